"""int8 models: keel against onnxruntime on the same quantized file, and top-1 agreement
of each int8 model with its float32 original.

    python -m benchmarks.int8                         # lenet, resnet20, resnet18, mobilenetv2
    python -m benchmarks.int8 --models lenet,resnet20 --passes 3
    python -m benchmarks.int8 --models resnet20,resnet18 --threads 1,2
    python -m benchmarks.int8 --models resnet18 --threads 1,2 --profile   # per node

Each float model of :mod:`benchmarks.zoo` is optimized by keel (BatchNorm folded into
the convolutions, as onnxruntime's quantization pre-processing does), exported to ONNX
and quantized by ``onnxruntime.quantization.quantize_static``: QDQ format, int8
weights per output channel, uint8 activations, minmax ranges over random calibration
samples. Both runtimes run that one file at batch 32 on one thread, or on each count of
``--threads`` (keel turns its QDQ patterns into integer nodes; onnxruntime into its
QLinear kernels), timed twice: wall time by :func:`keel.bench.bench_model`, and the
process's CPU time per run (on several threads: all of them together), alternating pass
by pass (what a loaded machine's other work adds less to). Writes
``benchmarks/results/int8-<stamp>.json`` with the load average before and after each
model: time ratios from a busy machine say little. With ``--profile`` it writes
``int8-profile-<stamp>.json`` instead: each node's median time in keel
(``model.enable_profiling()``) and in onnxruntime (its own profiler) on the same file,
the two runtimes alternating pass by pass, their convolutions paired by node name.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.zoo import MODELS, build

RESULTS = Path(__file__).resolve().parent / "results"
CNNS = ("lenet", "resnet20", "resnet18", "mobilenetv2")


def quantize(name: str, calibration_samples: int = 16, seed: int = 0) -> bytes:
    """The zoo model ``name``, BatchNorm folded, quantized by onnxruntime (QDQ)."""
    import onnx
    from onnxruntime import quantization as q

    from keel.graph.export import to_onnx
    from keel.graph.importers.onnx import import_onnx
    from keel.graph.passes import optimize

    spec = MODELS[name]
    folded = to_onnx(optimize(import_onnx(build(name)), "extended"))
    batches = [{spec.input_name: spec.make_input(min(8, calibration_samples), seed + i)}
               for i in range(max(1, calibration_samples // 8))]

    class Reader(q.CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "float.onnx", Path(tmp) / "int8.onnx"
        onnx.save(folded, str(src))
        q.quantize_static(str(src), str(dst), Reader(), quant_format=q.QuantFormat.QDQ,
                          per_channel=True, activation_type=q.QuantType.QUInt8,
                          weight_type=q.QuantType.QInt8)
        return dst.read_bytes()


def top1_agreement(name: str, int8: bytes, samples: int = 64, seed: int = 100) -> float:
    """The share of ``samples`` random inputs whose top-1 class keel's int8 run of
    ``int8`` gives as keel's float32 run of the original does."""
    import keel

    spec = MODELS[name]
    feeds = {spec.input_name: spec.make_input(samples, seed)}
    want = next(iter(keel.load_model(build(name)).predict(feeds).values())).argmax(-1)
    got = next(iter(keel.load_model(int8).predict(feeds).values())).argmax(-1)
    return float(np.mean(got == want))


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _bench(name: str, model: bytes, args: argparse.Namespace) -> dict[str, Any]:
    from keel.bench import BenchConfig, bench_model

    spec = MODELS[name]
    threads = tuple(int(t) for t in str(args.threads).split(",") if t.strip())
    config = BenchConfig(batches=(args.batch,), threads=threads, passes=args.passes,
                         min_pass_seconds=args.pass_seconds)
    before = _load_average()
    report = bench_model(f"{name}-int8", model, config,
                         feeds_for=lambda b: {spec.input_name: spec.make_input(b)})
    cpu: dict[str, Any] = {
        f"t{t}": cpu_time_ratio(name, model, args.batch, args.passes, args.pass_seconds, t)
        for t in threads}
    return {"model": name, "ratios (keel time / onnxruntime time)": report.ratios,
            "cpu_time_ratio (keel / onnxruntime)": cpu,
            "load_average": {"before": before, "after": _load_average()},
            "report": report.to_dict() if hasattr(report, "to_dict") else str(report)}


def cpu_time_ratio(name: str, model: bytes, batch: int, passes: int,
                   pass_seconds: float, threads: int = 1) -> dict[str, float]:
    """keel's and onnxruntime's CPU time per run of ``model`` (process time, all of
    ``threads`` together: what a loaded machine's other work does not add to), alternating
    pass by pass; the median ms of each and the median of the passes' ratios."""
    import onnxruntime as ort

    import keel

    spec = MODELS[name]
    feeds = {spec.input_name: spec.make_input(batch)}
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    runs = {"keel": functools.partial(keel.load_model(model, threads=threads).predict, feeds),
            "onnxruntime": functools.partial(session.run, None, feeds)}
    per_pass: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():
        run()
    for _ in range(passes):
        for key, run in runs.items():
            per_pass[key].append(_cpu_ms_per_run(run, pass_seconds))
    ratios = [k / o for k, o in zip(per_pass["keel"], per_pass["onnxruntime"], strict=True)]
    return {"keel_ms": statistics.median(per_pass["keel"]),
            "onnxruntime_ms": statistics.median(per_pass["onnxruntime"]),
            "ratio": round(statistics.median(ratios), 3)}


