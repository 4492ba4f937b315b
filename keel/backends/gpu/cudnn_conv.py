"""Convolutions on cuDNN: one fused cuDNN graph per signature, built once, then bound and run.

The ``cudnn`` conv variant of the gpu backend runs dense, grouped, depthwise
and 1x1 convolutions (1-, 2- and 3-D; float32 and float16) as a cuDNN
operation graph made with the ``nvidia-cudnn-frontend`` package
(:mod:`keel.backends.gpu.cudnn_lib`): ``conv_fprop``, then the node's bias,
residual Z and activation (ReLU, or a clip as a clipped ReLU: Relu6) as
pointwise ops of the same graph, so the conv's output is written once.

Layout: the tensors keep the graph's NCHW layout (OIHW filters), described to
cuDNN by their dims and packed strides. Channels-last would suit cuDNN's
tensor-core kernels better at float16, but every keel op around a conv reads
NCHW, so a layout change would cost a transpose before and after each conv;
NCHW float32 runs on cuDNN's FMA kernels either way (TF32 is excluded, below).

Per signature (shapes, dtype, attributes, fused epilogue, device, thread) the
graph is validated, planned by cuDNN's heuristics (modes A then FALLBACK: the
first engine that builds, not timed), built, and its workspace allocated once
through CuPy. A call binds the device pointers and executes on CuPy's current
stream; it allocates nothing and never synchronizes. When cuDNN has no engine
for the whole fused graph, shorter ones are tried (without the activation,
without the residual, without the bias) and what is left runs after the conv
through the array namespace; with no engine at all, the shared ``im2col``
variant runs the node.

float32 excludes engines that carry the ``TENSOR_CORE`` or
``DOWN_CONVERT_INPUTS`` numerical notes: at float32 those are the TF32
engines (10-bit mantissas), whose results differ from the reference by far
more than float32 rounding. float16 computes in float32 on tensor cores.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.cpu import kernels as cpu_kernels
from keel.backends.cpu.conv_epilogue import Activation, activation, finish
from keel.backends.gpu import cudnn_lib
from keel.backends.gpu.cudnn_lib import CudnnLibrary
from keel.backends.gpu.kernels import TABLE
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schemas.conv import DTYPES as CONV_DTYPES
from keel.ops.schemas.conv import ConvGeometry, check_conv_extras, conv_geometry

__all__ = ["DTYPES", "ConvDescriptor", "Fusion", "cannot_serve", "describe", "fusions",
           "graph_activation"]

DTYPES = frozenset({DType.FLOAT32, DType.FLOAT16})
_RANKS = (1, 2, 3)          # spatial ranks: 1-D runs as 2-D with a unit height
DTYPES_ANY = CONV_DTYPES[Op.CONV]


# ---- what cuDNN is told: pure arithmetic on the conv's geometry ----------------------
def _packed(dims: Sequence[int]) -> tuple[int, ...]:
    """Row-major (C-contiguous) element strides of ``dims``."""
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class ConvDescriptor:
    """A conv as cuDNN's graph API takes it: NCHW dims, packed strides, per-dim windows.

    The group count is implicit, as cuDNN reads it: ``x[1] // w[1]``.
    """

    x: tuple[int, ...]
    w: tuple[int, ...]
    y: tuple[int, ...]
    pre_padding: tuple[int, ...]
    post_padding: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]

    @property
    def bias(self) -> tuple[int, ...]:
        """B as a tensor broadcast over Y: (1, M, 1, ...)."""
        return (1, self.y[1], *(1 for _ in self.y[2:]))

    @property
    def groups(self) -> int:
        return self.x[1] // self.w[1]


def describe(geo: ConvGeometry) -> ConvDescriptor:
    """The cuDNN description of a resolved conv (pads already through ``auto_pad``)."""
    win = geo.window
    lift: tuple[int, ...] = (1,) if win.rank == 1 else ()   # 1-D: a unit height
    zero: tuple[int, ...] = (0,) if win.rank == 1 else ()
    return ConvDescriptor(
        x=(geo.batch, geo.in_channels, *lift, *win.in_spatial),
        w=(geo.out_channels, geo.in_channels // geo.group, *lift, *win.kernel),
        y=(geo.batch, geo.out_channels, *lift, *win.out_spatial),
        pre_padding=(*zero, *win.pads_begin), post_padding=(*zero, *win.pads_end),
        stride=(*lift, *win.strides), dilation=(*lift, *win.dilations))


def cannot_serve(spatial_rank: int | None, dtype: DType | None) -> str | None:
    """Why the cudnn variant cannot run a conv of this rank and dtype; None when it can."""
    if dtype not in DTYPES:
        shown = "unknown" if dtype is None else dtype.value
        return f"cuDNN conv graphs here take float16 or float32, not {shown}"
    if spatial_rank is not None and spatial_rank not in _RANKS:
        return f"cuDNN conv graphs here take 1-3 spatial dims, not {spatial_rank}"
    return None


def graph_activation(act: Activation) -> tuple[float, float | None] | None:
    """The activation as cuDNN's clipped ReLU ``(lower_clip, upper_clip or None)``; None
    when the graph cannot express it (it then runs after the conv)."""
    name, params = act
    if name != "clip" or not math.isfinite(params[0]):
        return None
    low, high = params
    return float(low), (None if math.isinf(high) else float(high))


@dataclass(frozen=True)
class Fusion:
    """Which parts of ``act(conv + B + Z)`` run inside the cuDNN graph."""

    bias: bool
    residual: bool
    activation: bool

    def describe(self) -> str:
        parts = [n for n, on in (("bias", self.bias), ("residual", self.residual),
                                 ("activation", self.activation)) if on]
        return "conv" + "".join(f" + {p}" for p in parts)


def fusions(bias: bool, residual: bool, act: bool) -> tuple[Fusion, ...]:
    """The graphs to try, most fused first; each drops the last op of the one before
    (act(conv + B + Z) is computed in that order, so what is left runs after the conv)."""
    steps = [Fusion(bias, residual, act), Fusion(bias, residual, False),
             Fusion(bias, False, False), Fusion(False, False, False)]
    return tuple(dict.fromkeys(steps))


# ---- the graph, built once per signature ---------------------------------------------
@dataclass(frozen=True)
class _Spec:
    desc: ConvDescriptor
    dtype: DType
    bias: bool
    residual: bool
    act: Activation
    device: int


class _Compiled:
    """A built cuDNN graph for one signature and what a call binds into it."""

    def __init__(self, graph: Any, uids: dict[str, int], fusion: Fusion, workspace: Any,
                 engine: str) -> None:
        self.graph, self.uids, self.fusion, self.engine = graph, uids, fusion, engine
        self.workspace = workspace                       # a CuPy uint8 buffer, kept
        self.workspace_ptr = _address(workspace)


def _address(array: Any) -> int:
    """The device address of a CuPy array (a host array's address under a fake device)."""
    ptr = getattr(array.data, "ptr", None)
    return int(ptr) if ptr is not None else int(array.__array_interface__["data"][0])


def _cudnn_type(cudnn: Any, dtype: DType) -> Any:
    return cudnn.data_type.HALF if dtype is DType.FLOAT16 else cudnn.data_type.FLOAT


def _graph(cudnn: Any, handle: Any, spec: _Spec, fusion: Fusion) -> tuple[Any, dict[str, int]]:
    """The operation graph of ``fusion`` for ``spec`` (not yet validated)."""
    io, f32 = _cudnn_type(cudnn, spec.dtype), cudnn.data_type.FLOAT
    d = spec.desc
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
    x = g.tensor(name="X", dim=list(d.x), stride=list(_packed(d.x)), data_type=io)
    w = g.tensor(name="W", dim=list(d.w), stride=list(_packed(d.w)), data_type=io)
    uids = {"x": x.uid, "w": w.uid}
    y = g.conv_fprop(x, w, pre_padding=list(d.pre_padding), post_padding=list(d.post_padding),
                     stride=list(d.stride), dilation=list(d.dilation), compute_data_type=f32,
                     name="conv")
    if fusion.bias:
        b = g.tensor(name="B", dim=list(d.bias), stride=list(_packed(d.bias)), data_type=io)
        uids["b"] = b.uid
        y = g.bias(y, b, name="bias")
    if fusion.residual:
        z = g.tensor(name="Z", dim=list(d.y), stride=list(_packed(d.y)), data_type=io)
        uids["z"] = z.uid
        y = g.add(y, z, name="residual")
    clip = graph_activation(spec.act) if fusion.activation else None
    if clip == (0.0, None):
        y = g.relu(y, name="act")
    elif clip is not None:
        y = g.relu(y, lower_clip=clip[0], upper_clip=clip[1], name="act")
    y.set_output(True).set_data_type(io).set_dim(list(d.y)).set_stride(list(_packed(d.y)))
    uids["y"] = y.uid
    return g, uids


def _build(cudnn: Any, handle: Any, spec: _Spec, fusion: Fusion) -> tuple[Any, dict[str, int]]:
    """Validate, plan (cuDNN's heuristics) and build one graph; raises when no engine
    serves it."""
    g, uids = _graph(cudnn, handle, spec, fusion)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    if spec.dtype is DType.FLOAT32:
        # At float32 these notes mark TF32 (or down-converting) engines: not float32
        # results; nondeterministic engines would break keel's bitwise repeatable runs.
        g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE,
                                  cudnn.numerical_note.DOWN_CONVERT_INPUTS,
                                  cudnn.numerical_note.NONDETERMINISTIC])
    else:     # keel's runs are bitwise repeatable: no engine with atomics in its reduction
        g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
    g.check_support()
    g.build_plans()
    return g, uids


