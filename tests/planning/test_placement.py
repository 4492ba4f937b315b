"""Placement: per-node backend, variant, precision and reasons; pins; fallbacks; copies."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import yaml

from keel.backends.base import DeviceKind
from keel.backends.registry import BackendRegistry
from keel.dtypes import DType
from keel.errors import BackendSelectionError, UnsupportedOperationError
from keel.graph.ir import Graph, Node, Value
from keel.graph.shape_inference import infer_graph_types
from keel.ops.registry import Op
from keel.ops.types import TensorType
from keel.planning.placement import ExecutionPlan, place
from keel.testing.backends import FakeBackend


def registry_of(*backends: FakeBackend) -> BackendRegistry:
    reg = BackendRegistry()
    for i, b in enumerate(backends):
        reg.register(b.name, functools.partial(lambda x: x, b), priority=100 - i)
    return reg


def small_graph() -> Graph:
    t = TensorType(DType.FLOAT32, ("batch", 8))
    nodes = [
        Node("mm", Op.MATMUL, ["x", "w"], ["h"]),
        Node("act", Op.RELU, ["h"], ["r"]),
        Node("add", Op.ADD, ["r", "x"], ["y"]),
    ]
    return Graph("small", nodes, [Value("x", t)], [Value("y", t)],
                 initializers={"w": np.eye(8, dtype=np.float32)})


def plan_of(graph: Graph, reg: BackendRegistry, backend: str = "auto",
            shapes: dict[str, tuple[int, ...]] | None = None) -> ExecutionPlan:
    types = infer_graph_types(graph, shapes or {"x": (4, 8)})
    return place(graph, types, reg, backend=backend)


def test_pinned_backend_runs_every_node() -> None:
    reg = registry_of(FakeBackend("fast"), FakeBackend("reference"))
    plan = plan_of(small_graph(), reg, backend="reference")
    assert [n.backend for n in plan.nodes] == ["reference"] * 3
    assert all("pinned to reference" in n.reasons[0] for n in plan.nodes)
    assert plan.copies == ()
    assert plan.backend == "reference"


def test_pinned_backend_that_cannot_run_here_fails_before_running() -> None:
    reg = registry_of(FakeBackend("gpu", DeviceKind.GPU, available=False,
                                  reason="CuPy is not installed"), FakeBackend("reference"))
    with pytest.raises(BackendSelectionError, match="'gpu' cannot be used: CuPy is not installed"):
        plan_of(small_graph(), reg, backend="gpu")


def test_pinned_backend_missing_an_op_names_the_node() -> None:
    reg = registry_of(FakeBackend("fast", ops={Op.MATMUL, Op.ADD}), FakeBackend("reference"))
    with pytest.raises(UnsupportedOperationError,
                       match=r"'relu' is not supported by backend 'fast'; supported on: "
                             r"reference \(node 'act'") as info:
        plan_of(small_graph(), reg, backend="fast")
    assert info.value.supported_on == ("reference",)


def test_unknown_pinned_backend_is_a_selection_error() -> None:
    with pytest.raises(BackendSelectionError, match="'tpu' cannot be used"):
        plan_of(small_graph(), registry_of(FakeBackend("reference")), backend="tpu")


def test_auto_moves_an_unsupported_node_down_the_chain_with_a_reason() -> None:
    reg = registry_of(FakeBackend("fast", ops={Op.MATMUL, Op.ADD}), FakeBackend("reference"))
    plan = plan_of(small_graph(), reg)
    assert [n.backend for n in plan.nodes] == ["fast", "reference", "fast"]
    act = plan.node("act")
    assert any("fast" in r and "no kernel for relu" in r for r in act.reasons)
    assert plan.backends == {"fast": 2, "reference": 1}
    # Both run on the host: no device copies.
    assert plan.copies == ()


def test_strict_mode_turns_a_fallback_into_an_error() -> None:
    reg = registry_of(FakeBackend("fast", ops={Op.MATMUL, Op.ADD}), FakeBackend("reference"))
    graph = small_graph()
    types = infer_graph_types(graph, {"x": (4, 8)})
    with pytest.raises(UnsupportedOperationError,
                       match=r"'relu'.*'fast'.*reference.*node 'act'.*KEEL_STRICT"):
        place(graph, types, reg, strict=True)


def test_auto_with_nothing_available_says_why() -> None:
    reg = registry_of(FakeBackend("gpu", DeviceKind.GPU, available=False, reason="no GPU"))
    with pytest.raises(BackendSelectionError, match=r"no backend can run here.*gpu: no GPU"):
        plan_of(small_graph(), reg)


def big_matmul_graph() -> Graph:
    a = TensorType(DType.FLOAT32, (1024, 2048))
    w = TensorType(DType.FLOAT32, (2048, 1024))
    nodes = [Node("mm", Op.MATMUL, ["x", "w"], ["h"]),
             Node("act", Op.RELU, ["h"], ["y"])]
    return Graph("big", nodes, [Value("x", a), Value("w", w)],
                 [Value("y", TensorType(DType.FLOAT32, (1024, 1024)))])


def test_device_copies_are_inserted_and_counted() -> None:
    # The GPU backend has only matmul: 16 MB of matmul inputs go to the GPU
    # (over the 10 MB crossover), the relu comes back to the CPU.
    gpu = FakeBackend("gpu", DeviceKind.GPU, ops={Op.MATMUL})
    reg = registry_of(gpu, FakeBackend("cpu"))
    types = infer_graph_types(big_matmul_graph(), {})
    plan = place(big_matmul_graph(), types, reg)
    assert [(n.backend, n.device) for n in plan.nodes] == [("gpu", "gpu"), ("cpu", "cpu")]
    moves = [(c.value, c.src, c.dst) for c in plan.copies]
    assert moves == [("x", "cpu", "gpu"), ("w", "cpu", "gpu"), ("h", "gpu", "cpu")]
    assert plan.to_dict()["copy_count"] == 3
    assert any("3 device copies planned" in r for r in plan.reasons)
    # Each device has its own arena: h lives on the GPU, its copy on the host.
    assert set(plan.memory["arena_bytes"]) == {"gpu", "cpu"}
    assert plan.memory_plan is not None
    assert plan.memory_plan.allocation("h").device == "gpu"


def test_small_work_stays_on_the_cpu_with_the_reason() -> None:
    gpu = FakeBackend("gpu", DeviceKind.GPU)
    reg = registry_of(gpu, FakeBackend("cpu"))
    plan = plan_of(small_graph(), reg)
    assert {n.backend for n in plan.nodes} == {"cpu"}
    assert "under 1 MB" in plan.node("mm").reasons[0]
    assert any(r.startswith("gpu rejected") for r in plan.node("mm").reasons)


def test_plan_records_variant_and_precision() -> None:
    plan = plan_of(small_graph(), registry_of(FakeBackend("reference")))
    for n in plan.nodes:
        assert n.variant == "default"
        assert n.precision == "fp32"
        assert any(r.startswith("variant default") for r in n.reasons)
        assert any(r.startswith("precision fp32") for r in n.reasons)


def test_plan_knows_its_peak_before_running() -> None:
    plan = plan_of(small_graph(), registry_of(FakeBackend("reference")), shapes={"x": (100, 8)})
    weights, out = 8 * 8 * 4, 100 * 8 * 4
    assert plan.memory["weight_bytes"] == weights
    assert plan.memory["output_bytes"] == out
    assert plan.peak_bytes == weights + out + plan.memory["heap_bytes"] + sum(
        plan.memory["arena_bytes"].values())
    assert plan.input_shapes == {"x": (100, 8)}


def test_plan_serialises_to_json_yaml_and_a_table() -> None:
    plan = plan_of(small_graph(), registry_of(FakeBackend("fast", ops={Op.MATMUL, Op.ADD}),
                                              FakeBackend("reference")))
    data = json.loads(plan.to_json())
    assert [n["backend"] for n in data["nodes"]] == ["fast", "reference", "fast"]
    assert data["peak_bytes"] == plan.peak_bytes
    assert yaml.safe_load(plan.to_yaml()) == data
    table = plan.table()
    for word in ("node", "backend", "act", "relu", "reference", "peak memory", "device copies"):
        assert word in table


def test_plan_is_frozen() -> None:
    plan = plan_of(small_graph(), registry_of(FakeBackend("reference")))
    with pytest.raises(AttributeError):
        plan.peak_bytes = 0  # type: ignore[misc]
