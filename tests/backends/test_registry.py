"""The backend registry: registration, priority chain, plugins, why-unavailable records."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from keel.backends.base import Availability, DeviceKind
from keel.backends.registry import (
    BackendRegistry,
    builtin_registry,
    default_registry,
)
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.ops.registry import Op
from tests.backends.fakes import make_backend, spy_registry


def _ep(name: str, load: object) -> types.SimpleNamespace:
    """A stand-in for importlib.metadata.EntryPoint."""
    loader = load if callable(load) and not isinstance(load, type) else (lambda: load)
    return types.SimpleNamespace(name=name, load=loader)


def test_fresh_registry_is_empty() -> None:
    reg = BackendRegistry()
    assert reg.names() == []
    assert reg.priority == []
    assert reg.available() == []
    assert reg.report() == {}


def test_priority_orders_by_number_then_registration() -> None:
    reg = spy_registry(low={"priority": 1}, high={"priority": 5}, tie={"priority": 1})
    assert reg.priority == ["high", "low", "tie"]
    assert [b.name for b in reg.available()] == ["high", "low", "tie"]


def test_set_priority_replaces_the_chain_exactly() -> None:
    reg = spy_registry(a={}, b={}, c={})
    reg.set_priority(["c", "a"])
    assert reg.priority == ["c", "a"]
    assert reg.names() == ["c", "a", "b"]          # b is still registered, just not chained
    assert [b.name for b in reg.available()] == ["c", "a"]
    assert reg.get("b").name == "b"                  # and can still be named explicitly


@pytest.mark.parametrize(("names", "match"), [
    (["a", "nope"], r"unknown backend 'nope' in priority list; registered: a, b"),
    (["a", "a"], r"names a backend twice"),
    ([], r"non-empty list"),
    ("a", r"non-empty list of backend names, got 'a'"),
])
def test_set_priority_rejects_bad_lists(names: list[str], match: str) -> None:
    reg = spy_registry(a={}, b={})
    with pytest.raises(InvalidArgumentError, match=match):
        reg.set_priority(names)


def test_register_validates_its_arguments() -> None:
    reg = BackendRegistry()
    with pytest.raises(InvalidArgumentError, match=r"lower-case string, got 'CPU'"):
        reg.register("CPU", make_backend("cpu"))
    with pytest.raises(InvalidArgumentError, match=r"must be callable, got int"):
        reg.register("x", 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"priority of backend 'x' must be an int"):
        reg.register("x", make_backend("x"), priority="high")  # type: ignore[arg-type]
    reg.register("x", make_backend("x"))
    with pytest.raises(InvalidArgumentError, match=r"'x' is already registered"):
        reg.register("x", make_backend("x"))
    reg.register("x", make_backend("x"), 7, replace=True)
    assert reg.priority == ["x"]


def test_get_unknown_names_the_target_and_lists_registered() -> None:
    reg = spy_registry(cpu={})
    with pytest.raises(BackendSelectionError, match=r"'tpu'.*registered: cpu") as info:
        reg.get("tpu")
    assert info.value.target == "tpu"


def test_get_unavailable_raises_with_its_reason() -> None:
    reg = spy_registry(gpu={"device": DeviceKind.GPU, "available": False,
                            "reason": "no CUDA device"})
    with pytest.raises(BackendSelectionError, match=r"backend 'gpu' cannot be used: no CUDA"):
        reg.get("gpu")
    assert reg.instance("gpu").name == "gpu"            # the object exists nonetheless
    assert reg.report() == {"gpu": Availability(False, "no CUDA device")}
    assert reg.available() == []


def test_factory_failure_is_recorded_not_raised() -> None:
    def explode() -> None:
        raise OSError("driver library missing")

    reg = BackendRegistry()
    reg.register("weird", explode)  # type: ignore[arg-type]
    reg.register("cpu", make_backend("cpu"))
    report = reg.report()
    assert not report["weird"].available
    assert report["weird"].reason == "failed to initialize: OSError: driver library missing"
    assert [b.name for b in reg.available()] == ["cpu"]
    with pytest.raises(BackendSelectionError, match=r"'weird'.*driver library missing"):
        reg.get("weird")


def test_factory_must_build_a_backend_of_its_name() -> None:
    reg = BackendRegistry()
    reg.register("notabackend", lambda: object())  # type: ignore[arg-type,return-value]
    reg.register("misnamed", make_backend("other"))
    assert "not a keel.backends.base.Backend" in reg.availability("notabackend").reason
    assert "named 'other', registered as 'misnamed'" in reg.availability("misnamed").reason


def test_factory_runs_once() -> None:
    calls = []
    cls = make_backend("cpu")

    def factory() -> object:
        calls.append(1)
        return cls()

    reg = BackendRegistry()
    reg.register("cpu", factory)  # type: ignore[arg-type]
    assert reg.get("cpu") is reg.get("cpu") is reg.instance("cpu")
    assert len(calls) == 1


def test_entry_point_plugins_register_with_their_priority() -> None:
    reg = spy_registry(cpu={"priority": 200})
    plugin = make_backend("fancy", priority=500)
    added = reg.load_entry_points([_ep("fancy", plugin)])
    assert added == ["fancy"]
    assert reg.priority == ["fancy", "cpu"]
    assert reg.get("fancy").name == "fancy"


def test_entry_point_plugin_that_fails_to_load_is_recorded() -> None:
    def broken_load() -> object:
        raise ImportError("No module named 'fancy_accel'")

    reg = spy_registry(cpu={})
    assert reg.load_entry_points([_ep("fancy", broken_load)]) == ["fancy"]
    avail = reg.availability("fancy")
    assert not avail.available
    assert avail.reason == "plugin failed to load: ImportError: No module named 'fancy_accel'"
    with pytest.raises(BackendSelectionError, match=r"'fancy'.*plugin failed to load"):
        reg.get("fancy")


def test_entry_point_plugin_cannot_take_a_registered_name() -> None:
    reg = spy_registry(cpu={})
    original = reg.instance("cpu")
    assert reg.load_entry_points([_ep("cpu", make_backend("cpu"))]) == []
    assert reg.instance("cpu") is original


def test_load_entry_points_reads_the_real_group() -> None:
    # keel itself declares no plugins; the call must work and add only real ones.
    reg = BackendRegistry()
    added = reg.load_entry_points()
    assert added == reg.names()


def test_supported_on_lists_available_backends_with_the_op() -> None:
    reg = spy_registry(
        gpu={"device": DeviceKind.GPU, "ops": (Op.ADD,), "available": False, "priority": 3},
        cpu={"ops": (Op.ADD,), "priority": 2},
        reference={"ops": (Op.ADD, Op.RELU), "priority": 1},
    )
    assert reg.supported_on(Op.RELU) == ("reference",)
    assert reg.supported_on(Op.ADD) == ("cpu", "reference")
    assert reg.supported_on(Op.CONV) == ()


def test_builtin_registry_has_keel_backends_in_seed_order() -> None:
    reg = builtin_registry()
    # Seed 004's chain; webgpu is registered but opt-in (pinned or named in set_priority).
    assert reg.priority == ["gpu", "cpu", "reference"]
    assert reg.names() == ["gpu", "cpu", "reference", "webgpu"]
    assert "webgpu" in reg.manual()
    assert reg.availability("cpu").available
    assert reg.availability("reference").available
    assert builtin_registry() is not reg                 # always a fresh one


def test_builtin_gpu_availability_has_a_reason() -> None:
    avail = builtin_registry().availability("gpu")
    assert avail.reason
    if not avail.available:
        assert "CuPy" in avail.reason or "CUDA" in avail.reason


def test_default_registry_is_shared() -> None:
    assert default_registry() is default_registry()
    assert {"gpu", "cpu", "reference"} <= set(default_registry().names())


def test_with_instance_replaces_one_backend_and_shares_the_rest() -> None:
    from keel.backends.cpu.backend import CpuBackend

    reg = builtin_registry()
    reg.set_priority(["cpu", "reference"])
    mine = CpuBackend(threads=3)
    own = reg.with_instance("cpu", mine)
    assert own.instance("cpu") is mine and reg.instance("cpu") is not mine
    assert own.instance("reference") is reg.instance("reference")
    assert own.priority == reg.priority == ["cpu", "reference"]
    assert own.names() == reg.names()
    with pytest.raises(BackendSelectionError, match="no backend of that name"):
        reg.with_instance("tpu", mine)


def test_an_installed_plugin_is_found_through_its_entry_points_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The registry scans entry_points.txt files before asking importlib.metadata (which
    # costs a fresh process 2 MB and tens of ms): without a distribution declaring the
    # group nothing is asked; with one, the plugin is found and registered.
    from keel.backends import registry as registry_module

    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    dist = tmp_path / "keelplugin_fancy-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: keelplugin-fancy\n"
                                   "Version: 0.1\n")
    (dist / "entry_points.txt").write_text("[console_scripts]\nfancy = keelplugin_fancy:main\n")
    assert not registry_module._may_declare_backends()
    assert BackendRegistry().load_entry_points() == []
    (dist / "entry_points.txt").write_text("[keel.backends]\nfancy = keelplugin_fancy:Fancy\n")
    (tmp_path / "keelplugin_fancy.py").write_text(
        "from keel.backends.reference.backend import ReferenceBackend\n\n\n"
        "class Fancy(ReferenceBackend):\n    name = 'fancy'\n")
    assert registry_module._may_declare_backends()
    reg = BackendRegistry()
    assert reg.load_entry_points() == ["fancy"]
    assert reg.instance("fancy").name == "fancy"
