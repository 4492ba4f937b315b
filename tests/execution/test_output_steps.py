"""A node whose output is a graph output writes a fresh array every run. A native conv
prepared once moves its prepared calls to each new array instead of preparing them again;
the caller keeps every array it got, and the values are the reference backend's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from keel import native
from keel.backends.cpu import conv, planner
from keel.execution.model import load_model


def conv_model(channels: int, out: int, size: int, **attrs: Any) -> bytes:
    """ReLU, then one Conv whose output (over the planner's HOLD_BYTES, 64 KiB, at batch
    8: a fresh array) is the graph's output (the ReLU puts the conv's X in the arena: a
    feed read in place is prepared per array)."""
    rng = np.random.default_rng(out)
    kernel = attrs.pop("kernel", 1)
    group = attrs.get("group", 1)
    w = rng.standard_normal((out, channels // group, kernel, kernel)).astype(np.float32)
    b = rng.standard_normal(out).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Conv", ["r", "w", "b"], ["y"], **attrs)]
    graph = helper.make_graph(
        nodes, "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, channels, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


CASES = {
    "pointwise_stride2": conv_model(64, 128, 14, strides=[2, 2]),
    "pointwise": conv_model(32, 48, 12),
    "padded_3x3": conv_model(16, 32, 12, kernel=3, pads=[1, 1, 1, 1]),
    "strided_3x3": conv_model(16, 32, 17, kernel=3, pads=[1, 1, 1, 1], strides=[2, 2]),
    "grouped": conv_model(16, 32, 14, kernel=3, group=2),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_conv_making_the_graph_output_hands_out_arrays_the_caller_keeps(
        case: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    onnx_bytes = CASES[case]
    model = load_model(onnx_bytes, backend="cpu", threads=threads)
    reference = load_model(onnx_bytes, backend="reference")
    prepared = []
    real = conv._prepare_native

    def counted(*args: Any, **kwargs: Any) -> Any:
        prepared.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(conv, "_prepare_native", counted)
    rng = np.random.default_rng(7)
    feeds = [rng.standard_normal(_shape(onnx_bytes)).astype(np.float32)
             for _ in range(4)]
    got = [model.predict({"x": x})["y"] for x in feeds]
    for x, y in zip(feeds, got, strict=True):
        np.testing.assert_allclose(y, reference.predict({"x": x})["y"], rtol=1e-4, atol=1e-4)
    assert got[0].nbytes > planner.HOLD_BYTES     # not held: a fresh array each run
    # Every run handed out its own array, and no later run wrote into an earlier one.
    assert len({id(y) for y in got}) == len(got)
    for i, y in enumerate(got):
        assert all(not np.shares_memory(y, other) for other in got[i + 1:])
    np.testing.assert_array_equal(got[0], model.predict({"x": feeds[0]})["y"])
    assert not np.array_equal(got[0], got[1])
    for x in feeds:              # outputs dropped at once: a new array may take an old id
        np.testing.assert_allclose(model.predict({"x": x})["y"], reference.predict({"x": x})["y"],
                                   rtol=1e-4, atol=1e-4)
    if native.available() and prepared:
        # Prepared on the first run at most: the later runs moved what it prepared.
        assert len(prepared) == 1


def _shape(onnx_bytes: bytes) -> tuple[int, ...]:
    import onnx

    dims = onnx.load_from_string(onnx_bytes).graph.input[0].type.tensor_type.shape.dim
    return tuple(d.dim_value for d in dims)
