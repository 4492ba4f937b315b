"""The vision family: kernels against ONNX's oracle, inference, importer forms, typed errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.graph.importers.onnx import import_onnx
from keel.ops.registry import Op, OpGroup
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._extra_support import (
    assert_close,
    keel_run,
    onnx_model,
    onnx_run,
    run_both,
    run_cpu,
    run_ref,
)

RNG = np.random.default_rng(8)


def _n(*shape: int, dtype: Any = np.float32, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def _i(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


X4 = _n(2, 3, 5, 6)
GRID = RNG.uniform(-1.3, 1.3, (2, 4, 3, 2)).astype(np.float32)
GRID3 = RNG.uniform(-1.2, 1.2, (1, 2, 3, 2, 3)).astype(np.float32)
ROIS = np.array([[0.5, 1.0, 4.0, 3.5], [-1.0, 0.0, 3.0, 6.0], [2.0, 2.0, 2.5, 2.2]], np.float32)
BOXES = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, -0.1, 1, 0.9], [0, 10, 1, 11],
                   [1, 1, 0, 0], [0, 100, 1, 101]]], np.float32)
SCORES = np.array([[[0.9, 0.75, 0.6, 0.95, 0.5, 0.3], [0.1, 0.2, 0.9, 0.9, 0.3, 0.5]]], np.float32)

# (id, keel op, inputs, attrs, ONNX op_type, ONNX attrs, opset)
ORACLE: list[tuple[str, Op, list[Any], dict[str, Any], str, dict[str, Any], int]] = [
    *[(f"grid_sample-{m}-{p}-{a}", Op.GRID_SAMPLE, [X4, GRID],
       {"mode": m, "padding_mode": p, "align_corners": a}, "GridSample",
       {"mode": m, "padding_mode": p, "align_corners": a}, 22)
      for m in ("linear", "nearest", "cubic") for p in ("zeros", "border", "reflection")
      for a in (0, 1)],
    ("grid_sample-3d", Op.GRID_SAMPLE, [_n(1, 2, 3, 4, 5), GRID3], {}, "GridSample", {}, 22),
    ("affine_grid-2d", Op.AFFINE_GRID, [_n(2, 2, 3), _i(2, 3, 4, 5)], {}, "AffineGrid", {}, 20),
    ("affine_grid-3d-align", Op.AFFINE_GRID, [_n(1, 3, 4), _i(1, 1, 2, 3, 4)],
     {"align_corners": 1}, "AffineGrid", {"align_corners": 1}, 20),
    ("roi_align-avg", Op.ROI_ALIGN, [X4, ROIS, _i(0, 1, 1)],
     {"output_height": 3, "output_width": 2}, "RoiAlign",
     {"output_height": 3, "output_width": 2}, 22),
    ("roi_align-max-output-half", Op.ROI_ALIGN, [X4, ROIS, _i(1, 0, 1)],
     {"mode": "max", "sampling_ratio": 2, "coordinate_transformation_mode": "output_half_pixel",
      "spatial_scale": 0.5},
     "RoiAlign", {"mode": "max", "sampling_ratio": 2, "spatial_scale": 0.5,
                  "coordinate_transformation_mode": "output_half_pixel"}, 22),
    ("nms-corners", Op.NON_MAX_SUPPRESSION, [BOXES, SCORES, _i(3), np.array([0.4], np.float32)],
     {}, "NonMaxSuppression", {}, 11),
    ("nms-score-threshold", Op.NON_MAX_SUPPRESSION,
     [BOXES, SCORES, _i(5), np.array([0.0], np.float32), np.array([0.4], np.float32)],
     {}, "NonMaxSuppression", {}, 11),
    ("col2im", Op.COL2IM, [_n(2, 3 * 4, 12), _i(4, 5), _i(2, 2)], {}, "Col2Im", {}, 18),
    ("col2im-pads-strides", Op.COL2IM, [_n(1, 2 * 6, 6), _i(5, 6), _i(2, 3)],
     {"pads": (1, 0, 1, 2), "strides": (2, 2), "dilations": (1, 2)}, "Col2Im",
     {"pads": [1, 0, 1, 2], "strides": [2, 2], "dilations": [1, 2]}, 18),
    ("center_crop_pad", Op.CENTER_CROP_PAD, [_n(5, 4, 3), _i(3, 7)], {"axes": (0, 1)},
     "CenterCropPad", {"axes": [0, 1]}, 18),
    ("max_unpool", Op.MAX_UNPOOL, [_n(1, 1, 2, 2), np.array([[[[5, 7], [13, 15]]]])],
     {"kernel_shape": (2, 2), "strides": (2, 2)}, "MaxUnpool",
     {"kernel_shape": [2, 2], "strides": [2, 2]}, 22),
    ("deform_conv", Op.DEFORM_CONV,
     [_n(1, 4, 5, 5), _n(2, 2, 2, 2), _n(1, 2 * 4 * 2, 4, 4), _n(2), RNG.random((1, 8, 4, 4))
      .astype(np.float32)],
     {"group": 2, "offset_group": 2}, "DeformConv", {"group": 2, "offset_group": 2}, 22),
]


@pytest.mark.parametrize(("op", "inputs", "attrs", "onnx_op", "onnx_attrs", "opset"),
                         [pytest.param(*c[1:], id=c[0]) for c in ORACLE])
def test_kernels_match_onnx(op: Op, inputs: list[Any], attrs: dict[str, Any], onnx_op: str,
                            onnx_attrs: dict[str, Any], opset: int) -> None:
    expected = onnx_run(onnx_op, inputs, opset=opset, **onnx_attrs)
    assert_close(run_both(op, inputs, rtol=1e-5, atol=1e-5, **attrs), expected, 1e-5, 1e-5)


def test_nms_output_is_data_dependent() -> None:
    assert Op.NON_MAX_SUPPRESSION in OpGroup.DATA_DEPENDENT
    schema = get_schema(Op.NON_MAX_SUPPRESSION)
    out = schema.infer_types([TensorType(DType.FLOAT32, (1, 6, 4)),
                              TensorType(DType.FLOAT32, (1, 2, 6))], schema.normalize_attrs({}))
    assert out == [TensorType(DType.INT64, (None, 3))]
    (none,) = run_both(Op.NON_MAX_SUPPRESSION, [BOXES, SCORES])
    assert none.shape == (0, 3) and none.dtype == np.int64


def test_value_inputs_shape_inference() -> None:
    col = get_schema(Op.COL2IM)
    out = col.infer_types([TensorType(DType.FLOAT32, ("n", 12, 12)), None, None],
                          col.normalize_attrs({}), [None, _i(4, 5), _i(2, 2)])
    assert out == [TensorType(DType.FLOAT32, ("n", 3, 4, 5))]
    ag = get_schema(Op.AFFINE_GRID)
    out = ag.infer_types([TensorType(DType.FLOAT16, (2, 2, 3)), None], ag.normalize_attrs({}),
                         [None, _i(2, 1, 7, 9)])
    assert out == [TensorType(DType.FLOAT16, (2, 7, 9, 2))]
    assert col.value_inputs == (1, 2) and ag.value_inputs == (1,)


def test_grid_sample_16_modes_and_roi_align_10_import() -> None:
    got = keel_run("GridSample", [X4, GRID], opset=16, mode="bicubic")
    want = onnx_run("GridSample", [X4, GRID], opset=22, mode="cubic")
    assert_close(got, want, 1e-5, 1e-5)
    graph = import_onnx(onnx_model("RoiAlign", [X4, ROIS, _i(0, 1, 1)], opset=10))
    assert graph.nodes[0].attrs["coordinate_transformation_mode"] == "output_half_pixel"


def test_nms_runs_end_to_end() -> None:
    inputs = [BOXES, SCORES, _i(2), np.array([0.5], np.float32)]
    got = keel_run("NonMaxSuppression", inputs, opset=11)
    assert_close(got, onnx_run("NonMaxSuppression", inputs, opset=11))


@pytest.mark.parametrize(("op", "inputs", "attrs", "match"), [
    (Op.GRID_SAMPLE, [X4, GRID], {"mode": "bilinear"}, "mode must be one of linear, nearest"),
    (Op.GRID_SAMPLE, [X4, GRID], {"padding_mode": "wrap"}, "padding_mode must be one of zeros"),
    (Op.GRID_SAMPLE, [X4, GRID[..., :1]], {}, r"grid must have shape \(N, out_1..out_2, 2\)"),
    (Op.AFFINE_GRID, [_n(2, 2, 3), _i(2, 3, 4)], {}, r"size must be \(N, C, H, W\)"),
    (Op.AFFINE_GRID, [_n(2, 3, 4), _i(2, 3, 4, 5)], {}, r"theta must have shape \(2, 2, 3\)"),
    (Op.ROI_ALIGN, [X4, ROIS, _i(0, 5, 1)], {}, r"batch_indices\[1\] = 5 is not a batch index"),
    (Op.ROI_ALIGN, [X4, ROIS, _i(0, 0, 0)], {"mode": "min"}, "mode must be one of avg, max"),
    (Op.NON_MAX_SUPPRESSION, [BOXES, SCORES, _i(3), np.array([1.5], np.float32)], {},
     r"iou_threshold must be in \[0, 1\], got 1.5"),
    (Op.NON_MAX_SUPPRESSION, [BOXES, SCORES[:, :, :4]], {}, "scores must have shape"),
    (Op.COL2IM, [_n(1, 5, 12), _i(4, 5), _i(2, 2)], {}, r"input must have shape \(N, C \* 4"),
    (Op.COL2IM, [_n(1, 4, 12), _i(4, 5), _i(2, 2)], {"strides": (1,)},
     "strides must have 2 entries"),
    (Op.CENTER_CROP_PAD, [_n(3, 4), _i(2)], {}, "shape must hold one non-negative size per axis"),
    (Op.CENTER_CROP_PAD, [_n(3, 4), _i(2, 2)], {"axes": (1, -1)}, "repeat an axis"),
    (Op.MAX_UNPOOL, [_n(1, 1, 2, 2), _i(0, 1, 2, 99).reshape(1, 1, 2, 2)],
     {"kernel_shape": (2, 2), "strides": (2, 2)}, "index 99 is outside the unpooled tensor"),
    (Op.MAX_UNPOOL, [_n(1, 1, 2, 2), _i(0, 1, 2, 3).reshape(1, 1, 2, 2), _i(1, 1, 3, 3)],
     {"kernel_shape": (2, 2), "strides": (2, 2)}, "must have rank 4 and be at least"),
    (Op.DEFORM_CONV, [_n(1, 2, 5, 5), _n(2, 2, 3, 3), _n(1, 18, 2, 2)], {},
     r"offset must have shape \(1, 18, 3, 3\)"),
])
def test_typed_errors(op: Op, inputs: list[Any], attrs: dict[str, Any], match: str) -> None:
    for run in (run_ref, run_cpu):
        with pytest.raises(InvalidArgumentError, match=match):
            run(op, inputs, **attrs)


def test_deform_conv_3d_is_unsupported() -> None:
    with pytest.raises(UnsupportedOperationError, match="3-D deformable convolution"):
        run_cpu(Op.DEFORM_CONV, [_n(1, 1, 3, 3, 3), _n(1, 1, 2, 2, 2), _n(1, 24, 2, 2, 2)])
