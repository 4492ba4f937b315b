"""cpu kernels of the indexing family, written once against ``ctx.xp``.

Indices are bounds-checked once (a min/max pass) and then used as they are:
NumPy and CuPy both read negative indices from the end. Where NumPy and CuPy
differ (``take``'s ``mode``, ``argsort``'s ``kind``) the NumPy-only argument
is passed only to NumPy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.cpu import native_window
from keel.backends.cpu.kernels import TABLE
from keel.backends.cpu.native_gemm import planner_rules
from keel.backends.cpu.shape import destination, emit
from keel.errors import ExecutionError, InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schemas.indexing import (
    REDUCTIONS,
    check_index,
    check_index_dtype,
    check_indices,
    check_reduction,
    compress_layout,
    elements_check,
    gather_nd_dims,
    one_hot_depth,
    one_hot_dims,
    reverse_axes,
    scatter_nd_depth,
    sequence_lengths,
    slice_index,
    slice_params,
    topk_k,
    updates_like,
)
from keel.ops.schemas.shape import ints_param, require, static_dims
from keel.ops.types import normalize_axis


def _is_numpy(xp: Any) -> bool:
    return xp is np


def _take(xp: Any, x: Any, indices: Any, axis: int, out: Any = None) -> Any:
    # NumPy's default mode="raise" buffers ``out``; indices are already checked,
    # so "wrap" is exact (and maps -1 to the last entry). CuPy always wraps.
    if _is_numpy(xp):
        return xp.take(x, indices, axis=axis, out=out, mode="wrap")
    return xp.take(x, indices, axis=axis, out=out)


@TABLE.kernel(Op.INDEX, supports_out=True)
def index(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The slice at ``index`` along ``axis`` (that axis removed), copied once."""
    x = inputs[0]
    if x.ndim == 0:
        raise InvalidArgumentError("index needs an input of rank >= 1, got a scalar")
    axis = normalize_axis(attrs["axis"], x.ndim, what="index axis")
    i = check_index("index", attrs["index"], x.shape[axis], axis)
    view = x[(slice(None),) * axis + (i,)]
    return [view.copy()] if out is None else emit(ctx.xp, view, out)


@TABLE.kernel(Op.SLICE, supports_out=True)
def slice_(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX Slice through a strided view, copied once."""
    x = inputs[0]
    starts, ends, axes, steps = (ints_param("slice", inputs, i, attrs, name)
                                 for i, name in enumerate(("starts", "ends", "axes", "steps"), 1))
    params = slice_params("slice", x.ndim, require(starts, "slice", "starts"),
                          require(ends, "slice", "ends"), axes, steps)
    view = x[slice_index(x.shape, params)]
    return [view.copy()] if out is None else emit(ctx.xp, view, out)


def _native_gather(x: Any, indices: Any, dst: Any, axis: int,
                   threads: int) -> Callable[[], None] | None:
    """window.c's row copy of ``take(x, indices, axis)`` into ``dst`` (split over the
    node's ``threads`` as the planner's least copy work allows), an index out of range
    raising check_indices' error with nothing written; None where it does not serve."""
    call = native_window.bind_gather(x, indices, dst, axis, threads)
    if call is None:
        return None

    def gather() -> None:
        rc = call()
        if rc != 0:                # the C side checks every index before it writes
            gather_failed(rc, indices, x.shape[axis], axis)
    return gather


def gather_failed(rc: int, indices: Any, size: int, axis: int) -> None:
    """Raise the error window.c's row copy returned ``rc`` for: 1, an index out of range
    (check_indices' InvalidArgumentError naming it); -1, a worker thread without memory
    for its scratch (MemoryError, as the other native kernels); anything else, or an
    index error check_indices does not find, the kernel's fault (ExecutionError)."""
    if rc == 1:
        check_indices("gather", indices, size, f"axis {axis}")
        raise ExecutionError(f"gather: the native row copy refused indices along axis {axis} "
                             "that check_indices accepts")
    if rc == -1:
        raise MemoryError("native gather: no memory for a worker thread's scratch")
    raise ExecutionError(f"gather: the native row copy refused its arguments (code {rc})")


