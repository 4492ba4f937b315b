"""Loading without Python's cyclic garbage collector.

Importing and planning a model allocate a few objects per node (nodes, types, plans,
placements) and free almost none of them. Each full collection walks every live
object, and the collector runs one whenever enough new objects survived since the
last: on a 100,000-node graph the load spent more than half its time in collections
that found nothing. :func:`paused` switches the collector off for the duration of a
load; reference counting still frees everything that is not a cycle, and the
collector resumes as it was after the last concurrent load ends.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import ParamSpec, TypeVar

from keel._fork import renew_after_fork, reset_after_fork

__all__ = ["paused", "pausing"]

_lock = threading.Lock()
renew_after_fork(sys.modules[__name__], "_lock")
_depth = 0                      # loads running now
_was_enabled = False            # the collector's state when the first of them began

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def paused() -> Iterator[None]:
    """The cyclic collector off inside the block (nested and concurrent blocks share)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def pausing(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with the collector :func:`paused`."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with paused():
            return fn(*args, **kwargs)
    return wrapper



def _in_child(module: ModuleType) -> None:
    """A fork during a load in another thread: the child runs no load, so the collector
    goes back to the state it had before."""
    global _depth
    if _depth and _was_enabled:
        gc.enable()
    _depth = 0


reset_after_fork(sys.modules[__name__], _in_child)
