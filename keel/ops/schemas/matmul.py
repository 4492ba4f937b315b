"""Schemas of the matmul family: matmul, dot, gemm, einsum, matmul_integer, attention.

Semantics:

* ``matmul`` — NumPy ``matmul`` (= ONNX MatMul): 1-D operands are promoted
  (``a`` gets a leading 1, ``b`` a trailing 1, both removed from the result),
  batch dimensions broadcast. Optional third input ``bias`` broadcasts to the
  result (never grows it); attributes ``activation``/``activation_params`` add
  a fused epilogue (:mod:`keel.ops.epilogue`): ``act(A @ B + bias)``.
* ``dot`` — seed 001: 1-D · 1-D gives a 0-D scalar. Other ranks follow
  ``numpy.dot``: a 0-D operand multiplies elementwise; 2-D · 2-D is a matrix
  product; N-D · 1-D sums over the last axis of ``a``; N-D · M-D (M >= 2) sums
  the last axis of ``a`` against the second-to-last of ``b``.
* ``gemm`` — ONNX Gemm: ``act(alpha * A' @ B' + beta * C)``, ``A'`` is ``A``
  or its transpose (``trans_a``), likewise ``B'``; ``C`` broadcasts to (M, N).
* ``einsum`` — ONNX Einsum / ``numpy.einsum`` with an ``equation``
  (explicit ``->`` output or implicit mode; ``...`` broadcast dimensions).
* ``matmul_integer`` — ONNX MatMulInteger: ``(A - a_zero_point) @ (B -
  b_zero_point)`` exactly, int32 out. ``a_zero_point`` is a scalar or one value
  per row of A (M); ``b_zero_point`` a scalar or one per column of B (N).
* ``attention`` — ``softmax(Q @ K^T * scale + mask) @ V`` with a numerically
  stable softmax over the last axis. Q is (..., S, D), K (..., T, D), V
  (..., T, Dv) (keel's fused form uses [B, H, S, D]); batch dimensions
  broadcast as in matmul. ``mask`` is additive (float, broadcast to
  (..., S, T)) or boolean (True = attend). ``scale`` defaults to 1/sqrt(D);
  ``is_causal`` masks key positions after the query position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.epilogue import resolve_activation
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, Shape, TensorType, broadcast_shapes

__all__ = [
    "DTYPES",
    "EPILOGUE_ATTRS",
    "check_dtype",
    "dot_shape",
    "einsum_shape",
    "gemm_shape",
    "matmul_shape",
    "parse_einsum",
]

FLOATS = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
_WIDE_INTS = frozenset({DType.INT32, DType.INT64, DType.UINT32, DType.UINT64})
_ALL_INTS = _WIDE_INTS | {DType.INT8, DType.INT16, DType.UINT8, DType.UINT16}
_BYTES = frozenset({DType.INT8, DType.UINT8})

# The dtypes of input 0 each op accepts (ONNX type constraints).
DTYPES: dict[Op, frozenset[DType]] = {
    Op.MATMUL: FLOATS | _WIDE_INTS,
    Op.DOT: FLOATS | _ALL_INTS,
    Op.GEMM: FLOATS | _WIDE_INTS,
    Op.EINSUM: FLOATS | _ALL_INTS,
    Op.MATMUL_INTEGER: _BYTES,
    Op.ATTENTION: FLOATS,
}

EPILOGUE_ATTRS = (
    AttrSpec("activation", AttrKind.STR, ""),
    AttrSpec("activation_params", AttrKind.FLOATS, ()),
)


def check_dtype(op: Op, dtype: DType, allowed: frozenset[DType] | None = None,
                what: str = "input") -> None:
    """Raise ``InvalidArgumentError`` unless ``dtype`` is allowed for ``op``."""
    allowed = DTYPES[op] if allowed is None else allowed
    if dtype not in allowed:
        names = ", ".join(sorted(d.value for d in allowed))
        raise InvalidArgumentError(
            f"{op.value} does not take {dtype.value} {what}s; allowed: {names}"
        )


def _same_dtype(op: Op, types: Sequence[TensorType | None]) -> DType | None:
    known = [t.dtype for t in types if t is not None]
    if len(set(known)) > 1:
        raise InvalidArgumentError(
            f"{op.value} needs inputs of one dtype, got {', '.join(d.value for d in known)}"
        )
    return known[0] if known else None


def _check_epilogue(op: Op, attrs: Mapping[str, Any], dtype: DType) -> None:
    name = attrs.get("activation", "")
    resolve_activation(name, attrs.get("activation_params", ()))
    if name not in ("", "relu", "clip") and dtype not in FLOATS:
        raise InvalidArgumentError(
            f"{op.value}: activation {name!r} needs a float output, got {dtype.value}"
        )


def _dims_match(a: Dim, b: Dim) -> bool:
    return not (isinstance(a, int) and isinstance(b, int) and a != b)


# ---- shape rules (shared by infer and the kernels) ---------------------------------------
def matmul_shape(a: Sequence[Dim], b: Sequence[Dim], op: Op = Op.MATMUL) -> Shape:
    """The shape of ``numpy.matmul(a, b)``; a mismatch is an ``InvalidArgumentError``."""
    if len(a) == 0 or len(b) == 0:
        raise InvalidArgumentError(
            f"{op.value} needs operands of rank >= 1, got shapes {tuple(a)} and {tuple(b)}"
        )
    a2 = (1, *a) if len(a) == 1 else tuple(a)
    b2 = (*b, 1) if len(b) == 1 else tuple(b)
    if not _dims_match(a2[-1], b2[-2]):
        raise InvalidArgumentError(
            f"{op.value}: inner dimensions differ: {tuple(a)} @ {tuple(b)} "
            f"({a2[-1]} != {b2[-2]})"
        )
    try:
        batch = broadcast_shapes(a2[:-2], b2[:-2])
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"{op.value}: batch dimensions of {tuple(a)} and {tuple(b)} do not broadcast"
        ) from None
    out: list[Dim] = [*batch]
    if len(a) > 1:
        out.append(a2[-2])
    if len(b) > 1:
        out.append(b2[-1])
    return tuple(out)


def check_bias(op: Op, out: Sequence[Dim], bias: Sequence[Dim], name: str = "bias") -> None:
    """``bias`` must broadcast to ``out`` without changing it."""
    try:
        joint = broadcast_shapes(out, bias)
    except InvalidArgumentError:
        joint = None
    if joint is None or len(joint) != len(out) or not all(
            _dims_match(j, o) for j, o in zip(joint, out, strict=True)):
        raise InvalidArgumentError(
            f"{op.value}: {name} of shape {tuple(bias)} does not broadcast to the "
            f"result shape {tuple(out)}"
        )


def dot_shape(a: Sequence[Dim], b: Sequence[Dim]) -> Shape:
    """The shape of ``numpy.dot(a, b)`` (see the module docstring)."""
    if len(a) == 0 or len(b) == 0:
        return tuple(b) if len(a) == 0 else tuple(a)
    k_b = b[0] if len(b) == 1 else b[-2]
    if not _dims_match(a[-1], k_b):
        raise InvalidArgumentError(
            f"dot: shapes {tuple(a)} and {tuple(b)} are not aligned ({a[-1]} != {k_b})"
        )
    if len(b) == 1:
        return tuple(a[:-1])
    return (*a[:-1], *b[:-2], b[-1])


def gemm_shape(a: Sequence[Dim], b: Sequence[Dim], trans_a: bool, trans_b: bool) -> Shape:
    """(M, N) of ``A' @ B'``; A and B must be 2-D with matching K."""
    if len(a) != 2 or len(b) != 2:
        raise InvalidArgumentError(
            f"gemm needs 2-D A and B, got shapes {tuple(a)} and {tuple(b)}"
        )
    m, ka = (a[1], a[0]) if trans_a else (a[0], a[1])
    kb, n = (b[1], b[0]) if trans_b else (b[0], b[1])
    if not _dims_match(ka, kb):
        raise InvalidArgumentError(
            f"gemm: K differs between A' ({ka}) and B' ({kb}); shapes {tuple(a)}, {tuple(b)}, "
            f"trans_a={trans_a}, trans_b={trans_b}"
        )
    return (m, n)


# ---- einsum ------------------------------------------------------------------------------
def parse_einsum(equation: str, ranks: Sequence[int]) -> tuple[list[list[str]], list[str]]:
    """Split an einsum equation into per-input and output label lists.

    ``...`` is expanded into labels ``"...0"``, ``"...1"``, … aligned to the right
    across operands, so dimensions under the ellipsis broadcast like NumPy's.
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise InvalidArgumentError(
            f"einsum equation {equation!r} names {len(terms)} operands, got {len(ranks)}"
        )
    widths = [_ellipsis_width(term, rank, equation) for term, rank in zip(terms, ranks,
                                                                             strict=True)]
    n_ell = max(widths, default=0)
    inputs = [_labels(term, w, n_ell) for term, w in zip(terms, widths, strict=True)]
    if arrow:
        _ellipsis_width(rhs, None, equation)
        output = _labels(rhs, n_ell, n_ell)
    else:
        counts: dict[str, int] = {}
        for labels in inputs:
            for lab in labels:
                counts[lab] = counts.get(lab, 0) + 1
        named = sorted(k for k, c in counts.items() if c == 1 and not k.startswith("..."))
        output = [f"...{i}" for i in range(n_ell)] + named
    seen = {lab for labels in inputs for lab in labels}
    for lab in output:
        if lab not in seen:
            raise InvalidArgumentError(
                f"einsum output label {lab!r} does not appear in any input of {equation!r}"
            )
    if len(set(output)) != len(output):
        raise InvalidArgumentError(f"einsum output repeats a label in {equation!r}")
    return inputs, output


