"""Reference kernels of the reduction family: the executable spec.

Floats accumulate in float64, integers in int64 (uint64 for unsigned), and
the result is cast back to the input dtype. For sums and products that cast
gives exactly what wrapping arithmetic in the input dtype would; for means
and norms the wide accumulator is the more correct answer, and the one the
other backends must match.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import KernelContext
from keel.backends.reference.kernels import TABLE
from keel.ops.registry import Op
from keel.ops.schemas.elementwise import DTYPES
from keel.ops.schemas.reduction import (
    arg_axis,
    cumulative_axis,
    empty_value,
    reduced_shape,
    reduction_axes,
)

Attrs = Mapping[str, Any]
Axes = tuple[int, ...]


def _give(y: Any, dtype: np.dtype[Any], out: Sequence[Any] | None) -> list[Any]:
    y = np.asarray(y).astype(dtype)
    if out is None:
        return [y]
    out[0][...] = y
    return [out[0]]


def _wide(x: np.ndarray) -> np.ndarray:
    """The accumulator dtype: float64, int64, uint64 (bool stays bool)."""
    kind = {"f": np.float64, "i": np.int64, "u": np.uint64}.get(x.dtype.kind)
    return x if kind is None else x.astype(kind)


def _count(shape: Sequence[int], axes: Axes) -> int:
    return math.prod(shape[a] for a in axes)


def _mean(w: np.ndarray, axes: Axes, keep: bool) -> np.ndarray:
    total = np.sum(w, axis=axes, keepdims=keep)
    n = _count(w.shape, axes)
    if w.dtype.kind == "f":
        return total / n                                  # 0 / 0: NaN when empty
    if n == 0:
        return np.zeros_like(total)
    # Integer mean truncates toward zero (ONNX casts the float mean back).
    return np.sign(total) * (np.abs(total) // n)


def _log_sum_exp(w: np.ndarray, axes: Axes, keep: bool) -> np.ndarray:
    top = np.max(w, axis=axes, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)      # all -inf, or an +inf: no shift
    y = np.log(np.sum(np.exp(w - top), axis=axes, keepdims=True)) + top
    return y if keep else np.squeeze(y, axis=axes)


# fn(widened x, axes, keepdims) for each op. Axes () reduce nothing: the
# elementwise part still applies (reduce_sum_square squares), as in ONNX.
_REDUCE: dict[Op, Callable[[np.ndarray, Axes, bool], np.ndarray]] = {
    Op.SUM: lambda w, ax, k: np.sum(w, axis=ax, keepdims=k),
    Op.MEAN: _mean,
    Op.REDUCE_MAX: lambda w, ax, k: np.max(w, axis=ax, keepdims=k),
    Op.REDUCE_MIN: lambda w, ax, k: np.min(w, axis=ax, keepdims=k),
    Op.REDUCE_PROD: lambda w, ax, k: np.prod(w, axis=ax, keepdims=k),
    Op.REDUCE_L1: lambda w, ax, k: np.sum(np.abs(w), axis=ax, keepdims=k),
    Op.REDUCE_L2: lambda w, ax, k: np.sqrt(np.sum(w * w, axis=ax, keepdims=k)),
    Op.REDUCE_LOG_SUM: lambda w, ax, k: np.log(np.sum(w, axis=ax, keepdims=k)),
    Op.REDUCE_LOG_SUM_EXP: _log_sum_exp,
    Op.REDUCE_SUM_SQUARE: lambda w, ax, k: np.sum(w * w, axis=ax, keepdims=k),
}
# Reductions without an identity: over no elements they give empty_value(op).
_NO_IDENTITY = frozenset({Op.REDUCE_MAX, Op.REDUCE_MIN, Op.REDUCE_LOG_SUM_EXP})


def _axes_input(inputs: Sequence[Any]) -> np.ndarray | None:
    return np.asarray(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None


def _reduce_kernel(op: Op) -> Callable[..., list[Any]]:
    fn = _REDUCE[op]

    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        x = np.asarray(inputs[0])
        axes = reduction_axes(op, x.ndim, attrs, _axes_input(inputs))
        keep = bool(attrs["keepdims"])
        if op in _NO_IDENTITY and axes and _count(x.shape, axes) == 0:
            shape = reduced_shape(x.shape, axes, keep)
            return _give(np.full(shape, empty_value(op, x.dtype), x.dtype), x.dtype, out)
        with np.errstate(all="ignore"):
            y = fn(_wide(x), axes, keep)
        return _give(y, x.dtype, out)
    return kernel


for _op in _REDUCE:
    TABLE.kernel(_op, dtypes=DTYPES[_op], supports_out=True)(_reduce_kernel(_op))


@TABLE.kernel(Op.SUM_ALL, dtypes=DTYPES[Op.SUM_ALL], supports_out=True)
def sum_all(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
            out: Sequence[Any] | None) -> list[Any]:
    """Sum of every element, shape () (seed 001); 0 when empty."""
    x = np.asarray(inputs[0])
    return _give(np.sum(_wide(x)), x.dtype, out)


@TABLE.kernel(Op.MEAN_ALL, dtypes=DTYPES[Op.MEAN_ALL], supports_out=True)
def mean_all(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
             out: Sequence[Any] | None) -> list[Any]:
    """Mean of every element, shape () (seed 001); NaN when empty (0 for integers)."""
    x = np.asarray(inputs[0])
    with np.errstate(all="ignore"):
        y = _mean(_wide(x), tuple(range(x.ndim)), False)
    return _give(y, x.dtype, out)


def _arg_kernel(op: Op, fn: Callable[..., np.ndarray]) -> Callable[..., list[Any]]:
    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        x = np.asarray(inputs[0])
        axis = arg_axis(op, x.shape, attrs)
        if attrs["select_last_index"]:
            idx = x.shape[axis] - 1 - fn(np.flip(x, axis), axis=axis)
        else:
            idx = fn(x, axis=axis)
        if attrs["keepdims"]:
            idx = np.expand_dims(idx, axis)
        return _give(idx, np.dtype(np.int64), out)
    return kernel


TABLE.kernel(Op.ARGMAX, dtypes=DTYPES[Op.ARGMAX], supports_out=True)(
    _arg_kernel(Op.ARGMAX, np.argmax))
TABLE.kernel(Op.ARGMIN, dtypes=DTYPES[Op.ARGMIN], supports_out=True)(
    _arg_kernel(Op.ARGMIN, np.argmin))


def _exclusive(y: np.ndarray, axis: int, identity: int) -> np.ndarray:
    """Shift a running total one step along ``axis``, starting from ``identity``."""
    if y.shape[axis] == 0:
        return y
    head = np.full_like(np.take(y, [0], axis=axis), identity)
    body = np.take(y, np.arange(y.shape[axis] - 1), axis=axis)
    return np.concatenate([head, body], axis=axis)


def _cumulative_kernel(op: Op) -> Callable[..., list[Any]]:
    running, identity = (np.cumsum, 0) if op is Op.CUMSUM else (np.cumprod, 1)

    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        x = np.asarray(inputs[0])
        axis = cumulative_axis(op, x.ndim, attrs, _axes_input(inputs))
        w = _wide(x).reshape(x.shape or (1,))      # a scalar runs as one element
        if attrs["reverse"]:
            w = np.flip(w, axis)
        with np.errstate(all="ignore"):
            y = running(w, axis=axis)
        if attrs["exclusive"]:
            y = _exclusive(y, axis, identity)
        if attrs["reverse"]:
            y = np.flip(y, axis)
        return _give(y.reshape(x.shape), x.dtype, out)
    return kernel


for _op in (Op.CUMSUM, Op.CUMPROD):
    TABLE.kernel(_op, dtypes=DTYPES[_op], supports_out=True)(_cumulative_kernel(_op))
