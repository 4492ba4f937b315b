"""RuntimePlan: what runs where on a machine, with reasons and fallbacks.

``plan_runtime(profile, policy)`` makes four selections:

1. **llama.cpp build** (seed 000): the GPU build when ``prefer_gpu`` holds and a
   GPU has at least ``min_gpu_memory_gb``; the CPU build otherwise. The CPU
   build is always listed as a fallback.
2. **Python runtime** (seed 000): the lightweight runtime when
   ``prefer_lightweight_python_on_low_memory`` holds and total or available
   memory (cgroup aware) is below ``lightweight_memory_threshold_gb``; full
   CPython otherwise, with the lightweight runtime as its fallback.
3. **Accelerator orchestration** (seed 000): an experimental offload entry when
   ``allow_accelerator_experiments`` holds and a TPU/NPU is detected; the
   standard GPU/CPU options stay as fallbacks either way.
4. **keel engine**: the first available of gpu → cpu → reference, each rejected
   candidate with its reason. A pinned engine (``policy.backend`` /
   ``KEEL_BACKEND``) is authoritative: if it is unavailable the plan raises
   :class:`~keel.errors.BackendSelectionError` naming it.

It also classifies the host as an ``edge`` or ``server`` target and records two
constraints of the machine (seed 002):

5. **memory mode**: ``low-memory`` where the Python-runtime rule finds total or
   available memory below ``lightweight_memory_threshold_gb``: weights stay
   memory-mapped from ``.keel`` files, kernels keep no packed copies of weights
   and one arena is reused (see :func:`select_memory_mode`); ``standard``
   otherwise.
6. **threads**: the usable cores, or fewer where the probe reads the CPU
   throttling for heat (:mod:`keel.hardware.thermal`). A GPU near its slowdown
   temperature or throttling is rejected for keel's engine and llama.cpp, with
   the reading as the reason.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keel.config import format_bytes
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.hardware.profile import GIB, GpuInfo, HardwareProfile
from keel.hardware.thermal import cpu_throttling, hot_gpus, throttled_threads
from keel.planning.policy import RuntimePolicy

__all__ = [
    "ENGINE_PRIORITY",
    "RuntimePlan",
    "Selection",
    "engine_availability",
    "gpu_kept_off",
    "is_this_machine",
    "low_memory_mode",
    "low_memory_reason",
    "plan_runtime",
    "with_llama_cpp",
]

#: keel's engines in priority order (auto mode takes the first available)
ENGINE_PRIORITY = ("gpu", "cpu", "reference")

# llama.cpp build flavour per GPU vendor
_LLAMA_BUILDS = {"nvidia": "CUDA", "amd": "ROCm/HIP", "apple": "Metal", "intel": "SYCL/Vulkan"}


@dataclass(frozen=True)
class Selection:
    """One decision of a plan: the choice, why, what stays as fallback, what was rejected."""

    component: str                  # llama.cpp | python_runtime | accelerators | engine |
                                    # memory | threads
    choice: str
    reason: str
    fallbacks: tuple[str, ...] = ()
    detail: str = ""
    rejected: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RuntimePlan:
    """The runtime plan of one machine under one policy. Frozen, serialisable."""

    target: str                     # edge | server
    target_reason: str
    llama_cpp: Selection
    python_runtime: Selection
    accelerators: Selection
    engine: Selection
    memory_mode: Selection
    threads: Selection
    policy: RuntimePolicy
    host: str | None
    reasons: tuple[str, ...]

    @property
    def selections(self) -> tuple[Selection, ...]:
        return (self.llama_cpp, self.python_runtime, self.accelerators, self.engine,
                self.memory_mode, self.threads)

    @property
    def low_memory(self) -> bool:
        """Whether the machine is planned for in low-memory mode."""
        return self.memory_mode.choice == "low-memory"

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_yaml(self) -> str:
        import yaml  # lazily: 1.3 MB a model load never needs

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def explain(self) -> str:
        """A readable multi-line account of every selection."""
        lines = [f"target: {self.target} ({self.target_reason})"]
        for s in self.selections:
            lines.append(f"{s.component}: {s.choice}" + (f" [{s.detail}]" if s.detail else ""))
            lines.append(f"  why: {s.reason}")
            lines.append(f"  fallbacks: {', '.join(s.fallbacks) or 'none'}")
            lines += [f"  rejected {name}: {why}" for name, why in s.rejected]
        return "\n".join(lines)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def plan_runtime(profile: HardwareProfile, policy: RuntimePolicy | None = None,
                 available_backends: Mapping[str, tuple[bool, str]] | None = None,
                 *, local: bool | None = None) -> RuntimePlan:
    """Plan ``profile`` under ``policy`` (default: defaults plus ``KEEL_*`` env).

    ``available_backends`` maps engine name -> ``(available, reason)``; when
    None it is derived from the profile (:func:`engine_availability`), checking
    for CuPy only when the profile describes this machine (``local``, by
    default decided by :func:`is_this_machine`).
    """
    from keel.planning.targets import classify_host  # here: a model load plans no target

    if not isinstance(profile, HardwareProfile):
        raise InvalidArgumentError(
            f"plan_runtime needs a HardwareProfile, got {type(profile).__name__}"
        )
    if policy is not None and not isinstance(policy, RuntimePolicy):
        raise InvalidArgumentError(
            f"plan_runtime needs a RuntimePolicy or None as policy, got {type(policy).__name__}")
    policy = RuntimePolicy.resolve() if policy is None else policy
    if available_backends is None:
        local = is_this_machine(profile) if local is None else local
        available_backends = engine_availability(profile, local=local)
    engine = select_engine(_thermal_checked(_checked(available_backends), profile), policy)
    llama = select_llama_cpp(profile, policy)
    python_runtime = select_python_runtime(profile, policy)
    standard = (llama.choice, *[f for f in llama.fallbacks if f != llama.choice])
    accelerators = select_accelerators(profile, policy, standard)
    target = classify_host(profile, policy)
    memory_mode = select_memory_mode(profile, policy)
    threads = select_threads(profile)
    selections = (llama, python_runtime, accelerators, engine, memory_mode, threads)
    reasons = (f"target: {target.target}: {target.reason}",
               *(f"{s.component}: {s.choice}: {s.reason}" for s in selections))
    return RuntimePlan(
        target=target.target, target_reason=target.reason, llama_cpp=llama,
        python_runtime=python_runtime, accelerators=accelerators, engine=engine,
        memory_mode=memory_mode, threads=threads,
        policy=policy, host=profile.hostname, reasons=reasons,
    )


def with_llama_cpp(plan: RuntimePlan, llama: Selection) -> RuntimePlan:
    """``plan`` with its llama.cpp selection replaced (by the plan made from a GGUF file)."""
    reasons = tuple(f"llama.cpp: {llama.choice}: {llama.reason}" if r.startswith("llama.cpp:")
                    else r for r in plan.reasons)
    return dataclasses.replace(plan, llama_cpp=llama, reasons=reasons)


def is_this_machine(profile: HardwareProfile) -> bool:
    """Whether ``profile`` was probed on this machine (same host name and OS)."""
    return bool(profile.hostname) and profile.hostname == platform.node() \
        and profile.platform_system == platform.system()


# --- engine -------------------------------------------------------------------


def _checked(available: Mapping[str, tuple[bool, str]]) -> dict[str, tuple[bool, str]]:
    out = {}
    for name, entry in available.items():
        if (not isinstance(name, str) or not isinstance(entry, tuple) or len(entry) != 2
                or not isinstance(entry[0], bool) or not isinstance(entry[1], str)):
            raise InvalidArgumentError(
                "available_backends must map a backend name to (available: bool, reason: str); "
                f"got {name!r}: {entry!r}"
            )
        out[name] = entry
    return out


def gpu_kept_off(profile: HardwareProfile | None) -> str:
    """Why keel's GPU engine is kept off ``profile``'s machine for heat: every NVIDIA GPU is
    near its limit or throttling; "" when not (or when no profile says)."""
    if profile is None:
        return ""
    hot = hot_gpus(profile)
    nvidia = [g.index for g in profile.gpus if g.vendor == "nvidia"]
    if nvidia and all(i in hot for i in nvidia):
        return f"kept off the GPU for heat: {hot[nvidia[0]]}"
    return ""


def _thermal_checked(available: dict[str, tuple[bool, str]],
                     profile: HardwareProfile) -> dict[str, tuple[bool, str]]:
    """``available`` with the GPU engine refused while every GPU it could use runs hot."""
    ok, _ = available.get("gpu", (False, ""))
    hot = gpu_kept_off(profile)
    if ok and hot:
        available = {**available, "gpu": (False, hot)}
    return available


def _cupy_installed() -> bool:
    try:
        return importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):   # a broken or half-installed package
        return False


def engine_availability(profile: HardwareProfile,
                        local: bool = True) -> dict[str, tuple[bool, str]]:
    """Which of keel's engines can run on the machine ``profile`` describes, and why."""
    return {
        "gpu": _gpu_engine(profile, local),
        "cpu": (True, "the NumPy CPU engine runs on every machine"),
        "reference": (True, "the reference engine runs on every machine (exact, slow)"),
    }


