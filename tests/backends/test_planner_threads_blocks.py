"""The cpu planner decides each MatMul / Gemm node's threads from its product's flops and
the NumPy kernels' cache blocks; the kernels run what the node plan says."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import matmul as cpu_matmul
from keel.backends.cpu import native_gemm
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.backend import CpuBackend
from keel.backends.plan import NodePlan
from keel.dtypes import DType
from keel.hardware.fakes import fake_profile
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType

F32 = DType.FLOAT32


def _plan(op: Op, *shapes: tuple[int, ...], threads: int = 2, profile: Any = None,
          **attrs: Any) -> NodePlan:
    backend = CpuBackend(threads=threads)
    full = dict(get_schema(op).normalize_attrs(attrs))
    return backend.plan_node(op, [TensorType(F32, s) for s in shapes], full, profile=profile)


@pytest.mark.parametrize(("a", "b", "want"), [((1, 784), (784, 512), 2), ((1, 16), (16, 16), 1),
                                              ((4, 64, 32), (32, 100), 2)])
def test_a_matmul_node_takes_threads_by_its_products_flops(
        a: tuple[int, ...], b: tuple[int, ...], want: int) -> None:
    plan = _plan(Op.MATMUL, a, b)
    flops = 2 * int(np.prod(a[:-1])) * a[-1] * b[-1]
    assert plan.threads == want
    why = plan.reason("threads")
    assert why.startswith(f"{want} kernel thread(s) of 2: ")
    assert (f"{flops:,} flops, at least {cpu_planner.MIN_FLOPS_PER_THREAD:,} per thread"
            in why)
    # A split native product says how its tiles fall (gemm_split's grid, tested apart).
    assert ("split" in why) == (want > 1 and plan.variant == "native")


@pytest.mark.parametrize(("a", "want"), [((1, 256), 2), ((4, 256), 2), ((9, 256), 2),
                                        ((1, 16), 1)])
def test_a_product_of_one_row_panel_splits_by_the_floats_of_b_it_streams(
        a: tuple[int, int], want: int) -> None:
    """Up to the micro-tile's rows (8 for AVX-512) a product with a weight B is bound by
    reading B, so its split counts B's floats (MIN_STREAM_FLOATS a thread): 1 and 4 rows
    of a 256 x 256 B (65,536 floats; 131,072 and 524,288 flops, under two threads'
    MIN_FLOPS_PER_THREAD) split; 9 rows count their flops alone (and split by them)."""
    if native_gemm.geometry() != (8, 32):
        pytest.skip("needs the native GEMM's AVX-512 tile (8 x 32)")
    b = (a[1], 256)
    flops = 2 * a[0] * a[1] * 256
    plan = _plan(Op.MATMUL, a, b)
    assert plan.variant == "native" and plan.threads == want
    why = plan.reason("threads")
    streamed = a[0] <= 8
    assert ("so the product streams B" in why) == streamed
    if streamed:
        assert (f"{a[1] * 256:,} floats of B, at least MIN_STREAM_FLOATS = "
                f"{cpu_planner.MIN_STREAM_FLOATS:,} per thread") in why
        assert (want > 1) == (a[1] * 256 >= 2 * cpu_planner.MIN_STREAM_FLOATS)
        # More threads than the flops alone ask for: the reason says so.
        by_flops = max(1, min(2, flops // cpu_planner.MIN_FLOPS_PER_THREAD))
        assert (f"(the flops alone: {by_flops} thread(s))" in why) == (by_flops < want)
    else:
        assert want == min(2, flops // cpu_planner.MIN_FLOPS_PER_THREAD)
    assert ("split" in why) == (want > 1)


def test_a_product_whose_b_is_computed_per_call_does_not_stream_it() -> None:
    """MatMul(x, Relu(z)): B is packed at every call, not a weight streamed from a kept
    packing, so the plan neither says it streams B nor splits by B's floats (1 x 256 x
    256: 131,072 flops, one thread), and its pass (node_splits) is not split; the same
    product with a constant B splits by B's floats."""
    if native_gemm.geometry() != (8, 32):
        pytest.skip("needs the native GEMM's AVX-512 tile (8 x 32)")
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["z"], ["r"]), helper.make_node("MatMul", ["x", "r"], ["y"])],
        "per_call_b",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [256, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])])
    from keel.execution.model import load_model

    loaded = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                        backend="cpu", threads=2)
    plans = [n.plan for n in loaded.plan.nodes if n.op == Op.MATMUL.value]
    assert len(plans) == 1 and plans[0] is not None and plans[0].threads == 1
    assert "streams B" not in plans[0].reason("threads")
    assert "streams B" not in loaded.explain()
    types = [TensorType(F32, (1, 256)), TensorType(F32, (256, 256))]
    for constants, pieces in (((False, False), 1), ((False, True), 2)):
        plan = CpuBackend(threads=2).plan_node(Op.MATMUL, types, {}, constants=constants)
        assert plan.threads == pieces
        split = cpu_planner.node_splits(Op.MATMUL, types, {}, plan, 2, constants=constants)
        assert len(split) == 1 and split[0].pieces == pieces
    rng = np.random.default_rng(5)
    x, z = (rng.standard_normal(s).astype(np.float32) for s in ((1, 256), (256, 256)))
    got = loaded.predict({"x": x, "z": z})["y"]
    np.testing.assert_allclose(got, x @ np.maximum(z, 0), rtol=1e-4, atol=1e-4)


