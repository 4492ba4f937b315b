"""The channel-blocked direct conv (native_blocked, blocked.c; 3x3 padded by one or 1x1,
stride 1 or 2): 16 output channels a vector, X read in place, the border's zeros
multiplied as a padded copy would give them, X, Y and the residual each NCHW or blocked
([N][C/16][H][W][16]). Checked against the reference backend (bias / residual / ReLU /
clip, NaN and inf), for the masked form's bits (3x3 stride 1) or one result (strided and
1x1) in every combination of layouts and on 1, 2, 3 and 16 threads, and for the cpu
planner's rule (blocked_conv) and split."""

from __future__ import annotations

import functools
import gc
import itertools
import threading
import weakref
from typing import Any

import numpy as np
import pytest

from keel import config, native
from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import conv_gemm, native_blocked, native_gemm, thread_costs
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_epilogue import activation
from keel.backends.cpu.kernels import load as load_cpu
from keel.backends.plan import NodePlan
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
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
    # one image of 4 bands: the split cuts the output channels too (2 and 4 groups)
    ((1, 64, 8, 8), (64, 64, 3, 3)),
    ((1, 32, 8, 8), (128, 32, 3, 3)),
    # rows that are not whole 8-pixel tiles (a tail tile of 1 to 7 pixels, a band's last
    # run short of 16 through lane masks): 7, 14, 15 and 28 wide, two blocks a tile too
    ((1, 32, 7, 7), (32, 32, 3, 3)),
    ((2, 16, 14, 14), (16, 16, 3, 3)),
    ((1, 16, 15, 15), (48, 16, 3, 3)),
    ((1, 16, 6, 28), (32, 16, 3, 3)),
    ((1, 3, 5, 3), (16, 3, 3, 3)),
    # two-block tails of 1, 2, 3 and 5 pixels (rows of 9, 10, 11 and 13)
    ((1, 16, 3, 9), (32, 16, 3, 3)),
    ((1, 16, 3, 10), (32, 16, 3, 3)),
    ((1, 16, 3, 11), (32, 16, 3, 3)),
    ((1, 16, 3, 13), (32, 16, 3, 3)),
]


def _blocked(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any],
             threads: int = 1, sides: native_blocked.Sides = native_blocked.NCHW_SIDES
             ) -> np.ndarray:
    """The blocked conv of NCHW arrays, X, Y and Z moved into the layouts of ``sides``
    for the kernel and Y's result given back in NCHW."""
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    form = (f"{'nchwc16' if sides.x else 'nchw'}->{'nchwc16' if sides.y else 'nchw'}")
    layout = conv_gemm.native_layout(geo, form, blocked_residual=sides.residual)
    assert layout.blocked and layout.sides == sides
    y = np.empty((geo.batch, geo.out_channels, *geo.window.out_spatial), np.float32)
    act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    x = native_blocked.to_blocked(x) if sides.x else x
    z = native_blocked.to_blocked(z) if sides.residual and z is not None else z
    assert conv_gemm.native(np, layout, x, w, b, z, y, act, None, threads)
    return native_blocked.to_nchw(y) if sides.y else y


