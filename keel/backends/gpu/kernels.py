"""The kernel table of the ``gpu`` backend.

The ``cpu`` kernels are written once against ``ctx.xp``; here the same
:class:`KernelVariant` entries are bound to CuPy (the ``gpu`` backend passes
``cupy`` as ``ctx.xp``). Variants marked ``host_only`` (NumPy-only code) are
left out. GPU-only variants register on :data:`TABLE` from modules listed in
:data:`FAMILIES` and win over a ``cpu`` variant of the same name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from keel.backends.base import KernelTable
from keel.dtypes import DType
from keel.ops.registry import Op

__all__ = ["FAMILIES", "TABLE", "load"]

TABLE = KernelTable("gpu")

# Modules of keel.backends.gpu with GPU-only kernels (raw CUDA, cuBLAS, cuDNN).
FAMILIES: tuple[str, ...] = (
    "cudnn_conv", "fused_norm", "fused_elementwise", "fused_pool", "fused_scatter", "gemm",
)


@functools.lru_cache(maxsize=1)
def load() -> KernelTable:
    """GPU-only kernels, then every ``cpu`` kernel that runs through ``ctx.xp``."""
    from keel.backends.cpu import kernels as cpu

    for family in FAMILIES:
        importlib.import_module(f"keel.backends.gpu.{family}")
    from keel.backends.gpu import planner

    TABLE.chooser = planner.choose_variant
    shared = cpu.load()
    for op in Op:
        for name, variant in shared.variants(op).items():
            if variant.meta.get("host_only") or name in TABLE.variants(op):
                continue
            if variant.dtypes is not None and DType.STRING in variant.dtypes:
                # Strings are host object arrays: a shared kernel takes them on the cpu only.
                variant = dataclasses.replace(variant, dtypes=variant.dtypes - {DType.STRING})
            TABLE.register(variant)
    return TABLE