def _engine_name(g: Any) -> str:
    try:
        return str(g.get_plan_name_at_index(int(getattr(g, "_plan_index", 0))))
    except Exception:
        return "unnamed engine"


class _Declined(Exception):
    """No cuDNN engine serves any graph of a signature (the reasons, one per graph)."""


def _compile(lib: CudnnLibrary, xp: Any, spec: _Spec) -> _Compiled:
    cudnn = lib.module
    handle = lib.handle(spec.device)
    act_fusable = graph_activation(spec.act) is not None
    failures = []
    for fusion in fusions(spec.bias, spec.residual, act_fusable):
        try:
            g, uids = _build(cudnn, handle, spec, fusion)
            size = int(g.get_workspace_size())
        except Exception as exc:     # cuDNN declines this graph: try the next, shorter one
            failures.append(f"{fusion.describe()}: {type(exc).__name__}: {exc}")
            continue
        workspace = xp.empty(max(size, 1), dtype=xp.uint8)
        return _Compiled(g, uids, fusion, workspace, _engine_name(g))
    raise _Declined("; ".join(failures))


_LOCK = threading.Lock()
# (library, spec, thread) -> the built graph, or why cuDNN declined every graph of it.
_COMPILED: dict[tuple[CudnnLibrary, _Spec, int], _Compiled | _Declined] = {}


