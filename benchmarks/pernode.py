"""Per node, one thread against two (or any counts): keel and onnxruntime in one process.

    python -m benchmarks.pernode --model resnet20             # batch 1, 40 passes
    python -m benchmarks.pernode --model resnet18 --batch 32 --threads 16 --passes 2
    python -m benchmarks.pernode --model mobilenetv2 --passes 15 --json
    python -m benchmarks.pernode --model mobilenetv2 --kinds   # summed by kind of node
    python -m benchmarks.pernode --model resnet18 --batch 32 --passes 3

Each pass runs, for each thread count (``--threads``; one and two by default), keel's
steps one by one inside whole runs (each step's bound call timed alone, as the run calls
it: the workers spin between the steps as they do in a run) and onnxruntime's session
with its profiling on (its own per-node times, whole microseconds), then times whole
runs of both (onnxruntime without profiling). Medians and the fastest of every node: the
fastest is a node's time with the second core free, the median what the machine's other
work leaves. keel's steps say how many threads the plan gives them; whether a step
splits is in ``explain()``. ``--kinds`` sums both sides' nodes by kind (a conv's kind
from its own shapes: the stem, depthwise by kernel and stride, 1x1 expansions and
projections by output map, other ops by name) and lists the kinds where keel loses most
first. Speed is reported here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import zoo
from keel.execution.program import _exit_scopes

__all__ = ["by_kind", "conv_kind", "measure"]

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


def _stride(x: int, y: int, k: int) -> int:
    """A conv's stride along one axis from its input and output lengths and kernel: the
    smallest that gives y from x with at most k - 1 pads in all (floor division of the
    lengths read an odd map's stride 2, 7 -> 4, as 1). A symbolic length (0 once read
    from the graph, a name in a profile) gives 0: the kind then says "s?"."""
    if x <= 0 or y <= 0:
        return 0
    reach = range(x - k, x)                     # x + pads - k, the last window's start
    return next((s for s in range(1, x + 1)
                 if reach.start <= (y - 1) * s + s - 1 and (y - 1) * s < reach.stop), 0)


def conv_kind(weight: Sequence[int], x: Sequence[int], y: Sequence[int]) -> str:
    """A 2-D conv's kind from its weight (M, C / group, KH, KW), input and output shapes:
    "stem" (a dense conv of the image's few channels), "depthwise KxK sS", "1x1 expansion
    HxW" / "1x1 projection HxW" / "1x1 mixing HxW" (more / fewer / as many output
    channels), else "conv KxK sS" ("s?" where a map's length is symbolic)."""
    m, per_group, kh, kw = (int(v) for v in weight)
    c, stride = int(x[1]), _stride(_length(x[2]), _length(y[2]), kh)
    strided = f"s{stride}" if stride else "s?"
    if per_group == 1 and c == m > 1:
        return f"depthwise {kh}x{kw} {strided}"
    if per_group == c <= 4:
        return "stem"
    if (kh, kw, stride) == (1, 1, 1) and per_group == c:
        role = "expansion" if m > c else "projection" if m < c else "mixing"
        return f"1x1 {role} {y[2]}x{y[3]}"
    return f"conv {kh}x{kw} {strided}"


def _length(dim: object) -> int:
    """A map's length, 0 where it is symbolic (a name, or onnx's 0 for an unknown dim)."""
    return dim if isinstance(dim, int) else int(dim) if str(dim).isdigit() else 0


def _graph_kinds(onnx_bytes: bytes) -> dict[str, str]:
    """Each node's kind by its name (conv_kind for 2-D convs, else its op)."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load_from_string(onnx_bytes))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
    kinds = {}
    for node in model.graph.node:
        ins = [shapes.get(n, []) for n in node.input[:2]]
        out = shapes.get(node.output[0], [])
        convolves = node.op_type == "Conv" and all(len(s) == 4 for s in (*ins, out))
        kinds[node.name] = conv_kind(ins[1], ins[0], out) if convolves else node.op_type
    return kinds


def _ort_kind(args: Mapping[str, Any]) -> str:
    """An onnxruntime node's kind from its profiled shapes (fused nodes keep the conv's)."""
    op = str(args.get("op_name", "?"))
    shapes = [next(iter(s.values())) for s in args.get("input_type_shape", [])]
    out = [next(iter(s.values())) for s in args.get("output_type_shape", [])]
    if op in ("Conv", "FusedConv") and len(shapes) >= 2 and out and all(
            len(s) == 4 for s in (shapes[0], shapes[1], out[0])):
        return conv_kind(shapes[1], shapes[0], out[0])
    return op


def _ort_nodes(path: str) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Microseconds of each node's kernel, every profiled run, from onnxruntime's trace,
    and each node's kind (_ort_kind)."""
    found: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for event in json.loads(Path(path).read_text()):
        name = str(event.get("name", ""))
        if event.get("cat") == "Node" and name.endswith("_kernel_time"):
            node = name.removesuffix("_kernel_time")
            found.setdefault(node, []).append(float(event["dur"]))
            kinds.setdefault(node, _ort_kind(event.get("args", {})))
    return found, kinds


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "fastest": round(min(values), 2)}


