"""Reference kernels of the vision family: readable NumPy, float math in float64.

Sampling ops (grid_sample, roi_align, deform_conv) are written as "taps": for
every output point, the input positions it reads and their weights. Box and
block ops (non_max_suppression, col2im, max_unpool) loop the way their ONNX
definitions read.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
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
Tap = tuple[np.ndarray, np.ndarray, np.ndarray]     # index, weight, in range


def _opt(inputs: Inputs, i: int) -> np.ndarray | None:
    return inputs[i] if i < len(inputs) else None


def _ints(x: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(x).reshape(-1))


def _float_input(op: Op, x: np.ndarray, what: str = "X") -> np.ndarray:
    check_float(op, DType.from_numpy(x.dtype), what)
    return x.astype(np.float64)


# ---- grid_sample ------------------------------------------------------------------------
def _reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Reflect coordinates into [lo, hi] off its borders, as often as needed."""
    span = hi - lo
    if span <= 0:
        return np.full_like(x, lo)
    below, above = x < lo, x > hi
    dist = np.where(below, lo - x, np.where(above, x - hi, 0.0))
    flips = np.floor(dist / span)
    rest = dist - flips * span
    even = flips % 2 == 0
    reflected = np.where(below == even, lo + rest, hi - rest)
    return np.where(below | above, reflected, x)


def _fetch(index: np.ndarray, length: int, lo: float, hi: float, padding: str) -> Tap:
    """Where an integer tap reads along one axis, and whether it reads anything."""
    if padding == "border":
        return np.clip(index, 0, length - 1), np.ones(index.shape), np.ones(index.shape, bool)
    if padding == "reflection":
        inside = _reflect(index.astype(np.float64), lo, hi).astype(np.int64)
        return np.clip(inside, 0, length - 1), np.ones(index.shape), np.ones(index.shape, bool)
    valid = (index >= 0) & (index < length)
    return np.clip(index, 0, length - 1), np.ones(index.shape), valid


