"""onnxruntime's Python API on keel: ``import keel.onnxruntime as ort``.

A script written for onnxruntime runs on keel after changing its import line::

    import keel.onnxruntime as ort

    sess = ort.InferenceSession("model.onnx", providers=["CUDAExecutionProvider",
                                                         "CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    (probs,) = sess.run(None, {name: x})

``CUDAExecutionProvider`` maps to keel's ``gpu`` backend, ``CPUExecutionProvider``
to its ``cpu`` backend; ``SessionOptions`` map to ``load_model``'s arguments;
errors carry onnxruntime's names (``ort.capi.onnxruntime_pybind11_state.*``) and
are keel's typed errors. Importing this module imports neither onnxruntime nor
any optional package. See docs/onnxruntime.md.
"""

from __future__ import annotations

from keel import __version__ as _keel_version
from keel.onnxruntime import capi
from keel.onnxruntime._binding import IOBinding
from keel.onnxruntime._options import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    OptionNotHonoredWarning,
    RunOptions,
    SessionOptions,
)
from keel.onnxruntime._providers import ALL_PROVIDERS, ProviderWarning, available_providers
from keel.onnxruntime._session import InferenceSession
from keel.onnxruntime._values import ModelMetadata, NodeArg, OrtValue

__version__ = _keel_version
version = _keel_version
package_name = "keel"

SessionIOBinding = IOBinding

__all__ = [
    "ExecutionMode",
    "ExecutionOrder",
    "GraphOptimizationLevel",
    "IOBinding",
    "InferenceSession",
    "ModelMetadata",
    "NodeArg",
    "OptionNotHonoredWarning",
    "OrtValue",
    "ProviderWarning",
    "RunOptions",
    "SessionIOBinding",
    "SessionOptions",
    "__version__",
    "capi",
    "get_all_providers",
    "get_available_providers",
    "get_build_info",
    "get_device",
    "get_version_string",
]


def get_available_providers() -> list[str]:
    """The providers keel can run here: ``CUDAExecutionProvider`` when keel's gpu backend
    can run, and ``CPUExecutionProvider``."""
    return available_providers()


def get_all_providers() -> list[str]:
    """Every provider name onnxruntime knows (keel runs CUDA and CPU)."""
    return list(ALL_PROVIDERS)


def get_device() -> str:
    """``"GPU"`` when keel's gpu backend can run here, else ``"CPU"``."""
    return "GPU" if "CUDAExecutionProvider" in available_providers() else "CPU"


def get_version_string() -> str:
    return __version__


def get_build_info() -> str:
    return f"keel {__version__} (onnxruntime API)"
