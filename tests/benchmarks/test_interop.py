"""The inter-op benchmark's machinery: each case loaded as planned and in order, results
bitwise equal, what the plan chose and the load written down (speed is never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import interop
from keel.backends.cpu import planner


@pytest.mark.parametrize("min_work, at_once", [(None, 0), (0, 1)])
def test_the_script_writes_both_runs_and_the_rule(tmp_path: Path, min_work: int | None,
                                                  at_once: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner, "INTEROP_MIN_BRANCH_WORK", planner.INTEROP_MIN_BRANCH_WORK)
    extra = [] if min_work is None else ["--min-work", str(min_work)]
    assert interop.main(["--cases", "narrow_heads_b1", "--threads", "2", "--passes", "1",
                         "--calls", "2", "--out", str(tmp_path), *extra]) == 0
    (written,) = tmp_path.glob("interop-*.json")
    payload = json.loads(written.read_text())
    (row,) = payload["rows"]
    assert row["case"] == "narrow_heads_b1" and row["bitwise_equal"] is True
    assert len(row["at_once"]) == at_once
    assert payload["min_branch_work"] == (planner.INTEROP_MIN_BRANCH_WORK if min_work is None
                                          else min_work)
    assert len(payload["load_average"]) == 3 and payload["probe"]["cpu"]["logical_cores"]
