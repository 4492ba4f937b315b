"""The compiled-plan cache: hits and misses, keys, corrupt and untrusted entries, the CLI."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import keel
from keel import _hashing, config
from keel.cli import app
from keel.errors import InvalidArgumentError
from keel.execution import plan_cache
from keel.execution.model import Model, load_model
from keel.graph.importers.onnx import import_onnx
from keel.testing.cli import printed_json
from keel.testing.models import (
    lenet,
    make_inputs,
    mobilenet_block,
    resnet_block,
    transformer_encoder,
)

runner = CliRunner(env={"COLUMNS": "120"})
HIT = "compiled plan loaded from cache"
STORED = "compiled plan stored in cache"


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private cache folder with the plan cache on; returns where entries go."""
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KEEL_PLAN_CACHE", "on")
    config.settings.cache_clear()
    return tmp_path / "cache" / "plans"


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "block.onnx"
    path.write_bytes(resnet_block(channels=8, size=8).SerializeToString())
    return path


def said(model: Model) -> str:
    """What the plan says of the plan cache (the adaptive plan's reasons follow it)."""
    return next(r for r in reversed(model.plan.reasons) if _of_the_plan_cache(r))


def _of_the_plan_cache(reason: str) -> bool:
    """A reason the plan cache gave (other notes speak of the CPU's caches)."""
    return reason.startswith(("plan cache", "compiled plan"))


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.keel")) if folder.is_dir() else []


def _outputs(model: Model, seed: int = 0) -> dict[str, np.ndarray]:
    feeds = make_inputs(resnet_block(channels=8, size=8), batch=2, seed=seed)
    return model.predict(feeds)


def _same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
        for k in a)


def _placement_of(model: Model) -> dict[str, Any]:
    """The model's plan without what the cache said and without the adaptive plan's reasons
    (they quote the telemetry snapshot taken at each load: free memory moves between loads)."""
    data = model.plan.to_dict()
    adaptive = set(model.adaptive_plan.reasons) if model.adaptive_plan is not None else set()
    data["reasons"] = [r for r in data["reasons"] if "cache" not in r and r not in adaptive]
    data.pop("adaptive", None)
    return dict(data)


@pytest.mark.parametrize(("backend", "precision"),
                         [("auto", "auto"), ("cpu", "auto"), ("reference", "fp16")])
def test_a_second_load_comes_from_the_cache_and_equals_a_fresh_load(
        plans: Path, model_path: Path, backend: str, precision: str) -> None:
    first = load_model(model_path, backend, precision)
    assert said(first).startswith(STORED)
    (entry,) = _entries(plans)
    second = load_model(model_path, backend, precision)
    assert said(second) == (f"{HIT} {entry.stem[:12]}: optimization and "
                                       "placement skipped")
    fresh = load_model(model_path, backend, precision, plan_cache=False)
    assert _placement_of(second) == _placement_of(fresh)
    assert second.plan.nodes == fresh.plan.nodes and second.plan.memory == fresh.plan.memory
    # Each node's plan comes back whole, reasons included.
    assert [n.plan.to_dict() for n in second.plan.nodes if n.plan is not None] == [
        n.plan.to_dict() for n in fresh.plan.nodes if n.plan is not None] != []
    assert [i.to_dict() for i in second.inputs] == [i.to_dict() for i in fresh.inputs]
    assert [o.to_dict() for o in second.outputs] == [o.to_dict() for o in fresh.outputs]
    assert second.name == fresh.name == "resnet_block"
    assert _same_bits(_outputs(second), _outputs(fresh))
    assert _same_bits(_outputs(second, seed=3), _outputs(first, seed=3))


def test_bytes_and_protos_are_cached_by_content(plans: Path) -> None:
    proto = resnet_block(channels=8, size=8)
    load_model(proto.SerializeToString())
    assert HIT in said(load_model(proto))     # same bytes, given as a proto
    assert len(_entries(plans)) == 1


@pytest.mark.parametrize("change", [
    {"backend": "reference"}, {"precision": "fp16"}, {"optimization_level": "basic"},
    {"threads": 1}, {"memory_limit": "1GB"},
])
def test_a_changed_option_is_a_miss(plans: Path, model_path: Path,
                                    change: dict[str, Any]) -> None:
    load_model(model_path)
    changed = load_model(model_path, **change)
    assert said(changed).startswith(STORED)
    assert len(_entries(plans)) == 2
    assert HIT in said(load_model(model_path, **change))


