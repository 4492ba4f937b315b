"""Reference kernels of the shape family: readable NumPy, the executable spec.

Shapes come from the rules in :mod:`keel.ops.schemas.shape` (the same ones
the schemas and the other backends use); every kernel returns fresh arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.shape import (
    check_dims,
    check_pad_mode,
    check_same_dtype,
    concat_dims,
    depth_to_space_blocks,
    expand_dims_axes,
    expand_dims_dims,
    expand_shape,
    fill_value,
    flatten_dims,
    ints_param,
    pad_constant,
    pad_widths,
    range_values,
    require,
    reshape_dims,
    shape_interval,
    space_to_depth_blocks,
    split_layout,
    squeeze_dims,
    static_dims,
    tile_dims,
    transpose_perm,
    trilu_k,
)


@TABLE.kernel(Op.RESHAPE)
def reshape(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX Reshape: 0 copies a dim (unless allowzero), one -1 is inferred."""
    x = inputs[0]
    target = require(ints_param("reshape", inputs, 1, attrs, "shape"), "reshape", "a shape")
    shape = static_dims(reshape_dims("reshape", x.shape, target, attrs["allowzero"]))
    return [np.reshape(x, shape).copy()]


@TABLE.kernel(Op.EXPAND_DIMS)
def expand_dims(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Insert size-1 dims at the given axes (normalized against the output rank)."""
    x = inputs[0]
    axes = require(expand_dims_axes("expand_dims", ints_param("expand_dims", inputs, 1, attrs,
                                                              "axes"), attrs["axis"]),
                   "expand_dims", "'axis' or axes")
    return [np.reshape(x, static_dims(expand_dims_dims("expand_dims", x.shape, axes))).copy()]


@TABLE.kernel(Op.SQUEEZE)
def squeeze(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Remove the given size-1 axes, or every size-1 axis."""
    x = inputs[0]
    shape = squeeze_dims("squeeze", x.shape, ints_param("squeeze", inputs, 1, attrs, "axes"))
    return [np.reshape(x, static_dims(shape or ())).copy()]


@TABLE.kernel(Op.TRANSPOSE)
def transpose(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Permute the axes (default: reverse them)."""
    x = inputs[0]
    return [np.transpose(x, transpose_perm("transpose", attrs["perm"], x.ndim)).copy()]


@TABLE.kernel(Op.FLATTEN)
def flatten(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """2-D view: dims before ``axis`` multiply into rows, the rest into columns."""
    x = inputs[0]
    return [np.reshape(x, static_dims(flatten_dims("flatten", x.shape, attrs["axis"]))).copy()]


@TABLE.kernel(Op.EXPAND)
def expand(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Broadcast the input with the given shape (both ways)."""
    x = inputs[0]
    target = require(ints_param("expand", inputs, 1, attrs, "shape"), "expand", "a shape")
    shape = static_dims(expand_shape("expand", x.shape, target))
    return [np.broadcast_to(x, shape).copy()]


@TABLE.kernel(Op.SHAPE)
def shape(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The dims [start, end) of the input as int64."""
    dims = inputs[0].shape
    lo, hi = shape_interval(len(dims), attrs["start"], attrs["end"])
    return [np.array(dims[lo:hi], dtype=np.int64)]


@TABLE.kernel(Op.SIZE)
def size(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The element count as an int64 scalar."""
    return [np.array(inputs[0].size, dtype=np.int64)]


@TABLE.kernel(Op.CONCAT)
def concat(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Join inputs of one dtype along ``axis``."""
    check_same_dtype("concat", [x.dtype for x in inputs])
    concat_dims("concat", [x.shape for x in inputs], attrs["axis"])
    return [np.concatenate(list(inputs), axis=attrs["axis"])]


@TABLE.kernel(Op.SPLIT)
def split(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Cut the input along ``axis`` into pieces of the given (or equal, ceil) sizes."""
    x = inputs[0]
    axis, sizes = split_layout("split", x.shape, inputs, attrs, out)
    offsets = np.cumsum(sizes)[:-1]
    return [piece.copy() for piece in np.split(x, offsets, axis=axis)]


@TABLE.kernel(Op.TILE)
def tile(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Repeat the input ``repeats[i]`` times along axis i."""
    x = inputs[0]
    repeats = require(ints_param("tile", inputs, 1, attrs, "repeats"), "tile", "repeats")
    tile_dims("tile", x.shape, repeats)         # checks the count and overflow first
    return [np.tile(x, repeats)]


@TABLE.kernel(Op.PAD)
def pad(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Pad (negative pads crop first) in mode constant, reflect, edge or wrap."""
    x = inputs[0]
    pads = require(ints_param("pad", inputs, 1, attrs, "pads"), "pad", "pads")
    widths = pad_widths("pad", x.shape, pads, ints_param("pad", inputs, 3, attrs, "axes"))
    mode = attrs["mode"]
    check_pad_mode("pad", mode, x.shape, widths)
    crop = tuple(slice(max(-b, 0), d - max(-e, 0)) for d, (b, e) in zip(x.shape, widths,
                                                                          strict=True))
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    if mode != "constant":
        return [np.pad(x[crop], grow, mode=mode)]
    value = pad_constant(inputs, attrs)
    return [np.pad(x[crop], grow, mode="constant", constant_values=value).astype(x.dtype)]


@TABLE.kernel(Op.DEPTH_TO_SPACE)
def depth_to_space(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Move channel blocks into space (DCR: depth-column-row; CRD: column-row-depth)."""
    blocks, final = depth_to_space_blocks(inputs[0], attrs["blocksize"], attrs["mode"])
    return [blocks.reshape(final).copy()]


@TABLE.kernel(Op.SPACE_TO_DEPTH)
def space_to_depth(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Move spatial blocks into channels (the inverse of depth_to_space in the same mode)."""
    blocks, final = space_to_depth_blocks(inputs[0], attrs["blocksize"], attrs["mode"])
    return [blocks.reshape(final).copy()]


@TABLE.kernel(Op.CONSTANT_OF_SHAPE)
def constant_of_shape(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A tensor of the given shape filled with ``value`` (default float32 0)."""
    value = fill_value("constant_of_shape", attrs["value"])
    shape = require(ints_param("constant_of_shape", inputs, 0, attrs, "shape"),
                    "constant_of_shape", "a shape")
    return [np.full(check_dims("constant_of_shape", shape, "shape"), value, dtype=value.dtype)]


@TABLE.kernel(Op.RANGE)
def range_(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """start + i * delta for i < max(ceil((limit - start) / delta), 0)."""
    return [range_values("range", inputs)]


@TABLE.kernel(Op.EYE_LIKE)
def eye_like(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Ones on diagonal ``k`` of a matrix shaped like the input."""
    x = inputs[0]
    if x.ndim != 2:
        raise InvalidArgumentError(f"eye_like needs a rank-2 input, got shape {x.shape}")
    dtype = (attrs["dtype"] or DType.from_numpy(x.dtype)).numpy
    return [np.eye(x.shape[0], x.shape[1], k=attrs["k"], dtype=dtype)]


@TABLE.kernel(Op.TRILU)
def trilu(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Keep the upper (or lower) triangle from diagonal k of the last two dims."""
    x = inputs[0]
    if x.ndim < 2:
        raise InvalidArgumentError(f"trilu needs rank >= 2, got shape {x.shape}")
    k = trilu_k(inputs, attrs)
    return [np.triu(x, k) if attrs["upper"] else np.tril(x, k)]
