"""The kernel table of the ``cpu`` backend; family modules register into it."""

from __future__ import annotations

import functools
import importlib

from keel.backends.base import KernelTable
from keel.backends.bf16 import WideningTable

__all__ = ["EXTRA_OPS", "FAMILIES", "TABLE", "load", "load_all"]

TABLE = WideningTable("cpu")

FAMILIES = (
    "elementwise", "memory", "reduction", "shape", "indexing", "matmul", "conv",
    "pooling", "normalization", "resize", "quantization", "qlinear",
    "loss", "attention", "vision", "signal", "recurrent", "numeric", "ml", "trees",
    "control",
    "stateful", "strings",
)


# Families registering ops of other families of schemas (keel.ops.schemas.FAMILY_OPS).
EXTRA_OPS = {"qlinear": ("qgemm", "qlinear_add", "qlinear_conv", "qlinear_global_avg_pool",
                         "qlinear_matmul")}


@functools.lru_cache(maxsize=1)
def load() -> KernelTable:
    """The table, whose family modules (each registers its kernels) are imported when
    their ops are first asked for (``KernelTable.defer``)."""
    from keel.backends.cpu import planner
    from keel.backends.families import deferred_modules

    TABLE.chooser = planner.choose_variant
    TABLE.defer(deferred_modules(__package__, FAMILIES, EXTRA_OPS), load_all)
    return TABLE


def load_all() -> None:
    """Import every family module."""
    for family in FAMILIES:
        importlib.import_module(f"keel.backends.cpu.{family}")
