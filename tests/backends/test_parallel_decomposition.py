"""Work that must reach keel's threads on a many-core machine: stride-2 convs the rules
give to BLAS run on the native implicit GEMM on any thread count (other convs from two
threads on), a Transpose's copy splits where it pays, the native conv's
stride-phase copy splits over planes, and fused attention splits over batch x heads.
Each checked against the reference backend and for bitwise-equal results across
thread counts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel import native
from keel.backends.base import KernelContext, KernelVariant
from keel.backends.cpu import conv_gemm, fastmath, native_gemm, native_window
from keel.backends.cpu import kernels as cpu_kernels
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.backend import CpuBackend, blas_threads
from keel.backends.cpu.kernels import TABLE
from keel.backends.plan import NodePlan
from keel.backends.reference.backend import ReferenceBackend
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.conv import conv_geometry
from keel.ops.types import TensorType

F32 = DType.FLOAT32


@pytest.fixture(autouse=True)
def _native_tier() -> None:
    if not (native_gemm.available() and native_window.ready() and fastmath.available()):
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    cpu_kernels.load()                # the kernel families, for TABLE.get alone


def _conv_plan(x: tuple[int, ...], w: tuple[int, ...], threads: int, **attrs: Any) -> NodePlan:
    full = dict(get_schema(Op.CONV).normalize_attrs(attrs))
    return CpuBackend(threads=threads).plan_node(
        Op.CONV, [TensorType(F32, x), TensorType(F32, w), TensorType(F32, (w[0],))], full)


STRIDED = [
    ((32, 128, 28, 28), (256, 128, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((32, 64, 56, 56), (128, 64, 1, 1), {"strides": (2, 2)}),
    ((1, 256, 14, 14), (512, 256, 1, 1), {"strides": (2, 2)}),
]


@pytest.mark.parametrize(("x", "w", "attrs"), STRIDED)
def test_stride_2_convs_run_natively_on_any_thread_count(
        x: tuple[int, ...], w: tuple[int, ...], attrs: dict[str, Any]) -> None:
    """The native conv beats im2col and the pointwise GEMM on one thread there too, so
    the same kernel (the same bits) runs whatever the thread count."""
    for threads in (1, 2, 4, 16):
        plan = _conv_plan(x, w, threads, **attrs)
        assert plan.variant == "native"
        why = plan.reason("variant")
        assert f"native on {threads} keel thread(s), not " in why and "strided" in why
        assert "the rules without it: " in why and "im2col" in why


# A 5x5 stride-1 conv of 128 channels: im2col by the rules (no Winograd for 5x5, more
# channels than the native rule takes).
UNSTRIDED = ((32, 128, 14, 14), (128, 128, 5, 5), {"pads": (2, 2, 2, 2)})


def test_stride_1_convs_leave_blas_for_keels_threads_from_two_threads() -> None:
    x, w, attrs = UNSTRIDED
    one = _conv_plan(x, w, 1, **attrs)
    assert one.variant in cpu_planner.BLAS_CONV_VARIANTS      # the rules' choice on 1 thread
    for threads in (2, 4, 16):
        plan = _conv_plan(x, w, threads, **attrs)
        assert plan.variant == "native"
        why = plan.reason("variant")
        assert f"native on {threads} keel threads, not {one.variant}" in why
        assert one.reason("variant") in why                  # what 1 thread would run, why


def test_convs_the_rules_keep_off_blas_are_left_alone() -> None:
    """A 3x3 stride-1 conv of 128 channels stays on Winograd at any thread count."""
    for threads in (1, 2, 16):
        plan = _conv_plan((32, 128, 28, 28), (128, 128, 3, 3), threads, pads=(1, 1, 1, 1))
        assert plan.variant == "winograd"


PHASE_CASES = [
    ((2, 5, 9, 7), (11, 5, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, "masked"),
    ((3, 8, 16, 16), (12, 8, 1, 1), {"strides": (2, 2)}, "masked"),
    ((2, 4, 12, 12), (5, 4, 3, 3), {"pads": (1, 1, 1, 1), "strides": (3, 3)}, "masked"),
    ((2, 3, 13, 13), (8, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, "gathered"),
    ((2, 6, 10, 11), (4, 6, 3, 3), {"pads": (0, 1, 2, 1), "strides": (2, 2)}, "gathered"),
    # stride-2 rows of 16 or more: whole vectors of the permuted copy and a partial one
    ((2, 3, 34, 70), (4, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, "masked"),
    ((2, 3, 33, 67), (4, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, "gathered"),
    ((1, 4, 64, 64), (8, 4, 1, 1), {"strides": (2, 2)}, "masked"),
    # ResNet-18's stem at batch 1: 3 planes, copied in bands of rows on 2 threads or more
    ((1, 3, 224, 224), (8, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, "gathered"),
]


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs", "form"), PHASE_CASES)
def test_the_phase_copy_on_keels_threads_is_numpys_copy(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any],
        form: str) -> None:
    geo = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    layout = conv_gemm.native_layout(geo, form)
    assert layout.copied and layout.fills
    x = _rand(np.random.default_rng(1), *x_shape)
    want = np.zeros((len(layout.fills), *x_shape[:2], *layout.q), np.float32)
    for f, (dst, src) in enumerate(layout.fills):
        want[(f, slice(None), slice(None), *dst)] = x[(slice(None), slice(None), *src)]
    for threads in (1, 2, 3, 16):
        got = np.zeros_like(want)
        copy = conv_gemm.bind_phase_copy(layout, x, got, threads)
        assert copy is not None
        copy()
        assert np.array_equal(got, want)


@pytest.mark.parametrize("threads", [2, 3, 16])
def test_a_few_planes_are_copied_in_bands_of_rows_on_every_thread(threads: int) -> None:
    """The stem's 3 planes alone split unevenly on 2 threads and leave 13 of 16 idle."""
    bands, pieces = cpu_planner.phase_copy_split(3, 224, 224, threads)
    assert pieces == threads if threads < 16 else pieces > 3     # 16: the least work decides
    units = 3 * bands
    assert -(-units // pieces) * pieces <= cpu_planner.EVEN_SPLIT * units
    assert (bands > 1) == (threads != 3)
    assert cpu_planner.phase_copy_split(64, 56, 56, threads)[0] == 1   # enough planes


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_a_strided_1d_conv_is_planned_and_runs(threads: int) -> None:
    """A 1-D stride-2 conv (a speech encoder's second conv): its copy splits by planes
    (window.c's phase copy takes 2-D planes only), and it runs as the reference does."""
    from onnx import TensorProto, helper, numpy_helper

    import keel

    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(_rand(rng, 32, 32, 3), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1], strides=[2])], "conv1d",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32, 300])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    blob = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()
    x = {"x": _rand(rng, 2, 32, 300)}
    got = keel.load_model(blob, backend="cpu", threads=threads, plan_cache=False).predict(x)
    want = keel.load_model(blob, backend="reference").predict(x)
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-4)


