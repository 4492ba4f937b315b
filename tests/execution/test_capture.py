"""Recorded device runs (keel.execution.capture): what is recorded, staged, replayed and why.

The gpu backend runs here on the fake CuPy (NumPy underneath) with a recorder that
behaves as a CUDA graph does: recording executes nothing, a replay re-issues the
recorded work on the same buffers (the fake pool hands the recorded run's
allocations back in the same order), and feeds reach it only through the staged
buffers. The real recorder (CuPy streams) is exercised on a GPU by the gpu suite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import keel
from keel.backends.cpu.backend import CpuBackend
from keel.backends.gpu.backend import GpuBackend
from keel.backends.registry import BackendRegistry
from keel.config import reload_settings
from keel.errors import MemoryLimitError
from tests.backends.fakes import EmulatedCupy


class _PoolCupy(EmulatedCupy):
    """The fake CuPy whose ``empty`` hands out a recorded run's arrays again on replays."""

    def __init__(self) -> None:
        super().__init__()
        self.recording: list[Any] | None = None  # arrays made by a recording's first launch
        self.replaying: Iterator[Any] | None = None

    def empty(self, shape: Any, dtype: Any = np.float64) -> Any:
        if self.replaying is not None:
            return next(self.replaying)
        array = np.empty(shape, dtype=dtype)
        if self.recording is not None:
            self.recording.append(array)
        return array


class _Recorder:
    """A GraphCapture as CUDA graphs behave, on the fake CuPy."""

    def __init__(self, cp: _PoolCupy, fail: str = "") -> None:
        self.cp, self.fail = cp, fail
        self.recorded = 0
        self.launched = 0
        self.log: list[Any] = []

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def record(self, run: Callable[[], None]) -> Any:
        if self.fail:
            raise RuntimeError(self.fail)
        self.recorded += 1
        return ("graph", run)                     # nothing executes while recording

    def launch(self, graph: Any) -> None:
        _, run = graph
        self.launched += 1
        if self.launched == 1:                    # the first launch allocates as recorded
            self.cp.recording = self.log
            try:
                run()
            finally:
                self.cp.recording = None
            return
        self.cp.replaying = iter(self.log)
        try:
            run()
        finally:
            self.cp.replaying = None

    def buffer(self, like: Any) -> Any:
        return np.empty(like.shape, dtype=like.dtype)

    def stage(self, buffer: Any, value: Any) -> None:
        buffer[...] = value


class _FakeGpu(GpuBackend):
    fail = ""
    recorders: list[_Recorder] = []

    def __init__(self) -> None:
        super().__init__(cupy_module=_PoolCupy())

    def graph_capture(self) -> tuple[Any, str]:
        recorder = _Recorder(self._cupy(), self.fail)
        type(self).recorders.append(recorder)
        return recorder, ""


def _mlp(width: int = 8, hidden: int = 16) -> bytes:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((width, hidden)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((hidden, 4)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, width])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, 4])], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


def _registry(fail: str = "") -> BackendRegistry:
    gpu = type("FakeGpu", (_FakeGpu,), {"fail": fail, "recorders": []})
    registry = BackendRegistry()
    registry.register("gpu", gpu, 10)
    registry.register("cpu", CpuBackend, 0)
    return registry


