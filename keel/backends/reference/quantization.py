"""Reference kernels of the quantization family: readable NumPy.

Integer arithmetic (zero-point shifts, matmul and convolution accumulators) is
exact (int64, or float64 holding integers). Two steps deliberately keep the
precision ONNX and onnxruntime use, because rounding to integers makes any
other precision visible: the division ``x / y_scale`` of quantize_linear runs
in the type of ``x / y_scale`` (or ``precision``), and requantization
multipliers (``a_scale * b_scale / y_scale``) are formed in the scales' type.
Requantization (QLinearConv, QLinearMatMul, QGemm) is onnxruntime's float32
form, ``round_half_even(float32(acc) * float32(multiplier)) + zero_point``
(:func:`requantized`): the native int8 stores then run sixteen float lanes
per AVX-512 instruction instead of eight doubles, and keel's outputs move
closer to onnxruntime's. On ``benchmarks.int8``'s models (16 random inputs,
output elements differing from onnxruntime's) the earlier double product gave
ResNet-20 13 of 160, ResNet-18 2445 of 16000 and MobileNetV2 8455 of 16000;
the float32 form gives 0, 2166 and 0 (LeNet 0 either way).
Rounding is half to even, and results saturate to the output type.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.backends.reference.memory import cast_array
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
    qgemm_scales,
    qlinear_global_scale,
    quantize_output_dtype,
)

__all__ = ["conv_float64", "qlinear_add_constants", "qlinear_add_sum", "qlinear_global_average",
           "quantize_to_float"]


_QLINEAR = frozenset({DType.UINT8, DType.INT8})


def _dtype(a: np.ndarray) -> DType:
    return DType.from_numpy(a.dtype)


def _opt(inputs: Inputs, i: int) -> np.ndarray | None:
    return inputs[i] if i < len(inputs) else None


def _broadcast_param(op: Op, p: np.ndarray, x_shape: tuple[int, ...], attrs: Attrs,
                     what: str) -> np.ndarray:
    """A scale or zero point expanded to broadcast against x (per tensor/axis/block)."""
    layout, axis = param_layout(op, x_shape, p.shape, attrs["axis"], attrs["block_size"], what)
    if layout is ParamLayout.TENSOR:
        return p.reshape(())
    if layout is ParamLayout.AXIS:
        return p.reshape([-1 if i == axis else 1 for i in range(len(x_shape))])
    repeated = np.repeat(p, attrs["block_size"], axis=axis)
    return repeated.take(np.arange(x_shape[axis]), axis=axis)


def _saturate(q: np.ndarray, dtype: DType) -> np.ndarray:
    """Round half to even, saturate to ``dtype``'s range; NaN maps to the zero point."""
    lo, hi = QUANT_RANGES[dtype]
    q = np.where(np.isnan(q), 0.0, np.rint(q))
    return np.clip(q, lo, hi).astype(dtype.numpy)


