"""Plain, frozen, serialisable descriptions of a machine.

Every field is either a reading or ``None``; a ``None`` is explained by an
entry in the owning record's ``notes`` (``field: why``). Nothing is guessed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from keel.errors import InvalidArgumentError

__all__ = [
    "AcceleratorInfo",
    "CpuInfo",
    "DeviceInfo",
    "GpuInfo",
    "HardwareProfile",
    "MemoryInfo",
    "ThermalReading",
    "unexplained_fields",
]

GIB = 1024**3


@dataclass(frozen=True)
class CpuInfo:
    vendor: str | None = None
    brand: str | None = None
    architecture: str | None = None           # normalised: x86_64, aarch64, arm, ppc64le, ...
    logical_cores: int | None = None
    physical_cores: int | None = None
    usable_cores: int | None = None           # min(affinity mask, cgroup quota), rounded up
    affinity_cores: int | None = None
    cgroup_cpu_quota: float | None = None     # cores allowed by the cgroup quota, if limited
    base_frequency_mhz: float | None = None
    max_frequency_mhz: float | None = None
    simd: tuple[str, ...] = ()                # normalised lower-case feature names
    simd_level: str = "scalar"                # scalar|sse2|sse4.2|avx|avx2|avx512|neon|sve|sve2
    source: str = "none"
    current_frequency_mhz: float | None = None
    simd_source: str = "none"                 # where simd was read: /proc/cpuinfo flags, ...
    # Data caches one core sees, in bytes (the L3 is usually shared by several cores).
    l1d_cache_bytes: int | None = None
    l2_cache_bytes: int | None = None
    l3_cache_bytes: int | None = None
    notes: tuple[str, ...] = ()
    # The CPUs of each NUMA node, as sysfs lists them (``0-55,112-167``), node 0 first;
    # empty where no node is listed (one node, or a platform without the reading).
    numa_nodes: tuple[str, ...] = ()

    def has(self, feature: str) -> bool:
        return feature.lower() in self.simd


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int | None = None
    available_bytes: int | None = None
    cgroup_limit_bytes: int | None = None
    effective_limit_bytes: int | None = None  # min(total, cgroup limit)
    effective_available_bytes: int | None = None
    source: str = "none"
    notes: tuple[str, ...] = ()

    @property
    def total_gib(self) -> float | None:
        return None if self.total_bytes is None else self.total_bytes / GIB

    @property
    def available_gib(self) -> float | None:
        return None if self.available_bytes is None else self.available_bytes / GIB

    @property
    def effective_limit_gib(self) -> float | None:
        lim = self.effective_limit_bytes
        return None if lim is None else lim / GIB

    @property
    def effective_available_gib(self) -> float | None:
        avail = self.effective_available_bytes
        return None if avail is None else avail / GIB


@dataclass(frozen=True)
class GpuInfo:
    index: int
    vendor: str                               # nvidia|amd|intel|apple|unknown
    name: str | None = None
    total_memory_bytes: int | None = None
    free_memory_bytes: int | None = None
    driver: str | None = None
    compute_capability: str | None = None     # "9.0" for NVIDIA; None elsewhere
    pci_bus_id: str | None = None
    # nvml|nvidia-smi|amdsmi|rocm-smi|sysfs|system_profiler
    source: str = "none"
    notes: tuple[str, ...] = ()

    @property
    def total_memory_gib(self) -> float | None:
        tot = self.total_memory_bytes
        return None if tot is None else tot / GIB


@dataclass(frozen=True)
class AcceleratorInfo:
    kind: str                                 # tpu|npu|neuron|habana|...
    name: str
    source: str                               # env:VAR or /dev path
    detail: str | None = None


@dataclass(frozen=True)
class ThermalReading:
    """One temperature sensor: a CPU thermal zone or a GPU, at probe time."""

    device: str                               # "cpu" or "gpu:N"
    temperature_c: float
    limit_c: float | None = None              # where the device starts to slow down
    throttled: bool = False                   # the source says it slows down now
    source: str = "none"                      # nvml | /sys/class/thermal/thermal_zoneN
    detail: str = ""                          # what the limit is, the throttle reasons


@dataclass(frozen=True)
class WebGpuAdapterInfo:
    """One WebGPU adapter as wgpu-native reports it (see :mod:`keel.hardware.webgpu`)."""

    vendor: str = ""
    device: str = ""
    description: str = ""
    backend_type: str = ""                    # Vulkan|Metal|D3D12
    adapter_type: str = ""                    # DiscreteGPU|IntegratedGPU|CPU|Unknown
    shader_f16: bool = False
    limits: dict[str, int] = field(default_factory=dict, hash=False, compare=False)

    @property
    def is_cpu(self) -> bool:
        return self.adapter_type.lower() == "cpu"

    def label(self) -> str:
        name = self.device or self.vendor or "unnamed"
        return f"{name} ({self.backend_type}, {self.adapter_type})"


@dataclass(frozen=True)
class HardwareProfile:
    cpu: CpuInfo = field(default_factory=CpuInfo)
    memory: MemoryInfo = field(default_factory=MemoryInfo)
    gpus: tuple[GpuInfo, ...] = ()
    accelerators: tuple[AcceleratorInfo, ...] = ()
    webgpu_adapters: tuple[WebGpuAdapterInfo, ...] = ()
    platform_system: str | None = None        # Linux|Darwin|Windows
    platform_release: str | None = None
    python_version: str | None = None
    hostname: str | None = None
    forced_backend: str | None = None         # KEEL_BACKEND at probe time
    probe_seconds: float | None = None
    notes: tuple[str, ...] = ()               # sources that failed, with why
    thermal: tuple[ThermalReading, ...] = ()  # temperature sensors (a reading or absent)

    # --- derived views -------------------------------------------------
    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def has_tpu(self) -> bool:
        return any(a.kind == "tpu" for a in self.accelerators)

    @property
    def has_npu(self) -> bool:
        return any(a.kind != "tpu" for a in self.accelerators)

    def device_info(self) -> DeviceInfo:
        """Seed 004's flat view of this profile."""
        return DeviceInfo(
            cpu_cores=self.cpu.usable_cores or self.cpu.logical_cores or 0,
            memory_limit_bytes=self.memory.effective_limit_bytes,
            has_avx2=self.cpu.has("avx2"),
            has_avx512=self.cpu.has("avx512f"),
            has_neon=self.cpu.has("neon") or self.cpu.has("asimd"),
            gpu_count=len(self.gpus),
            gpu_names=[g.name or "unknown" for g in self.gpus],
            gpu_memory_bytes=[g.total_memory_bytes or 0 for g in self.gpus],
            platform_system=self.platform_system or "unknown",
            forced_backend=self.forced_backend,
        )

    # --- serialisation -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_yaml(self) -> str:
        import yaml  # lazily: 1.3 MB a model load never needs

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any) -> HardwareProfile:
        if not isinstance(data, dict):
            raise InvalidArgumentError(
                f"a hardware profile must be a mapping, got {type(data).__name__}"
            )
        return _from_plain(cls, data, "profile")

    @classmethod
    def from_json(cls, text: str) -> HardwareProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"hardware profile is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_yaml(cls, text: str) -> HardwareProfile:
        import yaml  # lazily: 1.3 MB a model load never needs

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InvalidArgumentError(f"hardware profile is not valid YAML: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str) -> HardwareProfile:
        """Read a profile saved by ``keel probe --json`` or ``--yaml``."""
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError, TypeError) as exc:
            raise InvalidArgumentError(f"cannot read hardware profile {path!r}: {exc}") from None
        return cls.from_yaml(text)  # YAML is a superset of JSON


