"""Schemas of the attention family: ONNX Attention and the transformer-block ops around it.

* ``onnx_attention`` — ONNX Attention (opsets 23 to 25) in full: 3-D inputs
  ``(B, S, heads * D)`` with ``q_num_heads``/``kv_num_heads`` or 4-D inputs
  ``(B, heads, S, D)``; grouped-query attention (``q_num_heads`` a multiple of
  ``kv_num_heads``, each key/value head serving consecutive query heads); an
  additive float or boolean (True = attend) ``attn_mask`` broadcast to
  ``(B, q_heads, S, T)`` and padded with "masked" up to ``T`` keys;
  ``is_causal`` aligned bottom-right (query ``i`` sees key ``j <= i + offset``,
  ``offset`` = past length, or ``nonpad_kv_seqlen - S`` per batch);
  ``left_window_size``/``right_window_size`` sliding windows; ``softcap``
  (``c * tanh(x / c)`` before the mask); ``past_key``/``past_value`` caches
  concatenated in front of K and V (outputs ``present_key``/``present_value``);
  ``nonpad_kv_seqlen`` key padding; and the fourth output ``qk_matmul_output``
  chosen by ``qk_matmul_output_mode`` (0: scaled Q·Kᵀ, 1: after softcap, 2: plus
  the mask, 3: softmax). A query row with no key left to attend gives zeros, not
  NaN. ``softmax_precision`` is accepted; keel's kernels always compute the
  softmax in float32 or wider.

  keel keeps its own ``attention`` op (matmul family) unchanged: the fused form
  graph passes produce, with a simpler contract. The ONNX importer maps an ONNX
  Attention node to ``attention`` when it fits that contract exactly and to
  ``onnx_attention`` otherwise.
* ``rotary_embedding`` — ONNX RotaryEmbedding-23.
* ``swiglu`` — ONNX SwiGLU: ``A * sigmoid(alpha * A) * B`` (equal shapes).
* ``tensor_scatter`` — ONNX TensorScatter-24: write ``update`` into a copy of
  ``past_cache`` along ``axis`` from ``write_indices[b]`` on (``linear``) or
  wrapping around (``circular``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, Shape, TensorType, broadcast_shapes, normalize_axis

__all__ = [
    "FLOAT_DTYPES",
    "AttentionShapes",
    "check_attention",
    "check_rotary",
    "check_swiglu",
    "check_tensor_scatter",
]

FLOAT_DTYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
_TS_MODES = ("linear", "circular")


def _known(d: Dim) -> bool:
    return isinstance(d, int)


def _agree(a: Dim, b: Dim) -> bool:
    return not (_known(a) and _known(b) and a != b)


def _add(a: Dim, b: Dim) -> Dim:
    return a + b if isinstance(a, int) and isinstance(b, int) else None


def _mul(a: Dim, b: Dim) -> Dim:
    return a * b if isinstance(a, int) and isinstance(b, int) else None


def _split(op: Op, name: str, hidden: Dim, heads: int) -> Dim:
    """The head size of a 3-D input's hidden dimension split into ``heads`` heads."""
    if not isinstance(hidden, int):
        return None
    if hidden % heads:
        raise InvalidArgumentError(
            f"{op.value}: {name}'s hidden size {hidden} is not divisible by its {heads} heads")
    return hidden // heads


def check_float(op: Op, dtype: DType, what: str = "input") -> None:
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"{op.value}: {what} must be float16, bfloat16, float32 or float64, got {dtype.value}")


@dataclass(frozen=True)
class AttentionShapes:
    """The dimensions of one ONNX Attention call, checked."""

    batch: Dim
    q_heads: int | Dim
    kv_heads: int | Dim
    q_len: Dim
    new_kv_len: Dim
    past_len: Dim
    head_size: Dim
    v_head_size: Dim
    three_d: bool

    @property
    def kv_len(self) -> Dim:
        return _add(self.past_len, self.new_kv_len)

    def outputs(self) -> tuple[Shape, Shape, Shape, Shape]:
        """Y, present_key, present_value and qk_matmul_output."""
        if self.three_d:
            y: Shape = (self.batch, self.q_len, _mul(self.q_heads, self.v_head_size))
        else:
            y = (self.batch, self.q_heads, self.q_len, self.v_head_size)
        return (y, (self.batch, self.kv_heads, self.kv_len, self.head_size),
                (self.batch, self.kv_heads, self.kv_len, self.v_head_size),
                (self.batch, self.q_heads, self.q_len, self.kv_len))


