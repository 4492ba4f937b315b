"""Schemas of the conv family, and the sliding-window geometry pooling shares.

Semantics:

* ``conv`` — ONNX Conv over 1-D, 2-D or 3-D inputs (any rank >= 3 in fact):
  X (N, C, *spatial), W (M, C / group, *kernel), optional B (M,) and a keel
  extension, optional Z (the residual, shaped like Y): ``Y = act(conv(X, W) +
  B + Z)`` with the fused activation of :mod:`keel.ops.epilogue`. ``group``
  splits channels (``group == C`` with ``M == C * k`` is a depthwise conv).
* ``conv2d`` — seed 001: X (N, C, H, W), W (O, C / groups, kH, kW); attributes
  ``stride``, ``padding``, ``dilation`` (an int or one value per spatial dim;
  ``padding`` may also give (top, left, bottom, right)) and ``groups``. No bias:
  a bias is ``conv`` with B, or a following ``add``.
* ``conv_transpose`` — ONNX ConvTranspose: W is (C, M / group, *kernel);
  ``output_padding``, ``output_shape`` (spatial, or the full shape), ``pads``,
  ``strides``, ``dilations``, ``group``, ``auto_pad``; optional bias B (M,).
* ``conv_integer`` — ONNX ConvInteger: ``conv(X - x_zero_point, W -
  w_zero_point)`` exactly, in int32. Padding is applied after the zero point is
  removed (padded positions count as the zero point).

Window geometry (conv and pooling): per spatial dim with input size ``i``,
kernel ``k``, stride ``s``, dilation ``d`` (effective kernel ``e = (k-1)d+1``):

* ``auto_pad="NOTSET"``: explicit ``pads`` (begins then ends);
  ``o = floor((i + pb + pe - e) / s) + 1`` (``ceil`` in pooling's ceil mode,
  where a last window starting past the input and begin padding is dropped).
* ``"SAME_UPPER"`` / ``"SAME_LOWER"``: ``o = ceil(i / s)``, total padding
  ``max(0, (o-1)s + e - i)`` split evenly; the odd one goes at the end
  (UPPER) or the beginning (LOWER).
* ``"VALID"``: no padding, ``o = floor((i - e) / s) + 1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.epilogue import resolve_activation
from keel.ops.registry import Op
from keel.ops.schema import AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, Shape, TensorType

__all__ = [
    "AUTO_PADS",
    "DTYPES",
    "ConvGeometry",
    "TransposeGeometry",
    "Window",
    "conv2d_attrs",
    "conv_geometry",
    "conv_transpose_geometry",
    "window",
    "window_out_dim",
]

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")

FLOATS = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
_BYTES = frozenset({DType.INT8, DType.UINT8})

DTYPES: dict[Op, frozenset[DType]] = {
    Op.CONV: FLOATS,
    Op.CONV2D: FLOATS,
    Op.CONV_TRANSPOSE: FLOATS,
    Op.CONV_INTEGER: _BYTES,
}

WINDOW_ATTRS = (
    AttrSpec("auto_pad", AttrKind.STR, "NOTSET"),
    AttrSpec("dilations", AttrKind.INTS, ()),
    AttrSpec("kernel_shape", AttrKind.INTS, ()),
    AttrSpec("pads", AttrKind.INTS, ()),
    AttrSpec("strides", AttrKind.INTS, ()),
)
_EPILOGUE_ATTRS = (
    AttrSpec("activation", AttrKind.STR, ""),
    AttrSpec("activation_params", AttrKind.FLOATS, ()),
)


# ---- window geometry ------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    """Where a sliding window goes over the spatial dims of one input."""

    in_spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    out_spatial: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.kernel)

    @property
    def effective_kernel(self) -> tuple[int, ...]:
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations, strict=True))

    @property
    def padded(self) -> bool:
        return any(self.pads_begin) or any(self.pads_end)


def _per_dim(op: Op, name: str, given: Sequence[int], rank: int, default: int,
             minimum: int) -> tuple[int, ...]:
    values = tuple(given) if given else (default,) * rank
    if len(values) == 1 and rank > 1:
        values = values * rank
    if len(values) != rank:
        raise InvalidArgumentError(
            f"{op.value}: {name} needs {rank} values (one per spatial dim), got {tuple(given)}"
        )
    if any(v < minimum for v in values):
        raise InvalidArgumentError(f"{op.value}: {name} must be >= {minimum}, got {values}")
    return values


def _pads(op: Op, given: Sequence[int], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    pads = tuple(given) if given else (0,) * (2 * rank)
    if len(pads) != 2 * rank:
        raise InvalidArgumentError(
            f"{op.value}: pads needs {2 * rank} values (begins then ends), got {tuple(given)}"
        )
    if any(p < 0 for p in pads):
        raise InvalidArgumentError(f"{op.value}: pads must be >= 0, got {pads}")
    return pads[:rank], pads[rank:]


def check_auto_pad(op: Op, auto_pad: str) -> None:
    if auto_pad not in AUTO_PADS:
        raise InvalidArgumentError(
            f"{op.value}: auto_pad must be one of {', '.join(AUTO_PADS)}; got {auto_pad!r}"
        )


def window_out_dim(i: Dim, k: int, s: int, d: int, pb: int, pe: int, auto_pad: str,
                   ceil_mode: bool = False) -> Dim:
    """Output size along one spatial dim (None when the input size is not known)."""
    if not isinstance(i, int):
        return None
    e = (k - 1) * d + 1
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return -(-i // s)
    if auto_pad == "VALID":
        pb = pe = 0
    span = i + pb + pe - e
    if span < 0:
        return 0
    o = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (o - 1) * s >= i + pb:   # the last window would start in the end padding
        o -= 1
    return o


def window(op: Op, in_spatial: Sequence[int], kernel: Sequence[int],
           attrs: Mapping[str, Any], ceil_mode: bool = False) -> Window:
    """Resolve strides, dilations, pads (including ``auto_pad``) and the output size."""
    rank = len(kernel)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    check_auto_pad(op, auto_pad)
    strides = _per_dim(op, "strides", attrs.get("strides", ()), rank, 1, 1)
    dilations = _per_dim(op, "dilations", attrs.get("dilations", ()), rank, 1, 1)
    begin, end = _pads(op, attrs.get("pads", ()), rank)
    if auto_pad != "NOTSET":
        begin, end = _auto_pads(in_spatial, kernel, strides, dilations, auto_pad)
    out = tuple(
        window_out_dim(i, k, s, d, pb, pe, "NOTSET", ceil_mode)
        for i, k, s, d, pb, pe in zip(in_spatial, kernel, strides, dilations, begin, end,
                                      strict=True)
    )
    if any(not isinstance(o, int) or o <= 0 for o in out):
        raise InvalidArgumentError(
            f"{op.value}: the window (kernel {tuple(kernel)}, dilations {dilations}) does not "
            f"fit the padded input {tuple(in_spatial)} with pads {begin + end}"
        )
    return Window(tuple(in_spatial), tuple(kernel), strides, dilations, begin, end,
                  tuple(int(o) for o in out if isinstance(o, int)))


def _auto_pads(in_spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
               dilations: Sequence[int], auto_pad: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if auto_pad == "VALID":
        return (0,) * len(kernel), (0,) * len(kernel)
    begin: list[int] = []
    end: list[int] = []
    for i, k, s, d in zip(in_spatial, kernel, strides, dilations, strict=True):
        o = -(-i // s)
        total = max(0, (o - 1) * s + (k - 1) * d + 1 - i)
        small, large = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else large)
        end.append(large if auto_pad == "SAME_UPPER" else small)
    return tuple(begin), tuple(end)


def window_shape(op: Op, in_spatial: Sequence[Dim], kernel: Sequence[int],
                 attrs: Mapping[str, Any], ceil_mode: bool = False) -> tuple[Dim, ...]:
    """Output spatial dims for possibly symbolic input dims (None where unknown)."""
    if all(isinstance(i, int) for i in in_spatial):
        return window(op, [int(i) for i in in_spatial if isinstance(i, int)], kernel, attrs,
                      ceil_mode).out_spatial
    rank = len(kernel)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    check_auto_pad(op, auto_pad)
    strides = _per_dim(op, "strides", attrs.get("strides", ()), rank, 1, 1)
    dilations = _per_dim(op, "dilations", attrs.get("dilations", ()), rank, 1, 1)
    begin, end = _pads(op, attrs.get("pads", ()), rank)
    return tuple(
        window_out_dim(i, k, s, d, pb, pe, auto_pad, ceil_mode)
        for i, k, s, d, pb, pe in zip(in_spatial, kernel, strides, dilations, begin, end,
                                      strict=True)
    )


# ---- conv geometry ----------------------------------------------------------------------
@dataclass(frozen=True)
class ConvGeometry:
    """Everything a conv kernel needs to know about its shapes."""

    batch: int
    in_channels: int
    out_channels: int
    group: int
    window: Window

    @property
    def rank(self) -> int:
        return self.window.rank

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.batch, self.out_channels, *self.window.out_spatial)

    @property
    def is_depthwise(self) -> bool:
        """One input channel per group (each output channel sees one input channel)."""
        return self.group > 1 and self.group == self.in_channels

    @property
    def is_pointwise(self) -> bool:
        """A 1x1 kernel without padding or dilation: a plain matrix product."""
        w = self.window
        return all(k == 1 for k in w.kernel) and not w.padded


def _check_conv_shapes(op: Op, x: Sequence[Dim], w: Sequence[Dim], group: int) -> None:
    if len(x) < 3:
        raise InvalidArgumentError(
            f"{op.value}: X must be (N, C, *spatial) with rank >= 3, got shape {tuple(x)}"
        )
    if len(w) != len(x):
        raise InvalidArgumentError(
            f"{op.value}: W must have X's rank {len(x)}, got shapes X {tuple(x)}, W {tuple(w)}"
        )
    if group < 1:
        raise InvalidArgumentError(f"{op.value}: group must be >= 1, got {group}")


def _kernel_from(op: Op, w: Sequence[Dim], attrs: Mapping[str, Any]) -> tuple[int, ...]:
    given = tuple(attrs.get("kernel_shape", ()))
    spatial = tuple(w[2:])
    if given and (len(given) != len(spatial) or any(
            isinstance(d, int) and d != g for d, g in zip(spatial, given, strict=True))):
        raise InvalidArgumentError(
            f"{op.value}: kernel_shape {given} does not match W's spatial dims {spatial}"
        )
    kernel = given or spatial
    if not all(isinstance(k, int) and k >= 1 for k in kernel):
        raise InvalidArgumentError(f"{op.value}: kernel dims must be known and >= 1, got {kernel}")
    return tuple(int(k) for k in kernel if isinstance(k, int))


def _check_channels(op: Op, c_in: Dim, w_in: Dim, m: Dim, group: int) -> None:
    if isinstance(c_in, int) and isinstance(w_in, int) and c_in != w_in * group:
        raise InvalidArgumentError(
            f"{op.value}: X has {c_in} channels but W expects {w_in} per group x {group} "
            f"groups = {w_in * group}"
        )
    if isinstance(m, int) and m % group:
        raise InvalidArgumentError(
            f"{op.value}: the {m} output channels do not split into {group} groups"
        )


def conv_geometry(op: Op, x: Sequence[int], w: Sequence[int],
                  attrs: Mapping[str, Any]) -> ConvGeometry:
    """Check X and W against the attributes; resolve pads and the output shape."""
    group = int(attrs.get("group", 1))
    _check_conv_shapes(op, x, w, group)
    _check_channels(op, x[1], w[1], w[0], group)
    kernel = _kernel_from(op, w, attrs)
    win = window(op, x[2:], kernel, attrs)
    return ConvGeometry(int(x[0]), int(x[1]), int(w[0]), group, win)


def check_conv_extras(op: Op, out: Sequence[Dim], b: Sequence[Dim] | None,
                      z: Sequence[Dim] | None) -> None:
    """B is (M,); Z has Y's shape."""
    m = out[1]
    if b is not None and (len(b) != 1 or (isinstance(b[0], int) and isinstance(m, int)
                                          and b[0] != m)):
        raise InvalidArgumentError(f"{op.value}: B must have shape ({m},), got {tuple(b)}")
    if z is not None and (len(z) != len(out) or any(
            isinstance(a, int) and isinstance(c, int) and a != c
            for a, c in zip(z, out, strict=True))):
        raise InvalidArgumentError(
            f"{op.value}: Z (residual) must have Y's shape {tuple(out)}, got {tuple(z)}"
        )


