"""The ``webgpu`` backend: WGSL compute shaders on any GPU wgpu reaches.

wgpu-native runs on Vulkan (Linux, Android, Windows), Metal (macOS, iOS) and
DX12 (Windows); with Mesa's ``llvmpipe`` it runs on the CPU, which is how it is
tested without a GPU. ``wgpu`` is imported when the backend is first asked
whether it is available, never when keel is imported. Without it, or without an
adapter, the backend reports unavailable with the reason.

Arrays are :class:`~keel.backends.webgpu.array.WgpuArray` views of storage
buffers. The executor's arena is one buffer allocated at load; constants are
uploaded once; every kernel records into one open compute pass that is
submitted when a result is read (see :mod:`keel.backends.webgpu.device`).

The backend computes in float32 (and float16 on adapters with ``shader-f16``);
it holds integer and boolean tensors (indices, shapes) for the ops that move
them. ``WebGpuBackend(seed_constraints=True)`` enforces seed 001's GPU profile
(float32 only, element counts divisible by 4), as the ``gpu`` backend does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from keel.backends.base import Availability, Backend, DeviceKind, KernelTable
from keel.backends.plan import NodePlan, PlanRequest
from keel.dtypes import DType
from keel.errors import BackendSelectionError, InvalidArgumentError

__all__ = ["INSTALL_HINT", "WebGpuBackend"]

INSTALL_HINT = ("install it with: pip install 'keel-runtime[webgpu]' (and, without a GPU, "
                "Mesa's Vulkan drivers: apt-get install mesa-vulkan-drivers)")

# What the backend holds: float32 (float16 where the adapter has shader-f16) to compute
# in, and the integer/boolean dtypes of indices and shapes that its copies move.
_HELD = frozenset({DType.FLOAT32, DType.FLOAT16, DType.INT64, DType.INT32, DType.BOOL,
                   DType.UINT8, DType.INT8})

# Why the dtypes a model may hold beyond those are refused (placement and to_device say it).
_F64 = ("WGSL has no 64-bit float (shader-f64 is a wgpu-native extension outside WebGPU); "
        "run the model on cpu, or convert it to float32")
_NARROW_INT = ("WGSL's integers are 32-bit: its 16-bit and unsigned 32/64-bit integers have "
               "no kernels here; run those nodes on cpu")
_NOTES = {DType.FLOAT64: _F64, DType.INT16: _NARROW_INT, DType.UINT16: _NARROW_INT,
          DType.UINT32: _NARROW_INT, DType.UINT64: _NARROW_INT}


class WebGpuBackend(Backend):
    """WGSL kernels on one WebGPU adapter through ``wgpu``.

    ``power_preference`` picks among adapters ("high-performance" or
    "low-power"); ``wgpu_module`` replaces ``import wgpu`` (tests).
    """

    name = "webgpu"
    device = DeviceKind.GPU
    dtypes = _HELD
    dtype_notes = _NOTES

    def __init__(self, *, seed_constraints: bool = False,
                 power_preference: str = "high-performance",
                 wgpu_module: Any | None = None) -> None:
        super().__init__()
        if power_preference not in ("high-performance", "low-power"):
            raise InvalidArgumentError(
                f"power_preference must be 'high-performance' or 'low-power', "
                f"got {power_preference!r}")
        self.seed_constraints = seed_constraints
        self.power_preference = power_preference
        self._module = wgpu_module
        self._device: Any = None
        self._xp: Any = None

    # ---- availability ----------------------------------------------------------
    def _check_available(self) -> Availability:
        from keel.backends.webgpu.device import Device, load_wgpu

        try:
            wgpu = self._module if self._module is not None else load_wgpu()
        except ImportError as exc:
            return Availability(False, f"wgpu is not installed ({exc}); {INSTALL_HINT}")
        except Exception as exc:
            return Availability(False, f"wgpu failed to import: {type(exc).__name__}: {exc}")
        try:
            adapter = wgpu.gpu.request_adapter_sync(power_preference=self.power_preference)
        except Exception as exc:
            return Availability(False, f"no WebGPU adapter: {type(exc).__name__}: {exc}; "
                                       f"{INSTALL_HINT}")
        if adapter is None:
            return Availability(False, f"wgpu found no WebGPU adapter; {INSTALL_HINT}")
        try:
            self._device = Device(wgpu, adapter)
        except Exception as exc:
            return Availability(False, f"the WebGPU adapter refused a device: "
                                       f"{type(exc).__name__}: {exc}")
        return self._smoke_test()

    def _smoke_test(self) -> Availability:
        from keel.backends.webgpu.array import Namespace
        from keel.backends.webgpu.elementwise import binary

        info = self._device.info
        try:
            xp = Namespace(self._device)
            x = xp.asarray(np.arange(4, dtype=np.float32))
            ok = np.array_equal(binary("add", x, x).to_host(), np.arange(4) * 2.0)
        except Exception as exc:
            return Availability(False, f"WebGPU adapter {info.label()} failed a smoke test: "
                                       f"{type(exc).__name__}: {exc}")
        if not ok:
            return Availability(False, f"WebGPU adapter {info.label()} computed a wrong "
                                       "result in the smoke test")
        self._xp = xp
        return Availability(True, f"wgpu {getattr(self._device.wgpu, '__version__', '?')}, "
                                  f"adapter {info.label()}"
                                  + (", shader-f16" if info.shader_f16 else ""))

    @property
    def adapter(self) -> Any:
        """The adapter's :class:`~keel.backends.webgpu.device.AdapterInfo` (None: none)."""
        return None if not self.is_available() else self._device.info

    # ---- hooks ----------------------------------------------------------------------
    def _kernels(self) -> KernelTable:
        from keel.backends.webgpu import kernels

        return kernels.load()

    def _plan_node(self, request: PlanRequest) -> NodePlan:
        from keel.backends.webgpu import planner

        return planner.plan(request, self.kernels)

    @property
    def xp(self) -> Any:
        if not self.is_available():
            raise BackendSelectionError(self.name, self.availability().reason)
        return self._xp

    def _to_device(self, host: np.ndarray) -> Any:
        return self.xp.asarray(host)

    def _to_host(self, array: Any) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array.copy()
        return array.to_host()

    def _is_native(self, array: Any) -> bool:
        from keel.backends.webgpu.array import WgpuArray

        return isinstance(array, WgpuArray)

    def _validate_tensor(self, shape: tuple[int, ...], dtype: DType) -> None:
        if dtype is DType.FLOAT16 and self.is_available() and not self._device.info.shader_f16:
            raise InvalidArgumentError(
                f"webgpu: adapter {self._device.info.label()} has no shader-f16; "
                "float16 tensors need it")
        if not self.seed_constraints:
            return
        numel = math.prod(shape)
        if dtype is not DType.FLOAT32:
            raise InvalidArgumentError(
                f"webgpu (seed 001 GPU profile) holds float32 only, got {dtype.value}")
        if numel % 4:
            raise InvalidArgumentError(
                f"webgpu (seed 001 GPU profile) needs an element count divisible by 4, "
                f"got {numel} for shape {shape}")

    def _synchronize(self) -> None:
        if self._device is not None:
            self._device.flush()

    def _capability_details(self) -> dict[str, Any]:
        info = self._device.info
        notes = [f"adapter: {info.label()}", f"vendor: {info.vendor or 'unknown'}",
                 f"shader-f16: {'yes' if info.shader_f16 else 'no'}"]
        if info.is_cpu:
            notes.append("a CPU adapter (software rasterizer): correct, never faster than "
                         "the cpu backend; auto placement does not choose it")
        if self.seed_constraints:
            notes.append("seed 001 GPU profile constraints enforced: float32, numel % 4 == 0")
        size = info.limits.get("max-buffer-size")
        if size:
            notes.append(f"largest buffer: {size} bytes (WebGPU does not report device memory)")
        return {"memory_bytes": None, "notes": tuple(notes)}

    def auto_blocked(self, props: Any, measured: Callable[[], Any] | None = None
                     ) -> str | None:
        from keel.backends.webgpu import planner

        adapter = self.adapter
        if adapter is None or adapter.is_cpu or measured is None:
            return planner.auto_blocked(adapter, None, props.nbytes)
        found = measured()
        return planner.auto_blocked(adapter, None if found is None else planner.Measured(*found),
                                    props.nbytes)

    def _plan_notes(self) -> tuple[str, ...]:
        if not self.is_available():
            return ()
        return (f"webgpu runs on adapter {self._device.info.label()}",)
