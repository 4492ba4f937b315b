"""CPU probe: vendor, brand, cores (affinity and cgroup aware), frequencies, SIMD.

Linux reads ``/proc/cpuinfo``, ``/sys/devices/system/cpu`` and the cgroup
tree; macOS reads ``sysctl hw machdep.cpu``; Windows reads the registry,
``PROCESSOR_*`` environment variables and ``IsProcessorFeaturePresent``.
psutil, when importable, supplies physical cores, frequencies and (on
Windows) the affinity mask; on Linux it reads the same files as keel, so it is
asked only where ``/proc/cpuinfo`` and sysfs give no core count. Every field is
a reading or ``None`` with a note.
"""

from __future__ import annotations

import functools
import math
import platform
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from keel.hardware.profile import CpuInfo
from keel.hardware.sources import (
    Notes,
    PlatformInfo,
    ProbeSources,
    cgroup_dirs,
    parse_cpu_list,
    parse_key_values,
    to_float,
    to_int,
)

__all__ = [
    "ARM_FEATURES",
    "X86_FEATURES",
    "normalize_arch",
    "probe_cpu",
    "simd_from_flags",
    "simd_level",
    "this_cpu",
]

#: /proc/cpuinfo ``flags`` name -> keel's feature name (gcc ``-m`` spelling).
X86_FEATURES: dict[str, str] = {
    "sse": "sse", "sse2": "sse2", "pni": "sse3", "ssse3": "ssse3",
    "sse4_1": "sse4.1", "sse4_2": "sse4.2", "avx": "avx", "avx2": "avx2", "fma": "fma",
    "f16c": "f16c", "avx_vnni": "avxvnni",
    "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd",
    "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512ifma": "avx512ifma",
    "avx512vbmi": "avx512vbmi", "avx512_vbmi2": "avx512vbmi2", "avx512_vnni": "avx512vnni",
    "avx512_bitalg": "avx512bitalg", "avx512_vpopcntdq": "avx512vpopcntdq",
    "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16",
    "amx_tile": "amx-tile", "amx_bf16": "amx-bf16", "amx_int8": "amx-int8",
    "amx_fp16": "amx-fp16",
}

#: /proc/cpuinfo ``Features`` name (ARM) -> keel's feature name.
ARM_FEATURES: dict[str, str] = {
    "neon": "neon", "asimd": "neon", "asimdhp": "fp16", "asimddp": "dotprod",
    "i8mm": "i8mm", "bf16": "bf16", "sve": "sve", "sve2": "sve2", "sme": "sme", "sme2": "sme2",
}

# Canonical order of features in CpuInfo.simd (x86 first, then ARM).
_ORDER = list(dict.fromkeys([*X86_FEATURES.values(), *ARM_FEATURES.values()]))

# Highest level first; the first one present names the CPU's simd_level.
_LEVELS = (
    ("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx"), ("sse4.2", "sse4.2"),
    ("sse2", "sse2"), ("sve2", "sve2"), ("sve", "sve"), ("neon", "neon"),
)

_ARCH = {
    "x86_64": "x86_64", "amd64": "x86_64", "x64": "x86_64", "em64t": "x86_64",
    "i386": "x86", "i686": "x86", "x86": "x86",
    "aarch64": "aarch64", "arm64": "aarch64", "armv8l": "arm", "armv7l": "arm", "armv6l": "arm",
    "ppc64le": "ppc64le", "ppc64": "ppc64", "s390x": "s390x", "riscv64": "riscv64",
}

_VENDORS = {
    "GenuineIntel": "Intel", "AuthenticAMD": "AMD", "HygonGenuine": "Hygon",
    "CentaurHauls": "Centaur", "  Shanghai  ": "Zhaoxin",
}

