"""cpu kernels of the conv family, written once against ``ctx.xp``.

``conv`` has several variants, each registered with a :class:`ConvRule` (its
typed metadata, see :mod:`keel.backends.cpu.conv_rules`):

* ``im2col`` — any conv: the input is split into stride phases and flattened,
  so the column matrix fills with long contiguous copies, and one BLAS GEMM
  per chunk of images (per group) computes the output; small outputs in a
  batch stack their images into one wider GEMM (:mod:`~keel.backends.cpu.conv_gemm`).
* ``pointwise`` — 1x1 without padding: a plain GEMM on the input, no copy.
* ``depthwise`` — one input channel per group: per-channel gemv over shifted
  rows, or one channels-last ``einsum`` (:mod:`~keel.backends.cpu.depthwise`).
* ``winograd`` — 3x3 stride 1: F(2x2, 3x3) (:mod:`~keel.backends.cpu.winograd`),
  chosen where it measured faster than ``im2col`` (enough channels and tiles).
* ``native`` — an implicit GEMM on the native kernel (needs the native tier):
  the filters packed once, the taps gathered block by block from the
  zero-bordered image (no im2col matrix), bias, residual and ReLU/clip fused
  into the store of NCHW rows (:func:`~keel.backends.cpu.conv_gemm.native`);
  chosen up to 64 channels where it measured faster than the NumPy variants
  (0.53-0.85x their time on ResNet-20's convs). In ``benchmarks.run`` (1
  thread, keel / onnxruntime time): ResNet-20 2.45 -> 1.73 at batch 1 and
  1.99 -> 1.41 at batch 32, ResNet-18 1.17 -> 1.01 at batch 32.
* ``default`` — runs the variant its node plan names; called without a plan
  (or with shapes the plan could not know), the one the cpu planner
  (:mod:`~keel.backends.cpu.planner`) picks from the real shapes (``native``
  only where the native tier is available).

Every variant writes into ``out`` when given, folds the bias into its GEMM or
transform where it can, and moves its result into NCHW in one pass that also
adds the residual Z and applies the activation
(:func:`~keel.backends.cpu.conv_epilogue.finish`). Everything that follows
from the shapes is planned once per signature (:func:`_plan`); buffers and the
views of them are kept per thread (:func:`workspace.bound`); weights are
packed for their layout once per model through the ``prepack`` hook (or, for
frozen arrays outside a model, cached while they live). float16 is computed
in float32.

A model's node sees the same arrays every run, so the ``native`` variant's
whole computation is prepared once per node (:class:`_Ready`: the phase-image
copy as views, the kernel calls with their arguments converted) and a
steady-state call only checks that the arrays are the ones it was made for:
about 1-1.7 us of Python per call instead of 9 (LeNet's convs at batch 1, 1
thread: 9.6 and 11.4 us against 17.7 and 16.6, the C kernel 7.9 and 10.0).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, NodePlan, Out, optional_input
from keel.backends.bound import BoundCall, bare
from keel.backends.cpu import (
    conv_epilogue,
    conv_gemm,
    conv_pool,
    depthwise,
    native_blocked,
    native_gemm,
    planner,
    winograd,
    workspace,
)
from keel.backends.cpu.backend import ThreadCap
from keel.backends.cpu.conv_epilogue import Activation, activation
from keel.backends.cpu.conv_rules import ConvCase
from keel.backends.cpu.kernels import TABLE
from keel.backends.cpu.planner import REQUIRES, RULES, TIER_RULES, conv_call_variant
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.native.pointers import weak as _ref
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

__all__ = ["RULES"]




def _case(geo: ConvGeometry, dtype: str) -> ConvCase:
    win = geo.window
    return ConvCase(win.rank, win.kernel, win.strides, win.dilations, win.padded, geo.group,
                    geo.in_channels, geo.out_channels, win.out_spatial, geo.batch, dtype)


def _check_dtypes(op: Op, arrays: Sequence[Any]) -> DType:
    return _check_dtype_set(op, tuple(a.dtype for a in arrays if a is not None))


@functools.lru_cache(maxsize=256)
def _check_dtype_set(op: Op, dtypes: tuple[Any, ...]) -> DType:
    kinds = {DType.from_numpy(d) for d in dtypes}
    if len(kinds) != 1:
        raise InvalidArgumentError(
            f"{op.value} needs inputs of one dtype, got "
            f"{', '.join(sorted(d.value for d in kinds))}"
        )
    dtype = kinds.pop()
    if dtype not in DTYPES[op]:
        allowed = ", ".join(sorted(d.value for d in DTYPES[op]))
        raise InvalidArgumentError(f"{op.value} does not take {dtype.value}; allowed: {allowed}")
    return dtype


# ---- the variants --------------------------------------------------------------------
@dataclass(frozen=True)
class WinogradLayout:
    """What a Winograd conv runs from, as its plan's form gives it (planner.winograd_form;
    None: a call the planner did not see, the rules for this machine): ``chunk`` images
    at a time pass by pass, the products' tiles (``lanes``: the pipeline's and the tall
    ones, ``pass_lanes``: a chunk's wider products) and the ``pipeline`` option."""

    geo: ConvGeometry
    chunk: int | None
    lanes: bool | None
    pass_lanes: bool | None
    pipeline: tuple[int, ...] | None

    @property
    def pads(self) -> tuple[int, int]:
        return self.geo.window.pads_begin[0], self.geo.window.pads_begin[1]

    @property
    def out_hw(self) -> tuple[int, int]:
        return self.geo.window.out_spatial[0], self.geo.window.out_spatial[1]


