"""A NumPy backend with a chosen name, device kind, op set and availability.

Placement, copies and fallbacks can then be exercised without the hardware:
``FakeBackend("gpu", DeviceKind.GPU, ops={Op.MATMUL})`` claims to be a GPU
backend that only has matmul; ``available=False`` mimics a backend that
cannot run here (with ``reason``). Kernels come from ``table`` when given,
else from the reference backend's table, restricted to ``ops``.
``CountingBackend`` runs the reference kernels and counts each call by op, so
a test can see which code path really ran a graph.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from keel.backends.base import Availability, Backend, DeviceKind, Kernel, KernelTable
from keel.ops.registry import Op

__all__ = ["CountingBackend", "FakeBackend", "restricted_table"]


class FakeBackend(Backend):
    """A configurable stand-in backend; arrays are NumPy arrays whatever the device."""

    def __init__(self, name: str, device: DeviceKind = DeviceKind.CPU, *,
                 ops: Iterable[Op] | None = None, table: KernelTable | None = None,
                 available: bool = True, reason: str = "") -> None:
        super().__init__()
        self.name = name            # type: ignore[misc]  # per instance, on purpose
        self.device = device        # type: ignore[misc]
        self._source = table
        self._ops = None if ops is None else frozenset(ops)
        self._available = available
        self._reason = reason or ("fake backend" if available else "fake: unavailable")
        self.copies_in = 0

    def _check_available(self) -> Availability:
        return Availability(self._available, self._reason)

    def _kernels(self) -> KernelTable:
        if self._source is None:
            from keel.backends.reference.kernels import load

            return restricted_table(self.name, load(), self._ops)
        return restricted_table(self.name, self._source, self._ops)

    @property
    def xp(self) -> ModuleType:
        return np

    def _to_device(self, host: np.ndarray) -> np.ndarray:
        self.copies_in += 1
        return np.array(host, copy=True)


def restricted_table(name: str, source: KernelTable, ops: Iterable[Op] | None) -> KernelTable:
    """A table named ``name`` with the variants of ``source`` for ``ops`` (all when None)."""
    keep = None if ops is None else set(ops)
    table = KernelTable(name)
    for op in Op:
        if keep is not None and op not in keep:
            continue
        for variant in source.variants(op).values():
            table.register(variant)
    return table


class CountingBackend(FakeBackend):
    """A host backend running the reference kernels that counts the calls per op."""

    def __init__(self, name: str = "counting") -> None:
        super().__init__(name)
        self.calls: collections.Counter[Op] = collections.Counter()

    def _kernels(self) -> KernelTable:
        source = super()._kernels()
        table = KernelTable(self.name)
        for op in Op:
            for variant in source.variants(op).values():
                table.register(dataclasses.replace(variant, fn=self._counted(op, variant.fn),
                                                   bind=None))   # every call counted
        return table

    def _counted(self, op: Op, fn: Kernel) -> Kernel:
        def counted(ctx: Any, inputs: Sequence[Any], attrs: Any, out: Any) -> Any:
            self.calls[op] += 1
            return fn(ctx, inputs, attrs, out)

        return counted
