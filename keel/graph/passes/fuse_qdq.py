"""QDQ → integer nodes: quantized Conv, Gemm and MatMul run as one integer op.

A QDQ model (onnxruntime's ``quantize_static``, ``keel convert --quantize int8
--quantize-mode qdq``) spells each quantized product in float between
DequantizeLinear and QuantizeLinear nodes::

    DQ(x_q) ─┐
    DQ(w_q) ─┼─ Conv / Gemm / MatMul ─ [Relu] ─ Q ─► y_q
    DQ(b_q) ─┘   (bias: int32 DQ, or a float constant)

This pass replaces each such pattern with QLINEAR_CONV, QGEMM or
QLINEAR_MATMUL reading ``x_q`` and the integer weights directly, so the
weights stay int8 in memory and the product accumulates in int32 (instead of
constant folding turning the weights back into float32). A bias becomes int32
with scale ``x_scale * w_scale`` (``rint(b / scale)``: the integers themselves
when the model quantized it that way). A Relu between the product and Q (or a
fused ReLU epilogue) is dropped only where it changes nothing: Q's zero point is
its type's minimum, so every negative value saturates to it anyway. A Gemm or
2-D MatMul whose output stays float (no Q after it) becomes a QGEMM with a
float32 output.

A residual join, ``DQ(a_q) + DQ(b_q) ─ [Relu] ─ Q``, becomes one QLINEAR_ADD: a
single pass over the bytes, instead of a float tensor per step, computing what
onnxruntime's QLinearAdd computes (its float32 scale ratios and fused
multiply-adds, see the reference kernel), which can differ from the float nodes
by one step on a rounding boundary. As in onnxruntime's fusion, a, b and the
output share one 8-bit type and a Relu is taken only where it changes nothing;
otherwise the join runs as written. And
``DQ(x_q) ─ MaxPool (or Flatten, Reshape, Transpose, Squeeze, Unsqueeze) ─ Q``
with Q's scale and zero point those of the DQ becomes that op on ``x_q`` itself
(the same bits, see ``_try_on_integers``). ``DQ(x_q) ─ GlobalAveragePool ─ Q`` becomes
one QLINEAR_GLOBAL_AVG_POOL, as onnxruntime fuses it: integer sums requantized in float32
(its arithmetic, which can differ from the float nodes by one step on a rounding
boundary), so the classifier's input of an int8 CNN never leaves 8 bits.

Only patterns with per-tensor activation parameters, constant integer weights
(per tensor or per output channel) and no fused epilogue are taken; anything
else keeps running as written. The integer node computes what onnxruntime's
QDQ fusion computes, which can differ from the float graph by one quantization
step where a value sits on a rounding boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from keel.dtypes import DType
from keel.graph.ir import Graph, Node
from keel.graph.passes._rewrite import Rewriter
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.quantization import QUANT_RANGES, qlinear_global_scale

__all__ = ["fuse_qdq"]

_EIGHT_BITS = (np.dtype(np.uint8), np.dtype(np.int8))
_BIAS_LIMIT = float(1 << 30)    # |int32 bias| kept below, with room for the products
_GLOBAL_AVERAGE_MAX_SIZE = 1 << 24    # onnxruntime's QLinearGlobalAveragePool takes fewer
# ops whose every output value is one of the input's (a positive scale keeps MaxPool's order)
_VALUE_PRESERVING = frozenset({Op.MAX_POOL, Op.FLATTEN, Op.RESHAPE, Op.TRANSPOSE, Op.SQUEEZE,
                               Op.EXPAND_DIMS})


@dataclass(frozen=True)
class _Dequantized:
    """A DEQUANTIZE_LINEAR's integer input, scale and zero point (names)."""

    node: Node
    value: str
    scale: str
    zero_point: str


def fuse_qdq(graph: Graph) -> Graph:
    """A copy of ``graph`` with DQ → Conv/Gemm/MatMul → Q patterns as integer nodes,
    DQ → Add → [Relu] → Q as QLINEAR_ADD, and value-preserving ops between equal DQ
    and Q parameters on the integers."""
    rw = Rewriter(graph.copy())
    for node in list(rw.graph.nodes):
        if rw.claimed(node):
            continue
        if node.op in (Op.CONV, Op.GEMM, Op.MATMUL):
            _try(rw, node)
        elif node.op is Op.ADD:
            _try_add(rw, node)
        elif node.op is Op.GLOBAL_AVG_POOL:
            _try_global_average(rw, node)
        elif node.op in _VALUE_PRESERVING:
            _try_on_integers(rw, node)
    return rw.apply()


