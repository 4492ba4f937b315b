"""Schemas of the signal family: DFT, STFT, window functions and the mel filter bank.

Complex tensors are real tensors with a trailing axis of 2 (real, imaginary);
a real signal may carry a trailing axis of 1 instead. Following ONNX:

* ``dft`` — DFT-20: inputs ``input``, ``[dft_length]``, ``[axis]`` (scalars;
  ``axis`` defaults to -2 and may not be the trailing complex axis). Forward
  transforms are unnormalized, inverse ones divide by the length.
  ``onesided`` keeps the ``n // 2 + 1`` non-negative frequencies of a forward
  transform; with ``inverse`` it takes such a half spectrum and returns the real
  signal (trailing axis 1, length ``dft_length``, default ``2 * (bins - 1)``).
* ``stft`` — STFT-17: ``signal`` (B, length, 1 or 2), ``frame_step``,
  ``[window]``, ``[frame_length]`` → (B, frames, bins, 2), ``frames = 1 +
  (length - frame_length) // frame_step``.
* ``hann_window``, ``hamming_window``, ``blackman_window`` — ``size`` samples,
  ``periodic`` (denominator ``size``) or symmetric (``size - 1``; a single
  sample is 1), cast to ``output_datatype``.
* ``mel_weight_matrix`` — MelWeightMatrix-17: (dft_length // 2 + 1,
  num_mel_bins) triangular filters on ONNX's integer frequency bins; the parts
  of a triangle beyond the last spectrogram bin are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, Shape, TensorType, checked_numel, normalize_axis

__all__ = [
    "concrete",
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "WINDOWS",
    "check_dft",
    "check_mel",
    "check_stft",
    "check_window_size",
    "mel_edges",
    "scalar",
]

FLOAT_DTYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
INT_DTYPES = frozenset({DType.INT32, DType.INT64})
WINDOWS = (Op.HANN_WINDOW, Op.HAMMING_WINDOW, Op.BLACKMAN_WINDOW)


def concrete(shape: Sequence[Dim]) -> tuple[int, ...]:
    """A shape computed from concrete input shapes, with every dimension an int."""
    dims = []
    for d in shape:
        if not isinstance(d, int):
            raise InvalidArgumentError(f"shape {tuple(shape)} has an unknown dimension {d!r}")
        dims.append(d)
    return tuple(dims)


def check_float(op: Op, dtype: DType, what: str = "input") -> None:
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"{op.value}: {what} must be float16, bfloat16, float32 or float64, got {dtype.value}")


def scalar(op: Op, name: str, value: Any) -> Any:
    """The single element of a scalar (or one-element) input, as a Python number."""
    flat = value.reshape(-1).tolist()
    if len(flat) != 1:
        raise InvalidArgumentError(
            f"{op.value}: {name} must be a scalar, got shape {tuple(value.shape)}")
    return flat[0]


def _complex_axis(op: Op, shape: Sequence[Dim]) -> None:
    if len(shape) < 2 or (isinstance(shape[-1], int) and shape[-1] not in (1, 2)):
        raise InvalidArgumentError(
            f"{op.value}: the input's last axis must hold 1 (real) or 2 (real, imaginary) "
            f"values, got shape {tuple(shape)}")


def check_dft(shape: Sequence[Dim], length: int | None, axis: int,
              attrs: Mapping[str, Any]) -> tuple[int, Shape]:
    """The normalized signal axis and the output shape (``length`` None: the default)."""
    op = Op.DFT
    _complex_axis(op, shape)
    a = normalize_axis(axis, len(shape), what=f"{op.value}: axis")
    if a == len(shape) - 1:
        raise InvalidArgumentError(
            f"{op.value}: axis {axis} is the trailing (real, imaginary) axis; allowed: "
            f"{-len(shape)}..{len(shape) - 2}")
    inverse, onesided = attrs["inverse"], attrs["onesided"]
    n: Dim = length
    if n is None:
        have = shape[a]
        n = (2 * (have - 1) if inverse and onesided else have) if isinstance(have, int) \
            else None
    if isinstance(n, int) and n < 1:
        raise InvalidArgumentError(f"{op.value}: dft_length must be >= 1, got {n}")
    out = list(shape)
    if inverse and onesided:
        out[a], out[-1] = n, 1
    else:
        out[a] = n // 2 + 1 if onesided and isinstance(n, int) else (None if onesided else n)
        out[-1] = 2
    return a, tuple(out)


def check_stft(shape: Sequence[int], step: int, window: Sequence[int] | None,
               frame_length: int | None, onesided: bool) -> tuple[int, Shape]:
    """The frame length and the output shape (B, frames, bins, 2)."""
    op = Op.STFT
    if len(shape) != 3 or shape[2] not in (1, 2):
        raise InvalidArgumentError(
            f"{op.value}: signal must have shape (batch, length, 1 or 2), got {tuple(shape)}")
    if window is not None and len(window) != 1:
        raise InvalidArgumentError(f"{op.value}: window must be 1-D, got {tuple(window)}")
    size = frame_length if frame_length is not None else (
        window[0] if window is not None else shape[1])
    if window is not None and window[0] != size:
        raise InvalidArgumentError(
            f"{op.value}: window has {window[0]} samples but frame_length is {size}")
    if step < 1 or size < 1 or size > shape[1]:
        raise InvalidArgumentError(
            f"{op.value}: frame_step must be >= 1 and frame_length in 1..{shape[1]} (the signal "
            f"length), got {step} and {size}")
    frames = 1 + (shape[1] - size) // step
    return size, (shape[0], frames, size // 2 + 1 if onesided else size, 2)


def check_window_size(op: Op, size: int) -> int:
    if size < 0:
        raise InvalidArgumentError(f"{op.value}: size must be >= 0, got {size}")
    checked_numel((size,), what=f"{op.value} output")
    return size


def check_mel(bins: int, dft_length: int, rate: int, low: float, high: float) -> Shape:
    op = Op.MEL_WEIGHT_MATRIX
    if bins < 1 or dft_length < 1 or rate < 1:
        raise InvalidArgumentError(
            f"{op.value}: num_mel_bins, dft_length and sample_rate must be >= 1, got {bins}, "
            f"{dft_length}, {rate}")
    if not 0.0 <= low < high:
        raise InvalidArgumentError(
            f"{op.value}: need 0 <= lower_edge_hertz < upper_edge_hertz, got {low} and {high}")
    return (dft_length // 2 + 1, bins)


def mel_edges(bins: int, dft_length: int, rate: int, low: float, high: float) -> np.ndarray:
    """The num_mel_bins + 2 integer frequency bins of the filters' edges, as ONNX computes
    them (host NumPy: a few numbers); both backends build their triangles on these."""
    low_mel = 2595 * np.log1p(low / 700) / np.log(10)
    high_mel = 2595 * np.log1p(high / 700) / np.log(10)
    mel = np.arange(bins + 2) * ((high_mel - low_mel) / (bins + 2)) + low_mel
    hertz = 700 * np.expm1(mel / 2595 * np.log(10))
    return np.floor_divide((dft_length + 1) * hertz, rate).astype(np.int64)


# ---- inference ----------------------------------------------------------------------------
def _value(values: Sequence[np.ndarray | None], i: int) -> np.ndarray | None:
    return values[i] if i < len(values) else None


def _present(types: Sequence[TensorType | None], i: int) -> bool:
    return i < len(types) and types[i] is not None


def _infer_dft(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
               values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    if x is None:
        return [None]
    check_float(Op.DFT, x.dtype)
    length, axis = _value(values, 1), _value(values, 2)
    if x.shape is None or (_present(types, 1) and length is None) \
            or (_present(types, 2) and axis is None):
        rank = None if x.shape is None else len(x.shape)
        return [TensorType(x.dtype, None if rank is None else (None,) * rank)]
    n = None if length is None else int(scalar(Op.DFT, "dft_length", length))
    a = -2 if axis is None else int(scalar(Op.DFT, "axis", axis))
    return [TensorType(x.dtype, check_dft(x.shape, n, a, attrs)[1])]


def _infer_stft(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    if x is None:
        return [None]
    check_float(Op.STFT, x.dtype, "signal")
    step, frame = _value(values, 1), _value(values, 3)
    window = types[2] if len(types) > 2 else None
    if not x.is_static or step is None or (_present(types, 3) and frame is None) \
            or (window is not None and not window.is_static):
        return [TensorType(x.dtype, (None,) * 4)]
    shape = check_stft(
        concrete(x.shape or ()),
        int(scalar(Op.STFT, "frame_step", step)),
        None if window is None else concrete(window.shape or ()),
        None if frame is None else int(scalar(Op.STFT, "frame_length", frame)),
        attrs["onesided"])[1]
    return [TensorType(x.dtype, shape)]


def _infer_window(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        size = _value(values, 0)
        n = None if size is None else check_window_size(op, int(scalar(op, "size", size)))
        return [TensorType(attrs["output_datatype"], (n,))]
    return infer


def _infer_mel(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
               values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    given = [_value(values, i) for i in range(5)]
    if any(v is None for v in given):
        return [TensorType(attrs["output_datatype"], (None, None))]
    nums = [scalar(Op.MEL_WEIGHT_MATRIX, "input", v) for v in given]
    shape = check_mel(int(nums[0]), int(nums[1]), int(nums[2]), float(nums[3]), float(nums[4]))
    return [TensorType(attrs["output_datatype"], shape)]


_OUT_DTYPE = AttrSpec("output_datatype", AttrKind.DTYPE, DType.FLOAT32)

register_schema(OpSchema(
    Op.DFT, 1, 3,
    attrs=(AttrSpec("inverse", AttrKind.BOOL, False), AttrSpec("onesided", AttrKind.BOOL, False)),
    infer=_infer_dft, value_inputs=(1, 2),
    doc="ONNX DFT-20: the discrete Fourier transform along `axis` (an input, default -2).",
))
register_schema(OpSchema(
    Op.STFT, 2, 4, attrs=(AttrSpec("onesided", AttrKind.BOOL, True),),
    infer=_infer_stft, value_inputs=(1, 3),
    doc="ONNX STFT-17: DFTs of windowed frames of the signal.",
))
for _op, _formula in (
    (Op.HANN_WINDOW, "sin(pi n / N) ** 2"),
    (Op.HAMMING_WINDOW, "25/46 - 21/46 cos(2 pi n / N)"),
    (Op.BLACKMAN_WINDOW, "0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)"),
):
    register_schema(OpSchema(
        _op, 1, 1, attrs=(_OUT_DTYPE, AttrSpec("periodic", AttrKind.BOOL, True)),
        infer=_infer_window(_op), value_inputs=(0,),
        doc=f"ONNX {_op.value}: w[n] = {_formula}, N = size (periodic) or size - 1.",
    ))
register_schema(OpSchema(
    Op.MEL_WEIGHT_MATRIX, 5, 5, attrs=(_OUT_DTYPE,), infer=_infer_mel,
    value_inputs=(0, 1, 2, 3, 4),
    doc="ONNX MelWeightMatrix-17: triangular mel filters over the DFT's frequency bins.",
))