def _gpu_engine(profile: HardwareProfile, local: bool) -> tuple[bool, str]:
    nvidia = [g for g in profile.gpus if g.vendor == "nvidia"]
    if not nvidia:
        others = sorted({g.vendor for g in profile.gpus})
        extra = f" ({', '.join(others)} GPUs are not supported: keel's GPU engine is CUDA " \
                "through CuPy)" if others else ""
        return False, f"no NVIDIA GPU in the profile{extra}"
    driven = [g for g in nvidia if g.source != "sysfs"]
    if not driven:
        return False, (f"NVIDIA GPU {_gpu_label(nvidia[0])} is visible only on the PCI bus: "
                       "no NVIDIA driver answered (NVML/nvidia-smi)")
    label = _gpu_label(driven[0])
    if not local:
        return True, (f"NVIDIA GPU {label} in the profile; CuPy on that machine is not "
                      "checked (it needs keel-runtime[cuda12])")
    if not _cupy_installed():
        return False, (f"NVIDIA GPU {label} present but CuPy is not installed "
                       "(pip install keel-runtime[cuda12])")
    return True, f"NVIDIA GPU {label} present and CuPy installed"


def _gpu_label(gpu: GpuInfo) -> str:
    return f"{gpu.index} ({gpu.name or 'unnamed'})"


