"""keel's kernel libraries built for another architecture, to check them under emulation.

keel builds its kernels on the machine that runs them (:mod:`keel.native.build`); this
module builds the same sources with the same flags (``BASE_FLAGS``, the source folder's
headers, ``-lm``) but a cross compiler and a fixed target instead of ``-march=native``,
so the code paths of another instruction set (aarch64's NEON) are compiled and can be
run here under ``qemu-user``. Nothing here runs in a normal load: the tests use it
(``tests/native/test_aarch64.py``), with Debian's ``gcc-aarch64-linux-gnu``,
``libc6-dev-arm64-cross`` and ``qemu-user``.

aarch64's target is ``-march=armv8-a``, the baseline every 64-bit ARM core runs:
Advanced SIMD (NEON) is part of it, and the kernels use no half-precision arithmetic.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from keel.errors import KeelError
from keel.native.build import SOURCE_DIR
from keel.native.toolchain import BASE_FLAGS, run_tool

__all__ = ["TARGETS", "CrossBuildError", "CrossTarget", "build_libraries", "build_program",
           "find_target"]

_BUILD_TIMEOUT_S = 300.0


class CrossBuildError(KeelError):
    """A cross build that failed (the compiler's first lines of output say why)."""


@dataclass(frozen=True)
class CrossTarget:
    """A target architecture: its cross compiler, flags, emulator and library root."""

    name: str
    compiler: str                  # the cross compiler's command
    flags: tuple[str, ...]         # instead of -march=native
    emulator: str                  # qemu-user's command for the target
    sysroot: str                   # the target's C library (qemu's -L)

    def command(self, program: Path, *args: str) -> list[str]:
        """The command line that runs ``program`` (built for the target) under emulation."""
        return [self.emulator, "-L", self.sysroot, str(program), *args]


TARGETS = {
    "aarch64": CrossTarget("aarch64", "aarch64-linux-gnu-gcc", ("-march=armv8-a",),
                           "qemu-aarch64", "/usr/aarch64-linux-gnu"),
}


def find_target(name: str) -> tuple[CrossTarget | None, str]:
    """The target ``name`` when its cross compiler, emulator and C library are here, else
    None and what is missing."""
    target = TARGETS.get(name)
    if target is None:
        return None, f"no cross target {name!r}; known: {', '.join(sorted(TARGETS))}"
    missing = [tool for tool in (target.compiler, target.emulator) if shutil.which(tool) is None]
    if not Path(target.sysroot, "lib").is_dir():
        missing.append(f"{target.sysroot}/lib (the target's C library)")
    if missing:
        return None, f"{name} cross tools missing: {', '.join(missing)}"
    return target, ""


def build_libraries(target: CrossTarget, folder: Path,
                    names: Sequence[str] | None = None) -> dict[str, Path]:
    """Build ``src/<name>.c`` (default: every source) into ``folder/<name>.so`` for the
    target, side by side; raises :class:`CrossBuildError` for the first that fails."""
    wanted = sorted(s.stem for s in SOURCE_DIR.glob("*.c")) if names is None else list(names)
    folder.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> Path:
        out = folder / f"{name}.so"
        _compile(target, [*BASE_FLAGS, *target.flags, f"-I{SOURCE_DIR}", "-o", str(out),
                          str(SOURCE_DIR / f"{name}.c"), "-lm"], name)
        return out

    with ThreadPoolExecutor(max(1, len(wanted))) as pool:
        return dict(zip(wanted, pool.map(one, wanted), strict=True))


def build_program(target: CrossTarget, source: Path, out: Path) -> Path:
    """Build a C program (a test harness) for the target, linked with ``-ldl``."""
    _compile(target, ["-O2", "-std=gnu11", "-o", str(out), str(source), "-ldl"], source.stem)
    return out


def _compile(target: CrossTarget, args: list[str], what: str) -> None:
    try:
        done = run_tool([target.compiler, *args], _BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CrossBuildError(f"building {what} for {target.name} took over "
                              f"{_BUILD_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no message"])[:3]
        raise CrossBuildError(f"{target.compiler} could not build {what}: {' | '.join(first)}")