def _try(rw: Rewriter, node: Node) -> None:
    g = rw.graph
    if node.attr("activation", "") not in ("", "relu") or len(node.outputs) != 1:
        return
    x = _activation(rw, node.input(0))
    w = _weight(rw, node.input(1))
    if x is None or w is None or not _weight_axis_fits(g, node, w):
        return
    tail, q = _quantized_output(rw, node)
    if node.attr("activation", "") and (q is None or not _relu_redundant(g, q)):
        return
    if node.op is Op.CONV:
        if q is None or len(node.present_inputs()) > 3:
            return
        new = _qlinear_conv(rw, node, x, w, q)
    elif node.op is Op.GEMM:
        new = _qgemm(rw, node, x, w, q)
    else:
        new = _qlinear_matmul(rw, node, x, w, q)
    if new is not None:
        rw.replace([node, *tail], [new])


# ---- the pattern's parts ---------------------------------------------------------------------
def _dequantized(rw: Rewriter, name: str) -> _Dequantized | None:
    dq = rw.made_by(name, Op.DEQUANTIZE_LINEAR) if name else None
    if dq is None or dq.attr("block_size", 0) or \
            dq.attr("output_dtype", None) not in (None, DType.FLOAT32):
        return None
    g = rw.graph
    scale = g.constant(dq.input(1))
    if scale is None or scale.dtype != np.float32:
        return None
    return _Dequantized(dq, dq.input(0), dq.input(1), dq.input(2))


def _activation(rw: Rewriter, name: str) -> _Dequantized | None:
    """An 8-bit activation read through DQ with a per-tensor scale and zero point."""
    d = _dequantized(rw, name)
    if d is None or rw.graph.is_constant(d.value):
        return None
    t = rw.graph.type_of(d.value)
    if t is not None and t.dtype.numpy not in _EIGHT_BITS:
        return None
    if not _scalar(rw.graph, d.scale) or (d.zero_point and not _scalar(rw.graph, d.zero_point)):
        return None
    if t is None and not d.zero_point:
        return None
    return d


def _weight(rw: Rewriter, name: str) -> _Dequantized | None:
    """Constant 8-bit weights read through DQ, per tensor or along one axis."""
    d = _dequantized(rw, name)
    if d is None:
        return None
    value = rw.graph.constant(d.value)
    if value is None or value.dtype not in _EIGHT_BITS:
        return None
    return d


def _scalar(g: Graph, name: str) -> bool:
    value = g.constant(name)
    return value is not None and value.size == 1


def _weight_axis_fits(g: Graph, node: Node, w: _Dequantized) -> bool:
    """Per-channel weight parameters lie along the output-channel axis of ``node``."""
    scale = g.constant(w.scale)
    if scale is None or scale.size == 1:
        return True
    rank = g.constant(w.value).ndim  # type: ignore[union-attr]
    axis = int(w.node.attr("axis", 1)) % rank
    if node.op is Op.CONV:
        return axis == 0
    if node.op is Op.GEMM:
        return axis == (0 if node.attr("trans_b", False) else 1)
    return rank == 2 and axis == 1


def _try_add(rw: Rewriter, node: Node) -> None:
    if node.attr("activation", "") or len(node.outputs) != 1 or len(node.inputs) != 2:
        return
    a, b = _activation(rw, node.input(0)), _activation(rw, node.input(1))
    if a is None or b is None:
        return
    tail, q = _quantized_output(rw, node)
    if q is None:
        return
    y_type = rw.graph.constant(q.input(2)).dtype  # type: ignore[union-attr]
    if {_integer_type(rw, a), _integer_type(rw, b)} != {y_type}:
        return              # onnxruntime's QLinearAdd takes one type: it leaves such joins
    inputs = [a.value, a.scale, _zero_point(rw, a, ()), b.value, b.scale,
              _zero_point(rw, b, ()), q.input(1), q.input(2)]
    attrs = get_schema(Op.QLINEAR_ADD).normalize_attrs({})
    rw.replace([node, *tail], [Node(node.name, Op.QLINEAR_ADD, inputs, [q.outputs[0]], attrs,
                                    node.origin)])


