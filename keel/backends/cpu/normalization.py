"""cpu kernels of the normalization family, written once against ``ctx.xp``.

float16 inputs are computed in float32 (float64 stays float64). Each kernel
computes into its output buffer where it can: a given ``out`` of the compute
dtype, or one fresh array, so the passes over the data run in place instead
of allocating a temporary per step. Row statistics use a batched dot product
(BLAS) for the sum of squares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from keel.backends.base import KernelContext
from keel.backends.cpu.kernels import TABLE
from keel.dtypes import DType
from keel.errors import UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schemas.normalization import (
    FLOAT_DTYPES,
    check_batch_norm,
    check_float,
    check_group_norm,
    check_instance_norm,
    check_lp_normalization,
    check_lrn,
    check_mvn_axes,
    check_trailing_norm,
    compute_dtype,
)
from keel.ops.types import normalize_axis

__all__: list[str] = []

Inputs = Sequence[Any]
Attrs = Mapping[str, Any]
Out = Sequence[Any] | None

_MVN_EPSILON = 1e-9


def _ct(xp: Any, op: Op, x: Any, stash_type: int = 1) -> Any:
    """The compute dtype (an xp dtype) after checking that ``x`` is floating point."""
    dt = DType.from_numpy(x.dtype)
    check_float(op, dt)
    return xp.float64 if compute_dtype(op, dt, stash_type) is DType.FLOAT64 else xp.float32


def _target(xp: Any, out: Out, i: int, shape: tuple[int, ...], dtype: Any,
            contiguous: bool = False) -> Any:
    """Where to compute output ``i``: the caller's buffer if it fits, else a fresh array."""
    if out is not None and len(out) > i:
        buf = out[i]
        if buf.dtype == dtype and (not contiguous or buf.flags.c_contiguous):
            return buf
    return xp.empty(shape, dtype=dtype)


def _finish(out: Out, i: int, buf: Any, dtype: Any) -> Any:
    """Deliver ``buf`` as output ``i``: into the caller's buffer, or cast to ``dtype``."""
    if out is not None and len(out) > i:
        if buf is not out[i]:
            out[i][...] = buf
        return out[i]
    return buf if buf.dtype == dtype else buf.astype(dtype)


def _sum_squares_rows(xp: Any, y2: Any) -> Any:
    """Sum of squares of each row of a 2-D array, shape (R, 1), by a batched dot."""
    return xp.matmul(y2[:, None, :], y2[:, :, None]).reshape(-1, 1)


def _standardize_rows(xp: Any, x2: Any, y2: Any, eps: float) -> tuple[Any, Any]:
    """y2 = (x2 - mean) / sqrt(var + eps) per row; returns mean and inv_std, (R, 1) each."""
    rows, k = y2.shape
    if k == 0:
        nan = xp.full((rows, 1), math.nan, dtype=y2.dtype)
        return nan, nan.copy()
    mean = x2.mean(axis=1, keepdims=True, dtype=y2.dtype)
    xp.subtract(x2, mean, out=y2)
    inv_std = _sum_squares_rows(xp, y2)
    inv_std /= k
    inv_std += eps
    xp.sqrt(inv_std, out=inv_std)
    xp.reciprocal(inv_std, out=inv_std)
    y2 *= inv_std
    return mean, inv_std


def _vector(xp: Any, v: Any, dtype: Any) -> Any:
    return xp.asarray(v).reshape(-1).astype(dtype, copy=False)


def _flat_param(xp: Any, p: Any, norm_shape: tuple[int, ...], dtype: Any) -> Any:
    """A layer-norm parameter broadcast to the normalized shape and flattened."""
    extra = p.ndim - len(norm_shape)
    if extra > 0:
        p = p.reshape(p.shape[extra:])
    return xp.broadcast_to(p, norm_shape).reshape(-1).astype(dtype, copy=False)


