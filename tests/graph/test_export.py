"""Export to ONNX: valid models onnxruntime runs, and keel's own domain round trip."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import helper

from keel.dtypes import DType
from keel.graph.export import EXPORT_OPSET, to_onnx
from keel.graph.importers.onnx import KEEL_DOMAIN, import_onnx
from keel.graph.ir import Graph, Node, Value
from keel.graph.passes import optimize
from keel.ops.registry import Op
from keel.ops.types import TensorType
from tests.graph import models as M
from tests.graph.interp import run_graph
from tests.graph.models import init, model, rel_l2, rng, vi
from tests.graph.test_passes import feeds_of

BUILDERS: dict[str, Callable[[np.random.Generator], onnx.ModelProto]] = {
    "mlp": M.mlp, "lenet": M.lenet, "resnet_block": M.conv_bn_block,
    "mobilenet_block": M.mobilenet_block, "transformer": M.transformer,
    "ln_gelu_tanh": lambda r: M.layer_norm_gelu(r, tanh=True), "attention": M.attention,
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("level", ["none", "all"])
def test_export_runs_in_onnxruntime_with_the_same_results(name: str, level: str) -> None:
    r = rng(12)
    m = BUILDERS[name](r)
    g = optimize(import_onnx(m), level)
    exported = to_onnx(g)
    onnx.checker.check_model(exported, full_check=True)
    assert all(n.domain == "" for n in exported.graph.node)
    assert exported.opset_import[0].version >= EXPORT_OPSET
    feeds = feeds_of(g, r)
    want = M.run_ort(m, feeds)
    for got, expected in zip(M.run_ort(exported, feeds), want, strict=True):
        assert rel_l2(got, expected) < 1e-5


@pytest.mark.parametrize("name", ["resnet_block", "transformer", "mlp"])
def test_keel_domain_export_reimports_fused(name: str) -> None:
    r = rng(13)
    g = optimize(import_onnx(BUILDERS[name](r)), "all")
    exported = to_onnx(g, custom_domain=True)
    domains = {n.domain for n in exported.graph.node}
    assert KEEL_DOMAIN in domains
    assert {o.domain for o in exported.opset_import} == {"", KEEL_DOMAIN}
    assert {p.key: p.value for p in exported.metadata_props}["keel.custom_domain"] == KEEL_DOMAIN
    back = import_onnx(exported.SerializeToString())
    assert [n.op for n in back.nodes] == [n.op for n in g.nodes]
    for a, b in zip(back.nodes, g.nodes, strict=True):
        assert a.attrs.keys() == b.attrs.keys()
        for key, value in a.attrs.items():  # ONNX float attributes are float32
            want = b.attrs[key]
            assert value == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want)
    feeds = feeds_of(g, r)
    want, got = run_graph(g, feeds), run_graph(back, feeds)
    for k in want:  # equal up to epsilon's float32 rounding in the ONNX attribute
        assert rel_l2(got[k], want[k]) < 1e-6


def test_standard_export_reimports_to_an_equivalent_graph() -> None:
    r = rng(14)
    g = optimize(import_onnx(M.transformer(r)), "all")
    back = import_onnx(to_onnx(g))
    again = optimize(back, "all")
    assert sorted(n.op.value for n in again.nodes) == sorted(n.op.value for n in g.nodes)
    feeds = feeds_of(g, r)
    assert rel_l2(run_graph(again, feeds)["y"], run_graph(g, feeds)["y"]) < 1e-6


def test_keel_only_ops_are_written_in_keel_domain() -> None:
    f32 = DType.FLOAT32
    g = Graph("g", [Node("s", Op.SUM_ALL, ["x"], ["y"], {})], [Value("x", TensorType(f32, (3,)))],
              [Value("y", TensorType(f32, ()))])
    exported = to_onnx(g)
    assert exported.graph.node[0].domain == KEEL_DOMAIN
    back = import_onnx(exported)
    assert back.nodes[0].op is Op.SUM_ALL
    x = np.arange(3, dtype=np.float32)
    assert float(run_graph(back, {"x": x})["y"]) == pytest.approx(3.0)


def test_folded_graph_output_is_exported_through_an_identity() -> None:
    nodes = [helper.make_node("Neg", ["c"], ["y"]), helper.make_node("Relu", ["x"], ["z"])]
    m = model(nodes, [vi("x", [2])], [vi("y", [2]), vi("z", [2])],
              [init("c", np.ones(2, np.float32))])
    g = optimize(import_onnx(m), "basic")
    assert "y" in g.initializers
    exported = to_onnx(g)
    onnx.checker.check_model(exported)
    y, z = M.run_ort(exported, {"x": np.array([-1, 2], np.float32)})
    np.testing.assert_array_equal(y, [-1, -1])
    np.testing.assert_array_equal(z, [0, 2])


def test_symbolic_dims_and_value_types_survive_export() -> None:
    g = import_onnx(M.mlp(rng(0)))
    exported = to_onnx(g)
    dims = exported.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "N" and dims[1].dim_value == 16
    assert "h1" in {v.name for v in exported.graph.value_info}


def test_optional_inputs_stay_optional_after_export() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = model(nodes, [vi("x", [2, 3]), vi("w", [3, 3])], [vi("y", [2, 3])],
              [init("w", np.eye(3, dtype=np.float32))])
    back = import_onnx(to_onnx(import_onnx(m)))
    assert back.optional_input_names == ["w"]


def test_causal_attention_is_written_in_keel_domain() -> None:
    q = np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(np.float32)
    f32 = DType.FLOAT32
    t = TensorType(f32, (1, 2, 3, 4))
    g = Graph("g", [Node("att", Op.ATTENTION, ["q", "q", "q"], ["y"],
                         {"scale": None, "is_causal": True})],
              [Value("q", t)], [Value("y", t)])
    exported = to_onnx(g)
    assert exported.graph.node[0].domain == KEEL_DOMAIN
    back = import_onnx(exported)
    assert back.nodes[0].attrs["is_causal"] is True
    np.testing.assert_array_equal(run_graph(back, {"q": q})["y"], run_graph(g, {"q": q})["y"])
