"""Reusable scratch buffers for kernels (im2col matrices, padded inputs, transforms).

A kernel asks for a buffer by a key that fixes its meaning (``("im2col", shape,
dtype)``); the same key gives the same buffer back on the next call, so a
steady-state run allocates nothing and pays no page faults. Buffers are
per thread (kernels may run concurrently) and per array namespace. A buffer
made by :func:`filled` is set to its fill value once, when it is created:
callers only ever write the cells that change between calls (the interior of
a padded copy), so the border keeps its value.

The cache is bounded (:data:`LIMIT_BYTES` per thread); the least recently
used buffers go first.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

__all__ = ["LIMIT_BYTES", "clear", "derived", "empty", "filled", "held_bytes", "is_frozen"]

LIMIT_BYTES = 256 * 2**20

_local = threading.local()


def _cache() -> OrderedDict[Hashable, Any]:
    cache: OrderedDict[Hashable, Any] | None = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = OrderedDict()
    return cache


def _get(xp: Any, key: Hashable, shape: Sequence[int], dtype: Any, fill: float | None) -> Any:
    shape = tuple(shape)
    full_key = (xp.__name__, key, shape, dtype, fill)
    cache = _cache()
    buf = cache.get(full_key)
    if buf is not None:
        cache.move_to_end(full_key)
        return buf
    buf = xp.empty(shape, dtype=dtype) if fill is None else xp.full(shape, fill, dtype=dtype)
    cache[full_key] = buf
    _evict(cache)
    return buf


def _evict(cache: OrderedDict[Hashable, Any]) -> None:
    total = sum(int(b.nbytes) for b in cache.values())
    while total > LIMIT_BYTES and len(cache) > 1:
        _, old = cache.popitem(last=False)
        total -= int(old.nbytes)


def empty(xp: Any, key: Hashable, shape: Sequence[int], dtype: Any) -> Any:
    """A buffer for ``key`` with undefined contents."""
    return _get(xp, key, shape, dtype, None)


def filled(xp: Any, key: Hashable, shape: Sequence[int], dtype: Any, value: float) -> Any:
    """A buffer for ``key`` set to ``value`` when created (then only what callers write)."""
    return _get(xp, key, shape, dtype, float(value))


def held_bytes() -> int:
    """Bytes held by this thread's workspace cache."""
    return sum(int(b.nbytes) for b in _cache().values())


def clear() -> None:
    """Drop this thread's buffers."""
    _cache().clear()



# ---- values derived from constant arrays (prepacked weights) -----------------------------
_derived: dict[tuple[str, int], tuple[weakref.ref[Any], Any]] = {}
_derived_lock = threading.Lock()


def is_frozen(array: Any) -> bool:
    """Whether ``array`` cannot change: a read-only NumPy array over read-only memory.

    Only such arrays (graph constants are frozen when a model is loaded) may have
    results derived from them cached; anything else is recomputed on every call.
    """
    a = array
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        a = a.base
    return a is None or isinstance(a, bytes)


def derived(xp: Any, tag: str, array: Any, fn: Callable[[Any, Any], Any]) -> Any:
    """``fn(xp, array)``, cached while ``array`` lives if ``array`` is frozen."""
    if not is_frozen(array):
        return fn(xp, array)
    key = (tag, id(array))
    with _derived_lock:
        hit = _derived.get(key)
    if hit is not None and hit[0]() is array:
        return hit[1]
    value = fn(xp, array)

    def forget(_: weakref.ref[Any]) -> None:
        _derived.pop(key, None)

    ref = weakref.ref(array, forget)
    with _derived_lock:
        _derived[key] = (ref, value)
    return value
