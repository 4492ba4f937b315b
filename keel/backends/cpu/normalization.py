"""cpu kernels of the normalization family, written once against ``ctx.xp``.

float16 inputs are computed in float32 (float64 stays float64). Each kernel
computes into its output buffer where it can: a given ``out`` of the compute
dtype, or one fresh array, so the passes over the data run in place instead
of allocating a temporary per step.

Layer/instance/group normalization and softmax work on blocks of rows of about
64 Ki elements, so each pass over a block (center, square, scale, shift; shift,
exp, scale) runs in cache; row sums are matrix-vector products with a ones
vector (BLAS, ~4x NumPy's row-wise reduce), and the softmax shift is a scalar
per block when the block's spread allows it (see ``_shift``).

With the native tier (``keel.backends.cpu.fastmath``), float32 LayerNormalization
(also fused with its residual Add: ``skip_layer_norm``) and last-axis Softmax /
LogSoftmax run as compiled row kernels (one read and one write per element, sums
in float64; 1.3-2.4x faster, the ``native`` variants below record the
measurements); a strided input is copied first, so a result's bits never depend
on the layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Bind, Inputs, KernelContext, Out
from keel.backends.cpu import fastmath, planner, workspace
from keel.backends.cpu.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
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
    check_skip,
    check_trailing_norm,
    compute_dtype,
)
from keel.ops.types import normalize_axis

__all__: list[str] = []


_MVN_EPSILON = 1e-9


def _ct(xp: Any, op: Op, x: Any, stash_type: int = 1) -> Any:
    """The compute dtype (an xp dtype) after checking that ``x`` is floating point."""
    return xp.float64 if _wide(op, x.dtype, stash_type) else xp.float32


@functools.lru_cache(maxsize=256)
def _wide(op: Op, dtype: Any, stash_type: int) -> bool:
    """Whether ``op`` computes in float64 for inputs of ``dtype`` (checked once)."""
    dt = DType.from_numpy(dtype)
    check_float(op, dt)
    return compute_dtype(op, dt, stash_type) is DType.FLOAT64


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


RowHook = Callable[[Any], None]      # in-place work on a block of finished rows


def _row_block(ctx: KernelContext) -> int:
    """Elements per block of rows: the node plan's row_block (the cpu planner's)."""
    return planner.block(ctx.plan, "row_block")


def _row_blocks(rows: int, k: int, block: int) -> Iterator[tuple[int, int]]:
    """Blocks of rows of about ``block`` elements (the plan's row_block): every pass
    over a block (center, square, scale, shift) runs in cache."""
    step = max(1, block // max(k, 1))
    for r0 in range(0, rows, step):
        yield r0, min(r0 + step, rows)


def _ones(xp: Any, k: int, dtype: Any) -> Any:
    """A ones vector: row sums as a matrix-vector product (BLAS), ~4x a row-wise reduce."""
    return workspace.filled(xp, "normalization.ones", (k,), dtype, 1.0)


def _standardize_rows(xp: Any, x2: Any, y2: Any, eps: float,
                      then: RowHook | None = None, *, block: int) -> tuple[Any, Any]:
    """y2 = (x2 - mean) / sqrt(var + eps) per row; returns mean and inv_std, (R, 1) each.

    Block by block of rows: the mean and the variance of the centered rows are
    matrix-vector products with a ones vector, and ``then`` (an affine step)
    runs on each block while it is still in cache.
    """
    rows, k = y2.shape
    dt = y2.dtype
    if k == 0:
        nan = xp.full((rows, 1), math.nan, dtype=dt)
        return nan, nan.copy()
    mean = xp.empty((rows, 1), dtype=dt)
    inv_std = xp.empty((rows, 1), dtype=dt)
    ones = _ones(xp, k, dt)
    step = max(1, block // k)
    square = workspace.empty(xp, "normalization.square", (min(step, rows), k), dt)
    for r0, r1 in _row_blocks(rows, k, block):
        xb, yb = x2[r0:r1].astype(dt, copy=False), y2[r0:r1]
        m, v = mean[r0:r1, 0], inv_std[r0:r1, 0]
        xp.dot(xb, ones, out=m)
        m *= 1.0 / k
        xp.subtract(xb, m[:, None], out=yb)
        sq = square[:r1 - r0]
        xp.multiply(yb, yb, out=sq)
        xp.dot(sq, ones, out=v)
        v *= 1.0 / k
        v += eps
        xp.sqrt(v, out=v)
        xp.reciprocal(v, out=v)
        yb *= v[:, None]
        if then is not None:
            then(yb)
    return mean, inv_std


def _vector(xp: Any, v: Any, dtype: Any) -> Any:
    return xp.asarray(v).reshape(-1).astype(dtype, copy=False)


def _flat_param(xp: Any, p: Any, norm_shape: tuple[int, ...], dtype: Any) -> Any:
    """A layer-norm parameter broadcast to the normalized shape and flattened."""
    if p.shape == norm_shape and p.flags.c_contiguous:
        return p.reshape(-1).astype(dtype, copy=False)
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


@functools.lru_cache(maxsize=256)
def _trailing_axis(op: Op, x: tuple[int, ...], axis: int, scale: tuple[int, ...],
                   bias: tuple[int, ...] | None) -> int:
    names = ("Scale", "B") if op is Op.LAYER_NORM else ("scale", "B")
    return check_trailing_norm(op, x, axis, {names[0]: scale, names[1]: bias})


def _trailing_rows(x: Any, axis: int) -> tuple[int, int]:
    return math.prod(x.shape[:axis]), math.prod(x.shape[axis:])


# float32, 1 thread, medians of interleaved runs on the 2-core AVX-512 development
# machine: this module's NumPy path / native / onnxruntime.
_LAYER_NORM_MEASURED = ("(4096, 256): 1.24 ms NumPy, 0.56 ms native, 0.58 ms onnxruntime; "
                        "(512, 768): 0.43 / 0.18 / 0.20 ms")
_SOFTMAX_MEASURED = ("softmax (4096, 1024): 4.0 ms NumPy, 2.2 ms native, 1.4 ms onnxruntime; "
                     "(16384, 128): 2.0 / 1.5 / 0.9 ms; log-softmax (4096, 1024): "
                     "5.3 / 2.6 / 1.6 ms")


def _bind_layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                     out: Sequence[Any]) -> Callable[[], object] | None:
    """LayerNorm's native call for one program step (``KernelVariant.bind``): float32
    rows into a contiguous Y, statistics not asked for."""
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    if ctx.xp is not np or len(out) != 1 or x.dtype != np.float32 or \
            _ct(np, Op.LAYER_NORM, x, attrs["stash_type"]) != np.float32:
        return None
    axis = _trailing_axis(Op.LAYER_NORM, x.shape, attrs["axis"], scale.shape,
                          None if bias is None else bias.shape)
    rows, k = _trailing_rows(x, axis)
    y = out[0]
    if not rows or y.dtype != np.float32 or not (y.flags.c_contiguous and x.flags.c_contiguous):
        return None
    norm_shape = tuple(x.shape[axis:])
    gamma = np.ascontiguousarray(_flat_param(np, scale, norm_shape, np.float32))
    beta = None if bias is None else np.ascontiguousarray(
        _flat_param(np, bias, norm_shape, np.float32))
    return fastmath.bound_layer_norm(x.reshape(rows, k), gamma, beta, y.reshape(rows, k),
                                     attrs["epsilon"], threads=ctx.threads)


@TABLE.kernel(Op.LAYER_NORM, dtypes=FLOAT_DTYPES, supports_out=True, bind=_bind_layer_norm)
def layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Standardize rows over X.shape[axis:], then * Scale + B; Mean and InvStdDev too."""
    xp = ctx.xp
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    ct = _ct(xp, Op.LAYER_NORM, x, attrs["stash_type"])
    axis = _trailing_axis(Op.LAYER_NORM, x.shape, attrs["axis"], scale.shape,
                          None if bias is None else bias.shape)
    rows, k = _trailing_rows(x, axis)
    y = _target(xp, out, 0, x.shape, ct, contiguous=True)
    norm_shape = tuple(x.shape[axis:])
    gamma = _flat_param(xp, scale, norm_shape, ct)
    beta = None if bias is None else _flat_param(xp, bias, norm_shape, ct)
    stat_shape = tuple(x.shape[:axis]) + (1,) * (x.ndim - axis)
    stats = out is None or len(out) > 1
    done = None if xp is not np or not rows else _native_layer_norm(
        ctx, x.reshape(rows, k), gamma, beta, y.reshape(rows, k), attrs["epsilon"], stats)
    if done is not None:
        mean, inv_std = done
    else:
        def affine(block: Any) -> None:
            block *= gamma
            if beta is not None:
                block += beta

        mean, inv_std = _standardize_rows(xp, x.reshape(rows, k), y.reshape(rows, k),
                                          attrs["epsilon"], affine, block=_row_block(ctx))
    results = [_finish(out, 0, y, x.dtype)]
    if stats:
        results += [_finish(out, 1, mean.reshape(stat_shape), ct),
                    _finish(out, 2, inv_std.reshape(stat_shape), ct)]
    # As many results as output buffers given; all three when none are.
    return results if out is None else results[:len(out)]


def _native_layer_norm(ctx: KernelContext, x2: Any, gamma: Any, beta: Any | None, y2: Any,
                       epsilon: float, stats: bool) -> tuple[Any, Any] | None:
    """The native row kernel into ``y2``; (mean, inv_std) as (rows, 1) arrays (None
    each unless ``stats``), or None when the case is not served."""
    rows = x2.shape[0]
    mean = np.empty((rows, 1), np.float32) if stats else None
    inv_std = np.empty((rows, 1), np.float32) if stats else None
    # Strided inputs are copied (one pass): the result's bits never depend on the layout.
    x2, gamma = np.ascontiguousarray(x2), np.ascontiguousarray(gamma)
    beta = None if beta is None else np.ascontiguousarray(beta)
    if fastmath.layer_norm(x2, gamma, beta, y2, epsilon, mean, inv_std, ctx.threads):
        return mean, inv_std
    return None


TABLE.kernel(Op.LAYER_NORM, variant="native", dtypes=("float32",), supports_out=True,
             requires="native", priority=1, simd=(), shapes="float32, any layout",
             measured=_LAYER_NORM_MEASURED, bind=_bind_layer_norm)(layer_norm)


@functools.lru_cache(maxsize=256)
def _skip_plan(x: tuple[int, ...], skip: tuple[int, ...], axis: int, scale: tuple[int, ...],
               bias: tuple[int, ...] | None) -> tuple[int, tuple[int, ...], int]:
    """(axis, skip's shape without extra leading 1s, p): row r of X as (rows, k) adds row
    r % p of skip as (p, k); p = 0 when skip varies within a row or repeats other than
    over leading axes (then it is broadcast in full first)."""
    op = Op.SKIP_LAYER_NORM
    check_skip(op, x, skip)
    axis = check_trailing_norm(op, x, axis, {"scale": scale, "B": bias})
    trimmed = skip[max(len(skip) - len(x), 0):]
    padded = (1,) * (len(x) - len(trimmed)) + trimmed
    lead = padded[:axis]
    while lead and lead[0] == 1:
        lead = lead[1:]
    fits = padded[axis:] == x[axis:] and lead == x[axis - len(lead):axis]
    return axis, trimmed, math.prod(lead) if fits else 0


def _skip_rows(skip: Any, plan: tuple[int, tuple[int, ...], int], x_shape: tuple[int, ...],
               k: int) -> Any:
    """skip as a C-contiguous (p, k) matrix for the native kernel (see _skip_plan)."""
    _, trimmed, period = plan
    if period:
        return np.ascontiguousarray(skip).reshape(period, k)
    full = np.broadcast_to(skip.reshape(trimmed), x_shape)
    return np.ascontiguousarray(full).reshape(-1, k)


_SKIP_LAYER_NORM_MEASURED = ("(4096, 256): 0.67 ms Add + native LayerNorm, 0.55 ms native "
                             "fused, 0.72 ms onnxruntime; (512, 768): 0.22 / 0.18 / 0.24 ms")


@TABLE.kernel(Op.SKIP_LAYER_NORM, dtypes=FLOAT_DTYPES, supports_out=True)
def skip_layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """S = X + skip (X's dtype), then LayerNormalization of S into Y; S too when asked."""
    xp = ctx.xp
    x, skip, scale = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    ct = _ct(xp, Op.SKIP_LAYER_NORM, x, attrs["stash_type"])
    if skip.dtype != x.dtype:
        raise InvalidArgumentError(f"{Op.SKIP_LAYER_NORM.value}: skip must have X's dtype "
                                   f"{x.dtype}, got {skip.dtype}")
    plan = _skip_plan(x.shape, skip.shape, attrs["axis"], scale.shape,
                      None if bias is None else bias.shape)
    axis = plan[0]
    rows, k = _trailing_rows(x, axis)
    y = _target(xp, out, 0, x.shape, ct, contiguous=True)
    total = _target(xp, out, 1, x.shape, x.dtype, contiguous=True) \
        if out is None or len(out) > 1 else None
    norm_shape = tuple(x.shape[axis:])
    gamma = _flat_param(xp, scale, norm_shape, ct)
    beta = None if bias is None else _flat_param(xp, bias, norm_shape, ct)
    if not (xp is np and rows and k and x.dtype == np.float32 and _native_skip_layer_norm(
            ctx, x, skip, plan, gamma, beta, y, total, attrs["epsilon"])):
        s = total if total is not None else (y if y.dtype == x.dtype else None)
        s = xp.add(x, skip.reshape(plan[1]), out=s)
        _standardize_rows(xp, s.reshape(rows, k), y.reshape(rows, k), attrs["epsilon"],
                          _affine(gamma, beta), block=_row_block(ctx))
    results = [_finish(out, 0, y, x.dtype)]
    if total is not None:
        results.append(_finish(out, 1, total, x.dtype))
    return results


def _affine(gamma: Any, beta: Any | None) -> RowHook:
    def affine(block: Any) -> None:
        block *= gamma
        if beta is not None:
            block += beta
    return affine


def _native_skip_layer_norm(ctx: KernelContext, x: Any, skip: Any,
                            plan: tuple[int, tuple[int, ...], int], gamma: Any,
                            beta: Any | None, y: Any, total: Any | None, epsilon: float) -> bool:
    """The native row kernel (add, statistics and affine in one pass over each row)."""
    rows, k = _trailing_rows(x, plan[0])
    x2 = np.ascontiguousarray(x).reshape(rows, k)
    return fastmath.skip_layer_norm(
        x2, _skip_rows(skip, plan, x.shape, k), np.ascontiguousarray(gamma),
        None if beta is None else np.ascontiguousarray(beta), y.reshape(rows, k), epsilon,
        None if total is None else total.reshape(rows, k), _skip_threads(ctx))


def _skip_threads(ctx: KernelContext) -> int | None:
    """A SkipLayerNorm's threads: its node plan's (the cpu planner's, from its elements:
    MIN_SKIP_NORM_ELEMENTS a thread), else the backend's."""
    plan = ctx.plan
    return plan.threads if plan is not None and plan.threads else ctx.threads


def _bind_skip_layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                          out: Sequence[Any]) -> Callable[[], object] | None:
    """SkipLayerNorm's native call for one program step (``KernelVariant.bind``): float32,
    every array contiguous, a skip that repeats whole rows (read in place)."""
    x, skip, scale = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    if ctx.xp is not np or x.dtype != np.float32 or skip.dtype != np.float32 or \
            _ct(np, Op.SKIP_LAYER_NORM, x, attrs["stash_type"]) != np.float32:
        return None
    plan = _skip_plan(x.shape, skip.shape, attrs["axis"], scale.shape,
                      None if bias is None else bias.shape)
    rows, k = _trailing_rows(x, plan[0])
    y, total = out[0], out[1] if len(out) > 1 else None
    arrays = (x, skip, y) if total is None else (x, skip, y, total)
    if not (rows and k and plan[2]) or any(
            a.dtype != np.float32 or not a.flags.c_contiguous for a in arrays):
        return None
    norm_shape = tuple(x.shape[plan[0]:])
    gamma = np.ascontiguousarray(_flat_param(np, scale, norm_shape, np.float32))
    beta = None if bias is None else np.ascontiguousarray(
        _flat_param(np, bias, norm_shape, np.float32))
    return fastmath.bound_skip_layer_norm(
        x.reshape(rows, k), skip.reshape(plan[2], k), gamma, beta, y.reshape(rows, k),
        attrs["epsilon"], None if total is None else total.reshape(rows, k),
        _skip_threads(ctx))


