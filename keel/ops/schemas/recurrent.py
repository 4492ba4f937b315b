"""Schemas of the recurrent family: ONNX RNN, GRU and LSTM (opset 22).

Shapes (layout 0; layout 1 swaps the first two axes of X, Y, initial and final
states): X (T, B, I), W (dirs, gates * H, I), R (dirs, gates * H, H), B (dirs,
2 * gates * H), sequence_lens (B,), initial_h / initial_c (dirs, B, H), P
(dirs, 3 * H); outputs Y (T, dirs, B, H), Y_h and Y_c (dirs, B, H). Gate order
is ONNX's: GRU z, r, h; LSTM i, o, f, c. ``direction`` is forward, reverse or
bidirectional. ``activations`` lists f (RNN), f, g (GRU) or f, g, h (LSTM)
per direction (once for both, or once each); empty means ONNX's defaults
(Tanh; Sigmoid, Tanh; Sigmoid, Tanh, Tanh). Functions that take parameters
consume ``activation_alpha`` / ``activation_beta`` in order. ``clip`` bounds the
gate pre-activations. Past its ``sequence_lens`` entry a batch row keeps its
state and its Y rows are zero; the reverse direction starts at its last valid
step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schema import AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, Shape, TensorType

__all__ = [
    "ACTIVATIONS",
    "FLOAT_DTYPES",
    "Activation",
    "RecurrentShapes",
    "check_clip",
    "check_recurrent",
    "check_sequence_lens",
    "recurrent_activations",
]

FLOAT_DTYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
GATES = {Op.RNN: 1, Op.GRU: 3, Op.LSTM: 4}
_DEFAULTS = {Op.RNN: ("tanh",), Op.GRU: ("sigmoid", "tanh"),
             Op.LSTM: ("sigmoid", "tanh", "tanh")}
_DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}

# Activation name (lower case) → (default alpha, default beta); None: takes no parameter.
ACTIVATIONS: dict[str, tuple[float | None, float | None]] = {
    "relu": (None, None), "tanh": (None, None), "sigmoid": (None, None),
    "affine": (1.0, 0.0), "leakyrelu": (0.01, None), "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, None),
    "softsign": (None, None), "softplus": (None, None),
}


@dataclass(frozen=True)
class Activation:
    """One activation function with its parameters."""

    name: str
    alpha: float = 0.0
    beta: float = 0.0


def recurrent_activations(op: Op, attrs: Mapping[str, Any]) -> list[list[Activation]]:
    """The activation functions of each direction, with their alpha and beta."""
    dirs = _DIRECTIONS[check_direction(op, attrs["direction"])]
    per_dir = len(_DEFAULTS[op])
    names = [str(n).lower() for n in attrs["activations"] or ()] or list(_DEFAULTS[op]) * dirs
    if len(names) == per_dir and dirs == 2:
        names = names * 2
    if len(names) != per_dir * dirs:
        raise InvalidArgumentError(
            f"{op.value}: activations must list {per_dir} function(s) per direction "
            f"({per_dir * dirs} for direction {attrs['direction']}), got {len(names)}")
    alphas, betas = list(attrs["activation_alpha"]), list(attrs["activation_beta"])
    acts = []
    for name in names:
        if name not in ACTIVATIONS:
            raise UnsupportedOperationError(
                op.value, detail=f"activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
        da, db = ACTIVATIONS[name]
        alpha = alphas.pop(0) if da is not None and alphas else (da or 0.0)
        beta = betas.pop(0) if db is not None and betas else (db or 0.0)
        acts.append(Activation(name, alpha, beta))
    return [acts[d * per_dir:(d + 1) * per_dir] for d in range(dirs)]


def check_direction(op: Op, direction: str) -> str:
    if direction not in _DIRECTIONS:
        raise InvalidArgumentError(
            f"{op.value}: direction must be forward, reverse or bidirectional, got "
            f"{direction!r}")
    return direction


@dataclass(frozen=True)
class RecurrentShapes:
    seq: Dim
    batch: Dim
    inputs: Dim
    hidden: Dim
    dirs: int


def _agree(a: Dim, b: Dim) -> bool:
    return not (isinstance(a, int) and isinstance(b, int) and a != b)


def _expect(op: Op, name: str, shape: Sequence[Dim] | None, want: Sequence[Dim]) -> None:
    if shape is not None and (len(shape) != len(want) or not all(map(_agree, shape, want))):
        raise InvalidArgumentError(
            f"{op.value}: {name} must have shape {tuple('?' if d is None else d for d in want)}, "
            f"got {tuple(shape)}")


def check_recurrent(op: Op, shapes: Sequence[Sequence[Dim] | None],
                    attrs: Mapping[str, Any]) -> RecurrentShapes:
    """Check every input shape (None: absent or unknown); the problem's dimensions."""
    dirs = _DIRECTIONS[check_direction(op, attrs["direction"])]
    if attrs["layout"] not in (0, 1):
        raise InvalidArgumentError(f"{op.value}: layout must be 0 or 1, got {attrs['layout']}")
    x, w, r = shapes[0], shapes[1], shapes[2]
    if x is None or w is None or r is None or len(x) != 3 or len(w) != 3 or len(r) != 3:
        raise InvalidArgumentError(
            f"{op.value}: X, W and R must be 3-D, got {x}, {w} and {r}")
    seq, batch = (x[1], x[0]) if attrs["layout"] else (x[0], x[1])
    hidden = r[2]
    if attrs["hidden_size"] is not None and not _agree(attrs["hidden_size"], hidden):
        raise InvalidArgumentError(
            f"{op.value}: hidden_size {attrs['hidden_size']} disagrees with R {tuple(r)}")
    g = GATES[op]
    gh = g * hidden if isinstance(hidden, int) else None
    _expect(op, "W", w, (dirs, gh, x[2]))
    _expect(op, "R", r, (dirs, gh, hidden))
    at = list(shapes) + [None] * 8
    _expect(op, "B", at[3], (dirs, None if gh is None else 2 * gh))
    _expect(op, "sequence_lens", at[4], (batch,))
    state = (batch, dirs, hidden) if attrs["layout"] else (dirs, batch, hidden)
    _expect(op, "initial_h", at[5], state)
    if op is Op.LSTM:
        _expect(op, "initial_c", at[6], state)
        _expect(op, "P", at[7], (dirs, None if not isinstance(hidden, int) else 3 * hidden))
    return RecurrentShapes(seq, batch, x[2], hidden, dirs)


