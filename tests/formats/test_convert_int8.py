"""``keel convert --quantize int8 --quantize-mode qdq``: onnxruntime runs the output, keel
runs it on integer nodes (QGEMM, QLINEAR_CONV with int8 weights), the two agree, and top-1
stays with the float model's (the bundled digits demo and a LeNet)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from keel import load_model
from keel.cli.convert import convert_model
from keel.cli.demo import load_demo_data
from keel.graph.importers.onnx import import_onnx
from keel.graph.passes import optimize
from keel.graph.quantize import QuantizeOptions
from keel.ops.registry import Op
from keel.testing import models

ort = pytest.importorskip("onnxruntime")
QDQ = QuantizeOptions(8, "qdq")


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, feeds)[0])


def _ops(path: Path) -> Counter[Op]:
    return Counter(n.op for n in optimize(import_onnx(str(path))).nodes)


def test_digits_demo_int8_agrees_with_float_and_onnxruntime(tmp_path: Path) -> None:
    model, x, y = load_demo_data()
    src, calibration, out = tmp_path / "f.onnx", tmp_path / "c.npz", tmp_path / "q.onnx"
    src.write_bytes(model)
    np.savez(calibration, pixels=x[:120])
    convert_model(src, out, quantize=QDQ, calibration=calibration)
    ops = _ops(out)
    assert ops[Op.QGEMM] == 3 and ops[Op.GEMM] == 0
    test = {"pixels": x[120:]}
    fp32 = load_model(str(src)).predict(test)["probabilities"].argmax(1)
    int8 = load_model(str(out)).predict(test)["probabilities"].argmax(1)
    theirs = _ort(out, test).argmax(1)
    assert np.mean(int8 == fp32) >= 0.98
    assert np.mean(int8 == theirs) >= 0.99
    assert abs(np.mean(int8 == y[120:]) - np.mean(fp32 == y[120:])) <= 0.01


def test_lenet_int8_runs_on_integer_convolutions_in_keel_and_onnxruntime(tmp_path: Path) -> None:
    proto = models.lenet()
    src, calibration, out = tmp_path / "f.onnx", tmp_path / "c.npz", tmp_path / "q.onnx"
    onnx.save(proto, str(src))
    name = proto.graph.input[0].name
    samples = models.make_inputs(proto, batch=64, seed=1)[name]
    np.savez(calibration, **{name: samples})
    convert_model(src, out, quantize=QDQ, calibration=calibration)
    ops = _ops(out)
    assert ops[Op.QLINEAR_CONV] == 2 and ops[Op.CONV] == 0
    test = models.make_inputs(proto, batch=48, seed=2)
    fp32 = next(iter(load_model(str(src)).predict(test).values())).argmax(1)
    int8 = next(iter(load_model(str(out)).predict(test).values())).argmax(1)
    theirs = _ort(out, test).argmax(1)
    assert np.mean(int8 == fp32) >= 0.85
    assert np.mean(int8 == theirs) >= 0.95
