"""Backends written to seed 004's small contract, and the remote backend on ``keel serve``.

Seed 004's contract is three methods — ``execute(operation, inputs)``,
``is_available()`` and ``get_capabilities()`` — and no array namespace.
:func:`as_backend` turns such an object into a keel :class:`Backend` whose
kernels hand the contract NumPy arrays (``get_capabilities()["ops"]`` names the
ops it runs), so it registers like any other::

    keel.register_backend("mine", lambda: as_backend(MyBackend(), "mine"))
    keel.Runtime(backend="mine").run_op("add", [a, b])

:class:`RemoteBackend` keeps the same contract for whole models on a
``keel serve`` instance (the Open Inference Protocol over REST, standard
library only): ``execute(model_name, {input: array})`` returns the outputs,
availability comes from the server's readiness and capabilities from its
metadata. ``keel.load_model(path, backend="remote", remote=URL)`` returns a
:class:`RemoteModel`: the model served under ``path``'s stem, with ``inputs``,
``outputs``, ``predict`` and ``run`` like a local model. A network failure is
a :class:`RemoteError` that says what was asked and why it failed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from keel.backends.base import Availability, Backend, DeviceKind, KernelContext, KernelTable
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, KeelError
from keel.inference_protocol import (
    DATATYPES,
    Limits,
    array_to_bytes,
    bytes_to_array,
    datatype_of_array,
    decode_json_data,
)
from keel.ops.registry import to_op
from keel.ops.types import TensorInfo

__all__ = ["ExecuteContract", "RemoteBackend", "RemoteError", "RemoteModel", "as_backend",
           "load_remote"]


class RemoteError(KeelError):
    """A remote server could not be reached or refused a request; says which and why."""

    code = "REMOTE"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@runtime_checkable
class ExecuteContract(Protocol):
    """Seed 004's backend contract."""

    def execute(self, operation: str, inputs: Any) -> Any: ...

    def is_available(self) -> bool: ...

    def get_capabilities(self) -> dict[str, Any]: ...


def as_backend(impl: ExecuteContract, name: str) -> Backend:
    """A keel backend named ``name`` running the ops ``impl.get_capabilities()["ops"]``
    names through ``impl.execute(op, [numpy arrays])`` (a list of outputs, or one)."""
    if not isinstance(impl, ExecuteContract):
        raise InvalidArgumentError(f"{type(impl).__name__} does not implement execute, "
                                   f"is_available and get_capabilities")
    cls = type(f"ContractBackend_{name}", (_ContractBackend,),
               {"name": name, "device": DeviceKind.CPU})
    return cls(impl)


class _ContractBackend(Backend):
    """Host NumPy arrays in and out; every decision is the contract's."""

    def __init__(self, impl: ExecuteContract) -> None:
        super().__init__()
        self.impl = impl

    def _check_available(self) -> Availability:
        ok = bool(self.impl.is_available())
        return Availability(ok, f"{type(self.impl).__name__}.is_available() said {ok}")

    def _kernels(self) -> KernelTable:
        table = KernelTable(self.name)
        for op_name in self.impl.get_capabilities().get("ops", ()):
            op = to_op(op_name)
            table.kernel(op)(self._kernel_for(op.value))
        return table

    def _kernel_for(self, op: str) -> Any:
        impl = self.impl

        def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
                   out: Sequence[Any] | None) -> list[Any]:
            result = impl.execute(op, [None if a is None else np.asarray(a) for a in inputs])
            results = list(result) if isinstance(result, list | tuple) else [result]
            return [np.asarray(r) for r in results]

        return kernel

    @property
    def xp(self) -> Any:
        return np

    def _capability_details(self) -> dict[str, Any]:
        caps = self.impl.get_capabilities()
        notes = tuple(f"{k}: {v}" for k, v in sorted(caps.items()) if k != "ops")
        return {"notes": notes}


