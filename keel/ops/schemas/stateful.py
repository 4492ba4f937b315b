"""Schemas of the ops that carry a recurrent state from one call to the next (ONNX 27).

* ``linear_attention``: ONNX LinearAttention. Q, K, V are packed ``(B, T, H * D)``;
  a state ``S`` of shape ``(B, H_kv, d_k, d_v)`` is updated token by token with the
  ``update_rule`` (``linear``: ``S += k v^T``; ``gated``: ``S = exp(g) S + k v^T``;
  ``delta``: ``S += beta k (v - S^T k)^T``; ``gated_delta``: both) and read as
  ``o = scale q^T S``. Outputs ``(B, T, H_q * d_v)`` and the final state.
  ``q_num_heads`` is a multiple of ``kv_num_heads`` (grouped query heads share a state).
* ``causal_conv_with_state``: ONNX CausalConvWithState, a depthwise causal 1-D
  convolution of ``(B, C, L)`` with weights ``(C, 1, k)``; ``past_state`` holds the
  previous ``k - 1`` positions (zeros when absent), ``present_state`` the last ``k - 1``
  of ``past_state ++ input``. ``activation`` may fuse SiLU (``silu`` or ``swish``).

The checks here are shared by ``infer`` and the kernels, so both raise the same errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, TensorType

__all__ = ["STATE_FLOATS", "UPDATE_RULES", "LinearAttentionShapes", "check_causal_conv",
           "check_linear_attention"]

STATE_FLOATS = frozenset({DType.FLOAT16, DType.FLOAT32, DType.FLOAT64})
UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")
ACTIVATIONS = ("none", "silu", "swish")


@dataclass(frozen=True)
class LinearAttentionShapes:
    """The unpacked sizes of one linear_attention call."""

    batch: Dim
    tokens: Dim
    q_heads: int
    kv_heads: int
    d_k: Dim
    d_v: Dim
    decay_per_key: bool       # decay is (B, T, H_kv * d_k), else (B, T, H_kv)


def _per_head(op: Op, name: str, dim: Dim, heads: int) -> Dim:
    if not isinstance(dim, int):
        return None
    if dim % heads:
        raise InvalidArgumentError(
            f"{op.value}: the last dimension of {name} ({dim}) is not a multiple of its "
            f"head count {heads}")
    return dim // heads


def _rank3(op: Op, name: str, shape: Sequence[Dim] | None) -> Sequence[Dim] | None:
    if shape is not None and len(shape) != 3:
        raise InvalidArgumentError(
            f"{op.value}: {name} must be rank 3, got shape {tuple(shape)}")
    return shape


def _same(op: Op, what: str, a: Dim, b: Dim) -> None:
    if isinstance(a, int) and isinstance(b, int) and a != b:
        raise InvalidArgumentError(f"{op.value}: {what} differ ({a} and {b})")


def check_linear_attention(q: Sequence[Dim], k: Sequence[Dim], v: Sequence[Dim],
                           past: Sequence[Dim] | None, decay: Sequence[Dim] | None,
                           beta: Sequence[Dim] | None,
                           attrs: Mapping[str, Any]) -> LinearAttentionShapes:
    """Check shapes and attributes; the unpacked sizes."""
    op = Op.LINEAR_ATTENTION
    hq, hkv, rule = attrs["q_num_heads"], attrs["kv_num_heads"], attrs["update_rule"]
    if hq <= 0 or hkv <= 0 or hq % hkv:
        raise InvalidArgumentError(
            f"{op.value}: q_num_heads ({hq}) must be a positive multiple of kv_num_heads "
            f"({hkv})")
    if rule not in UPDATE_RULES:
        raise InvalidArgumentError(
            f"{op.value}: update_rule {rule!r} is not one of {', '.join(UPDATE_RULES)}")
    for name, shape in (("query", q), ("key", k), ("value", v)):
        _rank3(op, name, shape)
    for i, what in ((0, "batch sizes"), (1, "sequence lengths")):
        _same(op, f"query/key/value {what}", q[i], k[i])
        _same(op, f"query/key/value {what}", q[i], v[i])
    d_k = _per_head(op, "query", q[2], hq)
    _same(op, "query and key head sizes", d_k, _per_head(op, "key", k[2], hkv))
    d_v = _per_head(op, "value", v[2], hkv)
    _check_gates(op, rule, decay is not None, beta is not None)
    per_key = _check_decay(op, _rank3(op, "decay", decay), hkv, d_k)
    _check_beta(op, _rank3(op, "beta", beta), hkv)
    if past is not None:
        want = (q[0], hkv, d_k, d_v)
        if len(past) != 4 or any(isinstance(a, int) and isinstance(b, int) and a != b
                                 for a, b in zip(past, want, strict=True)):
            raise InvalidArgumentError(
                f"{op.value}: past_state must have shape (B, kv_num_heads, d_k, d_v) = "
                f"{want}, got {tuple(past)}")
    return LinearAttentionShapes(q[0], q[1], hq, hkv, d_k, d_v, per_key)


def _check_gates(op: Op, rule: str, has_decay: bool, has_beta: bool) -> None:
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gated != has_decay:
        raise InvalidArgumentError(
            f"{op.value}: update_rule {rule!r} {'needs' if gated else 'takes no'} decay")
    if delta != has_beta:
        raise InvalidArgumentError(
            f"{op.value}: update_rule {rule!r} {'needs' if delta else 'takes no'} beta")


def _check_decay(op: Op, decay: Sequence[Dim] | None, hkv: int, d_k: Dim) -> bool:
    if decay is None or not isinstance(decay[2], int):
        return False
    if decay[2] == hkv:
        return False
    if isinstance(d_k, int) and decay[2] == hkv * d_k:
        return True
    raise InvalidArgumentError(
        f"{op.value}: decay's last dimension ({decay[2]}) must be kv_num_heads ({hkv}) "
        f"or kv_num_heads * d_k")


def _check_beta(op: Op, beta: Sequence[Dim] | None, hkv: int) -> None:
    if beta is not None and isinstance(beta[2], int) and beta[2] not in (1, hkv):
        raise InvalidArgumentError(
            f"{op.value}: beta's last dimension ({beta[2]}) must be 1 or kv_num_heads ({hkv})")


def check_causal_conv(x: Sequence[Dim], w: Sequence[Dim], bias: Sequence[Dim] | None,
                      past: Sequence[Dim] | None, activation: str) -> Dim:
    """Check shapes and the activation; the kernel size k (None when unknown)."""
    op = Op.CAUSAL_CONV_WITH_STATE
    if activation not in ACTIVATIONS:
        raise InvalidArgumentError(
            f"{op.value}: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    _rank3(op, "input", x)
    _rank3(op, "weight", w)
    if w[1] not in (1, None) and isinstance(w[1], int):
        raise InvalidArgumentError(
            f"{op.value}: weight must be (channels, 1, k) (depthwise), got {tuple(w)}")
    _same(op, "input and weight channel counts", x[1], w[0])
    if bias is not None:
        if len(bias) != 1:
            raise InvalidArgumentError(f"{op.value}: bias must be rank 1, got {tuple(bias)}")
        _same(op, "input and bias channel counts", x[1], bias[0])
    k = w[2]
    if isinstance(k, int) and k < 1:
        raise InvalidArgumentError(f"{op.value}: the kernel size must be >= 1, got {k}")
    if past is not None:
        _rank3(op, "past_state", past)
        _same(op, "input and past_state batch sizes", x[0], past[0])
        _same(op, "input and past_state channel counts", x[1], past[1])
        _same(op, "past_state length and kernel size - 1", past[2],
              k - 1 if isinstance(k, int) else None)
    return k


def _shape(types: Sequence[TensorType | None], i: int) -> Sequence[Dim] | None:
    t = types[i] if i < len(types) else None
    return None if t is None else t.shape


def _check_float(op: Op, types: Sequence[TensorType | None]) -> None:
    for t in types:
        if t is not None and t.dtype not in STATE_FLOATS:
            raise InvalidArgumentError(
                f"{op.value} takes float16, float32 or float64 tensors, got {t.dtype.value}")


def _infer_linear_attention(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                            values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    _check_float(Op.LINEAR_ATTENTION, types)
    q, k, v = (_shape(types, i) for i in range(3))
    if types[0] is None or q is None or k is None or v is None:
        return [None, None]
    s = check_linear_attention(q, k, v, _shape(types, 3), _shape(types, 4), _shape(types, 5),
                               attrs)
    past = types[3] if len(types) > 3 else None
    out_d = None if s.d_v is None else s.q_heads * s.d_v
    return [TensorType(types[0].dtype, (s.batch, s.tokens, out_d)),
            TensorType(past.dtype if past is not None else types[0].dtype,
                       (s.batch, s.kv_heads, s.d_k, s.d_v))]


def _infer_causal_conv(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                       values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    _check_float(Op.CAUSAL_CONV_WITH_STATE, types)
    x, w = _shape(types, 0), _shape(types, 1)
    if types[0] is None or x is None or w is None:
        return [None, None]
    k = check_causal_conv(x, w, _shape(types, 2), _shape(types, 3), attrs["activation"])
    carry = k - 1 if isinstance(k, int) else None
    return [TensorType(types[0].dtype, tuple(x)),
            TensorType(types[0].dtype, (x[0], x[1], carry))]


register_schema(OpSchema(
    Op.LINEAR_ATTENTION, 3, 6, max_outputs=2, min_outputs=1,
    attrs=(AttrSpec("chunk_size", AttrKind.INT, 64),
           AttrSpec("kv_num_heads", AttrKind.INT, REQUIRED),
           AttrSpec("q_num_heads", AttrKind.INT, REQUIRED),
           AttrSpec("scale", AttrKind.FLOAT, 0.0),
           AttrSpec("update_rule", AttrKind.STR, "gated_delta")),
    infer=_infer_linear_attention,
    doc="ONNX LinearAttention: inputs query, key, value (B, T, H*D), [past_state "
        "(B, H_kv, d_k, d_v)], [decay], [beta]; outputs (B, T, H_q*d_v) and the state. "
        "scale 0 means 1/sqrt(d_k); chunk_size is a hint with no effect on results.",
))
register_schema(OpSchema(
    Op.CAUSAL_CONV_WITH_STATE, 2, 4, max_outputs=2, min_outputs=1,
    attrs=(AttrSpec("activation", AttrKind.STR, "none"),),
    infer=_infer_causal_conv,
    doc="ONNX CausalConvWithState: depthwise causal conv1d of input (B, C, L) with weight "
        "(C, 1, k), [bias (C)], [past_state (B, C, k-1)]; outputs (B, C, L) and the last "
        "k-1 positions. activation: none, silu or swish (the same).",
))
