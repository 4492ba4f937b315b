"""Reference kernels of the elementwise family: the executable spec.

Float inputs are widened to float64, the math runs there and the result is
cast to the output dtype. Integer inputs use NumPy's integer ops, which wrap
like C. Every function below is written for readability, not speed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import KernelContext
from keel.backends.reference.kernels import TABLE
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.elementwise import DTYPES, check_choices

__all__ = ["erf"]

Attrs = Mapping[str, Any]
Fn = Callable[..., Any]

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)


def _give(y: np.ndarray, out: Sequence[Any] | None) -> list[Any]:
    """The result as a fresh array, or written into the caller's output."""
    if out is None:
        return [y]
    out[0][...] = y
    return [out[0]]


def _wide(x: Any) -> np.ndarray:
    """Float arrays widened to float64; others unchanged."""
    x = np.asarray(x)
    return x.astype(np.float64) if x.dtype.kind == "f" else x


def erf(x: np.ndarray) -> np.ndarray:
    """The error function in float64, element by element with ``math.erf``."""
    return np.asarray(np.frompyfunc(math.erf, 1, 1)(np.asarray(x, np.float64)), np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _gelu(x: np.ndarray, a: Attrs) -> np.ndarray:
    if a["approximate"] == "tanh":
        return 0.5 * x * (1.0 + np.tanh(_GELU_TANH_SCALE * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + erf(x * _SQRT1_2))


def _shrink(x: np.ndarray, a: Attrs) -> np.ndarray:
    bias, lambd = a["bias"], a["lambd"]
    return np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, 0.0))


# Unary ops: fn(x, attrs) on float64 (float inputs) or native integers/bools.
_UNARY: dict[Op, Fn] = {
    Op.RELU: lambda x, a: np.maximum(x, 0),
    Op.NEG: lambda x, a: np.negative(x),
    Op.ABS: lambda x, a: np.abs(x),
    Op.SIGN: lambda x, a: np.sign(x),
    Op.EXP: lambda x, a: np.exp(x),
    Op.LOG: lambda x, a: np.log(x),
    Op.SQRT: lambda x, a: np.sqrt(x),
    Op.TANH: lambda x, a: np.tanh(x),
    Op.SIGMOID: lambda x, a: _sigmoid(x),
    Op.RECIPROCAL: lambda x, a: 1.0 / x,
    Op.FLOOR: lambda x, a: np.floor(x),
    Op.CEIL: lambda x, a: np.ceil(x),
    Op.ROUND: lambda x, a: np.round(x),          # half to even
    Op.SIN: lambda x, a: np.sin(x),
    Op.COS: lambda x, a: np.cos(x),
    Op.TAN: lambda x, a: np.tan(x),
    Op.ASIN: lambda x, a: np.arcsin(x),
    Op.ACOS: lambda x, a: np.arccos(x),
    Op.ATAN: lambda x, a: np.arctan(x),
    Op.SINH: lambda x, a: np.sinh(x),
    Op.COSH: lambda x, a: np.cosh(x),
    Op.ASINH: lambda x, a: np.arcsinh(x),
    Op.ACOSH: lambda x, a: np.arccosh(x),
    Op.ATANH: lambda x, a: np.arctanh(x),
    Op.ERF: lambda x, a: erf(x),
    Op.NOT: lambda x, a: np.logical_not(x),
    Op.BITWISE_NOT: lambda x, a: np.invert(x),
    Op.LEAKY_RELU: lambda x, a: np.where(x >= 0, x, a["alpha"] * x),
    Op.HARD_SIGMOID: lambda x, a: np.clip(a["alpha"] * x + a["beta"], 0.0, 1.0),
    Op.HARD_SWISH: lambda x, a: x * np.clip(x / 6.0 + 0.5, 0.0, 1.0),
    Op.GELU: _gelu,
    Op.ELU: lambda x, a: np.where(x > 0, x, a["alpha"] * np.expm1(x)),
    Op.SELU: lambda x, a: a["gamma"] * np.where(x > 0, x, a["alpha"] * np.expm1(x)),
    Op.CELU: lambda x, a: (np.maximum(x, 0.0)
                           + np.minimum(0.0, a["alpha"] * np.expm1(x / a["alpha"]))),
    Op.SOFTPLUS: lambda x, a: np.logaddexp(0.0, x),
    Op.SOFTSIGN: lambda x, a: x / (1.0 + np.abs(x)),
    Op.THRESHOLDED_RELU: lambda x, a: np.where(x > a["alpha"], x, 0.0),
    Op.SHRINK: _shrink,
    Op.MISH: lambda x, a: x * np.tanh(np.logaddexp(0.0, x)),
    Op.SWISH: lambda x, a: x * _sigmoid(a["alpha"] * x),
}