# ARM "CPU implementer" codes and a few "CPU part" codes (from the ARM ARM / kernel tables).
_ARM_IMPLEMENTERS = {
    0x41: "ARM", 0x42: "Broadcom", 0x43: "Cavium", 0x46: "Fujitsu", 0x48: "HiSilicon",
    0x4E: "NVIDIA", 0x51: "Qualcomm", 0x61: "Apple", 0xC0: "Ampere",
}
_ARM_PARTS = {
    (0x41, 0xD03): "Cortex-A53", (0x41, 0xD05): "Cortex-A55", (0x41, 0xD08): "Cortex-A72",
    (0x41, 0xD0B): "Cortex-A76", (0x41, 0xD0C): "Neoverse-N1", (0x41, 0xD40): "Neoverse-V1",
    (0x41, 0xD41): "Cortex-A78", (0x41, 0xD42): "Cortex-A78AE", (0x41, 0xD46): "Cortex-A510",
    (0x41, 0xD47): "Cortex-A710", (0x41, 0xD49): "Neoverse-N2", (0x41, 0xD4F): "Neoverse-V2",
    (0x41, 0xD80): "Cortex-A520", (0x41, 0xD81): "Cortex-A720", (0x41, 0xD87): "Cortex-A725",
    (0xC0, 0xAC3): "AmpereOne",
}

# Windows IsProcessorFeaturePresent ids (winnt.h PF_*) -> keel feature name.
_WIN_FEATURES = {
    6: "sse", 10: "sse2", 13: "sse3", 36: "ssse3", 37: "sse4.1", 38: "sse4.2",
    39: "avx", 40: "avx2", 41: "avx512f", 19: "neon", 46: "sve",
}

# macOS sysctl hw.optional.* -> keel feature name.
_MAC_FEATURES = {
    "hw.optional.sse": "sse", "hw.optional.sse2": "sse2", "hw.optional.sse3": "sse3",
    "hw.optional.supplementalsse3": "ssse3", "hw.optional.sse4_1": "sse4.1",
    "hw.optional.sse4_2": "sse4.2", "hw.optional.avx1_0": "avx", "hw.optional.avx2_0": "avx2",
    "hw.optional.fma": "fma", "hw.optional.avx512f": "avx512f", "hw.optional.avx512dq": "avx512dq",
    "hw.optional.avx512cd": "avx512cd", "hw.optional.avx512bw": "avx512bw",
    "hw.optional.avx512vl": "avx512vl", "hw.optional.avx512ifma": "avx512ifma",
    "hw.optional.avx512vbmi": "avx512vbmi",
    "hw.optional.neon": "neon", "hw.optional.AdvSIMD": "neon",
    "hw.optional.arm.FEAT_FP16": "fp16", "hw.optional.neon_fp16": "fp16",
    "hw.optional.arm.FEAT_DotProd": "dotprod", "hw.optional.arm.FEAT_I8MM": "i8mm",
    "hw.optional.arm.FEAT_BF16": "bf16", "hw.optional.arm.FEAT_SME": "sme",
    "hw.optional.arm.FEAT_SME2": "sme2",
}


def normalize_arch(machine: str) -> str | None:
    """``AMD64``/``x86_64`` -> ``x86_64``, ``arm64``/``aarch64`` -> ``aarch64``; None if empty."""
    raw = machine.strip().lower()
    if not raw:
        return None
    return _ARCH.get(raw, raw)


def simd_from_flags(flags: Iterable[str], table: Mapping[str, str]) -> tuple[str, ...]:
    """Normalised features present in ``flags``, in keel's canonical order."""
    found = {table[f] for f in flags if f in table}
    return tuple(name for name in _ORDER if name in found)


def simd_level(features: Iterable[str]) -> str:
    """The widest SIMD level among ``features``; ``scalar`` when none."""
    present = set(features)
    return next((level for level, need in _LEVELS if need in present), "scalar")


