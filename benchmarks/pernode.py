"""Per node, one thread against two: keel and onnxruntime in one process.

    python -m benchmarks.pernode --model resnet20             # batch 1, 40 passes
    python -m benchmarks.pernode --model mobilenetv2 --passes 15 --json
    python -m benchmarks.pernode --model resnet18 --batch 32 --passes 3

Each pass runs, for one thread and then two, keel's steps one by one inside whole runs
(each step's bound call timed alone, as the run calls it: the workers spin between the
steps as they do in a run) and onnxruntime's session with its profiling on (its own
per-node times, whole microseconds), then times whole runs of both (onnxruntime
without profiling). Medians and the fastest of every node: the fastest is a node's time
with the second core free, the median what the machine's other work leaves. keel's
steps say how many threads the plan gives them; whether a step splits is in
``explain()``. Speed is reported here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import zoo
from keel.execution.program import _exit_scopes

__all__ = ["measure"]

_RUNS = 5            # runs a pass of each side's per-node timing, and of whole runs x 2


def _program(model: Any) -> Any:
    """The program of the model's first compiled signature, the only one where a pass
    feeds one shape (benchmarks/gpu.py reads it the same way)."""
    return next(p.program for p in model._cache.values() if p.program is not None)


def _step_calls(program: Any) -> list[Callable[[], object]]:
    """Each step as one call: its bound call, or the executor's own step where unbound."""
    if program._calls is not None:
        return list(program._calls)
    return [functools.partial(program._run_items, [(i, hot)], None)
            for i, hot in enumerate(program._hot)]


def _keel_pass(model: Any, feeds: Mapping[str, np.ndarray], times: list[list[int]]) -> None:
    program = _program(model)
    calls = _step_calls(program)
    clock = time.perf_counter_ns
    for _ in range(_RUNS):
        model.predict(feeds)               # bound on this thread, workers spinning
        program._load_feeds(feeds)
        scopes = program._enter_scopes()   # the run's own: quiet FP state, BLAS thread cap
        try:
            for i, call in enumerate(calls):
                t0 = clock()
                call()
                times[i].append(clock() - t0)
        finally:
            _exit_scopes(scopes)
            program._release()


def _whole(run: Callable[[], object], out: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(2 * _RUNS):
        t0 = clock()
        run()
        out.append(clock() - t0)


def _ort(onnx_bytes: bytes, threads: int, profile_dir: str | None) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if profile_dir is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(profile_dir) / f"ort_{threads}")
    return ort.InferenceSession(onnx_bytes, opts, providers=["CPUExecutionProvider"])


def _ort_nodes(path: str) -> dict[str, list[float]]:
    """Microseconds of each node's kernel, every profiled run, from onnxruntime's trace."""
    found: dict[str, list[float]] = {}
    for event in json.loads(Path(path).read_text()):
        name = str(event.get("name", ""))
        if event.get("cat") == "Node" and name.endswith("_kernel_time"):
            found.setdefault(name.removesuffix("_kernel_time"), []).append(float(event["dur"]))
    return found


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "fastest": round(min(values), 2)}


def measure(name: str, passes: int = 40, batch: int = 1) -> dict[str, Any]:
    """Per-node and whole-run times (us) of zoo model ``name`` on 1 and 2 threads."""
    from keel.execution.model import load_model

    onnx_bytes = zoo.build(name)
    feeds = zoo.MODELS[name].make_feeds(batch)
    keel = {t: load_model(onnx_bytes, backend="cpu", threads=t) for t in (1, 2)}
    for model in keel.values():
        for _ in range(3):
            model.predict(feeds)
    names = {t: [s.name for s in _program(m)._steps] for t, m in keel.items()}
    planned = {t: [getattr(s.ctx, "threads", None) for s in _program(m)._steps]
               for t, m in keel.items()}
    steps: dict[int, list[list[int]]] = {t: [[] for _ in names[t]] for t in keel}
    whole: dict[str, list[int]] = {f"{side}{t}": [] for side in ("keel", "ort") for t in keel}
    with tempfile.TemporaryDirectory() as tmp:
        profiled = {t: _ort(onnx_bytes, t, tmp) for t in keel}
        plain = {t: _ort(onnx_bytes, t, None) for t in keel}
        for _ in range(passes):
            for t, model in keel.items():
                _keel_pass(model, feeds, steps[t])
                for _ in range(_RUNS):
                    profiled[t].run(None, feeds)
                _whole(functools.partial(model.predict, feeds), whole[f"keel{t}"])
                _whole(functools.partial(plain[t].run, None, feeds), whole[f"ort{t}"])
        ort_nodes = {t: _ort_nodes(profiled[t].end_profiling()) for t in keel}
    return {
        "model": name, "batch": batch, "passes": passes,
        "whole_us": {k: _summary([v / 1000 for v in vs]) for k, vs in whole.items()},
        "keel_steps": {t: [{"step": n, "threads": planned[t][i],
                            **_summary([v / 1000 for v in steps[t][i]])}
                           for i, n in enumerate(names[t])] for t in keel},
        "ort_nodes": {t: [{"node": n, **_summary(v)} for n, v in ort_nodes[t].items()]
                      for t in keel},
    }


def _table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} at batch {result['batch']}, {result['passes']} passes"
             " (us, median / fastest)"]
    for key, s in result["whole_us"].items():
        lines.append(f"  whole run {key:6s} {s['median']:10.1f} / {s['fastest']:.1f}")
    for side, rows, label in (("keel", result["keel_steps"], "step"),
                              ("onnxruntime", result["ort_nodes"], "node")):
        lines.append(f"  {side}: {label}, 1 thread -> 2 threads")
        for one, two in zip(rows[1], rows[2], strict=False):
            lines.append(f"    {one[label][:40]:40s} {one['median']:8.1f} -> {two['median']:8.1f}"
                         f"   fastest {one['fastest']:8.1f} -> {two['fastest']:8.1f}")
        for stat in ("median", "fastest"):
            sums = [sum(r[stat] for r in rows[t]) for t in (1, 2)]
            lines.append(f"    summed {stat}: {sums[0]:.1f} -> {sums[1]:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20", choices=sorted(zoo.DEFAULT_MODELS))
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.model, args.passes, args.batch)
    print(json.dumps(result, indent=1) if args.json else _table(result))


if __name__ == "__main__":
    main()
