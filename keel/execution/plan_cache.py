"""The compiled-plan cache: a model loaded again skips optimization and placement.

``load_model`` looks a model up here before it optimizes it, and stores it
after planning its first input signature. An entry is one ``.keel`` file
(:mod:`keel.formats.keel_format`: versioned, checksummed) holding the
optimized graph with its weights; its header also carries, as JSON, the
model's declared inputs and outputs and the plan of its first signature.

The entry's name is its key: a SHA-256 over the model's bytes and everything
else the result depends on: the load options, the machine
(:func:`~keel.planning.calibration.hardware_fingerprint`, or the profile the
caller gave), keel's version and a stamp of its source files, the native
kernels' status, the calibration in use, the backends registered, keel's
settings and the cpu planner's constants as they are in this process
(:mod:`keel.backends.planner_constants`). Change any of them and the model is planned again.

Trust: the folder (``cache_dir()/plans``) and every entry must belong to the
current user and be writable by no one else, or the cache is not used (an
entry that fails the check is rebuilt and replaced). Entries are written to a
temporary file in the same folder and renamed into place, so no reader sees
half an entry. A truncated, corrupt, stale or foreign entry is rebuilt,
never trusted, never an error. The folder keeps at most ``MAX_ENTRIES``
entries and ``MAX_BYTES`` in all; the least recently used go first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel._files import Untrusted as _Unusable
from keel._files import open_trusted, private_folder, read_regular, trusted_folder
from keel._hashing import file_identity as _identity
from keel._hashing import known_digest, remembering, sha256
from keel.config import cache_dir, settings
from keel.errors import InvalidArgumentError, KeelError
from keel.execution.compiled import CompiledModel, EntryError, from_json, to_json
from keel.graph.ir import Graph

__all__ = [
    "CACHE_FORMAT", "MAX_BYTES", "MAX_ENTRIES", "CacheEntry", "Lookup",
    "ModelSource", "cache_key", "clear", "entries", "lookup", "model_bytes", "plans_dir",
    "store",
]

CACHE_FORMAT = 2              # the entry's JSON layout; a change makes every entry a miss
MAX_ENTRIES = 16
MAX_BYTES = 4 << 30
_META = "keel.plan_cache"     # the graph metadata key the entry's JSON travels under
_NAME = re.compile(r"[0-9a-f]{64}\.keel")
_TEMP_MAX_AGE_S = 3600.0      # a temporary file this old was left by a writer that died
_DIGESTS = "digests.json"     # model files' digests, by path (see model_digest)
_MAX_DIGESTS = 256


@dataclass(frozen=True)
class Lookup:
    """A lookup's result: the compiled model (None on a miss) and, for a plan, why."""

    compiled: CompiledModel | None
    reason: str = ""
    storable: bool = True      # False: the folder cannot be used, so nothing is stored


@dataclass(frozen=True)
class CacheEntry:
    """One entry on disk, for ``keel cache list``."""

    key: str
    model: str
    path: str
    size_bytes: int
    modified: float            # seconds since the epoch of the last store or hit

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.modified)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "model": self.model, "path": self.path,
                "size_bytes": self.size_bytes, "age_s": round(self.age_s, 1)}


# ---- the key -----------------------------------------------------------------------------
def model_bytes(src: Any) -> bytes | None:
    """The bytes a model is keyed by: a file's content, bytes, a serialized ModelProto.

    None for anything else (a ``Graph``) or a file that cannot be read (the
    loader then reports it).
    """
    if isinstance(src, (str, os.PathLike)):
        try:                    # a regular file only: never a device, FIFO or folder
            return read_regular(src, MAX_BYTES, "model file")
        except KeelError:
            return None
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src)
    if type(src).__name__ == "ModelProto":
        return bytes(src.SerializeToString())
    return None


