"""Shape inference, constant folding and calibration run graphs through keel's executor.

A fresh registry with a counting backend shows which code ran the nodes; the
results on real models are checked against onnxruntime, which shares no code
with keel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from keel.backends.registry import BackendRegistry
from keel.dtypes import DType
from keel.execution.evaluate import ProgramEvaluator
from keel.graph.importers.onnx import import_onnx
from keel.graph.ir import Graph, Node
from keel.graph.quantize import QuantizeOptions, quantize_with_report
from keel.graph.shape_inference import GraphRunner, evaluate_node, infer_graph_types, propagate
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from keel.testing import models as TM
from keel.testing.backends import CountingBackend, FakeBackend
from tests.graph.models import init, model, vi


def _counting() -> tuple[CountingBackend, ProgramEvaluator]:
    backend = CountingBackend()
    registry = BackendRegistry()
    registry.register("counting", lambda: backend)
    return backend, ProgramEvaluator(registry, "counting")


def _exported_flatten() -> onnx.ModelProto:
    """Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])), as exporters write flatten."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    return model(nodes, [vi("x", ["N", 3, 4])], [vi("y", None)],
                 [init("zero", np.array(0, np.int64)), init("axes0", np.array([0], np.int64)),
                  init("minus1", np.array([-1], np.int64))])


# ---- shape inference -------------------------------------------------------------------------
def test_shape_inference_computes_constant_values_on_the_executor() -> None:
    g = import_onnx(_exported_flatten())
    backend, evaluator = _counting()
    state = propagate(g, {"x": (5, 3, 4)}, evaluator=evaluator)
    np.testing.assert_array_equal(state.values["shape"], [5, -1])
    assert state.types["y"] == TensorType(DType.FLOAT32, (5, 12))
    # Shape is type arithmetic; the three nodes after it ran on the counting backend.
    assert backend.calls == {Op.GATHER: 1, Op.EXPAND_DIMS: 1, Op.CONCAT: 1}
    assert propagate(g, {"x": (5, 3, 4)}).types == state.types      # the default evaluator


def test_a_value_the_executor_cannot_compute_stays_unknown() -> None:
    # The only backend lacks Concat: nothing else computes the shape behind its back.
    registry = BackendRegistry()
    registry.register("limited", lambda: FakeBackend(
        "limited", ops={Op.GATHER, Op.EXPAND_DIMS, Op.RESHAPE}))
    state = propagate(import_onnx(_exported_flatten()), {"x": (5, 3, 4)},
                      evaluator=ProgramEvaluator(registry, "limited"))
    assert "n1" in state.values and "shape" not in state.values
    t = state.types["y"]
    assert t is not None and not t.is_static


def test_nodes_alike_share_one_prepared_graph() -> None:
    backend, evaluator = _counting()
    prepared: list[Graph] = []

    def recording(graph: Graph) -> GraphRunner:
        prepared.append(graph)
        return evaluator(graph)

    elu = get_schema(Op.ELU)
    a = Node("a", Op.ELU, ["p"], ["q"], elu.normalize_attrs({"alpha": 1.0}))
    b = Node("b", Op.ELU, ["r"], ["s"], elu.normalize_attrs({"alpha": 1.0}))
    c = Node("c", Op.ELU, ["r"], ["s"], elu.normalize_attrs({"alpha": 2.0}))
    x = np.array([-1.0, 0.5], np.float32)
    got = [evaluate_node(n, [v], recording) for n, v in ((a, x), (b, 2 * x), (c, x))]
    assert len(prepared) == 2                        # a and b alike; c's alpha differs
    assert backend.calls[Op.ELU] == 3
    for (node, value), result in zip(((a, x), (b, 2 * x), (c, x)), got, strict=True):
        alpha = node.attrs["alpha"]
        want = np.where(value > 0, value, alpha * (np.exp(value) - 1)).astype(np.float32)
        assert result is not None
        np.testing.assert_allclose(result[0], want, rtol=1e-6)


def test_a_node_that_fails_to_run_gives_no_value() -> None:
    node = Node("r", Op.RESHAPE, ["x", "shape"], ["y"], get_schema(Op.RESHAPE).normalize_attrs({}))
    assert evaluate_node(node, [np.zeros((2, 3), np.float32), np.array([4], np.int64)]) is None


