"""Conformance cases of the loss family: NLL and softmax cross-entropy.

Every reduction (none, sum, mean) with and without class weights and
``ignore_index`` (a positive one and a negative one), over ranks 2 to 5, in
float32, float64 and float16, with int32 and int64 targets; zero-size batches
(``*-empty``) and a non-contiguous input view (``*-view``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

_OPS = (Op.NEGATIVE_LOG_LIKELIHOOD_LOSS, Op.SOFTMAX_CROSS_ENTROPY_LOSS)
_SHORT = {Op.NEGATIVE_LOG_LIKELIHOOD_LOSS: "nll", Op.SOFTMAX_CROSS_ENTROPY_LOSS: "sce"}


def _tol(dtype: Any) -> dict[str, Any]:
    dt = np.dtype(dtype)
    if dt == np.float16:
        return {"rtol": 5e-3, "atol": 5e-3}
    if dt == np.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    return {"rtol": 1e-5, "atol": 1e-5}


def _inputs(shape: Sequence[int], dtype: Any = np.float32, weight: bool = False,
            ignore: int | None = None, tdtype: Any = np.int64, transpose: bool = False) -> Make:
    """Scores of ``shape`` (N, C, ...), targets in [0, C) (some set to ``ignore``), weights."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        n, c, rest = shape[0], shape[1], tuple(shape[2:])
        x = rng.standard_normal(tuple(shape)) * 2
        if transpose:    # the same values seen through a non-contiguous view
            x = np.ascontiguousarray(np.swapaxes(x, 0, 1)).swapaxes(0, 1)
        target = rng.integers(0, c, (n, *rest))
        if ignore is not None and target.size:
            target.reshape(-1)[::3] = ignore
        out: list[np.ndarray | None] = [x.astype(dtype), target.astype(tdtype)]
        if weight:
            out.append((rng.random(c) + 0.25).astype(dtype))
        return out
    return make


def _reduction_cases(op: Op) -> list[OpCase]:
    s = _SHORT[op]
    cases = []
    for reduction in ("none", "sum", "mean"):
        for weight in (False, True):
            for ignore in (None, 1, -5):
                tag = f"{s}-{reduction}{'-w' if weight else ''}" \
                      f"{'' if ignore is None else f'-ii{ignore}'}"
                attrs: dict[str, Any] = {"reduction": reduction}
                if ignore is not None:
                    attrs["ignore_index"] = ignore
                cases.append(OpCase(tag, op, _inputs((3, 5, 4), np.float32, weight, ignore),
                                    attrs, **_tol(np.float32)))
    return cases


def _shape_and_dtype_cases(op: Op) -> list[OpCase]:
    s = _SHORT[op]
    cases = [OpCase(f"{s}-{np.dtype(dt).name}", op, _inputs((4, 6, 3), dt, True, 2),
                    {"reduction": "mean", "ignore_index": 2}, **_tol(dt))
             for dt in (np.float32, np.float64, np.float16)]
    cases += [
        OpCase(f"{s}-nc", op, _inputs((6, 4), np.float32, True), {"reduction": "sum"}),
        OpCase(f"{s}-5d", op, _inputs((2, 3, 2, 3, 2), np.float32, False, 0),
               {"reduction": "none", "ignore_index": 0}),
        OpCase(f"{s}-int32-target", op, _inputs((3, 4, 5), np.float32, True, tdtype=np.int32),
               {"reduction": "mean"}),
        OpCase(f"{s}-empty", op, _inputs((0, 4, 3), np.float32, True), {"reduction": "none"}),
        OpCase(f"{s}-empty-sum", op, _inputs((0, 4), np.float32), {"reduction": "sum"}),
        OpCase(f"{s}-view", op, _inputs((3, 5, 2), np.float32, True, transpose=True),
               {"reduction": "mean"}),
    ]
    return cases


CASES: list[OpCase] = [case for op in _OPS
                       for case in _reduction_cases(op) + _shape_and_dtype_cases(op)]
