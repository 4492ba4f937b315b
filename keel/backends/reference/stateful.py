"""Reference kernels of the stateful family: linear_attention and causal_conv_with_state.

Both compute in float32 (float64 for float64 inputs), as ONNX's reference does, and
cast the results back to the input types. linear_attention runs the recurrence token by
token: it is the definition every chunked or fused form is checked against.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.reference.kernels import TABLE
from keel.ops.registry import Op
from keel.ops.schemas.stateful import STATE_FLOATS, check_causal_conv, check_linear_attention

__all__: list[str] = []


def _wide(x: np.ndarray) -> Any:
    return np.float64 if x.dtype == np.float64 else np.float32


def _heads(x: np.ndarray, heads: int, ct: Any) -> np.ndarray:
    """(B, T, H * D) -> (B, H, T, D) in the compute type."""
    b, t, hd = x.shape
    return x.reshape(b, t, heads, hd // heads).transpose(0, 2, 1, 3).astype(ct)


@TABLE.kernel(Op.LINEAR_ATTENTION, dtypes=STATE_FLOATS)
def linear_attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The recurrence of ``update_rule`` over the tokens, grouped heads sharing a state."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    past, decay, beta = (optional_input(inputs, i) for i in (3, 4, 5))
    s = check_linear_attention(q.shape, k.shape, v.shape, None if past is None else past.shape,
                               None if decay is None else decay.shape,
                               None if beta is None else beta.shape, attrs)
    ct = _wide(q)
    hq, hkv = s.q_heads, s.kv_heads
    b, t, d_k, d_v = q.shape[0], q.shape[1], q.shape[2] // hq, v.shape[2] // hkv
    q4, k4, v4 = _heads(q, hq, ct), _heads(k, hkv, ct), _heads(v, hkv, ct)
    g = None if decay is None else _heads(decay, hkv, ct)           # (B, H_kv, T, 1 or d_k)
    bt = None if beta is None else _heads(beta, beta.shape[2], ct)  # (B, H_kv or 1, T, 1)
    state = (np.zeros((b, hkv, d_k, d_v), ct) if past is None else past.astype(ct))
    scale = attrs["scale"] or 1.0 / np.sqrt(d_k)
    y = np.zeros((b, hq, t, d_v), ct)
    for i in range(t):
        if g is not None:
            state = state * np.exp(g[:, :, i, :])[..., None]
        v_t = v4[:, :, i, :]
        if bt is not None:
            retrieved = np.einsum("bhdm,bhd->bhm", state, k4[:, :, i, :])
            v_t = bt[:, :, i, :] * (v_t - retrieved)
        state = state + k4[:, :, i, :, None] * v_t[:, :, None, :]
        shared = np.repeat(state, hq // hkv, axis=1)
        y[:, :, i, :] = scale * np.einsum("bhd,bhdm->bhm", q4[:, :, i, :], shared)
    output = y.transpose(0, 2, 1, 3).reshape(b, t, hq * d_v).astype(q.dtype)
    return [output, state.astype(q.dtype if past is None else past.dtype)]


@TABLE.kernel(Op.CAUSAL_CONV_WITH_STATE, dtypes=STATE_FLOATS)
def causal_conv_with_state(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                           out: Out) -> list[Any]:
    """Depthwise conv1d of ``past_state ++ input`` (valid), optional SiLU; the last k - 1
    positions of that concatenation are the new state."""
    x, w = inputs[0], inputs[1]
    bias, past = optional_input(inputs, 2), optional_input(inputs, 3)
    check_causal_conv(x.shape, w.shape, None if bias is None else bias.shape,
                      None if past is None else past.shape, attrs["activation"])
    (b, c, length), k = x.shape, w.shape[2]
    if past is None:
        past = np.zeros((b, c, k - 1), dtype=x.dtype)
    padded = np.concatenate([past.astype(x.dtype), x], axis=2)
    ct = _wide(x)
    wide = padded.astype(ct)
    y = np.zeros((b, c, length), ct)
    for j in range(k):
        y += wide[:, :, j:j + length] * w[:, 0, j].astype(ct)[None, :, None]
    if bias is not None:
        y += bias.astype(ct)[None, :, None]
    if attrs["activation"] in ("silu", "swish"):
        y = y.astype(x.dtype).astype(ct)      # ONNX rounds the conv before the activation
        y = y * (1.0 / (1.0 + np.exp(-y)))
    return [y.astype(x.dtype), padded[:, :, padded.shape[2] - (k - 1):].copy()]