def _try_global_average(rw: Rewriter, node: Node) -> None:
    """DQ → GlobalAveragePool → Q as one QLINEAR_GLOBAL_AVG_POOL where onnxruntime fuses
    it (x and y of one 8-bit type) and its kernel takes the parameters: a static plane of
    fewer than 2^24 values and x_scale / (y_scale * size) in [2^-32, 256)."""
    x = _activation(rw, node.input(0))
    if x is None or len(node.outputs) != 1:
        return
    tail, q = _quantized_output(rw, node)
    t = rw.graph.type_of(x.value)
    plane = [] if t is None or t.shape is None else list(t.shape[2:])
    sizes = [d for d in plane if isinstance(d, int)]
    if q is None or not plane or len(sizes) != len(plane):
        return
    y_type = rw.graph.constant(q.input(2)).dtype  # type: ignore[union-attr]
    if _integer_type(rw, x) != y_type:
        return
    size = math.prod(sizes)
    g = rw.graph
    scale = qlinear_global_scale(g.constant(x.scale), g.constant(q.input(1)), size)
    if not (size < _GLOBAL_AVERAGE_MAX_SIZE and 2.0 ** -32 <= float(scale) < 256.0):
        return
    inputs = [x.value, x.scale, _zero_point(rw, x, ()), q.input(1), q.input(2)]
    rw.replace([node, *tail], [Node(node.name, Op.QLINEAR_GLOBAL_AVG_POOL, inputs,
                                    [q.outputs[0]], {}, node.origin)])


def _try_on_integers(rw: Rewriter, node: Node) -> None:
    """DQ → MaxPool (or a reshaping op) → Q with Q's parameters those of the DQ: the op
    on the integers.

    Each output is one of the dequantized inputs (for MaxPool the largest: a positive
    scale keeps the order), and quantizing it again with the same scale and zero point
    gives its integer back exactly (|v - zero point| <= 255 comes back from float32
    within far less than half a step), so the op on the integers gives the same bits."""
    x = _activation(rw, node.input(0))
    if x is None or len(node.outputs) != 1 or not x.zero_point:
        return
    q = rw.single_consumer(node.outputs[0])
    if q is None or q.op is not Op.QUANTIZE_LINEAR or rw.claimed(q) or \
            q.attr("precision", None) is not None or not q.input(2):
        return
    g = rw.graph
    pairs = ((x.scale, q.input(1)), (x.zero_point, q.input(2)))
    if not all(_same_constant(g, a, b) for a, b in pairs):
        return
    scale = g.constant(x.scale)
    if scale is None or not float(scale.reshape(())) > 0:
        return
    rw.replace([node, q], [Node(node.name, node.op, [x.value, *node.inputs[1:]],
                                [q.outputs[0]], dict(node.attrs), node.origin)])


def _same_constant(g: Graph, a: str, b: str) -> bool:
    va, vb = g.constant(a), g.constant(b)
    return (va is not None and vb is not None and va.dtype == vb.dtype and va.size == 1
            and vb.size == 1 and bool(va.reshape(()) == vb.reshape(())))


def _quantized_output(rw: Rewriter, node: Node) -> tuple[list[Node], Node | None]:
    """The Q node quantizing ``node``'s output (through a Relu it makes redundant), and the
    nodes from ``node`` to it; ([], None) when the output stays float."""
    out = node.outputs[0]
    tail: list[Node] = []
    nxt = rw.single_consumer(out)
    if nxt is not None and nxt.op is Op.RELU:
        tail.append(nxt)
        nxt = rw.single_consumer(nxt.outputs[0])
    if nxt is None or nxt.op is not Op.QUANTIZE_LINEAR or rw.claimed(nxt) or \
            nxt.input(0) != (tail[-1].outputs[0] if tail else out):
        return [], None
    g = rw.graph
    zp = g.constant(nxt.input(2)) if nxt.input(2) else None
    scale = g.constant(nxt.input(1))
    if scale is None or scale.size != 1 or scale.dtype != np.float32 or zp is None or \
            zp.size != 1 or zp.dtype not in _EIGHT_BITS or nxt.attr("precision", None) is not None:
        return [], None
    if tail and not _relu_redundant(g, nxt):
        return [], None
    return [*tail, nxt], nxt


