"""Schemas of the vision family: sampling, boxes and image/column rearrangements.

Every op follows ONNX at its latest opset:

* ``grid_sample`` — GridSample-22, N-D: ``mode`` linear | nearest | cubic
  (Keys cubic, A = -0.75), ``padding_mode`` zeros | border | reflection,
  ``align_corners``. ``grid[..., 0]`` indexes the last spatial axis.
* ``affine_grid`` — AffineGrid-20: the sampling grid of ``theta`` (N, 2, 3) or
  (N, 3, 4) over ``size`` (N, C, H, W) or (N, C, D, H, W) (a value input).
* ``roi_align`` — RoiAlign-22 (``half_pixel`` or ``output_half_pixel``
  coordinates, ``avg`` or ``max`` pooling, onnxruntime's max-of-weighted-corners).
* ``non_max_suppression`` — NonMaxSuppression-11; the output length depends on
  the data (``[K, 3]`` int64 rows of batch, class, box).
* ``col2im`` — Col2Im-18 (N-D); ``image_shape`` and ``block_shape`` are value inputs.
* ``center_crop_pad`` — CenterCropPad-18; ``shape`` is a value input.
* ``max_unpool`` — MaxUnpool-22; the indices address the inferred output
  ``(in - 1) * stride - pads + kernel`` and an ``output_shape`` input only
  grows it (the unpooled values stay in its leading corner, as ONNX's tests
  expect).
* ``deform_conv`` — DeformConv-22 on 2-D images (bilinear sampling at the
  offset kernel taps, zeros outside, optional modulation ``mask``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, Shape, TensorType, checked_numel, normalize_axis

__all__ = [
    "concrete",
    "FLOAT_DTYPES",
    "GRID_MODES",
    "PADDING_MODES",
    "check_affine_grid",
    "check_center_crop_pad",
    "check_col2im",
    "check_deform_conv",
    "check_grid_sample",
    "check_max_unpool",
    "check_nms",
    "check_roi_align",
    "nms_limits",
    "spatial_params",
]

FLOAT_DTYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
GRID_MODES = ("linear", "nearest", "cubic")
PADDING_MODES = ("zeros", "border", "reflection")
_ROI_MODES = ("avg", "max")
_ROI_COORDS = ("half_pixel", "output_half_pixel")


def _known(d: Dim) -> bool:
    return isinstance(d, int)


def _agree(a: Dim, b: Dim) -> bool:
    return not (_known(a) and _known(b) and a != b)


def concrete(shape: Sequence[Dim]) -> tuple[int, ...]:
    """A shape computed from concrete input shapes, with every dimension an int."""
    dims = []
    for d in shape:
        if not isinstance(d, int):
            raise InvalidArgumentError(f"shape {tuple(shape)} has an unknown dimension {d!r}")
        dims.append(d)
    return tuple(dims)


def check_float(op: Op, dtype: DType, what: str = "X") -> None:
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"{op.value}: {what} must be float16, bfloat16, float32 or float64, got {dtype.value}")


def _choice(op: Op, name: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise InvalidArgumentError(
            f"{op.value}: {name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def spatial_params(op: Op, rank: int, attrs: Mapping[str, Any],
                   names: Sequence[str] = ("dilations", "pads", "strides")
                   ) -> dict[str, tuple[int, ...]]:
    """dilations, pads (begin..., end...) and strides with ONNX defaults, checked."""
    defaults = {"dilations": (1,) * rank, "pads": (0,) * (2 * rank), "strides": (1,) * rank,
                "kernel_shape": ()}
    out: dict[str, tuple[int, ...]] = {}
    for name in names:
        value = tuple(attrs.get(name) or defaults[name])
        want = 2 * rank if name == "pads" else rank
        if len(value) != want:
            raise InvalidArgumentError(
                f"{op.value}: {name} must have {want} entries, got {value}")
        low = 0 if name == "pads" else 1
        if any(v < low for v in value):
            raise InvalidArgumentError(
                f"{op.value}: {name} entries must be >= {low}, got {value}")
        out[name] = value
    return out


# ---- grid_sample / affine_grid ----------------------------------------------------------
def check_grid_sample(x: Sequence[Dim], grid: Sequence[Dim], attrs: Mapping[str, Any]) -> Shape:
    """X (N, C, D1..Dr), grid (N, O1..Or, r); returns Y's shape (N, C, O1..Or)."""
    op = Op.GRID_SAMPLE
    _choice(op, "mode", attrs["mode"], GRID_MODES)
    _choice(op, "padding_mode", attrs["padding_mode"], PADDING_MODES)
    r = len(x) - 2
    if r < 1:
        raise InvalidArgumentError(
            f"{op.value}: X must have rank >= 3 (N, C, spatial...), got {tuple(x)}")
    if len(grid) != r + 2 or not _agree(grid[0], x[0]) or not _agree(grid[-1], r):
        raise InvalidArgumentError(
            f"{op.value}: grid must have shape (N, out_1..out_{r}, {r}) for X of shape "
            f"{tuple(x)}, got {tuple(grid)}")
    return (x[0], x[1], *grid[1:-1])


