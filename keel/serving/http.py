"""The Open Inference Protocol over REST (a Starlette app), JSON and binary tensors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from keel.inference_protocol import (
    ProtocolError,
    array_to_bytes,
    bytes_to_array,
    datatype_of_array,
    decode_json_data,
    json_data,
    parse_json,
)
from keel.serving.repository import run_request

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from keel.serving.server import ServerState

__all__ = ["build_app"]

_HEADER = "inference-header-content-length"
Handler = Callable[["Request"], Awaitable["Response"]]


def build_app(state: ServerState) -> Any:
    """The Starlette application serving ``state``'s repository."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    def route(path: str, handler: Handler, method: str = "GET") -> Route:
        return Route(path, _guarded(state, handler), methods=[method])

    h = _Handlers(state)
    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    routes = [
        route("/v2/health/live", h.live), route("/v2/health/ready", h.ready),
        route("/v2", h.server_metadata), route("/metrics", h.metrics),
        route(model, h.model_metadata), route(versioned, h.model_metadata),
        route(model + "/ready", h.model_ready), route(versioned + "/ready", h.model_ready),
        route(model + "/infer", h.infer, "POST"), route(versioned + "/infer", h.infer, "POST"),
        route("/v2/repository/index", h.index, "POST"),
        route("/v2/repository/models/{name}/load", h.load, "POST"),
        route("/v2/repository/models/{name}/unload", h.unload, "POST"),
    ]
    return Starlette(routes=routes)


def _error(status: int, message: str) -> Response:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status)


def _guarded(state: ServerState, handler: Handler) -> Handler:
    """``handler`` behind the bearer token (health checks stay open) and the protocol's
    error response for every refused request."""

    async def guarded(request: Request) -> Response:
        open_path = request.url.path.startswith("/v2/health/")
        if not open_path and not state.authorized(request.headers.get("authorization")):
            state.count_failure("", "http", "unauthenticated")
            return _error(401, "missing or wrong bearer token")
        try:
            return await handler(request)
        except ProtocolError as exc:
            state.count_failure(request.path_params.get("name", ""), "http", exc.grpc_code)
            return _error(exc.status, exc.message)

    return guarded


