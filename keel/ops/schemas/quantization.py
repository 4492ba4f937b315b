"""Schemas of the quantization family (ONNX semantics at the latest opset).

* ``quantize_linear``: ``y = saturate(round_half_even(x / y_scale) + y_zero_point)``,
  per tensor, per axis or blocked (``block_size``); outputs uint8, int8, uint16, int16,
  the packed int4, uint4, int2, uint2, and the float8 and float4 types (rounded to
  nearest even; a float8 output saturates to its finite range when ``saturate``).
* ``dequantize_linear``: ``y = (x - x_zero_point) * x_scale``, same granularities.
* ``dynamic_quantize_linear``: uint8 asymmetric quantization with the scale and
  zero point computed from the data (three outputs).
* ``qlinear_matmul`` and ``qlinear_conv``: integer matmul / convolution of
  zero-point-shifted inputs, requantized with ``a_scale * b_scale / y_scale``.

``matmul_integer`` and ``conv_integer`` belong to the matmul and conv families.
The helpers here (parameter layout, conv geometry, matmul shape) are shared by
``infer`` and the kernels, so both raise the same typed errors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, Shape, TensorType, broadcast_shapes, normalize_axis

__all__ = [
    "FLOAT_QUANT_DTYPES",
    "QUANT_DTYPES",
    "QUANT_RANGES",
    "QUANTIZE_INPUTS",
    "ConvGeometry",
    "ParamLayout",
    "conv_geometry",
    "dequantize_output_dtype",
    "matmul_param_shape",
    "matmul_shape",
    "param_layout",
    "qlinear_global_scale",
    "quantize_output_dtype",
]

QUANT_RANGES: dict[DType, tuple[int, int]] = {
    DType.UINT8: (0, 255),
    DType.INT8: (-128, 127),
    DType.UINT16: (0, 65535),
    DType.INT16: (-32768, 32767),
    DType.UINT4: (0, 15),
    DType.INT4: (-8, 7),
    DType.UINT2: (0, 3),
    DType.INT2: (-2, 1),
}
# Float quantized types: x / y_scale (+ y_zero_point) rounded into the format itself.
FLOAT_QUANT_DTYPES = frozenset({DType.FLOAT8E4M3FN, DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2,
                                DType.FLOAT8E5M2FNUZ, DType.FLOAT4E2M1})
QUANT_DTYPES = frozenset(QUANT_RANGES) | FLOAT_QUANT_DTYPES
_DEQUANT_INPUTS = QUANT_DTYPES | {DType.INT32}
_FLOATS = frozenset({DType.FLOAT16, DType.FLOAT32, DType.FLOAT64})
_QLINEAR_DTYPES = frozenset({DType.UINT8, DType.INT8})
QUANTIZE_INPUTS = _FLOATS | {DType.INT32}


def _names(dtypes: frozenset[DType]) -> str:
    return ", ".join(sorted(d.value for d in dtypes))


class ParamLayout(str, enum.Enum):
    """How a scale or zero point maps onto the quantized tensor."""

    TENSOR = "tensor"      # one value (a scalar or a 1-element vector)
    AXIS = "axis"          # one value per index of ``axis``
    BLOCK = "block"        # one value per ``block_size`` run along ``axis``


def param_layout(op: Op, x_shape: Sequence[Dim], p_shape: Sequence[Dim], axis: int,
                 block_size: int, what: str) -> tuple[ParamLayout, int]:
    """The layout of a scale/zero-point of shape ``p_shape``; returns it and the axis."""
    if block_size < 0:
        raise InvalidArgumentError(f"{op.value}: block_size must be >= 0, got {block_size}")
    rank = len(x_shape)
    if block_size == 0:
        if len(p_shape) == 0 or (len(p_shape) == 1 and p_shape[0] == 1):
            return ParamLayout.TENSOR, 0
        ax = normalize_axis(axis, rank, what=f"{op.value}: axis")
        if len(p_shape) == 1 and not _conflict(p_shape[0], x_shape[ax]):
            return ParamLayout.AXIS, ax
        raise InvalidArgumentError(
            f"{op.value}: {what} of shape {tuple(p_shape)} must be a scalar or 1-D with "
            f"x.shape[{ax}] = {x_shape[ax]} entries"
        )
    ax = normalize_axis(axis, rank, what=f"{op.value}: axis")
    want = [(-(-d // block_size) if i == ax and isinstance(d, int) else d)
            for i, d in enumerate(x_shape)]
    if len(p_shape) != rank or any(_conflict(p, w) for p, w in zip(p_shape, want, strict=True)):
        raise InvalidArgumentError(
            f"{op.value}: blocked {what} must have shape {tuple(want)} (x.shape with "
            f"ceil(x.shape[{ax}] / {block_size}) on axis {ax}), got {tuple(p_shape)}"
        )
    return ParamLayout.BLOCK, ax


def _conflict(a: Dim, b: Dim) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a != b


def quantize_output_dtype(zero_point: DType | None, output_dtype: DType | None) -> DType:
    """The output type: the zero point's, else ``output_dtype``, else uint8."""
    if zero_point is not None and output_dtype is not None and zero_point is not output_dtype:
        raise InvalidArgumentError(
            f"quantize_linear: output_dtype {output_dtype.value} differs from the zero "
            f"point's type {zero_point.value}"
        )
    dt = zero_point or output_dtype or DType.UINT8
    if dt not in QUANT_DTYPES:
        raise InvalidArgumentError(
            f"quantize_linear: output type must be one of {_names(QUANT_DTYPES)}, got {dt.value}"
        )
    return dt