def _ellipsis_width(term: str, rank: int | None, equation: str) -> int:
    """How many dimensions ``...`` covers in ``term`` (0 without an ellipsis)."""
    if term.count("...") > 1:
        raise InvalidArgumentError(f"einsum term {term!r} has more than one '...'")
    named = term.replace("...", "")
    for ch in named:
        if not ch.isalpha():
            raise InvalidArgumentError(
                f"einsum equation {equation!r} has an invalid label {ch!r}; labels are letters"
            )
    if rank is None:
        return 0
    if "..." not in term:
        if len(named) != rank:
            raise InvalidArgumentError(
                f"einsum term {term!r} has {len(named)} labels for an operand of rank {rank}"
            )
        return 0
    if len(named) > rank:
        raise InvalidArgumentError(
            f"einsum term {term!r} has more labels than the operand's rank {rank}"
        )
    return rank - len(named)


def _labels(term: str, width: int, n_ell: int) -> list[str]:
    head, dots, tail = term.partition("...")
    if not dots:
        return list(term)
    return [*head, *[f"...{i}" for i in range(n_ell - width, n_ell)], *tail]


def einsum_shape(equation: str, shapes: Sequence[Sequence[Dim]]) -> Shape:
    """The output shape of ``numpy.einsum(equation, *operands)``."""
    inputs, output = parse_einsum(equation, [len(s) for s in shapes])
    sizes: dict[str, list[Dim]] = {}
    for labels, shape in zip(inputs, shapes, strict=True):
        for lab, d in zip(labels, shape, strict=True):
            sizes.setdefault(lab, []).append(d)
    joint: dict[str, Dim] = {}
    for lab, dims in sizes.items():
        try:
            joint[lab] = broadcast_shapes(*[(d,) for d in dims])[0]
        except InvalidArgumentError:
            raise InvalidArgumentError(
                f"einsum {equation!r}: label {lab!r} has sizes {dims} that do not match"
            ) from None
    return tuple(joint[lab] for lab in output)


