"""Conformance cases of the signal family.

dft: real and complex input, forward/inverse, one-sided (rfft and irfft),
padded and truncated lengths, other axes, float16/float64. stft: real and
complex signals, with and without a window, one-sided or not. The windows:
periodic and symmetric, sizes 0, 1 and more, several output dtypes.
mel_weight_matrix: a few filter banks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]
F16, F32, F64 = np.float16, np.float32, np.float64


def _tol(dtype: Any, scale: float = 1.0) -> dict[str, Any]:
    dt = np.dtype(dtype)
    if dt == np.float16:
        return {"rtol": 1e-2, "atol": 5e-2 * scale}
    if dt == np.float64:
        return {"rtol": 1e-10, "atol": 1e-10 * scale}
    return {"rtol": 1e-4, "atol": 1e-4 * scale}


def _signal(shape: tuple[int, ...], dtype: Any = F32, length: int | None = None,
            axis: int | None = None) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        ins: list[np.ndarray | None] = [rng.standard_normal(shape).astype(dtype),
                                        None if length is None else np.array(length, np.int64),
                                        None if axis is None else np.array(axis, np.int64)]
        while ins[-1] is None:
            ins.pop()
        return ins
    return make


def _dft_cases() -> list[OpCase]:
    op = Op.DFT
    return [
        OpCase("dft-real", op, _signal((2, 8, 1)), **_tol(F32)),
        OpCase("dft-complex", op, _signal((2, 6, 3, 2), axis=1), **_tol(F32)),
        OpCase("dft-real-onesided", op, _signal((3, 9, 1)), {"onesided": True}, **_tol(F32)),
        OpCase("dft-complex-onesided-padded", op, _signal((2, 5, 2), length=8),
               {"onesided": True}, **_tol(F32)),
        OpCase("dft-inverse", op, _signal((2, 7, 2)), {"inverse": True}, **_tol(F32)),
        OpCase("dft-irfft", op, _signal((2, 5, 3, 2), axis=-3), {"inverse": True,
                                                                  "onesided": True},
               **_tol(F32)),
        OpCase("dft-irfft-odd", op, _signal((4, 2), length=7),
               {"inverse": True, "onesided": True}, **_tol(F32)),
        OpCase("dft-truncated-axis0", op, _signal((6, 3, 1), length=4, axis=0), **_tol(F32)),
        OpCase("dft-f64", op, _signal((2, 16, 2), F64), **_tol(F64)),
        OpCase("dft-f16", op, _signal((1, 8, 1), F16), **_tol(F16)),
        OpCase("dft-empty-batch", op, _signal((0, 8, 2)), **_tol(F32)),
    ]


def _stft(shape: tuple[int, ...], step: int, window: int | None, frame: int | None,
          dtype: Any = F32) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        ins: list[np.ndarray | None] = [
            rng.standard_normal(shape).astype(dtype), np.array(step, np.int64),
            None if window is None else np.hanning(window + 2)[1:-1].astype(dtype),
            None if frame is None else np.array(frame, np.int64)]
        while ins[-1] is None:
            ins.pop()
        return ins
    return make


def _stft_cases() -> list[OpCase]:
    op = Op.STFT
    return [
        OpCase("stft-window", op, _stft((2, 32, 1), 8, 16, None), **_tol(F32, 10)),
        OpCase("stft-frame-length", op, _stft((1, 30, 1), 5, None, 12),
               {"onesided": False}, **_tol(F32, 10)),
        OpCase("stft-complex", op, _stft((2, 20, 2), 4, 8, 8), {"onesided": False},
               **_tol(F32, 10)),
        OpCase("stft-f64", op, _stft((1, 16, 1), 3, 6, 6, F64), **_tol(F64, 10)),
    ]


def _window_cases() -> list[OpCase]:
    cases = []
    for op in (Op.HANN_WINDOW, Op.HAMMING_WINDOW, Op.BLACKMAN_WINDOW):
        for size in (0, 1, 10):
            for periodic in (True, False):
                cases.append(OpCase(
                    f"{op.value}-{size}{'' if periodic else '-symmetric'}", op,
                    (lambda s: lambda rng: [np.array(s, np.int64)])(size),
                    {"periodic": periodic}))
        cases.append(OpCase(f"{op.value}-f64-int32-size", op,
                            lambda rng: [np.array(7, np.int32)],
                            {"output_datatype": DType.FLOAT64}, **_tol(F64)))
        cases.append(OpCase(f"{op.value}-f16", op, lambda rng: [np.array(9, np.int64)],
                            {"output_datatype": DType.FLOAT16}, **_tol(F16)))
    return cases


def _mel(bins: int, dft: int, rate: int, low: float, high: float) -> Make:
    return lambda rng: [np.array(bins, np.int64), np.array(dft, np.int64),
                        np.array(rate, np.int64), np.array(low, np.float32),
                        np.array(high, np.float32)]


def _mel_cases() -> list[OpCase]:
    op = Op.MEL_WEIGHT_MATRIX
    return [
        OpCase("mel_weight_matrix-8", op, _mel(8, 16, 8192, 0.0, 4096.0)),
        OpCase("mel_weight_matrix-40", op, _mel(40, 512, 16000, 20.0, 8000.0)),
        OpCase("mel_weight_matrix-f64", op, _mel(10, 64, 8000, 100.0, 3000.0),
               {"output_datatype": DType.FLOAT64}, **_tol(F64)),
    ]


CASES: list[OpCase] = _dft_cases() + _stft_cases() + _window_cases() + _mel_cases()
