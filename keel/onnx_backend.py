"""keel as an ONNX backend (``onnx.backend.base.Backend``).

``prepare(model, device)`` loads a model once and returns a rep whose
``run(inputs)`` takes the inputs in graph order (or a dict) and returns the
outputs in graph order; ``run_model`` and ``run_node`` are the one-shot
forms. Devices: ``"CPU"`` runs on keel's ``cpu`` backend, ``"CUDA"`` on its
``gpu`` backend; ``backend="reference"`` (or any registered name) as a
keyword picks a keel backend directly. This is what onnx's backend test suite
drives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from onnx import ModelProto, NodeProto, helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.execution.model import Model, load_model

__all__ = ["KeelBackend", "KeelBackendRep", "prepare", "run_model", "run_node",
           "supports_device"]

_LOAD_OPTIONS = ("backend", "precision", "memory_limit", "optimization_level", "threads",
                 "registry")


class KeelBackendRep(BackendRep):
    """A prepared model: ``run`` feeds inputs in graph order and returns outputs in order."""

    def __init__(self, model: Model, input_names: Sequence[str]) -> None:
        self.model = model
        self.input_names = list(input_names)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        feeds = self._feeds(inputs)
        return tuple(self.model.run(None, feeds))

    def _feeds(self, inputs: Any) -> dict[str, Any]:
        if isinstance(inputs, Mapping):
            return dict(inputs)
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        values = list(inputs)
        if len(values) > len(self.input_names):
            raise InvalidArgumentError(
                f"{len(values)} inputs given; the model takes at most "
                f"{len(self.input_names)}: {', '.join(self.input_names)}")
        return dict(zip(self.input_names, values, strict=False))


class KeelBackend(Backend):
    """The ONNX backend interface over ``keel.load_model``."""

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> KeelBackendRep:
        options = {k: v for k, v in kwargs.items() if k in _LOAD_OPTIONS}
        options.setdefault("backend", _device_backend(device))
        loaded = load_model(model, **options)
        return KeelBackendRep(loaded, loaded.input_names)

    @classmethod
    def run_model(cls, model: ModelProto, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple[Any, ...]:
        """Run one node on ``inputs`` (in the node's input order)."""
        arrays = [np.asarray(x) for x in inputs]
        names = [n for n in node.input if n]
        if len(arrays) != len(names):
            raise InvalidArgumentError(
                f"node {node.op_type} has {len(names)} inputs; {len(arrays)} arrays given")
        graph_inputs = [helper.make_tensor_value_info(n, DType.from_numpy(a.dtype).onnx,
                                                      list(a.shape))
                        for n, a in zip(names, arrays, strict=True)]
        graph_outputs = [_output_info(n, outputs_info, i) for i, n in enumerate(node.output)
                         if n]
        graph = helper.make_graph([node], f"{node.op_type}_node", graph_inputs, graph_outputs)
        opset = kwargs.pop("opset_version", None)
        imports = [helper.make_opsetid("", int(opset))] if opset is not None else None
        model = helper.make_model(graph, opset_imports=imports)
        return cls.run_model(model, arrays, device, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            kind = Device(device).type
        except (AttributeError, ValueError):
            return False
        if kind == DeviceType.CPU:
            return True
        from keel.backends.registry import default_registry

        return default_registry().availability("gpu").available


def _device_backend(device: str) -> str:
    try:
        kind = Device(device).type
    except (AttributeError, ValueError):
        raise InvalidArgumentError(
            f"device {device!r} is not an ONNX device; use CPU or CUDA[:index]") from None
    return "cpu" if kind == DeviceType.CPU else "gpu"


def _output_info(name: str, outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None,
                 index: int) -> Any:
    if outputs_info is not None and index < len(outputs_info):
        dtype, shape = outputs_info[index]
        return helper.make_tensor_value_info(name, DType.from_numpy(dtype).onnx, list(shape))
    return helper.make_empty_tensor_value_info(name)


prepare = KeelBackend.prepare
run_model = KeelBackend.run_model
run_node = KeelBackend.run_node
supports_device = KeelBackend.supports_device
