"""Dynamic batching: queued requests run together, and no answer depends on the others.

Requests for one model wait in a queue; a batch closes when its rows reach the
batch limit ``B`` or when the oldest request has waited the queue delay. How
the batch then runs depends on what the model's plan guarantees
(:func:`batch_invariance`):

* **exact**: the plan makes a sample's result independent of the batch it runs
  in (keel's cpu backend with batch invariance, docs/runtime.md). The batch
  runs as it is, without padding, and the model's adaptive planner decides how
  it is split into executions (streams, chunks) for this machine; a request
  larger than ``B`` is not cut by the server either.
* **padded**: no such guarantee (OpenBLAS, another backend, a tuning cache).
  Every batch runs padded to exactly ``B`` rows (the last real row repeated),
  so the model always runs one input shape, inside which a row's result depends
  only on that row; a request larger than ``B`` runs as several batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Batcher", "batch_invariance", "check_invariance", "pad_rows"]

Arrays = dict[str, np.ndarray]
# called once per executed batch: rows that were real, rows padded, seconds waited (each item)
BatchObserver = Callable[[int, int, list[float]], None]


@dataclass
class _Item:
    arrays: Arrays
    rows: int
    future: asyncio.Future[Arrays]
    queued_at: float = field(default_factory=time.perf_counter)

    def key(self) -> tuple[Any, ...]:
        return tuple((k, a.shape[1:], a.dtype.str) for k, a in sorted(self.arrays.items()))


def pad_rows(arrays: Mapping[str, np.ndarray], size: int) -> Arrays:
    """``arrays`` (same row count) padded to ``size`` rows by repeating the last row."""
    out = {}
    for name, a in arrays.items():
        missing = size - a.shape[0]
        out[name] = a if missing == 0 else np.concatenate(
            [a, np.repeat(a[-1:], missing, axis=0)], axis=0)
    return out


def batch_invariance(model: Any) -> tuple[bool, str]:
    """Whether ``model``'s plan makes a sample's result independent of its batch, and why.

    It does on the cpu backend while batch invariance holds there (the native GEMM
    loaded, ``KEEL_BATCH_INVARIANT`` on) and no tuning cache may pick another variant
    at another batch size; other backends make no such promise."""
    from keel.backends.cpu.planner import batch_invariant
    from keel.config import cache_dir, settings

    backends = sorted({n.backend for n in model.plan.nodes})
    if backends != ["cpu"]:
        return False, (f"the plan runs on {', '.join(backends) or 'no backend'}; only the "
                       "cpu backend promises batch invariance")
    if not batch_invariant():
        why = ("KEEL_BATCH_INVARIANT is off" if not settings().batch_invariant else
               "the native GEMM is not loaded (OpenBLAS sums in an order that follows "
               "the batch)")
        return False, f"{why}: a row's low bits may change with the batch size"
    tuning = cache_dir() / "tuning"
    if tuning.is_dir() and any(f.suffix == ".json" for f in tuning.iterdir()):
        return False, (f"the tuning cache ({tuning}) may choose another variant at "
                       "another batch size")
    return True, "the cpu plan is batch invariant: a row's result never depends on its batch"


def check_invariance(run: Callable[[Arrays], Arrays], feeds: Arrays) -> str:
    """"" when each row of ``feeds`` gets the same bits alone, in the whole batch and in a
    slice at another position; else what differed. A check at load time, beside the
    plan's promise: a kernel that broke it shows here before any request is served."""
    rows = next(iter(feeds.values())).shape[0]
    last = rows - 1
    ranges = [(last, last + 1), (1, rows)] if rows > 1 else [(0, 1)]
    parts = [run({k: a[begin:end] for k, a in feeds.items()}) for begin, end in ranges]
    whole = run(feeds)                  # last: the model's latest plan is the whole batch's
    for (begin, end), part in zip(ranges, parts, strict=True):
        for name, value in part.items():
            if not np.array_equal(value, whole[name][begin:end],
                                  equal_nan=value.dtype.kind in "fc"):
                return (f"output {name!r} of rows {begin}..{end - 1} run as a batch of "
                        f"{end - begin} differs from the same rows in a batch of {rows}")
    return ""


