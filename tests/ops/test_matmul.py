"""The matmul family: seed-001 semantics, schemas, reference vs ONNX, cpu vs reference,
and the fused-epilogue module."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from keel.backends.base import KernelContext
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops import epilogue
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.matmul import dot_shape, einsum_shape, matmul_shape, parse_einsum
from keel.ops.types import TensorType
from tests.ops._matconv_support import CPU, CPU_CTX, cpu, onnx_reference, ref

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


# ---- prepacked constant operands -------------------------------------------------------
def _frozen(x: np.ndarray) -> np.ndarray:
    x.flags.writeable = False
    return x


def _prepacked(op: Op, inputs: list[np.ndarray | None], **attrs: Any) -> KernelContext:
    """The cpu context the executor builds: the variant's prepack of the frozen inputs."""
    variant = CPU.get(op)
    norm = get_schema(op).normalize_attrs(attrs)
    consts = [x if x is not None and not x.flags.writeable else None for x in inputs]
    assert variant.prepack is not None
    return dataclasses.replace(CPU_CTX, prepacked=variant.prepack(CPU_CTX, consts, norm))


def _run(op: Op, ctx: KernelContext, inputs: list[np.ndarray | None],
         out: list[np.ndarray] | None = None, **attrs: Any) -> list[np.ndarray]:
    norm = get_schema(op).normalize_attrs(attrs)
    return list(CPU.get(op).fn(ctx, list(inputs), norm, out))


@pytest.mark.parametrize(("m", "k", "n"), [(1, 784, 512), (32, 784, 512), (33, 100, 17),
                                           (5, 7, 3), (0, 4, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32])
def test_gemm_prepacked_and_unpacked_agree_bitwise(m: int, k: int, n: int, dtype: Any) -> None:
    a = (RNG.standard_normal((m, k)) * 3).astype(dtype)
    w = _frozen((RNG.standard_normal((n, k)) * 3).astype(dtype))
    c = _frozen((RNG.standard_normal(n) * 3).astype(dtype))
    attrs: dict[str, Any] = {"trans_b": 1, "alpha": 2.0, "beta": 0.5, "activation": "relu"}
    packed = _run(Op.GEMM, _prepacked(Op.GEMM, [None, w, c], **attrs), [a, w, c], **attrs)[0]
    plain = cpu(Op.GEMM, [a, w, c], **attrs)[0]
    np.testing.assert_array_equal(packed, plain)
    want = ref(Op.GEMM, [a, w, c], **attrs)[0]
    # Sums of k products of size ~9: absolute error relative to the largest output.
    tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}.get(dtype, 0)
    scale = float(np.abs(want).max(initial=1.0))
    np.testing.assert_allclose(packed, want, rtol=tol, atol=tol * scale)


def test_gemm_prepack_is_read_only_and_leaves_the_weights_alone() -> None:
    w, c = _frozen(_f(6, 5)), _frozen(_f(6))
    ctx = _prepacked(Op.GEMM, [None, w, c], trans_b=1, beta=2.0)
    state = ctx.prepacked
    if state.native is None:            # BLAS keeps a transposed contiguous copy
        assert state.rhs.shape == (5, 6) and state.rhs.flags.c_contiguous
        assert not state.rhs.flags.writeable
        np.testing.assert_array_equal(state.rhs, w.T)
    else:                               # the native GEMM keeps its packed panels instead
        assert state.rhs is None
    assert not state.addend.flags.writeable
    np.testing.assert_array_equal(state.addend, 2.0 * c)
    assert not w.flags.writeable and not c.flags.writeable
    # A constant already in the BLAS layout is shared, not copied (nor frozen by us).
    b = _frozen(_f(5, 6))
    assert _prepacked(Op.MATMUL, [None, b]).prepacked.rhs is b
    live = _f(5, 6)
    pack = CPU.get(Op.MATMUL).prepack
    assert pack is not None and pack(CPU_CTX, [None, None], {}) is None
    assert live.flags.writeable


