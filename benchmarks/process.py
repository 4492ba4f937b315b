"""Seed 002's metrics for a whole process: time to the first prediction and peak RSS.

    python -m benchmarks.process [--models lenet,resnet20] [--runs 5] [--save]

Each run starts a fresh Python process that imports NumPy and keel, loads the
model from its ``.keel`` file (converted with ``keel convert``'s defaults) or
from the ONNX file, and predicts once, then reports:

- ``first_predict_ms``: from the child's first statement to the prediction's
  return (imports, load, first predict), and ``process_ms``: from starting the
  interpreter to its exit, as the parent sees it;
- ``cpu_ms``: the child's user + system CPU time, which a busy machine inflates
  less than the wall clock;
- ``vmhwm_mb``: the child's peak resident memory (``VmHWM``, the whole process),
  and ``above_numpy_mb``, the same minus a process that only imports NumPy (the
  figure ``benchmarks.run`` reported alone before).

Two cases per file: the compiled-plan cache on (what every process after the
first finds) and off. The model files are first left to settle (the plan cache
remembers a file's digest once it is 2 s old, as a deployed model is), and a
warm-up run fills the bytecode, dataclass-code, native-kernel and plan caches.
Baselines: a bare interpreter and one that imports NumPy. Medians over the runs;
``--save`` writes ``benchmarks/results/process-<stamp>.json`` with the machine's
load average, which these wall-clock figures depend on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.load_time import save_report
from benchmarks.zoo import MODELS, build

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ("lenet", "resnet20")
CASES = ("keel", "onnx")               # the file the model is loaded from
PLAN_CACHE = ("on", "off")

# argv: model path ("" for a baseline), input name, sample shape (JSON), plan cache,
# "numpy" for the NumPy baseline.
_CHILD = """
import time
_t0 = time.perf_counter()
import json, resource, sys
path, name, shape, cache = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
if path or cache == "numpy":
    import numpy as np
if path:
    import keel
    model = keel.load_model(path, plan_cache=cache == "on")
    model.predict({name: np.zeros((1, *shape), np.float32)})
first = time.perf_counter() - _t0
use = resource.getrusage(resource.RUSAGE_SELF)
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"first_predict_ms": first * 1e3, "cpu_ms": (use.ru_utime + use.ru_stime) * 1e3,
                  "vmhwm_mb": hwm / 1024}))
"""


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    report = measure(args.models, args.runs)
    print(render(report))
    if args.save:
        print(f"wrote {save(report)}")
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/process-<stamp>.json")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    return args


def measure(models: list[str], runs: int, files: tuple[str, ...] = CASES,
            plan_cache: tuple[str, ...] = PLAN_CACHE) -> dict[str, Any]:
    """Medians of ``runs`` fresh processes per model, file (``keel``, ``onnx``) and
    plan-cache case (``on``, ``off``), with the bare-interpreter and NumPy baselines
    (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="keel-process-") as tmp:
        folder = Path(tmp)
        env = _child_env(folder)
        baselines = {kind: _median_runs(env, runs, "", "", (), kind)
                     for kind in ("python", "numpy")}
        rows = []
        for name in models:
            paths = _model_files(name, folder)
            if "on" in plan_cache:          # (the cache off reads no digest)
                _settle(paths.values())
            spec = MODELS[name]
            for case in files:
                for cache in plan_cache:
                    row = _median_runs(env, runs, paths[case], spec.input_name,
                                       spec.sample_shape, cache)
                    row.update(model=name, file=case, plan_cache=cache,
                               above_numpy_mb=row["vmhwm_mb"] - baselines["numpy"]["vmhwm_mb"])
                    rows.append(row)
    return {"runs": runs, "baselines": baselines, "rows": rows,
            "load_average": load_average()}


def _child_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(folder / "pycache")    # bytecode kept between runs
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _model_files(name: str, folder: Path) -> dict[str, str]:
    """The zoo model as ONNX and as ``.keel`` (optimized as ``keel convert`` does)."""
    from keel.cli.convert import convert_model

    onnx_path = folder / f"{name}.onnx"
    onnx_path.write_bytes(build(name))
    keel_path = folder / f"{name}.keel"
    convert_model(onnx_path, keel_path)
    return {"onnx": str(onnx_path), "keel": str(keel_path)}


def _settle(paths: Iterable[str]) -> None:
    """Wait until the files are older than the plan cache's settling time: it remembers a
    model file's digest only then (a write in the same clock tick could not be told apart),
    so every process before would hash the whole file again. A deployed model is older."""
    from keel._hashing import SETTLE_NS

    newest = max(os.stat(p).st_ctime_ns for p in paths)
    wait = (newest + SETTLE_NS - time.time_ns()) / 1e9
    if wait > 0:
        time.sleep(wait + 0.05)


def _child(env: dict[str, str], path: str, input_name: str, shape: tuple[int, ...],
           cache: str) -> dict[str, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, path, input_name,
                           json.dumps(list(shape)), cache],
                          capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the measured process failed: {done.stderr.strip()[-600:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_ms"] = wall * 1e3
    return result


def _median_runs(env: dict[str, str], runs: int, path: str, input_name: str,
                 shape: tuple[int, ...], cache: str) -> dict[str, Any]:
    _child(env, path, input_name, shape, cache)       # warm-up: bytecode, builds, plan cache
    samples = [_child(env, path, input_name, shape, cache) for _ in range(max(1, runs))]
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def load_average() -> list[float] | None:
    """The machine's load averages, rounded (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def render(report: dict[str, Any]) -> str:
    """The medians as a Markdown table, baselines first."""
    lines = [f"Whole process, medians of {report['runs']} fresh processes (load average "
             f"{report['load_average']}):", "",
             "| model | file | plan cache | first predict ms | process ms | CPU ms "
             "| VmHWM MB | above NumPy MB |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, row in report["baselines"].items():
        lines.append(f"| ({kind} only) | | | {row['first_predict_ms']:.0f} | "
                     f"{row['process_ms']:.0f} | {row['cpu_ms']:.0f} | "
                     f"{row['vmhwm_mb']:.1f} | |")
    for row in report["rows"]:
        lines.append(f"| {row['model']} | .{row['file']} | {row['plan_cache']} | "
                     f"{row['first_predict_ms']:.0f} | {row['process_ms']:.0f} | "
                     f"{row['cpu_ms']:.0f} | {row['vmhwm_mb']:.1f} | "
                     f"{row['above_numpy_mb']:.1f} |")
    return "\n".join(lines)


def save(report: dict[str, Any]) -> Path:
    return save_report(report, "process")


if __name__ == "__main__":
    sys.exit(main())
