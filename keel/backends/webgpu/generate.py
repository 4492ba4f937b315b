"""Ops of the webgpu backend that make tensors from shapes and scalars.

ConstantOfShape, EyeLike and Trilu run typed shaders (any held dtype, the value
or diagonal in the parameters). Shape, Size and Range compute their few values
from what the host already knows (dims, and Range's scalar inputs, which are
host constants in an exported graph) and upload them into a new buffer: no
read back, and no break in the recorded pass.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, KernelTable, Out
from keel.backends.webgpu import typed
from keel.backends.webgpu.array import Namespace, WgpuArray
from keel.backends.webgpu.ops import device_of
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.shape import (
    check_dims,
    fill_value,
    ints_param,
    range_values,
    require,
    shape_interval,
    trilu_k,
)

__all__ = ["register"]

_ZERO = {"f32": "0.0", "i32": "0", "vec2<u32>": "vec2<u32>(0u, 0u)"}
_ONE = {"f32": "1.0", "i32": "1", "vec2<u32>": "vec2<u32>(1u, 0u)"}


@functools.cache
def _source(body: str, kinds: tuple[str, ...], out: str) -> str:
    return typed.typed_source(kinds, out, body)


def _uploaded(like: WgpuArray, host: np.ndarray) -> list[Any]:
    return [Namespace(like.storage.device).asarray(host)]


def _shape(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    dims = inputs[0].shape
    lo, hi = shape_interval(len(dims), attrs["start"], attrs["end"])
    return _uploaded(inputs[0], np.array(dims[lo:hi], dtype=np.int64))


def _size(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    return _uploaded(inputs[0], np.array(inputs[0].size, dtype=np.int64))


def _range(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    return _uploaded(inputs[0], range_values("range", inputs))


def _constant_of_shape(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out
                       ) -> list[Any]:
    value = fill_value("constant_of_shape", attrs["value"])
    shape = check_dims("constant_of_shape", require(
        ints_param("constant_of_shape", inputs, 0, attrs, "shape"), "constant_of_shape",
        "a shape"), "shape")
    kind = typed.kind_of(value.dtype)
    y = typed.output(device_of(inputs[0]), out, tuple(shape), value.dtype)
    if y.size:
        typed.launch_typed(_source(f"    return {typed.typed_constant(kind)};\n", (), kind), y, [],
                     typed.head(y, typed.constant_words(value, value.dtype)))
    return [y]


def _eye_like(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    if x.ndim != 2:
        raise InvalidArgumentError(f"eye_like needs a rank-2 input, got shape {x.shape}")
    dtype = np.dtype((attrs["dtype"] or DType.from_numpy(x.dtype)).numpy)
    kind = typed.kind_of(dtype)
    y = typed.output(x.storage.device, out, x.shape, dtype)
    if y.size:
        d = typed.domain(kind)
        body = (f"    let on = i32(coord(k, 7u)) - i32(coord(k, 6u)) == bitcast<i32>(P[2]);\n"
                f"    return select({_ZERO[d]}, {_ONE[d]}, on);\n")
        typed.launch_typed(_source(body, (), kind), y, [], typed.head(y, [attrs["k"]]))
    return [y]


def _trilu(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = inputs[0]
    if x.ndim < 2:
        raise InvalidArgumentError(f"trilu needs rank >= 2, got shape {x.shape}")
    k = trilu_k(inputs, attrs)
    kind = typed.kind_of(x.dtype)
    y = typed.output(x.storage.device, out, x.shape, x.dtype)
    if y.size:
        keep = ">=" if attrs["upper"] else "<="
        body = (f"    let keep = i32(coord(k, 7u)) - i32(coord(k, 6u)) {keep} "
                "bitcast<i32>(P[2]);\n"
                f"    if (!keep) {{ return {_ZERO[typed.domain(kind)]}; }}\n"
                "    return ld0(u32(i32(P[14]) + at(k, 6u, 15u)));\n")
        params = typed.head(y, [k]).u(x.offset).dims(x.strides_el, 0)
        typed.launch_typed(_source(body, (kind,), kind), y, [x], params)
    return [y]


def register(table: KernelTable) -> None:
    for op, fn, what in (
            (Op.SHAPE, _shape, "dims known on the host, uploaded"),
            (Op.SIZE, _size, "element count known on the host, uploaded"),
            (Op.RANGE, _range, "values of host scalars, uploaded"),
            (Op.CONSTANT_OF_SHAPE, _constant_of_shape, "WGSL fill of any held dtype"),
            (Op.EYE_LIKE, _eye_like, "WGSL diagonal of any held dtype"),
            (Op.TRILU, _trilu, "WGSL triangle of any held dtype")):
        table.kernel(op, supports_out=True, description=what)(fn)
