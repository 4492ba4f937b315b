"""The prepared native calls of conv, MatMul / Gemm and the window pools: a node called
again with the same arrays runs the call prepared on its first run, and the result is
bitwise what the full path computes; other arrays, attributes or thread counts (or a
different thread) get calls of their own, and a model's output (a fresh array every
run) is served too."""

from __future__ import annotations

import gc
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import matmul as cpu_matmul
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu import pooling
from keel.backends.cpu.backend import CpuBackend
from keel.backends.cpu.kernels import load as load_cpu
from keel.execution.model import load_model
from keel.ops.registry import Op
from keel.ops.schema import get_schema

CPU = load_cpu()
RNG = np.random.default_rng(23)


pytestmark = pytest.mark.usefixtures("native_gemm_tier", "native_window_tier")


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _ctx(state: Any = None, threads: int = 1) -> KernelContext:
    return KernelContext(np, "cpu", DeviceKind.CPU, threads, state)


def _state(op: Op, variant: str, consts: Sequence[Any], attrs: dict[str, Any]) -> Any:
    kernel = CPU.get(op, variant)
    assert kernel.prepack is not None
    return kernel.prepack(CpuBackend(threads=1).context(), list(consts), attrs)


def _conv(state: Any, inputs: list[Any], attrs: dict[str, Any], y: np.ndarray,
          threads: int = 1) -> np.ndarray:
    got = CPU.get(Op.CONV, "native").fn(_ctx(state, threads), inputs, attrs, [y])[0]
    assert got is y
    return y


def _conv_full(inputs: list[Any], attrs: dict[str, Any], shape: tuple[int, ...]
               ) -> np.ndarray:
    """The full path: a fresh state and a fresh output, so nothing prepared is reused."""
    state = _state(Op.CONV, "native", [None, *inputs[1:3]], attrs)
    return _conv(state, inputs, attrs, np.empty(shape, np.float32))


# ---- conv ---------------------------------------------------------------------------------
CONVS = [
    # X, W, attrs, with bias, with residual
    ((1, 1, 28, 28), (6, 1, 5, 5), {"pads": (2, 2, 2, 2)}, True, False),      # phase image
    ((1, 6, 14, 14), (16, 6, 5, 5), {}, True, False),                          # X in place
    ((2, 8, 9, 9), (8, 8, 3, 3), {"strides": (2, 2), "pads": (1, 1, 1, 1)}, False, True),
    ((1, 4, 8, 8), (6, 2, 3, 3), {"group": 2, "pads": (1, 1, 1, 1),
                                  "activation": "gelu"}, True, False),
    ((1, 8, 6, 6), (4, 8, 1, 1), {"activation": "relu"}, True, True),         # 1x1 direct
]


@pytest.mark.parametrize(("xs", "ws", "extra", "bias", "residual"), CONVS)
def test_conv_reuses_its_prepared_run_with_new_values(
        xs: tuple[int, ...], ws: tuple[int, ...], extra: dict[str, Any], bias: bool,
        residual: bool) -> None:
    attrs = get_schema(Op.CONV).normalize_attrs({"kernel_shape": ws[2:], **extra})
    w, b = _frozen(_f(*ws)), _frozen(_f(ws[0])) if bias else None
    x = _f(*xs)
    y_shape = _out_shape(x, w, b, attrs)
    z = _f(*y_shape) if residual else None
    inputs = [x, w, b, z] if residual else [x, w, b]
    state = _state(Op.CONV, "native", [None, w, b], attrs)
    y = np.empty(y_shape, np.float32)
    for _ in range(3):
        x[...] = _f(*xs)
        if z is not None:
            z[...] = _f(*y_shape)
        _conv(state, inputs, attrs, y)
        np.testing.assert_array_equal(y, _conv_full(inputs, attrs, y_shape))
    assert len(state.ready) == 1


def _out_shape(x: np.ndarray, w: np.ndarray, b: Any, attrs: dict[str, Any]
               ) -> tuple[int, ...]:
    return tuple(CPU.get(Op.CONV).fn(_ctx(), [x, w, b], attrs, None)[0].shape)


def test_conv_with_a_phase_image_takes_any_x_of_its_shape() -> None:
    # A model's input is the caller's array: a new object every run.
    attrs = get_schema(Op.CONV).normalize_attrs({"kernel_shape": (3, 3), "pads": (1, 1, 1, 1)})
    w, b = _frozen(_f(4, 3, 3, 3)), _frozen(_f(4))
    state = _state(Op.CONV, "native", [None, w, b], attrs)
    y = np.empty((1, 4, 10, 10), np.float32)
    for strided in (False, True, False):
        x = _f(1, 3, 10, 20)[..., ::2] if strided else _f(1, 3, 10, 10)
        _conv(state, [x, w, b], attrs, y)
        np.testing.assert_array_equal(y, _conv_full([np.ascontiguousarray(x), w, b], attrs,
                                                    y.shape))
    assert len(state.ready) == 1


