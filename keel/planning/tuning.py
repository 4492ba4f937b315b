"""Measured variant choices: time a node's candidate kernels here and remember the winner.

The declared rules (:func:`keel.planning.variants.choose_variant`, the conv
variants' :class:`~keel.backends.cpu.conv_rules.ConvRule` evidence tables)
were measured on one machine. :func:`tune` measures the machine it runs on:
for each distinct *node case* of a planned model on the ``cpu`` backend (op,
input shapes, dtypes, which inputs are weights, attributes, thread count)
that more than one kernel variant can run, it

* builds a one-node program per candidate variant with
  :func:`~keel.execution.program.compile_program` (the weights prepacked as in
  a real run, the output written into the same buffer every run, as an arena
  view is), on the model's own cpu backend (same threads);
* runs each once untimed (one-time preparation), checks that every
  candidate's output agrees with the others within the dtype's tolerance
  (a candidate that disagrees is dropped; when no two agree nothing is
  decided), then alternates the candidates in rounds, rotating their order,
  each sample long enough to read a clock, until each has ``repeats``
  samples or the case's share of the time budget is spent (at least
  ``MIN_REPEATS``);
* keeps the fastest median, unless the declared rules' own choice is within
  ``NOISE`` of it: a difference that small is noise, and the declared choice
  stays.

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
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from keel._fork import renew_after_fork
from keel._hashing import sha256
from keel.backends.base import Backend, KernelTable
from keel.backends.cpu.conv_rules import conv_case
from keel.config import cache_dir
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, KeelError
from keel.graph.ir import Graph, Node, Value
from keel.hardware.profile import HardwareProfile
from keel.ops.registry import Op
from keel.ops.types import TensorType
from keel.planning.calibration import (
    Progress,
    _write_atomically,
    fingerprint_id,
    hardware_fingerprint,
    machine_fingerprint,
)
from keel.planning.variants import VariantInfo, choose_variant, tier_unavailable

if TYPE_CHECKING:
    from keel.planning.placement import ExecutionPlan

__all__ = [
    "DEFAULT_BUDGET_SECONDS",
    "DEFAULT_REPEATS",
    "CaseReport",
    "Lookup",
    "NodeCase",
    "Timing",
    "TuneReport",
    "TunedCase",
    "TuningCache",
    "Work",
    "cached",
    "candidates",
    "find_work",
    "lookup",
    "node_case",
    "progress_bar",
    "record",
    "tune",
    "tuning_path",
]

TUNING_VERSION = 1
FILE_FORMAT = "keel-tuning"
DEFAULT_BUDGET_SECONDS = 60.0
DEFAULT_REPEATS = 9
MIN_REPEATS = 3
# A declared choice within 3 % of the fastest candidate stays: run-to-run noise on a
# busy machine is of that order, and a plan should not flip on noise.
NOISE = 1.03
SAMPLE_SECONDS = 2e-3           # one sample runs the node this long at least
MAX_CALLS_PER_SAMPLE = 1000
# Largest |difference| / largest |output| two candidates may show and still agree.
TOLERANCE = {DType.FLOAT16: 2e-2, DType.FLOAT32: 1e-3, DType.FLOAT64: 1e-9}
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
        each case): a plan made with one token is stale under another."""
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
        _write_atomically(path, text + "\n")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write the tuning cache {path}: {exc}") from None


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
    case = node_case(graph, node, input_types, backend.name, _threads(backend), describe=False)
    if case is None:
        return None
    tiers = _tiers()
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


def _threads(backend: Backend) -> int:
    threads = getattr(backend, "threads", 1)
    return threads if isinstance(threads, int) and threads > 0 else 1


def _tiers() -> tuple[str, ...]:
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


# ---- measuring ---------------------------------------------------------------------
@dataclass
class _Bench:
    """One candidate variant compiled as a one-node program, with its feeds and outputs."""

    variant: str
    program: Any
    feeds: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    calls: int = 1                        # runs per sample
    samples: list[float] = field(default_factory=list)

    def run(self) -> None:
        self.program.run(self.feeds, outputs=self.outputs)

    def sample(self) -> None:
        start = time.perf_counter()
        for _ in range(self.calls):
            self.run()
        self.samples.append((time.perf_counter() - start) / self.calls)


