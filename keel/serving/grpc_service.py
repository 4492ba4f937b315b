"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``, grpc.aio)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from keel.inference_protocol import (
    ProtocolError,
    array_to_bytes,
    bytes_to_array,
    datatype_of_array,
    decode_json_data,
    element_count,
)
from keel.serving import proto
from keel.serving.repository import run_request

if TYPE_CHECKING:
    from keel.serving.server import ServerState

__all__ = ["add_service"]

# datatype -> the InferTensorContents field that holds it
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents",
             "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
             "BYTES": "bytes_contents"}
Rpc = Callable[[Any, Any], Awaitable[Any]]


def add_service(server: Any, state: ServerState) -> None:
    """Register the service's methods on a ``grpc.aio`` server."""
    import grpc

    service = _Service(state)
    handlers = {}
    for rpc, (request, response) in proto.METHODS.items():
        method = _guarded(state, getattr(service, rpc))
        handlers[rpc] = grpc.unary_unary_rpc_method_handler(
            method, request_deserializer=proto.message(request).FromString,
            response_serializer=proto.message(response).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(proto.SERVICE,
                                                                          handlers),))


def _guarded(state: ServerState, method: Rpc) -> Rpc:
    import grpc

    async def guarded(request: Any, context: Any) -> Any:
        open_rpc = method.__name__ in ("ServerLive", "ServerReady")
        token = dict(context.invocation_metadata()).get("authorization")
        if not open_rpc and not state.authorized(token):
            state.count_failure("", "grpc", "unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        try:
            return await method(request, context)
        except ProtocolError as exc:
            model = getattr(request, "model_name", "") or getattr(request, "name", "")
            state.count_failure(model, "grpc", exc.grpc_code)
            await context.abort(getattr(grpc.StatusCode, exc.grpc_code), exc.message)

    return guarded


class _Service:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return proto.message("ServerLiveResponse")(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return proto.message("ServerReadyResponse")(ready=self.state.ready)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return proto.message("ServerMetadataResponse")(**self.state.server_metadata())

    async def ModelReady(self, request: Any, context: Any) -> Any:
        self.state.repo.get(request.name, request.version)
        return proto.message("ModelReadyResponse")(ready=True)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        meta = self.state.repo.get(request.name, request.version).metadata()
        cls = proto.message("ModelMetadataResponse")
        return cls(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                   inputs=[cls.TensorMetadata(**t) for t in meta["inputs"]],
                   outputs=[cls.TensorMetadata(**t) for t in meta["outputs"]])

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        cls = proto.message("RepositoryIndexResponse")
        models = [cls.ModelIndex(**e) for e in self.state.repo.index()
                  if not request.ready or e["state"] == "READY"]
        return cls(models=models)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self.state.repo.load(request.model_name)
        return proto.message("RepositoryModelLoadResponse")()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self.state.repo.unload(request.model_name)
        return proto.message("RepositoryModelUnloadResponse")()

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        started = time.perf_counter()
        arrays = _inputs(request, self.state.limits)
        wanted = [o.name for o in request.outputs] or None
        served, result = await run_request(self.state.repo, request.model_name,
                                           request.model_version, arrays, wanted,
                                           self.state.limits.request_timeout_s)
        self.state.observe_request(request.model_name, "grpc", time.perf_counter() - started)
        reply = proto.message("ModelInferResponse")(
            model_name=request.model_name, model_version=served.version, id=request.id)
        for name, array in result.items():
            reply.outputs.add(name=name, datatype=datatype_of_array(array),
                              shape=list(array.shape))
            reply.raw_output_contents.append(array_to_bytes(array))
        return reply


def _inputs(request: Any, limits: Any) -> dict[str, np.ndarray]:
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        name, shape = tensor.name, list(tensor.shape)
        if name in arrays:
            raise ProtocolError(f"input {name!r} is given twice")
        if raw:
            arrays[name] = bytes_to_array(name, tensor.datatype, shape, raw[i], limits)
            continue
        element_count(shape, name, limits)
        field = _CONTENTS.get(tensor.datatype)
        if field is None:
            raise ProtocolError(f"input {name!r}: datatype {tensor.datatype!r} cannot travel "
                                f"in 'contents'; send it in raw_input_contents")
        values = list(getattr(tensor.contents, field))
        if tensor.datatype == "BYTES":
            values = [v.decode(errors="replace") for v in values]
        arrays[name] = decode_json_data(name, tensor.datatype, shape, values, limits)
    if not arrays:
        raise ProtocolError("the request has no inputs")
    return arrays
