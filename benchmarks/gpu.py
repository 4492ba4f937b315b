"""keel's gpu backend against torch on the same GPU, same graph, same weights.

    python -m benchmarks.gpu                          # six models, batches 1 and 32
    python -m benchmarks.gpu --models resnet18 --batches 32 --passes 5

For each model and batch, in one process, with alternating passes:

* ``keel``: keel's gpu backend, NumPy in and out (CUDA-graph replay where the
  program is captured; ``explain()`` says whether it is);
* ``keel_fp16``: the same at ``precision="fp16"``;
* ``torch``: torch eager on the same graph (:mod:`keel.torch_graph`), NumPy
  in and out, TF32 off for convolutions and matrix products;
* ``torch_graph`` (batch 1): torch's CUDA-graph replay of the same calls;
* ``torch_fp16`` (batch 32): torch eager under ``torch.autocast(float16)``;
* ``keel_dev`` / ``torch_dev``: device-resident feeds and outputs (CuPy arrays
  in and out for keel, CUDA tensors for torch): no host copies;
* ``keel_cpu`` (ResNet-18 at batch 32): keel's cpu backend on this machine's cores.

Each runner's time is the median over passes of the per-pass median; ratios
are keel time over torch time (below 1.0 keel is faster). Results go to
``benchmarks/results/gpu-<stamp>.json`` with the machine's probe, and the
table is printed. Correctness: keel's output against torch fp32 (relative L2).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.zoo import MODELS, build

RESULTS = Path(__file__).resolve().parent / "results"
SIX = ("mlp", "lenet", "resnet20", "resnet18", "mobilenetv2", "bert_mini")
Runner = Callable[[], Any]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    why = _unavailable()
    if why:
        print(f"benchmarks.gpu: {why}", file=sys.stderr)
        return 2
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name in args.models:
        for batch in args.batches:
            started = time.perf_counter()
            try:
                row = bench(name, batch, args.passes, args.pass_seconds, args.profile,
                            args.placement)
            except Exception as exc:             # one model's failure: keep the rest
                row = {"model": name, "batch": batch,
                       "error": f"{type(exc).__name__}: {exc}"}
            row["seconds"] = round(time.perf_counter() - started, 1)
            rows.append(row)
            print(_line(row), flush=True)
    _write(rows, args)
    return 0


def _unavailable() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'keel-runtime[zoo]')"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    from keel.backends.gpu.backend import GpuBackend

    gpu = GpuBackend()
    return "" if gpu.is_available() else f"keel's gpu backend: {gpu.availability().reason}"


def bench(name: str, batch: int, passes: int, pass_seconds: float,
          profile: bool = False, placement: bool = False) -> dict[str, Any]:
    """Time every runner for one model and batch; the row of the table."""
    import cupy
    import torch

    import keel
    from keel.torch_graph import TorchGraph

    data = build(name)
    feeds = MODELS[name].make_feeds(batch)
    graph = TorchGraph(data)
    dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    cp_feeds = {k: cupy.asarray(v) for k, v in feeds.items()}
    model = keel.load_model(data, backend="gpu")
    half = keel.load_model(data, backend="gpu", precision="fp16")

    def host(out: dict[str, Any]) -> dict[str, np.ndarray]:
        return {k: v.float().cpu().numpy() for k, v in out.items()}

    def torch_run() -> Any:
        return host(graph({k: torch.from_numpy(v).cuda() for k, v in feeds.items()}))

    def torch_fp16() -> Any:
        with torch.autocast("cuda", dtype=torch.float16):
            return torch_run()

    def keel_dev() -> Any:
        out = model.predict(cp_feeds, output_device="gpu")
        cupy.cuda.get_current_stream().synchronize()
        return out

    def torch_dev() -> Any:
        out = graph(dev)
        torch.cuda.synchronize()
        return out

    runners: dict[str, Runner] = {
        "keel": lambda: model.predict(feeds),
        "keel_fp16": lambda: half.predict(feeds),
        "torch": torch_run,
        "keel_dev": keel_dev,
        "torch_dev": torch_dev,
    }
    if batch == 1:
        runners["torch_graph"] = _torch_graph(graph, feeds)
    else:
        runners["torch_fp16"] = torch_fp16
    if name == "resnet18" and batch >= 32:
        cpu = keel.load_model(data, backend="cpu")
        runners["keel_cpu"] = lambda: cpu.predict(feeds)
    with torch.no_grad():
        reference = torch_run()
        checks = _check(reference, model.predict(feeds), half.predict(feeds))
        times = _alternate(runners, passes, pass_seconds)
    program = next((p.program for p in model._cache.values() if p.program is not None), None)
    row: dict[str, Any] = {
        "profile": _profile(data, feeds) if profile else [],
        "auto": _auto(data, feeds) if placement else {},
        "model": name, "batch": batch, "ms": {k: round(v * 1e3, 4) for k, v in times.items()},
        "captured": bool(program is not None and program.captured),
        "capture_reason": "" if program is None else program.capture_reason,
        **checks,
    }
    row["ratios"] = _ratios(times)
    return row


def _profile(data: bytes, feeds: dict[str, np.ndarray], runs: int = 3, top: int = 10
             ) -> list[dict[str, Any]]:
    """keel gpu's slowest nodes: milliseconds per run, each step synchronized (so the
    sum is over the un-recorded run, launch gaps included)."""
    import keel

    model = keel.load_model(data, backend="gpu", enable_profiling=True)
    model.predict(feeds)
    profiler = model.profiler
    assert profiler is not None
    profiler.events.clear()
    for _ in range(runs):
        model.predict(feeds)
    ops = {e.name: (e.op, e.backend) for e in profiler.events}
    totals = sorted(profiler.node_totals().items(), key=lambda kv: -kv[1])
    return [{"node": n, "op": ops[n][0], "backend": ops[n][1], "ms": round(us / runs / 1e3, 4)}
            for n, us in totals[:top]]


def _auto(data: bytes, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """What auto mode decides here: the device trial's reason and the precision."""
    import keel

    model = keel.load_model(data)
    started = time.perf_counter()
    model.predict(feeds)
    first = time.perf_counter() - started
    plan = model.plan
    measured = next((r for r in plan.reasons if r.startswith("placement measured")), "")
    return {"placement": measured, "precision": model._half_reason,
            "backends": sorted(plan.backends), "first_predict_s": round(first, 3)}


