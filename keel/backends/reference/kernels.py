"""The kernel table of the ``reference`` backend; family modules register into it."""

from __future__ import annotations

import functools
import importlib

from keel.backends.base import KernelTable

__all__ = ["FAMILIES", "TABLE", "load"]

TABLE = KernelTable("reference")

FAMILIES = (
    "elementwise", "memory", "reduction", "shape", "indexing", "matmul", "conv",
    "pooling", "normalization", "resize", "quantization",
    "loss", "attention", "vision", "signal", "recurrent", "numeric", "ml", "trees",
    "control",
    "stateful", "strings",
)


@functools.lru_cache(maxsize=1)
def load() -> KernelTable:
    """Import every family module (each registers its kernels) and return the table."""
    for family in FAMILIES:
        importlib.import_module(f"keel.backends.reference.{family}")
    return TABLE
