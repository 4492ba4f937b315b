"""Cache-bound plan sizes follow the caches of the machine planned for."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import keel
from keel.backends.cpu import planner
from keel.backends.cpu.backend import CpuBackend
from keel.dtypes import DType
from keel.hardware.cpu import cache_sizes
from keel.hardware.fakes import fake_machine, fake_profile
from keel.ops.registry import Op
from keel.ops.types import TensorType
from tests.native._conv_support import prepared_flags

F32 = DType.FLOAT32


def _layer_norm_block(profile: object) -> tuple[int, str]:
    plan = CpuBackend(threads=1).plan_node(
        Op.LAYER_NORM, [TensorType(F32, (64, 256)), TensorType(F32, (256,)),
                        TensorType(F32, (256,))], {"axis": -1, "epsilon": 1e-5},
        profile=profile)
    return plan.option("row_block"), plan.reason("row_block")


def test_the_probe_reads_cache_sizes_from_sysfs_and_sysctl() -> None:
    xeon = fake_profile("x86-avx512-server").cpu
    assert (xeon.l1d_cache_bytes, xeon.l2_cache_bytes, xeon.l3_cache_bytes) == (
        48 << 10, 2 << 20, 105 << 20)
    m2 = fake_profile("apple-m2-pro").cpu
    assert (m2.l1d_cache_bytes, m2.l2_cache_bytes, m2.l3_cache_bytes) == (64 << 10, 4 << 20,
                                                                          None)
    assert any(n.startswith("l3_cache_bytes:") for n in m2.notes)
    board = fake_profile("edge-arm-board").cpu
    assert board.l2_cache_bytes is None
    assert any(n.startswith("l2_cache_bytes:") for n in board.notes)
    # The planner's quick read answers what the full probe reads.
    assert cache_sizes(fake_machine("x86-avx512-server").sources()) == {
        "l1d_cache_bytes": 48 << 10, "l2_cache_bytes": 2 << 20, "l3_cache_bytes": 105 << 20}


def test_blocks_scale_with_the_profiles_l2() -> None:
    measured = planner.BLOCKS["row_block"]
    xeon, why = _layer_norm_block(fake_profile("x86-avx512-server"))
    assert xeon == 2 * measured                       # a 2 MiB L2 against the measured 1 MiB
    assert "Xeon(R) Platinum 8480+: L2 2048 KiB" in why
    zen3, _ = _layer_norm_block(fake_profile("container-2core-1gib"))
    assert zen3 == measured // 2                      # 512 KiB
    board, why = _layer_norm_block(fake_profile("edge-arm-board"))
    assert board == measured and "reads no cache sizes" in why


def test_this_machines_plan_uses_its_own_caches() -> None:
    here = cache_sizes()
    block, why = _layer_norm_block(None)
    l2 = here.get("l2_cache_bytes")
    if l2 is None:
        assert block == planner.BLOCKS["row_block"] and "reads no cache sizes" in why
    else:
        assert block == planner.caches().with_l2(planner.BLOCKS["row_block"])
        assert f"this machine: L2 {l2 >> 10} KiB" in why


@pytest.mark.parametrize("name", [None, "x86-avx512-server", "container-2core-1gib"])
def test_a_call_without_a_plan_blocks_as_the_plan_would(
        name: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # None: this machine's caches; a fake profile stands in for this machine's probe.
    profile = None if name is None else fake_profile(name)
    if profile is not None:
        monkeypatch.setattr(planner, "_here", lambda: planner.caches(profile))
    planned, _ = _layer_norm_block(profile)
    assert planner.block(None, "row_block") == planned


def test_the_non_temporal_threshold_follows_the_last_level_cache() -> None:
    from keel.ops.schemas.conv import conv_geometry

    # A 64 -> 64 3x3 conv at batch 8 on 112x112 writes 25.7 MB: past a 16 MiB cache,
    # within a 105 MiB one.
    geo = conv_geometry(Op.CONV, (8, 64, 112, 112), (64, 64, 3, 3),
                        {"pads": (1, 1, 1, 1), "strides": (1, 1), "dilations": (1, 1),
                         "group": 1})
    small = planner.Caches(1 << 20, 16 << 20, "test")
    large = planner.caches(fake_profile("x86-avx512-server"))
    assert planner.stream_stores(geo, small) and not planner.stream_stores(geo, large)


@pytest.mark.parametrize("name", ["x86-avx512-server", "container-2core-1gib"])
def test_a_model_planned_for_another_machine_shows_its_blocks(name: str) -> None:
    from tests.execution.test_dispatch import model_proto

    m = keel.load_model(model_proto(), backend="cpu", hardware=fake_profile(name))
    blocks = {n.plan.option("epilogue_block") for n in m.plan.nodes
              if n.plan is not None and n.op == "gemm"}
    l2 = fake_profile(name).cpu.l2_cache_bytes
    assert blocks == {planner.BLOCKS["epilogue_block"] * l2 // (1 << 20)}


def test_winograd_chunks_follow_the_last_level_cache() -> None:
    from keel.ops.schemas.conv import conv_geometry

    # 64 -> 64 3x3 on 56x56: 3.2 MB of transformed tiles an image.
    geo = conv_geometry(Op.CONV, (32, 64, 56, 56), (64, 64, 3, 3),
                        {"pads": (1, 1, 1, 1), "strides": (1, 1), "dilations": (1, 1),
                         "group": 1})
    measured = planner.winograd_form(geo, 4, planner.Caches(1 << 20, 32 << 20, "test"))
    assert measured.chunk == 1 and "within 4 MiB" in measured.reason
    xeon = planner.winograd_form(geo, 4, planner.caches(fake_profile("x86-avx512-server")))
    assert xeon.chunk == 4
    assert "scaled by rule to the caches of the profile's" in xeon.reason
    assert "Xeon(R) Platinum 8480+" in xeon.reason


def test_winograd_products_follow_the_vendor_planned_for() -> None:
    """A plan for a profile takes the form of its CPU's vendor (winograd_lanes), not this
    machine's: an AMD profile's products in lanes tiles, an Intel one's in 8 x 32 panels,
    on any machine."""
    from keel import native
    from keel.backends.cpu import winograd

    if winograd._functions() is None:    # the NumPy Winograd runs no products in tiles
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    reasons = {}
    for name in ("amd-sysfs-only", "x86-avx512-server"):
        profile = fake_profile(name)
        plan = CpuBackend(threads=1).plan_node(
            Op.CONV, [TensorType(F32, (1, 64, 56, 56)), TensorType(F32, (64, 64, 3, 3)),
                      TensorType(F32, (64,))],
            {"pads": (1, 1, 1, 1), "strides": (1, 1), "dilations": (1, 1), "group": 1,
             "kernel_shape": (3, 3)}, profile=profile)
        assert plan.variant == "winograd"
        reasons[profile.cpu.vendor] = plan.reason("winograd_pipeline")
    assert "products in lanes tiles" in reasons["AMD"]
    assert "products in 8 x 32 panels" in reasons["Intel"]


def _winograd_model() -> Any:
    """One 64 -> 64 3x3 conv on 56x56 (ResNet-18's first Winograd layers), bias, ReLU."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((64, 64, 3, 3)).astype(np.float32) / 24,
                                "w")
    b = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1],
                          kernel_shape=[3, 3]),
         helper.make_node("Relu", ["c"], ["y"])], "winograd",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 56, 56])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 56, 56])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("name", "lanes", "form"), [
    ("amd-sysfs-only", True, "products in lanes tiles"),
    ("x86-avx512-server", False, "products in 8 x 32 panels"),
    ("amd-rocm-server", False, "gemm.c builds lanes tiles with its 8 x 32 tiles only")])
