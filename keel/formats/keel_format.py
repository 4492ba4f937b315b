"""The ``.keel`` file: one graph and its weights in one memory-mappable file.

Layout (all integers little-endian)::

    offset  size  field
    0       8     magic  b"KEELMDL\\0"
    8       4     format version (uint32)
    12      4     CRC-32 of the header JSON (uint32)
    16      8     header length in bytes (uint64)
    24      n     header: UTF-8 JSON (keel version, graph, tensor table)
    ...           zero padding to a multiple of 64
    data          weight blobs, each starting at a multiple of 64

The header's ``tensors`` table gives, per initializer: dtype, shape, offset
and stored byte count, encoding (``raw``, ``zlib`` or ``strings``), the
storage dtype (``float16`` when saved with ``fp16=True``) and a CRC-32. Raw
blobs load with :func:`numpy.memmap` without a copy (read-only arrays); the
others are decoded on load. Every size and offset is checked before use: a
truncated, corrupt or hostile file is a :class:`ModelFormatError`.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from keel._files import open_regular
from keel.dtypes import DType, pack, packed_size, unpack
from keel.errors import KeelError, ModelFormatError
from keel.graph.ir import NO_ATTRS, Graph, Node, Value
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import MAX_ELEMENTS, TensorType, ValueKind

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "KeelFileInfo",
    "is_keel_file",
    "load_keel",
    "read_header",
    "save_keel",
]

_T = TypeVar("_T")

MAGIC = b"KEELMDL\x00"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sIIQ")
MAX_HEADER_BYTES = 256 << 20
# fp16 storage keeps a tensor in full precision when a value would overflow float16.
_FP16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class KeelFileInfo:
    """What :func:`save_keel` wrote."""

    path: str
    file_bytes: int
    tensor_bytes: int          # the initializers' in-memory size
    stored_bytes: int          # their size in the file (after fp16/compression)
    tensors: int


# ---- saving ------------------------------------------------------------------------------
def save_keel(graph: Graph, path: str | os.PathLike[str], compress: bool = False,
              fp16: bool = False) -> KeelFileInfo:
    """Write ``graph`` to ``path`` atomically (a temporary file renamed into place).

    ``compress`` stores each weight zlib-compressed when that saves space
    (loading then decodes instead of mapping); ``fp16`` stores float32/float64
    weights as float16 (lossy; they load back in their original dtype).
    """
    blobs: list[bytes] = []
    table: dict[str, dict[str, Any]] = {}
    for name, arr in graph.initializers.items():
        entry, blob = _encode_tensor(np.asarray(arr), compress, fp16)
        table[name] = entry
        blobs.append(blob)
    header = {"format": "keel", "format_version": FORMAT_VERSION,
              "keel_version": _keel_version(), "graph": _graph_to_json(graph),
              "tensors": table}
    head, data_offset = _layout(header, blobs)
    target = Path(path)
    _atomic_write(target, _chunks(head, data_offset, list(table.values()), blobs))
    return KeelFileInfo(str(target), target.stat().st_size,
                        sum(int(np.asarray(a).nbytes) for a in graph.initializers.values()),
                        sum(len(b) for b in blobs), len(blobs))


def _layout(header: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, int]:
    """Place the blobs (offsets relative to the data section) and size the header."""
    offset = 0
    for entry, blob in zip(header["tensors"].values(), blobs, strict=True):
        entry["offset"] = offset
        offset = _align(offset + len(blob))
    data_offset = 0
    # The header holds data_offset, which depends on the header's length: settle it.
    for _ in range(8):
        header["data_offset"] = data_offset
        text = json.dumps(header, separators=(",", ":")).encode()
        needed = _align(_PREFIX.size + len(text))
        if needed == data_offset:
            prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, zlib.crc32(text), len(text))
            return prefix + text, data_offset
        data_offset = needed
    raise AssertionError("header layout did not settle")  # the length grows by digits only


def _chunks(head: bytes, data_offset: int, entries: list[dict[str, Any]],
            blobs: list[bytes]) -> Iterator[bytes]:
    yield head
    pos = len(head)
    for entry, blob in zip(entries, blobs, strict=True):
        start = data_offset + entry["offset"]
        yield b"\x00" * (start - pos)
        yield blob
        pos = start + len(blob)
    if pos < data_offset:         # no weights at all: the (empty) data section still starts there
        yield b"\x00" * (data_offset - pos)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _atomic_write(target: Path, chunks: Iterator[bytes]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _encode_tensor(arr: np.ndarray, compress: bool, fp16: bool) -> tuple[dict[str, Any], bytes]:
    dtype = DType.from_numpy(arr.dtype)
    entry: dict[str, Any] = {"dtype": dtype.value, "shape": [int(d) for d in arr.shape],
                             "storage": dtype.value, "encoding": "raw"}
    if dtype is DType.STRING:
        blob = json.dumps([str(x) for x in arr.reshape(-1)]).encode()
        entry["encoding"] = "strings"
    else:
        stored = arr
        if fp16 and dtype in (DType.FLOAT32, DType.FLOAT64) and _fits_fp16(arr):
            stored = arr.astype(np.float16)
            entry["storage"] = DType.FLOAT16.value
        blob = pack(stored)     # little-endian; 4- and 2-bit types packed as in ONNX
        if compress and blob:
            packed = zlib.compress(blob, 6)
            if len(packed) < 0.95 * len(blob):
                blob, entry["encoding"] = packed, "zlib"
    entry["nbytes"] = len(blob)
    entry["crc32"] = zlib.crc32(blob)
    return entry, blob


def _fits_fp16(arr: np.ndarray) -> bool:
    if arr.size == 0:
        return True
    finite = arr[np.isfinite(arr)]
    return finite.size == 0 or float(np.max(np.abs(finite))) <= _FP16_MAX


# ---- loading -----------------------------------------------------------------------------
def is_keel_file(src: str | os.PathLike[str] | bytes) -> bool:
    """True when ``src`` (a path or bytes) starts with the ``.keel`` magic."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src[: len(MAGIC)]) == MAGIC
    try:
        fd, _ = open_regular(src, None)
    except ModelFormatError:
        return False
    with os.fdopen(fd, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def read_header(src: str | os.PathLike[str] | bytes) -> dict[str, Any]:
    """The checked header of a ``.keel`` file (no weights are read)."""
    buf = _open(src)
    return _header(buf, len(buf))


def load_keel(src: str | os.PathLike[str] | bytes, verify: bool = True) -> Graph:
    """Load a ``.keel`` file (path or bytes) into a Graph.

    Raw weights are read-only views of a memory map of the file (no copy);
    ``verify`` checks each blob's CRC-32 (reading every page once).
    """
    try:
        buf = _open(src)
        header = _header(buf, len(buf))
        graph = _graph_from_json(header["graph"])
        graph.initializers = {name: _decode_tensor(buf, name, entry, header["data_offset"],
                                                   verify)
                              for name, entry in _table(header).items()}
        graph.verify()
        return graph
    except ModelFormatError:
        raise
    except KeelError as exc:
        raise ModelFormatError(f"invalid .keel graph: {exc.message}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            UnicodeError, RecursionError, MemoryError, zlib.error) as exc:
        raise ModelFormatError(f"invalid .keel file: {type(exc).__name__}: {exc}") from None


def _open(src: str | os.PathLike[str] | bytes) -> Any:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(src), dtype=np.uint8)
    fd, size = open_regular(src, None, ".keel file")      # a regular file, never a device
    with os.fdopen(fd, "rb") as f:
        if size < _PREFIX.size:
            raise ModelFormatError(f"{os.fspath(src)!r} has {size} bytes: too short for a "
                                   ".keel file")
        try:
            return np.memmap(f, dtype=np.uint8, mode="r", shape=(size,))
        except OSError as exc:
            raise ModelFormatError(f"cannot read {os.fspath(src)!r}: {exc.strerror}") from None


def _header(buf: Any, size: int) -> dict[str, Any]:
    if size < _PREFIX.size:
        raise ModelFormatError(f"{size} bytes: too short for a .keel file")
    magic, version, crc, length = _PREFIX.unpack(bytes(buf[: _PREFIX.size]))
    if magic != MAGIC:
        raise ModelFormatError("not a .keel file (bad magic)")
    if version != FORMAT_VERSION:
        raise ModelFormatError(f".keel format version {version}; this keel reads version "
                               f"{FORMAT_VERSION}")
    if length > min(size - _PREFIX.size, MAX_HEADER_BYTES):
        raise ModelFormatError(f"header claims {length} bytes; the file has "
                               f"{size - _PREFIX.size} after the prefix (truncated?)")
    text = bytes(buf[_PREFIX.size:_PREFIX.size + length])
    if zlib.crc32(text) != crc:
        raise ModelFormatError("header checksum mismatch (corrupt file)")
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"header is not valid JSON: {exc}") from None
    _require(isinstance(header, dict) and header.get("format") == "keel", "header is not keel's")
    data_offset = header.get("data_offset")
    _require(isinstance(data_offset, int) and _PREFIX.size + length <= data_offset <= size,
             "data offset lies outside the file")
    _require(isinstance(header.get("graph"), dict), "header has no graph")
    header["_file_size"] = size
    return header


