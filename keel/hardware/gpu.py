"""GPU probe: NVIDIA, AMD, Intel and Apple GPUs, and which source answered.

Sources, richest first:

- NVIDIA: NVML through ``pynvml`` (package ``nvidia-ml-py``, imported lazily),
  then ``nvidia-smi --query-gpu=... --format=csv``.
- AMD: ``amdsmi`` (ROCm 6 Python bindings), then ``rocm-smi --json``.
- Apple and the GPUs of Intel Macs: ``system_profiler SPDisplaysDataType -json``.
- Linux, any vendor: PCI display controllers under ``/sys/class/drm/card*/device``
  and ``/sys/bus/pci/devices`` (class ``0x03xxxx``), by vendor id (``0x10de``
  NVIDIA, ``0x1002`` AMD, ``0x8086`` Intel). This sees a GPU even when no
  driver or vendor tool is installed; names come from ``pci.ids`` when present
  and AMD VRAM from ``mem_info_vram_total``.

A GPU seen by several sources is reported once, by the richest one (matched
on the PCI bus id).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Iterable
from typing import Any

from keel.hardware.profile import GpuInfo
from keel.hardware.sources import (
    CommandResult,
    Notes,
    ProbeSources,
    parse_key_values,
    to_int,
)

__all__ = ["PCI_VENDORS", "normalize_bus_id", "parse_nvidia_smi", "parse_rocm_smi", "probe_gpus"]

#: PCI vendor id -> keel vendor name (GPUs of other vendors, e.g. BMC VGA, are ignored).
PCI_VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel"}

MIB = 1024**2

_SMI_FIELDS = ("index", "name", "memory.total", "memory.free", "driver_version",
               "compute_cap", "pci.bus_id")

_PCI_IDS = ("/usr/share/hwdata/pci.ids", "/usr/share/misc/pci.ids", "/usr/share/pci.ids")


def probe_gpus(src: ProbeSources, system_memory_bytes: int | None = None
               ) -> tuple[tuple[GpuInfo, ...], tuple[str, ...]]:
    """All GPUs ``src`` can see, and a note for every source that could not answer.

    ``system_memory_bytes`` is the unified memory of Apple GPUs.
    """
    notes = Notes()
    found: list[GpuInfo] = []
    for vendor_sources in (_NVIDIA, _AMD):
        for reader in vendor_sources:
            gpus, why = reader(src)
            if gpus:
                found += gpus
                break
            notes.items.append(f"gpus: {why}")
    if src.platform.system == "Darwin":
        gpus, why = _system_profiler(src, system_memory_bytes)
        found += gpus
        if why:
            notes.items.append(f"gpus: {why}")
    if src.platform.system == "Linux":
        sysfs, why = _sysfs(src)
        found += _unmatched(sysfs, found)
        if why:
            notes.items.append(f"gpus: {why}")
    return tuple(found), notes.as_tuple()


# --- NVIDIA ----------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml(src: ProbeSources) -> tuple[list[GpuInfo], str]:
    nvml, why = src.module("pynvml")
    if nvml is None:
        return [], f"NVML: {why} (install nvidia-ml-py)"
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return [], f"NVML: nvmlInit failed ({exc})"
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        count = int(nvml.nvmlDeviceGetCount())
        gpus = [_nvml_device(nvml, i, driver) for i in range(count)]
    except Exception as exc:  # any NVML error mid-query
        return [], f"NVML: query failed ({exc})"
    finally:
        with contextlib.suppress(Exception):  # a failed shutdown changes nothing we report
            nvml.nvmlShutdown()
    return gpus, "" if gpus else "NVML: the driver reports no GPU"


def _nvml_device(nvml: Any, index: int, driver: str) -> GpuInfo:
    notes = Notes()
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        capability: str | None = f"{major}.{minor}"
    except Exception as exc:  # not supported on very old drivers
        capability = None
        notes.add("compute_capability", f"NVML did not report it ({exc})")
    try:
        bus: str | None = normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
    except Exception as exc:  # PCI info is optional for the plan
        bus = None
        notes.add("pci_bus_id", f"NVML did not report it ({exc})")
    return GpuInfo(
        index=index, vendor="nvidia", name=_text(nvml.nvmlDeviceGetName(handle)),
        total_memory_bytes=int(mem.total), free_memory_bytes=int(mem.free),
        driver=driver, compute_capability=capability, pci_bus_id=bus,
        source="nvml", notes=notes.as_tuple(),
    )


def _nvidia_smi(src: ProbeSources) -> tuple[list[GpuInfo], str]:
    fields: tuple[str, ...] = _SMI_FIELDS
    answer = src.run("nvidia-smi", f"--query-gpu={','.join(fields)}",
                     "--format=csv,noheader,nounits")
    if not answer.ok and "compute_cap" in answer.reason:
        # drivers before 510 do not know the compute_cap field; ask without it
        fields = tuple(f for f in _SMI_FIELDS if f != "compute_cap")
        answer = src.run("nvidia-smi", f"--query-gpu={','.join(fields)}",
                         "--format=csv,noheader,nounits")
    if not answer.ok:
        return [], f"nvidia-smi: {answer.reason}"
    gpus = parse_nvidia_smi(answer.output, fields)
    return gpus, "" if gpus else "nvidia-smi: answered with no GPU rows"


def _smi_value(raw: str) -> str | None:
    value = raw.strip()
    return None if not value or value.startswith("[") or value == "N/A" else value


def parse_nvidia_smi(text: str, fields: Iterable[str] = _SMI_FIELDS) -> list[GpuInfo]:
    """Rows of ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits``."""
    import csv  # here: a probe where nvidia-smi does not answer never parses CSV

    names = list(fields)
    gpus: list[GpuInfo] = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if len(row) != len(names):
            continue
        values = {n: _smi_value(v) for n, v in zip(names, row, strict=True)}
        notes = Notes()
        for key, field_name in (("name", "name"), ("memory.total", "total_memory_bytes"),
                                ("memory.free", "free_memory_bytes"),
                                ("driver_version", "driver"),
                                ("compute_cap", "compute_capability"),
                                ("pci.bus_id", "pci_bus_id")):
            if values.get(key) is None:
                notes.add(field_name, f"nvidia-smi did not report {key}")
        total, free = to_int(values.get("memory.total")), to_int(values.get("memory.free"))
        bus = values.get("pci.bus_id")
        gpus.append(GpuInfo(
            index=to_int(values.get("index")) or len(gpus), vendor="nvidia",
            name=values.get("name"),
            total_memory_bytes=None if total is None else total * MIB,
            free_memory_bytes=None if free is None else free * MIB,
            driver=values.get("driver_version"), compute_capability=values.get("compute_cap"),
            pci_bus_id=None if bus is None else normalize_bus_id(bus),
            source="nvidia-smi", notes=notes.as_tuple(),
        ))
    return gpus


# --- AMD ---------------------------------------------------------------------------


def _amdsmi(src: ProbeSources) -> tuple[list[GpuInfo], str]:
    amd, why = src.module("amdsmi")
    if amd is None:
        return [], f"amdsmi: {why}"
    try:
        amd.amdsmi_init()
    except Exception as exc:  # AmdSmiLibraryException when no driver
        return [], f"amdsmi: amdsmi_init failed ({exc})"
    try:
        gpus = [_amdsmi_device(amd, i, h) for i, h in enumerate(amd.amdsmi_get_processor_handles())]
    except Exception as exc:  # any library error mid-query
        return [], f"amdsmi: query failed ({exc})"
    finally:
        with contextlib.suppress(Exception):  # a failed shutdown changes nothing we report
            amd.amdsmi_shut_down()
    return gpus, "" if gpus else "amdsmi: no AMD GPU handles"


def _amdsmi_device(amd: Any, index: int, handle: Any) -> GpuInfo:
    notes = Notes()

    def ask(field_name: str, call: Any, *args: Any) -> Any:
        try:
            return call(handle, *args)
        except Exception as exc:  # each amdsmi query may be unsupported on its own
            notes.add(field_name, f"amdsmi did not report it ({exc})")
            return None

    asic = ask("name", amd.amdsmi_get_gpu_asic_info) or {}
    vram = getattr(getattr(amd, "AmdSmiMemoryType", None), "VRAM", None)
    total = ask("total_memory_bytes", amd.amdsmi_get_gpu_memory_total, vram)
    used = ask("free_memory_bytes", amd.amdsmi_get_gpu_memory_usage, vram)
    driver = ask("driver", amd.amdsmi_get_gpu_driver_info) or {}
    bus = ask("pci_bus_id", amd.amdsmi_get_gpu_device_bdf)
    notes.add("compute_capability", "a CUDA notion; AMD GPUs report a gfx target instead")
    return GpuInfo(
        index=index, vendor="amd", name=asic.get("market_name") or None,
        total_memory_bytes=to_int(total),
        free_memory_bytes=None if total is None or used is None else int(total) - int(used),
        driver=driver.get("driver_version") or None, compute_capability=None,
        pci_bus_id=normalize_bus_id(str(bus)) if bus else None,
        source="amdsmi", notes=notes.as_tuple(),
    )


def _rocm_smi(src: ProbeSources) -> tuple[list[GpuInfo], str]:
    answer = src.run("rocm-smi", "--showproductname", "--showmeminfo", "vram",
                     "--showdriverversion", "--showbus", "--json")
    if not answer.ok:
        return [], f"rocm-smi: {answer.reason}"
    gpus = parse_rocm_smi(answer.output)
    return gpus, "" if gpus else "rocm-smi: answered with no card"


def parse_rocm_smi(text: str) -> list[GpuInfo]:
    """Cards in ``rocm-smi --showproductname --showmeminfo vram ... --json`` output."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(data, dict):
        return []
    system = {k.lower(): v for k, v in (data.get("system") or {}).items()}
    driver = system.get("driver version")
    gpus = []
    for key in sorted(k for k in data if re.fullmatch(r"card\d+", k)):
        card = {k.lower(): v for k, v in data[key].items()}
        total = to_int(card.get("vram total memory (b)"))
        used = to_int(card.get("vram total used memory (b)"))
        notes = Notes()
        notes.add("compute_capability", "a CUDA notion; AMD GPUs report a gfx target instead")
        name = card.get("card series") or card.get("card model")
        for value, field_name in ((name, "name"), (total, "total_memory_bytes"),
                                  (driver, "driver"), (card.get("pci bus"), "pci_bus_id")):
            if value is None:
                notes.add(field_name, "rocm-smi did not report it")
        if total is None or used is None:
            notes.add("free_memory_bytes", "rocm-smi did not report VRAM total and used")
        gpus.append(GpuInfo(
            index=int(key[4:]), vendor="amd", name=name, total_memory_bytes=total,
            free_memory_bytes=None if total is None or used is None else total - used,
            driver=driver, compute_capability=None,
            pci_bus_id=normalize_bus_id(card["pci bus"]) if card.get("pci bus") else None,
            source="rocm-smi", notes=notes.as_tuple(),
        ))
    return gpus


