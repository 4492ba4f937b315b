"""Build, cache and load keel's native kernel libraries.

``library(name)`` compiles ``keel/native/src/<name>.c`` (with every header
beside it) into a shared object, caches it under ``KEEL_CACHE_DIR/native``
(else the user cache directory) and loads it with ctypes. The cache key
hashes the sources, the compiler and its flags and this CPU's feature flags,
so a cache shared between machines never hands a build for one CPU to
another. A build is written to a private temporary file and renamed into
place, so concurrent processes never see half a library. The first build of
a library takes about a second; later processes only load it.

``KEEL_NATIVE`` chooses: ``auto`` (default: use native kernels when a
compiler works), ``off`` (never; the NumPy kernels run), ``on`` (required:
an unavailable native tier is a :class:`~keel.errors.BackendSelectionError`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel import config
from keel.config import Settings
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.native.toolchain import BASE_FLAGS, Compiler, find_compiler

__all__ = ["NativeLibrary", "NativeStatus", "available", "library", "loaded", "mode", "reset",
           "status"]

SOURCE_DIR = Path(__file__).resolve().parent / "src"
_BUILD_TIMEOUT_S = 300.0
_ARCH_FLAGS = ("-march=native",)
_PROBE_SOURCE = "int keel_native_probe(int x) { return x + 1; }\n"
_POOL = "threads"         # the worker pool every kernel library shares


@dataclass(frozen=True)
class NativeStatus:
    """Whether native kernels can run here, and why (or why not)."""

    available: bool
    reason: str
    compiler: str | None = None           # e.g. "gcc 12.2.0"
    flags: tuple[str, ...] = ()
    mode: str = "auto"
    built: tuple[str, ...] = ()           # libraries loaded in this process
    failed: Mapping[str, str] = field(default_factory=dict)   # library -> why

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "reason": self.reason, "compiler": self.compiler,
                "flags": list(self.flags), "mode": self.mode, "built": list(self.built),
                "failed": dict(self.failed)}


class NativeLibrary:
    """A loaded native library; :meth:`function` declares one of its C functions."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self._dll = ctypes.CDLL(str(path))

    def function(self, symbol: str, argtypes: Sequence[Any],
                 restype: Any = None) -> Callable[..., Any]:
        """The C function ``symbol`` with its argument and result types declared."""
        try:
            fn = getattr(self._dll, symbol)
        except AttributeError:
            raise InvalidArgumentError(
                f"native library {self.name!r} has no function {symbol!r}") from None
        fn.argtypes = list(argtypes)
        fn.restype = restype
        return fn

    def address(self, symbol: str) -> int | None:
        """The address of the C function ``symbol``; None when the library has none."""
        fn = getattr(self._dll, symbol, None)
        return None if fn is None else int(ctypes.cast(fn, ctypes.c_void_p).value or 0)

    def __repr__(self) -> str:
        return f"NativeLibrary({self.name!r}, {str(self.path)!r})"


class _State:
    """The process's view of the native tier (compiler found once, libraries loaded once)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.checked = False
        self.compiler: Compiler | None = None
        self.flags: tuple[str, ...] = ()
        self.reason = "not checked yet"
        self.libraries: dict[str, NativeLibrary] = {}
        self.failed: dict[str, str] = {}
        # KEEL_NATIVE, KEEL_CC, KEEL_SPIN_US and KEEL_CACHE_DIR, taken at first use
        self.settings: Settings | None = None

    def values(self) -> Settings:
        """The settings this state runs with: the process's, taken once."""
        if self.settings is None:
            self.settings = config.settings()
        return self.settings


_STATE = _State()


def mode() -> str:
    """``KEEL_NATIVE`` as this process's native tier read it: ``auto``, ``on`` or ``off``."""
    return _STATE.values().native


def status() -> NativeStatus:
    """Whether native kernels are available, with the compiler, flags and reason."""
    state = _check()
    return NativeStatus(
        available=state.compiler is not None, reason=state.reason,
        compiler=state.compiler.name if state.compiler else None, flags=state.flags,
        mode=state.values().native, built=tuple(sorted(state.libraries)),
        failed=dict(state.failed))


def available() -> bool:
    """True when native kernels can be built and loaded here."""
    return _check().compiler is not None


