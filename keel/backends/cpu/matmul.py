"""cpu kernels of the matmul family, written once against ``ctx.xp``.

Float products go to BLAS through ``xp.matmul`` with ``out=`` (the caller's
buffer when given), and the epilogue (bias, activation) runs in place on the
result. float16 is computed in float32. Two-operand einsums are rewritten as
one batched matmul (transposes and reshapes around it); other einsums use
``xp.einsum(optimize=True)``. Integer matmuls with zero points run exactly in
float BLAS (float32 while every partial sum stays below 2**24, else float64).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import KernelContext
from keel.backends.cpu.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.epilogue import apply_activation
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
    parse_einsum,
)

__all__: list[str] = []

Inputs = Sequence[Any]
Attrs = Mapping[str, Any]
Out = Sequence[Any] | None


def _opt(inputs: Inputs, i: int) -> Any:
    return inputs[i] if i < len(inputs) else None


def _common(op: Op, arrays: Sequence[Any]) -> DType:
    return _common_dtype(op, tuple(a.dtype for a in arrays if a is not None))


@functools.lru_cache(maxsize=256)
def _common_dtype(op: Op, dtypes: tuple[Any, ...]) -> DType:
    kinds = {DType.from_numpy(d) for d in dtypes}
    if len(kinds) != 1:
        raise InvalidArgumentError(
            f"{op.value} needs inputs of one dtype, got "
            f"{', '.join(sorted(d.value for d in kinds))}"
        )
    dtype = kinds.pop()
    check_dtype(op, dtype)
    return dtype


def _compute(xp: Any, dtype: DType) -> Any:
    return xp.float32 if dtype is DType.FLOAT16 else dtype.numpy


def _target(xp: Any, out: Out, shape: tuple[int, ...], dtype: Any) -> Any:
    """The caller's buffer when it can take the result directly, else a fresh array."""
    if out is not None and out[0] is not None:
        buf = out[0]
        if buf.dtype == dtype and buf.shape == shape:
            return buf
    return xp.empty(shape, dtype=dtype)


def _deliver(out: Out, y: Any, dtype: DType) -> list[Any]:
    if out is not None and out[0] is not None:
        if out[0] is not y:
            out[0][...] = y
        return [out[0]]
    return [y.astype(dtype.numpy, copy=False)]


def _activate(xp: Any, y: Any, attrs: Attrs) -> None:
    if attrs.get("activation"):
        apply_activation(xp, y, attrs["activation"], attrs.get("activation_params", ()), out=y)


# ---- matmul, dot, gemm ---------------------------------------------------------------
# Shape checks are pure functions of the shapes: cached, so a steady-state call pays
# one dictionary lookup instead of re-deriving them.
@functools.lru_cache(maxsize=1024)
def _matmul_plan(a: tuple[int, ...], b: tuple[int, ...],
                 bias: tuple[int, ...] | None) -> tuple[int, ...]:
    shape = matmul_shape(a, b)
    if bias is not None:
        check_bias(Op.MATMUL, shape, bias)
    return tuple(int(d) for d in shape if isinstance(d, int))


@functools.lru_cache(maxsize=1024)
def _gemm_plan(a: tuple[int, ...], b: tuple[int, ...], c: tuple[int, ...] | None,
               trans_a: bool, trans_b: bool) -> tuple[int, ...]:
    shape = gemm_shape(a, b, trans_a, trans_b)
    if c is not None:
        check_bias(Op.GEMM, shape, c, "C")
    return tuple(int(d) for d in shape if isinstance(d, int))


@TABLE.kernel(Op.MATMUL, dtypes=DTYPES[Op.MATMUL], supports_out=True, simd=(),
              shapes="any ranks (NumPy matmul broadcasting)")
def matmul(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """act(A @ B + bias): BLAS into the output, epilogue in place."""
    xp = ctx.xp
    a, b = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    dtype = _common(Op.MATMUL, [a, b, bias])
    shape = _matmul_plan(a.shape, b.shape, None if bias is None else bias.shape)
    ct = _compute(xp, dtype)
    y = _target(xp, out, shape, ct)
    xp.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False), out=y)
    if bias is not None:
        xp.add(y, bias.astype(ct, copy=False), out=y)
    _activate(xp, y, attrs)
    return _deliver(out, y, dtype)


@TABLE.kernel(Op.DOT, dtypes=DTYPES[Op.DOT], supports_out=True, simd=(),
              shapes="any ranks (numpy.dot)")
