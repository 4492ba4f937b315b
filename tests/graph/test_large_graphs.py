"""Large graphs load and run: a 20,000-input fan-in and a 100,000-node chain (memory
planning was quadratic: the fan-in took minutes to load). Their load times are recorded
in docs/performance.md, not asserted here; tests/graph/test_memory_plan.py holds the
memory planner's scaling."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import keel


def _model(nodes: list[onnx.NodeProto], x: str, y: str) -> bytes:
    graph = helper.make_graph(nodes, "large", [
        helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["N", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


def _fan_in(n: int) -> bytes:
    nodes = [helper.make_node("Relu", ["x"], [f"r{i}"], name=f"r{i}") for i in range(n)]
    nodes.append(helper.make_node("Sum", [f"r{i}" for i in range(n)], ["y"], name="sum"))
    return _model(nodes, "x", "y")


def _chain(n: int) -> bytes:
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"], name=f"n{i}") for i in range(n)]
    return _model(nodes, "v0", f"v{n}")


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "n"), [("fan-in", 20_000), ("chain", 100_000)])
def test_large_graphs_load_and_run(shape: str, n: int) -> None:
    data = _fan_in(n) if shape == "fan-in" else _chain(n)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    model = keel.load_model(data, plan_cache=False)
    (out,) = model.predict({model.input_names[0]: x}).values()
    want = np.maximum(x, 0) * (n if shape == "fan-in" else 1)
    np.testing.assert_allclose(out, want, rtol=1e-3)     # 20,000 float32 additions
    # nodes alike are placed once: the Relus share one node plan
    relus = [p for p in model.plan.nodes if p.op == "relu"]
    assert len(relus) == n and len({id(p.plan) for p in relus}) == 1
