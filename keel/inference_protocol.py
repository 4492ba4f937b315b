"""The Open Inference Protocol's data model, free of any web framework.

Datatypes, the limits a server enforces, tensors decoded from and encoded to
JSON and the binary tensor data extension, and :class:`ProtocolError`, which
carries the HTTP status and gRPC code a bad request answers with. Nothing here
unpickles: tensors are numbers, booleans or length-prefixed byte strings.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError

__all__ = [
    "DATATYPES",
    "Limits",
    "ProtocolError",
    "array_to_bytes",
    "bytes_to_array",
    "datatype_of",
    "datatype_of_array",
    "decode_json_data",
    "element_count",
    "json_data",
    "not_found",
    "numpy_dtype",
    "parse_json",
]

# protocol datatype -> numpy dtype ("BYTES" holds byte strings in an object array)
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
_BY_DTYPE = {DType.BOOL: "BOOL", DType.UINT8: "UINT8", DType.UINT16: "UINT16",
             DType.UINT32: "UINT32", DType.UINT64: "UINT64", DType.INT8: "INT8",
             DType.INT16: "INT16", DType.INT32: "INT32", DType.INT64: "INT64",
             DType.FLOAT16: "FP16", DType.FLOAT32: "FP32", DType.FLOAT64: "FP64",
             DType.STRING: "BYTES"}


class ProtocolError(InvalidArgumentError):
    """A request the protocol refuses; ``status`` is its HTTP status, ``grpc_code`` the
    name of its ``grpc.StatusCode``."""

    code = "PROTOCOL"

    def __init__(self, message: str, status: int = 400,
                 grpc_code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.status = status
        self.grpc_code = grpc_code


def not_found(message: str) -> ProtocolError:
    return ProtocolError(message, 404, "NOT_FOUND")


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server."""

    max_body_bytes: int = 64 * 1024 * 1024
    max_tensor_elements: int = 16 * 1024 * 1024
    request_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tensor_elements"):
            if int(getattr(self, name)) < 1:
                raise InvalidArgumentError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise InvalidArgumentError(
                f"request_timeout_s must be positive, got {self.request_timeout_s}")


def datatype_of(dtype: DType) -> str:
    """The protocol's name for a keel dtype (``ProtocolError`` for one keel serves none
    for: bfloat16, the float8/float4 and the 4- and 2-bit types)."""
    name = _BY_DTYPE.get(dtype)
    if name is None:
        raise ProtocolError(f"the Open Inference Protocol has no datatype for {dtype.value}; "
                            f"it carries {', '.join(sorted(set(_BY_DTYPE.values())))}")
    return name


def numpy_dtype(datatype: Any, tensor: str) -> np.dtype:
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise ProtocolError(f"tensor {tensor!r}: unknown datatype {datatype!r}; the protocol's "
                            f"datatypes are {', '.join(DATATYPES)}")
    return DATATYPES[datatype]


def element_count(shape: Any, tensor: str, limits: Limits) -> int:
    """The number of elements ``shape`` holds, checked before any data is read."""
    if not isinstance(shape, Sequence) or isinstance(shape, str | bytes) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"tensor {tensor!r}: shape must be a list of non-negative "
                            f"integers, got {shape!r}")
    count = math.prod(shape)
    if count > limits.max_tensor_elements:
        raise ProtocolError(
            f"tensor {tensor!r}: shape {list(shape)} holds {count} elements, more than this "
            f"server's limit of {limits.max_tensor_elements}", 413, "RESOURCE_EXHAUSTED")
    return int(count)


def decode_json_data(name: str, datatype: Any, shape: Any, data: Any,
                     limits: Limits) -> np.ndarray:
    """A tensor from the protocol's JSON ``data`` (flat or nested, row-major)."""
    count = element_count(shape, name, limits)
    dtype = numpy_dtype(datatype, name)
    flat = _flatten(data, name, count)
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise ProtocolError(f"tensor {name!r}: BYTES data must be strings")
        arr = np.array([v.encode() for v in flat], dtype=object)
    else:
        arr = _numbers(flat, dtype, datatype, name)
    return arr.reshape(tuple(shape))


