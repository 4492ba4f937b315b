"""A ModelProto parsed without its graph's nodes, which are parsed one at a time.

A parsed protobuf costs about ten times its bytes (upb's arena: a 3.2 MB file of
100,000 nodes takes 32 MB), and the importer holds it while it builds keel's own
objects from it. Nodes are most of a large graph's bytes, so :func:`split_model`
reads the wire format far enough to find the graph (``ModelProto`` field 7) and
its nodes (``GraphProto`` field 1), parses everything else into a ``ModelProto``
whose graph has no nodes, and hands back where each node's bytes lie:
:meth:`SplitModel.nodes` parses them one by one, so only one ``NodeProto`` is
alive at a time. Anything unusual in the bytes (a second graph field, a group,
a length past the end) makes :func:`split_model` return None, and the caller
parses the whole message as before, with its usual errors.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from keel.errors import ModelFormatError

__all__ = ["SplitModel", "split_model"]

_GRAPH_FIELD = 7        # ModelProto.graph
_NODE_FIELD = 1         # GraphProto.node
_LENGTH_DELIMITED = 2
# Below this many bytes the whole parse costs little: no split.
MIN_SPLIT_BYTES = 1 << 16


class _NotSplittable(Exception):
    """The bytes are not the plain wire format this reader follows."""


@dataclass(frozen=True)
class SplitModel:
    """A ``ModelProto`` without its graph's nodes, and the bytes those nodes lie in."""

    model: Any
    data: memoryview
    spans: array          # start, end of each node's bytes, in file order, flattened

    def __len__(self) -> int:
        return len(self.spans) // 2

    def nodes(self, where: str) -> Iterator[Any]:
        """Each node as a ``NodeProto``, parsed when it is reached; bytes that do not parse
        are a ``ModelFormatError`` naming ``where`` (the model)."""
        import onnx

        spans, data = self.spans, self.data
        for k in range(0, len(spans), 2):
            try:
                proto = onnx.NodeProto.FromString(data[spans[k]:spans[k + 1]])
            except Exception as exc:  # protobuf's DecodeError and friends: "corrupt"
                raise ModelFormatError(
                    f"model {where} is not a valid ONNX protobuf (node #{k // 2}: "
                    f"{type(exc).__name__}: {exc})") from None
            yield proto


def split_model(data: bytes) -> SplitModel | None:
    """``data`` (a serialized ModelProto) parsed apart from its nodes, or None where the
    split does not apply (a small file, or bytes this reader does not follow): the
    caller parses the whole message then. Raises what protobuf raises on bad bytes."""
    if len(data) < MIN_SPLIT_BYTES:
        return None
    view = memoryview(data)
    try:
        graph = _graph_field(view)
        spans, runs = _graph_fields(view, graph[1], graph[2])
    except _NotSplittable:
        return None
    return SplitModel(_parse_without_nodes(view, graph, runs), view, spans)


def _graph_field(view: memoryview) -> tuple[int, int, int]:
    """(field start, value start, value end) of the one graph field."""
    found = [f for f in _fields(view, 0, len(view))
             if f[0] == _GRAPH_FIELD and f[1] == _LENGTH_DELIMITED]
    if len(found) != 1:             # none, or several that protobuf would merge
        raise _NotSplittable
    return found[0][2], found[0][3], found[0][4]


def _graph_fields(view: memoryview, start: int, end: int) -> tuple[array, list[list[int]]]:
    """The node spans of the graph in ``view[start:end]`` and the runs of its other fields."""
    spans = array("q")
    runs: list[list[int]] = []
    for number, wire, fstart, vstart, vend in _fields(view, start, end):
        if number == _NODE_FIELD and wire == _LENGTH_DELIMITED:
            spans.append(vstart)
            spans.append(vend)
        elif runs and runs[-1][1] == fstart:
            runs[-1][1] = vend
        else:
            runs.append([fstart, vend])
    return spans, runs


def _parse_without_nodes(view: memoryview, graph: tuple[int, int, int],
                         runs: list[list[int]]) -> Any:
    import onnx

    model = onnx.ModelProto()
    model.MergeFromString(view[:graph[0]])
    model.MergeFromString(view[graph[2]:])
    model.graph.SetInParent()
    for start, end in runs:
        model.graph.MergeFromString(view[start:end])
    return model


def _fields(view: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, value start, value end) of each field."""
    while pos < end:
        fstart = pos
        key, pos = _varint(view, pos, end)
        wire = key & 7
        if wire == 0:
            vstart = pos
            _, pos = _varint(view, pos, end)
        elif wire == 1:
            vstart, pos = pos, pos + 8
        elif wire == _LENGTH_DELIMITED:
            length, vstart = _varint(view, pos, end)
            pos = vstart + length
        elif wire == 5:
            vstart, pos = pos, pos + 4
        else:                       # groups: long deprecated, left to protobuf
            raise _NotSplittable
        if pos > end:
            raise _NotSplittable
        yield key >> 3, wire, fstart, vstart, pos


def _varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _NotSplittable
