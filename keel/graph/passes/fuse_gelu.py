"""GELU pattern fusion, exact (erf) and tanh forms.

* erf:  ``0.5 * x * (1 + erf(x / sqrt(2)))`` (``x / 1.414…`` or ``x * 0.707…``)
* tanh: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``
  (``x^3`` as ``Pow(x, 3)`` or ``x * x * x``)

The final ``0.5 * x * (1 + …)`` is matched in any association exporters
produce. The result is one GELU node (``approximate`` "none" or "tanh").
"""

from __future__ import annotations

import math

from keel.graph.ir import Graph, Node
from keel.graph.passes._rewrite import Rewriter, const_scalar, make_attrs
from keel.ops.registry import Op

__all__ = ["fuse_gelu"]

_TOL = 1e-3


def fuse_gelu(graph: Graph) -> Graph:
    """A copy of ``graph`` with GELU subgraphs fused into GELU nodes."""
    rw = Rewriter(graph.copy())
    for node in list(rw.graph.nodes):
        if node.op in (Op.ERF, Op.TANH) and not rw.claimed(node):
            _try(rw, node)
    return rw.apply()


def _near(value: float | None, target: float) -> bool:
    return value is not None and abs(value - target) <= _TOL * abs(target)


def _other(node: Node, value: str) -> str:
    return node.inputs[1] if node.inputs[0] == value else node.inputs[0]


def _try(rw: Rewriter, core: Node) -> None:
    head = _erf_arg(rw, core) if core.op is Op.ERF else _tanh_arg(rw, core)
    if head is None:
        return
    x, front = head
    add = rw.single_consumer(core.outputs[0])
    if add is None or add.op is not Op.ADD or not _near(
            const_scalar(rw.graph, _other(add, core.outputs[0])), 1.0):
        return
    tail = _half_x_times(rw, add.outputs[0], x)
    if tail is None:
        return
    attrs = make_attrs(Op.GELU, {"approximate": "none" if core.op is Op.ERF else "tanh"})
    if attrs is None:
        return
    pattern = [*front, core, add, *tail]
    out = max(tail, key=lambda n: rw.index[id(n)]).outputs[0]
    rw.replace(pattern, [Node(core.name, Op.GELU, [x], [out], attrs, origin="GELU pattern")])


def _erf_arg(rw: Rewriter, erf: Node) -> tuple[str, list[Node]] | None:
    """``x / sqrt(2)`` or ``x * (1 / sqrt(2))`` feeding the Erf."""
    scaled = rw.made_by(erf.inputs[0], Op.DIV, Op.MUL)
    if scaled is None or not rw.only_use(erf.inputs[0], erf):
        return None
    if scaled.op is Op.DIV:
        ok = _near(const_scalar(rw.graph, scaled.inputs[1]), math.sqrt(2.0))
        return (scaled.inputs[0], [scaled]) if ok else None
    for x, c in (scaled.inputs, scaled.inputs[::-1]):
        if _near(const_scalar(rw.graph, c), 1 / math.sqrt(2.0)):
            return x, [scaled]
    return None


def _tanh_arg(rw: Rewriter, tanh: Node) -> tuple[str, list[Node]] | None:
    """``sqrt(2/pi) * (x + 0.044715 * x^3)`` feeding the Tanh."""
    outer = rw.made_by(tanh.inputs[0], Op.MUL)
    if outer is None or not rw.only_use(tanh.inputs[0], tanh):
        return None
    for inner_name, c in (outer.inputs, outer.inputs[::-1]):
        if not _near(const_scalar(rw.graph, c), math.sqrt(2 / math.pi)):
            continue
        inner = rw.made_by(inner_name, Op.ADD)
        if inner is None or not rw.only_use(inner_name, outer):
            continue
        for x, cubic_term in (inner.inputs, inner.inputs[::-1]):
            cube = _cubic(rw, cubic_term, x, inner)
            if cube is not None:
                return x, [*cube, inner, outer]
    return None


def _cubic(rw: Rewriter, term: str, x: str, reader: Node) -> list[Node] | None:
    """``0.044715 * x^3`` with ``x^3`` as ``Pow(x, 3)``, ``x * (x * x)`` or ``(x * x) * x``."""
    mul = rw.made_by(term, Op.MUL)
    if mul is None or not rw.only_use(term, reader):
        return None
    for cube_name, c in (mul.inputs, mul.inputs[::-1]):
        if not _near(const_scalar(rw.graph, c), 0.044715):
            continue
        power = rw.made_by(cube_name, Op.POW, Op.MUL)
        if power is None or not rw.only_use(cube_name, mul):
            continue
        if power.op is Op.POW and power.inputs[0] == x and \
                const_scalar(rw.graph, power.inputs[1]) == 3.0:
            return [power, mul]
        if power.op is Op.MUL and x in power.inputs:
            sq_name = _other(power, x)
            square = rw.made_by(sq_name, Op.MUL)
            if square is not None and square.inputs == [x, x] and rw.only_use(sq_name, power):
                return [square, power, mul]
    return None


def _half_x_times(rw: Rewriter, s: str, x: str) -> list[Node] | None:
    """The nodes computing ``0.5 * x * s`` from ``s``, in any association."""
    m1 = rw.single_consumer(s)
    if m1 is None or m1.op is not Op.MUL or rw.claimed(m1):
        return None
    other = _other(m1, s)
    if other == x:                                  # (x * s) * 0.5
        m2 = rw.single_consumer(m1.outputs[0])
        if m2 is not None and m2.op is Op.MUL and \
                _near(const_scalar(rw.graph, _other(m2, m1.outputs[0])), 0.5):
            return [m1, m2]
        return None
    if _near(const_scalar(rw.graph, other), 0.5):    # x * (s * 0.5)
        m2 = rw.single_consumer(m1.outputs[0])
        if m2 is not None and m2.op is Op.MUL and _other(m2, m1.outputs[0]) == x:
            return [m1, m2]
        return None
    half = rw.made_by(other, Op.MUL)                 # (x * 0.5) * s
    if half is not None and x in half.inputs and rw.only_use(other, m1) and \
            _near(const_scalar(rw.graph, _other(half, x)), 0.5):
        return [half, m1]
    return None
