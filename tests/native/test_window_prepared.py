"""Prepared (bound once per node) depthwise-conv and global-pool calls, and the
input prefetch of large row-strided window calls: results bitwise equal to fresh calls
for any thread count, and recomputed for other arrays or values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import depthwise, pooling, workspace
from keel.backends.cpu import native_window as nw
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.kernels import load as load_cpu
from keel.backends.reference.kernels import load as load_reference
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.conv import Window, conv_geometry

CPU = load_cpu()
REFERENCE = load_reference()
RNG = np.random.default_rng(23)


pytestmark = pytest.mark.usefixtures("native_window_tier")


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _ctx(threads: int = 1) -> KernelContext:
    return KernelContext(np, "cpu", DeviceKind.CPU, threads)


def _conv(inputs: list[Any], attrs: dict[str, Any], y: np.ndarray, threads: int = 1
          ) -> np.ndarray:
    got = CPU.get(Op.CONV, "depthwise").fn(_ctx(threads), inputs, attrs, [y])[0]
    assert got is y
    return y


def _reference(op: Op, inputs: list[Any], attrs: dict[str, Any]) -> np.ndarray:
    ctx = KernelContext(np, "reference", DeviceKind.CPU)
    return REFERENCE.get(op).fn(ctx, inputs, attrs, None)[0]


def _dw_attrs(c: int, stride: int, **extra: Any) -> dict[str, Any]:
    return get_schema(Op.CONV).normalize_attrs({
        "group": c, "kernel_shape": (3, 3), "pads": (1, 1, 1, 1), "strides": (stride, stride),
        "activation": "clip", "activation_params": (0.0, 6.0), **extra})


def _prepared_for(x: np.ndarray) -> int:
    return sum(1 for run in depthwise._PREPARED.values() if run.x() is x)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("residual", [False, True])
def test_depthwise_reuses_its_bound_call_with_new_values(stride: int, residual: bool) -> None:
    c = 12
    attrs = _dw_attrs(c, stride)
    x, w, b = _f(2, c, 9, 9), _f(c, 1, 3, 3), _f(c)
    side = 9 if stride == 1 else 5
    z = _f(2, c, side, side) if residual else None
    y = np.empty((2, c, side, side), np.float32)
    inputs = [x, w, b] if z is None else [x, w, b, z]
    for _ in range(3):
        x[...] = _f(2, c, 9, 9)
        _conv(inputs, attrs, y)
        fresh = [x.copy(), w, b] if z is None else [x.copy(), w, b, z.copy()]
        np.testing.assert_array_equal(y, _conv(fresh, attrs, np.empty_like(y)))
        np.testing.assert_allclose(y, _reference(Op.CONV, inputs, attrs), rtol=1e-5, atol=1e-5)
    assert _prepared_for(x) == 1


def test_a_bound_window_call_on_one_thread_holds_that_threads_window_scratch() -> None:
    """A window call bound for one thread runs on this thread's window scratch
    (workspace.thread_scratch, as the GEMM's and the blocked conv's are) and keeps it:
    a later, larger one does not free it under the call."""
    x = np.random.default_rng(2).standard_normal((1, 4, 9, 9)).astype(np.float32)
    y = np.empty((1, 4, 4, 4), np.float32)
    win = Window((9, 9), (3, 3), (2, 2), (1, 1), (0, 0), (0, 0), (4, 4))
    geo = nw.plan(4, win)
    assert geo is not None
    bound = nw.bind_max_pool(x, y, geo, threads=1)
    held = workspace.thread_scratch(workspace.Scratch.WINDOW, 0)
    assert any(kept is held for kept in bound.keep)
    grown = workspace.thread_scratch(workspace.Scratch.WINDOW, held.size + 1)
    assert grown is not held and any(kept is held for kept in bound.keep)
    bound()
    np.testing.assert_array_equal(y, _max_pool_3x3_stride_2(x))


def _max_pool_3x3_stride_2(x: np.ndarray) -> np.ndarray:
    """3x3 windows at stride 2 over (N, C, 9, 9), unpadded."""
    windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))
    return windows[:, :, ::2, ::2].max(axis=(-1, -2))


def test_depthwise_other_weights_or_activation_rebind() -> None:
    c = 8
    x, b, y = _f(1, c, 10, 10), _f(c), np.empty((1, c, 10, 10), np.float32)
    clip, plain = _dw_attrs(c, 1), _dw_attrs(c, 1, activation="", activation_params=())
    w1, w2 = _f(c, 1, 3, 3), _f(c, 1, 3, 3)
    for w, attrs in ((w1, clip), (w2, clip), (w2, plain), (w1, clip)):
        _conv([x, w, b], attrs, y)
        np.testing.assert_allclose(y, _reference(Op.CONV, [x, w, b], attrs), rtol=1e-5,
                                   atol=1e-5)
    assert _prepared_for(x) == 1          # one binding per (X, Y, Z, thread): the latest


@pytest.mark.parametrize("side", [15, 120])       # wide rows (8) and rows straight to Y (60)
def test_depthwise_bound_calls_are_bitwise_equal_across_thread_counts(
        monkeypatch: pytest.MonkeyPatch, side: int) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_CHUNK_TAPS", 1)             # split even small convs
    c, out = 16, (side + 1) // 2
    attrs = _dw_attrs(c, 2)
    x, w, b = _f(3, c, side, side), _f(c, 1, 3, 3), _f(c)
    y = np.empty((3, c, out, out), np.float32)
    results = []
    for threads in (1, 2, 1, 2):
        _conv([x, w, b], attrs, y, threads)
        results.append(y.copy())
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


def test_depthwise_residual_overlapping_the_output_is_not_bound() -> None:
    c = 4
    attrs = _dw_attrs(c, 1)
    x, w, b = _f(1, c, 6, 6), _f(c, 1, 3, 3), _f(c)
    y = np.empty((1, c, 6, 6), np.float32)
    z = y                                  # the residual is the output itself: still exact
    y[...] = _f(1, c, 6, 6)
    want = _reference(Op.CONV, [x, w, b, y.copy()], attrs)
    _conv([x, w, b, z], attrs, y)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", [Op.GLOBAL_MAX_POOL, Op.GLOBAL_AVG_POOL])
def test_global_pool_reuses_its_bound_call_with_new_values(op: Op) -> None:
    attrs = get_schema(op).normalize_attrs({})
    x, y = _f(2, 33, 7, 7), np.empty((2, 33, 1, 1), np.float32)
    kernel = CPU.get(op, "native").fn
    for step in range(3):
        x[...] = _f(2, 33, 7, 7)
        if step == 2:
            x[1, 5, 3, 3] = np.nan
        assert kernel(_ctx(), [x], attrs, [y])[0] is y
        np.testing.assert_allclose(y, _reference(op, [x], attrs), rtol=1e-6, atol=1e-6)
        assert np.isnan(y[1, 5, 0, 0]) == (step == 2)
    assert sum(1 for run in pooling._BOUND.values() if run.x_ref() is x) == 1


@pytest.mark.parametrize("op", [Op.GLOBAL_MAX_POOL, Op.GLOBAL_AVG_POOL])
def test_global_pool_bound_across_thread_counts(op: Op,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_CHUNK_TAPS", 1)
    attrs = get_schema(op).normalize_attrs({})
    x, y = _f(4, 20, 5, 5), np.empty((4, 20, 1, 1), np.float32)
    kernel = CPU.get(op, "native").fn
    results = []
    for threads in (2, 1, 2):
        kernel(_ctx(threads), [x], attrs, [y])
        results.append(y.copy())
    np.testing.assert_allclose(results[0], _reference(op, [x], attrs), rtol=1e-6, atol=1e-6)
    for got in results[1:]:
        assert got.tobytes() == results[0].tobytes()


@pytest.mark.parametrize(("activation", "params"), [("", ()), ("relu", ()),
                                                    ("clip", (-0.5, 0.5))])
@pytest.mark.parametrize("residual", [False, True])
def test_wide_rows_straight_to_the_output_with_every_epilogue(
        activation: str, params: tuple[float, ...], residual: bool) -> None:
    c = 3
    attrs = _dw_attrs(c, 1, activation=activation, activation_params=params)
    x, w, b = _f(2, c, 5, 57), _f(c, 1, 3, 3), _f(c)
    inputs = [x, w, b, _f(2, c, 5, 57)] if residual else [x, w, b]
    y = _conv(inputs, attrs, np.empty((2, c, 5, 57), np.float32))
    np.testing.assert_allclose(y, _reference(Op.CONV, inputs, attrs), rtol=1e-5, atol=1e-5)


def test_prefetching_calls_match_plane_by_plane_calls() -> None:
    """A stride-2 call over more than 4M input floats prefetches its input rows; calls of
    one plane do not. The values must not change, and agree with the NumPy form."""
    c, side = 5, 960                         # 4.6M floats of input, rows of 960
    win = Window((side, side), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), (480, 480))
    geo = nw.plan(c, win)
    assert geo is not None
    x, w, b = _f(1, c, side, side), _f(c, 1, 3, 3), _f(c)
    whole, planes = (np.empty((1, c, 480, 480), np.float32) for _ in range(2))
    nw.depthwise_conv(x, w, b, None, whole, geo, (0.0, 6.0))
    for p in range(c):
        nw.depthwise_conv(x[:, p:p + 1], w[p:p + 1], b[p:p + 1], None, planes[:, p:p + 1],
                          nw.plan(1, win), (0.0, 6.0))     # type: ignore[arg-type]
    np.testing.assert_array_equal(whole, planes)
    attrs = _dw_attrs(c, 2)
    layout = cpu_planner.depthwise_layout(conv_geometry(Op.CONV, x.shape, w.shape, attrs),
                                        "rows")
    numpy_y = np.empty_like(whole)
    depthwise.depthwise(np, layout, x, w, b, None, numpy_y, ("clip", (0.0, 6.0)))
    np.testing.assert_allclose(whole, numpy_y, rtol=1e-5, atol=1e-5)


def test_node_run_serves_only_its_arrays_and_follows_thread_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_CHUNK_TAPS", 1)
    c = 6
    attrs = _dw_attrs(c, 1)
    x, w, b, y = _f(2, c, 8, 8), _f(c, 1, 3, 3), _f(c), np.empty((2, c, 8, 8), np.float32)
    _conv([x, w, b], attrs, y)
    run = depthwise.node_run("depthwise", attrs, x, y, None)
    assert run is not None
    assert run.serves("depthwise", x, w, b, None, y, attrs)
    assert not run.serves("depthwise", x, _f(c, 1, 3, 3), b, None, y, attrs)
    assert not run.serves("depthwise", x.copy(), w, b, None, y, attrs)
    assert not run.serves("default", x, w, b, None, y, attrs)
    want = _reference(Op.CONV, [x, w, b], attrs)
    for threads in (1, 2, 1):
        y[...] = 0.0
        run.run(x, y, threads)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert depthwise.node_run("depthwise", attrs, x.copy(), y, None) is None