def _torch_graph(graph: Any, feeds: dict[str, np.ndarray]) -> Runner:
    """torch's CUDA-graph replay of the graph, NumPy in and out."""
    import torch

    static = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            graph(static)
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(cuda_graph):
        outputs = graph(static)

    def replay() -> Any:
        for k, v in feeds.items():
            static[k].copy_(torch.from_numpy(v))
        cuda_graph.replay()
        return {k: v.cpu().numpy() for k, v in outputs.items()}

    return replay


def _check(reference: dict[str, np.ndarray], fp32: dict[str, Any],
           fp16: dict[str, Any]) -> dict[str, float]:
    def rel(got: dict[str, Any]) -> float:
        worst = 0.0
        for k, want in reference.items():
            have = np.asarray(got[k], dtype=np.float64)
            worst = max(worst, float(np.linalg.norm(have - want)
                                     / max(np.linalg.norm(want), 1e-30)))
        return worst

    return {"rel_l2_fp32": rel(fp32), "rel_l2_fp16": rel(fp16)}


def _alternate(runners: dict[str, Runner], passes: int, pass_seconds: float
               ) -> dict[str, float]:
    """Median over ``passes`` alternating passes of each runner's per-pass median."""
    for run in runners.values():                  # warm: plans, recordings, autotuning
        for _ in range(3):
            run()
    per: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(passes):
        for name, run in runners.items():
            samples: list[float] = []
            deadline = time.perf_counter() + pass_seconds
            while len(samples) < 3 or time.perf_counter() < deadline:
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
                if len(samples) >= 200:
                    break
            per[name].append(statistics.median(samples))
    return {k: statistics.median(v) for k, v in per.items()}


def _ratios(t: dict[str, float]) -> dict[str, float]:
    pairs = {"keel/torch": ("keel", "torch"), "keel/torch_graph": ("keel", "torch_graph"),
             "keel_fp16/torch_fp16": ("keel_fp16", "torch_fp16"),
             "keel_dev/torch_dev": ("keel_dev", "torch_dev"),
             "keel_cpu/keel": ("keel_cpu", "keel")}
    return {k: round(t[a] / t[b], 3) for k, (a, b) in pairs.items() if a in t and b in t}


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['model']} b{row['batch']}: ERROR {row['error']}"
    ms = "  ".join(f"{k}={v:.3f}" for k, v in row["ms"].items())
    ratios = "  ".join(f"{k}={v:.2f}" for k, v in row["ratios"].items())
    return (f"{row['model']} b{row['batch']}: {ms} ms | {ratios} | err fp32 "
            f"{row['rel_l2_fp32']:.1e} fp16 {row['rel_l2_fp16']:.1e} | "
            f"{'captured' if row['captured'] else row['capture_reason']}")


def render_markdown(rows: list[dict[str, Any]], device: str) -> str:
    head = (f"# keel gpu vs torch on {device}\n\nTimes in ms (NumPy in and out unless _dev); "
            "ratios keel/torch (< 1.0: keel faster). TF32 off on both sides.\n\n"
            "| model | batch | keel | torch | keel/torch | torch graph | keel fp16 | "
            "torch fp16 | fp16 ratio | keel dev / torch dev | captured |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | error: {r['error']} |")
            continue
        ms, ra = r["ms"], r["ratios"]

        def cell(d: dict[str, float], k: str, fmt: str = "{:.3f}") -> str:
            return fmt.format(d[k]) if k in d else "-"

        lines.append(
            f"| {r['model']} | {r['batch']} | {cell(ms, 'keel')} | {cell(ms, 'torch')} | "
            f"{cell(ra, 'keel/torch', '{:.2f}')} | {cell(ms, 'torch_graph')} | "
            f"{cell(ms, 'keel_fp16')} | {cell(ms, 'torch_fp16')} | "
            f"{cell(ra, 'keel_fp16/torch_fp16', '{:.2f}')} | "
            f"{cell(ra, 'keel_dev/torch_dev', '{:.2f}')} | {'yes' if r['captured'] else 'no'} |")
    return head + "\n".join(lines) + "\n"


def _write(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    import torch

    import keel

    device = torch.cuda.get_device_name(0)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    payload = {"stamp": stamp, "device": device, "torch": torch.__version__,
               "keel": keel.__version__, "machine": keel.probe().to_dict(),
               "config": {"passes": args.passes, "pass_seconds": args.pass_seconds},
               "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-{stamp}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    table = render_markdown(rows, device)
    (args.out / f"gpu-{stamp}.md").write_text(table)
    print(table)
    print(f"wrote {path}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(SIX))
    p.add_argument("--batches", default="1,32")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--pass-seconds", type=float, default=0.2)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--placement", action="store_true",
                   help="also record what auto mode decides (device trial, precision)")
    p.add_argument("--profile", action="store_true",
                   help="also record keel gpu's slowest nodes per model (synchronized steps)")
    a = p.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    a.batches = tuple(int(b) for b in a.batches.split(","))
    return a


if __name__ == "__main__":
    sys.exit(main())
