"""A program step's kernel bound to its arrays (``KernelVariant.bind``), with what the
executor may ask of it beyond calling it.

A bind returns a callable of no arguments. Where the executor can do more with a step
than call it (run consecutive native products as one C call, skip NumPy's
floating-point state, move the array a product reads), the bind returns a
:class:`BoundCall` saying so in typed fields; any other callable is a plain step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["BoundCall", "PartFailed", "bare"]

R = TypeVar("R", covariant=True)


@dataclass(frozen=True, slots=True, eq=False)
class BoundCall(Generic[R]):
    """``fn`` (no arguments) and what a program may do with it.

    - ``keep``: the objects ``fn``'s raw addresses point into (arrays made when it was
      bound), alive as long as the call.
    - ``native``: ``fn`` runs C code only, so NumPy's floating-point state means nothing
      to it.
    - ``entry``: the C function's kind and arguments as one entry of a list of calls run
      in C one after another (``native_gemm.joined``); None: not joinable.
    - ``parts``: how many program steps ``fn`` runs (a joined call: several).
    - ``point``: ``point(array)`` moves the array the call reads as its first input.
    - ``reading``: ``reading(buffer)``: the same step as a call of its own whose first
      input moves (its ``point`` set), where that input is ``buffer``; else None.

    The steady run calls ``fn`` itself (:func:`bare`): no frame of this class's in
    its loop. Compared by identity (what it keeps are arrays).
    """

    fn: Callable[[], R]
    keep: tuple[object, ...] = field(default=(), repr=False)   # arrays: no text, no ==
    native: bool = False
    entry: tuple[int, ...] | None = None
    parts: int = 1
    point: Callable[[Any], None] | None = None
    reading: Callable[[Any], BoundCall[Any] | None] | None = None

    def __call__(self) -> R:
        return self.fn()


class PartFailed(Exception):
    """Step ``part`` of a call that runs several (``BoundCall.parts``) raised ``error``:
    the program names that step, not the call's first."""

    def __init__(self, part: int, error: Exception) -> None:
        super().__init__(part, error)
        self.part, self.error = part, error


def bare(call: Callable[[], R]) -> Callable[[], R]:
    """What to call in a tight loop for ``call``: a :class:`BoundCall`'s ``fn``."""
    return call.fn if isinstance(call, BoundCall) else call