class ModelSource:
    """A model as the cache sees it: its bytes, read once when needed, and their digest.

    A file's digest is remembered in the cache folder with the file's device,
    inode, size and modification and change times, and used again while they
    are all unchanged (:func:`keel._hashing.remembering`: not a file changed in
    the same clock tick as it was hashed).
    """

    def __init__(self, src: Any) -> None:
        self.src = src
        self.path = Path(src) if isinstance(src, (str, os.PathLike)) else None
        self._data: bytes | None = None
        self._stat = self.file_identity()

    def data(self) -> bytes | None:
        """The model's bytes (:func:`model_bytes`), read on first use."""
        if self._data is None:
            self._data = model_bytes(self.src)
        return self._data

    def digest(self) -> str | None:
        """The SHA-256 of the model's bytes; None when there are none."""
        if self.path is None:
            data = self.data()
            return None if data is None else sha256(data).hexdigest()
        return None if self._stat is None else _file_digest(self, self.path, self._stat)

    def file_identity(self) -> list[int] | None:
        """The file's device, inode, size, modification and change times (None: no file)."""
        try:
            return None if self.path is None else _identity(self.path.stat())
        except (OSError, ValueError):         # ValueError: a path holding a NUL byte
            return None

    def unchanged(self) -> bool:
        """Whether the file is still the one that was hashed (always, for bytes)."""
        return self.path is None or self.file_identity() == self._stat

    def may_use_external_data(self) -> bool:
        """Whether an ONNX model may keep weights in external files (its bytes hold the
        ``location`` key of external data; weight bytes may match it too, rarely)."""
        from keel.formats.keel_format import MAGIC

        data = self.data()
        return data is not None and not data.startswith(MAGIC) and b"\x08location" in data


def cache_key(digest: str, options: Mapping[str, Any], hardware: Any = None,
              backends: Mapping[str, Any] | None = None) -> str:
    """The SHA-256 key of the model with ``digest`` loaded with ``options`` here.

    ``hardware`` is the profile the caller gave (None: this machine's
    fingerprint); ``backends`` describes the registry (names, chain,
    availability). See the module docstring for the rest.
    """
    parts = {"format": CACHE_FORMAT, "model": digest,
             "options": dict(options), "backends": dict(backends or {}),
             "machine": _machine(hardware), "keel": _keel_identity(),
             "native": _native_identity(), "calibration": _calibration_identity(),
             "settings": _settings_identity(), "planner": _planner_identity()}
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return sha256(text.encode()).hexdigest()


def _machine(hardware: Any) -> Any:
    from keel.planning.calibration_record import machine_fingerprint

    if hardware is None:
        return machine_fingerprint()
    # A given profile drives placement as a whole; how long its probe took does not.
    profile = hardware.to_dict() if hasattr(hardware, "to_dict") else repr(hardware)
    return {k: v for k, v in profile.items() if k != "probe_seconds"} \
        if isinstance(profile, dict) else profile


def _keel_identity() -> dict[str, str]:
    from keel import __version__

    return {"version": str(__version__), "sources": _source_stamp()}


@functools.cache
def _source_stamp() -> str:
    """A hash of the names, sizes and modification times of keel's source files.

    A development checkout changes its code without changing its version: an
    edit, a ``git checkout`` or a reinstall changes the stamp.
    """
    lines: list[str] = []
    _stamp_lines(str(Path(__file__).resolve().parent.parent), "", lines)
    return sha256("".join(sorted(lines)).encode()).hexdigest()


def _stamp_lines(folder: str, relative: str, lines: list[str]) -> None:
    """``path|size|mtime`` of each source file under ``folder`` (``relative`` to the
    package), as ``os.walk`` would find them, with one ``scandir`` per folder."""
    with os.scandir(folder) as entries:
        found = list(entries)
    for entry in found:
        if entry.is_dir(follow_symlinks=False):
            if entry.name != "__pycache__":
                _stamp_lines(entry.path, f"{relative}{entry.name}{os.sep}", lines)
        elif entry.name.endswith((".py", ".c", ".h", ".yaml")):
            info = entry.stat()
            lines.append(f"{relative}{entry.name}|{info.st_size}|{info.st_mtime_ns}\n")


