"""Reference kernels of the normalization family: readable NumPy in float64.

Each kernel states its op's formula directly, computes in float64 and casts
the result to the input's dtype. Shape rules come from the op schemas.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schemas.normalization import (
    FLOAT_DTYPES,
    check_batch_norm,
    check_float,
    check_group_norm,
    check_instance_norm,
    check_lp_normalization,
    check_lrn,
    check_mvn_axes,
    check_skip,
    check_trailing_norm,
    compute_dtype,
)
from keel.ops.types import normalize_axis

__all__: list[str] = []


# Added to the standard deviation by ONNX MeanVarianceNormalization's function body.
_MVN_EPSILON = 1e-9


def _float_input(op: Op, x: np.ndarray) -> np.ndarray:
    check_float(op, DType.from_numpy(x.dtype))
    return np.asarray(x, dtype=np.float64)


def _opt(inputs: Inputs, i: int) -> np.ndarray | None:
    return inputs[i] if i < len(inputs) else None


def _mean(a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Mean over ``axes`` (keepdims); an empty reduction gives NaN without a warning."""
    count = math.prod(a.shape[i] for i in axes)
    with np.errstate(invalid="ignore", divide="ignore"):
        return a.sum(axis=axes, keepdims=True) / count


def _standardize(x: np.ndarray, axes: tuple[int, ...],
                 eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x - mean) / sqrt(var + eps) over ``axes``; also returns mean and 1/sqrt(var + eps)."""
    mean = _mean(x, axes)
    var = _mean((x - mean) ** 2, axes)
    inv_std = 1.0 / np.sqrt(var + eps)
    return (x - mean) * inv_std, mean, inv_std


def _per_channel(v: np.ndarray, rank: int) -> np.ndarray:
    """A (C,) vector shaped to broadcast along axis 1 of a rank-``rank`` tensor."""
    return np.asarray(v, dtype=np.float64).reshape((1, -1) + (1,) * (rank - 2))


@TABLE.kernel(Op.BATCH_NORM, dtypes=FLOAT_DTYPES)
def batch_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """scale * (X - mean) / sqrt(var + epsilon) + B along the channel axis."""
    if attrs["training_mode"]:
        raise UnsupportedOperationError(
            Op.BATCH_NORM.value, ctx.backend,
            detail="training_mode=1 (batch statistics, running-mean updates); "
                   "keel runs BatchNormalization in inference mode only",
        )
    x, scale, bias, mean, var = inputs
    xf = _float_input(Op.BATCH_NORM, x)
    check_batch_norm(Op.BATCH_NORM, x.shape, {"scale": scale.shape, "B": bias.shape,
                                              "input_mean": mean.shape,
                                              "input_var": var.shape})
    r = x.ndim
    y = (xf - _per_channel(mean, r)) / np.sqrt(_per_channel(var, r) + attrs["epsilon"])
    y = y * _per_channel(scale, r) + _per_channel(bias, r)
    return [y.astype(x.dtype)]


@TABLE.kernel(Op.LAYER_NORM, dtypes=FLOAT_DTYPES)
def layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Standardize over X.shape[axis:], then * Scale + B; also returns Mean and InvStdDev."""
    x, scale, bias = inputs[0], inputs[1], _opt(inputs, 2)
    xf = _float_input(Op.LAYER_NORM, x)
    stat = compute_dtype(Op.LAYER_NORM, DType.from_numpy(x.dtype), attrs["stash_type"])
    axis = check_trailing_norm(Op.LAYER_NORM, x.shape, attrs["axis"], {
        "Scale": scale.shape, "B": None if bias is None else bias.shape})
    normalized, mean, inv_std = _standardize(xf, tuple(range(axis, x.ndim)), attrs["epsilon"])
    y = normalized * scale.astype(np.float64)
    if bias is not None:
        y = y + bias.astype(np.float64)
    results = [y.astype(x.dtype), mean.astype(stat.numpy), inv_std.astype(stat.numpy)]
    # As many results as output buffers given; all three when none are.
    return results if out is None else results[:len(out)]


