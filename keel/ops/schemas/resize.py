"""Schema of Resize (ONNX Resize-19) and the output-shape rule its kernels share.

Inputs are ``X, roi, scales, sizes``; ``roi``, ``scales`` and ``sizes`` are
optional (absent as ``None``, or as an empty tensor the way older exporters
write them) and are *value inputs*: the output shape depends on their values.
Exactly one of ``scales`` and ``sizes`` must be given.

Output shape (the rule of ONNX's reference implementation and onnxruntime):
``floor(in * scale)`` with ``scales``; ``sizes`` as given with
``keep_aspect_ratio_policy="stretch"``; otherwise one scale
``min``/``max(sizes / in)`` over the resized axes and ``round_half_up(in * scale)``.
``roi`` only moves the sampling window of ``tf_crop_and_resize``; it does
not change the output shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import MAX_ELEMENTS, Dim, TensorType, checked_numel, normalize_axis

__all__ = [
    "COORDINATE_MODES",
    "KEEP_ASPECT_POLICIES",
    "MODES",
    "NEAREST_MODES",
    "AxisResize",
    "ResizePlan",
    "check_resize_attrs",
    "plan_resize",
]

MODES = ("nearest", "linear", "cubic")
COORDINATE_MODES = (
    "half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
    "asymmetric", "tf_crop_and_resize",
    "tf_half_pixel_for_nn",   # Resize-11 only; kept so older models import unchanged
)
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
KEEP_ASPECT_POLICIES = ("stretch", "not_larger", "not_smaller")


@dataclass(frozen=True)
class AxisResize:
    """How one axis is resampled."""

    axis: int
    in_size: int
    out_size: int
    scale: float                       # the scale of the coordinate transform
    roi: tuple[float, float] = (0.0, 1.0)
    # tf_crop_and_resize: (end - start) and start * (in_size - 1), both rounded in the
    # roi's own float type as ONNX and onnxruntime compute them.
    roi_width: float = 1.0
    roi_offset: float = 0.0


@dataclass(frozen=True)
class ResizePlan:
    """The output shape and the per-axis resampling of one Resize call."""

    out_shape: tuple[int, ...]
    axes: tuple[AxisResize, ...]       # only the axes named by ``axes`` (all by default)


def _choice(attrs: Mapping[str, Any], name: str, allowed: Sequence[str]) -> None:
    if attrs[name] not in allowed:
        raise InvalidArgumentError(
            f"resize: {name} {attrs[name]!r} is not supported; allowed: {', '.join(allowed)}"
        )


def check_resize_attrs(attrs: Mapping[str, Any]) -> None:
    """Check the string-valued attributes against the values ONNX defines."""
    _choice(attrs, "mode", MODES)
    _choice(attrs, "coordinate_transformation_mode", COORDINATE_MODES)
    _choice(attrs, "nearest_mode", NEAREST_MODES)
    _choice(attrs, "keep_aspect_ratio_policy", KEEP_ASPECT_POLICIES)


def resize_axes(rank: int, attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """The resized axes, normalized; all axes when ``axes`` is absent."""
    if attrs.get("axes") is None:
        return tuple(range(rank))
    axes = tuple(normalize_axis(a, rank, what="resize: axes entry") for a in attrs["axes"])
    if len(set(axes)) != len(axes):
        raise InvalidArgumentError(f"resize: axes {tuple(attrs['axes'])} repeat an axis")
    return axes


def _given(value: Any) -> bool:
    return value is not None and np.asarray(value).size > 0


def _vector(value: Any, n: int, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise InvalidArgumentError(
            f"resize: {name} must be 1-D with {n} entries (one per resized axis), "
            f"got shape {arr.shape}"
        )
    return arr


def _scales(value: Any, n: int) -> list[float]:
    arr = _vector(value, n, "scales")
    if arr.dtype.kind != "f":
        raise InvalidArgumentError(f"resize: scales must be a float tensor, got {arr.dtype}")
    out = [float(s) for s in arr]
    for s in out:
        if not (math.isfinite(s) and s > 0):
            raise InvalidArgumentError(f"resize: scales must be finite and > 0, got {out}")
    return out


def _sizes(value: Any, n: int) -> list[int]:
    arr = _vector(value, n, "sizes")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"resize: sizes must be an integer tensor, got {arr.dtype}")
    out = [int(s) for s in arr]
    if any(s < 0 for s in out):
        raise InvalidArgumentError(f"resize: sizes must be >= 0, got {out}")
    return out


def _check_one_of(scales: Any, sizes: Any) -> None:
    if _given(scales) and _given(sizes):
        raise InvalidArgumentError("resize: give scales or sizes, not both")
    if not _given(scales) and not _given(sizes):
        raise InvalidArgumentError("resize: one of scales and sizes is required")


def _out_from_sizes(ins: Sequence[Dim], sizes: Sequence[int],
                    policy: str) -> tuple[list[Dim], list[float | None]]:
    """Output dims and coordinate scales from ``sizes`` (None where unknowable)."""
    if policy == "stretch":
        return list(sizes), [None if not isinstance(i, int) else
                             (s / i if i else 1.0) for i, s in zip(ins, sizes, strict=True)]
    dims = [i for i in ins if isinstance(i, int)]
    if len(dims) != len(ins):
        return [None] * len(ins), [None] * len(ins)
    ratios = [s / i for i, s in zip(dims, sizes, strict=True) if i]
    scale = (min if policy == "not_larger" else max)(ratios) if ratios else 1.0
    outs: list[Dim] = [int(scale * i + 0.5) for i in dims]    # round half up
    return outs, [scale] * len(ins)


def _out_from_scales(ins: Sequence[Dim], scales: Sequence[float]) -> list[Dim]:
    outs: list[Dim] = []
    for i, s in zip(ins, scales, strict=True):
        if not isinstance(i, int):
            outs.append(None)
            continue
        exact = i * s
        if exact > MAX_ELEMENTS:
            raise InvalidArgumentError(
                f"resize: dimension {i} * scale {s} overflows (more than {MAX_ELEMENTS})"
            )
        outs.append(math.floor(exact))
    return outs


def _resized_dims(ins: Sequence[Dim], scales: Any, sizes: Any,
                  attrs: Mapping[str, Any]) -> tuple[list[Dim], list[float | None]]:
    n = len(ins)
    if _given(scales):
        sc = _scales(scales, n)
        return _out_from_scales(ins, sc), list(sc)
    sz = _sizes(sizes, n)
    for i, s in zip(ins, sz, strict=True):
        if i == 0 and s != 0:
            raise InvalidArgumentError(f"resize: cannot resize an empty axis to size {s}")
    return _out_from_sizes(ins, sz, attrs["keep_aspect_ratio_policy"])


def _roi(roi: Any, ins: Sequence[int], attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per axis: the roi window and its width and pixel offset (see AxisResize)."""
    n = len(ins)
    if attrs["coordinate_transformation_mode"] != "tf_crop_and_resize":
        return [{}] * n
    if not _given(roi):
        raise InvalidArgumentError("resize: tf_crop_and_resize needs the roi input")
    arr = _vector(roi, 2 * n, "roi")
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    out = []
    for i, size in enumerate(ins):
        start, end = arr[i], arr[n + i]
        out.append({"roi": (float(start), float(end)), "roi_width": float(end - start),
                    "roi_offset": float(start * arr.dtype.type(size - 1))})
    return out


