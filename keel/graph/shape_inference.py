"""Graph-level type and shape inference.

Walks the nodes in order and asks each op's schema for its output types
(``OpSchema.infer``), handing it the *values* of inputs that are known before
running: initializers, and small results computable from them or from static
shapes (``Shape`` of a tensor whose shape is known, ``Gather`` of that, ...).
Those values are what lets ``Reshape(x, Concat(Shape(x)[0], -1))`` get a static
output shape.

Computing a value means running a node, and keel runs nodes in one place: the
executor (``keel.execution``), which is downstream of this stage. So this
module defines what an :class:`Evaluator` is and takes one as an argument;
without one, :func:`default_evaluator` asks keel's root package, which wires in
the executor's (``keel.execution.evaluate.ProgramEvaluator``, every node on the
reference backend). Nothing here imports the executor.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import numpy as np

from keel._fork import renew_after_fork
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, KeelError, UnsupportedOperationError
from keel.graph.ir import Graph, Node, Value
from keel.ops.registry import Op, OpGroup
from keel.ops.schema import get_schema
from keel.ops.types import TensorType, ValueKind

__all__ = [
    "Evaluator",
    "GraphRunner",
    "Propagation",
    "default_evaluator",
    "evaluate_node",
    "infer_graph_types",
    "infer_node",
    "propagate",
    "propagate_node",
]

# Largest constant (in elements) that inference computes to learn shapes; bigger
# results stay unknown values (their types are still inferred).
VALUE_LIMIT = 1 << 16
# Values are computed only for cheap ops (work linear in the output): shape
# arithmetic needs nothing else, and a hostile model cannot make loading slow.
# Control flow may loop for long; sequences and optionals are not arrays.
_NOT_PROPAGATED = (OpGroup.MATMUL_LIKE | OpGroup.CONVOLUTION | OpGroup.POOLING
                   | OpGroup.NORMALIZATION | OpGroup.QUANTIZATION | OpGroup.CONTROL_FLOW
                   | OpGroup.SEQUENCE)


class GraphRunner(Protocol):
    """Runs one graph: ``runner(feeds, observe)`` returns the graph outputs for ``feeds``.

    ``observe`` maps value names to callbacks, each called once per run with
    that value's host array as soon as it is made; the array may be reused by
    later steps, so a callback reads it then and keeps no reference.
    """

    def __call__(self, feeds: Mapping[str, Any],
                 observe: Mapping[str, Callable[[Any], None]] | None = None
                 ) -> dict[str, Any]: ...


# What runs graphs for this stage: ``evaluator(graph)`` prepares a runner of ``graph``.
Evaluator = Callable[[Graph], GraphRunner]


def default_evaluator(backend: str = "reference") -> Evaluator:
    """The executor's evaluator, placing every node on ``backend`` ("reference" or "auto").

    keel's root package wires it in: this stage is upstream of the executor and
    never imports it.
    """
    import keel

    evaluator: Evaluator = keel._graph_evaluator(backend)
    return evaluator


@dataclass
class Propagation:
    """What is known about every value before running: its type and maybe its value."""

    types: dict[str, TensorType | None] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    # Runs the nodes whose values are computed (None: the default, made on first use).
    evaluator: Evaluator | None = field(default=None, repr=False)
    # Output types inferred, by node signature, for nodes with no known input values:
    # a long graph of repeated layers infers each kind of node once.
    inferred: dict[tuple[Any, ...], list[TensorType | None]] = field(default_factory=dict,
                                                                      repr=False)


def infer_graph_types(
    graph: Graph, input_shapes: Mapping[str, Sequence[int | str | None]] | None = None,
    evaluator: Evaluator | None = None,
) -> dict[str, TensorType | None]:
    """The type of every value in ``graph`` (None where it cannot be known).

    ``input_shapes`` overrides the declared shapes of graph inputs (for example
    a concrete batch size); a shape that contradicts the declaration raises
    ``InvalidArgumentError`` naming the input, and so does a node whose inputs
    its schema rejects (naming the node). ``evaluator`` computes the constant
    values shapes depend on (default: :func:`default_evaluator`).
    """
    return propagate(graph, input_shapes, evaluator=evaluator).types


def propagate(
    graph: Graph,
    input_shapes: Mapping[str, Sequence[int | str | None]] | None = None,
    value_limit: int = VALUE_LIMIT,
    evaluator: Evaluator | None = None,
) -> Propagation:
    """Types of every value and the values of small constants, node by node."""
    state = Propagation(evaluator=evaluator)
    for name, arr in graph.initializers.items():
        state.types[name] = _type_of_array(arr)
        if graph.is_constant(name) and arr.size <= value_limit:
            state.values[name] = arr
    for v in graph.inputs:
        state.types[v.name] = _input_type(v.name, v.type, (input_shapes or {}).get(v.name))
    for name in input_shapes or {}:
        if name not in state.types or name not in graph.input_names:
            raise InvalidArgumentError(
                f"input_shapes names {name!r}, which is not a graph input; "
                f"inputs: {', '.join(graph.input_names) or 'none'}"
            )
    for node in graph.nodes:
        propagate_node(node, state, graph.value_types, value_limit)
    return state


def propagate_node(
    node: Node,
    state: Propagation,
    declared: Mapping[str, TensorType] | None = None,
    value_limit: int = VALUE_LIMIT,
) -> None:
    """Add the types (and small known values) of ``node``'s outputs to ``state``.

    ``declared`` holds types the model states for values; they fill in what
    inference leaves unknown.
    """
    declared = declared or {}
    types, known = state.types, state.values
    in_types = [types.get(i) if i else None for i in node.inputs]
    in_values: list[np.ndarray | None] = (
        [known.get(i) if i else None for i in node.inputs] if known else [None] * len(node.inputs))
    valued = any(v is not None for v in in_values)
    if node.op in OpGroup.CONTROL_FLOW:
        out_types = _control_types(node, in_types, state.evaluator)
    else:
        out_types = _inferred(node, in_types, in_values, state, valued)
    for name, t in zip(node.outputs, out_types, strict=False):
        if name:
            types[name] = _merge(t, declared.get(name)) if declared else t
    for name in node.outputs[len(out_types):]:
        if name:
            types[name] = declared.get(name)
    if not valued and node.op not in _SHAPE_VALUED and any(node.inputs):
        return             # an input without a known value: no output value is known
    values = _known_values(node, in_types, in_values, out_types, value_limit, state)
    for name, val in zip(node.outputs, values, strict=False):
        if name and val is not None:
            known[name] = val


# Nodes with more inputs are inferred afresh: a wide fan-in (a Sum of 20,000) seldom repeats,
# and its key would hold a tuple as long as its inputs for the rest of the load.
_MEMO_INPUTS = 64


def _inferred(node: Node, in_types: list[TensorType | None],
              in_values: list[np.ndarray | None], state: Propagation,
              valued: bool) -> list[TensorType | None]:
    """``infer_node``, remembered by signature where no input value is known."""
    if valued or len(in_types) > _MEMO_INPUTS:
        return infer_node(node, in_types, in_values)
    key = (node.op, tuple(in_types), tuple(bool(i) for i in node.inputs), len(node.outputs),
           tuple(sorted(node.attrs.items())))
    try:
        found = state.inferred.get(key)
    except TypeError:                    # an attribute that is not hashable
        return infer_node(node, in_types, in_values)
    if found is None:
        found = state.inferred[key] = infer_node(node, in_types, in_values)
    return found


def _control_types(node: Node, in_types: Sequence[TensorType | None],
                   evaluator: Evaluator | None) -> list[TensorType | None]:
    """Output types of a control-flow node: its subgraphs' output types, each subgraph
    propagated with the types the node's inputs give its formal inputs and captures."""
    from keel.graph.subgraphs import bound_body, subgraphs

    outs: dict[str, list[TensorType | None]] = {}
    for attr, _ in subgraphs(node):
        body = bound_body(node, attr, in_types)
        try:
            types = propagate(body, evaluator=evaluator).types
        except InvalidArgumentError as exc:
            if node.op is Op.IF:        # a branch these shapes do not take may not type
                continue
            raise InvalidArgumentError(
                f"node {node.name!r} ({node.op.value}), subgraph {attr!r}: {exc.message}"
            ) from None
        outs[attr] = [types.get(v.name) or v.type for v in body.outputs]
    return _control_outputs(node, in_types, outs)


