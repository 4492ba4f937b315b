"""The numeric family: bitcast and det against ONNX's oracle, typed errors."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._extra_support import assert_close, keel_run, onnx_run, run_both, run_cpu, run_ref

RNG = np.random.default_rng(34)


@pytest.mark.parametrize(("x", "to", "code"), [
    (RNG.standard_normal((2, 3)).astype(np.float32), DType.INT32, TensorProto.INT32),
    (np.array([-1, 5, 300], np.int16), DType.FLOAT16, TensorProto.FLOAT16),
    (np.array([True, False]), DType.UINT8, TensorProto.UINT8),
    (np.array(2.5, np.float64), DType.INT64, TensorProto.INT64),
])
def test_bitcast_matches_onnx(x: np.ndarray, to: DType, code: int) -> None:
    expected = onnx_run("BitCast", [x], opset=26, to=code)
    assert_close(run_both(Op.BITCAST, [x], to=to), expected)


def test_bitcast_into_a_given_buffer_and_from_a_view() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    buf = np.empty((3, 2), np.uint32)
    (got,) = run_cpu(Op.BITCAST, [x], out=[buf], to=DType.UINT32)
    assert got is buf
    np.testing.assert_array_equal(got, np.ascontiguousarray(x).view(np.uint32))


def test_bitcast_width_mismatch_and_import() -> None:
    with pytest.raises(InvalidArgumentError, match=r"float32 \(32 bits\) cannot be read as int64"):
        run_ref(Op.BITCAST, [np.zeros(2, np.float32)], to=DType.INT64)
    schema = get_schema(Op.BITCAST)
    with pytest.raises(InvalidArgumentError, match="the widths must match"):
        schema.infer_types([TensorType(DType.INT8, (2,))], schema.normalize_attrs({"to": "int16"}))
    x = RNG.standard_normal(4).astype(np.float32)
    assert_close(keel_run("BitCast", [x], opset=26, to=TensorProto.UINT32),
                 [x.view(np.uint32)])


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (2, 1, 1)])
def test_det_matches_onnx(shape: tuple[int, ...]) -> None:
    x = RNG.standard_normal(shape).astype(np.float32)
    expected = onnx_run("Det", [x], opset=22)
    assert_close(run_both(Op.DET, [x], rtol=1e-5, atol=1e-5), expected, 1e-5, 1e-5)


def test_det_edge_cases() -> None:
    (empty,) = run_both(Op.DET, [np.zeros((2, 0, 0), np.float64)])
    np.testing.assert_array_equal(empty, [1.0, 1.0])
    with pytest.raises(InvalidArgumentError, match=r"X must be \(\*, M, M\)"):
        run_cpu(Op.DET, [np.zeros((2, 3), np.float32)])
    with pytest.raises(InvalidArgumentError,
                       match="X must be float16, bfloat16, float32 or float64"):
        run_ref(Op.DET, [np.zeros((2, 2), np.int32)])
    schema = get_schema(Op.DET)
    assert schema.infer_types([TensorType(DType.FLOAT32, ("b", 3, 3))], {}) == \
        [TensorType(DType.FLOAT32, ("b",))]