def _flatten(data: Any, name: str, count: int) -> list[Any]:
    if not isinstance(data, list):
        raise ProtocolError(f"tensor {name!r}: data must be a JSON list, got "
                            f"{type(data).__name__}")
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
            if len(flat) > count:
                break
        else:
            stack.pop()
            continue
        if len(flat) > count:
            break
    if len(flat) != count:
        raise ProtocolError(f"tensor {name!r}: data holds "
                            f"{'more than ' if len(flat) > count else ''}{len(flat)} "
                            f"elements, its shape needs {count}")
    return flat


def _numbers(flat: list[Any], dtype: np.dtype, datatype: str, name: str) -> np.ndarray:
    if datatype == "BOOL":
        ok = all(isinstance(v, bool) for v in flat)
    elif dtype.kind in "iu":
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in flat)
    else:
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat)
    if not ok:
        kind = {"b": "booleans", "i": "integers", "u": "integers"}.get(dtype.kind, "numbers")
        raise ProtocolError(f"tensor {name!r}: {datatype} data must be {kind}")
    try:
        return np.array(flat, dtype=dtype)
    except (OverflowError, ValueError) as exc:
        raise ProtocolError(f"tensor {name!r}: data does not fit {datatype}: {exc}") from None


def bytes_to_array(name: str, datatype: Any, shape: Any, raw: bytes,
                   limits: Limits) -> np.ndarray:
    """A tensor from the binary tensor data extension's bytes (little-endian, row-major;
    BYTES elements each a 4-byte little-endian length, then the bytes)."""
    count = element_count(shape, name, limits)
    dtype = numpy_dtype(datatype, name)
    if datatype == "BYTES":
        return _unpack_bytes(name, raw, count).reshape(tuple(shape))
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(f"tensor {name!r}: {len(raw)} bytes of data, shape {list(shape)} "
                            f"of {datatype} needs {count * dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(tuple(shape))


def _unpack_bytes(name: str, raw: bytes, count: int) -> np.ndarray:
    items: list[bytes] = []
    pos = 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise ProtocolError(f"tensor {name!r}: BYTES data ends inside a length prefix")
        (size,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + size > len(raw):
            raise ProtocolError(f"tensor {name!r}: a BYTES element runs past the data")
        items.append(raw[pos:pos + size])
        pos += size
    if len(items) != count:
        raise ProtocolError(f"tensor {name!r}: {len(items)} BYTES elements, its shape "
                            f"needs {count}")
    out = np.empty(count, dtype=object)
    out[:] = items
    return out


def array_to_bytes(array: np.ndarray) -> bytes:
    """The binary tensor data extension's bytes of ``array``."""
    if array.dtype == object or array.dtype.kind in "SU":
        parts = []
        for item in array.reshape(-1):
            b = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(b)) + b)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def datatype_of_array(array: np.ndarray) -> str:
    if array.dtype == object or array.dtype.kind in "SU":
        return "BYTES"
    for name, dtype in DATATYPES.items():
        if dtype == array.dtype:
            return name
    raise ProtocolError(f"an output of dtype {array.dtype} has no protocol datatype", 500,
                        "INTERNAL")


def json_data(array: np.ndarray) -> list[Any]:
    """``array`` flattened for the protocol's JSON ``data``."""
    if array.dtype == object or array.dtype.kind in "SU":
        return [v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                for v in array.reshape(-1)]
    flat: list[Any] = array.reshape(-1).tolist()
    if array.dtype.kind == "f":      # JSON has no NaN or infinity: the protocol sends strings
        flat = [v if math.isfinite(v) else str(v) for v in flat]
    return flat


def parse_json(body: bytes) -> Mapping[str, Any]:
    """The JSON object of a request body."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed JSON in the request body: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"the request body must be a JSON object, got "
                            f"{type(value).__name__}")
    return value