def test_the_winograd_run_follows_the_vendor_planned_for(
        name: str, lanes: bool, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model planned for another machine's profile carries its vendor's and tile's
    Winograd tiles as the plan's winograd_lanes option (an AVX2 AMD server's 6 x 16 tiles
    have no lanes tiles, whatever its vendor), explain() names them, and the kernel runs
    them here whatever this machine's vendor, with the reference backend's result."""
    from keel.backends.cpu import native_gemm, winograd

    if winograd._functions() is None:    # the NumPy Winograd runs no products in tiles
        pytest.skip("native tier unavailable")
    model = keel.load_model(_winograd_model(), backend="cpu", hardware=fake_profile(name),
                            threads=1)      # one thread: the pipeline, its tiles the plan's
    convs = [n.plan for n in model.plan.nodes if n.plan is not None
             and n.plan.option("conv_variant", n.plan.variant) == "winograd"]
    assert len(convs) == 1 and convs[0].option("winograd_lanes") is lanes
    assert lanes or convs[0].option("winograd_pass_lanes") is False
    assert form in convs[0].reason("winograd_lanes") and form in model.explain()
    x = np.random.default_rng(4).standard_normal((1, 64, 56, 56)).astype(np.float32)
    model.run(None, {"x": x})             # packs the filters in every tiling once
    ran: list[bool] = []
    tiled, with_tiles = winograd._Products.tiled, native_gemm.with_tiles

    def spy_tiled(self: Any, tall: bool, lanes: bool) -> Any:
        ran.append(lanes)
        return tiled(self, tall, lanes)

    def spy_with_tiles(call: Any, tall: bool, lanes: bool) -> Any:
        ran.append(lanes)
        return with_tiles(call, tall, lanes)

    monkeypatch.setattr(winograd._Products, "tiled", spy_tiled)
    monkeypatch.setattr(native_gemm, "with_tiles", spy_with_tiles)
    got = model.run(None, {"x": x})[0]
    assert ran and set(ran) == {lanes}
    want = keel.load_model(_winograd_model(), backend="reference").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _one_conv(name: str, w: np.ndarray, x_shape: list[int], y_shape: list[int],
              **attrs: Any) -> Any:
    """A model of one bias-free Conv of the constant ``w``."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _passes_model() -> Any:
    """A 512 -> 256 3x3 conv on 12x12 at batch 2: run pass by pass on one thread for any
    L2 (U, 8 MiB, is read again by every pipeline block), its chunks' 36 or 72 tiles in
    lanes tiles by Intel's rule (32-column panels compute 1.78x or 1.33x them) and in
    panels by AMD's (B over the lanes tiles' LANES_MAX_B_BYTES)."""
    w = np.random.default_rng(8).standard_normal((256, 512, 3, 3)).astype(np.float32) / 64
    return _one_conv("passes", w, [2, 512, 12, 12], [2, 256, 12, 12], pads=[1, 1, 1, 1],
                     kernel_shape=[3, 3])


