"""cpu kernels of the stateful family: the reference kernels, registered here.

linear_attention's recurrence is a short loop over tokens of small batched einsums
(one per token at decode, T at prefill), and causal_conv_with_state k slices of one
multiply-add; both are whole-array NumPy already, so the cpu backend runs the same
code (a chunk-parallel linear attention for long prefills is future work).
"""

from __future__ import annotations

from keel.backends.cpu.kernels import TABLE
from keel.backends.reference import kernels as reference
from keel.ops.registry import Op

__all__: list[str] = []

for _op in (Op.LINEAR_ATTENTION, Op.CAUSAL_CONV_WITH_STATE):
    _variant = reference.load().get(_op)
    TABLE.kernel(_op, dtypes=_variant.dtypes, host_only=True,
                 description=_variant.description)(_variant.fn)