def _control_outputs(node: Node, in_types: Sequence[TensorType | None],
                     outs: Mapping[str, list[TensorType | None]]) -> list[TensorType | None]:
    from keel.ops.schemas.control import merge_types

    if node.op is Op.IF:
        if len(outs) < 2:               # one branch did not type: the other's types
            return next(iter(outs.values()), [None] * len(node.outputs))
        return [merge_types(a, b) for a, b in zip(outs["then_branch"], outs["else_branch"],
                                                  strict=False)]
    body = outs["body"]
    if node.op is Op.SEQUENCE_MAP:
        return [None if t is None else TensorType(t.dtype, t.shape, ValueKind.SEQUENCE)
                for t in body]
    if node.op is Op.LOOP:
        carried = len(node.attrs["body"].inputs) - 2
        initial = [in_types[2 + k] if 2 + k < len(in_types) else None for k in range(carried)]
        return [*[merge_types(a, b) for a, b in zip(initial, body[1:1 + carried], strict=True)],
                *[_stack(t, None, 0) for t in body[1 + carried:]]]
    n_scan = int(node.attrs["num_scan_inputs"])
    states = len(node.attrs["body"].inputs) - n_scan
    trip = _scan_trip(node, in_types, states, n_scan)
    axes = list(node.attrs.get("scan_output_axes") or [0] * (len(body) - states))
    return [*[merge_types(a, b) for a, b in zip(in_types[:states], body[:states], strict=True)],
            *[_stack(t, trip, axes[k] if k < len(axes) else 0)
              for k, t in enumerate(body[states:])]]


