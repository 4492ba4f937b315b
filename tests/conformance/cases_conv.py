"""Conformance cases of the conv family: conv, conv2d, conv_transpose, conv_integer.

``conv`` cases cover 1-D, 2-D and 3-D inputs, padding (explicit, asymmetric,
``SAME_UPPER``/``SAME_LOWER``/``VALID``), strides, dilations, groups and
depthwise convs (with a channel multiplier), 1x1 convs, 3x3 convs large
enough for the cpu backend's Winograd variant, every fused activation, the
residual input Z, batch > 1, zero-size batches, non-contiguous inputs and
float16/32/64, and shapes that take each layout of the cpu variants (compact
and wide im2col columns, the depthwise formulations). Tolerances grow with
the dtype's precision and the number of terms per output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

F16, F32, F64 = np.float16, np.float32, np.float64
_TOL: dict[Any, dict[str, float]] = {
    F16: {"rtol": 5e-3, "atol": 5e-2},
    F32: {"rtol": 1e-4, "atol": 1e-4},
    F64: {"rtol": 1e-9, "atol": 1e-9},
}


def _arrays(*shapes: Sequence[int] | None, dtype: Any = F32,
            view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    """Normal random arrays of ``shapes`` (None: an absent input); ``view`` applies to X."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        out: list[np.ndarray | None] = [
            None if s is None else rng.standard_normal(tuple(s)).astype(dtype) for s in shapes]
        if view is not None and out[0] is not None:
            out[0] = view(out[0])
        return out
    return make


def _conv(id: str, x: Sequence[int], w: Sequence[int], b: bool = True,
          z: Sequence[int] | None = None, dtype: Any = F32, op: Op = Op.CONV,
          view: Callable[[np.ndarray], np.ndarray] | None = None, **attrs: Any) -> OpCase:
    shapes: list[Sequence[int] | None] = [x, w]
    m = w[1] * attrs.get("group", 1) if op is Op.CONV_TRANSPOSE else w[0]
    if b or z is not None:
        shapes.append((m,) if b else None)
    if z is not None:
        shapes.append(z)
    tol = dict(_TOL[dtype])
    if attrs.get("activation") in ("gelu",) and dtype == F64:
        tol = {"rtol": 1e-6, "atol": 1e-6}      # the cpu gelu is accurate to ~2e-7
    return OpCase(id, op, _arrays(*shapes, dtype=dtype, view=view), attrs, **tol)


_ACTIVATIONS: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("relu", ()), ("leaky_relu", (0.1,)), ("sigmoid", ()), ("tanh", ()), ("clip", (-0.5, 6.0)),
    ("hard_sigmoid", (0.25, 0.4)), ("hard_swish", ()), ("gelu", ()), ("gelu_tanh", ()),
    ("silu", ()),
)

_P1 = (1, 1, 1, 1)