EVERY_SIDES = [native_blocked.Sides(*flags) for flags in itertools.product((False, True),
                                                                           repeat=3)]


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
    bias, residual, clip): the same bits in every layout of X, Y and the residual (X
    blocked only with whole blocks of channels), whatever the split over threads."""
    rng = np.random.default_rng(4)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    z = rand(rng, x_shape[0], w_shape[0], *x_shape[2:])
    attrs = {**PADDED, "activation": "clip", "activation_params": (-0.5, 0.5)}
    _the_same_bits_everywhere(x, w, b, z, attrs, _masked(x, w, b, z, attrs))


def _the_same_bits_everywhere(x: np.ndarray, w: np.ndarray, b: np.ndarray, z: np.ndarray,
                              attrs: dict[str, Any], want: np.ndarray) -> None:
    """The blocked conv gives ``want`` in every layout of X, Y and the residual (X
    blocked only with whole blocks of channels) on 1, 2, 3 and 16 threads."""
    for sides in EVERY_SIDES:
        if sides.x and x.shape[1] % 16:
            continue
        for threads in (1, 2, 3, 16):
            assert np.array_equal(_blocked(x, w, b, z, attrs, threads, sides), want), sides


S2 = {"pads": (1, 1, 1, 1), "strides": (2, 2)}
STRIDED = [
    # X, W, attrs: ResNet's downsampling 3x3 and 1x1 convs (16 x 16 and 8 x 8 out), odd
    # input sizes (the last row and column's taps read the border), 1x1 at stride 1
    ((2, 16, 32, 32), (32, 16, 3, 3), S2),
    ((1, 32, 16, 16), (64, 32, 3, 3), S2),
    ((2, 5, 15, 31), (16, 5, 3, 3), S2),
    ((2, 16, 32, 32), (32, 16, 1, 1), {"strides": (2, 2)}),
    ((1, 32, 16, 16), (64, 32, 1, 1), {"strides": (2, 2)}),
    ((1, 3, 15, 15), (16, 3, 1, 1), {"strides": (2, 2)}),
    ((2, 16, 8, 16), (48, 16, 1, 1), {}),
    # ResNet-18's downsampling rows (28, 14 and 7 pixels out) and 15 out of 29 and 30 in
    ((1, 16, 56, 56), (32, 16, 3, 3), S2),
    ((2, 32, 28, 28), (32, 32, 3, 3), S2),
    ((1, 32, 14, 14), (64, 32, 3, 3), S2),
    ((1, 16, 29, 30), (16, 16, 3, 3), S2),
    ((1, 16, 56, 56), (32, 16, 1, 1), {"strides": (2, 2)}),
    ((2, 32, 14, 14), (64, 32, 1, 1), {"strides": (2, 2)}),
    ((1, 16, 29, 29), (16, 16, 1, 1), {"strides": (2, 2)}),
    # two-block tails at stride 2 (9, 11 and 13 out) and of a 1x1 at stride 1 (5 and 3)
    ((1, 16, 18, 18), (32, 16, 3, 3), S2),
    ((1, 16, 21, 22), (32, 16, 3, 3), S2),
    ((1, 16, 26, 25), (32, 16, 1, 1), {"strides": (2, 2)}),
    ((1, 16, 4, 13), (32, 16, 1, 1), {}),
    ((1, 16, 4, 11), (64, 16, 1, 1), {}),
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", STRIDED)
@pytest.mark.parametrize("act,params", [("", ()), ("relu", ()), ("clip", (-0.3, 0.4))])
def test_strided_and_1x1_match_the_reference(x_shape: tuple[int, ...],
                                             w_shape: tuple[int, ...],
                                             attrs: dict[str, Any], act: str,
                                             params: tuple[float, ...]) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    assert conv_gemm.blocked_serves(geo)
    check_against_reference(_blocked, x_shape, w_shape, attrs, act, params)


@pytest.mark.parametrize("x_shape,w_shape,attrs", STRIDED)
def test_strided_and_1x1_the_same_bits_in_every_layout_and_split(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any]) -> None:
    """Each element is one chain (c, kh, kw from 0, then bias, residual, clip) whatever
    the layouts of X, Y and the residual and the split over threads."""
    rng = np.random.default_rng(10)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    z = rand(rng, *geo.out_shape)
    attrs = {**attrs, "activation": "clip", "activation_params": (-0.5, 0.5)}
    _the_same_bits_everywhere(x, w, b, z, attrs, _blocked(x, w, b, z, attrs))


@pytest.mark.parametrize("x_shape,m", [
    ((1, 16, 56, 56), 32), ((2, 32, 28, 28), 32), ((1, 16, 55, 55), 32),   # 28, 14, 28 out
    ((1, 16, 27, 27), 64)])
@pytest.mark.parametrize("x_blocked", [False, True])
def test_wide_tiles_give_the_bits_of_the_narrow_ones(x_shape: tuple[int, ...], m: int,
                                                     x_blocked: bool) -> None:
    """2 x 14-pixel tiles sum each output's taps in the order 8-pixel tiles and their
    tail do, so the bits are theirs (odd inputs: the right column's taps in the image)."""
    rng = np.random.default_rng(12)
    x, w = rand(rng, *x_shape), rand(rng, m, x_shape[1], 3, 3)
    geo = conv_geometry(Op.CONV, x.shape, w.shape, S2)
    assert cpu_planner.blocked_wide(geo)
    x = native_blocked.to_blocked(x) if x_blocked else x
    got = []
    for wide in (False, True):
        y = np.empty(geo.out_shape, np.float32)
        call = native_blocked.prepare(x, native_blocked.pack_filters(w), y, 2, 1,
                                      lambda threads: (1, threads), stride=2,
                                      bias=rand(np.random.default_rng(3), m),
                                      sides=native_blocked.Sides(x=x_blocked), wide=wide)
        assert call is not None
        call.run(1)
        got.append(y)
    assert np.array_equal(*got)


@pytest.mark.parametrize("x_shape,w_shape,attrs,wide", [
    ((1, 64, 56, 56), (128, 64, 3, 3), S2, True),      # 28-pixel rows
    ((1, 128, 28, 28), (256, 128, 3, 3), S2, True),    # 14
    ((1, 256, 14, 14), (512, 256, 3, 3), S2, False),   # 7: one tail tile a row already
    ((1, 16, 64, 64), (32, 16, 3, 3), S2, False),      # 32: whole 8-pixel tiles
    ((1, 16, 56, 56), (16, 16, 3, 3), S2, False),      # one block a tile
    ((1, 16, 28, 28), (32, 16, 3, 3), PADDED, False),  # stride 1
    ((1, 16, 56, 56), (32, 16, 1, 1), {"strides": (2, 2)}, False),
])
def test_the_planners_wide_tile_rule(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                     attrs: dict[str, Any], wide: bool) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    assert cpu_planner.blocked_wide(geo) is wide
    variant = dict((k, why) for k, _, why in cpu_planner._blocked_fields(geo, 1))["variant"]
    assert ("2 x 14-pixel register tiles" in variant) is wide


@pytest.mark.parametrize("sides", [s for s in EVERY_SIDES if s.y == s.residual])
def test_a_residual_in_y_itself(sides: native_blocked.Sides) -> None:
    """Y may be its residual's own array where both have one layout (the arena's reuse):
    each element's residual is read before it is written."""
    rng = np.random.default_rng(6)
    x, w, b = rand(rng, 2, 32, 8, 16), rand(rng, 32, 32, 3, 3), rand(rng, 32)
    z = rand(rng, 2, 32, 8, 16)
    want = _masked(x, w, b, z, PADDED)
    geo = conv_geometry(Op.CONV, x.shape, w.shape, PADDED)
    form = f"{'nchwc16' if sides.x else 'nchw'}->{'nchwc16' if sides.y else 'nchw'}"
    layout = conv_gemm.native_layout(geo, form, blocked_residual=sides.residual)
    y = native_blocked.to_blocked(z) if sides.y else z.copy()
    xs = native_blocked.to_blocked(x) if sides.x else x
    assert conv_gemm.native(np, layout, xs, w, b, y, y, activation("", ()), None, 2)
    assert np.array_equal(native_blocked.to_nchw(y) if sides.y else y, want)


def test_the_layout_changes_round_trip() -> None:
    rng = np.random.default_rng(7)
    x = rand(rng, 2, 32, 3, 5)
    blocked = native_blocked.to_blocked(x)
    assert blocked.shape == x.shape
    assert blocked.reshape(2, 2, 3, 5, 16)[1, 0, 2, 4, 7] == x[1, 7, 2, 4]
    assert np.array_equal(native_blocked.to_nchw(blocked), x)


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
    ((1, 16, 24, 24), (32, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (3, 3)}),
    ((1, 16, 16, 16), (32, 16, 1, 1), {"pads": (1, 1, 1, 1)}),     # a padded 1x1
    ((1, 16, 16, 16), (32, 16, 1, 1), {"strides": (2, 1)}),
    ((1, 16, 16, 16), (16, 16, 3, 3), {}),                          # unpadded
    ((1, 16, 16, 16), (16, 16, 3, 3), {"pads": (1, 1, 1, 1), "dilations": (2, 2)}),
    ((1, 16, 16, 16), (20, 16, 3, 3), PADDED),                      # not whole blocks
    ((1, 16, 16, 16), (16, 16, 5, 5), {"pads": (2, 2, 2, 2)}),
    ((1, 16, 16, 16), (16, 8, 3, 3), {"pads": (1, 1, 1, 1), "group": 2}),
])
def test_not_served(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                    attrs: dict[str, Any]) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    assert not conv_gemm.blocked_serves(geo)
    assert not cpu_planner.blocked_conv(geo, (8, 32), "Intel")
    layout = conv_gemm.native_layout(geo, "nchwc16->nchwc16")
    y = np.empty(geo.out_shape, np.float32)
    x = np.zeros(x_shape, np.float32)
    assert not conv_gemm.native(np, layout, x, np.zeros(w_shape, np.float32), None, None, y,
                                activation("", ()), None, 1)


