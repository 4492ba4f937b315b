"""Real-model shapes built with onnx.helper match onnxruntime (issue 4's done-when).

MLP, LeNet, a ResNet block with BatchNorm, a MobileNet depthwise block and a
2-layer transformer encoder (token embeddings, LayerNorm, GELU, attention) run
on keel's cpu and reference backends at every optimization level, at batch 1
and 32, and must match onnxruntime within 1e-4 relative L2 error.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from keel.execution.model import OPTIMIZATION_LEVELS, Model, load_model
from keel.testing.models import BUILDERS, make_inputs

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle of these tests")

TOLERANCE = 1e-4
BATCHES = (1, 32)
BACKENDS = ("cpu", "reference")


@functools.cache
def proto(name: str) -> Any:
    return BUILDERS[name]()


@functools.cache
def expected(name: str, batch: int) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    model = proto(name)
    feeds = make_inputs(model, batch, seed=batch)
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return feeds, session.run(None, feeds)


@functools.cache
def keel_model(name: str, backend: str, level: str) -> Model:
    return load_model(proto(name), backend=backend, optimization_level=level)


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    want64 = want.astype(np.float64)
    return float(np.linalg.norm(got.astype(np.float64) - want64) / np.linalg.norm(want64))


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("level", OPTIMIZATION_LEVELS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(BUILDERS))
def test_matches_onnxruntime(name: str, backend: str, level: str, batch: int) -> None:
    feeds, want = expected(name, batch)
    model = keel_model(name, backend, level)
    assert set(model.plan.backends) == {backend}
    got = model.run(None, feeds)
    assert len(got) == len(want)
    for g, w, info in zip(got, want, model.outputs, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, info.name
        err = rel_l2(g, w)
        assert err <= TOLERANCE, f"{name}/{info.name}: relative L2 error {err:.2e}"


def test_optimization_changes_the_graph() -> None:
    """The levels really differ: fusions shrink the transformer and the conv nets."""
    for name in ("transformer_encoder", "resnet_block", "mobilenet_block"):
        none = len(keel_model(name, "reference", "none").graph.nodes)
        full = len(keel_model(name, "reference", "all").graph.nodes)
        assert full < none, name


@pytest.mark.parametrize("name", list(BUILDERS))
def test_chunked_run_matches_whole_batch(name: str) -> None:
    feeds, want = expected(name, 32)
    whole = keel_model(name, "cpu", "all")
    whole.predict(feeds)
    peak_32 = whole.plan.peak_bytes
    peak_1 = load_model(proto(name), backend="cpu").plan.peak_bytes
    limited = load_model(proto(name), backend="cpu", memory_limit=(peak_1 + peak_32) // 2)
    got = limited.run(None, feeds)
    assert limited.plan.chunk_size_hint is not None and limited.plan.chunk_size_hint < 32
    reference = whole.run(None, feeds)
    for g, r, w in zip(got, reference, want, strict=True):
        # Chunks change the products' shapes and so BLAS's summation order (the NumPy
        # kernels, KEEL_NATIVE=off): an element may move by about 1e-6.
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
        assert rel_l2(g, w) <= TOLERANCE
