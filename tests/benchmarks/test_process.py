"""The whole-process benchmark measures and reports its figures (never their size)."""

from __future__ import annotations

import pytest

from benchmarks import process


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


def test_unknown_models_are_refused() -> None:
    with pytest.raises(SystemExit):
        process.main(["--models", "nosuchmodel"])
