"""WebGPU probe: the adapters wgpu-native finds (Vulkan, Metal, DX12), or why none.

Read through ``ProbeSources.module("wgpu")`` (the optional ``webgpu`` extra).
Each adapter is recorded with its vendor, device, backend type, adapter type
(DiscreteGPU, IntegratedGPU, CPU), the limits that bound keel's kernels and
whether it has ``shader-f16``. OpenGL adapters are left out: wgpu's GL backend
has no compute shaders keel can rely on. Enumerating adapters starts the
drivers, so the answer is kept for the process (per wgpu module).
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any

from keel._fork import renew_after_fork
from keel.hardware.profile import WebGpuAdapterInfo
from keel.hardware.sources import ProbeSources

__all__ = ["adapter_info", "describe_adapters", "load_wgpu", "probe_webgpu"]

_CACHE: dict[int, tuple[WebGpuAdapterInfo, ...]] = {}
_LOCK = threading.Lock()
renew_after_fork(sys.modules[__name__], "_LOCK")   # free in a forked child


def probe_webgpu(src: ProbeSources) -> tuple[tuple[WebGpuAdapterInfo, ...], list[str]]:
    """(the WebGPU adapters, notes saying why there are none)."""
    wgpu, why = src.module("wgpu")
    if wgpu is None:
        return (), [f"webgpu_adapters: {why or 'wgpu is not installed'} "
                    "(pip install 'keel-runtime[webgpu]')"]
    with _LOCK:
        found = _CACHE.get(id(wgpu))
        if found is None:
            found = _CACHE[id(wgpu)] = _adapters(wgpu)
    if not found:
        return (), ["webgpu_adapters: wgpu found no Vulkan, Metal or DX12 adapter (without a "
                    "GPU, Mesa's mesa-vulkan-drivers give the llvmpipe CPU adapter)"]
    return found, []


def _adapters(wgpu: Any) -> tuple[WebGpuAdapterInfo, ...]:
    return tuple(describe_adapters(wgpu))


def load_wgpu() -> Any:
    """The ``wgpu`` module (ImportError when it is not installed)."""
    return importlib.import_module("wgpu")


# Limits worth recording: what bounds the kernels' buffers and workgroups.
_LIMIT_NAMES = ("max-buffer-size", "max-storage-buffer-binding-size",
                "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup",
                "max-compute-workgroups-per-dimension", "max-storage-buffers-per-shader-stage")


def adapter_info(adapter: Any) -> WebGpuAdapterInfo:
    """One wgpu adapter as plain data."""
    info = dict(adapter.info)
    limits = dict(adapter.limits)
    return WebGpuAdapterInfo(
        vendor=str(info.get("vendor", "")), device=str(info.get("device", "")),
        description=str(info.get("description", "")),
        backend_type=str(info.get("backend_type", "")),
        adapter_type=str(info.get("adapter_type", "")),
        shader_f16="shader-f16" in adapter.features,
        limits={k: int(limits[k]) for k in _LIMIT_NAMES if k in limits})


def describe_adapters(wgpu: Any | None = None) -> list[WebGpuAdapterInfo]:
    """Every adapter wgpu-native finds here (compute-capable backends only: no OpenGL)."""
    mod = load_wgpu() if wgpu is None else wgpu
    found = [adapter_info(a) for a in mod.gpu.enumerate_adapters_sync()]
    return [a for a in found if a.backend_type.lower() != "opengl"]
