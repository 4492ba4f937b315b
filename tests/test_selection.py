"""Backend selection: pins, the seed-004 size thresholds, residency, policy, calibration."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from keel import config
from keel.backends.base import DeviceKind
from keel.backends.registry import BackendRegistry
from keel.dtypes import DType
from keel.errors import BackendSelectionError, InvalidArgumentError, UnsupportedOperationError
from keel.hardware.profile import GpuInfo, HardwareProfile
from keel.ops.registry import Op, OpGroup
from keel.planning import selection
from keel.planning.calibration import Measurement, reset_default_calibration
from keel.planning.selection import (
    MB,
    Calibration,
    OperationProperties,
    Selection,
    cost_group,
    gpu_pays_back,
    resolve_pin,
    select_backend,
)
from tests.backends.fakes import spy_registry

ALL = (Op.ADD, Op.RELU, Op.MATMUL, Op.CONV2D, Op.SUM)


@pytest.fixture(autouse=True)
def _no_env_pin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.delenv("KEEL_BACKEND", raising=False)
    # No calibration cached on the machine running the tests may change the static rules.
    monkeypatch.delenv("KEEL_CALIBRATION", raising=False)
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    config.settings.cache_clear()
    reset_default_calibration()
    yield
    reset_default_calibration()
    config.settings.cache_clear()


def _registry(gpu_available: bool = True, gpu_ops: tuple[Op, ...] = ALL) -> BackendRegistry:
    return spy_registry(
        gpu={"device": DeviceKind.GPU, "ops": gpu_ops, "available": gpu_available,
             "reason": "fake GPU" if gpu_available else "no CUDA device", "priority": 300},
        cpu={"ops": ALL, "priority": 200},
        reference={"ops": (*ALL, Op.SOFTMAX), "priority": 100},
    )


def _props(op: Op, nbytes: int, residency: str = "cpu",
           dtype: DType = DType.FLOAT32) -> OperationProperties:
    return OperationProperties(op, nbytes // dtype.itemsize, nbytes, dtype, residency)


@pytest.mark.parametrize(("op", "nbytes", "backend"), [
    (Op.ADD, 512 * 1000, "cpu"),            # < 1 MB: always the CPU
    (Op.MATMUL, 999_999, "cpu"),
    (Op.MATMUL, 5 * MB, "cpu"),             # 1..10 MB matmul: the CPU
    (Op.MATMUL, 11 * MB, "gpu"),            # > 10 MB matmul: the GPU
    (Op.CONV2D, 11 * MB, "gpu"),
    (Op.ADD, 50 * MB, "cpu"),               # elementwise needs > 100 MB
    (Op.RELU, 101 * MB, "gpu"),
    (Op.SUM, 500 * MB, "cpu"),              # no static crossover: the CPU
])
def test_seed_004_thresholds(op: Op, nbytes: int, backend: str) -> None:
    sel = select_backend(_props(op, nbytes), registry=_registry())
    assert sel.backend == backend, sel
    assert sel.reason


def test_every_rejected_candidate_has_a_reason() -> None:
    sel = select_backend(_props(Op.ADD, 1000), registry=_registry())
    assert sel.backend == "cpu"
    assert dict(sel.rejected) == {
        "gpu": "cpu chosen instead: 1.0 kB of input is under 1 MB: launch and transfer "
               "overhead dominate",
        "reference": "lower in the priority chain than cpu",
    }


def test_unavailable_gpu_is_rejected_with_its_reason() -> None:
    sel = select_backend(_props(Op.MATMUL, 50 * MB), registry=_registry(gpu_available=False))
    assert sel.backend == "cpu"
    assert sel.reason == "the CPU is the only device available for it"
    assert ("gpu", "unavailable: no CUDA device") in sel.rejected


def test_data_on_the_gpu_stays_there() -> None:
    sel = select_backend(_props(Op.ADD, 1000, residency="gpu"), registry=_registry())
    assert sel.backend == "gpu"
    assert "already live on the GPU" in sel.reason


def test_gpu_data_comes_back_when_the_gpu_lacks_the_op() -> None:
    reg = _registry(gpu_ops=(Op.ADD,))
    sel = select_backend(_props(Op.MATMUL, 50 * MB, residency="gpu"), registry=reg)
    assert sel.backend == "cpu"
    assert ("gpu", "has no kernel for matmul") in sel.rejected


def test_falls_back_to_reference_for_ops_only_it_has() -> None:
    sel = select_backend(_props(Op.SOFTMAX, 1000), registry=_registry())
    assert sel.backend == "reference"
    assert dict(sel.rejected)["cpu"] == "has no kernel for softmax"


def test_no_backend_with_the_op_is_an_unsupported_operation() -> None:
    with pytest.raises(UnsupportedOperationError,
                       match=r"'conv' is not supported; supported on: no backend \(no backend "
                             r"can run it here \(gpu: has no kernel for conv"):
        select_backend(_props(Op.CONV, 1000), registry=_registry())


def test_pin_is_authoritative_even_when_slower() -> None:
    sel = select_backend(_props(Op.ADD, 8), registry=_registry(), pinned="gpu")
    assert sel == Selection("gpu", "pinned by the caller")


def test_pinned_unavailable_backend_raises_naming_it() -> None:
    with pytest.raises(BackendSelectionError, match=r"backend 'gpu' cannot be used: no CUDA"
                       ) as info:
        select_backend(_props(Op.ADD, 8), registry=_registry(gpu_available=False),
                       pinned="gpu")
    assert info.value.target == "gpu"


def test_pinned_backend_without_the_op_does_not_fall_back() -> None:
    with pytest.raises(UnsupportedOperationError,
                       match=r"'softmax' is not supported by backend 'cpu'; supported on: "
                             r"reference \(backend pinned by the caller has no kernel"):
        select_backend(_props(Op.SOFTMAX, 8), registry=_registry(), pinned="cpu")


def test_pin_by_policy_and_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = _registry()
    policy = SimpleNamespace(backend="reference")
    assert select_backend(_props(Op.ADD, 8), policy=policy, registry=reg).reason == \
        "pinned by the policy"
    monkeypatch.setenv("KEEL_BACKEND", "gpu")
    config.settings.cache_clear()
    assert select_backend(_props(Op.ADD, 8), registry=reg) == \
        Selection("gpu", "pinned by KEEL_BACKEND")
    # an explicit argument beats the policy, which beats the environment
    assert resolve_pin("cpu", policy) == ("cpu", "the caller")
    assert resolve_pin("auto", policy) == ("reference", "the policy")
    assert resolve_pin(None, None) == ("gpu", "KEEL_BACKEND")


def test_policy_can_keep_work_off_the_gpu() -> None:
    sel = select_backend(_props(Op.MATMUL, 50 * MB), registry=_registry(),
                         policy=SimpleNamespace(prefer_gpu=False))
    assert sel.backend == "cpu"
    assert ("gpu", "the policy sets prefer_gpu: false") in sel.rejected


def _profile(total_gib: float, free_gib: float) -> HardwareProfile:
    gib = 1024**3
    gpu = GpuInfo(index=0, vendor="nvidia", name="Fake", total_memory_bytes=int(total_gib * gib),
                  free_memory_bytes=int(free_gib * gib))
    return HardwareProfile(gpus=(gpu,))


def test_profile_memory_limits_the_gpu() -> None:
    small = _profile(4, 4)
    sel = select_backend(_props(Op.MATMUL, 50 * MB), profile=small, registry=_registry(),
                         policy=SimpleNamespace(min_gpu_memory_gb=8.0))
    assert sel.backend == "cpu"
    assert "under the policy's min_gpu_memory_gb 8.0" in dict(sel.rejected)["gpu"]
    full = _profile(80, 0.01)
    sel = select_backend(_props(Op.MATMUL, 50 * MB), profile=full, registry=_registry())
    assert "exceed free GPU memory" in dict(sel.rejected)["gpu"]
    roomy = _profile(80, 70)
    assert select_backend(_props(Op.MATMUL, 50 * MB), profile=roomy,
                          registry=_registry()).backend == "gpu"


def test_calibration_overrides_static_thresholds_per_group() -> None:
    cal = Calibration({"elementwise": 2 * MB, OpGroup.MATMUL_LIKE: None}, source="bench run 7")
    reg = _registry()
    sel = select_backend(_props(Op.ADD, 3 * MB), registry=reg, calibration=cal)
    assert sel.backend == "gpu"
    assert "measured GPU crossover 2.0 MB (bench run 7)" in sel.reason
    sel = select_backend(_props(Op.MATMUL, 500 * MB), registry=reg, calibration=cal)
    assert sel.backend == "cpu"
    assert "never beat the CPU for matmul_like ops" in sel.reason
    # a group the calibration does not cover keeps the static rule
    assert select_backend(_props(Op.CONV2D, 11 * MB), registry=reg,
                          calibration=cal).backend == "gpu"


def _measured(group: OpGroup, op: Op, dtype: DType, points: list[tuple[int, float, float]],
              ) -> list[Measurement]:
    return [Measurement(group, dtype, op, "", n // dtype.itemsize, n, cpu, gpu, gpu / 4, 5)
            for n, cpu, gpu in points]


def test_a_measured_calibration_decides_per_dtype_and_quotes_the_measurement() -> None:
    points = _measured(OpGroup.MATMUL_LIKE, Op.MATMUL, DType.FLOAT32,
                       [(1_000_000, 0.5e-3, 0.9e-3), (4_194_304, 1.9e-3, 0.21e-3)])
    cal = Calibration({"matmul_like/float32": 4_194_304, "matmul_like/float16": None},
                      source="measured today", measurements=tuple(points))
    reg = _registry()
    sel = select_backend(_props(Op.MATMUL, 5 * MB), registry=reg, calibration=cal)
    assert sel == Selection("gpu", "5.0 MB of float32 matmul_like input is at or over the "
                                   "measured GPU crossover 4.2 MB (measured today: at 4.2 MB "
                                   "float32 matmul, gpu 210 µs incl. copies vs cpu 1.9 ms)",
                            (("cpu", f"gpu chosen instead: {sel.reason}"),
                             ("reference", f"gpu chosen instead: {sel.reason}")))
    # under the crossover, even above the static 10 MB: the measurement wins over seed 004
    small = select_backend(_props(Op.MATMUL, 2 * MB), registry=reg, calibration=cal)
    assert small.backend == "cpu" and "is under the measured GPU crossover 4.2 MB" in small.reason
    # float16 never won; float64 was not measured, so the static rule decides
    half = select_backend(_props(Op.MATMUL, 500 * MB, dtype=DType.FLOAT16), registry=reg,
                          calibration=cal)
    assert half.backend == "cpu"
    assert half.reason == "calibration (measured today): the GPU never beat the CPU for " \
                          "float16 matmul_like ops"
    wide = select_backend(_props(Op.MATMUL, 11 * MB, dtype=DType.FLOAT64), registry=reg,
                          calibration=cal)
    assert wide.backend == "gpu" and wide.reason.endswith(
        "over the 10 MB where the GPU pays back the transfer (the calibration has no float64 "
        "measurement for matmul_like ops)")


def test_pins_and_residency_beat_a_calibration() -> None:
    cal = Calibration({"elementwise": 0})          # the GPU always wins, by measurement
    reg = _registry()
    assert select_backend(_props(Op.ADD, 8), registry=reg, calibration=cal).backend == "gpu"
    assert select_backend(_props(Op.ADD, 8), registry=reg, calibration=cal,
                          pinned="cpu") == Selection("cpu", "pinned by the caller")
    never = Calibration({"elementwise": None})
    sel = select_backend(_props(Op.ADD, 8, residency="gpu"), registry=reg, calibration=never)
    assert sel.backend == "gpu" and "already live on the GPU" in sel.reason


def test_the_default_calibration_is_read_only_when_it_can_matter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def default() -> Calibration:
        calls.append(1)
        return Calibration({"elementwise": 0}, source="cached")

    monkeypatch.setattr(selection, "default_calibration", default)
    # no usable GPU, a pin, data already on the GPU: nothing to decide by cost
    select_backend(_props(Op.ADD, 8), registry=_registry(gpu_available=False))
    select_backend(_props(Op.ADD, 8), registry=_registry(), pinned="cpu")
    select_backend(_props(Op.ADD, 8, residency="gpu"), registry=_registry())
    assert calls == []
    sel = select_backend(_props(Op.ADD, 8), registry=_registry())
    assert calls == [1] and sel.backend == "gpu" and sel.reason.endswith(
        "the measured GPU crossover 0 B (cached)")
    # an explicit calibration is used instead; an empty one keeps the static rules
    assert select_backend(_props(Op.ADD, 8), registry=_registry(),
                          calibration=Calibration()).backend == "cpu"
    assert calls == [1]


def test_calibration_round_trips_and_validates() -> None:
    cal = Calibration({"convolution": 4 * MB}, source="x")
    assert Calibration.from_dict(cal.to_dict()) == cal
    assert cal.covers(OpGroup.CONVOLUTION) and not cal.covers(OpGroup.ELEMENTWISE)
    with pytest.raises(InvalidArgumentError, match=r"unknown op group 'matmul'; allowed: "):
        Calibration({"matmul": 1})
    with pytest.raises(InvalidArgumentError, match=r"crossover for elementwise must be a "
                                                   r"non-negative int of bytes or None, got -1"):
        Calibration({"elementwise": -1})
    with pytest.raises(InvalidArgumentError, match=r"must be a mapping with a 'crossover_bytes'"):
        Calibration.from_dict({"crossover_bytes": [1, 2]})


def test_operation_properties_validate() -> None:
    props = OperationProperties("add", 4, 16, "float32")  # type: ignore[arg-type]
    assert props.op is Op.ADD and props.dtype is DType.FLOAT32 and props.residency == "cpu"
    with pytest.raises(InvalidArgumentError, match=r"residency 'tpu' is not a device kind; "
                                                   r"allowed: cpu, gpu"):
        OperationProperties(Op.ADD, 4, 16, DType.FLOAT32, "tpu")
    with pytest.raises(InvalidArgumentError, match=r"nbytes must be a non-negative int, got -1"):
        OperationProperties(Op.ADD, 4, -1, DType.FLOAT32)


def test_cost_groups_and_gpu_pay_back() -> None:
    assert cost_group(Op.QLINEAR_MATMUL) is OpGroup.MATMUL_LIKE
    assert cost_group(Op.CONV) is OpGroup.CONVOLUTION
    assert cost_group(Op.RELU) is OpGroup.ELEMENTWISE
    assert cost_group(Op.SUM) is OpGroup.REDUCTION
    assert gpu_pays_back(_props(Op.MATMUL, 11 * MB))[0]
    assert not gpu_pays_back(_props(Op.MATMUL, 10 * MB))[0]     # "over 10 MB", not at


def test_selection_serialises() -> None:
    sel = select_backend(_props(Op.ADD, 1000), registry=_registry())
    data: dict[str, Any] = sel.to_dict()
    assert data["backend"] == "cpu"
    assert {r["backend"] for r in data["rejected"]} == {"gpu", "reference"}
    assert str(sel).splitlines()[0].startswith("cpu: ")


def test_real_registry_selects_an_available_backend() -> None:
    from keel.backends.registry import builtin_registry

    reg = builtin_registry()
    sel = select_backend(_props(Op.ADD, 64), registry=reg)
    assert reg.availability(sel.backend).available


def test_select_backend_rejects_what_is_not_operation_properties() -> None:
    with pytest.raises(InvalidArgumentError, match="needs OperationProperties, got str"):
        select_backend("add")  # type: ignore[arg-type]