def _planner_identity() -> str:
    # A planner constant changed in this process (the source stamp sees only edits).
    from keel.backends import planner_constants

    return planner_constants.refresh()


def _native_identity() -> dict[str, Any]:
    # Variant choices depend on whether native kernels can run, and with what flags.
    from keel.native import build

    try:
        status = build.status()
    except KeelError as exc:          # KEEL_NATIVE=on without a compiler: placement says so
        return {"error": exc.message}
    return {"available": status.available, "compiler": status.compiler,
            "flags": list(status.flags), "mode": status.mode}


def _calibration_identity() -> Any:
    from keel.planning.calibration_record import calibration_status

    status = calibration_status()
    cal = status.calibration
    return {"path": status.path, "calibration": None if cal is None else cal.to_dict()}


def _settings_identity() -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(settings()).items()
            if k not in ("plan_cache", "code_cache")}


# ---- the folder --------------------------------------------------------------------------
def plans_dir() -> Path:
    """Where entries live: ``cache_dir()/plans``."""
    return cache_dir() / "plans"


def _existing_folder() -> Path | None:
    """The plans folder, checked; None when there is none yet."""
    return trusted_folder(plans_dir())


def _made_folder() -> Path:
    """The plans folder, created (private to this user) when missing, checked."""
    return private_folder(plans_dir())


# ---- remembered file digests ----------------------------------------------------------
def _file_digest(source: ModelSource, path: Path, ident: list[int]) -> str | None:
    name = str(path.resolve())
    known = _digests()
    found = known_digest(known, name, ident)
    if found is not None:
        return found
    started = time.time_ns()
    data = source.data()
    if data is None:
        return None
    digest = sha256(data).hexdigest()
    kept = remembering(known, name, ident, digest, started, _MAX_DIGESTS)
    if kept is not None and source.unchanged():
        with contextlib.suppress(_Unusable, OSError):
            folder = _made_folder()
            _replace_atomically(folder / _DIGESTS, lambda tmp: tmp.write_text(json.dumps(kept)))
    return digest


