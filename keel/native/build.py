"""Build, cache and load keel's native kernel libraries.

``library(name)`` compiles ``keel/native/src/<name>.c`` (with every header
beside it) into a shared object, caches it under ``KEEL_CACHE_DIR/native``
(else the user cache directory) and loads it with ctypes. The cache key
hashes the sources, the compiler and its flags and this CPU's feature flags,
so a cache shared between machines never hands a build for one CPU to
another. A build is written to a private temporary file and renamed into
place, so concurrent processes never see half a library. A fresh build says
so on stderr (what is built, about how long it takes, where it is cached) and
again when done: gemm takes 10-30 s, the others a few seconds; later processes
only load it, and start no compiler: the compiler's ``--version`` answer (part of
the key) is remembered beside the builds (``compilers.json``, under the binary's
path, inode, size and modification time). ``keel build`` (:func:`build_all`)
builds them all at once.

Install-time builds: ``pip install`` runs :func:`prebuild` into
``keel/native/prebuilt/``, recording beside each library the CPU it was built
for. Before building, keel takes such a library when its key (sources,
compiler, flags, CPU) and its recorded CPU match this machine and it checks
out like a cached one (root may own it: a system-wide install); a wheel built
on another CPU is never loaded here, the library is built into the cache.

Trust: a library runs as the caller, so keel loads only what it can vouch
for. Each build is recorded in a small file beside it (its size and SHA-256,
written atomically after the library); before loading, keel opens the
library, checks on the open file that it is a regular file of this user's,
writable by no one else, of the recorded size and hash, and loads it right
after (a library whose hash matched once is remembered with its device, inode,
size and modification and change times, and not hashed again while they are all
the same: any write changes its change time). A damaged entry (a truncated
``.so``) is built again. The cache folder must be this user's and writable by no one else; if
it is not, keel says why (``status().cache``) and builds in a private folder
of its own under the temporary directory. A compile running longer than
``KEEL_BUILD_TIMEOUT`` seconds (default 120) is killed with every process it
started, and the library counts as failed.

``KEEL_NATIVE`` chooses: ``auto`` (default: use native kernels when a
compiler works), ``off`` (never; the NumPy kernels run), ``on`` (required:
an unavailable native tier is a :class:`~keel.errors.BackendSelectionError`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel import config
from keel._files import Untrusted, open_trusted, private_folder, user_temp_folder
from keel._fork import renew_after_fork
from keel._hashing import file_identity, known_digest, remembering, sha256
from keel.config import Settings
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.native.toolchain import (
    BASE_FLAGS,
    Compiler,
    compiler_version,
    extra_flags,
    find_compiler,
    run_tool,
)

__all__ = ["NativeLibrary", "NativeStatus", "available", "build_all", "library", "loaded", "mode",
           "prebuild", "reset", "status"]

SOURCE_DIR = Path(__file__).resolve().parent / "src"
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"   # filled by ``pip install``
# fresh-build times seen on one core, idle to loaded, for the progress line (others: ~1 s)
_BUILD_ESTIMATES = {"gemm": "10-30 s", "window": "3-10 s", "winograd": "1-4 s",
                    "fastmath": "1-3 s"}
_RECORD_MAX_BYTES = 4096  # a build record is a few hundred bytes of JSON
_ARCH_FLAGS = ("-march=native",)
_PROBE_SOURCE = "int keel_native_probe(int x) { return x + 1; }\n"
_POOL = "threads"         # the worker pool every kernel library shares
_COMPILERS = "compilers.json"    # the compilers' --version answers (_remembered_version)
_COMPILERS_MAX_BYTES = 65536
_CHECKED = "checked.json"        # libraries whose hash matched, with their identity (_matches)
_CHECKED_MAX = 256
_CHECKED_MAX_BYTES = 1 << 20


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
    cache: str = ""                       # the folder builds are cached in, and why there

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "reason": self.reason, "compiler": self.compiler,
                "flags": list(self.flags), "mode": self.mode, "built": list(self.built),
                "failed": dict(self.failed), "cache": self.cache}


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
        renew_after_fork(self, "lock")
        self.checked = False
        self.compiler: Compiler | None = None
        self.flags: tuple[str, ...] = ()
        self.reason = "not checked yet"
        self.libraries: dict[str, NativeLibrary] = {}
        self.failed: dict[str, str] = {}
        # KEEL_NATIVE, KEEL_CC, KEEL_SPIN_US, KEEL_IDLE_SPIN_US, KEEL_CACHE_DIR and
        # KEEL_BUILD_TIMEOUT, taken at first use
        self.settings: Settings | None = None
        self.folder: Path | None = None       # the cache folder, checked (see cache_folder)
        self.cache = ""                       # where builds are cached, and why there
        self.origins: dict[str, str] = {}     # library -> "built", "cached" or "prebuilt"
        self.checked_files: dict[str, Any] | None = None   # _CHECKED, read on first use

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
        failed=dict(state.failed), cache=state.cache)


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
            lib = _mapped(name, source, state.compiler, state.flags)
        except (OSError, _BuildError) as exc:
            state.failed[name] = str(exc)
            if required:
                raise BackendSelectionError("native", str(exc)) from exc
            return None
        state.libraries[name] = lib
        if name == _POOL:
            _configure_pool(lib, state.values().spin_us, state.values().idle_spin_us)
        else:
            _attach_pool(lib)
        return lib


# Every library this process mapped, by file name (which carries its build key), and the
# worker pool: a loaded library stays mapped (reset() cannot unload it), so the same build
# in another cache folder is not mapped a second time, and no other build of threads.c is
# mapped after the first: a second pool would run the kernels loaded after it on workers
# that pin(), the yield and the spin settings sent to the first never reach.
_MAPPED: dict[str, NativeLibrary] = {}
_PROCESS_POOL: list[NativeLibrary] = []


def _mapped(name: str, source: Path, compiler: Compiler, flags: tuple[str, ...]
            ) -> NativeLibrary:
    """``name``'s library built by ``compiler`` with ``flags``, mapped once per process
    (the worker pool: the first one mapped, whatever its build)."""
    if name == _POOL and _PROCESS_POOL:
        return _PROCESS_POOL[0]
    path = _build(name, source, compiler, flags)
    lib = _MAPPED.get(path.name)
    if lib is None:
        lib = _MAPPED[path.name] = NativeLibrary(name, path)
    if name == _POOL:
        _PROCESS_POOL.append(lib)
    return lib


def loaded(name: str) -> NativeLibrary | None:
    """The library built from ``src/<name>.c`` if this process has loaded it (never builds)."""
    return _STATE.libraries.get(name)


def build_all() -> list[dict[str, Any]]:
    """Build (or find built) every native library now, compiling them side by side (one
    compiler process per core), then load them, the worker pool first. Per library:
    ``library``, ``state`` (``built``, ``cached``, ``prebuilt`` or ``failed``), ``seconds``
    (building and loading), ``path`` and ``reason`` (why it failed)."""
    names = sorted(s.stem for s in SOURCE_DIR.glob("*.c"))
    names.sort(key=lambda name: name != _POOL)
    state = _check()
    seconds: dict[str, float] = {}
    compiler = state.compiler
    if compiler is not None:
        _cache_folder()                       # chosen once, before the threads start
        _side_by_side(lambda name: _build_ahead(name, compiler, state, seconds), names)
    return [_build_one(name, seconds.get(name, 0.0)) for name in names]


def _side_by_side(work: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``work`` on every item, on up to one thread per core (each runs a compiler)."""
    from concurrent.futures import ThreadPoolExecutor  # (and logging): builds only

    workers = max(1, min(len(items), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="keel-build") as pool:
        return list(pool.map(work, items))


def _build_ahead(name: str, compiler: Compiler, state: _State,
                 seconds: dict[str, float]) -> None:
    """Build ``name`` into the cache (a failure is remembered, as :func:`library` does)."""
    start = time.perf_counter()
    try:
        _build(name, SOURCE_DIR / f"{name}.c", compiler, state.flags)
    except (OSError, _BuildError) as exc:
        with state.lock:
            state.failed.setdefault(name, str(exc))
    seconds[name] = time.perf_counter() - start


def _build_one(name: str, built_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        lib = library(name)
    except BackendSelectionError:
        lib = None
    state = _STATE
    seconds = round(built_s + time.perf_counter() - start, 3)
    if lib is None:
        return {"library": name, "state": "failed", "seconds": seconds, "path": None,
                "reason": state.failed.get(name, state.reason)}
    return {"library": name, "state": state.origins.get(name, "cached"), "seconds": seconds,
            "path": str(lib.path), "reason": ""}


def prebuild(target: Path) -> list[dict[str, Any]]:
    """Build every library into ``target`` for this CPU, recording the CPU each was built
    for (the step ``pip install`` runs; :func:`library` takes these builds when they match
    this CPU and compiler). Per library: ``library``, ``state`` (``built`` or ``failed``),
    ``seconds``, ``path``, ``reason``; no compiler makes every entry ``failed``."""
    global _STATE
    saved, _STATE = _STATE, _State()
    try:
        with tempfile.TemporaryDirectory(prefix="keel-prebuild-") as scratch:
            _STATE.folder = Path(scratch)    # the compiler probe, not in a user cache
            try:
                state = _check()
            except BackendSelectionError:
                state = _STATE
            target.mkdir(parents=True, exist_ok=True)
            return _side_by_side(lambda source: _prebuild_one(source, state, target),
                                 sorted(SOURCE_DIR.glob("*.c")))
    finally:
        _STATE = saved


def _prebuild_one(source: Path, state: _State, target: Path) -> dict[str, Any]:
    name, start = source.stem, time.perf_counter()
    entry: dict[str, Any] = {"library": name, "state": "failed", "path": None,
                             "reason": state.reason}
    if state.compiler is not None:
        key = _key(name, source, state.compiler, state.flags)
        try:
            _compile(name, source, state.compiler, state.flags, target, key)
            os.chmod(target / f"{key}.json", 0o644)   # readable by whoever runs keel
            entry.update(state="built", path=str(_verified(target, key, root_ok=True)),
                         reason="")
        except (OSError, _BuildError) as exc:
            entry["reason"] = str(exc)
    entry["seconds"] = round(time.perf_counter() - start, 3)
    return entry


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
    run = None if pool is None else pool.address("keel_parallel_capped")
    if run is not None:
        lib.function("keel_use_pool", [ctypes.c_void_p])(run)


def _configure_pool(pool: NativeLibrary, spin_us: int, idle_spin_us: int) -> None:
    """Hand the worker pool its settings (``KEEL_SPIN_US``, ``KEEL_IDLE_SPIN_US``): the C
    code reads no environment."""
    pool.function("keel_pool_set_spin_us", [ctypes.c_int64])(spin_us)
    pool.function("keel_pool_set_idle_spin_us", [ctypes.c_int64])(idle_spin_us)


def reset() -> None:
    """Forget what was found and loaded, and take the current settings (tests: after
    ``keel.config.reload_settings()`` with a changed ``KEEL_NATIVE`` / ``KEEL_CC``). The
    libraries stay mapped: loading one of the same build again takes the mapped one, and
    the worker pool stays the process's one (see ``_mapped``)."""
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
            compiler, how = find_compiler(values, _remembered_version)
            if compiler is None:
                state.reason = how
            else:
                flags, why = _working_flags(compiler)
                if flags is None:
                    state.reason = (f"{compiler.name} ({how}) cannot build a shared library "
                                    f"here: {why}")
                else:
                    state.compiler, state.flags = compiler, flags
                    state.reason = (f"{compiler.name} ({how}), "
                                    f"{' '.join(f for f in flags if f.startswith(('-O', '-m')))}")
        state.checked = True
        if state.compiler is None and values.native == "on":
            raise BackendSelectionError("native", state.reason)
        return state


def _remembered_version(path: str) -> str | None:
    """``path --version``'s first line, remembered in the cache folder under the compiler
    binary's real path, device, inode, size and modification time: a process that finds
    its libraries cached starts no compiler at all (a changed compiler is asked again)."""
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except OSError:
        return compiler_version(path)
    ident = f"{real}|{info.st_dev}|{info.st_ino}|{info.st_size}|{info.st_mtime_ns}"
    target = _cache_folder() / _COMPILERS
    known: dict[str, Any] = {}
    try:
        with os.fdopen(open_trusted(target), "rb") as f:
            loaded = json.loads(f.read(_COMPILERS_MAX_BYTES))
        known = loaded if isinstance(loaded, dict) else {}
    except (Untrusted, ValueError):
        pass
    if isinstance(known.get(ident), str):
        return str(known[ident])
    version = compiler_version(path)
    if version is not None:
        kept = {k: v for k, v in known.items() if k.split("|", 1)[0] != real}
        with contextlib.suppress(OSError):
            _write_record(target, {**kept, ident: version})
    return version


def _working_flags(compiler: Compiler) -> tuple[tuple[str, ...] | None, str]:
    """BASE_FLAGS plus the CPU-targeting flags this compiler accepts (None if none work),
    and the last failure."""
    why = ""
    for extra in (_ARCH_FLAGS, ()):
        flags = (*BASE_FLAGS, *extra, *extra_flags())
        try:
            _build("probe", None, compiler, flags)
        except _Timeout as exc:
            return None, str(exc)          # a compiler that hangs gets no second wait
        except (OSError, _BuildError) as exc:
            why = str(exc)
            continue
        return flags, ""
    return None, why


def _cache_folder() -> Path:
    """The folder builds are cached in: ``KEEL_CACHE_DIR/native`` when it is this user's
    and writable by no one else, else a private folder of keel's (the reason is kept)."""
    state = _STATE
    if state.folder is not None:
        return state.folder
    wanted = state.values().cache_dir / "native"
    try:
        state.folder = private_folder(wanted)
        state.cache = str(wanted)
    except Untrusted as exc:
        state.folder = _private_fallback()
        state.cache = f"{state.folder} ({wanted} not used: {exc})"
    return state.folder


def _private_fallback() -> Path:
    try:
        return user_temp_folder("native")
    except Untrusted:                      # that one is someone else's too: a fresh one
        return Path(tempfile.mkdtemp(prefix="keel-native-"))


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> str:
    """What the build targets: the architecture and the CPU's feature flags (read once
    per process)."""
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


def _key(name: str, source: Path | None, compiler: Compiler,
         flags: tuple[str, ...]) -> str:
    """The cache key: sources, headers, compiler, flags and this CPU."""
    code = source.read_bytes() if source is not None else _PROBE_SOURCE.encode()
    digest = sha256()
    for part in (code, compiler.path.encode(), compiler.version.encode(),
                 " ".join(flags).encode(), _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    if source is not None:
        for header in sorted(source.parent.glob("*.h")):
            digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return f"{name}-{digest.hexdigest()[:20]}"


def _cpu_digest() -> str:
    """A short fingerprint of :func:`_cpu_identity`, recorded with every build."""
    return sha256(_cpu_identity().encode()).hexdigest()[:32]


def _build(name: str, source: Path | None, compiler: Compiler,
           flags: tuple[str, ...]) -> Path:
    """The library for ``source`` (None: the probe), from the cache when its entry checks
    out, else the one ``pip install`` built when it was built for this CPU, else built
    (with a progress line on stderr). Checked just before it is returned: the caller loads
    it at once."""
    key = _key(name, source, compiler, flags)
    folder = _cache_folder()
    found, origin = _verified(folder, key), "cached"
    if found is None and source is not None:
        found, origin = _verified(PREBUILT_DIR, key, root_ok=True), "prebuilt"
    if found is None:
        origin = "built"
        if source is None:
            _compile(name, source, compiler, flags, folder, key)
        else:
            _compile_reporting(name, source, compiler, flags, folder, key)
        found = _verified(folder, key)
    if found is None:
        raise _BuildError(f"the build of {name} in {folder} did not check out after building")
    _STATE.origins.setdefault(name, origin)   # a build ahead (build_all) is kept as such
    return found


def _compile_reporting(name: str, source: Path, compiler: Compiler, flags: tuple[str, ...],
                       folder: Path, key: str) -> None:
    """:func:`_compile`, saying on stderr what is built, how long it may take, and when done."""
    how_long = _BUILD_ESTIMATES.get(name, "~1 s")
    _say(f"keel: compiling native kernels for this CPU ({name}, {how_long}, once; "
         f"cached in {folder})")
    start = time.perf_counter()
    try:
        _compile(name, source, compiler, flags, folder, key)
    except (OSError, _BuildError) as exc:
        _say(f"keel: building {name} failed after {time.perf_counter() - start:.1f} s "
             f"({exc}); keel uses its NumPy kernels for it")
        raise
    _say(f"keel: built {name} in {time.perf_counter() - start:.1f} s")


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _verified(folder: Path, key: str, root_ok: bool = False) -> Path | None:
    """The entry's library, when the open file's owner, mode, size and SHA-256 match its
    record and it was built for this CPU; None (build it again) otherwise. ``root_ok``
    (the install folder, which root may own): root's files are trusted too, and the
    record must name the CPU it was built for."""
    try:
        with os.fdopen(open_trusted(folder / f"{key}.json", root_ok), "rb") as f:
            record = json.loads(f.read(_RECORD_MAX_BYTES))
        path = folder / str(record["file"])
        size, sha = int(record["size"]), str(record["sha256"])
        cpu = str(record["cpu"] if root_ok else record.get("cpu", _cpu_digest()))
    except (Untrusted, ValueError, KeyError, TypeError):
        return None
    if path.parent != folder or not path.name.startswith(f"{key}-") or cpu != _cpu_digest():
        return None
    try:
        fd = open_trusted(path, root_ok)
    except Untrusted:
        return None
    try:
        good = _matches(path, fd, size, sha)
    finally:
        os.close(fd)
    return path if good else None


def _matches(path: Path, fd: int, size: int, sha: str) -> bool:
    """Whether the open library has the recorded size and SHA-256. The hash is computed
    unless this file was found good before with the same identity (remembered in the
    cache folder: :func:`keel._hashing.remembering`)."""
    info = os.fstat(fd)
    if info.st_size != size:
        return False
    ident, name = file_identity(info), str(path)
    checked = _checked_files()
    if known_digest(checked, name, ident) == sha:
        return True
    started = time.time_ns()
    if _fd_sha256(fd) != sha:
        return False
    kept = remembering(checked, name, ident, sha, started, _CHECKED_MAX)
    if kept is not None:
        with _STATE.lock:                     # builds ahead check from several threads
            checked.clear()
            checked.update(kept)
            with contextlib.suppress(OSError, Untrusted):
                _write_record(_cache_folder() / _CHECKED, checked)
    return True


def _checked_files() -> dict[str, Any]:
    """The libraries found good before (``_CHECKED``), read once per process."""
    state = _STATE
    if state.checked_files is None:
        state.checked_files = {}
        try:
            with os.fdopen(open_trusted(_cache_folder() / _CHECKED), "rb") as f:
                found = json.loads(f.read(_CHECKED_MAX_BYTES))
            if isinstance(found, dict):
                state.checked_files = found
        except (Untrusted, ValueError):
            pass
    return state.checked_files


def _fd_sha256(fd: int) -> str:
    digest = sha256(size=os.fstat(fd).st_size)
    os.lseek(fd, 0, os.SEEK_SET)
    while block := os.read(fd, 1 << 20):
        digest.update(block)
    return digest.hexdigest()


def _compile(name: str, source: Path | None, compiler: Compiler, flags: tuple[str, ...],
             folder: Path, key: str) -> None:
    """Build into a temporary file, install it under a name holding its hash, then write
    its record: a reader never sees a record naming a library not yet in place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=folder)
    os.close(fd)
    src_tmp = None
    try:
        if source is None:
            fd, src_tmp = tempfile.mkstemp(prefix=".probe-", suffix=".c", dir=folder)
            with os.fdopen(fd, "w") as f:
                f.write(_PROBE_SOURCE)
        _run_compiler(name, compiler, [*flags, f"-I{SOURCE_DIR}", "-o", tmp,
                                       src_tmp or str(source), "-lm"])
        os.chmod(tmp, 0o755)
        with open(tmp, "rb") as built:
            sha = _fd_sha256(built.fileno())
        target = folder / f"{key}-{sha[:16]}.so"
        record = {"file": target.name, "size": os.path.getsize(tmp), "sha256": sha,
                  "cpu": _cpu_digest()}
        os.replace(tmp, target)
        tmp = ""
        _write_record(folder / f"{key}.json", record)
    finally:
        for leftover in (tmp, src_tmp):
            if leftover:
                with contextlib.suppress(OSError):
                    os.unlink(leftover)


def _write_record(target: Path, record: Mapping[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".json", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class _Timeout(_BuildError):
    pass


def _run_compiler(name: str, compiler: Compiler, args: Sequence[str]) -> None:
    import subprocess

    timeout = _STATE.values().build_timeout_s
    try:
        done = run_tool([compiler.path, *args], timeout)
    except subprocess.TimeoutExpired:
        raise _Timeout(f"building {name} took over {timeout:g} s (KEEL_BUILD_TIMEOUT); "
                       "the compiler was stopped") from None
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no message"])[:3]
        raise _BuildError(f"{compiler.name} could not build {name}: {' | '.join(first)}")
