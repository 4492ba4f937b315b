"""A corpus of over 10,000 hostile model files, generated from fixed seeds.

Each case is a damaged ``.onnx`` file (truncated, bit-flipped, overwritten
byte runs, or a protobuf field set to a hostile value), a ``.keel`` file
(bit flips, or its header JSON mutated with a valid checksum, so the checks
past the checksum are reached), or an ONNX model whose external data points
somewhere it should not. Each must load (and then verify or fail with a keel
error) or raise a keel error: never a crash, a hang or a raw exception.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from keel.errors import KeelError
from keel.formats.keel_format import MAGIC, load_keel, save_keel
from keel.graph.importers.onnx import import_onnx
from keel.graph.ir import Graph
from keel.graph.passes import optimize
from tests.graph import models as M
from tests.test_fuzz_loader import CASE_SECONDS, CaseTimeout, time_bound

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

MODELS: dict[str, Callable[[np.random.Generator], Any]] = {
    "mlp": M.mlp, "resnet_block": M.conv_bn_block, "transformer": M.transformer,
    "ln_gelu": M.layer_norm_gelu, "mlp_opset11": lambda r: M.mlp(r, opset=11)}
RAW_CASES = 1200          # per model: truncations, bit flips and overwritten runs
PROTO_CASES = 600         # per model: one protobuf field set to a hostile value
KEEL_CASES = 600          # per .keel model: header mutations and bit flips
PATH_CASES = 500          # external-data path and range tricks
CORPUS_SECONDS = 60.0     # the whole corpus's time box (on a loaded 2-core machine)

HOSTILE_INTS = [-1, 0, 1, 3, 2**31 - 1, -2**31, 2**62, 2**63 - 1, 17, 255]
HOSTILE_STRINGS = ["", "../x", "Relu", "\x00", "a" * 300, "/etc/passwd", "x:y", "ü"]
HOSTILE_JSON: list[Any] = [-1, 0, 2**63, 2**70, "x", None, [], {}, 1.5, "../../etc/passwd",
                           True, [1] * 50, {"a": 1}, "float32", -2**63]


def _outcome(load: Callable[[], Graph]) -> str:
    try:
        graph = load()
    except KeelError:
        return "keel-error"
    try:
        graph.verify()
    except KeelError:
        return "loads, verify refused"
    return "loads"


def _tally(cases: Iterator[tuple[str, Callable[[], Graph]]], tally: Counter[str]) -> None:
    for label, load in cases:
        try:
            with time_bound(CASE_SECONDS):
                tally[_outcome(load)] += 1
        except CaseTimeout:
            pytest.fail(f"{label}: loading took longer than {CASE_SECONDS} s")
        except Exception as exc:
            pytest.fail(f"{label}: {type(exc).__name__} escaped: {exc}")


# ---- raw bytes ----------------------------------------------------------------
def _raw(blob: bytes, r: np.random.Generator, count: int) -> Iterator[tuple[str, bytes]]:
    for i in range(count):
        kind = i % 3
        if kind == 0:
            cut = int(r.integers(0, len(blob)))
            yield f"truncated at {cut}", blob[:cut]
            continue
        data = bytearray(blob)
        if kind == 1:
            for _ in range(int(r.integers(1, 6))):
                data[int(r.integers(0, len(data)))] ^= 1 << int(r.integers(0, 8))
            yield "bits flipped", bytes(data)
        else:
            at, n = int(r.integers(0, len(data))), int(r.integers(1, 16))
            data[at:at + n] = r.integers(0, 256, n, dtype=np.uint8).tobytes()
            yield f"{n} bytes overwritten at {at}", bytes(data)


# ---- protobuf fields -------------------------------------------------------------
def _set_fields(msg: Message) -> list[tuple[FieldDescriptor, Any]]:
    return [(f, v) for f, v in msg.ListFields()]


def _hostile_scalar(field: FieldDescriptor, old: Any, r: np.random.Generator) -> Any:
    if field.type == FieldDescriptor.TYPE_STRING:
        return HOSTILE_STRINGS[int(r.integers(0, len(HOSTILE_STRINGS)))]
    if field.type == FieldDescriptor.TYPE_BYTES:
        return old[: int(r.integers(0, len(old) + 1))] if r.random() < 0.7 else old + b"\x01" * 7
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return float(r.choice([np.nan, np.inf, -1.0, 0.0, 1e30]))
    if field.type == FieldDescriptor.TYPE_ENUM:
        return int(r.integers(0, 40))
    value = HOSTILE_INTS[int(r.integers(0, len(HOSTILE_INTS)))]
    if field.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64):
        value = abs(value)
    if field.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32):
        value = max(-2**31, min(value, 2**31 - 1)) if field.type == FieldDescriptor.TYPE_INT32 \
            else min(value, 2**32 - 1)
    return value


def _mutate(msg: Message, r: np.random.Generator) -> str:
    """Set one field somewhere below ``msg`` to a hostile value; what was done."""
    fields = _set_fields(msg)
    if not fields:
        return "nothing to mutate"
    field, value = fields[int(r.integers(0, len(fields)))]
    repeated = hasattr(value, "extend")          # a repeated field's container
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if repeated and r.random() < 0.25:
            if r.random() < 0.5 or len(value) < 2:
                del value[int(r.integers(0, len(value)))]
                return f"{field.name}: an element removed"
            value.add().CopyFrom(value[int(r.integers(0, len(value)))])
            return f"{field.name}: an element repeated"
        child = value[int(r.integers(0, len(value)))] if repeated else value
        return f"{field.name}.{_mutate(child, r)}"
    if repeated:
        i = int(r.integers(0, len(value)))
        try:
            value[i] = _hostile_scalar(field, value[i], r)
        except (ValueError, TypeError):
            del value[i]
        return f"{field.name}[{i}]"
    try:
        setattr(msg, field.name, _hostile_scalar(field, value, r))
    except (ValueError, TypeError):
        msg.ClearField(field.name)
    return field.name


def _proto_cases(model: onnx.ModelProto, r: np.random.Generator,
                 count: int) -> Iterator[tuple[str, bytes]]:
    for _ in range(count):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        what = _mutate(copy, r)
        yield what, copy.SerializeToString()


# ---- .keel headers ------------------------------------------------------------------
_PREFIX = struct.Struct("<8sIIQ")


def _leaf_paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    yield path
    for key, child in items:
        yield from _leaf_paths(child, (*path, key))


def _with_header(blob: bytes, r: np.random.Generator) -> tuple[str, bytes]:
    """``blob`` with one header JSON value replaced, its checksum made right again."""
    _, version, _, length = _PREFIX.unpack(blob[:_PREFIX.size])
    header = json.loads(blob[_PREFIX.size:_PREFIX.size + length])
    room = int(header["data_offset"])
    paths = [p for p in _leaf_paths(header) if p]
    path = paths[int(r.integers(0, len(paths)))]
    parent = header
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = HOSTILE_JSON[int(r.integers(0, len(HOSTILE_JSON)))]
    text = json.dumps(header, separators=(",", ":")).encode()
    data_at = _PREFIX.size + length
    if _PREFIX.size + len(text) <= room:
        text += b" " * (room - _PREFIX.size - len(text))      # the data stays where it was
        data_at = room
    prefix = _PREFIX.pack(MAGIC, version, zlib.crc32(text), len(text))
    return "header " + "/".join(map(str, path)), prefix + text + blob[data_at:]


def _keel_cases(blob: bytes, r: np.random.Generator, count: int
                ) -> Iterator[tuple[str, bytes]]:
    for i in range(count):
        if i % 3:
            yield _with_header(blob, r)
        else:
            yield from _raw(blob, r, 1)


# ---- external data ------------------------------------------------------------------
LOCATIONS = ["../outside.bin", "/etc/passwd", "w.bin/../../outside.bin", "", "sub/../w.bin",
             "link.bin", "w.bin\x00x", "./w.bin", "a" * 300, "/dev/zero", "dir", "w.bin"]


def _external_cases(tmp: Path, r: np.random.Generator, count: int
                    ) -> Iterator[tuple[str, Callable[[], Graph]]]:
    model = M.mlp(np.random.default_rng(1))
    folder = tmp / "model"
    folder.mkdir()
    onnx.save_model(model, str(folder / "m.onnx"), save_as_external_data=True,
                    location="w.bin", size_threshold=0)
    (tmp / "outside.bin").write_bytes(b"\x00" * 4096)
    (folder / "link.bin").symlink_to(tmp / "outside.bin")
    (folder / "dir").mkdir()
    base = onnx.load_model(str(folder / "m.onnx"), load_external_data=False)
    for i in range(count):
        copy = onnx.ModelProto()
        copy.CopyFrom(base)
        tensors = [t for t in copy.graph.initializer if t.external_data]
        tensor = tensors[int(r.integers(0, len(tensors)))]
        entries = {e.key: e for e in tensor.external_data}
        where = LOCATIONS[int(r.integers(0, len(LOCATIONS)))]
        entries["location"].value = where
        label = f"location {where!r}"
        if i % 2:
            key = "offset" if r.random() < 0.5 else "length"
            entry = entries.get(key) or tensor.external_data.add(key=key)
            entry.key = key
            entry.value = str(HOSTILE_INTS[int(r.integers(0, len(HOSTILE_INTS)))])
            label += f", {key} {entry.value}"
        path = folder / f"case{i % 8}.onnx"
        path.write_bytes(copy.SerializeToString())
        yield label, lambda p=path: import_onnx(p)


# ---- the corpus -------------------------------------------------------------------
def _loads(data: bytes, load: Callable[[bytes], Graph]) -> Callable[[], Graph]:
    return lambda: load(data)


def test_ten_thousand_hostile_files_give_keel_errors_or_load(tmp_path: Path) -> None:
    start = time.perf_counter()
    tally: Counter[str] = Counter()
    for seed, name in enumerate(sorted(MODELS)):
        r = np.random.default_rng(1000 + seed)
        model = MODELS[name](np.random.default_rng(1))
        blob = model.SerializeToString()
        _tally(((f"{name}: {label}", _loads(d, import_onnx))
                for label, d in _raw(blob, r, RAW_CASES)), tally)
        _tally(((f"{name}: {label}", _loads(d, import_onnx))
                for label, d in _proto_cases(model, r, PROTO_CASES)), tally)
    for seed, name in enumerate(["mlp", "resnet_block", "transformer"]):
        path = tmp_path / f"{name}.keel"
        save_keel(optimize(import_onnx(MODELS[name](np.random.default_rng(1)))), path,
                  compress=bool(seed % 2))
        r = np.random.default_rng(2000 + seed)
        _tally(((f"{name}.keel: {label}", _loads(d, load_keel))
                for label, d in _keel_cases(path.read_bytes(), r, KEEL_CASES)), tally)
    _tally(_external_cases(tmp_path, np.random.default_rng(3000), PATH_CASES), tally)
    elapsed = time.perf_counter() - start
    assert sum(tally.values()) >= 10_000, tally
    assert tally["keel-error"] >= 5_000, tally          # most damage is caught, not loaded
    assert elapsed < CORPUS_SECONDS, f"{elapsed:.0f} s for {sum(tally.values())} files"
