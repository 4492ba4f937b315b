"""QLinearGlobalAveragePool: ``DQ → GlobalAveragePool → Q`` (QDQ) and com.microsoft's
QLinearGlobalAveragePool (QOperator) load as one QLINEAR_GLOBAL_AVG_POOL, which gives
onnxruntime's bytes exactly on the reference backend, the cpu backend's NumPy kernel and
its native kernel (NCHW and reading a channels-last chain), at 1, 2 and 3 threads."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import keel
from keel.graph.importers.onnx import import_onnx
from keel.graph.passes import optimize
from keel.ops.registry import Op

ort = pytest.importorskip("onnxruntime")

_TYPES = {np.uint8: TensorProto.UINT8, np.int8: TensorProto.INT8}


def _const(name: str, value: Any) -> Any:
    return onnx.numpy_helper.from_array(np.asarray(value), name)


def _qdq_pool(shape: list[int], x_scale: float, y_scale: float, dtype: Any = np.uint8,
              y_dtype: Any = None) -> Any:
    """Q → DQ → GlobalAveragePool → Q → DQ, float in and out."""
    y_dtype = dtype if y_dtype is None else y_dtype
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("GlobalAveragePool", ["xd"], ["p"]),
             helper.make_node("QuantizeLinear", ["p", "sy", "zy"], ["pq"]),
             helper.make_node("DequantizeLinear", ["pq", "sy", "zy"], ["y"])]
    inits = [_const("sx", np.float32(x_scale)), _const("zx", dtype(7)),
             _const("sy", np.float32(y_scale)), _const("zy", y_dtype(3))]
    graph = helper.make_graph(
        nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _qoperator_pool(shape: list[int], dtype: Any, x_zp: int, y_zp: int, x_scale: float,
                    y_scale: float) -> Any:
    """One com.microsoft QLinearGlobalAveragePool on 8-bit x."""
    node = helper.make_node("QLinearGlobalAveragePool", ["x", "sx", "zx", "sy", "zy"], ["y"],
                            domain="com.microsoft", channels_last=0)
    inits = [_const("sx", np.float32(x_scale)), _const("zx", dtype(x_zp)),
             _const("sy", np.float32(y_scale)), _const("zy", dtype(y_zp))]
    graph = helper.make_graph(
        [node], "pool", [helper.make_tensor_value_info("x", _TYPES[dtype], shape)],
        [helper.make_tensor_value_info("y", _TYPES[dtype], None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _ort(proto: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, feeds)[0])


def _ops(proto: Any) -> Counter[Op]:
    return Counter(n.op for n in optimize(import_onnx(proto)).nodes)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("shape", [[3, 40, 7, 7], [2, 300, 5, 3], [1, 5, 17, 19]],
                         ids=["7x7", "300-channels", "odd-plane"])
def test_qoperator_pool_gives_onnxruntimes_bytes(dtype: Any, shape: list[int]) -> None:
    rng = np.random.default_rng(sum(shape))
    info = np.iinfo(dtype)
    for x_zp, y_zp, x_scale, y_scale in [(3, 120, 0.02, 0.013), (-7 % 128, 0, 0.5, 0.03),
                                         (100, 50, 0.001, 0.0007)]:
        proto = _qoperator_pool(shape, dtype, x_zp, y_zp, x_scale, y_scale)
        assert _ops(proto)[Op.QLINEAR_GLOBAL_AVG_POOL] == 1
        x = rng.integers(info.min, info.max + 1, shape).astype(dtype)
        want = _ort(proto, {"x": x})
        ref = keel.load_model(proto, backend="reference").predict({"x": x})["y"]
        np.testing.assert_array_equal(ref, want)
        for threads in (1, 2, 3):
            got = keel.load_model(proto, threads=threads).predict({"x": x})["y"]
            np.testing.assert_array_equal(got, want)


def test_qdq_pool_fuses_as_onnxruntime_does_and_gives_its_bytes() -> None:
    proto = _qdq_pool([4, 24, 6, 6], 0.05, 0.021)
    ops = _ops(proto)
    assert ops[Op.QLINEAR_GLOBAL_AVG_POOL] == 1 and ops[Op.GLOBAL_AVG_POOL] == 0
    feeds = {"x": np.random.default_rng(1).uniform(-1, 12, (4, 24, 6, 6)).astype(np.float32)}
    want = _ort(proto, feeds)
    for threads in (1, 2):
        np.testing.assert_array_equal(
            keel.load_model(proto, threads=threads).predict(feeds)["y"], want)
    np.testing.assert_array_equal(
        keel.load_model(proto, backend="reference").predict(feeds)["y"], want)


@pytest.mark.parametrize(("x_scale", "y_scale", "y_dtype"),
                         [(0.05, 1e-6, None), (1e-9, 1.0, None), (0.05, 0.02, np.int8)],
                         ids=["scale-too-large", "scale-too-small", "two-types"])
def test_qdq_pool_outside_onnxruntimes_kernel_stays_float(x_scale: float, y_scale: float,
                                                          y_dtype: Any) -> None:
    """A multiplier x_scale / (y_scale * size) outside [2^-32, 256), which onnxruntime's
    kernel refuses, or x and y of two types, keep the float pool."""
    proto = _qdq_pool([2, 8, 4, 4], x_scale, y_scale, y_dtype=y_dtype)
    ops = _ops(proto)
    assert ops[Op.QLINEAR_GLOBAL_AVG_POOL] == 0 and ops[Op.GLOBAL_AVG_POOL] == 1
