"""LayerNorm pattern fusion.

Exporters spell layer normalization as
``d = x - ReduceMean(x); y = d / Sqrt(ReduceMean(d^2) + eps) * gamma + beta``
(``d^2`` as ``Pow(d, 2)`` or ``d * d``; ``gamma``/``beta`` optional). Over
trailing axes with constant ``gamma``/``beta`` this is one LAYER_NORM node
(ONNX LayerNormalization): one pass over the row instead of nine kernels.
"""

from __future__ import annotations

import numpy as np

from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.passes._rewrite import Rewriter, const_scalar, make_attrs
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["fuse_layer_norm"]


def fuse_layer_norm(graph: Graph) -> Graph:
    """A copy of ``graph`` with each layer-normalization subgraph fused."""
    rw = Rewriter(graph.copy())
    try:
        types = infer_graph_types(rw.graph)
    except KeelError:
        return rw.apply()
    for sub in list(rw.graph.nodes):
        if sub.op is Op.SUB and not rw.claimed(sub):
            _try(rw, sub, types)
    return rw.apply()


def _try(rw: Rewriter, sub: Node, types: dict[str, TensorType | None]) -> None:
    x, d = sub.inputs[0], sub.outputs[0]
    mean1 = rw.made_by(sub.inputs[1], Op.MEAN)
    if mean1 is None or mean1.inputs[0] != x or not rw.only_use(mean1.outputs[0], sub):
        return
    users = {id(u): u for u in rw.uses(d)}
    if len(users) != 2 or d in rw.outputs:
        return
    square = next((u for u in users.values() if _is_square(rw, u, d)), None)
    div = next((u for u in users.values() if u.op is Op.DIV and u.inputs == [d, u.inputs[1]]),
               None)
    if square is None or div is None:
        return
    chain = _variance_chain(rw, square, div)
    if chain is None:
        return
    mean2, add_eps, sqrt, eps = chain
    axis = _axis(rw, mean1, mean2, types.get(x))
    if axis is None:
        return
    tail, scale, bias = _affine(rw, div)
    _fuse(rw, [mean1, sub, square, mean2, add_eps, sqrt, div, *tail],
          x, axis, eps, scale, bias, types.get(x))


def _is_square(rw: Rewriter, node: Node, d: str) -> bool:
    if node.op is Op.MUL:
        return node.inputs == [d, d]
    return node.op is Op.POW and node.inputs[0] == d and const_scalar(rw.graph,
                                                                      node.inputs[1]) == 2.0


def _variance_chain(rw: Rewriter, square: Node,
                    div: Node) -> tuple[Node, Node, Node, float] | None:
    mean2 = rw.single_consumer(square.outputs[0])
    if mean2 is None or mean2.op is not Op.MEAN:
        return None
    add = rw.single_consumer(mean2.outputs[0])
    if add is None or add.op is not Op.ADD:
        return None
    other = add.inputs[1] if add.inputs[0] == mean2.outputs[0] else add.inputs[0]
    eps = const_scalar(rw.graph, other)
    sqrt = rw.single_consumer(add.outputs[0])
    if eps is None or sqrt is None or sqrt.op is not Op.SQRT:
        return None
    if not rw.only_use(sqrt.outputs[0], div) or div.inputs[1] != sqrt.outputs[0]:
        return None
    return mean2, add, sqrt, eps


def _reduce_axes(rw: Rewriter, node: Node) -> list[int] | None:
    if not node.attr("keepdims", True):
        return None
    if node.input(1):
        value = rw.graph.constant(node.input(1))
        return None if value is None else [int(v) for v in value.reshape(-1)]
    axes = node.attr("axes", None)
    return None if axes is None else [int(v) for v in axes]


def _axis(rw: Rewriter, m1: Node, m2: Node, xt: TensorType | None) -> int | None:
    """The LayerNormalization axis when both means reduce the same trailing axes."""
    a1, a2 = _reduce_axes(rw, m1), _reduce_axes(rw, m2)
    if not a1 or a1 != a2:
        return None
    rank = None if xt is None else xt.rank
    if any(a >= 0 for a in a1):
        if rank is None:
            return None
        a1 = [a - rank if a >= 0 else a for a in a1]
    k = len(a1)
    return -k if sorted(a1) == list(range(-k, 0)) else None


def _affine(rw: Rewriter, div: Node) -> tuple[list[Node], str, str]:
    """The optional ``* gamma`` and ``+ beta`` after the division, with constant operands."""
    tail: list[Node] = []
    scale = bias = ""
    cur = div.outputs[0]
    mul = rw.single_consumer(cur)
    if mul is not None and mul.op is Op.MUL:
        other = mul.inputs[1] if mul.inputs[0] == cur else mul.inputs[0]
        if rw.graph.is_constant(other):
            tail.append(mul)
            scale, cur = other, mul.outputs[0]
    add = rw.single_consumer(cur)
    if add is not None and add.op is Op.ADD and not rw.claimed(add):
        other = add.inputs[1] if add.inputs[0] == cur else add.inputs[0]
        if rw.graph.is_constant(other):
            tail.append(add)
            bias = other
    return tail, scale, bias


def _fuse(rw: Rewriter, pattern: list[Node], x: str, axis: int, eps: float, scale: str,
          bias: str, xt: TensorType | None) -> None:
    if xt is None or xt.shape is None or not xt.dtype.is_float:
        return
    if not all(isinstance(d, int) for d in xt.shape[axis:]):
        return
    norm_shape = tuple(int(d) for d in xt.shape[axis:])  # type: ignore[arg-type]
    g = rw.graph
    params = []
    for name, fill in ((scale, 1.0), (bias, None)):
        value = np.full(norm_shape, fill, dtype=xt.dtype.numpy) if not name and fill else \
            (g.constant(name) if name else None)
        if value is None:
            params.append("")
            continue
        shaped = _param(value, norm_shape, xt)
        if shaped is None:
            return
        new = rw.fresh(f"{pattern[0].name}/ln_{'scale' if fill else 'bias'}")
        g.initializers[new] = shaped
        params.append(new)
    attrs = make_attrs(Op.LAYER_NORM, {"axis": axis, "epsilon": eps})
    if attrs is None:
        return
    out = pattern[-1].outputs[0]
    inputs = [x, params[0]] + ([params[1]] if params[1] else [])
    rw.replace(pattern, [Node(pattern[1].name, Op.LAYER_NORM, inputs, [out], attrs,
                              origin="LayerNorm pattern")])


def _param(value: np.ndarray, norm_shape: tuple[int, ...], xt: TensorType) -> np.ndarray | None:
    """gamma/beta as an array of the normalized shape, if they vary only over those axes."""
    if value.dtype != xt.dtype.numpy:
        return None
    shape = list(value.shape)
    while shape and shape[0] == 1 and len(shape) > len(norm_shape):
        shape.pop(0)
    if len(shape) > len(norm_shape):
        return None
    try:
        return np.ascontiguousarray(np.broadcast_to(value.reshape(shape), norm_shape))
    except ValueError:
        return None
