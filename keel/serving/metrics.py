"""Prometheus metrics of one server, per model: requests, failures, latency, queue time,
batch sizes. Each server has its own registry (several can run in one process)."""

from __future__ import annotations

__all__ = ["Metrics"]

_LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("keel_requests", "Inference requests answered",
                                ["model", "protocol"], registry=r)
        self.failures = Counter("keel_request_failures", "Requests refused or failed",
                                ["model", "protocol", "reason"], registry=r)
        self.latency = Histogram("keel_request_seconds", "Inference request latency",
                                 ["model", "protocol"], buckets=_LATENCY, registry=r)
        self.queue = Histogram("keel_queue_seconds", "Time a request waited for its batch",
                               ["model"], buckets=_LATENCY, registry=r)
        self.batch = Histogram("keel_batch_rows", "Real rows per executed batch", ["model"],
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.padding = Counter("keel_batch_padding_rows", "Rows of padding executed",
                               ["model"], registry=r)
        self.runs = Histogram("keel_batch_executions",
                              "Executions the planner split each batch into", ["model"],
                              buckets=(1, 2, 4, 8, 16), registry=r)

    def observe_request(self, model: str, protocol: str, seconds: float) -> None:
        self.requests.labels(model, protocol).inc()
        self.latency.labels(model, protocol).observe(seconds)

    def count_failure(self, model: str, protocol: str, reason: str) -> None:
        self.failures.labels(model, protocol, reason).inc()

    def observe_batch(self, model: str, rows: int, padded: int, waited: list[float],
                      runs: int = 1) -> None:
        self.batch.labels(model).observe(rows)
        self.runs.labels(model).observe(runs)
        self.padding.labels(model).inc(padded)
        for seconds in waited:
            self.queue.labels(model).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def __repr__(self) -> str:
        return f"<Metrics {len(list(self.registry.collect()))} families>"
