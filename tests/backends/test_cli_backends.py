"""``keel backends``: every backend, available or why not, capabilities and op coverage."""

from __future__ import annotations

from typer.testing import CliRunner

from keel.backends.registry import builtin_registry
from keel.cli import app
from keel.cli.backends import backends_report
from keel.ops.registry import Op
from keel.testing.cli import printed_json
from tests.backends.fakes import spy_registry


def test_json_lists_every_backend_with_reasons_and_coverage() -> None:
    result = CliRunner().invoke(app, ["backends", "--json"])
    assert result.exit_code == 0, result.output
    data = printed_json(result)
    names = [b["name"] for b in data["backends"]]
    assert {"gpu", "cpu", "reference"} <= set(names)
    assert data["known_ops"] == len(Op)
    for entry in data["backends"]:
        assert entry["reason"], entry["name"]
        assert entry["coverage"]["ops"] == len(entry["ops"])
        assert entry["coverage"]["seed_001_gpu_profile"].endswith("/19")
    cpu = next(b for b in data["backends"] if b["name"] == "cpu")
    assert cpu["available"] and cpu["device"] == "cpu" and cpu["threads"] >= 1


def test_table_says_why_a_backend_is_unavailable() -> None:
    result = CliRunner().invoke(app, ["backends"])
    assert result.exit_code == 0, result.output
    gpu = builtin_registry().availability("gpu")
    assert "reference" in result.output and "cpu" in result.output
    first_words = gpu.reason.split()[0]
    assert f"gpu: {first_words}" in result.output


def test_verbose_lists_ops() -> None:
    result = CliRunner().invoke(app, ["backends", "--verbose"])
    assert result.exit_code == 0, result.output
    assert "reference (" in result.output and " ops): " in result.output


def test_report_of_a_fresh_registry() -> None:
    reg = spy_registry(fast={"ops": (Op.ADD,), "priority": 2},
                       gone={"available": False, "reason": "driver missing", "priority": 1})
    reg.register("broken", lambda: (_ for _ in ()).throw(OSError("boom")))
    report = backends_report(reg)
    assert report["priority"] == ["fast", "gone", "broken"]
    by_name = {b["name"]: b for b in report["backends"]}
    assert by_name["fast"]["ops"] == ["add"] and by_name["fast"]["priority"] == 1
    assert by_name["gone"]["reason"] == "driver missing"
    assert by_name["broken"]["reason"] == "failed to initialize: OSError: boom"
    assert by_name["broken"]["device"] is None and by_name["broken"]["ops"] == []
