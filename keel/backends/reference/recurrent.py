"""Reference kernels of the recurrent family: the ONNX equations, one time step at a time,
in float64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.recurrent import (
    FLOAT_DTYPES,
    Activation,
    check_clip,
    check_recurrent,
    check_sequence_lens,
    recurrent_activations,
)

__all__: list[str] = []

Fn = Callable[[np.ndarray], np.ndarray]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _function(act: Activation) -> Fn:
    a, b = act.alpha, act.beta
    table: dict[str, Fn] = {
        "relu": lambda x: np.maximum(x, 0.0),
        "tanh": np.tanh,
        "sigmoid": _sigmoid,
        "affine": lambda x: a * x + b,
        "leakyrelu": lambda x: np.where(x >= 0, x, a * x),
        "thresholdedrelu": lambda x: np.where(x > a, x, 0.0),
        "scaledtanh": lambda x: a * np.tanh(b * x),
        "hardsigmoid": lambda x: np.clip(a * x + b, 0.0, 1.0),
        "elu": lambda x: np.where(x >= 0, x, a * np.expm1(np.minimum(x, 0.0))),
        "softsign": lambda x: x / (1.0 + np.abs(x)),
        "softplus": lambda x: np.logaddexp(0.0, x),
    }
    return table[act.name]


def _opt(inputs: Inputs, i: int) -> np.ndarray | None:
    return inputs[i] if i < len(inputs) and inputs[i] is not None else None


def _prepare(op: Op, inputs: Inputs, attrs: Attrs) -> dict[str, Any]:
    """Checked float64 operands in layout 0 with defaults filled in."""
    x = inputs[0]
    if DType.from_numpy(x.dtype) not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"{op.value}: X must be float16, bfloat16, float32 or float64, got {x.dtype}")
    check_clip(op, attrs["clip"])
    shapes = [None if v is None else v.shape for v in (_opt(inputs, i) for i in range(8))]
    dirs = check_recurrent(op, shapes, attrs).dirs
    swap = (lambda a: np.swapaxes(a, 0, 1)) if attrs["layout"] else (lambda a: a)
    seq, batch, hidden = swap(x).shape[0], swap(x).shape[1], inputs[2].shape[2]
    gates = {Op.RNN: 1, Op.GRU: 3, Op.LSTM: 4}[op]
    lens = _opt(inputs, 4)
    seq_lens = [seq] * batch if lens is None else [int(v) for v in lens]
    check_sequence_lens(op, seq_lens, seq)
    zeros = np.zeros((dirs, batch, hidden))
    bias = _opt(inputs, 3)
    return {
        "x": swap(x).astype(np.float64),
        "w": inputs[1].astype(np.float64), "r": inputs[2].astype(np.float64),
        "b": np.zeros((dirs, 2 * gates * hidden)) if bias is None else bias.astype(np.float64),
        "h0": zeros if _opt(inputs, 5) is None else swap(inputs[5]).astype(np.float64),
        "c0": zeros if _opt(inputs, 6) is None else swap(inputs[6]).astype(np.float64),
        "p": np.zeros((dirs, 3 * hidden)) if _opt(inputs, 7) is None
        else inputs[7].astype(np.float64),
        "lens": np.array(seq_lens), "seq": seq, "hidden": hidden, "dirs": dirs,
        "acts": recurrent_activations(op, attrs), "clip": attrs["clip"],
    }


def _clip(v: np.ndarray, clip: float | None) -> np.ndarray:
    return v if clip is None else np.clip(v, -clip, clip)


def _rnn_step(d: dict[str, Any], k: int, xt: np.ndarray, state: tuple[np.ndarray, ...],
              attrs: Attrs) -> tuple[np.ndarray, ...]:
    (f,) = (_function(a) for a in d["acts"][k])
    wb, rb = np.split(d["b"][k], 2)
    pre = xt @ d["w"][k].T + state[0] @ d["r"][k].T + wb + rb
    return (f(_clip(pre, d["clip"])),)


def _gru_step(d: dict[str, Any], k: int, xt: np.ndarray, state: tuple[np.ndarray, ...],
              attrs: Attrs) -> tuple[np.ndarray, ...]:
    f, g = (_function(a) for a in d["acts"][k])
    h_prev = state[0]
    wz, wr, wh = np.split(d["w"][k], 3)
    rz, rr, rh = np.split(d["r"][k], 3)
    wbz, wbr, wbh, rbz, rbr, rbh = np.split(d["b"][k], 6)
    z = f(_clip(xt @ wz.T + h_prev @ rz.T + wbz + rbz, d["clip"]))
    r = f(_clip(xt @ wr.T + h_prev @ rr.T + wbr + rbr, d["clip"]))
    if attrs["linear_before_reset"]:
        pre = xt @ wh.T + r * (h_prev @ rh.T + rbh) + wbh
    else:
        pre = xt @ wh.T + (r * h_prev) @ rh.T + rbh + wbh
    h = g(_clip(pre, d["clip"]))
    return ((1 - z) * h + z * h_prev,)


def _lstm_step(d: dict[str, Any], k: int, xt: np.ndarray, state: tuple[np.ndarray, ...],
               attrs: Attrs) -> tuple[np.ndarray, ...]:
    f, g, h = (_function(a) for a in d["acts"][k])
    h_prev, c_prev = state
    wb, rb = np.split(d["b"][k], 2)
    pre = xt @ d["w"][k].T + h_prev @ d["r"][k].T + wb + rb
    pi, po, pf, pc = np.split(pre, 4, axis=-1)
    peep_i, peep_o, peep_f = np.split(d["p"][k], 3)
    i = f(_clip(pi + peep_i * c_prev, d["clip"]))
    forget = 1 - i if attrs["input_forget"] else f(_clip(pf + peep_f * c_prev, d["clip"]))
    c = forget * c_prev + i * g(_clip(pc, d["clip"]))
    o = f(_clip(po + peep_o * c, d["clip"]))
    return o * h(c), c


_STEPS = {Op.RNN: _rnn_step, Op.GRU: _gru_step, Op.LSTM: _lstm_step}


def _run(op: Op, inputs: Inputs, attrs: Attrs) -> list[Any]:
    d = _prepare(op, inputs, attrs)
    x, seq, dirs = d["x"], d["seq"], d["dirs"]
    batch, hidden = x.shape[1], d["hidden"]
    y = np.zeros((seq, dirs, batch, hidden))
    finals: list[tuple[np.ndarray, ...]] = []
    for k in range(dirs):
        reverse = attrs["direction"] == "reverse" or k == 1
        state: tuple[np.ndarray, ...] = (d["h0"][k], d["c0"][k]) if op is Op.LSTM \
            else (d["h0"][k],)
        for t in (reversed(range(seq)) if reverse else range(seq)):
            new = _STEPS[op](d, k, x[t], state, attrs)
            live = (t < d["lens"])[:, None]        # rows past their length keep their state
            state = tuple(np.where(live, n, s) for n, s in zip(new, state, strict=True))
            y[t, k] = np.where(live, new[0], 0.0)
        finals.append(state)
    outs = [y] + [np.stack([s[j] for s in finals]) for j in range(len(finals[0]))]
    if attrs["layout"]:
        outs = [np.transpose(outs[0], (2, 0, 1, 3))] + [np.swapaxes(o, 0, 1) for o in outs[1:]]
    return [o.astype(inputs[0].dtype) for o in outs]


@TABLE.kernel(Op.RNN, dtypes=FLOAT_DTYPES)
def rnn(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX RNN: Y, Y_h."""
    return _run(Op.RNN, inputs, attrs)


@TABLE.kernel(Op.GRU, dtypes=FLOAT_DTYPES)
def gru(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX GRU: Y, Y_h."""
    return _run(Op.GRU, inputs, attrs)


@TABLE.kernel(Op.LSTM, dtypes=FLOAT_DTYPES)
def lstm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX LSTM: Y, Y_h, Y_c."""
    return _run(Op.LSTM, inputs, attrs)