def _winograd(xp: Any, layout: WinogradLayout, x: Any, w: Any, b: Any, z: Any, y: Any,
              act: Activation, packed: Any = None, threads: int = 1) -> None:
    """F(2x2, 3x3), in chunks of the planned images: the transforms compiled (bias, z and
    a clip in the output transform; the products in the planned tiles) where the native
    tier serves the arrays; else in NumPy, the bias in the transform, z and the
    activation in the last copy."""
    pads, out_hw, chunk = layout.pads, layout.out_hw, layout.chunk
    if xp is not np or not winograd.native_conv3x3(x, w, pads, out_hw, y, b, z, act, packed,
                                                   threads, chunk, layout.lanes,
                                                   layout.pass_lanes, layout.pipeline):
        winograd.conv3x3(xp, x, w, pads, out_hw, y, b, z, act, packed, chunk)


_IMPLS: dict[str, Callable[..., None]] = {
    "im2col": conv_gemm.im2col, "pointwise": conv_gemm.pointwise,
    "depthwise": depthwise.depthwise, "winograd": _winograd,
}


def _layout(variant: str, geo: ConvGeometry, has_bias: bool, form: planner.ConvForm) -> Any:
    """The shape-derived plan a variant runs from, in its planned ``form`` (computed
    once per signature)."""
    if variant == "im2col":
        return conv_gemm.im2col_layout(geo, form.layout.startswith("compact"),
                                       form.layout.endswith("-stacked"), form.chunk or 1)
    if variant == "pointwise":
        return conv_gemm.pointwise_layout(geo, has_bias, form.layout == "stacked")
    if variant == "depthwise":
        assert form.block is not None         # every depthwise form has its block
        return depthwise.depthwise_layout(geo, form.layout, form.block, form.reason,
                                          form.scheme)
    if variant == "native":
        return conv_gemm.native_layout(geo, form.layout, form.stream_stores, form.gemm_lanes,
                                       form.output_streams,
                                       blocked_residual=form.blocked_residual,
                                       step=form.chunk or 1, a16=form.gemm_a16,
                                       tail=form.gemm_tail)
    if variant == "winograd":
        return WinogradLayout(geo, form.chunk, form.lanes, form.pass_lanes, form.pipeline)
    return geo


def _form(node_plan: NodePlan | None, variant: str, geo: ConvGeometry,
          itemsize: int) -> planner.ConvForm:
    """The layout the node's plan gives ``variant``; without one (a call the planner
    did not see, or shapes it could not know), the planner's for these shapes."""
    if node_plan is not None and (node_plan.layout or node_plan.chunk is not None) and (
            variant in (node_plan.variant, node_plan.option("conv_variant"))):
        return planner.ConvForm(
            node_plan.layout, node_plan.reason("layout"), node_plan.chunk,
            node_plan.workspace_bytes,
            node_plan.option("depthwise_scheme", planner.DEPTHWISE_SCHEME),
            bool(node_plan.option("stream_stores", False)),
            node_plan.option("depthwise_block"), lanes=node_plan.option("winograd_lanes"),
            pass_lanes=node_plan.option("winograd_pass_lanes"),
            pipeline=node_plan.option("winograd_pipeline"),
            gemm_lanes=node_plan.option("gemm_lanes"),
            output_streams=bool(node_plan.option("output_streams", False)),
            gemm_a16=bool(node_plan.option("gemm_a16", False)),
            gemm_tail=node_plan.option("gemm_lanes_tail"),
            blocked_residual=node_plan.option("residual_layout") == planner.NCHWC)
    threads = node_plan.threads if node_plan is not None and node_plan.threads else 1
    return planner.conv_form(variant, geo, itemsize, threads=threads)


def _planned(node_plan: NodePlan | None) -> str:
    """The conv variant the node's plan runs (``default``: decided from the real shapes)."""
    if node_plan is None or node_plan.variant != "default":
        return "default" if node_plan is None else node_plan.variant
    return str(node_plan.option("conv_variant", "default"))


# ---- the kernels --------------------------------------------------------------------
def _target(xp: Any, out: Out, shape: tuple[int, ...], dtype: Any) -> Any:
    if out is not None and out[0] is not None:
        buf = out[0]
        if buf.dtype == dtype and buf.flags.c_contiguous and tuple(buf.shape) == shape:
            return buf
    return xp.empty(shape, dtype=dtype)


@dataclass(frozen=True)
class _Plan:
    """Everything about a conv call that follows from shapes, dtypes and attributes."""

    geo: ConvGeometry
    variant: str
    layout: Any             # the variant's shape-derived plan
    act: Activation
    dtype: DType
    out_dtype: Any          # the NumPy dtype of the output
    compute: Any            # the NumPy dtype computed in (float32 for float16)


