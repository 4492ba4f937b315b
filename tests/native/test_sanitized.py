"""The native kernels built under AddressSanitizer and UndefinedBehaviorSanitizer.

A subprocess builds keel's native libraries with ``KEEL_CFLAGS`` set to
``-fsanitize=address,undefined`` (no recovery: the first finding aborts) into a
fresh cache, and runs the fastmath and pooling-window op tests, which compare
the kernels with the reference backend, under them. Python is not built with
the sanitizers, so their runtimes are preloaded (``LD_PRELOAD``) for the
ctypes-loaded libraries; leak checking is off (the interpreter's own
allocations at exit are not keel's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SANITIZE = "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
TESTS = ("tests/native/test_fastmath.py", "tests/native/test_window_prepared.py")


def _runtime(name: str) -> str | None:
    """The gcc sanitizer runtime's path, or None when this toolchain has none."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    found = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True,
                           timeout=30, check=False).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def test_native_op_tests_pass_under_asan_and_ubsan(tmp_path: Path) -> None:
    asan, ubsan = _runtime("libasan.so"), _runtime("libubsan.so")
    if asan is None or ubsan is None:
        pytest.skip("gcc with its AddressSanitizer and UBSan runtimes is not installed here")
    root = Path(__file__).resolve().parents[2]
    # An instrumented build takes several times a plain one's time (gcc -O3 with ASan and
    # UBSan on a loaded 2-core Xeon: window.c 83 s, gemm.c 118 s, against 8 s and 21 s
    # plain), past the default KEEL_BUILD_TIMEOUT while other tests run beside it.
    env = {**os.environ, "KEEL_CC": "gcc", "KEEL_CFLAGS": SANITIZE, "KEEL_NATIVE": "on",
           "KEEL_BUILD_TIMEOUT": "600",
           "LD_PRELOAD": f"{asan}:{ubsan}",
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=1",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
           "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    base = tmp_path / "base"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         f"--basetemp={base}", *TESTS], cwd=root, env=env, capture_output=True, text=True,
        timeout=1500, check=False)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
    built = list((base / "keel-cache").rglob("*.so"))
    assert built, "the native libraries were not built in the run's cache"
    assert all(b"__asan_init" in lib.read_bytes() for lib in built), built  # really sanitized