def compiled(lib: CudnnLibrary, xp: Any, spec: _Spec) -> _Compiled | _Declined:
    """The built graph of ``spec`` on this thread (built on first use, then kept)."""
    key = (lib, spec, threading.get_ident())
    found = _COMPILED.get(key)
    if found is None:
        with _LOCK:
            try:
                found = _compile(lib, xp, spec)
            except _Declined as exc:
                found = exc
            _COMPILED[key] = found
    return found


def built() -> list[dict[str, Any]]:
    """What has been built so far: one entry per signature (for reports and probes)."""
    rows = []
    for (_, spec, _), found in list(_COMPILED.items()):
        row: dict[str, Any] = {"x": spec.desc.x, "w": spec.desc.w, "dtype": spec.dtype.value,
                               "groups": spec.desc.groups}
        if isinstance(found, _Compiled):
            row.update(engine=found.engine, fused=found.fusion.describe(),
                       workspace_bytes=int(found.workspace.nbytes))
        else:
            row["declined"] = str(found)
        rows.append(row)
    return rows


# ---- the kernel ---------------------------------------------------------------------
@functools.lru_cache(maxsize=512)
def _signature(x: tuple[int, ...], w: tuple[int, ...], b: tuple[int, ...] | None,
               z: tuple[int, ...] | None, dtype: Any,
               attrs_key: tuple[tuple[str, Any], ...]) -> tuple[ConvGeometry, ConvDescriptor,
                                                               DType, Activation]:
    attrs = dict(attrs_key)
    geo = conv_geometry(Op.CONV, x, w, attrs)
    check_conv_extras(Op.CONV, geo.out_shape, b, z)
    act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    return geo, describe(geo), DType.from_numpy(dtype), act


