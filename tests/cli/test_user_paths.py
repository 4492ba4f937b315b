"""The command line as a new user meets it: version, input and dimension names, exit codes,
JSON errors, output that leads with the model, sizes in the user's unit, 80 columns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import keel
from keel import config
from keel.cli import main
from keel.cli.common import EXIT_FAILED, EXIT_MISMATCH
from keel.execution.model import load_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_keel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("KEEL_")]:
        monkeypatch.delenv(var)
    config.reload_settings()


def _keel(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``keel ARGS`` in this process: (exit code, stdout, stderr)."""
    code: Any = 0
    try:
        main(list(args))
    except SystemExit as done:
        code = done.code
    captured = capsys.readouterr()
    return int(code or 0), captured.out, captured.err


def _save(model: Any, path: Path) -> str:
    onnx.save(model, path)
    return str(path)


@pytest.fixture
def cnn(tmp_path: Path) -> str:
    """Conv → Relu → GlobalAveragePool on ``image`` of shape (N, 3, 8, 8)."""
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["image", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["logits"], name="pool")]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return _save(model, tmp_path / "cnn.onnx")


@pytest.fixture
def seq_model(tmp_path: Path) -> str:
    """``x`` (batch, seq, 256) @ W (256, 3): symbolic batch and sequence dimensions."""
    w = np.random.default_rng(1).standard_normal((256, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "seq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 3])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return _save(model, tmp_path / "seq.onnx")


# ---- version, errors, exit codes -------------------------------------------
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _keel(capsys, "--version")
    assert code == 0 and out.strip() == f"keel {keel.__version__}"


def test_an_unknown_input_is_named_with_the_models_inputs(
        capsys: pytest.CaptureFixture[str], cnn: str, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((1, 3, 8, 8), np.float32))
    code, out, err = _keel(capsys, "run", cnn, "--input", f"img={tmp_path / 'x.npy'}")
    assert code == EXIT_FAILED and out == ""
    assert err.count("\n") == 1 and err.startswith("keel: error:")
    assert "'img'" in err and "its inputs are: image" in err


def test_errors_under_json_are_a_json_object_on_stdout(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = _keel(capsys, "run", str(tmp_path / "missing.onnx"), "--json")
    assert code == EXIT_FAILED and err == ""
    error = json.loads(out)["error"]
    assert error["code"] == "ModelFormatError" and "missing.onnx" in error["message"]
    code, out, _ = _keel(capsys, "run", "--no-such-option", "--json")
    assert code == EXIT_FAILED
    assert json.loads(out)["error"]["code"] == "UsageError"


def test_a_usage_error_exits_2_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = _keel(capsys, "run", "--no-such-option")
    assert code == EXIT_FAILED and "Traceback" not in err and "--no-such-option" in err


def test_validate_of_a_keel_file_against_onnxruntime(
        capsys: pytest.CaptureFixture[str], cnn: str, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    keel_file = str(tmp_path / "cnn.keel")
    assert _keel(capsys, "convert", cnn, "-o", keel_file)[0] == 0
    code, out, err = _keel(capsys, "validate", keel_file, "--against", "onnxruntime", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] and report["outputs"][0]["shape"] == [1, 4, 1, 1]


def test_validate_exits_1_when_an_output_does_not_match(
        capsys: pytest.CaptureFixture[str], cnn: str, tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    theirs = ort.InferenceSession(cnn, providers=["CPUExecutionProvider"]).run(
        None, {"image": x})[0]
    if np.array_equal(load_model(cnn).predict({"image": x})["logits"], theirs):
        pytest.skip("keel and onnxruntime agree bit for bit here: nothing to mismatch")
    code, out, _ = _keel(capsys, "validate", cnn, "--against", "onnxruntime", "--input",
                         f"image={tmp_path / 'x.npy'}", "--rtol", "0", "--atol", "0", "--json")
    assert code == EXIT_MISMATCH and json.loads(out)["ok"] is False


def test_validate_that_cannot_run_exits_2(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    broken = tmp_path / "broken.keel"
    broken.write_bytes(b"not a model")
    code, _out, err = _keel(capsys, "validate", str(broken), "--against", "onnxruntime")
    assert code == EXIT_FAILED and err.startswith("keel: error:") and err.count("\n") == 1


# ---- --dim -----------------------------------------------------------------
def test_run_sizes_any_symbolic_dimension(capsys: pytest.CaptureFixture[str],
                                          seq_model: str) -> None:
    code, out, _ = _keel(capsys, "run", seq_model, "--random", "--dim", "seq=5",
                         "--dim", "batch=2", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["inputs"]["x"]["shape"] == [2, 5, 256]
    assert report["outputs"]["y"]["shape"] == [2, 5, 3]


def test_an_unknown_dim_is_named_with_the_models_dims(capsys: pytest.CaptureFixture[str],
                                                      seq_model: str) -> None:
    code, _, err = _keel(capsys, "run", seq_model, "--random", "--dim", "len=5")
    assert code == EXIT_FAILED
    assert "'len'" in err and "its symbolic dimensions are: batch, seq" in err
    code, _, err = _keel(capsys, "run", seq_model, "--random", "--dim", "seq")
    assert code == EXIT_FAILED and "NAME=VALUE" in err


def test_validate_and_bench_take_dims(capsys: pytest.CaptureFixture[str],
                                      seq_model: str) -> None:
    code, out, err = _keel(capsys, "validate", seq_model, "--against", "reference",
                           "--dim", "seq=7", "--json")
    assert code == 0, err
    assert json.loads(out)["outputs"][0]["shape"] == [1, 7, 3]
    code, out, err = _keel(capsys, "bench", seq_model, "--batch", "2", "--passes", "1",
                           "--dim", "seq=7", "--json")
    assert code == 0, err
    assert "inputs x=(2, 7, 256)" in " ".join(json.loads(out)["notes"])


# ---- output for the model's user -------------------------------------------
def test_plan_of_a_model_leads_with_the_model(capsys: pytest.CaptureFixture[str],
                                              cnn: str) -> None:
    code, out, _ = _keel(capsys, "plan", cnn)
    assert code == 0 and out.startswith("model 'cnn'")
    assert "llama.cpp" not in out and "python_runtime" not in out
    assert len([ln for ln in out.splitlines() if "peak memory" in ln and "=" in ln]) == 1
    code, out, _ = _keel(capsys, "plan", cnn, "--runtime")
    assert code == 0 and out.startswith("model 'cnn'")
    assert out.index("runtime manager") < out.index("llama.cpp")


def test_the_plan_table_reads_at_80_columns(cnn: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update(COLUMNS="80", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "keel", "plan", cnn], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("node "))):
                  lines.index(next(ln for ln in lines if ln.startswith("device copies:")))]
    assert all(len(ln) <= 80 for ln in table), max(table, key=len)
    why = [ln for ln in table if ln.startswith("    why: ")]
    assert len(why) == 2      # each node's reason under its row
    plan = load_model(cnn).plan
    wrapped = " ".join(ln.strip() for ln in plan.table(width=60).splitlines())
    assert all(n.reasons[0] in wrapped.replace("why: ", "") for n in plan.nodes)


def test_drop_shows_the_model_before_the_build_flags(capsys: pytest.CaptureFixture[str],
                                                     cnn: str, tmp_path: Path) -> None:
    code, out, _ = _keel(capsys, "drop", cnn, "--profile", "edge", "--out", str(tmp_path / "a"))
    assert code == 0
    assert out.index("cnn.onnx") < out.index("rustc flags") < out.index("-C opt-level")


def test_backends_explains_its_columns(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _keel(capsys, "backends")
    assert code == 0 and "seed 001 " not in out.split("\n\n")[0]
    assert "gpu ops" in out and "gpu ops: of the ops every GPU backend" in " ".join(out.split())


def test_sizes_are_shown_in_the_unit_given(cnn: str) -> None:
    text = load_model(cnn, memory_limit="512MB").explain()
    assert "memory limit 512 MB" in text and "fits the limit 512 MB" in text
    assert "488.3 MiB" not in text
    assert "memory limit 512.0 MiB" in load_model(cnn, memory_limit="512MiB").explain()


def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _keel(capsys, "demo", "--json")
    assert code == 0
    data = json.loads(out)
    cpu = next(r for r in data["results"] if r["backend"] == "cpu")
    assert cpu["error"] is None and cpu["accuracy"] > 0.9
    assert {"hardware", "runtime", "plan"} <= set(data)


# ---- settings --------------------------------------------------------------
def test_keel_backend_is_read_once_until_settings_are_reloaded(
        cnn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(load_model(cnn).plan.backends) == {"cpu"}
    monkeypatch.setenv("KEEL_BACKEND", "reference")
    assert set(load_model(cnn).plan.backends) == {"cpu"}      # read once, as documented
    config.reload_settings()
    assert set(load_model(cnn).plan.backends) == {"reference"}


def test_backends_lists_webgpu_with_its_adapter(capsys: pytest.CaptureFixture[str]) -> None:
    from keel.backends.registry import builtin_registry

    webgpu = builtin_registry().instance("webgpu")
    code, out, _ = _keel(capsys, "backends")
    assert code == 0
    text = " ".join(out.split())
    assert "webgpu" in text
    if webgpu.is_available():
        assert f"adapter {webgpu.adapter.label()}" in text
    else:
        assert " ".join(webgpu.availability().reason.split()) in text
