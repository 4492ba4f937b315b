"""`keel probe`, `keel plan`, `keel drop` and `keel demo` from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import keel.cli.demo
import keel.cli.plan
import keel.cli.probe
from keel import config
from keel.cli import SUBCOMMANDS, app, main
from keel.hardware import HardwareProfile
from keel.hardware.fakes import fake_profile
from keel.testing.cli import printed_json

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _keel(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "keel", *args], capture_output=True,
                          text=True, env=_env(**env), cwd=ROOT, timeout=60)


@pytest.fixture(autouse=True)
def _no_keel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("KEEL_")]:
        monkeypatch.delenv(var)
    config.reload_settings()


@pytest.fixture
def h100(monkeypatch: pytest.MonkeyPatch) -> HardwareProfile:
    """Make every CLI command see the fake 8x H100 server."""
    profile = fake_profile("nvidia-h100-server")
    for module in (keel.cli.probe, keel.cli.plan, keel.cli.demo):
        monkeypatch.setattr(module, "probe", lambda: profile)
    return profile


def test_subcommands_are_registered() -> None:
    assert {"probe", "plan", "drop", "demo"} <= set(SUBCOMMANDS)


def test_probe_json_round_trips_into_the_profile(h100: HardwareProfile) -> None:
    result = runner.invoke(app, ["probe", "--json"])
    assert result.exit_code == 0, result.output
    assert HardwareProfile.from_json(result.stdout) == h100


def test_probe_yaml_round_trips_into_the_profile(h100: HardwareProfile) -> None:
    result = runner.invoke(app, ["probe", "--yaml"])
    assert result.exit_code == 0 and HardwareProfile.from_yaml(result.output) == h100


def test_probe_json_of_this_machine_round_trips() -> None:
    done = _keel("probe", "--json")
    assert done.returncode == 0, done.stderr
    profile = HardwareProfile.from_json(done.stdout)
    assert json.loads(profile.to_json()) == json.loads(done.stdout)
    assert profile.probe_seconds is not None and profile.probe_seconds < 2.0


def test_probe_table_is_readable(h100: HardwareProfile) -> None:
    result = runner.invoke(app, ["probe"])
    assert result.exit_code == 0
    out = result.output
    assert "Intel(R) Xeon(R) Platinum 8480+" in out and "avx512" in out
    assert "NVIDIA H100 80GB HBM3" in out and "nvidia-smi" in out
    assert "2 node(s): node 0: CPUs 0-55,112-167" in out          # two sockets: NUMA
    assert "notes (what could not be read, and why):" in out


def test_probe_json_and_yaml_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["probe", "--json", "--yaml"])
    assert exit_info.value.code == 2
    error = json.loads(capsys.readouterr().out)["error"]   # --json: the error is JSON too
    assert error["code"] == "InvalidArgumentError"
    assert "--json and --yaml are exclusive" in error["message"]


def test_keel_backend_gpu_without_a_gpu_is_a_one_line_error() -> None:
    done = _keel("plan", KEEL_BACKEND="gpu")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'gpu'" in lines[0] and "BACKEND_SELECTION" in lines[0]
    assert done.stdout == ""


def test_plan_of_this_machine_prints_every_selection() -> None:
    done = _keel("plan")
    assert done.returncode == 0, done.stderr
    for component in ("llama.cpp", "python_runtime", "accelerators", "engine"):
        assert component in done.stdout


def test_plan_json_has_choices_fallbacks_and_reasons(h100: HardwareProfile) -> None:
    result = runner.invoke(app, ["plan", "--json"])
    assert result.exit_code == 0, result.output
    data = printed_json(result)
    assert data["target"] == "server" and data["llama_cpp"]["choice"] == "gpu"
    assert data["llama_cpp"]["fallbacks"] == ["cpu"]
    assert data["python_runtime"]["fallbacks"] == ["lightweight"]
    assert len(data["reasons"]) == 7 and data["memory_mode"]["choice"] == "standard"


def test_plan_for_a_saved_profile_of_another_machine(tmp_path: Path) -> None:
    saved = tmp_path / "h100.json"
    saved.write_text(fake_profile("nvidia-h100-nvml").to_json())
    result = runner.invoke(app, ["plan", "--hardware", str(saved), "--json"])
    assert result.exit_code == 0, result.output
    data = printed_json(result)
    assert data["host"] == "dgx-h100-01" and data["engine"]["choice"] == "gpu"
    assert "not checked" in data["engine"]["reason"]


def test_plan_with_a_policy_file(tmp_path: Path, h100: HardwareProfile) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("prefer_gpu: false\n")
    result = runner.invoke(app, ["plan", "--policy", str(policy), "--json"])
    data = printed_json(result)
    assert data["llama_cpp"]["choice"] == "cpu" and data["engine"]["choice"] == "cpu"
    assert data["policy"]["prefer_gpu"] is False


def test_a_bad_policy_file_names_the_key(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("min_gpu_memory: 8\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--policy", str(policy)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown key 'min_gpu_memory'" in err


def test_a_missing_hardware_file_is_a_clear_error(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--hardware", str(tmp_path / "nope.json")])
    assert "cannot read hardware profile" in capsys.readouterr().err


def test_plan_table_names_the_target_and_rejections(h100: HardwareProfile) -> None:
    result = runner.invoke(app, ["plan"])
    assert result.exit_code == 0
    assert "target server:" in result.output and "CUDA build on nvidia GPU 0" in result.output


def _real_model(tmp_path: Path) -> Path:
    from importlib import resources

    model = tmp_path / "m.onnx"
    model.write_bytes((resources.files("keel") / "data" / "digits_mlp.onnx").read_bytes())
    return model


def test_drop_writes_a_deterministic_manifest(tmp_path: Path) -> None:
    model = _real_model(tmp_path)
    args = ["drop", str(model), "--profile", "edge", "--out", str(tmp_path / "art"), "--json"]
    first = printed_json(runner.invoke(app, args))
    second = printed_json(runner.invoke(app, args))
    assert first["drop_id"] == second["drop_id"] and first["created"] and not second["created"]
    drop_dir = tmp_path / "art" / "edge" / first["drop_id"]
    manifest = yaml.safe_load((drop_dir / "manifest.yaml").read_text())
    assert manifest["flags"] == ["-C opt-level=z", "-C lto=fat", "-C codegen-units=1"]
    table = runner.invoke(app, args[:-1])
    assert table.exit_code == 0 and first["drop_id"] in table.output


def test_drop_with_an_unknown_profile_fails(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    model = _real_model(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["drop", str(model), "--profile", "laptop", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown target profile 'laptop'" in capsys.readouterr().err


def test_drop_refuses_a_file_that_is_not_a_model(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"model-bytes")
    with pytest.raises(SystemExit) as exit_info:
        main(["drop", str(model), "--profile", "edge", "--out", str(tmp_path / "art")])
    assert exit_info.value.code == 2
    assert "keel: error: [MODEL_FORMAT]" in capsys.readouterr().err
    assert not (tmp_path / "art").exists()


def test_demo_prints_the_probe_summary_and_the_plan(h100: HardwareProfile) -> None:
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 0, result.output
    assert "keel probe: dgx-h100-01" in result.output
    assert "keel plan: dgx-h100-01 (target: server)" in result.output


def test_probe_names_the_int8_dot_product_instructions() -> None:
    assert keel.cli.probe.int8_dot(("avx2", "avxvnni", "avx512vnni")).startswith(
        "AVX-512 VNNI, AVX-VNNI")
    assert keel.cli.probe.int8_dot(("avx2", "fma")).startswith("no VNNI")
