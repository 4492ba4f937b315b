"""The reduction family: reference kernels against ONNX's reference evaluator,
seed 001's ``sum_all``/``mean_all``/``sum``/``mean``, ONNX's values for empty
reductions, schemas, the cpu kernels' ``out=`` and float16 accumulation, and
every typed error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op, OpGroup
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.conformance.cases_reduction import CASES
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
    "mean-int8": "ONNX's evaluator accumulates an integer mean in the input dtype and wraps",
    "mean-uint8": "ONNX's evaluator accumulates an integer mean in the input dtype and wraps",
    "reduce_sum_square-int32": "ONNX's evaluator returns int64, not the input dtype",
    "reduce_sum_square-uint32": "ONNX's evaluator returns uint64, not the input dtype",
    "reduce_log_sum_exp-scalar": "ONNX's evaluator fails on a rank-0 input",
    "cumsum-scalar": "ONNX's evaluator flattens a rank-0 input to shape (1,)",
    "cumprod-scalar": "ONNX's evaluator flattens a rank-0 input to shape (1,)",
}
_AXES_OPS = OpGroup.REDUCTION - {Op.SUM_ALL, Op.MEAN_ALL, Op.ARGMAX, Op.ARGMIN, Op.CUMSUM,
                                 Op.CUMPROD}


def _onnx_form(case: OpCase, inputs: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The case as an ONNX node: axes and the cumulative axis become inputs."""
    attrs = {k: int(v) if isinstance(v, bool) else v for k, v in case.attrs.items()}
    if case.op in _AXES_OPS:
        axes = attrs.pop("axes", None)
        axes = attrs.pop("axis", axes)
        if axes is not None:
            inputs = [inputs[0], np.array(np.atleast_1d(axes), np.int64)]
    if case.op in (Op.CUMSUM, Op.CUMPROD):
        axis = attrs.pop("axis", None)
        axis_input = np.asarray(inputs[1] if len(inputs) > 1 else axis)
        inputs = [inputs[0], axis_input.reshape(()).astype(np.int64)]   # ONNX: rank 0
    return inputs, attrs


_ORACLE_CASES = [c for c in CASES if c.op in ONNX_NAMES and c.id not in NO_ORACLE]


@pytest.mark.parametrize("case", _ORACLE_CASES, ids=lambda c: c.id)
def test_reference_matches_onnx(case: OpCase) -> None:
    inputs = case_inputs(case)
    onnx_inputs, onnx_attrs = _onnx_form(case, inputs)
    expected = onnx_run(ONNX_NAMES[case.op], onnx_inputs, **onnx_attrs)
    actual = run_ref(case.op, inputs, **case.attrs)[0]
    assert_close(actual, expected, max(case.rtol, 1e-6), max(case.atol, 1e-7), case.id)


RUNS = pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
X = np.arange(24, dtype=np.float32).reshape(2, 3, 4)


@RUNS
class TestSeed001:
    """seed 001's four reductions, by hand."""

    def test_sum_all(self, run: Any) -> None:
        out = run(Op.SUM_ALL, [X])[0]
        assert_close(out, np.array(276.0, np.float32))

    def test_mean_all(self, run: Any) -> None:
        out = run(Op.MEAN_ALL, [X])[0]
        assert_close(out, np.array(11.5, np.float32))

    def test_sum_keeps_dims_by_default(self, run: Any) -> None:
        assert_close(run(Op.SUM, [X], axes=[1])[0], X.sum(axis=1, keepdims=True))
        assert_close(run(Op.SUM, [X], axis=-1, keepdims=False)[0], X.sum(axis=-1))
        assert_close(run(Op.SUM, [X])[0], X.sum(keepdims=True))

    def test_mean(self, run: Any) -> None:
        assert_close(run(Op.MEAN, [X], axes=[0, 2], keepdims=False)[0], X.mean(axis=(0, 2)))
        assert_close(run(Op.MEAN, [X, np.array([1], np.int64)])[0],
                     X.mean(axis=1, keepdims=True))