def test_conv_reading_x_in_place_recomputes_for_another_x() -> None:
    attrs = get_schema(Op.CONV).normalize_attrs({"kernel_shape": (3, 3)})
    w = _frozen(_f(5, 3, 3, 3))
    state = _state(Op.CONV, "native", [None, w], attrs)
    y = np.empty((1, 5, 6, 6), np.float32)
    for _ in range(2):
        x = _f(1, 3, 8, 8)
        _conv(state, [x, w], attrs, y)
        np.testing.assert_array_equal(y, _conv_full([x, w], attrs, y.shape))


def test_conv_other_attributes_or_weights_do_not_take_the_prepared_run() -> None:
    base = {"kernel_shape": (3, 3), "pads": (1, 1, 1, 1)}
    attrs = get_schema(Op.CONV).normalize_attrs(base)
    relu = get_schema(Op.CONV).normalize_attrs({**base, "activation": "relu"})
    w, other = _frozen(_f(4, 2, 3, 3)), _frozen(_f(4, 2, 3, 3))
    x, y = _f(1, 2, 7, 7), np.empty((1, 4, 7, 7), np.float32)
    state = _state(Op.CONV, "native", [None, w], attrs)
    _conv(state, [x, w], attrs, y)
    _conv(state, [x, w], relu, y)
    np.testing.assert_array_equal(y, _conv_full([x, w], relu, y.shape))
    assert y.min() >= 0
    _conv(state, [x, other], attrs, y)
    np.testing.assert_array_equal(y, _conv_full([x, other], attrs, y.shape))


