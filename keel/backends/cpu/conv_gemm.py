"""GEMM convolutions: wide im2col for any conv, and 1x1 convs as a plain GEMM.

Wide im2col
-----------
The padded input is split into stride phases and flattened
(:mod:`keel.backends.cpu.window`): within a phase, the kernel tap at offset
``k`` of *every* output position of one (image, channel) plane is a single
contiguous run of ``L`` elements, where ``L`` spans the output rows at the
phase image's row stride (a few garbage columns per row: the "wide" layout).
The column matrix therefore fills with long contiguous copies (one strided
copy per phase, whatever the kernel size) instead of one short row per output
row, and the GEMM writes ``(M, L)`` wide rows that are moved into NCHW by the
epilogue's single pass (:func:`conv_epilogue.finish`), together with the
residual add or the activation. The bias rides in the GEMM as a column of W
against a row of ones in the column matrix.

Measured on the 2-core AMD EPYC (1 thread, OpenBLAS) for a 16->16 3x3 conv on
32x32: the copy of the column matrix takes 10 us wide against 28 us with
32-element rows, and the GEMM 66 us with ``L = 1086`` against 107 us for the
1024 columns of the plain layout (a 4 KiB row stride makes the packed panels
collide in cache).

Small outputs (late layers) in a batch stack their images side by side in one
GEMM (``stacked``), whose columns would otherwise be too few for BLAS to run
at speed.

Native implicit GEMM
--------------------
With the native GEMM (:mod:`keel.backends.cpu.native_gemm`) no column matrix
is built at all: B's rows are the taps of every input channel and its
columns the output pixels, addressed by two tables of offsets into X (or into
its zero-bordered, stride-phase-split copy); the kernel gathers each block of
B into its packed panels as it goes (or reads a panel in place when it is one
run of an image row), and writes Y's NCHW rows with the bias, residual and
ReLU fused in. Measured on a 16->16 3x3 conv on 32x32 at batch 32 (1 thread):
1.80 ms against 3.21 ms for the wide im2col above and 1.71 ms for onnxruntime.

A stride-1 2-D conv may instead read B through a per-tap offset table from a
zero-bordered copy of X whose image rows share their padding (``Wide``; XNNPACK's
indirection in spirit): every tap is one contiguous run of "wide" columns, read
in place with no gather, and the store drops the garbage columns by masked
moves. It is chosen where measured faster (the cpu planner's wide rule): 0.88x the
gathered time on ResNet-20's 32->32 3x3 layers on 16x16 (onnxruntime 0.82x at
batch 1, 0.84x at batch 32 of the wide time) and 0.85x on LeNet's first conv.

Where every tap of a 2-D conv reads a plane of the output's own shape (X itself
for a stride-1 conv whose output is as large as its input, or X split into
unbordered stride phases), the kernel reads the taps in place through lane
masks instead (``Masked``, gemm.c's KEEL_DIRECT): no zero-bordered copy, no
gather or packing of B, no garbage columns. Measured at batch 32 (1 thread,
prepared calls, interleaved medians) against the gathered or wide layout:
0.86x on 64->64 3x3 on 8x8, 0.90x on 32->32 on 16x16, 0.82x / 0.91x on the
stride-2 3x3 convs of ResNet-20, 0.93x on 3->16 on 32x32, 1.02x on 16->16 on
32x32 alone (faster inside the model, where X comes from memory), 0.67-0.91x
on 8 and 16 channels at 16x16 and 32x32; ResNet-20 at batch 32 30.2 -> 27.5 ms
(onnxruntime 22.4). Strided convs on large images keep the gathered layout
(the cpu planner's masked rule).

A 1x1 stride-1 conv reads X in place as B (``direct``); the kernel runs it row
panel by row panel over wide column blocks, so Y's rows stream out in long runs
with the bias and ReLU6 on the store, and at batch B streams from memory (packed
in long runs, the next block prefetched). Small images at batch (7x7) stack
instead. Measured on MobileNetV2's 1x1 layers at batch 32 (1 thread, against
the OpenBLAS ``pointwise`` variant): 0.77x on 16->96 at 112x112, 0.82x on
24->144 at 56x56, 0.90x at 28x28, 0.83-1.01x at 14x14, 0.88-0.98x stacked at
7x7; the whole set 0.95x onnxruntime's single-conv time (pointwise 1.02x).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.backends.cpu import native_blocked, native_gemm, native_window, workspace
from keel.backends.cpu import window as wnd
from keel.backends.cpu.conv_epilogue import Activation, finish
from keel.errors import InvalidArgumentError
from keel.ops.schemas.conv import ConvGeometry

__all__ = ["Im2colLayout", "NativeCall", "NativeLayout", "PointwiseLayout", "Wide",
           "bind_phase_copy", "blocked_serves", "strided_serves", "im2col", "im2col_layout",
           "layout_filters", "native", "native_calls", "native_filters", "native_layout",
           "native_source", "pointwise", "pointwise_layout", "wide_serves"]

# How an im2col conv is laid out (compact or wide columns, images stacked, images per
# chunk) is the cpu planner's decision (keel.backends.cpu.planner.im2col_form).


@dataclass(frozen=True)
class _PhaseGroup:
    """The taps that read one stride phase: a regular grid of shifts in it."""

    phase: int
    first_tap: int                    # index of the group's first tap in the packed order
    counts: tuple[int, ...]           # taps per spatial dim
    base: int                         # offset of the first tap in the phase plane
    steps: tuple[int, ...]            # offset step per spatial dim (elements)

    @property
    def taps(self) -> int:
        return math.prod(self.counts)


@dataclass(frozen=True, eq=False)     # identity-hashed: a fast workspace key
class Im2colLayout:
    """Shape-derived facts of one wide-im2col conv (cached per signature)."""

    geo: ConvGeometry
    columns: int                      # L: wide columns per image
    groups: tuple[_PhaseGroup, ...]
    perm: tuple[int, ...]             # packed tap order -> row-major kernel tap
    chunk: int                        # images per chunk
    stacked: bool
    compact: bool                     # columns are the output pixels, no garbage

    @property
    def taps(self) -> int:
        return len(self.perm)


def im2col_columns(geo: ConvGeometry, compact: bool) -> int:
    """Columns per image of the column matrix: the output pixels (compact), or the wide
    layout's, which cover every output from the phase images' rows."""
    win = geo.window
    if compact:
        return math.prod(win.out_spatial)
    rows = wnd.wide_plan((1, geo.in_channels), win).row_strides
    return sum((o - 1) * r for o, r in zip(win.out_spatial, rows, strict=True)) + 1


def im2col_depth(geo: ConvGeometry) -> int:
    """Rows of the column matrix per group: every tap of every input channel, and a row
    of ones for the bias."""
    return geo.in_channels // geo.group * math.prod(geo.window.kernel) + 1


def im2col_scratch(geo: ConvGeometry, compact: bool, stacked: bool, n: int,
                   itemsize: int) -> int:
    """Bytes of the buffers :class:`_Im2colBuffers` holds for ``n`` images: the
    phase-split image, the column matrix and, unless the GEMM writes Y itself, the
    product."""
    c, g, m = geo.in_channels, geo.group, geo.out_channels
    plan = wnd.wide_plan((n, c), geo.window)
    ncol, depth = im2col_columns(geo, compact), im2col_depth(geo)
    image = plan.phases * (n * c * plan.plane + plan.slack)
    if stacked and n > 1:
        row = row_length(n * ncol, np.dtype(f"f{itemsize}"))
        return (image + g * depth * row + m * row) * itemsize
    row = row_length(ncol, np.dtype(f"f{itemsize}"))
    product = 0 if compact else n * m * row
    return (image + n * g * depth * row + product) * itemsize


def im2col_layout(geo: ConvGeometry, compact: bool, stacked: bool, chunk: int
                  ) -> Im2colLayout:
    """The im2col of ``geo`` as planned (pure; callers cache it per signature):
    ``compact`` columns, the images ``stacked`` in one GEMM, ``chunk`` images at a time."""
    win = geo.window
    rows = wnd.wide_plan((1, geo.in_channels), win).row_strides
    groups, perm = _phase_groups(geo, rows)
    return Im2colLayout(geo, im2col_columns(geo, compact), groups, perm,
                        max(1, min(geo.batch, chunk)), stacked and geo.batch > 1, compact)


def _phase_groups(geo: ConvGeometry, rows: Sequence[int]
                  ) -> tuple[tuple[_PhaseGroup, ...], tuple[int, ...]]:
    win = geo.window
    phase_strides = [math.prod(win.strides[d + 1:]) for d in range(win.rank)]
    kernel_strides = [math.prod(win.kernel[d + 1:]) for d in range(win.rank)]
    groups: list[_PhaseGroup] = []
    perm: list[int] = []
    for phis in itertools.product(*(range(s) for s in win.strides)):
        ks = [[k for k in range(kk) if (k * d) % s == phi]
              for kk, d, s, phi in zip(win.kernel, win.dilations, win.strides, phis, strict=True)]
        if not all(ks):
            continue
        shift = [[(k * d) // s for k in dim] for dim, d, s in
                 zip(ks, win.dilations, win.strides, strict=True)]
        base = sum(sh[0] * r for sh, r in zip(shift, rows, strict=True))
        # The taps of one phase are evenly spaced in every dim (step lcm(s, d) / s).
        steps = tuple((sh[1] - sh[0]) * r if len(sh) > 1 else 0
                      for sh, r in zip(shift, rows, strict=True))
        phase = sum(p * ps for p, ps in zip(phis, phase_strides, strict=True))
        groups.append(_PhaseGroup(phase, len(perm), tuple(len(k) for k in ks), base, steps))
        perm.extend(sum(k * st for k, st in zip(at, kernel_strides, strict=True))
                    for at in itertools.product(*ks))
    return tuple(groups), tuple(perm)


def _pack_weights(xp: Any, layout: Im2colLayout, w: Any, b: Any) -> Any:
    """W as (G, Mg, Cg * taps + 1): taps in the packed order, the bias (or 0) last."""
    geo = layout.geo
    g, mg = geo.group, geo.out_channels // geo.group
    cg, t = geo.in_channels // g, layout.taps
    taps = w.reshape(g, mg, cg, t)
    if layout.perm != tuple(range(t)):
        taps = taps[..., list(layout.perm)]
    packed = xp.zeros((g, mg, cg * t + 1), dtype=w.dtype)
    packed[..., : cg * t] = taps.reshape(g, mg, cg * t)
    if b is not None:
        packed[..., -1] = b.reshape(g, mg)
    return packed


def im2col(xp: Any, layout: Im2colLayout, x: Any, w: Any, b: Any, z: Any, y: Any,
           act: Activation, packed: Any = None) -> None:
    """y = act(conv(x, w) + b + z) by wide im2col and one GEMM per chunk of images."""
    geo = layout.geo
    key = ("im2col", layout.perm, geo.group)
    w3 = workspace.form(xp, packed, key, (w, b),
                        lambda xp_, a: _pack_weights(xp_, layout, a[0], a[1]))
    n, step = geo.batch, layout.chunk
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        ready = workspace.bound(xp, (layout, n1 - n0, x.dtype),
                                functools.partial(_Im2colBuffers, xp, layout, n1 - n0, x.dtype))
        if n1 - n0 == n:
            ready.run(xp, x, w3, z, y, act)
        else:
            ready.run(xp, x[n0:n1], w3, None if z is None else z[n0:n1], y[n0:n1], act)


class PhaseFill:
    """Copies X into a zero-bordered, stride-phase-split flat image (views made once)."""

    def __init__(self, xp: Any, plan: wnd.WidePlan, dtype: Any, fill: float = 0.0) -> None:
        n, c = plan.batch, plan.channels
        size = n * c * plan.plane
        self.plan = plan
        self.image = xp.full((plan.phases, size + plan.slack), fill, dtype=dtype)
        every = (slice(None), slice(None))
        self.parts = [(self.image[p, :size].reshape(n, c, *plan.q)[every + dst], every + src)
                      for p, (dst, src) in enumerate(plan.fills)]

    def __call__(self, x: Any) -> Any:
        for dst, src in self.parts:
            dst[...] = x[src]
        return self.image


class _Im2colBuffers:
    """The buffers of one wide-im2col layout for ``n`` images, and every view of them."""

    def __init__(self, xp: Any, layout: Im2colLayout, n: int, dtype: Any) -> None:
        geo = layout.geo
        c, g, t, ncol, m = geo.in_channels, geo.group, layout.taps, layout.columns, \
            geo.out_channels
        cg = c // g
        plan = wnd.wide_plan((n, c), geo.window)
        pl = plan.plane
        self.fill = PhaseFill(xp, plan, dtype)
        img = self.fill.image
        out = plan.out
        # Trailing dims of a tap view and their steps in the phase plane.
        if layout.compact:
            tail, tail_steps = out, plan.row_strides
            rows = tuple(math.prod(out[d + 1:]) for d in range(len(out)))
        else:
            tail, tail_steps, rows = (ncol,), (1,), plan.row_strides
        stacked = layout.stacked and n > 1
        self.direct = layout.compact and not stacked       # the GEMM writes Y itself
        self.shape = (n, g, m // g, ncol)
        self.wide = None
        if stacked:
            span = n * ncol
            self.cols = xp.ones((g, cg * t + 1, row_length(span, dtype)), dtype=dtype)
            self.operand = self.cols[:, :, :span]
            dst = self.operand[:, : cg * t].reshape(g, cg, t, n, ncol)
            wide = xp.empty((g, m // g, row_length(span, dtype)), dtype=dtype)
            self.wide = self.product = wide[:, :, :span]
            lead: tuple[int, ...] = (g, cg)
            lead_steps: tuple[int, ...] = (cg * pl, pl)
            out_steps = (ncol, wide.shape[-1])
        else:
            self.cols = xp.ones((n, g, cg * t + 1, row_length(ncol, dtype)), dtype=dtype)
            self.operand = self.cols[..., :ncol]
            dst = self.operand[:, :, : cg * t].reshape(n, g, cg, t, ncol)
            wide = None
            if not self.direct:
                wide = xp.empty((n, m, row_length(ncol, dtype)), dtype=dtype)
                self.wide = wide[..., :ncol]
                self.product = self.wide.reshape(self.shape)
            row = ncol if wide is None else wide.shape[-1]
            lead, lead_steps = (n, g, cg), (c * pl, cg * pl, pl)
            out_steps = (m * row, row)
        self.single = n == 1 and g == 1 and not stacked
        if self.single:
            self.operand = self.operand[0, 0]
            if self.wide is not None:
                self.product = self.wide[0]
        self.copies = []
        for grp in layout.groups:
            taps = slice(grp.first_tap, grp.first_tap + grp.taps)
            if stacked:
                part = dst[:, :, taps].reshape(g, cg, *grp.counts, n, *tail)
                src = strided(xp, img[grp.phase], grp.base, (*lead, *grp.counts, n, *tail),
                              (*lead_steps, *grp.steps, c * pl, *tail_steps))
            else:
                part = dst[:, :, :, taps].reshape(n, g, cg, *grp.counts, *tail)
                src = strided(xp, img[grp.phase], grp.base, (*lead, *grp.counts, *tail),
                              (*lead_steps, *grp.steps, *tail_steps))
            self.copies.append((part, src))
        self.valid = None if wide is None else valid(xp, wide, (n, m, *out), out_steps, rows)
        self.nbytes = int(img.nbytes + self.cols.nbytes + (0 if wide is None else wide.nbytes))

    def run(self, xp: Any, x: Any, w3: Any, z: Any, y: Any, act: Activation) -> None:
        self.fill(x)
        for part, src in self.copies:
            part[...] = src
        weights = w3[0] if self.single else w3
        if self.direct:
            xp.matmul(weights, self.operand,
                      out=y.reshape(self.shape[2:] if self.single else self.shape))
            finish(xp, y, y, z, act)
        else:
            xp.matmul(weights, self.operand, out=self.product)
            finish(xp, self.valid, y, z, act)


def row_length(columns: int, dtype: Any) -> int:
    """A row length >= ``columns`` whose byte size is not a multiple of 4 KiB.

    BLAS reads its operands in panels; rows 4 KiB apart map to the same cache
    sets and evict each other (measured: a 16x145 @ 145x1024 GEMM takes 108 us
    with 1024-float rows, 60 us with 1040).
    """
    return columns + 16 if (columns * np.dtype(dtype).itemsize) % 4096 == 0 else columns


def strided(xp: Any, base: Any, offset: int, shape: Sequence[int],
            steps: Sequence[int]) -> Any:
    """A view of flat ``base`` from ``offset`` with ``shape`` and element ``steps``."""
    src = base[offset:]
    item = src.itemsize
    return xp.lib.stride_tricks.as_strided(src, tuple(shape), tuple(s * item for s in steps))


def valid(xp: Any, wide: Any, shape: Sequence[int], lead_steps: Sequence[int],
          row_steps: Sequence[int]) -> Any:
    """The (N, M, *out) view of the valid outputs in a wide result (element steps)."""
    return strided(xp, wide.reshape(-1), 0, shape, (*lead_steps, *row_steps))


# ---- 1x1 convs --------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PointwiseLayout:
    """Shape-derived facts of one 1x1 conv (no padding)."""

    geo: ConvGeometry
    fold: bool                         # the bias rides in the GEMM (X copied above ones)
    stacked: bool                      # the images side by side in one GEMM
    copy: bool                         # X is copied (strided, folded or stacked)
    sub: tuple[slice, ...]             # the X pixels the kernel reads (strides)


def pointwise_layout(geo: ConvGeometry, has_bias: bool, stacked: bool) -> PointwiseLayout:
    """Plan a 1x1 conv (its images ``stacked`` as planned): copy X only when it pays
    (stride, stacking or a cheap bias fold)."""
    win = geo.window
    stacked = stacked and geo.batch > 1
    strided_ = any(s != 1 for s in win.strides)
    # Copying X under a row of ones costs C * P; adding the bias after costs M * P.
    fold = has_bias and (stacked or strided_ or geo.out_channels > geo.in_channels)
    sub = (slice(None), slice(None), *(slice(None, (o - 1) * s + 1, s) for o, s in
                                       zip(win.out_spatial, win.strides, strict=True)))
    return PointwiseLayout(geo, fold, stacked, stacked or strided_ or fold, sub)


def _pack_pointwise(xp: Any, geo: ConvGeometry, w: Any, b: Any) -> Any:
    g = geo.group
    mg, cg = geo.out_channels // g, geo.in_channels // g
    packed = xp.zeros((g, mg, cg + 1), dtype=w.dtype)
    packed[..., :cg] = w.reshape(g, mg, cg)
    if b is not None:
        packed[..., -1] = b.reshape(g, mg)
    return packed


def pointwise(xp: Any, layout: PointwiseLayout, x: Any, w: Any, b: Any, z: Any, y: Any,
              act: Activation, packed: Any = None) -> None:
    """y = act(W @ X + b + z) for a 1x1 conv."""
    geo = layout.geo
    out = geo.window.out_spatial
    n, c, g, m = geo.batch, geo.in_channels, geo.group, geo.out_channels
    cg, mg, p = c // g, m // g, math.prod(out)
    if layout.stacked:
        w3 = _packed_pointwise(xp, geo, w, b if layout.fold else None, packed)
        row = row_length(n * p, x.dtype)
        xs = workspace.filled(xp, "pointwise_stacked", (g, cg + 1, row), x.dtype, 1.0)
        xs[:, :cg, : n * p].reshape(g, cg, n, *out)[...] = xp.moveaxis(
            x[layout.sub].reshape(n, g, cg, *out), 0, 2)
        wide = workspace.empty(xp, "pointwise_wide", (g, mg, row), x.dtype)
        xp.matmul(w3, xs[:, :, : n * p], out=wide[:, :, : n * p])
        finish(xp, valid(xp, wide, (n, m, p), (p, row), (1,)), y.reshape(n, m, p),
               None if z is None else z.reshape(n, m, p), act)
        return
    y4 = y.reshape(n, g, mg, p)
    if layout.copy:
        weights = _packed_pointwise(xp, geo, w, b if layout.fold else None, packed)
        operand = workspace.filled(xp, "pointwise_copy", (n, g, cg + 1, p), x.dtype, 1.0)
        operand[:, :, :cg].reshape(n, g, cg, *out)[...] = x[layout.sub].reshape(
            n, g, cg, *out)
    else:
        operand, weights = x.reshape(n, g, cg, p), w.reshape(g, mg, cg)
    if n == 1 and g == 1:
        xp.matmul(weights[0], operand[0, 0], out=y4[0, 0])
    else:
        xp.matmul(weights, operand, out=y4)
    if b is not None and not layout.fold:
        xp.add(y, b.reshape(1, m, *([1] * len(out))), out=y)
    finish(xp, y, y, z, act)


def _packed_pointwise(xp: Any, geo: ConvGeometry, w: Any, b: Any, packed: Any) -> Any:
    return workspace.form(xp, packed, ("pointwise", geo.group, b is None), (w, b),
                          lambda xp_, a: _pack_pointwise(xp_, geo, a[0], a[1]))


# ---- the native implicit GEMM -------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class NativeLayout:
    """Shape-derived facts of one conv on the native GEMM (cached per signature).

    B's rows are the kernel taps of every input channel, its columns the output
    pixels: element ``(c * taps + t, o)`` of image n is ``source[n * stride +
    rows[c * taps + t] + cols[o]]``. The source is X itself (unpadded, stride 1),
    or X copied into a zero-bordered image split by stride phase (``phase[f][u] =
    padded[u * s + f]``, so a strided tap reads unit-stride runs; only the phases
    some tap reads are kept). The kernel gathers B block by block into its packed
    panels (no im2col matrix) and writes Y's rows in NCHW as they are.
    ``direct``: a 1x1 stride-1 unpadded conv, whose B is X's (C, P) matrix, read
    in place. ``stacked``: the images of the batch side by side in one product of
    N * P columns (``stack_cols``: where each reads in the source, ``stack_out``:
    where it goes in Y), so that a small image fills the kernel's column panels
    (7x7 = 49 pixels would fill two 32-column panels to 77 %, 32 images 98 %).
    ``images``: the ``gathered-images`` form, a batch run image by image, each image's
    phase copy and then its products (``geo`` and the phase image are one image's, so
    the products read a phase image the copy has just left in cache); or, planned with
    a ``step`` of k > 1 images (whole images per thread), k images at a time, their
    phases copied together and their products stacked in one (``geo`` then k images'
    in the gathered-stacked layout: k threads' column panels, about an image each).
    """

    geo: ConvGeometry
    direct: bool
    copied: bool                      # the source is a phase image (else X itself)
    q: tuple[int, ...]                # spatial dims of a phase plane
    fills: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]  # per kept phase
    plane: int                        # elements per (image, channel) of one phase
    rows: Any                         # (Cg * taps,) int64, read-only
    cols: Any                         # (P,) int64, read-only
    stack_cols: Any = None            # (N * P,) int64 when stacked
    stack_out: Any = None             # (N * P,) int64 when stacked
    wide: Wide | None = None          # the indirect "wide" layout (see Wide)
    masked: Masked | None = None      # taps read in place through lane masks (see Masked)
    band: bool = False                # by bands of output rows from X itself
    blocked: bool = False             # channel-blocked direct conv (native_blocked)
    sides: native_blocked.Sides = native_blocked.NCHW_SIDES  # its blocked X, Y, residual
    nt: bool = False                  # Y's final stores bypass the cache (as planned)
    lanes: bool | None = None         # products in lanes tiles (as planned; None: the rule)
    a16: bool = False                 # filters in 16-row panels only (as planned: native_a16)
    tail: bool | None = None          # lanes tails (as planned: native_lanes_tail; None: rule)
    streams: bool = False             # gathered taps stream for the output (as planned)
    images: int = 0                   # by image: this many, ``step`` at a time (geo: a step's)
    step: int = 1                     # by image: images a step (stacked when more than one)

    @property
    def stacked(self) -> bool:
        return self.stack_cols is not None

    @property
    def reads_x(self) -> bool:
        """Whether the kernel reads X where it lies and takes each run's X (band and
        blocked forms)."""
        return self.band or self.blocked


@dataclass(frozen=True, eq=False)
class Wide:
    """A stride-1 conv read through a per-tap offset table, with no gather pass.

    X's element (t, c, y, x) lies at ``lead + t * image + c * channel + y * row + x``
    of a flat zero-filled buffer whose rows are ``row = W + max(pad left, pad
    right)`` long (at least the output's width): the zeros after one image row
    are the right padding of that row and the left padding of the next, and the
    zero rows after one plane the bottom padding of that plane and the top
    padding of the next (planes of ``max(H + max(pad top, pad bottom), OH) * row``).
    Output pixel (oy, ox) of image t is product column ``t * image + oy * row +
    ox`` (``stacked``: every image in one product, the images of a channel end to
    end, ``image`` apart) or column ``oy * row + ox`` of product t; tap (c, kh,
    kw) of every column is then one contiguous run of the buffer from ``c *
    channel + kh * dh * row + kw * dw``, so the kernel reads B's panels in place
    through that row table. The columns ``ox >= OW`` (and those between stacked
    images) are computed and dropped by
    the store's column map. Unpadded, unstacked, X itself is the buffer.
    """

    row: int
    lead: int                         # buffer elements before X's first element
    image: int                        # element step between images
    channel: int                      # element step between channels
    size: int                         # buffer elements
    columns: int                      # product columns (one product, or one per image)
    stacked: bool
    rows: Any                         # (Cg * taps,) int64 tap offsets, read-only
    out: Any                          # (columns,) int64: where each column goes in Y (-1: dropped)


@dataclass(frozen=True, eq=False)
class Masked:
    """A conv whose taps the kernel reads in place from planes of the output's shape.

    Every source plane is OH x OW: X itself (stride 1, output as large as the
    input), or X split by stride phase (``phase[f][u][v] = x[s * u + fh][s * v +
    fw]``, no border). Output pixel q = (oy, ox) is product column q, and tap t
    of channel c reads the plane's element ``q + dy[t] * OW + dx[t]`` of its
    phase, when (oy + dy, ox + dx) lies in the plane: a run of output pixels is a
    run of the plane, read by loads whose lanes that fall outside it are masked
    off (gemm.c's KEEL_DIRECT). No zero-bordered copy of X, no gathered or packed
    B, no garbage columns.
    """

    geometry: Any                     # int64 {T, OH, OW, cs, (dy, dx, off) per tap}
    offsets: Any                      # (Cg * T,) int64: c * cs + off[t]
    image: int                        # element step between images in the source
    channel: int                      # element step between channels (cs)
    taps: tuple[tuple[int, int, int], ...]   # (phase, dy, dx) per tap
    out: tuple[int, int]              # (OH, OW)


# The masked layout's limit on taps per filter (gemm.c's DIRECT_MAX_TAPS), its flag
# and where the column table and the flags sit in keel_gemm_args (see gemm.c).
MASKED_MAX_TAPS = 64


def native_layout(geo: ConvGeometry, form: str, stream_stores: bool = False,
                  lanes: bool | None = None, output_streams: bool = False,
                  blocked_residual: bool = False, step: int = 1, a16: bool = False,
                  tail: bool | None = None) -> NativeLayout:
    """``geo`` on the native GEMM in ``form`` (pure; callers cache it per signature).

    The cpu planner decides the form (``keel.backends.cpu.planner.native_form``):
    ``band``, ``masked``, ``wide`` / ``wide-stacked``, ``direct`` (a 1x1 stride-1
    conv reading X in place), ``gathered`` / ``gathered-stacked`` or ``gathered-images``
    (gathered, image by image: see :class:`NativeLayout`). A form
    that does not serve ``geo`` runs gathered, unstacked. ``stream_stores``: Y's
    final stores bypass the cache (where no activation pass rereads Y); ``lanes``: the
    products run in gemm.c's lanes tiles or not (None: lanes_tiles, or masked_lanes, for
    this machine); ``tail``: a product's partly filled last column panel runs in lanes
    tiles where its shape gives one, or not (the planner's native_lanes_tail; None: its
    lanes_tail for this machine);
    ``output_streams``: gathered taps stream for the output's sake (the planner's
    native_tiles decides both); ``step``: the gathered-images form's images a step (the
    planner's by_image_step); ``a16``: the filters are packed in 16-row panels only (the
    planner's native_a16, where the products run in lanes tiles). A form naming
    ``nchwc16`` (``"nchw->nchwc16"``,
    ``"nchwc16->nchwc16"``, ``"nchwc16->nchw"``, ``"nchw->nchw"``: the planner's
    float_layouts) is the channel-blocked direct conv inside a float NCHWc region (or
    alone: planner.blocked_alone), its X
    and Y in the layouts the form names and its residual blocked where
    ``blocked_residual``.
    """
    if form in native_blocked.REGION_LAYOUTS:
        src, _, dst = form.partition("->")
        return NativeLayout(geo, False, False, (), (), math.prod(geo.window.in_spatial), None,
                            None, blocked=True, sides=native_blocked.Sides(
                                src == native_blocked.NCHWC, dst == native_blocked.NCHWC,
                                blocked_residual))
    # 16-row panels serve products run wholly in lanes tiles only: the direct form's, as
    # the planner's native_a16 gives them (a masked call reads 8-row panels). A plan may
    # come from a file, so one that says otherwise is refused, not run.
    if a16 and not (form == "direct" and lanes is True):
        raise InvalidArgumentError(
            f"a native conv's plan packs its filters in 16-row panels (gemm_a16) for "
            f"products in the {form!r} form with gemm_lanes {lanes!r}: only the direct "
            "form's products in lanes tiles read them")
    layout = _native_layout(geo, form, step)
    if form == "masked" and layout.masked is None:
        lanes = None                        # ran gathered: masked_lanes was not its rule
    if stream_stores or lanes is not None or output_streams or a16 or tail is not None:
        layout = dataclasses.replace(layout, nt=stream_stores, lanes=lanes,
                                     streams=output_streams, a16=a16, tail=tail)
    return layout


def _native_layout(geo: ConvGeometry, form: str, step: int = 1) -> NativeLayout:
    win = geo.window
    if form == "gathered-images" and geo.batch > 1 and (win.padded or any(
            s != 1 for s in win.strides)):
        step = max(1, min(step, geo.batch))
        one = _native_layout(dataclasses.replace(geo, batch=step),
                             "gathered-stacked" if step > 1 else "gathered")
        return dataclasses.replace(one, images=geo.batch, step=step)
    found = (band_layout(geo) if form == "band" else masked_layout(geo) if form == "masked"
             else _wide_layout(geo, form == "wide-stacked")
             if form.startswith("wide") and wide_serves(geo) else None)
    if found is not None:
        return found
    unit = all(s == 1 for s in win.strides)
    if form == "direct" and geo.is_pointwise and unit:
        return NativeLayout(geo, True, False, (), (), math.prod(win.in_spatial), None, None)
    if form == "gathered-strided" and strided_serves(geo):
        return _strided_layout(geo)
    copied = win.padded or not unit
    q = tuple(-(-(i + b + e) // s) for i, b, e, s in
              zip(win.in_spatial, win.pads_begin, win.pads_end, win.strides, strict=True))
    q = q if copied else tuple(win.in_spatial)
    steps = [math.prod(q[d + 1:]) for d in range(win.rank)]
    plane = math.prod(q)
    # Each tap: (its phase, its offset in the phase plane), row-major over the kernel.
    taps = [(tuple(k * dl % s for k, dl, s in zip(ks, win.dilations, win.strides, strict=True)),
             sum(k * dl // s * st for k, dl, s, st in
                 zip(ks, win.dilations, win.strides, steps, strict=True)))
            for ks in itertools.product(*(range(k) for k in win.kernel))]
    phases = sorted({ph for ph, _ in taps})
    phase_size = geo.batch * geo.in_channels * plane
    offsets = np.array([phases.index(ph) * phase_size + off for ph, off in taps], np.int64)
    cg = geo.in_channels // geo.group
    rows = (np.arange(cg, dtype=np.int64)[:, None] * plane + offsets).reshape(-1)
    cols = _grid([[o * st for o in range(oo)] for oo, st in
                  zip(win.out_spatial, steps, strict=True)])
    fills = tuple(_phase_fill(ph, win) for ph in phases) if copied else ()
    stack_cols = stack_out = None
    pixels = len(cols)
    if form == "gathered-stacked" and geo.batch > 1:
        image = np.arange(geo.batch, dtype=np.int64)[:, None]
        stack_cols = (image * geo.in_channels * plane + cols).reshape(-1)
        stack_out = (image * geo.out_channels * pixels + np.arange(pixels)).reshape(-1)
        stack_cols.flags.writeable = stack_out.flags.writeable = False
    rows.flags.writeable = False
    cols.flags.writeable = False
    return NativeLayout(geo, False, copied, q, fills, plane, rows, cols, stack_cols, stack_out)


def strided_serves(geo: ConvGeometry) -> bool:
    """Whether the gathered-strided form runs ``geo``: an unpadded 1x1 conv at stride 2,
    whose output rows gemm.c's packing reads from X itself as every other float."""
    win = geo.window
    return (geo.is_pointwise and not win.padded and all(s == 2 for s in win.strides)
            and all(d == 1 for d in win.dilations))