_NVIDIA = (_nvml, _nvidia_smi)
_AMD = (_amdsmi, _rocm_smi)


# --- Apple / macOS --------------------------------------------------------------------


def _mac_vendor(raw: str) -> str:
    low = raw.lower()
    for key, vendor in (("apple", "apple"), ("nvidia", "nvidia"), ("amd", "amd"),
                        ("ati", "amd"), ("intel", "intel")):
        if key in low:
            return vendor
    return "unknown"


def _mac_vram(text: str | None) -> int | None:
    match = re.fullmatch(r"\s*(\d+)\s*(MB|GB)\s*", text or "")
    if match is None:
        return None
    return int(match.group(1)) * (MIB if match.group(2) == "MB" else 1024 * MIB)


def _system_profiler(src: ProbeSources, unified: int | None) -> tuple[list[GpuInfo], str]:
    answer = src.run("system_profiler", "SPDisplaysDataType", "-json")
    try:
        entries = json.loads(answer.output)["SPDisplaysDataType"] if answer.ok else None
    except (json.JSONDecodeError, KeyError, TypeError):
        entries, answer = None, CommandResult(False, reason="output is not the expected JSON")
    if not entries:
        return _apple_from_brand(src, unified, f"system_profiler: {answer.reason or 'no GPU'}")
    gpus = []
    for i, entry in enumerate(entries):
        gpus.append(_mac_gpu(i, entry, unified))
    return gpus, ""


