"""What a split over keel's threads costs on this machine, measured.

The cpu planner splits a kernel call over threads only while each thread gets the least
work worth one (``planner.least_work``). Its declared values were measured on a 2-core
machine; on another the dispatch to the pool and each kernel's speed differ. This module
measures them here, in well under a second once the kernels measured are built (the
first time, a native build of each family they need not yet built: 10-30 s, each build
printing its line, as any first use of them does):

* the pool's dispatch round trip at 2, 4, 8 and all usable cores (at most those):
  threads.c's ``keel_pool_time_dispatch``, every thread in one job at once;
* the one-thread rate of each kernel family's native kernel at a small, representative
  size (:class:`Family`), in the units its least work counts.

Medians of many short repeats, with their quartiles (the spread, for a loaded machine).
The result is kept as JSON in ``cache_dir()/thread-costs/``, one file per hardware
fingerprint and keel version, written atomically; a file of another machine or version,
or one that does not read, is ignored and :func:`current` says why. ``KEEL_THREAD_COSTS``
decides when it is measured: ``auto`` (the default) on a machine with more than 2 usable
cores, the first time a plan needs it; ``on`` on any machine; ``off`` never (the
declared values decide).
"""

from __future__ import annotations

import enum
import functools
import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from keel._files import write_atomically
from keel._fork import renew_after_fork
from keel._hashing import sha256
from keel.config import cache_dir, settings

__all__ = ["Family", "PoolBusy", "Sample", "Source", "ThreadCosts", "current", "forget", "load",
           "measure", "path_here", "refresh", "save"]

FILE_FORMAT = "keel-thread-costs"
FILE_VERSION = 1
# The measurement's size: its whole time budget, and the repeats each point aims for
# (fewer where the budget runs out, never under MIN_REPEATS).
BUDGET_S = 0.4
REPEATS = 200
MIN_REPEATS = 9
DISPATCH_POINTS = (2, 4, 8)        # thread counts timed, with all usable cores
# A dispatch timing that shows contention is used by this process only, not kept: more
# than this share of its jobs had a thread that did not join within a millisecond
# (descheduled), its quartiles further apart than DOUBT_SPREAD times, or a point's median
# over DOUBT_STEP times the next narrower point's (a wider split wakes at most twice the
# threads: a step that large is the machine's other work, not the pool). Judgement
# values, set from what the 2-core Xeon gave: quiet, quartiles within 1.5x and no
# stalled job; under 4 runnable processes 0.76 -> 6.98 us and stalls.
DOUBT_STALLED = 0.05
DOUBT_SPREAD = 3.0
DOUBT_STEP = 4.0
# The tries at a dispatch timing while another thread holds the pool, a pause apart.
BUSY_TRIES = 3
BUSY_PAUSE_S = 0.005


class Family(enum.Enum):
    """A kernel family whose least work a thread is derived from its measured rate."""

    GEMM = "gemm"            # gemm.c, flops: a 32x256 @ 256x256 product, B packed
    WINDOW = "window"        # window.c, output positions x taps: a 3x3 depthwise conv
    FASTMATH = "fastmath"    # fastmath.c, elements: GELU over 16,384 floats
    COPY = "copy"            # window.c's strided copy, elements: a 128x256 transpose
    WINOGRAD = "winograd"    # winograd.c, floats touched: the input transform of 64 planes

    @property
    def unit(self) -> str:
        return _UNITS[self]


_UNITS = {Family.GEMM: "flops", Family.WINDOW: "taps", Family.FASTMATH: "elements",
          Family.COPY: "elements", Family.WINOGRAD: "floats"}


