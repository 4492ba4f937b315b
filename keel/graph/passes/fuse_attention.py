"""Scaled dot-product attention fusion.

``Softmax(Q @ Kᵀ · scale [+ mask]) @ V`` over 4-D ``[B, H, S, D]`` tensors,
as exporters write it (``Kᵀ`` a Transpose swapping the last two axes; the
scale a Mul or Div by a constant after the first MatMul, or split as Muls by
constants of Q and Kᵀ before it, as torch's scaled_dot_product_attention
exports), becomes one ATTENTION node: inputs Q, K, V, [mask]; attribute
``scale``. The fused kernel never materialises the ``[S, T]`` score matrix in
full.

torch's export also guards the probabilities, ``Where(IsNaN(P), 0, P)``: a
row that the mask hides entirely (all -inf) gives NaN from the softmax, and
zeros after the guard. The fused form guards its output instead,
``Where(IsNaN(Y), 0, Y)``: the same values for hidden rows and for NaN in Q or
K (a whole row of NaN scores); only NaN in V differs (NaN before, 0 after).
"""

from __future__ import annotations

from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.passes._rewrite import Rewriter, const_scalar, make_attrs
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["fuse_attention"]


def fuse_attention(graph: Graph) -> Graph:
    """A copy of ``graph`` with attention subgraphs fused into ATTENTION nodes."""
    rw = Rewriter(graph.copy())
    try:
        types = infer_graph_types(rw.graph)
    except KeelError:
        return rw.apply()
    for node in list(rw.graph.nodes):
        if node.op is Op.SOFTMAX and not rw.claimed(node):
            _try(rw, node, types)
    return rw.apply()


def _rank4(t: TensorType | None) -> bool:
    return t is not None and t.rank == 4 and t.dtype.is_float


def _try(rw: Rewriter, softmax: Node, types: dict[str, TensorType | None]) -> None:
    if int(softmax.attr("axis", -1)) not in (-1, 3):
        return
    guard = _nan_guard(rw, softmax)
    p = softmax.outputs[0] if guard is None else guard[1].outputs[0]
    pv = rw.single_consumer(p)
    if pv is None or pv.op is not Op.MATMUL or pv.inputs[0] != p or \
            len(pv.present_inputs()) != 2 or pv.attr("activation", ""):
        return
    scores = _scores(rw, softmax.inputs[0], softmax)
    if scores is None:
        return
    qk, scale, mask, extra = scores
    (q, q_scale, q_mul), (kt, k_scale, k_mul) = (_operand(rw, qk, i) for i in (0, 1))
    v = pv.inputs[1]
    if not all(_rank4(types.get(n)) for n in (q, kt, v, pv.outputs[0])):
        return
    attrs = make_attrs(Op.ATTENTION, {"scale": scale * q_scale * k_scale})
    if attrs is None:
        return
    k, k_nodes, absorbed = _untransposed(rw, kt, k_mul[0] if k_mul else qk)
    pattern = [*absorbed, *q_mul, *k_mul, qk, *extra, softmax, *(guard or ()), pv]
    inputs = [q, k, v] + ([mask] if mask else [])
    y = pv.outputs[0] if guard is None else rw.fresh(f"{pv.outputs[0]}/unguarded")
    fused = Node(qk.name, Op.ATTENTION, inputs, [y], attrs, origin="attention pattern")
    rw.replace(pattern, [*k_nodes, fused, *_guarded(rw, guard, y, pv.outputs[0])])


def _nan_guard(rw: Rewriter, softmax: Node) -> tuple[Node, Node] | None:
    """(IsNaN, Where) of ``Where(IsNaN(P), 0, P)`` when the softmax output P feeds
    exactly those two nodes; None otherwise."""
    p = softmax.outputs[0]
    users = rw.uses(p)
    if p in rw.outputs or len(users) != 2:
        return None
    isnan = next((n for n in users if n.op is Op.ISNAN), None)
    where = next((n for n in users if n.op is Op.WHERE), None)
    if isnan is None or where is None or len(where.inputs) != 3 or \
            where.inputs[0] != isnan.outputs[0] or where.inputs[2] != p or \
            where.inputs[1] == p or const_scalar(rw.graph, where.inputs[1]) != 0.0 or \
            not rw.only_use(isnan.outputs[0], where):
        return None
    return isnan, where