def plan_resize(x_shape: Sequence[int], roi: Any, scales: Any, sizes: Any,
                attrs: Mapping[str, Any]) -> ResizePlan:
    """Output shape and per-axis resampling for a concrete input; errors are typed."""
    check_resize_attrs(attrs)
    _check_one_of(scales, sizes)
    axes = resize_axes(len(x_shape), attrs)
    ins = [int(x_shape[a]) for a in axes]
    outs, coord_scales = _resized_dims(ins, scales, sizes, attrs)
    rois = _roi(roi, ins, attrs)
    out_shape = [int(d) for d in x_shape]
    plans = []
    for k, a in enumerate(axes):
        out_shape[a] = cast(int, outs[k])      # every input dim is known here
        plans.append(AxisResize(a, ins[k], out_shape[a], float(coord_scales[k] or 1.0),
                                **rois[k]))
    checked_numel(out_shape, what="resize output shape")
    return ResizePlan(tuple(out_shape), tuple(plans))


def _infer_resize(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                  values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    check_resize_attrs(attrs)
    x = types[0]
    if x is None or x.shape is None:
        return [None if x is None else TensorType(x.dtype, None)]
    axes = resize_axes(len(x.shape), attrs)
    scales = values[2] if len(values) > 2 else None
    sizes = values[3] if len(values) > 3 else None
    out: list[Dim] = list(x.shape)
    if _given(scales) or _given(sizes):
        _check_one_of(scales, sizes)
        dims, _ = _resized_dims([x.shape[a] for a in axes], scales, sizes, attrs)
    else:
        dims = [None] * len(axes)      # not constant: known only at run time
    for a, d in zip(axes, dims, strict=True):
        out[a] = d
    known = [d for d in out if isinstance(d, int)]
    if len(known) == len(out):
        checked_numel(known, what="resize output shape")
    return [TensorType(x.dtype, tuple(out))]


register_schema(OpSchema(
    Op.RESIZE, 1, 4,
    attrs=(
        AttrSpec("mode", AttrKind.STR, "nearest"),
        AttrSpec("coordinate_transformation_mode", AttrKind.STR, "half_pixel"),
        AttrSpec("nearest_mode", AttrKind.STR, "round_prefer_floor"),
        AttrSpec("cubic_coeff_a", AttrKind.FLOAT, -0.75),
        AttrSpec("exclude_outside", AttrKind.BOOL, False),
        AttrSpec("extrapolation_value", AttrKind.FLOAT, 0.0),
        AttrSpec("antialias", AttrKind.BOOL, False),
        AttrSpec("axes", AttrKind.INTS, None),
        AttrSpec("keep_aspect_ratio_policy", AttrKind.STR, "stretch"),
    ),
    infer=_infer_resize,
    value_inputs=(1, 2, 3),
    doc="ONNX Resize-19: inputs X, roi, scales, sizes (the last three optional); "
        "nearest, linear and cubic sampling, separable over the resized axes.",
))
