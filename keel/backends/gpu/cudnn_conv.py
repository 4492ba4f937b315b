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
    """Which parts of ``act(conv + B + Z)`` run inside the cuDNN graph, in which order."""

    bias: bool
    residual: bool
    activation: bool
    residual_first: bool = False    # conv + Z + B: the order of cuDNN's ConvBiasAct pattern

    def describe(self) -> str:
        parts = [("bias", self.bias), ("residual", self.residual)]
        if self.residual_first:
            parts.reverse()
        parts.append(("activation", self.activation))
        return "conv" + "".join(f" + {name}" for name, on in parts if on)


def fusions(bias: bool, residual: bool, act: bool) -> tuple[Fusion, ...]:
    """The graphs to try, most fused first: all of ``act(conv + B + Z)`` (Z before B, then
    after it), then without the activation, without the residual, without the bias (what
    a graph leaves out runs after the conv)."""
    steps = [Fusion(bias, residual, act, True), Fusion(bias, residual, act),
             Fusion(bias, residual, False, True), Fusion(bias, residual, False),
             Fusion(bias, False, False), Fusion(False, False, False)]
    # Z's place only matters with both in the graph.
    steps = [f if f.bias and f.residual else Fusion(f.bias, f.residual, f.activation)
             for f in steps]
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


@dataclass
class _Compiled:
    """A built cuDNN graph for one signature and what a call binds into it."""

    graph: Any
    uids: dict[str, int]
    fusion: Fusion
    workspace: Any          # a CuPy uint8 buffer, kept as long as the graph
    engine: str             # the engine that runs, and how it was picked
    declined: tuple[str, ...] = ()      # the more fused graphs cuDNN had no engine for

    def __post_init__(self) -> None:
        self.workspace_ptr = _address(self.workspace)


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
    steps = [("b", fusion.bias), ("z", fusion.residual)]
    for name, on in reversed(steps) if fusion.residual_first else steps:
        if not on:
            continue
        dims = d.bias if name == "b" else d.y
        t = g.tensor(name=name.upper(), dim=list(dims), stride=list(_packed(dims)),
                     data_type=io)
        uids[name] = t.uid
        y = g.bias(y, t, name="bias") if name == "b" else g.add(y, t, name="residual")
    clip = graph_activation(spec.act) if fusion.activation else None
    if clip == (0.0, None):
        y = g.relu(y, name="act")
    elif clip is not None:
        y = g.relu(y, lower_clip=clip[0], upper_clip=clip[1], name="act")
    y.set_output(True).set_data_type(io).set_dim(list(d.y)).set_stride(list(_packed(d.y)))
    uids["y"] = y.uid
    return g, uids


def _planned(cudnn: Any, handle: Any, spec: _Spec, fusion: Fusion) -> tuple[Any, dict[str, int]]:
    """One graph validated and planned by cuDNN's heuristics (A, then FALLBACK), with the
    engines keel must not run filtered out; raises when cuDNN cannot serve it."""
    g, uids = _graph(cudnn, handle, spec, fusion)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    notes = [cudnn.numerical_note.NONDETERMINISTIC]    # keel's runs are bitwise repeatable
    if spec.dtype is DType.FLOAT32:
        # At float32 these notes mark the TF32 (or down-converting) engines: 10-bit
        # mantissas, far from float32 results. float16 keeps its tensor-core engines.
        notes += [cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS]
    g.deselect_numeric_notes(notes)
    g.check_support()
    return g, uids


def _engine_name(g: Any, index: int) -> str:
    try:
        return str(g.get_plan_name_at_index(index))
    except Exception:
        return f"plan {index}"


# Timed runs per candidate engine, after one untimed run: engines differ by far more than
# the spread of three back-to-back runs of one.
_TIMED_RUNS = 3


def _time_plan(xp: Any, g: Any, handle: Any, pack: dict[int, int], workspace: int,
               index: int) -> float:
    """Milliseconds per run of the plan at ``index`` (after one untimed run)."""
    g.execute_plan_at_index(pack, workspace, index=index, handle=handle)
    start, end = xp.cuda.Event(), xp.cuda.Event()
    start.record()
    for _ in range(_TIMED_RUNS):
        g.execute_plan_at_index(pack, workspace, index=index, handle=handle)
    end.record()
    end.synchronize()
    return float(xp.cuda.get_elapsed_time(start, end)) / _TIMED_RUNS



def _fastest(xp: Any, cudnn: Any, g: Any, handle: Any, pack: dict[int, int]
             ) -> tuple[int, str] | None:
    """Build every plan of ``g``, time each on the call's own arrays (the output into a
    scratch buffer) and return (the fastest's index, what was measured); None when no
    plan ran."""
    g.build_plans(cudnn.build_plan_policy.ALL)
    sizes = {}
    for i in range(int(g.get_execution_plan_count())):
        try:
            sizes[i] = int(g.get_workspace_size_plan_at_index(i))
        except Exception:             # not built (declined) or filtered out
            continue
    if not sizes:
        return None
    scratch = xp.empty(max(*sizes.values(), 1), dtype=xp.uint8)
    times = {}
    for i in sizes:
        try:
            times[i] = _time_plan(xp, g, handle, pack, _address(scratch), i)
        except Exception:             # a plan that fails to run is not a candidate
            continue
    if not times:
        return None
    best = min(times, key=times.__getitem__)
    return best, (f"fastest of {len(times)} engines timed on first run "
                  f"({times[best]:.3f} ms; heuristics' first {times[min(times)]:.3f} ms)")