def select_engine(available: Mapping[str, tuple[bool, str]], policy: RuntimePolicy) -> Selection:
    """keel's engine: the pin if any (or raise), else the first available by priority."""
    order = [n for n in ENGINE_PRIORITY if n in available]
    order += [n for n in available if n not in ENGINE_PRIORITY]
    pinned = policy.pinned_backend
    if pinned is not None:
        if pinned not in available:
            raise BackendSelectionError(pinned, "it is not among the known backends "
                                        f"({', '.join(order) or 'none'})")
        ok, why = available[pinned]
        if not ok:
            raise BackendSelectionError(pinned, why)
        return Selection("engine", pinned, f"pinned by policy/KEEL_BACKEND ({why}); "
                         "a pin never falls back", fallbacks=())
    rejected: list[tuple[str, str]] = []
    usable = []
    for name in order:
        ok, why = available[name]
        if name == "gpu" and ok and not policy.prefer_gpu:
            ok, why = False, "policy prefer_gpu is false"
        if ok:
            usable.append((name, why))
        else:
            rejected.append((name, why))
    if not usable:
        raise BackendSelectionError("auto", "no engine is available: " + "; ".join(
            f"{n}: {w}" for n, w in rejected))
    (name, why), rest = usable[0], usable[1:]
    return Selection("engine", name, f"first available in priority {' > '.join(order)}: {why}",
                     fallbacks=tuple(n for n, _ in rest), rejected=tuple(rejected))