def test_the_gemm_split_counts_b_s_floats_only_where_b_is_packed_once() -> None:
    """At run time (gemm_split, asked again by the kernel): a B packed per call (an
    activation, ``raw``) is not streamed from a kept packing, so flops decide."""
    grid = (8, 32)
    weight = cpu_planner.gemm_split(1, 1, 256, 256, 2, grid, raw=(True, False))
    activation = cpu_planner.gemm_split(1, 1, 256, 256, 2, grid, raw=(True, True))
    assert (weight.rows, weight.cols, weight.parts) == (1, 2, 2)
    assert activation.parts == 1
    assert activation.reason.startswith("not split: 131,072 flops, under ")
    assert "floats of B" not in activation.reason
    # B's floats at least the least work of one thread, but under two threads' worth.
    least = cpu_planner.least_work(cpu_planner.LeastWork.STREAM, 2)
    k = least // 256 + 1
    assert least <= 256 * k < 2 * least
    small = cpu_planner.gemm_split(1, 1, 256, k, 2, grid, raw=(True, False))
    assert small.parts == 1 and small.reason.endswith(
        f"and {256 * k:,} floats of B, under {least:,} for each of two threads")


def test_a_gemm_node_counts_its_transposed_operands() -> None:
    plan = _plan(Op.GEMM, (512, 8), (512, 784), trans_a=1)     # 8 x 512 @ 512 x 784
    assert plan.threads == 2 and f"{2 * 8 * 512 * 784:,} flops" in plan.reason("threads")
    assert _plan(Op.GEMM, (4, 4), (4, 4), threads=1).threads == 1


def test_other_nodes_keep_the_backends_threads() -> None:
    plan = _plan(Op.RELU, (1, 8))
    assert plan.threads == 2 and "the backend's thread count" in plan.reason("threads")


@pytest.mark.parametrize(("op", "shapes", "name"), [
    (Op.MATMUL, ((2, 8), (8, 4)), "epilogue_block"),
    (Op.ATTENTION, ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), "attention_block"),
    (Op.LAYER_NORM, ((2, 8), (8,)), "row_block"),
    (Op.SOFTMAX, ((2, 8),), "row_block"),
])
def test_blocked_kernels_get_their_block_in_the_plan(
        op: Op, shapes: tuple[tuple[int, ...], ...], name: str) -> None:
    """Planned for a Xeon Gold 6230 (1 MiB L2, the L2 the blocks were measured on), the
    block is the measured one, which the kernel runs with (blocks that scale with other
    caches, and a call without a plan: tests/backends/test_plan_caches.py)."""
    plan = _plan(op, *shapes, profile=fake_profile("container-v1-2core-1gib"))
    assert plan.option(name) == cpu_planner.BLOCKS[name]
    assert plan.reason(name).startswith(f"{name} {cpu_planner.BLOCKS[name]}: ")
    assert "Xeon(R) Gold 6230 CPU @ 2.10GHz: L2 1024 KiB" in plan.reason(name)
    assert plan.to_dict()["options"][name] == cpu_planner.BLOCKS[name]
    assert cpu_planner.block(plan, name) == cpu_planner.BLOCKS[name]


