"""Adaptive planning: decide before running, and again only at chunk boundaries.

The planner takes a request (kernel class, size, residency, the requested
backend and precision, an optional memory limit and an optional telemetry
snapshot) and returns an :class:`AdaptivePlan`: the runtime, kernel variant,
precision, a chunk-size hint and the log of reasons behind each choice.

It is a planner, not a controller: it never polls, never switches a backend
in the middle of a kernel, and never overrides what the caller pinned. When
work does not fit the memory budget in one piece, it splits the work into
chunks; between chunks, :meth:`AdaptivePlanner.replan` may shrink the chunk
when a fresh telemetry snapshot shows less free memory than planned for.
Without telemetry the plan stays as it is (static heuristics and declared
metadata only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from keel.config import format_bytes
from keel.errors import InvalidArgumentError, MemoryLimitError

__all__ = [
    "AdaptivePlan",
    "AdaptivePlanner",
    "MemoryTelemetry",
    "PlanRequest",
    "plan_chunks",
]

PeakFn = Callable[[int], int]


@runtime_checkable
class MemoryTelemetry(Protocol):
    """What the planner reads from a telemetry snapshot, when there is one.

    ``available_bytes(device)`` is the memory free on ``device`` when the
    snapshot was taken, or ``None`` when the source cannot tell.
    """

    def available_bytes(self, device: str) -> int | None: ...


@dataclass(frozen=True)
class PlanRequest:
    """Planner input: what runs, how much of it, where its data lives, what was asked."""

    kernel_class: str                 # an OpGroup name, or "graph" for a whole model
    size: int                         # rows / batch items to process
    residency: str = "cpu"            # device the data lives on now
    backend: str = "auto"             # requested runtime: "auto" or a pinned backend
    precision: str = "auto"           # requested precision: "auto" or pinned
    memory_limit: int | None = None   # bytes; None: no budget
    native_precision: str = "fp32"    # what the work is expressed in
    variant: str = "default"          # variant chosen upstream (declared metadata)
    variant_reason: str = "no variant metadata given: default kernel"
    telemetry: Any = None             # a MemoryTelemetry, or None


@dataclass(frozen=True)
class AdaptivePlan:
    """Planner output. ``reasons`` is the decision log, oldest first."""

    runtime: str
    variant: str
    precision: str
    chunk_size: int
    size: int
    peak_bytes: int | None = None
    memory_limit: int | None = None
    pinned: bool = False
    reasons: tuple[str, ...] = field(default_factory=tuple)

    @property
    def n_chunks(self) -> int:
        return max(1, -(-self.size // max(self.chunk_size, 1)))

    @property
    def chunked(self) -> bool:
        return self.chunk_size < self.size

    def chunks(self, start: int = 0) -> list[tuple[int, int]]:
        """``(begin, end)`` ranges from ``start`` on, each at most ``chunk_size`` long."""
        step = max(self.chunk_size, 1)
        return [(b, min(b + step, self.size)) for b in range(start, self.size, step)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime, "variant": self.variant, "precision": self.precision,
            "chunk_size": self.chunk_size, "size": self.size, "n_chunks": self.n_chunks,
            "peak_bytes": self.peak_bytes, "memory_limit": self.memory_limit,
            "pinned": self.pinned, "reasons": list(self.reasons),
        }


class AdaptivePlanner:
    """Plans once before running and re-plans only at chunk boundaries.

    ``choose_runtime(request) -> (backend, reason)`` picks the runtime in auto
    mode (the op-level selection for a single op, placement for a graph); the
    default keeps the data where it lives.
    """

    def __init__(self, choose_runtime: Callable[[PlanRequest], tuple[str, str]] | None = None,
                 ) -> None:
        self._choose_runtime = choose_runtime

    def plan(self, request: PlanRequest, peak_of: PeakFn | None = None) -> AdaptivePlan:
        """Decide runtime, variant, precision and chunk size for ``request``.

        ``peak_of(n)`` is the peak memory of processing ``n`` items at once;
        a limit that even one item cannot meet raises ``MemoryLimitError``.
        """
        if request.size < 0:
            raise InvalidArgumentError(f"size must be >= 0, got {request.size}")
        runtime, pinned, why_runtime = self._runtime(request)
        precision, why_precision = _precision(request)
        reasons = [why_runtime, f"variant {request.variant}: {request.variant_reason}",
                   why_precision]
        limit = _effective_limit(request.memory_limit, request.telemetry, runtime, reasons)
        chunk, peak, why_chunk = plan_chunks(request.size, peak_of, limit)
        reasons.append(why_chunk)
        return AdaptivePlan(runtime, request.variant, precision, chunk, request.size, peak,
                            limit, pinned, tuple(reasons))

    def replan(self, plan: AdaptivePlan, completed: int, peak_of: PeakFn | None = None,
               telemetry: Any = None) -> AdaptivePlan:
        """Re-plan at a chunk boundary after ``completed`` items are done.

        Only the chunk size may change, and only from a telemetry snapshot:
        runtime, variant and precision stay as planned (nothing switches
        mid-run, and pins stay authoritative).
        """
        if telemetry is None or peak_of is None or completed >= plan.size:
            return plan
        free = _available(telemetry, plan.runtime)
        if free is None or plan.peak_bytes is None or plan.peak_bytes <= free:
            return plan
        limit = free if plan.memory_limit is None else min(plan.memory_limit, free)
        remaining = plan.size - completed
        chunk, peak, why = plan_chunks(remaining, peak_of, limit)
        note = (f"re-planned after {completed} of {plan.size} items: telemetry shows "
                f"{format_bytes(free)} free on {plan.runtime}; {why}")
        return replace(plan, chunk_size=min(chunk, plan.chunk_size), peak_bytes=peak,
                       memory_limit=limit, reasons=(*plan.reasons, note))

    def _runtime(self, request: PlanRequest) -> tuple[str, bool, str]:
        if request.backend != "auto":
            return request.backend, True, f"runtime {request.backend}: pinned by the caller"
        if self._choose_runtime is None:
            return (request.residency, False,
                    f"runtime {request.residency}: auto mode keeps the data where it lives")
        name, reason = self._choose_runtime(request)
        return name, False, f"runtime {name}: {reason}"


def plan_chunks(size: int, peak_of: PeakFn | None, limit: int | None,
                ) -> tuple[int, int | None, str]:
    """The largest chunk (≤ ``size``) whose peak fits ``limit``: (chunk, peak, reason)."""
    if peak_of is None:
        return max(size, 1), None, "no memory model given: one chunk"
    whole = peak_of(size)
    if limit is None:
        return max(size, 1), whole, f"no memory limit: one chunk (peak {format_bytes(whole)})"
    if whole <= limit:
        return max(size, 1), whole, (
            f"peak {format_bytes(whole)} fits the limit {format_bytes(limit)}: one chunk")
    smallest = peak_of(1)
    if smallest > limit:
        raise MemoryLimitError(
            f"memory limit {format_bytes(limit)} ({limit} bytes) cannot be met: the plan "
            f"needs a peak of {format_bytes(smallest)} ({smallest} bytes) even one item at "
            f"a time ({format_bytes(whole)} for all {size} at once)",
            required_bytes=smallest, limit_bytes=limit,
        )
    chunk = _largest_fitting(size, peak_of, limit)
    peak = peak_of(chunk)
    n = -(-size // chunk)
    return chunk, peak, (
        f"peak {format_bytes(whole)} for {size} items exceeds the limit "
        f"{format_bytes(limit)}: {n} chunks of up to {chunk} (peak {format_bytes(peak)})")


def _largest_fitting(size: int, peak_of: PeakFn, limit: int) -> int:
    """Binary search; the peak grows with the chunk (checked at the ends)."""
    lo, hi = 1, size           # peak_of(lo) fits, peak_of(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak_of(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo


def _precision(request: PlanRequest) -> tuple[str, str]:
    if request.precision != "auto":
        return request.precision, f"precision {request.precision}: pinned by the caller"
    return request.native_precision, (
        f"precision {request.native_precision}: auto keeps the model's own precision")


def _effective_limit(limit: int | None, telemetry: Any, device: str,
                     reasons: list[str]) -> int | None:
    if telemetry is None:
        reasons.append("no telemetry snapshot: static plan from declared sizes")
        return limit
    free = _available(telemetry, device)
    if free is None:
        reasons.append(f"telemetry cannot tell the free memory on {device}: limit unchanged")
        return limit
    if limit is None or free < limit:
        reasons.append(f"telemetry: {format_bytes(free)} free on {device}; planning within it")
        return free
    reasons.append(f"telemetry: {format_bytes(free)} free on {device}, above the limit")
    return limit


def _available(telemetry: Any, device: str) -> int | None:
    if isinstance(telemetry, MemoryTelemetry):
        value = telemetry.available_bytes(device)
        return None if value is None else int(value)
    return None

