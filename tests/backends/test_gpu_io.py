"""Device arrays at the edges: CUDA feeds taken without a copy, outputs left on the gpu."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

import keel
from keel.backends.gpu.backend import GpuBackend
from keel.backends.gpu.io import is_device_array
from keel.errors import BackendSelectionError, InvalidArgumentError
from tests.execution.test_capture import _feeds, _mlp


class _Cai:
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False),
                                "version": 3}


class _DlpackOn:
    def __init__(self, kind: int) -> None:
        self.kind = kind

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.kind, 0)


def test_device_arrays_are_recognised_without_importing_cupy() -> None:
    assert is_device_array(_Cai())
    assert is_device_array(_DlpackOn(2))          # kDLCUDA
    assert not is_device_array(_DlpackOn(1))      # kDLCPU
    assert not is_device_array(np.zeros(3))
    assert not is_device_array([1.0, 2.0])


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed: the missing-CuPy message cannot be shown")
def test_a_device_feed_without_cupy_is_a_clear_error() -> None:
    model = keel.load_model(_mlp(), backend="cpu")
    with pytest.raises(InvalidArgumentError, match="lives on a CUDA device, which needs CuPy"):
        model.predict({"x": _Cai()})


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed: the missing-CuPy message cannot be shown")
def test_gpu_outputs_without_cupy_are_a_clear_error() -> None:
    model = keel.load_model(_mlp(), backend="cpu")
    with pytest.raises(BackendSelectionError, match="returns CuPy arrays, and CuPy is not"):
        model.predict(_feeds(0), output_device="gpu")
    with pytest.raises(InvalidArgumentError, match="output_device must be 'cpu' or 'gpu'"):
        model.predict(_feeds(0), output_device="tpu")


def _gpu_or_skip() -> Any:
    backend = GpuBackend()
    if not backend.is_available():
        pytest.skip(f"no usable GPU: {backend.availability().reason}")
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_cupy_feeds_and_gpu_outputs_match_host_runs(backend: str) -> None:
    cp = _gpu_or_skip()
    model = keel.load_model(_mlp(), backend=backend)
    for seed in range(4):                       # past the recording on the gpu
        host = _feeds(seed)
        want = model.predict(host)["y"]
        got = model.predict({"x": cp.asarray(host["x"])}, output_device="gpu")["y"]
        assert isinstance(got, cp.ndarray)
        np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(model.predict({"x": cp.asarray(host["x"])})["y"], want,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_outputs_are_the_callers_own() -> None:
    cp = _gpu_or_skip()
    model = keel.load_model(_mlp(), backend="gpu")
    outs = [model.predict(_feeds(seed), output_device="gpu")["y"] for seed in range(4)]
    reference = keel.load_model(_mlp(), backend="reference")
    for seed, out in enumerate(outs):
        np.testing.assert_allclose(cp.asnumpy(out), reference.predict(_feeds(seed))["y"],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_torch_cuda_tensors_are_feeds() -> None:
    _gpu_or_skip()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    model = keel.load_model(_mlp(), backend="gpu")
    host = _feeds(0)
    got = model.predict({"x": torch.from_numpy(host["x"]).cuda()})["y"]
    np.testing.assert_allclose(got, model.predict(host)["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_a_device_feed_of_the_wrong_dtype_is_refused() -> None:
    cp = _gpu_or_skip()
    model = keel.load_model(_mlp(), backend="gpu")
    with pytest.raises(InvalidArgumentError, match=r"\(on the gpu\) has dtype float64"):
        model.predict({"x": cp.zeros((2, 8))})


@pytest.mark.gpu
def test_a_model_on_the_gpu_is_recorded_and_replayed() -> None:
    _gpu_or_skip()
    model = keel.load_model(_mlp(), backend="gpu")
    reference = keel.load_model(_mlp(), backend="reference")
    for seed in range(4):
        np.testing.assert_allclose(model.predict(_feeds(seed))["y"],
                                   reference.predict(_feeds(seed))["y"], rtol=1e-5, atol=1e-5)
    program = next(p.program for p in model._cache.values() if p.program is not None)
    assert program.captured, program.capture_reason
