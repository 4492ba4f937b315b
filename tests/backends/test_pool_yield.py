"""How keel's spinning threads give their core away: the cpu planner decides it
(``planner.pool_yield``), the backend hands it to the pool, the plan says why, and the
results are the same bits at every thread count whichever way the threads yield."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from keel import native
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.backend import CpuBackend
from keel.execution.model import load_model
from keel.native import pool
from keel.testing.models import make_inputs, resnet_stages


@pytest.fixture(autouse=True)
def _planned_yield() -> Iterator[None]:
    """Each test leaves the pool yielding as the planner decides."""
    yield
    way = cpu_planner.pool_yield()
    pool.set_yield(way.spins, way.shared)


def _needs_native() -> None:
    if not native.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")


def test_a_compiled_program_leaves_the_pool_yielding_as_the_planner_says() -> None:
    """Compiling a program hands the planner's yield to the pool (whatever it was set
    to before), and the reason names the setting it states."""
    _needs_native()
    pool.set_yield(0, False)
    model = load_model(resnet_stages(), backend="cpu", threads=2)
    model.predict(make_inputs(resnet_stages(), 1))
    way = cpu_planner.pool_yield()
    assert pool.yielding() == (way.spins, way.shared)
    assert f"{way.spins} spins" in way.reason and "POOL_YIELD_SHARED" in way.reason


def test_a_yield_to_any_thread_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "POOL_YIELD_SHARED", False)
    way = cpu_planner.pool_yield()
    assert not way.shared and "to any thread" in way.reason


def test_a_backend_hands_the_pool_the_planned_yield(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_native()
    pool.set_yield(0, False)
    CpuBackend(threads=2).pin_threads()
    assert pool.yielding() == (cpu_planner.POOL_YIELD_SPINS, True)
    monkeypatch.setattr(cpu_planner, "POOL_YIELD_SPINS", 64)
    monkeypatch.setattr(cpu_planner, "POOL_YIELD_SHARED", False)
    CpuBackend(threads=2).pin_threads()
    assert pool.yielding() == (64, False)


def test_the_plan_notes_say_how_the_threads_yield() -> None:
    model = load_model(resnet_stages(), backend="cpu", threads=2)
    model.predict(make_inputs(resnet_stages(), 1))
    assert f"keel threads: {cpu_planner.pool_yield().reason}" in model.explain()


@pytest.mark.parametrize("spins, shared", [(256, True), (1, True), (256, False), (0, False)])
def test_the_same_bits_at_every_thread_count_however_threads_yield(
        spins: int, shared: bool) -> None:
    _needs_native()
    onnx_model = resnet_stages(channels=16, size=16)
    feeds = make_inputs(onnx_model, 1, seed=4)
    outs = []
    for threads in (1, 2, 3, 16):
        model = load_model(onnx_model, backend="cpu", threads=threads)
        model.predict(feeds)                 # compiled: the backend set the planned yield
        pool.set_yield(spins, shared)
        got = model.predict(feeds)
        outs.append([got[k] for k in sorted(got)])
    for got in outs[1:]:
        for a, b in zip(got, outs[0], strict=True):
            np.testing.assert_array_equal(a, b)
