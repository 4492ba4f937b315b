"""Conformance cases of the elementwise family.

Every op gets one case per dtype it accepts, plus broadcasting (``*-bcast``),
zero-size (``*-empty``), non-contiguous (``*-nc``: a transposed or strided
view) and, for float ops, special values (``*-special``: NaN, ±inf, ±0).
Inputs stay inside each op's domain (positive for log, nonzero divisors, …)
so that the comparison tests the kernels, not undefined behaviour.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import numpy as np

from keel.dtypes import DType
from keel.ops.registry import Op, OpGroup
from keel.ops.schemas.elementwise import DTYPES
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]
Domain = tuple[float, float]

SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5,
                    2.5, -2.5, 30.0, -30.0, 100.0, -100.0], dtype=np.float32)


class Tolerance(TypedDict):
    rtol: float
    atol: float


def tolerance(dtype: Any, scale: float = 1.0) -> Tolerance:
    """rtol/atol for a float dtype (integers and bools compare exactly anyway)."""
    dt = np.dtype(dtype)
    if dt == np.float16:
        return {"rtol": 5e-3 * scale, "atol": 5e-3 * scale}
    if dt == DType.BFLOAT16.numpy:             # one bfloat16 step is 2**-7 of the value
        return {"rtol": 1e-2 * scale, "atol": 1e-2 * scale}
    if dt == np.float64:
        return {"rtol": 1e-10 * scale, "atol": 1e-12 * scale}
    return {"rtol": 1e-5 * scale, "atol": 1e-6 * scale}


def rand(rng: Gen, shape: Sequence[int], dtype: Any, lo: float = -3.0,
         hi: float = 3.0) -> np.ndarray:
    """Uniform values in [lo, hi] (clamped to an integer dtype's range), or random bools."""
    dt = np.dtype(dtype)
    values: np.ndarray
    if dt.kind == "b":
        values = rng.random(tuple(shape)) < 0.5
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        low, high = max(int(lo), int(info.min)), min(int(hi), int(info.max))
        values = rng.integers(low, high, size=tuple(shape), endpoint=True)
    else:
        values = rng.uniform(lo, hi, tuple(shape))
    return np.asarray(values, dtype=dt)       # an array even for shape ()


def full_range(rng: Gen, shape: Sequence[int], dtype: Any) -> np.ndarray:
    """Integers over the whole range of ``dtype`` (bit patterns, wrapping)."""
    info = np.iinfo(np.dtype(dtype))
    return np.asarray(rng.integers(int(info.min), int(info.max), size=tuple(shape),
                                   endpoint=True, dtype=np.dtype(dtype)))


def nonzero(rng: Gen, shape: Sequence[int], dtype: Any, hi: float = 7.0) -> np.ndarray:
    """Values with |v| in [1, hi] (or [0.5, hi] for floats): safe divisors."""
    dt = np.dtype(dtype)
    low = 0.5 if dt.kind == "f" else 1
    mag = rand(rng, shape, dt, low, hi)
    if dt.kind == "u":
        return mag
    return np.where(rng.random(tuple(shape)) < 0.5, -mag, mag).astype(dt)


def _int_domain(dtype: DType, domain: Domain) -> Domain:
    if dtype.is_int:
        return (0.0, 200.0) if dtype.value.startswith("u") else (-100.0, 100.0)
    return domain


def _main(dtypes: frozenset[DType]) -> DType:
    for dt in (DType.FLOAT32, DType.INT32, DType.UINT8, DType.INT8, DType.BOOL):
        if dt in dtypes:
            return dt
    return sorted(dtypes, key=lambda d: d.value)[0]


# ---- unary --------------------------------------------------------------------
UNARY_DOMAINS: dict[Op, Domain] = {
    Op.LOG: (0.05, 5.0), Op.SQRT: (0.0, 9.0), Op.ASIN: (-0.99, 0.99),
    Op.ACOS: (-0.99, 0.99), Op.ATANH: (-0.99, 0.99), Op.ACOSH: (1.0, 6.0),
    Op.TAN: (-1.4, 1.4), Op.RECIPROCAL: (0.25, 4.0), Op.EXP: (-6.0, 6.0),
    Op.SINH: (-5.0, 5.0), Op.COSH: (-5.0, 5.0), Op.ERF: (-4.0, 4.0),
    Op.GELU: (-5.0, 5.0), Op.SOFTPLUS: (-10.0, 10.0), Op.MISH: (-6.0, 6.0),
}
# Composite float16 kernels round after every step: a wider float16 tolerance.
_LOOSE_F16 = frozenset({Op.GELU, Op.MISH, Op.SWISH, Op.ELU, Op.SELU, Op.CELU, Op.SOFTSIGN,
                        Op.HARD_SWISH, Op.SIGMOID, Op.TAN, Op.SINH, Op.COSH, Op.EXP})
_UNARY_ATTRS: dict[Op, list[dict[str, Any]]] = {
    Op.LEAKY_RELU: [{}, {"alpha": 0.3}],
    Op.HARD_SIGMOID: [{}, {"alpha": 0.5, "beta": 0.1}],
    Op.GELU: [{}, {"approximate": "tanh"}],
    Op.ELU: [{}, {"alpha": 0.5}],
    Op.SELU: [{}, {"alpha": 1.5, "gamma": 2.0}],
    Op.CELU: [{}, {"alpha": 2.0}],
    Op.THRESHOLDED_RELU: [{}, {"alpha": 0.5}],
    Op.SHRINK: [{}, {"bias": 1.5, "lambd": 1.0}],
    Op.SWISH: [{}, {"alpha": 1.7}],
    Op.ISINF: [{}, {"detect_negative": False}, {"detect_positive": False},
               {"detect_negative": False, "detect_positive": False}],
}


def _unary_input(dtype: DType, domain: Domain, shape: Sequence[int] = (3, 4),
                 view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    lo, hi = _int_domain(dtype, domain)

    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rand(rng, shape, dtype.numpy, lo, hi)
        return [x if view is None else view(x)]
    return make


def _unary_cases(op: Op) -> list[OpCase]:
    dtypes, domain = DTYPES[op], UNARY_DOMAINS.get(op, (-3.0, 3.0))
    main = _main(dtypes)
    cases = []
    for attrs_index, attrs in enumerate(_UNARY_ATTRS.get(op, [{}])):
        tag = f"{op.value}-a{attrs_index}" if attrs_index else op.value
        for dt in sorted(dtypes, key=lambda d: d.value):
            scale = 4.0 if dt is DType.FLOAT16 and op in _LOOSE_F16 else 1.0
            cases.append(OpCase(f"{tag}-{dt.value}", op, _unary_input(dt, domain), attrs,
                                **tolerance(dt.numpy, scale)))
        if attrs_index:
            continue
        tol = tolerance(main.numpy)
        cases += [
            OpCase(f"{tag}-empty", op, _unary_input(main, domain, (0, 3)), attrs, **tol),
            OpCase(f"{tag}-scalar", op, _unary_input(main, domain, ()), attrs, **tol),
            OpCase(f"{tag}-nc", op, _unary_input(main, domain, (4, 6),
                                                 lambda x: x[:, ::2].T), attrs, **tol),
        ]
        if main is DType.FLOAT32:
            cases.append(OpCase(f"{tag}-special", op, lambda rng: [SPECIAL.copy()], attrs,
                                **tol))
    return cases


def _clip_cases() -> list[OpCase]:
    def bounded(dtype: DType, lo: float | None, hi: float | None) -> Make:
        def make(rng: Gen) -> list[np.ndarray | None]:
            x = rand(rng, (4, 5), dtype.numpy, *_int_domain(dtype, (-3.0, 3.0)))
            bounds = [None if v is None else np.array(v, dtype=dtype.numpy) for v in (lo, hi)]
            return [x, *bounds]
        return make

    cases = [OpCase(f"clip-inputs-{dt.value}", Op.CLIP, bounded(dt, 1.0, 2.0 if dt.is_float
                                                                 else 50.0))
             for dt in sorted(DTYPES[Op.CLIP], key=lambda d: d.value)]
    f32 = DType.FLOAT32
    cases += [
        OpCase("clip-min-only", Op.CLIP, bounded(f32, -0.5, None)),
        OpCase("clip-max-only", Op.CLIP, bounded(f32, None, 0.5)),
        OpCase("clip-inverted", Op.CLIP, bounded(f32, 1.0, -1.0)),
        OpCase("clip-attrs", Op.CLIP, _unary_input(f32, (-3.0, 3.0)), {"min": -1.0, "max": 1.5}),
        OpCase("clip-attrs-int8", Op.CLIP, _unary_input(DType.INT8, (0.0, 0.0)),
               {"min": -20.7, "max": 1e9}),
        OpCase("clip-none", Op.CLIP, _unary_input(f32, (-3.0, 3.0))),
        OpCase("clip-special", Op.CLIP, lambda rng: [
            SPECIAL.copy(), np.array(-1.0, np.float32), np.array(1.0, np.float32)]),
        OpCase("clip-nc", Op.CLIP, _unary_input(f32, (-3.0, 3.0), (4, 6), lambda x: x.T),
               {"min": 0.0}),
        OpCase("clip-empty", Op.CLIP, _unary_input(f32, (-3.0, 3.0), (0, 2)), {"max": 0.0}),
    ]
    return cases


def _round_cases() -> list[OpCase]:
    # Exact halves check round-half-to-even, floor and ceil at the boundary.
    def halves(dtype: Any) -> Make:
        return lambda rng: [(rng.integers(-12, 12, size=(5, 6)) / 2).astype(dtype)]
    return [OpCase(f"{op.value}-halves-{np.dtype(dt).name}", op, halves(dt))
            for op in (Op.ROUND, Op.FLOOR, Op.CEIL)
            for dt in (np.float16, np.float32, np.float64)]


# ---- binary -------------------------------------------------------------------
Pair = Callable[[Gen, Sequence[int], Sequence[int], DType], tuple[np.ndarray, np.ndarray]]


def _pair_default(rng: Gen, sa: Sequence[int], sb: Sequence[int],
                  dt: DType) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = _int_domain(dt, (-3.0, 3.0))
    return rand(rng, sa, dt.numpy, lo, hi), rand(rng, sb, dt.numpy, lo, hi)


def _pair_divisor(rng: Gen, sa: Sequence[int], sb: Sequence[int],
                  dt: DType) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = _int_domain(dt, (-10.0, 10.0))
    return rand(rng, sa, dt.numpy, lo, hi), nonzero(rng, sb, dt.numpy)


def _pair_ties(rng: Gen, sa: Sequence[int], sb: Sequence[int],
               dt: DType) -> tuple[np.ndarray, np.ndarray]:
    # Few distinct values, so equal pairs are common.
    lo, hi = (0.0, 3.0) if dt.value.startswith("u") else (-2.0, 2.0)
    if dt.is_float:
        halves = [np.round(rand(rng, s, np.float64, lo, hi) * 2) / 2 for s in (sa, sb)]
        return np.asarray(halves[0], dt.numpy), np.asarray(halves[1], dt.numpy)
    return rand(rng, sa, dt.numpy, lo, hi), rand(rng, sb, dt.numpy, lo, hi)


def _pair_bits(rng: Gen, sa: Sequence[int], sb: Sequence[int],
               dt: DType) -> tuple[np.ndarray, np.ndarray]:
    return full_range(rng, sa, dt.numpy), full_range(rng, sb, dt.numpy)


def _pair_shift(rng: Gen, sa: Sequence[int], sb: Sequence[int],
                dt: DType) -> tuple[np.ndarray, np.ndarray]:
    bits = dt.itemsize * 8
    low = 0 if dt.value.startswith("u") else -2
    shifts = rng.integers(low, bits + 2, size=tuple(sb), endpoint=True).astype(dt.numpy)
    return full_range(rng, sa, dt.numpy), shifts


def _pair_pow(rng: Gen, sa: Sequence[int], sb: Sequence[int],
              dt: DType) -> tuple[np.ndarray, np.ndarray]:
    if dt.is_float:
        return rand(rng, sa, dt.numpy, 0.2, 3.0), rand(rng, sb, dt.numpy, -2.0, 2.0)
    return rand(rng, sa, dt.numpy, -4, 4), rand(rng, sb, dt.numpy, -2, 6)


def _pair_input(pair: Pair, dt: DType, sa: Sequence[int], sb: Sequence[int],
                view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        a, b = pair(rng, sa, sb, dt)
        return [a if view is None else view(a), b]
    return make


def _binary_cases(op: Op, pair: Pair, attrs: dict[str, Any] | None = None,
                  tag: str = "") -> list[OpCase]:
    attrs = attrs or {}
    name = f"{op.value}{tag}"
    dtypes = DTYPES[op]
    main = _main(dtypes)
    tol = tolerance(main.numpy)
    cases = [OpCase(f"{name}-{dt.value}", op, _pair_input(pair, dt, (2, 1, 4), (3, 4)), attrs,
                    **tolerance(dt.numpy))
             for dt in sorted(dtypes, key=lambda d: d.value)]
    return [
        *cases,
        OpCase(f"{name}-same", op, _pair_input(pair, main, (3, 5), (3, 5)), attrs, **tol),
        OpCase(f"{name}-bcast-scalar", op, _pair_input(pair, main, (3, 5), ()), attrs, **tol),
        OpCase(f"{name}-bcast-left", op, _pair_input(pair, main, (5,), (2, 3, 5)), attrs,
               **tol),
        OpCase(f"{name}-empty", op, _pair_input(pair, main, (0, 4), (4,)), attrs, **tol),
        OpCase(f"{name}-nc", op, _pair_input(pair, main, (5, 3), (3, 5), lambda a: a.T),
               attrs, **tol),
    ]


def _prelu_cases() -> list[OpCase]:
    def make(dt: DType, xs: Sequence[int], ss: Sequence[int],
             view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
        def gen(rng: Gen) -> list[np.ndarray | None]:
            x = rand(rng, xs, dt.numpy, *_int_domain(dt, (-3.0, 3.0)))
            slope = rand(rng, ss, dt.numpy, *(_int_domain(dt, (0.0, 1.0)) if dt.is_float
                                              else (0.0, 5.0)))
            return [x if view is None else view(x), slope]
        return gen
    cases = [OpCase(f"prelu-{dt.value}", Op.PRELU, make(dt, (2, 3, 4), (3, 1)),
                    **tolerance(dt.numpy))
             for dt in sorted(DTYPES[Op.PRELU], key=lambda d: d.value)]
    return [
        *cases,
        OpCase("prelu-scalar-slope", Op.PRELU, make(DType.FLOAT32, (3, 4), (1,))),
        OpCase("prelu-same", Op.PRELU, make(DType.FLOAT32, (3, 4), (3, 4))),
        OpCase("prelu-empty", Op.PRELU, make(DType.FLOAT32, (0, 4), (4,))),
        OpCase("prelu-nc", Op.PRELU, make(DType.FLOAT32, (4, 3), (4,), lambda x: x.T)),
    ]


def _pow_cases() -> list[OpCase]:
    def mixed(base: Any, exp: Any, blo: float, bhi: float, elo: float, ehi: float) -> Make:
        return lambda rng: [rand(rng, (3, 4), base, blo, bhi), rand(rng, (4,), exp, elo, ehi)]
    return [
        *_binary_cases(Op.POW, _pair_pow),
        OpCase("pow-f32-int64-exp", Op.POW, mixed(np.float32, np.int64, 0.5, 2.0, -3, 3)),
        OpCase("pow-int32-f32-exp", Op.POW, mixed(np.int32, np.float32, 0, 9, 0.0, 2.5)),
        OpCase("pow-int64-int8-exp", Op.POW, mixed(np.int64, np.int8, -3, 3, -3, 5)),
    ]


def _variadic_cases(op: Op) -> list[OpCase]:
    def many(dt: DType, *shapes: Sequence[int]) -> Make:
        lo, hi = _int_domain(dt, (-3.0, 3.0))
        return lambda rng: [rand(rng, s, dt.numpy, lo, hi) for s in shapes]
    f32 = DType.FLOAT32
    cases = [OpCase(f"{op.value}-{dt.value}", op, many(dt, (2, 1, 4), (3, 4)),
                    **tolerance(dt.numpy)) for dt in sorted(DTYPES[op], key=lambda d: d.value)]
    return [
        *cases,
        OpCase(f"{op.value}-one", op, many(f32, (3, 4))),
        OpCase(f"{op.value}-three", op, many(f32, (3, 1), (1, 4), (3, 4))),
        OpCase(f"{op.value}-four-int64", op, many(DType.INT64, (2, 3), (3,), (1, 1), (2, 3))),
        OpCase(f"{op.value}-empty", op, many(f32, (0, 4), (4,))),
        OpCase(f"{op.value}-nan", op, lambda rng: [SPECIAL.copy(), SPECIAL[::-1].copy()]),
        OpCase(f"{op.value}-nc", op, lambda rng: [rand(rng, (5, 3), np.float32).T,
                                                  rand(rng, (3, 10), np.float32)[:, ::2]]),
    ]


def _add_n_cases() -> list[OpCase]:
    """Sum of many inputs, one node: broadcast ones among them, and a wrap-around in int8."""
    def many(rng: Gen) -> list[np.ndarray | None]:
        return [rand(rng, (4, 1, 3) if k % 7 == 3 else (5, 3), np.float32) for k in range(40)]

    def wraps(rng: Gen) -> list[np.ndarray | None]:
        return [np.full((2, 3), 100, np.int8), np.full((2, 3), 100, np.int8),
                rand(rng, (2, 3), np.int8)]
    return [OpCase("add_n-forty", Op.ADD_N, many, **tolerance(np.float32, 10.0)),
            OpCase("add_n-int8-wraps", Op.ADD_N, wraps)]


def _where_cases() -> list[OpCase]:
    def make(dt: DType, cs: Sequence[int], xs: Sequence[int], ys: Sequence[int],
             view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
        lo, hi = _int_domain(dt, (-3.0, 3.0))

        def gen(rng: Gen) -> list[np.ndarray | None]:
            x = rand(rng, xs, dt.numpy, lo, hi)
            return [rng.random(tuple(cs)) < 0.5, x if view is None else view(x),
                    rand(rng, ys, dt.numpy, lo, hi)]
        return gen
    value_dtypes = sorted((d for d in DType if d is not DType.STRING and not d.is_narrow),
                          key=lambda d: d.value)
    f32 = DType.FLOAT32
    return [OpCase(f"where-{dt.value}", Op.WHERE, make(dt, (2, 1, 4), (3, 4), (1,)))
            for dt in value_dtypes] + [
        OpCase("where-same", Op.WHERE, make(f32, (3, 4), (3, 4), (3, 4))),
        OpCase("where-bcast-cond", Op.WHERE, make(f32, (4,), (3, 4), (3, 1))),
        OpCase("where-empty", Op.WHERE, make(f32, (0, 4), (4,), (1, 4))),
        OpCase("where-nc", Op.WHERE, make(f32, (3, 5), (5, 3), (3, 5), lambda x: x.T)),
    ]


def _binary_family() -> list[OpCase]:
    cases: list[OpCase] = []
    for op in (Op.ADD, Op.SUB, Op.MUL):
        cases += _binary_cases(op, _pair_default)
    cases += _binary_cases(Op.DIV, _pair_divisor)
    cases += _pow_cases()
    cases += _binary_cases(Op.MOD, _pair_divisor, {"fmod": 0}, "-floor")
    cases += _binary_cases(Op.MOD, _pair_divisor, {"fmod": 1}, "-fmod")
    for op in (Op.EQUAL, Op.LESS, Op.LESS_EQUAL, Op.GREATER, Op.GREATER_EQUAL,
               Op.AND, Op.OR, Op.XOR):
        cases += _binary_cases(op, _pair_ties)
    for op in (Op.BITWISE_AND, Op.BITWISE_OR, Op.BITWISE_XOR):
        cases += _binary_cases(op, _pair_bits)
    cases += _binary_cases(Op.BIT_SHIFT, _pair_shift, {"direction": "LEFT"}, "-left")
    cases += _binary_cases(Op.BIT_SHIFT, _pair_shift, {"direction": "RIGHT"}, "-right")
    cases += _prelu_cases()
    cases += _variadic_cases(Op.MAXIMUM) + _variadic_cases(Op.MINIMUM)
    cases += _variadic_cases(Op.ADD_N) + _add_n_cases()
    return cases + _where_cases()


def _wide_int_cases() -> list[OpCase]:
    """int32 and int64 arithmetic past 32 bits' and 2^53's reach, with signs and
    wrap-around (NumPy's integers wrap): a kernel that computes in floats, or drops the
    carry between words, fails these."""
    def wide(dtype: Any) -> Make:
        def make(rng: Gen) -> list[np.ndarray | None]:
            info = np.iinfo(dtype)
            edges = np.array([info.min, info.max, -1, 0, 1, info.max // 3], dtype)
            a = np.concatenate([edges, rng.integers(info.min, info.max, 26, dtype=dtype)])
            b = np.concatenate([edges[::-1], rng.integers(info.min, info.max, 26, dtype=dtype)])
            return [a.reshape(4, 8), b.reshape(4, 8)]
        return make
    cases = [OpCase(f"{op.value}-{np.dtype(dt).name}-wide", op, wide(dt))
             for op in (Op.ADD, Op.SUB, Op.MUL) for dt in (np.int32, np.int64)]
    return cases + [OpCase(f"{op.value}-{np.dtype(dt).name}-wide", op,
                           lambda rng, dt=dt: wide(dt)(rng)[:1])
                    for op in (Op.NEG, Op.ABS, Op.RELU) for dt in (np.int32, np.int64)]


def _unary_family() -> list[OpCase]:
    cases: list[OpCase] = []
    # clip has its own cases: its bounds are inputs.
    for op in sorted(OpGroup.ELEMENTWISE_UNARY - {Op.CLIP}, key=lambda o: o.value):
        cases += _unary_cases(op)
    return cases + _clip_cases() + _round_cases()


CASES: list[OpCase] = _binary_family() + _unary_family() + _wide_int_cases()
