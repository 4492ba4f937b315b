"""Conformance cases of the memory family: ``copy``, ``identity``, ``fill``, ``cast``.

``fill`` runs without an output buffer here (the runner lets the backend
allocate), so every case names its output ``shape``. ``cast`` covers every
pair of dtypes with values each target can hold, plus float → int
truncation and → bool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.ops.registry import Op
from tests.conformance.cases_elementwise import SPECIAL, rand
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

VALUE_DTYPES = sorted((d for d in DType if d is not DType.STRING), key=lambda d: d.value)


def tensor(shape: Sequence[int], dtype: Any = np.float32,
           view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        dt = np.dtype(dtype)
        x = rand(rng, shape, dt, 0.0 if dt.kind == "u" else -100.0, 100.0)
        return [x if view is None else view(x)]
    return make


def _passthrough(op: Op) -> list[OpCase]:
    name = op.value
    return [*(OpCase(f"{name}-{dt.value}", op, tensor((3, 4), dt.numpy))
              for dt in VALUE_DTYPES),
            OpCase(f"{name}-empty", op, tensor((0, 4))),
            OpCase(f"{name}-scalar", op, tensor(())),
            OpCase(f"{name}-nc", op, tensor((4, 6), view=lambda x: x[:, ::2].T)),
            OpCase(f"{name}-special", op, lambda rng: [SPECIAL.copy()])]


def _fill_cases() -> list[OpCase]:
    def value(dtype: Any, *rest: float) -> Make:
        return lambda rng: [np.array([rng.uniform(-50, 50), *rest], dtype=dtype)]
    return [
        OpCase("fill-f32", Op.FILL, value(np.float32, 0.0, 0.0, 0.0), {"shape": (2, 3)}),
        OpCase("fill-padding-ignored", Op.FILL, value(np.float64, 7.0, 8.0), {"shape": (5,)}),
        OpCase("fill-dtype-int32", Op.FILL, value(np.float32), {"shape": (2, 2),
                                                                "dtype": "int32"}),
        OpCase("fill-int64", Op.FILL, lambda rng: [np.array([[-3, 9]], np.int64)],
               {"shape": (4, 1, 2)}),
        OpCase("fill-bool", Op.FILL, lambda rng: [np.array([True])], {"shape": (3,)}),
        OpCase("fill-scalar-value", Op.FILL, lambda rng: [np.array(2.5, np.float16)],
               {"shape": (2, 2)}),
        OpCase("fill-scalar-out", Op.FILL, value(np.float32), {"shape": ()}),
        OpCase("fill-empty-out", Op.FILL, value(np.float32), {"shape": (0, 3)}),
        OpCase("fill-nc-value", Op.FILL, tensor((4, 3), view=lambda x: x.T), {"shape": (3, 3)}),
        OpCase("fill-nan", Op.FILL, lambda rng: [np.array([np.nan, 1.0], np.float32)],
               {"shape": (2,)}),
    ]


def _cast_source(src: DType, dst: DType) -> Make:
    """Values both ``src`` and ``dst`` hold: fractions only when src is float."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        unsigned = DType.BOOL in (src, dst) or any(d.value.startswith("u") for d in (src, dst))
        low = 0.0 if unsigned else -100.0
        high = 1.0 if DType.BOOL in (src, dst) else 100.0
        values: np.ndarray
        if src.is_float:
            values = rng.uniform(low, high, (3, 4))
            values[0, :2] = 0.0                     # exact zeros: -> bool False
        else:
            values = rng.integers(int(low), int(high), (3, 4), endpoint=True)
        return [np.asarray(values).astype(src.numpy)]
    return make


def _cast_cases() -> list[OpCase]:
    cases = [OpCase(f"cast-{src.value}-{dst.value}", Op.CAST, _cast_source(src, dst),
                    {"to": dst.value})
             for src in VALUE_DTYPES for dst in VALUE_DTYPES]
    return [*cases,
            OpCase("cast-truncate", Op.CAST,
                   lambda rng: [np.array([-2.7, -1.5, -0.5, 0.5, 1.5, 2.7], np.float32)],
                   {"to": "int32"}),
            OpCase("cast-special-bool", Op.CAST, lambda rng: [SPECIAL.copy()], {"to": "bool"}),
            OpCase("cast-special-f16", Op.CAST, lambda rng: [SPECIAL.astype(np.float64) * 1e3],
                   {"to": "float16"}),
            OpCase("cast-empty", Op.CAST, tensor((0, 3)), {"to": "int64"}),
            OpCase("cast-scalar", Op.CAST, tensor(()), {"to": "float64"}),
            OpCase("cast-nc", Op.CAST, tensor((4, 6), view=lambda x: x[:, ::2].T),
                   {"to": "int16"}),
            *_narrow_cast_cases()]


# Beyond every float8 range, infinities, NaN, signed zeros, ties and tiny values.
_EDGES = np.array([0.0, -0.0, 1.0, -1.5, 0.3, 240.0, 448.0, 500.0, -1e5, 57344.0, 7e4,
                   np.inf, -np.inf, np.nan, 1e-9, 3.0e-3, 2.0 ** 127, 3.0e38], np.float32)


def _narrow_cast_cases() -> list[OpCase]:
    """Saturation on and off for every float8 type, float8e8m0's three rounding modes."""
    f8 = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    edges: Make = lambda rng: [_EDGES.copy()]          # noqa: E731
    scaled: Make = lambda rng: [(_EDGES * rng.uniform(0.5, 2.0)).astype(np.float16)]  # noqa: E731
    return [*(OpCase(f"cast-edges-{to}-saturate{int(sat)}", Op.CAST, make,
                     {"to": to, "saturate": sat})
              for to in f8 for sat in (True, False) for make in (edges,)),
            *(OpCase(f"cast-edges-f16-{to}-saturate{int(sat)}", Op.CAST, scaled,
                     {"to": to, "saturate": sat}) for to in f8 for sat in (True, False)),
            *(OpCase(f"cast-edges-float8_e8m0fnu-{mode}-saturate{int(sat)}", Op.CAST, edges,
                     {"to": "float8_e8m0fnu", "round_mode": mode, "saturate": sat})
              for mode in ("up", "down", "nearest") for sat in (True, False)),
            OpCase("cast-edges-bfloat16", Op.CAST, edges, {"to": "bfloat16"}),
            OpCase("cast-edges-float4_e2m1fn", Op.CAST, edges, {"to": "float4_e2m1fn"}),
            OpCase("cast-edges-int4", Op.CAST,
                   lambda rng: [np.array([-9.5, -8, -2.7, -0.5, 0.5, 2.5, 7, 7.9, 20], np.float32)],
                   {"to": "int4"})]


CASES: list[OpCase] = [*_passthrough(Op.COPY), *_passthrough(Op.IDENTITY), *_fill_cases(),
                       *_cast_cases()]
