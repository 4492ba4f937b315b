"""Graph-level type and shape inference.

Walks the nodes in order and asks each op's schema for its output types
(``OpSchema.infer``), handing it the *values* of inputs that are known before
running: initializers, and small results computable from them or from static
shapes (``Shape`` of a tensor whose shape is known, ``Gather`` of that, ...).
Those values are what lets ``Reshape(x, Concat(Shape(x)[0], -1))`` get a static
output shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, KeelError, UnsupportedOperationError
from keel.graph.ir import Graph, Node
from keel.ops.registry import Op, OpGroup
from keel.ops.schema import get_schema
from keel.ops.types import TensorType

__all__ = [
    "Propagation",
    "evaluate_node",
    "infer_graph_types",
    "infer_node",
    "propagate",
    "propagate_node",
]

# Largest constant (in elements) that inference computes to learn shapes; bigger
# results stay unknown values (their types are still inferred).
VALUE_LIMIT = 1 << 16
# Values are computed only for cheap ops (work linear in the output): shape
# arithmetic needs nothing else, and a hostile model cannot make loading slow.
_NOT_PROPAGATED = (OpGroup.MATMUL_LIKE | OpGroup.CONVOLUTION | OpGroup.POOLING
                   | OpGroup.NORMALIZATION | OpGroup.QUANTIZATION)


@dataclass
class Propagation:
    """What is known about every value before running: its type and maybe its value."""

    types: dict[str, TensorType | None] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)


def infer_graph_types(
    graph: Graph, input_shapes: Mapping[str, Sequence[int | str | None]] | None = None
) -> dict[str, TensorType | None]:
    """The type of every value in ``graph`` (None where it cannot be known).

    ``input_shapes`` overrides the declared shapes of graph inputs (for example
    a concrete batch size); a shape that contradicts the declaration raises
    ``InvalidArgumentError`` naming the input, and so does a node whose inputs
    its schema rejects (naming the node).
    """
    return propagate(graph, input_shapes).types


def propagate(
    graph: Graph,
    input_shapes: Mapping[str, Sequence[int | str | None]] | None = None,
    value_limit: int = VALUE_LIMIT,
) -> Propagation:
    """Types of every value and the values of small constants, node by node."""
    state = Propagation()
    for name, arr in graph.initializers.items():
        state.types[name] = _type_of_array(arr)
        if graph.is_constant(name) and arr.size <= value_limit:
            state.values[name] = arr
    for v in graph.inputs:
        state.types[v.name] = _input_type(v.name, v.type, (input_shapes or {}).get(v.name))
    for name in input_shapes or {}:
        if name not in state.types or name not in graph.input_names:
            raise InvalidArgumentError(
                f"input_shapes names {name!r}, which is not a graph input; "
                f"inputs: {', '.join(graph.input_names) or 'none'}"
            )
    for node in graph.nodes:
        propagate_node(node, state, graph.value_types, value_limit)
    return state


def propagate_node(
    node: Node,
    state: Propagation,
    declared: Mapping[str, TensorType] | None = None,
    value_limit: int = VALUE_LIMIT,
) -> None:
    """Add the types (and small known values) of ``node``'s outputs to ``state``.

    ``declared`` holds types the model states for values; they fill in what
    inference leaves unknown.
    """
    declared = declared or {}
    in_types = [state.types.get(i) if i else None for i in node.inputs]
    in_values = [state.values.get(i) if i else None for i in node.inputs]
    out_types = infer_node(node, in_types, in_values)
    for name, t in zip(node.outputs, out_types, strict=False):
        if name:
            state.types[name] = _merge(t, declared.get(name))
    for name in node.outputs[len(out_types):]:
        if name:
            state.types[name] = declared.get(name)
    values = _known_values(node, in_types, in_values, out_types, value_limit)
    for name, val in zip(node.outputs, values, strict=False):
        if name and val is not None:
            state.values[name] = val


def infer_node(
    node: Node,
    in_types: Sequence[TensorType | None],
    in_values: Sequence[np.ndarray | None],
) -> list[TensorType | None]:
    """Output types of one node from its schema; errors name the node."""
    try:
        schema = get_schema(node.op)
    except UnsupportedOperationError:
        return [None] * len(node.outputs)
    try:
        return list(schema.infer_types(list(in_types), node.attrs, list(in_values)))
    except KeelError as exc:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op.value}): {exc.message}"
        ) from None
    except Exception as exc:  # a schema rule tripped on odd input: report, never leak
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op.value}): type inference failed with "
            f"{type(exc).__name__}: {exc}"
        ) from None


def _known_values(
    node: Node,
    in_types: Sequence[TensorType | None],
    in_values: Sequence[np.ndarray | None],
    out_types: Sequence[TensorType | None],
    value_limit: int,
) -> list[np.ndarray | None]:
    if node.op is Op.SHAPE:
        return [_shape_value(node, in_types[0] if in_types else None)]
    if node.op is Op.SIZE:
        t = in_types[0] if in_types else None
        n = t.numel() if t is not None else None
        return [None if n is None else np.array(n, dtype=np.int64)]
    if node.op in _NOT_PROPAGATED:
        return []
    present = [v for i, v in zip(node.inputs, in_values, strict=False) if i]
    if len(present) != len(node.present_inputs()) or any(v is None for v in present):
        return []
    if not _small(out_types, len(node.outputs), value_limit):
        return []
    return list(evaluate_node(node, list(in_values)) or [])


def _small(out_types: Sequence[TensorType | None], n_out: int, limit: int) -> bool:
    if len(out_types) < n_out:
        return False
    for t in out_types:
        n = None if t is None else t.numel()
        if n is None or n > limit:
            return False
    return True


def evaluate_node(node: Node, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray] | None:
    """Run ``node`` on NumPy inputs with the reference kernel; None if that cannot be done.

    Used for constant values at optimize time. A failing kernel (the node is
    invalid for these inputs) gives None, so the error surfaces when the model
    runs, with the node named, instead of here.
    """
    from keel.backends.base import DeviceKind, KernelContext
    from keel.backends.reference.kernels import load

    table = load()
    if node.op not in table:
        return None
    ctx = KernelContext(np, "reference", DeviceKind.CPU)
    try:
        outs = table.get(node.op).fn(ctx, list(inputs), node.attrs, None)
    except Exception:
        return None
    return [np.asarray(o) for o in outs]


def _shape_value(node: Node, t: TensorType | None) -> np.ndarray | None:
    if t is None or not t.is_static or t.shape is None:
        return None
    dims = [int(d) for d in t.shape]  # type: ignore[arg-type]
    start, end = _shape_bounds(node, len(dims))
    return np.array(dims[start:end], dtype=np.int64)


def _shape_bounds(node: Node, rank: int) -> tuple[int, int]:
    """ONNX Shape's ``start``/``end`` (clamped into [0, rank])."""
    start = int(node.attr("start", 0))
    end_attr = node.attr("end", None)
    end = rank if end_attr is None else int(end_attr)
    start = start + rank if start < 0 else start
    end = end + rank if end < 0 else end
    return min(max(start, 0), rank), min(max(end, 0), rank)


