"""precision="bf16" on the cpu: the model's float math retyped to bfloat16, computed by
the cpu kernels in float32 on the widened values and rounded to bfloat16 after every
node (keel/backends/bf16.py); declared outputs keep their dtype."""

from __future__ import annotations

import numpy as np
import pytest

import keel
from benchmarks.zoo import MODELS, build
from keel.config import reload_settings


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("name", ["mlp", "lenet", "bert_mini"])
def test_a_model_at_bf16_on_the_cpu_stays_near_fp32(name: str) -> None:
    data, feeds = build(name), MODELS[name].make_feeds(2)
    want = keel.load_model(data, backend="cpu").predict(feeds)
    model = keel.load_model(data, backend="cpu", precision="bf16")
    got = model.predict(feeds)
    for key, ref in want.items():
        assert got[key].dtype == ref.dtype
        # bfloat16 rounding after every node: measurably off fp32, and near it
        assert 1e-4 < _rel(got[key], ref) < 2e-2, name
    assert model.precision == "bf16"
    assert any(n.precision == "bf16" for n in model.plan.nodes)
    assert "precision bf16" in model.explain()


def test_keel_precision_bf16_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_PRECISION", "bf16")
    reload_settings()
    try:
        model = keel.load_model(build("mlp"), backend="cpu")
        model.predict(MODELS["mlp"].make_feeds(1))
        assert model.precision == "bf16"
    finally:
        monkeypatch.delenv("KEEL_PRECISION")
        reload_settings()
