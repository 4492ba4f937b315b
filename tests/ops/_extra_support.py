"""Helpers for the loss, attention, vision, signal, recurrent and numeric op tests.

Kernels are called directly (reference and cpu tables, NumPy namespace), and
single-node ONNX models run through ``onnx.reference.ReferenceEvaluator`` as
the oracle, or through keel's importer and executor (``keel_run``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu.kernels import load as load_cpu
from keel.backends.reference.kernels import load as load_reference
from keel.ops.registry import Op
from keel.ops.schema import get_schema

REF_CTX = KernelContext(np, "reference", DeviceKind.CPU)
CPU_CTX = KernelContext(np, "cpu", DeviceKind.CPU)


def run_ref(op: Op, inputs: Sequence[Any], **attrs: Any) -> list[np.ndarray]:
    """The reference kernel of ``op`` with schema-normalized ``attrs``."""
    norm = get_schema(op).normalize_attrs(attrs)
    return list(load_reference().get(op).fn(REF_CTX, list(inputs), norm, None))


def run_cpu(op: Op, inputs: Sequence[Any], out: Sequence[Any] | None = None,
            **attrs: Any) -> list[Any]:
    """The cpu kernel of ``op`` (NumPy namespace), optionally into ``out``."""
    norm = get_schema(op).normalize_attrs(attrs)
    return list(load_cpu().get(op).fn(CPU_CTX, list(inputs), norm, out))


def run_both(op: Op, inputs: Sequence[Any], rtol: float = 1e-5, atol: float = 1e-5,
             **attrs: Any) -> list[np.ndarray]:
    """Reference outputs, after checking the cpu kernel agrees with them."""
    expected = run_ref(op, inputs, **attrs)
    assert_close(run_cpu(op, inputs, **attrs), expected, rtol, atol)
    return expected


def assert_close(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray],
                 rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Same count, dtypes and shapes; floats within tolerance, others exact."""
    assert len(actual) == len(expected), (len(actual), len(expected))
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype, (a.dtype, e.dtype)
        assert a.shape == e.shape, (a.shape, e.shape)
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
        else:
            np.testing.assert_array_equal(a, e)


def onnx_model(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
               opset: int = 23, outputs: Sequence[str] | None = None, **attrs: Any) -> Any:
    """A one-node ONNX model; None inputs and "" outputs are absent."""
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    while names and names[-1] == "":
        names.pop()
    outs = list(outputs) if outputs is not None else [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs, strict=False) if x is not None],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs if o])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def feeds(inputs: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
    return {f"in{i}": x for i, x in enumerate(inputs) if x is not None}


def onnx_run(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
             opset: int = 23, outputs: Sequence[str] | None = None,
             **attrs: Any) -> list[np.ndarray]:
    """One ONNX node on ``inputs`` through ONNX's reference evaluator."""
    model = onnx_model(op_type, inputs, n_outputs, opset, outputs, **attrs)
    return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, feeds(inputs))]


def keel_run(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
             opset: int = 23, outputs: Sequence[str] | None = None, backend: str = "cpu",
             **attrs: Any) -> list[np.ndarray]:
    """One ONNX node imported and run by keel (``load_model``) on ``backend``."""
    from keel.execution.model import load_model

    model = onnx_model(op_type, inputs, n_outputs, opset, outputs, **attrs)
    return [np.asarray(r) for r in load_model(model, backend=backend).run(None, feeds(inputs))]
