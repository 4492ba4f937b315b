"""Schemas of the reduction family.

``sum_all`` and ``mean_all`` (seed 001) reduce a whole tensor to a scalar of
shape ``()``. ``sum``, ``mean`` and the ``reduce_*`` ops follow ONNX
ReduceSum/ReduceMean/…: the axes come from the optional input 1 (ONNX ≥13/18)
or, for ``run_op`` callers, from the attribute ``axes`` (or its alias
``axis``); no axes means every axis, unless ``noop_with_empty_axes`` is set:
then nothing is reduced (``sum`` is the identity; ``reduce_sum_square`` still
squares and ``reduce_l1`` still takes |x|, as ONNX's reference does).

``keepdims`` defaults to **True**, as in ONNX, because the graph importer maps
ReduceSum/ReduceMean onto ``sum``/``mean``; callers wanting NumPy's default
(the Tensor API, ``run_op`` users) pass ``keepdims=False``.

Reductions over an empty set give ONNX's values: 0 for sums and norms, 1 for
products, -inf (or the dtype's minimum; ``False`` for bool) for max, +inf (or
the maximum; ``True``) for min, -inf for the log-sums and NaN for a float
mean (0 for an integer mean).

:func:`reduction_axes` and :func:`cumulative_axis` are shared with the
kernels, so a bad axis raises the same :class:`InvalidArgumentError`
everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.schemas.elementwise import ALL, DTYPES, FLOATS, NUMERIC, check_dtype
from keel.ops.types import Shape, TensorType, normalize_axis

__all__ = ["arg_axis", "cumulative_axis", "empty_value", "reduced_shape", "reduction_axes"]

# ONNX's ReduceSum/ReduceProd/CumSum type constraint.
_ONNX_REDUCE = FLOATS | {DType.INT32, DType.INT64, DType.UINT32, DType.UINT64}


def _axes_given(op: Op, attrs: Mapping[str, Any],
                axes_input: Any | None) -> tuple[int, ...] | None:
    """The axes a caller gave (input 1, ``axes`` or ``axis``), or None."""
    sources = [name for name in ("axes", "axis") if attrs.get(name) is not None]
    if axes_input is not None:
        sources.append("input 1")
    if len(sources) > 1:
        raise InvalidArgumentError(
            f"{op.value} takes its axes from one place; got {' and '.join(sources)}"
        )
    if axes_input is not None:
        arr = np.asarray(axes_input)
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"{op.value} axes (input 1) must be integers, got {arr.dtype.name}"
            )
        return tuple(int(a) for a in arr.reshape(-1))
    for name in ("axes", "axis"):
        if attrs.get(name) is not None:
            return tuple(attrs[name])
    return None


def reduction_axes(op: Op, rank: int, attrs: Mapping[str, Any],
                   axes_input: Any | None = None) -> tuple[int, ...]:
    """The sorted, non-negative axes to reduce; ``()`` means none (an identity).

    ``axes_input`` is the host value of input 1 when present.
    """
    given = _axes_given(op, attrs, axes_input)
    if not given:
        return () if attrs.get("noop_with_empty_axes") else tuple(range(rank))
    axes = [normalize_axis(a, rank, what=f"{op.value} axis") for a in given]
    if len(set(axes)) != len(axes):
        raise InvalidArgumentError(f"{op.value} axes {given} name an axis twice")
    # A rank-0 tensor has nothing to reduce; axis 0 (accepted above) is a no-op.
    return tuple(sorted(axes)) if rank > 0 else ()


def reduced_shape(shape: Sequence[Any], axes: Sequence[int], keepdims: bool) -> Shape:
    """``shape`` with ``axes`` reduced (kept as 1 when ``keepdims``)."""
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def cumulative_axis(op: Op, rank: int, attrs: Mapping[str, Any],
                    axis_input: Any | None = None) -> int:
    """The axis of ``cumsum``/``cumprod``: input 1 (ONNX) or attribute ``axis``."""
    if axis_input is not None and attrs.get("axis") is not None:
        raise InvalidArgumentError(
            f"{op.value} takes its axis from one place; got input 1 and attribute 'axis'"
        )
    if axis_input is None and attrs.get("axis") is None:
        raise InvalidArgumentError(
            f"{op.value} needs an axis: pass it as input 1 or as attribute 'axis'"
        )
    if axis_input is not None:
        arr = np.asarray(axis_input)
        if arr.size != 1 or arr.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"{op.value} axis (input 1) must be one integer, got {arr.dtype.name} "
                f"of shape {arr.shape}"
            )
        axis = int(arr.reshape(-1)[0])
    else:
        axis = int(attrs["axis"])
    return normalize_axis(axis, rank, what=f"{op.value} axis")


def empty_value(op: Op, dtype: Any) -> Any:
    """What ``reduce_max``/``reduce_min``/``reduce_log_sum_exp`` give over no elements.

    The ops with an identity (sums, products, norms) get it from NumPy; these
    three have none, so ONNX fixes the value: -inf (or the dtype's minimum,
    ``False``) for max, +inf (or the maximum, ``True``) for min, -inf for the
    log-sum-exp.
    """
    dt = np.dtype(dtype)
    if op is Op.REDUCE_LOG_SUM_EXP:
        return -math.inf
    if dt.kind == "b":
        return op is Op.REDUCE_MIN
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return int(info.min if op is Op.REDUCE_MAX else info.max)
    return -math.inf if op is Op.REDUCE_MAX else math.inf


# ---- schemas ----------------------------------------------------------------
def _whole_infer(op: Op, allowed: frozenset[DType]) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [None]
        check_dtype(op, x.dtype, allowed)
        return [TensorType(x.dtype, ())]
    return infer


def _axes_infer(op: Op, allowed: frozenset[DType]) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [None]
        check_dtype(op, x.dtype, allowed)
        if x.shape is None:
            return [TensorType(x.dtype, None)]
        rank = len(x.shape)
        axes_type = types[1] if len(types) > 1 else None
        axes_value = values[1] if len(values) > 1 else None
        if axes_type is not None and axes_value is None:
            _axes_given(op, attrs, np.zeros(0, np.int64))   # conflicts only
            # Axes known only at run time: the rank survives only with keepdims.
            return [TensorType(x.dtype, (None,) * rank if attrs["keepdims"] else None)]
        axes = reduction_axes(op, rank, attrs, axes_value)
        return [TensorType(x.dtype, reduced_shape(x.shape, axes, attrs["keepdims"]))]
    return infer


_AXES_ATTRS = (
    AttrSpec("axes", AttrKind.INTS, None),
    AttrSpec("axis", AttrKind.INTS, None),
    AttrSpec("keepdims", AttrKind.BOOL, True),
    AttrSpec("noop_with_empty_axes", AttrKind.BOOL, False),
)


def _whole(op: Op, doc: str) -> None:
    DTYPES[op] = NUMERIC
    register_schema(OpSchema(op, 1, 1, infer=_whole_infer(op, NUMERIC), doc=doc))


def _along(op: Op, allowed: frozenset[DType], doc: str) -> None:
    DTYPES[op] = allowed
    register_schema(OpSchema(op, 1, 2, _AXES_ATTRS, infer=_axes_infer(op, allowed),
                             value_inputs=(1,), doc=doc))


_whole(Op.SUM_ALL, "Sum of every element, shape () (seed 001).")
_whole(Op.MEAN_ALL, "Mean of every element, shape () (seed 001); NaN when empty.")
_along(Op.SUM, NUMERIC, "Sum along axes (seed 001; ONNX ReduceSum).")
_along(Op.MEAN, NUMERIC, "Mean along axes (seed 001; ONNX ReduceMean); an integer "
       "mean truncates toward zero.")
_along(Op.REDUCE_MAX, ALL, "Max along axes (ONNX ReduceMax).")
_along(Op.REDUCE_MIN, ALL, "Min along axes (ONNX ReduceMin).")
_along(Op.REDUCE_PROD, _ONNX_REDUCE, "Product along axes.")
_along(Op.REDUCE_L1, _ONNX_REDUCE, "Sum of |X| along axes.")
_along(Op.REDUCE_L2, _ONNX_REDUCE, "sqrt(sum(X**2)) along axes.")
_along(Op.REDUCE_LOG_SUM, FLOATS, "log(sum(X)) along axes.")
_along(Op.REDUCE_LOG_SUM_EXP, FLOATS, "log(sum(exp(X))) along axes, computed stably.")
_along(Op.REDUCE_SUM_SQUARE, _ONNX_REDUCE, "sum(X**2) along axes.")


def _arg_infer(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [TensorType(DType.INT64, None)]
        check_dtype(op, x.dtype, NUMERIC)
        if x.shape is None:
            return [TensorType(DType.INT64, None)]
        axis = arg_axis(op, x.shape, attrs)
        return [TensorType(DType.INT64, reduced_shape(x.shape, (axis,), attrs["keepdims"]))]
    return infer


def arg_axis(op: Op, shape: Sequence[Any], attrs: Mapping[str, Any]) -> int:
    """The normalized axis of ``argmax``/``argmin``; an empty axis is an error."""
    if len(shape) == 0:
        raise InvalidArgumentError(f"{op.value} needs an input of rank >= 1, got a scalar")
    axis = normalize_axis(attrs["axis"], len(shape), what=f"{op.value} axis")
    if shape[axis] == 0:
        raise InvalidArgumentError(
            f"{op.value} over axis {attrs['axis']} of shape {tuple(shape)}: the axis is empty"
        )
    return axis


for _op, _doc in ((Op.ARGMAX, "Index of the max along axis (first, or last with "
                   "select_last_index), int64."),
                  (Op.ARGMIN, "Index of the min along axis, int64.")):
    DTYPES[_op] = NUMERIC
    register_schema(OpSchema(
        _op, 1, 1,
        (AttrSpec("axis", AttrKind.INT, 0), AttrSpec("keepdims", AttrKind.BOOL, True),
         AttrSpec("select_last_index", AttrKind.BOOL, False)),
        infer=_arg_infer(_op), doc=_doc,
    ))


def _cumulative_infer(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [None]
        check_dtype(op, x.dtype, _ONNX_REDUCE)
        axis_known = len(values) > 1 and values[1] is not None
        if x.shape is not None and (axis_known or attrs.get("axis") is not None):
            cumulative_axis(op, len(x.shape), attrs, values[1] if axis_known else None)
        return [TensorType(x.dtype, x.shape)]
    return infer


for _op, _doc in ((Op.CUMSUM, "Running sum along an axis (ONNX CumSum)."),
                  (Op.CUMPROD, "Running product along an axis (ONNX CumProd).")):
    DTYPES[_op] = _ONNX_REDUCE
    register_schema(OpSchema(
        _op, 1, 2,
        (AttrSpec("axis", AttrKind.INT, None), AttrSpec("exclusive", AttrKind.BOOL, False),
         AttrSpec("reverse", AttrKind.BOOL, False)),
        infer=_cumulative_infer(_op), value_inputs=(1,), doc=_doc,
    ))
