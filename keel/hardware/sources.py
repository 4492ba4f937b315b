"""Injectable probe sources: where every hardware reading comes from.

The probe never touches the machine directly. It asks a :class:`ProbeSources`
for files (``/proc``, ``/sys``, cgroup trees), command output (``nvidia-smi``,
``rocm-smi``, ``sysctl``, ``system_profiler``), environment variables, platform
facts, optional modules (``psutil``, ``pynvml``, ``amdsmi``), the affinity mask,
Windows registry values and Windows processor features. ``ProbeSources.real()``
reads this machine; tests build one with fake files, fake command answers and
fake modules (see :mod:`keel.hardware.fakes`), so every branch of detection
runs without the hardware.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "CommandResult",
    "DirectoryFiles",
    "FileSource",
    "MemoryFiles",
    "PlatformInfo",
    "ProbeSources",
    "run_command",
]

#: Seconds any one external command may take before it is abandoned.
COMMAND_TIMEOUT_S = 3.0


class FileSource(Protocol):
    """Read-only access to a file tree laid out like ``/``."""

    def read_text(self, path: str) -> str | None:
        """The file's text, or None when it is missing or unreadable."""

    def listdir(self, path: str) -> list[str]:
        """Sorted entry names of a directory; empty when it is missing."""

    def readlink(self, path: str) -> str | None:
        """The target of a symbolic link, or None."""

    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at ``path``."""


class DirectoryFiles:
    """Files under a root directory (``/`` for this machine, a temp tree in tests)."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)

    def _path(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def read_text(self, path: str) -> str | None:
        try:
            return self._path(path).read_text(encoding="utf-8", errors="replace")
        except (OSError, ValueError):
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(path)))
        except OSError:
            return []

    def readlink(self, path: str) -> str | None:
        try:
            return os.readlink(self._path(path))
        except OSError:
            return None

    def exists(self, path: str) -> bool:
        return self._path(path).exists()


class MemoryFiles:
    """An in-memory file tree: ``{"/proc/cpuinfo": "...", ...}`` plus symlinks."""

    def __init__(self, files: Mapping[str, str], links: Mapping[str, str] | None = None) -> None:
        self.files = {_norm(k): v for k, v in files.items()}
        self.links = {_norm(k): v for k, v in (links or {}).items()}

    def read_text(self, path: str) -> str | None:
        return self.files.get(_norm(path))

    def listdir(self, path: str) -> list[str]:
        prefix = _norm(path).rstrip("/") + "/"
        names = {
            key[len(prefix):].split("/", 1)[0]
            for key in (*self.files, *self.links)
            if key.startswith(prefix)
        }
        return sorted(names)

    def readlink(self, path: str) -> str | None:
        return self.links.get(_norm(path))

    def exists(self, path: str) -> bool:
        key = _norm(path)
        return key in self.files or key in self.links or bool(self.listdir(key))

    def write_tree(self, root: str | os.PathLike[str]) -> None:
        """Write this tree under ``root`` (so :class:`DirectoryFiles` can read it)."""
        base = Path(root)
        for key, text in self.files.items():
            target = base / key.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        for key, dest in self.links.items():
            target = base / key.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(dest, target)


def _norm(path: str) -> str:
    return "/" + path.strip("/")


@dataclass(frozen=True)
class CommandResult:
    """What an external command answered: its stdout, or why there is none."""

    ok: bool
    output: str = ""
    reason: str = ""


Runner = Callable[[Sequence[str], float], CommandResult]