def conv2d_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Seed-001 ``conv2d`` attributes in ``conv``'s form."""
    stride = _per_dim(Op.CONV2D, "stride", attrs.get("stride", (1,)), 2, 1, 1)
    dilation = _per_dim(Op.CONV2D, "dilation", attrs.get("dilation", (1,)), 2, 1, 1)
    padding = tuple(attrs.get("padding", (0,)))
    if len(padding) == 1:
        padding = padding * 4
    elif len(padding) == 2:
        padding = padding * 2
    if len(padding) != 4 or any(p < 0 for p in padding):
        raise InvalidArgumentError(
            "conv2d: padding must be one int, (pad_h, pad_w) or (top, left, bottom, right) "
            f"of values >= 0; got {tuple(attrs.get('padding', ()))}"
        )
    return {"strides": stride, "dilations": dilation, "pads": padding,
            "group": int(attrs.get("groups", 1)), "auto_pad": "NOTSET"}


def _same_dtype(op: Op, types: Sequence[TensorType | None]) -> DType | None:
    known = [t.dtype for t in types if t is not None]
    if len(set(known)) > 1:
        raise InvalidArgumentError(
            f"{op.value} needs inputs of one dtype, got {', '.join(d.value for d in known)}"
        )
    return known[0] if known else None


def _check_dtype(op: Op, dtype: DType, what: str = "input") -> None:
    if dtype not in DTYPES[op]:
        names = ", ".join(sorted(d.value for d in DTYPES[op]))
        raise InvalidArgumentError(
            f"{op.value} does not take {dtype.value} {what}s; allowed: {names}"
        )


