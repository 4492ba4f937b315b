"""Conformance cases of keel's fused residual LayerNorm (``skip_layer_norm``).

float32, float64 and float16 over the last axis; a skip broadcast over leading
axes (a position embedding), over a middle axis and from a higher rank of ones;
a non-trailing axis, no bias, odd row lengths (every vector-width remainder of
the native row kernel), a mean far from zero, stash_type 11 and zero-size X.
Outputs Y and the sum S.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.cases_normalization import norm_tol
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

F16, F32, F64 = np.float16, np.float32, np.float64


def _inputs(x: Sequence[int], skip: Sequence[int], norm: Sequence[int], dtype: Any = F32,
            bias: bool = True, shift: float = 0.0) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        shapes = [x, skip, norm] + ([norm] if bias else [])
        arrays = [rng.standard_normal(tuple(s)).astype(dtype) for s in shapes]
        arrays[0] = (arrays[0] + shift).astype(dtype)
        return list(arrays)
    return make


def _cases() -> list[OpCase]:
    op = Op.SKIP_LAYER_NORM
    cases = [OpCase(f"skip_layer_norm-last-{np.dtype(dt).name}", op,
                    _inputs((3, 5, 16), (3, 5, 16), (16,), dt), **norm_tol(dt))
             for dt in (F32, F64, F16)]
    cases += [OpCase(f"skip_layer_norm-row{k}", op, _inputs((4, k), (4, k), (k,)), **norm_tol(F32))
              for k in (1, 7, 17, 33, 100)]
    cases += [
        OpCase("skip_layer_norm-position-skip", op, _inputs((2, 6, 24), (6, 24), (24,)),
               **norm_tol(F32)),
        OpCase("skip_layer_norm-middle-broadcast", op, _inputs((2, 6, 24), (2, 1, 24), (24,)),
               **norm_tol(F32)),
        OpCase("skip_layer_norm-higher-rank-skip", op,
               _inputs((2, 6, 8), (1, 1, 2, 6, 8), (8,)), **norm_tol(F32)),
        OpCase("skip_layer_norm-axis1", op, _inputs((3, 4, 5), (3, 4, 5), (4, 5)), {"axis": 1},
               **norm_tol(F32)),
        OpCase("skip_layer_norm-no-bias", op, _inputs((2, 8), (2, 8), (8,), bias=False),
               **norm_tol(F32)),
        OpCase("skip_layer_norm-shifted", op, _inputs((4, 32), (4, 32), (32,), shift=50.0),
               {"epsilon": 1e-3}, **norm_tol(F32)),
        OpCase("skip_layer_norm-stash11", op, _inputs((2, 6), (2, 6), (6,)),
               {"stash_type": 11}, **norm_tol(F32)),
        OpCase("skip_layer_norm-empty", op, _inputs((0, 6), (0, 6), (6,)), **norm_tol(F32)),
    ]
    return cases


CASES: list[OpCase] = _cases()
