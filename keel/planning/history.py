"""Runtime history: a model's measured step times on this machine, kept between runs.

After a chunked or stream-split run, the model records how long each step
took per item, for its input signature and the chunk (or sub-batch) size it
ran. The next plan of the same model on the same machine reads it back: the
first chunk starts at the size that ran fastest per item, among those that
fit the budget, and the plan's reason log names the measurement.

One small JSON file, ``runtime-history.json`` under :func:`keel.config.cache_dir`,
holds every model's entry, keyed by the model's content hash and the hardware
fingerprint of :mod:`keel.planning.calibration` (another machine never reads
this one's times). It is written atomically; a file that cannot be read or
parsed is ignored and rebuilt, never trusted. It stays small: at most
:data:`MAX_MODELS` models, :data:`MAX_SIGNATURES` signatures per model and
:data:`MAX_SIZES` sizes per signature, the least recently updated going first.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from keel.config import cache_dir
from keel.graph.ir import Graph
from keel.planning.calibration_record import fingerprint_id, hardware_fingerprint

__all__ = [
    "FILE_NAME",
    "MAX_MODELS",
    "MAX_SIGNATURES",
    "MAX_SIZES",
    "RuntimeHistory",
    "StepRecord",
    "graph_digest",
    "history_path",
]

FILE_NAME = "runtime-history.json"
FORMAT = "keel-runtime-history"
VERSION = 1
MAX_MODELS = 32
MAX_SIGNATURES = 16
MAX_SIZES = 8
#: a size's average covers at most this many runs, so it follows the machine as it changes
AVERAGE_RUNS = 8


@dataclass(frozen=True)
class StepRecord:
    """Measured time of running ``size`` items at once, averaged over ``runs`` runs."""

    size: int
    seconds_per_item: float
    runs: int

    def describe(self) -> str:
        return (f"{self.size} items per step measured {self.seconds_per_item * 1e3:.3g} ms "
                f"per item ({self.runs} run{'s' if self.runs != 1 else ''})")


def history_path(directory: Path | None = None) -> Path:
    return (cache_dir() if directory is None else directory) / FILE_NAME


def graph_digest(graph: Graph) -> str:
    """A content hash of a graph: its nodes, attributes, inputs, outputs and weights."""
    digest = hashlib.sha256()
    for v in (*graph.inputs, *graph.outputs):
        digest.update(f"value {v.name} {v.type}\n".encode())
    for node in graph.nodes:
        digest.update(f"node {node.op} {list(node.inputs)} "
                      f"{list(node.outputs)}\n".encode())
        for key in sorted(node.attrs):
            digest.update(f"attr {key} ".encode())
            digest.update(_attr_bytes(node.attrs[key]))
    for name in sorted(graph.initializers):
        array = np.ascontiguousarray(graph.initializers[name])
        digest.update(f"weight {name} {array.dtype} {array.shape}\n".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:32]


def _attr_bytes(value: Any) -> bytes:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {value.shape} ".encode() + np.ascontiguousarray(value).tobytes()
    if isinstance(value, Graph):
        return graph_digest(value).encode()
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(_attr_bytes(v) for v in value) + b"]"
    return repr(value).encode()


class RuntimeHistory:
    """One model's measured step times on one machine, read from and written to ``path``."""

    def __init__(self, key: str, path: Path | None = None) -> None:
        self.key = key
        self.path = history_path() if path is None else path
        self.note: str | None = None      # why an existing file was ignored, if it was

    @classmethod
    def for_model(cls, graph: Graph, profile: Any = None,
                  path: Path | None = None) -> RuntimeHistory:
        """The history of ``graph`` on the machine ``profile`` describes (probed when None)."""
        fingerprint = _this_machine() if profile is None else hardware_fingerprint(profile)
        return cls(f"{graph_digest(graph)}-{fingerprint_id(fingerprint)}", path)

    # ---- reading ---------------------------------------------------------
    def records(self, signature: str) -> dict[int, StepRecord]:
        """Every size measured for ``signature``, by size."""
        sizes = self._entry(self._read()).get("signatures", {}).get(signature, {})
        found = {}
        for size, data in sizes.get("sizes", {}).items():
            record = _record(size, data)
            if record is not None:
                found[record.size] = record
        return found

    def fastest(self, signature: str, largest: int) -> StepRecord | None:
        """The measured size up to ``largest`` with the least time per item (ties: larger)."""
        fits = [r for r in self.records(signature).values() if r.size <= largest]
        return min(fits, key=lambda r: (r.seconds_per_item, -r.size), default=None)

    # ---- writing ---------------------------------------------------------
    def record(self, signature: str, measured: Mapping[int, tuple[float, int]],
               ) -> dict[int, StepRecord]:
        """Add measurements (size -> (seconds, items) run in steps of that size) for
        ``signature``, then write the file atomically; returns the updated records."""
        data = self._read()
        data["seq"] = seq = int(data.get("seq", 0)) + 1
        entries = data.setdefault("entries", {})
        entry = entries.setdefault(self.key, {"signatures": {}})
        entry["updated"] = seq
        sig = entry["signatures"].setdefault(signature, {"sizes": {}})
        sig["updated"] = seq
        updated = {}
        for size, (seconds, items) in sorted(measured.items()):
            record = _averaged(_record(str(size), sig["sizes"].get(str(size))), size,
                               seconds / max(items, 1))
            sig["sizes"][str(size)] = {"seconds_per_item": record.seconds_per_item,
                                       "runs": record.runs, "updated": seq}
            updated[size] = record
        _trim(sig["sizes"], MAX_SIZES)
        _trim(entry["signatures"], MAX_SIGNATURES)
        _trim(entries, MAX_MODELS)
        self._write(data)
        return updated

    # ---- the file ----------------------------------------------------------
    def _read(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return _empty()
        except (OSError, UnicodeDecodeError) as exc:
            self.note = f"runtime history {str(self.path)!r} unreadable ({exc}): ignored"
            return _empty()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            self.note = f"runtime history {str(self.path)!r} is corrupt ({exc}): rebuilt"
            return _empty()
        if not _valid(data):
            self.note = f"runtime history {str(self.path)!r} has another format: rebuilt"
            return _empty()
        return dict(data)

    def _entry(self, data: Mapping[str, Any]) -> Mapping[str, Any]:
        entry = data.get("entries", {}).get(self.key)
        return entry if isinstance(entry, Mapping) else {}

    def _write(self, data: dict[str, Any]) -> None:
        from keel._files import write_atomically

        try:
            write_atomically(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        except OSError as exc:   # a history that cannot be written is only a lost hint
            self.note = f"runtime history {str(self.path)!r} not written ({exc})"


@functools.lru_cache(maxsize=1)
def _this_machine() -> dict[str, Any]:
    """This machine's fingerprint, probed once per process."""
    return hardware_fingerprint()


def _empty() -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "seq": 0, "entries": {}}


def _valid(data: Any) -> bool:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return False
    if data.get("version") != VERSION or not isinstance(data.get("seq", 0), int):
        return False
    entries = data.get("entries")
    return isinstance(entries, dict) and all(
        isinstance(e, dict) and isinstance(e.get("signatures", {}), dict)
        and all(isinstance(s, dict) and isinstance(s.get("sizes", {}), dict)
                for s in e.get("signatures", {}).values())
        for e in entries.values())


def _record(size: str, data: Any) -> StepRecord | None:
    """A stored record, or None where it is malformed (then it is simply not used)."""
    if not isinstance(data, Mapping) or not size.isdigit():
        return None
    seconds, runs = data.get("seconds_per_item"), data.get("runs")
    if not isinstance(seconds, (int, float)) or not isinstance(runs, int):
        return None
    if not seconds > 0 or runs < 1 or int(size) < 1:
        return None
    return StepRecord(int(size), float(seconds), runs)


def _averaged(old: StepRecord | None, size: int, per_item: float) -> StepRecord:
    """``old`` with one more measurement, averaged over at most :data:`AVERAGE_RUNS` runs."""
    if old is None:
        return StepRecord(size, per_item, 1)
    runs = min(old.runs + 1, AVERAGE_RUNS)
    return StepRecord(size, old.seconds_per_item + (per_item - old.seconds_per_item) / runs,
                      runs)


def _trim(items: dict[str, Any], bound: int) -> None:
    """Drop the least recently updated items beyond ``bound``."""
    while len(items) > bound:
        oldest = min(items, key=lambda k: _updated(items[k]))
        del items[oldest]


def _updated(item: Any) -> int:
    value = item.get("updated", 0) if isinstance(item, Mapping) else 0
    return value if isinstance(value, int) else 0

