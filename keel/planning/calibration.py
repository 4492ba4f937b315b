"""Measured CPU/GPU crossovers: from which size the GPU pays back its transfers.

Seed 004 decides by fixed sizes (under 1 MB the CPU; matmul-like and
convolution ops over 10 MB and elementwise ops over 100 MB the GPU). Those
numbers describe some machine, not this one. :func:`calibrate` measures this
one: for each op group and dtype it times a representative op (``WORKLOADS``)
on the CPU backend and on the GPU backend over a geometric sweep of input
sizes and keeps

* every :class:`Measurement`, as medians over repeats: the CPU time; the GPU
  time for data that lives on the host, host→device copies of the inputs and
  device→host copies of the results included; and the GPU time for data
  already on the device. Each clock stops only after the device synchronized,
  and one untimed run per point absorbs one-time costs (kernel compilation,
  memory pools);
* the *crossover* of each (group, dtype): the smallest measured input size
  from which the GPU, copies included, beat the CPU at that size and at every
  larger size measured. ``None`` when the GPU was not ahead at the largest
  size and the sweep covered its whole range. A sweep cut short (time budget,
  memory, a failed run) before the GPU pulled ahead proves nothing: that pair
  is left out, with a note, and selection keeps the static rule for it.

The backends timed are the ones selection would use: the first available
backend of each device kind in the registry's priority chain that has the
op. Without an available GPU backend nothing is timed: the calibration's
``no_gpu`` says why, and it covers no group.

A calibration persists as versioned JSON tied to a hardware fingerprint (CPU
model, architecture and cores, GPU names, drivers and memory) in the cache
directory (``KEEL_CACHE_DIR``, else the platform's cache directory under
``keel``), one file per fingerprint, written atomically.
:func:`default_calibration` is what selection consults when it is given none:
the file ``KEEL_CALIBRATION`` names (``off`` disables calibration), else the
cached file for this machine. A file measured on a different machine, of
another format version, or unreadable is ignored, and
:func:`calibration_status` says why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from keel.backends.base import Backend, DeviceKind
from keel.backends.registry import BackendRegistry, default_registry
from keel.config import cache_dir
from keel.dtypes import DType, as_dtype
from keel.errors import BackendSelectionError, InvalidArgumentError, KeelError
from keel.hardware.fingerprint import _probe
from keel.hardware.profile import HardwareProfile
from keel.ops.registry import Op, OpGroup
from keel.planning.calibration_record import (
    CALIBRATION_VERSION,
    Calibration,
    CalibrationStatus,
    Measurement,
    calibration_path,
    calibration_status,
    default_calibration,
    find_calibration,
    find_crossover,
    fingerprint_id,
    format_seconds,
    format_size,
    group_name,
    hardware_fingerprint,
    load,
    machine_fingerprint,
    parse_group,
    reset_default_calibration,
    save,
)

__all__ = [  # the sweep's names, then those of the record and its file, re-exported
    "CONFIRM_WINS", "DEFAULT_GROUPS", "DEFAULT_SIZES", "QUICK_SIZES", "WORKLOADS", "Workload",
    "calibrate",
    "CALIBRATION_VERSION", "Calibration", "CalibrationStatus", "Measurement", "cache_dir",
    "calibration_path", "calibration_status", "default_calibration", "find_calibration",
    "find_crossover", "fingerprint_id", "format_seconds", "format_size", "group_name",
    "hardware_fingerprint", "load", "machine_fingerprint", "parse_group",
    "reset_default_calibration", "save",
]

# 10 kB to 100 MB of input in steps of √10, so the seed-004 thresholds
# (1, 10 and 100 MB) are points of the sweep.
DEFAULT_SIZES = tuple(round(10 ** (4 + k / 2)) for k in range(9))
QUICK_SIZES = tuple(10**k for k in range(4, 8))            # 10 kB .. 10 MB
DEFAULT_REPEATS, QUICK_REPEATS = 5, 3
DEFAULT_BUDGET_SECONDS, QUICK_BUDGET_SECONDS = 120.0, 20.0
# The sweep of a pair stops once the GPU led at this many consecutive sizes.
CONFIRM_WINS = 2

Clock = Callable[[], float]
Progress = Callable[[int, int, str], None]       # (done, total, what is being measured)


# ---- workloads ------------------------------------------------------------------------

Inputs = list[np.ndarray | None]
Builder = Callable[[int, DType, "np.random.Generator"], tuple[Inputs, dict[str, Any], str]]


@dataclass(frozen=True)
class Workload:
    """The op timed for one group, and how to build its inputs for a target input size.

    ``build(target_bytes, dtype, rng) -> (inputs, attrs, shapes)``; the inputs
    come as close to ``target_bytes`` as the op's shapes allow. ``exponent``
    says how its time grows with the input size (matmul: ``n³`` work on
    ``n²`` data, so 1.5); the sweep uses it to stay inside its time budget.
    """

    op: Op
    build: Builder
    exponent: float = 1.0


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    if dtype is DType.BOOL:
        return rng.random(shape) < 0.5
    if dtype.is_int:
        return rng.integers(0, 8, size=shape, dtype=dtype.numpy)
    wide = np.float64 if dtype is DType.FLOAT64 else np.float32
    return rng.standard_normal(shape, dtype=wide).astype(dtype.numpy, copy=False)


def _elementwise(target: int, dt: DType, rng: np.random.Generator,
                 ) -> tuple[Inputs, dict[str, Any], str]:
    n = max(1, target // (2 * dt.itemsize))
    return [_random(rng, (n,), dt), _random(rng, (n,), dt)], {}, f"{n} + {n}"


def _reduction(target: int, dt: DType, rng: np.random.Generator,
               ) -> tuple[Inputs, dict[str, Any], str]:
    cols = 256                    # a row reduction, as in means and softmax denominators
    rows = max(1, round(target / (cols * dt.itemsize)))
    return [_random(rng, (rows, cols), dt)], {"axes": (1,), "keepdims": False}, \
        f"{rows}x{cols}, over axis 1"


def _matmul(target: int, dt: DType, rng: np.random.Generator,
            ) -> tuple[Inputs, dict[str, Any], str]:
    m = max(1, round(math.sqrt(target / (2 * dt.itemsize))))
    return [_random(rng, (m, m), dt), _random(rng, (m, m), dt)], {}, f"{m}x{m} @ {m}x{m}"


def _conv(target: int, dt: DType, rng: np.random.Generator,
          ) -> tuple[Inputs, dict[str, Any], str]:
    c = 16                        # 16 → 16 channels, 3x3, same padding
    weight = c * c * 9
    hw = max(4, round(math.sqrt(max(target / dt.itemsize - weight, 0) / c)))
    inputs: Inputs = [_random(rng, (1, c, hw, hw), dt), _random(rng, (c, c, 3, 3), dt)]
    return inputs, {"kernel_shape": (3, 3), "pads": (1, 1, 1, 1)}, \
        f"1x{c}x{hw}x{hw} * {c}x{c}x3x3"


def _layer_norm(target: int, dt: DType, rng: np.random.Generator,
                ) -> tuple[Inputs, dict[str, Any], str]:
    d = 256
    rows = max(1, round(target / (d * dt.itemsize)) - 2)
    inputs: Inputs = [_random(rng, (rows, d), dt), _random(rng, (d,), dt), _random(rng, (d,), dt)]
    return inputs, {}, f"{rows}x{d}, scale {d}, bias {d}"


def _max_pool(target: int, dt: DType, rng: np.random.Generator,
              ) -> tuple[Inputs, dict[str, Any], str]:
    c = 16
    hw = max(2, 2 * round(math.sqrt(target / (c * dt.itemsize)) / 2))
    return [_random(rng, (1, c, hw, hw), dt)], {"kernel_shape": (2, 2), "strides": (2, 2)}, \
        f"1x{c}x{hw}x{hw}, 2x2 window"


# One representative op per group; a group selection meets that is not here keeps
# the static rule.
WORKLOADS: Mapping[OpGroup, Workload] = {
    OpGroup.ELEMENTWISE: Workload(Op.ADD, _elementwise),
    OpGroup.REDUCTION: Workload(Op.SUM, _reduction),
    OpGroup.MATMUL_LIKE: Workload(Op.MATMUL, _matmul, exponent=1.5),
    OpGroup.CONVOLUTION: Workload(Op.CONV, _conv),
    OpGroup.NORMALIZATION: Workload(Op.LAYER_NORM, _layer_norm),
    OpGroup.POOLING: Workload(Op.MAX_POOL, _max_pool),
}
DEFAULT_GROUPS = tuple(group_name(g) for g in WORKLOADS)


# ---- timing ---------------------------------------------------------------------------

def _time_point(cpu: Backend, gpu: Backend, op: Op, inputs: Inputs, attrs: Mapping[str, Any],
                clock: Clock, repeats: int) -> tuple[float, float, float]:
    """Median seconds on the CPU, on the GPU with copies, on the GPU with resident data."""
    def on_cpu() -> None:
        cpu.run(op, inputs, None, attrs)
        cpu.synchronize()

    def on_gpu_with_copies() -> None:
        device_inputs = [gpu.to_device(x) for x in inputs]
        for result in gpu.run(op, device_inputs, None, attrs):
            gpu.read(result)
        gpu.synchronize()

    resident = [gpu.to_device(x) for x in inputs]

    def on_gpu_resident() -> None:
        gpu.run(op, resident, None, attrs)
        gpu.synchronize()

    runs = (on_cpu, on_gpu_with_copies, on_gpu_resident)
    for run in runs:              # untimed: kernel compilation, memory pools, caches
        run()
    samples: tuple[list[float], ...] = ([], [], [])
    for _ in range(repeats):      # interleaved, so drift hits every variant alike
        for run, times in zip(runs, samples, strict=True):
            gpu.synchronize()     # nothing queued earlier is counted
            start = clock()
            run()
            times.append(clock() - start)
    import statistics

    cpu_s, gpu_s, resident_s = (statistics.median(t) for t in samples)
    return cpu_s, gpu_s, resident_s


@dataclass(frozen=True)
class _Job:
    group: OpGroup
    dtype: DType
    workload: Workload
    cpu: Backend
    gpu: Backend

    @property
    def label(self) -> str:
        return f"{group_name(self.group)} {self.dtype.value}"


@dataclass(frozen=True)
class _Sweep:
    points: tuple[Measurement, ...]
    complete: bool                # measured up to the top of the range, or the GPU led
    note: str | None


@dataclass
class _Settings:
    sizes: tuple[int, ...]
    repeats: int
    clock: Clock
    seed: int
    memory: int | None            # bytes one point may need on host and device, if known
    tick: Callable[[str], None]


def _sweep(job: _Job, cfg: _Settings, share: float) -> _Sweep:
    """Measure ``job`` at growing sizes until done, the GPU led, or the share runs out."""
    start, wins = cfg.clock(), 0
    points: list[Measurement] = []
    for i, size in enumerate(cfg.sizes):
        stop = _why_stop(job, cfg, points, size, share - (cfg.clock() - start))
        if stop is not None:
            return _Sweep(tuple(points), False, stop)
        inputs, attrs, shapes = job.workload.build(size, job.dtype, np.random.default_rng(cfg.seed))
        try:
            times = _time_point(job.cpu, job.gpu, job.workload.op, inputs, attrs, cfg.clock,
                                cfg.repeats)
        except (KeelError, MemoryError) as exc:
            return _Sweep(tuple(points), False, f"stopped at {format_size(size)}: "
                                                f"{type(exc).__name__}: {exc}")
        arrays = [x for x in inputs if x is not None]
        points.append(Measurement(job.group, job.dtype, job.workload.op, shapes,
                                  sum(int(x.size) for x in arrays),
                                  sum(int(x.nbytes) for x in arrays), *times, cfg.repeats))
        cfg.tick(f"{job.label} {format_size(points[-1].nbytes)}")
        wins = wins + 1 if points[-1].gpu_wins else 0
        if wins >= CONFIRM_WINS and i + 1 < len(cfg.sizes):
            return _Sweep(tuple(points), True, f"the GPU led at {CONFIRM_WINS} consecutive "
                                               "sizes; larger sizes were not measured")
    return _Sweep(tuple(points), True, None)


def _why_stop(job: _Job, cfg: _Settings, points: Sequence[Measurement], size: int,
              left: float) -> str | None:
    if cfg.memory is not None and 4 * size > cfg.memory:
        return (f"stopped before {format_size(size)}: a point needs about "
                f"{format_size(4 * size)}, {format_size(cfg.memory)} is free")
    if not points:
        return None               # the smallest size is always measured
    last = points[-1]
    per_run = last.cpu_seconds + last.gpu_seconds + last.gpu_resident_seconds
    growth = (size / max(last.nbytes, 1)) ** job.workload.exponent
    predicted = per_run * growth * (cfg.repeats + 1)
    if predicted > left:
        return (f"stopped before {format_size(size)}: about {format_seconds(predicted)} more "
                f"would exceed its share of the time budget ({format_seconds(max(left, 0))} "
                "left)")
    return None


# ---- calibrate -------------------------------------------------------------------------

def calibrate(
    registry: BackendRegistry | None = None,
    groups: Iterable[OpGroup | str] = DEFAULT_GROUPS,
    dtypes: Iterable[DType | str] = ("float32",),
    sizes: Sequence[int] | None = None,
    *,
    quick: bool = False,
    budget_seconds: float | None = None,
    repeats: int | None = None,
    profile: HardwareProfile | None = None,
    clock: Clock = time.perf_counter,
    progress: Progress | None = None,
    seed: int = 0,
    gpu: str | None = None,
) -> Calibration:
    """Measure this machine's CPU/GPU crossover per op group and dtype.

    ``gpu`` names the GPU backend to time (``"webgpu"``); default: the first
    available GPU backend of the priority chain.

    ``sizes`` are target input sizes in bytes (default ``DEFAULT_SIZES``, or
    ``QUICK_SIZES`` with ``quick``); ``budget_seconds`` bounds the whole sweep
    (default 120 s, 20 s with ``quick``), shared fairly among the pairs;
    ``repeats`` timed runs per point give the medians (default 5, 3 with
    ``quick``). ``clock`` and ``profile`` are injectable so tests can give
    fake backends a deterministic cost. ``progress(done, total, label)`` is
    called after each point.
    """
    reg = registry if registry is not None else default_registry()
    pairs = [(g, d) for g in _checked_groups(groups) for d in _checked_dtypes(dtypes)]
    grid = _checked_sizes(sizes if sizes is not None else QUICK_SIZES if quick else DEFAULT_SIZES)
    budget = _positive(budget_seconds, QUICK_BUDGET_SECONDS if quick else DEFAULT_BUDGET_SECONDS,
                       "budget_seconds")
    reps = int(_positive(repeats, QUICK_REPEATS if quick else DEFAULT_REPEATS, "repeats"))
    prof = profile if profile is not None else _probe()
    created = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    base: dict[str, Any] = {"source": f"measured {created}", "created": created,
                            "fingerprint": hardware_fingerprint(prof)}
    cpus, gpus, why_no_gpu = _device_backends(reg)
    if gpu is not None:
        gpus, why_no_gpu = _named_gpu(reg, gpu)
    if not gpus:
        return Calibration(no_gpu=why_no_gpu, notes=(f"no GPU: {why_no_gpu}",), **base)
    counter = _Counter(len(pairs) * len(grid), progress)
    cfg = _Settings(grid, reps, clock, seed, _free_memory(prof, gpus[0]), counter.tick)
    table, points, notes, used = _run_pairs(pairs, cpus, gpus, cfg, budget, counter)
    return Calibration(table, measurements=points, notes=notes, devices=used, **base)


def _run_pairs(pairs: Sequence[tuple[OpGroup, DType]], cpus: Sequence[Backend],
               gpus: Sequence[Backend], cfg: _Settings, budget: float, counter: _Counter,
               ) -> tuple[dict[Any, int | None], tuple[Measurement, ...], tuple[str, ...],
                          dict[str, str]]:
    table: dict[Any, int | None] = {}
    points: list[Measurement] = []
    notes: list[str] = []
    used: dict[str, str] = {}
    start = cfg.clock()
    for index, (group, dtype) in enumerate(pairs):
        job, why_not = _job(group, dtype, cpus, gpus)
        if job is None:
            notes.append(f"{group_name(group)} {dtype.value}: not calibrated: {why_not}")
            counter.skip(len(cfg.sizes), f"{group_name(group)} {dtype.value} skipped")
            continue
        used.setdefault("cpu", _describe(job.cpu))
        used.setdefault("gpu", _describe(job.gpu))
        share = (budget - (cfg.clock() - start)) / (len(pairs) - index)
        sweep = _sweep(job, cfg, share)
        counter.skip(len(cfg.sizes) - len(sweep.points), f"{job.label} done")
        points.extend(sweep.points)
        decided, crossover, note = _conclude(sweep)
        if decided:
            table[(group, dtype)] = crossover
        if note:
            notes.append(f"{job.label}: {note}")
    return table, tuple(points), tuple(notes), used


def _conclude(sweep: _Sweep) -> tuple[bool, int | None, str | None]:
    """Whether the sweep decides its pair, the crossover in bytes, and a note."""
    found = find_crossover(sweep.points)
    if found is not None:
        return True, found.nbytes, sweep.note
    if not sweep.points:
        return False, None, f"nothing measured ({sweep.note}); the static rule applies"
    if sweep.complete:
        return True, None, None
    top = format_size(sweep.points[-1].nbytes)
    return False, None, (f"inconclusive: the GPU was not ahead at {top} and larger sizes "
                         f"were not measured ({sweep.note}); the static rule applies")


def _job(group: OpGroup, dtype: DType, cpus: Sequence[Backend], gpus: Sequence[Backend],
         ) -> tuple[_Job | None, str]:
    workload = WORKLOADS[group]
    op = workload.op
    cpu = next((b for b in cpus if b.supports(op, dtype)), None)
    gpu = next((b for b in gpus if b.supports(op, dtype)), None)
    if cpu is None or gpu is None:
        which = ", ".join(b.name for b in (cpus if cpu is None else gpus)) or "none"
        kind = "CPU" if cpu is None else "GPU"
        return None, f"no {kind} backend ({which}) has a {op.value} kernel for {dtype.value}"
    return _Job(group, dtype, workload, cpu, gpu), ""


def _device_backends(reg: BackendRegistry) -> tuple[list[Backend], list[Backend], str]:
    """Available CPU and GPU backends of the priority chain, and why there is no GPU."""
    cpus: list[Backend] = []
    gpus: list[Backend] = []
    missing: list[str] = []
    for name in reg.priority:
        try:
            backend = reg.instance(name)
        except BackendSelectionError as exc:
            missing.append(f"{name}: {exc.reason}")
            continue
        avail = backend.availability()
        if not avail.available:
            if backend.device is DeviceKind.GPU:
                missing.append(f"{name}: {avail.reason}")
            continue
        (gpus if backend.device is DeviceKind.GPU else cpus).append(backend)
    why = "; ".join(missing) or \
        f"no GPU backend in the priority chain ({', '.join(reg.priority) or 'empty'})"
    return cpus, gpus, why


def _named_gpu(reg: BackendRegistry, name: str) -> tuple[list[Backend], str]:
    """The GPU backend called ``name`` when it is available, else why not."""
    backend = reg.instance(name)           # BackendSelectionError for an unknown name
    if backend.device is not DeviceKind.GPU:
        raise InvalidArgumentError(f"backend {name!r} runs on the {backend.device.value}, "
                                   "not a GPU: nothing to calibrate against the CPU")
    avail = backend.availability()
    return ([backend], "") if avail.available else ([], f"{name}: {avail.reason}")


def _describe(backend: Backend) -> str:
    return f"{backend.name}: {backend.availability().reason}"


def _free_memory(profile: HardwareProfile, gpu: Backend) -> int | None:
    """The smaller of free host memory and free memory of the GPU timed, where known."""
    index = getattr(gpu, "device_index", 0)
    readings = [profile.memory.effective_available_bytes,
                *(g.free_memory_bytes for g in profile.gpus if g.index == index)]
    known = [r for r in readings if r is not None]
    return min(known) if known else None


class _Counter:
    def __init__(self, total: int, progress: Progress | None) -> None:
        self.done, self.total, self.progress = 0, total, progress

    def tick(self, label: str) -> None:
        self.skip(1, label)

    def skip(self, count: int, label: str) -> None:
        self.done += count
        if self.progress is not None and count:
            self.progress(self.done, self.total, label)


def _checked_groups(groups: Iterable[OpGroup | str]) -> list[OpGroup]:
    if isinstance(groups, (str, OpGroup)):
        groups = [groups]
    chosen = list(dict.fromkeys(parse_group(g) for g in groups))
    unknown = [g for g in chosen if g not in WORKLOADS]
    if unknown or not chosen:
        raise InvalidArgumentError(
            f"cannot calibrate op group(s) {[group_name(g) for g in unknown]}; "
            f"allowed: {', '.join(DEFAULT_GROUPS)}")
    return chosen


def _checked_dtypes(dtypes: Iterable[DType | str]) -> list[DType]:
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    chosen = list(dict.fromkeys(as_dtype(d) for d in dtypes))
    if not chosen or DType.STRING in chosen:
        raise InvalidArgumentError(
            f"dtypes must name at least one numeric dtype, got {[d.value for d in chosen]}")
    return chosen


def _checked_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s <= 0]
    if bad or not sizes:
        raise InvalidArgumentError(
            f"sizes must be positive ints of bytes, got {list(sizes)!r}")
    return tuple(sorted(set(sizes)))


def _positive(value: float | None, default: float, name: str) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(f"{name} must be a positive number, got {value!r}")
    return float(value)