def test_another_machine_profile_is_a_miss(plans: Path, model_path: Path) -> None:
    here = keel.probe()
    bigger = dataclasses.replace(here, cpu=dataclasses.replace(here.cpu, logical_cores=256))
    load_model(model_path, hardware=here)
    assert said(load_model(model_path, hardware=bigger)).startswith(STORED)
    assert HIT in said(load_model(model_path, hardware=here))


def test_a_rewritten_model_file_is_keyed_by_its_new_bytes(
        plans: Path, model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_hashing, "SETTLE_NS", 0)     # remember the digest at once
    load_model(model_path)
    assert HIT in said(load_model(model_path))   # from the remembered digest
    other = resnet_block(channels=8, size=8, seed=5).SerializeToString()
    assert len(other) == model_path.stat().st_size
    model_path.write_bytes(other)
    rewritten = load_model(model_path)
    assert said(rewritten).startswith(STORED)
    assert _same_bits(_outputs(rewritten), _outputs(load_model(other, plan_cache=False)))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(offset: float) -> Any:
    """Invert 8 bytes at ``offset`` (a byte offset, or a fraction of the file when < 1:
    the first 8 bytes from there with no zero, inside the weights)."""
    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        at = int(len(data) * offset) if offset < 1 else int(offset)
        while offset < 1 and not all(data[at:at + 8]):    # past the zeros aligning the
            at += 8                                       # weights, which no one reads
        data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
        path.write_bytes(bytes(data))
    return flip


@pytest.mark.parametrize("damage", [_truncate, _flip(16), _flip(200), _flip(0.9),
                                    lambda p: p.write_bytes(b"not a keel file")],
                         ids=["truncated", "length-flipped", "header-flipped",
                              "weights-flipped", "garbage"])
def test_a_corrupt_entry_is_rebuilt_never_trusted(plans: Path, model_path: Path,
                                                  damage: Any) -> None:
    fresh = load_model(model_path, plan_cache=False)
    load_model(model_path)
    (entry,) = _entries(plans)
    damage(entry)
    rebuilt = load_model(model_path)
    assert any("not trusted: it is corrupt" in r for r in rebuilt.plan.reasons)
    assert said(rebuilt).startswith(STORED)
    assert _same_bits(_outputs(rebuilt), _outputs(fresh))
    assert HIT in said(load_model(model_path))      # replaced by a good entry


def test_an_entry_under_another_key_is_not_trusted(plans: Path, model_path: Path) -> None:
    load_model(model_path, optimization_level="basic")
    (basic,) = _entries(plans)
    load_model(model_path)
    (full,) = [p for p in _entries(plans) if p != basic]
    basic.write_bytes(full.read_bytes())
    rebuilt = load_model(model_path, optimization_level="basic")
    assert any("written by another version or for another key" in r
               for r in rebuilt.plan.reasons)
    assert _placement_of(rebuilt) == _placement_of(
        load_model(model_path, optimization_level="basic", plan_cache=False))


@pytest.mark.parametrize("make", [lenet, mobilenet_block, transformer_encoder])
def test_other_models_run_bitwise_alike_from_the_cache(plans: Path, tmp_path: Path,
                                                       make: Any) -> None:
    proto = make()
    path = tmp_path / "m.onnx"
    path.write_bytes(proto.SerializeToString())
    feeds = make_inputs(proto, batch=2)
    load_model(path)
    hit = load_model(path)
    assert HIT in said(hit)
    fresh = load_model(path, plan_cache=False)
    assert _placement_of(hit) == _placement_of(fresh)
    assert _same_bits(hit.predict(feeds), fresh.predict(feeds))


def test_an_entry_others_may_write_is_not_trusted(plans: Path, model_path: Path) -> None:
    load_model(model_path)
    (entry,) = _entries(plans)
    entry.chmod(0o666)
    rebuilt = load_model(model_path)
    assert any("the file is writable by other users" in r for r in rebuilt.plan.reasons)
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600            # replaced, private again