def test_the_phase_copy_refuses_what_it_cannot_copy() -> None:
    geo = conv_geometry(Op.CONV, (2, 4, 8, 8), (4, 4, 3, 3),
                        {"pads": (1, 1, 1, 1), "strides": (2, 2)})
    layout = conv_gemm.native_layout(geo, "masked")
    x = np.zeros((2, 4, 8, 8), np.float32)
    image = np.zeros((len(layout.fills), 2, 4, *layout.q), np.float32)
    assert conv_gemm.bind_phase_copy(layout, x[:, :, ::1, ::-1], image, 2) is None
    assert conv_gemm.bind_phase_copy(layout, x.astype(np.float64), image, 2) is None
    assert conv_gemm.bind_phase_copy(layout, x, image[:, :1], 2) is None


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs", "form"), PHASE_CASES)
def test_strided_native_convs_match_the_reference_and_every_thread_count(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any],
        form: str) -> None:
    """Through the conv node's steady state (prepared calls, X refilled each run)."""
    rng = np.random.default_rng(9)
    w, b = _rand(rng, *w_shape), _rand(rng, w_shape[0])
    w.setflags(write=False)
    b.setflags(write=False)
    full = dict(get_schema(Op.CONV).normalize_attrs(attrs))
    kernel = TABLE.get(Op.CONV, "native")
    assert kernel.prepack is not None
    x = _rand(rng, *x_shape)
    want = np.asarray(ReferenceBackend().run(Op.CONV, [x, w, b], attrs=attrs)[0])
    results = []
    for threads in (1, 2, 3):
        state = kernel.prepack(KernelContext(np, "cpu", "cpu", threads, None), [None, w, b],
                               full)
        ctx = KernelContext(np, "cpu", "cpu", threads, state)
        y = np.empty(want.shape, np.float32)
        for _ in range(2):                     # the prepared run, then a new X
            x_run = x.copy()
            (got,) = kernel.fn(ctx, [x_run, w, b], full, [y])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        results.append(got.copy())
    assert all(np.array_equal(r, results[0]) for r in results[1:])