def _heads_3d(op: Op, attrs: Mapping[str, Any]) -> tuple[int, int]:
    qh, kvh = attrs["q_num_heads"], attrs["kv_num_heads"]
    if qh is None or kvh is None or qh <= 0 or kvh <= 0:
        raise InvalidArgumentError(
            f"{op.value}: 3-D Q, K, V need q_num_heads and kv_num_heads > 0, got "
            f"q_num_heads={qh}, kv_num_heads={kvh}")
    return qh, kvh


def _base_shapes(q: Sequence[Dim], k: Sequence[Dim], v: Sequence[Dim],
                 attrs: Mapping[str, Any]) -> AttentionShapes:
    op = Op.ONNX_ATTENTION
    if not len(q) == len(k) == len(v) or len(q) not in (3, 4):
        raise InvalidArgumentError(
            f"{op.value}: Q, K and V must all be 3-D or all 4-D, got shapes {tuple(q)}, "
            f"{tuple(k)}, {tuple(v)}")
    if len(q) == 3:
        qh, kvh = _heads_3d(op, attrs)
        return AttentionShapes(q[0], qh, kvh, q[1], k[1], 0, _split(op, "Q", q[2], qh),
                               _split(op, "V", v[2], kvh), True)
    for name, given, actual in (("q_num_heads", attrs["q_num_heads"], q[1]),
                                ("kv_num_heads", attrs["kv_num_heads"], k[1])):
        if given is not None and not _agree(given, actual):
            raise InvalidArgumentError(
                f"{op.value}: {name}={given} disagrees with the 4-D input's {actual} heads")
    if not _agree(k[1], v[1]) or not _agree(k[2], v[2]):
        raise InvalidArgumentError(
            f"{op.value}: K {tuple(k)} and V {tuple(v)} differ in heads or keys")
    if not _agree(q[3], k[3]):
        raise InvalidArgumentError(
            f"{op.value}: Q {tuple(q)} and K {tuple(k)} differ in the head size")
    return AttentionShapes(q[0], q[1], k[1], q[2], k[2], 0, q[3], v[3], False)


def check_attention(q: Sequence[Dim], k: Sequence[Dim], v: Sequence[Dim],
                    attrs: Mapping[str, Any], mask: Sequence[Dim] | None = None,
                    past_key: Sequence[Dim] | None = None,
                    past_value: Sequence[Dim] | None = None,
                    nonpad: Sequence[Dim] | None = None) -> AttentionShapes:
    """Check every shape and attribute of an ONNX Attention call; its dimensions."""
    op = Op.ONNX_ATTENTION
    _check_attention_attrs(attrs)
    s = _base_shapes(q, k, v, attrs)
    if len(q) == 3 and isinstance(k[2], int) and isinstance(s.kv_heads, int) \
            and k[2] % s.kv_heads:
        raise InvalidArgumentError(
            f"{op.value}: K's hidden size {k[2]} is not divisible by its {s.kv_heads} heads")
    if not _agree(q[0], k[0]) or not _agree(k[0], v[0]) or not _agree(k[1], v[1]):
        raise InvalidArgumentError(
            f"{op.value}: Q {tuple(q)}, K {tuple(k)} and V {tuple(v)} disagree in batch or "
            "keys")
    if isinstance(s.q_heads, int) and isinstance(s.kv_heads, int) and (
            s.kv_heads <= 0 or s.q_heads % s.kv_heads):
        raise InvalidArgumentError(
            f"{op.value}: the {s.q_heads} query heads must be a multiple of the "
            f"{s.kv_heads} key/value heads")
    if len(q) == 3 and isinstance(q[2], int) and isinstance(k[2], int) \
            and isinstance(s.q_heads, int) and isinstance(s.kv_heads, int) \
            and q[2] // s.q_heads != k[2] // s.kv_heads:
        raise InvalidArgumentError(
            f"{op.value}: Q and K differ in the head size: {q[2]}/{s.q_heads} vs "
            f"{k[2]}/{s.kv_heads}")
    s = _with_past(s, past_key, past_value, nonpad)
    if mask is not None:
        _check_mask(s, mask)
    return s


