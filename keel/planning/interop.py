"""Inter-op parallelism: independent branches of a graph that run at once.

A *region* is a contiguous run of nodes, in the graph's (topological) order, that
splits into two or more groups with no value passing between them: the branches of an
Inception-style block between its fork and its concat, or the heads of a model after
their shared trunk. Everything before a region has run when it starts, and nothing
after it starts before every branch is done, so its branches may run on different
threads in any interleaving and compute exactly what the sequential order computes.

:func:`find_regions` finds the regions; :func:`plan_regions` asks the backend's rule
(the cpu planner's :func:`~keel.backends.cpu.planner.plan_branches`) whether running
each one's branches at once pays, and records the answer and its reason either way.
The memory plan then keeps every value a concurrent region reads or writes alive over
the whole region (:func:`spans`), so branches running at once never share arena bytes,
and the program runs each region's lanes on threads of their own
(:mod:`keel.execution.branches`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.graph.ir import Graph, Node
from keel.ops.registry import OpGroup
from keel.ops.types import TensorType
from keel.planning.work import estimated_work

__all__ = ["Region", "find_regions", "plan_regions", "spans"]


@dataclass(frozen=True)
class Region:
    """Independent branches between ``first`` and ``last`` (node indices, inclusive), the
    lanes they run in (node names per lane: one lane when they run in order) and why."""

    first: int
    last: int
    branches: int                          # independent groups of nodes found
    lanes: tuple[tuple[str, ...], ...]     # each lane's nodes, in graph order
    reason: str

    @property
    def concurrent(self) -> bool:
        return len(self.lanes) > 1

    def to_dict(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "branches": self.branches,
                "lanes": [list(lane) for lane in self.lanes], "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Region:
        return cls(int(data["first"]), int(data["last"]), int(data["branches"]),
                   tuple(tuple(str(n) for n in lane) for lane in data["lanes"]),
                   str(data["reason"]))


def find_regions(nodes: Sequence[Node]) -> list[tuple[int, int, list[list[int]]]]:
    """(first, last, the node indices of each branch) of every run of ``nodes`` that
    splits into two or more independent branches.

    One pass in order: a window of nodes grows, each node joining the branch of the
    window's nodes it reads (values made before the window are the window's inputs). A
    node reading two branches is a join: the window closes before it and the next one
    starts after it. A window still of one branch restarts after a node whose outputs
    several nodes read (a fork), so that the branches after it are told apart.
    """
    producer = {out: i for i, n in enumerate(nodes) for out in n.outputs if out}
    readers: dict[str, int] = {}
    for n in nodes:
        for name in dict.fromkeys(i for i in n.inputs if i):
            readers[name] = readers.get(name, 0) + 1
    found: list[tuple[int, int, list[list[int]]]] = []
    start, count = 0, 0
    root: dict[int, int] = {}                   # node index -> its branch's first node
    for i, node in enumerate(nodes):
        roots = {root[producer[v]] for v in node.inputs if producer.get(v, -1) >= start}
        if len(roots) > 1:                      # a join: the window ends before it
            _close(found, start, i - 1, root)
            start, root, count = i + 1, {}, 0
            continue
        root[i] = roots.pop() if roots else i
        count += root[i] == i
        if count == 1 and any(readers.get(o, 0) > 1 for o in node.outputs):
            start, root, count = i + 1, {}, 0   # one branch so far, forking here
    _close(found, start, len(nodes) - 1, root)
    return found


def _close(found: list[tuple[int, int, list[list[int]]]], first: int, last: int,
           root: Mapping[int, int]) -> None:
    groups: dict[int, list[int]] = {}
    for i, r in root.items():
        groups.setdefault(r, []).append(i)
    if len(groups) > 1:
        found.append((first, last, sorted(groups.values())))


def plan_regions(graph: Graph, types: Mapping[str, TensorType | None],
                 placements: Sequence[Any], threads: int, enabled: bool,
                 rule: Callable[[Sequence[Sequence[tuple[float, int]]]], tuple[int, str]]
                 ) -> tuple[Region, ...]:
    """Every region of ``graph`` with its decision: the lanes its branches run in, as
    ``rule`` decides from each branch's nodes' (estimated work, kernel threads: the node
    plan's, else ``threads``), and why. ``placements`` are the nodes' (in graph order); a region
    runs in order where it is off (``enabled`` False: ``KEEL_INTEROP=off``) or where a
    node of it runs on another device or runs subgraphs."""
    nodes = graph.nodes
    regions = []
    for first, last, branches in find_regions(nodes):
        names = [[nodes[i].name for i in b] for b in branches]
        why = _why_in_order(nodes, placements, first, last, enabled)
        if why:
            regions.append(Region(first, last, len(branches), (_flat(names),), why))
            continue
        loads = [[(estimated_work(types.get, nodes[i]), placements[i].threads or threads)
                  for i in b] for b in branches]
        lanes, why = rule(loads)
        regions.append(Region(first, last, len(branches),
                              _lanes(names, [sum(w for w, _ in b) for b in loads], lanes),
                              why))
    return tuple(regions)


def _why_in_order(nodes: Sequence[Node], placements: Sequence[Any], first: int, last: int,
                  enabled: bool) -> str:
    """Why a region runs in order whatever its work ("": the rule decides)."""
    if not enabled:
        return "KEEL_INTEROP=off: in order"
    span = range(first, last + 1)
    if any(placements[i].backend != "cpu" for i in span):
        return "in order: some of its nodes run on another backend than cpu"
    if any(nodes[i].op in OpGroup.CONTROL_FLOW for i in span):
        return "in order: a node runs subgraphs (their programs run one at a time)"
    return ""


def _flat(branches: Sequence[Sequence[str]]) -> tuple[str, ...]:
    return tuple(n for b in branches for n in b)


def _lanes(branches: Sequence[Sequence[str]], work: Sequence[float],
           count: int) -> tuple[tuple[str, ...], ...]:
    """The branches dealt into ``count`` lanes, heaviest first onto the lightest lane
    (each lane's nodes kept in graph order); one lane: every node, in graph order."""
    if count <= 1:
        return (_flat(branches),)
    lanes: list[list[tuple[int, str]]] = [[] for _ in range(count)]
    load = [0.0] * count
    order = {n: k for k, n in enumerate(_flat(branches))}
    for b in sorted(range(len(branches)), key=lambda b: -work[b]):
        lane = min(range(count), key=lambda k: load[k])
        load[lane] += work[b]
        lanes[lane] += [(order[n], n) for n in branches[b]]
    return tuple(tuple(n for _, n in sorted(lane)) for lane in lanes if lane)


def spans(regions: Sequence[Region]) -> tuple[tuple[int, int], ...]:
    """(first, last) node indices of the regions whose branches run at once: the memory
    plan keeps every value they touch alive over all of each."""
    return tuple((r.first, r.last) for r in regions if r.concurrent)