def _stack(t: TensorType | None, count: int | str | None, axis: int) -> TensorType | None:
    """``t`` stacked ``count`` times along a new axis ``axis``."""
    if t is None or t.shape is None:
        return None if t is None else TensorType(t.dtype, None)
    rank = len(t.shape) + 1
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return TensorType(t.dtype, None)
    return TensorType(t.dtype, (*t.shape[:axis], count, *t.shape[axis:]))


def _scan_trip(node: Node, in_types: Sequence[TensorType | None], states: int,
               n_scan: int) -> int | str | None:
    """The length of the scanned axis, where the first scan input's type gives it."""
    t = in_types[states] if n_scan and states < len(in_types) else None
    axes = list(node.attrs.get("scan_input_axes") or [0])
    if t is None or t.shape is None or not axes:
        return None
    axis = axes[0] + len(t.shape) if axes[0] < 0 else axes[0]
    return t.shape[axis] if 0 <= axis < len(t.shape) else None


def infer_node(
    node: Node,
    in_types: Sequence[TensorType | None],
    in_values: Sequence[np.ndarray | None],
) -> list[TensorType | None]:
    """Output types of one node from its schema; errors name the node."""
    try:
        schema = get_schema(node.op)
    except UnsupportedOperationError:
        return [None] * len(node.outputs)
    try:
        return list(schema.infer_types(list(in_types), node.attrs, list(in_values)))
    except KeelError as exc:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op.value}): {exc.message}"
        ) from None
    except Exception as exc:  # a schema rule tripped on odd input: report, never leak
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op.value}): type inference failed with "
            f"{type(exc).__name__}: {exc}"
        ) from None


# Ops whose output value follows from their input's type alone.
_SHAPE_VALUED = frozenset({Op.SHAPE, Op.SIZE})


