"""What auto mode decides from runs timed on this machine, and why.

With a GPU here, :class:`keel.execution.model.Model` times a signature's first
inputs with every node on the gpu and with every node on the cpu, and, where the
gpu wins and precision is ``auto``, the model at fp16 against fp32, then at bf16
where fp16 is not within tolerance or cannot run. The measuring is the execution
stage's; the rules it applies and the reasons the plan quotes are here, with the
run counts the measurements use.

fp16 comes first: its 11-bit significand is 8 times finer than bfloat16's 8 bits,
so where both stay within range fp16 is the more accurate. bfloat16 has float32's
exponent range, so it is the one that survives activations or products past
fp16's 65504 (or below its 6e-8); it is tried only where fp16 failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from keel.planning.calibration_record import format_seconds

__all__ = ["HALF_PRECISIONS", "HALF_TOLERANCE", "TIMED_RUNS", "WARM_RUNS", "HalfTrial",
           "faster_device", "half_precision", "try_next"]

WARM_RUNS = 2       # untimed runs first: compiling, recording a device graph
TIMED_RUNS = 3      # then timed runs; their median is the measurement
# precision="auto" takes fp16 (else bf16) on a GPU where every float output stays within
# this relative L2 error of fp32 on the model's own first inputs (a stated tolerance, not
# a measurement).
HALF_TOLERANCE = 5e-3
# The half precisions auto tries on a GPU, in order (the module docstring says why).
HALF_PRECISIONS = ("fp16", "bf16")


@dataclass(frozen=True)
class HalfTrial:
    """One half precision run against fp32 on the same inputs: its relative error and
    median time, or why it could not run."""

    precision: str
    error: float = float("inf")
    seconds: float = float("inf")
    failure: str = ""                    # non-empty: it could not run here

    def within(self) -> bool:
        return not self.failure and self.error <= HALF_TOLERANCE

    def describe(self, fp32_seconds: float, named: bool) -> str:
        if self.failure:
            return f"{self.precision} cannot run here ({self.failure})"
        name = f"{self.precision} " if named else ""
        return (f"{name}relative error {self.error:.1e} against fp32 on these inputs "
                f"(tolerance {HALF_TOLERANCE:.0e}), {format_seconds(self.seconds)} vs fp32 "
                f"{format_seconds(fp32_seconds)}")


def faster_device(times: Mapping[str, float], notes: Sequence[str] = ()) -> tuple[str, str]:
    """The backend with the smallest median in ``times`` (backend -> seconds), and the
    reason the plan quotes; ``notes`` say which backends could not run it whole."""
    best = min(times, key=times.__getitem__)
    measured = " vs ".join(f"{name} {format_seconds(t)}" for name, t in times.items())
    return best, (f"placement measured here on this signature's first inputs: {measured} "
                  f"(median of {TIMED_RUNS} runs after {WARM_RUNS} warm-up runs): every node "
                  f"on {best}" + "".join(f"; {note}" for note in notes))


def try_next(trial: HalfTrial) -> bool:
    """Whether auto tries the next half precision after ``trial``: it was not within
    tolerance or could not run (a half precision that is accurate but slower ends it)."""
    return not trial.within()


def half_precision(tried: Sequence[HalfTrial], fp32_seconds: float,
                   device: str) -> tuple[str | None, str]:
    """The half precision "auto" takes on ``device`` (the first of ``tried`` within
    HALF_TOLERANCE of fp32 and faster; None: fp32 is kept), and the reason, with the
    numbers of every one tried."""
    named = len(tried) > 1
    measured = "; ".join(t.describe(fp32_seconds, named) for t in tried)
    for t in tried:
        if t.within() and t.seconds < fp32_seconds:
            return t.precision, f"precision auto: {t.precision} on {device}: {measured}"
    return None, f"precision auto: fp32 kept: {measured}"
