"""A model whose shapes keep changing runs new signatures on one shape-generic plan,
placed once without sizes, with the same results as per-signature plans."""

from __future__ import annotations

import numpy as np
import pytest

import keel
from keel.testing import models

pytest.importorskip("onnx")


def _model(**kwargs: object) -> keel.Model:
    return keel.load_model(models.mlp(in_features=8, hidden=(16,), classes=4)
                           .SerializeToString(), backend="cpu", **kwargs)


def _sequence_model(**kwargs: object) -> keel.Model:
    """y = softmax(relu(x @ W)) over x: float32[1, S, 8], S symbolic (a decode cache's
    length): signatures that differ past the batch dimension."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Softmax", ["r"], ["y"], axis=-1)], "seq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "S", 4])],
        [numpy_helper.from_array(w, "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(proto)
    return keel.load_model(proto.SerializeToString(), backend="cpu", **kwargs)


def _generic(model: keel.Model) -> bool:
    return any(r.startswith("shape-generic plan") for r in model.plan.reasons)


def _x(batch: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(batch).standard_normal((batch, 8)).astype(np.float32)}


def _seq(length: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(length).standard_normal((1, length, 8))
            .astype(np.float32)}


def test_new_signatures_after_the_first_run_on_one_generic_plan() -> None:
    model = _sequence_model()
    reference = _sequence_model(plan_cache=False)
    reference.set_backend("reference")
    for length in (1, 2):                       # the first signatures get plans of their own
        model.predict(_seq(length))
        assert not _generic(model)
    placed = None
    for length in range(3, 12):                  # every later new length: the generic plan
        got = model.predict(_seq(length))
        assert _generic(model)
        assert model.plan.input_shapes == {"x": (1, length, 8)}
        placed = placed or model.plan.nodes
        assert model.plan.nodes is placed         # placed once, not per signature
        want = reference.predict(_seq(length))
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-6)


def test_a_recurring_signature_gets_its_own_plan() -> None:
    model = _sequence_model()
    for length in (1, 2):
        model.predict(_seq(length))
    first = model.predict(_seq(5))
    assert _generic(model)
    model.predict(_seq(5))
    assert _generic(model)
    model.predict(_seq(5))                       # the third run: planned for its sizes
    assert not _generic(model)
    np.testing.assert_allclose(model.predict(_seq(5))["y"], first["y"], rtol=1e-6)


def test_new_batch_sizes_keep_plans_of_their_own() -> None:
    """A signature that differs from a planned one only in its batch dimension is planned
    for its sizes by the same batch-invariant rules (never the shape-generic plan)."""
    model = _model()
    for batch in (1, 2, 3, 5, 7, 33):
        model.predict(_x(batch))
        assert not _generic(model)


def test_a_memory_limit_keeps_per_signature_plans() -> None:
    model = _model(memory_limit="64MB")
    for batch in (1, 2, 3, 4):
        model.predict(_x(batch))
        assert not _generic(model)
