"""The matmul family: seed-001 semantics, schemas, reference vs ONNX, cpu vs reference,
and the fused-epilogue module."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops import epilogue
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.matmul import dot_shape, einsum_shape, matmul_shape, parse_einsum
from keel.ops.types import TensorType
from tests.ops._matconv_support import cpu, onnx_reference, ref

RNG = np.random.default_rng(7)


def _f(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


# ---- seed 001 -----------------------------------------------------------------------------
def test_seed_matmul_is_numpy_matmul() -> None:
    a = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    b = np.array([[5.0, 6.0], [7.0, 8.0]], dtype=np.float32)
    want = np.array([[19.0, 22.0], [43.0, 50.0]], dtype=np.float32)
    for kernel in (ref, cpu):
        (y,) = kernel(Op.MATMUL, [a, b])
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, want)


def test_seed_dot_of_vectors_is_a_scalar() -> None:
    a = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    b = np.array([4.0, 5.0, 6.0], dtype=np.float32)
    for kernel in (ref, cpu):
        (y,) = kernel(Op.DOT, [a, b])
        assert y.shape == () and y.dtype == np.float32
        assert float(y) == 32.0


def test_dot_follows_numpy_dot_for_other_ranks() -> None:
    for sa, sb in (((3, 4), (4, 5)), ((2, 3, 4), (4,)), ((2, 3, 4), (5, 4, 2)), ((), (3,))):
        a, b = _f(*sa, dtype=np.float64), _f(*sb, dtype=np.float64)
        (y,) = cpu(Op.DOT, [a, b])
        np.testing.assert_allclose(y, np.dot(a, b), rtol=1e-12)
        assert dot_shape(sa, sb) == np.dot(a, b).shape


# ---- schemas ------------------------------------------------------------------------------
def test_matmul_shape_promotes_vectors_and_broadcasts() -> None:
    assert matmul_shape((3,), (3,)) == ()
    assert matmul_shape((2, 3, 4), (4,)) == (2, 3)
    assert matmul_shape((4,), (2, 4, 5)) == (2, 5)
    assert matmul_shape((2, 1, 3, 4), (5, 4, 6)) == (2, 5, 3, 6)
    assert matmul_shape(("b", 3, 4), (4, 6)) == ("b", 3, 6)


def test_matmul_shape_errors_say_what_was_given() -> None:
    with pytest.raises(InvalidArgumentError, match=r"inner dimensions differ.*\(3, 4\)"):
        matmul_shape((3, 4), (5, 6))
    with pytest.raises(InvalidArgumentError, match="rank >= 1"):
        matmul_shape((), (3,))
    with pytest.raises(InvalidArgumentError, match="batch dimensions"):
        matmul_shape((2, 3, 4), (3, 4, 5))


def test_matmul_infer_checks_bias_dtype_and_activation() -> None:
    schema = get_schema(Op.MATMUL)
    f32 = DType.FLOAT32
    attrs = schema.normalize_attrs({})
    out = schema.infer_types([TensorType(f32, (2, 3)), TensorType(f32, (3, 4)),
                              TensorType(f32, (4,))], attrs)
    assert out == [TensorType(f32, (2, 4))]
    with pytest.raises(InvalidArgumentError, match="does not broadcast"):
        schema.infer_types([TensorType(f32, (2, 3)), TensorType(f32, (3, 4)),
                            TensorType(f32, (2, 4, 4))], attrs)
    with pytest.raises(InvalidArgumentError, match="one dtype"):
        schema.infer_types([TensorType(f32, (2, 3)), TensorType(DType.FLOAT64, (3, 4))], attrs)
    with pytest.raises(InvalidArgumentError, match="unknown activation 'swish'"):
        schema.infer_types([TensorType(f32, (2, 3)), TensorType(f32, (3, 4))],
                           schema.normalize_attrs({"activation": "swish"}))
    with pytest.raises(InvalidArgumentError, match="does not take bool"):
        schema.infer_types([TensorType(DType.BOOL, (2, 3)), TensorType(DType.BOOL, (3, 4))],
                           attrs)


def test_gemm_infer_and_errors() -> None:
    schema = get_schema(Op.GEMM)
    f32 = DType.FLOAT32
    attrs = schema.normalize_attrs({"trans_a": 1})
    out = schema.infer_types([TensorType(f32, (3, 4)), TensorType(f32, (3, 5))], attrs)
    assert out == [TensorType(f32, (4, 5))]
    with pytest.raises(InvalidArgumentError, match="K differs"):
        schema.infer_types([TensorType(f32, (3, 4)), TensorType(f32, (4, 5))], attrs)
    with pytest.raises(InvalidArgumentError, match="2-D A and B"):
        schema.infer_types([TensorType(f32, (2, 3, 4)), TensorType(f32, (4, 5))],
                           schema.normalize_attrs({}))


def test_einsum_parsing_and_shapes_match_numpy() -> None:
    for eq, shapes in (("ij,jk->ik", [(2, 3), (3, 4)]), ("...ij,...jk", [(5, 2, 3), (3, 4)]),
                       ("ii", [(3, 3)]), ("ba", [(2, 3)]), ("a...,a...", [(2, 3, 4), (2, 4)])):
        want = np.einsum(eq, *[np.ones(s) for s in shapes]).shape
        assert einsum_shape(eq, shapes) == want
    assert parse_einsum("ij,jk", [2, 2]) == ([["i", "j"], ["j", "k"]], ["i", "k"])
    with pytest.raises(InvalidArgumentError, match="names 2 operands, got 1"):
        parse_einsum("ij,jk->ik", [2])
    with pytest.raises(InvalidArgumentError, match="label 'z' does not appear"):
        parse_einsum("ij->z", [2])
    with pytest.raises(InvalidArgumentError, match="label 'j' has sizes"):
        einsum_shape("ij,jk->ik", [(2, 3), (4, 5)])


def test_attention_infer_checks_mask_and_head_size() -> None:
    schema = get_schema(Op.ATTENTION)
    f32 = DType.FLOAT32
    attrs = schema.normalize_attrs({})
    q, k, v = TensorType(f32, (1, 2, 5, 8)), TensorType(f32, (1, 2, 7, 8)), TensorType(
        f32, (1, 2, 7, 4))
    assert schema.infer_types([q, k, v], attrs) == [TensorType(f32, (1, 2, 5, 4))]
    with pytest.raises(InvalidArgumentError, match="head size"):
        schema.infer_types([q, TensorType(f32, (1, 2, 7, 6)), v], attrs)
    with pytest.raises(InvalidArgumentError, match="mask of shape"):
        schema.infer_types([q, k, v, TensorType(f32, (1, 2, 5, 6))], attrs)


# ---- reference kernels against the ONNX reference evaluator ------------------------------
@pytest.mark.parametrize(("sa", "sb"), [((3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 6)),
                                        ((4,), (2, 4, 3)), ((3, 4), (4,))])
def test_reference_matmul_matches_onnx(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    a, b = _f(*sa), _f(*sb)
    np.testing.assert_allclose(ref(Op.MATMUL, [a, b])[0], onnx_reference("MatMul", [a, b])[0],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attrs", [{}, {"alpha": 0.5, "beta": 2.0},
                                   {"transA": 1, "transB": 1, "alpha": -1.5}])
def test_reference_gemm_matches_onnx(attrs: dict[str, Any]) -> None:
    a = _f(4, 3) if attrs.get("transA") else _f(3, 4)
    b = _f(5, 4) if attrs.get("transB") else _f(4, 5)
    c = _f(5)
    keel_attrs = {{"transA": "trans_a", "transB": "trans_b"}.get(k, k): v
                  for k, v in attrs.items()}
    np.testing.assert_allclose(ref(Op.GEMM, [a, b, c], **keel_attrs)[0],
                               onnx_reference("Gemm", [a, b, c], **attrs)[0],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("equation", "shapes"), [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("ij->ji", [(3, 4)]),
    ("i,i", [(5,), (5,)]), ("abc,cd,de->abe", [(2, 3, 4), (4, 5), (5, 2)])])
def test_reference_einsum_matches_onnx(equation: str, shapes: list[tuple[int, ...]]) -> None:
    ops = [_f(*s) for s in shapes]
    np.testing.assert_allclose(ref(Op.EINSUM, ops, equation=equation)[0],
                               onnx_reference("Einsum", ops, equation=equation)[0],
                               rtol=1e-5, atol=1e-6)


def test_reference_matmul_integer_matches_onnx() -> None:
    a = RNG.integers(0, 256, (3, 5), dtype=np.uint8)
    b = RNG.integers(-128, 128, (5, 4), dtype=np.int8)
    azp, bzp = np.array(3, np.uint8), np.array(-2, np.int8)
    want = onnx_reference("MatMulInteger", [a, b, azp, bzp], out_types=(np.int32,))[0]
    got = ref(Op.MATMUL_INTEGER, [a, b, azp, bzp])[0]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


def test_reference_attention_is_the_textbook_formula() -> None:
    q, k, v = _f(2, 3, 8, dtype=np.float64), _f(2, 5, 8, dtype=np.float64), _f(
        2, 5, 4, dtype=np.float64)
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(8)
    weights = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    np.testing.assert_allclose(ref(Op.ATTENTION, [q, k, v])[0], weights @ v, rtol=1e-12)


def test_attention_softmax_is_stable_for_huge_scores() -> None:
    q = np.full((1, 2, 4), 100.0, np.float32)
    k = np.full((1, 3, 4), 100.0, np.float32)
    v = _f(1, 3, 2)
    for kernel in (ref, cpu):
        (y,) = kernel(Op.ATTENTION, [q, k, v])
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y[0, 0], v[0].mean(0), rtol=1e-5)


# ---- cpu kernels ---------------------------------------------------------------------------
def test_cpu_matmul_writes_into_out_and_applies_the_epilogue() -> None:
    a, b, bias = _f(6, 5), _f(5, 7), _f(7)
    out = np.empty((6, 7), np.float32)
    (y,) = cpu(Op.MATMUL, [a, b, bias], out=[out], activation="leaky_relu",
               activation_params=(0.2,))
    assert y is out
    want = ref(Op.MATMUL, [a, b, bias], activation="leaky_relu", activation_params=(0.2,))[0]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_cpu_gemm_with_float16_computes_in_float32() -> None:
    a, b, c = _f(8, 16, dtype=np.float16), _f(16, 4, dtype=np.float16), _f(4, dtype=np.float16)
    (y,) = cpu(Op.GEMM, [a, b, c], alpha=0.5)
    assert y.dtype == np.float16
    want = 0.5 * (a.astype(np.float64) @ b.astype(np.float64)) + c
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("equation", ["bhsd,bhtd->bhst", "ij,jk->ki", "bi,bi->b", "iij,jk->ik"])
def test_cpu_einsum_matches_numpy(equation: str) -> None:
    table: dict[str, list[tuple[int, ...]]] = {
        "bhsd,bhtd->bhst": [(2, 3, 4, 5), (2, 3, 6, 5)], "ij,jk->ki": [(3, 4), (4, 5)],
        "bi,bi->b": [(3, 4), (1, 4)], "iij,jk->ik": [(3, 3, 4), (4, 2)]}
    shapes = table[equation]
    ops = [_f(*s, dtype=np.float64) for s in shapes]
    np.testing.assert_allclose(cpu(Op.EINSUM, ops, equation=equation)[0],
                               np.einsum(equation, *ops), rtol=1e-12)


def test_cpu_matmul_integer_is_exact_past_float32_precision() -> None:
    # 600 terms of 255 * 255 overflow float32's exact range: the kernel must switch to float64.
    a = np.full((2, 600), 255, np.uint8)
    b = np.full((600, 3), 255, np.uint8)
    zero = np.array(0, np.uint8)
    (y,) = cpu(Op.MATMUL_INTEGER, [a, b, zero, zero])
    assert y.dtype == np.int32
    assert (y == 600 * 255 * 255).all()


def test_kernels_reject_mixed_dtypes() -> None:
    with pytest.raises(InvalidArgumentError, match="one dtype"):
        cpu(Op.MATMUL, [_f(2, 3), _f(3, 4, dtype=np.float64)])
    with pytest.raises(InvalidArgumentError, match="one dtype"):
        ref(Op.GEMM, [_f(2, 3), _f(3, 4, dtype=np.float64)])


# ---- the epilogue module --------------------------------------------------------------------
def test_activation_names_are_the_contract() -> None:
    names = {"", "relu", "leaky_relu", "sigmoid", "tanh", "clip", "hard_sigmoid", "hard_swish",
             "gelu", "gelu_tanh", "silu"}
    assert set(epilogue.ACTIVATIONS) == names


def test_resolve_activation_fills_defaults_and_rejects_bad_input() -> None:
    assert epilogue.resolve_activation("clip", (0.0,)) == ("clip", (0.0, math.inf))
    assert epilogue.resolve_activation("leaky_relu") == ("leaky_relu", (0.01,))
    with pytest.raises(InvalidArgumentError, match="unknown activation 'mish'; allowed"):
        epilogue.resolve_activation("mish")
    with pytest.raises(InvalidArgumentError, match="at most 0 parameters, got 1"):
        epilogue.resolve_activation("relu", (1.0,))


def test_reference_activations_by_hand() -> None:
    x = np.array([-2.0, -0.5, 0.0, 1.0, 4.0])
    act = epilogue.reference_activation
    np.testing.assert_allclose(act(x, "relu"), [0, 0, 0, 1, 4])
    np.testing.assert_allclose(act(x, "leaky_relu", (0.1,)), [-0.2, -0.05, 0, 1, 4])
    np.testing.assert_allclose(act(x, "clip", (-1.0, 2.0)), [-1, -0.5, 0, 1, 2])
    np.testing.assert_allclose(act(x, "hard_sigmoid"), np.clip(0.2 * x + 0.5, 0, 1))
    np.testing.assert_allclose(act(x, "hard_swish"), x * np.clip(x / 6 + 0.5, 0, 1))
    np.testing.assert_allclose(act(x, "sigmoid"), 1 / (1 + np.exp(-x)))
    np.testing.assert_allclose(act(x, "silu"), x / (1 + np.exp(-x)))
    np.testing.assert_allclose(act(x, "gelu"),
                               [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(act(np.array([-1000.0, 1000.0]), "sigmoid"), [0.0, 1.0])


@pytest.mark.parametrize("name", sorted(epilogue.ACTIVATIONS))
@pytest.mark.parametrize("size", [37, 200_003])   # the plain and the chunked NumPy path
def test_apply_activation_matches_reference_in_place(name: str, size: int) -> None:
    params: tuple[float, ...] = {"leaky_relu": (0.1,), "clip": (-1.0, 3.0),
                                 "hard_sigmoid": (0.3, 0.4)}.get(name, ())
    x = (RNG.standard_normal(size) * 4).astype(np.float32)
    y = x.copy()
    got = epilogue.apply_activation(np, y, name, params, out=y)
    assert got is y
    want = epilogue.reference_activation(x, name, params)
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-6)


def test_apply_activation_into_another_array_keeps_the_input() -> None:
    x = _f(3, 4)
    keep = x.copy()
    out = np.empty_like(x)
    epilogue.apply_activation(np, x, "gelu", (), out=out)
    np.testing.assert_array_equal(x, keep)
    np.testing.assert_allclose(out, epilogue.reference_activation(x, "gelu"), atol=1e-6)
    assert epilogue.apply_activation(np, x, "") is x


def test_apply_activation_keeps_integers_integer() -> None:
    x = np.array([-3, 0, 5], np.int32)
    epilogue.apply_activation(np, x, "relu", (), out=x)
    assert x.dtype == np.int32
    np.testing.assert_array_equal(x, [0, 0, 5])


def test_gelu_approximation_error_is_small_in_float64() -> None:
    x = np.linspace(-10, 10, 100_001)
    got = epilogue.apply_activation(np, x, "gelu")
    err = np.abs(got - epilogue.reference_activation(x, "gelu"))
    assert err.max() < 2e-7