def dot(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """numpy.dot; 1-D . 1-D gives a 0-D array (seed 001)."""
    xp = ctx.xp
    a, b = inputs
    dtype = _common(Op.DOT, [a, b])
    shape = dot_shape(a.shape, b.shape)
    ct = _compute(xp, dtype)
    y = xp.asarray(xp.dot(a.astype(ct, copy=False), b.astype(ct, copy=False)))
    return _deliver(out, y.reshape(shape), dtype)


@TABLE.kernel(Op.GEMM, dtypes=DTYPES[Op.GEMM], supports_out=True, simd=(),
              shapes="2-D A and B, C broadcast to (M, N)")
def gemm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """act(alpha * A' @ B' + beta * C): BLAS into the output, the rest in place."""
    xp = ctx.xp
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    dtype = _common(Op.GEMM, [a, b, c])
    trans_a, trans_b = attrs["trans_a"], attrs["trans_b"]
    shape = _gemm_plan(a.shape, b.shape, None if c is None else c.shape, trans_a, trans_b)
    ct = _compute(xp, dtype)
    a2 = a.astype(ct, copy=False)
    b2 = b.astype(ct, copy=False)
    y = _target(xp, out, shape, ct)
    xp.matmul(a2.T if trans_a else a2, b2.T if trans_b else b2, out=y)
    alpha, beta = attrs["alpha"], attrs["beta"]
    if alpha != 1.0:    # integer gemm: alpha and beta act as integers
        xp.multiply(y, alpha if dtype.is_float else int(alpha), out=y)
    if c is not None and beta != 0.0:
        c2 = c.astype(ct, copy=False)
        if beta != 1.0:
            c2 = c2 * (beta if dtype.is_float else int(beta))
        xp.add(y, c2, out=y)
    _activate(xp, y, attrs)
    return _deliver(out, y, dtype)


# ---- einsum ----------------------------------------------------------------------------
@TABLE.kernel(Op.EINSUM, dtypes=DTYPES[Op.EINSUM], supports_out=True, simd=(),
              shapes="two operands: one batched GEMM; else xp.einsum(optimize=True)")
def einsum(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """numpy.einsum semantics; two-operand contractions as one batched matmul."""
    xp = ctx.xp
    dtype = _common(Op.EINSUM, inputs)
    equation = attrs["equation"].replace(" ", "")
    shape = einsum_shape(equation, [x.shape for x in inputs])
    ct = _compute(xp, dtype)
    ops = [x.astype(ct, copy=False) for x in inputs]
    labels, output = parse_einsum(equation, [x.ndim for x in inputs])
    y = None
    if len(ops) == 2:
        y = _einsum_pair(xp, ops[0], ops[1], labels[0], labels[1], output)
    if y is None:
        y = xp.einsum(equation, *ops, optimize=len(ops) > 1)
    return _deliver(out, xp.asarray(y).reshape(shape), dtype)


def _einsum_pair(xp: Any, a: Any, b: Any, la: list[str], lb: list[str],
                 lo: list[str]) -> Any:
    """The contraction of two operands as one batched matmul; None if it is not one."""
    if len(set(la)) != len(la) or len(set(lb)) != len(lb):
        return None                                    # diagonals: leave to einsum
    a, la = _sum_private(a, la, lb, lo)
    b, lb = _sum_private(b, lb, la, lo)
    size = {**dict(zip(lb, b.shape, strict=True)), **dict(zip(la, a.shape, strict=True))}
    batch = [lab for lab in lo if lab in la and lab in lb]
    inner = [lab for lab in la if lab in lb and lab not in lo]
    left = [lab for lab in la if lab not in lb]
    right = [lab for lab in lb if lab not in la]
    if any(dict(zip(la, a.shape, strict=True))[lab] != dict(zip(lb, b.shape, strict=True))[lab]
           for lab in inner):
        return None                                    # broadcast contraction: rare
    k = math.prod(size[lab] for lab in inner)
    a3 = a.transpose([la.index(x) for x in (*batch, *left, *inner)])
    a3 = a3.reshape((*a3.shape[:len(batch)], math.prod(size[x] for x in left), k))
    b3 = b.transpose([lb.index(x) for x in (*batch, *inner, *right)])
    b3 = b3.reshape((*b3.shape[:len(batch)], k, math.prod(size[x] for x in right)))
    y = xp.matmul(a3, b3)
    y = y.reshape((*y.shape[:len(batch)], *(size[x] for x in left), *(size[x] for x in right)))
    have = [*batch, *left, *right]
    return y.transpose([have.index(x) for x in lo])


def _sum_private(a: Any, la: list[str], other: list[str], lo: list[str]) -> tuple[Any, list[str]]:
    """Sum out the labels only ``a`` has that the output drops."""
    private = [i for i, lab in enumerate(la) if lab not in other and lab not in lo]
    if not private:
        return a, la
    return a.sum(axis=tuple(private)), [lab for i, lab in enumerate(la) if i not in private]


# ---- integer matmul ----------------------------------------------------------------------
@TABLE.kernel(Op.MATMUL_INTEGER, dtypes=DTYPES[Op.MATMUL_INTEGER], supports_out=True,
              simd=(), shapes="any ranks (NumPy matmul broadcasting)")
def matmul_integer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(A - a_zero_point) @ (B - b_zero_point) exactly, through float BLAS."""
    xp = ctx.xp
    a, b, azp, bzp = inputs[0], inputs[1], _opt(inputs, 2), _opt(inputs, 3)
    for i, x in enumerate(inputs):
        if x is not None:
            check_dtype(Op.MATMUL_INTEGER, DType.from_numpy(x.dtype), what=f"input {i}")
    shape = matmul_shape(a.shape, b.shape, Op.MATMUL_INTEGER)
    k = a.shape[-1]
    # |a - zp|, |b - zp| <= 255: partial sums are exact in float32 below 2**24.
    ft = xp.float32 if k * 255 * 255 < 2**24 else xp.float64
    af, bf = a.astype(ft), b.astype(ft)
    if azp is not None:
        rows = a.shape[-2] if a.ndim > 1 else 1
        check_zero_point(Op.MATMUL_INTEGER, "a_zero_point", azp.shape, (rows,), "row")
        zp = azp.astype(ft).reshape(-1)
        xp.subtract(af, zp.reshape(-1, 1) if zp.size > 1 else zp[0], out=af)
    if bzp is not None:
        cols = b.shape[-1] if b.ndim > 1 else 1
        check_zero_point(Op.MATMUL_INTEGER, "b_zero_point", bzp.shape, (cols,), "column")
        xp.subtract(bf, bzp.astype(ft).reshape(-1), out=bf)
    y = xp.rint(xp.matmul(af, bf)).astype(xp.int64).astype(xp.int32)
    return _deliver(out, y.reshape(shape), DType.INT32)


# ---- attention -----------------------------------------------------------------------
@TABLE.kernel(Op.ATTENTION, dtypes=DTYPES[Op.ATTENTION], supports_out=True, simd=(),
              shapes="Q (..., S, D), K (..., T, D), V (..., T, Dv)")
def attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """softmax(Q K^T * scale + mask) V: two batched GEMMs and an in-place softmax."""
    xp = ctx.xp
    q, k, v, mask = inputs[0], inputs[1], inputs[2], _opt(inputs, 3)
    dtype = _common(Op.ATTENTION, [q, k, v])
    shape = tuple(int(d) for d in attention_shape(q.shape, k.shape, v.shape,
                                                   None if mask is None else mask.shape)
                  if isinstance(d, int))
    ct = _compute(xp, dtype)
    q, k, v = (t.astype(ct, copy=False) for t in (q, k, v))
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    s, t = q.shape[-2], k.shape[-2]
    if q.shape[-1] < t:             # scale the smaller of Q and the scores
        scores = xp.matmul(q * scale, xp.swapaxes(k, -1, -2))
    else:
        scores = xp.matmul(q, xp.swapaxes(k, -1, -2))
        xp.multiply(scores, scale, out=scores)
    if attrs["is_causal"]:
        future = xp.triu(xp.ones((s, t), dtype=bool), k=1)
        scores = xp.where(future, -np.inf, scores)
    if mask is not None:
        if mask.dtype == np.bool_:
            scores = xp.where(mask, scores, -np.inf)
        else:
            xp.add(scores, mask.astype(ct, copy=False), out=scores)
    _softmax_last(xp, scores)
    y = _target(xp, out, shape, ct)
    xp.matmul(scores, v, out=y)
    return _deliver(out, y, dtype)


def _softmax_last(xp: Any, x: Any) -> None:
    """In-place softmax over the last axis, max-subtracted (no overflow)."""
    xp.subtract(x, x.max(axis=-1, keepdims=True), out=x)
    xp.exp(x, out=x)
    xp.divide(x, x.sum(axis=-1, keepdims=True), out=x)
