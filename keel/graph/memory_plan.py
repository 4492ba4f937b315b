"""Static memory planning: liveness intervals → offsets in one arena per device.

Every intermediate value of known size gets a byte range in its device's arena
before anything runs. Two values share bytes only when their lifetimes do not
overlap, or when an op's schema declares that an output may reuse an input
(``OpSchema.inplace``) and that input dies at that op. Offsets are aligned to
64 bytes. Buffers are placed by a sweep over time that gives each the
tightest free gap left by buffers already dead (O(N log N) in the number of
values: a 100,000-node graph plans in well under a second); graphs of up to
``EXACT_LIMIT`` buffers per arena are also placed greedily, largest first,
into the tightest gap among the buffers alive at the same time (best fit,
quadratic), and the smaller arena is kept.

Values whose producing kernel cannot write into a given buffer live on the
*heap* (the kernel allocates them); they are planned the same way so that
their peak is known too, but get no arena offset. Values of unknown size
(data-dependent shapes) are listed as ``dynamic``.

Graph inputs, initializers and graph outputs are never in the arena: the
caller owns inputs, weights are resident, and outputs are fresh arrays.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keel.config import format_bytes
from keel.errors import KeelError
from keel.graph.ir import Graph
from keel.ops.schema import get_schema
from keel.ops.types import TensorType

__all__ = [
    "ALIGNMENT",
    "Allocation",
    "MemoryPlan",
    "PlanStep",
    "align",
    "graph_steps",
    "plan_graph_memory",
    "plan_memory",
]

ALIGNMENT = 64
ARENA = "arena"
HEAP = "heap"


def align(n: int, alignment: int = ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


@dataclass(frozen=True, slots=True)
class PlanStep:
    """What the planner needs to know about one step of a program."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    device: str = "cpu"
    # (input index, output index) pairs where the output may reuse the input's bytes.
    inplace: tuple[tuple[int, int], ...] = ()
    # False when the kernel allocates its outputs itself (they go to the heap).
    writes_out: bool = True
    # Whether an output may be a view of an input (a kernel allocating its own
    # results may return ``x.reshape(...)``); None: exactly when not ``writes_out``.
    may_alias: bool | None = None

    @property
    def aliases(self) -> bool:
        return (not self.writes_out) if self.may_alias is None else self.may_alias


