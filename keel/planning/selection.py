"""Which backend runs one operation, and why.

:func:`select_backend` decides from the op's properties (op group, size,
dtype, where its data lives), the backends available in a registry, an
optional hardware profile and policy, and an optional :class:`Calibration`.

1. A pin (the ``pinned`` argument, else the policy's ``backend``, else
   ``KEEL_BACKEND``) is authoritative: the pinned backend runs the op or the
   call raises (``BackendSelectionError`` when it cannot run here,
   ``UnsupportedOperationError`` when it lacks the op). Never a silent fallback.
2. Otherwise the priority chain is walked. A backend is *viable* when it is
   available, has a kernel for the op and dtype, and the policy and profile
   allow it (``prefer_gpu``, ``min_gpu_memory_gb``, free GPU memory).
3. Among viable backends, the device is chosen by cost: data already on a
   device stays there; otherwise the GPU is used only when the transfer is
   paid back — from seed 004, under 1 MB always the CPU, matmul-like and
   convolution ops over 10 MB and elementwise ops over 100 MB on the GPU,
   everything else on the CPU. A :class:`Calibration` with measured crossover
   sizes (:mod:`keel.planning.calibration`, ``keel calibrate``) replaces these
   static thresholds for the op groups and dtypes it covers, and the reason
   quotes the measurement. Without one given, the calibration cached for this
   machine is used when there is one.
4. The first viable backend on that device, in chain order, runs the op.
   Every other candidate is listed in ``Selection.rejected`` with its reason.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keel.backends.base import Backend, DeviceKind
from keel.backends.registry import BackendRegistry, default_registry
from keel.config import format_bytes, settings
from keel.dtypes import DType, as_dtype
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.hardware.profile import HardwareProfile
from keel.ops.registry import Op, OpGroup, op_group, to_op
from keel.planning.calibration_record import (
    Calibration,
    default_calibration,
    format_size,
    group_name,
)

__all__ = [
    "MB",
    "SMALL_BYTES",
    "STATIC_CROSSOVER_BYTES",
    "Calibration",
    "OperationProperties",
    "Selection",
    "cost_group",
    "gpu_pays_back",
    "resolve_pin",
    "select_backend",
]

MB = 1_000_000                     # seed 004 sizes are decimal megabytes
SMALL_BYTES = 1 * MB               # under this, launch and transfer overhead dominate
# From which input size the GPU pays back the transfer, per cost group (seed 004).
# Groups not listed stay on the CPU unless their data already lives on the GPU.
STATIC_CROSSOVER_BYTES: Mapping[OpGroup, int] = {
    OpGroup.MATMUL_LIKE: 10 * MB,
    OpGroup.CONVOLUTION: 10 * MB,
    OpGroup.ELEMENTWISE: 100 * MB,
}

_RESIDENCIES = tuple(d.value for d in DeviceKind)


@dataclass(frozen=True)
class OperationProperties:
    """What selection needs to know about one operation."""

    op: Op
    element_count: int                 # elements of the inputs
    nbytes: int                        # bytes of the inputs
    dtype: DType                       # dtype of the first input
    residency: str = "cpu"             # device kind where the inputs live

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", to_op(self.op))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        for name in ("element_count", "nbytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
        if self.residency not in _RESIDENCIES:
            raise InvalidArgumentError(
                f"residency {self.residency!r} is not a device kind; allowed: "
                f"{', '.join(_RESIDENCIES)}")


@dataclass(frozen=True)
class Selection:
    """The backend chosen for one operation, why, and why not each other candidate."""

    backend: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "reason": self.reason,
                "rejected": [{"backend": b, "reason": r} for b, r in self.rejected]}

    def __str__(self) -> str:
        lines = [f"{self.backend}: {self.reason}"]
        lines += [f"  not {b}: {r}" for b, r in self.rejected]
        return "\n".join(lines)


def cost_group(op: Op) -> OpGroup:
    """The group whose crossover applies to ``op`` (compute-heavy groups first)."""
    for group in (OpGroup.CONVOLUTION, OpGroup.MATMUL_LIKE, OpGroup.ELEMENTWISE):
        if op in group:
            return group
    return op_group(op)


# ---- selection ----------------------------------------------------------------

def select_backend(
    props: OperationProperties,
    profile: HardwareProfile | None = None,
    policy: Any = None,
    registry: BackendRegistry | None = None,
    pinned: str | None = None,
    calibration: Calibration | None = None,
) -> Selection:
    """Choose the backend for one operation; see the module docstring for the rules.

    ``calibration=None`` consults :func:`~keel.planning.calibration.default_calibration`
    (the file ``KEEL_CALIBRATION`` names, else the cached one for this machine);
    an empty ``Calibration()`` keeps the static thresholds only.
    """
    if not isinstance(props, OperationProperties):
        raise InvalidArgumentError(
            f"select_backend needs OperationProperties, got {type(props).__name__}")
    reg = registry if registry is not None else default_registry()
    pin, source = resolve_pin(pinned, policy)
    if pin is not None:
        return _select_pinned(reg, pin, source, props)
    viable, rejected = _viable(reg, props, profile, policy)
    if not viable:
        detail = "; ".join(f"{b}: {r}" for b, r in rejected) or "the priority chain is empty"
        raise UnsupportedOperationError(props.op.value, supported_on=reg.supported_on(props.op),
                                        detail=f"no backend can run it here ({detail})")
    device, why = _choose_device(viable, props, calibration)
    chosen = next((b for b in viable if b.device is device), viable[0])
    if chosen.device is not device:
        why = f"the only device that can run it ({why})"
    for b in viable:
        if b is not chosen:
            rejected.append((b.name, _why_not_chosen(b, chosen, why)))
    return Selection(chosen.name, why, tuple(rejected))


def resolve_pin(pinned: str | None, policy: Any) -> tuple[str | None, str]:
    """The pinned backend name and who pinned it: the caller, the policy or KEEL_BACKEND.

    ``"auto"`` (or nothing) at one level defers to the next; ``(None, "")`` is no pin.
    """
    for value, source in ((pinned, "the caller"),
                          (getattr(policy, "backend", None), "the policy"),
                          (settings().backend, "KEEL_BACKEND")):
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidArgumentError(f"backend must be a name, got {value!r}")
        name = value.strip().lower()
        if name != "auto":
            return name, source
    return None, ""


def _select_pinned(reg: BackendRegistry, pin: str, source: str,
                   props: OperationProperties) -> Selection:
    backend = reg.get(pin)        # BackendSelectionError naming the pin
    if not backend.supports(props.op, props.dtype):
        what = "op" if not backend.supports(props.op) else f"op for {props.dtype.value}"
        raise UnsupportedOperationError(
            props.op.value, pin, supported_on=reg.supported_on(props.op),
            detail=f"backend pinned by {source} has no kernel for this {what}")
    return Selection(pin, f"pinned by {source}")


def _viable(reg: BackendRegistry, props: OperationProperties, profile: HardwareProfile | None,
            policy: Any) -> tuple[list[Backend], list[tuple[str, str]]]:
    viable: list[Backend] = []
    rejected: list[tuple[str, str]] = []
    for name in reg.priority:
        avail = reg.availability(name)
        if not avail.available:
            rejected.append((name, f"unavailable: {avail.reason}"))
            continue
        backend = reg.instance(name)
        why_not = _why_not_viable(backend, props, profile, policy)
        if why_not:
            rejected.append((name, why_not))
        else:
            viable.append(backend)
    return viable, rejected


def _why_not_viable(backend: Backend, props: OperationProperties,
                    profile: HardwareProfile | None, policy: Any) -> str | None:
    if not backend.supports(props.op):
        return f"has no kernel for {props.op.value}"
    if not backend.supports(props.op, props.dtype):
        note = backend.dtype_notes.get(props.dtype)
        return (f"has no {props.op.value} kernel for {props.dtype.value}"
                + (f" (it holds no {props.dtype.value}: {note})" if note else ""))
    blocked = backend.auto_blocked(props, functools.partial(_measured, backend.name, props))
    if blocked:
        return blocked
    if backend.device is DeviceKind.GPU:
        return _gpu_blocked(backend, props, profile, policy)
    return None


def _measured(name: str, props: OperationProperties) -> tuple[int | None, str] | None:
    """What ``keel calibrate --gpu NAME`` measured for ``props``'s group and dtype:
    (crossover in bytes, None where the backend never won; where it was measured)."""
    from keel.planning.calibration_record import find_calibration

    calibration = find_calibration(gpu=name).calibration
    entry = None if calibration is None else calibration.lookup(cost_group(props.op),
                                                                 props.dtype)
    return None if calibration is None or entry is None else (entry[1], calibration.source)


def _gpu_blocked(backend: Backend, props: OperationProperties,
                 profile: HardwareProfile | None, policy: Any) -> str | None:
    if policy is not None and getattr(policy, "prefer_gpu", True) is False:
        return "the policy sets prefer_gpu: false"
    gpu = _profile_gpu(backend, profile)
    if gpu is None:
        return None
    min_gb = getattr(policy, "min_gpu_memory_gb", None) if policy is not None else None
    total = gpu.total_memory_bytes
    if isinstance(min_gb, (int, float)) and total is not None and total < min_gb * 1024**3:
        return (f"GPU memory {format_bytes(total)} is under the policy's "
                f"min_gpu_memory_gb {min_gb}")
    free = gpu.free_memory_bytes
    if free is not None and props.nbytes > free:
        return f"inputs of {format_bytes(props.nbytes)} exceed free GPU memory {format_bytes(free)}"
    return None


def _profile_gpu(backend: Backend, profile: HardwareProfile | None) -> Any:
    if profile is None:
        return None
    index = getattr(backend, "device_index", 0)
    return next((g for g in profile.gpus if g.index == index), None)


def _choose_device(viable: list[Backend], props: OperationProperties,
                   calibration: Calibration | None) -> tuple[DeviceKind, str]:
    devices = {b.device for b in viable}
    resident = DeviceKind(props.residency)
    if resident is DeviceKind.GPU and resident in devices:
        return resident, "its inputs already live on the GPU: running there avoids a transfer"
    if DeviceKind.GPU not in devices:
        return DeviceKind.CPU, "the CPU is the only device available for it"
    # Looked up only here, where it matters: a machine without a usable GPU never reads it.
    worth, why = gpu_pays_back(props, calibration if calibration is not None
                               else default_calibration())
    if worth:
        return DeviceKind.GPU, why
    if DeviceKind.CPU in devices:
        return DeviceKind.CPU, why
    return DeviceKind.GPU, f"no CPU backend can run it, so the GPU does ({why})"


def gpu_pays_back(props: OperationProperties,
                  calibration: Calibration | None = None) -> tuple[bool, str]:
    """Whether moving this op's inputs to the GPU is paid back, and why (not).

    A calibration that covers the op's group on its dtype decides, and the
    reason quotes the measurement behind it; otherwise the static rules do.
    """
    group = cost_group(props.op)
    entry = None if calibration is None else calibration.lookup(group, props.dtype)
    if calibration is not None and entry is not None:
        return _calibrated(props, group, calibration, entry)
    verdict, why = _static(props, group)
    if calibration is not None and not calibration.has_gpu:
        why += " (the calibration found no usable GPU; run `keel calibrate` again)"
    elif calibration is not None and calibration.covers(group):
        why += (f" (the calibration has no {props.dtype.value} measurement for "
                f"{group_name(group)} ops)")
    return verdict, why


def _calibrated(props: OperationProperties, group: OpGroup, calibration: Calibration,
                entry: tuple[tuple[OpGroup, DType | None], int | None]) -> tuple[bool, str]:
    (_, dtype), cross = entry
    what = group_name(group) if dtype is None else f"{dtype.value} {group_name(group)}"
    evidence = calibration.evidence(group, props.dtype)
    quote = calibration.source if evidence is None \
        else f"{calibration.source}: {evidence.describe()}"
    if cross is None:
        if evidence is None:
            return False, (f"calibration ({calibration.source}): the GPU never beat the CPU "
                           f"for {what} ops")
        return False, (f"the GPU was not ahead of the CPU for {what} ops at the largest size "
                       f"measured ({quote})")
    verdict = props.nbytes >= cross
    return verdict, (f"{_size(props.nbytes)} of {what} input is "
                     f"{'at or over' if verdict else 'under'} the measured GPU crossover "
                     f"{_size(cross)} ({quote})")


def _static(props: OperationProperties, group: OpGroup) -> tuple[bool, str]:
    """Seed 004's fixed thresholds."""
    name, size = group_name(group), _size(props.nbytes)
    if props.nbytes < SMALL_BYTES:
        return False, f"{size} of input is under 1 MB: launch and transfer overhead dominate"
    static = STATIC_CROSSOVER_BYTES.get(group)
    if static is None:
        return False, f"{name} ops stay on the CPU unless their inputs already live on the GPU"
    verdict = props.nbytes > static
    return verdict, (f"{size} of {name} input is {'over' if verdict else 'not over'} the "
                     f"{static // MB} MB where the GPU pays back the transfer")


_size = format_size      # decimal units, like the thresholds (seed 004 counts megabytes)


def _why_not_chosen(backend: Backend, chosen: Backend, why: str) -> str:
    if backend.device is chosen.device:
        return f"lower in the priority chain than {chosen.name}"
    return f"{chosen.device.value} chosen instead: {why}"
