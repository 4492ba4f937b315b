"""The memory family: seed 001's ``copy`` and ``fill``, ``cast`` and ``identity``
against ONNX's reference evaluator, schemas, and every typed error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.dtypes import DType, as_dtype
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.conformance.cases_memory import CASES
from tests.conformance.harness import OpCase, case_inputs
from tests.ops._elementwise_support import (
    ONNX_NAMES,
    assert_close,
    onnx_run,
    run_cpu,
    run_ref,
)

RUNS = pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])


def _onnx_runs(case: OpCase) -> bool:
    """onnx's reference casts with ml_dtypes' direct conversions, which leave out some
    pairs of narrow types (int4 -> int2, float8e8m0 -> int4, ...); keel casts those
    through float32, and the conformance suite checks them against keel's reference."""
    if case.op is not Op.CAST:
        return True
    source = case_inputs(case)[0]
    assert source is not None
    try:
        np.zeros(1, source.dtype).astype(as_dtype(case.attrs["to"]).numpy)
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("case", [c for c in CASES if c.op in ONNX_NAMES and _onnx_runs(c)],
                         ids=lambda c: c.id)
def test_reference_matches_onnx(case: OpCase) -> None:
    inputs = case_inputs(case)
    attrs = dict(case.attrs)
    if case.op is Op.CAST:
        attrs["to"] = as_dtype(attrs["to"]).onnx
    expected = onnx_run(ONNX_NAMES[case.op], inputs, **attrs)
    assert_close(run_ref(case.op, inputs, **case.attrs)[0], expected, what=case.id)


@RUNS
class TestSeed001:
    def test_copy(self, run: Any) -> None:
        x = np.arange(8, dtype=np.float32)
        fresh = run(Op.COPY, [x])[0]
        assert_close(fresh, x)
        assert not np.shares_memory(fresh, x)

    def test_copy_into_output(self, run: Any) -> None:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        out = np.zeros((2, 4), np.float32)
        result = _with_out(run, Op.COPY, [x], out)
        assert result is out
        assert_close(out, x)

    def test_copy_needs_exactly_the_input_shape(self, run: Any) -> None:
        x = np.zeros(8, np.float32)
        with pytest.raises(InvalidArgumentError, match=r"copy needs an output of exactly the "
                                                       r"input's shape and dtype float32\[8\], "
                                                       r"got float32\[2, 4\]"):
            _with_out(run, Op.COPY, [x], np.zeros((2, 4), np.float32))
        with pytest.raises(InvalidArgumentError, match=r"got float64\[8\] \(use cast"):
            _with_out(run, Op.COPY, [x], np.zeros(8, np.float64))

    def test_fill_reads_element_zero(self, run: Any) -> None:
        # seed 001's example: the value sits in element 0, the rest is padding.
        value = np.array([42.0, 0.0, 0.0, 0.0], np.float32)
        out = np.zeros(8, np.float32)
        assert _with_out(run, Op.FILL, [value], out) is out
        assert_close(out, np.full(8, 42.0, np.float32))

    def test_fill_with_shape_attribute(self, run: Any) -> None:
        value = np.array([[2.5, 9.0]], np.float64)
        assert_close(run(Op.FILL, [value], shape=[2, 3])[0], np.full((2, 3), 2.5))
        assert_close(run(Op.FILL, [value], shape=[3], dtype="int32")[0],
                     np.full(3, 2, np.int32))

    def test_fill_errors(self, run: Any) -> None:
        with pytest.raises(InvalidArgumentError, match="fill reads its value from element 0 "
                                                       "of input 0, which is empty"):
            run(Op.FILL, [np.zeros(0, np.float32)], shape=[2])
        with pytest.raises(InvalidArgumentError, match="fill needs its output shape: pass an "
                                                       "output tensor or the attribute 'shape'"):
            run(Op.FILL, [np.ones(4, np.float32)])
        with pytest.raises(InvalidArgumentError, match=r"fill shape \(2, -1\) has a negative"):
            run(Op.FILL, [np.ones(4, np.float32)], shape=[2, -1])
        with pytest.raises(InvalidArgumentError, match="elements \\(overflow\\)"):
            run(Op.FILL, [np.ones(4, np.float32)], shape=[2**40, 2**40])

    def test_cast_truncates_toward_zero_and_tests_nonzero(self, run: Any) -> None:
        x = np.array([-2.7, -0.5, 0.0, 0.5, 2.7, np.nan], np.float32)
        assert_close(run(Op.CAST, [x[:5]], to="int8")[0], np.array([-2, 0, 0, 0, 2], np.int8))
        assert_close(run(Op.CAST, [x], to=DType.BOOL)[0],
                     np.array([True, True, False, True, True, True]))

    def test_cast_rejects_strings(self, run: Any) -> None:
        with pytest.raises(UnsupportedOperationError, match="float32 -> string: string tensors "
                                                            "are not supported"):
            run(Op.CAST, [np.zeros(2, np.float32)], to="string")

    def test_identity_is_a_fresh_copy(self, run: Any) -> None:
        x = np.arange(3, dtype=np.int16)
        out = run(Op.IDENTITY, [x])[0]
        assert_close(out, x)
        assert not np.shares_memory(out, x)


def _with_out(run: Any, op: Op, inputs: list[Any], out: np.ndarray) -> Any:
    """Run ``op`` writing into ``out``; returns what the kernel returned."""
    return run(op, inputs, out=[out])[0]


def test_cpu_identity_into_its_own_input_is_a_no_op() -> None:
    x = np.arange(4, dtype=np.float32)
    assert run_cpu(Op.IDENTITY, [x], out=[x])[0] is x
    assert_close(x, np.arange(4, dtype=np.float32))


def test_schemas() -> None:
    x = TensorType(DType.FLOAT32, ("n", 3))
    cast = get_schema(Op.CAST)
    assert cast.infer_types([x], cast.normalize_attrs({"to": "int64"})) == [
        TensorType(DType.INT64, ("n", 3))]
    fill = get_schema(Op.FILL)
    assert fill.infer_types([x], fill.normalize_attrs({"shape": [2]})) == [
        TensorType(DType.FLOAT32, (2,))]
    assert fill.infer_types([x], fill.normalize_attrs({"dtype": "uint8"})) == [
        TensorType(DType.UINT8, None)]
    assert get_schema(Op.COPY).infer_types([x], {}) == [x]
    assert get_schema(Op.IDENTITY).inplace == ((0, 0),)
    assert get_schema(Op.COPY).inplace == ()


def test_schema_errors() -> None:
    cast = get_schema(Op.CAST)
    with pytest.raises(InvalidArgumentError, match="cast requires attribute 'to' \\(dtype\\)"):
        cast.normalize_attrs({})
    with pytest.raises(InvalidArgumentError, match="attribute 'to' of cast must be dtype"):
        cast.normalize_attrs({"to": "float128"})
    with pytest.raises(UnsupportedOperationError, match="string -> float32"):
        cast.infer_types([TensorType(DType.STRING, (2,))], cast.normalize_attrs({"to": "f32"}))
    fill = get_schema(Op.FILL)
    with pytest.raises(InvalidArgumentError, match=r"fill shape \(-3,\) has a negative"):
        fill.infer_types([TensorType(DType.FLOAT32, (1,))],
                         fill.normalize_attrs({"shape": [-3]}))
