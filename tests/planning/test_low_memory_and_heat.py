"""Seed 002's constraints: a low-memory mode and plans that read the machine's heat."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest

from keel.backends.cpu.backend import resolve_threads
from keel.cli.convert import convert_model
from keel.config import reload_settings
from keel.dtypes import DType
from keel.execution.model import load_model
from keel.hardware import probe
from keel.hardware.fakes import fake_machine, fake_profile
from keel.hardware.thermal import cpu_throttling, hot_gpus
from keel.planning.runtime_plan import low_memory_mode, plan_runtime
from keel.testing.models import lenet, make_inputs

ONNX_MODEL = lenet(size=16)


@pytest.fixture
def keel_model(tmp_path: Path) -> str:
    source = tmp_path / "lenet.onnx"
    onnx.save(ONNX_MODEL, str(source))
    convert_model(source, tmp_path / "lenet.keel", "all")
    return str(tmp_path / "lenet.keel")


def _prepacking_nodes(model: object) -> list[str]:
    plan = model.plan                                            # type: ignore[attr-defined]
    return [n.name for n in plan.nodes if n.plan is not None and n.plan.option("prepack", True)
            and n.op in ("conv", "gemm")]


def test_a_small_machine_plans_mapped_weights_and_no_packed_copies(keel_model: str) -> None:
    board = fake_profile("edge-arm-board")                       # 4 GiB
    low = load_model(keel_model, hardware=board, plan_cache=False)
    assert low.plan.memory["prepacked_bytes"] == 0
    assert _prepacking_nodes(low) == []
    conv = next(n for n in low.plan.nodes if n.op == "conv")
    assert conv.plan is not None and "low-memory mode (total memory 3.7 GiB" in \
        conv.plan.reason("prepack")
    said = next(r for r in low.plan.reasons if r.startswith("low-memory mode"))
    weights = len(low.graph.initializers)
    assert f"{weights} of {weights} weight tensors" in said and "memory-mapped" in said
    server = load_model(keel_model, hardware=fake_profile("x86-avx512-server"),
                        plan_cache=False)
    assert server.plan.memory["prepacked_bytes"] > 0
    assert not any(r.startswith("low-memory mode") for r in server.plan.reasons)


def test_low_memory_plans_compute_the_same_outputs(keel_model: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    feeds = make_inputs(ONNX_MODEL, batch=3, seed=1)
    standard = load_model(keel_model, plan_cache=False)
    monkeypatch.setenv("KEEL_LIGHTWEIGHT_MEMORY_THRESHOLD_GB", "100000")
    reload_settings()
    low = load_model(keel_model, plan_cache=False)
    assert "lightweight_memory_threshold_gb=100000" in low_memory_mode(None)
    assert _prepacking_nodes(standard) and not _prepacking_nodes(low)
    expected = standard.predict(feeds)
    for name, value in low.predict(feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)


def test_an_onnx_model_in_low_memory_mode_says_its_weights_are_in_memory(
        tmp_path: Path) -> None:
    source = tmp_path / "lenet.onnx"
    onnx.save(ONNX_MODEL, str(source))
    model = load_model(str(source), hardware=fake_profile("container-2core-1gib"),
                       plan_cache=False)
    said = next(r for r in model.plan.reasons if r.startswith("low-memory mode"))
    assert "the weights are in memory (load a .keel file" in said


def test_low_memory_runs_one_stream(keel_model: str) -> None:
    board = fake_profile("edge-arm-board")
    model = load_model(keel_model, hardware=board, hint="throughput", plan_cache=False)
    model.predict(make_inputs(ONNX_MODEL, batch=16))
    adaptive = model.adaptive_plan
    assert adaptive is not None and adaptive.streams == 1
    assert any("low-memory mode" in r and "one stream reuses one arena" in r
               for r in adaptive.reasons)


def test_the_runtime_plan_names_the_memory_mode() -> None:
    low = plan_runtime(fake_profile("edge-arm-board"), local=False)
    assert low.low_memory and low.memory_mode.choice == "low-memory"
    assert "no packed copies" in low.memory_mode.reason
    big = plan_runtime(fake_profile("x86-avx512-server"), local=False)
    assert not big.low_memory and "weights may be packed" in big.memory_mode.reason


def test_the_probe_reads_cpu_zones_and_gpu_temperatures() -> None:
    hot_board = probe(fake_machine("edge-arm-board-hot").sources())
    (zone,) = hot_board.thermal
    assert (zone.device, zone.temperature_c, zone.limit_c, zone.throttled) == (
        "cpu", 86.5, 85.0, True)
    assert "passive trip point 85 C" in zone.detail
    cool_board = fake_profile("edge-arm-board")
    assert cool_board.thermal[0].temperature_c == 48.0 and not cpu_throttling(cool_board)
    gpus = fake_profile("nvidia-h100-hot").thermal
    assert [r.device for r in gpus] == [f"gpu:{i}" for i in range(8)]
    assert gpus[0].temperature_c == 85.0 and gpus[0].limit_c == 87.0
    assert set(hot_gpus(fake_profile("nvidia-h100-hot"))) == set(range(8))
    assert hot_gpus(fake_profile("nvidia-h100-nvml")) == {}


def test_a_throttling_cpu_gets_fewer_threads() -> None:
    plan = plan_runtime(fake_profile("edge-arm-board-hot"), local=False)
    assert plan.threads.choice == "4" and plan.threads.fallbacks == ("8",)
    assert "86.5 C" in plan.threads.reason and "to shed heat" in plan.threads.reason
    assert plan_runtime(fake_profile("edge-arm-board"), local=False).threads.choice == "8"
    threads, why = resolve_threads(fake_profile("edge-arm-board-hot"))
    assert threads == 4 and "throttling for heat" in why


def test_a_gpu_near_its_limit_is_kept_off() -> None:
    hot = plan_runtime(fake_profile("nvidia-h100-hot"), local=False)
    assert hot.engine.choice == "cpu"
    assert dict(hot.engine.rejected)["gpu"].startswith("kept off the GPU for heat: GPU 0 at 85 C")
    assert hot.llama_cpp.choice == "cpu"
    assert all("kept off for heat" in why for _, why in hot.llama_cpp.rejected)
    cool = plan_runtime(fake_profile("nvidia-h100-nvml"), local=False)
    assert (cool.engine.choice, cool.llama_cpp.choice) == ("gpu", "gpu")


def test_a_throttling_gpu_is_kept_off_whatever_its_temperature() -> None:
    profile = fake_profile("nvidia-h100-nvml")
    readings = tuple(dataclasses.replace(r, temperature_c=60.0, throttled=True,
                                         detail="hardware thermal slowdown")
                     for r in profile.thermal)
    hot = dataclasses.replace(profile, thermal=readings)
    assert "is throttling (hardware thermal slowdown)" in hot_gpus(hot)[0]
    assert plan_runtime(hot, local=False).engine.choice == "cpu"


def test_a_saved_profile_keeps_its_thermal_readings(tmp_path: Path) -> None:
    profile = fake_profile("edge-arm-board-hot")
    path = tmp_path / "board.json"
    path.write_text(profile.to_json())
    from keel.hardware.profile import HardwareProfile

    assert HardwareProfile.load(str(path)) == profile


def test_placement_keeps_nodes_off_a_hot_gpu() -> None:
    from keel.backends.base import DeviceKind
    from keel.backends.registry import BackendRegistry
    from keel.graph.ir import Graph, Node, Value
    from keel.graph.shape_inference import infer_graph_types
    from keel.ops.registry import Op
    from keel.ops.types import TensorType
    from keel.planning.placement import place
    from keel.testing.backends import FakeBackend

    registry = BackendRegistry()
    gpu = FakeBackend("gpu", DeviceKind.GPU, ops={Op.MATMUL})
    for priority, backend in ((100, gpu), (50, FakeBackend("cpu"))):
        registry.register(backend.name, lambda b=backend: b, priority=priority)
    x, w = TensorType(DType.FLOAT32, (1024, 2048)), TensorType(DType.FLOAT32, (2048, 1024))
    graph = Graph("big", [Node("mm", Op.MATMUL, ["x", "w"], ["y"])],
                  [Value("x", x), Value("w", w)],
                  [Value("y", TensorType(DType.FLOAT32, (1024, 1024)))])
    types = infer_graph_types(graph, {})
    cool = place(graph, types, registry, fake_profile("nvidia-h100-nvml"))
    hot = place(graph, types, registry, fake_profile("nvidia-h100-hot"))
    assert [n.backend for n in cool.nodes] == ["gpu"]
    assert [n.backend for n in hot.nodes] == ["cpu"]
    assert any(r.startswith("gpu skipped: kept off the GPU for heat: GPU 0 at 85 C")
               for r in hot.reasons)
