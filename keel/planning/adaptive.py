"""Adaptive planning: decide before running, and again only at chunk boundaries.

The planner takes a request (op class, size, the dtype mix of its nodes, where
its inputs live, the requested backend, precision and performance hint, an
optional memory limit, a telemetry snapshot and the runtime history of this
work on this machine) and returns an :class:`AdaptivePlan`: the runtime,
kernel variant, precision plan, chunk-size hint, stream split and the log of
reasons behind each choice.

It is a planner, not a controller: it never polls, never switches a backend
in the middle of a kernel, and never overrides what the caller pinned. When
work does not fit the memory budget in one piece, it splits the work into
chunks; between chunks, :meth:`AdaptivePlanner.replan` may shrink the chunk
(a fresh snapshot shows less free memory than planned for) or grow it toward
the budget (there is headroom and no measurement says the larger size runs
slower), at most doubling per boundary. Without telemetry the plan rests on
static heuristics and declared metadata only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from keel.config import HINTS, format_bytes, format_limit
from keel.errors import InvalidArgumentError, MemoryLimitError
from keel.planning import trials

__all__ = [
    "HINTS",
    "AdaptivePlan",
    "AdaptivePlanner",
    "MemoryTelemetry",
    "PlanRequest",
    "check_hint",
    "plan_chunks",
    "split_evenly",
]

PeakFn = Callable[[int], int]
#: a re-plan grows the chunk at most by this factor per chunk boundary
GROWTH_PER_BOUNDARY = 2


def check_hint(value: Any, where: str = "hint") -> str:
    """``value`` as a hint name; anything else raises naming the allowed values."""
    if value is None:
        return "none"
    if not isinstance(value, str) or value.strip().lower() not in HINTS:
        raise InvalidArgumentError(
            f"{where} {value!r} is not allowed; use one of {', '.join(HINTS)}")
    return value.strip().lower()


def split_evenly(size: int, parts: int) -> tuple[int, ...]:
    """``size`` items in ``parts`` contiguous near-equal parts, larger parts first."""
    parts = max(1, min(parts, size)) if size > 0 else 1
    base, extra = divmod(size, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


@runtime_checkable
class MemoryTelemetry(Protocol):
    """What the planner reads from a telemetry snapshot, when there is one.

    ``available_bytes(device)`` is the memory free on ``device`` when the
    snapshot was taken, or ``None`` when the source cannot tell.
    """

    def available_bytes(self, device: str) -> int | None: ...


@dataclass(frozen=True)
class PlanRequest:
    """Planner input: what runs, how much of it, where its data lives, what was asked.

    ``node_precisions`` is the dtype mix: each node's compute precision as
    placed (``(node, precision)`` pairs). ``history`` is what the runtime
    history holds for this work on this machine (size -> record); ``None``
    when no history is kept, empty when nothing was measured yet. ``profile``
    (a ``HardwareProfile``) tells the precision planner what the devices do
    fast. ``cores`` is what the cpu backend may use; ``threads_pinned`` says
    the caller fixed it.
    """

    kernel_class: str                 # an OpGroup name, or "graph" for a whole model
    size: int                         # rows / batch items to process
    residency: str = "cpu"            # device the inputs live on now
    backend: str = "auto"             # requested runtime: "auto" or a pinned backend
    precision: str = "auto"           # requested precision: "auto" or pinned
    memory_limit: int | None = None   # bytes; None: no budget
    native_precision: str = "fp32"    # what the work is expressed in
    variant: str = "default"          # variant chosen upstream (declared metadata)
    variant_reason: str = "no variant metadata given: default kernel"
    telemetry: Any = None             # a MemoryTelemetry, or None
    node_precisions: tuple[tuple[str, str], ...] = ()
    hint: str = "none"
    cores: int = 1
    threads_pinned: bool = False
    splittable: bool = True           # the work has a batch axis to split
    history: Mapping[int, Any] | None = None
    profile: Any = None
    low_memory: str = ""              # why the machine is planned in low-memory mode


@dataclass(frozen=True)
class AdaptivePlan:
    """Planner output. ``reasons`` is the decision log, oldest first.

    ``memory_limit`` is the budget the chunks were sized for (the requested
    limit, lowered to the free memory a snapshot showed); ``requested_limit``
    the caller's. ``precision_plan`` maps each precision to the nodes that
    compute in it. ``streams`` sub-batches of ``batch_split`` items run
    concurrently on ``threads_per_stream`` threads each.
    """

    runtime: str
    variant: str
    precision: str
    chunk_size: int
    size: int
    peak_bytes: int | None = None
    memory_limit: int | None = None
    pinned: bool = False
    reasons: tuple[str, ...] = field(default_factory=tuple)
    precision_plan: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    hint: str = "none"
    streams: int = 1
    threads_per_stream: int = 1
    batch_split: tuple[int, ...] = ()
    requested_limit: int | None = None
    residency: str = "cpu"
    telemetry: Mapping[str, Any] | None = None

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
            "precision_plan": {k: list(v) for k, v in self.precision_plan.items()},
            "residency": self.residency, "hint": self.hint,
            "streams": self.streams, "threads_per_stream": self.threads_per_stream,
            "batch_split": list(self.batch_split),
            "chunk_size": self.chunk_size, "size": self.size, "n_chunks": self.n_chunks,
            "peak_bytes": self.peak_bytes, "memory_limit": self.memory_limit,
            "requested_limit": self.requested_limit, "pinned": self.pinned,
            "telemetry": None if self.telemetry is None else dict(self.telemetry),
            "reasons": list(self.reasons),
        }


class AdaptivePlanner:
    """Plans once before running and re-plans only at chunk boundaries.

    ``choose_runtime(request) -> (backend, reason)`` picks the runtime in auto
    mode (the op-level selection for a single op, placement for a graph); the
    default keeps the data where it lives. The chooser sees the request's
    residency: inputs already resident on a device favour it.
    """

    def __init__(self, choose_runtime: Callable[[PlanRequest], tuple[str, str]] | None = None,
                 ) -> None:
        self._choose_runtime = choose_runtime

    def plan(self, request: PlanRequest, peak_of: PeakFn | None = None) -> AdaptivePlan:
        """Decide runtime, variant, precision, chunk size and streams for ``request``.

        ``peak_of(n)`` is the peak memory of processing ``n`` items at once;
        a limit that even one item cannot meet raises ``MemoryLimitError``.
        """
        if request.size < 0:
            raise InvalidArgumentError(f"size must be >= 0, got {request.size}")
        hint = check_hint(request.hint)
        runtime, pinned, why_runtime = self._runtime(request)
        precision, groups, why_precision = _precision(request, runtime, hint)
        reasons = [why_runtime, f"variant {request.variant}: {request.variant_reason}",
                   *why_precision]
        limit = _effective_limit(request, runtime, peak_of, reasons)
        fit, peak, why_chunk = plan_chunks(request.size, peak_of, limit)
        reasons.append(why_chunk)
        chunk = _first_chunk(request, fit, reasons)
        if chunk != fit and peak_of is not None:
            peak = peak_of(chunk)
        streams, threads, split = _streams(request, runtime, hint, chunk, peak_of, limit,
                                           reasons)
        return AdaptivePlan(runtime, request.variant, precision, chunk, request.size, peak,
                            limit, pinned, tuple(reasons), groups, hint, streams, threads,
                            split, request.memory_limit, request.residency,
                            telemetry_summary(request.telemetry))

    def replan(self, plan: AdaptivePlan, completed: int, peak_of: PeakFn | None = None,
               telemetry: Any = None, measured: Any = None,
               known: Mapping[int, Any] | None = None) -> AdaptivePlan:
        """Re-plan at a chunk boundary after ``completed`` items are done.

        Only the chunk size may change: runtime, variant and precision stay as
        planned (nothing switches mid-run, and pins stay authoritative). The
        budget is the requested limit, lowered to the free memory ``telemetry``
        shows now. A chunk that no longer fits shrinks to the largest that does;
        one with headroom grows toward it, at most doubling, unless ``known``
        (size -> measured record) says the larger size ran slower per item than
        ``measured`` (the record of the chunk just run). Deterministic given
        these measurements.
        """
        if peak_of is None or completed >= plan.size:
            return plan
        free = None if telemetry is None else _available(telemetry, plan.runtime)
        limit = _tighter(plan.requested_limit, free)
        if limit is None:
            return plan
        remaining = plan.size - completed
        fit, _, _ = plan_chunks(remaining, peak_of, limit)
        current = min(plan.chunk_size, remaining)
        where = (f"re-planned after {completed} of {plan.size} items"
                 + ("" if free is None else
                    f": telemetry shows {format_bytes(free)} free on {plan.runtime}"))
        if fit < current:
            note = f"{where}; the chunk shrinks to {fit}, the largest that fits " \
                   f"{format_limit(limit)}"
            return _resized(plan, fit, peak_of, limit, note)
        grown = min(fit, current * GROWTH_PER_BOUNDARY)
        if grown <= current:
            return plan
        slower = _measured_slower(grown, measured, known)
        if slower is not None:
            return replace(plan, reasons=(*plan.reasons, f"{where}; the chunk stays at "
                                          f"{current}: {slower}"))
        note = (f"{where}; {format_bytes(peak_of(grown))} for {grown} items fits "
                f"{format_limit(limit)}: the chunk grows from {current} to {grown}"
                + (f" (measured {measured.describe()})" if measured is not None else ""))
        return _resized(plan, grown, peak_of, limit, note)

    def _runtime(self, request: PlanRequest) -> tuple[str, bool, str]:
        if request.backend != "auto":
            return request.backend, True, f"runtime {request.backend}: pinned by the caller"
        if self._choose_runtime is None:
            return (request.residency, False,
                    f"runtime {request.residency}: auto mode keeps the data where it lives")
        name, reason = self._choose_runtime(request)
        return name, False, f"runtime {name}: {reason}"


def _resized(plan: AdaptivePlan, chunk: int, peak_of: PeakFn, limit: int,
             note: str) -> AdaptivePlan:
    return replace(plan, chunk_size=chunk, peak_bytes=peak_of(chunk), memory_limit=limit,
                   reasons=(*plan.reasons, note))


def _measured_slower(size: int, measured: Any, known: Mapping[int, Any] | None) -> str | None:
    """Why growing to ``size`` would not pay, from measurements; None when none says so."""
    if measured is None or not known or size not in known:
        return None
    larger = known[size]
    if larger.seconds_per_item <= measured.seconds_per_item:
        return None
    return (f"the runtime history has {larger.describe()}, slower than "
            f"{measured.describe()}")


def _tighter(limit: int | None, free: int | None) -> int | None:
    if free is None:
        return limit
    return free if limit is None else min(limit, free)


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
            f"peak {format_bytes(whole)} fits the limit {format_limit(limit)}: one chunk")
    smallest = peak_of(1)
    if smallest > limit:
        raise MemoryLimitError(
            f"memory limit {format_limit(limit)} ({limit} bytes) cannot be met: the plan "
            f"needs a peak of {format_bytes(smallest)} ({smallest} bytes) even one item at "
            f"a time ({format_bytes(whole)} for all {size} at once)",
            required_bytes=smallest, limit_bytes=limit,
        )
    chunk = _largest_fitting(size, peak_of, limit)
    peak = peak_of(chunk)
    n = -(-size // chunk)
    return chunk, peak, (
        f"peak {format_bytes(whole)} for {size} items exceeds the limit "
        f"{format_limit(limit)}: {n} chunks of up to {chunk} (peak {format_bytes(peak)})")


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


def _first_chunk(request: PlanRequest, fit: int, reasons: list[str]) -> int:
    """The first chunk: the largest that fits, or what the runtime history says runs best."""
    if fit >= request.size or request.history is None:
        return fit
    if not request.history:
        first = max(1, fit // 2)
        if first < fit:
            reasons.append(
                f"no runtime history for this work on this machine: the first chunk is "
                f"{first}, half of the {fit} that fit, to measure its step time; later "
                f"chunks grow toward {fit} at chunk boundaries")
        return first
    fits = [r for size, r in request.history.items() if size <= fit]
    best = min(fits, key=lambda r: (r.seconds_per_item, -r.size), default=None)
    if best is None:
        reasons.append(f"runtime history: no measured size fits the budget: first chunk {fit}")
        return fit
    reasons.append(f"runtime history on this machine: {best.describe()}, the fastest "
                   f"recorded that fits: first chunk {best.size}")
    return int(best.size)


def _streams(request: PlanRequest, runtime: str, hint: str, chunk: int,
             peak_of: PeakFn | None, limit: int | None,
             reasons: list[str]) -> tuple[int, int, tuple[int, ...]]:
    """How many concurrent streams, with how many threads each, and the batch split."""
    cores = max(1, request.cores)
    whose = "the caller's" if request.threads_pinned else "the usable"
    if hint != "throughput":
        what = ("latency hint: one stream using all" if hint == "latency"
                else "no performance hint: one stream on")
        reasons.append(f"{what} {cores} of {whose} cores; the batch is not split")
        return 1, cores, (request.size,)
    per_stream = 1 if cores <= 4 else 2 if cores <= 16 else 4
    nominal = max(1, cores // per_stream)
    why_not = _no_streams(request, runtime, chunk, cores)
    if why_not is not None:
        would = (f" (a batch of {nominal} or more would run as {nominal} streams of "
                 f"{cores // nominal} thread{'s' if cores // nominal > 1 else ''} each)"
                 if request.size < 2 and nominal > 1 and runtime == "cpu" else "")
        reasons.append(f"throughput hint: one stream of {cores} threads: {why_not}{would}")
        return 1, cores, (request.size,)
    streams = max(1, min(request.size, nominal))
    while streams > 1 and peak_of is not None and limit is not None \
            and streams * peak_of(-(-request.size // streams)) > limit:
        streams -= 1
    split = split_evenly(request.size, streams)
    threads = max(1, cores // streams)
    reasons.append(
        f"throughput hint: {streams} streams of {threads} thread{'s' if threads > 1 else ''} "
        f"each on {cores} of {whose} cores ({per_stream} per stream for {cores} cores); "
        f"the batch of {request.size} splits into {'+'.join(map(str, split))}, run "
        f"concurrently, results concatenated in order"
        + ("" if len(split) == nominal else
           " (fewer streams: " + ("the batch is smaller" if request.size < nominal
                                  else f"{nominal} arenas exceed the memory budget") + ")"))
    return streams, threads, split


def _no_streams(request: PlanRequest, runtime: str, chunk: int, cores: int) -> str | None:
    if runtime != "cpu":
        return f"streams split work across cpu cores, and this runs on {runtime}"
    if chunk < request.size:
        return "the memory budget already splits the batch into chunks"
    if not request.splittable or request.size < 2:
        return "there is no batch of two or more items to split"
    if cores < 2:
        return "one usable core"
    if request.low_memory:
        return f"low-memory mode ({request.low_memory}): one stream reuses one arena"
    return None


def _precision(request: PlanRequest, runtime: str, hint: str,
               ) -> tuple[str, dict[str, tuple[str, ...]], list[str]]:
    """The precision, the nodes of each precision, and the reasons."""
    groups: dict[str, list[str]] = {}
    for node, precision in request.node_precisions:
        groups.setdefault(precision, []).append(node)
    plan = {k: tuple(v) for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))}
    if request.precision != "auto":
        return request.precision, plan, [
            f"precision {request.precision}: pinned by the caller"]
    native = request.native_precision
    reasons = []
    if len(plan) > 1:
        mix = ", ".join(f"{len(v)} node{'s' if len(v) != 1 else ''} in {k}"
                        for k, v in plan.items())
        reasons.append(f"precision plan: mixed dtypes: {mix}; auto computes each node in "
                       f"its own dtype's precision")
    reasons.append(f"precision {native}: auto keeps the model's own precision"
                   + _device_precision_note(request.profile, runtime, native))
    return native if len(plan) <= 1 else "mixed", plan, reasons


def _device_precision_note(profile: Any, runtime: str, native: str) -> str:
    """What ``auto`` would do differently on this device, and why it does not by itself."""
    if native != "fp32":
        return ""
    if runtime == "cpu":
        simd = set(getattr(getattr(profile, "cpu", None), "simd", ()) or ())
        has = sorted(simd & {"avx512_fp16", "asimdhp", "fphp"})
        return ("; on cpu fp32 is the fast path: keel's cpu kernels compute fp16 by "
                "converting to fp32, so fp16 would only add conversions"
                + (f" (the CPU reports {', '.join(has)}, which they do not use)" if has
                   else ""))
    fast = _fast_fp16_gpu(profile)
    if runtime in ("gpu", "cuda") and fast is not None:
        return (f"; {fast} has fast fp16 arithmetic: where auto placement measures this "
                f"model on the gpu, auto also runs it at fp16 (then bf16, where fp16 is not "
                f"within tolerance) on the same inputs and takes one only within "
                f"{trials.HALF_TOLERANCE:.0e} relative error of fp32 and faster (explain() "
                f"says which); pin precision='fp32' to rule that out, or 'fp16' or 'bf16' "
                f"to take it without the check")
    return ""


def _fast_fp16_gpu(profile: Any) -> str | None:
    """The first GPU with fast fp16 (NVIDIA compute capability 7.0 or later), described."""
    for gpu in getattr(profile, "gpus", ()) or ():
        cc = getattr(gpu, "compute_capability", None)
        try:
            major = int(str(cc).split(".")[0])
        except ValueError:
            continue
        if major >= 7:
            return f"{gpu.name or 'GPU ' + str(gpu.index)} (compute capability {cc})"
    return None


def _effective_limit(request: PlanRequest, device: str, peak_of: PeakFn | None,
                     reasons: list[str]) -> int | None:
    """The budget: the requested limit, lowered to the free memory a snapshot shows; with
    no limit, the free memory only when the whole work would not fit in it."""
    limit, telemetry = request.memory_limit, request.telemetry
    if telemetry is None:
        reasons.append("no telemetry snapshot: static plan from declared sizes")
        return limit
    source = getattr(telemetry, "source", "caller's source")
    free = _available(telemetry, device)
    if free is None:
        reasons.append(f"telemetry ({source}) cannot tell the free memory on {device}: "
                       f"limit unchanged")
        return limit
    seen = f"telemetry ({source}): {format_bytes(free)} free on {device}"
    if limit is not None and free >= limit:
        reasons.append(f"{seen}, above the limit")
        return limit
    if limit is None:
        whole = None if peak_of is None else peak_of(request.size)
        if whole is None or whole <= free or peak_of is None or peak_of(1) > free:
            reasons.append(f"{seen}; no memory limit: planning without one")
            return None
    reasons.append(f"{seen}; planning within it")
    return free


def telemetry_summary(telemetry: Any) -> dict[str, Any] | None:
    """What the plan records of a snapshot: its source and readings."""
    if telemetry is None:
        return None
    if hasattr(telemetry, "to_dict"):
        data = dict(telemetry.to_dict())
        data.setdefault("source", getattr(telemetry, "source", type(telemetry).__name__))
        return data
    return {"source": str(getattr(telemetry, "source", type(telemetry).__name__))}


def _available(telemetry: Any, device: str) -> int | None:
    if isinstance(telemetry, MemoryTelemetry):
        value = telemetry.available_bytes(device)
        return None if value is None else int(value)
    return None

