"""Schemas of the memory family: ``copy``, ``fill``, ``cast``, ``identity``.

``copy`` and ``fill`` follow seed 001: ``copy`` needs an output of exactly the
input's shape; ``fill`` writes the first element of input 0 (the rest is
padding) into every element of its output. Its output shape comes from the
output buffer a caller gives or from the attribute ``shape``; its dtype from
that buffer, the attribute ``dtype`` or input 0. ``cast`` is ONNX Cast
(float → int truncates toward zero, anything → bool is ``x != 0``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.schemas.elementwise import ALL, DTYPES
from keel.ops.types import TensorType, checked_numel

__all__ = ["check_cast"]


def _same(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
          values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    return [types[0]]


def _fill_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    dtype = attrs.get("dtype") or (types[0].dtype if types[0] is not None else None)
    if dtype is None:
        return [None]
    shape = attrs.get("shape")
    if shape is None:
        return [TensorType(dtype, None)]
    checked_numel(shape, what="fill shape")
    return [TensorType(dtype, tuple(shape))]


def check_cast(src: DType, dst: DType) -> None:
    """Strings are the one ONNX Cast case keel leaves out."""
    if DType.STRING in (src, dst):
        raise UnsupportedOperationError(
            "cast", detail=f"{src.value} -> {dst.value}: string tensors are not supported"
        )


def _cast_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    if x is None:
        return [TensorType(attrs["to"], None)]
    check_cast(x.dtype, attrs["to"])
    return [TensorType(attrs["to"], x.shape)]


for _op in (Op.COPY, Op.FILL, Op.CAST, Op.IDENTITY):
    DTYPES[_op] = ALL

register_schema(OpSchema(
    Op.COPY, 1, 1, infer=_same,
    doc="Copy input 0 into an output of exactly its shape and dtype (seed 001).",
))
register_schema(OpSchema(
    Op.IDENTITY, 1, 1, infer=_same, inplace=((0, 0),), doc="The input, unchanged (ONNX).",
))
register_schema(OpSchema(
    Op.FILL, 1, 1,
    (AttrSpec("shape", AttrKind.INTS, None), AttrSpec("dtype", AttrKind.DTYPE, None)),
    infer=_fill_infer,
    doc="Every output element = input 0's first element (seed 001). Output shape: the "
        "output buffer given, else attribute 'shape'; dtype: the buffer, else attribute "
        "'dtype', else input 0's.",
))
register_schema(OpSchema(
    Op.CAST, 1, 1,
    (AttrSpec("to", AttrKind.DTYPE, REQUIRED), AttrSpec("saturate", AttrKind.BOOL, True),
     AttrSpec("round_mode", AttrKind.STR, "up")),
    infer=_cast_infer,
    doc="ONNX Cast to dtype 'to'. 'saturate' and 'round_mode' only matter for float8 "
        "types, which keel does not have; they are accepted and ignored.",
))
