"""Accelerator probe: TPUs and NPUs from environment variables and device nodes.

Environment variables read (a variable counts when it is set and non-empty):

==========================  ========  ==========================================
variable                    kind      set by
==========================  ========  ==========================================
``TPU_VISIBLE_DEVICES``     tpu       Cloud TPU VMs (libtpu)
``TPU_NAME``                tpu       Cloud TPU nodes / VMs
``TPU_ACCELERATOR_TYPE``    tpu       Cloud TPU VMs (e.g. ``v5litepod-8``)
``COLAB_TPU_ADDR``          tpu       Google Colab TPU runtimes
``NEURON_RT_VISIBLE_CORES`` neuron    AWS Inferentia / Trainium (Neuron runtime)
``NEURO_ACCELERATORS``      npu       generic NPU deployments
``HABANA_VISIBLE_DEVICES``  habana    Intel Gaudi (Habana) containers
==========================  ========  ==========================================

Device nodes read: ``/dev/accel<N>`` (the Linux accel subsystem: Google TPU,
Intel NPU, AMD XDNA, Qualcomm AI 100, Gaudi; the kind comes from the bound
driver or PCI vendor in ``/sys/class/accel/accel<N>/device``),
``/dev/neuron<N>`` (AWS Neuron) and ``/dev/hl<N>`` (Gaudi before the accel
subsystem). Environment variables of one kind are reported together as one
entry; each device node is one entry.
"""

from __future__ import annotations

import re

from keel.hardware.profile import AcceleratorInfo
from keel.hardware.sources import ProbeSources, to_int

__all__ = ["ACCELERATOR_ENV", "probe_accelerators"]

#: environment variable -> accelerator kind
ACCELERATOR_ENV: dict[str, str] = {
    "TPU_VISIBLE_DEVICES": "tpu",
    "TPU_NAME": "tpu",
    "TPU_ACCELERATOR_TYPE": "tpu",
    "COLAB_TPU_ADDR": "tpu",
    "NEURON_RT_VISIBLE_CORES": "neuron",
    "NEURO_ACCELERATORS": "npu",
    "HABANA_VISIBLE_DEVICES": "habana",
}

_KIND_NAMES = {"tpu": "TPU", "neuron": "AWS Neuron", "npu": "NPU", "habana": "Intel Gaudi"}

# kernel driver of an accel device -> kind
_ACCEL_DRIVERS = {
    "intel_vpu": "npu", "amdxdna": "npu", "qaic": "npu", "habanalabs": "habana",
}
_GOOGLE_PCI_VENDOR = 0x1AE0

_NODES = (
    (re.compile(r"neuron\d+"), "neuron"),
    (re.compile(r"hl\d+"), "habana"),
)


def probe_accelerators(src: ProbeSources) -> tuple[AcceleratorInfo, ...]:
    """TPU/NPU entries found in the environment and under ``/dev``."""
    return (*_from_env(src), *_from_nodes(src))


def _from_env(src: ProbeSources) -> list[AcceleratorInfo]:
    by_kind: dict[str, list[str]] = {}
    for var, kind in ACCELERATOR_ENV.items():
        if src.env.get(var, "").strip():
            by_kind.setdefault(kind, []).append(var)
    found = []
    for kind, names in by_kind.items():
        name = _KIND_NAMES[kind]
        if kind == "tpu" and src.env.get("TPU_ACCELERATOR_TYPE", "").strip():
            name = f"TPU {src.env['TPU_ACCELERATOR_TYPE'].strip()}"
        detail = "; ".join(f"{v}={src.env[v].strip()}" for v in names)
        found.append(AcceleratorInfo(kind=kind, name=name, source="env:" + ",".join(names),
                                     detail=detail))
    return found


def _from_nodes(src: ProbeSources) -> list[AcceleratorInfo]:
    if src.platform.system != "Linux":
        return []
    found = []
    for node in src.files.listdir("/dev"):
        if re.fullmatch(r"accel\d+", node):
            kind, detail = _accel_kind(src, node)
            found.append(AcceleratorInfo(kind=kind, name=node, source=f"/dev/{node}",
                                         detail=detail))
            continue
        for pattern, kind in _NODES:
            if pattern.fullmatch(node):
                found.append(AcceleratorInfo(kind=kind, name=node, source=f"/dev/{node}",
                                             detail=f"{_KIND_NAMES[kind]} device node"))
    return found


def _accel_kind(src: ProbeSources, node: str) -> tuple[str, str]:
    device = f"/sys/class/accel/{node}/device"
    link = src.files.readlink(f"{device}/driver")
    driver = link.rstrip("/").rsplit("/", 1)[-1] if link else None
    vendor = to_int(src.read(f"{device}/vendor"))
    if driver in _ACCEL_DRIVERS:
        return _ACCEL_DRIVERS[driver], f"accel device bound to driver {driver!r}"
    if vendor == _GOOGLE_PCI_VENDOR:
        return "tpu", "accel device with Google PCI vendor id 0x1ae0"
    return "accel", (f"accel device; driver {driver!r} is not one keel knows" if driver
                     else "accel device; no driver or known vendor in sysfs")
