"""The alone benchmark's machinery: keel's whole runs and steps, then onnxruntime's whole
runs, one model in the process (speed is never asserted)."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from benchmarks import alone

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def lenet() -> dict[str, Any]:
    return alone.measure("lenet", batch=2, threads=2, runs=5)


def test_both_runtimes_and_every_step_are_timed(lenet: dict[str, Any]) -> None:
    assert (lenet["model"], lenet["batch"], lenet["threads"], lenet["runs"]) == ("lenet", 2, 2, 5)
    for key in ("keel_us", "keel_again_us", "ort_us"):
        assert 0 < lenet[key]["p10"] <= lenet[key]["median"]
    steps = lenet["steps"]
    assert steps and any(s["step"].startswith("Conv") for s in steps)
    assert all(0 < s["fastest"] <= s["median"] for s in steps)
    assert lenet["steps_median_sum_us"] == pytest.approx(sum(s["median"] for s in steps))
    assert lenet["steps_fastest_sum_us"] <= lenet["steps_median_sum_us"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_the_cpu_each_thread_name_used_is_read(lenet: dict[str, Any]) -> None:
    before = alone.cpu_by_thread_name()
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:            # 50 ms of this thread's CPU
        pass
    time.sleep(0.01)                            # a switch: the kernel books the time
    after = alone.cpu_by_thread_name()
    assert after["main"] - before["main"] > 20_000_000
    assert all(v >= 0 for v in lenet["cores_busy"].values())


def test_the_summary_names_the_model_and_both_runtimes(lenet: dict[str, Any]) -> None:
    text = alone.summary(lenet)
    assert text.startswith("lenet b2 t2: keel ") and "onnxruntime" in text
    assert "cores busy" in text and "furthest over their fastest" in text


@pytest.mark.parametrize("args", [["--threads", "0"], ["--runs", "0"], ["--model", "nope"]])
def test_bad_arguments_are_refused(args: list[str]) -> None:
    with pytest.raises(SystemExit):
        alone.main(args)
