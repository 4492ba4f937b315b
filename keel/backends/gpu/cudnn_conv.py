"""The gpu backend's ``cudnn`` conv variant, and its conv ``default`` that runs the planned one.

``cudnn`` runs dense, grouped, depthwise and 1x1 convolutions (1-, 2- and 3-D;
float32 and float16) as one cuDNN graph per signature with the node's bias,
residual and ReLU/clip fused where cuDNN serves them
(:mod:`keel.backends.gpu.cudnn_graph`: descriptors, building, measuring the
engine once per shape). A steady-state call looks its built graph up by the
arrays' shapes and the node's attributes, binds the device pointers, executes
on CuPy's current stream, and runs what the graph left out (bias, residual,
activation) through the array namespace; it allocates nothing and never
synchronizes. A signature no cuDNN graph serves runs on the shared ``im2col``
variant.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.cpu import kernels as cpu_kernels
from keel.backends.cpu.conv_epilogue import Activation, activation, finish
from keel.backends.gpu import cudnn_lib
from keel.backends.gpu.cudnn_graph import (
    DTYPES,
    Compiled,
    Declined,
    Fusion,
    Signature,
    address,
    compiled,
    describe,
    leaves_out,
)
from keel.backends.gpu.cudnn_lib import CudnnLibrary
from keel.backends.gpu.kernels import TABLE
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schemas.conv import DTYPES as CONV_DTYPES
from keel.ops.schemas.conv import check_conv_extras, conv_geometry

__all__ = ["conv", "dispatch"]


@functools.lru_cache(maxsize=512)
def _signature(x: tuple[int, ...], w: tuple[int, ...], b: tuple[int, ...] | None,
               z: tuple[int, ...] | None, dtype: Any, attrs_key: tuple[tuple[str, Any], ...],
               device: int) -> tuple[Signature, tuple[int, ...]]:
    """The graph signature of a call and its output shape (checked once per signature)."""
    attrs = dict(attrs_key)
    geo = conv_geometry(Op.CONV, x, w, attrs)
    check_conv_extras(Op.CONV, geo.out_shape, b, z)
    act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    spec = Signature(describe(geo), DType.from_numpy(dtype), b is not None, z is not None,
                     act, device)
    return spec, geo.out_shape


def _after(xp: Any, act: Activation) -> Any:
    """What runs after a graph of ``fusion``: the rest of ``y = act(conv + B + Z)``."""
    def run(fusion: Fusion, arrays: dict[str, Any]) -> None:
        y, b, z = arrays["y"], arrays["b"], arrays["z"]
        if b is not None and not fusion.bias:
            xp.add(y, b.reshape(1, -1, *(1 for _ in y.shape[2:])), out=y)
        rest_z = None if fusion.residual else z
        rest_act = ("", ()) if fusion.activation else act
        if rest_z is not None or rest_act[0]:
            finish(xp, y, y, rest_z, rest_act)
    return run


def _contiguous(xp: Any, a: Any) -> Any:
    return a if a is None or a.flags.c_contiguous else xp.ascontiguousarray(a)


# A call's graph by (library, thread, device, shapes, dtype, id(attrs)): the steady state
# pays one dict lookup. Each entry keeps the attrs and the library it was made for, so
# their ids are not reused while it is there.
_Entry = tuple[Attrs, CudnnLibrary, Signature, Compiled | Declined, tuple[int, ...]]
_FAST: dict[tuple[Any, ...], _Entry] = {}
_FAST_LIMIT = 1024


def _lookup(lib: CudnnLibrary, xp: Any, arrays: dict[str, Any], attrs: Attrs) -> _Entry:
    x, w, b, z = arrays["x"], arrays["w"], arrays["b"], arrays["z"]
    device = int(xp.cuda.runtime.getDevice())
    key = (id(lib), threading.get_ident(), device, x.shape, w.shape, x.dtype, id(attrs),
           None if b is None else b.shape, None if z is None else z.shape)
    hit = _FAST.get(key)
    if hit is not None and hit[0] is attrs and hit[1] is lib:
        return hit
    spec, out_shape = _signature(tuple(x.shape), tuple(w.shape),
                                 None if b is None else tuple(b.shape),
                                 None if z is None else tuple(z.shape), x.dtype,
                                 tuple(attrs.items()), device)
    if arrays["y"] is None:
        arrays["y"] = xp.empty(out_shape, dtype=x.dtype)
    found = compiled(lib, xp, spec, arrays, _after(xp, spec.act))
    if len(_FAST) >= _FAST_LIMIT:
        _FAST.clear()
    entry: _Entry = (attrs, lib, spec, found, out_shape)
    _FAST[key] = entry
    return entry


def conv(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out,
         lib: CudnnLibrary | None = None) -> list[Any]:
    """``act(conv(X, W) + B + Z)`` through the cuDNN graph built for its signature."""
    xp = ctx.xp
    lib = cudnn_lib.LIBRARY if lib is None else lib
    x, w = _contiguous(xp, inputs[0]), _contiguous(xp, inputs[1])
    b, z = _contiguous(xp, optional_input(inputs, 2)), _contiguous(xp, optional_input(inputs, 3))
    y = out[0] if out is not None and out[0] is not None else None
    if y is not None and (not y.flags.c_contiguous or y.dtype != x.dtype):
        y = None
    arrays = {"x": x, "w": w, "b": b, "z": z, "y": y}
    _, _, spec, found, out_shape = _lookup(lib, xp, arrays, attrs)
    if isinstance(found, Declined):
        return list(TABLE.get(Op.CONV, "im2col").fn(ctx, inputs, attrs, out))
    y = arrays["y"]
    if y is None:
        y = arrays["y"] = xp.empty(out_shape, dtype=x.dtype)
    handle = lib.handle(spec.device)
    lib.bind_stream(handle, int(xp.cuda.get_current_stream().ptr))
    found.graph.execute({uid: address(arrays[name]) for name, uid in found.slots},
                        found.workspace_ptr, handle=handle)
    if leaves_out(found.fusion, spec):
        _after(xp, spec.act)(found.fusion, arrays)
    if out is not None and out[0] is not None and out[0] is not y:
        out[0][...] = y
        return [out[0]]
    return [y]


def dispatch(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The gpu's conv ``default``: runs the variant the node's plan names (on the op-level
    path, the plan the gpu planner made from the real shapes)."""
    name = "default" if ctx.plan is None else ctx.plan.variant
    if name == "cudnn":
        return conv(ctx, inputs, attrs, out)
    # Any other variant is a cpu one run through CuPy; the cpu's own dispatcher for
    # "default" (no plan: the shapes decide).
    shared = cpu_kernels.load().get(Op.CONV, name)
    return list(shared.fn(ctx, inputs, attrs, out))


TABLE.kernel(Op.CONV, dtypes=CONV_DTYPES[Op.CONV], supports_out=True, dispatcher=True,
             gpu_only=True, description="runs the variant the gpu planner names: cudnn, "
                                        "pointwise or im2col")(dispatch)
TABLE.kernel(Op.CONV, variant="cudnn", dtypes=DTYPES, supports_out=True,
             description="cuDNN conv graph (nvidia-cudnn-frontend): bias, residual and "
                         "ReLU/clip fused where cuDNN's engines take them, the engine "
                         "measured once per shape", gpu_only=True)(conv)
