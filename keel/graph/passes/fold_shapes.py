"""Shape-subgraph folding: with static shapes, ``Shape``/``Size`` are constants.

``Shape(x)`` of a tensor whose shape is known becomes an initializer, and so
does ``Size(x)``. When only some dims are known (a symbolic batch), a
``Gather`` or ``Slice`` that picks only known dims out of ``Shape(x)`` is
folded all the same. Constant folding then collapses what was computed from
them (the ``Concat``/``Unsqueeze``/``Reshape`` chains exporters emit).
"""

from __future__ import annotations

import numpy as np

from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.passes.fold_constants import fold_constants
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.types import Dim, TensorType

__all__ = ["fold_shapes"]


def fold_shapes(graph: Graph) -> Graph:
    """A copy of ``graph`` with known shapes as constants, then constant-folded."""
    g = graph.copy()
    try:
        types = infer_graph_types(g)
    except KeelError:
        return g
    dims_of: dict[str, list[Dim]] = {}
    kept: list[Node] = []
    for node in g.nodes:
        value = _fold_node(g, node, types, dims_of)
        if value is None:
            kept.append(node)
        else:
            g.initializers[node.outputs[0]] = value
            g.value_types.pop(node.outputs[0], None)
    g.nodes = kept
    return fold_constants(g)


def _fold_node(g: Graph, node: Node, types: dict[str, TensorType | None],
               dims_of: dict[str, list[Dim]]) -> np.ndarray | None:
    if node.op is Op.SHAPE and node.inputs:
        return _shape(node, types.get(node.inputs[0]), dims_of)
    if node.op is Op.SIZE and node.inputs:
        t = types.get(node.inputs[0])
        n = t.numel() if t is not None else None
        return None if n is None else np.array(n, dtype=np.int64)
    if node.op in (Op.GATHER, Op.SLICE) and node.inputs and node.inputs[0] in dims_of:
        return _pick(g, node, dims_of[node.inputs[0]])
    return None


def _shape(node: Node, t: TensorType | None,
           dims_of: dict[str, list[Dim]]) -> np.ndarray | None:
    if t is None or t.shape is None:
        return None
    rank = len(t.shape)
    start, end = int(node.attr("start", 0)), node.attr("end", None)
    lo = min(max(start + rank if start < 0 else start, 0), rank)
    stop = rank if end is None else int(end)
    hi = min(max(stop + rank if stop < 0 else stop, 0), rank)
    dims: list[Dim] = [d if isinstance(d, int) else None for d in t.shape[lo:hi]]
    if all(d is not None for d in dims):
        return np.array(dims, dtype=np.int64)
    dims_of[node.outputs[0]] = dims
    return None


def _pick(g: Graph, node: Node, dims: list[Dim]) -> np.ndarray | None:
    """Gather(axis 0)/Slice of a partly known shape, when it picks known dims only."""
    table = np.array(dims, dtype=object)
    picked: np.ndarray | None
    try:
        if node.op is Op.GATHER:
            if int(node.attr("axis", 0)) != 0:
                return None
            idx = g.constant(node.input(1))
            if idx is None or idx.dtype.kind not in "iu":
                return None
            picked = table[np.asarray(idx, dtype=np.int64)]
        else:
            picked = _slice(g, node, table)
    except (IndexError, ValueError, TypeError):
        return None  # an invalid index fails at run time, with the node named
    if picked is None or any(d is None for d in np.asarray(picked).reshape(-1)):
        return None
    return np.asarray(picked, dtype=np.int64)


def _slice(g: Graph, node: Node, table: np.ndarray) -> np.ndarray | None:
    parts = [g.constant(node.input(k)) if node.input(k) else None for k in range(1, 5)]
    starts, ends, axes, steps = parts
    if starts is None or ends is None or starts.size != 1 or ends.size != 1:
        return None
    if (node.input(3) and (axes is None or int(axes.reshape(-1)[0]) not in (0, -1))) or \
            (node.input(4) and steps is None):
        return None
    step = 1 if steps is None else int(steps.reshape(-1)[0])
    if step == 0:
        return None
    start, end = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    # Python slicing clamps like ONNX Slice does for a 1-D input.
    return table[slice(start, end, step)]