def check_clip(op: Op, clip: float | None) -> None:
    if clip is not None and not clip > 0:
        raise InvalidArgumentError(f"{op.value}: clip must be > 0, got {clip}")


def check_sequence_lens(op: Op, lens: Sequence[int], seq: int) -> None:
    bad = [n for n in lens if not 0 <= n <= seq]
    if bad:
        raise InvalidArgumentError(
            f"{op.value}: sequence_lens entries must be in [0, {seq}], got {bad[0]}")


def _infer(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        recurrent_activations(op, attrs)
        check_clip(op, attrs["clip"])
        n = 3 if op is Op.LSTM else 2
        x = types[0]
        if x is None:
            return [None] * n
        if x.dtype not in FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"{op.value}: X must be float16, bfloat16, float32 or float64, got {x.dtype.value}")
        shapes = [None if t is None or t.shape is None else tuple(t.shape) for t in types]
        if any(s is None for s in shapes[:3]):
            return [TensorType(x.dtype, None)] * n
        s = check_recurrent(op, shapes, attrs)
        y: Shape = (s.batch, s.seq, s.dirs, s.hidden) if attrs["layout"] \
            else (s.seq, s.dirs, s.batch, s.hidden)
        state: Shape = (s.batch, s.dirs, s.hidden) if attrs["layout"] \
            else (s.dirs, s.batch, s.hidden)
        out: list[TensorType | None] = [TensorType(x.dtype, y), TensorType(x.dtype, state),
                                        TensorType(x.dtype, state)]
        return out[:n]
    return infer


_COMMON = (
    AttrSpec("activation_alpha", AttrKind.FLOATS, ()),
    AttrSpec("activation_beta", AttrKind.FLOATS, ()),
    AttrSpec("activations", AttrKind.STRS, None),
    AttrSpec("clip", AttrKind.FLOAT, None),
    AttrSpec("direction", AttrKind.STR, "forward"),
    AttrSpec("hidden_size", AttrKind.INT, None),
    AttrSpec("layout", AttrKind.INT, 0),
)

register_schema(OpSchema(
    Op.RNN, 3, 6, attrs=_COMMON, infer=_infer(Op.RNN), max_outputs=2,
    doc="ONNX RNN: H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb). Outputs Y, Y_h.",
))
register_schema(OpSchema(
    Op.GRU, 3, 6, attrs=(*_COMMON, AttrSpec("linear_before_reset", AttrKind.BOOL, False)),
    infer=_infer(Op.GRU), max_outputs=2,
    doc="ONNX GRU (gates z, r, h): H_t = (1 - z) * h + z * H_{t-1}. Outputs Y, Y_h.",
))
register_schema(OpSchema(
    Op.LSTM, 3, 8, attrs=(*_COMMON, AttrSpec("input_forget", AttrKind.BOOL, False)),
    infer=_infer(Op.LSTM), max_outputs=3,
    doc="ONNX LSTM (gates i, o, f, c; peepholes P): C_t = f * C_{t-1} + i * c, "
        "H_t = o * h(C_t). Outputs Y, Y_h, Y_c.",
))