def _input_type(
    name: str, declared: TensorType, given: Sequence[int | str | None] | None
) -> TensorType:
    if given is None:
        return declared
    shape = tuple(given)
    if declared.shape is not None:
        if len(shape) != len(declared.shape):
            raise InvalidArgumentError(
                f"input {name!r} is declared with rank {len(declared.shape)} "
                f"{_fmt(declared.shape)}, got rank {len(shape)} {_fmt(shape)}"
            )
        for want, got in zip(declared.shape, shape, strict=True):
            if isinstance(want, int) and isinstance(got, int) and want != got:
                raise InvalidArgumentError(
                    f"input {name!r} is declared with shape {_fmt(declared.shape)}, "
                    f"got {_fmt(shape)}"
                )
    for d in shape:
        if isinstance(d, int) and d < 0:
            raise InvalidArgumentError(f"input {name!r} shape {_fmt(shape)} has a negative dim")
    return TensorType(declared.dtype, shape)


def _merge(inferred: TensorType | None, declared: TensorType | None) -> TensorType | None:
    """Inferred types win; the model's declaration fills what inference left unknown."""
    if inferred is None:
        return declared
    if declared is None or declared.shape is None or declared.dtype != inferred.dtype:
        return inferred
    if inferred.shape is None:
        return TensorType(inferred.dtype, declared.shape)
    if len(inferred.shape) != len(declared.shape):
        return inferred
    dims = tuple(d if d is not None else e for d, e in zip(inferred.shape, declared.shape,
                                                          strict=True))
    return TensorType(inferred.dtype, dims)


def _type_of_array(arr: np.ndarray) -> TensorType | None:
    try:
        return TensorType(DType.from_numpy(arr.dtype), tuple(int(d) for d in arr.shape))
    except KeelError:
        return None


def _fmt(shape: Sequence[Any]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
