"""A bounded load test: concurrent clients, dynamic batching, every answer checked.

It reports latency and throughput (``-s`` shows them); speed is never asserted.
"""

from __future__ import annotations

from pathlib import Path

import keel
from benchmarks.serve import _in_batch, run_load
from keel.serving.server import Server

from .conftest import BATCH, pixels


def test_concurrent_clients_with_dynamic_batching(server: Server, repository: Path) -> None:
    model = keel.load_model(str(repository / "digits.onnx"))
    inputs = [pixels(1 + i % 2, seed=200 + i) for i in range(32)]
    expected = [_in_batch(model, x, BATCH) for x in inputs]
    assert server.grpc_port is not None
    report = run_load(server.grpc_port, clients=16, requests=400, inputs=inputs,
                      expected=expected, batching=True)
    print("\n" + report.line() + f" ({report.seconds:.2f} s)")
    assert report.failures == 0
    assert report.wrong == 0
