"""Helpers for the normalization, resize and quantization op tests.

Kernels are called directly (reference and cpu tables, NumPy namespace), and
single-node ONNX models run through ``onnx.reference.ReferenceEvaluator`` as
the oracle.
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


def onnx_run(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
             opset: int = 23, **attrs: Any) -> list[np.ndarray]:
    """One ONNX node on ``inputs`` (None: absent) through ONNX's reference evaluator."""
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    while names and names[-1] == "":
        names.pop()
    outputs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, names, outputs, **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs, strict=False) if x is not None],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: x for n, x in zip(names, inputs, strict=False) if x is not None}
    return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, feeds)]
