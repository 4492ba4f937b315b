"""cpu kernel of Resize, written against ``ctx.xp``.

Per resized axis a small table of tap indices and weights is built on the
host (NumPy, vectorised over the output positions) and moved to the array
namespace; the data is then resampled by gathers along the axis and a
weighted sum, one axis at a time, shrinking axes first. Identity axes are
skipped. Nearest resizing by whole factors (the common 2x upsampling) is a
few strided copies straight into the output, without gathers.

Semantics match the reference kernel (``keel.backends.reference.resize``):
float16 is computed in float32, float64 in float64. Integer data is
interpolated exactly as the reference does it (float64, the same weights, axis
order and summation order), so that results landing on a rounding tie round
the same way; they round half to even and saturate. All of ONNX Resize-19 is
covered, antialiasing included.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import KernelContext
from keel.backends.cpu.kernels import TABLE
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.resize import AxisResize, plan_resize

__all__: list[str] = []

Attrs = Mapping[str, Any]


# ---- host-side tables (NumPy: they are tiny and built once per call) -------------


def _coordinates(mode: str, ax: AxisResize) -> np.ndarray:
    """Source coordinates of every output position along one axis (float64)."""
    y = np.arange(ax.out_size, dtype=np.float64)
    s, n_in, n_out = ax.scale, ax.in_size, ax.out_size
    if mode in ("half_pixel", "pytorch_half_pixel"):
        if mode == "pytorch_half_pixel" and n_out <= 1:
            return np.zeros_like(y)
        return (y + 0.5) / s - 0.5
    if mode == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / (s * n_in))
        return offset + (y + 0.5) / s - 0.5
    if mode == "align_corners":
        return y * (n_in - 1) / (n_out - 1) if n_out > 1 else np.zeros_like(y)
    if mode == "asymmetric":
        return y / s
    if mode == "tf_half_pixel_for_nn":
        return (y + 0.5) / s
    if n_out > 1:    # tf_crop_and_resize
        return y * ax.roi_width * (n_in - 1) / (n_out - 1) + ax.roi_offset
    return np.full_like(y, ax.roi_width * (n_in - 1) / 2 + ax.roi_offset)


def _nearest(x: np.ndarray, mode: str) -> np.ndarray:
    floor = np.floor(x)
    frac = x - floor
    if mode == "round_prefer_floor":
        up = frac > 0.5
    elif mode == "round_prefer_ceil":
        up = frac >= 0.5
    elif mode == "floor":
        up = np.zeros_like(frac, dtype=bool)
    else:
        up = frac > 0
    return (floor + up).astype(np.intp)


def _kernel(t: np.ndarray, attrs: Attrs) -> np.ndarray:
    t = np.abs(t)
    if attrs["mode"] == "linear":
        return np.maximum(0.0, 1.0 - t)
    a = attrs["cubic_coeff_a"]
    t2, t3 = t * t, t * t * t
    near = (a + 2) * t3 - (a + 3) * t2 + 1
    far = a * t3 - 5 * a * t2 + 8 * a * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def _weights(x: np.ndarray, ax: AxisResize, attrs: Attrs) -> tuple[np.ndarray, np.ndarray]:
    """(taps, weights), each (out, n): see ``reference.resize.tap_weights``."""
    left = np.ceil(x) - 1
    ratio = x - left
    support = 1 if attrs["mode"] == "linear" else 2
    s = min(ax.scale, 1.0) if attrs["antialias"] else 1.0
    first = math.floor(-support / s) + 1
    offsets = np.arange(first, 2 - first, dtype=np.float64)
    w = _kernel(s * (offsets[None, :] - ratio[:, None]), attrs)
    if attrs["antialias"]:
        w /= w.sum(axis=1, keepdims=True)
    taps = (left[:, None] + offsets[None, :]).astype(np.intp)
    if attrs["exclude_outside"]:
        w = np.where((taps < 0) | (taps >= ax.in_size), 0.0, w)
        total = w.sum(axis=1, keepdims=True)
        w /= np.where(total == 0, 1.0, total)
    return taps, w


def _table(ax: AxisResize, attrs: Attrs) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(taps, weights or None for nearest, extrapolated mask) for one axis.

    Taps are not yet clamped to the input: callers clamp (edge padding) as they need.
    """
    ctm = attrs["coordinate_transformation_mode"]
    x = _coordinates(ctm, ax)
    outside = ((x < 0) | (x > ax.in_size - 1)) if ctm == "tf_crop_and_resize" else \
        np.zeros(x.shape, dtype=bool)
    if attrs["mode"] == "nearest":
        taps, w = _nearest(x, attrs["nearest_mode"])[:, None], None
    else:
        taps, w = _weights(x, ax, attrs)
    return taps, w, outside


