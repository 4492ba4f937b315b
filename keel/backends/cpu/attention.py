"""cpu kernels of the attention family, written once against ``ctx.xp``.

``onnx_attention`` computes in float32 (float64 for float64 inputs) with
batched matmuls (BLAS). Grouped-query attention never copies key/value heads:
the query heads are viewed as (kv_heads, group) and each group multiplies its
shared key/value head by broadcasting. The softmax runs in place on the score
buffer (a native row kernel for contiguous float32 scores when the native tier
is available: ``keel.backends.cpu.fastmath``); the additive bias is built once
at (S, T) (or per batch) and broadcast.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.cpu import fastmath
from keel.backends.cpu.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.attention import (
    FLOAT_DTYPES,
    AttentionShapes,
    check_attention,
    check_float,
    check_rotary,
    check_swiglu,
    check_tensor_scatter,
)

__all__: list[str] = []


def _shape(x: Any) -> tuple[int, ...] | None:
    return None if x is None else tuple(x.shape)


def _deliver(out: Out, i: int, value: Any) -> Any:
    """``value`` as output ``i``: written into the caller's buffer when one is given."""
    if out is not None and len(out) > i and out[i] is not None:
        if out[i] is not value:
            out[i][...] = value
        return out[i]
    return value


def _ct(xp: Any, op: Op, x: Any, what: str) -> Any:
    """The compute dtype after checking that ``x`` is floating point."""
    check_float(op, DType.from_numpy(x.dtype), what)
    return xp.float64 if x.dtype == xp.float64 else xp.float32


def _heads(x: Any, heads: int) -> Any:
    """(B, S, heads * D) -> a (B, heads, S, D) view."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _bias(xp: Any, attrs: Attrs, mask: Any, q_len: int, kv_len: int, past_len: int,
          nonpad: Any, ct: Any) -> Any | None:
    """The additive bias broadcastable to (B, H, S, T), or None when nothing is masked."""
    parts = []
    if mask is not None:
        pad = [(0, 0)] * (mask.ndim - 1) + [(0, kv_len - mask.shape[-1])]
        if mask.dtype == xp.bool_:
            allowed = xp.pad(mask, pad, constant_values=False) if pad[-1][1] else mask
            parts.append(xp.where(allowed, ct(0), ct(-math.inf)))
        else:
            m = mask.astype(ct)
            parts.append(xp.pad(m, pad, constant_values=-math.inf) if pad[-1][1] else m)
    frontier = _frontier(xp, attrs, q_len, kv_len, past_len, nonpad)
    if frontier is not None:
        parts.append(xp.where(frontier, ct(0), ct(-math.inf)))
    if not parts:
        return None
    bias = parts[0]
    for p in parts[1:]:
        bias = bias + p
    return bias


def _frontier(xp: Any, attrs: Attrs, q_len: int, kv_len: int, past_len: int,
              nonpad: Any) -> Any | None:
    """Which keys each query may see under is_causal, the windows and the key padding."""
    if nonpad is not None:
        offset = (nonpad.astype(xp.int64) - q_len).reshape(-1, 1, 1, 1)
    else:
        offset = past_len
    i = xp.arange(q_len).reshape(-1, 1) + offset
    j = xp.arange(kv_len).reshape(1, -1)
    allowed = None
    rules = []
    if attrs["is_causal"]:
        rules.append(j <= i)
    if attrs["left_window_size"] >= 0:
        rules.append(i - j <= attrs["left_window_size"])
    if attrs["right_window_size"] >= 0:
        rules.append(j - i <= attrs["right_window_size"])
    if nonpad is not None:
        rules.append(j < nonpad.reshape(-1, 1, 1, 1))
    for rule in rules:
        allowed = rule if allowed is None else allowed & rule
    return allowed


def _grouped(x: Any, kv_heads: int) -> Any:
    """(B, Hq, S, X) viewed as (B, Hkv, G, S, X): query head h uses key/value head h // G."""
    b, hq, s, d = x.shape
    return x.reshape(b, kv_heads, hq // kv_heads, s, d)


def _softmax_rows(xp: Any, scores: Any, threads: int | None) -> None:
    """In-place softmax over the last axis; an all -inf row becomes zeros."""
    if xp is np and scores.flags.c_contiguous and scores.ndim and scores.shape[-1]:
        rows = scores.reshape(-1, scores.shape[-1])
        if fastmath.softmax(rows, rows, "masked", threads):
            return
    top = scores.max(axis=-1, keepdims=True)
    top = xp.where(top == -math.inf, 0, top)
    scores -= top
    xp.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    total = xp.where(total == 0, 1, total)
    scores /= total


def _scores(xp: Any, q: Any, k: Any, attrs: Attrs, ct: Any) -> Any:
    """Q·Kᵀ·scale as (B, Hkv, G, S, T) in the compute dtype."""
    kv_heads = k.shape[1]
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[3])
    qg = _grouped(q, kv_heads).astype(ct)
    kt = k.astype(ct).swapaxes(-1, -2)[:, :, None]
    scores = xp.matmul(qg, kt)
    scores *= ct(scale)
    return scores


