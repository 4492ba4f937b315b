"""cpu kernels of the quantization family, written against ``ctx.xp``.

They follow the reference kernels step for step, so the integer results are
the same bit for bit: the quantize division runs in the type of
``x / y_scale``, requantization multipliers are formed in the scales' type,
and integer accumulators are held exactly in float64, which lets the
matmul and the im2col convolution use BLAS; requantization is onnxruntime's
float32 product (:func:`keel.backends.reference.quantization.requantized`).
Rounding is half to even and results saturate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.cpu.kernels import TABLE
from keel.backends.reference.quantization import (
    qlinear_add_sum,
    qlinear_global_average,
    quantize_to_float,
    requantized,
)
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.quantization import (
    FLOAT_QUANT_DTYPES,
    QUANT_RANGES,
    QUANTIZE_INPUTS,
    ConvGeometry,
    ParamLayout,
    conv_geometry,
    dequantize_output_dtype,
    matmul_param_shape,
    matmul_shape,
    param_layout,
    quantize_output_dtype,
)

__all__: list[str] = []


_QLINEAR = frozenset({DType.UINT8, DType.INT8})


def _dtype(a: Any) -> DType:
    return DType.from_numpy(a.dtype)



def _require(op: Op, what: str, dtype: DType, allowed: frozenset[DType]) -> None:
    if dtype not in allowed:
        names = ", ".join(sorted(d.value for d in allowed))
        raise InvalidArgumentError(f"{op.value}: {what} must be one of {names}, got {dtype.value}")


def _broadcast_param(xp: Any, op: Op, p: Any, x_shape: tuple[int, ...], attrs: Attrs,
                     what: str) -> Any:
    """A scale or zero point expanded to broadcast against x (per tensor/axis/block)."""
    layout, axis = param_layout(op, x_shape, p.shape, attrs["axis"], attrs["block_size"], what)
    if layout is ParamLayout.TENSOR:
        return p.reshape(())
    if layout is ParamLayout.AXIS:
        return p.reshape([-1 if i == axis else 1 for i in range(len(x_shape))])
    repeated = xp.repeat(p, attrs["block_size"], axis=axis)
    return repeated[(slice(None),) * axis + (slice(0, x_shape[axis]),)]


def _deliver(xp: Any, q: Any, dtype: DType, out: Out, i: int = 0) -> Any:
    """Round half to even and saturate ``q`` (in place), then cast into ``dtype``/``out``."""
    lo, hi = QUANT_RANGES[dtype]
    xp.rint(q, out=q)
    xp.copyto(q, 0.0, where=xp.isnan(q))    # NaN to 0; clip bounds the infinities
    xp.clip(q, lo, hi, out=q)
    if out is not None:
        out[i][...] = q
        return out[i]
    return q.astype(dtype.numpy)


@TABLE.kernel(Op.QUANTIZE_LINEAR, dtypes=QUANTIZE_INPUTS, supports_out=True)
def quantize_linear(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """saturate(round_half_even(x / y_scale) + y_zero_point)."""
    xp = ctx.xp
    x, scale, zp = inputs[0], inputs[1], optional_input(inputs, 2)
    op = Op.QUANTIZE_LINEAR
    out_dtype = quantize_output_dtype(None if zp is None else _dtype(zp), attrs["output_dtype"])
    _require(op, "x", _dtype(x), QUANTIZE_INPUTS)
    if zp is not None and out_dtype.is_narrow:      # ml_dtypes' values join float math
        zp = zp.astype(np.float32)
    div = _division_dtype(x, scale, attrs["precision"])
    s = _broadcast_param(xp, op, scale, x.shape, attrs, "y_scale").astype(div, copy=False)
    q = xp.divide(x.astype(div, copy=False), s)
    if out_dtype in FLOAT_QUANT_DTYPES:
        zb = None if zp is None else _broadcast_param(xp, op, zp, x.shape, attrs,
                                                      "y_zero_point")
        return _store(quantize_to_float(q, zb, out_dtype, attrs["saturate"]), out)
    if zp is not None:
        if q.dtype == np.float16:
            # float16 cannot hold every uint16 zero point exactly: add in float32.
            q = xp.rint(q).astype(np.float32)
        else:
            xp.rint(q, out=q)
        q += _broadcast_param(xp, op, zp, x.shape, attrs, "y_zero_point")
    return [_deliver(xp, q, out_dtype, out)]


def _store(y: Any, out: Out) -> list[Any]:
    if out is None:
        return [y]
    out[0][...] = y
    return [out[0]]


def _division_dtype(x: Any, scale: Any, precision: DType | None) -> Any:
    if precision is None:
        return np.result_type(x.dtype, scale.dtype)
    if not precision.is_float:
        raise InvalidArgumentError(
            f"quantize_linear: precision must be a float type, got {precision.value}"
        )
    return precision.numpy


@TABLE.kernel(Op.DEQUANTIZE_LINEAR, supports_out=True)
def dequantize_linear(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(x - x_zero_point) * x_scale, in float32 (float64 for float64 or int32 data)."""
    xp = ctx.xp
    x, scale, zp = inputs[0], inputs[1], optional_input(inputs, 2)
    op = Op.DEQUANTIZE_LINEAR
    out_dtype = dequantize_output_dtype(_dtype(x), _dtype(scale),
                                        None if zp is None else _dtype(zp),
                                        attrs["output_dtype"])
    wide = out_dtype is DType.FLOAT64 or _dtype(x) is DType.INT32
    ct = np.dtype(np.float64 if wide else np.float32)
    if _dtype(x).is_narrow:         # 4-bit, 2-bit, float8, float4: exact in float32
        x = x.astype(ct)
        zp = None if zp is None else zp.astype(ct)
    y = out[0] if out is not None and out[0].dtype == ct else xp.empty(x.shape, dtype=ct)
    use_out = out is not None and y is out[0]
    if zp is not None:
        zb = _broadcast_param(xp, op, zp, x.shape, attrs, "x_zero_point")
        xp.subtract(x, zb, out=y, dtype=ct)
    else:
        y[...] = x
    y *= _broadcast_param(xp, op, scale, x.shape, attrs, "x_scale").astype(ct, copy=False)
    if out is not None and not use_out:
        out[0][...] = y
        return [out[0]]
    return [y if use_out or ct == out_dtype.numpy else y.astype(out_dtype.numpy)]


