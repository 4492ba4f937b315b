"""The kernel table of the ``webgpu`` backend: WGSL kernels only, no host fallbacks.

An op without a kernel here is not run by a pinned ``webgpu`` backend (placement
raises ``UnsupportedOperationError`` naming the backends that have it);
``tests/known_failures/webgpu.txt`` lists them.
"""

from __future__ import annotations

import functools

from keel.backends.base import KernelTable

__all__ = ["FLOAT_DTYPES", "TABLE", "load"]

TABLE = KernelTable("webgpu")

# The dtypes the WGSL arithmetic runs on (float16 only on adapters with shader-f16).
FLOAT_DTYPES = ("float32", "float16")


@functools.lru_cache(maxsize=1)
def load() -> KernelTable:
    from keel.backends.webgpu import (
        elementwise,
        generate,
        layers,
        linalg,
        logic,
        planner,
        shape,
    )

    TABLE.chooser = planner.choose_variant
    elementwise.register(TABLE, FLOAT_DTYPES)
    linalg.register(TABLE, FLOAT_DTYPES)
    layers.register(TABLE, FLOAT_DTYPES)
    shape.register(TABLE)
    logic.register(TABLE)
    generate.register(TABLE)
    return TABLE
