"""What auto mode decides from runs timed on this machine, and why.

With a GPU here, :class:`keel.execution.model.Model` times a signature's first
inputs with every node on the gpu and with every node on the cpu, and, where the
gpu wins and precision is ``auto``, the model at fp16 against fp32. The measuring
is the execution stage's; the rules it applies and the reasons the plan quotes are
here, with the run counts the measurements use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from keel.planning.calibration_record import format_seconds

__all__ = ["HALF_TOLERANCE", "TIMED_RUNS", "WARM_RUNS", "faster_device", "half_precision"]

WARM_RUNS = 2       # untimed runs first: compiling, recording a device graph
TIMED_RUNS = 3      # then timed runs; their median is the measurement
# precision="auto" takes fp16 on a GPU where every float output stays within this relative
# L2 error of fp32 on the model's own first inputs (a stated tolerance, not a measurement).
HALF_TOLERANCE = 5e-3


def faster_device(times: Mapping[str, float], notes: Sequence[str] = ()) -> tuple[str, str]:
    """The backend with the smallest median in ``times`` (backend -> seconds), and the
    reason the plan quotes; ``notes`` say which backends could not run it whole."""
    best = min(times, key=times.__getitem__)
    measured = " vs ".join(f"{name} {format_seconds(t)}" for name, t in times.items())
    return best, (f"placement measured here on this signature's first inputs: {measured} "
                  f"(median of {TIMED_RUNS} runs after {WARM_RUNS} warm-up runs): every node "
                  f"on {best}" + "".join(f"; {note}" for note in notes))


def half_precision(error: float, half_seconds: float, fp32_seconds: float,
                   device: str) -> tuple[bool, str]:
    """Whether precision "auto" takes fp16 on ``device``: within HALF_TOLERANCE of fp32
    and faster; and the reason, with the numbers."""
    measured = (f"relative error {error:.1e} against fp32 on these inputs (tolerance "
                f"{HALF_TOLERANCE:.0e}), {format_seconds(half_seconds)} vs fp32 "
                f"{format_seconds(fp32_seconds)}")
    if error <= HALF_TOLERANCE and half_seconds < fp32_seconds:
        return True, f"precision auto: fp16 on {device}: {measured}"
    return False, f"precision auto: fp32 kept: {measured}"
