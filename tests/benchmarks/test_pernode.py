"""The per-node benchmark's machinery: every step of keel's program and every node of
onnxruntime's profile timed on one and two threads, and whole runs of both (speed is
never asserted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import pernode

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def lenet() -> dict[str, Any]:
    return pernode.measure("lenet", passes=1)


def test_every_step_and_node_is_timed_on_both_thread_counts(lenet: dict[str, Any]) -> None:
    result = lenet
    assert set(result["whole_us"]) == {"keel1", "keel2", "ort1", "ort2"}
    for t in (1, 2):
        steps = result["keel_steps"][t]
        assert steps and all(0 < s["fastest"] <= s["median"] for s in steps)
        assert any(s["step"].startswith("Conv") for s in steps)
        assert {s["threads"] for s in steps if s["threads"] is not None} <= {1, t}
        nodes = result["ort_nodes"][t]
        assert nodes and all(0 <= n["fastest"] <= n["median"] for n in nodes)
    assert "summed fastest" in pernode._table(result)


@pytest.mark.parametrize(("weight", "x", "y", "kind"), [
    ((32, 3, 3, 3), (1, 3, 224, 224), (1, 32, 112, 112), "stem"),
    ((96, 1, 3, 3), (1, 96, 112, 112), (1, 96, 56, 56), "depthwise 3x3 s2"),
    ((960, 1, 3, 3), (1, 960, 7, 7), (1, 960, 7, 7), "depthwise 3x3 s1"),
    ((576, 96, 1, 1), (1, 96, 14, 14), (1, 576, 14, 14), "1x1 expansion 14x14"),
    ((96, 576, 1, 1), (1, 576, 14, 14), (1, 96, 14, 14), "1x1 projection 14x14"),
    ((128, 64, 1, 1), (1, 64, 56, 56), (1, 128, 28, 28), "conv 1x1 s2"),
    ((64, 64, 3, 3), (1, 64, 56, 56), (1, 64, 56, 56), "conv 3x3 s1"),
    ((64, 64, 1, 1), (1, 64, 56, 56), (1, 64, 56, 56), "1x1 mixing 56x56"),
    ((960, 1, 3, 3), (1, 960, 7, 7), (1, 960, 4, 4), "depthwise 3x3 s2"),
    ((256, 128, 1, 1), (1, 128, 7, 7), (1, 256, 4, 4), "conv 1x1 s2"),
    ((16, 6, 5, 5), (1, 6, 14, 14), (1, 16, 10, 10), "conv 5x5 s1"),
    ((64, 64, 3, 3), (1, 64, "h", "w"), (1, 64, "h2", "w2"), "conv 3x3 s?"),
])
def test_a_conv_kind_comes_from_its_shapes(weight: tuple[int, ...], x: tuple[int, ...],
                                           y: tuple[int, ...], kind: str) -> None:
    assert pernode.conv_kind(weight, x, y) == kind


def test_both_sides_sum_to_the_same_kinds_of_conv(lenet: dict[str, Any]) -> None:
    result = lenet
    for t in (1, 2):
        rows = {r["kind"]: r for r in pernode.by_kind(result, t)}
        convs = {k: r for k, r in rows.items() if k == "stem" or k.startswith("conv")}
        assert set(convs) == {"stem", "conv 5x5 s1"}
        assert all(r["keel_nodes"] == r["ort_nodes"] == 1 for r in convs.values())
        keel = sum(s["fastest"] for s in result["keel_steps"][t])
        assert sum(r["keel_fastest"] for r in rows.values()) == pytest.approx(keel)
        ort = sum(n["fastest"] for n in result["ort_nodes"][t])
        assert sum(r["ort_fastest"] for r in rows.values()) == pytest.approx(ort)
    assert "1 thread(s)" in pernode._kinds_table(result)


def _event(node: str, op: str, ins: list[list[int]], out: list[int], dur: int) -> dict[str, Any]:
    """One node's kernel time as onnxruntime 1.x writes it to its profile."""
    return {"cat": "Node", "name": f"{node}_kernel_time", "dur": dur,
            "args": {"op_name": op, "input_type_shape": [{"float": s} for s in ins],
                     "output_type_shape": [{"float": out}]}}


