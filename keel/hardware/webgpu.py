"""WebGPU probe: the adapters wgpu-native finds (Vulkan, Metal, DX12), or why none.

Read through ``ProbeSources.module("wgpu")`` (the optional ``webgpu`` extra).
Each adapter is recorded with its vendor, device, backend type, adapter type
(DiscreteGPU, IntegratedGPU, CPU), the limits that bound keel's kernels and
whether it has ``shader-f16``. OpenGL adapters are left out: wgpu's GL backend
has no compute shaders keel can rely on. Enumerating adapters starts the
drivers, so the answer is kept for the process (per wgpu module).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from keel._fork import renew_after_fork
from keel.hardware.profile import WebGpuAdapterInfo
from keel.hardware.sources import ProbeSources

__all__ = ["probe_webgpu"]

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
    from keel.backends.webgpu.device import describe_adapters

    return tuple(WebGpuAdapterInfo(vendor=a.vendor, device=a.device, description=a.description,
                                   backend_type=a.backend_type, adapter_type=a.adapter_type,
                                   shader_f16=a.shader_f16, limits=dict(a.limits))
                 for a in describe_adapters(wgpu))
