"""A planner constant changed in a running process gives fresh plans: the node plans kept
by request, the op-level path's and the compiled-plan cache are keyed by the planner's
constants (:mod:`keel.backends.planner_constants`), not only by the graph and profile."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keel import config
from keel.backends import planner_constants
from keel.backends.cpu import planner
from keel.execution.model import Model, load_model
from keel.testing.models import mlp

# The mlp's first two products: one thread at the declared least work a thread (16,384
# flops each, under MIN_FLOPS_PER_THREAD), two once it is lowered under their work.
LOWERED_FLOPS = 1000


def _gemm_threads(model: Model) -> list[int]:
    return [n["plan"]["threads"] for n in model.plan.to_dict()["nodes"] if n["op"] == "gemm"]


def test_a_model_loaded_after_a_constant_changed_is_planned_afresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = mlp().SerializeToString()
    before = _gemm_threads(load_model(model, threads=2))
    monkeypatch.setattr(planner, "MIN_FLOPS_PER_THREAD", LOWERED_FLOPS)
    after = _gemm_threads(load_model(model, threads=2))
    planner.forget()
    fresh = _gemm_threads(load_model(model, threads=2))
    assert before[:2] == [1, 1]
    assert after == fresh
    assert after[:2] == [2, 2]


def test_the_compiled_plan_cache_misses_after_a_constant_changed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KEEL_PLAN_CACHE", "on")
    config.reload_settings()
    path = tmp_path / "mlp.onnx"
    path.write_bytes(mlp().SerializeToString())
    stored = load_model(path, threads=2)
    assert _gemm_threads(load_model(path, threads=2)) == _gemm_threads(stored)
    monkeypatch.setattr(planner, "MIN_FLOPS_PER_THREAD", LOWERED_FLOPS)
    again = load_model(path, threads=2)
    assert not any(r.startswith("compiled plan loaded from cache") for r in again.plan.reasons)
    assert _gemm_threads(again)[:2] == [2, 2]


def test_the_fingerprint_follows_the_constants_and_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    first = planner_constants.refresh()
    assert planner_constants.current() == first == planner_constants.measure()
    monkeypatch.setitem(planner.BLOCKS, "epilogue_block", 1)
    assert planner_constants.current() == first              # kept until refreshed
    assert planner_constants.refresh() != first
    monkeypatch.undo()
    assert planner_constants.refresh() == first
    planner.forget()                                        # the kept plans do not count
    assert planner_constants.measure() == first


def test_the_fingerprint_is_the_same_in_every_process() -> None:
    """The compiled-plan cache on disk is found again by a new process: the fingerprint
    does not follow the string hash seed (the planner's sets of names and ops)."""
    code = "from keel.backends import planner_constants as p; print(p.measure())"
    prints = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                             text=True, env={**os.environ, "PYTHONHASHSEED": seed}
                             ).stdout.strip() for seed in ("1", "2", "3")}
    assert len(prints) == 1 and prints.pop()


def test_sets_and_enums_are_written_in_one_order() -> None:
    from keel.ops.registry import Op

    one = planner_constants._canonical(frozenset({"b", "a", Op.CONV}))
    assert one == planner_constants._canonical(frozenset({Op.CONV, "a", "b"}))
    assert one is not None and "Op.CONV" in one
    code = planner_constants._canonical({"f": lambda: 0, "n": 1})   # code: a placeholder
    assert code == planner_constants._canonical({"n": 1, "f": print}) and "n" in code


def test_a_rebound_or_changed_constant_is_written_again(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Kept texts are reused only for the very value they were written from."""
    first = planner_constants.refresh()
    monkeypatch.setattr(planner, "BY_IMAGE_L2_SHARE", planner.BY_IMAGE_L2_SHARE + 0.25)
    assert planner_constants.refresh() != first
    monkeypatch.undo()
    assert planner_constants.refresh() == first
    monkeypatch.setitem(planner.BLOCKS, "epilogue_block", 3)       # a dict, changed in place
    assert planner_constants.refresh() != first


def _epilogue_blocks(model: Model) -> set[int]:
    return {n.plan.option("epilogue_block") for n in model.plan.nodes
            if n.plan is not None and n.plan.option("epilogue_block") is not None}


def test_a_changed_block_size_reaches_the_next_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """BLOCKS is read for each plan (block_size keeps only the L2 scaling, by value): a
    model loaded after an entry changed, and a call without a plan, block by the new
    size."""
    model = mlp().SerializeToString()
    sizes = planner.caches()
    before = _epilogue_blocks(load_model(model, threads=1))
    assert before == {planner.block_size("epilogue_block", sizes)}
    monkeypatch.setitem(planner.BLOCKS, "epilogue_block", 2 * planner.BLOCKS["epilogue_block"])
    after = _epilogue_blocks(load_model(model, threads=1))
    assert after == {sizes.with_l2(planner.BLOCKS["epilogue_block"])} != before
    assert planner.block(None, "epilogue_block") in after


def test_forget_rescales_the_blocks_for_changed_cache_constants(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """block_size keeps the L2 scaling by value; planner.forget() drops it, so a changed
    EVIDENCE_RANGE reaches the next block size."""
    sizes = dataclasses.replace(planner.caches(), l2=4 << 20)
    planner.block_size("epilogue_block", sizes)
    monkeypatch.setattr(planner, "EVIDENCE_RANGE", 2)
    planner.forget()
    assert planner.block_size("epilogue_block", sizes) == sizes.with_l2(
        planner.BLOCKS["epilogue_block"])
    monkeypatch.undo()
    planner.forget()


def _if_model() -> bytes:
    """y = If(c): x * 2 else -x, two bodies placed beside the graph."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    two = helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])
    then = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])],
                             [two])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["n"])], "else", [],
                              [helper.make_tensor_value_info("n", TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), x],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                 .SerializeToString())


def test_a_scope_keeps_its_fingerprint_whatever_another_thread_measures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside once(), refresh() and current() give what the scope measured, though
    another thread measured changed constants since (a load's key and placement agree)."""
    import threading

    with planner_constants.once():
        mine = planner_constants.refresh()
        monkeypatch.setitem(planner.BLOCKS, "epilogue_block",
                            2 * planner.BLOCKS["epilogue_block"])
        other: list[str] = []
        worker = threading.Thread(target=lambda: other.append(planner_constants.refresh()))
        worker.start()
        worker.join()
        assert other and other[0] != mine
        assert planner_constants.refresh() == planner_constants.current() == mine
    assert planner_constants.current() == other[0]


def test_a_load_measures_the_constants_once(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    """A load that misses the compiled-plan cache measures the constants once, for its
    key, its placement and its If bodies' placements."""
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KEEL_PLAN_CACHE", "on")
    config.reload_settings()
    measured = planner_constants.measure
    calls: list[str] = []

    def counted() -> str:
        calls.append(measured())
        return calls[-1]

    monkeypatch.setattr(planner_constants, "measure", counted)
    path = tmp_path / "if.onnx"
    path.write_bytes(_if_model())
    model = load_model(path)
    assert any(r.startswith("subgraphs: 2 planned") for r in model.plan.reasons)
    assert len(calls) == 1
    model.predict({"c": np.array(True), "x": np.ones((2,), np.float32)})
    assert len(calls) == 1
    planner.forget()                                        # an explicit refresh measures
    assert len(calls) == 2