def _attention(inputs: list[Any], threads: int, **attrs: Any) -> np.ndarray:
    full = dict(get_schema(Op.ATTENTION).normalize_attrs(attrs))
    plan = CpuBackend(threads=threads).plan_node(
        Op.ATTENTION, [TensorType(DType.from_numpy(a.dtype), a.shape) for a in inputs], full)
    out = np.empty((*inputs[0].shape[:-1], inputs[2].shape[-1]), np.float32)
    ctx = KernelContext(np, "cpu", "cpu", threads, None, plan=plan)
    (y,) = TABLE.get(Op.ATTENTION).fn(ctx, inputs, full, [out])
    return y


@pytest.mark.parametrize("mask", ["", "additive", "bool", "causal"])
def test_attention_splits_over_heads_with_the_same_bits_on_every_thread_count(
        mask: str) -> None:
    rng = np.random.default_rng(4)
    q, k, v = _rand(rng, 3, 5, 24, 16), _rand(rng, 3, 5, 40, 16), _rand(rng, 3, 5, 40, 8)
    inputs: list[Any] = [q, k, v]
    attrs: dict[str, Any] = {}
    if mask == "additive":
        inputs.append(np.where(rng.random((3, 1, 1, 40)) < 0.3, -1e4, 0).astype(np.float32))
    elif mask == "bool":
        keep = rng.random((3, 5, 24, 40)) < 0.6
        keep[..., 0] = True
        inputs.append(keep)
    elif mask == "causal":
        q = _rand(rng, 3, 5, 40, 16)
        inputs, attrs = [q, k, v], {"is_causal": True}
    want = np.asarray(ReferenceBackend().run(Op.ATTENTION, inputs, attrs=attrs)[0])
    one = _attention(inputs, 1, **attrs)
    np.testing.assert_allclose(one, want, rtol=1e-5, atol=2e-6)
    for threads in (2, 3, 4, 16):
        assert np.array_equal(_attention(inputs, threads, **attrs), one)


@pytest.mark.parametrize("batch", [(2, 3), (1, 2)])
@pytest.mark.parametrize("mask", ["", "additive", "bool", "causal"])
def test_attention_takes_whole_heads_per_thread_with_the_bits_of_the_steps(
        mask: str, batch: tuple[int, int]) -> None:
    """Each thread runs its heads, or blocks of their query rows where the heads are
    fewer than the threads, through the products and the softmax in its own scratch
    (gemm.c's keel_attention_f32): the same bits on 1, 2, 3 and 16 threads, and those of
    the products and softmax run step by step over blocks of heads."""
    from keel.backends.cpu import matmul

    rng = np.random.default_rng(5)
    s, t = 33, 70
    q, k, v = _rand(rng, *batch, s, 16), _rand(rng, *batch, t, 16), _rand(rng, *batch, t, 24)
    m = {"": None, "causal": None,
         "additive": np.where(rng.random((batch[0], 1, 1, t)) < 0.3, -1e4, 0).astype(
             np.float32),
         "bool": rng.random((*batch, s, t)) < 0.7}[mask]
    causal = mask == "causal"
    heads = batch[0] * batch[1]
    q3, k3, v3 = (a.reshape(heads, *a.shape[2:]) for a in (q, k, v))
    steps = np.empty((heads, s, 24), np.float32)
    matmul._attention_steps(q3, k3, v3, m, steps, batch, 0.25, causal, 65536, 2)
    for threads in (1, 2, 3, 16):
        y = np.full((heads, s, 24), np.nan, np.float32)
        assert matmul._attention_whole_heads(q3, k3, v3, m, y, batch, 0.25, causal, threads)
        assert np.array_equal(y, steps, equal_nan=True)
    want = np.asarray(ReferenceBackend().run(
        Op.ATTENTION, [q, k, v] if m is None else [q, k, v, m],
        attrs={"scale": 0.25, "is_causal": causal})[0])
    np.testing.assert_allclose(steps.reshape(want.shape), want, rtol=1e-5, atol=2e-6)


def test_attention_cuts_rows_only_where_the_heads_are_fewer_than_the_threads() -> None:
    rows = cpu_planner.tile_grid()[0] if cpu_planner.tile_grid() else 4
    assert cpu_planner.attention_split(128, 128, 16) == (1, 16)     # BERT-mini, batch 32
    assert cpu_planner.attention_split(4, 128, 2) == (1, 2)
    assert cpu_planner.attention_split(4, 128, 16) == (4, 16)       # batch 1: 4 x 4 blocks
    assert cpu_planner.attention_split(3, 128, 16) == (6, 16)
    assert cpu_planner.attention_split(1, rows, 16) == (1, 1)       # one row panel
    assert "query rows" in cpu_planner.attention_split_reason(4, 128, 16)
    assert "query rows" not in cpu_planner.attention_split_reason(4, 128, 4)


