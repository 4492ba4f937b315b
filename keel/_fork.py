"""Fork safety: what keel renews in a child process right after ``os.fork``.

A forked child has one thread: the one that called ``fork``. A lock another
thread held at that moment (a model's lock while that thread was inside
``predict``) stays held in the child for ever, and the child's next call would
wait on it without end. So every lock keel owns is registered here with
:func:`renew_after_fork`; in the child each one is replaced by a new, free
lock before ``fork`` returns. State that lives on threads that did not come
along (a model's stream workers) is dropped by the resets registered with
:func:`reset_after_fork`, and made again when next needed. The native worker
pool resets itself in C (``pthread_atfork`` in ``native/src/threads.c``).

What a thread was doing at the moment of the fork is not finished in the
child: its call never returns there. Anything else, the child can use at once.
Registration holds its owner weakly.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["renew_after_fork", "reset_after_fork"]

_LOCK_TYPE = type(threading.Lock())
_LOCKS: weakref.WeakKeyDictionary[Any, dict[str, Callable[[], Any]]] = \
    weakref.WeakKeyDictionary()
_RESETS: weakref.WeakKeyDictionary[Any, list[Callable[[Any], None]]] = \
    weakref.WeakKeyDictionary()


def renew_after_fork(owner: Any, *names: str) -> None:
    """Give ``owner``'s lock attributes ``names`` (a ``Lock`` or an ``RLock``, or any type
    made without arguments) a new, free lock in every forked child."""
    kept = _LOCKS.setdefault(owner, {})
    for name in names:
        lock = getattr(owner, name)
        kept[name] = threading.Lock if isinstance(lock, _LOCK_TYPE) else type(lock)


def reset_after_fork(owner: Any, reset: Callable[[Any], None]) -> None:
    """Call ``reset(owner)`` in every forked child (before any of the child's own code)."""
    _RESETS.setdefault(owner, []).append(reset)


def _in_child() -> None:
    for owner, locks in list(_LOCKS.items()):
        for name, factory in locks.items():
            setattr(owner, name, factory())
    for owner, resets in list(_RESETS.items()):
        for reset in resets:
            reset(owner)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