def _conv_out_shape(op: Op, x: Shape, w: Shape, attrs: Mapping[str, Any]) -> Shape:
    group = int(attrs.get("group", 1))
    _check_conv_shapes(op, x, w, group)
    _check_channels(op, x[1], w[1], w[0], group)
    kernel = _kernel_from(op, w, attrs)
    spatial = window_shape(op, x[2:], kernel, attrs)
    return (x[0], w[0], *spatial)


def _conv_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    dtype = _same_dtype(Op.CONV, types)
    if dtype is None:
        return [None]
    _check_dtype(Op.CONV, dtype)
    resolve_activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    x, w = types[0], types[1]
    if x is None or w is None or x.shape is None or w.shape is None:
        return [TensorType(dtype, None)]
    out = _conv_out_shape(Op.CONV, x.shape, w.shape, attrs)
    b = types[2] if len(types) > 2 else None
    z = types[3] if len(types) > 3 else None
    check_conv_extras(Op.CONV, out, b.shape if b is not None else None,
                      z.shape if z is not None else None)
    return [TensorType(dtype, out)]


def _conv2d_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                  values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    dtype = _same_dtype(Op.CONV2D, types)
    if dtype is None:
        return [None]
    _check_dtype(Op.CONV2D, dtype)
    x, w = types
    if x is None or w is None or x.shape is None or w.shape is None:
        return [TensorType(dtype, None)]
    if len(x.shape) != 4:
        raise InvalidArgumentError(
            f"conv2d: X must be (N, C, H, W), got shape {tuple(x.shape)}"
        )
    return [TensorType(dtype, _conv_out_shape(Op.CONV2D, x.shape, w.shape,
                                              conv2d_attrs(attrs)))]