def test_a_bound_native_attention_gives_the_kernels_bits() -> None:
    """A program step binds the native attention once (its calls prepared on the step's
    arrays); each run gives the bits of the kernel's own call, on 1, 2 and 16 threads."""
    rng = np.random.default_rng(6)
    q, k, v = _rand(rng, 1, 3, 40, 16), _rand(rng, 1, 3, 40, 16), _rand(rng, 1, 3, 40, 8)
    full = dict(get_schema(Op.ATTENTION).normalize_attrs({}))
    attention = TABLE.get(Op.ATTENTION)
    assert attention.bind is not None
    for threads in (1, 2, 16):
        want = _attention([q, k, v], threads)
        y = np.full(want.shape, np.nan, np.float32)
        ctx = KernelContext(np, "cpu", "cpu", threads, None)
        run = attention.bind(ctx, [q, k, v], full, [y])
        assert run is not None
        for _ in range(2):
            q[...] = _rand(rng, 1, 3, 40, 16)       # new values in the same arrays
            run()
            assert np.array_equal(y, _attention([q, k, v], threads))


def test_attention_heads_per_block_grow_with_the_threads() -> None:
    assert cpu_planner.attention_heads(65536, 128 * 128, 128, 1) == 4
    assert cpu_planner.attention_heads(65536, 128 * 128, 128, 16) == 64
    assert cpu_planner.attention_heads(65536, 512 * 512, 8, 4) == 4      # one head each
    assert cpu_planner.attention_heads(65536, 16, 3, 8) == 3             # all there are


def test_fused_attention_counts_as_native_work_on_float32() -> None:
    attention = TABLE.get(Op.ATTENTION)
    blas = KernelVariant(Op.MATMUL, "default", attention.fn)
    assert blas_threads(4, [(attention, F32, 90.0), (blas, F32, 10.0)])[0] == 1
    assert blas_threads(4, [(attention, DType.FLOAT64, 90.0), (blas, F32, 10.0)])[0] == 4


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16, np.bool_])
@pytest.mark.parametrize("perm", [(0, 2, 1, 3), (0, 1, 3, 2), (3, 2, 1, 0), (1, 0, 2, 3)])
def test_a_transpose_splits_its_copy_over_keels_threads(dtype: Any, perm: tuple[int, ...]
                                                        ) -> None:
    x = (np.random.default_rng(2).standard_normal((6, 33, 5, 140)) * 10).astype(dtype)
    want = np.ascontiguousarray(x.transpose(perm))
    kernel = TABLE.get(Op.TRANSPOSE)
    for threads in (1, 2, 3):
        out = np.zeros_like(want)
        view = x.transpose(perm)
        served = native_window.copy_strided(view, np.zeros_like(want), threads)
        assert served is (threads > 1)                  # one thread: NumPy's copy
        (got,) = kernel.fn(KernelContext(np, "cpu", "cpu", threads, None), [x],
                           {"perm": list(perm)}, [out])
        assert got is out and np.array_equal(got, want)


def test_the_strided_copy_refuses_what_it_cannot_copy() -> None:
    x = np.zeros((128, 128, 8), np.float32)
    view = x.transpose(2, 0, 1)
    assert native_window.copy_strided(view, np.zeros((8, 128, 128), np.float32), 2)
    assert not native_window.copy_strided(view, np.zeros((8, 128, 128), np.float64), 2)
    assert not native_window.copy_strided(view, np.zeros((8, 128, 128), np.float32).T, 2)
    assert not native_window.copy_strided(view, x.reshape(8, 128, 128), 2)     # overlaps
    assert not native_window.copy_strided(x[:1, :1].transpose(2, 0, 1),
                                          np.zeros((8, 1, 1), np.float32), 2)  # too little
    small = x[:64, :64].transpose(2, 0, 1)        # 32,768 elements: one thread's copy
    assert not native_window.copy_strided(small, np.zeros((8, 64, 64), np.float32), 2)
    assert native_window.bind_strided_copy(small, np.zeros((8, 64, 64), np.float32), 2) \
        is None