@dataclass(frozen=True)
class Sample:
    """A median of ``count`` repeats with its quartiles (``low`` .. ``high``)."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> Sample:
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        # Six digits, as the file keeps them: a sample reads back equal to itself.
        median, low, high = (float(f"{v:.6g}") for v in (statistics.median(values), q[0], q[2]))
        return cls(median, low, high, len(values))

    def to_list(self) -> list[float]:
        return [self.median, self.low, self.high, self.count]

    @classmethod
    def from_list(cls, data: Any) -> Sample:
        median, low, high, count = (float(v) for v in data)
        if not 0 < low <= median <= high or count < 1:
            raise ValueError(f"not a sample: {data!r}")
        return cls(median, low, high, int(count))


@dataclass(frozen=True)
class ThreadCosts:
    """The dispatch round trip (microseconds) by thread count, and each family's
    one-thread rate (its units a nanosecond), as measured on ``cpu``."""

    dispatch_us: tuple[tuple[int, Sample], ...]       # ascending thread counts
    rates: tuple[tuple[Family, Sample], ...]
    cpu: str
    cores: int
    seconds: float
    # Why the dispatch timing looks contended ("": it does not); not kept in the file.
    doubt: str = field(default="", compare=False)

    def dispatch(self, threads: int) -> float:
        """The round trip of a split over ``threads`` threads: the median of the nearest
        measured count at or above it (the widest measured past them), never less than a
        narrower count's (a wider split costs no less: noise does not make it cheaper)."""
        most = 0.0
        for count, sample in self.dispatch_us:
            most = max(most, sample.median)
            if count >= threads:
                break
        return most

    def rate(self, family: Family) -> float:
        return dict(self.rates)[family].median

    def to_dict(self) -> dict[str, Any]:
        return {"dispatch_us": {str(t): s.to_list() for t, s in self.dispatch_us},
                "rates_per_ns": {f.value: s.to_list() for f, s in self.rates},
                "cpu": self.cpu, "cores": self.cores, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: Any) -> ThreadCosts:
        """Raises ValueError (or KeyError, TypeError) on anything but a whole record."""
        dispatch = tuple(sorted((int(t), Sample.from_list(s))
                                for t, s in data["dispatch_us"].items()))
        rates = tuple((f, Sample.from_list(data["rates_per_ns"][f.value])) for f in Family)
        if not dispatch or dispatch[0][0] < 2:
            raise ValueError("no dispatch measured on 2 threads or more")
        return cls(dispatch, rates, str(data["cpu"]), int(data["cores"]),
                   float(data["seconds"]))

    @functools.cached_property
    def token(self) -> str:
        """A short hash of the numbers: plans made under other costs are not reused.
        Hashed once (the splits ask for it on every call)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return sha256(text.encode()).hexdigest()[:16]


# ---- measuring --------------------------------------------------------------------------
def _repeat(call: Callable[[], Any], until: float) -> list[float]:
    """Nanoseconds of each of up to REPEATS calls (one untimed first), stopping at
    ``until`` (perf_counter seconds) once MIN_REPEATS are in."""
    call()
    times: list[float] = []
    clock = time.perf_counter_ns
    while len(times) < REPEATS and (len(times) < MIN_REPEATS or time.perf_counter() < until):
        t0 = clock()
        call()
        times.append(float(clock() - t0))
    return times


@dataclass(frozen=True)
class _Kernel:
    """A bound one-thread call, the work units one call does, and the arrays its
    addresses point into (kept alive with it)."""

    call: Callable[[], Any]
    units: int
    arrays: tuple[Any, ...]


def _gemm() -> _Kernel:
    from keel.backends.cpu import native_gemm

    rng = np.random.default_rng(0)
    m, k, n = 32, 256, 256
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = native_gemm.pack(rng.standard_normal((k, n), dtype=np.float32), left=False)
    c = np.empty((m, n), np.float32)
    if b is None:
        raise RuntimeError("the native GEMM is unavailable")
    return _Kernel(lambda: native_gemm.gemm(a, b, c, threads=1), 2 * m * k * n, (a, b, c))


def _window() -> _Kernel:
    from keel.backends.cpu import native_window
    from keel.ops.schemas.conv import Window

    c, hw = 32, 28
    geo = native_window.plan(c, Window((hw, hw), (3, 3), (1, 1), (1, 1), (1, 1), (1, 1),
                                       (hw, hw)))
    if geo is None:
        raise RuntimeError("the native window kernels are unavailable")
    x = np.ones((1, c, hw, hw), np.float32)
    w = np.full((c, 1, 3, 3), 0.1, np.float32)
    y = np.empty_like(x)
    bound = native_window.bind_depthwise_conv(x, w, None, None, y, geo, None, 1, "planes")
    return _Kernel(bound, c * geo.taps_per_plane, (x, w, y))


def _fastmath() -> _Kernel:
    from keel.backends.cpu import fastmath

    x = np.linspace(-4, 4, 16384, dtype=np.float32)
    y = np.empty_like(x)
    bound = fastmath.bound_unary("gelu", x, y, threads=1)
    if bound is None:
        raise RuntimeError("the native fastmath kernels are unavailable")
    return _Kernel(bound, x.size, (x, y))


def _copy() -> _Kernel:
    from keel.backends.cpu import native_window

    src = np.ones((256, 128), np.float32)
    dst = np.empty((128, 256), np.float32)
    bound = native_window.bind_strided_copy(src.T, dst, 1, chunks=1)
    if bound is None:
        raise RuntimeError("the native strided copy is unavailable")
    return _Kernel(bound, dst.size, (src, dst))


def _winograd() -> _Kernel:
    from keel.backends.cpu import planner, winograd

    planes, hw = 64, 14
    bound = winograd.bound_input_transform(planes, (hw, hw))
    if bound is None:
        raise RuntimeError("the native Winograd transforms are unavailable")
    return _Kernel(bound, planes * planner.winograd_plane_floats((hw, hw), False), ())


_KERNELS: Mapping[Family, Callable[[], _Kernel]] = {
    Family.GEMM: _gemm, Family.WINDOW: _window, Family.FASTMATH: _fastmath,
    Family.COPY: _copy, Family.WINOGRAD: _winograd,
}


class PoolBusy(RuntimeError):
    """Another thread held keel's pool through every try: nothing was timed."""


