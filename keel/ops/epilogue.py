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

import contextlib
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
        erf = np.vectorize(math.erf, otypes=[np.float64])
        return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))
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
# exp(-x) overflows to inf for very negative x; the result is still right (0).
_OVERFLOWING = frozenset({"sigmoid", "silu"})
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
    impl = _IMPLS[name]
    guard = np.errstate(over="ignore") if name in _OVERFLOWING else contextlib.nullcontext()
    if xp is np and out.flags.c_contiguous and out.size > _CHUNK:
        if out is not y and not (y.flags.c_contiguous and y.shape == out.shape):
            out[...] = y
            y = out
        src, dst = y.reshape(-1), out.reshape(-1)
        with guard:
            for start in range(0, dst.size, _CHUNK):
                stop = min(start + _CHUNK, dst.size)
                impl(np, src[start:stop], p, dst[start:stop], _numpy_scratch)
        return out
    with guard:
        impl(xp, y, p, out, _alloc_scratch(xp))
    return out


Scratch = Callable[[Any, int], Any]   # (like_array, slot) -> array of the same shape/dtype


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


def _alloc_scratch(xp: Any) -> Scratch:
    return lambda like, slot: xp.empty_like(like)


def _const(xp: Any, value: float, like: Any) -> Any:
    if xp is np and _CONST_MIN <= like.size <= _CHUNK and like.flags.c_contiguous:
        return _numpy_constant(value, like)
    return like.dtype.type(value)      # a scalar of the array's dtype (integers stay integers)


def _relu(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
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


# erfc(z) for z >= 0 as t * exp(-z^2 + P(t)), t = 1 / (1 + z/2): the Chebyshev
# fit of Numerical Recipes (erfcc), fractional error below 1.2e-7 for every z.
_ERFC_COEFFS = (
    0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807,
    -0.18628806, 0.09678418, 0.37409196, 1.00002368, -1.26551223,
)


def _gelu(xp: Any, x: Any, p: tuple[float, ...], out: Any, scratch: Scratch) -> None:
    z, t, q = scratch(x, 0), scratch(x, 1), scratch(x, 2)
    xp.abs(x, out=z)
    xp.multiply(z, 1.0 / math.sqrt(2.0), out=z)   # |x| / sqrt(2)
    xp.multiply(z, 0.5, out=t)
    xp.add(t, 1.0, out=t)
    xp.reciprocal(t, out=t)
    xp.multiply(t, _ERFC_COEFFS[0], out=q)
    for c in _ERFC_COEFFS[1:-1]:
        xp.add(q, c, out=q)
        xp.multiply(q, t, out=q)
    xp.add(q, _ERFC_COEFFS[-1], out=q)
    xp.multiply(z, z, out=z)
    xp.subtract(q, z, out=q)
    xp.exp(q, out=q)
    xp.multiply(q, t, out=q)                  # erfc(|x| / sqrt(2))
    xp.subtract(1.0, q, out=q)                # erf(|x| / sqrt(2))
    xp.copysign(q, x, out=q)                  # erf(x / sqrt(2))
    xp.add(q, 1.0, out=q)
    xp.multiply(q, 0.5, out=q)
    xp.multiply(x, q, out=out)


_IMPLS: dict[str, Callable[[Any, Any, tuple[float, ...], Any, Scratch], None]] = {
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
