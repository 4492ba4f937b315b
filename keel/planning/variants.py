"""Kernel variants with typed metadata, and the choice of one per node.

Backends register several implementations of an op in their
:class:`~keel.backends.base.KernelTable` (``im2col``, ``winograd``, ...), each
with free-form metadata. :class:`VariantRegistry` is the typed view over those
tables: for every variant a :class:`VariantInfo` saying which backend, dtypes,
SIMD levels and shapes it serves, its priority, the measurement behind any
performance-based limit, and its callable.

:func:`choose_variant` picks the variant for one node from its input types
and attributes alone (a pure function: same inputs, same answer) and says
why in words, for a backend without a planner of its own. A backend's own
decisions (the cpu conv rules, the forms of its kernels) are made by its
planner (``Backend.plan_node``; ``keel/backends/<name>/planner.py``), which
placement asks for every node: this module imports no backend's modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.backends.base import Kernel, KernelTable, KernelVariant
from keel.backends.plan import (
    choose_by_priority,
    skipped_note,
    tier_unavailable,
    usable_variants,
)
from keel.dtypes import DType
from keel.errors import UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["VariantInfo", "VariantRegistry", "choose_variant", "tier_unavailable"]


@dataclass(frozen=True)
class VariantInfo:
    """One kernel variant and the facts a planner needs about it.

    Read from a :class:`KernelVariant` and these keys of its ``meta``:
    ``priority`` (int), ``simd`` (tuple of SIMD level names), ``shapes`` (str),
    ``measured`` (str), ``rule`` (a backend's rule object, e.g. the cpu's
``ConvRule``: anything with ``priority`` and ``scope()``), ``tier_rules`` (a
    mapping from a tier to the rule in force where that tier is available: the
    variant runs a faster form there, measured apart), ``dispatcher``
    (bool: the entry that picks among the others at run time) and
    ``requires`` (str: a tier the variant needs, e.g. ``"native"`` for the
    compiled kernels of :mod:`keel.native`; a variant whose tier is
    unavailable is never chosen, and the reason says why).
    """

    op: Op
    name: str
    backend: str
    fn: Kernel
    dtypes: frozenset[DType] | None        # None: any dtype
    supports_out: bool
    description: str
    priority: int = 0
    simd: tuple[str, ...] = ()             # SIMD levels it needs; () runs anywhere
    shapes: str = "any"                    # the shapes it serves, in words
    measured: str = ""                     # the measurement behind its limits
    rule: Any = None                       # the backend's rule object, if any
    tier_rules: tuple[tuple[str, Any], ...] = ()   # (tier, rule in force with it)
    dispatcher: bool = False               # picks among the others at run time
    requires: str | None = None            # a tier it needs ("native"), else None

    @classmethod
    def from_kernel(cls, backend: str, kv: KernelVariant) -> VariantInfo:
        """Read the typed facts out of a table entry's metadata."""
        meta = kv.meta
        rule: Any = meta.get("rule")
        return cls(
            op=kv.op, name=kv.name, backend=backend, fn=kv.fn, dtypes=kv.dtypes,
            supports_out=kv.supports_out, description=kv.description,
            priority=int(meta.get("priority", rule.priority if rule is not None else 0)),
            simd=tuple(meta.get("simd", ())),
            shapes=str(meta.get("shapes", rule.scope() if hasattr(rule, "scope") else "any")),
            measured=str(meta.get("measured", "")),
            rule=rule,
            tier_rules=tuple((str(t), r) for t, r in dict(meta.get("tier_rules", {})).items()
                             if r is not None),
            dispatcher=bool(meta.get("dispatcher", False)),
            requires=meta.get("requires") or None,
        )

    def serves_dtype(self, dtype: DType | None) -> bool:
        return dtype is None or self.dtypes is None or dtype in self.dtypes

    def active_rule(self) -> Any:
        """The rule in force here: a tier's own where that tier is available, else ``rule``."""
        for tier, rule in self.tier_rules:
            if tier_unavailable(tier) is None:
                return rule
        return self.rule

    def unavailable(self) -> str | None:
        """Why the tier this variant requires cannot run here; None when it can."""
        return tier_unavailable(self.requires)

    def serves_simd(self, level: str | None) -> bool:
        """Whether a CPU reporting SIMD ``level`` (e.g. "avx2") can run this variant."""
        return not self.simd or (level is not None and level in self.simd)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (no callable) for reports and JSON."""
        return {
            "op": self.op.value, "name": self.name, "backend": self.backend,
            "dtypes": None if self.dtypes is None else sorted(d.value for d in self.dtypes),
            "supports_out": self.supports_out, "description": self.description,
            "priority": self.priority, "simd": list(self.simd), "shapes": self.shapes,
            "measured": self.measured, "dispatcher": self.dispatcher,
            "requires": self.requires,
        }


class VariantRegistry:
    """A typed view over the variants in one or more kernel tables."""

    def __init__(self, tables: Iterable[KernelTable] = ()) -> None:
        self._tables: dict[str, KernelTable] = {}
        for table in tables:
            self.add_table(table)

    def add_table(self, table: KernelTable) -> None:
        """Add (or replace) the table of ``table.backend``."""
        self._tables[table.backend] = table

    def backends(self) -> tuple[str, ...]:
        return tuple(self._tables)

    def variants(self, op: Op, backend: str | None = None) -> list[VariantInfo]:
        """Every variant of ``op`` (on ``backend``, or on all), highest priority first."""
        found = [VariantInfo.from_kernel(name, kv)
                 for name, table in self._tables.items() if backend in (None, name)
                 for kv in table.variants(op).values()]
        return sorted(found, key=lambda v: (v.backend, -v.priority, v.name))

    def get(self, op: Op, name: str, backend: str) -> VariantInfo:
        """One variant; an unknown one is an ``UnsupportedOperationError`` listing the rest."""
        table = self._table(op, backend)
        return VariantInfo.from_kernel(backend, table.get(op, name))

    def callable(self, op: Op, name: str, backend: str) -> Kernel:
        return self.get(op, name, backend).fn

    def choose(self, op: Op, input_types: Sequence[TensorType | None],
               attrs: Mapping[str, Any], backend: str) -> tuple[str, str]:
        """:func:`choose_variant` on ``backend``'s table."""
        return choose_variant(op, input_types, attrs, self._table(op, backend))

    def to_dict(self) -> dict[str, list[dict[str, Any]]]:
        """{backend: [variant facts, ...]} for every op with more than one variant."""
        report: dict[str, list[dict[str, Any]]] = {}
        for name, table in self._tables.items():
            rows = [VariantInfo.from_kernel(name, kv).to_dict()
                    for op in sorted(table.ops(), key=lambda o: o.value)
                    if len(table.variants(op)) > 1
                    for kv in table.variants(op).values()]
            report[name] = rows
        return report

    def _table(self, op: Op, backend: str) -> KernelTable:
        table = self._tables.get(backend)
        if table is None:
            raise UnsupportedOperationError(
                op.value, backend, supported_on=self._tables,
                detail=f"no kernel table for backend {backend!r} in this registry")
        return table


def choose_variant(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                   table: KernelTable) -> tuple[str, str]:
    """The variant of ``op`` to run from ``table`` for these inputs, and why.

    The table's backend planner decides where it has one (``table.chooser``:
    the cpu conv rules, ...); else the highest-priority variant serving the
    first input's dtype, skipping variants whose tier (the native kernels)
    cannot run here. Same inputs, same answer. ``Backend.plan_node`` gives a
    node's whole plan (layout, threads, ...), not only its variant.
    """
    if table.chooser is not None:
        return table.chooser(op, input_types, attrs, table)
    variants, skipped = usable_variants(op, table)
    dtype = input_types[0].dtype if input_types and input_types[0] is not None else None
    name, why = choose_by_priority(op, variants, dtype, table.backend)
    return name, why + skipped_note(skipped)