def test_prepacked_state_is_ignored_for_other_arrays() -> None:
    # The state belongs to the arrays it was made from: other operands recompute.
    w, other = _frozen(_f(6, 5)), _f(6, 5)
    a = _f(3, 5)
    ctx = _prepacked(Op.GEMM, [None, w, None], trans_b=1)
    got = _run(Op.GEMM, ctx, [a, other], trans_b=1)[0]
    np.testing.assert_allclose(got, a @ other.T, rtol=1e-5, atol=1e-5)
    b, bias, other_bias = _frozen(_f(5, 4)), _frozen(_f(4)), _f(4)
    ctx = _prepacked(Op.MATMUL, [None, b, bias])
    got = _run(Op.MATMUL, ctx, [a, b, other_bias])[0]
    np.testing.assert_allclose(got, a @ b + other_bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("sa", "sb"), [((4, 8, 16), (16, 5)), ((2, 3, 4, 16), (16, 5)),
                                        ((16,), (16, 5)), ((3, 16), (16, 5)),
                                        ((2, 4, 16), (2, 16, 5))])
def test_matmul_folds_leading_dimensions_into_one_gemm(sa: tuple[int, ...],
                                                       sb: tuple[int, ...]) -> None:
    a, b, bias = _f(*sa), _frozen(_f(*sb)), _f(sb[-1])
    out = np.empty(np.matmul(a, b).shape, np.float32)
    want = ref(Op.MATMUL, [a, b, bias], activation="gelu")[0]
    for ctx in (CPU_CTX, _prepacked(Op.MATMUL, [None, b, None])):
        (y,) = _run(Op.MATMUL, ctx, [a, b, bias], out=[out], activation="gelu")
        assert y is out
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # A non-contiguous A (a transposed view) gives the same values.
    at = np.ascontiguousarray(np.swapaxes(a, 0, -1)).swapaxes(0, -1) if a.ndim > 1 else a
    np.testing.assert_allclose(cpu(Op.MATMUL, [at, b, bias])[0], a @ b + bias,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("bias_shape", "act"), [((1000,), "gelu"), ((1, 1000), "silu"),
                                                 ((300, 1000), "relu"), ((), "tanh")])
def test_epilogue_in_row_blocks_matches_the_reference(bias_shape: tuple[int, ...],
                                                      act: str) -> None:
    # Outputs past two epilogue blocks: a row bias and the activation go block by block.
    a, b, c = _f(300, 16), _f(16, 1000), _f(*bias_shape)
    cases: tuple[tuple[Op, dict[str, Any]], ...] = ((Op.MATMUL, {}),
                                                (Op.GEMM, {"alpha": 0.5, "beta": 2.0}))
    for op, attrs in cases:
        inputs = [a, b, c] if op is Op.GEMM or len(bias_shape) else [a, b]
        got = cpu(op, inputs, activation=act, **attrs)[0]
        want = ref(op, inputs, activation=act, **attrs)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- fused attention ---------------------------------------------------------------------
def _attention_inputs(q: tuple[int, ...], t: int, dv: int | None = None,
                      dtype: Any = np.float32) -> list[np.ndarray]:
    k = (*q[:-2], t, q[-1])
    v = (*q[:-2], t, q[-1] if dv is None else dv)
    return [_f(*q, dtype=dtype), _f(*k, dtype=dtype), _f(*v, dtype=dtype)]


@pytest.mark.parametrize("mask", ["", "additive-batch", "additive-full", "bool", "causal"])
def test_attention_blocks_of_heads_match_the_reference(mask: str) -> None:
    # 2 x 12 heads of 40 x 50 scores: several blocks of heads, one ragged.
    q, k, v = _attention_inputs((2, 12, 40, 16), 50, dv=24)
    inputs: list[np.ndarray | None] = [q, k, v]
    attrs: dict[str, Any] = {"is_causal": mask == "causal"} if mask == "causal" else {}
    if mask == "additive-batch":      # BERT's padding mask: (B, 1, 1, T)
        inputs.append(np.where(RNG.random((2, 1, 1, 50)) < 0.3, -1e4, 0).astype(np.float32))
    elif mask == "additive-full":
        inputs.append(_f(1, 12, 40, 50))
    elif mask == "bool":
        keep = RNG.random((2, 12, 40, 50)) < 0.6
        keep[..., 0] = True
        inputs.append(keep)
    if mask == "causal":
        q, k, v = _attention_inputs((2, 12, 50, 16), 50, dv=24)
        inputs = [q, k, v]
    out = np.empty((*q.shape[:-1], 24), np.float32)
    (y,) = cpu(Op.ATTENTION, inputs, out=[out], **attrs)
    assert y is out
    np.testing.assert_allclose(y, ref(Op.ATTENTION, inputs, **attrs)[0], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("spread", [10.0, 100.0, 300.0])
def test_attention_softmax_shift_keeps_every_row_finite(spread: float) -> None:
    # Scores within +-64 need no shift, a spread up to 128 one per block, wider the row max.
    q, k, v = _attention_inputs((1, 2, 6, 4), 8)
    q *= spread / np.abs(q @ k.swapaxes(-1, -2)).max()
    (y,) = cpu(Op.ATTENTION, [q, k, v], scale=1.0)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ref(Op.ATTENTION, [q, k, v], scale=1.0)[0],
                               rtol=1e-4, atol=1e-5)


def test_attention_fully_masked_rows_and_other_shapes() -> None:
    q, k, v = _attention_inputs((1, 2, 3, 4), 5)
    keep = np.ones((3, 5), bool)
    keep[1] = False                       # query 1 sees nothing: nan, as the reference
    (y,) = cpu(Op.ATTENTION, [q, k, v, keep])
    with np.errstate(invalid="ignore"):           # the reference's -inf - -inf
        want = ref(Op.ATTENTION, [q, k, v, keep])[0]
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    assert np.isnan(y[:, :, 1]).all()
    np.testing.assert_allclose(y[:, :, [0, 2]], want[:, :, [0, 2]], rtol=1e-5, atol=1e-6)
    # 3-D (no head axis), batched 5-D, non-contiguous and broadcast batch dimensions.
    for inputs in (_attention_inputs((3, 7, 8), 9), _attention_inputs((2, 2, 2, 5, 4), 6),
                   [x.swapaxes(0, 1).copy().swapaxes(0, 1)
                    for x in _attention_inputs((3, 2, 5, 4), 6)],
                   [_f(2, 3, 5, 4), _f(1, 3, 6, 4), _f(3, 6, 4)]):
        np.testing.assert_allclose(cpu(Op.ATTENTION, inputs)[0],
                                   ref(Op.ATTENTION, inputs)[0], rtol=1e-5, atol=1e-6)


# ---- the GELU epilogue ---------------------------------------------------------------------
def test_gelu_float32_is_within_1e_6_relative_where_it_matters() -> None:
    x = np.concatenate([np.linspace(-8, 8, 400_001), RNG.standard_normal(100_000) * 3,
                        np.geomspace(1e-30, 8, 2001), -np.geomspace(1e-30, 8, 2001)])
    x32 = x.astype(np.float32)
    got = epilogue.apply_activation(np, x32, "gelu").astype(np.float64)
    want = epilogue.reference_activation(x32.astype(np.float64), "gelu")
    rel = np.abs(got - want) / np.maximum(np.abs(want), 1e-300)
    assert rel[x32 >= -4].max() < 1e-6          # |gelu| > 1.2e-4
    assert rel[x32 >= -8].max() < 2.5e-6        # the tail keeps its relative accuracy


def test_gelu_reference_has_no_cancellation_in_the_tail() -> None:
    # x * Phi(x) with Phi(-10) = 7.6e-24: the erfc form keeps it, 1 + erf(x) would give 0.
    got = epilogue.reference_activation(np.array([-10.0]), "gelu")[0]
    assert got == pytest.approx(-10 * 0.5 * math.erfc(10 / math.sqrt(2)), rel=1e-12)


def test_gelu_special_values_and_dtypes() -> None:
    x = np.array([np.inf, -np.inf, np.nan, 0.0, 1e-30, 40.0, -40.0])
    for dtype in (np.float32, np.float64):
        got = epilogue.apply_activation(np, x.astype(dtype), "gelu")
        want = epilogue.reference_activation(x, "gelu")
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=1e-6)
    h = np.linspace(-6, 6, 1001).astype(np.float16)
    got16 = epilogue.apply_activation(np, h, "gelu")
    assert got16.dtype == np.float16
    np.testing.assert_allclose(got16, epilogue.reference_activation(h, "gelu"),
                               rtol=2 ** -10, atol=2 ** -14)
    empty = np.empty((0, 3), np.float32)
    assert epilogue.apply_activation(np, empty, "gelu", out=empty) is empty


def test_in_place_resolves_once_and_applies() -> None:
    assert epilogue.in_place("") is None
    run = epilogue.in_place("leaky_relu", (0.5,))
    assert run is not None
    y = np.array([-2.0, 3.0], np.float32)
    run(np, y)
    np.testing.assert_array_equal(y, [-1.0, 3.0])
    with pytest.raises(InvalidArgumentError, match="unknown activation 'swish'"):
        epilogue.in_place("swish")