def _dispatch(threads: int) -> tuple[Sample, int]:
    """The dispatch round trip on ``threads`` threads, and its jobs that stalled."""
    from keel.native import pool

    for attempt in range(BUSY_TRIES):
        found = pool.dispatch_times(threads, REPEATS)
        if found is None:
            raise RuntimeError(f"keel's pool could not run {threads} threads")
        if not found.busy:
            return Sample.of([t / 1000 for t in found.times]), found.stalled
        time.sleep(BUSY_PAUSE_S * (attempt + 1))
    raise PoolBusy("keel's pool was running another thread's job through "
                   f"{BUSY_TRIES} tries")


def contention(dispatch: list[tuple[int, Sample]], stalled: list[int],
               load: float = 0.0, cores: int = 1 << 30) -> str:
    """Why a dispatch timing looks contended, or "" (DOUBT_STALLED, DOUBT_SPREAD,
    DOUBT_STEP; ``load``: the 1-minute load average, over ``cores`` the usable cores: a
    worker waits for a time slice, a steady 7 us on the 2-core Xeon against 0.74 quiet,
    with quartiles as tight as quiet ones)."""
    why = [f"load average {load:.1f} on {cores} usable cores"] if load > cores else []
    for (threads, sample), count in zip(dispatch, stalled, strict=True):
        if count > DOUBT_STALLED * sample.count:
            why.append(f"{count} of {sample.count} jobs on {threads} threads stalled")
        if sample.high > DOUBT_SPREAD * sample.low:
            why.append(f"quartiles {sample.low:g}-{sample.high:g} us on {threads} threads")
    for (narrow, a), (wide, b) in itertools.pairwise(dispatch):
        if b.median > DOUBT_STEP * a.median:
            why.append(f"{b.median:g} us on {wide} threads against {a.median:g} on {narrow}")
    return "; ".join(why)


