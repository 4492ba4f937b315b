"""Calibration: run float samples through a graph and record activation ranges.

Samples are arrays keyed by graph input name. For an input declared with
shape ``(d0, d1, ...)`` an array is either

* of the same rank, samples stacked along axis 0 (the batch axis): with
  ``d0`` symbolic they are fed ``batch_size`` at a time; with ``d0`` fixed at
  ``k`` the count must be a multiple of ``k`` and they are fed ``k`` at a time;
* or one rank higher: a stack of whole feeds, merged into the form above.

The other static dimensions must match. Inputs that have a default
(an initializer) need no samples; names that are not inputs are ignored, so
an ``.npz`` may also hold labels.

The graph runs through keel's executor, placed and compiled as a loaded model
is (one program per batch shape, see ``keel.execution.evaluate``). Each wanted
value is observed the moment the program makes it, so memory stays at one
batch's planned arena. Two observers:

* ``minmax``: the smallest and largest finite value seen;
* ``percentile``: the ``100 - p``-th and ``p``-th percentiles of a bounded,
  evenly strided subsample of the values (rare outliers do not stretch the
  range, so common values keep more resolution).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, KeelError
from keel.graph.ir import Graph, Value
from keel.graph.shape_inference import Evaluator, default_evaluator

__all__ = ["METHODS", "CalibrationSet", "Progress", "check_samples", "collect_ranges",
           "load_calibration"]

METHODS = ("minmax", "percentile")
Progress = Callable[[int, int], None]     # (samples done, samples in all)

_PER_BATCH = 1 << 16    # values a percentile observer keeps from one batch
_KEEP = 1 << 21         # and in all, per tensor (halved by striding when exceeded)


@dataclass(frozen=True)
class CalibrationSet:
    """Checked samples: per input, an array batched along axis 0; ``count`` rows each."""

    arrays: dict[str, np.ndarray]
    count: int
    step: int | None        # fixed rows per feed (a fixed batch dimension), else None

    def batches(self, batch_size: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(rows done after this batch, feeds) over all samples, in order."""
        step = self.step or batch_size
        for start in range(0, self.count, step):
            stop = min(start + step, self.count)
            yield stop, {k: a[start:stop] for k, a in self.arrays.items()}


# ---- samples -------------------------------------------------------------------------------
def load_calibration(path: str | os.PathLike[str], graph: Graph) -> CalibrationSet:
    """Read an ``.npz`` of samples keyed by input name and check it against ``graph``."""
    arrays = _read_npz(path)
    return check_samples(graph, arrays, source=f"calibration file {os.fspath(path)!r}")


def _read_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    what = f"calibration file {os.fspath(path)!r}"
    try:
        loaded: Any = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise InvalidArgumentError(f"{what} does not exist") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InvalidArgumentError(
            f"cannot read {what}: {exc}; expected an .npz of arrays keyed by input name"
        ) from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InvalidArgumentError(
            f"{what} holds a single array; expected an .npz of arrays keyed by input name "
            "(numpy.savez(path, input_name=array, ...))")
    try:
        with loaded as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InvalidArgumentError(f"cannot read {what}: {exc}") from None


def check_samples(graph: Graph, samples: Mapping[str, Any],
                  source: str = "calibration data") -> CalibrationSet:
    """Check ``samples`` against the graph's inputs (see the module docstring)."""
    needed = [v for v in graph.inputs if v.name not in graph.initializers]
    arrays: dict[str, np.ndarray] = {}
    steps: dict[str, int] = {}
    for value in needed:
        if value.name not in samples:
            have = ", ".join(sorted(samples)) or "none"
            raise InvalidArgumentError(
                f"{source} has no samples for input {value.name!r} (it has: {have}); every "
                f"model input needs them: {', '.join(v.name for v in needed)}")
        arrays[value.name], step = _check_array(value, samples[value.name], source)
        if step is not None:
            steps[value.name] = step
    return CalibrationSet(arrays, _common_count(arrays, source), _common_step(steps, source))


