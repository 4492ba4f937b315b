"""Reference kernel of Resize: separable interpolation, one axis at a time.

For every output position along an axis the kernel maps the position to a
source coordinate (``coordinate_transformation_mode``), picks the taps around
it and their weights (``mode``), and takes the weighted sum of the taps in
float64. The formulas are those of the ONNX Resize-19 specification; where it
speaks of ``length_resized`` the integer output length is used, as onnxruntime
does. (onnx's own reference evaluator uses the fractional ``scale * length`` in
``align_corners``, so its node cases downsampling by scales with align_corners
expect other numbers: see tests/onnx_node/known_failures.txt.) Taps outside the
input are clamped to the edge (or dropped with ``exclude_outside``);
``tf_crop_and_resize`` positions outside the input take ``extrapolation_value``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import KernelContext
from keel.backends.reference.kernels import TABLE
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.resize import AxisResize, plan_resize

__all__ = ["source_coordinate", "tap_weights"]


def source_coordinate(mode: str, y: int, ax: AxisResize) -> float:
    """The source coordinate of output position ``y`` (ONNX's ``x_original``)."""
    scale, n_in, n_out = ax.scale, ax.in_size, ax.out_size
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adjustment = n_out / (scale * n_in)
        offset = n_in / 2 * (1 - adjustment)
        return offset + (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if n_out > 1 else 0.0
    if mode == "align_corners":
        return y * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_half_pixel_for_nn":
        return (y + 0.5) / scale
    # tf_crop_and_resize: start * (n_in - 1) + y * (end - start) * (n_in - 1) / (n_out - 1)
    if n_out > 1:
        return y * ax.roi_width * (n_in - 1) / (n_out - 1) + ax.roi_offset
    return ax.roi_width * (n_in - 1) / 2 + ax.roi_offset


def _nearest_tap(x: float, nearest_mode: str) -> int:
    if x == math.floor(x):
        return int(x)
    frac = x - math.floor(x)
    take_floor = {"round_prefer_floor": frac <= 0.5, "round_prefer_ceil": frac < 0.5,
                  "floor": True, "ceil": False}[nearest_mode]
    return math.floor(x) if take_floor else math.floor(x) + 1


def _cubic(t: float, a: float) -> float:
    """The Keys cubic convolution kernel with parameter ``a``."""
    t = abs(t)
    t2, t3 = t * t, t * t * t
    if t <= 1:
        return (a + 2) * t3 - (a + 3) * t2 + 1
    if t < 2:
        return a * t3 - 5 * a * t2 + 8 * a * t - 4 * a
    return 0.0


def _triangle(t: float) -> float:
    return max(0.0, 1.0 - abs(t))


def tap_weights(x: float, scale: float, attrs: Mapping[str, Any]) -> tuple[int, list[float]]:
    """(first tap, weights) for linear or cubic sampling at source coordinate ``x``.

    ``left`` is the tap at or just below ``x`` (one below when ``x`` is a whole
    number) and ``ratio = x - left`` lies in (0, 1]. Without antialiasing the
    weights are the kernel at distances ``i - ratio``; with it (and ``scale`` < 1)
    the kernel is stretched by ``1 / scale`` over more taps and the weights are
    renormalized to sum to 1.
    """
    left = math.ceil(x) - 1
    ratio = x - left
    support = 1 if attrs["mode"] == "linear" else 2
    a = attrs["cubic_coeff_a"]
    def kernel(t: float) -> float:
        return _triangle(t) if support == 1 else _cubic(t, a)
    if not attrs["antialias"]:
        first = 1 - support
        weights = [kernel(i - ratio) for i in range(first, support + 1)]
        return left + first, weights
    s = min(scale, 1.0)
    first = math.floor(-support / s) + 1
    weights = [kernel(s * (i - ratio)) for i in range(first, 1 - first + 1)]
    total = sum(weights)
    return left + first, [w / total for w in weights]


def _axis_table(ax: AxisResize, attrs: Mapping[str, Any]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output position: tap indices, weights, and whether it is extrapolated."""
    ctm = attrs["coordinate_transformation_mode"]
    rows_idx, rows_w, outside = [], [], []
    for y in range(ax.out_size):
        x = source_coordinate(ctm, y, ax)
        outside.append(ctm == "tf_crop_and_resize" and not 0 <= x <= ax.in_size - 1)
        if attrs["mode"] == "nearest":
            taps, weights = [_nearest_tap(x, attrs["nearest_mode"])], [1.0]
        else:
            first, weights = tap_weights(x, ax.scale, attrs)
            taps = list(range(first, first + len(weights)))
        if attrs["exclude_outside"] and attrs["mode"] != "nearest":
            weights = [w if 0 <= t < ax.in_size else 0.0 for t, w in zip(taps, weights,
                                                                        strict=True)]
            total = sum(weights)
            weights = [w / total for w in weights] if total else weights
        rows_idx.append([min(max(t, 0), ax.in_size - 1) for t in taps])
        rows_w.append(weights)
    return np.array(rows_idx, dtype=np.intp), np.array(rows_w), np.array(outside, dtype=bool)


def _resize_axis(data: np.ndarray, ax: AxisResize, attrs: Mapping[str, Any]) -> np.ndarray:
    idx, weights, outside = _axis_table(ax, attrs)
    moved = np.moveaxis(data, ax.axis, 0)
    if attrs["mode"] == "nearest":
        result = moved[idx[:, 0]]
    else:
        taps = moved[idx]                                  # (out, taps, ...)
        w = weights.reshape(weights.shape + (1,) * (moved.ndim - 1))
        result = (taps * w).sum(axis=1)
    if outside.any():
        result = result.copy()
        result[outside] = _cast_back(np.array(attrs["extrapolation_value"]), result.dtype)
    return np.moveaxis(result, 0, ax.axis)


def _cast_back(y: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """float64 → the input dtype; integers round half to even and saturate."""
    if y.dtype == dtype:
        return y
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype)


def _opt(inputs: Sequence[Any], i: int) -> Any:
    return inputs[i] if i < len(inputs) else None


@TABLE.kernel(Op.RESIZE)
def resize(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
           out: Sequence[Any] | None) -> list[Any]:
    """ONNX Resize-19 (all modes) by separable interpolation in float64."""
    x = inputs[0]
    plan = plan_resize(x.shape, _opt(inputs, 1), _opt(inputs, 2), _opt(inputs, 3), attrs)
    interpolating = attrs["mode"] != "nearest"
    if interpolating and x.dtype.kind not in "iuf":
        raise InvalidArgumentError(
            f"resize: mode {attrs['mode']!r} needs a numeric tensor, got {x.dtype}"
        )
    if math.prod(plan.out_shape) == 0:
        return [np.zeros(plan.out_shape, dtype=x.dtype)]
    data = x.astype(np.float64) if interpolating else np.asarray(x)
    for ax in plan.axes:
        data = _resize_axis(data, ax, attrs)
    return [_cast_back(data, x.dtype) if interpolating else np.ascontiguousarray(data)]