def measure(cores: int, cpu: str = "this CPU", budget_s: float = BUDGET_S) -> ThreadCosts:
    """Measure this machine's thread costs (``cores``: its usable cores, the widest
    dispatch timed); ``seconds`` is the timing's, after the kernels are built and loaded;
    ``doubt`` says why the dispatch looks contended. Raises PoolBusy while another thread
    holds the pool, RuntimeError where the native tier cannot run them."""
    points = sorted({t for t in (*DISPATCH_POINTS, cores) if 2 <= t <= cores})
    if not points:
        raise RuntimeError(f"{cores} usable core: no split to measure")
    kernels = {family: build() for family, build in _KERNELS.items()}   # built, loaded
    start = time.perf_counter()
    share = budget_s / (len(points) + len(_KERNELS))
    timed = [_dispatch(threads) for threads in points]
    dispatch = [(threads, sample) for threads, (sample, _) in zip(points, timed, strict=True)]
    rates = []
    for family, kernel in kernels.items():
        took = _repeat(kernel.call, time.perf_counter() + share)
        rates.append((family, Sample.of([kernel.units / t for t in took])))
    return ThreadCosts(tuple(dispatch), tuple(rates), cpu, cores,
                       round(time.perf_counter() - start, 3),
                       contention(dispatch, [count for _, count in timed], _load(), cores))


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:                    # not known here: not counted against the timing
        return 0.0


# ---- the cache ------------------------------------------------------------------------
def path_here() -> Path:
    """Where this machine's thread costs are kept."""
    from keel.hardware.fingerprint import fingerprint_id, machine_fingerprint

    fid = fingerprint_id(machine_fingerprint())
    return cache_dir() / "thread-costs" / f"thread-costs-{fid}.json"


def save(costs: ThreadCosts, path: Path | None = None) -> Path:
    """Write ``costs`` as this machine's (atomically: a reader never sees half a file)."""
    from keel import __version__
    from keel.hardware.fingerprint import machine_fingerprint

    path = path or path_here()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    text = json.dumps({"format": FILE_FORMAT, "version": FILE_VERSION, "keel": __version__,
                       "fingerprint": machine_fingerprint(), "costs": costs.to_dict()},
                      indent=1, sort_keys=True)
    write_atomically(path, text + "\n")
    return path


def load(path: Path | None = None) -> tuple[ThreadCosts | None, str]:
    """The costs kept at ``path`` (default: this machine's file), or None and why not."""
    from keel import __version__
    from keel.hardware.fingerprint import machine_fingerprint

    path = path or path_here()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"nothing measured yet ({path} does not exist)"
    except (OSError, ValueError) as exc:
        return None, f"ignored {path}: unreadable ({exc})"
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        return None, f"ignored {path}: not a keel thread-costs file"
    if data.get("version") != FILE_VERSION or data.get("keel") != __version__:
        return None, (f"ignored {path}: written by keel {data.get('keel')!r} (format "
                      f"{data.get('version')!r}), this is keel {__version__}")
    if data.get("fingerprint") != machine_fingerprint():
        return None, f"ignored {path}: measured on another machine (hardware fingerprint differs)"
    try:
        return ThreadCosts.from_dict(data.get("costs")), f"loaded {path}"
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return None, f"ignored {path}: damaged ({exc!r})"