TABLE.kernel(Op.SKIP_LAYER_NORM, variant="native", dtypes=("float32",), supports_out=True,
             requires="native", priority=1, simd=(), shapes="float32, any layout",
             measured=_SKIP_LAYER_NORM_MEASURED, bind=_bind_skip_layer_norm)(skip_layer_norm)


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
    _standardize_rows(xp, x.reshape(rows, k), y.reshape(rows, k), attrs["epsilon"],
                      block=_row_block(ctx))
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
    _standardize_rows(xp, x.reshape(n * groups, k), y.reshape(n * groups, k), attrs["epsilon"],
                      block=_row_block(ctx))
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
    axis = _trailing_axis(Op.RMS_NORM, x.shape, attrs["axis"], scale.shape, None)
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


# When a block of rows spans at most twice this much, exp(x - midpoint) lies in
# [e**-64, e**64]: no overflow, no underflow out of the normal float32 range, and
# a row sum stays finite for rows of up to 2**30 elements.
_EXP_SAFE = 64.0


def _shift(xp: Any, xb: Any, axis: int) -> Any:
    """What to subtract from a block before exp: nothing when exp cannot overflow or
    underflow there, a scalar when the block's spread allows it (two contiguous
    reductions, ~7x cheaper than a row-wise max and its broadcast), else the max
    along ``axis`` (NaN and inf take that path too)."""
    hi, lo = float(xb.max()), float(xb.min())
    if lo >= -_EXP_SAFE and hi <= _EXP_SAFE:
        return None
    if hi - lo <= 2 * _EXP_SAFE:
        return xb.dtype.type((hi + lo) / 2)
    return xb.max(axis=axis, keepdims=True)


