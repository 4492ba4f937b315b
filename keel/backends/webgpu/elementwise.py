"""Elementwise WGSL kernels: unary and binary ops with NumPy broadcasting, and Clip.

One shader per (expression, arity, dtype, layout): inputs that are contiguous
and shaped like the output are read flat; any other input (broadcast,
transposed, sliced) is read through its strides, in place. Float32 computes in
f32; float16 (adapters with ``shader-f16``) loads and stores f16 and computes
in f32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, KernelTable, Out
from keel.backends.webgpu import logic, wgsl
from keel.backends.webgpu.array import WgpuArray
from keel.backends.webgpu.ops import (
    Params,
    broadcast_strides,
    device_of,
    groups_for,
    launch,
    out_array,
    scalar_type,
)
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.elementwise import DTYPES

__all__ = ["BINARY", "UNARY", "binary", "elementwise", "register"]

# WGSL expressions in a (and b), with the scalars s0..s3 an op's attributes give.
UNARY: dict[Op, str] = {
    Op.RELU: "select(a, 0.0, a < 0.0)",
    Op.NEG: "-a",
    Op.ABS: "abs(a)",
    Op.EXP: "exp(a)",
    Op.LOG: "log(a)",
    Op.SQRT: "sqrt(a)",
    Op.TANH: "tanh_(a)",
    Op.SIGMOID: "sigmoid_(a)",
    Op.RECIPROCAL: "1.0 / a",
    Op.FLOOR: "floor(a)",
    Op.CEIL: "ceil(a)",
    Op.SIN: "sin(a)",
    Op.COS: "cos(a)",
    Op.ERF: "erf_(a)",
    Op.SIGN: "keep_nan(a, sign(a))",
    Op.LEAKY_RELU: "select(a, s0 * a, a < 0.0)",
    Op.HARD_SIGMOID: "keep_nan(a, clamp(s0 * a + s1, 0.0, 1.0))",
    Op.HARD_SWISH: "a * clamp(a / 6.0 + 0.5, 0.0, 1.0)",
    Op.SOFTSIGN: "a / (1.0 + abs(a))",
    Op.SWISH: "a * sigmoid_(s0 * a)",
    Op.ROUND: "round(a)",                   # WGSL's round: half to even, as NumPy's
    Op.TAN: "keep_nan(a, tan(a))",
    Op.ASIN: "asin_(a)",
    Op.ACOS: "acos_(a)",
    Op.ATAN: "keep_nan(a, atan(a))",
    Op.SINH: "keep_nan(a, sinh(a))",
    Op.COSH: "keep_nan(a, cosh(a))",
    Op.ASINH: "keep_nan(a, asinh(a))",
    Op.ACOSH: "acosh_(a)",
    Op.ATANH: "atanh_(a)",
    Op.ELU: "select(s0 * expm1_(a), a, a > 0.0)",
    Op.SELU: "s1 * select(s0 * expm1_(a), a, a > 0.0)",
    Op.CELU: "keep_nan(a, max(a, 0.0) + min(0.0, s0 * expm1_(a / s0)))",
    Op.SOFTPLUS: "softplus_(a)",
    Op.MISH: "a * tanh_(softplus_(a))",
    Op.THRESHOLDED_RELU: "select(0.0, a, a > s0)",
    Op.SHRINK: "select(select(0.0, a - s0, a > s1), a + s0, a < -s1)",
}
_GELU = {"none": "gelu_(a)",
         "tanh": "0.5 * a * (1.0 + tanh_(0.7978845608028654 * (a + 0.044715 * a * a * a)))"}

BINARY: dict[Op, str] = {
    Op.ADD: "a + b",
    Op.SUB: "a - b",
    Op.MUL: "a * b",
    Op.DIV: "a / b",
    Op.POW: "pow(a, b)",
}

# The attributes that become the scalars s0, s1 of an op's expression.
_SCALARS: dict[Op, tuple[str, ...]] = {
    Op.LEAKY_RELU: ("alpha",), Op.HARD_SIGMOID: ("alpha", "beta"), Op.SWISH: ("alpha",),
    Op.ELU: ("alpha",), Op.SELU: ("alpha", "gamma"), Op.CELU: ("alpha",),
    Op.THRESHOLDED_RELU: ("alpha",), Op.SHRINK: ("bias", "lambd"),
}


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*(tuple(s) for s in shapes)))
    except ValueError:
        raise InvalidArgumentError(
            f"shapes {', '.join(str(tuple(s)) for s in shapes)} do not broadcast") from None


def elementwise(expr: str, xs: Sequence[WgpuArray], scalars: Sequence[float] = (),
                out: Out = None) -> WgpuArray:
    """``expr`` over ``xs`` broadcast together, into ``out[0]`` when it fits."""
    dtype = _one_dtype(xs)
    t = scalar_type(dtype)
    shape = broadcast_shape(*(x.shape for x in xs))
    y = out_array(device_of(*xs), out, 0, shape, dtype)
    if y.size == 0:
        return y
    flat = all(x.shape == shape and x.is_contiguous() for x in xs)
    params = _params(xs, y, scalars, flat)
    launch(wgsl.elementwise(expr, len(xs), t, flat), [y, *xs], params, groups_for(y.size), [y])
    return y


def _one_dtype(xs: Sequence[WgpuArray]) -> Any:
    dtype = xs[0].dtype
    for x in xs:
        if x.dtype != dtype:
            raise InvalidArgumentError(f"elementwise inputs must share a dtype, got "
                                       f"{', '.join(str(x.dtype) for x in xs)}")
    return dtype


def _params(xs: Sequence[WgpuArray], y: WgpuArray, scalars: Sequence[float], flat: bool
            ) -> Params:
    """n, the output's offset, four f32 scalars, then the inputs' offsets (``flat``) or
    the output's shape and each input's offset and broadcast strides."""
    s = [*scalars, 0.0, 0.0, 0.0, 0.0][:4]
    params = Params().u(y.size, y.offset).f(*s)
    if flat:
        return params.u(*(x.offset for x in xs))
    params.dims(y.shape, 1)
    for x in xs:
        params.u(x.offset).dims(broadcast_strides(x, y.shape), 0)
    return params


def binary(name: str, a: WgpuArray, b: WgpuArray, out: Out = None) -> WgpuArray:
    return elementwise(BINARY[Op(name)], [a, b], (), out)


def _unary(op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        if inputs[0].dtype.kind in "iu":
            return [logic.integer(op, [inputs[0]], out)]
        expr = UNARY[op] if op is not Op.GELU else _GELU[str(attrs.get("approximate",
                                                                        "none"))]
        scalars = [float(attrs[k]) for k in _SCALARS.get(op, ())]
        return [elementwise(expr, [inputs[0]], scalars, out)]
    return kernel


def _binary(op: Op) -> Any:
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        if inputs[0].dtype.kind in "iu":
            return [logic.integer(op, [inputs[0], inputs[1]], out)]
        return [elementwise(BINARY[op], [inputs[0], inputs[1]], (), out)]
    return kernel


def _clip(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    bounds = []
    for index, name, default in ((1, "min", -np.inf), (2, "max", np.inf)):
        given = inputs[index] if len(inputs) > index else None
        if given is not None and attrs.get(name) is not None:
            raise InvalidArgumentError(f"clip got its {name} twice: as input {index} and "
                                       f"as attribute {name!r}")
        if given is not None:
            value = np.asarray(given)          # a one-element constant: its host copy
            if value.size != 1:
                raise InvalidArgumentError(f"clip input {index} ({name}) must hold one "
                                           f"element, got shape {value.shape}")
            bounds.append(float(value.reshape(())))
        else:
            bounds.append(default if attrs.get(name) is None else float(attrs[name]))
    lo, hi = (float(np.float32(b)) for b in bounds)
    expr = f"keep_nan(a, min(max(a, {wgsl.lit(lo)}), {wgsl.lit(hi)}))"
    return [elementwise(expr, [x], (), out)]


def register(table: KernelTable, float_dtypes: Sequence[str]) -> None:
    def dtypes(op: Op) -> tuple[str, ...]:
        ints = tuple(d.value for d in DTYPES[op] if d.value in logic.INT_DTYPES) \
            if op in logic.INTEGER else ()
        return (*float_dtypes, *ints)

    for op in (*UNARY, Op.GELU):
        table.kernel(op, dtypes=dtypes(op), supports_out=True,
                     description=f"WGSL {op.value}")(_unary(op))
    for op in BINARY:
        table.kernel(op, dtypes=dtypes(op), supports_out=True,
                     description=f"WGSL {op.value} with broadcasting")(_binary(op))
    table.kernel(Op.CLIP, dtypes=float_dtypes, supports_out=True,
                 description="WGSL clip")(_clip)