CASES: list[OpCase] = [
    # ---- 2-D, dense ----
    _conv("conv-3x3-pad1-f32", (2, 4, 9, 9), (6, 4, 3, 3), pads=_P1),
    _conv("conv-3x3-pad1-f64", (2, 4, 9, 9), (6, 4, 3, 3), dtype=F64, pads=_P1),
    _conv("conv-3x3-pad1-f16", (1, 3, 7, 7), (4, 3, 3, 3), dtype=F16, pads=_P1),
    _conv("conv-3x3-nobias", (1, 3, 8, 7), (5, 3, 3, 3), b=False),
    _conv("conv-3x3-asym-pads-stride2", (2, 3, 11, 10), (4, 3, 3, 3), pads=(0, 1, 2, 1),
          strides=(2, 2)),
    _conv("conv-5x3-dilated", (1, 3, 12, 11), (4, 3, 5, 3), pads=(2, 1, 2, 1),
          dilations=(2, 1)),
    _conv("conv-7x7-stride2-stem", (1, 3, 20, 20), (8, 3, 7, 7), pads=(3, 3, 3, 3),
          strides=(2, 2)),
    _conv("conv-kernel-shape-attr", (1, 2, 6, 6), (3, 2, 3, 3), kernel_shape=(3, 3)),
    # 3x3 stride 1 with >= 64 channels and >= 14x14 outputs: the cpu default is Winograd.
    _conv("conv-winograd-64ch-f32", (1, 64, 14, 14), (64, 64, 3, 3), pads=_P1,
          activation="relu"),
    _conv("conv-winograd-64ch-odd-f64", (2, 64, 15, 13), (64, 64, 3, 3), dtype=F64,
          pads=(1, 0, 1, 2)),
    _conv("conv-winograd-residual", (1, 64, 14, 14), (64, 64, 3, 3), z=(1, 64, 14, 14),
          pads=_P1, activation="relu"),
    # A batch of 7x7 outputs: Winograd at batch 8 (enough tiles), im2col at batch 1.
    _conv("conv-winograd-batched-7x7", (8, 64, 7, 7), (64, 64, 3, 3), pads=_P1,
          activation="relu"),
    # >= 64 output channels: compact im2col columns (the GEMM writes Y itself).
    _conv("conv-im2col-compact-stride2", (2, 16, 15, 15), (64, 16, 3, 3), pads=_P1,
          strides=(2, 2), z=(2, 64, 8, 8), activation="relu"),
    # 32x32 outputs: 1024-float rows, padded so that BLAS panels do not collide.
    _conv("conv-im2col-4kib-rows", (2, 4, 32, 32), (8, 4, 3, 3), pads=_P1),
    # ---- 1x1 ----
    _conv("conv-1x1", (2, 8, 7, 6), (16, 8, 1, 1)),
    _conv("conv-1x1-fewer-out", (2, 16, 5, 5), (4, 16, 1, 1)),
    _conv("conv-1x1-stride2", (1, 8, 9, 9), (12, 8, 1, 1), strides=(2, 2)),
    _conv("conv-1x1-groups", (2, 8, 5, 5), (6, 4, 1, 1), group=2),
    _conv("conv-1x1-f64", (1, 8, 5, 5), (16, 8, 1, 1), dtype=F64),
    # ---- grouped and depthwise ----
    _conv("conv-groups2", (2, 6, 8, 8), (4, 3, 3, 3), pads=_P1, group=2),
    _conv("conv-groups3-dilated", (1, 6, 10, 10), (6, 2, 3, 3), pads=(2, 2, 2, 2),
          dilations=(2, 2), group=3),
    _conv("conv-depthwise-3x3", (2, 8, 9, 9), (8, 1, 3, 3), pads=_P1, group=8),
    _conv("conv-depthwise-3x3-stride2", (1, 8, 10, 9), (8, 1, 3, 3), pads=(1, 1, 0, 1),
          strides=(2, 2), group=8, activation="clip", activation_params=(0.0, 6.0)),
    _conv("conv-depthwise-multiplier2", (1, 4, 7, 7), (8, 1, 3, 3), pads=_P1, group=4),
    _conv("conv-depthwise-5x5-dilated", (1, 4, 12, 12), (4, 1, 5, 5), pads=(4, 4, 4, 4),
          dilations=(2, 2), group=4),
    _conv("conv-depthwise-f64", (1, 6, 7, 8), (6, 1, 3, 3), dtype=F64, pads=_P1, group=6),
    _conv("conv-depthwise-f16", (1, 4, 6, 6), (4, 1, 3, 3), dtype=F16, pads=_P1, group=4),
    # Many channels on small planes: the channels-last einsum (stride 1 and 2).
    _conv("conv-depthwise-channels-last", (2, 192, 7, 7), (192, 1, 3, 3), pads=_P1,
          group=192, z=(2, 192, 7, 7)),
    _conv("conv-depthwise-channels-last-stride2", (1, 256, 9, 9), (256, 1, 3, 3),
          pads=_P1, strides=(2, 2), group=256, activation="clip",
          activation_params=(0.0, 6.0)),
    # A batch of large planes: one multiply-add per tap.
    _conv("conv-depthwise-planes-batched", (2, 3, 56, 56), (3, 1, 3, 3), pads=_P1, group=3),
    # ---- auto_pad ----
    _conv("conv-same-upper-stride2", (1, 3, 8, 7), (4, 3, 4, 4), auto_pad="SAME_UPPER",
          strides=(2, 2)),
    _conv("conv-same-lower-stride2", (1, 3, 8, 7), (4, 3, 3, 3), auto_pad="SAME_LOWER",
          strides=(2, 2)),
    _conv("conv-valid", (1, 3, 8, 7), (4, 3, 3, 2), auto_pad="VALID"),
    # ---- other ranks ----
    _conv("conv1d", (2, 3, 17), (4, 3, 3), pads=(1, 1), strides=(2,)),
    _conv("conv1d-depthwise", (2, 4, 12), (4, 1, 5), pads=(2, 2), group=4),
    _conv("conv3d", (1, 2, 5, 6, 7), (3, 2, 3, 3, 3), pads=(1, 1, 1, 1, 1, 1),
          strides=(1, 2, 1)),
    _conv("conv3d-depthwise", (1, 3, 4, 5, 6), (3, 1, 2, 3, 3), pads=(0, 1, 1, 1, 1, 1),
          group=3),
    _conv("conv1d-dilated-residual-relu", (2, 4, 15), (6, 4, 3), z=(2, 6, 12),
          pads=(1, 0), dilations=(2,), activation="relu"),
    _conv("conv1d-f16", (1, 3, 12), (4, 3, 3), dtype=F16, pads=(1, 1)),
    _conv("conv3d-groups-residual-silu", (2, 4, 4, 5, 5), (6, 2, 2, 3, 3), z=(2, 6, 4, 2, 1),
          pads=(0, 1, 0, 1, 0, 0), strides=(1, 2, 2), dilations=(1, 1, 2), group=2,
          activation="silu"),
    _conv("conv3d-f16", (1, 2, 4, 4, 4), (3, 2, 3, 3, 3), dtype=F16, pads=(1,) * 6),
    # ---- epilogue: residual, activations ----
    _conv("conv-residual", (2, 4, 6, 6), (5, 4, 3, 3), z=(2, 5, 6, 6), pads=_P1),
    _conv("conv-residual-nobias", (1, 4, 6, 6), (5, 4, 3, 3), b=False, z=(1, 5, 6, 6),
          pads=_P1, activation="relu"),
    *[_conv(f"conv-act-{name}", (1, 4, 6, 6), (5, 4, 3, 3), pads=_P1, activation=name,
            activation_params=params) for name, params in _ACTIVATIONS],
    _conv("conv-act-gelu-f64", (1, 4, 6, 6), (5, 4, 3, 3), dtype=F64, pads=_P1,
          activation="gelu"),
    # ---- zero-size and non-contiguous ----
    _conv("conv-empty-batch", (0, 3, 6, 6), (4, 3, 3, 3), pads=_P1),
    _conv("conv-empty-channels", (1, 0, 6, 6), (4, 0, 3, 3), pads=_P1),
    _conv("conv-nc-transposed", (1, 4, 9, 8), (5, 4, 3, 3), pads=_P1,
          view=lambda x: np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)),
    _conv("conv-nc-channel-slice", (1, 8, 7, 7), (5, 4, 3, 3), pads=_P1,
          view=lambda x: x[:, ::2]),
    # ---- seed-001 conv2d ----
    _conv("conv2d-basic", (1, 3, 8, 8), (4, 3, 3, 3), b=False, op=Op.CONV2D),
    _conv("conv2d-padding-stride", (2, 3, 9, 8), (4, 3, 3, 3), b=False, op=Op.CONV2D,
          padding=1, stride=2),
    _conv("conv2d-pad-hw-dilation-groups", (1, 4, 10, 9), (6, 2, 3, 3), b=False,
          op=Op.CONV2D, padding=(2, 1), dilation=2, groups=2),
    _conv("conv2d-f64", (1, 3, 6, 6), (2, 3, 3, 3), b=False, op=Op.CONV2D, dtype=F64,
          padding=(1, 0, 1, 2)),
    # ---- conv_transpose ----
    _conv("conv-transpose-basic", (1, 3, 4, 5), (3, 2, 3, 3), op=Op.CONV_TRANSPOSE),
    _conv("conv-transpose-stride-pads-outpad", (2, 3, 4, 5), (3, 2, 3, 3),
          op=Op.CONV_TRANSPOSE, strides=(2, 3), pads=(1, 0, 1, 1), output_padding=(1, 2)),
    _conv("conv-transpose-groups", (1, 4, 5, 5), (4, 3, 3, 3), op=Op.CONV_TRANSPOSE,
          group=2, strides=(2, 2)),
    _conv("conv-transpose-dilated", (1, 3, 4, 5), (3, 2, 3, 2), b=False,
          op=Op.CONV_TRANSPOSE, dilations=(2, 2), strides=(2, 1)),
    _conv("conv-transpose-output-shape", (1, 3, 4, 5), (3, 2, 3, 3), op=Op.CONV_TRANSPOSE,
          strides=(2, 2), output_shape=(9, 10)),
    _conv("conv-transpose-output-shape-past-full", (1, 1, 3, 3), (1, 2, 3, 3),
          op=Op.CONV_TRANSPOSE, strides=(3, 2), output_shape=(10, 8)),
    _conv("conv-transpose-same-upper", (1, 3, 4, 5), (3, 2, 3, 3), op=Op.CONV_TRANSPOSE,
          strides=(2, 2), auto_pad="SAME_UPPER"),
    _conv("conv-transpose-same-lower", (1, 3, 4, 5), (3, 2, 4, 4), op=Op.CONV_TRANSPOSE,
          strides=(2, 2), auto_pad="SAME_LOWER"),
    _conv("conv-transpose-1d", (2, 3, 6), (3, 4, 3), op=Op.CONV_TRANSPOSE, strides=(2,)),
    _conv("conv-transpose-3d", (1, 2, 3, 4, 3), (2, 2, 2, 2, 2), op=Op.CONV_TRANSPOSE,
          strides=(2, 1, 2)),
    _conv("conv-transpose-f64", (1, 3, 4, 4), (3, 2, 3, 3), op=Op.CONV_TRANSPOSE, dtype=F64,
          strides=(2, 2), pads=_P1),
    _conv("conv-transpose-f16", (1, 2, 3, 3), (2, 2, 3, 3), op=Op.CONV_TRANSPOSE, dtype=F16),
]


