"""A steady run's feed read where the caller has it, and its bound products called as one.

The cpu planner reads a staged feed of at least ``FEED_IN_PLACE_BYTES`` in place where
only bound native products read it, as their A (``feed_in_place``), and joins a run's
consecutive bound products into one native call (``JOIN_CALLS``). Both must compute the
bits the kernels compute, on any thread count, whatever array the caller passes.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import GraphProto, TensorProto, helper, numpy_helper

from keel import native
from keel.backends.bound import BoundCall
from keel.backends.cpu import planner
from keel.errors import ExecutionError
from keel.execution import program as program_module
from keel.execution.model import Model, load_model
from keel.ops.registry import Op

WIDTH, HIDDEN, CLASSES = 784, 128, 10


def _const(name: str, value: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(value, name)


def _serialized(graph: GraphProto) -> bytes:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def mlp(residual: bool = False) -> bytes:
    """Gemm + ReLU, Gemm + ReLU, Gemm (the benchmark MLP's shape, narrower); with
    ``residual`` the feed is also added to the first layer's output (not read as A)."""
    rng = np.random.default_rng(7)
    n = helper.make_node
    nodes = [n("Gemm", ["x", "w1", "b1"], ["g1"], transB=1), n("Relu", ["g1"], ["h1"])]
    first = "h1"
    consts = [_const("w1", (rng.standard_normal((WIDTH, WIDTH)) / 28).astype(np.float32)),
              _const("b1", rng.standard_normal(WIDTH).astype(np.float32))]
    if residual:
        nodes.append(n("Add", ["h1", "x"], ["r1"]))
        first = "r1"
    nodes += [n("Gemm", [first, "w2", "b2"], ["g2"], transB=1), n("Relu", ["g2"], ["h2"]),
              n("Gemm", ["h2", "w3", "b3"], ["y"], transB=1)]
    consts += [_const("w2", (rng.standard_normal((HIDDEN, WIDTH)) / 28).astype(np.float32)),
               _const("b2", rng.standard_normal(HIDDEN).astype(np.float32)),
               _const("w3", (rng.standard_normal((CLASSES, HIDDEN)) / 11).astype(np.float32)),
               _const("b3", rng.standard_normal(CLASSES).astype(np.float32))]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", CLASSES])], consts)
    return _serialized(graph)


def program_of(model: Model, x: np.ndarray) -> program_module.Program:
    fast = model._fast_path({"x": x})
    assert fast is not None
    return fast[0][1]


def unbound(model: Model, x: np.ndarray) -> np.ndarray:
    """The same run step by step through the kernels (``intermediates`` binds nothing)."""
    return model.intermediates({"x": x})["y"]


def callers_arrays(rows: int, seed: int) -> list[np.ndarray]:
    """One feed's values as a caller may pass them: C order, Fortran order, misaligned."""
    x = np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)
    raw = bytearray(x.nbytes + 2)
    odd = np.frombuffer(raw, np.float32, count=x.size, offset=2).reshape(x.shape)
    odd[...] = x
    return [x, np.asfortranarray(x), odd]


@pytest.mark.parametrize("rows", [1, 32])
def test_a_feed_read_in_place_computes_the_kernels_bits_on_every_thread_count(rows: int) -> None:
    """Whatever array the caller passes, in whatever order of calls, the run computes
    bitwise what the kernels compute, and the native products the same bits on 1, 2, 3
    and 16 threads."""
    ort = pytest.importorskip("onnxruntime")
    onnx_model = mlp()
    session = ort.InferenceSession(onnx_model, providers=["CPUExecutionProvider"])
    in_place = rows * WIDTH * 4 >= planner.FEED_IN_PLACE_BYTES
    results: list[list[np.ndarray]] = []
    for threads in (1, 2, 3, 16):
        model = load_model(onnx_model, backend="cpu", threads=threads)
        got = []
        for seed in range(3):
            for x in callers_arrays(rows, seed):
                got.append(model.predict({"x": x})["y"])
                np.testing.assert_array_equal(got[-1], unbound(model, x))
        program = program_of(model, np.zeros((rows, WIDTH), np.float32))
        if native.available():
            assert program._direct_run is not None
            assert [slot for slot, _, _ in program._moving] == (
                [program._input_slots[0]] if in_place else [])
        results.append(got)
    if native.available():        # BLAS (the NumPy path) sums differently on more threads
        for got in results[1:]:
            for a, b in zip(got, results[0], strict=True):
                np.testing.assert_array_equal(a, b)
    x = callers_arrays(rows, 2)[0]
    (want,) = session.run(None, {"x": x})
    np.testing.assert_allclose(results[0][-1], want, rtol=1e-4, atol=1e-4)


