"""MatMul + Add fusion.

``MatMul(A, B) + C`` becomes ``Gemm(A, B, C)`` when A and B are matrices (2-D),
and a MATMUL with a bias input (``A @ B + bias``, the fused-epilogue contract)
when they are batched. Only when C broadcasts *into* the product's shape: an
Add that would grow the result is not a bias.
"""

from __future__ import annotations

from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.passes._rewrite import Rewriter, make_attrs
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType, broadcast_shapes

__all__ = ["fuse_matmul_add"]


def fuse_matmul_add(graph: Graph) -> Graph:
    """A copy of ``graph`` with MatMul → Add pairs fused into Gemm or biased MATMUL."""
    rw = Rewriter(graph.copy())
    try:
        types = infer_graph_types(rw.graph)
    except KeelError:
        return rw.apply()
    for add in list(rw.graph.nodes):
        if add.op is Op.ADD and not rw.claimed(add):
            _try(rw, add, types)
    return rw.apply()


def _try(rw: Rewriter, add: Node, types: dict[str, TensorType | None]) -> None:
    for k in (0, 1):
        mm = rw.made_by(add.inputs[k], Op.MATMUL)
        bias = add.inputs[1 - k]
        if mm is None or len(mm.present_inputs()) != 2 or mm.attr("activation", ""):
            continue
        if not rw.only_use(mm.outputs[0], add) or bias == mm.outputs[0]:
            continue
        a, b, y = (types.get(n) for n in (mm.inputs[0], mm.inputs[1], mm.outputs[0]))
        c = types.get(bias)
        if not _bias_fits(y, c):
            continue
        node = _fused(mm, add, bias, a, b)
        if node is not None:
            rw.replace([mm, add], [node])
            return


def _bias_fits(y: TensorType | None, c: TensorType | None) -> bool:
    if y is None or c is None or y.shape is None or c.shape is None or y.dtype != c.dtype \
            or not y.dtype.is_float:
        return False
    if len(c.shape) > len(y.shape):
        return False
    try:
        return broadcast_shapes(y.shape, c.shape) == tuple(y.shape) and all(
            d is not None for d in c.shape
        )
    except KeelError:
        return False


def _takes_bias() -> bool:
    try:
        schema = get_schema(Op.MATMUL)
    except KeelError:
        return False
    return schema.max_inputs is None or schema.max_inputs >= 3


def _fused(mm: Node, add: Node, bias: str, a: TensorType | None,
           b: TensorType | None) -> Node | None:
    origin = f"{mm.origin or 'MatMul'}+{add.origin or 'Add'}"
    if a is not None and b is not None and a.rank == 2 and b.rank == 2:
        attrs = make_attrs(Op.GEMM, {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0})
        if attrs is not None:
            return Node(mm.name, Op.GEMM, [mm.inputs[0], mm.inputs[1], bias],
                        [add.outputs[0]], attrs, origin)
    if a is None or b is None or a.rank is None or b.rank is None or min(a.rank, b.rank) < 2:
        return None  # 1-D operands: a bias over a squeezed axis is not what MATMUL adds
    if not _takes_bias():
        return None
    return Node(mm.name, Op.MATMUL, [mm.inputs[0], mm.inputs[1], bias], [add.outputs[0]],
                dict(mm.attrs), origin)