@TABLE.kernel(Op.BATCH_NORM, dtypes=FLOAT_DTYPES, supports_out=True)
def batch_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Y = X * a + b with per-channel a = scale / sqrt(var + eps), b = B - mean * a."""
    xp = ctx.xp
    if attrs["training_mode"]:
        raise UnsupportedOperationError(
            Op.BATCH_NORM.value, ctx.backend,
            detail="training_mode=1 (batch statistics, running-mean updates); "
                   "keel runs BatchNormalization in inference mode only",
        )
    x, scale, bias, mean, var = inputs
    ct = _ct(xp, Op.BATCH_NORM, x)
    check_batch_norm(Op.BATCH_NORM, x.shape, {"scale": scale.shape, "B": bias.shape,
                                              "input_mean": mean.shape,
                                              "input_var": var.shape})
    # The per-channel coefficients are tiny: compute them in float64 for accuracy.
    a = _vector(xp, scale, xp.float64) / xp.sqrt(_vector(xp, var, xp.float64) + attrs["epsilon"])
    b = _vector(xp, bias, xp.float64) - _vector(xp, mean, xp.float64) * a
    bshape = (1, -1) + (1,) * (x.ndim - 2)
    y = _target(xp, out, 0, x.shape, ct)
    xp.multiply(x, a.astype(ct).reshape(bshape), out=y)
    y += b.astype(ct).reshape(bshape)
    return [_finish(out, 0, y, x.dtype)]


def _trailing_rows(x: Any, axis: int) -> tuple[int, int]:
    return math.prod(x.shape[:axis]), math.prod(x.shape[axis:])


@TABLE.kernel(Op.LAYER_NORM, dtypes=FLOAT_DTYPES, supports_out=True)
def layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Standardize rows over X.shape[axis:], then * Scale + B; Mean and InvStdDev too."""
    xp = ctx.xp
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    ct = _ct(xp, Op.LAYER_NORM, x, attrs["stash_type"])
    axis = check_trailing_norm(Op.LAYER_NORM, x.shape, attrs["axis"], {
        "Scale": scale.shape, "B": None if bias is None else bias.shape})
    rows, k = _trailing_rows(x, axis)
    y = _target(xp, out, 0, x.shape, ct, contiguous=True)
    y2 = y.reshape(rows, k)
    mean, inv_std = _standardize_rows(xp, x.reshape(rows, k), y2, attrs["epsilon"])
    norm_shape = tuple(x.shape[axis:])
    y2 *= _flat_param(xp, scale, norm_shape, ct)
    if bias is not None:
        y2 += _flat_param(xp, bias, norm_shape, ct)
    stat_shape = tuple(x.shape[:axis]) + (1,) * (x.ndim - axis)
    results = [_finish(out, 0, y, x.dtype),
               _finish(out, 1, mean.reshape(stat_shape), ct),
               _finish(out, 2, inv_std.reshape(stat_shape), ct)]
    # As many results as output buffers given; all three when none are.
    return results if out is None else results[:len(out)]


