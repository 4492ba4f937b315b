"""Helpers for the shape and indexing op tests: run kernels directly, and ONNX's oracle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._kernels import run_cpu as run_cpu
from tests.ops._kernels import run_ref as run_ref

OPSET = 21
def run_both(op: Op, inputs: Sequence[Any], **attrs: Any) -> list[np.ndarray]:
    """Reference outputs, after checking the cpu kernel gives the same."""
    expected = run_ref(op, inputs, **attrs)
    actual = run_cpu(op, inputs, **attrs)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_allclose(np.asarray(a, dtype=np.float64) if e.dtype.kind == "b" else a,
                                   np.asarray(e, dtype=np.float64) if e.dtype.kind == "b" else e,
                                   rtol=1e-6, atol=1e-6)
    return expected


def onnx_run(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
             opset: int = OPSET, **attrs: Any) -> list[np.ndarray]:
    """Run one ONNX node on ``inputs`` (None = absent) with ONNX's reference evaluator."""
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    while names and names[-1] == "":
        names.pop()
    outputs = [f"out{i}" for i in range(n_outputs)]
    onnx_attrs = {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v
                  for k, v in attrs.items()}
    node = helper.make_node(op_type, names, outputs, **onnx_attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs, strict=False) if x is not None],
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: x for n, x in zip(names, inputs, strict=False) if x is not None}
    return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, feeds)]


def assert_same(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> None:
    """Same count, dtypes, shapes and values (floats to 1e-6)."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype, (a.dtype, e.dtype)
        assert a.shape == e.shape, (a.shape, e.shape)
        if e.dtype.kind == "f":
            np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, e)


def ttype(dtype: str, shape: Sequence[Any] | None) -> TensorType:
    return TensorType(DType(dtype), None if shape is None else tuple(shape))


def infer(op: Op, types: Sequence[TensorType | None], values: Sequence[Any] | None = None,
          **attrs: Any) -> list[TensorType | None]:
    schema = get_schema(op)
    return schema.infer_types(list(types), schema.normalize_attrs(attrs),
                              None if values is None else list(values))


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)
