"""The plan's records: what :func:`~keel.planning.placement.place` decides, as data.

An :class:`ExecutionPlan` holds each node's :class:`NodePlacement`, the
:class:`DeviceCopy` steps between devices and the memory plan's summary;
:func:`lower_steps` turns placements and copies into the memory plan's steps.
A model whose plan comes from the compiled-plan cache reads these back and
never imports placement itself (its selection, tuning and kernel variants).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keel.backends.plan import FIELDS
from keel.config import format_bytes
from keel.dtypes import DType
from keel.errors import KeelError
from keel.graph.memory_plan import PlanStep
from keel.ops.schema import get_schema

if TYPE_CHECKING:
    from keel.backends.plan import NodePlan
    from keel.graph.ir import Graph, Node
    from keel.graph.memory_plan import MemoryPlan
    from keel.planning.interop import Region

__all__ = ["HOST", "DeviceCopy", "ExecutionPlan", "NodePlacement", "lower_steps",
           "precision_name", "scratch_bytes"]

HOST = "cpu"      # graph inputs arrive, and outputs leave, as host (NumPy) arrays

_PRECISIONS = {
    DType.FLOAT16: "fp16", DType.BFLOAT16: "bf16", DType.FLOAT32: "fp32", DType.FLOAT64: "fp64",
    DType.INT8: "int8", DType.UINT8: "int8", DType.INT16: "int16", DType.UINT16: "int16",
}


def precision_name(dtype: DType | None) -> str:
    """The precision a node computes in: fp16/bf16/fp32/fp64/int8/int16, else the dtype name."""
    if dtype is None:
        return "unknown"
    return _PRECISIONS.get(dtype, dtype.value)


@dataclass(frozen=True, slots=True)
class NodePlacement:
    """Where and how one node runs, and why."""

    name: str
    op: str
    backend: str
    variant: str
    precision: str
    reasons: tuple[str, ...]
    device: str = HOST
    writes_out: bool = True        # the kernel writes into planned buffers
    plan: NodePlan | None = None   # the backend planner's decisions, the kernel's input

    @property
    def layout(self) -> str:
        return "" if self.plan is None else self.plan.layout

    @property
    def threads(self) -> int | None:
        return None if self.plan is None else self.plan.threads

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "op": self.op, "backend": self.backend,
                "variant": self.variant, "precision": self.precision, "device": self.device,
                "reasons": list(self.reasons),
                "plan": None if self.plan is None else self.plan.to_dict()}


@dataclass(frozen=True)
class DeviceCopy:
    """A value copied between devices before ``before`` runs (``""``: after the last node)."""

    value: str
    target: str            # the name the copy has on the destination device
    src: str
    dst: str
    before: str
    nbytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "from": self.src, "to": self.dst, "before": self.before,
                "nbytes": self.nbytes}


@dataclass(frozen=True)
class ExecutionPlan:
    """Per-node placement, device copies and the memory plan of one input signature."""

    model: str
    backend: str                        # what the caller asked for
    precision: str
    nodes: tuple[NodePlacement, ...]
    copies: tuple[DeviceCopy, ...]
    memory: Mapping[str, Any]           # the memory plan's summary
    peak_bytes: int
    chunk_size_hint: int | None = None
    reasons: tuple[str, ...] = ()
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    memory_plan: MemoryPlan | None = field(default=None, compare=False, repr=False)
    # The plans of control-flow nodes' subgraphs, by "node/attribute" (If's branches,
    # a loop body), each for the types its first run takes.
    subplans: Mapping[str, ExecutionPlan] = field(default_factory=dict, compare=False,
                                                  repr=False)
    # Runs of independent branches, each with whether they run at once and why.
    regions: tuple[Region, ...] = ()

    def node(self, name: str) -> NodePlacement:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeelError(f"no node named {name!r} in the plan of {self.model!r}")

    @property
    def backends(self) -> dict[str, int]:
        """Node count per backend."""
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.backend] = counts.get(n.backend, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "backend": self.backend,
            "precision": self.precision,
            "input_shapes": {k: list(v) for k, v in self.input_shapes.items()},
            "backends": self.backends,
            "nodes": [n.to_dict() for n in self.nodes],
            "copies": [c.to_dict() for c in self.copies],
            "copy_count": len(self.copies),
            "memory": _plain(dict(self.memory)),
            "peak_bytes": self.peak_bytes,
            "chunk_size_hint": self.chunk_size_hint,
            "reasons": list(self.reasons),
            **({"regions": [r.to_dict() for r in self.regions]} if self.regions else {}),
            **({"subgraphs": {k: p.to_dict() for k, p in self.subplans.items()}}
               if self.subplans else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_yaml(self) -> str:
        import yaml  # lazily: 1.3 MB a model load never needs

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def table(self, width: int | None = None) -> str:
        """A fixed-width text table: one row per node (name, op, backend, variant, layout,
        threads, precision) with its reason wrapped under the row, then copies, memory and
        reasons. ``width`` defaults to the terminal's (``COLUMNS``), at least 60."""
        import shutil
        import textwrap

        width = max(width or shutil.get_terminal_size((100, 24)).columns, 60)
        header = ("node", "op", "backend", "variant", "layout", "threads", "precision")
        caps = (28, 18, 10, 14, 10, 7, 9)
        rows = [(n.name, n.op, n.backend, n.variant, n.layout or "-",
                 "-" if n.threads is None else str(n.threads), n.precision) for n in self.nodes]
        widths = [min(max([len(h)] + [len(r[i]) for r in rows]), cap)
                  for i, (h, cap) in enumerate(zip(header, caps, strict=True))]

        def cell(text: str, w: int) -> str:
            return (text if len(text) <= w else text[:w - 1] + "…").ljust(w)

        lines = ["  ".join(cell(h, w) for h, w in zip(header, widths, strict=True)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        for node, row in zip(self.nodes, rows, strict=True):
            lines.append("  ".join(cell(c, w) for c, w in zip(row, widths, strict=True)).rstrip())
            if node.reasons:
                lines += textwrap.wrap(node.reasons[0], width - 1, initial_indent="    why: ",
                                       subsequent_indent="         ")
        lines.append("")
        lines.append(f"device copies: {len(self.copies)}")
        lines += [f"  {c.value}: {c.src} -> {c.dst} before {c.before or 'output'}"
                  for c in self.copies]
        if not any(r.startswith("peak memory") for r in self.reasons):
            lines.append(f"peak memory: {format_bytes(self.peak_bytes)} "
                         f"({self.peak_bytes} bytes)")
        if self.chunk_size_hint is not None:
            lines.append(f"chunk size hint: {self.chunk_size_hint}")
        lines += [f"- {r}" for r in self.reasons]     # whole lines: searched, copied
        for path, sub in self.subplans.items():
            lines += ["", f"subgraph {path}:"]
            lines += [f"    {line}" if line else "" for line in sub.table(width).splitlines()]
        return "\n".join(lines)

    def node_plans(self) -> str:
        """Every node plan's fields, one line each with its value and its reason."""
        lines = []
        for n in self.nodes:
            if n.plan is None:
                continue
            lines.append(f"{n.name} ({n.op} on {n.backend}):")
            data = n.plan.to_dict()
            for name in FIELDS:
                value = data[name]
                shown = "-" if value in (None, "") else str(value)
                lines.append(f"  {name}: {shown} ({n.plan.reason(name) or 'no reason given'})")
            lines += [f"  {k}: {v}" + (f" ({why})" if (why := n.plan.reason(k)) else "")
                      for k, v in data["options"].items()]
        for path, sub in self.subplans.items():
            lines.append(f"subgraph {path}:")
            lines += [f"    {line}" for line in sub.node_plans().splitlines()]
        return "\n".join(lines)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value



def scratch_bytes(placements: Sequence[NodePlacement]) -> int:
    """The kernels' scratch beyond the arena (im2col columns, Winograd's transformed
    tiles, padded copies): the largest any node's plan estimates, which the kernel holds
    while it runs (kernels reuse their scratch buffers from node to node)."""
    sizes = {p.plan.workspace_bytes for p in placements
             if p.plan is not None and p.plan.workspace_bytes}
    return max(sizes, default=0)


def lower_steps(graph: Graph, placements: Sequence[NodePlacement],
                copies: Sequence[DeviceCopy]) -> list[PlanStep]:
    """The program's steps in order: copies before the node that needs them, then nodes."""
    steps: list[PlanStep] = []
    renamed: dict[tuple[str, str], str] = {}
    for node, placed in zip(graph.nodes, placements, strict=True):
        for c in copies:
            if c.before == node.name:
                steps.append(PlanStep(f"copy:{c.target}", (c.value,), (c.target,), c.dst,
                                      writes_out=False, may_alias=False))
                renamed[(c.value, c.dst)] = c.target
        inputs = tuple(renamed.get((i, placed.device), i) if i else "" for i in node.inputs)
        steps.append(PlanStep(node.name, inputs, tuple(node.outputs), placed.device,
                              _inplace(node), placed.writes_out))
    return steps


def _inplace(node: Node) -> tuple[tuple[int, int], ...]:
    try:
        return tuple(get_schema(node.op).inplace)
    except KeelError:
        return ()
