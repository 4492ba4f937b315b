"""Files keel names from model content stay in the folder asked for: a graph or output
name holding ``../`` or a separator is made a plain file name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import keel
from keel._files import safe_file_name


def _named(graph_name: str, output_name: str) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], [output_name])], graph_name,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("name", "want"), [
    ("../../escaped", "_.._escaped"), ("..", "model"), ("/etc/passwd", "_etc_passwd"),
    ("a\\b\x00c", "a_b_c"), (".hidden", "hidden"), ("résumé v2", "r_sum__v2"),
    ("x" * 300, "x" * 120), ("", "model"), ("resnet-18.v1", "resnet-18.v1")])
def test_names_become_one_plain_file_name(name: str, want: str) -> None:
    assert safe_file_name(name, "model") == want


def test_end_profiling_stays_in_the_working_folder(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "deep" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    model = keel.load_model(_named("../../escaped", "y"), enable_profiling=True)
    model.predict({"x": np.ones(2, np.float32)})
    written = Path(model.end_profiling())
    assert written.resolve().parent == work.resolve()
    assert written.name == "keel_profile__.._escaped.json"
    assert json.loads(written.read_text())
    assert not list(tmp_path.glob("*.json")) and not list((tmp_path / "deep").glob("*.json"))


def test_keel_run_saves_outputs_inside_the_output_folder(tmp_path: Path) -> None:
    from keel.cli import main

    path = tmp_path / "m.onnx"
    onnx.save(_named("g", "../../../escaped"), path)
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(SystemExit) as done:
        main(["run", str(path), "--random", "--output-dir", str(out), "--json"])
    assert done.value.code in (0, None)
    assert [p.name for p in out.iterdir()] == ["_.._.._escaped.npy"]
    assert not list(tmp_path.rglob("escaped*"))