@pytest.mark.parametrize(("name", "lanes"), [("amd-sysfs-only", False),
                                             ("x86-avx512-server", True)])
def test_the_winograd_passes_run_the_tiles_of_the_vendor_planned_for(
        name: str, lanes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Winograd conv run pass by pass carries its chunks' lanes-tile choice for the
    vendor planned for as the plan's winograd_pass_lanes option, explain() says why, and
    every product call the passes run carries it here whatever this machine's vendor,
    with the reference backend's result."""
    from keel.backends.cpu import native_gemm, winograd

    if winograd._functions() is None:    # the NumPy Winograd runs no products in tiles
        pytest.skip("native tier unavailable")
    model = keel.load_model(_passes_model(), backend="cpu", hardware=fake_profile(name),
                            threads=1)
    convs = [n.plan for n in model.plan.nodes if n.plan is not None
             and n.plan.option("conv_variant", n.plan.variant) == "winograd"]
    assert len(convs) == 1 and convs[0].option("winograd_pass_lanes") is lanes
    why = convs[0].reason("winograd_pass_lanes")
    assert why.startswith("run pass by pass") and why in model.explain()
    assert ("in lanes tiles" if lanes else "in 8 x 32 panels") in why
    ran: list[bool] = []
    bound = native_gemm.Call.bound

    def spy(call: Any, threads: int, panel_major: bool = False) -> Any:
        ran.append(bool(int(call.values[native_gemm._FLAGS_FIELD]) & native_gemm._LANES))
        return bound(call, threads, panel_major)

    monkeypatch.setattr(native_gemm.Call, "bound", spy)
    x = np.random.default_rng(9).standard_normal((2, 512, 12, 12)).astype(np.float32)
    got = model.run(None, {"x": x})[0]
    assert ran and set(ran) == {lanes}        # no call: the pipeline ran, not the passes
    want = keel.load_model(_passes_model(), backend="reference").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def _expansion_model() -> Any:
    """MobileNetV2's 96 -> 576 1x1 conv on 14x14 at batch 1 (the direct form; its
    products in lanes tiles on AMD's cores, in panels on Intel's)."""
    w = np.random.default_rng(5).standard_normal((576, 96, 1, 1)).astype(np.float32) / 10
    return _one_conv("expansion", w, [1, 96, 14, 14], [1, 576, 14, 14])


@pytest.mark.parametrize(("name", "lanes"), [("amd-sysfs-only", True),
                                             ("x86-avx512-server", False),
                                             ("amd-rocm-server", False)])
def test_the_direct_conv_runs_the_tiles_of_the_vendor_planned_for(
        name: str, lanes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model planned for another machine's profile carries its vendor's lanes-tile
    choice for the direct conv as the plan's gemm_lanes option, explain() says it, and
    the prepared call carries it here whatever this machine's vendor, with the reference
    backend's result. An AVX2 AMD EPYC's 6 x 16 tiles have no lanes tiles (LANES_GRID),
    so the shape AMD's 8 x 32 build runs in them runs in panels there."""
    from keel.backends.cpu import native_gemm

    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    model = keel.load_model(_expansion_model(), backend="cpu", hardware=fake_profile(name),
                            threads=1)
    convs = [n.plan for n in model.plan.nodes if n.plan is not None]
    assert len(convs) == 1 and convs[0].layout == "direct"
    assert convs[0].option("gemm_lanes") is lanes
    explain = model.explain()
    assert (", in lanes tiles: 196 pixels" in explain) is lanes
    assert (", not in lanes tiles: 196 pixels" in explain) is not lanes
    ran = prepared_flags(monkeypatch, native_gemm._LANES)
    x = np.random.default_rng(6).standard_normal((1, 96, 14, 14)).astype(np.float32)
    got = model.run(None, {"x": x})[0]
    assert ran and set(ran) == {lanes}
    want = keel.load_model(_expansion_model(), backend="reference").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_pipeline_blocks_in_panels_hold_at_most_the_measured_tiles() -> None:
    """Where Winograd's products run in 8 x 32 panels (Intel) a pipeline block holds at
    most PIPELINE_PANELS_MAX_TILES tiles however large the L2, and the reason says so;
    the lanes tiles (AMD) keep the L2's limit."""
    two_mib = planner.Caches(2 << 20, 32 << 20, "test")
    intel = planner.winograd_pipeline(1, 64, 64, (56, 56), 1, two_mib, (8, 32),
                                       vendor="Intel")
    amd = planner.winograd_pipeline(1, 64, 64, (56, 56), 1, two_mib, (8, 32), vendor="AMD")
    assert intel.tiles == planner.PIPELINE_PANELS_MAX_TILES < amd.tiles
    assert "(PIPELINE_PANELS_MAX_TILES)" in intel.reason
    assert "PIPELINE_PANELS_MAX_TILES" not in amd.reason


def _product_model(op: str) -> Any:
    """A MatMul (its B a constant) or Gemm (both operands inputs) of MobileNetV2's
    96 -> 576 expansion's product shape, 576 rows x 196 columns of depth 96: lanes_tiles
    takes it on AMD's cores and not on Intel's."""
    from onnx import TensorProto, helper, numpy_helper

    b = np.random.default_rng(7).standard_normal((96, 196)).astype(np.float32) / 10
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [576, 96])]
    if op == "Gemm":
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [96, 196]))
    graph = helper.make_graph(
        [helper.make_node(op, ["a", "b"], ["y"])], "product", inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [576, 196])],
        [] if op == "Gemm" else [numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), b


