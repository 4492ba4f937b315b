"""The gathered-images form of the native conv (conv_gemm.NativeLayout.images): a batch's
strided conv run image by image, each image's phase copy into one image's phase image and
then its products. Checked against the reference backend (pads, strides, odd sizes, a
1x1 stride-2 conv, bias / residual / clip / ReLU, a residual that is Y itself), through the
conv kernel's prepared path, bitwise equal at 1, 2, 3 and 16 threads and to the gathered
form of each image alone; and where the cpu planner takes it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import keel.backends.cpu.conv  # noqa: F401  (registers the conv kernels on TABLE)
from keel.backends.base import KernelContext
from keel.backends.cpu import conv_gemm
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_epilogue import activation
from keel.backends.cpu.kernels import TABLE
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry
from tests.native._conv_support import (
    check_against_reference,
    check_residual_in_place,
    prepared_state,
    rand,
    reference,
    run_layout,
)

pytestmark = pytest.mark.usefixtures("native_gemm_tier")


CASES = [
    # X, W, attrs
    ((3, 16, 16, 16), (32, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((2, 5, 9, 7), (11, 5, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),  # odd sizes
    ((2, 3, 16, 16), (7, 3, 3, 3), {"pads": (0, 0, 1, 1), "strides": (2, 2)}),
    ((3, 8, 16, 16), (12, 8, 1, 1), {"strides": (2, 2)}),                # 1x1 stride 2
    ((2, 4, 12, 12), (5, 4, 3, 3), {"pads": (1, 1, 1, 1), "strides": (3, 3)}),
    ((2, 6, 10, 10), (9, 6, 3, 3), {"pads": (1, 1, 1, 1)}),              # padded stride 1
]


def _by_image(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any],
              threads: int = 1, y: np.ndarray | None = None) -> np.ndarray:
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm.native_layout(geo, "gathered-images")
    assert layout.images == geo.batch and layout.geo.batch == 1
    return run_layout(layout, x, w, b, z, attrs, threads, y)


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
@pytest.mark.parametrize("act,params", [("", ()), ("relu", ()), ("clip", (-0.3, 0.4))])
def test_matches_the_reference(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                               attrs: dict[str, Any], act: str,
                               params: tuple[float, ...]) -> None:
    check_against_reference(_by_image, x_shape, w_shape, attrs, act, params)


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES[:4])
def test_residual_in_place(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                           attrs: dict[str, Any]) -> None:
    """Z is Y itself: each image's products add to what Y holds."""
    check_residual_in_place(_by_image, x_shape, w_shape, attrs)


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES[:4])
def test_bitwise_equal_across_threads_and_to_each_image_alone(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any]) -> None:
    """The same bits at 1, 2, 3 and 16 threads, and as the gathered form of one image
    (what a batch of one runs), and as the masked form of the batch."""
    rng = np.random.default_rng(11)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    z = rand(rng, *reference([x, w, b], attrs).shape)
    one = _by_image(x, w, b, z, attrs, threads=1)
    for threads in (2, 3, 16):
        assert np.array_equal(_by_image(x, w, b, z, attrs, threads=threads), one)
    geo1 = conv_geometry(Op.CONV, (1, *x_shape[1:]), w_shape, attrs)
    act = activation("", ())
    for i in range(x_shape[0]):
        y = np.empty((1, *one.shape[1:]), np.float32)
        layout = conv_gemm.native_layout(geo1, "gathered")
        assert conv_gemm.native(np, layout, x[i:i + 1], w, b, z[i:i + 1], y, act, None, 2)
        assert np.array_equal(y, one[i:i + 1])
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    masked = conv_gemm.native_layout(geo, "masked")
    if masked.masked is not None:
        y = np.empty_like(one)
        assert conv_gemm.native(np, masked, x, w, b, z, y, act, None, 2)
        assert np.array_equal(y, one)


