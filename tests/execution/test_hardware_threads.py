"""A hardware profile given to ``load_model`` decides the cpu backend's thread count (and
the SIMD level and memory it reports), so a plan for another machine can be made and read
here; ``threads=`` and ``KEEL_THREADS`` stay authoritative, and the plan says which
decided."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel import config, load_model
from keel.backends.cpu.backend import CpuBackend, default_threads
from keel.errors import InvalidArgumentError
from keel.hardware.fakes import fake_profile
from keel.hardware.profile import HardwareProfile
from keel.testing.models import make_inputs, mlp

SIXTEEN = ("cpu backend, 16 threads: usable cores of the given hardware profile (AMD Ryzen 7 "
           "5800X 8-Core Processor: 16 usable of 16 logical cores)")


@pytest.fixture(scope="module")
def proto() -> Any:
    return mlp(in_features=16, hidden=(32, 16), classes=4)


@pytest.fixture
def sixteen_cores() -> HardwareProfile:
    """Another machine: 16 usable cores, AVX2, a GPU without its driver."""
    profile = fake_profile("nvidia-no-driver")
    assert profile.cpu.usable_cores == 16 and profile.cpu.simd_level == "avx2"
    return profile


@pytest.fixture(autouse=True)
def _no_keel_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEEL_THREADS", raising=False)
    config.reload_settings()


def _cpu_thread_notes(reasons: tuple[str, ...]) -> list[str]:
    return [r for r in reasons if r.startswith("cpu backend, ")]


def test_the_profile_decides_the_threads_and_the_plan_says_so(
        proto: Any, sixteen_cores: HardwareProfile) -> None:
    model = load_model(proto, hardware=sixteen_cores)
    assert _cpu_thread_notes(model.plan.reasons) == [SIXTEEN]
    assert SIXTEEN in model.plan.to_dict()["reasons"]
    assert SIXTEEN in model.explain()
    feeds = make_inputs(proto, 5)
    want = load_model(proto, backend="reference").predict(feeds)["probs"]
    np.testing.assert_allclose(model.predict(feeds)["probs"], want, rtol=1e-5, atol=1e-6)


def test_the_program_runs_under_the_profiles_threads(proto: Any,
                                                     sixteen_cores: HardwareProfile) -> None:
    # In float64 the products run on BLAS, which the program caps at the backend's threads.
    model = load_model(proto, hardware=sixteen_cores, precision="fp64")
    feeds = make_inputs(proto, 5)
    want = load_model(proto, backend="reference").predict(feeds)["probs"]
    np.testing.assert_allclose(model.predict(feeds)["probs"], want, rtol=1e-6, atol=1e-7)
    assert "cpu threads: BLAS on 16 threads: " in model.explain()


def test_threads_given_win_over_the_profile(proto: Any,
                                            sixteen_cores: HardwareProfile) -> None:
    model = load_model(proto, hardware=sixteen_cores, threads=3)
    assert _cpu_thread_notes(model.plan.reasons) == [
        "cpu backend, 3 threads: set by the caller (threads=3)"]


def test_keel_threads_wins_over_the_profile(monkeypatch: pytest.MonkeyPatch, proto: Any,
                                            sixteen_cores: HardwareProfile) -> None:
    monkeypatch.setenv("KEEL_THREADS", "5")
    config.reload_settings()
    model = load_model(proto, hardware=sixteen_cores)
    assert _cpu_thread_notes(model.plan.reasons) == ["cpu backend, 5 threads: KEEL_THREADS=5"]
    assert _cpu_thread_notes(load_model(proto, hardware=sixteen_cores, threads=2).plan.reasons
                             ) == ["cpu backend, 2 threads: set by the caller (threads=2)"]


def test_without_a_profile_this_machine_decides(proto: Any) -> None:
    notes = _cpu_thread_notes(load_model(proto).plan.reasons)
    assert notes == [f"cpu backend, {default_threads()} threads: usable cores of this machine "
                     "(affinity mask and cgroup quota, from the hardware probe)"]


def test_the_backend_reports_the_profiles_cpu_not_this_one() -> None:
    arm = fake_profile("edge-arm-board")
    backend = CpuBackend(hardware=arm)
    assert backend.simd_level == "sve2" and backend.threads == 8
    caps = backend.capabilities()
    assert (caps.threads, caps.simd_level) == (8, "sve2")
    assert caps.memory_bytes == arm.memory.effective_limit_bytes is not None
    assert any(n.startswith("threads: 8 threads: usable cores of the given hardware profile")
               for n in caps.notes)


def test_a_profile_without_usable_cores_falls_back_in_the_open(
        sixteen_cores: HardwareProfile) -> None:
    import dataclasses

    logical_only = dataclasses.replace(
        sixteen_cores, cpu=dataclasses.replace(sixteen_cores.cpu, usable_cores=None))
    backend = CpuBackend(hardware=logical_only)
    assert backend.threads == 16
    assert backend.threads_reason.startswith("16 threads: logical cores of the given hardware "
                                             "profile")
    nothing = dataclasses.replace(sixteen_cores, cpu=dataclasses.replace(
        sixteen_cores.cpu, usable_cores=None, logical_cores=None))
    assert CpuBackend(hardware=nothing).threads_reason == (
        f"{default_threads()} threads: usable cores of this machine (affinity mask and cgroup "
        "quota, from the hardware probe); the given hardware profile does not say how many "
        "cores it has")


def test_hardware_must_be_a_profile(proto: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=r"hardware must be a keel\.hardware\."
                                                   r"HardwareProfile or None, got dict"):
        load_model(proto, hardware={"cpu": 16})