@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
@pytest.mark.parametrize("name", ["amd-sysfs-only", "x86-avx512-server"])
def test_matmul_and_gemm_run_no_lanes_tiles_on_any_vendor(
        name: str, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gemm.c's lanes tiles take a packed A only (a conv's weights); a MatMul's or
    Gemm's A is an activation, so its products run outside them on every vendor: the
    plan carries no gemm_lanes option nor says lanes tiles, and the prepared call runs
    without them here, a shape lanes_tiles takes on AMD's cores planned for either."""
    from keel.backends.cpu import native_gemm

    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    assert planner.lanes_tiles(1, 576, 196, 96, "AMD", (8, 32))
    assert not planner.lanes_tiles(1, 576, 196, 96, "Intel", (8, 32))
    onnx_model, b = _product_model(op)
    model = keel.load_model(onnx_model, backend="cpu", hardware=fake_profile(name),
                            threads=1)
    plans = [n.plan for n in model.plan.nodes if n.plan is not None]
    assert len(plans) == 1 and plans[0].option("gemm_lanes") is None
    assert "lanes tiles" not in model.explain()
    ran = prepared_flags(monkeypatch, native_gemm._LANES)
    a = np.random.default_rng(8).standard_normal((576, 96)).astype(np.float32)
    feeds = {"a": a, "b": b} if op == "Gemm" else {"a": a}
    got = model.run(None, feeds)[0]
    assert ran and set(ran) == {False}
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def _pipeline_model() -> Any:
    """A 256 -> 256 3x3 conv on 14x14 at batch 1: on one thread, the per-thread pipeline
    (one block of 49 tiles) for a 2 MiB L2, pass by pass for a 512 KiB one (U, 2.25 MiB,
    read again by each of its blocks)."""
    w = np.random.default_rng(10).standard_normal((256, 256, 3, 3)).astype(np.float32) / 48
    return _one_conv("pipeline", w, [1, 256, 14, 14], [1, 256, 14, 14], pads=[1, 1, 1, 1],
                     kernel_shape=[3, 3])


