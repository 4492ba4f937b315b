"""Measured variant choices: the cache, its safety, what placement makes of it, tune=True.

Speed is never asserted: which variant wins depends on the machine. Tests
check that measurements are taken, cached, read back, applied to the right
node only, ignored where they no longer hold, and that a tuned model still
computes what onnxruntime does.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
import pytest

import keel
from keel import config, native
from keel.backends.registry import default_registry
from keel.config import cache_dir
from keel.errors import InvalidArgumentError
from keel.execution import tuning as tuner
from keel.execution.model import Model, load_model
from keel.graph.shape_inference import infer_graph_types
from keel.planning import tuning
from keel.planning.tuning import Timing, TunedCase
from keel.testing.models import make_inputs, resnet_block

SIZE = 8
CHANNELS = 8


pytestmark = pytest.mark.usefixtures("fresh_tuning")


@pytest.fixture(scope="module")
def onnx_model() -> Any:
    return resnet_block(channels=CHANNELS, size=SIZE)


def _load(onnx_model: Any, **kwargs: Any) -> Model:
    return load_model(onnx_model.SerializeToString(), **kwargs)


def _work(model: Model) -> list[tuner.Work]:
    """The cases tuning would measure for ``model``'s first signature (batch 1)."""
    types = infer_graph_types(model.graph, {"x": (1, 3, SIZE, SIZE)})
    cpu = default_registry().get("cpu")
    return tuner.find_work(model.graph, types, model.plan, cpu)


def _entry(work: tuner.Work, winner: str, declared: str, tiers: tuple[str, ...] | None = None,
           ) -> TunedCase:
    """A made-up measurement of ``work`` in which ``winner`` won by 1.5x."""
    others = [c for c in work.candidates if c != winner]
    timings = (Timing(winner, 1e-5, 9), *(Timing(c, 1.5e-5, 9) for c in others))
    tiers = tuning.tiers_here() if tiers is None else tiers
    return TunedCase(work.case, timings, winner, declared, tiers, "2026-01-01T00:00:00+00:00")


def _declared(model: Model, node: str) -> str:
    return model.plan.node(node).variant


# ---- the cache ---------------------------------------------------------------------
def test_entries_round_trip_through_the_cache(onnx_model: Any) -> None:
    model = _load(onnx_model)
    work = _work(model)
    entries = [_entry(w, w.candidates[0], _declared(model, w.nodes[0])) for w in work]
    path = tuning.record(entries)
    assert path.parent == cache_dir() / "tuning"
    back = tuning.cached()
    assert back.status == f"loaded {path}"
    assert {k: v.to_dict() for k, v in back.entries.items()} == \
        {e.case.key: e.to_dict() for e in entries}
    assert TunedCase.from_dict(json.loads(json.dumps(entries[0].to_dict()))) == entries[0]
    assert back.token != tuning.TuningCache(path, {}, "").token     # what a plan cache keys on