# --- the seed's three selections -------------------------------------------------


def select_llama_cpp(profile: HardwareProfile, policy: RuntimePolicy) -> Selection:
    """Seed rule 1: GPU build if a GPU has ``min_gpu_memory_gb``; CPU build always a fallback."""
    threshold = policy.min_gpu_memory_gb
    if not policy.prefer_gpu:
        return Selection("llama.cpp", "cpu", "policy prefer_gpu is false", ("cpu",))
    if not profile.gpus:
        return Selection("llama.cpp", "cpu", "no GPU detected", ("cpu",))
    eligible, rejected = [], []
    hot = hot_gpus(profile)
    for gpu in profile.gpus:
        label = f"{gpu.vendor} GPU {_gpu_label(gpu)}"
        total = gpu.total_memory_bytes
        if gpu.index in hot:
            rejected.append((label, f"kept off for heat: {hot[gpu.index]}"))
        elif total is None:
            rejected.append((label, "its memory size is unknown"))
        elif total < threshold * GIB:
            rejected.append((label, f"{format_bytes(total)} < min_gpu_memory_gb={threshold:g}"))
        else:
            eligible.append(gpu)
    if not eligible:
        why = (f"no GPU has at least min_gpu_memory_gb={threshold:g} GiB" if not hot else
               "no GPU is both cool enough and has at least "
               f"min_gpu_memory_gb={threshold:g} GiB")
        return Selection("llama.cpp", "cpu", why,
                         ("cpu",), rejected=tuple(rejected))
    best = max(eligible, key=lambda g: g.total_memory_bytes or 0)
    build = _LLAMA_BUILDS.get(best.vendor, "GPU")
    return Selection(
        "llama.cpp", "gpu",
        f"GPU {_gpu_label(best)} has {format_bytes(best.total_memory_bytes)} >= "
        f"min_gpu_memory_gb={threshold:g}",
        ("cpu",), detail=f"{build} build on {best.vendor} GPU {best.index}",
        rejected=tuple(rejected),
    )


def _memory_readings(profile: HardwareProfile) -> tuple[tuple[str, int | None], ...]:
    memory = profile.memory
    return (("total", memory.effective_limit_bytes),
            ("available", memory.effective_available_bytes))


def low_memory_reason(profile: HardwareProfile, policy: RuntimePolicy) -> str:
    """Why ``profile`` is a low-memory machine under ``policy`` (total or available memory
    below ``lightweight_memory_threshold_gb``, seed 000's rule), or "" when it is not."""
    threshold = policy.lightweight_memory_threshold_gb
    low = [(label, v) for label, v in _memory_readings(profile)
           if v is not None and v < threshold * GIB]
    if not low:
        return ""
    label, value = low[0]
    return f"{label} memory {format_bytes(value)} < lightweight_memory_threshold_gb={threshold:g}"


def low_memory_mode(profile: HardwareProfile | None, policy: Any = None) -> str:
    """:func:`low_memory_reason` for a plan: ``profile`` None is this machine, whose total
    (cgroup-aware) memory decides, so that its plans do not flip with the momentary load;
    ``policy`` None is the policy from the defaults and ``KEEL_*`` settings."""
    if profile is None:
        from keel.hardware.memory import probe_memory
        from keel.hardware.sources import ProbeSources

        memory = probe_memory(ProbeSources.real())
        profile = HardwareProfile(memory=dataclasses.replace(
            memory, available_bytes=None, effective_available_bytes=None))
    if not isinstance(policy, RuntimePolicy):
        policy = RuntimePolicy.from_env()
    return low_memory_reason(profile, policy)


