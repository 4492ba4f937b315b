"""A job of keel's pool takes only the threads it has chunks for (its width): workers
beyond it neither run its chunks nor are woken for it, so the workers a wider split (or
a measurement on every core) started stay asleep while a narrower model runs."""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from keel import native
from keel.native import pool
from tests.native._pool_support import worker_states

SPIN_US = 50_000          # 50 ms: long against a job, short against the test


def _function(name: str, args: int) -> Callable[..., int]:
    lib = native.library("threads")
    if lib is None:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    return lib.function(name, [ctypes.c_int64] * args + [ctypes.c_void_p], ctypes.c_int64)


def _check(n: int, parts: int, wait_ms: int = 0) -> np.ndarray:
    """keel_pool_check's record of one job: each chunk's (lo, hi, thread id)."""
    out = np.full(3 * min(n, parts), -1, dtype=np.int64)
    assert _function("keel_pool_check", 3)(n, parts, wait_ms, out.ctypes.data) == 0
    return out.reshape(-1, 3)


def _asleep(count: int, within_s: float) -> list[str]:
    """The workers' states once at least ``count`` of them sleep (or the last look)."""
    deadline = time.monotonic() + within_s
    states = worker_states()
    while time.monotonic() < deadline:
        states = worker_states()
        if sum(s in "SD" for s in states) >= count:
            break
        time.sleep(0.002)
    return states


@pytest.fixture
def fresh_pool() -> Iterator[None]:
    _function("keel_pool_check", 3)          # skips where the native tier is not here
    pool.shutdown()
    pool.set_spin_us(SPIN_US)
    pool.set_idle_spin_us(0)
    try:
        yield
    finally:
        pool.set_spin_us(None)
        pool.set_idle_spin_us(None)
        pool.shutdown()


def test_jobs_of_changing_widths_run_every_chunk_once_below_their_width(
        fresh_pool: None) -> None:
    _check(40, 4, wait_ms=5000)                        # three workers started
    rng = np.random.default_rng(0)
    for _ in range(400):
        parts = int(rng.integers(2, 6))
        n = int(rng.integers(1, 60))
        rows = _check(n, parts)
        assert [tuple(r) for r in rows[:, :2]] == pool.chunks(n, parts)
        assert rows[:, 2].min() >= 0
        assert rows[:, 2].max() < min(n, parts), rows


def test_a_capped_job_runs_its_extra_chunks_on_its_threads_only(fresh_pool: None) -> None:
    capped = _function("keel_pool_check_capped", 3)
    _check(40, 4, wait_ms=5000)
    for parts, threads in [(8, 2), (33, 3), (40, 4), (5, 1)]:
        out = np.full(3 * parts, -1, dtype=np.int64)
        assert capped(parts * 3, parts, threads, out.ctypes.data) == 0
        rows = out.reshape(-1, 3)
        assert [tuple(r) for r in rows[:, :2]] == pool.chunks(parts * 3, parts)
        assert rows[:, 2].min() >= 0 and rows[:, 2].max() < threads, rows


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_workers_a_narrower_job_has_no_chunks_for_go_to_sleep(fresh_pool: None) -> None:
    """Three workers spin after a four-thread job; two-thread jobs that keep coming keep
    worker 1 spinning, while workers 2 and 3 sleep once their spin (started by the last
    job they took part in) runs out."""
    _check(40, 4, wait_ms=5000)
    assert pool.workers() == 3
    end = time.monotonic() + 3 * SPIN_US / 1e6
    while time.monotonic() < end:
        rows = _check(20, 2, wait_ms=5000)             # both chunks at once: worker 1 runs
        assert sorted(rows[:, 2]) == [0, 1]
    states = worker_states()
    assert sorted(states).count("R") <= 1 and sum(s in "SD" for s in states) >= 2, states


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_a_job_wakes_only_the_workers_it_has_chunks_for(fresh_pool: None) -> None:
    _check(40, 4, wait_ms=5000)
    states = _asleep(3, within_s=5 * SPIN_US / 1e6 + 2)
    assert states.count("S") + states.count("D") == 3, states     # all three asleep
    rows = _check(20, 2, wait_ms=5000)                 # worker 1 woken: it runs chunk 1
    assert sorted(rows[:, 2]) == [0, 1]
    states = worker_states()                                 # worker 1 spins SPIN_US on
    assert sum(s in "SD" for s in states) >= 2, states
