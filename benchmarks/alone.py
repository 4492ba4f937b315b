"""keel alone, then onnxruntime alone: whole runs and keel's steps, one model in a process.

    python -m benchmarks.alone --model mobilenetv2 --threads 16            # batch 1
    python -m benchmarks.alone --model resnet18 --batch 32 --threads 4 --runs 10 --json

The suite (``benchmarks.run``) alternates both runtimes in one process, each block
after the other's workers went idle; on a many-core machine that still leaves a cell
resolved to about ±0.15 (two passes on a shared host). Here keel runs first, alone: its
whole runs, then each step's bound call timed inside whole runs (as
``benchmarks.pernode`` times them), then whole runs again; then, once keel's workers are
idle, onnxruntime's session with the same threads, alone. What it prints: both
runtimes' whole-run medians and tenth percentiles, the sum of keel's step medians and of
their fastest (a whole run's median near that sum says the time is in the steps, not
between them), the cores each thread name kept busy during keel's runs (where Linux's
``/proc`` tells: keel's workers, BLAS's, anything else in the process), and the steps
whose median is furthest over their fastest. ``--json`` prints all of it with every
step's median and fastest. Alternate processes of two code versions to compare them.
Speed is reported here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks import pernode, zoo
from keel.bench import settle

__all__ = ["measure"]

_WARM = 20      # untimed runs before each runtime's timing


def _timed(run: Callable[[], object], runs: int) -> list[int]:
    clock = time.perf_counter_ns
    out = []
    for _ in range(runs):
        t0 = clock()
        run()
        out.append(clock() - t0)
    return out


def cpu_by_thread_name() -> dict[str, int]:
    """CPU nanoseconds each thread name of this process has used (the calling thread as
    ``main``); empty where ``/proc/self/task`` does not say."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    out: dict[str, int] = {}
    me = str(os.getpid())
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = "main" if tid == me else f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):      # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0) + ns
    return out


def _us(values: list[int]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(values) / 1000, "p10": ordered[len(ordered) // 10] / 1000}


def measure(name: str, batch: int = 1, threads: int = 1, runs: int = 100) -> dict[str, Any]:
    """keel's and onnxruntime's whole runs of zoo model ``name`` (us), keel's steps, and
    the cores each thread name kept busy during keel's first whole runs."""
    from keel.execution.model import load_model

    onnx_bytes = zoo.build(name)
    feeds = zoo.MODELS[name].make_feeds(batch)
    model = load_model(onnx_bytes, backend="cpu", threads=threads)
    for _ in range(_WARM):
        model.predict(feeds)
    before, start = cpu_by_thread_name(), time.perf_counter_ns()
    first = _timed(lambda: model.predict(feeds), runs)
    after, wall = cpu_by_thread_name(), time.perf_counter_ns() - start
    busy = {k: round((v - before.get(k, 0)) / wall, 2) for k, v in after.items()
            if v > before.get(k, 0)}
    program = pernode._program(model)
    steps: list[list[int]] = [[] for _ in program._steps]
    for _ in range(max(1, runs // 5)):
        pernode._keel_pass(model, feeds, steps)
    again = _timed(lambda: model.predict(feeds), runs)
    settle()
    session = pernode._ort(onnx_bytes, threads, None)
    for _ in range(_WARM):
        session.run(None, feeds)
    ort_runs = _timed(lambda: session.run(None, feeds), runs)
    step_rows = [{"step": step.name, "median": statistics.median(times) / 1000,
                  "fastest": min(times) / 1000}
                 for step, times in zip(program._steps, steps, strict=True)]
    return {"model": name, "batch": batch, "threads": threads, "runs": runs,
            "keel_us": _us(first), "keel_again_us": _us(again), "ort_us": _us(ort_runs),
            "steps_median_sum_us": sum(r["median"] for r in step_rows),
            "steps_fastest_sum_us": sum(r["fastest"] for r in step_rows),
            "cores_busy": busy, "steps": step_rows}


def summary(result: dict[str, Any], widest: int = 6) -> str:
    keel, ort = result["keel_us"], result["ort_us"]
    summed, fastest = result["steps_median_sum_us"], result["steps_fastest_sum_us"]
    rows = sorted(result["steps"], key=lambda r: r["fastest"] - r["median"])[:widest]
    return "\n".join([
        f"{result['model']} b{result['batch']} t{result['threads']}: keel {keel['median']:.1f} "
        f"(p10 {keel['p10']:.1f}, again {result['keel_again_us']['median']:.1f}), steps "
        f"summed {summed:.1f} (fastest {fastest:.1f}); "
        f"onnxruntime {ort['median']:.1f} (p10 {ort['p10']:.1f}) us; keel / onnxruntime "
        f"{keel['median'] / ort['median']:.2f}",
        f"  cores busy during keel's runs, by thread name: {result['cores_busy']}",
        "  steps furthest over their fastest (median / fastest us): "
        + ", ".join(f"{r['step']} {r['median']:.0f} / {r['fastest']:.0f}" for r in rows)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20", choices=sorted(zoo.DEFAULT_MODELS))
    parser.add_argument("--batch", type=pernode._at_least_one, default=1)
    parser.add_argument("--threads", type=pernode._at_least_one, default=1)
    parser.add_argument("--runs", type=pernode._at_least_one, default=100,
                        help="whole runs of each runtime (keel's steps: a fifth as many passes)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.model, args.batch, args.threads, args.runs)
    print(json.dumps(result, indent=1) if args.json else summary(result))


if __name__ == "__main__":
    main()
