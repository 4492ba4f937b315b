"""Row kernels of the gpu backend: LayerNormalization (plain and with its residual
add), Softmax and LogSoftmax, one CUDA block per row.

LayerNorm reads each row twice from L1/L2 (the mean, then the centered
variance: no cancellation) and writes it once; statistics are float32 for
float16 and float32 inputs. Softmax takes the row max and the sum of
``exp(x - max)`` with warp shuffles, then writes the row. Threads per row come
from the gpu planner (``planner.row_threads``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.gpu import fused_cuda as cu
from keel.backends.gpu import planner
from keel.backends.gpu.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.normalization import check_skip, check_trailing_norm, compute_dtype
from keel.ops.types import normalize_axis

__all__: list[str] = []

_DTYPES = ("float16", "bfloat16", "float32")

_LAYER_NORM = r"""
extern "C" __global__ void keel_layer_norm(
        const T* x, const T* skip, const T* gamma, const T* beta, T* y, T* total,
        float* mean_out, float* rstd_out, long long k, long long period, float eps) {
    __shared__ float shm[32];
    long long r = blockIdx.x;
    const T* xr = x + r * k;
    const T* sr = skip ? skip + (r % period) * k : 0;
    T* tr = total ? total + r * k : 0;
    float s = 0.f;
    for (long long j = threadIdx.x; j < k; j += blockDim.x) {
        float v = kload(xr, j);
        if (sr) {
            v = kround(v + kload(sr, j), xr);
            if (tr) kstore(tr, j, v);
        }
        s += v;
    }
    float mean = block_sum(s, shm) / (float)k;
    float q = 0.f;
    for (long long j = threadIdx.x; j < k; j += blockDim.x) {
        float v = sr ? kround(kload(xr, j) + kload(sr, j), xr) : kload(xr, j);
        float d = v - mean;
        q += d * d;
    }
    float rstd = rsqrtf(block_sum(q, shm) / (float)k + eps);
    T* yr = y + r * k;
    for (long long j = threadIdx.x; j < k; j += blockDim.x) {
        float v = sr ? kround(kload(xr, j) + kload(sr, j), xr) : kload(xr, j);
        float o = (v - mean) * rstd * kload(gamma, j);
        if (beta) o += kload(beta, j);
        kstore(yr, j, o);
    }
    if (threadIdx.x == 0) {
        if (mean_out) mean_out[r] = mean;
        if (rstd_out) rstd_out[r] = rstd;
    }
}
"""

# mode 0: softmax, 1: log-softmax. The scores are scaled, optionally causally masked
# (column j > row % s hidden) before the row max; ``in`` may be ``out``.
_SOFTMAX = r"""
extern "C" __global__ void keel_softmax(const T* in, T* out, long long n, float scale,
                                        int causal, long long s, int mode) {
    __shared__ float shm[32];
    long long r = blockIdx.x;
    const T* xr = in + r * n;
    T* yr = out + r * n;
    long long last = causal ? (r % s) : n - 1;
    const float ninf = __int_as_float(0xff800000);
    float m = ninf;
    for (long long j = threadIdx.x; j < n; j += blockDim.x)
        if (j <= last) m = fmaxf(m, kload(xr, j) * scale);
    m = block_max(m, shm);
    float sum = 0.f;
    for (long long j = threadIdx.x; j < n; j += blockDim.x)
        if (j <= last) sum += expf(kload(xr, j) * scale - m);
    sum = block_sum(sum, shm);
    float lse = m + logf(sum);
    float inv = 1.f / sum;
    for (long long j = threadIdx.x; j < n; j += blockDim.x) {
        float v = j <= last ? kload(xr, j) * scale : ninf;
        kstore(yr, j, mode ? v - lse : expf(v - m) * inv);
    }
}
"""


def _param(xp: Any, p: Any, norm_shape: tuple[int, ...], dtype: Any) -> Any:
    """A scale/bias broadcast to the normalized shape: contiguous, flat, of X's dtype."""
    extra = p.ndim - len(norm_shape)
    if extra > 0:
        p = p.reshape(p.shape[extra:])
    if p.shape != norm_shape:
        p = xp.broadcast_to(p, norm_shape)
    return xp.ascontiguousarray(p.astype(dtype, copy=False)).reshape(-1)


