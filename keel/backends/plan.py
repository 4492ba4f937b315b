"""What a backend's planner decides for one node: :class:`NodePlan`.

A planner (``Backend.plan_node``, one module per backend: ``cpu/planner.py``,
``gpu/planner.py``) looks at a node's op, input types, attributes and the
planning context (:class:`PlanRequest`) and returns a frozen
:class:`NodePlan`: the kernel variant, its layout or form, threads, BLAS
threads, chunking, workspace and precision, each with the reason it was
chosen. Placement stores it; the executor hands it to the kernel as
``ctx.plan``; the kernel executes it and decides nothing again.

A backend without a planner of its own gets :func:`choose_by_priority`: the
highest-priority variant its table offers for the dtype, skipping variants
whose tier (``requires="native"``) cannot run here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.types import TensorType

if TYPE_CHECKING:
    from keel.backends.base import KernelTable, KernelVariant

__all__ = ["FIELDS", "LayoutDecision", "Measured", "field_reasons", "NodePlan", "PlanRequest",
           "choose_by_priority", "tier_unavailable"]

# The decided fields of a node plan, in the order reports show them.
FIELDS = ("variant", "layout", "threads", "blas_threads", "chunk", "workspace_bytes",
          "precision")


@dataclass(frozen=True)
class Measured:
    """A choice measured on this machine (a tuning cache hit): it overrides the rules."""

    variant: str
    reason: str                      # e.g. "measured on this machine: X 1.31x faster than Y"
    layout: str = ""


@dataclass(frozen=True)
class PlanRequest:
    """What a planner decides from: the node and the planning context."""

    op: Op
    input_types: tuple[TensorType | None, ...]
    attrs: Mapping[str, Any]
    threads: int | None = None       # the thread count the backend runs with
    profile: Any = None              # the HardwareProfile planned for (None: this machine)
    precision: str = ""              # the precision placement decided ("" when unknown)
    measured: Measured | None = None  # a tuning override (keel.planning.tuning), if any
    low_memory: str = ""             # why the machine is planned in low-memory mode ("": not)
    # Which inputs are constants of the graph (a weight), one flag an input; None: not said.
    constants: tuple[bool, ...] | None = None

    def constant(self, index: int) -> bool:
        """Whether input ``index`` is a constant of the graph (True where not said)."""
        return self.constants is None or (index < len(self.constants)
                                          and self.constants[index])

    @property
    def dtype(self) -> DType | None:
        first = self.input_types[0] if self.input_types else None
        return None if first is None else first.dtype

    def static_shapes(self) -> tuple[tuple[int, ...] | None, ...] | None:
        """Every present input's shape as ints; None when any is not known."""
        shapes: list[tuple[int, ...] | None] = []
        for t in self.input_types:
            if t is None:
                shapes.append(None)
            elif t.shape is None or not t.is_static:
                return None
            else:
                shapes.append(tuple(int(d) for d in t.shape))  # type: ignore[arg-type]
        return tuple(shapes)


@dataclass(frozen=True)
class LayoutDecision:
    """A node's layout decided over the whole graph (``Backend.plan_layouts``): the layout
    (None: the node plan's own stands, only options or fields decided), why, the threads
    reason of the kernel that runs in it ("": its plan's stands), options for its plan
    as (name, value, reason), and other fields of its plan the layout changes as (field,
    value, reason): a different kernel's scratch, say."""

    layout: str | None      # None: the node plan's own layout stands
    reason: str
    threads_reason: str = ""
    options: tuple[tuple[str, Any, str], ...] = ()
    fields: tuple[tuple[str, Any, str], ...] = ()


