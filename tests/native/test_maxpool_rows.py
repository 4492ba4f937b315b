"""window.c's max pool by output rows (stride 2 across): the planner's choice, bitwise the
band kernel's results and the reference's, NaN and infinities, any thread count, and the
portable builds."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import native_window as nw
from keel.backends.cpu import planner as cpu_planner
from keel.backends.reference.kernels import load as load_reference
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.conv import Window
from keel.ops.schemas.pooling import pool_window

REFERENCE = load_reference()


pytestmark = pytest.mark.usefixtures("native_window_tier")


# (N, C, H, W), kernel, strides, pads (top, left, bottom, right), ceil mode
ROW_WINDOWS = [
    ((1, 64, 112, 112), (3, 3), (2, 2), (1, 1, 1, 1), False),      # ResNet's stem pool
    ((2, 5, 17, 23), (3, 3), (2, 2), (1, 1, 1, 1), False),
    ((1, 3, 8, 9), (3, 3), (2, 2), (1, 1, 1, 1), False),           # rows under a vector
    ((1, 3, 9, 40), (2, 2), (2, 2), (0, 0, 0, 0), False),
    ((1, 4, 33, 33), (3, 3), (2, 2), (2, 2, 2, 2), False),         # all-padding edges
    ((1, 3, 31, 47), (1, 1), (2, 2), (0, 0, 0, 0), False),
    ((2, 3, 30, 45), (2, 2), (2, 2), (1, 1, 1, 1), False),
    ((1, 2, 21, 70), (5, 3), (3, 2), (2, 1, 2, 1), False),         # taller windows
    ((1, 3, 10, 11), (3, 3), (2, 2), (0, 0, 0, 0), True),          # ceil mode
    ((3, 2, 8, 8), (3, 3), (2, 2), (0, 0, 0, 0), False),
    ((1, 2, 5, 1), (3, 3), (2, 2), (1, 1, 1, 1), False),           # one column
]


def _window(x: tuple[int, ...], kernel: tuple[int, int], strides: tuple[int, int],
            pads: tuple[int, int, int, int], ceil: bool) -> tuple[Window, dict[str, Any]]:
    attrs = get_schema(Op.MAX_POOL).normalize_attrs(
        {"kernel_shape": kernel, "strides": strides, "pads": pads, "ceil_mode": int(ceil)})
    return pool_window(Op.MAX_POOL, x, attrs), attrs


def _pool(x: np.ndarray, win: Window, threads: int, rows: bool,
          monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """The native max pool of ``x``, on the row kernel or the band kernel."""
    geo = nw.plan(x.shape[1], win)
    assert geo is not None
    with monkeypatch.context() as m:
        if not rows:
            m.setattr(cpu_planner, "max_pool_by_rows", lambda *a: False)
        assert geo.by_rows() is rows
        y = np.empty((*x.shape[:2], *win.out_spatial), np.float32)
        nw.max_pool(x, y, geo, threads)
    return y


def _reference(x: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    ctx = KernelContext(np, "reference", DeviceKind.CPU, 1)
    return np.asarray(REFERENCE.get(Op.MAX_POOL, "default").fn(ctx, [x], attrs, None)[0])


@pytest.mark.parametrize(("x", "kernel", "strides", "pads", "ceil"), ROW_WINDOWS)
def test_rows_match_the_band_kernel_and_the_reference(
        x: tuple[int, ...], kernel: tuple[int, int], strides: tuple[int, int],
        pads: tuple[int, int, int, int], ceil: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    win, attrs = _window(x, kernel, strides, pads, ceil)
    xs = np.random.default_rng(sum(x)).standard_normal(x).astype(np.float32)
    got = _pool(xs, win, 1, True, monkeypatch)
    np.testing.assert_array_equal(got, _pool(xs, win, 1, False, monkeypatch))
    np.testing.assert_array_equal(got, _reference(xs, attrs))      # a max is exact


def test_nan_and_infinities_at_the_row_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN anywhere in a window gives NaN, in the first and last vectors of a row too;
    +inf wins and -inf loses, as in the band kernel."""
    shape = (2, 3, 20, 45)
    win, attrs = _window(shape, (3, 3), (2, 2), (1, 1, 1, 1), False)
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    x[0, 0, 4, 0] = np.nan          # first column: the masked load left of the row
    x[0, 1, 19, 44] = np.nan        # last row and column
    x[1, 2, 9, 33] = np.nan         # a whole vector inside the row
    x[1, 0, 0, 0] = np.inf
    x[1, 1, 10:13, :] = -np.inf
    got = _pool(x, win, 1, True, monkeypatch)
    np.testing.assert_array_equal(got, _pool(x, win, 1, False, monkeypatch))
    nan = np.zeros(got.shape, bool)
    nan[0, 0, 2, 0] = True
    nan[0, 1, 9, 22] = True
    nan[1, 2, 4:6, 16:18] = True
    np.testing.assert_array_equal(np.isnan(got), nan)
    want = _reference(x, attrs)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert got[1, 0, 0, 0] == np.inf


