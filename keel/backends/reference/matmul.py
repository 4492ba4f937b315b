"""Reference kernels of the matmul family: readable NumPy, float64 accumulation.

Float inputs are computed in float64 and the result cast to the input dtype;
integer inputs are computed in 64-bit integers (wrapping on the cast back, as
ONNX integer matmul does). Shape rules come from :mod:`keel.ops.schemas.matmul`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.epilogue import reference_activation
from keel.ops.registry import Op
from keel.ops.schemas.matmul import (
    DTYPES,
    attention_shape,
    check_bias,
    check_dtype,
    check_zero_point,
    dot_shape,
    einsum_shape,
    gemm_shape,
    matmul_shape,
)

__all__: list[str] = []




def _wide(op: Op, *arrays: np.ndarray) -> tuple[np.dtype[Any], list[np.ndarray]]:
    """The common dtype (checked) and the arrays widened to float64 / int64 / uint64."""
    dtypes = {DType.from_numpy(a.dtype) for a in arrays}
    if len(dtypes) > 1:
        raise InvalidArgumentError(
            f"{op.value} needs inputs of one dtype, got "
            f"{', '.join(sorted(d.value for d in dtypes))}"
        )
    dtype = dtypes.pop()
    check_dtype(op, dtype)
    if dtype.is_float:
        acc: Any = np.float64
    elif dtype.value.startswith("uint"):
        acc = np.uint64
    else:
        acc = np.int64
    return dtype.numpy, [np.asarray(a, dtype=acc) for a in arrays]


def _epilogue(y: np.ndarray, attrs: Attrs, dtype: np.dtype[Any]) -> np.ndarray:
    name = attrs.get("activation", "")
    if name:
        y = reference_activation(y, name, attrs.get("activation_params", ()))
    return y.astype(dtype)


@TABLE.kernel(Op.MATMUL, dtypes=DTYPES[Op.MATMUL])
def matmul(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """act(A @ B + bias) with NumPy matmul semantics."""
    a, b, bias = inputs[0], inputs[1], optional_input(inputs, 2)
    arrays = [a, b] if bias is None else [a, b, bias]
    dtype, wide = _wide(Op.MATMUL, *arrays)
    shape = matmul_shape(a.shape, b.shape)
    y = np.matmul(wide[0], wide[1])
    if bias is not None:
        check_bias(Op.MATMUL, shape, bias.shape)
        y = y + wide[2]
    return [_epilogue(np.asarray(y), attrs, dtype)]


@TABLE.kernel(Op.DOT, dtypes=DTYPES[Op.DOT])
def dot(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """numpy.dot; 1-D . 1-D is a 0-D scalar (seed 001)."""
    a, b = inputs
    dtype, (wa, wb) = _wide(Op.DOT, a, b)
    dot_shape(a.shape, b.shape)
    return [np.asarray(np.dot(wa, wb)).astype(dtype)]


@TABLE.kernel(Op.GEMM, dtypes=DTYPES[Op.GEMM])
def gemm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """act(alpha * A' @ B' + beta * C)."""
    a, b, c = inputs[0], inputs[1], optional_input(inputs, 2)
    dtype, wide = _wide(Op.GEMM, *([a, b] if c is None else [a, b, c]))
    shape = gemm_shape(a.shape, b.shape, attrs["trans_a"], attrs["trans_b"])
    wa = wide[0].T if attrs["trans_a"] else wide[0]
    wb = wide[1].T if attrs["trans_b"] else wide[1]
    y = attrs["alpha"] * (wa @ wb) if dtype.kind == "f" else wa @ wb * int(attrs["alpha"])
    if c is not None:
        check_bias(Op.GEMM, shape, c.shape, "C")
        y = y + (attrs["beta"] * wide[2] if dtype.kind == "f" else wide[2] * int(attrs["beta"]))
    return [_epilogue(np.asarray(y), attrs, dtype)]


@TABLE.kernel(Op.EINSUM, dtypes=DTYPES[Op.EINSUM])
def einsum(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """numpy.einsum(equation, *inputs) in float64 / int64."""
    dtype, wide = _wide(Op.EINSUM, *inputs)
    equation = attrs["equation"]
    shape = einsum_shape(equation, [x.shape for x in inputs])
    y = np.einsum(equation.replace(" ", ""), *wide)
    return [np.asarray(y).reshape(shape).astype(dtype)]


@TABLE.kernel(Op.MATMUL_INTEGER, dtypes=DTYPES[Op.MATMUL_INTEGER])
def matmul_integer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(A - a_zero_point) @ (B - b_zero_point), exact, int32."""
    a, b = inputs[0], inputs[1]
    for i, x in enumerate(inputs):
        if x is not None:
            check_dtype(Op.MATMUL_INTEGER, DType.from_numpy(x.dtype), what=f"input {i}")
    matmul_shape(a.shape, b.shape, Op.MATMUL_INTEGER)
    a64 = a.astype(np.int64)
    b64 = b.astype(np.int64)
    azp, bzp = optional_input(inputs, 2), optional_input(inputs, 3)
    rows = a.shape[-2] if a.ndim > 1 else 1
    cols = b.shape[-1] if b.ndim > 1 else 1
    if azp is not None:
        check_zero_point(Op.MATMUL_INTEGER, "a_zero_point", azp.shape, (rows,), "row")
        # One zero point per row of A: a column vector against A's rows.
        zp = azp.astype(np.int64).reshape(-1)
        a64 = a64 - (zp.reshape(-1, 1) if zp.size > 1 else zp[0])
    if bzp is not None:
        check_zero_point(Op.MATMUL_INTEGER, "b_zero_point", bzp.shape, (cols,), "column")
        b64 = b64 - bzp.astype(np.int64).reshape(-1)
    return [np.matmul(a64, b64).astype(np.int32)]


@TABLE.kernel(Op.ATTENTION, dtypes=DTYPES[Op.ATTENTION])
def attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """softmax(Q @ K^T * scale + mask) @ V with a max-subtracted softmax, in float64."""
    q, k, v, mask = inputs[0], inputs[1], inputs[2], optional_input(inputs, 3)
    dtype, (q64, k64, v64) = _wide(Op.ATTENTION, q, k, v)
    attention_shape(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = np.matmul(q64, np.swapaxes(k64, -1, -2)) * scale
    if attrs["is_causal"]:
        s, t = scores.shape[-2:]
        scores = np.where(np.tril(np.ones((s, t), dtype=bool)), scores, -np.inf)
    if mask is not None:
        if mask.dtype == np.bool_:
            scores = np.where(mask, scores, -np.inf)
        else:
            scores = scores + mask.astype(np.float64)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return [np.matmul(weights, v64).astype(dtype)]