@functools.lru_cache(maxsize=512)
def _plan(op: Op, variant: str, node_plan: NodePlan | None, backend: str,
          shapes: tuple[tuple[int, ...] | None, ...], dtypes: tuple[Any, ...],
          attrs_key: tuple[tuple[str, Any], ...]) -> _Plan:
    """Check and resolve one conv signature as its node plan says (cached: a steady
    state pays a lookup)."""
    attrs = dict(attrs_key)
    dtype = _check_dtype_set(op, dtypes)
    x, w, b, z = shapes
    assert x is not None and w is not None   # always given
    geo = conv_geometry(op, x, w, attrs)
    check_conv_extras(op, geo.out_shape, b, z)
    case = _case(geo, dtype.value)
    if variant == "default":
        variant = _planned(node_plan)
    if variant == "default":        # no plan decided it: the planner, from these shapes
        threads = node_plan.threads if node_plan is not None and node_plan.threads else 1
        variant, _ = conv_call_variant(case, threads)
    else:
        why_not = RULES[variant].cannot_serve(case)   # a named variant runs where it can
        if why_not is not None:
            raise UnsupportedOperationError(op.value, backend,
                                            detail=f"variant {variant!r}: {why_not}")
    compute = np.dtype(np.float32) if dtype is DType.FLOAT16 else dtype.numpy
    act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    layout = _layout(variant, geo, b is not None,
                     _form(node_plan, variant, geo, compute.itemsize))
    return _Plan(geo, variant, layout, act, dtype, dtype.numpy, compute)


# Steady-state lookup: (variant, shapes, dtypes, backend, id(attrs), id(node plan)) ->
# (attrs, node plan, plan). The attrs and the node plan are kept in the entry, so their
# ids cannot be reused while it is there.
_FAST: dict[tuple[Any, ...], tuple[Attrs, NodePlan | None, _Plan]] = {}
_FAST_LIMIT = 1024


def _lookup(op: Op, variant: str, backend: str, x: Any, w: Any, b: Any, z: Any,
            attrs: Attrs, node_plan: NodePlan | None = None) -> _Plan:
    key = (op, variant, backend, x.shape, w.shape, x.dtype, w.dtype, id(attrs), id(node_plan),
           None if b is None else (b.shape, b.dtype), None if z is None else (z.shape, z.dtype))
    hit = _FAST.get(key)
    if hit is not None and hit[0] is attrs and hit[1] is node_plan:
        return hit[2]
    arrays = (x, w, b, z)
    plan = _plan(op, variant, node_plan, backend,
                 tuple(None if a is None else tuple(a.shape) for a in arrays),
                 tuple(a.dtype for a in arrays if a is not None), tuple(attrs.items()))
    if len(_FAST) >= _FAST_LIMIT:
        _FAST.clear()
    _FAST[key] = (attrs, node_plan, plan)
    return plan


def _run(ctx: KernelContext, op: Op, variant: str, x: Any, w: Any, b: Any, z: Any,
         attrs: Attrs, out: Out) -> list[Any]:
    """Check, choose the variant, compute in float32/64, apply the epilogue."""
    xp = ctx.xp
    plan = _lookup(op, variant, ctx.backend, x, w, b, z, attrs, ctx.plan)
    packed = ctx.prepacked
    if plan.dtype is DType.FLOAT16:
        x, w, b, z = (None if a is None else a.astype(plan.compute) for a in (x, w, b, z))
        packed = None
    y = _target(xp, out, plan.geo.out_shape, plan.compute)
    if plan.variant == "depthwise":
        depthwise.depthwise(xp, plan.layout, x, w, b, z, y, plan.act, packed, ctx.threads or 1)
        if isinstance(packed, _State) and out is not None and out[0] is y:
            # The call the native form bound: the node's next runs skip the plan lookup.
            run = depthwise.node_run(variant, attrs, x, y, z)
            if run is not None:
                if len(packed.ready) >= _READY_PER_NODE:
                    packed.ready.clear()
                packed.ready[(id(y), id(z), threading.get_ident())] = run
    elif plan.variant == "winograd":
        _winograd(xp, plan.layout, x, w, b, z, y, plan.act, packed, ctx.threads or 1)
    elif plan.variant != "native":
        _IMPLS[plan.variant](xp, plan.layout, x, w, b, z, y, plan.act, packed)
    elif not _native(xp, plan, variant, x, w, b, z, y, attrs, out, packed, ctx.threads or 1):
        # Not served here (the gpu backend, the native tier gone): the NumPy im2col,
        # between layout changes where the plan keeps a side channel-blocked.
        sides = plan.layout.sides
        x, z = (native_blocked.to_nchw(a) if a is not None and blocked else a
                for a, blocked in ((x, sides.x), (z, sides.residual)))
        fallback = _lookup(op, "im2col", ctx.backend, x, w, b, z, attrs)
        result = np.empty_like(y) if sides.y else y
        with ThreadCap(ctx.threads or 1) if xp is np else contextlib.nullcontext():
            _IMPLS["im2col"](xp, fallback.layout, x, w, b, z, result, plan.act, packed)
        if sides.y:
            native_blocked.to_blocked(result, y)
    if out is not None and out[0] is not None and out[0] is not y:
        out[0][...] = y
        return [out[0]]
    return [y.astype(plan.out_dtype, copy=False)]


