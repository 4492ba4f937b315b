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


def _generic(model: keel.Model) -> bool:
    return any(r.startswith("shape-generic plan") for r in model.plan.reasons)


def _x(batch: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(batch).standard_normal((batch, 8)).astype(np.float32)}


def test_new_signatures_after_the_first_run_on_one_generic_plan() -> None:
    model = _model()
    reference = _model(plan_cache=False)
    reference.set_backend("reference")
    for batch in (1, 2):                        # the first signatures get plans of their own
        model.predict(_x(batch))
        assert not _generic(model)
    placed = None
    for batch in range(3, 12):                   # every later new batch: the generic plan
        got = model.predict(_x(batch))
        assert _generic(model)
        assert model.plan.input_shapes == {"x": (batch, 8)}
        placed = placed or model.plan.nodes
        assert model.plan.nodes is placed         # placed once, not per signature
        want = reference.predict(_x(batch))
        np.testing.assert_allclose(got["probs"], want["probs"], rtol=1e-5, atol=1e-6)


def test_a_recurring_signature_gets_its_own_plan() -> None:
    model = _model()
    for batch in (1, 2):
        model.predict(_x(batch))
    first = model.predict(_x(5))
    assert _generic(model)
    model.predict(_x(5))
    assert _generic(model)
    model.predict(_x(5))                         # the third run: planned for its sizes
    assert not _generic(model)
    np.testing.assert_array_equal(model.predict(_x(5))["probs"], first["probs"])


def test_a_memory_limit_keeps_per_signature_plans() -> None:
    model = _model(memory_limit="64MB")
    for batch in (1, 2, 3, 4):
        model.predict(_x(batch))
        assert not _generic(model)
