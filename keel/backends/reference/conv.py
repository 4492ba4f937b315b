"""Reference kernels of the conv family: direct convolution by definition.

``y[n, m, o] = sum over c, k of w[m, c, k] * x_padded[n, g*C/G + c, o*s + k*d]``,
one kernel offset at a time, in float64 (int64 for conv_integer), cast to the
output dtype. Shape rules come from :mod:`keel.ops.schemas.conv`.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.epilogue import reference_activation
from keel.ops.registry import Op
from keel.ops.schemas.conv import (
    DTYPES,
    ConvGeometry,
    check_conv_extras,
    check_zero_point,
    conv2d_attrs,
    conv_geometry,
    conv_transpose_geometry,
)

__all__: list[str] = []




def _check(op: Op, *arrays: np.ndarray) -> np.dtype[Any]:
    dtypes = {DType.from_numpy(a.dtype) for a in arrays if a is not None}
    if len(dtypes) > 1:
        raise InvalidArgumentError(
            f"{op.value} needs inputs of one dtype, got "
            f"{', '.join(sorted(d.value for d in dtypes))}"
        )
    dtype = dtypes.pop()
    if dtype not in DTYPES[op]:
        allowed = ", ".join(sorted(d.value for d in DTYPES[op]))
        raise InvalidArgumentError(f"{op.value} does not take {dtype.value}; allowed: {allowed}")
    return dtype.numpy


def direct_conv(x: np.ndarray, w: np.ndarray, geo: ConvGeometry) -> np.ndarray:
    """The convolution by definition (x, w already widened), no bias."""
    win, g = geo.window, geo.group
    n, c = x.shape[:2]
    m = w.shape[0]
    xp = np.pad(x, [(0, 0), (0, 0), *zip(win.pads_begin, win.pads_end, strict=True)])
    xg = xp.reshape(n, g, c // g, *xp.shape[2:])
    wg = w.reshape(g, m // g, c // g, *win.kernel)
    y = np.zeros((n, g, m // g, *win.out_spatial), dtype=x.dtype)
    for offs in itertools.product(*(range(k) for k in win.kernel)):
        taps = tuple(slice(o * d, o * d + (size - 1) * s + 1, s) for o, d, s, size in
                     zip(offs, win.dilations, win.strides, win.out_spatial, strict=True))
        patch = xg[(slice(None),) * 3 + taps]                 # (n, g, c/g, *out)
        tap: tuple[Any, ...] = (Ellipsis, *offs)
        y += np.einsum("ngc...,gmc->ngm...", patch, wg[tap])
    return y.reshape(n, m, *win.out_spatial)


@TABLE.kernel(Op.CONV, dtypes=DTYPES[Op.CONV])
def conv(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """act(conv(X, W) + B + Z) (ONNX Conv with keel's residual and activation)."""
    x, w, b, z = inputs[0], inputs[1], optional_input(inputs, 2), optional_input(inputs, 3)
    dtype = _check(Op.CONV, x, w, b, z)
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    check_conv_extras(Op.CONV, geo.out_shape, None if b is None else b.shape,
                      None if z is None else z.shape)
    y = direct_conv(x.astype(np.float64), w.astype(np.float64), geo)
    if b is not None:
        y += b.astype(np.float64).reshape(1, -1, *([1] * geo.rank))
    if z is not None:
        y += z.astype(np.float64)
    if attrs["activation"]:
        y = reference_activation(y, attrs["activation"], attrs["activation_params"])
    return [y.astype(dtype)]


@TABLE.kernel(Op.CONV2D, dtypes=DTYPES[Op.CONV2D])
def conv2d(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Seed-001 conv2d: NCHW input, OIHW weight, no bias."""
    x, w = inputs
    dtype = _check(Op.CONV2D, x, w)
    if x.ndim != 4:
        raise InvalidArgumentError(f"conv2d: X must be (N, C, H, W), got shape {x.shape}")
    geo = conv_geometry(Op.CONV2D, x.shape, w.shape, conv2d_attrs(attrs))
    return [direct_conv(x.astype(np.float64), w.astype(np.float64), geo).astype(dtype)]


@TABLE.kernel(Op.CONV_TRANSPOSE, dtypes=DTYPES[Op.CONV_TRANSPOSE])
def conv_transpose(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Scatter each input pixel times the kernel into the output (the adjoint of conv)."""
    x, w, b = inputs[0], inputs[1], optional_input(inputs, 2)
    dtype = _check(Op.CONV_TRANSPOSE, x, w, b)
    geo = conv_transpose_geometry(x.shape, w.shape, attrs)
    n, c, g = geo.batch, geo.in_channels, geo.group
    mg = geo.out_channels // g
    full = tuple(ob + o + oe for ob, o, oe in
                 zip(geo.pads_begin, geo.out_spatial, geo.pads_end, strict=True))
    y = np.zeros((n, g, mg, *full))
    xg = x.astype(np.float64).reshape(n, g, c // g, *geo.in_spatial)
    wg = w.astype(np.float64).reshape(g, c // g, mg, *geo.kernel)
    for offs in itertools.product(*(range(k) for k in geo.kernel)):
        taps = tuple(slice(o * d, o * d + (i - 1) * s + 1, s) for o, d, s, i in
                     zip(offs, geo.dilations, geo.strides, geo.in_spatial, strict=True))
        tap: tuple[Any, ...] = (Ellipsis, *offs)
        y[(slice(None),) * 3 + taps] += np.einsum("ngc...,gcm->ngm...", xg, wg[tap])
    crop = tuple(slice(pb, pb + o) for pb, o in zip(geo.pads_begin, geo.out_spatial,
                                                     strict=True))
    y = y.reshape(n, g * mg, *full)[(slice(None),) * 2 + crop]
    if b is not None:
        if b.shape != (geo.out_channels,):
            raise InvalidArgumentError(
                f"conv_transpose: B must have shape ({geo.out_channels},), got {b.shape}"
            )
        y = y + b.astype(np.float64).reshape(1, -1, *([1] * len(full)))
    return [y.astype(dtype)]


@TABLE.kernel(Op.CONV_INTEGER, dtypes=DTYPES[Op.CONV_INTEGER])
def conv_integer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """conv(X - x_zero_point, W - w_zero_point) in int64, returned as int32."""
    x, w, xzp, wzp = inputs[0], inputs[1], optional_input(inputs, 2), optional_input(inputs, 3)
    for a in inputs:
        if a is not None:
            _check(Op.CONV_INTEGER, a)      # X and W may differ (uint8 and int8)
    geo = conv_geometry(Op.CONV_INTEGER, x.shape, w.shape, attrs)
    x64 = x.astype(np.int64)
    w64 = w.astype(np.int64)
    if xzp is not None:
        check_zero_point(Op.CONV_INTEGER, "x_zero_point", xzp.shape, 1)
        x64 = x64 - int(xzp.reshape(-1)[0])
    if wzp is not None:
        check_zero_point(Op.CONV_INTEGER, "w_zero_point", wzp.shape, w.shape[0])
        w64 = w64 - wzp.astype(np.int64).reshape(-1, *([1] * (w.ndim - 1)))
    return [direct_conv(x64, w64, geo).astype(np.int32)]
