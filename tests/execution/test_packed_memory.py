"""The kernels' packed copies of weights count in the plan's memory and its limit."""

from __future__ import annotations

import dataclasses
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
        own = state if state.base is None else state.base
        if not isinstance(own, np.ndarray) or any(np.shares_memory(own, w) for w in weights):
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
                                                ((96, 96, 7, 1, 1), "im2col")])
def test_the_plan_counts_the_scratch_its_conv_kernel_holds(
        shape: tuple[int, int, int, int, int], variant: str) -> None:
    from keel.backends.cpu import workspace

    c, _, side, _, batch = shape
    workspace.clear()                 # this thread's scratch buffers, which the kernel uses
    model = keel.load_model(_conv(*shape), backend="cpu", threads=1, plan_cache=False)
    assert model.plan.nodes[0].variant == variant
    memory = model.plan.memory
    assert memory["workspace_bytes"] == model.plan.nodes[0].plan.workspace_bytes > 0
    assert model.plan.peak_bytes >= (memory["weight_bytes"] + memory["workspace_bytes"]
                                     + memory["output_bytes"])
    model.predict({"x": np.ones((batch, c, side, side), np.float32)})
    assert 0 < workspace.held_bytes() <= memory["workspace_bytes"]