def _check_attention_attrs(attrs: Mapping[str, Any]) -> None:
    op = Op.ONNX_ATTENTION
    if attrs["qk_matmul_output_mode"] not in (0, 1, 2, 3):
        raise InvalidArgumentError(
            f"{op.value}: qk_matmul_output_mode must be 0, 1, 2 or 3, got "
            f"{attrs['qk_matmul_output_mode']}")
    if attrs["softcap"] < 0:
        raise InvalidArgumentError(f"{op.value}: softcap must be >= 0, got {attrs['softcap']}")
    for name in ("left_window_size", "right_window_size"):
        if attrs[name] < -1:
            raise InvalidArgumentError(
                f"{op.value}: {name} must be -1 (unbounded) or >= 0, got {attrs[name]}")


def _with_past(s: AttentionShapes, past_key: Sequence[Dim] | None,
               past_value: Sequence[Dim] | None,
               nonpad: Sequence[Dim] | None) -> AttentionShapes:
    op = Op.ONNX_ATTENTION
    if (past_key is None) != (past_value is None):
        raise InvalidArgumentError(f"{op.value}: past_key and past_value go together")
    if nonpad is not None:
        if past_key is not None:
            raise InvalidArgumentError(
                f"{op.value}: nonpad_kv_seqlen cannot be combined with past_key/past_value")
        if len(nonpad) != 1 or not _agree(nonpad[0], s.batch):
            raise InvalidArgumentError(
                f"{op.value}: nonpad_kv_seqlen must have shape ({s.batch},), got "
                f"{tuple(nonpad)}")
    if past_key is None or past_value is None:
        return s
    want_k = (s.batch, s.kv_heads, None, s.head_size)
    want_v = (s.batch, s.kv_heads, None, s.v_head_size)
    for name, shape, want in (("past_key", past_key, want_k), ("past_value", past_value, want_v)):
        if len(shape) != 4 or not all(map(_agree, shape, want)):
            raise InvalidArgumentError(
                f"{op.value}: {name} must have shape (B, kv_heads, P, head_size) = "
                f"{tuple('P' if d is None else d for d in want)}, got {tuple(shape)}")
    if not _agree(past_key[2], past_value[2]):
        raise InvalidArgumentError(
            f"{op.value}: past_key {tuple(past_key)} and past_value {tuple(past_value)} "
            "differ in length")
    return AttentionShapes(s.batch, s.q_heads, s.kv_heads, s.q_len, s.new_kv_len,
                           past_key[2], s.head_size, s.v_head_size, s.three_d)


def _check_mask(s: AttentionShapes, mask: Sequence[Dim]) -> None:
    op = Op.ONNX_ATTENTION
    scores = (s.batch, s.q_heads, s.q_len, s.kv_len)
    if len(mask) == 0 or len(mask) > 4:
        raise InvalidArgumentError(
            f"{op.value}: attn_mask must have rank 1 to 4, got shape {tuple(mask)}")
    last = mask[-1]
    if isinstance(last, int) and isinstance(s.kv_len, int) and last > s.kv_len:
        raise InvalidArgumentError(
            f"{op.value}: attn_mask has {last} keys, more than the {s.kv_len} keys attended")
    try:
        joint = broadcast_shapes(scores[:-1], mask[:-1])
    except InvalidArgumentError:
        joint = None
    if joint is None or len(joint) != 3 or not all(map(_agree, joint, scores[:-1])):
        raise InvalidArgumentError(
            f"{op.value}: attn_mask of shape {tuple(mask)} does not broadcast to the scores "
            f"(B, q_heads, S, T) = {scores}")


