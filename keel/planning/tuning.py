"""Measured variant choices: what ``keel tune`` measured on this machine, and what
placement takes from it.

The declared rules (:func:`keel.planning.variants.choose_variant`, the conv
variants' :class:`~keel.backends.cpu.conv_rules.ConvRule` evidence tables)
were measured on one machine. :mod:`keel.execution.tuning` measures the
machine it runs on, for each distinct *node case* of a planned model on the
``cpu`` backend (op, input shapes, dtypes, which inputs are weights,
attributes, thread count) that more than one kernel variant can run.

Winners are cached as JSON in ``cache_dir()/tuning/``, one file per hardware
fingerprint (:func:`keel.planning.calibration.hardware_fingerprint`), tied to
the keel version; a file of another version or machine, unreadable or
damaged, is ignored (and replaced by the next ``tune``), and one owned by
another user or writable by others is refused. Files are written atomically.

Placement consults the cache through :func:`lookup`: a measured winner that
can still run here decides the node's variant ("measured on this machine:
winograd 1.31x faster than im2col (median of 9 runs)"); otherwise the
declared rules decide and the reason names the machine their evidence came
from.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import stat
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from keel._files import write_atomically
from keel._fork import renew_after_fork
from keel._hashing import sha256
from keel.backends.base import Backend, KernelTable
from keel.config import cache_dir
from keel.errors import InvalidArgumentError, KeelError
from keel.graph.ir import Graph, Node
from keel.hardware.profile import HardwareProfile
from keel.ops.registry import Op
from keel.ops.types import TensorType
from keel.planning.calibration_record import (
    fingerprint_id,
    hardware_fingerprint,
    machine_fingerprint,
)
from keel.planning.variants import VariantInfo, tier_unavailable

__all__ = [
    "BACKEND",
    "Lookup",
    "NodeCase",
    "Timing",
    "TunedCase",
    "TuningCache",
    "backend_threads",
    "cached",
    "candidates",
    "lookup",
    "node_case",
    "path_here",
    "record",
    "tiers_here",
    "tuning_path",
]

TUNING_VERSION = 1
FILE_FORMAT = "keel-tuning"
_TIERS = ("native",)
BACKEND = "cpu"                 # the backend whose variants are measured
_CONV_OPS = frozenset({Op.CONV})


# ---- node cases ------------------------------------------------------------------
@dataclass(frozen=True)
class NodeCase:
    """What a variant's speed depends on: the key a measurement is cached under."""

    data: Mapping[str, Any]          # backend, op, inputs, attrs, threads (plain JSON)
    description: str

    @functools.cached_property
    def key(self) -> str:
        return case_key(self.data)


def case_key(data: Mapping[str, Any]) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return sha256(text.encode()).hexdigest()[:24]


def node_case(graph: Graph, node: Node, input_types: Sequence[TensorType | None],
              backend: str, threads: int, describe: bool = True) -> NodeCase | None:
    """The case of ``node`` (None when an input's shape is not static); ``describe``:
    with its description in words (what a lookup by key does without)."""
    inputs: list[Any] = []
    for name, t in zip(node.inputs, input_types, strict=False):
        if not name:
            inputs.append(None)
            continue
        if t is None or not t.is_static:
            return None
        inputs.append([list(t.shape or ()), t.dtype.value, graph.is_constant(name)])
    data = {"backend": backend, "op": node.op.value, "inputs": inputs,
            "attrs": {k: _plain(v) for k, v in sorted(node.attrs.items())},
            "threads": threads}
    return NodeCase(data, _describe(node, input_types, graph) if describe else "")