class Batcher:
    """Collects requests for one model and runs them in batches of up to ``size`` rows.

    ``run`` executes one batch (it is called on this batcher's own worker thread,
    one batch at a time). ``delay_s`` is the longest the first request of a batch
    waits for others. ``pad``: every batch runs padded to exactly ``size`` rows and
    larger requests are cut into ``size``-row parts; without it batches run as they
    are and ``run`` (the model's planner) splits them.
    """

    def __init__(self, run: Callable[[Arrays], Arrays], size: int, delay_s: float,
                 observe: BatchObserver | None = None, pad: bool = True) -> None:
        self.size = size
        self.delay_s = delay_s
        self.pad = pad
        self._run = run
        self._observe = observe
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._held: _Item | None = None        # an item that did not fit the last batch
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="keel-batch")
        self._task: asyncio.Task[None] | None = None

    async def submit(self, arrays: Arrays) -> Arrays:
        """The outputs for ``arrays`` (every input with the batch as its first dimension)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        rows = next(iter(arrays.values())).shape[0]
        loop = asyncio.get_running_loop()
        parts = []
        step = self.size if self.pad else rows
        for start in range(0, rows, step):
            part = {k: a[start:start + step] for k, a in arrays.items()}
            item = _Item(part, min(step, rows - start), loop.create_future())
            self._queue.put_nowait(item)
            parts.append(item.future)
        results = await asyncio.gather(*parts)
        if len(results) == 1:
            return results[0]
        return {k: np.concatenate([r[k] for r in results], axis=0) for k in results[0]}

    async def close(self) -> None:
        """Stop after the batches already queued have run."""
        while self._held is not None or not self._queue.empty():
            await asyncio.sleep(0.005)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if batch:
                await loop.run_in_executor(self._executor, self._execute, batch)

    async def _next(self, timeout: float | None) -> _Item | None:
        if self._held is not None:
            item, self._held = self._held, None
            return item
        if timeout is None:
            return await self._queue.get()
        if timeout <= 0:
            return None if self._queue.empty() else self._queue.get_nowait()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def _collect(self) -> list[_Item]:
        first = await self._next(None)
        if first is None or first.future.done():      # cancelled: its caller gave up
            return []
        batch, rows, key = [first], first.rows, first.key()
        deadline = first.queued_at + self.delay_s
        while rows < self.size:
            item = await self._next(deadline - time.perf_counter())
            if item is None:
                break
            if item.future.done():
                continue
            if item.key() != key or rows + item.rows > self.size:
                self._held = item
                break
            batch.append(item)
            rows += item.rows
        return batch

    def _execute(self, batch: list[_Item]) -> None:
        started = time.perf_counter()
        rows = sum(item.rows for item in batch)
        try:
            joined = {k: np.concatenate([item.arrays[k] for item in batch], axis=0)
                      for k in batch[0].arrays}
            outputs = self._run(pad_rows(joined, self.size) if self.pad else joined)
        except BaseException as exc:  # handed to every waiting caller
            for item in batch:
                _settle(item.future, exc=exc)
            return
        if self._observe is not None:
            padded = self.size - rows if self.pad else 0
            self._observe(rows, padded, [started - i.queued_at for i in batch])
        pos = 0
        for item in batch:
            part = {k: v[pos:pos + item.rows] for k, v in outputs.items()}
            _settle(item.future, result=part)
            pos += item.rows


def _settle(future: asyncio.Future[Arrays], result: Arrays | None = None,
            exc: BaseException | None = None) -> None:
    """Complete ``future`` from the worker thread, on its own loop."""

    def done() -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result if result is not None else {})

    future.get_loop().call_soon_threadsafe(done)
