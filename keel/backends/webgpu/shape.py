"""Shape and memory ops of the webgpu backend: views made into copies, Gather, Fill.

Reshape, Flatten, Squeeze, ExpandDims, Transpose, Slice, Index, Split, Expand,
Tile, DepthToSpace and SpaceToDepth compute the view NumPy would make (no data
moves; Expand and Tile are broadcast views with zero strides), then one
strided-copy shader writes it contiguous: the copy the op's contract asks for.
Concat, Pad (constant, edge, reflect, wrap) and Gather are typed shaders that
find each output element's source. Their shape arguments are small host
constants (read without a round trip). These ops move any dtype the backend
holds, integers, bool and float16 included.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, KernelTable, Out
from keel.backends.webgpu import wgsl
from keel.backends.webgpu.array import WgpuArray
from keel.backends.webgpu.ops import (
    MAX_RANK,
    Params,
    assign,
    broadcast_strides,
    contiguous,
    groups_for,
    launch,
    out_array,
)
from keel.backends.webgpu.typed import (
    constant_words,
    head,
    kind_of,
    launch_typed,
    output,
    typed_constant,
    typed_source,
)
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.indexing import check_index, check_indices, slice_index, slice_params
from keel.ops.schemas.shape import (
    check_pad_mode,
    check_same_dtype,
    concat_dims,
    depth_to_space_blocks,
    expand_dims_axes,
    expand_dims_dims,
    expand_shape,
    flatten_dims,
    ints_param,
    pad_constant,
    pad_widths,
    require,
    reshape_dims,
    space_to_depth_blocks,
    split_layout,
    squeeze_dims,
    static_dims,
    tile_dims,
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


_GATHER = """    let inner = P[14]; let count = P[15]; let dim = P[16];
    let e = k % inner;
    let q = (k / inner) % count;
    let o = k / (inner * count);
    var idx = {index};
    if (idx < 0) {{ idx = idx + i32(dim); }}
    idx = clamp(idx, 0, i32(dim) - 1);
    return ld0(P[17] + (o * dim + u32(idx)) * inner + e);
"""


def _gather(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x, indices = inputs
    axis = attrs["axis"]
    if not -x.ndim <= axis < x.ndim:
        raise InvalidArgumentError(f"gather axis {axis} is out of range for rank {x.ndim}")
    axis %= x.ndim
    if indices.storage.host is not None:          # a constant: checked on its host copy
        check_indices("gather", indices.to_host(), x.shape[axis], f"axis {axis}")
    elif indices.dtype not in (np.int32, np.int64):
        raise InvalidArgumentError(f"gather: indices must be int32 or int64, got "
                                   f"{indices.dtype}")
    xc, ic = contiguous(x), contiguous(indices)
    y = output(x.storage.device, out, (*x.shape[:axis], *indices.shape, *x.shape[axis + 1:]),
               x.dtype)
    if y.size == 0:
        return [y]
    wide = indices.dtype == np.int64
    index = "bitcast<i32>(ld1(P[18] + q).x)" if wide else "ld1(P[18] + q)"
    inner = math.prod(x.shape[axis + 1:])
    params = head(y).u(inner, ic.size, x.shape[axis], xc.offset, ic.offset)
    launch_typed(_typed(_GATHER.format(index=index), kind_of(x.dtype), kind_of(ic.dtype),
                        out=kind_of(x.dtype)), y, [xc, ic], params)
    return [y]


@functools.cache
def _typed(body: str, *kinds: str, out: str) -> str:
    return typed_source(kinds, out, body)


def _expand(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    target = require(ints_param("expand", inputs, 1, attrs, "shape"), "expand", "a shape")
    shape = static_dims(expand_shape("expand", x.shape, target))
    return _give(WgpuArray(x.storage, shape, x.dtype, broadcast_strides(x, shape), x.offset),
                 out)


def _tile(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Tile as a copy of a broadcast view: x (d0, d1) seen as (r0, d0, r1, d1) with the
    repeat dims of stride 0, written contiguous, is the tiled (r0*d0, r1*d1) array."""
    x = inputs[0]
    repeats = require(ints_param("tile", inputs, 1, attrs, "repeats"), "tile", "repeats")
    shape = static_dims(tile_dims("tile", x.shape, repeats))
    y = out_array(x.storage.device, out, 0, shape, x.dtype)
    spread = [d for pair in zip(repeats, x.shape, strict=True) for d in pair]
    strides = [s for st in x.strides_el for s in (0, st)]
    assign(y.reshape(spread) if y.size else y,
           WgpuArray(x.storage, spread, x.dtype, strides, x.offset))
    return [y]


