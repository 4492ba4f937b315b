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

import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from keel import config
from keel._files import write_atomically
from keel._fork import renew_after_fork
from keel._hashing import sha256
from keel.backends.base import Backend, DeviceKind
from keel.backends.registry import BackendRegistry, default_registry
from keel.config import Settings, cache_dir
from keel.dtypes import DType, as_dtype
from keel.errors import BackendSelectionError, InvalidArgumentError, KeelError
from keel.hardware.profile import HardwareProfile
from keel.ops.registry import Op, OpGroup

__all__ = [
    "CALIBRATION_VERSION",
    "CONFIRM_WINS",
    "DEFAULT_GROUPS",
    "DEFAULT_SIZES",
    "QUICK_SIZES",
    "WORKLOADS",
    "Calibration",
    "CalibrationStatus",
    "Measurement",
    "Workload",
    "cache_dir",
    "calibrate",
    "calibration_path",
    "calibration_status",
    "default_calibration",
    "find_calibration",
    "find_crossover",
    "fingerprint_id",
    "format_seconds",
    "format_size",
    "group_name",
    "hardware_fingerprint",
    "load",
    "parse_group",
    "reset_default_calibration",
    "save",
]


CALIBRATION_VERSION = 1
FILE_FORMAT = "keel-calibration"
# 10 kB to 100 MB of input in steps of √10, so the seed-004 thresholds
# (1, 10 and 100 MB) are points of the sweep.
DEFAULT_SIZES = tuple(round(10 ** (4 + k / 2)) for k in range(9))
QUICK_SIZES = tuple(10**k for k in range(4, 8))            # 10 kB .. 10 MB
DEFAULT_REPEATS, QUICK_REPEATS = 5, 3
DEFAULT_BUDGET_SECONDS, QUICK_BUDGET_SECONDS = 120.0, 20.0
# The sweep of a pair stops once the GPU led at this many consecutive sizes.
CONFIRM_WINS = 2
_OFF = ("off", "none", "0", "false", "no")

KeyLike = OpGroup | str | tuple[OpGroup | str, DType | str | None]
CalibrationKey = tuple[OpGroup, DType | None]
Clock = Callable[[], float]
Progress = Callable[[int, int, str], None]       # (done, total, what is being measured)


# ---- formatting and keys --------------------------------------------------------

