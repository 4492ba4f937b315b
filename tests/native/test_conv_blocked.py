"""The channel-blocked direct 3x3 conv (native_blocked, blocked.c): 16 output channels a
vector, X read in place, the border's zeros multiplied as a padded copy would give them.
Checked against the reference backend (bias / residual / ReLU / clip, NaN and inf), for
the masked form's bits, for the same bits on 1, 2, 3 and 16 threads, through a loaded
model, and for the cpu planner's choice of it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import keel
from keel import native
from keel.backends.cpu import conv_gemm, native_blocked
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_epilogue import activation
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry
from tests.native._conv_support import check_against_reference, rand, reference


@pytest.fixture(autouse=True)
def _blocked_kernel() -> None:
    if not native_blocked.available():
        pytest.skip(f"blocked conv unavailable (AVX-512 builds only): {native.status().reason}")


PADDED = {"pads": (1, 1, 1, 1)}
CASES = [
    # X, W: rows of 8, 16, 24 and 32 pixels (bands of 2 rows on rows of 8 and 24), one
    # and two blocks a tile, a single input channel
    ((2, 16, 32, 32), (16, 16, 3, 3)),
    ((1, 32, 16, 16), (32, 32, 3, 3)),
    ((3, 64, 8, 8), (64, 64, 3, 3)),
    ((2, 5, 8, 24), (48, 5, 3, 3)),
    ((1, 1, 4, 8), (16, 1, 3, 3)),
    ((2, 3, 2, 40), (32, 3, 3, 3)),
]


def _blocked(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any],
             threads: int = 1) -> np.ndarray:
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm.native_layout(geo, "blocked")
    assert layout.blocked
    y = np.empty((geo.batch, geo.out_channels, *geo.window.out_spatial), np.float32)
    act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    assert conv_gemm.native(np, layout, x, w, b, z, y, act, None, threads)
    return y


def _masked(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any]
            ) -> np.ndarray:
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    y = np.empty((geo.batch, geo.out_channels, *geo.window.out_spatial), np.float32)
    act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    assert conv_gemm.native(np, conv_gemm.native_layout(geo, "masked"), x, w, b, z, y, act,
                            None, 1)
    return y


@pytest.mark.parametrize("x_shape,w_shape", CASES)
@pytest.mark.parametrize("act,params", [("", ()), ("relu", ()), ("clip", (-0.3, 0.4))])
def test_blocked_matches_the_reference(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                       act: str, params: tuple[float, ...]) -> None:
    check_against_reference(_blocked, x_shape, w_shape, PADDED, act, params)


@pytest.mark.parametrize("x_shape,w_shape", CASES)
def test_the_masked_forms_bits_on_every_thread_count(x_shape: tuple[int, ...],
                                                     w_shape: tuple[int, ...]) -> None:
    """Each element is the masked tiles' chain of multiply-adds (c, kh, kw from 0, then
    bias, residual, clip): the same bits, whatever the split over threads."""
    rng = np.random.default_rng(4)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    z = rand(rng, x_shape[0], w_shape[0], *x_shape[2:])
    attrs = {**PADDED, "activation": "clip", "activation_params": (-0.5, 0.5)}
    masked = _masked(x, w, b, z, attrs)
    for threads in (1, 2, 3, 16):
        assert np.array_equal(_blocked(x, w, b, z, attrs, threads), masked)


def test_nan_and_inf_propagate_like_the_reference() -> None:
    """An inf filter tap times the border's zeros is NaN, as in a zero-padded conv."""
    rng = np.random.default_rng(5)
    x, w, b = rand(rng, 2, 3, 4, 8), rand(rng, 16, 3, 3, 3), rand(rng, 16)
    x[0, 1, 0, 0] = np.nan
    x[1, 2, 3, 7] = np.inf
    w[3, 0, 0, 0] = np.inf           # reads the row above and the pixel left of the image
    w[7, 2, 2, 2] = -np.inf          # the row below and the pixel right of it
    np.testing.assert_allclose(_blocked(x, w, b, None, PADDED), reference([x, w, b], PADDED),
                               rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 16, 16, 16), (32, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((1, 16, 16, 16), (16, 16, 3, 3), {}),                          # unpadded
    ((1, 16, 16, 16), (16, 16, 3, 3), {"pads": (1, 1, 1, 1), "dilations": (2, 2)}),
    ((1, 16, 16, 16), (20, 16, 3, 3), PADDED),                      # not whole blocks
    ((1, 16, 12, 12), (16, 16, 3, 3), PADDED),                      # rows of 12 pixels
    ((1, 16, 7, 8), (16, 16, 3, 3), PADDED),                        # odd rows of 8
    ((1, 16, 16, 16), (16, 16, 5, 5), {"pads": (2, 2, 2, 2)}),
    ((1, 16, 16, 16), (16, 8, 3, 3), {"pads": (1, 1, 1, 1), "group": 2}),
])
def test_not_served(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                    attrs: dict[str, Any]) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    assert not conv_gemm.blocked_serves(geo)
    assert not conv_gemm.native_layout(geo, "blocked").blocked
    assert cpu_planner.native_form(geo, (8, 32), "Intel")[0] != "blocked"


