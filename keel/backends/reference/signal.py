"""Reference kernels of the signal family: NumPy's FFT in complex128, windows in float64."""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schemas.signal import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_dft,
    check_float,
    check_mel,
    check_stft,
    check_window_size,
    concrete,
    mel_edges,
    scalar,
)

__all__: list[str] = []



def _opt(inputs: Inputs, i: int) -> np.ndarray | None:
    return inputs[i] if i < len(inputs) else None


def _to_complex(x: np.ndarray) -> np.ndarray:
    """(..., 1) real or (..., 2) real/imaginary → complex128 (...)."""
    x64 = x.astype(np.float64)
    return x64[..., 0] + 1j * x64[..., 1] if x.shape[-1] == 2 else x64[..., 0].astype(complex)


def _from_complex(z: np.ndarray) -> np.ndarray:
    return np.stack([z.real, z.imag], axis=-1)


@TABLE.kernel(Op.DFT, dtypes=FLOAT_DTYPES)
def dft(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """np.fft.fft / ifft / rfft / irfft along the signal axis."""
    x, length, axis = inputs[0], _opt(inputs, 1), _opt(inputs, 2)
    check_float(Op.DFT, DType.from_numpy(x.dtype))
    n_given = None if length is None else int(scalar(Op.DFT, "dft_length", length))
    a, dims = check_dft(x.shape, n_given, -2 if axis is None else
                        int(scalar(Op.DFT, "axis", axis)), attrs)
    n = concrete(dims)[a]
    z = _to_complex(x)
    if attrs["inverse"] and attrs["onesided"]:
        y = np.fft.irfft(z, n=n, axis=a)[..., None]
    elif attrs["inverse"]:
        y = _from_complex(np.fft.ifft(z, n=n, axis=a))
    else:
        full = np.fft.fft(z, n=n_given if n_given is not None else x.shape[a], axis=a)
        if attrs["onesided"]:
            full = np.take(full, np.arange(full.shape[a] // 2 + 1), axis=a)
        y = _from_complex(full)
    return [y.astype(x.dtype)]


@TABLE.kernel(Op.STFT, dtypes=FLOAT_DTYPES)
def stft(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The DFT of each windowed frame: frame f covers samples [f * step, f * step + length)."""
    x, step, window, frame = inputs[0], inputs[1], _opt(inputs, 2), _opt(inputs, 3)
    check_float(Op.STFT, DType.from_numpy(x.dtype), "signal")
    size, dims = check_stft(x.shape, int(scalar(Op.STFT, "frame_step", step)),
                             None if window is None else window.shape,
                             None if frame is None else int(scalar(Op.STFT, "frame_length",
                                                                   frame)),
                            attrs["onesided"])
    shape = concrete(dims)
    hop = int(scalar(Op.STFT, "frame_step", step))
    w = np.ones(size) if window is None else window.astype(np.float64)
    z = _to_complex(x)
    frames = np.stack([z[:, f * hop:f * hop + size] * w for f in range(shape[1])], axis=1) \
        if shape[1] else np.zeros((x.shape[0], 0, size), complex)
    spectrum = np.fft.fft(frames, axis=-1)[..., :shape[2]]
    return [_from_complex(spectrum).reshape(shape).astype(x.dtype)]


def _window(op: Op, inputs: Inputs, attrs: Attrs) -> tuple[np.ndarray, float]:
    """Sample indices n and the denominator N of a window."""
    size = check_window_size(op, int(scalar(op, "size", inputs[0])))
    return np.arange(size, dtype=np.float64), float(size if attrs["periodic"] else size - 1)


def _finish(w: np.ndarray, attrs: Attrs) -> list[Any]:
    if w.size == 1 and not np.isfinite(w[0]):   # a symmetric window of one sample is 1
        w = np.ones(1)
    return [w.astype(attrs["output_datatype"].numpy)]


@TABLE.kernel(Op.HANN_WINDOW, dtypes=INT_DTYPES)
def hann_window(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """sin(pi n / N) ** 2."""
    n, big_n = _window(Op.HANN_WINDOW, inputs, attrs)
    with np.errstate(invalid="ignore", divide="ignore"):
        return _finish(np.sin(np.pi * n / big_n) ** 2, attrs)


@TABLE.kernel(Op.HAMMING_WINDOW, dtypes=INT_DTYPES)
def hamming_window(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """25/46 - 21/46 cos(2 pi n / N)."""
    n, big_n = _window(Op.HAMMING_WINDOW, inputs, attrs)
    with np.errstate(invalid="ignore", divide="ignore"):
        return _finish(25 / 46 - 21 / 46 * np.cos(2 * np.pi * n / big_n), attrs)


@TABLE.kernel(Op.BLACKMAN_WINDOW, dtypes=INT_DTYPES)
def blackman_window(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)."""
    n, big_n = _window(Op.BLACKMAN_WINDOW, inputs, attrs)
    with np.errstate(invalid="ignore", divide="ignore"):
        w = 0.42 - 0.5 * np.cos(2 * np.pi * n / big_n) + 0.08 * np.cos(4 * np.pi * n / big_n)
    return _finish(w, attrs)


@TABLE.kernel(Op.MEL_WEIGHT_MATRIX, dtypes=INT_DTYPES)
def mel_weight_matrix(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                      out: Out) -> list[Any]:
    """Filter i rises from edge i to edge i + 1 and falls to edge i + 2."""
    bins, dft_length, rate = (int(scalar(Op.MEL_WEIGHT_MATRIX, "input", v)) for v in inputs[:3])
    low, high = (float(scalar(Op.MEL_WEIGHT_MATRIX, "input", v)) for v in inputs[3:5])
    shape = concrete(check_mel(bins, dft_length, rate, low, high))
    edges = mel_edges(bins, dft_length, rate, low, high).tolist()
    w = np.zeros(shape)
    rows = shape[0]
    for i in range(bins):
        left, center, right = edges[i], edges[i + 1], edges[i + 2]
        for j in range(max(left, 0), min(center, rows - 1) + 1):
            w[j, i] = 1.0 if center == left else (j - left) / (center - left)
        for j in range(max(center, 0), min(right, rows)):
            w[j, i] = (right - j) / (right - center)
    return [w.astype(attrs["output_datatype"].numpy)]
