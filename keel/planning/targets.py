"""Target profiles (``edge``, ``server``) and the classification of a host into one.

The profiles, their flags and feature gates are those of the design (seed 000):

========  =============================================  ===========================
profile   flags                                          feature gates
========  =============================================  ===========================
edge      ``-C opt-level=z -C lto=fat -C codegen-units=1``  ``low-power``, ``quantized-kernels``
server    ``-C opt-level=3 -C lto=thin``                 ``throughput``, ``gpu-offload``
========  =============================================  ===========================

A host is a ``server`` when it has a GPU with dedicated memory of at least
``policy.min_gpu_memory_gb``, or a TPU/NPU, or both at least
:data:`SERVER_MIN_MEMORY_GIB` of usable memory and :data:`SERVER_MIN_CORES`
usable cores; otherwise it is an ``edge`` host. The classification says which
rule decided.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from keel.config import format_bytes
from keel.errors import InvalidArgumentError
from keel.hardware.profile import GIB, HardwareProfile
from keel.planning.policy import RuntimePolicy

__all__ = [
    "SERVER_MIN_CORES",
    "SERVER_MIN_MEMORY_GIB",
    "TARGETS",
    "TargetClassification",
    "TargetProfile",
    "classify_host",
    "get_target",
]

#: usable memory (GiB) a GPU-less, accelerator-less host needs to count as a server
SERVER_MIN_MEMORY_GIB = 32.0
#: usable cores a GPU-less, accelerator-less host needs to count as a server
SERVER_MIN_CORES = 16


@dataclass(frozen=True)
class TargetProfile:
    """A deployment target: what it is for, its build flags and feature gates."""

    name: str
    description: str
    primary_backends: tuple[str, ...]
    flags: tuple[str, ...]
    feature_gates: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}


TARGETS: dict[str, TargetProfile] = {
    "edge": TargetProfile(
        name="edge",
        description="Thermally constrained systems such as Jetson-class boards or small "
                    "form-factor PCs.",
        primary_backends=("llama.cpp CPU", "lightweight Python runtime"),
        flags=("-C opt-level=z", "-C lto=fat", "-C codegen-units=1"),
        feature_gates=("low-power", "quantized-kernels"),
    ),
    "server": TargetProfile(
        name="server",
        description="High-throughput servers with ample memory, GPUs, or custom accelerators.",
        primary_backends=("llama.cpp GPU (when policy allows)", "full CPython runtime"),
        flags=("-C opt-level=3", "-C lto=thin"),
        feature_gates=("throughput", "gpu-offload"),
    ),
}


def get_target(name: str) -> TargetProfile:
    """The target profile called ``name`` (``edge`` or ``server``)."""
    target = TARGETS.get(name.strip().lower()) if isinstance(name, str) else None
    if target is None:
        raise InvalidArgumentError(
            f"unknown target profile {name!r}; allowed: {', '.join(TARGETS)}"
        )
    return target


@dataclass(frozen=True)
class TargetClassification:
    """Which target a host is, and the rule that decided it."""

    target: str
    reason: str


def classify_host(profile: HardwareProfile,
                  policy: RuntimePolicy | None = None) -> TargetClassification:
    """Classify ``profile`` as an ``edge`` or ``server`` host, with the reason."""
    policy = RuntimePolicy() if policy is None else policy
    threshold = policy.min_gpu_memory_gb
    for gpu in profile.gpus:
        total = gpu.total_memory_bytes
        if gpu.vendor != "apple" and total is not None and total >= threshold * GIB:
            return TargetClassification("server", (
                f"GPU {gpu.index} ({gpu.name or gpu.vendor}) has {format_bytes(total)} of "
                f"dedicated memory, at least min_gpu_memory_gb={threshold:g}"
            ))
    if profile.accelerators:
        kinds = sorted({a.kind for a in profile.accelerators})
        return TargetClassification("server", f"custom accelerator present ({', '.join(kinds)})")
    memory = profile.memory.effective_limit_bytes
    cores = profile.cpu.usable_cores
    if memory is None or cores is None:
        missing = "memory" if memory is None else "usable core count"
        return TargetClassification("edge", f"no large GPU or accelerator, and the {missing} "
                                            "is unknown, so the server floor cannot be shown")
    if memory >= SERVER_MIN_MEMORY_GIB * GIB and cores >= SERVER_MIN_CORES:
        return TargetClassification("server", (
            f"{format_bytes(memory)} usable memory and {cores} usable cores meet the server "
            f"floor ({SERVER_MIN_MEMORY_GIB:g} GiB, {SERVER_MIN_CORES} cores)"
        ))
    return TargetClassification("edge", (
        f"no GPU with dedicated memory >= {threshold:g} GiB, no accelerator, and "
        f"{format_bytes(memory)} usable memory / {cores} usable cores are below the server "
        f"floor ({SERVER_MIN_MEMORY_GIB:g} GiB and {SERVER_MIN_CORES} cores)"
    ))
