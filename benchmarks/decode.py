"""Small shapes: a GPT-2 decode loop, its single step, and a small block at sequence 1.

    python -m benchmarks.decode                  # 1 thread, 7 alternating passes
    python -m benchmarks.decode --passes 11 --steps 32

Three cases, keel's cpu backend against onnxruntime (same threads, sequential):

* ``decode_loop``: greedy generation on ``gpt2_decode`` (benchmarks/zoo.py, exported
  with torch): an 8-token prompt, then ``--steps`` steps of one token each, every step
  feeding a cache one position longer: a new input signature per step, as real decoding
  does. The time is per step (the prompt step excluded).
* ``decode_step``: the same step again and again (batch 1, a cache of 64).
* ``small_block_s1``: the attention + LayerNorm + GELU block at batch 1, sequence 1.

Each pass times keel and onnxruntime back to back; the ratio is the median over passes
of keel's time over onnxruntime's (below 1.0 keel is faster), for each pass's median
call and for its tenth percentile (less disturbed by other work on a shared machine). Writes
``benchmarks/results/decode-<stamp>.json`` with the machine's probe and load average.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import zoo
from benchmarks.exports import GPT2Shape, decode_feeds, missing_packages

RESULTS = Path(__file__).resolve().parent / "results"
Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def _runners(model: bytes, threads: int) -> tuple[Runner, Runner]:
    import onnxruntime as ort

    import keel

    k = keel.load_model(model, backend="cpu", threads=threads, plan_cache=False)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    s = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    return (lambda f: k.run(None, f)), (lambda f: s.run(None, f))


Timing = tuple[float, float]       # (median, tenth percentile) of one pass, in seconds


def _loop(run: Runner, shape: GPT2Shape, steps: int, start: int) -> Timing:
    """Seconds per step of greedy decoding after an 8-token prompt; caches start at
    ``start`` tokens so that each pass meets signatures it has not seen."""
    rng = np.random.default_rng(start)
    prompt = rng.integers(0, shape.vocab, (1, 8))
    past = [rng.standard_normal((1, shape.heads, start, shape.head_dim)).astype(np.float32)
            for _ in shape.past_names()]
    out = run(decode_feeds(shape, prompt, past))
    times: list[float] = []
    for _ in range(steps):
        token = np.array([[int(out[0][0, -1].argmax())]], np.int64)
        t0 = time.perf_counter()
        out = run(decode_feeds(shape, token, out[1:]))
        times.append(time.perf_counter() - t0)
    return _stats(times)


def _repeat(run: Runner, feeds: dict[str, np.ndarray], seconds: float) -> Timing:
    """One call's seconds over about ``seconds`` of calls."""
    run(feeds)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        t0 = time.perf_counter()
        run(feeds)
        times.append(time.perf_counter() - t0)
    return _stats(times)


def _stats(times: list[float]) -> Timing:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[len(ordered) // 10]


def _alternate(name: str, passes: int, timed: Callable[[Runner, int], Timing],
               keel_run: Runner, ort_run: Runner) -> dict[str, Any]:
    keel_t: list[Timing] = []
    ort_t: list[Timing] = []
    for i in range(passes):
        keel_t.append(timed(keel_run, i))
        ort_t.append(timed(ort_run, i))
    row: dict[str, Any] = {"case": name, "passes": passes}
    # The tenth percentile is less disturbed by other work on a shared machine.
    for which, label in ((0, ""), (1, "_p10")):
        k = [t[which] for t in keel_t]
        o = [t[which] for t in ort_t]
        row[f"keel_ms{label}"] = statistics.median(k) * 1e3
        row[f"onnxruntime_ms{label}"] = statistics.median(o) * 1e3
        row[f"ratio{label}"] = statistics.median(a / b for a, b in zip(k, o, strict=True))
    print(f"{name}: keel {row['keel_ms']:.3f} ms, onnxruntime {row['onnxruntime_ms']:.3f} ms, "
          f"ratio {row['ratio']:.2f} (tenth percentiles: {row['keel_ms_p10']:.3f} / "
          f"{row['onnxruntime_ms_p10']:.3f} ms, ratio {row['ratio_p10']:.2f})", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--steps", type=int, default=32, help="decode loop steps (0: no loop)")
    p.add_argument("--pass-seconds", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = []
    before = _load_average()
    block = zoo.build("small_block")
    keel_run, ort_run = _runners(block, args.threads)
    feeds = zoo.MODELS["small_block"].make_feeds(1)
    rows.append(_alternate("small_block_s1", args.passes,
                           lambda run, _: _repeat(run, feeds, args.pass_seconds),
                           keel_run, ort_run))
    missing = missing_packages()
    if missing is None:
        shape = zoo.decode_shape()
        keel_run, ort_run = _runners(zoo.build("gpt2_decode"), args.threads)
        step = zoo.decode_feeds(1)
        rows.append(_alternate("decode_step", args.passes,
                               lambda run, _: _repeat(run, step, args.pass_seconds),
                               keel_run, ort_run))
        if args.steps > 0:
            rows.append(_alternate("decode_loop", args.passes,
                                   lambda run, i: _loop(run, shape, args.steps,
                                                        16 + i * (args.steps + 8)),
                                   keel_run, ort_run))
    else:
        print(f"decode cases skipped: {missing}")
    _write(args, rows, before)
    return 0


def _load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], before: str,
           kind: str = "decode", **extra: Any) -> None:
    """``<out>/<kind>-<stamp>.json``: the cases, the machine, the load before and after."""
    import onnxruntime

    import keel

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    payload = {"stamp": stamp, "python": platform.python_version(), "keel": keel.__version__,
               "onnxruntime": onnxruntime.__version__, "threads": args.threads,
               **({"steps": args.steps} if kind == "decode" else {}), **extra,
               "load_average": {"before": before, "after": _load_average()},
               "machine": keel.probe().to_dict(), "cases": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{kind}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path} (load average {before} before, {_load_average()} after)")


if __name__ == "__main__":
    raise SystemExit(main())
