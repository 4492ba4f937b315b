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
