"""The remote backend runs models on a real ``keel serve``; seed 004's contract is enough
to register a backend with no array namespace."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import keel
from keel.backends.registry import BackendRegistry
from keel.backends.remote import RemoteBackend, RemoteError, as_backend
from keel.serving.server import Server

from .conftest import as_served, pixels


def test_load_model_with_the_remote_backend(server: Server, repository: Path) -> None:
    url = f"http://127.0.0.1:{server.http_port}"
    local = keel.load_model(str(repository / "digits.onnx"))
    remote = keel.load_model(str(repository / "digits.onnx"), backend="remote", remote=url)
    assert [(t.name, t.dtype) for t in remote.inputs] == [(t.name, t.dtype) for t in local.inputs]
    assert remote.inputs[0].shape == (None, 64)
    x = pixels(5, seed=11)
    got = remote.predict({"pixels": x})
    assert np.array_equal(got["probabilities"], as_served(local, x)["probabilities"])
    (only,) = remote.run(["probabilities"], {"pixels": x})
    assert np.array_equal(only, got["probabilities"])


def test_set_backend_makes_remote_the_default(server: Server, repository: Path) -> None:
    url = f"http://127.0.0.1:{server.http_port}"
    keel.set_backend("remote", remote=url)
    try:
        model = keel.load_model(str(repository / "digits.onnx"))
        assert "RemoteModel" in repr(model)
    finally:
        keel.set_backend("auto")
    assert "RemoteModel" not in repr(keel.load_model(str(repository / "digits.onnx")))
    with pytest.raises(keel.InvalidArgumentError, match="unknown backend 'tpu9'"):
        keel.set_backend("tpu9")
    with pytest.raises(keel.InvalidArgumentError, match="needs remote="):
        keel.set_backend("remote")


def test_availability_and_capabilities_come_from_the_server(server: Server) -> None:
    backend = RemoteBackend(f"http://127.0.0.1:{server.http_port}")
    assert backend.is_available()
    caps = backend.get_capabilities()
    assert caps["server"]["name"] == "keel"
    assert caps["models"]["digits"]["inputs"][0]["name"] == "pixels"
    out = backend.execute("digits", {"pixels": pixels(1)})
    assert out["probabilities"].shape == (1, 10)


def test_a_network_failure_is_a_typed_error_with_the_reason(repository: Path) -> None:
    with socket.socket() as s:                  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = RemoteBackend(f"http://127.0.0.1:{port}", timeout_s=5)
    assert not backend.is_available()
    with pytest.raises(RemoteError, match="cannot reach the server") as info:
        backend.execute("digits", {"pixels": pixels(1)})
    assert isinstance(info.value, keel.KeelError)
    with pytest.raises(RemoteError, match="cannot reach"):
        keel.load_model(str(repository / "digits.onnx"), backend="remote",
                        remote=f"http://127.0.0.1:{port}")
    with pytest.raises(keel.InvalidArgumentError, match="http:// or https://"):
        RemoteBackend("127.0.0.1:8000")


def test_server_refusals_surface_as_remote_errors(server: Server) -> None:
    backend = RemoteBackend(f"http://127.0.0.1:{server.http_port}")
    with pytest.raises(RemoteError, match="answered 404: unknown model 'nope'"):
        backend.execute("nope", {"x": pixels(1)})
    with pytest.raises(RemoteError, match="is FP32, got FP64"):
        backend.execute("digits", {"pixels": pixels(1).astype(np.float64)})


class HostOnly:
    """Seed 004's contract and nothing else: no array namespace, no kernel table."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def execute(self, operation: str, inputs: Any) -> Any:
        self.calls.append(operation)
        a, b = inputs
        return np.add(a, b) if operation == "add" else np.multiply(a, b)

    def is_available(self) -> bool:
        return True

    def get_capabilities(self) -> dict[str, Any]:
        return {"ops": ["add", "mul"], "where": "this process"}


@pytest.fixture
def contract_registry() -> Iterator[tuple[BackendRegistry, HostOnly]]:
    impl = HostOnly()
    registry = BackendRegistry()
    registry.register("hostonly", lambda: as_backend(impl, "hostonly"))
    yield registry, impl


def test_the_seed_contract_is_enough_to_register_a_backend(
        contract_registry: tuple[BackendRegistry, HostOnly]) -> None:
    registry, impl = contract_registry
    rt = keel.Runtime(backend="hostonly", registry=registry)
    a = rt.allocate(keel.TensorDesc((3,), "float32"))
    b = rt.allocate(keel.TensorDesc((3,), "float32"))
    rt.write(a, np.array([1, 2, 3], np.float32))
    rt.write(b, np.array([10, 20, 30], np.float32))
    (c,) = rt.run_op("add", [a, b])
    (d,) = rt.run_op("mul", [c, b])
    assert rt.read(d).tolist() == [110, 440, 990]
    assert impl.calls == ["add", "mul"]
    caps = registry.get("hostonly").capabilities()
    assert caps.available and set(caps.ops) == {"add", "mul"}
    assert "where: this process" in caps.notes
    with pytest.raises(keel.UnsupportedOperationError):
        rt.run_op("sub", [a, b])


def test_a_backend_without_the_contract_is_refused() -> None:
    with pytest.raises(keel.InvalidArgumentError, match="does not implement execute"):
        as_backend(object(), "nothing")  # type: ignore[arg-type]


def test_local_options_with_the_remote_backend_are_refused_not_dropped() -> None:
    from keel.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="threads, hint cannot apply there"):
        keel.load_model("digits.onnx", backend="remote", remote="http://127.0.0.1:9",
                        threads=2, hint="latency")


def test_a_dtype_the_protocol_cannot_carry_is_a_protocol_error() -> None:
    from keel.dtypes import DType
    from keel.inference_protocol import ProtocolError, datatype_of

    assert datatype_of(DType.FLOAT32) == "FP32"
    with pytest.raises(ProtocolError, match="no datatype for bfloat16"):
        datatype_of(DType.BFLOAT16)
