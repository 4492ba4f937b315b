"""A conv and the max pool that alone reads its output, run as one native call.

Where the cpu planner pools a conv while its rows are in cache (``planner.pool_in_conv``:
the conv's plan carries the option ``pooled_by``, the pool's ``pool_in_conv`` with its
split), the pool's bound step (:class:`PoolStep`, made when the program binds its steps)
waits for its conv: each run the conv's step, bound or not (a large feed is read where
the caller has it, so a network's first conv runs unbound), hands its X over
(:func:`hand_over`) instead of computing, and the pool's step then runs gemm.c's
keel_conv_pool_f32, which computes the conv's rows into a buffer of the thread's and
pools them from there: the conv's output is never written out. Its results are the
conv's then the pool's, bit for bit. Where no pool step waits for the conv's Y (the pool
runs unbound, its bind declined, another program), the conv computes as usual and the
pool after it.

The pool's step runs right after the conv's (the planner's rule asks for the pool to be
the next node), so nothing writes where X lies between the two; the pooled Y must not
overlap X (checked each run). A run that keeps or watches every value (the program's
general path, ``every_value``) runs every step unbound: the conv then computes its own
output and the pool reads it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from keel.backends.base import every_value_wanted
from keel.backends.cpu import native_gemm, native_window

__all__ = ["ConvStep", "PoolStep", "hand_over", "waiting"]

BandOf = Callable[[], "native_gemm.BandCall | None"]


class PoolStep:
    """A max pool's bound step that its conv may hand its X to: then the conv and the
    pool as one call, else the pool's own call."""

    __slots__ = ("__weakref__", "call", "fused", "geo", "pending", "pool", "refused",
                 "split", "threads", "x_at", "x_ref", "y")

    def __init__(self, pool: Callable[[], Any], x: np.ndarray, y: np.ndarray,
                 geo: native_window.WindowGeometry, split: native_gemm.PoolSplit,
                 threads: int) -> None:
        self.pool, self.y, self.geo, self.split, self.threads = pool, y, geo, split, threads
        self.x_ref = weakref.ref(x)
        self.call: native_gemm.PooledCall | None = None
        self.fused: Callable[[], Any] | None = None     # the call bound
        self.x_at, self.pending, self.refused = 0, False, False

    def __call__(self) -> None:
        if self.pending and self.fused is not None:
            self.pending = False
            self.fused()
        else:
            self.pool()

    def take(self, x: np.ndarray, band_of: BandOf) -> bool:
        """Whether this step computes the conv of ``x`` with its pool this run (the conv
        then does nothing)."""
        self.pending = False
        if self.refused:
            return False
        at = int(x.ctypes.data)
        if self.call is None:
            self.call = self._prepared(band_of)
            if self.call is None:       # not served: the conv computes itself from now on
                self.refused = True
                return False
            self.fused, self.x_at = self.call.bound(self.threads), 0
        if at != self.x_at:             # another X (a feed read where the caller has it)
            if np.may_share_memory(x, self.y) or not self.call.point_x(x):
                return False
            self.x_at = at
        self.pending = True
        return True

    def _prepared(self, band_of: BandOf) -> native_gemm.PooledCall | None:
        band = band_of()
        pool = native_window.row_pool(self.geo)
        if band is None or pool is None:
            return None
        function, scratch = pool
        kh, sh, pt = (int(self.geo.array[i]) for i in (5, 7, 11))
        return native_gemm.prepare_pooled(
            band, self.y, native_gemm.RowPool(function, self.geo.address, scratch, kh, sh, pt,
                                              self.geo), self.split)


# The pool steps waiting for a conv, by (the conv's Y: the pool's X, its address, the
# binding thread). A memo, emptied when full; a step held by no program is gone.
_WAITING: dict[tuple[int, int, int], weakref.ref[PoolStep]] = {}
_WAITING_KEPT = 64      # derived: far more programs x threads than a process binds at once


def _key(y: np.ndarray) -> tuple[int, int, int]:
    return id(y), int(y.ctypes.data), threading.get_ident()


def waiting(pool: Callable[[], Any], x: np.ndarray, y: np.ndarray,
            geo: native_window.WindowGeometry, split: native_gemm.PoolSplit,
            threads: int) -> PoolStep | None:
    """The pool of ``x`` into ``y`` as a step its conv may hand its X to (``pool``: the
    pool's own bound call); None where ``y`` is not the pooled shape of ``geo``."""
    if y.shape[2:] != tuple(int(v) for v in geo.array[3:5]) or native_window.row_pool(
            geo) is None:
        return None
    step = PoolStep(pool, x, y, geo, split, threads)
    if len(_WAITING) >= _WAITING_KEPT:
        _WAITING.clear()
    _WAITING[_key(x)] = weakref.ref(step)
    return step


def hand_over(x: np.ndarray, y: np.ndarray, band_of: BandOf,
              key: tuple[int, int, int] | None = None) -> bool:
    """Whether a pool step waits for this conv's ``y`` and takes the conv of ``x`` (made
    by ``band_of`` once) this run: then the conv computes nothing. ``key``: ``y``'s key
    in the waiting steps where the caller keeps it (a bound step on its thread)."""
    if every_value_wanted():
        return False                # the run keeps or watches the conv's output
    ref = _WAITING.get(_key(y) if key is None else key)
    step = None if ref is None else ref()
    return step is not None and step.x_ref() is y and step.take(x, band_of)


class ConvStep:
    """A pooled conv's bound step: it hands X over to its pool's step, or computes."""

    __slots__ = ("band_of", "call", "key", "x", "y")

    def __init__(self, call: Callable[[], Any], x: np.ndarray, y: np.ndarray,
                 band_of: BandOf) -> None:
        self.call, self.x, self.y, self.band_of = call, x, y, band_of
        self.key = _key(y)      # bound on the thread that runs it: its key stays put

    def __call__(self) -> None:
        if not hand_over(self.x, self.y, self.band_of, self.key):
            self.call()
