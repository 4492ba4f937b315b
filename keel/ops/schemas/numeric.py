"""Schemas of the numeric family: ops with no family of their own.

* ``bitcast`` — ONNX BitCast-26: the same bytes read as dtype ``to``, which
  must have the input's item size (bool counts as one byte); strings are
  refused.
* ``det`` — ONNX Det-22: the determinant of each square matrix in the last two
  axes; shape ``(*, M, M)`` → ``(*)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, Shape, TensorType

__all__ = ["BITCAST_DTYPES", "FLOAT_DTYPES", "check_bitcast", "check_det"]

FLOAT_DTYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
# Whole-byte types only: a 4- or 2-bit element has no bytes of its own to reinterpret.
BITCAST_DTYPES = frozenset(d for d in DType if d is not DType.STRING and d.bits >= 8)


def check_bitcast(source: DType, target: DType) -> None:
    """Both dtypes hold numbers of one item size."""
    op = Op.BITCAST
    for d in (source, target):
        if d not in BITCAST_DTYPES:
            raise InvalidArgumentError(f"{op.value}: cannot reinterpret {d.value} data")
    if source.itemsize != target.itemsize:
        raise InvalidArgumentError(
            f"{op.value}: {source.value} ({8 * source.itemsize} bits) cannot be read as "
            f"{target.value} ({8 * target.itemsize} bits); the widths must match")


def check_det(shape: Sequence[Dim]) -> Shape:
    """(*, M, M) → (*)."""
    if len(shape) < 2 or (isinstance(shape[-1], int) and isinstance(shape[-2], int)
                          and shape[-1] != shape[-2]):
        raise InvalidArgumentError(
            f"{Op.DET.value}: X must be (*, M, M) (square matrices), got shape {tuple(shape)}")
    return tuple(shape[:-2])


def _infer_bitcast(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                   values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    if x is None:
        return [None]
    check_bitcast(x.dtype, attrs["to"])
    return [TensorType(attrs["to"], x.shape)]


def _infer_det(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
               values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    if x is None:
        return [None]
    if x.dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"{Op.DET.value}: X must be float16, bfloat16, float32 or float64, got {x.dtype.value}")
    return [TensorType(x.dtype, None if x.shape is None else check_det(x.shape))]


register_schema(OpSchema(
    Op.BITCAST, 1, 1, attrs=(AttrSpec("to", AttrKind.DTYPE, REQUIRED),), infer=_infer_bitcast,
    doc="ONNX BitCast: reinterpret the bytes of X as dtype `to` of the same width.",
))
register_schema(OpSchema(
    Op.DET, 1, 1, infer=_infer_det,
    doc="ONNX Det: determinants of the square matrices in X's last two axes.",
))