# ---- what the planner asks ----------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """The costs the planner derives its least work from (None: the declared values)
    and where they came from, or why there are none."""

    costs: ThreadCosts | None
    reason: str
    again: bool = False          # asked again on the next plan (the pool was busy)

    @property
    def token(self) -> str:
        return "declared" if self.costs is None else self.costs.token


_CURRENT: dict[tuple[str, Path], Source] = {}
_LAST: tuple[Any, Source] = (None, Source(None, "not read yet"))    # (settings, source)
_LOCK = threading.RLock()
renew_after_fork(sys.modules[__name__], "_LOCK")         # free in a forked child


def forget() -> None:
    """Read (or measure) again on the next :func:`current` (tests, ``keel probe``)."""
    with _LOCK:
        _CURRENT.clear()
        _remember(None, Source(None, "not read yet"))


def current() -> Source:
    """This process's thread costs: read once, measured first where ``KEEL_THREAD_COSTS``
    asks (``auto``: more than 2 usable cores; ``on``: always)."""
    st = settings()
    last = _LAST
    if last[0] is st:                  # the splits ask on every call: no hashing then
        return last[1]
    key = (st.thread_costs, st.cache_dir)
    found = _CURRENT.get(key)
    if found is None:
        with _LOCK:
            found = _CURRENT.get(key)
            if found is None:
                # The kernels measured ask for their least work too: the declared values
                # answer them (and any other thread) while the measurement runs.
                _CURRENT[key] = Source(None, "being measured")
                try:
                    found = _find(st.thread_costs)
                finally:
                    _CURRENT.pop(key)          # nothing, if _find raised: asked again
                if not found.again:
                    _CURRENT[key] = found
    if found.reason != "being measured" and not found.again:
        _remember(st, found)
    return found


def _remember(st: Any, found: Source) -> None:
    global _LAST
    _LAST = (st, found)


def refresh() -> Source:
    """Measure this machine's thread costs now and keep them, whatever
    ``KEEL_THREAD_COSTS`` says (``keel probe --thread-costs``; with ``off`` plans still use
    the declared values). Raises RuntimeError where they cannot be measured."""
    cores, cpu = _machine()
    costs = measure(cores, cpu)
    forget()
    found = _kept(costs)
    st = settings()
    if st.thread_costs != "off":         # this process plans with them, kept or not
        with _LOCK:
            _CURRENT[(st.thread_costs, st.cache_dir)] = found
    return found


def adopt(costs: ThreadCosts, reason: str) -> Source:
    """Plan this process with ``costs`` (another machine's, read from a file: the
    parallelism audit of benchmarks/threads_audit.py) until :func:`forget`."""
    found = Source(costs, reason)
    st = settings()
    with _LOCK:
        _CURRENT[(st.thread_costs, st.cache_dir)] = found
        _remember(st, found)
    return found


def read_costs(path: Path) -> ThreadCosts:
    """The costs in ``path``: a kept thread-costs file or ``keel probe --thread-costs
    --json``'s output (both hold them under "costs"). Raises ValueError where it holds
    none."""
    data = json.loads(path.read_text(encoding="utf-8"))
    try:
        return ThreadCosts.from_dict(data["costs"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: no thread costs in it ({exc!r})") from exc


def _find(mode: str) -> Source:
    if mode == "off":
        return Source(None, "KEEL_THREAD_COSTS=off")
    costs, why = load()
    if costs is not None:
        return Source(costs, f"measured on this machine ({why})")
    cores, cpu = _machine()
    if mode == "auto" and cores <= 2:
        return Source(None, f"not measured here: {cores} usable cores, as many as the "
                            "declared values were measured on (KEEL_THREAD_COSTS=on "
                            f"measures them; {why})")
    try:
        costs = measure(cores, cpu)
    except PoolBusy as exc:
        return Source(None, f"not measured yet: {exc}; measured on a later plan", True)
    except Exception as exc:   # any failure: the declared values, and why
        return Source(None, f"not measured here: {exc!r}")
    return _kept(costs)


def _kept(costs: ThreadCosts) -> Source:
    """``costs`` as this process's, kept in this machine's file unless contended."""
    if costs.doubt:
        return Source(costs, "measured on this machine just now under contention, used by "
                             f"this process only, not kept ({costs.doubt}); measured again "
                             "by the next process")
    try:
        path = save(costs)
    except OSError as exc:
        return Source(costs, f"measured on this machine just now (not kept: {exc})")
    return Source(costs, f"measured on this machine just now (kept in {path})")


def _machine() -> tuple[int, str]:
    from keel.backends.cpu.backend import default_threads
    from keel.hardware.cpu import this_cpu

    cpu = this_cpu()
    return default_threads(), str(getattr(cpu, "brand", None) or "this CPU")
