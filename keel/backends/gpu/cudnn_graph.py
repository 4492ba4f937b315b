"""cuDNN graphs for convolutions: what cuDNN is told, how a graph is built and its engine measured.

A conv signature (:class:`Signature`: the conv as cuDNN describes it, its
dtype, which of bias, residual and activation it has, the device) becomes a
cuDNN operation graph made with the ``nvidia-cudnn-frontend`` package
(:mod:`keel.backends.gpu.cudnn_lib`): ``conv_fprop``, then the bias, the
residual Z and the activation (ReLU, or a clip as a clipped ReLU: Relu6) as
pointwise ops of the same graph, so the conv's output is written once.

Layout: the tensors keep the graph's NCHW layout (OIHW filters), described to
cuDNN by their dims and packed strides. Channels-last would suit cuDNN's
tensor-core kernels better at float16, but every keel op around a conv reads
NCHW, so a layout change would cost a transpose before and after each conv;
NCHW float32 runs on cuDNN's FMA kernels either way (TF32 is excluded, below).

Each graph is validated and planned by cuDNN's heuristics (modes A then
FALLBACK). cuDNN may have no engine for the whole fused graph; shorter ones
(:func:`fusions`: without the activation, the residual, the bias) leave the
rest to run after the conv. On the first call of a signature every graph
cuDNN serves is built with all its candidate engines, each engine is timed on
the call's own arrays (the output into a scratch buffer), together with what
would run after the graph, and the fastest pair is kept: the engine and the
fusion are measured once per shape, and kept on disk for later processes on the
same GPU and cuDNN (:mod:`keel.backends.gpu.cudnn_choices`), which then build only
that engine. A first call inside a CUDA-graph capture
cannot be timed: it keeps the most fused graph cuDNN serves, on cuDNN's
heuristic choice. The workspace is allocated once per built graph through
CuPy.

float32 excludes engines that carry the ``TENSOR_CORE`` or
``DOWN_CONVERT_INPUTS`` numerical notes: at float32 those are the TF32
engines (10-bit mantissas), whose results differ from the reference by far
more than float32 rounding. float16 and bfloat16 compute in float32 on tensor
cores (the graph's compute and intermediate types are FLOAT).
Engines with the ``NONDETERMINISTIC`` note are excluded at every dtype: keel's
runs are bitwise repeatable.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from keel._fork import renew_after_fork
from keel.backends.cpu.conv_epilogue import Activation
from keel.backends.gpu.cudnn_choices import Choice, EngineCache, engine_cache
from keel.backends.gpu.cudnn_lib import CudnnLibrary
from keel.dtypes import DType
from keel.ops.schemas.conv import ConvGeometry

__all__ = ["DTYPES", "Compiled", "ConvDescriptor", "Declined", "Fusion", "Signature", "built",
           "cannot_serve", "compiled", "describe", "fusions", "graph_activation", "leaves_out",
           "address", "pack"]

DTYPES = frozenset({DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16})
_RANKS = (1, 2, 3)          # spatial ranks: 1-D runs as 2-D with a unit height


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
        return f"cuDNN conv graphs here take float16, bfloat16 or float32, not {shown}"
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
class Signature:
    """Everything a built graph depends on."""

    desc: ConvDescriptor
    dtype: DType
    bias: bool
    residual: bool
    act: Activation
    device: int


@dataclass
class Compiled:
    """A built cuDNN graph for one signature and what a call binds into it."""

    graph: Any
    uids: dict[str, int]
    fusion: Fusion
    workspace: Any          # a CuPy uint8 buffer, kept as long as the graph
    engine: str             # the engine that runs, and how it was picked
    declined: tuple[str, ...] = ()      # the graphs cuDNN had no engine for

    def __post_init__(self) -> None:
        self.workspace_ptr = address(self.workspace)
        self.slots = tuple(self.uids.items())     # (array name, graph uid) per bound tensor


class Declined(Exception):
    """No cuDNN engine serves any graph of a signature (the reasons, one per graph)."""


# What runs after a graph that left part of act(conv + B + Z) out: (fusion, arrays by name).
After = Callable[[Fusion, dict[str, Any]], None]


def address(array: Any) -> int:
    """The device address of a CuPy array (a host array's address under a fake device)."""
    host = getattr(array, "__array_interface__", None)   # (no buffer of bfloat16 in NumPy)
    return int(host["data"][0]) if host is not None else int(array.data.ptr)


def _cudnn_type(cudnn: Any, dtype: DType) -> Any:
    if dtype is DType.FLOAT16:
        return cudnn.data_type.HALF
    return cudnn.data_type.BFLOAT16 if dtype is DType.BFLOAT16 else cudnn.data_type.FLOAT


def _graph(cudnn: Any, handle: Any, spec: Signature, fusion: Fusion) -> tuple[Any, dict[str, int]]:
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


def _planned(cudnn: Any, handle: Any, spec: Signature, fusion: Fusion
             ) -> tuple[Any, dict[str, int]]:
    """One graph validated and planned by cuDNN's heuristics (A, then FALLBACK), with the
    engines keel must not run filtered out; raises when cuDNN cannot serve it."""
    g, uids = _graph(cudnn, handle, spec, fusion)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    notes = [cudnn.numerical_note.NONDETERMINISTIC]    # keel's runs are bitwise repeatable
    if spec.dtype is DType.FLOAT32:
        # At float32 these notes mark the TF32 (or down-converting) engines: 10-bit
        # mantissas, far from float32 results. float16 and bfloat16 keep their
        # tensor-core engines.
        notes += [cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS]
    g.deselect_numeric_notes(notes)
    g.check_support()
    return g, uids


def _engine_name(g: Any, index: int) -> str:
    try:
        return str(g.get_plan_name_at_index(index))
    except Exception:
        return f"plan {index}"


# Timed runs per candidate, after one untimed run: engines differ by far more than the
# spread of three back-to-back runs of one.
_TIMED_RUNS = 3


def _timed(xp: Any, run: Callable[[], Any]) -> float:
    """Milliseconds per call of ``run`` on the current stream (after one untimed call)."""
    run()
    start, end = xp.cuda.Event(), xp.cuda.Event()
    start.record()
    for _ in range(_TIMED_RUNS):
        run()
    end.record()
    end.synchronize()
    return float(xp.cuda.get_elapsed_time(start, end)) / _TIMED_RUNS


def _engine_times(xp: Any, cudnn: Any, g: Any, handle: Any, bound: dict[int, int]
                  ) -> dict[int, float]:
    """Every plan of ``g`` built and timed on ``bound`` pointers: {plan index: ms}."""
    g.build_plans(cudnn.build_plan_policy.ALL)
    sizes = {}
    for i in range(int(g.get_execution_plan_count())):
        try:
            sizes[i] = int(g.get_workspace_size_plan_at_index(i))
        except Exception:             # not built (declined) or filtered out
            continue
    if not sizes:
        return {}
    workspace = xp.empty(max(*sizes.values(), 1), dtype=xp.uint8)
    ptr, times = address(workspace), {}
    for i in sizes:
        try:
            times[i] = _timed(xp, lambda i=i: g.execute_plan_at_index(  # type: ignore[misc]
                bound, ptr, index=i, handle=handle))
        except Exception:             # a plan that fails to run is not a candidate
            continue
    return times


@dataclass
class _Candidate:
    fusion: Fusion
    graph: Any
    uids: dict[str, int]
    index: int | None       # the plan to build (None: cuDNN's heuristic choice)
    ms: float = math.inf    # the graph's fastest engine plus what runs after it
    engines: int = 0        # how many engines were timed


def leaves_out(fusion: Fusion, spec: Signature) -> bool:
    """Whether part of ``spec``'s act(conv + B + Z) runs after a graph of ``fusion``."""
    return ((spec.bias and not fusion.bias) or (spec.residual and not fusion.residual)
            or (bool(spec.act[0]) and not fusion.activation))


def _measure(xp: Any, cudnn: Any, handle: Any, spec: Signature, cand: _Candidate,
             scratch: dict[str, Any], after: After) -> _Candidate:
    """``cand`` with its fastest engine and its time, what runs after the graph included."""
    times = _engine_times(xp, cudnn, cand.graph, handle, pack(cand.uids, scratch))
    if not times:
        raise Declined("no candidate engine ran")
    best = min(times, key=times.__getitem__)
    rest = leaves_out(cand.fusion, spec)
    extra = _timed(xp, lambda: after(cand.fusion, scratch)) if rest else 0.0
    return _Candidate(cand.fusion, cand.graph, cand.uids, best, times[best] + extra,
                      len(times))


def _capturing(xp: Any) -> bool:
    """Whether the current stream is being captured into a CUDA graph (nothing may be
    timed or synchronized then)."""
    probe = getattr(xp.cuda.get_current_stream(), "is_capturing", None)
    return bool(probe()) if probe is not None else False


def _compile(lib: CudnnLibrary, xp: Any, spec: Signature, arrays: dict[str, Any],
             after: After) -> Compiled:
    """The fastest graph and engine of ``spec`` measured on ``arrays`` (the first call's;
    Y replaced by a scratch buffer), or the most fused graph cuDNN serves when capturing."""
    cudnn = lib.module
    handle = lib.handle(spec.device)
    act_fusable = graph_activation(spec.act) is not None
    store, key = _store(lib, xp, spec.device), _key(spec)
    kept = _remembered(xp, cudnn, handle, spec, act_fusable, store, key)
    if kept is not None:
        return kept
    scratch = None if _capturing(xp) else {**arrays, "y": xp.empty_like(arrays["y"])}
    failures: list[str] = []
    best: _Candidate | None = None
    for fusion in fusions(spec.bias, spec.residual, act_fusable):
        try:
            cand = _Candidate(fusion, *_planned(cudnn, handle, spec, fusion), index=None)
            if scratch is None:
                cand.graph.build_plans()          # cuDNN's heuristic choice
            else:
                cand = _measure(xp, cudnn, handle, spec, cand, scratch, after)
        except Exception as exc:     # cuDNN declines this graph: try the next, shorter one
            failures.append(f"{fusion.describe()}: {type(exc).__name__}: {exc}")
            continue
        if best is None or cand.ms < best.ms:
            best = cand
        if scratch is None:
            break                    # not timed: the most fused graph cuDNN serves
    if best is None:
        raise Declined("; ".join(failures))
    found = _built(xp, best, failures)
    if store is not None and best.index is not None:
        store.put(key, Choice(best.fusion.describe(), best.index,
                              _engine_name(best.graph, best.index), best.ms))
    return found


# ---- choices measured by an earlier process (keel.backends.gpu.cudnn_choices) ----------
def _store(lib: CudnnLibrary, xp: Any, device: int) -> EngineCache | None:
    """The on-disk engine choices of this GPU and cuDNN, or None (caching off, or the GPU
    or library cannot be named: a choice must never cross to another)."""
    try:
        props = xp.cuda.runtime.getDeviceProperties(device)
        name = props["name"]
        identity = {"keel": _keel_version(), "cudnn": int(lib.module.backend_version()),
                    "frontend": str(getattr(lib.module, "__version__", "?")),
                    "gpu": name.decode() if isinstance(name, bytes) else str(name),
                    "capability": f"{props['major']}.{props['minor']}"}
    except Exception:
        return None
    return engine_cache(identity)


def _keel_version() -> str:
    from keel import __version__

    return __version__


def _key(spec: Signature) -> str:
    """``spec`` as text, without the device index (the cache file names the GPU)."""
    d = spec.desc
    return json.dumps([d.x, d.w, d.y, d.pre_padding, d.post_padding, d.stride, d.dilation,
                       spec.dtype.value, spec.bias, spec.residual,
                       spec.act[0], list(spec.act[1])])


def _remembered(xp: Any, cudnn: Any, handle: Any, spec: Signature, act_fusable: bool,
                store: EngineCache | None, key: str) -> Compiled | None:
    """The graph and engine an earlier process measured fastest for ``spec``, built alone;
    None where there is none, or cuDNN no longer ranks that engine at that index."""
    choice = store.get(key) if store is not None else None
    if store is None or choice is None:
        return None
    fusion = next((f for f in fusions(spec.bias, spec.residual, act_fusable)
                   if f.describe() == choice.fusion), None)
    if fusion is None:
        return None
    try:
        graph, uids = _planned(cudnn, handle, spec, fusion)
        if _engine_name(graph, choice.plan) != choice.engine:
            return None
        cand = _Candidate(fusion, graph, uids, choice.plan, choice.ms)
        return _built(xp, cand, [], how=(f"measured fastest earlier on this GPU "
                                         f"({choice.ms:.3f} ms), kept in {store.path}"))
    except Exception:                  # it no longer builds: measure again
        return None


def _built(xp: Any, best: _Candidate, failures: list[str], how: str = "") -> Compiled:
    g = best.graph
    if best.index is None:                        # built on cuDNN's heuristic choice
        index = int(getattr(g, "_plan_index", 0))
        how = "cuDNN's heuristic choice (not timed: first run captured)"
    else:
        index = best.index
        g.select_plan(index)
        g.build_plans()
        how = how or (f"fastest of {best.engines} engines and the fusions cuDNN serves, "
                      f"timed on first run: {best.ms:.3f} ms")
    workspace = xp.empty(max(int(g.get_workspace_size()), 1), dtype=xp.uint8)
    return Compiled(g, best.uids, best.fusion, workspace, f"{_engine_name(g, index)}, {how}",
                    tuple(failures))


def pack(uids: dict[str, int], arrays: dict[str, Any]) -> dict[int, int]:
    """The variant pack: each graph tensor's uid -> its array's device address."""
    return {uid: address(arrays[name]) for name, uid in uids.items()}


_LOCK = threading.Lock()
renew_after_fork(sys.modules[__name__], "_LOCK")   # free in a forked child
# (library, signature, thread) -> the built graph, or why cuDNN declined every graph of it.
_COMPILED: dict[tuple[CudnnLibrary, Signature, int], Compiled | Declined] = {}


def compiled(lib: CudnnLibrary, xp: Any, spec: Signature, arrays: dict[str, Any],
             after: After) -> Compiled | Declined:
    """The built graph of ``spec`` on this thread (built and measured on first use, then
    kept); ``arrays`` are the call's (by name: x, w, b, z, y), ``after`` what runs after a
    graph that leaves part of the epilogue out."""
    key = (lib, spec, threading.get_ident())
    found = _COMPILED.get(key)
    if found is None:
        with _LOCK:
            try:
                found = _compile(lib, xp, spec, arrays, after)
            except Declined as exc:
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
        if isinstance(found, Compiled):
            row.update(engine=found.engine, fused=found.fusion.describe(),
                       workspace_bytes=int(found.workspace.nbytes), declined=found.declined)
        else:
            row["declined"] = str(found)
        rows.append(row)
    return rows