def run_command(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> CommandResult:
    """Run a command if it is on PATH; never raises."""
    exe = shutil.which(argv[0])
    if exe is None:
        return CommandResult(False, reason=f"{argv[0]} not found on PATH")
    import subprocess  # (with signal, selectors, locale: ~3 ms) only when a tool is found

    try:
        done = subprocess.run(
            [exe, *argv[1:]], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return CommandResult(False, reason=f"{argv[0]} did not answer within {timeout:g} s")
    except OSError as exc:
        return CommandResult(False, reason=f"{argv[0]} could not be started: {exc}")
    if done.returncode != 0:
        first = (done.stderr or done.stdout).strip().splitlines()
        detail = f": {first[0]}" if first else ""
        return CommandResult(False, reason=f"{argv[0]} exited with {done.returncode}{detail}")
    return CommandResult(True, output=done.stdout)


@dataclass(frozen=True)
class PlatformInfo:
    """Facts from the ``platform`` module."""

    system: str                 # Linux | Darwin | Windows | ...
    machine: str                # raw: x86_64, AMD64, arm64, aarch64, ...
    release: str = ""
    processor: str = ""
    node: str = ""
    python_version: str = ""

    @classmethod
    def current(cls) -> PlatformInfo:
        # Only Windows' probe reads ``processor``; elsewhere platform.processor() runs
        # ``uname -p`` in a child process, on every probe.
        system = platform.system()
        return cls(
            system=system,
            machine=platform.machine(),
            release=platform.release(),
            processor=platform.processor() if system == "Windows" else "",
            node=platform.node(),
            python_version=platform.python_version(),
        )


def _import(name: str) -> tuple[Any | None, str]:
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # a broken optional package must not break the probe
        return None, f"{name} is not importable ({type(exc).__name__}: {exc})"


def _real_affinity() -> frozenset[int] | None:
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return None
    try:
        return frozenset(getter(0))
    except OSError:
        return None


def _real_registry(key: str, value: str) -> Any | None:
    if sys.platform != "win32":
        return None
    import winreg

    try:
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, key) as handle:
            return winreg.QueryValueEx(handle, value)[0]
    except OSError:
        return None


def _real_win_feature(feature: int) -> bool | None:
    if sys.platform != "win32":
        return None
    import ctypes

    try:
        return bool(ctypes.windll.kernel32.IsProcessorFeaturePresent(feature))
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class ProbeSources:
    """Everything the probe may read. Defaults read this machine.

    ``importer`` returns ``(module, "")`` or ``(None, why)``; ``runner`` returns a
    :class:`CommandResult`; ``affinity`` returns the CPU ids this process may
    run on, or None where the OS has no affinity API; ``clock`` times the probe.
    """

    files: FileSource = field(default_factory=DirectoryFiles)
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    platform: PlatformInfo = field(default_factory=PlatformInfo.current)
    runner: Runner = run_command
    importer: Callable[[str], tuple[Any | None, str]] = _import
    affinity: Callable[[], frozenset[int] | None] = _real_affinity
    registry: Callable[[str, str], Any | None] = _real_registry
    win_feature: Callable[[int], bool | None] = _real_win_feature
    clock: Callable[[], float] = time.perf_counter

    @classmethod
    def real(cls) -> ProbeSources:
        """Sources that read this machine."""
        return cls()

    def read(self, path: str) -> str | None:
        try:
            return self.files.read_text(path)
        except Exception:  # a faulty file source reads as a missing file
            return None

    def listdir(self, path: str) -> list[str]:
        """The entries of folder ``path``; a faulty or missing folder lists nothing."""
        try:
            return self.files.listdir(path)
        except Exception:  # a faulty file source reads as a missing folder
            return []

    def run(self, *argv: str, timeout: float = COMMAND_TIMEOUT_S) -> CommandResult:
        try:
            return self.runner(argv, timeout)
        except Exception as exc:  # a faulty runner is a failed source, not a crash
            return CommandResult(False, reason=f"{argv[0]} failed: {exc}")

    def module(self, name: str) -> tuple[Any | None, str]:
        try:
            return self.importer(name)
        except Exception as exc:  # a faulty importer is a missing module, not a crash
            return None, f"importing {name} failed ({type(exc).__name__}: {exc})"


# --- small parsing helpers shared by the probe modules ----------------------


class Notes:
    """Collects ``field: why`` notes for the fields a source could not fill."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, field_name: str, why: str) -> None:
        self.items.append(f"{field_name}: {why}")

    def extend(self, notes: Sequence[str]) -> None:
        self.items.extend(notes)

    def as_tuple(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.items))  # keep order, drop repeats


def to_int(text: object) -> int | None:
    """``int`` of a reading, or None when it is not an integer."""
    if isinstance(text, bool) or text is None:
        return None
    raw = str(text).strip()
    try:
        return int(raw, 16) if raw.lower().startswith("0x") else int(raw)
    except ValueError:
        return None


def to_float(text: object) -> float | None:
    """``float`` of a reading, or None when it is not a number."""
    try:
        return float(str(text).strip())
    except (TypeError, ValueError):
        return None


def parse_key_values(text: str, sep: str = ":") -> dict[str, str]:
    """``key<sep> value`` lines into a dict (first occurrence wins)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, found, value = line.partition(sep)
        if found and key.strip() and key.strip() not in out:
            out[key.strip()] = value.strip()
    return out


def parse_cpu_list(text: str) -> frozenset[int] | None:
    """``0-3,8,10-11`` into a set of CPU ids; None when malformed."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        a, b = to_int(lo), to_int(hi) if dash else to_int(lo)
        if a is None or b is None or b < a:
            return None
        ids.update(range(a, b + 1))
    return frozenset(ids)


# --- cgroups ------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupDirs:
    """The cgroup directories of this process for one controller, leaf first."""

    version: str                # "v1" | "v2"
    dirs: tuple[str, ...]       # from the process's own cgroup up to the mount point

    def read(self, src: ProbeSources, name: str) -> list[tuple[str, str]]:
        """``(dir, text)`` for every level that has the file ``name``."""
        found = []
        for d in self.dirs:
            text = src.read(f"{d}/{name}")
            if text is not None:
                found.append((d, text.strip()))
        return found


def cgroup_dirs(src: ProbeSources, controller: str) -> tuple[CgroupDirs | None, str]:
    """Locate this process's cgroup for ``controller`` (``cpu`` or ``memory``).

    Returns ``(dirs, "")`` or ``(None, why)``. cgroup v1 wins when the controller
    is mounted there (hybrid hosts keep controllers on v1 and leave v2 empty).
    """
    text = src.read("/proc/self/cgroup")
    if text is None:
        return None, "/proc/self/cgroup is not readable"
    mounts = _cgroup_mounts(src)
    v2_path = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controller in controllers.split(","):
            root, point = mounts.get(controller, ("/", f"/sys/fs/cgroup/{controller}"))
            return CgroupDirs("v1", _walk_up(point, _relative(path, root))), ""
        if controllers == "":
            v2_path = path
    if v2_path is not None:
        root, point = mounts.get("", ("/", "/sys/fs/cgroup"))
        return CgroupDirs("v2", _walk_up(point, _relative(v2_path, root))), ""
    return None, f"no cgroup {controller} controller in /proc/self/cgroup"


def _cgroup_mounts(src: ProbeSources) -> dict[str, tuple[str, str]]:
    """controller ("" for v2) -> (mount root, mount point) from mountinfo."""
    mounts: dict[str, tuple[str, str]] = {}
    for line in (src.read("/proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            mounts.setdefault("", (fields[3], fields[4]))
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                mounts.setdefault(option, (fields[3], fields[4]))
    return mounts


def _relative(path: str, root: str) -> str:
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        return path[len(root):]
    return path


def _walk_up(point: str, rel: str) -> tuple[str, ...]:
    parts = [p for p in rel.split("/") if p and p != ".."]
    dirs = ["/".join([point.rstrip("/"), *parts[:n]]) for n in range(len(parts), -1, -1)]
    return tuple(dirs)