def _unary_kernel(op: Op, fn: Fn) -> Callable[..., list[Any]]:
    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        check_choices(op, attrs)
        x = np.asarray(inputs[0])
        # Shrink's float bias on integers: compute in float64, truncate back (ONNX).
        source = x.astype(np.float64) if op is Op.SHRINK else _wide(x)
        with np.errstate(all="ignore"):
            y = np.asarray(fn(source, attrs)).astype(x.dtype)
        return _give(y, out)
    return kernel


def _isnan(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
           out: Sequence[Any] | None) -> list[Any]:
    return _give(np.isnan(inputs[0]), out)


def _isinf(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
           out: Sequence[Any] | None) -> list[Any]:
    x = np.asarray(inputs[0])
    positive = np.isposinf(x) & attrs["detect_positive"]
    negative = np.isneginf(x) & attrs["detect_negative"]
    return _give(positive | negative, out)


def _bound(inputs: Sequence[Any], index: int, attrs: Attrs, name: str,
           dtype: np.dtype[Any]) -> np.ndarray | None:
    """Clip's bound ``name``: input ``index`` or the attribute, converted to ``dtype``."""
    given = inputs[index] if len(inputs) > index else None
    if given is not None and attrs.get(name) is not None:
        raise InvalidArgumentError(
            f"clip got its {name} twice: as input {index} and as attribute {name!r}"
        )
    if given is not None:
        arr = np.asarray(given)
        if arr.size != 1:
            raise InvalidArgumentError(
                f"clip input {index} ({name}) must hold one element, got shape {arr.shape}"
            )
        return arr.reshape(())
    if attrs.get(name) is None:
        return None
    value = float(attrs[name])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        value = min(max(value, float(info.min)), float(info.max))
        return np.array(int(value), dtype=dtype)
    return np.array(value, dtype=dtype)


def _clip(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
          out: Sequence[Any] | None) -> list[Any]:
    x = np.asarray(inputs[0])
    lo = _bound(inputs, 1, attrs, "min", x.dtype)
    hi = _bound(inputs, 2, attrs, "max", x.dtype)
    y = _wide(x)
    if lo is not None:
        y = np.maximum(y, _wide(lo))
    if hi is not None:
        y = np.minimum(y, _wide(hi))
    return _give(np.asarray(y).astype(x.dtype), out)


for _op, _fn in _UNARY.items():
    TABLE.kernel(_op, dtypes=DTYPES[_op], supports_out=True)(_unary_kernel(_op, _fn))
TABLE.kernel(Op.ISNAN, dtypes=DTYPES[Op.ISNAN], supports_out=True)(_isnan)
TABLE.kernel(Op.ISINF, dtypes=DTYPES[Op.ISINF], supports_out=True)(_isinf)
TABLE.kernel(Op.CLIP, dtypes=DTYPES[Op.CLIP], supports_out=True)(_clip)


# ---- binary -------------------------------------------------------------------
def _div(a: np.ndarray, b: np.ndarray, attrs: Attrs) -> np.ndarray:
    if a.dtype.kind == "f":
        return a / b
    # Integer division truncates toward zero (C, ONNX), unlike NumPy's floor.
    q = np.floor_divide(a, b)
    adjust = (np.remainder(a, b) != 0) & ((a < 0) ^ (b < 0))
    return q + adjust.astype(q.dtype)


def _pow(a: np.ndarray, b: np.ndarray, attrs: Attrs) -> np.ndarray:
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        return np.power(a.astype(np.float64), b.astype(np.float64))
    negative = b < 0
    power = np.power(a, np.where(negative, 0, b).astype(a.dtype))
    # a ** -n truncated toward zero: ±1 for |a| == 1, else 0.
    inverse = np.where(np.abs(a) == 1, np.where(b % 2 == 0, 1, a), 0)
    return np.where(negative, inverse, power)


