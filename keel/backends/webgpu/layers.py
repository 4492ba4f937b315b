"""Pooling, Softmax, LayerNorm and the sum/mean reductions as WGSL kernels.

Row ops (softmax, layer norm, reductions, global average pooling) run one
workgroup per row of a contiguous (rows, L) view with a fixed-order tree sum,
so results are the same on every run. An axis that is not last is moved last
by a strided copy first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, KernelTable, Out, optional_input
from keel.backends.webgpu import wgsl
from keel.backends.webgpu.array import Namespace, WgpuArray
from keel.backends.webgpu.elementwise import elementwise
from keel.backends.webgpu.ops import (
    Params,
    contiguous,
    fresh,
    groups_for,
    launch,
    lifted,
    out_array,
    scalar_type,
)
from keel.backends.webgpu.typed import run_map
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schemas.normalization import (
    check_batch_norm,
    check_group_norm,
    check_instance_norm,
    check_skip,
    compute_dtype,
)
from keel.ops.schemas.pooling import pool_window
from keel.ops.schemas.reduction import arg_axis, reduction_axes

__all__ = ["register", "softmax_last"]

_NONE = 0xFFFFFFFF
_REDUCING = ("sum", "mean", "max", "min", "prod")      # row kinds with one value per row


def _row_groups(rows: int) -> tuple[int, int, int]:
    return groups_for(rows, 1)


def _rows(kind: str, x: WgpuArray, length: int, out_shape: Sequence[int], out: Out = None
          ) -> WgpuArray:
    """A one-value-per-row (or per-element) row kernel over contiguous ``x``."""
    xc = contiguous(x)
    y = out_array(x.storage.device, out, 0, out_shape, x.dtype)
    rows = y.size if kind in _REDUCING else xc.size // max(length, 1)
    if y.size == 0:
        return y
    params = Params().u(rows, length, xc.offset, y.offset).f(0.0).u(0, 0, 0, 0, 0, 1, 0)
    launch(wgsl.rows(scalar_type(x.dtype), kind), [y, xc], params, _row_groups(rows), [y])
    return y


def softmax_last(x: WgpuArray, out: Out = None, kind: str = "softmax") -> WgpuArray:
    if x.size == 0:
        return out_array(x.storage.device, out, 0, x.shape, x.dtype)
    return _rows(kind, x, x.shape[-1], x.shape, out)


def _moved_last(x: WgpuArray, axis: int) -> tuple[WgpuArray, tuple[int, ...]]:
    order = (*(a for a in range(x.ndim) if a != axis), axis)
    return x.transpose(order), order


def _softmax(kind: str) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        x = inputs[0]
        axis = _axis(attrs.get("axis", -1), x.ndim, kind)
        if axis == x.ndim - 1 or x.size == 0:
            return [softmax_last(x, out, kind)]
        moved, order = _moved_last(x, axis)
        y = softmax_last(moved, None, kind)
        back = [order.index(a) for a in range(x.ndim)]
        dst = out_array(x.storage.device, out, 0, x.shape, x.dtype)
        dst[...] = y.transpose(back)
        return [dst]
    return kernel


def _axis(axis: int, rank: int, what: str) -> int:
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise InvalidArgumentError(f"{what}: axis {axis} is out of range for rank {rank}")
    return axis % max(rank, 1)


def _layer_norm_rows(x: WgpuArray, scale: WgpuArray, bias: WgpuArray | None,
                     skip: WgpuArray | None, axis: int, eps: float, stats: bool,
                     total: bool) -> list[WgpuArray]:
    dev = x.storage.device
    xc = contiguous(x)
    length = 1
    for d in x.shape[axis:]:
        length *= d
    rows = xc.size // length if length else 0
    y = fresh(dev, x.shape, x.dtype)
    stat_shape = (*x.shape[:axis], *([1] * (x.ndim - axis)))
    mean, inv = fresh(dev, stat_shape, np.float32), fresh(dev, stat_shape, np.float32)
    summed = fresh(dev, x.shape, x.dtype)
    sc = _over(scale, x.shape[axis:])
    bc = None if bias is None else _over(bias, x.shape[axis:])
    kc = None if skip is None else contiguous(skip)
    params = (Params().u(rows, length, xc.offset, y.offset).f(eps)
              .u(sc.offset, _NONE if bc is None else bc.offset, mean.offset, inv.offset,
                 _NONE if kc is None else kc.offset, 1 if kc is None else kc.size,
                 summed.offset))
    arrays = [y, xc, sc] + ([bc] if bc is not None else []) + ([kc] if kc is not None else []) \
        + ([mean, inv] if stats else []) + ([summed] if total else [])
    if y.size:
        source = wgsl.rows(scalar_type(x.dtype), "layer_norm", bc is not None, kc is not None,
                           stats, total)
        launch(source, arrays, params, _row_groups(rows), [y, mean, inv, summed])
    return [y, mean, inv, summed]


def _over(p: WgpuArray, dims: Sequence[int]) -> WgpuArray:
    """A scale or bias laid out over the normalized dims (broadcast where it repeats)."""
    if p.shape == tuple(dims) and p.is_contiguous():
        return p
    if len(p.shape) > len(dims):
        if any(d != 1 for d in p.shape[:len(p.shape) - len(dims)]):
            raise InvalidArgumentError(f"layer norm: a parameter of shape {p.shape} does not "
                                       f"broadcast over the normalized dims {tuple(dims)}")
        p = p.reshape(p.shape[len(p.shape) - len(dims):])
    full = fresh(p.storage.device, dims, p.dtype)
    full[...] = p
    return full


def _layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x, scale, bias = inputs[0], inputs[1], optional_input(inputs, 2)
    compute_dtype(Op.LAYER_NORM, DType.from_numpy(x.dtype), attrs["stash_type"])
    if attrs["stash_type"] != 1:
        raise InvalidArgumentError("webgpu layer norm keeps its statistics in float32 "
                                   "(stash_type 1); float64 statistics run elsewhere")
    axis = _axis(attrs["axis"], x.ndim, "layer_norm")
    wanted = 3 if out is None else len(out)
    y, mean, inv, _ = _layer_norm_rows(x, scale, bias, None, axis, float(attrs["epsilon"]),
                                       wanted > 1, False)
    return [y, mean, inv][:wanted]


def _per_channel(p: WgpuArray, rank: int) -> WgpuArray:
    """A (C,) parameter seen along axis 1 of a rank-``rank`` tensor."""
    return p.reshape((p.shape[0], *([1] * (rank - 2))))


def _standardized(x: WgpuArray, rows: tuple[int, ...], eps: float) -> WgpuArray:
    """``x`` standardized over the last dim of its view as ``rows`` (a layer norm with
    unit scale), laid out as ``x``."""
    view = contiguous(x).reshape(rows)
    ones = Namespace(x.storage.device).asarray(np.ones(rows[-1:], x.dtype))
    y = _layer_norm_rows(view, ones, None, None, len(rows) - 1, eps, False, False)[0]
    return y.reshape(x.shape)


def _affine(y: WgpuArray, scale: WgpuArray, bias: WgpuArray, out: Out) -> WgpuArray:
    rank = y.ndim
    return run_map("a * b + c", [y, _per_channel(scale, rank), _per_channel(bias, rank)],
                   y.dtype, out)


def _batch_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    if attrs["training_mode"]:
        raise UnsupportedOperationError(
            Op.BATCH_NORM.value, "webgpu",
            detail="training_mode=1 (batch statistics, running-mean updates); keel runs "
                   "BatchNormalization in inference mode only")
    x, scale, bias, mean, var = inputs
    check_batch_norm(Op.BATCH_NORM, x.shape, {"scale": scale.shape, "B": bias.shape,
                                              "input_mean": mean.shape,
                                              "input_var": var.shape})
    k = run_map(f"a / sqrt(b + {wgsl.lit(float(attrs['epsilon']))})", [scale, var],
                np.float32)
    per = [_per_channel(p, x.ndim) for p in (mean, k, bias)]
    return [run_map("(a - b) * c + d", [x, *per], x.dtype, out)]


def _instance_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x, scale, bias = inputs
    check_instance_norm(Op.INSTANCE_NORM, x.shape, scale.shape, bias.shape)
    rows = (x.shape[0] * x.shape[1], math.prod(x.shape[2:]))
    return [_affine(_standardized(x, rows, float(attrs["epsilon"])), scale, bias, out)]


def _group_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x, scale, bias = inputs
    groups = attrs["num_groups"]
    compute_dtype(Op.GROUP_NORM, DType.from_numpy(x.dtype), attrs["stash_type"])
    if attrs["stash_type"] != 1:
        raise InvalidArgumentError("webgpu group norm keeps its statistics in float32 "
                                   "(stash_type 1); float64 statistics run elsewhere")
    per_group = check_group_norm(Op.GROUP_NORM, x.shape, groups, scale.shape, bias.shape)
    n, c = x.shape[0], x.shape[1]
    if per_group:           # one value per group: seen once per channel of the group
        scale, bias = (WgpuArray(p.storage, (groups, c // groups), p.dtype,
                                 (p.strides_el[0], 0), p.offset).reshape(c)
                       for p in (scale, bias))
    rows = (n * groups, (c // groups) * math.prod(x.shape[2:]))
    return [_affine(_standardized(x, rows, float(attrs["epsilon"])), scale, bias, out)]


def _skip_layer_norm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x, skip, scale, bias = inputs[0], inputs[1], inputs[2], optional_input(inputs, 3)
    if skip.dtype != x.dtype:
        raise InvalidArgumentError(f"skip_layer_norm: skip must have X's dtype {x.dtype}, "
                                   f"got {skip.dtype}")
    check_skip(Op.SKIP_LAYER_NORM, x.shape, skip.shape)
    if skip.shape != x.shape:              # broadcast: laid out like X once
        skip = _over(skip, x.shape)
    axis = _axis(attrs["axis"], x.ndim, "skip_layer_norm")
    wanted = 2 if out is None else len(out)
    y, _, _, summed = _layer_norm_rows(x, scale, bias, skip, axis, float(attrs["epsilon"]),
                                       False, wanted > 1)
    return [y, summed][:wanted]


def _reduce(kind: str, x: WgpuArray, axes: Sequence[int], keepdims: bool, out: Out
            ) -> WgpuArray:
    axes = sorted({_axis(a, x.ndim, kind) for a in axes})
    kept = [a for a in range(x.ndim) if a not in axes]
    moved = x.transpose((*kept, *axes)) if x.ndim else x
    length = 1
    for a in axes:
        length *= x.shape[a]
    shape = tuple(1 if a in axes else x.shape[a] for a in range(x.ndim)) if keepdims \
        else tuple(x.shape[a] for a in kept)
    return _rows(kind, moved, length, shape, out)


def _sum_mean(op: Op, kind: str) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        x = inputs[0]
        given = inputs[1] if len(inputs) > 1 and inputs[1] is not None else None
        axes = reduction_axes(op, x.ndim, attrs, None if given is None else given.to_host())
        if not axes:
            dst = out_array(x.storage.device, out, 0, x.shape, x.dtype)
            dst[...] = x
            return [dst]
        return [_reduce(kind, x, axes, bool(attrs["keepdims"]), out)]
    return kernel


def _all(kind: str) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        x = inputs[0]
        return [_rows(kind, x, x.size, (), out)]
    return kernel


# ONNX reductions as a row reduction between two float maps (None: none): on x first, on
# the reduced values after (ReduceL2 = sqrt of the row sum of squares).
_REDUCE: dict[Op, tuple[str | None, str, str | None]] = {
    Op.REDUCE_MAX: (None, "max", None), Op.REDUCE_MIN: (None, "min", None),
    Op.REDUCE_PROD: (None, "prod", None), Op.REDUCE_L1: ("abs(a)", "sum", None),
    Op.REDUCE_L2: ("a * a", "sum", "sqrt(a)"), Op.REDUCE_SUM_SQUARE: ("a * a", "sum", None),
    Op.REDUCE_LOG_SUM: (None, "sum", "log(a)"),
}


def _onnx_reduce(op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        x = inputs[0]
        given = inputs[1] if len(inputs) > 1 and inputs[1] is not None else None
        axes = reduction_axes(op, x.ndim, attrs, None if given is None else given.to_host())
        keep = bool(attrs["keepdims"])
        if op is Op.REDUCE_LOG_SUM_EXP:
            return [_log_sum_exp(x, axes, keep, out)]
        before, kind, after = _REDUCE[op]
        src = x if before is None else elementwise(before, [x])
        y = _reduce(kind, src, axes, keep, out if after is None else None)
        return [y if after is None else elementwise(after, [y], (), out)]
    return kernel


def _log_sum_exp(x: WgpuArray, axes: Sequence[int], keep: bool, out: Out) -> WgpuArray:
    """log(sum(exp(x - top))) + top, top the row maximum where finite (else 0)."""
    top = elementwise("select(0.0, a, !is_nan(a) && abs(a) <= 3.4028235e38)",
                      [_reduce("max", x, axes, True, None)])
    total = _reduce("sum", elementwise("exp(a - b)", [x, top]), axes, keep, None)
    shift = top if keep else top.reshape(total.shape)
    return elementwise("log(a) + b", [total, shift], (), out)


def _global_max(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    if x.ndim < 3:
        raise InvalidArgumentError(f"global_max_pool needs rank >= 3, got {x.shape}")
    return [_reduce("max", x, tuple(range(2, x.ndim)), True, out)]


def _global_avg(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    if x.ndim < 3:
        raise InvalidArgumentError(f"global_avg_pool needs rank >= 3, got {x.shape}")
    return [_reduce("mean", x, tuple(range(2, x.ndim)), True, out)]


def _pool(kind: str, op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        x = inputs[0]
        win = pool_window(op, x.shape, attrs)
        full = lifted(win, 3, op.value)
        xc = contiguous(x)
        n, c = x.shape[:2]
        shape = (n, c, *win.out_spatial)
        y = out_array(x.storage.device, out, 0, shape, x.dtype)
        want_indices = kind == "max" and (out is None or len(out) > 1)
        ix = out_array(x.storage.device, out, 1, shape, np.int64) if want_indices else None
        if y.size:
            params = Params().u(n * c, *full.in_spatial, *full.out_spatial, *full.kernel,
                                *full.strides, *full.pads_begin, *full.dilations,
                                int(bool(attrs.get("count_include_pad", 0))), xc.offset,
                                y.offset, *full.pads_end)
            arrays = [y, xc]
            if ix is not None:
                params.u(ix.offset * 2, int(attrs.get("storage_order", 0)))
                arrays.append(ix)
            launch(wgsl.pool3d(scalar_type(x.dtype), kind, ix is not None), arrays, params,
                   groups_for(y.size), arrays[::2])
        return [y] if ix is None else [y, ix]
    return kernel


_ARG_TYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
              np.dtype(np.int32): "i32"}


def _arg(op: Op, kind: str) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        x = inputs[0]
        t = _ARG_TYPES.get(x.dtype)
        if t is None:
            raise InvalidArgumentError(f"webgpu {op.value} takes float32, float16 or int32, "
                                       f"got {x.dtype}")
        axis = arg_axis(op, x.shape, attrs)
        moved, _ = _moved_last(x, axis)
        xc = contiguous(moved)
        kept = tuple(d for a, d in enumerate(x.shape) if a != axis)
        shape = tuple(1 if a == axis else d for a, d in enumerate(x.shape)) \
            if attrs["keepdims"] else kept
        y = out_array(x.storage.device, out, 0, shape, np.int64)
        if y.size:
            params = Params().u(y.size, x.shape[axis], xc.offset, y.offset * 2)
            launch(wgsl.arg_rows(t, kind, bool(attrs["select_last_index"])), [y, xc], params,
                   groups_for(y.size), [y])
        return [y]
    return kernel


def register(table: KernelTable, float_dtypes: Sequence[str]) -> None:
    fd = float_dtypes
    table.kernel(Op.SOFTMAX, dtypes=fd, supports_out=True,
                 description="WGSL row softmax")(_softmax("softmax"))
    table.kernel(Op.LOG_SOFTMAX, dtypes=fd, supports_out=True,
                 description="WGSL row log-softmax")(_softmax("log_softmax"))
    for op in (*_REDUCE, Op.REDUCE_LOG_SUM_EXP):
        table.kernel(op, dtypes=fd, supports_out=True,
                     description=f"WGSL row {op.value}")(_onnx_reduce(op))
    for op, fn in ((Op.BATCH_NORM, _batch_norm), (Op.INSTANCE_NORM, _instance_norm),
                   (Op.GROUP_NORM, _group_norm)):
        table.kernel(op, dtypes=fd, supports_out=True,
                     description=f"WGSL {op.value}: row statistics, per-channel affine")(fn)
    table.kernel(Op.GLOBAL_MAX_POOL, dtypes=fd, supports_out=True,
                 description="WGSL row max over the spatial dims")(_global_max)
    table.kernel(Op.LAYER_NORM, dtypes=fd, description="WGSL row layer norm")(_layer_norm)
    table.kernel(Op.SKIP_LAYER_NORM, dtypes=fd,
                 description="WGSL row layer norm of X + skip")(_skip_layer_norm)
    table.kernel(Op.SUM, dtypes=fd, supports_out=True, description="WGSL row sum")(
        _sum_mean(Op.SUM, "sum"))
    table.kernel(Op.MEAN, dtypes=fd, supports_out=True, description="WGSL row mean")(
        _sum_mean(Op.MEAN, "mean"))
    table.kernel(Op.SUM_ALL, dtypes=fd, supports_out=True, description="WGSL tree sum")(
        _all("sum"))
    table.kernel(Op.MEAN_ALL, dtypes=fd, supports_out=True, description="WGSL tree mean")(
        _all("mean"))
    table.kernel(Op.GLOBAL_AVG_POOL, dtypes=fd, supports_out=True,
                 description="WGSL row mean over H x W")(_global_avg)
    for op, kind in ((Op.ARGMAX, "max"), (Op.ARGMIN, "min")):
        table.kernel(op, dtypes=(*fd, "int32"), supports_out=True,
                     description=f"WGSL arg{kind} per row (int64 indices)")(_arg(op, kind))
    table.kernel(Op.MAX_POOL, dtypes=fd, supports_out=True,
                 description="WGSL max pool (Y, Indices)")(_pool("max", Op.MAX_POOL))
    table.kernel(Op.AVG_POOL, dtypes=fd, supports_out=True,
                 description="WGSL average pool")(_pool("avg", Op.AVG_POOL))
