"""Conformance cases of the stateful family.

linear_attention: every update rule, decode (T = 1) and prefill, with and without a
past state, grouped and multi-query heads, per-head and per-key decay, a scalar beta,
an explicit scale, float16 and float64. causal_conv_with_state: with and without bias
and past state, kernel sizes 1 to 4, inputs shorter than the kernel, SiLU.
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


def _linear(rule: str, b: int = 2, t: int = 3, hq: int = 2, hkv: int = 2, dk: int = 4,
            dv: int = 3, past: bool = True, dtype: Any = F32, per_key: bool = False,
            beta_heads: int | None = None) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        def n(*shape: int, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
            return rng.uniform(lo, hi, shape).astype(dtype)
        decay = beta = None
        if rule in ("gated", "gated_delta"):
            decay = n(b, t, hkv * dk if per_key else hkv, lo=-0.5, hi=0.0)
        if rule in ("delta", "gated_delta"):
            beta = n(b, t, hkv if beta_heads is None else beta_heads, lo=0.0, hi=1.0)
        state = n(b, hkv, dk, dv) if past else None
        return [n(b, t, hq * dk), n(b, t, hkv * dk) / np.sqrt(dk).astype(dtype),
                n(b, t, hkv * dv), state, decay, beta]
    return make


def _tol(dtype: Any) -> dict[str, float]:
    return {"rtol": 2e-2, "atol": 2e-2} if dtype == F16 else {"rtol": 1e-5, "atol": 1e-5}


def _linear_cases() -> list[OpCase]:
    cases = []
    for rule in ("linear", "gated", "delta", "gated_delta"):
        for t in (1, 5):
            cases.append(OpCase(f"linear_attention-{rule}-t{t}", Op.LINEAR_ATTENTION,
                                _linear(rule, t=t),
                                {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": rule}))
    attrs = {"q_num_heads": 4, "kv_num_heads": 2, "update_rule": "gated_delta"}
    return [*cases,
            OpCase("linear_attention-gqa", Op.LINEAR_ATTENTION, _linear("gated_delta", hq=4),
                   attrs),
            OpCase("linear_attention-mqa", Op.LINEAR_ATTENTION,
                   _linear("gated_delta", hq=4, hkv=1), {**attrs, "kv_num_heads": 1}),
            OpCase("linear_attention-per-key-decay", Op.LINEAR_ATTENTION,
                   _linear("gated", per_key=True),
                   {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "gated"}),
            OpCase("linear_attention-scalar-beta-no-past", Op.LINEAR_ATTENTION,
                   _linear("delta", past=False, beta_heads=1),
                   {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "delta"}),
            OpCase("linear_attention-scale", Op.LINEAR_ATTENTION, _linear("linear"),
                   {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear",
                    "scale": 0.3}),
            *(OpCase(f"linear_attention-{np.dtype(dt).name}", Op.LINEAR_ATTENTION,
                     _linear("gated_delta", dtype=dt),
                     {"q_num_heads": 2, "kv_num_heads": 2}, **_tol(dt)) for dt in (F16, F64))]


def _conv(b: int, c: int, length: int, k: int, bias: bool, past: bool,
          dtype: Any = F32) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        def n(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape).astype(dtype)
        return [n(b, c, length), n(c, 1, k), n(c) if bias else None,
                n(b, c, k - 1) if past else None]
    return make


def _conv_cases() -> list[OpCase]:
    op = Op.CAUSAL_CONV_WITH_STATE
    cases = [OpCase(f"causal_conv-k{k}-bias{int(bias)}-past{int(past)}", op,
                    _conv(2, 3, 6, k, bias, past))
             for k in (1, 2, 4) for bias in (False, True) for past in (False, True)]
    return [*cases,
            OpCase("causal_conv-short-input", op, _conv(1, 2, 2, 4, False, False)),
            OpCase("causal_conv-decode-step", op, _conv(2, 4, 1, 4, True, True)),
            *(OpCase(f"causal_conv-{act}", op, _conv(2, 3, 5, 3, True, True),
                     {"activation": act}) for act in ("silu", "swish")),
            OpCase("causal_conv-float16-silu", op, _conv(1, 3, 5, 3, True, True, F16),
                   {"activation": "silu"}, **_tol(F16)),
            OpCase("causal_conv-float64", op, _conv(1, 3, 5, 3, True, True, F64))]


CASES: list[OpCase] = [*_linear_cases(), *_conv_cases()]
