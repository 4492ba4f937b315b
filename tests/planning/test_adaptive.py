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


# ---- seed 003 inputs: dtype mix, residency, hint, history ------------------------------
def test_a_dtype_mix_gives_a_precision_plan_per_node() -> None:
    mix = (("a", "fp32"), ("b", "fp16"), ("c", "fp32"))
    plan = AdaptivePlanner().plan(PlanRequest("graph", 4, node_precisions=mix))
    assert plan.precision == "mixed"
    assert plan.precision_plan == {"fp32": ("a", "c"), "fp16": ("b",)}
    assert any("2 nodes in fp32, 1 node in fp16" in r for r in plan.reasons)
    pinned = AdaptivePlanner().plan(PlanRequest("graph", 4, node_precisions=mix,
                                                precision="fp16"))
    assert pinned.precision == "fp16"
    assert "precision fp16: pinned by the caller" in pinned.reasons


def test_auto_precision_keeps_fp32_on_cpu_and_says_what_a_fast_fp16_gpu_would_do() -> None:
    from keel.hardware.fakes import fake_profile

    cpu = AdaptivePlanner().plan(PlanRequest("graph", 4))
    assert cpu.precision == "fp32"
    assert any("on cpu fp32 is the fast path" in r for r in cpu.reasons)
    gpu = AdaptivePlanner(lambda r: ("gpu", "large graph")).plan(
        PlanRequest("graph", 4, hint="throughput", profile=fake_profile("nvidia-h100-nvml")))
    assert gpu.precision == "fp32"               # the plan keeps fp32; a measured trial may not
    note = next(r for r in gpu.reasons if r.startswith("precision fp32"))
    assert "fast fp16" in note and "takes one only within 5e-03 relative error" in note
    assert "compute capability 9.0" in note


def test_residency_reaches_the_runtime_choice() -> None:
    seen: list[str] = []

    def choose(request: PlanRequest) -> tuple[str, str]:
        seen.append(request.residency)
        return request.residency, "inputs live there"

    plan = AdaptivePlanner(choose).plan(PlanRequest("graph", 4, residency="gpu"))
    assert seen == ["gpu"] and plan.runtime == "gpu" and plan.residency == "gpu"
    assert plan.to_dict()["residency"] == "gpu"


def test_hints_set_streams_threads_and_the_batch_split() -> None:
    none = AdaptivePlanner().plan(PlanRequest("graph", 10, cores=8))
    assert (none.streams, none.threads_per_stream, none.batch_split) == (1, 8, (10,))
    latency = AdaptivePlanner().plan(PlanRequest("graph", 10, cores=8, hint="latency"))
    assert (latency.streams, latency.threads_per_stream) == (1, 8)
    assert any("latency hint: one stream using all 8" in r for r in latency.reasons)
    throughput = AdaptivePlanner().plan(PlanRequest("graph", 10, cores=8, hint="throughput"))
    assert (throughput.streams, throughput.threads_per_stream) == (4, 2)
    assert throughput.batch_split == (3, 3, 2, 2) and sum(throughput.batch_split) == 10
    assert any("4 streams of 2 threads" in r for r in throughput.reasons)


def test_throughput_streams_fit_the_memory_budget_and_stay_on_cpu() -> None:
    peak = linear_peak(100, 10)
    # 4 streams of 3 items need 4 * 130 bytes; 3 streams of 4 fit 3 * 140 = 420.
    plan = AdaptivePlanner().plan(PlanRequest("graph", 12, cores=4, hint="throughput",
                                              memory_limit=450), peak)
    assert plan.streams == 3 and plan.batch_split == (4, 4, 4)
    gpu = AdaptivePlanner(lambda r: ("gpu", "big")).plan(
        PlanRequest("graph", 12, cores=4, hint="throughput"))
    assert gpu.streams == 1
    assert any("this runs on gpu" in r for r in gpu.reasons)


def test_an_invalid_hint_names_the_allowed_values() -> None:
    with pytest.raises(InvalidArgumentError, match="none, latency, throughput"):
        AdaptivePlanner().plan(PlanRequest("graph", 4, hint="fast"))


def test_telemetry_without_a_limit_chunks_only_when_the_work_exceeds_free_memory() -> None:
    peak = linear_peak(100, 10)
    roomy = AdaptivePlanner().plan(
        PlanRequest("graph", 32, telemetry=FakeTelemetry({"cpu": 10_000})), peak)
    assert not roomy.chunked and roomy.memory_limit is None
    tight = AdaptivePlanner().plan(
        PlanRequest("graph", 32, telemetry=FakeTelemetry({"cpu": 255})), peak)
    assert tight.chunk_size == 15 and tight.memory_limit == 255
    assert tight.telemetry == {"source": "FakeTelemetry"}


@dataclass(frozen=True)
class Step:
    size: int
    seconds_per_item: float
    runs: int = 1

    def describe(self) -> str:
        return f"{self.size} items at {self.seconds_per_item}"


def test_without_history_the_first_chunk_is_half_and_replanning_grows_it() -> None:
    planner = AdaptivePlanner()
    peak = linear_peak(100, 10)
    plan = planner.plan(PlanRequest("graph", 64, memory_limit=300, history={}), peak)
    assert plan.chunk_size == 10                       # half of the 20 that fit
    assert any("no runtime history" in r for r in plan.reasons)
    grown = planner.replan(plan, 10, peak, measured=Step(10, 1e-3))
    assert grown.chunk_size == 20 and grown.peak_bytes == 300
    assert "grows from 10 to 20" in grown.reasons[-1]
    # Deterministic given the same measurements.
    assert planner.replan(plan, 10, peak, measured=Step(10, 1e-3)) == grown
    # Never past the budget, and at most doubling per boundary.
    assert planner.replan(grown, 30, peak, measured=Step(20, 1e-3)) is grown
    small = planner.plan(PlanRequest("graph", 640, memory_limit=3000, history={}), peak)
    assert small.chunk_size == 145
    assert planner.replan(small, 145, peak).chunk_size == 290


def test_replanning_keeps_the_chunk_when_history_measured_the_larger_size_slower() -> None:
    planner = AdaptivePlanner()
    peak = linear_peak(100, 10)
    known = {20: Step(20, 5e-3)}
    plan = planner.plan(PlanRequest("graph", 64, memory_limit=300, history={}), peak)
    kept = planner.replan(plan, 10, peak, measured=Step(10, 1e-3), known=known)
    assert kept.chunk_size == 10
    assert "stays at 10" in kept.reasons[-1] and "slower" in kept.reasons[-1]


def test_history_picks_the_first_chunk_and_the_reason_names_it() -> None:
    peak = linear_peak(100, 10)
    history = {8: Step(8, 1e-3), 16: Step(16, 2e-3), 40: Step(40, 1e-4)}
    plan = AdaptivePlanner().plan(PlanRequest("graph", 64, memory_limit=300,
                                              history=history), peak)
    assert plan.chunk_size == 8            # 40 does not fit; 8 is the fastest that does
    assert any(r.startswith("runtime history on this machine: 8 items") for r in plan.reasons)
