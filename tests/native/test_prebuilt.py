"""Native builds are never silent, and builds made at install time are used only on the
CPU they were built for: a progress line on stderr for a fresh build (none for a cached
one), ``prebuild`` (the ``pip install`` step) into a folder, a prebuilt library taken on
this CPU, and one recorded for another CPU refused and rebuilt.

Loads run in a subprocess with a small source folder of their own, so they build fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel import config
from keel.native import build

# Building is what these tests check: a run with the tier turned off (CI's second pass,
# KEEL_NATIVE=off) has nothing to build; the pass with the tier on runs them.
NATIVE_ON = pytest.mark.skipif(config.settings().native == "off",
                               reason="KEEL_NATIVE=off: the native tier is off in this run")

REPO = Path(__file__).resolve().parents[2]
# Load "adder" from the source folder argv[1], with the prebuilt folder argv[2].
LOADER = """
import ctypes, json, sys
from pathlib import Path
from keel.native import build
build.SOURCE_DIR, build.PREBUILT_DIR = Path(sys.argv[1]), Path(sys.argv[2])
lib = build.library("adder")
answer = None if lib is None else lib.function("keel_add_one", [ctypes.c_int], ctypes.c_int)(41)
print(json.dumps({"answer": answer, "path": None if lib is None else str(lib.path)}))
"""


def _load(src: Path, prebuilt: Path, cache: Path) -> tuple[dict, str]:
    """(what the subprocess loaded, its stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "KEEL_CACHE_DIR": str(cache),
           "KEEL_NATIVE": "auto"}
    done = subprocess.run([sys.executable, "-c", LOADER, str(src), str(prebuilt)], env=env,
                          timeout=300, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _prebuild(src: Path, target: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    return build.prebuild(target)


def test_a_fresh_build_says_so_on_stderr_and_a_cached_one_does_not(
        sources: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, err = _load(sources, tmp_path / "none", cache)
    assert first["answer"] == 42
    assert "keel: compiling native kernels for this CPU (adder, ~1 s, once; cached in" in err
    assert str(cache / "native") in err
    assert "keel: built adder in" in err
    again, err = _load(sources, tmp_path / "none", cache)
    assert again["path"] == first["path"]
    assert "compiling" not in err and "built" not in err


@NATIVE_ON
def test_prebuild_builds_each_library_for_this_cpu(
        sources: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = _prebuild(sources, tmp_path / "prebuilt", monkeypatch)
    assert [(e["library"], e["state"], e["reason"]) for e in report] == [("adder", "built", "")]
    path = Path(report[0]["path"])
    assert path.parent == tmp_path / "prebuilt" and path.is_file()
    record = json.loads(next((tmp_path / "prebuilt").glob("adder-*.json")).read_text())
    assert record["cpu"] == build._cpu_digest() and record["file"] == path.name


@NATIVE_ON
def test_a_prebuilt_library_for_this_cpu_is_loaded_without_building(
        sources: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prebuilt = tmp_path / "prebuilt"
    _prebuild(sources, prebuilt, monkeypatch)
    loaded, err = _load(sources, prebuilt, tmp_path / "cache")
    assert loaded["answer"] == 42
    assert Path(loaded["path"]).parent == prebuilt
    assert "compiling" not in err


@NATIVE_ON
def test_a_prebuilt_library_for_another_cpu_is_refused_and_rebuilt(
        sources: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prebuilt = tmp_path / "prebuilt"
    _prebuild(sources, prebuilt, monkeypatch)
    record_path = next(prebuilt.glob("adder-*.json"))
    record = json.loads(record_path.read_text())
    record["cpu"] = "another-cpu-with-other-instructions"
    record_path.write_text(json.dumps(record))
    loaded, err = _load(sources, prebuilt, tmp_path / "cache")
    assert loaded["answer"] == 42
    assert Path(loaded["path"]).parent == tmp_path / "cache" / "native"
    assert "keel: compiling native kernels for this CPU (adder" in err


@NATIVE_ON
def test_prebuild_without_a_compiler_reports_why_and_raises_nothing(
        sources: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_CC", str(tmp_path / "no-such-cc"))
    config.reload_settings()
    report = _prebuild(sources, tmp_path / "prebuilt", monkeypatch)
    assert [(e["library"], e["state"], e["path"]) for e in report] == [("adder", "failed", None)]
    assert "no-such-cc" in report[0]["reason"]
    assert not list((tmp_path / "prebuilt").glob("*.so"))