def _mac_gpu(index: int, entry: dict[str, Any], unified: int | None) -> GpuInfo:
    notes = Notes()
    vendor = _mac_vendor(str(entry.get("spdisplays_vendor", entry.get("sppci_model", ""))))
    total = _mac_vram(entry.get("spdisplays_vram"))
    if total is None and vendor == "apple" and unified is not None:
        total = unified
        notes.add("unified_memory", "Apple GPUs share system memory; total is system memory")
    elif total is None:
        notes.add("total_memory_bytes", "system_profiler reports no dedicated VRAM")
    metal = str(entry.get("spdisplays_mtlgpufamilysupport", ""))
    driver = metal.replace("spdisplays_metal", "Metal ").strip() if metal else None
    if driver is None:
        notes.add("driver", "system_profiler reports no Metal family")
    if entry.get("sppci_cores"):
        notes.add("cores", f"{entry['sppci_cores']} GPU cores")
    notes.add("free_memory_bytes", "macOS does not report free GPU memory")
    notes.add("compute_capability", "a CUDA notion; not applicable")
    notes.add("pci_bus_id", "not reported by system_profiler")
    return GpuInfo(
        index=index, vendor=vendor, name=entry.get("sppci_model") or entry.get("_name"),
        total_memory_bytes=total, driver=driver, source="system_profiler",
        notes=notes.as_tuple(),
    )


