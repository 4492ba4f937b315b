"""Schemas of the normalization family: batch, layer, instance, group and RMS
normalization, LRN, Lp and mean-variance normalization, and the softmax family.

Every op here follows ONNX semantics at the latest opset (BatchNormalization-15
in inference mode, LayerNormalization-17, GroupNormalization-21,
RMSNormalization-23, Softmax/LogSoftmax/Hardmax-13, ...), except keel's fused
``skip_layer_norm``: LayerNormalization of a residual sum ``X + skip``, which
passes write (onnxruntime's SkipLayerNormalization without its bias input). The shape rules live
in small ``check_*`` functions that both ``infer`` and the kernels call, so a
bad shape is the same :class:`InvalidArgumentError` wherever it is found.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, TensorType, normalize_axis

__all__ = [
    "FLOAT_DTYPES",
    "check_batch_norm",
    "check_float",
    "check_group_norm",
    "check_instance_norm",
    "check_lrn",
    "check_lp_normalization",
    "check_mvn_axes",
    "check_skip",
    "check_trailing_norm",
    "compute_dtype",
]

FLOAT_DTYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})

# ONNX TensorProto codes accepted for ``stash_type`` (the precision of the statistics).
_STASH_TYPES = {1: DType.FLOAT32, 11: DType.FLOAT64}


def check_float(op: Op, dtype: DType, what: str = "X") -> None:
    """Normalization math is defined on floating-point tensors only."""
    if dtype not in FLOAT_DTYPES:
        allowed = ", ".join(sorted(d.value for d in FLOAT_DTYPES))
        raise InvalidArgumentError(f"{op.value}: {what} must be {allowed}, got {dtype.value}")


def compute_dtype(op: Op, x_dtype: DType, stash_type: int = 1) -> DType:
    """The dtype statistics are kept in: float32, or float64 for float64 inputs or stash 11.

    float16 inputs are computed in float32, as ONNX's ``stash_type=1`` asks.
    """
    if stash_type not in _STASH_TYPES:
        raise UnsupportedOperationError(
            op.value, detail=f"stash_type {stash_type}; supported: 1 (float32), 11 (float64)"
        )
    if x_dtype is DType.FLOAT64 or _STASH_TYPES[stash_type] is DType.FLOAT64:
        return DType.FLOAT64
    return DType.FLOAT32


def _known(d: Dim) -> bool:
    return isinstance(d, int)


def _rank_at_least(op: Op, shape: Sequence[Dim], rank: int, layout: str) -> None:
    if len(shape) < rank:
        raise InvalidArgumentError(
            f"{op.value}: X must have rank >= {rank} ({layout}), got shape {tuple(shape)}"
        )


def _check_vector(op: Op, name: str, shape: Sequence[Dim] | None, sizes: Sequence[int]) -> None:
    """A per-channel parameter: 1-D with one of ``sizes`` elements (unknown dims pass)."""
    if shape is None:
        return
    if len(shape) != 1 or (_known(shape[0]) and shape[0] not in sizes):
        want = " or ".join(f"({n},)" for n in dict.fromkeys(sizes))
        raise InvalidArgumentError(
            f"{op.value}: {name} must have shape {want}, got {tuple(shape)}"
        )


def check_batch_norm(op: Op, x: Sequence[Dim], params: Mapping[str, Sequence[Dim] | None]) -> None:
    """X is (N, C, ...); scale, B, mean and var are (C,)."""
    _rank_at_least(op, x, 2, "N, C, ...")
    c = x[1]
    if isinstance(c, int):
        for name, shape in params.items():
            _check_vector(op, name, shape, (c,))


def check_instance_norm(op: Op, x: Sequence[Dim], scale: Sequence[Dim] | None,
                        bias: Sequence[Dim] | None) -> None:
    """X is (N, C, ...); scale and B are (C,)."""
    check_batch_norm(op, x, {"scale": scale, "B": bias})


def check_group_norm(op: Op, x: Sequence[Dim], num_groups: int, scale: Sequence[Dim] | None,
                     bias: Sequence[Dim] | None) -> bool:
    """X is (N, C, ...), ``num_groups`` divides C; scale and bias are (C,).

    Returns True when scale and bias hold one value per *group* (GroupNormalization-18,
    accepted as well so older models import unchanged).
    """
    _rank_at_least(op, x, 2, "N, C, ...")
    if num_groups <= 0:
        raise InvalidArgumentError(f"{op.value}: num_groups must be > 0, got {num_groups}")
    c = x[1]
    if not isinstance(c, int):
        return False
    if c % num_groups:
        raise InvalidArgumentError(
            f"{op.value}: num_groups {num_groups} must divide the channel count {c}"
        )
    for name, shape in (("scale", scale), ("bias", bias)):
        _check_vector(op, name, shape, (c, num_groups))
    return scale is not None and c != num_groups and tuple(scale) == (num_groups,)


def check_trailing_norm(op: Op, x: Sequence[Dim], axis: int,
                        params: Mapping[str, Sequence[Dim] | None]) -> int:
    """Layer and RMS normalization over ``x[axis:]``; returns the normalized axis.

    Each parameter must broadcast to ``x.shape[axis:]`` without growing it
    (leading dims of size 1 beyond the normalized rank are allowed).
    """
    axis = normalize_axis(axis, len(x), what=f"{op.value}: axis")
    if len(x) == 0:
        raise InvalidArgumentError(f"{op.value}: X must have rank >= 1, got a scalar")
    norm = tuple(x[axis:])
    for name, shape in params.items():
        if shape is None:
            continue
        extra = len(shape) - len(norm)
        lead, tail = tuple(shape[:max(extra, 0)]), tuple(shape[max(extra, 0):])
        ok = all(d == 1 for d in lead if _known(d))
        ok = ok and all(not (_known(p) and _known(n) and p not in (1, n))
                        for p, n in zip(reversed(tail), reversed(norm), strict=False))
        if not ok:
            raise InvalidArgumentError(
                f"{op.value}: {name} of shape {tuple(shape)} does not broadcast to the "
                f"normalized shape {norm} (axis {axis})"
            )
    return axis


def check_skip(op: Op, x: Sequence[Dim], skip: Sequence[Dim]) -> None:
    """``skip`` broadcasts to X's shape without growing it (unknown dims pass)."""
    extra = len(skip) - len(x)
    ok = extra <= 0 or all(d == 1 for d in skip[:extra] if _known(d))
    tail = tuple(skip[max(extra, 0):])
    ok = ok and all(not (_known(s) and _known(d) and s not in (1, d))
                    for s, d in zip(reversed(tail), reversed(tuple(x)), strict=False))
    if not ok:
        raise InvalidArgumentError(
            f"{op.value}: skip of shape {tuple(skip)} does not broadcast to X's shape "
            f"{tuple(x)} without growing it"
        )


