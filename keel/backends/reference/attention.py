"""Reference kernels of the attention family: readable NumPy in float64.

``onnx_attention`` states ONNX Attention step by step: reshape 3-D inputs to
heads, append the past cache, build one additive bias from the mask, the
causal frontier, the sliding window and the key padding, repeat key/value
heads for grouped queries, then softmax(Q·Kᵀ·scale (soft-capped) + bias)·V
with rows that attend no key set to zero.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.attention import (
    FLOAT_DTYPES,
    check_attention,
    check_float,
    check_rotary,
    check_swiglu,
    check_tensor_scatter,
)

__all__: list[str] = []



def _opt(inputs: Inputs, i: int) -> np.ndarray | None:
    return inputs[i] if i < len(inputs) else None


def _shape(x: np.ndarray | None) -> tuple[int, ...] | None:
    return None if x is None else tuple(x.shape)


def _heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, S, heads * D) -> (B, heads, S, D)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _allowed_to_bias(allowed: np.ndarray) -> np.ndarray:
    return np.where(allowed, 0.0, -np.inf)


def _attention_bias(attrs: Attrs, mask: np.ndarray | None, q_len: int, kv_len: int,
                    past_len: int, nonpad: np.ndarray | None) -> np.ndarray:
    """The additive bias (0 or -inf, plus a float mask), broadcastable to (B, H, S, T)."""
    bias = np.zeros((q_len, kv_len))
    if mask is not None:
        pad = [(0, 0)] * (mask.ndim - 1) + [(0, kv_len - mask.shape[-1])]
        if mask.dtype == np.bool_:
            bias = bias + _allowed_to_bias(np.pad(mask, pad, constant_values=False))
        else:
            bias = bias + np.pad(mask.astype(np.float64), pad, constant_values=-np.inf)
    # The query block starts after `offset` valid keys: the past, or the external cache.
    if nonpad is not None:
        offset = (nonpad.astype(np.int64) - q_len).reshape(-1, 1, 1, 1)
    else:
        offset = np.asarray(past_len)
    i = np.arange(q_len).reshape(-1, 1) + offset
    j = np.arange(kv_len).reshape(1, -1)
    if attrs["is_causal"]:
        bias = bias + _allowed_to_bias(j <= i)
    if attrs["left_window_size"] >= 0:
        bias = bias + _allowed_to_bias(i - j <= attrs["left_window_size"])
    if attrs["right_window_size"] >= 0:
        bias = bias + _allowed_to_bias(j - i <= attrs["right_window_size"])
    if nonpad is not None:
        bias = bias + _allowed_to_bias(j < nonpad.reshape(-1, 1, 1, 1))
    return bias


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; a row that is all -inf gives zeros."""
    top = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(top == -np.inf, 0.0, top))
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total == 0, 1.0, total)


@TABLE.kernel(Op.ONNX_ATTENTION, dtypes=FLOAT_DTYPES)
def onnx_attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX Attention: Y, present_key, present_value, qk_matmul_output."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    mask, past_k, past_v, nonpad = (_opt(inputs, i) for i in range(3, 7))
    dims = check_attention(q.shape, k.shape, v.shape, attrs, _shape(mask), _shape(past_k),
                           _shape(past_v), _shape(nonpad))
    check_float(Op.ONNX_ATTENTION, DType.from_numpy(q.dtype), "Q")
    if mask is not None and mask.dtype not in (np.bool_, q.dtype):
        raise InvalidArgumentError(
            f"{Op.ONNX_ATTENTION.value}: attn_mask must be bool or {q.dtype} like Q, got "
            f"{mask.dtype}")
    if dims.three_d:
        qh, kvh = attrs["q_num_heads"], attrs["kv_num_heads"]
        q, k, v = _heads(q, qh), _heads(k, kvh), _heads(v, kvh)
    if past_k is not None and past_v is not None:
        k, v = np.concatenate([past_k, k], axis=2), np.concatenate([past_v, v], axis=2)
    q_len, kv_len = q.shape[2], k.shape[2]
    bias = _attention_bias(attrs, mask, q_len, kv_len,
                           0 if past_k is None else past_k.shape[2], nonpad)
    group = q.shape[1] // max(k.shape[1], 1)
    k64 = np.repeat(k.astype(np.float64), group, axis=1)
    v64 = np.repeat(v.astype(np.float64), group, axis=1)
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[3])
    scores = q.astype(np.float64) @ k64.swapaxes(-1, -2) * scale
    cap = attrs["softcap"]
    capped = cap * np.tanh(scores / cap) if cap > 0 else scores
    biased = capped + bias
    probs = _softmax(biased)
    # A row whose bias masks every key attends nothing: zeros, whatever its scores are.
    probs = np.where((bias == -np.inf).all(axis=-1, keepdims=True), 0.0, probs)
    y = probs @ v64
    if dims.three_d:
        y = y.transpose(0, 2, 1, 3).reshape(y.shape[0], q_len, -1)
    qk = (scores, capped, biased, probs)[attrs["qk_matmul_output_mode"]]
    qk = np.broadcast_to(qk, scores.shape)
    return [y.astype(q.dtype), k.astype(q.dtype), v.astype(q.dtype), qk.astype(q.dtype)]