# ---- the native path, prepared once per node ------------------------------------------
class _State(workspace.Packed):
    """A conv node's prepack state: its constants, their packed forms, and the node's
    prepared native runs (:class:`_Ready`) by (id(Y), id(Z), thread)."""

    def __init__(self, arrays: tuple[Any, ...]) -> None:
        super().__init__(arrays)
        # Prepared runs: this module's _Ready, or the depthwise form's NodeRun (same
        # serves/run interface).
        self.ready: dict[tuple[int, int, int], _Ready | depthwise.NodeRun] = {}
        # The run last prepared by (id(Z), thread), moved to each new Y of its layout:
        # a model's output is a fresh array every run (:meth:`_Ready.moved`).
        self.moving: dict[tuple[int, int], _Ready] = {}


_READY_PER_NODE = 8


class _Ready:
    """One conv node's native computation, prepared for the arrays it runs on.

    A model calls a node with the same arena views every run, so everything the
    slow path derives per call (the plan lookup, the packed filters, the phase
    image, the kernel's argument blocks) is done once: a steady-state run copies
    X into the zero-bordered image through views made once and runs the
    prepared kernel calls. A copied X may be any array of X's shape and dtype
    (a model's input is the caller's array); one read in place must be the
    same object. The phase image belongs to the thread that prepared it.
    """

    __slots__ = ("act", "attrs", "b", "calls", "copy", "fills", "finish", "go", "layout",
                 "rebind", "source", "threads", "variant", "w", "x_address", "x_dtype",
                 "x_ref", "x_shape", "y_address", "y_layout", "y_ref", "z_ref")

    def __init__(self, variant: str, attrs: Attrs, x: Any, w: Any, b: Any, z: Any, y: Any,
                 act: Activation, calls: Sequence[conv_gemm.NativeCall],
                 fills: tuple[tuple[Any, Any], ...] | None, rebind: bool = False,
                 layout: conv_gemm.NativeLayout | None = None, source: Any = None) -> None:
        self.variant, self.attrs, self.w, self.b = variant, attrs, w, b
        # rebind: the calls read X where it lies and take each run's X (a model input).
        self.rebind, self.x_address = rebind, native_gemm.address(x)
        self.x_ref = None if fills is not None or rebind else weakref.ref(x)
        self.x_shape, self.x_dtype = x.shape, x.dtype
        self.y_ref, self.z_ref = weakref.ref(y), _ref(z)
        self.y_address, self.y_layout = native_gemm.address(y), (y.shape, y.strides, y.dtype)
        self.calls, self.fills, self.act = tuple(calls), fills, act
        self.finish = act[0] not in ("", "clip")
        self.threads = 0                # the thread count the calls in ``go`` were bound for
        self.go: tuple[Callable[[], Any], ...] = ()
        # The phase image's copy on keel's threads: the layout and image it fills, and
        # the bound copy with the X address and thread count it was bound for.
        self.layout, self.source = layout, source
        self.copy: tuple[int, int, Callable[[], Any] | None] = (0, 0, None)

    def serves(self, variant: str, x: Any, w: Any, b: Any, z: Any, y: Any,
               attrs: Attrs) -> bool:
        """Whether this is the computation of these arrays (Y and Z are the key's)."""
        return self.y_ref() is y and self.serves_inputs(variant, x, w, b, z, attrs)

    def serves_inputs(self, variant: str, x: Any, w: Any, b: Any, z: Any,
                      attrs: Attrs) -> bool:
        """Whether this is the computation of these inputs, whatever its Y (what a run
        moved to a new Y must check before the move)."""
        if (self.attrs is not attrs or self.w is not w or self.b is not b
                or self.variant != variant or self.z_ref() is not z):
            return False
        if self.x_ref is not None:
            return self.x_ref() is x
        return x.shape == self.x_shape and x.dtype == self.x_dtype and (
            not self.rebind or x.flags.c_contiguous)

    def moved(self, x: Any, y: Any, z: Any) -> _Ready | None:
        """This run writing into ``y`` instead: the calls' output addresses moved, nothing
        prepared again (~45 us less than preparing a 1x1 conv's run afresh). None unless
        ``y`` is C-contiguous, has the layout of the Y it was prepared for and overlaps
        neither X, Z nor the phase image."""
        if ((y.shape, y.strides, y.dtype) != self.y_layout or not y.flags.c_contiguous
                or np.may_share_memory(y, x) or (z is not None and np.may_share_memory(y, z))
                or (self.source is not None and np.may_share_memory(y, self.source))):
            return None
        lo, delta = self.y_address, native_gemm.address(y) - self.y_address
        again = copy.copy(self)
        again.y_ref = weakref.ref(y)
        if delta:
            again.calls = tuple(call.moved(lo, lo + y.nbytes, delta) for call in self.calls)
            again.y_address = lo + delta
            again.threads, again.go = 0, ()
        # else: a new array in the old one's place (the allocator hands a freed output's
        # bytes to the next one of its size): the calls and their bound forms stand.
        return again

    def run(self, x: Any, y: Any, threads: int) -> None:
        if self.rebind and native_gemm.address(x) != self.x_address:
            calls = []
            for call in self.calls:
                again = None if isinstance(call, native_gemm.Call) else call.with_x(x)
                if again is None:       # serves() checked X: not reached
                    raise ValueError("a conv reading X in place needs a C-contiguous "
                                     "float32 X")
                calls.append(again)
            self.calls, self.x_address, self.threads = tuple(calls), native_gemm.address(x), 0
        if self.fills is not None and not self._copy_phases(x, threads):
            for dst, src in self.fills:
                dst[...] = x if src is None else x[src]
        if threads != self.threads:
            self.go = tuple(call.bound(threads) for call in self.calls)
            self.threads = threads
        for go in self.go:
            go()
        if self.finish:
            conv_epilogue.finish(np, y, y, None, self.act)

    def _copy_phases(self, x: Any, threads: int) -> bool:
        """X into the phase image on keel's threads; False where the copy is NumPy's."""
        address = native_gemm.address(x)
        if self.copy[:2] != (address, threads):
            bound = None if self.layout is None else conv_gemm.bind_phase_copy(
                self.layout, x, self.source, threads)
            self.copy = (address, threads, bound)
        go = self.copy[2]
        if go is None:
            return False
        go()
        return True


