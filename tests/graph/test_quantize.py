"""int8/int16 quantization: the arithmetic, the rewrites, accuracy on keel and onnxruntime.

Accuracy bounds (relative L2 against the float model, measured on held-out inputs):
weight-only int8 < 2e-2, weight-only int16 < 1e-3; qdq int8 (minmax, 256 calibration
samples from the input distribution) < 5e-2; qdq int16 calibrated on the very inputs it
is measured on (no clipping, only rounding) < 1e-3. The bundled digits classifier keeps
its accuracy within one point after int8 quantization.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from keel.cli.demo import load_demo_data
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.execution.model import load_model
from keel.formats.keel_format import save_keel
from keel.graph.export import to_onnx
from keel.graph.importers.onnx import import_onnx
from keel.graph.ir import Graph
from keel.graph.passes import optimize
from keel.graph.quantize import (
    QuantizeOptions,
    activation_params,
    check_samples,
    quantize_graph,
    quantize_weight,
    quantize_with_report,
)
from keel.ops.registry import Op
from keel.ops.schemas.quantization import QUANT_RANGES
from keel.testing import models as TM
from tests.graph import models as M
from tests.graph.models import rel_l2

_TARGETS = (Op.CONV, Op.GEMM, Op.MATMUL)


# ---- fixtures ------------------------------------------------------------------------------
_PROTOS: dict[str, Any] = {}


def proto(name: str) -> Any:
    if name not in _PROTOS:
        _PROTOS[name] = {"mlp": lambda: TM.mlp(64, (128, 64), 10),
                         "lenet": lambda: TM.lenet(1, 28, 10),
                         "transformer": lambda: TM.transformer_encoder(layers=1)}[name]()
    return _PROTOS[name]


def float_graph(name: str, level: str = "all") -> Graph:
    return optimize(import_onnx(proto(name)), level)


def inputs(name: str, batch: int, seed: int) -> dict[str, np.ndarray]:
    return TM.make_inputs(proto(name), batch, seed=seed)


def keel_run(graph: Graph, feeds: dict[str, np.ndarray], **kw: Any) -> dict[str, np.ndarray]:
    return load_model(graph, backend="cpu", **kw).predict(feeds)


def ort_run(graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(to_onnx(graph).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds), strict=True))


def ops(graph: Graph) -> list[Op]:
    return [n.op for n in graph.nodes]


# ---- arithmetic ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DType.INT8, DType.INT16])
def test_weights_are_symmetric_per_output_channel(dtype: DType) -> None:
    w = M.rng(0).standard_normal((6, 3, 3, 3)).astype(np.float32)
    w[2] *= 100.0                      # one channel far larger: its scale must not leak
    w[4] = 0.0
    q, scale = quantize_weight(w, 0, dtype)
    qmax = QUANT_RANGES[dtype][1]
    assert q.dtype == dtype.numpy and scale.dtype == np.float32 and scale.shape == (6,)
    assert np.all(np.abs(q.astype(np.int64)) <= qmax)
    for c in (0, 1, 2, 3, 5):
        assert np.abs(q[c]).max() == qmax       # each channel uses the whole range
    assert scale[4] == 1.0 and not q[4].any()  # an all-zero channel stays exact
    err = np.abs(q.astype(np.float64) * scale[:, None, None, None] - w)
    assert np.all(err <= scale[:, None, None, None] / 2 * (1 + 1e-6))


def test_per_tensor_and_last_axis_weights() -> None:
    w = M.rng(1).standard_normal((5, 7)).astype(np.float32)
    q, scale = quantize_weight(w, None, DType.INT8)
    assert scale.shape == () and np.isclose(scale, np.abs(w).max() / 127)
    assert np.abs(q.astype(np.int64)).max() == 127
    q1, s1 = quantize_weight(w, 1, DType.INT8)
    assert s1.shape == (7,) and np.allclose(s1, np.abs(w).max(axis=0) / 127)
    assert np.abs(q1.astype(np.float64) * s1 - w).max() <= s1.max() / 2 * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [DType.UINT8, DType.INT8, DType.UINT16, DType.INT16])
def test_activation_range_maps_onto_the_integer_range(dtype: DType) -> None:
    qmin, qmax = QUANT_RANGES[dtype]
    scale, zp = activation_params(-1.5, 4.0, dtype, np.dtype(np.float32))
    assert scale.dtype == np.float32 and zp.dtype == dtype.numpy and zp.shape == ()
    assert np.isclose(float(scale), 5.5 / (qmax - qmin))
    # 0 is exact; the ends land on the ends of the integer range.
    assert round(-1.5 / float(scale)) + int(zp) == qmin
    assert round(4.0 / float(scale)) + int(zp) in (qmax, qmax - 1)


def test_activation_range_always_holds_zero_and_a_positive_scale() -> None:
    scale, zp = activation_params(2.0, 6.0, DType.UINT8, np.dtype(np.float32))
    assert int(zp) == 0 and np.isclose(float(scale), 6.0 / 255)     # widened to [0, 6]
    scale, zp = activation_params(0.0, 0.0, DType.UINT8, np.dtype(np.float32))
    assert float(scale) == 1.0 and int(zp) == 0


# ---- weight-only ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "lenet"])
@pytest.mark.parametrize("bits, bound", [(8, 2e-2), (16, 1e-3)])
def test_weight_only_stays_close_on_keel_and_onnxruntime(name: str, bits: int,
                                                         bound: float) -> None:
    g = float_graph(name)
    report = quantize_with_report(g, QuantizeOptions(bits, "weight-only"))
    q = report.graph
    assert len(report.quantized_nodes) == sum(op in _TARGETS for op in ops(g))
    assert ops(q).count(Op.DEQUANTIZE_LINEAR) == report.quantized_weights > 0
    assert Op.QUANTIZE_LINEAR not in ops(q)
    ints = [a for a in q.initializers.values() if a.dtype == np.dtype(f"int{bits}")]
    assert len(ints) == 2 * report.quantized_weights          # integers and zero points
    assert report.weight_bytes_after < (0.3 if bits == 8 else 0.55) * report.weight_bytes_before
    feeds = inputs(name, 16, seed=1)
    ref = keel_run(g, feeds)
    for out in (keel_run(q, feeds), ort_run(q, feeds)):
        for k in ref:
            assert rel_l2(out[k], ref[k]) < bound, (k, rel_l2(out[k], ref[k]))


def test_weight_only_file_shrinks_and_folds_back_at_load(tmp_path: Any) -> None:
    g = float_graph("lenet")
    q = quantize_graph(g, "int8", "weight-only")
    float_file, int8_file = tmp_path / "f.keel", tmp_path / "q.keel"
    save_keel(g, float_file)
    save_keel(q, int8_file)
    ratio = float_file.stat().st_size / int8_file.stat().st_size
    assert ratio > 3.5, ratio
    # Loading (optimized, the default) folds each dequantization once into a float
    # weight: no per-run work. Unoptimized, the integers stay and are dequantized per run.
    folded = load_model(str(int8_file), backend="cpu")
    kept = load_model(str(int8_file), backend="cpu", optimization_level="none")
    assert Op.DEQUANTIZE_LINEAR not in ops(folded.graph)
    assert ops(kept.graph).count(Op.DEQUANTIZE_LINEAR) == 5
    assert any(a.dtype == np.int8 for a in kept.graph.initializers.values())
    feeds = inputs("lenet", 4, seed=3)
    np.testing.assert_allclose(folded.predict(feeds)["logits"], kept.predict(feeds)["logits"],
                               rtol=1e-5, atol=1e-5)


def test_weight_only_runs_with_a_pinned_int8_precision() -> None:
    q = quantize_graph(float_graph("mlp"), 8, "weight-only")
    feeds = inputs("mlp", 4, seed=1)
    # Unoptimized, so the dequantization nodes that mark the model quantized stay.
    pinned = keel_run(q, feeds, precision="int8", optimization_level="none")["probs"]
    np.testing.assert_allclose(pinned, keel_run(q, feeds)["probs"], rtol=1e-5, atol=1e-6)


def test_weight_axes_follow_each_op() -> None:
    g = float_graph("mlp", "basic")         # Gemm with trans_b, then MatMul + Add twice
    q = quantize_graph(g, 8, "weight-only")
    producers = q.producers()
    found = []
    for n in q.nodes:
        if n.op in _TARGETS:
            dq = producers[n.inputs[1]]
            w, scale = (q.initializers[i] for i in dq.inputs[:2])
            found.append((n.op, w.shape, dq.attrs["axis"], scale.shape))
    assert found == [
        (Op.GEMM, (128, 64), 0, (128,)),    # B is [N, K] under trans_b: channels on axis 0
        (Op.MATMUL, (128, 64), 1, (64,)),   # B is [K, N]: channels on the last axis
        (Op.MATMUL, (64, 10), 1, (10,)),
    ]


def test_a_weight_read_by_other_ops_stays_float_for_them() -> None:
    w = M.rng(0).standard_normal((4, 4)).astype(np.float32)
    m = M.model([helper.make_node("MatMul", ["x", "w"], ["y"]),
                 helper.make_node("Add", ["y", "w"], ["z"])],
                [M.vi("x", [4, 4])], [M.vi("z", [4, 4])], [M.init("w", w)])
    g = import_onnx(m)
    q = quantize_graph(g, 8, "weight-only")
    assert "w" in q.initializers and q.initializers["w"].dtype == np.float32
    add = next(n for n in q.nodes if n.op is Op.ADD)
    assert add.inputs[1] == "w"
    x = M.rng(1).standard_normal((4, 4)).astype(np.float32)
    assert rel_l2(keel_run(q, {"x": x})["z"], keel_run(g, {"x": x})["z"]) < 2e-2


def test_quantizing_is_deterministic() -> None:
    g = float_graph("lenet")
    cal = {"x": inputs("lenet", 32, seed=2)["x"]}
    a = quantize_graph(g, 8, "qdq", cal)
    b = quantize_graph(g, 8, "qdq", cal)
    assert a.initializers.keys() == b.initializers.keys()
    for k, v in a.initializers.items():
        assert v.dtype == b.initializers[k].dtype and np.array_equal(v, b.initializers[k])


# ---- qdq -------------------------------------------------------------------------------------
def _producer_op(g: Graph, value: str) -> Op | None:
    node = g.producers().get(value)
    return None if node is None else node.op


def test_qdq_wraps_every_target_in_standard_qdq_pairs() -> None:
    g = float_graph("lenet")
    report = quantize_with_report(g, QuantizeOptions(8, "qdq"),
                                  {"x": inputs("lenet", 64, seed=2)["x"]})
    q = report.graph
    assert report.calibration_samples == 64 and report.skipped == ()
    assert q.input_names == g.input_names and q.output_names == g.output_names
    producers = q.producers()
    for n in q.nodes:
        if n.op not in _TARGETS:
            continue
        x, w, b = (producers[n.inputs[i]] for i in range(3))
        assert x.op is Op.DEQUANTIZE_LINEAR and _producer_op(q, x.inputs[0]) is \
            Op.QUANTIZE_LINEAR
        assert q.initializers[x.inputs[2]].dtype == np.uint8       # activations: uint8
        assert w.op is Op.DEQUANTIZE_LINEAR and q.initializers[w.inputs[0]].dtype == np.int8
        assert b.op is Op.DEQUANTIZE_LINEAR and q.initializers[b.inputs[0]].dtype == np.int32
        # The bias scale is x_scale * w_scale, as QLinearConv/QGemm take it.
        np.testing.assert_allclose(q.initializers[b.inputs[1]],
                                   q.initializers[x.inputs[1]] * q.initializers[w.inputs[1]],
                                   rtol=1e-6)
    # The graph output (logits) keeps its float value: no pair after the last Gemm.
    assert _producer_op(q, "logits") is Op.GEMM


def test_qdq_export_is_fused_by_onnxruntime(tmp_path: Any) -> None:
    q = quantize_graph(float_graph("lenet"), 8, "qdq", {"x": inputs("lenet", 32, seed=2)["x"]})
    model = to_onnx(q)
    onnx.checker.check_model(model, full_check=True)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    # What onnxruntime made of the QDQ groups: integer kernels, no float Conv/Gemm left.
    fused = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert fused.count("QLinearConv") == 2 and "Conv" not in fused and "Gemm" not in fused


@pytest.mark.parametrize("name, out", [("mlp", "probs"), ("lenet", "logits")])
@pytest.mark.parametrize("activation", ["uint8", "int8"])
def test_qdq_int8_stays_within_its_bound_on_keel_and_onnxruntime(name: str, out: str,
                                                                 activation: str) -> None:
    g = float_graph(name)
    cal = inputs(name, 256, seed=2)
    q = quantize_graph(g, 8, "qdq", cal, activation_dtype=activation)
    feeds = inputs(name, 32, seed=1)
    ref = keel_run(g, feeds)[out]
    got_keel, got_ort = keel_run(q, feeds)[out], ort_run(q, feeds)[out]
    assert rel_l2(got_keel, ref) < 5e-2
    assert rel_l2(got_ort, ref) < 5e-2
    # onnxruntime's integer kernels and keel's float simulation agree closely.
    assert rel_l2(got_ort, got_keel) < 1e-2


@pytest.mark.parametrize("name, out", [("mlp", "probs"), ("lenet", "logits")])
def test_qdq_int16_rounding_error_is_small(name: str, out: str) -> None:
    g = float_graph(name)
    feeds = inputs(name, 32, seed=1)
    q = quantize_graph(g, "int16", "qdq", feeds)       # ranges of these very inputs
    assert any(a.dtype == np.uint16 for a in q.initializers.values())
    ref = keel_run(g, feeds)[out]
    assert rel_l2(keel_run(q, feeds)[out], ref) < 1e-3
    assert rel_l2(ort_run(q, feeds)[out], ref) < 1e-3


def test_qdq_quantizes_both_operands_of_an_activation_matmul() -> None:
    g = float_graph("transformer", "basic")         # attention as plain MatMuls
    cal = inputs("transformer", 32, seed=2)
    report = quantize_with_report(g, QuantizeOptions(8, "qdq"), cal)
    q = report.graph
    both = [n for n in q.nodes if n.op is Op.MATMUL and
            all(_producer_op(q, i) is Op.DEQUANTIZE_LINEAR for i in n.inputs[:2]) and
            not any(q.producers()[i].inputs[0] in q.initializers for i in n.inputs[:2])]
    assert len(both) == 2                           # Q·Kᵀ and P·V
    feeds = inputs("transformer", 4, seed=1)
    ref = keel_run(g, feeds)["logits"]
    assert rel_l2(keel_run(q, feeds)["logits"], ref) < 5e-2
    assert rel_l2(ort_run(q, feeds)["logits"], ref) < 5e-2


def test_percentile_calibration_ignores_rare_outliers() -> None:
    g = float_graph("mlp")
    cal = inputs("mlp", 512, seed=2)
    cal["x"][0, 0] = 1000.0                          # one wild sample value
    minmax = quantize_with_report(g, QuantizeOptions(8, "qdq"), cal)
    pct = quantize_with_report(g, QuantizeOptions(8, "qdq", method="percentile",
                                                  percentile=99.9), cal)
    assert minmax.ranges["x"][1] == 1000.0
    assert pct.ranges["x"][1] < 5.0
    feeds = inputs("mlp", 32, seed=1)
    ref = keel_run(g, feeds)["probs"]
    assert rel_l2(keel_run(pct.graph, feeds)["probs"], ref) < \
        rel_l2(keel_run(minmax.graph, feeds)["probs"], ref)


def test_calibration_reports_progress_per_batch() -> None:
    calls: list[tuple[int, int]] = []
    quantize_graph(float_graph("mlp"), 8, "qdq", inputs("mlp", 40, seed=2), batch_size=16,
                   progress=lambda done, total: calls.append((done, total)))
    assert calls == [(16, 40), (32, 40), (40, 40)]


def test_a_fixed_batch_input_takes_stacked_feeds() -> None:
    m = proto("mlp")
    fixed = onnx.ModelProto()
    fixed.CopyFrom(m)
    fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    g = optimize(import_onnx(fixed), "all")
    x = inputs("mlp", 24, seed=2)["x"]
    calls: list[tuple[int, int]] = []
    a = quantize_graph(g, 8, "qdq", {"x": x}, progress=lambda d, t: calls.append((d, t)))
    b = quantize_graph(g, 8, "qdq", {"x": x.reshape(6, 4, 64)})
    assert calls[0] == (4, 24) and len(calls) == 6             # fed 4 at a time
    for k, v in a.initializers.items():
        assert np.array_equal(v, b.initializers[k])
    with pytest.raises(InvalidArgumentError, match=r"'x' has a fixed batch of 4; its 10"):
        quantize_graph(g, 8, "qdq", {"x": x[:10]})


# ---- the bundled digits classifier ---------------------------------------------------------------
@pytest.fixture(scope="module")
def digits() -> tuple[Graph, np.ndarray, np.ndarray]:
    model, x, y = load_demo_data()
    return optimize(import_onnx(model), "all"), x, y


def _accuracy(probs: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(probs.argmax(axis=1) == y))


@pytest.mark.parametrize("mode", ["weight-only", "qdq"])
def test_digits_accuracy_holds_within_one_point_after_int8(
        digits: tuple[Graph, np.ndarray, np.ndarray], mode: str) -> None:
    g, x, y = digits
    # Calibrate on the first 120 held-out samples, measure on the 240 it never saw.
    cal, test_x, test_y = x[:120], x[120:], y[120:]
    q = quantize_graph(g, 8, mode, {"pixels": cal} if mode == "qdq" else None)
    base = _accuracy(keel_run(g, {"pixels": test_x})["probabilities"], test_y)
    assert base > 0.9
    got = _accuracy(keel_run(q, {"pixels": test_x})["probabilities"], test_y)
    got_ort = _accuracy(ort_run(q, {"pixels": test_x})["probabilities"], test_y)
    assert abs(got - base) <= 0.01 and abs(got_ort - base) <= 0.01, (base, got, got_ort)


# ---- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, "int4", "float16", True, None])
def test_unknown_bits_are_named(bits: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"unknown quantization bits {bits!r}"):
        quantize_graph(float_graph("mlp"), bits, "weight-only")


@pytest.mark.parametrize("mode", ["dynamic", "", 3])
def test_unknown_modes_are_named(mode: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"unknown quantization mode {mode!r}"):
        quantize_graph(float_graph("mlp"), 8, mode)


def test_qdq_needs_calibration_data() -> None:
    with pytest.raises(InvalidArgumentError,
                       match=r"qdq quantization needs calibration data.*samples for the model "
                             r"inputs \(x\).*\.npz"):
        quantize_graph(float_graph("mlp"), 8, "qdq")


def test_weight_only_refuses_calibration_data() -> None:
    with pytest.raises(InvalidArgumentError, match="only used by qdq"):
        quantize_graph(float_graph("mlp"), 8, "weight-only", inputs("mlp", 4, seed=0))


@pytest.mark.parametrize("samples, match", [
    ({"pixels": np.zeros((4, 64), np.float32)}, r"no samples for input 'x' \(it has: pixels\)"),
    ({"x": np.zeros((4, 63), np.float32)}, r"input 'x' is declared \(batch, 64\).*\(4, 63\) "
                                           r"\(dimension 1 must be 64\)"),
    ({"x": np.zeros((64,), np.float32)}, r"input 'x' .* must have rank 2 .* or 3"),
    ({"x": np.zeros((0, 64), np.float32)}, r"input 'x' has no samples"),
    ({"x": np.array([["a"] * 64])}, r"input 'x' takes float32; its samples are <U1"),
])
def test_ill_shaped_calibration_names_the_input(samples: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        quantize_graph(float_graph("mlp"), 8, "qdq", samples)


def test_integer_inputs_refuse_float_samples() -> None:
    g = float_graph("transformer")
    with pytest.raises(InvalidArgumentError, match=r"input 'tokens' takes int64; its samples "
                                                   r"are float32"):
        check_samples(g, {"tokens": np.zeros((2, 16), np.float32)})


def test_inputs_must_agree_on_the_sample_count() -> None:
    m = M.model([helper.make_node("MatMul", ["a", "b"], ["y"])],
                [M.vi("a", ["n", 3]), M.vi("b", [3, 2])], [M.vi("y", ["n", 2])])
    g = import_onnx(m)
    good = {"a": np.ones((6, 3), np.float32), "b": np.ones((2, 3, 2), np.float32)}
    assert check_samples(g, good).count == 6
    with pytest.raises(InvalidArgumentError, match=r"'b' has 9 samples but 'a' has 6"):
        check_samples(g, {**good, "b": np.ones((9, 2), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"different fixed batch sizes"):
        m2 = M.model([helper.make_node("Concat", ["a", "b"], ["y"], axis=0)],
                     [M.vi("a", [2, 3]), M.vi("b", [3, 3])], [M.vi("y", [5, 3])])
        check_samples(import_onnx(m2), {"a": np.ones((6, 3), np.float32),
                                        "b": np.ones((6, 3), np.float32)})


def test_calibration_files_are_checked(tmp_path: Any) -> None:
    g = float_graph("mlp")
    missing = tmp_path / "none.npz"
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        quantize_graph(g, 8, "qdq", str(missing))
    single = tmp_path / "one.npy"
    np.save(single, np.zeros((2, 64), np.float32))
    with pytest.raises(InvalidArgumentError, match="holds a single array"):
        quantize_graph(g, 8, "qdq", single)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(InvalidArgumentError, match="cannot read calibration file"):
        quantize_graph(g, 8, "qdq", junk)
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((3, 8, 8), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"calibration file .*wrong\.npz.*input 'x'"):
        quantize_graph(g, 8, "qdq", wrong)
    good = tmp_path / "good.npz"
    np.savez(good, x=inputs("mlp", 8, seed=2)["x"], labels=np.arange(8))
    assert Op.QUANTIZE_LINEAR in ops(quantize_graph(g, 8, "qdq", good))


@pytest.mark.parametrize("options, match", [
    ({"method": "entropy"}, r"unknown calibration method 'entropy'; allowed: minmax, "
                            r"percentile"),
    ({"percentile": 40.0}, r"percentile must be in \(50, 100\], got 40.0"),
    ({"batch_size": 0}, r"batch size must be a positive integer, got 0"),
    ({"activation_dtype": "uint16"}, r"activation dtype 'uint16' does not go with int8"),
])
def test_bad_options_are_named(options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        QuantizeOptions(8, "qdq", **options)


def test_unknown_keywords_are_named() -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown quantization option 'per_channel'; "
                                                   r"allowed: progress, method"):
        quantize_graph(float_graph("mlp"), 8, "weight-only", per_channel=False)
    with pytest.raises(InvalidArgumentError, match=r"percentile must be in \(50, 100\], got 'x'"):
        QuantizeOptions(8, "qdq", percentile="x")  # type: ignore[arg-type]


def test_an_already_quantized_graph_is_refused() -> None:
    q = quantize_graph(float_graph("mlp"), 8, "weight-only")
    with pytest.raises(InvalidArgumentError, match=r"already quantized \(3 quantization"):
        quantize_graph(q, 8, "weight-only")


def test_non_float_weights_are_left_alone_with_a_reason() -> None:
    m = M.model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                [M.vi("x", ["n", 2], TensorProto.INT32)], [M.vi("y", ["n", 2], TensorProto.INT32)],
                [M.init("w", np.ones((2, 2), np.int32))])
    report = quantize_with_report(import_onnx(m), QuantizeOptions(8, "weight-only"))
    assert report.quantized_nodes == ()
    assert "int32" in report.skipped[0][1]
    assert report.to_dict()["quantized_nodes"] == 0
