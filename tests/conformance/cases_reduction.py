"""Conformance cases of the reduction family.

Every op gets one case per dtype it accepts, then the ways of naming axes
(attribute, input 1, negative, the ``axis`` alias, none, an empty list with
and without ``noop_with_empty_axes``), ``keepdims`` both ways, reductions over
an empty extent (``*-empty``: where ONNX defines 0, 1, ±inf, …), non-contiguous
input (``*-nc``) and rank 0 (``*-scalar``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schemas.elementwise import DTYPES
from tests.conformance.cases_elementwise import SPECIAL, Tolerance, rand, tolerance
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

# Value ranges that keep each reduction finite and away from cancellation.
_DOMAIN: dict[Op, tuple[float, float]] = {
    Op.REDUCE_PROD: (0.5, 1.5), Op.CUMPROD: (0.5, 1.5), Op.REDUCE_LOG_SUM: (0.1, 2.0),
    Op.REDUCE_LOG_SUM_EXP: (-5.0, 5.0),
}
_INT_DOMAIN: dict[Op, tuple[float, float]] = {
    Op.REDUCE_PROD: (-2.0, 2.0), Op.CUMPROD: (-2.0, 2.0),
}


def _values(op: Op, dtype: Any) -> tuple[float, float]:
    dt = np.dtype(dtype)
    if dt.kind == "u":
        return (0.0, 3.0) if op in _INT_DOMAIN else (0.0, 200.0)
    if dt.kind == "i":
        return _INT_DOMAIN.get(op, (-100.0, 100.0))
    return _DOMAIN.get(op, (-3.0, 3.0))


def _tol(dtype: Any) -> Tolerance:
    # Sums reorder additions: allow for cancellation near zero.
    tol = tolerance(dtype)
    return {"rtol": tol["rtol"], "atol": max(tol["atol"], 10 * tol["rtol"])}


def tensor(op: Op, shape: Sequence[int], dtype: Any = np.float32, *extra: np.ndarray | None,
           view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    """One random input for ``op`` (seen through ``view``), then fixed extra inputs."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rand(rng, shape, dtype, *_values(op, dtype))
        return [x if view is None else view(x), *extra]
    return make


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _by_dtype(op: Op, shape: Sequence[int], attrs: dict[str, Any]) -> list[OpCase]:
    return [OpCase(f"{op.value}-{dt.value}", op, tensor(op, shape, dt.numpy), attrs,
                   **_tol(dt.numpy))
            for dt in sorted(DTYPES[op], key=lambda d: d.value)]


def _axes_cases(op: Op) -> list[OpCase]:
    name = op.value
    main = np.bool_ if DType.FLOAT32 not in DTYPES[op] else np.float32
    cases = _by_dtype(op, (3, 4, 5), {"axes": (1,)})
    cases += [
        OpCase(f"{name}-all", op, tensor(op, (3, 4, 5)), **_tol(main)),
        OpCase(f"{name}-all-flat", op, tensor(op, (1000,)), {"keepdims": False}, **_tol(main)),
        OpCase(f"{name}-axes-input", op, tensor(op, (3, 4, 5), main, i64(0, 2)),
               {"keepdims": False}, **_tol(main)),
        OpCase(f"{name}-axes-neg", op, tensor(op, (3, 4, 5)), {"axes": (-1, 0)}, **_tol(main)),
        OpCase(f"{name}-axis-alias", op, tensor(op, (3, 4, 5)), {"axis": 2, "keepdims": False},
               **_tol(main)),
        OpCase(f"{name}-axes-empty-input", op, tensor(op, (3, 4), main, i64()), **_tol(main)),
        OpCase(f"{name}-noop", op, tensor(op, (3, 4)), {"noop_with_empty_axes": True},
               **_tol(main)),
        OpCase(f"{name}-noop-empty-input", op, tensor(op, (3, 4), main, i64()),
               {"noop_with_empty_axes": True}, **_tol(main)),
        OpCase(f"{name}-empty", op, tensor(op, (0, 3)), {"axes": (0,)}, **_tol(main)),
        OpCase(f"{name}-empty-all", op, tensor(op, (2, 0, 3)), {"keepdims": False},
               **_tol(main)),
        OpCase(f"{name}-empty-kept", op, tensor(op, (0, 3)), {"axes": (1,)}, **_tol(main)),
        OpCase(f"{name}-nc", op, tensor(op, (5, 4, 3), view=lambda x: x.transpose(2, 0, 1)),
               {"axes": (0, 2), "keepdims": False}, **_tol(main)),
        OpCase(f"{name}-scalar", op, tensor(op, ()), **_tol(main)),
    ]
    if main is np.float32:
        cases.append(OpCase(f"{name}-special", op,
                            lambda rng: [SPECIAL.reshape(3, 5).copy()], {"axes": (1,)}))
    return cases


