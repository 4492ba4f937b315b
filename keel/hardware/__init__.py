"""The hardware probe: measure the machine into a plain, serialisable HardwareProfile.

``probe()`` reads the CPU (:mod:`.cpu`), memory (:mod:`.memory`), GPUs
(:mod:`.gpu`) and accelerators (:mod:`.accelerators`) through injectable
:class:`~keel.hardware.sources.ProbeSources`. It never raises: a source that
cannot answer leaves its field ``None`` with a ``field: why`` note.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from keel.config import BACKEND_NAMES
from keel.hardware.accelerators import probe_accelerators
from keel.hardware.cpu import probe_cpu
from keel.hardware.gpu import probe_gpus
from keel.hardware.memory import probe_memory
from keel.hardware.profile import (
    AcceleratorInfo,
    CpuInfo,
    DeviceInfo,
    GpuInfo,
    HardwareProfile,
    MemoryInfo,
    ThermalReading,
    WebGpuAdapterInfo,
    unexplained_fields,
)
from keel.hardware.sources import Notes, ProbeSources
from keel.hardware.thermal import probe_thermal
from keel.hardware.webgpu import probe_webgpu

__all__ = [
    "AcceleratorInfo",
    "CpuInfo",
    "DeviceInfo",
    "GpuInfo",
    "HardwareProfile",
    "MemoryInfo",
    "ProbeSources",
    "ThermalReading",
    "WebGpuAdapterInfo",
    "detect_devices",
    "probe",
    "unexplained_fields",
]

R = TypeVar("R")


def probe(sources: ProbeSources | None = None, *, webgpu: bool = False) -> HardwareProfile:
    """Probe the machine (or the machine ``sources`` describe) into a HardwareProfile.

    ``webgpu`` also lists the WebGPU adapters (``keel probe --webgpu``): that starts the
    Vulkan/Metal/DX12 drivers in this process, which costs seconds, so it is asked for.
    """
    src = ProbeSources.real() if sources is None else sources
    start = src.clock()
    notes = Notes()
    cpu = _guarded("cpu", lambda: probe_cpu(src), CpuInfo, notes)
    memory = _guarded("memory", lambda: probe_memory(src), MemoryInfo, notes)
    gpus: tuple[GpuInfo, ...] = ()
    try:
        gpus, gpu_notes = probe_gpus(src, memory.total_bytes)
        notes.extend(gpu_notes)
    except Exception as exc:  # the probe never raises; a crashed source is a note
        notes.add("gpus", f"GPU probe failed ({type(exc).__name__}: {exc})")
    accelerators: tuple[AcceleratorInfo, ...] = ()
    try:
        accelerators = probe_accelerators(src)
    except Exception as exc:  # the probe never raises; a crashed source is a note
        notes.add("accelerators", f"accelerator probe failed ({type(exc).__name__}: {exc})")
    thermal: tuple[ThermalReading, ...] = ()
    try:
        thermal = probe_thermal(src)
    except Exception as exc:  # the probe never raises; a crashed source is a note
        notes.add("thermal", f"thermal probe failed ({type(exc).__name__}: {exc})")
    adapters: tuple[WebGpuAdapterInfo, ...] = ()
    if not webgpu:
        notes.add("webgpu_adapters", "not probed: starting the WebGPU drivers costs seconds "
                                     "(keel probe --webgpu lists the adapters)")
    else:
        try:
            adapters, webgpu_notes = probe_webgpu(src)
            notes.extend(webgpu_notes)
        except Exception as exc:  # the probe never raises; a crashed source is a note
            notes.add("webgpu_adapters", f"WebGPU probe failed ({type(exc).__name__}: {exc})")
    plat = src.platform
    fields = {"platform_system": plat.system, "platform_release": plat.release,
              "python_version": plat.python_version, "hostname": plat.node}
    for name, value in fields.items():
        if not value:
            notes.add(name, "the platform module returned an empty value")
    return HardwareProfile(
        cpu=cpu, memory=memory, gpus=gpus, accelerators=accelerators,
        webgpu_adapters=adapters,
        **{name: value or None for name, value in fields.items()},
        forced_backend=_forced_backend(src, notes),
        probe_seconds=round(src.clock() - start, 6),
        notes=notes.as_tuple(), thermal=thermal,
    )


def detect_devices(sources: ProbeSources | None = None) -> DeviceInfo:
    """Seed 004's flat view of :func:`probe`'s profile."""
    return probe(sources).device_info()


def _guarded(name: str, read: Callable[[], R], record: Callable[..., R], notes: Notes) -> R:
    try:
        return read()
    except Exception as exc:  # the probe never raises; a crashed source is a note
        why = f"{name} probe failed ({type(exc).__name__}: {exc})"
        notes.add(name, why)
        return _failed(record, why)


def _failed(record: Callable[..., R], why: str) -> R:
    """An empty record whose every ``None`` field says why."""
    empty: Any = record()
    nones = [f.name for f in dataclasses.fields(empty) if getattr(empty, f.name) is None]
    result: R = dataclasses.replace(empty, notes=tuple(f"{n}: {why}" for n in nones))
    return result


def _forced_backend(src: ProbeSources, notes: Notes) -> str | None:
    raw = src.env.get("KEEL_BACKEND", "").strip().lower()
    if raw in ("", "auto"):
        notes.add("forced_backend", "KEEL_BACKEND is not set" if not raw
                  else "KEEL_BACKEND=auto pins nothing")
        return None
    if raw not in BACKEND_NAMES:
        notes.add("forced_backend",
                  f"KEEL_BACKEND={raw!r} is not one of {', '.join(BACKEND_NAMES)}")
        return None
    return raw