def test_runs_off_the_steady_path_read_the_feeds_buffer(tmp_path: Path) -> None:
    """A steady run leaves its products reading the caller's array; a profiled run, a
    run of an array in another order and a run of a misaligned one then read the feed
    as copied into its buffer, not the array the last steady run read."""
    model = load_model(mlp(), backend="cpu", threads=1)
    first = callers_arrays(32, 0)[0]
    model.predict({"x": first})
    model.predict({"x": first})                     # the steady run, pointed at `first`
    x, fortran, odd = callers_arrays(32, 1)
    want = unbound(model, x)
    assert not np.array_equal(want, unbound(model, first))
    model.enable_profiling()
    np.testing.assert_array_equal(model.predict({"x": x})["y"], want)
    model.end_profiling(tmp_path / "profile.json")
    for array in (fortran, odd):
        model.predict({"x": first})
        np.testing.assert_array_equal(model.predict({"x": array})["y"], want)
    model.predict({"x": first})
    del first
    gc.collect()
    np.testing.assert_array_equal(model.predict({"x": x.copy()})["y"], want)


def test_a_run_after_the_arena_grew_reads_the_feeds_buffer() -> None:
    """A larger batch grows the shared arena; the next run of the steady program binds
    again (off the steady path) and must read the feed as copied, not the array its
    last steady run was pointed at."""
    model = load_model(mlp(), backend="cpu", threads=1)
    first, second = (callers_arrays(32, seed)[0] for seed in (4, 5))
    for _ in range(2):
        model.predict({"x": first})                 # the steady run, pointed at `first`
    pool = program_of(model, first)._pool
    grown = pool.version
    model.predict({"x": callers_arrays(400, 6)[0]})
    assert pool.version != grown, "the larger batch should have replaced the arena"
    want = unbound(model, second)
    assert not np.array_equal(want, unbound(model, first))
    np.testing.assert_array_equal(model.predict({"x": second})["y"], want)


def test_a_thread_coming_back_reads_the_feed_it_is_given() -> None:
    """Each thread's calls read in place what its own last steady run gave them; a run
    on a thread coming back after another thread's runs reads the feed it is given."""
    model = load_model(mlp(), backend="cpu", threads=1)
    first, second, third = (callers_arrays(32, seed)[0] for seed in (6, 7, 8))
    for _ in range(2):
        model.predict({"x": first})                 # this thread's steady run: `first`
    other: list[np.ndarray] = []
    worker = threading.Thread(target=lambda: other.extend(
        model.predict({"x": second})["y"] for _ in range(3)))
    worker.start()
    worker.join()
    np.testing.assert_array_equal(other[-1], unbound(model, second))
    np.testing.assert_array_equal(model.predict({"x": third})["y"], unbound(model, third))


def test_a_feed_that_another_step_reads_is_copied() -> None:
    """The feed is also a residual addend: not every reader can move, so it is copied."""
    model = load_model(mlp(residual=True), backend="cpu", threads=1)
    x = callers_arrays(32, 3)[0]
    for _ in range(2):
        got = model.predict({"x": x})["y"]
    assert program_of(model, x)._moving == ()
    np.testing.assert_array_equal(got, unbound(model, x))


def steady_calls(model: Model, x: np.ndarray) -> tuple[Any, ...] | None:
    """The calls of the model's steady run for ``x`` (None: it has none)."""
    run = program_of(model, x)._direct_run
    if run is None:
        return None
    cells = dict(zip(run.__code__.co_freevars, run.__closure__ or (), strict=True))
    return tuple(cells["calls"].cell_contents)


@pytest.mark.parametrize("threads", [1, 2])
def test_consecutive_bound_products_run_as_one_native_call(
        threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The three products are one call in the steady run (JOIN_CALLS), bitwise what the
    products called one by one compute; with JOIN_CALLS off they are three."""
    x = callers_arrays(32, 4)[0]
    calls = {}
    results = {}
    for join in (True, False):
        monkeypatch.setattr(planner, "JOIN_CALLS", join)
        model = load_model(mlp(), backend="cpu", threads=threads)
        results[join] = [model.predict({"x": x})["y"] for _ in range(3)]
        steady = steady_calls(model, x)
        if steady is not None:
            calls[join] = [c.parts if isinstance(c, BoundCall) else 1 for c in steady]
    if native.available():
        assert calls == {True: [3], False: [1, 1, 1]}
    for got, plain in zip(results[True], results[False], strict=True):
        np.testing.assert_array_equal(got, plain)


@pytest.mark.skipif(not native.available(), reason="no native kernels: nothing joined")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("part", [0, 1, 2])
def test_a_joined_call_names_the_product_that_failed(threads: int, part: int) -> None:
    """A joined product whose entry is bad (a kind keel_gemm_calls_f32 does not know)
    fails the run naming that product's node, not the first of the joined ones."""
    x = callers_arrays(32, 6)[0]
    model = load_model(mlp(), backend="cpu", threads=threads)
    model.predict({"x": x})
    steady = steady_calls(model, x)
    assert steady is not None and len(steady) == 1 and steady[0].parts == 3
    entries = steady[0].keep[0]          # the joined call's list, one row a product
    entries[part, 0] = 7
    with pytest.raises(ExecutionError, match="entry of kind 7") as failed:
        model.predict({"x": x})
    gemms = [node.name for node in model.graph.nodes if node.op == Op.GEMM]
    assert failed.value.node == gemms[part]


def test_explain_states_both_rules() -> None:
    model = load_model(mlp(), backend="cpu", threads=1)
    model.predict({"x": callers_arrays(32, 5)[0]})
    text = model.explain()
    assert "FEED_IN_PLACE_BYTES" in text and "read where the caller has it" in text
    assert "JOIN_CALLS" in text
