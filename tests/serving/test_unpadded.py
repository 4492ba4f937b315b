"""Dynamic batching without padding: where the model's plan is batch invariant the server
runs a batch's real rows only, and each answer is bitwise keel's prediction of the request
alone; where it is not, batches run padded and the server says why."""

from __future__ import annotations

import concurrent.futures
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.http as thttp

import keel
from keel import config
from keel.backends.cpu import planner
from keel.errors import InvalidArgumentError
from keel.integrations.ray import KeelPredictor
from keel.serving.batching import batch_invariance, check_invariance
from keel.serving.repository import ModelOptions, load_served
from keel.serving.server import Server
from keel.testing.models import mlp

from .conftest import BATCH, DIGITS, in_fixed_batch, infer_grpc, pixels, start


@pytest.fixture(scope="module")
def slow_queue(repository: Path) -> Iterator[Server]:
    """A server whose batches wait long enough for concurrent requests to meet."""
    srv = start(repository, options=ModelOptions(max_batch_size=BATCH, max_queue_delay_s=0.3))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def digits(repository: Path) -> keel.Model:
    return keel.load_model(str(repository / "digits.onnx"))


def _metric(server: Server, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics").read()
    prefix = f'{name}{{model="digits"}}'
    return sum(float(line.split()[-1]) for line in text.decode().splitlines()
               if line.startswith(prefix))


def _expected(model: keel.Model, x: np.ndarray) -> np.ndarray:
    if batch_invariance(model)[0]:
        return model.predict({"pixels": x})["probabilities"]
    return in_fixed_batch(model, x)["probabilities"]


def test_requests_batched_together_get_their_answers_alone(slow_queue: Server,
                                                           digits: keel.Model) -> None:
    invariant, why = batch_invariance(digits)
    meta = thttp.InferenceServerClient(f"127.0.0.1:{slow_queue.http_port}"
                                       ).get_model_metadata("digits")
    assert meta["parameters"]["batching"] == ("exact" if invariant else "padded")
    assert why in meta["parameters"]["batching_reason"]
    requests = [pixels(1 + i % 2, seed=300 + i) for i in range(5)]      # 7 rows: one batch
    alone = [infer_grpc(slow_queue, x) for x in requests]
    batches, padding = _metric(slow_queue, "keel_batch_rows_count"), \
        _metric(slow_queue, "keel_batch_padding_rows_total")
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda x: infer_grpc(slow_queue, x), requests))
    ran = _metric(slow_queue, "keel_batch_rows_count") - batches
    padded = _metric(slow_queue, "keel_batch_padding_rows_total") - padding
    assert ran < len(requests)                                    # some ran together
    rows = sum(len(x) for x in requests)
    assert padded == (0 if invariant else ran * BATCH - rows)
    for x, a, b in zip(requests, alone, together, strict=True):
        assert np.array_equal(a, b)                               # bitwise, alone or not
        assert np.array_equal(b, _expected(digits, x))


def test_a_request_larger_than_the_batch_limit(slow_queue: Server, digits: keel.Model) -> None:
    """Unpadded, it runs whole and the planner splits it; padded, in limit-sized parts."""
    x = pixels(2 * BATCH + 3, seed=7)
    batches = _metric(slow_queue, "keel_batch_rows_count")
    got = infer_grpc(slow_queue, x)
    ran = _metric(slow_queue, "keel_batch_rows_count") - batches
    assert ran == (1 if batch_invariance(digits)[0] else 3)
    assert np.array_equal(got, _expected(digits, x))


def test_batch_invariance_off_pads_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_BATCH_INVARIANT", "off")
    config.reload_settings()
    try:
        served = load_served("digits", "1", DIGITS, ModelOptions(max_batch_size=4))
    finally:
        monkeypatch.delenv("KEEL_BATCH_INVARIANT")
        config.reload_settings()
    assert served.batching == "padded" and served.padded
    assert "KEEL_BATCH_INVARIANT is off" in served.plan_summary()


def test_a_tuning_cache_pads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "machine.json").write_text("{}")
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    config.reload_settings()
    try:
        invariant, why = batch_invariance(keel.load_model(str(DIGITS), backend="cpu"))
    finally:
        monkeypatch.undo()
        config.reload_settings()
    assert not invariant
    if planner.batch_invariant():         # else the native GEMM's absence already says no
        assert "tuning cache" in why


def test_the_reference_backend_pads() -> None:
    served = load_served("digits", "1", DIGITS, ModelOptions(backend="reference"))
    assert served.batching == "padded"
    assert "only the cpu backend promises batch invariance" in served.batch_reason


def test_check_invariance_finds_a_batch_dependent_run() -> None:
    x = pixels(BATCH, seed=1)
    centred = check_invariance(lambda f: {"y": f["x"] - f["x"].mean(axis=0)}, {"x": x})
    assert "output 'y' of rows 7..7 run as a batch of 1 differs" in centred
    assert check_invariance(lambda f: {"y": f["x"] * 2}, {"x": x}) == ""


def test_the_ray_predictor_pads_only_where_the_plan_is_not_batch_invariant() -> None:
    predictor = KeelPredictor(str(DIGITS), execution_batch=BATCH)
    invariant, why = batch_invariance(predictor.model)
    assert predictor.execution_batch == (None if invariant else BATCH)
    assert predictor.padding_reason == ("" if invariant else why)
    x = pixels(BATCH + 3, seed=9)
    got = predictor({"pixels": x})["probabilities"]
    assert np.array_equal(got, _expected(predictor.model, x))


def test_an_unknown_hint_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="--hint 'fast' is not allowed; use one of"):
        ModelOptions(hint="fast")
    assert ModelOptions(hint=" Latency ").hint == "latency"


def test_a_model_with_a_fixed_batch_runs_requests_alone(tmp_path: Path) -> None:
    model = mlp(seed=2)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4      # batch fixed at 4
    onnx.save(model, str(tmp_path / "fixed.onnx"))
    served = load_served("fixed", "1", tmp_path / "fixed.onnx", ModelOptions())
    assert served.batching == "alone" and served.batch_size is None
    assert "input 'x' has no free first dimension" in served.plan_summary()
    assert served.metadata()["parameters"]["batching"] == "alone"
