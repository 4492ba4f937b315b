"""CPU probe: identity, cores (affinity and cgroup quota), frequencies and SIMD."""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Mapping
from typing import Any

import pytest

from keel.hardware import probe
from keel.hardware.cpu import (
    ARM_FEATURES,
    X86_FEATURES,
    normalize_arch,
    probe_cpu,
    simd_from_flags,
    simd_level,
)
from keel.hardware.fakes import SPR_FLAGS, FakePsutil, fake_machine
from keel.hardware.memory import probe_memory
from keel.hardware.sources import MemoryFiles, PlatformInfo, ProbeSources

ON_LINUX = platform.system() == "Linux"


def _cpuinfo_flags() -> tuple[set[str], Mapping[str, str]]:
    """This machine's /proc/cpuinfo flag set and the table that maps it."""
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return set(value.split()), X86_FEATURES
            if key.strip() == "Features":
                return set(value.split()), ARM_FEATURES
    pytest.skip("this machine's /proc/cpuinfo lists no flags/Features line")


@pytest.mark.skipif(not ON_LINUX, reason="reads /proc/cpuinfo, which only Linux has")
def test_simd_flags_agree_with_this_machines_proc_cpuinfo() -> None:
    flags, table = _cpuinfo_flags()
    cpu = probe().cpu
    expected = {table[f] for f in flags if f in table}
    assert set(cpu.simd) == expected
    assert cpu.simd_level == simd_level(expected)
    assert cpu.has("avx2") == ("avx2" in flags)
    assert cpu.has("avx512f") == ("avx512f" in flags)
    assert cpu.simd_source.startswith("/proc/cpuinfo")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity API here")
def test_this_machine_uses_its_affinity_mask() -> None:
    cpu = probe().cpu
    mask = os.sched_getaffinity(0)
    assert cpu.affinity_cores == len(mask)
    assert cpu.usable_cores is not None and cpu.usable_cores <= len(mask)


def test_x86_avx512_server_features_level_and_topology() -> None:
    cpu = fake_machine("x86-avx512-server").profile().cpu
    assert (cpu.vendor, cpu.brand) == ("Intel", "Intel(R) Xeon(R) Platinum 8480+")
    assert cpu.architecture == "x86_64"
    assert (cpu.logical_cores, cpu.physical_cores, cpu.usable_cores) == (224, 112, 224)
    for feature in ("sse4.2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vnni",
                    "avx512bf16", "avx512fp16", "amx-tile", "amx-int8", "amx-bf16"):
        assert cpu.has(feature), feature
    assert not cpu.has("neon") and not cpu.has("sve")
    assert cpu.simd_level == "avx512"
    assert set(cpu.simd) == {X86_FEATURES[f] for f in SPR_FLAGS.split() if f in X86_FEATURES}
    assert (cpu.base_frequency_mhz, cpu.max_frequency_mhz) == (2000.0, 3800.0)


def test_arm_board_maps_asimd_and_sve_to_neon_and_sve() -> None:
    cpu = fake_machine("edge-arm-board").profile().cpu
    assert cpu.architecture == "aarch64"
    assert cpu.vendor == "ARM" and cpu.brand == "ARM Cortex-A520 + Cortex-A720"
    assert {"neon", "sve", "sve2", "i8mm", "bf16", "dotprod", "fp16"} <= set(cpu.simd)
    assert not cpu.has("avx2")
    assert cpu.simd_level == "sve2"
    assert (cpu.logical_cores, cpu.physical_cores) == (8, 8)
    assert cpu.max_frequency_mhz == 1800.0 and cpu.current_frequency_mhz == 1200.0


@pytest.mark.parametrize(("features", "level"), [
    ((), "scalar"), (("sse", "sse2"), "sse2"), (("sse2", "sse4.2"), "sse4.2"),
    (("sse4.2", "avx"), "avx"), (("avx", "avx2", "fma"), "avx2"),
    (("avx2", "avx512f", "amx-tile"), "avx512"), (("neon",), "neon"),
    (("neon", "sve"), "sve"), (("neon", "sve", "sve2"), "sve2"),
])
def test_simd_level_is_the_widest_present(features: tuple[str, ...], level: str) -> None:
    assert simd_level(features) == level