@TABLE.kernel(Op.ONNX_ATTENTION, dtypes=FLOAT_DTYPES, supports_out=True)
def onnx_attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX Attention: Y, present_key, present_value, qk_matmul_output."""
    xp = ctx.xp
    q, k, v = inputs[0], inputs[1], inputs[2]
    mask, past_k, past_v, nonpad = (optional_input(inputs, i) for i in range(3, 7))
    dims = check_attention(q.shape, k.shape, v.shape, attrs, _shape(mask), _shape(past_k),
                           _shape(past_v), _shape(nonpad))
    ct = _ct(xp, Op.ONNX_ATTENTION, q, "Q")
    if mask is not None and mask.dtype not in (xp.bool_, q.dtype):
        raise InvalidArgumentError(
            f"{Op.ONNX_ATTENTION.value}: attn_mask must be bool or {q.dtype} like Q, got "
            f"{mask.dtype}")
    q, k, v = _as_heads(q, k, v, dims, attrs)
    if past_k is not None:
        k, v = xp.concatenate([past_k, k], axis=2), xp.concatenate([past_v, v], axis=2)
    q_len, kv_len = q.shape[2], k.shape[2]
    bias = _bias(xp, attrs, mask, q_len, kv_len, 0 if past_k is None else past_k.shape[2],
                 nonpad, ct)
    scores = _scores(xp, q, k, attrs, ct)                 # (B, Hkv, G, S, T)
    b, hq = q.shape[0], q.shape[1]
    flat = scores.reshape(b, hq, q_len, kv_len)           # a view of the same buffer
    qk = _probabilities(xp, flat, bias, attrs, ct, _wants(out, 3), ctx.threads)
    y = xp.matmul(scores, v.astype(ct)[:, :, None])         # (B, Hkv, G, S, Dv)
    y = y.reshape(b, hq, q_len, v.shape[3])
    if dims.three_d:
        y = y.transpose(0, 2, 1, 3).reshape(b, q_len, -1)
    results = [_deliver(out, 0, y.astype(q.dtype, copy=False))]
    # present_key/value: fresh arrays (never the caller's inputs), only when asked for.
    for i, cache in ((1, k), (2, v)):
        if _wants(out, i):
            results.append(_deliver(out, i, cache.astype(q.dtype)))
    if qk is not None:
        results.append(_deliver(out, 3, qk.astype(q.dtype, copy=False)))
    # As many results as output buffers given; all four when none are.
    return results


def _probabilities(xp: Any, flat: Any, bias: Any, attrs: Attrs, ct: Any,
                   want_qk: bool, threads: int | None) -> Any | None:
    """Turn the scores in ``flat`` into attention probabilities in place: soft cap, bias,
    softmax, dead rows zeroed. Returns the qk_matmul_output snapshot when asked for."""
    mode = attrs["qk_matmul_output_mode"]
    qk = flat.copy() if want_qk and mode == 0 else None
    if attrs["softcap"] > 0:
        cap = ct(attrs["softcap"])
        flat /= cap
        xp.tanh(flat, out=flat)
        flat *= cap
    if want_qk and mode == 1:
        qk = flat.copy()
    if bias is not None:
        flat += bias
    if want_qk and mode == 2:
        qk = flat.copy()
    _softmax_rows(xp, flat, threads)
    if bias is not None:
        # Rows whose bias masks every key attend nothing: zeros, whatever the scores
        # (NaN included, so a select rather than a product).
        dead = (bias == -math.inf).all(axis=-1, keepdims=True)
        if bool(dead.any()):
            flat[...] = xp.where(dead, ct(0), flat)
    return flat.copy() if want_qk and mode == 3 else qk


def _wants(out: Out, i: int) -> bool:
    """Whether output ``i`` is asked for: always when the caller gave no buffers."""
    return out is None or len(out) > i


def _as_heads(q: Any, k: Any, v: Any, dims: AttentionShapes,
              attrs: Attrs) -> tuple[Any, Any, Any]:
    if not dims.three_d:
        return q, k, v
    qh, kvh = attrs["q_num_heads"], attrs["kv_num_heads"]
    return _heads(q, qh), _heads(k, kvh), _heads(v, kvh)


@TABLE.kernel(Op.ROTARY_EMBEDDING, dtypes=FLOAT_DTYPES, supports_out=True)
def rotary_embedding(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Rotate feature pairs by the cached angles of each position."""
    xp = ctx.xp
    x, cos, sin, pos = inputs[0], inputs[1], inputs[2], optional_input(inputs, 3)
    ct = _ct(xp, Op.ROTARY_EMBEDDING, x, "X")
    rot = check_rotary(x.shape, cos.shape, sin.shape, _shape(pos), attrs)
    y = x.astype(ct)                                   # a fresh copy: rotated in place below
    # (B, S, H, D) views of x and y: the caches are (B, S, rot/2).
    if x.ndim == 3:
        ys, xs = y.reshape(*x.shape[:2], attrs["num_heads"], -1), \
            x.reshape(*x.shape[:2], attrs["num_heads"], -1)
    else:
        ys, xs = y.transpose(0, 2, 1, 3), x.transpose(0, 2, 1, 3)
    rot = rot or xs.shape[-1]
    if pos is not None:
        cos, sin = xp.take(cos, pos, axis=0), xp.take(sin, pos, axis=0)
    c, s = cos.astype(ct)[:, :, None, :], sin.astype(ct)[:, :, None, :]
    if attrs["interleaved"]:
        x1, x2 = xs[..., 0:rot:2].astype(ct), xs[..., 1:rot:2].astype(ct)
        ys[..., 0:rot:2], ys[..., 1:rot:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        half = rot // 2
        x1, x2 = xs[..., :half].astype(ct), xs[..., half:rot].astype(ct)
        ys[..., :half], ys[..., half:rot] = x1 * c - x2 * s, x1 * s + x2 * c
    return [_deliver(out, 0, y.astype(x.dtype, copy=False))]


@TABLE.kernel(Op.SWIGLU, dtypes=FLOAT_DTYPES, supports_out=True)
def swiglu(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """A * sigmoid(alpha * A) * B, computed in one buffer."""
    xp = ctx.xp
    a, b = inputs
    ct = _ct(xp, Op.SWIGLU, a, "A")
    check_swiglu(a.shape, b.shape)
    if b.dtype != a.dtype:
        raise InvalidArgumentError(
            f"{Op.SWIGLU.value}: A and B must have one dtype, got {a.dtype} and {b.dtype}")
    y = a.astype(ct)
    y *= ct(-attrs["alpha"])
    xp.exp(y, out=y)
    y += 1
    xp.divide(a, y, out=y)
    y *= b
    return [_deliver(out, 0, y.astype(a.dtype, copy=False))]


@TABLE.kernel(Op.TENSOR_SCATTER, supports_out=True)
def tensor_scatter(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """past_cache with update written along axis from write_indices[b] on."""
    xp = ctx.xp
    cache, update, indices = inputs[0], inputs[1], optional_input(inputs, 2)
    axis = check_tensor_scatter(cache.shape, update.shape, _shape(indices), attrs)
    if update.dtype != cache.dtype:
        raise InvalidArgumentError(
            f"{Op.TENSOR_SCATTER.value}: update must have past_cache's dtype {cache.dtype}, "
            f"got {update.dtype}")
    result = out[0] if out is not None and len(out) and out[0] is not None \
        else xp.empty(cache.shape, dtype=cache.dtype)
    result[...] = cache
    starts = [0] * cache.shape[0] if indices is None else [int(i) for i in indices.tolist()]
    size, length = cache.shape[axis], update.shape[axis]
    for b, start in enumerate(starts):
        target = xp.moveaxis(result[b], axis - 1, 0)
        source = xp.moveaxis(update[b], axis - 1, 0)
        if attrs["mode"] == "circular" and size:
            target[(start + xp.arange(length)) % size] = source
        elif length and not (start >= 0 and start + length <= size):
            raise InvalidArgumentError(
                f"{Op.TENSOR_SCATTER.value}: write_indices[{b}] = {start} with {length} "
                f"updates runs outside the {size} entries of axis {axis} (mode linear)")
        else:
            target[start:start + length] = source
    return [result]