def _strided_layout(geo: ConvGeometry) -> NativeLayout:
    """An unpadded 1x1 stride-2 conv gathered from X itself, no phase copy: input channel
    c is B's row at ``c * plane`` and output pixel (oy, ox) the column at ``2 * oy * W +
    2 * ox`` (gemm.c packs a row's even floats with one permute)."""
    win = geo.window
    plane = math.prod(win.in_spatial)
    steps = [math.prod(win.in_spatial[d + 1:]) for d in range(win.rank)]
    cg = geo.in_channels // geo.group
    rows = np.arange(cg, dtype=np.int64) * plane
    cols = _grid([[o * s * st for o in range(oo)] for oo, s, st in
                  zip(win.out_spatial, win.strides, steps, strict=True)])
    rows.flags.writeable = False
    cols.flags.writeable = False
    return NativeLayout(geo, False, False, tuple(win.in_spatial), (), plane, rows, cols)


def blocked_serves(geo: ConvGeometry) -> bool:
    """Whether the channel-blocked direct conv (native_blocked) computes ``geo``: a dense
    2-D 3x3 conv padded by one on every side or an unpadded 1x1 conv, at stride 1 or 2
    (the same both ways), output channels in whole blocks of 16 (output rows of any
    width: a row's last 1 to 7 pixels are a tail tile, a band's last pixels short of 16
    are written through lane masks)."""
    win = geo.window
    pad = {(3, 3): 1, (1, 1): 0}.get((win.kernel[0], win.kernel[-1]), -1)
    return (win.rank == 2 and geo.group == 1 and pad >= 0
            and tuple(win.strides) in ((1, 1), (2, 2)) and all(d == 1 for d in win.dilations)
            and all(p == pad for p in (*win.pads_begin, *win.pads_end))
            and geo.out_channels % native_blocked.LANES == 0)


