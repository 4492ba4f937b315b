"""Seed 003: plan before running, re-plan only at chunk boundaries, pins stay pinned."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from keel.errors import InvalidArgumentError, MemoryLimitError
from keel.planning.adaptive import (
    AdaptivePlanner,
    MemoryTelemetry,
    PlanRequest,
    plan_chunks,
)


def linear_peak(fixed: int, per_item: int):  # type: ignore[no-untyped-def]
    calls: list[int] = []

    def peak(n: int) -> int:
        calls.append(n)
        return fixed + per_item * n

    peak.calls = calls  # type: ignore[attr-defined]
    return peak


@dataclass
class FakeTelemetry:
    free: dict[str, int | None]

    def available_bytes(self, device: str) -> int | None:
        return self.free.get(device)


def test_fake_telemetry_satisfies_the_protocol() -> None:
    assert isinstance(FakeTelemetry({}), MemoryTelemetry)


def test_no_limit_means_one_chunk() -> None:
    chunk, peak, why = plan_chunks(32, linear_peak(100, 10), None)
    assert (chunk, peak) == (32, 420)
    assert "no memory limit" in why


def test_fitting_limit_means_one_chunk() -> None:
    chunk, peak, why = plan_chunks(32, linear_peak(100, 10), 420)
    assert (chunk, peak) == (32, 420)
    assert "fits" in why


def test_tight_limit_picks_the_largest_chunk_that_fits() -> None:
    chunk, peak, why = plan_chunks(32, linear_peak(100, 10), 255)
    assert chunk == 15 and peak == 250
    assert "3 chunks of up to 15" in why


def test_impossible_limit_states_the_peak_it_needs() -> None:
    with pytest.raises(MemoryLimitError, match=r"needs a peak of .*\(110 bytes\)") as info:
        plan_chunks(32, linear_peak(100, 10), 109)
    assert info.value.required_bytes == 110
    assert info.value.limit_bytes == 109


def test_plan_records_a_reason_for_every_choice() -> None:
    plan = AdaptivePlanner().plan(
        PlanRequest("graph", 64, memory_limit=100 + 10 * 20), linear_peak(100, 10))
    assert plan.runtime == "cpu" and not plan.pinned
    assert plan.precision == "fp32" and plan.variant == "default"
    assert plan.chunk_size == 20 and plan.n_chunks == 4 and plan.chunked
    assert plan.chunks() == [(0, 20), (20, 40), (40, 60), (60, 64)]
    text = " | ".join(plan.reasons)
    for word in ("runtime cpu", "variant default", "precision fp32", "no telemetry",
                 "4 chunks"):
        assert word in text
    assert plan.to_dict()["n_chunks"] == 4


def test_pinned_runtime_and_precision_are_kept() -> None:
    def choose(_: PlanRequest) -> tuple[str, str]:
        raise AssertionError("auto selection must not run for a pinned request")

    plan = AdaptivePlanner(choose).plan(PlanRequest("matmul_like", 8, backend="reference",
                                                    precision="fp64"))
    assert (plan.runtime, plan.precision, plan.pinned) == ("reference", "fp64", True)
    assert "pinned by the caller" in plan.reasons[0]


def test_auto_runtime_comes_from_the_chooser() -> None:
    plan = AdaptivePlanner(lambda r: ("gpu", "large matmul")).plan(PlanRequest("matmul_like", 8))
    assert plan.runtime == "gpu"
    assert plan.reasons[0] == "runtime gpu: large matmul"


def test_telemetry_lowers_the_budget_before_running() -> None:
    request = PlanRequest("graph", 32, memory_limit=10_000,
                          telemetry=FakeTelemetry({"cpu": 300}))
    plan = AdaptivePlanner().plan(request, linear_peak(100, 10))
    assert plan.chunk_size == 20
    assert any("telemetry" in r and "free on cpu" in r for r in plan.reasons)


def test_replan_without_telemetry_changes_nothing() -> None:
    planner = AdaptivePlanner()
    peak = linear_peak(100, 10)
    plan = planner.plan(PlanRequest("graph", 32, memory_limit=255), peak)
    assert planner.replan(plan, 15, peak, telemetry=None) is plan


def test_replan_shrinks_chunks_at_a_boundary_but_keeps_runtime_and_precision() -> None:
    planner = AdaptivePlanner()
    peak = linear_peak(100, 10)
    plan = planner.plan(PlanRequest("graph", 32, backend="cpu", precision="fp32",
                                    memory_limit=255), peak)
    after = planner.replan(plan, 15, peak, telemetry=FakeTelemetry({"cpu": 160}))
    assert after.chunk_size == 6
    assert (after.runtime, after.precision, after.pinned) == ("cpu", "fp32", True)
    assert "re-planned after 15 of 32" in after.reasons[-1]
    # More free memory than planned for never grows the chunk mid-run.
    same = planner.replan(plan, 15, peak, telemetry=FakeTelemetry({"cpu": 10**9}))
    assert same is plan


def test_replan_raises_when_memory_vanishes() -> None:
    planner = AdaptivePlanner()
    peak = linear_peak(100, 10)
    plan = planner.plan(PlanRequest("graph", 32, memory_limit=255), peak)
    with pytest.raises(MemoryLimitError):
        planner.replan(plan, 15, peak, telemetry=FakeTelemetry({"cpu": 50}))


def test_negative_size_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="size must be >= 0, got -1"):
        AdaptivePlanner().plan(PlanRequest("graph", -1))


def test_binary_search_calls_the_peak_model_few_times() -> None:
    peak = linear_peak(0, 1)
    chunk, _, _ = plan_chunks(1_000_000, peak, 777)
    assert chunk == 777
    assert len(peak.calls) < 30