def test_conv_thread_counts_and_threads_give_bitwise_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)     # split even tiny products
    attrs = get_schema(Op.CONV).normalize_attrs({"kernel_shape": (3, 3), "pads": (1, 1, 1, 1)})
    w, b = _frozen(_f(16, 8, 3, 3)), _frozen(_f(16))
    x = _f(2, 8, 12, 12)
    state = _state(Op.CONV, "native", [None, w, b], attrs)
    want = _conv_full([x, w, b], attrs, (2, 16, 12, 12))
    y = np.empty_like(want)
    for threads in (1, 2, 1, 2):
        y[...] = 0
        _conv(state, [x, w, b], attrs, y, threads)
        np.testing.assert_array_equal(y, want)
    # Other Python threads running the same node on arrays of their own.
    results: list[np.ndarray] = []

    def body() -> None:
        mine = np.empty_like(want)
        for _ in range(3):
            _conv(state, [x, w, b], attrs, mine)
        results.append(mine)

    workers = [threading.Thread(target=body) for _ in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert len(results) == 3
    for got in results:
        np.testing.assert_array_equal(got, want)


# ---- matmul / gemm ------------------------------------------------------------------------
GEMM_ATTRS = {"trans_a": 0, "trans_b": 1, "alpha": 1.0, "beta": 1.0, "activation": "relu",
              "activation_params": ()}


def _gemm_full(inputs: list[Any], attrs: dict[str, Any]) -> np.ndarray:
    state = _state(Op.GEMM, "native", [None, *inputs[1:]], attrs)
    return np.asarray(cpu_matmul.gemm(_ctx(state), inputs, attrs, None)[0])


@pytest.mark.parametrize("n", [10, 5000])     # a small output is held, a large one retargeted
def test_gemm_writes_each_fresh_output_bitwise_like_the_full_path(n: int) -> None:
    a, w, c = _f(4, 30), _frozen(_f(n, 30)), _frozen(_f(n))
    state = _state(Op.GEMM, "native", [None, w, c], GEMM_ATTRS)
    ctx = _ctx(state)
    outs = []
    for _ in range(4):
        a[...] = _f(4, 30)
        y = np.empty((4, n), np.float32)               # a model output: fresh every run
        assert cpu_matmul.gemm(ctx, [a, w, c], GEMM_ATTRS, [y])[0] is y
        np.testing.assert_array_equal(y, _gemm_full([a, w, c], GEMM_ATTRS))
        outs.append(y)
    assert len(state.calls) == 1
    (run,) = state.calls.values()
    assert (run.hold is not None) == (n == 10)
    assert len({id(o) for o in outs}) == 4


def test_a_fresh_output_where_the_last_one_lay_keeps_the_bound_call() -> None:
    """A model's output is a new array every run, and the allocator often gives it the
    bytes the last one freed: the conv's and the product's calls bound for that address
    are kept (nothing moved or bound again), an output elsewhere gets its calls moved,
    and every result is bitwise the full path's."""
    attrs = get_schema(Op.CONV).normalize_attrs({"kernel_shape": (3, 3), "pads": (1, 1, 1, 1),
                                                 "activation": "relu"})
    x, w, b, z = _f(1, 16, 16, 16), _frozen(_f(16, 16, 3, 3)), _frozen(_f(16)), _f(1, 16, 16, 16)
    conv_state = _state(Op.CONV, "native", [None, w, b], attrs)
    conv_places = np.empty((2, 1, 16, 16, 16), np.float32)
    a, gw, gc = _f(4, 30), _frozen(_f(5000, 30)), _frozen(_f(5000))     # retargeted, not held
    gemm_state = _state(Op.GEMM, "native", [None, gw, gc], GEMM_ATTRS)
    gemm_places = np.empty((2, 4, 5000), np.float32)
    conv_goes, gemm_goes = [], []
    for where in (0, 0, 1, 1, 0):
        x[...], z[...], a[...] = _f(1, 16, 16, 16), _f(1, 16, 16, 16), _f(4, 30)
        y = conv_places[where].view()                  # a new array, in a known place
        _conv(conv_state, [x, w, b, z], attrs, y)
        np.testing.assert_array_equal(y, _conv_full([x, w, b, z], attrs, y.shape))
        conv_goes.append(next(iter(conv_state.moving.values())).go)
        y = gemm_places[where].view()
        assert cpu_matmul.gemm(_ctx(gemm_state), [a, gw, gc], GEMM_ATTRS, [y])[0] is y
        np.testing.assert_array_equal(y, _gemm_full([a, gw, gc], GEMM_ATTRS))
        gemm_goes.append(next(iter(gemm_state.calls.values())).go)
    for goes in (conv_goes, gemm_goes):
        assert goes[1] is goes[0] and goes[3] is goes[2]
        assert goes[2] is not goes[1] and goes[4] is not goes[3]


def test_gemm_other_arrays_recompute() -> None:
    a, w, c = _f(3, 12), _frozen(_f(7, 12)), _frozen(_f(7))
    state = _state(Op.GEMM, "native", [None, w, c], GEMM_ATTRS)
    ctx = _ctx(state)
    y = np.empty((3, 7), np.float32)
    cpu_matmul.gemm(ctx, [a, w, c], GEMM_ATTRS, [y])
    other_c, other_w, other_a = _f(7), _f(7, 12), _f(3, 12)
    for inputs in ([a, w, other_c], [a, other_w, c], [other_a, w, c]):
        cpu_matmul.gemm(ctx, inputs, GEMM_ATTRS, [y])
        want = np.maximum(inputs[0].astype(np.float64) @ inputs[1].T.astype(np.float64)
                          + inputs[2], 0)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_a_bound_split_gemm_outlives_the_call_the_node_dropped() -> None:
    """A scalar C becomes a bias row that only the prepared call owns; the bound form of
    a call split over threads must keep it alive after the node drops that call (here:
    replaced by the call for another output), even once its bytes could be reused."""
    attrs = {**GEMM_ATTRS, "activation": ""}
    a, w, c = _f(16, 512), _frozen(_f(512, 512)), _frozen(np.array([3.0], np.float32))
    state = _state(Op.GEMM, "native", [None, w, c], attrs)
    ctx = _ctx(state, threads=2)
    y = np.empty((16, 512), np.float32)
    go = CPU.get(Op.GEMM, "native").bind(ctx, [a, w, c], attrs, [y])
    assert go is not None
    go()
    first = y.copy()
    cpu_matmul.gemm(ctx, [a, w, c], attrs, [np.empty((16, 512), np.float32)])
    gc.collect()
    junk = [np.full(512, -1e6, np.float32) for _ in range(4000)]    # reuses freed rows
    go()
    del junk
    np.testing.assert_array_equal(y, first)
    want = a.astype(np.float64) @ w.T.astype(np.float64) + 3.0
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-3)


def test_gemm_output_overlapping_a_is_computed_like_before() -> None:
    # An output that shares memory with A never runs a prepared call that reads A.
    w = _frozen(_f(6, 6))
    attrs = {**GEMM_ATTRS, "activation": ""}
    state = _state(Op.GEMM, "native", [None, w], attrs)
    ctx = _ctx(state)
    a = _f(2, 6)
    cpu_matmul.gemm(ctx, [a, w], attrs, [np.empty((2, 6), np.float32)])
    cpu_matmul.gemm(ctx, [a, w], attrs, [np.empty((2, 6), np.float32)])
    want = a.astype(np.float64) @ w.T.astype(np.float64)
    cpu_matmul.gemm(ctx, [a, w], attrs, [a])
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5)


