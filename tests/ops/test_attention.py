"""The attention family: kernels against ONNX's oracle, importer routing, typed errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.graph.importers.onnx import import_onnx
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._extra_support import (
    assert_close,
    keel_run,
    onnx_model,
    onnx_run,
    run_both,
    run_cpu,
    run_ref,
)

RNG = np.random.default_rng(3)
ATT = Op.ONNX_ATTENTION


def _n(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def _bool(*shape: int) -> np.ndarray:
    m = RNG.random(shape) > 0.4
    m[..., 0] = True
    return m


Q4, K4, V4 = _n(2, 4, 3, 8), _n(2, 4, 5, 8), _n(2, 4, 5, 6)
# (id, inputs (None = absent), attrs)
ATTENTION_ORACLE: list[tuple[str, list[Any], dict[str, Any]]] = [
    ("plain", [Q4, K4, V4], {}),
    ("scaled-causal", [Q4, K4, V4], {"scale": 0.2, "is_causal": 1}),
    ("gqa", [_n(2, 6, 3, 8), _n(2, 2, 5, 8), _n(2, 2, 5, 8)], {}),
    ("3d-gqa-causal", [_n(2, 4, 24), _n(2, 4, 8), _n(2, 4, 8)],
     {"q_num_heads": 6, "kv_num_heads": 2, "is_causal": 1}),
    ("float-mask-softcap", [Q4, K4, V4, _n(3, 5)], {"softcap": 1.5}),
    ("bool-mask-4d", [Q4, K4, V4, _bool(2, 1, 3, 5)], {}),
    ("short-mask-causal", [Q4, K4, V4, _n(4, 3, 4)], {"is_causal": 1}),
    ("past", [_n(1, 2, 2, 4), _n(1, 2, 2, 4), _n(1, 2, 2, 4), _bool(2, 5), _n(1, 2, 3, 4),
              _n(1, 2, 3, 4)], {"is_causal": 1}),
]


@pytest.mark.parametrize(("inputs", "attrs"),
                         [pytest.param(i, a, id=n) for n, i, a in ATTENTION_ORACLE])
def test_attention_matches_onnx(inputs: list[Any], attrs: dict[str, Any]) -> None:
    n_out = 3 if len(inputs) > 4 else 1
    expected = onnx_run("Attention", inputs, n_outputs=n_out, **attrs)
    actual = run_both(ATT, inputs, rtol=1e-5, atol=1e-6, **attrs)[:n_out]
    assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_qk_matmul_output_modes(mode: int) -> None:
    inputs = [Q4, K4, V4, _n(3, 5)]
    attrs = {"qk_matmul_output_mode": mode, "softcap": 2.0}
    y, _, _, qk = run_both(ATT, inputs, rtol=1e-5, atol=1e-6, **attrs)
    scores = np.einsum("bhsd,bhtd->bhst", Q4.astype(np.float64), K4) / np.sqrt(8)
    capped = 2.0 * np.tanh(scores / 2.0)
    biased = capped + inputs[3]
    probs = np.exp(biased) / np.exp(biased).sum(-1, keepdims=True)
    want = (scores, capped, biased, probs)[mode]
    np.testing.assert_allclose(qk, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, probs @ V4, rtol=1e-5, atol=1e-6)


def test_window_and_nonpad_match_onnx_opset_25() -> None:
    q, k, v = _n(2, 2, 4, 4), _n(2, 2, 6, 4), _n(2, 2, 6, 4)
    lens = np.array([6, 3], dtype=np.int64)
    attrs = {"is_causal": 1, "left_window_size": 2}
    expected = onnx_run("Attention", [q, k, v, None, None, None, lens], opset=25, **attrs)
    assert_close(run_both(ATT, [q, k, v, None, None, None, lens], **attrs)[:1], expected)


def test_fully_masked_rows_give_zeros_not_nan() -> None:
    q = _n(1, 1, 3, 4)
    q[0, 0, 1] = np.nan          # a masked row's scores may be anything, NaN included
    mask = np.ones((3, 5), bool)
    mask[1] = False
    y, *_ = run_both(ATT, [q, _n(1, 1, 5, 4), _n(1, 1, 5, 4), mask])
    assert np.all(y[0, 0, 1] == 0) and np.all(np.isfinite(y))


def test_cpu_writes_into_given_buffers() -> None:
    want = run_ref(ATT, [Q4, K4, V4])
    bufs = [np.empty_like(w) for w in want]
    got = run_cpu(ATT, [Q4, K4, V4], out=bufs)
    assert all(g is b for g, b in zip(got, bufs, strict=True))
    assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_attention_inference() -> None:
    schema = get_schema(ATT)
    f = DType.FLOAT32
    types = [TensorType(f, ("b", 5, 24)), TensorType(f, ("b", 7, 8)), TensorType(f, ("b", 7, 12))]
    attrs = schema.normalize_attrs({"q_num_heads": 6, "kv_num_heads": 2})
    out = schema.infer_types(types, attrs)
    assert out == [TensorType(f, ("b", 5, 36)), TensorType(f, ("b", 2, 7, 4)),
                   TensorType(f, ("b", 2, 7, 6)), TensorType(f, ("b", 6, 5, 7))]


@pytest.mark.parametrize(("inputs", "attrs", "match"), [
    ([Q4, K4, V4], {"qk_matmul_output_mode": 4}, "qk_matmul_output_mode must be 0, 1, 2 or 3"),
    ([Q4, K4, V4], {"softcap": -1.0}, "softcap must be >= 0"),
    ([Q4, K4, V4], {"left_window_size": -2}, r"left_window_size must be -1 \(unbounded\)"),
    ([_n(2, 3, 12), _n(2, 5, 12), _n(2, 5, 12)], {},
     "3-D Q, K, V need q_num_heads and kv_num_heads > 0"),
    ([_n(2, 3, 12), _n(2, 5, 12), _n(2, 5, 12)], {"q_num_heads": 5, "kv_num_heads": 3},
     "Q's hidden size 12 is not divisible by its 5 heads"),
    ([_n(2, 6, 3, 8), _n(2, 4, 5, 8), _n(2, 4, 5, 8)], {},
     "the 6 query heads must be a multiple of the 4 key/value heads"),
    ([Q4, _n(2, 4, 5, 4), V4], {}, "differ in the head size"),
    ([Q4, K4, V4, _n(3, 6)], {}, "attn_mask has 6 keys, more than the 5 keys attended"),
    ([Q4, K4, V4, _n(2, 3, 3, 5)], {}, r"attn_mask of shape \(2, 3, 3, 5\) does not broadcast"),
    ([Q4, K4, V4, None, _n(2, 4, 2, 8)], {}, "past_key and past_value go together"),
    ([Q4, K4, V4, _n(3, 5).astype(np.float64)], {}, "attn_mask must be bool or float32"),
    ([Q4.astype(np.int32), K4, V4], {}, "Q must be float16, bfloat16, float32 or float64"),
])
def test_attention_typed_errors(inputs: list[Any], attrs: dict[str, Any], match: str) -> None:
    for run in (run_ref, run_cpu):
        with pytest.raises(InvalidArgumentError, match=match):
            run(ATT, inputs, **attrs)


# ---- the importer: fused attention where it fits, onnx_attention elsewhere -----------------
@pytest.mark.parametrize(("inputs", "attrs", "outputs", "op"), [
    ([Q4, K4, V4], {}, ["Y"], Op.ATTENTION),
    ([Q4, K4, V4], {"is_causal": 1}, ["Y"], Op.ATTENTION),
    ([Q4, K4, V4, _bool(3, 5)], {}, ["Y"], Op.ONNX_ATTENTION),
    ([Q4, K4, V4], {"softcap": 3.0}, ["Y"], Op.ONNX_ATTENTION),
    ([Q4, K4, V4], {}, ["Y", "", "", "qk"], Op.ONNX_ATTENTION),
    ([_n(2, 4, 24), _n(2, 4, 8), _n(2, 4, 8)], {"q_num_heads": 6, "kv_num_heads": 2}, ["Y"],
     Op.ONNX_ATTENTION),
])
def test_importer_routes_attention(inputs: list[Any], attrs: dict[str, Any],
                                   outputs: list[str], op: Op) -> None:
    graph = import_onnx(onnx_model("Attention", inputs, outputs=outputs, **attrs))
    assert [n.op for n in graph.nodes] == [op]
    got = keel_run("Attention", inputs, outputs=outputs, **attrs)
    assert_close(got, onnx_run("Attention", inputs, outputs=outputs, **attrs), 1e-5, 1e-6)


def test_constant_float_mask_with_a_dead_row_is_not_fused() -> None:
    from onnx import numpy_helper

    mask = np.zeros((3, 5), np.float32)
    mask[2] = -np.inf
    model = onnx_model("Attention", [Q4, K4, V4])
    model.graph.node[0].input.append("mask")
    model.graph.initializer.append(numpy_helper.from_array(mask, "mask"))
    graph = import_onnx(model)
    assert [n.op for n in graph.nodes] == [Op.ONNX_ATTENTION]
    mask[2] = 0.0
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(mask, "mask"))
    assert [n.op for n in import_onnx(model).nodes] == [Op.ATTENTION]


# ---- rotary embedding, SwiGLU, TensorScatter --------------------------------------------------
def _caches(*lead: int, half: int) -> list[np.ndarray]:
    angles = RNG.random((*lead, half)) * 6
    return [np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)]


@pytest.mark.parametrize(("x", "caches", "pos", "attrs"), [
    (_n(2, 3, 4, 8), _caches(2, 4, half=4), None, {}),
    (_n(2, 3, 4, 8), _caches(9, half=4), RNG.integers(0, 9, (2, 4)), {"interleaved": 1}),
    (_n(2, 4, 12), _caches(2, 4, half=2), None,
     {"num_heads": 2, "rotary_embedding_dim": 4}),
    (_n(2, 4, 12), _caches(7, half=2), RNG.integers(0, 7, (2, 4)),
     {"num_heads": 2, "rotary_embedding_dim": 4, "interleaved": 1}),
])
def test_rotary_embedding_matches_onnx(x: np.ndarray, caches: list[np.ndarray],
                                       pos: np.ndarray | None, attrs: dict[str, Any]) -> None:
    inputs = [x, *caches] + ([] if pos is None else [pos])
    expected = onnx_run("RotaryEmbedding", inputs, **attrs)
    assert_close(run_both(Op.ROTARY_EMBEDDING, inputs, **attrs), expected, 1e-5, 1e-6)


def test_rotary_embedding_errors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"a 3-D input .* needs num_heads > 0"):
        run_ref(Op.ROTARY_EMBEDDING, [_n(2, 3, 8), *_caches(2, 3, half=4)])
    with pytest.raises(InvalidArgumentError, match="rotary_embedding_dim 3 must be even"):
        run_cpu(Op.ROTARY_EMBEDDING, [_n(2, 3, 4, 8), *_caches(2, 4, half=1)],
                rotary_embedding_dim=3)
    with pytest.raises(InvalidArgumentError, match=r"cos_cache must have shape \(B, S"):
        run_cpu(Op.ROTARY_EMBEDDING, [_n(2, 3, 4, 8), *_caches(2, 5, half=4)])


def test_swiglu_matches_onnx_and_rejects_broadcasting() -> None:
    a, b = _n(3, 6), _n(3, 6)
    expected = onnx_run("SwiGLU", [a, b], opset=28, alpha=1.5)
    assert_close(run_both(Op.SWIGLU, [a, b], alpha=1.5), expected, 1e-5, 1e-6)
    with pytest.raises(InvalidArgumentError, match=r"same shape .no broadcasting"):
        run_cpu(Op.SWIGLU, [a, b[:1]])


@pytest.mark.parametrize(("shapes", "starts", "attrs"), [
    (((2, 3, 8, 4), (2, 3, 3, 4)), [0, 5], {}),
    (((2, 3, 8, 4), (2, 3, 3, 4)), [6, 7], {"mode": "circular"}),
    (((2, 5, 3), (2, 2, 3)), None, {"axis": 1}),
])
def test_tensor_scatter_matches_onnx(shapes: tuple[tuple[int, ...], ...],
                                     starts: list[int] | None, attrs: dict[str, Any]) -> None:
    inputs = [_n(*shapes[0]), _n(*shapes[1])]
    if starts is not None:
        inputs.append(np.array(starts, dtype=np.int64))
    expected = onnx_run("TensorScatter", inputs, opset=24, **attrs)
    assert_close(run_both(Op.TENSOR_SCATTER, inputs, **attrs), expected)


def test_tensor_scatter_errors() -> None:
    cache, update = _n(2, 6, 3), _n(2, 2, 3)
    with pytest.raises(InvalidArgumentError, match=r"write_indices\[1\] = 5 with 2 updates"):
        run_cpu(Op.TENSOR_SCATTER, [cache, update, np.array([0, 5])], axis=1)
    with pytest.raises(InvalidArgumentError, match="mode must be linear or circular"):
        run_ref(Op.TENSOR_SCATTER, [cache, update], mode="ring", axis=1)
    with pytest.raises(InvalidArgumentError, match="axis must not be the batch axis 0"):
        run_ref(Op.TENSOR_SCATTER, [cache, update], axis=0)
