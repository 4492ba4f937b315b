"""``IOBinding``: inputs and outputs bound ahead of ``run_with_iobinding``.

Inputs are read when the session runs (a bound array or pointer may change in
between, as in onnxruntime). An output bound to an ``OrtValue`` or a buffer is
written in place; an output bound by name only gets a new ``OrtValue`` per run.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from keel.dtypes import DType
from keel.onnxruntime._values import OrtValue
from keel.onnxruntime.capi.onnxruntime_pybind11_state import (
    InvalidArgument,
    RuntimeException,
)

if TYPE_CHECKING:
    from keel.onnxruntime._session import InferenceSession

__all__ = ["IOBinding"]


def _from_pointer(device_type: str, element_type: Any, shape: Sequence[int],
                  buffer_ptr: int) -> np.ndarray:
    """A NumPy view of host memory at ``buffer_ptr`` (no copy)."""
    if str(device_type).lower() != "cpu":
        raise InvalidArgument(f"binding a {device_type!r} pointer is not supported; bind an "
                              "OrtValue made with device_type='cuda' instead")
    dtype = DType.from_numpy(element_type).numpy
    dims = tuple(int(d) for d in shape)
    size = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    buffer = (ctypes.c_char * size).from_address(int(buffer_ptr))
    return np.frombuffer(memoryview(buffer), dtype=dtype).reshape(dims)


class IOBinding:
    """onnxruntime's ``IOBinding`` for one session."""

    def __init__(self, session: InferenceSession) -> None:
        self.session = session
        self._inputs: dict[str, OrtValue] = {}
        self._outputs: dict[str, OrtValue | None] = {}     # None: a new value per run
        self._results: list[OrtValue] = []

    # ---- inputs ----------------------------------------------------------
    def _input_name(self, name: str) -> str:
        if name not in self.session.input_names():
            raise InvalidArgument(f"Failed to find NodeArg with name: {name} in the def list; "
                                  f"the inputs are: {', '.join(self.session.input_names())}")
        return name

    def bind_cpu_input(self, name: str, arr_on_cpu: np.ndarray) -> None:
        """Bind a NumPy array (read when the session runs)."""
        self._inputs[self._input_name(name)] = OrtValue.ortvalue_from_numpy(
            np.asarray(arr_on_cpu))

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any,
                   shape: Sequence[int], buffer_ptr: int) -> None:
        """Bind host memory at ``buffer_ptr`` of ``shape`` and ``element_type``."""
        array = _from_pointer(device_type, element_type, shape, buffer_ptr)
        self._inputs[self._input_name(name)] = OrtValue(array)

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._inputs[self._input_name(name)] = ortvalue

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def synchronize_inputs(self) -> None:
        """Nothing to wait for: inputs are read when the session runs."""

    # ---- outputs ---------------------------------------------------------
    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type: Any = None, shape: Sequence[int] | None = None,
                    buffer_ptr: int | None = None) -> None:
        """Bind an output: to host memory at ``buffer_ptr``, else a new value per run."""
        if buffer_ptr is None:
            self._outputs[name] = None
            return
        if element_type is None or shape is None:
            raise InvalidArgument("bind_output with a buffer_ptr needs element_type and shape")
        self._outputs[name] = OrtValue(_from_pointer(device_type, element_type, shape,
                                                     buffer_ptr))

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        """Write output ``name`` into ``ortvalue`` (same shape and type) on every run."""
        self._outputs[name] = ortvalue

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = []

    def synchronize_outputs(self) -> None:
        """Nothing to wait for: outputs are written when the run returns."""

    def get_outputs(self) -> list[OrtValue]:
        """The outputs of the last run, in the order they were bound."""
        return list(self._results)

    get_outputs_as_ortvaluevector = get_outputs

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        """Host copies of the last run's outputs."""
        return [np.array(v.numpy(), copy=True) for v in self._results]

    # ---- used by InferenceSession.run_with_iobinding ----------------------
    def feeds(self) -> dict[str, OrtValue]:
        return dict(self._inputs)

    def output_names(self) -> list[str]:
        if not self._outputs:
            raise RuntimeException("Error in execution: At least one output should be "
                                   "requested.")
        return list(self._outputs)

    def store(self, results: Sequence[np.ndarray]) -> None:
        """Write a run's ``results`` (in ``output_names`` order) into the bound outputs."""
        stored = []
        for (name, target), result in zip(self._outputs.items(), results, strict=True):
            if target is None:
                stored.append(OrtValue(result))
                continue
            if target.shape_tuple != tuple(result.shape) or target.dtype() is not \
                    DType.from_numpy(result.dtype):
                raise InvalidArgument(
                    f"output {name!r} is {DType.from_numpy(result.dtype).value}"
                    f"{list(result.shape)} but was bound to {target.data_type()}"
                    f"{target.shape()}")
            target.update_inplace(result)
            stored.append(target)
        self._results = stored
