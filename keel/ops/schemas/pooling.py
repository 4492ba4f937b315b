"""Schemas of the pooling family: max, average, Lp and global pools (ONNX semantics).

X is (N, C, *spatial). The window geometry (``kernel_shape``, ``strides``,
``dilations``, ``pads``, ``auto_pad``, ``ceil_mode``) is the conv family's, see
:mod:`keel.ops.schemas.conv`.

* ``max_pool`` — padded positions never win. The optional second output
  ``Indices`` (int64) holds, for each output, the flat index of the winning
  element in X: ``((n * C + c) * H + h) * W + w`` for ``storage_order=0``
  (row major), ``((n * C + c) * W + w) * H + h`` for ``storage_order=1``
  (column major within each spatial plane). Ties go to the first element of
  the window in row-major order.
* ``avg_pool`` — the mean over the window; padded positions count in the
  divisor only with ``count_include_pad``. Positions past the explicit pads
  (the extra end of a ``ceil_mode`` window) never count.
* ``lp_pool`` — ``(sum |x|^p)^(1/p)`` over the window (padding adds nothing).
* ``global_avg_pool`` / ``global_max_pool`` — over all spatial dims; the output
  keeps them with size 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.schemas.conv import Window, window, window_shape
from keel.ops.types import Dim, Shape, TensorType

__all__ = ["DTYPES", "check_pool_input", "pool_window"]

FLOATS = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})

DTYPES: dict[Op, frozenset[DType]] = {
    Op.MAX_POOL: FLOATS | {DType.INT8, DType.UINT8},
    Op.AVG_POOL: FLOATS,
    Op.LP_POOL: FLOATS,
    Op.GLOBAL_AVG_POOL: FLOATS,
    Op.GLOBAL_MAX_POOL: FLOATS,
}

_POOL_ATTRS = (
    AttrSpec("auto_pad", AttrKind.STR, "NOTSET"),
    AttrSpec("ceil_mode", AttrKind.BOOL, False),
    AttrSpec("dilations", AttrKind.INTS, ()),
    AttrSpec("kernel_shape", AttrKind.INTS, REQUIRED),
    AttrSpec("pads", AttrKind.INTS, ()),
    AttrSpec("strides", AttrKind.INTS, ()),
)


def check_pool_input(op: Op, x: Sequence[Dim], dtype: DType) -> None:
    """X is (N, C, *spatial) of a dtype the op takes."""
    if dtype not in DTYPES[op]:
        names = ", ".join(sorted(d.value for d in DTYPES[op]))
        raise InvalidArgumentError(f"{op.value} does not take {dtype.value} inputs; allowed: "
                                   f"{names}")
    if len(x) < 3:
        raise InvalidArgumentError(
            f"{op.value}: X must be (N, C, *spatial) with rank >= 3, got shape {tuple(x)}"
        )


def _kernel(op: Op, x: Sequence[Dim], attrs: Mapping[str, Any]) -> tuple[int, ...]:
    kernel = tuple(attrs["kernel_shape"])
    if len(kernel) != len(x) - 2 or any(k < 1 for k in kernel):
        raise InvalidArgumentError(
            f"{op.value}: kernel_shape needs {len(x) - 2} values >= 1 for X of shape "
            f"{tuple(x)}, got {kernel}"
        )
    return kernel


def pool_window(op: Op, x: Sequence[int], attrs: Mapping[str, Any]) -> Window:
    """Resolve the window of a pool over X (N, C, *spatial)."""
    kernel = _kernel(op, x, attrs)
    return window(op, x[2:], kernel, attrs, ceil_mode=bool(attrs.get("ceil_mode", False)))


def _pool_infer(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [None, None] if op is Op.MAX_POOL else [None]
        if x.shape is None:
            check_pool_input(op, (None,) * 3, x.dtype)
            shape: Shape | None = None
        else:
            check_pool_input(op, x.shape, x.dtype)
            kernel = _kernel(op, x.shape, attrs)
            spatial = window_shape(op, x.shape[2:], kernel, attrs,
                                   ceil_mode=bool(attrs.get("ceil_mode", False)))
            shape = (x.shape[0], x.shape[1], *spatial)
        if op is Op.MAX_POOL:
            if attrs["storage_order"] not in (0, 1):
                raise InvalidArgumentError(
                    f"max_pool: storage_order must be 0 or 1, got {attrs['storage_order']}"
                )
            return [TensorType(x.dtype, shape), TensorType(DType.INT64, shape)]
        return [TensorType(x.dtype, shape)]
    return infer


def _global_infer(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [None]
        if x.shape is None:
            return [TensorType(x.dtype, None)]
        check_pool_input(op, x.shape, x.dtype)
        return [TensorType(x.dtype, (x.shape[0], x.shape[1], *([1] * (len(x.shape) - 2))))]
    return infer


register_schema(OpSchema(
    Op.MAX_POOL, 1, 1, (*_POOL_ATTRS, AttrSpec("storage_order", AttrKind.INT, 0)),
    infer=_pool_infer(Op.MAX_POOL), min_outputs=1, max_outputs=2,
    doc="ONNX MaxPool; optional second output Indices (int64).",
))
register_schema(OpSchema(
    Op.AVG_POOL, 1, 1, (*_POOL_ATTRS, AttrSpec("count_include_pad", AttrKind.BOOL, False)),
    infer=_pool_infer(Op.AVG_POOL), doc="ONNX AveragePool.",
))
register_schema(OpSchema(
    Op.LP_POOL, 1, 1, (*_POOL_ATTRS, AttrSpec("p", AttrKind.INT, 2)),
    infer=_pool_infer(Op.LP_POOL), doc="ONNX LpPool: (sum |x|^p)^(1/p) over each window.",
))
register_schema(OpSchema(
    Op.GLOBAL_AVG_POOL, 1, 1, infer=_global_infer(Op.GLOBAL_AVG_POOL),
    doc="Mean over all spatial dims, kept with size 1.",
))
register_schema(OpSchema(
    Op.GLOBAL_MAX_POOL, 1, 1, infer=_global_infer(Op.GLOBAL_MAX_POOL),
    doc="Max over all spatial dims, kept with size 1.",
))