def _ran_pipelines(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """What each compiled Winograd call runs: the pipeline's (tiles, panels, from the
    last, threads, chunks) as its C entry point receives them, or () for the passes."""
    import ctypes

    from keel.backends.cpu import winograd

    real = winograd._functions()
    assert real is not None
    ran: list[tuple[int, ...]] = []

    def fused(*args: Any) -> Any:
        sizes = (ctypes.c_int64 * 6).from_address(args[10])
        ran.append((sizes[0], sizes[1], sizes[4], sizes[5], args[11]))
        return real.fused(*args)

    def passes(*args: Any) -> Any:
        ran.append(())
        return real.input(*args)

    spied = dataclasses.replace(real, fused=fused, input=passes)
    monkeypatch.setattr(winograd, "_functions", lambda: spied)
    return ran


def test_the_plan_states_the_winograd_pipeline_and_the_kernel_runs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Planned for two profiles of other L2 sizes, one Winograd conv's plan states the
    pipeline for one and pass by pass for the other (winograd_pipeline, its reason in
    explain()), and here, whatever this machine's caches, the kernel runs what its plan
    states, on 1, 2, 3 and 16 threads: bitwise one result, the reference backend's."""
    from keel.backends.cpu import winograd

    if winograd._functions() is None:    # the NumPy Winograd has no pipeline
        pytest.skip("native tier unavailable")
    x = np.random.default_rng(11).standard_normal((1, 256, 14, 14)).astype(np.float32)
    want = keel.load_model(_pipeline_model(), backend="reference").run(None, {"x": x})[0]
    ran = _ran_pipelines(monkeypatch)
    results, stated = [], {}
    for name in ("x86-avx512-server", "container-2core-1gib"):
        for threads in (1, 2, 3, 16):
            model = keel.load_model(_pipeline_model(), backend="cpu",
                                    hardware=fake_profile(name), threads=threads)
            convs = [n.plan for n in model.plan.nodes if n.plan is not None
                     and n.plan.option("conv_variant", n.plan.variant) == "winograd"]
            assert len(convs) == 1
            option = convs[0].option("winograd_pipeline")
            assert option is not None and option[:2] == (1, threads)
            why = convs[0].reason("winograd_pipeline")
            assert why.startswith(f"on {threads} thread(s) ") and why in model.explain()
            pipe = planner.planned_pipeline(option, 1, threads)
            assert pipe is not None
            stated[name, threads] = pipe.tiles
            ran.clear()
            results.append(model.run(None, {"x": x})[0])
            assert ran == [(pipe.tiles, pipe.panels, int(pipe.last_first), pipe.threads,
                            pipe.parts) if pipe.tiles else ()]
            assert ("per-thread pipeline: " if pipe.tiles else "pass by pass: ") in why
    assert stated["x86-avx512-server", 1] == 49 and stated["container-2core-1gib", 1] == 0
    np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-4)
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