def _relu_redundant(g: Graph, q: Node) -> bool:
    """Q's zero point is its type's minimum: it saturates every negative value to it, as
    a ReLU before it would."""
    zp = g.constant(q.input(2))
    return zp is not None and int(zp.reshape(())) == QUANT_RANGES[DType.from_numpy(zp.dtype)][0]


# ---- the integer nodes -----------------------------------------------------------------------
def _integer_type(rw: Rewriter, d: _Dequantized) -> np.dtype:
    """The 8-bit type of ``d``'s value: its zero point's, else the graph's type for it."""
    zp = rw.graph.constant(d.zero_point) if d.zero_point else None
    if zp is not None:
        return zp.dtype
    return rw.graph.type_of(d.value).dtype.numpy  # type: ignore[union-attr]


def _zero_point(rw: Rewriter, d: _Dequantized, like_shape: tuple[int, ...]) -> str:
    """``d``'s zero point, or zeros of its value's type where the model gave none."""
    if d.zero_point:
        return d.zero_point
    g = rw.graph
    t = g.type_of(d.value)
    value = g.constant(d.value)
    dtype = value.dtype if value is not None else t.dtype.numpy  # type: ignore[union-attr]
    name = rw.fresh(f"{d.value}_zero_point")
    g.initializers[name] = np.zeros(like_shape, dtype=dtype)
    return name


def _bias(rw: Rewriter, node: Node, x: _Dequantized, w: _Dequantized,
          n: int) -> tuple[str, _Dequantized] | None:
    """The bias as int32 with scale x_scale * w_scale ("" without one) and the weights to
    use with it; None when it cannot be (not constant, not 1-D of n values).

    A channel whose weights are all but zero (a tiny scale) while its bias is not would
    need a bias beyond int32: its weight scale is raised until the bias fits in 2^30,
    and its integers requantized (as onnxruntime's quantizer does).
    """
    name = node.input(2)
    if not name:
        return "", w
    g = rw.graph
    value = _constant_float(rw, name)
    if value is None or value.size not in (1, n) or value.ndim > 1:
        return None
    x_scale = float(g.constant(x.scale).astype(np.float64).reshape(()))  # type: ignore[union-attr]
    w_scale = g.constant(w.scale).astype(np.float64).reshape(-1)  # type: ignore[union-attr]
    alpha, beta = (float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))) \
        if node.op is Op.GEMM else (1.0, 1.0)
    value = np.broadcast_to(value.reshape(-1) * beta, (n,))
    scale = np.broadcast_to(x_scale * alpha * w_scale, (n,))
    if not np.all(scale > 0):
        return None
    over = np.abs(value / scale) > _BIAS_LIMIT
    if over.any():
        widened = _widened(rw, node, w, over, np.abs(value) / (x_scale * alpha * _BIAS_LIMIT))
        if widened is None:
            return None
        w = widened
        scale = np.broadcast_to(
            x_scale * alpha * g.constant(w.scale).astype(np.float64).reshape(-1),  # type: ignore[union-attr]
            (n,))
    out = rw.fresh(f"{name}_int32")
    g.initializers[out] = np.rint(value / scale).astype(np.int32)
    return out, w


def _widened(rw: Rewriter, node: Node, w: _Dequantized, over: np.ndarray,
             wanted: np.ndarray) -> _Dequantized | None:
    """``w`` with the scales of the ``over`` channels raised to ``wanted`` (per channel
    weights with zero point 0 only), their integers requantized."""
    g = rw.graph
    q, scale = g.constant(w.value), g.constant(w.scale)
    zp = g.constant(w.zero_point) if w.zero_point else None
    if q is None or scale is None or scale.size != over.size or (zp is not None and np.any(zp)):
        return None
    axis = int(w.node.attr("axis", 1)) % q.ndim
    new_scale = scale.astype(np.float64).copy()
    new_scale[over] = np.maximum(new_scale[over], wanted[over])
    new_scale = new_scale.astype(np.float32)
    ratio = (scale.astype(np.float64) / new_scale.astype(np.float64)).reshape(
        [-1 if i == axis else 1 for i in range(q.ndim)])
    lo, hi = QUANT_RANGES[DType.from_numpy(q.dtype)]
    values = np.clip(np.rint(q.astype(np.float64) * ratio), lo, hi).astype(q.dtype)
    q_name, s_name = rw.fresh(f"{w.value}_widened"), rw.fresh(f"{w.scale}_widened")
    g.initializers[q_name], g.initializers[s_name] = values, new_scale
    return _Dequantized(w.node, q_name, s_name, w.zero_point)


