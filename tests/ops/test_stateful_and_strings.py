"""LinearAttention, CausalConvWithState, the string ops and TfIdfVectorizer against ONNX's reference
evaluator (every conformance case, every output), through keel's backends and a loaded
model, and their typed errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import keel
from keel.errors import InvalidArgumentError, ModelFormatError
from keel.ops.registry import Op
from tests.conformance import cases_stateful, cases_strings
from tests.conformance.harness import OpCase, case_inputs
from tests.ops._kernels import run_cpu, run_ref

ONNX_OPS = {Op.LINEAR_ATTENTION: ("LinearAttention", 2), Op.CAUSAL_CONV_WITH_STATE:
            ("CausalConvWithState", 2), Op.STRING_CONCAT: ("StringConcat", 1),
            Op.STRING_SPLIT: ("StringSplit", 2), Op.STRING_NORMALIZER: ("StringNormalizer", 1),
            Op.REGEX_FULL_MATCH: ("RegexFullMatch", 1),
            Op.TFIDF_VECTORIZER: ("TfIdfVectorizer", 1)}
CASES = [*cases_stateful.CASES, *cases_strings.CASES]


def _model(case: OpCase, inputs: Sequence[np.ndarray | None]) -> onnx.ModelProto:
    op_type, outs = ONNX_OPS[case.op]
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    while names and not names[-1]:
        names.pop()
    attrs = {k: int(v) if isinstance(v, bool) else v for k, v in case.attrs.items()}
    node = helper.make_node(op_type, names, [f"out{i}" for i in range(outs)], **attrs)
    graph = helper.make_graph(
        [node], "single",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs, strict=False) if x is not None],
        [helper.make_tensor_value_info(f"out{i}", onnx.TensorProto.UNDEFINED, None)
         for i in range(outs)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)])


def _feeds(inputs: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
    return {f"in{i}": x for i, x in enumerate(inputs) if x is not None}


def _same(actual: Any, expected: Any, case: OpCase) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, case.id
    if expected.dtype.kind in "OU":
        assert actual.tolist() == expected.astype(object).tolist(), case.id
    elif expected.dtype.kind == "f":
        assert actual.dtype == expected.dtype, case.id
        np.testing.assert_allclose(actual, expected, rtol=max(case.rtol, 1e-5),
                                   atol=max(case.atol, 1e-5), err_msg=case.id)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=case.id)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
def test_kernels_match_onnx(case: OpCase, run: Any) -> None:
    inputs = case_inputs(case)
    expected = ReferenceEvaluator(_model(case, inputs)).run(None, _feeds(inputs))
    actual = run(case.op, inputs, **case.attrs)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        _same(a, e, case)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in (
    "linear_attention-gqa", "linear_attention-gated-t5", "causal_conv-k4-bias1-past1",
    "string_split-comma", "string_normalizer-lower-stopwords", "regex_full_match")],
    ids=lambda c: c.id)
def test_a_loaded_model_matches_onnx(case: OpCase) -> None:
    inputs = case_inputs(case)
    m = _model(case, inputs)
    expected = ReferenceEvaluator(m).run(None, _feeds(inputs))
    model = keel.load_model(m.SerializeToString(), backend="cpu", plan_cache=False)
    got = model.run(None, _feeds(inputs))
    for a, e in zip(got, expected, strict=True):
        _same(a, e, case)


def test_linear_attention_decode_continues_a_prefill() -> None:
    """Prefill T tokens at once = prefill T - 1, then one decode step from its state."""
    case = next(c for c in CASES if c.id == "linear_attention-gated_delta-t5")
    q, k, v, past, decay, beta = case_inputs(case)
    attrs = case.attrs
    whole = run_ref(Op.LINEAR_ATTENTION, [q, k, v, past, decay, beta], **attrs)
    head = run_ref(Op.LINEAR_ATTENTION, [x[:, :4] if x is not past else x  # type: ignore
                                         for x in (q, k, v, past, decay, beta)], **attrs)
    step = run_ref(Op.LINEAR_ATTENTION, [q[:, 4:], k[:, 4:], v[:, 4:], head[1],
                                         decay[:, 4:], beta[:, 4:]], **attrs)
    np.testing.assert_allclose(step[0], whole[0][:, 4:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(step[1], whole[1], rtol=1e-5, atol=1e-6)


F = np.float32
ERRORS = [
    ("heads", Op.LINEAR_ATTENTION, [np.ones((1, 1, 6), F)] * 3,
     {"q_num_heads": 3, "kv_num_heads": 2, "update_rule": "linear"},
     "q_num_heads \\(3\\) must be a positive multiple of kv_num_heads \\(2\\)"),
    ("rule", Op.LINEAR_ATTENTION, [np.ones((1, 1, 4), F)] * 3,
     {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "fast"},
     "update_rule 'fast' is not one of linear, gated, delta, gated_delta"),
    ("no-decay", Op.LINEAR_ATTENTION, [np.ones((1, 1, 4), F)] * 3,
     {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "gated"},
     "update_rule 'gated' needs decay"),
    ("past", Op.LINEAR_ATTENTION, [*[np.ones((1, 1, 4), F)] * 3, np.ones((1, 2, 2, 3), F)],
     {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear"},
     "past_state must have shape"),
    ("activation", Op.CAUSAL_CONV_WITH_STATE, [np.ones((1, 2, 3), F), np.ones((2, 1, 2), F)],
     {"activation": "relu"}, "activation 'relu' is not one of none, silu, swish"),
    ("past-length", Op.CAUSAL_CONV_WITH_STATE,
     [np.ones((1, 2, 3), F), np.ones((2, 1, 3), F), None, np.ones((1, 2, 1), F)], {},
     "past_state length and kernel size - 1 differ \\(1 and 2\\)"),
    ("pattern", Op.REGEX_FULL_MATCH, [np.array(["a"], dtype=object)], {"pattern": "("},
     "pattern '\\(' is not a valid regular expression"),
    ("normalizer-rank", Op.STRING_NORMALIZER, [np.array([["a"], ["b"]], dtype=object)], {},
     "input must be \\(C,\\) or \\(1, C\\)"),
]


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
@pytest.mark.parametrize(("chunk", "per_key"), [(64, False), (7, True), (1, False)])
def test_linear_attention_long_prefill_matches_the_reference(rule: str, chunk: int,
                                                             per_key: bool) -> None:
    # 150 tokens: chunks of 64 (two full, one ragged), 7 and 1; grouped query heads, a
    # past state, and a decay strong enough (-3 a token) that exp(-sum) over a chunk
    # would overflow float32: the parallel form must take each pair's decay difference.
    make = cases_stateful._linear(rule, b=2, t=150, hq=4, hkv=2, dk=8, dv=6,
                                  per_key=per_key and rule in ("gated", "gated_delta"))
    inputs = make(np.random.default_rng(31))
    if inputs[4] is not None:
        inputs[4] = inputs[4] * np.float32(6)                 # decay in [-3, 0]
    attrs = {"q_num_heads": 4, "kv_num_heads": 2, "update_rule": rule, "chunk_size": chunk}
    got, want = run_cpu(Op.LINEAR_ATTENTION, inputs, **attrs), \
        run_ref(Op.LINEAR_ATTENTION, inputs, **attrs)
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_equal_compares_strings_as_onnx_does() -> None:
    a = np.array([["cat", "dog"], ["", "émigré"]], dtype=object)
    b = np.array(["cat", "émigré"], dtype=object)              # broadcast along rows
    node = helper.make_node("Equal", ["a", "b"], ["y"])
    graph = helper.make_graph(
        [node], "equal", [helper.make_tensor_value_info("a", onnx.TensorProto.STRING, [2, 2]),
                          helper.make_tensor_value_info("b", onnx.TensorProto.STRING, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.BOOL, [2, 2])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model = keel.load_model(m.SerializeToString(), backend="cpu")
    want = ReferenceEvaluator(m).run(None, {"a": a, "b": b})[0]
    for _ in range(2):                      # a second run on the compiled program
        np.testing.assert_array_equal(model.run(None, {"a": a, "b": b})[0], want)
    np.testing.assert_array_equal(run_cpu(Op.EQUAL, [a, b])[0], run_ref(Op.EQUAL, [a, b])[0])
    with pytest.raises(ModelFormatError, match="inputs of one dtype, got string, float32"):
        mixed = helper.make_graph(
            [node], "mixed",
            [helper.make_tensor_value_info("a", onnx.TensorProto.STRING, [2]),
             helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [2])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.BOOL, [2])])
        keel.load_model(helper.make_model(
            mixed, opset_imports=[helper.make_opsetid("", 19)]).SerializeToString())


@pytest.mark.parametrize(("what", "op", "inputs", "attrs", "match"), ERRORS,
                         ids=[e[0] for e in ERRORS])
def test_typed_errors(what: str, op: Op, inputs: list[Any], attrs: dict[str, Any],
                      match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        run_ref(op, inputs, **attrs)


def test_a_model_with_a_bad_update_rule_is_a_format_error() -> None:
    node = helper.make_node("LinearAttention", ["q", "k", "v"], ["y", "state"], q_num_heads=1,
                            kv_num_heads=1, update_rule="gated")
    vi = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 2, 4]) for n in "qkv"]
    graph = helper.make_graph([node], "g", vi, [helper.make_tensor_value_info(
        n, onnx.TensorProto.FLOAT, None) for n in ("y", "state")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)])
    with pytest.raises(ModelFormatError, match="needs decay"):
        keel.load_model(m.SerializeToString(), backend="cpu", plan_cache=False)