# Concat: output element k takes input j where the axis coordinate is in j's range. P:
# head, the axis among the padded dims (14), then per input its start on the axis, offset
# and MAX_RANK strides (15 + 10j ...).
_CONCAT_SRC = """fn src(k: u32, a: u32, base: u32) -> u32 {
    var rem = k;
    var off = i32(P[base + 1u]);
    for (var d = 7; d >= 0; d = d - 1) {
        let n = P[6u + u32(d)];
        var c = rem % n;
        rem = rem / n;
        if (u32(d) == a) { c = c - P[base]; }
        off = off + i32(c) * bitcast<i32>(P[base + 2u + u32(d)]);
    }
    return u32(off);
}
"""


def _concat_body(count: int) -> str:
    lines = ["    let c = coord(k, P[14]);\n"]
    for j in range(count - 1):
        lines.append(f"    if (c < P[{15 + 10 * (j + 1)}u]) {{ return ld{j}(src(k, P[14], "
                     f"{15 + 10 * j}u)); }}\n")
    lines.append(f"    return ld{count - 1}(src(k, P[14], {15 + 10 * (count - 1)}u));\n")
    return "".join(lines)


@functools.cache
def _concat_source(kind: str, count: int) -> str:
    return typed_source((kind,) * count, kind, _concat_body(count)).replace(
        "fn val(", _CONCAT_SRC + "fn val(", 1)


