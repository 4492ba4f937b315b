"""Independent branches at once: the regions the planner finds, the rule that decides
whether a region's branches run at once, the memory plan that keeps their values apart,
and runs that stay bitwise equal to the same model in order (and close to onnxruntime),
at 1, 2 and 4 threads, with a failing branch raising cleanly."""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from benchmarks.interop import feeds, inception, two_heads
from keel import config, load_model
from keel.backends.cpu import planner
from keel.errors import InvalidArgumentError
from keel.graph.importers.onnx import import_onnx
from keel.planning.interop import Region, find_regions

THREADS = (1, 2, 4)


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The rule lowered so that any two branches run at once on 2 or more threads."""
    monkeypatch.setattr(planner, "INTEROP_MIN_BRANCH_WORK", 0)
    monkeypatch.setattr(planner, "INTEROP_BUSY_SHARE", 1.0)
    monkeypatch.delenv("KEEL_INTEROP", raising=False)
    config.reload_settings()
    yield


def _load(model: onnx.ModelProto, threads: int, interop: bool,
          monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("KEEL_INTEROP", "on" if interop else "off")
    config.reload_settings()
    try:
        return load_model(model.SerializeToString(), backend="cpu", threads=threads)
    finally:
        monkeypatch.delenv("KEEL_INTEROP")
        config.reload_settings()


def _program(model: Any) -> Any:
    return next(p.program for p in model._cache.values() if p.program is not None)


# ---- finding regions ---------------------------------------------------------------------
def _names(model: onnx.ModelProto) -> list[tuple[set[str], ...]]:
    nodes = import_onnx(model).nodes
    return [tuple({nodes[i].name for i in b} for b in branches)
            for _, _, branches in find_regions(nodes)]


def test_two_heads_split_after_the_trunk() -> None:
    (a, b), = _names(two_heads(1))
    assert {n.split("_")[0] for n in a} == {"a"} and {n.split("_")[0] for n in b} == {"b"}
    assert "trunk" not in a | b


def test_inception_branches_end_before_their_concat() -> None:
    nodes = import_onnx(inception(1)).nodes
    (first, last, branches), = find_regions(nodes)
    assert nodes[first - 1].name.startswith("stem") and nodes[last + 1].name == "concat"
    assert sorted(len(b) for b in branches) == [2, 3, 4, 4]


def test_a_chain_has_no_region() -> None:
    from keel.testing.models import mlp

    assert find_regions(import_onnx(mlp()).nodes) == []


@pytest.mark.parametrize("name", ["resnet20", "bert_mini", "mobilenetv2"])
def test_branches_never_read_each_others_values(name: str) -> None:
    from benchmarks import zoo

    nodes = import_onnx(onnx.load_from_string(zoo.build(name))).nodes
    for first, last, branches in find_regions(nodes):
        made = [{o for i in b for o in nodes[i].outputs} for b in branches]
        for k, b in enumerate(branches):
            read = {v for i in b for v in nodes[i].inputs}
            others = set().union(*(m for j, m in enumerate(made) if j != k))
            assert not read & others
        covered = sorted(i for b in branches for i in b)
        assert covered == list(range(first, last + 1))


# ---- the rule --------------------------------------------------------------------------
def test_the_rule_wants_two_heavy_branches_and_idle_threads() -> None:
    heavy = planner.INTEROP_MIN_BRANCH_WORK
    small = [(heavy / 4, 1)] * 2
    idle = [[(heavy, 1)], [(heavy, 1)]]
    assert planner.plan_branches(1, idle)[0] == 1
    lanes, why = planner.plan_branches(4, idle)
    assert lanes == 2 and "at once on 2 threads" in why
    assert planner.plan_branches(4, [small, [(heavy, 1)]])[0] == 1
    busy = [[(heavy, 4)], [(heavy, 4)]]
    lanes, why = planner.plan_branches(4, busy)
    assert lanes == 1 and "already" in why
    three = [[(heavy, 1)]] * 3
    assert planner.plan_branches(2, three)[0] == 2


def test_the_plan_records_each_region_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(two_heads(1), 2, True, monkeypatch)
    model.predict(feeds(two_heads(1)))
    region, = model.plan.regions
    assert not region.concurrent                # 0.8M multiply-adds a branch: in order
    assert "fewer than two do" in region.reason
    assert f"branches a_gemm0 .. b_softmax: {region.reason}" in model.explain()
    off = _load(two_heads(1), 2, False, monkeypatch)
    off.predict(feeds(two_heads(1)))
    assert "KEEL_INTEROP=off" in off.plan.regions[0].reason
    assert Region.from_dict(region.to_dict()) == region


# ---- running -----------------------------------------------------------------------------
def _ort(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, inputs), strict=True))


@pytest.mark.parametrize("build", [lambda: two_heads(2, width=64), lambda: inception(1, 8, 12)],
                         ids=["two_heads", "inception"])
@pytest.mark.parametrize("threads", THREADS)
def test_at_once_is_bitwise_the_order_and_close_to_onnxruntime(
        build: Any, threads: int, eager: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build()
    inputs = feeds(model)
    at_once = _load(model, threads, True, monkeypatch)
    in_order = _load(model, threads, False, monkeypatch)
    expected = in_order.predict(inputs)
    reference = _ort(model, inputs)
    for _ in range(3):                      # the first run binds, the later ones replay
        got = at_once.predict(inputs)
        for name, value in expected.items():
            assert np.array_equal(got[name], value)
            np.testing.assert_allclose(got[name], reference[name], rtol=1e-4, atol=1e-5)
    lanes = _program(at_once).lanes
    assert (len(lanes) == 1) == (threads > 1)
    assert all(r.concurrent == (threads > 1) for r in at_once.plan.regions)
    assert _program(in_order).lanes == []


def test_concurrent_values_never_share_bytes(eager: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(inception(1, 8, 12), 2, True, monkeypatch)
    model.predict(feeds(inception(1, 8, 12)))
    plan = model.plan
    region, = plan.regions
    assert region.concurrent
    nodes = model._graph.nodes[region.first:region.last + 1]     # as optimized and planned
    assert [n.name for n in nodes] == [n.name for n in plan.nodes[region.first:region.last + 1]]
    memory = plan.memory_plan
    touched = {v for n in nodes for v in (*n.inputs, *n.outputs)
               if v in memory and memory.allocation(v).pool == "arena"}
    spans = sorted((memory.allocation(v).offset,
                    memory.allocation(v).offset + memory.allocation(v).nbytes, v)
                   for v in touched)
    assert len(spans) > 4
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        assert end <= start, f"{a} and {b} share arena bytes"


def _failing_heads(on_caller: bool) -> onnx.ModelProto:
    """Two branches after a Relu: one Gathers rows of a table by the ``idx`` input (an
    index out of range fails it), the other runs a MatMul; the heavier branch runs on the
    calling thread, the other on a lane thread (``on_caller``: the Gather is heavier)."""
    rng = np.random.default_rng(0)
    cols = 1 if on_caller else 16
    table = numpy_helper.from_array(rng.standard_normal((4, 16)).astype(np.float32), "table")
    w = numpy_helper.from_array(rng.standard_normal((16, cols)).astype(np.float32), "w")
    gather = [helper.make_node("Gather", ["table", "idx"], ["g"], name="gather", axis=0),
              helper.make_node("Add", ["g", "xr"], ["out_g"], name="add")]
    matmul = [helper.make_node("MatMul", ["xr", "w"], ["m"], name="matmul"),
              helper.make_node("Tanh", ["m"], ["out_m"], name="tanh")]
    branches = matmul + gather if on_caller else gather + matmul
    nodes = [helper.make_node("Relu", ["x"], ["xr"], name="relu"), *branches]
    graph = helper.make_graph(
        nodes, "failing", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16]),
                           helper.make_tensor_value_info("idx", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("out_g", TensorProto.FLOAT, [2, 16]),
         helper.make_tensor_value_info("out_m", TensorProto.FLOAT, [2, cols])], [table, w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("on_caller", [True, False], ids=["calling_thread", "lane_thread"])
def test_a_failing_branch_raises_and_the_next_run_is_whole(
        on_caller: bool, eager: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _failing_heads(on_caller)
    at_once = _load(model, 2, True, monkeypatch)
    good = {"x": np.ones((2, 16), np.float32), "idx": np.array([0, 3], np.int64)}
    expected = _load(model, 2, False, monkeypatch).predict(good)
    at_once.predict(good)
    (caller, _), = _program(at_once).lanes
    assert ("gather" in caller) == on_caller
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="gather: index 9 is out of range"):
            at_once.predict({**good, "idx": np.array([0, 9], np.int64)})
        got = at_once.predict(good)
        for name, value in expected.items():
            assert np.array_equal(got[name], value)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_branches_at_once_on_new_lane_threads(
        eager: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(two_heads(2, width=64), 2, True, monkeypatch)
    inputs = feeds(two_heads(2, width=64))
    expected = model.predict(inputs)                 # the lane threads start here
    assert _program(model).lanes
    pid = os.fork()
    if pid == 0:                                     # the child: new lane threads
        signal.alarm(60)                             # a hang ends the child, not the test
        ok = all(np.array_equal(model.predict(inputs)[k], v) for k, v in expected.items())
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_plan_cache_keeps_the_regions_and_their_memory(
        eager: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KEEL_PLAN_CACHE", "on")
    config.reload_settings()
    model = inception(1, 8, 12)
    path = tmp_path / "inception.onnx"
    path.write_bytes(model.SerializeToString())
    first = load_model(path, backend="cpu", threads=2)
    second = load_model(path, backend="cpu", threads=2)
    assert any("loaded from cache" in r for r in second.plan.reasons)
    assert second.plan.regions == first.plan.regions and first.plan.regions[0].concurrent
    assert second.plan.memory == first.plan.memory
    inputs = feeds(model)
    expected = first.predict(inputs)
    got = second.predict(inputs)
    assert all(np.array_equal(got[k], v) for k, v in expected.items())
    assert _program(second).lanes


def test_a_failing_branch_keeps_no_reference_to_the_feeds(
        eager: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import weakref

    at_once = _load(_failing_heads(False), 2, True, monkeypatch)
    idx = np.array([0, 1], np.int64)
    at_once.predict({"x": np.ones((2, 16), np.float32), "idx": idx})
    x = np.ones((2, 16), np.float32)
    ref = weakref.ref(x)
    with pytest.raises(InvalidArgumentError):
        at_once.predict({"x": x, "idx": np.array([0, 9], np.int64)})
    del x
    assert ref() is None


def test_a_sixteen_core_profile_runs_small_products_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On 16 threads a 384-wide Gemm at batch 1 streams its 147,456 floats of B over 4
    threads (the native GEMM; NumPy's products run on one), so two heads of such products
    leave most threads idle: the plan runs them at once. 1024-wide ones stream their B
    over all 16 (NumPy's split by flops, over 5: at once), and on 2 threads (a 1 GiB
    container: B read raw, split by flops) they fill both: in order."""
    from keel import native
    from keel.hardware.fakes import fake_profile

    monkeypatch.delenv("KEEL_THREADS", raising=False)
    sixteen, two = fake_profile("nvidia-no-driver"), fake_profile("container-2core-1gib")

    def plan(model: onnx.ModelProto, profile: Any) -> tuple[Any, dict[str, np.ndarray]]:
        loaded = load_model(model.SerializeToString(), backend="cpu", hardware=profile)
        return loaded, loaded.predict(feeds(model))

    narrow = two_heads(1, width=384, depth=40)
    (at_once, got), (_, expected) = plan(narrow, sixteen), plan(narrow, two)
    region, = at_once.plan.regions
    assert region.concurrent and "at once on 2 threads" in region.reason
    streams = native.available()
    assert f"{25 if streams else 6}% of the 16 threads busy" in region.reason
    wide = two_heads(1, width=1024, depth=5)
    on_sixteen, = plan(wide, sixteen)[0].plan.regions
    if streams:
        assert not on_sixteen.concurrent and "already" in on_sixteen.reason
    else:
        assert on_sixteen.concurrent and "31% of the 16 threads busy" in on_sixteen.reason
    on_two, = plan(wide, two)[0].plan.regions
    assert not on_two.concurrent and "already" in on_two.reason
    for name, value in expected.items():
        assert np.array_equal(got[name], value)
