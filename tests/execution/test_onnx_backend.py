"""keel as an onnx.backend.base.Backend."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.backend.base import Backend

from keel import onnx_backend
from keel.backends.registry import default_registry
from keel.errors import InvalidArgumentError
from keel.testing.models import make_inputs, mlp


def test_is_an_onnx_backend() -> None:
    assert issubclass(onnx_backend.KeelBackend, Backend)


def test_prepare_runs_with_a_list_or_a_dict() -> None:
    model = mlp(in_features=8, hidden=(8,), classes=3)
    rep = onnx_backend.prepare(model, "CPU")
    assert rep.model.backend == "cpu"
    x = make_inputs(model, 2)["x"]
    (listed,) = rep.run([x])
    (single,) = rep.run(x)
    (named,) = rep.run({"x": x})
    np.testing.assert_array_equal(listed, named)
    np.testing.assert_array_equal(single, named)
    with pytest.raises(InvalidArgumentError, match="2 inputs given; the model takes at most 1"):
        rep.run([x, x])


def test_backend_keyword_picks_a_keel_backend() -> None:
    rep = onnx_backend.prepare(mlp(in_features=8, hidden=(8,), classes=3), backend="reference")
    assert set(rep.model.plan.backends) == {"reference"}


def test_run_model_and_run_node() -> None:
    x = np.array([[-1.0, 2.0]], np.float32)
    (y,) = onnx_backend.run_node(helper.make_node("Relu", ["x"], ["y"]), [x])
    np.testing.assert_array_equal(y, [[0.0, 2.0]])
    (z,) = onnx_backend.run_node(helper.make_node("Add", ["a", "b"], ["z"]), [x, x],
                                 opset_version=14)
    np.testing.assert_array_equal(z, 2 * x)
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    (neg,) = onnx_backend.run_model(helper.make_model(graph), [x])
    np.testing.assert_array_equal(neg, -x)


def test_supports_device() -> None:
    assert onnx_backend.supports_device("CPU")
    gpu = default_registry().availability("gpu").available
    assert onnx_backend.supports_device("CUDA") is gpu
    assert not onnx_backend.supports_device("TPU")
    with pytest.raises(InvalidArgumentError, match="device 'TPU' is not an ONNX device"):
        onnx_backend.prepare(mlp(), "TPU")
