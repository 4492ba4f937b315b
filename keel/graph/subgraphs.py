"""Subgraphs of control-flow nodes: where they are, what they capture, how they run.

A control-flow node (``OpGroup.CONTROL_FLOW``) holds its subgraphs as attributes.
Each subgraph is a :class:`~keel.graph.ir.Graph` whose ``inputs`` are its formal
inputs (Loop's iteration number and condition and carried values, Scan's states
and slices, none for If) and whose nodes may read values of the enclosing graph.
Those values are the node's *captures*: the node lists them explicitly as its
last inputs and attribute ``captures`` names them as the subgraph reads them,
so every pass, the memory plan and dead-code elimination see the use, and a
pass renaming the outer value leaves the subgraph untouched (the i-th capture
binds the node's i-th captured input when it runs).

:func:`executable` gives the graph that is planned and compiled for a body:
the subgraph with its captures as extra inputs after the formal ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.graph.ir import Graph, Node, Value
from keel.ops.registry import Op
from keel.ops.types import TensorType, ValueKind

__all__ = [
    "SUBGRAPH_ATTRS",
    "captured_inputs",
    "captures",
    "executable",
    "formal_types",
    "bound_body",
    "capture_types",
    "free_names",
    "subgraphs",
    "walk",
]

SUBGRAPH_ATTRS: dict[Op, tuple[str, ...]] = {
    Op.IF: ("then_branch", "else_branch"),
    Op.LOOP: ("body",),
    Op.SCAN: ("body",),
    Op.SEQUENCE_MAP: ("body",),
}


def subgraphs(node: Node) -> list[tuple[str, Graph]]:
    """``(attribute, subgraph)`` of each subgraph ``node`` holds (none for other ops)."""
    return [(a, node.attrs[a]) for a in SUBGRAPH_ATTRS.get(node.op, ())
            if isinstance(node.attrs.get(a), Graph)]


def walk(graph: Graph, prefix: str = "") -> Iterator[tuple[str, Graph]]:
    """Every subgraph nested in ``graph``, as ``("node/attr", subgraph)``, depth first."""
    for node in graph.nodes:
        for attr, body in subgraphs(node):
            path = f"{prefix}{node.name}/{attr}"
            yield path, body
            yield from walk(body, path + "/")


def captures(node: Node) -> tuple[str, ...]:
    """The names the subgraphs of ``node`` read from the enclosing graph."""
    return tuple(node.attrs.get("captures") or ())


def captured_inputs(node: Node) -> list[str]:
    """The node inputs that bind its captures (its last ``len(captures)`` inputs)."""
    n = len(captures(node))
    return list(node.inputs[len(node.inputs) - n:]) if n else []


def free_names(graph: Graph) -> list[str]:
    """Names ``graph`` reads that it does not define (from the enclosing scope), in order."""
    defined = set(graph.initializers) | set(graph.input_names)
    free: list[str] = []
    for node in graph.nodes:
        for name in node.inputs:
            if name and name not in defined and name not in free:
                free.append(name)
        defined.update(o for o in node.outputs if o)
    for name in graph.output_names:
        if name not in defined and name not in free:
            free.append(name)
    return free


def executable(body: Graph, names: Sequence[str],
               types: Sequence[TensorType | None]) -> Graph:
    """``body`` with captures ``names`` (typed ``types``) as inputs after its formal ones."""
    inputs = list(body.inputs)
    taken = set(body.input_names)
    for name, t in zip(names, types, strict=True):
        if name in taken:
            continue
        taken.add(name)
        inputs.append(Value(name, t if t is not None else TensorType(DType.FLOAT32, None)))
    return Graph(body.name, body.nodes, inputs, list(body.outputs), body.initializers,
                 body.value_types, body.opset, body.metadata)


def formal_types(node: Node, attr: str, body: Graph,
                 in_types: Sequence[TensorType | None]) -> list[TensorType | None]:
    """The types the formal inputs of ``node``'s subgraph ``attr`` take on the first run,
    from the node's input types (the body's declared types where the node gives none)."""
    declared: list[TensorType | None] = [v.type for v in body.inputs]
    given: list[TensorType | None]
    if node.op is Op.IF:
        given = []
    elif node.op is Op.LOOP:
        carried = len(declared) - 2
        given = [TensorType(DType.INT64, ()), TensorType(DType.BOOL, ()),
                 *[_at(in_types, 2 + k) for k in range(carried)]]
    elif node.op is Op.SCAN:
        given = _scan_formal(node, declared, in_types)
    else:                                       # SequenceMap: elements of sequences
        given = [None if t is None else (t.element() if t.kind is ValueKind.SEQUENCE else t)
                 for t in (_at(in_types, k) for k in range(len(declared)))]
    return [g if g is not None else d for g, d in zip(given, declared, strict=False)] + \
        declared[len(given):]


def _scan_formal(node: Node, declared: list[TensorType | None],
                 in_types: Sequence[TensorType | None]) -> list[TensorType | None]:
    n_scan = int(node.attrs["num_scan_inputs"])
    states = len(declared) - n_scan
    if states < 0:
        raise InvalidArgumentError(f"node {node.name!r} (Scan): the body has fewer inputs "
                                   f"than num_scan_inputs={n_scan}")
    axes = list(node.attrs.get("scan_input_axes") or [0] * n_scan)
    result: list[TensorType | None] = [_at(in_types, k) for k in range(states)]
    for j in range(n_scan):
        t = _at(in_types, states + j)
        if t is None or t.shape is None or j >= len(axes):
            result.append(None)
            continue
        axis = axes[j] + len(t.shape) if axes[j] < 0 else axes[j]
        if not 0 <= axis < len(t.shape):
            result.append(None)
            continue
        result.append(TensorType(t.dtype, t.shape[:axis] + t.shape[axis + 1:]))
    return result


def _at(types: Sequence[TensorType | None], k: int) -> TensorType | None:
    return types[k] if k < len(types) else None


def capture_types(node: Node, in_types: Sequence[TensorType | None]
                  ) -> list[TensorType | None]:
    """The types of ``node``'s captured inputs."""
    n = len(captures(node))
    return list(in_types[len(in_types) - n:]) if n else []


def bound_body(node: Node, attr: str, in_types: Sequence[TensorType | None]) -> Graph:
    """The executable graph of subgraph ``attr`` for a run of ``node`` whose inputs have
    ``in_types``: formal inputs and captures typed as that run feeds them."""
    body = node.attrs[attr]
    names = captures(node)
    cap_types = capture_types(node, in_types)
    graph = executable(body, names, cap_types)
    bound = dict(zip(names, cap_types, strict=True))
    for v, t in zip(body.inputs, formal_types(node, attr, body, in_types), strict=False):
        bound[v.name] = t
    graph.inputs = [Value(v.name, _typed(bound.get(v.name), v.type)) for v in graph.inputs]
    return graph


def _typed(given: TensorType | None, declared: TensorType) -> TensorType:
    """``given`` where it is known and agrees in rank with the declaration, else declared."""
    if given is None:
        return declared
    if declared.shape is not None and given.shape is not None and \
            len(declared.shape) != len(given.shape):
        return declared
    return given
