"""The channels-last kernel an int8 convolution runs is the planner's choice, made once from
its constant weights (int8_channels_last_kernel): a 1x1 convolution with weight zero points
runs on the matrix product, a dense one with weight zero points or a depthwise one of more
taps than the kernel takes stays out of a chain's inside on its NCHW kernel, and a
convolution whose weights are no constants says its kernel is chosen when they are packed.
explain() names the kernel that runs, and the results are onnxruntime's bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import keel
from keel.backends.cpu import native_qgemm, planner

ort = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(5)


def _conv(name: str, x: str, c: int, m: int, k: int, group: int = 1, w_zero: int = 0,
          const_weights: bool = True) -> tuple[Any, list[Any]]:
    """A QLinearConv (int8 weights, zero points ``w_zero`` per channel, padding k // 2)
    reading ``x`` (uint8) and writing ``name``, with its initializers."""
    w = RNG.integers(-60, 60, (m, c // group, k, k)).astype(np.int8)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), f"{name}_xs"),
             numpy_helper.from_array(np.array(120, np.uint8), f"{name}_xz"),
             numpy_helper.from_array(RNG.uniform(0.002, 0.01, m).astype(np.float32), f"{name}_ws"),
             numpy_helper.from_array(np.full(m, w_zero, np.int8), f"{name}_wz"),
             numpy_helper.from_array(np.array(0.05, np.float32), f"{name}_ys"),
             numpy_helper.from_array(np.array(128, np.uint8), f"{name}_yz"),
             numpy_helper.from_array(RNG.integers(-2000, 2000, m).astype(np.int32), f"{name}_b")]
    if const_weights:
        inits.append(numpy_helper.from_array(w, f"{name}_w"))
    node = helper.make_node(
        "QLinearConv", [x, f"{name}_xs", f"{name}_xz", f"{name}_w", f"{name}_ws", f"{name}_wz",
                        f"{name}_ys", f"{name}_yz", f"{name}_b"], [name],
        pads=[k // 2] * 4, group=group, name=name)
    return node, inits


def _model(tmp_path: Path, layers: list[tuple[Any, ...]], c: int,
           weight_input: tuple[int, ...] | None = None) -> Path:
    nodes, inits, x = [], [], "x"
    for name, cin, m, k, group, w_zero, const in layers:
        node, more = _conv(name, x, cin, m, k, group, w_zero, const)
        nodes.append(node)
        inits += more
        x = name
    inputs = [helper.make_tensor_value_info("x", TensorProto.UINT8, [3, c, 9, 9])]
    if weight_input is not None:
        inputs.append(helper.make_tensor_value_info(f"{layers[0][0]}_w", TensorProto.INT8,
                                                    list(weight_input)))
    graph = helper.make_graph(nodes, "int8_kernels", inputs,
                              [helper.make_tensor_value_info(x, TensorProto.UINT8, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = tmp_path / "model.onnx"
    onnx.save(proto, str(path))
    return path


def _plans(model: Any) -> dict[str, Any]:
    return {p.name: p for p in model.plan.nodes}


def _agrees(path: Path, feeds: dict[str, np.ndarray]) -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    for threads in (1, 2):
        got = next(iter(keel.load_model(str(path), threads=threads).predict(feeds).values()))
        np.testing.assert_array_equal(got, want)
    ref = keel.load_model(str(path), backend="reference").predict(feeds)
    np.testing.assert_array_equal(next(iter(ref.values())), want)


def test_explain_names_the_kernel_each_fallback_case_runs(tmp_path: Path) -> None:
    if not native_qgemm.available():
        pytest.skip("the int8 kernels need the native tier")
    planner.forget()
    path = _model(tmp_path, [
        ("pointwise_zp", 32, 48, 1, 1, 3, True),     # weight zero points: the matrix product
        ("depthwise", 48, 48, 3, 48, 0, True),       # the chain's depthwise
        ("dense_zp", 48, 64, 3, 1, -2, True),        # weight zero points: its NCHW kernel
        ("depthwise_9x9", 64, 64, 9, 64, 0, True),   # 81 taps: its NCHW kernel
        ("depthwise_last", 64, 64, 3, 64, 0, True),
        ("pointwise", 64, 50, 1, 1, 0, True),        # symmetric: the panels
        ("dense_c50", 50, 64, 3, 1, 0, True),        # 50 channels: its NCHW kernel
    ], c=32)
    model = keel.load_model(str(path), threads=2)
    plans = _plans(model)
    first = plans["pointwise_zp"]
    assert first.layout == "nchw->nhwc" and first.plan.option("int8_kernel") == "matmul"
    assert "the matrix product" in first.plan.reason("layout")
    assert "the 1x1 panels" not in first.plan.reason("layout")
    assert "the matrix product" in first.plan.reason("threads")
    assert plans["depthwise"].plan.option("int8_kernel") == "depthwise"
    # the dense convolution with zero points runs NCHW, outside any chain: its NCHW split
    dense = plans["dense_zp"]
    assert dense.layout == "" and "indirect" not in dense.plan.reason("layout")
    assert "where the node's layout is NCHW" in dense.plan.reason("threads")
    # 81 taps: it may start the last chain, on its NCHW kernel and a transpose
    wide = plans["depthwise_9x9"]
    assert wide.layout in ("", "nchw->nhwc")
    if wide.layout:
        assert wide.plan.option("int8_kernel") == "nchw"
        assert "its NCHW kernel" in wide.plan.reason("int8_kernel")
        assert "its kernel on" not in wide.plan.reason("layout")
    assert plans["pointwise"].plan.option("int8_kernel") == "panels"
    assert "the 1x1 panels" in plans["pointwise"].plan.reason("layout")
    narrow = plans["dense_c50"]
    assert narrow.layout == "" and "where the node's layout is NCHW" in narrow.plan.reason(
        "threads")
    assert "the matrix product" in model.explain()
    feeds = {"x": RNG.integers(0, 256, (3, 32, 9, 9)).astype(np.uint8)}
    _agrees(path, feeds)


def test_weights_that_are_no_constants_leave_the_choice_to_the_pack(tmp_path: Path) -> None:
    if not native_qgemm.available():
        pytest.skip("the int8 kernels need the native tier")
    planner.forget()
    path = _model(tmp_path, [("pointwise", 32, 48, 1, 1, 0, False),
                             ("depthwise", 48, 48, 3, 48, 0, True)], c=32,
                  weight_input=(48, 32, 1, 1))
    model = keel.load_model(str(path), threads=2)
    first = _plans(model)["pointwise"]
    assert first.layout == "nchw->nhwc" and first.plan.option("int8_kernel") is None
    assert "chosen when the weights are packed" in first.plan.reason("layout")
    weights = RNG.integers(-60, 60, (48, 32, 1, 1)).astype(np.int8)
    _agrees(path, {"x": RNG.integers(0, 256, (3, 32, 9, 9)).astype(np.uint8),
                   "pointwise_w": weights})


def test_panels_on_a_bias_that_is_no_constant_say_the_fold_is_checked_when_packed(
        tmp_path: Path) -> None:
    """Symmetric 1x1 weights whose bias is a graph input: the panels are the plan's kernel,
    and its reason says that whether the folded bias fits is decided when it is packed."""
    if not native_qgemm.available():
        pytest.skip("the int8 kernels need the native tier")
    planner.forget()
    path = _model(tmp_path, [("pointwise", 32, 48, 1, 1, 0, True),
                             ("depthwise", 48, 48, 3, 48, 0, True)], c=32)
    proto = onnx.load(str(path))
    bias = next(t for t in proto.graph.initializer if t.name == "pointwise_b")
    proto.graph.initializer.remove(bias)
    proto.graph.input.append(helper.make_tensor_value_info("pointwise_b", TensorProto.INT32,
                                                           [48]))
    onnx.save(proto, str(path))
    model = keel.load_model(str(path), threads=2)
    first = _plans(model)["pointwise"]
    assert first.plan.option("int8_kernel") == "panels"
    assert "decided when it is packed" in first.plan.reason("int8_kernel")
    assert "decided when it is packed" not in _plans(model)["depthwise"].plan.reason(
        "int8_kernel")
    _agrees(path, {"x": RNG.integers(0, 256, (3, 32, 9, 9)).astype(np.uint8),
                   "pointwise_b": numpy_helper.to_array(bias)})