def _plain(value: Any) -> Any:
    """An attribute as plain JSON data (arrays by shape, dtype and content hash)."""
    if isinstance(value, np.ndarray):
        digest = sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
        return {"array": list(value.shape), "dtype": str(value.dtype), "sha256": digest}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _describe(node: Node, input_types: Sequence[TensorType | None], graph: Graph) -> str:
    """E.g. ``conv float32 (1x3x16x16; weights 16x3x3x3, 16): 3x3 stride 1x1, ...``."""
    fed: list[str] = []
    weights: list[str] = []
    for name, t in zip(node.inputs, input_types, strict=False):
        if name and t is not None:
            dims = "x".join(str(d) for d in t.shape or ()) or "scalar"
            (weights if graph.is_constant(name) else fed).append(dims)
    dtype = next((t.dtype.value for t in input_types if t is not None), "")
    text = f"{node.op.value} {dtype} ({', '.join(fed)}" + (
        f"; weights {', '.join(weights)})" if weights else ")")
    case = _conv_case(node, input_types)
    return f"{text}: {case.describe()}" if case is not None else text


def _conv_case(node: Node, input_types: Sequence[TensorType | None]) -> Any:
    if node.op not in _CONV_OPS or len(input_types) < 2:
        return None
    x, w = input_types[0], input_types[1]
    if x is None or w is None or not x.is_static or not w.is_static:
        return None
    from keel.backends.cpu.conv_rules import conv_case  # only conv cases need it

    try:
        return conv_case(node.op, x.shape or (), w.shape or (), node.attrs, x.dtype.value)
    except KeelError:
        return None


def candidates(node: Node, input_types: Sequence[TensorType | None],
               table: KernelTable) -> tuple[str, ...]:
    """The variants of ``table`` that can run ``node`` here (static shapes only)."""
    if any(t is None or not t.is_static
           for name, t in zip(node.inputs, input_types, strict=False) if name):
        return ()
    dtype = next((t.dtype for t in input_types if t is not None), None)
    infos = [VariantInfo.from_kernel(table.backend, kv) for kv in table.variants(node.op).values()]
    usable = [v for v in infos
              if not v.dispatcher and v.unavailable() is None and v.serves_dtype(dtype)]
    if node.op in _CONV_OPS:
        case = _conv_case(node, input_types)
        usable = [v for v in usable if case is not None and (rule := v.active_rule()) is not None
                  and rule.cannot_serve(case) is None]
    return tuple(sorted(v.name for v in usable))


# ---- measured results ----------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """One candidate's median time per run over ``runs`` samples."""

    variant: str
    median_s: float
    runs: int

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "median_s": self.median_s, "runs": self.runs}