def _is_identity(ax: AxisResize, attrs: Attrs) -> bool:
    if ax.in_size != ax.out_size:
        return False
    x = _coordinates(attrs["coordinate_transformation_mode"], ax)
    return bool(np.array_equal(x, np.arange(ax.in_size, dtype=np.float64)))


# ---- device-side resampling ------------------------------------------------------


def _compute_dtype(xp: Any, dtype: Any) -> Any:
    return xp.float64 if dtype == xp.float64 or dtype.kind in "iu" else xp.float32


def _along(axis: int, ndim: int, v: Any) -> Any:
    """A per-position vector shaped to broadcast along ``axis`` (trailing dims)."""
    return v.reshape((-1,) + (1,) * (ndim - axis - 1))


def _resample_axis(xp: Any, data: Any, ax: AxisResize, attrs: Attrs, dst: Any | None,
                   scratch: Any, plain: bool) -> Any:
    """Resample ``data`` along one axis into ``dst`` (or a fresh array); ``scratch`` is a
    flat buffer at least as large as the result, shared by the passes of one call;
    ``plain`` sums the weighted taps in order, exactly as the reference does."""
    taps, w, outside = _table(ax, attrs)
    taps = np.clip(taps, 0, ax.in_size - 1)
    axis = ax.axis
    shape = (*data.shape[:axis], ax.out_size, *data.shape[axis + 1:])
    r = dst if dst is not None else xp.empty(shape, dtype=data.dtype)
    if w is None:
        _take(xp, data, taps[:, 0], axis, r)
    else:
        _weighted_sum(xp, data, r, scratch[:r.size].reshape(r.shape), axis, taps, w, plain)
    if outside.any():
        r[_at(axis, xp.asarray(outside))] = _fill_value(attrs["extrapolation_value"], r.dtype)
    return r


def _at(axis: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + (index,)


def _fill_value(value: float, dtype: Any) -> Any:
    """The extrapolation value in ``dtype`` (integers round half to even and saturate)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return int(np.clip(np.rint(value), info.min, info.max))
    return value


def _take(xp: Any, data: Any, taps: np.ndarray, axis: int, out: Any) -> None:
    """Gather ``taps`` along ``axis`` into ``out`` (indices are already in range)."""
    if xp is np:
        # NumPy buffers ``out`` for the default mode="raise"; the taps are clipped already.
        np.take(data, taps, axis=axis, out=out, mode="clip")
    else:
        xp.take(data, xp.asarray(taps), axis=axis, out=out)


def _weighted_sum(xp: Any, data: Any, r: Any, t: Any, axis: int, taps: np.ndarray,
                  w: np.ndarray, plain: bool) -> None:
    """r = sum_j w[:, j] * data[taps[:, j]] along ``axis``; ``t`` is scratch of r's shape."""
    if not plain and w.shape[1] == 2 and np.allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-12):
        _linear_sum(xp, data, r, t, axis, taps, w)
        return
    wd = xp.asarray(w.astype(r.dtype))
    _take(xp, data, taps[:, 0], axis, r)
    r *= _along(axis, r.ndim, wd[:, 0])
    for j in range(1, w.shape[1]):
        _take(xp, data, taps[:, j], axis, t)
        t *= _along(axis, r.ndim, wd[:, j])
        r += t


def _linear_sum(xp: Any, data: Any, r: Any, t: Any, axis: int, taps: np.ndarray,
                w: np.ndarray) -> None:
    """Two taps as r = near + w_far * (far - near): exact where both taps clamp to one
    input, and when w_far is the same everywhere (2x half-pixel upsampling: 0.25) the
    multiply is by a scalar over a contiguous array instead of a broadcast per row."""
    swap = w[:, 0] > w[:, 1]          # tap 0 is the near one there
    w_far = np.minimum(w[:, 0], w[:, 1])
    if np.all(w_far == w_far[0]):
        _take(xp, data, np.where(swap, taps[:, 0], taps[:, 1]), axis, r)
        _take(xp, data, np.where(swap, taps[:, 1], taps[:, 0]), axis, t)
        t -= r
        t *= float(w_far[0])
    else:
        _take(xp, data, taps[:, 0], axis, r)
        _take(xp, data, taps[:, 1], axis, t)
        t -= r
        t *= _along(axis, r.ndim, xp.asarray(w[:, 1].astype(r.dtype)))
    r += t