def _apple_from_brand(src: ProbeSources, unified: int | None,
                      why: str) -> tuple[list[GpuInfo], str]:
    answer = src.run("sysctl", "-n", "machdep.cpu.brand_string")
    brand = answer.output.strip() if answer.ok else ""
    if not brand.startswith("Apple"):
        return [], why
    notes = Notes()
    for field_name in ("name", "driver", "free_memory_bytes", "compute_capability", "pci_bus_id"):
        notes.add(field_name, f"{why}; the GPU is known only from the SoC brand {brand!r}")
    if unified is None:
        notes.add("total_memory_bytes", "system memory (shared with the GPU) is unknown")
    gpu = GpuInfo(index=0, vendor="apple", total_memory_bytes=unified, source="sysctl",
                  notes=notes.as_tuple())
    return [gpu], why


# --- Linux sysfs (PCI vendor ids) ---------------------------------------------------


def normalize_bus_id(bus: str) -> str:
    """``00000000:18:00.0`` / ``0000:18:00.0`` -> ``0000:18:00.0`` (lower case)."""
    parts = bus.strip().lower().split(":")
    if len(parts) == 3:
        domain = to_int(f"0x{parts[0]}")
        if domain is not None:
            return f"{domain:04x}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"0000:{parts[0]}:{parts[1]}"
    return bus.strip().lower()


