"""Per-step dispatch overhead of keel's executor, and its fixed per-call cost.

    python -m benchmarks.dispatch                  # chains of 200 Relu and Add nodes
    python -m benchmarks.dispatch --nodes 400 --json

A chain of N tiny nodes (4 float32 elements) is timed against a chain of one
node; the difference divided by N is the time per node. The kernel's own cost
(the same kernel called directly, with the same buffers) is measured apart,
and the dispatch overhead is what remains. The one-node chain's time is the
fixed cost of ``Model.predict`` (validation, signature lookup, thread scope,
outputs). Speed is reported here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

__all__ = ["chain_model", "measure"]

_SIZE = 4


def chain_model(n: int, op: str = "Relu", size: int = _SIZE) -> bytes:
    """An ONNX model: ``n`` nodes of ``op`` (Relu, or Add of a constant) in a chain."""
    nodes, x = [], "x"
    for i in range(n):
        ins = [x, "c"] if op == "Add" else [x]
        nodes.append(helper.make_node(op, ins, [f"v{i}"], name=f"n{i}"))
        x = f"v{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="out"))
    inits = [numpy_helper.from_array(np.ones(size, np.float32), "c")] if op == "Add" else []
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _per_call(fn: Callable[[], Any], calls: int, repeats: int = 7) -> float:
    """Median seconds per call over ``repeats`` blocks of ``calls`` calls."""
    for _ in range(min(calls, 50)):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _kernel_cost(op: str) -> float:
    """Seconds per direct call of the cpu kernel a chain node runs."""
    from keel.backends.cpu.backend import CpuBackend
    from keel.ops.registry import to_op

    backend = CpuBackend(threads=1)
    kernel = backend.kernels.get(to_op(op.lower())).fn
    ctx = backend.context()
    x = np.ones(_SIZE, np.float32)
    ins = [x, np.ones(_SIZE, np.float32)] if op == "Add" else [x]
    out = [np.empty(_SIZE, np.float32)]
    return _per_call(lambda: kernel(ctx, ins, {}, out), 20000)


def measure(nodes: int = 200, ops: tuple[str, ...] = ("Relu", "Add")) -> dict[str, Any]:
    """Per-node time, kernel time and dispatch overhead (microseconds) per op."""
    import keel

    result: dict[str, Any] = {}
    x = np.ones(_SIZE, np.float32)
    for op in ops:
        per_model = {}
        for n in (1, nodes + 1):
            model = keel.load_model(chain_model(n, op), backend="cpu",
                                    optimization_level="none", threads=1)
            per_model[n] = _per_call(lambda m=model: m.predict({"x": x}), 200)
        per_node = (per_model[nodes + 1] - per_model[1]) / nodes
        kernel = _kernel_cost(op)
        result[op] = {
            "predict_1_node_us": round(per_model[1] * 1e6, 2),
            "per_node_us": round(per_node * 1e6, 2),
            "kernel_us": round(kernel * 1e6, 2),
            "dispatch_us": round((per_node - kernel) * 1e6, 2),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = measure(args.nodes)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for op, r in result.items():
        print(f"{op:5s} per node {r['per_node_us']:6.2f} us = kernel {r['kernel_us']:5.2f} us "
              f"+ dispatch {r['dispatch_us']:5.2f} us; predict() with one node "
              f"{r['predict_1_node_us']:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
