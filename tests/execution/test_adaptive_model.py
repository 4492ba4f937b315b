"""Seed 003 and performance hints on real models: plans before running, identical results."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from keel import config
from keel.cli import app
from keel.errors import InvalidArgumentError, MemoryLimitError
from keel.execution.model import load_model
from keel.planning.policy import RuntimePolicy
from keel.testing.cli import printed_json
from keel.testing.models import make_inputs, mlp

BACKENDS = ("reference", "cpu")


@pytest.fixture(scope="module")
def proto() -> Any:
    return mlp(in_features=16, hidden=(32, 16), classes=4)


def assert_same(backend: str, got: np.ndarray, want: np.ndarray) -> None:
    """Bitwise on the reference backend; on cpu within the chunked-run tolerance (a GEMM
    computes the rows of a short tail panel in another order than full panels)."""
    if backend == "reference":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@dataclass
class FakeTelemetry:
    free: int
    source: str = "fake"

    def available_bytes(self, device: str) -> int | None:
        return self.free if device == "cpu" else None


def test_a_telemetry_snapshot_is_taken_at_plan_time_by_default(proto: Any) -> None:
    m = load_model(proto, backend="cpu")
    plan = m.adaptive_plan
    assert plan is not None and plan.telemetry is not None
    assert plan.telemetry["source"] in ("static", "nvml")
    assert any(r.startswith("telemetry (") for r in m.plan.reasons)
    m.set_telemetry(lambda: FakeTelemetry(10**9))
    m.predict(make_inputs(proto, 2))
    assert m.adaptive_plan is not None and m.adaptive_plan.telemetry == {"source": "fake"}
    m.set_telemetry(None)
    m.predict(make_inputs(proto, 3))
    assert m.adaptive_plan is not None and m.adaptive_plan.telemetry is None


def test_a_telemetry_source_that_leaves_no_room_is_refused_like_a_limit(proto: Any) -> None:
    m = load_model(proto, backend="cpu", memory_limit="1GB")
    with pytest.raises(MemoryLimitError, match="cannot be met"):
        m.set_telemetry(lambda: FakeTelemetry(64))
    m.predict(make_inputs(proto, 2))                 # the old source is kept
    assert m.adaptive_plan is not None
    assert m.adaptive_plan.telemetry is not None
    assert m.adaptive_plan.telemetry["source"] in ("static", "nvml")


@pytest.mark.parametrize("backend", BACKENDS)
def test_throughput_splits_the_batch_into_concurrent_streams_with_identical_results(
        backend: str, proto: Any) -> None:
    feeds = make_inputs(proto, 37, seed=3)
    whole = load_model(proto, backend=backend).predict(feeds)["probs"]
    m = load_model(proto, backend=backend, hint="throughput", threads=2)
    for _ in range(2):                     # the second run reuses the streams' programs
        assert_same(backend, m.predict(feeds)["probs"], whole)
    plan = m.adaptive_plan
    assert plan is not None and plan.hint == "throughput" and m.hint == "throughput"
    if backend == "cpu":
        assert (plan.streams, plan.threads_per_stream, plan.batch_split) == (2, 1, (19, 18))
        assert m.plan.chunk_size_hint == 19
        assert "2 streams of 1 thread (batch split 19+18)" in m.explain()
    else:                                  # streams split cpu cores only
        assert plan.streams == 1
        assert any("this runs on reference" in r for r in plan.reasons)


def test_latency_runs_one_stream_on_every_core_and_does_not_split(proto: Any) -> None:
    m = load_model(proto, backend="cpu", hint="latency", threads=2)
    feeds = make_inputs(proto, 8)
    np.testing.assert_array_equal(m.predict(feeds)["probs"],       # the same program
                                  load_model(proto, backend="cpu").predict(feeds)["probs"])
    plan = m.adaptive_plan
    assert plan is not None
    assert (plan.streams, plan.threads_per_stream, plan.batch_split) == (1, 2, (8,))
    assert any("latency hint: one stream using all 2" in r for r in plan.reasons)


def test_the_hint_comes_from_the_policy_and_bad_hints_name_the_allowed_values(
        proto: Any) -> None:
    m = load_model(proto, policy=RuntimePolicy(hint="throughput"))
    assert m.hint == "throughput"
    assert load_model(proto, policy=RuntimePolicy(hint="throughput"), hint="latency").hint \
        == "latency"
    with pytest.raises(InvalidArgumentError, match="use one of none, latency, throughput"):
        load_model(proto, hint="fastest")
    with pytest.raises(InvalidArgumentError, match="none, latency, throughput"):
        RuntimePolicy(hint="fastest")


def _limit_for_chunks(proto: Any, batch: int) -> int:
    big = load_model(proto, backend="cpu")
    big.predict(make_inputs(proto, batch))
    return (big.plan.peak_bytes + load_model(proto, backend="cpu").plan.peak_bytes) // 2


def test_chunks_grow_at_boundaries_and_the_history_informs_the_next_plan(
        proto: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    config.reload_settings()
    feeds = make_inputs(proto, 64, seed=5)
    whole = load_model(proto, backend="cpu").predict(feeds)["probs"]
    limit = _limit_for_chunks(proto, 64)
    first = load_model(proto, backend="cpu", memory_limit=limit)
    assert_same("cpu", first.predict(feeds)["probs"], whole)
    plan = first.adaptive_plan
    assert plan is not None and plan.chunked
    assert any("no runtime history" in r for r in plan.reasons)
    assert any("the chunk grows from" in r for r in plan.reasons)
    assert_same("cpu", first.predict(feeds)["probs"], whole)  # times recorded
    assert (tmp_path / "runtime-history.json").is_file()
    later = load_model(proto, backend="cpu", memory_limit=limit)
    assert_same("cpu", later.predict(feeds)["probs"], whole)
    assert later.adaptive_plan is not None
    assert any(r.startswith("runtime history on this machine")
               for r in later.adaptive_plan.reasons)


def test_a_corrupt_history_is_rebuilt_and_never_breaks_a_run(
        proto: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    config.reload_settings()
    (tmp_path / "runtime-history.json").write_text("{corrupt")
    feeds = make_inputs(proto, 64, seed=5)
    m = load_model(proto, backend="cpu", memory_limit=_limit_for_chunks(proto, 64))
    for _ in range(2):
        m.predict(feeds)
    data = json.loads((tmp_path / "runtime-history.json").read_text())
    assert data["format"] == "keel-runtime-history" and data["entries"]


def test_telemetry_shrinks_chunks_with_identical_results(proto: Any) -> None:
    feeds = make_inputs(proto, 64, seed=9)
    whole = load_model(proto, backend="cpu").predict(feeds)["probs"]
    limit = _limit_for_chunks(proto, 64)
    m = load_model(proto, backend="cpu", memory_limit=limit)
    tight = (limit + m.plan.peak_bytes) // 2       # still above one item's peak (the weights)
    calls: list[int] = []

    def source() -> FakeTelemetry:      # roomy at plan time and after chunk 1, then tight
        calls.append(1)
        return FakeTelemetry(limit if len(calls) <= 2 else tight)

    m.set_telemetry(source)
    calls.clear()
    assert_same("cpu", m.predict(feeds)["probs"], whole)
    assert m.adaptive_plan is not None
    assert any("shrinks to" in r for r in m.adaptive_plan.reasons)


def mixed_model() -> Any:
    """y = cast(cast(x, double) * 2, float): fp32 and fp64 nodes in one graph."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    two = helper.make_tensor("two", TensorProto.DOUBLE, [], [2.0])
    nodes = [helper.make_node("Cast", ["x"], ["xd"], to=TensorProto.DOUBLE, name="up"),
             helper.make_node("Mul", ["xd", "two"], ["yd"], name="mul"),
             helper.make_node("Cast", ["yd"], ["y"], to=TensorProto.FLOAT, name="down"),
             helper.make_node("Relu", ["y"], ["r"], name="relu")]
    r = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["batch", 3])
    graph = helper.make_graph(nodes, "mixed", [x], [y, r], [two])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_mixed_dtype_graph_gets_a_precision_plan() -> None:
    m = load_model(mixed_model(), backend="reference", optimization_level="none")
    plan = m.adaptive_plan
    assert plan is not None
    assert set(plan.precision_plan) >= {"fp32", "fp64"}
    assert plan.precision == "mixed"
    assert "mul" in plan.precision_plan["fp64"] and "relu" in plan.precision_plan["fp32"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(m.predict({"x": x})["y"], x * 2)


def test_keel_plan_shows_the_hint_and_the_adaptive_plan(tmp_path: Any, proto: Any) -> None:
    path = tmp_path / "net.onnx"
    path.write_bytes(proto.SerializeToString())
    runner = CliRunner()
    result = runner.invoke(app, ["plan", str(path), "--hint", "throughput", "--json"])
    assert result.exit_code == 0, result.output
    data = printed_json(result)
    adaptive = data["model"]["adaptive"]
    assert adaptive["hint"] == "throughput"
    assert adaptive["telemetry"]["source"] in ("static", "nvml")
    assert {"precision_plan", "streams", "threads_per_stream", "batch_split",
            "residency", "chunk_size", "reasons"} <= set(adaptive)
    bad = runner.invoke(app, ["plan", str(path), "--hint", "fast"])
    assert bad.exit_code != 0
    assert "latency" in bad.output or "latency" in str(bad.exception)


class DeviceArray:
    """An array-like that reports living on a GPU (as a CuPy array's ``device`` does)."""

    device = "cuda:0"

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._array if dtype is None else self._array.astype(dtype)


def test_residency_of_the_feeds_reaches_the_plan(proto: Any) -> None:
    m = load_model(proto, backend="auto")
    feeds = make_inputs(proto, 4)
    want = m.predict(feeds)["probs"]
    assert m.adaptive_plan is not None and m.adaptive_plan.residency == "cpu"
    got = m.predict({k: DeviceArray(v) for k, v in feeds.items()})["probs"]
    np.testing.assert_array_equal(got, want)
    plan = m.adaptive_plan
    assert plan is not None and plan.residency == "gpu"
    if "gpu" not in m.plan.backends:          # no GPU here: the inputs are copied first
        assert plan.runtime != "gpu"
        assert any("the inputs live on gpu, where no node runs" in r for r in plan.reasons)
    else:
        assert plan.runtime == "gpu"


def test_keel_hint_reaches_a_bare_load_model(proto: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_HINT", "latency")
    config.reload_settings()
    assert load_model(proto, backend="cpu").hint == "latency"
    assert load_model(proto, backend="cpu", hint="throughput").hint == "throughput"