@dataclass(frozen=True)
class TunedCase:
    """A measured node case: every accepted candidate's timing and the winner."""

    case: NodeCase
    timings: tuple[Timing, ...]          # fastest first
    winner: str
    declared: str                        # what the declared rules chose
    tiers: tuple[str, ...]               # kernel tiers available when measured
    measured_at: str

    @property
    def runs(self) -> int:
        return min(t.runs for t in self.timings)

    def timing(self, variant: str) -> Timing:
        return next(t for t in self.timings if t.variant == variant)

    @property
    def runner_up(self) -> Timing:
        """The fastest candidate other than the winner."""
        return min((t for t in self.timings if t.variant != self.winner),
                   key=lambda t: t.median_s)

    @property
    def ratio(self) -> float:
        """The runner-up's median over the winner's (> 1: the winner is faster)."""
        return self.runner_up.median_s / self.timing(self.winner).median_s

    def reason(self, where: str = "this machine") -> str:
        other, runs = self.runner_up, f"median of {self.runs} runs"
        if self.ratio < 1:
            return (f"measured on {where}: {self.winner} within {(1 / self.ratio - 1):.1%} of "
                    f"{other.variant} ({runs}): the declared choice stays")
        return (f"measured on {where}: {self.winner} {self.ratio:.2f}x faster than "
                f"{other.variant} ({runs})")

    def to_dict(self) -> dict[str, Any]:
        return {"case": dict(self.case.data), "description": self.case.description,
                "timings": [t.to_dict() for t in self.timings], "winner": self.winner,
                "declared": self.declared, "tiers": list(self.tiers),
                "measured_at": self.measured_at}

    @classmethod
    def from_dict(cls, data: Any) -> TunedCase:
        """Checked reading: anything malformed raises ``InvalidArgumentError``."""
        try:
            timings = tuple(Timing(str(t["variant"]), float(t["median_s"]), int(t["runs"]))
                            for t in data["timings"])
            tuned = cls(NodeCase(dict(data["case"]), str(data["description"])), timings,
                        str(data["winner"]), str(data["declared"]),
                        tuple(str(t) for t in data["tiers"]), str(data["measured_at"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"malformed tuning entry: {exc!r}") from None
        if (len(timings) < 2 or tuned.winner not in {t.variant for t in timings}
                or any(not (math.isfinite(t.median_s) and t.median_s > 0) or t.runs < 1
                       for t in timings)):
            raise InvalidArgumentError("tuning entry's timings or winner do not hold together")
        return tuned


# ---- the cache ----------------------------------------------------------------------
def tuning_path(fingerprint: Mapping[str, Any], directory: Path | None = None) -> Path:
    """Where the tuning of the machine with ``fingerprint`` is cached."""
    return _path(fingerprint_id(fingerprint), directory)


def _path(fid: str, directory: Path | None = None) -> Path:
    folder = (cache_dir() / "tuning") if directory is None else directory
    return folder / f"tuning-{fid}.json"


@dataclass(frozen=True)
class TuningCache:
    """The measured cases of one machine's cache file, or none and why."""

    path: Path
    entries: Mapping[str, TunedCase]      # by NodeCase.key
    status: str                           # where the entries came from, or why none

    @property
    def token(self) -> str:
        """A short hash of what placement would take from this cache (winner and tiers of
        each case): a plan made with one token is stale under another. ``untuned`` when
        nothing is measured, as :func:`keel.execution.model` says without reading a file."""
        if not self.entries:
            return "untuned"
        text = json.dumps({k: [t.winner, *t.tiers] for k, t in self.entries.items()},
                          sort_keys=True)
        return sha256(text.encode()).hexdigest()[:16]


_MEMO: dict[Path, tuple[tuple[int, int, int], TuningCache]] = {}
_MEMO_LOCK = threading.Lock()
renew_after_fork(sys.modules[__name__], "_MEMO_LOCK")   # free in a forked child


def _unsafe(path: Path) -> str | None:
    """Why ``path`` must not be trusted: another user's, or writable by others."""
    if not hasattr(os, "getuid"):
        return None
    try:
        st = path.stat()
    except OSError:                 # absent or unreadable: reading it fails and says so
        return None
    if st.st_uid != os.getuid():
        return f"{path} is owned by another user (uid {st.st_uid})"
    if st.st_mode & stat.S_IWOTH:
        return f"{path} is writable by others"
    return None


def _load(path: Path, fingerprint: Mapping[str, Any]) -> TuningCache:
    """The entries of ``path``; never raises (an unusable file gives none, with why)."""
    why = _unsafe(path.parent) or _unsafe(path)
    if why is not None:
        return TuningCache(path, {}, f"refused: {why}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return TuningCache(path, {}, f"nothing measured yet ({path} does not exist)")
    except (OSError, ValueError) as exc:
        return TuningCache(path, {}, f"ignored {path}: unreadable ({exc})")
    why = _stale(data, fingerprint)
    if why is not None:
        return TuningCache(path, {}, f"ignored {path}: {why}")
    entries: dict[str, TunedCase] = {}
    raw = data.get("entries")
    for key, value in (raw.items() if isinstance(raw, dict) else ()):
        with contextlib.suppress(InvalidArgumentError):
            tuned = TunedCase.from_dict(value)
            if tuned.case.key == key:     # the key is recomputed, never taken as written
                entries[key] = tuned
    return TuningCache(path, entries, f"loaded {path}")


def _stale(data: Any, fingerprint: Mapping[str, Any]) -> str | None:
    from keel import __version__

    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        return f"not a keel tuning file (no \"format\": \"{FILE_FORMAT}\")"
    if data.get("version") != TUNING_VERSION:
        return f"format version {data.get('version')!r}, this keel reads {TUNING_VERSION}"
    if data.get("keel") != __version__:
        return f"measured with keel {data.get('keel')!r}, this is keel {__version__}"
    if data.get("fingerprint") != dict(fingerprint):
        return "measured on another machine (hardware fingerprint differs)"
    return None


def _cache_of(fingerprint: Mapping[str, Any], fid: str) -> TuningCache:
    """The cached tuning of ``fingerprint`` (its id ``fid``), read again only when the
    file changed."""
    path = _path(fid)
    try:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        stamp = (0, -1, 0)
    with _MEMO_LOCK:
        hit = _MEMO.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
    store = _load(path, fingerprint)
    with _MEMO_LOCK:
        _MEMO[path] = (stamp, store)
    return store


def _save(path: Path, fingerprint: Mapping[str, Any], new: Sequence[TunedCase]) -> None:
    """Merge ``new`` into the file at ``path`` (its valid entries kept), atomically."""
    from keel import __version__

    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot create the tuning cache {path.parent}: {exc}") \
            from None
    why = _unsafe(path.parent) or _unsafe(path)
    if why is not None:
        raise InvalidArgumentError(f"refusing to write the tuning cache: {why}")
    entries = dict(_load(path, fingerprint).entries)
    entries.update({t.case.key: t for t in new})
    text = json.dumps({"format": FILE_FORMAT, "version": TUNING_VERSION, "keel": __version__,
                       "fingerprint": dict(fingerprint),
                       "entries": {k: t.to_dict() for k, t in sorted(entries.items())}},
                      indent=1, sort_keys=True)
    try:
        # Beside the target, then renamed over it: a reader never sees half a file.
        write_atomically(path, text + "\n")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write the tuning cache {path}: {exc}") from None


def path_here() -> Path:
    """Where this machine's tuning is cached."""
    return _path(_here()[1])


def cached() -> TuningCache:
    """This machine's tuning cache as placement reads it."""
    return _cache_of(*_here())


def record(tuned: Sequence[TunedCase]) -> Path:
    """Add ``tuned`` to this machine's cache (atomically); returns the file's path."""
    fingerprint, fid = _here()
    path = _path(fid)
    _save(path, fingerprint, tuned)
    return path


def _here() -> tuple[dict[str, Any], str]:
    """This machine's fingerprint (probed once per process) and its id."""
    return machine_fingerprint(), _here_id()


@functools.lru_cache(maxsize=1)
def _here_id() -> str:
    return fingerprint_id(machine_fingerprint())


def _fingerprint(profile: Any) -> tuple[dict[str, Any], str, str]:
    """The fingerprint plans for ``profile`` are looked up under, its id, and the
    machine's name in a reason."""
    here, fid = _here()
    if not isinstance(profile, HardwareProfile):
        return here, fid, "this machine"
    theirs = hardware_fingerprint(profile)
    if theirs == here:
        return here, fid, "this machine"
    return theirs, fingerprint_id(theirs), str(theirs.get("cpu") or "its CPU")


# ---- what placement asks ---------------------------------------------------------------
@dataclass(frozen=True)
class Lookup:
    """The measured variant of a node (None: the declared rules decide), and why."""

    variant: str | None
    reason: str


def lookup(graph: Graph, node: Node, input_types: Sequence[TensorType | None],
           backend: Backend, profile: Any = None) -> Lookup | None:
    """The tuned variant of ``node`` on ``backend``, or a note for the declared choice.

    None when the node has fewer than two candidate variants here (nothing to
    measure). A measured winner that cannot run here any more (its tier off,
    or it was measured with other tiers) is ignored, and the note says why.
    """
    table = backend.kernels
    if backend.name != BACKEND or len(table.variants(node.op)) < 2:
        return None
    case = node_case(graph, node, input_types, backend.name, backend_threads(backend),
                     describe=False)
    if case is None:
        return None
    tiers = tiers_here()
    cands, declared = _choices(case.key, tiers, node, input_types, table)
    if len(cands) < 2:
        return None
    fingerprint, fid, where = _fingerprint(profile)
    tuned = _cache_of(fingerprint, fid).entries.get(case.key)
    if tuned is None:
        return Lookup(None, declared)
    why_not = _unusable(tuned, tiers, cands, table, node.op)
    if why_not is not None:
        return Lookup(None, f"measured result ignored ({why_not}); {declared}")
    return Lookup(tuned.winner, tuned.reason(where))


# (case key, tiers available, kernel table) -> (candidates, the declared choice's note):
# placement asks once per node and plan, and the answer depends only on these.
_CHOICES: dict[tuple[str, tuple[str, ...], KernelTable], tuple[tuple[str, ...], str]] = {}
_CHOICES_LIMIT = 4096


def _choices(key: str, tiers: tuple[str, ...], node: Node,
             input_types: Sequence[TensorType | None],
             table: KernelTable) -> tuple[tuple[str, ...], str]:
    memo = (key, tiers, table)         # the table itself: an id could be reused
    hit = _CHOICES.get(memo)
    if hit is None:
        cands = candidates(node, input_types, table)
        hit = (cands, _declared_note(node.op, table, cands) if len(cands) > 1 else "")
        if len(_CHOICES) >= _CHOICES_LIMIT:
            _CHOICES.clear()
        _CHOICES[memo] = hit
    return hit


def backend_threads(backend: Backend) -> int:
    """The thread count a node case of ``backend`` is keyed by."""
    threads = getattr(backend, "threads", 1)
    return threads if isinstance(threads, int) and threads > 0 else 1


def tiers_here() -> tuple[str, ...]:
    """The kernel tiers that can run here (a measurement records them)."""
    return tuple(t for t in _TIERS if tier_unavailable(t) is None)


def _unusable(tuned: TunedCase, tiers: tuple[str, ...], cands: Sequence[str],
              table: KernelTable, op: Op) -> str | None:
    if tuned.winner not in cands:
        kv = table.variants(op).get(tuned.winner)
        why = None if kv is None else VariantInfo.from_kernel(table.backend, kv).unavailable()
        return f"{tuned.winner} cannot run here: {why or 'not a candidate for this node'}"
    if tuned.tiers != tiers:
        was = ", ".join(tuned.tiers) or "none"
        now = ", ".join(tiers) or "none"
        return f"measured with kernel tiers {was}, here {now}"
    return None


def _declared_note(op: Op, table: KernelTable, cands: Sequence[str]) -> str:
    """How the declared choice was made, and on which machine its evidence was measured."""
    machines: dict[str, None] = {}
    for name in cands:
        rule = VariantInfo.from_kernel(table.backend, table.get(op, name)).active_rule()
        if rule is not None and rule.measured:
            machines[_machine(rule.measured)] = None
    names = ", ".join(cands[:-1]) + f" and {cands[-1]}"
    tell = f"`keel tune` times {names} on this machine"
    if not machines:
        return f"declared priorities decide, nothing measured; {tell}"
    return (f"declared rules decide: their evidence was measured on "
            f"{' and '.join(machines)}; {tell}")


def _machine(measured: str) -> str:
    """The machine a rule's ``measured`` text names: its text up to the first top-level
    comma ("2-core AMD EPYC (Zen 4, AVX-512), 1 thread, ..." -> "2-core AMD EPYC (Zen 4,
    AVX-512)")."""
    depth = 0
    for i, ch in enumerate(measured):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch in ",:" and depth == 0:
            return measured[:i].strip()
    return measured.strip()