def format_size(n: int) -> str:
    """Decimal units, like seed 004's thresholds (``4.2 MB``)."""
    for unit, scale in (("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_seconds(seconds: float) -> str:
    """A duration with three significant digits (``210 µs``, ``1.9 ms``, ``2.5 s``)."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def group_name(group: OpGroup) -> str:
    """The lower-case name of an op group (``matmul_like``)."""
    return group.name.lower()


def parse_group(key: OpGroup | str) -> OpGroup:
    """An ``OpGroup`` from itself or its name (``matmul_like``, ``matmul-like``)."""
    if isinstance(key, OpGroup):
        return key
    try:
        return OpGroup[str(key).strip().upper().replace("-", "_")]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown op group {key!r}; allowed: "
            f"{', '.join(group_name(g) for g in OpGroup)}") from None


def _parse_key(key: KeyLike) -> CalibrationKey:
    """``"elementwise"`` (every dtype), ``"elementwise/float32"`` or a (group, dtype) pair."""
    if isinstance(key, tuple):
        group, dtype = key
        return parse_group(group), None if dtype is None else as_dtype(dtype)
    if isinstance(key, OpGroup):
        return key, None
    name, sep, dtype_name = str(key).partition("/")
    return parse_group(name), as_dtype(dtype_name.strip()) if sep else None


def _key_name(key: CalibrationKey) -> str:
    group, dtype = key
    return group_name(group) if dtype is None else f"{group_name(group)}/{dtype.value}"


# ---- the record ---------------------------------------------------------------------

@dataclass(frozen=True)
class Measurement:
    """One point of a sweep; times are medians, in seconds."""

    group: OpGroup
    dtype: DType
    op: Op
    shapes: str                      # the inputs, e.g. "724x724 @ 724x724"
    elements: int                    # elements of the inputs
    nbytes: int                      # bytes of the inputs
    cpu_seconds: float
    gpu_seconds: float               # host data: copies in and out included
    gpu_resident_seconds: float      # data already on the device
    repeats: int

    @property
    def gpu_wins(self) -> bool:
        """Whether the GPU, copies included, beat the CPU here."""
        return self.gpu_seconds < self.cpu_seconds

    def describe(self) -> str:
        """``at 4.2 MB float32 matmul, gpu 210 µs incl. copies vs cpu 1.9 ms``."""
        return (f"at {format_size(self.nbytes)} {self.dtype.value} {self.op.value}, "
                f"gpu {format_seconds(self.gpu_seconds)} incl. copies vs cpu "
                f"{format_seconds(self.cpu_seconds)}")

    def to_dict(self) -> dict[str, Any]:
        return {"group": group_name(self.group), "dtype": self.dtype.value, "op": self.op.value,
                "shapes": self.shapes, "elements": self.elements, "nbytes": self.nbytes,
                "cpu_seconds": self.cpu_seconds, "gpu_seconds": self.gpu_seconds,
                "gpu_resident_seconds": self.gpu_resident_seconds, "repeats": self.repeats}

    @classmethod
    def from_dict(cls, data: Any) -> Measurement:
        if not isinstance(data, Mapping):
            raise InvalidArgumentError(f"a measurement must be a mapping, got {data!r}")
        try:
            return cls(parse_group(data["group"]), as_dtype(data["dtype"]), Op(data["op"]),
                       str(data["shapes"]), _count(data, "elements"), _count(data, "nbytes"),
                       _seconds(data, "cpu_seconds"), _seconds(data, "gpu_seconds"),
                       _seconds(data, "gpu_resident_seconds"), _count(data, "repeats"))
        except KeyError as exc:
            raise InvalidArgumentError(f"a measurement lacks {exc}: {dict(data)!r}") from None
        except ValueError as exc:    # Op(...) of an unknown name
            raise InvalidArgumentError(f"bad measurement {dict(data)!r}: {exc}") from None


def _count(data: Mapping[str, Any], name: str) -> int:
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _seconds(data: Mapping[str, Any], name: str) -> float:
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidArgumentError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Calibration:
    """Measured GPU-versus-CPU crossover sizes, per op group and dtype.

    ``crossover_bytes`` maps a key to the input size in bytes from which the
    GPU, transfers included, beat the CPU, or to ``None`` when it never did
    in the measured range. A key is ``"matmul_like/float32"`` (one dtype), a
    bare group such as ``"elementwise"`` or an ``OpGroup`` (every dtype), or
    a ``(group, dtype)`` pair. Selection consults a calibration first; pairs
    it does not cover keep the static thresholds. ``measurements`` are the
    points behind the numbers, which selection quotes in its reasons;
    ``no_gpu`` says why nothing could be measured; ``fingerprint`` ties a
    measured calibration to the machine (:func:`hardware_fingerprint`).
    """

    crossover_bytes: Mapping[Any, int | None] = field(default_factory=dict)
    source: str = "measured"
    measurements: tuple[Measurement, ...] = ()
    notes: tuple[str, ...] = ()
    no_gpu: str | None = None
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    devices: Mapping[str, str] = field(default_factory=dict)   # device kind -> what ran
    created: str | None = None

    def __post_init__(self) -> None:
        table: dict[CalibrationKey, int | None] = {}
        for raw, value in dict(self.crossover_bytes).items():
            key = _parse_key(raw)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise InvalidArgumentError(
                    f"crossover for {_key_name(key)} must be a non-negative int of bytes "
                    f"or None, got {value!r}")
            table[key] = value
        object.__setattr__(self, "crossover_bytes", table)
        object.__setattr__(self, "measurements", tuple(self.measurements))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "fingerprint", dict(self.fingerprint))
        object.__setattr__(self, "devices", dict(self.devices))

    @property
    def has_gpu(self) -> bool:
        """Whether a GPU backend was there to measure."""
        return self.no_gpu is None

    def lookup(self, group: OpGroup | str, dtype: DType | str | None = None,
               ) -> tuple[CalibrationKey, int | None] | None:
        """The entry for ``group`` on ``dtype`` (exact dtype first, then group-wide)."""
        table: Mapping[CalibrationKey, int | None] = self.crossover_bytes
        group = parse_group(group)
        keys = [(group, None)] if dtype is None else [(group, as_dtype(dtype)), (group, None)]
        for key in keys:
            if key in table:
                return key, table[key]
        return None

    def covers(self, group: OpGroup | str, dtype: DType | str | None = None) -> bool:
        """Whether this calibration decides ``group`` (on ``dtype``; any dtype when None)."""
        if dtype is None:
            return any(g is parse_group(group) for g, _ in self.crossover_bytes)
        return self.lookup(group, dtype) is not None

    def crossover(self, group: OpGroup | str, dtype: DType | str | None = None) -> int | None:
        entry = self.lookup(group, dtype)
        return None if entry is None else entry[1]

    def measured(self, group: OpGroup | str, dtype: DType | str) -> tuple[Measurement, ...]:
        """The points measured for ``group`` on ``dtype``, smallest first."""
        dt, grp = as_dtype(dtype), parse_group(group)
        points = [m for m in self.measurements if m.group is grp and m.dtype is dt]
        return tuple(sorted(points, key=lambda m: m.nbytes))

    def evidence(self, group: OpGroup | str, dtype: DType | str) -> Measurement | None:
        """The measurement behind the entry: the crossover point, else the largest size."""
        points = self.measured(group, dtype)
        entry = self.lookup(group, dtype)
        if not points or entry is None:
            return None
        cross = entry[1]
        if cross is None:
            return points[-1]
        return next((m for m in points if m.nbytes == cross), None)

    def to_dict(self) -> dict[str, Any]:
        table: Mapping[CalibrationKey, int | None] = self.crossover_bytes
        return {"source": self.source, "created": self.created, "no_gpu": self.no_gpu,
                "fingerprint": dict(self.fingerprint), "devices": dict(self.devices),
                "crossover_bytes": {_key_name(k): v for k, v in table.items()},
                "measurements": [m.to_dict() for m in self.measurements],
                "notes": list(self.notes)}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        if not isinstance(data, Mapping) or not isinstance(data.get("crossover_bytes", {}),
                                                           Mapping):
            raise InvalidArgumentError(
                "a calibration must be a mapping with a 'crossover_bytes' mapping, "
                f"got {data!r}")
        lists = {name: data.get(name) or [] for name in ("measurements", "notes")}
        maps = {name: data.get(name) or {} for name in ("fingerprint", "devices")}
        if not all(isinstance(v, list) for v in lists.values()) or \
                not all(isinstance(v, Mapping) for v in maps.values()):
            raise InvalidArgumentError(
                "a calibration's measurements and notes must be lists, its fingerprint and "
                f"devices mappings; got {data!r}")
        no_gpu, created = data.get("no_gpu"), data.get("created")
        return cls(dict(data.get("crossover_bytes", {})), str(data.get("source", "measured")),
                   tuple(Measurement.from_dict(m) for m in lists["measurements"]),
                   tuple(str(n) for n in lists["notes"]),
                   None if no_gpu is None else str(no_gpu), maps["fingerprint"],
                   {str(k): str(v) for k, v in maps["devices"].items()},
                   None if created is None else str(created))


def find_crossover(points: Iterable[Measurement]) -> Measurement | None:
    """The smallest point from which the GPU beat the CPU at every larger point measured."""
    found = None
    for m in sorted(points, key=lambda p: p.nbytes, reverse=True):
        if not m.gpu_wins:
            break
        found = m
    return found


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


# ---- the machine and the cache ----------------------------------------------------------

def _probe() -> HardwareProfile:
    from keel.hardware import probe

    return probe()


def hardware_fingerprint(profile: HardwareProfile | None = None) -> dict[str, Any]:
    """What a calibration is valid for: CPU model and cores, GPU names, drivers, memory."""
    prof = profile if profile is not None else _probe()
    cpu = prof.cpu
    return {"cpu": cpu.brand, "architecture": cpu.architecture,
            "logical_cores": cpu.logical_cores, "usable_cores": cpu.usable_cores,
            "gpus": [{"name": g.name, "driver": g.driver, "memory_bytes": g.total_memory_bytes}
                     for g in prof.gpus]}


def machine_fingerprint() -> dict[str, Any]:
    """This machine's :func:`hardware_fingerprint`, probed once per process (a fresh copy
    each call): the plan cache's key and the tuning cache's file both need it."""
    return json.loads(_machine_json())


@functools.lru_cache(maxsize=1)
def _machine_json() -> str:
    return json.dumps(hardware_fingerprint(), sort_keys=True)


def fingerprint_id(fingerprint: Mapping[str, Any]) -> str:
    """A short stable hash of a fingerprint (names the cache file)."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return sha256(text.encode()).hexdigest()[:16]


def calibration_path(fingerprint: Mapping[str, Any], directory: Path | None = None,
                     gpu: str = "") -> Path:
    """Where the calibration of the machine with ``fingerprint`` is cached (``gpu``: of
    a GPU backend other than the default chain's, such as ``webgpu``, in its own file)."""
    folder = cache_dir() if directory is None else directory
    suffix = f"-{gpu}" if gpu else ""
    return folder / f"calibration-{fingerprint_id(fingerprint)}{suffix}.json"


def save(calibration: Calibration, path: str | os.PathLike[str] | None = None,
         gpu: str = "") -> Path:
    """Write ``calibration`` as versioned JSON, atomically; returns the path.

    Without ``path`` it goes to the cache, under its machine's fingerprint (and the
    ``gpu`` backend's name, for one calibrated with ``calibrate(gpu=...)``).
    """
    if path is None:
        if not calibration.fingerprint:
            raise InvalidArgumentError(
                "a calibration without a hardware fingerprint cannot go to the cache; "
                "give a path")
        target = calibration_path(calibration.fingerprint, gpu=gpu)
    else:
        target = Path(path).expanduser()
    text = json.dumps({"format": FILE_FORMAT, "version": CALIBRATION_VERSION,
                       **calibration.to_dict()}, indent=2, ensure_ascii=False)
    try:
        write_atomically(target, text + "\n")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write calibration {str(target)!r}: {exc}") from None
    reset_default_calibration()
    return target


def load(path: str | os.PathLike[str],
         fingerprint: Mapping[str, Any] | None = None) -> Calibration:
    """Read a calibration file; with ``fingerprint``, reject one of another machine.

    Unreadable files, other formats or versions and, when ``fingerprint`` is
    given, a different machine raise ``InvalidArgumentError`` saying which. A
    file without a fingerprint (written by hand) is not tied to a machine.
    """
    where = str(path)
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read calibration {where!r}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"calibration {where!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise InvalidArgumentError(f"{where!r} is not a keel calibration file "
                                   f"(no \"format\": \"{FILE_FORMAT}\")")
    if data.get("version") != CALIBRATION_VERSION:
        raise InvalidArgumentError(
            f"calibration {where!r} has format version {data.get('version')!r}; this keel "
            f"reads version {CALIBRATION_VERSION}: run `keel calibrate` again")
    calibration = Calibration.from_dict(data)
    # A calibration written by hand carries no fingerprint: it claims no machine.
    if fingerprint is not None and calibration.fingerprint:
        diffs = _fingerprint_diff(calibration.fingerprint, fingerprint)
        if diffs:
            raise InvalidArgumentError(
                f"calibration {where!r} was measured on a different machine "
                f"({'; '.join(diffs)}): run `keel calibrate` here")
    return calibration