def test_simd_from_flags_normalises_and_orders() -> None:
    assert simd_from_flags(["avx512_vnni", "sse4_2", "pni", "junk"], X86_FEATURES) == (
        "sse3", "sse4.2", "avx512vnni")
    assert simd_from_flags(["asimd", "fp", "sve"], ARM_FEATURES) == ("neon", "sve")
    assert simd_from_flags(["neon", "vfpv4"], ARM_FEATURES) == ("neon",)   # 32-bit ARM


@pytest.mark.parametrize(("raw", "norm"), [
    ("x86_64", "x86_64"), ("AMD64", "x86_64"), ("arm64", "aarch64"), ("aarch64", "aarch64"),
    ("armv7l", "arm"), ("i686", "x86"), ("ppc64le", "ppc64le"), ("", None),
])
def test_normalize_arch(raw: str, norm: str | None) -> None:
    assert normalize_arch(raw) == norm


@pytest.mark.parametrize("name", ["container-2core-1gib", "container-v1-2core-1gib"])
def test_cgroup_cpu_quota_of_two_cores_caps_usable_cores(name: str) -> None:
    cpu = fake_machine(name).profile().cpu
    assert cpu.cgroup_cpu_quota == 2.0
    assert cpu.usable_cores == 2
    assert cpu.logical_cores is not None and cpu.logical_cores > 2


def _with(name: str, files: Mapping[str, str] | None = None, **overrides: object) -> ProbeSources:
    machine = fake_machine(name)
    merged = {**machine.files, **(files or {})}
    return machine.sources(files=MemoryFiles(merged, machine.links), **overrides)


def test_affinity_mask_caps_usable_cores_without_a_quota() -> None:
    src = _with("x86-avx512-server", affinity=lambda: frozenset({0, 1, 2}))
    cpu = probe_cpu(src)
    assert (cpu.affinity_cores, cpu.usable_cores, cpu.cgroup_cpu_quota) == (3, 3, None)
    assert any(n.startswith("cgroup_cpu_quota:") for n in cpu.notes)


@pytest.mark.parametrize(("cpu_max", "usable"), [("150000 100000", 2), ("50000 100000", 1)])
def test_fractional_quotas_round_up(cpu_max: str, usable: int) -> None:
    src = _with("container-2core-1gib", {"/sys/fs/cgroup/cpu.max": cpu_max + "\n"})
    assert probe_cpu(src).usable_cores == usable


def test_the_tightest_level_of_a_nested_cgroup_v2_quota_wins() -> None:
    src = _with("container-2core-1gib", {
        "/proc/self/cgroup": "0::/kubepods/pod1\n",
        "/sys/fs/cgroup/kubepods/pod1/cpu.max": "400000 100000\n",
        "/sys/fs/cgroup/kubepods/cpu.max": "100000 100000\n",
        "/sys/fs/cgroup/cpu.max": "max 100000\n",
    })
    cpu = probe_cpu(src)
    assert cpu.cgroup_cpu_quota == 1.0 and cpu.usable_cores == 1


def test_brand_string_gives_the_base_frequency_when_cpufreq_does_not() -> None:
    cpu = fake_machine("container-v1-2core-1gib").profile().cpu
    assert cpu.brand == "Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz"
    assert cpu.base_frequency_mhz == pytest.approx(2100.0)
    assert cpu.affinity_cores == 8 and cpu.usable_cores == 2


def test_macos_cpu_from_sysctl() -> None:
    cpu = fake_machine("apple-m2-pro").profile().cpu
    assert (cpu.vendor, cpu.brand, cpu.architecture) == ("Apple", "Apple M2 Pro", "aarch64")
    assert (cpu.logical_cores, cpu.physical_cores, cpu.usable_cores) == (12, 12, 12)
    assert set(cpu.simd) == {"neon", "fp16", "dotprod", "i8mm", "bf16"}
    assert cpu.simd_level == "neon" and cpu.simd_source == "sysctl hw.optional"
    assert cpu.affinity_cores is None
    assert any(n.startswith("affinity_cores:") for n in cpu.notes)


