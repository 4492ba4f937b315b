"""Conformance cases of Resize (ONNX Resize-19).

Covered: every mode with every coordinate transformation, every nearest
rounding, antialiasing, ``exclude_outside``, ``tf_crop_and_resize`` with
extrapolation, ``axes``, ``sizes`` with each ``keep_aspect_ratio_policy``,
the whole-factor fast paths (2x nearest, 2x bilinear of NCHW), identity axes,
integer, float16 and float64 data, zero-size tensors and non-contiguous input.
Integer data is only interpolated where the weights are exact (2x linear), so
both kernels round the same ties.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

F32 = np.float32
_COORDS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
           "asymmetric", "tf_crop_and_resize")
_ROI = np.array([0.0, 0.0, 0.1, -0.2, 1.0, 1.0, 0.8, 1.1], dtype=F32)


def _f(*values: float) -> np.ndarray:
    return np.array(values, dtype=F32)


def _i(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _x(shape: tuple[int, ...], dtype: Any = F32, roi: np.ndarray | None = None,
       scales: np.ndarray | None = None, sizes: np.ndarray | None = None,
       view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    """Random X (integers in their dtype's small range) and the fixed roi/scales/sizes."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        dt = np.dtype(dtype)
        if dt.kind in "iu":
            x = rng.integers(0 if dt.kind == "u" else -100, 100, size=shape).astype(dt)
        elif dt.kind == "b":
            x = rng.random(shape) < 0.5
        else:
            x = rng.uniform(-3.0, 3.0, shape).astype(dt)
        return [x if view is None else view(x), roi, scales, sizes]
    return make


def _tol(dtype: Any = F32) -> dict[str, Any]:
    dt = np.dtype(dtype)
    if dt == np.float16:
        return {"rtol": 5e-3, "atol": 5e-3}
    if dt == np.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    return {"rtol": 1e-5, "atol": 1e-5}


def _grid() -> list[OpCase]:
    """mode x coordinate transformation, upsampling and downsampling, fractional ratios."""
    cases = []
    for mode in ("nearest", "linear", "cubic"):
        for ctm in _COORDS:
            roi = _ROI if ctm == "tf_crop_and_resize" else None
            attrs = {"mode": mode, "coordinate_transformation_mode": ctm,
                     "extrapolation_value": -7.0}
            cases.append(OpCase(f"resize-{mode}-{ctm}-up", Op.RESIZE,
                                _x((2, 3, 5, 6), roi=roi, scales=_f(1, 1, 2, 1.5)), attrs,
                                **_tol()))
            cases.append(OpCase(f"resize-{mode}-{ctm}-down", Op.RESIZE,
                                _x((2, 3, 9, 8), roi=roi, sizes=_i(2, 3, 4, 3)), attrs,
                                **_tol()))
    return cases


def _nearest_modes() -> list[OpCase]:
    return [OpCase(f"resize-nearest-{nm}-{ctm}", Op.RESIZE,
                   _x((1, 2, 7, 5), scales=_f(1, 1, 1.7, 0.6)),
                   {"mode": "nearest", "nearest_mode": nm,
                    "coordinate_transformation_mode": ctm}, **_tol())
            for nm in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
            for ctm in ("half_pixel", "asymmetric", "align_corners")]


def _options() -> list[OpCase]:
    linear, cubic = {"mode": "linear"}, {"mode": "cubic"}
    return [
        OpCase("resize-linear-antialias-down", Op.RESIZE, _x((2, 2, 12, 10), scales=_f(
            1, 1, 0.4, 0.3)), {**linear, "antialias": True}, **_tol()),
        OpCase("resize-cubic-antialias-down", Op.RESIZE, _x((2, 2, 12, 10), sizes=_i(
            2, 2, 5, 3)), {**cubic, "antialias": True}, **_tol()),
        OpCase("resize-linear-antialias-up", Op.RESIZE, _x((1, 2, 4, 4), scales=_f(
            1, 1, 2, 3)), {**linear, "antialias": True}, **_tol()),
        OpCase("resize-cubic-exclude-outside", Op.RESIZE, _x((1, 2, 5, 6), scales=_f(
            1, 1, 2.5, 0.5)), {**cubic, "exclude_outside": True}, **_tol()),
        OpCase("resize-cubic-a-0.5", Op.RESIZE, _x((1, 1, 6, 6), scales=_f(1, 1, 1.5, 1.5)),
               {**cubic, "cubic_coeff_a": -0.5}, **_tol()),
        OpCase("resize-linear-axes", Op.RESIZE, _x((2, 5, 3, 4), scales=_f(0.5, 2.5)),
               {**linear, "axes": (-1, 0)}, **_tol()),
        OpCase("resize-crop-axes", Op.RESIZE, _x((2, 6, 5), roi=_f(0.2, -0.3, 0.7, 1.2),
                                                  sizes=_i(4, 7)),
               {**linear, "axes": (1, 2), "coordinate_transformation_mode":
                "tf_crop_and_resize", "extrapolation_value": 2.5}, **_tol()),
        OpCase("resize-not-larger", Op.RESIZE, _x((1, 3, 6, 4), sizes=_i(5, 5)),
               {**linear, "axes": (2, 3), "keep_aspect_ratio_policy": "not_larger"}, **_tol()),
        OpCase("resize-not-smaller", Op.RESIZE, _x((1, 3, 6, 4), sizes=_i(5, 5)),
               {"axes": (2, 3), "keep_aspect_ratio_policy": "not_smaller"}, **_tol()),
        OpCase("resize-identity", Op.RESIZE, _x((2, 3, 4), scales=_f(1, 1, 1)), linear,
               **_tol()),
        OpCase("resize-1d", Op.RESIZE, _x((9,), scales=_f(0.7)), cubic, **_tol()),
        OpCase("resize-5d", Op.RESIZE, _x((1, 2, 3, 4, 2), scales=_f(1, 1, 2, 0.5, 1.5)),
               linear, **_tol()),
        OpCase("resize-tf-half-pixel-for-nn", Op.RESIZE, _x((1, 1, 5, 4), scales=_f(
            1, 1, 1.6, 2)), {"coordinate_transformation_mode": "tf_half_pixel_for_nn"},
            **_tol()),
    ]


def _fast_paths_and_dtypes() -> list[OpCase]:
    up2 = _f(1, 1, 2, 2)
    cases = [
        OpCase("resize-nearest-2x", Op.RESIZE, _x((2, 8, 16, 16), scales=up2), **_tol()),
        OpCase("resize-nearest-3x-asymmetric", Op.RESIZE, _x((1, 4, 5, 6), scales=_f(
            1, 1, 3, 1)), {"coordinate_transformation_mode": "asymmetric",
                           "nearest_mode": "floor"}, **_tol()),
        OpCase("resize-linear-2x", Op.RESIZE, _x((2, 8, 16, 16), scales=up2),
               {"mode": "linear"}, **_tol()),
        OpCase("resize-linear-2x-align-corners", Op.RESIZE, _x((1, 4, 6, 7), scales=up2),
               {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
               **_tol()),
        OpCase("resize-cubic-2x", Op.RESIZE, _x((1, 4, 8, 8), scales=up2),
               {"mode": "cubic"}, **_tol()),
    ]
    floats: tuple[Any, ...] = (np.float16, np.float64)
    for fdt in floats:
        for mode in ("nearest", "linear", "cubic"):
            cases.append(OpCase(f"resize-{mode}-{np.dtype(fdt).name}", Op.RESIZE,
                                _x((1, 2, 5, 4), fdt, scales=_f(1, 1, 1.6, 2.5)),
                                {"mode": mode}, **_tol(fdt)))
    ints: tuple[Any, ...] = (np.uint8, np.int8, np.int32, np.int64, np.uint16)
    for idt in ints:
        name = np.dtype(idt).name
        cases.append(OpCase(f"resize-nearest-{name}", Op.RESIZE,
                            _x((1, 2, 5, 4), idt, scales=_f(1, 1, 1.6, 0.5))))
        cases.append(OpCase(f"resize-linear-2x-{name}", Op.RESIZE,
                            _x((1, 2, 5, 4), idt, scales=up2), {"mode": "linear"}))
    cases.append(OpCase("resize-nearest-bool", Op.RESIZE,
                        _x((2, 3, 4), np.bool_, sizes=_i(3, 5, 2))))
    return cases


def _edges() -> list[OpCase]:
    return [
        OpCase("resize-empty-batch", Op.RESIZE, _x((0, 2, 3, 3), scales=_f(1, 1, 2, 2)),
               {"mode": "linear"}),
        OpCase("resize-empty-output", Op.RESIZE, _x((1, 2, 1, 3), scales=_f(1, 1, 0.5, 2)),
               {"mode": "cubic"}),
        OpCase("resize-to-one", Op.RESIZE, _x((1, 1, 6, 5), sizes=_i(1, 1, 1, 1)),
               {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
               **_tol()),
        OpCase("resize-from-one", Op.RESIZE, _x((1, 1, 1, 1), scales=_f(1, 1, 3, 4)),
               {"mode": "cubic"}, **_tol()),
        OpCase("resize-scales-empty-sizes", Op.RESIZE,
               lambda rng: [rng.uniform(-1, 1, (1, 2, 3, 4)).astype(F32), None,
                            np.zeros((0,), F32), _i(1, 2, 5, 7)], {"mode": "linear"},
               **_tol()),
        OpCase("resize-nc", Op.RESIZE, _x((6, 5, 2, 3), scales=_f(1, 1, 1.5, 2),
                                          view=lambda x: x.transpose(2, 3, 1, 0)),
               {"mode": "linear"}, **_tol()),
        OpCase("resize-nc-nearest-2x", Op.RESIZE, _x((6, 5, 2, 3), scales=_f(1, 1, 2, 2),
                                                     view=lambda x: x.transpose(2, 3, 1, 0))),
    ]


CASES: list[OpCase] = [*_grid(), *_nearest_modes(), *_options(), *_fast_paths_and_dtypes(),
                       *_edges()]
