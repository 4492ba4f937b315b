"""keel's element types and their conversions to NumPy and ONNX.

The narrow types (bfloat16, the float8 and float4 formats, 4- and 2-bit integers)
are NumPy dtypes from ``ml_dtypes``, imported on first use. In memory every element
takes a whole byte (two for bfloat16); the 4- and 2-bit integers and float4 are
packed only in files (ONNX ``raw_data``, the ``.keel`` weights).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from keel.errors import InvalidArgumentError

__all__ = ["NARROW", "NARROW_FLOATS", "NARROW_INTS", "DType", "as_dtype", "pack", "packed_size",
           "unpack"]


class DType(str, enum.Enum):
    """An element type. The value is the canonical lower-case spelling."""

    BOOL = "bool"
    INT8 = "int8"
    INT16 = "int16"
    INT32 = "int32"
    INT64 = "int64"
    UINT8 = "uint8"
    UINT16 = "uint16"
    UINT32 = "uint32"
    UINT64 = "uint64"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    STRING = "string"
    # narrow types, stored as ml_dtypes' NumPy dtypes of the same names
    BFLOAT16 = "bfloat16"
    FLOAT8E4M3FN = "float8_e4m3fn"
    FLOAT8E4M3FNUZ = "float8_e4m3fnuz"
    FLOAT8E5M2 = "float8_e5m2"
    FLOAT8E5M2FNUZ = "float8_e5m2fnuz"
    FLOAT8E8M0 = "float8_e8m0fnu"
    FLOAT4E2M1 = "float4_e2m1fn"
    INT4 = "int4"
    UINT4 = "uint4"
    INT2 = "int2"
    UINT2 = "uint2"

    @property
    def numpy(self) -> np.dtype[Any]:
        if self is DType.STRING:
            return np.dtype(object)
        if self in NARROW:
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, self.value))
        return np.dtype(self.value)

    @property
    def itemsize(self) -> int:
        if self is DType.STRING:
            return 8
        # ml_dtypes' sizes, known without importing it (a load that meets no narrow
        # value never does; tests/test_narrow_dtypes.py checks the table)
        narrow = _NARROW_ITEMSIZE.get(self)
        return int(self.numpy.itemsize) if narrow is None else narrow

    @property
    def is_float(self) -> bool:
        """float16, float32 or float64: the float types NumPy computes in natively."""
        return self in (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64)

    @property
    def is_int(self) -> bool:
        """An integer type NumPy computes in natively (not int4, uint4, int2, uint2)."""
        return self.value.startswith(("int", "uint")) and self not in NARROW

    @property
    def is_narrow(self) -> bool:
        """A type from ``ml_dtypes``: bfloat16, float8, float4, 4- and 2-bit integers."""
        return self in NARROW

    @property
    def bits(self) -> int:
        """Bits per element in a packed file: 4 or 2 for the sub-byte types, else 8 x size."""
        return _SUB_BYTE.get(self, 8 * self.itemsize)

    @property
    def onnx(self) -> int:
        return _TO_ONNX[self]

    @classmethod
    def from_numpy(cls, dtype: Any) -> DType:
        try:
            return _FROM_NUMPY[dtype]       # a kernel's per-call lookup: one dict probe
        except (KeyError, TypeError):
            pass
        dt = np.dtype(dtype)
        if dt.kind in ("O", "U", "S"):
            return cls.STRING
        try:
            found = cls(dt.name)
        except ValueError:
            raise InvalidArgumentError(
                f"unsupported NumPy dtype {dt.name!r}; allowed: "
                f"{', '.join(d.value for d in cls)}"
            ) from None
        if isinstance(dtype, np.dtype):
            _FROM_NUMPY[dtype] = found
        return found

    @classmethod
    def from_onnx(cls, elem_type: int) -> DType:
        for dt, code in _TO_ONNX.items():
            if code == elem_type:
                return dt
        raise InvalidArgumentError(
            f"unsupported ONNX element type {elem_type}; allowed: "
            f"{', '.join(f'{d.value}={c}' for d, c in _TO_ONNX.items())}"
        )


# ONNX TensorProto.DataType codes (stable across onnx releases).
_TO_ONNX: dict[DType, int] = {
    DType.FLOAT32: 1,
    DType.UINT8: 2,
    DType.INT8: 3,
    DType.UINT16: 4,
    DType.INT16: 5,
    DType.INT32: 6,
    DType.INT64: 7,
    DType.STRING: 8,
    DType.BOOL: 9,
    DType.FLOAT16: 10,
    DType.FLOAT64: 11,
    DType.UINT32: 12,
    DType.UINT64: 13,
    DType.BFLOAT16: 16,
    DType.FLOAT8E4M3FN: 17,
    DType.FLOAT8E4M3FNUZ: 18,
    DType.FLOAT8E5M2: 19,
    DType.FLOAT8E5M2FNUZ: 20,
    DType.UINT4: 21,
    DType.INT4: 22,
    DType.FLOAT4E2M1: 23,
    DType.FLOAT8E8M0: 24,
    DType.UINT2: 25,
    DType.INT2: 26,
}

# bfloat16 and the float8/float4 formats: keel computes in float32 and rounds back.
NARROW_FLOATS = frozenset({
    DType.BFLOAT16, DType.FLOAT8E4M3FN, DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2,
    DType.FLOAT8E5M2FNUZ, DType.FLOAT8E8M0, DType.FLOAT4E2M1,
})
NARROW_INTS = frozenset({DType.INT4, DType.UINT4, DType.INT2, DType.UINT2})
NARROW = NARROW_FLOATS | NARROW_INTS
# DType.from_numpy's answers for the NumPy dtypes it has seen (a handful per process)
_FROM_NUMPY: dict[np.dtype, DType] = {}

_SUB_BYTE = {DType.INT4: 4, DType.UINT4: 4, DType.FLOAT4E2M1: 4, DType.INT2: 2, DType.UINT2: 2}
# bfloat16 takes two bytes; every other narrow type one per element in memory
_NARROW_ITEMSIZE = {d: 2 if d is DType.BFLOAT16 else 1 for d in NARROW}


def as_dtype(value: Any) -> DType:
    """Turn a DType, a string ("float32", "f32"), a NumPy dtype or type into a DType."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        text = _ALIASES.get(text, text)
        try:
            return DType(text)
        except ValueError:
            pass
    try:
        return DType.from_numpy(value)
    except (TypeError, InvalidArgumentError):
        raise InvalidArgumentError(
            f"unknown dtype {value!r}; allowed: {', '.join(d.value for d in DType)}"
        ) from None


