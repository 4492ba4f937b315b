"""The drop format: deterministic ids and bytes, atomic writes, verification, typed errors."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import pytest
import yaml

from keel.errors import DropIntegrityError, InvalidArgumentError
from keel.hardware.fakes import fake_profile
from keel.planning import drops
from keel.planning.drops import (
    drop_inputs,
    drop_model_path,
    hardware_fingerprint,
    stable_profile,
    verify_drop,
    write_drop,
)
from keel.planning.targets import get_target


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.onnx"
    path.write_bytes(b"\x08\x07keel-test-model" * 10)
    return path


def _files(model: Path) -> dict[str, drops.Source]:
    return {"model.keel": model, "plan.json": b'{"plan": 1}\n', "flags.txt": b"-C lto=thin\n"}


def _write(model: Path, out: Path, profile: str = "edge", **extra: object) -> drops.Drop:
    inputs = drop_inputs(model, get_target(profile), {"model_file": "model.keel", **extra})
    return write_drop(out, inputs, _files(model))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_same_inputs_give_the_same_id_and_bytes(model: Path, tmp_path: Path) -> None:
    a = _write(model, tmp_path / "a")
    b = _write(model, tmp_path / "b")
    assert a.drop_id == b.drop_id and len(a.drop_id) == 16
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    assert Path(a.path) == tmp_path / "a" / "edge" / a.drop_id
    assert sorted(os.listdir(a.path)) == ["flags.txt", "manifest.yaml", "model.keel",
                                          "plan.json"]


def test_the_manifest_lists_every_file_with_its_size_and_hash(model: Path,
                                                               tmp_path: Path) -> None:
    drop = _write(model, tmp_path, "server")
    manifest = yaml.safe_load((Path(drop.path) / "manifest.yaml").read_text())
    assert manifest == drop.manifest and manifest["drop_id"] == drop.drop_id
    assert manifest["profile"] == "server"
    assert manifest["feature_gates"] == ["throughput", "gpu-offload"]
    assert manifest["model"]["file"] == "tiny.onnx"
    assert manifest["model"]["size_bytes"] == model.stat().st_size
    assert set(manifest["files"]) == {"flags.txt", "model.keel", "plan.json"}
    assert manifest["files"]["model.keel"]["size_bytes"] == model.stat().st_size
    assert manifest["files"]["plan.json"] == {
        "size_bytes": 12, "sha256": hashlib.sha256(b'{"plan": 1}\n').hexdigest()}
    assert str(tmp_path) not in (Path(drop.path) / "manifest.yaml").read_text()
    assert verify_drop(drop.path) == manifest
    assert drop_model_path(drop.path) == os.path.join(drop.path, "model.keel")


def test_different_inputs_give_different_ids(model: Path, tmp_path: Path) -> None:
    edge = _write(model, tmp_path)
    server = _write(model, tmp_path, "server")
    quantized = _write(model, tmp_path, quantize="int8")
    other = tmp_path / "other.onnx"
    other.write_bytes(model.read_bytes() + b"!")
    ids = {edge.drop_id, server.drop_id, quantized.drop_id, _write(other, tmp_path).drop_id}
    assert len(ids) == 4


def test_a_second_write_finds_the_identical_drop(model: Path, tmp_path: Path) -> None:
    first = _write(model, tmp_path)
    second = _write(model, tmp_path)
    assert first.created and not second.created and first.drop_id == second.drop_id
    assert [p for p in os.listdir(tmp_path / "edge") if p.startswith(".")] == []


def test_a_damaged_drop_is_replaced_whole(model: Path, tmp_path: Path) -> None:
    drop = _write(model, tmp_path)
    good = _tree(Path(drop.path))
    (Path(drop.path) / "flags.txt").write_text("garbage")
    (Path(drop.path) / "extra.txt").write_text("stray")
    again = _write(model, tmp_path)
    assert again.created and _tree(Path(drop.path)) == good


def test_a_changed_file_is_refused(model: Path, tmp_path: Path) -> None:
    drop = Path(_write(model, tmp_path).path)
    data = bytearray((drop / "model.keel").read_bytes())
    data[3] ^= 1                                   # same size, other bytes
    (drop / "model.keel").write_bytes(bytes(data))
    with pytest.raises(DropIntegrityError, match=r"model\.keel has SHA-256 .* changed after"):
        verify_drop(drop)
    with pytest.raises(DropIntegrityError, match=r"model\.keel"):
        drop_model_path(drop)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "plan.json").write_bytes(b"{}"), r"plan\.json is 2 bytes"),
    (lambda d: (d / "flags.txt").unlink(), r"flags\.txt is missing"),
    (lambda d: (d / "notes.txt").write_text("x"), r"does not list: notes\.txt"),
    (lambda d: (d / "manifest.yaml").write_text("files: [1, 2]"), "does not list its files"),
    (lambda d: (d / "manifest.yaml").write_text(
        "files: {'../x': {size_bytes: 1, sha256: a}}"), "outside the drop"),
])
def test_every_kind_of_damage_is_a_typed_error(model: Path, tmp_path: Path, damage: object,
                                               message: str) -> None:
    drop = Path(_write(model, tmp_path).path)
    damage(drop)                                   # type: ignore[operator]
    with pytest.raises(DropIntegrityError, match=message):
        verify_drop(drop)


def test_a_failed_write_leaves_nothing_behind(model: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(drops.os, "replace", failing_replace)
    with pytest.raises(InvalidArgumentError, match=r"cannot write drop .* No space left"):
        _write(model, tmp_path / "out")
    assert os.listdir(tmp_path / "out" / "edge") == []      # no final dir, no temp dir


def test_an_interrupted_write_leaves_nothing_behind(model: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(drops.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _write(model, tmp_path / "out")
    assert os.listdir(tmp_path / "out" / "edge") == []


def test_bad_inputs_are_typed_errors(model: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"model file .*missing\.onnx.* does not exist"):
        _write(tmp_path / "missing.onnx", tmp_path)
    with pytest.raises(InvalidArgumentError, match="unknown target profile 'desktop'"):
        _write(model, tmp_path, "desktop")


def test_the_fingerprint_ignores_readings_that_change_between_probes() -> None:
    profile = fake_profile("nvidia-h100-nvml")
    memory = dataclasses.replace(profile.memory, available_bytes=1, effective_available_bytes=1)
    warmer = tuple(dataclasses.replace(r, temperature_c=80.0) for r in profile.thermal)
    busier = dataclasses.replace(profile, probe_seconds=9.0, memory=memory, thermal=warmer)
    assert hardware_fingerprint(stable_profile(profile)) == \
        hardware_fingerprint(stable_profile(busier))
    assert hardware_fingerprint(profile) != hardware_fingerprint(busier)
    assert hardware_fingerprint(stable_profile(profile)) != \
        hardware_fingerprint(stable_profile(fake_profile("edge-arm-board")))
