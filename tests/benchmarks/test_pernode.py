"""The per-node benchmark's machinery: every step of keel's program and every node of
onnxruntime's profile timed on one and two threads, and whole runs of both (speed is
never asserted)."""

from __future__ import annotations

import pytest

from benchmarks import pernode

pytest.importorskip("onnxruntime")


def test_every_step_and_node_is_timed_on_both_thread_counts() -> None:
    result = pernode.measure("lenet", passes=1)
    assert set(result["whole_us"]) == {"keel1", "keel2", "ort1", "ort2"}
    for t in (1, 2):
        steps = result["keel_steps"][t]
        assert steps and all(0 < s["fastest"] <= s["median"] for s in steps)
        assert any(s["step"].startswith("Conv") for s in steps)
        assert {s["threads"] for s in steps if s["threads"] is not None} <= {1, t}
        nodes = result["ort_nodes"][t]
        assert nodes and all(0 <= n["fastest"] <= n["median"] for n in nodes)
    assert "summed fastest" in pernode._table(result)