def test_through_the_prepared_kernel() -> None:
    """The conv node's steady state: the steps kept in the prepack state, a new X each run
    copied image by image, the same Y."""
    rng = np.random.default_rng(9)
    w, b = rand(rng, 16, 8, 3, 3), rand(rng, 16)
    w.setflags(write=False)
    b.setflags(write=False)
    attrs = {"pads": (1, 1, 1, 1), "strides": (2, 2)}
    full = {"group": 1, "dilations": (1, 1), **attrs, "activation": "relu",
            "activation_params": ()}
    kernel = TABLE.get(Op.CONV, "native")
    assert kernel.prepack is not None
    state = kernel.prepack(KernelContext(np, "cpu", "cpu", 1, None), [None, w, b], full)
    ctx = KernelContext(np, "cpu", "cpu", 1, state)
    geo = conv_geometry(Op.CONV, (3, 8, 12, 12), w.shape, attrs)
    layout = conv_gemm.native_layout(geo, "gathered-images")
    act = activation("relu", ())
    y = None
    for _ in range(3):
        x = rand(rng, 3, 8, 12, 12)
        expect = np.maximum(reference([x, w, b], attrs), 0)
        if y is None:
            y = np.empty(expect.shape, np.float32)
        assert conv_gemm.native(np, layout, x, w, b, None, y, act, ctx.prepacked, 2)
        np.testing.assert_allclose(y, expect, rtol=1e-4, atol=1e-4)


