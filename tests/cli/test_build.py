"""``keel build``: every native library built (or found) now, and its state reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from keel import config, native
from keel.native import build
from keel.native.toolchain import find_compiler
from tests.cli.test_user_paths import _keel

LIBRARIES = sorted(p.stem for p in build.SOURCE_DIR.glob("*.c"))


@pytest.fixture(autouse=True)
def _fresh_native_state() -> Any:
    native.reset()
    yield
    native.reset()


@pytest.mark.skipif(config.settings().native == "off",
                    reason="KEEL_NATIVE=off: the native tier is off in this run")
def test_build_json_reports_each_library_built_or_found(
        capsys: pytest.CaptureFixture[str]) -> None:
    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(f"native tier unavailable: {why}")
    code, out, _ = _keel(capsys, "build", "--json")
    report = json.loads(out)
    assert code == 0 and report["available"] and report["compiler"]
    assert "-O3" in report["flags"]
    libraries = {e["library"]: e for e in report["libraries"]}
    assert sorted(libraries) == LIBRARIES
    for entry in libraries.values():
        assert entry["state"] in ("built", "cached", "prebuilt"), entry
        assert Path(entry["path"]).is_file()
    # a second run in a fresh process state finds them all in the cache, silently
    native.reset()
    code, out, err = _keel(capsys, "build", "--json")
    assert {e["state"] for e in json.loads(out)["libraries"]} <= {"cached", "prebuilt"}
    assert "compiling" not in err


def test_build_with_native_off_says_why_for_each_library(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_NATIVE", "off")
    config.reload_settings()
    native.reset()
    code, out, _ = _keel(capsys, "build")
    assert code == 0
    assert "KEEL_NATIVE=off" in out
    for name in LIBRARIES:
        assert any(line.split()[:2] == [name, "failed"] for line in out.splitlines()), out
    _, out, _ = _keel(capsys, "build", "--json")
    report = json.loads(out)
    assert not report["available"]
    assert {e["state"] for e in report["libraries"]} == {"failed"}
    assert all("KEEL_NATIVE=off" in e["reason"] for e in report["libraries"])
