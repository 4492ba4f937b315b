"""Shared reads together: a later reader of a value runs right after the reader before it.

A value read by two nodes far apart in the order is read twice from memory: the
nodes between push it out of cache. ResNet's downsampling block is the case: its
block input X feeds the first 3x3 conv and the 1x1 shortcut, and the shortcut comes
after the second 3x3 conv, which has pushed X out of L2. Moving the shortcut right
after the first conv reads X while it is still in cache; the residual Add then
joins the second conv (``fuse_residual`` runs after this pass and takes the operand
made last).

A reader moves only when every value it reads is ready where it goes, it has no
side effects or subgraphs (only Conv, Gemm and MatMul move: the nodes whose reads
cost), and the order's peak of live intermediates does not grow: moving a node
earlier keeps its outputs alive longer. The move lands after the earlier reader's
chain of sole consumers (its activation or bias, fused into it later), so that reader
keeps its place once fused. Each move is recorded in the graph's metadata
(``keel.node_order``), which ``explain()`` shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["ORDER_KEY", "order_shared_reads"]

ORDER_KEY = "keel.node_order"   # metadata: one line per move, for explain()
_MOVABLE = frozenset({Op.CONV, Op.GEMM, Op.MATMUL})


def order_shared_reads(graph: Graph) -> Graph:
    """A copy of ``graph`` with later readers of a shared value moved beside the reader
    before them."""
    g = graph.copy()
    try:
        types = infer_graph_types(g)
    except KeelError:
        return g
    sizes = {name: _bytes(t) for name, t in types.items()}
    notes: list[str] = []
    links = _Links(g)
    for i in range(len(g.nodes)):
        note = _move(g, i, sizes, links)
        if note:
            notes.append(note)
            links = _Links(g)
    if notes:
        g.metadata[ORDER_KEY] = "\n".join(
            [*filter(None, g.metadata.get(ORDER_KEY, "").split("\n")), *notes])
    return g


def _bytes(t: TensorType | None) -> int | None:
    """A tensor's bytes with each symbolic dimension counted as 1: the passes see the
    graph before its batch is known, and a batch scales every activation alike."""
    if t is None or t.shape is None or not t.is_tensor:
        return None
    known = [d if isinstance(d, int) else 1 for d in t.shape]
    return int(np.prod(known, dtype=np.int64)) * t.dtype.itemsize


class _Links:
    """Where each value is made and read, and who reads it, in ``g``'s order."""

    def __init__(self, g: Graph) -> None:
        self.producer = {o: k for k, m in enumerate(g.nodes) for o in m.outputs if o}
        self.readers: dict[str, list[int]] = {}
        for k, m in enumerate(g.nodes):
            for v in dict.fromkeys(m.present_inputs()):
                self.readers.setdefault(v, []).append(k)
        self.consumers = g.consumers()


def _move(g: Graph, i: int, sizes: Mapping[str, int | None], links: _Links) -> str:
    """Move node ``i`` right after the reader before it of a value it reads (after that
    reader's chain), where every input is ready there and the peak does not grow; the
    reason, or "" when it stays. The reader before, not the first: readers already in a
    row stay in their order, so a second run of the pass moves nothing."""
    n = g.nodes[i]
    if n.op not in _MOVABLE or any(isinstance(v, Graph) for v in n.attrs.values()) or \
            any(sizes.get(o) is None for o in n.outputs if o):
        return ""
    inputs = n.present_inputs()
    for value in inputs:
        if value not in links.producer:     # weights and graph inputs: not the cache's
            continue
        before = [k for k in links.readers[value] if k < i]
        if not before:
            continue
        target = _chain_end(g, before[-1], links) + 1
        if target >= i or any(links.producer.get(v, -1) >= target for v in inputs):
            continue
        order = [*g.nodes[:target], n, *(m for m in g.nodes[target:] if m is not n)]
        if _peak(order, g, sizes) > _peak(g.nodes, g, sizes):
            continue
        reader = g.nodes[before[-1]].name
        g.nodes = order
        return (f"{n.name} runs right after {reader}: both read {value} "
                f"({(sizes.get(value) or 0) >> 10} KiB an image), the second read while it is in "
                "cache; the peak of live values does not grow")
    return ""


def _chain_end(g: Graph, k: int, links: _Links) -> int:
    """The last node of ``k``'s chain: each next node the sole reader of the one before,
    reading nothing else but constants and no product itself (an activation, a bias)."""
    while k + 1 < len(g.nodes):
        here, after = g.nodes[k], g.nodes[k + 1]
        outs = [o for o in here.outputs if o]
        if len(outs) != 1 or outs[0] in g.output_names or \
                [id(m) for m in links.consumers.get(outs[0], [])] != [id(after)]:
            break
        if after.op in _MOVABLE or any(v != outs[0] and g.constant(v) is None
                                       for v in after.present_inputs()):
            break
        k += 1
    return k


def _peak(order: Sequence[Node], g: Graph, sizes: Mapping[str, int | None]) -> int:
    """The most bytes of intermediates alive at once in ``order``: each from its producer
    to its last reader (graph outputs to the end); an unknown size counts as 0 in both
    orders alike."""
    last: dict[str, int] = {}
    for k, m in enumerate(order):
        for v in m.present_inputs():
            last[v] = k
    end = len(order)
    for v in g.output_names:
        last[v] = end
    delta = [0] * (end + 2)
    for k, m in enumerate(order):
        for o in m.outputs:
            if o:
                size = sizes.get(o) or 0
                delta[k] += size
                delta[last.get(o, k) + 1] -= size
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak
