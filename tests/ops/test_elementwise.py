"""The elementwise family: schemas, reference kernels against ONNX's reference
evaluator, what is special to the cpu kernels (in-place outputs, ``out=``
buffers, erf accuracy), seed 001's ``add``/``mul``/``relu``, and every typed error.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from keel.backends.cpu.elementwise import erf as cpu_erf
from keel.backends.reference.elementwise import erf as reference_erf
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op, OpGroup
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.conformance.cases_elementwise import CASES
from tests.conformance.harness import OpCase, case_inputs
from tests.ops._elementwise_support import (
    ONNX_NAMES,
    assert_close,
    onnx_run,
    run_cpu,
    run_ref,
)

# Cases ONNX's evaluator cannot judge, and why; each behaviour is tested by hand below.
NO_ORACLE = {
    "pow-int32": "NumPy under ONNX's evaluator refuses negative integer exponents",
    "pow-int64": "NumPy under ONNX's evaluator refuses negative integer exponents",
    "pow-int64-int8-exp": "NumPy under ONNX's evaluator refuses negative integer exponents",
    "softsign-scalar": "ONNX's evaluator fails on a rank-0 Softsign",
    "clip-attrs-int8": "keel clamps attribute bounds to the dtype's range; ONNX Clip has none",
}


def _onnx_form(case: OpCase, inputs: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The case as an ONNX node: clip's keel-only attributes become inputs 1 and 2."""
    attrs = {k: int(v) if isinstance(v, bool) else v for k, v in case.attrs.items()}
    if case.op is Op.CLIP and attrs:
        x = inputs[0]
        bounds = [None if attrs.get(k) is None else np.array(attrs[k], x.dtype)
                  for k in ("min", "max")]
        return [x, *bounds], {}
    return inputs, attrs


@pytest.mark.parametrize("case", [c for c in CASES if c.id not in NO_ORACLE],
                         ids=lambda c: c.id)
def test_reference_matches_onnx(case: OpCase) -> None:
    inputs = case_inputs(case)
    onnx_inputs, onnx_attrs = _onnx_form(case, inputs)
    expected = onnx_run(ONNX_NAMES[case.op], onnx_inputs, **onnx_attrs)
    actual = run_ref(case.op, inputs, **case.attrs)[0]
    # ONNX stores float attributes as float32 and its Erf works in float32, so
    # float64 results agree to float32 precision, not to the last bit.
    assert_close(actual, expected, max(case.rtol, 1e-6), max(case.atol, 1e-7), case.id)


@pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
class TestHandComputed:
    """Behaviour the ONNX oracle cannot check, and seed 001's elementwise ops."""

    def test_seed_add_broadcasts(self, run: Any) -> None:
        a = np.array([[1.0], [2.0]], np.float32)
        b = np.array([10.0, 20.0, 30.0], np.float32)
        expected = np.array([[11, 21, 31], [12, 22, 32]], np.float32)
        assert_close(run(Op.ADD, [a, b])[0], expected)

    def test_seed_mul_broadcasts(self, run: Any) -> None:
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        assert_close(run(Op.MUL, [a, np.array(2.0, np.float32)])[0], a * 2)

    def test_seed_relu(self, run: Any) -> None:
        x = np.array([-2.0, -0.0, 0.0, 3.5, np.nan], np.float32)
        assert_close(run(Op.RELU, [x])[0], np.array([0, 0, 0, 3.5, np.nan], np.float32))

    def test_integer_pow_with_negative_exponent_truncates(self, run: Any) -> None:
        a = np.array([2, -1, -1, 1, 3, 5], np.int32)
        b = np.array([-1, -3, -2, -7, 0, 2], np.int32)
        assert_close(run(Op.POW, [a, b])[0], np.array([0, -1, 1, 1, 1, 25], np.int32))

    def test_integer_div_truncates_toward_zero(self, run: Any) -> None:
        a = np.array([7, -7, 7, -7, 6], np.int64)
        b = np.array([2, 2, -2, -2, 3], np.int64)
        assert_close(run(Op.DIV, [a, b])[0], np.array([3, -3, -3, 3, 2], np.int64))

    def test_mod_sign_follows_divisor_or_dividend(self, run: Any) -> None:
        a, b = np.array([7, -7, 7, -7], np.int32), np.array([3, 3, -3, -3], np.int32)
        assert_close(run(Op.MOD, [a, b])[0], np.array([1, 2, -2, -1], np.int32))
        assert_close(run(Op.MOD, [a, b], fmod=1)[0], np.array([1, -1, 1, -1], np.int32))

    def test_bit_shift_out_of_range(self, run: Any) -> None:
        a = np.array([-8, 8, -8, 8, 64], np.int8)
        b = np.array([8, 8, -1, 1, 1], np.int8)
        assert_close(run(Op.BIT_SHIFT, [a, b], direction="RIGHT")[0],
                     np.array([-1, 0, -1, 4, 32], np.int8))
        assert_close(run(Op.BIT_SHIFT, [a, b], direction="LEFT")[0],
                     np.array([0, 0, 0, 16, -128], np.int8))

    def test_round_half_to_even(self, run: Any) -> None:
        x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 2.6], np.float32)
        assert_close(run(Op.ROUND, [x])[0], np.array([0, 2, 2, 0, -2, 3], np.float32))

    def test_clip_attributes(self, run: Any) -> None:
        x = np.array([-5.0, 0.5, 5.0], np.float32)
        assert_close(run(Op.CLIP, [x], min=-1.0, max=1.0)[0],
                     np.array([-1.0, 0.5, 1.0], np.float32))
        ints = np.array([-100, 0, 100], np.int8)
        assert_close(run(Op.CLIP, [ints], min=-20.7, max=1e9)[0],
                     np.array([-20, 0, 100], np.int8))

    def test_inverted_clip_gives_max(self, run: Any) -> None:
        x = np.array([-5.0, 0.5, 5.0], np.float32)
        out = run(Op.CLIP, [x, np.array(1.0, np.float32), np.array(-1.0, np.float32)])[0]
        assert_close(out, np.full(3, -1.0, np.float32))

    def test_maximum_is_variadic(self, run: Any) -> None:
        xs = [np.array([1, 5, 3], np.int64), np.array([4], np.int64),
              np.array([[0], [9]], np.int64)]
        assert_close(run(Op.MAXIMUM, xs)[0], np.array([[4, 5, 4], [9, 9, 9]], np.int64))
        assert_close(run(Op.MINIMUM, xs[:1])[0], xs[0])

    def test_gelu_tanh_differs_from_exact(self, run: Any) -> None:
        x = np.array([-1.0, 1.0], np.float64)
        exact = run(Op.GELU, [x])[0]
        tanh = run(Op.GELU, [x], approximate="tanh")[0]
        assert_close(exact, 0.5 * x * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x])),
                     rtol=1e-14, atol=0)
        assert np.all(np.abs(exact - tanh) > 1e-5)


# ---- cpu: in-place outputs and out= buffers ---------------------------------------
def _inplace_cases() -> list[tuple[OpCase, int]]:
    pairs = []
    for case in CASES:
        inputs = case_inputs(case)
        expected = run_ref(case.op, inputs, **case.attrs)[0]
        for i, o in get_schema(case.op).inplace:
            x = inputs[i]
            if o == 0 and x is not None and x.shape == expected.shape \
                    and x.dtype == expected.dtype:
                pairs.append((case, i))
    return pairs


@pytest.mark.parametrize(("case", "index"), _inplace_cases(),
                         ids=lambda v: v.id if isinstance(v, OpCase) else f"in{v}")
def test_cpu_output_may_reuse_its_inplace_input(case: OpCase, index: int) -> None:
    inputs = case_inputs(case)
    fresh = run_cpu(case.op, inputs, **case.attrs)[0]
    buffer = np.ascontiguousarray(inputs[index]).copy()
    inputs[index] = buffer
    result = run_cpu(case.op, inputs, out=[buffer], **case.attrs)[0]
    assert result is buffer
    assert fresh.tobytes() == buffer.tobytes(), f"{case.id}: aliased output differs"


@pytest.mark.parametrize("op", [Op.ADD, Op.LESS, Op.SIGMOID, Op.WHERE, Op.MAXIMUM])
def test_cpu_writes_into_the_output_given(op: Op) -> None:
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    inputs = {Op.ADD: [x, x], Op.LESS: [x, x.T.copy().reshape(3, 4)], Op.SIGMOID: [x],
              Op.WHERE: [x > 0, x, -x], Op.MAXIMUM: [x, x[:1], x[:, :1]]}[op]
    expected = run_ref(op, inputs)[0]
    out = np.full(expected.shape, 7, expected.dtype)
    assert run_cpu(op, inputs, out=[out])[0] is out
    assert_close(out, expected, rtol=1e-6)


# ---- erf ---------------------------------------------------------------------------
def _true_erf(x: np.ndarray) -> np.ndarray:
    return np.array([math.erf(float(v)) for v in x.reshape(-1)]).reshape(x.shape)


def test_cpu_erf_float64_is_within_a_few_ulp() -> None:
    x = np.concatenate([np.linspace(-7, 7, 40000), np.geomspace(1e-300, 6, 2000)])
    actual = cpu_erf(np, x, np.empty_like(x))
    expected = _true_erf(x)
    assert np.max(np.abs(actual - expected) / np.abs(expected)) < 2e-15


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cpu_erf_float32_is_within_1e_6_relative(dtype: Any) -> None:
    # Both branches (|x| < 0.5 and the tail) and tiny arguments, in float32 arithmetic.
    tiny = float(np.finfo(dtype).tiny)             # subnormals round coarser: not tested
    grid = np.concatenate([np.linspace(-6, 6, 30001), np.geomspace(tiny, 6, 3001),
                           -np.geomspace(tiny, 6, 3001)])
    x = grid.astype(dtype)
    x = x[x != 0]
    actual = cpu_erf(np, x, np.empty_like(x)).astype(np.float64)
    expected = _true_erf(x.astype(np.float64))
    bound = 1e-6 if dtype == np.float32 else 2.0 ** -11   # float16: one rounding
    assert np.max(np.abs(actual - expected) / np.abs(expected)) < bound


def test_cpu_erf_float32_blocks_and_aliasing() -> None:
    # Larger than one block and computed in place: the same values as one call per element.
    x = np.linspace(-5, 5, 3 * 70001, dtype=np.float32)
    want = np.concatenate([cpu_erf(np, part, np.empty_like(part))
                           for part in np.array_split(x, 7)])
    got = x.copy()
    assert cpu_erf(np, got, got) is got
    np.testing.assert_array_equal(got, want)


def test_cpu_erf_special_values_and_blocks() -> None:
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-324, 30.0])
    out = cpu_erf(np, special, np.empty_like(special))
    np.testing.assert_array_equal(out, [np.nan, 1, -1, 0, -0.0, 5e-324, 1])
    assert np.signbit(out[4])
    # Larger than one block, non-contiguous: the blocked path matches the reference.
    x = np.linspace(-5, 5, 2 * 3 * 70000).reshape(2, -1)[:, ::3]
    actual = cpu_erf(np, x, np.empty(x.shape))
    np.testing.assert_allclose(actual, reference_erf(x), rtol=2e-15, atol=0)


# ---- schemas -----------------------------------------------------------------------
F32 = DType.FLOAT32


def _infer(op: Op, *types: TensorType | None, **attrs: Any) -> list[TensorType | None]:
    schema = get_schema(op)
    return schema.infer_types(list(types), schema.normalize_attrs(attrs))


def test_infer_broadcasts_symbolic_shapes() -> None:
    out = _infer(Op.ADD, TensorType(F32, ("batch", 1, 4)), TensorType(F32, (3, 1)))
    assert out == [TensorType(F32, ("batch", 3, 4))]


def test_infer_gives_bool_for_predicates() -> None:
    x = TensorType(DType.INT32, (2,))
    assert _infer(Op.LESS, x, x) == [TensorType(DType.BOOL, (2,))]
    assert _infer(Op.ISNAN, TensorType(F32, (2,))) == [TensorType(DType.BOOL, (2,))]
    assert _infer(Op.WHERE, TensorType(DType.BOOL, (3, 1)), x, x) == [
        TensorType(DType.INT32, (3, 2))]


def test_infer_unknowns() -> None:
    assert _infer(Op.EXP, None) == [None]
    assert _infer(Op.ADD, TensorType(F32, (2,)), TensorType(F32, None)) == [
        TensorType(F32, None)]


def test_pow_output_takes_the_base_dtype() -> None:
    out = _infer(Op.POW, TensorType(DType.INT64, (2,)), TensorType(F32, (2,)))
    assert out == [TensorType(DType.INT64, (2,))]


def test_inplace_declarations() -> None:
    for op in OpGroup.ELEMENTWISE_UNARY - {Op.ISNAN, Op.ISINF}:
        assert get_schema(op).inplace == ((0, 0),), op
    assert get_schema(Op.ADD).inplace == ((0, 0),)
    assert get_schema(Op.EQUAL).inplace == ()
    assert get_schema(Op.ISNAN).inplace == ()


def test_every_elementwise_op_has_a_schema_and_kernels() -> None:
    from keel.backends.cpu.kernels import load as load_cpu
    from keel.backends.reference.kernels import load as load_reference

    for op in OpGroup.ELEMENTWISE:
        get_schema(op)
        assert op in load_reference() and op in load_cpu(), op


# ---- typed errors ------------------------------------------------------------------
def test_dtype_not_allowed() -> None:
    with pytest.raises(InvalidArgumentError,
                       match="exp does not take int32 inputs; allowed: bfloat16, float16, float32"):
        _infer(Op.EXP, TensorType(DType.INT32, (2,)))
    with pytest.raises(InvalidArgumentError, match="and does not take float32 inputs"):
        _infer(Op.AND, TensorType(F32, (2,)), TensorType(F32, (2,)))


def test_mixed_dtypes() -> None:
    with pytest.raises(InvalidArgumentError, match="add needs inputs of one dtype, got "
                                                   "float32, int32"):
        _infer(Op.ADD, TensorType(F32, (2,)), TensorType(DType.INT32, (2,)))


def test_shapes_that_do_not_broadcast() -> None:
    with pytest.raises(InvalidArgumentError, match="cannot be broadcast together"):
        _infer(Op.MUL, TensorType(F32, (2, 3)), TensorType(F32, (4,)))
    with pytest.raises(InvalidArgumentError, match="cannot be broadcast together"):
        run_cpu(Op.MUL, [np.zeros((2, 3)), np.zeros(4)])


def test_broadcast_overflow() -> None:
    with pytest.raises(InvalidArgumentError, match=r"broadcast shape \(1099511627776, "
                                                   r"1099511627776\) has more than"):
        _infer(Op.ADD, TensorType(F32, (2**40, 1)), TensorType(F32, (1, 2**40)))


def test_prelu_slope_must_broadcast_to_x() -> None:
    with pytest.raises(InvalidArgumentError, match="prelu slope must broadcast to X"):
        _infer(Op.PRELU, TensorType(F32, (3,)), TensorType(F32, (2, 3)))


def test_where_condition_must_be_bool() -> None:
    with pytest.raises(InvalidArgumentError, match="where does not take float32 conditions"):
        _infer(Op.WHERE, TensorType(F32, (2,)), TensorType(F32, (2,)), TensorType(F32, (2,)))


@pytest.mark.parametrize(("op", "attrs", "message"), [
    (Op.MOD, {"fmod": 2}, "mod attribute 'fmod' must be one of 0, 1; got 2"),
    (Op.BIT_SHIFT, {"direction": "UP"}, "bit_shift attribute 'direction' must be one of "
                                        "'LEFT', 'RIGHT'; got 'UP'"),
])
def test_enumerated_binary_attributes(op: Op, attrs: dict[str, Any], message: str) -> None:
    x = np.array([4, 8], np.uint8)
    with pytest.raises(InvalidArgumentError, match=message):
        _infer(op, TensorType(DType.UINT8, (2,)), TensorType(DType.UINT8, (2,)), **attrs)
    for run in (run_ref, run_cpu):
        with pytest.raises(InvalidArgumentError, match=message):
            run(op, [x, x], **attrs)


def test_gelu_approximate_choice() -> None:
    message = "gelu attribute 'approximate' must be one of 'none', 'tanh'; got 'fast'"
    with pytest.raises(InvalidArgumentError, match=message):
        _infer(Op.GELU, TensorType(F32, (2,)), approximate="fast")
    for run in (run_ref, run_cpu):
        with pytest.raises(InvalidArgumentError, match=message):
            run(Op.GELU, [np.zeros(2, np.float32)], approximate="fast")


@pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
def test_clip_bound_errors(run: Any) -> None:
    x = np.zeros(3, np.float32)
    with pytest.raises(InvalidArgumentError, match="clip got its min twice: as input 1 and as "
                                                   "attribute 'min'"):
        run(Op.CLIP, [x, np.array(0.0, np.float32)], min=1.0)
    with pytest.raises(InvalidArgumentError, match=r"clip input 2 \(max\) must hold one "
                                                   r"element, got shape \(2,\)"):
        run(Op.CLIP, [x, None, np.zeros(2, np.float32)])


def test_clip_bound_schema_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="clip input 1 must hold one element"):
        _infer(Op.CLIP, TensorType(F32, (3,)), TensorType(F32, (2,)))
    with pytest.raises(InvalidArgumentError, match="clip input 2 must be float32 like input 0"):
        _infer(Op.CLIP, TensorType(F32, (3,)), None, TensorType(DType.FLOAT64, ()))


def test_attribute_errors() -> None:
    schema = get_schema(Op.LEAKY_RELU)
    with pytest.raises(InvalidArgumentError, match="unknown attribute 'alpah' for leaky_relu; "
                                                   "allowed: alpha"):
        schema.normalize_attrs({"alpah": 0.1})
    with pytest.raises(InvalidArgumentError, match="attribute 'alpha' of leaky_relu must be "
                                                   "float"):
        schema.normalize_attrs({"alpha": "steep"})


def test_arity_errors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"maximum takes 1\.\.any inputs, got 0"):
        get_schema(Op.MAXIMUM).check_arity(0)
    with pytest.raises(InvalidArgumentError, match=r"add takes 2\.\.2 inputs, got 3"):
        get_schema(Op.ADD).check_arity(3)