@TABLE.kernel(Op.DYNAMIC_QUANTIZE_LINEAR, dtypes=("float32",), supports_out=True)
def dynamic_quantize_linear(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                            out: Out) -> list[Any]:
    """uint8 quantization over [min(0, min x), max(0, max x)], in float32 like ONNX."""
    xp = ctx.xp
    x = inputs[0]
    _require(Op.DYNAMIC_QUANTIZE_LINEAR, "x", _dtype(x), frozenset({DType.FLOAT32}))
    f32 = np.float32
    hi = f32(max(0.0, float(x.max()))) if x.size else f32(0)
    lo = f32(min(0.0, float(x.min()))) if x.size else f32(0)
    scale = (hi - lo if hi != lo else f32(1)) / f32(255)
    zero_point = np.rint(np.clip(f32(0) - lo / scale, 0, 255))
    q = xp.divide(x, scale)
    xp.rint(q, out=q)
    q += zero_point
    results = [_deliver(xp, q, DType.UINT8, out),
               xp.asarray(np.array(scale, dtype=np.float32)),
               xp.asarray(np.array(zero_point, dtype=np.uint8))]
    if out is not None:
        for i in (1, 2):
            out[i][...] = results[i]
            results[i] = out[i]
    return results


def check_pair(op: Op, value: Any, zero_point: Any, what: str) -> None:
    """``value`` is 8-bit and its zero point has its type."""
    _require(op, what, _dtype(value), _QLINEAR)
    if zero_point.dtype != value.dtype:
        raise InvalidArgumentError(
            f"{op.value}: the zero point of {what} must have its type {value.dtype}, "
            f"got {zero_point.dtype}"
        )


def _shifted(xp: Any, v: Any, zero_point: Any) -> Any:
    """v - zero_point as float64 (exact for 8-bit data)."""
    y = v.astype(np.float64)
    y -= zero_point
    return y


def _check_operands(op: Op, a: Any, a_zp: Any, b: Any, b_zp: Any, y_zp: Any) -> None:
    check_pair(op, a, a_zp, "a")
    check_pair(op, b, b_zp, "b")
    _require(op, "y_zero_point", _dtype(y_zp), _QLINEAR)