def test_macos_without_sysctl_records_why() -> None:
    machine = fake_machine("apple-m2-pro")
    cpu = probe_cpu(machine.sources(runner=lambda argv, t: __import__(
        "keel.hardware.sources", fromlist=["CommandResult"]).CommandResult(False, reason="gone")))
    assert cpu.brand is None
    assert any(n.startswith("sysctl: gone") for n in cpu.notes)
    assert any(n.startswith("brand:") for n in cpu.notes)


def test_windows_cpu_from_registry_features_and_psutil() -> None:
    cpu = fake_machine("windows-rtx4090").profile().cpu
    assert cpu.brand == "13th Gen Intel(R) Core(TM) i9-13900K" and cpu.vendor == "Intel"
    assert cpu.architecture == "x86_64"
    assert (cpu.logical_cores, cpu.physical_cores, cpu.affinity_cores) == (32, 24, 32)
    assert cpu.base_frequency_mhz == 2995.0
    assert cpu.has("avx2") and not cpu.has("avx512f") and cpu.simd_level == "avx2"
    assert cpu.simd_source == "IsProcessorFeaturePresent"


def test_windows_falls_back_to_processor_identifier_and_env() -> None:
    machine = fake_machine("windows-rtx4090")
    src = machine.sources(registry=lambda key, value: None, win_feature=lambda f: None,
                          importer=lambda name: (None, f"{name} missing"))
    cpu = probe_cpu(src)
    assert cpu.brand == "Intel64 Family 6 Model 183 Stepping 1, GenuineIntel"
    assert cpu.vendor == "Intel" and cpu.logical_cores == 32
    assert cpu.physical_cores is None and cpu.simd == ()
    notes = "\n".join(cpu.notes)
    assert "simd: IsProcessorFeaturePresent is not callable" in notes
    assert "physical_cores:" in notes and "psutil: psutil missing" in notes


def test_unknown_platform_is_explained_not_guessed() -> None:
    src = ProbeSources(files=MemoryFiles({}), platform=PlatformInfo("Plan9", "mips"),
                       importer=lambda name: (None, "absent"), affinity=lambda: None)
    cpu = probe_cpu(src)
    assert cpu.architecture == "mips" and cpu.logical_cores is None and cpu.simd == ()
    assert any("no CPU reader for platform 'Plan9'" in n for n in cpu.notes)
    missing = [f.name for f in dataclasses.fields(cpu) if getattr(cpu, f.name) is None]
    assert missing and all(any(n.startswith(f"{m}:") for n in cpu.notes) for m in missing)


def _psutil_importer(asked: list[str]) -> Any:
    fake = FakePsutil(total=1, available=1, logical=224, physical=100,
                      freq=(1234.0, 800.0, 4100.0), affinity=None)

    def importer(name: str) -> tuple[Any, str]:
        asked.append(name)
        return (fake, "") if name == "psutil" else (None, "absent")

    return importer


def test_linux_reads_proc_and_sysfs_without_importing_psutil() -> None:
    # psutil reads the same files on Linux; importing it is ~8 ms of a fresh process.
    asked: list[str] = []
    src = _with("x86-avx512-server", importer=_psutil_importer(asked))
    cpu = probe_cpu(src)
    assert cpu.physical_cores == 112 and cpu.logical_cores == 224   # sysfs, not psutil's 100
    assert cpu.base_frequency_mhz == 2000.0   # only cpufreq knows the base
    assert probe_memory(src).source.startswith("/proc/meminfo")
    assert "psutil" not in asked


def test_psutil_answers_where_the_linux_files_cannot_be_read() -> None:
    asked: list[str] = []
    src = ProbeSources(files=MemoryFiles({}), platform=PlatformInfo("Linux", "x86_64"),
                       importer=_psutil_importer(asked), affinity=lambda: frozenset())
    cpu = probe_cpu(src)
    assert (cpu.logical_cores, cpu.physical_cores) == (224, 100)
    assert (cpu.max_frequency_mhz, cpu.current_frequency_mhz) == (4100.0, 1234.0)
    assert probe_memory(src).source.startswith("psutil") and "psutil" in asked
