"""The masked layout of the native implicit-GEMM conv (conv_gemm.Masked, gemm.c's
KEEL_DIRECT): taps read in place from X (or its unbordered stride phases) by loads whose
lanes outside the plane are masked off. Checked against the reference backend on random
inputs (pads, strides, dilations, groups, kernel sizes, every remainder of the tile's
rows and columns, bias / residual / clip / ReLU, NaN), through the conv kernel's
prepared path, and for bitwise equality between 1 and 2 threads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import keel.backends.cpu.conv  # noqa: F401  (registers the conv kernels on TABLE)
from keel.backends.base import KernelContext
from keel.backends.cpu import conv_gemm
from keel.backends.cpu import native_gemm as ng
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_epilogue import activation
from keel.backends.cpu.kernels import TABLE
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry
from tests.native._conv_support import (
    check_against_reference,
    check_residual_in_place,
    rand,
    reference,
    run_layout,
)

pytestmark = pytest.mark.usefixtures("native_gemm_tier")


CASES = [
    # X, W, attrs
    ((2, 3, 8, 8), (16, 3, 3, 3), {"pads": (1, 1, 1, 1)}),
    ((3, 16, 32, 32), (16, 16, 3, 3), {"pads": (1, 1, 1, 1)}),          # whole panels
    ((2, 5, 7, 7), (9, 5, 3, 3), {"pads": (1, 1, 1, 1)}),                # 49 columns, 9 rows
    ((1, 4, 5, 3), (17, 4, 3, 3), {"pads": (1, 1, 1, 1)}),               # 15 columns, 17 rows
    ((2, 3, 6, 11), (7, 3, 3, 3), {"pads": (1, 1, 1, 1)}),               # 66 columns
    ((2, 4, 11, 9), (6, 4, 3, 3), {"pads": (2, 2, 2, 2), "dilations": (2, 2)}),
    ((2, 6, 9, 9), (4, 3, 3, 3), {"pads": (1, 1, 1, 1), "group": 2}),
    ((1, 2, 1, 1), (3, 2, 3, 3), {"pads": (1, 1, 1, 1)}),                # 1-pixel image
    ((2, 3, 10, 10), (7, 3, 5, 5), {"pads": (2, 2, 2, 2)}),
    ((2, 3, 9, 8), (5, 3, 3, 3), {"pads": (0, 1, 2, 1)}),                # uneven pads
    ((2, 16, 16, 16), (32, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((2, 5, 9, 7), (11, 5, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),  # odd sizes
    ((2, 3, 15, 15), (7, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((2, 3, 16, 16), (7, 3, 3, 3), {"pads": (0, 0, 1, 1), "strides": (2, 2)}),
    ((2, 8, 16, 16), (12, 8, 1, 1), {"strides": (2, 2)}),                # 1x1 stride 2
    ((1, 3, 13, 13), (8, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}),
    ((2, 4, 12, 12), (5, 4, 3, 3), {"pads": (1, 1, 1, 1), "strides": (3, 3)}),
]


def _masked(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any],
            threads: int = 1, y: np.ndarray | None = None) -> np.ndarray:
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm.native_layout(geo, "masked")
    assert layout.masked is not None
    return run_layout(layout, x, w, b, z, attrs, threads, y)


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
@pytest.mark.parametrize("act,params", [("", ()), ("relu", ()), ("clip", (-0.3, 0.4))])
def test_masked_matchesreference(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                  attrs: dict[str, Any], act: str,
                                  params: tuple[float, ...]) -> None:
    check_against_reference(_masked, x_shape, w_shape, attrs, act, params)


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
def test_residual_in_place(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                           attrs: dict[str, Any]) -> None:
    """Z is Y itself: the kernel adds the product to what Y holds."""
    check_residual_in_place(_masked, x_shape, w_shape, attrs)


@pytest.mark.parametrize("attrs", [{"pads": (1, 1, 1, 1)},
                                   {"pads": (1, 1, 1, 1), "strides": (2, 2)}])
def test_threads_bitwise_equal(attrs: dict[str, Any]) -> None:
    rng = np.random.default_rng(11)
    x, w, b = rand(rng, 3, 16, 16, 16), rand(rng, 40, 16, 3, 3), rand(rng, 40)
    one = _masked(x, w, b, None, attrs, threads=1)
    for threads in (2, 3):
        assert np.array_equal(_masked(x, w, b, None, attrs, threads=threads), one)
    single = _masked(x[:1], w, b, None, attrs, threads=2)     # split by row panels
    assert np.array_equal(single, one[:1])


def test_nan_propagates_like_thereference() -> None:
    rng = np.random.default_rng(5)
    x, w, b = rand(rng, 2, 3, 9, 9), rand(rng, 8, 3, 3, 3), rand(rng, 8)
    x[0, 1, 0, 0] = np.nan
    x[1, 2, 4, 8] = np.inf
    attrs = {"pads": (1, 1, 1, 1)}
    np.testing.assert_allclose(_masked(x, w, b, None, attrs), reference([x, w, b], attrs),
                               rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 1, 28, 28), (6, 1, 5, 5), {}),                              # output smaller than X
    ((2, 3, 6, 6), (5, 3, 1, 1), {"pads": (1, 1, 1, 1)}),            # output larger than X
    ((2, 3, 16, 16), (4, 3, 3, 3), {"strides": (2, 2)}),             # unpadded, stride 2
    ((1, 3, 4, 4, 4), (2, 3, 3, 3, 3), {"pads": (1, 1, 1, 1, 1, 1)}),  # 3-D
    ((1, 2, 12, 12), (2, 2, 9, 9), {"pads": (4, 4, 4, 4)}),          # 81 taps
])
def test_not_served(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                    attrs: dict[str, Any]) -> None:
    """Where a tap would read outside the planes what is not padding, or too many taps:
    the layout falls back to the gathered or wide one."""
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    assert conv_gemm.masked_layout(geo) is None
    assert cpu_planner.native_layout(geo).masked is None


@pytest.mark.parametrize("x_shape,w_shape,attrs,chosen", [
    ((32, 16, 32, 32), (16, 16, 3, 3), {"pads": (1, 1, 1, 1)}, True),
    ((32, 16, 32, 32), (32, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, True),
    ((32, 16, 32, 32), (32, 16, 1, 1), {"strides": (2, 2)}, True),
    ((32, 16, 32, 32), (32, 16, 1, 1), {}, False),                   # X is B as it lies
    ((2, 3, 224, 224), (32, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, False),
    # ResNet's stem: masked for one image (its phase image in cache), gathered for more
    # (on AMD's cores: MASKED_STRIDED_VENDORS)
    ((1, 3, 224, 224), (64, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, True),
    ((2, 3, 224, 224), (64, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, False),
    ((1, 16, 224, 224), (64, 16, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, False),
])
def test_choice(x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any],
                chosen: bool) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    assert (cpu_planner.native_form(geo, vendor="AMD")[0] == "masked") is chosen
    here = cpu_planner.native_form(geo)[0] == "masked"
    assert (cpu_planner.native_layout(geo).masked is not None) is here


@pytest.mark.parametrize("x_shape,w_shape,attrs,form", [
    ((1, 3, 224, 224), (64, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, "gathered"),
    ((1, 64, 56, 56), (128, 64, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, "gathered"),
    # an unpadded 1x1 stride 2 with rows of 14 or more: B packed from X (gathered-strided)
    ((1, 64, 56, 56), (128, 64, 1, 1), {"strides": (2, 2)}, "gathered-strided"),
    # in lanes tiles (masked_lanes): the masks are read once, into a copy
    ((1, 256, 14, 14), (512, 256, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, "masked"),
    ((32, 64, 56, 56), (128, 64, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)},
     "gathered-images"),
    ((1, 4, 32, 32), (16, 4, 3, 3), {"pads": (1, 1, 1, 1)}, "masked"),
])
def test_strided_convs_of_one_image_leave_the_masked_tiles_on_intel(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any],
        form: str) -> None:
    """On a CPU outside MASKED_STRIDED_VENDORS a strided conv of one image takes the
    gathered form unless its masked form runs in lanes tiles, and says why; a batch of
    enough work an image runs gathered image by image (test_conv_by_image), and unit
    strides keep the masked form."""
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    got, why = cpu_planner.native_form(geo, (8, 32), "Intel")
    assert got == form
    assert ("masked loads on Intel's cores" in why) is (form in ("gathered", "gathered-images"))
    assert cpu_planner.native_form(geo, (8, 32), "AMD")[0] == "masked"


@pytest.mark.parametrize("attrs", [{"pads": (1, 1, 1, 1)},
                                   {"pads": (1, 1, 1, 1), "strides": (2, 2)}])
def test_through_the_prepared_kernel(attrs: dict[str, Any]) -> None:
    """The conv node's steady state (prepack state, prepared calls reused, a copied X
    refilled from a new array each run)."""
    rng = np.random.default_rng(9)
    w, b = rand(rng, 16, 8, 3, 3), rand(rng, 16)
    w.setflags(write=False)
    b.setflags(write=False)
    full = {"group": 1, "dilations": (1, 1), "strides": (1, 1), **attrs,
            "activation": "relu", "activation_params": ()}
    kernel = TABLE.get(Op.CONV, "native")
    assert kernel.prepack is not None
    state = kernel.prepack(KernelContext(np, "cpu", "cpu", 1, None), [None, w, b], full)
    ctx = KernelContext(np, "cpu", "cpu", 1, state)
    y = None
    for _ in range(3):
        x = rand(rng, 2, 8, 12, 12)
        expect = np.maximum(reference([x, w, b], attrs), 0)
        if y is None:
            y = np.empty(expect.shape, np.float32)
        (got,) = kernel.fn(ctx, [x, w, b], full, [y])
        assert got is y
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)


# ---- groups of column panels (the planner's masked_panel_group) ---------------------------
GROUP_CASES = [
    ((2, 5, 9, 7), (11, 5, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((2, 3, 15, 15), (19, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((1, 8, 28, 28), (17, 8, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),  # 7 panels
    ((2, 3, 6, 11), (7, 3, 3, 3), {"pads": (1, 1, 1, 1)}),
    ((2, 8, 16, 16), (12, 8, 1, 1), {"strides": (2, 2)}),
    ((2, 6, 9, 9), (4, 3, 3, 3), {"pads": (1, 1, 1, 1), "group": 2}),
    ((1, 4, 32, 32), (9, 4, 3, 3), {"pads": (1, 1, 1, 1)}),            # 32 panels
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", GROUP_CASES)
@pytest.mark.parametrize("group", [2, 3, 8, 20])
def test_groups_of_column_panels_give_the_same_bits(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any],
        group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row panel by row panel over groups of column panels: bitwise the column-panel
    order's C (the same sums), with a residual and a clip, on 1 to 16 threads; a group
    of more panels than the planner gives (20) runs whole, as any other."""
    rng = np.random.default_rng(group)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    full = {**attrs, "activation": "clip", "activation_params": (-0.3, 0.4)}
    plain = reference([x, w, b], attrs)
    z = rand(rng, *plain.shape)
    monkeypatch.setattr(cpu_planner, "masked_panel_group", lambda *a, **k: 1)
    want = _masked(x, w, b, z, full)
    np.testing.assert_allclose(want, np.clip(plain + z, -0.3, 0.4), rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(cpu_planner, "masked_panel_group", lambda *a, **k: group)
    for threads in (1, 2, 3, 4, 16):
        assert _masked(x, w, b, z, full, threads=threads).tobytes() == want.tobytes()


def test_panel_groups_follow_the_filters_and_the_l2() -> None:
    l2 = cpu_planner.Caches(1 << 20, 32 << 20, "a 1 MiB L2")
    group = cpu_planner.masked_panel_group
    # ResNet-18's stride-2 convs at batch 1 on 32-column panels and 8-row tiles.
    assert group(512, 2304, 49, 32, 8, l2) == 2         # A 4.5 MiB: both panels at once
    assert group(256, 1152, 196, 32, 8, l2) == 4        # A 1.1 MiB: 7 panels by 4 + 3
    assert group(128, 576, 784, 32, 8, l2) == 1         # A in the L2
    assert group(512, 256, 49, 32, 8, l2) == 1          # 1x1 downsample: A 512 KiB
    assert group(512, 2304, 49, 32, 8, cpu_planner.Caches(16 << 20, 32 << 20, "")) == 1
    assert group(512, 9216, 49, 32, 8, l2) == 1         # one panel of B fills the L2
    assert group(64, 2304, 4096, 32, 8, cpu_planner.Caches(8 << 20, 32 << 20, "")) == 1


# ---- short last column panels (49 = 32 + 17 output pixels) --------------------------------
SHORT_CASES = [
    ((1, 16, 14, 14), (24, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),  # 32 + 17
    ((1, 16, 14, 14), (19, 16, 1, 1), {"strides": (2, 2)}),                # 1x1 stride 2
    ((2, 5, 7, 7), (9, 5, 3, 3), {"pads": (1, 1, 1, 1)}),                 # 49 columns, 9 rows
    ((1, 4, 5, 3), (17, 4, 3, 3), {"pads": (1, 1, 1, 1)}),                # 15 columns
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", SHORT_CASES)
def test_short_panels_give_the_gathered_bits(x_shape: tuple[int, ...],
                                             w_shape: tuple[int, ...],
                                             attrs: dict[str, Any]) -> None:
    """A panel of fewer than 32 columns (masked moves from the registers with AVX-512)
    sums and finishes each element as the gathered taps do: the same bits, with a bias,
    a residual and a clip, on 1 to 16 threads."""
    rng = np.random.default_rng(17)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    full = {**attrs, "activation": "clip", "activation_params": (-0.3, 0.4)}
    plain = reference([x, w, b], attrs)
    z = rand(rng, *plain.shape)
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    gathered = conv_gemm.native_layout(geo, "gathered")
    assert gathered.masked is None
    want = np.empty(plain.shape, np.float32)
    act = activation("clip", (-0.3, 0.4))
    assert conv_gemm.native(np, gathered, x, w, b, z, want, act, None, 1)
    np.testing.assert_allclose(want, np.clip(plain + z, -0.3, 0.4), rtol=1e-4, atol=1e-4)
    for threads in (1, 2, 3, 16):
        assert _masked(x, w, b, z, full, threads=threads).tobytes() == want.tobytes()


# ---- lanes tiles (the planner's masked_lanes) ---------------------------------------------
LANES_CASES = [
    ((1, 16, 14, 14), (40, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),  # 49 pixels
    ((2, 24, 14, 14), (48, 24, 1, 1), {"strides": (2, 2)}),               # 1x1 stride 2
    ((1, 8, 28, 28), (33, 8, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),   # 196, 33 rows
    ((2, 12, 9, 7), (64, 6, 3, 3), {"pads": (1, 1, 1, 1), "group": 2}),   # 63 pixels, groups
    ((1, 4, 5, 3), (70, 4, 3, 3), {"pads": (1, 1, 1, 1)}),                # 15 pixels, 70 rows
    ((1, 3, 2, 2), (32, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),     # 1 pixel
    ((1, 256, 14, 14), (512, 256, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),  # ResNet
]


def _lanes_flags(x: np.ndarray, w: np.ndarray, attrs: dict[str, Any]) -> list[bool]:
    """Whether each prepared call of the masked conv carries KEEL_LANES."""
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm.native_layout(geo, "masked")
    y = np.empty((geo.batch, geo.out_channels, *geo.window.out_spatial), np.float32)
    filters = conv_gemm.native_filters(np, geo, w, None)
    source = conv_gemm.native_source(np, layout, x)
    calls = conv_gemm.native_calls(layout, source, x, filters, None, y, activation("", ()))
    assert calls is not None
    return [bool(int(c.values[ng._FLAGS_FIELD]) & ng._LANES) for c in calls]


@pytest.mark.parametrize("x_shape,w_shape,attrs", LANES_CASES)
def test_lanes_tiles_give_the_masked_tiles_bits(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """C's rows in the vector lanes over the taps copied through the masks: bitwise the
    masked tiles' C, with a bias, a residual and a clip (and with NaN in X), on 1, 2, 3
    and 16 threads."""
    rng = np.random.default_rng(5)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    x.reshape(-1)[::97] = np.nan
    full = {**attrs, "activation": "clip", "activation_params": (-0.3, 0.4)}
    plain = reference([x, w, b], attrs)
    z = rand(rng, *plain.shape)
    monkeypatch.setattr(cpu_planner, "masked_lanes", lambda *a, **k: False)
    assert not any(_lanes_flags(x, w, attrs))
    want = _masked(x, w, b, z, full)
    np.testing.assert_allclose(want, np.clip(plain + z, -0.3, 0.4), rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(cpu_planner, "masked_lanes", lambda *a, **k: True)
    assert all(_lanes_flags(x, w, attrs))
    for threads in (1, 2, 3, 16):
        assert _masked(x, w, b, z, full, threads=threads).tobytes() == want.tobytes()


def test_masked_lanes_follow_the_computed_pixels() -> None:
    lanes = cpu_planner.masked_lanes
    grid = (8, 32)
    # ResNet-18's stride-2 convs at batch 1: 49 pixels (64 computed), 196 (224).
    assert lanes(512, 49, 2304, grid) and lanes(512, 49, 256, grid)
    assert lanes(256, 196, 1152, grid)
    assert not lanes(256, 196, 128, grid)           # 1x1: depth below the rows
    assert not lanes(128, 784, 576, grid)           # whole panels, B past the L2 share
    # ResNet-20's convs: whole column panels, nothing to save.
    assert not lanes(32, 256, 144, grid) and not lanes(64, 64, 576, grid)
    assert not lanes(16, 49, 144, grid)             # too few rows for a lanes tile
    assert not lanes(512, 49, 2304, None)


def test_masked_lanes_need_the_taps_copy_to_fit_the_workspace() -> None:
    """The planner says lanes tiles only where the kernel can copy the taps (k x n
    floats) into its workspace, so explain() names the form that runs."""
    work = ng.workspace_floats()
    if not work:
        pytest.skip("the native tier is unavailable: no workspace to size")
    k = -(-(work + 1) // 49)                        # the first depth past the workspace
    assert cpu_planner.lanes_tiles(1, 512, 49, k, grid=(8, 32))  # the lanes rule would
    assert not cpu_planner.masked_lanes(512, 49, k, (8, 32))
    assert cpu_planner.masked_lanes(512, 49, work // 49, (8, 32))


def test_the_native_form_says_when_it_runs_in_lanes_tiles() -> None:
    def why(x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> str:
        attrs = {"pads": (1, 1, 1, 1), "strides": (2, 2)}
        form, reason = cpu_planner.native_form(
            conv_geometry(Op.CONV, x_shape, w_shape, attrs), (8, 32), "AMD")
        assert form == "masked"
        return reason

    assert "in lanes tiles: 49 pixels an image, which 32-column panels compute as 64" in why(
        (1, 256, 14, 14), (512, 256, 3, 3))
    assert "lanes" not in why((1, 64, 56, 56), (128, 64, 3, 3))


def test_one_small_image_runs_masked_with_the_gathered_bits() -> None:
    """A strided conv of one image of few channels with many output pixels (ResNet's
    7x7 stride-2 stem, smaller) runs masked, says why, and gives the gathered form's
    bits with a bias, a residual and a clip on 1 to 16 threads."""
    attrs = {"pads": (3, 3, 3, 3), "strides": (2, 2)}
    rng = np.random.default_rng(23)
    x, w, b = rand(rng, 1, 3, 140, 132), rand(rng, 40, 3, 7, 7), rand(rng, 40)
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    form, why = cpu_planner.native_form(geo, (8, 32), "AMD")
    assert form == "masked"
    assert "4620 output pixels of one image of 3 channel(s)" in why
    plain = reference([x, w, b], attrs)
    z = rand(rng, *plain.shape)
    want = np.empty(plain.shape, np.float32)
    act = activation("clip", (-0.3, 0.4))
    assert conv_gemm.native(np, conv_gemm.native_layout(geo, "gathered"), x, w, b, z, want,
                            act, None, 1)
    np.testing.assert_allclose(want, np.clip(plain + z, -0.3, 0.4), rtol=1e-4, atol=1e-4)
    full = {**attrs, "activation": "clip", "activation_params": (-0.3, 0.4)}
    for threads in (1, 2, 3, 16):
        assert _masked(x, w, b, z, full, threads=threads).tobytes() == want.tobytes()


@pytest.mark.parametrize("vendor", ["Hygon", "ARM", None])
def test_unmeasured_vendors_reason_says_so(vendor: str | None) -> None:
    """Outside Intel and AMD a strided conv of one image keeps Intel's gathered form, and
    the reason says the masked form was not measured there instead of claiming a wait."""
    geo = conv_geometry(Op.CONV, (1, 64, 56, 56), (128, 64, 3, 3),
                        {"pads": (1, 1, 1, 1), "strides": (2, 2)})
    got, why = cpu_planner.native_form(geo, (8, 32), vendor)
    assert got == "gathered"
    assert "not measured on" in why and "masked loads on" not in why