def _shifted(xp: Any, x: Any, shift: Any, y: Any) -> Any:
    """``x - shift`` into ``y`` (``x`` itself when there is no shift)."""
    if shift is None:
        return x
    xp.subtract(x, shift, out=y)
    return y


def _softmax_setup(ctx: KernelContext, op: Op, inputs: Inputs,
                   attrs: Attrs, out: Out) -> tuple[Any, int, Any]:
    xp = ctx.xp
    x = inputs[0]
    ct = _ct(xp, op, x)
    axis = normalize_axis(attrs["axis"], x.ndim, what=f"{op.value}: axis")
    y = _target(xp, out, 0, x.shape, ct)
    return x, axis, y


def _last_axis_rows(x: Any, axis: int, y: Any) -> tuple[Any, Any] | None:
    """(x2, y2): x and y as (rows, n) matrices when ``axis`` is the last one and
    both reshape without a copy; else None."""
    if axis != x.ndim - 1 or not (x.flags.c_contiguous and y.flags.c_contiguous):
        return None
    n = x.shape[-1] if x.ndim else 1
    return x.reshape(-1, n), y.reshape(-1, n)


def _native_softmax(ctx: KernelContext, x: Any, axis: int, y: Any, mode: str) -> bool:
    """The native row kernel along the last axis of float32 ``x`` into ``y``. A strided
    ``x`` is copied (one pass) so that the result's bits never depend on the layout."""
    if (ctx.xp is not np or axis != x.ndim - 1 or x.dtype != np.float32
            or y.dtype != np.float32):
        return False
    n = x.shape[-1] if x.ndim else 1
    x2 = np.ascontiguousarray(x).reshape(-1, n)
    if y.flags.c_contiguous:
        return fastmath.softmax(x2, y.reshape(-1, n), mode, ctx.threads)
    staged = np.empty(x2.shape, np.float32)
    if not fastmath.softmax(x2, staged, mode, ctx.threads):
        return False
    y[...] = staged.reshape(y.shape)
    return True


