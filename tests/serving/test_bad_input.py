"""Bad requests get the protocol's error with a clear message; the server keeps serving."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from keel.inference_protocol import Limits
from keel.serving.server import Server

from .conftest import (
    grpc_client,
    http_client,
    infer_grpc,
    infer_http,
    make_repository,
    pixels,
    post,
    start,
)

TOKEN = "s3cret-token"


def _body(**changes: object) -> bytes:
    tensor: dict[str, object] = {"name": "pixels", "shape": [1, 64], "datatype": "FP32",
                                 "data": [0.5] * 64}
    tensor.update(changes)
    return json.dumps({"inputs": [tensor]}).encode()


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/v2/models/digits/infer", b"{not json", 400, "malformed JSON"),
    ("/v2/models/digits/infer", b"[1, 2]", 400, "must be a JSON object"),
    ("/v2/models/digits/infer", b"{}", 400, "non-empty 'inputs'"),
    ("/v2/models/digits/infer", _body(datatype="INT64", data=[1] * 64), 400,
     "input 'pixels' is FP32, got INT64"),
    ("/v2/models/digits/infer", _body(datatype="FP99"), 400, "unknown datatype 'FP99'"),
    ("/v2/models/digits/infer", _body(shape=[1, 32], data=[0.5] * 32), 400,
     "has shape [1, 32], the model takes [-1, 64]"),
    ("/v2/models/digits/infer", _body(shape=[1, 65]), 400, "shape needs 65"),
    ("/v2/models/digits/infer", _body(data=["a"] * 64), 400, "FP32 data must be numbers"),
    ("/v2/models/digits/infer", _body(name="image"), 400, "has no input 'image'"),
    ("/v2/models/nope/infer", _body(), 404, "unknown model 'nope'"),
    ("/v2/models/digits/versions/7/infer", _body(), 404, "has no version '7'"),
    ("/v2/models/digits/infer", _body(shape=[4096, 64], data=[0.5]), 413,
     "more than this server's limit of 65536"),
    ("/v2/repository/models/nope/load", b"", 404, "not in the repository"),
])
def test_bad_request_gets_the_protocols_error(limited: Server, path: str, body: bytes,
                                              status: int, message: str) -> None:
    got, reply = post(limited, path, body, {"Authorization": f"Bearer {TOKEN}"})
    assert got == status
    assert message in reply["error"]
    assert infer_http(limited, pixels(1), headers=_auth()).shape == (1, 10)   # still serving


def test_unknown_output_and_binary_size_mismatch(limited: Server) -> None:
    inp = thttp.InferInput("pixels", [1, 64], "FP32")
    inp.set_data_from_numpy(pixels(1))
    with pytest.raises(InferenceServerException, match="has no output 'logits'"):
        http_client(limited).infer("digits", [inp], headers=_auth(),
                                   outputs=[thttp.InferRequestedOutput("logits")])
    head = json.dumps({"inputs": [{"name": "pixels", "shape": [1, 64], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 256}}]}).encode()
    status, reply = post(limited, "/v2/models/digits/infer", head + b"\0" * 100,
                         {"Inference-Header-Content-Length": str(len(head)), **_auth()})
    assert status == 400 and "runs past" in reply["error"]


def test_body_over_the_limit_is_refused(limited: Server) -> None:
    status, reply = post(limited, "/v2/models/digits/infer", b" " * (1 << 20 + 1), _auth())
    assert status == 413 and "limit of 1048576 bytes" in reply["error"]
    big = tgrpc.InferInput("pixels", [5000, 64], "FP32")
    big.set_data_from_numpy(np.zeros((5000, 64), np.float32))
    with pytest.raises(InferenceServerException) as info:
        grpc_client(limited).infer("digits", [big], headers=_grpc_auth())
    assert "RESOURCE_EXHAUSTED" in str(info.value.status())


def test_grpc_errors_carry_the_message(limited: Server) -> None:
    g = grpc_client(limited)
    wrong = tgrpc.InferInput("pixels", [1, 64], "FP64")
    wrong.set_data_from_numpy(np.zeros((1, 64), np.float64))
    with pytest.raises(InferenceServerException, match="is FP32, got FP64"):
        g.infer("digits", [wrong], headers=_grpc_auth())
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as info:
        g.get_model_metadata("nope", headers=_grpc_auth())
    assert "NOT_FOUND" in str(info.value.status())
    assert infer_grpc_auth(limited).shape == (1, 10)


def infer_grpc_auth(server: Server) -> np.ndarray:
    inp = tgrpc.InferInput("pixels", [1, 64], "FP32")
    inp.set_data_from_numpy(pixels(1))
    result = grpc_client(server).infer("digits", [inp], headers=_grpc_auth())
    return result.as_numpy("probabilities")


def test_missing_or_wrong_token_gets_401_and_runs_nothing(limited: Server) -> None:
    before = _answered(limited)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        status, reply = post(limited, "/v2/models/digits/infer", _body(), headers)
        assert status == 401 and "bearer token" in reply["error"]
    with pytest.raises(InferenceServerException) as info:
        infer_grpc(limited, pixels(1))
    assert "UNAUTHENTICATED" in str(info.value.status())
    with pytest.raises(InferenceServerException):
        http_client(limited).get_model_repository_index()
    assert _answered(limited) == before
    assert http_client(limited).is_server_live()        # health checks stay open


def test_a_request_over_the_time_limit_is_refused(tmp_path: Path) -> None:
    srv = start(make_repository(tmp_path / "r"), limits=Limits(request_timeout_s=1e-6))
    try:
        with pytest.raises(InferenceServerException, match="took longer than"):
            infer_http(srv, pixels(64))
        assert http_client(srv).is_server_ready()
    finally:
        srv.stop()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_failures_are_counted_under_served_names_only(limited: Server) -> None:
    post(limited, "/v2/models/made-up-name/infer", _body(), _auth())
    post(limited, "/v2/models/digits/infer", b"{not json", _auth())
    text = _metrics(limited)
    assert "made-up-name" not in text
    assert 'keel_request_failures_total{model="digits",protocol="http",reason=' \
        '"INVALID_ARGUMENT"}' in text
    assert 'keel_request_failures_total{model="",protocol="http",reason="NOT_FOUND"}' in text


def _grpc_auth() -> dict[str, str]:
    return {"authorization": f"Bearer {TOKEN}"}


def _metrics(server: Server) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/metrics",
                                 headers=_auth())
    return str(urllib.request.urlopen(req).read().decode())


def _answered(server: Server) -> float:
    text = _metrics(server)
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("keel_requests_total"))


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start(make_repository(tmp_path_factory.mktemp("limited")), auth_token=TOKEN,
                limits=Limits(max_body_bytes=1 << 20, max_tensor_elements=1 << 16))
    yield srv
    srv.stop()


def test_a_chunked_body_over_the_limit_is_refused(limited: Server) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", limited.http_port, timeout=30)
    chunks = (b" " * 65536 for _ in range(40))        # 2.5 MiB, no Content-Length
    conn.request("POST", "/v2/models/digits/infer", body=chunks,
                 headers={**_auth(), "Transfer-Encoding": "chunked"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and "limit of 1048576 bytes" in json.loads(resp.read())["error"]
    conn.close()
