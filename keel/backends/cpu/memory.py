"""cpu kernels of the memory family, written against ``ctx.xp`` with ``out=`` buffers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import KernelContext
from keel.backends.cpu.elementwise import destination
from keel.backends.cpu.kernels import TABLE
from keel.backends.reference.memory import cast_array
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
    x = inputs[0]
    if out is None:
        return [x.copy()]
    dst = out[0]
    if tuple(dst.shape) != tuple(x.shape) or dst.dtype != x.dtype:
        raise InvalidArgumentError(
            f"copy needs an output of exactly the input's shape and dtype "
            f"{x.dtype}{list(x.shape)}, got {dst.dtype}{list(dst.shape)} (use cast to convert)"
        )
    ctx.xp.copyto(dst, x)
    return [dst]


@TABLE.kernel(Op.IDENTITY, supports_out=True)
def identity(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
             out: Sequence[Any] | None) -> list[Any]:
    """The input, as a fresh array (or copied into the output given, unless it is the input);
    a sequence or an optional value as it is."""
    x = inputs[0]
    if x is None or isinstance(x, list):
        return [x if x is None else list(x)]
    if out is None:
        return [x.copy()]
    if out[0] is not x:
        ctx.xp.copyto(out[0], x)
    return [out[0]]


@TABLE.kernel(Op.FILL, supports_out=True)
def fill(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
         out: Sequence[Any] | None) -> list[Any]:
    """Every output element = input 0's first element (seed 001); no host round trip."""
    flat = inputs[0].reshape(-1)
    if flat.shape[0] == 0:
        raise InvalidArgumentError(
            "fill reads its value from element 0 of input 0, which is empty"
        )
    if out is None:
        if attrs.get("shape") is None:
            raise InvalidArgumentError(
                "fill needs its output shape: pass an output tensor or the attribute 'shape'"
            )
        shape = tuple(attrs["shape"])
        checked_numel(shape, what="fill shape")
        dtype = attrs["dtype"].numpy if attrs.get("dtype") is not None else flat.dtype
        out = [ctx.xp.empty(shape, dtype=dtype)]
    with np.errstate(all="ignore"):      # NaN or out-of-range into ints: as cast does
        ctx.xp.copyto(out[0], flat[0:1].reshape(()), casting="unsafe")
    return [out[0]]


def _bind_cast(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any]) -> Callable[[], object] | None:
    """Cast's one copy for one program step (``KernelVariant.bind``); not the narrow
    dtypes, which convert through ml_dtypes."""
    x, to, d = inputs[0], attrs["to"], out[0]
    src = DType.from_numpy(x.dtype)
    check_cast(src, to)
    if ctx.xp is not np or src.is_narrow or to.is_narrow or d.shape != x.shape \
            or d.dtype != to.numpy:
        return None
    return functools.partial(np.copyto, d, x, casting="unsafe")


@TABLE.kernel(Op.CAST, supports_out=True, bind=_bind_cast)
def cast(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
         out: Sequence[Any] | None) -> list[Any]:
    """ONNX Cast: float -> int truncates toward zero; x -> bool is x != 0."""
    x, to = inputs[0], attrs["to"]
    src = DType.from_numpy(x.dtype)
    check_cast(src, to)
    if src.is_narrow or to.is_narrow:       # ml_dtypes' conversions, ONNX's saturation
        y = cast_array(x, to, attrs["saturate"], attrs["round_mode"])
        if out is None:
            return [y]
        out[0][...] = y
        return [out[0]]
    d = destination(ctx.xp, out, x.shape, to.numpy)
    # Out-of-range and NaN float -> int conversions are undefined in ONNX.
    with np.errstate(all="ignore"):
        ctx.xp.copyto(d, x, casting="unsafe")
    return [d]
