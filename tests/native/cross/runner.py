"""Scripts for ``harness.c``: kernel calls written on the host, run on another
architecture under qemu-user, their results read back (the format is in harness.c)."""

from __future__ import annotations

import struct
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from keel.native.cross import CrossTarget

__all__ = ["Buffer", "Results", "Script", "Symbol"]

HARNESS = Path(__file__).resolve().parent / "harness.c"
_RUN_TIMEOUT_S = 120


@dataclass(frozen=True)
class Buffer:
    """A buffer of the script (``at``: a byte offset into it, for an address argument)."""

    id: int
    nbytes: int
    at: int = 0

    def offset(self, nbytes: int) -> Buffer:
        return Buffer(self.id, self.nbytes, self.at + nbytes)


@dataclass(frozen=True)
class Symbol:
    """The address of an exported function of a loaded library (a callback argument)."""

    library: int
    name: str


Arg = int | Buffer | Symbol | None


class Script:
    """Records to run in order; :meth:`run` runs them and returns what was asked for."""

    def __init__(self) -> None:
        self._out = bytearray(b"KQS1")
        self._buffers = 0
        self._libraries = 0
        self._reads: list[tuple[str, object]] = []   # ("call", name) / ("dump", (dtype, shape))

    def library(self, path: Path) -> int:
        self._out += b"L" + _text(str(path))
        self._libraries += 1
        return self._libraries - 1

    def array(self, a: np.ndarray) -> Buffer:
        """A buffer holding a copy of ``a``'s bytes (C order)."""
        data = np.ascontiguousarray(a).tobytes()
        return self._buffer(len(data), data)

    def zeros(self, nbytes: int) -> Buffer:
        return self._buffer(nbytes, None)

    def block(self, fmt: str, values: Sequence[int | float | Buffer | None]) -> Buffer:
        """A packed argument block (``struct`` format ``fmt``, little-endian); each
        :class:`Buffer` value becomes that buffer's address in the target's memory."""
        plain = [0 if isinstance(v, Buffer) or v is None else v for v in values]
        buf = self.array(np.frombuffer(struct.pack("<" + fmt, *plain), np.uint8))
        codes = struct.Struct("<" + fmt)
        for i, v in enumerate(values):
            if isinstance(v, Buffer):
                field = _field_offset(fmt, i)
                assert field + 8 <= codes.size
                self._out += b"P" + struct.pack("<IQIQ", buf.id, field, v.id, v.at)
        return buf

    def call(self, library: int, name: str, *ints: Arg, floats: Sequence[float] = ()) -> int:
        """Call ``name``; returns the index of its result in :meth:`run`'s answer."""
        rec = bytearray(b"C" + struct.pack("<I", library) + _text(name))
        rec += struct.pack("<B", len(ints))
        for a in ints:
            if isinstance(a, Buffer):
                rec += struct.pack("<BqI", 1, a.at, a.id)
            elif isinstance(a, Symbol):
                rec += struct.pack("<BqI", 2, 0, a.library) + _text(a.name)
            else:
                rec += struct.pack("<BqI", 0, 0 if a is None else int(a), 0)
        rec += struct.pack(f"<B{len(floats)}f", len(floats), *floats)
        self._out += rec
        self._reads.append(("call", name))
        return len(self._reads) - 1

    def dump(self, buf: Buffer, dtype: type | np.dtype, shape: Sequence[int]) -> int:
        """Read the buffer back as an array; returns its index in :meth:`run`'s answer."""
        self._out += b"D" + struct.pack("<I", buf.id)
        self._reads.append(("dump", (np.dtype(dtype), tuple(shape))))
        return len(self._reads) - 1

    def run(self, target: CrossTarget, harness: Path) -> Results:
        """Run the script with ``harness`` (built for ``target``) under its emulator."""
        with tempfile.TemporaryDirectory(prefix="keel-cross-") as tmp:
            script, answer = Path(tmp, "script"), Path(tmp, "answer")
            script.write_bytes(bytes(self._out))
            done = subprocess.run(target.command(harness, str(script), str(answer)),
                                  capture_output=True, text=True, timeout=_RUN_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"the {target.name} harness failed ({done.returncode}): "
                                   f"{done.stderr.strip()[-600:]}")
            return Results(self._parse(answer.read_bytes()))

    def _buffer(self, nbytes: int, data: bytes | None) -> Buffer:
        buf = Buffer(self._buffers, nbytes)
        self._buffers += 1
        self._out += b"B" + struct.pack("<IQB", buf.id, nbytes, data is not None)
        if data is not None:
            self._out += data
        return buf

    def _parse(self, data: bytes) -> list[int | np.ndarray]:
        if data[:4] != b"KQR1":
            raise RuntimeError("the harness wrote no answer")
        pos, values = 4, []
        for kind, info in self._reads:
            tag = data[pos:pos + 1]
            if kind == "call":
                assert tag == b"C", f"answer out of step at {info}"
                values.append(struct.unpack_from("<q", data, pos + 1)[0])
                pos += 9
            else:
                assert tag == b"D", "answer out of step at a dump"
                (n,) = struct.unpack_from("<Q", data, pos + 1)
                dtype, shape = info  # type: ignore[misc]
                raw = np.frombuffer(data[pos + 9:pos + 9 + n], np.uint8)
                values.append(raw.view(dtype).reshape(shape).copy())
                pos += 9 + n
        return values


class Results:
    """The calls' results and the dumped arrays, by the index :class:`Script` gave."""

    def __init__(self, values: list[int | np.ndarray]) -> None:
        self._values = values

    def value(self, index: int) -> int:
        v = self._values[index]
        assert isinstance(v, int)
        return v

    def array(self, index: int) -> np.ndarray:
        v = self._values[index]
        assert isinstance(v, np.ndarray)
        return v


def _text(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<I", len(raw)) + raw


def _field_offset(fmt: str, index: int) -> int:
    """The byte offset of field ``index`` of a little-endian struct of one-letter codes."""
    return struct.calcsize("<" + _expand(fmt)[:index])


def _expand(fmt: str) -> str:
    """``23q3d`` as ``qqq...ddd``: one letter per field."""
    out, count = "", ""
    for ch in fmt:
        if ch.isdigit():
            count += ch
        else:
            out += ch * int(count or 1)
            count = ""
    return out
