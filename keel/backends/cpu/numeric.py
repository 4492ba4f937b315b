"""cpu kernels of the numeric family, written once against ``ctx.xp``.

``det`` runs the batched LU determinant of ``xp.linalg`` in float32 (float16
inputs are widened, float64 stays float64).
"""

from __future__ import annotations

from typing import Any

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.cpu.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.numeric import BITCAST_DTYPES, FLOAT_DTYPES, check_bitcast, check_det

__all__: list[str] = []



@TABLE.kernel(Op.BITCAST, dtypes=BITCAST_DTYPES, supports_out=True)
def bitcast(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One copy of X's bytes into the output, read as dtype ``to``."""
    x = inputs[0]
    check_bitcast(DType.from_numpy(x.dtype), attrs["to"])
    target = attrs["to"].numpy
    if out is not None and out and out[0] is not None and out[0].flags.c_contiguous:
        # Write X's bytes through a view of the output in X's own dtype.
        out[0].view(x.dtype)[...] = x
        return [out[0]]
    return [x.copy(order="C").view(target)]


@TABLE.kernel(Op.DET, dtypes=FLOAT_DTYPES, supports_out=True)
def det(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """xp.linalg.det over the batch of matrices."""
    xp = ctx.xp
    x = inputs[0]
    if DType.from_numpy(x.dtype) not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"{Op.DET.value}: X must be float16, float32 or float64, got {x.dtype}")
    shape = check_det(x.shape)
    if x.shape[-1] == 0:
        y = xp.ones(shape, dtype=x.dtype)
    else:
        ct = xp.float64 if x.dtype == xp.float64 else xp.float32
        y = xp.linalg.det(x.astype(ct, copy=False)).reshape(shape).astype(x.dtype, copy=False)
    if out is not None and out and out[0] is not None:
        out[0][...] = y
        return [out[0]]
    return [y]
