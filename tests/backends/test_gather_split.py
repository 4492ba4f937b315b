"""Gather on the cpu backend: window.c's row copy, split over keel's threads where the
planner's least copy work allows, gives NumPy's take's bytes on every thread count,
and an index out of range raises the typed error with nothing written."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from keel import native
from keel.backends.base import KernelContext
from keel.backends.cpu import indexing, native_window
from keel.backends.cpu import kernels as cpu_kernels
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.backend import CpuBackend
from keel.backends.cpu.kernels import TABLE
from keel.backends.reference.backend import ReferenceBackend
from keel.dtypes import DType
from keel.errors import ExecutionError, InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.types import TensorType

THREADS = (1, 2, 3, 16)


@pytest.fixture(autouse=True)
def _native_tier() -> None:
    if not native_window.ready():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    cpu_kernels.load()


def _embedding(rng: np.random.Generator, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """A 3000 x 128 table and 8 x 128 indices, a few of them negative: 131,072
    elements copied, two threads' worth of the declared least copy work."""
    table = rng.standard_normal((3000, 128)).astype(np.float32)
    indices = rng.integers(-3000, 3000, size=(8, 128)).astype(dtype)
    return table, indices


def _ctx(threads: int) -> KernelContext:
    return KernelContext(np, "cpu", "cpu", threads, None)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_an_embedding_lookup_is_the_references_on_every_thread_count(dtype: Any) -> None:
    table, indices = _embedding(np.random.default_rng(1), dtype)
    want = np.asarray(ReferenceBackend().run(Op.GATHER, [table, indices], attrs={"axis": 0})[0])
    kernel = TABLE.get(Op.GATHER)
    assert kernel.bind is not None
    for threads in THREADS:
        out = np.zeros_like(want)
        (got,) = kernel.fn(_ctx(threads), [table, indices], {"axis": 0}, [out])
        assert got is out and np.array_equal(got, want)
        bound_out = np.zeros_like(want)
        call = kernel.bind(_ctx(threads), [table, indices], {"axis": 0}, [bound_out])
        assert call is not None
        call()
        assert np.array_equal(bound_out, want)


def test_the_row_copy_splits_only_where_each_thread_gets_the_least_copy_work() -> None:
    table, indices = _embedding(np.random.default_rng(2), np.int64)
    out = np.empty((8, 128, 128), np.float32)
    parts = [native_window.bind_gather(table, indices, out, 0, t) for t in THREADS]
    assert [p.args[-1] for p in parts if p is not None] == [1, 2, 2, 2]
    few = indices[:1, :64].copy()            # 8,192 elements: one thread's copy
    call = native_window.bind_gather(table, few, np.empty((1, 64, 128), np.float32), 0, 16)
    assert call is not None and call.args[-1] == 1


@pytest.mark.parametrize(("shape", "axis", "indices", "dtype"), [
    ((4, 50, 6), 1, np.array([[3, -1], [0, 49]]), np.float64),
    ((5, 7), 1, np.array(-2), np.int8),
    ((300, 2, 3), 0, np.arange(-300, 300, 7, dtype=np.int32), np.float16),
    ((2, 3, 4, 5), 3, np.array([], dtype=np.int64), np.float32),
])
def test_other_gathers_are_the_references(shape: tuple[int, ...], axis: int,
                                          indices: np.ndarray, dtype: Any) -> None:
    x = (np.random.default_rng(3).standard_normal(shape) * 20).astype(dtype)
    want = np.asarray(ReferenceBackend().run(Op.GATHER, [x, indices], attrs={"axis": axis})[0])
    kernel = TABLE.get(Op.GATHER)
    for threads in THREADS:
        (got,) = kernel.fn(_ctx(threads), [x, indices], {"axis": axis}, None)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_gathers_it_does_not_serve_fall_back_to_numpy() -> None:
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    out = np.empty((3, 4), np.float32)
    assert native_window.bind_gather(table, np.array([1, 2, 3], np.uint16), out, 0, 2) is None
    assert native_window.bind_gather(table.T, np.array([1, 0, 1]),
                                     np.empty((3, 10), np.float32), 0, 2) is None
    assert native_window.bind_gather(table, np.array([1, 2, 3]), out.astype(np.float64),
                                     0, 2) is None
    (got,) = TABLE.get(Op.GATHER).fn(_ctx(2), [table.T, np.array([1, 3], np.uint8)],
                                     {"axis": 0}, None)
    assert np.array_equal(got, table.T[[1, 3]])


