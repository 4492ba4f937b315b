"""keel's gRPC messages match the official client's field for field."""

from __future__ import annotations

from typing import Any

import pytest
import tritonclient.grpc.service_pb2 as service_pb2

from keel.serving import proto


def _same(ours: Any, theirs: Any, path: str) -> None:
    for f in ours.fields:
        g = theirs.fields_by_name.get(f.name)
        assert g is not None, f"{path}.{f.name} is not in tritonclient's message"
        assert (f.number, f.type, f.is_repeated) == (g.number, g.type, g.is_repeated), \
            f"{path}.{f.name} differs"
        if f.message_type is not None:
            _same(f.message_type, g.message_type, f"{path}.{f.name}")


@pytest.mark.parametrize("name", [n for n in proto._MESSAGES if "." not in n])
def test_message_matches_tritonclient(name: str) -> None:
    _same(proto.message(name).DESCRIPTOR, service_pb2.DESCRIPTOR.message_types_by_name[name],
          name)


def test_service_methods_are_tritonclients() -> None:
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    for rpc, (request, response) in proto.METHODS.items():
        assert theirs[rpc].input_type.name == request
        assert theirs[rpc].output_type.name == response
