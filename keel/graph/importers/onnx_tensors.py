"""ONNX ``TensorProto`` → NumPy, checked against hostile input.

Every size is checked before anything is allocated: negative or overflowing
dims, data shorter or longer than the dims say, external files outside the
model's directory. Each problem is a :class:`ModelFormatError` that names the
tensor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from keel.dtypes import DType, packed_size, unpack
from keel.errors import InvalidArgumentError, ModelFormatError
from keel.ops.types import MAX_ELEMENTS

__all__ = ["dims_of", "tensor_to_array"]

# TensorProto.DataType codes keel reads, with the typed field each one uses
# when the data is not in ``raw_data``.
_FIELD: dict[int, str] = {
    1: "float_data",      # FLOAT
    2: "int32_data",      # UINT8
    3: "int32_data",      # INT8
    4: "int32_data",      # UINT16
    5: "int32_data",      # INT16
    6: "int32_data",      # INT32
    7: "int64_data",      # INT64
    8: "string_data",     # STRING
    9: "int32_data",      # BOOL
    10: "int32_data",     # FLOAT16 (bit patterns)
    11: "double_data",    # DOUBLE
    12: "uint64_data",    # UINT32
    13: "uint64_data",    # UINT64
    # BFLOAT16 and the float8 types: one bit pattern per entry; the 4- and 2-bit
    # types: one packed byte per entry (as in raw_data).
    **{code: "int32_data" for code in range(16, 27)},
}
_ONNX_TYPE_NAMES = {
    0: "UNDEFINED", 14: "COMPLEX64", 15: "COMPLEX128", 27: "FLOAT6E2M3", 28: "FLOAT6E3M2",
}


def element_dtype(code: int, what: str) -> DType:
    """keel's dtype for ONNX element type ``code``; unsupported ones raise ModelFormatError."""
    try:
        return DType.from_onnx(int(code))
    except InvalidArgumentError:
        name = _ONNX_TYPE_NAMES.get(int(code), str(code))
        allowed = ", ".join(d.value for d in DType)
        raise ModelFormatError(
            f"{what} has element type {name}, which keel does not support; allowed: {allowed}"
        ) from None


def dims_of(dims: Any, what: str) -> tuple[int, ...]:
    """Checked static dims: none negative, element count within keel's limit."""
    out = tuple(int(d) for d in dims)
    total = 1
    for d in out:
        if d < 0:
            raise ModelFormatError(f"{what} has a negative dimension in {out}")
        total *= d
        if total > MAX_ELEMENTS:
            raise ModelFormatError(f"{what} declares {out}: more elements than keel accepts")
    return out


def tensor_to_array(t: Any, base_dir: Path | None, what: str = "") -> np.ndarray:
    """Decode a ``TensorProto``; external data is read relative to ``base_dir``."""
    label = what or f"tensor {t.name!r}"
    if t.HasField("segment"):
        raise ModelFormatError(f"{label} is segmented, which keel does not read")
    dtype = element_dtype(t.data_type, label)
    shape = dims_of(t.dims, label)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    raw = t.raw_data          # read once: each read of the field copies its bytes
    if t.data_location == 1:  # EXTERNAL
        data = _external(t, base_dir, label, dtype, numel)
    elif raw:
        data = _from_raw(raw, dtype, numel, label)
    else:
        data = _from_field(t, dtype, numel, label)
    return data.reshape(shape)


def _from_raw(raw: bytes, dtype: DType, numel: int, label: str) -> np.ndarray:
    if dtype is DType.STRING:
        raise ModelFormatError(f"{label}: string tensors cannot use raw_data")
    want = packed_size(dtype, numel)
    if len(raw) != want:
        raise ModelFormatError(
            f"{label} declares {numel} {dtype.value} elements ({want} bytes) "
            f"but holds {len(raw)} bytes"
        )
    if dtype is DType.BOOL:
        return np.frombuffer(raw, dtype=np.uint8) != 0
    if dtype.is_narrow:
        return unpack(raw, dtype, numel)
    # On a little-endian host the bytes are the array: a read-only view, no copy
    # (the graph's weights are frozen anyway, and loading skips a memcpy).
    data = np.frombuffer(raw, dtype=dtype.numpy.newbyteorder("<"))
    return data if data.dtype.isnative else data.astype(dtype.numpy)


