"""``NodeArg``, ``ModelMetadata`` and ``OrtValue`` as onnxruntime shows them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument
from keel.ops.types import ValueKind

__all__ = ["ModelMetadata", "NodeArg", "OrtValue", "type_string"]

# onnxruntime's element names where they differ from keel's
_ORT_NAMES = {DType.FLOAT32: "float", DType.FLOAT64: "double"}
# ONNX's "no model_version" (onnxruntime reports INT64_MAX)
_NO_VERSION = 2**63 - 1


def type_string(dtype: DType, kind: ValueKind = ValueKind.TENSOR) -> str:
    """onnxruntime's type name: ``tensor(float)``, ``tensor(int64)``, ``tensor(double)``;
    ``seq(tensor(float))``, ``optional(tensor(float))`` for sequences and optionals."""
    tensor = f"tensor({_ORT_NAMES.get(dtype, dtype.value)})"
    return {ValueKind.TENSOR: tensor, ValueKind.SEQUENCE: f"seq({tensor})",
            ValueKind.OPTIONAL: f"optional({tensor})",
            ValueKind.OPTIONAL_SEQUENCE: f"optional(seq({tensor}))"}[kind]


@dataclass(frozen=True)
class NodeArg:
    """A model input or output: ``name``, ``shape`` (ints, symbolic names as strings, None
    for unknown sizes) and ``type`` (``'tensor(float)'``)."""

    name: str
    shape: list[int | str | None]
    type: str


@dataclass(frozen=True)
class ModelMetadata:
    """The model's metadata, read from its ONNX fields."""

    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = _NO_VERSION
    custom_metadata_map: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_graph(cls, metadata: Mapping[str, str]) -> ModelMetadata:
        """From a keel graph's ``metadata`` (the ONNX importer's ``onnx.*`` entries)."""
        keys = json.loads(metadata.get("onnx.metadata_props", "[]"))
        version = metadata.get("onnx.model_version")
        return cls(
            producer_name=metadata.get("onnx.producer_name", ""),
            graph_name=metadata.get("onnx.graph_name", ""),
            domain=metadata.get("onnx.domain", ""),
            description=metadata.get("onnx.doc_string", ""),
            graph_description=metadata.get("onnx.graph_doc_string", ""),
            version=_NO_VERSION if version is None else int(version),
            custom_metadata_map={k: metadata[k] for k in keys if k in metadata},
        )


def _device(device_type: str, device_id: int) -> str:
    name = str(device_type).lower()
    if name not in ("cpu", "cuda"):
        raise InvalidArgument(f"device_type {device_type!r} is not supported; use 'cpu' or "
                              "'cuda'")
    if device_id != 0:
        raise InvalidArgument(f"device_id {device_id} is not supported; keel uses device 0")
    return name


def _to_device(array: np.ndarray, device: str) -> Any:
    if device == "cpu":
        return array
    from keel.backends.registry import default_registry

    return default_registry().get("gpu").to_device(array)


class OrtValue:
    """A tensor on a device. On ``cpu`` it wraps the NumPy array it was made from (no copy,
    as in onnxruntime); on ``cuda`` it holds a copy on keel's gpu backend."""

    def __init__(self, array: Any, device: str = "cpu") -> None:
        self._array = array
        self._device = device

    @staticmethod
    def ortvalue_from_numpy(numpy_obj: Any, device_type: str = "cpu",
                            device_id: int = 0) -> OrtValue:
        """Wrap ``numpy_obj`` (a NumPy array, C-contiguous)."""
        if not isinstance(numpy_obj, np.ndarray):
            raise InvalidArgument(f"ortvalue_from_numpy takes a NumPy array, got "
                                  f"{type(numpy_obj).__name__}")
        device = _device(device_type, device_id)
        array = numpy_obj if numpy_obj.flags.c_contiguous else np.ascontiguousarray(numpy_obj)
        return OrtValue(_to_device(array, device), device)

    @staticmethod
    def ortvalue_from_shape_and_type(shape: Sequence[int], element_type: Any,
                                     device_type: str = "cpu", device_id: int = 0) -> OrtValue:
        """A zero-filled tensor of ``shape`` and NumPy ``element_type``."""
        device = _device(device_type, device_id)
        array = np.zeros(tuple(int(d) for d in shape), dtype=DType.from_numpy(element_type).numpy)
        return OrtValue(_to_device(array, device), device)

    @property
    def array(self) -> Any:
        """The wrapped array (NumPy on cpu, the gpu backend's on cuda)."""
        return self._array

    def numpy(self) -> np.ndarray:
        """The data as a NumPy array (the wrapped one on cpu, a copy from cuda)."""
        if self._device == "cpu":
            return np.asarray(self._array)
        from keel.backends.registry import default_registry

        return np.asarray(default_registry().get("gpu").read(self._array))

    def host(self) -> np.ndarray:
        """The data as a NumPy array, for feeding a model."""
        return self.numpy()

    def update_inplace(self, np_arr: np.ndarray) -> None:
        """Copy ``np_arr`` (same shape) into this value."""
        if tuple(np.shape(np_arr)) != self.shape_tuple:
            raise InvalidArgument(f"update_inplace: shape {np.shape(np_arr)} differs from "
                                  f"{self.shape_tuple}")
        if self._device == "cpu":
            np.copyto(self._array, np_arr)
        else:
            self._array[...] = _to_device(np.asarray(np_arr, dtype=self._array.dtype), "cuda")

    @property
    def shape_tuple(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self._array.shape)

    def shape(self) -> list[int]:
        return list(self.shape_tuple)

    def dtype(self) -> DType:
        return DType.from_numpy(self._array.dtype)

    def data_type(self) -> str:
        return type_string(self.dtype())

    def element_type(self) -> int:
        """The ONNX element type number (1 for float)."""
        return self.dtype().onnx

    def device_name(self) -> str:
        return self._device

    def is_tensor(self) -> bool:
        return True

    def has_value(self) -> bool:
        return True

    def is_sparse_tensor(self) -> bool:
        return False

    def is_tensor_sequence(self) -> bool:
        return False

    def data_ptr(self) -> int:
        """The address of the first element."""
        if self._device == "cpu":
            return int(self._array.ctypes.data)
        return int(self._array.data.ptr)

    def __repr__(self) -> str:
        return f"<keel.onnxruntime.OrtValue {self.data_type()} {self.shape()} on {self._device}>"


def unwrap(value: Any, name: str) -> Any:
    """A feed as keel's Model takes it: an OrtValue's array (a cuda one stays on the device:
    the model takes device arrays without a copy), anything else as given."""
    if isinstance(value, OrtValue):
        return value.array if value.device_name() == "cuda" else value.host()
    if isinstance(value, (str, bytes)):
        raise Fail(f"input {name!r} must be a NumPy array, got {type(value).__name__}")
    return value
