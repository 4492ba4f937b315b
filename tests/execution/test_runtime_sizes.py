"""Outputs whose size is only known at run time are checked before they are allocated."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import keel
from keel.execution.budget import output_elements
from keel.ops.registry import Op


def _model(node: onnx.NodeProto, inputs: list[tuple[str, int, list[int]]],
           out_type: int = TensorProto.FLOAT) -> bytes:
    graph = helper.make_graph(
        [node], "sized", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(node.output[0], out_type, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]
                             ).SerializeToString()


def _constant_of_shape() -> bytes:
    node = helper.make_node("ConstantOfShape", ["s"], ["y"],
                            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))
    return _model(node, [("s", TensorProto.INT64, [1])])


# op, the model, small feeds, the feeds' name order as the kernel takes them
CASES: list[tuple[Op, bytes, dict[str, Any]]] = [
    (Op.CONSTANT_OF_SHAPE, _constant_of_shape(), {"s": np.array([7], np.int64)}),
    (Op.EXPAND, _model(helper.make_node("Expand", ["x", "s"], ["y"]),
                       [("x", TensorProto.FLOAT, [3, 1]), ("s", TensorProto.INT64, [3])]),
     {"x": np.ones((3, 1), np.float32), "s": np.array([2, 1, 5], np.int64)}),
    (Op.TILE, _model(helper.make_node("Tile", ["x", "r"], ["y"]),
                     [("x", TensorProto.FLOAT, [2, 3]), ("r", TensorProto.INT64, [2])]),
     {"x": np.ones((2, 3), np.float32), "r": np.array([4, 2], np.int64)}),
    (Op.RANGE, _model(helper.make_node("Range", ["a", "b", "d"], ["y"]),
                      [(n, TensorProto.FLOAT, []) for n in "abd"]),
     {"a": np.float32(1.5), "b": np.float32(9.0), "d": np.float32(0.7)}),
    (Op.PAD, _model(helper.make_node("Pad", ["x", "p"], ["y"]),
                    [("x", TensorProto.FLOAT, [2, 3]), ("p", TensorProto.INT64, [4])]),
     {"x": np.ones((2, 3), np.float32), "p": np.array([1, 0, 2, 3], np.int64)}),
    (Op.ONE_HOT, _model(helper.make_node("OneHot", ["i", "d", "v"], ["y"]),
                        [("i", TensorProto.INT64, [4]), ("d", TensorProto.INT64, [1]),
                         ("v", TensorProto.FLOAT, [2])]),
     {"i": np.array([0, 2, 1, 3], np.int64), "d": np.array([5], np.int64),
      "v": np.array([0, 1], np.float32)}),
    (Op.RESIZE, _model(helper.make_node("Resize", ["x", "", "", "z"], ["y"], mode="nearest"),
                       [("x", TensorProto.FLOAT, [1, 1, 2, 3]), ("z", TensorProto.INT64, [4])]),
     {"x": np.ones((1, 1, 2, 3), np.float32), "z": np.array([1, 1, 5, 4], np.int64)}),
]


@pytest.mark.parametrize(("op", "model", "feeds"), CASES, ids=[c[0].value for c in CASES])
def test_the_size_read_from_the_inputs_is_the_kernels(op: Op, model: bytes,
                                                      feeds: dict[str, Any]) -> None:
    out = keel.load_model(model).predict(feeds)["y"]
    ins = [np.asarray(v) for v in feeds.values()]
    if op == Op.RESIZE:
        ins = [ins[0], None, None, ins[1]]                  # roi and scales absent
    assert output_elements(op, ins, {}) == out.size


@pytest.mark.parametrize(("op", "model", "feeds"), CASES, ids=[c[0].value for c in CASES])
def test_a_limit_below_the_output_raises_and_above_it_runs(op: Op, model: bytes,
                                                          feeds: dict[str, Any]) -> None:
    _check_limits(model, feeds, keel.load_model(model).predict(feeds)["y"])


def _check_limits(model: bytes, feeds: dict[str, Any], expected: np.ndarray) -> None:
    """Under a roomy limit the node runs; one byte short of its output, it raises."""
    fits = keel.load_model(model, memory_limit=1 << 20)
    np.testing.assert_array_equal(fits.predict(feeds)["y"], expected)
    tight = keel.load_model(model, memory_limit=fits.plan.peak_bytes + expected.nbytes - 1)
    with pytest.raises(keel.MemoryLimitError, match=r"node '.*' needs .*\(\d+ bytes\)"):
        tight.predict(feeds)


def test_constant_of_shape_of_half_a_billion_under_100mb_raises_before_allocating() -> None:
    model = keel.load_model(_constant_of_shape(), memory_limit="100MB")
    assert model.plan.peak_bytes < 1 << 20
    with pytest.raises(keel.MemoryLimitError) as info:
        model.predict({"s": np.array([500_000_000], np.int64)})
    assert info.value.required_bytes == 2_000_000_000
    assert info.value.limit_bytes == 100_000_000
    assert "ConstantOfShape" in str(info.value)


def test_without_a_limit_more_than_the_machine_has_is_a_memory_limit_error() -> None:
    model = keel.load_model(_constant_of_shape())
    with pytest.raises(keel.MemoryLimitError, match="available"):
        model.predict({"s": np.array([1 << 50], np.int64)})      # 4 PiB of float32


def test_set_memory_limit_reaches_the_run_time_check() -> None:
    model = keel.load_model(_constant_of_shape())
    feeds = {"s": np.array([1 << 20], np.int64)}                  # 4 MiB
    assert model.predict(feeds)["y"].size == 1 << 20
    model.set_memory_limit("1MB")
    with pytest.raises(keel.MemoryLimitError):
        model.predict(feeds)
    model.set_memory_limit(None)
    assert model.predict(feeds)["y"].size == 1 << 20


# Outputs sized by the data itself (or by k): the count is read before the kernel runs.
DATA_CASES: list[tuple[Op, bytes, dict[str, Any], int]] = [
    (Op.NONZERO, _model(helper.make_node("NonZero", ["x"], ["y"]),
                        [("x", TensorProto.FLOAT, [3, 4])], TensorProto.INT64),
     {"x": np.array([[0, 1, 0, 2], [3, 0, 0, 0], [0, 0, 5, 6]], np.float32)}, 1),
    (Op.COMPRESS, _model(helper.make_node("Compress", ["x", "c"], ["y"], axis=1),
                         [("x", TensorProto.FLOAT, [2, 5]), ("c", TensorProto.BOOL, [5])]),
     {"x": np.ones((2, 5), np.float32), "c": np.array([1, 0, 1, 1, 0], bool)}, 1),
    (Op.TOPK, _model(helper.make_node("TopK", ["x", "k"], ["y", "i"], axis=1),
                     [("x", TensorProto.FLOAT, [3, 8]), ("k", TensorProto.INT64, [1])]),
     {"x": np.arange(24, dtype=np.float32).reshape(3, 8), "k": np.array([3], np.int64)}, 3),
]


@pytest.mark.parametrize(("op", "model", "feeds", "units"), DATA_CASES,
                         ids=[c[0].value for c in DATA_CASES])
def test_data_sized_outputs_are_counted_before_the_kernel_runs(
        op: Op, model: bytes, feeds: dict[str, Any], units: int) -> None:
    expected = keel.load_model(model).predict(feeds)["y"]
    ins = [np.asarray(v) for v in feeds.values()]
    # TopK's int64 indices count beside its values (in the values' 4-byte units)
    assert output_elements(op, ins, {"axis": 1}) == expected.size * units
    _check_limits(model, feeds, expected)


def test_nonzero_of_a_dense_input_beyond_the_limit_raises_naming_the_node() -> None:
    model = keel.load_model(_model(helper.make_node("NonZero", ["x"], ["y"], name="nz"),
                                   [("x", TensorProto.FLOAT, [1000, 1000])], TensorProto.INT64),
                            memory_limit="12MB")   # the input fits; 16 MB of coordinates do not
    with pytest.raises(keel.MemoryLimitError, match=r"node 'nz' needs .*\(16000000 bytes\)"):
        model.predict({"x": np.ones((1000, 1000), np.float32)})
