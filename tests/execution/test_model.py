"""The Model API: loading, predict/run, validation, caching, pins, memory limits, profiling."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import keel
import keel.execution.model as model_module
import keel.planning.placement as placement
from keel.config import Settings
from keel.dtypes import DType
from keel.errors import BackendSelectionError, InvalidArgumentError, MemoryLimitError
from keel.execution.model import Model, TensorInfo, load_model
from keel.testing.models import make_inputs, mlp

BACKENDS = ("reference", "cpu")


@pytest.fixture(scope="module")
def mlp_proto() -> Any:
    return mlp(in_features=16, hidden=(32, 16), classes=4)


def two_input_model() -> Any:
    """z = a + b with a shared symbolic batch, plus an optional input with a default."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 3])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 3])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [3])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 3])
    default = helper.make_tensor("c", TensorProto.FLOAT, [3], [10.0, 20.0, 30.0])
    nodes = [helper.make_node("Add", ["a", "b"], ["s"], name="add1"),
             helper.make_node("Add", ["s", "c"], ["z"], name="add2")]
    graph = helper.make_graph(nodes, "two", [a, b, c], [z], [default])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# ---- loading and describing ---------------------------------------------------
def test_load_from_path_bytes_and_proto(tmp_path: Path, mlp_proto: Any) -> None:
    path = tmp_path / "net.onnx"
    onnx.save(mlp_proto, path)
    feeds = make_inputs(mlp_proto, 3)
    results = [load_model(src, backend="reference").predict(feeds)["probs"]
               for src in (path, str(path), mlp_proto.SerializeToString(), mlp_proto)]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    assert load_model(path).name == "mlp"


def test_keel_load_model_is_the_public_entry(mlp_proto: Any) -> None:
    assert keel.load_model is load_model
    assert isinstance(keel.load_model(mlp_proto), keel.Model)


def test_inputs_and_outputs_keep_symbolic_dims(mlp_proto: Any) -> None:
    m = load_model(mlp_proto)
    assert m.inputs == [TensorInfo("x", ("batch", 16), DType.FLOAT32)]
    assert m.outputs == [TensorInfo("probs", ("batch", 4), DType.FLOAT32)]
    assert m.inputs[0].to_dict() == {"name": "x", "shape": ["batch", 16], "dtype": "float32"}


def test_inputs_with_a_default_are_optional() -> None:
    m = load_model(two_input_model(), backend="reference")
    assert [i.name for i in m.inputs] == ["a", "b"]
    a = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(m.predict({"a": a, "b": a})["z"], [[12, 22, 32]] * 2)
    given = m.predict({"a": a, "b": a, "c": np.zeros(3, np.float32)})["z"]
    np.testing.assert_array_equal(given, np.full((2, 3), 2.0))


def test_not_a_model_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match=r"a model is a path.*got int"):
        load_model(42)
    with pytest.raises(keel.ModelFormatError):
        load_model(b"not a protobuf at all")


def test_bad_options_are_rejected(mlp_proto: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="optimization_level 'max' is not allowed"):
        load_model(mlp_proto, optimization_level="max")
    with pytest.raises(InvalidArgumentError, match="precision 'fp8' is not allowed"):
        load_model(mlp_proto, precision="fp8")
    with pytest.raises(InvalidArgumentError, match="not a size"):
        load_model(mlp_proto, memory_limit="lots")


# ---- running --------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_predict_run_and_async_agree(backend: str, mlp_proto: Any) -> None:
    m = load_model(mlp_proto, backend=backend)
    feeds = make_inputs(mlp_proto, 5)
    out = m.predict(feeds)
    assert set(out) == {"probs"} and out["probs"].shape == (5, 4)
    np.testing.assert_allclose(out["probs"].sum(axis=1), 1.0, rtol=1e-5)
    (listed,) = m.run(None, feeds)
    np.testing.assert_array_equal(listed, out["probs"])
    assert m.run(["probs"], feeds)[0].shape == (5, 4)
    async_out = asyncio.run(m.predict_async(feeds))
    np.testing.assert_array_equal(async_out["probs"], out["probs"])


