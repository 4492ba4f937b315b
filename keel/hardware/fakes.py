"""Named fake machines for tests, built from real readings.

Each :class:`FakeMachine` carries the files (``/proc``, ``/sys``, cgroup
trees), command answers (``nvidia-smi``, ``rocm-smi``, ``sysctl``,
``system_profiler``), environment, optional modules (fake ``psutil`` and
``pynvml``), affinity mask, registry values and processor features that a
real machine of that kind shows. ``fake_machine(name).sources()`` gives
:class:`~keel.hardware.sources.ProbeSources` for :func:`keel.hardware.probe`;
``fake_profile(name)`` gives the probed profile. Fake probes use a frozen
clock, so their ``probe_seconds`` is ``0.0`` and repeated probes compare equal.

Machines: ``x86-avx512-server`` (2x Xeon Platinum 8480+, 2 TiB, no GPU),
``nvidia-h100-server`` (the same host with 8x H100 80GB seen by nvidia-smi),
``nvidia-h100-nvml`` (that host seen through NVML), ``nvidia-h100-hot`` (the
same with its GPUs at 85 C, 2 C below their slowdown temperature),
``edge-arm-board`` (8-core Cortex-A720/A520 board with SVE2, 4 GiB, no GPU, its
CPU at 48 C), ``edge-arm-board-hot`` (the same at 86.5 C, over its passive trip
point), ``container-2core-1gib``
(cgroup v2 quota of 2 cores and 1 GiB on a 16-thread host),
``container-v1-2core-1gib`` (the same limits through cgroup v1),
``amd-sysfs-only`` (Radeon RX 7900 XTX seen only through amdgpu sysfs),
``nvidia-no-driver`` (an NVIDIA card on PCI with no driver bound),
``amd-rocm-server`` (2x Instinct MI210 through rocm-smi), ``apple-m2-pro``
(macOS, sysctl + system_profiler), ``windows-rtx4090`` (Windows, registry +
IsProcessorFeaturePresent + nvidia-smi), ``tpu-v5e-vm`` (TPU env vars and
``/dev/accel*``) and ``inferentia-inf2`` (``/dev/neuron0``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from keel.errors import InvalidArgumentError
from keel.hardware.profile import HardwareProfile
from keel.hardware.sources import CommandResult, MemoryFiles, PlatformInfo, ProbeSources

__all__ = [
    "FAKE_MACHINES",
    "FakeMachine",
    "FakeNvml",
    "FakePsutil",
    "fake_machine",
    "fake_profile",
]

GIB = 1024**3


# --- fake optional modules ------------------------------------------------------


class FakePsutil:
    """The parts of psutil the probe uses, answering fixed readings."""

    def __init__(self, total: int, available: int, logical: int, physical: int | None,
                 freq: tuple[float, float, float] | None = None,
                 affinity: Sequence[int] | None = None) -> None:
        self._vm = SimpleNamespace(total=total, available=available)
        self._counts = {True: logical, False: physical}
        self._freq = None if freq is None else SimpleNamespace(
            current=freq[0], min=freq[1], max=freq[2])
        self._affinity = affinity

    def virtual_memory(self) -> Any:
        return self._vm

    def cpu_count(self, logical: bool = True) -> int | None:
        return self._counts[logical]

    def cpu_freq(self) -> Any:
        return self._freq

    def Process(self) -> Any:
        if self._affinity is None:   # macOS: psutil.Process has no cpu_affinity
            return SimpleNamespace()
        mask = list(self._affinity)
        return SimpleNamespace(cpu_affinity=lambda: mask)


class FakeNvml:
    """The parts of pynvml the probe and telemetry use, for a list of GPUs.

    Each GPU is a dict with ``name``, ``total``, ``free`` (bytes), ``cc``
    (major, minor), ``bus`` and optionally ``util`` (percent), ``temp`` and
    ``slowdown`` (degrees C) and ``throttle`` (NVML's clock-throttle reason bits).
    """

    class NVMLError(Exception):
        """pynvml's error type."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, gpus: Sequence[Mapping[str, Any]], driver: str,
                 init_error: str | None = None) -> None:
        self.gpus = [dict(g) for g in gpus]
        self.driver = driver
        self.init_error = init_error
        self.initialised = 0

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return str(self.gpus[handle]["name"]).encode()   # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        g = self.gpus[handle]
        return SimpleNamespace(total=g["total"], free=g["free"], used=g["total"] - g["free"])

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        major, minor = self.gpus[handle]["cc"]
        return int(major), int(minor)

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return SimpleNamespace(busId=self.gpus[handle]["bus"])

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        util = self.gpus[handle].get("util", 0)
        return SimpleNamespace(gpu=util, memory=util)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return int(self.gpus[handle].get("temp", 35))

    def nvmlDeviceGetTemperatureThreshold(self, handle: int, kind: int) -> int:
        return int(self.gpus[handle].get("slowdown", 87))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        return int(self.gpus[handle].get("throttle", 0))


