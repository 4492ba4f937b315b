"""TelemetrySnapshot: NVML when present, static heuristics otherwise; a snapshot, never a poller."""

from __future__ import annotations

import threading

import pytest

from keel.hardware.fakes import FakeNvml, fake_machine, fake_profile
from keel.planning.adaptive import MemoryTelemetry
from keel.planning.telemetry import TelemetrySnapshot, take_snapshot

GIB = 1024**3


def _nvml(util: int = 0) -> FakeNvml:
    return FakeNvml([{"name": "NVIDIA H100 80GB HBM3", "total": 80 * GIB, "free": 60 * GIB,
                      "cc": (9, 0), "bus": "00000000:18:00.0", "util": util, "temp": 61}],
                    driver="550.54.15")


def test_nvml_snapshot_reads_utilisation_memory_and_temperature() -> None:
    nvml = _nvml(util=95)
    src = fake_machine("nvidia-h100-server").sources(
        importer=lambda name: (nvml, "") if name == "pynvml" else (None, "absent"))
    snap = take_snapshot(sources=src)
    assert snap.source == "nvml" and snap.gpu_available
    gpu = snap.gpu(0)
    assert gpu is not None and gpu.utilization_percent == 95.0 and gpu.temperature_c == 61.0
    assert snap.is_saturated(0) is True and snap.is_saturated(0, threshold=99) is False
    assert snap.available_bytes("gpu:0") == 60 * GIB and snap.available_bytes("gpu") == 60 * GIB
    assert nvml.initialised == 0


def test_without_nvml_the_snapshot_is_static_and_says_why() -> None:
    machine = fake_machine("nvidia-h100-server")
    snap = take_snapshot(sources=machine.sources())
    assert snap.source == "static" and snap.gpu_available and len(snap.gpus) == 8
    assert snap.is_saturated(0) is None                      # unknown, not guessed
    assert snap.available_bytes("gpu:1") == 81008 * 1024**2  # as probed
    assert any("NVML is unavailable: pynvml is not importable" in n for n in snap.notes)


def test_a_failing_nvml_falls_back_to_the_given_profile() -> None:
    broken = FakeNvml([], driver="", init_error="Driver Not Loaded")
    src = fake_machine("edge-arm-board").sources(
        importer=lambda name: (broken, "") if name == "pynvml" else (None, "absent"))
    snap = take_snapshot(fake_profile("edge-arm-board"), sources=src)
    assert snap.source == "static" and not snap.gpu_available and snap.gpus == ()
    assert any("nvmlInit failed (Driver Not Loaded)" in n for n in snap.notes)


def test_host_memory_is_cgroup_aware() -> None:
    snap = take_snapshot(sources=fake_machine("container-2core-1gib").sources())
    assert snap.available_bytes("cpu") == GIB - 250 * 1024**2
    assert snap.available_bytes("tpu") is None


def test_it_is_a_memory_telemetry_for_the_adaptive_planner() -> None:
    snap = take_snapshot(sources=fake_machine("edge-arm-board").sources())
    assert isinstance(snap, MemoryTelemetry)
    assert snap.to_dict()["source"] == "static"


def test_taking_a_snapshot_starts_no_thread() -> None:
    before = threading.active_count()
    take_snapshot()
    assert threading.active_count() == before


def test_snapshots_are_frozen() -> None:
    snap = TelemetrySnapshot("static", False, (), None)
    with pytest.raises(AttributeError):
        snap.source = "nvml"  # type: ignore[misc]
