"""Fake backends and a fake CuPy for tests: every branch runs without the hardware."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Availability, Backend, DeviceKind, KernelContext, KernelTable
from keel.backends.registry import BackendRegistry
from keel.ops.registry import Op

__all__ = ["FakeCupy", "SpyBackend", "make_backend", "spy_registry"]


def _add(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
         out: Sequence[Any] | None) -> list[Any]:
    return [ctx.xp.add(inputs[0], inputs[1])]


def _relu(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
          out: Sequence[Any] | None) -> list[Any]:
    return [ctx.xp.maximum(inputs[0], 0)]


def _broken(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
            out: Sequence[Any] | None) -> list[Any]:
    if out is not None:
        out[0][...] = -1          # scribbles on what it was given, then fails
    raise RuntimeError("kernel exploded")


KERNELS: dict[Op, Callable[..., list[Any]]] = {Op.ADD: _add, Op.RELU: _relu, Op.MUL: _broken}


class SpyBackend(Backend):
    """A NumPy backend with chosen ops, availability and device that counts allocations."""

    name = "spy"
    device = DeviceKind.CPU
    ops: frozenset[Op] = frozenset({Op.ADD, Op.RELU})
    available = True
    reason = "spy backend"

    def __init__(self) -> None:
        super().__init__()
        self._xp = _CountingNumpy()

    @property
    def allocations(self) -> int:
        """Arrays made through ``xp.zeros``/``xp.empty`` (allocate, scratch outputs)."""
        return self._xp.allocations

    def _check_available(self) -> Availability:
        return Availability(self.available, self.reason)

    def _kernels(self) -> KernelTable:
        table = KernelTable(self.name)
        for op in self.ops:
            # Ops without a fake kernel get add (selection tests never run them).
            table.kernel(op, supports_out=op is Op.MUL)(KERNELS.get(op, _add))
        return table

    @property
    def xp(self) -> Any:
        return self._xp


class _CountingNumpy(types.SimpleNamespace):
    """NumPy, counting the arrays made with ``zeros`` and ``empty``."""

    def __init__(self) -> None:
        super().__init__(allocations=0)

    def zeros(self, *args: Any, **kwargs: Any) -> np.ndarray:
        self.allocations += 1
        return np.zeros(*args, **kwargs)

    def empty(self, *args: Any, **kwargs: Any) -> np.ndarray:
        self.allocations += 1
        return np.empty(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


def make_backend(name: str, *, device: DeviceKind = DeviceKind.CPU,
                 ops: Sequence[Op] = (Op.ADD, Op.RELU), available: bool = True,
                 reason: str = "", priority: int = 0) -> type[SpyBackend]:
    """A SpyBackend subclass called ``name`` (a factory for registries)."""
    attrs = {"name": name, "device": device, "ops": frozenset(ops), "available": available,
             "reason": reason or (f"{name} is here" if available else f"{name} is missing"),
             "priority": priority}
    return type(f"Spy_{name}", (SpyBackend,), attrs)


def spy_registry(**specs: dict[str, Any]) -> BackendRegistry:
    """A fresh registry of spy backends: ``spy_registry(cpu={...}, gpu={...})``."""
    registry = BackendRegistry()
    for name, spec in specs.items():
        spec = dict(spec)
        priority = spec.pop("priority", 0)
        registry.register(name, make_backend(name, **spec), priority)
    return registry


class FakeCupy(types.ModuleType):
    """Enough of CuPy, backed by NumPy, to run the gpu backend's code paths."""

    def __init__(self, devices: int = 1, *, device_error: Exception | None = None,
                 smoke_error: Exception | None = None) -> None:
        super().__init__("cupy")
        self.__version__ = "0.0-fake"
        self.synchronized = 0
        self._smoke_error = smoke_error
        fake = self

        class _Device(contextlib.AbstractContextManager[Any]):
            def __init__(self, index: int = 0) -> None:
                self.index = index

            def __exit__(self, *exc: object) -> None:
                return None

            def synchronize(self) -> None:
                fake.synchronized += 1

        def count() -> int:
            if device_error is not None:
                raise device_error
            return devices

        def props(index: int) -> dict[str, Any]:
            return {"name": b"Fake GPU", "totalGlobalMem": 8 * 1024**3, "major": 9, "minor": 0}

        runtime = types.SimpleNamespace(getDeviceCount=count, getDeviceProperties=props)
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=_Device)

    def arange(self, *args: Any, **kwargs: Any) -> Any:
        if self._smoke_error is not None:
            raise self._smoke_error
        return np.arange(*args, **kwargs)

    def asnumpy(self, array: Any) -> np.ndarray:
        return np.array(array, copy=True)         # a device-to-host copy, as CuPy's

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)
