"""cuDNN engine choices kept on disk, so a new process does not time every engine again.

Measuring a conv signature (:mod:`keel.backends.gpu.cudnn_graph`) builds and times
every engine of every fusion cuDNN serves: 0.1-1 s per new shape, about 12 s to warm
MobileNetV2 at float16. The winner (the fusion, the engine's plan index and name, its
time) is written to ``cache_dir()/cudnn/engines-<id>.json``, one file per (keel
version, cuDNN version, frontend version, GPU name, compute capability): a choice
measured on one GPU or library never decides on another. A later process builds only
that engine, after checking that cuDNN's heuristics still rank it at the same index
under the same name; anything else measures again.

The file is trusted as keel's other caches are (:mod:`keel._files`): the folder and the
file must be the current user's and writable by no one else, or the cache is not read
and not written. Writes are atomic (a reader never sees half a file); a file that is
unreadable, of another format or of another machine is ignored and replaced on the next
write. Nothing here ever raises into a run: a cache that cannot be used only costs the
measurement. ``KEEL_PLAN_CACHE=off`` turns it off with the compiled-plan cache.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

from keel._files import Untrusted, open_trusted, private_folder, write_atomically
from keel._fork import renew_after_fork

__all__ = ["Choice", "EngineCache", "engine_cache"]

FILE_FORMAT = "keel-cudnn-engines"
VERSION = 1
_LOG = logging.getLogger("keel.gpu")
_MAX_BYTES = 8 * 1024 * 1024         # a file larger than this is not keel's: ignored


@dataclass(frozen=True)
class Choice:
    """The measured winner of one signature: which fused graph, which engine, how fast."""

    fusion: str          # Fusion.describe() of the graph that won
    plan: int            # the engine's index among cuDNN's ranked plans for that graph
    engine: str          # the engine's name at that index (checked before it is reused)
    ms: float            # its measured time, what runs after the graph included

    def to_dict(self) -> dict[str, Any]:
        return {"fusion": self.fusion, "plan": self.plan, "engine": self.engine,
                "ms": round(self.ms, 6)}

    @classmethod
    def from_dict(cls, data: Any) -> Choice | None:
        try:
            choice = cls(str(data["fusion"]), int(data["plan"]), str(data["engine"]),
                         float(data["ms"]))
        except (KeyError, TypeError, ValueError):
            return None
        return choice if choice.plan >= 0 else None


class EngineCache:
    """The engine choices of one machine identity (``identity``: what must match), in
    ``folder``. Read once, then updated in memory and on disk as signatures are measured."""

    def __init__(self, folder: Path, identity: dict[str, Any]) -> None:
        self.identity = identity
        text = json.dumps(identity, sort_keys=True)
        self.folder = folder
        self.path = folder / f"engines-{sha256(text.encode()).hexdigest()[:16]}.json"
        self.status = "not read yet"
        self._entries: dict[str, Choice] | None = None
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")

    def get(self, key: str) -> Choice | None:
        with self._lock:
            return self._read().get(key)

    def put(self, key: str, choice: Choice) -> None:
        """Keep ``choice`` and write the file again (atomically), unless the file was refused;
        a failure to write is logged once and leaves the run alone."""
        with self._lock:
            entries = self._read()
            if entries.get(key) == choice:
                return
            entries[key] = choice
            if self.status.startswith("refused"):
                return                     # kept for this process; that file is not keel's
            try:
                self._write(entries)
            except (OSError, Untrusted) as exc:
                if not self.status.startswith("not written"):
                    _LOG.warning("cuDNN engine choices not saved to %s: %s", self.path, exc)
                self.status = f"not written: {exc}"

    def _read(self) -> dict[str, Choice]:
        if self._entries is None:
            self._entries, self.status = self._load()
        return self._entries

    def _load(self) -> tuple[dict[str, Choice], str]:
        try:
            private_folder(self.folder)
            fd = open_trusted(self.path)
        except Untrusted as exc:
            if not self.path.exists():
                return {}, f"nothing measured yet ({self.path} does not exist)"
            return {}, f"refused {self.path}: {exc}"
        try:
            with os.fdopen(fd, "rb") as fh:
                raw = fh.read(_MAX_BYTES + 1)
            data = json.loads(raw) if len(raw) <= _MAX_BYTES else None
        except (OSError, ValueError) as exc:
            return {}, f"ignored {self.path}: unreadable ({exc})"
        if not isinstance(data, dict) or data.get("format") != FILE_FORMAT \
                or data.get("version") != VERSION:
            return {}, f"ignored {self.path}: not a keel cuDNN engine file of version {VERSION}"
        if data.get("identity") != self.identity:
            return {}, f"ignored {self.path}: measured on another GPU or library"
        entries = {}
        raw_entries = data.get("entries")
        for key, value in (raw_entries.items() if isinstance(raw_entries, dict) else ()):
            choice = Choice.from_dict(value)
            if choice is not None:
                entries[str(key)] = choice
        return entries, f"loaded {self.path}"

    def _write(self, entries: dict[str, Choice]) -> None:
        private_folder(self.folder)
        text = json.dumps({"format": FILE_FORMAT, "version": VERSION, "identity": self.identity,
                           "entries": {k: c.to_dict() for k, c in sorted(entries.items())}},
                          indent=1, sort_keys=True)
        write_atomically(self.path, text + "\n")
        self.status = f"saved {self.path}"


_CACHES: dict[tuple[str, str], EngineCache] = {}
_LOCK = threading.Lock()
renew_after_fork(sys.modules[__name__], "_LOCK")


def engine_cache(identity: dict[str, Any]) -> EngineCache | None:
    """This process's cache for ``identity`` (one object per folder and identity), or None
    where caching is off (``KEEL_PLAN_CACHE=off``)."""
    from keel.config import cache_dir, settings

    if not settings().plan_cache:
        return None
    folder = cache_dir() / "cudnn"
    key = (str(folder), json.dumps(identity, sort_keys=True))
    with _LOCK:
        found = _CACHES.get(key)
        if found is None:
            found = _CACHES[key] = EngineCache(folder, identity)
        return found
