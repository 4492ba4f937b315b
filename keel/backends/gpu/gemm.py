"""GEMM-shaped ops of the gpu backend on cuBLAS (through ``cupy.matmul``), each with its
epilogue fused into one elementwise pass after the product.

* Gemm: ``act(alpha * A' @ B' + beta * C)``: transposes are views (cuBLAS takes them
  as its transpose flags), the product goes into the output, then one pass applies
  alpha, C and the activation.
* MatMul: ``act(A @ B + bias)``: with a 2-D B, every leading dimension of A folds into
  the rows of one GEMM; a batched B is one strided-batched GEMM.
* Attention: ``softmax(Q @ K^T * scale + mask) @ V``: two batched GEMMs with one row
  kernel between them that scales, masks (causal in the kernel; an additive or boolean
  mask in one pass before it) and normalizes the scores in place.

float16 runs in float16 with float32 accumulation (CuPy's default compute type for
half). bfloat16 runs in bfloat16 with float32 accumulation on cuBLAS's ``GemmEx``
calls (``keel.backends.gpu.cublas_bf16``: CuPy's matmul would widen it to a float32
GEMM). float32 runs in plain float32: CuPy uses TF32 only when ``CUPY_TF32=1`` is set
in the environment, which keel never sets.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.gpu import cublas_bf16
from keel.backends.gpu.fused_elementwise import apply_epilogue, epilogue_of
from keel.backends.gpu.fused_norm import run_softmax
from keel.backends.gpu.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.matmul import attention_shape, check_bias, gemm_shape, matmul_shape

__all__: list[str] = []

_DTYPES = ("float16", "bfloat16", "float32")


def _same_dtype(op: Op, *arrays: Any) -> Any:
    dtypes = {a.dtype for a in arrays if a is not None}
    if len(dtypes) != 1:
        raise InvalidArgumentError(f"{op.value} needs inputs of one dtype, got "
                                   f"{', '.join(sorted(str(d) for d in dtypes))}")
    return dtypes.pop()


def _static(shape: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def _output(xp: Any, out: Out, shape: tuple[int, ...], dtype: Any) -> Any:
    if out is not None and out[0] is not None:
        buf = out[0]
        if buf.dtype == dtype and tuple(buf.shape) == shape and buf.flags.c_contiguous:
            return buf
    return xp.empty(shape, dtype=dtype)


def _target(op: Op, xp: Any, out: Out, shape: Any, operands: tuple[Any, ...], bias: Any,
            bias_name: str) -> Any:
    """The output buffer of a product of ``operands`` (one dtype) plus ``bias``."""
    dtype = _same_dtype(op, *operands, bias)
    dims = _static(shape)
    if bias is not None:
        check_bias(op, dims, bias.shape, bias_name)
    return _output(xp, out, dims, dtype)


def _product(xp: Any, a: Any, b: Any, y: Any) -> None:
    """``y = a @ b`` on cuBLAS: CuPy's matmul, bfloat16 through its GemmEx calls."""
    if y.dtype == DType.BFLOAT16.numpy:
        cublas_bf16.product(xp, a, b, y)
    else:
        xp.matmul(a, b, out=y)


def _scores(xp: Any, q: Any, kt: Any) -> Any:
    """``q @ kt`` (batched) into a new array."""
    if q.dtype != DType.BFLOAT16.numpy:
        return xp.matmul(q, kt)
    rows = np.broadcast_shapes(tuple(q.shape[:-1]), (*kt.shape[:-2], 1))
    scores = xp.empty((*rows, int(kt.shape[-1])), dtype=q.dtype)
    cublas_bf16.product(xp, q, kt, scores)
    return scores


def _deliver(out: Out, y: Any) -> list[Any]:
    if out is not None and out[0] is not None and out[0] is not y:
        out[0][...] = y
        return [out[0]]
    return [y]


@TABLE.kernel(Op.GEMM, variant="cublas", dtypes=_DTYPES, supports_out=True, gpu=True,
              shapes="2-D A and B (either transposed), C broadcast to (M, N)")
def gemm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """act(alpha * A' @ B' + beta * C): one cuBLAS GEMM, then one fused pass."""
    xp = ctx.xp
    a, b, c = inputs[0], inputs[1], optional_input(inputs, 2)
    y = _target(Op.GEMM, xp, out, gemm_shape(a.shape, b.shape, attrs["trans_a"],
                                             attrs["trans_b"]), (a, b), c, "C")
    if y.size:
        _product(xp, a.T if attrs["trans_a"] else a, b.T if attrs["trans_b"] else b, y)
    elif c is None:
        return _deliver(out, y)
    beta = float(attrs["beta"])
    addend = c if c is not None and beta != 0.0 else None
    name, params = epilogue_of(attrs)
    apply_epilogue(xp, y, name, params, float(attrs["alpha"]), addend, beta)
    return _deliver(out, y)


@TABLE.kernel(Op.MATMUL, variant="cublas", dtypes=_DTYPES, supports_out=True, gpu=True,
              shapes="any ranks (NumPy matmul broadcasting), bias over the last axis")
def matmul(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """act(A @ B + bias): one (batched) cuBLAS GEMM, then one fused pass."""
    xp = ctx.xp
    a, b, bias = inputs[0], inputs[1], optional_input(inputs, 2)
    y = _target(Op.MATMUL, xp, out, matmul_shape(a.shape, b.shape), (a, b), bias, "bias")
    if y.size:
        if b.ndim == 2 and a.ndim > 2:
            a2 = xp.ascontiguousarray(a).reshape(-1, a.shape[-1])
            _product(xp, a2, b, y.reshape(-1, b.shape[1]))
        else:
            _product(xp, a, b, y)
    name, params = epilogue_of(attrs)
    apply_epilogue(xp, y, name, params, 1.0, bias, 1.0)
    return _deliver(out, y)


@TABLE.kernel(Op.ATTENTION, variant="fused", dtypes=_DTYPES, supports_out=True, gpu=True,
              shapes="Q (..., S, D), K (..., T, D), V (..., T, Dv), mask broadcast to scores")
def attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """softmax(Q K^T * scale + mask) V: batched GEMM, fused softmax row kernel, batched
    GEMM."""
    xp = ctx.xp
    q, k, v, mask = inputs[0], inputs[1], inputs[2], optional_input(inputs, 3)
    dtype = _same_dtype(Op.ATTENTION, q, k, v)
    shape = _static(attention_shape(q.shape, k.shape, v.shape,
                                    None if mask is None else mask.shape))
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    y = _output(xp, out, shape, dtype)
    if not y.size:
        return _deliver(out, y)
    scores = _scores(xp, q, xp.swapaxes(k, -1, -2))
    if mask is not None:
        # The mask applies after the scale: fold the scale in first, then the softmax
        # kernel runs with scale 1.
        scores *= scores.dtype.type(scale)
        scale = 1.0
        if mask.dtype == np.bool_:
            scores = xp.where(mask, scores, scores.dtype.type(-np.inf))
        else:
            scores += mask.astype(scores.dtype, copy=False)
    scores = xp.ascontiguousarray(scores)
    run_softmax(ctx, scores, scores, float(scale), bool(attrs["is_causal"]), False)
    _product(xp, scores, v, y)
    return _deliver(out, y)
