"""Conformance cases of the numeric family: bitcast (every width, bool, scalars,
zero-size) and det (batched, 1 x 1, 0 x 0, singular, float16/float64)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Make = Callable[[np.random.Generator], list[np.ndarray | None]]


def _bits(shape: tuple[int, ...], dtype: str) -> Make:
    def make(rng: np.random.Generator) -> list[np.ndarray | None]:
        raw = rng.integers(0, 256, (*shape, np.dtype(dtype).itemsize), dtype=np.uint8)
        data = raw.view(dtype).reshape(shape)
        if np.dtype(dtype).kind == "f":
            data = np.where(np.isfinite(data), data, 1.5).astype(dtype)
        return [data]
    return make


_PAIRS = [("float32", DType.INT32), ("int32", DType.FLOAT32), ("float64", DType.UINT64),
          ("int64", DType.FLOAT64), ("float16", DType.INT16), ("uint16", DType.FLOAT16),
          ("int8", DType.UINT8), ("uint8", DType.BOOL)]


def _bitcast_cases() -> list[OpCase]:
    cases = [OpCase(f"bitcast-{src}-{dst.value}", Op.BITCAST, _bits((3, 4), src),
                    {"to": dst}) for src, dst in _PAIRS if src != "uint8"]
    cases += [
        OpCase("bitcast-bool-uint8", Op.BITCAST,
               lambda rng: [rng.random((2, 5)) > 0.5], {"to": DType.UINT8}),
        OpCase("bitcast-scalar", Op.BITCAST, lambda rng: [np.array(1.25, np.float32)],
               {"to": DType.UINT32}),
        OpCase("bitcast-empty", Op.BITCAST, lambda rng: [np.zeros((0, 3), np.int16)],
               {"to": DType.UINT16}),
    ]
    return cases


def _det_cases() -> list[OpCase]:
    def mats(shape: tuple[int, ...], dtype: Any = np.float32) -> Make:
        return lambda rng: [rng.standard_normal(shape).astype(dtype)]

    def singular(rng: np.random.Generator) -> list[np.ndarray | None]:
        m = rng.standard_normal((2, 3, 3))
        m[:, 2] = m[:, 0] + m[:, 1]
        return [m.astype(np.float64)]
    return [
        OpCase("det-2d", Op.DET, mats((4, 4)), rtol=1e-4, atol=1e-5),
        OpCase("det-batched", Op.DET, mats((2, 3, 5, 5)), rtol=1e-4, atol=1e-5),
        OpCase("det-1x1", Op.DET, mats((3, 1, 1))),
        OpCase("det-0x0", Op.DET, mats((2, 0, 0))),
        OpCase("det-singular-f64", Op.DET, singular, rtol=1e-9, atol=1e-9),
        OpCase("det-f16", Op.DET, mats((3, 3), np.float16), rtol=1e-2, atol=1e-2),
        OpCase("det-empty-batch", Op.DET, mats((0, 3, 3))),
    ]


CASES: list[OpCase] = _bitcast_cases() + _det_cases()
