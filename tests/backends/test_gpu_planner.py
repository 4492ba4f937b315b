"""The gpu planner's rules: its own kernels where they serve, the shared xp kernel
elsewhere, never a cpu rule; launch shapes; checked without a GPU (fake CuPy)."""

from __future__ import annotations

import numpy as np
import pytest

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.gpu import fused_scatter, planner
from keel.backends.gpu.backend import GpuBackend
from keel.backends.plan import Measured, NodePlan
from keel.backends.registry import builtin_registry
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.backends.fakes import FakeCupy
from tests.conformance.harness import case_inputs, collect_cases

F32, F16, F64 = DType.FLOAT32, DType.FLOAT16, DType.FLOAT64


def _gpu() -> GpuBackend:
    return GpuBackend(cupy_module=FakeCupy())


def _plan(op: Op, dtype: DType, shapes: list[tuple[int, ...]], **attrs: object) -> NodePlan:
    return _gpu().plan_node(op, [TensorType(dtype, s) for s in shapes], attrs)


@pytest.mark.parametrize(("op", "shapes", "variant"), [
    (Op.LAYER_NORM, [(32, 128, 256), (256,), (256,)], "fused"),
    (Op.SKIP_LAYER_NORM, [(32, 128, 256), (32, 128, 256), (256,), (256,)], "fused"),
    (Op.SOFTMAX, [(32, 4, 128, 128)], "fused"),
    (Op.LOG_SOFTMAX, [(32, 10)], "fused"),
    (Op.GELU, [(32, 128, 1024)], "fused"),
    (Op.RELU, [(32, 512)], "fused"),
    (Op.GEMM, [(32, 512), (512, 512), (512,)], "cublas"),
    (Op.MATMUL, [(32, 128, 256), (256, 1024), (1024,)], "cublas"),
    (Op.ATTENTION, [(32, 4, 128, 64), (32, 4, 128, 64), (32, 4, 128, 64)], "fused"),
    (Op.MAX_POOL, [(32, 64, 112, 112)], "direct"),
    (Op.GLOBAL_AVG_POOL, [(32, 512, 7, 7)], "direct"),
])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_gpu_kernels_are_preferred_with_the_reason(op: Op, shapes: list[tuple[int, ...]],
                                                   variant: str, dtype: DType) -> None:
    plan = _plan(op, dtype, shapes)
    assert plan.variant == variant
    assert "the gpu's own kernel" in plan.reason("variant")
    assert "not measured on a GPU" in plan.reason("variant")


def test_other_dtypes_run_the_shared_kernel_and_say_why() -> None:
    plan = _plan(Op.LAYER_NORM, F64, [(4, 8), (8,)])
    assert plan.variant == "default"
    assert "fused takes bfloat16, float16, float32, the node is float64" in \
        plan.reason("variant")
    stashed = _plan(Op.LAYER_NORM, F32, [(4, 8), (8,)], stash_type=11)
    assert stashed.variant == "default"
    assert "stash_type 11" in stashed.reason("variant")


def test_no_cpu_rule_ever_picks_a_gpu_variant() -> None:
    """Outside convolution, only the shared default or a gpu-only kernel runs: never a
    variant the cpu's rules would choose (native, blocked, winograd...)."""
    gpu = _gpu()
    for op in gpu.kernels.ops() - {Op.CONV}:
        variants = gpu.kernels.variants(op)
        for dtype in (F32, F16):
            plan = gpu.plan_node(op, [TensorType(dtype, (2, 3, 4, 4))], {})
            chosen = variants[plan.variant]
            assert plan.variant == "default" or chosen.meta.get("gpu"), (op, plan.variant)
            assert "requires" not in chosen.meta


def test_shared_and_own_defaults_are_told_apart() -> None:
    add = _plan(Op.ADD, F32, [(4,), (4,)])
    assert add.variant == "default" and "the shared xp kernel" in add.reason("variant")
    low = _plan(Op.REDUCE_MIN, F32, [(4, 4)])
    assert low.variant == "default" and "the gpu's own kernel" in low.reason("variant")


def test_a_measured_choice_overrides_the_rules() -> None:
    plan = _gpu().plan_node(Op.GEMM, [TensorType(F32, (2, 2)), TensorType(F32, (2, 2))], {},
                            measured=Measured("default", "measured: default 1.2x faster"))
    assert plan.variant == "default" and plan.reason("variant").startswith("measured")


@pytest.mark.parametrize(("k", "threads"), [(1, 32), (128, 32), (256, 64), (1000, 256),
                                            (4096, 1024), (10**7, 1024)])
def test_row_threads_are_whole_warps_within_a_block(k: int, threads: int) -> None:
    assert planner.row_threads(None, k) == threads


def test_launch_shapes_follow_a_plan_option() -> None:
    plan = NodePlan(variant="fused", options=(("row_threads", 128), ("block_threads", 64)))
    assert planner.row_threads(plan, 10**6) == 128
    assert planner.elementwise_threads(plan) == 64
    assert planner.elementwise_threads(None) == planner.ELEMENTWISE_BLOCK


_MIN_CASES = [c for c in collect_cases() if c.op is Op.REDUCE_MIN]


@pytest.mark.parametrize("case", _MIN_CASES, ids=[c.id for c in _MIN_CASES])
def test_reduce_min_formulation_matches_the_reference(case: object) -> None:
    """The gpu ReduceMin (the shared ReduceMax on the order-reversed input), run with
    NumPy as its array namespace, against the reference on every conformance case."""
    reference = builtin_registry().instance("reference")
    inputs = case_inputs(case)  # type: ignore[arg-type]
    expected = reference.run(Op.REDUCE_MIN, inputs, None, case.attrs)  # type: ignore[attr-defined]
    ctx = KernelContext(np, "gpu", DeviceKind.GPU)
    norm = get_schema(Op.REDUCE_MIN).normalize_attrs(case.attrs)  # type: ignore[attr-defined]
    got = fused_scatter.reduce_min(ctx, inputs, norm, None)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(g, e)


def test_scatter_positions_read_negative_indices_from_the_end() -> None:
    rows = np.array([[0, -1], [1, 0]])
    cols = np.array([[2, 0], [-3, 1]])
    flat = fused_scatter._flat(np, (rows, cols), (2, 3))
    assert flat.tolist() == [[2, 3], [3, 1]]


def test_gpu_kernels_off_runs_the_shared_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from keel.config import reload_settings

    monkeypatch.setenv("KEEL_GPU_KERNELS", "off")
    reload_settings()
    try:
        plan = _plan(Op.LAYER_NORM, F32, [(4, 8), (8,)])
    finally:
        monkeypatch.delenv("KEEL_GPU_KERNELS")
        reload_settings()
    assert plan.variant == "default"
    assert "fused: KEEL_GPU_KERNELS=off" in plan.reason("variant")
    assert _plan(Op.LAYER_NORM, F32, [(4, 8), (8,)]).variant == "fused"
