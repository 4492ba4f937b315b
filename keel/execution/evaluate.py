"""The executor as the graph stage's evaluator: run a graph, get values back.

Shape inference (constant values that decide shapes), constant folding and
quantization's calibration all need to run a graph, or one node of it, on
NumPy arrays. They do so through :class:`ProgramEvaluator`: the graph is
placed by ``planning.place`` and compiled by ``compile_program`` into the same
:class:`~keel.execution.program.Program` that runs inference, once per input
signature, and run with :meth:`Program.run`. There is no second interpreter.

The graph stage sits upstream of this module and never imports it: it defines
what an evaluator is (``keel.graph.shape_inference.Evaluator``) and takes one
as an argument; without one it asks keel's root package, which wires this
module in (:func:`default_evaluator`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from keel._fork import renew_after_fork
from keel.backends.registry import BackendRegistry, default_registry
from keel.errors import InvalidArgumentError
from keel.execution.program import Observer, Program, compile_program
from keel.graph.ir import Graph
from keel.graph.shape_inference import infer_graph_types
from keel.ops.types import TensorType
from keel.planning.placement import place

__all__ = ["GraphProgram", "ProgramEvaluator", "default_evaluator"]


class ProgramEvaluator:
    """Runs graphs as inference does: placed on ``backend`` of ``registry``, compiled, run.

    ``backend="reference"`` (the default) runs every node on the executable
    spec, which is what shape inference and constant folding want: exact
    values, every op and dtype. ``backend="auto"`` places nodes as a loaded
    model does (quantization's calibration runs so).
    """

    def __init__(self, registry: BackendRegistry | None = None,
                 backend: str = "reference") -> None:
        self.registry = registry if registry is not None else default_registry()
        self.backend = backend

    def __call__(self, graph: Graph) -> GraphProgram:
        """A runner of ``graph`` that compiles one program per input signature."""
        return GraphProgram(graph, self)

    def __repr__(self) -> str:
        return f"ProgramEvaluator(backend={self.backend!r})"


class GraphProgram:
    """One graph, run on feeds; its programs, one per input signature, are kept."""

    def __init__(self, graph: Graph, evaluator: ProgramEvaluator) -> None:
        self.graph = graph
        self.evaluator = evaluator
        self.programs: dict[tuple[Any, ...], Program] = {}
        self._lock = threading.Lock()           # a program runs one call at a time
        renew_after_fork(self, "_lock")

    def __call__(self, feeds: Mapping[str, Any],
                 observe: Mapping[str, Observer] | None = None) -> dict[str, Any]:
        """The graph outputs for ``feeds``; ``observe`` as in :meth:`Program.run`."""
        arrays = {name: np.asarray(value) for name, value in feeds.items()}
        with self._lock:
            return self.program(arrays).run(arrays, observe=observe)

    def program(self, feeds: Mapping[str, np.ndarray]) -> Program:
        """The program compiled for the signature of ``feeds`` (made on first use)."""
        shapes = {name: tuple(int(d) for d in a.shape) for name, a in feeds.items()
                  if name in self.graph.input_names}
        key = tuple(sorted((name, shape, feeds[name].dtype.str)
                           for name, shape in shapes.items()))
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = self._compile(shapes)
        return program

    def _compile(self, shapes: Mapping[str, tuple[int, ...]]) -> Program:
        missing = [v.name for v in self.graph.inputs
                   if v.name not in shapes and v.name not in self.graph.initializers]
        if missing:
            raise InvalidArgumentError(f"input {missing[0]!r} is missing")
        ev = self.evaluator
        types: Mapping[str, TensorType | None] = infer_graph_types(self.graph, shapes,
                                                                    evaluator=ev)
        plan = place(self.graph, types, ev.registry, backend=ev.backend)
        backends = {name: ev.registry.get(name) for name in plan.backends}
        return compile_program(self.graph, plan, types, backends)


_DEFAULTS: dict[str, ProgramEvaluator] = {}


def default_evaluator(backend: str = "reference") -> ProgramEvaluator:
    """The evaluator graph-stage code uses when it is given none: the default registry's
    backends, placed on ``backend`` (one evaluator per backend, kept)."""
    evaluator = _DEFAULTS.get(backend)
    if evaluator is None:
        evaluator = _DEFAULTS.setdefault(backend, ProgramEvaluator(backend=backend))
    return evaluator
