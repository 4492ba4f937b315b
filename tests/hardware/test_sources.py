"""Probe sources: file trees, commands, cgroup location, parsing helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from keel.hardware.sources import (
    DirectoryFiles,
    MemoryFiles,
    ProbeSources,
    cgroup_dirs,
    parse_cpu_list,
    parse_key_values,
    run_command,
    to_float,
    to_int,
)


def test_memory_files_read_list_link_exists() -> None:
    fs = MemoryFiles({"/a/b/c.txt": "x", "/a/d": "y"}, links={"/a/e": "../z"})
    assert fs.read_text("/a/b/c.txt") == "x"
    assert fs.read_text("a/b/c.txt") == "x"            # leading slash optional
    assert fs.read_text("/missing") is None
    assert fs.listdir("/a") == ["b", "d", "e"]
    assert fs.listdir("/nope") == []
    assert fs.readlink("/a/e") == "../z"
    assert fs.exists("/a/b") and fs.exists("/a/d") and not fs.exists("/a/x")


def test_directory_files_read_the_tree_memory_files_write(tmp_path: Path) -> None:
    tree = MemoryFiles({"/proc/cpuinfo": "processor\t: 0\n", "/sys/x/y": "1\n"},
                       links={"/sys/x/driver": "../../drivers/amdgpu"})
    tree.write_tree(tmp_path)
    fs = DirectoryFiles(tmp_path)
    assert fs.read_text("/proc/cpuinfo") == "processor\t: 0\n"
    assert fs.listdir("/sys/x") == ["driver", "y"]
    assert fs.readlink("/sys/x/driver") == "../../drivers/amdgpu"
    assert fs.read_text("/nope") is None and fs.listdir("/nope") == []


def test_run_command_reports_missing_failing_and_slow_programs() -> None:
    missing = run_command(["keel-no-such-program-xyz"])
    assert not missing.ok and "not found on PATH" in missing.reason
    ok = run_command([sys.executable, "-c", "print('hi')"])
    assert ok.ok and ok.output.strip() == "hi"
    failing = run_command([sys.executable, "-c", "import sys; sys.exit('boom')"])
    assert not failing.ok and "exited with 1" in failing.reason and "boom" in failing.reason
    slow = run_command([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.3)
    assert not slow.ok and "did not answer" in slow.reason


def test_a_runner_that_raises_is_a_failed_source() -> None:
    def broken(argv: object, timeout: float) -> object:
        raise RuntimeError("runner exploded")

    src = ProbeSources(runner=broken)  # type: ignore[arg-type]
    answer = src.run("nvidia-smi")
    assert not answer.ok and "runner exploded" in answer.reason


@pytest.mark.parametrize(("text", "expected"), [
    ("0-3", {0, 1, 2, 3}), ("0,2,4-5\n", {0, 2, 4, 5}), ("7", {7}), ("", set()),
])
def test_parse_cpu_list(text: str, expected: set[int]) -> None:
    assert parse_cpu_list(text) == frozenset(expected)


@pytest.mark.parametrize("text", ["3-1", "a-b", "1-"])
def test_parse_cpu_list_rejects_malformed_lists(text: str) -> None:
    assert parse_cpu_list(text) is None


def test_number_and_key_value_helpers() -> None:
    assert to_int("0x10de\n") == 0x10DE and to_int(" 42 ") == 42 and to_int("-1") == -1
    assert to_int("max") is None and to_int(None) is None and to_int(True) is None
    assert to_float("2596.124") == pytest.approx(2596.124) and to_float("x") is None
    assert parse_key_values("a : 1\nb: 2\na: 3\nnoise") == {"a": "1", "b": "2"}


def _sources(files: dict[str, str]) -> ProbeSources:
    return ProbeSources(files=MemoryFiles(files))


def test_cgroup_v2_dirs_walk_from_the_process_cgroup_to_the_root() -> None:
    src = _sources({
        "/proc/self/cgroup": "0::/user.slice/app.scope\n",
        "/proc/self/mountinfo": "35 24 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
    })
    dirs, why = cgroup_dirs(src, "memory")
    assert dirs is not None and why == ""
    assert dirs.version == "v2"
    assert dirs.dirs == ("/sys/fs/cgroup/user.slice/app.scope", "/sys/fs/cgroup/user.slice",
                         "/sys/fs/cgroup")


def test_cgroup_v1_wins_on_hybrid_hosts_and_honours_the_mount_root() -> None:
    src = _sources({
        "/proc/self/cgroup": "4:memory:/docker/abc/inner\n1:cpu,cpuacct:/docker/abc\n0::/\n",
        "/proc/self/mountinfo": (
            "31 24 0:27 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
            "32 24 0:26 / /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n"
            "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        ),
    })
    memory, _ = cgroup_dirs(src, "memory")
    assert memory is not None and memory.version == "v1"
    assert memory.dirs == ("/sys/fs/cgroup/memory/inner", "/sys/fs/cgroup/memory")
    cpu, _ = cgroup_dirs(src, "cpu")
    assert cpu is not None
    assert cpu.dirs == ("/sys/fs/cgroup/cpu,cpuacct/docker/abc",
                        "/sys/fs/cgroup/cpu,cpuacct/docker", "/sys/fs/cgroup/cpu,cpuacct")


def test_cgroup_dirs_say_why_when_there_is_no_cgroup_file() -> None:
    dirs, why = cgroup_dirs(_sources({}), "cpu")
    assert dirs is None and "/proc/self/cgroup" in why
