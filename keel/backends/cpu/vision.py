"""cpu kernels of the vision family, written once against ``ctx.xp``.

Sampling coordinates are computed in float64 (they decide which pixel is read:
float32 rounding would move a nearest-neighbour tap); pixel values are
gathered and weighted in float32 (float64 for float64 inputs). Gathers work on
flattened spatial axes with ``take_along_axis``; col2im adds whole strided
blocks at once; non_max_suppression runs its greedy selection on host copies of
the (small) boxes and scores.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.cpu.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.vision import (
    FLOAT_DTYPES,
    check_affine_grid,
    check_center_crop_pad,
    check_col2im,
    check_deform_conv,
    check_float,
    check_grid_sample,
    check_max_unpool,
    check_nms,
    check_roi_align,
    concrete,
    nms_limits,
)

__all__: list[str] = []


_CUBIC_A = -0.75
_ALL2: tuple[slice, ...] = (slice(None), slice(None))    # the batch and channel axes



def _ints(x: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in x.reshape(-1).tolist())


def _deliver(out: Out, i: int, value: Any) -> Any:
    """``value`` as output ``i``: written into the caller's buffer when one is given."""
    if out is not None and len(out) > i and out[i] is not None:
        if out[i] is not value:
            out[i][...] = value
        return out[i]
    return value


def _ct(xp: Any, op: Op, x: Any, what: str = "X") -> Any:
    check_float(op, DType.from_numpy(x.dtype), what)
    return xp.float64 if x.dtype == xp.float64 else xp.float32


def _gather(xp: Any, flat_x: Any, index: Any) -> Any:
    """flat_x (N, C, P) at index (N, Q) for every channel: (N, C, Q)."""
    n, c = flat_x.shape[0], flat_x.shape[1]
    if flat_x.shape[2] == 0:
        return xp.zeros((n, c, index.shape[1]), dtype=flat_x.dtype)
    return xp.take_along_axis(flat_x, xp.broadcast_to(index[:, None], (n, c, index.shape[1])),
                              axis=2)


# ---- grid_sample --------------------------------------------------------------------------
def _reflect(xp: Any, x: Any, lo: float, hi: float) -> Any:
    span = hi - lo
    if span <= 0:
        return xp.full(x.shape, lo)
    below, above = x < lo, x > hi
    dist = xp.where(below, lo - x, xp.where(above, x - hi, 0.0))
    flips = xp.floor(dist / span)
    rest = dist - flips * span
    even = flips % 2 == 0
    return xp.where(below | above, xp.where(below == even, lo + rest, hi - rest), x)


def _fetch(xp: Any, index: Any, length: int, lo: float, hi: float,
           padding: str) -> tuple[Any, Any]:
    """(clamped index, in range or None) of an integer tap along one axis."""
    if padding == "reflection":
        index = _reflect(xp, index.astype(xp.float64), lo, hi).astype(xp.int64)
    elif padding == "zeros":
        return xp.clip(index, 0, max(length - 1, 0)), (index >= 0) & (index < length)
    return xp.clip(index, 0, max(length - 1, 0)), None