def check_lrn(op: Op, x: Sequence[Dim], size: int) -> None:
    """X is (N, C, ...); the window ``size`` is positive."""
    _rank_at_least(op, x, 2, "N, C, ...")
    if size <= 0:
        raise InvalidArgumentError(f"{op.value}: size must be > 0, got {size}")


def check_lp_normalization(op: Op, rank: int, axis: int, p: int) -> int:
    """``p`` is 1 or 2; returns the normalized axis."""
    if p not in (1, 2):
        raise InvalidArgumentError(f"{op.value}: p must be 1 or 2, got {p}")
    return normalize_axis(axis, rank, what=f"{op.value}: axis")


def check_mvn_axes(op: Op, rank: int, axes: Sequence[int]) -> tuple[int, ...]:
    """Normalized, distinct reduction axes."""
    norm = tuple(normalize_axis(a, rank, what=f"{op.value}: axes entry") for a in axes)
    if len(set(norm)) != len(norm):
        raise InvalidArgumentError(f"{op.value}: axes {tuple(axes)} repeat an axis")
    return norm


# ---- inference ----------------------------------------------------------------


def _shape(t: TensorType | None) -> tuple[Dim, ...] | None:
    return None if t is None or t.shape is None else tuple(t.shape)


def _at(types: Sequence[TensorType | None], i: int) -> TensorType | None:
    return types[i] if i < len(types) else None


