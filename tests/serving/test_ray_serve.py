"""keel on a local Ray Serve: the Open Inference Protocol's REST infer request, batched by
Serve, answers each row as one process does inside an execution batch."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import ray
from ray import serve

import keel
from keel.integrations.ray import serve_app

from .conftest import BATCH, DIGITS, free_port, in_fixed_batch, pixels, same_answer


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(serve_app(str(DIGITS), max_batch_size=BATCH, batch_wait_timeout_s=0.02),
              name="digits", route_prefix="/digits")
    yield f"http://127.0.0.1:{port}/digits"
    serve.shutdown()
    ray.shutdown()


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _infer(url: str, x: np.ndarray) -> np.ndarray:
    status, reply = _post(url, {"inputs": [{"name": "pixels", "shape": list(x.shape),
                                            "datatype": "FP32", "data": x.ravel().tolist()}]})
    assert status == 200, reply
    out = reply["outputs"][0]
    assert out["name"] == "probabilities" and out["datatype"] == "FP32"
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def test_concurrent_requests_batched_by_serve_answer_like_one_process(url: str) -> None:
    x = pixels(40, seed=3)
    expected = in_fixed_batch(keel.load_model(str(DIGITS)), x, BATCH)["probabilities"]
    sizes = [1, 2, 3, 1, 4, 2, 1, 3, 2, 1, 5, 1, 2, 3, 1, 2, 3, 3]     # 40 rows
    starts = np.cumsum([0, *sizes[:-1]])
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda s: _infer(url, x[s[0]:s[0] + s[1]]),
                                zip(starts, sizes, strict=True)))
    for start, n, got in zip(starts, sizes, answers, strict=True):
        assert got.shape == (n, 10)
        # A row's answer does not depend on the requests Serve batched it with.
        assert same_answer(got, in_fixed_batch(keel.load_model(str(DIGITS)),
                                               x[start:start + n], BATCH)["probabilities"])
        assert same_answer(got, expected[start:start + n])


def test_bad_requests_get_the_protocols_error_and_serving_goes_on(url: str) -> None:
    status, reply = _post(url, {"inputs": [{"name": "nope", "shape": [1, 64],
                                            "datatype": "FP32", "data": [0.0] * 64}]})
    assert status == 400 and "unknown input 'nope'" in reply["error"]
    status, reply = _post(url, {"inputs": [{"name": "pixels", "shape": [1, 64],
                                            "datatype": "FP32", "data": [0.0] * 3}]})
    assert status == 400 and "error" in reply
    status, reply = _post(url, {"inputs": []})
    assert status == 400 and "inputs" in reply["error"]
    x = pixels(2, seed=9)
    assert same_answer(_infer(url, x), in_fixed_batch(keel.load_model(str(DIGITS)), x,
                                                      BATCH)["probabilities"])
