"""Helpers for the matmul, conv and pooling tests: run a kernel, run one ONNX node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu.kernels import load as load_cpu
from keel.backends.reference.kernels import load as load_reference
from keel.ops.registry import Op
from keel.ops.schema import get_schema

REFERENCE = load_reference()
CPU = load_cpu()
REF_CTX = KernelContext(np, "reference", DeviceKind.CPU)
CPU_CTX = KernelContext(np, "cpu", DeviceKind.CPU)


def ref(op: Op, inputs: Sequence[np.ndarray | None], **attrs: Any) -> list[np.ndarray]:
    """The reference kernel of ``op`` on ``inputs`` (attributes normalized by the schema)."""
    norm = get_schema(op).normalize_attrs(attrs)
    return list(REFERENCE.get(op).fn(REF_CTX, list(inputs), norm, None))


def cpu(op: Op, inputs: Sequence[np.ndarray | None], variant: str = "default",
        out: Sequence[np.ndarray] | None = None, **attrs: Any) -> list[np.ndarray]:
    """A cpu kernel variant of ``op`` on ``inputs``."""
    norm = get_schema(op).normalize_attrs(attrs)
    return list(CPU.get(op, variant).fn(CPU_CTX, list(inputs), norm, out))


def _model(op_type: str, inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any],
           out_types: Sequence[Any], opset: int) -> Any:
    from onnx import helper

    names = [f"x{i}" if x is not None else "" for i, x in enumerate(inputs)]
    node = helper.make_node(op_type, names, [f"y{i}" for i in range(len(out_types))], **attrs)
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
        for n, x in zip(names, inputs, strict=True) if x is not None]
    graph_outputs = [
        helper.make_tensor_value_info(f"y{i}", helper.np_dtype_to_tensor_dtype(np.dtype(t)),
                                      None) for i, t in enumerate(out_types)]
    graph = helper.make_graph([node], op_type, graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=10)


def _feeds(inputs: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
    return {f"x{i}": x for i, x in enumerate(inputs) if x is not None}


def onnx_reference(op_type: str, inputs: Sequence[np.ndarray | None],
                   out_types: Sequence[Any] = (np.float32,), opset: int = 21,
                   **attrs: Any) -> list[np.ndarray]:
    """One ONNX node through ``onnx.reference.ReferenceEvaluator`` (the oracle)."""
    from onnx.reference import ReferenceEvaluator

    model = _model(op_type, inputs, attrs, out_types, opset)
    return list(ReferenceEvaluator(model).run(None, _feeds(inputs)))


def onnxruntime_node(op_type: str, inputs: Sequence[np.ndarray | None],
                     out_types: Sequence[Any] = (np.float32,), opset: int = 21,
                     **attrs: Any) -> list[np.ndarray]:
    """One ONNX node through onnxruntime (callers skip when it is not installed)."""
    import onnxruntime

    model = _model(op_type, inputs, attrs, out_types, opset)
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return list(session.run(None, _feeds(inputs)))