def _cubic_weights(t: np.ndarray) -> list[np.ndarray]:
    a = _CUBIC_A
    return [((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
            ((a + 2) * t - (a + 3)) * t * t + 1,
            ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
            ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a]


def _axis_taps(coord: np.ndarray, length: int, attrs: Attrs) -> list[Tap]:
    """The taps one spatial axis contributes for normalized coordinates ``coord``."""
    align, mode, padding = attrs["align_corners"], attrs["mode"], attrs["padding_mode"]
    x = (coord + 1) / 2 * (length - 1) if align else ((coord + 1) * length - 1) / 2
    lo, hi = (0.0, length - 1.0) if align else (-0.5, length - 0.5)
    if mode == "nearest":
        x = np.rint(x)
    outside = (x < lo) | (x > hi)
    if padding == "border":
        x = np.where(outside, np.clip(x, 0, length - 1), x)
    elif padding == "reflection":
        x = np.where(outside, _reflect(x, lo, hi), x)
    if mode == "nearest":
        index, _, valid = _fetch(np.trunc(x).astype(np.int64), length, lo, hi, padding)
        return [(index, np.ones(x.shape), valid)]
    base = np.floor(x)
    t = x - base
    offsets: tuple[int, ...]
    if mode == "linear":
        offsets, weights = (0, 1), [1 - t, t]
    else:
        offsets, weights = (-1, 0, 1, 2), _cubic_weights(t)
    taps = []
    for off, w in zip(offsets, weights, strict=True):
        index, _, valid = _fetch(base.astype(np.int64) + off, length, lo, hi, padding)
        taps.append((index, w, valid))
    return taps


@TABLE.kernel(Op.GRID_SAMPLE, dtypes=FLOAT_DTYPES)
def grid_sample(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Y[n, c, o...] = sum over taps of weight * X[n, c, tap], taps per spatial axis."""
    x, grid = inputs
    xf = _float_input(Op.GRID_SAMPLE, x)
    _float_input(Op.GRID_SAMPLE, grid, "grid")
    shape = concrete(check_grid_sample(x.shape, grid.shape, attrs))
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    r = len(spatial)
    g = grid.astype(np.float64).reshape(n, -1, r)
    # grid's last entry 0 addresses the last spatial axis: reverse to axis order.
    per_axis = [_axis_taps(g[..., r - 1 - d], spatial[d], attrs) for d in range(r)]
    strides = [math.prod(spatial[d + 1:]) for d in range(r)]
    flat_x = xf.reshape(n, c, -1)
    y = np.zeros((n, c, g.shape[1]))
    for combo in itertools.product(*per_axis):
        flat = sum(idx * s for (idx, _, _), s in zip(combo, strides, strict=True))
        weight = np.prod([w for _, w, _ in combo], axis=0)
        valid = np.all([v for _, _, v in combo], axis=0)
        gathered = np.take_along_axis(flat_x, np.broadcast_to(flat[:, None], (n, c, flat.shape[1])),
                                      axis=2) if flat_x.size else np.zeros((n, c, flat.shape[1]))
        y += np.where(valid[:, None], gathered, 0.0) * weight[:, None]
    return [y.reshape(shape).astype(x.dtype)]


# ---- affine_grid --------------------------------------------------------------------------
def _base_coords(length: int, align: bool) -> np.ndarray:
    if align:
        return np.linspace(-1.0, 1.0, length)
    return (2 * np.arange(length) + 1) / max(length, 1) - 1


@TABLE.kernel(Op.AFFINE_GRID, dtypes=FLOAT_DTYPES)
def affine_grid(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """grid[n, ..., :] = theta[n] @ (x, y[, z], 1) over the normalized base grid."""
    theta, size = inputs
    size_t = _ints(size)
    shape = concrete(check_affine_grid(theta.shape, size_t))
    dims = size_t[2:]
    axes = [_base_coords(d, attrs["align_corners"]) for d in dims]
    mesh = np.meshgrid(*axes, indexing="ij")          # one array per axis, D/H/W order
    # Homogeneous points in x (last axis) first order: (x, y[, z], 1).
    points = np.stack([*reversed(mesh), np.ones(dims)], axis=-1)
    grid = np.einsum("...k,njk->n...j", points, _float_input(Op.AFFINE_GRID, theta, "theta"))
    return [grid.reshape(shape).astype(theta.dtype)]


# ---- roi_align -----------------------------------------------------------------------------
def _roi_axis(start: float, size: float, bins: int, grid: int, length: int) -> Tap:
    """Sample positions of one ROI along one axis: low index, high-side weight, in range.

    Returns arrays of shape (bins, grid): the low neighbour, the fraction toward the
    high neighbour, and whether the sample lies in [-1, length].
    """
    k = np.arange(bins)[:, None] * (size / bins) + (np.arange(grid)[None, :] + 0.5) \
        * (size / bins) / max(grid, 1)
    pos = start + k
    valid = (pos >= -1.0) & (pos <= length)
    pos = np.maximum(pos, 0.0)
    low = np.trunc(pos).astype(np.int64)
    at_end = low >= length - 1
    low = np.where(at_end, length - 1, low)
    frac = np.where(at_end, 0.0, pos - low)
    return low, frac, valid


@TABLE.kernel(Op.ROI_ALIGN, dtypes=FLOAT_DTYPES)
def roi_align(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Average (or max) of bilinear samples on a regular grid in each output bin."""
    x, rois, batch = inputs
    xf = _float_input(Op.ROI_ALIGN, x)
    shape = concrete(check_roi_align(x.shape, rois.shape, batch.shape, attrs))
    h, w = x.shape[2], x.shape[3]
    oh, ow, ratio = attrs["output_height"], attrs["output_width"], attrs["sampling_ratio"]
    half = attrs["coordinate_transformation_mode"] == "half_pixel"
    y = np.zeros(shape)
    for r, (box, b) in enumerate(zip(rois.astype(np.float64), _ints(batch), strict=True)):
        if not 0 <= b < x.shape[0]:
            raise InvalidArgumentError(
                f"{Op.ROI_ALIGN.value}: batch_indices[{r}] = {b} is not a batch index of X "
                f"(batch size {x.shape[0]})")
        x1, y1, x2, y2 = box * attrs["spatial_scale"] - (0.5 if half else 0.0)
        rw, rh = x2 - x1, y2 - y1
        if not half:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        gh = ratio if ratio > 0 else math.ceil(rh / oh)
        gw = ratio if ratio > 0 else math.ceil(rw / ow)
        yl, fy, vy = _roi_axis(y1, rh, oh, gh, h)
        xl, fx, vx = _roi_axis(x1, rw, ow, gw, w)
        y[r] = _roi_bins(xf[b], (yl, fy, vy), (xl, fx, vx), attrs["mode"], max(gh * gw, 1))
    return [y.astype(x.dtype)]


def _roi_bins(img: np.ndarray, ys: Tap, xs: Tap, mode: str, count: int) -> np.ndarray:
    """(C, oh, ow) from the four weighted neighbours of each (oh, gh) x (ow, gw) sample."""
    (yl, fy, vy), (xl, fx, vx) = ys, xs
    h, w = img.shape[1], img.shape[2]
    yh, xh = np.minimum(yl + 1, h - 1), np.minimum(xl + 1, w - 1)
    yl4, yh4, fy4 = yl[:, :, None, None], yh[:, :, None, None], fy[:, :, None, None]
    valid = vy[:, :, None, None] & vx[None, None, :, :]
    corners = [(yl4, xl, (1 - fy4) * (1 - fx)), (yl4, xh, (1 - fy4) * fx),
               (yh4, xl, fy4 * (1 - fx)), (yh4, xh, fy4 * fx)]
    # Samples outside the map read nothing: their weights are zero.
    terms = [img[:, yi, xi] * np.where(valid, wt, 0.0) for yi, xi, wt in corners]
    if mode == "avg":
        return np.sum(terms, axis=0).sum(axis=(2, 4)) / count
    if terms[0].shape[2] == 0 or terms[0].shape[4] == 0:
        return np.zeros((img.shape[0], yl.shape[0], xl.shape[0]))
    return np.max(np.maximum.reduce(terms), axis=(2, 4))


# ---- non_max_suppression ------------------------------------------------------------------
def _corners(box: np.ndarray, center: bool) -> tuple[float, float, float, float]:
    """(y_min, x_min, y_max, x_max) of one box."""
    if center:
        xc, yc, bw, bh = (float(v) for v in box)
        return yc - bh / 2, xc - bw / 2, yc + bh / 2, xc + bw / 2
    y1, x1, y2, x2 = (float(v) for v in box)
    return min(y1, y2), min(x1, x2), max(y1, y2), max(x1, x2)


def _suppresses(a: tuple[float, ...], b: tuple[float, ...], threshold: float) -> bool:
    ih = min(a[2], b[2]) - max(a[0], b[0])
    iw = min(a[3], b[3]) - max(a[1], b[1])
    if ih <= 0 or iw <= 0:
        return False
    inter = ih * iw
    area_a, area_b = (a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1])
    union = area_a + area_b - inter
    if area_a <= 0 or area_b <= 0 or union <= 0:
        return False
    return inter / union > threshold


@TABLE.kernel(Op.NON_MAX_SUPPRESSION, dtypes=FLOAT_DTYPES)
def non_max_suppression(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                        out: Out) -> list[Any]:
    """Per batch and class: take boxes by descending score unless one kept overlaps too much."""
    boxes, scores = inputs[0], inputs[1]
    check_nms(boxes.shape, scores.shape, attrs)
    max_out, iou_t, score_t = nms_limits(*(_opt(inputs, i) for i in (2, 3, 4)))
    center = attrs["center_point_box"] == 1
    rows = []
    for b, c in itertools.product(range(scores.shape[0]), range(scores.shape[1])):
        order = sorted(range(scores.shape[2]), key=lambda i: (-float(scores[b, c, i]), i))
        if score_t is not None:
            order = [i for i in order if float(scores[b, c, i]) > score_t]
        kept: list[int] = []
        for i in order:
            if len(kept) >= max_out:
                break
            box = _corners(boxes[b, i], center)
            if not any(_suppresses(box, _corners(boxes[b, k], center), iou_t) for k in kept):
                kept.append(i)
        rows += [(b, c, i) for i in kept]
    return [np.array(rows, dtype=np.int64).reshape(-1, 3)]


# ---- col2im / center_crop_pad / max_unpool ---------------------------------------------------
def _wide(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64 if x.dtype.kind == "f" else np.int64)


@TABLE.kernel(Op.COL2IM)
def col2im(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Add every column entry back at the image position its block and tap address."""
    x, image, block = inputs[0], _ints(inputs[1]), _ints(inputs[2])
    shape, blocks = check_col2im(x.shape, image, block, attrs)
    r = len(image)
    pads, strides, dil = attrs["pads"] or (0,) * 2 * r, attrs["strides"] or (1,) * r, \
        attrs["dilations"] or (1,) * r
    n, ch = x.shape[0], x.shape[1] // math.prod(block)
    cols = _wide(x).reshape(n, ch, *block, *blocks)
    padded = np.zeros((n, ch, *(image[i] + pads[i] + pads[i + r] for i in range(r))),
                      dtype=cols.dtype)
    for tap in itertools.product(*(range(b) for b in block)):
        window = tuple(slice(tap[i] * dil[i], tap[i] * dil[i] + strides[i] * (blocks[i] - 1) + 1,
                             strides[i]) for i in range(r))
        padded[_ALL2 + window] += cols[_ALL2 + tap]
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(r))
    return [padded[_ALL2 + crop].reshape(concrete(shape)).astype(x.dtype)]


def _centered(inner: int, outer: int) -> slice:
    start = (outer - inner) // 2
    return slice(start, start + inner)


@TABLE.kernel(Op.CENTER_CROP_PAD)
def center_crop_pad(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Crop (centered) or zero-pad (centered) each listed axis to its new size."""
    x = inputs[0]
    axes, dims = check_center_crop_pad(x.shape, _ints(inputs[1]), attrs["axes"])
    shape = concrete(dims)
    src = [slice(None)] * x.ndim
    dst = [slice(None)] * x.ndim
    for a in axes:
        have, want = x.shape[a], shape[a]
        if want < have:
            src[a] = _centered(want, have)
        elif want > have:
            dst[a] = _centered(have, want)
    y = np.zeros(shape, dtype=x.dtype)
    y[tuple(dst)] = x[tuple(src)]
    return [y]


@TABLE.kernel(Op.MAX_UNPOOL, dtypes=FLOAT_DTYPES)
def max_unpool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Zeros with X[k] placed at flat position I[k] of the unpooled shape."""
    x, indices, given = inputs[0], inputs[1], _opt(inputs, 2)
    inferred, shape = check_max_unpool(x.shape, indices.shape, attrs,
                                       None if given is None else _ints(given))
    total = math.prod(inferred)
    flat = indices.astype(np.int64).reshape(-1)
    bad = flat[(flat < 0) | (flat >= total)]
    if bad.size:
        raise InvalidArgumentError(
            f"{Op.MAX_UNPOOL.value}: index {int(bad[0])} is outside the unpooled tensor of "
            f"{total} elements {inferred}")
    y = np.zeros(total, dtype=x.dtype)
    for pos, value in zip(flat, x.reshape(-1), strict=True):
        y[pos] = value
    result = np.zeros(shape, dtype=x.dtype)
    result[tuple(slice(0, d) for d in inferred)] = y.reshape(inferred)
    return [result]


# ---- deform_conv ------------------------------------------------------------------------------
@TABLE.kernel(Op.DEFORM_CONV, dtypes=FLOAT_DTYPES)
def deform_conv(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Convolution whose kernel taps sample X bilinearly at offset positions (zeros outside)."""
    x, wt, offset, bias, mask = inputs[0], inputs[1], inputs[2], _opt(inputs, 3), \
        _opt(inputs, 4)
    xf = _float_input(Op.DEFORM_CONV, x)
    geo = check_deform_conv(x.shape, wt.shape, offset.shape,
                            None if bias is None else bias.shape,
                            None if mask is None else mask.shape, attrs)
    n, c, h, w = x.shape
    (kh, kw), (oh, ow), og = geo["kernel"], geo["out"], geo["offset_group"]
    off = offset.astype(np.float64).reshape(n, og, kh, kw, 2, oh, ow)
    mod = np.ones((n, og, kh, kw, oh, ow)) if mask is None \
        else mask.astype(np.float64).reshape(n, og, kh, kw, oh, ow)
    (sh, sw), (dh, dw), pads = geo["strides"], geo["dilations"], geo["pads"]
    base_y = (np.arange(oh) * sh - pads[0])[None, :] + (np.arange(kh) * dh)[:, None]
    base_x = (np.arange(ow) * sw - pads[1])[None, :] + (np.arange(kw) * dw)[:, None]
    py = base_y[None, None, :, None, :, None] + off[:, :, :, :, 0]
    px = base_x[None, None, None, :, None, :] + off[:, :, :, :, 1]
    cols = np.zeros((n, og, c // og, kh, kw, oh, ow))
    xg = xf.reshape(n, og, c // og, h, w)
    y0, x0 = np.floor(py).astype(np.int64), np.floor(px).astype(np.int64)
    for dy, dx in itertools.product((0, 1), (0, 1)):
        yi, xi = y0 + dy, x0 + dx
        weight = (1 - np.abs(py - yi)) * (1 - np.abs(px - xi))
        valid = (yi >= 0) & (yi < h) & (xi >= 0) & (xi < w)
        for b, g in itertools.product(range(n), range(og)):
            picked = xg[b, g][:, np.clip(yi[b, g], 0, h - 1), np.clip(xi[b, g], 0, w - 1)]
            cols[b, g] += np.where(valid[b, g], weight[b, g] * mod[b, g], 0.0) * picked
    groups = geo["group"]
    cols = cols.reshape(n, groups, (c // groups) * kh * kw, oh * ow)
    kernels = wt.astype(np.float64).reshape(groups, wt.shape[0] // groups, -1)
    y = np.matmul(kernels[None], cols).reshape(n, wt.shape[0], oh, ow)
    if bias is not None:
        y = y + bias.astype(np.float64).reshape(1, -1, 1, 1)
    return [y.astype(x.dtype)]