def _native(xp: Any, plan: _Plan, variant: str, x: Any, w: Any, b: Any, z: Any, y: Any,
            attrs: Attrs, out: Out, packed: Any, threads: int) -> bool:
    """The native implicit GEMM; False when not served (nothing written then). When
    ``y`` is the caller's ``out`` and ``packed`` the node's state, the computation is
    prepared once for these arrays (:class:`_Ready`) and run from there."""
    if not (isinstance(packed, _State) and out is not None and out[0] is y and xp is np
            and x.dtype == np.float32 and y.dtype == np.float32
            and native_gemm.available()):
        return conv_gemm.native(xp, plan.layout, x, w, b, z, y, plan.act, packed, threads)
    ready = _prepare_native(plan, variant, x, w, b, z, y, attrs, packed)
    if ready is None:
        return conv_gemm.native(xp, plan.layout, x, w, b, z, y, plan.act, packed, threads)
    key = (id(y), id(z), threading.get_ident())
    if len(packed.ready) >= _READY_PER_NODE:
        packed.ready.clear()
    packed.ready[key] = ready
    if len(packed.moving) >= _READY_PER_NODE:
        packed.moving.clear()
    packed.moving[key[1:]] = ready
    ready.run(x, y, threads)
    return True


def _prepare_native(plan: _Plan, variant: str, x: Any, w: Any, b: Any, z: Any, y: Any,
                    attrs: Attrs, packed: _State) -> _Ready | None:
    """The prepared native computation of these arrays; None when not served."""
    layout = plan.layout
    if layout.images or (layout.blocked and not conv_gemm.blocked_serves(layout.geo)):
        return None     # image by image (conv_gemm keeps its own steps), or not served
    filters = conv_gemm.layout_filters(np, layout, packed, w, b)
    if not conv_gemm.residual_in_place(z, y):
        return None                     # the kernel would add a copy of Z made now
    source = conv_gemm.native_source(np, layout, x)
    if not layout.copied and source is not x:
        return None                     # a contiguous copy of X, made afresh each call
    calls = conv_gemm.native_calls(layout, source, x, filters, z, y, plan.act)
    if calls is None:
        return None
    fills = None
    if layout.copied:
        fills = tuple(_fill(source, f, dst, src, x.shape[2:])
                      for f, (dst, src) in enumerate(layout.fills))
    return _Ready(variant, attrs, x, w, b, z, y, plan.act, calls, fills, layout.reads_x,
                  layout if layout.copied else None, source if layout.copied else None)


def _fill(source: Any, phase: int, dst: tuple[slice, ...], src: tuple[slice, ...],
          dims: Sequence[int]) -> tuple[Any, Any]:
    """(the view of ``source``'s phase that X's elements go to, the index of those
    elements in X, or None for all of X)."""
    every = (slice(None), slice(None))
    dst_index: tuple[Any, ...] = (phase, *every, *dst)
    src_index: tuple[slice, ...] = (*every, *src)
    return source[dst_index], None if _whole(src, dims) else src_index


def _whole(index: Sequence[slice], dims: Sequence[int]) -> bool:
    """Whether ``index`` (one slice per dim) takes all of dims ``dims``."""
    return all(s.indices(d) == (0, d, 1) for s, d in zip(index, dims, strict=True))


def _prepack(ctx: KernelContext, consts: Sequence[Any], attrs: Attrs) -> Any:
    """The conv's constant W and B; the forms each layout needs are made on first use."""
    w = consts[1] if len(consts) > 1 else None
    if w is None:
        return None
    return _State((w, consts[2] if len(consts) > 2 else None))


