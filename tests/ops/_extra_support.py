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

from tests.ops._kernels import assert_close as assert_close
from tests.ops._kernels import run_both as run_both
from tests.ops._kernels import run_cpu as run_cpu
from tests.ops._kernels import run_ref as run_ref


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
