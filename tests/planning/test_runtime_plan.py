"""plan_runtime: seed 000's three selection rules, keel's engine chain, fallbacks, pins."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import keel
from keel import config
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.hardware.fakes import FAKE_MACHINES, fake_profile
from keel.hardware.profile import AcceleratorInfo, GpuInfo, HardwareProfile, MemoryInfo
from keel.planning import runtime_plan as rp
from keel.planning.policy import RuntimePolicy
from keel.planning.runtime_plan import RuntimePlan, engine_availability, plan_runtime

GIB = 1024**3
DEFAULT = RuntimePolicy()


def _plan(profile: HardwareProfile, policy: RuntimePolicy = DEFAULT, **kw: object) -> RuntimePlan:
    return plan_runtime(profile, policy, local=False, **kw)  # type: ignore[arg-type]


def _with_gpu(total_gib: float | None, vendor: str = "nvidia") -> HardwareProfile:
    base = fake_profile("x86-avx512-server")
    total = None if total_gib is None else int(total_gib * GIB)
    gpu = GpuInfo(index=0, vendor=vendor, name="Test GPU", total_memory_bytes=total,
                  source="nvidia-smi")
    return dataclasses.replace(base, gpus=(gpu,))


def _with_memory(total_gib: float | None, available_gib: float | None) -> HardwareProfile:
    base = fake_profile("x86-avx512-server")

    def to_bytes(gib: float | None) -> int | None:
        return None if gib is None else int(gib * GIB)

    memory = MemoryInfo(total_bytes=to_bytes(total_gib), available_bytes=to_bytes(available_gib),
                        effective_limit_bytes=to_bytes(total_gib),
                        effective_available_bytes=to_bytes(available_gib))
    return dataclasses.replace(base, memory=memory)


# --- rule 1: llama.cpp GPU vs CPU build ---------------------------------------------


def test_rule1_gpu_build_when_a_gpu_meets_the_threshold() -> None:
    llama = _plan(fake_profile("nvidia-h100-server")).llama_cpp
    assert llama.choice == "gpu" and llama.fallbacks == ("cpu",)
    assert llama.detail == "CUDA build on nvidia GPU 0"
    assert "79.6 GiB >= min_gpu_memory_gb=8" in llama.reason


def test_rule1_cpu_build_when_the_gpu_is_below_the_threshold() -> None:
    llama = _plan(_with_gpu(6.0)).llama_cpp
    assert llama.choice == "cpu" and llama.fallbacks == ("cpu",)
    assert llama.rejected == (("nvidia GPU 0 (Test GPU)", "6.0 GiB < min_gpu_memory_gb=8"),)


def test_rule1_threshold_comes_from_the_policy() -> None:
    assert _plan(_with_gpu(6.0), RuntimePolicy(min_gpu_memory_gb=4)).llama_cpp.choice == "gpu"
    h100 = fake_profile("nvidia-h100-server")
    assert _plan(h100, RuntimePolicy(min_gpu_memory_gb=100)).llama_cpp.choice == "cpu"


def test_rule1_prefer_gpu_false_picks_the_cpu_build() -> None:
    llama = _plan(fake_profile("nvidia-h100-server"), RuntimePolicy(prefer_gpu=False)).llama_cpp
    assert llama.choice == "cpu" and "prefer_gpu is false" in llama.reason


def test_rule1_unknown_gpu_memory_and_no_gpu_pick_the_cpu_build() -> None:
    unknown = _plan(_with_gpu(None)).llama_cpp
    assert unknown.choice == "cpu" and "memory size is unknown" in unknown.rejected[0][1]
    none = _plan(fake_profile("edge-arm-board")).llama_cpp
    assert none.choice == "cpu" and none.reason == "no GPU detected"


@pytest.mark.parametrize(("name", "build"), [
    ("amd-rocm-server", "ROCm/HIP"), ("apple-m2-pro", "Metal"), ("windows-rtx4090", "CUDA"),
])
def test_rule1_build_flavour_follows_the_vendor(name: str, build: str) -> None:
    llama = _plan(fake_profile(name)).llama_cpp
    assert llama.choice == "gpu" and llama.detail.startswith(build)


def test_rule1_picks_the_largest_eligible_gpu() -> None:
    llama = _plan(fake_profile("amd-sysfs-only")).llama_cpp
    assert llama.detail == "ROCm/HIP build on amd GPU 0"
    assert [name for name, _ in llama.rejected] == ["amd GPU 1 (Raphael)"]


# --- rule 2: lightweight Python vs CPython ---------------------------------------------


def test_rule2_lightweight_when_total_memory_is_low() -> None:
    python = _plan(fake_profile("edge-arm-board")).python_runtime
    assert python.choice == "lightweight"
    assert python.reason.startswith("total memory 3.7 GiB < lightweight_memory_threshold_gb=6")


def test_rule2_lightweight_when_only_available_memory_is_low() -> None:
    python = _plan(_with_memory(64, 2)).python_runtime
    assert python.choice == "lightweight" and python.reason.startswith("available memory 2.0")


def test_rule2_cgroup_limit_counts_as_total() -> None:
    assert _plan(fake_profile("container-2core-1gib")).python_runtime.choice == "lightweight"


def test_rule2_cpython_with_lightweight_fallback_otherwise() -> None:
    python = _plan(_with_memory(64, 60)).python_runtime
    assert python.choice == "cpython" and python.fallbacks == ("lightweight",)
    threshold = RuntimePolicy(lightweight_memory_threshold_gb=100)
    assert _plan(_with_memory(64, 60), threshold).python_runtime.choice == "lightweight"


def test_rule2_policy_can_switch_the_rule_off() -> None:
    policy = RuntimePolicy(prefer_lightweight_python_on_low_memory=False)
    python = _plan(fake_profile("edge-arm-board"), policy).python_runtime
    assert python.choice == "cpython" and python.fallbacks == ("lightweight",)


def test_rule2_unknown_memory_cannot_trigger_the_rule() -> None:
    python = _plan(_with_memory(None, None)).python_runtime
    assert python.choice == "cpython" and "memory is unknown" in python.reason


# --- rule 3: accelerator experiments -----------------------------------------------------


def test_rule3_offload_entry_when_allowed_and_detected() -> None:
    plan = _plan(fake_profile("tpu-v5e-vm"))
    assert plan.accelerators.choice == "experimental-offload"
    assert plan.accelerators.detail == "experimental offload to tpu"
    assert plan.accelerators.fallbacks == ("cpu",)
    assert plan.llama_cpp.fallbacks == ("cpu",)          # the standard options stay


def test_rule3_never_removes_gpu_and_cpu_options() -> None:
    h100 = fake_profile("nvidia-h100-server")
    npu = AcceleratorInfo(kind="npu", name="NPU", source="env:NEURO_ACCELERATORS", detail="1")
    plan = _plan(dataclasses.replace(h100, accelerators=(npu,)))
    assert plan.accelerators.choice == "experimental-offload"
    assert plan.accelerators.fallbacks == ("gpu", "cpu")
    assert plan.llama_cpp.choice == "gpu" and plan.engine.choice == "gpu"


def test_rule3_not_allowed_or_not_detected_means_none() -> None:
    off = _plan(fake_profile("inferentia-inf2"), RuntimePolicy(allow_accelerator_experiments=False))
    assert off.accelerators.choice == "none" and "is false" in off.accelerators.reason
    assert _plan(fake_profile("edge-arm-board")).accelerators.reason == "no TPU/NPU detected"


# --- fallbacks on every fake and policy ------------------------------------------------

_POLICIES = [
    RuntimePolicy(), RuntimePolicy(prefer_gpu=False),
    RuntimePolicy(min_gpu_memory_gb=1000, lightweight_memory_threshold_gb=10_000),
    RuntimePolicy(prefer_lightweight_python_on_low_memory=False,
                  allow_accelerator_experiments=False),
]


@pytest.mark.parametrize("name", sorted(FAKE_MACHINES))
@pytest.mark.parametrize("policy", _POLICIES, ids=["defaults", "no-gpu", "high", "off"])
def test_fallbacks_are_always_present(name: str, policy: RuntimePolicy) -> None:
    plan = _plan(fake_profile(name), policy)
    assert "cpu" in plan.llama_cpp.fallbacks
    if plan.python_runtime.choice == "cpython":
        assert "lightweight" in plan.python_runtime.fallbacks
    assert "cpu" in plan.accelerators.fallbacks
    if plan.llama_cpp.choice == "gpu":
        assert "gpu" in plan.accelerators.fallbacks
    assert plan.engine.fallbacks[-1:] == ("reference",) or plan.engine.choice == "reference"
    assert all(s.reason for s in plan.selections)
    assert len(plan.reasons) == 1 + len(plan.selections)
    assert plan.reasons[0].startswith(f"target: {plan.target}")


# --- keel's engine chain -------------------------------------------------------------------


def test_engine_auto_on_a_gpu_less_machine_is_cpu_with_reasons() -> None:
    engine = _plan(fake_profile("edge-arm-board")).engine
    assert (engine.choice, engine.fallbacks) == ("cpu", ("reference",))
    assert engine.rejected == (("gpu", "no NVIDIA GPU in the profile"),)


def test_engine_gpu_for_a_saved_nvidia_profile() -> None:
    engine = _plan(fake_profile("nvidia-h100-nvml")).engine
    assert engine.choice == "gpu" and engine.fallbacks == ("cpu", "reference")
    assert "not checked" in engine.reason


def test_engine_on_this_machine_checks_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    h100 = fake_profile("nvidia-h100-server")
    monkeypatch.setattr(rp, "_cupy_installed", lambda: False)
    gpu_ok, why = engine_availability(h100, local=True)["gpu"]
    assert not gpu_ok and "CuPy is not installed" in why
    assert plan_runtime(h100, DEFAULT, local=True).engine.choice == "cpu"
    monkeypatch.setattr(rp, "_cupy_installed", lambda: True)
    assert plan_runtime(h100, DEFAULT, local=True).engine.choice == "gpu"


def test_engine_gpu_seen_only_on_pci_is_not_available() -> None:
    ok, why = engine_availability(fake_profile("nvidia-no-driver"), local=False)["gpu"]
    assert not ok and "visible only on the PCI bus" in why


def test_engine_prefer_gpu_false_rejects_the_gpu() -> None:
    engine = _plan(fake_profile("nvidia-h100-server"), RuntimePolicy(prefer_gpu=False)).engine
    assert engine.choice == "cpu" and ("gpu", "policy prefer_gpu is false") in engine.rejected


def test_a_pin_to_an_unavailable_engine_raises_naming_it() -> None:
    with pytest.raises(BackendSelectionError, match="backend 'gpu' cannot be used: no NVIDIA"):
        _plan(fake_profile("edge-arm-board"), RuntimePolicy(backend="gpu"))
    try:
        _plan(fake_profile("edge-arm-board"), RuntimePolicy(backend="gpu"))
    except BackendSelectionError as exc:
        assert exc.target == "gpu" and "\n" not in str(exc)


def test_a_pin_to_an_available_engine_has_no_fallback() -> None:
    engine = _plan(fake_profile("nvidia-h100-server"), RuntimePolicy(backend="reference")).engine
    assert engine.choice == "reference" and engine.fallbacks == ()
    assert "pinned" in engine.reason


def test_available_backends_mapping_overrides_the_profile() -> None:
    mapping = {"gpu": (True, "remote box has CuPy"), "cpu": (True, "numpy"),
               "reference": (True, "always")}
    engine = _plan(fake_profile("edge-arm-board"), available_backends=mapping).engine
    assert engine.choice == "gpu" and "remote box has CuPy" in engine.reason
    only_ref = {"cpu": (False, "disabled by the operator"), "reference": (True, "always")}
    engine = _plan(fake_profile("edge-arm-board"), available_backends=only_ref).engine
    assert engine.choice == "reference"
    assert engine.rejected == (("cpu", "disabled by the operator"),)
    with pytest.raises(BackendSelectionError, match="'gpu' cannot be used: it is not among"):
        _plan(fake_profile("edge-arm-board"), RuntimePolicy(backend="gpu"),
              available_backends=only_ref)
    with pytest.raises(BackendSelectionError, match="no engine is available"):
        _plan(fake_profile("edge-arm-board"), available_backends={"cpu": (False, "off")})


def test_a_malformed_mapping_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="available_backends must map"):
        _plan(fake_profile("edge-arm-board"), available_backends={"cpu": True})


def test_policy_none_reads_keel_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_BACKEND", "reference")
    config.reload_settings()
    assert plan_runtime(fake_profile("edge-arm-board")).engine.choice == "reference"
    monkeypatch.setenv("KEEL_BACKEND", "gpu")
    config.reload_settings()
    with pytest.raises(BackendSelectionError, match="'gpu'"):
        plan_runtime(fake_profile("edge-arm-board"))


def test_not_a_profile_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="needs a HardwareProfile, got dict"):
        plan_runtime({})  # type: ignore[arg-type]


# --- the plan as data ------------------------------------------------------------------------


def test_plan_serialises_and_explains() -> None:
    plan = _plan(fake_profile("tpu-v5e-vm"))
    data = json.loads(plan.to_json())
    assert data["target"] == "server" and data["engine"]["choice"] == "cpu"
    assert data["llama_cpp"]["fallbacks"] == ["cpu"]
    assert data["policy"] == RuntimePolicy().to_dict()
    assert yaml.safe_load(plan.to_yaml()) == data
    text = plan.explain()
    assert "accelerators: experimental-offload" in text and "rejected gpu:" in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.target = "edge"  # type: ignore[misc]


def test_this_machine_plans_without_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEEL_BACKEND", raising=False)
    config.reload_settings()
    plan = keel.plan_runtime(keel.probe())
    assert plan.engine.choice in ("gpu", "cpu")
    assert plan.host is not None


def test_planning_never_imports_cupy() -> None:
    code = (
        "import sys, keel\n"
        "from keel.hardware.fakes import fake_profile\n"
        "keel.plan_runtime(keel.probe())\n"
        "keel.plan_runtime(fake_profile('nvidia-h100-server'), local=True)\n"
        "print(sorted(m for m in ('cupy', 'torch', 'onnxruntime') if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "KEEL_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env, cwd=root)
    assert out.stdout.strip() == "[]"


def test_plan_runtime_rejects_a_policy_of_the_wrong_type() -> None:
    with pytest.raises(InvalidArgumentError, match=r"needs a RuntimePolicy or None .* got str"):
        plan_runtime(fake_profile("edge-arm-board"), "policy.yaml")  # type: ignore[arg-type]
