"""Temperature readings (``profile.thermal``) and what they say about throttling.

Two sources, each optional: the Linux thermal zones of the CPU
(``/sys/class/thermal/thermal_zoneN``: ``type``, ``temp`` in millidegrees and
the trip points; the limit is the lowest ``passive`` trip point, else ``hot``,
else ``critical``) and NVML for NVIDIA GPUs (temperature, the slowdown
threshold and the current clock-throttle reasons). A source that is absent
gives no reading; the probe never raises for one.

:func:`cpu_throttling` and :func:`hot_gpus` are the rules plans apply: a CPU
zone at or over its limit, or reported throttling, makes keel plan fewer
threads (:func:`throttled_threads`); a GPU within :data:`GPU_HEADROOM_C` of
its slowdown temperature, or throttling for heat, keeps work off that GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

from keel.hardware.profile import HardwareProfile, ThermalReading
from keel.hardware.sources import ProbeSources, to_float

__all__ = ["GPU_HEADROOM_C", "THROTTLED_CORE_SHARE", "cpu_throttling", "hot_gpus",
           "probe_thermal", "throttled_threads"]

#: a GPU this many degrees C (or fewer) below its slowdown temperature is near its limit
GPU_HEADROOM_C = 5.0
#: the share of its usable cores a throttling CPU is planned with (at least one)
THROTTLED_CORE_SHARE = 0.5

_ZONES = "/sys/class/thermal"
_CPU_ZONE_WORDS = ("cpu", "x86_pkg", "soc", "package", "coretemp")
_TRIP_ORDER = ("passive", "hot", "critical")
# NVML clock-throttle reason bits that mean heat (nvmlClocksThrottleReason*)
_THERMAL_BITS = {0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                 0x08: "hardware slowdown"}
_NVML_SLOWDOWN_THRESHOLD = 1      # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN


def probe_thermal(src: ProbeSources) -> tuple[ThermalReading, ...]:
    """Every CPU thermal zone and NVIDIA GPU temperature this machine exposes."""
    return (*_cpu_zones(src), *_nvml_gpus(src))


def _cpu_zones(src: ProbeSources) -> list[ThermalReading]:
    readings = []
    for zone in sorted(src.listdir(_ZONES)):
        if not zone.startswith("thermal_zone"):
            continue
        base = f"{_ZONES}/{zone}"
        kind = (src.read(f"{base}/type") or "").strip()
        milli = to_float((src.read(f"{base}/temp") or "").strip())
        if milli is None or not any(w in kind.lower() for w in _CPU_ZONE_WORDS):
            continue
        limit, trip = _zone_limit(src, base)
        temp = milli / 1000.0
        readings.append(ThermalReading(
            device="cpu", temperature_c=temp, limit_c=limit,
            throttled=limit is not None and temp >= limit, source=base,
            detail=f"zone {kind}" + (f", {trip} trip point {limit:g} C" if trip else "")))
    return readings


def _zone_limit(src: ProbeSources, base: str) -> tuple[float | None, str]:
    trips: dict[str, float] = {}
    for name in src.listdir(base):
        if not (name.startswith("trip_point_") and name.endswith("_type")):
            continue
        kind = (src.read(f"{base}/{name}") or "").strip()
        milli = to_float((src.read(f"{base}/{name[:-5]}_temp") or "").strip())
        if kind in _TRIP_ORDER and milli is not None and milli > 0:
            trips[kind] = min(trips.get(kind, milli), milli)
    for kind in _TRIP_ORDER:
        if kind in trips:
            return trips[kind] / 1000.0, kind
    return None, ""


def _nvml_gpus(src: ProbeSources) -> list[ThermalReading]:
    nvml, _ = src.module("pynvml")
    if nvml is None:
        return []
    try:
        nvml.nvmlInit()
    except Exception:  # no driver: the GPU probe already says so
        return []
    try:
        return [_nvml_gpu(nvml, i) for i in range(int(nvml.nvmlDeviceGetCount()))]
    except Exception:  # a board without a sensor: no reading rather than a failed probe
        return []
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _nvml_gpu(nvml: Any, index: int) -> ThermalReading:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    temp = float(nvml.nvmlDeviceGetTemperature(handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)))
    limit: float | None = None
    with contextlib.suppress(Exception):      # not every board reports its threshold
        limit = float(nvml.nvmlDeviceGetTemperatureThreshold(
            handle, getattr(nvml, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN",
                            _NVML_SLOWDOWN_THRESHOLD)))
    reasons: list[str] = []
    with contextlib.suppress(Exception):      # nor its throttle reasons
        bits = int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
        reasons = [why for bit, why in _THERMAL_BITS.items() if bits & bit]
    detail = ", ".join(reasons) if reasons else ""
    if limit is not None:
        detail = f"slowdown at {limit:g} C" + (f"; {detail}" if detail else "")
    return ThermalReading(device=f"gpu:{index}", temperature_c=temp, limit_c=limit,
                          throttled=bool(reasons), source="nvml", detail=detail)


def cpu_throttling(profile: HardwareProfile) -> str:
    """Why the CPU counts as thermally throttled ("" when it does not, or nothing says)."""
    for r in profile.thermal:
        if r.device != "cpu":
            continue
        if r.throttled or (r.limit_c is not None and r.temperature_c >= r.limit_c):
            limit = "" if r.limit_c is None else f", at or over its limit {r.limit_c:g} C"
            return f"CPU at {r.temperature_c:g} C ({r.detail or r.source}{limit})"
    return ""


def hot_gpus(profile: HardwareProfile) -> dict[int, str]:
    """GPU index -> why it is throttling or within :data:`GPU_HEADROOM_C` of its limit."""
    hot = {}
    for r in profile.thermal:
        kind, _, index = r.device.partition(":")
        if kind != "gpu" or not index.isdigit():
            continue
        if r.throttled:
            hot[int(index)] = f"GPU {index} at {r.temperature_c:g} C is throttling ({r.detail})"
        elif r.limit_c is not None and r.temperature_c >= r.limit_c - GPU_HEADROOM_C:
            hot[int(index)] = (f"GPU {index} at {r.temperature_c:g} C is within "
                               f"{GPU_HEADROOM_C:g} C of its slowdown temperature "
                               f"{r.limit_c:g} C")
    return hot


def throttled_threads(cores: int) -> int:
    """The threads a throttling CPU with ``cores`` usable cores is planned with."""
    return max(1, int(cores * THROTTLED_CORE_SHARE))
