"""Kernel variants with typed metadata, and the choice of one per node.

Backends register several implementations of an op in their
:class:`~keel.backends.base.KernelTable` (``im2col``, ``winograd``, ...), each
with free-form metadata. :class:`VariantRegistry` is the typed view over those
tables: for every variant a :class:`VariantInfo` saying which backend, dtypes,
SIMD levels and shapes it serves, its priority, the measurement behind any
performance-based limit, and its callable.

:func:`choose_variant` picks the variant for one node from its input types
and attributes alone (a pure function: same inputs, same answer) and says
why in words. Conv-family ops are decided by the variants'
:class:`~keel.backends.cpu.conv_rules.ConvRule` metadata, the same rules the
``default`` conv kernel applies at run time, so a plan and a plain run agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.backends.base import Kernel, KernelTable, KernelVariant
from keel.backends.cpu.conv_rules import ConvCase, ConvRule, conv_case, pick
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, KeelError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["VariantInfo", "VariantRegistry", "choose_variant", "tier_unavailable"]

_CONV_OPS = frozenset({Op.CONV, Op.CONV2D, Op.CONV_INTEGER})


@dataclass(frozen=True)
class VariantInfo:
    """One kernel variant and the facts a planner needs about it.

    Read from a :class:`KernelVariant` and these keys of its ``meta``:
    ``priority`` (int), ``simd`` (tuple of SIMD level names), ``shapes`` (str),
    ``measured`` (str), ``rule`` (a :class:`ConvRule`), ``tier_rules`` (a
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
    rule: ConvRule | None = None
    tier_rules: tuple[tuple[str, ConvRule], ...] = ()   # (tier, rule in force with it)
    dispatcher: bool = False               # picks among the others at run time
    requires: str | None = None            # a tier it needs ("native"), else None

    @classmethod
    def from_kernel(cls, backend: str, kv: KernelVariant) -> VariantInfo:
        """Read the typed facts out of a table entry's metadata."""
        meta = kv.meta
        rule = meta.get("rule")
        return cls(
            op=kv.op, name=kv.name, backend=backend, fn=kv.fn, dtypes=kv.dtypes,
            supports_out=kv.supports_out, description=kv.description,
            priority=int(meta.get("priority", rule.priority if rule is not None else 0)),
            simd=tuple(meta.get("simd", ())),
            shapes=str(meta.get("shapes", rule.scope() if isinstance(rule, ConvRule) else "any")),
            measured=str(meta.get("measured", "")),
            rule=rule if isinstance(rule, ConvRule) else None,
            tier_rules=tuple((str(t), r) for t, r in dict(meta.get("tier_rules", {})).items()
                             if isinstance(r, ConvRule)),
            dispatcher=bool(meta.get("dispatcher", False)),
            requires=meta.get("requires") or None,
        )

    def serves_dtype(self, dtype: DType | None) -> bool:
        return dtype is None or self.dtypes is None or dtype in self.dtypes

    def active_rule(self) -> ConvRule | None:
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


def tier_unavailable(tier: str | None) -> str | None:
    """Why kernels of ``tier`` (``"native"``, ...) cannot run here; None when they can."""
    if tier is None:
        return None
    if tier == "native":
        from keel import native

        if native.available():
            return None
        return f"native kernels unavailable: {native.status().reason}"
    return f"unknown kernel tier {tier!r}"


def choose_variant(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                   table: KernelTable) -> tuple[str, str]:
    """The variant of ``op`` to run from ``table`` for these inputs, and why.

    Depends only on the op, the input types (shapes, dtypes), the attributes,
    the variants ``table`` offers and whether the tiers they require (the
    native kernels) can run on this machine: same inputs, same answer. Falls
    back to ``default`` (which decides at run time) when the shapes are not
    known.
    """
    variants = {name: VariantInfo.from_kernel(table.backend, kv)
                for name, kv in table.variants(op).items()}
    skipped = {name: why for name, v in variants.items()
               if name != "default" and (why := v.unavailable()) is not None}
    variants = {name: v for name, v in variants.items() if name not in skipped}
    if "default" not in variants:
        raise UnsupportedOperationError(op.value, table.backend,
                                        detail="no default kernel to fall back to")
    dtype = input_types[0].dtype if input_types and input_types[0] is not None else None
    name, why = _choose(op, input_types, attrs, table, variants, dtype)
    if skipped:
        why += "; not considered: " + "; ".join(f"{n} ({w})" for n, w in sorted(skipped.items()))
    return name, why


def _choose(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
            table: KernelTable, variants: Mapping[str, VariantInfo],
            dtype: DType | None) -> tuple[str, str]:
    if len(variants) == 1:
        only = variants["default"]
        conv = {name: info for name, kv in table.variants(Op.CONV).items()
                if (info := VariantInfo.from_kernel(table.backend, kv)).unavailable() is None}
        if op in _CONV_OPS and only.dispatcher and len(conv) > 1:
            _, why = _choose_conv(op, input_types, attrs, conv, dtype)
            return "default", f"dispatches through the conv variants at run time: {why}"
        return "default", f"{op.value}: the only {table.backend} kernel"
    if op in _CONV_OPS:
        return _choose_conv(op, input_types, attrs, variants, dtype)
    return _choose_by_priority(op, variants, dtype)


def _choose_conv(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                 variants: Mapping[str, VariantInfo], dtype: DType | None) -> tuple[str, str]:
    case = _conv_case(op, input_types, attrs, dtype)
    if case is None:
        return "default", "input shapes not known before running: the default kernel picks"
    found = [v.active_rule() for v in variants.values()
             if not v.dispatcher and v.serves_dtype(dtype)]
    rules = [r for r in found if r is not None]
    if not rules:
        return "default", f"{op.value}: no variant carries conv rules; default dispatches"
    try:
        return pick(case, rules)
    except LookupError as exc:
        return "default", str(exc)


def _conv_case(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
               dtype: DType | None) -> ConvCase | None:
    if len(input_types) < 2 or any(t is None or t.shape is None for t in input_types[:2]):
        return None
    x, w = input_types[0], input_types[1]
    assert x is not None and w is not None and x.shape is not None and w.shape is not None
    try:
        return conv_case(op, x.shape, w.shape, attrs, dtype.value if dtype else "float32")
    except (InvalidArgumentError, KeelError):
        return None


def _choose_by_priority(op: Op, variants: Mapping[str, VariantInfo],
                        dtype: DType | None) -> tuple[str, str]:
    usable = [v for v in variants.values() if not v.dispatcher and v.serves_dtype(dtype)]
    if not usable:
        return "default", f"{op.value}: no specialised variant takes {dtype}; default"
    best = max(usable, key=lambda v: (v.priority, v.name == "default"))
    return best.name, f"{op.value}: {best.name} has the highest priority ({best.priority})"