def check_rotary(x: Sequence[Dim], cos: Sequence[Dim], sin: Sequence[Dim],
                 positions: Sequence[Dim] | None, attrs: Mapping[str, Any]) -> int | None:
    """ONNX RotaryEmbedding's shape rules; returns the rotated width (None if unknown)."""
    op = Op.ROTARY_EMBEDDING
    heads = attrs["num_heads"]
    if len(x) == 3:
        if heads is None or heads <= 0:
            raise InvalidArgumentError(
                f"{op.value}: a 3-D input (B, S, hidden) needs num_heads > 0, got {heads}")
        head = _split(op, "X", x[2], heads)
        batch, seq = x[0], x[1]
    elif len(x) == 4:
        head, batch, seq = x[3], x[0], x[2]
    else:
        raise InvalidArgumentError(
            f"{op.value}: X must be 3-D (B, S, hidden) or 4-D (B, heads, S, head_size), got "
            f"shape {tuple(x)}")
    rot = attrs["rotary_embedding_dim"] or head
    if isinstance(rot, int) and (rot % 2 or rot < 0 or (isinstance(head, int) and rot > head)):
        raise InvalidArgumentError(
            f"{op.value}: rotary_embedding_dim {rot} must be even and at most the head size "
            f"{head}")
    half = rot // 2 if isinstance(rot, int) else None
    want = (None, half) if positions is not None else (batch, seq, half)
    for name, cache in (("cos_cache", cos), ("sin_cache", sin)):
        if len(cache) != len(want) or not all(map(_agree, cache, want)):
            form = "(max_position, rotary_dim / 2)" if positions is not None \
                else "(B, S, rotary_dim / 2)"
            raise InvalidArgumentError(
                f"{op.value}: {name} must have shape {form} = "
                f"{tuple('?' if d is None else d for d in want)}, got {tuple(cache)}")
    if positions is not None and (len(positions) != 2 or not _agree(positions[0], batch)
                                  or not _agree(positions[1], seq)):
        raise InvalidArgumentError(
            f"{op.value}: position_ids must have shape (B, S) = ({batch}, {seq}), got "
            f"{tuple(positions)}")
    return rot if isinstance(rot, int) else None


def check_swiglu(a: Sequence[Dim], b: Sequence[Dim]) -> None:
    if len(a) != len(b) or not all(map(_agree, a, b)):
        raise InvalidArgumentError(
            f"{Op.SWIGLU.value}: A and B must have the same shape (no broadcasting), got "
            f"{tuple(a)} and {tuple(b)}")


def _fits(inner: Dim, outer: Dim) -> bool:
    return not (isinstance(inner, int) and isinstance(outer, int) and inner > outer)


def check_tensor_scatter(cache: Sequence[Dim], update: Sequence[Dim],
                         indices: Sequence[Dim] | None, attrs: Mapping[str, Any]) -> int:
    """ONNX TensorScatter's shape rules; returns the normalized sequence axis."""
    op = Op.TENSOR_SCATTER
    if attrs["mode"] not in _TS_MODES:
        raise InvalidArgumentError(
            f"{op.value}: mode must be linear or circular, got {attrs['mode']!r}")
    if len(cache) < 2:
        raise InvalidArgumentError(
            f"{op.value}: past_cache must have rank >= 2 (batch and sequence axes), got "
            f"{tuple(cache)}")
    axis = normalize_axis(attrs["axis"], len(cache), what=f"{op.value}: axis")
    if axis == 0:
        raise InvalidArgumentError(f"{op.value}: axis must not be the batch axis 0")
    ok = len(update) == len(cache) and all(
        _agree(u, c) if i != axis else _fits(u, c)
        for i, (u, c) in enumerate(zip(update, cache, strict=False)))
    if not ok:
        raise InvalidArgumentError(
            f"{op.value}: update {tuple(update)} must match past_cache {tuple(cache)} except "
            f"for at most as many entries along axis {axis}")
    if indices is not None and (len(indices) != 1 or not _agree(indices[0], cache[0])):
        raise InvalidArgumentError(
            f"{op.value}: write_indices must have shape ({cache[0]},), got {tuple(indices)}")
    return axis


# ---- inference ----------------------------------------------------------------------------


def _shape(types: Sequence[TensorType | None], i: int) -> tuple[Dim, ...] | None:
    t = types[i] if i < len(types) else None
    return None if t is None or t.shape is None else tuple(t.shape)


