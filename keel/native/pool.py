"""keel's own worker threads for native kernels (``native/src/threads.c``).

A kernel's ``*_mt`` entry point splits ``range(n)`` into ``parts`` contiguous
chunks of near-equal size — :func:`chunks` gives the same ranges, every time —
and runs them on the calling thread and the pool's workers, in C: no Python
runs on a worker, and ctypes releases the GIL around the call. Every kernel
computes each item of its range independently, so the result is bitwise the
same for any thread count.

An idle worker spins for a while (``KEEL_SPIN_US`` microseconds, default 200,
handed to the pool when it loads: the C code reads no environment) before it
sleeps, so the next kernel of the same model run starts on it at once: a
dispatch costs about a microsecond, where waking a sleeping thread costs tens
(see threads.c). When a model run ends the program parks the pool
(:func:`parker`): its idle workers spin on for ``KEEL_IDLE_SPIN_US`` at most
(default 50), then sleep, so a run that follows at once still finds them
spinning and other work gets the core back soon after. A spinning thread may give
its core away every few microseconds (:func:`set_yield`, as the cpu planner decides:
``planner.pool_yield``), so that where the cores are shared a spinning worker does not
hold the caller's. One pool serves every kernel library; ``keel.native.build`` hands
each library its address when it loads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from keel.config import settings
from keel.native import build

__all__ = ["DispatchTimes", "chunks", "dispatch_times", "idle_spin_us", "parker", "parts", "pin",
           "pinned", "set_affinity", "set_idle_spin_us", "set_spin_us", "set_yield", "shutdown",
           "spin_us", "workers", "yielding"]

_I64 = ctypes.c_int64
_pinned: frozenset[int] | None = None     # the CPUs keel's threads are kept on (None: any)


def chunks(n: int, threads: int, min_chunk: int = 1) -> list[tuple[int, int]]:
    """The contiguous ``(lo, hi)`` ranges a ``*_mt`` kernel runs (deterministic):
    ``parts(n, threads, min_chunk)`` of them, the first ``n % parts`` one longer."""
    count = parts(n, threads, min_chunk)
    if count == 0:
        return []
    base, extra = divmod(n, count)
    out, lo = [], 0
    for i in range(count):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def parts(n: int, threads: int, min_chunk: int = 1) -> int:
    """How many chunks ``n`` items split into on up to ``threads`` threads, each chunk
    at least ``min_chunk`` items (the fewest worth a thread); 0 for no items."""
    if n <= 0:
        return 0
    return max(1, min(threads, n // max(1, min_chunk), n))


def _function(symbol: str, argtypes: list[Any], restype: Any = None) -> Any:
    lib = build.library("threads")
    return None if lib is None else lib.function(symbol, argtypes, restype)


def set_affinity(on: bool) -> None:
    """Whether chunk ``c`` of a split goes first to the pool's thread ``c`` (the default:
    a thread then runs the same part of consecutive kernels split the same way, and finds
    its data in its own cache; see threads.c's OWN_PARTS) or to whichever thread is free
    first. The same chunks either way, so the same results: for measuring what the
    affinity is worth. Call it only while no kernel runs."""
    fn = _function("keel_pool_set_affinity", [_I64])
    if fn is not None:
        fn(1 if on else 0)


def set_yield(spins: int, shared: bool) -> None:
    """How spinning threads (idle workers, the caller waiting for a job's chunks) give
    their core away: every ``spins`` spins, rounded up to a power of two (0: never; the
    caller still does every 4,096), and with ``shared`` only where another of the pool's
    threads last ran on the same CPU (threads.c). The cpu planner decides it
    (``planner.pool_yield``); the same chunks whatever it is, so the same results."""
    fn = _function("keel_pool_set_yield", [_I64, _I64])
    if fn is not None:
        fn(max(0, int(spins)), 1 if shared else 0)


def yielding() -> tuple[int, bool] | None:
    """The pool's yield as set (:func:`set_yield`): (spins, shared); None when the native
    tier is unavailable."""
    spins = _function("keel_pool_yield_spins", [], _I64)
    shared = _function("keel_pool_yield_shared", [], _I64)
    return None if spins is None or shared is None else (int(spins()), bool(shared()))


def pin(cpus: Collection[int] | None) -> bool:
    """Keep keel's threads on ``cpus`` (one NUMA node's, as the cpu plan decides; None:
    wherever the process may run): the native pool's workers, running and to come, and
    the threads that run a program's branches at once (they read :func:`pinned`). False
    where the pool's workers could not be moved (the platform cannot pin them)."""
    global _pinned
    _pinned = None if cpus is None else frozenset(int(c) for c in cpus)
    fn = _function("keel_pool_pin", [ctypes.POINTER(_I64), _I64], _I64)
    if fn is None:
        return True                       # no native workers to move
    ids = sorted(_pinned or ())
    array = (_I64 * max(1, len(ids)))(*ids)
    return int(fn(array, len(ids))) == 0


