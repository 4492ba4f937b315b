"""Conformance cases of the recurrent family: RNN, GRU and LSTM.

Every direction, both layouts, biases, initial states, peepholes,
``sequence_lens`` shorter than the sequence, ``clip``, non-default activations
(with alpha/beta), GRU's linear_before_reset, LSTM's input_forget, float64 and
float16.
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
_GATES = {Op.RNN: 1, Op.GRU: 3, Op.LSTM: 4}


def _tol(dtype: Any) -> dict[str, Any]:
    dt = np.dtype(dtype)
    if dt == np.float16:
        return {"rtol": 1e-2, "atol": 1e-2}
    if dt == np.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    return {"rtol": 1e-4, "atol": 1e-5}


def _inputs(op: Op, seq: int = 4, batch: int = 3, size: int = 5, hidden: int = 4,
            dirs: int = 1, layout: int = 0, bias: bool = True, lens: list[int] | None = None,
            initial: bool = False, peep: bool = False, dtype: Any = F32) -> Make:
    g = _GATES[op]

    def make(rng: Gen) -> list[np.ndarray | None]:
        def n(*shape: int) -> np.ndarray:
            return (rng.standard_normal(shape) * 0.5).astype(dtype)
        x = n(batch, seq, size) if layout else n(seq, batch, size)
        state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
        ins: list[np.ndarray | None] = [
            x, n(dirs, g * hidden, size), n(dirs, g * hidden, hidden),
            n(dirs, 2 * g * hidden) if bias else None,
            None if lens is None else np.array(lens, dtype=np.int32),
            n(*state) if initial else None]
        if op is Op.LSTM:
            ins += [n(*state) if initial else None, n(dirs, 3 * hidden) if peep else None]
        while ins[-1] is None:
            ins.pop()
        return ins
    return make


def _cases(op: Op) -> list[OpCase]:
    name = op.value
    cases = [
        OpCase(f"{name}-forward", op, _inputs(op), **_tol(F32)),
        OpCase(f"{name}-reverse-initial", op, _inputs(op, initial=True),
               {"direction": "reverse"}, **_tol(F32)),
        OpCase(f"{name}-bidirectional-lens", op, _inputs(op, dirs=2, lens=[4, 2, 0],
                                                         initial=True),
               {"direction": "bidirectional"}, **_tol(F32)),
        OpCase(f"{name}-layout1", op, _inputs(op, dirs=2, layout=1, initial=True),
               {"direction": "bidirectional", "layout": 1}, **_tol(F32)),
        OpCase(f"{name}-no-bias-clip", op, _inputs(op, bias=False), {"clip": 0.3},
               **_tol(F32)),
        OpCase(f"{name}-f64", op, _inputs(op, dtype=F64, initial=True), **_tol(F64)),
        OpCase(f"{name}-f16", op, _inputs(op, dtype=F16), **_tol(F16)),
        OpCase(f"{name}-empty-batch", op, _inputs(op, batch=0), **_tol(F32)),
    ]
    acts = {Op.RNN: ["LeakyRelu"], Op.GRU: ["HardSigmoid", "Softsign"],
            Op.LSTM: ["HardSigmoid", "Elu", "ScaledTanh"]}[op]
    cases.append(OpCase(f"{name}-activations", op, _inputs(op),
                        {"activations": acts, "activation_alpha": [0.3, 0.7, 0.9][:len(acts)],
                         "activation_beta": [0.4, 1.1]}, **_tol(F32)))
    if op is Op.GRU:
        cases.append(OpCase("gru-linear-before-reset", op, _inputs(op, dirs=2, lens=[1, 4, 3]),
                            {"linear_before_reset": True, "direction": "bidirectional"},
                            **_tol(F32)))
    if op is Op.LSTM:
        cases.append(OpCase("lstm-peepholes-input-forget", op,
                            _inputs(op, initial=True, peep=True, lens=[3, 4, 1]),
                            {"input_forget": True}, **_tol(F32)))
    if op is Op.RNN:
        cases.append(OpCase("rnn-relu-affine-bidirectional", op, _inputs(op, dirs=2),
                            {"direction": "bidirectional", "activations": ["Relu", "Affine"],
                             "activation_alpha": [0.5], "activation_beta": [0.1]},
                            **_tol(F32)))
    return cases


CASES: list[OpCase] = [c for op in (Op.RNN, Op.GRU, Op.LSTM) for c in _cases(op)]