def _known_values(
    node: Node,
    in_types: Sequence[TensorType | None],
    in_values: Sequence[np.ndarray | None],
    out_types: Sequence[TensorType | None],
    value_limit: int,
    state: Propagation,
) -> list[np.ndarray | None]:
    if node.op is Op.SHAPE:
        return [_shape_value(node, in_types[0] if in_types else None)]
    if node.op is Op.SIZE:
        t = in_types[0] if in_types else None
        n = t.numel() if t is not None else None
        return [None if n is None else np.array(n, dtype=np.int64)]
    if node.op in _NOT_PROPAGATED:
        return []
    present = [v for i, v in zip(node.inputs, in_values, strict=False) if i]
    if len(present) != len(node.present_inputs()) or any(v is None for v in present):
        return []
    if not _small(out_types, len(node.outputs), value_limit):
        return []
    if state.evaluator is None:
        state.evaluator = default_evaluator()
    return list(evaluate_node(node, list(in_values), state.evaluator) or [])


def _small(out_types: Sequence[TensorType | None], n_out: int, limit: int) -> bool:
    if len(out_types) < n_out:
        return False
    for t in out_types:
        n = None if t is None else t.numel()
        if n is None or n > limit:
            return False
    return True


def evaluate_node(node: Node, inputs: Sequence[np.ndarray | None],
                  evaluator: Evaluator | None = None) -> list[np.ndarray | None] | None:
    """Run ``node`` on NumPy inputs through ``evaluator``; None if that cannot be done.

    The node runs as a graph of its own whose inputs are the given arrays (on
    the reference backend with the default evaluator); nodes alike (op,
    attributes, input dtypes and shapes) share one prepared graph. Used for
    constant values at optimize time. A failing node (invalid for these inputs,
    or an op or dtype nothing runs) gives None, so the error surfaces when the
    model runs, with the node named, instead of here. The result has one entry
    per output of ``node`` (None for an absent one).
    """
    if len(node.inputs) > len(inputs) or not any(node.outputs):
        return None
    feeds: dict[str, np.ndarray] = {}
    alias: dict[str, str] = {}                  # the node's input name -> its graph input
    for name, value in zip(node.inputs, inputs, strict=False):
        if name and name not in alias:
            if value is None:
                return None
            alias[name] = f"x{len(alias)}"
            feeds[alias[name]] = np.asarray(value)
    lone = Node(node.name, node.op, [alias.get(i, "") for i in node.inputs],
                [f"y{k}" if o else "" for k, o in enumerate(node.outputs)], node.attrs)
    run = _runner(lone, feeds, evaluator or default_evaluator())
    if run is None:
        return None
    try:
        outs = run(feeds)
    except Exception:       # the node cannot run on these inputs: it fails when the model runs
        return None
    return [np.asarray(outs[o]) if o else None for o in lone.outputs]


# Prepared one-node graphs, by evaluator and node signature (most recently used last).
_RUNNERS: collections.OrderedDict[tuple[Any, ...], GraphRunner] = collections.OrderedDict()
_RUNNERS_KEPT = 256
_RUNNERS_LOCK = threading.Lock()
renew_after_fork(sys.modules[__name__], "_RUNNERS_LOCK")   # free in a forked child


def _runner(node: Node, feeds: Mapping[str, np.ndarray],
            evaluator: Evaluator) -> GraphRunner | None:
    """A runner of ``node`` alone, fed ``feeds``; shared by nodes alike when their
    attributes can be compared exactly."""
    attrs = _attrs_key(node.attrs)
    key: tuple[Any, ...] | None = None if attrs is None else (
        evaluator, node.op, attrs, tuple(node.inputs), tuple(node.outputs),
        tuple((a.dtype.str, a.shape) for a in feeds.values()))
    if key is not None:
        with _RUNNERS_LOCK:
            run = _RUNNERS.get(key)
            if run is not None:
                _RUNNERS.move_to_end(key)
                return run
    graph = _node_graph(node, feeds)
    if graph is None:
        return None
    run = evaluator(graph)
    if key is not None:
        with _RUNNERS_LOCK:
            _RUNNERS[key] = run
            while len(_RUNNERS) > _RUNNERS_KEPT:
                _RUNNERS.popitem(last=False)
    return run