def _fingerprint_diff(stored: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(stored) | set(here))
    return [f"{k}: {stored.get(k)!r} in the file, {here.get(k)!r} here"
            for k in keys if stored.get(k) != here.get(k)]


@dataclass(frozen=True)
class CalibrationStatus:
    """The calibration selection uses by default (or ``None``), where from, and why."""

    calibration: Calibration | None
    path: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        cal = self.calibration
        return {"path": self.path, "reason": self.reason,
                "calibration": None if cal is None else cal.to_dict()}


def find_calibration(path: str | os.PathLike[str] | None = None, *,
                     profile: HardwareProfile | None = None,
                     settings: Settings | None = None, gpu: str = "") -> CalibrationStatus:
    """Look up the calibration for this machine: ``path``, ``KEEL_CALIBRATION``, the cache.

    ``settings`` (default: the process's) give ``KEEL_CALIBRATION`` and the
    cache directory. Never raises: a missing, stale or broken file is a
    reason, not an error.
    """
    values = config.settings() if settings is None else settings
    raw = str(path) if path is not None else (values.calibration or "")
    if raw.lower() in _OFF:
        return CalibrationStatus(None, None, f"KEEL_CALIBRATION={raw}: calibration is off; "
                                             "the static thresholds apply")
    folder = values.cache_dir
    if not raw:
        cached = sorted(folder.glob("calibration-*.json")) if folder.is_dir() else []
        if not cached:
            flag = f" --gpu {gpu}" if gpu else ""
            return CalibrationStatus(None, None, f"no calibration cached in {folder}; run "
                                                 f"`keel calibrate{flag}` to measure this "
                                                 "machine")
    fingerprint = hardware_fingerprint(profile)
    target = Path(raw).expanduser() if raw else calibration_path(fingerprint, folder, gpu)
    if not raw and not target.is_file():
        return CalibrationStatus(None, None, f"the {len(cached)} calibration(s) cached in "
                                             f"{folder} are for other machines; run "
                                             "`keel calibrate` here")
    try:
        calibration = load(target, fingerprint)
    except KeelError as exc:
        return CalibrationStatus(None, str(target), f"ignored: {exc.message}")
    return CalibrationStatus(calibration, str(target),
                             f"loaded {target} ({calibration.source})")


_DEFAULT: dict[tuple[str, str], CalibrationStatus] = {}
_DEFAULT_LOCK = threading.Lock()
renew_after_fork(sys.modules[__name__], "_DEFAULT_LOCK")   # free in a forked child


def calibration_status() -> CalibrationStatus:
    """:func:`find_calibration` for this process, looked up once per setting."""
    values = config.settings()
    key = (values.calibration or "", str(values.cache_dir))
    with _DEFAULT_LOCK:
        status = _DEFAULT.get(key)
        if status is None:
            status = _DEFAULT[key] = find_calibration(settings=values)
            if status.path is not None and status.calibration is None:
                import logging  # here: a load that finds its calibration logs nothing

                logging.getLogger(__name__).warning("keel calibration %s", status.reason)
        return status


def default_calibration() -> Calibration | None:
    """The calibration selection consults when it is given none (``None``: static rules)."""
    return calibration_status().calibration


def reset_default_calibration() -> None:
    """Forget the looked-up calibration (after a new one was saved, or in tests)."""
    with _DEFAULT_LOCK:
        _DEFAULT.clear()