@pytest.mark.parametrize("bad", [3000, -3001])
@pytest.mark.parametrize("threads", [1, 2])
def test_an_index_out_of_range_raises_with_nothing_written(bad: int, threads: int) -> None:
    table, indices = _embedding(np.random.default_rng(4), np.int64)
    indices[5, 77] = bad
    kernel = TABLE.get(Op.GATHER)
    assert kernel.bind is not None
    out = np.full((8, 128, 128), 7.0, np.float32)
    call = kernel.bind(_ctx(threads), [table, indices], {"axis": 0}, [out])
    assert call is not None
    with pytest.raises(InvalidArgumentError, match=f"index {bad} is out of range"):
        call()
    with pytest.raises(InvalidArgumentError, match=f"index {bad} is out of range"):
        kernel.fn(_ctx(threads), [table, indices], {"axis": 0}, [out])
    assert (out == 7.0).all()


def test_the_plan_takes_a_gathers_threads_from_the_elements_it_copies() -> None:
    """BERT-mini's embedding lookup: 32 x 128 tokens of 256 floats split over two
    threads; a batch of one sequence of 8 stays on one, and explain says why."""
    table = TensorType(DType.FLOAT32, (30522, 256))
    big = CpuBackend(threads=2).plan_node(
        Op.GATHER, [table, TensorType(DType.INT64, (32, 128))], {"axis": 0})
    small = CpuBackend(threads=2).plan_node(
        Op.GATHER, [table, TensorType(DType.INT64, (1, 8))], {"axis": 0})
    assert big.threads == 2 and small.threads == 1
    reason = dict(small.reasons)["threads"]
    assert "2,048 elements copied, 8 row(s) of 256" in reason and "MIN_COPY_ELEMENTS" in reason
    (split,) = cpu_planner.node_splits(Op.GATHER, [table, TensorType(DType.INT64, (32, 128))],
                                       {"axis": 0}, big, 2)
    assert (split.units, split.pieces, split.work) == (32 * 128, 2, 32 * 128 * 256)


@pytest.mark.parametrize(("shape", "index_shape", "axis", "rows"), [
    ((2, 1 << 20), (1,), 0, 1),          # one row of a million elements: not cut
    ((2, 1 << 20), (), 0, 1),
    ((3, 1 << 19), (3,), 0, 3),          # three rows: 2 + 1 on two threads
    ((1 << 20, 2), (1,), 1, 1 << 20),    # a million rows of one element
    ((30522, 256), (32, 128), 0, 32 * 128),
])
@pytest.mark.parametrize("threads", [2, 3, 16])
def test_the_plan_and_the_kernel_split_the_same_whole_rows(
        shape: tuple[int, ...], index_shape: tuple[int, ...], axis: int, rows: int,
        threads: int) -> None:
    """The kernel copies whole rows (one index's slice each): the node plan's threads,
    its split's pieces and the kernel's chunks are one number, the split's units rows."""
    types = [TensorType(DType.FLOAT32, shape), TensorType(DType.INT64, index_shape)]
    plan = CpuBackend(threads=threads).plan_node(Op.GATHER, types, {"axis": axis})
    (split,) = cpu_planner.node_splits(Op.GATHER, types, {"axis": axis}, plan, threads)
    x, indices = np.zeros(shape, np.float32), np.zeros(index_shape, np.int64)
    out = np.empty(np.take(x, indices, axis=axis).shape, np.float32)
    call = native_window.bind_gather(x, indices, out, axis, plan.threads or 1)
    assert call is not None
    assert split.units == rows and split.unit == "row(s)"
    assert plan.threads == split.pieces == call.args[-1]
    assert split.most * split.pieces >= split.units