def test_a_folder_others_may_write_is_not_used(plans: Path, model_path: Path) -> None:
    load_model(model_path)
    plans.chmod(0o777)
    before = {p: p.stat().st_mtime_ns for p in plans.iterdir()}
    again = load_model(model_path)
    assert said(again).startswith("plan cache not used: ")
    assert "is writable by other users" in said(again)
    assert {p: p.stat().st_mtime_ns for p in plans.iterdir()} == before   # nothing written
    with pytest.raises(InvalidArgumentError, match="writable by other users"):
        plan_cache.entries()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_is_not_used(plans: Path, model_path: Path) -> None:
    load_model(model_path)
    os.chown(plans, 4242, -1)
    again = load_model(model_path)
    assert "belongs to another user (uid 4242)" in said(again)


def test_plan_cache_off_writes_nothing(plans: Path, model_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(model_path, plan_cache=False)
    assert not any(_of_the_plan_cache(r) for r in model.plan.reasons)
    monkeypatch.setenv("KEEL_PLAN_CACHE", "off")
    config.settings.cache_clear()
    load_model(model_path)
    assert not plans.parent.exists() or not plans.exists()


def test_graphs_and_given_registries_are_not_cached(plans: Path, model_path: Path) -> None:
    from keel.backends.registry import builtin_registry

    load_model(import_onnx(model_path))
    given = load_model(model_path, registry=builtin_registry())
    assert said(given) == ("plan cache not used: a registry was given (its "
                                      "backends cannot be keyed)")
    assert _entries(plans) == []


def test_entries_are_written_atomically_and_pruned(plans: Path, model_path: Path) -> None:
    for level in ("all", "extended", "basic"):
        load_model(model_path, optimization_level=level)
    entries = _entries(plans)
    assert len(entries) == 3 and not list(plans.glob(".*.tmp"))
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in entries)
    for age, path in enumerate(entries):
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    plan_cache._prune(plans, max_entries=2)
    assert _entries(plans) == entries[1:]                   # the least recently used went
    plan_cache._prune(plans, max_bytes=1)
    assert _entries(plans) == entries[2:]                   # the newest one always stays


def test_a_failed_write_leaves_the_old_entry_and_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "entry.keel"
    target.write_bytes(b"old")

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        plan_cache._replace_atomically(target, fail)
    assert target.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [target]


def test_the_setting_reads_on_and_off() -> None:
    assert config.Settings.from_env({}).plan_cache is True
    assert config.Settings.from_env({"KEEL_PLAN_CACHE": "off"}).plan_cache is False
    assert config.Settings.from_env({"KEEL_PLAN_CACHE": "on"}).plan_cache is True
    with pytest.raises(InvalidArgumentError, match="KEEL_PLAN_CACHE='sometimes'"):
        config.Settings.from_env({"KEEL_PLAN_CACHE": "sometimes"})


def test_keel_cache_lists_and_clears(plans: Path, model_path: Path) -> None:
    load_model(model_path)
    listed = runner.invoke(app, ["cache", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    report = printed_json(listed)
    (entry,) = report["entries"]
    assert entry["model"] == "resnet_block" and entry["key"] == _entries(plans)[0].stem
    assert entry["size_bytes"] == report["total_bytes"] > 0
    table = runner.invoke(app, ["cache"])
    assert "resnet_block" in table.output and entry["key"][:12] in table.output
    cleared = runner.invoke(app, ["cache", "clear", "--json"])
    assert printed_json(cleared)["removed"] == 1
    assert _entries(plans) == [] and printed_json(
        runner.invoke(app, ["cache", "list", "--json"]))["entries"] == []
    assert said(load_model(model_path)).startswith(STORED)


def test_keel_cache_rejects_an_unknown_action(plans: Path) -> None:
    result = runner.invoke(app, ["cache", "prune"])
    assert result.exit_code != 0
    assert "unknown action 'prune'; use one of list, clear" in str(result.exception)


def test_a_model_with_external_weights_is_not_cached(plans: Path, tmp_path: Path) -> None:
    import onnx

    path = tmp_path / "external.onnx"
    onnx.save_model(resnet_block(channels=8, size=8), str(path), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    model = load_model(path)
    assert said(model) == ("plan cache not used: the model may keep weights in "
                                      "external files")
    assert _entries(plans) == []


def test_a_source_sees_its_file_change(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"one")
    source = plan_cache.ModelSource(path)
    assert source.digest() == plan_cache.ModelSource(b"one").digest() and source.unchanged()
    path.write_bytes(b"three")
    assert not source.unchanged()