def _cubic(t: Any) -> list[Any]:
    a = _CUBIC_A
    return [((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
            ((a + 2) * t - (a + 3)) * t * t + 1,
            ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
            ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a]


def _axis_taps(xp: Any, coord: Any, length: int, attrs: Attrs) -> list[tuple[Any, Any, Any]]:
    """(index, weight or None, in range or None) per tap of one spatial axis."""
    align, mode, padding = attrs["align_corners"], attrs["mode"], attrs["padding_mode"]
    x = (coord + 1) / 2 * (length - 1) if align else ((coord + 1) * length - 1) / 2
    lo, hi = (0.0, length - 1.0) if align else (-0.5, length - 0.5)
    if mode == "nearest":
        x = xp.rint(x)
    if padding != "zeros":
        outside = (x < lo) | (x > hi)
        fixed = xp.clip(x, 0, length - 1) if padding == "border" else _reflect(xp, x, lo, hi)
        x = xp.where(outside, fixed, x)
    if mode == "nearest":
        index, valid = _fetch(xp, xp.trunc(x).astype(xp.int64), length, lo, hi, padding)
        return [(index, None, valid)]
    base = xp.floor(x)
    t = x - base
    offsets, weights = ((0, 1), [1 - t, t]) if mode == "linear" else ((-1, 0, 1, 2), _cubic(t))
    start = base.astype(xp.int64)
    taps = []
    for off, w in zip(offsets, weights, strict=True):
        index, valid = _fetch(xp, start + off, length, lo, hi, padding)
        taps.append((index, w, valid))
    return taps


@TABLE.kernel(Op.GRID_SAMPLE, dtypes=FLOAT_DTYPES, supports_out=True)
def grid_sample(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Sum of weighted taps, gathered over the flattened spatial axes."""
    xp = ctx.xp
    x, grid = inputs
    ct = _ct(xp, Op.GRID_SAMPLE, x)
    check_float(Op.GRID_SAMPLE, DType.from_numpy(grid.dtype), "grid")
    shape = check_grid_sample(x.shape, grid.shape, attrs)
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    r = len(spatial)
    g = grid.astype(xp.float64).reshape(n, -1, r)
    per_axis = [_axis_taps(xp, g[..., r - 1 - d], spatial[d], attrs) for d in range(r)]
    strides = [math.prod(spatial[d + 1:]) for d in range(r)]
    flat_x = x.reshape(n, c, -1).astype(ct, copy=False)
    y = xp.zeros((n, c, g.shape[1]), dtype=ct)
    for combo in itertools.product(*per_axis):
        flat = combo[0][0] * strides[0]
        weight, valid = combo[0][1], combo[0][2]
        for (idx, w, v), s in zip(combo[1:], strides[1:], strict=True):
            flat = flat + idx * s
            weight = w if weight is None else (weight if w is None else weight * w)
            valid = v if valid is None else (valid if v is None else valid & v)
        term = _gather(xp, flat_x, flat)
        if valid is not None:
            weight = xp.where(valid, 1.0 if weight is None else weight, 0.0)
        if weight is not None:
            term *= weight.astype(ct)[:, None]
        y += term
    return [_deliver(out, 0, y.reshape(shape).astype(x.dtype, copy=False))]


# ---- affine_grid ----------------------------------------------------------------------------
@TABLE.kernel(Op.AFFINE_GRID, dtypes=FLOAT_DTYPES, supports_out=True)
def affine_grid(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """theta[n] applied to the homogeneous base grid with one matmul per batch."""
    xp = ctx.xp
    theta, size = inputs
    ct = _ct(xp, Op.AFFINE_GRID, theta, "theta")
    size_t = _ints(size)
    shape = check_affine_grid(theta.shape, size_t)
    dims = size_t[2:]
    axes = [xp.linspace(-1.0, 1.0, d) if attrs["align_corners"]
            else (2 * xp.arange(d) + 1) / max(d, 1) - 1 for d in dims]
    mesh = xp.meshgrid(*axes, indexing="ij")
    points = xp.stack([*reversed(mesh), xp.ones(dims)], axis=-1).reshape(-1, len(dims) + 1)
    grid = xp.matmul(points.astype(ct)[None], theta.astype(ct).swapaxes(1, 2))
    return [_deliver(out, 0, grid.reshape(shape).astype(theta.dtype, copy=False))]


# ---- roi_align --------------------------------------------------------------------------------
def _roi_axis(xp: Any, start: float, size: float, bins: int, grid: int,
              length: int) -> tuple[Any, Any, Any]:
    step = size / bins
    pos = start + xp.arange(bins)[:, None] * step \
        + (xp.arange(grid)[None, :] + 0.5) * step / max(grid, 1)
    valid = (pos >= -1.0) & (pos <= length)
    pos = xp.maximum(pos, 0.0)
    low = xp.trunc(pos).astype(xp.int64)
    at_end = low >= length - 1
    low = xp.where(at_end, length - 1, low)
    frac = xp.where(at_end, 0.0, pos - low)
    return low, frac, valid


@TABLE.kernel(Op.ROI_ALIGN, dtypes=FLOAT_DTYPES, supports_out=True)
def roi_align(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Per ROI: all bins' bilinear samples at once, averaged or max-pooled."""
    xp = ctx.xp
    x, rois, batch = inputs
    ct = _ct(xp, Op.ROI_ALIGN, x)
    shape = check_roi_align(x.shape, rois.shape, batch.shape, attrs)
    h, w = x.shape[2], x.shape[3]
    oh, ow, ratio = attrs["output_height"], attrs["output_width"], attrs["sampling_ratio"]
    half = attrs["coordinate_transformation_mode"] == "half_pixel"
    y = out[0] if out is not None and out and out[0].dtype == ct else xp.empty(shape, dtype=ct)
    for r, (box, b) in enumerate(zip(rois.astype(xp.float64).tolist(), _ints(batch),
                                     strict=True)):
        if not 0 <= b < x.shape[0]:
            raise InvalidArgumentError(
                f"{Op.ROI_ALIGN.value}: batch_indices[{r}] = {b} is not a batch index of X "
                f"(batch size {x.shape[0]})")
        x1, y1, x2, y2 = (v * attrs["spatial_scale"] - (0.5 if half else 0.0) for v in box)
        rw, rh = x2 - x1, y2 - y1
        if not half:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        gh = ratio if ratio > 0 else math.ceil(rh / oh)
        gw = ratio if ratio > 0 else math.ceil(rw / ow)
        ys, xs = _roi_axis(xp, y1, rh, oh, gh, h), _roi_axis(xp, x1, rw, ow, gw, w)
        y[r] = _roi_bins(xp, x[b], ys, xs, attrs["mode"], max(gh * gw, 1), ct)
    return [_deliver(out, 0, y.astype(x.dtype, copy=False))]


def _roi_bins(xp: Any, img: Any, ys: tuple[Any, Any, Any], xs: tuple[Any, Any, Any],
              mode: str, count: int, ct: Any) -> Any:
    (yl, fy, vy), (xl, fx, vx) = ys, xs
    c, h, w = img.shape
    if yl.size == 0 or xl.size == 0:
        return xp.zeros((c, yl.shape[0], xl.shape[0]), dtype=ct)
    yh, xh = xp.minimum(yl + 1, h - 1), xp.minimum(xl + 1, w - 1)
    flat = img.reshape(c, -1).astype(ct, copy=False)
    valid = vy[:, :, None, None] & vx[None, None, :, :]
    fy4 = fy[:, :, None, None]
    corners = [(yl, xl, (1 - fy4) * (1 - fx)), (yl, xh, (1 - fy4) * fx),
               (yh, xl, fy4 * (1 - fx)), (yh, xh, fy4 * fx)]
    total = None
    for yi, xi, weight in corners:
        index = (yi[:, :, None, None] * w + xi[None, None, :, :]).reshape(-1)
        term = xp.take(flat, index, axis=1).reshape(c, *valid.shape)
        term *= xp.where(valid, weight, 0.0).astype(ct)
        if total is None:
            total = term
        elif mode == "avg":
            total += term
        else:
            xp.maximum(total, term, out=total)
    assert total is not None     # four corners were added
    if mode == "avg":
        return total.sum(axis=(2, 4)) / ct(count)
    return total.max(axis=(2, 4))


# ---- non_max_suppression --------------------------------------------------------------------
def _host_corners(boxes: Any, center: bool) -> np.ndarray:
    """(boxes, 4) host array of (y_min, x_min, y_max, x_max)."""
    b = np.asarray(boxes.tolist(), dtype=np.float64).reshape(-1, 4)
    if center:
        half_w, half_h = b[:, 2] / 2, b[:, 3] / 2
        return np.stack([b[:, 1] - half_h, b[:, 0] - half_w, b[:, 1] + half_h,
                         b[:, 0] + half_w], axis=1)
    return np.stack([np.minimum(b[:, 0], b[:, 2]), np.minimum(b[:, 1], b[:, 3]),
                     np.maximum(b[:, 0], b[:, 2]), np.maximum(b[:, 1], b[:, 3])], axis=1)


def _overlaps(box: np.ndarray, kept: np.ndarray, threshold: float) -> bool:
    """Whether ``box`` has IoU above ``threshold`` with any of ``kept``."""
    ih = np.minimum(box[2], kept[:, 2]) - np.maximum(box[0], kept[:, 0])
    iw = np.minimum(box[3], kept[:, 3]) - np.maximum(box[1], kept[:, 1])
    inter = ih * iw
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (kept[:, 2] - kept[:, 0]) * (kept[:, 3] - kept[:, 1])
    union = area + areas - inter
    ok = (ih > 0) & (iw > 0) & (area > 0) & (areas > 0) & (union > 0)
    iou = inter / np.where(ok, union, 1.0)
    return bool(np.any(ok & (iou > threshold)))


@TABLE.kernel(Op.NON_MAX_SUPPRESSION, dtypes=FLOAT_DTYPES)
def non_max_suppression(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                        out: Out) -> list[Any]:
    """Greedy selection per batch and class on host copies; [K, 3] int64 on the device."""
    xp = ctx.xp
    boxes, scores = inputs[0], inputs[1]
    check_nms(boxes.shape, scores.shape, attrs)
    max_out, iou_t, score_t = nms_limits(*(optional_input(inputs, i) for i in (2, 3, 4)))
    rows: list[tuple[int, int, int]] = []
    host_scores = np.asarray(scores.tolist(), dtype=np.float64).reshape(scores.shape)
    for b in range(boxes.shape[0] if max_out else 0):
        corners = _host_corners(boxes[b], attrs["center_point_box"] == 1)
        for c in range(scores.shape[1]):
            s = host_scores[b, c]
            order = np.lexsort((np.arange(s.size), -s))     # score down, index up
            if score_t is not None:
                order = order[s[order] > score_t]
            kept: list[int] = []
            for i in order.tolist():
                if len(kept) >= max_out:
                    break
                if not kept or not _overlaps(corners[i], corners[kept], iou_t):
                    kept.append(i)
            rows += [(b, c, i) for i in kept]
    return [xp.asarray(np.array(rows, dtype=np.int64).reshape(-1, 3))]


# ---- col2im / center_crop_pad / max_unpool ---------------------------------------------------
@TABLE.kernel(Op.COL2IM, supports_out=True)
def col2im(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Add each tap's column plane into the padded image through a strided view."""
    xp = ctx.xp
    x, image, block = inputs[0], _ints(inputs[1]), _ints(inputs[2])
    shape, blocks = check_col2im(x.shape, image, block, attrs)
    r = len(image)
    pads, strides, dil = attrs["pads"] or (0,) * 2 * r, attrs["strides"] or (1,) * r, \
        attrs["dilations"] or (1,) * r
    acc = (xp.float64 if x.dtype == xp.float64 else xp.float32) if x.dtype.kind == "f" \
        else xp.int64
    n, ch = x.shape[0], x.shape[1] // math.prod(block)
    cols = x.reshape(n, ch, *block, *blocks)
    padded = xp.zeros((n, ch, *(image[i] + pads[i] + pads[i + r] for i in range(r))), dtype=acc)
    for tap in itertools.product(*(range(b) for b in block)):
        window = tuple(slice(tap[i] * dil[i], tap[i] * dil[i] + strides[i] * (blocks[i] - 1) + 1,
                             strides[i]) for i in range(r))
        padded[_ALL2 + window] += cols[_ALL2 + tap]
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(r))
    y = padded[_ALL2 + crop].reshape(shape)
    return [_deliver(out, 0, y.astype(x.dtype, copy=False))]


def _centered(inner: int, outer: int) -> slice:
    start = (outer - inner) // 2
    return slice(start, start + inner)


@TABLE.kernel(Op.CENTER_CROP_PAD, supports_out=True)
def center_crop_pad(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One slice copy: the centered crop of X into the centered window of Y (zeros around)."""
    xp = ctx.xp
    x = inputs[0]
    axes, shape = check_center_crop_pad(x.shape, _ints(inputs[1]), attrs["axes"])
    dims = concrete(shape)
    src = [slice(None)] * x.ndim
    dst = [slice(None)] * x.ndim
    for a in axes:
        if dims[a] < x.shape[a]:
            src[a] = _centered(dims[a], x.shape[a])
        elif dims[a] > x.shape[a]:
            dst[a] = _centered(x.shape[a], dims[a])
    y = out[0] if out is not None and out else xp.empty(dims, dtype=x.dtype)
    if any(s != slice(None) for s in dst):
        y[...] = 0
    y[tuple(dst)] = x[tuple(src)]
    return [y]


@TABLE.kernel(Op.MAX_UNPOOL, dtypes=FLOAT_DTYPES, supports_out=True)
def max_unpool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One scatter of X into the flat unpooled tensor (the last write wins on repeats)."""
    xp = ctx.xp
    x, indices, given = inputs[0], inputs[1], optional_input(inputs, 2)
    inferred, shape = check_max_unpool(x.shape, indices.shape, attrs,
                                       None if given is None else _ints(given))
    total = math.prod(inferred)
    flat = indices.astype(xp.int64).reshape(-1)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= total):
        bad = int(flat.min()) if int(flat.min()) < 0 else int(flat.max())
        raise InvalidArgumentError(
            f"{Op.MAX_UNPOOL.value}: index {bad} is outside the unpooled tensor of {total} "
            f"elements {inferred}")
    y = out[0] if out is not None and out else xp.empty(shape, dtype=x.dtype)
    y[...] = 0
    corner = y[tuple(slice(0, d) for d in inferred)]
    dense = xp.zeros(total, dtype=x.dtype)
    dense[flat] = x.reshape(-1)
    corner[...] = dense.reshape(inferred)
    return [y]


# ---- deform_conv ------------------------------------------------------------------------------
@TABLE.kernel(Op.DEFORM_CONV, dtypes=FLOAT_DTYPES, supports_out=True)
def deform_conv(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Bilinear taps gathered into columns (N, C * kH * kW, L), then one batched matmul."""
    xp = ctx.xp
    x, wt, offset, bias, mask = inputs[0], inputs[1], inputs[2], optional_input(inputs, 3), \
        optional_input(inputs, 4)
    ct = _ct(xp, Op.DEFORM_CONV, x)
    geo = check_deform_conv(x.shape, wt.shape, offset.shape,
                            None if bias is None else bias.shape,
                            None if mask is None else mask.shape, attrs)
    n, c = x.shape[0], x.shape[1]
    (kh, kw), (oh, ow) = geo["kernel"], geo["out"]
    cols = _deform_columns(xp, x, offset, mask, geo, ct)          # (N, og, C/og, taps * L)
    groups = geo["group"]
    cols = cols.reshape(n, groups, (c // groups) * kh * kw, oh * ow)
    kernels = wt.astype(ct).reshape(groups, wt.shape[0] // groups, -1)
    y = xp.matmul(kernels[None], cols).reshape(n, wt.shape[0], oh, ow)
    if bias is not None:
        y += bias.astype(ct).reshape(1, -1, 1, 1)
    return [_deliver(out, 0, y.astype(x.dtype, copy=False))]


def _deform_columns(xp: Any, x: Any, offset: Any, mask: Any, geo: Mapping[str, Any],
                    ct: Any) -> Any:
    n, c, h, w = x.shape
    (kh, kw), (oh, ow), og = geo["kernel"], geo["out"], geo["offset_group"]
    (sh, sw), (dh, dw), pads = geo["strides"], geo["dilations"], geo["pads"]
    off = offset.astype(xp.float64).reshape(n, og, kh, kw, 2, oh, ow)
    base_y = (xp.arange(oh) * sh - pads[0])[None, :] + (xp.arange(kh) * dh)[:, None]
    base_x = (xp.arange(ow) * sw - pads[1])[None, :] + (xp.arange(kw) * dw)[:, None]
    py = base_y[None, None, :, None, :, None] + off[:, :, :, :, 0]
    px = base_x[None, None, None, :, None, :] + off[:, :, :, :, 1]
    flat_x = x.reshape(n * og, c // og, h * w).astype(ct, copy=False)
    y0, x0 = xp.floor(py).astype(xp.int64), xp.floor(px).astype(xp.int64)
    cols = xp.zeros((n * og, c // og, kh * kw * oh * ow), dtype=ct)
    for dy, dx in itertools.product((0, 1), (0, 1)):
        yi, xi = y0 + dy, x0 + dx
        weight = (1 - xp.abs(py - yi)) * (1 - xp.abs(px - xi))
        valid = (yi >= 0) & (yi < h) & (xi >= 0) & (xi < w)
        if mask is not None:
            weight = weight * mask.reshape(weight.shape)
        index = (xp.clip(yi, 0, max(h - 1, 0)) * w + xp.clip(xi, 0, max(w - 1, 0)))
        term = _gather(xp, flat_x, index.reshape(n * og, -1))
        term *= xp.where(valid, weight, 0.0).reshape(n * og, 1, -1).astype(ct)
        cols += term
    return cols.reshape(n, og, c // og, kh * kw * oh * ow)
