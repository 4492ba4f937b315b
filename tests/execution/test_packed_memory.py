"""The kernels' packed copies of weights count in the plan's memory and its limit."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import keel
from keel.graph.memory_plan import packed_bytes


def _mlp(k: int = 512, n: int = 1024) -> bytes:
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((k, n), dtype=np.float32)
    w2 = rng.standard_normal((n, k), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, k])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def _held(state: Any, weights: list[np.ndarray], seen: set[int]) -> int:
    """Bytes of the arrays in a prepack state that are not the weights themselves."""
    if id(state) in seen:
        return 0
    seen.add(id(state))
    if isinstance(state, np.ndarray):
        # A packed copy may lie on its own mapping (huge pages): its base is no array.
        own = state.base if isinstance(state.base, np.ndarray) else state
        if any(np.shares_memory(own, w) for w in weights):
            return 0
        return int(own.nbytes)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return sum(_held(getattr(state, f.name), weights, seen)
                   for f in dataclasses.fields(state))
    if isinstance(state, tuple | list):
        return sum(_held(s, weights, seen) for s in state)
    return 0


def test_the_plan_counts_a_packed_copy_at_least_as_big_as_the_kernels_hold() -> None:
    from keel import native

    if not native.available():
        pytest.skip(f"only the native GEMM packs weights: {native.status().reason}")
    model = keel.load_model(_mlp())
    memory = model.plan.memory
    weights = memory["weight_bytes"]
    assert weights == 2 * 512 * 1024 * 4
    assert memory["prepacked_bytes"] >= weights
    assert model.plan.peak_bytes >= weights + memory["prepacked_bytes"]
    model.predict({"x": np.ones((4, 512), np.float32)})
    consts = list(model._graph.initializers.values())
    held = sum(_held(s, consts, set()) for s in model._pool.prepacked.values())
    assert 0 < held <= memory["prepacked_bytes"]


def test_a_limit_that_holds_the_weights_but_not_their_packed_copy_is_refused() -> None:
    plan = keel.load_model(_mlp()).plan
    limit = plan.peak_bytes - plan.memory["prepacked_bytes"] // 2
    with pytest.raises(keel.MemoryLimitError, match="cannot be met"):       # at load time
        keel.load_model(_mlp(), memory_limit=limit)
    roomy = keel.load_model(_mlp(), memory_limit=plan.peak_bytes + (1 << 20))
    assert roomy.predict({"x": np.ones((4, 512), np.float32)})["y"].shape == (4, 512)


@pytest.mark.parametrize(("shape", "expected"), [
    ((512, 1024), 512 * 1024 * 4 + 64), ((10,), 64 * 4 + 64), ((3, 5), 64 * 5 * 4 + 64),
    ((8, 3, 3, 3), 64 * 27 * 4 + 64), ((2, 5, 3), 2 * 64 * 5 * 4 + 64)])
def test_packed_estimate_pads_one_side_to_64(shape: tuple[int, ...], expected: int) -> None:
    assert packed_bytes(shape, 4) == expected


def _conv(c: int, m: int, side: int, stride: int, batch: int) -> bytes:
    w = np.random.default_rng(0).standard_normal((m, c, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1],
                          strides=[stride, stride], kernel_shape=[3, 3])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


@pytest.mark.parametrize(("shape", "variant"), [((128, 128, 14, 1, 8), "winograd"),
                                                ((512, 512, 7, 1, 4), "winograd"),
                                                ((96, 96, 7, 1, 1), "im2col"),
                                                ((128, 256, 28, 2, 8), "native"),
                                                ((64, 128, 56, 2, 1), "native")])
def test_the_plan_counts_the_scratch_its_conv_kernel_holds(
        shape: tuple[int, int, int, int, int], variant: str) -> None:
    from keel.backends.cpu import native_gemm, workspace

    if variant == "native" and not native_gemm.available():
        variant = "im2col"        # the stride-2 conv's variant without the native tier
    c, _, side, _, batch = shape
    workspace.clear()                 # this thread's scratch buffers, which the kernel uses
    model = keel.load_model(_conv(*shape), backend="cpu", threads=1, plan_cache=False)
    assert model.plan.nodes[0].variant == variant
    memory = model.plan.memory
    assert memory["workspace_bytes"] == model.plan.nodes[0].plan.workspace_bytes > 0
    assert model.plan.peak_bytes >= (memory["weight_bytes"] + memory["workspace_bytes"]
                                     + memory["output_bytes"])
    model.predict({"x": np.ones((batch, c, side, side), np.float32)})
    if "per-thread pipeline:" in model.plan.nodes[0].plan.reason("winograd_pipeline"):
        assert workspace.held_bytes() == 0    # its blocks live in the pool threads' scratch
        return
    if "blocked.c" in model.plan.nodes[0].plan.reason("variant"):
        # the blocked conv's scratch is the thread's native workspace: measured on a
        # thread of its own, where nothing else has grown it
        assert workspace.held_bytes() == 0
        held: list[int] = []

        def run() -> None:
            model.predict({"x": np.ones((batch, c, side, side), np.float32)})
            held.append(workspace.thread_scratch(workspace.Scratch.WORK, 0).nbytes)

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        assert held and 0 < held[0] <= memory["workspace_bytes"]
        return
    assert 0 < workspace.held_bytes() <= memory["workspace_bytes"]


# One conv per form of the native implicit GEMM: (x, w, attrs, form).
NATIVE_FORMS = [
    ((2, 16, 12, 12), (8, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, "masked"),
    ((2, 16, 12, 12), (8, 16, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, "gathered"),
    ((3, 8, 9, 9), (8, 8, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)},
     "gathered-stacked"),
    ((2, 8, 10, 10), (8, 8, 3, 3), {"pads": (1, 1, 1, 1)}, "wide"),
    ((2, 8, 10, 10), (8, 8, 3, 3), {"pads": (1, 1, 1, 1)}, "wide-stacked"),
    ((2, 8, 10, 10), (8, 8, 3, 3), {}, "wide"),
    ((2, 8, 10, 10), (8, 8, 1, 1), {}, "direct"),
    ((1, 3, 32, 32), (8, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, "band"),
]


@pytest.mark.parametrize(("x", "w", "attrs", "form"), NATIVE_FORMS)
def test_the_native_convs_scratch_estimate_is_what_it_holds(
        x: tuple[int, ...], w: tuple[int, ...], attrs: dict[str, Any], form: str) -> None:
    """The plan's estimate for the native conv is the workspace its run asks for, in
    every form (compared with the bytes held after a run, not a fixed number)."""
    from keel.backends.cpu import conv_gemm, native_gemm, workspace
    from keel.ops.registry import Op
    from keel.ops.schema import get_schema
    from keel.ops.schemas.conv import conv_geometry

    if not native_gemm.available():
        pytest.skip("the native GEMM is not loaded (KEEL_NATIVE=off or no compiler)")
    geo = conv_geometry(Op.CONV, list(x), list(w),
                        dict(get_schema(Op.CONV).normalize_attrs(attrs)))
    layout = conv_gemm.native_layout(geo, form)
    rng = np.random.default_rng(1)
    xs = rng.standard_normal(x).astype(np.float32)
    ws = rng.standard_normal(w).astype(np.float32)
    y = np.empty((x[0], w[0], *geo.window.out_spatial), np.float32)
    workspace.clear()
    assert conv_gemm.native(np, layout, xs, ws, None, None, y, ("", ()), threads=2)
    assert workspace.held_bytes() == conv_gemm.native_scratch(layout, 4)