def _mod(a: np.ndarray, b: np.ndarray, attrs: Attrs) -> np.ndarray:
    return np.fmod(a, b) if attrs["fmod"] == 1 else np.mod(a, b)


def _bit_shift(a: np.ndarray, b: np.ndarray, attrs: Attrs) -> np.ndarray:
    bits = a.dtype.itemsize * 8
    valid = (b >= 0) & (b < bits)
    shift = np.where(valid, b, 0)
    if attrs["direction"] == "LEFT":
        # Shift the unsigned bit pattern: bits past the sign bit are dropped.
        unsigned = np.dtype(f"u{a.dtype.itemsize}")
        moved = np.left_shift(a.view(unsigned), shift.astype(unsigned)).view(a.dtype)
        return np.where(valid, moved, 0)
    moved = np.right_shift(a, shift.astype(a.dtype))      # arithmetic for signed a
    sign_fill = np.negative((a < 0).astype(a.dtype))      # -1 where a < 0, else 0
    return np.where(valid, moved, sign_fill)


def _prelu(x: np.ndarray, slope: np.ndarray, attrs: Attrs) -> np.ndarray:
    return np.where(x >= 0, x, x * slope)


_BINARY: dict[Op, Fn] = {
    Op.ADD: lambda a, b, _: a + b,
    Op.SUB: lambda a, b, _: a - b,
    Op.MUL: lambda a, b, _: a * b,
    Op.DIV: _div,
    Op.POW: _pow,
    Op.MOD: _mod,
    Op.EQUAL: lambda a, b, _: a == b,
    Op.LESS: lambda a, b, _: a < b,
    Op.LESS_EQUAL: lambda a, b, _: a <= b,
    Op.GREATER: lambda a, b, _: a > b,
    Op.GREATER_EQUAL: lambda a, b, _: a >= b,
    Op.AND: lambda a, b, _: np.logical_and(a, b),
    Op.OR: lambda a, b, _: np.logical_or(a, b),
    Op.XOR: lambda a, b, _: np.logical_xor(a, b),
    Op.BITWISE_AND: lambda a, b, _: np.bitwise_and(a, b),
    Op.BITWISE_OR: lambda a, b, _: np.bitwise_or(a, b),
    Op.BITWISE_XOR: lambda a, b, _: np.bitwise_xor(a, b),
    Op.BIT_SHIFT: _bit_shift,
    Op.PRELU: _prelu,
}
_PREDICATES = frozenset({Op.EQUAL, Op.LESS, Op.LESS_EQUAL, Op.GREATER, Op.GREATER_EQUAL})


def _binary_kernel(op: Op, fn: Fn) -> Callable[..., list[Any]]:
    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        check_choices(op, attrs)
        a, b = np.asarray(inputs[0]), np.asarray(inputs[1])
        result = np.dtype(np.bool_) if op in _PREDICATES else a.dtype
        with np.errstate(all="ignore"):
            y = np.asarray(fn(_wide(a), _wide(b), attrs)).astype(result)
        return _give(y, out)
    return kernel


def _variadic(fn: Fn) -> Callable[..., list[Any]]:
    """``fn`` folded over the inputs left to right, in float64 for floats (Max, Min, Sum)."""
    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        arrays = [np.asarray(x) for x in inputs]
        y = functools.reduce(fn, [_wide(x) for x in arrays])   # NaN propagates
        return _give(np.asarray(y).astype(arrays[0].dtype), out)
    return kernel


def _where(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
           out: Sequence[Any] | None) -> list[Any]:
    cond, x, y = (np.asarray(v) for v in inputs)
    return _give(np.where(cond, x, y).astype(x.dtype), out)


for _op, _fn in _BINARY.items():
    TABLE.kernel(_op, dtypes=DTYPES[_op], supports_out=True)(_binary_kernel(_op, _fn))
TABLE.kernel(Op.MAXIMUM, dtypes=DTYPES[Op.MAXIMUM], supports_out=True)(_variadic(np.maximum))
TABLE.kernel(Op.MINIMUM, dtypes=DTYPES[Op.MINIMUM], supports_out=True)(_variadic(np.minimum))
TABLE.kernel(Op.ADD_N, dtypes=DTYPES[Op.ADD_N], supports_out=True)(_variadic(np.add))
TABLE.kernel(Op.WHERE, dtypes=DTYPES[Op.WHERE], supports_out=True)(_where)