# ---- real models against onnxruntime -------------------------------------------------------------
def _ort_values(proto: onnx.ModelProto, names: list[str],
                feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every value in ``names`` as onnxruntime computes it (each made a graph output)."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in have)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    outs = [o.name for o in sess.get_outputs()]
    return dict(zip(outs, sess.run(None, feeds), strict=True))


def _zoo(name: str) -> onnx.ModelProto:
    from benchmarks import zoo

    return zoo.MODELS[name].build()


_REAL = {
    "mlp": lambda: TM.mlp(64, (128, 64), 10),
    "lenet": lambda: TM.lenet(1, 28, 10),
    "resnet_block": TM.resnet_block,
    "transformer": lambda: TM.transformer_encoder(layers=1),
    "exported_flatten": _exported_flatten,
    "zoo_resnet20": lambda: _zoo("resnet20"),
    "zoo_bert_mini": lambda: _zoo("bert_mini"),
}


@pytest.mark.parametrize("name", sorted(_REAL))
def test_inferred_shapes_are_the_shapes_a_run_makes(name: str) -> None:
    proto = _REAL[name]()
    feeds = TM.make_inputs(proto, 2, seed=0)
    g = import_onnx(proto)
    types = infer_graph_types(g, {k: v.shape for k, v in feeds.items()})
    made = [o for n in g.nodes for o in n.outputs if o and o not in g.initializers]
    actual = _ort_values(proto, made, feeds)
    checked = 0
    for value in made:
        if value not in actual:
            continue            # a value keel's importer made itself
        t = types[value]
        assert t is not None and t.is_static, value
        assert t.shape == actual[value].shape and t.dtype.numpy == actual[value].dtype, value
        checked += 1
    assert checked >= len(made) // 2


@pytest.mark.parametrize("name", ["mlp", "lenet", "resnet_block", "transformer"])
def test_calibrated_ranges_are_the_ranges_of_the_run(name: str) -> None:
    proto = _REAL[name]()
    g = import_onnx(proto)                 # as imported: every value onnxruntime has too
    cal = TM.make_inputs(proto, 40, seed=2)
    report = quantize_with_report(g, QuantizeOptions(8, "qdq", batch_size=16), cal)
    assert report.ranges
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    for start in range(0, 40, 16):
        batch = {k: v[start:start + 16] for k, v in cal.items()}
        for value, array in _ort_values(proto, list(report.ranges), batch).items():
            if value in report.ranges:
                lo[value] = min(lo.get(value, np.inf), float(array.min()))
                hi[value] = max(hi.get(value, -np.inf), float(array.max()))
    assert sorted(lo) == sorted(report.ranges)
    for value, (low, high) in report.ranges.items():
        np.testing.assert_allclose([low, high], [lo[value], hi[value]], rtol=1e-5, atol=1e-5)


def test_calibration_runs_on_the_given_executor() -> None:
    proto = TM.lenet(1, 28, 10)
    g = import_onnx(proto)
    cal = TM.make_inputs(proto, 40, seed=2)
    backend, evaluator = _counting()
    report = quantize_with_report(g, QuantizeOptions(8, "qdq", batch_size=16), cal,
                                  evaluator=evaluator)
    convs = sum(n.op is Op.CONV for n in g.nodes)
    assert backend.calls[Op.CONV] == 3 * convs             # batches of 16, 16 and 8
    default = quantize_with_report(g, QuantizeOptions(8, "qdq", batch_size=16), cal)
    assert report.ranges.keys() == default.ranges.keys()
    for value, pair in report.ranges.items():
        np.testing.assert_allclose(pair, default.ranges[value], rtol=1e-5, atol=1e-6)
    params, want = _activation_params(report.graph), _activation_params(default.graph)
    assert params.keys() == want.keys() and params
    for k, v in params.items():
        np.testing.assert_allclose(v, want[k], rtol=1e-5)


def _activation_params(graph: Graph) -> dict[str, Any]:
    """The scale and zero point of every QUANTIZE_LINEAR (the calibrated activations)."""
    return {i: graph.initializers[i] for n in graph.nodes if n.op is Op.QUANTIZE_LINEAR
            for i in n.inputs[1:]}
