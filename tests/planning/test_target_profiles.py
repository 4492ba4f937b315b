"""edge/server target profiles and the classification of hosts."""

from __future__ import annotations

import dataclasses

import pytest

from keel.errors import InvalidArgumentError
from keel.hardware.fakes import fake_profile
from keel.hardware.profile import CpuInfo, HardwareProfile, MemoryInfo
from keel.planning.policy import RuntimePolicy
from keel.planning.targets import TARGETS, classify_host, get_target

GIB = 1024**3


def test_flags_and_feature_gates_are_the_seeds() -> None:
    edge, server = get_target("edge"), get_target("server")
    assert edge.flags == ("-C opt-level=z", "-C lto=fat", "-C codegen-units=1")
    assert edge.feature_gates == ("low-power", "quantized-kernels")
    assert server.flags == ("-C opt-level=3", "-C lto=thin")
    assert server.feature_gates == ("throughput", "gpu-offload")
    assert "llama.cpp CPU" in edge.primary_backends
    assert "full CPython runtime" in server.primary_backends
    assert list(TARGETS) == ["edge", "server"]
    assert get_target(" Server ") is server
    assert edge.to_dict()["flags"] == list(edge.flags)


def test_unknown_target_lists_the_allowed_ones() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown target profile 'cloud'; allowed: "
                                                   "edge, server"):
        get_target("cloud")


@pytest.mark.parametrize(("name", "target", "because"), [
    ("nvidia-h100-server", "server", "GPU 0 (NVIDIA H100 80GB HBM3) has 79.6 GiB"),
    ("windows-rtx4090", "server", "dedicated memory"),
    ("amd-sysfs-only", "server", "GPU 0 (Navi 31"),
    ("tpu-v5e-vm", "server", "custom accelerator present (tpu)"),
    ("inferentia-inf2", "server", "custom accelerator present (neuron)"),
    ("x86-avx512-server", "server", "224 usable cores meet the server floor"),
    ("edge-arm-board", "edge", "8 usable cores are below the server floor"),
    ("container-2core-1gib", "edge", "1.0 GiB usable memory / 2 usable cores"),
    ("nvidia-no-driver", "edge", "below the server floor"),
    ("apple-m2-pro", "edge", "12 usable cores are below"),   # unified memory is not dedicated
])
def test_hosts_are_classified_with_a_reason(name: str, target: str, because: str) -> None:
    result = classify_host(fake_profile(name))
    assert result.target == target
    assert because in result.reason


def test_the_gpu_threshold_comes_from_the_policy() -> None:
    rtx = fake_profile("windows-rtx4090")
    assert classify_host(rtx, RuntimePolicy(min_gpu_memory_gb=32)).target == "server"  # cores
    small = dataclasses.replace(rtx, cpu=dataclasses.replace(rtx.cpu, usable_cores=8))
    assert classify_host(small, RuntimePolicy(min_gpu_memory_gb=32)).target == "edge"
    assert classify_host(small).target == "server"


def test_unknown_memory_is_edge_with_the_reason() -> None:
    profile = HardwareProfile(cpu=CpuInfo(usable_cores=64), memory=MemoryInfo())
    result = classify_host(profile)
    assert result.target == "edge" and "memory is unknown" in result.reason