RESNET_S2 = [
    # (X, W, attrs): ResNet-18's stride-2 convs at batch 32, ResNet-20's
    ((32, 64, 56, 56), (128, 64, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((32, 64, 56, 56), (128, 64, 1, 1), {"strides": (2, 2)}),
    ((32, 128, 28, 28), (256, 128, 1, 1), {"strides": (2, 2)}),
    ((32, 128, 28, 28), (256, 128, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((32, 256, 14, 14), (512, 256, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((32, 256, 14, 14), (512, 256, 1, 1), {"strides": (2, 2)}),
    ((32, 16, 32, 32), (32, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((32, 32, 16, 16), (64, 32, 1, 1), {"strides": (2, 2)}),
]


@pytest.mark.parametrize("case,form", zip(RESNET_S2, [
    "gathered-images", "gathered-images", "gathered-images",
    "masked", "masked", "masked",        # in lanes tiles at one image (masked_lanes)
    "masked", "masked",                  # 2.4 and 0.3 MFLOP an image < BY_IMAGE_MIN_FLOPS
], strict=True))
def test_where_the_planner_takes_it(case: tuple[Any, ...], form: str) -> None:
    """On a CPU outside MASKED_STRIDED_VENDORS: a batch's strided conv of enough work an
    image whose one-image product would not run in lanes tiles, with its reason; AMD's
    cores keep the masked form, and one image the gathered form."""
    geo = conv_geometry(Op.CONV, *case)
    got, why = cpu_planner.native_form(geo, (8, 32), "Intel")
    assert got == form
    assert ("step by step" in why and "BY_IMAGE_MIN_FLOPS" in why) is (form != "masked")
    assert cpu_planner.native_form(geo, (8, 32), "AMD")[0] == "masked"
    one = conv_geometry(Op.CONV, (1, *case[0][1:]), *case[1:])
    assert cpu_planner.native_form(one, (8, 32), "Intel")[0] != "gathered-images"


def test_not_where_the_masked_rule_would_not_take_the_batch() -> None:
    """ResNet-18's stem at batch 32 (12544 output pixels, over MASKED_STRIDED_BELOW) keeps
    the gathered form of the whole batch."""
    geo = conv_geometry(Op.CONV, (32, 3, 224, 224), (64, 3, 7, 7),
                        {"pads": (3, 3, 3, 3), "strides": (2, 2)})
    assert cpu_planner.native_form(geo, (8, 32), "Intel")[0] == "gathered"


def test_not_served_where_y_overlaps_x() -> None:
    """An image's Y could overwrite X of an image not yet copied: not served, nothing
    written."""
    rng = np.random.default_rng(2)
    w, b = rand(rng, 8, 8, 1, 1), rand(rng, 8)
    attrs = {"strides": (2, 2)}
    buf = rand(rng, 3 * 8 * 16 * 16)
    x = buf.reshape(3, 8, 16, 16)
    y = buf[: 3 * 8 * 8 * 8].reshape(3, 8, 8, 8)
    before = buf.copy()
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm.native_layout(geo, "gathered-images")
    assert not conv_gemm.native(np, layout, x, w, b, None, y, activation("", ()), None, 1)
    assert np.array_equal(buf, before)


def test_not_served_where_y_overlaps_z() -> None:
    """Z partly in Y's memory: image i's Y could overwrite Z of image i + 1 before that
    image reads it; not served, nothing written."""
    rng = np.random.default_rng(3)
    w, b = rand(rng, 8, 8, 3, 3), rand(rng, 8)
    attrs = {"pads": (1, 1, 1, 1), "strides": (2, 2)}
    x = rand(rng, 2, 8, 16, 16)
    buf = rand(rng, 3 * 8 * 8 * 8)
    z = buf[: 2 * 8 * 8 * 8].reshape(2, 8, 8, 8)
    y = buf[8 * 8 * 8:].reshape(2, 8, 8, 8)
    before = buf.copy()
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm.native_layout(geo, "gathered-images")
    assert not conv_gemm.native(np, layout, x, w, b, z, y, activation("", ()), None, 1)
    assert np.array_equal(buf, before)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("form", ["gathered-images", "gathered"])
def test_a_copied_residual_is_not_kept_for_later_runs(form: str, strided: bool) -> None:
    """Z a few floats off Y (or a strided view) is copied when the calls are prepared;
    calls holding that copy must not be kept, or later runs would add the first Z."""
    rng = np.random.default_rng(4)
    w, b = rand(rng, 8, 8, 3, 3), rand(rng, 8)
    attrs = {"pads": (1, 1, 1, 1), "strides": (2, 2)}
    state = prepared_state(w, b, attrs)
    x = rand(rng, 1, 8, 16, 16)
    layout = conv_gemm.native_layout(conv_geometry(Op.CONV, x.shape, w.shape, attrs), form)
    buf = np.empty(8 * 8 * 8 + 4, np.float32)
    y, z = buf[:-4].reshape(1, 8, 8, 8), buf[4:].reshape(1, 8, 8, 8)
    if strided:
        buf = np.empty((1, 8, 8, 16), np.float32)
        y, z = np.empty((1, 8, 8, 8), np.float32), buf[..., ::2]
    for _ in range(3):
        x[...], buf[...] = rand(rng, *x.shape), rand(rng, *buf.shape)
        expect = reference([x, w, b], attrs) + z
        before = buf.copy()
        served = conv_gemm.native(np, layout, x, w, b, z, y, activation("", ()), state, 1)
        if served:
            np.testing.assert_allclose(y, expect, rtol=1e-4, atol=1e-4)
        else:                           # image by image declines a Z overlapping Y
            assert form == "gathered-images" and not strided
            assert np.array_equal(buf, before)


def _by_steps(step: int) -> Any:
    """The gathered-images form run ``step`` images a step (their products stacked)."""
    def run(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any],
            threads: int = 1, y: np.ndarray | None = None) -> np.ndarray:
        geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
        layout = conv_gemm.native_layout(geo, "gathered-images", step=step)
        assert layout.step == min(step, geo.batch) and layout.geo.batch == layout.step
        return run_layout(layout, x, w, b, z, attrs, threads, y)
    return run


@pytest.mark.parametrize("step", [2, 3])
@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES[:4])
def test_steps_of_images_match_the_reference(step: int, x_shape: tuple[int, ...],
                                             w_shape: tuple[int, ...],
                                             attrs: dict[str, Any]) -> None:
    """k images a step, the last step shorter where k does not divide the batch."""
    check_against_reference(_by_steps(step), x_shape, w_shape, attrs, "relu", ())
    check_residual_in_place(_by_steps(step), x_shape, w_shape, attrs)


# ResNet-18's 64 -> 128 convs beside each other and its 128 -> 256 1x1, at a batch no step
# of 2, 3 or 16 divides (the last step shorter).
RESNET_BATCH = 17


@pytest.mark.parametrize("case", [RESNET_S2[0], RESNET_S2[2]])
def test_planned_steps_give_the_same_bits_on_every_thread_count(case: tuple[Any, ...]) -> None:
    """The step the planner gives each thread count (1, 2, 3, 16), run on that many
    threads: every result the same bits, and the reference backend's values."""
    x_shape, w_shape, attrs = (RESNET_BATCH, *case[0][1:]), case[1], case[2]
    rng = np.random.default_rng(5)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    z = rand(rng, *reference([x, w, b], attrs).shape)
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    results, steps = [], set()
    for threads in (1, 2, 3, 16):
        step = cpu_planner.by_image_step(geo, threads, (8, 32), L2_2MIB)[0]
        steps.add(step)
        results.append(_by_steps(step)(x, w, b, z, attrs, threads))
    assert len(steps) > 1                       # the thread counts ran different steps
    for got in results[1:]:
        assert np.array_equal(got, results[0])
    np.testing.assert_allclose(results[0], reference([x, w, b], attrs) + z, rtol=1e-4,
                               atol=1e-4)


# The caches these tests plan for (the steps depend on an image's phase copy fitting
# BY_IMAGE_L2_SHARE of the L2): a 2 MiB L2, whatever this machine's.
L2_2MIB = cpu_planner.Caches(l2=2 << 20, llc=32 << 20, source="a 2 MiB L2 (the test's)")


def test_an_image_over_the_l2_share_keeps_one_image_a_step() -> None:
    """ResNet-18's 64 -> 128 3x3 conv (an 841 KiB phase copy an image) on 16 threads: whole
    images per thread with a 2 MiB L2, one image a step with a 1 MiB one."""
    geo = conv_geometry(Op.CONV, *RESNET_S2[0])
    assert cpu_planner.by_image_step(geo, 16, (8, 32), L2_2MIB)[0] == 16
    small = cpu_planner.Caches(l2=1 << 20, llc=32 << 20, source="a 1 MiB L2 (the test's)")
    step, why = cpu_planner.by_image_step(geo, 16, (8, 32), small)
    assert step == 1 and "BY_IMAGE_L2_SHARE" in why


@pytest.mark.parametrize("case", RESNET_S2[:3])
def test_whole_images_per_thread_where_an_image_would_split_its_rows(
        case: tuple[Any, ...]) -> None:
    """One thread, or threads that split an image's product by columns only, take an
    image a step; where one image's grid splits its rows too (16 threads on ResNet-18's
    stride-2 convs), a step takes as many images as threads, and says why."""
    geo = conv_geometry(Op.CONV, *case)
    pixels = geo.window.out_spatial[0] * geo.window.out_spatial[1]
    depth = geo.in_channels * geo.window.kernel[0] * geo.window.kernel[1]
    assert cpu_planner.by_image_step(geo, 1, (8, 32), L2_2MIB)[0] == 1
    for threads in (2, 3, 4, 16):
        one, stacked = (cpu_planner.gemm_split(1, geo.out_channels, k * pixels, depth,
                                               threads, (8, 32), L2_2MIB, raw=(False, True))
                        for k in (1, threads))
        step, why = cpu_planner.by_image_step(geo, threads, (8, 32), L2_2MIB)
        assert step == (threads if one.rows > 1 and stacked.rows < one.rows else 1)
        assert ("whole images per thread" in why) is (step > 1)
    assert cpu_planner.by_image_step(geo, 2, (8, 32), L2_2MIB)[0] == 1       # ResNet-18 on two
    assert cpu_planner.by_image_step(geo, 16, (8, 32), L2_2MIB)[0] == 16
    few = conv_geometry(Op.CONV, (5, *case[0][1:]), *case[1:])
    assert cpu_planner.by_image_step(few, 16, (8, 32), L2_2MIB)[0] in (1, 5)  # never past the batch


def test_the_plan_states_the_step() -> None:
    """The node's plan carries the step as its chunk, with the reason, for its threads,
    and the split it states is the stacked product's."""
    geo = conv_geometry(Op.CONV, *RESNET_S2[0])
    form = cpu_planner.conv_form("native", geo, 4, (8, 32), L2_2MIB, threads=16,
                                 vendor="Intel")
    assert form.layout == "gathered-images" and form.chunk == 16
    assert "whole images per thread" in form.chunk_reason
    splits = cpu_planner.conv_splits("native", form.layout, form.chunk, geo, 16, (8, 32),
                                     L2_2MIB, vendor="Intel")
    assert "1x16 tiles" in splits[-1].name and splits[0].units == 16 * geo.in_channels
    two = cpu_planner.conv_form("native", geo, 4, (8, 32), L2_2MIB, threads=2,
                                vendor="Intel")
    assert two.chunk == 1 and "by columns" in two.chunk_reason