def test_onnxruntime_nodes_take_the_kind_of_the_conv_they_run(tmp_path: Path) -> None:
    # Shapes as onnxruntime's own MobileNetV2 profile reports them: NCHWc convs (the
    # 144 -> 24 projection with its channels padded to 32 and the residual as a fourth
    # input), a FusedConv, and a node that is no conv.
    events = [
        _event("clip_25_nchwc", "Conv", [[1, 32, 112, 112], [32, 1, 3, 3], [32]],
               [1, 32, 112, 112], 90),
        _event("clip_60_nchwc", "Conv", [[1, 96, 112, 112], [96, 1, 3, 3], [96]],
               [1, 96, 56, 56], 70),
        _event("clip_47_nchwc", "Conv", [[1, 16, 112, 112], [96, 16, 1, 1], [96]],
               [1, 96, 112, 112], 300),
        _event("bn_104_nchwc", "Conv",
               [[1, 144, 56, 56], [32, 144, 1, 1], [32], [1, 32, 56, 56]], [1, 32, 56, 56], 120),
        _event("relu_7", "FusedConv", [[1, 64, 14, 14], [384, 64, 1, 1], [384]],
               [1, 384, 14, 14], 50),
        _event("clip_60_nchwc", "Conv", [[1, 96, 112, 112], [96, 1, 3, 3], [96]],
               [1, 96, 56, 56], 60),
        _event("flatten", "Flatten", [[1, 1280, 1, 1]], [1, 1280], 3),
        {"cat": "Session", "name": "model_run", "dur": 700, "args": {}},
    ]
    trace = tmp_path / "profile.json"
    trace.write_text(json.dumps(events))
    times, kinds = pernode._ort_nodes(str(trace))
    assert kinds == {"clip_25_nchwc": "depthwise 3x3 s1", "clip_60_nchwc": "depthwise 3x3 s2",
                     "clip_47_nchwc": "1x1 expansion 112x112",
                     "bn_104_nchwc": "1x1 projection 56x56", "relu_7": "1x1 expansion 14x14",
                     "flatten": "Flatten"}
    assert times["clip_60_nchwc"] == [70.0, 60.0]


def test_mobilenetv2_convs_are_the_same_kinds_on_both_sides() -> None:
    result = pernode.measure("mobilenetv2", passes=1)
    for t in (1, 2):
        rows = pernode.by_kind(result, t)
        convs = [r for r in rows if r["kind"] == "stem" or r["kind"].startswith(("1x1", "depth"))]
        assert sum(r["keel_nodes"] for r in convs) == 52
        assert all(r["keel_nodes"] == r["ort_nodes"] for r in convs), convs
        ort = sum(n["fastest"] for n in result["ort_nodes"][t])
        assert sum(r["ort_fastest"] for r in rows) == pytest.approx(ort)


def test_a_kind_only_one_side_has_shows_no_ratio() -> None:
    def node(kind: str) -> dict[str, Any]:
        return {"kind": kind, "median": 6.0, "fastest": 4.0}

    result = {"model": "m", "batch": 1, "passes": 1,
              "keel_steps": {t: [node("stem")] for t in (1, 2)},
              "ort_nodes": {t: [node("stem"), node("ReorderOutput")] for t in (1, 2)}}
    lines = pernode._kinds_table(result).splitlines()
    reorder = [line.split() for line in lines if "ReorderOutput" in line]
    stem = [line.split() for line in lines if "stem" in line]
    assert len(reorder) == 2 and all(r[-1] == r[5] == "-" for r in reorder)
    assert all(s[-1] == s[5] == "1.00" for s in stem)


def test_json_and_kinds_cannot_be_asked_together(monkeypatch: pytest.MonkeyPatch) -> None:
    def measured(*args: Any) -> dict[str, Any]:
        raise AssertionError("measured: the arguments were taken")

    monkeypatch.setattr(pernode, "measure", measured)
    with pytest.raises(SystemExit):
        pernode.main(["--model", "lenet", "--passes", "1", "--json", "--kinds"])


@pytest.mark.parametrize("flag", ["--batch", "--passes"])
def test_a_batch_or_passes_below_one_is_refused(flag: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def measured(*args: Any) -> dict[str, Any]:
        raise AssertionError("measured: the arguments were taken")

    monkeypatch.setattr(pernode, "measure", measured)
    with pytest.raises(SystemExit):
        pernode.main(["--model", "lenet", flag, "0"])


def test_any_thread_counts_are_measured_and_shown() -> None:
    result = pernode.measure("lenet", passes=1, threads=(3,))
    assert result["threads"] == [3] and list(result["keel_steps"]) == [3]
    assert list(result["ort_nodes"]) == [3] and set(result["whole_us"]) == {"keel3", "ort3"}
    table = pernode._table(result)
    assert "3 thread(s)" in table and "2 thread(s)" not in table
    assert "  3 thread(s)" in pernode._kinds_table(result)


@pytest.mark.parametrize("text", ["0", "1,,2", "a", "2,2"])
def test_bad_thread_counts_are_refused(text: str) -> None:
    with pytest.raises(SystemExit):
        pernode.main(["--model", "lenet", "--threads", text])
