"""The ``reference`` backend: readable NumPy kernels, the executable spec of every op."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from keel.backends.base import Availability, Backend, DeviceKind, KernelTable
from keel.dtypes import NARROW

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """Runs every op as plainly as NumPy allows, accumulating floats in float64.

    It is always available; automatic selection puts it last in the chain, so
    it runs only the ops no faster backend has (and the conformance suite).
    """

    name = "reference"
    device = DeviceKind.CPU
    dtypes = Backend.dtypes | NARROW     # NumPy holds ml_dtypes' arrays

    def _check_available(self) -> Availability:
        return Availability(True, "NumPy is always available")

    def _kernels(self) -> KernelTable:
        from keel.backends.reference import kernels

        return kernels.load()

    @property
    def xp(self) -> ModuleType:
        return np

    def _capability_details(self) -> dict[str, object]:
        return {"notes": ("the executable spec: float64 accumulation, no tricks",)}