@pytest.mark.parametrize("x_shape,w_shape,grid,vendor,chosen", [
    ((1, 16, 32, 32), (16, 16, 3, 3), (8, 32), "Intel", True),
    ((32, 32, 16, 16), (32, 32, 3, 3), (8, 32), "Intel", True),
    ((1, 64, 8, 8), (64, 64, 3, 3), (8, 32), "Intel", True),
    ((1, 3, 32, 32), (16, 3, 3, 3), (8, 32), "Intel", False),      # a stem: not measured
    ((1, 24, 32, 32), (16, 24, 3, 3), (8, 32), "Intel", False),    # not whole blocks in
    ((1, 16, 32, 32), (16, 16, 3, 3), (8, 32), "AMD", False),      # masked measured there
    ((1, 16, 32, 32), (16, 16, 3, 3), (6, 16), "Intel", False),    # no AVX-512 kernel
])
def test_the_planners_rule(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                           grid: tuple[int, int], vendor: str, chosen: bool) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, PADDED)
    assert cpu_planner.blocked_conv(geo, grid, vendor) is chosen
    # only in a region: a conv planned alone keeps an NCHW form
    assert cpu_planner.native_form(geo, grid, vendor)[0] not in native_blocked.REGION_LAYOUTS


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_the_split_is_the_planners(threads: int) -> None:
    """The call chunks its units as the plan's split says (whole bands of one channel
    group, images after one another), the least flops of a split that wide each."""
    geo = conv_geometry(Op.CONV, (2, 16, 32, 32), (16, 16, 3, 3), PADDED)
    (split,) = cpu_planner.conv_splits("native", "nchwc16->nchwc16", None, geo, threads)
    assert split.units == 2 * 32
    assert split.pieces == cpu_planner.blocked_parts(geo, threads) <= threads
    x = np.zeros((2, 16, 32, 32), np.float32)
    y = np.empty_like(x)
    filters = native_blocked.pack_filters(np.zeros((16, 16, 3, 3), np.float32))
    call = native_blocked.prepare(x, filters, y, 1, 1,
                                  lambda t: cpu_planner.blocked_split(geo, t).pair)
    assert call is not None and call.split(threads) == (1, split.pieces)


