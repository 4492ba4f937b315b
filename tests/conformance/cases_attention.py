"""Conformance cases of the attention family.

``onnx_attention``: 4-D and 3-D inputs, grouped-query heads, float and boolean
masks of ranks 1 to 4 (shorter than the keys too), is_causal, softcap, scale,
sliding windows, past key/value caches, nonpad_kv_seqlen (with fully masked
rows), every qk_matmul_output_mode, float16/float64 and zero-size sequences.
``rotary_embedding``: 3-D and 4-D, halves and interleaved pairs, partial
rotation, with and without position ids. ``swiglu`` and ``tensor_scatter``
(linear, circular, other axes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]
F16, F32, F64 = np.float16, np.float32, np.float64


def _tol(dtype: Any) -> dict[str, Any]:
    dt = np.dtype(dtype)
    if dt == np.float16:
        return {"rtol": 5e-3, "atol": 5e-3}
    if dt == np.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    return {"rtol": 1e-4, "atol": 1e-5}


def _attn(b: int = 2, hq: int = 4, hkv: int = 4, s: int = 3, t: int = 5, d: int = 8,
          dv: int = 8, dtype: Any = F32, three_d: bool = False,
          mask: tuple[int, ...] | None = None, bool_mask: bool = False, past: int = 0,
          nonpad: list[int] | None = None) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        def n(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape).astype(dtype)
        if three_d:
            q, k, v = n(b, s, hq * d), n(b, t, hkv * d), n(b, t, hkv * dv)
        else:
            q, k, v = n(b, hq, s, d), n(b, hkv, t, d), n(b, hkv, t, dv)
        out: list[np.ndarray | None] = [q, k, v, None, None, None, None]
        if mask is not None:
            if bool_mask:
                m = rng.random(mask) > 0.3
                m[..., 0] = True
                out[3] = m
            else:
                out[3] = n(*mask)
        if past:
            out[4], out[5] = n(b, hkv, past, d), n(b, hkv, past, dv)
        if nonpad is not None:
            out[6] = np.array(nonpad, dtype=np.int64)
        while out[-1] is None:
            out.pop()
        return out
    return make


def _attention_cases() -> list[OpCase]:
    op = Op.ONNX_ATTENTION
    c = [
        OpCase("onnx_attention-4d", op, _attn(), **_tol(F32)),
        OpCase("onnx_attention-4d-f64", op, _attn(dtype=F64), **_tol(F64)),
        OpCase("onnx_attention-4d-f16", op, _attn(dtype=F16), **_tol(F16)),
        OpCase("onnx_attention-3d", op, _attn(three_d=True),
               {"q_num_heads": 4, "kv_num_heads": 4}, **_tol(F32)),
        OpCase("onnx_attention-3d-gqa-dv", op, _attn(hq=6, hkv=2, dv=4, three_d=True),
               {"q_num_heads": 6, "kv_num_heads": 2}, **_tol(F32)),
        OpCase("onnx_attention-gqa", op, _attn(hq=6, hkv=3), **_tol(F32)),
        OpCase("onnx_attention-mqa-causal", op, _attn(hq=4, hkv=1, s=5, t=5),
               {"is_causal": True}, **_tol(F32)),
        OpCase("onnx_attention-mask2d-float", op, _attn(mask=(3, 5)), **_tol(F32)),
        OpCase("onnx_attention-mask4d-bool", op, _attn(mask=(2, 1, 3, 5), bool_mask=True),
               **_tol(F32)),
        OpCase("onnx_attention-mask3d-short", op, _attn(mask=(4, 3, 4)), **_tol(F32)),
        OpCase("onnx_attention-mask1d-bool-causal", op, _attn(mask=(5,), bool_mask=True),
               {"is_causal": True, "scale": 0.3}, **_tol(F32)),
        OpCase("onnx_attention-softcap", op, _attn(mask=(3, 5)),
               {"softcap": 2.0, "qk_matmul_output_mode": 1}, **_tol(F32)),
        OpCase("onnx_attention-qk-mode2", op, _attn(mask=(3, 5)),
               {"qk_matmul_output_mode": 2}, **_tol(F32)),
        OpCase("onnx_attention-qk-mode3", op, _attn(hq=4, hkv=2),
               {"qk_matmul_output_mode": 3, "is_causal": True}, **_tol(F32)),
        OpCase("onnx_attention-past-causal", op, _attn(s=2, t=2, past=4, mask=(2, 6)),
               {"is_causal": True}, **_tol(F32)),
        OpCase("onnx_attention-window", op, _attn(s=6, t=6),
               {"left_window_size": 2, "right_window_size": 1}, **_tol(F32)),
        OpCase("onnx_attention-nonpad-dead-rows", op, _attn(s=4, t=6, nonpad=[6, 2]),
               {"is_causal": True}, **_tol(F32)),
        OpCase("onnx_attention-empty-queries", op, _attn(s=0), **_tol(F32)),
    ]
    return c


def _rotary(shape: tuple[int, ...], rot: int, positions: bool, max_pos: int = 10,
            dtype: Any = F32) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rng.standard_normal(shape).astype(dtype)
        b, s = shape[0], shape[1] if len(shape) == 3 else shape[2]
        lead = (max_pos,) if positions else (b, s)
        angles = rng.random((*lead, rot // 2)) * 6
        out: list[np.ndarray | None] = [x, np.cos(angles).astype(dtype),
                                        np.sin(angles).astype(dtype)]
        if positions:
            out.append(rng.integers(0, max_pos, (b, s)).astype(np.int64))
        return out
    return make


def _rotary_cases() -> list[OpCase]:
    op = Op.ROTARY_EMBEDDING
    return [
        OpCase("rotary_embedding-4d", op, _rotary((2, 3, 4, 8), 8, True), **_tol(F32)),
        OpCase("rotary_embedding-4d-interleaved", op, _rotary((2, 3, 4, 8), 8, False),
               {"interleaved": True}, **_tol(F32)),
        OpCase("rotary_embedding-3d-partial", op, _rotary((2, 5, 12), 4, True),
               {"num_heads": 2, "rotary_embedding_dim": 4}, **_tol(F32)),
        OpCase("rotary_embedding-3d-interleaved-partial", op, _rotary((2, 5, 12), 4, False),
               {"num_heads": 2, "rotary_embedding_dim": 4, "interleaved": True}, **_tol(F32)),
        OpCase("rotary_embedding-f16", op, _rotary((1, 2, 3, 6), 6, True, dtype=F16),
               **_tol(F16)),
        OpCase("rotary_embedding-f64", op, _rotary((1, 2, 3, 6), 6, True, dtype=F64),
               **_tol(F64)),
        OpCase("rotary_embedding-empty", op, _rotary((2, 0, 4, 8), 8, True), **_tol(F32)),
    ]


def _pair(shape: tuple[int, ...], dtype: Any) -> Make:
    return lambda rng: [(rng.standard_normal(shape) * 3).astype(dtype),
                        rng.standard_normal(shape).astype(dtype)]


def _scatter(cache: tuple[int, ...], update: tuple[int, ...], starts: list[int] | None,
             dtype: Any = F32) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        out: list[np.ndarray | None] = [rng.standard_normal(cache).astype(dtype),
                                        rng.standard_normal(update).astype(dtype)]
        if starts is not None:
            out.append(np.array(starts, dtype=np.int64))
        return out
    return make


def _other_cases() -> list[OpCase]:
    sw, ts = Op.SWIGLU, Op.TENSOR_SCATTER
    cases = [OpCase(f"swiglu-{np.dtype(dt).name}", sw, _pair((3, 7), dt), **_tol(dt))
             for dt in (F32, F64, F16)]
    cases += [
        OpCase("swiglu-alpha-4d", sw, _pair((2, 3, 2, 5), F32), {"alpha": 1.702}, **_tol(F32)),
        OpCase("swiglu-empty", sw, _pair((0, 4), F32)),
        OpCase("tensor_scatter-linear", ts, _scatter((2, 3, 8, 4), (2, 3, 2, 4), [1, 6])),
        OpCase("tensor_scatter-no-indices", ts, _scatter((2, 5, 3), (2, 2, 3), None),
               {"axis": 1}),
        OpCase("tensor_scatter-circular", ts, _scatter((2, 2, 5, 3), (2, 2, 3, 3), [4, 0]),
               {"mode": "circular"}),
        OpCase("tensor_scatter-last-axis-f16", ts,
               _scatter((3, 2, 6), (3, 2, 2), [0, 2, 4], F16), {"axis": -1}),
        OpCase("tensor_scatter-int64", ts, lambda rng: [
            rng.integers(0, 9, (2, 4, 2)), rng.integers(0, 9, (2, 1, 2)),
            np.array([3, 0], dtype=np.int64)], {"axis": 1}),
        OpCase("tensor_scatter-empty-update", ts, _scatter((2, 4, 3), (2, 0, 3), [1, 2]),
               {"axis": 1}),
    ]
    return cases


CASES: list[OpCase] = _attention_cases() + _rotary_cases() + _other_cases()
