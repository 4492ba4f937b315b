"""The end of a model run parks keel's idle workers (``keel_pool_park``): they spin on
for ``KEEL_IDLE_SPIN_US`` at most, then sleep, however long ``KEEL_SPIN_US`` is."""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from keel import config, native
from keel.backends.cpu.backend import CpuBackend
from keel.errors import InvalidArgumentError
from keel.execution.model import load_model
from keel.native import pool
from tests.native._pool_support import worker_states

LONG_SPIN_US = 20_000_000          # 20 s: a worker left to KEEL_SPIN_US would spin on


def _all_asleep(within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = worker_states()
        if states and all(s in "SD" for s in states):
            return True
        time.sleep(0.005)
    return False


@pytest.fixture
def long_spin() -> Iterator[None]:
    if not sys.platform.startswith("linux"):
        pytest.skip("reads the workers' states from /proc (Linux)")
    if native.library("threads") is None:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    pool.shutdown()
    pool.set_spin_us(LONG_SPIN_US)
    pool.set_idle_spin_us(0)
    try:
        yield
    finally:
        pool.set_spin_us(None)
        pool.set_idle_spin_us(None)
        pool.shutdown()                  # no worker keeps spinning on the long setting


def _dispatch() -> None:
    """Two chunks on the pool: its worker runs one (and starts if there was none)."""
    lib = native.library("threads")
    assert lib is not None
    check = lib.function("keel_pool_check", [ctypes.c_int64] * 3 + [ctypes.c_void_p],
                         ctypes.c_int64)
    out = np.full(6, -1, dtype=np.int64)
    assert check(10, 2, 5000, out.ctypes.data) == 0     # both chunks at once: a worker ran


def test_a_worker_spins_until_parked_then_sleeps(long_spin: None) -> None:
    _dispatch()
    time.sleep(0.1)
    states = worker_states()
    assert states and "R" in states         # spinning: never asleep under a 20 s spin
    park = pool.parker()
    assert park is not None
    park()
    assert _all_asleep(within_s=5.0), worker_states()
    _dispatch()                              # a sleeping worker is woken for the next job
    assert pool.workers() >= 1


def product_model() -> bytes:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "product", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def test_a_model_run_on_two_threads_parks_the_workers_when_it_ends(long_spin: None) -> None:
    model = load_model(product_model(), backend="cpu", threads=2)
    x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    want = load_model(product_model(), backend="cpu", threads=1).predict({"x": x})["y"]
    for _ in range(3):
        got = model.predict({"x": x})["y"]
        np.testing.assert_array_equal(got, want)         # bitwise, as across thread counts
    assert pool.workers() >= 1, "the 2-thread product did not use keel's pool"
    assert _all_asleep(within_s=5.0), worker_states()


@pytest.fixture
def pool_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The environment a test sets reaches the pool once it loads again; afterwards the
    pool loads with the process's own settings."""
    if native.library("threads") is None:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    yield monkeypatch
    monkeypatch.undo()
    config.reload_settings()
    native.reset()
    pool.set_idle_spin_us(None)


@pytest.mark.parametrize(("raw", "shown"), [("", str(config.DEFAULT_IDLE_SPIN_US)),
                                            ("0", "0"), (" 300 ", "300")])
def test_the_pool_takes_the_idle_spin_setting(pool_settings: pytest.MonkeyPatch, raw: str,
                                              shown: str) -> None:
    pool_settings.setenv("KEEL_IDLE_SPIN_US", raw)
    config.reload_settings()
    native.reset()                          # loading the pool again hands it the setting
    assert pool.idle_spin_us() == int(shown)
    notes = CpuBackend(threads=2)._capability_details()["notes"]
    assert any(f"{shown} us once a model run has ended" in n for n in notes)
    pool.set_idle_spin_us(7)
    assert pool.idle_spin_us() == 7
    pool.set_idle_spin_us(None)
    assert pool.idle_spin_us() == int(shown)


@pytest.mark.parametrize("raw", ["-1", "soon", "2.5"])
def test_a_bad_idle_spin_setting_is_an_error_naming_it(raw: str) -> None:
    with pytest.raises(InvalidArgumentError, match="KEEL_IDLE_SPIN_US"):
        config.Settings.from_env({"KEEL_IDLE_SPIN_US": raw})