def test_run_rejects_unknown_output_names(mlp_proto: Any) -> None:
    m = load_model(mlp_proto)
    with pytest.raises(InvalidArgumentError, match="unknown output 'logits'; the model's "
                                                   "outputs are: probs"):
        m.run(["logits"], make_inputs(mlp_proto, 1))


@pytest.mark.parametrize(("feeds", "message"), [
    ({}, r"input 'a' is missing; expected float32\[batch, 3\]"),
    ({"a": np.ones((2, 3), np.float32), "b": np.ones((2, 3), np.float32),
      "d": np.ones(3, np.float32)}, "unknown input 'd'; the model's inputs are: a, b"),
    ({"a": np.ones((2, 3, 1), np.float32), "b": np.ones((2, 3), np.float32)},
     r"input 'a' has rank 3 \(shape \(2, 3, 1\)\); expected rank 2"),
    ({"a": np.ones((2, 4), np.float32), "b": np.ones((2, 3), np.float32)},
     r"input 'a' has shape \(2, 4\); expected float32\[batch, 3\] \(dimension 1 must be 3\)"),
    ({"a": np.ones((2, 3), np.float64), "b": np.ones((2, 3), np.float32)},
     "input 'a' has dtype float64; expected float32"),
    ({"a": np.ones((2, 3), np.float32), "b": np.ones((5, 3), np.float32)},
     "dimension 'batch' is 2 in input 'a' but 5 in input 'b'"),
    ({"a": "text", "b": np.ones((2, 3), np.float32)}, "input 'a' must be an array, got str"),
])
def test_input_validation_names_the_input(feeds: dict[str, Any], message: str) -> None:
    m = load_model(two_input_model(), backend="reference")
    with pytest.raises(InvalidArgumentError, match=message):
        m.predict(feeds)


def test_feeds_must_be_a_mapping(mlp_proto: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=r"feeds must be a dict.*got list"):
        load_model(mlp_proto).predict([np.ones((1, 16), np.float32)])  # type: ignore[arg-type]


def test_lists_are_read_in_the_declared_dtype() -> None:
    m = load_model(two_input_model(), backend="reference")
    out = m.predict({"a": [[1, 2, 3]], "b": [[0.5, 0.5, 0.5]]})["z"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [[11.5, 22.5, 33.5]])


def test_one_program_per_input_signature(monkeypatch: pytest.MonkeyPatch,
                                         mlp_proto: Any) -> None:
    calls: list[Any] = []
    real = placement.place           # what Model._place imports when it places

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(placement, "place", counting)
    m = load_model(mlp_proto, backend="reference")
    assert len(calls) == 1                        # the first signature, planned at load
    for batch in (1, 4, 4, 1, 4):
        m.predict(make_inputs(mlp_proto, batch))
    assert len(calls) == 2
    assert m.plan.input_shapes == {"x": (4, 16)}


# ---- backends and precision -----------------------------------------------------
def test_set_backend_pins_every_node_and_bad_pins_fail_early(mlp_proto: Any) -> None:
    m = load_model(mlp_proto)
    m.set_backend("reference")
    assert set(m.plan.backends) == {"reference"}
    with pytest.raises(BackendSelectionError, match="'nope' cannot be used"):
        m.set_backend("nope")
    assert m.backend == "reference"
    assert m.predict(make_inputs(mlp_proto, 2))["probs"].shape == (2, 4)


def test_environment_backend_is_a_pin(monkeypatch: pytest.MonkeyPatch, mlp_proto: Any) -> None:
    monkeypatch.setattr(model_module, "settings", lambda: Settings(backend="reference"))
    m = load_model(mlp_proto)
    assert m.backend == "reference" and set(m.plan.backends) == {"reference"}