def _table(header: dict[str, Any]) -> dict[str, Any]:
    return _field(header, "tensors", dict, "header")


def _decode_tensor(buf: Any, name: str, entry: Any, data_offset: int,
                   verify: bool) -> np.ndarray:
    what = f"tensor {name!r}"
    _require(isinstance(entry, dict), f"{what}: entry is not an object")
    dtype, storage = _dtype(entry.get("dtype"), what), _dtype(entry.get("storage"), what)
    shape = _shape(entry.get("shape"), what)
    offset, nbytes = entry.get("offset"), entry.get("nbytes")
    _require(isinstance(offset, int) and isinstance(nbytes, int) and offset >= 0 and
             nbytes >= 0 and offset % ALIGN == 0, f"{what}: bad offset or size")
    start = data_offset + offset
    _require(start + nbytes <= buf.shape[0], f"{what}: data runs past the end of the file "
             "(truncated?)")
    blob = buf[start:start + nbytes]
    if verify:
        _require(zlib.crc32(blob) == entry.get("crc32"), f"{what}: checksum mismatch")
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    encoding = entry.get("encoding")
    if encoding == "strings":
        values = json.loads(bytes(blob).decode("utf-8"))
        _require(isinstance(values, list) and len(values) == numel, f"{what}: bad strings")
        return np.array([str(v) for v in values], dtype=object).reshape(shape)
    want = packed_size(storage, numel)
    if encoding == "zlib":
        arr = unpack(_inflate(bytes(blob), want, what), storage, numel)
    else:
        _require(encoding == "raw" and nbytes == want, f"{what}: {nbytes} bytes stored, "
                 f"{want} expected for {shape} {storage.value}")
        arr = unpack(blob, storage, numel)
    if arr.dtype != dtype.numpy:
        arr = arr.astype(dtype.numpy)
    return arr.reshape(shape)


