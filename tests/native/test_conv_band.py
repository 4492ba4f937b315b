"""The band conv (gemm.c's keel_conv_band_f32): a dense 2-D conv read from X's rows band
by band of output rows, against the reference backend."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.base import KernelContext, NodePlan
from keel.backends.cpu import conv_gemm
from keel.backends.cpu import native_gemm as ng
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_epilogue import activation, finish
from keel.backends.cpu.kernels import TABLE
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry
from tests.native._conv_support import check_against_reference, rand, reference

pytestmark = pytest.mark.usefixtures("native_gemm_tier")


CASES = [
    # X, W, attrs: every width remainder of a vector, the stride paths (1, 2: vectors;
    # 3: the scalar one), padding on one side, dilation, rows past the last tile
    ((2, 3, 20, 20), (32, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((2, 3, 35, 33), (13, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((1, 2, 9, 7), (5, 2, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((2, 3, 16, 16), (7, 3, 3, 3), {"pads": (0, 0, 1, 1), "strides": (2, 2)}),
    ((1, 3, 13, 13), (8, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}),
    ((2, 4, 12, 12), (5, 4, 3, 3), {"pads": (1, 1, 1, 1), "strides": (3, 3)}),
    ((2, 3, 18, 40), (9, 3, 3, 3), {"pads": (1, 1, 1, 1)}),
    ((1, 3, 5, 70), (17, 3, 3, 3), {"pads": (2, 0, 1, 3)}),
    ((2, 2, 15, 19), (6, 2, 3, 3), {"pads": (2, 2, 2, 2), "dilations": (2, 2),
                                    "strides": (2, 1)}),
    ((2, 3, 64, 64), (24, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((1, 1, 1, 1), (3, 1, 3, 3), {"pads": (1, 1, 1, 1)}),           # one pixel
]


def _band(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any],
          threads: int = 1, nt: bool = False) -> np.ndarray:
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm.native_layout(geo, "band", stream_stores=nt)
    assert layout.band and layout.nt is nt
    y = ng._aligned(int(np.prod(geo.out_shape))).reshape(geo.out_shape)
    act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    filters = conv_gemm.native_filters(np, geo, w, b)
    calls = conv_gemm.native_calls(layout, x, x, filters, z, y, act)
    assert calls is not None and isinstance(calls[0], ng.BandCall)
    for call in calls:
        call.run(threads)
    if act[0] not in ("", "clip"):
        finish(np, y, y, None, act)
    return y


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
@pytest.mark.parametrize("act,params", [("", ()), ("relu", ()), ("clip", (-0.3, 0.4))])
def test_band_matchesreference(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                attrs: dict[str, Any], act: str,
                                params: tuple[float, ...]) -> None:
    check_against_reference(_band, x_shape, w_shape, attrs, act, params)


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES[:3] + CASES[5:7])
def test_threads_and_streaming_stores_bitwise_equal(x_shape: tuple[int, ...],
                                                    w_shape: tuple[int, ...],
                                                    attrs: dict[str, Any]) -> None:
    rng = np.random.default_rng(11)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    full = {**attrs, "activation": "clip", "activation_params": (0.0, 6.0)}
    one = _band(x, w, b, None, full)
    for threads in (2, 3):
        assert np.array_equal(_band(x, w, b, None, full, threads=threads), one)
    assert np.array_equal(_band(x, w, b, None, full, nt=True), one)
    assert np.array_equal(_band(x, w, b, None, full, threads=2, nt=True), one)


def test_nan_and_inf_propagate_like_thereference() -> None:
    rng = np.random.default_rng(5)
    x, w, b = rand(rng, 2, 3, 21, 37), rand(rng, 8, 3, 3, 3), rand(rng, 8)
    x[0, 1, 0, 0] = np.nan
    x[1, 2, 4, 36] = np.inf
    x[1, 0, 20, 17] = -np.inf
    attrs = {"pads": (1, 1, 1, 1), "strides": (2, 2)}
    np.testing.assert_allclose(_band(x, w, b, None, attrs), reference([x, w, b], attrs),
                               rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("x_shape,w_shape,attrs,chosen", [
    ((2, 3, 224, 224), (32, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, True),
    ((1, 3, 224, 224), (32, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, True),
    ((2, 3, 224, 224), (64, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, False),
    ((2, 3, 64, 64), (32, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, False),
    ((2, 3, 224, 224), (32, 3, 3, 3), {"pads": (1, 1, 1, 1)}, False),   # stride 1
    ((2, 6, 224, 224), (6, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2),
                                      "group": 2}, False),
])
def test_choice(x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any],
                chosen: bool) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    grid = ng.geometry()
    expect = chosen and grid is not None and grid[1] == 32     # measured with AVX-512
    assert (cpu_planner.native_form(geo)[0] == "band") is expect
    assert cpu_planner.native_layout(geo).band is expect


def test_through_the_prepared_kernel_with_a_new_x_each_run() -> None:
    """The conv node's steady state: the band call reads X where it lies, so a model
    input (a new array every run) rebinds it."""
    rng = np.random.default_rng(9)
    w, b = rand(rng, 16, 3, 3, 3), rand(rng, 16)
    w.setflags(write=False)
    b.setflags(write=False)
    attrs = {"pads": (1, 1, 1, 1), "strides": (2, 2)}
    full = {"group": 1, "dilations": (1, 1), **attrs, "activation": "clip",
            "activation_params": (0.0, 6.0)}
    kernel = TABLE.get(Op.CONV, "native")
    assert kernel.prepack is not None
    state = kernel.prepack(KernelContext(np, "cpu", "cpu", 1, None), [None, w, b], full)
    # The node's plan says band (the planner would not, for this small image): the
    # kernel runs what the plan says.
    band = NodePlan("native", layout="band", reasons=(("layout", "band: asked for"),))
    y = None
    for threads in (1, 1, 2, 1):
        ctx = KernelContext(np, "cpu", "cpu", threads, state, band)
        x = rand(rng, 2, 3, 18, 22)
        expect = np.clip(reference([x, w, b], attrs), 0.0, 6.0)
        if y is None:
            y = np.empty(expect.shape, np.float32)
        (got,) = kernel.fn(ctx, [x, w, b], full, [y])
        assert got is y
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)
    assert any(getattr(r, "rebind", False) for r in state.ready.values())


@pytest.mark.parametrize("x_shape", [(1, 3, 9, 7), (2, 3, 20, 20), (1, 2, 11, 33),
                                     (1, 3, 6, 64), (1, 3, 12, 70)])
def test_three_taps_at_once_give_the_bits_of_one_tap_at_a_time(
        x_shape: tuple[int, ...]) -> None:
    """A stride-2 3-wide kernel padded by one on the left builds a kernel row's three taps
    from one split of X's row (band_row3); X with that padding column written out (pads
    0 on the left) takes them one at a time (band_row): the same B, the same bits."""
    rng = np.random.default_rng(3)
    x, w, b = rand(rng, *x_shape), rand(rng, 16, x_shape[1], 3, 3), rand(rng, 16)
    x[0, 0, 1, -1] = np.nan
    padded = np.zeros((*x_shape[:3], x_shape[3] + 1), np.float32)
    padded[..., 1:] = x
    split = {"pads": (1, 1, 1, 1), "strides": (2, 2), "activation": "clip",
             "activation_params": (0.0, 6.0)}
    one_by_one = {**split, "pads": (1, 0, 1, 1)}
    expect = _band(padded, w, b, None, one_by_one)
    for threads in (1, 2, 3, 16):
        np.testing.assert_array_equal(_band(x, w, b, None, split, threads=threads), expect)
