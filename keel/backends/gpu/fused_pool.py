"""Pooling kernels of the gpu backend: MaxPool / AveragePool over 1-D and 2-D windows
(one thread per output element, every tap read directly from the unpadded input) and
GlobalAveragePool / GlobalMaxPool (one CUDA block per (n, c) row, warp reductions).

Sums are float32 for float16 and float32 inputs. MaxPool's optional Indices output
and 3-D windows are the shared xp kernel's: this variant computes Y only and hands
any other case to it.
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
from keel.ops.registry import Op
from keel.ops.schemas.pooling import check_pool_input, pool_window

__all__: list[str] = []

_DTYPES = ("float16", "bfloat16", "float32")

# mode 0: max, 1: average over in-bounds taps, 2: average counting the padding
# (taps inside the padded extent).
_WINDOW = r"""
extern "C" __global__ void keel_pool2d(
        const T* x, T* y, long long total, int h, int w, int oh, int ow,
        int kh, int kw, int sh, int sw, int dh, int dw, int ph, int pw, int pe_h, int pe_w,
        int mode) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    int ox = (int)(i % ow);
    int oy = (int)((i / ow) % oh);
    long long plane = i / ((long long)ow * oh);
    const T* xp = x + plane * (long long)h * w;
    float acc = mode ? 0.f : __int_as_float(0xff800000);
    int count = 0;
    for (int a = 0; a < kh; ++a) {
        int iy = oy * sh - ph + a * dh;
        for (int b = 0; b < kw; ++b) {
            int ix = ox * sw - pw + b * dw;
            bool inside = iy >= 0 && iy < h && ix >= 0 && ix < w;
            if (mode == 2) {
                if (iy < h + pe_h && ix < w + pe_w) ++count;
            } else if (inside) {
                ++count;
            }
            if (!inside) continue;
            float v = kload(xp, (long long)iy * w + ix);
            if (mode) acc += v;
            else if (v > acc || v != v) acc = v;
        }
    }
    kstore(y, i, mode ? acc / (float)count : acc);
}
"""

# mode 0: mean, 1: max of each row of n elements.
_ROWS = r"""
extern "C" __global__ void keel_row_reduce(const T* x, T* y, long long n, int mode) {
    __shared__ float shm[32];
    const T* xr = x + (long long)blockIdx.x * n;
    float acc = mode ? __int_as_float(0xff800000) : 0.f;
    bool nan = false;
    for (long long j = threadIdx.x; j < n; j += blockDim.x) {
        float v = kload(xr, j);
        nan = nan || v != v;
        acc = mode ? fmaxf(acc, v) : acc + v;
    }
    acc = mode ? block_max(acc, shm) : block_sum(acc, shm);
    bool any_nan = block_sum(nan ? 1.f : 0.f, shm) > 0.f;
    if (threadIdx.x == 0)
        kstore(y, blockIdx.x, mode ? (any_nan ? __int_as_float(0x7fc00000) : acc)
                                   : acc / (float)n);
}
"""


def _as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    return (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])


def _window_kernel(op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        xp, x = ctx.xp, inputs[0]
        check_pool_input(op, x.shape, DType.from_numpy(x.dtype))
        win = pool_window(op, tuple(x.shape), dict(attrs))
        wants_indices = op is Op.MAX_POOL and (out is None or len(out) > 1)
        if win.rank > 2 or wants_indices:
            return list(cu.shared(op)(ctx, inputs, attrs, out))
        shape = (x.shape[0], x.shape[1], *win.out_spatial)
        y = out[0] if out is not None and out[0].flags.c_contiguous else xp.empty(shape, x.dtype)
        total = math.prod(shape)
        if total:
            _launch_window(ctx, op, xp.ascontiguousarray(x), y, win, total, attrs)
        if out is not None and out[0] is not y:
            out[0][...] = y
            return [out[0]]
        return [y]
    kernel.__doc__ = f"{op.value}: one thread per output element, taps read in place."
    return kernel


def _launch_window(ctx: KernelContext, op: Op, x: Any, y: Any, win: Any, total: int,
                   attrs: Attrs) -> None:
    h, w = _as_2d(win.in_spatial)
    oh, ow = _as_2d(win.out_spatial)
    kh, kw = _as_2d(win.kernel)
    sh, sw = _as_2d(win.strides)
    dh, dw = _as_2d(win.dilations)
    ph, pw = (0, win.pads_begin[0]) if win.rank == 1 else win.pads_begin
    eh, ew = (0, win.pads_end[0]) if win.rank == 1 else win.pads_end
    mode = 0 if op is Op.MAX_POOL else (2 if attrs.get("count_include_pad") else 1)
    block = planner.elementwise_threads(ctx.plan)
    kernel = cu.raw_kernel(ctx.xp, "keel_pool2d", _WINDOW, cu.ctype(op.value, x.dtype))
    ints = (h, w, oh, ow, kh, kw, sh, sw, dh, dw, ph, pw, eh, ew, mode)
    cu.launch(kernel, -(-total // block), block,
              (x, y, np.int64(total), *(np.int32(v) for v in ints)))


def _global_kernel(op: Op) -> Any:
    mode = 1 if op is Op.GLOBAL_MAX_POOL else 0

    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        xp, x = ctx.xp, inputs[0]
        check_pool_input(op, x.shape, DType.from_numpy(x.dtype))
        n, c = x.shape[:2]
        count = math.prod(x.shape[2:])
        shape = (n, c, *([1] * (x.ndim - 2)))
        y = out[0] if out is not None and out[0].flags.c_contiguous else xp.empty(shape, x.dtype)
        if count == 0:
            y.fill(np.nan)
        elif n * c:
            raw = cu.raw_kernel(xp, "keel_row_reduce", _ROWS, cu.ctype(op.value, x.dtype))
            cu.launch(raw, n * c, planner.row_threads(ctx.plan, count),
                      (xp.ascontiguousarray(x), y, np.int64(count), np.int32(mode)))
        if out is not None and out[0] is not y:
            out[0][...] = y
            return [out[0]]
        return [y]
    kernel.__doc__ = f"{op.value}: one block per (n, c) row, warp-shuffle reductions."
    return kernel


for _op in (Op.MAX_POOL, Op.AVG_POOL):
    TABLE.kernel(_op, variant="direct", dtypes=_DTYPES, supports_out=True, gpu=True,
                 shapes="1-D and 2-D windows (others, and Indices: the shared kernel)"
                 )(_window_kernel(_op))
for _op in (Op.GLOBAL_AVG_POOL, Op.GLOBAL_MAX_POOL):
    TABLE.kernel(_op, variant="direct", dtypes=_DTYPES, supports_out=True, gpu=True,
                 shapes="any rank")(_global_kernel(_op))
