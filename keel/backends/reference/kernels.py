"""The kernel table of the ``reference`` backend; family modules register into it."""

from __future__ import annotations

import functools
import importlib

from keel.backends.base import KernelTable
from keel.backends.bf16 import WideningTable

__all__ = ["FAMILIES", "TABLE", "load", "load_all"]

TABLE = WideningTable("reference")

FAMILIES = (
    "elementwise", "memory", "reduction", "shape", "indexing", "matmul", "conv",
    "pooling", "normalization", "resize", "quantization",
    "loss", "attention", "vision", "signal", "recurrent", "numeric", "ml", "trees",
    "control",
    "stateful", "strings",
)


@functools.lru_cache(maxsize=1)
def load() -> KernelTable:
    """The table, whose family modules (each registers its kernels) are imported when
    their ops are first asked for (``KernelTable.defer``)."""
    from keel.backends.families import deferred_modules

    TABLE.defer(deferred_modules(__package__, FAMILIES), load_all)
    return TABLE


def load_all() -> None:
    """Import every family module."""
    for family in FAMILIES:
        importlib.import_module(f"keel.backends.reference.{family}")
