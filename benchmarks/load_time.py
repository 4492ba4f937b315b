"""Load time with the compiled-plan cache: first load (miss, stored) versus second (hit).

    python -m benchmarks.load_time [--model resnet18] [--runs 5] [--save]

Each run empties the plan cache, then loads the model twice: in fresh
processes (what a service restart sees) and in this process. A fresh process
imports keel before the clock starts (the import is reported apart) and
keeps compiled bytecode in a private folder, so both loads import the same
way. The load without the cache (``plan_cache=False``) is timed too, and so
is the first ``predict`` after each load, which builds the program that a
load leaves for later. Medians over the runs; ``--save`` writes
``benchmarks/results/load-<stamp>.json`` with the machine's probe.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.zoo import MODELS, build

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
CASES = ("off", "first", "second")     # plan_cache=False, then a miss, then a hit

# Runs in a fresh process: argv = model path, input name, sample shape (JSON), cache on/off.
_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from keel.execution.model import load_model
t1 = time.perf_counter()
model = load_model(sys.argv[1], plan_cache=sys.argv[4] == "on")
t2 = time.perf_counter()
x = np.random.default_rng(0).standard_normal((1, *json.loads(sys.argv[3]))).astype(np.float32)
model.predict({sys.argv[2]: x})
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_predict_s": t3 - t2,
                  "reason": next((r for r in model.plan.reasons if "plan cache" in r
                                  or "compiled plan" in r), "")}))
"""


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    report = measure(args.model, args.runs)
    _print(report)
    if args.save:
        print(f"wrote {_save(report)}")
    return 0


def measure(model: str, runs: int) -> dict[str, Any]:
    """Time ``runs`` rounds of loads of the zoo model ``model`` (see the module docstring)."""
    spec = MODELS[model]
    with tempfile.TemporaryDirectory(prefix="keel-load-") as tmp:
        folder = Path(tmp)
        path = folder / f"{model}.onnx"
        path.write_bytes(build(model))
        env = _child_env(folder)
        _child(path, spec, env, "on")       # warm up: bytecode, native builds, page cache
        fresh = _fresh_runs(path, spec, env, folder, runs)
        with _cache_dir(env["KEEL_CACHE_DIR"]):
            here = _in_process_runs(path, folder, runs)
    return _summarize(model, runs, fresh, here)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/load-<stamp>.json")
    return parser.parse_args(argv)


def _child_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(folder / "pycache")
    env["KEEL_CACHE_DIR"] = str(folder / "cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def _cache_dir(path: str) -> Iterator[None]:
    """``KEEL_CACHE_DIR`` set to ``path`` for this process, restored afterwards."""
    old = os.environ.get("KEEL_CACHE_DIR")
    os.environ["KEEL_CACHE_DIR"] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ["KEEL_CACHE_DIR"]
        else:
            os.environ["KEEL_CACHE_DIR"] = old


def _child(path: Path, spec: Any, env: dict[str, str], cache: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), spec.input_name,
         json.dumps(list(spec.sample_shape)), cache],
        capture_output=True, text=True, env=env, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _fresh_runs(path: Path, spec: Any, env: dict[str, str], folder: Path,
                runs: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for _ in range(runs):
        shutil.rmtree(folder / "cache" / "plans", ignore_errors=True)
        out["off"].append(_child(path, spec, env, "off"))
        out["first"].append(_child(path, spec, env, "on"))
        out["second"].append(_child(path, spec, env, "on"))
    return out


def _in_process_runs(path: Path, folder: Path, runs: int) -> dict[str, list[float]]:
    from keel.execution.model import load_model

    out: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(runs):
        shutil.rmtree(folder / "cache" / "plans", ignore_errors=True)
        for case in CASES:
            start = time.perf_counter()
            load_model(path, plan_cache=case != "off")
            out[case].append(time.perf_counter() - start)
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _summarize(model: str, runs: int, fresh: dict[str, list[dict[str, Any]]],
               here: dict[str, list[float]]) -> dict[str, Any]:
    summary = {case: {"load_s": _median(fresh[case], "load_s"),
                      "load_and_first_predict_s": statistics.median(
                          r["load_s"] + r["first_predict_s"] for r in fresh[case]),
                      "import_s": _median(fresh[case], "import_s")} for case in CASES}
    same = {case: statistics.median(here[case]) for case in CASES}
    return {
        "model": model, "runs": runs,
        "fresh_process": summary,
        "fresh_process_ratio": summary["second"]["load_s"] / summary["first"]["load_s"],
        "in_process_s": same,
        "in_process_ratio": same["second"] / same["first"],
        "reasons": {case: fresh[case][-1]["reason"] for case in CASES},
        "raw": {"fresh_process": fresh, "in_process": here},
    }


def _print(report: dict[str, Any]) -> None:
    print(f"{report['model']}: medians of {report['runs']} runs (seconds)")
    print(f"{'case':<8} {'fresh load':>11} {'+ predict':>10} {'in-process':>11}")
    for case in CASES:
        row = report["fresh_process"][case]
        print(f"{case:<8} {row['load_s']:>11.3f} {row['load_and_first_predict_s']:>10.3f} "
              f"{report['in_process_s'][case]:>11.3f}")
    print(f"second / first load: {report['fresh_process_ratio']:.2f} in fresh processes, "
          f"{report['in_process_ratio']:.2f} in one process")


def _save(report: dict[str, Any]) -> Path:
    return save_report(report, "load")


def save_report(report: dict[str, Any], prefix: str) -> Path:
    """Write ``report`` with the machine's probe to ``results/<prefix>-<stamp>.json``."""
    import keel

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    payload = {"stamp": stamp, "python": sys.version.split()[0], "keel": keel.__version__,
               "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
               "machine": keel.probe().to_dict(), **report}
    RESULTS.mkdir(parents=True, exist_ok=True)
    target = RESULTS / f"{prefix}-{stamp}.json"
    target.write_text(json.dumps(payload, indent=2) + "\n")
    return target


if __name__ == "__main__":
    sys.exit(main())
