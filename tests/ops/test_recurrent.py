"""The recurrent family: RNN, GRU, LSTM against ONNX's oracle and the equations by hand."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._extra_support import assert_close, keel_run, onnx_run, run_both, run_cpu, run_ref

RNG = np.random.default_rng(21)
GATES = {Op.RNN: 1, Op.GRU: 3, Op.LSTM: 4}
NAMES = {Op.RNN: "RNN", Op.GRU: "GRU", Op.LSTM: "LSTM"}


def _n(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.5).astype(np.float32)


def _weights(op: Op, dirs: int = 1, size: int = 3, hidden: int = 4) -> list[np.ndarray]:
    g = GATES[op]
    return [_n(dirs, g * hidden, size), _n(dirs, g * hidden, hidden), _n(dirs, 2 * g * hidden)]


@pytest.mark.parametrize("op", [Op.RNN, Op.GRU, Op.LSTM], ids=lambda o: o.value)
@pytest.mark.parametrize(("direction", "layout"), [("forward", 0), ("reverse", 0),
                                                   ("bidirectional", 0), ("bidirectional", 1)])
def test_matches_onnx(op: Op, direction: str, layout: int) -> None:
    dirs = 2 if direction == "bidirectional" else 1
    x = _n(2, 5, 3) if layout else _n(5, 2, 3)
    h0 = _n(2, dirs, 4) if layout else _n(dirs, 2, 4)
    inputs: list[Any] = [x, *_weights(op, dirs), None, h0]
    n_out = 3 if op is Op.LSTM else 2
    if op is Op.LSTM:
        inputs += [h0 * 0.5, _n(dirs, 12)]
    attrs = {"direction": direction, "layout": layout, "hidden_size": 4}
    expected = onnx_run(NAMES[op], inputs, n_outputs=n_out, opset=22, **attrs)
    assert_close(run_both(op, inputs, rtol=1e-5, atol=1e-6, **attrs), expected, 1e-5, 1e-6)


@pytest.mark.parametrize("op", [Op.RNN, Op.GRU, Op.LSTM], ids=lambda o: o.value)
def test_sequence_lens_stop_each_row(op: Op) -> None:
    x, weights = _n(5, 2, 3), _weights(op)
    lens = np.array([5, 2], dtype=np.int32)
    y, y_h, *_ = run_both(op, [x, *weights, lens])
    short = run_both(op, [x[:2, 1:], *weights])
    np.testing.assert_allclose(y[:2, :, 1:], short[0], rtol=1e-6)
    np.testing.assert_array_equal(y[2:, :, 1], 0)
    np.testing.assert_allclose(y_h[:, 1:], short[1], rtol=1e-6)
    # In reverse the row starts at its last valid step.
    rev = run_both(op, [x, *weights, lens], direction="reverse")
    rev_short = run_both(op, [x[:2, 1:], *weights], direction="reverse")
    np.testing.assert_allclose(rev[1][:, 1:], rev_short[1], rtol=1e-6)


def test_rnn_activation_and_clip_by_hand() -> None:
    x, (w, r, b) = _n(1, 2, 3), _weights(Op.RNN)
    (y, _) = run_both(Op.RNN, [x, w, r, b], activations=["LeakyRelu"], activation_alpha=[0.2],
                      clip=0.1)
    pre = x[0].astype(np.float64) @ w[0].T + b[0, :4] + b[0, 4:]
    pre = np.clip(pre, -0.1, 0.1)
    np.testing.assert_allclose(y[0, 0], np.where(pre >= 0, pre, 0.2 * pre), rtol=1e-5)


def test_lstm_input_forget_by_hand() -> None:
    x, (w, r, b) = _n(1, 1, 3), _weights(Op.LSTM)
    _, y_h, y_c = run_both(Op.LSTM, [x, w, r, b], input_forget=True)
    pre = x[0].astype(np.float64) @ w[0].T + b[0, :16] + b[0, 16:]
    i, o, _, c = np.split(pre, 4, axis=-1)
    sig = 1 / (1 + np.exp(-i))
    cell = sig * np.tanh(c)                 # f = 1 - i times a zero initial cell
    np.testing.assert_allclose(y_c[0], cell, rtol=1e-5)
    np.testing.assert_allclose(y_h[0], 1 / (1 + np.exp(-o)) * np.tanh(cell), rtol=1e-5)


def test_gru_linear_before_reset_matches_onnx() -> None:
    inputs = [_n(4, 2, 3), *_weights(Op.GRU)]
    expected = onnx_run("GRU", inputs, n_outputs=2, opset=22, linear_before_reset=1)
    assert_close(run_both(Op.GRU, inputs, linear_before_reset=True), expected, 1e-5, 1e-6)


def test_cpu_writes_into_given_buffers() -> None:
    inputs = [_n(3, 2, 3), *_weights(Op.LSTM)]
    want = run_ref(Op.LSTM, inputs)
    bufs = [np.empty_like(w) for w in want]
    got = run_cpu(Op.LSTM, inputs, out=bufs)
    assert all(g is b for g, b in zip(got, bufs, strict=True))
    assert_close(got, want, 1e-5, 1e-6)


def test_inference_and_import() -> None:
    schema = get_schema(Op.GRU)
    f = DType.FLOAT32
    types = [TensorType(f, ("t", "b", 3)), TensorType(f, (2, 12, 3)), TensorType(f, (2, 12, 4))]
    out = schema.infer_types(types, schema.normalize_attrs({"direction": "bidirectional"}))
    assert out == [TensorType(f, ("t", 2, "b", 4)), TensorType(f, (2, "b", 4))]
    inputs = [_n(3, 2, 3), *_weights(Op.RNN)]
    got = keel_run("RNN", inputs, n_outputs=2, opset=14, hidden_size=4)
    assert_close(got, onnx_run("RNN", inputs, n_outputs=2, opset=14, hidden_size=4), 1e-5, 1e-6)


@pytest.mark.parametrize(("op", "attrs", "inputs", "match"), [
    (Op.RNN, {"direction": "both"}, None, "direction must be forward, reverse or bidirectional"),
    (Op.GRU, {"activations": ["Tanh"]}, None, r"activations must list 2 function\(s\)"),
    (Op.LSTM, {"layout": 2}, None, "layout must be 0 or 1"),
    (Op.RNN, {"hidden_size": 5}, None, "hidden_size 5 disagrees with R"),
    (Op.RNN, {"clip": 0.0}, None, "clip must be > 0"),
    (Op.GRU, {}, [_n(2, 1, 3), _n(1, 12, 3), _n(1, 12, 4), None, np.array([3])],
     r"sequence_lens entries must be in \[0, 2\], got 3"),
    (Op.LSTM, {}, [_n(2, 1, 3), _n(1, 16, 2), _n(1, 16, 4)], r"W must have shape \(1, 16, 3\)"),
])
def test_typed_errors(op: Op, attrs: dict[str, Any], inputs: list[Any] | None,
                      match: str) -> None:
    ins = inputs if inputs is not None else [_n(2, 1, 3), *_weights(op)]
    for run in (run_ref, run_cpu):
        with pytest.raises(InvalidArgumentError, match=match):
            run(op, ins, **attrs)


def test_unknown_activation_is_unsupported() -> None:
    with pytest.raises(UnsupportedOperationError, match="activation 'gelu'; supported: relu"):
        run_cpu(Op.RNN, [_n(2, 1, 3), *_weights(Op.RNN)], activations=["Gelu"])
