"""The int8 benchmark's machinery: onnxruntime-quantized zoo CNNs run in keel on integer
nodes with top-1 agreeing with float32, and the script writes its results (speed is
never asserted)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from benchmarks import int8
from keel.graph.importers.onnx import import_onnx
from keel.graph.passes import optimize
from keel.ops.registry import Op

pytest.importorskip("onnxruntime.quantization")


@pytest.mark.parametrize("name, floor", [("lenet", 0.85), ("resnet20", 0.9)])
def test_quantized_zoo_cnns_keep_their_top1(name: str, floor: float) -> None:
    model = int8.quantize(name)
    ops = Counter(n.op for n in optimize(import_onnx(model)).nodes)
    assert ops[Op.QLINEAR_CONV] >= 2 and ops[Op.CONV] == 0
    assert int8.top1_agreement(name, model, samples=64) >= floor


@pytest.mark.parametrize("name", ["lenet", "resnet20", "resnet18", "mobilenetv2"])
def test_quantized_zoo_cnns_give_onnxruntimes_outputs_exactly(name: str) -> None:
    """keel's integer kernels compute what onnxruntime's fused QDQ kernels compute (its
    float32 requantization, its QLinearAdd), so the dequantized logits are the same floats,
    on one thread and on two (MobileNetV2 runs its channels-last int8 chain)."""
    import onnxruntime as ort

    import keel

    model = int8.quantize(name)
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0]
    shape = [2 if not isinstance(d, int) else d for d in feed.shape]
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    want = session.run(None, {feed.name: x})[0]
    for threads in (1, 2):
        got = keel.load_model(model, threads=threads).run(None, {feed.name: x})[0]
        np.testing.assert_array_equal(got, want)


def test_the_script_writes_ratios_and_the_load(tmp_path: Path) -> None:
    assert int8.main(["--models", "lenet", "--batch", "4", "--passes", "1",
                      "--pass-seconds", "0.01", "--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("int8-*.json")
    payload = json.loads(written.read_text())
    assert payload["machine"]["cpu"]["logical_cores"]       # the machine that measured it
    row = payload["rows"][0]
    assert row["model"] == "lenet" and row["ratios (keel time / onnxruntime time)"]
    assert "before" in row["load_average"] and 0.0 <= row["top1_agreement_with_fp32"] <= 1.0


def test_the_script_measures_each_thread_count(tmp_path: Path) -> None:
    assert int8.main(["--models", "lenet", "--batch", "4", "--passes", "1", "--threads", "1,2",
                      "--pass-seconds", "0.01", "--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("int8-*.json")
    row = json.loads(written.read_text())["rows"][0]
    assert set(row["ratios (keel time / onnxruntime time)"]) == {"b4_t1", "b4_t2"}
    cpu = row["cpu_time_ratio (keel / onnxruntime)"]
    assert set(cpu) == {"t1", "t2"} and all(v["ratio"] > 0 for v in cpu.values())


def test_the_profile_pairs_each_convolution_with_onnxruntimes(tmp_path: Path) -> None:
    """--profile: per-node times of both runtimes on the same file, LeNet's two
    convolutions paired by name, the other nodes summed per op, at each thread count."""
    assert int8.main(["--models", "lenet", "--batch", "4", "--passes", "1", "--threads", "1,2",
                      "--profile", "--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("int8-profile-*.json")
    rows = json.loads(written.read_text())["rows"]
    assert [r["threads"] for r in rows] == [1, 2]
    for row in rows:
        assert [c["node"] for c in row["convolutions"]] == ["Conv_4", "Conv_12"]
        assert all(c["keel_ms"] > 0 and c["onnxruntime_ms"] > 0 for c in row["convolutions"])
        assert "max_pool" in row["keel_other_ms"] and "QGemm" in row["onnxruntime_other_ms"]