def pinned() -> frozenset[int] | None:
    """The CPUs :func:`pin` keeps keel's threads on; None: not pinned."""
    return _pinned


def workers() -> int:
    """Worker threads started in this process (0 before the first parallel call)."""
    fn = _function("keel_pool_workers", [], _I64)
    return 0 if fn is None else int(fn())


def spin_us() -> int | None:
    """How long an idle worker spins before it sleeps, in microseconds, as the pool holds
    it (``KEEL_SPIN_US``, default 200); None when the native tier is unavailable."""
    fn = _function("keel_pool_spin_us", [], _I64)
    return None if fn is None else int(fn())


def set_spin_us(us: int | None) -> None:
    """How long an idle worker spins before it sleeps, in microseconds (0: at once;
    None: back to ``KEEL_SPIN_US`` as the settings read it, else the default)."""
    fn = _function("keel_pool_set_spin_us", [_I64])
    if fn is not None:
        fn(settings().spin_us if us is None else max(0, int(us)))


def parker() -> Callable[[], None] | None:
    """The pool's ``keel_pool_park``, called when a model run ends: workers spinning for
    the next job spin on for at most :func:`idle_spin_us`, then sleep. None where no
    pool is loaded in this process (then no worker spins)."""
    lib = build.loaded("threads")
    return None if lib is None else lib.function("keel_pool_park", [])


def idle_spin_us() -> int | None:
    """How long idle workers spin after a run ends, in microseconds, as the pool holds it
    (``KEEL_IDLE_SPIN_US``); None when the native tier is unavailable."""
    fn = _function("keel_pool_idle_spin_us", [], _I64)
    return None if fn is None else int(fn())


def set_idle_spin_us(us: int | None) -> None:
    """How long idle workers spin after a run ends, in microseconds (0: they sleep at
    once; None: back to ``KEEL_IDLE_SPIN_US`` as the settings read it)."""
    fn = _function("keel_pool_set_idle_spin_us", [_I64])
    if fn is not None:
        fn(settings().idle_spin_us if us is None else max(0, int(us)))


def shutdown() -> None:
    """Stop and join the worker threads (they start again on the next parallel call)."""
    lib = build.loaded("threads")
    if lib is not None:
        lib.function("keel_pool_stop", [])()


@dataclass(frozen=True)
class DispatchTimes:
    """The round trips, in nanoseconds, of a timing's jobs, and how many of them had a
    chunk whose wait timed out (a thread descheduled); ``busy``: the pool ran another
    thread's job, so a job ran inline and nothing was timed (``times`` empty)."""

    times: list[int]
    stalled: int
    busy: bool


def dispatch_times(threads: int, repeats: int) -> DispatchTimes | None:
    """The round trips of ``repeats`` empty jobs split over ``threads`` threads of the
    pool (threads.c's keel_pool_time_dispatch: timed in C, after one untimed job that
    starts the workers); None where the native tier is unavailable or the workers could
    not all start."""
    fn = _function("keel_pool_time_dispatch", [_I64, _I64, ctypes.POINTER(_I64)], _I64)
    if fn is None or threads < 2 or repeats < 1:
        return None
    out = (_I64 * repeats)()
    rc = int(fn(threads, repeats, out))
    if rc == -2:
        return DispatchTimes([], 0, True)
    return None if rc < 0 else DispatchTimes(list(out), rc, False)