@TABLE.kernel(Op.QLINEAR_MATMUL, dtypes=_QLINEAR, supports_out=True)
def qlinear_matmul(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """float64 BLAS matmul of the zero-point-shifted inputs (exact), requantized."""
    xp = ctx.xp
    a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp = inputs
    op = Op.QLINEAR_MATMUL
    _check_operands(op, a, a_zp, b, b_zp, y_zp)
    y_shape = matmul_shape(op, a.shape, b.shape) or (1,)

    def shaped(p: Any, operand: Sequence[Any], what: str, per: str) -> Any:
        return p.reshape(matmul_param_shape(what, operand, p.shape, per))

    acc = xp.matmul(_shifted(xp, a, shaped(a_zp, a.shape, "a_zero_point", "row")),
                    _shifted(xp, b, shaped(b_zp, b.shape, "b_zero_point", "col")))
    mult = (shaped(a_s, a.shape, "a_scale", "row") * shaped(b_s, b.shape, "b_scale", "col")
            / shaped(y_s, y_shape, "y_scale", "row"))
    q = requantized(acc, mult, shaped(y_zp, y_shape, "y_zero_point", "row"), xp)
    return [_deliver(xp, q, _dtype(y_zp), out)]


@TABLE.kernel(Op.QLINEAR_ADD, dtypes=_QLINEAR, supports_out=True)
def qlinear_add(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """onnxruntime's QLinearAdd (the reference's ``qlinear_add_sum``), rounded half to
    even, [clamped at y's zero point for a fused ReLU], saturated."""
    xp = ctx.xp
    a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp = inputs
    op = Op.QLINEAR_ADD
    _check_operands(op, a, a_zp, b, b_zp, y_zp)
    if any(p.size != 1 for p in (a_s, a_zp, b_s, b_zp, y_s, y_zp)):
        raise InvalidArgumentError(f"{op.value}: every scale and zero point must be per tensor")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = xp.rint(qlinear_add_sum(a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp)).astype(np.float64)
    if attrs["activation"] == "relu":
        xp.maximum(q, float(y_zp.reshape(())), out=q)
    return [_deliver(xp, q, _dtype(y_zp), out)]


@TABLE.kernel(Op.QLINEAR_GLOBAL_AVG_POOL, dtypes=_QLINEAR, supports_out=True)
def qlinear_global_avg_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                            out: Out) -> list[Any]:
    """onnxruntime's QLinearGlobalAveragePool (the reference's ``qlinear_global_average``)."""
    y = qlinear_global_average(*inputs)
    if out is not None:
        out[0][...] = y
        return [out[0]]
    return [y]


def _im2col_conv(xp: Any, x: Any, w: Any, geo: ConvGeometry) -> Any:
    """Convolution as one batched BLAS matmul per group over im2col columns (float64)."""
    n, c = x.shape[:2]
    m, groups = w.shape[0], geo.group
    cg, mg = c // groups, m // groups
    k, p = math.prod(geo.kernel), math.prod(geo.out_spatial)
    pointwise = k == 1 and set(geo.strides) == {1} and not any(geo.pads_begin + geo.pads_end)
    if pointwise:
        cols = x.reshape(n, groups, cg, p)
    else:
        padded = xp.pad(x, [(0, 0), (0, 0), *zip(geo.pads_begin, geo.pads_end, strict=True)])
        cols = xp.empty((n, groups, cg, k, p), dtype=x.dtype)
        view = cols.reshape(n, groups, cg, k, *geo.out_spatial)
        for i, offset in enumerate(itertools.product(*(range(kk) for kk in geo.kernel))):
            window = tuple(slice(o * d, o * d + (size - 1) * s + 1, s) for o, d, s, size
                           in zip(offset, geo.dilations, geo.strides, geo.out_spatial,
                                  strict=True))
            index = (slice(None), slice(None), *window)
            patch = padded[index]
            view[:, :, :, i] = patch.reshape(n, groups, cg, *geo.out_spatial)
        cols = cols.reshape(n, groups, cg * k, p)
    acc = xp.matmul(w.reshape(groups, mg, cg * k), cols)        # (n, groups, mg, p)
    return acc.reshape(n, m, *geo.out_spatial)


def _scalar(op: Op, p: Any, what: str) -> Any:
    if p.size != 1:
        raise InvalidArgumentError(f"{op.value}: {what} must be a scalar, got shape {p.shape}")
    return p.reshape(())


def _per_channel(op: Op, p: Any, m: int, rank: int, what: str,
                 channel_axis: int = 1) -> Any:
    if p.size == 1:
        return p.reshape(())
    if tuple(p.shape) != (m,):
        raise InvalidArgumentError(
            f"{op.value}: {what} must be a scalar or have shape ({m},), got {p.shape}"
        )
    return p.reshape([m if i == channel_axis else 1 for i in range(rank)])


@TABLE.kernel(Op.QLINEAR_CONV, dtypes=_QLINEAR, supports_out=True)
def qlinear_conv(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """im2col convolution of the zero-point-shifted inputs (+ int32 bias), requantized."""
    xp = ctx.xp
    x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp = inputs[:8]
    bias = optional_input(inputs, 8)
    op = Op.QLINEAR_CONV
    check_pair(op, x, x_zp, "x")
    check_pair(op, w, w_zp, "w")
    _require(op, "y_zero_point", _dtype(y_zp), _QLINEAR)
    geo = conv_geometry(x.shape, w.shape, attrs)
    m = w.shape[0]
    w_f = _shifted(xp, w, _per_channel(op, w_zp, m, w.ndim, "w_zero_point", channel_axis=0))
    acc = _im2col_conv(xp, _shifted(xp, x, _scalar(op, x_zp, "x_zero_point")), w_f, geo)
    if bias is not None:
        if tuple(bias.shape) != (m,) or bias.dtype != np.int32:
            raise InvalidArgumentError(
                f"{op.value}: B must be int32 of shape ({m},), got {bias.dtype} {bias.shape}"
            )
        acc += bias.reshape((1, m) + (1,) * (x.ndim - 2))
    mult = (_scalar(op, x_s, "x_scale") * _per_channel(op, w_s, m, x.ndim, "w_scale")
            / _scalar(op, y_s, "y_scale"))
    q = requantized(acc, mult, _scalar(op, y_zp, "y_zero_point"), xp)
    return [_deliver(xp, q, _dtype(y_zp), out)]