@dataclass(frozen=True)
class DeviceInfo:
    """System device capabilities, flat (seed 004's view)."""

    cpu_cores: int
    memory_limit_bytes: int | None
    has_avx2: bool
    has_avx512: bool
    has_neon: bool
    gpu_count: int
    gpu_names: list[str]
    gpu_memory_bytes: list[int]
    platform_system: str
    forced_backend: str | None


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [_to_plain(v) for v in obj]
    return obj


_NESTED: dict[str, type] = {
    "cpu": CpuInfo, "memory": MemoryInfo, "gpus": GpuInfo, "accelerators": AcceleratorInfo,
    "thermal": ThermalReading,
    "webgpu_adapters": WebGpuAdapterInfo,
}


def _from_plain(cls: type, data: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise InvalidArgumentError(
            f"unknown key {unknown[0]!r} in {where}; allowed: {', '.join(known)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        sub = _NESTED.get(name) if cls is HardwareProfile else None
        if sub is not None and name in ("gpus", "accelerators", "thermal", "webgpu_adapters"):
            if not isinstance(value, list):
                raise InvalidArgumentError(f"{where}.{name} must be a list")
            kwargs[name] = tuple(
                _from_plain(sub, _mapping(v, f"{where}.{name}[{i}]"), f"{where}.{name}[{i}]")
                for i, v in enumerate(value)
            )
        elif sub is not None:
            kwargs[name] = _from_plain(sub, _mapping(value, f"{where}.{name}"), f"{where}.{name}")
        elif isinstance(value, list):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise InvalidArgumentError(f"invalid {where}: {exc}") from None


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def unexplained_fields(profile: HardwareProfile) -> list[str]:
    """Dotted names of ``None`` fields that carry no ``field: why`` note.

    A complete probe returns an empty list: every field is a reading or says
    why it is not.
    """
    records: list[tuple[str, Any, tuple[str, ...]]] = [
        ("", profile, profile.notes),
        ("cpu.", profile.cpu, profile.cpu.notes),
        ("memory.", profile.memory, profile.memory.notes),
    ]
    records += [(f"gpus[{i}].", g, g.notes) for i, g in enumerate(profile.gpus)]
    missing = []
    for prefix, record, notes in records:
        for f in dataclasses.fields(record):
            value = getattr(record, f.name)
            if value is None and not any(n.startswith(f"{f.name}:") for n in notes):
                missing.append(prefix + f.name)
    missing += [
        f"accelerators[{i}].detail" for i, a in enumerate(profile.accelerators) if a.detail is None
    ]
    return missing