def _bind_gather(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                 out: Sequence[Any]) -> Callable[[], object] | None:
    """Gather for one program step (``KernelVariant.bind``): the indices still checked
    on every call (they are data), the rest once; window.c's split row copy where it
    serves, else NumPy's take."""
    (x, indices), dst = inputs, out[0]
    axis = normalize_axis(attrs["axis"], x.ndim, what="gather axis")
    shape = tuple(x.shape[:axis]) + tuple(indices.shape) + tuple(x.shape[axis + 1:])
    if not _is_numpy(ctx.xp) or dst.shape != shape or dst.dtype != x.dtype:
        return None
    native = _native_gather(x, indices, dst, axis, ctx.threads or 1)
    if native is not None:
        return native
    size, what = x.shape[axis], f"axis {axis}"

    def gather() -> None:
        check_indices("gather", indices, size, what)
        np.take(x, indices, axis=axis, out=dst, mode="wrap")
    return gather


@TABLE.kernel(Op.GATHER, supports_out=True, bind=_bind_gather)
def gather(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """``take`` along ``axis``, straight into ``out`` when given (window.c's split row
    copy where it serves and the copy is worth binding for one call: the planner's
    gather_copies_unbound)."""
    xp, (x, indices) = ctx.xp, inputs
    axis = normalize_axis(attrs["axis"], x.ndim, what="gather axis")
    shape = tuple(x.shape[:axis]) + tuple(indices.shape) + tuple(x.shape[axis + 1:])
    dst = destination(xp, shape, x.dtype, out)
    native = (_native_gather(x, indices, dst, axis, ctx.threads or 1)
              if _is_numpy(xp) and planner_rules().gather_copies_unbound(dst.size) else None)
    if native is not None:
        native()
    else:
        check_indices("gather", indices, x.shape[axis], f"axis {axis}")
        _take(xp, x, indices, axis, out=dst)
    return [dst]


@TABLE.kernel(Op.GATHER_ELEMENTS, supports_out=True)
def gather_elements(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """``take_along_axis`` on the data cut to the indices' extent."""
    xp, (x, indices) = ctx.xp, inputs
    axis = elements_check("gather_elements", x.shape, indices.shape, attrs["axis"])
    check_indices("gather_elements", indices, x.shape[axis], f"axis {axis}")
    cut = tuple(slice(None) if a == axis else slice(0, n) for a, n in enumerate(indices.shape))
    return emit(xp, xp.take_along_axis(x[cut], indices, axis=axis), out)


@TABLE.kernel(Op.GATHER_ND, supports_out=True)
def gather_nd(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One fancy-indexing gather with per-batch index tuples."""
    xp, (x, indices) = ctx.xp, inputs
    b = attrs["batch_dims"]
    check_index_dtype("gather_nd", indices)
    dims = static_dims(gather_nd_dims("gather_nd", x.shape, indices.shape, b) or ())
    k = indices.shape[-1]
    for j in range(k):
        check_indices("gather_nd", indices[..., j], x.shape[b + j], f"axis {b + j}")
    batch = int(np.prod(x.shape[:b], dtype=np.int64))
    per_batch = int(np.prod(indices.shape[b:-1], dtype=np.int64))
    rows = x.reshape((batch, *x.shape[b:]))
    tuples = indices.reshape(batch, per_batch, k)
    index = (xp.arange(batch).reshape(batch, 1), *tuple(tuples[..., j] for j in range(k)))
    return emit(xp, rows[index].reshape(dims), out)


def _ufunc_at(ctx: KernelContext, op: str, reduction: str, dst: Any, index: tuple[Any, ...],
              updates: Any) -> None:
    """Write (reduction "none": last write wins) or accumulate ``updates`` at ``index``."""
    if reduction == "none":
        dst[index] = updates
        return
    ufunc = getattr(ctx.xp, REDUCTIONS[reduction])
    try:
        ufunc.at(dst, index, updates)
    except (AttributeError, NotImplementedError) as exc:
        raise UnsupportedOperationError(
            op, ctx.backend, detail=f"reduction {reduction!r} needs {REDUCTIONS[reduction]}.at, "
            f"which this array library lacks ({exc})") from None


def scatter_elements_setup(xp: Any, inputs: Inputs, attrs: Attrs, out: Out
                           ) -> tuple[Any, tuple[Any, ...], Any]:
    """Checked ScatterElements: (the result holding a copy of data, the broadcast index
    arrays, the updates in data's dtype)."""
    x, indices, updates = inputs
    axis = elements_check("scatter_elements", x.shape, indices.shape, attrs["axis"])
    updates_like("scatter_elements", indices.shape, updates.shape)
    check_indices("scatter_elements", indices, x.shape[axis], f"axis {axis}")
    dst = destination(xp, x.shape, x.dtype, out)
    dst[...] = x
    index = tuple(indices if a == axis else
                  xp.arange(n).reshape((1,) * a + (n,) + (1,) * (indices.ndim - a - 1))
                  for a, n in enumerate(indices.shape))
    return dst, index, updates.astype(x.dtype, copy=False)


def scatter_nd_setup(xp: Any, inputs: Inputs, out: Out) -> tuple[Any, tuple[Any, ...], Any]:
    """Checked ScatterND: (the result holding a copy of data, one index array per indexed
    axis, the updates in data's dtype)."""
    x, indices, updates = inputs
    check_index_dtype("scatter_nd", indices)
    k = scatter_nd_depth("scatter_nd", x.shape, indices.shape, updates.shape)
    for j in range(k):
        check_indices("scatter_nd", indices[..., j], x.shape[j], f"axis {j}")
    dst = destination(xp, x.shape, x.dtype, out)
    dst[...] = x
    return dst, tuple(indices[..., j] for j in range(k)), updates.astype(x.dtype, copy=False)


@TABLE.kernel(Op.SCATTER_ELEMENTS, supports_out=True)
def scatter_elements(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Copy data into the result, then scatter in place with broadcast index arrays."""
    reduction = check_reduction("scatter_elements", attrs["reduction"])
    dst, index, updates = scatter_elements_setup(ctx.xp, inputs, attrs, out)
    _ufunc_at(ctx, "scatter_elements", reduction, dst, index, updates)
    return [dst]


@TABLE.kernel(Op.SCATTER_ND, supports_out=True)
def scatter_nd(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Copy data into the result, then scatter in place at the index tuples."""
    reduction = check_reduction("scatter_nd", attrs["reduction"])
    dst, index, updates = scatter_nd_setup(ctx.xp, inputs, out)
    _ufunc_at(ctx, "scatter_nd", reduction, dst, index, updates)
    return [dst]


def _stable_argsort(xp: Any, x: Any, axis: int) -> Any:
    # CuPy's argsort is stable already and takes no ``kind``.
    if _is_numpy(xp):
        return xp.argsort(x, axis=axis, kind="stable")
    return xp.argsort(x, axis=axis)


@TABLE.kernel(Op.TOPK)
def topk(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Values descend (ascend) along ``axis``; equal values keep ascending index order."""
    xp, x = ctx.xp, inputs[0]
    if x.ndim == 0:
        raise InvalidArgumentError("topk needs an input of rank >= 1, got a scalar")
    axis = normalize_axis(attrs["axis"], x.ndim, what="topk axis")
    n = x.shape[axis]
    k = topk_k("topk", require(ints_param("topk", inputs, 1, attrs, "k"), "topk", "k"), n)
    lanes = xp.moveaxis(x, axis, -1)
    if 0 < 4 * k <= n and not (x.dtype.kind == "f" and bool(xp.isnan(lanes).any())):
        order = _select_k(xp, lanes, k, attrs["largest"])
    else:
        order = _sort_lanes(xp, lanes, attrs["largest"])[..., :k]
    order = xp.ascontiguousarray(xp.moveaxis(order, -1, axis)).astype("int64", copy=False)
    return [xp.take_along_axis(x, order, axis=axis), order]


def _sort_lanes(xp: Any, lanes: Any, largest: bool) -> Any:
    """Stable order of every lane; for ``largest`` the lane is sorted reversed and read
    backwards, so values descend and equal values still come in ascending index."""
    if not largest:
        return _stable_argsort(xp, lanes, -1)
    n = lanes.shape[-1]
    return (n - 1) - _stable_argsort(xp, lanes[..., ::-1], -1)[..., ::-1]


def _select_k(xp: Any, lanes: Any, k: int, largest: bool) -> Any:
    """The top k of each lane in O(n): partition for the k-th value, keep everything
    beyond it and the lowest-index ties at it, then sort only those k."""
    n = lanes.shape[-1]
    kth = n - k if largest else k - 1
    threshold = xp.partition(lanes, kth, axis=-1)[..., kth:kth + 1]
    beyond = lanes > threshold if largest else lanes < threshold
    ties = lanes == threshold
    room = k - beyond.sum(axis=-1, keepdims=True)
    if bool((ties.sum(axis=-1, keepdims=True) > room).any()):
        ties &= xp.cumsum(ties, axis=-1) <= room      # only the lowest-index ties fit
    chosen = beyond | ties
    # Exactly k per lane, so the row-major positions regroup into (..., k), in index order.
    picked = (xp.nonzero(chosen.reshape(-1))[0] % n).reshape((*lanes.shape[:-1], k))
    values = xp.take_along_axis(lanes, picked, axis=-1)
    return xp.take_along_axis(picked, _sort_lanes(xp, values, largest), axis=-1)


@TABLE.kernel(Op.NONZERO)
def nonzero(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """int64 [rank, count] coordinates, row-major."""
    xp, x = ctx.xp, inputs[0]
    if x.ndim == 0:
        return [xp.zeros((0, int(bool(x))), dtype="int64")]
    coords = xp.nonzero(x)
    return [xp.stack(coords).astype("int64", copy=False).reshape(x.ndim, -1)]


@TABLE.kernel(Op.ONE_HOT, supports_out=True)
def one_hot(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Compare indices with a broadcast class range, then select on/off values."""
    xp, (indices, depth_t, values) = ctx.xp, inputs
    depth = one_hot_depth("one_hot", depth_t)
    if values.size != 2:
        raise InvalidArgumentError(
            f"one_hot: values must be [off_value, on_value], got {values.size} elements")
    dims = one_hot_dims("one_hot", indices.shape, depth, attrs["axis"])
    axis = normalize_axis(attrs["axis"], indices.ndim + 1)
    idx = indices.astype("int64", copy=False)     # float indices truncate, as onnxruntime
    idx = xp.where(idx < 0, idx + depth, idx)
    classes = xp.arange(depth).reshape((depth,) + (1,) * (indices.ndim - axis))
    hot = xp.expand_dims(idx, axis) == classes
    pair = values.reshape(-1)
    dst = destination(xp, static_dims(dims), values.dtype, out)
    dst[...] = xp.where(hot, pair[1], pair[0])
    return [dst]


@TABLE.kernel(Op.COMPRESS)
def compress(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """``take`` of the positions where the condition holds."""
    xp, (x, condition) = ctx.xp, inputs
    flat, axis = compress_layout("compress", x, condition, attrs["axis"])
    keep = xp.nonzero(condition)[0]
    return [_take(xp, flat, keep, axis)]


@TABLE.kernel(Op.REVERSE_SEQUENCE, supports_out=True)
def reverse_sequence(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One gather: step t of batch b reads step len_b - 1 - t while t < len_b."""
    xp, (x, seq) = ctx.xp, inputs
    t_axis, b_axis = reverse_axes("reverse_sequence", x.ndim, attrs)
    time, batch = x.shape[t_axis], x.shape[b_axis]
    lens = xp.asarray(list(sequence_lengths("reverse_sequence", seq, batch, time)),
                      dtype="int64").reshape(1, batch)
    steps = xp.arange(time, dtype="int64").reshape(time, 1)
    source = xp.where(steps < lens, lens - 1 - steps, steps)           # (time, batch)
    moved = xp.moveaxis(x, (t_axis, b_axis), (0, 1))
    gathered = moved[source, xp.arange(batch).reshape(1, batch)]
    dst = destination(xp, x.shape, x.dtype, out)
    xp.moveaxis(dst, (t_axis, b_axis), (0, 1))[...] = gathered
    return [dst]


@TABLE.kernel(Op.UNIQUE)
def unique(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """``unique`` with indices, inverse and counts; sorted=0 reorders by first occurrence."""
    xp, x = ctx.xp, inputs[0]
    axis = attrs["axis"]
    if axis is not None:
        axis = normalize_axis(axis, x.ndim, what="unique axis")
    y, first, inverse, counts = xp.unique(x, return_index=True, return_inverse=True,
                                          return_counts=True, axis=axis)
    inverse = inverse.reshape(-1)
    if not attrs["sorted"]:
        order = xp.argsort(first)          # first indices are distinct: any sort is exact
        rank = xp.empty_like(order)
        rank[order] = xp.arange(order.size, dtype=order.dtype)
        y = _take(xp, y, order, 0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    return [y, first.astype("int64", copy=False), inverse.astype("int64", copy=False),
            counts.astype("int64", copy=False)]
