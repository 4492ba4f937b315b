"""The gathered-strided form of the native conv (conv_gemm.strided_serves): an unpadded
1x1 stride-2 conv whose B gemm.c packs from X itself, a row's every other float, with no
phase copy. Checked against the reference backend (odd sizes, rows of one to many
pixels, bias / residual / clip / ReLU, a residual that is Y itself), bitwise equal at 1,
2, 3 and 16 threads and to the phase-copy gathered form it replaces; and where the cpu
planner takes it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.cpu import conv_gemm
from keel.backends.cpu import planner as cpu_planner
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry
from tests.native import _conv_support as support

pytestmark = pytest.mark.usefixtures("native_gemm_tier")

S2 = {"strides": (2, 2)}

CASES = [
    # X, W: output rows of 28 (panels crossing rows), 3 (short runs), 17 and 1 pixels
    ((1, 16, 56, 56), (24, 16, 1, 1)),
    ((2, 5, 6, 5), (11, 5, 1, 1)),
    ((3, 8, 33, 34), (12, 8, 1, 1)),
    ((2, 7, 9, 1), (9, 7, 1, 1)),
]


def _strided(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any],
             threads: int = 1, y: np.ndarray | None = None) -> np.ndarray:
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm.native_layout(geo, "gathered-strided")
    assert not layout.copied and conv_gemm.native_scratch(layout, 4) == 0
    return support.run_layout(layout, x, w, b, z, attrs, threads, y)


@pytest.mark.parametrize("x_shape,w_shape", CASES)
@pytest.mark.parametrize("act,params", [("", ()), ("relu", ()), ("clip", (-0.3, 0.4))])
def test_matches_the_reference(x_shape: tuple[int, ...], w_shape: tuple[int, ...], act: str,
                               params: tuple[float, ...]) -> None:
    support.check_against_reference(_strided, x_shape, w_shape, S2, act, params)


@pytest.mark.parametrize("x_shape,w_shape", CASES[:2])
def test_residual_in_place(x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> None:
    """Z is Y itself: the product adds to what Y holds."""
    support.check_residual_in_place(_strided, x_shape, w_shape, S2)


@pytest.mark.parametrize("x_shape,w_shape", CASES)
def test_bitwise_across_threads_and_to_the_phase_copy(x_shape: tuple[int, ...],
                                                     w_shape: tuple[int, ...]) -> None:
    """The same bits at 1, 2, 3 and 16 threads, and as the gathered form that copies X's
    stride phase first: the packing moves the same floats, the products are the same."""
    rng = np.random.default_rng(5)
    x, w = support.rand(rng, *x_shape), support.rand(rng, *w_shape)
    b = support.rand(rng, w_shape[0])
    z = support.rand(rng, *support.reference([x, w, b], S2).shape)
    one = _strided(x, w, b, z, S2)
    for threads in (2, 3, 16):
        assert np.array_equal(_strided(x, w, b, z, S2, threads=threads), one)
    geo = conv_geometry(Op.CONV, x_shape, w_shape, S2)
    copied = conv_gemm.native_layout(geo, "gathered")
    assert copied.copied
    assert np.array_equal(support.run_layout(copied, x, w, b, z, S2, 2), one)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 8, 16, 16), (8, 8, 1, 1), {"strides": (1, 1)}),
    ((1, 8, 16, 16), (8, 8, 1, 1), {"strides": (3, 3)}),
    ((1, 8, 16, 16), (8, 8, 1, 1), {"strides": (2, 2), "pads": (1, 1, 1, 1)}),
    ((1, 8, 16, 16), (8, 8, 3, 3), {"strides": (2, 2)}),
    ((1, 8, 16, 16), (8, 8, 1, 1), {"strides": (2, 2), "dilations": (2, 2)}),
])
def test_not_served_but_at_an_unpadded_1x1_stride_2(x_shape: tuple[int, ...],
                                                   w_shape: tuple[int, ...],
                                                   attrs: dict[str, Any]) -> None:
    assert not conv_gemm.strided_serves(conv_geometry(Op.CONV, x_shape, w_shape, attrs))


@pytest.mark.parametrize("x_shape,w_shape,form", [
    # ResNet-18's shortcuts at batch 1
    ((1, 64, 56, 56), (128, 64, 1, 1), "gathered-strided"),
    ((1, 128, 28, 28), (256, 128, 1, 1), "gathered-strided"),
    # 7-wide output rows: the masked form's lanes tiles (STRIDED_GATHER_MIN_WIDTH)
    ((1, 256, 14, 14), (512, 256, 1, 1), "masked"),
    ((32, 256, 14, 14), (512, 256, 1, 1), "masked"),
])
def test_where_the_planner_takes_it(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                    form: str) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, S2)
    got, why = cpu_planner.native_form(geo, (8, 32), "Intel")
    assert got == form
    assert ("STRIDED_GATHER_MIN_WIDTH" in why) is (form == "gathered-strided")


@pytest.mark.parametrize("grid,vendor", [((6, 16), "Intel"), (None, "Intel"),
                                         ((8, 32), "AMD")])
def test_not_taken_off_avx512_tiles_or_on_an_unmeasured_vendor(grid: Any,
                                                               vendor: str) -> None:
    """pack_pairs is AVX-512 code (elsewhere the map packs column by column, slower than
    the phase copy) measured on Intel cores only: the shortcuts keep their forms."""
    geo = conv_geometry(Op.CONV, (1, 64, 56, 56), (128, 64, 1, 1), S2)
    assert cpu_planner.native_form(geo, grid, vendor)[0] != "gathered-strided"


@pytest.mark.parametrize("x_shape,w_shape", [((32, 64, 56, 56), (128, 64, 1, 1)),
                                             ((32, 128, 28, 28), (256, 128, 1, 1))])
def test_a_batch_keeps_its_form(x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> None:
    """ResNet-18's shortcuts at batch 32 copy each image's phase before its product."""
    geo = conv_geometry(Op.CONV, x_shape, w_shape, S2)
    assert cpu_planner.native_form(geo, (8, 32), "Intel")[0] == "gathered-images"


@pytest.mark.parametrize("x_shape,w_shape", [((32, 64, 56, 56), (128, 64, 1, 1)),
                                             ((32, 128, 28, 28), (256, 128, 1, 1))])
def test_a_batch_on_many_threads_packs_from_x(x_shape: tuple[int, ...],
                                              w_shape: tuple[int, ...]) -> None:
    """On STRIDED_GATHER_BATCH_THREADS threads or more a batch packs B from X too (its
    phase copy a pass of its own there: measured on 16 cores); on fewer it keeps
    gathered-images, and 7-wide rows keep the masked form on any."""
    geo = conv_geometry(Op.CONV, x_shape, w_shape, S2)
    many = cpu_planner.STRIDED_GATHER_BATCH_THREADS
    form, why = cpu_planner.native_form(geo, (8, 32), "Intel", many)
    assert form == "gathered-strided" and "STRIDED_GATHER_BATCH_THREADS" in why
    assert cpu_planner.native_form(geo, (8, 32), "Intel", many - 1)[0] == "gathered-images"
    assert cpu_planner.native_form(geo, (8, 32), "AMD", many)[0] != "gathered-strided"
    narrow = conv_geometry(Op.CONV, (32, 256, 14, 14), (512, 256, 1, 1), S2)
    assert cpu_planner.native_form(narrow, (8, 32), "Intel", many)[0] == "masked"


def test_a_batch_too_small_for_many_threads_keeps_its_form() -> None:
    """A batch on a 16-thread cap whose product gets fewer threads for want of work is the
    few-thread case the phase copy won: it keeps its form."""
    geo = conv_geometry(Op.CONV, (2, 8, 28, 28), (8, 8, 1, 1), S2)
    many = cpu_planner.STRIDED_GATHER_BATCH_THREADS
    assert not cpu_planner.batch_on_many_threads(geo, many, many)
    assert cpu_planner.native_form(geo, (8, 32), "Intel", many)[0] != "gathered-strided"


@pytest.mark.parametrize("x_shape,w_shape", [CASES[1], CASES[2], ((4, 16, 28, 28), (32, 16, 1, 1))])
def test_a_batch_packed_from_x_has_the_bits_of_its_images_phase_copied(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> None:
    """The form a batch ran in before on many threads (each image's phase copied, then its
    product) and the one it runs in now give the same bits, on 16 threads and on 2."""
    rng = np.random.default_rng(9)
    x, w = support.rand(rng, *x_shape), support.rand(rng, *w_shape)
    b = support.rand(rng, w_shape[0])
    z = support.rand(rng, *support.reference([x, w, b], S2).shape)
    geo = conv_geometry(Op.CONV, x_shape, w_shape, S2)
    for threads in (2, 16):
        images = conv_gemm.native_layout(geo, "gathered-images", step=1)
        assert np.array_equal(_strided(x, w, b, z, S2, threads=threads),
                              support.run_layout(images, x, w, b, z, S2, threads))
