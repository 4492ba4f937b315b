"""cpu kernels of the reduction family, written once against ``ctx.xp``.

Results go straight into the output buffer. Float32/float64 reduce in their
own dtype (NumPy sums pairwise); float16 reduces in float32, because a long
float16 accumulation loses every digit. Integer sums and products wrap in
the input dtype, which is exactly the reference's wide result cast back;
integer means and L2 norms accumulate in 64 bits, like the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import KernelContext
from keel.backends.cpu.elementwise import destination, host_value
from keel.backends.cpu.kernels import TABLE
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
# (xp, x, axes, keepdims, out) -> writes out
Impl = Callable[[Any, Any, Axes, bool, Any], Any]


def _working(xp: Any, x: Any) -> Any:
    """float16 reduces in float32; everything else in its own dtype."""
    return x.astype(xp.float32) if x.dtype == np.float16 else x


def _into(xp: Any, d: Any, y: Any) -> Any:
    """Write ``y`` (a wider result, or ``d`` itself) into ``d``.

    Reductions without ``out=`` return NumPy scalars at rank 0, hence
    ``asarray`` before any in-place step elsewhere in this module.
    """
    if y is not d:
        xp.copyto(d, y, casting="unsafe")
    return d


def _acc(d: Any, x: Any) -> tuple[Any, Any]:
    """(dtype, out) for a reduction of working array ``x`` whose result lands in ``d``."""
    return (x.dtype, d) if x.dtype == d.dtype else (x.dtype, None)


def _sum_of(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
    dtype, out = _acc(d, x)
    return _into(xp, d, xp.sum(x, axis=axes, keepdims=keep, dtype=dtype, out=out))


def _sum(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
    return _sum_of(xp, _working(xp, x), axes, keep, d)


def _count(shape: Sequence[int], axes: Axes) -> int:
    return math.prod(shape[a] for a in axes)


def _mean(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
    n = _count(x.shape, axes)
    if d.dtype.kind == "f":
        w = _working(xp, x)
        dtype, out = _acc(d, w)
        total = xp.sum(w, axis=axes, keepdims=keep, dtype=dtype, out=out)
        total /= n                              # 0 / 0 is NaN: the empty mean
        return _into(xp, d, total)
    wide = xp.int64 if d.dtype.kind == "i" else xp.uint64
    total = xp.sum(x, axis=axes, keepdims=keep, dtype=wide)
    if n == 0:
        d.fill(0)
        return d
    # Integer mean truncates toward zero, like the reference.
    mean = xp.floor_divide(xp.abs(total), n)
    mean *= xp.sign(total)
    return _into(xp, d, mean)


def _extreme(name: str) -> Impl:
    def impl(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
        return getattr(xp, name)(x, axis=axes, keepdims=keep, out=d)
    return impl


def _prod(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
    w = _working(xp, x)
    dtype, out = _acc(d, w)
    return _into(xp, d, xp.prod(w, axis=axes, keepdims=keep, dtype=dtype, out=out))


def _l1(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
    return _sum_of(xp, xp.abs(_working(xp, x)), axes, keep, d)


def _sum_square(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
    w = _working(xp, x)
    return _sum_of(xp, xp.multiply(w, w), axes, keep, d)


def _l2(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
    if d.dtype.kind != "f":
        # Integers: a 64-bit sum of squares, its square root truncated back.
        w = x.astype(xp.int64 if d.dtype.kind == "i" else xp.uint64)
        root = xp.sqrt(xp.sum(w * w, axis=axes, keepdims=keep).astype(xp.float64))
        return _into(xp, d, root)
    w = _working(xp, x)
    total = xp.asarray(xp.sum(xp.multiply(w, w), axis=axes, keepdims=keep))
    return _into(xp, d, xp.sqrt(total, out=total))


def _log_sum(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
    w = _working(xp, x)
    total = xp.asarray(xp.sum(w, axis=axes, keepdims=keep))
    return _into(xp, d, xp.log(total, out=total))


def _log_sum_exp(xp: Any, x: Any, axes: Axes, keep: bool, d: Any) -> Any:
    w = _working(xp, x)
    top = xp.asarray(xp.max(w, axis=axes, keepdims=True))
    xp.copyto(top, 0, where=xp.logical_not(xp.isfinite(top)))   # all -inf or an inf
    shifted = xp.asarray(xp.subtract(w, top))
    xp.exp(shifted, out=shifted)
    total = xp.asarray(xp.sum(shifted, axis=axes, keepdims=keep))
    xp.log(total, out=total)
    total += top.reshape(total.shape)
    return _into(xp, d, total)


_REDUCE: dict[Op, Impl] = {
    Op.SUM: _sum,
    Op.MEAN: _mean,
    Op.REDUCE_MAX: _extreme("max"),
    Op.REDUCE_MIN: _extreme("min"),
    Op.REDUCE_PROD: _prod,
    Op.REDUCE_L1: _l1,
    Op.REDUCE_L2: _l2,
    Op.REDUCE_LOG_SUM: _log_sum,
    Op.REDUCE_LOG_SUM_EXP: _log_sum_exp,
    Op.REDUCE_SUM_SQUARE: _sum_square,
}
_NO_IDENTITY = frozenset({Op.REDUCE_MAX, Op.REDUCE_MIN, Op.REDUCE_LOG_SUM_EXP})


def _axes_input(inputs: Sequence[Any]) -> np.ndarray | None:
    return host_value(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None


def _reduce_kernel(op: Op) -> Callable[..., list[Any]]:
    impl = _REDUCE[op]

    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        x = inputs[0]
        axes = reduction_axes(op, x.ndim, attrs, _axes_input(inputs))
        keep = bool(attrs["keepdims"])
        d = destination(ctx.xp, out, reduced_shape(x.shape, axes, keep), x.dtype)
        if op in _NO_IDENTITY and axes and _count(x.shape, axes) == 0:
            d.fill(empty_value(op, x.dtype))
            return [d]
        with np.errstate(all="ignore"):
            impl(ctx.xp, x, axes, keep, d)
        return [d]
    return kernel


for _op in _REDUCE:
    TABLE.kernel(_op, dtypes=DTYPES[_op], supports_out=True)(_reduce_kernel(_op))


def _whole_kernel(impl: Impl) -> Callable[..., list[Any]]:
    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        x = inputs[0]
        d = destination(ctx.xp, out, (), x.dtype)
        with np.errstate(all="ignore"):
            impl(ctx.xp, x, tuple(range(x.ndim)), False, d)
        return [d]
    return kernel


TABLE.kernel(Op.SUM_ALL, dtypes=DTYPES[Op.SUM_ALL], supports_out=True)(_whole_kernel(_sum))
TABLE.kernel(Op.MEAN_ALL, dtypes=DTYPES[Op.MEAN_ALL], supports_out=True)(_whole_kernel(_mean))


def _arg_kernel(op: Op, name: str) -> Callable[..., list[Any]]:
    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        xp, x = ctx.xp, inputs[0]
        axis = arg_axis(op, x.shape, attrs)
        keep = bool(attrs["keepdims"])
        d = destination(xp, out, reduced_shape(x.shape, (axis,), keep), np.int64)
        last = bool(attrs["select_last_index"])
        getattr(xp, name)(xp.flip(x, axis) if last else x, axis=axis, keepdims=keep, out=d)
        if last:
            xp.subtract(x.shape[axis] - 1, d, out=d)
        return [d]
    return kernel


TABLE.kernel(Op.ARGMAX, dtypes=DTYPES[Op.ARGMAX], supports_out=True)(
    _arg_kernel(Op.ARGMAX, "argmax"))
TABLE.kernel(Op.ARGMIN, dtypes=DTYPES[Op.ARGMIN], supports_out=True)(
    _arg_kernel(Op.ARGMIN, "argmin"))


def _along(array: Any, axis: int, part: slice) -> Any:
    index = [slice(None)] * array.ndim
    index[axis] = part
    return array[tuple(index)]


def _cumulative_kernel(op: Op) -> Callable[..., list[Any]]:
    name, identity = ("cumsum", 0) if op is Op.CUMSUM else ("cumprod", 1)

    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        xp, x = ctx.xp, inputs[0]
        axis = cumulative_axis(op, x.ndim, attrs, _axes_input(inputs))
        d = destination(xp, out, x.shape, x.dtype)
        w, dst = _working(xp, x).reshape(x.shape or (1,)), d.reshape(x.shape or (1,))
        buffer = dst if w.dtype == dst.dtype else xp.empty(w.shape, dtype=w.dtype)
        target = buffer
        if attrs["reverse"]:      # run over flipped views: no copies
            w, target = xp.flip(w, axis), xp.flip(buffer, axis)
        with np.errstate(all="ignore"):
            if not attrs["exclusive"]:
                getattr(xp, name)(w, axis=axis, out=target)
            elif w.shape[axis] > 0:
                _along(target, axis, slice(0, 1)).fill(identity)
                getattr(xp, name)(_along(w, axis, slice(0, -1)), axis=axis,
                                  out=_along(target, axis, slice(1, None)))
        _into(xp, dst, buffer)
        return [d]
    return kernel


for _op in (Op.CUMSUM, Op.CUMPROD):
    TABLE.kernel(_op, dtypes=DTYPES[_op], supports_out=True)(_cumulative_kernel(_op))