def _conv_variant(variant: str) -> Callable[[KernelContext, Inputs, Attrs, Out], list[Any]]:
    get_ident = threading.get_ident

    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        state = ctx.prepacked
        z = inputs[3] if len(inputs) > 3 else None
        if (out is not None and ctx.plan is not None and ctx.plan.option("pooled_by")
                and _handed_over(ctx, variant, inputs, attrs, out[0])):
            return [out[0]]
        if out is not None and state.__class__ is _State:
            # The steady state of a model's node: its prepared native computation.
            y = out[0]
            ready = state.ready.get((id(y), id(z), get_ident()))
            x, w = inputs[0], inputs[1]
            b = inputs[2] if len(inputs) > 2 else None
            if ready is not None and ready.serves(variant, x, w, b, z, y, attrs):
                ready.run(x, y, ctx.threads or 1)
                return [y]
            if y is not None and _run_moved(state, variant, x, w, b, z, y, attrs,
                                            ctx.threads or 1):
                return [y]
        return _run(ctx, Op.CONV, variant, inputs[0], inputs[1], optional_input(inputs, 2),
                    z, attrs, out)
    kernel.__doc__ = RULES[variant].summary if variant in RULES else "dispatching conv"
    return kernel


def _handed_over(ctx: KernelContext, variant: str, inputs: Inputs, attrs: Attrs, y: Any
                 ) -> bool:
    """Whether the pool the planner pools this conv with takes it over this run
    (conv_pool.hand_over): the conv then computes nothing."""
    x, w = inputs[0], inputs[1]
    b, z = optional_input(inputs, 2), inputs[3] if len(inputs) > 3 else None

    def band_of() -> native_gemm.BandCall | None:
        if ctx.prepacked.__class__ is not _State:
            return None
        plan = _lookup(Op.CONV, variant, ctx.backend, x, w, b, z, attrs, ctx.plan)
        if plan.variant != "native" or y.shape != plan.geo.out_shape:
            return None
        return _pooled_band(plan, x, w, b, z, y, ctx.prepacked)

    return conv_pool.hand_over(x, y, band_of)


def _run_moved(state: _State, variant: str, x: Any, w: Any, b: Any, z: Any, y: Any,
               attrs: Attrs, threads: int) -> bool:
    """Run the node's last prepared computation moved to a new Y (a model's output, a
    fresh array every run); False when there is none or it does not serve these arrays."""
    key = (id(z), threading.get_ident())
    last = state.moving.get(key)
    if (last is None or type(y) is not np.ndarray
            or not last.serves_inputs(variant, x, w, b, z, attrs)):
        return False
    ready = last.moved(x, y, z)             # copies the calls: only for a run it serves
    if ready is None:
        return False
    state.moving[key] = ready
    ready.run(x, y, threads)
    return True


def _bind_conv(variant: str, ctx: KernelContext, inputs: Inputs, attrs: Attrs,
               out: Sequence[Any]) -> Callable[[], Any] | None:
    """The node's prepared native computation (:class:`_Ready`, or the depthwise form's
    native call) bound for one program step: what the kernel prepares on its first run
    and then finds by its arrays on every run, called directly; None where neither the
    native implicit GEMM nor the native depthwise kernel serves these arrays (the kernel
    then runs as usual)."""
    state = ctx.prepacked
    x, w = inputs[0], inputs[1]
    b = optional_input(inputs, 2)
    z = inputs[3] if len(inputs) > 3 else None
    if (state.__class__ is not _State or ctx.xp is not np or len(out) != 1
            or type(x) is not np.ndarray or type(out[0]) is not np.ndarray):
        return None
    y = out[0]
    plan = _lookup(Op.CONV, variant, ctx.backend, x, w, b, z, attrs, ctx.plan)
    if y.shape != plan.geo.out_shape:
        return None
    if plan.variant == "depthwise":
        return depthwise.bind(plan.layout, x, w, b, z, y, plan.act, ctx.threads or 1)
    if plan.variant == "winograd":
        return _bind_winograd(plan, x, w, b, z, y, state, ctx.threads or 1)
    if (plan.variant != "native" or plan.dtype is DType.FLOAT16
            or x.dtype != np.float32 or y.dtype != np.float32 or not native_gemm.available()):
        return None
    ready = _prepare_native(plan, variant, x, w, b, z, y, attrs, state)
    if ready is None:
        return None
    if ctx.plan is not None and ctx.plan.option("pooled_by") is not None:
        call = functools.partial(ready.run, x, y, ctx.threads or 1)
        step = conv_pool.ConvStep(call, x, y, functools.partial(_pooled_band, plan, x, w, b,
                                                                z, y, state))
        # C only where the conv's own run is (the pool's fused call is C either way)
        native = _c_only(ready, x, ctx.threads or 1)
        return BoundCall(step, native=native,
                         reading=functools.partial(_conv_step_reading, step, native))
    return _native_step(ready, x, ctx.threads or 1) or functools.partial(
        ready.run, x, y, ctx.threads or 1)


def _c_only(ready: _Ready, x: Any, threads: int) -> bool:
    """Whether ``ready``'s run of ``x`` is C code only: its kernel calls, after X's copy
    into the phase image on keel's threads where it has one (no copy or activation pass
    of NumPy's)."""
    return not ready.finish and (ready.fills is None or (
        ready.layout is not None
        and conv_gemm.bind_phase_copy(ready.layout, x, ready.source, threads) is not None))