def _node_graph(node: Node, feeds: Mapping[str, np.ndarray]) -> Graph | None:
    """``node`` alone in a graph whose inputs are ``feeds``."""
    inputs = {}
    for name, array in feeds.items():
        t = _type_of_array(array)
        if t is None:
            return None
        inputs[name] = Value(name, t)
    try:
        inferred = infer_node(node, [inputs[i].type if i else None for i in node.inputs],
                              [None] * len(node.inputs))
    except KeelError:
        return None
    inferred += [None] * (len(node.outputs) - len(inferred))
    outputs = [Value(o, t if t is not None else TensorType(DType.FLOAT32, None))
               for o, t in zip(node.outputs, inferred, strict=False) if o]
    return Graph(f"{node.name}:value", [node], list(inputs.values()), outputs)


def _attrs_key(attrs: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """``attrs`` as a hashable key that tells apart every two that differ, or None."""
    try:
        return tuple(sorted((k, _frozen(v)) for k, v in attrs.items()))
    except TypeError:
        return None


def _frozen(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_frozen(v) for v in value)
    if isinstance(value, (float, np.floating)):
        return "float", repr(float(value))          # tells 0.0 from -0.0
    if value is None or isinstance(value, (bool, int, str, Enum, np.integer, np.bool_)):
        return type(value).__name__, value
    raise TypeError(f"no exact key for a {type(value).__name__}")


def _shape_value(node: Node, t: TensorType | None) -> np.ndarray | None:
    if t is None or not t.is_static or t.shape is None:
        return None
    dims = [int(d) for d in t.shape]  # type: ignore[arg-type]
    start, end = _shape_bounds(node, len(dims))
    return np.array(dims[start:end], dtype=np.int64)


def _shape_bounds(node: Node, rank: int) -> tuple[int, int]:
    """ONNX Shape's ``start``/``end`` (clamped into [0, rank])."""
    start = int(node.attr("start", 0))
    end_attr = node.attr("end", None)
    end = rank if end_attr is None else int(end_attr)
    start = start + rank if start < 0 else start
    end = end + rank if end < 0 else end
    return min(max(start, 0), rank), min(max(end, 0), rank)


def _input_type(
    name: str, declared: TensorType, given: Sequence[int | str | None] | None
) -> TensorType:
    if given is None or not declared.is_tensor:
        return declared
    shape = tuple(given)
    if declared.shape is not None:
        if len(shape) != len(declared.shape):
            raise InvalidArgumentError(
                f"input {name!r} is declared with rank {len(declared.shape)} "
                f"{_fmt(declared.shape)}, got rank {len(shape)} {_fmt(shape)}"
            )
        for want, got in zip(declared.shape, shape, strict=True):
            if isinstance(want, int) and isinstance(got, int) and want != got:
                raise InvalidArgumentError(
                    f"input {name!r} is declared with shape {_fmt(declared.shape)}, "
                    f"got {_fmt(shape)}"
                )
    for d in shape:
        if isinstance(d, int) and d < 0:
            raise InvalidArgumentError(f"input {name!r} shape {_fmt(shape)} has a negative dim")
    return TensorType(declared.dtype, shape)


def _merge(inferred: TensorType | None, declared: TensorType | None) -> TensorType | None:
    """Inferred types win; the model's declaration fills what inference left unknown."""
    if inferred is None:
        return declared
    if declared is None or declared is inferred or declared.shape is None or \
            declared.dtype != inferred.dtype:
        return inferred
    if inferred.shape is None:
        return TensorType(inferred.dtype, declared.shape, inferred.kind)
    if len(inferred.shape) != len(declared.shape) or None not in inferred.shape:
        return inferred
    dims = tuple(d if d is not None else e for d, e in zip(inferred.shape, declared.shape,
                                                          strict=True))
    # a type per value and round adds up in a large graph: the inferred one where it is equal
    return inferred if dims == inferred.shape else TensorType(inferred.dtype, dims,
                                                              inferred.kind)


def _type_of_array(arr: np.ndarray) -> TensorType | None:
    try:
        return TensorType(DType.from_numpy(arr.dtype), tuple(int(d) for d in arr.shape))
    except KeelError:
        return None


def _fmt(shape: Sequence[Any]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