def _epilogue(xp: Any, done: Fusion, b: Any, z: Any, y: Any, act: Activation) -> None:
    """What the graph left out of ``y = act(conv + B + Z)``, in place on ``y``."""
    if b is not None and not done.bias:
        xp.add(y, b.reshape(1, -1, *(1 for _ in y.shape[2:])), out=y)
    rest_z = None if done.residual else z
    rest_act = ("", ()) if done.activation else act
    if rest_z is not None or rest_act[0]:
        finish(xp, y, y, rest_z, rest_act)


def _contiguous(xp: Any, a: Any) -> Any:
    return a if a is None or a.flags.c_contiguous else xp.ascontiguousarray(a)


def _im2col(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    return list(TABLE.get(Op.CONV, "im2col").fn(ctx, inputs, attrs, out))


def conv(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out,
         lib: CudnnLibrary | None = None) -> list[Any]:
    """``act(conv(X, W) + B + Z)`` through one cuDNN graph per signature."""
    xp = ctx.xp
    lib = cudnn_lib.LIBRARY if lib is None else lib
    x, w = _contiguous(xp, inputs[0]), _contiguous(xp, inputs[1])
    b, z = _contiguous(xp, optional_input(inputs, 2)), _contiguous(xp, optional_input(inputs, 3))
    geo, desc, dtype, act = _signature(
        tuple(x.shape), tuple(w.shape), None if b is None else tuple(b.shape),
        None if z is None else tuple(z.shape), x.dtype, tuple(attrs.items()))
    spec = _Spec(desc, dtype, b is not None, z is not None, act,
                 int(xp.cuda.runtime.getDevice()))
    found = compiled(lib, xp, spec)
    if isinstance(found, _Declined):
        return _im2col(ctx, inputs, attrs, out)
    y = out[0] if out is not None and out[0] is not None else None
    if y is None or not y.flags.c_contiguous or y.dtype != x.dtype:
        y = xp.empty(geo.out_shape, dtype=x.dtype)
    handle = lib.handle(spec.device)
    lib.bind_stream(handle, int(xp.cuda.get_current_stream().ptr))
    pack = {found.uids["x"]: _address(x), found.uids["w"]: _address(w),
            found.uids["y"]: _address(y)}
    if "b" in found.uids:
        pack[found.uids["b"]] = _address(b)
    if "z" in found.uids:
        pack[found.uids["z"]] = _address(z)
    found.graph.execute(pack, found.workspace_ptr, handle=handle)
    _epilogue(xp, found.fusion, b, z, y, act)
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


TABLE.kernel(Op.CONV, dtypes=DTYPES_ANY, supports_out=True, dispatcher=True, gpu_only=True,
             description="runs the variant the gpu planner names: cudnn, pointwise or "
                         "im2col")(dispatch)
TABLE.kernel(Op.CONV, variant="cudnn", dtypes=DTYPES, supports_out=True,
             description="cuDNN conv graph (nvidia-cudnn-frontend): bias, residual and "
                         "ReLU/clip fused where cuDNN's engines take them",
             gpu_only=True)(conv)