def test_precision_fp64_computes_in_float64_and_returns_declared_dtype(mlp_proto: Any) -> None:
    feeds = make_inputs(mlp_proto, 3)
    base = load_model(mlp_proto, backend="reference").predict(feeds)["probs"]
    m = load_model(mlp_proto, backend="reference", precision="fp64")
    assert {n.precision for n in m.plan.nodes} == {"fp64"}
    out = m.predict(feeds)["probs"]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, base, rtol=1e-5, atol=1e-6)


def test_int8_precision_quantizes_a_float_model_on_load(mlp_proto: Any) -> None:
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    ref = load_model(mlp_proto).run(None, {"x": x})[0]
    m = load_model(mlp_proto, precision="int8")
    ints = [a for a in m.graph.initializers.values() if a.dtype == np.int8]
    assert ints, "int8 precision must keep int8 weights in memory"
    out = m.run(None, {"x": x})[0]
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < 2e-2


# ---- plans, explain, memory -------------------------------------------------------
def test_plan_and_explain_answer_before_running(mlp_proto: Any) -> None:
    m = load_model(mlp_proto, backend="reference")
    plan = m.plan
    assert plan.input_shapes == {"x": (1, 16)}
    assert plan.peak_bytes > plan.memory["weight_bytes"] > 0
    json.dumps(plan.to_dict())
    text = m.explain()
    for word in ("model 'mlp'", "backend reference", "peak memory", "reference",
                 "planned for input shapes x=(1, 16)"):
        assert word in text
    for n in plan.nodes:
        assert n.name in text


def test_impossible_memory_limit_fails_at_load_stating_the_peak(mlp_proto: Any) -> None:
    peak = load_model(mlp_proto, backend="reference").plan.peak_bytes
    with pytest.raises(MemoryLimitError, match=rf"needs a peak of .*\({peak} bytes\)") as info:
        load_model(mlp_proto, backend="reference", memory_limit=peak - 1)
    assert info.value.required_bytes == peak
    assert info.value.limit_bytes == peak - 1


def test_set_memory_limit_checks_before_running(mlp_proto: Any) -> None:
    m = load_model(mlp_proto, backend="reference")
    with pytest.raises(MemoryLimitError):
        m.set_memory_limit(100)
    assert m.memory_limit is None
    m.set_memory_limit("10MB")
    assert m.memory_limit == 10_000_000
    m.set_memory_limit(None)
    assert m.memory_limit is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_limit_that_fits_only_in_chunks_runs_chunked(backend: str, mlp_proto: Any) -> None:
    feeds = make_inputs(mlp_proto, 64, seed=7)
    whole_model = load_model(mlp_proto, backend=backend)
    whole = whole_model.predict(feeds)["probs"]
    big = whole_model.plan.peak_bytes
    small = load_model(mlp_proto, backend=backend).plan.peak_bytes   # batch 1
    m = load_model(mlp_proto, backend=backend, memory_limit=(big + small) // 2)
    chunked = m.predict(feeds)["probs"]
    np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-7)
    hint = m.plan.chunk_size_hint
    assert hint is not None and 1 <= hint < 64
    assert any("chunks of up to" in r for r in m.plan.reasons)
    assert "chunked:" in m.explain()


def test_chunked_run_with_an_impossible_batch_limit_raises_before_running(
        mlp_proto: Any) -> None:
    m = load_model(mlp_proto, backend="reference")
    one = m.plan.peak_bytes
    m.set_memory_limit(one)          # fits one item, with the outputs of one item
    with pytest.raises(MemoryLimitError, match="needs a peak of"):
        # The whole batch's outputs alone exceed what one-item chunks leave room for.
        m.predict(make_inputs(mlp_proto, 100_000))


# ---- profiling --------------------------------------------------------------------
def test_profiling_writes_a_chrome_trace(tmp_path: Path, mlp_proto: Any) -> None:
    m = load_model(mlp_proto, backend="reference")
    m.enable_profiling()
    m.predict(make_inputs(mlp_proto, 2))
    assert m.profiler is not None and m.profiler.events
    path = m.end_profiling(tmp_path / "profile.json")
    events = json.loads(Path(path).read_text())
    assert {e["cat"] for e in events} == {"Session", "Node"}
    assert m.profiler is None
    with pytest.raises(InvalidArgumentError, match="profiling is not enabled"):
        m.end_profiling()


