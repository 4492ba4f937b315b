"""The whole-process benchmark measures and reports its figures (never their size)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from benchmarks import process
from keel._hashing import SETTLE_NS


def test_a_fresh_process_is_measured_from_its_first_statement_to_its_first_prediction(
        ) -> None:
    report = process.measure(["lenet"], runs=1, files=("keel",), plan_cache=("off",))
    base = report["baselines"]
    assert set(base) == {"python", "numpy"}
    # Importing NumPy costs a process memory; the model's process holds more again.
    assert base["numpy"]["vmhwm_mb"] > base["python"]["vmhwm_mb"] > 0
    (row,) = report["rows"]
    assert (row["model"], row["file"], row["plan_cache"]) == ("lenet", "keel", "off")
    assert row["vmhwm_mb"] > base["numpy"]["vmhwm_mb"]
    assert row["above_numpy_mb"] == pytest.approx(row["vmhwm_mb"] - base["numpy"]["vmhwm_mb"])
    # The parent's clock spans the interpreter's start and exit around the child's own.
    assert row["process_ms"] > row["first_predict_ms"] > 0 and row["cpu_ms"] > 0
    table = process.render(report)
    assert "| lenet | .keel | off |" in table and "(numpy only)" in table


def test_a_fresh_model_file_is_left_to_settle_before_the_plan_cache_is_measured(
        tmp_path: Path) -> None:
    # The plan cache remembers a file's digest only once it is older than SETTLE_NS.
    fresh = tmp_path / "model.keel"
    fresh.write_bytes(b"x")
    process._settle([str(fresh)])
    assert time.time_ns() >= os.stat(fresh).st_ctime_ns + SETTLE_NS


def test_unknown_models_are_refused() -> None:
    with pytest.raises(SystemExit):
        process.main(["--models", "nosuchmodel"])


def test_the_suite_table_shows_the_whole_process_beside_the_figure_above_numpy() -> None:
    from benchmarks import run as suite

    model = {"model": "lenet", "ratios": {"b1_t1": 1.1}, "measurements": [], "notes": [],
             "load_ms": {"keel:cpu": 2.0, "onnxruntime": 3.0},
             "peak_rss_mb": {"keel:cpu": 14.0, "onnxruntime": 12.0},
             "process": {"first_predict_ms": 250.0, "cpu_ms": 200.0, "vmhwm_mb": 41.0}}
    payload = {"config": {"batches": [1], "threads": [1]}, "onnxruntime": "1.x",
               "stamp": "now", "python": "3.11", "machine": {"cpu": {}},
               "models": [model, {**model, "model": "mlp", "process": {}}]}
    table = suite.render_markdown(payload)
    assert "| 14.0 / 12.0 | 250, 200, 41.0 |" in table
    assert "| 14.0 / 12.0 | — |" in table          # a model measured without it
