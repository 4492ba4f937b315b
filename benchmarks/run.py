"""Run keel's benchmark suite: keel's cpu backend against onnxruntime, side by side.

    python -m benchmarks.run                       # every model, batches 1 and 32, 1 and 2 threads
    python -m benchmarks.run --models lenet,mlp --passes 3
    python -m benchmarks.run --backend gpu         # keel's gpu backend vs torch (benchmarks.gpu)
    python -m benchmarks.run --backend webgpu      # keel's webgpu backend vs onnxruntime (CPU)

``--backend webgpu`` times whatever adapter wgpu finds. On Mesa's llvmpipe (no
GPU) the numbers say nothing about speed: a software rasterizer on the cores
onnxruntime uses. They mean something on a real GPU adapter.

Writes ``benchmarks/results/<stamp>.json`` (with the machine's probe) and
``benchmarks/results/latest.md`` (the ratio table). Ratios are keel time over
onnxruntime time, the median over alternating passes in one process: below
1.0 keel is faster. The passes alternate settled blocks (``--method settled``,
the default; :mod:`keel.bench`): each runtime's block starts once the other's
worker threads have gone idle, so a 2-thread cell times each runtime without
the other's spinning workers on its cores. ``--method blocks`` alternates the
blocks back to back, as runs before this method did. Both files name the method.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import process
from benchmarks.zoo import DEFAULT_MODELS, MODELS, build
from keel.bench import METHODS, BenchConfig, ModelReport, bench_model, peak_rss_delta
from keel.errors import KeelError

RESULTS = Path(__file__).resolve().parent / "results"
RSS_MODELS = ("lenet", "resnet20", "mlp")
# Targets of the suite, as keel/onnxruntime time ratios (lower is better).
# Throughput ≥ 1.0x (0.8x) onnxruntime is a time ratio ≤ 1.0 (1.25).
TARGETS: dict[str, Any] = {
    "b32": {"mlp": 1.0, "resnet18": 1.0, "bert_mini": 1.0,
            "lenet": 1.25, "resnet20": 1.25, "mobilenetv2": 1.25},
    "b1_t1": 1.5,
    # Small shapes, where the fixed cost per call and per node dominates.
    "b1_t1_small": {"small_block": 1.2, "gpt2_decode": 1.2},
}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return _run(args)
    except KeelError as exc:          # a backend or provider that cannot run here
        print(f"benchmarks.run: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.backend == "gpu":       # the gpu's reference is torch on the same GPU
        from benchmarks import gpu

        return gpu.main(["--models", ",".join(args.models), "--batches",
                         ",".join(map(str, args.batches)), "--passes", str(args.passes),
                         "--out", str(args.out)])
    config = BenchConfig(batches=args.batches, threads=args.threads, passes=args.passes,
                         min_pass_seconds=args.pass_seconds, backend=args.backend,
                         method=args.method)
    reports: list[ModelReport] = []
    for name in args.models:
        spec = MODELS[name]
        model = build(name)
        before = _load_average()
        report = bench_model(name, model, config,
                             feeds_for=spec.make_feeds,
                             progress=lambda msg: print(f"  {msg}", flush=True))
        # Other work on a shared machine slows 2-thread runs most: record how busy it was.
        report.notes.append(f"load average (1 min) {before} before, {_load_average()} after")
        if name in RSS_MODELS and not args.no_rss and args.backend == "cpu":
            _add_rss(report, model)
        reports.append(report)
        print(_row(report, args), flush=True)
    _write(reports, args)
    return 0


def _load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:                     # not every platform reports one
        return "unknown"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"models to run, from {', '.join(MODELS)} (gpt2_decode needs torch)")
    p.add_argument("--backend", default="cpu", choices=("cpu", "gpu", "webgpu"),
                   help="keel backend to time; gpu compares with torch on the same GPU "
                        "(python -m benchmarks.gpu), "
                        "webgpu with its CPU provider (on llvmpipe: correctness, not speed)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--pass-seconds", type=float, default=0.3)
    p.add_argument("--method", default="settled", choices=METHODS,
                   help="settled: each runtime's block starts once the other's threads are "
                        "idle (default); blocks: the blocks back to back")
    p.add_argument("--no-rss", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    a.batches = tuple(int(b) for b in a.batches.split(","))
    a.threads = tuple(int(t) for t in a.threads.split(","))
    return a


def _add_rss(report: ModelReport, model: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{report.model}.onnx"
        path.write_bytes(model)
        for runtime in ("keel:cpu", "onnxruntime"):
            report.peak_rss_mb[runtime] = round(peak_rss_delta(str(path), runtime), 1)
    # The whole process beside the figure above NumPy: .keel file, plan cache on.
    row = process.measure([report.model], runs=3, files=("keel",), plan_cache=("on",))
    (found,) = row["rows"]
    report.process = {k: round(found[k], 1) for k in ("first_predict_ms", "cpu_ms", "vmhwm_mb")}


def _row(r: ModelReport, args: argparse.Namespace) -> str:
    cells = [f"{k}={v:.2f}" for k, v in sorted(r.ratios.items())]
    return f"{r.model}: " + "  ".join(cells)


def _write(reports: list[ModelReport], args: argparse.Namespace) -> None:
    import keel

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    payload: dict[str, Any] = {
        "stamp": stamp,
        "python": platform.python_version(),
        "keel": keel.__version__,
        "onnxruntime": _ort_version(),
        "config": {"batches": args.batches, "threads": args.threads, "passes": args.passes,
                   "method": args.method},
        "machine": keel.probe().to_dict(),
        "models": [r.to_dict() for r in reports],
    }
    (args.out / f"{stamp}.json").write_text(json.dumps(payload, indent=2))
    (args.out / "latest.md").write_text(render_markdown(payload))
    print(f"wrote {args.out / (stamp + '.json')} and {args.out / 'latest.md'}")


def _ort_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


def target(model: str, key: str) -> float | None:
    """The ratio a setting must stay under, or None where the suite sets no target."""
    if key == "b1_t1":
        return float(TARGETS["b1_t1_small"].get(model, TARGETS["b1_t1"]))
    if key.startswith("b32_"):
        goal = TARGETS["b32"].get(model)
        return None if goal is None else float(goal)
    return None


def _cell(m: dict[str, Any], key: str) -> str:
    if key not in m["ratios"]:
        return "—"
    ratio = m["ratios"][key]
    goal = target(m["model"], key)
    mark = "" if goal is None else (" ✓" if ratio <= goal else " ✗")
    return f"{ratio:.2f}{mark}"


def _keel(values: dict[str, Any], default: Any) -> Any:
    """keel's entry (``keel:cpu``, ``keel:gpu``...) in a per-runtime mapping."""
    return next((v for k, v in values.items() if k.startswith("keel:")), default)


