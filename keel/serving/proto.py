"""The gRPC messages of the Open Inference Protocol, built at import from a table.

This is KServe's published ``grpc_predict_v2.proto`` (package ``inference``,
service ``GRPCInferenceService``) plus the model repository extension's
messages as Triton's clients send them (``RepositoryIndex``; load and unload
with ``repository_name`` and ``parameters``), written as data rather than
``protoc`` output: generated modules pin the protobuf runtime they run on,
while descriptors built here work with every protobuf from 4 on, the range
onnx needs. They live in a private descriptor pool, so they never clash with
another copy of the same package (``tritonclient``'s) in the same process.
Field names and numbers are checked against ``tritonclient``'s in the tests.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["METHODS", "SERVICE", "message"]

SERVICE = "inference.GRPCInferenceService"

_T = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"bool": _T.TYPE_BOOL, "string": _T.TYPE_STRING, "bytes": _T.TYPE_BYTES,
            "int32": _T.TYPE_INT32, "int64": _T.TYPE_INT64, "uint32": _T.TYPE_UINT32,
            "uint64": _T.TYPE_UINT64, "float": _T.TYPE_FLOAT, "double": _T.TYPE_DOUBLE}

# message -> fields: (name, number, type, label) with label "" | "repeated" | "oneof" |
# "map" (a map<string, type>). Nested messages are named "Outer.Inner".
_PARAMS = ("parameters", 4, "InferParameter", "map")
_MESSAGES: dict[str, list[tuple[str, int, str, str]]] = {
    "ServerLiveRequest": [],
    "ServerLiveResponse": [("live", 1, "bool", "")],
    "ServerReadyRequest": [],
    "ServerReadyResponse": [("ready", 1, "bool", "")],
    "ModelReadyRequest": [("name", 1, "string", ""), ("version", 2, "string", "")],
    "ModelReadyResponse": [("ready", 1, "bool", "")],
    "ServerMetadataRequest": [],
    "ServerMetadataResponse": [("name", 1, "string", ""), ("version", 2, "string", ""),
                               ("extensions", 3, "string", "repeated")],
    "ModelMetadataRequest": [("name", 1, "string", ""), ("version", 2, "string", "")],
    "ModelMetadataResponse": [
        ("name", 1, "string", ""), ("versions", 2, "string", "repeated"),
        ("platform", 3, "string", ""),
        ("inputs", 4, "ModelMetadataResponse.TensorMetadata", "repeated"),
        ("outputs", 5, "ModelMetadataResponse.TensorMetadata", "repeated")],
    "ModelMetadataResponse.TensorMetadata": [
        ("name", 1, "string", ""), ("datatype", 2, "string", ""),
        ("shape", 3, "int64", "repeated")],
    "InferParameter": [("bool_param", 1, "bool", "oneof"), ("int64_param", 2, "int64", "oneof"),
                       ("string_param", 3, "string", "oneof"),
                       ("double_param", 4, "double", "oneof"),
                       ("uint64_param", 5, "uint64", "oneof")],
    "InferTensorContents": [
        ("bool_contents", 1, "bool", "repeated"), ("int_contents", 2, "int32", "repeated"),
        ("int64_contents", 3, "int64", "repeated"), ("uint_contents", 4, "uint32", "repeated"),
        ("uint64_contents", 5, "uint64", "repeated"), ("fp32_contents", 6, "float", "repeated"),
        ("fp64_contents", 7, "double", "repeated"), ("bytes_contents", 8, "bytes", "repeated")],
    "ModelInferRequest": [
        ("model_name", 1, "string", ""), ("model_version", 2, "string", ""),
        ("id", 3, "string", ""), _PARAMS,
        ("inputs", 5, "ModelInferRequest.InferInputTensor", "repeated"),
        ("outputs", 6, "ModelInferRequest.InferRequestedOutputTensor", "repeated"),
        ("raw_input_contents", 7, "bytes", "repeated")],
    "ModelInferRequest.InferInputTensor": [
        ("name", 1, "string", ""), ("datatype", 2, "string", ""),
        ("shape", 3, "int64", "repeated"), _PARAMS,
        ("contents", 5, "InferTensorContents", "")],
    "ModelInferRequest.InferRequestedOutputTensor": [
        ("name", 1, "string", ""), ("parameters", 2, "InferParameter", "map")],
    "ModelInferResponse": [
        ("model_name", 1, "string", ""), ("model_version", 2, "string", ""),
        ("id", 3, "string", ""), _PARAMS,
        ("outputs", 5, "ModelInferResponse.InferOutputTensor", "repeated"),
        ("raw_output_contents", 6, "bytes", "repeated")],
    "ModelInferResponse.InferOutputTensor": [
        ("name", 1, "string", ""), ("datatype", 2, "string", ""),
        ("shape", 3, "int64", "repeated"), _PARAMS,
        ("contents", 5, "InferTensorContents", "")],
    "ModelRepositoryParameter": [
        ("bool_param", 1, "bool", "oneof"), ("int64_param", 2, "int64", "oneof"),
        ("string_param", 3, "string", "oneof"), ("bytes_param", 4, "bytes", "oneof")],
    "RepositoryIndexRequest": [("repository_name", 1, "string", ""), ("ready", 2, "bool", "")],
    "RepositoryIndexResponse": [
        ("models", 1, "RepositoryIndexResponse.ModelIndex", "repeated")],
    "RepositoryIndexResponse.ModelIndex": [
        ("name", 1, "string", ""), ("version", 2, "string", ""), ("state", 3, "string", ""),
        ("reason", 4, "string", "")],
    "RepositoryModelLoadRequest": [
        ("repository_name", 1, "string", ""), ("model_name", 2, "string", ""),
        ("parameters", 3, "ModelRepositoryParameter", "map")],
    "RepositoryModelLoadResponse": [],
    "RepositoryModelUnloadRequest": [
        ("repository_name", 1, "string", ""), ("model_name", 2, "string", ""),
        ("parameters", 3, "ModelRepositoryParameter", "map")],
    "RepositoryModelUnloadResponse": [],
}

# rpc -> (request, response)
METHODS: dict[str, tuple[str, str]] = {
    name: (f"{msg}Request", f"{msg}Response") for name, msg in [
        ("ServerLive", "ServerLive"), ("ServerReady", "ServerReady"),
        ("ModelReady", "ModelReady"), ("ServerMetadata", "ServerMetadata"),
        ("ModelMetadata", "ModelMetadata"), ("ModelInfer", "ModelInfer"),
        ("RepositoryIndex", "RepositoryIndex"), ("RepositoryModelLoad", "RepositoryModelLoad"),
        ("RepositoryModelUnload", "RepositoryModelUnload")]}


def _field(owner: descriptor_pb2.DescriptorProto, path: str, name: str, number: int,
           kind: str, label: str) -> None:
    f = owner.field.add(name=name, number=number)
    if label in ("repeated", "map"):
        f.label = _T.LABEL_REPEATED
    else:
        f.label = _T.LABEL_OPTIONAL
    if label == "oneof":
        if not owner.oneof_decl:
            owner.oneof_decl.add(name="parameter_choice")
        f.oneof_index = 0
    if label == "map":
        entry_name = "".join(p.capitalize() if p.islower() else p
                             for p in name.split("_")) + "Entry"
        entry = owner.nested_type.add(name=entry_name)
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, label=_T.LABEL_OPTIONAL, type=_T.TYPE_STRING)
        entry.field.add(name="value", number=2, label=_T.LABEL_OPTIONAL, type=_T.TYPE_MESSAGE,
                        type_name=f".inference.{kind}")
        f.type, f.type_name = _T.TYPE_MESSAGE, f".inference.{path}.{entry_name}"
    elif kind in _SCALARS:
        f.type = _SCALARS[kind]
    else:
        f.type, f.type_name = _T.TYPE_MESSAGE, f".inference.{kind}"


def _file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(name="keel_grpc_predict_v2.proto",
                                              package="inference", syntax="proto3")
    protos: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full in _MESSAGES:
        outer, _, inner = full.partition(".")
        proto = (protos[outer].nested_type.add(name=inner) if inner
                 else file.message_type.add(name=outer))
        protos[full] = proto
    for full, fields in _MESSAGES.items():
        for spec in fields:
            _field(protos[full], full, *spec)
    service = file.service.add(name="GRPCInferenceService")
    for rpc, (request, response) in METHODS.items():
        service.method.add(name=rpc, input_type=f".inference.{request}",
                           output_type=f".inference.{response}")
    return file


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())
_CLASSES: dict[str, Any] = {}


def message(name: str) -> Any:
    """The message class of ``name`` (``"ModelInferRequest"``, ``"InferTensorContents"``)."""
    cls = _CLASSES.get(name)
    if cls is None:
        cls = message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"inference.{name}"))
        _CLASSES[name] = cls
    return cls
