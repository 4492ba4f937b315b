"""The whole probe: never raises, fast, every field read or explained, round-trips."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

import keel
from keel.errors import InvalidArgumentError
from keel.hardware import detect_devices, probe, unexplained_fields
from keel.hardware.fakes import FAKE_MACHINES, fake_machine, fake_profile
from keel.hardware.profile import CpuInfo, HardwareProfile
from keel.hardware.sources import DirectoryFiles, MemoryFiles, PlatformInfo, ProbeSources


def test_probe_of_this_machine_is_fast_complete_and_timed() -> None:
    start = time.perf_counter()
    profile = probe()
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0
    assert profile.probe_seconds is not None and 0 < profile.probe_seconds <= elapsed
    assert unexplained_fields(profile) == []
    assert profile.cpu.logical_cores and profile.memory.total_bytes
    assert keel.probe is probe


@pytest.mark.parametrize("name", sorted(FAKE_MACHINES))
def test_every_fake_fills_or_explains_every_field(name: str) -> None:
    profile = fake_profile(name)
    assert unexplained_fields(profile) == []
    assert profile.probe_seconds == 0.0            # fakes run on a frozen clock
    assert profile == fake_profile(name)           # deterministic


@pytest.mark.parametrize("name", sorted(FAKE_MACHINES))
def test_profiles_round_trip_through_json_and_yaml(name: str) -> None:
    profile = fake_profile(name)
    assert HardwareProfile.from_json(profile.to_json()) == profile
    assert HardwareProfile.from_yaml(profile.to_yaml()) == profile


def test_this_machines_profile_round_trips(tmp_path: Path) -> None:
    profile = probe()
    assert HardwareProfile.from_json(profile.to_json()) == profile
    saved = tmp_path / "hw.yaml"
    saved.write_text(profile.to_yaml())
    assert HardwareProfile.load(str(saved)) == profile


def test_unexplained_fields_finds_a_silent_none() -> None:
    silent = HardwareProfile(cpu=CpuInfo(vendor=None, notes=()))
    assert "cpu.vendor" in unexplained_fields(silent)
    assert "hostname" in unexplained_fields(silent)


def test_loading_a_bad_profile_names_the_key() -> None:
    data: dict[str, Any] = fake_profile("edge-arm-board").to_dict()
    data["cpu"]["cores"] = 4
    with pytest.raises(InvalidArgumentError, match=r"unknown key 'cores' in profile\.cpu"):
        HardwareProfile.from_json(json.dumps(data))


class _ExplodingFiles:
    def read_text(self, path: str) -> str | None:
        raise OSError(f"I/O error reading {path}")

    def listdir(self, path: str) -> list[str]:
        raise PermissionError(path)

    def readlink(self, path: str) -> str | None:
        raise OSError(path)

    def exists(self, path: str) -> bool:
        raise OSError(path)


def test_probe_never_raises_when_every_source_explodes() -> None:
    def boom(*args: object) -> Any:
        raise RuntimeError("source exploded")

    src = ProbeSources(files=_ExplodingFiles(), env={}, platform=PlatformInfo("Linux", ""),
                       runner=boom, importer=boom, affinity=boom)
    profile = probe(src)
    assert profile.cpu.logical_cores is None and profile.gpus == ()
    assert unexplained_fields(profile) == []
    notes = "\n".join(profile.notes)
    assert "cpu: cpu probe failed (RuntimeError: source exploded)" in notes   # affinity
    assert "gpus: GPU probe failed (PermissionError" in notes                 # listdir
    assert "accelerators: accelerator probe failed" in notes
    assert any("importing psutil failed" in n for n in profile.memory.notes)


def test_directory_tree_and_in_memory_tree_give_the_same_profile(tmp_path: Path) -> None:
    machine = fake_machine("container-v1-2core-1gib")
    MemoryFiles(machine.files, machine.links).write_tree(tmp_path)
    from_disk = probe(machine.sources(files=DirectoryFiles(tmp_path)))
    assert from_disk == machine.profile()


def test_forced_backend_comes_from_keel_backend() -> None:
    machine = fake_machine("edge-arm-board")
    assert probe(machine.sources(env={"KEEL_BACKEND": "CPU"})).forced_backend == "cpu"
    bad = probe(machine.sources(env={"KEEL_BACKEND": "tpu"}))
    assert bad.forced_backend is None
    assert any("KEEL_BACKEND='tpu' is not one of" in n for n in bad.notes)


def test_device_info_view_of_seed_004() -> None:
    h100 = fake_profile("nvidia-h100-server").device_info()
    assert (h100.cpu_cores, h100.gpu_count, h100.has_avx2, h100.has_avx512) == (224, 8, True, True)
    assert h100.gpu_names[0] == "NVIDIA H100 80GB HBM3"
    assert h100.gpu_memory_bytes[0] == 81559 * 1024**2 and not h100.has_neon
    arm = fake_profile("edge-arm-board").device_info()
    assert arm.has_neon and not arm.has_avx2 and arm.gpu_count == 0
    container = fake_profile("container-2core-1gib").device_info()
    assert container.cpu_cores == 2 and container.memory_limit_bytes == 1024**3
    mac = fake_profile("apple-m2-pro").device_info()
    assert mac.platform_system == "Darwin" and mac.has_neon and mac.gpu_count == 1


def test_detect_devices_on_this_machine() -> None:
    info = detect_devices()
    profile = probe()
    assert info.cpu_cores == profile.cpu.usable_cores
    assert info.has_avx2 == profile.cpu.has("avx2")
    assert info.gpu_count == len(profile.gpus)
    assert dataclasses.is_dataclass(info)


def test_load_rejects_a_file_that_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InvalidArgumentError, match=r"cannot read hardware profile .*utf-8"):
        HardwareProfile.load(str(path))
