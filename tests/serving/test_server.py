"""The server with the official tritonclient over HTTP and gRPC: answers equal keel's."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

import keel
from keel.serving.server import Server
from keel.testing.models import mlp

from .conftest import (
    BATCH,
    as_served,
    grpc_client,
    http_client,
    infer_grpc,
    infer_http,
    pixels,
    post,
)


@pytest.fixture(scope="module")
def digits(repository: Path) -> keel.Model:
    return keel.load_model(str(repository / "digits.onnx"))


def test_health_and_metadata_over_both_protocols(server: Server) -> None:
    h, g = http_client(server), grpc_client(server)
    assert h.is_server_live() and h.is_server_ready() and h.is_model_ready("digits")
    assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("mlp")
    assert h.get_server_metadata()["name"] == "keel"
    assert "model_repository" in g.get_server_metadata().extensions
    meta = h.get_model_metadata("digits")
    assert meta["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}]
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}]
    gmeta = g.get_model_metadata("mlp")
    assert [t.name for t in gmeta.inputs] == ["x"] and list(gmeta.outputs[0].shape) == [-1, 10]


@pytest.mark.parametrize("rows", [1, 3, BATCH, 2 * BATCH + 3])
def test_answers_equal_keels_prediction(server: Server, digits: keel.Model, rows: int) -> None:
    x = pixels(rows, seed=rows)
    expected = as_served(digits, x)["probabilities"]
    for got in (infer_http(server, x), infer_grpc(server, x),
                infer_http(server, x, binary=False)):
        assert got.dtype == np.float32 and got.shape == (rows, 10)
        assert np.array_equal(got, expected)                      # bitwise
        np.testing.assert_allclose(got, digits.predict({"pixels": x})["probabilities"],
                                   rtol=1e-5, atol=1e-6)


def test_json_tensors_and_outputs_requested_by_name(server: Server, digits: keel.Model) -> None:
    x = pixels(2, seed=5)
    body = {"id": "r1", "inputs": [{"name": "pixels", "shape": [2, 64], "datatype": "FP32",
                                    "data": x.tolist()}],
            "outputs": [{"name": "probabilities"}]}
    status, reply = post(server, "/v2/models/digits/infer", json.dumps(body).encode())
    assert status == 200 and reply["id"] == "r1" and reply["model_version"] == "1"
    (out,) = reply["outputs"]
    assert out["name"] == "probabilities" and out["shape"] == [2, 10]
    got = np.array(out["data"], dtype=np.float32).reshape(2, 10)
    assert np.array_equal(got, as_served(digits, x)["probabilities"])
    req = thttp.InferRequestedOutput("probabilities", binary_data=True)
    inp = thttp.InferInput("pixels", [2, 64], "FP32")
    inp.set_data_from_numpy(x)
    result = http_client(server).infer("digits", [inp], outputs=[req])
    assert np.array_equal(result.as_numpy("probabilities"), got)
    ginp = tgrpc.InferInput("pixels", [2, 64], "FP32")
    ginp.set_data_from_numpy(x)
    reply = grpc_client(server).infer("digits", [ginp], request_id="g1",
                                      outputs=[tgrpc.InferRequestedOutput("probabilities")])
    assert reply.get_response().id == "g1"
    assert np.array_equal(reply.as_numpy("probabilities"), got)


def test_a_requests_answer_does_not_depend_on_other_traffic(server: Server) -> None:
    """Alone, and inside batches with other clients' requests: the same bits."""
    requests = [pixels(1 + i % 3, seed=100 + i) for i in range(24)]
    alone = [infer_grpc(server, x) for x in requests]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        together = list(pool.map(lambda x: infer_http(server, x), requests))
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a, b)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics").read()
    batches = [line for line in metrics.decode().splitlines()
               if line.startswith('keel_batch_rows_count{model="digits"}')]
    assert batches and float(batches[0].split()[-1]) > 0


def test_repository_index_load_and_unload(server: Server) -> None:
    h, g = http_client(server), grpc_client(server)
    names = {m["name"]: m["state"] for m in h.get_model_repository_index()}
    assert names == {"digits": "READY", "mlp": "READY"}
    g.unload_model("mlp")
    assert not h.is_model_ready("mlp")
    with pytest.raises(Exception, match="unknown model 'mlp'"):
        infer_grpc(server, pixels(1), model="mlp")
    assert {m.name: m.state for m in g.get_model_repository_index().models}["mlp"] == \
        "UNAVAILABLE"
    h.load_model("mlp")
    assert g.is_model_ready("mlp")
    assert infer_http(server, pixels(2), model="mlp").shape == (2, 10)


def test_a_new_version_swaps_in_without_dropping_requests(server: Server,
                                                          repository: Path) -> None:
    old = keel.load_model(str(repository / "mlp" / "1" / "model.onnx"))
    x = pixels(3, seed=9)
    before = as_served(old, x)["probs"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(infer_http, server, x, "mlp") for _ in range(40)]
        (repository / "mlp" / "2").mkdir()
        onnx.save(mlp(seed=2), str(repository / "mlp" / "2" / "model.onnx"))
        grpc_client(server).load_model("mlp")
        answers = [f.result() for f in running]       # none failed
    new = keel.load_model(str(repository / "mlp" / "2" / "model.onnx"))
    after = as_served(new, x)["probs"]
    assert not np.array_equal(before, after)
    assert all(np.array_equal(a, before) or np.array_equal(a, after) for a in answers)
    assert http_client(server).get_model_metadata("mlp")["versions"] == ["2"]
    assert np.array_equal(infer_grpc(server, x, model="mlp"), after)


def _two_outputs() -> Any:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4])
            for n in ("pos", "neg")]
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["pos"]),
                               helper.make_node("Neg", ["x"], ["neg"])], "two", [x], outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_only_the_outputs_asked_for_come_back(tmp_path: Path) -> None:
    from .conftest import start

    onnx.save(_two_outputs(), str(tmp_path / "two.onnx"))
    srv = start(tmp_path)
    try:
        x = np.array([[1, -2, 3, -4]], np.float32)
        inp = thttp.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        got = http_client(srv).infer("two", [inp], outputs=[thttp.InferRequestedOutput("neg")])
        assert [o["name"] for o in got.get_response()["outputs"]] == ["neg"]
        assert np.array_equal(got.as_numpy("neg"), -x)
        ginp = tgrpc.InferInput("x", [1, 4], "FP32")
        ginp.set_data_from_numpy(x)
        reply = grpc_client(srv).infer("two", [ginp],
                                       outputs=[tgrpc.InferRequestedOutput("pos")])
        assert [o.name for o in reply.get_response().outputs] == ["pos"]
        assert np.array_equal(reply.as_numpy("pos"), np.maximum(x, 0))
        both = grpc_client(srv).infer("two", [ginp]).get_response().outputs
        assert sorted(o.name for o in both) == ["neg", "pos"]
    finally:
        srv.stop()
