"""The cpu planner's lanes-tile rule by vendor: AMD's cores take the shapes measured there;
Intel's (and unmeasured vendors') take lanes tiles only for deep products or where the
column panels waste many columns, and the direct 1x1 conv's reason says which ran and
why. Every tiling gives the same bits (tests/native/test_gemm_tiles.py), so only the
choice is checked here."""

from __future__ import annotations

import pytest

from keel.backends.cpu import planner
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry

GRID = (8, 32)                          # gemm.c's AVX-512 tile: 8 rows x 2 vectors

# (rows, columns, depth) of MobileNetV2's 1x1 convs at batch 1
EXPAND_14 = (576, 196, 96)              # 96 -> 576 on 14x14: depth below the rows
PROJECT_14 = (64, 196, 384)             # 384 -> 64 on 14x14: depth above the rows
PROJECT_28 = (32, 784, 192)             # 192 -> 32 on 28x28: 784 columns
EXPAND_7 = (960, 49, 160)               # 160 -> 960 on 7x7: panels compute 64 of 49


def test_amd_keeps_the_shapes_measured_there() -> None:
    for m, n, k in (EXPAND_14, PROJECT_14, PROJECT_28, EXPAND_7):
        assert planner.lanes_tiles(1, m, n, k, "AMD", GRID)


@pytest.mark.parametrize("vendor", ["Intel", "Hygon", None])
def test_other_vendors_take_lanes_tiles_for_deep_or_narrow_products(
        vendor: str | None) -> None:
    assert not planner.lanes_tiles(1, *EXPAND_14, vendor, GRID)
    assert not planner.lanes_tiles(1, *PROJECT_28, vendor, GRID)
    assert planner.lanes_tiles(1, *PROJECT_14, vendor, GRID)
    assert planner.lanes_tiles(1, *EXPAND_7, vendor, GRID)


def test_the_shape_limits_hold_for_every_vendor() -> None:
    """Below LANES_MIN_ROWS rows, or with B past LANES_MAX_B_BYTES, no vendor's products
    run in lanes tiles (MobileNetV2's 1x1 convs at batch 32)."""
    for vendor in ("AMD", "Intel"):
        assert not planner.lanes_tiles(1, planner.LANES_MIN_ROWS - 1, 49, 960, vendor, GRID)
        assert not planner.lanes_tiles(32, 576, 196, 96, vendor, GRID)


def _reason(x: tuple[int, ...], w: tuple[int, ...], vendor: str | None,
            grid: tuple[int, int] = GRID) -> str:
    form, why = planner.native_form(conv_geometry(Op.CONV, x, w, {}), grid, vendor)
    assert form == "direct"
    return why


def test_the_direct_form_says_whether_its_products_run_in_lanes_tiles() -> None:
    expand = ((1, 96, 14, 14), (576, 96, 1, 1))
    why = _reason(*expand, "Intel")
    assert "not in lanes tiles: 196 pixels an image" in why
    assert "depth 96 below the 576 rows" in why and "share a port" in why
    assert "not measured" not in why
    assert "in lanes tiles: 196 pixels" in _reason(*expand, "AMD")
    assert "not measured on an unknown vendor's cores" in _reason(*expand, None)
    project = ((1, 192, 28, 28), (32, 192, 1, 1))
    assert "over LANES_MAX_COLUMNS (256) pixels" in _reason(*project, "Intel")
    assert ", in lanes tiles: 49 pixels an image, which 32-column panels compute as 64" in (
        _reason((1, 160, 7, 7), (960, 160, 1, 1), "Intel"))


def test_a_in_16_row_panels_is_said_only_for_intel_s_8_x_32_tiles() -> None:
    """lanes_a16: gemm.c reads 16-row panels with its AVX-512 8 x 32 tiles only, so a
    build with another tile (6 x 16 with AVX2, 4 x 8 scalar) is not told it does (nor
    that its products run in lanes tiles: it has none); AMD's cores were not measured."""
    geo = conv_geometry(Op.CONV, (1, 384, 14, 14), (64, 384, 1, 1), {})
    assert planner.lanes_a16(GRID, "Intel")
    assert planner.native_tiles(geo, "direct", GRID, "Intel")[0] is True
    a16, why = planner.native_a16(True, GRID, "Intel")
    assert a16 and why.startswith("A in 16-row panels, one load a vector")
    for vendor, grid in (("Intel", (6, 16)), ("Intel", (4, 8)), ("AMD", GRID)):
        lanes = planner.native_tiles(geo, "direct", grid, vendor)[0]
        assert lanes is (vendor == "AMD"), (vendor, grid)
        a16, why = planner.native_a16(lanes, grid, vendor)
        assert not a16 and not planner.lanes_a16(grid, vendor)
        # Said where the products run in lanes tiles (AMD's 8 x 32), with why not.
        assert why == ("" if not lanes else "A in 8-row panels, two joined each depth "
                       "step: 16-row panels were measured on Intel's cores only (lanes_a16, "
                       "LANES_A16_VENDORS): not measured on AMD's cores")
    assert planner.native_a16(False, GRID, "Intel") == (False, "")


