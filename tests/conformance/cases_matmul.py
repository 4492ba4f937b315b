"""Conformance cases of the matmul family: matmul, dot, gemm, einsum, matmul_integer,
attention.

They cover NumPy matmul broadcasting and the 1-D promotions, every fused
activation on matmul and gemm, gemm's transposes, alpha/beta and the shapes C
may take, einsum equations that are and are not one batched GEMM (traces,
diagonals, ellipses, three operands), integer matmuls with per-tensor, per-row
and per-column zero points, attention with additive (per head, or BERT's per-batch
padding), boolean and causal masks, more heads than one block of the cpu kernel,
broadcast K/V, zero-size and non-contiguous inputs, and float16/32/64 plus integer dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

F16, F32, F64 = np.float16, np.float32, np.float64
_TOL: dict[Any, dict[str, float]] = {
    F16: {"rtol": 5e-3, "atol": 2e-2},
    DType.BFLOAT16.numpy: {"rtol": 3e-2, "atol": 1e-1},      # cases_bf16.py
    F32: {"rtol": 1e-5, "atol": 1e-5},
    F64: {"rtol": 1e-10, "atol": 1e-10},
}


def _arrays(*shapes: Sequence[int] | None, dtype: Any = F32,
            views: Sequence[Callable[[np.ndarray], np.ndarray] | None] = ()) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        out: list[np.ndarray | None] = []
        for i, s in enumerate(shapes):
            if s is None:
                out.append(None)
                continue
            if np.dtype(dtype).kind in "iu":
                a = rng.integers(-20, 20, size=tuple(s)).astype(dtype)
            else:
                a = rng.standard_normal(tuple(s)).astype(dtype)
            view = views[i] if i < len(views) else None
            out.append(a if view is None else view(a))
        return out
    return make


def _case(id: str, op: Op, *shapes: Sequence[int] | None, dtype: Any = F32,
          views: Sequence[Callable[[np.ndarray], np.ndarray] | None] = (),
          tol: dict[str, float] | None = None, **attrs: Any) -> OpCase:
    tol = tol or _TOL.get(dtype, {"rtol": 0.0, "atol": 0.0})
    return OpCase(id, op, _arrays(*shapes, dtype=dtype, views=views), attrs, **tol)


def _t(a: np.ndarray) -> np.ndarray:
    """A transposed (Fortran-ordered) view of the same values."""
    return np.ascontiguousarray(a.swapaxes(-1, -2)).swapaxes(-1, -2)


def _strided(a: np.ndarray) -> np.ndarray:
    """The same values every other element of a buffer twice as wide."""
    wide = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), dtype=a.dtype)
    wide[..., ::2] = a
    return wide[..., ::2]


_ACTIVATIONS: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("relu", ()), ("leaky_relu", (0.2,)), ("sigmoid", ()), ("tanh", ()), ("clip", (-1.0, 1.0)),
    ("hard_sigmoid", ()), ("hard_swish", ()), ("gelu", ()), ("gelu_tanh", ()), ("silu", ()),
)

CASES: list[OpCase] = [
    # ---- matmul ----
    _case("matmul-2d-f32", Op.MATMUL, (5, 7), (7, 3)),
    _case("matmul-2d-f64", Op.MATMUL, (5, 7), (7, 3), dtype=F64),
    _case("matmul-2d-f16", Op.MATMUL, (4, 6), (6, 3), dtype=F16),
    _case("matmul-1d-1d", Op.MATMUL, (6,), (6,)),
    _case("matmul-1d-2d", Op.MATMUL, (6,), (6, 4)),
    _case("matmul-2d-1d", Op.MATMUL, (3, 6), (6,)),
    _case("matmul-1d-batched", Op.MATMUL, (6,), (2, 6, 4)),
    _case("matmul-batched-broadcast", Op.MATMUL, (2, 1, 3, 4), (5, 4, 6)),
    _case("matmul-batched-same", Op.MATMUL, (3, 4, 5), (3, 5, 2)),
    _case("matmul-bias-row", Op.MATMUL, (4, 5), (5, 3), (3,)),
    _case("matmul-bias-full-batched", Op.MATMUL, (2, 4, 5), (5, 3), (2, 4, 3)),
    *[_case(f"matmul-act-{name}", Op.MATMUL, (4, 8), (8, 6), (6,), activation=name,
            activation_params=params) for name, params in _ACTIVATIONS],
    _case("matmul-act-gelu-f64", Op.MATMUL, (4, 8), (8, 6), dtype=F64, activation="gelu",
          tol={"rtol": 1e-6, "atol": 1e-6}),
    _case("matmul-int32", Op.MATMUL, (3, 4), (4, 5), dtype=np.int32),
    _case("matmul-int64-batched", Op.MATMUL, (2, 3, 4), (4, 2), dtype=np.int64),
    _case("matmul-int32-relu-bias", Op.MATMUL, (3, 4), (4, 5), (5,), dtype=np.int32,
          activation="relu"),
    _case("matmul-empty-rows", Op.MATMUL, (0, 4), (4, 3)),
    _case("matmul-empty-inner", Op.MATMUL, (3, 0), (0, 2)),
    _case("matmul-nc-transposed", Op.MATMUL, (5, 7), (7, 3), views=(_t, _t)),
    _case("matmul-nc-strided", Op.MATMUL, (4, 5), (5, 3), views=(_strided,)),
    _case("matmul-3d-2d-bias-gelu", Op.MATMUL, (3, 20, 16), (16, 12), (12,), activation="gelu"),
    _case("matmul-4d-2d-nc", Op.MATMUL, (2, 3, 4, 16), (16, 5), views=(_t,)),
    # ---- dot ----
    _case("dot-1d-1d", Op.DOT, (7,), (7,)),
    _case("dot-2d-2d", Op.DOT, (3, 4), (4, 5)),
    _case("dot-nd-1d", Op.DOT, (2, 3, 4), (4,)),
    _case("dot-nd-md", Op.DOT, (2, 3, 4), (5, 4, 2)),
    _case("dot-scalar", Op.DOT, (), (3, 2)),
    _case("dot-1d-f64", Op.DOT, (9,), (9,), dtype=F64),
    _case("dot-1d-f16", Op.DOT, (5,), (5,), dtype=F16),
    _case("dot-int64", Op.DOT, (4,), (4,), dtype=np.int64),
    _case("dot-empty", Op.DOT, (0,), (0,)),
    # ---- gemm ----
    _case("gemm-plain", Op.GEMM, (4, 3), (3, 5)),
    _case("gemm-trans-both-alpha-beta", Op.GEMM, (3, 4), (5, 3), (5,), alpha=0.5, beta=2.0,
          trans_a=1, trans_b=1),
    _case("gemm-trans-a", Op.GEMM, (3, 4), (3, 5), (4, 5), trans_a=1),
    _case("gemm-c-column", Op.GEMM, (4, 3), (3, 5), (4, 1), beta=-1.0),
    _case("gemm-c-scalar", Op.GEMM, (4, 3), (3, 5), (), beta=0.5),
    _case("gemm-beta-zero", Op.GEMM, (4, 3), (3, 5), (5,), beta=0.0),
    _case("gemm-f64", Op.GEMM, (4, 3), (5, 3), (5,), dtype=F64, trans_b=1, alpha=1.5),
    _case("gemm-f16", Op.GEMM, (4, 3), (3, 5), (5,), dtype=F16),
    _case("gemm-int32", Op.GEMM, (4, 3), (3, 5), (5,), dtype=np.int32, alpha=2.0, beta=3.0),
    *[_case(f"gemm-act-{name}", Op.GEMM, (4, 8), (6, 8), (6,), trans_b=1, activation=name,
            activation_params=params) for name, params in _ACTIVATIONS[:4]],
    _case("gemm-empty", Op.GEMM, (0, 3), (3, 5), (5,)),
    _case("gemm-nc", Op.GEMM, (4, 6), (6, 5), views=(_t, _strided)),
    _case("gemm-one-row-trans-b", Op.GEMM, (1, 30), (20, 30), (20,), trans_b=1,
          activation="relu"),
]

_EINSUM: tuple[tuple[str, str, tuple[tuple[int, ...], ...]], ...] = (
    ("matmul", "ij,jk->ik", ((3, 4), (4, 5))),
    ("batched", "bij,bjk->bik", ((2, 3, 4), (2, 4, 5))),
    ("attention-scores", "bhsd,bhtd->bhst", ((1, 2, 3, 4), (1, 2, 5, 4))),
    ("transpose-out", "ab,bc->ca", ((2, 3), (3, 4))),
    ("contract-two", "ijk,ikl->jl", ((2, 3, 4), (2, 4, 5))),
    ("broadcast-batch", "bi,bi->b", ((3, 4), (1, 4))),
    ("outer", "i,j->ij", ((3,), (4,))),
    ("full-sum", "ij,ij->", ((3, 4), (3, 4))),
    ("private-sum", "abc,b->ac", ((2, 3, 4), (3,))),
    ("trace", "ii", ((4, 4),)),
    ("diagonal", "ii->i", ((4, 4),)),
    ("sum-axis", "ijk->ik", ((2, 3, 4),)),
    ("permute", "ijk->kij", ((2, 3, 4),)),
    ("implicit", "ij,jk", ((3, 4), (4, 2))),
    ("ellipsis", "...ij,...jk->...ik", ((2, 3, 4), (4, 5))),
    ("ellipsis-implicit", "...ij,...jk", ((2, 2, 3, 4), (2, 1, 4, 5))),
    ("three-operands", "ab,bc,cd->ad", ((2, 3), (3, 4), (4, 5))),
    ("repeated-in-operand", "iij,jk->ik", ((3, 3, 4), (4, 2))),
)

CASES += [_case(f"einsum-{name}", Op.EINSUM, *shapes, equation=eq)
          for name, eq, shapes in _EINSUM]
CASES += [
    _case("einsum-batched-f64", Op.EINSUM, (2, 3, 4), (2, 4, 5), dtype=F64,
          equation="bij,bjk->bik"),
    _case("einsum-matmul-f16", Op.EINSUM, (3, 4), (4, 5), dtype=F16, equation="ij,jk->ik"),
    _case("einsum-int32", Op.EINSUM, (3, 4), (4, 5), dtype=np.int32, equation="ij,jk->ik"),
    _case("einsum-empty", Op.EINSUM, (0, 4), (4, 5), equation="ij,jk->ik"),
    _case("einsum-nc", Op.EINSUM, (3, 4), (4, 5), views=(_t,), equation="ij,jk->ik"),
]


def _matmul_integer(id: str, a: tuple[int, ...], b: tuple[int, ...], a_type: Any, b_type: Any,
                    a_zp: tuple[int, ...] | None, b_zp: tuple[int, ...] | None) -> OpCase:
    def make(rng: Gen) -> list[np.ndarray | None]:
        def draw(shape: Sequence[int], dtype: Any) -> np.ndarray:
            info = np.iinfo(dtype)
            return rng.integers(info.min, info.max, size=tuple(shape), endpoint=True,
                                dtype=dtype)
        out: list[np.ndarray | None] = [draw(a, a_type), draw(b, b_type)]
        if a_zp is not None or b_zp is not None:
            out.append(None if a_zp is None else draw(a_zp, a_type))
        if b_zp is not None:
            out.append(draw(b_zp, b_type))
        return out
    return OpCase(id, Op.MATMUL_INTEGER, make)


CASES += [
    _matmul_integer("matmul-integer-u8-u8", (4, 6), (6, 3), np.uint8, np.uint8, (), ()),
    _matmul_integer("matmul-integer-u8-i8-per-row-col", (4, 6), (6, 3), np.uint8, np.int8,
                    (4,), (3,)),
    _matmul_integer("matmul-integer-i8-no-zero-points", (2, 3, 5), (5, 4), np.int8, np.int8,
                    None, None),
    _matmul_integer("matmul-integer-b-zero-point-only", (3, 5), (5, 2), np.int8, np.uint8,
                    None, (1,)),
    _matmul_integer("matmul-integer-deep", (2, 600), (600, 3), np.uint8, np.uint8, (), ()),
    _matmul_integer("matmul-integer-1d", (6,), (6, 3), np.uint8, np.int8, (), (3,)),
]


def _attention(id: str, q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...],
               mask: str = "", dtype: Any = F32, **attrs: Any) -> OpCase:
    def make(rng: Gen) -> list[np.ndarray | None]:
        arrays: list[np.ndarray | None] = [rng.standard_normal(s).astype(dtype)
                                           for s in (q, k, v)]
        scores = (*q[:-1], k[-2])
        if mask == "additive":
            arrays.append(np.where(rng.random((1, *scores[1:])) < 0.3, -1e4, 0.0)
                          .astype(dtype))
        elif mask == "padding":            # (B, 1, 1, T): one row per batch, every head
            arrays.append(np.where(rng.random((scores[0], 1, 1, scores[-1])) < 0.3, -1e4, 0.0)
                          .astype(dtype))
        elif mask == "bool":
            keep = rng.random(scores[-2:]) < 0.7
            keep[:, 0] = True                     # every query sees at least one key
            arrays.append(keep)
        return arrays
    return OpCase(id, Op.ATTENTION, make, attrs, **_TOL[dtype])


CASES += [
    _attention("attention-4d", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)),
    _attention("attention-value-width", (1, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 5)),
    _attention("attention-additive-mask", (2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8),
               mask="additive"),
    _attention("attention-bool-mask", (2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), mask="bool"),
    _attention("attention-causal-scale", (1, 2, 6, 4), (1, 2, 6, 4), (1, 2, 6, 4),
               is_causal=True, scale=0.3),
    _attention("attention-causal-additive", (2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8),
               mask="additive", is_causal=True),
    _attention("attention-causal-bool-3d", (3, 6, 8), (3, 6, 8), (3, 6, 8), mask="bool",
               is_causal=True),
    _attention("attention-causal-f16", (1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8), dtype=F16,
               is_causal=True),
    _attention("attention-3d", (4, 5, 16), (4, 9, 16), (4, 9, 16)),
    _attention("attention-large-scores", (1, 1, 3, 4), (1, 1, 5, 4), (1, 1, 5, 4),
               scale=50.0),
    _attention("attention-f64", (1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), dtype=F64),
    _attention("attention-f16", (1, 1, 4, 8), (1, 1, 5, 8), (1, 1, 5, 8), dtype=F16),
    # More heads than one block of the cpu kernel, with BERT's padding mask.
    _attention("attention-many-heads-padding", (2, 6, 40, 8), (2, 6, 48, 8), (2, 6, 48, 8),
               mask="padding"),
    _attention("attention-broadcast-kv", (2, 3, 5, 8), (1, 3, 7, 8), (3, 7, 8)),
]