def _from_field(t: Any, dtype: DType, numel: int, label: str) -> np.ndarray:
    values = getattr(t, _FIELD[dtype.onnx])
    want = packed_size(dtype, numel) if dtype.bits < 8 else numel
    if len(values) != want:
        raise ModelFormatError(
            f"{label} declares {numel} elements but holds {len(values)} in {_FIELD[dtype.onnx]}"
        )
    if dtype.is_narrow:         # bit patterns (packed bytes for the sub-byte types)
        bits = np.array(values, dtype=np.int64) & (0xFFFF if dtype.itemsize == 2 else 0xFF)
        return unpack(bits.astype(f"<u{dtype.itemsize}").view(np.uint8), dtype, numel)
    if dtype is DType.STRING:
        return np.array([bytes(v).decode("utf-8", "replace") for v in values], dtype=object)
    if dtype is DType.FLOAT16:
        bits = np.array(values, dtype=np.int64)
        return (bits & 0xFFFF).astype(np.uint16).view(np.float16)
    if dtype is DType.BOOL:
        return np.array(values, dtype=np.int64) != 0
    arr = np.array(values, dtype=np.float64 if dtype.is_float else None)
    if dtype.is_int and arr.size and (arr.min() < np.iinfo(dtype.numpy).min
                                      or arr.max() > np.iinfo(dtype.numpy).max):
        raise ModelFormatError(f"{label} holds values outside the range of {dtype.value}")
    return arr.astype(dtype.numpy)


def _external(t: Any, base_dir: Path | None, label: str, dtype: DType,
              numel: int) -> np.ndarray:
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location", "")
    if base_dir is None:
        raise ModelFormatError(
            f"{label} keeps its data in external file {location!r}, but the model was given "
            "as bytes without a base directory; load it from its path or pass base_dir"
        )
    path = _inside(base_dir, location, label)
    try:
        offset = int(info.get("offset", "0"))
        want = packed_size(dtype, numel)
        length = int(info.get("length", str(want)))
    except ValueError:
        raise ModelFormatError(f"{label}: external offset/length are not integers") from None
    size = path.stat().st_size
    if dtype is DType.STRING or offset < 0 or length != want or offset + length > size:
        raise ModelFormatError(
            f"{label}: external data {location!r} [offset {offset}, length {length}] does not "
            f"hold {numel} {dtype.value} elements ({want} bytes) within its {size} bytes"
        )
    if want == 0:
        return np.zeros(0, dtype=dtype.numpy)
    if dtype.bits < 8:          # packed on disk: read and unpack
        with path.open("rb") as f:
            f.seek(offset)
            return unpack(f.read(length), dtype, numel)
    # A read-only map: large weights are paged in on use, never copied up front.
    return np.memmap(path, dtype=dtype.numpy.newbyteorder("<"), mode="r",
                     offset=offset, shape=(numel,))


def _inside(base_dir: Path, location: str, label: str) -> Path:
    if not location or os.path.isabs(location) or "\x00" in location:
        raise ModelFormatError(f"{label}: external data location {location!r} is not a "
                               "relative path inside the model's directory")
    base = base_dir.resolve()
    path = (base / location).resolve()
    if base != path and base not in path.parents:
        raise ModelFormatError(
            f"{label}: external data location {location!r} points outside the model's "
            f"directory {str(base)!r}"
        )
    try:
        regular = path.is_file()
    except OSError as exc:              # a name too long for the file system, say
        raise ModelFormatError(f"{label}: external data file {location!r} cannot be read: "
                               f"{exc.strerror}") from None
    if not regular:
        raise ModelFormatError(f"{label}: external data file {location!r} is missing "
                               f"(looked in {str(base)!r})")
    return path
