# ruff: noqa: F401
"""keel: a hardware-adaptive inference and tensor runtime.

probe the machine → plan where and how work runs (with reasons) → run it.
The public API is re-exported here and loaded lazily, so ``import keel`` stays
fast and imports no optional package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from keel import _dataclass_code
from keel.dtypes import DType
from keel.errors import (
    BackendSelectionError,
    ExecutionError,
    InvalidArgumentError,
    KeelError,
    MemoryLimitError,
    ModelFormatError,
    UnsupportedOperationError,
    VerificationError,
)

__version__ = "0.1.0"

_dataclass_code.install()       # keel's dataclasses compile their methods once per machine

# public name -> module that defines it
_LAZY = {
    "probe": "keel.hardware",
    "HardwareProfile": "keel.hardware.profile",
    "DeviceInfo": "keel.hardware.profile",
    "detect_devices": "keel.hardware",
    "RuntimePolicy": "keel.planning.policy",
    "RuntimePlan": "keel.planning.runtime_plan",
    "plan_runtime": "keel.planning.runtime_plan",
    "Op": "keel.ops.registry",
    "OpGroup": "keel.ops.registry",
    "Backend": "keel.backends.base",
    "BackendRegistry": "keel.backends.registry",
    "default_registry": "keel.backends.registry",
    "register_backend": "keel.backends.registry",
    "set_backend_priority": "keel.backends.registry",
    "select_backend": "keel.planning.selection",
    "OperationProperties": "keel.planning.selection",
    "Runtime": "keel.runtime",
    "TensorDesc": "keel.tensors",
    "Tensor": "keel.tensors",
    "tensor": "keel.tensors",
    "explain_last_dispatch": "keel.tensors",
    "load_model": "keel.execution.model",
    "set_backend": "keel.execution.model",
    "Model": "keel.execution.model",
    "TensorInfo": "keel.execution.model",
}

__all__ = [
    "BackendSelectionError",
    "DType",
    "ExecutionError",
    "InvalidArgumentError",
    "KeelError",
    "MemoryLimitError",
    "ModelFormatError",
    "UnsupportedOperationError",
    "VerificationError",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers only

    from keel.backends.base import Backend
    from keel.backends.registry import (
        BackendRegistry,
        default_registry,
        register_backend,
        set_backend_priority,
    )
    from keel.execution.model import Model, TensorInfo, load_model, set_backend
    from keel.hardware import detect_devices, probe
    from keel.hardware.profile import DeviceInfo, HardwareProfile
    from keel.ops.registry import Op, OpGroup
    from keel.planning.policy import RuntimePolicy
    from keel.planning.runtime_plan import RuntimePlan, plan_runtime
    from keel.planning.selection import OperationProperties, select_backend
    from keel.runtime import Runtime
    from keel.tensors import Tensor, TensorDesc, explain_last_dispatch, tensor


def _graph_evaluator(backend: str) -> Any:
    """The executor as the graph stage's evaluator (``keel.graph.shape_inference``).

    The graph stage is upstream of execution and never imports it; this root
    module, above every stage, wires the executor in.
    """
    return importlib.import_module("keel.execution.evaluate").default_evaluator(backend)