def check_affine_grid(theta: Sequence[Dim], size: Sequence[int]) -> Shape:
    """theta (N, 2, 3) with size (N, C, H, W), or (N, 3, 4) with (N, C, D, H, W)."""
    op = Op.AFFINE_GRID
    if len(size) not in (4, 5) or any(s < 0 for s in size):
        raise InvalidArgumentError(
            f"{op.value}: size must be (N, C, H, W) or (N, C, D, H, W) of non-negative "
            f"values, got {tuple(size)}")
    r = len(size) - 2
    want = (size[0], r, r + 1)
    if len(theta) != 3 or not all(map(_agree, theta, want)):
        raise InvalidArgumentError(
            f"{op.value}: theta must have shape {want} for size {tuple(size)}, got "
            f"{tuple(theta)}")
    checked_numel((*size[:1], *size[2:], r), what=f"{op.value} output")
    return (size[0], *size[2:], r)


# ---- roi_align / non_max_suppression ------------------------------------------------------
def check_roi_align(x: Sequence[Dim], rois: Sequence[Dim], indices: Sequence[Dim],
                    attrs: Mapping[str, Any]) -> Shape:
    op = Op.ROI_ALIGN
    _choice(op, "mode", attrs["mode"], _ROI_MODES)
    _choice(op, "coordinate_transformation_mode", attrs["coordinate_transformation_mode"],
            _ROI_COORDS)
    if attrs["output_height"] < 1 or attrs["output_width"] < 1 or attrs["sampling_ratio"] < 0:
        raise InvalidArgumentError(
            f"{op.value}: output_height and output_width must be >= 1 and sampling_ratio >= 0, "
            f"got {attrs['output_height']}, {attrs['output_width']}, {attrs['sampling_ratio']}")
    if len(x) != 4:
        raise InvalidArgumentError(f"{op.value}: X must be (N, C, H, W), got {tuple(x)}")
    if len(rois) != 2 or not _agree(rois[1], 4):
        raise InvalidArgumentError(
            f"{op.value}: rois must have shape (num_rois, 4), got {tuple(rois)}")
    if len(indices) != 1 or not _agree(indices[0], rois[0]):
        raise InvalidArgumentError(
            f"{op.value}: batch_indices must have shape ({rois[0]},), got {tuple(indices)}")
    return (rois[0], x[1], attrs["output_height"], attrs["output_width"])


def check_nms(boxes: Sequence[Dim], scores: Sequence[Dim], attrs: Mapping[str, Any]) -> None:
    op = Op.NON_MAX_SUPPRESSION
    if attrs["center_point_box"] not in (0, 1):
        raise InvalidArgumentError(
            f"{op.value}: center_point_box must be 0 or 1, got {attrs['center_point_box']}")
    if len(boxes) != 3 or not _agree(boxes[2], 4):
        raise InvalidArgumentError(
            f"{op.value}: boxes must have shape (batches, boxes, 4), got {tuple(boxes)}")
    if len(scores) != 3 or not _agree(scores[0], boxes[0]) or not _agree(scores[2], boxes[1]):
        raise InvalidArgumentError(
            f"{op.value}: scores must have shape (batches, classes, boxes) = "
            f"({boxes[0]}, classes, {boxes[1]}), got {tuple(scores)}")