def select_python_runtime(profile: HardwareProfile, policy: RuntimePolicy) -> Selection:
    """Seed rule 2: lightweight runtime below the memory threshold, full CPython otherwise."""
    threshold = policy.lightweight_memory_threshold_gb
    readings = _memory_readings(profile)
    if not policy.prefer_lightweight_python_on_low_memory:
        return Selection("python_runtime", "cpython",
                         "policy prefer_lightweight_python_on_low_memory is false",
                         ("lightweight",))
    low = low_memory_reason(profile, policy)
    if low:
        return Selection("python_runtime", "lightweight", low)
    known = [f"{label} {format_bytes(v)}" for label, v in readings if v is not None]
    if not known:
        return Selection("python_runtime", "cpython",
                         "memory is unknown, so the low-memory rule cannot apply",
                         ("lightweight",))
    return Selection("python_runtime", "cpython",
                     f"{' and '.join(known)} memory >= "
                     f"lightweight_memory_threshold_gb={threshold:g}", ("lightweight",))


def select_accelerators(profile: HardwareProfile, policy: RuntimePolicy,
                        standard: tuple[str, ...]) -> Selection:
    """Seed rule 3: experimental offload to TPU/NPU when allowed; GPU/CPU stay as fallbacks."""
    if not profile.accelerators:
        return Selection("accelerators", "none", "no TPU/NPU detected", standard)
    found = ", ".join(f"{a.kind} {a.name} ({a.source})" for a in profile.accelerators)
    if not policy.allow_accelerator_experiments:
        return Selection("accelerators", "none",
                         f"policy allow_accelerator_experiments is false (detected: {found})",
                         standard)
    kinds = sorted({a.kind for a in profile.accelerators})
    return Selection("accelerators", "experimental-offload",
                     f"allow_accelerator_experiments and detected {found}", standard,
                     detail=f"experimental offload to {', '.join(kinds)}")


# --- seed 002's constraints: memory and heat ---------------------------------------

LOW_MEMORY_MEASURES = ("weights stay memory-mapped from the .keel file (load a .keel model; an "
                       "ONNX model's weights are read into memory)",
                       "kernels keep no packed copies of the weights (each call packs "
                       "what it needs, then frees it)",
                       "one stream, so the arena is reused rather than duplicated")


def select_memory_mode(profile: HardwareProfile, policy: RuntimePolicy) -> Selection:
    """``low-memory`` below the lightweight threshold (the measures in the detail), else
    ``standard``."""
    low = low_memory_reason(profile, policy)
    if low:
        return Selection("memory", "low-memory", f"{low}: {'; '.join(LOW_MEMORY_MEASURES)}",
                         ("standard",), detail="mapped weights, no packed copies")
    known = [f"{label} {format_bytes(v)}" for label, v in _memory_readings(profile)
             if v is not None]
    if not known:
        return Selection("memory", "standard",
                         "memory is unknown, so the low-memory rule cannot apply")
    return Selection("memory", "standard",
                     f"{' and '.join(known)} memory >= lightweight_memory_threshold_gb="
                     f"{policy.lightweight_memory_threshold_gb:g}: weights may be packed "
                     "for speed")


def select_threads(profile: HardwareProfile) -> Selection:
    """The usable cores, or fewer while the CPU throttles for heat."""
    cpu = profile.cpu
    cores = cpu.usable_cores or cpu.logical_cores
    if cores is None:
        return Selection("threads", "auto", "the core count is unknown: the backend decides")
    hot = cpu_throttling(profile)
    if hot:
        fewer = throttled_threads(cores)
        return Selection("threads", str(fewer),
                         f"{hot}: planned with {fewer} of {cores} usable cores to shed heat",
                         (str(cores),))
    return Selection("threads", str(cores), f"{cores} usable cores; no thermal throttling "
                     "read" + ("" if any(r.device == "cpu" for r in profile.thermal)
                               else " (no CPU temperature sensor)"))
