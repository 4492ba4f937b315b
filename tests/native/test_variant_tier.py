"""Variants that need the native tier are chosen only where it runs, and the plan says why."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from keel import config, native
from keel.backends.base import KernelTable
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.types import TensorType
from keel.planning.variants import VariantRegistry, choose_variant, tier_unavailable


def _kernel(*_: Any) -> list[Any]:
    return []


def _table() -> KernelTable:
    table = KernelTable("cpu")
    table.kernel(Op.RELU)(_kernel)
    table.kernel(Op.RELU, variant="native", requires="native", priority=10)(_kernel)
    return table


@pytest.fixture
def native_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KEEL_NATIVE", "off")
    config.reload_settings()
    native.reset()
    yield
    native.reset()


def test_unavailable_tier_is_not_chosen_and_the_reason_says_why(native_off: None) -> None:
    name, why = choose_variant(Op.RELU, [TensorType(DType.FLOAT32, (4,))], {}, _table())
    assert name == "default"
    assert "not considered: native (native kernels unavailable: disabled by KEEL_NATIVE=off)" \
        in why


def test_available_tier_is_chosen_by_priority() -> None:
    if not native.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    name, why = choose_variant(Op.RELU, [TensorType(DType.FLOAT32, (4,))], {}, _table())
    assert (name, why) == ("native", "relu: native has the highest priority (10)")


def test_variant_facts_carry_the_tier() -> None:
    info = VariantRegistry([_table()]).get(Op.RELU, "native", "cpu")
    assert info.requires == "native" and info.to_dict()["requires"] == "native"
    assert VariantRegistry([_table()]).get(Op.RELU, "default", "cpu").requires is None


def test_unknown_tier_is_never_available() -> None:
    assert tier_unavailable(None) is None
    assert tier_unavailable("quantum") == "unknown kernel tier 'quantum'"
