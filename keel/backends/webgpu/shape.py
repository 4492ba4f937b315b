"""Shape and memory ops of the webgpu backend: views made into copies, Gather, Fill.

Reshape, Flatten, Squeeze, ExpandDims, Transpose, Slice and Index compute the
view NumPy would make (no data moves), then one strided-copy shader writes it
contiguous: the copy the op's contract asks for. Their shape arguments are
small host constants (read without a round trip). These ops move any dtype the
backend holds, integers included.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, KernelTable, Out
from keel.backends.webgpu import wgsl
from keel.backends.webgpu.array import WgpuArray
from keel.backends.webgpu.ops import Params, assign, groups_for, launch, out_array
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.indexing import check_index, check_indices, slice_index, slice_params
from keel.ops.schemas.shape import (
    expand_dims_axes,
    expand_dims_dims,
    flatten_dims,
    ints_param,
    require,
    reshape_dims,
    squeeze_dims,
    static_dims,
    transpose_perm,
)
from keel.ops.types import checked_numel

__all__ = ["register"]


def _give(view: WgpuArray, out: Out) -> list[Any]:
    """The view written contiguous: into ``out[0]`` when it fits, else a fresh array."""
    y = out_array(view.storage.device, out, 0, view.shape, view.dtype)
    assign(y, view)
    return [y]


def _reshape(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    target = require(ints_param("reshape", inputs, 1, attrs, "shape"), "reshape", "a shape")
    shape = static_dims(reshape_dims("reshape", x.shape, target, attrs["allowzero"]))
    return _give(_as_shape(x, shape), out)


def _as_shape(x: WgpuArray, shape: tuple[int, ...]) -> WgpuArray:
    if x.is_contiguous():
        return x.reshape(shape)
    return x.copy().reshape(shape)


def _flatten(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    return _give(_as_shape(x, static_dims(flatten_dims("flatten", x.shape, attrs["axis"]))),
                 out)


def _squeeze(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    shape = squeeze_dims("squeeze", x.shape, ints_param("squeeze", inputs, 1, attrs, "axes"))
    return _give(_as_shape(x, static_dims(shape or ())), out)


def _expand_dims(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    axes = require(expand_dims_axes("expand_dims", ints_param("expand_dims", inputs, 1, attrs,
                                                              "axes"), attrs["axis"]),
                   "expand_dims", "'axis' or axes")
    return _give(_as_shape(x, static_dims(expand_dims_dims("expand_dims", x.shape, axes))),
                 out)


def _transpose(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    return _give(x.transpose(transpose_perm("transpose", attrs["perm"], x.ndim)), out)


def _slice(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    starts, ends, axes, steps = (ints_param("slice", inputs, i, attrs, name)
                                 for i, name in enumerate(("starts", "ends", "axes", "steps"), 1))
    params = slice_params("slice", x.ndim, require(starts, "slice", "starts"),
                          require(ends, "slice", "ends"), axes, steps)
    return _give(x[slice_index(x.shape, params)], out)


def _index(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    if x.ndim == 0:
        raise InvalidArgumentError("index needs an input of rank >= 1, got a scalar")
    axis = attrs["axis"] % x.ndim if -x.ndim <= attrs["axis"] < x.ndim else None
    if axis is None:
        raise InvalidArgumentError(f"index axis {attrs['axis']} is out of range for rank "
                                   f"{x.ndim}")
    i = check_index("index", attrs["index"], x.shape[axis], axis)
    key = (slice(None),) * axis + (i,)
    return _give(x[key], out)


def _copy(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    if out is not None and (tuple(out[0].shape) != x.shape or out[0].dtype != x.dtype):
        raise InvalidArgumentError(
            f"copy needs an output of exactly the input's shape and dtype "
            f"{x.dtype}{list(x.shape)}, got {out[0].dtype}{list(out[0].shape)} "
            "(use cast to convert)")
    return _give(x, out)


def _fill(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    flat = np.asarray(inputs[0]).reshape(-1)          # a small host copy
    if flat.shape[0] == 0:
        raise InvalidArgumentError("fill reads its value from element 0 of input 0, which "
                                   "is empty")
    value = flat[0:1].reshape(())                     # seed 001: the rest is padding
    src = inputs[0]
    if out is not None:
        shape, dtype = tuple(out[0].shape), out[0].dtype
    elif attrs.get("shape") is not None:
        shape = tuple(attrs["shape"])
        checked_numel(shape, what="fill shape")
        dtype = attrs["dtype"].numpy if attrs.get("dtype") is not None else value.dtype
    else:
        raise InvalidArgumentError(
            "fill needs its output shape: pass an output tensor or the attribute 'shape'")
    y = out_array(src.storage.device, out, 0, shape, dtype)
    with np.errstate(all="ignore"):
        word = np.asarray(value).astype(y.dtype).reshape(1)
    if y.size == 0:
        return [y]
    if y.itemsize % 4:
        assign(y, np.broadcast_to(word, shape))       # 1- and 2-byte values: one upload
        return [y]
    words = word.view(np.uint32)
    params = Params().u(y.size, words.size, y.offset * words.size, *words)
    launch(wgsl.fill_words(), [y], params, groups_for(y.size), [y])
    return [y]


def _gather(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x, indices = inputs
    axis = attrs["axis"]
    if not -x.ndim <= axis < x.ndim:
        raise InvalidArgumentError(f"gather axis {axis} is out of range for rank {x.ndim}")
    axis %= x.ndim
    if indices.storage.host is not None:          # a constant: checked on its host copy
        check_indices("gather", indices.to_host(), x.shape[axis], f"axis {axis}")
    elif indices.dtype.kind not in "iu" or indices.itemsize not in (4, 8):
        raise InvalidArgumentError(f"gather: indices must be int32 or int64, got "
                                   f"{indices.dtype}")
    if x.itemsize % 4:
        raise InvalidArgumentError(f"webgpu gathers elements of 4 or 8 bytes, got {x.dtype}")
    xc = x if x.is_contiguous() else x.copy()
    ic = indices if indices.is_contiguous() else indices.copy()
    shape = (*x.shape[:axis], *indices.shape, *x.shape[axis + 1:])
    y = out_array(x.storage.device, out, 0, shape, x.dtype)
    if y.size == 0:
        return [y]
    words = x.itemsize // 4
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    inner = int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    params = Params().u(outer, ic.size, inner, x.shape[axis], xc.offset * words, ic.offset,
                        y.offset * words, ic.itemsize // 4)
    launch(wgsl.gather(words), [y, xc, ic], params, groups_for(y.size), [y])
    return [y]


def register(table: KernelTable) -> None:
    for op, fn in ((Op.RESHAPE, _reshape), (Op.FLATTEN, _flatten), (Op.SQUEEZE, _squeeze),
                   (Op.EXPAND_DIMS, _expand_dims), (Op.TRANSPOSE, _transpose),
                   (Op.SLICE, _slice), (Op.INDEX, _index), (Op.COPY, _copy),
                   (Op.IDENTITY, _copy), (Op.FILL, _fill), (Op.GATHER, _gather)):
        table.kernel(op, supports_out=True, description=f"WGSL strided copy ({op.value})")(fn)