def _capturing(xp: Any) -> bool:
    """Whether the current stream is being captured into a CUDA graph (nothing may be
    timed or synchronized then)."""
    probe = getattr(xp.cuda.get_current_stream(), "is_capturing", None)
    return bool(probe()) if probe is not None else False


def _finish(xp: Any, cudnn: Any, g: Any, handle: Any, pack: dict[int, int] | None
            ) -> str:
    """Build the plan that runs: the fastest measured when ``pack`` (the first call's
    pointers) may be timed, else cuDNN's heuristic choice. Returns how it was picked."""
    found = None if pack is None else _fastest(xp, cudnn, g, handle, pack)
    if found is None:
        g.build_plans()
        index = int(getattr(g, "_plan_index", 0))
        return f"{_engine_name(g, index)}, cuDNN's heuristic choice (not timed)"
    index, how = found
    g.select_plan(index)
    g.build_plans()
    return f"{_engine_name(g, index)}, {how}"


class _Declined(Exception):
    """No cuDNN engine serves any graph of a signature (the reasons, one per graph)."""


def _compile(lib: CudnnLibrary, xp: Any, spec: _Spec, arrays: dict[str, Any]) -> _Compiled:
    """The most fused graph of ``spec`` that cuDNN serves, built, its engine measured on
    ``arrays`` (the first call's; Y replaced by a scratch buffer) unless capturing."""
    cudnn = lib.module
    handle = lib.handle(spec.device)
    act_fusable = graph_activation(spec.act) is not None
    timed = not _capturing(xp)
    scratch = xp.empty_like(arrays["y"]) if timed else None
    failures = []
    for fusion in fusions(spec.bias, spec.residual, act_fusable):
        try:
            g, uids = _planned(cudnn, handle, spec, fusion)
            pack = None if scratch is None else _pack(uids, {**arrays, "y": scratch})
            engine = _finish(xp, cudnn, g, handle, pack)
            size = int(g.get_workspace_size())
        except Exception as exc:     # cuDNN declines this graph: try the next, shorter one
            failures.append(f"{fusion.describe()}: {type(exc).__name__}: {exc}")
            continue
        workspace = xp.empty(max(size, 1), dtype=xp.uint8)
        return _Compiled(g, uids, fusion, workspace, engine, tuple(failures))
    raise _Declined("; ".join(failures))


def _pack(uids: dict[str, int], arrays: dict[str, Any]) -> dict[int, int]:
    """The variant pack: each graph tensor's uid -> its array's device address."""
    return {uid: _address(arrays[name]) for name, uid in uids.items()}


_LOCK = threading.Lock()
# (library, spec, thread) -> the built graph, or why cuDNN declined every graph of it.
_COMPILED: dict[tuple[CudnnLibrary, _Spec, int], _Compiled | _Declined] = {}


def compiled(lib: CudnnLibrary, xp: Any, spec: _Spec, arrays: dict[str, Any]
             ) -> _Compiled | _Declined:
    """The built graph of ``spec`` on this thread (built on first use, then kept)."""
    key = (lib, spec, threading.get_ident())
    found = _COMPILED.get(key)
    if found is None:
        with _LOCK:
            try:
                found = _compile(lib, xp, spec, arrays)
            except _Declined as exc:
                found = exc
            _COMPILED[key] = found
    return found


def built() -> list[dict[str, Any]]:
    """What has been built so far: one entry per signature (for reports and probes)."""
    rows = []
    for (_, spec, _), found in list(_COMPILED.items()):
        row: dict[str, Any] = {"x": spec.desc.x, "w": spec.desc.w, "dtype": spec.dtype.value,
                               "groups": spec.desc.groups, "bias": spec.bias,
                               "residual": spec.residual, "activation": spec.act[0]}
        if isinstance(found, _Compiled):
            row.update(engine=found.engine, fused=found.fusion.describe(),
                       workspace_bytes=int(found.workspace.nbytes), declined=found.declined)
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
    y = out[0] if out is not None and out[0] is not None else None
    if y is None or not y.flags.c_contiguous or y.dtype != x.dtype:
        y = xp.empty(geo.out_shape, dtype=x.dtype)
    arrays = {"x": x, "w": w, "b": b, "z": z, "y": y}
    spec = _Spec(desc, dtype, b is not None, z is not None, act,
                 int(xp.cuda.runtime.getDevice()))
    found = compiled(lib, xp, spec, arrays)
    if isinstance(found, _Declined):
        return _im2col(ctx, inputs, attrs, out)
    handle = lib.handle(spec.device)
    lib.bind_stream(handle, int(xp.cuda.get_current_stream().ptr))
    found.graph.execute(_pack(found.uids, arrays), found.workspace_ptr, handle=handle)
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
