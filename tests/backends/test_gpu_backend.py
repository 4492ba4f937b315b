"""The gpu backend: availability branches with a fake CuPy, kernel binding, the real check."""

from __future__ import annotations

import numpy as np
import pytest

from keel.backends.base import DeviceKind, KernelVariant
from keel.backends.cpu import kernels as cpu_kernels
from keel.backends.cpu.backend import CpuBackend
from keel.backends.gpu import kernels as gpu_kernels
from keel.backends.gpu.backend import GpuBackend
from keel.dtypes import DType
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.ops.registry import Op
from tests.backends.fakes import FakeCupy


def test_missing_cupy_is_unavailable_with_an_install_hint(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import importlib

    real = importlib.import_module

    def fake_import(name: str, *args: object) -> object:
        if name == "cupy":
            raise ModuleNotFoundError("No module named 'cupy'")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib, "import_module", fake_import)
    gpu = GpuBackend()
    assert not gpu.is_available()
    assert gpu.availability().reason.startswith("CuPy is not installed (No module named 'cupy')")
    assert "pip install 'keel-runtime[cuda12]'" in gpu.availability().reason
    with pytest.raises(BackendSelectionError, match=r"backend 'gpu' cannot be used: CuPy is not"):
        gpu.require_available()
    with pytest.raises(BackendSelectionError, match=r"'gpu'"):
        gpu.xp  # noqa: B018


@pytest.mark.parametrize(("fake", "match"), [
    (FakeCupy(devices=0), "CuPy is installed but no CUDA device is visible"),
    (FakeCupy(device_error=RuntimeError("cudaErrorInsufficientDriver")),
     "no usable CUDA driver or device: RuntimeError: cudaErrorInsufficientDriver"),
    (FakeCupy(smoke_error=RuntimeError("nvrtc: library not found")),
     "CUDA device 0 failed a smoke test: RuntimeError: nvrtc: library not found"),
])
def test_unavailable_branches_say_why(fake: FakeCupy, match: str) -> None:
    gpu = GpuBackend(cupy_module=fake)
    assert not gpu.is_available()
    assert gpu.availability().reason == match
    with pytest.raises(BackendSelectionError, match=rf"backend 'gpu' cannot be used: {match}"):
        gpu.require_available()


def test_device_index_beyond_the_visible_devices() -> None:
    gpu = GpuBackend(device_index=2, cupy_module=FakeCupy(devices=2))
    assert gpu.availability().reason == "CUDA device 2 requested, 2 visible"
    with pytest.raises(InvalidArgumentError, match=r"device_index must be a non-negative int, "
                                                   r"got -1"):
        GpuBackend(device_index=-1)


def test_available_fake_device_reports_and_runs_shared_kernels() -> None:
    fake = FakeCupy()
    gpu = GpuBackend(cupy_module=fake)
    assert gpu.is_available(), gpu.availability().reason
    assert gpu.availability().reason == ("CuPy 0.0-fake, 1 CUDA device(s); using device 0 "
                                         "(Fake GPU)")
    caps = gpu.capabilities()
    assert caps.device is DeviceKind.GPU and caps.memory_bytes == 8 * 1024**3
    assert "compute capability 9.0" in caps.notes
    assert gpu.context().xp is fake          # kernels see the CuPy namespace
    if Op.ADD not in gpu.kernels:
        pytest.fail("the cpu backend has no add kernel for the gpu backend to share")
    a = gpu.to_device(np.arange(4, dtype=np.float32))
    (res,) = gpu.run(Op.ADD, [a, a])
    np.testing.assert_array_equal(gpu.read(res), [0, 2, 4, 6])
    gpu.synchronize()
    assert fake.synchronized == 1


def test_gpu_table_reuses_the_cpu_kernel_entries() -> None:
    cpu = cpu_kernels.load()
    gpu = gpu_kernels.load()
    for op in cpu.ops():
        for name, variant in cpu.variants(op).items():
            own = gpu.variants(op).get(name)
            if own is not None and own.meta.get("gpu_only"):
                continue              # the gpu's own variant of that name (conv's dispatcher)
            if variant.meta.get("host_only"):
                assert gpu.variants(op).get(name) is not variant
            else:
                # Shared, unless the gpu backend has a kernel of its own by that name.
                mine = gpu.variants(op)[name]
                assert mine is variant or mine.meta.get("gpu") or _without_strings(
                    mine, variant), f"{op.value}/{name} not shared"


def _without_strings(mine: KernelVariant, variant: KernelVariant) -> bool:
    """``mine`` is ``variant`` with the string dtype left out (strings stay on the cpu)."""
    return (variant.dtypes is not None and DType.STRING in variant.dtypes
            and mine.fn is variant.fn and mine.dtypes == variant.dtypes - {DType.STRING})


def test_string_equal_runs_on_the_cpu_only() -> None:
    assert CpuBackend().supports(Op.EQUAL, DType.STRING)
    assert not GpuBackend(cupy_module=FakeCupy()).supports(Op.EQUAL, DType.STRING)
    assert GpuBackend(cupy_module=FakeCupy()).supports(Op.EQUAL, DType.FLOAT32)


def test_seed_constraints_are_opt_in() -> None:
    relaxed = GpuBackend(cupy_module=FakeCupy())
    assert relaxed.allocate((3,), "int64").shape == (3,)
    strict = GpuBackend(seed_constraints=True, cupy_module=FakeCupy())
    assert strict.allocate((2, 2), "float32").shape == (2, 2)
    with pytest.raises(InvalidArgumentError, match=r"holds float32 only, got int64"):
        strict.allocate((4,), "int64")
    with pytest.raises(InvalidArgumentError, match=r"divisible by 4, got 3 for shape \(3,\)"):
        strict.to_device(np.ones(3, np.float32))
    with pytest.raises(InvalidArgumentError, match=r"divisible by 4, got 6"):
        strict.run(Op.ADD, [np.ones(6, np.float32), np.ones(6, np.float32)])
    assert "seed 001 GPU profile constraints enforced" in " ".join(strict.capabilities().notes)


def test_real_gpu_backend_state_is_explained() -> None:
    gpu = GpuBackend()
    avail = gpu.availability()
    assert avail.reason
    if not avail.available:
        with pytest.raises(BackendSelectionError, match=r"backend 'gpu' cannot be used"):
            gpu.allocate((4,), "float32")
