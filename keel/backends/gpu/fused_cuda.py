"""Compiling and launching the gpu backend's own CUDA kernels (CuPy ``RawKernel``).

Every kernel source here is compiled once per (kernel, element type) through
CuPy (NVRTC) and cached for the process; CuPy also keeps the binary on disk.
Kernels launch on CuPy's current stream, allocate nothing and never read a
device value on the host, so a run of them can be captured into a CUDA graph.

Element types: ``float`` (float32), ``half_t`` (float16, stored as its 16 bits)
and ``bf16_t`` (bfloat16, a struct of its 16 bits, the layout of CUDA's
``__nv_bfloat16``); each is loaded into and stored from float registers with
``kload`` / ``kstore`` (a shift for bfloat16 loads, PTX conversions rounding to
nearest even for the stores, so no CUDA header is needed; ``cvt.rn.bf16.f32``
needs sm_80), and every sum is taken in float32.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel._fork import renew_after_fork
from keel.backends.base import Kernel
from keel.dtypes import DType
from keel.errors import UnsupportedOperationError
from keel.ops.registry import Op

__all__ = ["PRELUDE", "absent", "cached", "ctype", "launch", "raw_kernel", "shared", "source"]

# Device helpers shared by every kernel: float loads/stores of both element types,
# rounding to the element type, warp and block reductions (blockDim.x a multiple of
# 32, at most 1024; ``shm`` holds 32 floats).
PRELUDE = r"""
typedef unsigned short half_t;
__device__ __forceinline__ float kload(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float kload(const half_t* p, long long i) {
    float f; half_t h = p[i];
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ void kstore(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void kstore(half_t* p, long long i, float v) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i] = h;
}
struct bf16_t { unsigned short bits; };
__device__ __forceinline__ float kload(const bf16_t* p, long long i) {
    return __uint_as_float(((unsigned int)p[i].bits) << 16);
}
__device__ __forceinline__ void kstore(bf16_t* p, long long i, float v) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i].bits = h;
}
__device__ __forceinline__ float kround(float v, const float*) { return v; }
__device__ __forceinline__ float kround(float v, const bf16_t*) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ float kround(float v, const half_t*) {
    half_t h; float f;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// A block-wide sum (MAX false) or max (MAX true); every thread gets the result.
template <bool MAX> __device__ float block_reduce(float v, float* shm) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) shm[warp] = v;
    __syncthreads();
    v = lane < warps ? shm[lane] : (MAX ? __int_as_float(0xff800000) : 0.f);
    return MAX ? warp_max(v) : warp_sum(v);
}
__device__ __forceinline__ float block_sum(float v, float* shm) {
    return block_reduce<false>(v, shm);
}
__device__ __forceinline__ float block_max(float v, float* shm) {
    return block_reduce<true>(v, shm);
}
"""

_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "half_t",
           DType.BFLOAT16.numpy: "bf16_t"}
_LOCK = threading.Lock()
renew_after_fork(sys.modules[__name__], "_LOCK")   # free in a forked child
_BUILT: dict[tuple[Any, ...], Any] = {}


def cached(key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """``build()`` once per process for ``key`` (compiled kernels: CuPy compiles each once
    per dtype on its first launch and keeps the binary)."""
    found = _BUILT.get(key)
    if found is None:
        with _LOCK:
            found = _BUILT.get(key)
            if found is None:
                found = _BUILT[key] = build()
    return found


def ctype(op: str, dtype: Any) -> str:
    """The kernel element type of ``dtype``; other dtypes are not served by these kernels."""
    try:
        return _CTYPES[np.dtype(dtype)]
    except KeyError:
        raise UnsupportedOperationError(
            op, "gpu", detail=f"dtype {np.dtype(dtype).name}: the fused CUDA kernels take "
                              "float16, bfloat16 and float32") from None


def source(body: str, element: str) -> str:
    """A full kernel source: the prelude, ``T`` bound to ``element``, then ``body``."""
    return f"{PRELUDE}\ntypedef {element} T;\n{body}"


def raw_kernel(cp: Any, name: str, body: str, element: str) -> Any:
    """The ``RawKernel`` ``name`` of ``body`` for ``element``: built once per process."""
    return cached((id(cp), name, element),
                  lambda: cp.RawKernel(source(body, element), name))


def shared(op: Op) -> Kernel:
    """The shared xp kernel of ``op`` (the cpu package's ``default``), for the cases a
    gpu kernel hands on."""
    from keel.backends.cpu import kernels as cpu

    return cpu.load().get(op).fn


def absent() -> np.uint64:
    """A null device pointer argument (an optional array not given)."""
    return np.uint64(0)


def launch(kernel: Any, grid: int | Sequence[int], block: int, args: Sequence[Any],
           shared_bytes: int = 0) -> None:
    """Launch on CuPy's current stream (the RawKernel default): nothing synchronizes."""
    g = (grid,) if isinstance(grid, int) else tuple(grid)
    kernel(g, (block,), tuple(args), shared_mem=shared_bytes)
