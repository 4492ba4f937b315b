"""``keel convert``: ONNX → .keel / ONNX, sizes and passes reported, errors exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
import pytest

from keel.cli import main
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