@RUNS
class TestEdges:
    """Empty reductions (ONNX's values), integer means, noop, cumulative flags."""

    @pytest.mark.parametrize(("op", "value"), [
        (Op.SUM, 0.0), (Op.REDUCE_PROD, 1.0), (Op.REDUCE_MAX, -np.inf),
        (Op.REDUCE_MIN, np.inf), (Op.MEAN, np.nan), (Op.REDUCE_L2, 0.0),
        (Op.REDUCE_LOG_SUM, -np.inf), (Op.REDUCE_LOG_SUM_EXP, -np.inf),
    ])
    def test_empty_float(self, run: Any, op: Op, value: float) -> None:
        out = run(op, [np.zeros((0, 3), np.float32)], axes=[0], keepdims=False)[0]
        assert_close(out, np.full(3, value, np.float32))

    def test_empty_integer_and_bool(self, run: Any) -> None:
        empty = np.zeros((2, 0), np.int32)
        assert_close(run(Op.REDUCE_MAX, [empty], axes=[1])[0], np.full((2, 1), -2**31, np.int32))
        assert_close(run(Op.REDUCE_MIN, [empty], axes=[1])[0], np.full((2, 1), 2**31 - 1,
                                                                         np.int32))
        assert_close(run(Op.MEAN, [empty], axes=[1])[0], np.zeros((2, 1), np.int32))
        flags = np.zeros((0,), bool)
        assert_close(run(Op.REDUCE_MAX, [flags])[0], np.array([False]))
        assert_close(run(Op.REDUCE_MIN, [flags])[0], np.array([True]))
        assert_close(run(Op.SUM_ALL, [np.zeros(0, np.int64)])[0], np.array(0, np.int64))
        assert_close(run(Op.MEAN_ALL, [np.zeros(0, np.float32)])[0],
                     np.array(np.nan, np.float32))

    def test_integer_mean_truncates_toward_zero(self, run: Any) -> None:
        x = np.array([[-3, -4], [3, 4], [120, 120]], np.int8)
        assert_close(run(Op.MEAN, [x], axes=[1], keepdims=False)[0],
                     np.array([-3, 3, 120], np.int8))

    def test_integer_sum_of_squares_keeps_the_dtype(self, run: Any) -> None:
        x = np.array([[3, 4], [1, 2]], np.int32)
        assert_close(run(Op.REDUCE_SUM_SQUARE, [x], axes=[1])[0],
                     np.array([[25], [5]], np.int32))

    def test_noop_with_empty_axes(self, run: Any) -> None:
        x = np.array([[-1.0, 2.0]], np.float32)
        assert_close(run(Op.SUM, [x], noop_with_empty_axes=True)[0], x)
        assert_close(run(Op.REDUCE_SUM_SQUARE, [x, np.zeros(0, np.int64)],
                         noop_with_empty_axes=True)[0], x * x)

    def test_cumulative_flags(self, run: Any) -> None:
        x, axis = np.array([1, 2, 3, 4], np.int32), np.array(0, np.int64)
        for (exclusive, reverse), expected in {
            (False, False): [1, 3, 6, 10], (True, False): [0, 1, 3, 6],
            (False, True): [10, 9, 7, 4], (True, True): [9, 7, 4, 0],
        }.items():
            out = run(Op.CUMSUM, [x, axis], exclusive=exclusive, reverse=reverse)[0]
            assert_close(out, np.array(expected, np.int32))
        assert_close(run(Op.CUMPROD, [x], axis=0, exclusive=True)[0],
                     np.array([1, 1, 2, 6], np.int32))

    def test_arg_select_last_index(self, run: Any) -> None:
        x = np.array([[1, 3, 3, 0], [2, 2, 2, 2]], np.int32)
        assert_close(run(Op.ARGMAX, [x], axis=1)[0], np.array([[1], [0]], np.int64))
        assert_close(run(Op.ARGMAX, [x], axis=1, select_last_index=True, keepdims=False)[0],
                     np.array([2, 3], np.int64))
        assert_close(run(Op.ARGMIN, [x], axis=-1, select_last_index=True)[0],
                     np.array([[3], [3]], np.int64))


def test_cpu_float16_accumulates_in_float32() -> None:
    ones = np.ones(10_000, np.float16)        # float16 steps of 8 above 8192: 10000 exact
    assert run_cpu(Op.SUM_ALL, [ones])[0] == 10_000
    assert run_cpu(Op.MEAN, [ones], keepdims=False)[0] == 1
    assert run_cpu(Op.CUMSUM, [ones], axis=0)[0][-1] == 10_000


@pytest.mark.parametrize("op", [Op.SUM, Op.REDUCE_MAX, Op.REDUCE_LOG_SUM_EXP, Op.MEAN])
def test_cpu_writes_into_the_output_given(op: Op) -> None:
    expected = run_ref(op, [X], axes=[2])[0]
    out = np.full(expected.shape, 7, expected.dtype)
    assert run_cpu(op, [X], out=[out], axes=[2])[0] is out
    assert_close(out, expected, rtol=1e-6)


# ---- schemas -----------------------------------------------------------------------
F32 = DType.FLOAT32


def _infer(op: Op, *types: TensorType | None, values: list[Any] | None = None,
           **attrs: Any) -> list[TensorType | None]:
    schema = get_schema(op)
    return schema.infer_types(list(types), schema.normalize_attrs(attrs), values)