class RemoteBackend:
    """Models run on a ``keel serve`` instance at ``url`` (seed 004's remote example)."""

    name = "remote"

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 60.0) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise InvalidArgumentError(f"remote must be an http:// or https:// URL of a keel "
                                       f"serve instance, got {url!r}")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    # ---- seed 004's contract ------------------------------------------------
    def execute(self, operation: str, inputs: Mapping[str, Any],
                outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run model ``operation`` on ``inputs``; its outputs (those named, if given)."""
        tensors, blobs = [], []
        for name, value in inputs.items():
            array = np.asarray(value)
            blob = array_to_bytes(array)
            tensors.append({"name": name, "shape": list(array.shape),
                            "datatype": datatype_of_array(array),
                            "parameters": {"binary_data_size": len(blob)}})
            blobs.append(blob)
        request: dict[str, Any] = {"inputs": tensors, "parameters": {"binary_data_output": True}}
        if outputs:
            request["outputs"] = [{"name": n} for n in outputs]
        head = json.dumps(request).encode()
        body, headers = self._call(f"/v2/models/{urllib.parse.quote(operation)}/infer",
                                   head + b"".join(blobs),
                                   {"Inference-Header-Content-Length": str(len(head)),
                                    "Content-Type": "application/octet-stream"})
        return _decode_reply(body, headers.get("inference-header-content-length"))

    def is_available(self) -> bool:
        try:
            self._call("/v2/health/ready")
        except RemoteError:
            return False
        return True

    def get_capabilities(self) -> dict[str, Any]:
        """The server's metadata and, per model served, its metadata."""
        server = self._json("/v2")
        index = self._json("/v2/repository/index", b"{}")
        models = {m["name"]: self.model_metadata(m["name"]) for m in index
                  if m.get("state") == "READY"}
        return {"server": server, "models": models, "url": self.url}

    def model_metadata(self, name: str) -> dict[str, Any]:
        meta: dict[str, Any] = self._json(f"/v2/models/{urllib.parse.quote(name)}")
        return meta

    # ---- transport -----------------------------------------------------------
    def _json(self, path: str, body: bytes | None = None) -> Any:
        data, _ = self._call(path, body)
        try:
            return json.loads(data)
        except ValueError:
            raise RemoteError(f"{self.url}{path} answered with something other than "
                              f"JSON") from None

    def _call(self, path: str, body: bytes | None = None,
              headers: Mapping[str, str] | None = None) -> tuple[bytes, Mapping[str, str]]:
        all_headers = dict(headers or {})
        if self.token is not None:
            all_headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=body, headers=all_headers,
                                     method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.read(), {k.lower(): v for k, v in resp.headers.items()}
        except urllib.error.HTTPError as err:
            raise RemoteError(f"{self.url}{path}: the server answered {err.code}: "
                              f"{_error_text(err.read())}", err.code) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise RemoteError(f"{self.url}{path}: cannot reach the server: {reason}") from None

    def __repr__(self) -> str:
        return f"<RemoteBackend {self.url}>"


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", body[:200]))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


def _decode_reply(body: bytes, header_length: str | None) -> dict[str, np.ndarray]:
    try:
        return _outputs(body, header_length)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON, fields, sizes
        raise RemoteError(f"the server's reply is not an inference response: "
                          f"{type(exc).__name__}: {exc}") from None


def _outputs(body: bytes, header_length: str | None) -> dict[str, np.ndarray]:
    split = int(header_length) if header_length else len(body)
    reply = json.loads(body[:split])
    limits = Limits(max_body_bytes=1 << 62, max_tensor_elements=1 << 62)
    out: dict[str, np.ndarray] = {}
    pos = split
    for tensor in reply.get("outputs", []):
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is None:
            out[tensor["name"]] = decode_json_data(tensor["name"], tensor["datatype"],
                                                   tensor["shape"], tensor["data"], limits)
        else:
            out[tensor["name"]] = bytes_to_array(tensor["name"], tensor["datatype"],
                                                 tensor["shape"], body[pos:pos + size], limits)
            pos += size
    return out


class RemoteModel:
    """A model served by ``keel serve``, used like a local :class:`keel.Model`."""

    def __init__(self, backend: RemoteBackend, name: str) -> None:
        self.backend = backend
        self.name = name
        meta = backend.model_metadata(name)
        def infos(tensors: list[dict[str, Any]]) -> list[Any]:
            return [TensorInfo(t["name"], tuple(d if d >= 0 else None for d in t["shape"]),
                               DType.from_numpy(DATATYPES[t["datatype"]])) for t in tensors]

        self.inputs = infos(meta["inputs"])
        self.outputs = infos(meta["outputs"])
        self.version = meta["versions"][0] if meta.get("versions") else ""

    def predict(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        if not isinstance(feeds, Mapping):
            raise InvalidArgumentError(
                f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
        return self.backend.execute(self.name, feeds)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        names = list(output_names) if output_names else [t.name for t in self.outputs]
        result = self.backend.execute(self.name, input_feed, names)
        return [result[n] for n in names]

    def __repr__(self) -> str:
        return f"<keel.RemoteModel {self.name!r} v{self.version} at {self.backend.url}>"


def load_remote(src: Any, remote: str | None, *, token: str | None = None,
                timeout_s: float = 60.0) -> RemoteModel:
    """The model ``src`` names (a path's stem, or a model name) on the server ``remote``."""
    if not remote:
        raise InvalidArgumentError("backend='remote' needs remote='http://host:port', the "
                                   "address of a keel serve instance")
    if not isinstance(src, str | Path):
        raise InvalidArgumentError(f"backend='remote' takes a model path or name, got "
                                   f"{type(src).__name__}")
    path = Path(src)
    name = path.stem if path.suffix in (".onnx", ".keel") else path.name
    backend = RemoteBackend(remote, token=token, timeout_s=timeout_s)
    return RemoteModel(backend, name)