# --- the fake machine -------------------------------------------------------------


def _frozen_clock() -> float:
    return 0.0


@dataclass(frozen=True)
class FakeMachine:
    """Everything a probe of one (fake) machine can read."""

    name: str
    description: str
    system: str
    machine: str
    files: Mapping[str, str] = field(default_factory=dict)
    links: Mapping[str, str] = field(default_factory=dict)
    commands: Mapping[str, str | CommandResult] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    modules: Mapping[str, Any] = field(default_factory=dict)
    affinity: frozenset[int] | None = None
    registry: Mapping[str, Any] = field(default_factory=dict)
    win_features: frozenset[int] | None = None
    release: str = ""
    hostname: str = ""

    def sources(self, **overrides: Any) -> ProbeSources:
        """ProbeSources reading this machine (``overrides`` replace any field)."""
        values: dict[str, Any] = dict(
            files=MemoryFiles(self.files, self.links),
            env=dict(self.env),
            platform=PlatformInfo(system=self.system, machine=self.machine,
                                  release=self.release, node=self.hostname,
                                  processor=self.env.get("PROCESSOR_IDENTIFIER", ""),
                                  python_version="3.11.7"),
            runner=self._run, importer=self._import, affinity=lambda: self.affinity,
            registry=lambda key, value: self.registry.get(value),
            win_feature=self._win_feature, clock=_frozen_clock,
        )
        values.update(overrides)
        return ProbeSources(**values)

    def profile(self) -> HardwareProfile:
        """The profile :func:`keel.hardware.probe` reads from this machine."""
        from keel.hardware import probe

        return probe(self.sources())

    def _run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        answer = self.commands.get(" ".join(argv), self.commands.get(argv[0]))
        if answer is None:
            return CommandResult(False, reason=f"{argv[0]} not found on PATH")
        return answer if isinstance(answer, CommandResult) else CommandResult(True, answer)

    def _import(self, name: str) -> tuple[Any | None, str]:
        module = self.modules.get(name)
        if module is None:
            return None, f"{name} is not importable (ModuleNotFoundError: not installed)"
        return module, ""

    def _win_feature(self, feature: int) -> bool | None:
        return None if self.win_features is None else feature in self.win_features


# --- reading builders -----------------------------------------------------------


