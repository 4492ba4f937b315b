"""The runtime history: per model and machine, atomic, bounded, corrupt files rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

from keel.hardware.fakes import fake_profile
from keel.planning import history as history_module
from keel.planning.history import MAX_SIZES, RuntimeHistory, graph_digest
from keel.testing.models import mlp


def test_measurements_are_kept_and_averaged(tmp_path: Path) -> None:
    store = RuntimeHistory("m-1", tmp_path / "h.json")
    assert store.records("x=8") == {}
    store.record("x=8", {4: (0.004, 4), 8: (0.004, 8)})
    store.record("x=8", {4: (0.002, 4)})
    again = RuntimeHistory("m-1", tmp_path / "h.json").records("x=8")
    assert again[8].seconds_per_item == 0.0005 and again[8].runs == 1
    assert again[4].runs == 2 and abs(again[4].seconds_per_item - 0.00075) < 1e-12
    assert RuntimeHistory("m-1", tmp_path / "h.json").fastest("x=8", 8).size == 8
    assert RuntimeHistory("m-1", tmp_path / "h.json").fastest("x=8", 6).size == 4
    assert [p.name for p in tmp_path.iterdir()] == ["h.json"]    # no temporary left


def test_a_corrupt_or_foreign_file_is_ignored_and_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    for text in ("{not json", json.dumps({"format": "other"}), "\x00\x01"):
        path.write_text(text)
        store = RuntimeHistory("m", path)
        assert store.records("s") == {}
        assert store.note is not None
        assert "ignored" in store.note or "rebuilt" in store.note
        store.record("s", {2: (0.2, 2)})
        assert RuntimeHistory("m", path).records("s")[2].seconds_per_item == 0.1


def test_the_store_stays_bounded(tmp_path: Path) -> None:
    store = RuntimeHistory("m", tmp_path / "h.json")
    for size in range(1, MAX_SIZES + 4):
        store.record("s", {size: (1.0, size)})
    kept = store.records("s")
    assert len(kept) == MAX_SIZES and 1 not in kept and MAX_SIZES + 3 in kept
    for i in range(history_module.MAX_MODELS + 2):
        RuntimeHistory(f"model-{i}", tmp_path / "h.json").record("s", {1: (1.0, 1)})
    data = json.loads((tmp_path / "h.json").read_text())
    assert len(data["entries"]) == history_module.MAX_MODELS
    assert "model-0" not in data["entries"]


def test_keys_name_the_model_content_and_the_machine(tmp_path: Path) -> None:
    from keel.graph.importers.onnx import import_onnx

    graph = import_onnx(mlp(in_features=4, hidden=(8,), classes=2))
    other = import_onnx(mlp(in_features=4, hidden=(8,), classes=2, seed=1))
    assert graph_digest(graph) == graph_digest(import_onnx(mlp(in_features=4, hidden=(8,),
                                                               classes=2)))
    assert graph_digest(graph) != graph_digest(other)
    server = RuntimeHistory.for_model(graph, fake_profile("x86-avx512-server"), tmp_path / "h")
    board = RuntimeHistory.for_model(graph, fake_profile("edge-arm-board"), tmp_path / "h")
    assert server.key != board.key
    server.record("s", {1: (1.0, 1)})
    assert board.records("s") == {}