@pytest.fixture
def per_node_rules(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Auto placement by the per-node size rules (no gpu-versus-cpu trial runs)."""
    monkeypatch.setenv("KEEL_PLACEMENT_TRIALS", "off")
    reload_settings()
    yield
    monkeypatch.delenv("KEEL_PLACEMENT_TRIALS")
    reload_settings()


def _program(model: Any) -> Any:
    return next(p.program for p in model._cache.values() if p.program is not None)


def _feeds(seed: int, width: int = 8) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((2, width)).astype(np.float32)}


def test_second_run_records_and_later_runs_replay_with_new_feeds() -> None:
    data = _mlp()
    registry = _registry()
    model = keel.load_model(data, backend="gpu", registry=registry)
    reference = keel.load_model(data, backend="reference")
    for seed in range(5):
        feeds = _feeds(seed)
        got = model.predict(feeds)["y"]
        np.testing.assert_allclose(got, reference.predict(feeds)["y"], rtol=1e-5, atol=1e-5)
    program = _program(model)
    recorder, = registry.get("gpu").recorders
    assert program.captured and recorder.recorded == 1
    assert recorder.launched == 4                 # runs 2..5; run 1 warms up
    assert program.capture_reason.startswith("captured on gpu")
    assert "captured on gpu" in model.explain()


def test_outputs_handed_out_are_not_overwritten_by_the_next_replay() -> None:
    model = keel.load_model(_mlp(), backend="gpu", registry=_registry())
    outs = [model.predict(_feeds(seed))["y"] for seed in range(4)]
    again = keel.load_model(_mlp(), backend="reference")
    for seed, out in enumerate(outs):
        np.testing.assert_allclose(out, again.predict(_feeds(seed))["y"], rtol=1e-5, atol=1e-5)


def test_a_recording_that_fails_runs_step_by_step_and_says_why() -> None:
    model = keel.load_model(_mlp(), backend="gpu",
                            registry=_registry(fail="operation not permitted when capturing"))
    reference = keel.load_model(_mlp(), backend="reference")
    for seed in range(3):
        np.testing.assert_allclose(model.predict(_feeds(seed))["y"],
                                   reference.predict(_feeds(seed))["y"], rtol=1e-5, atol=1e-5)
    program = _program(model)
    assert not program.captured
    assert "recording failed (RuntimeError: operation not permitted" in program.capture_reason
    assert "recording failed" in model.explain()


def test_setting_off_runs_every_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_CUDA_GRAPHS", "off")
    reload_settings()
    try:
        registry = _registry()
        model = keel.load_model(_mlp(), backend="gpu", registry=registry)
        for seed in range(3):
            model.predict(_feeds(seed))
        assert not _program(model).captured
        assert registry.get("gpu").recorders == []
        assert _program(model).capture_reason == "not captured: KEEL_CUDA_GRAPHS=off"
    finally:
        monkeypatch.delenv("KEEL_CUDA_GRAPHS")
        reload_settings()


def test_host_programs_say_nothing_about_capture() -> None:
    model = keel.load_model(_mlp(), backend="cpu")
    model.predict(_feeds(0))
    model.predict(_feeds(1))
    assert _program(model).capture_reason == "" and not _program(model).captured


@pytest.mark.usefixtures("per_node_rules")
def test_a_host_node_beside_device_nodes_is_not_captured() -> None:
    # MatMuls with 16 MB of input run on the gpu; Binarizer has no gpu kernel.
    model = onnx.load_from_string(_mlp(width=2048, hidden=2048))
    graph = model.graph
    graph.output.pop()
    graph.node.append(helper.make_node("Binarizer", ["y"], ["b"], domain="ai.onnx.ml",
                                       threshold=0.0))
    graph.node.append(helper.make_node("Relu", ["b"], ["out"]))
    graph.output.append(helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4]))
    model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 3))
    keel_model = keel.load_model(model.SerializeToString(), backend="auto",
                                 registry=_registry())
    for seed in range(3):
        keel_model.predict(_feeds(seed, width=2048))
    program = _program(keel_model)
    placed = {op: backend for _, op, backend in program.steps}
    assert placed["matmul"] == "gpu" and placed["binarizer"] == "cpu", placed
    assert not program.captured
    assert program.capture_reason.startswith("not captured: node"), program.capture_reason
    assert "runs on cpu beside the gpu nodes" in program.capture_reason


class _OomCupy(_PoolCupy):
    """The fake CuPy whose allocations run out of memory once armed."""

    armed = False

    def empty(self, shape: Any, dtype: Any = np.float64) -> Any:
        if self.armed:
            raise MemoryError("Out of memory allocating 512 bytes")
        return super().empty(shape, dtype)


class _OomGpu(_FakeGpu):
    def __init__(self) -> None:
        GpuBackend.__init__(self, cupy_module=_OomCupy())


def _oom_registry() -> BackendRegistry:
    registry = BackendRegistry()
    registry.register("gpu", type("OomGpu", (_OomGpu,), {"recorders": []}), 10)
    registry.register("cpu", CpuBackend, 0)
    return registry


@pytest.mark.usefixtures("per_node_rules")
def test_a_device_out_of_memory_in_auto_mode_reruns_on_the_cpu() -> None:
    data = _mlp(width=2048, hidden=2048)
    registry = _oom_registry()
    model = keel.load_model(data, backend="auto", registry=registry)
    reference = keel.load_model(data, backend="reference")
    feeds = _feeds(0, width=2048)
    model.predict(feeds)
    assert {b for _, _, b in _program(model).steps} >= {"gpu"}
    registry.get("gpu")._cupy().armed = True
    with pytest.warns(RuntimeWarning, match="ran out of memory.*runs on the cpu from now on"):
        got = model.predict(feeds)["y"]
    np.testing.assert_allclose(got, reference.predict(feeds)["y"], rtol=1e-4, atol=1e-3)
    assert {b for _, _, b in _program(model).steps} == {"cpu"}
    assert "on the cpu since a device failed at run time here: gpu:" in model.explain()
    np.testing.assert_allclose(model.predict(_feeds(1, width=2048))["y"],
                               reference.predict(_feeds(1, width=2048))["y"],
                               rtol=1e-4, atol=1e-3)


def test_a_device_out_of_memory_on_a_pinned_gpu_raises() -> None:
    registry = _oom_registry()
    model = keel.load_model(_mlp(), backend="gpu", registry=registry)
    model.predict(_feeds(0))
    registry.get("gpu")._cupy().armed = True
    with pytest.raises(MemoryLimitError, match=r"on gpu in node .* ran out of memory: Out of "
                                               r"memory allocating 512 bytes"):
        model.predict(_feeds(1))