class _Handlers:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def live(self, request: Request) -> Response:
        return _json({"live": True})

    async def ready(self, request: Request) -> Response:
        ready = self.state.ready
        return _json({"ready": ready}, 200 if ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        return _json(self.state.server_metadata())

    async def metrics(self, request: Request) -> Response:
        from starlette.responses import Response

        body, content_type = self.state.metrics_text()
        return Response(body, media_type=content_type)

    async def model_metadata(self, request: Request) -> Response:
        p = request.path_params
        return _json(self.state.repo.get(p["name"], p.get("version", "")).metadata())

    async def model_ready(self, request: Request) -> Response:
        p = request.path_params
        self.state.repo.get(p["name"], p.get("version", ""))
        return _json({"name": p["name"], "ready": True})

    async def index(self, request: Request) -> Response:
        body = await self._body(request)
        ready_only = bool(parse_json(body).get("ready")) if body.strip() else False
        entries = [e for e in self.state.repo.index() if not ready_only or e["state"] == "READY"]
        return _json(entries)

    async def load(self, request: Request) -> Response:
        await self.state.repo.load(request.path_params["name"])
        return _json({})

    async def unload(self, request: Request) -> Response:
        await self.state.repo.unload(request.path_params["name"])
        return _json({})

    async def infer(self, request: Request) -> Response:
        started = time.perf_counter()
        name, version = request.path_params["name"], request.path_params.get("version", "")
        body = await self._body(request)
        header, arrays, wanted, binary_out = decode_request(
            body, request.headers.get(_HEADER), self.state.limits)
        served, result = await run_request(self.state.repo, name, version, arrays,
                                           list(wanted) or None,
                                           self.state.limits.request_timeout_s)
        self.state.observe_request(name, "http", time.perf_counter() - started)
        reply: dict[str, Any] = {"model_name": name, "model_version": served.version}
        if "id" in header:
            reply["id"] = header["id"]
        return encode_reply(reply, result, wanted, binary_out)

    async def _body(self, request: Request) -> bytes:
        """The body, or a 413 once it passes the limit. The rest of a body too large is
        read and dropped (for at most the request time limit), so the client, still
        sending, gets the answer rather than a broken pipe."""
        limit = self.state.limits.max_body_bytes
        declared = request.headers.get("content-length")
        chunks, size = [], 0
        stream = request.stream()
        if declared is None or not declared.isdigit() or int(declared) <= limit:
            async for chunk in stream:
                size += len(chunk)
                if size > limit:
                    break
                chunks.append(chunk)
            else:
                return b"".join(chunks)
        chunks.clear()
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            await asyncio.wait_for(_drain(stream), self.state.limits.request_timeout_s)
        raise ProtocolError(f"the request body of {declared or 'more than ' + str(limit)} "
                            f"bytes is larger than this server's limit of {limit} bytes",
                            413, "RESOURCE_EXHAUSTED")


async def _drain(stream: AsyncIterator[bytes]) -> None:
    async for _ in stream:
        pass


def _json(value: Any, status: int = 200) -> Response:
    from starlette.responses import JSONResponse

    return JSONResponse(value, status_code=status)


def decode_request(body: bytes, header_length: str | None, limits: Any
                   ) -> tuple[Mapping[str, Any], dict[str, np.ndarray], dict[str, bool], bool]:
    """The request's JSON, its input arrays, the outputs asked for (name -> binary?) and
    whether outputs not named default to binary."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise ProtocolError(f"Inference-Header-Content-Length {header_length!r} is not a "
                                f"byte count within the body of {len(body)} bytes")
        split = int(header_length)
    else:
        split = len(body)
    header = parse_json(body[:split])
    binary = memoryview(body)[split:]
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("the request needs a non-empty 'inputs' list")
    arrays: dict[str, np.ndarray] = {}
    pos = 0
    for spec in inputs:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError("each input must be an object with a 'name'")
        name = spec["name"]
        if name in arrays:
            raise ProtocolError(f"input {name!r} is given twice")
        params = spec.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is not None:
            if not isinstance(size, int) or size < 0 or pos + size > len(binary):
                raise ProtocolError(f"input {name!r}: binary_data_size {size!r} runs past the "
                                    f"{len(binary)} bytes of binary data")
            arrays[name] = bytes_to_array(name, spec.get("datatype"), spec.get("shape"),
                                          bytes(binary[pos:pos + size]), limits)
            pos += size
        else:
            if "data" not in spec:
                raise ProtocolError(f"input {name!r} has neither 'data' nor binary data")
            arrays[name] = decode_json_data(name, spec.get("datatype"), spec.get("shape"),
                                            spec["data"], limits)
    if pos != len(binary):
        raise ProtocolError(f"{len(binary) - pos} bytes of binary data belong to no input")
    params = header.get("parameters") or {}
    binary_out = bool(isinstance(params, dict) and params.get("binary_data_output"))
    wanted: dict[str, bool] = {}
    for out in header.get("outputs") or []:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise ProtocolError("each requested output must be an object with a 'name'")
        p = out.get("parameters") or {}
        wanted[out["name"]] = bool(p.get("binary_data", binary_out)) if isinstance(p, dict) \
            else binary_out
    return header, arrays, wanted, binary_out


def encode_reply(reply: dict[str, Any], result: Mapping[str, np.ndarray],
                 wanted: Mapping[str, bool], binary_out: bool) -> Response:
    from starlette.responses import Response

    outputs, blobs = [], []
    for name, array in result.items():
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of_array(array),
                                 "shape": list(array.shape)}
        if wanted.get(name, binary_out):
            blob = array_to_bytes(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = json_data(array)
        outputs.append(entry)
    reply["outputs"] = outputs
    head = json.dumps(reply).encode()
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(blobs), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})
