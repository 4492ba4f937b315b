"""cpu kernels of the recurrent family, written once against ``ctx.xp``.

The input projection of every time step is one GEMM up front
((T * B, I) @ (I, gates * H), both biases folded in); each step then adds one
(B, H) @ (H, gates * H) product for the recurrence. Computation is in float32
(float64 for float64 inputs). Masking for ``sequence_lens`` is skipped when
every row runs the full length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.cpu.kernels import TABLE
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

Fn = Callable[[Any], Any]


def _function(xp: Any, act: Activation, clip: float | None) -> Fn:
    a, b = act.alpha, act.beta
    table: dict[str, Fn] = {
        "relu": lambda x: xp.maximum(x, 0),
        "tanh": xp.tanh,
        "sigmoid": lambda x: 0.5 * (xp.tanh(0.5 * x) + 1),   # no overflow for large |x|
        "affine": lambda x: a * x + b,
        "leakyrelu": lambda x: xp.where(x >= 0, x, a * x),
        "thresholdedrelu": lambda x: xp.where(x > a, x, 0),
        "scaledtanh": lambda x: a * xp.tanh(b * x),
        "hardsigmoid": lambda x: xp.clip(a * x + b, 0, 1),
        "elu": lambda x: xp.where(x >= 0, x, a * xp.expm1(xp.minimum(x, 0))),
        "softsign": lambda x: x / (1 + xp.abs(x)),
        "softplus": lambda x: xp.logaddexp(0, x),
    }
    fn = table[act.name]
    if clip is None:
        return fn
    return lambda x: fn(xp.clip(x, -clip, clip))


def _packed(xp: Any, weights: Any) -> Any:
    """weights.T as a contiguous array: the per-step GEMMs reuse it T times."""
    return xp.ascontiguousarray(weights.T)


def _opt(inputs: Inputs, i: int) -> Any:
    return inputs[i] if i < len(inputs) and inputs[i] is not None else None


class _Problem:
    """Checked operands in layout 0 and the compute dtype, defaults filled in."""

    def __init__(self, xp: Any, op: Op, inputs: Inputs, attrs: Attrs) -> None:
        x = inputs[0]
        if DType.from_numpy(x.dtype) not in FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"{op.value}: X must be float16, float32 or float64, got {x.dtype}")
        check_clip(op, attrs["clip"])
        s = check_recurrent(op, [None if v is None else v.shape
                                 for v in (_opt(inputs, i) for i in range(8))], attrs)
        self.ct = xp.float64 if x.dtype == xp.float64 else xp.float32
        self.dirs = s.dirs
        swap = (lambda a: xp.swapaxes(a, 0, 1)) if attrs["layout"] else (lambda a: a)
        self.x = swap(x).astype(self.ct)
        self.seq, self.batch, self.hidden = self.x.shape[0], self.x.shape[1], \
            inputs[2].shape[2]
        self.w, self.r = inputs[1].astype(self.ct), inputs[2].astype(self.ct)
        gates = {Op.RNN: 1, Op.GRU: 3, Op.LSTM: 4}[op]
        bias = _opt(inputs, 3)
        self.b = xp.zeros((self.dirs, 2 * gates * self.hidden), dtype=self.ct) if bias is None \
            else bias.astype(self.ct)
        zeros = xp.zeros((self.dirs, self.batch, self.hidden), dtype=self.ct)
        self.h0 = zeros if _opt(inputs, 5) is None else swap(inputs[5]).astype(self.ct)
        self.c0 = zeros if _opt(inputs, 6) is None else swap(inputs[6]).astype(self.ct)
        peep = _opt(inputs, 7)
        self.p = None if peep is None else peep.astype(self.ct)
        lens = _opt(inputs, 4)
        self.lens = None
        if lens is not None:
            host = [int(v) for v in lens.reshape(-1).tolist()]
            check_sequence_lens(op, host, self.seq)
            if any(n != self.seq for n in host):
                self.lens = lens.astype(xp.int64)
        self.fns = [[_function(xp, a, attrs["clip"]) for a in acts]
                    for acts in recurrent_activations(op, attrs)]

    def projected(self, xp: Any, k: int, extra_bias: Any) -> Any:
        """X_t W^T + bias for every step t: (T, B, gates * H)."""
        t, b, i = self.x.shape
        proj = xp.matmul(self.x.reshape(t * b, i), _packed(xp, self.w[k])).reshape(t, b,
                                                                       self.w.shape[1])
        proj += extra_bias
        return proj


def _rnn_dir(xp: Any, pr: _Problem, k: int, attrs: Attrs) -> Any:
    half = pr.b.shape[1] // 2
    proj = pr.projected(xp, k, pr.b[k, :half] + pr.b[k, half:])
    rt = _packed(xp, pr.r[k])
    (f,) = pr.fns[k]

    def step(t: int, state: tuple[Any, ...]) -> tuple[Any, ...]:
        return (f(proj[t] + xp.matmul(state[0], rt)),)
    return step, (pr.h0[k],)


def _gru_dir(xp: Any, pr: _Problem, k: int, attrs: Attrs) -> Any:
    hid = pr.hidden
    wb, rb = pr.b[k, :3 * hid], pr.b[k, 3 * hid:]
    # z and r take both biases up front; the h gate's recurrent bias depends on the mode.
    proj = pr.projected(xp, k, xp.concatenate([wb[:2 * hid] + rb[:2 * hid], wb[2 * hid:]]))
    r_zr, r_h, rbh = _packed(xp, pr.r[k, :2 * hid]), _packed(xp, pr.r[k, 2 * hid:]), rb[2 * hid:]
    f, g = pr.fns[k]
    linear = attrs["linear_before_reset"]

    def step(t: int, state: tuple[Any, ...]) -> tuple[Any, ...]:
        h_prev = state[0]
        zr = f(proj[t, :, :2 * hid] + xp.matmul(h_prev, r_zr))
        z, r = zr[:, :hid], zr[:, hid:]
        if linear:
            h = g(proj[t, :, 2 * hid:] + r * (xp.matmul(h_prev, r_h) + rbh))
        else:
            h = g(proj[t, :, 2 * hid:] + xp.matmul(r * h_prev, r_h) + rbh)
        return (h + z * (h_prev - h),)
    return step, (pr.h0[k],)


def _lstm_dir(xp: Any, pr: _Problem, k: int, attrs: Attrs) -> Any:
    hid = pr.hidden
    proj = pr.projected(xp, k, pr.b[k, :4 * hid] + pr.b[k, 4 * hid:])
    rt = _packed(xp, pr.r[k])
    f, g, h = pr.fns[k]
    peep = None if pr.p is None else (pr.p[k, :hid], pr.p[k, hid:2 * hid], pr.p[k, 2 * hid:])
    coupled = attrs["input_forget"]

    def step(t: int, state: tuple[Any, ...]) -> tuple[Any, ...]:
        h_prev, c_prev = state
        pre = proj[t] + xp.matmul(h_prev, rt)
        pi, po, pf, pc = (pre[:, j * hid:(j + 1) * hid] for j in range(4))
        if peep is not None:
            pi, pf = pi + peep[0] * c_prev, pf + peep[2] * c_prev
        i = f(pi)
        c = (1 - i if coupled else f(pf)) * c_prev + i * g(pc)
        o = f(po if peep is None else po + peep[1] * c)
        return o * h(c), c
    return step, (pr.h0[k], pr.c0[k])


_DIRECTIONS = {Op.RNN: _rnn_dir, Op.GRU: _gru_dir, Op.LSTM: _lstm_dir}


def _run(xp: Any, op: Op, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    pr = _Problem(xp, op, inputs, attrs)
    y = xp.zeros((pr.seq, pr.dirs, pr.batch, pr.hidden), dtype=pr.ct)
    finals = []
    for k in range(pr.dirs):
        step, state = _DIRECTIONS[op](xp, pr, k, attrs)
        reverse = attrs["direction"] == "reverse" or k == 1
        for t in (range(pr.seq - 1, -1, -1) if reverse else range(pr.seq)):
            new = step(t, state)
            if pr.lens is None:
                state = new
                y[t, k] = new[0]
                continue
            live = (t < pr.lens)[:, None]        # rows past their length keep their state
            state = tuple(xp.where(live, n, s) for n, s in zip(new, state, strict=True))
            y[t, k] = xp.where(live, new[0], 0)
        finals.append(state)
    outs = [y] + [xp.stack([s[j] for s in finals]) for j in range(len(finals[0]))]
    if attrs["layout"]:
        outs = [xp.transpose(outs[0], (2, 0, 1, 3))] + [xp.swapaxes(o, 0, 1) for o in outs[1:]]
    dtype = inputs[0].dtype
    results = []
    for i, o in enumerate(outs):
        if out is not None and len(out) > i and out[i] is not None:
            out[i][...] = o
            results.append(out[i])
        else:
            results.append(o.astype(dtype, copy=False))
    return results


@TABLE.kernel(Op.RNN, dtypes=FLOAT_DTYPES, supports_out=True)
def rnn(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX RNN: Y, Y_h."""
    return _run(ctx.xp, Op.RNN, inputs, attrs, out)


@TABLE.kernel(Op.GRU, dtypes=FLOAT_DTYPES, supports_out=True)
def gru(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX GRU: Y, Y_h."""
    return _run(ctx.xp, Op.GRU, inputs, attrs, out)


@TABLE.kernel(Op.LSTM, dtypes=FLOAT_DTYPES, supports_out=True)
def lstm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX LSTM: Y, Y_h, Y_c."""
    return _run(ctx.xp, Op.LSTM, inputs, attrs, out)

