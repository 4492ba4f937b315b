"""A model's depthwise conv node binds its native call once; later runs stay exact."""

from __future__ import annotations

import numpy as np
import pytest

from keel import load_model, native
from keel.testing.models import mobilenet_block


def test_bound_depthwise_runs_match_fresh_runs_on_new_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from keel.backends.cpu import depthwise

    bound_runs = []
    real = depthwise.NodeRun.run

    def counted(self: depthwise.NodeRun, *args: object) -> None:
        bound_runs.append(1)
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(depthwise.NodeRun, "run", counted)
    if not native.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    proto = mobilenet_block()
    steady = load_model(proto, backend="cpu", threads=1)
    name = steady.inputs[0].name
    shape = [d if isinstance(d, int) else 2 for d in steady.inputs[0].shape]
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    steady.predict({name: feeds[0]})                      # binds the calls
    for x in feeds[1:]:
        got = steady.predict({name: x})
        fresh = load_model(proto, backend="cpu", threads=1).predict({name: x})
        for key in fresh:
            assert got[key].tobytes() == fresh[key].tobytes()
    variants = {n.variant for n in steady.plan.nodes if n.op == "conv"}
    assert "depthwise" in variants
    assert len(bound_runs) == 2                           # the runs after the first
