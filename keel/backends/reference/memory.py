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

__all__ = ["cast_array"]

# The float8 types whose Cast saturates by default (saturate=1): out-of-range values
# and infinities become the largest finite value of the sign instead of inf or NaN.
SATURATING = frozenset({DType.FLOAT8E4M3FN, DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2,
                        DType.FLOAT8E5M2FNUZ})
_ROUND_MODES = ("up", "down", "nearest")


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
    y = cast_array(x, to, attrs.get("saturate", True), attrs.get("round_mode", "up"))
    if out is None:
        return [y]
    out[0][...] = y
    return [out[0]]


def cast_array(x: np.ndarray, to: DType, saturate: bool = True,
               round_mode: str = "up") -> np.ndarray:
    """``x`` as ``to`` with ONNX Cast's rules (shared by every NumPy backend).

    Rounding is to nearest even (ml_dtypes' conversions). With ``saturate`` a float8
    target clips to its finite range first; float8e8m0 (a power of two) rounds as
    ``round_mode`` says; anything else converts as NumPy / ml_dtypes do (floats into
    4- and 2-bit integers truncate toward zero and wrap, like onnx's reference).
    """
    if x.dtype.kind not in "OUS" and DType.from_numpy(x.dtype).is_narrow and to.is_narrow:
        x = x.astype(np.float32)        # exact; ml_dtypes lacks some direct pairs
    # Out-of-range and NaN float -> int conversions are undefined in ONNX.
    with np.errstate(all="ignore"):
        if to is DType.FLOAT8E8M0:
            return to_e8m0(x, saturate, round_mode)
        if to in SATURATING and saturate:
            import ml_dtypes

            limit = float(ml_dtypes.finfo(to.numpy).max)
            wide = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
            return np.clip(wide, -limit, limit).astype(to.numpy)
        return x.astype(to.numpy)


def to_e8m0(x: np.ndarray, saturate: bool, round_mode: str) -> np.ndarray:
    """float8e8m0 (2 ** (e - 127), e = 255 for NaN): float32's exponent field, rounded
    up, down or to nearest by its mantissa; ``saturate`` stops at 2 ** 127."""
    if round_mode not in _ROUND_MODES:
        raise InvalidArgumentError(
            f"cast: round_mode must be one of {', '.join(_ROUND_MODES)}, got {round_mode!r}")
    import ml_dtypes

    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.uint16)
    special = exponent == 0xFF
    if round_mode == "up":
        bump = (bits & 0x7FFFFF) > 0
    elif round_mode == "nearest":
        guard = (bits & 0x400000) > 0
        rest = (bits & 0x3FFFFF) > 0
        bump = guard & (rest | (exponent > 0))
    else:
        bump = np.zeros(bits.shape, dtype=bool)
    bump &= ~special
    if saturate:
        bump &= exponent != 0xFE
    code = np.where(special, 0xFF, exponent + bump).astype(np.uint8)
    return code.view(ml_dtypes.float8_e8m0fnu)
