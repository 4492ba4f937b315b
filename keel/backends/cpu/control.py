"""cpu kernels of control flow, sequences and optionals: the reference's.

A control-flow kernel only sequences its subgraphs; their nodes are placed and
compiled like any other graph's (``keel.execution.control``), so the work inside
a branch or a loop body runs on the cpu backend's own kernels.
"""

from __future__ import annotations

import keel.backends.reference.control  # noqa: F401  (registers the reference's kernels)
from keel.backends.cpu.kernels import TABLE
from keel.backends.reference.kernels import TABLE as REFERENCE
from keel.ops.registry import OpGroup

__all__: list[str] = []

for _op in sorted(OpGroup.CONTROL_FLOW | OpGroup.SEQUENCE, key=lambda op: op.value):
    for _variant in REFERENCE.variants(_op).values():
        TABLE.register(_variant)