# ---- infer functions -------------------------------------------------------------------
def _matmul_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                  values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    a, b = types[0], types[1]
    dtype = _same_dtype(Op.MATMUL, types)
    if dtype is None:
        return [None]
    check_dtype(Op.MATMUL, dtype)
    _check_epilogue(Op.MATMUL, attrs, dtype)
    if a is None or b is None or a.shape is None or b.shape is None:
        return [TensorType(dtype, None)]
    shape = matmul_shape(a.shape, b.shape)
    bias = types[2] if len(types) > 2 else None
    if bias is not None and bias.shape is not None:
        check_bias(Op.MATMUL, shape, bias.shape)
    return [TensorType(dtype, shape)]


def _dot_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
               values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    a, b = types
    dtype = _same_dtype(Op.DOT, types)
    if dtype is None:
        return [None]
    check_dtype(Op.DOT, dtype)
    if a is None or b is None or a.shape is None or b.shape is None:
        return [TensorType(dtype, None)]
    return [TensorType(dtype, dot_shape(a.shape, b.shape))]


def _gemm_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    a, b = types[0], types[1]
    dtype = _same_dtype(Op.GEMM, types)
    if dtype is None:
        return [None]
    check_dtype(Op.GEMM, dtype)
    _check_epilogue(Op.GEMM, attrs, dtype)
    if a is None or b is None or a.shape is None or b.shape is None:
        return [TensorType(dtype, None)]
    shape = gemm_shape(a.shape, b.shape, attrs["trans_a"], attrs["trans_b"])
    c = types[2] if len(types) > 2 else None
    if c is not None and c.shape is not None:
        check_bias(Op.GEMM, shape, c.shape, "C")
    return [TensorType(dtype, shape)]


