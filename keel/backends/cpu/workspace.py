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

import enum
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from keel._fork import renew_after_fork

__all__ = ["LIMIT_BYTES", "Packed", "Scratch", "aligned", "bound", "clear", "derived",
           "derived_from", "empty", "filled", "form", "held_bytes", "is_frozen",
           "thread_scratch"]

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


def bound(xp: Any, key: Hashable, make: Callable[[], Any]) -> Any:
    """A per-thread object built by ``make()`` once for ``key`` (then reused).

    For kernels that keep buffers *and views of them* ready between calls: the
    object's ``nbytes`` counts against :data:`LIMIT_BYTES` like a buffer's.
    ``key`` should hash fast (an identity-hashed layout object, not a shape tuple).
    """
    full_key = (xp.__name__, "bound", key)
    cache = _cache()
    obj = cache.get(full_key)
    if obj is not None:
        cache.move_to_end(full_key)
        return obj
    obj = make()
    cache[full_key] = obj
    _evict(cache)
    return obj


def held_bytes() -> int:
    """Bytes held by this thread's workspace cache."""
    return sum(int(b.nbytes) for b in _cache().values())


def clear() -> None:
    """Drop this thread's buffers."""
    _cache().clear()


# ---- native calls' per-thread scratch (outside the cache: a bound call holds its own) ---
class Scratch(enum.Enum):
    """What a thread's scratch buffer is for (thread_scratch keeps one of each)."""
    WORK = "a serial native call's workspace (the GEMM's packing, a band or blocked conv's)"
    ATTENTION = "a serial attention call's scores"
    WINDOW = "a serial window kernel's (pooling, depthwise conv) rows"


def aligned(n: int) -> np.ndarray:
    """``n`` float32 starting on a 64-byte boundary (a cache line, one AVX-512 vector)."""
    raw = np.empty(n + 16, dtype=np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip:skip + n]


def thread_scratch(use: Scratch, floats: int) -> np.ndarray:
    """This thread's scratch for ``use``: at least ``floats`` float32, 64-byte aligned,
    kept for the thread's next call and replaced by a larger one where a call needs more
    (a bound call holds the one it was bound to). No two threads share one."""
    held_by_use: dict[Scratch, np.ndarray] | None = getattr(_local, "scratch", None)
    if held_by_use is None:
        held_by_use = _local.scratch = {}
    held = held_by_use.get(use)
    if held is None or held.size < floats:
        held = held_by_use[use] = aligned(floats)
    return held



# ---- values derived from constant arrays (prepacked weights) -----------------------------
_derived: dict[tuple[Hashable, tuple[int, ...]], tuple[tuple[weakref.ref[Any], ...], Any]] = {}
_derived_lock = threading.Lock()
renew_after_fork(sys.modules[__name__], "_derived_lock")   # free in a forked child


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


def derived(xp: Any, tag: Hashable, array: Any, fn: Callable[[Any, Any], Any]) -> Any:
    """``fn(xp, array)``, cached while ``array`` lives if ``array`` is frozen.

    ``tag`` names what is derived and everything besides ``array`` it depends on
    (a layout, a permutation), so one weight used by two layouts caches both.
    """
    return derived_from(xp, tag, (array,), lambda xp_, arrays: fn(xp_, arrays[0]))


def derived_from(xp: Any, tag: Hashable, arrays: tuple[Any, ...],
                 fn: Callable[[Any, tuple[Any, ...]], Any]) -> Any:
    """``fn(xp, arrays)``, cached while the arrays live if every one (but None) is frozen."""
    present = tuple(a for a in arrays if a is not None)
    if not all(is_frozen(a) for a in present):
        return fn(xp, arrays)
    key = (tag, tuple(id(a) if a is not None else 0 for a in arrays))
    with _derived_lock:
        hit = _derived.get(key)
    if hit is not None and all(ref() is a for ref, a in zip(hit[0], present, strict=True)):
        return hit[1]
    value = fn(xp, arrays)

    def forget(_: weakref.ref[Any]) -> None:
        _derived.pop(key, None)

    refs = tuple(weakref.ref(a, forget) for a in present)
    with _derived_lock:
        _derived[key] = (refs, value)
    return value


class Packed:
    """Prepack state of a node: its constant inputs and forms derived from them.

    A conv variant's ``prepack`` returns one of these; the kernel asks it for
    the form it needs (packed weights for one layout) with :func:`form`, which
    makes each form once, on first use (the variant that runs, and so the
    layout, may depend on the input shape).
    """

    def __init__(self, arrays: tuple[Any, ...]) -> None:
        self.arrays = arrays
        self._forms: dict[Hashable, Any] = {}

    def get(self, tag: Hashable, arrays: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """The form ``tag`` of ``arrays``; made by ``make()`` and kept if they are ours."""
        if len(arrays) > len(self.arrays) or any(
                a is not b for a, b in zip(arrays, self.arrays, strict=False)):
            return make()
        form = self._forms.get(tag)
        if form is None:
            form = self._forms[tag] = make()
        return form


def form(xp: Any, packed: Any, tag: Hashable, arrays: tuple[Any, ...],
         make: Callable[[Any, tuple[Any, ...]], Any]) -> Any:
    """``make(xp, arrays)``, kept in the prepack state ``packed`` when there is one,
    else cached while the arrays live if they are frozen (see :func:`derived_from)."""
    if isinstance(packed, Packed):
        return packed.get(tag, arrays, lambda: make(xp, arrays))
    return derived_from(xp, tag, arrays, make)
