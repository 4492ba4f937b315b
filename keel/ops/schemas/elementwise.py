"""Schemas of the elementwise family: binary, unary and ``where``.

Semantics follow ONNX (latest opset) with NumPy broadcasting. ``add`` and
``mul`` stay binary as in seed 001 (the importer chains ONNX ``Sum``);
``maximum`` and ``minimum`` are variadic like ONNX ``Max``/``Min``.

The dtype sets below are what ONNX allows for each op; ``infer`` rejects any
other dtype with an :class:`InvalidArgumentError`, and the kernels of every
backend declare the same sets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Shape, TensorType, broadcast_shapes, checked_numel

__all__ = [
    "ALL",
    "DTYPES",
    "FLOATS",
    "INTS",
    "NUMERIC",
    "SIGNED",
    "SIGNED_NUMERIC",
    "UNSIGNED",
    "check_choices",
    "check_dtype",
]

FLOATS = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
SIGNED = frozenset({DType.INT8, DType.INT16, DType.INT32, DType.INT64})
UNSIGNED = frozenset({DType.UINT8, DType.UINT16, DType.UINT32, DType.UINT64})
INTS = SIGNED | UNSIGNED
NUMERIC = FLOATS | INTS
SIGNED_NUMERIC = FLOATS | SIGNED
ALL = NUMERIC | {DType.BOOL}
BOOLS = frozenset({DType.BOOL})

# The dtypes of input 0 each op accepts (ONNX type constraints), for the
# elementwise, reduction and memory families; kernels declare the same sets.
DTYPES: dict[Op, frozenset[DType]] = {}


def check_dtype(op: Op, dtype: DType, allowed: frozenset[DType], what: str = "input") -> None:
    """Raise ``InvalidArgumentError`` unless ``dtype`` is in ``allowed``."""
    if dtype not in allowed:
        names = ", ".join(sorted(d.value for d in allowed))
        raise InvalidArgumentError(
            f"{op.value} does not take {dtype.value} {what}s; allowed: {names}"
        )


def _same_dtype(op: Op, types: Sequence[TensorType | None]) -> DType | None:
    known = [t.dtype for t in types if t is not None]
    if len(set(known)) > 1:
        raise InvalidArgumentError(
            f"{op.value} needs inputs of one dtype, got {', '.join(d.value for d in known)}"
        )
    return known[0] if known else None


def _broadcast(types: Sequence[TensorType | None]) -> Shape | None:
    shapes = [t.shape for t in types if t is not None]
    if len(shapes) < len(types) or any(s is None for s in shapes):
        return None
    out = broadcast_shapes(*[s for s in shapes if s is not None])
    dims = [d for d in out if isinstance(d, int)]
    if len(dims) == len(out):
        checked_numel(dims, what="broadcast shape")   # (2**40, 1) x (1, 2**40) overflows
    return out


# ---- binary --------------------------------------------------------------
def _binary_infer(op: Op, allowed: frozenset[DType], result: DType | None,
                  mixed: bool) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        dtype = types[0].dtype if types[0] is not None else None
        if not mixed:
            dtype = _same_dtype(op, types)
        if dtype is None:
            return [None]
        check_dtype(op, dtype, allowed)
        if op is Op.POW and types[1] is not None:
            check_dtype(op, types[1].dtype, NUMERIC, "exponent")
        check_choices(op, attrs)
        shape = _broadcast(types)
        if op is Op.PRELU and shape is not None and types[0] is not None:
            _check_unidirectional(types[0].shape, shape)
        return [TensorType(result or dtype, shape)]
    return infer


# Attributes that take one of a few values: (op, attribute) -> allowed values.
_CHOICES: dict[tuple[Op, str], tuple[Any, ...]] = {
    (Op.BIT_SHIFT, "direction"): ("LEFT", "RIGHT"),
    (Op.MOD, "fmod"): (0, 1),
    (Op.GELU, "approximate"): ("none", "tanh"),
}


def check_choices(op: Op, attrs: Mapping[str, Any]) -> None:
    """Raise ``InvalidArgumentError`` when an enumerated attribute has another value.

    Kernels call this too: ``Backend.run`` normalizes attributes but does not infer.
    """
    for (owner, name), allowed in _CHOICES.items():
        if owner is op and attrs.get(name) not in allowed:
            raise InvalidArgumentError(
                f"{op.value} attribute {name!r} must be one of "
                f"{', '.join(repr(a) for a in allowed)}; got {attrs.get(name)!r}"
            )


def _check_unidirectional(x: Shape | None, out: Shape) -> None:
    # PRelu broadcasts slope to X, never X to slope (ONNX unidirectional).
    if x is None:
        return
    differs = len(out) != len(x) or any(
        isinstance(a, int) and a != b for a, b in zip(x, out, strict=True))
    if differs:
        raise InvalidArgumentError(
            f"prelu slope must broadcast to X of shape {x}; together they give {out}"
        )


def _binary(op: Op, allowed: frozenset[DType], *, result: DType | None = None,
            attrs: tuple[AttrSpec, ...] = (), variadic: bool = False,
            mixed: bool = False, doc: str = "") -> None:
    DTYPES[op] = allowed
    register_schema(OpSchema(
        op, 1 if variadic else 2, None if variadic else 2, attrs,
        infer=_binary_infer(op, allowed, result, mixed),
        inplace=() if result is not None else ((0, 0),), doc=doc,
    ))


_binary(Op.ADD, NUMERIC, doc="A + B with NumPy broadcasting (seed 001).")
_binary(Op.SUB, NUMERIC, doc="A - B.")
_binary(Op.MUL, NUMERIC, doc="A * B with NumPy broadcasting (seed 001).")
_binary(Op.DIV, NUMERIC, doc="A / B; integer division truncates toward zero (ONNX Div).")
_binary(Op.POW, SIGNED_NUMERIC - {DType.INT8, DType.INT16}, mixed=True,
        doc="A ** B; B may have another numeric dtype; the output has A's dtype.")
_binary(Op.MOD, NUMERIC, attrs=(AttrSpec("fmod", AttrKind.INT, 0),),
        doc="fmod=0: result has the sign of B (floor); fmod=1: sign of A (C fmod).")
_binary(Op.MAXIMUM, NUMERIC, variadic=True, doc="Elementwise max of 1+ inputs; NaN wins.")
_binary(Op.MINIMUM, NUMERIC, variadic=True, doc="Elementwise min of 1+ inputs; NaN wins.")
_binary(Op.ADD_N, NUMERIC, variadic=True,
        doc="Elementwise sum of 1+ inputs broadcast together (ONNX Sum), one node however "
            "many inputs; added left to right in the inputs' dtype, as onnxruntime does.")
_binary(Op.EQUAL, ALL | {DType.STRING}, result=DType.BOOL,
        doc="A == B (strings too: element by element).")
for _op, _doc in ((Op.LESS, "A < B."), (Op.LESS_EQUAL, "A <= B."),
                  (Op.GREATER, "A > B."), (Op.GREATER_EQUAL, "A >= B.")):
    _binary(_op, NUMERIC, result=DType.BOOL, doc=_doc)
for _op, _doc in ((Op.AND, "Logical and."), (Op.OR, "Logical or."), (Op.XOR, "Logical xor.")):
    _binary(_op, BOOLS, doc=_doc)
for _op, _doc in ((Op.BITWISE_AND, "A & B."), (Op.BITWISE_OR, "A | B."),
                  (Op.BITWISE_XOR, "A ^ B.")):
    _binary(_op, INTS, doc=_doc)
_binary(Op.BIT_SHIFT, INTS, attrs=(AttrSpec("direction", AttrKind.STR, "LEFT"),),
        doc="A << B or A >> B (arithmetic for signed A); shifts outside 0..bits-1 "
            "give 0 (or -1 for a right shift of a negative A), as ONNX BitShift-28.")
_binary(Op.PRELU, SIGNED_NUMERIC - {DType.INT8, DType.INT16} | {DType.UINT32, DType.UINT64},
        doc="X if X >= 0 else slope * X; slope broadcasts to X.")


# ---- where ----------------------------------------------------------------
def _where_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                 values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    cond = types[0]
    if cond is not None:
        check_dtype(Op.WHERE, cond.dtype, BOOLS, "condition")
    dtype = _same_dtype(Op.WHERE, types[1:])
    if dtype is None:
        return [None]
    return [TensorType(dtype, _broadcast(types))]


DTYPES[Op.WHERE] = BOOLS
register_schema(OpSchema(
    Op.WHERE, 3, 3, infer=_where_infer, inplace=((1, 0),),
    doc="condition ? X : Y, the three broadcast together.",
))


# ---- unary ----------------------------------------------------------------
def _unary_infer(op: Op, allowed: frozenset[DType], result: DType | None) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [None]
        check_dtype(op, x.dtype, allowed)
        check_choices(op, attrs)
        for i, bound in enumerate(types[1:], start=1):   # clip's min and max
            if bound is not None:
                _check_bound(op, x.dtype, bound, i)
        return [TensorType(result or x.dtype, x.shape)]
    return infer


def _check_bound(op: Op, dtype: DType, bound: TensorType, index: int) -> None:
    if bound.dtype != dtype:
        raise InvalidArgumentError(
            f"{op.value} input {index} must be {dtype.value} like input 0, got {bound.dtype.value}"
        )
    if bound.is_static and bound.numel() != 1:
        raise InvalidArgumentError(
            f"{op.value} input {index} must hold one element, got shape {bound.shape}"
        )


def _unary(op: Op, allowed: frozenset[DType], *attrs: AttrSpec,
           result: DType | None = None, max_inputs: int = 1, doc: str = "") -> None:
    DTYPES[op] = allowed
    register_schema(OpSchema(
        op, 1, max_inputs, attrs, infer=_unary_infer(op, allowed, result),
        inplace=() if result is not None else ((0, 0),), doc=doc,
    ))


def _f(name: str, default: float | None) -> AttrSpec:
    return AttrSpec(name, AttrKind.FLOAT, default)


_unary(Op.RELU, SIGNED_NUMERIC, doc="max(X, 0) (seed 001).")
_unary(Op.NEG, SIGNED_NUMERIC, doc="-X.")
_unary(Op.ABS, NUMERIC, doc="|X|.")
_unary(Op.SIGN, NUMERIC, doc="-1, 0 or 1 (NaN stays NaN).")
_FLOAT_UNARY_DOCS = {
    Op.EXP: "e**X.", Op.LOG: "Natural log.", Op.SQRT: "Square root.", Op.TANH: "tanh.",
    Op.SIGMOID: "1 / (1 + e**-X).", Op.RECIPROCAL: "1 / X.", Op.FLOOR: "floor.",
    Op.CEIL: "ceil.", Op.ROUND: "Round half to even.", Op.SIN: "sin.", Op.COS: "cos.",
    Op.TAN: "tan.", Op.ASIN: "asin.", Op.ACOS: "acos.", Op.ATAN: "atan.", Op.SINH: "sinh.",
    Op.COSH: "cosh.", Op.ASINH: "asinh.", Op.ACOSH: "acosh.", Op.ATANH: "atanh.",
    Op.ERF: "The error function.", Op.HARD_SWISH: "X * max(0, min(1, X / 6 + 1/2)).",
    Op.SOFTPLUS: "log(1 + e**X).", Op.SOFTSIGN: "X / (1 + |X|).",
    Op.MISH: "X * tanh(softplus(X)).",
}
for _op, _doc in _FLOAT_UNARY_DOCS.items():
    _unary(_op, FLOATS, doc=_doc)
_unary(Op.NOT, BOOLS, doc="Logical not.")
_unary(Op.BITWISE_NOT, INTS, doc="~X.")
_unary(Op.ISNAN, FLOATS, result=DType.BOOL, doc="X is NaN.")
_unary(Op.ISINF, FLOATS, AttrSpec("detect_negative", AttrKind.BOOL, True),
       AttrSpec("detect_positive", AttrKind.BOOL, True), result=DType.BOOL,
       doc="X is +inf (detect_positive) or -inf (detect_negative).")
_unary(Op.CLIP, NUMERIC, _f("min", None), _f("max", None), max_inputs=3,
       doc="min(max(X, lo), hi). lo and hi are optional one-element inputs 1 and 2 "
           "(ONNX Clip-11+) or, for run_op callers, attributes 'min' and 'max'; giving "
           "one bound both ways is an error. lo > hi gives hi everywhere.")
_unary(Op.LEAKY_RELU, FLOATS, _f("alpha", 0.01), doc="X if X >= 0 else alpha * X.")
_unary(Op.HARD_SIGMOID, FLOATS, _f("alpha", 0.2), _f("beta", 0.5),
       doc="max(0, min(1, alpha * X + beta)).")
_unary(Op.GELU, FLOATS, AttrSpec("approximate", AttrKind.STR, "none"),
       doc="0.5 X (1 + erf(X / sqrt 2)); approximate='tanh' uses the tanh formula.")
_unary(Op.ELU, FLOATS, _f("alpha", 1.0), doc="X if X > 0 else alpha (e**X - 1).")
_unary(Op.SELU, FLOATS, _f("alpha", 1.67326319217681884765625),
       _f("gamma", 1.05070102214813232421875),
       doc="gamma * (X if X > 0 else alpha (e**X - 1)).")
_unary(Op.CELU, FLOATS, _f("alpha", 1.0),
       doc="max(0, X) + min(0, alpha (e**(X / alpha) - 1)).")
_unary(Op.THRESHOLDED_RELU, FLOATS, _f("alpha", 1.0), doc="X if X > alpha else 0.")
_unary(Op.SHRINK, NUMERIC - {DType.BFLOAT16}, _f("bias", 0.0), _f("lambd", 0.5),
       doc="X + bias if X < -lambd, X - bias if X > lambd, else 0.")
_unary(Op.SWISH, FLOATS, _f("alpha", 1.0), doc="X * sigmoid(alpha * X) (ONNX Swish).")

# ``DTYPES`` holds the dtypes of the memory and reduction ops too, which their families
# add: whoever reads it from here finds them all (schemas load by family, on first use).
from keel.ops.schemas import memory, reduction  # noqa: E402, F401
