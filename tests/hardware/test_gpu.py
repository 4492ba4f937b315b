"""GPU probe: NVML, nvidia-smi, amdsmi, rocm-smi, system_profiler and PCI ids in sysfs."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from keel.hardware.fakes import H100_SMI_CSV, FakeNvml, fake_machine
from keel.hardware.gpu import normalize_bus_id, parse_nvidia_smi, parse_rocm_smi, probe_gpus
from keel.hardware.sources import CommandResult, MemoryFiles, PlatformInfo, ProbeSources

MIB = 1024**2


def test_nvidia_smi_csv_of_an_h100_server() -> None:
    profile = fake_machine("nvidia-h100-server").profile()
    assert len(profile.gpus) == 8                       # sysfs duplicates are not added
    gpu = profile.gpus[0]
    assert (gpu.vendor, gpu.name, gpu.source) == ("nvidia", "NVIDIA H100 80GB HBM3", "nvidia-smi")
    assert gpu.total_memory_bytes == 81559 * MIB and gpu.free_memory_bytes == 81008 * MIB
    assert gpu.total_memory_gib == pytest.approx(79.65, abs=0.01)
    assert (gpu.driver, gpu.compute_capability) == ("535.104.05", "9.0")
    assert gpu.pci_bus_id == "0000:18:00.0"
    assert [g.index for g in profile.gpus] == list(range(8))
    assert any("ignored display controllers" in n and "0x1a03" in n for n in profile.notes)


def test_nvml_is_preferred_and_records_its_source() -> None:
    machine = fake_machine("nvidia-h100-nvml")
    both = machine.sources(runner=lambda argv, t: CommandResult(True, H100_SMI_CSV))
    gpus, notes = probe_gpus(both)
    assert [g.source for g in gpus] == ["nvml"] * 8
    assert gpus[3].pci_bus_id == "0000:5d:00.0" and gpus[3].compute_capability == "9.0"
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"        # bytes from old pynvml decoded
    assert machine.modules["pynvml"].initialised == 0      # init and shutdown balanced
    assert not any("nvidia-smi" in n for n in notes)


def test_nvml_failure_falls_back_to_nvidia_smi_with_a_note() -> None:
    broken = FakeNvml([], driver="", init_error="NVML Shared Library Not Found")
    src = fake_machine("nvidia-h100-server").sources(
        importer=lambda name: (broken, "") if name == "pynvml" else (None, "absent"))
    gpus, notes = probe_gpus(src)
    assert len(gpus) == 8 and gpus[0].source == "nvidia-smi"
    assert any("nvmlInit failed (NVML Shared Library Not Found)" in n for n in notes)


def test_old_nvidia_smi_without_compute_cap_is_asked_again() -> None:
    calls: list[Sequence[str]] = []

    def runner(argv: Sequence[str], timeout: float) -> CommandResult:
        calls.append(argv)
        if "compute_cap" in argv[1]:
            return CommandResult(False, reason='nvidia-smi exited with 2: Field "compute_cap" '
                                               'is not a valid field to query.')
        return CommandResult(True, "0, Tesla V100-SXM2-16GB, 16160, 16150, 470.82.01, "
                                   "00000000:00:1E.0\n")

    src = ProbeSources(files=MemoryFiles({}), runner=runner,
                       platform=PlatformInfo("Linux", "x86_64"),
                       importer=lambda name: (None, "absent"))
    gpus, _ = probe_gpus(src)
    assert len(calls) >= 2 and gpus[0].name == "Tesla V100-SXM2-16GB"
    assert gpus[0].compute_capability is None
    assert any(n.startswith("compute_capability:") for n in gpus[0].notes)


def test_nvidia_smi_unavailable_values_become_explained_nones() -> None:
    gpus = parse_nvidia_smi("0, NVIDIA A100-SXM4-40GB, [N/A], [N/A], 525.85.12, 8.0, "
                            "00000000:07:00.0\ngarbage line\n")
    assert len(gpus) == 1
    assert gpus[0].total_memory_bytes is None and gpus[0].free_memory_bytes is None
    assert any(n.startswith("total_memory_bytes:") for n in gpus[0].notes)


def test_rocm_smi_json_of_two_mi210() -> None:
    profile = fake_machine("amd-rocm-server").profile()
    assert len(profile.gpus) == 2                       # the sysfs copies are matched by bus
    gpu = profile.gpus[0]
    assert (gpu.vendor, gpu.name, gpu.source) == ("amd", "AMD Instinct MI210", "rocm-smi")
    assert gpu.total_memory_bytes == 68702699520
    assert gpu.free_memory_bytes == 68702699520 - 10960896
    assert gpu.driver == "6.3.6" and gpu.compute_capability is None
    assert any(n.startswith("compute_capability:") for n in gpu.notes)


def test_rocm_smi_garbage_is_no_gpu() -> None:
    assert parse_rocm_smi("not json") == [] and parse_rocm_smi("[1, 2]") == []


class _FakeAmdSmi:
    """The parts of amdsmi the probe calls."""

    AmdSmiMemoryType = SimpleNamespace(VRAM="vram")

    def amdsmi_init(self) -> None:
        pass

    def amdsmi_shut_down(self) -> None:
        pass

    def amdsmi_get_processor_handles(self) -> list[str]:
        return ["h0"]

    def amdsmi_get_gpu_asic_info(self, handle: str) -> dict[str, Any]:
        return {"market_name": "AMD Instinct MI300X", "vendor_id": "0x1002"}

    def amdsmi_get_gpu_memory_total(self, handle: str, kind: str) -> int:
        assert kind == "vram"
        return 192 * 1024**3

    def amdsmi_get_gpu_memory_usage(self, handle: str, kind: str) -> int:
        return 2 * 1024**3

    def amdsmi_get_gpu_driver_info(self, handle: str) -> dict[str, str]:
        return {"driver_name": "amdgpu", "driver_version": "6.7.0"}

    def amdsmi_get_gpu_device_bdf(self, handle: str) -> str:
        raise RuntimeError("AMDSMI_STATUS_NOT_SUPPORTED")


def test_amdsmi_module_is_used_before_rocm_smi() -> None:
    amd = _FakeAmdSmi()
    src = fake_machine("amd-rocm-server").sources(
        importer=lambda name: (amd, "") if name == "amdsmi" else (None, "absent"))
    gpus, _ = probe_gpus(src)
    assert gpus[0].source == "amdsmi" and gpus[0].name == "AMD Instinct MI300X"
    assert gpus[0].total_memory_bytes == 192 * 1024**3
    assert gpus[0].free_memory_bytes == 190 * 1024**3 and gpus[0].driver == "6.7.0"
    assert gpus[0].pci_bus_id is None
    assert any("AMDSMI_STATUS_NOT_SUPPORTED" in n for n in gpus[0].notes)


def test_amd_gpu_seen_only_through_sysfs() -> None:
    profile = fake_machine("amd-sysfs-only").profile()
    assert [g.vendor for g in profile.gpus] == ["amd", "amd"]
    dgpu = profile.gpus[0]
    assert dgpu.source == "sysfs" and dgpu.pci_bus_id == "0000:03:00.0"
    assert dgpu.name == "Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]"   # from pci.ids
    assert dgpu.total_memory_bytes == 25753026560
    assert dgpu.free_memory_bytes == 25753026560 - 1073741824
    assert dgpu.driver == "amdgpu"
    assert any("rocm-smi: rocm-smi not found" in n for n in profile.notes)


def test_nvidia_gpu_on_pci_without_a_driver_is_still_seen() -> None:
    gpu, = fake_machine("nvidia-no-driver").profile().gpus
    assert (gpu.vendor, gpu.source, gpu.name) == ("nvidia", "sysfs", "GA104GL [RTX A4000]")
    assert gpu.driver is None and gpu.total_memory_bytes is None
    notes = "\n".join(gpu.notes)
    assert "driver: no kernel driver is bound" in notes and "total_memory_bytes:" in notes


def test_intel_gpu_from_pci_vendor_id_and_unknown_name() -> None:
    base = "/sys/bus/pci/devices/0000:00:02.0"
    src = ProbeSources(
        files=MemoryFiles({f"{base}/vendor": "0x8086\n", f"{base}/device": "0xa780\n",
                           f"{base}/class": "0x030000\n"},
                          links={f"{base}/driver": "../../../bus/pci/drivers/i915"}),
        platform=PlatformInfo("Linux", "x86_64"), importer=lambda name: (None, "absent"),
        runner=lambda argv, t: CommandResult(False, reason="absent"))
    gpu, = probe_gpus(src)[0]
    assert (gpu.vendor, gpu.driver, gpu.name) == ("intel", "i915", None)
    assert any(n.startswith("name:") for n in gpu.notes)


def test_apple_gpu_from_system_profiler_uses_unified_memory() -> None:
    gpu, = fake_machine("apple-m2-pro").profile().gpus
    assert (gpu.vendor, gpu.name, gpu.source) == ("apple", "Apple M2 Pro", "system_profiler")
    assert gpu.total_memory_bytes == 32 * 1024**3 and gpu.driver == "Metal 3"
    assert "cores: 19 GPU cores" in gpu.notes


def test_apple_gpu_known_from_the_soc_brand_when_system_profiler_fails() -> None:
    machine = fake_machine("apple-m2-pro")

    def runner(argv: Sequence[str], timeout: float) -> CommandResult:
        if argv[0] == "system_profiler":
            return CommandResult(False, reason="system_profiler did not answer within 3 s")
        return machine._run(argv, timeout)

    gpus, notes = probe_gpus(machine.sources(runner=runner), system_memory_bytes=1234)
    assert gpus[0].vendor == "apple" and gpus[0].source == "sysctl"
    assert gpus[0].total_memory_bytes == 1234 and gpus[0].name is None
    assert any("did not answer" in n for n in notes)


def test_intel_mac_discrete_gpu_vram_is_parsed() -> None:
    out = ('{"SPDisplaysDataType": [{"sppci_model": "AMD Radeon Pro 5500M", '
           '"spdisplays_vendor": "sppci_vendor_amd", "spdisplays_vram": "8 GB"}]}')
    src = ProbeSources(files=MemoryFiles({}), platform=PlatformInfo("Darwin", "x86_64"),
                       importer=lambda name: (None, "absent"),
                       runner=lambda argv, t: CommandResult(argv[0] == "system_profiler", out))
    gpu, = probe_gpus(src)[0]
    assert (gpu.vendor, gpu.total_memory_bytes) == ("amd", 8 * 1024**3)


@pytest.mark.parametrize(("raw", "norm"), [
    ("00000000:18:00.0", "0000:18:00.0"), ("0000:3B:00.0", "0000:3b:00.0"),
    ("3b:00.0", "0000:3b:00.0"), ("00000001:01:00.0", "0001:01:00.0"),
])
def test_normalize_bus_id(raw: str, norm: str) -> None:
    assert normalize_bus_id(raw) == norm
