"""keel's own worker threads for native kernels.

``parallel_for(n, body, threads)`` splits ``range(n)`` into at most
``threads`` contiguous chunks of near-equal size — the same chunks for the
same ``n`` and ``threads``, every time — runs the first on the calling
thread and the rest on persistent worker threads, and returns when all are
done. Native kernels release the GIL (ctypes drops it around a foreign
call), so the chunks run in parallel. A kernel that computes every item of
its range independently gives bitwise the same result for any thread count.

Waking a worker costs tens of microseconds, so callers pass ``min_chunk``
(the fewest items worth a thread) and small jobs run inline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["chunks", "parallel_for", "shutdown"]

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_workers = 0


def chunks(n: int, threads: int, min_chunk: int = 1) -> list[tuple[int, int]]:
    """The contiguous ``(lo, hi)`` ranges ``parallel_for`` hands out (deterministic)."""
    if n <= 0:
        return []
    parts = max(1, min(threads, n // max(1, min_chunk), n))
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def parallel_for(n: int, body: Callable[[int, int], None], threads: int,
                 min_chunk: int = 1) -> None:
    """Run ``body(lo, hi)`` over contiguous chunks of ``range(n)`` on up to ``threads`` threads."""
    parts = chunks(n, threads, min_chunk)
    if len(parts) <= 1:
        for lo, hi in parts:
            body(lo, hi)
        return
    pool = _pool(len(parts) - 1)
    futures: list[Future[None]] = [pool.submit(body, lo, hi) for lo, hi in parts[1:]]
    error: BaseException | None = None
    try:
        body(*parts[0])
    except BaseException as exc:      # still wait for the others before raising
        error = exc
    for fut in futures:
        try:
            fut.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


def _pool(workers: int) -> ThreadPoolExecutor:
    global _executor, _workers
    if _executor is not None and _workers >= workers:
        return _executor
    with _lock:
        if _executor is None or _workers < workers:
            old = _executor
            _executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="keel-worker")
            _workers = workers
            if old is not None:
                old.shutdown(wait=False)
        return _executor


def shutdown() -> None:
    """Stop the worker threads (they start again on the next parallel call)."""
    global _executor, _workers
    with _lock:
        if _executor is not None:
            _executor.shutdown(wait=True)
        _executor, _workers = None, 0