@TABLE.kernel(Op.QUANTIZE_LINEAR, dtypes=QUANTIZE_INPUTS)
def quantize_linear(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """saturate(round_half_even(x / y_scale) + y_zero_point)."""
    x, scale, zp = inputs[0], inputs[1], _opt(inputs, 2)
    out_dtype = quantize_output_dtype(None if zp is None else _dtype(zp), attrs["output_dtype"])
    _require(Op.QUANTIZE_LINEAR, "x", _dtype(x), QUANTIZE_INPUTS)
    if zp is not None and out_dtype.is_narrow:      # ml_dtypes' values join float math
        zp = zp.astype(np.float64)
    div = _division_dtype(x, scale, attrs["precision"])
    s = _broadcast_param(Op.QUANTIZE_LINEAR, scale, x.shape, attrs, "y_scale")
    if out_dtype in FLOAT_QUANT_DTYPES:
        with np.errstate(divide="ignore", invalid="ignore"):
            y = x.astype(div) / s.astype(div)
        zb = None if zp is None else _broadcast_param(Op.QUANTIZE_LINEAR, zp, x.shape, attrs,
                                                      "y_zero_point")
        return [quantize_to_float(y, zb, out_dtype, attrs["saturate"])]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(x.astype(div) / s.astype(div)).astype(np.float64)
    if zp is not None:
        q = q + _broadcast_param(Op.QUANTIZE_LINEAR, zp, x.shape, attrs, "y_zero_point")
    return [_saturate(q, out_dtype)]


def quantize_to_float(y: Any, zero_point: Any, dtype: DType, saturate: bool) -> Any:
    """``y + zero_point`` rounded into a float8 or float4 type (nearest even); float8
    saturates to its finite range when ``saturate`` (float4 has no inf or NaN: always)."""
    if zero_point is not None:
        y = y + zero_point.astype(np.float32)
    return cast_array(y, dtype, saturate)


def _division_dtype(x: np.ndarray, scale: np.ndarray, precision: DType | None) -> Any:
    if precision is None:
        return np.result_type(x.dtype, scale.dtype)
    if not precision.is_float:
        raise InvalidArgumentError(
            f"quantize_linear: precision must be a float type, got {precision.value}"
        )
    return precision.numpy


def _require(op: Op, what: str, dtype: DType, allowed: frozenset[DType]) -> None:
    if dtype not in allowed:
        names = ", ".join(sorted(d.value for d in allowed))
        raise InvalidArgumentError(f"{op.value}: {what} must be one of {names}, got {dtype.value}")


@TABLE.kernel(Op.DEQUANTIZE_LINEAR)
def dequantize_linear(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(x - x_zero_point) * x_scale, computed in float64."""
    x, scale, zp = inputs[0], inputs[1], _opt(inputs, 2)
    out_dtype = dequantize_output_dtype(_dtype(x), _dtype(scale),
                                        None if zp is None else _dtype(zp),
                                        attrs["output_dtype"])
    y = x.astype(np.float64)
    if zp is not None:
        zb = _broadcast_param(Op.DEQUANTIZE_LINEAR, zp, x.shape, attrs, "x_zero_point")
        y = y - zb.astype(np.float64)
    y = y * _broadcast_param(Op.DEQUANTIZE_LINEAR, scale, x.shape, attrs, "x_scale")
    return [y.astype(out_dtype.numpy)]


@TABLE.kernel(Op.DYNAMIC_QUANTIZE_LINEAR, dtypes=("float32",))
def dynamic_quantize_linear(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                            out: Out) -> list[Any]:
    """uint8 quantization over [min(0, min x), max(0, max x)], in float32 like ONNX."""
    x = inputs[0]
    _require(Op.DYNAMIC_QUANTIZE_LINEAR, "x", _dtype(x), frozenset({DType.FLOAT32}))
    f32 = np.float32
    hi = f32(max(0.0, float(x.max()))) if x.size else f32(0)
    lo = f32(min(0.0, float(x.min()))) if x.size else f32(0)
    scale = (hi - lo if hi != lo else f32(1)) / f32(255)
    zero_point = np.rint(np.clip(f32(0) - lo / scale, 0, 255))
    y = np.rint(x / scale) + zero_point
    return [_saturate(y.astype(np.float64), DType.UINT8), np.array(scale, dtype=np.float32),
            np.array(zero_point, dtype=np.uint8)]


def _check_pair(op: Op, value: np.ndarray, zero_point: np.ndarray, what: str) -> None:
    _require(op, what, _dtype(value), _QLINEAR)
    if zero_point.dtype != value.dtype:
        raise InvalidArgumentError(
            f"{op.value}: the zero point of {what} must have its type {value.dtype}, "
            f"got {zero_point.dtype}"
        )


def _multiplier(*scales: np.ndarray) -> np.ndarray:
    """a_scale * b_scale / y_scale in the scales' own type, as ONNX forms it, held as
    float32 (the type the requantization product runs in)."""
    a, b, y = scales
    return np.asarray(a * b / y).astype(np.float32)


def requantized(acc: Any, mult: Any, zero_point: Any, xp: Any = np) -> Any:
    """onnxruntime's requantization before saturation: round_half_even(float32(acc) *
    float32(mult)) + zero_point, returned as float64 (exact whole numbers)."""
    q = xp.rint(acc.astype(np.float32) * xp.asarray(mult).astype(np.float32))
    return q.astype(np.float64) + zero_point


@TABLE.kernel(Op.QLINEAR_MATMUL, dtypes=_QLINEAR)
def qlinear_matmul(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Integer matmul of the zero-point-shifted inputs, requantized to y's type."""
    a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp = inputs
    op = Op.QLINEAR_MATMUL
    _check_pair(op, a, a_zp, "a")
    _check_pair(op, b, b_zp, "b")
    _require(op, "y_zero_point", _dtype(y_zp), _QLINEAR)
    y_shape = matmul_shape(op, a.shape, b.shape)

    def shaped(p: np.ndarray, operand: Sequence[Any], what: str, per: str) -> np.ndarray:
        return p.reshape(matmul_param_shape(what, operand, p.shape, per))

    a_int = a.astype(np.int64) - shaped(a_zp, a.shape, "a_zero_point", "row")
    b_int = b.astype(np.int64) - shaped(b_zp, b.shape, "b_zero_point", "col")
    acc = np.matmul(a_int, b_int).astype(np.float64)
    mult = _multiplier(shaped(a_s, a.shape, "a_scale", "row"),
                       shaped(b_s, b.shape, "b_scale", "col"),
                       shaped(y_s, y_shape or (1,), "y_scale", "row"))
    y = requantized(acc, mult, shaped(y_zp, y_shape or (1,), "y_zero_point", "row"))
    return [_saturate(np.asarray(y), _dtype(y_zp))]


@TABLE.kernel(Op.QLINEAR_ADD, dtypes=_QLINEAR)
def qlinear_add(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """onnxruntime's QLinearAdd: ``qlinear_add_sum`` rounded half to even, [clamped at y's
    zero point for a fused ReLU], saturated."""
    a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp = inputs
    op = Op.QLINEAR_ADD
    _check_pair(op, a, a_zp, "a")
    _check_pair(op, b, b_zp, "b")
    _require(op, "y_zero_point", _dtype(y_zp), _QLINEAR)
    for what, p in (("a", a_s), ("a", a_zp), ("b", b_s), ("b", b_zp), ("y", y_s), ("y", y_zp)):
        if p.size != 1:
            raise InvalidArgumentError(f"{op.value}: {what}'s scale and zero point must be "
                                       f"per tensor, got shape {p.shape}")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.rint(qlinear_add_sum(a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp)).astype(np.float64)
    if attrs["activation"] == "relu":
        q = np.maximum(q, float(y_zp.reshape(())))
    return [_saturate(q, _dtype(y_zp))]


@TABLE.kernel(Op.QLINEAR_GLOBAL_AVG_POOL, dtypes=_QLINEAR)
def qlinear_global_avg_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                            out: Out) -> list[Any]:
    """onnxruntime's QLinearGlobalAveragePool (NCHW): see :func:`qlinear_global_average`."""
    return [qlinear_global_average(*inputs)]


def qlinear_global_average(x: Any, x_s: Any, x_zp: Any, y_s: Any, y_zp: Any) -> Any:
    """onnxruntime's QLinearGlobalAveragePool of the NCHW 8-bit ``x`` (MLAS's x86-64 form):
    per plane, the integer sum less size * x's zero point (int32, wrapping as its vector
    adds do), times :func:`qlinear_global_scale` in float32, clamped to y's range less its
    zero point as vmaxps/vminps clamp (NaN gives the lower bound), rounded half to even,
    plus y's zero point. Shape (N, C, 1, ...). Checks its operands first."""
    op = Op.QLINEAR_GLOBAL_AVG_POOL
    _check_pair(op, x, x_zp, "x")
    _require(op, "y_zero_point", _dtype(y_zp), _QLINEAR)
    for what, p in (("x", x_s), ("x", x_zp), ("y", y_s), ("y", y_zp)):
        if p.size != 1:
            raise InvalidArgumentError(f"{op.value}: {what}'s scale and zero point must be "
                                       f"per tensor, got shape {p.shape}")
    if x.ndim < 3:
        raise InvalidArgumentError(f"{op.value}: x must be (N, C, spatial...), got {x.shape}")
    n, c = x.shape[:2]
    size = int(np.prod(x.shape[2:]))
    zp_in, zp_out = int(np.asarray(x_zp).reshape(())), int(np.asarray(y_zp).reshape(()))
    lo, hi = QUANT_RANGES[_dtype(np.asarray(y_zp))]
    acc = x.reshape(n, c, size).sum(axis=-1, dtype=np.int64) - zp_in * size
    acc = ((acc + 2**31) % 2**32 - 2**31).astype(np.int32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = acc.astype(np.float32) * qlinear_global_scale(x_s, y_s, size)
    low, high = np.float32(lo - zp_out), np.float32(hi - zp_out)
    v = np.where(v > low, v, low)
    v = np.where(v < high, v, high)
    y = np.rint(v).astype(np.int32) + zp_out
    return y.astype(np.asarray(y_zp).dtype).reshape(n, c, *(1,) * (x.ndim - 2))


def qlinear_add_constants(a_scale: Any, b_scale: Any, y_scale: Any, a_zero_point: Any,
                          b_zero_point: Any, y_zero_point: Any) -> tuple[np.float32, ...]:
    """onnxruntime's QLinearAdd constants, float32: a_scale / y_scale, b_scale / y_scale and
    y_zp - (ra * a_zp + rb * b_zp), the product ra * a_zp fused into that sum (as its
    x86-64 build compiles the expression)."""
    def one(v: Any) -> np.float32:
        return np.float32(np.asarray(v).reshape(()))

    ra, rb = one(a_scale) / one(y_scale), one(b_scale) / one(y_scale)
    zero_points = ra.astype(np.float64) * float(one(a_zero_point)) + float(rb * one(b_zero_point))
    return ra, rb, np.float32(one(y_zero_point) - np.float32(zero_points))


def _fma32(x: Any, y: np.float32, z: Any) -> Any:
    """float32(x * y + z) with one rounding (exact in float64 for 8-bit x and the ratios
    QLinearAdd meets: the sum spans far fewer than 53 bits)."""
    return (x.astype(np.float64) * float(y) + z.astype(np.float64)).astype(np.float32)


def qlinear_add_sum(a: Any, a_s: Any, a_zp: Any, b: Any, b_s: Any, b_zp: Any, y_s: Any,
                    y_zp: Any) -> Any:
    """The float32 value onnxruntime rounds for QLinearAdd (its x86-64 vector form): the raw
    integers times the scale ratios, fused-multiply-added onto the zero points' constant,
    b's term first, except where a is constant along the innermost axis (onnxruntime's
    scalar-a span) and a's term comes first. y_zp is included, before the rounding."""
    ra, rb, fixed = qlinear_add_constants(a_s, b_s, y_s, a_zp, b_zp, y_zp)
    va, vb = a.astype(np.float32), b.astype(np.float32)
    c = np.float32(fixed)
    if a.size == 1 or (a.ndim and a.shape[-1] == 1 and b.ndim and b.shape[-1] > 1):
        return _fma32(vb, rb, _fma32(va, ra, c))
    return _fma32(va, ra, _fma32(vb, rb, c))


def conv_float64(x: np.ndarray, w: np.ndarray, geo: ConvGeometry) -> np.ndarray:
    """Direct N-D convolution in float64: a sum over kernel offsets of strided slices."""
    n, c = x.shape[:2]
    m, groups = w.shape[0], geo.group
    cg, mg = c // groups, m // groups
    padded = np.pad(x.astype(np.float64),
                    [(0, 0), (0, 0), *zip(geo.pads_begin, geo.pads_end, strict=True)])
    y = np.zeros((n, m, *geo.out_spatial))
    for offset in itertools.product(*(range(k) for k in geo.kernel)):
        window = tuple(slice(o * d, o * d + (size - 1) * s + 1, s) for o, d, s, size
                       in zip(offset, geo.dilations, geo.strides, geo.out_spatial, strict=True))
        index = (slice(None), slice(None), *window)
        patch = padded[index]
        for g in range(groups):
            w_index: tuple[Any, ...] = (slice(g * mg, (g + 1) * mg), slice(None), *offset)
            taps = w[w_index]   # (mg, cg)
            y[:, g * mg:(g + 1) * mg] += np.einsum(
                "nc...,mc->nm...", patch[:, g * cg:(g + 1) * cg], taps.astype(np.float64))
    return y


def _scalar(op: Op, p: np.ndarray, what: str) -> np.ndarray:
    if p.size != 1:
        raise InvalidArgumentError(f"{op.value}: {what} must be a scalar, got shape {p.shape}")
    return p.reshape(())


def _per_channel(op: Op, p: np.ndarray, m: int, rank: int, what: str,
                 channel_axis: int = 1) -> np.ndarray:
    if p.size == 1:
        return p.reshape(())
    if p.shape != (m,):
        raise InvalidArgumentError(
            f"{op.value}: {what} must be a scalar or have shape ({m},), got {p.shape}"
        )
    return p.reshape([m if i == channel_axis else 1 for i in range(rank)])


@TABLE.kernel(Op.QLINEAR_CONV, dtypes=_QLINEAR)
def qlinear_conv(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Convolution of the zero-point-shifted inputs (+ int32 bias), requantized."""
    x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp = inputs[:8]
    bias = _opt(inputs, 8)
    op = Op.QLINEAR_CONV
    _check_pair(op, x, x_zp, "x")
    _check_pair(op, w, w_zp, "w")
    _require(op, "y_zero_point", _dtype(y_zp), _QLINEAR)
    geo = conv_geometry(x.shape, w.shape, attrs)
    m = w.shape[0]
    w_int = w.astype(np.float64) - _per_channel(op, w_zp, m, w.ndim, "w_zero_point", channel_axis=0)
    acc = conv_float64(x.astype(np.float64) - _scalar(op, x_zp, "x_zero_point"), w_int, geo)
    if bias is not None:
        if bias.shape != (m,) or bias.dtype != np.int32:
            raise InvalidArgumentError(
                f"{op.value}: B must be int32 of shape ({m},), got {bias.dtype} {bias.shape}"
            )
        acc += bias.reshape((1, m) + (1,) * (x.ndim - 2))
    mult = _multiplier(_scalar(op, x_s, "x_scale"),
                       _per_channel(op, w_s, m, x.ndim, "w_scale"),
                       _scalar(op, y_s, "y_scale"))
    y = requantized(acc, mult, _scalar(op, y_zp, "y_zero_point"))
    return [_saturate(y, _dtype(y_zp))]


def _zero_point(p: np.ndarray | None, like: np.ndarray) -> np.ndarray:
    return np.zeros((), like.dtype) if p is None else p


@TABLE.kernel(Op.QGEMM, dtypes=_QLINEAR)
def qgemm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """alpha * (A' - a_zp)(B' - b_zp) + C, requantized (or float32 without y_scale)."""
    a, a_s, a_zp, b, b_s, b_zp = inputs[:6]
    c, y_s, y_zp = _opt(inputs, 6), _opt(inputs, 7), _opt(inputs, 8)
    op = Op.QGEMM
    a_zp, b_zp = _zero_point(a_zp, a), _zero_point(b_zp, b)
    _check_pair(op, a, a_zp, "a")
    _check_pair(op, b, b_zp, "b")
    a_int = a.astype(np.int64) - a_zp.reshape(())
    b_int = b.astype(np.int64) - (b_zp.reshape(-1, 1) if attrs["trans_b"] else b_zp.reshape(-1))
    acc = np.matmul(a_int.T if attrs["trans_a"] else a_int,
                    b_int.T if attrs["trans_b"] else b_int).astype(np.float64)
    if c is not None:
        acc = acc + c.astype(np.float64)
    mult = qgemm_scales(attrs["alpha"], a_s, b_s, y_s)
    if y_s is None:
        return [acc.astype(np.float32) * mult.astype(np.float32)]
    if y_zp is None:
        return [_saturate(requantized(acc, mult, 0.0), DType.UINT8)]
    _require(op, "y_zero_point", _dtype(y_zp), _QLINEAR)
    return [_saturate(requantized(acc, mult, float(y_zp.reshape(()))), _dtype(y_zp))]
