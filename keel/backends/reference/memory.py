"""Reference kernels of the memory family: ``copy``, ``fill``, ``cast``, ``identity``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import KernelContext
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.memory import check_cast
from keel.ops.types import checked_numel

Attrs = Mapping[str, Any]


@TABLE.kernel(Op.COPY, supports_out=True)
def copy(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
         out: Sequence[Any] | None) -> list[Any]:
    """Copy input 0; an output given must have exactly its shape and dtype (seed 001)."""
    x = np.asarray(inputs[0])
    if out is None:
        return [x.copy()]
    dst = out[0]
    if tuple(dst.shape) != x.shape or dst.dtype != x.dtype:
        raise InvalidArgumentError(
            f"copy needs an output of exactly the input's shape and dtype "
            f"{x.dtype}{list(x.shape)}, got {dst.dtype}{list(dst.shape)} (use cast to convert)"
        )
    dst[...] = x
    return [dst]


@TABLE.kernel(Op.IDENTITY, supports_out=True)
def identity(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
             out: Sequence[Any] | None) -> list[Any]:
    """The input, as a fresh array (or written into the output given); a sequence or an
    optional value as it is."""
    if inputs[0] is None or isinstance(inputs[0], list):
        return [inputs[0] if inputs[0] is None else list(inputs[0])]
    x = np.asarray(inputs[0])
    if out is None:
        return [x.copy()]
    out[0][...] = x
    return [out[0]]


def fill_value(op: Op, source: Any) -> Any:
    """Element 0 of ``source`` as a 0-d array (seed 001: the rest is padding)."""
    flat = source.reshape(-1)
    if flat.shape[0] == 0:
        raise InvalidArgumentError(
            f"{op.value} reads its value from element 0 of input 0, which is empty"
        )
    return flat[0:1].reshape(())


@TABLE.kernel(Op.FILL, supports_out=True)
def fill(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
         out: Sequence[Any] | None) -> list[Any]:
    """Every output element = input 0's first element (seed 001)."""
    value = fill_value(Op.FILL, np.asarray(inputs[0]))
    if out is not None:
        dst = out[0]
    elif attrs.get("shape") is not None:
        shape = tuple(attrs["shape"])
        checked_numel(shape, what="fill shape")
        dtype = attrs["dtype"].numpy if attrs.get("dtype") is not None else value.dtype
        dst = np.empty(shape, dtype)
    else:
        raise InvalidArgumentError(
            "fill needs its output shape: pass an output tensor or the attribute 'shape'"
        )
    with np.errstate(all="ignore"):        # NaN or out-of-range into ints: as cast does
        dst[...] = value.astype(dst.dtype)
    return [dst]


@TABLE.kernel(Op.CAST, supports_out=True)
def cast(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
         out: Sequence[Any] | None) -> list[Any]:
    """ONNX Cast: float -> int truncates toward zero; x -> bool is x != 0."""
    x = np.asarray(inputs[0])
    to: DType = attrs["to"]
    check_cast(DType.from_numpy(x.dtype), to)
    # Out-of-range and NaN float -> int conversions are undefined in ONNX.
    with np.errstate(all="ignore"):
        y = x.astype(to.numpy)
    if out is None:
        return [y]
    out[0][...] = y
    return [out[0]]