@dataclass(frozen=True, slots=True)
class Allocation:
    """Where one value lives and for how long (step indices, inclusive)."""

    value: str
    device: str
    pool: str            # "arena" or "heap"
    offset: int          # byte offset in the pool of its device
    nbytes: int          # exact size of the value
    first: int
    last: int
    shares: str | None = None   # the value whose bytes this one reuses in place

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class MemoryPlan:
    """Offsets of every planned value, arena sizes and the peak, known before running."""

    allocations: tuple[Allocation, ...]
    arena_bytes: Mapping[str, int]
    heap_bytes: int = 0
    weight_bytes: int = 0
    output_bytes: int = 0
    live_peak_bytes: int = 0          # most bytes simultaneously alive (a lower bound)
    prepacked_bytes: int = 0          # kernels' packed copies of constants (an estimate)
    workspace_bytes: int = 0          # kernels' scratch beyond the arena (the largest node's)
    dynamic: tuple[str, ...] = ()     # values of unknown size, allocated when they appear
    alignment: int = ALIGNMENT
    _index: dict[str, Allocation] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({a.value: a for a in self.allocations})

    @property
    def total_arena_bytes(self) -> int:
        return sum(self.arena_bytes.values())

    @property
    def peak_bytes(self) -> int:
        """Weights + their packed copies + arenas + kernel scratch + kernel-allocated
        intermediates + outputs."""
        return (self.weight_bytes + self.prepacked_bytes + self.total_arena_bytes
                + self.workspace_bytes + self.heap_bytes + self.output_bytes)

    @property
    def inplace(self) -> tuple[tuple[str, str], ...]:
        """(output, input) pairs that share bytes in place."""
        return tuple((a.value, a.shares) for a in self.allocations if a.shares is not None)

    def __contains__(self, value: object) -> bool:
        return value in self._index

    def allocation(self, value: str) -> Allocation:
        try:
            return self._index[value]
        except KeyError:
            raise KeelError(f"value {value!r} has no planned allocation") from None

    def in_arena(self, value: str) -> bool:
        a = self._index.get(value)
        return a is not None and a.pool == ARENA

    def summary(self) -> dict[str, Any]:
        """Plain numbers for plans and reports."""
        return {
            "peak_bytes": self.peak_bytes,
            "arena_bytes": dict(self.arena_bytes),
            "heap_bytes": self.heap_bytes,
            "weight_bytes": self.weight_bytes,
            "prepacked_bytes": self.prepacked_bytes,
            "workspace_bytes": self.workspace_bytes,
            "output_bytes": self.output_bytes,
            "live_peak_bytes": self.live_peak_bytes,
            "planned_values": sum(1 for a in self.allocations if a.pool == ARENA),
            "heap_values": sum(1 for a in self.allocations if a.pool == HEAP),
            "inplace_values": len(self.inplace),
            "dynamic_values": list(self.dynamic),
            "alignment": self.alignment,
        }

    def to_dict(self) -> dict[str, Any]:
        data = self.summary()
        data["allocations"] = [
            {"value": a.value, "device": a.device, "pool": a.pool, "offset": a.offset,
             "nbytes": a.nbytes, "first": a.first, "last": a.last, "shares": a.shares}
            for a in self.allocations
        ]
        return data

    def report(self) -> str:
        """A few readable lines: the peak and where it comes from."""
        arenas = ", ".join(f"{d} {format_bytes(n)}" for d, n in sorted(self.arena_bytes.items()))
        lines = [
            f"peak memory {format_bytes(self.peak_bytes)} = weights "
            f"{format_bytes(self.weight_bytes)} + packed weights "
            f"{format_bytes(self.prepacked_bytes)} + arena {format_bytes(self.total_arena_bytes)}"
            f" + scratch {format_bytes(self.workspace_bytes)}"
            f" + kernel-allocated {format_bytes(self.heap_bytes)} + outputs "
            f"{format_bytes(self.output_bytes)}",
            f"arenas: {arenas or 'none'} (64-byte aligned offsets); values alive at once "
            f"peak at {format_bytes(self.live_peak_bytes)}",
            f"{len(self.allocations)} intermediate values planned, {len(self.inplace)} reuse "
            "their input's bytes in place",
        ]
        if self.dynamic:
            lines.append(
                f"{len(self.dynamic)} values have data-dependent sizes and are not in the "
                f"peak: {', '.join(self.dynamic[:5])}{' …' if len(self.dynamic) > 5 else ''}"
            )
        return "\n".join(lines)


def packed_bytes(shape: Sequence[int], itemsize: int) -> int:
    """An upper estimate of a kernel's packed copy of a constant of ``shape``.

    A GEMM packs a matrix in panels, padding one side to the panel width (at most
    64 elements): the matrix is (first dimension, the rest), a 3-D constant a batch
    of its last two dimensions, a vector one row; plus one alignment's slack.
    """
    dims = [int(d) for d in shape]
    batch = dims[0] if len(dims) == 3 else 1
    matrix = dims[1:] if len(dims) == 3 else dims
    rows, cols = (matrix[0], math.prod(matrix[1:])) if len(matrix) > 1 else (1, math.prod(matrix))
    padded = max(_round64(rows) * cols if rows > 1 else 0, rows * _round64(cols))
    return batch * padded * itemsize + ALIGNMENT