def test_the_cache_is_written_atomically(onnx_model: Any, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    model = _load(onnx_model)
    first, second = _work(model)[:2]
    path = tuning.record([_entry(first, first.candidates[0], "im2col")])
    before = path.read_bytes()
    assert [p.name for p in path.parent.iterdir()] == [path.name]     # no temporary left
    assert not path.stat().st_mode & 0o002                            # not writable by others

    def fail(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(tuning.os, "replace", fail)
    with pytest.raises(InvalidArgumentError, match=r"cannot write the tuning cache.*disk full"):
        tuning.record([_entry(second, second.candidates[0], "im2col")])
    assert path.read_bytes() == before                                 # the old file intact
    assert [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.mark.parametrize("damage", ["not json", "other format", "other version",
                                    "other keel", "other machine", "wrong key"])
def test_a_corrupt_or_stale_file_is_ignored_and_rebuilt(onnx_model: Any, damage: str) -> None:
    model = _load(onnx_model)
    work = _work(model)[0]
    path = tuning.record([_entry(work, work.candidates[0], "im2col")])
    data = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{ half a fi")
    else:
        if damage == "wrong key":
            data["entries"] = {"0" * 24: next(iter(data["entries"].values()))}
        else:
            field, value = {"other format": ("format", "x"), "other version": ("version", 99),
                            "other keel": ("keel", "0.0.1"),
                            "other machine": ("fingerprint", {"cpu": "elsewhere"})}[damage]
            data[field] = value
        path.write_text(json.dumps(data))
    assert tuning.cached().entries == {}
    assert "declared rules decide" in _load(onnx_model).plan.node(work.nodes[0]).reasons[-2]
    report = model.tune(budget_s=1.0, progress=lambda *_: None)      # measures it again
    assert {c.key: c.status for c in report.cases}[work.case.key] in ("measured", "undecided")
    rebuilt = json.loads(path.read_text())
    assert rebuilt["format"] == "keel-tuning" and rebuilt["keel"] == keel.__version__
    assert tuning.cached().status == f"loaded {path}"


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX ownership")
@pytest.mark.parametrize("how", ["dir writable by others", "file writable by others",
                                 "file of another user"])
def test_an_unsafe_cache_is_refused(onnx_model: Any, how: str) -> None:
    model = _load(onnx_model)
    work = _work(model)[0]
    path = tuning.record([_entry(work, work.candidates[0], "im2col")])
    if how == "dir writable by others":
        path.parent.chmod(0o777)
    elif how == "file writable by others":
        path.chmod(0o666)
    else:
        if os.getuid() != 0:
            pytest.skip("changing a file's owner needs root")
        os.chown(path, 54321, -1)
    status = tuning.cached()
    assert status.entries == {} and status.status.startswith("refused: ")
    with pytest.raises(InvalidArgumentError, match="refusing to write the tuning cache"):
        tuning.record([_entry(work, work.candidates[0], "im2col")])


# ---- placement ----------------------------------------------------------------------
def test_a_tuned_entry_decides_the_matching_node_only(onnx_model: Any) -> None:
    before = _load(onnx_model).plan
    work = next(w for w in _work(_load(onnx_model)) if w.node.op.value == "conv"
                and len(w.nodes) == 1)
    node = work.nodes[0]
    declared = before.node(node).variant
    winner = next(c for c in work.candidates if c != declared)
    tuning.record([_entry(work, winner, declared)])
    after = _load(onnx_model).plan
    assert after.node(node).variant == winner
    other = sorted(c for c in work.candidates if c != winner)[0]
    assert f"variant {winner}: measured on this machine: {winner} 1.50x faster than {other} " \
           "(median of 9 runs)" in after.node(node).reasons
    for placed in before.nodes:
        if placed.name != node:
            assert _own_choices(after.node(placed.name)) == _own_choices(placed)


def _own_choices(placed: Any) -> Any:
    """A node's placement without the program's BLAS share (one choice for every step:
    a variant measured onto BLAS may give the program its first BLAS step)."""
    plan = placed.plan
    kept = tuple(r for r in plan.reasons if r[0] != "blas_threads")
    return dataclasses.replace(placed, plan=dataclasses.replace(plan, blas_threads=None,
                                                                reasons=kept))


def test_without_a_measurement_the_reason_names_the_rules_machine(onnx_model: Any) -> None:
    plan = _load(onnx_model).plan
    conv = next(n for n in plan.nodes if n.op == "conv")
    why = conv.reasons[-2]
    assert "declared rules decide: their evidence was measured on 2-core AMD EPYC" in why
    assert "`keel tune` times" in why
    flatten = next(n for n in plan.nodes if n.op == "flatten")
    assert "keel tune" not in " ".join(flatten.reasons)       # one kernel: nothing to tune


def test_the_machine_of_a_rule_is_its_text_up_to_the_first_top_level_comma() -> None:
    assert tuning._machine("2-core AMD EPYC (Zen 4, AVX-512), 1 thread, x") == \
        "2-core AMD EPYC (Zen 4, AVX-512)"
    assert tuning._machine("2-core AMD EPYC (AVX-512): numbers") == "2-core AMD EPYC (AVX-512)"


def test_a_tuned_variant_measured_with_other_tiers_is_ignored(onnx_model: Any) -> None:
    work = next(w for w in _work(_load(onnx_model)) if w.node.op.value == "conv")
    node = work.nodes[0]
    declared = _load(onnx_model).plan.node(node).variant
    winner = next(c for c in work.candidates if c != declared)
    other_tiers = () if tuning.tiers_here() else ("native",)
    tuning.record([_entry(work, winner, declared, tiers=other_tiers)])
    placed = _load(onnx_model).plan.node(node)
    assert placed.variant == declared
    assert "measured result ignored (measured with kernel tiers" in placed.reasons[-2]


def test_a_tuned_winner_that_cannot_run_here_is_ignored(onnx_model: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if not native.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    work = next(w for w in _work(_load(onnx_model)) if "native" in w.candidates)
    tuning.record([_entry(work, "native", "im2col")])
    assert _load(onnx_model).plan.node(work.nodes[0]).variant == "native"
    monkeypatch.setenv("KEEL_NATIVE", "off")
    config.reload_settings()
    native.reset()
    try:
        placed = _load(onnx_model).plan.node(work.nodes[0])
    finally:
        monkeypatch.delenv("KEEL_NATIVE")
        config.reload_settings()
        native.reset()
    assert placed.variant != "native"
    assert "measured result ignored (native cannot run here: native kernels unavailable" \
        in placed.reasons[-2]


def test_a_pinned_backend_stays_authoritative(onnx_model: Any) -> None:
    model = _load(onnx_model)
    tuning.record([_entry(w, w.candidates[0], "x") for w in _work(model)])
    pinned = _load(onnx_model, backend="reference").plan
    assert {n.backend for n in pinned.nodes} == {"reference"}
    assert not any("measured on this" in r or "keel tune" in r for n in pinned.nodes
                   for r in n.reasons)


def test_forced_variants_compute_what_onnxruntime_does(onnx_model: Any) -> None:
    ort = pytest.importorskip("onnxruntime")
    feeds = make_inputs(onnx_model, batch=1)
    session = ort.InferenceSession(onnx_model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)[0]
    work = _work(_load(onnx_model))
    for pick in range(3):              # each conv case with each of its candidates in turn
        tuning.record([_entry(w, w.candidates[pick % len(w.candidates)], "x") for w in work])
        model = _load(onnx_model)
        assert any(r.startswith("variant") and "measured on this machine" in r
                   for n in model.plan.nodes for r in n.reasons)
        got = model.predict(feeds)["logits"]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


# ---- measuring ----------------------------------------------------------------------
def test_load_model_tune_measures_then_plans(onnx_model: Any) -> None:
    ort = pytest.importorskip("onnxruntime")
    model = _load(onnx_model, tune=2.0)
    convs = [n for n in model.plan.nodes if n.op == "conv"]
    measured = [n for n in convs if any("measured on this machine:" in r for r in n.reasons)]
    entries = tuning.cached().entries
    assert len(entries) >= 1 and measured
    for n in measured:
        reason = next(r for r in n.reasons if "measured on this machine:" in r)
        assert n.variant in reason and "(median of" in reason
    for entry in entries.values():                   # every candidate that agreed was timed
        assert entry.winner in {t.variant for t in entry.timings} and entry.runs >= 3
    feeds = make_inputs(onnx_model, batch=1)
    expected = ort.InferenceSession(onnx_model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(model.predict(feeds)["logits"], expected, rtol=1e-4, atol=1e-5)
    again = model.tune(budget_s=1.0, progress=lambda *_: None)      # nothing left to measure
    assert {c.status for c in again.cases} <= {"cached", "undecided", "skipped"}
    assert sum(c.status == "cached" for c in again.cases) == len(entries)


def test_tune_reports_every_case_with_its_nodes(onnx_model: Any) -> None:
    model = _load(onnx_model)
    seen: list[tuple[int, int, str]] = []
    report = model.tune(budget_s=2.0, progress=lambda d, t, what: seen.append((d, t, what)))
    assert report.cases and not report.nothing_to_tune
    assert seen[-1][:2] == (len(report.cases), len(report.cases))
    named = {n for c in report.cases for n in c.nodes}
    assert named <= {n.name for n in model.graph.nodes}
    for case in report.cases:
        assert len(case.candidates) >= 2
        if case.tuned is not None:
            assert case.tuned.ratio > 0 and case.tuned.declared


def test_candidates_that_disagree_are_dropped() -> None:
    def bench(name: str, value: float) -> Any:
        return tuner._Bench(name, None, {}, {"y": np.full((4,), value, np.float32)})

    notes: list[str] = []
    kept = tuner._agreeing([bench("a", 1.0), bench("b", 1.0 + 1e-6), bench("c", 2.0)], notes)
    assert [b.variant for b in kept] == ["a", "b"]
    assert notes == ["c dropped: its output differs from a's"]
    notes.clear()
    assert tuner._agreeing([bench("a", 1.0), bench("c", 2.0)], notes) == []
    assert notes == ["no two candidates' outputs agree: nothing decided"]


def test_a_model_with_nothing_on_the_cpu_has_nothing_to_tune(onnx_model: Any) -> None:
    model = _load(onnx_model, backend="reference")
    report = model.tune(budget_s=1.0, progress=lambda *_: None)
    assert report.nothing_to_tune and report.message().startswith("nothing to tune")


@pytest.mark.parametrize("budget", [0, -1.0, float("nan"), True, "10"])
def test_a_bad_budget_is_refused(onnx_model: Any, budget: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="tuning budget must be a positive number"):
        _load(onnx_model).tune(budget_s=budget)


@pytest.mark.parametrize("shapes", [{"y": (1, 3, 8, 8)}, {"x": 5}, {"x": (1, -3, 8, 8)},
                                    {"x": (1, 3.0, 8, 8)}])
def test_bad_shapes_to_tune_are_refused(onnx_model: Any, shapes: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="give a tuple of non-negative ints for one "
                                                   "of the inputs x"):
        _load(onnx_model).tune(shapes, budget_s=1.0)


def test_the_reason_quotes_the_ratio_or_keeps_the_declared_choice_within_noise() -> None:
    case = tuning.NodeCase({"op": "conv"}, "conv")
    won = TunedCase(case, (Timing("winograd", 1.0e-3, 9), Timing("im2col", 1.31e-3, 11)),
                    "winograd", "im2col", (), "")
    assert won.reason() == ("measured on this machine: winograd 1.31x faster than im2col "
                            "(median of 9 runs)")
    kept = TunedCase(case, (Timing("winograd", 1.0e-3, 9), Timing("im2col", 1.02e-3, 9)),
                     "im2col", "im2col", (), "")
    assert kept.reason("AMD EPYC") == ("measured on AMD EPYC: im2col within 2.0% of winograd "
                                       "(median of 9 runs): the declared choice stays")


def test_outputs_agree_within_the_dtype_tolerance_with_matching_nans() -> None:
    y = np.array([1.0, -2.0, 4.0], np.float32)
    assert tuner._close(y, y + np.float32(1e-4))
    assert not tuner._close(y, y + np.float32(1e-2))
    nan = np.array([1.0, np.nan], np.float32)
    assert tuner._close(nan, nan.copy())
    assert not tuner._close(nan, np.array([1.0, 0.0], np.float32))    # an unwritten value
    assert not tuner._close(np.array([1, 2]), np.array([1, 3]))       # integers: exact