def _guarded(rw: Rewriter, guard: tuple[Node, Node] | None, y: str, out: str) -> list[Node]:
    """The guard moved to the fused output: ``out = Where(IsNaN(y), 0, y)``."""
    if guard is None:
        return []
    isnan, where = guard
    nan = rw.fresh(f"{out}/isnan")
    return [Node(isnan.name, Op.ISNAN, [y], [nan], dict(isnan.attrs), origin=isnan.origin),
            Node(where.name, Op.WHERE, [nan, where.inputs[1], y], [out], dict(where.attrs),
                 origin=where.origin)]


def _operand(rw: Rewriter, qk: Node, i: int) -> tuple[str, float, list[Node]]:
    """Operand ``i`` of the scores MatMul without a Mul by a constant that only it reads:
    (the unscaled operand, the factor, the Mul absorbed, if any)."""
    name = qk.inputs[i]
    mul = rw.made_by(name, Op.MUL)
    if mul is None or not rw.only_use(name, qk):
        return name, 1.0, []
    found = _scaled(rw, mul)
    if found is None:
        return name, 1.0, []
    return found[0], found[1], [mul]


def _untransposed(rw: Rewriter, kt: str, qk: Node) -> tuple[str, list[Node], list[Node]]:
    """K as [B, H, T, D] from the Kᵀ operand that ``qk`` reads: (name, nodes to add,
    nodes absorbed).

    A Transpose making Kᵀ is replaced by one making K (none when K is its
    input); without one, K is a new Transpose of Kᵀ.
    """
    swap = (0, 1, 3, 2)
    tr = rw.made_by(kt, Op.TRANSPOSE)
    perm = None if tr is None else tr.attr("perm", (3, 2, 1, 0))
    if tr is not None and perm is not None and len(perm) == 4 and rw.only_use(kt, qk):
        composed = tuple(int(perm[i]) for i in swap)
        if composed == (0, 1, 2, 3):
            return tr.inputs[0], [], [tr]
        k = rw.fresh(f"{kt}/untransposed")
        node = Node(tr.name, Op.TRANSPOSE, [tr.inputs[0]], [k], {**tr.attrs, "perm": composed},
                    origin="attention K")
        return k, [node], [tr]
    k = rw.fresh(f"{kt}/untransposed")
    node = Node(rw.fresh(f"{qk.name}/k"), Op.TRANSPOSE, [kt], [k], {"perm": swap},
                origin="attention K")
    return k, [node], []


def _scores(rw: Rewriter, name: str, reader: Node
            ) -> tuple[Node, float, str, list[Node]] | None:
    """Walk back from the softmax input: [Add mask] ← [Mul/Div scale] ← MatMul(Q, Kᵀ)."""
    extra: list[Node] = []
    mask = ""
    scale = 1.0
    node = rw.made_by(name, Op.ADD, Op.MUL, Op.DIV, Op.MATMUL)
    if node is None or not rw.only_use(name, reader):
        return None
    if node.op is Op.ADD:
        extra.insert(0, node)
        name, mask = _split_add(rw, node)
        reader, node = node, rw.made_by(name, Op.MUL, Op.DIV, Op.MATMUL)
        if node is None or not rw.only_use(name, reader):
            return None
    if node.op in (Op.MUL, Op.DIV):
        found = _scaled(rw, node)
        if found is None:
            return None
        name, factor = found
        scale = factor
        extra.insert(0, node)
        reader, node = node, rw.made_by(name, Op.MATMUL)
        if node is None or not rw.only_use(name, reader):
            return None
    if node.op is not Op.MATMUL or len(node.present_inputs()) != 2 or node.attr("activation", ""):
        return None
    return node, scale, mask, extra


def _split_add(rw: Rewriter, add: Node) -> tuple[str, str]:
    """(the scores operand, the mask operand) of the mask Add."""
    a, b = add.inputs
    producer = rw.producer.get(a)
    if producer is not None and producer.op in (Op.MUL, Op.DIV, Op.MATMUL):
        return a, b
    return b, a


def _scaled(rw: Rewriter, node: Node) -> tuple[str, float] | None:
    """(the unscaled operand, the scale) of ``x * c`` or ``x / c``."""
    if node.op is Op.DIV:
        c = const_scalar(rw.graph, node.inputs[1])
        return None if not c else (node.inputs[0], 1.0 / c)
    for x, c_name in (node.inputs, node.inputs[::-1]):
        c = const_scalar(rw.graph, c_name)
        if c is not None:
            return x, c
    return None
