"""Subgraphs as compiled bodies: how control-flow nodes run their branches and loops.

When a program is compiled, each subgraph of a control-flow node (If's branches,
Loop's, Scan's and SequenceMap's body) becomes a :class:`CompiledBody`, which the
node's kernel finds in its attributes and calls once per branch taken or per
iteration. A body is the subgraph with its captures as extra inputs
(:func:`keel.graph.subgraphs.bound_body`), placed and compiled into a
:class:`~keel.execution.program.Program` like any graph:

- for the signature the enclosing plan already knows (the types shape inference
  gave the body's inputs), at load, with the plan ``planning.place`` made for it
  (``ExecutionPlan.subplans``);
- for any other signature (a loop-carried value that changes shape, a sequence
  element), on first use, then kept: a loop whose values keep their shapes
  compiles its body once, not per iteration. Past ``KEPT_SIGNATURES`` different
  signatures the body compiles once more for inputs of unknown dimensions and runs
  every further signature on that program.

Each body has its own arena pool: the enclosing program's arena views stay live
while a body runs.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.graph.ir import Graph, Node, Value
from keel.graph.shape_inference import infer_graph_types
from keel.graph.subgraphs import bound_body, subgraphs
from keel.ops.types import TensorType, ValueKind
from keel.planning.placement import ExecutionPlan, place

__all__ = ["KEPT_SIGNATURES", "CompiledBody", "bind_bodies"]

# Programs kept per body, one per input signature, before it falls back to one
# program compiled for unknown dimensions.
KEPT_SIGNATURES = 8

_Key = tuple[Any, ...]


def bind_bodies(node: Node, types: Mapping[str, TensorType | None], plan: ExecutionPlan,
                registry: Any, pool: Any = None) -> dict[str, Any]:
    """``node``'s attributes with each subgraph replaced by its :class:`CompiledBody`;
    ``pool``: the enclosing program's arenas, whose memory limit the bodies keep."""
    in_types = [types.get(i) if i else None for i in node.inputs]
    attrs = dict(node.attrs)
    for attr, _ in subgraphs(node):
        graph = bound_body(node, attr, in_types)
        attrs[attr] = CompiledBody(graph, registry, plan.backend, plan.precision,
                                   plan.subplans.get(f"{node.name}/{attr}"), pool)
    return attrs


class CompiledBody:
    """One subgraph, compiled per input signature; called with its input values in order
    (formal inputs, then captures), it returns its outputs in order."""

    def __init__(self, graph: Graph, registry: Any, backend: str, precision: str,
                 plan: ExecutionPlan | None = None, parent: Any = None) -> None:
        from keel.execution.program import ArenaPool

        self.graph = graph
        self.n_outputs = len(graph.outputs)
        self.compiles = 0                  # how many programs were compiled (for tests)
        self._registry = registry
        self._backend = backend
        self._precision = precision
        self._pool = ArenaPool()
        self._parent = parent              # the enclosing pool: its memory limit holds here
        self._programs: collections.OrderedDict[_Key, Any] = collections.OrderedDict()
        self._dynamic: Any = None
        self._names = [v.name for v in graph.outputs]
        if plan is not None and all(v.type.is_static or not v.type.is_tensor
                                    for v in graph.inputs):
            key = tuple(_type_key(v.type) for v in graph.inputs)
            self._programs[key] = self._compile(graph, plan)

    def output_type(self, index: int) -> TensorType | None:
        return self.graph.outputs[index].type

    def __call__(self, values: Sequence[Any]) -> list[Any]:
        values = [_contiguous(v) for v in values]
        key = tuple(_value_key(v) for v in values)
        program = self._programs.get(key)
        if program is None:
            program = self._program_for(key, values)
        if self._parent is not None:       # a limit set on the model after compiling
            self._pool.limit = self._parent.limit
        result = program.execute(values)
        return [result[name] for name in self._names]

    def _program_for(self, key: _Key, values: Sequence[Any]) -> Any:
        if len(self._programs) >= KEPT_SIGNATURES:
            if self._dynamic is None:
                self._dynamic = self._compile(self._typed(values, dynamic=True), dynamic=True)
            return self._dynamic
        program = self._programs[key] = self._compile(self._typed(values))
        return program

    def _typed(self, values: Sequence[Any], dynamic: bool = False) -> Graph:
        """The body with its inputs typed as ``values`` are."""
        inputs = [Value(v.name, _type_of(value, v.type, dynamic))
                  for v, value in zip(self.graph.inputs, values, strict=True)]
        g = self.graph
        return Graph(g.name, g.nodes, inputs, list(g.outputs), g.initializers, g.value_types,
                     g.opset, g.metadata)

    def _compile(self, graph: Graph, plan: ExecutionPlan | None = None,
                 dynamic: bool = False) -> Any:
        from keel.backends.registry import default_registry
        from keel.execution.program import compile_program

        registry = self._registry if self._registry is not None else default_registry()
        types = infer_graph_types(graph)
        if plan is None:
            plan = place(graph, types, registry, backend=self._backend,
                         precision=self._precision)
        backends = {name: registry.get(name) for name in plan.backends}
        self.compiles += 1
        return compile_program(graph, plan, types, backends, self._pool, registry=registry,
                               dynamic=dynamic)

    def __repr__(self) -> str:
        return f"<CompiledBody {self.graph.name!r}: {len(self._programs)} signatures>"


def _contiguous(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.ndim and not value.flags.c_contiguous:
        return np.ascontiguousarray(value)
    return value


def _value_key(value: Any) -> Any:
    if value is None:
        return None
    if type(value) is list:
        return ("seq", value[0].dtype.str if value else None)
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    return arr.shape, arr.dtype.str


def _type_key(t: TensorType) -> Any:
    if t.kind is ValueKind.SEQUENCE:
        return ("seq", t.dtype.numpy.str)
    if not t.is_tensor:
        return None
    return tuple(int(d) for d in t.shape or () if isinstance(d, int)), t.dtype.numpy.str


def _type_of(value: Any, declared: TensorType, dynamic: bool) -> TensorType:
    """The type ``value`` has as an input of the body (``declared``: the subgraph's)."""
    if value is None:
        return declared
    if type(value) is list:
        dtype = DType.from_numpy(value[0].dtype) if value else declared.dtype
        return TensorType(dtype, None, ValueKind.SEQUENCE)
    arr = np.asarray(value)
    dtype = DType.from_numpy(arr.dtype)
    if dynamic:
        return TensorType(dtype, tuple([None] * arr.ndim))
    return TensorType(dtype, tuple(int(d) for d in arr.shape))