def _round64(n: int) -> int:
    return -(-n // 64) * 64


# ---- planning --------------------------------------------------------------
@dataclass(slots=True)
class _Buffer:
    device: str
    pool: str
    size: int                 # aligned
    first: int
    last: int
    members: list[str]
    offset: int = 0


def plan_memory(
    steps: Sequence[PlanStep],
    sizes: Mapping[str, int | None],
    *,
    external: Collection[str] = (),
    weight_bytes: int = 0,
    output_bytes: int = 0,
    alignment: int = ALIGNMENT,
    concurrent: Sequence[tuple[int, int]] = (),
) -> MemoryPlan:
    """Plan every value produced by ``steps`` that is not ``external``.

    ``sizes`` gives each value's byte count (``None``: unknown until it runs).
    ``concurrent``: (first, last) step indices of runs whose steps may run at once (a
    region's branches on threads of their own): every value such a run reads or writes
    is alive over the whole run, and no step of it reuses an input's bytes in place.
    """
    last_use = _last_uses(steps, external)
    born = _widen(steps, concurrent, last_use)
    state = _Liveness(last_use, born)
    for i, step in enumerate(steps):
        state.add_step(i, step, sizes, external, alignment)
    _place_all(state.buffers)
    allocations = tuple(
        Allocation(v, b.device, b.pool, b.offset, int(sizes[v] or 0), state.first[v],
                   max(state.first[v], last_use.get(v, state.first[v])), state.shares.get(v))
        for b in state.buffers for v in b.members
    )
    arena, heap = _pool_sizes(state.buffers, steps)
    return MemoryPlan(
        allocations=allocations,
        arena_bytes=arena,
        heap_bytes=heap,
        weight_bytes=weight_bytes,
        output_bytes=output_bytes,
        live_peak_bytes=_live_peak(state.buffers, len(steps)),
        dynamic=tuple(state.dynamic),
        alignment=alignment,
    )


@dataclass
class _Liveness:
    """Buffers being built step by step: who owns which bytes, who reuses whose."""

    last_use: Mapping[str, int]
    born: Mapping[int, int] = field(default_factory=dict)   # step -> its concurrent run's first
    buffers: list[_Buffer] = field(default_factory=list)
    owner: dict[str, _Buffer] = field(default_factory=dict)
    shares: dict[str, str] = field(default_factory=dict)
    first: dict[str, int] = field(default_factory=dict)
    dynamic: list[str] = field(default_factory=list)

    def add_step(self, i: int, step: PlanStep, sizes: Mapping[str, int | None],
                 external: Collection[str], alignment: int) -> None:
        claimed: set[int] = set()
        for j, out in enumerate(step.outputs):
            if not out or out in external or out in self.owner:
                continue
            size = sizes.get(out)
            if size is None:
                self.dynamic.append(out)
                continue
            pool = ARENA if step.writes_out else HEAP
            start = self.born.get(i, i)
            self.first[out] = start
            last = max(i, self.last_use.get(out, i))
            buf = None if i in self.born else _inplace_buffer(step, i, j, size, pool, self.owner,
                                                          sizes, claimed)
            if buf is not None:
                claimed.add(id(buf))
                self.shares[out] = buf.members[-1]
                buf.members.append(out)
                buf.last = max(buf.last, last)
            else:
                buf = _Buffer(step.device, pool, align(size, alignment), start, last, [out])
                self.buffers.append(buf)
            self.owner[out] = buf


def _pool_sizes(buffers: Sequence[_Buffer], steps: Sequence[PlanStep],
                ) -> tuple[dict[str, int], int]:
    arena: dict[str, int] = {}
    heap: dict[str, int] = {}
    for b in buffers:
        pool = arena if b.pool == ARENA else heap
        pool[b.device] = max(pool.get(b.device, 0), b.offset + b.size)
    for step in steps:
        arena.setdefault(step.device, 0)
    return arena, sum(heap.values())


def _last_uses(steps: Sequence[PlanStep], external: Collection[str]) -> dict[str, int]:
    """Last step reading each value, extended through outputs that may be views of it."""
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in step.inputs:
            if name:
                last[name] = i
    end = len(steps) - 1
    for name in external:            # graph outputs are read after the last step
        last[name] = end
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        if not step.aliases:
            continue
        reach = max((last.get(o, i) for o in step.outputs if o), default=i)
        for name in step.inputs:
            if name and last.get(name, i) < reach:
                last[name] = reach
    return last


def _widen(steps: Sequence[PlanStep], concurrent: Sequence[tuple[int, int]],
           last_use: dict[str, int]) -> dict[int, int]:
    """Every value a concurrent run's steps read or write kept alive to the run's end
    (in ``last_use``); returns each such step's run's first step (values it makes are
    alive from there)."""
    born: dict[int, int] = {}
    for first, last in concurrent:
        for i in range(first, last + 1):
            born[i] = first
            for name in (*steps[i].inputs, *steps[i].outputs):
                if name:
                    last_use[name] = max(last_use.get(name, i), last)
    return born


def _inplace_buffer(
    step: PlanStep, i: int, out_index: int, size: int, pool: str,
    owner: Mapping[str, _Buffer], sizes: Mapping[str, int | None], claimed: set[int],
) -> _Buffer | None:
    """The buffer of an input that output ``out_index`` may take over, if any."""
    for in_index, o_index in step.inplace:
        if o_index != out_index or in_index >= len(step.inputs):
            continue
        name = step.inputs[in_index]
        buf = owner.get(name)
        if (
            buf is None
            or id(buf) in claimed
            or buf.pool != pool
            or buf.device != step.device
            or buf.last != i                         # the input must die here
            or sizes.get(name) != size               # same bytes, same view layout
            or step.inputs.count(name) != 1          # read once: no aliasing surprises
        ):
            continue
        return buf
    return None


#: groups of at most this many buffers are also placed by exact best fit (quadratic), and
#: keep whichever of the two placements needs the smaller arena
EXACT_LIMIT = 512


def _place_all(buffers: list[_Buffer]) -> None:
    """Offsets for every buffer, independently for each (device, pool).

    Each group is placed by a sweep over time (:func:`_sweep`, O(N log N)); a group of at
    most ``EXACT_LIMIT`` buffers is also placed by greedy best fit, largest first
    (:func:`_best_fit`, O(N²), often tighter), and the smaller arena wins.
    """
    groups: dict[tuple[str, str], list[_Buffer]] = {}
    for buf in buffers:
        groups.setdefault((buf.device, buf.pool), []).append(buf)
    for group in groups.values():
        swept = _sweep(group)
        if len(group) <= EXACT_LIMIT and _best_fit(group) > swept:
            _sweep(group)


def _best_fit(group: list[_Buffer]) -> int:
    """Greedy best fit by size: each buffer, largest first, into the tightest gap among the
    buffers already placed that live at the same time. Returns the arena's size."""
    placed: list[_Buffer] = []
    for buf in sorted(group, key=lambda b: (-b.size, b.first)):
        buf.offset = _best_offset(buf, placed)
        placed.append(buf)
    return max((b.offset + b.size for b in group), default=0)


def _best_offset(buf: _Buffer, placed: list[_Buffer]) -> int:
    if buf.size == 0:
        return 0
    overlapping = sorted(
        (p for p in placed if p.size and p.first <= buf.last and buf.first <= p.last),
        key=lambda p: p.offset,
    )
    best: int | None = None
    best_gap = 0
    cursor = 0
    for p in overlapping:
        gap = p.offset - cursor
        if gap >= buf.size and (best is None or gap < best_gap):
            best, best_gap = cursor, gap
        cursor = max(cursor, p.offset + p.size)
    return cursor if best is None else best


def _sweep(group: list[_Buffer]) -> int:
    """Offsets by a sweep over time, as an allocator would: buffers in order of their first
    step (largest first among equals) take the tightest free gap left by buffers already
    dead, else the top of the arena. O(N log N). Returns the arena's size."""
    gaps = _Gaps()
    live: list[tuple[int, int, _Buffer]] = []        # a heap by last step
    for n, buf in enumerate(sorted(group, key=lambda b: (b.first, -b.size))):
        while live and live[0][0] < buf.first:
            done = heapq.heappop(live)[2]
            gaps.free(done.offset, done.offset + done.size)
        buf.offset = gaps.take(buf.size) if buf.size else 0
        if buf.size:
            heapq.heappush(live, (buf.last, n, buf))
    return gaps.high


class _Gaps:
    """Free byte ranges below the arena's top, neighbours merged; best fit by size."""

    def __init__(self) -> None:
        self.top = 0                                   # bytes in use end below this
        self.high = 0                                  # the highest top so far: the arena
        self.end_of: dict[int, int] = {}               # gap start -> end
        self.start_of: dict[int, int] = {}             # gap end -> start
        self.by_size: list[tuple[int, int]] = []       # (size, start), sorted

    def take(self, size: int) -> int:
        """The start of the tightest gap of at least ``size`` bytes (lowest first among
        equals), else of fresh bytes at the top."""
        i = bisect.bisect_left(self.by_size, (size, -1))
        if i == len(self.by_size):
            start, self.top = self.top, self.top + size
            self.high = max(self.high, self.top)
            return start
        have, start = self.by_size[i]
        self._remove(start)
        if have > size:
            self._add(start + size, start + have)
        return start

    def free(self, lo: int, hi: int) -> None:
        if hi in self.end_of:                          # a gap right above: merge
            hi = self._remove(hi)
        if lo in self.start_of:                        # a gap right below: merge
            lo = self.start_of[lo]
            self._remove(lo)
        if hi >= self.top:
            self.top = lo
        else:
            self._add(lo, hi)

    def _add(self, lo: int, hi: int) -> None:
        self.end_of[lo], self.start_of[hi] = hi, lo
        bisect.insort(self.by_size, (hi - lo, lo))

    def _remove(self, lo: int) -> int:
        hi = self.end_of.pop(lo)
        del self.start_of[hi]
        del self.by_size[bisect.bisect_left(self.by_size, (hi - lo, lo))]
        return hi


def _live_peak(buffers: Sequence[_Buffer], n_steps: int) -> int:
    if not buffers:
        return 0
    delta = [0] * (n_steps + 1)
    for b in buffers:
        delta[b.first] += b.size
        delta[min(b.last, n_steps - 1) + 1] -= b.size
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


# ---- graphs ----------------------------------------------------------------
def graph_steps(
    graph: Graph,
    *,
    device_of: Mapping[str, str] | None = None,
    writes_out: Mapping[str, bool] | None = None,
) -> list[PlanStep]:
    """One ``PlanStep`` per node; ``device_of`` and ``writes_out`` are keyed by node name."""
    steps = []
    for node in graph.nodes:
        steps.append(PlanStep(
            name=node.name,
            inputs=tuple(node.inputs),
            outputs=tuple(node.outputs),
            device=(device_of or {}).get(node.name, "cpu"),
            inplace=_schema_inplace(node.op),
            writes_out=(writes_out or {}).get(node.name, True),
        ))
    return steps


def _schema_inplace(op: Any) -> tuple[tuple[int, int], ...]:
    try:
        return tuple(get_schema(op).inplace)
    except KeelError:
        return ()


def value_sizes(types: Mapping[str, TensorType | None]) -> dict[str, int | None]:
    """Byte counts of typed values; ``None`` where the shape is not static."""
    return {name: (None if t is None else t.nbytes()) for name, t in types.items()}


def plan_graph_memory(
    graph: Graph,
    types: Mapping[str, TensorType | None],
    *,
    device_of: Mapping[str, str] | None = None,
    writes_out: Mapping[str, bool] | None = None,
    alignment: int = ALIGNMENT,
) -> MemoryPlan:
    """Plan the intermediates of ``graph`` for the static ``types`` of one input signature."""
    steps = graph_steps(graph, device_of=device_of, writes_out=writes_out)
    return plan_steps_for_graph(graph, types, steps, alignment=alignment)


def plan_steps_for_graph(
    graph: Graph,
    types: Mapping[str, TensorType | None],
    steps: Sequence[PlanStep],
    *,
    alignment: int = ALIGNMENT,
    concurrent: Sequence[tuple[int, int]] = (),
) -> MemoryPlan:
    """Like :func:`plan_graph_memory` for steps built by the caller (copies included);
    ``concurrent`` as :func:`plan_memory` takes it."""
    sizes = value_sizes(types)
    external = set(graph.input_names) | set(graph.initializers) | set(graph.output_names)
    weights = sum(int(a.nbytes) for a in graph.initializers.values())
    outputs = sum(sizes.get(name) or 0 for name in dict.fromkeys(graph.output_names))
    return plan_memory(steps, sizes, external=external, weight_bytes=weights,
                       output_bytes=outputs, alignment=alignment, concurrent=concurrent)
