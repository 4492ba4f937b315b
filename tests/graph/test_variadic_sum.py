"""ONNX Sum (and Mean's sum) of three or more inputs imports as one variadic ``ADD_N``
node: a 20,000-input fan-in stays one node instead of 19,999 Adds and their partial
sums. Its results are checked against onnxruntime and the reference backend, across
batch sizes, and through .keel and ONNX export round trips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import keel
from keel.formats.keel_format import load_keel, save_keel
from keel.graph.export import to_onnx
from keel.graph.importers.onnx import import_onnx
from keel.ops.registry import Op

ort = pytest.importorskip("onnxruntime")


def _sum_model(n: int, op_type: str = "Sum", dtype: int = TensorProto.FLOAT,
               broadcast: bool = True) -> bytes:
    """``op_type`` over ``n`` inputs: Relu of x (rows x 8) or, every fifth with
    ``broadcast``, of b (1 x 8)."""
    def source(i: int) -> str:
        return "b" if broadcast and i % 5 == 4 else "x"
    nodes = [helper.make_node("Relu", [source(i)], [f"r{i}"], name=f"r{i}") for i in range(n)]
    nodes.append(helper.make_node(op_type, [f"r{i}" for i in range(n)], ["y"], name="sum"))
    graph = helper.make_graph(
        nodes, "fan_in", [helper.make_tensor_value_info("x", dtype, ["N", 8]),
                          helper.make_tensor_value_info("b", dtype, [1, 8])],
        [helper.make_tensor_value_info("y", dtype, ["N", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


def _feeds(rows: int, dtype: type = np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return {"x": rng.standard_normal((rows, 8)).astype(dtype),
                "b": rng.standard_normal((1, 8)).astype(dtype)}
    return {"x": rng.integers(-50, 50, (rows, 8)).astype(dtype),
            "b": rng.integers(-50, 50, (1, 8)).astype(dtype)}


def _ort(data: bytes, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, feeds)[0])


def _ops(data: bytes) -> list[Op]:
    return [n.op for n in import_onnx(data).nodes if n.op is not Op.RELU]


@pytest.mark.parametrize(("n", "ops"), [(1, [Op.IDENTITY]), (2, [Op.ADD]), (3, [Op.ADD_N]),
                                        (500, [Op.ADD_N])])
def test_a_sum_is_one_node(n: int, ops: list[Op]) -> None:
    assert _ops(_sum_model(n)) == ops


def test_a_mean_sums_with_one_node() -> None:
    assert _ops(_sum_model(6, "Mean")) == [Op.ADD_N, Op.DIV]


@pytest.mark.parametrize("n", [3, 7, 2000])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_the_sum_matches_onnxruntime(n: int, backend: str) -> None:
    data = _sum_model(n)
    feeds = _feeds(3)
    model = keel.load_model(data, backend=backend, plan_cache=False)
    got = model.predict(feeds)["y"]
    want = _ort(data, feeds)
    assert got.dtype == want.dtype and got.shape == want.shape
    # onnxruntime adds in float32, the reference in float64: n roundings apart at most
    np.testing.assert_allclose(got, want, rtol=1e-7 * n + 1e-6, atol=1e-6)


def test_float64_matches_onnxruntime() -> None:
    data = _sum_model(9, dtype=TensorProto.DOUBLE)
    feeds = _feeds(4, np.float64)
    got = keel.load_model(data, backend="cpu", plan_cache=False).predict(feeds)["y"]
    np.testing.assert_allclose(got, _ort(data, feeds), rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_integers_match_the_reference(dtype: type) -> None:
    """ONNX Sum takes floats only; keel's takes integers too, wrapping as NumPy does."""
    onnx_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    data = _sum_model(9, dtype=onnx_type)
    feeds = _feeds(4, dtype)
    got = keel.load_model(data, backend="cpu", plan_cache=False).predict(feeds)["y"]
    want = keel.load_model(data, backend="reference", plan_cache=False).predict(feeds)["y"]
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, want)


def test_the_mean_matches_onnxruntime() -> None:
    data = _sum_model(11, "Mean")
    feeds = _feeds(5)
    got = keel.load_model(data, plan_cache=False).predict(feeds)["y"]
    np.testing.assert_allclose(got, _ort(data, feeds), rtol=1e-5, atol=1e-6)


def test_the_cpu_sum_is_batch_invariant() -> None:
    """Each sample's sum has the same bits alone as inside a batch: added in one fixed
    order, whatever the batch size."""
    model = keel.load_model(_sum_model(301), backend="cpu", plan_cache=False)
    feeds = _feeds(16, seed=3)
    batch = model.predict(feeds)["y"]
    for row in (0, 7, 15):
        alone = model.predict({"x": feeds["x"][row:row + 1], "b": feeds["b"]})["y"]
        np.testing.assert_array_equal(alone[0], batch[row])


def test_a_sum_with_a_repeated_input_reads_it_each_time() -> None:
    """Sum(r, r, r): the output never takes over the repeated input's buffer."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Sum", ["r", "r", "r"], ["y"])]
    graph = helper.make_graph(
        nodes, "repeat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = _feeds(4)["x"]
    got = keel.load_model(data.SerializeToString(), plan_cache=False).predict({"x": x})["y"]
    np.testing.assert_allclose(got, 3 * np.maximum(x, 0), rtol=1e-6)


def test_add_n_survives_keel_and_onnx_round_trips(tmp_path: Path) -> None:
    data = _sum_model(12)
    feeds = _feeds(2)
    graph = import_onnx(data)
    save_keel(graph, tmp_path / "fan.keel")
    again = load_keel(tmp_path / "fan.keel")
    assert [n.op for n in again.nodes].count(Op.ADD_N) == 1
    exported = to_onnx(graph)
    assert [n.op_type for n in exported.graph.node].count("Sum") == 1
    onnx.checker.check_model(exported)
    want = _ort(data, feeds)
    for src in (tmp_path / "fan.keel", exported.SerializeToString()):
        got = keel.load_model(src, plan_cache=False).predict(feeds)["y"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
