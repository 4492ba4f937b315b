"""Identity removal: Identity nodes (and inference-time Dropout, imported as
Identity) and casts to the type a value already has disappear; readers of
their output read their input instead.

When the output is a graph output its name must survive, so the producer of
the input is renamed to it instead, when that is possible (the input is made
by a node and is not itself a graph output); otherwise the node stays.
"""

from __future__ import annotations

from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["remove_identity"]


def remove_identity(graph: Graph) -> Graph:
    """A copy of ``graph`` without removable Identity/no-op Cast nodes."""
    g = graph.copy()
    types = _types(g)
    alias: dict[str, str] = {}
    producer = g.producers()
    outputs = set(g.output_names)
    fixed = set(g.input_names) | set(g.initializers)
    kept: list[Node] = []
    for node in g.nodes:
        node.inputs = [_resolve(alias, i) if i else i for i in node.inputs]
        if _is_noop(node, types):
            x, y = node.inputs[0], node.outputs[0]
            if y not in outputs:
                alias[y] = x
                continue
            prod = producer.get(x)
            if prod is not None and x not in outputs and x not in fixed:
                prod.outputs = [y if o == x else o for o in prod.outputs]
                producer[y] = prod
                alias[x] = y
                continue
        kept.append(node)
    for node in kept:  # readers of a renamed value that came before the Identity
        node.inputs = [_resolve(alias, i) if i else i for i in node.inputs]
    g.nodes = kept
    return g


def _resolve(alias: dict[str, str], name: str) -> str:
    while name in alias:
        name = alias[name]
    return name


def _is_noop(node: Node, types: dict[str, TensorType | None]) -> bool:
    if len(node.present_inputs()) != 1 or len(node.outputs) != 1 or not node.inputs[0]:
        return False
    if node.op is Op.IDENTITY:
        return True
    if node.op is Op.CAST:
        t = types.get(node.inputs[0])
        return t is not None and t.dtype == node.attr("to")
    return False


def _types(g: Graph) -> dict[str, TensorType | None]:
    try:
        return infer_graph_types(g)
    except KeelError:
        return {}
