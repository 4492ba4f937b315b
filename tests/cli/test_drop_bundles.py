"""`keel drop` bundles: a real converted model, its plan and flags, hashed; `keel run DROP`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

from keel.cli import EXIT_TAMPERED, main
from keel.cli.drop import build_drop
from keel.errors import DropIntegrityError, InvalidArgumentError
from keel.execution.model import load_model
from keel.formats.keel_format import load_keel
from keel.hardware.fakes import fake_profile
from keel.ops.registry import Op
from keel.testing.gguf_files import write_gguf
from keel.testing.models import lenet, make_inputs

gguf = pytest.importorskip("gguf", reason="the gguf package (keel-runtime[gguf]) is needed "
                                          "for the GGUF drop")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "lenet.onnx"
    onnx.save(lenet(size=16), str(path))
    return path


@pytest.fixture
def edge_board(tmp_path: Path) -> Path:
    """A saved profile of a hot 4 GiB board: low-memory mode and a thermal thread cap."""
    path = tmp_path / "edge-board.json"
    path.write_text(fake_profile("edge-arm-board-hot").to_json())
    return path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_a_drop_carries_the_converted_model_its_plan_and_flags(
        model: Path, edge_board: Path, tmp_path: Path) -> None:
    drop = build_drop(model, "edge", tmp_path / "art", hardware=edge_board)
    root = Path(drop.path)
    assert sorted(p.name for p in root.iterdir()) == ["flags.txt", "manifest.yaml",
                                                      "model.keel", "plan.json"]
    manifest = yaml.safe_load((root / "manifest.yaml").read_text())
    for name, facts in manifest["files"].items():
        assert facts["size_bytes"] == (root / name).stat().st_size
    assert manifest["hardware"]["host"] == "edge-board"
    assert manifest["model"]["file"] == "lenet.onnx" and manifest["keel_version"]
    graph = load_keel(root / "model.keel")
    assert Op.CONV in {n.op for n in graph.nodes}
    plan = json.loads((root / "plan.json").read_text())
    assert plan["drop_id"] == drop.drop_id and plan["runtime"]["target"] == "edge"
    assert plan["runtime"]["memory_mode"]["choice"] == "low-memory"
    assert plan["runtime"]["threads"]["choice"] == "4"
    assert any("stay memory-mapped from the .keel file" in r for r in plan["model"]["reasons"])
    assert all(n["reasons"] for n in plan["model"]["nodes"])
    flags = (root / "flags.txt").read_text().splitlines()
    assert "-C opt-level=z" in flags and "KEEL_THREADS=4" in flags
    assert "KEEL_BACKEND=cpu" in flags and "KEEL_HINT=latency" in flags


def test_the_same_inputs_give_byte_identical_drops(model: Path, edge_board: Path,
                                                   tmp_path: Path) -> None:
    for hardware in (edge_board, None):
        a = build_drop(model, "server", tmp_path / "a", hardware=hardware, quantize="int8")
        b = build_drop(model, "server", tmp_path / "b", hardware=hardware, quantize="int8")
        assert a.drop_id == b.drop_id and a.created and b.created
        assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    other = build_drop(model, "server", tmp_path / "a", hardware=edge_board)
    assert other.drop_id != a.drop_id


def test_int8_drops_store_integer_weights(model: Path, edge_board: Path,
                                          tmp_path: Path) -> None:
    plain = build_drop(model, "edge", tmp_path, hardware=edge_board)
    quantized = build_drop(model, "edge", tmp_path, hardware=edge_board, quantize="int8")
    weights = load_keel(Path(quantized.path) / "model.keel").initializers.values()
    assert any(w.dtype == np.int8 for w in weights)
    sizes = [Path(d.path, "model.keel").stat().st_size for d in (plain, quantized)]
    assert sizes[1] < sizes[0]
    assert quantized.manifest["quantize"] == "int8"
    with pytest.raises(InvalidArgumentError, match="--quantize 'int4'"):
        build_drop(model, "edge", tmp_path, quantize="int4")


def test_running_the_drop_matches_running_the_model(model: Path, edge_board: Path,
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    drop = build_drop(model, "edge", tmp_path / "art", hardware=edge_board)
    feeds = make_inputs(onnx.load(str(model)), batch=2, seed=3)
    direct = load_model(str(model)).predict(feeds)
    from_drop = load_model(drop.path).predict(feeds)
    for name, value in direct.items():
        np.testing.assert_allclose(from_drop[name], value, rtol=1e-5, atol=1e-6)
    (name, value), = feeds.items()
    np.save(tmp_path / "x.npy", value)
    code, _, err = _run(capsys, "run", drop.path, "--input", f"{name}=x.npy".replace(
        "x.npy", str(tmp_path / "x.npy")), "--output-dir", str(tmp_path / "out"), "--json")
    assert code == 0, err
    for out_name, value in direct.items():
        saved = np.load(tmp_path / "out" / f"{out_name}.npy")
        np.testing.assert_allclose(saved, value, rtol=1e-5, atol=1e-6)


def test_a_tampered_drop_is_refused(model: Path, edge_board: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    drop = build_drop(model, "edge", tmp_path / "art", hardware=edge_board)
    weights = Path(drop.path) / "model.keel"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(DropIntegrityError, match=r"model\.keel has SHA-256"):
        load_model(drop.path)
    code, out, _ = _run(capsys, "run", drop.path, "--random", "--json")
    assert code == EXIT_TAMPERED == 4
    assert json.loads(out)["error"]["code"] == "DropIntegrityError"
    rebuilt = build_drop(model, "edge", tmp_path / "art", hardware=edge_board)
    assert rebuilt.created and load_model(drop.path).predict(
        make_inputs(onnx.load(str(model)), batch=1))


def test_a_gguf_drop_carries_the_llama_cpp_plan(tmp_path: Path, capsys: pytest.CaptureFixture[
        str]) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", layers=4)
    hardware = tmp_path / "h100.json"
    hardware.write_text(fake_profile("nvidia-h100-nvml").to_json())
    drop = build_drop(path, "server", tmp_path / "art", hardware=hardware, context=512)
    root = Path(drop.path)
    assert (root / "model.gguf").read_bytes() == path.read_bytes()
    plan = json.loads((root / "plan.json").read_text())
    assert plan["llama_cpp"]["gpu_layers"] == 5 and plan["llama_cpp"]["context"] == 512
    assert plan["runtime"]["llama_cpp"]["reason"].startswith("-ngl 5 -c 512")
    flags = (root / "flags.txt").read_text().splitlines()
    assert flags[flags.index("# llama.cpp") + 1] == " ".join(plan["llama_cpp"]["flags"])
    assert "-ngl 5 -c 512" in flags[-1]
    code, _, err = _run(capsys, "run", drop.path, "--random")
    assert code == 2 and "for llama.cpp" in err
    with pytest.raises(InvalidArgumentError, match="keeps the quantization"):
        build_drop(path, "server", tmp_path / "art", quantize="int8")


def test_drop_cli_prints_json_and_the_run_command(model: Path, edge_board: Path,
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    args = ["drop", str(model), "--profile", "edge", "--hardware", str(edge_board),
            "--out", str(tmp_path / "art")]
    code, out, _ = _run(capsys, *args, "--json")
    data = json.loads(out)
    assert code == 0 and data["created"] and data["files"][-1] == "manifest.yaml"
    code, out, _ = _run(capsys, *args)
    assert code == 0 and "already present, identical" in out and "keel run" in out
