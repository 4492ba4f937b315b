"""Which files keel trusts, and which it reads: one place for the checks.

Trust: a folder keel caches in (native libraries it loads into the process,
compiled plans it runs) and every file in it must belong to the current user
and be writable by no one else. A folder or file that fails is
:class:`Untrusted`, with the reason; the caller then uses another folder or
rebuilds the entry. Files are checked on the open descriptor (``fstat``), so
what was checked is what is read.

Reading: a model path must name a regular file (not ``/dev/zero``, a FIFO, a
socket or a folder) no larger than the reader's cap. The file is opened
without blocking (a FIFO never hangs) and checked on the open descriptor.
Anything else is a :class:`~keel.errors.ModelFormatError`; a path holding a
NUL byte is an :class:`~keel.errors.InvalidArgumentError`.

Without POSIX owners and modes (Windows) ownership is not checked.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from keel.errors import InvalidArgumentError, ModelFormatError

__all__ = ["Untrusted", "check_path", "open_regular", "open_trusted", "owner_problem",
           "private_folder", "read_regular", "safe_file_name", "trusted_folder",
           "user_temp_folder", "write_atomically"]

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


class Untrusted(Exception):
    """A folder or file keel must not use; the message says why."""


# ---- trust -------------------------------------------------------------------------------
def owner_problem(info: os.stat_result, what: str, root_ok: bool = False) -> str | None:
    """Why a file or folder with ``info`` cannot be trusted; None when it can. ``root_ok``:
    root's files are trusted too (an installed package's)."""
    uid = getattr(os, "getuid", None)
    if uid is None:
        return None
    if info.st_uid != uid() and not (root_ok and info.st_uid == 0):
        return f"{what} belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def trusted_folder(folder: Path) -> Path | None:
    """``folder`` checked (not followed if a link); None when it does not exist."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Untrusted(f"cannot read {folder}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise Untrusted(f"{folder} is not a folder")
    problem = owner_problem(info, str(folder))
    if problem is not None:
        raise Untrusted(problem)
    return folder


def private_folder(folder: Path) -> Path:
    """``folder``, created private to this user (0700) when missing, checked."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise Untrusted(f"cannot create {folder}: {exc.strerror}") from None
    found = trusted_folder(folder)
    if found is None:
        raise Untrusted(f"{folder} vanished while it was being made")
    return found


def user_temp_folder(purpose: str) -> Path:
    """A folder of this user's own under the temporary directory (``keel-<purpose>-<uid>``),
    made 0700 and checked; where a cache goes when the configured one is not trusted."""
    uid = getattr(os, "getuid", lambda: "user")()
    return private_folder(Path(tempfile.gettempdir()) / f"keel-{purpose}-{uid}")


def open_trusted(path: Path, root_ok: bool = False) -> int:
    """A read-only descriptor of ``path`` (not followed if a link), after checking the open
    file: a regular file of this user's (or root's, with ``root_ok``), writable by no one
    else. The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise Untrusted(f"cannot open it ({exc.strerror})") from None
    info = os.fstat(fd)
    problem = ("it is not a regular file" if not stat.S_ISREG(info.st_mode)
               else owner_problem(info, "the file", root_ok))
    if problem is not None:
        os.close(fd)
        raise Untrusted(problem)
    return fd


def write_atomically(target: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``target`` so that a reader never sees half a file:
    beside it first, then renamed over it. The temporary file is made with the usual
    permissions (umask applies), not 0600."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---- names --------------------------------------------------------------------------------
_NAME_MAX = 120


def safe_file_name(text: str, fallback: str) -> str:
    """``text`` (a graph, node or output name: model content) as one file name that stays in
    the folder it is joined to: letters, digits, ``-``, ``_`` and inner dots kept, anything
    else (``/``, ``\\``, NUL...) an underscore, no leading dot (never ``..``), at most
    120 characters; ``fallback`` when nothing is left."""
    kept = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in text)
    kept = kept.lstrip(".")[:_NAME_MAX]
    return kept or fallback


# ---- reading model files ------------------------------------------------------------------
def check_path(path: str | os.PathLike[str], what: str = "model path") -> str:
    """``path`` as a string; an :class:`InvalidArgumentError` when it holds a NUL byte."""
    text = os.fspath(path)
    if isinstance(text, bytes) or "\x00" in text:
        raise InvalidArgumentError(f"{what} {text!r} contains a NUL byte (or is not text)")
    return text


def open_regular(path: str | os.PathLike[str], limit: int | None,
                 what: str = "model file", why: str = "") -> tuple[int, int]:
    """A read-only descriptor of the regular file ``path`` and its size (at most ``limit``
    bytes when given); :class:`ModelFormatError` for anything else. The caller closes it."""
    text = check_path(path)
    try:
        fd = os.open(text, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        _refuse_special(text, what)                  # a socket cannot be opened at all
        raise ModelFormatError(f"cannot read {what} {text!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        _refuse_special(text, what, info)
        if limit is not None and info.st_size > limit:
            raise ModelFormatError(f"{what} {text!r} is {info.st_size} bytes; keel reads at "
                                   f"most {limit} here{f' ({why})' if why else ''}")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def _refuse_special(text: str, what: str, info: os.stat_result | None = None) -> None:
    """A :class:`ModelFormatError` naming what ``text`` is, unless it is a regular file (or,
    without ``info``, cannot be looked at)."""
    if info is None:
        try:
            info = os.stat(text)
        except OSError:
            return
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        raise ModelFormatError(f"{what} {text!r} is {kind}; keel reads only regular files")


def read_regular(path: str | os.PathLike[str], limit: int, what: str = "model file",
                 why: str = "") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (see
    :func:`open_regular`; ``why`` says why the cap is what it is); a file that grows past
    the cap while it is read is refused too."""
    fd, _ = open_regular(path, limit, what, why)
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise ModelFormatError(f"cannot read {what} {os.fspath(path)!r}: "
                                   f"{exc.strerror}") from None
    if len(data) > limit:
        raise ModelFormatError(f"{what} {os.fspath(path)!r} is over {limit} bytes; keel reads "
                               "at most that here")
    return data
