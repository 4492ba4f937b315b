"""Schemas of the loss family: ONNX NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both take scores ``(N, C, d1, ..., dk)``, integer targets ``(N, d1, ..., dk)``
holding class indices in ``[0, C)`` and an optional per-class ``weight``
``(C,)``. A target equal to ``ignore_index`` contributes nothing (weight 0).
``reduction`` is ``none`` (the per-element loss, shaped like the target),
``sum``, or ``mean`` (the sum divided by the sum of the weights of the
elements that count: their number when no weight is given).

``softmax_cross_entropy_loss`` is ``negative_log_likelihood_loss`` of
``log_softmax(scores, axis=1)``, and gives that log-probability tensor as its
optional second output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, TensorType

__all__ = [
    "FLOAT_DTYPES",
    "REDUCTIONS",
    "TARGET_DTYPES",
    "check_loss",
    "check_reduction",
    "check_targets",
]

FLOAT_DTYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
TARGET_DTYPES = frozenset({DType.INT32, DType.INT64})
REDUCTIONS = ("none", "sum", "mean")


def check_reduction(op: Op, reduction: str) -> str:
    """``reduction`` is one of none, sum, mean."""
    if reduction not in REDUCTIONS:
        raise InvalidArgumentError(
            f"{op.value}: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    return reduction


def _dims_agree(a: Dim, b: Dim) -> bool:
    return not (isinstance(a, int) and isinstance(b, int) and a != b)


def check_loss(op: Op, x: Sequence[Dim], target: Sequence[Dim],
               weight: Sequence[Dim] | None) -> None:
    """Scores ``(N, C, d...)``, target ``(N, d...)``, weight ``(C,)`` (unknown dims pass)."""
    if len(x) < 2:
        raise InvalidArgumentError(
            f"{op.value}: input must have rank >= 2 (N, C, d1, ...), got shape {tuple(x)}")
    want = (x[0], *x[2:])
    if len(target) != len(want) or not all(map(_dims_agree, target, want)):
        raise InvalidArgumentError(
            f"{op.value}: target must have shape (N, d1, ...) = {want} for input of shape "
            f"{tuple(x)}, got {tuple(target)}")
    if weight is not None and (len(weight) != 1 or not _dims_agree(weight[0], x[1])):
        raise InvalidArgumentError(
            f"{op.value}: weight must have shape ({x[1]},) (one per class), got {tuple(weight)}")


def check_targets(op: Op, target: Any, classes: int, ignore_index: int | None) -> None:
    """Every target that is not ``ignore_index`` is a class index in ``[0, classes)``.

    Reads the values; works on NumPy and CuPy arrays alike.
    """
    counted = target if ignore_index is None else target[target != ignore_index]
    bad = counted[(counted < 0) | (counted >= classes)]
    if bad.size:
        ignored = "" if ignore_index is None else f" (ignore_index is {ignore_index})"
        raise InvalidArgumentError(
            f"{op.value}: target value {int(bad.reshape(-1)[0])} is not a class index in "
            f"[0, {classes}){ignored}")


def _check_types(op: Op, types: Sequence[TensorType | None]) -> None:
    x, t = types[0], types[1]
    w = types[2] if len(types) > 2 else None
    if x is not None and x.dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"{op.value}: input must be float16, bfloat16, float32 or float64, got {x.dtype.value}")
    if t is not None and t.dtype not in TARGET_DTYPES:
        raise InvalidArgumentError(
            f"{op.value}: target must be int32 or int64, got {t.dtype.value}")
    if w is not None and x is not None and w.dtype is not x.dtype:
        raise InvalidArgumentError(
            f"{op.value}: weight must have the input's dtype {x.dtype.value}, got "
            f"{w.dtype.value}")
    if x is not None and t is not None and x.shape is not None and t.shape is not None:
        check_loss(op, x.shape, t.shape, None if w is None or w.shape is None else w.shape)


def _infer(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        check_reduction(op, attrs["reduction"])
        _check_types(op, types)
        x, t = types[0], types[1]
        if x is None:
            return [None, None]
        if attrs["reduction"] != "none":
            loss: TensorType | None = TensorType(x.dtype, ())
        elif t is not None:
            loss = TensorType(x.dtype, t.shape)
        else:
            loss = TensorType(x.dtype, None)
        return [loss, x]
    return infer


_ATTRS = (AttrSpec("reduction", AttrKind.STR, "mean"),
          AttrSpec("ignore_index", AttrKind.INT, None))

register_schema(OpSchema(
    Op.NEGATIVE_LOG_LIKELIHOOD_LOSS, 2, 3, attrs=_ATTRS,
    infer=_infer(Op.NEGATIVE_LOG_LIKELIHOOD_LOSS),
    doc="ONNX NegativeLogLikelihoodLoss: loss[n, d] = -input[n, target[n, d], d] * "
        "weight[target[n, d]], reduced by `reduction` (none, sum, mean); targets equal to "
        "ignore_index count for nothing.",
))
register_schema(OpSchema(
    Op.SOFTMAX_CROSS_ENTROPY_LOSS, 2, 3, attrs=_ATTRS, max_outputs=2,
    infer=_infer(Op.SOFTMAX_CROSS_ENTROPY_LOSS),
    doc="ONNX SoftmaxCrossEntropyLoss: negative_log_likelihood_loss of "
        "log_softmax(scores, axis=1); the optional second output is that log_softmax.",
))
