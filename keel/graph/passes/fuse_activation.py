"""Activation fusion into the epilogue of Conv, Gemm and MatMul.

``act(conv(x))`` becomes one CONV node with ``activation``/``activation_params``
attributes (the fused-epilogue contract in ``keel.ops.epilogue``), and the same
for GEMM and MATMUL: the activation runs on the output while it is still in
cache instead of in a second pass over memory. ``x * sigmoid(x)`` fuses as
``silu``.
"""

from __future__ import annotations

import numpy as np

from keel.graph.ir import Graph, Node
from keel.graph.passes._rewrite import Rewriter, const_scalar, schema_has
from keel.ops.registry import Op

__all__ = ["FUSABLE", "fuse_activation"]

FUSABLE = (Op.CONV, Op.GEMM, Op.MATMUL)


def fuse_activation(graph: Graph) -> Graph:
    """A copy of ``graph`` with single-use activations folded into their producers."""
    rw = Rewriter(graph.copy())
    ops = {op for op in FUSABLE if schema_has(op, "activation")}
    for node in list(rw.graph.nodes):
        if node.op in ops and not rw.claimed(node) and not node.attr("activation", ""):
            _try(rw, node)
    return rw.apply()


def _try(rw: Rewriter, producer: Node) -> None:
    out = producer.outputs[0]
    users = rw.uses(out)
    if out in rw.outputs or not users:
        return
    if len(users) == 1 and users[0].inputs.count(out) == 1:
        act = _activation(rw, users[0])
        if act is not None and not rw.claimed(users[0]):
            _fuse(rw, producer, [users[0]], users[0].outputs[0], act)
        return
    silu = _silu(rw, producer, users)
    if silu is not None:
        _fuse(rw, producer, silu, silu[-1].outputs[0], ("silu", ()))


def _fuse(rw: Rewriter, producer: Node, pattern: list[Node], out: str,
          act: tuple[str, tuple[float, ...]]) -> None:
    attrs = dict(producer.attrs)
    attrs["activation"], attrs["activation_params"] = act
    origin = "+".join(n.origin or n.op.value for n in (producer, *pattern))
    fused = Node(producer.name, producer.op, list(producer.inputs), [out], attrs, origin)
    rw.replace([producer, *pattern], [fused])


def _activation(rw: Rewriter, node: Node) -> tuple[str, tuple[float, ...]] | None:
    """The epilogue name and parameters equivalent to ``node``, if there is one."""
    simple = {Op.RELU: "relu", Op.SIGMOID: "sigmoid", Op.TANH: "tanh",
              Op.HARD_SWISH: "hard_swish"}
    if node.op in simple:
        return simple[node.op], ()
    if node.op is Op.LEAKY_RELU:
        return "leaky_relu", (float(node.attr("alpha", 0.01)),)
    if node.op is Op.HARD_SIGMOID:
        return "hard_sigmoid", (float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5)))
    if node.op is Op.GELU:
        return ("gelu_tanh" if node.attr("approximate", "none") == "tanh" else "gelu"), ()
    if node.op is Op.SWISH and float(node.attr("alpha", 1.0)) == 1.0:
        return "silu", ()
    if node.op is Op.CLIP:
        return _clip(rw, node)
    return None


def _clip(rw: Rewriter, node: Node) -> tuple[str, tuple[float, ...]] | None:
    bounds = []
    for k, key, default in ((1, "min", -np.inf), (2, "max", np.inf)):
        if node.input(k):
            value = const_scalar(rw.graph, node.input(k))
            if value is None:
                return None
            bounds.append(value)
        else:
            attr = node.attr(key, None)
            bounds.append(default if attr is None else float(attr))
    return "clip", (bounds[0], bounds[1])


def _silu(rw: Rewriter, producer: Node, users: list[Node]) -> list[Node] | None:
    """``Mul(y, Sigmoid(y))`` where y is read by exactly those two nodes."""
    y = producer.outputs[0]
    if len(users) != 2:
        return None
    sig = next((u for u in users if u.op is Op.SIGMOID), None)
    mul = next((u for u in users if u.op is Op.MUL), None)
    if sig is None or mul is None or rw.claimed(sig) or rw.claimed(mul):
        return None
    s = sig.outputs[0]
    if sorted(mul.inputs) != sorted([y, s]) or not rw.only_use(s, mul):
        return None
    return [sig, mul]
