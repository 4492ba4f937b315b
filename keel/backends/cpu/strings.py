"""cpu kernels of the string family: the reference kernels, registered here, host-only
(strings are object arrays of Python ``str``; there is nothing faster to do with them)."""

from __future__ import annotations

from keel.backends.cpu.kernels import TABLE
from keel.backends.reference import kernels as reference
from keel.ops.registry import OpGroup

__all__: list[str] = []

for _op in sorted(OpGroup.STRING):
    _variant = reference.load().get(_op)
    TABLE.kernel(_op, dtypes=_variant.dtypes, host_only=True,
                 description=_variant.description)(_variant.fn)