@dataclass
class _Cpu:
    """Mutable draft of a CpuInfo while sources are read."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    notes: Notes = field(default_factory=Notes)

    def set(self, name: str, value: Any, source: str | None = None) -> None:
        if value is not None and self.values.get(name) is None:
            self.values[name] = value
            if source and source not in self.sources:
                self.sources.append(source)

    def missing(self, name: str, why: str) -> None:
        if self.values.get(name) is None:
            self.notes.add(name, why)


def probe_cpu(src: ProbeSources) -> CpuInfo:
    """Read the CPU description from ``src``; never raises for missing data."""
    draft = _Cpu()
    system = src.platform.system
    draft.set("architecture", normalize_arch(src.platform.machine), "platform")
    if system == "Linux":
        _linux(src, draft)
    psutil, why_no_psutil = _psutil_module(src, draft, system)
    if psutil is not None:
        _psutil(psutil, draft)      # elsewhere first: the preferred source where it answers
    if system == "Darwin":
        _darwin(src, draft)
    elif system == "Windows":
        _windows(src, draft)
    elif system != "Linux":
        draft.notes.add("cpu", f"no CPU reader for platform {system!r}")
    if psutil is None and system != "Linux":
        draft.notes.add("psutil", why_no_psutil)
    _usable(src, draft, psutil)
    return _finish(draft, system)


@functools.lru_cache(maxsize=1)
def this_cpu() -> CpuInfo | None:
    """This machine's CPU as :func:`probe_cpu` reads it (cgroup quotas and the affinity
    mask honoured), probed once per process; None where the probe fails. Only the CPU is
    read: a full ``probe()`` would also ask for GPUs, which a CPU planner has no use for."""
    try:
        return probe_cpu(ProbeSources.real())
    except Exception:  # a failing probe: callers fall back to os
        return None


# --- Linux ------------------------------------------------------------------


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    return [parse_key_values(b) for b in re.split(r"\n\s*\n", text) if b.strip()]


def _linux(src: ProbeSources, draft: _Cpu) -> None:
    text = src.read("/proc/cpuinfo")
    blocks = _cpuinfo_blocks(text) if text else []
    if not blocks:
        draft.notes.add("cpuinfo", "/proc/cpuinfo is not readable")
    first = next((b for b in blocks if "processor" in b), blocks[0] if blocks else {})
    _linux_identity(blocks, draft)
    _linux_simd(first, draft)
    online = parse_cpu_list(src.read("/sys/devices/system/cpu/online") or "")
    if online:
        draft.set("logical_cores", len(online), "sysfs")
    draft.set("logical_cores", sum("processor" in b for b in blocks) or None, "/proc/cpuinfo")
    draft.set("physical_cores", _sysfs_physical(src, online), "sysfs")
    pairs = {(b.get("physical id"), b.get("core id")) for b in blocks if "core id" in b}
    draft.set("physical_cores", len(pairs) or None, "/proc/cpuinfo")
    _linux_freq(src, first, draft)
    _linux_caches(src, draft)
    draft.set("numa_nodes", numa_nodes(src) or None, "sysfs node")
    _cgroup_quota(src, draft)


def _arm_brand(impl: int, blocks: list[dict[str, str]]) -> str | None:
    """``ARM Cortex-A520 + Cortex-A720``: every core type, in cpu order."""
    parts = []
    for block in blocks:
        part = to_int(block.get("CPU part"))
        if part is not None:
            name = _ARM_PARTS.get((to_int(block.get("CPU implementer")) or impl, part))
            parts.append(name or f"part {part:#x}")
    names = " + ".join(dict.fromkeys(parts))
    vendor = _ARM_IMPLEMENTERS.get(impl)
    return " ".join(filter(None, (vendor, names))) or None


def _linux_identity(blocks: list[dict[str, str]], draft: _Cpu) -> None:
    first = next((b for b in blocks if "processor" in b), blocks[0] if blocks else {})
    vendor = first.get("vendor_id")
    if vendor:
        draft.set("vendor", _VENDORS.get(vendor, vendor.strip()), "/proc/cpuinfo")
        draft.set("brand", first.get("model name") or None, "/proc/cpuinfo")
        return
    impl = to_int(first.get("CPU implementer"))
    if impl is not None:
        draft.set("vendor", _ARM_IMPLEMENTERS.get(impl, f"ARM implementer {impl:#x}"),
                  "/proc/cpuinfo")
        draft.set("brand", _arm_brand(impl, blocks), "/proc/cpuinfo")
    draft.set("brand", first.get("model name") or first.get("cpu") or None, "/proc/cpuinfo")
    draft.missing("vendor", "/proc/cpuinfo has neither vendor_id nor CPU implementer")


def _linux_simd(first: Mapping[str, str], draft: _Cpu) -> None:
    if "flags" in first:
        draft.values["simd"] = simd_from_flags(first["flags"].split(), X86_FEATURES)
        draft.values["simd_source"] = "/proc/cpuinfo flags"
    elif "Features" in first:
        draft.values["simd"] = simd_from_flags(first["Features"].split(), ARM_FEATURES)
        draft.values["simd_source"] = "/proc/cpuinfo Features"
    else:
        draft.notes.add("simd", "/proc/cpuinfo lists no flags/Features line")


def _sysfs_physical(src: ProbeSources, online: frozenset[int] | None) -> int | None:
    if not online:
        return None
    groups = set()
    for cpu in online:
        text = src.read(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        siblings = parse_cpu_list(text) if text else None
        if siblings is None:
            return None
        groups.add(siblings)
    return len(groups)


_CACHE_FIELDS = {1: "l1d_cache_bytes", 2: "l2_cache_bytes", 3: "l3_cache_bytes"}


def _linux_caches(src: ProbeSources, draft: _Cpu) -> None:
    """cpu0's data and unified caches from sysfs (``size`` reads like ``48K``)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    for entry in sorted(src.listdir(base)):
        if not entry.startswith("index"):
            continue
        kind = (src.read(f"{base}/{entry}/type") or "").strip()
        level = to_int(src.read(f"{base}/{entry}/level"))
        name = _CACHE_FIELDS.get(level or 0)
        if name is not None and kind in ("Data", "Unified"):
            draft.set(name, _cache_size(src.read(f"{base}/{entry}/size")), "sysfs cache")


