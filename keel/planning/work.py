"""How much arithmetic a node does, from its value types: what sizes program-level
decisions (the cpu planner's BLAS thread count, made at placement and kept by the
program that runs the plan)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["estimated_work"]

_PRODUCTS = frozenset({Op.MATMUL, Op.GEMM, Op.MATMUL_INTEGER, Op.QLINEAR_MATMUL})
_CONVOLUTIONS = frozenset({Op.CONV, Op.CONV_INTEGER, Op.QLINEAR_CONV, Op.CONV_TRANSPOSE,
                           Op.CONV2D})


def estimated_work(type_of: Callable[[str], TensorType | None], node: Any) -> float:
    """Rough multiply-adds of ``node`` (its output's elements for ops without a
    reduction), from the value types ``type_of`` gives: what sizes a backend's
    program scope, e.g. how much of a program runs on BLAS. 0.0 where the shapes
    are not known."""
    def dims(name: str) -> tuple[int, ...] | None:
        t = type_of(name) if name else None
        if t is None or t.shape is None or not all(isinstance(d, int) for d in t.shape):
            return None
        return tuple(int(d) for d in t.shape)  # type: ignore[arg-type]

    shape = dims(node.outputs[0]) if node.outputs else None
    if shape is None:
        return 0.0
    out = math.prod(shape)
    reduce = 1
    if node.op in _PRODUCTS and len(node.inputs) > 1:
        a = dims(node.inputs[0])
        if a:
            reduce = a[0] if node.op is Op.GEMM and node.attrs.get("trans_a") else a[-1]
    elif node.op in _CONVOLUTIONS and len(node.inputs) > 1:
        w = dims(node.inputs[1])
        if w and len(w) > 1:
            reduce = math.prod(w[1:])
    elif node.op is Op.ATTENTION and len(node.inputs) > 1:
        k = dims(node.inputs[1])
        if k and len(k) > 1:
            reduce = 2 * k[-2]                  # scores and the weighted sum over keys
    return float(out) * reduce
