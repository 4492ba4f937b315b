"""cpu kernels of the stateful family: linear_attention and causal_conv_with_state.

linear_attention runs chunk by chunk in its parallel form: within a chunk of L tokens
(the node's ``chunk_size``) the outputs are one masked L x L product of queries and
keys (times the decay between each pair of tokens) applied to the rows the chunk adds
to the state, plus the queries against the state the chunk starts from; the state
moves on once per chunk. Without the delta rule those rows are the values; with it
(``delta``, ``gated_delta``) each token's row depends on the earlier ones through
the state it retrieves from, a unit lower-triangular system solved once per chunk
(the WY form of DeltaNet's chunked training). Grouped query heads read their shared
state by broadcasting, never copied. The reference backend's kernel (one token at a
time, einsums) is what it is checked against. causal_conv_with_state is k slices of one
multiply-add, whole-array NumPy already: the cpu backend runs the reference code.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.cpu.kernels import TABLE
from keel.backends.reference import kernels as reference
from keel.ops.registry import Op
from keel.ops.schemas.stateful import STATE_FLOATS, check_linear_attention

__all__: list[str] = []

_conv = reference.load().get(Op.CAUSAL_CONV_WITH_STATE)
TABLE.kernel(Op.CAUSAL_CONV_WITH_STATE, dtypes=_conv.dtypes, host_only=True,
             description=_conv.description)(_conv.fn)


def _split_heads(x: np.ndarray, heads: int, ct: Any) -> np.ndarray:
    """(B, T, H * D) -> (B, H, T, D) in the compute type."""
    b, t, hd = x.shape
    return x.reshape(b, t, heads, hd // heads).transpose(0, 2, 1, 3).astype(ct)


@TABLE.kernel(Op.LINEAR_ATTENTION, dtypes=STATE_FLOATS, host_only=True,
              description="chunked parallel form of every update rule (the delta rules "
                          "through one unit-triangular solve per chunk)")
def linear_attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """ONNX LinearAttention: (B, T, H_q * d_v) outputs and the final state."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    past, decay, beta = (optional_input(inputs, i) for i in (3, 4, 5))
    extra = [None if x is None else tuple(x.shape) for x in (past, decay, beta)]
    s = check_linear_attention(q.shape, k.shape, v.shape, extra[0], extra[1], extra[2], attrs)
    ct = np.float64 if q.dtype == np.float64 else np.float32
    hq, hkv = s.q_heads, s.kv_heads
    b, t, d_k, d_v = q.shape[0], q.shape[1], q.shape[2] // hq, v.shape[2] // hkv
    # Query heads grouped under their key/value head: (B, H_kv, G, T, d_k).
    qg = q.reshape(b, t, hkv, hq // hkv, d_k).transpose(0, 2, 3, 1, 4).astype(ct)
    k4, v4 = _split_heads(k, hkv, ct), _split_heads(v, hkv, ct)
    g = None if decay is None else _split_heads(decay, hkv, ct)       # (B, H_kv, T, 1|d_k)
    bt = None if beta is None else _split_heads(beta, beta.shape[2], ct)
    state = (np.zeros((b, hkv, d_k, d_v), ct) if past is None else past.astype(ct))
    y = np.empty((b, hkv, hq // hkv, t, d_v), ct)
    chunk = max(1, int(attrs["chunk_size"]))
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        state = _chunk(qg[:, :, :, c0:c1], k4[:, :, c0:c1], v4[:, :, c0:c1],
                       None if g is None else g[:, :, c0:c1],
                       None if bt is None else bt[:, :, c0:c1], state, y[:, :, :, c0:c1])
    y *= ct(attrs["scale"] or 1.0 / np.sqrt(d_k))
    output = y.transpose(0, 3, 1, 2, 4).reshape(b, t, hq * d_v).astype(q.dtype)
    return [output, state.astype(q.dtype if past is None else past.dtype)]


def _chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray | None,
           beta: np.ndarray | None, state: np.ndarray, y: np.ndarray) -> np.ndarray:
    """One chunk of L tokens: y (unscaled) written, the state after it returned.

    G is the decay summed from the chunk's start to each token (inclusive; 0 without
    decay), D[t, i] = exp(G_t - G_i) for i <= t (per key with a per-key decay), and U
    the rows the chunk adds to the state: token t reads
    y_t = (q_t * exp(G_t)) . S0 + sum_{i <= t} (q_t . D[t, i] k_i) u_i, and the chunk
    leaves exp(G_L) S0 + sum_i (exp(G_L - G_i) k_i) u_i^T. Without the delta rule U is
    V; with it u_t = beta_t (v_t - (k_t * exp(G_t)) . S0 - sum_{i < t} (k_t . D[t, i]
    k_i) u_i), a unit lower-triangular system in U solved at once."""
    L = k.shape[2]
    if L == 1:
        return _token(q, k, v, g, beta, state, y)
    causal = _causal(L)
    total = None if g is None else np.cumsum(g, axis=2)            # (B, H, L, 1|d_k)
    grown = None if total is None else np.exp(total)
    u = v
    if beta is not None:
        kk = _pair_scores(k[:, :, None], k, total, causal)[:, :, 0]   # (B, H, L, L)
        kk *= beta
        start = np.matmul(k if grown is None else k * grown, state)
        rhs = beta * (v - start)
        u = _unit_lower_solve(np.tril(kk, -1), rhs)
    from_state = np.matmul(q if grown is None else q * grown[:, :, None], state[:, :, None])
    y[...] = from_state + np.matmul(_pair_scores(q, k, total, causal), u[:, :, None])
    if total is None:
        return state + np.matmul(k.swapaxes(-1, -2), u)
    last = total[:, :, -1:]                                       # (B, H, 1, 1|d_k)
    carried = k * np.exp(last - total)                            # exp(G_L - G_i) k_i
    return state * np.exp(last).swapaxes(-1, -2) + np.matmul(carried.swapaxes(-1, -2), u)


def _token(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray | None,
           beta: np.ndarray | None, state: np.ndarray, y: np.ndarray) -> np.ndarray:
    """:func:`_chunk` of one token (a decode step), as the recurrence: decay, retrieve
    (delta rules), add k u^T, read."""
    if g is not None:
        state = state * np.exp(g).swapaxes(-1, -2)               # (B, H, 1|d_k, 1)
    u = v
    if beta is not None:
        u = beta * (v - np.matmul(k, state))
    state = state + k.swapaxes(-1, -2) * u                        # (B, H, d_k, d_v)
    np.matmul(q, state[:, :, None], out=y)
    return state


@functools.lru_cache(maxsize=16)
def _causal(n: int) -> np.ndarray:
    mask = np.tril(np.ones((n, n), dtype=bool))
    mask.flags.writeable = False
    return mask


def _pair_scores(x: np.ndarray, k: np.ndarray, total: np.ndarray | None,
                 causal: np.ndarray) -> np.ndarray:
    """sum_d x_td k_id exp(G_td - G_id) for i <= t, else 0: (B, H, G, L, L) for x
    (B, H, G, L, d_k). The exponent is formed per pair (never exp(G_t) times exp(-G_i),
    which overflows over a long chunk); pairs i > t are masked before the exponential."""
    if total is None:
        return np.matmul(x, k[:, :, None].swapaxes(-1, -2)) * causal
    diff = total[:, :, :, None, :] - total[:, :, None, :, :]     # (B, H, L, L, 1|d_k)
    decay = np.exp(np.where(causal[:, :, None], diff, -np.inf))
    if total.shape[-1] == 1:                                      # one decay per head
        return np.matmul(x, k[:, :, None].swapaxes(-1, -2)) * decay[:, :, None, :, :, 0]
    return np.einsum("bhgtd,bhtid,bhid->bhgti", x, decay, k, optimize=True)


def _unit_lower_solve(strict: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """X with (I + strict) X = rhs, ``strict`` (..., L, L) strictly lower triangular:
    forward substitution, one row of every batch and head at a time."""
    x = rhs.copy()
    for t in range(1, x.shape[-2]):
        x[..., t, :] -= np.matmul(strict[..., t:t + 1, :t], x[..., :t, :])[..., 0, :]
    return x
