"""Load cost grows linearly with the graph: a 20,000-input fan-in and a 100,000-node chain
load and run (memory planning was quadratic: the fan-in took minutes to load).

The bounds are generous on purpose (a loaded 2-core machine takes about a third of them):
they catch a quadratic step, not a slow machine. Quadratic planning alone took over 250 s
for the fan-in."""

from __future__ import annotations

import time

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
@pytest.mark.parametrize(("shape", "n", "bound_s"), [("fan-in", 20_000, 240.0),
                                                    ("chain", 100_000, 300.0)])
def test_large_graphs_load_and_run(shape: str, n: int, bound_s: float) -> None:
    data = _fan_in(n) if shape == "fan-in" else _chain(n)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    started = time.perf_counter()
    model = keel.load_model(data, plan_cache=False)
    (out,) = model.predict({model.input_names[0]: x}).values()
    seconds = time.perf_counter() - started
    want = np.maximum(x, 0) * (n if shape == "fan-in" else 1)
    np.testing.assert_allclose(out, want, rtol=1e-3)     # 20,000 float32 additions
    assert seconds < bound_s, seconds