def _whole_cases(op: Op) -> list[OpCase]:
    name = op.value
    return [*_by_dtype(op, (3, 4), {}),
            OpCase(f"{name}-long", op, tensor(op, (4096,)), **_tol(np.float32)),
            OpCase(f"{name}-f16-long", op, tensor(op, (2000,), np.float16), **_tol(np.float16)),
            OpCase(f"{name}-empty", op, tensor(op, (0, 3))),
            OpCase(f"{name}-empty-int", op, tensor(op, (0,), np.int32)),
            OpCase(f"{name}-scalar", op, tensor(op, ())),
            OpCase(f"{name}-nc", op, tensor(op, (6, 5), view=lambda x: x[::2].T))]


def _arg_cases(op: Op) -> list[OpCase]:
    name = op.value

    def ties(shape: Sequence[int], dtype: Any = np.float32,
             view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
        def make(rng: Gen) -> list[np.ndarray | None]:
            x = rand(rng, shape, dtype, 0.0, 3.0)        # few distinct values: many ties
            x = np.round(x) if x.dtype.kind == "f" else x
            return [x if view is None else view(x)]
        return make
    cases = [OpCase(f"{name}-{dt.value}", op, ties((4, 5), dt.numpy), {"axis": 1})
             for dt in sorted(DTYPES[op], key=lambda d: d.value)]
    return [*cases,
            OpCase(f"{name}-axis0", op, ties((4, 5))),
            OpCase(f"{name}-last", op, ties((4, 5)), {"axis": 1, "select_last_index": True}),
            OpCase(f"{name}-flat", op, ties((4, 5)), {"axis": -1, "keepdims": False}),
            OpCase(f"{name}-last-flat", op, ties((3, 4, 5)),
                   {"axis": 1, "keepdims": False, "select_last_index": True}),
            OpCase(f"{name}-empty-other", op, ties((0, 5)), {"axis": 1}),
            OpCase(f"{name}-nc", op, ties((5, 4), view=lambda x: x.T), {"axis": 1}),
            OpCase(f"{name}-nan", op, lambda rng: [SPECIAL.reshape(3, 5).copy()], {"axis": 1})]


def _cumulative_cases(op: Op) -> list[OpCase]:
    name = op.value
    axis1 = np.array(1, np.int64)
    cases = [OpCase(f"{name}-{dt.value}", op, tensor(op, (3, 6), dt.numpy, axis1),
                    **_tol(dt.numpy))
             for dt in sorted(DTYPES[op], key=lambda d: d.value)]
    for exclusive in (False, True):
        for reverse in (False, True):
            tag = f"{name}-ex{int(exclusive)}-rev{int(reverse)}"
            attrs = {"exclusive": exclusive, "reverse": reverse}
            cases += [OpCase(tag, op, tensor(op, (3, 6), np.float32, axis1), attrs,
                             **_tol(np.float32)),
                      OpCase(f"{tag}-int64", op, tensor(op, (3, 6), np.int64,
                                                        np.array([0], np.int32)), attrs)]
    return [*cases,
            OpCase(f"{name}-axis-attr", op, tensor(op, (4, 5)), {"axis": -2}, **_tol(np.float32)),
            OpCase(f"{name}-long", op, tensor(op, (2, 300)), {"axis": 1}, rtol=1e-4, atol=1e-4),
            OpCase(f"{name}-empty", op, tensor(op, (0, 4)), {"axis": 0, "exclusive": True}),
            OpCase(f"{name}-empty-other", op, tensor(op, (3, 0)), {"axis": 0}),
            OpCase(f"{name}-scalar", op, tensor(op, ()), {"axis": 0}),
            OpCase(f"{name}-nc", op, tensor(op, (6, 3), view=lambda x: x.T),
                   {"axis": 1, "reverse": True}, **_tol(np.float32))]


CASES: list[OpCase] = []
for _op in (Op.SUM, Op.MEAN, Op.REDUCE_MAX, Op.REDUCE_MIN, Op.REDUCE_PROD, Op.REDUCE_L1,
            Op.REDUCE_L2, Op.REDUCE_LOG_SUM, Op.REDUCE_LOG_SUM_EXP, Op.REDUCE_SUM_SQUARE):
    CASES += _axes_cases(_op)
for _op in (Op.SUM_ALL, Op.MEAN_ALL):
    CASES += _whole_cases(_op)
for _op in (Op.ARGMAX, Op.ARGMIN):
    CASES += _arg_cases(_op)
for _op in (Op.CUMSUM, Op.CUMPROD):
    CASES += _cumulative_cases(_op)