@dataclass(frozen=True)
class Work:
    """A case to measure: its representative node, the nodes sharing it, its candidates."""

    case: NodeCase
    node: Node
    input_types: tuple[TensorType | None, ...]
    candidates: tuple[str, ...]
    nodes: tuple[str, ...]


def _one_node(graph: Graph, node: Node, types: Mapping[str, TensorType | None]
              ) -> tuple[Graph, dict[str, TensorType | None]]:
    """``node`` alone: its weights as the graph's constants, its other inputs fed."""
    inputs, weights = [], {}
    for name in dict.fromkeys(node.present_inputs()):
        if graph.is_constant(name):
            weights[name] = graph.initializers[name]
        else:
            t = types.get(name)
            assert t is not None            # candidates() only takes static inputs
            inputs.append(Value(name, t))
    outputs = [Value(o, t) for o in node.outputs if o and (t := types.get(o)) is not None]
    one = Graph(f"tune:{node.name}", [node], inputs, outputs, weights)
    names = {*node.present_inputs(), *(o for o in node.outputs if o)}
    return one, {n: types.get(n) for n in names}


def _feeds(graph: Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for v in graph.inputs:
        shape = tuple(int(d) for d in v.type.shape or () if isinstance(d, int))
        dt = v.type.dtype
        if dt.is_float:
            feeds[v.name] = rng.standard_normal(shape).astype(dt.numpy)
        elif dt is DType.BOOL:
            feeds[v.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            feeds[v.name] = rng.integers(0, 4, size=shape).astype(dt.numpy)
    return feeds


def _benches(work: Work, graph: Graph, types: Mapping[str, TensorType | None],
             backend: Backend, notes: list[str]) -> list[_Bench]:
    """Compile each candidate and run it twice (its one-time preparation, then a run
    into poisoned outputs that the agreement check reads); drop failures."""
    from keel.backends.registry import BackendRegistry
    from keel.execution.program import ArenaPool, compile_program
    from keel.planning.placement import place

    one, sub = _one_node(graph, work.node, types)
    registry = BackendRegistry()
    registry.register(backend.name, lambda: backend)
    base = place(one, sub, registry, backend=backend.name, strict=False)
    feeds = _feeds(one, np.random.default_rng(0))
    benches = []
    for variant in work.candidates:
        placed = replace(base.nodes[0], variant=variant,
                         writes_out=backend.kernels.get(work.node.op, variant).supports_out)
        try:
            program = compile_program(one, replace(base, nodes=(placed,)), sub,
                                      {backend.name: backend}, ArenaPool())
            outputs = {v.name: np.empty(_shape(v.type), v.type.dtype.numpy)
                       for v in one.outputs}
            bench = _Bench(variant, program, feeds, outputs)
            bench.run()             # prepares what the node keeps between runs
            for out in outputs.values():
                _poison(out)        # what the steady-state run leaves unwritten shows
            bench.run()
        except KeelError as exc:
            notes.append(f"{variant} failed: {exc.message}")
            continue
        benches.append(bench)
    return benches


def _poison(array: np.ndarray) -> None:
    if array.dtype.kind in "fc":
        array.fill(np.nan)
    else:
        array.fill(np.iinfo(array.dtype).max if array.dtype.kind in "iu" else 0)


def _shape(t: TensorType) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape or () if isinstance(d, int))


def _agreeing(benches: list[_Bench], notes: list[str]) -> list[_Bench]:
    """The largest group of candidates whose outputs agree with one of them."""
    def agree(a: _Bench, b: _Bench) -> bool:
        return all(_close(a.outputs[k], b.outputs[k]) for k in a.outputs)

    best: list[_Bench] = []
    for pivot in benches:
        group = [b for b in benches if b is pivot or agree(pivot, b)]
        if len(group) > len(best):
            best = group
    if len(best) < 2:
        notes.append("no two candidates' outputs agree: nothing decided")
        return []
    for b in benches:
        if b not in best:
            notes.append(f"{b.variant} dropped: its output differs from {best[0].variant}'s")
    return best


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    dtype = DType.from_numpy(a.dtype)
    if not dtype.is_float:
        return bool(np.array_equal(a, b))
    x, y = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(x)
    if not (np.array_equal(finite, np.isfinite(y))
            and np.array_equal(x[~finite], y[~finite], equal_nan=True)):
        return False                # NaN and infinities must match exactly
    x, y = x[finite], y[finite]
    scale = float(np.max(np.abs(y), initial=0.0))
    return float(np.max(np.abs(x - y), initial=0.0)) <= TOLERANCE.get(dtype, 1e-3) * scale


def _time(benches: list[_Bench], allowance: float, repeats: int) -> None:
    """Alternate the candidates, rotating their order, until each has ``repeats``
    samples or ``allowance`` seconds passed (each gets ``MIN_REPEATS`` at least)."""
    for b in benches:               # one more untimed run: how many runs fill a sample
        start = time.perf_counter()
        b.run()
        once = max(time.perf_counter() - start, 1e-9)
        b.calls = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(SAMPLE_SECONDS / once)))
    deadline = time.perf_counter() + allowance
    for turn in range(repeats):
        if turn >= MIN_REPEATS and time.perf_counter() > deadline:
            break
        shift = turn % len(benches)
        for b in benches[shift:] + benches[:shift]:
            b.sample()


