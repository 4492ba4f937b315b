"""The kernel table of the ``cpu`` backend; family modules register into it."""

from __future__ import annotations

import functools
import importlib

from keel.backends.base import KernelTable

__all__ = ["FAMILIES", "TABLE", "load"]

TABLE = KernelTable("cpu")

FAMILIES = (
    "elementwise", "memory", "reduction", "shape", "indexing", "matmul", "conv",
    "pooling", "normalization", "resize", "quantization", "qlinear",
    "loss", "attention", "vision", "signal", "recurrent", "numeric", "ml", "trees",
    "control",
    "stateful", "strings",
)


@functools.lru_cache(maxsize=1)
def load() -> KernelTable:
    """Import every family module (each registers its kernels) and return the table."""
    from keel.backends.cpu import planner

    for family in FAMILIES:
        importlib.import_module(f"keel.backends.cpu.{family}")
    TABLE.chooser = planner.choose_variant
    return TABLE