def test_a_conv_decided_at_run_time_follows_the_same_thread_rule() -> None:
    """The default kernel's choice on shapes known only at the call (no placement)."""
    from keel.backends.cpu.conv_rules import conv_case

    attrs = dict(get_schema(Op.CONV).normalize_attrs({"pads": (1, 1, 1, 1),
                                                      "strides": (2, 2)}))
    case = conv_case(Op.CONV, (32, 128, 28, 28), (256, 128, 3, 3), attrs, "float32")
    assert case is not None
    assert cpu_planner.conv_call_variant(case, 1)[0] == "native"     # strided
    x, w, flat = UNSTRIDED
    case = conv_case(Op.CONV, x, w, dict(get_schema(Op.CONV).normalize_attrs(flat)),
                     "float32")
    assert case is not None
    one, _ = cpu_planner.conv_call_variant(case, 1)
    assert one in cpu_planner.BLAS_CONV_VARIANTS
    variant, why = cpu_planner.conv_call_variant(case, 4)
    assert variant == "native" and f"native on 4 keel threads, not {one}" in why


def test_float64_strided_convs_stay_where_the_rules_put_them() -> None:
    """The native conv computes float32 (and float16) only."""
    full = dict(get_schema(Op.CONV).normalize_attrs({"strides": (2, 2)}))
    f64 = DType.FLOAT64
    plan = CpuBackend(threads=4).plan_node(
        Op.CONV, [TensorType(f64, (8, 64, 28, 28)), TensorType(f64, (128, 64, 1, 1))], full)
    assert plan.variant in cpu_planner.BLAS_CONV_VARIANTS


@pytest.mark.parametrize(("shape", "split"), [((1, 128, 4, 64), False), ((8, 128, 4, 64), True)])
def test_a_bound_transpose_splits_only_a_copy_worth_two_threads(
        shape: tuple[int, ...], split: bool) -> None:
    """BERT-mini's head transpose: one thread's copy at batch 1 (32,768 elements), split
    at batch 8; the same bytes either way."""
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    want = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    out = np.zeros_like(want)
    kernel = TABLE.get(Op.TRANSPOSE)
    assert kernel.bind is not None
    call = kernel.bind(KernelContext(np, "cpu", "cpu", 2, None), [x],
                       {"perm": [0, 2, 1, 3]}, [out])
    assert call is not None
    assert isinstance(call, native_window.Bound) is split
    call()
    assert np.array_equal(out, want)


def test_a_stride_2_conv_model_gives_the_same_bits_on_any_thread_count() -> None:
    """Native on one thread as on more: the strided conv no longer changes variant (and
    rounding) with the thread count; checked against the reference backend too."""
    from onnx import TensorProto, helper, numpy_helper

    from keel.execution.model import load_model

    rng = np.random.default_rng(4)
    w = rng.standard_normal((96, 80, 3, 3)).astype(np.float32) * 0.05
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])],
        "strided", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 80, 20, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                              ).SerializeToString()
    x = rng.standard_normal((2, 80, 20, 20)).astype(np.float32)
    runs = {}
    for threads in (1, 2, 3):
        m = load_model(model, backend="cpu", threads=threads, plan_cache=False)
        assert m.plan.nodes[0].variant == "native"
        runs[threads] = m.predict({"x": x})["y"]
    assert np.array_equal(runs[1], runs[2]) and np.array_equal(runs[1], runs[3])
    want = load_model(model, backend="reference").predict({"x": x})["y"]
    np.testing.assert_allclose(runs[1], want, rtol=1e-4, atol=1e-4)


def test_a_global_pool_counts_each_element_it_reads_as_window_taps() -> None:
    """A global pool's element costs more than a depthwise tap
    (GLOBAL_POOL_TAPS_PER_ELEMENT): a pool whose elements alone would not give two
    threads the least taps each splits in two, the plan and the bound call alike, with
    the bits of one thread."""
    least = cpu_planner.least_work(cpu_planner.LeastWork.TAPS, 2)
    planes = -(-least // 49)
    assert planes * 49 < 2 * least <= planes * 49 * cpu_planner.GLOBAL_POOL_TAPS_PER_ELEMENT
    x = np.random.default_rng(6).standard_normal((1, planes, 7, 7)).astype(np.float32)
    ys = [np.empty((1, planes, 1, 1), np.float32) for _ in range(2)]
    one, two = (native_window.bind_global_avg_pool(x, y, t)
                for y, t in zip(ys, (1, 2), strict=True))
    assert type(two) is native_window.Bound and two.args[-1] == 2
    one()
    two()
    assert ys[0].tobytes() == ys[1].tobytes()
    plan = CpuBackend(threads=2).plan_node(Op.GLOBAL_AVG_POOL, [TensorType(F32, x.shape)], {})
    (split,) = cpu_planner.node_splits(Op.GLOBAL_AVG_POOL, [TensorType(F32, x.shape)], {},
                                       plan, 2)
    assert split.pieces == 2