@TABLE.kernel(Op.SOFTMAX, dtypes=FLOAT_DTYPES, supports_out=True)
def softmax(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """exp(X - max) / sum(exp(X - max)) along axis, in the output buffer."""
    xp = ctx.xp
    x, axis, y = _softmax_setup(ctx, Op.SOFTMAX, inputs, attrs, out)
    if x.size and not _native_softmax(ctx, x, axis, y, "softmax"):
        with np.errstate(invalid="ignore", over="ignore"):
            rows = _last_axis_rows(x, axis, y)
            if rows is not None:
                _softmax_rows(xp, *rows, False, _row_block(ctx))
            else:
                xp.exp(_shifted(xp, x, _shift(xp, x, axis), y), out=y)
                y /= y.sum(axis=axis, keepdims=True)
    return [_finish(out, 0, y, x.dtype)]


@TABLE.kernel(Op.LOG_SOFTMAX, dtypes=FLOAT_DTYPES, supports_out=True)
def log_softmax(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(X - max) - log(sum(exp(X - max))) along axis, in the output buffer."""
    xp = ctx.xp
    x, axis, y = _softmax_setup(ctx, Op.LOG_SOFTMAX, inputs, attrs, out)
    if x.size and not _native_softmax(ctx, x, axis, y, "log_softmax"):
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            rows = _last_axis_rows(x, axis, y)
            if rows is not None:
                _softmax_rows(xp, *rows, True, _row_block(ctx))
            else:
                shifted = _shifted(xp, x, _shift(xp, x, axis), y)
                log_sum = xp.exp(shifted).sum(axis=axis, keepdims=True)
                xp.log(log_sum, out=log_sum)
                xp.subtract(shifted, log_sum, out=y)
    return [_finish(out, 0, y, x.dtype)]


def _softmax_bind(op: Op, mode: str) -> Bind:
    def bind(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
             out: Sequence[Any]) -> Callable[[], object] | None:
        """The native row kernel for one program step (``KernelVariant.bind``): float32
        along the last axis, X and Y contiguous."""
        x, y = inputs[0], out[0]
        if (ctx.xp is not np or x.dtype != np.float32 or y.dtype != np.float32 or not x.size
                or normalize_axis(attrs["axis"], x.ndim, what=f"{op.value}: axis")
                != x.ndim - 1 or not (x.flags.c_contiguous and y.flags.c_contiguous)):
            return None
        n = x.shape[-1]
        return fastmath.bound_softmax(x.reshape(-1, n), y.reshape(-1, n), mode, ctx.threads)
    return bind


for _op, _fn, _mode in ((Op.SOFTMAX, softmax, "softmax"),
                        (Op.LOG_SOFTMAX, log_softmax, "log_softmax")):
    TABLE.kernel(_op, variant="native", dtypes=("float32",), supports_out=True,
                 requires="native", priority=1, simd=(), bind=_softmax_bind(_op, _mode),
                 shapes="float32, last axis, any layout", measured=_SOFTMAX_MEASURED)(_fn)


def _softmax_rows(xp: Any, x2: Any, y2: Any, log: bool, block: int) -> None:
    """Softmax (or log-softmax) of each row, block by block of rows in cache:
    shift, exp, row sums as a matrix-vector product with a ones vector, scale."""
    rows, n = y2.shape
    dt = y2.dtype
    ones = _ones(xp, n, dt)
    step = min(max(1, block // max(n, 1)), rows)
    sums = workspace.empty(xp, "softmax.sums", (step,), dt)
    for r0, r1 in _row_blocks(rows, n, block):
        xb, yb, total = x2[r0:r1].astype(dt, copy=False), y2[r0:r1], sums[:r1 - r0]
        shifted = _shifted(xp, xb, _shift(xp, xb, 1), yb)
        if log:
            e = workspace.empty(xp, "softmax.exp", (step, n), dt)[:r1 - r0]
            xp.exp(shifted, out=e)
            xp.dot(e, ones, out=total)
            xp.log(total, out=total)
            xp.subtract(shifted, total[:, None], out=yb)
        else:
            xp.exp(shifted, out=yb)
            xp.dot(yb, ones, out=total)
            xp.reciprocal(total, out=total)
            yb *= total[:, None]


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