@pytest.mark.parametrize("vendor", ["AMD", "Intel", None])
@pytest.mark.parametrize("grid", [(6, 16), (6, 8), (4, 8), None])
def test_a_grid_without_lanes_tiles_never_runs_in_them(
        vendor: str | None, grid: tuple[int, int] | None) -> None:
    """gemm.c builds lanes tiles with its 8 x 32 tiles only (LANES_GRID): a plan for
    another tile (an AVX2 AMD EPYC's 6 x 16 among them) is never told its products run
    in them, whatever the vendor, nor its partly filled last panel; the direct form's
    reason says why, where a product of the same shapes on 8 x 32 would."""
    for m, n, k in (EXPAND_14, PROJECT_14, PROJECT_28, EXPAND_7):
        assert not planner.lanes_tiles(1, m, n, k, vendor, grid), (m, n, k)
        assert not planner.lanes_tail(m, n, k, grid, vendor), (m, n, k)
    assert planner.lanes_tiles(1, *PROJECT_14, vendor, GRID)
    if grid is None:
        return
    why = _reason((1, 384, 14, 14), (64, 384, 1, 1), vendor, grid)
    assert ", not in lanes tiles: 196 pixels an image" in why
    assert (f"gemm.c builds them with its 8 x 32 tiles only (LANES_GRID), these are "
            f"{grid[0]} x {grid[1]}") in why


@pytest.mark.parametrize("vendor", ["AMD", "Intel", None])
@pytest.mark.parametrize("grid", [(6, 16), (4, 8)])
def test_no_form_runs_in_lanes_tiles_on_a_grid_without_them(
        vendor: str | None, grid: tuple[int, int]) -> None:
    """The masked conv (masked_lanes) and Winograd's products (winograd_lanes and
    winograd_pass_lanes) follow LANES_GRID as the direct conv does: a plan for 6 x 16 or
    4 x 8 tiles never says they run in lanes tiles, nor counts lanes tiles in its split,
    where the same conv on 8 x 32 tiles takes them."""
    masked = conv_geometry(Op.CONV, (1, 64, 7, 7), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]})
    assert planner.masked_lanes(64, 49, 576, GRID)
    assert not planner.masked_lanes(64, 49, 576, grid)
    assert "in lanes tiles" in planner.native_form(masked, GRID, vendor)[1]
    assert "in lanes tiles" not in planner.native_form(masked, grid, vendor)[1]
    split = planner.conv_splits("native", "masked", None, masked, 16, grid, vendor=vendor)
    for lanes in (True, False):
        want = planner.gemm_pass("product", 1, 64, 49, 576, 16, grid, raw=(False, True),
                                 lanes=lanes)
        assert (split == (want,)) is not lanes
    assert planner.winograd_lanes("AMD", GRID)[0]
    assert planner.winograd_pass_lanes(64, 64, 49, vendor, GRID)[0]
    for tiles in (16, 49):                  # one vector (tall tiles), then wider
        lanes, why = planner.winograd_pass_lanes(64, 64, tiles, vendor, grid)
        assert not lanes and "LANES_GRID" in why
    lanes, why = planner.winograd_lanes(vendor, grid)
    assert not lanes and f"these are {grid[0]} x {grid[1]}" in why


def test_the_planner_knows_which_builds_have_lanes_tiles() -> None:
    """LANES_GRID mirrors gemm.c's keel_gemm_lanes_built_f32 (native_gemm checks the two
    agree when it loads the kernel): this build's tile has lanes tiles exactly where
    gemm.c says it built them."""
    from keel.backends.cpu import native_gemm

    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    functions = native_gemm._functions()
    assert functions is not None
    built = planner.lanes_built((functions.mr, functions.nr))
    assert functions.lanes_built is built is planner.lanes_built()