@dataclass(frozen=True)
class NodePlan:
    """How one node runs on its backend, every field with the reason it was chosen.

    ``layout`` is the variant's form ("" when it has one form or decides it
    from shapes known only at run time); ``threads`` the threads its kernel
    uses; ``blas_threads`` the BLAS threads (None: sized per program, see the
    program scope); ``chunk`` images per chunk (None: whole batch);
    ``workspace_bytes`` scratch beyond the arena (None: not estimated);
    ``options`` kernel-specific decisions as (name, value) pairs.
    """

    variant: str
    layout: str = ""
    threads: int | None = None
    blas_threads: int | None = None
    chunk: int | None = None
    workspace_bytes: int | None = None
    precision: str = ""
    options: tuple[tuple[str, Any], ...] = ()
    reasons: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def reason(self, name: str) -> str:
        """The reason recorded for field ``name`` ("" when none)."""
        return next((why for f, why in self.reasons if f == name), "")

    def with_option(self, name: str, value: Any, reason: str) -> NodePlan:
        """This plan with option ``name`` set to ``value`` for ``reason``."""
        options = (*((k, v) for k, v in self.options if k != name), (name, value))
        reasons = (*((f, why) for f, why in self.reasons if f != name), (name, reason))
        return dataclasses.replace(self, options=options, reasons=reasons)

    def with_field(self, name: str, value: Any, reason: str) -> NodePlan:
        """This plan with field ``name`` set to ``value`` for ``reason``."""
        if name not in FIELDS:
            raise InvalidArgumentError(f"a node plan has no field {name!r}; its fields are "
                                       f"{', '.join(FIELDS)}")
        reasons = (*((f, why) for f, why in self.reasons if f != name), (name, reason))
        return dataclasses.replace(self, **{name: value}, reasons=reasons)

    def option(self, name: str, default: Any = None) -> Any:
        return next((v for k, v in self.options if k == name), default)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: every field, its value and its reason."""
        data: dict[str, Any] = {f: getattr(self, f) for f in FIELDS}
        data["options"] = {k: _plain(v) for k, v in self.options}
        data["reasons"] = dict(self.reasons)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodePlan:
        """The plan :meth:`to_dict` described (lists read back as tuples)."""
        if not isinstance(data, Mapping) or set(data) != {*FIELDS, "options", "reasons"}:
            raise InvalidArgumentError(
                f"a node plan needs exactly the fields {', '.join(FIELDS)}, options and "
                f"reasons; got {sorted(data) if isinstance(data, Mapping) else data!r}")
        options = tuple((str(k), tuple(v) if isinstance(v, list) else v)
                        for k, v in dict(data["options"]).items())
        reasons = tuple((str(k), str(v)) for k, v in dict(data["reasons"]).items())
        return cls(**{f: data[f] for f in FIELDS}, options=options, reasons=reasons)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


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


def usable_variants(op: Op, table: KernelTable) -> tuple[dict[str, KernelVariant],
                                                         dict[str, str]]:
    """``op``'s variants whose tier runs here, and why each other one does not."""
    found = table.variants(op)
    skipped = {name: why for name, kv in found.items()
               if name != "default" and (why := tier_unavailable(kv.meta.get("requires")))}
    usable = {n: kv for n, kv in found.items() if n not in skipped}
    if "default" not in usable:
        raise UnsupportedOperationError(op.value, table.backend,
                                        detail="no default kernel to fall back to")
    return usable, skipped


def skipped_note(skipped: Mapping[str, str]) -> str:
    """The reason suffix naming the variants not considered, and why."""
    if not skipped:
        return ""
    return "; not considered: " + "; ".join(f"{n} ({w})" for n, w in sorted(skipped.items()))


def priority(kv: KernelVariant) -> int:
    rule = kv.meta.get("rule")
    return int(kv.meta.get("priority", getattr(rule, "priority", 0)))


def choose_by_priority(op: Op, variants: Mapping[str, KernelVariant], dtype: DType | None,
                       backend: str) -> tuple[str, str]:
    """The highest-priority non-dispatching variant serving ``dtype``, and why."""
    if len(variants) == 1:
        return "default", f"{op.value}: the only {backend} kernel"
    usable = [kv for kv in variants.values() if not kv.meta.get("dispatcher")
              and (dtype is None or kv.dtypes is None or dtype in kv.dtypes)]
    if not usable:
        return "default", f"{op.value}: no specialised variant takes {dtype}; default"
    best = max(usable, key=lambda v: (priority(v), v.name == "default"))
    return best.name, f"{op.value}: {best.name} has the highest priority ({priority(best)})"


def default_plan(request: PlanRequest, table: KernelTable, threads: int | None
                 ) -> NodePlan:
    """The plan of a backend without a planner: the priority choice, nothing else decided."""
    usable, skipped = usable_variants(request.op, table)
    if request.measured is not None and request.measured.variant in usable:
        name, why = request.measured.variant, request.measured.reason
    elif table.chooser is not None:
        name, why = table.chooser(request.op, request.input_types, request.attrs, table)
        skipped = {}                              # the chooser's reason names them
    else:
        name, why = choose_by_priority(request.op, usable, request.dtype, table.backend)
    return NodePlan(variant=name, threads=threads, precision=request.precision,
                    reasons=field_reasons(variant=why + skipped_note(skipped),
                                          blas_threads="not decided per node"))


_DEFAULT_REASONS = {
    "layout": "the variant's only form",
    "threads": "the backend's thread count",
    "blas_threads": "sized once per program from its steps' work (the cpu planner's "
                    "plan_program; explain() shows its decision)",
    "chunk": "whole batch",
    "workspace_bytes": "not estimated",
    "precision": "the model's own",
}


def field_reasons(**reasons: str) -> tuple[tuple[str, str], ...]:
    """A reason for every field of a node plan: those given, the usual ones for the rest."""
    merged = {**_DEFAULT_REASONS, **reasons}
    return tuple((f, merged[f]) for f in FIELDS)


def request_types(inputs: Sequence[Any]) -> tuple[TensorType | None, ...]:
    """The input types of arrays (for a plan made at call time from the real shapes)."""
    from keel.backends.base import dtype_of

    return tuple(None if x is None else TensorType(dtype_of(x), tuple(x.shape))
                 for x in inputs)
