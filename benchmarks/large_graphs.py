"""Loading large graphs: a chain of 100,000 Relus and 20,000 Relus into one Sum.

    python -m benchmarks.large_graphs [--runs 3] [--save]

Each run is a fresh process that builds the model's bytes, imports keel and the ONNX
importer, then measures, with its peak resident set restarted before each
(``/proc/self/clear_refs``):

- ``import``: ``import_onnx`` alone (ONNX bytes to keel's graph): seconds, CPU seconds
  and the peak's growth over the process before it, as a multiple of the file's bytes;
- ``load``: ``load_model(bytes, plan_cache=False)`` (import, optimization, placement,
  memory plan), the same figures, in a second fresh process.

Medians over the runs; ``--save`` writes ``benchmarks/results/large-<stamp>.json``
with the machine's probe and load average (wall seconds depend on it: compare CPU
seconds on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.load_time import save_report
from benchmarks.process import load_average

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"chain": 100_000, "fan-in": 20_000}
STAGES = ("import", "load")

# argv: shape, node count, stage
_CHILD = """
import json, sys, time
from onnx import TensorProto, helper
from keel.execution.model import load_model
from keel.graph.importers.onnx import import_onnx

def model(nodes, x, y):
    graph = helper.make_graph(nodes, "large", [
        helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["N", 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()

n = int(sys.argv[2])
if sys.argv[1] == "chain":
    data = model([helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"], name=f"n{i}")
                  for i in range(n)], "v0", f"v{n}")
else:
    nodes = [helper.make_node("Relu", ["x"], [f"r{i}"], name=f"r{i}") for i in range(n)]
    nodes.append(helper.make_node("Sum", [f"r{i}" for i in range(n)], ["y"], name="sum"))
    data = model(nodes, "x", "y")
small = model([helper.make_node("Relu", ["a"], ["b"])], "a", "b")
run = import_onnx if sys.argv[3] == "import" else (lambda d: load_model(d, plan_cache=False))
run(small)                                        # modules loaded, native kernels built

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
wall, cpu = time.perf_counter(), time.process_time()
run(data)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_mb": (status("VmHWM:") - before) / 1e6,
                  "ratio": (status("VmHWM:") - before) / len(data), "file_mb": len(data) / 1e6}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/large-<stamp>.json")
    args = parser.parse_args(argv)
    report = measure(args.runs)
    print(render(report))
    if args.save:
        print(f"wrote {save_report(report, 'large')}")
    return 0


def measure(runs: int) -> dict[str, Any]:
    """Medians of ``runs`` fresh processes per shape and stage (see the module docstring)."""
    rows = []
    for shape, n in SHAPES.items():
        for stage in STAGES:
            samples = [measure_once(shape, n, stage) for _ in range(max(1, runs))]
            row = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
            row.update(shape=shape, nodes=n, stage=stage, samples=samples)
            rows.append(row)
    return {"runs": runs, "rows": rows, "load_average_after": load_average()}


def measure_once(shape: str, n: int, stage: str) -> dict[str, float]:
    """One fresh process's figures for ``stage`` (``import`` or ``load``) of the graph
    ``shape`` (``chain`` or ``fan-in``) of ``n`` nodes: wall_s, cpu_s, peak_mb, ratio
    (the peak's growth over the file's bytes), file_mb. Linux only (``/proc``)."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _CHILD, shape, str(n), stage],
                          capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the measured process failed: {done.stderr.strip()[-600:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def render(report: dict[str, Any]) -> str:
    """The medians as a Markdown table."""
    lines = [f"Large graphs, medians of {report['runs']} fresh processes (load average "
             f"{report['load_average_after']}):", "",
             "| graph | stage | file MB | wall s | CPU s | peak MB | peak / file |",
             "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['shape']} of {row['nodes']:,} | {row['stage']} | "
                     f"{row['file_mb']:.2f} | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | "
                     f"{row['peak_mb']:.1f} | {row['ratio']:.1f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