def test_a_gather_model_gives_the_same_bits_on_every_thread_count() -> None:
    from onnx import TensorProto, helper, numpy_helper

    from keel.execution.model import load_model

    rng = np.random.default_rng(5)
    table = rng.standard_normal((1000, 256)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)], "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [16, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                              ).SerializeToString()
    ids = rng.integers(-1000, 1000, size=(16, 64))
    want = load_model(model, backend="reference").predict({"ids": ids})["y"]
    for threads in THREADS:
        m = load_model(model, backend="cpu", threads=threads, plan_cache=False)
        for _ in range(2):                      # the first run, then the bound steady run
            assert np.array_equal(m.predict({"ids": ids})["y"], want)
        ids[0, 0] = 1000
        with pytest.raises(InvalidArgumentError, match="index 1000 is out of range"):
            m.predict({"ids": ids})
        ids[0, 0] = 3
        want = load_model(model, backend="reference").predict({"ids": ids})["y"]


def test_a_numpy_scalar_index_takes_numpys_path() -> None:
    """A NumPy scalar has no buffer to hand the row copy: the kernel falls back to take."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert native_window.bind_gather(x, np.int64(1), np.empty(4, np.float32), 0, 2) is None
    kernel = TABLE.get(Op.GATHER)
    assert kernel.bind is not None
    for index in (np.int64(1), np.int32(-2)):
        (got,) = kernel.fn(_ctx(2), [x, index], {"axis": 0}, None)
        assert np.array_equal(got, np.take(x, index, axis=0))
        out = np.zeros(4, np.float32)
        call = kernel.bind(_ctx(2), [x, index], {"axis": 0}, [out])
        assert call is not None
        call()
        assert np.array_equal(out, np.take(x, index, axis=0))


def test_a_read_only_output_is_refused_as_numpys_take_refuses_it() -> None:
    table, indices = _embedding(np.random.default_rng(6), np.int64)
    out = np.full((8, 128, 128), 7.0, np.float32)
    out.flags.writeable = False
    assert native_window.bind_gather(table, indices, out, 0, 2) is None
    with pytest.raises(ValueError, match="read-only"):
        np.take(table, indices, axis=0, out=out)
    with pytest.raises(ValueError, match="read-only"):
        TABLE.get(Op.GATHER).fn(_ctx(2), [table, indices], {"axis": 0}, [out])
    assert (out == 7.0).all()


def test_each_refusal_of_the_row_copy_raises_its_own_error() -> None:
    """window.c's codes: 1 an index out of range, 2 its arguments refused (an index width
    other than 4 or 8 bytes, here called on the real kernel), -1 no scratch memory."""
    table, indices = _embedding(np.random.default_rng(7), np.int64)
    call = native_window.bind_gather(table, indices, np.empty((8, 128, 128), np.float32), 0, 1)
    assert isinstance(call, functools.partial)
    args = list(call.args)
    args[3] = 2                                   # index_bytes
    assert call.func(*args) == 2
    with pytest.raises(ExecutionError, match="refused its arguments"):
        indexing.gather_failed(2, indices, 3000, 0)
    with pytest.raises(MemoryError, match="scratch"):
        indexing.gather_failed(-1, indices, 3000, 0)
    with pytest.raises(ExecutionError, match="that check_indices accepts"):
        indexing.gather_failed(1, indices, 3000, 0)
    indices[0, 0] = 3000
    with pytest.raises(InvalidArgumentError, match="index 3000 is out of range"):
        indexing.gather_failed(1, indices, 3000, 0)


def test_an_unbound_gather_copies_natively_only_from_one_threads_copy_work() -> None:
    """A plain call binds the row copy each time, which costs more than take's copy of a
    shape tensor: the planner keeps those below one thread's least copy work on take."""
    least = cpu_planner.least_work(cpu_planner.LeastWork.COPY, 2)
    assert not cpu_planner.gather_copies_unbound(1)
    assert not cpu_planner.gather_copies_unbound(least - 1)
    assert cpu_planner.gather_copies_unbound(least)
    shape = np.array([1, 3, 224, 224], np.int64)
    for threads in THREADS:
        (got,) = TABLE.get(Op.GATHER).fn(_ctx(threads), [shape, np.array(-1)], {"axis": 0}, None)
        assert got.shape == () and got == 224