def test_the_matmul_kernel_splits_its_product_as_the_plan_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    seen: list[int] = []
    real = native_gemm.Call.bound

    def spy(self: native_gemm.Call, threads: int) -> Any:
        seen.append(threads)
        return real(self, threads)

    monkeypatch.setattr(native_gemm.Call, "bound", spy)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal((256, 128)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    for planned in (1, 2):
        plan = NodePlan(variant="default", threads=planned)
        ctx = KernelContext(np, "cpu", DeviceKind.CPU, 2, None, plan)
        y = np.empty((64, 128), np.float32)
        got = cpu_matmul.matmul(ctx, [a, b], {}, [y])[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
        assert seen[-1] == planned


def _profile(level: str) -> Any:
    from keel.hardware.profile import CpuInfo, HardwareProfile

    return HardwareProfile(cpu=CpuInfo(brand=f"Test CPU {level}", simd_level=level))


@pytest.mark.parametrize("level", ["avx512", "avx2", "neon"])
def test_a_plan_for_another_machine_uses_its_native_tile_and_names_it(level: str) -> None:
    """The band form needs 32-column panels (AVX-512's tile): a profile decides it."""
    if not native_gemm.available():
        pytest.skip("native tier unavailable")
    profile = _profile(level)
    grid = cpu_planner.tile_grid(profile)
    attrs = dict(get_schema(Op.CONV).normalize_attrs({"strides": (2, 2), "pads": (1, 1, 1, 1)}))
    plan = CpuBackend(threads=1).plan_node(
        Op.CONV, [TensorType(F32, (32, 3, 224, 224)), TensorType(F32, (32, 3, 3, 3))], attrs,
        profile=profile)
    assert plan.variant == "native"
    assert grid is not None and (plan.layout == "band") is (grid[1] == 32)
    named = f"planned for the profile's Test CPU {level} ({level})" in plan.reason("layout")
    assert named is (grid != native_gemm.geometry())


def test_a_profile_of_this_cpus_level_plans_as_this_machine() -> None:
    here = CpuBackend().simd_level
    if here is None or not native_gemm.available():
        pytest.skip("SIMD level or native tier unknown here")
    assert cpu_planner.tile_grid(_profile(here)) == native_gemm.geometry()


@pytest.mark.parametrize(("op", "shape", "want"), [
    (Op.LAYER_NORM, (1, 1, 256), 1), (Op.LAYER_NORM, (1, 128, 256), 2),
    (Op.SOFTMAX, (4, 128), 1), (Op.GELU, (32, 128, 1024), 2),
    (Op.TRANSPOSE, (1, 128, 4, 64), 1), (Op.TRANSPOSE, (8, 128, 4, 64), 2)])
def test_row_and_copy_nodes_take_threads_by_their_elements(
        op: Op, shape: tuple[int, ...], want: int) -> None:
    """A tiny node (a block at sequence 1) plans one thread, as its kernel would split."""
    shapes = [shape, (shape[-1],)] if op is Op.LAYER_NORM else [shape]
    attrs = {"perm": (0, 2, 1, 3)} if op is Op.TRANSPOSE else {}
    plan = _plan(op, *shapes, **attrs)
    least = (cpu_planner.MIN_COPY_ELEMENTS if op is Op.TRANSPOSE
             else cpu_planner.MIN_CHUNK_ELEMENTS)
    assert plan.threads == want
    assert f"{want} kernel thread(s) of 2: {int(np.prod(shape)):,} elements" in \
        plan.reason("threads") and f"at least {least:,} per thread" in plan.reason("threads")


@pytest.mark.parametrize(("seq", "want"), [(48, 1), (64, 1), (96, 2), (128, 2)])
def test_skip_layer_norm_nodes_split_from_their_own_least_work(seq: int, want: int) -> None:
    """Two threads only where each gets MIN_SKIP_NORM_ELEMENTS: BERT-mini at batch 1
    (sequence 128) splits, a sequence of 64 (16,384 elements) does not."""
    plan = _plan(Op.SKIP_LAYER_NORM, (1, seq, 256), (1, seq, 256), (256,))
    assert plan.threads == want
    assert (f"{want} kernel thread(s) of 2: {seq * 256:,} elements, at least "
            f"{cpu_planner.MIN_SKIP_NORM_ELEMENTS:,} per thread (MIN_SKIP_NORM_ELEMENTS)"
            in plan.reason("threads"))


@pytest.mark.parametrize(("seq", "want"), [(1, 1), (128, 2)])
def test_attention_nodes_take_threads_by_their_scores(seq: int, want: int) -> None:
    q = (1, 4, seq, 64)                     # the small block at sequence 1, BERT-mini's
    plan = _plan(Op.ATTENTION, q, q, q)
    assert plan.threads == want
    assert f"{4 * seq * seq * 128:,} elements" in plan.reason("threads")


def test_a_block_at_batch_one_splits_its_weight_products_with_the_same_bits() -> None:
    """The benchmarks' small block at sequence 1 (hidden 256, FFN 1024): each product
    streams its weight B, so on two threads or more each splits by columns, and the
    output has the same bits on every thread count; on one thread nothing splits."""
    if not native_gemm.available():
        pytest.skip("needs the native GEMM")
    from benchmarks import zoo
    from keel.execution.model import load_model

    model = zoo.build("small_block")
    x = np.random.default_rng(3).standard_normal((1, 1, 256)).astype(np.float32)
    outs = {}
    for threads in (1, 2, 3, 16):
        loaded = load_model(model, backend="cpu", threads=threads)
        outs[threads] = loaded.predict({"hidden_states": x})["out"]
        streamed = [line for line in loaded.explain().splitlines()
                    if "so the product streams B" in line]
        assert len(streamed) == 6                   # Q, K, V, the output and the FFN's two
        assert all(("by columns split" in line) == (threads > 1) for line in streamed)
    for threads, out in outs.items():
        assert np.array_equal(out, outs[1]), threads
