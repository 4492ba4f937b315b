"""Resize: the schema's shape rule, reference and cpu kernels against ONNX's oracle."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._nrq_support import assert_close, onnx_run, run_both, run_cpu, run_ref

RNG = np.random.default_rng(5)
X = RNG.standard_normal((2, 3, 6, 8)).astype(np.float32)
ROI = np.array([0.0, 0.0, 0.2, -0.1, 1.0, 1.0, 0.9, 1.2], dtype=np.float32)
COORDS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
          "asymmetric", "tf_crop_and_resize")
# Scales whose products with the input dims are whole numbers: there ONNX's oracle (which
# uses the fractional length scale * in) and the specification (the integer length) agree.
SIZING = {
    "up": (np.array([1, 1, 2, 1.5], np.float32), None),
    "down": (np.array([1, 1, 0.5, 0.25], np.float32), None),
    "sizes": (None, np.array([2, 3, 4, 11], np.int64)),
}


def _resize_both(x: np.ndarray, roi: Any, scales: Any, sizes: Any,
                 **attrs: Any) -> list[np.ndarray]:
    tol = 2e-3 if x.dtype == np.float16 else 1e-5
    return run_both(Op.RESIZE, [x, roi, scales, sizes], rtol=tol, atol=tol, **attrs)


def _grid() -> list[Any]:
    params = []
    for mode, ctm, which in itertools.product(("nearest", "linear", "cubic"), COORDS, SIZING):
        options: list[dict[str, Any]]
        if mode == "nearest":
            options = [{"nearest_mode": nm} for nm in
                       ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")]
        else:
            options = [{"exclude_outside": ex, "antialias": aa}
                       for ex, aa in itertools.product((0, 1), (0, 1))]
        for opt in options:
            attrs = {"mode": mode, "coordinate_transformation_mode": ctm,
                     "extrapolation_value": -3.0, **opt}
            label = "-".join([mode, ctm, which, *(f"{k}={v}" for k, v in opt.items())])
            params.append(pytest.param(attrs, which, id=label))
    return params


@pytest.mark.parametrize(("attrs", "which"), _grid())
def test_matches_onnx_across_modes(attrs: dict[str, Any], which: str) -> None:
    scales, sizes = SIZING[which]
    roi = ROI if attrs["coordinate_transformation_mode"] == "tf_crop_and_resize" else None
    expected = onnx_run("Resize", [X, roi, scales, sizes], opset=19, **attrs)
    assert_close(_resize_both(X, roi, scales, sizes, **attrs), expected, rtol=1e-5, atol=1e-5)


ORACLE: list[tuple[str, list[Any], dict[str, Any]]] = [
    ("axes", [X, None, np.array([3, 0.5], np.float32), None],
     {"mode": "linear", "axes": [1, 3]}),
    ("axes-sizes", [X, None, None, np.array([5, 4], np.int64)],
     {"mode": "cubic", "axes": [3, 2]}),
    ("crop-axes", [X, np.array([0.1, 0.3, 0.9, 1.4], np.float32), None,
                   np.array([5, 3], np.int64)],
     {"mode": "linear", "axes": [2, 3], "coordinate_transformation_mode": "tf_crop_and_resize",
      "extrapolation_value": 9.0}),
    ("not-larger", [X, None, None, np.array([9, 9], np.int64)],
     {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"}),
    ("not-smaller", [X, None, None, np.array([9, 9], np.int64)],
     {"axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller"}),
    ("cubic-a", [X, None, np.array([1, 1, 1.5, 0.75], np.float32), None],
     {"mode": "cubic", "cubic_coeff_a": -0.5}),
    ("uint8-linear", [RNG.integers(0, 255, (1, 2, 4, 6)).astype(np.uint8), None,
                      np.array([1, 1, 1.5, 0.5], np.float32), None], {"mode": "linear"}),
    ("int32-nearest", [RNG.integers(-1000, 1000, (2, 5)).astype(np.int32), None,
                       np.array([1.5, 0.8], np.float32), None], {}),
    ("float64-cubic", [X.astype(np.float64), None, np.array([1, 1, 1.5, 0.5], np.float32),
                       None], {"mode": "cubic"}),
    ("1d-antialias", [RNG.standard_normal(20).astype(np.float32), None,
                      np.array([0.3], np.float32), None], {"mode": "linear", "antialias": 1}),
    ("empty-scales-input", [X, None, np.zeros(0, np.float32), np.array([1, 3, 3, 4])],
     {"mode": "linear"}),
]


@pytest.mark.parametrize(("inputs", "attrs"), [pytest.param(*c[1:], id=c[0]) for c in ORACLE])
def test_matches_onnx_options(inputs: list[Any], attrs: dict[str, Any]) -> None:
    onnx_inputs = [None if v is not None and v.size == 0 else v for v in inputs]
    expected = onnx_run("Resize", onnx_inputs, opset=19, **attrs)
    assert_close(_resize_both(*inputs, **attrs), expected, rtol=1e-5, atol=1e-5)


def test_negative_axes_count_from_the_back() -> None:
    # ONNX's oracle rejects negative axes: compare with the positive spelling instead.
    sizes = np.array([5, 4], np.int64)
    assert_close(_resize_both(X, None, None, sizes, mode="cubic", axes=[-1, -2]),
                 run_ref(Op.RESIZE, [X, None, None, sizes], mode="cubic", axes=[3, 2]))


def test_float16_matches_onnx_within_one_rounding() -> None:
    x = X.astype(np.float16)
    scales = np.array([1, 1, 1.5, 2], np.float32)
    expected = onnx_run("Resize", [x, None, scales], opset=19, mode="linear")
    assert_close(_resize_both(x, None, scales, None, mode="linear"), expected, rtol=2e-3,
                 atol=2e-3)


def test_align_corners_uses_the_integer_output_length() -> None:
    # 5 * 0.6 is 3.0000001 in float32; the specification's length_resized is 3.
    x = np.arange(5, dtype=np.float32)
    (y,) = _resize_both(x, None, np.array([0.6], np.float32), None, mode="nearest",
                        coordinate_transformation_mode="align_corners", nearest_mode="floor")
    np.testing.assert_array_equal(y, [0, 2, 4])


@pytest.mark.parametrize(("mode", "shape", "scale", "expected"), [
    ("linear", (2, 4), 0.6, [[1, 4]]),
    ("cubic", (4, 4), 0.8, [[1, 2.5, 4], [7, 8.5, 10], [13, 14.5, 16]]),
])
def test_align_corners_downsampling_matches_onnxruntime(mode: str, shape: tuple[int, int],
                                                        scale: float,
                                                        expected: list[list[float]]) -> None:
    # onnx's node cases test_resize_downsample_scales_{linear,cubic}_align_corners expect
    # the reference evaluator's numbers, which divide by the fractional scale * in (2.4,
    # 3.2); onnxruntime 1.31 and keel divide by the output length minus one (1, 2).
    x = np.arange(1, math.prod(shape) + 1, dtype=np.float32).reshape(shape)
    (y,) = _resize_both(x, None, np.array([scale, scale], np.float32), None, mode=mode,
                        coordinate_transformation_mode="align_corners")
    np.testing.assert_allclose(y, np.array(expected, np.float32), rtol=1e-6)


def test_pytorch_half_pixel_to_one_samples_the_first_element() -> None:
    x = RNG.standard_normal(6).astype(np.float32)
    (y,) = _resize_both(x, None, None, np.array([1]), mode="cubic",
                        coordinate_transformation_mode="pytorch_half_pixel")
    np.testing.assert_array_equal(y, x[:1])


def test_nearest_ignores_antialias() -> None:
    x = RNG.standard_normal((2, 9)).astype(np.float32)
    scales = np.array([1, 0.5], np.float32)
    plain = _resize_both(x, None, scales, None)
    assert_close(_resize_both(x, None, scales, None, antialias=1), plain)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_cpu_writes_into_out(mode: str) -> None:
    scales = np.array([1, 1, 2, 2], np.float32)
    expected = run_ref(Op.RESIZE, [X, None, scales], mode=mode)
    out = np.empty((2, 3, 12, 16), np.float32)
    (y,) = run_cpu(Op.RESIZE, [X, None, scales], out=[out], mode=mode)
    assert y is out
    assert_close([out], expected)


def test_cpu_rounds_integers_half_to_even() -> None:
    x = np.array([[0, 1, 2, 3]], dtype=np.uint8)
    # half_pixel 2x: (0, 1) interpolates to 0.25 and 0.75 of the way; 1.5 -> 2, 2.5 -> 2.
    (y,) = _resize_both(x, None, np.array([1, 2], np.float32), None, mode="linear",
                        coordinate_transformation_mode="align_corners")
    np.testing.assert_array_equal(y, np.rint(np.linspace(0, 3, 8)).astype(np.uint8)[None])


# ---- the shape rule -------------------------------------------------------------------


def _infer(shape: tuple[Any, ...], scales: Any = None, sizes: Any = None,
           **attrs: Any) -> TensorType | None:
    schema = get_schema(Op.RESIZE)
    values = [None, None, scales, sizes]
    return schema.infer_types([TensorType(DType.FLOAT32, shape), None, None, None],
                              schema.normalize_attrs(attrs), values)[0]


def test_infer_from_constant_scales_and_sizes() -> None:
    def shape(*args: Any, **attrs: Any) -> Any:
        t = _infer(*args, **attrs)
        return None if t is None else t.shape

    assert shape((1, 3, 5, 7), np.array([1, 1, 2, 0.5], np.float32)) == (1, 3, 10, 3)
    assert shape(("n", 3, 5, 7), sizes=np.array([8, 9]), axes=[2, 3]) == ("n", 3, 8, 9)
    assert shape((1, 3, 6, 4), sizes=np.array([5, 5]), axes=[2, 3],
                 keep_aspect_ratio_policy="not_larger") == (1, 3, 5, 3)
    assert shape((2, "h", 4), np.array([1, 2, 2], np.float32)) == (2, None, 8)


def test_infer_without_constants_keeps_the_rank() -> None:
    assert _infer((1, 3, 5, 7)) == TensorType(DType.FLOAT32, (None, None, None, None))
    assert _infer((1, 3, 5, 7), axes=[3]) == TensorType(DType.FLOAT32, (1, 3, 5, None))


def test_overflowing_output_is_an_invalid_argument() -> None:
    huge = np.array([1, 1, 1e30, 1], np.float32)
    with pytest.raises(InvalidArgumentError, match="overflows"):
        _infer((1, 3, 5, 7), huge)
    with pytest.raises(InvalidArgumentError, match="more than"):
        _infer((1024, 1024, 5, 7), np.array([1, 1, 2e8, 2e8], np.float32))
    with pytest.raises(InvalidArgumentError, match="overflows"):
        run_ref(Op.RESIZE, [X, None, huge])


# ---- errors ----------------------------------------------------------------------------

ERRORS: list[tuple[str, list[Any], dict[str, Any], str]] = [
    ("both", [X, None, np.ones(4, np.float32), np.array([1, 3, 6, 8])], {},
     "give scales or sizes, not both"),
    ("neither", [X], {}, "one of scales and sizes is required"),
    ("scales-length", [X, None, np.ones(3, np.float32)], {},
     r"scales must be 1-D with 4 entries \(one per resized axis\), got shape \(3,\)"),
    ("scales-zero", [X, None, np.array([1, 1, 0, 1], np.float32)], {},
     "scales must be finite and > 0"),
    ("scales-int", [X, None, np.array([1, 1, 2, 2])], {}, "scales must be a float tensor"),
    ("sizes-negative", [X, None, None, np.array([1, 3, -6, 8])], {}, "sizes must be >= 0"),
    ("crop-no-roi", [X, None, np.ones(4, np.float32)],
     {"coordinate_transformation_mode": "tf_crop_and_resize"},
     "tf_crop_and_resize needs the roi input"),
    ("roi-length", [X, np.zeros(3, np.float32), np.ones(4, np.float32)],
     {"coordinate_transformation_mode": "tf_crop_and_resize"}, "roi must be 1-D with 8"),
    ("mode", [X, None, np.ones(4, np.float32)], {"mode": "bilinear"},
     "mode 'bilinear' is not supported; allowed: nearest, linear, cubic"),
    ("ctm", [X, None, np.ones(4, np.float32)], {"coordinate_transformation_mode": "edge"},
     "coordinate_transformation_mode 'edge'"),
    ("nearest-mode", [X, None, np.ones(4, np.float32)], {"nearest_mode": "round"},
     "nearest_mode 'round'"),
    ("policy", [X, None, None, np.array([3, 3])], {"axes": [2, 3],
                                                  "keep_aspect_ratio_policy": "fit"},
     "keep_aspect_ratio_policy 'fit'"),
    ("axes-range", [X, None, np.ones(1, np.float32)], {"axes": [4]},
     "resize: axes entry 4 is out of range for rank 4"),
    ("axes-repeat", [X, None, np.ones(2, np.float32)], {"axes": [1, -3]}, "repeat an axis"),
    ("empty-axis", [np.zeros((0, 3), np.float32), None, None, np.array([2, 3])], {},
     "cannot resize an empty axis to size 2"),
    ("bool-linear", [np.ones((2, 2), bool), None, np.ones(2, np.float32)], {"mode": "linear"},
     "needs a numeric tensor"),
]


@pytest.mark.parametrize(("inputs", "attrs", "match"),
                         [pytest.param(*c[1:], id=c[0]) for c in ERRORS])
@pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
def test_typed_errors(run: Any, inputs: list[Any], attrs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        run(Op.RESIZE, inputs, **attrs)
