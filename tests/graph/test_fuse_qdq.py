"""QDQ models run on integer nodes: onnxruntime's quantize_static output, loaded by keel,
has its quantized Conv/Gemm/MatMul replaced by QLINEAR_CONV/QGEMM/QLINEAR_MATMUL reading
int8 weights; the cpu backend agrees with the reference backend, and both with
onnxruntime within a few quantization steps of the logits (the exact agreement of the integer
kernels themselves is tests/native/test_qgemm.py's)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

import keel
from keel.graph.export import to_onnx
from keel.graph.importers.onnx import import_onnx
from keel.graph.passes import optimize
from keel.ops.registry import Op
from keel.testing import models

ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")


def _quantized(tmp_path: Path, proto: Any, fmt: str = "qdq", per_channel: bool = True) -> Path:
    """``proto`` quantized by onnxruntime (uint8 activations, int8 weights)."""
    src, dst = tmp_path / "float.onnx", tmp_path / f"{fmt}.onnx"
    onnx.save(proto, str(src))
    feeds = [models.make_inputs(proto, batch=4, seed=s) for s in range(3)]

    class Reader(quantization.CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.items = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    quantization.quantize_static(
        str(src), str(dst), Reader(), per_channel=per_channel,
        quant_format=(quantization.QuantFormat.QDQ if fmt == "qdq"
                      else quantization.QuantFormat.QOperator),
        activation_type=quantization.QuantType.QUInt8,
        weight_type=quantization.QuantType.QInt8)
    return dst


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def _last_scale(path: Path) -> float:
    """The scale of the last QuantizeLinear: one step of the quantized logits."""
    model = onnx.load(str(path))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    q = [n for n in model.graph.node if n.op_type == "QuantizeLinear"][-1]
    return float(inits[q.input[1]])


@pytest.mark.parametrize("per_channel", [True, False])
def test_lenet_qdq_runs_on_integer_nodes_as_onnxruntime_does(tmp_path: Path,
                                                             per_channel: bool) -> None:
    path = _quantized(tmp_path, models.lenet(), per_channel=per_channel)
    graph = optimize(import_onnx(str(path)))
    ops = Counter(n.op for n in graph.nodes)
    assert ops[Op.QLINEAR_CONV] == 2 and ops[Op.QGEMM] >= 1
    assert ops[Op.CONV] == 0 and ops[Op.GEMM] == 0
    int8 = [a for a in graph.initializers.values() if a.dtype == np.int8]
    assert int8 and sum(a.size for a in int8) > 0.9 * sum(
        a.size for a in graph.initializers.values() if a.dtype.kind in "fi" and a.ndim > 1)
    feeds = models.make_inputs(models.lenet(), batch=5, seed=9)
    want = _ort(path, feeds)
    got = keel.load_model(str(path), threads=1).predict(feeds)
    ref = keel.load_model(str(path), backend="reference").predict(feeds)
    step = _last_scale(path)
    for name, value in want.items():
        # Float ops between the integer nodes (the average pool) sum in their own order,
        # so a value on a rounding boundary may quantize one step apart.
        assert np.max(np.abs(got[name] - ref[name])) <= 4 * step
        assert np.max(np.abs(got[name] - value)) <= 4 * step
        assert (got[name].argmax(-1) == value.argmax(-1)).mean() >= 4 / 5


def _folded_and_quantized(tmp_path: Path, proto: Any, fmt: str) -> Path:
    """``proto`` with BatchNorm folded first (as onnxruntime's quantization
    pre-processing does), then quantized by onnxruntime in format ``fmt``."""
    folded = tmp_path / "folded.onnx"
    onnx.save(to_onnx(optimize(import_onnx(proto))), str(folded))
    return _quantized(tmp_path, onnx.load(str(folded)), fmt=fmt)


def _agrees_with_onnxruntime(path: Path, proto: Any, threads: int) -> None:
    feeds = models.make_inputs(proto, batch=6, seed=2)
    want = _ort(path, feeds)
    got = keel.load_model(str(path), threads=threads).predict(feeds)
    step = _last_scale(path)
    for key, value in want.items():
        # a one-step difference inside may move a logit by a few of its own steps
        assert np.max(np.abs(got[key] - value)) <= 4 * step
        assert (got[key].argmax(-1) == value.argmax(-1)).mean() >= 5 / 6


def test_resnet_block_qdq_agrees_with_onnxruntime(tmp_path: Path) -> None:
    path = _folded_and_quantized(tmp_path, models.resnet_block(), "qdq")
    _agrees_with_onnxruntime(path, models.resnet_block(), threads=2)


@pytest.mark.parametrize("name", ["lenet", "resnet_block"])
def test_qoperator_models_with_com_microsoft_ops_run(tmp_path: Path, name: str) -> None:
    """QOperator form: QLinearConv, com.microsoft QGemm, QLinearAdd,
    QLinearGlobalAveragePool."""
    proto = getattr(models, name)()
    path = _folded_and_quantized(tmp_path, proto, "qoperator")
    domains = {(n.domain, n.op_type) for n in onnx.load(str(path)).graph.node}
    assert ("com.microsoft", "QGemm") in domains
    graph = optimize(import_onnx(str(path)))
    assert not {Op.CONV, Op.GEMM, Op.MATMUL} & {n.op for n in graph.nodes}
    _agrees_with_onnxruntime(path, proto, threads=1)


@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
def test_residual_joins_become_qlinear_add(tmp_path: Path, fmt: str) -> None:
    """DQ → Add → Q (QDQ: onnxruntime folds the ReLU into Q's range) and com.microsoft
    QLinearAdd (QOperator) both load as one QLINEAR_ADD; keel's cpu and reference
    backends give onnxruntime's bits."""
    proto = models.resnet_block()
    path = _folded_and_quantized(tmp_path, proto, fmt)
    graph = optimize(import_onnx(str(path)))
    ops = Counter(n.op for n in graph.nodes)
    assert ops[Op.QLINEAR_ADD] == 1 and ops[Op.ADD] == 0
    feeds = models.make_inputs(proto, batch=3, seed=5)
    got = keel.load_model(str(path), threads=2).predict(feeds)
    ref = keel.load_model(str(path), backend="reference").predict(feeds)
    want = _ort(path, feeds)
    for name, value in ref.items():
        np.testing.assert_array_equal(got[name], value)
        np.testing.assert_array_equal(value, want[name])


def _const(name: str, value: Any) -> Any:
    return onnx.numpy_helper.from_array(np.asarray(value), name)


def _join(zero_point: int, z_zero_point: Any) -> Any:
    """quantize(x) and quantize(z) (z with ``z_zero_point``, and its type), dequantized,
    added, ReLU, quantized with ``zero_point``, dequantized: a residual join in QDQ form
    with its ReLU kept."""
    from onnx import TensorProto, helper

    const = _const
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("QuantizeLinear", ["z", "sz", "zz"], ["zq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["zq", "sz", "zz"], ["zd"]),
             helper.make_node("Add", ["xd", "zd"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "sy", "zy"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"])]
    inits = [const("sx", np.float32(0.031)), const("zx", np.uint8(120)),
             const("sz", np.float32(0.017)), const("zz", z_zero_point),
             const("sy", np.float32(0.029)), const("zy", np.uint8(zero_point))]
    shape = [2, 8, 9, 9]
    graph = helper.make_graph(
        nodes, "join", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                        for n in ("x", "z")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize(("zero_point", "z_zero_point", "fused"),
                         [(0, np.uint8(133), True), (100, np.uint8(133), False),
                          (0, np.int8(-5), False)],
                         ids=["relu-redundant", "relu-changes-q", "two-types"])
def test_a_join_fuses_as_onnxruntime_does_and_gives_its_bits(
        tmp_path: Path, zero_point: int, z_zero_point: Any, fused: bool) -> None:
    """Q's zero point at its minimum makes the ReLU redundant: the join of one 8-bit type
    becomes one QLINEAR_ADD without it. A ReLU that changes what Q gives, or operands of
    two types, leave the join as written (as onnxruntime leaves it). Every case gives
    onnxruntime's bytes exactly."""
    proto = _join(zero_point, z_zero_point)
    ops = Counter(n.op for n in optimize(import_onnx(proto)).nodes)
    assert (ops[Op.QLINEAR_ADD], ops[Op.ADD], ops[Op.RELU]) == ((1, 0, 0) if fused else (0, 1, 1))
    rng = np.random.default_rng(3)
    feeds = {n: rng.uniform(-3, 3, (2, 8, 9, 9)).astype(np.float32) for n in ("x", "z")}
    path = tmp_path / "join.onnx"
    onnx.save(proto, str(path))
    want = _ort(path, feeds)
    for threads in (1, 2):
        got = keel.load_model(proto, threads=threads).predict(feeds)
        np.testing.assert_array_equal(got["y"], want["y"])
    ref = keel.load_model(proto, backend="reference").predict(feeds)
    np.testing.assert_array_equal(ref["y"], want["y"])


def _pooled(out_scale: float) -> Any:
    """Q → DQ → MaxPool (padded) → Q → DQ → Flatten → Q → DQ, the second Q with
    ``out_scale`` (the first DQ's scale is 0.05)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("MaxPool", ["xd"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["p", "so", "z"], ["pq"]),
             helper.make_node("DequantizeLinear", ["pq", "so", "z"], ["pd"]),
             helper.make_node("Flatten", ["pd"], ["f"]),
             helper.make_node("QuantizeLinear", ["f", "so", "z"], ["fq"]),
             helper.make_node("DequantizeLinear", ["fq", "so", "z"], ["y"])]
    inits = [_const("s", np.float32(0.05)), _const("so", np.float32(out_scale)),
             _const("z", np.uint8(131))]
    graph = helper.make_graph(
        nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 9, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 75])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("out_scale", [0.05, 0.07], ids=["same-scale", "other-scale"])
def test_max_pool_and_flatten_between_equal_parameters_run_on_integers(
        out_scale: float) -> None:
    proto = _pooled(out_scale)
    graph = optimize(import_onnx(proto))
    made = graph.producers()
    pool = next(n for n in graph.nodes if n.op is Op.MAX_POOL)
    flat = next(n for n in graph.nodes if n.op is Op.FLATTEN)
    reads_integers = made[pool.inputs[0]].op is Op.QUANTIZE_LINEAR
    assert reads_integers == (out_scale == 0.05)
    # the Flatten's parameters match either way: it reads the integers of what precedes it
    assert made[flat.inputs[0]].op is (Op.MAX_POOL if reads_integers else Op.QUANTIZE_LINEAR)
    rng = np.random.default_rng(4)
    feeds = {"x": rng.uniform(-8, 5, (2, 3, 9, 9)).astype(np.float32)}
    want = keel.load_model(proto, optimization_level="none", backend="reference").predict(feeds)
    for threads in (1, 2):
        got = keel.load_model(proto, threads=threads).predict(feeds)
        np.testing.assert_array_equal(got["y"], want["y"])
