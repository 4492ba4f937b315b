"""TelemetrySnapshot: one reading of GPU load and free memory, taken when planning.

Planning happens before execution and at chunk boundaries; it reads a
snapshot, never a background poller. With NVML (``pynvml`` from the
``nvidia-ml-py`` package, imported lazily) a snapshot carries per-GPU
utilisation, temperature and free memory. Without it, the snapshot falls back
to static heuristics: GPU presence and free memory as the hardware probe saw
them, utilisation unknown. ``source`` says which one answered and ``notes`` why.

The snapshot satisfies the planner's ``MemoryTelemetry`` protocol:
``available_bytes("cpu")`` is the host memory effectively available (cgroup
aware); ``available_bytes("gpu")`` / ``("gpu:1")`` the free memory of that GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

from keel.hardware.memory import probe_memory
from keel.hardware.profile import HardwareProfile
from keel.hardware.sources import Notes, ProbeSources

__all__ = ["SATURATION_PERCENT", "GpuTelemetry", "TelemetrySnapshot", "take_snapshot"]

#: utilisation at or above which a GPU counts as saturated
SATURATION_PERCENT = 90.0


@dataclass(frozen=True)
class GpuTelemetry:
    """One GPU at snapshot time; ``None`` where the source cannot tell."""

    index: int
    name: str | None
    utilization_percent: float | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    temperature_c: float | None = None


@dataclass(frozen=True)
class TelemetrySnapshot:
    """GPU availability plus optional saturation and memory signals, at one moment."""

    source: str                          # "nvml" | "static"
    gpu_available: bool
    gpus: tuple[GpuTelemetry, ...]
    host_available_bytes: int | None
    notes: tuple[str, ...] = ()

    def gpu(self, index: int = 0) -> GpuTelemetry | None:
        return next((g for g in self.gpus if g.index == index), None)

    def is_saturated(self, index: int = 0, threshold: float = SATURATION_PERCENT) -> bool | None:
        """Whether GPU ``index`` is at least ``threshold`` % busy; None when unknown."""
        gpu = self.gpu(index)
        if gpu is None or gpu.utilization_percent is None:
            return None
        return gpu.utilization_percent >= threshold

    def available_bytes(self, device: str) -> int | None:
        """Free memory on ``device`` (``cpu``, ``gpu``, ``gpu:N``); None when unknown."""
        name, _, index = device.partition(":")
        if name == "cpu":
            return self.host_available_bytes
        if name in ("gpu", "cuda"):
            gpu = self.gpu(int(index) if index.isdigit() else 0)
            return None if gpu is None else gpu.memory_free_bytes
        return None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["gpus"] = [dict(g) for g in data["gpus"]]
        data["notes"] = list(self.notes)
        return data


def take_snapshot(profile: HardwareProfile | None = None,
                  sources: ProbeSources | None = None,
                  probe_gpus: bool = True) -> TelemetrySnapshot:
    """Read telemetry once: NVML when importable and working, static heuristics otherwise.

    ``profile`` feeds the static fallback (probed from ``sources`` when None,
    unless ``probe_gpus`` is false: then the static snapshot lists no GPU and
    says so, for callers that have no GPU backend to plan for).
    Never raises for a missing or failing telemetry source.
    """
    src = ProbeSources.real() if sources is None else sources
    notes = Notes()
    host = _host_available(src, notes)
    nvml, why = src.module("pynvml")
    if nvml is not None:
        gpus, failure = _nvml_gpus(nvml)
        if failure is None:
            return TelemetrySnapshot("nvml", bool(gpus), gpus, host, notes.as_tuple())
        why = failure
    notes.items.append(f"source: static heuristics, because NVML is unavailable: {why}")
    if profile is None and not probe_gpus:
        notes.items.append("gpus: not probed (no GPU backend to plan for)")
        profile = HardwareProfile()
    if profile is None:
        from keel.hardware import probe  # downstream of hardware: imported when needed

        profile = probe(src)
    return _static(profile, host, notes)


def _host_available(src: ProbeSources, notes: Notes) -> int | None:
    try:
        memory = probe_memory(src)
    except Exception as exc:  # telemetry never raises
        notes.items.append(f"host_available_bytes: memory probe failed ({exc})")
        return None
    if memory.effective_available_bytes is None:
        notes.items.append("host_available_bytes: available memory is unknown")
    return memory.effective_available_bytes


def _nvml_gpus(nvml: Any) -> tuple[tuple[GpuTelemetry, ...], str | None]:
    try:
        nvml.nvmlInit()
    except Exception as exc:  # no driver, no library
        return (), f"nvmlInit failed ({exc})"
    try:
        gpus = tuple(_nvml_gpu(nvml, i) for i in range(int(nvml.nvmlDeviceGetCount())))
    except Exception as exc:  # any NVML error mid-query
        return (), f"NVML query failed ({exc})"
    finally:
        with contextlib.suppress(Exception):  # a failed shutdown changes nothing we report
            nvml.nvmlShutdown()
    return gpus, None


def _nvml_gpu(nvml: Any, index: int) -> GpuTelemetry:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = nvml.nvmlDeviceGetName(handle)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    util = nvml.nvmlDeviceGetUtilizationRates(handle)
    try:
        temp: float | None = float(
            nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    except Exception:  # some boards expose no sensor; temperature stays unknown
        temp = None
    return GpuTelemetry(
        index=index, name=name.decode() if isinstance(name, bytes) else str(name),
        utilization_percent=float(util.gpu), memory_total_bytes=int(mem.total),
        memory_free_bytes=int(mem.free), temperature_c=temp,
    )


def _static(profile: HardwareProfile, host: int | None, notes: Notes) -> TelemetrySnapshot:
    gpus = tuple(
        GpuTelemetry(index=g.index, name=g.name, utilization_percent=None,
                     memory_total_bytes=g.total_memory_bytes,
                     memory_free_bytes=g.free_memory_bytes)
        for g in profile.gpus
    )
    if gpus:
        notes.items.append("gpus: utilisation unknown without NVML; free memory as probed")
    if host is None:
        host = profile.memory.effective_available_bytes
    return TelemetrySnapshot("static", bool(gpus), gpus, host, notes.as_tuple())
