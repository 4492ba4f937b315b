"""bfloat16 cases of the ops the gpu backend runs on its own kernels at ``precision="bf16"``:
GEMM-shaped products, attention, convolutions, pooling, LayerNorm and softmax, the
float16 cases' shapes again. (The elementwise and reduction families take bfloat16
through their dtype tables, in cases_elementwise.py and cases_reduction.py.)

The reference computes in float64 and rounds once; a bfloat16 kernel rounds its
inputs' products in float32 and may round an intermediate (a GEMM's output before
its epilogue, attention's scores) to bfloat16 too: a few bfloat16 steps (2**-7
relative each) of tolerance.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from keel.dtypes import DType
from keel.ops.registry import Op
from tests.conformance import cases_conv, cases_matmul, cases_normalization, cases_pooling
from tests.conformance import cases_skip_layer_norm as skip
from tests.conformance.cases_elementwise import Tolerance
from tests.conformance.harness import OpCase

BF16 = DType.BFLOAT16.numpy
_PRODUCT: Tolerance = {"rtol": 3e-2, "atol": 1e-1}      # sums of many rounded products
_ROW: Tolerance = {"rtol": 2e-2, "atol": 2e-2}          # one rounding of a float32 result


def _tol(case: OpCase, tol: Tolerance) -> OpCase:
    return dataclasses.replace(case, rtol=tol["rtol"], atol=tol["atol"])


def _conv(id: str, x: tuple[int, ...], w: tuple[int, ...], **attrs: Any) -> OpCase:
    m = w[0]
    return OpCase(id, Op.CONV, cases_conv._arrays(x, w, (m,), dtype=BF16), attrs, **_PRODUCT)


_P1 = (1, 1, 1, 1)

CASES: list[OpCase] = [
    _tol(cases_matmul._case("matmul-2d-bf16", Op.MATMUL, (4, 6), (6, 3), dtype=BF16), _PRODUCT),
    _tol(cases_matmul._case("matmul-batched-bf16", Op.MATMUL, (2, 3, 4, 6), (3, 6, 5),
                            dtype=BF16), _PRODUCT),
    _tol(cases_matmul._case("matmul-3d-2d-bf16", Op.MATMUL, (2, 4, 6), (6, 5), dtype=BF16),
         _PRODUCT),
    _tol(cases_matmul._case("gemm-bf16", Op.GEMM, (4, 3), (3, 5), (5,), dtype=BF16), _PRODUCT),
    _tol(cases_matmul._case("gemm-trans-b-bf16", Op.GEMM, (4, 3), (5, 3), (5,), dtype=BF16,
                            trans_b=1), _PRODUCT),
    _tol(cases_matmul._attention("attention-causal-bf16", (1, 2, 6, 8), (1, 2, 6, 8),
                                 (1, 2, 6, 8), dtype=BF16, is_causal=True), _PRODUCT),
    _tol(cases_matmul._attention("attention-bf16", (1, 1, 4, 8), (1, 1, 5, 8), (1, 1, 5, 8),
                                 dtype=BF16), _PRODUCT),
    _conv("conv-3x3-pad1-bf16", (1, 3, 7, 7), (4, 3, 3, 3), pads=_P1),
    _conv("conv-depthwise-bf16", (1, 4, 6, 6), (4, 1, 3, 3), pads=_P1, group=4),
    _conv("conv1d-bf16", (1, 3, 12), (4, 3, 3), pads=(1, 1)),
    *[_tol(cases_pooling._pool(f"{name}-bf16", op, (1, 3, 6, 6), BF16, kernel_shape=(2, 2),
                               strides=(2, 2)), _ROW)
      for name, op in (("max-pool", Op.MAX_POOL), ("avg-pool", Op.AVG_POOL))],
    _tol(cases_pooling._pool("global-avg-pool-bf16", Op.GLOBAL_AVG_POOL, (1, 3, 8, 8), BF16),
         _ROW),
    _tol(cases_pooling._pool("global-max-pool-bf16", Op.GLOBAL_MAX_POOL, (1, 3, 4, 4), BF16),
         _ROW),
    OpCase("layer_norm-last-bf16", Op.LAYER_NORM,
           cases_normalization._x((3, 5, 16), BF16, (16,), (16,)), **_ROW),
    OpCase("skip_layer_norm-last-bf16", Op.SKIP_LAYER_NORM,
           skip._inputs((3, 5, 16), (3, 5, 16), (16,), BF16), **_ROW),
    *[OpCase(f"{op.value}-bf16", op, cases_normalization._x((3, 4, 5), BF16), **_ROW)
      for op in (Op.SOFTMAX, Op.LOG_SOFTMAX)],
]