def numa_nodes(src: ProbeSources | None = None) -> tuple[str, ...]:
    """The CPU list of each NUMA node with CPUs (``/sys/devices/system/node/node<N>/cpulist``),
    by node number; empty where sysfs lists no node (not Linux, or no readings)."""
    if src is None:
        src = ProbeSources(platform=PlatformInfo(platform.system(), platform.machine()))
    base = "/sys/devices/system/node"
    found = []
    for entry in src.listdir(base):
        number = to_int(entry[4:]) if entry.startswith("node") else None
        text = None if number is None else (src.read(f"{base}/{entry}/cpulist") or "").strip()
        if text and parse_cpu_list(text):
            found.append((number, text))
    return tuple(text for _, text in sorted(found))


def cache_sizes(src: ProbeSources | None = None) -> dict[str, int]:
    """The cache fields (``l2_cache_bytes`` ...) of this machine's CPU (or ``src``'s) that
    sysfs, or macOS's sysctl, answers, without the rest of the CPU probe."""
    if src is None:      # platform.processor() and the rest of PlatformInfo cost ms
        src = ProbeSources(platform=PlatformInfo(platform.system(), platform.machine()))
    draft = _Cpu()
    if src.platform.system == "Linux":
        _linux_caches(src, draft)
    elif src.platform.system == "Darwin":
        answer = src.run("sysctl", *_DARWIN_CACHES.values())
        kv = parse_key_values(answer.output) if answer.ok else {}
        _darwin_caches(kv, draft)
    return {k: v for k, v in draft.values.items() if k in _CACHE_FIELDS.values()}


_DARWIN_CACHES = {1: "hw.l1dcachesize", 2: "hw.l2cachesize", 3: "hw.l3cachesize"}


