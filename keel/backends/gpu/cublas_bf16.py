"""bfloat16 matrix products on cuBLAS with float32 accumulation (tensor cores).

CuPy's ``matmul`` computes bfloat16 by widening to a float32 GEMM (no tensor
cores), so keel calls cuBLAS itself: ``cublasGemmEx`` (one product) or
``cublasGemmStridedBatchedEx`` (a batch), with bfloat16 (``CUDA_R_16BF``)
operands and output and ``CUBLAS_COMPUTE_32F``, through CuPy's own binding
(``cupy.cuda.cublas``) on CuPy's cuBLAS handle and current stream. cuBLAS is
column-major: the row-major ``Y = A @ B`` is the column-major ``Y^T = B^T A^T``,
so B goes first, and a transposed 2-D view is passed as the transpose flag
rather than copied. The enum values are CUDA's (stable across releases); CuPy's
names are used where it has them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from keel.backends.gpu.cudnn_graph import address

__all__ = ["product"]

# Host scalars alpha = 1 and beta = 0 (cuBLAS reads them when the call is made).
_one = np.ones(1, np.float32)
_zero = np.zeros(1, np.float32)


def _enum(module: Any, name: str, value: int) -> int:
    return int(getattr(module, name, value))


def _operand(xp: Any, x: Any) -> tuple[Any, int, int]:
    """(array, cuBLAS op, leading dimension) of a 2-D row-major operand as the column-major
    call needs it transposed: a C-contiguous array as it is, a transposed view as the
    transpose flag, anything else copied."""
    if x.flags.c_contiguous:
        return x, 0, int(x.shape[1])                       # CUBLAS_OP_N
    if x.T.flags.c_contiguous:
        return x, 1, int(x.shape[0])                       # CUBLAS_OP_T
    x = xp.ascontiguousarray(x)
    return x, 0, int(x.shape[1])


def _stacked(xp: Any, x: Any, batch: tuple[int, ...]) -> tuple[Any, int]:
    """``x`` as a contiguous stack of ``batch`` matrices and the element stride between
    them (0: one matrix shared by every product)."""
    if x.ndim == 2:
        return xp.ascontiguousarray(x), 0
    full = xp.ascontiguousarray(xp.broadcast_to(x, (*batch, *x.shape[-2:])))
    return full, int(x.shape[-2] * x.shape[-1])


def product(xp: Any, a: Any, b: Any, y: Any) -> None:
    """``y = a @ b`` for bfloat16 ``a`` (..., M, K), ``b`` (..., K, N) and a C-contiguous
    ``y`` (..., M, N) of their broadcast batch."""
    m, k, n = int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
    if b.ndim == 2 and a.ndim > 2:                  # every leading dim of A is rows
        a = xp.ascontiguousarray(a).reshape(-1, k)
        m = int(a.shape[0])
    lib, runtime = xp.cuda.cublas, xp.cuda.runtime
    bf16 = _enum(runtime, "CUDA_R_16BF", 14)
    compute = _enum(lib, "CUBLAS_COMPUTE_32F", 68)
    algo = _enum(lib, "CUBLAS_GEMM_DEFAULT", -1)
    handle = xp.cuda.device.get_cublas_handle()
    lib.setStream(handle, int(xp.cuda.get_current_stream().ptr))
    if a.ndim == 2 and b.ndim == 2:
        (bb, op_b, ld_b), (aa, op_a, ld_a) = _operand(xp, b), _operand(xp, a)
        lib.gemmEx(handle, op_b, op_a, n, m, k, _one.ctypes.data, address(bb), bf16, ld_b,
                   address(aa), bf16, ld_a, _zero.ctypes.data, address(y), bf16, n,
                   compute, algo)
        return
    batch = tuple(int(d) for d in y.shape[:-2])
    (bb, stride_b), (aa, stride_a) = _stacked(xp, b, batch), _stacked(xp, a, batch)
    lib.gemmStridedBatchedEx(handle, 0, 0, n, m, k, _one.ctypes.data, address(bb), bf16, n,
                             stride_b, address(aa), bf16, k, stride_a, _zero.ctypes.data,
                             address(y), bf16, n, m * n, math.prod(batch), compute, algo)
