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
from collections.abc import Callable
from typing import Protocol, cast

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
