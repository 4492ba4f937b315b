"""Converters of onnxruntime's quantized ``com.microsoft`` ops (QOperator models).

``onnxruntime.quantization.quantize_static(..., quant_format=QOperator)`` writes
these beside ai.onnx's QLinearConv and QLinearMatMul:

* QGemm becomes keel's QGEMM (same inputs and attributes): an int8 kernel;
* DynamicQuantizeMatMul becomes DynamicQuantizeLinear → MatMulInteger, scaled
  by ``a_scale * b_scale`` in float32, plus the bias, as onnxruntime computes it;
* QLinearGlobalAveragePool (NCHW, both zero points given) becomes keel's
  QLINEAR_GLOBAL_AVG_POOL: onnxruntime's integer arithmetic, its bytes;
* the other elementwise and pooling ones (QLinearAdd, QLinearMul, QLinearSigmoid,
  QLinearLeakyRelu, QLinearConcat, QLinearAveragePool, a QLinearGlobalAveragePool
  without zero points)
  become DequantizeLinear → the float op → QuantizeLinear: the values between
  nodes stay 8-bit, and a result may differ from onnxruntime's integer
  arithmetic by one quantization step where it sits on a rounding boundary.

The domain's opset is 1; every converter here serves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keel.graph.importers.onnx_context import ConverterTable, ImportContext, OnnxNode
from keel.ops.registry import Op

__all__ = ["MS_DOMAIN", "MS_TABLE"]

MS_DOMAIN = "com.microsoft"
MS_TABLE = ConverterTable()


def _dequantized(ctx: ImportContext, value: str, scale: str, zero_point: str) -> str:
    out = ctx.fresh(f"{value}_dequantized")
    ctx.emit(Op.DEQUANTIZE_LINEAR, [value, scale, zero_point], [out])
    return out


def _requantized(ctx: ImportContext, value: str, scale: str, zero_point: str,
                 output: str) -> None:
    ctx.emit(Op.QUANTIZE_LINEAR, [value, scale, zero_point], [output])


def _float_op(ctx: ImportContext, n: OnnxNode, op: Op, operands: Sequence[tuple[int, int, int]],
              out_params: tuple[int, int], attrs: dict[str, Any] | None = None) -> None:
    """DQ each (value, scale, zero point) operand, run ``op`` in float, Q the result."""
    floats = [_dequantized(ctx, n.input(v), n.input(s), n.input(z)) for v, s, z in operands]
    result = ctx.fresh(f"{n.outputs[0]}_float")
    ctx.emit(op, floats, [result], attrs or {})
    _requantized(ctx, result, n.input(out_params[0]), n.input(out_params[1]), n.outputs[0])


def _binary(op: Op) -> Any:
    def convert(ctx: ImportContext, n: OnnxNode) -> None:
        _float_op(ctx, n, op, [(0, 1, 2), (3, 4, 5)], (6, 7))
    return convert


def _unary(op: Op, *keep: str) -> Any:
    def convert(ctx: ImportContext, n: OnnxNode) -> None:
        _float_op(ctx, n, op, [(0, 1, 2)], (3, 4), {k: n.attrs[k] for k in keep if k in n.attrs})
    return convert


MS_TABLE.register("QLinearAdd", 1, _binary(Op.ADD))
MS_TABLE.register("QLinearMul", 1, _binary(Op.MUL))
MS_TABLE.register("QLinearSigmoid", 1, _unary(Op.SIGMOID))
MS_TABLE.register("QLinearLeakyRelu", 1, _unary(Op.LEAKY_RELU, "alpha"))


@MS_TABLE.converts("QLinearGlobalAveragePool", since=1)
def _global_average_pool(ctx: ImportContext, n: OnnxNode) -> None:
    if n.attrs.get("channels_last", 0):
        raise ctx.unsupported("channels_last=1 (keel reads NCHW)")
    if all(n.input(i) for i in range(5)):
        ctx.emit(Op.QLINEAR_GLOBAL_AVG_POOL, [n.input(i) for i in range(5)], n.outputs)
        return
    _float_op(ctx, n, Op.GLOBAL_AVG_POOL, [(0, 1, 2)], (3, 4))


@MS_TABLE.converts("QLinearAveragePool", since=1)
def _average_pool(ctx: ImportContext, n: OnnxNode) -> None:
    if n.attrs.get("channels_last", 0):
        raise ctx.unsupported("channels_last=1 (keel reads NCHW)")
    attrs = {k: v for k, v in n.attrs.items() if k != "channels_last"}
    _float_op(ctx, n, Op.AVG_POOL, [(0, 1, 2)], (3, 4), attrs)


@MS_TABLE.converts("QLinearConcat", since=1)
def _concat(ctx: ImportContext, n: OnnxNode) -> None:
    count = len(n.inputs) - 2
    if count < 3 or count % 3:
        raise ctx.invalid("needs Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) triples")
    operands = [(2 + 3 * i, 3 + 3 * i, 4 + 3 * i) for i in range(count // 3)]
    _float_op(ctx, n, Op.CONCAT, operands, (0, 1), {"axis": n.attrs.get("axis", 0)})


@MS_TABLE.converts("QGemm", since=1)
def _qgemm(ctx: ImportContext, n: OnnxNode) -> None:
    attrs = {k: v for k, v in n.attrs.items() if k in ("alpha", "transA", "transB")}
    ctx.emit(Op.QGEMM, n.inputs, n.outputs, attrs)


@MS_TABLE.converts("DynamicQuantizeMatMul", since=1)
def _dynamic_quantize_matmul(ctx: ImportContext, n: OnnxNode) -> None:
    a, b, b_scale, b_zero_point, bias = (n.input(i) for i in range(5))
    base = n.outputs[0]
    a_q, a_scale, a_zp = (ctx.fresh(f"{base}_{s}") for s in ("a_quantized", "a_scale", "a_zp"))
    ctx.emit(Op.DYNAMIC_QUANTIZE_LINEAR, [a], [a_q, a_scale, a_zp])
    acc, as_float, scale = (ctx.fresh(f"{base}_{s}") for s in ("int32", "float", "scale"))
    ctx.emit(Op.MATMUL_INTEGER, [a_q, b, a_zp, b_zero_point], [acc])
    ctx.emit(Op.CAST, [acc], [as_float], {"to": 1})
    ctx.emit(Op.MUL, [a_scale, b_scale], [scale])
    if not bias:
        ctx.emit(Op.MUL, [as_float, scale], [n.outputs[0]])
        return
    scaled = ctx.fresh(f"{base}_scaled")
    ctx.emit(Op.MUL, [as_float, scale], [scaled])
    ctx.emit(Op.ADD, [scaled, bias], [n.outputs[0]])
