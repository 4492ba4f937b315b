"""Per-step dispatch overhead of keel's executor, and its fixed per-call cost.

    python -m benchmarks.dispatch                  # chains of 200 Relu and Add nodes
    python -m benchmarks.dispatch --nodes 400 --json
    python -m benchmarks.dispatch --models mlp,lenet    # batch-1 runs of zoo models

A chain of N tiny nodes (4 float32 elements) is timed against a chain of one
node; the difference divided by N is the time per node. The kernel's own cost
(the same kernel called directly, with the same buffers) is measured apart,
and the dispatch overhead is what remains. The one-node chain's time is the
fixed cost of ``Model.predict`` (validation, signature lookup, thread scope,
outputs).

For zoo models (``--models``), a batch-1 ``predict`` is timed twice, in
interleaved blocks: as it runs, and with every kernel replaced by one that
returns its buffers untouched (same plan, variants, thread caps and
outputs). The second is what a run costs around its kernels.
Speed is reported here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

__all__ = ["chain_model", "measure", "measure_models"]

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

    def call() -> Any:
        return kernel(ctx, ins, {}, out)

    return _per_call(call, 20000)


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
            per_model[n] = _per_call(functools.partial(model.predict, {"x": x}), 200)
        per_node = (per_model[nodes + 1] - per_model[1]) / nodes
        kernel = _kernel_cost(op)
        result[op] = {
            "predict_1_node_us": round(per_model[1] * 1e6, 2),
            "per_node_us": round(per_node * 1e6, 2),
            "kernel_us": round(kernel * 1e6, 2),
            "dispatch_us": round((per_node - kernel) * 1e6, 2),
        }
    return result


def _untouched(ctx: Any, inputs: Sequence[Any], attrs: Any, out: Sequence[Any] | None
               ) -> Sequence[Any]:
    return [] if out is None else out


def _hollow_registry(threads: int) -> Any:
    """A registry whose ``cpu`` backend has every kernel variant (metadata kept) replaced
    by one that returns its buffers: what is left of a run is keel's own work."""
    from keel.backends.base import KernelTable
    from keel.backends.cpu.backend import CpuBackend
    from keel.backends.registry import BackendRegistry
    from keel.ops.registry import Op

    class HollowCpu(CpuBackend):
        def _kernels(self) -> KernelTable:
            real, table = super()._kernels(), KernelTable("cpu")
            for op in Op:
                for v in real.variants(op).values():
                    table.register(dataclasses.replace(v, fn=_untouched, prepack=None))
            return table

    registry = BackendRegistry()
    registry.register("cpu", lambda: HollowCpu(threads=threads), priority=0)
    return registry


def measure_models(names: Sequence[str] = ("mlp", "lenet"), threads: int = 1,
                   rounds: int = 15) -> dict[str, Any]:
    """Batch-1 ``predict`` microseconds per zoo model: as run, and with no-op kernels."""
    import keel
    from benchmarks.zoo import MODELS, build

    hollow = _hollow_registry(threads)
    result: dict[str, Any] = {}
    for name in names:
        spec = MODELS[name]
        feeds = {spec.input_name: spec.make_input(1)}
        real = keel.load_model(build(name), backend="cpu", threads=threads)
        empty = keel.load_model(build(name), backend="cpu", registry=hollow)
        times: dict[str, list[float]] = {"real": [], "empty": []}
        for _ in range(rounds):             # interleaved blocks: both see the same noise
            for key, model in (("real", real), ("empty", empty)):
                times[key].append(_per_call(functools.partial(model.predict, feeds), 200, 1))
        run, around = (statistics.median(times[k]) * 1e6 for k in ("real", "empty"))
        result[name] = {"predict_us": round(run, 2), "around_kernels_us": round(around, 2),
                        "kernels_us": round(run - around, 2), "steps": len(real.plan.nodes)}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--models", default="",
                   help="comma-separated zoo models to time at batch 1 (e.g. mlp,lenet)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = measure(args.nodes)
    names = [n for n in args.models.split(",") if n]
    models = measure_models(names) if names else {}
    if args.json:
        print(json.dumps({**result, **{f"model:{k}": v for k, v in models.items()}}, indent=2))
        return 0
    for op, r in result.items():
        print(f"{op:5s} per node {r['per_node_us']:6.2f} us = kernel {r['kernel_us']:5.2f} us "
              f"+ dispatch {r['dispatch_us']:5.2f} us; predict() with one node "
              f"{r['predict_1_node_us']:.1f} us")
    for name, r in models.items():
        print(f"{name}: batch-1 predict {r['predict_us']:.1f} us = kernels "
              f"{r['kernels_us']:.1f} us + {r['around_kernels_us']:.1f} us around them "
              f"({r['steps']} nodes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