def test_a_winograd_plan_takes_the_grid_planned_for() -> None:
    """winograd_form takes the plan's tile grid: the products of an AMD plan run in lanes
    tiles on 8 x 32 tiles, in panels on 6 x 16, compiled or pass by pass."""
    from keel.backends.cpu import native_gemm

    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    geo = conv_geometry(Op.CONV, (1, 64, 56, 56), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]})
    eight = planner.conv_form("winograd", geo, 4, GRID, None, 1, "AMD")
    six = planner.conv_form("winograd", geo, 4, (6, 16), None, 1, "AMD")
    assert eight.lanes and not six.lanes and "LANES_GRID" in six.lanes_reason
    assert not six.pass_lanes and "LANES_GRID" in six.pass_lanes_reason


def test_the_split_counts_the_tiles_that_run() -> None:
    """The conv's planned product split counts columns where lanes tiles run and vectors
    where panels do, so the 4-thread split of the same conv follows the vendor (2 x 2
    tiles in lanes, 4 x 1 in panels)."""
    geo = conv_geometry(Op.CONV, (1, 96, 14, 14), (576, 96, 1, 1), {})
    splits = {}
    for vendor, lanes in (("AMD", True), ("Intel", False)):
        got = planner.conv_splits("native", "direct", None, geo, 4, GRID, vendor=vendor)
        want = planner.gemm_pass("product", 1, *EXPAND_14, 4, GRID, raw=(False, True),
                                 lanes=lanes)
        assert got == (want,)
        splits[vendor] = got[0].name
    assert splits["AMD"] != splits["Intel"]


def test_a_partly_filled_last_panel_runs_in_lanes_tiles() -> None:
    """lanes_tail takes a tail of 1 to LANES_TAIL_MAX_COLUMNS columns past the whole
    32-column panels, with at least LANES_MIN_ROWS rows, on the AVX-512 tile of
    LANES_TAIL_VENDORS' cores only; the direct 1x1 conv's reason names it where its
    products run in panels."""
    assert planner.lanes_tail(*EXPAND_14, GRID, "Intel")  # 196 = 6 x 32 + 4
    assert planner.lanes_tail(576, 32 + planner.LANES_TAIL_MAX_COLUMNS, 96, GRID, "Intel")
    assert not planner.lanes_tail(576, 33 + planner.LANES_TAIL_MAX_COLUMNS, 96, GRID, "Intel")
    assert not planner.lanes_tail(576, 192, 96, GRID, "Intel")  # whole panels
    assert not planner.lanes_tail(*PROJECT_28, GRID, "Intel")  # 784: a tail of 16
    assert not planner.lanes_tail(planner.LANES_MIN_ROWS - 1, 196, 96, GRID, "Intel")
    assert not planner.lanes_tail(*EXPAND_14, (6, 16), "Intel")  # no lanes tiles there
    assert not planner.lanes_tail(*EXPAND_14, GRID, "AMD")  # not measured there
    expand = ((1, 96, 14, 14), (576, 96, 1, 1))
    assert "the last 4 of its 196 pixels an image in lanes tiles" in _reason(*expand, "Intel")
    assert "lanes_tail" not in _reason(*expand, "AMD")               # all in lanes tiles
    assert "lanes_tail" not in _reason((1, 96, 16, 16), (576, 96, 1, 1), "Intel")


def test_filters_in_16_row_panels_only_for_the_direct_conv_in_lanes_tiles() -> None:
    """A layout with a16 (native_a16's 16-row panels) is a direct conv whose products run
    in lanes tiles: native_layout refuses any other with a typed error (a plan may come
    from a file)."""
    from keel.backends.cpu import conv_gemm
    from keel.errors import InvalidArgumentError

    geo = conv_geometry(Op.CONV, (1, 96, 14, 14), (576, 96, 1, 1), {})
    assert conv_gemm.native_layout(geo, "direct", lanes=True, a16=True).a16
    for form, lanes in (("direct", False), ("direct", None), ("gathered", True),
                        ("masked", True)):
        with pytest.raises(InvalidArgumentError, match="gemm_a16"):
            conv_gemm.native_layout(geo, form, lanes=lanes, a16=True)
