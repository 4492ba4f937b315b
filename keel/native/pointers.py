"""Raw data addresses of NumPy arrays for native calls, cheaply.

``array.ctypes.data`` costs about 1 µs: a tiny model's batch-1 run makes a
few dozen native calls with three or four arrays each, so the address alone
would cost more than the arithmetic. Most arrays a kernel sees are the same
objects run after run (views into the model's arena, its weights), so
:func:`address` remembers the address of each array it has seen, keyed by
identity through a weak reference: a hit costs about a tenth of the lookup,
and the cache never keeps an array alive. An array's data pointer cannot
change while the array exists.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["address", "weak"]

_LIMIT = 1024
_seen: dict[int, tuple[weakref.ref[Any], int]] = {}


def address(a: Any) -> int:
    """The address of ``a``'s first element (``a.ctypes.data``), remembered per array."""
    hit = _seen.get(id(a))
    if hit is not None and hit[0]() is a:
        return hit[1]
    ptr: int = a.ctypes.data
    if len(_seen) >= _LIMIT:
        _seen.clear()
    _seen[id(a)] = (weakref.ref(a), ptr)
    return ptr


class _Dead:
    """Stands in for a weak reference to an absent array: calling it gives None."""

    def __call__(self) -> None:
        return None


_DEAD = _Dead()


def weak(a: Any) -> Any:
    """A weak reference to ``a``, or a stand-in that gives None when ``a`` is None
    (prepared native calls hold their arrays this way and compare identities)."""
    return _DEAD if a is None else weakref.ref(a)
