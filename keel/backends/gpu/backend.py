"""The ``gpu`` backend: CuPy on one CUDA device, sharing the ``cpu`` backend's xp kernels.

CuPy is imported when the backend is first asked whether it is available,
never when keel is imported. Without CuPy, a driver or a device, the backend
reports unavailable with the reason, and pinning it raises
``BackendSelectionError`` before anything is allocated.

Seed 001's GPU profile describes a runtime whose GPU tensors are float32 only
with an element count divisible by 4. Those limits come from that runtime's
hand-written vec4 float shaders; CuPy kernels are dtype-generic and need no
alignment, and real models need int64 indices, booleans and float16 on the
device. So keel's ``gpu`` backend holds every numeric dtype and any size by
default; ``GpuBackend(seed_constraints=True)`` enforces the seed's limits
(rejecting a tensor at allocation, copy-in and before running an op) for
checking code against that stricter profile.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from keel.backends.base import Availability, Backend, DeviceKind, KernelTable
from keel.backends.plan import NodePlan, PlanRequest
from keel.dtypes import DType
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.ops.registry import Op

__all__ = ["INSTALL_HINT", "GpuBackend"]

INSTALL_HINT = "install it with: pip install 'keel-runtime[cuda12]'"


class GpuBackend(Backend):
    """Kernels on one CUDA device through CuPy.

    ``cupy_module`` replaces ``import cupy`` (tests pass a fake namespace to
    run every branch without a GPU).
    """

    name = "gpu"
    device = DeviceKind.GPU
    # CuPy 14 holds ml_dtypes' bfloat16 (the other narrow types stay on the host)
    dtypes = Backend.dtypes | {DType.BFLOAT16}

    def __init__(self, device_index: int = 0, *, seed_constraints: bool = False,
                 cupy_module: Any | None = None) -> None:
        super().__init__()
        if isinstance(device_index, bool) or not isinstance(device_index, int) \
                or device_index < 0:
            raise InvalidArgumentError(
                f"device_index must be a non-negative int, got {device_index!r}")
        self.device_index = device_index
        self.seed_constraints = seed_constraints
        self._module = cupy_module

    # ---- availability ----------------------------------------------------
    def _cupy(self) -> Any:
        if self._module is None:
            self._module = importlib.import_module("cupy")
        return self._module

    def _check_available(self) -> Availability:
        try:
            cp = self._cupy()
        except ImportError as exc:
            return Availability(False, f"CuPy is not installed ({exc}); {INSTALL_HINT}")
        except Exception as exc:
            return Availability(False, f"CuPy failed to import: {type(exc).__name__}: {exc}")
        try:
            count = int(cp.cuda.runtime.getDeviceCount())
        except Exception as exc:
            return Availability(False, f"no usable CUDA driver or device: "
                                       f"{type(exc).__name__}: {exc}")
        if count == 0:
            return Availability(False, "CuPy is installed but no CUDA device is visible")
        if self.device_index >= count:
            return Availability(False, f"CUDA device {self.device_index} requested, "
                                       f"{count} visible")
        return self._smoke_test(cp, count)

    def _smoke_test(self, cp: Any, count: int) -> Availability:
        # A tiny elementwise op and reduction compile kernels through NVRTC:
        # a broken toolkit install shows up here, not in the middle of a model.
        try:
            with cp.cuda.Device(self.device_index):
                x = cp.arange(4, dtype=cp.float32)
                ok = float((x + 1).sum()) == 10.0
        except Exception as exc:
            return Availability(False, f"CUDA device {self.device_index} failed a smoke test: "
                                       f"{type(exc).__name__}: {exc}")
        if not ok:
            return Availability(False, f"CUDA device {self.device_index} computed a wrong "
                                       "result in the smoke test")
        return Availability(True, f"CuPy {getattr(cp, '__version__', '?')}, {count} CUDA "
                                  f"device(s); using device {self.device_index} "
                                  f"({self._device_name(cp)})")

    def _device_name(self, cp: Any) -> str:
        try:
            name = cp.cuda.runtime.getDeviceProperties(self.device_index)["name"]
        except Exception:
            return "name unknown"
        return name.decode() if isinstance(name, bytes) else str(name)

    # ---- hooks -------------------------------------------------------------
    def _kernels(self) -> KernelTable:
        from keel.backends.gpu import kernels

        return kernels.load()

    def _plan_node(self, request: PlanRequest) -> NodePlan:
        from keel.backends.gpu import planner

        return planner.plan(request, self.kernels)

    @property
    def xp(self) -> Any:
        if not self.is_available():
            raise BackendSelectionError(self.name, self.availability().reason)
        return self._cupy()

    def _to_device(self, host: np.ndarray) -> Any:
        return self.xp.asarray(host)

    def _to_host(self, array: Any) -> np.ndarray:
        return np.asarray(self.xp.asnumpy(array))

    def _is_native(self, array: Any) -> bool:
        return isinstance(array, self.xp.ndarray)

    def _validate_tensor(self, shape: tuple[int, ...], dtype: DType) -> None:
        if not self.seed_constraints:
            return
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if dtype is not DType.FLOAT32:
            raise InvalidArgumentError(
                f"gpu (seed 001 GPU profile) holds float32 only, got {dtype.value}")
        if numel % 4:
            raise InvalidArgumentError(
                f"gpu (seed 001 GPU profile) needs an element count divisible by 4, "
                f"got {numel} for shape {shape}")

    def _execution_scope(self, op: Op | None) -> AbstractContextManager[Any]:
        return self._cupy().cuda.Device(self.device_index)

    def _synchronize(self) -> None:
        if self.is_available():
            self._cupy().cuda.Device(self.device_index).synchronize()

    def free_memory(self) -> int | None:
        """Free device memory, counting what CuPy's default pool holds unused."""
        try:
            cp = self._cupy()
            with cp.cuda.Device(self.device_index):
                free = int(cp.cuda.runtime.memGetInfo()[0])
                return free + int(cp.get_default_memory_pool().free_bytes())
        except Exception:
            return None

    def graph_capture(self) -> tuple[Any, str]:
        """A CUDA graph recorder with its own stream and memory pool (see ``capture``)."""
        if not self.is_available():
            return None, self.availability().reason
        from keel.backends.gpu.capture import CudaGraphs

        cp = self._cupy()
        if not hasattr(cp.cuda, "Stream") or not hasattr(cp.cuda.Stream, "begin_capture"):
            return None, f"CuPy {getattr(cp, '__version__', '?')} cannot capture streams"
        try:
            return CudaGraphs(cp, self.device_index), ""
        except Exception as exc:
            return None, f"cannot make a capture stream: {type(exc).__name__}: {exc}"

    def _capability_details(self) -> dict[str, Any]:
        cp = self._cupy()
        props = cp.cuda.runtime.getDeviceProperties(self.device_index)
        notes = [f"device {self.device_index}: {self._device_name(cp)}",
                 f"compute capability {props.get('major', '?')}.{props.get('minor', '?')}"]
        if self.seed_constraints:
            notes.append("seed 001 GPU profile constraints enforced: float32, numel % 4 == 0")
        return {"memory_bytes": int(props.get("totalGlobalMem", 0)) or None,
                "notes": tuple(notes)}