def wide_serves(geo: ConvGeometry) -> bool:
    """Whether the wide layout can run ``geo``: a 2-D stride-1 conv, not a 1x1 stride-1
    unpadded one (which reads X in place as it is)."""
    win = geo.window
    return (win.rank == 2 and all(s == 1 for s in win.strides)
            and not (geo.is_pointwise and not win.padded))


def panels(columns: int, width: int) -> int:
    return -(-columns // width)


def _wide_shape(geo: ConvGeometry) -> tuple[int, int, int]:
    """(row, plane, span) of the wide layout: the row and image steps in the buffer and
    the product columns of one image."""
    win = geo.window
    (h, w), (oh, ow) = win.in_spatial, win.out_spatial
    (pt, pl), (pb, pr) = win.pads_begin, win.pads_end
    # Output columns and rows must also fit apart (a padded 1x1 conv is wider than X).
    row = max(w + max(pl, pr), ow)
    plane = max(h + max(pt, pb), oh) * row
    return row, plane, (oh - 1) * row + ow


def wide_panels(geo: ConvGeometry, stacked: bool, width: int) -> int:
    """Column panels of the wide layout's products, all together."""
    _, plane, span = _wide_shape(geo)
    if stacked:
        return panels((geo.batch - 1) * plane + span, width)
    return geo.batch * panels(span, width)


def _wide_layout(geo: ConvGeometry, stacked: bool) -> NativeLayout:
    """The :class:`Wide` plan of a 2-D stride-1 conv."""
    win = geo.window
    (h, w), (oh, ow) = win.in_spatial, win.out_spatial
    (dh, dw), (kh, kw) = win.dilations, win.kernel
    n, c = geo.batch, geo.in_channels
    row, plane, span = _wide_shape(geo)
    lead = win.pads_begin[0] * row + win.pads_begin[1]
    image, channel = (plane, n * plane) if stacked else (c * plane, plane)
    copied = win.padded or stacked
    size = lead + n * c * plane + row if copied else n * c * plane
    columns = (n - 1) * plane + span if stacked else span
    taps = _grid([[i * dh * row for i in range(kh)], [j * dw for j in range(kw)]])
    cg = c // geo.group
    rows = (np.arange(cg, dtype=np.int64)[:, None] * channel + taps).reshape(-1)
    j = np.arange(columns, dtype=np.int64)
    t, rest = (j // plane, j % plane) if stacked else (np.zeros_like(j), j)
    oy, ox = rest // row, rest % row
    out = np.where((ox < ow) & (oy < oh), t * geo.out_channels * oh * ow + oy * ow + ox, -1)
    rows.flags.writeable = out.flags.writeable = False
    every = (slice(0, h), slice(0, w))
    fills = ((every, (slice(0, h, 1), slice(0, w, 1))),) if copied else ()
    return NativeLayout(geo, False, copied, (h, w), fills, plane, rows, _grid([range(oh * ow)]),
                        wide=Wide(row, lead, image, channel, size, columns, stacked, rows, out))


# A dense strided 2-D conv may run by bands of output rows, its taps read from X's
# rows into a small buffer per band (gemm.c's keel_conv_band_f32): no zero-bordered
# phase copy of X and no gathered panels. Where it runs: the cpu planner's band rule.


def band_layout(geo: ConvGeometry) -> NativeLayout | None:
    """The band plan of ``geo`` (X read where it lies, by bands of output rows: gemm.c's
    keel_conv_band_f32); None unless a dense 2-D conv."""
    win = geo.window
    if win.rank != 2 or geo.group != 1:
        return None
    return NativeLayout(geo, False, False, tuple(win.in_spatial), (),
                        math.prod(win.in_spatial), None, None, band=True)


def _masked_taps(geo: ConvGeometry) -> tuple[list[tuple[int, int]],
                                             list[tuple[int, int, int]]] | None:
    """(the stride phases kept, (phase index, dy, dx) per tap in row-major order) of a
    2-D conv the masked layout serves; None when it does not.

    Tap (kh, kw) reads X's row ``s * oy + kh * d - pad`` = ``s * (oy + dy) + fh``:
    row ``oy + dy`` of phase fh. A row the phase plane lacks (``oy + dy`` outside
    ``[0, OH)``) reads as zero, so it must be padding: below 0 it always is; at
    ``OH`` and up only when ``s * OH + fh >= H``. Stride 1 reads X itself, whose
    planes must then be the output's shape.
    """
    win = geo.window
    if win.rank != 2 or math.prod(win.kernel) > MASKED_MAX_TAPS:
        return None
    (h, w), (oh, ow) = win.in_spatial, win.out_spatial
    unit = all(s == 1 for s in win.strides)
    if oh * ow == 0 or (unit and (oh, ow) != (h, w)):
        return None
    phases: list[tuple[int, int]] = []
    taps: list[tuple[int, int, int]] = []
    for ks in itertools.product(*(range(k) for k in win.kernel)):
        shift = []
        for k, dl, s, pad, size, out in zip(ks, win.dilations, win.strides, win.pads_begin,
                                            (h, w), (oh, ow), strict=True):
            f, dq = (k * dl - pad) % s, (k * dl - pad) // s
            if dq > 0 and s * out + f < size:
                return None
            shift.append((f, dq))
        phase = (shift[0][0], shift[1][0])
        if phase not in phases:
            phases.append(phase)
        taps.append((phases.index(phase), shift[0][1], shift[1][1]))
    return phases, taps


def masked_layout(geo: ConvGeometry) -> NativeLayout | None:
    """The :class:`Masked` plan of ``geo``; None when it does not serve it."""
    found = _masked_taps(geo)
    if found is None:
        return None
    phases, taps = found
    win = geo.window
    oh, ow = win.out_spatial
    n, c = geo.batch, geo.in_channels
    plane = oh * ow
    unit = all(s == 1 for s in win.strides)
    phase_size = n * c * plane
    geometry = [len(taps), oh, ow, plane]
    for ph, dy, dx in taps:
        geometry += [dy, dx, ph * phase_size + dy * ow + dx]
    table = np.array(geometry, dtype=np.int64)
    off = table[6::3]
    cg = c // geo.group
    offsets = (np.arange(cg, dtype=np.int64)[:, None] * plane + off).reshape(-1)
    fills: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...] = ()
    if not unit:
        fills = tuple(_masked_fill(ph, win, (oh, ow)) for ph in phases)
    table.flags.writeable = offsets.flags.writeable = False
    return NativeLayout(geo, False, not unit, (oh, ow), fills, plane, offsets, None,
                        masked=Masked(table, offsets, c * plane, plane, tuple(taps), (oh, ow)))


@functools.lru_cache(maxsize=256)
def _masked_table(masked: Masked, width: int, group: int) -> Any:
    """gemm.c's geometry table of ``masked`` for column panels of ``width``: the
    geometry, then per panel and tap the bits of the panel's columns whose tap lies
    inside the plane (bit q: column q of the panel; a panel is at most 64 columns),
    then the column panels of a group (the planner's ``masked_panel_group``; 1: column
    panel by column panel). Made per panel width: a kernel built for another CPU has
    other panels."""
    bits = _masked_bits(masked.taps, *masked.out, width)
    table = np.concatenate([masked.geometry, bits, np.array([group], np.int64)])
    table.flags.writeable = False
    return table


def _masked_bits(taps: Sequence[tuple[int, int, int]], oh: int, ow: int, width: int) -> Any:
    """Per column panel and tap, the bits of the panel's columns reading inside (int64)."""
    panels = -(-oh * ow // width)
    q = np.arange(panels * width, dtype=np.int64)
    oy, ox = q // ow, q % ow
    lanes = np.stack([(q < oh * ow) & (oy + dy >= 0) & (oy + dy < oh) & (ox + dx >= 0)
                      & (ox + dx < ow) for _, dy, dx in taps])       # (T, panels * width)
    weights = np.left_shift(np.uint64(1), np.arange(width, dtype=np.uint64))
    bits = (lanes.reshape(len(taps), panels, width).astype(np.uint64) * weights).sum(
        axis=-1, dtype=np.uint64)
    return np.ascontiguousarray(bits.T).view(np.int64).reshape(-1)


def _masked_fill(phase: tuple[int, int], win: Any, out: tuple[int, int]
                 ) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """Where X's elements go in one unbordered stride phase of the output's shape."""
    dst: list[slice] = []
    src: list[slice] = []
    for f, s, size, o in zip(phase, win.strides, win.in_spatial, out, strict=True):
        count = min(o, len(range(f, size, s)))
        dst.append(slice(0, count))
        src.append(slice(f, f + s * (count - 1) + 1, s))
    return tuple(dst), tuple(src)


def _phase_fill(phase: tuple[int, ...], win: Any) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """Where X's elements go in one stride phase: phase[dst] = x[src] per spatial dim."""
    dst: list[slice] = []
    src: list[slice] = []
    for f, s, b, size in zip(phase, win.strides, win.pads_begin, win.in_spatial, strict=True):
        first = (f - b) % s                   # the first X index landing in this phase
        count = len(range(first, size, s))
        u0 = (first + b) // s
        dst.append(slice(u0, u0 + count))
        src.append(slice(first, size, s))
    return tuple(dst), tuple(src)


def _grid(axes: Sequence[Sequence[int]]) -> Any:
    """Row-major sums a0 + a1 + ... over every combination: (prod of lengths,) int64."""
    total = np.zeros((), dtype=np.int64)
    for values in axes:
        total = total[..., None] + np.asarray(values, dtype=np.int64)
    return total.reshape(-1)


def layout_filters(xp: Any, layout: NativeLayout, packed: Any, w: Any, b: Any) -> Any:
    """The node's filters as ``layout``'s kernel reads them (packed once per node)."""
    geo = layout.geo
    if layout.blocked:
        return workspace.form(xp, packed, ("blocked",), (w, b), lambda xp_, a: (
            native_blocked.pack_filters(a[0]),
            None if a[1] is None else np.ascontiguousarray(a[1], dtype=np.float32)))
    a16 = layout.a16             # as planned (native_a16): one packing is held either way
    return workspace.form(xp, packed, ("native", geo.group, a16), (w, b),
                          lambda xp_, a: native_filters(xp_, geo, a[0], a[1], a16))


def native_filters(xp: Any, geo: ConvGeometry, w: Any, b: Any, a16: bool = False) -> Any:
    """Per group: W (Mg, Cg * taps) packed as the left operand (in 16-row panels only
    where ``a16``: the layout's, as the planner's native_a16 says), and its bias (or
    None)."""
    g = geo.group
    mg = geo.out_channels // g
    w3 = w.reshape(g, mg, -1).astype(np.float32, copy=False)
    bias = None if b is None else np.ascontiguousarray(b.reshape(g, mg), dtype=np.float32)
    return tuple((native_gemm.pack_a16(w3[i]) if a16 else native_gemm.pack(w3[i], left=True),
                  None if bias is None else bias[i]) for i in range(g))


# How many sets of prepared calls a node keeps for each form: a memo's size, not a choice
# of how it runs. A node sees one set of arrays per batch shape (and thread count) a
# model runs at, so a few cover a model served at a handful of shapes; past this many
# it empties the memo and prepares again, bitwise the same.
_CALLS_KEPT = 8


def _kept(calls: dict[Any, Any], key: Any, entry: Any) -> None:
    """``entry`` kept at ``key``, the memo emptied first when full."""
    if len(calls) >= _CALLS_KEPT:
        calls.clear()
    calls[key] = entry


def residual_in_place(z: Any, y: Any) -> bool:
    """Whether prepared calls read Z where it lies, and so see each run's values; False
    where :func:`_native_residual` adds a copy made when they are prepared (Z shares
    Y's memory without being Y, is not float32 or not C-contiguous): such calls are
    not kept."""
    if z is None or native_gemm.same_memory(z, y):
        return True
    return z.dtype == np.float32 and z.flags.c_contiguous and not np.may_share_memory(z, y)


def native(xp: Any, layout: NativeLayout, x: Any, w: Any, b: Any, z: Any, y: Any,
           act: Activation, packed: Any = None, threads: int = 1) -> bool:
    """y = act(conv(x, w) + b + z) on the native GEMM; False when not served (float32
    NumPy arrays only; nothing is written then).

    A model calls a node with the same arrays every run, so the prepared kernel
    calls are kept in the node's prepack state, keyed by the arrays they read
    and write (a steady-state call then skips ~5 us of argument checks per group).
    """
    if xp is not np or x.dtype != np.float32 or y.dtype != np.float32 \
            or not native_gemm.available() or (layout.blocked and not blocked_serves(layout.geo)):
        return False
    filters = layout_filters(xp, layout, packed, w, b)
    if layout.images:
        return _native_images(layout, x, filters, z, y, act, packed, threads)
    source = native_source(xp, layout, x, threads)
    calls = None
    if isinstance(packed, workspace.Packed) and residual_in_place(z, y):
        calls = packed.get(("native_calls",), (w, b), dict)
    key = (id(source), id(y), id(z), id(filters))
    hit = None if calls is None else calls.get(key)
    if hit is not None and hit[1] is filters and all(
            ref() is a for ref, a in zip(hit[0], (source, y, z), strict=True)):
        ready = hit[2]
    else:
        ready = native_calls(layout, source, x, filters, z, y, act)
        if ready is None:
            return False
        if calls is not None:
            _kept(calls, key, (tuple(_ref(a) for a in (source, y, z)), filters, ready))
    for call in ready:
        call.run(threads)
    if act[0] not in ("", "clip"):
        finish(xp, y, y, None, act)
    return True


# One step of the gathered-images form: its images' phase copy, then their products.
_ImageStep = tuple[Callable[[], None], Sequence["NativeCall"]]


def _native_images(layout: NativeLayout, x: Any, filters: Any, z: Any, y: Any,
                   act: Activation, packed: Any, threads: int) -> bool:
    """The gathered-images form: each step's phase copy into one step's phase image,
    then that step's products, so they read the copy from cache (prepared once per set
    of arrays, as :func:`native` keeps its calls); False when not served (nothing
    written)."""
    if x.shape[0] != layout.images or not x.flags.c_contiguous or np.may_share_memory(x, y):
        return False                     # image i's Y could overwrite a later image's X
    if z is not None and not native_gemm.same_memory(z, y) and np.may_share_memory(z, y):
        return False                     # ... or a later image's Z
    image = workspace.filled(np, ("native_phases", layout), phase_image_shape(layout),
                             x.dtype, 0.0)
    calls = None
    if isinstance(packed, workspace.Packed) and residual_in_place(z, y):
        calls = packed.get(("native_image_calls", threads, layout.step), (), dict)
    key = (id(x), id(y), id(z), id(image), id(filters))
    hit = None if calls is None else calls.get(key)
    if hit is not None and hit[1] is filters and all(
            ref() is a for ref, a in zip(hit[0], (x, y, z, image), strict=True)):
        steps = hit[2]
    else:
        steps = _image_steps(layout, image, x, filters, z, y, act, threads)
        if steps is None:
            return False
        if calls is not None:
            _kept(calls, key, (tuple(_ref(a) for a in (x, y, z, image)), filters, steps))
    for copy, products in steps:
        copy()
        for call in products:
            call.run(threads)
    if act[0] not in ("", "clip"):
        finish(np, y, y, None, act)
    return True


def _image_steps(layout: NativeLayout, image: Any, x: Any, filters: Any, z: Any, y: Any,
                 act: Activation, threads: int) -> list[_ImageStep] | None:
    """Per step of images: the copy of their phases into ``image`` and their products
    reading them; None when one is not served. A last step of fewer images has a layout
    (and phase image) of its own."""
    steps: list[_ImageStep] = []
    for i in range(0, layout.images, layout.step):
        k = min(layout.step, layout.images - i)
        part, buffer = layout, image
        if k != layout.step:
            part = _tail_layout(layout, k)
            buffer = workspace.filled(np, ("native_phases", part), phase_image_shape(part),
                                      x.dtype, 0.0)
        xi, yi = x[i:i + k], y[i:i + k]
        copy = bind_phase_copy(part, xi, buffer, threads)
        ready = native_calls(part, buffer, xi, filters,
                             None if z is None else z[i:i + k], yi, act)
        if copy is None or ready is None:
            return None
        steps.append((copy, ready))
    return steps


@functools.lru_cache(maxsize=64)
def _tail_layout(layout: NativeLayout, images: int) -> NativeLayout:
    """The gathered-images layout of a last step of ``images`` (fewer than its step),
    its products run as the plan says the others' do."""
    geo = dataclasses.replace(layout.geo, batch=images)
    tail = _native_layout(geo, "gathered-stacked" if images > 1 else "gathered")
    return dataclasses.replace(tail, nt=layout.nt, lanes=layout.lanes, streams=layout.streams,
                               images=layout.images, step=layout.step, tail=layout.tail)


class _Dead:
    """Stands in for a weak reference to None (an absent input)."""

    def __call__(self) -> None:
        return None


def _ref(a: Any) -> Any:
    return _Dead() if a is None else weakref.ref(a)


def native_source(xp: Any, layout: NativeLayout, x: Any, threads: int = 1) -> Any:
    """The array B is read from: X (C-contiguous), or its zero-bordered phase image
    (copied on up to ``threads`` of keel's threads where the window kernels run)."""
    if not layout.copied:
        return x if x.flags.c_contiguous else xp.ascontiguousarray(x)
    if layout.wide is not None:
        view = _wide_view(xp, layout, layout.wide, x.dtype)
        view[0] = x
        return view
    image = workspace.filled(xp, ("native_phases", layout), phase_image_shape(layout),
                             x.dtype, 0.0)
    if xp is np:
        copy = bind_phase_copy(layout, x, image, threads)
        if copy is not None:
            copy()
            return image
    every = (slice(None), slice(None))
    for f, (dst, src) in enumerate(layout.fills):
        dst_index: tuple[Any, ...] = (f, *every, *dst)
        src_index: tuple[slice, ...] = (*every, *src)
        image[dst_index] = x[src_index]
    return image


def phase_image_shape(layout: NativeLayout) -> tuple[int, ...]:
    """The shape of a copied layout's zero-bordered phase image: (phases, N, C, *q)."""
    geo = layout.geo
    return (len(layout.fills), geo.batch, geo.in_channels, *layout.q)


def native_scratch(layout: NativeLayout, itemsize: int) -> int:
    """Bytes of workspace the native conv of ``layout`` holds (:func:`native_source`):
    X's zero-bordered copy, the phase image or the wide buffer; 0 where it reads X in
    place. The packing workspace of each thread (``native_gemm``) is not the node's."""
    if not layout.copied:
        return 0
    if layout.wide is not None:
        return layout.wide.size * itemsize
    return math.prod(phase_image_shape(layout)) * itemsize


@functools.lru_cache(maxsize=256)
def _phase_geometry(layout: NativeLayout) -> Any:
    """The native phase copy's geometry of a layout's fills; None where it has none."""
    if not layout.copied or layout.wide is not None:
        return None
    return native_window.phase_geometry(layout.fills, layout.geo.window.in_spatial, layout.q)


def bind_phase_copy(layout: NativeLayout, x: Any, image: Any,
                    threads: int) -> native_window.Bound | None:
    """X's copy into the layout's phase image, split by planes over keel's threads, ready
    to run (a NumPy strided copy runs on one thread: at batch 32, 4 ms of ResNet-18's
    64-channel stride-2 conv); None where the window kernels do not serve it."""
    geometry = _phase_geometry(layout)
    if geometry is None:
        return None
    return native_window.bind_phase_copy(x, image, geometry, threads)


def _wide_buffer(xp: Any, layout: NativeLayout, wide: Wide, dtype: Any) -> Any:
    """The flat zero-bordered buffer of a copied wide layout (zeros set once)."""
    return workspace.filled(xp, ("native_wide", layout), (wide.size,), dtype, 0.0)


def _wide_view(xp: Any, layout: NativeLayout, wide: Wide, dtype: Any) -> Any:
    """X's place in the wide buffer as a (1, N, C, H, W) view (one "phase")."""
    geo = layout.geo
    flat = _wide_buffer(xp, layout, wide, dtype)
    return strided(xp, flat, wide.lead, (1, geo.batch, geo.in_channels, *layout.q),
                   (0, wide.image, wide.channel, wide.row, 1))


# A prepared kernel call of a native layout.
NativeCall = native_gemm.Call | native_gemm.BandCall | native_blocked.BlockedCall

# One group's GEMM operands: (B, C, residual, column map, lane masks), given the group
# index and its slices of C and the residual.
_Operands = tuple[Any, Any, Any, Any, Any]


def _group_calls(layout: NativeLayout, filters: Any, z: Any, y: Any, act: Activation,
                 operands: Callable[[int, Any, Any], _Operands]
                 ) -> list[native_gemm.Call] | None:
    """One prepared GEMM per group: filters on the left, ``operands`` building the rest;
    None when one is not served."""
    geo = layout.geo
    n, g, m = geo.batch, geo.group, geo.out_channels
    mg, p = m // g, math.prod(geo.window.out_spatial)
    clip = (act[1][0], act[1][1]) if act[0] == "clip" else None
    # Past the cache only where Y alone is final (a ReLU after the kernel rereads it).
    nt = layout.nt and act[0] in ("", "clip")
    y3 = y.reshape(n, m, p)
    res, accumulate = _native_residual(z, y, n, m, p)
    calls = []
    for gi, (wp, bias) in enumerate(filters):
        rows = slice(gi * mg, (gi + 1) * mg)
        b, target, resid, columns, masks = operands(
            gi, y3[:, rows], None if res is None else res[:, rows])
        call = native_gemm.prepare(wp, b, target, bias=bias, bias_rows=True, residual=resid,
                                   accumulate=accumulate, clip=clip, columns=columns,
                                   masks=masks, nt=nt, lanes=layout.lanes,
                                   output_streams=layout.streams, tail=layout.tail)
        if call is None:
            return None
        calls.append(call)
    return calls


def _wide_calls(layout: NativeLayout, wide: Wide, source: Any, x: Any, filters: Any, z: Any,
                y: Any, act: Activation) -> list[native_gemm.Call] | None:
    """The kernel calls of the wide layout (see :class:`Wide`)."""
    geo = layout.geo
    cg = geo.in_channels // geo.group
    if layout.copied:
        flat = _wide_buffer(np, layout, wide, source.dtype)
        if native_gemm.address(flat) + 4 * wide.lead != native_gemm.address(source):
            return None                      # not the buffer ``source`` views
    else:
        if source is not x or np.may_share_memory(x, y):
            return None
        flat = source.reshape(-1)

    def operands(gi: int, target: Any, resid: Any) -> _Operands:
        b = native_gemm.Rows(flat, wide.rows + gi * cg * wide.channel, wide.columns,
                             0 if wide.stacked else wide.image)
        if wide.stacked:
            target, resid = _spread(target), None if resid is None else _spread(resid)
        return b, target, resid, wide.out, None

    return _group_calls(layout, filters, z, y, act, operands)


def _masked_calls(layout: NativeLayout, masked: Masked, source: Any, x: Any, filters: Any,
                  z: Any, y: Any, act: Activation) -> list[native_gemm.Call] | None:
    """The kernel calls of the masked layout (see :class:`Masked`)."""
    geo = layout.geo
    cg, p = geo.in_channels // geo.group, math.prod(geo.window.out_spatial)
    if source is x and np.may_share_memory(x, y):
        return None                          # the kernel would read what it writes
    grid = native_gemm.geometry()
    if grid is None or grid[1] > 64:
        return None
    rows, depth = geo.out_channels // geo.group, cg * len(masked.taps)
    group = native_gemm.planner_rules().masked_panel_group(rows, depth, p, grid[1], grid[0])
    table = _masked_table(masked, grid[1], group)
    flat = source.reshape(-1)

    def operands(gi: int, target: Any, resid: Any) -> _Operands:
        b = native_gemm.Rows(flat[gi * cg * masked.channel:], masked.offsets, p, masked.image)
        return b, target, resid, None, table

    return _group_calls(layout, filters, z, y, act, operands)


def native_calls(layout: NativeLayout, source: Any, x: Any, filters: Any, z: Any, y: Any,
                  act: Activation
                  ) -> Sequence[NativeCall] | None:
    """The kernel calls computing every group; None when one is not served."""
    geo = layout.geo
    if layout.band:
        return _band_calls(layout, source, x, filters, z, y, act)
    if layout.blocked:
        return _blocked_calls(layout, source, x, filters, z, y, act)
    if layout.wide is not None:
        return _wide_calls(layout, layout.wide, source, x, filters, z, y, act)
    if layout.masked is not None:
        return _masked_calls(layout, layout.masked, source, x, filters, z, y, act)
    n, cg, p = geo.batch, geo.in_channels // geo.group, math.prod(geo.window.out_spatial)
    if source is x and np.may_share_memory(x, y):
        return None                          # the kernel would read what it writes

    def operands(gi: int, target: Any, resid: Any) -> _Operands:
        columns = None
        if layout.direct:
            b: Any = source.reshape(n, geo.in_channels, p)[:, gi * cg:(gi + 1) * cg]
        elif layout.stacked:
            b = native_gemm.Rows(source.reshape(-1), layout.rows + gi * cg * layout.plane,
                                 n * p, 0, layout.stack_cols)
            target, columns = _spread(target), layout.stack_out
            resid = None if resid is None else _spread(resid)
        else:
            b = native_gemm.Rows(source.reshape(-1), layout.rows + gi * cg * layout.plane,
                                 p, geo.in_channels * layout.plane, layout.cols)
        return b, target, resid, columns, None

    return _group_calls(layout, filters, z, y, act, operands)


def _band_calls(layout: NativeLayout, source: Any, x: Any, filters: Any, z: Any, y: Any,
                act: Activation) -> list[native_gemm.BandCall] | None:
    """The kernel call of the band layout (X read where it lies); None when not served."""
    win = layout.geo.window
    if source is not x or np.may_share_memory(x, y) or len(filters) != 1 or (
            z is not None and (z.dtype != np.float32 or not z.flags.c_contiguous
                               or np.may_share_memory(z, y))):
        return None
    wp, bias = filters[0]
    clip = (act[1][0], act[1][1]) if act[0] == "clip" else None
    call = native_gemm.prepare_band(x, wp, y, win.kernel, win.strides, win.dilations,
                                    win.pads_begin, bias=bias, residual=z, clip=clip,
                                    nt=layout.nt and act[0] in ("", "clip"))
    return None if call is None else [call]


def _blocked_calls(layout: NativeLayout, source: Any, x: Any, filters: Any, z: Any, y: Any,
                   act: Activation) -> list[native_blocked.BlockedCall] | None:
    """The kernel call of the blocked form (X read where it lies); None when not served."""
    if source is not x or not residual_in_place(z, y):
        return None
    rules = native_gemm.planner_rules()
    geo = layout.geo
    packed, bias = filters
    clip = (act[1][0], act[1][1]) if act[0] == "clip" else None
    call = native_blocked.prepare(
        x, packed, y, rules.blocked_oc_tile(geo.out_channels), rules.blocked_rows(geo),
        lambda threads: rules.blocked_split(geo, threads).pair,
        stride=geo.window.strides[0], bias=bias, residual=z, clip=clip, sides=layout.sides,
        wide=rules.blocked_wide(geo))
    return None if call is None else [call]


def _spread(a: Any) -> Any:
    """(N, M, P) with image stride S as one (M, (N - 1) * S + P) matrix with a.strides[1]
    between rows: column ``t * S + o`` of row m is element (t, m, o) (rows overlap;
    the stacked product's column map writes each element once)."""
    n, m, p = a.shape
    image = a.strides[0] // a.itemsize
    return np.lib.stride_tricks.as_strided(a, (m, (n - 1) * image + p),
                                           (a.strides[1], a.itemsize))


def _native_residual(z: Any, y: Any, n: int, m: int, p: int) -> tuple[Any, bool]:
    """Z as (N, M, P) for the kernel's residual, or (None, True) when Z is Y itself
    (the kernel then adds to what Y holds)."""
    if z is None:
        return None, False
    if native_gemm.same_memory(z, y):
        return None, True
    if np.may_share_memory(z, y) or z.dtype != np.float32:
        z = np.array(z, dtype=np.float32)
    return np.ascontiguousarray(z).reshape(n, m, p), False