def _infer_attention(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                     values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    op = Op.ONNX_ATTENTION
    _check_attention_attrs(attrs)
    q = types[0]
    if q is None:
        return [None] * 4
    check_float(op, q.dtype, "Q")
    mask = types[3] if len(types) > 3 else None
    if mask is not None and mask.dtype not in (DType.BOOL, q.dtype):
        raise InvalidArgumentError(
            f"{op.value}: attn_mask must be bool or {q.dtype.value} like Q, got "
            f"{mask.dtype.value}")
    shapes = [_shape(types, i) for i in range(7)]
    qs, ks, vs = shapes[0], shapes[1], shapes[2]
    if qs is None or ks is None or vs is None or any(
            types[i] is not None and shapes[i] is None for i in range(3, min(len(types), 7))):
        return [TensorType(q.dtype, None)] * 4
    dims = check_attention(qs, ks, vs, attrs, shapes[3], shapes[4], shapes[5], shapes[6])
    return [TensorType(q.dtype, s) for s in dims.outputs()]


def _infer_same(op: Op) -> Any:
    def infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
              values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
        x = types[0]
        if x is None:
            return [None]
        if op is not Op.TENSOR_SCATTER:
            check_float(op, x.dtype, "X" if op is Op.ROTARY_EMBEDDING else "A")
        s0, s1, s2, s3 = (_shape(types, i) for i in range(4))
        if s0 is None or s1 is None:
            return [x]
        if op is Op.SWIGLU:
            check_swiglu(s0, s1)
        elif op is Op.TENSOR_SCATTER:
            check_tensor_scatter(s0, s1, s2, attrs)
        elif s2 is not None:
            check_rotary(s0, s1, s2, s3, attrs)
        return [x]
    return infer


register_schema(OpSchema(
    Op.ONNX_ATTENTION, 3, 7, max_outputs=4,
    attrs=(AttrSpec("is_causal", AttrKind.BOOL, False),
           AttrSpec("kv_num_heads", AttrKind.INT, None),
           AttrSpec("q_num_heads", AttrKind.INT, None),
           AttrSpec("qk_matmul_output_mode", AttrKind.INT, 0),
           AttrSpec("scale", AttrKind.FLOAT, None),
           AttrSpec("softcap", AttrKind.FLOAT, 0.0),
           AttrSpec("softmax_precision", AttrKind.INT, None),
           AttrSpec("left_window_size", AttrKind.INT, -1),
           AttrSpec("right_window_size", AttrKind.INT, -1)),
    infer=_infer_attention,
    doc="ONNX Attention (opsets 23-25): inputs Q, K, V, [attn_mask], [past_key], "
        "[past_value], [nonpad_kv_seqlen]; outputs Y, [present_key], [present_value], "
        "[qk_matmul_output]. See the module docstring.",
))
register_schema(OpSchema(
    Op.ROTARY_EMBEDDING, 3, 4,
    attrs=(AttrSpec("interleaved", AttrKind.BOOL, False),
           AttrSpec("num_heads", AttrKind.INT, None),
           AttrSpec("rotary_embedding_dim", AttrKind.INT, 0)),
    infer=_infer_same(Op.ROTARY_EMBEDDING),
    doc="ONNX RotaryEmbedding: rotate pairs of X's first rotary_embedding_dim features "
        "(halves, or interleaved pairs) by the angles in cos_cache/sin_cache, looked up by "
        "position_ids when given.",
))
register_schema(OpSchema(
    Op.SWIGLU, 2, 2, attrs=(AttrSpec("alpha", AttrKind.FLOAT, 1.0),),
    infer=_infer_same(Op.SWIGLU),
    doc="ONNX SwiGLU: A * sigmoid(alpha * A) * B, A and B of one shape and dtype.",
))
register_schema(OpSchema(
    Op.TENSOR_SCATTER, 2, 3,
    attrs=(AttrSpec("mode", AttrKind.STR, "linear"), AttrSpec("axis", AttrKind.INT, -2)),
    infer=_infer_same(Op.TENSOR_SCATTER), inplace=((0, 0),),
    doc="ONNX TensorScatter: past_cache with update written along axis from "
        "write_indices[b] (default 0) on, linearly or wrapping around (circular).",
))