def _measure(work: Work, graph: Graph, types: Mapping[str, TensorType | None],
             backend: Backend, allowance: float, repeats: int,
             notes: list[str]) -> TunedCase | None:
    benches = _agreeing(_benches(work, graph, types, backend, notes), notes)
    if not benches:
        return None
    _time(benches, allowance, repeats)
    import statistics  # here: measuring is rare, its decimal and fractions are not

    timings = tuple(sorted((Timing(b.variant, statistics.median(b.samples), len(b.samples))
                            for b in benches), key=lambda t: t.median_s))
    declared, _ = choose_variant(work.node.op, work.input_types, work.node.attrs,
                                 backend.kernels)
    winner = timings[0].variant
    kept = next((t for t in timings if t.variant == declared), None)
    if kept is not None and kept.median_s <= timings[0].median_s * NOISE:
        winner = declared
    return TunedCase(work.case, timings, winner, declared, _tiers(),
                     datetime.now(timezone.utc).isoformat(timespec="seconds"))


# ---- tuning a planned model ---------------------------------------------------------------
@dataclass(frozen=True)
class CaseReport:
    """What ``tune`` did with one case: measured, cached, skipped or undecided."""

    description: str
    key: str
    nodes: tuple[str, ...]
    candidates: tuple[str, ...]
    status: str
    tuned: TunedCase | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        t = self.tuned
        return {"case": self.description, "key": self.key, "nodes": list(self.nodes),
                "candidates": list(self.candidates), "status": self.status,
                "medians_s": {} if t is None else {x.variant: x.median_s for x in t.timings},
                "runs": {} if t is None else {x.variant: x.runs for x in t.timings},
                "winner": None if t is None else t.winner,
                "declared": None if t is None else t.declared,
                "ratio": None if t is None else round(t.ratio, 4),
                "reason": None if t is None else t.reason(), "notes": list(self.notes)}


@dataclass(frozen=True)
class TuneReport:
    """The cases of one planned model and what tuning found for each."""

    model: str
    threads: int
    path: str
    budget_s: float
    elapsed_s: float
    cases: tuple[CaseReport, ...]

    @property
    def nothing_to_tune(self) -> bool:
        return not self.cases

    def message(self) -> str:
        if self.nothing_to_tune:
            return (f"nothing to tune: no node of {self.model!r} has more than one kernel "
                    "variant that can run it here")
        counts: dict[str, int] = {}
        for c in self.cases:
            counts[c.status] = counts.get(c.status, 0) + 1
        done = ", ".join(f"{n} {s}" for s, n in counts.items())
        return f"{len(self.cases)} case(s) of {self.model!r}: {done}; cache {self.path}"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "threads": self.threads, "cache": self.path,
                "budget_s": self.budget_s, "elapsed_s": round(self.elapsed_s, 3),
                "nothing_to_tune": self.nothing_to_tune, "message": self.message(),
                "cases": [c.to_dict() for c in self.cases]}


