"""Inter-op parallelism: independent branches run at once against the same model in order.

    python -m benchmarks.interop                     # 2 threads, 9 alternating passes
    python -m benchmarks.interop --threads 4 --passes 15
    python -m benchmarks.interop --plans             # the suite's models: what each plan chose

Cases, each loaded twice in one process: once as planned (``KEEL_INTEROP=on``, the
default) and once with every node in order (``KEEL_INTEROP=off``); each pass times both
back to back, and the ratio is the median over passes of the planned time over the
in-order time (below 1.0 the branches at once are faster). The models, built here with
onnx.helper (the tests build the same ones):

* ``two_heads``: a Gemm trunk, then two heads of three 512-wide Gemm + Relu and a
  Softmax each (a model with two outputs), at batch 1 and 32; at batch 1 each product
  streams its weight over the threads (the cpu planner's ``streams_b``), so the heads
  fill two threads already;
* ``narrow_heads_b1``: the same with 128-wide Gemms, whose products stay on one thread
  each: the case where branches at once could fill the threads;
* ``inception``: a stem conv, then four branches (1x1; 1x1 then 3x3; 1x1 then 5x5;
  3x3 max pool then 1x1) joined by a Concat, 32 channels at 16x16 and 28x28, batch 1.

``--plans`` plans the benchmark suite's models (benchmarks/zoo.py) at batch 1 and 32 and
prints each region the plan found and what it decided, without running anything.
Writes ``benchmarks/results/interop-<stamp>.json`` with the machine's probe and load.
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
import onnx
from onnx import TensorProto, helper, numpy_helper

RESULTS = Path(__file__).resolve().parent / "results"


# ---- the models -----------------------------------------------------------------------
def _weight(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float32),
                                   name)


def _model(nodes: list[onnx.NodeProto], name: str, inputs: list[onnx.ValueInfoProto],
           outputs: list[onnx.ValueInfoProto], inits: list[onnx.TensorProto]
           ) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def two_heads(batch: int = 1, width: int = 512, depth: int = 3, seed: int = 0
              ) -> onnx.ModelProto:
    """A Gemm trunk and two heads of ``depth`` Gemm + Relu and a Softmax: two outputs."""
    rng = np.random.default_rng(seed)
    inits = [_weight("trunk_w", (width, width), rng), _weight("trunk_b", (width,), rng)]
    nodes = [helper.make_node("Gemm", ["x", "trunk_w", "trunk_b"], ["t"], name="trunk"),
             helper.make_node("Relu", ["t"], ["tr"], name="trunk_relu")]
    outputs = []
    for head in ("a", "b"):
        prev = "tr"
        for d in range(depth):
            w, bias, y = f"{head}{d}_w", f"{head}{d}_b", f"{head}{d}"
            inits += [_weight(w, (width, width), rng), _weight(bias, (width,), rng)]
            nodes += [helper.make_node("Gemm", [prev, w, bias], [y], name=f"{head}_gemm{d}"),
                      helper.make_node("Relu", [y], [y + "_r"], name=f"{head}_relu{d}")]
            prev = y + "_r"
        nodes.append(helper.make_node("Softmax", [prev], [f"out_{head}"], axis=-1,
                                      name=f"{head}_softmax"))
        outputs.append(helper.make_tensor_value_info(f"out_{head}", TensorProto.FLOAT,
                                                     [batch, width]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])
    return _model(nodes, "two_heads", [x], outputs, inits)


def inception(batch: int = 1, channels: int = 32, size: int = 16, seed: int = 0
              ) -> onnx.ModelProto:
    """A stem conv, four Inception branches joined by a Concat, a 1x1 conv and a pool."""
    rng = np.random.default_rng(seed)
    c = channels
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def conv(name: str, x: str, cin: int, cout: int, k: int) -> str:
        inits.extend([_weight(f"{name}_w", (cout, cin, k, k), rng),
                      _weight(f"{name}_b", (cout,), rng)])
        nodes.extend([helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [name],
                                       name=name, pads=[k // 2] * 4),
                      helper.make_node("Relu", [name], [name + "_r"], name=name + "_relu")])
        return name + "_r"

    stem = conv("stem", "x", 3, c, 3)
    b1 = conv("b1", stem, c, c, 1)
    b2 = conv("b2b", conv("b2a", stem, c, c, 1), c, c, 3)
    b3 = conv("b3b", conv("b3a", stem, c, c // 2, 1), c // 2, c, 5)
    nodes.append(helper.make_node("MaxPool", [stem], ["p4"], name="b4_pool",
                                  kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
    b4 = conv("b4", "p4", c, c, 1)
    nodes.append(helper.make_node("Concat", [b1, b2, b3, b4], ["cat"], name="concat", axis=1))
    head = conv("head", "cat", 4 * c, c, 1)
    nodes.append(helper.make_node("GlobalAveragePool", [head], ["y"], name="gap"))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, size, size])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, c, 1, 1])
    return _model(nodes, "inception", [x], [y], inits)


CASES: dict[str, Callable[[], onnx.ModelProto]] = {
    "two_heads_b1": lambda: two_heads(1),
    "two_heads_b32": lambda: two_heads(32),
    "narrow_heads_b1": lambda: two_heads(1, width=128),
    "inception_16_b1": lambda: inception(1, 32, 16),
    "inception_28_b1": lambda: inception(1, 32, 28),
}


def feeds(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    """Random float32 feeds for every input of ``model`` (static shapes)."""
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]
                                        ).astype(np.float32)
            for v in model.graph.input}


# ---- timing -----------------------------------------------------------------------------
def _load(model: bytes, threads: int, interop: bool) -> Any:
    import keel
    from keel.config import reload_settings

    os.environ["KEEL_INTEROP"] = "on" if interop else "off"
    reload_settings()
    try:
        return keel.load_model(model, backend="cpu", threads=threads, plan_cache=False)
    finally:
        os.environ.pop("KEEL_INTEROP", None)
        reload_settings()


def _time(run: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, threads: int, passes: int, calls: int) -> dict[str, Any]:
    model = CASES[name]()
    data = model.SerializeToString()
    planned, ordered = _load(data, threads, True), _load(data, threads, False)
    f = feeds(model)
    a, b = planned.predict(f), ordered.predict(f)
    same = all(np.array_equal(a[k], b[k]) for k in a)
    at_once = [r.reason for r in planned.plan.regions if r.concurrent]
    ratios, times = [], []
    for _ in range(passes):
        tp = _time(lambda: planned.predict(f), calls)
        to = _time(lambda: ordered.predict(f), calls)
        ratios.append(tp / to)
        times.append((tp, to))
    return {"case": name, "threads": threads, "at_once": at_once, "bitwise_equal": same,
            "ratio_median": statistics.median(ratios),
            "planned_ms": statistics.median(t[0] for t in times) * 1e3,
            "in_order_ms": statistics.median(t[1] for t in times) * 1e3}


def zoo_plans(threads: int) -> list[dict[str, Any]]:
    """What the plan decided for each region of the suite's models, at batch 1 and 32
    (each signature runs once, to be planned)."""
    import keel
    from benchmarks import zoo

    out = []
    for name in zoo.DEFAULT_MODELS:
        model = keel.load_model(zoo.build(name), backend="cpu", threads=threads,
                                plan_cache=False)
        for batch in (1, 32):
            model.predict(zoo.MODELS[name].make_feeds(batch))     # plans this signature
            plan = model.plan
            out.append({"model": name, "batch": batch,
                        "regions": [r.reason for r in plan.regions],
                        "at_once": sum(r.concurrent for r in plan.regions)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=9)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--min-work", type=float, default=None,
                        help="the planner's least multiply-adds per branch (to measure it)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results folder")
    parser.add_argument("--plans", action="store_true",
                        help="print what the suite's models' plans decided; time nothing")
    args = parser.parse_args(argv)
    if args.min_work is not None:
        from keel.backends.cpu import planner

        planner.INTEROP_MIN_BRANCH_WORK = int(args.min_work)
    if args.plans:
        for row in zoo_plans(args.threads):
            print(json.dumps(row))
        return 0
    rows = []
    for name in args.cases.split(","):
        row = measure(name, args.threads, args.passes, args.calls)
        rows.append(row)
        print(f"{name:18s} {args.threads} threads: at once {len(row['at_once'])} region(s), "
              f"{row['planned_ms']:.3f} ms vs {row['in_order_ms']:.3f} ms in order, "
              f"ratio {row['ratio_median']:.2f}, bitwise equal {row['bitwise_equal']}")
    from keel.hardware import probe

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"interop-{stamp}.json"
    from keel.backends.cpu import planner

    path.write_text(json.dumps({"rows": rows, "machine": platform.node(),
                                "min_branch_work": planner.INTEROP_MIN_BRANCH_WORK,
                                "busy_share": planner.INTEROP_BUSY_SHARE,
                                "load_average": os.getloadavg(),
                                "probe": probe().to_dict()}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