@TABLE.kernel(Op.SKIP_LAYER_NORM, dtypes=FLOAT_DTYPES)
def skip_layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """S = X + skip in X's dtype (as Add rounds it), then LayerNormalization of S; Y and S."""
    x, skip, scale, bias = inputs[0], inputs[1], inputs[2], _opt(inputs, 3)
    op = Op.SKIP_LAYER_NORM
    check_float(op, DType.from_numpy(x.dtype))
    compute_dtype(op, DType.from_numpy(x.dtype), attrs["stash_type"])
    if skip.dtype != x.dtype:
        raise InvalidArgumentError(f"{op.value}: skip must have X's dtype {x.dtype}, "
                                   f"got {skip.dtype}")
    check_skip(op, x.shape, skip.shape)
    axis = check_trailing_norm(op, x.shape, attrs["axis"], {
        "scale": scale.shape, "B": None if bias is None else bias.shape})
    extra = skip.ndim - x.ndim
    total = np.add(x, skip.reshape(skip.shape[extra:]) if extra > 0 else skip)
    normalized, _, _ = _standardize(total.astype(np.float64), tuple(range(axis, x.ndim)),
                                    attrs["epsilon"])
    y = normalized * scale.astype(np.float64)
    if bias is not None:
        y = y + bias.astype(np.float64)
    results = [y.astype(x.dtype), total]
    return results if out is None else results[:len(out)]


