"""Conformance cases of the vision family.

grid_sample: every mode x padding mode x align_corners in 2-D, 1-D and 3-D,
grids reaching well outside [-1, 1], float16/float64. affine_grid 2-D/3-D.
roi_align: both coordinate modes, avg and max, fixed and adaptive sampling,
boxes partly off the map. non_max_suppression: both box formats, thresholds,
limits, several batches and classes. col2im (1-D to 3-D, pads, strides,
dilations, ints), center_crop_pad (crop, pad, both, axes), max_unpool (with
and without output_shape), deform_conv (groups, offset groups, mask, bias).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]
F16, F32, F64 = np.float16, np.float32, np.float64


def _tol(dtype: Any) -> dict[str, Any]:
    dt = np.dtype(dtype)
    if dt == np.float16:
        return {"rtol": 5e-3, "atol": 5e-3}
    if dt == np.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    return {"rtol": 1e-4, "atol": 1e-5}


def _grid(x: tuple[int, ...], out: tuple[int, ...], dtype: Any = F32) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        grid = rng.uniform(-1.4, 1.4, (x[0], *out, len(x) - 2))
        return [rng.standard_normal(x).astype(dtype), grid.astype(dtype)]
    return make


def _grid_sample_cases() -> list[OpCase]:
    op, cases = Op.GRID_SAMPLE, []
    for mode in ("linear", "nearest", "cubic"):
        for pad in ("zeros", "border", "reflection"):
            for align in (False, True):
                cases.append(OpCase(
                    f"grid_sample-{mode}-{pad}{'-align' if align else ''}", op,
                    _grid((2, 3, 5, 6), (4, 3)),
                    {"mode": mode, "padding_mode": pad, "align_corners": align}, **_tol(F32)))
    cases += [
        OpCase("grid_sample-1d", op, _grid((2, 2, 7), (5,)), {"padding_mode": "reflection"}),
        OpCase("grid_sample-3d-linear", op, _grid((1, 2, 3, 4, 5), (2, 3, 2)), **_tol(F32)),
        OpCase("grid_sample-3d-nearest-border", op, _grid((1, 2, 3, 4, 5), (2, 3, 2)),
               {"mode": "nearest", "padding_mode": "border"}),
        OpCase("grid_sample-f64-cubic", op, _grid((1, 2, 4, 4), (3, 3), F64), {"mode": "cubic"},
               **_tol(F64)),
        OpCase("grid_sample-f16", op, _grid((1, 2, 4, 4), (3, 3), F16), **_tol(F16)),
        OpCase("grid_sample-empty", op, _grid((2, 3, 4, 4), (0, 3))),
    ]
    return cases


def _affine_cases() -> list[OpCase]:
    op = Op.AFFINE_GRID

    def make(theta: tuple[int, ...], size: tuple[int, ...], dtype: Any = F32) -> Make:
        return lambda rng: [rng.standard_normal(theta).astype(dtype),
                            np.array(size, dtype=np.int64)]
    return [
        OpCase("affine_grid-2d", op, make((2, 2, 3), (2, 3, 4, 5))),
        OpCase("affine_grid-2d-align", op, make((2, 2, 3), (2, 3, 4, 1)), {"align_corners": 1}),
        OpCase("affine_grid-3d", op, make((1, 3, 4), (1, 1, 2, 3, 4))),
        OpCase("affine_grid-3d-align-f64", op, make((2, 3, 4), (2, 1, 3, 2, 2), F64),
               {"align_corners": 1}, **_tol(F64)),
    ]


def _roi(n: int, c: int, h: int, w: int, rois: int, dtype: Any = F32) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x1 = rng.uniform(-2, w, rois)
        y1 = rng.uniform(-2, h, rois)
        boxes = np.stack([x1, y1, x1 + rng.uniform(0, w, rois), y1 + rng.uniform(0, h, rois)],
                         axis=1)
        return [rng.standard_normal((n, c, h, w)).astype(dtype), boxes.astype(dtype),
                rng.integers(0, n, rois).astype(np.int64)]
    return make


def _roi_cases() -> list[OpCase]:
    op = Op.ROI_ALIGN
    base = {"output_height": 3, "output_width": 2}
    return [
        OpCase("roi_align-avg-adaptive", op, _roi(2, 3, 8, 9, 5), base),
        OpCase("roi_align-avg-ratio2-output-half", op, _roi(2, 3, 8, 9, 5),
               {**base, "sampling_ratio": 2, "coordinate_transformation_mode":
                "output_half_pixel", "spatial_scale": 0.5}),
        OpCase("roi_align-max", op, _roi(1, 2, 6, 6, 4), {**base, "mode": "max"}),
        OpCase("roi_align-max-ratio1", op, _roi(1, 2, 6, 6, 4),
               {"mode": "max", "sampling_ratio": 1, "output_height": 2, "output_width": 2}),
        OpCase("roi_align-f64", op, _roi(1, 2, 5, 5, 3, F64), base, **_tol(F64)),
        OpCase("roi_align-no-rois", op, _roi(1, 2, 5, 5, 0), base),
    ]


def _nms(batches: int, classes: int, boxes: int, center: bool, extras: tuple[Any, ...]) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        xy = rng.uniform(0, 10, (batches, boxes, 2))
        wh = rng.uniform(0.5, 4, (batches, boxes, 2))
        if center:
            b = np.concatenate([xy, wh], axis=2)
        else:
            b = np.concatenate([xy, xy + wh], axis=2)[..., [1, 0, 3, 2]]
            b[:, ::3] = b[:, ::3][..., [2, 3, 0, 1]]     # some boxes with flipped corners
        scores = rng.random((batches, classes, boxes))
        if boxes > 1:
            scores[:, :, 1] = scores[:, :, 0]             # a tie: the lower index wins
        ins: list[np.ndarray | None] = [b.astype(F32), scores.astype(F32)]
        ins += [None if e is None else np.array(e, dtype=np.int64 if i == 0 else F32)
                for i, e in enumerate(extras)]
        return ins
    return make


def _nms_cases() -> list[OpCase]:
    op = Op.NON_MAX_SUPPRESSION
    return [
        OpCase("nms-corners", op, _nms(2, 3, 12, False, ([5], [0.3]))),
        OpCase("nms-center", op, _nms(1, 2, 15, True, ([10], [0.5], [0.2])),
               {"center_point_box": 1}),
        OpCase("nms-zero-iou", op, _nms(1, 1, 10, False, ([100], [0.0]))),
        OpCase("nms-no-limit", op, _nms(1, 1, 6, False, ())),
        OpCase("nms-no-boxes", op, _nms(1, 2, 0, False, ([3], [0.5]))),
    ]


def _col2im(x: tuple[int, ...], image: tuple[int, ...], block: tuple[int, ...],
            dtype: Any = F32) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        data = rng.standard_normal(x) if np.dtype(dtype).kind == "f" \
            else rng.integers(-9, 9, x)
        return [data.astype(dtype), np.array(image, np.int64), np.array(block, np.int64)]
    return make


def _block_cases() -> list[OpCase]:
    col, ccp, mu = Op.COL2IM, Op.CENTER_CROP_PAD, Op.MAX_UNPOOL
    cases = [
        OpCase("col2im-2d", col, _col2im((2, 2 * 4, 12), (4, 5), (2, 2))),
        OpCase("col2im-2d-pads-strides-dil", col, _col2im((1, 3 * 6, 6), (5, 6), (2, 3)),
               {"pads": [1, 0, 1, 2], "strides": [2, 2], "dilations": [1, 2]}),
        OpCase("col2im-1d", col, _col2im((2, 3, 6), (8,), (3,))),
        OpCase("col2im-3d-int32", col, _col2im((1, 8, 8), (3, 3, 3), (2, 2, 2), np.int32)),
        OpCase("col2im-f64", col, _col2im((1, 4, 9), (4, 4), (2, 2), F64), **_tol(F64)),
    ]

    def crop(x: tuple[int, ...], shape: tuple[int, ...], dtype: Any = F32) -> Make:
        return lambda rng: [rng.standard_normal(x).astype(dtype), np.array(shape, np.int64)]
    cases += [
        OpCase("center_crop_pad-crop", ccp, crop((5, 7, 3), (3, 4, 3))),
        OpCase("center_crop_pad-pad", ccp, crop((2, 3, 3), (5, 4, 3))),
        OpCase("center_crop_pad-both-axes", ccp, crop((6, 4, 3), (3, 7)), {"axes": [0, -2]}),
        OpCase("center_crop_pad-int64", ccp, lambda rng: [rng.integers(0, 9, (4, 5)),
                                                          np.array([3, 8], np.int64)]),
    ]

    def unpool(x: tuple[int, ...], kernel: int, out: tuple[int, ...] | None = None) -> Make:
        def make(rng: Gen) -> list[np.ndarray | None]:
            n, c, h, w = x
            oh, ow = h * kernel, w * kernel
            dy, dx = rng.integers(0, kernel, (2, n, c, h, w))
            rows = np.arange(h)[:, None] * kernel + dy
            cols = np.arange(w)[None, :] * kernel + dx
            plane = np.arange(n * c).reshape(n, c, 1, 1) * oh * ow
            ins: list[np.ndarray | None] = [rng.standard_normal(x).astype(F32),
                                            (plane + rows * ow + cols).astype(np.int64)]
            if out is not None:
                ins.append(np.array(out, np.int64))
            return ins
        return make
    cases += [
        OpCase("max_unpool-2x2", mu, unpool((2, 3, 3, 4), 2),
               {"kernel_shape": [2, 2], "strides": [2, 2]}),
        OpCase("max_unpool-output-shape", mu, unpool((1, 2, 2, 2), 2, (1, 2, 5, 6)),
               {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ]
    return cases


def _deform(n: int, c: int, m: int, hw: tuple[int, int], k: int, group: int, og: int,
            out: tuple[int, int], mask: bool, bias: bool, dtype: Any = F32) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        ins: list[np.ndarray | None] = [
            rng.standard_normal((n, c, *hw)).astype(dtype),
            rng.standard_normal((m, c // group, k, k)).astype(dtype),
            (rng.standard_normal((n, og * k * k * 2, *out)) * 1.5).astype(dtype),
            rng.standard_normal(m).astype(dtype) if bias else None,
            rng.random((n, og * k * k, *out)).astype(dtype) if mask else None]
        while ins[-1] is None:
            ins.pop()
        return ins
    return make


def _deform_cases() -> list[OpCase]:
    op = Op.DEFORM_CONV
    return [
        OpCase("deform_conv-basic", op, _deform(1, 2, 3, (5, 5), 3, 1, 1, (3, 3), False, False)),
        OpCase("deform_conv-pads-stride-mask-bias", op,
               _deform(2, 4, 4, (6, 7), 3, 2, 2, (3, 4), True, True),
               {"pads": [1, 1, 1, 1], "strides": [2, 2], "group": 2, "offset_group": 2}),
        OpCase("deform_conv-dilated", op, _deform(1, 2, 2, (7, 7), 2, 1, 1, (5, 5), True, False),
               {"dilations": [2, 2]}),
        OpCase("deform_conv-f64", op, _deform(1, 2, 2, (4, 4), 2, 1, 2, (3, 3), True, True, F64),
               {"offset_group": 2}, **_tol(F64)),
    ]


CASES: list[OpCase] = (_grid_sample_cases() + _affine_cases() + _roi_cases() + _nms_cases()
                       + _block_cases() + _deform_cases())