def _native_step(ready: _Ready, x: Any, threads: int) -> BoundCall | None:
    """``ready``'s run as a step marked ``native`` where it is its kernel calls alone,
    after X's copy into the phase image where it has one, on keel's threads (the window
    kernels' copy, as :meth:`_Ready.run` makes it): C code only, no copy or activation
    pass of NumPy's. Its X bound (a step's X stays put, so the run never rebinds it);
    None otherwise."""
    if ready.finish:
        return None
    copy: tuple[Callable[[], Any], ...] = ()
    if ready.fills is not None:
        phases = None if ready.layout is None else conv_gemm.bind_phase_copy(
            ready.layout, x, ready.source, threads)
        if phases is None:
            return None         # the copy is NumPy's
        copy = (phases,)
    bound = tuple(call.bound(threads) for call in ready.calls)
    go = (*copy, *(bare(call) for call in bound))
    reading = None
    if not copy and len(ready.calls) == 1 and isinstance(ready.calls[0], native_gemm.BandCall):
        reading = functools.partial(_band_reading, ready, ready.calls[0], threads)
    return BoundCall(go[0] if len(go) == 1 else functools.partial(_each, go),
                     keep=(ready, *copy, *bound), native=True, reading=reading)


def _conv_step_reading(step: conv_pool.ConvStep, native: bool, buffer: Any
                       ) -> BoundCall | None:
    """A pooled conv's step as one whose X its ``point`` moves (a feed read where the
    caller has it: the cpu planner's ``FEED_IN_PLACE_MOST_BYTES``); None where the
    step does not read ``buffer``."""
    moving = step.reading(buffer)
    return None if moving is None else BoundCall(moving, native=native, point=moving.point)


def _band_reading(ready: _Ready, band: native_gemm.BandCall, threads: int, buffer: Any
                  ) -> BoundCall | None:
    """The band conv's step as a call whose X its ``point`` moves (a feed read where the
    caller has it: the cpu planner's ``FEED_IN_PLACE_MOST_BYTES``); None where the conv
    does not read ``buffer`` itself."""
    moving = band.bound_reading(threads, buffer)
    return None if moving is None else dataclasses.replace(
        moving, keep=(ready, *moving.keep))


def _each(calls: tuple[Callable[[], Any], ...]) -> None:
    for call in calls:
        call()


def _pooled_band(plan: _Plan, x: Any, w: Any, b: Any, z: Any, y: Any, state: _State
                 ) -> native_gemm.BandCall | None:
    """The conv as a band conv (gemm.c's keel_conv_band_f32: the same sums, so the same
    bits as any native form), for the max pool that the planner pools it with
    (conv_pool); None where the band conv does not serve it."""
    layout = plan.layout
    if not isinstance(layout, conv_gemm.NativeLayout):
        return None
    win = layout.geo.window
    if (z is not None or plan.act[0] not in ("", "clip") or layout.blocked
            or layout.geo.group != 1 or win.rank != 2):
        return None
    ((wp, bias),) = conv_gemm.layout_filters(np, layout, state, w, b)
    clip = (plan.act[1][0], plan.act[1][1]) if plan.act[0] == "clip" else None
    return native_gemm.prepare_band(x, wp, y, win.kernel, win.strides, win.dilations,
                                    win.pads_begin, bias=bias, clip=clip)


def _bind_winograd(plan: _Plan, x: Any, w: Any, b: Any, z: Any, y: Any, state: _State,
                   threads: int) -> Callable[[], Any] | None:
    """The Winograd form's native calls bound to these arrays (as :func:`_winograd`
    runs them: the per-thread pipeline, or pass by pass); None where it runs otherwise."""
    layout: WinogradLayout = plan.layout
    return winograd.bind_conv3x3(x, w, layout.pads, layout.out_hw, y, b, z, plan.act,
                                 state, threads, layout.lanes, layout.pipeline,
                                 layout.chunk, layout.pass_lanes)


for _name, _rule in RULES.items():
    TABLE.kernel(Op.CONV, variant=_name, dtypes=DTYPES[Op.CONV], supports_out=True,
                 bind=functools.partial(_bind_conv, _name),
                 description=_rule.summary, prepack=_prepack, rule=_rule,
                 priority=_rule.priority, simd=(), measured=_rule.measured,
                 requires=REQUIRES.get(_name),
                 tier_rules=TIER_RULES.get(_name, {}))(_conv_variant(_name))

TABLE.kernel(Op.CONV, dtypes=DTYPES[Op.CONV], supports_out=True, prepack=_prepack,
             description="picks winograd, pointwise, depthwise or im2col by the conv rules",
             dispatcher=True)(_conv_variant("default"))


