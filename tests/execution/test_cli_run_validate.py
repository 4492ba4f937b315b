"""``keel run`` and ``keel validate``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from keel.backends.base import KernelContext
from keel.backends.registry import BackendRegistry
from keel.cli import SUBCOMMANDS, main
from keel.cli.validate import _Oracle, compare, first_divergence
from keel.execution.model import load_model
from keel.ops.registry import Op
from keel.testing.backends import FakeBackend, restricted_table
from keel.testing.models import make_inputs, mlp


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "mlp.onnx"
    onnx.save(mlp(in_features=8, hidden=(16,), classes=3), path)
    return path


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_subcommands_are_registered() -> None:
    assert {"run", "validate"} <= set(SUBCOMMANDS)


def test_run_random_json(capsys: pytest.CaptureFixture[str], model_path: Path) -> None:
    code, out, _ = cli(capsys, "run", str(model_path), "--random", "--batch", "5", "--json",
                       "--backend", "reference")
    assert code == 0
    report = json.loads(out)
    assert report["outputs"]["probs"]["shape"] == [5, 3]
    assert report["backends_used"] == {"reference": report["backends_used"]["reference"]}
    assert report["peak_bytes"] > 0


def test_run_with_input_files_saves_outputs(capsys: pytest.CaptureFixture[str],
                                            model_path: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out, _ = cli(capsys, "run", str(model_path), "--input", f"x={tmp_path / 'x.npy'}",
                       "--output-dir", str(tmp_path / "out"))
    assert code == 0 and "probs" in out and "saved probs" in out
    saved = np.load(tmp_path / "out" / "probs.npy")
    expected = load_model(model_path).predict({"x": x})["probs"]
    np.testing.assert_allclose(saved, expected, rtol=1e-6)


def test_run_without_data_names_the_input(capsys: pytest.CaptureFixture[str],
                                          model_path: Path) -> None:
    code, _, err = cli(capsys, "run", str(model_path))
    assert code == 2
    assert "input 'x' has no data; pass --input x=FILE.npy or --random" in err


def test_run_bad_input_spec(capsys: pytest.CaptureFixture[str], model_path: Path) -> None:
    code, _, err = cli(capsys, "run", str(model_path), "--input", "x")
    assert code == 2 and "must look like NAME=FILE.npy" in err


def test_validate_against_reference(capsys: pytest.CaptureFixture[str],
                                    model_path: Path) -> None:
    code, out, _ = cli(capsys, "validate", str(model_path), "--against", "reference",
                       "--per-node", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["ok"] and report["outputs"][0]["name"] == "probs"
    assert report["outputs"][0]["max_abs_error"] < 1e-5
    assert report["first_divergence"]["node"] is None
    assert report["first_divergence"]["values_compared"] > 0


def test_validate_against_onnxruntime_per_node(capsys: pytest.CaptureFixture[str],
                                               model_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle here")
    code, out, _ = cli(capsys, "validate", str(model_path), "--against", "onnxruntime",
                       "--per-node", "--optimization-level", "none")
    assert code == 0
    assert "max abs" in out and "per node: no node diverges" in out


def test_validate_rejects_unknown_oracles(capsys: pytest.CaptureFixture[str],
                                          model_path: Path) -> None:
    code, _, err = cli(capsys, "validate", str(model_path), "--against", "tensorflow")
    assert code == 2 and "use one of onnxruntime, reference" in err


def _identity_relu(ctx: KernelContext, ins: Sequence[Any], attrs: Mapping[str, Any],
                   out: Sequence[Any] | None) -> list[Any]:
    return [ins[0].copy()]          # a wrong relu: lets negatives through


def test_first_divergence_names_the_first_wrong_node(model_path: Path) -> None:
    from keel.backends.reference.kernels import load

    table = restricted_table("cpu", load(), [op for op in Op if op is not Op.RELU])
    table.kernel(Op.RELU)(_identity_relu)
    reg = BackendRegistry()
    reg.register("cpu", lambda: FakeBackend("cpu", table=table))
    broken = load_model(model_path, backend="cpu", registry=reg, optimization_level="none")
    feeds = make_inputs(onnx.load(model_path), 4)
    found = first_divergence(broken, _Oracle(str(model_path), "reference", "none"), feeds,
                             1e-4, 1e-5)
    assert found["op"] == "relu"
    assert found["max_abs_error"] > 0


def test_compare_reports_errors() -> None:
    want = np.array([1.0, -2.0, 0.0], np.float32)
    c = compare("y", want + np.array([0, 1e-3, 0], np.float32), want, 1e-4, 1e-6)
    assert not c.ok and c.max_abs_error == pytest.approx(1e-3, rel=1e-3)
    assert c.max_rel_error == pytest.approx(5e-4, rel=1e-3)
    assert compare("y", want, want, 1e-4, 1e-6).ok
    assert not compare("y", want[:2], want, 1e-4, 1e-6).ok


@pytest.mark.parametrize(("args", "message"), [
    (("--random", "--batch", "-1"), "--batch must be 0 or more, got -1"),
    (("--random", "--seed", "-1"), "--seed must be 0 or more, got -1"),
])
def test_run_rejects_negative_batch_and_seed(capsys: pytest.CaptureFixture[str],
                                             model_path: Path, args: tuple[str, ...],
                                             message: str) -> None:
    code, _, err = cli(capsys, "run", str(model_path), *args)
    assert code == 2
    assert err.strip().splitlines() == [err.strip()]
    assert err.startswith("keel: error:") and message in err


def test_run_rejects_bad_counts_before_loading(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    # The options are checked before the model is read (or native kernels compiled):
    # a model that does not exist is not reached.
    code, _, err = cli(capsys, "run", str(tmp_path / "absent.onnx"), "--random",
                       "--seed", "-1")
    assert code == 2
    assert err.strip() == "keel: error: [INVALID_ARGUMENT] --seed must be 0 or more, got -1"


def test_run_output_dir_that_is_a_file_is_one_line_error(capsys: pytest.CaptureFixture[str],
                                                         model_path: Path) -> None:
    code, _, err = cli(capsys, "run", str(model_path), "--random", "--output-dir",
                       str(model_path))
    assert code == 2
    assert err.strip().splitlines() == [err.strip()]
    assert err.startswith("keel: error:") and "cannot save outputs to --output-dir" in err


def test_run_rejects_an_input_given_twice(capsys: pytest.CaptureFixture[str],
                                          model_path: Path, tmp_path: Path) -> None:
    arr = tmp_path / "x.npy"
    np.save(arr, np.zeros((1, 4), np.float32))
    code, _, err = cli(capsys, "run", str(model_path), "--input", f"x={arr}",
                       "--input", f"x={arr}")
    assert code == 2
    assert err.startswith("keel: error:") and "'x' is given twice" in err


@pytest.mark.parametrize("flag", ["--rtol", "--atol"])
def test_validate_rejects_negative_tolerances(capsys: pytest.CaptureFixture[str],
                                              model_path: Path, flag: str) -> None:
    code, _, err = cli(capsys, "validate", str(model_path), "--against", "reference",
                       flag, "-1")
    assert code == 2
    assert err.startswith("keel: error:") and f"{flag} must be a non-negative number" in err