def _cpu_ms_per_run(run: Callable[[], Any], seconds: float) -> float:
    count, start = 0, time.process_time()
    while count < 2 or time.process_time() - start < seconds:
        run()
        count += 1
    return (time.process_time() - start) * 1e3 / count


def profile_nodes(name: str, model: bytes, batch: int, threads: int, passes: int,
                  runs: int = 5) -> dict[str, Any]:
    """Each node's median milliseconds per run in keel and in onnxruntime on ``model``
    (``passes`` of ``runs`` runs each, the runtimes alternating pass by pass), the
    convolutions paired by name (onnxruntime's node named ``<keel's>_token_<n>`` or
    ``<keel's>``), and each runtime's other nodes summed per op."""
    import onnxruntime as ort

    import keel

    spec = MODELS[name]
    feeds = {spec.input_name: spec.make_input(batch)}
    keel_model = keel.load_model(model, threads=threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        options.profile_file_prefix = str(Path(tmp) / "ort")
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        for _ in range(2):
            keel_model.predict(feeds)
            session.run(None, feeds)
        keel_model.enable_profiling()
        for _ in range(passes):
            for _ in range(runs):
                keel_model.predict(feeds)
            for _ in range(runs):
                session.run(None, feeds)
        profiler = keel_model.profiler
        assert profiler is not None
        keel_times = _per_node((e.name, e.op, e.duration_ns / 1e6) for e in profiler.events)
        trace = json.loads(Path(session.end_profiling()).read_text())
    ort_times = _per_node((e["name"][:-len("_kernel_time")], e["args"].get("op_name", ""),
                           e["dur"] / 1e3) for e in trace
                          if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"))
    ort_by_name = {n.split("_token_")[0]: (n, op, ms) for n, (op, ms) in ort_times.items()
                   if "Conv" in op}
    convs = []
    for node, (op, ms) in keel_times.items():
        found = ort_by_name.get(node)
        if "conv" in op.lower() and found is not None:
            convs.append({"node": node, "keel_ms": round(ms, 4), "onnxruntime_ms": round(
                found[2], 4), "ratio": round(ms / found[2], 3) if found[2] else None})
    return {"threads": threads, "convolutions": convs,
            "keel_conv_ms": round(sum(c["keel_ms"] for c in convs), 3),
            "onnxruntime_conv_ms": round(sum(c["onnxruntime_ms"] for c in convs), 3),
            "keel_other_ms": _other(keel_times, {c["node"] for c in convs}),
            "onnxruntime_other_ms": _other(ort_times, {ort_by_name[c["node"]][0]
                                                       for c in convs})}


def _per_node(events: Any) -> dict[str, tuple[str, float]]:
    """(node, op, ms) events → {node: (op, median ms)}, in the order first seen."""
    times: dict[str, tuple[str, list[float]]] = {}
    for node, op, ms in events:
        times.setdefault(node, (op, []))[1].append(ms)
    return {node: (op, statistics.median(ms)) for node, (op, ms) in times.items()}


def _other(times: dict[str, tuple[str, float]], paired: set[str]) -> dict[str, float]:
    """The median ms of the nodes not in ``paired``, summed per op."""
    out: dict[str, float] = {}
    for node, (op, ms) in times.items():
        if node not in paired:
            out[op] = round(out.get(op, 0.0) + ms, 4)
    return out


def _print_profile(name: str, row: dict[str, Any]) -> None:
    print(f"{name}, {row['threads']} thread(s): convolutions keel {row['keel_conv_ms']} ms, "
          f"onnxruntime {row['onnxruntime_conv_ms']} ms", flush=True)
    for c in row["convolutions"]:
        print(f"  {c['node']:<24} {c['keel_ms']:9.3f} {c['onnxruntime_ms']:9.3f}  {c['ratio']}")
    print(f"  other nodes, keel: {row['keel_other_ms']}\n  other nodes, onnxruntime: "
          f"{row['onnxruntime_other_ms']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(CNNS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", default="1", help="thread counts, e.g. 1,2")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--pass-seconds", type=float, default=0.3)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--profile", action="store_true",
                   help="per-node times against onnxruntime's instead of whole runs")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name not in CNNS:
            p.error(f"unknown model {name!r}; choose from {', '.join(CNNS)}")
        model = quantize(name)
        if args.profile:
            for t in (int(t) for t in str(args.threads).split(",") if t.strip()):
                found = profile_nodes(name, model, args.batch, t, args.passes)
                _print_profile(name, found)
                rows.append({"model": name, "load_average": _load_average(), **found})
            continue
        row = _bench(name, model, args)
        row["top1_agreement_with_fp32"] = top1_agreement(name, model)
        print(f"{name}: {row['ratios (keel time / onnxruntime time)']} cpu time "
              f"{row['cpu_time_ratio (keel / onnxruntime)']} top-1 agreement "
              f"{row['top1_agreement_with_fp32']:.3f} load {row['load_average']}", flush=True)
        rows.append(row)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    import keel

    payload = {"stamp": stamp, "keel": keel.__version__, "machine": keel.probe().to_dict(),
               "batch": args.batch, "rows": rows}
    kind = "int8-profile" if args.profile else "int8"
    (args.out / f"{kind}-{stamp}.json").write_text(json.dumps(payload, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
