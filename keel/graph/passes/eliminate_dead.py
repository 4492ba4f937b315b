"""Dead-code elimination: drop nodes and constants no graph output depends on.

Optional outputs nobody reads (beyond the schema's required count) are
dropped too, so kernels need not compute them. Graph inputs always stay:
they are the model's interface, used or not.
"""

from __future__ import annotations

from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.ops.schema import get_schema

__all__ = ["eliminate_dead"]


def eliminate_dead(graph: Graph) -> Graph:
    """A copy of ``graph`` without unreachable nodes, initializers and value types."""
    g = graph.copy()
    live = set(g.output_names)
    kept: list[Node] = []
    for node in reversed(g.nodes):
        if any(o and o in live for o in node.outputs):
            kept.append(node)
            live.update(i for i in node.inputs if i)
    kept.reverse()
    for node in kept:
        _drop_unread_outputs(node, live)
    g.nodes = kept
    inputs = set(g.input_names)
    g.initializers = {k: v for k, v in g.initializers.items() if k in live or k in inputs}
    g.value_types = {k: v for k, v in g.value_types.items() if k in live}
    return g


def _drop_unread_outputs(node: Node, live: set[str]) -> None:
    try:
        required = get_schema(node.op).min_outputs
    except KeelError:
        return
    outs = [o if k < required or o in live else "" for k, o in enumerate(node.outputs)]
    while len(outs) > required and not outs[-1]:
        outs.pop()
    node.outputs = outs