@TABLE.kernel(Op.CONV2D, dtypes=DTYPES[Op.CONV2D], supports_out=True, dispatcher=True)
def conv2d(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Seed-001 conv2d (NCHW, OIHW, no bias) through the conv variants."""
    x, w = inputs
    if x.ndim != 4:
        raise InvalidArgumentError(f"conv2d: X must be (N, C, H, W), got shape {x.shape}")
    return _run(ctx, Op.CONV2D, "default", x, w, None, None, _conv2d_attrs(attrs), out)


def _conv2d_attrs(attrs: Attrs) -> dict[str, Any]:
    return dict(_conv2d_attrs_cached(tuple(attrs.items())))


@functools.lru_cache(maxsize=256)
def _conv2d_attrs_cached(key: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    return tuple(conv2d_attrs(dict(key)).items())


# ---- conv_integer -----------------------------------------------------------------
@TABLE.kernel(Op.CONV_INTEGER, dtypes=DTYPES[Op.CONV_INTEGER], supports_out=True)
def conv_integer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Exact integer conv through the float variants (float32 while sums stay < 2^24)."""
    xp = ctx.xp
    x, w, xzp, wzp = inputs[0], inputs[1], optional_input(inputs, 2), optional_input(inputs, 3)
    for a in inputs:
        if a is not None:
            _check_dtypes(Op.CONV_INTEGER, [a])
    geo = conv_geometry(Op.CONV_INTEGER, x.shape, w.shape, attrs)
    terms = (geo.in_channels // geo.group) * math.prod(geo.window.kernel)
    # |x - zp| and |w - zp| are at most 255: every partial sum is exact in float32
    # while terms * 255 * 255 < 2**24.
    ft = xp.float32 if terms * 255 * 255 < 2**24 else xp.float64
    xf = x.astype(ft)
    wf = w.astype(ft)
    if xzp is not None:
        check_zero_point(Op.CONV_INTEGER, "x_zero_point", xzp.shape, 1)
        xf -= xzp.reshape(-1)[:1].astype(ft)
    if wzp is not None:
        check_zero_point(Op.CONV_INTEGER, "w_zero_point", wzp.shape, w.shape[0])
        xp.subtract(wf, wzp.astype(ft).reshape(-1, *([1] * (w.ndim - 1))), out=wf)
    variant = planner.exact_conv_variant(_case(geo, str(np.dtype(ft))))
    yf = xp.empty(geo.out_shape, dtype=ft)
    layout = _layout(variant, geo, False, _form(None, variant, geo, np.dtype(ft).itemsize))
    _IMPLS[variant](xp, layout, xf, wf, None, None, yf, activation("", ()), None)
    result = xp.rint(yf).astype(xp.int64).astype(xp.int32)
    if out is not None and out[0] is not None:
        out[0][...] = result
        return [out[0]]
    return [result]


# ---- conv_transpose ------------------------------------------------------------------
@TABLE.kernel(Op.CONV_TRANSPOSE, dtypes=DTYPES[Op.CONV_TRANSPOSE], supports_out=True)
def conv_transpose(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """GEMM W^T @ X per group into columns, then col2im: one strided add per kernel tap."""
    xp = ctx.xp
    x, w, b = inputs[0], inputs[1], optional_input(inputs, 2)
    dtype = _check_dtypes(Op.CONV_TRANSPOSE, [x, w, b])
    geo = conv_transpose_geometry(x.shape, w.shape, attrs)
    if b is not None and tuple(b.shape) != (geo.out_channels,):
        raise InvalidArgumentError(
            f"conv_transpose: B must have shape ({geo.out_channels},), got {tuple(b.shape)}"
        )
    compute = xp.float32 if dtype is DType.FLOAT16 else dtype.numpy
    x, w = x.astype(compute, copy=False), w.astype(compute, copy=False)
    n, c, g = geo.batch, geo.in_channels, geo.group
    mg, k = geo.out_channels // g, math.prod(geo.kernel)
    p = math.prod(geo.in_spatial)
    wt = w.reshape(g, c // g, mg * k).transpose(0, 2, 1)           # (G, Mg*K, Cg)
    cols = xp.matmul(wt, x.reshape(n, g, c // g, p))              # (N, G, Mg*K, P)
    cols = cols.reshape(n, g * mg, *geo.kernel, *geo.in_spatial)
    full = tuple(b0 + o + e for b0, o, e in
                 zip(geo.pads_begin, geo.out_spatial, geo.pads_end, strict=True))
    y = xp.zeros((n, geo.out_channels, *full), dtype=compute)
    for offs in itertools.product(*(range(kk) for kk in geo.kernel)):
        taps = tuple(slice(o * d, o * d + (i - 1) * s + 1, s) for o, d, s, i in
                     zip(offs, geo.dilations, geo.strides, geo.in_spatial, strict=True))
        dst_index: tuple[slice, ...] = (slice(None), slice(None), *taps)
        src_index: tuple[Any, ...] = (slice(None), slice(None), *offs)
        dst = y[dst_index]
        xp.add(dst, cols[src_index], out=dst)
    crop = tuple(slice(pb, pb + o) for pb, o in zip(geo.pads_begin, geo.out_spatial,
                                                     strict=True))
    crop_index: tuple[slice, ...] = (slice(None), slice(None), *crop)
    result = y[crop_index]
    target = out[0] if out is not None and out[0] is not None else xp.empty(
        geo.out_shape, dtype=dtype.numpy)
    target[...] = result
    if b is not None:
        xp.add(target, b.astype(target.dtype).reshape(1, -1, *([1] * len(full))), out=target)
    return [target]