def test_intermediates_return_every_value(mlp_proto: Any) -> None:
    m = load_model(mlp_proto, backend="reference", optimization_level="none")
    values = m.intermediates(make_inputs(mlp_proto, 2))
    produced = {o for n in m.graph.nodes for o in n.outputs if o}
    assert produced <= set(values)


def test_threads_option_builds_its_own_cpu_backend(mlp_proto: Any) -> None:
    m = load_model(mlp_proto, backend="cpu", threads=1)
    assert isinstance(m, Model)
    np.testing.assert_allclose(
        m.predict(make_inputs(mlp_proto, 3))["probs"],
        load_model(mlp_proto, backend="reference").predict(make_inputs(mlp_proto, 3))["probs"],
        rtol=1e-5, atol=1e-6)


def test_symbolic_dims_that_cannot_be_one_are_planned_without_sizes() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, None])
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [2, -1])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "halves",
                              [x], [y], [shape])
    m = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                   backend="reference")
    assert any("planned without sizes" in r for r in m.plan.reasons)
    out = m.predict({"x": np.arange(6, dtype=np.float32)})["y"]
    np.testing.assert_array_equal(out, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert m.plan.input_shapes == {"x": (6,)}


def test_keel_files_load_from_path_and_bytes(tmp_path: Path, mlp_proto: Any) -> None:
    from keel.formats.keel_format import save_keel
    from keel.graph.importers.onnx import import_onnx

    path = tmp_path / "net.keel"
    save_keel(import_onnx(mlp_proto), path)
    feeds = make_inputs(mlp_proto, 3)
    want = load_model(mlp_proto, backend="reference").predict(feeds)["probs"]
    for src in (path, path.read_bytes()):
        got = load_model(src, backend="reference").predict(feeds)["probs"]
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(keel.ModelFormatError):
        load_model(path.read_bytes()[:100])


def test_steady_state_predict_allocates_little_beyond_outputs() -> None:
    import tracemalloc

    proto = mlp(in_features=256, hidden=(1024, 1024), classes=16)
    m = load_model(proto, backend="cpu")
    feeds = make_inputs(proto, 64)
    m.predict(feeds)                               # plan, compile, bind the arena
    intermediates = m.plan.memory["arena_bytes"]["cpu"]
    assert intermediates >= 2 * 64 * 1024 * 4      # two 256 KiB activations at least
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = m.predict(feeds)
        peak = tracemalloc.get_traced_memory()[1] - base
        del result
    finally:
        tracemalloc.stop()
    assert peak < m.plan.memory["output_bytes"] + 64 * 1024, (peak, intermediates)


@pytest.mark.parametrize("limit", [float("nan"), float("inf")])
def test_memory_limit_must_be_finite(mlp_proto: Any, limit: Any) -> None:
    model = load_model(mlp_proto)
    with pytest.raises(InvalidArgumentError, match="must be a finite byte count"):
        model.set_memory_limit(limit)
    with pytest.raises(InvalidArgumentError, match="must be a finite byte count"):
        load_model(mlp_proto, memory_limit=limit)


def test_run_rejects_output_names_that_are_not_a_list(mlp_proto: Any) -> None:
    model = load_model(mlp_proto)
    feeds = make_inputs(mlp_proto, 2)
    with pytest.raises(InvalidArgumentError, match=r"output_names must be a list .* got int"):
        model.run(5, feeds)  # type: ignore[arg-type]


def test_end_profiling_to_an_unwritable_path(mlp_proto: Any, tmp_path: Path) -> None:
    model = load_model(mlp_proto, enable_profiling=True)
    model.predict(make_inputs(mlp_proto, 2))
    with pytest.raises(InvalidArgumentError, match="cannot write the profile to"):
        model.end_profiling(tmp_path)
