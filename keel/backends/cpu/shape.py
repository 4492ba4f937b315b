"""cpu kernels of the shape family, written once against ``ctx.xp``.

The same code runs on NumPy and on CuPy: only the subset of the array API the
two share is used. Reshape-like ops (reshape, expand_dims, squeeze, flatten)
return views when called without ``out`` (the schemas mark them in-place, so
a planner aliases their buffers); the others return fresh arrays, or write
into ``out`` without temporaries where the op allows it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Bind, Inputs, KernelContext, Out
from keel.backends.cpu import native_window
from keel.backends.cpu.kernels import TABLE
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
    host_scalar,
    ints_param,
    pad_constant,
    pad_widths,
    range_count,
    require,
    reshape_dims,
    shape_interval,
    space_to_depth_blocks,
    split_sizes,
    squeeze_dims,
    static_dims,
    tile_dims,
    transpose_perm,
    trilu_k,
)
from keel.ops.types import normalize_axis


def destination(xp: Any, shape: Sequence[int], dtype: Any, out: Out, i: int = 0) -> Any:
    """``out[i]`` checked against the result's shape, or a fresh uninitialized array."""
    if out is None:
        return xp.empty(tuple(shape), dtype=dtype)
    dst = out[i]
    if tuple(dst.shape) != tuple(shape):
        raise InvalidArgumentError(
            f"output {i} has shape {tuple(dst.shape)}; the result has {tuple(shape)}"
        )
    return dst


def emit(xp: Any, result: Any, out: Out) -> list[Any]:
    """Return ``result`` as is, or copy it into ``out[0]`` (a view copies without a temporary)."""
    if out is None:
        return [result]
    dst = destination(xp, result.shape, result.dtype, out)
    dst[...] = result
    return [dst]


def _view(xp: Any, x: Any, shape: Sequence[int], out: Out) -> list[Any]:
    # reshape is a view when the layout allows it (always for contiguous input).
    return emit(xp, x.reshape(tuple(shape)), out)


# ---- binding: a program step's copies prepared once (KernelVariant.bind) ----------
Copies = Callable[[Inputs, Attrs, Sequence[Any]], list[tuple[Any, Any]]]


def _copy_bind(copies: Copies) -> Bind:
    """A bind for a kernel that copies views of its input into its outputs: ``copies``
    gives the (output, source view) pairs the kernel's ``dst[...] = view`` writes."""
    def bind(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
             out: Sequence[Any]) -> Callable[[], object] | None:
        if ctx.xp is not np:
            return None
        pairs = copies(inputs, attrs, out)
        if len(pairs) != len(out) or any(
                d.shape != v.shape or d.dtype != v.dtype for d, v in pairs):
            return None
        if len(pairs) == 1:
            return functools.partial(np.copyto, *pairs[0])
        return functools.partial(_copy_all, tuple(pairs))
    return bind