def _concat(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    xs = list(inputs)
    check_same_dtype("concat", [x.dtype for x in xs])
    shape = static_dims(concat_dims("concat", [x.shape for x in xs], attrs["axis"]))
    axis = attrs["axis"] % len(shape)
    parts = [x for x in xs if x.size]
    # One dispatch binds the output, the parameters and as many inputs as the device
    # lets one shader bind; more inputs concatenate in steps, left to right.
    group = max(2, xs[0].storage.device.storage_bindings - 2)
    while len(parts) > group:
        first = parts[:group]
        dims = list(first[0].shape)
        dims[axis] = sum(x.shape[axis] for x in first)
        parts = [_join(first, tuple(dims), axis, None), *parts[group:]]
    return [_join(parts, shape, axis, out, xs[0])]


def _join(parts: list[WgpuArray], shape: tuple[int, ...], axis: int, out: Out,
          like: WgpuArray | None = None) -> WgpuArray:
    ref = parts[0] if parts else like
    assert ref is not None
    y = output(ref.storage.device, out, shape, ref.dtype)
    if y.size == 0 or not parts:
        return y
    pad = MAX_RANK - len(shape)
    params = head(y).u(axis + pad)
    start = 0
    for x in parts:
        params.u(start, x.offset).dims(x.strides_el, 0)
        start += x.shape[axis]
    kind = kind_of(ref.dtype)
    launch_typed(_concat_source(kind, len(parts)), y, parts, params)
    return y


# Pad: each output coordinate less the pad before it, mapped into the input by the mode.
# P: head (the constant's words at 2, 3), x offset (14), x strides (15..), x shape (23..),
# pads before (31..), each over MAX_RANK dims.
_PAD = """    var rem = k;
    var off = i32(P[14]);
    for (var d = 7; d >= 0; d = d - 1) {{
        let n = P[6u + u32(d)];
        let o = rem % n;
        rem = rem / n;
        let size = i32(P[23u + u32(d)]);
        var c = i32(o) - i32(P[31u + u32(d)]);
        if (c < 0 || c >= size) {{ {outside} }}
        off = off + c * bitcast<i32>(P[15u + u32(d)]);
    }}
    return ld0(u32(off));
"""
_PAD_MODES = {
    "edge": "c = clamp(c, 0, size - 1);",
    "reflect": "c = select(c, -c, c < 0); c = select(c, 2 * (size - 1) - c, c >= size);",
    "wrap": "c = ((c % size) + size) % size;",
}
def _pad(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    pads = require(ints_param("pad", inputs, 1, attrs, "pads"), "pad", "pads")
    widths = pad_widths("pad", x.shape, pads, ints_param("pad", inputs, 3, attrs, "axes"))
    mode = attrs["mode"]
    check_pad_mode("pad", mode, x.shape, widths)
    crop = x[tuple(slice(max(-b, 0), d - max(-e, 0))
                   for d, (b, e) in zip(x.shape, widths, strict=True))]
    shape = tuple(d + max(b, 0) + max(e, 0) for d, (b, e) in zip(crop.shape, widths,
                                                                   strict=True))
    kind = kind_of(x.dtype)
    words = constant_words(pad_constant(inputs, attrs), x.dtype) if mode == "constant" else []
    y = output(x.storage.device, out, shape, x.dtype)
    if y.size == 0:
        return [y]
    if crop.size == 0:                       # nothing to copy: all of it is the constant
        crop = WgpuArray(y.storage, (1,) * len(shape), y.dtype, None, 0)
    outside = _PAD_MODES.get(mode, f"return {typed_constant(kind)};")
    params = (head(y, words).u(crop.offset).dims(crop.strides_el, 0).dims(crop.shape, 1)
              .dims([max(b, 0) for b, _ in widths], 0))
    launch_typed(_typed(_PAD.format(outside=outside), kind, out=kind), y, [crop], params)
    return [y]


def _split(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    axis, sizes = split_layout("split", x.shape, inputs, attrs, out)
    pieces = []
    start = 0
    for i, size in enumerate(sizes):
        view = x[(slice(None),) * axis + (slice(start, start + size),)]
        y = out_array(x.storage.device, out, i, view.shape, x.dtype)
        assign(y, view)
        pieces.append(y)
        start += size
    return pieces


def _blocks_into(blocks: WgpuArray, shape: tuple[int, ...], out: Out) -> list[Any]:
    """``blocks`` (a permuted view) written contiguous as ``shape``: the same elements."""
    y = out_array(blocks.storage.device, out, 0, shape, blocks.dtype)
    assign(y.reshape(blocks.shape), blocks)
    return [y]


def _depth_to_space(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    blocks, final = depth_to_space_blocks(contiguous(inputs[0]), attrs["blocksize"],
                                          attrs["mode"])
    return _blocks_into(blocks, final, out)


def _space_to_depth(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    blocks, final = space_to_depth_blocks(contiguous(inputs[0]), attrs["blocksize"],
                                          attrs["mode"])
    return _blocks_into(blocks, final, out)


def register(table: KernelTable) -> None:
    for op, fn in ((Op.RESHAPE, _reshape), (Op.FLATTEN, _flatten), (Op.SQUEEZE, _squeeze),
                   (Op.EXPAND_DIMS, _expand_dims), (Op.TRANSPOSE, _transpose),
                   (Op.SLICE, _slice), (Op.INDEX, _index), (Op.COPY, _copy),
                   (Op.IDENTITY, _copy), (Op.FILL, _fill), (Op.GATHER, _gather),
                   (Op.EXPAND, _expand), (Op.TILE, _tile), (Op.CONCAT, _concat),
                   (Op.PAD, _pad), (Op.SPLIT, _split), (Op.DEPTH_TO_SPACE, _depth_to_space),
                   (Op.SPACE_TO_DEPTH, _space_to_depth)):
        table.kernel(op, supports_out=True, description=f"WGSL strided copy ({op.value})")(fn)
