"""``keel tune``: time a node's candidate kernels on this machine and remember the winner.

For each distinct node case of a planned model (see :mod:`keel.planning.tuning`,
which keeps the results and answers placement) that more than one kernel
variant can run, :func:`tune`

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

Winners go to :func:`keel.planning.tuning.record`.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import numpy as np

from keel.backends.base import Backend
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, KeelError
from keel.execution.program import ArenaPool, compile_program
from keel.graph.ir import Graph, Node, Value
from keel.ops.types import TensorType
from keel.planning.calibration import Progress
from keel.planning.plans import ExecutionPlan
from keel.planning.tuning import (
    BACKEND,
    NodeCase,
    Timing,
    TunedCase,
    backend_threads,
    cached,
    candidates,
    node_case,
    path_here,
    record,
    tiers_here,
)
from keel.planning.variants import choose_variant

__all__ = [
    "DEFAULT_BUDGET_SECONDS",
    "DEFAULT_REPEATS",
    "CaseReport",
    "TuneReport",
    "Work",
    "find_work",
    "progress_bar",
    "tune",
]

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
    timings = tuple(sorted((Timing(b.variant, statistics.median(b.samples), len(b.samples))
                            for b in benches), key=lambda t: t.median_s))
    declared, _ = choose_variant(work.node.op, work.input_types, work.node.attrs,
                                 backend.kernels)
    winner = timings[0].variant
    kept = next((t for t in timings if t.variant == declared), None)
    if kept is not None and kept.median_s <= timings[0].median_s * NOISE:
        winner = declared
    return TunedCase(work.case, timings, winner, declared, tiers_here(),
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
        case = node_case(graph, node, input_types, backend.name, backend_threads(backend))
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
    path = path_here()
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
    threads = 0 if backend is None else backend_threads(backend)
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