def _first(x: Any) -> float | None:
    """The first element of an optional scalar input (NumPy or CuPy), or None if empty."""
    if x is None:
        return None
    flat = x.reshape(-1).tolist()
    return flat[0] if flat else None


def nms_limits(limit: Any, iou: Any, score: Any) -> tuple[int, float, float | None]:
    """max_output_boxes_per_class (0: none), iou_threshold (0) and score_threshold (None)
    from the optional scalar inputs, checked."""
    first = _first(limit)
    max_out = max(int(first), 0) if first is not None else 0
    iou_t = _first(iou)
    iou_t = 0.0 if iou_t is None else float(iou_t)
    if not 0.0 <= iou_t <= 1.0:
        raise InvalidArgumentError(
            f"{Op.NON_MAX_SUPPRESSION.value}: iou_threshold must be in [0, 1], got {iou_t}")
    score_t = _first(score)
    return max_out, iou_t, None if score_t is None else float(score_t)


# ---- col2im / center_crop_pad / max_unpool ------------------------------------------------
def check_col2im(x: Sequence[Dim], image: Sequence[int], block: Sequence[int],
                 attrs: Mapping[str, Any]) -> tuple[Shape, tuple[int, ...]]:
    """Y's shape (N, C, *image) and the number of blocks along each axis."""
    op = Op.COL2IM
    r = len(image)
    if r < 1 or len(block) != r or any(b < 1 for b in block) or any(i < 0 for i in image):
        raise InvalidArgumentError(
            f"{op.value}: image_shape {tuple(image)} and block_shape {tuple(block)} must have "
            "one entry per spatial axis (block entries >= 1)")
    p = spatial_params(op, r, attrs)
    blocks = tuple(
        (image[i] + p["pads"][i] + p["pads"][i + r] - p["dilations"][i] * (block[i] - 1) - 1)
        // p["strides"][i] + 1 for i in range(r))
    if any(b < 1 for b in blocks):
        raise InvalidArgumentError(
            f"{op.value}: image_shape {tuple(image)} with the pads is smaller than one block "
            f"{tuple(block)} (dilated)")
    k = math.prod(block)
    if len(x) != 3 or (isinstance(x[1], int) and x[1] % k) \
            or not _agree(x[2], math.prod(blocks)):
        raise InvalidArgumentError(
            f"{op.value}: input must have shape (N, C * {k}, {math.prod(blocks)}) for blocks "
            f"{tuple(block)} over image {tuple(image)}, got {tuple(x)}")
    channels = x[1] // k if isinstance(x[1], int) else None
    return (x[0], channels, *image), blocks


def check_center_crop_pad(x: Sequence[Dim], shape: Sequence[int],
                          axes: Sequence[int] | None) -> tuple[tuple[int, ...], Shape]:
    """The normalized axes and the output shape."""
    op = Op.CENTER_CROP_PAD
    norm = tuple(range(len(x))) if axes is None else tuple(
        normalize_axis(a, len(x), what=f"{op.value}: axes entry") for a in axes)
    if len(set(norm)) != len(norm):
        raise InvalidArgumentError(f"{op.value}: axes {tuple(axes or ())} repeat an axis")
    if len(shape) != len(norm) or any(s < 0 for s in shape):
        raise InvalidArgumentError(
            f"{op.value}: shape must hold one non-negative size per axis ({len(norm)}), got "
            f"{tuple(shape)}")
    out = list(x)
    for a, s in zip(norm, shape, strict=True):
        out[a] = s
    return norm, tuple(out)


def check_max_unpool(x: Sequence[int], indices: Sequence[int], attrs: Mapping[str, Any],
                     output_shape: Sequence[int] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The inferred shape the indices address and the output shape."""
    op = Op.MAX_UNPOOL
    kernel = tuple(attrs["kernel_shape"])
    r = len(kernel)
    if len(x) != r + 2 or tuple(indices) != tuple(x):
        raise InvalidArgumentError(
            f"{op.value}: X must be (N, C, {r} spatial dims) for kernel_shape {kernel} and I "
            f"must have X's shape; got X {tuple(x)}, I {tuple(indices)}")
    if any(k < 1 for k in kernel):
        raise InvalidArgumentError(f"{op.value}: kernel_shape must be >= 1, got {kernel}")
    p = spatial_params(op, r, attrs, ("pads", "strides"))
    inferred = (x[0], x[1], *(
        (x[i + 2] - 1) * p["strides"][i] - p["pads"][i] - p["pads"][i + r] + kernel[i]
        for i in range(r)))
    if any(d < 0 for d in inferred):
        raise InvalidArgumentError(
            f"{op.value}: the pads make the output shape {inferred} negative")
    if output_shape is None:
        return inferred, inferred
    out = tuple(int(d) for d in output_shape)
    if len(out) != len(inferred) or any(o < i for o, i in zip(out, inferred, strict=True)):
        raise InvalidArgumentError(
            f"{op.value}: output_shape {out} must have rank {len(inferred)} and be at least "
            f"the unpooled shape {inferred}")
    return inferred, out


# ---- deform_conv ----------------------------------------------------------------------------
def check_deform_conv(x: Sequence[int], w: Sequence[int], offset: Sequence[int],
                      bias: Sequence[int] | None, mask: Sequence[int] | None,
                      attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The checked geometry: kernel, pads, strides, dilations, output size, groups."""
    op = Op.DEFORM_CONV
    if len(x) != 4 or len(w) != 4:
        if len(x) >= 3 and len(x) == len(w):
            raise UnsupportedOperationError(
                op.value, detail=f"{len(x) - 2}-D deformable convolution; keel supports 2-D "
                                 "(X of shape N, C, H, W)")
        raise InvalidArgumentError(
            f"{op.value}: X and W must be 4-D (N, C, H, W) and (M, C/group, kH, kW), got "
            f"{tuple(x)} and {tuple(w)}")
    group, ogroup = attrs["group"], attrs["offset_group"]
    kernel = tuple(attrs["kernel_shape"] or w[2:])
    p = spatial_params(op, 2, attrs)
    if group < 1 or ogroup < 1 or x[1] != w[1] * group or w[0] % group or x[1] % ogroup \
            or kernel != tuple(w[2:]):
        raise InvalidArgumentError(
            f"{op.value}: X {tuple(x)}, W {tuple(w)}, group {group}, offset_group {ogroup} and "
            f"kernel_shape {kernel} are inconsistent")
    out = tuple((x[2 + i] + p["pads"][i] + p["pads"][i + 2]
                 - p["dilations"][i] * (kernel[i] - 1) - 1) // p["strides"][i] + 1
                for i in range(2))
    taps = kernel[0] * kernel[1]
    want = (x[0], ogroup * taps * 2, *out)
    if tuple(offset) != want:
        raise InvalidArgumentError(
            f"{op.value}: offset must have shape {want}, got {tuple(offset)}")
    if mask is not None and tuple(mask) != (x[0], ogroup * taps, *out):
        raise InvalidArgumentError(
            f"{op.value}: mask must have shape {(x[0], ogroup * taps, *out)}, got {tuple(mask)}")
    if bias is not None and tuple(bias) != (w[0],):
        raise InvalidArgumentError(f"{op.value}: B must have shape ({w[0]},), got {tuple(bias)}")
    return {"kernel": kernel, "out": out, "group": group, "offset_group": ogroup, **p}


# ---- inference ------------------------------------------------------------------------------
def _shape(types: Sequence[TensorType | None], i: int) -> tuple[Dim, ...] | None:
    t = types[i] if i < len(types) else None
    return None if t is None or t.shape is None else tuple(t.shape)


def _static(shape: tuple[Dim, ...] | None) -> tuple[int, ...] | None:
    if shape is None:
        return None
    dims = [d for d in shape if isinstance(d, int)]
    return tuple(dims) if len(dims) == len(shape) else None


def _ints(v: np.ndarray | None) -> tuple[int, ...] | None:
    return None if v is None else tuple(int(i) for i in np.asarray(v).reshape(-1))


def _value(values: Sequence[np.ndarray | None], i: int) -> np.ndarray | None:
    return values[i] if i < len(values) else None


def _infer(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [None]
        if op not in (Op.CENTER_CROP_PAD, Op.MAX_UNPOOL, Op.NON_MAX_SUPPRESSION):
            check_float(op, x.dtype, "theta" if op is Op.AFFINE_GRID else "X")
        shape = _INFER_SHAPE[op](types, attrs, values)
        dtype = DType.INT64 if op is Op.NON_MAX_SUPPRESSION else x.dtype
        return [TensorType(dtype, shape)]
    return infer


def _grid_sample_shape(types: Any, attrs: Any, values: Any) -> Shape | None:
    x, g = _shape(types, 0), _shape(types, 1)
    return None if x is None or g is None else check_grid_sample(x, g, attrs)


def _affine_grid_shape(types: Any, attrs: Any, values: Any) -> Shape | None:
    size, theta = _ints(_value(values, 1)), _shape(types, 0)
    if size is not None and theta is not None:
        return check_affine_grid(theta, size)
    given = _shape(types, 1)          # (4,) or (5,): the rank is known, the sizes are not
    if theta is None or given is None or len(given) != 1 or given[0] not in (4, 5):
        return None
    r = int(given[0]) - 2
    return (theta[0], *(None,) * r, r)


def _roi_align_shape(types: Any, attrs: Any, values: Any) -> Shape | None:
    x, r, i = _shape(types, 0), _shape(types, 1), _shape(types, 2)
    return None if x is None or r is None or i is None else check_roi_align(x, r, i, attrs)


def _nms_shape(types: Any, attrs: Any, values: Any) -> Shape | None:
    b, s = _shape(types, 0), _shape(types, 1)
    if b is not None and s is not None:
        check_nms(b, s, attrs)
    return (None, 3)


def _col2im_shape(types: Any, attrs: Any, values: Any) -> Shape | None:
    x, image, block = _shape(types, 0), _ints(_value(values, 1)), _ints(_value(values, 2))
    if x is not None and image is not None and block is not None:
        return check_col2im(x, image, block, attrs)[0]
    # Unknown sizes: the rank still follows from image_shape's length.
    spatial = _shape(types, 1)
    if x is None or spatial is None or len(spatial) != 1 or not isinstance(spatial[0], int):
        return None
    return (x[0], None, *(None,) * spatial[0])


def _center_crop_pad_shape(types: Any, attrs: Any, values: Any) -> Shape | None:
    x, shape = _shape(types, 0), _ints(_value(values, 1))
    if x is None:
        return None
    if shape is not None:
        return check_center_crop_pad(x, shape, attrs["axes"])[1]
    axes = range(len(x)) if attrs["axes"] is None else [a % max(len(x), 1) for a in attrs["axes"]]
    return tuple(None if i in axes else d for i, d in enumerate(x))


def _max_unpool_shape(types: Any, attrs: Any, values: Any) -> Shape | None:
    x, i = _static(_shape(types, 0)), _static(_shape(types, 1))
    given = _ints(_value(values, 2))
    if x is None or i is None or (len(types) > 2 and types[2] is not None and given is None):
        rank = _shape(types, 0)
        return None if rank is None else (None,) * len(rank)
    return check_max_unpool(x, i, attrs, given)[1]


def _deform_conv_shape(types: Any, attrs: Any, values: Any) -> Shape | None:
    x, w, offset, bias, mask = (_static(_shape(types, k)) for k in range(5))
    if x is None or w is None or offset is None:
        return None
    geo = check_deform_conv(x, w, offset, bias, mask, attrs)
    return (x[0], w[0], *geo["out"])


_INFER_SHAPE = {
    Op.GRID_SAMPLE: _grid_sample_shape, Op.AFFINE_GRID: _affine_grid_shape,
    Op.ROI_ALIGN: _roi_align_shape, Op.NON_MAX_SUPPRESSION: _nms_shape,
    Op.COL2IM: _col2im_shape, Op.CENTER_CROP_PAD: _center_crop_pad_shape,
    Op.MAX_UNPOOL: _max_unpool_shape, Op.DEFORM_CONV: _deform_conv_shape,
}

_CONV_ATTRS = (AttrSpec("dilations", AttrKind.INTS, ()), AttrSpec("pads", AttrKind.INTS, ()),
               AttrSpec("strides", AttrKind.INTS, ()))

register_schema(OpSchema(
    Op.GRID_SAMPLE, 2, 2,
    attrs=(AttrSpec("mode", AttrKind.STR, "linear"),
           AttrSpec("padding_mode", AttrKind.STR, "zeros"),
           AttrSpec("align_corners", AttrKind.BOOL, False)),
    infer=_infer(Op.GRID_SAMPLE),
    doc="ONNX GridSample-22 (N-D): sample X at the normalized positions in grid.",
))
register_schema(OpSchema(
    Op.AFFINE_GRID, 2, 2, attrs=(AttrSpec("align_corners", AttrKind.BOOL, False),),
    infer=_infer(Op.AFFINE_GRID), value_inputs=(1,),
    doc="ONNX AffineGrid-20: theta applied to the normalized base grid of `size`.",
))
register_schema(OpSchema(
    Op.ROI_ALIGN, 3, 3,
    attrs=(AttrSpec("coordinate_transformation_mode", AttrKind.STR, "half_pixel"),
           AttrSpec("mode", AttrKind.STR, "avg"),
           AttrSpec("output_height", AttrKind.INT, 1),
           AttrSpec("output_width", AttrKind.INT, 1),
           AttrSpec("sampling_ratio", AttrKind.INT, 0),
           AttrSpec("spatial_scale", AttrKind.FLOAT, 1.0)),
    infer=_infer(Op.ROI_ALIGN),
    doc="ONNX RoiAlign-22: bilinear samples averaged (or max-pooled) per output bin.",
))
register_schema(OpSchema(
    Op.NON_MAX_SUPPRESSION, 2, 5, attrs=(AttrSpec("center_point_box", AttrKind.INT, 0),),
    infer=_infer(Op.NON_MAX_SUPPRESSION),
    doc="ONNX NonMaxSuppression-11: greedy per batch and class by descending score; "
        "[K, 3] int64 (batch, class, box) rows.",
))
register_schema(OpSchema(
    Op.COL2IM, 3, 3, attrs=_CONV_ATTRS, infer=_infer(Op.COL2IM), value_inputs=(1, 2),
    doc="ONNX Col2Im-18: sum sliding blocks back into an image (the inverse of im2col).",
))
register_schema(OpSchema(
    Op.CENTER_CROP_PAD, 2, 2, attrs=(AttrSpec("axes", AttrKind.INTS, None),),
    infer=_infer(Op.CENTER_CROP_PAD), value_inputs=(1,),
    doc="ONNX CenterCropPad-18: crop or zero-pad each axis around its center to `shape`.",
))
register_schema(OpSchema(
    Op.MAX_UNPOOL, 2, 3,
    attrs=(AttrSpec("kernel_shape", AttrKind.INTS, REQUIRED), AttrSpec("pads", AttrKind.INTS, ()),
           AttrSpec("strides", AttrKind.INTS, ())),
    infer=_infer(Op.MAX_UNPOOL), value_inputs=(2,),
    doc="ONNX MaxUnpool-22: scatter X to the flat positions I of the unpooled tensor.",
))
register_schema(OpSchema(
    Op.DEFORM_CONV, 3, 5,
    attrs=(*_CONV_ATTRS, AttrSpec("group", AttrKind.INT, 1),
           AttrSpec("kernel_shape", AttrKind.INTS, ()),
           AttrSpec("offset_group", AttrKind.INT, 1)),
    infer=_infer(Op.DEFORM_CONV),
    doc="ONNX DeformConv-22 (2-D): convolution sampling X bilinearly at kernel taps moved "
        "by `offset`, each tap scaled by `mask`.",
))
