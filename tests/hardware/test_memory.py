"""Memory probe: totals, cgroup v1/v2 limits and what is effectively available."""

from __future__ import annotations

import platform
from collections.abc import Mapping

import pytest

from keel.hardware import probe
from keel.hardware.fakes import GIB, fake_machine
from keel.hardware.memory import probe_memory
from keel.hardware.sources import CommandResult, MemoryFiles, PlatformInfo, ProbeSources

MIB = 1024**2


def _with(name: str, files: Mapping[str, str] | None = None, **kw: object) -> ProbeSources:
    machine = fake_machine(name)
    return machine.sources(files=MemoryFiles({**machine.files, **(files or {})}), **kw)


@pytest.mark.skipif(platform.system() != "Linux", reason="compares with /proc/meminfo")
def test_this_machine_memory_matches_psutil_and_respects_its_cgroup() -> None:
    import psutil

    mem = probe().memory
    assert mem.total_bytes == psutil.virtual_memory().total
    assert mem.available_bytes is not None and 0 < mem.available_bytes <= mem.total_bytes
    assert mem.effective_limit_bytes is not None
    assert mem.effective_limit_bytes <= mem.total_bytes
    if mem.cgroup_limit_bytes is None:
        assert any(n.startswith("cgroup_limit_bytes:") for n in mem.notes)
    else:
        assert mem.effective_limit_bytes <= mem.cgroup_limit_bytes


@pytest.mark.parametrize(("name", "usage", "inactive"), [
    ("container-2core-1gib", 300 * MIB, 50 * MIB),
    ("container-v1-2core-1gib", 400 * MIB, 100 * MIB),
])
def test_cgroup_memory_limit_of_one_gib_is_respected(name: str, usage: int,
                                                     inactive: int) -> None:
    mem = fake_machine(name).profile().memory
    assert mem.total_bytes is not None and mem.total_bytes > 16 * GIB
    assert mem.cgroup_limit_bytes == GIB
    assert mem.effective_limit_bytes == GIB
    assert mem.effective_available_bytes == GIB - (usage - inactive)
    assert mem.effective_limit_gib == pytest.approx(1.0)
    assert "cgroup" in mem.source


def test_v1_unlimited_sentinel_is_no_limit() -> None:
    src = _with("container-v1-2core-1gib",
                {"/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"})
    mem = probe_memory(src)
    assert mem.cgroup_limit_bytes is None
    assert mem.effective_limit_bytes == mem.total_bytes
    assert any("sets no memory limit" in n for n in mem.notes)


def test_nested_v2_limits_take_the_tightest_level() -> None:
    src = _with("container-2core-1gib", {
        "/proc/self/cgroup": "0::/kubepods/pod1\n",
        "/sys/fs/cgroup/kubepods/pod1/memory.max": "max\n",
        "/sys/fs/cgroup/kubepods/memory.max": str(512 * MIB) + "\n",
        "/sys/fs/cgroup/memory.max": "max\n",
    })
    mem = probe_memory(src)
    assert mem.cgroup_limit_bytes == 512 * MIB
    assert any("cgroup usage is unreadable" in n for n in mem.notes)  # leaf has no usage file


def test_proc_meminfo_is_read_in_kib() -> None:
    mem = fake_machine("edge-arm-board").profile().memory
    assert (mem.total_bytes, mem.available_bytes) == (3930124 * 1024, 3124556 * 1024)
    assert mem.total_gib == pytest.approx(3.748, abs=1e-3)
    assert mem.source == "/proc/meminfo"


def test_nothing_readable_gives_nones_with_reasons() -> None:
    src = ProbeSources(files=MemoryFiles({}), platform=PlatformInfo("Linux", "x86_64"),
                       importer=lambda name: (None, "psutil absent"))
    mem = probe_memory(src)
    assert mem.total_bytes is None and mem.effective_limit_bytes is None
    for name in ("total_bytes", "available_bytes", "cgroup_limit_bytes",
                 "effective_limit_bytes", "effective_available_bytes"):
        assert any(n.startswith(f"{name}:") for n in mem.notes), name


def test_macos_without_psutil_reads_sysctl_memsize() -> None:
    machine = fake_machine("apple-m2-pro")
    mem = probe_memory(machine.sources(importer=lambda name: (None, "psutil absent")))
    assert mem.total_bytes == 32 * GIB and mem.source == "sysctl"
    assert mem.available_bytes is None
    assert any(n.startswith("available_bytes:") for n in mem.notes)


def test_macos_with_failing_sysctl_reports_why() -> None:
    machine = fake_machine("apple-m2-pro")
    src = machine.sources(importer=lambda name: (None, "psutil absent"),
                          runner=lambda argv, t: CommandResult(False, reason="no sysctl"))
    mem = probe_memory(src)
    assert mem.total_bytes is None
    assert any("no sysctl" in n for n in mem.notes if n.startswith("total_bytes:"))


def test_windows_memory_from_psutil() -> None:
    mem = fake_machine("windows-rtx4090").profile().memory
    assert (mem.total_bytes, mem.available_bytes) == (64 * GIB, 48 * GIB)
    assert mem.source == "psutil" and mem.cgroup_limit_bytes is None