@TABLE.kernel(Op.INSTANCE_NORM, dtypes=FLOAT_DTYPES)
def instance_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Standardize each (n, c) over the spatial axes, then * scale[c] + B[c]."""
    x, scale, bias = inputs
    xf = _float_input(Op.INSTANCE_NORM, x)
    check_instance_norm(Op.INSTANCE_NORM, x.shape, scale.shape, bias.shape)
    normalized, _, _ = _standardize(xf, tuple(range(2, x.ndim)), attrs["epsilon"])
    y = normalized * _per_channel(scale, x.ndim) + _per_channel(bias, x.ndim)
    return [y.astype(x.dtype)]


@TABLE.kernel(Op.GROUP_NORM, dtypes=FLOAT_DTYPES)
def group_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Standardize each group of channels (with the spatial axes), then * scale + bias."""
    x, scale, bias = inputs
    xf = _float_input(Op.GROUP_NORM, x)
    groups = attrs["num_groups"]
    compute_dtype(Op.GROUP_NORM, DType.from_numpy(x.dtype), attrs["stash_type"])
    per_group = check_group_norm(Op.GROUP_NORM, x.shape, groups, scale.shape, bias.shape)
    n, c = x.shape[0], x.shape[1]
    grouped = xf.reshape(n, groups, (c // groups) * math.prod(x.shape[2:]))
    normalized, _, _ = _standardize(grouped, (2,), attrs["epsilon"])
    if per_group:
        scale, bias = np.repeat(scale, c // groups), np.repeat(bias, c // groups)
    y = normalized.reshape(x.shape) * _per_channel(scale, x.ndim) + _per_channel(bias, x.ndim)
    return [y.astype(x.dtype)]


@TABLE.kernel(Op.RMS_NORM, dtypes=FLOAT_DTYPES)
def rms_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """X / sqrt(mean(X ** 2 over X.shape[axis:]) + epsilon) * scale."""
    x, scale = inputs
    xf = _float_input(Op.RMS_NORM, x)
    compute_dtype(Op.RMS_NORM, DType.from_numpy(x.dtype), attrs["stash_type"])
    axis = check_trailing_norm(Op.RMS_NORM, x.shape, attrs["axis"], {"scale": scale.shape})
    mean_square = _mean(xf**2, tuple(range(axis, x.ndim)))
    y = xf / np.sqrt(mean_square + attrs["epsilon"]) * scale.astype(np.float64)
    return [y.astype(x.dtype)]


@TABLE.kernel(Op.LRN, dtypes=FLOAT_DTYPES)
def lrn(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """X / (bias + alpha / size * (sum of squares over neighbouring channels)) ** beta."""
    x = inputs[0]
    xf = _float_input(Op.LRN, x)
    size = attrs["size"]
    check_lrn(Op.LRN, x.shape, size)
    channels = x.shape[1]
    before, after = (size - 1) // 2, math.ceil((size - 1) / 2)
    square = xf**2
    square_sum = np.zeros_like(xf)
    for c in range(channels):
        lo, hi = max(0, c - before), min(channels, c + after + 1)
        square_sum[:, c] = square[:, lo:hi].sum(axis=1)
    y = xf / (attrs["bias"] + attrs["alpha"] / size * square_sum) ** attrs["beta"]
    return [y.astype(x.dtype)]


@TABLE.kernel(Op.LP_NORMALIZATION, dtypes=FLOAT_DTYPES)
def lp_normalization(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """X / ||X||_p along axis; where the norm is 0 the result is 0."""
    x = inputs[0]
    xf = _float_input(Op.LP_NORMALIZATION, x)
    p = attrs["p"]
    axis = check_lp_normalization(Op.LP_NORMALIZATION, x.ndim, attrs["axis"], p)
    norm = (np.abs(xf) ** p).sum(axis=axis, keepdims=True) ** (1.0 / p)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(norm == 0, 0.0, xf / norm)
    return [y.astype(x.dtype)]


@TABLE.kernel(Op.MEAN_VARIANCE_NORM, dtypes=FLOAT_DTYPES)
def mean_variance_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(X - mean) / (sqrt(variance) + 1e-9) over ``axes``."""
    x = inputs[0]
    xf = _float_input(Op.MEAN_VARIANCE_NORM, x)
    axes = check_mvn_axes(Op.MEAN_VARIANCE_NORM, x.ndim, attrs["axes"])
    mean = _mean(xf, axes)
    std = np.sqrt(_mean((xf - mean) ** 2, axes))
    y = (xf - mean) / (std + _MVN_EPSILON)
    return [y.astype(x.dtype)]


def _softmax_input(op: Op, x: np.ndarray, attrs: Attrs) -> tuple[np.ndarray, int]:
    xf = _float_input(op, x)
    return xf, normalize_axis(attrs["axis"], x.ndim, what=f"{op.value}: axis")


@TABLE.kernel(Op.SOFTMAX, dtypes=FLOAT_DTYPES)
def softmax(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """exp(X - max) / sum(exp(X - max)) along axis."""
    x = inputs[0]
    xf, axis = _softmax_input(Op.SOFTMAX, x, attrs)
    if x.size == 0:
        return [x.copy()]
    e = np.exp(xf - xf.max(axis=axis, keepdims=True))
    return [(e / e.sum(axis=axis, keepdims=True)).astype(x.dtype)]


@TABLE.kernel(Op.LOG_SOFTMAX, dtypes=FLOAT_DTYPES)
def log_softmax(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(X - max) - log(sum(exp(X - max))) along axis."""
    x = inputs[0]
    xf, axis = _softmax_input(Op.LOG_SOFTMAX, x, attrs)
    if x.size == 0:
        return [x.copy()]
    shifted = xf - xf.max(axis=axis, keepdims=True)
    y = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
    return [y.astype(x.dtype)]


@TABLE.kernel(Op.HARDMAX, dtypes=FLOAT_DTYPES)
def hardmax(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """1 at the first maximum along axis, 0 elsewhere."""
    x = inputs[0]
    _, axis = _softmax_input(Op.HARDMAX, x, attrs)
    if x.size == 0:
        return [np.zeros_like(x)]
    first_max = np.expand_dims(np.argmax(x, axis=axis), axis)
    positions = np.arange(x.shape[axis]).reshape([-1 if i == axis else 1 for i in range(x.ndim)])
    return [(positions == first_max).astype(x.dtype)]
