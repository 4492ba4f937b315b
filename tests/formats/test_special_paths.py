"""Paths are checked before reading: only regular files, within a size cap.

Devices, FIFOs, sockets and folders are a ``ModelFormatError`` (a FIFO never hangs), a
path holding a NUL byte an ``InvalidArgumentError``; ``keel run`` prints one line and a
status that says which, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest

import keel
from keel import _files
from keel.cli import EXIT_ERROR
from keel.errors import InvalidArgumentError, ModelFormatError
from keel.formats.keel_format import is_keel_file, load_keel, save_keel
from keel.graph.importers.onnx import import_onnx
from keel.testing.models import mlp

REPO = Path(__file__).resolve().parents[2]
posix_only = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and /dev")


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "model.onnx"
    os.mkfifo(path)
    yield path


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "model.keel"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        yield path


@posix_only
@pytest.mark.parametrize("plan_cache", [True, False])
@pytest.mark.parametrize(("where", "kind"), [("/dev/zero", "a character device"),
                                             ("/dev/null", "a character device"),
                                             ("folder", "a folder"), ("fifo", "a FIFO"),
                                             ("socket", "a socket")])
def test_special_files_are_refused_as_format_errors(
        where: str, kind: str, plan_cache: bool, tmp_path: Path, fifo: Path,
        unix_socket: Path) -> None:
    path = {"folder": tmp_path, "fifo": fifo, "socket": unix_socket}.get(where, Path(where))
    with pytest.raises(ModelFormatError, match=f"is {kind}; keel reads only regular files"):
        keel.load_model(path, plan_cache=plan_cache)


@posix_only
def test_every_reader_refuses_a_fifo_without_waiting(tmp_path: Path) -> None:
    # Opened for reading, a FIFO without a writer would block for ever.
    for name in ("m.onnx", "m.keel", "m.bin"):
        os.mkfifo(tmp_path / name)
    with pytest.raises(ModelFormatError, match="is a FIFO"):
        import_onnx(tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError, match="is a FIFO"):
        load_keel(tmp_path / "m.keel")
    assert not is_keel_file(tmp_path / "m.bin")


@pytest.mark.parametrize("path", ["model\x00.onnx", Path("dir\x00/model.keel")])
def test_a_path_with_a_nul_byte_is_a_typed_error(path: str | Path) -> None:
    with pytest.raises(InvalidArgumentError, match="contains a NUL byte"):
        keel.load_model(path)
    with pytest.raises(InvalidArgumentError, match="contains a NUL byte"):
        import_onnx(path)


def test_a_file_over_the_cap_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    path.write_bytes(b"x" * 100)
    assert _files.read_regular(path, 100) == b"x" * 100
    with pytest.raises(ModelFormatError, match="is 100 bytes; keel reads at most 99 here"):
        _files.read_regular(path, 99)


def test_regular_model_files_still_load(tmp_path: Path) -> None:
    onnx_path = tmp_path / "m.onnx"
    onnx.save(mlp(in_features=4, hidden=(8,), classes=2), onnx_path)
    keel_path = tmp_path / "m.keel"
    save_keel(import_onnx(onnx_path), keel_path)
    for path in (onnx_path, keel_path):
        assert keel.load_model(path).input_names == ["x"]


def _keel_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "keel", *args], env=env, timeout=300,
                          capture_output=True, text=True, check=False)


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keel: error: "), done.stderr
    return lines[0]


@posix_only
def test_keel_run_on_dev_zero_prints_one_line() -> None:
    done = _keel_cli("run", "/dev/zero", "--random")
    assert done.returncode == EXIT_ERROR == 2
    assert "[MODEL_FORMAT] model file '/dev/zero' is a character device" in \
        _one_line_error(done)


def test_keel_run_with_a_huge_batch_prints_one_line(tmp_path: Path) -> None:
    path = tmp_path / "m.keel"
    save_keel(import_onnx(mlp(in_features=4, hidden=(8,), classes=2)), path)
    done = _keel_cli("run", str(path), "--random", "--batch", "100000000", "--memory-limit",
                     "100MB")
    assert done.returncode == EXIT_ERROR
    assert ("[MEMORY_LIMIT] random inputs at --batch 100000000 need 1.5 GiB, more than the "
            "memory limit") in _one_line_error(done)
    unlimited = _keel_cli("run", str(path), "--random", "--batch", "100000000000")
    assert unlimited.returncode == EXIT_ERROR
    assert "more than the memory available" in _one_line_error(unlimited)
