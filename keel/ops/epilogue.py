"""Fused epilogues: the activations a conv, gemm or matmul may apply to its output.

Graph passes fold an activation that follows a CONV, GEMM or MATMUL into the
producer's attributes ``activation: str`` and ``activation_params: floats``;
the kernel then writes its output once and applies the activation in place.

Names and parameters (missing parameters take the default shown):

=============  ==========================  ======================================
name           params                      y =
=============  ==========================  ======================================
``""``         ()                          x
relu           ()                          max(x, 0)
leaky_relu     (alpha=0.01,)               x if x >= 0 else alpha * x
sigmoid        ()                          1 / (1 + exp(-x))
tanh           ()                          tanh(x)
clip           (min=-inf, max=+inf)        min(max(x, min), max)
hard_sigmoid   (alpha=0.2, beta=0.5)       max(0, min(1, alpha * x + beta))
hard_swish     ()                          x * max(0, min(1, x / 6 + 1 / 2))
gelu           ()                          x / 2 * (1 + erf(x / sqrt(2)))
gelu_tanh      ()                          x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))
silu           ()                          x * sigmoid(x)
=============  ==========================  ======================================

Two implementations live here: :func:`reference_activation` (readable NumPy in
float64, the executable spec) and :func:`apply_activation` (written against an
array namespace ``xp``, in place, for the optimized backends).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.errors import InvalidArgumentError

__all__ = [
    "ACTIVATIONS",
    "apply_activation",
    "in_place",
    "normal_tail",
    "reference_activation",
    "resolve_activation",
]

_DEFAULTS: dict[str, tuple[float, ...]] = {
    "": (),
    "relu": (),
    "leaky_relu": (0.01,),
    "sigmoid": (),
    "tanh": (),
    "clip": (-math.inf, math.inf),
    "hard_sigmoid": (0.2, 0.5),
    "hard_swish": (),
    "gelu": (),
    "gelu_tanh": (),
    "silu": (),
}

ACTIVATIONS: frozenset[str] = frozenset(_DEFAULTS)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def resolve_activation(name: str, params: Sequence[float] = ()) -> tuple[str, tuple[float, ...]]:
    """Check an activation name and fill its missing parameters with the defaults."""
    try:
        return _resolve(name, tuple(params))
    except TypeError:      # unhashable params: resolve without the cache
        return _resolve.__wrapped__(name, tuple(float(p) for p in params))


@functools.lru_cache(maxsize=256)
def _resolve(name: str, params: tuple[float, ...]) -> tuple[str, tuple[float, ...]]:
    if name not in _DEFAULTS:
        allowed = ", ".join(repr(n) for n in sorted(ACTIVATIONS))
        raise InvalidArgumentError(f"unknown activation {name!r}; allowed: {allowed}")
    defaults = _DEFAULTS[name]
    given = tuple(float(p) for p in params)
    if len(given) > len(defaults):
        raise InvalidArgumentError(
            f"activation {name!r} takes at most {len(defaults)} parameters, "
            f"got {len(given)}: {given}"
        )
    return name, given + defaults[len(given):]


# ---- reference -------------------------------------------------------------------------
def reference_activation(y: np.ndarray, name: str, params: Sequence[float] = ()) -> np.ndarray:
    """The activation by definition, computed in float64 (a new array)."""
    name, p = resolve_activation(name, params)
    x = np.asarray(y, dtype=np.float64)
    if name == "":
        return x.copy()
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "leaky_relu":
        return np.where(x >= 0, x, p[0] * x)
    if name == "sigmoid":
        return _ref_sigmoid(x)
    if name == "tanh":
        return np.tanh(x)
    if name == "clip":
        return np.minimum(np.maximum(x, p[0]), p[1])
    if name == "hard_sigmoid":
        return np.clip(p[0] * x + p[1], 0.0, 1.0)
    if name == "hard_swish":
        return x * np.clip(x / 6.0 + 0.5, 0.0, 1.0)
    if name == "gelu":
        # x * Phi(x) with Phi(x) = erfc(-x / sqrt 2) / 2: the same function as
        # x/2 * (1 + erf(x / sqrt 2)), without the cancellation in 1 + erf for x < 0.
        erfc = np.vectorize(math.erfc, otypes=[np.float64])
        with np.errstate(invalid="ignore"):            # -inf * 0: nan, as defined
            return 0.5 * x * erfc(-x / math.sqrt(2.0))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
    return x * _ref_sigmoid(x)  # silu


def _ref_sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a negative argument only: no overflow for any x.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


# ---- xp implementation -------------------------------------------------------------------
# NumPy arrays are processed in flat chunks: every pass of a multi-pass activation
# (gelu is ~25 passes) then stays in cache, and scratch buffers stay small.
_CHUNK = 65536
# Below this size the constant-buffer trick costs more than it saves.
_CONST_MIN = 4096
# Floating-point events that are part of the algorithm, not errors: exp(-x)
# overflows to inf for very negative x in sigmoid (the result is still right: 0);
# gelu squares |x| (inf past 1.8e19 in float32, harmless) and gives
# gelu(-inf) = -inf * 0 = nan as its definition does.
_EXPECTED_FP_EVENTS: dict[str, dict[str, str]] = {
    "sigmoid": {"over": "ignore"},
    "silu": {"over": "ignore"},
    "gelu": {"over": "ignore", "invalid": "ignore"},
}
_local = threading.local()


def apply_activation(xp: Any, y: Any, name: str, params: Sequence[float] = (),
                     out: Any = None) -> Any:
    """``act(y)`` into ``out`` (which may be ``y`` itself: in place) and return it.

    With ``out=None`` a new array is returned, except for ``name == ""``, which
    returns ``y`` unchanged.
    """
    name, p = resolve_activation(name, params)
    if name == "":
        if out is None or out is y:
            return y
        out[...] = y
        return out
    if out is None:
        out = xp.empty_like(y)
    _activation(name, p)(xp, y, out)
    return out


def in_place(name: str, params: Sequence[float] = ()) -> Callable[[Any, Any], None] | None:
    """``f(xp, y)`` applying the activation to ``y`` in place, or None for ``""``.

    Resolved once per (name, params): a kernel calling it per step skips the
    name checks and dispatch that :func:`apply_activation` does on every call.
    """
    name, p = resolve_activation(name, params)
    if name == "":
        return None
    run = _activation(name, p)
    return lambda xp, y: run(xp, y, y)


@functools.lru_cache(maxsize=256)
def _activation(name: str, p: tuple[float, ...]) -> Callable[[Any, Any, Any], None]:
    """``f(xp, y, out)`` for a resolved, non-empty activation."""
    impl = _IMPLS[name]
    events = _EXPECTED_FP_EVENTS.get(name)
    if events is None:
        return lambda xp, y, out: _apply(xp, impl, y, p, out)

    def guarded(xp: Any, y: Any, out: Any) -> None:
        with np.errstate(**events):  # type: ignore[arg-type]
            _apply(xp, impl, y, p, out)

    return guarded


def _apply(xp: Any, impl: Impl, y: Any, p: tuple[float, ...], out: Any) -> None:
    if xp is not np or not out.flags.c_contiguous:
        impl(xp, y, p, out, _alloc_scratch(xp))
        return
    if out is not y and not (y.flags.c_contiguous and y.shape == out.shape):
        out[...] = y
        y = out
    if out.size <= _CHUNK:
        impl(np, y, p, out, _numpy_scratch)
        return
    src, dst = y.reshape(-1), out.reshape(-1)
    for start in range(0, dst.size, _CHUNK):
        stop = min(start + _CHUNK, dst.size)
        impl(np, src[start:stop], p, dst[start:stop], _numpy_scratch)


Scratch = Callable[[Any, int], Any]   # (like_array, slot) -> array of the same shape/dtype
# (xp, x, params, out, scratch): writes act(x) into out
Impl = Callable[[Any, Any, tuple[float, ...], Any, Scratch], None]


def _numpy_scratch(like: np.ndarray, slot: int) -> np.ndarray:
    """A per-thread reusable buffer shaped like the chunk ``like``."""
    cache: dict[tuple[str, int], np.ndarray] | None = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
    key = (like.dtype.str, slot)
    buf = cache.get(key)
    if buf is None:
        buf = cache[key] = np.empty(_CHUNK, dtype=like.dtype)
    return buf[: like.size].reshape(like.shape)


def _numpy_constant(value: float, like: np.ndarray) -> np.ndarray:
    """A per-thread buffer of ``value`` shaped like ``like``.

    NumPy's binary ufuncs take their SIMD path for two full arrays but not for
    an array and a scalar (``maximum`` is ~3x slower with a scalar), so a
    clamp against a constant reads a constant buffer instead.
    """
    cache: dict[tuple[str, float], np.ndarray] | None = getattr(_local, "consts", None)
    if cache is None:
        cache = _local.consts = {}
    key = (like.dtype.str, value)
    buf = cache.get(key)
    if buf is None:
        buf = cache[key] = np.full(_CHUNK, value, dtype=like.dtype)
    return buf[: like.size].reshape(like.shape)


@functools.lru_cache(maxsize=8)
def _alloc_scratch(xp: Any) -> Scratch:
    return lambda like, slot: xp.empty_like(like)


def _const(xp: Any, value: float, like: Any) -> Any:
    if xp is np and _CONST_MIN <= like.size <= _CHUNK and like.flags.c_contiguous:
        return _numpy_constant(value, like)
    return like.dtype.type(value)      # a scalar of the array's dtype (integers stay integers)


def _relu(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    if x.dtype.kind == "f":
        # clip has a SIMD loop that maximum with a scalar lacks (3x faster on
        # float32 with NumPy 2); NaN propagates the same way.
        xp.clip(x, 0, xp.inf, out=out)
    else:
        xp.maximum(x, _const(xp, 0.0, x), out=out)


def _leaky_relu(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    alpha = p[0]
    t = scratch(x, 0)
    xp.multiply(x, alpha, out=t)
    if 0.0 <= alpha <= 1.0:        # x >= alpha*x exactly where x >= 0
        xp.maximum(x, t, out=out)
    elif alpha > 1.0:
        xp.minimum(x, t, out=out)
    else:
        out[...] = xp.where(x >= 0, x, t)


def _sigmoid(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    # exp(-x) overflows to inf for very negative x, and 1 / (1 + inf) is the right 0.
    xp.negative(x, out=out)
    xp.exp(out, out=out)
    xp.add(out, 1.0, out=out)
    xp.reciprocal(out, out=out)


def _tanh(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    xp.tanh(x, out=out)


def _clip(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    lo, hi = p
    src = x
    if lo > -math.inf:
        xp.maximum(src, _const(xp, lo, x), out=out)
        src = out
    if hi < math.inf:
        xp.minimum(src, _const(xp, hi, x), out=out)
        src = out
    if src is not out:
        out[...] = src


def _hard_sigmoid(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    xp.multiply(x, p[0], out=out)
    xp.add(out, p[1], out=out)
    _clip(xp, out, (0.0, 1.0), out, scratch)


def _hard_swish(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    t = scratch(x, 0)
    _hard_sigmoid(xp, x, (1.0 / 6.0, 0.5), t, scratch)
    xp.multiply(x, t, out=out)


def _silu(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    t = scratch(x, 0)
    _sigmoid(xp, x, (), t, scratch)
    xp.multiply(x, t, out=out)


def _gelu_tanh(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    t = scratch(x, 0)
    xp.multiply(x, x, out=t)
    xp.multiply(t, 0.044715, out=t)
    xp.add(t, 1.0, out=t)
    xp.multiply(t, x, out=t)                  # x + 0.044715 x^3
    xp.multiply(t, _SQRT_2_OVER_PI, out=t)
    xp.tanh(t, out=t)
    xp.add(t, 1.0, out=t)
    xp.multiply(t, 0.5, out=t)
    xp.multiply(x, t, out=out)


# GELU without cancellation: gelu(x) = max(x, 0) - a * q(a), a = |x|, q(a) = Phi(-a)
# = erfc(a / sqrt 2) / 2. For x < 0 that is -a * q(a) with q accurate relative to
# itself, so the negative tail keeps its relative accuracy (the textbook
# x/2 * (1 + erf(x / sqrt 2)) loses it in 1 + erf: in float32, 3e-4 relative error
# at x = -4, 4 % at x = -5, 100 % at x = -6). q comes from the Chebyshev fit of
# Numerical Recipes (erfcc): erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z/2),
# fractional error below 1.2e-7 for every z >= 0. With z = a / sqrt 2 and
# u = C / (k + a), k = 2 sqrt 2, C = k/2 * e^c0 (so t = k u / C) it becomes
#     q(a) = u * exp(H(u) - a^2 / 2),   H(u) = sum_{i>=1} c_i (k / C)^i u^i,
# which saves the passes that would scale t and add the constant terms: 26 passes
# over the data, each in cache (see apply_activation's chunks).
#
# Accuracy, float32 against float64, measured on a dense grid: relative error
# below 1e-6 for x >= -4 (|gelu(x)| > 1.2e-4) and below 2.5e-6 down to x = -8
# (|gelu| > 1e-14), where the float32 rounding of the exponent (about 12 at x = -5)
# dominates. (exp2 with log2(e) folded into H is 8 % faster but doubles that
# error.) float64 inputs are computed in float64 within the fit's 1.2e-7.
_ERFC_NR = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
            0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)   # c0 .. c9
_GELU_K = 2.0 * math.sqrt(2.0)
_GELU_C = _GELU_K / 2.0 * math.exp(_ERFC_NR[0])
_GELU_H = tuple(c * (_GELU_K / _GELU_C) ** i for i, c in enumerate(_ERFC_NR))[:0:-1]  # h9..h1
# Above this, q(a) * a underflows to 0 in float32 and is below 1e-55 in float64:
# clamping +inf there gives gelu(+inf) = inf instead of inf - 0 * inf = nan.
_GELU_CLAMP = 16.0


@functools.lru_cache(maxsize=16)
def _gelu_constants(dtype: np.dtype[Any]) -> tuple[Any, ...]:
    """(k, C, 0.5, h9, ..., h1) as scalars of ``dtype`` (no per-call conversion)."""
    cast = dtype.type
    return (cast(_GELU_K), cast(_GELU_C), cast(0.5), *(cast(h) for h in _GELU_H))


def _gelu(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    if x.dtype.itemsize < 4:                   # float16: (k / C)^9 ~ 5e7 exceeds its range
        wide = x.astype(xp.float32)
        _gelu(xp, wide, p, wide, _alloc_scratch(xp))
        out[...] = wide
        return
    if x.size == 0:
        return
    a, q = scratch(x, 0), scratch(x, 1)
    if float(x.max()) <= _GELU_CLAMP:         # one reduction instead of a clamping pass
        xp.abs(x, out=a)
    else:                                      # +inf (or nan) present: clamp, as said above
        xp.minimum(x, _GELU_CLAMP, out=a)
        xp.abs(a, out=a)
    normal_tail(xp, a, q, scratch(x, 2), scratch(x, 3))
    xp.multiply(q, a, out=q)
    xp.maximum(x, _const(xp, 0.0, x), out=out)
    xp.subtract(out, q, out=out)


def normal_tail(xp: Any, a: Any, out: Any, u: Any, w: Any) -> Any:
    """``Phi(-a) = erfc(a / sqrt 2) / 2`` for ``a >= 0`` into ``out``, relative error
    ~1e-7 (plus ~6e-8 * a^2 from float32 rounding); ``u`` and ``w`` are scratch arrays
    like ``a``. float32 or float64 (see the GELU notes above)."""
    k, c, half, *h = _gelu_constants(a.dtype)
    q = out
    xp.add(a, k, out=u)
    xp.divide(c, u, out=u)                    # u = C / (k + a)
    xp.multiply(u, h[0], out=q)
    for coef in h[1:]:                        # Horner: q = H(u)
        xp.add(q, coef, out=q)
        xp.multiply(q, u, out=q)
    xp.multiply(a, half, out=w)               # exact: a power-of-two scaling
    xp.multiply(w, a, out=w)                  # a^2 / 2
    xp.subtract(q, w, out=q)
    xp.exp(q, out=q)
    xp.multiply(q, u, out=q)
    return q


_IMPLS: dict[str, Impl] = {
    "relu": _relu,
    "leaky_relu": _leaky_relu,
    "sigmoid": _sigmoid,
    "tanh": _tanh,
    "clip": _clip,
    "hard_sigmoid": _hard_sigmoid,
    "hard_swish": _hard_swish,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": _silu,
}