def _conv_integer_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                        values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    for i, t in enumerate(types):
        if t is not None:
            _check_dtype(Op.CONV_INTEGER, t.dtype, f"input {i}")
    x, w = types[0], types[1]
    if x is None or w is None or x.shape is None or w.shape is None:
        return [TensorType(DType.INT32, None)]
    out = _conv_out_shape(Op.CONV_INTEGER, x.shape, w.shape, attrs)
    for t, name, n in ((types[2] if len(types) > 2 else None, "x_zero_point", 1),
                       (types[3] if len(types) > 3 else None, "w_zero_point", w.shape[0])):
        if t is not None and t.shape is not None:
            check_zero_point(Op.CONV_INTEGER, name, t.shape, n)
    return [TensorType(DType.INT32, out)]


def check_zero_point(op: Op, name: str, shape: Sequence[Dim], n: Dim) -> None:
    """A scalar (or one-element) zero point, or one per output channel (``n``)."""
    if len(shape) == 0 or (len(shape) == 1 and shape[0] in (1, n)) or shape[0] is None:
        return
    raise InvalidArgumentError(
        f"{op.value}: {name} must be a scalar or have {n} values, got shape {tuple(shape)}"
    )


# ---- conv_transpose ---------------------------------------------------------------------
@dataclass(frozen=True)
class TransposeGeometry:
    """Shapes of a transposed conv: the input is the conv's output and vice versa."""

    batch: int
    in_channels: int
    out_channels: int
    group: int
    in_spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    out_spatial: tuple[int, ...]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.batch, self.out_channels, *self.out_spatial)