def measure(name: str, passes: int = 40, batch: int = 1,
            threads: Sequence[int] = (1, 2)) -> dict[str, Any]:
    """Per-node and whole-run times (us) of zoo model ``name`` on each of ``threads``."""
    from keel.execution.model import load_model

    onnx_bytes = zoo.build(name)
    feeds = zoo.MODELS[name].make_feeds(batch)
    keel = {t: load_model(onnx_bytes, backend="cpu", threads=t) for t in threads}
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
    kinds = _graph_kinds(onnx_bytes)
    return {
        "model": name, "batch": batch, "passes": passes, "threads": list(keel),
        "whole_us": {k: _summary([v / 1000 for v in vs]) for k, vs in whole.items()},
        "keel_steps": {t: [{"step": n, "threads": planned[t][i], "kind": kinds.get(n, "other"),
                            **_summary([v / 1000 for v in steps[t][i]])}
                           for i, n in enumerate(names[t])] for t in keel},
        "ort_nodes": {t: [{"node": n, "kind": ort_nodes[t][1][n], **_summary(v)}
                          for n, v in ort_nodes[t][0].items()] for t in keel},
    }


def by_kind(result: dict[str, Any], threads: int) -> list[dict[str, Any]]:
    """Both sides' nodes summed by kind on ``threads`` threads (us, medians and fastest
    summed, and how many nodes), the kinds where keel loses most (fastest) first."""
    rows: dict[str, dict[str, Any]] = {}
    for side, label in (("keel_steps", "keel"), ("ort_nodes", "ort")):
        for node in result[side][threads]:
            row = rows.setdefault(node["kind"], {"kind": node["kind"], "keel_nodes": 0,
                                                 "ort_nodes": 0, "keel_median": 0.0,
                                                 "keel_fastest": 0.0, "ort_median": 0.0,
                                                 "ort_fastest": 0.0})
            row[f"{label}_nodes"] += 1
            row[f"{label}_median"] += node["median"]
            row[f"{label}_fastest"] += node["fastest"]
    return sorted(rows.values(), key=lambda r: r["ort_fastest"] - r["keel_fastest"])


def _ratio(row: Mapping[str, Any], stat: str) -> str:
    """keel's sum over onnxruntime's, "-" for a kind only one side has (0.00 would read
    as a node keel runs in no time)."""
    if not (row["keel_nodes"] and row["ort_nodes"] and row[f"ort_{stat}"]):
        return f"{'-':>6s}"
    return f"{row[f'keel_{stat}'] / row[f'ort_{stat}']:6.2f}"


def _kinds_table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} at batch {result['batch']} by kind of node, "
             f"{result['passes']} passes (us summed; keel / onnxruntime)"]
    for t in result["keel_steps"]:
        lines.append(f"  {t} thread(s)          nodes      median: keel    ort  ratio"
                     "     fastest: keel    ort   diff  ratio")
        for r in by_kind(result, t):
            lines.append(f"    {r['kind'][:22]:22s} {r['keel_nodes']:2d}/{r['ort_nodes']:2d}"
                         f" {r['keel_median']:12.0f} {r['ort_median']:6.0f}"
                         f" {_ratio(r, 'median')}"
                         f" {r['keel_fastest']:14.0f} {r['ort_fastest']:6.0f}"
                         f" {r['keel_fastest'] - r['ort_fastest']:6.0f}"
                         f" {_ratio(r, 'fastest')}")
    return "\n".join(lines)


def _table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} at batch {result['batch']}, {result['passes']} passes"
             " (us, median / fastest)"]
    for key, s in result["whole_us"].items():
        lines.append(f"  whole run {key:6s} {s['median']:10.1f} / {s['fastest']:.1f}")
    for side, rows, label in (("keel", result["keel_steps"], "step"),
                              ("onnxruntime", result["ort_nodes"], "node")):
        counts = list(result["keel_steps"])
        lines.append(f"  {side}: {label}, " + " -> ".join(f"{t} thread(s)" for t in counts))
        for same in zip(*(rows[t] for t in counts), strict=False):
            medians = " -> ".join(f"{r['median']:8.1f}" for r in same)
            fastest = " -> ".join(f"{r['fastest']:8.1f}" for r in same)
            lines.append(f"    {same[0][label][:40]:40s} {medians}   fastest {fastest}")
        for stat in ("median", "fastest"):
            sums = " -> ".join(f"{sum(r[stat] for r in rows[t]):.1f}" for t in counts)
            lines.append(f"    summed {stat}: {sums}")
    return "\n".join(lines)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _thread_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(_at_least_one(part) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"thread counts like 1,16, not {text!r}") from exc
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"each thread count once, not {text!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20", choices=sorted(zoo.DEFAULT_MODELS))
    parser.add_argument("--passes", type=_at_least_one, default=40)
    parser.add_argument("--batch", type=_at_least_one, default=1)
    parser.add_argument("--threads", type=_thread_counts, default=(1, 2),
                        help="comma-separated thread counts (default 1,2)")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true")
    shown.add_argument("--kinds", action="store_true", help="sums by kind of node")
    args = parser.parse_args(argv)
    result = measure(args.model, args.passes, args.batch, args.threads)
    if args.json:
        print(json.dumps(result, indent=1))
    elif args.kinds:
        print(_kinds_table(result))
    else:
        print(_table(result))


if __name__ == "__main__":
    main()
