"""onnxruntime's quantized com.microsoft ops, one node each, against onnxruntime: outputs
equal or within one quantization step (keel runs the elementwise ones in float between
DequantizeLinear and QuantizeLinear; onnxruntime in integer arithmetic)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import keel

ort = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(17)
U8 = TensorProto.UINT8


def _model(node: Any, inputs: list[tuple[str, int, list[int]]], output: tuple[str, int],
           consts: dict[str, np.ndarray]) -> bytes:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(output[0], output[1], None)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return bytes(model.SerializeToString())


def _both(model: bytes, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    got = next(iter(keel.load_model(model).predict(feeds).values()))
    return got, want


def _u8(*shape: int) -> np.ndarray:
    return RNG.integers(0, 256, shape).astype(np.uint8)


def _params(**values: float) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for key, v in values.items():
        out[key] = np.array(v, np.float32) if key.endswith("s") else np.array(v, np.uint8)
    return out


def _within_one_step(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.95


@pytest.mark.parametrize("op_type", ["QLinearAdd", "QLinearMul"])
def test_binary(op_type: str) -> None:
    consts = _params(a_s=0.05, a_z=120, b_s=0.03, b_z=130, y_s=0.08, y_z=128)
    node = helper.make_node(op_type, ["a", "a_s", "a_z", "b", "b_s", "b_z", "y_s", "y_z"], ["y"],
                            domain="com.microsoft")
    model = _model(node, [("a", U8, [2, 3, 8]), ("b", U8, [3, 8])], ("y", U8), consts)
    _within_one_step(*_both(model, {"a": _u8(2, 3, 8), "b": _u8(3, 8)}))


@pytest.mark.parametrize("op_type,attrs", [("QLinearSigmoid", {}),
                                           ("QLinearLeakyRelu", {"alpha": 0.2}),
                                           ("QLinearGlobalAveragePool", {"channels_last": 0})])
def test_unary(op_type: str, attrs: dict[str, Any]) -> None:
    consts = _params(x_s=0.05, x_z=100, y_s=0.01 if op_type == "QLinearSigmoid" else 0.04,
                     y_z=20 if op_type == "QLinearSigmoid" else 90)
    node = helper.make_node(op_type, ["x", "x_s", "x_z", "y_s", "y_z"], ["y"],
                            domain="com.microsoft", **attrs)
    model = _model(node, [("x", U8, [2, 4, 5, 5])], ("y", U8), consts)
    _within_one_step(*_both(model, {"x": _u8(2, 4, 5, 5)}))


def test_concat() -> None:
    consts = _params(y_s=0.1, y_z=128, a_s=0.05, a_z=120, b_s=0.2, b_z=3)
    node = helper.make_node("QLinearConcat", ["y_s", "y_z", "a", "a_s", "a_z", "b", "b_s", "b_z"],
                            ["y"], domain="com.microsoft", axis=1)
    model = _model(node, [("a", U8, [2, 3, 4]), ("b", U8, [2, 5, 4])], ("y", U8), consts)
    _within_one_step(*_both(model, {"a": _u8(2, 3, 4), "b": _u8(2, 5, 4)}))


def test_dynamic_quantize_matmul() -> None:
    consts = {"b": RNG.integers(-127, 128, (24, 10)).astype(np.int8),
              "b_s": np.array(0.02, np.float32), "b_z": np.array(0, np.int8),
              "bias": RNG.standard_normal(10).astype(np.float32)}
    node = helper.make_node("DynamicQuantizeMatMul", ["a", "b", "b_s", "b_z", "bias"], ["y"],
                            domain="com.microsoft")
    model = _model(node, [("a", TensorProto.FLOAT, [3, 24])], ("y", TensorProto.FLOAT), consts)
    got, want = _both(model, {"a": RNG.standard_normal((3, 24)).astype(np.float32)})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_qgemm_matches_onnxruntime() -> None:
    consts = {"a_s": np.array(0.05, np.float32), "a_z": np.array(128, np.uint8),
              "b": RNG.integers(-127, 128, (10, 24)).astype(np.int8),
              "b_s": RNG.uniform(0.01, 0.03, 10).astype(np.float32),
              "b_z": np.zeros(10, np.int8),
              "c": RNG.integers(-3000, 3000, 10).astype(np.int32),
              "y_s": np.array(0.5, np.float32), "y_z": np.array(120, np.uint8)}
    node = helper.make_node("QGemm", ["a", "a_s", "a_z", "b", "b_s", "b_z", "c", "y_s", "y_z"],
                            ["y"], domain="com.microsoft", transB=1, alpha=1.0)
    model = _model(node, [("a", U8, [5, 24])], ("y", U8), consts)
    _within_one_step(*_both(model, {"a": _u8(5, 24)}))


def test_an_unknown_com_microsoft_op_is_unsupported() -> None:
    node = helper.make_node("QLinearSoftmax", ["x"], ["y"], domain="com.microsoft", name="s")
    model = _model(node, [("x", U8, [2])], ("y", U8), {})
    with pytest.raises(keel.errors.UnsupportedOperationError, match="QGemm"):
        keel.load_model(model)