def _digests() -> dict[str, Any]:
    """The remembered digests; empty when the folder or the file cannot be trusted."""
    try:
        folder = _existing_folder()
        if folder is None or not (folder / _DIGESTS).exists():
            return {}
        known = json.loads(_read_trusted(folder / _DIGESTS))
    except (_Unusable, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


# ---- lookup ------------------------------------------------------------------------------
def lookup(key: str) -> Lookup:
    """The entry stored under ``key``; never raises (an unusable entry is a miss with why)."""
    try:
        folder = _existing_folder()
    except _Unusable as exc:
        return Lookup(None, f"plan cache not used: {exc}", storable=False)
    path = None if folder is None else folder / f"{key}.keel"
    if path is None or not path.exists():
        return Lookup(None)
    try:
        compiled = _read_entry(path, key)
    except _Unusable as exc:
        return Lookup(None, f"plan cache entry {key[:12]} not trusted: {exc}; planning again")
    with contextlib.suppress(OSError):
        os.utime(path)                      # recently used: pruned last
    return Lookup(compiled, f"compiled plan loaded from cache {key[:12]}: optimization and "
                            "placement skipped")


def _read_entry(path: Path, key: str) -> CompiledModel:
    from keel.formats.keel_format import load_keel

    data = _read_trusted(path)
    try:
        graph = load_keel(data)
        meta = json.loads(graph.metadata.pop(_META))
        if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT or \
                meta.get("key") != key:
            raise _Unusable("it was written by another version or for another key")
        return from_json(graph, meta)
    except _Unusable:
        raise
    except EntryError as exc:
        raise _Unusable(str(exc)) from None
    except (KeelError, KeyError, ValueError, TypeError, AttributeError) as exc:
        detail = exc.message if isinstance(exc, KeelError) else f"{type(exc).__name__}: {exc}"
        raise _Unusable(f"it is corrupt ({detail})") from None


def _read_trusted(path: Path) -> bytes:
    """The file's bytes, after checking (on the open file) who owns it and who may write it."""
    with os.fdopen(open_trusted(path), "rb") as f:
        return f.read()


# ---- store -------------------------------------------------------------------------------
def store(key: str, compiled: CompiledModel) -> str:
    """Write ``compiled`` under ``key`` atomically and prune; returns a line for the plan.

    Never raises: a folder that cannot be used or written is the reason returned.
    """
    short = key[:12]
    try:
        meta = {"format": CACHE_FORMAT, "key": key, **to_json(compiled)}
        folder = _made_folder()
        _write(folder / f"{key}.keel", compiled.graph, meta)
    except (_Unusable, EntryError) as exc:
        return f"compiled plan not stored in the cache: {exc}"
    except (OSError, KeelError) as exc:
        why = exc.message if isinstance(exc, KeelError) else exc.strerror or str(exc)
        return f"compiled plan not stored in the cache: {why}"
    _prune(folder)
    return f"compiled plan stored in cache {short}"


def _write(target: Path, graph: Graph, meta: dict[str, Any]) -> None:
    from keel.formats.keel_format import save_keel

    tagged = dataclasses.replace(graph, metadata={**graph.metadata, _META: json.dumps(meta)})
    _replace_atomically(target, lambda tmp: save_keel(tagged, tmp))


def _replace_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """``write`` a private temporary file beside ``target``, then rename it over ``target``."""
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _prune(folder: Path, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
    """Keep the most recently used entries within the bounds; drop dead writers' temp files."""
    now = time.time()
    total = 0
    for kept, (path, info) in enumerate(_listing(folder), start=1):
        total += info.st_size
        if kept > max_entries or (kept > 1 and total > max_bytes):
            with contextlib.suppress(OSError):
                path.unlink()
    for tmp in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > _TEMP_MAX_AGE_S:
                tmp.unlink()


def _listing(folder: Path) -> list[tuple[Path, os.stat_result]]:
    """Entries (by name) with their stat, most recently used first."""
    found = []
    for path in folder.iterdir():
        if _NAME.fullmatch(path.name):
            with contextlib.suppress(OSError):
                found.append((path, path.stat()))
    return sorted(found, key=lambda item: item[1].st_mtime, reverse=True)


# ---- list and clear ----------------------------------------------------------------------
def entries() -> list[CacheEntry]:
    """The entries on disk, most recently used first (``InvalidArgumentError``: unsafe folder)."""
    folder = _checked_folder()
    if folder is None:
        return []
    return [CacheEntry(path.stem, _model_name(path), str(path), info.st_size, info.st_mtime)
            for path, info in _listing(folder)]


def clear() -> int:
    """Remove every entry (and leftover temporary file); returns how many entries went."""
    folder = _checked_folder()
    if folder is None:
        return 0
    removed = 0
    for path, _ in _listing(folder):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    for other in (*folder.glob(".*.tmp"), folder / _DIGESTS):
        with contextlib.suppress(FileNotFoundError):
            other.unlink()
    return removed


def _checked_folder() -> Path | None:
    try:
        return _existing_folder()
    except _Unusable as exc:
        raise InvalidArgumentError(f"the plan cache is not used: {exc}") from None


def _model_name(path: Path) -> str:
    """The model an entry was stored for, from its header alone ("?" when unreadable)."""
    from keel.formats.keel_format import read_header

    try:
        meta = json.loads(read_header(path)["graph"]["metadata"][_META])
        return str(meta.get("name") or "?")
    except (KeelError, KeyError, TypeError, ValueError):
        return "?"
