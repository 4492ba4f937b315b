"""Throughput and latency of ``keel serve`` and of keel on Ray Data.

The server runs in this process on 127.0.0.1 (ephemeral ports); clients are
threads using the official ``tritonclient`` (gRPC), each sending its requests
one after another. Every answer is checked bitwise against keel's prediction of
the same rows (padded to the batch limit where the server pads, docs/serving.md).
The table covers 1, 8 and 32 concurrent clients, with dynamic batching on
(batch limit 8, queue delay 2 ms) and off (each request runs alone). Then keel scores a Ray dataset.

    PYTHONPATH=. python benchmarks/serve.py [--requests 400] [--ray-rows 100000]

Results go to ``benchmarks/results/serve-<UTC time>.json`` and print as a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import keel

DIGITS = Path(__file__).resolve().parents[1] / "keel" / "data" / "digits_mlp.onnx"
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class LoadReport:
    clients: int
    batching: bool
    requests: int
    failures: int
    wrong: int
    seconds: float
    throughput_rps: float
    p50_ms: float
    p99_ms: float

    def line(self) -> str:
        mode = "dynamic batching" if self.batching else "no batching"
        return (f"{self.clients:>3} clients, {mode:<16}: {self.throughput_rps:8.1f} req/s, "
                f"p50 {self.p50_ms:7.2f} ms, p99 {self.p99_ms:7.2f} ms, "
                f"{self.failures} failed, {self.wrong} wrong")


def run_load(grpc_port: int, clients: int, requests: int, inputs: list[np.ndarray],
             expected: list[np.ndarray], batching: bool, model: str = "digits",
             input_name: str = "pixels", output_name: str = "probabilities") -> LoadReport:
    """``requests`` requests from ``clients`` threads, each with its own gRPC client."""
    import tritonclient.grpc as tgrpc

    def client(index: int) -> tuple[list[float], int, int]:
        conn = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        latencies, failures, wrong = [], 0, 0
        for n in range(index, requests, clients):
            x = inputs[n % len(inputs)]
            inp = tgrpc.InferInput(input_name, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            start = time.perf_counter()
            try:
                got = conn.infer(model, [inp]).as_numpy(output_name)
            except Exception:
                failures += 1
                continue
            latencies.append(time.perf_counter() - start)
            wrong += not np.array_equal(got, expected[n % len(inputs)])
        conn.close()
        return latencies, failures, wrong

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        parts = list(pool.map(client, range(clients)))
    seconds = time.perf_counter() - start
    latencies = sorted(t for p in parts for t in p[0])
    ms = [t * 1000 for t in latencies] or [float("nan")]
    return LoadReport(clients, batching, requests, sum(p[1] for p in parts),
                      sum(p[2] for p in parts), seconds, len(latencies) / seconds,
                      statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))])


def serve_table(requests: int, client_counts: tuple[int, ...] = (1, 8, 32),
                rows: int = 1) -> list[LoadReport]:
    import keel
    from keel.serving.repository import ModelOptions
    from keel.serving.server import Server, ServerConfig

    folder = Path(tempfile.mkdtemp(prefix="keel-serve-bench-"))
    shutil.copy(DIGITS, folder / "digits.onnx")
    model = keel.load_model(str(folder / "digits.onnx"))
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((rows, 64)).astype(np.float32) for _ in range(64)]
    reports = []
    try:
        for batching in (True, False):
            size = 8 if batching else 1
            expected = [_in_batch(model, x, size) for x in inputs]
            server = Server(ServerConfig(str(folder), http_port=0, grpc_port=0,
                                         options=ModelOptions(max_batch_size=size,
                                                              max_queue_delay_s=0.002)),
                            log=lambda _line: None).start_in_thread()
            try:
                assert server.grpc_port is not None
                for clients in client_counts:
                    report = run_load(server.grpc_port, clients, requests, inputs, expected,
                                      batching)
                    print(report.line(), flush=True)
                    reports.append(report)
            finally:
                server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return reports


def _in_batch(model: Any, x: np.ndarray, size: int) -> np.ndarray:
    """What the server answers for ``x``: keel's prediction of ``x`` alone where the plan is
    batch invariant (or there is no batching), else of ``x`` padded to ``size`` rows."""
    from keel.serving.batching import batch_invariance, pad_rows

    if size == 1 or batch_invariance(model)[0]:
        return np.asarray(model.predict({"pixels": x})["probabilities"])
    return np.asarray(model.predict(pad_rows({"pixels": x}, size))["probabilities"][:len(x)])


def ray_throughput(rows: int) -> dict[str, float]:
    import ray

    from keel.integrations.ray import KeelPredictor

    x = np.random.default_rng(1).standard_normal((rows, 64)).astype(np.float32)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ds = ray.data.from_numpy(np.array_split(x, 16)).map_batches(
            KeelPredictor, fn_constructor_kwargs={"model": str(DIGITS),
                                                  "inputs": {"pixels": "data"}},
            batch_size=1024, concurrency=2, batch_format="numpy")
        start = time.perf_counter()
        count = sum(len(b["probabilities"]) for b in ds.iter_batches(batch_size=None))
        seconds = time.perf_counter() - start
    finally:
        ray.shutdown()
    return {"rows": count, "seconds": seconds, "rows_per_s": count / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--ray-rows", type=int, default=100_000)
    args = parser.parse_args()
    reports = serve_table(args.requests)
    ray_result = ray_throughput(args.ray_rows) if args.ray_rows else None
    if ray_result:
        print(f"Ray Data, 2 actors: {ray_result['rows_per_s']:.0f} rows/s "
              f"({ray_result['rows']} rows in {ray_result['seconds']:.2f} s)")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"serve-{stamp}.json"
    out.write_text(json.dumps({
        "machine": keel.probe().to_dict(), "load_average": os.getloadavg(),
        "serve": [asdict(r) for r in reports], "ray": ray_result}, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
