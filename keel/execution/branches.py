"""The threads that run a program's independent branches at once.

A region the plan runs at once (:mod:`keel.planning.interop`) has lanes: the calling
thread runs the first, and lane ``j`` runs on lane thread ``j - 1``, always the same
one, so that what a kernel keeps per thread (bound calls, scratch, packed workspaces)
is made once per lane and reused run after run. The lane threads are plain Python
threads that wait on a queue; the kernels they call release the GIL (native kernels
through ctypes, NumPy's and BLAS's loops), so the lanes' arithmetic overlaps.

:func:`run_lanes` returns only once every lane has finished, whether or not one
failed, and then raises the first lane's error (by lane order): a failing branch never
leaves another still writing while the caller goes on. A lane thread never hands work
on to lane threads (a program running there runs its regions in order), so no lane
waits on another. Lane threads are pinned where keel's native workers are
(:func:`keel.native.pool.pinned`, one NUMA node's CPUs). They start at the first region
run and do not survive a fork: the child starts new ones when it needs them.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence

from keel._fork import renew_after_fork, reset_after_fork

__all__ = ["in_lane", "run_lanes"]

_Job = tuple[Callable[[], None], "_Done"]


class _Done:
    """A lane's completion: set once its call returned or raised (the exception kept)."""

    __slots__ = ("error", "event")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None


class _Lanes:
    """The lane threads of this process (grown on demand, never shrunk)."""

    def __init__(self) -> None:
        self.queues: list[queue.SimpleQueue[_Job]] = []
        self.lock = threading.Lock()
        renew_after_fork(self, "lock")

    def queue(self, index: int) -> queue.SimpleQueue[_Job]:
        if index >= len(self.queues):
            with self.lock:
                while index >= len(self.queues):
                    jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
                    threading.Thread(target=_serve, args=(jobs,), daemon=True,
                                     name=f"keel-lane-{len(self.queues) + 1}").start()
                    self.queues.append(jobs)
        return self.queues[index]


_LANES = _Lanes()
_state = threading.local()


def _reset(lanes: _Lanes) -> None:
    lanes.queues = []            # the lane threads did not come along (the lock is renewed)


reset_after_fork(_LANES, _reset)


def in_lane() -> bool:
    """Whether this thread is a lane thread (whose programs run their regions in order)."""
    return bool(getattr(_state, "lane", False))


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    _state.lane = True
    pinned: frozenset[int] | None = None
    while True:
        call, done = jobs.get()
        pinned = _follow_pin(pinned)
        try:
            call()
        except BaseException as exc:  # handed to the caller, which raises it
            done.error = exc
        finally:
            done.event.set()


def _follow_pin(applied: frozenset[int] | None) -> frozenset[int] | None:
    """Keep this thread on the CPUs keel's native workers are pinned to."""
    from keel.native.pool import pinned

    cpus = pinned()
    setter = getattr(os, "sched_setaffinity", None)
    if cpus == applied or setter is None:
        return applied
    try:
        setter(0, cpus if cpus is not None else os.sched_getaffinity(os.getpid()))
    except OSError:
        return applied
    return cpus


def run_lanes(calls: Sequence[Callable[[], None]]) -> None:
    """Run ``calls[0]`` here and each other on its lane thread, at once; return when all
    have finished; raise the first lane's error, if any, after every lane is done."""
    if in_lane():
        for call in calls:           # a lane thread hands nothing on: in order
            call()
        return
    waits = []
    for index, call in enumerate(calls[1:]):
        done = _Done()
        _LANES.queue(index).put((call, done))
        waits.append(done)
    first: BaseException | None = None
    try:
        calls[0]()
    except BaseException as exc:
        first = exc
    for done in waits:
        done.event.wait()
        if first is None:
            first = done.error
        done.error = None
    try:
        if first is not None:
            raise first
    finally:
        del first        # no frame of this run keeps its error (and what it references)