def library(name: str) -> NativeLibrary | None:
    """The loaded library built from ``src/<name>.c``; None when the tier is unavailable.

    A library whose build fails is remembered (``status().failed``) and not
    tried again in this process; keel then runs the NumPy kernels.
    """
    found = _STATE.libraries.get(name)
    if found is not None:
        return found
    state = _check()
    with state.lock:
        found = state.libraries.get(name)
        required = state.values().native == "on"
        if found is not None or name in state.failed or state.compiler is None:
            if found is None and required:
                raise BackendSelectionError(
                    "native", state.failed.get(name, state.reason))
            return found
        source = SOURCE_DIR / f"{name}.c"
        if not source.is_file():
            raise InvalidArgumentError(f"no native source {source.name} in {SOURCE_DIR}")
        try:
            path = _build(name, source, state.compiler, state.flags)
            lib = NativeLibrary(name, path)
        except (OSError, _BuildError) as exc:
            state.failed[name] = str(exc)
            if required:
                raise BackendSelectionError("native", str(exc)) from exc
            return None
        state.libraries[name] = lib
        if name == _POOL:
            _configure_pool(lib, state.values().spin_us)
        else:
            _attach_pool(lib)
        return lib


def loaded(name: str) -> NativeLibrary | None:
    """The library built from ``src/<name>.c`` if this process has loaded it (never builds)."""
    return _STATE.libraries.get(name)


def _attach_pool(lib: NativeLibrary) -> None:
    """Hand ``lib`` the worker pool of ``threads.c`` (see ``src/parallel.h``): one pool for
    every library. Without it (threads.c failed to build) the library runs its chunks in
    order on the calling thread."""
    use = lib.address("keel_use_pool")
    if use is None:
        return
    try:
        pool = library(_POOL)
    except BackendSelectionError:
        pool = None
    run = None if pool is None else pool.address("keel_parallel")
    if run is not None:
        lib.function("keel_use_pool", [ctypes.c_void_p])(run)


def _configure_pool(pool: NativeLibrary, spin_us: int) -> None:
    """Hand the worker pool its settings (``KEEL_SPIN_US``): the C code reads no environment."""
    pool.function("keel_pool_set_spin_us", [ctypes.c_int64])(spin_us)


def reset() -> None:
    """Forget what was found and loaded, and take the current settings (tests: after
    ``keel.config.reload_settings()`` with a changed ``KEEL_NATIVE`` / ``KEEL_CC``)."""
    global _STATE
    _STATE = _State()


class _BuildError(Exception):
    pass


def _check() -> _State:
    state = _STATE
    if state.checked:
        return state
    with state.lock:
        if state.checked:
            return state
        values = state.values()
        if values.native == "off":
            state.reason = "disabled by KEEL_NATIVE=off"
        else:
            compiler, how = find_compiler(values)
            if compiler is None:
                state.reason = how
            else:
                flags = _working_flags(compiler)
                if flags is None:
                    state.reason = f"{compiler.name} ({how}) cannot build a shared library here"
                else:
                    state.compiler, state.flags = compiler, flags
                    state.reason = (f"{compiler.name} ({how}), "
                                    f"{' '.join(f for f in flags if f.startswith(('-O', '-m')))}")
        state.checked = True
        if state.compiler is None and values.native == "on":
            raise BackendSelectionError("native", state.reason)
        return state


def _working_flags(compiler: Compiler) -> tuple[str, ...] | None:
    """BASE_FLAGS plus the CPU-targeting flags this compiler accepts; None if none work."""
    for extra in (_ARCH_FLAGS, ()):
        flags = (*BASE_FLAGS, *extra)
        try:
            _build("probe", None, compiler, flags)
        except (OSError, _BuildError):
            continue
        return flags
    return None


def _cache_dir() -> Path:
    return _STATE.values().cache_dir / "native"


def _cpu_identity() -> str:
    """What the build targets: the architecture and the CPU's feature flags."""
    text = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features", "model name", "cpu part"):
                    text += line
                if key in ("flags", "features") and text:
                    break
    except OSError:
        text = platform.processor()
    return f"{platform.machine()}|{text}"


def _build(name: str, source: Path | None, compiler: Compiler, flags: tuple[str, ...]) -> Path:
    code = source.read_bytes() if source is not None else _PROBE_SOURCE.encode()
    digest = hashlib.sha256()
    for part in (code, compiler.path.encode(), compiler.version.encode(),
                 " ".join(flags).encode(), _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    if source is not None:
        for header in sorted(source.parent.glob("*.h")):
            digest.update(header.name.encode() + b"\0" + header.read_bytes())
    folder = _cache_dir()
    target = folder / f"{name}-{digest.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=folder)
    os.close(fd)
    src_tmp = None
    try:
        if source is None:
            fd, src_tmp = tempfile.mkstemp(prefix=".probe-", suffix=".c", dir=folder)
            with os.fdopen(fd, "w") as f:
                f.write(_PROBE_SOURCE)
            src = src_tmp
        else:
            src = str(source)
        cmd = [compiler.path, *flags, f"-I{SOURCE_DIR}", "-o", tmp, src, "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=_BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise _BuildError(f"building {name} took over {_BUILD_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[:3]
            raise _BuildError(f"{compiler.name} could not build {name}: {' | '.join(first)}")
        os.replace(tmp, target)
        tmp = ""
        return target
    finally:
        for leftover in (tmp, src_tmp):
            if leftover:
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
