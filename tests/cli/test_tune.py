"""`keel tune`: the summary table, --json, input shapes, and a model with nothing to tune."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from keel.cli import SUBCOMMANDS, app
from keel.config import cache_dir
from keel.testing.cli import printed_json
from keel.testing.models import resnet_block

runner = CliRunner(env={"COLUMNS": "120"})
CASE_KEYS = {"case", "key", "nodes", "candidates", "status", "medians_s", "runs", "winner",
             "declared", "ratio", "reason", "notes"}


pytestmark = pytest.mark.usefixtures("fresh_tuning")


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "block.onnx"
    path.write_bytes(resnet_block(channels=8, size=8).SerializeToString())
    return path


def test_tune_is_a_subcommand() -> None:
    assert "tune" in SUBCOMMANDS


def test_json_lists_each_case_then_reads_them_back_from_the_cache(model_file: Path) -> None:
    result = runner.invoke(app, ["tune", str(model_file), "--budget", "2", "--threads", "1",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = printed_json(result)
    assert set(report) == {"model", "threads", "cache", "budget_s", "elapsed_s",
                           "nothing_to_tune", "message", "cases"}
    assert report["threads"] == 1 and not report["nothing_to_tune"]
    assert Path(report["cache"]).parent == cache_dir() / "tuning"
    for case in report["cases"]:
        assert set(case) == CASE_KEYS
        assert len(case["candidates"]) >= 2 and case["nodes"]
        if case["status"] == "measured":
            assert case["winner"] in case["medians_s"]
            assert set(case["medians_s"]) <= set(case["candidates"])
            assert case["reason"].startswith(f"measured on this machine: {case['winner']} ")
    measured = {c["key"] for c in report["cases"] if c["status"] == "measured"}
    assert measured
    again = json.loads(runner.invoke(app, ["tune", str(model_file), "--threads", "1",
                                           "--json"]).stdout)
    assert {c["key"] for c in again["cases"] if c["status"] == "cached"} == measured


def test_the_table_names_each_case_and_its_winner(model_file: Path) -> None:
    result = runner.invoke(app, ["tune", str(model_file), "--budget", "2", "--batch", "2"])
    assert result.exit_code == 0, result.output
    assert "keel tune resnet_block" in result.stdout
    assert "conv float32 (2x3x8x8" in result.stdout
    assert "case(s) of 'resnet_block'" in result.stdout


def test_an_input_shape_is_tuned_as_given(model_file: Path) -> None:
    result = runner.invoke(app, ["tune", str(model_file), "--budget", "1", "--json",
                                 "--input-shape", "x=3x3x8x8"])
    assert result.exit_code == 0, result.output
    cases = printed_json(result)["cases"]
    assert any(c["case"].startswith("conv float32 (3x3x8x8") for c in cases)


@pytest.mark.parametrize(("spec", "message"), [
    ("x", "must look like NAME=1x3x224x224"),
    ("x=1xAx8x8", "must look like NAME=1x3x224x224"),
    ("y=1x3x8x8", "names y, not an input of the model; its inputs: x"),
])
def test_a_bad_input_shape_is_a_clear_error(model_file: Path, spec: str, message: str) -> None:
    result = runner.invoke(app, ["tune", str(model_file), "--input-shape", spec])
    assert result.exit_code != 0
    assert message in str(result.exception)


def test_a_model_with_nothing_to_tune_says_so(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    path = tmp_path / "relu.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                     .SerializeToString())
    result = runner.invoke(app, ["tune", str(path)])
    assert result.exit_code == 0, result.output
    assert "nothing to tune: no node of 'relu' has more than one kernel variant" in result.stdout
    data = printed_json(runner.invoke(app, ["tune", str(path), "--json"]))
    assert data["nothing_to_tune"] and data["cases"] == []
