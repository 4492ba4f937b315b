"""What docs/models.md shows of the Model API is what the code does."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import keel
from keel.testing import models

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def test_the_tensorinfo_repr_shown_is_the_real_one() -> None:
    shown = re.search(r"print\(model\.inputs\)\s+# (\[TensorInfo.*\])", DOC.read_text())
    assert shown is not None
    info = keel.TensorInfo("x", ("batch", 784), keel.DType.FLOAT32)
    assert repr([info]) == shown.group(1)


def test_node_totals_while_profiling_then_profiler_is_gone(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    model = keel.load_model(models.mlp(in_features=8, hidden=(16,), classes=4).
                            SerializeToString(), backend="cpu", plan_cache=False)
    model.enable_profiling()
    model.predict({"x": np.ones((2, 8), np.float32)})
    assert model.profiler is not None
    totals = model.profiler.node_totals()
    assert totals and all(t >= 0 for t in totals.values())
    assert (tmp_path / "p.json").samefile(model.end_profiling(tmp_path / "p.json"))
    assert model.profiler is None