def dequantize_output_dtype(x: DType, scale: DType, zero_point: DType | None,
                            output_dtype: DType | None) -> DType:
    """Checks the input types; the output is ``output_dtype`` or the scale's type."""
    if x not in _DEQUANT_INPUTS:
        raise InvalidArgumentError(
            f"dequantize_linear: x must be one of {_names(_DEQUANT_INPUTS)}, got {x.value}"
        )
    if zero_point is not None and zero_point is not x:
        raise InvalidArgumentError(
            f"dequantize_linear: x_zero_point must have x's type {x.value}, "
            f"got {zero_point.value}"
        )
    _require(Op.DEQUANTIZE_LINEAR, "x_scale", scale, _FLOATS)
    out = output_dtype or scale
    _require(Op.DEQUANTIZE_LINEAR, "output_dtype", out, _FLOATS)
    return out


def _require(op: Op, what: str, dtype: DType, allowed: frozenset[DType]) -> None:
    if dtype not in allowed:
        raise InvalidArgumentError(
            f"{op.value}: {what} must be one of {_names(allowed)}, got {dtype.value}"
        )


def matmul_shape(op: Op, a: Sequence[Dim], b: Sequence[Dim]) -> Shape:
    """NumPy matmul's output shape (1-D operands promoted and dropped again)."""
    if len(a) == 0 or len(b) == 0:
        raise InvalidArgumentError(f"{op.value}: operands must have rank >= 1, got "
                                   f"{tuple(a)} and {tuple(b)}")
    a2 = (1, *a) if len(a) == 1 else tuple(a)
    b2 = (*b, 1) if len(b) == 1 else tuple(b)
    if _conflict(a2[-1], b2[-2]):
        raise InvalidArgumentError(
            f"{op.value}: inner dimensions differ: a {tuple(a)} and b {tuple(b)}"
        )
    batch = broadcast_shapes(a2[:-2], b2[:-2])
    out: list[Dim] = [*batch, a2[-2], b2[-1]]
    if len(b) == 1:
        out.pop(-1)
    if len(a) == 1:
        out.pop(-2 if len(b) != 1 else -1)
    return tuple(out)


def matmul_param_shape(what: str, operand: Sequence[Any], p_shape: Sequence[int],
                       per: str) -> tuple[int, ...]:
    """The shape a QLinearMatMul scale/zero point takes to broadcast against ``operand``.

    A scalar (or one element) is per tensor; a vector is per row (``per="row"``: one
    entry per ``operand[-2]``) or per column (``per="col"``: per ``operand[-1]``); a
    tensor of the operand's rank must broadcast to it ([..., M, 1] or [..., 1, N]).
    """
    if math.prod(p_shape) == 1:
        return ()
    rows, cols = (operand[-2] if len(operand) > 1 else 1), operand[-1]
    if len(p_shape) == 1 and len(operand) >= 2:
        if per == "row" and p_shape[0] == rows:
            return (rows, 1)
        if per == "col" and p_shape[0] == cols:
            return (cols,)
    elif len(p_shape) == len(operand) and all(p in (1, o) for p, o in zip(p_shape, operand,
                                                                           strict=True)):
        return tuple(p_shape)
    raise InvalidArgumentError(
        f"qlinear_matmul: {what} of shape {tuple(p_shape)} must be a scalar, a per-{per} "
        f"vector of {rows if per == 'row' else cols} entries, or broadcast to "
        f"{tuple(operand)}"
    )


