"""The calibration record, its file and the machine's fingerprint, without the sweep.

A :class:`Calibration` holds the crossovers and :class:`Measurement` points that
:func:`keel.planning.calibration.calibrate` measured; :func:`save` and
:func:`load` write and read it as versioned JSON tied to
:func:`hardware_fingerprint`; :func:`calibration_status` finds the one selection
consults by default. :mod:`keel.planning.calibration` re-exports every name:
this module is what the compiled-plan cache's key needs (the machine and the
calibration in use) without the workloads and timing of a calibration run.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel import config
from keel._files import write_atomically
from keel._fork import renew_after_fork
from keel.config import Settings, cache_dir
from keel.dtypes import DType, as_dtype
from keel.errors import InvalidArgumentError, KeelError
from keel.hardware.fingerprint import fingerprint_id, hardware_fingerprint, machine_fingerprint
from keel.hardware.profile import HardwareProfile
from keel.ops.registry import Op, OpGroup

__all__ = [
    "CALIBRATION_VERSION",
    "Calibration",
    "CalibrationStatus",
    "Measurement",
    "cache_dir",
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
    "machine_fingerprint",
    "parse_group",
    "reset_default_calibration",
    "save",
]

CALIBRATION_VERSION = 1
FILE_FORMAT = "keel-calibration"
_OFF = ("off", "none", "0", "false", "no")

KeyLike = OpGroup | str | tuple[OpGroup | str, DType | str | None]
CalibrationKey = tuple[OpGroup, DType | None]

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


# ---- the machine and the cache ----------------------------------------------------------

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

                logging.getLogger("keel.planning.calibration").warning(  # its documented name
                    "keel calibration %s", status.reason)
        return status


def default_calibration() -> Calibration | None:
    """The calibration selection consults when it is given none (``None``: static rules)."""
    return calibration_status().calibration


def reset_default_calibration() -> None:
    """Forget the looked-up calibration (after a new one was saved, or in tests)."""
    with _DEFAULT_LOCK:
        _DEFAULT.clear()