def test_a_plan_for_another_batch_or_threads_leaves_the_pipeline_to_the_rule() -> None:
    """A plan's pipeline is stated for its batch and threads: a call of another (one the
    planner did not see) takes the run-time rule."""
    pipe = planner.winograd_pipeline(1, 256, 256, (14, 14), 1,
                                     planner.caches(fake_profile("x86-avx512-server")))
    option = planner.pipeline_option(pipe, 1, 1)
    assert planner.planned_pipeline(option, 1, 1) == dataclasses.replace(
        pipe, reason="as planned (winograd_pipeline)")
    assert planner.planned_pipeline(option, 2, 1) is None
    assert planner.planned_pipeline(option, 1, 2) is None
    assert planner.planned_pipeline(None, 1, 1) is None


def _masked_model() -> Any:
    """A 64 -> 64 3x3 conv on 7x7 at batch 1 (the masked form; its product in lanes
    tiles with 8 x 32 tiles: 32-column panels compute 64 of its 49 pixels)."""
    w = np.random.default_rng(7).standard_normal((64, 64, 3, 3)).astype(np.float32) / 10
    return _one_conv("masked", w, [1, 64, 7, 7], [1, 64, 7, 7], pads=[1, 1, 1, 1])


def _planned_here_and_for(model: Any, name: str, x: np.ndarray, monkeypatch: Any,
                          flag: int) -> tuple[Any, list[bool], np.ndarray, np.ndarray]:
    """``model`` planned for profile ``name``: its conv's plan, whether each call it
    prepares here carries ``flag``, its output, and this machine's plan's output."""
    here = keel.load_model(model, backend="cpu", threads=1).run(None, {"x": x})[0]
    planned = keel.load_model(model, backend="cpu", hardware=fake_profile(name), threads=1)
    ran = prepared_flags(monkeypatch, flag)
    got = planned.run(None, {"x": x})[0]
    return planned, ran, got, here


@pytest.mark.parametrize(("name", "taken"), [("x86-avx512-server", True),
                                             ("windows-rtx4090", False),
                                             ("amd-sysfs-only", False)])