def _check_array(value: Value, raw: Any, source: str) -> tuple[np.ndarray, int | None]:
    name, declared = value.name, value.type
    arr = _cast(name, np.asarray(raw), declared.dtype, source)
    shape = declared.shape
    if shape is None:
        if arr.ndim == 0 or arr.shape[0] == 0:
            raise InvalidArgumentError(
                f"{source}: input {name!r} needs samples stacked along axis 0, got shape "
                f"{tuple(arr.shape)}")
        return arr, None
    rank = len(shape)
    if arr.ndim == rank + 1 and rank > 0:
        arr = arr.reshape(arr.shape[0] * arr.shape[1], *arr.shape[2:])
    if arr.ndim != rank or rank == 0:
        raise InvalidArgumentError(
            f"{source}: input {name!r} is declared {_fmt(shape)} (rank {rank}); its samples "
            f"must have rank {rank} (stacked along the batch axis) or {rank + 1} (a stack of "
            f"feeds), got shape {tuple(arr.shape)}")
    for axis, (want, got) in enumerate(zip(shape[1:], arr.shape[1:], strict=True), start=1):
        if isinstance(want, int) and want != got:
            raise InvalidArgumentError(
                f"{source}: input {name!r} is declared {_fmt(shape)}; its samples have shape "
                f"{tuple(arr.shape)} (dimension {axis} must be {want})")
    if arr.shape[0] == 0:
        raise InvalidArgumentError(f"{source}: input {name!r} has no samples (shape "
                                   f"{tuple(arr.shape)})")
    fixed = shape[0] if isinstance(shape[0], int) else None
    if fixed is not None and (fixed == 0 or arr.shape[0] % fixed):
        raise InvalidArgumentError(
            f"{source}: input {name!r} has a fixed batch of {fixed}; its {arr.shape[0]} "
            f"samples are not a multiple of it")
    return arr, fixed


def _cast(name: str, arr: np.ndarray, dtype: DType, source: str) -> np.ndarray:
    kind = arr.dtype.kind
    ok = kind in "fiub" if dtype.is_float else (kind in "iub" and dtype.numpy.kind in "iub")
    if not ok:
        raise InvalidArgumentError(
            f"{source}: input {name!r} takes {dtype.value}; its samples are {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype.numpy)


def _common_count(arrays: Mapping[str, np.ndarray], source: str) -> int:
    counts = {name: int(a.shape[0]) if a.ndim else 1 for name, a in arrays.items()}
    first = next(iter(counts.values()), 0)
    for name, count in counts.items():
        if count != first:
            raise InvalidArgumentError(
                f"{source}: input {name!r} has {count} samples but "
                f"{next(iter(counts))!r} has {first}; every input needs the same count")
    if first == 0:
        raise InvalidArgumentError(f"{source}: the model has no inputs to feed samples to")
    return first


def _common_step(steps: Mapping[str, int], source: str) -> int | None:
    if len(set(steps.values())) > 1:
        raise InvalidArgumentError(
            f"{source}: inputs have different fixed batch sizes {dict(steps)}; calibration "
            "feeds them together and needs one")
    return next(iter(steps.values()), None)


def _fmt(shape: Sequence[Any]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


# ---- observers -------------------------------------------------------------------------------
class _Observer:
    """The range of one tensor over every batch."""

    def __init__(self, method: str, percentile: float) -> None:
        self.method, self.percentile = method, percentile
        self.lo, self.hi = np.inf, -np.inf
        self.kept: list[np.ndarray] = []
        self.kept_size = 0

    def update(self, value: np.ndarray) -> None:
        flat = value.reshape(-1)
        if flat.size and not np.isfinite(flat).all():
            flat = flat[np.isfinite(flat)]
        if flat.size == 0:
            return
        self.lo, self.hi = min(self.lo, float(flat.min())), max(self.hi, float(flat.max()))
        if self.method == "percentile":
            self._keep(flat[:: max(1, flat.size // _PER_BATCH)].astype(np.float32))

    def _keep(self, values: np.ndarray) -> None:
        self.kept.append(values)
        self.kept_size += values.size
        if self.kept_size > _KEEP:
            self.kept = [np.concatenate(self.kept)[::2]]
            self.kept_size = self.kept[0].size

    def range(self) -> tuple[float, float]:
        if self.lo > self.hi:               # nothing finite was seen
            return 0.0, 0.0
        if self.method == "minmax" or not self.kept:
            return self.lo, self.hi
        values = np.concatenate(self.kept)
        lo, hi = np.percentile(values, [100.0 - self.percentile, self.percentile])
        return float(lo), float(hi)


def collect_ranges(graph: Graph, data: CalibrationSet, tensors: Sequence[str],
                   method: str = "minmax", percentile: float = 99.99, batch_size: int = 32,
                   progress: Progress | None = None,
                   evaluator: Evaluator | None = None) -> dict[str, tuple[float, float]]:
    """The (low, high) range of each of ``tensors`` over every sample of ``data``.

    Each batch runs through ``evaluator`` (default: the executor, placed as a
    loaded model is); every wanted value is observed as the run makes it.
    """
    observers = {t: _Observer(method, percentile) for t in tensors}
    run = (evaluator or default_evaluator("auto"))(graph)
    watch = {t: o.update for t, o in observers.items()}
    for done, feeds in data.batches(batch_size):
        try:
            run(feeds, watch)
        except KeelError as exc:
            if hasattr(exc, "add_note"):
                exc.add_note("while running calibration samples through the float graph")
            raise
        if progress is not None:
            progress(done, data.count)
    return {t: o.range() for t, o in observers.items()}
