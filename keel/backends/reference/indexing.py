"""Reference kernels of the indexing family: readable NumPy, the executable spec.

Index rules (bounds, slice clamping, shapes) come from
:mod:`keel.ops.schemas.indexing`. Scatter reductions on floats accumulate in
float64 and cast once at the end; every kernel returns fresh arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.indexing import (
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


def _non_negative(indices: np.ndarray, size: int) -> np.ndarray:
    return np.where(indices < 0, indices + size, indices).astype(np.int64)


@TABLE.kernel(Op.INDEX)
def index(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Seed 001: the slice at ``index`` along ``axis``, with that axis removed."""
    x = inputs[0]
    if x.ndim == 0:
        raise InvalidArgumentError("index needs an input of rank >= 1, got a scalar")
    axis = normalize_axis(attrs["axis"], x.ndim, what="index axis")
    i = check_index("index", attrs["index"], x.shape[axis], axis)
    return [np.take(x, i, axis=axis)]


@TABLE.kernel(Op.SLICE)
def slice_(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX Slice with clamping and negative steps."""
    x = inputs[0]
    starts, ends, axes, steps = (ints_param("slice", inputs, i, attrs, name)
                                 for i, name in enumerate(("starts", "ends", "axes", "steps"), 1))
    params = slice_params("slice", x.ndim, require(starts, "slice", "starts"),
                          require(ends, "slice", "ends"), axes, steps)
    return [x[slice_index(x.shape, params)].copy()]


@TABLE.kernel(Op.GATHER)
def gather(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Take ``indices`` along ``axis``: dims data[:axis] + indices + data[axis+1:]."""
    x, indices = inputs
    axis = normalize_axis(attrs["axis"], x.ndim, what="gather axis")
    check_indices("gather", indices, x.shape[axis], f"axis {axis}")
    return [np.take(x, _non_negative(indices, x.shape[axis]), axis=axis)]


@TABLE.kernel(Op.GATHER_ELEMENTS)
def gather_elements(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """out[i][j] = data[indices[i][j]][j] for axis 0 (and likewise for other axes)."""
    x, indices = inputs
    axis = elements_check("gather_elements", x.shape, indices.shape, attrs["axis"])
    check_indices("gather_elements", indices, x.shape[axis], f"axis {axis}")
    result = np.empty(indices.shape, dtype=x.dtype)
    for pos in np.ndindex(*indices.shape):
        src = list(pos)
        src[axis] = int(indices[pos])
        result[pos] = x[tuple(src)]
    return [result]


@TABLE.kernel(Op.GATHER_ND)
def gather_nd(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Index tuples along the last dim of ``indices``, after ``batch_dims`` shared dims."""
    x, indices = inputs
    b = attrs["batch_dims"]
    check_index_dtype("gather_nd", indices)
    dims = static_dims(gather_nd_dims("gather_nd", x.shape, indices.shape, b) or ())
    result = np.empty(dims, dtype=x.dtype)
    for pos in np.ndindex(*indices.shape[:-1]):
        src = _nd_index("gather_nd", x.shape, b, indices[pos])
        result[pos] = x[pos[:b] + src]
    return [result]


def _nd_index(op: str, shape: Sequence[int], first_axis: int, tup: np.ndarray) -> tuple[int, ...]:
    """One index tuple of GatherND/ScatterND, checked and made non-negative."""
    return tuple(check_index(op, int(v), shape[first_axis + j], first_axis + j)
                 for j, v in enumerate(tup.tolist()))


def _combine(reduction: str) -> Callable[[Any, Any], Any]:
    """How a scatter merges an update into the current value."""
    table: dict[str, Callable[[Any, Any], Any]] = {
        "none": lambda old, new: new,
        "add": lambda old, new: old + new,
        "mul": lambda old, new: old * new,
        "max": np.maximum,
        "min": np.minimum,
    }
    return table[reduction]


def _work_copy(x: np.ndarray) -> np.ndarray:
    """The accumulator of a scatter: float64 for floats (cast back at the end)."""
    return x.astype(np.float64) if x.dtype.kind == "f" else x.copy()


@TABLE.kernel(Op.SCATTER_ELEMENTS)
def scatter_elements(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A copy of data with ``updates`` written (or reduced) at ``indices`` along ``axis``."""
    x, indices, updates = inputs
    combine = _combine(check_reduction("scatter_elements", attrs["reduction"]))
    axis = elements_check("scatter_elements", x.shape, indices.shape, attrs["axis"])
    updates_like("scatter_elements", indices.shape, updates.shape)
    check_indices("scatter_elements", indices, x.shape[axis], f"axis {axis}")
    result = _work_copy(x)
    for pos in np.ndindex(*indices.shape):
        dst = list(pos)
        dst[axis] = int(indices[pos]) % x.shape[axis]
        result[tuple(dst)] = combine(result[tuple(dst)], updates[pos])
    return [result.astype(x.dtype)]


@TABLE.kernel(Op.SCATTER_ND)
def scatter_nd(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A copy of data with ``updates`` written (or reduced) at index tuples."""
    x, indices, updates = inputs
    combine = _combine(check_reduction("scatter_nd", attrs["reduction"]))
    check_index_dtype("scatter_nd", indices)
    scatter_nd_depth("scatter_nd", x.shape, indices.shape, updates.shape)
    result = _work_copy(x)
    for pos in np.ndindex(*indices.shape[:-1]):
        dst = _nd_index("scatter_nd", x.shape, 0, indices[pos])
        result[dst] = combine(result[dst], updates[pos])
    return [result.astype(x.dtype)]


@TABLE.kernel(Op.TOPK)
def topk(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The k largest (smallest) values and their indices; ties keep the lower index first."""
    x = inputs[0]
    if x.ndim == 0:
        raise InvalidArgumentError("topk needs an input of rank >= 1, got a scalar")
    axis = normalize_axis(attrs["axis"], x.ndim, what="topk axis")
    k = topk_k("topk", require(ints_param("topk", inputs, 1, attrs, "k"), "topk", "k"),
               x.shape[axis])
    lanes = np.moveaxis(x, axis, -1)
    order = np.empty((*lanes.shape[:-1], k), dtype=np.int64)
    for pos in np.ndindex(*lanes.shape[:-1]):
        values = lanes[pos].tolist()
        # Python's sort is stable, also with reverse=True: ties stay in index order.
        ranked = sorted(range(len(values)), key=values.__getitem__, reverse=attrs["largest"])
        order[pos] = ranked[:k]
    indices = np.moveaxis(order, -1, axis)
    return [np.take_along_axis(x, indices, axis=axis), np.ascontiguousarray(indices)]


@TABLE.kernel(Op.NONZERO)
def nonzero(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """int64 [rank, count] coordinates of the non-zero elements, row-major."""
    x = inputs[0]
    if x.ndim == 0:
        return [np.zeros((0, int(bool(x))), dtype=np.int64)]
    return [np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)]


@TABLE.kernel(Op.ONE_HOT)
def one_hot(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """on_value where index == class (negative indices from the end), off_value elsewhere."""
    indices, depth_t, values = inputs
    depth = one_hot_depth("one_hot", depth_t)
    if values.size != 2:
        raise InvalidArgumentError(
            f"one_hot: values must be [off_value, on_value], got {values.size} elements")
    dims = one_hot_dims("one_hot", indices.shape, depth, attrs["axis"])
    axis = normalize_axis(attrs["axis"], indices.ndim + 1)
    idx = np.asarray(indices).astype(np.int64)      # float indices truncate, as onnxruntime
    idx = np.where(idx < 0, idx + depth, idx)
    classes = np.arange(depth).reshape((depth,) + (1,) * (indices.ndim - axis))
    hot = np.expand_dims(idx, axis) == classes
    off, on = values.reshape(-1)
    return [np.where(hot, on, off).astype(values.dtype).reshape(dims)]


@TABLE.kernel(Op.COMPRESS)
def compress(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Keep slices (or flat elements) where the bool condition holds."""
    x, condition = inputs
    flat, axis = compress_layout("compress", x, condition, attrs["axis"])
    keep = np.nonzero(condition.reshape(-1))[0]
    return [np.take(flat, keep, axis=axis)]


@TABLE.kernel(Op.REVERSE_SEQUENCE)
def reverse_sequence(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Reverse the first ``sequence_lens[b]`` time steps of each batch entry b."""
    x, seq = inputs
    t_axis, b_axis = reverse_axes("reverse_sequence", x.ndim, attrs)
    lens = sequence_lengths("reverse_sequence", seq, x.shape[b_axis], x.shape[t_axis])
    result = x.copy()
    for b, n in enumerate(lens):
        if n == 0:
            continue
        dst: list[Any] = [slice(None)] * x.ndim
        src: list[Any] = [slice(None)] * x.ndim
        dst[b_axis] = src[b_axis] = b
        dst[t_axis], src[t_axis] = slice(0, n), slice(n - 1, None, -1)
        result[tuple(dst)] = x[tuple(src)]
    return [result]


@TABLE.kernel(Op.UNIQUE)
def unique(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Unique values (or slices), first indices, inverse indices and counts."""
    x = inputs[0]
    axis = attrs["axis"]
    if axis is not None:
        axis = normalize_axis(axis, x.ndim, what="unique axis")
    y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True,
                                          return_counts=True, axis=axis)
    inverse = inverse.reshape(-1)
    if not attrs["sorted"]:
        order = np.argsort(first)               # by first occurrence
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        y = np.take(y, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    return [y, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)]
