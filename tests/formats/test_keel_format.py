"""The .keel file: round trips, zero-copy loading, options, atomic writes, hostile files."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from keel.dtypes import DType
from keel.errors import ModelFormatError
from keel.formats.keel_format import (
    ALIGN,
    FORMAT_VERSION,
    MAGIC,
    is_keel_file,
    load_keel,
    read_header,
    save_keel,
)
from keel.graph.importers.onnx import import_onnx
from keel.graph.ir import Graph
from keel.graph.passes import optimize
from tests.graph import models as M
from tests.graph.interp import run_graph
from tests.graph.models import init, model, rel_l2, rng, vi
from tests.graph.test_passes import feeds_of


def _graph(name: str = "transformer", level: str = "all") -> Graph:
    builders: dict[str, Callable[[np.random.Generator], Any]] = {
        "transformer": M.transformer, "resnet_block": M.conv_bn_block, "lenet": M.lenet}
    return optimize(import_onnx(builders[name](rng(20))), level)


def _same(a: Graph, b: Graph, tol: float = 0.0) -> None:
    assert [(n.name, n.op, n.inputs, n.outputs, n.origin) for n in a.nodes] == \
        [(n.name, n.op, n.inputs, n.outputs, n.origin) for n in b.nodes]
    assert a.inputs == b.inputs and a.outputs == b.outputs and a.opset == b.opset
    assert a.value_types == b.value_types and a.metadata == b.metadata
    feeds = feeds_of(a, rng(1))
    want, got = run_graph(a, feeds), run_graph(b, feeds)
    for k in want:
        assert rel_l2(got[k], want[k]) <= tol


@pytest.mark.parametrize("name", ["transformer", "resnet_block", "lenet"])
def test_round_trip_is_exact(tmp_path: Path, name: str) -> None:
    g = _graph(name)
    info = save_keel(g, tmp_path / "m.keel")
    back = load_keel(tmp_path / "m.keel")
    _same(g, back)
    for k, arr in g.initializers.items():
        np.testing.assert_array_equal(back.initializers[k], arr)
        assert back.initializers[k].dtype == arr.dtype
    assert info.tensors == len(g.initializers) and info.file_bytes == (tmp_path / "m.keel"
                                                                      ).stat().st_size


def test_raw_weights_are_read_only_views_of_the_mapped_file(tmp_path: Path) -> None:
    save_keel(_graph("lenet"), tmp_path / "m.keel")
    back = load_keel(tmp_path / "m.keel")
    for arr in back.initializers.values():
        assert not arr.flags.writeable
        base: Any = arr
        while getattr(base, "base", None) is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap), "the weight was copied out of the mapped file"


def test_header_and_alignment(tmp_path: Path) -> None:
    save_keel(_graph("lenet"), tmp_path / "m.keel")
    data = (tmp_path / "m.keel").read_bytes()
    assert data[:8] == MAGIC and struct.unpack("<I", data[8:12])[0] == FORMAT_VERSION
    header = read_header(tmp_path / "m.keel")
    assert header["keel_version"] and header["data_offset"] % ALIGN == 0
    for entry in header["tensors"].values():
        assert (header["data_offset"] + entry["offset"]) % ALIGN == 0
        assert entry["encoding"] == "raw"
    assert is_keel_file(tmp_path / "m.keel") and is_keel_file(data)
    assert not is_keel_file(b"\x08\x07onnx") and not is_keel_file(tmp_path / "missing")


def test_load_from_bytes(tmp_path: Path) -> None:
    g = _graph("resnet_block")
    save_keel(g, tmp_path / "m.keel")
    _same(g, load_keel((tmp_path / "m.keel").read_bytes()))


def test_compression_shrinks_compressible_weights(tmp_path: Path) -> None:
    g = _graph("lenet")
    g.initializers = {k: np.round(v * 4) / 4 if v.ndim > 1 else v
                      for k, v in g.initializers.items()}
    plain = save_keel(g, tmp_path / "plain.keel")
    packed = save_keel(g, tmp_path / "packed.keel", compress=True)
    assert packed.file_bytes < plain.file_bytes * 0.8
    encodings = {e["encoding"] for e in read_header(tmp_path / "packed.keel")["tensors"].values()}
    assert "zlib" in encodings
    _same(g, load_keel(tmp_path / "packed.keel"))


def test_fp16_storage_halves_weights_and_loads_original_dtype(tmp_path: Path) -> None:
    g = _graph("lenet")
    info = save_keel(g, tmp_path / "half.keel", fp16=True)
    assert info.stored_bytes <= info.tensor_bytes // 2 + 64
    back = load_keel(tmp_path / "half.keel")
    for k, arr in g.initializers.items():
        assert back.initializers[k].dtype == arr.dtype
        np.testing.assert_allclose(back.initializers[k], arr, rtol=1e-3, atol=1e-3)
    _same(g, back, tol=1e-2)


def test_fp16_keeps_tensors_that_would_overflow(tmp_path: Path) -> None:
    g = Graph("g", [], [], [], {"big": np.array([1e6, 1.0], np.float32)})
    save_keel(g, tmp_path / "m.keel", fp16=True)
    assert read_header(tmp_path / "m.keel")["tensors"]["big"]["storage"] == "float32"
    np.testing.assert_array_equal(load_keel(tmp_path / "m.keel").initializers["big"],
                                  [1e6, 1.0])


def test_attributes_strings_and_dtypes_round_trip(tmp_path: Path) -> None:
    nodes = [helper.make_node("ConstantOfShape", ["s"], ["c"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [2.5])),
             helper.make_node("Cast", ["c"], ["y"], to=TensorProto.FLOAT16)]
    m = model(nodes, [vi("s", [2], TensorProto.INT64)], [vi("y", None, TensorProto.FLOAT16)])
    g = import_onnx(m)
    g.initializers["names"] = np.array(["a", "bc"], dtype=object)
    save_keel(g, tmp_path / "m.keel", compress=True)
    back = load_keel(tmp_path / "m.keel")
    assert back.nodes[1].attrs["to"] is DType.FLOAT16
    np.testing.assert_array_equal(back.nodes[0].attrs["value"], [2.5])
    assert list(back.initializers["names"]) == ["a", "bc"]


def test_a_graph_without_weights_round_trips(tmp_path: Path) -> None:
    """A tree ensemble keeps everything in attributes: the file has no data section."""
    strings = [b"red", b"green"]
    nodes = [helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml",
                              keys_strings=strings, values_int64s=[3, 4], default_int64=-1)]
    m = helper.make_model(
        helper.make_graph(nodes, "g", [vi("x", [2], TensorProto.STRING)],
                          [vi("y", [2], TensorProto.INT64)]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)])
    save_keel(import_onnx(m), tmp_path / "m.keel")
    back = load_keel(tmp_path / "m.keel")
    assert list(back.nodes[0].attrs["keys"]) == ["red", "green"]
    np.testing.assert_array_equal(back.nodes[0].attrs["values"], [3, 4])


def test_write_is_atomic(tmp_path: Path) -> None:
    target = tmp_path / "m.keel"
    save_keel(_graph("resnet_block"), target)
    before = target.read_bytes()
    bad = Graph("g", [], [], [], {"c": np.array([1 + 2j])})
    with pytest.raises(Exception, match="complex"):
        save_keel(bad, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.keel"]


# ---- hostile files --------------------------------------------------------------------------
def _file(tmp_path: Path) -> bytes:
    save_keel(_graph("resnet_block"), tmp_path / "m.keel")
    return (tmp_path / "m.keel").read_bytes()


def _rewrite_header(data: bytes, edit: Any) -> bytes:
    """A file whose header was changed by ``edit`` (with a correct checksum: a crafted file).

    The data section moves to just after the new header unless the edit set
    ``data_offset`` itself.
    """
    _, version, _, length = struct.unpack("<8sIIQ", data[:24])
    header = json.loads(data[24:24 + length])
    old_offset = header["data_offset"]
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    start = -(-(24 + len(text) + 16) // ALIGN) * ALIGN
    if header.get("data_offset") == old_offset:
        header["data_offset"] = start
        text = json.dumps(header, separators=(",", ":")).encode()
    prefix = struct.pack("<8sIIQ", MAGIC, version, zlib.crc32(text), len(text)) + text
    return prefix + b"\0" * (start - len(prefix)) + data[old_offset:]


def _first(header: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = next(iter(header["tensors"].values()))
    return entry


CRAFTED = {
    "negative-offset": lambda h: _first(h).update(offset=-64),
    "offset-past-end": lambda h: _first(h).update(offset=1 << 40),
    "misaligned": lambda h: _first(h).update(offset=1),
    "huge-shape": lambda h: _first(h).update(shape=[1 << 40, 1 << 40]),
    "negative-dim": lambda h: _first(h).update(shape=[-1]),
    "shape-size-mismatch": lambda h: _first(h).update(shape=[1]),
    "unknown-dtype": lambda h: _first(h).update(dtype="float128"),
    "unknown-encoding": lambda h: _first(h).update(encoding="lz4"),
    "unknown-op": lambda h: h["graph"]["nodes"][0].update(op="warp"),
    "bad-attr": lambda h: h["graph"]["nodes"][0]["attrs"].update(group="x"),
    "dangling-input": lambda h: h["graph"]["nodes"][0].update(inputs=["ghost"]),
    "no-tensors": lambda h: h.pop("tensors"),
    "no-graph": lambda h: h.pop("graph"),
    "nodes-not-a-list": lambda h: h["graph"].update(nodes=7),
    "data-offset-outside": lambda h: h.update(data_offset=1 << 50),
}


@pytest.mark.parametrize("edit", sorted(CRAFTED))
def test_crafted_headers_are_format_errors(tmp_path: Path, edit: str) -> None:
    data = _rewrite_header(_file(tmp_path), CRAFTED[edit])
    with pytest.raises(ModelFormatError):
        load_keel(data)


def test_zlib_bomb_cannot_inflate_past_the_declared_size(tmp_path: Path) -> None:
    g = Graph("g", [], [], [], {"w": np.zeros(16, np.float32)})
    save_keel(g, tmp_path / "m.keel", compress=True)
    data = (tmp_path / "m.keel").read_bytes()
    header = read_header(data)
    entry = header["tensors"]["w"]
    assert entry["encoding"] == "zlib"
    bomb = zlib.compress(b"\0" * (64 << 20))
    start = header["data_offset"] + entry["offset"]

    def edit(h: dict[str, Any]) -> None:
        h["tensors"]["w"].update(nbytes=len(bomb), crc32=zlib.crc32(bomb))

    forged = _rewrite_header(data[:start], edit) + bomb
    with pytest.raises(ModelFormatError, match="does not inflate to 64 bytes"):
        load_keel(forged)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: b"NOTKEEL!" + d[8:], "bad magic"),
    (lambda d: d[:8] + struct.pack("<I", 99) + d[12:], "format version 99"),
    (lambda d: d[:30] + bytes([d[30] ^ 1]) + d[31:], "header checksum"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 0x10]), "checksum mismatch"),
    (lambda d: d[:20], "too short"),
    (lambda d: d[:100], "truncated"),
    (lambda d: d[: len(d) - 50], "past the end|truncated"),
])
def test_corrupt_files_are_format_errors(tmp_path: Path, mutate: Any, match: str) -> None:
    data = mutate(_file(tmp_path))
    with pytest.raises(ModelFormatError, match=match):
        load_keel(data)
    (tmp_path / "bad.keel").write_bytes(data)
    with pytest.raises(ModelFormatError):
        load_keel(tmp_path / "bad.keel")


def test_missing_file_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="cannot read"):
        load_keel(tmp_path / "none.keel")


def test_verify_false_skips_checksums(tmp_path: Path) -> None:
    data = bytearray(_file(tmp_path))
    data[-1] ^= 0x10
    g = load_keel(bytes(data), verify=False)
    assert g.nodes


def test_initializer_graph_outputs_and_optional_inputs_survive(tmp_path: Path) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = model(nodes, [vi("x", [2, 3]), vi("w", [3, 3])], [vi("y", [2, 3])],
              [init("w", np.eye(3, dtype=np.float32))])
    g = import_onnx(m)
    save_keel(g, tmp_path / "m.keel")
    back = load_keel(tmp_path / "m.keel")
    assert back.optional_input_names == ["w"]