def test_the_lanes_tail_runs_as_the_plan_says(name: str, taken: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan carries whether its conv's products take lanes tails (gemm_lanes_tail, for
    the tile and vendor planned for: an AVX-512 Xeon's 8 x 32 tiles do, a Core i9's
    6 x 16 have no lanes tiles, AMD's were not measured), explain() says it, and the
    calls it prepares here run it so whatever this machine's rule, bit for bit this
    machine's plan's result."""
    from keel.backends.cpu import native_gemm

    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    x = np.random.default_rng(8).standard_normal((1, 96, 14, 14)).astype(np.float32)
    planned, ran, got, here = _planned_here_and_for(_expansion_model(), name, x,
                                                    monkeypatch, native_gemm._LANES_TAIL)
    convs = [n.plan for n in planned.plan.nodes if n.plan is not None]
    assert len(convs) == 1 and convs[0].option("gemm_lanes_tail") is taken
    assert f"gemm_lanes_tail: {taken} (" in planned.explain()
    assert ran and set(ran) == {taken}          # 196 = 6 x 32 + 4: a tail where taken
    np.testing.assert_array_equal(got, here)


@pytest.mark.parametrize(("name", "lanes"), [("x86-avx512-server", True),
                                             ("windows-rtx4090", False)])
def test_the_masked_conv_runs_the_tiles_of_the_grid_planned_for(
        name: str, lanes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The masked conv's plan carries masked_lanes for the tile planned for (gemm_lanes:
    an AVX2 Core i9's 6 x 16 tiles have no lanes tiles), explain() says it, and its
    prepared calls run it here, bit for bit this machine's plan's result."""
    from keel.backends.cpu import native_gemm

    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    x = np.random.default_rng(9).standard_normal((1, 64, 7, 7)).astype(np.float32)
    planned, ran, got, here = _planned_here_and_for(_masked_model(), name, x, monkeypatch,
                                                    native_gemm._LANES)
    convs = [n.plan for n in planned.plan.nodes if n.plan is not None]
    assert len(convs) == 1 and convs[0].layout == "masked"
    assert convs[0].option("gemm_lanes") is lanes
    assert ("(masked_lanes)" in planned.explain()) is lanes
    assert ran and set(ran) == {lanes}
    np.testing.assert_array_equal(got, here)


def test_a_masked_plan_in_lanes_tiles_packs_no_16_row_panels() -> None:
    """The masked form's products in lanes tiles read 8-row panels: its layout as
    planned packs no 16-row panels (native_a16 is the direct form's)."""
    from keel.backends.cpu import native_gemm
    from keel.ops.schemas.conv import conv_geometry

    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    geo = conv_geometry(Op.CONV, (1, 64, 7, 7), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]})
    form = planner.native_form(geo)[0]
    layout = planner.native_layout(geo)
    assert form == "masked" and layout.a16 is False
    assert layout.lanes is planner.native_tiles(geo, form)[0]


@pytest.mark.parametrize(("batch", "channels", "size", "stride", "kernel", "pads", "form"), [
    (1, 32, 8, 1, 3, 0, "wide"), (2, 32, 8, 1, 3, 0, "gathered-stacked"),
    (1, 32, 10, 1, 3, 0, "gathered"), (1, 64, 9, 1, 3, 1, "masked"),
    (1, 64, 56, 2, 3, 1, "nchw->nchw")])
def test_only_the_direct_form_plans_lanes_tails(
        batch: int, channels: int, size: int, stride: int, kernel: int, pads: int,
        form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the direct form's products take lanes tails (the others read B through row
    tables, column maps or masks; a channel-blocked conv, in a region or alone, runs no
    GEMM): their plans carry no gemm_lanes_tail, explain() names none, and none of their
    prepared calls takes one."""
    from keel.backends.cpu import native_gemm

    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    out = (size + 2 * pads - kernel) // stride + 1
    w = np.random.default_rng(10).standard_normal((64, channels, kernel, kernel))
    model = keel.load_model(_one_conv(form, w.astype(np.float32) / 10,
                                      [batch, channels, size, size], [batch, 64, out, out],
                                      pads=[pads] * 4, strides=[stride] * 2,
                                      kernel_shape=[kernel, kernel]),
                            backend="cpu", threads=1)
    convs = [n.plan for n in model.plan.nodes if n.plan is not None]
    if form != convs[0].layout:
        pytest.skip(f"planned here as {convs[0].layout!r}, not {form!r}")
    assert convs[0].option("gemm_lanes_tail") is None
    assert "gemm_lanes_tail" not in model.explain()
    ran = prepared_flags(monkeypatch, native_gemm._LANES_TAIL)
    x = np.random.default_rng(11).standard_normal((batch, channels, size, size))
    model.run(None, {"x": x.astype(np.float32)})
    assert not any(ran)