@pytest.mark.parametrize("x_shape,w_shape,threads,grid", [
    # (groups, chunks): bands alone on one and two threads, as before channel groups
    ((1, 64, 8, 8), (64, 64, 3, 3), 2, (1, 2)),
    ((1, 64, 65, 16), (64, 64, 3, 3), 2, (1, 2)),     # 33 of 65 bands: within the slack
    ((1, 64, 8, 8), (64, 64, 3, 3), 3, (2, 3)),       # 8 units in 3: 3 of 8, not 2 of 4
    ((1, 64, 8, 8), (64, 64, 3, 3), 16, (2, 8)),      # both register tiles, every band
    ((1, 32, 8, 8), (128, 32, 3, 3), 16, (4, 16)),    # 4 tiles x 4 bands
    ((32, 64, 8, 8), (64, 64, 3, 3), 16, (1, 16)),    # 128 bands are enough
    ((1, 32, 16, 16), (32, 32, 3, 3), 16, (1, 16)),
])
def test_the_planner_cuts_output_channels_where_bands_are_too_few(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], threads: int,
        grid: tuple[int, int]) -> None:
    """blocked_split's grid: the least work on the busiest thread, then the fewest
    channel groups; the plan's split counts the grid's units."""
    geo = conv_geometry(Op.CONV, x_shape, w_shape, PADDED)
    split = cpu_planner.blocked_split(geo, threads)
    assert split.pair == grid
    assert f"x {grid[0]} group(s)" in split.reason
    (plan,) = cpu_planner.conv_splits("native", "nchwc16->nchwc16", None, geo, threads)
    assert (plan.units, plan.pieces) == (split.units, split.parts)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_every_grid_gives_the_same_bits(groups: int) -> None:
    """Any channel groups (whole register tiles) and chunks: the bits of one thread."""
    rng = np.random.default_rng(9)
    x, w, b = rand(rng, 2, 32, 8, 8), rand(rng, 128, 32, 3, 3), rand(rng, 128)
    z = rand(rng, 2, 128, 8, 8)
    want = _masked(x, w, b, z, PADDED)
    filters = native_blocked.pack_filters(w)
    for parts in (1, 2, 3, 5, 2 * 4 * groups):
        y = np.full((2, 128, 8, 8), np.nan, np.float32)
        call = native_blocked.prepare(x, filters, y, 2, 2, lambda t, p=parts: (groups, p),
                                      bias=b, residual=z)
        assert call is not None
        call.run(parts)
        assert np.array_equal(y, want), (groups, parts)