_ALIASES = {
    "f16": "float16", "half": "float16", "fp16": "float16",
    "f32": "float32", "float": "float32", "fp32": "float32",
    "f64": "float64", "double": "float64", "fp64": "float64",
    "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "str": "string",
    "bf16": "bfloat16", "float8e4m3fn": "float8_e4m3fn", "float8e4m3fnuz": "float8_e4m3fnuz",
    "float8e5m2": "float8_e5m2", "float8e5m2fnuz": "float8_e5m2fnuz",
    "float8e8m0": "float8_e8m0fnu", "float4e2m1": "float4_e2m1fn",
    "i4": "int4", "u4": "uint4",
}


def packed_size(dtype: DType, numel: int) -> int:
    """Bytes ``numel`` elements of ``dtype`` take packed (ONNX raw data, ``.keel`` weights)."""
    return -(-numel * dtype.bits // 8)


def pack(array: np.ndarray) -> bytes:
    """Little-endian bytes of ``array``; 4- and 2-bit types two or four to a byte, the
    first element in the low bits (ONNX's layout), the last byte zero-padded."""
    dtype = DType.from_numpy(array.dtype)
    if dtype not in _SUB_BYTE:
        return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    per = 8 // dtype.bits
    codes = np.ascontiguousarray(array).reshape(-1).view(np.uint8) & ((1 << dtype.bits) - 1)
    codes = np.concatenate([codes, np.zeros(-codes.size % per, np.uint8)]).reshape(-1, per)
    shifts = np.arange(per, dtype=np.uint8) * np.uint8(dtype.bits)
    return np.bitwise_or.reduce(codes << shifts, axis=1).astype(np.uint8).tobytes()


def unpack(data: bytes | np.ndarray, dtype: DType, numel: int) -> np.ndarray:
    """The inverse of :func:`pack`: a flat array of ``numel`` elements of ``dtype``.
    The caller checks ``len(data) == packed_size(dtype, numel)``."""
    raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    if dtype not in _SUB_BYTE:
        wide = raw.view(dtype.numpy.newbyteorder("<"))
        return wide if wide.dtype.isnative else wide.astype(dtype.numpy)
    bits = dtype.bits
    shifts = np.arange(8 // bits, dtype=np.uint8) * np.uint8(bits)
    codes = ((raw[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:numel]
    if dtype in (DType.INT4, DType.INT2):      # sign-extend the code into the byte
        half = 1 << (bits - 1)
        return ((codes.astype(np.int8) ^ half) - half).astype(np.int8).astype(dtype.numpy)
    return codes.astype(np.uint8).view(dtype.numpy)