def _stats_dtype(op: Op, x: Any, stash_type: int) -> Any:
    return compute_dtype(op, DType.from_numpy(x.dtype), stash_type).numpy


def _out(xp: Any, out: Out, i: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """Output ``i``: the caller's buffer when it is contiguous and of ``dtype``."""
    if out is not None and len(out) > i and out[i] is not None:
        buf = out[i]
        if buf.dtype == dtype and buf.flags.c_contiguous:
            return buf
    return xp.empty(shape, dtype=dtype)


def _deliver(out: Out, i: int, buf: Any) -> Any:
    if out is not None and len(out) > i and out[i] is not None and out[i] is not buf:
        out[i][...] = buf
        return out[i]
    return buf


def _row_norm(ctx: KernelContext, x: Any, skip: Any, period: int, gamma: Any, beta: Any,
              y: Any, total: Any, stats: tuple[Any, Any] | None, eps: float, k: int) -> None:
    xp = ctx.xp
    rows = x.size // k if k else 0
    if rows == 0:
        return
    kernel = cu.raw_kernel(xp, "keel_layer_norm", _LAYER_NORM, cu.ctype("layer_norm", x.dtype))
    null = cu.absent()
    mean, rstd = stats if stats is not None else (null, null)
    cu.launch(kernel, rows, planner.row_threads(ctx.plan, k),
              (x, null if skip is None else skip, gamma, null if beta is None else beta, y,
               null if total is None else total, mean, rstd, np.int64(k),
               np.int64(max(period, 1)), np.float32(eps)))


def _layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """LayerNormalization in one kernel; Mean and InvStdDev when asked for."""
    xp = ctx.xp
    x = xp.ascontiguousarray(inputs[0])
    scale, bias = inputs[1], inputs[2] if len(inputs) > 2 else None
    axis = check_trailing_norm(Op.LAYER_NORM, x.shape, attrs["axis"],
                               {"Scale": scale.shape, "B": None if bias is None else bias.shape})
    norm_shape = tuple(x.shape[axis:])
    k = math.prod(norm_shape)
    y = _out(xp, out, 0, x.shape, x.dtype)
    want_stats = out is None or len(out) > 1
    stat_shape = tuple(x.shape[:axis]) + (1,) * (x.ndim - axis)
    stats = (xp.empty(stat_shape, np.float32), xp.empty(stat_shape, np.float32)) \
        if want_stats else None
    if k == 0 and stats is not None:
        stats[0].fill(math.nan)
        stats[1].fill(math.nan)
    _row_norm(ctx, x, None, 1, _param(xp, scale, norm_shape, x.dtype),
              None if bias is None else _param(xp, bias, norm_shape, x.dtype), y, None,
              stats, attrs["epsilon"], k)
    results = [_deliver(out, 0, y)]
    if stats is not None:
        sdt = _stats_dtype(Op.LAYER_NORM, x, attrs["stash_type"])
        results += [_deliver(out, i + 1, s.astype(sdt, copy=False))
                    for i, s in enumerate(stats)]
    return results if out is None else results[:len(out)]


def _skip_rows(xp: Any, x_shape: tuple[int, ...], skip: Any, axis: int) -> tuple[Any, int]:
    """skip as contiguous rows of k elements and its period in rows: row r of X adds
    row r % period of skip (broadcast in full when it varies otherwise)."""
    trimmed = skip.reshape(skip.shape[max(skip.ndim - len(x_shape), 0):])
    padded = (1,) * (len(x_shape) - trimmed.ndim) + tuple(trimmed.shape)
    lead = padded[:axis]
    while lead and lead[0] == 1:
        lead = lead[1:]
    if padded[axis:] == x_shape[axis:] and lead == x_shape[axis - len(lead):axis]:
        return xp.ascontiguousarray(trimmed), math.prod(lead)
    full = xp.ascontiguousarray(xp.broadcast_to(trimmed.reshape(padded), x_shape))
    return full, math.prod(x_shape[:axis])


def _skip_layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """S = X + skip (rounded to X's dtype), LayerNorm of S into Y, S too when asked."""
    xp = ctx.xp
    x = xp.ascontiguousarray(inputs[0])
    skip, scale = inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    if skip.dtype != x.dtype:
        raise InvalidArgumentError(f"{Op.SKIP_LAYER_NORM.value}: skip must have X's dtype "
                                   f"{x.dtype}, got {skip.dtype}")
    check_skip(Op.SKIP_LAYER_NORM, x.shape, skip.shape)
    axis = check_trailing_norm(Op.SKIP_LAYER_NORM, x.shape, attrs["axis"],
                               {"scale": scale.shape, "B": None if bias is None else bias.shape})
    norm_shape = tuple(x.shape[axis:])
    k = math.prod(norm_shape)
    rows, period = _skip_rows(xp, tuple(x.shape), skip, axis)
    y = _out(xp, out, 0, x.shape, x.dtype)
    total = _out(xp, out, 1, x.shape, x.dtype) if out is None or len(out) > 1 else None
    _row_norm(ctx, x, rows, period, _param(xp, scale, norm_shape, x.dtype),
              None if bias is None else _param(xp, bias, norm_shape, x.dtype), y, total,
              None, attrs["epsilon"], k)
    results = [_deliver(out, 0, y)]
    if total is not None:
        results.append(_deliver(out, 1, total))
    return results


def run_softmax(ctx: KernelContext, scores: Any, y: Any, scale: float, causal: bool,
                log: bool) -> None:
    """Softmax (or log-softmax) over the last axis of contiguous ``scores`` into
    contiguous ``y`` (may be ``scores``), after ``* scale`` and the causal mask."""
    n = scores.shape[-1] if scores.ndim else 1
    rows = scores.size // n if n else 0
    if rows == 0:
        return
    xp = ctx.xp
    kernel = cu.raw_kernel(xp, "keel_softmax", _SOFTMAX, cu.ctype("softmax", scores.dtype))
    s = scores.shape[-2] if scores.ndim >= 2 else 1
    cu.launch(kernel, rows, planner.row_threads(ctx.plan, n),
              (scores, y, np.int64(n), np.float32(scale), np.int32(causal), np.int64(s),
               np.int32(log)))


def _softmax_kernel(op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        xp, x = ctx.xp, inputs[0]
        axis = normalize_axis(attrs["axis"], max(x.ndim, 1), what=f"{op.value}: axis")
        last = x.ndim == 0 or axis == x.ndim - 1
        src = xp.ascontiguousarray(x if last else xp.moveaxis(x, axis, -1))
        y = _out(xp, out, 0, src.shape, x.dtype) if last else xp.empty_like(src)
        run_softmax(ctx, src, y, 1.0, False, op is Op.LOG_SOFTMAX)
        if not last:
            y = xp.moveaxis(y, -1, axis)
            if out is not None:
                out[0][...] = y
                return [out[0]]
            return [xp.ascontiguousarray(y)]
        return [_deliver(out, 0, y)]
    kernel.__doc__ = f"{op.value} in one row kernel (another axis is moved last first)."
    return kernel


_SHAPES = "float16/bfloat16/float32, any shape (statistics in float32)"
TABLE.kernel(Op.LAYER_NORM, variant="fused", dtypes=_DTYPES, supports_out=True,
             shapes=_SHAPES, gpu=True)(_layer_norm)
TABLE.kernel(Op.SKIP_LAYER_NORM, variant="fused", dtypes=_DTYPES, supports_out=True,
             shapes=_SHAPES, gpu=True)(_skip_layer_norm)
for _op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
    TABLE.kernel(_op, variant="fused", dtypes=_DTYPES, supports_out=True,
                 shapes="float16/bfloat16/float32, any axis (the last one without a copy)",
                 gpu=True)(_softmax_kernel(_op))