@dataclass(frozen=True)
class ConvGeometry:
    """Spatial geometry of an N-D convolution (ONNX Conv attributes resolved)."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    out_spatial: tuple[int, ...]
    group: int


def _ints(attrs: Mapping[str, Any], name: str, n: int, default: int) -> tuple[int, ...]:
    value = attrs.get(name)
    if value is None:
        return (default,) * n
    if len(value) != n:
        raise InvalidArgumentError(
            f"qlinear_conv: {name} must have {n} entries, got {tuple(value)}"
        )
    return tuple(int(v) for v in value)


def _check_channels(x: Sequence[int], w: Sequence[int], group: int) -> None:
    if len(x) < 3 or len(w) != len(x):
        raise InvalidArgumentError(
            f"qlinear_conv: x must be (N, C, D1, ...) and w (M, C/group, k1, ...) of the same "
            f"rank >= 3, got {tuple(x)} and {tuple(w)}"
        )
    if group <= 0 or x[1] != w[1] * group or w[0] % group:
        raise InvalidArgumentError(
            f"qlinear_conv: with group={group}, x channels {x[1]} must equal "
            f"w.shape[1] * group = {w[1] * group} and w.shape[0] = {w[0]} must be divisible "
            "by group"
        )


def conv_geometry(x: Sequence[int], w: Sequence[int], attrs: Mapping[str, Any]) -> ConvGeometry:
    """Resolve kernel, strides, dilations and (auto) pads; check the output is non-empty."""
    group = int(attrs.get("group", 1))
    _check_channels(x, w, group)
    n = len(x) - 2
    kernel = tuple(int(k) for k in w[2:])
    if attrs.get("kernel_shape") is not None and tuple(attrs["kernel_shape"]) != kernel:
        raise InvalidArgumentError(
            f"qlinear_conv: kernel_shape {tuple(attrs['kernel_shape'])} differs from "
            f"w.shape[2:] = {kernel}"
        )
    strides = _ints(attrs, "strides", n, 1)
    dil = _ints(attrs, "dilations", n, 1)
    if min(strides + dil, default=1) <= 0:
        raise InvalidArgumentError(
            f"qlinear_conv: strides {strides} and dilations {dil} must be > 0"
        )
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dil, strict=True)]
    begin, end = _pads(attrs, x[2:], span, strides)
    out = tuple((i + b + e - s) // st + 1 for i, b, e, s, st
                in zip(x[2:], begin, end, span, strides, strict=True))
    if any(i + b + e < s for i, b, e, s in zip(x[2:], begin, end, span, strict=True)):
        raise InvalidArgumentError(
            f"qlinear_conv: the dilated kernel {tuple(span)} is larger than the padded input "
            f"{tuple(i + b + e for i, b, e in zip(x[2:], begin, end, strict=True))}"
        )
    return ConvGeometry(kernel, strides, dil, begin, end, out, group)


def _pads(attrs: Mapping[str, Any], spatial: Sequence[int], span: Sequence[int],
          strides: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = len(spatial)
    auto = attrs.get("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        pads = _ints(attrs, "pads", 2 * n, 0) if attrs.get("pads") is not None else (0,) * 2 * n
        if min(pads, default=0) < 0:
            raise InvalidArgumentError(f"qlinear_conv: pads must be >= 0, got {pads}")
        return pads[:n], pads[n:]
    if auto == "VALID":
        return (0,) * n, (0,) * n
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        raise InvalidArgumentError(
            f"qlinear_conv: auto_pad {auto!r} is not supported; allowed: NOTSET, VALID, "
            "SAME_UPPER, SAME_LOWER"
        )
    begin, end = [], []
    for i, s, st in zip(spatial, span, strides, strict=True):
        total = max(0, (math.ceil(i / st) - 1) * st + s - i)
        small, big = total // 2, total - total // 2
        begin.append(small if auto == "SAME_UPPER" else big)
        end.append(big if auto == "SAME_UPPER" else small)
    return tuple(begin), tuple(end)


# ---- inference -----------------------------------------------------------------


def _t(types: Sequence[TensorType | None], i: int) -> TensorType | None:
    return types[i] if i < len(types) else None


def _infer_quantize(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                    values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x, scale, zp = types[0], _t(types, 1), _t(types, 2)
    out = quantize_output_dtype(None if zp is None else zp.dtype, attrs["output_dtype"])
    if x is None:
        return [None]
    _require(Op.QUANTIZE_LINEAR, "x", x.dtype, QUANTIZE_INPUTS)
    _check_params(Op.QUANTIZE_LINEAR, x, (("y_scale", scale), ("y_zero_point", zp)), attrs)
    return [TensorType(out, x.shape)]


def _infer_dequantize(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                      values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x, scale, zp = types[0], _t(types, 1), _t(types, 2)
    if x is None or scale is None:
        return [None]
    out = dequantize_output_dtype(x.dtype, scale.dtype, None if zp is None else zp.dtype,
                                  attrs["output_dtype"])
    _check_params(Op.DEQUANTIZE_LINEAR, x, (("x_scale", scale), ("x_zero_point", zp)), attrs)
    return [TensorType(out, x.shape)]


def _check_params(op: Op, x: TensorType, params: Sequence[tuple[str, TensorType | None]],
                  attrs: Mapping[str, Any]) -> None:
    if x.shape is None:
        return
    for name, p in params:
        if p is not None and p.shape is not None:
            param_layout(op, x.shape, p.shape, attrs["axis"], attrs["block_size"], name)


def _infer_dynamic(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                   values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    if x is None:
        return [None, TensorType(DType.FLOAT32, ()), TensorType(DType.UINT8, ())]
    _require(Op.DYNAMIC_QUANTIZE_LINEAR, "x", x.dtype, frozenset({DType.FLOAT32}))
    return [TensorType(DType.UINT8, x.shape), TensorType(DType.FLOAT32, ()),
            TensorType(DType.UINT8, ())]


def _eight_bit_operands(op: Op, types: Sequence[TensorType | None]
                        ) -> tuple[TensorType | None, TensorType | None, TensorType | None]:
    """Inputs 0, 3 and 7 (a, b, y_zero_point), each 8-bit where known."""
    a, b, yzp = types[0], types[3], types[7]
    for name, t in (("a", a), ("b", b), ("y_zero_point", yzp)):
        if t is not None:
            _require(op, name, t.dtype, _QLINEAR_DTYPES)
    return a, b, yzp


def _infer_qlinear_matmul(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                          values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    a, b, yzp = _eight_bit_operands(Op.QLINEAR_MATMUL, types)
    if yzp is None:
        return [None]
    if a is None or b is None or a.shape is None or b.shape is None:
        return [TensorType(yzp.dtype, None)]
    return [TensorType(yzp.dtype, matmul_shape(Op.QLINEAR_MATMUL, a.shape, b.shape))]


def _infer_qlinear_conv(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                        values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x, w, yzp = types[0], types[3], types[7]
    for name, t in (("x", x), ("w", w), ("y_zero_point", yzp)):
        if t is not None:
            _require(Op.QLINEAR_CONV, name, t.dtype, _QLINEAR_DTYPES)
    if yzp is None:
        return [None]
    if x is None or w is None or not x.is_static or not w.is_static:
        rank = None if x is None or x.shape is None else len(x.shape)
        return [TensorType(yzp.dtype, None if rank is None else (None,) * rank)]
    xs, ws = _static(x), _static(w)
    geo = conv_geometry(xs, ws, attrs)
    return [TensorType(yzp.dtype, (xs[0], ws[0], *geo.out_spatial))]


def _infer_qlinear_add(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                       values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    a, b, yzp = _eight_bit_operands(Op.QLINEAR_ADD, types)
    if attrs.get("activation", "") not in ("", "relu"):
        raise InvalidArgumentError(
            f"qlinear_add: activation must be '' or 'relu', got {attrs['activation']!r}")
    if yzp is None:
        return [None]
    if a is None or b is None or a.shape is None or b.shape is None:
        return [TensorType(yzp.dtype, None)]
    return [TensorType(yzp.dtype, broadcast_shapes(a.shape, b.shape))]


def qlinear_global_scale(x_scale: Any, y_scale: Any, size: int) -> np.float32:
    """onnxruntime's QLinearGlobalAveragePool multiplier, float32 throughout:
    x_scale / (y_scale * size)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.float32(np.float32(np.asarray(x_scale).reshape(())) / (
            np.float32(np.asarray(y_scale).reshape(())) * np.float32(size)))


