"""SHA-256 without OpenSSL for small inputs.

``hashlib.sha256`` is OpenSSL's: about 7x faster than Python's built-in
implementation (0.8 against 5.9 ms per MB here), but importing ``hashlib`` maps
libcrypto, 3.6 MB of a process's resident memory, and a fresh process that loads
a small model hashes only a few hundred KB (its keys, the model's bytes, the native
libraries it checks). :func:`sha256` takes the built-in one below
:data:`OPENSSL_FROM` bytes and OpenSSL's from there; both give the same digests.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

__all__ = ["OPENSSL_FROM", "Digest", "sha256"]

OPENSSL_FROM = 4 << 20     # bytes: above, OpenSSL's speed outweighs its import


class Digest(Protocol):
    """What keel uses of a hash object."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def sha256(data: bytes = b"", size: int | None = None) -> Digest:
    """A SHA-256 hash object started with ``data``; ``size``: how many bytes it will
    hash in all (default ``len(data)``), which picks the implementation."""
    if (len(data) if size is None else size) < OPENSSL_FROM:
        builtin = _builtin()
        if builtin is not None:
            return builtin(data)
    import hashlib

    return hashlib.sha256(data)


@functools.lru_cache(maxsize=1)
def _builtin() -> Callable[[bytes], Digest] | None:
    """Python's own SHA-256: in ``_sha2`` from Python 3.12, ``_sha256`` before (looked up
    once: a module that is not there is searched for on every path entry each time)."""
    for name in ("_sha2", "_sha256"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return cast("Callable[[bytes], Digest]", module.sha256)
    return None


# A file changed less than this before it was hashed is not remembered: a write in the
# same clock tick could not be told apart (git's "racy" entries).
SETTLE_NS = 2_000_000_000


def file_identity(info: os.stat_result) -> list[int]:
    """A file's device, inode, size and modification and change times: any write changes
    the change time, which no user can set back."""
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def known_digest(known: Mapping[str, Any], name: str, ident: list[int]) -> str | None:
    """The digest remembered in ``known`` for the file ``name`` with identity ``ident``."""
    seen = known.get(name)
    if isinstance(seen, dict) and seen.get("stat") == ident and isinstance(seen.get("sha256"), str):
        return str(seen["sha256"])
    return None


def remembering(known: Mapping[str, Any], name: str, ident: list[int], digest: str,
                started_ns: int, limit: int) -> dict[str, Any] | None:
    """``known`` with ``digest`` remembered for ``name`` (the oldest entries dropped past
    ``limit``), or None when the file changed within :data:`SETTLE_NS` of ``started_ns``,
    when hashing began."""
    if ident[4] >= started_ns - SETTLE_NS:
        return None
    kept = [(k, v) for k, v in known.items() if k != name and isinstance(v, dict)]
    return {**dict(kept[-(limit - 1):]), name: {"stat": ident, "sha256": digest}}
