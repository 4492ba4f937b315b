"""keel's element types and their conversions to NumPy and ONNX."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from keel.errors import InvalidArgumentError

__all__ = ["DType", "as_dtype"]


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

    @property
    def numpy(self) -> np.dtype[Any]:
        if self is DType.STRING:
            return np.dtype(object)
        return np.dtype(self.value)

    @property
    def itemsize(self) -> int:
        return 8 if self is DType.STRING else int(self.numpy.itemsize)

    @property
    def is_float(self) -> bool:
        return self in (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64)

    @property
    def is_int(self) -> bool:
        return self.value.startswith(("int", "uint"))

    @property
    def onnx(self) -> int:
        return _TO_ONNX[self]

    @classmethod
    def from_numpy(cls, dtype: Any) -> DType:
        dt = np.dtype(dtype)
        if dt.kind in ("O", "U", "S"):
            return cls.STRING
        try:
            return cls(dt.name)
        except ValueError:
            raise InvalidArgumentError(
                f"unsupported NumPy dtype {dt.name!r}; allowed: "
                f"{', '.join(d.value for d in cls)}"
            ) from None

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
}


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
}