def _whole_factor(ax: AxisResize, attrs: Attrs) -> int:
    """k when nearest resizing of this axis repeats every input element k times, else 0."""
    if ax.out_size % ax.in_size:
        return 0
    k = ax.out_size // ax.in_size
    taps, _, outside = _table(ax, attrs)
    repeated = np.repeat(np.arange(ax.in_size, dtype=np.intp), k)
    taps = np.clip(taps[:, 0], 0, ax.in_size - 1)
    return k if not outside.any() and np.array_equal(taps, repeated) else 0


def _repeat_nearest(xp: Any, x: Any, axes: Sequence[AxisResize], factors: Sequence[int],
                    out_shape: tuple[int, ...], dst: Any | None) -> Any:
    """Whole-factor nearest upsampling: one strided copy of X per phase of the output."""
    y = dst if dst is not None else xp.empty(out_shape, dtype=x.dtype)
    phases = [range(k) for k in factors]
    for offsets in itertools.product(*phases):
        index = [slice(None)] * x.ndim
        for ax, k, j in zip(axes, factors, offsets, strict=True):
            index[ax.axis] = slice(j, None, k)
        y[tuple(index)] = x
    return y


def _deliver(xp: Any, y: Any, dtype: Any, out: Sequence[Any] | None) -> Any:
    """Cast to the input dtype (integers round half to even and saturate) into ``out``."""
    if y.dtype != dtype and dtype.kind in "iu":
        info = np.iinfo(dtype)
        xp.rint(y, out=y)
        xp.clip(y, info.min, info.max, out=y)
    if out is not None:
        if y is not out[0]:
            out[0][...] = y
        return out[0]
    return y if y.dtype == dtype else y.astype(dtype)


def _dst(out: Sequence[Any] | None, dtype: Any) -> Any | None:
    if out is not None and out[0].dtype == dtype and out[0].flags.c_contiguous:
        return out[0]
    return None


def _opt(inputs: Sequence[Any], i: int) -> Any:
    value = inputs[i] if i < len(inputs) else None
    return None if value is None else np.asarray(_host(value))


def _host(value: Any) -> Any:
    """Shape parameters (roi, scales, sizes) are read on the host."""
    return value.get() if hasattr(value, "get") and not isinstance(value, np.ndarray) else value


def _largest_pass(shape: Sequence[int], axes: Sequence[AxisResize]) -> int:
    """The largest result of the axis passes, in elements (the scratch size)."""
    dims, largest = list(shape), 0
    for ax in axes:
        dims[ax.axis] = ax.out_size
        largest = max(largest, math.prod(dims))
    return largest


@TABLE.kernel(Op.RESIZE, supports_out=True)
def resize(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
           out: Sequence[Any] | None) -> list[Any]:
    """ONNX Resize-19: precomputed tap tables per axis, gathers and weighted sums."""
    xp = ctx.xp
    x = inputs[0]
    plan = plan_resize(x.shape, _opt(inputs, 1), _opt(inputs, 2), _opt(inputs, 3), attrs)
    nearest = attrs["mode"] == "nearest"
    if not nearest and x.dtype.kind not in "iuf":
        raise InvalidArgumentError(
            f"resize: mode {attrs['mode']!r} needs a numeric tensor, got {x.dtype}"
        )
    if math.prod(plan.out_shape) == 0:
        return [_deliver(xp, xp.zeros(plan.out_shape, dtype=x.dtype), x.dtype, out)]
    axes = [ax for ax in plan.axes if not _is_identity(ax, attrs)]
    exact = not nearest and x.dtype.kind in "iu"
    if not exact:
        # Shrinking axes first (less data for the rest); among equal ratios the innermost
        # first, since gathers along the contiguous axis cost the most per element.
        axes.sort(key=lambda ax: (ax.out_size / ax.in_size, -ax.axis))
    if nearest:
        factors = [_whole_factor(ax, attrs) for ax in axes]
        if all(factors):
            y = _repeat_nearest(xp, x, axes, factors, plan.out_shape, _dst(out, x.dtype))
            return [_deliver(xp, y, x.dtype, out)]
    data = x if nearest else x.astype(_compute_dtype(xp, x.dtype), copy=False)
    scratch = None if nearest else xp.empty(_largest_pass(x.shape, axes), dtype=data.dtype)
    for i, ax in enumerate(axes):
        last = i == len(axes) - 1
        data = _resample_axis(xp, data, ax, attrs, _dst(out, data.dtype) if last else None,
                              scratch, plain=exact)
    if not axes:
        data = data.copy() if data is x else data
    return [_deliver(xp, data, x.dtype, out)]