def _infer_qlinear_global_avg_pool(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                                   values: Sequence[np.ndarray | None]
                                   ) -> list[TensorType | None]:
    x, yzp = types[0], types[4]
    for name, t in (("x", x), ("y_zero_point", yzp)):
        if t is not None:
            _require(Op.QLINEAR_GLOBAL_AVG_POOL, name, t.dtype, _QLINEAR_DTYPES)
    if yzp is None:
        return [None]
    if x is None or x.shape is None:
        return [TensorType(yzp.dtype, None)]
    if len(x.shape) < 3:
        raise InvalidArgumentError(f"qlinear_global_avg_pool: x must be (N, C, spatial...), "
                                   f"got shape {tuple(x.shape)}")
    return [TensorType(yzp.dtype, (*x.shape[:2], *(1,) * (len(x.shape) - 2)))]


def qgemm_output_dtype(y_scale: TensorType | None, y_zero_point: TensorType | None) -> DType:
    """QGemm's output type: y_zero_point's (uint8 without one) when y_scale is given,
    else float32."""
    if y_scale is None:
        return DType.FLOAT32
    return DType.UINT8 if y_zero_point is None else y_zero_point.dtype


def _infer_qgemm(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                 values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    a, b, c = types[0], types[3], _t(types, 6)
    for name, t in (("a", a), ("b", b)):
        if t is not None:
            _require(Op.QGEMM, name, t.dtype, _QLINEAR_DTYPES)
    if c is not None and c.dtype is not DType.INT32:
        raise InvalidArgumentError(f"qgemm: C must be int32, got {c.dtype.value}")
    out = qgemm_output_dtype(_t(types, 7), _t(types, 8))
    if out is not DType.FLOAT32:
        _require(Op.QGEMM, "y_zero_point", out, _QLINEAR_DTYPES)
    if a is None or b is None or a.shape is None or b.shape is None:
        return [TensorType(out, None)]
    return [TensorType(out, qgemm_shape(a.shape, b.shape, attrs["trans_a"], attrs["trans_b"]))]


def qgemm_scales(alpha: float, a_scale: np.ndarray, b_scale: np.ndarray,
                 y_scale: np.ndarray | None) -> np.ndarray:
    """QGemm's multiplier of the int32 accumulators (float32 values held as float64),
    one per column (or one):
    ``alpha * a_scale * b_scale [/ y_scale]`` formed in float32, as onnxruntime forms it."""
    f32 = np.float32
    scale = f32(alpha) * np.asarray(a_scale, f32).reshape(()) * np.asarray(b_scale, f32).reshape(-1)
    if y_scale is not None:
        scale = scale / np.asarray(y_scale, f32).reshape(())
    return np.asarray(scale, f32).astype(np.float64)


def qgemm_shape(a: Sequence[Dim], b: Sequence[Dim], trans_a: bool, trans_b: bool) -> Shape:
    """(M, N) of ``A' @ B'``: both 2-D, K matching."""
    if len(a) != 2 or len(b) != 2:
        raise InvalidArgumentError(f"qgemm needs 2-D A and B, got {tuple(a)} and {tuple(b)}")
    m, ka = (a[1], a[0]) if trans_a else (a[0], a[1])
    kb, n = (b[1], b[0]) if trans_b else (b[0], b[1])
    if _conflict(ka, kb):
        raise InvalidArgumentError(f"qgemm: K differs between A' ({ka}) and B' ({kb})")
    return (m, n)


def _static(t: TensorType) -> tuple[int, ...]:
    return tuple(d for d in t.shape or () if isinstance(d, int))


_AXIS = AttrSpec("axis", AttrKind.INT, 1)
_BLOCK = AttrSpec("block_size", AttrKind.INT, 0)
_OUT_DTYPE = AttrSpec("output_dtype", AttrKind.DTYPE, None)

register_schema(OpSchema(
    Op.QUANTIZE_LINEAR, 2, 3,
    attrs=(_AXIS, AttrSpec("saturate", AttrKind.BOOL, True), _BLOCK, _OUT_DTYPE,
           AttrSpec("precision", AttrKind.DTYPE, None)),
    infer=_infer_quantize,
    doc="ONNX QuantizeLinear: saturate(round_half_even(x / y_scale) + y_zero_point). "
        "output_dtype (an 8-, 16-, 4- or 2-bit integer, float8 or float4e2m1) applies "
        "when y_zero_point is absent; precision is the dtype of the division (default: "
        "that of x / y_scale). saturate=0 lets a float8 output overflow to inf or NaN.",
))
register_schema(OpSchema(
    Op.DEQUANTIZE_LINEAR, 2, 3, attrs=(_AXIS, _BLOCK, _OUT_DTYPE),
    infer=_infer_dequantize,
    doc="ONNX DequantizeLinear: (x - x_zero_point) * x_scale, in the scale's type "
        "(or output_dtype).",
))
register_schema(OpSchema(
    Op.DYNAMIC_QUANTIZE_LINEAR, 1, 1, infer=_infer_dynamic, min_outputs=3, max_outputs=3,
    doc="ONNX DynamicQuantizeLinear: uint8 y, float32 y_scale and uint8 y_zero_point "
        "from the range [min(0, min(x)), max(0, max(x))].",
))
register_schema(OpSchema(
    Op.QLINEAR_MATMUL, 8, 8, infer=_infer_qlinear_matmul,
    doc="ONNX QLinearMatMul: inputs a, a_scale, a_zero_point, b, b_scale, b_zero_point, "
        "y_scale, y_zero_point; a's parameters may be per row, b's per column.",
))
register_schema(OpSchema(
    Op.QLINEAR_CONV, 8, 9,
    attrs=(AttrSpec("auto_pad", AttrKind.STR, "NOTSET"), AttrSpec("dilations", AttrKind.INTS),
           AttrSpec("group", AttrKind.INT, 1), AttrSpec("kernel_shape", AttrKind.INTS),
           AttrSpec("pads", AttrKind.INTS), AttrSpec("strides", AttrKind.INTS)),
    infer=_infer_qlinear_conv,
    doc="ONNX QLinearConv: inputs x, x_scale, x_zero_point, w, w_scale, w_zero_point, "
        "y_scale, y_zero_point, [B int32]; w's parameters may be per output channel.",
))
register_schema(OpSchema(
    Op.QGEMM, 6, 9,
    attrs=(AttrSpec("alpha", AttrKind.FLOAT, 1.0), AttrSpec("trans_a", AttrKind.BOOL, False),
           AttrSpec("trans_b", AttrKind.BOOL, False)),
    infer=_infer_qgemm,
    doc="onnxruntime's com.microsoft QGemm: inputs A, a_scale, a_zero_point, B, b_scale, "
        "b_zero_point, [C int32], [y_scale], [y_zero_point]. The int32 product of the "
        "zero-point-shifted A' and B' plus C (whose scale is alpha * a_scale * b_scale), "
        "requantized with y_scale and y_zero_point, or float32 without y_scale; b's "
        "parameters may be per column of B'.",
))
register_schema(OpSchema(
    Op.QLINEAR_ADD, 8, 8, attrs=(AttrSpec("activation", AttrKind.STR, ""),),
    infer=_infer_qlinear_add,
    doc="onnxruntime's com.microsoft QLinearAdd, with an optional ReLU (activation "
        "'relu': clamped at y_zero_point): inputs a, a_scale, a_zero_point, b, b_scale, "
        "b_zero_point, y_scale, y_zero_point, all parameters per tensor. Computed as "
        "onnxruntime computes it on x86-64 (float32 scale ratios and fused multiply-adds), "
        "which can differ from DequantizeLinear, Add and QuantizeLinear by one step on a "
        "rounding boundary.",
))
register_schema(OpSchema(
    Op.QLINEAR_GLOBAL_AVG_POOL, 5, 5,
    infer=_infer_qlinear_global_avg_pool,
    doc="onnxruntime's com.microsoft QLinearGlobalAveragePool (NCHW): inputs x, x_scale, "
        "x_zero_point, y_scale, y_zero_point, all per tensor. Computed as onnxruntime "
        "computes it: each plane's integer sum less its size times x's zero point, times the "
        "float32 x_scale / (y_scale * size), clamped, rounded half to even, plus y's zero "
        "point; which can differ from DequantizeLinear, GlobalAveragePool and QuantizeLinear "
        "by one step on a rounding boundary.",
))