def _copy_all(pairs: tuple[tuple[Any, Any], ...]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def _reshape_copies(inputs: Inputs, attrs: Attrs, out: Sequence[Any]) -> list[tuple[Any, Any]]:
    x = inputs[0]
    target = require(ints_param("reshape", inputs, 1, attrs, "shape"), "reshape", "a shape")
    return [(out[0], x.reshape(static_dims(reshape_dims("reshape", x.shape, target,
                                                         attrs["allowzero"]))))]


def _transpose_copies(inputs: Inputs, attrs: Attrs,
                      out: Sequence[Any]) -> list[tuple[Any, Any]]:
    x = inputs[0]
    return [(out[0], x.transpose(transpose_perm("transpose", attrs["perm"], x.ndim)))]


def _bind_transpose(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                    out: Sequence[Any]) -> Callable[[], object] | None:
    """Transpose's copy for one program step: the native strided copy split over the
    node's threads where it has more than one and work for them (as the kernel runs it,
    decided once here), else NumPy's."""
    if ctx.xp is not np:
        return None
    (dst, view), = _transpose_copies(inputs, attrs, out)
    if dst.shape != view.shape or dst.dtype != view.dtype:
        return None
    threads = ctx.threads or 1
    split = native_window.bind_strided_copy(view, dst, threads) if threads > 1 else None
    return split if split is not None else functools.partial(np.copyto, dst, view)


def _expand_copies(inputs: Inputs, attrs: Attrs, out: Sequence[Any]) -> list[tuple[Any, Any]]:
    x = inputs[0]
    target = require(ints_param("expand", inputs, 1, attrs, "shape"), "expand", "a shape")
    shape = static_dims(expand_shape("expand", x.shape, target))
    return [(out[0], np.broadcast_to(x, shape))]


def _split_copies(inputs: Inputs, attrs: Attrs, out: Sequence[Any]) -> list[tuple[Any, Any]]:
    x = inputs[0]
    axis = normalize_axis(attrs["axis"], x.ndim, what="split axis")
    given, num = ints_param("split", inputs, 1, attrs, "split"), attrs["num_outputs"]
    if given is None and num is None:
        num = len(out)
    pairs, start = [], 0
    for i, n in enumerate(split_sizes("split", x.shape[axis], given, num)):
        pairs.append((out[i], x[(slice(None),) * axis + (slice(start, start + n),)]))
        start += n
    return pairs


def _bind_concat(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                 out: Sequence[Any]) -> Callable[[], object] | None:
    """Concat into its output for one program step (``KernelVariant.bind``)."""
    check_same_dtype("concat", [x.dtype for x in inputs])
    dims, axis = _concat_layout(tuple(x.shape for x in inputs), attrs["axis"])
    dst = out[0]
    if ctx.xp is not np or dst.shape != dims or dst.dtype != inputs[0].dtype:
        return None
    return functools.partial(np.concatenate, tuple(inputs), axis=axis, out=dst)


@functools.lru_cache(maxsize=512)
def _concat_layout(shapes: tuple[tuple[int, ...], ...], axis: int) -> tuple[tuple[int, ...], int]:
    """Concat's output shape and normalized axis, checked once per input shapes."""
    dims = tuple(static_dims(concat_dims("concat", shapes, axis)))
    return dims, normalize_axis(axis, len(dims))


@functools.lru_cache(maxsize=512)
def _perm(perm: tuple[int, ...] | None, rank: int) -> tuple[int, ...]:
    """Transpose's full permutation, checked once per attribute and rank."""
    return transpose_perm("transpose", perm, rank)


@TABLE.kernel(Op.RESHAPE, supports_out=True, bind=_copy_bind(_reshape_copies))
def reshape(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A view in the target shape (0 copies a dim unless allowzero, one -1 inferred)."""
    x = inputs[0]
    target = require(ints_param("reshape", inputs, 1, attrs, "shape"), "reshape", "a shape")
    shape = static_dims(reshape_dims("reshape", x.shape, target, attrs["allowzero"]))
    return _view(ctx.xp, x, shape, out)


@TABLE.kernel(Op.EXPAND_DIMS, supports_out=True)
def expand_dims(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A view with size-1 dims inserted."""
    x = inputs[0]
    axes = require(expand_dims_axes("expand_dims", ints_param("expand_dims", inputs, 1, attrs,
                                                              "axes"), attrs["axis"]),
                   "expand_dims", "'axis' or axes")
    return _view(ctx.xp, x, static_dims(expand_dims_dims("expand_dims", x.shape, axes)), out)


@TABLE.kernel(Op.SQUEEZE, supports_out=True)
def squeeze(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A view without the given (or all) size-1 dims."""
    x = inputs[0]
    shape = squeeze_dims("squeeze", x.shape, ints_param("squeeze", inputs, 1, attrs, "axes"))
    return _view(ctx.xp, x, static_dims(shape or ()), out)


@TABLE.kernel(Op.FLATTEN, supports_out=True)
def flatten(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A 2-D view."""
    x = inputs[0]
    return _view(ctx.xp, x, static_dims(flatten_dims("flatten", x.shape, attrs["axis"])), out)


@TABLE.kernel(Op.TRANSPOSE, supports_out=True, bind=_bind_transpose)
def transpose(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Permuted axes, materialized in C order (one strided copy)."""
    xp, x = ctx.xp, inputs[0]
    perm = attrs["perm"]
    view = x.transpose(_perm(None if perm is None else tuple(perm), x.ndim))
    dst = destination(xp, view.shape, x.dtype, out)
    if not (xp is np and native_window.copy_strided(view, dst, ctx.threads or 1)):
        dst[...] = view
    return [dst]


@TABLE.kernel(Op.EXPAND, supports_out=True, bind=_copy_bind(_expand_copies))
def expand(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Broadcast into a materialized array (a broadcast view would be read-only)."""
    xp, x = ctx.xp, inputs[0]
    target = require(ints_param("expand", inputs, 1, attrs, "shape"), "expand", "a shape")
    dst = destination(xp, static_dims(expand_shape("expand", x.shape, target)), x.dtype, out)
    dst[...] = x
    return [dst]


@TABLE.kernel(Op.SHAPE)
def shape(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The dims [start, end) as int64."""
    dims = tuple(inputs[0].shape)
    lo, hi = shape_interval(len(dims), attrs["start"], attrs["end"])
    return emit(ctx.xp, ctx.xp.asarray(list(dims[lo:hi]), dtype="int64"), out)


@TABLE.kernel(Op.SIZE)
def size(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The element count as an int64 scalar."""
    return emit(ctx.xp, ctx.xp.asarray(int(inputs[0].size), dtype="int64"), out)


@TABLE.kernel(Op.CONCAT, supports_out=True, bind=_bind_concat)
def concat(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Join along ``axis`` (straight into ``out`` when given)."""
    xp = ctx.xp
    check_same_dtype("concat", [x.dtype for x in inputs])
    if out is None and attrs["axis"] in (0, -1) and all(x.ndim == 1 for x in inputs):
        # Shape arithmetic (1-D pieces of a shape): NumPy checks nothing else here, and
        # its own allocation is faster than empty() + out=.
        return [xp.concatenate(list(inputs))]
    dims, axis = _concat_layout(tuple(x.shape for x in inputs), attrs["axis"])
    if out is None:     # NumPy's own allocation here is faster than empty() + out=
        return [xp.concatenate(list(inputs), axis=axis)]
    dst = destination(xp, dims, inputs[0].dtype, out)
    xp.concatenate(list(inputs), axis=axis, out=dst)
    return [dst]


@TABLE.kernel(Op.SPLIT, supports_out=True, bind=_copy_bind(_split_copies))
def split(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Copy each piece into its own array (or ``out[i]``)."""
    xp, x = ctx.xp, inputs[0]
    axis = normalize_axis(attrs["axis"], x.ndim, what="split axis")
    given, num = ints_param("split", inputs, 1, attrs, "split"), attrs["num_outputs"]
    if given is None and num is None and out is not None:
        num = len(out)
    results, start = [], 0
    for i, n in enumerate(split_sizes("split", x.shape[axis], given, num)):
        index = (slice(None),) * axis + (slice(start, start + n),)
        piece = x[index]
        dst = destination(xp, piece.shape, x.dtype, out, i)
        dst[...] = piece
        results.append(dst)
        start += n
    return results


@TABLE.kernel(Op.TILE, supports_out=True)
def tile(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One broadcast write into the output seen as (r0, d0, r1, d1, …)."""
    xp, x = ctx.xp, inputs[0]
    repeats = require(ints_param("tile", inputs, 1, attrs, "repeats"), "tile", "repeats")
    dst = destination(xp, static_dims(tile_dims("tile", x.shape, repeats)), x.dtype, out)
    if not dst.flags.c_contiguous:      # the interleaved view needs a C-order buffer
        dst[...] = xp.tile(x, repeats)
        return [dst]
    interleaved = tuple(v for r, d in zip(repeats, x.shape, strict=True) for v in (r, d))
    source = tuple(v for d in x.shape for v in (1, d))
    dst.reshape(interleaved)[...] = x.reshape(source)
    return [dst]


@TABLE.kernel(Op.PAD, supports_out=True)
def pad(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Write the (cropped) input once, then fill the borders axis by axis."""
    xp, x, mode = ctx.xp, inputs[0], attrs["mode"]
    pads = require(ints_param("pad", inputs, 1, attrs, "pads"), "pad", "pads")
    widths = pad_widths("pad", x.shape, pads, ints_param("pad", inputs, 3, attrs, "axes"))
    check_pad_mode("pad", mode, x.shape, widths)
    value = pad_constant(inputs, attrs) if mode == "constant" else None
    crop = tuple(slice(max(-b, 0), d - max(-e, 0))
                 for d, (b, e) in zip(x.shape, widths, strict=True))
    src = x[crop]
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    dst = destination(xp, [d + b + e for d, (b, e) in zip(src.shape, grow, strict=True)],
                      x.dtype, out)
    dst[tuple(slice(b, b + d) for d, (b, _) in zip(src.shape, grow, strict=True))] = src
    for axis, (b, e) in enumerate(grow):
        if b or e:
            _fill_border(dst, axis, b, src.shape[axis], e, mode, value)
    return [dst]


def _fill_border(dst: Any, axis: int, before: int, n: int, after: int, mode: str,
                 value: Any) -> None:
    """Fill ``before``/``after`` entries of ``axis`` from the n entries between them."""
    def at(lo: int, hi: int, step: int = 1) -> tuple[slice, ...]:
        return (slice(None),) * axis + (slice(lo, hi if hi >= 0 else None, step),)

    end = before + n
    if mode == "constant":
        dst[at(0, before)] = value
        dst[at(end, end + after)] = value
    elif mode == "edge":
        dst[at(0, before)] = dst[at(before, before + 1)]
        dst[at(end, end + after)] = dst[at(end - 1, end)]
    elif mode == "reflect":
        dst[at(0, before)] = dst[at(2 * before, before, -1)]
        dst[at(end, end + after)] = dst[at(end - 2, end - 2 - after, -1)]
    else:
        _wrap(dst, at, before, n, after)


def _wrap(dst: Any, at: Any, before: int, n: int, after: int) -> None:
    # Pads longer than the axis repeat it, so copy in chunks of at most n.
    pos, end = before, before + n
    while pos > 0:
        m = min(n, pos)
        dst[at(pos - m, pos)] = dst[at(end - m, end)]
        pos -= m
    pos = end
    while pos < end + after:
        m = min(n, end + after - pos)
        dst[at(pos, pos + m)] = dst[at(before, before + m)]
        pos += m


@TABLE.kernel(Op.DEPTH_TO_SPACE, supports_out=True)
def depth_to_space(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One strided copy through a 6-D view of the input."""
    blocks, final = depth_to_space_blocks(inputs[0], attrs["blocksize"], attrs["mode"])
    return _blocks_into(ctx.xp, blocks, final, out)


@TABLE.kernel(Op.SPACE_TO_DEPTH, supports_out=True)
def space_to_depth(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One strided copy through a 6-D view of the input."""
    blocks, final = space_to_depth_blocks(inputs[0], attrs["blocksize"], attrs["mode"])
    return _blocks_into(ctx.xp, blocks, final, out)


def _blocks_into(xp: Any, blocks: Any, final: Sequence[int], out: Out) -> list[Any]:
    dst = destination(xp, final, blocks.dtype, out)
    if dst.flags.c_contiguous:
        dst.reshape(blocks.shape)[...] = blocks
    else:
        dst[...] = blocks.reshape(tuple(final))
    return [dst]


@TABLE.kernel(Op.CONSTANT_OF_SHAPE, supports_out=True)
def constant_of_shape(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Fill a new (or the given) array with ``value``."""
    value = fill_value("constant_of_shape", attrs["value"])
    dims = check_dims("constant_of_shape", require(
        ints_param("constant_of_shape", inputs, 0, attrs, "shape"), "constant_of_shape",
        "a shape"), "shape")
    dst = destination(ctx.xp, dims, value.dtype, out)
    dst.fill(value.item())
    return [dst]


@TABLE.kernel(Op.RANGE, supports_out=True)
def range_(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """start + i * delta, computed in int64 or float64 and cast once."""
    xp = ctx.xp
    check_same_dtype("range", [x.dtype for x in inputs])
    start, limit, delta = (host_scalar(x, op="range", what=name)
                           for x, name in zip(inputs, ("start", "limit", "delta"), strict=True))
    count = range_count("range", start, limit, delta)
    dtype = inputs[0].dtype
    wide = "int64" if dtype.kind in "iu" else "float64"
    steps = xp.arange(count, dtype=wide)
    steps *= delta
    steps += start
    return emit(xp, steps if dtype == steps.dtype else steps.astype(dtype), out)


@TABLE.kernel(Op.EYE_LIKE, supports_out=True)
def eye_like(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Ones on diagonal ``k``."""
    x = inputs[0]
    if x.ndim != 2:
        raise InvalidArgumentError(f"eye_like needs a rank-2 input, got shape {tuple(x.shape)}")
    dtype = (attrs["dtype"] or DType.from_numpy(x.dtype)).numpy
    return emit(ctx.xp, ctx.xp.eye(x.shape[0], x.shape[1], k=attrs["k"], dtype=dtype), out)


@TABLE.kernel(Op.TRILU, supports_out=True)
def trilu(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Upper (or lower) triangle from diagonal k of the last two dims."""
    xp, x = ctx.xp, inputs[0]
    if x.ndim < 2:
        raise InvalidArgumentError(f"trilu needs rank >= 2, got shape {tuple(x.shape)}")
    k = trilu_k(inputs, attrs)
    return emit(xp, xp.triu(x, k) if attrs["upper"] else xp.tril(x, k), out)
