"""A conv and the max pool that alone reads its output, run as one native call.

Where the cpu planner pools a conv while its rows are in cache (``planner.pool_in_conv``:
the conv's plan carries the option ``pooled_by``, the pool's ``pool_in_conv`` with its
split), the pool's bound step (:class:`PoolStep`, made when the program binds its steps)
waits for its conv: each run the conv's step, bound or not (a feed too large to stage
and read by another step too leaves a network's first conv unbound; else its bound step
reads the feed where the caller has it: :meth:`ConvStep.reading`), hands its X over
(:func:`hand_over`) instead of computing, and the pool's step then runs gemm.c's
keel_conv_pool_f32, which computes the conv's rows into a buffer of the thread's and
pools them from there: the conv's output is never written out. Its results are the
conv's then the pool's, bit for bit. Where no pool step waits for the conv's Y (the pool
runs unbound, its bind declined, another program), the conv computes as usual and the
pool after it.

The two steps meet through the conv's Y, the pool's X: one array of the program's (an
arena view) that both are handed. When the pool's step binds it is linked to that array
for the binding thread (:class:`_Link`, made by whichever of the two steps binds first;
the link lives exactly as long as the array), and a bound conv step holds its link from
its own bind. An unbound conv, which no bind reaches, finds the link by its Y each run.
Each run the conv's step tells the pool's step afresh whether it handed X over, so a run
cut short between the two leaves nothing for the next.

The pool's step runs right after the conv's (the planner's rule asks for the pool to be
the next node), so nothing writes where X lies between the two; the pooled Y must not
overlap X (checked when X moves). A run that keeps or watches every value (the
program's general path, ``every_value``) runs every step unbound: the conv then computes
its own output and the pool reads it.
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

    __slots__ = ("__weakref__", "call", "fused", "geo", "handed", "pool", "refused", "row",
                 "split", "threads", "x_at", "y")

    def __init__(self, pool: Callable[[], Any], y: np.ndarray,
                 geo: native_window.WindowGeometry, row: tuple[int, int],
                 split: native_gemm.PoolSplit, threads: int) -> None:
        self.pool, self.y, self.geo, self.split, self.threads = pool, y, geo, split, threads
        self.row = row                                  # native_window.row_pool(geo)
        self.call: native_gemm.PooledCall | None = None
        self.fused: Callable[[], Any] | None = None     # the call bound
        self.handed: Callable[[], Any] | None = None    # this run's: the conv handed X over
        self.x_at, self.refused = 0, False

    def __call__(self) -> None:
        fused, self.handed = self.handed, None
        if fused is not None:
            fused()
        else:
            self.pool()

    def take(self, x: Any, band_of: BandOf) -> bool:
        """Whether this step computes the conv of ``x`` with its pool this run (the conv
        then does nothing); called by the conv's step every run, so what it hands over
        is this run's alone."""
        self.handed = None
        if self.refused or every_value_wanted() or type(x) is not np.ndarray:
            return False                # a run that keeps or watches the conv's output
        if self.call is None:
            self.call = self._prepared(band_of)
            if self.call is None:       # not served: the conv computes itself from now on
                self.refused = True
                return False
            self.fused, self.x_at = self.call.bound(self.threads), 0
        at = int(x.ctypes.data)
        if at != self.x_at:             # another X (a feed read where the caller has it)
            if np.may_share_memory(x, self.y) or not self.call.point_x(x):
                return False
            self.x_at = at
        self.handed = self.fused
        return True

    def _prepared(self, band_of: BandOf) -> native_gemm.PooledCall | None:
        band = band_of()
        if band is None:
            return None
        function, scratch = self.row
        kh, sh, pt = (int(self.geo.array[i]) for i in (5, 7, 11))
        return native_gemm.prepare_pooled(
            band, self.y, native_gemm.RowPool(function, self.geo.address, scratch, kh, sh, pt,
                                              self.geo), self.split)


class _Link:
    """Where a conv's step finds the pool step waiting for its Y on one thread."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: weakref.ref[PoolStep] | None = None

    def waiting(self) -> PoolStep | None:
        return None if self.step is None else self.step()


# The links by the array the two steps share (its id: an entry is dropped when the array
# goes, so the id is never another array's) and the binding thread.
_LINKS: dict[int, dict[int, _Link]] = {}


def _link(y: np.ndarray) -> _Link:
    """The link of ``y`` on this thread, made where there is none."""
    by_thread = _LINKS.get(id(y))
    if by_thread is None:
        by_thread = _LINKS[id(y)] = {}
        weakref.finalize(y, _LINKS.pop, id(y), None)
    return by_thread.setdefault(threading.get_ident(), _Link())


def _found(y: Any) -> PoolStep | None:
    """The pool step waiting for ``y`` on this thread, if any."""
    by_thread = _LINKS.get(id(y))
    link = None if by_thread is None else by_thread.get(threading.get_ident())
    return None if link is None else link.waiting()


def waiting(pool: Callable[[], Any], x: np.ndarray, y: np.ndarray,
            geo: native_window.WindowGeometry, split: native_gemm.PoolSplit,
            threads: int) -> PoolStep | None:
    """The pool of ``x`` into ``y`` as a step its conv may hand its X to (``pool``: the
    pool's own bound call), linked to ``x`` on this thread; None where ``y`` is not the
    pooled shape of ``geo`` or the row kernel does not serve it."""
    row = native_window.row_pool(geo)
    if y.shape[2:] != tuple(int(v) for v in geo.array[3:5]) or row is None:
        return None
    step = PoolStep(pool, y, geo, row, split, threads)
    _link(x).step = weakref.ref(step)
    return step


def hand_over(x: Any, y: Any, band_of: BandOf) -> bool:
    """Whether a pool step waits for this conv's ``y`` and takes the conv of ``x`` (made
    by ``band_of`` once) this run: then the conv computes nothing."""
    step = _found(y)
    return step is not None and step.take(x, band_of)


class ConvStep:
    """A pooled conv's bound step: it hands X over to its pool's step, or computes.

    ``call`` computes the conv of ``buffer``, the array the step was bound to. A step
    reading a feed in place (:meth:`reading`) hands over whatever array its ``point``
    gave it (the pool's call checks it and moves its X there); where the pool does not
    take it, the array is copied into ``buffer`` and ``call`` computes from there."""

    __slots__ = ("band_of", "buffer", "call", "link", "x", "y")

    def __init__(self, call: Callable[[], Any], x: np.ndarray, y: np.ndarray,
                 band_of: BandOf, link: _Link | None = None) -> None:
        self.call, self.x, self.buffer, self.y, self.band_of = call, x, x, y, band_of
        # bound on the thread that runs it: the pool's link
        self.link = _link(y) if link is None else link

    def __call__(self) -> None:
        # The array ``point`` gave is this run's alone: the step lets go of it (the pool's
        # call keeps only its address), so a caller's array is not kept alive after it.
        x, self.x = self.x, self.buffer
        step = self.link.waiting()
        if step is not None and step.take(x, self.band_of):
            return
        if x is not self.buffer:
            np.copyto(self.buffer, x)           # a same-dtype copy: no floating point
        self.call()

    def reading(self, buffer: Any) -> ConvStep | None:
        """This step as one of its own whose X its :meth:`point` moves, where it reads
        ``buffer``; else None."""
        if buffer is not self.buffer:
            return None
        return ConvStep(self.call, self.buffer, self.y, self.band_of, self.link)

    def point(self, x: np.ndarray) -> None:
        """Read ``x`` in the next run (a C-contiguous aligned array of X's shape and
        dtype, as a steady run gives it each run); the buffer again after it."""
        self.x = x