@pytest.mark.parametrize("threads", [2, 3, 4, 7, 16])
def test_threads_give_bitwise_equal_results(threads: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_CHUNK_TAPS", 1)          # split even small calls
    shape = (3, 11, 30, 37)
    win, _ = _window(shape, (3, 3), (2, 2), (1, 1, 1, 1), False)
    x = np.random.default_rng(threads).standard_normal(shape).astype(np.float32)
    x[2, 5, 7, 7] = np.nan
    one = _pool(x, win, 1, True, monkeypatch)
    assert one.tobytes() == _pool(x, win, threads, True, monkeypatch).tobytes()


def test_planner_takes_stride_two_across_only() -> None:
    rule = cpu_planner.max_pool_by_rows
    assert rule((3, 3), (2, 2), (1, 1))                              # ResNet
    assert rule((2, 2), (2, 2), (1, 1))                              # LeNet
    assert not rule((3, 3), (1, 1), (1, 1))
    assert not rule((3, 3), (2, 3), (1, 1))
    assert not rule((3, 5), (2, 2), (1, 1))                          # over three taps across
    assert not rule((3, 3), (2, 2), (2, 2))
    win, _ = _window((1, 2, 12, 12), (3, 3), (2, 2), (0, 0, 0, 0), False)
    geo = nw.plan(2, win)
    assert geo is not None and geo.by_rows()


def test_the_kernel_refuses_geometries_it_does_not_serve() -> None:
    from keel.backends.cpu.native_window import _functions

    fns = _functions()
    win, _ = _window((1, 2, 12, 12), (3, 3), (1, 1), (1, 1, 1, 1), False)
    geo = nw.plan(2, win)
    assert geo is not None and int(fns.maxpool_rows_scratch(geo.address)) == -1
    x = np.zeros((1, 2, 12, 12), np.float32)
    y = np.full((1, 2, 12, 12), 7.0, np.float32)
    assert fns.maxpool_rows(x.ctypes.data, y.ctypes.data, geo.address, None, 0, 2) == -1
    assert np.all(y == 7.0)                                          # nothing written


PORTABLE_FLAGS = {"x86_64": [("-march=x86-64",), ("-mavx2", "-mfma")]}


@pytest.mark.parametrize("flags", PORTABLE_FLAGS.get(__import__("platform").machine(), []))
def test_portable_builds_match_the_band_kernel(tmp_path: Any, flags: tuple[str, ...],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain-C path (a row of column maxima in scratch) gives the band kernel's bits."""
    import subprocess

    from keel.native.build import SOURCE_DIR
    from keel.native.toolchain import BASE_FLAGS, find_compiler

    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(f"native tier unavailable: {why}")
    target = tmp_path / "window.so"
    done = subprocess.run([compiler.path, *BASE_FLAGS, *flags, "-o", str(target),
                           str(SOURCE_DIR / "window.c"), "-lm"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(target))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    scratch = lib.keel_maxpool_rows_scratch
    scratch.argtypes, scratch.restype = [ptr], i64
    pool = lib.keel_maxpool_rows_f32
    pool.argtypes, pool.restype = [ptr] * 4 + [i64, i64], i64
    for x_shape, kernel, strides, pads, ceil in ROW_WINDOWS[1:]:
        win, _ = _window(x_shape, kernel, strides, pads, ceil)
        x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
        x[0, 0, 0, 0] = np.nan
        geo = nw.plan(x_shape[1], win)
        assert geo is not None
        buf = np.empty(scratch(geo.address), np.float32)
        got = np.empty((*x_shape[:2], *win.out_spatial), np.float32)
        planes = x_shape[0] * x_shape[1]
        assert pool(x.ctypes.data, got.ctypes.data, geo.address, buf.ctypes.data, 0,
                    planes) == 0
        assert got.tobytes() == _pool(x, win, 1, False, monkeypatch).tobytes()
