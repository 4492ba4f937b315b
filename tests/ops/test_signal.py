"""The signal family: kernels against ONNX's oracle and NumPy, inference, typed errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._extra_support import assert_close, keel_run, onnx_run, run_both, run_cpu, run_ref

RNG = np.random.default_rng(13)


def _n(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _s(v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


# (id, inputs, attrs): DFT-20, inputs (None = absent)
DFT_ORACLE: list[tuple[str, list[Any], dict[str, Any]]] = [
    ("real", [_n(2, 8, 1)], {}),
    ("complex-axis1", [_n(2, 6, 3, 2), None, _s(1)], {}),
    ("rfft-padded", [_n(3, 5, 1), _s(8)], {"onesided": 1}),
    ("inverse", [_n(2, 7, 2)], {"inverse": 1}),
    ("irfft", [_n(2, 5, 2), _s(8)], {"inverse": 1, "onesided": 1}),
]


@pytest.mark.parametrize(("inputs", "attrs"),
                         [pytest.param(i, a, id=n) for n, i, a in DFT_ORACLE])
def test_dft_matches_onnx(inputs: list[Any], attrs: dict[str, Any]) -> None:
    expected = onnx_run("DFT", inputs, opset=20, **attrs)
    assert_close(run_both(Op.DFT, inputs, rtol=1e-4, atol=1e-4, **attrs), expected, 1e-4, 1e-4)


def test_dft_by_numpy() -> None:
    x = _n(4, 9, 1).astype(np.float64)
    (y,) = run_both(Op.DFT, [x], onesided=True)
    want = np.fft.rfft(x[..., 0], axis=1)
    np.testing.assert_allclose(y[..., 0] + 1j * y[..., 1], want, atol=1e-12)


def test_dft_17_axis_attribute_imports() -> None:
    x = _n(1, 10, 4, 1)
    got = keel_run("DFT", [x], opset=17, axis=2)
    assert_close(got, onnx_run("DFT", [x], opset=17, axis=2), 1e-4, 1e-4)


@pytest.mark.parametrize(("inputs", "attrs"), [
    ([_n(2, 32, 1), _s(8), np.hanning(16).astype(np.float32)], {}),
    ([_n(1, 30, 1), _s(5), None, _s(12)], {"onesided": 0}),
    ([_n(2, 20, 2), _s(4), np.ones(8, np.float32), _s(8)], {"onesided": 0}),
])
def test_stft_matches_onnx(inputs: list[Any], attrs: dict[str, Any]) -> None:
    expected = onnx_run("STFT", inputs, opset=17, **attrs)
    assert_close(run_both(Op.STFT, inputs, rtol=1e-4, atol=1e-4, **attrs), expected, 1e-4, 1e-3)


@pytest.mark.parametrize("name", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows_match_onnx(name: str, periodic: int) -> None:
    op = {"HannWindow": Op.HANN_WINDOW, "HammingWindow": Op.HAMMING_WINDOW,
          "BlackmanWindow": Op.BLACKMAN_WINDOW}[name]
    expected = onnx_run(name, [_s(10)], opset=17, periodic=periodic)
    assert_close(run_both(op, [_s(10)], periodic=bool(periodic)), expected, 1e-6, 1e-6)
    (one,) = run_both(op, [_s(1)], periodic=False)
    np.testing.assert_array_equal(one, [1.0])
    (f64,) = run_both(op, [_s(5)], output_datatype=DType.FLOAT64)
    assert f64.dtype == np.float64


def test_mel_weight_matrix_matches_onnx() -> None:
    inputs = [_s(12), _s(64), _s(8000), np.array(50.0, np.float32),
              np.array(3800.0, np.float32)]
    expected = onnx_run("MelWeightMatrix", inputs, opset=17,
                        output_datatype=TensorProto.FLOAT)
    assert_close(run_both(Op.MEL_WEIGHT_MATRIX, inputs), expected)


def test_inference_from_constant_inputs() -> None:
    f = DType.FLOAT32
    dft = get_schema(Op.DFT)
    out = dft.infer_types([TensorType(f, ("b", 10, 1)), None, None],
                          dft.normalize_attrs({"onesided": True}), [None, _s(16), None])
    assert out == [TensorType(f, ("b", 9, 2))]
    unknown = dft.infer_types([TensorType(f, (2, 10, 1)), None, TensorType(DType.INT64, ())],
                              dft.normalize_attrs({}), [None, None, None])
    assert unknown == [TensorType(f, (None, None, None))]
    win = get_schema(Op.HANN_WINDOW)
    assert win.infer_types([TensorType(DType.INT64, ())], win.normalize_attrs({}),
                           [_s(7)]) == [TensorType(f, (7,))]
    stft = get_schema(Op.STFT)
    out = stft.infer_types([TensorType(f, (2, 32, 1)), None, TensorType(f, (16,))],
                           stft.normalize_attrs({}), [None, _s(8), None])
    assert out == [TensorType(f, (2, 3, 9, 2))]


@pytest.mark.parametrize(("op", "inputs", "attrs", "match"), [
    (Op.DFT, [_n(2, 8, 3)], {}, "last axis must hold 1 .real. or 2"),
    (Op.DFT, [_n(2, 8, 2), None, _s(2)], {}, "axis 2 is the trailing"),
    (Op.DFT, [_n(2, 8, 2), _s(0)], {}, "dft_length must be >= 1"),
    (Op.DFT, [_n(2, 8, 2), _s(4), _s(7)], {}, "axis 7 is out of range"),
    (Op.STFT, [_n(2, 8, 1), _s(2), np.ones(4, np.float32), _s(5)], {},
     "window has 4 samples but frame_length is 5"),
    (Op.STFT, [_n(2, 8, 1), _s(0)], {}, "frame_step must be >= 1"),
    (Op.STFT, [_n(2, 8), _s(2)], {}, r"signal must have shape \(batch, length, 1 or 2\)"),
    (Op.HANN_WINDOW, [_s(-3)], {}, "size must be >= 0"),
    (Op.HANN_WINDOW, [np.array([3, 4])], {}, "size must be a scalar"),
    (Op.MEL_WEIGHT_MATRIX, [_s(8), _s(16), _s(8000), np.array(500.0), np.array(100.0)], {},
     "need 0 <= lower_edge_hertz < upper_edge_hertz"),
])
def test_typed_errors(op: Op, inputs: list[Any], attrs: dict[str, Any], match: str) -> None:
    for run in (run_ref, run_cpu):
        with pytest.raises(InvalidArgumentError, match=match):
            run(op, inputs, **attrs)
