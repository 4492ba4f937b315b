"""Backends with an artificial, deterministic cost, for calibration tests.

Kernels and copies really run (NumPy, the reference kernels), but time as
seen by :func:`keel.planning.calibration.calibrate` moves only on a
:class:`FakeClock` that each kernel and copy advances by its modelled cost.
So a sweep's medians and crossover are exact and the tests never measure
real speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import DeviceKind, KernelContext, KernelTable
from keel.backends.registry import BackendRegistry
from keel.hardware.profile import CpuInfo, GpuInfo, HardwareProfile
from keel.ops.registry import Op
from keel.testing.backends import FakeBackend

__all__ = ["cpu_model", "gpu_model", "copy_model", "CostedBackend", "FakeClock", "costed_registry",
           "fake_profile"]

Cost = Callable[[Op, int], float]          # (op, bytes of the inputs) -> seconds


def cpu_model(op: Op, nbytes: int) -> float:
    return 2e-6 + nbytes * 1e-9             # little overhead, 1 GB/s


def gpu_model(op: Op, nbytes: int) -> float:
    return 20e-6 + nbytes * 1e-11           # launch overhead, 100 GB/s


def copy_model(nbytes: int) -> float:
    return 10e-6 + nbytes * 1e-10           # per copy: latency, 10 GB/s


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class CostedBackend(FakeBackend):
    """A FakeBackend whose kernels and copies advance ``clock`` by a cost model.

    ``asynchronous=True`` mimics a GPU stream: kernel time is only queued, and
    reaches the clock when the backend synchronizes (or copies a result out).
    """

    def __init__(self, name: str, device: DeviceKind, clock: FakeClock, cost: Cost, *,
                 copy_cost: Callable[[int], float] = copy_model, ops: Sequence[Op] | None = None,
                 available: bool = True, reason: str = "", asynchronous: bool = False) -> None:
        super().__init__(name, device, ops=ops, available=available, reason=reason)
        self.clock, self.cost, self.copy_cost = clock, cost, copy_cost
        self.asynchronous = asynchronous
        self.queued = 0.0
        self.kernel_calls = 0

    def _kernels(self) -> KernelTable:
        base = super()._kernels()
        table = KernelTable(self.name)
        for op in base.ops():
            for variant in base.variants(op).values():
                table.register(dataclasses.replace(variant, fn=self._costed(op, variant.fn)))
        return table

    def _costed(self, op: Op, fn: Any) -> Any:
        def run(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
                out: Sequence[Any] | None) -> Any:
            self.kernel_calls += 1
            seconds = self.cost(op, sum(x.nbytes for x in inputs if x is not None))
            if self.asynchronous:
                self.queued += seconds
            else:
                self.clock.advance(seconds)
            return fn(ctx, inputs, attrs, out)
        return run

    def _to_device(self, host: np.ndarray) -> np.ndarray:
        if self.device is DeviceKind.GPU:
            self.clock.advance(self.copy_cost(host.nbytes))
        return super()._to_device(host)

    def _to_host(self, array: Any) -> np.ndarray:
        self._synchronize()       # a copy out waits for the queued work, as cupy.asnumpy does
        if self.device is DeviceKind.GPU:
            self.clock.advance(self.copy_cost(array.nbytes))
        return np.array(array, copy=True)

    def _synchronize(self) -> None:
        self.clock.advance(self.queued)
        self.queued = 0.0


def costed_registry(clock: FakeClock, *, gpu_cost: Cost = gpu_model, cpu_cost: Cost = cpu_model,
                    gpu_available: bool = True, gpu_ops: Sequence[Op] | None = None,
                    asynchronous: bool = True) -> BackendRegistry:
    """gpu → cpu, both costed on ``clock``; the gpu may be unavailable or lack ops."""
    registry = BackendRegistry()
    registry.register("gpu", lambda: CostedBackend(
        "gpu", DeviceKind.GPU, clock, gpu_cost, ops=gpu_ops, available=gpu_available,
        reason="fake GPU" if gpu_available else "no CUDA device",
        asynchronous=asynchronous), 300)
    registry.register("cpu", lambda: CostedBackend("cpu", DeviceKind.CPU, clock, cpu_cost), 200)
    return registry


def fake_profile(cpu: str = "Fake CPU 9000", gpu: str = "Fake GPU", driver: str = "550.1",
                 ) -> HardwareProfile:
    """A small machine description for fingerprints (memory unknown: no memory limit)."""
    return HardwareProfile(
        cpu=CpuInfo(brand=cpu, architecture="x86_64", logical_cores=8, usable_cores=8),
        gpus=(GpuInfo(index=0, vendor="nvidia", name=gpu, driver=driver,
                      total_memory_bytes=80 * 1024**3),))
