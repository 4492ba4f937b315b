"""Graph-level type inference: schemas, constant values, input shape overrides."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.graph.importers.onnx import import_onnx
from keel.graph.ir import Graph, Node, Value
from keel.graph.shape_inference import infer_graph_types, propagate
from keel.ops.registry import Op
from keel.ops.types import TensorType
from tests.graph.models import init, mlp, model, rng, transformer, vi


def test_every_value_gets_a_type_with_symbolic_dims() -> None:
    g = import_onnx(mlp(rng(0)))
    types = infer_graph_types(g)
    names = {*g.input_names, *g.initializers, *(o for n in g.nodes for o in n.outputs)}
    assert names <= set(types)
    assert types["y"] == TensorType(DType.FLOAT32, ("N", 10))
    assert types["w1"] == TensorType(DType.FLOAT32, (16, 32))


def test_input_shapes_make_types_concrete() -> None:
    g = import_onnx(mlp(rng(0)))
    types = infer_graph_types(g, {"x": (3, 16)})
    assert types["h3"] == TensorType(DType.FLOAT32, (3, 32))
    assert types["y"] is not None and types["y"].is_static


def test_shape_computed_from_shape_of_a_static_tensor_is_known() -> None:
    # Reshape(x, Concat(Gather(Shape(x), 0), [-1])) as exporters write flatten.
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    m = model(nodes, [vi("x", ["N", 3, 4])], [vi("y", None)],
              [init("zero", np.array(0, np.int64)), init("axes0", np.array([0], np.int64)),
               init("minus1", np.array([-1], np.int64))])
    g = import_onnx(m)
    state = propagate(g, {"x": (5, 3, 4)})
    np.testing.assert_array_equal(state.values["shape"], [5, -1])
    assert state.types["y"] == TensorType(DType.FLOAT32, (5, 12))


def test_transformer_types_are_inferred_through_attention_reshapes() -> None:
    g = import_onnx(transformer(rng(0)))
    types = infer_graph_types(g, {"ids": (4, 6)})
    assert types["l0_qt"] == TensorType(DType.FLOAT32, (4, 2, 6, 8))
    assert types["l0_kt"] == TensorType(DType.FLOAT32, (4, 2, 8, 6))
    assert types["y"] == TensorType(DType.FLOAT32, (4, 6, 16))


@pytest.mark.parametrize("shapes, match", [
    ({"nope": (1, 16)}, "'nope', which is not a graph input"),
    ({"x": (1, 16, 1)}, "declared with rank 2"),
    ({"x": (2, 15)}, r"declared with shape \(N, 16\), got \(2, 15\)"),
    ({"x": (-1, 16)}, "negative dim"),
])
def test_bad_input_shapes_are_invalid_arguments(shapes: dict[str, tuple[int, ...]],
                                                match: str) -> None:
    g = import_onnx(mlp(rng(0)))
    with pytest.raises(InvalidArgumentError, match=match):
        infer_graph_types(g, shapes)


def test_a_node_whose_inputs_do_not_fit_is_named() -> None:
    f32 = DType.FLOAT32
    g = Graph("g", [Node("mm", Op.MATMUL, ["a", "b"], ["y"], {"activation": "",
                                                             "activation_params": ()})],
              [Value("a", TensorType(f32, (2, 3))), Value("b", TensorType(f32, (4, 5)))],
              [Value("y", TensorType(f32, None))])
    with pytest.raises(InvalidArgumentError, match="node 'mm' \\(matmul\\)"):
        infer_graph_types(g)


def test_declared_value_info_fills_what_inference_cannot_know() -> None:
    nodes = [helper.make_node("NonZero", ["x"], ["nz"])]
    m = model(nodes, [vi("x", [4])], [helper.make_tensor_value_info("nz", TensorProto.INT64,
                                                                    [1, "K"])])
    g = import_onnx(m)
    t = infer_graph_types(g)["nz"]
    assert t is not None and t.dtype is DType.INT64 and t.shape is not None and len(t.shape) == 2


def test_overridable_initializers_are_not_constant_values() -> None:
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"])]
    m = model(nodes, [vi("x", [2, 6]), vi("shape", [2], TensorProto.INT64)], [vi("y", None)],
              [init("shape", np.array([3, 4], np.int64))])
    g = import_onnx(m)
    state = propagate(g)
    assert "shape" not in state.values


@pytest.mark.parametrize("declared, target, expected", [
    (["N", "S", 4, 8], [0, -1, 32], ("N", "S", 32)),     # heads merged: S is left over
    (["N", "S", 32], [0, -1, 4, 8], ("N", "S", 4, 8)),   # split into heads
    (["N", "S", 4, 8], [0, -1, 16], None),               # 2 * S: not one symbol
    (["N", "S", "T"], [0, -1], None),                    # S * T: two symbols left over
    (["N", 3, 4], [0, -1], ("N", 12)),                   # every symbol cancels
])
def test_a_reshape_minus_one_takes_the_one_symbol_left_over(
        declared: list[str | int], target: list[int],
        expected: tuple[str | int, ...] | None) -> None:
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"])]
    m = model(nodes, [vi("x", declared)], [vi("y", None)],
              [init("shape", np.array(target, np.int64))])
    shape = infer_graph_types(import_onnx(m))["y"].shape
    if expected is None:
        assert shape is not None and shape[1] is None
    else:
        assert shape == expected