@TABLE.kernel(Op.ROTARY_EMBEDDING, dtypes=FLOAT_DTYPES)
def rotary_embedding(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Rotate feature pairs (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos) per position."""
    x, cos, sin, pos = inputs[0], inputs[1], inputs[2], _opt(inputs, 3)
    check_float(Op.ROTARY_EMBEDDING, DType.from_numpy(x.dtype), "X")
    rot = check_rotary(x.shape, cos.shape, sin.shape, _shape(pos), attrs)
    if x.ndim == 3:       # (B, S, hidden) -> (B, S, H, D)
        xs = x.reshape(*x.shape[:2], attrs["num_heads"], -1).astype(np.float64)
    else:                 # (B, H, S, D) -> (B, S, H, D)
        xs = x.transpose(0, 2, 1, 3).astype(np.float64)
    rot = rot or xs.shape[-1]
    if pos is not None:
        cos, sin = cos[pos], sin[pos]
    c = cos.astype(np.float64)[:, :, None, :]
    s = sin.astype(np.float64)[:, :, None, :]
    y = xs.copy()
    part = xs[..., :rot]
    if attrs["interleaved"]:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        y[..., 0:rot:2], y[..., 1:rot:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = part[..., :rot // 2], part[..., rot // 2:]
        y[..., :rot // 2], y[..., rot // 2:rot] = x1 * c - x2 * s, x1 * s + x2 * c
    y = y.reshape(x.shape) if x.ndim == 3 else y.transpose(0, 2, 1, 3)
    return [y.astype(x.dtype)]


@TABLE.kernel(Op.SWIGLU, dtypes=FLOAT_DTYPES)
def swiglu(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A * sigmoid(alpha * A) * B."""
    a, b = inputs
    check_float(Op.SWIGLU, DType.from_numpy(a.dtype), "A")
    check_swiglu(a.shape, b.shape)
    if b.dtype != a.dtype:
        raise InvalidArgumentError(
            f"{Op.SWIGLU.value}: A and B must have one dtype, got {a.dtype} and {b.dtype}")
    a64 = a.astype(np.float64)
    y = a64 / (1.0 + np.exp(-attrs["alpha"] * a64)) * b.astype(np.float64)
    return [y.astype(a.dtype)]


@TABLE.kernel(Op.TENSOR_SCATTER)
def tensor_scatter(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A copy of past_cache with update written along axis from write_indices[b] on."""
    cache, update, indices = inputs[0], inputs[1], _opt(inputs, 2)
    axis = check_tensor_scatter(cache.shape, update.shape, _shape(indices), attrs)
    if update.dtype != cache.dtype:
        raise InvalidArgumentError(
            f"{Op.TENSOR_SCATTER.value}: update must have past_cache's dtype {cache.dtype}, "
            f"got {update.dtype}")
    starts = [0] * cache.shape[0] if indices is None else [int(i) for i in indices]
    size, length = cache.shape[axis], update.shape[axis]
    result = cache.copy()
    for b, start in enumerate(starts):
        positions = start + np.arange(length)
        if attrs["mode"] == "circular":
            positions = positions % size if size else positions
        elif length and not (start >= 0 and start + length <= size):
            raise InvalidArgumentError(
                f"{Op.TENSOR_SCATTER.value}: write_indices[{b}] = {start} with {length} "
                f"updates runs outside the {size} entries of axis {axis} (mode linear)")
        target = np.moveaxis(result[b], axis - 1, 0)
        target[positions] = np.moveaxis(update[b], axis - 1, 0)
    return [result]