def _x86_cpuinfo(vendor: str, family: int, model: int, name: str, flags: str, sockets: int,
                 cores: int, threads: int, mhz: float) -> dict[str, str]:
    """``/proc/cpuinfo`` plus sysfs topology, enumerated the way Linux does it."""
    per_thread = sockets * cores
    blocks, files = [], {}
    for cpu in range(per_thread * threads):
        rest = cpu % per_thread
        socket, core = divmod(rest, cores)
        blocks.append(
            f"processor\t: {cpu}\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
            f"model\t\t: {model}\nmodel name\t: {name}\nstepping\t: 8\n"
            f"cpu MHz\t\t: {mhz:.3f}\ncache size\t: 107520 KB\nphysical id\t: {socket}\n"
            f"siblings\t: {cores * threads}\ncore id\t\t: {core}\ncpu cores\t: {cores}\n"
            f"apicid\t\t: {cpu * 2}\nfpu\t\t: yes\nflags\t\t: {flags}\n"
            f"bogomips\t: {mhz * 2:.2f}\nclflush size\t: 64\ncache_alignment\t: 64\n"
        )
        siblings = ",".join(str(rest + t * per_thread) for t in range(threads))
        files[f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"] = siblings
    files["/proc/cpuinfo"] = "\n".join(blocks)
    files["/sys/devices/system/cpu/online"] = f"0-{per_thread * threads - 1}\n"
    for socket in range(sockets):      # one NUMA node per socket, its hyperthreads with it
        lo = socket * cores
        cpus = ",".join(f"{lo + t * per_thread}-{lo + cores - 1 + t * per_thread}"
                        for t in range(threads))
        files[f"/sys/devices/system/node/node{socket}/cpulist"] = cpus + "\n"
    return files


def _arm_cpuinfo(parts: Sequence[int], features: str) -> dict[str, str]:
    blocks, files = [], {}
    for cpu, part in enumerate(parts):
        blocks.append(
            f"processor\t: {cpu}\nBogoMIPS\t: 2000.00\nFeatures\t: {features}\n"
            f"CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\n"
            f"CPU part\t: {part:#05x}\nCPU revision\t: 1\n"
        )
        files[f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"] = str(cpu)
    files["/proc/cpuinfo"] = "\n".join(blocks)
    files["/sys/devices/system/cpu/online"] = f"0-{len(parts) - 1}\n"
    return files


def _caches(l1d: str, l2: str, l3: str) -> dict[str, str]:
    """cpu0's cache directories in sysfs: L1 data and instruction, unified L2 and L3."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    rows = [(1, "Data", l1d), (1, "Instruction", "32K"), (2, "Unified", l2), (3, "Unified", l3)]
    files: dict[str, str] = {}
    for index, (level, kind, size) in enumerate(rows):
        files.update({f"{base}/index{index}/level": f"{level}\n",
                      f"{base}/index{index}/type": f"{kind}\n",
                      f"{base}/index{index}/size": f"{size}\n"})
    return files


def _meminfo(total_kib: int, available_kib: int) -> dict[str, str]:
    free = available_kib - available_kib // 8
    return {"/proc/meminfo": (
        f"MemTotal:       {total_kib} kB\nMemFree:        {free} kB\n"
        f"MemAvailable:   {available_kib} kB\nBuffers:          204800 kB\n"
        f"Cached:         {available_kib // 8} kB\nSwapCached:            0 kB\n"
    )}


_V2_MOUNT = ("35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 "
             "- cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n")


def _cgroup_v2(path: str = "/", cpu_max: str = "max 100000", memory_max: str = "max",
               current: int | None = None, inactive_file: int = 0) -> dict[str, str]:
    files = {"/proc/self/cgroup": f"0::{path}\n", "/proc/self/mountinfo": _V2_MOUNT}
    base = "/sys/fs/cgroup" + ("" if path == "/" else path)
    files[f"{base}/cpu.max"] = cpu_max + "\n"
    files[f"{base}/memory.max"] = memory_max + "\n"
    if current is not None:
        files[f"{base}/memory.current"] = f"{current}\n"
        files[f"{base}/memory.stat"] = f"anon {current - inactive_file}\n" \
                                       f"file {inactive_file}\ninactive_file {inactive_file}\n"
    return files


def _cgroup_v1(path: str, quota_us: int, period_us: int, limit: int, usage: int,
               inactive_file: int) -> dict[str, str]:
    """A docker-style v1 hierarchy: the container's cgroup is the mount root."""
    mounts = (
        f"30 24 0:26 {path} /sys/fs/cgroup/cpu,cpuacct ro,nosuid,nodev,noexec,relatime master:11 "
        "- cgroup cgroup rw,cpu,cpuacct\n"
        f"31 24 0:27 {path} /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:15 "
        "- cgroup cgroup rw,memory\n"
        f"32 24 0:28 {path} /sys/fs/cgroup/cpuset ro,nosuid,nodev,noexec,relatime master:13 "
        "- cgroup cgroup rw,cpuset\n"
    )
    return {
        "/proc/self/cgroup": (f"12:cpuset:{path}\n11:memory:{path}\n"
                              f"4:cpu,cpuacct:{path}\n1:name=systemd:{path}\n0::/system.slice\n"),
        "/proc/self/mountinfo": mounts,
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": f"{quota_us}\n",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": f"{period_us}\n",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{limit}\n",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{usage}\n",
        "/sys/fs/cgroup/memory/memory.stat": (
            f"cache {inactive_file}\nrss {usage - inactive_file}\n"
            f"total_inactive_file {inactive_file}\n"),
    }


def _pci_device(addr: str, vendor: int, device: int, klass: int,
                driver: str | None = None, drm_card: int | None = None,
                extra: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Files and links of one PCI device (and its DRM card when a driver made one)."""
    base = f"/sys/bus/pci/devices/{addr}"
    files = {f"{base}/vendor": f"{vendor:#06x}\n", f"{base}/device": f"{device:#06x}\n",
             f"{base}/class": f"{klass:#08x}\n"}
    files.update({f"{base}/{k}": v for k, v in (extra or {}).items()})
    links = {}
    if driver is not None:
        links[f"{base}/driver"] = f"../../../../bus/pci/drivers/{driver}"
    if drm_card is not None:
        card = f"/sys/class/drm/card{drm_card}/device"
        files.update({k.replace(base, card): v for k, v in files.items() if k.startswith(base)})
        files[f"{card}/uevent"] = (f"DRIVER={driver}\nPCI_CLASS={klass:X}\n"
                                   f"PCI_ID={vendor:04X}:{device:04X}\nPCI_SLOT_NAME={addr}\n")
        if driver is not None:
            links[f"{card}/driver"] = f"../../../../bus/pci/drivers/{driver}"
    return files, links


def _merge(*parts: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in parts:
        out.update(part)
    return out


# --- readings ---------------------------------------------------------------------

_BASE_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc "
    "cpuid aperfmperf pni pclmulqdq monitor ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe "
    "popcnt aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch"
)
#: Sapphire Rapids (Xeon Platinum 8480+), /proc/cpuinfo flags.
SPR_FLAGS = _BASE_FLAGS + (
    " dts acpi ss tm pbe art arch_perfmon pebs bts tsc_known_freq dtes64 ds_cpl vmx smx est tm2"
    " sdbg xtpr pdcm dca tsc_deadline_timer cpuid_fault epb cat_l3 cat_l2 cdp_l3 invpcid_single"
    " intel_ppin cdp_l2 ssbd mba ibrs ibpb stibp ibrs_enhanced tpr_shadow flexpriority ept vpid"
    " ept_ad fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq"
    " rdseed adx smap avx512ifma clflushopt clwb intel_pt avx512cd sha_ni avx512bw avx512vl"
    " xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local"
    " split_lock_detect avx_vnni avx512_bf16 wbnoinvd dtherm ida arat pln pts hfi vnmi"
    " avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni"
    " avx512_bitalg tme avx512_vpopcntdq la57 rdpid bus_lock_detect cldemote movdiri movdir64b"
    " enqcmd fsrm md_clear serialize tsxldtrk pconfig arch_lbr ibt amx_bf16 avx512_fp16"
    " amx_tile amx_int8 flush_l1d arch_capabilities"
)
#: Cascade Lake (Xeon Gold 6230).
CLX_FLAGS = _BASE_FLAGS + (
    " arch_perfmon pebs bts tsc_deadline_timer invpcid_single ssbd mba ibrs ibpb stibp"
    " ibrs_enhanced fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm cqm mpx rdt_a"
    " avx512f avx512dq rdseed adx smap clflushopt clwb intel_pt avx512cd avx512bw avx512vl"
    " xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc dtherm ida arat pln pts pku ospke"
    " avx512_vnni md_clear flush_l1d arch_capabilities"
)
#: Zen 3 (EPYC 7763, Ryzen 7 5800X): AVX2, no AVX-512.
ZEN3_FLAGS = _BASE_FLAGS + (
    " mmxext fxsr_opt extd_apicid rapl cmp_legacy svm extapic cr8_legacy sse4a misalignsse osvw"
    " ibs skinit wdt tce topoext perfctr_core perfctr_nb bpext perfctr_llc mwaitx cpb cat_l3"
    " cdp_l3 invpcid_single hw_pstate ssbd mba ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep"
    " bmi2 erms invpcid cqm rdt_a rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1"
    " xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local clzero irperf xsaveerptr rdpru"
    " wbnoinvd arat npt lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid decodeassists"
    " pausefilter pfthreshold v_vmsave_vmload vgif v_spec_ctrl umip pku ospke vaes vpclmulqdq"
    " rdpid overflow_recov succor smca fsrm"
)
#: Zen 4 (Ryzen 9 7950X): Zen 3 plus AVX-512.
ZEN4_FLAGS = ZEN3_FLAGS + (
    " avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi"
    " avx512_vbmi2 gfni avx512_vnni avx512_bitalg avx512_vpopcntdq"
)
#: Cortex-A720 / A520 (Armv9.2) /proc/cpuinfo Features.
ARMV9_FEATURES = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma"
    " lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm sb paca pacg"
    " dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm"
    " bf16 dgh bti ecv afp wfxt"
)

_PCI_IDS = (
    "# excerpt of pci.ids (https://pci-ids.ucw.cz)\n"
    "1002  Advanced Micro Devices, Inc. [AMD/ATI]\n"
    "\t164e  Raphael\n"
    "\t740f  Aldebaran/MI200 [Instinct MI210]\n"
    "\t744c  Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]\n"
    "10de  NVIDIA Corporation\n"
    "\t2330  GH100 [H100 SXM5 80GB]\n"
    "\t24b0  GA104GL [RTX A4000]\n"
    "1a03  ASPEED Technology, Inc.\n"
    "\t2000  ASPEED Graphics Family\n"
)

_H100_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
_H100_MIB, _H100_FREE_MIB = 81559, 81008

H100_SMI_CSV = "".join(
    f"{i}, NVIDIA H100 80GB HBM3, {_H100_MIB}, {_H100_FREE_MIB}, 535.104.05, 9.0, "
    f"00000000:{bus.upper()}:00.0\n"
    for i, bus in enumerate(_H100_BUSES)
)

MI210_ROCM_SMI = json.dumps({
    **{f"card{i}": {
        "Card Series": "AMD Instinct MI210", "Card Model": "0x740f",
        "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]", "Card SKU": "D67301",
        "GFX Version": "gfx90a", "VRAM Total Memory (B)": "68702699520",
        "VRAM Total Used Memory (B)": "10960896", "PCI Bus": f"0000:{bus}:00.0",
    } for i, bus in enumerate(("63", "43"))},
    "system": {"Driver version": "6.3.6"},
})

M2_PRO_SYSCTL = """hw.ncpu: 12
hw.byteorder: 1234
hw.memsize: 34359738368
hw.activecpu: 12
hw.perflevel0.physicalcpu: 8
hw.perflevel1.physicalcpu: 4
hw.physicalcpu: 12
hw.physicalcpu_max: 12
hw.logicalcpu: 12
hw.logicalcpu_max: 12
hw.cputype: 16777228
hw.cpu64bit_capable: 1
hw.cachelinesize: 128
hw.l1dcachesize: 65536
hw.l2cachesize: 4194304
hw.tbfrequency: 24000000
hw.packages: 1
hw.optional.arm.FEAT_FlagM: 1
hw.optional.arm.FEAT_FP16: 1
hw.optional.arm.FEAT_DotProd: 1
hw.optional.arm.FEAT_BF16: 1
hw.optional.arm.FEAT_I8MM: 1
hw.optional.arm.FEAT_SME: 0
hw.optional.AdvSIMD: 1
hw.optional.AdvSIMD_HPFPCvt: 1
hw.optional.neon: 1
hw.optional.neon_hpfp: 1
hw.optional.neon_fp16: 1
hw.optional.armv8_crc32: 1
hw.optional.floatingpoint: 1
machdep.cpu.cores_per_package: 12
machdep.cpu.core_count: 12
machdep.cpu.logical_per_package: 12
machdep.cpu.thread_count: 12
machdep.cpu.brand_string: Apple M2 Pro
"""

M2_PRO_DISPLAYS = json.dumps({"SPDisplaysDataType": [{
    "_name": "Apple M2 Pro", "spdisplays_mtlgpufamilysupport": "spdisplays_metal3",
    "spdisplays_ndrvs": [{"_name": "Color LCD", "spdisplays_main": "spdisplays_yes"}],
    "spdisplays_vendor": "sppci_vendor_Apple", "sppci_bus": "spdisplays_builtin",
    "sppci_cores": "19", "sppci_device_type": "spdisplays_gpu", "sppci_model": "Apple M2 Pro",
}]}, indent=2)


# --- the machines -----------------------------------------------------------------


def _xeon_8480_host() -> dict[str, str]:
    return _merge(
        _x86_cpuinfo("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+", SPR_FLAGS,
                     sockets=2, cores=56, threads=2, mhz=2000.0),
        _caches("48K", "2048K", "107520K"),
        {"/sys/devices/system/cpu/cpu0/cpufreq/base_frequency": "2000000\n",
         "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq": "3800000\n",
         "/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq": "2000000\n"},
        _meminfo(2113521128, 2051234560),
        _cgroup_v2("/user.slice/user-1000.slice/session-3.scope"),
        {"/usr/share/hwdata/pci.ids": _PCI_IDS},
    )


def _aspeed_bmc() -> tuple[dict[str, str], dict[str, str]]:
    return _pci_device("0000:03:00.0", 0x1A03, 0x2000, 0x030000, driver="ast", drm_card=0)


def _h100_pci() -> tuple[dict[str, str], dict[str, str]]:
    files, links = {}, {}
    for bus in _H100_BUSES:
        f, ln = _pci_device(f"0000:{bus}:00.0", 0x10DE, 0x2330, 0x030200, driver="nvidia")
        files.update(f)
        links.update(ln)
    return files, links


def _x86_avx512_server() -> FakeMachine:
    bmc_files, bmc_links = _aspeed_bmc()
    return FakeMachine(
        name="x86-avx512-server", description="2x Xeon Platinum 8480+, 2 TiB, no GPU",
        system="Linux", machine="x86_64", release="6.5.0-35-generic", hostname="xeon-01",
        files=_merge(_xeon_8480_host(), bmc_files), links=bmc_links,
        affinity=frozenset(range(224)),
    )


def _h100_server(nvml: bool, temp: int = 35) -> FakeMachine:
    bmc_files, bmc_links = _aspeed_bmc()
    gpu_files, gpu_links = _h100_pci()
    modules: dict[str, Any] = {}
    if nvml:
        modules["pynvml"] = FakeNvml([
            {"name": "NVIDIA H100 80GB HBM3", "total": _H100_MIB * 1024**2,
             "free": _H100_FREE_MIB * 1024**2, "cc": (9, 0),
             "bus": f"00000000:{bus.upper()}:00.0", "util": 0, "temp": temp}
            for bus in _H100_BUSES
        ], driver="535.104.05")
    hot = temp != 35
    return FakeMachine(
        name="nvidia-h100-hot" if hot else "nvidia-h100-nvml" if nvml else "nvidia-h100-server",
        description="2x Xeon Platinum 8480+, 2 TiB, 8x H100 80GB HBM3 "
                    + ("(NVML)" if nvml else "(nvidia-smi)")
                    + (f", GPUs at {temp} C (slowdown at 87 C)" if hot else ""),
        system="Linux", machine="x86_64", release="5.15.0-105-generic", hostname="dgx-h100-01",
        files=_merge(_xeon_8480_host(), bmc_files, gpu_files), links={**bmc_links, **gpu_links},
        commands={} if nvml else {"nvidia-smi": H100_SMI_CSV},
        modules=modules, affinity=frozenset(range(224)),
    )


def _thermal_zone(kind: str, milli_c: int, passive_milli_c: int) -> dict[str, str]:
    base = "/sys/class/thermal/thermal_zone0"
    return {f"{base}/type": f"{kind}\n", f"{base}/temp": f"{milli_c}\n",
            f"{base}/trip_point_0_type": "passive\n",
            f"{base}/trip_point_0_temp": f"{passive_milli_c}\n",
            f"{base}/trip_point_1_type": "critical\n", f"{base}/trip_point_1_temp": "105000\n"}


def _edge_arm_board(hot: bool = False) -> FakeMachine:
    parts = [0xD80] * 4 + [0xD81] * 4        # 4x Cortex-A520 + 4x Cortex-A720
    mali = {"/sys/class/drm/card0/device/uevent": "DRIVER=panthor\nOF_NAME=gpu\n"}
    zone = _thermal_zone("cpu-thermal", 86500 if hot else 48000, 85000)
    return FakeMachine(
        name="edge-arm-board-hot" if hot else "edge-arm-board",
        description="8-core Cortex-A720/A520 board (SVE2), 4 GiB, no GPU"
                    + (", CPU at 86.5 C over its 85 C passive trip point" if hot else ""),
        system="Linux", machine="aarch64", release="6.6.10-arm64", hostname="edge-board",
        files=_merge(
            _arm_cpuinfo(parts, ARMV9_FEATURES),
            {"/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq": "1800000\n",
             "/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq": "1200000\n"},
            _meminfo(3930124, 3124556), _cgroup_v2("/user.slice"), mali, zone,
        ),
        links={"/sys/class/drm/card0/device/driver": "../../../bus/platform/drivers/panthor"},
        affinity=frozenset(range(8)),
    )


def _ryzen_5800x_host() -> dict[str, str]:
    return _merge(
        _x86_cpuinfo("AuthenticAMD", 25, 33, "AMD Ryzen 7 5800X 8-Core Processor", ZEN3_FLAGS,
                     sockets=1, cores=8, threads=2, mhz=3800.0),
        _caches("32K", "512K", "32768K"),
        _meminfo(32763636, 28641220),
    )


def _container_v2() -> FakeMachine:
    return FakeMachine(
        name="container-2core-1gib", description="container: cgroup v2 quota 2 cores, 1 GiB",
        system="Linux", machine="x86_64", release="6.8.0-31-generic", hostname="3f2a9c1e7b44",
        files=_merge(_ryzen_5800x_host(), _cgroup_v2(
            "/", cpu_max="200000 100000", memory_max=str(GIB),
            current=300 * 1024**2, inactive_file=50 * 1024**2)),
        affinity=frozenset(range(16)),
    )


def _container_v1() -> FakeMachine:
    path = "/docker/9d2f0c7a1b3e"
    host = _merge(
        _x86_cpuinfo("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz",
                     CLX_FLAGS, sockets=2, cores=20, threads=2, mhz=2100.0),
        _caches("32K", "1024K", "28160K"),
        _meminfo(196608000, 180224000),
    )
    return FakeMachine(
        name="container-v1-2core-1gib",
        description="container: cgroup v1 quota 2 cores, 1 GiB, cpuset of 8 CPUs",
        system="Linux", machine="x86_64", release="4.18.0-513.el8.x86_64", hostname="9d2f0c7a1b3e",
        files=_merge(host, _cgroup_v1(path, 200000, 100000, GIB, 400 * 1024**2, 100 * 1024**2)),
        affinity=frozenset(range(8)),
    )


def _amd_sysfs_only() -> FakeMachine:
    dgpu, dlinks = _pci_device("0000:03:00.0", 0x1002, 0x744C, 0x030000, driver="amdgpu",
                               drm_card=0, extra={"mem_info_vram_total": "25753026560\n",
                                                  "mem_info_vram_used": "1073741824\n"})
    igpu, ilinks = _pci_device("0000:10:00.0", 0x1002, 0x164E, 0x030000, driver="amdgpu",
                               drm_card=1, extra={"mem_info_vram_total": "536870912\n",
                                                  "mem_info_vram_used": "104857600\n"})
    return FakeMachine(
        name="amd-sysfs-only",
        description="Ryzen 9 7950X desktop, Radeon RX 7900 XTX seen only through sysfs",
        system="Linux", machine="x86_64", release="6.8.0-31-generic", hostname="ryzen-desk",
        files=_merge(
            _x86_cpuinfo("AuthenticAMD", 25, 97, "AMD Ryzen 9 7950X 16-Core Processor",
                         ZEN4_FLAGS, sockets=1, cores=16, threads=2, mhz=4500.0),
            _caches("32K", "1024K", "32768K"),
            {"/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq": "5881000\n"},
            _meminfo(65536000, 60123000), _cgroup_v2("/user.slice"),
            {"/usr/share/misc/pci.ids": _PCI_IDS}, dgpu, igpu,
        ),
        links={**dlinks, **ilinks}, affinity=frozenset(range(32)),
    )


def _nvidia_no_driver() -> FakeMachine:
    gpu, links = _pci_device("0000:01:00.0", 0x10DE, 0x24B0, 0x030000)
    return FakeMachine(
        name="nvidia-no-driver",
        description="Ryzen 7 5800X workstation, RTX A4000 on PCI with no driver bound",
        system="Linux", machine="x86_64", release="6.8.0-31-generic", hostname="ws-01",
        files=_merge(_ryzen_5800x_host(), _cgroup_v2("/user.slice"),
                     {"/usr/share/hwdata/pci.ids": _PCI_IDS}, gpu),
        links=links, affinity=frozenset(range(16)),
    )


def _amd_rocm_server() -> FakeMachine:
    files, links = {}, {}
    for i, bus in enumerate(("63", "43")):
        f, ln = _pci_device(f"0000:{bus}:00.0", 0x1002, 0x740F, 0x038000, driver="amdgpu",
                            drm_card=i + 1, extra={"mem_info_vram_total": "68702699520\n"})
        files.update(f)
        links.update(ln)
    return FakeMachine(
        name="amd-rocm-server", description="EPYC 7763, 512 GiB, 2x Instinct MI210 (rocm-smi)",
        system="Linux", machine="x86_64", release="5.15.0-105-generic", hostname="mi210-01",
        files=_merge(
            _x86_cpuinfo("AuthenticAMD", 25, 1, "AMD EPYC 7763 64-Core Processor", ZEN3_FLAGS,
                         sockets=1, cores=64, threads=2, mhz=2450.0),
            _meminfo(528281600, 515000000), _cgroup_v2("/"), files,
        ),
        links=links, commands={"rocm-smi": MI210_ROCM_SMI}, affinity=frozenset(range(128)),
    )


def _apple_m2_pro() -> FakeMachine:
    return FakeMachine(
        name="apple-m2-pro", description="MacBook Pro, Apple M2 Pro, 32 GiB unified memory",
        system="Darwin", machine="arm64", release="23.4.0", hostname="macbook-pro",
        commands={"sysctl hw machdep.cpu": M2_PRO_SYSCTL,
                  "sysctl -n hw.memsize": "34359738368\n",
                  "sysctl -n machdep.cpu.brand_string": "Apple M2 Pro\n",
                  "system_profiler": M2_PRO_DISPLAYS},
        modules={"psutil": FakePsutil(total=32 * GIB, available=17 * GIB, logical=12,
                                      physical=12, freq=None, affinity=None)},
    )


def _windows_rtx4090() -> FakeMachine:
    return FakeMachine(
        name="windows-rtx4090", description="Windows 11, Core i9-13900K, 64 GiB, RTX 4090",
        system="Windows", machine="AMD64", release="10", hostname="GAMING-PC",
        env={"PROCESSOR_IDENTIFIER": "Intel64 Family 6 Model 183 Stepping 1, GenuineIntel",
             "PROCESSOR_ARCHITECTURE": "AMD64", "NUMBER_OF_PROCESSORS": "32"},
        registry={"ProcessorNameString": "13th Gen Intel(R) Core(TM) i9-13900K",
                  "VendorIdentifier": "GenuineIntel", "~MHz": 2995},
        win_features=frozenset({6, 10, 13, 36, 37, 38, 39, 40}),
        commands={"nvidia-smi": "0, NVIDIA GeForce RTX 4090, 24564, 22983, 546.33, 8.9, "
                                "00000000:01:00.0\n"},
        modules={"psutil": FakePsutil(total=64 * GIB, available=48 * GIB, logical=32,
                                      physical=24, freq=(2995.0, 0.0, 2995.0),
                                      affinity=range(32))},
    )


def _tpu_vm() -> FakeMachine:
    files, links = {}, {}
    for i in range(4):
        files[f"/dev/accel{i}"] = ""
        files[f"/sys/class/accel/accel{i}/device/vendor"] = "0x1ae0\n"
        links[f"/sys/class/accel/accel{i}/device/driver"] = "../../../bus/pci/drivers/vfio-pci"
    return FakeMachine(
        name="tpu-v5e-vm", description="Cloud TPU v5e VM: 4 chips on /dev/accel*, TPU env vars",
        system="Linux", machine="x86_64", release="6.5.0-1013-gcp", hostname="t1v-n-4c1d2e3f-w-0",
        files=_merge(
            _x86_cpuinfo("AuthenticAMD", 25, 1, "AMD EPYC 7B13", ZEN3_FLAGS,
                         sockets=1, cores=56, threads=2, mhz=2450.0),
            _meminfo(197632000, 190000000), _cgroup_v2("/"), files,
        ),
        links=links,
        env={"TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_NAME": "my-tpu",
             "TPU_VISIBLE_DEVICES": "0,1,2,3"},
        affinity=frozenset(range(112)),
    )


def _inferentia() -> FakeMachine:
    return FakeMachine(
        name="inferentia-inf2", description="AWS inf2.xlarge: 4 vCPU, 16 GiB, one Inferentia2",
        system="Linux", machine="x86_64", release="6.1.72-96.166.amzn2023.x86_64",
        hostname="ip-10-0-1-23",
        files=_merge(
            _x86_cpuinfo("AuthenticAMD", 25, 1, "AMD EPYC 7R13 Processor", ZEN3_FLAGS,
                         sockets=1, cores=2, threads=2, mhz=2650.0),
            _meminfo(15950000, 14800000), _cgroup_v2("/"), {"/dev/neuron0": ""},
        ),
        env={"NEURON_RT_VISIBLE_CORES": "0-1"}, affinity=frozenset(range(4)),
    )


#: name -> builder of that fake machine
FAKE_MACHINES: dict[str, Callable[[], FakeMachine]] = {
    "x86-avx512-server": _x86_avx512_server,
    "nvidia-h100-server": lambda: _h100_server(nvml=False),
    "nvidia-h100-nvml": lambda: _h100_server(nvml=True),
    "nvidia-h100-hot": lambda: _h100_server(nvml=True, temp=85),
    "edge-arm-board": _edge_arm_board,
    "edge-arm-board-hot": lambda: _edge_arm_board(hot=True),
    "container-2core-1gib": _container_v2,
    "container-v1-2core-1gib": _container_v1,
    "amd-sysfs-only": _amd_sysfs_only,
    "nvidia-no-driver": _nvidia_no_driver,
    "amd-rocm-server": _amd_rocm_server,
    "apple-m2-pro": _apple_m2_pro,
    "windows-rtx4090": _windows_rtx4090,
    "tpu-v5e-vm": _tpu_vm,
    "inferentia-inf2": _inferentia,
}


def fake_machine(name: str) -> FakeMachine:
    """The named fake machine; see the module docstring for the list."""
    builder = FAKE_MACHINES.get(name)
    if builder is None:
        raise InvalidArgumentError(
            f"unknown fake machine {name!r}; known: {', '.join(FAKE_MACHINES)}"
        )
    return builder()


def fake_profile(name: str) -> HardwareProfile:
    """The HardwareProfile that probing the named fake machine gives."""
    return fake_machine(name).profile()