def _einsum_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                  values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    dtype = _same_dtype(Op.EINSUM, types)
    if dtype is None:
        return [None]
    check_dtype(Op.EINSUM, dtype)
    if any(t is None or t.shape is None for t in types):
        return [TensorType(dtype, None)]
    shapes = [t.shape for t in types if t is not None and t.shape is not None]
    return [TensorType(dtype, einsum_shape(attrs["equation"], shapes))]


def check_zero_point(op: Op, name: str, shape: Sequence[Dim], allowed: Sequence[Dim],
                     axis_name: str) -> None:
    """A zero point is a scalar (or a 1-element tensor) or a 1-D vector of ``allowed`` size."""
    if len(shape) == 0 or (len(shape) == 1 and shape[0] == 1):
        return
    if len(shape) == 1 and any(_dims_match(shape[0], n) for n in allowed):
        return
    raise InvalidArgumentError(
        f"{op.value}: {name} must be a scalar or have one value per {axis_name} "
        f"({', '.join(str(n) for n in allowed)}); got shape {tuple(shape)}"
    )


def _matmul_integer_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                          values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    a, b = types[0], types[1]
    for i, t in enumerate(types):
        if t is not None:
            check_dtype(Op.MATMUL_INTEGER, t.dtype, _BYTES, f"input {i}")
    if a is None or b is None or a.shape is None or b.shape is None:
        return [TensorType(DType.INT32, None)]
    shape = matmul_shape(a.shape, b.shape, Op.MATMUL_INTEGER)
    rows: Dim = a.shape[-2] if len(a.shape) > 1 else 1
    cols: Dim = b.shape[-1] if len(b.shape) > 1 else 1
    for t, name, n, axis in ((types[2] if len(types) > 2 else None, "a_zero_point", rows, "row"),
                             (types[3] if len(types) > 3 else None, "b_zero_point", cols,
                              "column")):
        if t is not None and t.shape is not None:
            check_zero_point(Op.MATMUL_INTEGER, name, t.shape, (n,), axis)
    return [TensorType(DType.INT32, shape)]


