"""`keel calibrate`: the sweep's table and JSON, saving, the no-GPU path, `--show`."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import keel.cli.calibrate
from keel import config
from keel.cli import SUBCOMMANDS, app, main
from keel.planning.calibration import (
    calibrate,
    calibration_path,
    hardware_fingerprint,
    load,
    reset_default_calibration,
)
from keel.testing.cli import printed_json
from tests.planning.calibration_fakes import FakeClock, costed_registry, fake_profile

ROOT = Path(__file__).resolve().parents[2]
SIZES = (10_000, 31_623, 100_000, 316_228, 1_000_000)
runner = CliRunner(env={"COLUMNS": "80"})


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for var in [v for v in os.environ if v.startswith("KEEL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    config.reload_settings()
    reset_default_calibration()
    yield
    reset_default_calibration()


def _fake(monkeypatch: pytest.MonkeyPatch, gpu_available: bool = True) -> None:
    """Make the command sweep fake backends with exact costs on a fake machine."""
    clock = FakeClock()
    fake = functools.partial(calibrate, registry=costed_registry(clock,
                                                                 gpu_available=gpu_available),
                             clock=clock, profile=fake_profile(), sizes=SIZES, repeats=3)
    monkeypatch.setattr(keel.cli.calibrate, "calibrate", fake)


def _cached(tmp_path: Path) -> Path:
    return calibration_path(hardware_fingerprint(fake_profile()), tmp_path / "cache")


def test_calibrate_is_a_subcommand() -> None:
    assert "calibrate" in SUBCOMMANDS


def test_table_of_crossovers_and_the_cache(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    _fake(monkeypatch)
    result = runner.invoke(app, ["calibrate", "--groups", "elementwise,matmul_like"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[:3] == ["gpu: fake GPU", "cpu: fake backend",
                         lines[2]] and lines[2].startswith("keel calibrate (measured ")
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(" elementwise")
            or line.startswith(" matmul_like")}
    # crossover, then cpu / gpu with copies / gpu resident medians at it
    assert rows["elementwise"] == ["elementwise", "add", "float32", "100.0", "kB", "102", "µs",
                                   "66", "µs", "21", "µs"]
    assert rows["matmul_like"][:5] == ["matmul_like", "matmul", "float32", "100.4", "kB"]
    assert "  - elementwise float32: the GPU led at 2 consecutive sizes; larger sizes were " \
           "not measured" in lines
    path = _cached(tmp_path)
    assert lines[-1] == f"saved to {path}"
    saved = load(path)
    assert saved.crossover("elementwise", "float32") == 100_000
    assert len(saved.measurements) == 8


def test_json_to_a_chosen_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake(monkeypatch)
    target = tmp_path / "mine.json"
    result = runner.invoke(app, ["calibrate", "--groups", "elementwise", "--dtypes",
                                 "float32", "--dtypes", "float64", "--json", "-o", str(target)])
    assert result.exit_code == 0, result.output
    data = printed_json(result)
    assert data["saved_to"] == str(target)
    assert data["crossover_bytes"] == {"elementwise/float32": 100_000,
                                       "elementwise/float64": 100_000}
    assert data["measurements"][0]["op"] == "add"
    assert load(target).to_dict() == {k: v for k, v in data.items() if k != "saved_to"}
    assert not (tmp_path / "cache").exists()            # --output replaces the cache


def test_no_gpu_has_nothing_to_calibrate(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    _fake(monkeypatch, gpu_available=False)
    result = runner.invoke(app, ["calibrate"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("no GPU: nothing to calibrate (gpu: no CUDA device)\n")
    saved = load(_cached(tmp_path))
    assert saved.no_gpu == "gpu: no CUDA device" and saved.measurements == ()


def test_unknown_group_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--groups", "matmul"])
    assert exit_info.value.code == 2
    assert "keel: error: [INVALID_ARGUMENT] unknown op group 'matmul'; allowed: " in \
        capsys.readouterr().err


def test_show_says_which_calibration_selection_uses(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    result = runner.invoke(app, ["calibrate", "--show"])
    assert result.exit_code == 0
    assert result.output.replace("\n", "").startswith("no calibration cached in ")
    _fake(monkeypatch)
    other = tmp_path / "other.json"
    assert runner.invoke(app, ["calibrate", "--groups", "elementwise", "-o",
                               str(other)]).exit_code == 0
    monkeypatch.setenv("KEEL_CALIBRATION", str(other))    # measured on the fake machine
    config.reload_settings()
    shown = runner.invoke(app, ["calibrate", "--show", "--json"])
    data = printed_json(shown)
    assert data["calibration"] is None and data["path"] == str(other)
    assert "was measured on a different machine" in data["reason"]


def test_real_command_end_to_end(tmp_path: Path) -> None:
    # Whatever this machine has: without a GPU it measures nothing and says why.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               KEEL_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "keel", "calibrate", "--quick", "--groups",
                           "elementwise", "--budget", "10", "--json"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert Path(data["saved_to"]).parent == tmp_path
    if data["no_gpu"] is None:
        assert data["measurements"], data
    else:
        assert data["measurements"] == [] and data["crossover_bytes"] == {}