def test_an_unbound_run_binds_again_only_when_its_threads_or_thread_change() -> None:
    """run() binds on its first run for a thread count and calling thread and calls that
    from then on: the split is asked again only when either changes, not every run, and
    every run gives the bits of the masked form."""
    rng = np.random.default_rng(4)
    x, w, b = rand(rng, 1, 32, 8, 8), rand(rng, 64, 32, 3, 3), rand(rng, 64)
    want = _masked(x, w, b, None, PADDED)
    asked: list[int] = []

    def split(threads: int) -> tuple[int, int]:
        asked.append(threads)
        return (1, threads)

    y = np.full((1, 64, 8, 8), np.nan, np.float32)
    call = native_blocked.prepare(x, native_blocked.pack_filters(w), y, 2, 2, split, bias=b)
    assert call is not None
    for threads in (1, 1, 2, 2, 1):
        y[...] = np.nan
        call.run(threads)
        assert np.array_equal(y, want), threads
    assert asked == [1, 2, 1]
    worker = threading.Thread(target=call.run, args=(1,))
    worker.start()
    worker.join()
    assert asked == [1, 2, 1, 1]            # another thread binds to its own workspace
    assert np.array_equal(y, want)


def test_a_run_call_frees_its_operands_without_the_cyclic_collector() -> None:
    """What run() keeps of its bound form does not keep the call: with the cyclic
    collector off, dropping the call frees its residual (and filters and bias) at once,
    on one thread (this thread's workspace) and on two."""
    rng = np.random.default_rng(6)
    x, w, b = rand(rng, 1, 32, 8, 8), rand(rng, 64, 32, 3, 3), rand(rng, 64)
    y = np.empty((1, 64, 8, 8), np.float32)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for threads in (1, 2):
            z = rand(rng, 1, 64, 8, 8)
            call = native_blocked.prepare(x, native_blocked.pack_filters(w), y, 2, 2,
                                          lambda t: (1, t), bias=b, residual=z)
            assert call is not None
            call.run(threads)
            assert np.array_equal(y, _masked(x, w, b, z, PADDED))
            held = weakref.ref(z)
            del call, z
            assert held() is None, threads
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("bound", [False, True])
def test_a_run_binds_again_when_the_thread_costs_change(
        bound: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's split reads this process's thread costs: once they change (measured,
    refreshed or forgotten), run() -- and the call bound for a program's step -- asks the
    split again for the same threads and thread and runs the new grid, with the same
    bits."""
    def clear() -> None:
        if thread_costs.path_here().exists():
            thread_costs.path_here().unlink()
        thread_costs.forget()
        cpu_planner.forget()

    monkeypatch.setenv("KEEL_THREAD_COSTS", "auto")
    config.reload_settings()
    clear()
    try:
        geo = conv_geometry(Op.CONV, (1, 64, 8, 8), (64, 64, 3, 3), PADDED)
        rng = np.random.default_rng(5)
        x, w = rand(rng, 1, 64, 8, 8), rand(rng, 64, 64, 3, 3)
        want = _masked(x, w, None, None, PADDED)
        grids: list[tuple[int, int]] = []

        def split(threads: int) -> tuple[int, int]:
            grids.append(cpu_planner.blocked_split(geo, threads).pair)
            return grids[-1]

        y = np.full((1, 64, 8, 8), np.nan, np.float32)
        call = native_blocked.prepare(x, native_blocked.pack_filters(w), y, 2, 2, split)
        assert call is not None
        go = call.bound(2) if bound else functools.partial(call.run, 2)
        go()
        go()
        assert grids == [(1, 2)]                    # the declared costs: 2 chunks
        # A pool 16 times slower to dispatch on 2 threads: 16 times the least flops, more
        # than the conv's 4.7 million, so one chunk.
        dispatch = cpu_planner.THREAD_COST_REFERENCE_DISPATCH_US * 16
        thread_costs.save(thread_costs.ThreadCosts(
            ((2, thread_costs.Sample(dispatch, dispatch, dispatch, 9)),),
            tuple((f, thread_costs.Sample(rate, rate, rate, 9))
                  for f, rate in cpu_planner.THREAD_COST_REFERENCE_RATES.items()),
            "a test machine", 2, 0.1))
        thread_costs.forget()
        y[...] = np.nan
        go()
        assert grids == [(1, 2), (1, 1)]
        assert np.array_equal(y, want)
    finally:
        monkeypatch.undo()
        config.reload_settings()
        clear()


def test_groups_that_are_not_whole_tiles_are_refused() -> None:
    x = np.zeros((1, 16, 8, 8), np.float32)
    y = np.empty((1, 64, 8, 8), np.float32)
    filters = native_blocked.pack_filters(np.zeros((64, 16, 3, 3), np.float32))
    call = native_blocked.prepare(x, filters, y, 2, 2, lambda t: (3, 1))
    assert call is not None
    with pytest.raises(InvalidArgumentError, match=r"3 channel group\(s\) of 2 register tiles"):
        call.run(1)


@pytest.mark.parametrize("layout", ["nchwc16->nchwc16", "nchw->nchwc16", "nchwc16->nchw"])
def test_a_region_conv_the_kernel_does_not_serve_runs_between_layout_changes(
        layout: str) -> None:
    """A dilated conv is not served: the conv node planned inside a region runs the NCHW
    im2col between layout changes, reading and writing the layouts its plan names (and
    its blocked residual)."""
    rng = np.random.default_rng(8)
    x, w, b = rand(rng, 2, 16, 12, 12), rand(rng, 16, 16, 3, 3), rand(rng, 16)
    z = rand(rng, 2, 16, 12, 12)
    dilated = {"pads": (2, 2, 2, 2), "dilations": (2, 2)}
    assert not conv_gemm.blocked_serves(conv_geometry(Op.CONV, x.shape, w.shape, dilated))
    attrs = {**dilated, "activation": "relu"}
    src, _, dst = layout.partition("->")
    plan = NodePlan(variant="native", layout=layout, threads=2,
                    options=(("residual_layout", "nchwc16"),))
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, threads=2, plan=plan)
    kernel = load_cpu().get(Op.CONV, "native")
    norm = get_schema(Op.CONV).normalize_attrs(attrs)
    xs = native_blocked.to_blocked(x) if src == "nchwc16" else x
    (y,) = kernel.fn(ctx, [xs, w, b, native_blocked.to_blocked(z)], norm, None)
    got = native_blocked.to_nchw(np.asarray(y)) if dst == "nchwc16" else np.asarray(y)
    np.testing.assert_allclose(got, np.maximum(reference([x, w, b], dilated) + z, 0),
                               rtol=1e-4, atol=1e-4)


def test_the_flags_are_checked_by_name_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = native.library("blocked")
    assert lib is not None
    native_gemm.check_enums(lib, "keel_conv_blocked_flags", native_blocked._FLAGS,
                            "native_blocked")
    swapped = {**native_blocked._FLAGS, "BLOCKED_X": 8, "BLOCKED_Y": 4}
    with pytest.raises(native_gemm.ArgsLayoutError, match="keel_conv_blocked_flags"):
        native_gemm.check_enums(lib, "keel_conv_blocked_flags", swapped, "native_blocked")
