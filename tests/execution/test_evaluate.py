"""The executor as an evaluator: ``Program.run(observe=...)`` and ``ProgramEvaluator``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.registry import BackendRegistry
from keel.errors import InvalidArgumentError
from keel.execution.evaluate import ProgramEvaluator, default_evaluator
from keel.execution.program import compile_program
from keel.graph.importers.onnx import import_onnx
from keel.graph.ir import Graph, Value
from keel.graph.passes import optimize
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.planning.placement import place
from keel.testing.backends import CountingBackend
from keel.testing.models import lenet, make_inputs, mlp


def _lenet() -> tuple[Graph, dict[str, np.ndarray]]:
    proto = lenet(1, 28, 10)
    return optimize(import_onnx(proto), "all"), make_inputs(proto, 4, seed=3)


def _with_outputs(graph: Graph, names: list[str]) -> Graph:
    """``graph`` that also hands out ``names`` (as graph outputs: never arena bytes)."""
    types = infer_graph_types(graph)
    g = graph.copy()
    g.outputs = [*g.outputs, *(Value(n, types[n]) for n in names if types[n] is not None)]
    return g


def _inputs_of_op(graph: Graph, op: Op) -> list[str]:
    return [n.inputs[0] for n in graph.nodes if n.op is op]


def test_observed_values_are_the_values_the_run_makes() -> None:
    graph, feeds = _lenet()
    # Every activation a Gemm or Conv reads, the first of them a feed, one of them the
    # output of a flatten that runs as nothing (a view of its input's arena bytes).
    wanted = _inputs_of_op(graph, Op.CONV) + _inputs_of_op(graph, Op.GEMM)
    types = infer_graph_types(graph, {k: v.shape for k, v in feeds.items()})
    registry = _registry_with("cpu", "reference")
    plan = place(graph, types, registry, backend="auto")
    program = compile_program(graph, plan, types,
                              {name: registry.get(name) for name in plan.backends})
    flat = next(n for n in graph.nodes if n.op is Op.FLATTEN)
    assert flat.outputs[0] in wanted and flat.name not in [s[0] for s in program.steps]
    seen: dict[str, np.ndarray] = {}

    def keep(name: str) -> Any:
        return lambda value: seen.setdefault(name, np.array(value, copy=True))

    out = program.run(feeds, observe={name: keep(name) for name in wanted})
    assert sorted(seen) == sorted(wanted)
    expected = ProgramEvaluator(registry, "auto")(_with_outputs(graph, wanted))(feeds)
    for name in wanted:
        np.testing.assert_array_equal(seen[name], expected[name])
    np.testing.assert_array_equal(out["logits"], expected["logits"])


def test_observing_a_value_the_graph_lacks_is_an_invalid_argument() -> None:
    graph, feeds = _lenet()
    run = ProgramEvaluator(_registry_with("reference"))(graph)
    with pytest.raises(InvalidArgumentError, match="observe names 'nope', which is not a value"):
        run(feeds, {"nope": lambda value: None})


def test_a_graph_compiles_one_program_per_input_signature() -> None:
    proto = mlp(16, (32,), 4)
    counting = CountingBackend()
    registry = BackendRegistry()
    registry.register("counting", lambda: counting)
    run = ProgramEvaluator(registry, "counting")(import_onnx(proto))
    for batch in (4, 4, 2, 4):
        out = run(make_inputs(proto, batch, seed=batch))
        assert next(iter(out.values())).shape[0] == batch
    assert len(run.programs) == 2                    # batch 4 and batch 2
    assert counting.calls[Op.GEMM] == counting.calls[Op.MATMUL] == 4   # once per run


def test_the_default_evaluator_is_kept_per_backend() -> None:
    assert default_evaluator() is default_evaluator("reference")
    assert default_evaluator("auto") is not default_evaluator()
    assert default_evaluator().backend == "reference"


def _registry_with(*names: str) -> BackendRegistry:
    from keel.backends.registry import builtin_registry

    builtin = builtin_registry()
    registry = BackendRegistry()
    for rank, name in enumerate(names):
        registry.register(name, lambda n=name: builtin.instance(n), priority=-rank)
    registry.set_priority(list(names))
    return registry