def _infer_batch_norm(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                      values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    if x is None:
        return [None, None, None]
    check_float(Op.BATCH_NORM, x.dtype)
    if x.shape is not None:
        names = ("scale", "B", "input_mean", "input_var")
        check_batch_norm(Op.BATCH_NORM, x.shape,
                         {n: _shape(_at(types, i + 1)) for i, n in enumerate(names)})
    channel = None if x.shape is None else (x.shape[1],)
    stat = TensorType(x.dtype, channel)
    return [x, stat, stat]


def _infer_same(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [None]
        check_float(op, x.dtype)
        if x.shape is not None:
            _check_shape_rules(op, x.shape, types, attrs)
        return [x]
    return infer


def _check_shape_rules(op: Op, x: Sequence[Dim], types: Sequence[TensorType | None],
                       attrs: Mapping[str, Any]) -> None:
    if op is Op.INSTANCE_NORM:
        check_instance_norm(op, x, _shape(_at(types, 1)), _shape(_at(types, 2)))
    elif op is Op.GROUP_NORM:
        check_group_norm(op, x, attrs["num_groups"], _shape(_at(types, 1)),
                         _shape(_at(types, 2)))
    elif op is Op.RMS_NORM:
        compute_dtype(op, DType.FLOAT32, attrs["stash_type"])
        check_trailing_norm(op, x, attrs["axis"], {"scale": _shape(_at(types, 1))})
    elif op is Op.LRN:
        check_lrn(op, x, attrs["size"])
    elif op is Op.LP_NORMALIZATION:
        check_lp_normalization(op, len(x), attrs["axis"], attrs["p"])
    elif op is Op.MEAN_VARIANCE_NORM:
        check_mvn_axes(op, len(x), attrs["axes"])
    elif op in (Op.SOFTMAX, Op.LOG_SOFTMAX, Op.HARDMAX):
        normalize_axis(attrs["axis"], len(x), what=f"{op.value}: axis")


def _infer_layer_norm(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                      values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    if x is None:
        return [None, None, None]
    check_float(Op.LAYER_NORM, x.dtype)
    stat_dtype = compute_dtype(Op.LAYER_NORM, x.dtype, attrs["stash_type"])
    if x.shape is None:
        return [x, TensorType(stat_dtype, None), TensorType(stat_dtype, None)]
    axis = check_trailing_norm(Op.LAYER_NORM, x.shape, attrs["axis"],
                               {"Scale": _shape(_at(types, 1)), "B": _shape(_at(types, 2))})
    stat = TensorType(stat_dtype, tuple(x.shape[:axis]) + (1,) * (len(x.shape) - axis))
    return [x, stat, stat]


def _infer_skip_layer_norm(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                           values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x, skip = types[0], types[1]
    if x is None:
        return [None, None]
    op = Op.SKIP_LAYER_NORM
    check_float(op, x.dtype)
    compute_dtype(op, x.dtype, attrs["stash_type"])
    if skip is not None and skip.dtype != x.dtype:
        raise InvalidArgumentError(
            f"{op.value}: skip must have X's dtype {x.dtype.value}, got {skip.dtype.value}")
    if x.shape is not None:
        if skip is not None and skip.shape is not None:
            check_skip(op, x.shape, skip.shape)
        check_trailing_norm(op, x.shape, attrs["axis"],
                            {"scale": _shape(_at(types, 2)), "B": _shape(_at(types, 3))})
    return [x, x]


_EPS = AttrSpec("epsilon", AttrKind.FLOAT, 1e-5)
_STASH = AttrSpec("stash_type", AttrKind.INT, 1)
_AXIS_LAST = AttrSpec("axis", AttrKind.INT, -1)

register_schema(OpSchema(
    Op.BATCH_NORM, 5, 5,
    attrs=(_EPS, AttrSpec("momentum", AttrKind.FLOAT, 0.9),
           AttrSpec("training_mode", AttrKind.BOOL, False)),
    infer=_infer_batch_norm, max_outputs=3, inplace=((0, 0),),
    doc="ONNX BatchNormalization in inference mode: "
        "Y = scale * (X - input_mean) / sqrt(input_var + epsilon) + B, per channel (axis 1). "
        "momentum is ignored; training_mode=1 is not supported.",
))
register_schema(OpSchema(
    Op.LAYER_NORM, 2, 3, attrs=(_AXIS_LAST, _EPS, _STASH),
    infer=_infer_layer_norm, max_outputs=3,
    doc="ONNX LayerNormalization: normalize over X.shape[axis:], then * Scale + B. "
        "Outputs Y and optionally Mean and InvStdDev (float32, or float64 for float64 X "
        "or stash_type 11).",
))
register_schema(OpSchema(
    Op.SKIP_LAYER_NORM, 3, 4, attrs=(_AXIS_LAST, _EPS, _STASH),
    infer=_infer_skip_layer_norm, max_outputs=2, inplace=((0, 0),),
    doc="keel's residual LayerNorm: S = X + skip (rounded to X's dtype, as Add does; skip "
        "broadcasts to X's shape), Y = LayerNormalization(S, scale, B) over S.shape[axis:]. "
        "Inputs X, skip, scale, [B]; outputs Y and optionally S (the sum, for a graph that "
        "reads it elsewhere). onnxruntime's SkipLayerNormalization without its bias input.",
))
register_schema(OpSchema(
    Op.INSTANCE_NORM, 3, 3, attrs=(_EPS,), infer=_infer_same(Op.INSTANCE_NORM),
    doc="ONNX InstanceNormalization: normalize each (n, c) over the spatial axes, "
        "then * scale[c] + B[c].",
))
register_schema(OpSchema(
    Op.GROUP_NORM, 3, 3,
    attrs=(AttrSpec("num_groups", AttrKind.INT, REQUIRED), _EPS, _STASH),
    infer=_infer_same(Op.GROUP_NORM),
    doc="ONNX GroupNormalization-21: normalize each group of C/num_groups channels "
        "(with the spatial axes), then * scale[c] + bias[c]. Per-group scale and bias "
        "(opset 18) are accepted too.",
))
register_schema(OpSchema(
    Op.RMS_NORM, 2, 2, attrs=(_AXIS_LAST, _EPS, _STASH), infer=_infer_same(Op.RMS_NORM),
    doc="ONNX RMSNormalization: X / sqrt(mean(X**2 over X.shape[axis:]) + epsilon) * scale.",
))
register_schema(OpSchema(
    Op.LRN, 1, 1,
    attrs=(AttrSpec("alpha", AttrKind.FLOAT, 1e-4), AttrSpec("beta", AttrKind.FLOAT, 0.75),
           AttrSpec("bias", AttrKind.FLOAT, 1.0), AttrSpec("size", AttrKind.INT, REQUIRED)),
    infer=_infer_same(Op.LRN),
    doc="ONNX LRN: X / (bias + alpha / size * sum of squares over a window of `size` "
        "channels) ** beta.",
))
register_schema(OpSchema(
    Op.LP_NORMALIZATION, 1, 1,
    attrs=(_AXIS_LAST, AttrSpec("p", AttrKind.INT, 2)),
    infer=_infer_same(Op.LP_NORMALIZATION),
    doc="ONNX LpNormalization: X / ||X||_p along axis (p = 1 or 2); a zero norm gives 0.",
))
register_schema(OpSchema(
    Op.MEAN_VARIANCE_NORM, 1, 1, attrs=(AttrSpec("axes", AttrKind.INTS, (0, 2, 3)),),
    infer=_infer_same(Op.MEAN_VARIANCE_NORM),
    doc="ONNX MeanVarianceNormalization: (X - mean) / (std + 1e-9) over `axes`.",
))
for _op, _doc in (
    (Op.SOFTMAX, "ONNX Softmax-13: exp(X - max) / sum(exp(X - max)) along axis."),
    (Op.LOG_SOFTMAX, "ONNX LogSoftmax-13: X - max - log(sum(exp(X - max))) along axis."),
    (Op.HARDMAX, "ONNX Hardmax-13: 1 at the first maximum along axis, 0 elsewhere."),
):
    register_schema(OpSchema(_op, 1, 1, attrs=(_AXIS_LAST,), infer=_infer_same(_op),
                             inplace=((0, 0),) if _op is not Op.HARDMAX else (), doc=_doc))