def _conv_integer(id: str, x: tuple[int, ...], w: tuple[int, ...], x_type: Any, w_type: Any,
                  zero_points: str, **attrs: Any) -> OpCase:
    def make(rng: Gen) -> list[np.ndarray | None]:
        def draw(shape: Sequence[int], dtype: Any) -> np.ndarray:
            info = np.iinfo(dtype)
            return rng.integers(info.min, info.max, size=tuple(shape), endpoint=True,
                                dtype=dtype)
        xs, ws = draw(x, x_type), draw(w, w_type)
        if zero_points == "none":
            return [xs, ws]
        wz = (w[0],) if zero_points == "per-channel" else ()
        return [xs, ws, draw((), x_type), draw(wz, w_type)]
    return OpCase(id, Op.CONV_INTEGER, make, attrs)


CASES += [
    _conv_integer("conv-integer-u8-i8", (1, 3, 6, 6), (4, 3, 3, 3), np.uint8, np.int8,
                  "scalar", pads=_P1),
    _conv_integer("conv-integer-u8-u8-per-channel", (2, 4, 5, 5), (6, 2, 3, 3), np.uint8,
                  np.uint8, "per-channel", group=2, strides=(2, 2)),
    _conv_integer("conv-integer-no-zero-point", (1, 2, 5, 5), (3, 2, 1, 1), np.int8, np.int8,
                  "none"),
    _conv_integer("conv-integer-deep", (1, 64, 6, 6), (4, 64, 3, 3), np.uint8, np.int8,
                  "scalar", pads=_P1),       # 576 terms: the exact float64 path
    _conv_integer("conv-integer-depthwise", (1, 4, 6, 6), (4, 1, 3, 3), np.int8, np.int8,
                  "per-channel", pads=_P1, group=4),
]