def _transpose_pads(i: int, k: int, s: int, d: int, op_: int, target: int,
                    upper: bool) -> tuple[int, int]:
    """Pads that trim the full result to ``target``; none when it is shorter (the
    output then extends with zeros past the full result, as onnxruntime does)."""
    total = max(0, s * (i - 1) + op_ + (k - 1) * d + 1 - target)
    small, large = total // 2, total - total // 2
    return (small, large) if upper else (large, small)


def conv_transpose_geometry(x: Sequence[int], w: Sequence[int],
                            attrs: Mapping[str, Any]) -> TransposeGeometry:
    """Resolve pads and the output shape of ONNX ConvTranspose."""
    op = Op.CONV_TRANSPOSE
    group = int(attrs.get("group", 1))
    _check_conv_shapes(op, x, w, group)
    if x[1] != w[0]:
        raise InvalidArgumentError(
            f"conv_transpose: X has {x[1]} channels but W (C, M/group, ...) has {w[0]}"
        )
    if x[1] % group:
        raise InvalidArgumentError(
            f"conv_transpose: the {x[1]} input channels do not split into {group} groups"
        )
    kernel = _kernel_from(op, w, attrs)
    rank = len(kernel)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    check_auto_pad(op, auto_pad)
    strides = _per_dim(op, "strides", attrs.get("strides", ()), rank, 1, 1)
    dilations = _per_dim(op, "dilations", attrs.get("dilations", ()), rank, 1, 1)
    out_pad = _per_dim(op, "output_padding", attrs.get("output_padding", ()), rank, 0, 0)
    if any(p >= max(s, d) for p, s, d in zip(out_pad, strides, dilations, strict=True)):
        raise InvalidArgumentError(
            f"conv_transpose: output_padding {out_pad} must be smaller than the stride "
            f"{strides} or the dilation {dilations}"
        )
    in_sp = tuple(int(v) for v in x[2:])
    target = _output_shape_attr(attrs.get("output_shape", ()), rank)
    if target is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = tuple(i * s for i, s in zip(in_sp, strides, strict=True))
    if target is not None:
        pairs = [_transpose_pads(i, k, s, d, p, t, auto_pad == "SAME_UPPER")
                 for i, k, s, d, p, t in zip(in_sp, kernel, strides, dilations, out_pad,
                                             target, strict=True)]
        begin, end = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
        out = tuple(target)
    else:
        begin, end = _pads(op, attrs.get("pads", ()), rank)
        if auto_pad == "VALID":
            begin, end = (0,) * rank, (0,) * rank
        out = tuple(s * (i - 1) + p + (k - 1) * d + 1 - pb - pe for i, k, s, d, p, pb, pe in
                    zip(in_sp, kernel, strides, dilations, out_pad, begin, end, strict=True))
    if any(o <= 0 for o in out):
        raise InvalidArgumentError(f"conv_transpose: pads {begin + end} leave no output ({out})")
    return TransposeGeometry(int(x[0]), int(x[1]), int(w[1]) * group, group, in_sp, kernel,
                             strides, dilations, begin, end, out)


