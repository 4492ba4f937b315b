"""The int8 one-pass kernels' split reasons (planner.int8_split_reason) state a split
only where the native pass serves the node, by the kernels' own check
(qlinear.pass_served): 8-bit operands and zero points, float32 scales per tensor,
QuantizeLinear's float32 x and attributes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import keel
from keel.backends.cpu import native_qgemm, planner
from keel.backends.plan import PlanRequest
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.types import TensorType

X = (1, 64, 56, 56)


def _add(scale: DType) -> PlanRequest:
    u8 = DType.UINT8
    types = [TensorType(u8, X), TensorType(scale, ()), TensorType(u8, ())] * 2 + [
        TensorType(scale, ()), TensorType(u8, ())]
    return PlanRequest(Op.QLINEAR_ADD, tuple(types), {"activation": None}, threads=2)


def _quantize(zero_point: DType) -> PlanRequest:
    types = (TensorType(DType.FLOAT32, X), TensorType(DType.FLOAT32, ()),
             TensorType(zero_point, ()))
    return PlanRequest(Op.QUANTIZE_LINEAR, types, {"precision": None, "output_dtype": None},
                       threads=2)


@pytest.fixture(autouse=True)
def _native() -> None:
    if not native_qgemm.available():
        pytest.skip("the int8 kernels need the native tier")


def test_add_with_scales_the_pass_does_not_take_states_no_split() -> None:
    assert planner.int8_split_reason(_add(DType.FLOAT32)).startswith("one pass over")
    assert planner.int8_split_reason(_add(DType.FLOAT16)) == ""


def test_quantize_to_a_zero_point_not_of_8_bits_states_no_split() -> None:
    assert planner.int8_split_reason(_quantize(DType.UINT8)).startswith("one pass over")
    assert planner.int8_split_reason(_quantize(DType.INT32)) == ""


def test_a_quantize_nodes_plan_states_its_pass() -> None:
    """Through a loaded model: the planner reads the node's own attributes."""
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])], "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(X))],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, list(X))],
        [numpy_helper.from_array(np.array(0.05, np.float32), "s"),
         numpy_helper.from_array(np.array(128, np.uint8), "z")])
    model = keel.load_model(onnx.helper.make_model(graph).SerializeToString(), threads=2,
                            backend="cpu")
    assert "one pass over 200,704 elements" in model.explain()