@TABLE.kernel(Op.INSTANCE_NORM, dtypes=FLOAT_DTYPES, supports_out=True)
def instance_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Standardize each (n, c) row over the spatial axes, then * scale[c] + B[c]."""
    xp = ctx.xp
    x, scale, bias = inputs
    ct = _ct(xp, Op.INSTANCE_NORM, x)
    check_instance_norm(Op.INSTANCE_NORM, x.shape, scale.shape, bias.shape)
    n, c = x.shape[0], x.shape[1]
    rows, k = n * c, math.prod(x.shape[2:])
    y = _target(xp, out, 0, x.shape, ct, contiguous=True)
    _standardize_rows(xp, x.reshape(rows, k), y.reshape(rows, k), attrs["epsilon"])
    y3 = y.reshape(n, c, k)
    y3 *= _vector(xp, scale, ct).reshape(1, c, 1)
    y3 += _vector(xp, bias, ct).reshape(1, c, 1)
    return [_finish(out, 0, y, x.dtype)]


@TABLE.kernel(Op.GROUP_NORM, dtypes=FLOAT_DTYPES, supports_out=True)
def group_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Standardize each group of channels, then * scale[c] + bias[c]."""
    xp = ctx.xp
    x, scale, bias = inputs
    groups = attrs["num_groups"]
    ct = _ct(xp, Op.GROUP_NORM, x, attrs["stash_type"])
    per_group = check_group_norm(Op.GROUP_NORM, x.shape, groups, scale.shape, bias.shape)
    n, c = x.shape[0], x.shape[1]
    spatial = math.prod(x.shape[2:])
    y = _target(xp, out, 0, x.shape, ct, contiguous=True)
    k = (c // groups) * spatial
    _standardize_rows(xp, x.reshape(n * groups, k), y.reshape(n * groups, k), attrs["epsilon"])
    sc, bi = _vector(xp, scale, ct), _vector(xp, bias, ct)
    if per_group:
        sc, bi = xp.repeat(sc, c // groups), xp.repeat(bi, c // groups)
    y3 = y.reshape(n, c, spatial)
    y3 *= sc.reshape(1, c, 1)
    y3 += bi.reshape(1, c, 1)
    return [_finish(out, 0, y, x.dtype)]


@TABLE.kernel(Op.RMS_NORM, dtypes=FLOAT_DTYPES, supports_out=True)
def rms_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """X / sqrt(mean(X ** 2 over X.shape[axis:]) + epsilon) * scale."""
    xp = ctx.xp
    x, scale = inputs
    ct = _ct(xp, Op.RMS_NORM, x, attrs["stash_type"])
    axis = check_trailing_norm(Op.RMS_NORM, x.shape, attrs["axis"], {"scale": scale.shape})
    rows, k = _trailing_rows(x, axis)
    y = _target(xp, out, 0, x.shape, ct, contiguous=True)
    if y.size:
        x2 = x.reshape(rows, k).astype(ct, copy=False)
        inv_rms = _sum_squares_rows(xp, x2)
        inv_rms /= k
        inv_rms += attrs["epsilon"]
        xp.sqrt(inv_rms, out=inv_rms)
        y2 = y.reshape(rows, k)
        xp.divide(x2, inv_rms, out=y2)
        y2 *= _flat_param(xp, scale, tuple(x.shape[axis:]), ct)
    return [_finish(out, 0, y, x.dtype)]


@TABLE.kernel(Op.LRN, dtypes=FLOAT_DTYPES, supports_out=True)
def lrn(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """X / (bias + alpha / size * windowed channel sum of X ** 2) ** beta."""
    xp = ctx.xp
    x = inputs[0]
    ct = _ct(xp, Op.LRN, x)
    size = attrs["size"]
    check_lrn(Op.LRN, x.shape, size)
    channels = x.shape[1]
    before, after = (size - 1) // 2, math.ceil((size - 1) / 2)
    square = xp.square(x.astype(ct, copy=False))
    y = _target(xp, out, 0, x.shape, ct)
    y[...] = 0
    # One shifted add per window offset (size is small): exact order, no cumsum cancellation.
    for off in range(-before, after + 1):
        lo, hi = max(0, -off), min(channels, channels - off)
        if lo < hi:
            y[:, lo:hi] += square[:, lo + off:hi + off]
    y *= attrs["alpha"] / size
    y += attrs["bias"]
    xp.power(y, attrs["beta"], out=y)
    xp.divide(x, y, out=y)
    return [_finish(out, 0, y, x.dtype)]


@TABLE.kernel(Op.LP_NORMALIZATION, dtypes=FLOAT_DTYPES, supports_out=True)
def lp_normalization(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """X / ||X||_p along axis; a zero norm gives 0."""
    xp = ctx.xp
    x = inputs[0]
    ct = _ct(xp, Op.LP_NORMALIZATION, x)
    axis = check_lp_normalization(Op.LP_NORMALIZATION, x.ndim, attrs["axis"], attrs["p"])
    xf = x.astype(ct, copy=False)
    norm = xp.linalg.norm(xf, ord=attrs["p"], axis=axis, keepdims=True)
    # A zero norm means a zero vector: dividing it by 1 gives the 0 ONNX asks for.
    norm[norm == 0] = 1
    y = _target(xp, out, 0, x.shape, ct)
    xp.divide(xf, norm, out=y)
    return [_finish(out, 0, y, x.dtype)]


@TABLE.kernel(Op.MEAN_VARIANCE_NORM, dtypes=FLOAT_DTYPES, supports_out=True)
def mean_variance_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(X - mean) / (sqrt(variance) + 1e-9) over ``axes``."""
    xp = ctx.xp
    x = inputs[0]
    ct = _ct(xp, Op.MEAN_VARIANCE_NORM, x)
    axes = check_mvn_axes(Op.MEAN_VARIANCE_NORM, x.ndim, attrs["axes"])
    y = _target(xp, out, 0, x.shape, ct)
    if x.size:
        xp.subtract(x, x.mean(axis=axes, keepdims=True, dtype=ct), out=y)
        std = xp.square(y).mean(axis=axes, keepdims=True)
        xp.sqrt(std, out=std)
        std += _MVN_EPSILON
        y /= std
    return [_finish(out, 0, y, x.dtype)]


# When the whole tensor spans at most this much, exp(x - global max) lies in
# [e**-80, 1]: no overflow, no underflow out of the normal float32 range.
_SOFTMAX_SPREAD = 80.0


def _softmax_shift(x: Any, axis: int) -> Any:
    """What to subtract before exp: the max along ``axis`` — or the global max when the
    tensor's spread allows it, which is two contiguous reductions instead of a much
    slower reduction along rows (NaN and inf always take the row-wise path)."""
    hi, lo = x.max(), x.min()
    if float(hi) - float(lo) <= _SOFTMAX_SPREAD:
        return hi
    return x.max(axis=axis, keepdims=True)


def _softmax_setup(ctx: KernelContext, op: Op, inputs: Inputs,
                   attrs: Attrs, out: Out) -> tuple[Any, int, Any]:
    """(x, axis, y) with y = x - max(x), computed into the output buffer."""
    xp = ctx.xp
    x = inputs[0]
    ct = _ct(xp, op, x)
    axis = normalize_axis(attrs["axis"], x.ndim, what=f"{op.value}: axis")
    y = _target(xp, out, 0, x.shape, ct)
    if x.size:
        xp.subtract(x, _softmax_shift(x, axis), out=y)
    return x, axis, y


@TABLE.kernel(Op.SOFTMAX, dtypes=FLOAT_DTYPES, supports_out=True)
def softmax(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """exp(X - max) / sum(exp(X - max)) along axis, in the output buffer."""
    x, axis, y = _softmax_setup(ctx, Op.SOFTMAX, inputs, attrs, out)
    if x.size:
        ctx.xp.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
    return [_finish(out, 0, y, x.dtype)]


@TABLE.kernel(Op.LOG_SOFTMAX, dtypes=FLOAT_DTYPES, supports_out=True)
def log_softmax(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(X - max) - log(sum(exp(X - max))) along axis, in the output buffer."""
    xp = ctx.xp
    x, axis, y = _softmax_setup(ctx, Op.LOG_SOFTMAX, inputs, attrs, out)
    if x.size:
        log_sum = xp.exp(y).sum(axis=axis, keepdims=True)
        xp.log(log_sum, out=log_sum)
        y -= log_sum
    return [_finish(out, 0, y, x.dtype)]


@TABLE.kernel(Op.HARDMAX, dtypes=FLOAT_DTYPES, supports_out=True)
def hardmax(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """1 at the first maximum along axis, 0 elsewhere."""
    xp = ctx.xp
    x = inputs[0]
    _ct(xp, Op.HARDMAX, x)
    axis = normalize_axis(attrs["axis"], x.ndim, what=f"{Op.HARDMAX.value}: axis")
    y = _target(xp, out, 0, x.shape, x.dtype)
    if x.size:
        first_max = xp.expand_dims(xp.argmax(x, axis=axis), axis)
        positions = xp.arange(x.shape[axis]).reshape(
            [-1 if i == axis else 1 for i in range(x.ndim)])
        y[...] = positions == first_max
    return [_finish(out, 0, y, x.dtype)]
