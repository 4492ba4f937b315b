"""The code ``dataclasses`` compiles for keel's classes, kept between processes.

``@dataclass`` writes a class's ``__init__``, ``__repr__``, ``__eq__``, ``__hash__`` and
(frozen) ``__setattr__``/``__delattr__`` as source text and compiles it with ``exec``
when the class is defined. A fresh process that loads a small model and predicts
defines about a hundred of keel's dataclasses, and compiling their ~500 methods took
about 40 of its ~85 ms of keel imports (Python 3.11 on the 2-core EPYC). Python keeps a
module's bytecode (``__pycache__``), not these.

:func:`install` (``import keel`` runs it) gives ``dataclasses`` an ``exec`` that, for a
class of a keel module, runs the code compiled before from the same text, kept per
module in ``cache_dir()/code/<interpreter>/<module>.marshal``, and compiles what it
does not find there. The text is the key and ``compile`` of a text always gives the
same code, so a class is exactly what ``exec`` of the text makes (its methods' file is
``<string>`` as before). Any other class, and keel's classes defined before
:mod:`keel.config` can name the folder (its own ``Settings`` among them), go to
``exec`` unchanged.

A module's file is read when its first class is defined, checked like every cache file
keel runs code from (:mod:`keel._files`: this user's, writable by no one else), and
ignored unless it was written by this interpreter (its magic number leads the file).
When a process compiled something new for a module, it writes that module's file again
at exit, atomically, with the methods its classes used in this process (an edited
module's old methods go with it); like Python's own bytecode cache, nothing is written
under ``-B`` / ``PYTHONDONTWRITEBYTECODE``. ``KEEL_CODE_CACHE=off`` turns it off.
"""

from __future__ import annotations

import atexit
import builtins
import dataclasses
import importlib
import marshal
import os
import sys
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from types import CodeType
from typing import Any

__all__ = ["install", "installed"]

_CONFIG = "keel.config"       # defines Settings, which names the folder: never cached
_SUFFIX = ".marshal"
_MAX_BYTES = 8 << 20          # a module's file larger than this is not read


class _Store:
    """What this process took from the files and compiled, by module, and where they are.

    A file's code is handed out once and dropped (the class's methods keep what they
    need); what was taken is remembered by the texts' hashes, for the write.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.resolved = False
        self.folder: Path | None = None                       # None: not kept
        self.stored: dict[str, dict[str, CodeType]] = {}      # module -> its file, not taken
        self.taken: dict[str, set[int]] = {}                  # module -> hash of texts taken
        self.compiled: dict[str, dict[str, CodeType]] = {}    # module -> code compiled here

    def code(self, module: str, text: str) -> CodeType | str:
        """The code for ``text`` of a class of ``module`` (``text`` itself: not kept)."""
        folder = self._folder()
        if folder is None:
            return text
        stored = self.stored.get(module)
        if stored is None:
            stored = self.stored[module] = _read(folder / f"{module}{_SUFFIX}")
        taken = self.taken.setdefault(module, set())
        code = stored.pop(text, None)
        if not isinstance(code, CodeType):
            code = compile(text, "<string>", "exec")
            if hash(text) not in taken:       # not a text this process took from the file
                if not self.compiled:
                    atexit.register(self.write)
                self.compiled.setdefault(module, {})[text] = code
        taken.add(hash(text))
        return code

    def _folder(self) -> Path | None:
        """The folder, once :mod:`keel.config` can say where (None until then, or when off)."""
        if self.resolved:
            return self.folder
        config = sys.modules.get(_CONFIG) or importlib.import_module(_CONFIG)
        settings = getattr(config, "settings", None)
        if settings is None:                  # keel.config is still being imported
            return None
        try:
            values = settings()
        except Exception:     # a bad setting is reported where it is used, not here
            return None
        self.resolved = True
        if values.code_cache:
            from keel._files import Untrusted, trusted_folder

            folder = values.cache_dir / "code" / (sys.implementation.cache_tag or "python")
            try:
                trusted_folder(folder)
                self.folder = folder
            except Untrusted:
                self.folder = None
        return self.folder

    def write(self) -> None:
        """Write each module that compiled new code: what its file held that this process
        took, and what it compiled (at exit; never raises)."""
        folder = self.folder
        if folder is None or not self.compiled or sys.dont_write_bytecode \
                or os.getpid() != self.pid:   # a forked child leaves it to its parent
            return
        from keel._files import Untrusted, private_folder, write_atomically

        try:
            private_folder(folder)
        except Untrusted:
            return
        for module, compiled in sorted(self.compiled.items()):
            path = folder / f"{module}{_SUFFIX}"
            taken = self.taken[module]
            kept = {text: code for text, code in _read(path).items() if hash(text) in taken}
            try:
                write_atomically(path, MAGIC_NUMBER + marshal.dumps({**kept, **compiled}))
            except (OSError, ValueError):
                continue
        self.compiled.clear()


def _read(path: Path) -> dict[str, CodeType]:
    """A module's file, when it is trusted and this interpreter's; else nothing."""
    from keel._files import Untrusted, open_trusted

    try:
        with os.fdopen(open_trusted(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read() if size <= _MAX_BYTES else b""
    except (Untrusted, OSError):
        return {}
    if not data.startswith(MAGIC_NUMBER):
        return {}
    try:
        found = marshal.loads(memoryview(data)[len(MAGIC_NUMBER):])
    except (ValueError, EOFError, TypeError):
        return {}
    return found if isinstance(found, dict) else {}


_STORE = _Store()


def _exec(source: Any, globals: dict[str, Any] | None = None,
          locals: dict[str, Any] | None = None) -> None:
    """``exec`` for ``dataclasses``: a keel class's methods from their compiled code."""
    module = globals.get("__name__") if isinstance(globals, dict) else None
    if isinstance(source, str) and isinstance(module, str) and module != _CONFIG \
            and (module == "keel" or module.startswith("keel.")):
        source = _STORE.code(module, source)
    builtins.exec(source, globals, locals)


def install() -> None:
    """Give ``dataclasses`` the caching ``exec`` (once per process)."""
    if not installed():
        dataclasses.exec = _exec   # type: ignore[attr-defined]


def installed() -> bool:
    """Whether ``dataclasses`` compiles through this module's ``exec``."""
    return getattr(dataclasses, "exec", None) is _exec