def find_work(graph: Graph, types: Mapping[str, TensorType | None], plan: ExecutionPlan,
              backend: Backend) -> list[Work]:
    """The distinct cases of the nodes ``plan`` places on ``backend`` with >= 2 candidates."""
    placed = {p.name: p.backend for p in plan.nodes}
    found: dict[str, Work] = {}
    for node in graph.nodes:
        if placed.get(node.name) != backend.name:
            continue
        input_types = tuple(types.get(i) if i else None for i in node.inputs)
        cands = candidates(node, input_types, backend.kernels)
        case = node_case(graph, node, input_types, backend.name, _threads(backend))
        if len(cands) < 2 or case is None:
            continue
        seen = found.get(case.key)
        nodes = (*seen.nodes, node.name) if seen is not None else (node.name,)
        found[case.key] = Work(case, seen.node if seen else node, input_types, cands, nodes)
    return list(found.values())


def tune(graph: Graph, types: Mapping[str, TensorType | None], plan: ExecutionPlan,
         backends: Mapping[str, Backend], *,
         budget_s: float = DEFAULT_BUDGET_SECONDS, repeats: int = DEFAULT_REPEATS,
         force: bool = False, progress: Progress | None = None) -> TuneReport:
    """Measure the cases of ``plan``'s nodes on the cpu backend of ``backends`` (the
    plan's, as ``compile_program`` takes them) not yet cached; cache the winners.

    The budget is shared by the cases still to measure; a case started gets
    ``MIN_REPEATS`` samples of each candidate even past it, and the cases left
    when it is spent are reported ``skipped`` (a later ``tune`` measures them).
    ``force`` measures cached cases again.
    """
    if (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float))
            or not (budget_s > 0 and math.isfinite(budget_s))):
        raise InvalidArgumentError(f"the tuning budget must be a positive number of seconds, "
                                   f"got {budget_s!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < MIN_REPEATS:
        raise InvalidArgumentError(f"repeats must be an int >= {MIN_REPEATS}, got {repeats!r}")
    path = _path(_here()[1])
    backend = backends.get(BACKEND)
    work = [] if backend is None else find_work(graph, types, plan, backend)
    done = {} if force else cached().entries
    start = time.perf_counter()
    reports = []
    todo = [w for w in work if w.case.key not in done]
    for i, w in enumerate(work):
        if progress is not None:
            progress(i, len(work), f"tuning {w.case.description[:60]}")
        if w.case.key in done:
            reports.append(_report(w, "cached", done[w.case.key]))
            continue
        left = budget_s - (time.perf_counter() - start)
        if left <= 0:
            reports.append(_report(w, "skipped", None, ("the time budget was spent",)))
            continue
        allowance = left / max(1, len(todo) - todo.index(w))
        notes: list[str] = []
        tuned = _measure(w, graph, types, backends[BACKEND], allowance, repeats, notes)
        if tuned is not None:
            record([tuned])
        reports.append(_report(w, "measured" if tuned else "undecided", tuned, tuple(notes)))
    if progress is not None:
        progress(len(work), len(work), "tuned")
    threads = 0 if backend is None else _threads(backend)
    return TuneReport(graph.name, threads, str(path), float(budget_s),
                      time.perf_counter() - start, tuple(reports))


def _report(w: Work, status: str, tuned: TunedCase | None,
            notes: tuple[str, ...] = ()) -> CaseReport:
    return CaseReport(w.case.description, w.case.key, w.nodes, w.candidates, status, tuned,
                      notes)


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Progress]:
    """A progress callback drawing a bar on stderr (when it is a terminal)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import (
        Progress as Bar,
    )

    err = Console(stderr=True)
    with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
             TimeElapsedColumn(), console=err, transient=True,
             disable=not (enabled and err.is_terminal)) as bar:
        task = bar.add_task("tuning", total=None)

        def report(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=label)

        yield report