def _output_shape_attr(given: Sequence[int], rank: int) -> tuple[int, ...] | None:
    if not given:
        return None
    shape = tuple(given)
    if len(shape) == rank + 2:
        shape = shape[2:]
    if len(shape) != rank:
        raise InvalidArgumentError(
            f"conv_transpose: output_shape needs {rank} spatial values, got {tuple(given)}"
        )
    return shape


def _conv_transpose_infer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                          values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    dtype = _same_dtype(Op.CONV_TRANSPOSE, types)
    if dtype is None:
        return [None]
    _check_dtype(Op.CONV_TRANSPOSE, dtype)
    x, w = types[0], types[1]
    if x is None or w is None or x.shape is None or w.shape is None:
        return [TensorType(dtype, None)]
    if all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        geo = conv_transpose_geometry([int(d) for d in x.shape if isinstance(d, int)],
                                      [int(d) for d in w.shape if isinstance(d, int)], attrs)
        return [TensorType(dtype, geo.out_shape)]
    group = int(attrs.get("group", 1))
    m = w.shape[1] * group if isinstance(w.shape[1], int) else None
    return [TensorType(dtype, (x.shape[0], m, *([None] * (len(x.shape) - 2))))]


register_schema(OpSchema(
    Op.CONV, 2, 4,
    (*WINDOW_ATTRS, AttrSpec("group", AttrKind.INT, 1), *_EPILOGUE_ATTRS),
    infer=_conv_infer,
    doc="ONNX Conv (1-D/2-D/3-D) with optional bias B, residual Z and a fused activation.",
))
register_schema(OpSchema(
    Op.CONV2D, 2, 2,
    (AttrSpec("stride", AttrKind.INTS, (1,)), AttrSpec("padding", AttrKind.INTS, (0,)),
     AttrSpec("dilation", AttrKind.INTS, (1,)), AttrSpec("groups", AttrKind.INT, 1)),
    infer=_conv2d_infer,
    doc="Seed-001 conv2d: NCHW input, OIHW weight, no bias.",
))
register_schema(OpSchema(
    Op.CONV_TRANSPOSE, 2, 3,
    (*WINDOW_ATTRS, AttrSpec("group", AttrKind.INT, 1),
     AttrSpec("output_padding", AttrKind.INTS, ()), AttrSpec("output_shape", AttrKind.INTS, ())),
    infer=_conv_transpose_infer,
    doc="ONNX ConvTranspose.",
))
register_schema(OpSchema(
    Op.CONV_INTEGER, 2, 4, (*WINDOW_ATTRS, AttrSpec("group", AttrKind.INT, 1)),
    infer=_conv_integer_infer,
    doc="ONNX ConvInteger: conv(X - x_zero_point, W - w_zero_point) in int32.",
))

