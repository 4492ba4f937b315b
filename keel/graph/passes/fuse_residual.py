"""Residual fusion: ``Conv(x) + r`` becomes CONV with ``r`` as its Z input.

The fused-epilogue contract gives CONV a fourth input Z of the output's
shape: ``Y = act(conv(X, W) + B + Z)``. Adding the skip connection in the
epilogue saves a full read and write of the activation. Runs before
activation fusion so that ``Relu(Conv(x) + r)`` ends as one node.
"""

from __future__ import annotations

from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.passes._rewrite import Rewriter
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType

__all__ = ["fuse_residual"]


def fuse_residual(graph: Graph) -> Graph:
    """A copy of ``graph`` with Conv → Add(residual) pairs fused."""
    rw = Rewriter(graph.copy())
    try:
        if (get_schema(Op.CONV).max_inputs or 4) < 4:
            return rw.apply()
        types = infer_graph_types(rw.graph)
    except KeelError:
        return rw.apply()
    for add in list(rw.graph.nodes):
        if add.op is Op.ADD and not rw.claimed(add):
            _try(rw, add, types)
    return rw.apply()


def _try(rw: Rewriter, add: Node, types: dict[str, TensorType | None]) -> None:
    # Prefer the operand made last: the other is then surely defined before the fused node.
    candidates = sorted(
        (k for k in (0, 1) if rw.made_by(add.inputs[k], Op.CONV) is not None),
        key=lambda k: -rw.index[id(rw.producer[add.inputs[k]])],
    )
    for k in candidates:
        conv = rw.producer[add.inputs[k]]
        residual = add.inputs[1 - k]
        if conv.attr("activation", "") or conv.input(3) or not rw.only_use(conv.outputs[0], add):
            continue
        if residual == conv.outputs[0] or not _same_shape(types.get(conv.outputs[0]),
                                                          types.get(residual)):
            continue
        bias = conv.input(2)
        inputs = [conv.inputs[0], conv.inputs[1], bias, residual]
        rw.replace([conv, add], [Node(conv.name, Op.CONV, inputs, [add.outputs[0]],
                                      dict(conv.attrs), f"{conv.origin or 'Conv'}+Add")])
        return


def _same_shape(y: TensorType | None, z: TensorType | None) -> bool:
    if y is None or z is None or y.shape is None or z.shape is None or y.dtype != z.dtype:
        return False
    return len(y.shape) == len(z.shape) and all(
        a == b and a is not None for a, b in zip(y.shape, z.shape, strict=True)
    )