def test_matmul_thread_counts_give_bitwise_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)
    attrs = {"activation": "gelu", "activation_params": ()}
    a, b, bias = _f(3, 40, 50), _frozen(_f(50, 70)), _frozen(_f(70))
    state = _state(Op.MATMUL, "native", [None, b, bias], attrs)
    y = np.empty((3, 40, 70), np.float32)
    results = []
    for threads in (1, 2, 1, 2):
        cpu_matmul.matmul(_ctx(state, threads), [a, b, bias], attrs, [y])
        results.append(y.copy())
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


# ---- pools ----------------------------------------------------------------------------------
def _pool(op: Op, x: np.ndarray, y: np.ndarray, attrs: dict[str, Any], threads: int = 1
          ) -> np.ndarray:
    got = CPU.get(op, "native").fn(_ctx(None, threads), [x], attrs, [y])[0]
    assert got is y
    return y


@pytest.mark.parametrize("op", [Op.MAX_POOL, Op.AVG_POOL])
def test_pool_reuses_its_bound_call_with_new_values(op: Op) -> None:
    attrs = get_schema(op).normalize_attrs({"kernel_shape": (3, 3), "strides": (2, 2),
                                            "pads": (1, 1, 1, 1)})
    x, y = _f(2, 5, 11, 11), np.empty((2, 5, 6, 6), np.float32)
    for _ in range(3):
        x[...] = _f(2, 5, 11, 11)
        _pool(op, x, y, attrs)
        np.testing.assert_array_equal(y, _pool(op, x.copy(), np.empty_like(y), attrs))
    assert sum(1 for run in pooling._BOUND.values() if run.x_ref() is x) == 1


def test_pool_other_attributes_or_thread_counts_rebind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_CHUNK_TAPS", 1)             # split even tiny pools
    two = get_schema(Op.MAX_POOL).normalize_attrs({"kernel_shape": (2, 2), "strides": (2, 2)})
    three = get_schema(Op.MAX_POOL).normalize_attrs({"kernel_shape": (3, 3), "strides": (2, 2),
                                                     "pads": (0, 0, 1, 1)})
    x, y = _f(1, 6, 8, 8), np.empty((1, 6, 4, 4), np.float32)
    want2 = x.reshape(1, 6, 4, 2, 4, 2).max(axis=(3, 5))
    _pool(Op.MAX_POOL, x, y, two)
    np.testing.assert_array_equal(y, want2)
    _pool(Op.MAX_POOL, x, y, three)
    want3 = y.copy()
    assert not np.array_equal(want3, want2)
    for threads in (2, 1, 2):
        _pool(Op.MAX_POOL, x, y, three, threads)
        np.testing.assert_array_equal(y, want3)
    _pool(Op.MAX_POOL, x, y, two)
    np.testing.assert_array_equal(y, want2)


# ---- whole models ---------------------------------------------------------------------------
def _lenet() -> bytes:
    """Conv (padded) -> Relu -> MaxPool -> Conv -> Relu -> MaxPool -> Gemm -> Relu -> Gemm."""
    def init(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(_f(*shape) * 0.3, name)

    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], kernel_shape=[5, 5],
                         pads=[2, 2, 2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], kernel_shape=[5, 5]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["g1"], transB=1),
        helper.make_node("Relu", ["g1"], ["r3"]),
        helper.make_node("Gemm", ["r3", "w4", "b4"], ["output"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "lenet",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [1, 1, 28, 28])],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, [1, 10])],
        [init("w1", 6, 1, 5, 5), init("b1", 6), init("w2", 16, 6, 5, 5), init("b2", 16),
         init("w3", 84, 400), init("b3", 84), init("w4", 10, 84), init("b4", 10)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return bytes(model.SerializeToString())


def test_a_model_gives_bitwise_the_same_on_every_run_and_from_threads() -> None:
    model = load_model(_lenet(), backend="cpu", threads=1)
    xs = [RNG.standard_normal((1, 1, 28, 28)).astype(np.float32) for _ in range(4)]
    first = [model.predict({"input": x}) for x in xs]     # the full path on the first run
    again = [model.predict({"input": x}) for x in xs]      # then the prepared calls
    for one, two in zip(first, again, strict=True):
        for name in one:
            np.testing.assert_array_equal(one[name], two[name])
            assert one[name] is not two[name]
    seen: list[tuple[int, dict[str, np.ndarray]]] = []

    def body(i: int) -> None:
        for _ in range(20):
            seen.append((i, model.predict({"input": xs[i]})))

    workers = [threading.Thread(target=body, args=(i,)) for i in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert len(seen) == 80
    for i, result in seen:
        for name, value in result.items():
            np.testing.assert_array_equal(value, first[i][name])