def _constant_float(rw: Rewriter, name: str) -> np.ndarray | None:
    """A bias's float values: a constant, or the DQ of one."""
    g = rw.graph
    value = g.constant(name)
    if value is not None:
        return value.astype(np.float64) if value.dtype.kind == "f" else None
    d = _dequantized(rw, name)
    if d is None:
        return None
    q, scale = g.constant(d.value), g.constant(d.scale)
    zp = g.constant(d.zero_point) if d.zero_point else np.zeros(())
    if q is None or scale is None or zp is None or q.ndim > 1:
        return None
    return (q.astype(np.float64) - zp.astype(np.float64)) * scale.astype(np.float64)


def _qlinear_conv(rw: Rewriter, node: Node, x: _Dequantized, w: _Dequantized,
                  q: Node) -> Node | None:
    m = int(rw.graph.constant(w.value).shape[0])  # type: ignore[union-attr]
    found = _bias(rw, node, x, w, m)
    if found is None:
        return None
    bias, w = found
    attrs = get_schema(Op.QLINEAR_CONV).normalize_attrs(
        {k: v for k, v in node.attrs.items() if k in ("auto_pad", "dilations", "group",
                                                      "kernel_shape", "pads", "strides")
         and v not in ((), None)})
    inputs = [x.value, x.scale, _zero_point(rw, x, ()), w.value, w.scale,
              _zero_point(rw, w, ()), q.input(1), q.input(2)] + ([bias] if bias else [])
    return Node(node.name, Op.QLINEAR_CONV, inputs, [q.outputs[0]], attrs, node.origin)


def _qgemm(rw: Rewriter, node: Node, x: _Dequantized, w: _Dequantized,
           q: Node | None) -> Node | None:
    wv = rw.graph.constant(w.value)
    n = int(wv.shape[0] if node.attr("trans_b", False) else wv.shape[1])  # type: ignore[union-attr]
    found = _bias(rw, node, x, w, n)
    if found is None:
        return None
    bias, w = found
    attrs = get_schema(Op.QGEMM).normalize_attrs({
        "alpha": float(node.attr("alpha", 1.0)), "trans_a": bool(node.attr("trans_a", False)),
        "trans_b": bool(node.attr("trans_b", False))})
    inputs = [x.value, x.scale, _zero_point(rw, x, ()), w.value, w.scale,
              _zero_point(rw, w, ()), bias]
    if q is not None:
        inputs += [q.input(1), q.input(2)]
    while not inputs[-1]:
        inputs.pop()
    out = q.outputs[0] if q is not None else node.outputs[0]
    return Node(node.name, Op.QGEMM, inputs, [out], attrs, node.origin)


def _qlinear_matmul(rw: Rewriter, node: Node, x: _Dequantized, w: _Dequantized,
                    q: Node | None) -> Node | None:
    if len(node.present_inputs()) != 2 or rw.graph.constant(w.value).ndim != 2:  # type: ignore[union-attr]
        return None
    if q is None:
        t = rw.graph.type_of(x.value)
        if t is None or t.shape is None or len(t.shape) != 2:
            return None
        return _qgemm(rw, node, x, w, None)
    inputs = [x.value, x.scale, _zero_point(rw, x, ()), w.value, w.scale,
              _zero_point(rw, w, ()), q.input(1), q.input(2)]
    return Node(node.name, Op.QLINEAR_MATMUL, inputs, [q.outputs[0]],
                get_schema(Op.QLINEAR_MATMUL).normalize_attrs({}), node.origin)
