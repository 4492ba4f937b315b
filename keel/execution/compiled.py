"""A compiled model as plain data: what a plan-cache entry holds besides its graph.

A :class:`CompiledModel` is a graph already optimized for some load options,
the model's declared inputs and outputs and the plan of its first input
signature. :func:`to_json` turns all but the graph into JSON;
:func:`from_json` reads it back against the graph, recomputing the memory
plan, and raises :class:`EntryError` when anything does not fit (a field this
keel does not have, a plan for other nodes, another peak).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from keel.backends.plan import NodePlan
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.graph.ir import Graph, Value
from keel.ops.types import TensorType
from keel.planning.plans import (
    DeviceCopy,
    ExecutionPlan,
    NodePlacement,
    lower_steps,
    scratch_bytes,
)

if TYPE_CHECKING:
    from keel.planning.interop import Region

__all__ = ["CompiledModel", "EntryError", "from_json", "to_json"]

# The ExecutionPlan fields an entry stores or recomputes; a plan with others is not stored.
_PLAN_FIELDS = frozenset({"model", "backend", "precision", "nodes", "copies", "memory",
                          "peak_bytes", "chunk_size_hint", "reasons", "input_shapes",
                          "memory_plan", "subplans", "regions"})
_T = TypeVar("_T")


class EntryError(ValueError):
    """A compiled model that cannot be written as JSON, or JSON that does not read back."""


@dataclass(frozen=True)
class CompiledModel:
    """What an entry holds: a model optimized for some options, planned for one signature.

    ``types`` are the value types of that signature (``shapes``: the model's
    declared inputs, symbolic dimensions as 1; ``symbolic``: planned without
    sizes), ``plan`` its plan, memory plan included.
    """

    graph: Graph
    input_names: tuple[str, ...]
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    shapes: Mapping[str, tuple[int, ...]]
    symbolic: bool
    plan: ExecutionPlan
    types: Mapping[str, TensorType | None] = dataclasses.field(default_factory=dict)


def to_json(compiled: CompiledModel) -> dict[str, Any]:
    """The entry's JSON: interface, signature and plan (the memory plan is recomputed)."""
    plan = compiled.plan
    extra = {f.name for f in dataclasses.fields(plan)} - _PLAN_FIELDS
    if extra:
        raise EntryError(f"the plan has fields the cache cannot store ({', '.join(sorted(extra))})")
    if plan.subplans:
        raise EntryError("the plan has subgraph plans, which the cache does not store")
    return {
        "name": plan.model or compiled.graph.name,
        "input_names": list(compiled.input_names),
        "inputs": [_value_json(v) for v in compiled.inputs],
        "outputs": [_value_json(v) for v in compiled.outputs],
        "signature": {"symbolic": compiled.symbolic,
                      "shapes": {k: list(s) for k, s in compiled.shapes.items()}},
        "plan": {"model": plan.model, "backend": plan.backend, "precision": plan.precision,
                 "nodes": [_node_json(n) for n in plan.nodes],
                 "copies": [_fields(c) for c in plan.copies],
                 "peak_bytes": plan.peak_bytes,
                 "prepacked_bytes": int(plan.memory.get("prepacked_bytes", 0)),
                 "chunk_size_hint": plan.chunk_size_hint,
                 "reasons": list(plan.reasons),
                 "input_shapes": {k: list(v) for k, v in plan.input_shapes.items()},
                 "regions": [r.to_dict() for r in plan.regions]},
    }


