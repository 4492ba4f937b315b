"""Residual LayerNorm fusion: ``LayerNorm(x + r)`` becomes one SKIP_LAYER_NORM node.

Every transformer block ends its two sublayers with ``LayerNorm(x + sublayer(x))``.
Run as Add then LayerNorm, the sum is written out and read back; fused, each
row is added, normalized and written once (onnxruntime's SkipLayerNormalization).
When the graph reads the sum elsewhere (pre-norm blocks carry it on as the
next residual), the fused node writes it as its second output.

Runs after MatMul+Add fusion: a Linear's bias Add belongs in the MatMul
epilogue, and an Add straight after a bias-less MatMul becomes its bias there.
"""

from __future__ import annotations

from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.passes._rewrite import Rewriter, make_attrs
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.schemas.normalization import check_skip
from keel.ops.types import TensorType

__all__ = ["fuse_skip_layer_norm"]


def fuse_skip_layer_norm(graph: Graph) -> Graph:
    """A copy of ``graph`` with each Add → LayerNorm pair fused."""
    rw = Rewriter(graph.copy())
    try:
        types = infer_graph_types(rw.graph)
    except KeelError:
        return rw.apply()
    for ln in list(rw.graph.nodes):
        if ln.op is Op.LAYER_NORM and not rw.claimed(ln):
            _try(rw, ln, types)
    return rw.apply()


def _try(rw: Rewriter, ln: Node, types: dict[str, TensorType | None]) -> None:
    add = rw.made_by(ln.inputs[0], Op.ADD)
    if add is None or _statistics_used(rw, ln):
        return
    total = add.outputs[0]
    if ln.inputs.count(total) != 1:
        return
    later = [u for u in rw.uses(total) if u is not ln]
    # The fused node stands where the LayerNorm stood: readers of the sum must come later.
    if any(rw.index[id(u)] < rw.index[id(ln)] for u in later):
        return
    operands = _operands(add, types)
    attrs = make_attrs(Op.SKIP_LAYER_NORM, dict(ln.attrs))
    if operands is None or attrs is None:
        return
    outputs = [ln.outputs[0]] + ([total] if later or total in rw.outputs else [])
    inputs = [*operands, ln.inputs[1]] + ([ln.input(2)] if ln.input(2) else [])
    origin = f"{add.origin or 'Add'}+{ln.origin or 'LayerNormalization'}"
    rw.replace([add, ln], [Node(ln.name, Op.SKIP_LAYER_NORM, inputs, outputs, attrs, origin)])


def _statistics_used(rw: Rewriter, ln: Node) -> bool:
    """The LayerNorm's Mean or InvStdDev output is read (the fused op does not give them)."""
    return any(o and (rw.uses(o) or o in rw.outputs) for o in ln.outputs[1:])


def _operands(add: Node, types: dict[str, TensorType | None]) -> tuple[str, str] | None:
    """(X, skip): X has the sum's full shape, skip broadcasts to it without growing it."""
    out = types.get(add.outputs[0])
    if out is None or out.shape is None or not out.dtype.is_float or \
            any(d is None for d in out.shape):
        return None
    for k in (0, 1):
        x, skip = types.get(add.inputs[k]), types.get(add.inputs[1 - k])
        if x is None or skip is None or skip.shape is None or x.dtype != out.dtype \
                or skip.dtype != out.dtype or tuple(x.shape or ()) != tuple(out.shape):
            continue
        try:
            check_skip(Op.SKIP_LAYER_NORM, out.shape, skip.shape)
        except KeelError:
            continue
        if len(skip.shape) <= len(out.shape):
            return add.inputs[k], add.inputs[1 - k]
    return None