def test_infer_reductions() -> None:
    x = TensorType(F32, ("n", 3, 4))
    assert _infer(Op.SUM, x, axes=[1]) == [TensorType(F32, ("n", 1, 4))]
    assert _infer(Op.MEAN, x, axes=[-1], keepdims=False) == [TensorType(F32, ("n", 3))]
    assert _infer(Op.SUM_ALL, x) == [TensorType(F32, ())]
    assert _infer(Op.REDUCE_MAX, x, noop_with_empty_axes=True) == [x]
    axes = TensorType(DType.INT64, (1,))
    assert _infer(Op.SUM, x, axes, values=[None, np.array([0])]) == [
        TensorType(F32, (1, 3, 4))]
    # Axes known only when running: the rank survives only with keepdims.
    assert _infer(Op.SUM, x, axes, values=[None, None]) == [TensorType(F32, (None,) * 3)]
    assert _infer(Op.SUM, x, axes, values=[None, None], keepdims=False) == [
        TensorType(F32, None)]


def test_infer_arg_and_cumulative() -> None:
    x = TensorType(DType.INT32, (2, 5))
    assert _infer(Op.ARGMIN, x, axis=1, keepdims=False) == [TensorType(DType.INT64, (2,))]
    assert _infer(Op.CUMSUM, x, TensorType(DType.INT64, ()), values=[None, np.array(1)]) == [x]


def test_every_reduction_has_a_schema_and_kernels() -> None:
    from keel.backends.cpu.kernels import load as load_cpu
    from keel.backends.reference.kernels import load as load_reference

    for op in OpGroup.REDUCTION:
        assert get_schema(op).op is op
        assert op in load_reference() and op in load_cpu(), op


# ---- typed errors ------------------------------------------------------------------
@pytest.mark.parametrize("run", [run_ref, run_cpu, None], ids=["reference", "cpu", "schema"])
class TestAxisErrors:
    @staticmethod
    def _call(run: Any, op: Op, x: np.ndarray, *extra: Any, **attrs: Any) -> None:
        if run is None:
            types = [TensorType(DType.from_numpy(x.dtype), x.shape)]
            types += [TensorType(DType.from_numpy(e.dtype), e.shape) for e in extra]
            _infer(op, *types, values=[None, *extra], **attrs)
        else:
            run(op, [x, *extra], **attrs)

    def test_axis_out_of_range(self, run: Any) -> None:
        with pytest.raises(InvalidArgumentError,
                           match=r"sum axis 3 is out of range for rank 2; allowed: -2\.\.1"):
            self._call(run, Op.SUM, np.zeros((2, 3)), axes=[3])

    def test_axis_twice(self, run: Any) -> None:
        with pytest.raises(InvalidArgumentError,
                           match=r"reduce_max axes \(1, -1\) name an axis twice"):
            self._call(run, Op.REDUCE_MAX, np.zeros((2, 3)), axes=[1, -1])

    def test_axes_from_two_places(self, run: Any) -> None:
        with pytest.raises(InvalidArgumentError,
                           match="mean takes its axes from one place; got axes and input 1"):
            self._call(run, Op.MEAN, np.zeros((2, 3)), np.array([0]), axes=[1])
        with pytest.raises(InvalidArgumentError, match="got axes and axis"):
            self._call(run, Op.MEAN, np.zeros((2, 3)), axes=[1], axis=[0])

    def test_axes_input_must_be_integers(self, run: Any) -> None:
        with pytest.raises(InvalidArgumentError,
                           match=r"sum axes \(input 1\) must be integers, got float32"):
            self._call(run, Op.SUM, np.zeros((2, 3)), np.array([0.0], np.float32))

    def test_arg_over_an_empty_axis(self, run: Any) -> None:
        with pytest.raises(InvalidArgumentError,
                           match=r"argmax over axis 1 of shape \(2, 0\): the axis is empty"):
            self._call(run, Op.ARGMAX, np.zeros((2, 0)), axis=1)
        with pytest.raises(InvalidArgumentError, match="argmin needs an input of rank >= 1"):
            self._call(run, Op.ARGMIN, np.zeros(()))

    def test_cumulative_axis(self, run: Any) -> None:
        if run is not None:     # a schema cannot tell a missing axis from an unknown one
            with pytest.raises(InvalidArgumentError, match="cumsum needs an axis: pass it as "
                                                           "input 1 or as attribute 'axis'"):
                self._call(run, Op.CUMSUM, np.zeros(3))
        with pytest.raises(InvalidArgumentError,
                           match="cumprod takes its axis from one place"):
            self._call(run, Op.CUMPROD, np.zeros(3), np.array(0), axis=0)
        with pytest.raises(InvalidArgumentError, match=r"cumsum axis \(input 1\) must be one "
                                                       r"integer, got int64 of shape \(2,\)"):
            self._call(run, Op.CUMSUM, np.zeros(3), np.array([0, 0]))
        with pytest.raises(InvalidArgumentError, match="cumsum axis -2 is out of range"):
            self._call(run, Op.CUMSUM, np.zeros(3), np.array(-2))


def test_reduction_dtype_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="reduce_log_sum does not take int32 inputs"):
        _infer(Op.REDUCE_LOG_SUM, TensorType(DType.INT32, (2,)))
    with pytest.raises(InvalidArgumentError, match="sum does not take bool inputs"):
        _infer(Op.SUM, TensorType(DType.BOOL, (2,)))
