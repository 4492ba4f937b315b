"""A real server on 127.0.0.1 (ephemeral ports) over a small model repository."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from keel.inference_protocol import Limits
from keel.serving.repository import ModelOptions
from keel.serving.server import Server, ServerConfig
from keel.testing.models import mlp

BATCH = 8
DIGITS = Path(__file__).resolve().parents[2] / "keel" / "data" / "digits_mlp.onnx"


def make_repository(root: Path) -> Path:
    """``digits.onnx`` and ``mlp/1/model.onnx``."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(DIGITS, root / "digits.onnx")
    (root / "mlp" / "1").mkdir(parents=True)
    onnx.save(mlp(seed=1), str(root / "mlp" / "1" / "model.onnx"))
    return root


def start(root: Path, options: ModelOptions | None = None, **config: Any) -> Server:
    options = options or ModelOptions(max_batch_size=BATCH, max_queue_delay_s=0.005)
    return Server(ServerConfig(str(root), http_port=0, grpc_port=0, options=options,
                               **config),
                  log=lambda _line: None).start_in_thread()


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Server]:
    srv = start(repository, limits=Limits(max_body_bytes=1 << 20, max_tensor_elements=1 << 16))
    yield srv
    srv.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pixels(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)


def in_fixed_batch(model: object, x: np.ndarray, size: int = BATCH) -> dict[str, np.ndarray]:
    """What keel gives ``x``'s rows inside an execution batch of ``size`` rows."""
    from keel.serving.batching import pad_rows

    name = model.inputs[0].name  # type: ignore[attr-defined]
    parts = []
    for start in range(0, len(x), size):
        chunk = x[start:start + size]
        out = model.predict(pad_rows({name: chunk}, size))  # type: ignore[attr-defined]
        parts.append({k: v[:len(chunk)] for k, v in out.items()})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def as_served(model: object, x: np.ndarray, size: int = BATCH) -> dict[str, np.ndarray]:
    """What the server answers for ``x``'s rows: keel's prediction of exactly those rows
    where the model's plan is batch invariant (the server does not pad then), else their
    prediction inside padded execution batches of ``size`` rows."""
    from keel.serving.batching import batch_invariance

    if batch_invariance(model)[0]:
        name = model.inputs[0].name  # type: ignore[attr-defined]
        return dict(model.predict({name: x}))  # type: ignore[attr-defined]
    return in_fixed_batch(model, x, size)


def same_answer(got: np.ndarray, expected: np.ndarray) -> bool:
    """Whether an answer computed in another process (a server, a Ray actor) equals this
    process's: bit for bit on keel's native kernels, whose results do not depend on the
    thread count; within float32 rounding on the NumPy kernels (``KEEL_NATIVE=off``),
    where OpenBLAS sums in an order that follows the process's BLAS threads."""
    from keel import native

    if native.available():
        return bool(np.array_equal(got, expected))
    return bool(np.allclose(got, expected, rtol=1e-5, atol=1e-7))


class Listening(Protocol):
    """Where a server listens: a :class:`Server` in this process, or one started apart."""

    @property
    def http_port(self) -> int | None: ...

    @property
    def grpc_port(self) -> int | None: ...


def http_client(server: Listening, **kw: Any) -> thttp.InferenceServerClient:
    return thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}", **kw)


def grpc_client(server: Listening) -> tgrpc.InferenceServerClient:
    return tgrpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def infer_http(server: Listening, x: np.ndarray, model: str = "digits", **kw: Any) -> np.ndarray:
    inp = thttp.InferInput("pixels" if model == "digits" else "x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=kw.pop("binary", True))
    result = http_client(server).infer(model, [inp], **kw)
    return result.as_numpy("probabilities" if model == "digits" else "probs")


def infer_grpc(server: Listening, x: np.ndarray, model: str = "digits") -> np.ndarray:
    inp = tgrpc.InferInput("pixels" if model == "digits" else "x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = grpc_client(server).infer(model, [inp])
    return out.as_numpy("probabilities" if model == "digits" else "probs")


def post(server: Listening, path: str, body: bytes, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=body,
                                 headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
