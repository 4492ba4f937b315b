"""Accelerators from environment variables and device nodes."""

from __future__ import annotations

import pytest

from keel.hardware import accelerators
from keel.hardware.accelerators import ACCELERATOR_ENV, probe_accelerators
from keel.hardware.fakes import fake_machine
from keel.hardware.sources import MemoryFiles, PlatformInfo, ProbeSources


def _src(env: dict[str, str] | None = None, files: dict[str, str] | None = None,
         links: dict[str, str] | None = None, system: str = "Linux") -> ProbeSources:
    return ProbeSources(files=MemoryFiles(files or {}, links), env=env or {},
                        platform=PlatformInfo(system, "x86_64"))


def test_the_documented_variables_are_the_ones_read() -> None:
    doc = accelerators.__doc__ or ""
    for var in ("TPU_VISIBLE_DEVICES", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR",
                "NEURON_RT_VISIBLE_CORES", "NEURO_ACCELERATORS", "HABANA_VISIBLE_DEVICES"):
        assert var in ACCELERATOR_ENV and f"``{var}``" in doc


@pytest.mark.parametrize(("var", "kind"), sorted(ACCELERATOR_ENV.items()))
def test_each_variable_alone_flags_its_kind(var: str, kind: str) -> None:
    found, = probe_accelerators(_src({var: "0"}))
    assert found.kind == kind and found.source == f"env:{var}" and found.detail == f"{var}=0"


def test_empty_variables_and_no_nodes_mean_no_accelerator() -> None:
    assert probe_accelerators(_src({"TPU_NAME": "  ", "HOME": "/root"})) == ()


def test_tpu_vm_env_and_accel_nodes() -> None:
    profile = fake_machine("tpu-v5e-vm").profile()
    env_entry, *nodes = profile.accelerators
    assert env_entry.kind == "tpu" and env_entry.name == "TPU v5litepod-4"
    assert "TPU_NAME=my-tpu" in (env_entry.detail or "")
    assert [n.source for n in nodes] == [f"/dev/accel{i}" for i in range(4)]
    assert all(n.kind == "tpu" for n in nodes) and profile.has_tpu and not profile.has_npu


def test_neuron_node_and_env() -> None:
    profile = fake_machine("inferentia-inf2").profile()
    assert {a.source for a in profile.accelerators} == {"env:NEURON_RT_VISIBLE_CORES",
                                                        "/dev/neuron0"}
    assert profile.has_npu and not profile.has_tpu


def test_accel_node_kind_comes_from_its_driver() -> None:
    found = probe_accelerators(_src(
        files={"/dev/accel0": "", "/dev/accel1": "", "/dev/hl0": ""},
        links={"/sys/class/accel/accel0/device/driver": "../../bus/pci/drivers/intel_vpu"}))
    by_name = {a.name: a for a in found}
    assert by_name["accel0"].kind == "npu" and "intel_vpu" in (by_name["accel0"].detail or "")
    assert by_name["accel1"].kind == "accel" and "no driver" in (by_name["accel1"].detail or "")
    assert by_name["hl0"].kind == "habana"


def test_device_nodes_are_only_read_on_linux() -> None:
    assert probe_accelerators(_src(files={"/dev/neuron0": ""}, system="Darwin")) == ()
