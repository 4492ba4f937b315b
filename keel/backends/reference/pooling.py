"""Reference kernels of the pooling family: one window offset at a time, in float64.

The input is padded so every window (including a ``ceil_mode`` window that
runs past the explicit pads) lies inside it; masks say which padded positions
are input, explicit padding, or the extra ceil-mode end. Shape rules come from
:mod:`keel.ops.schemas.pooling`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schemas.conv import Window
from keel.ops.schemas.pooling import DTYPES, check_pool_input, pool_window

__all__: list[str] = []



def _extra_end(win: Window) -> tuple[int, ...]:
    """Padding past the explicit end pads that ceil-mode windows reach."""
    return tuple(
        max(0, (o - 1) * s + e - (i + pb + pe))
        for o, s, e, i, pb, pe in zip(win.out_spatial, win.strides, win.effective_kernel,
                                      win.in_spatial, win.pads_begin, win.pads_end,
                                      strict=True)
    )


def _pad(a: np.ndarray, win: Window, value: float, extra_value: float) -> np.ndarray:
    """Explicit pads hold ``value``; the ceil-mode extra at the end holds ``extra_value``."""
    a = np.pad(a, [(0, 0), (0, 0), *zip(win.pads_begin, win.pads_end, strict=True)],
               constant_values=value)
    return np.pad(a, [(0, 0), (0, 0), *((0, x) for x in _extra_end(win))],
                  constant_values=extra_value)


def _windows(a: np.ndarray, win: Window) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
    """(kernel offset, the strided slice of every window's element at that offset)."""
    for offs in itertools.product(*(range(k) for k in win.kernel)):
        taps = tuple(slice(o * d, o * d + (size - 1) * s + 1, s) for o, d, s, size in
                     zip(offs, win.dilations, win.strides, win.out_spatial, strict=True))
        index: tuple[slice, ...] = (slice(None), slice(None), *taps)
        yield offs, a[index]


def _input(op: Op, x: np.ndarray) -> np.ndarray:
    check_pool_input(op, x.shape, DType.from_numpy(x.dtype))
    return x.astype(np.float64)


@TABLE.kernel(Op.MAX_POOL, dtypes=DTYPES[Op.MAX_POOL], supports_out=True)
def max_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Max over each window and the Indices of the (first) winner in X; a window
    holding NaN gives NaN (as ``numpy.maximum`` does), at the first NaN's index.

    Gives as many outputs as ``out`` holds (Y, or Y and Indices); both without ``out``.
    """
    x = inputs[0]
    win = pool_window(Op.MAX_POOL, x.shape, attrs)
    xp = _pad(_input(Op.MAX_POOL, x), win, -np.inf, -np.inf)
    n, c = x.shape[:2]
    best = np.full((n, c, *win.out_spatial), -np.inf)
    arg = np.zeros((n, c, *win.out_spatial), dtype=np.int64)
    grids = np.meshgrid(*(np.arange(o) for o in win.out_spatial), indexing="ij")
    for offs, vals in _windows(xp, win):
        # NaN wins as NumPy's maximum has it: the first NaN in a window is its max.
        better = (vals > best) | (np.isnan(vals) & ~np.isnan(best))
        best = np.where(better, vals, best)
        coords = [g * s + k * d - pb for g, s, k, d, pb in
                  zip(grids, win.strides, offs, win.dilations, win.pads_begin, strict=True)]
        arg = np.where(better, _flat_index(coords, x.shape, attrs["storage_order"]), arg)
    base = (np.arange(n)[:, None] * c + np.arange(c)[None, :]) * math.prod(x.shape[2:])
    results = [best.astype(x.dtype), arg + base.reshape(n, c, *([1] * win.rank))]
    if out is None:
        return results
    for dst, src in zip(out, results, strict=False):
        dst[...] = src
    return list(out)


def _flat_index(coords: list[np.ndarray], shape: Sequence[int], storage_order: int
                ) -> np.ndarray:
    """Index of a spatial position within its (n, c) plane, row or column major."""
    dims = list(shape[2:])
    order = range(len(dims)) if storage_order == 0 else reversed(range(len(dims)))
    index = np.zeros_like(coords[0])
    for i in order:
        index = index * dims[i] + coords[i]
    return index


@TABLE.kernel(Op.AVG_POOL, dtypes=DTYPES[Op.AVG_POOL])
def avg_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Mean over each window; pads count only with ``count_include_pad``."""
    x = inputs[0]
    win = pool_window(Op.AVG_POOL, x.shape, attrs)
    xp = _pad(_input(Op.AVG_POOL, x), win, 0.0, 0.0)
    ones = np.ones((1, 1, *x.shape[2:]))
    counted = _pad(ones, win, 1.0 if attrs["count_include_pad"] else 0.0, 0.0)
    total = np.asarray(sum(vals for _, vals in _windows(xp, win)))
    count = np.asarray(sum(vals for _, vals in _windows(counted, win)))
    return [(total / count).astype(x.dtype)]


@TABLE.kernel(Op.LP_POOL, dtypes=DTYPES[Op.LP_POOL])
def lp_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(sum |x|^p)^(1/p) over each window; padding adds nothing."""
    x = inputs[0]
    p = attrs["p"]
    win = pool_window(Op.LP_POOL, x.shape, attrs)
    xp = _pad(np.abs(_input(Op.LP_POOL, x)) ** p, win, 0.0, 0.0)
    total = np.asarray(sum(vals for _, vals in _windows(xp, win)))
    return [(total ** (1.0 / p)).astype(x.dtype)]


def _global(op: Op, x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    return _input(op, x), tuple(range(2, x.ndim))


@TABLE.kernel(Op.GLOBAL_AVG_POOL, dtypes=DTYPES[Op.GLOBAL_AVG_POOL])
def global_avg_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Mean over all spatial dims (kept, size 1)."""
    x64, axes = _global(Op.GLOBAL_AVG_POOL, inputs[0])
    return [x64.mean(axis=axes, keepdims=True).astype(inputs[0].dtype)]


@TABLE.kernel(Op.GLOBAL_MAX_POOL, dtypes=DTYPES[Op.GLOBAL_MAX_POOL])
def global_max_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Max over all spatial dims (kept, size 1)."""
    x64, axes = _global(Op.GLOBAL_MAX_POOL, inputs[0])
    return [x64.max(axis=axes, keepdims=True).astype(inputs[0].dtype)]
