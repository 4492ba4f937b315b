"""Transpose chains: ``Transpose(Transpose(x, p), q)`` is one Transpose, or none.

Exporters often leave layout round trips (NCHW → NHWC → NCHW) around ops
that were moved or fused away; composing the permutations removes them.
"""

from __future__ import annotations

from keel.graph.ir import Graph, Node
from keel.graph.passes._rewrite import Rewriter
from keel.ops.registry import Op

__all__ = ["cancel_transposes"]


def cancel_transposes(graph: Graph) -> Graph:
    """A copy of ``graph`` with consecutive Transposes composed (identity ones removed)."""
    rw = Rewriter(graph.copy())
    for outer in list(rw.graph.nodes):
        if outer.op is Op.TRANSPOSE and not rw.claimed(outer):
            _try(rw, outer)
    return rw.apply()


def _try(rw: Rewriter, outer: Node) -> None:
    inner = rw.made_by(outer.inputs[0], Op.TRANSPOSE)
    if inner is None or not rw.only_use(inner.outputs[0], outer):
        return
    p, q = inner.attr("perm", None), outer.attr("perm", None)
    if p is None or q is None or len(p) != len(q) or sorted(p) != list(range(len(p))):
        return  # without explicit perms the rank (and so the reversal) is unknown here
    composed = tuple(p[i] for i in q)
    x, y = inner.inputs[0], outer.outputs[0]
    if composed == tuple(range(len(composed))):
        new = Node(outer.name, Op.IDENTITY, [x], [y], {}, origin="Transpose∘Transpose")
    else:
        new = Node(outer.name, Op.TRANSPOSE, [x], [y], {**outer.attrs, "perm": composed},
                   origin="Transpose∘Transpose")
    rw.replace([inner, outer], [new])