def _process_cell(row: dict[str, float]) -> str:
    if not row:
        return " | — |"
    return f" | {row['first_predict_ms']:.0f}, {row['cpu_ms']:.0f}, {row['vmhwm_mb']:.1f} |"


# How the passes alternated (``--method``), as the table states it.
_METHOD_TEXT = {
    "settled": "Method: settled blocks — each runtime's block of runs starts once the "
               "process's other threads (the other runtime's workers) have gone idle, after "
               "an untimed run, the order of the runtimes swapping from pass to pass.",
    "blocks": "Method: blocks — a block of keel's runs, then one of onnxruntime's, back to "
              "back.",
}


def render_markdown(payload: dict[str, Any]) -> str:
    """The ratio table: keel time / onnxruntime time per model and setting."""
    cfg = payload["config"]
    keys = [f"b{b}_t{t}" for b in cfg["batches"] for t in cfg["threads"]]
    cpu = payload["machine"]["cpu"]
    lines = [
        f"# keel vs onnxruntime {payload['onnxruntime']} — {payload['stamp']}",
        "",
        f"Machine: {cpu.get('brand')}, {cpu.get('usable_cores')} usable cores, "
        f"SIMD {cpu.get('simd_level')}; Python {payload['python']}.",
        "Cells: keel time / onnxruntime time (median over alternating passes in one "
        "process; < 1.0 means keel is faster). bN_tM = batch N with M threads. "
        f"{_METHOD_TEXT[cfg.get('method', 'blocks')]} "
        "A cell with a target shows ✓ when it is met, ✗ when not (batch 1: ≤ 1.5 with "
        "1 thread, ≤ 1.2 for small_block and gpt2_decode; batch 32: ≤ 1.0 for mlp, "
        "resnet18, bert_mini, ≤ 1.25 for the others).",
        "",
        "| model | " + " | ".join(keys) + " | load ms keel / ort | peak RSS MB keel / ort "
        "| whole process (.keel): first predict ms, CPU ms, VmHWM MB |",
        "|---" * (len(keys) + 4) + "|",
    ]
    for m in payload["models"]:
        ratios = [_cell(m, k) for k in keys]
        load = m["load_ms"]
        rss = m["peak_rss_mb"]
        lines.append(
            f"| {m['model']} | " + " | ".join(ratios)
            + f" | {_keel(load, float('nan')):.1f} / {load.get('onnxruntime', 0):.1f}"
            + (f" | {rss['keel:cpu']} / {rss['onnxruntime']}" if rss else " | —")
            + _process_cell(m.get("process") or {})
        )
    notes = [f"- {m['model']}: {n}" for m in payload["models"] for n in m.get("notes", [])]
    if notes:
        lines += ["", "Notes: the machine's load while each model ran (2 usable cores: above "
                  "~1, other work competes with a 2-thread run) and, with settled blocks, how "
                  "long the other runtime's threads took to go idle before each runtime's "
                  "blocks:", "", *notes]
    lines += ["", "Medians (ms) per runtime:", "",
              "| model | setting | keel median | keel p90 | ort median | ort p90 |",
              "|---|---|---|---|---|---|"]
    for m in payload["models"]:
        by = {(x["runtime"].split(":")[0], x["batch"], x["threads"]): x
              for x in m["measurements"]}
        for b in cfg["batches"]:
            for t in cfg["threads"]:
                k, o = by.get(("keel", b, t)), by.get(("onnxruntime", b, t))
                if k and o:
                    lines.append(f"| {m['model']} | b{b}_t{t} | {k['median_ms']:.3f} | "
                                 f"{k['p90_ms']:.3f} | {o['median_ms']:.3f} | {o['p90_ms']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
