"""Shared reads together: a later reader of a value runs right after the reader before it.

A value read by two nodes far apart in the order is read twice from memory: the
nodes between push it out of cache. ResNet's downsampling block is the case: its
block input X feeds the first 3x3 conv and the 1x1 shortcut, and the shortcut comes
after the second 3x3 conv, which has pushed X out of L2. Moving the shortcut right
after the first conv's chain gives its read of X a chance to find X still in cache;
the residual Add then joins the second conv (``fuse_residual`` runs after this pass
and takes the operand made last).

A reader moves only when every value it reads is ready where it goes and it has no
side effects or subgraphs (only Conv, Gemm and MatMul move: the nodes whose reads
cost). It lands after the earlier reader's chain of sole consumers (its activation or
bias, fused into it later), so that reader keeps its place once fused.

Memory: the passes run before the batch is known, so a tensor's size is a sum of
products of symbolic dimensions (``N × 196.0 KiB``), and a move is taken only when no
node's step holds more live bytes than it did, for every value of those dimensions.
Moving node ``n`` from position ``i`` to ``t`` changes what is live only at the steps
between: each node ``m`` there now also holds ``n``'s outputs, and no longer holds the
inputs of ``n`` that nothing from ``t`` on reads (``n`` was their last reader); and
``n``'s own step now holds what the step of ``m0`` (the node first at ``t``) held,
with ``n``'s outputs in place of ``m0``'s. So two checks, each coefficient by
coefficient of those sums (sound for any non-negative dimensions, where counting each
symbolic dimension as 1 is not: a move can fit at batch 1 and grow the arena at batch
256): ``n``'s outputs are no larger than the inputs whose last read it becomes, and no
larger than ``m0``'s outputs. Every step after the move then holds no more than some
step before it, so the peak of live values cannot grow. An unknown size counts as
nothing freed and nothing held by ``m0``, so it can only refuse a move.

Each move is recorded in the graph's metadata (``keel.node_order``), which
``explain()`` shows; ``optimize`` records the moves it makes inside subgraph bodies
there too, and starts the record afresh on each load (it is not exported).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from keel.config import format_bytes
from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["ORDER_KEY", "order_shared_reads"]

ORDER_KEY = "keel.node_order"   # metadata: one line per move, for explain()
_MOVABLE = frozenset({Op.CONV, Op.GEMM, Op.MATMUL})

# A tensor's bytes as a sum of terms: the symbolic dimensions multiplied (sorted, () for
# a fixed size) -> the bytes each unit of that product holds.
Size = dict[tuple[str, ...], int]


def order_shared_reads(graph: Graph) -> Graph:
    """A copy of ``graph`` with later readers of a shared value moved beside the reader
    before them."""
    g = graph.copy()
    try:
        types = infer_graph_types(g)
    except KeelError:
        return g
    sizes = {name: _size(t) for name, t in types.items()}
    notes: list[str] = []
    links = _Links(g)
    for i in range(len(g.nodes)):
        note = _move(g, i, sizes, links)
        if note:
            notes.append(note)
    if notes:
        g.metadata[ORDER_KEY] = "\n".join(
            [*filter(None, g.metadata.get(ORDER_KEY, "").split("\n")), *notes])
    return g


def _size(t: TensorType | None) -> Size | None:
    """A tensor's bytes as a sum of terms over its symbolic dimensions; None when a
    dimension or the rank is unknown."""
    if t is None or t.shape is None or not t.is_tensor or any(d is None for d in t.shape):
        return None
    fixed = t.dtype.itemsize
    for d in t.shape:
        if isinstance(d, int):
            fixed *= d
    symbols = tuple(sorted(d for d in t.shape if isinstance(d, str)))
    return {symbols: fixed}


def _sum(sizes: Sequence[Size | None]) -> Size:
    """The terms of ``sizes`` added (an unknown size adds nothing)."""
    total: Size = {}
    for s in sizes:
        for k, v in (s or {}).items():
            total[k] = total.get(k, 0) + v
    return total


def _within(a: Size, b: Size) -> bool:
    """Whether ``a`` is at most ``b`` for every non-negative value of the dimensions:
    term by term, a sufficient test since every term grows with its dimensions."""
    return all(v <= b.get(k, 0) for k, v in a.items() if v)


def _text(s: Size | None) -> str:
    """A size as read: ``3.1 MiB``, ``N × 196.0 KiB``."""
    if not s:
        return "size unknown"
    return " + ".join(" × ".join([*k, format_bytes(v)]) for k, v in sorted(s.items()))


class _Links:
    """Who makes and reads each value (fixed by a move), and each node's place in ``g``'s
    order (updated by each move for the nodes it shifts)."""

    def __init__(self, g: Graph) -> None:
        self.producer = {o: m for m in g.nodes for o in m.outputs if o}
        self.readers: dict[str, list[Node]] = {}
        for m in g.nodes:
            for v in dict.fromkeys(m.present_inputs()):
                self.readers.setdefault(v, []).append(m)
        self.consumers = g.consumers()
        self.place = {id(m): k for k, m in enumerate(g.nodes)}

    def at(self, m: Node) -> int:
        return self.place[id(m)]

    def moved(self, g: Graph, target: int, i: int) -> None:
        """``g.nodes[i]`` went to ``target``: the nodes between shift one place on."""
        for k in range(target, i + 1):
            self.place[id(g.nodes[k])] = k


def _move(g: Graph, i: int, sizes: Mapping[str, Size | None], links: _Links) -> str:
    """Move node ``i`` right after the reader before it of a value it reads (after that
    reader's chain), where every input is ready there and no step holds more; the
    reason, or "" when it stays. The reader before, not the first: readers already in a
    row stay in their order, so a second run of the pass moves nothing."""
    n = g.nodes[i]
    outs = [o for o in n.outputs if o]
    if n.op not in _MOVABLE or any(isinstance(v, Graph) for v in n.attrs.values()) or \
            any(sizes.get(o) is None for o in outs):
        return ""
    inputs = n.present_inputs()
    for value in inputs:
        if value not in links.producer:     # weights and graph inputs: not the cache's
            continue
        before = [k for k in map(links.at, links.readers[value]) if k < i]
        if not before:
            continue
        reader = max(before)
        target = _chain_end(g, reader, links) + 1
        if target >= i or any(v in links.producer and links.at(links.producer[v]) >= target
                              for v in inputs):
            continue
        made = _sum([sizes.get(o) for o in outs])
        freed = _freed(g, n, target, sizes, links)
        if not _within(made, freed) or \
                not _within(made, _sum([sizes.get(o) for o in g.nodes[target].outputs if o])):
            continue
        g.nodes.insert(target, g.nodes.pop(i))
        links.moved(g, target, i)
        last = g.nodes[target - 1].name
        first = g.nodes[reader].name
        where = (f"after {first}'s chain (up to {last}, fused into it later where an "
                 "activation or bias)") if last != first else f"right after {last}"
        return (f"{n.name} runs {where}: both read {value} ({_text(sizes.get(value))}), "
                "moved so the second read can find it still in cache; no step holds more "
                f"live bytes for any value of the symbolic dimensions (its output, "
                f"{_text(made)}, is no larger than what it frees by reading last, "
                f"{_text(freed)}, nor than the output of {g.nodes[target + 1].name})")
    return ""


def _freed(g: Graph, n: Node, target: int, sizes: Mapping[str, Size | None],
           links: _Links) -> Size:
    """The inputs of ``n`` that, with ``n`` at ``target``, nothing else reads from there
    on: produced values, not graph outputs, read last by ``n``."""
    free = [v for v in dict.fromkeys(n.present_inputs())
            if v in links.producer and v not in g.output_names and
            all(m is n or links.at(m) < target for m in links.readers[v])]
    return _sum([sizes.get(v) for v in free])


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