@pytest.mark.parametrize("x_shape,w_shape,grid,vendor,chosen", [
    ((1, 16, 32, 32), (16, 16, 3, 3), (8, 32), "Intel", True),
    ((32, 32, 16, 16), (32, 32, 3, 3), (8, 32), "Intel", True),
    ((1, 64, 8, 8), (64, 64, 3, 3), (8, 32), "Intel", True),
    ((1, 3, 32, 32), (16, 3, 3, 3), (8, 32), "Intel", False),      # a stem: not measured
    ((1, 16, 32, 32), (16, 16, 3, 3), (8, 32), "AMD", False),      # masked measured there
    ((1, 16, 32, 32), (16, 16, 3, 3), (6, 16), "Intel", False),    # no AVX-512 kernel
])
def test_the_planner_chooses_it_where_measured(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], grid: tuple[int, int],
        vendor: str, chosen: bool) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, PADDED)
    form, why = cpu_planner.native_form(geo, grid, vendor)
    assert (form == "blocked") is chosen
    if chosen:
        assert "BLOCKED_VENDORS" in why and f"{geo.in_channels} >= 16 input channels" in why


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_the_split_is_the_planners(threads: int) -> None:
    """The call chunks its bands as the plan's split says (whole bands, images after one
    another), the least flops of a split that wide each."""
    geo = conv_geometry(Op.CONV, (2, 16, 32, 32), (16, 16, 3, 3), PADDED)
    (split,) = cpu_planner.conv_splits("native", "blocked", None, geo, threads)
    assert split.units == 2 * 32
    assert split.pieces == cpu_planner.blocked_parts(geo, threads) <= threads
    x = np.zeros((2, 16, 32, 32), np.float32)
    y = np.empty_like(x)
    filters = native_blocked.pack_filters(np.zeros((16, 16, 3, 3), np.float32))
    call = native_blocked.prepare(x, filters, y, 1, 1,
                                  lambda t: cpu_planner.blocked_parts(geo, t))
    assert call is not None and call.parts(threads) == split.pieces


def test_a_model_runs_it_with_each_runs_x() -> None:
    """Through a loaded model on two threads: the plan says blocked, and the prepared
    call reads each run's X where it lies (a new input array every run)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(9)
    w, b = rand(rng, 32, 16, 3, 3), rand(rng, 32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])], "blocked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32, 8, 16])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = keel.load_model(onnx_model.SerializeToString(), backend="cpu", threads=2,
                            plan_cache=False)
    assert "layout: blocked" in str(model.explain())
    for _ in range(3):
        x = rand(rng, 2, 16, 8, 16)
        got = np.asarray(model.predict({"x": x})["y"])
        np.testing.assert_allclose(got, np.maximum(reference([x, w, b], PADDED), 0),
                                   rtol=1e-4, atol=1e-4)
