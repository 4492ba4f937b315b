"""cpu kernels of the signal family, written once against ``ctx.xp``.

Transforms use ``xp.fft`` in single precision for float16/float32 inputs
(double for float64) and the real-input transforms (rfft) where the input is
real, which halve the work. STFT frames are one gather of all frames at once.
"""

from __future__ import annotations

import math
from typing import Any

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.cpu.kernels import TABLE
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




def _deliver(out: Out, i: int, value: Any) -> Any:
    if out is not None and len(out) > i and out[i] is not None:
        if out[i] is not value:
            out[i][...] = value
        return out[i]
    return value


def _real_dtype(xp: Any, x: Any) -> Any:
    return xp.float64 if x.dtype == xp.float64 else xp.float32


def _complex(xp: Any, x: Any) -> Any:
    """(..., 2) real/imaginary as a complex array of the compute precision."""
    ct = _real_dtype(xp, x)
    z = x[..., 0].astype(ct) + 1j * x[..., 1].astype(ct)
    return z.astype(xp.complex128 if ct == xp.float64 else xp.complex64, copy=False)


def _pairs(xp: Any, z: Any) -> Any:
    return xp.stack([z.real, z.imag], axis=-1)


@TABLE.kernel(Op.DFT, dtypes=FLOAT_DTYPES, supports_out=True)
def dft(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """xp.fft along the signal axis (rfft for real input, irfft for one-sided inverse)."""
    xp = ctx.xp
    x, length, axis = inputs[0], optional_input(inputs, 1), optional_input(inputs, 2)
    check_float(Op.DFT, DType.from_numpy(x.dtype))
    n_given = None if length is None else int(scalar(Op.DFT, "dft_length", length))
    a, shape = check_dft(x.shape, n_given, -2 if axis is None else
                         int(scalar(Op.DFT, "axis", axis)), attrs)
    n = concrete(shape)[a]
    real = x.shape[-1] == 1
    signal = x[..., 0].astype(_real_dtype(xp, x), copy=False) if real else _complex(xp, x)
    if attrs["inverse"] and attrs["onesided"]:
        y = xp.fft.irfft(signal, n=n, axis=a)[..., None]
    elif attrs["inverse"]:
        y = _pairs(xp, xp.fft.ifft(signal, n=n, axis=a))
    else:
        full_n = n_given if n_given is not None else x.shape[a]
        if real and attrs["onesided"]:
            y = _pairs(xp, xp.fft.rfft(signal, n=full_n, axis=a))
        else:
            spectrum = xp.fft.fft(signal, n=full_n, axis=a)
            if attrs["onesided"]:
                spectrum = xp.take(spectrum, xp.arange(full_n // 2 + 1), axis=a)
            y = _pairs(xp, spectrum)
    return [_deliver(out, 0, y.astype(x.dtype, copy=False))]


@TABLE.kernel(Op.STFT, dtypes=FLOAT_DTYPES, supports_out=True)
def stft(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """All frames gathered at once (B, frames, length), windowed, then one batched FFT."""
    xp = ctx.xp
    x, step = inputs[0], inputs[1]
    window, frame = optional_input(inputs, 2), optional_input(inputs, 3)
    check_float(Op.STFT, DType.from_numpy(x.dtype), "signal")
    hop = int(scalar(Op.STFT, "frame_step", step))
    size, shape = check_stft(x.shape, hop, None if window is None else window.shape,
                             None if frame is None else int(scalar(Op.STFT, "frame_length",
                                                                   frame)),
                             attrs["onesided"])
    ct = _real_dtype(xp, x)
    frames_n = concrete(shape)[1]
    index = xp.arange(frames_n)[:, None] * hop + xp.arange(size)[None, :]
    real = x.shape[-1] == 1
    signal = x[..., 0].astype(ct, copy=False) if real else _complex(xp, x)
    frames = xp.take(signal, index, axis=1)                      # (B, frames, size)
    if window is not None:
        frames = frames * window.astype(ct)
    if real and attrs["onesided"]:
        spectrum = xp.fft.rfft(frames, axis=-1)
    else:
        spectrum = xp.fft.fft(frames, axis=-1)[..., :shape[2]]
    return [_deliver(out, 0, _pairs(xp, spectrum).astype(x.dtype, copy=False))]


def _window(xp: Any, op: Op, inputs: Inputs, attrs: Attrs) -> tuple[Any, float]:
    size = check_window_size(op, int(scalar(op, "size", inputs[0])))
    denominator = size if attrs["periodic"] else size - 1
    # One symmetric sample: N = 0; any finite denominator gives the defined value 1.
    return xp.arange(size, dtype=xp.float64), float(denominator or 1)


def _finish(xp: Any, out: Out, w: Any, attrs: Attrs, one: bool) -> list[Any]:
    if one:
        w = xp.ones(1, dtype=xp.float64)
    return [_deliver(out, 0, w.astype(attrs["output_datatype"].numpy))]


def _is_single_symmetric(inputs: Inputs, attrs: Attrs, op: Op) -> bool:
    return not attrs["periodic"] and int(scalar(op, "size", inputs[0])) == 1


@TABLE.kernel(Op.HANN_WINDOW, dtypes=INT_DTYPES, supports_out=True)
def hann_window(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """sin(pi n / N) ** 2."""
    xp = ctx.xp
    n, big_n = _window(xp, Op.HANN_WINDOW, inputs, attrs)
    w = xp.sin(n * (math.pi / big_n)) ** 2
    return _finish(xp, out, w, attrs, _is_single_symmetric(inputs, attrs, Op.HANN_WINDOW))


@TABLE.kernel(Op.HAMMING_WINDOW, dtypes=INT_DTYPES, supports_out=True)
def hamming_window(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """25/46 - 21/46 cos(2 pi n / N)."""
    xp = ctx.xp
    n, big_n = _window(xp, Op.HAMMING_WINDOW, inputs, attrs)
    w = 25 / 46 - 21 / 46 * xp.cos(n * (2 * math.pi / big_n))
    return _finish(xp, out, w, attrs, _is_single_symmetric(inputs, attrs, Op.HAMMING_WINDOW))


@TABLE.kernel(Op.BLACKMAN_WINDOW, dtypes=INT_DTYPES, supports_out=True)
def blackman_window(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)."""
    xp = ctx.xp
    n, big_n = _window(xp, Op.BLACKMAN_WINDOW, inputs, attrs)
    w = 0.42 - 0.5 * xp.cos(n * (2 * math.pi / big_n)) + 0.08 * xp.cos(n * (4 * math.pi / big_n))
    return _finish(xp, out, w, attrs, _is_single_symmetric(inputs, attrs, Op.BLACKMAN_WINDOW))


@TABLE.kernel(Op.MEL_WEIGHT_MATRIX, dtypes=INT_DTYPES, supports_out=True)
def mel_weight_matrix(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                      out: Out) -> list[Any]:
    """All triangles at once: rising (j - left) / (center - left), falling (right - j) / ..."""
    xp = ctx.xp
    bins, dft_length, rate = (int(scalar(Op.MEL_WEIGHT_MATRIX, "input", v)) for v in inputs[:3])
    low, high = (float(scalar(Op.MEL_WEIGHT_MATRIX, "input", v)) for v in inputs[3:5])
    shape = check_mel(bins, dft_length, rate, low, high)
    edges = xp.asarray(mel_edges(bins, dft_length, rate, low, high))
    left, center, right = edges[:-2][None, :], edges[1:-1][None, :], edges[2:][None, :]
    j = xp.arange(shape[0])[:, None]
    rising = xp.where(center == left, 1.0, (j - left) / xp.maximum(center - left, 1))
    falling = (right - j) / xp.maximum(right - center, 1)
    w = xp.where((j >= left) & (j <= center), rising, 0.0)
    w = xp.where((j >= center) & (j < right), falling, w)
    return [_deliver(out, 0, w.astype(attrs["output_datatype"].numpy))]