def _darwin_caches(kv: Mapping[str, str], draft: _Cpu) -> None:
    for level, key in _DARWIN_CACHES.items():
        draft.set(_CACHE_FIELDS[level], to_int(kv.get(key)) or None, "sysctl")


def _cache_size(text: str | None) -> int | None:
    match = re.fullmatch(r"(\d+)\s*([KMG]?)", (text or "").strip())
    if match is None:
        return None
    return int(match.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[match.group(2)]


def _linux_freq(src: ProbeSources, first: Mapping[str, str], draft: _Cpu) -> None:
    base = "/sys/devices/system/cpu/cpu0/cpufreq"
    khz = to_int(src.read(f"{base}/base_frequency"))
    draft.set("base_frequency_mhz", None if khz is None else khz / 1000, "sysfs cpufreq")
    khz = to_int(src.read(f"{base}/cpuinfo_max_freq"))
    draft.set("max_frequency_mhz", None if khz is None else khz / 1000, "sysfs cpufreq")
    draft.set("current_frequency_mhz", to_float(first.get("cpu MHz")), "/proc/cpuinfo")
    khz = to_int(src.read(f"{base}/scaling_cur_freq"))
    draft.set("current_frequency_mhz", None if khz is None else khz / 1000, "sysfs cpufreq")


def _cgroup_quota(src: ProbeSources, draft: _Cpu) -> None:
    dirs, why = cgroup_dirs(src, "cpu")
    if dirs is None:
        draft.notes.add("cgroup_cpu_quota", why)
        return
    quotas = []
    if dirs.version == "v2":
        for _, text in dirs.read(src, "cpu.max"):
            quota, _, period = text.partition(" ")
            q, p = to_int(quota), to_int(period)
            if q is not None and p:
                quotas.append(q / p)
    else:
        periods = dict(dirs.read(src, "cpu.cfs_period_us"))
        for d, text in dirs.read(src, "cpu.cfs_quota_us"):
            q, p = to_int(text), to_int(periods.get(d))
            if q is not None and q > 0 and p:
                quotas.append(q / p)
    if quotas:
        draft.set("cgroup_cpu_quota", min(quotas), f"cgroup {dirs.version}")
    else:
        draft.notes.add("cgroup_cpu_quota", f"cgroup {dirs.version} at {dirs.dirs[0]} "
                        "sets no CPU quota")


# --- macOS --------------------------------------------------------------------


def _darwin(src: ProbeSources, draft: _Cpu) -> None:
    answer = src.run("sysctl", "hw", "machdep.cpu")
    if not answer.ok:
        draft.notes.add("sysctl", answer.reason)
        return
    kv = parse_key_values(answer.output)
    brand = kv.get("machdep.cpu.brand_string")
    draft.set("brand", brand or None, "sysctl")
    vendor = kv.get("machdep.cpu.vendor")
    if not vendor and brand and brand.startswith("Apple"):
        vendor = "Apple"
    draft.set("vendor", _VENDORS.get(vendor or "", vendor) or None, "sysctl")
    draft.set("logical_cores", to_int(kv.get("hw.logicalcpu") or kv.get("hw.ncpu")), "sysctl")
    draft.set("physical_cores", to_int(kv.get("hw.physicalcpu")), "sysctl")
    hz = to_int(kv.get("hw.cpufrequency"))
    draft.set("base_frequency_mhz", None if hz is None else hz / 1e6, "sysctl")
    _darwin_caches(kv, draft)
    hz = to_int(kv.get("hw.cpufrequency_max"))
    draft.set("max_frequency_mhz", None if hz is None else hz / 1e6, "sysctl")
    flags = [key for key, value in kv.items() if key in _MAC_FEATURES and value.strip() == "1"]
    draft.values["simd"] = simd_from_flags(flags, _MAC_FEATURES)
    draft.values["simd_source"] = "sysctl hw.optional"
    draft.notes.add("cgroup_cpu_quota", "macOS has no cgroups")


# --- Windows ------------------------------------------------------------------

_WIN_CPU_KEY = r"HARDWARE\DESCRIPTION\System\CentralProcessor\0"


def _windows(src: ProbeSources, draft: _Cpu) -> None:
    ident = src.env.get("PROCESSOR_IDENTIFIER", "") or src.platform.processor
    brand = src.registry(_WIN_CPU_KEY, "ProcessorNameString")
    draft.set("brand", str(brand).strip() or None if brand else None, "registry")
    draft.set("brand", ident.strip() or None, "PROCESSOR_IDENTIFIER")
    vendor = src.registry(_WIN_CPU_KEY, "VendorIdentifier")
    if not vendor and "," in ident:
        vendor = ident.rsplit(",", 1)[1].strip()
    draft.set("vendor", _VENDORS.get(str(vendor), str(vendor)) if vendor else None, "registry")
    arch = src.env.get("PROCESSOR_ARCHITECTURE", "")
    if arch:
        draft.values["architecture"] = normalize_arch(arch)
    draft.set("logical_cores", to_int(src.env.get("NUMBER_OF_PROCESSORS")), "env")
    draft.set("base_frequency_mhz", to_float(src.registry(_WIN_CPU_KEY, "~MHz")), "registry")
    answers = {fid: src.win_feature(fid) for fid in _WIN_FEATURES}
    if all(a is None for a in answers.values()):
        draft.notes.add("simd", "IsProcessorFeaturePresent is not callable")
    else:
        flags = [str(fid) for fid, ok in answers.items() if ok]
        table = {str(k): v for k, v in _WIN_FEATURES.items()}
        draft.values["simd"] = simd_from_flags(flags, table)
        draft.values["simd_source"] = "IsProcessorFeaturePresent"
        draft.notes.add("simd_detail", "Windows reports only sse*/avx/avx2/avx512f/neon/sve; "
                        "fma, avx512bw/vnni and amx are unknown there")
    draft.notes.add("cgroup_cpu_quota", "Windows job-object CPU limits are not read")


# --- psutil, affinity and the final record -------------------------------------


def _psutil_module(src: ProbeSources, draft: _Cpu, system: str) -> tuple[Any, str]:
    """psutil, where the probe asks it: not on Linux once /proc and sysfs answered (psutil
    reads the same files there, and importing it is about 8 ms of a fresh process)."""
    if system == "Linux" and draft.values.get("logical_cores"):
        return None, "not needed: /proc/cpuinfo and sysfs answered"
    return src.module("psutil")


def _psutil(psutil: Any, draft: _Cpu) -> None:
    try:
        draft.set("physical_cores", psutil.cpu_count(logical=False), "psutil")
        draft.set("logical_cores", psutil.cpu_count(logical=True), "psutil")
        freq = psutil.cpu_freq()
    except Exception as exc:  # psutil raises platform-specific errors
        draft.notes.add("psutil", f"psutil failed: {exc}")
        return
    if freq is not None:
        draft.set("max_frequency_mhz", float(freq.max) if freq.max else None, "psutil")
        draft.set("current_frequency_mhz", float(freq.current) if freq.current else None,
                  "psutil")


def _affinity(src: ProbeSources, psutil: Any) -> tuple[int | None, str]:
    mask = src.affinity()
    if mask:
        return len(mask), "sched_getaffinity"
    if psutil is not None and hasattr(psutil.Process(), "cpu_affinity"):
        try:
            return len(psutil.Process().cpu_affinity()), "psutil cpu_affinity"
        except Exception as exc:  # AccessDenied and friends
            return None, f"psutil cpu_affinity failed: {exc}"
    return None, f"{src.platform.system} offers no CPU affinity mask to read"


def _usable(src: ProbeSources, draft: _Cpu, psutil: Any) -> None:
    count, how = _affinity(src, psutil)
    if count is None:
        draft.notes.add("affinity_cores", how)
    draft.set("affinity_cores", count, how)
    limits = [draft.values.get("affinity_cores"), draft.values.get("logical_cores")]
    quota = draft.values.get("cgroup_cpu_quota")
    if quota is not None:
        limits.append(max(1, math.ceil(quota)))
    known = [n for n in limits if n]
    draft.set("usable_cores", min(known) if known else None)


def _brand_ghz(brand: str | None) -> float | None:
    match = re.search(r"@\s*([0-9.]+)\s*GHz", brand or "")
    return None if match is None else float(match.group(1)) * 1000


def _finish(draft: _Cpu, system: str) -> CpuInfo:
    v = draft.values
    draft.set("base_frequency_mhz", _brand_ghz(v.get("brand")), "brand string")
    simd = tuple(v.get("simd", ()))
    _explain_missing(draft, system)
    return CpuInfo(
        vendor=v.get("vendor"), brand=v.get("brand"), architecture=v.get("architecture"),
        logical_cores=v.get("logical_cores"), physical_cores=v.get("physical_cores"),
        usable_cores=v.get("usable_cores"), affinity_cores=v.get("affinity_cores"),
        cgroup_cpu_quota=v.get("cgroup_cpu_quota"),
        base_frequency_mhz=v.get("base_frequency_mhz"),
        max_frequency_mhz=v.get("max_frequency_mhz"),
        current_frequency_mhz=v.get("current_frequency_mhz"),
        simd=simd, simd_level=simd_level(simd),
        simd_source=v.get("simd_source", "none"),
        l1d_cache_bytes=v.get("l1d_cache_bytes"), l2_cache_bytes=v.get("l2_cache_bytes"),
        l3_cache_bytes=v.get("l3_cache_bytes"),
        numa_nodes=tuple(v.get("numa_nodes") or ()),
        source="+".join(draft.sources) or "none",
        notes=draft.notes.as_tuple(),
    )


_WHY = {
    "vendor": "no source named the CPU vendor",
    "brand": "no source named the CPU model",
    "architecture": "platform.machine() is empty",
    "logical_cores": "no source counted logical CPUs",
    "physical_cores": "no source exposes the core topology",
    "usable_cores": "neither the affinity mask nor the logical core count is known",
    "affinity_cores": "no affinity mask was read",
    "cgroup_cpu_quota": "this platform has no cgroup reader",
    "base_frequency_mhz": "no source for this platform exposes it",
    "max_frequency_mhz": "no source for this platform exposes it",
    "current_frequency_mhz": "no source for this platform exposes it",
    "l1d_cache_bytes": "no source for this platform exposes it",
    "l2_cache_bytes": "no source for this platform exposes it",
    "l3_cache_bytes": "no source for this platform exposes it (many CPUs have no L3)",
}

# Where each frequency is looked for, per platform (for the "why not" note).
_FREQ_SOURCES = {
    "Linux": {"base_frequency_mhz": "cpufreq base_frequency, '@ GHz' in the brand",
              "max_frequency_mhz": "psutil, cpufreq cpuinfo_max_freq",
              "current_frequency_mhz": "psutil, /proc/cpuinfo, cpufreq"},
    "Darwin": {"base_frequency_mhz": "sysctl hw.cpufrequency (Intel Macs), '@ GHz' in the brand",
               "max_frequency_mhz": "psutil, sysctl hw.cpufrequency_max (Intel Macs)",
               "current_frequency_mhz": "psutil"},
    "Windows": {"base_frequency_mhz": "registry ~MHz, '@ GHz' in the brand",
                "max_frequency_mhz": "psutil", "current_frequency_mhz": "psutil"},
}


def _explain_missing(draft: _Cpu, system: str) -> None:
    looked = _FREQ_SOURCES.get(system, {})
    whys = {**_WHY, **{name: f"no source exposes it (looked at: {where})"
                       for name, where in looked.items()}}
    for name, why in whys.items():
        if draft.values.get(name) is None and not any(
            n.startswith(f"{name}:") for n in draft.notes.items
        ):
            draft.notes.add(name, why)
