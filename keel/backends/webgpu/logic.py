"""Cast, comparisons, logic, ``where``, integer arithmetic, bitwise ops and shifts,
PReLU, Maximum/Minimum and IsNaN/IsInf of the webgpu backend.

Each runs one typed element map (:mod:`keel.backends.webgpu.typed`): every dtype
the backend holds (float32, float16, int32, int64 as word pairs, uint8, int8,
bool), read in place through its strides. Cast follows ONNX (and NumPy's
``astype``): float to integer truncates toward zero, anything to bool is
``x != 0`` (NaN is true), integers narrow by keeping their low bits, int64 to
float rounds to nearest even. Casts from or to a dtype WGSL cannot hold
(float64, 16-bit and unsigned 32/64-bit integers, ml_dtypes' narrow types)
raise ``UnsupportedOperationError`` saying why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, KernelTable, Out
from keel.backends.webgpu.typed import KINDS, NAMES, domain, kind_of, run_map
from keel.dtypes import DType
from keel.errors import UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schemas.elementwise import DTYPES

__all__ = ["INT_DTYPES", "cast_expr", "integer", "register"]

HELD = tuple(sorted(DType.from_numpy(d).value for d in KINDS))
INT_DTYPES = ("int32", "int64", "int8", "uint8")

# Integer arithmetic per domain: i32 (int32, and int8/uint8 whose stores keep the low
# byte) and int64 word pairs. Division truncates toward zero (ONNX, C).
INTEGER: dict[Op, tuple[str, str]] = {
    Op.ADD: ("a + b", "add64(a, b)"),
    Op.SUB: ("a - b", "sub64(a, b)"),
    Op.MUL: ("a * b", "mul64(a, b)"),
    Op.DIV: ("a / b", "div64(a, b)"),
    Op.NEG: ("-a", "neg64(a)"),
    Op.ABS: ("abs(a)", "abs64(a)"),
    Op.RELU: ("max(a, 0)", "relu64(a)"),
    Op.SIGN: ("sign(a)", "sign64(a)"),
}
# Mod: fmod 0 takes the divisor's sign (floor), fmod 1 the dividend's (C's fmod).
_MOD = {0: ("mod32(a, b)", "mod64(a, b)", "modf_(a, b)"),
        1: ("a % b", "rem64(a, b)", "fmodf_(a, b)")}

_COMPARE = {Op.EQUAL: "==", Op.LESS: "<", Op.LESS_EQUAL: "<=", Op.GREATER: ">",
            Op.GREATER_EQUAL: ">="}
_COMPARE64 = {Op.EQUAL: "eq64(a, b)", Op.LESS: "lt64(a, b)", Op.LESS_EQUAL: "!lt64(b, a)",
              Op.GREATER: "lt64(b, a)", Op.GREATER_EQUAL: "!lt64(a, b)"}
_LOGIC = {Op.AND: "a != 0 && b != 0", Op.OR: "a != 0 || b != 0",
          Op.XOR: "(a != 0) != (b != 0)", Op.NOT: "a == 0"}


def _truth(cond: str) -> str:
    return f"select(0, 1, {cond})"


def cast_expr(src: str, dst: str) -> str:
    """The WGSL expression in ``a`` (of ``src``'s domain) giving ``dst``'s domain value."""
    s, d = domain(src), domain(dst)
    if dst == "bool":
        return _truth({"f32": "nonzero_f(a)", "i32": "a != 0",
                       "vec2<u32>": "(a.x | a.y) != 0u"}[s])
    return {
        ("f32", "f32"): "a", ("i32", "f32"): "f32(a)", ("vec2<u32>", "f32"): "i64_to_f32(a)",
        ("f32", "i32"): "i32(a)", ("i32", "i32"): "a", ("vec2<u32>", "i32"): "bitcast<i32>(a.x)",
        ("f32", "vec2<u32>"): "f32_to_i64(a)",
        ("i32", "vec2<u32>"): "vec2<u32>(bitcast<u32>(a), select(0u, 0xFFFFFFFFu, a < 0))",
        ("vec2<u32>", "vec2<u32>"): "a",
    }[(s, d)]


def _refuse(op: Op, dtype: DType, role: str) -> UnsupportedOperationError:
    from keel.backends.webgpu.backend import WebGpuBackend

    note = WebGpuBackend.dtype_notes.get(dtype, "no WGSL storage form for it")
    return UnsupportedOperationError(
        op.value, "webgpu", detail=f"{role} dtype {dtype.value}: {note}; webgpu holds "
                                   f"{', '.join(HELD)}")


def _cast(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    to = DType(attrs["to"]) if not isinstance(attrs["to"], DType) else attrs["to"]
    if to is DType.STRING or to.is_narrow or np.dtype(to.numpy) not in KINDS:
        raise _refuse(Op.CAST, to, "target")
    src, dst = kind_of(x.dtype), kind_of(to.numpy)
    return [run_map(cast_expr(src, dst), [x], to.numpy, out)]


def integer(op: Op, xs: Sequence[Any], out: Out = None, attrs: Attrs | None = None) -> Any:
    """``op`` over integer ``xs`` broadcast together (wrapping as NumPy's integers do)."""
    wide = kind_of(xs[0].dtype) == "i64"
    if op is Op.MOD:
        expr = _MOD[int((attrs or {}).get("fmod", 0))][1 if wide else 0]
    else:
        expr = INTEGER[op][1 if wide else 0]
    return run_map(expr, xs, xs[0].dtype, out)


def _mod(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    a, b = inputs[0], inputs[1]
    if a.dtype.kind in "iu":
        return [integer(Op.MOD, [a, b], out, attrs)]
    return [run_map(_MOD[int(attrs.get("fmod", 0))][2], [a, b], a.dtype, out)]


def _compare(op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        a, b = inputs[0], inputs[1]
        s = domain(kind_of(a.dtype))
        if s == "vec2<u32>":
            cond = _COMPARE64[op]
        elif s == "f32":
            cond = f"a {_COMPARE[op]} b && !is_nan(a) && !is_nan(b)"
        else:
            cond = f"a {_COMPARE[op]} b"
        return [run_map(_truth(cond), [a, b], np.bool_, out)]
    return kernel


def _logic(op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        return [run_map(_truth(_LOGIC[op]), list(inputs), np.bool_, out)]
    return kernel


def _where(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    cond, x, y = inputs
    return [run_map("select(c, b, a != 0)", [cond, x, y], x.dtype, out)]


_BITWISE = {Op.BITWISE_AND: "a & b", Op.BITWISE_OR: "a | b", Op.BITWISE_XOR: "a ^ b",
            Op.BITWISE_NOT: "~a"}
_BITS = {"i32": 32, "u8": 8, "i8": 8}


def _bitwise(op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        return [run_map(_BITWISE[op], list(inputs), inputs[0].dtype, out)]
    return kernel


def _shift_expr(kind: str, left: bool) -> str:
    """ONNX BitShift (as the reference): a shift past the width gives 0 (left) or the
    sign fill (right, arithmetic for signed types)."""
    if kind == "i64":
        valid = "b.y == 0u && b.x < 64u"
        if left:
            return f"select(vec2<u32>(0u, 0u), shl64(a, b.x), {valid})"
        return (f"select(select(vec2<u32>(0u, 0u), vec2<u32>(0xFFFFFFFFu, 0xFFFFFFFFu), "
                f"neg_(a)), sar64(a, b.x), {valid})")
    valid = f"b >= 0 && b < {_BITS[kind]}"
    if left:
        return f"select(0, bitcast<i32>(bitcast<u32>(a) << u32(b)), {valid})"
    return f"select(select(0, -1, a < 0), a >> u32(b), {valid})"


def _bit_shift(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    a, b = inputs[0], inputs[1]
    expr = _shift_expr(kind_of(a.dtype), attrs["direction"] == "LEFT")
    return [run_map(expr, [a, b], a.dtype, out)]


def _prelu(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x, slope = inputs[0], inputs[1]
    expr = {"f32": "select(a * b, a, a >= 0.0)", "i32": "select(a * b, a, a >= 0)",
            "vec2<u32>": "select(a, mul64(a, b), neg_(a))"}[domain(kind_of(x.dtype))]
    return [run_map(expr, [x, slope], x.dtype, out)]


# Maximum and minimum of two domain values; a NaN wins (NumPy's maximum, minimum).
_EXTREMUM = {
    (Op.MAXIMUM, "f32"): "maxn({a}, {b})",
    (Op.MINIMUM, "f32"): "minn({a}, {b})",
    (Op.MAXIMUM, "i32"): "max({a}, {b})",
    (Op.MINIMUM, "i32"): "min({a}, {b})",
    (Op.MAXIMUM, "vec2<u32>"): "select({a}, {b}, lt64({a}, {b}))",
    (Op.MINIMUM, "vec2<u32>"): "select({a}, {b}, lt64({b}, {a}))",
}


def _extremum(op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        xs = list(inputs)
        form = _EXTREMUM[(op, domain(kind_of(xs[0].dtype)))]
        while len(xs) > len(NAMES):         # fold the first inputs into one
            xs = [_fold(form, xs[:len(NAMES)], None), *xs[len(NAMES):]]
        return [_fold(form, xs, out)]
    return kernel


def _fold(form: str, xs: Sequence[Any], out: Out) -> Any:
    expr = "a"
    for name in NAMES[1:len(xs)]:
        expr = form.format(a=f"({expr})", b=name)
    return run_map(expr, xs, xs[0].dtype, out)


def _isnan(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    return [run_map(_truth("is_nan(a)"), [inputs[0]], np.bool_, out)]


def _isinf(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    signs = [f"bitcast<u32>(a) == {bits}" for bits, on in
             (("0x7f800000u", attrs["detect_positive"]), ("0xff800000u", attrs["detect_negative"]))
             if on]
    return [run_map(_truth(" || ".join(signs) or "false"), [inputs[0]], np.bool_, out)]


def _held(op: Op) -> tuple[str, ...]:
    return tuple(d.value for d in DTYPES[op] if d.value in HELD)


def register(table: KernelTable) -> None:
    entries = [
        (Op.CAST, HELD, "WGSL conversion between the held dtypes", _cast),
        (Op.MOD, _held(Op.MOD), "WGSL mod (floor or fmod), integers exact", _mod),
        *((op, _held(op), f"WGSL {op.value} with broadcasting", _compare(op))
          for op in _COMPARE),
        *((op, ("bool",), f"WGSL logical {op.value}", _logic(op)) for op in _LOGIC),
        (Op.WHERE, ("bool",), "WGSL select over every held dtype", _where),
        *((op, _held(op), f"WGSL {op.value}", _bitwise(op)) for op in _BITWISE),
        (Op.BIT_SHIFT, _held(Op.BIT_SHIFT), "WGSL shifts, past the width as ONNX says",
         _bit_shift),
        (Op.PRELU, _held(Op.PRELU), "WGSL prelu with a broadcast slope", _prelu),
        *((op, _held(op), f"WGSL {op.value} of any number of inputs", _extremum(op))
          for op in (Op.MAXIMUM, Op.MINIMUM)),
        (Op.ISNAN, _held(Op.ISNAN), "WGSL NaN test on the bits", _isnan),
        (Op.ISINF, _held(Op.ISINF), "WGSL infinity test on the bits", _isinf),
    ]
    for op, dtypes, what, fn in entries:
        table.kernel(op, dtypes=dtypes, supports_out=True, description=what)(fn)