def _sysfs(src: ProbeSources) -> tuple[list[GpuInfo], str]:
    devices: dict[str, str] = {}   # bus id -> sysfs device dir
    for card in src.files.listdir("/sys/class/drm"):
        if re.fullmatch(r"card\d+", card):
            d = f"/sys/class/drm/{card}/device"
            uevent = parse_key_values(src.read(f"{d}/uevent") or "", sep="=")
            bus = uevent.get("PCI_SLOT_NAME") or (src.files.readlink(d) or "").rsplit("/", 1)[-1]
            if bus:
                devices.setdefault(normalize_bus_id(bus), d)
    for addr in src.files.listdir("/sys/bus/pci/devices"):
        devices.setdefault(normalize_bus_id(addr), f"/sys/bus/pci/devices/{addr}")
    gpus, ignored = [], []
    pci_ids = _pci_ids_text(src)
    counts: dict[str, int] = {}
    for bus, d in sorted(devices.items()):
        klass = (src.read(f"{d}/class") or "").strip().lower()
        if not klass.startswith("0x03"):
            continue
        vendor_id, device_id = to_int(src.read(f"{d}/vendor")), to_int(src.read(f"{d}/device"))
        vendor = PCI_VENDORS.get(vendor_id or -1)
        if vendor is None:
            ignored.append(f"{bus} (vendor {vendor_id or 0:#06x})")
            continue
        index = counts.get(vendor, 0)
        counts[vendor] = index + 1
        gpus.append(_sysfs_gpu(src, d, bus, vendor, index,
                               _pci_name(pci_ids, vendor_id or 0, device_id)))
    why = f"sysfs: ignored display controllers of non-GPU vendors: {', '.join(ignored)}" \
        if ignored else ""
    return gpus, why


def _sysfs_gpu(src: ProbeSources, d: str, bus: str, vendor: str, index: int,
               name: str | None) -> GpuInfo:
    notes = Notes()
    driver_link = src.files.readlink(f"{d}/driver")
    driver = driver_link.rstrip("/").rsplit("/", 1)[-1] if driver_link else None
    total = to_int(src.read(f"{d}/mem_info_vram_total"))
    used = to_int(src.read(f"{d}/mem_info_vram_used"))
    tool = {"nvidia": "NVML/nvidia-smi", "amd": "amdsmi/rocm-smi"}.get(vendor, "a vendor tool")
    if name is None:
        notes.add("name", f"{tool} did not answer and pci.ids names no such device")
    if total is None:
        notes.add("total_memory_bytes", f"{tool} did not answer and sysfs exposes no VRAM size")
    if total is None or used is None:
        notes.add("free_memory_bytes", "sysfs exposes no VRAM usage")
    if driver is None:
        notes.add("driver", "no kernel driver is bound to the PCI device")
    notes.add("compute_capability", f"only {tool} reports it" if vendor == "nvidia"
              else "a CUDA notion; not applicable")
    return GpuInfo(
        index=index, vendor=vendor, name=name, total_memory_bytes=total,
        free_memory_bytes=None if total is None or used is None else total - used,
        driver=driver, pci_bus_id=bus, source="sysfs", notes=notes.as_tuple(),
    )


def _pci_ids_text(src: ProbeSources) -> str:
    for path in _PCI_IDS:
        text = src.read(path)
        if text:
            return text
    return ""


def _pci_name(text: str, vendor_id: int, device_id: int | None) -> str | None:
    """The device name in a ``pci.ids`` database, or None."""
    if not text or device_id is None:
        return None
    vendor_line = re.search(rf"^{vendor_id:04x}\s+(.+)$", text, re.MULTILINE)
    if vendor_line is None:
        return None
    section = text[vendor_line.end():]
    end = re.search(r"^[0-9a-fA-F]{4}\s", section, re.MULTILINE)
    section = section[: end.start()] if end else section
    device = re.search(rf"^\t{device_id:04x}\s+(.+)$", section, re.MULTILINE)
    return device.group(1).strip() if device else None


def _unmatched(sysfs: list[GpuInfo], known: list[GpuInfo]) -> list[GpuInfo]:
    """sysfs GPUs that no richer source already reported."""
    buses = {g.pci_bus_id for g in known if g.pci_bus_id}
    vague = {g.vendor for g in known if not g.pci_bus_id}
    return [g for g in sysfs if g.pci_bus_id not in buses and g.vendor not in vague]