def attention_shape(q: Sequence[Dim], k: Sequence[Dim], v: Sequence[Dim],
                    mask: Sequence[Dim] | None = None) -> Shape:
    """(..., S, Dv) from Q (..., S, D), K (..., T, D), V (..., T, Dv)."""
    if len(q) < 2 or len(k) < 2 or len(v) < 2:
        raise InvalidArgumentError(
            f"attention needs Q, K, V of rank >= 2, got {tuple(q)}, {tuple(k)}, {tuple(v)}"
        )
    if not _dims_match(q[-1], k[-1]):
        raise InvalidArgumentError(
            f"attention: Q and K differ in the head size: {tuple(q)} vs {tuple(k)}"
        )
    if not _dims_match(k[-2], v[-2]):
        raise InvalidArgumentError(
            f"attention: K and V differ in the number of keys: {tuple(k)} vs {tuple(v)}"
        )
    scores = matmul_shape(q, (*k[:-2], k[-1], k[-2]), Op.ATTENTION)
    if mask is not None:
        check_bias(Op.ATTENTION, scores, mask, "mask")
    return (*matmul_shape(scores, v, Op.ATTENTION),)


def _attention_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                     values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    dtype = _same_dtype(Op.ATTENTION, types[:3])
    if dtype is None:
        return [None]
    check_dtype(Op.ATTENTION, dtype)
    mask = types[3] if len(types) > 3 else None
    if mask is not None and mask.dtype is not DType.BOOL and mask.dtype is not dtype:
        raise InvalidArgumentError(
            f"attention: mask must be bool or {dtype.value} like Q, got {mask.dtype.value}"
        )
    if any(t is None or t.shape is None for t in types[:3]):
        return [TensorType(dtype, None)]
    q, k, v = (t.shape for t in types[:3])  # type: ignore[union-attr]
    assert q is not None and k is not None and v is not None  # narrowed above
    mshape = mask.shape if mask is not None else None
    return [TensorType(dtype, attention_shape(q, k, v, mshape))]


register_schema(OpSchema(
    Op.MATMUL, 2, 3, EPILOGUE_ATTRS, infer=_matmul_infer,
    doc="A @ B with NumPy matmul semantics (seed 001); optional bias and fused activation.",
))
register_schema(OpSchema(
    Op.DOT, 2, 2, infer=_dot_infer,
    doc="1-D . 1-D -> 0-D scalar (seed 001); other ranks as numpy.dot.",
))
register_schema(OpSchema(
    Op.GEMM, 2, 3,
    (AttrSpec("alpha", AttrKind.FLOAT, 1.0), AttrSpec("beta", AttrKind.FLOAT, 1.0),
     AttrSpec("trans_a", AttrKind.BOOL, False), AttrSpec("trans_b", AttrKind.BOOL, False),
     *EPILOGUE_ATTRS),
    infer=_gemm_infer,
    doc="act(alpha * A' @ B' + beta * C) (ONNX Gemm with a fused epilogue).",
))
register_schema(OpSchema(
    Op.EINSUM, 1, None, (AttrSpec("equation", AttrKind.STR, REQUIRED),),
    infer=_einsum_infer, doc="numpy.einsum(equation, *inputs) (ONNX Einsum).",
))
register_schema(OpSchema(
    Op.MATMUL_INTEGER, 2, 4, infer=_matmul_integer_infer,
    doc="(A - a_zero_point) @ (B - b_zero_point) in int32 (ONNX MatMulInteger).",
))
register_schema(OpSchema(
    Op.ATTENTION, 3, 4,
    (AttrSpec("scale", AttrKind.FLOAT, None), AttrSpec("is_causal", AttrKind.BOOL, False)),
    infer=_attention_infer,
    doc="softmax(Q @ K^T * scale + mask) @ V; scale defaults to 1/sqrt(D).",
))