def from_json(graph: Graph, meta: dict[str, Any]) -> CompiledModel:
    """The compiled model :func:`to_json` described, over ``graph`` (its weights included).

    Malformed JSON raises ``KeyError``/``TypeError``/``ValueError``; JSON that
    does not fit ``graph`` or this keel's plan raises :class:`EntryError`.
    """
    from keel.graph.memory_plan import plan_steps_for_graph
    from keel.graph.shape_inference import infer_graph_types

    sig = meta["signature"]
    shapes = {str(k): tuple(int(d) for d in s) for k, s in sig["shapes"].items()}
    symbolic = bool(sig["symbolic"])
    internal = {k: v for k, v in shapes.items() if k in graph.input_names}
    types = infer_graph_types(graph, {} if symbolic else internal)
    p = meta["plan"]
    nodes = tuple(_node_from_json(d) for d in p["nodes"])
    copies = tuple(_build(DeviceCopy, d) for d in p["copies"])
    if len(nodes) != len(graph.nodes) or any(
            n.name != g.name for n, g in zip(nodes, graph.nodes, strict=True)):
        raise EntryError("its plan does not match its graph")
    regions: tuple[Region, ...] = ()
    concurrent: tuple[tuple[int, int], ...] = ()
    if p.get("regions"):                # interop's module only for a plan with regions
        from keel.planning.interop import Region, spans

        regions = tuple(Region.from_dict(r) for r in p["regions"])
        concurrent = spans(regions)
    memory = plan_steps_for_graph(graph, types, lower_steps(graph, nodes, copies),
                                  concurrent=concurrent)
    # The kernels' packed weights were estimated at placement, from the registry's kernels.
    memory = dataclasses.replace(memory, prepacked_bytes=int(p["prepacked_bytes"]),
                                 workspace_bytes=scratch_bytes(nodes))
    if memory.peak_bytes != p["peak_bytes"]:
        raise EntryError("its memory plan does not match the stored one")
    plan = ExecutionPlan(
        model=str(p["model"]), backend=str(p["backend"]), precision=str(p["precision"]),
        nodes=nodes, copies=copies, memory=memory.summary(), peak_bytes=memory.peak_bytes,
        chunk_size_hint=p["chunk_size_hint"], reasons=tuple(str(r) for r in p["reasons"]),
        input_shapes={str(k): tuple(int(d) for d in v) for k, v in p["input_shapes"].items()},
        memory_plan=memory, regions=regions)
    return CompiledModel(graph, tuple(str(n) for n in meta["input_names"]),
                         tuple(_value_from_json(v) for v in meta["inputs"]),
                         tuple(_value_from_json(v) for v in meta["outputs"]),
                         shapes, symbolic, plan, types)


def _node_json(node: NodePlacement) -> dict[str, Any]:
    """A node's placement as JSON, its backend's node plan as that plan's own dict."""
    flat = dataclasses.replace(node, plan=None)
    data = _fields(flat)
    data["plan"] = None if node.plan is None else node.plan.to_dict()
    return data


def _node_from_json(data: Any) -> NodePlacement:
    if not isinstance(data, dict):
        raise EntryError("its NodePlacement entries do not match this keel's")
    stored = data.get("plan")
    node = _build(NodePlacement, {**data, "plan": None})
    try:
        plan = None if stored is None else NodePlan.from_dict(stored)
    except (InvalidArgumentError, TypeError, ValueError) as exc:
        raise EntryError(f"its node plans do not read back ({exc})") from None
    if plan is not None and plan.to_dict() != stored:
        raise EntryError("its node plans do not read back")
    return dataclasses.replace(node, plan=plan)


def _fields(obj: Any) -> dict[str, Any]:
    """A flat frozen dataclass as JSON; a field that is not plain data cannot be stored."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, tuple):
            value = list(value)
        items = value if isinstance(value, list) else [value]
        if not all(v is None or isinstance(v, (str, int, float, bool)) for v in items):
            raise EntryError(f"{type(obj).__name__}.{f.name} is not plain data")
        out[f.name] = value
    return out


def _build(cls: type[_T], data: Any) -> _T:
    """``cls`` from :func:`_fields`'s JSON, checked to hold exactly its fields."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if not isinstance(data, dict) or set(data) != names:
        raise EntryError(f"its {cls.__name__} entries do not match this keel's")
    obj = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    if _fields(obj) != data:
        raise EntryError(f"its {cls.__name__} entries do not read back")
    return obj


def _value_json(v: Value) -> dict[str, Any]:
    shape = None if v.type.shape is None else list(v.type.shape)
    return {"name": v.name, "dtype": v.type.dtype.value, "shape": shape}


def _value_from_json(d: Any) -> Value:
    shape: Sequence[Any] | None = d["shape"]
    if shape is not None and not all(x is None or isinstance(x, (int, str)) for x in shape):
        raise EntryError("its interface has a bad shape")
    return Value(str(d["name"]), TensorType(DType(d["dtype"]),
                                            None if shape is None else tuple(shape)))