def _inflate(data: bytes, want: int, what: str) -> bytes:
    d = zlib.decompressobj()
    # max_length bounds the output: a hostile blob cannot inflate past the declared size.
    out = d.decompress(data, want + 1)
    _require(len(out) == want and d.eof and not d.unconsumed_tail,
             f"{what}: compressed data does not inflate to {want} bytes")
    return out


def _dtype(value: Any, what: str) -> DType:
    try:
        return DType(value)
    except ValueError:
        raise ModelFormatError(f"{what}: unknown dtype {value!r}") from None


def _shape(value: Any, what: str) -> tuple[int, ...]:
    _require(isinstance(value, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                             and d >= 0 for d in value), f"{what}: bad shape")
    total = 1
    for d in value:
        total *= d
        _require(total <= MAX_ELEMENTS, f"{what}: shape {value} is too large")
    return tuple(value)


def _field(d: Any, key: str, kind: type[_T], what: str) -> _T:
    """``d[key]`` when ``d`` is an object holding a ``kind`` there; else ModelFormatError."""
    value = d.get(key) if isinstance(d, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ModelFormatError(f"{what}: field {key!r} is missing or not a {kind.__name__}")
    return value


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ModelFormatError(message)


# ---- the graph as JSON ---------------------------------------------------------------------
def _graph_to_json(g: Graph) -> dict[str, Any]:
    """The graph as JSON; a subgraph (a control-flow node's attribute) nests as one."""
    return {
        "name": g.name, "opset": g.opset, "metadata": dict(g.metadata),
        "inputs": [_value_json(v.name, v.type) for v in g.inputs],
        "outputs": [_value_json(v.name, v.type) for v in g.outputs],
        "value_types": {k: _type_json(t) for k, t in g.value_types.items()},
        "nodes": [{"name": n.name, "op": n.op.value, "inputs": n.inputs, "outputs": n.outputs,
                   "attrs": {k: _attr_json(v) for k, v in n.attrs.items()},
                   "origin": n.origin} for n in g.nodes],
    }


def _value_json(name: str, t: TensorType) -> dict[str, Any]:
    return {"name": name, **_type_json(t)}


def _type_json(t: TensorType) -> dict[str, Any]:
    kind = {} if t.is_tensor else {"kind": t.kind.value}
    return {"dtype": t.dtype.value, "shape": None if t.shape is None else list(t.shape),
            **kind}


def _attr_json(value: Any) -> Any:
    if isinstance(value, DType):
        return {"$dtype": value.value}
    if isinstance(value, Graph):
        # A subgraph's own constants (few and small) travel inline with it.
        return {"$graph": {**_graph_to_json(value),
                           "initializers": {k: _attr_json(np.asarray(a))
                                            for k, a in value.initializers.items()}}}
    if isinstance(value, TensorType):
        return {"$type": _type_json(value)}
    if isinstance(value, np.ndarray):
        dtype = DType.from_numpy(value.dtype)
        data = [str(x) for x in value.reshape(-1)] if dtype is DType.STRING else \
            base64.b64encode(np.ascontiguousarray(value).tobytes()).decode()
        return {"$array": {"dtype": dtype.value, "shape": list(value.shape), "data": data}}
    if isinstance(value, (tuple, list)):
        return [_attr_json(v) for v in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return value


def _attr_from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "$dtype" in value:
            return _dtype(value["$dtype"], "attribute")
        if "$graph" in value:
            body = _field(value, "$graph", dict, "attribute")
            graph = _graph_from_json(body)
            inits = _field(body, "initializers", dict, "subgraph")
            graph.initializers = {str(k): _attr_from_json(v) for k, v in inits.items()}
            return graph
        if "$type" in value:
            return _type_from_json(value["$type"], "attribute")
        spec = _field(value, "$array", dict, "attribute")
        dtype, shape = _dtype(spec.get("dtype"), "attribute"), _shape(spec.get("shape"),
                                                                      "attribute")
        if dtype is DType.STRING:
            strings = [str(x) for x in _field(spec, "data", list, "attribute")]
            return np.array(strings, dtype=np.object_).reshape(shape)
        raw = base64.b64decode(_field(spec, "data", str, "attribute"), validate=True)
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        _require(len(raw) == numel * dtype.itemsize, "attribute array has the wrong size")
        return np.frombuffer(raw, dtype=dtype.numpy).reshape(shape).copy()
    if isinstance(value, list):
        return tuple(_attr_from_json(v) for v in value)
    return value


def _type_from_json(d: Any, what: str) -> TensorType:
    _require(isinstance(d, dict), f"{what}: type is not an object")
    shape: Any = d.get("shape")
    _require(shape is None or (isinstance(shape, list) and all(
        d is None or isinstance(d, str) or (isinstance(d, int) and d >= 0) for d in shape)),
        f"{what}: bad shape")
    kind = d.get("kind", ValueKind.TENSOR.value)
    _require(kind in {k.value for k in ValueKind}, f"{what}: bad kind {kind!r}")
    return TensorType(_dtype(d.get("dtype"), what), None if shape is None else tuple(shape),
                      ValueKind(kind))


def _graph_from_json(d: dict[str, Any]) -> Graph:
    values: dict[str, list[Value]] = {"inputs": [], "outputs": []}
    for key in values:
        for v in _field(d, key, list, "graph"):
            _require(isinstance(v, dict) and isinstance(v.get("name"), str), f"bad {key} entry")
            values[key].append(Value(v["name"], _type_from_json(v, f"{key[:-1]} {v['name']!r}")))
    types = _field(d, "value_types", dict, "graph")
    nodes = _field(d, "nodes", list, "graph")
    meta = _field(d, "metadata", dict, "graph")
    return Graph(str(d.get("name", "model")), [_node_from_json(n) for n in nodes],
                 values["inputs"], values["outputs"], {},
                 {str(k): _type_from_json(t, f"value {k!r}") for k, t in types.items()},
                 int(d.get("opset", 0)), {str(k): str(v) for k, v in meta.items()})


def _node_from_json(d: Any) -> Node:
    _require(isinstance(d, dict), "node entry is not an object")
    name, op_name = d.get("name"), d.get("op")
    try:
        op = Op(op_name)
    except ValueError:
        raise ModelFormatError(f"node {name!r}: unknown op {op_name!r}") from None
    ins, outs, attrs = d.get("inputs"), d.get("outputs"), d.get("attrs", {})
    _require(isinstance(name, str) and isinstance(ins, list) and isinstance(outs, list) and
             all(isinstance(x, str) for x in ins + outs) and isinstance(attrs, dict),
             f"node {name!r} is malformed")
    decoded = {str(k): _attr_from_json(v) for k, v in attrs.items()}
    try:
        norm = get_schema(op).normalize_attrs(decoded)
    except KeelError as exc:
        raise ModelFormatError(f"node {name!r} ({op.value}): {exc.message}") from None
    return Node(name, op, list(ins), list(outs), norm or NO_ATTRS, str(d.get("origin", "")))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _keel_version() -> str:
    from keel import __version__

    return str(__version__)
