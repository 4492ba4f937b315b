"""Drop manifests: deterministic ids and bytes, atomic writes, typed errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from keel.errors import InvalidArgumentError
from keel.planning import drops
from keel.planning.drops import make_drop


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.onnx"
    path.write_bytes(b"\x08\x07keel-test-model" * 10)
    return path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_same_inputs_give_the_same_id_and_bytes(model: Path, tmp_path: Path) -> None:
    a = make_drop(model, "edge", tmp_path / "a")
    b = make_drop(model, "edge", tmp_path / "b")
    assert a.drop_id == b.drop_id and len(a.drop_id) == 16
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    assert Path(a.path) == tmp_path / "a" / "edge" / a.drop_id
    assert sorted(os.listdir(a.path)) == ["flags.txt", "manifest.yaml"]


def test_files_carry_the_profiles_flags_and_gates(model: Path, tmp_path: Path) -> None:
    drop = make_drop(model, "server", tmp_path)
    flags = (Path(drop.path) / "flags.txt").read_text()
    assert flags == "-C opt-level=3\n-C lto=thin\n"
    manifest = yaml.safe_load((Path(drop.path) / "manifest.yaml").read_text())
    assert manifest["drop_id"] == drop.drop_id and manifest["profile"] == "server"
    assert manifest["feature_gates"] == ["throughput", "gpu-offload"]
    assert manifest["model"]["file"] == "tiny.onnx"
    assert manifest["model"]["size_bytes"] == model.stat().st_size
    assert len(manifest["model"]["sha256"]) == 64 and manifest == drop.manifest
    assert str(tmp_path) not in (Path(drop.path) / "manifest.yaml").read_text()


def test_different_inputs_give_different_ids(model: Path, tmp_path: Path) -> None:
    edge = make_drop(model, "edge", tmp_path)
    server = make_drop(model, "server", tmp_path)
    other = tmp_path / "other.onnx"
    other.write_bytes(model.read_bytes() + b"!")
    assert len({edge.drop_id, server.drop_id, make_drop(other, "edge", tmp_path).drop_id}) == 3


def test_a_second_write_finds_the_identical_drop(model: Path, tmp_path: Path) -> None:
    first = make_drop(model, "edge", tmp_path)
    second = make_drop(model, "edge", tmp_path)
    assert first.created and not second.created and first.drop_id == second.drop_id


def test_a_damaged_drop_is_replaced_whole(model: Path, tmp_path: Path) -> None:
    drop = make_drop(model, "edge", tmp_path)
    good = _tree(Path(drop.path))
    (Path(drop.path) / "flags.txt").write_text("garbage")
    (Path(drop.path) / "extra.txt").write_text("stray")
    again = make_drop(model, "edge", tmp_path)
    assert again.created and _tree(Path(drop.path)) == good


def test_a_failed_write_leaves_nothing_behind(model: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(drops.os, "replace", failing_replace)
    with pytest.raises(InvalidArgumentError, match=r"cannot write drop .* No space left"):
        make_drop(model, "edge", tmp_path / "out")
    assert os.listdir(tmp_path / "out" / "edge") == []      # no final dir, no temp dir


def test_an_interrupted_write_leaves_nothing_behind(model: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(drops.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_drop(model, "edge", tmp_path / "out")
    assert os.listdir(tmp_path / "out" / "edge") == []


def test_bad_inputs_are_typed_errors(model: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"model file .*missing\.onnx.* does not exist"):
        make_drop(tmp_path / "missing.onnx", "edge", tmp_path)
    with pytest.raises(InvalidArgumentError, match="unknown target profile 'desktop'"):
        make_drop(model, "desktop", tmp_path)
