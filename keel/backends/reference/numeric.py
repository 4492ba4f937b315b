"""Reference kernels of the numeric family: bitcast and det (LU in float64)."""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.numeric import BITCAST_DTYPES, FLOAT_DTYPES, check_bitcast, check_det

__all__: list[str] = []



@TABLE.kernel(Op.BITCAST, dtypes=BITCAST_DTYPES)
def bitcast(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """X's bytes, element by element, read as dtype ``to``."""
    x = inputs[0]
    check_bitcast(DType.from_numpy(x.dtype), attrs["to"])
    return [x.copy(order="C").view(attrs["to"].numpy)]


@TABLE.kernel(Op.DET, dtypes=FLOAT_DTYPES)
def det(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """numpy.linalg.det of every (M, M) matrix, in float64."""
    x = inputs[0]
    if DType.from_numpy(x.dtype) not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"{Op.DET.value}: X must be float16, bfloat16, float32 or float64, got {x.dtype}")
    shape = check_det(x.shape)
    if x.shape[-1] == 0:       # the determinant of a 0 x 0 matrix is 1
        return [np.ones(shape, dtype=x.dtype)]
    return [np.asarray(np.linalg.det(x.astype(np.float64))).reshape(shape).astype(x.dtype)]
