"""The C compiler keel builds its native kernels with, and the flags it uses.

keel compiles a handful of small C files on the machine that runs them, at
``pip install`` where it can, else at first use, rather than shipping binaries
built elsewhere: the build then targets the very CPU it runs on
(``-march=native``), and installing keel needs no compiler (without one,
keel runs its NumPy kernels and says so). The compiler is ``KEEL_CC`` when
set, else the first of ``cc``, ``gcc`` and ``clang`` on ``PATH``.

Flags: ``-O3``, ``-march=native`` where the compiler accepts it, GNU C11
(which lets the compiler contract ``a * b + c`` into fused multiply-adds),
``-fno-math-errno`` (so ``sqrtf`` and friends inline), position-independent
code, a shared object. No ``-ffast-math``: NaN and infinity must keep their
IEEE meaning, as NumPy gives them. ``KEEL_CFLAGS`` adds flags after these
(:func:`extra_flags`), e.g. ``-fsanitize=address,undefined`` for a checked build;
they are part of the cache key, so such a build never replaces the usual one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from keel import config
from keel.config import Settings

if TYPE_CHECKING:
    import subprocess

__all__ = ["BASE_FLAGS", "Compiler", "compiler_version", "extra_flags", "find_compiler",
           "run_tool"]

BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-fno-plt")
_CANDIDATES = ("cc", "gcc", "clang")
_VERSION_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Compiler:
    """A C compiler found on this machine."""

    path: str
    version: str                  # the first line of ``--version``

    @property
    def name(self) -> str:
        """A short name for reports: ``gcc 12.2.0``, ``clang 17.0.6``..."""
        words = self.version.split()
        real = os.path.basename(os.path.realpath(self.path)).lower()
        text = f"{self.version.lower()} {real}"
        family = ("clang" if "clang" in text else "gcc" if "gcc" in text
                  else os.path.basename(self.path))
        numbers = [w for w in words if w[:1].isdigit() and "." in w]
        return f"{family} {numbers[-1]}" if numbers else family


def extra_flags(settings: Settings | None = None) -> tuple[str, ...]:
    """The flags ``KEEL_CFLAGS`` adds to every native build (none by default)."""
    return (config.settings() if settings is None else settings).cflags


def find_compiler(settings: Settings | None = None,
                  version_of: Callable[[str], str | None] | None = None,
                  ) -> tuple[Compiler | None, str]:
    """The compiler to use and how it was found, or None and why there is none.

    ``settings`` (default: the process's) give ``KEEL_CC``; ``version_of`` (default: ask
    the compiler, ``--version``) gives a compiler's first line of ``--version``.
    """
    ask = compiler_version if version_of is None else version_of
    wanted = (config.settings() if settings is None else settings).cc
    if wanted:
        path = shutil.which(wanted)
        if path is None:
            return None, f"KEEL_CC={wanted!r} is not an executable on PATH"
        version = ask(path)
        if version is None:
            return None, f"KEEL_CC={wanted!r} did not answer --version"
        return Compiler(path, version), f"KEEL_CC={wanted}"
    for name in _CANDIDATES:
        path = shutil.which(name)
        if path is None:
            continue
        version = ask(path)
        if version is not None:
            return Compiler(path, version), f"{name} on PATH"
    return None, f"no C compiler found (looked for KEEL_CC, {', '.join(_CANDIDATES)} on PATH)"


def run_tool(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (its output captured) in a process group of its own.

    Past ``timeout`` seconds the whole group is killed (the compiler and every process it
    started: none is left behind) and :class:`subprocess.TimeoutExpired` is raised.
    """
    import subprocess  # a process whose kernels are cached starts none: not imported there

    own_group = hasattr(os, "killpg")
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=own_group)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc, own_group)
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen[str], own_group: bool) -> None:
    """Kill ``proc`` and (with ``own_group``) every process of its group, then reap it."""
    import signal
    import subprocess

    if own_group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5.0)


@functools.lru_cache(maxsize=8)
def compiler_version(path: str) -> str | None:
    """The first line of ``path --version`` (None: no answer), asked once per process."""
    import subprocess

    timeout = min(_VERSION_TIMEOUT_S, config.settings().build_timeout_s)
    try:
        done = run_tool([path, "--version"], timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return done.stdout.strip().splitlines()[0]
