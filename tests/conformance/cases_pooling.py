"""Conformance cases of the pooling family: max, average, Lp and global pools.

They cover 1-D, 2-D and 3-D windows, strides, dilations, explicit and
``auto_pad`` padding, ``ceil_mode`` (windows running past the end),
``count_include_pad``, MaxPool's Indices in both storage orders, Lp pools for
p = 1, 2, 3, integer max pools, zero-size batches, non-contiguous inputs and
float16/32/64. (Backends return MaxPool's Indices too when no outputs are
given, so every max_pool case checks them.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

F16, F32, F64 = np.float16, np.float32, np.float64
_TOL: dict[Any, dict[str, float]] = {
    F16: {"rtol": 2e-3, "atol": 2e-3},
    F32: {"rtol": 1e-5, "atol": 1e-6},
    F64: {"rtol": 1e-12, "atol": 1e-12},
}


def _x(shape: Sequence[int], dtype: Any = F32,
       view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        if np.dtype(dtype).kind in "iu":
            info = np.iinfo(dtype)
            x = rng.integers(info.min, info.max, size=tuple(shape), endpoint=True, dtype=dtype)
        else:
            x = rng.standard_normal(tuple(shape)).astype(dtype)
        return [x if view is None else view(x)]
    return make


def _pool(id: str, op: Op, shape: Sequence[int], dtype: Any = F32,
          view: Callable[[np.ndarray], np.ndarray] | None = None, **attrs: Any) -> OpCase:
    return OpCase(id, op, _x(shape, dtype, view), attrs, **_TOL.get(dtype, _TOL[F32]))


def _windowed(prefix: str, op: Op, **extra: Any) -> list[OpCase]:
    """The window geometries every windowed pool runs."""
    return [
        _pool(f"{prefix}-k3s2p1", op, (2, 3, 9, 9), kernel_shape=(3, 3), strides=(2, 2),
              pads=(1, 1, 1, 1), **extra),
        _pool(f"{prefix}-k2s2", op, (1, 4, 8, 6), kernel_shape=(2, 2), strides=(2, 2),
              **extra),
        _pool(f"{prefix}-k3s1-asym-pads", op, (1, 2, 7, 8), kernel_shape=(3, 2),
              pads=(0, 1, 2, 1), **extra),
        _pool(f"{prefix}-dilated-stride", op, (1, 2, 11, 10), kernel_shape=(2, 3),
              strides=(2, 1), dilations=(2, 2), **extra),
        _pool(f"{prefix}-ceil", op, (1, 2, 8, 8), kernel_shape=(3, 3), strides=(2, 2),
              ceil_mode=1, **extra),
        _pool(f"{prefix}-ceil-pads-stride3", op, (1, 2, 10, 11), kernel_shape=(3, 3),
              strides=(3, 3), pads=(1, 0, 1, 2), ceil_mode=1, **extra),
        _pool(f"{prefix}-same-upper", op, (1, 2, 7, 8), kernel_shape=(3, 2), strides=(2, 2),
              auto_pad="SAME_UPPER", **extra),
        _pool(f"{prefix}-same-lower", op, (1, 2, 7, 8), kernel_shape=(3, 3), strides=(2, 3),
              auto_pad="SAME_LOWER", **extra),
        _pool(f"{prefix}-valid", op, (1, 2, 7, 8), kernel_shape=(3, 3), strides=(2, 2),
              auto_pad="VALID", **extra),
        _pool(f"{prefix}-1d", op, (2, 3, 11), kernel_shape=(3,), strides=(2,), pads=(1, 1),
              **extra),
        _pool(f"{prefix}-3d", op, (1, 2, 5, 6, 7), kernel_shape=(2, 3, 2), strides=(2, 1, 2),
              pads=(0, 1, 1, 1, 0, 1), **extra),
        _pool(f"{prefix}-3d-ceil-dilated", op, (1, 2, 7, 6, 8), kernel_shape=(2, 2, 3),
              strides=(2, 2, 2), dilations=(1, 2, 1), pads=(1, 0, 0, 0, 1, 1), ceil_mode=1,
              **extra),
        _pool(f"{prefix}-f64", op, (1, 3, 6, 6), F64, kernel_shape=(3, 3), pads=(1, 1, 1, 1),
              **extra),
        _pool(f"{prefix}-f16", op, (1, 3, 6, 6), F16, kernel_shape=(2, 2), strides=(2, 2),
              **extra),
        _pool(f"{prefix}-empty-batch", op, (0, 3, 6, 6), kernel_shape=(2, 2), **extra),
        _pool(f"{prefix}-nc", op, (1, 6, 7, 7), kernel_shape=(3, 3), strides=(2, 2),
              view=lambda x: x[:, ::2], **extra),
    ]


CASES: list[OpCase] = [
    *_windowed("max-pool", Op.MAX_POOL),
    _pool("max-pool-storage-order1", Op.MAX_POOL, (2, 2, 7, 6), kernel_shape=(3, 2),
          strides=(2, 2), pads=(1, 0, 1, 1), storage_order=1),
    _pool("max-pool-storage-order1-3d", Op.MAX_POOL, (1, 2, 4, 5, 3), kernel_shape=(2, 2, 2),
          storage_order=1),
    _pool("max-pool-int8", Op.MAX_POOL, (1, 2, 7, 7), np.int8, kernel_shape=(3, 3),
          pads=(1, 1, 1, 1)),
    _pool("max-pool-uint8", Op.MAX_POOL, (1, 2, 6, 6), np.uint8, kernel_shape=(2, 2),
          strides=(2, 2)),
    _pool("max-pool-ties", Op.MAX_POOL, (1, 1, 6, 6), kernel_shape=(3, 3), strides=(1, 1),
          view=lambda x: np.round(x).astype(np.float32)),
    _pool("max-pool-resnet-stem", Op.MAX_POOL, (1, 8, 16, 16), kernel_shape=(3, 3),
          strides=(2, 2), pads=(1, 1, 1, 1)),
    *_windowed("avg-pool", Op.AVG_POOL),
    *_windowed("avg-pool-incl", Op.AVG_POOL, count_include_pad=1),
    *_windowed("lp-pool", Op.LP_POOL),
    _pool("lp-pool-p1", Op.LP_POOL, (1, 3, 6, 6), kernel_shape=(2, 2), p=1,
          pads=(1, 1, 0, 0)),
    _pool("lp-pool-p3", Op.LP_POOL, (1, 3, 6, 6), kernel_shape=(3, 3), strides=(2, 2), p=3),
    _pool("global-avg-pool-2d", Op.GLOBAL_AVG_POOL, (2, 3, 5, 6)),
    _pool("global-avg-pool-1d", Op.GLOBAL_AVG_POOL, (2, 3, 7)),
    _pool("global-avg-pool-3d-f64", Op.GLOBAL_AVG_POOL, (1, 2, 3, 4, 5), F64),
    _pool("global-avg-pool-f16", Op.GLOBAL_AVG_POOL, (1, 3, 8, 8), F16),
    _pool("global-avg-pool-empty-batch", Op.GLOBAL_AVG_POOL, (0, 3, 4, 4)),
    _pool("global-avg-pool-nc", Op.GLOBAL_AVG_POOL, (1, 6, 5, 5), view=lambda x: x[:, ::2]),
    _pool("global-max-pool-2d", Op.GLOBAL_MAX_POOL, (2, 3, 5, 6)),
    _pool("global-max-pool-3d-f64", Op.GLOBAL_MAX_POOL, (1, 2, 3, 4, 5), F64),
    _pool("global-max-pool-f16", Op.GLOBAL_MAX_POOL, (1, 3, 4, 4), F16),
    _pool("global-max-pool-nc", Op.GLOBAL_MAX_POOL, (1, 6, 5, 5), view=lambda x: x[:, ::2]),
]
