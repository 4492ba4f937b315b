"""The native kernels built for older CPUs (no AVX-512, or no AVX at all) give the
reference backend's answers: the portable paths in every C file are exercised too,
not only the ones the development machine's -march=native selects."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keel import config, load_model, native
from keel.native import build
from keel.testing import models

# Targets below this machine's own, per architecture (x86-64: baseline SSE2; v3: AVX2+FMA).
PORTABLE = {"x86_64": [("-march=x86-64",), ("-march=x86-64-v3",)],
            "aarch64": [("-march=armv8-a",)]}.get(platform.machine(), [])

MODELS: dict[str, Callable[[], Any]] = {
    "mlp": models.mlp,                          # native GEMM
    "lenet": models.lenet,                      # implicit-GEMM conv, max pool
    "resnet_block": models.resnet_block,        # conv with residual
    "mobilenet_block": models.mobilenet_block,  # depthwise, 1x1 convs
    "transformer": models.transformer_encoder,  # LayerNorm, GELU, softmax
}


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], Path]:
    """One build cache per target, shared by the module's tests (each build takes seconds)."""
    return {flags: tmp_path_factory.mktemp("native") for flags in PORTABLE}


@pytest.fixture(params=PORTABLE, ids=lambda f: " ".join(f))
def portable(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
             caches: dict[tuple[str, ...], Path]) -> Iterator[tuple[str, ...]]:
    """The native tier rebuilt with the given target flags instead of -march=native."""
    monkeypatch.setenv("KEEL_CACHE_DIR", str(caches[request.param]))
    monkeypatch.delenv("KEEL_NATIVE", raising=False)
    config.reload_settings()
    monkeypatch.setattr(build, "_ARCH_FLAGS", request.param)
    native.reset()
    if not native.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    if not set(request.param) <= set(native.status().flags):
        pytest.skip(f"the compiler does not take {' '.join(request.param)}")
    yield request.param
    native.reset()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_portable_build_matches_the_reference(portable: tuple[str, ...], name: str) -> None:
    proto = MODELS[name]()
    feeds = models.make_inputs(proto, batch=3)
    want = load_model(proto, backend="reference").predict(feeds)
    got = load_model(proto, backend="cpu", threads=2).predict(feeds)
    for key, ref in want.items():
        np.testing.assert_allclose(got[key], ref, rtol=2e-4, atol=2e-5, err_msg=key)
    st = native.status()
    assert set(portable) <= set(st.flags) and "-march=native" not in st.flags
    assert st.built and not st.failed


def test_portable_winograd_matches_the_reference(portable: tuple[str, ...]) -> None:
    """The Winograd transforms' portable paths (partial vector blocks without masks)."""
    from keel.backends.cpu import winograd
    from keel.backends.reference.backend import ReferenceBackend
    from keel.ops.registry import Op

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, 11, 13)).astype(np.float32)
    w = rng.standard_normal((5, 6, 3, 3)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    y = np.empty((2, 5, 11, 13), np.float32)
    assert winograd.native_conv3x3(x, w, (1, 1), (11, 13), y, b, None, ("clip", (0.0, 1.0)),
                                   None, 2)
    want = ReferenceBackend().run(Op.CONV, [x, w, b], attrs={
        "pads": (1, 1, 1, 1), "activation": "clip", "activation_params": (0.0, 1.0)})[0]
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    assert "-march=native" not in native.status().flags
