"""The native cache is trusted only when it deserves it: a damaged library is rebuilt, a
folder others can write is not used, a compiler that hangs is stopped with its children.

Loads that could crash run in a subprocess, so a crash fails the test, not pytest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel import config, native
from keel.errors import InvalidArgumentError
from keel.native.toolchain import find_compiler

REPO = Path(__file__).resolve().parents[2]
# A library whose constructor runs at load: it leaves a marker file behind.
PLANTED = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w"); if (f) { fputs("ran", f); fclose(f); }
}
int keel_add_one(int x) { return x + 1000; }
"""
# Load "adder" from the source folder argv[1] and print keel_add_one(41) and the status.
LOADER = """
import ctypes, json, sys
from pathlib import Path
from keel import native
from keel.native import build
build.SOURCE_DIR = Path(sys.argv[1])
lib = native.library("adder")
answer = None if lib is None else lib.function("keel_add_one", [ctypes.c_int], ctypes.c_int)(41)
print(json.dumps({"answer": answer, "path": None if lib is None else str(lib.path),
                  "status": native.status().to_dict()}))
"""


def _load_in_subprocess(src: Path, cache: Path, tmp: Path, loader: str = LOADER) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "KEEL_CACHE_DIR": str(cache),
           "TMPDIR": str(tmp), "KEEL_NATIVE": "auto"}
    done = subprocess.run([sys.executable, "-c", loader, str(src)], env=env, timeout=300,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_truncated_library_is_rebuilt_not_loaded(sources: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _load_in_subprocess(sources, cache, tmp_path)
    assert first["answer"] == 42
    library = Path(first["path"])
    whole = library.read_bytes()
    library.write_bytes(whole[: len(whole) // 3])       # damaged in place: dlopen would crash
    second = _load_in_subprocess(sources, cache, tmp_path)
    assert second["answer"] == 42
    assert _matches_record(Path(second["path"]))


def test_a_library_not_matching_its_record_is_rebuilt(sources: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _load_in_subprocess(sources, cache, tmp_path)
    library = Path(first["path"])
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF                          # one flipped byte, same size
    library.write_bytes(bytes(data))
    second = _load_in_subprocess(sources, cache, tmp_path)
    assert second["answer"] == 42
    assert _matches_record(Path(second["path"]))


def test_a_library_found_good_is_not_hashed_again_until_it_changes(
        sources: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    at_once = "import keel._hashing as h; h.SETTLE_NS = 0"
    settled = LOADER.replace("build.SOURCE_DIR = Path(sys.argv[1])",
                             f"build.SOURCE_DIR = Path(sys.argv[1]); {at_once}")
    no_hashing = settled.replace(at_once, "build._fd_sha256 = None")
    first = _load_in_subprocess(sources, cache, tmp_path, settled)    # built, hashed
    assert first["answer"] == 42
    checked = json.loads((cache / "native" / "checked.json").read_text())
    assert first["path"] in checked                                   # remembered
    assert _load_in_subprocess(sources, cache, tmp_path, no_hashing)["answer"] == 42
    library = Path(first["path"])
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF                      # same size, a new change time
    library.write_bytes(bytes(data))
    second = _load_in_subprocess(sources, cache, tmp_path, settled)  # hashed: rebuilt
    assert second["answer"] == 42 and _matches_record(Path(second["path"]))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _matches_record(library: Path) -> bool:
    record = json.loads(next(library.parent.glob("adder-*.json")).read_text())
    return record["file"] == library.name and record["sha256"] == _sha256(library)


def _plant(sources: Path, tmp_path: Path, cache: Path, marker: Path) -> None:
    """Fill ``cache`` as keel would, then swap the library for one with a constructor and
    rewrite its record to match: everything an attacker who can write there can do."""
    good = _load_in_subprocess(sources, cache, tmp_path)
    library = Path(good["path"])
    evil_src = tmp_path / "planted.c"
    evil_src.write_text(PLANTED % marker)
    compiler, _ = find_compiler()
    assert compiler is not None
    subprocess.run([compiler.path, "-shared", "-fPIC", "-o", str(library), str(evil_src)],
                   check=True, timeout=120)
    record_path = next(library.parent.glob("adder-*.json"))
    record = json.loads(record_path.read_text())
    record.update(size=library.stat().st_size, sha256=_sha256(library))
    record_path.write_text(json.dumps(record))


def test_a_library_planted_in_a_world_writable_cache_is_not_loaded(
        sources: Path, tmp_path: Path) -> None:
    cache = tmp_path / "shared"
    marker = tmp_path / "constructor-ran"
    _plant(sources, tmp_path, cache, marker)
    for folder in (cache, cache / "native"):
        folder.chmod(0o777)
    for path in (cache / "native").iterdir():
        path.chmod(0o666)
    result = _load_in_subprocess(sources, cache, tmp_path)
    assert not marker.exists()
    assert result["answer"] == 42                         # built afresh in a private folder
    assert not result["path"].startswith(str(cache))
    assert "is writable by other users" in result["status"]["cache"]
    assert str(cache / "native") in result["status"]["cache"]


def test_a_library_owned_by_another_user_is_not_loaded(sources: Path, tmp_path: Path) -> None:
    if not hasattr(os, "getuid") or os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    cache = tmp_path / "theirs"
    marker = tmp_path / "constructor-ran"
    _plant(sources, tmp_path, cache, marker)
    for path in (cache / "native", *(cache / "native").iterdir()):
        os.chown(path, 65534, 65534)
    result = _load_in_subprocess(sources, cache, tmp_path)
    assert not marker.exists() and result["answer"] == 42
    assert "belongs to another user (uid 65534)" in result["status"]["cache"]


def test_a_planted_file_in_a_trusted_folder_is_not_loaded(
        sources: Path, tmp_path: Path) -> None:
    # The folder is ours, but one entry was made writable by others: that entry is rebuilt.
    cache = tmp_path / "cache"
    marker = tmp_path / "constructor-ran"
    _plant(sources, tmp_path, cache, marker)
    library = next((cache / "native").glob("adder-*.so"))
    library.chmod(0o777)
    result = _load_in_subprocess(sources, cache, tmp_path)
    assert not marker.exists() and result["answer"] == 42
    assert result["status"]["cache"] == str(cache / "native")


HANGING_CC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fakecc 1.0"; exit 0; fi
sleep 300 &
echo $! >> "{pids}"
echo $$ >> "{pids}"
sleep 300
"""


def _alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rsplit(")", 1)[1].split()[0] != "Z"       # a zombie has finished


@pytest.mark.skipif(not Path("/proc").is_dir() or not shutil.which("sh"),
                    reason="needs /proc and a POSIX shell")
def test_a_hanging_compiler_is_stopped_with_every_process_it_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = tmp_path / "pids"
    cc = tmp_path / "fakecc"
    cc.write_text(HANGING_CC.format(pids=pids))
    cc.chmod(0o755)
    monkeypatch.setenv("KEEL_CC", str(cc))
    monkeypatch.setenv("KEEL_BUILD_TIMEOUT", "1")
    monkeypatch.setenv("KEEL_NATIVE", "auto")
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    config.reload_settings()
    native.reset()
    try:
        started = time.monotonic()
        assert not native.available()
        waited = time.monotonic() - started
        reason = native.status().reason
    finally:
        native.reset()
    assert "took over 1 s (KEEL_BUILD_TIMEOUT)" in reason
    assert waited < 60                     # one timeout, not the default 120 s nor two of them
    started_pids = [int(p) for p in pids.read_text().split()]
    assert len(started_pids) == 2
    time.sleep(0.2)
    assert not [p for p in started_pids if _alive(p)]
    assert not list((tmp_path / "cache" / "native").glob(".*"))   # no temporaries left


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "nan", "inf"])
def test_a_bad_build_timeout_is_an_error_naming_it(raw: str) -> None:
    with pytest.raises(InvalidArgumentError,
                       match=rf"KEEL_BUILD_TIMEOUT='{raw}' must be a (finite )?number of "
                             r"seconds( >= 0| > 0)?$"):
        config.Settings.from_env({"KEEL_BUILD_TIMEOUT": raw})


def test_the_build_timeout_setting_is_read() -> None:
    assert config.Settings.from_env({"KEEL_BUILD_TIMEOUT": "2.5"}).build_timeout_s == 2.5
    assert config.Settings.from_env({}).build_timeout_s == 120.0
