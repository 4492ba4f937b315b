"""``keel convert``: ONNX → .keel / ONNX, sizes and passes reported, quantization, errors exit 2."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from rich.console import Console

from keel.cli import main
from keel.cli.convert import calibration_progress, convert_model
from keel.cli.demo import load_demo_data
from keel.execution.model import load_model
from keel.formats.keel_format import load_keel
from keel.graph.importers.onnx import import_onnx
from tests.graph import models as M
from tests.graph.interp import run_graph
from tests.graph.models import rel_l2, rng
from tests.graph.test_passes import feeds_of


@pytest.fixture()
def onnx_path(tmp_path: Path) -> Path:
    path = tmp_path / "block.onnx"
    onnx.save(M.conv_bn_block(rng(0)), str(path))
    return path


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code in (0, None)
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def test_convert_to_keel_reports_sizes_and_passes(onnx_path: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "block.keel"
    report = _run(capsys, "convert", str(onnx_path), "-o", str(out), "--json")
    assert report["input"]["nodes"] == 7 and report["output"]["nodes"] == 2
    assert report["output"]["file_bytes"] == out.stat().st_size
    assert report["passes_applied"][:3] == ["fuse_conv_bn", "fuse_residual", "fuse_activation"]
    original = import_onnx(onnx_path)
    converted = load_keel(out)
    feeds = feeds_of(original, rng(2))
    assert rel_l2(run_graph(converted, feeds)["y"], run_graph(original, feeds)["y"]) < 1e-5


def test_convert_to_onnx_with_a_level(onnx_path: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "basic.onnx"
    report = _run(capsys, "convert", str(onnx_path), "-o", str(out), "-O", "basic", "--json")
    assert report["optimization_level"] == "basic" and report["output"]["format"] == "onnx"
    onnx.checker.check_model(onnx.load(str(out)))


def test_convert_keel_to_keel_with_options(onnx_path: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    first = tmp_path / "a.keel"
    _run(capsys, "convert", str(onnx_path), "-o", str(first), "--json")
    report = _run(capsys, "convert", str(first), "-o", str(tmp_path / "b.keel"), "--compress",
                  "--fp16", "--json")
    assert report["options"] == {"compress": True, "fp16": True, "keel_ops": False}
    assert report["output"]["file_bytes"] < report["input"]["file_bytes"]


def test_convert_prints_a_table(onnx_path: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["convert", str(onnx_path), "-o", str(tmp_path / "t.keel")])
    text = capsys.readouterr().out
    assert "nodes" in text and "fuse_conv_bn" in text


@pytest.mark.parametrize("args, match", [
    (["-o", "out.txt"], "must end in .keel or .onnx"),
    (["-o", "out.keel", "-O", "max"], "unknown optimization level"),
])
def test_convert_errors_exit_2(onnx_path: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str], args: list[str],
                               match: str) -> None:
    args = [a if not a.startswith("out") else str(tmp_path / a) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(onnx_path), *args])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_convert_corrupt_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x0f\xff garbage")
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(bad), "-o", str(tmp_path / "x.keel")])
    assert exit_info.value.code == 2
    assert "MODEL_FORMAT" in capsys.readouterr().err


# ---- --quantize ---------------------------------------------------------------------------------
@pytest.fixture()
def digits(tmp_path: Path) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    """The bundled digits model as a file, 120 calibration samples, and the rest to test on."""
    model, x, y = load_demo_data()
    path = tmp_path / "digits.onnx"
    path.write_bytes(model)
    calibration = tmp_path / "calibration.npz"
    np.savez(calibration, pixels=x[:120])
    return path, calibration, x[120:], y[120:]


def _accuracy(model_path: Path, x: np.ndarray, y: np.ndarray) -> float:
    probs = load_model(str(model_path), backend="cpu").predict({"pixels": x})["probabilities"]
    return float(np.mean(probs.argmax(axis=1) == y))


def test_convert_quantize_int8_weight_only_keel(digits: Any, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    src, _, x, y = digits
    plain, small = tmp_path / "f.keel", tmp_path / "q.keel"
    _run(capsys, "convert", str(src), "-o", str(plain), "--json")
    report = _run(capsys, "convert", str(src), "-o", str(small), "--quantize", "int8",
                  "--json")
    q = report["quantization"]
    assert q["mode"] == "weight-only" and q["weight_dtype"] == "int8"
    assert q["quantized_nodes"] == 3 and q["quantized_weights"] == 3 and q["calibration"] is None
    assert q["weight_bytes_after"] < 0.3 * q["weight_bytes_before"]
    assert report["output"]["file_bytes"] == small.stat().st_size
    assert small.stat().st_size < 0.35 * plain.stat().st_size
    assert report["output"]["ops"]["dequantize_linear"] == 3
    assert abs(_accuracy(small, x, y) - _accuracy(src, x, y)) <= 0.01


def test_convert_quantize_qdq_onnx_runs_in_onnxruntime(digits: Any, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import onnxruntime as ort

    src, calibration, x, y = digits
    out = tmp_path / "q.onnx"
    report = _run(capsys, "convert", str(src), "-o", str(out), "--quantize", "int8",
                  "--quantize-mode", "qdq", "--calibration", str(calibration),
                  "--calibration-method", "percentile", "--percentile", "99.999",
                  "--calibration-batch-size", "16", "--json")
    q = report["quantization"]
    assert q["mode"] == "qdq" and q["activation_dtype"] == "uint8"
    assert q["calibration"] == {"samples": 120, "method": "percentile", "percentile": 99.999}
    assert q["calibration_file"] == str(calibration) and q["quantized_activations"] > 0
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in model.graph.node}
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    probs = sess.run(None, {"pixels": x})[0]
    assert abs(float(np.mean(probs.argmax(axis=1) == y)) - _accuracy(src, x, y)) <= 0.01


def test_convert_quantize_prints_what_it_did(digits: Any, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    src, calibration, _, _ = digits
    with pytest.raises(SystemExit):
        main(["convert", str(src), "-o", str(tmp_path / "q.keel"), "--quantize", "int16",
              "--quantize-mode", "qdq", "--calibration", str(calibration),
              "--activation-dtype", "int16"])
    text = " ".join(capsys.readouterr().out.split())
    assert "quantized 3 nodes to int16 (qdq, activations int16 from 120 samples" in text


def test_reconverting_a_quantized_model_keeps_it_quantized(
        digits: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = digits[0]
    first, again, exported = tmp_path / "a.keel", tmp_path / "b.keel", tmp_path / "c.onnx"
    _run(capsys, "convert", str(src), "-o", str(first), "--quantize", "int8", "--json")
    report = _run(capsys, "convert", str(first), "-o", str(again), "--json")
    assert report["output"]["ops"].get("dequantize_linear") == 3
    assert again.stat().st_size <= first.stat().st_size + 1024
    _run(capsys, "convert", str(again), "-o", str(exported), "--json")
    inits = onnx.load(str(exported)).graph.initializer
    assert sum(t.data_type == onnx.TensorProto.INT8 for t in inits) >= 3


@pytest.mark.parametrize("args, match", [
    (["--quantize", "int4"], "unknown quantization bits 'int4'"),
    (["--quantize", "int8", "--quantize-mode", "dynamic"], "unknown quantization mode 'dynamic'"),
    (["--quantize", "int8", "--quantize-mode", "qdq"], "qdq quantization needs calibration data"),
    (["--quantize", "int8", "--quantize-mode", "qdq", "--calibration", "bad.npz"],
     "no samples for input 'pixels'"),
    (["--quantize", "int8", "--quantize-mode", "qdq", "--calibration", "shape.npz"],
     "input 'pixels' is declared"),
    (["--quantize-mode", "qdq"], "--quantize-mode: only used with --quantize"),
    (["--quantize", "int8", "--fp16"], "--fp16 cannot be combined with --quantize"),
    (["--quantize", "int8", "--calibration", "shape.npz"],
     "--calibration: only used with --quantize-mode qdq (not weight-only)"),
    (["--quantize", "int8", "--quantize-mode", "qdq", "--calibration", "shape.npz",
      "--percentile", "99"], "--percentile: only used with --calibration-method percentile"),
    (["--quantize", "int8", "--quantize-mode", "qdq", "--calibration", "shape.npz",
      "--calibration-method", "entropy"], "unknown calibration method 'entropy'"),
])
def test_convert_quantize_errors_exit_2_and_write_nothing(
        digits: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
        match: str) -> None:
    src = digits[0]
    np.savez(tmp_path / "bad.npz", x=np.zeros((4, 64), np.float32))
    np.savez(tmp_path / "shape.npz", pixels=np.zeros((4, 8, 8), np.float32))
    args = [str(tmp_path / a) if a.endswith(".npz") else a for a in args]
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    out.write_bytes(b"previous")
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(src), "-o", str(out), *args])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err
    assert out.read_bytes() == b"previous" and os.listdir(out.parent) == ["q.onnx"]


def test_onnx_output_is_written_atomically(onnx_path: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "m.onnx"
    out.write_bytes(b"previous")

    def broken_save(proto: Any, path: str, **kw: Any) -> None:
        Path(path).write_bytes(b"half a mod")
        raise OSError("disk full")

    monkeypatch.setattr(onnx, "save_model", broken_save)
    with pytest.raises(OSError, match="disk full"):
        convert_model(onnx_path, out)
    assert out.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["block.onnx", "m.onnx"]


def test_calibration_progress_bar_on_a_terminal() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    with calibration_progress(console) as update:
        for done in (32, 64, 96, 100):
            update(done, 100)
    assert "calibrating" in buf.getvalue() and "100/100" in buf.getvalue()
    quiet = io.StringIO()
    with calibration_progress(Console(file=quiet, force_terminal=True)) as update:
        update(10, 10)                   # one batch did it all: no bar
    assert quiet.getvalue() == ""
