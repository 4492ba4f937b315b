"""Depthwise convolution (one input channel per group), written against ``xp``.

A depthwise conv has no reduction over channels, so there is no big GEMM to
hand to BLAS. Four formulations (:func:`depthwise_layout`):

* ``native`` (1-D and 2-D, channel multiplier 1, float32 on NumPy): the
  compiled window kernel of :mod:`keel.backends.cpu.native_window`. Every
  output is computed once in registers (fused multiply-adds over the taps of
  a phase-split copy of the input), with the bias, residual and clip applied
  on the way out: one pass over X and one over Y, where the NumPy forms below
  make several. Chosen first whenever the native tier is available; the
  layout keeps the NumPy form to fall back to (the gpu backend, float64, a
  tier that failed to build).

  Measured (2-core AMD EPYC, AVX-512, 1 thread, interleaved medians, bias and
  ReLU6 fused), MobileNetV2's 17 depthwise layers at batch 1: 1.77 ms native
  against 6.68 ms for the NumPy form chosen below (0.27x) and 1.76 ms for
  onnxruntime 1.31 (1.00x); at batch 8: 17.4 ms against 64.8 ms (0.27x) and
  25.9 ms (0.67x). Per layer, native/onnxruntime at batch 1 runs from 0.87x
  (96 ch 112x112 stride 2) to 1.45x (576 ch 14x14 stride 2: 7x7 planes, where
  onnxruntime's channel-blocked layout vectorizes across channels). Inside
  MobileNetV2 (profiled, 1 thread) the 17 depthwise nodes took 2.2 ms instead
  of 8.1-9.1 ms at batch 1 and 125 ms instead of 358 ms at batch 32; the
  whole model (``benchmarks.run``, shared machine) went from 2.54x to
  1.28-1.33x onnxruntime's time at batch 1 and from 2.75x to 1.50-1.97x at 32.

  At batch 32 the layers' inputs and outputs live in memory, not cache, and
  the kernel waited on it: the two 112x112-input layers ran 1.8x and 2.3x
  their cache-hot time. Prefetching the input of large stride-2 calls and
  computing rows of 32+ outputs straight into Y (no wide buffer to move out
  of) took the 17 layers (one call each, same values bitwise) from 79.9 ms to
  59.5 ms (96 ch 112x112 stride 2: 23.4 to 10.7 ms; 32 ch 112x112: 11.2 to
  8.2 ms; batch 1 unchanged at 1.6 ms); inside MobileNetV2 (profiled) from
  79-81 ms to 64 ms, the model from 1.35x to 1.29x onnxruntime's time
  (onnxruntime's own depthwise nodes take about 54 ms there, in its NCHWc
  layout). A node's call is bound once for the arrays it runs on
  (:class:`_Prepared`): 2.9 us instead of 4.5 us of Python around a small
  batch-1 call.

  Small planes: the kernel also computes 16 channels at once, one vector lane
  per plane (a 16x16 register transpose into a padded channels-interleaved
  copy, per-lane weights in registers, 16 outputs at a time transposed back to
  NCHW with the residual and clip): no wide outputs past each row, no
  per-plane copy and emit. Each lane runs the plane path's chain of fused
  multiply-adds, so the values are bitwise the same whichever scheme runs a
  plane (and any thread split). The cpu planner picks it (``depthwise_scheme``)
  where it measured faster inside MobileNetV2 (1 thread, blocked / plane time; numbers
  there): batch 1, unit strides up to 28x28 (0.78-0.96) and 14->7 s2 (0.87);
  batch 32, 7x7 s1 (0.82-0.91) and 28x28 s1 (0.81-0.91). Alone the batch-32
  14x14 layers ran 0.93-1.03, in the model 1.07-1.27 (the 16 planes a block
  streams at once wait on memory), so they keep the plane path. The model
  against onnxruntime (interleaved, one process, 21 / 400 runs): batch 32
  1.291x -> 1.275x (313.6 -> 309.9 ms against 242.9), batch 1 1.437x -> 1.398x
  (10.92 -> 10.63 ms against 7.60); the 17 nodes at batch 1 1.66 -> 1.55 ms.

  3x3 stride-2 convs padded by one may instead read X in place, the stride
  phases split in registers (no band copy; the ``strided`` scheme, the plane
  path's chain, the same bits), several output rows at a time (each input row split
  once for the two output rows it feeds) and rows of at most 8 outputs two to a
  vector: the planner picks it for every stride-2 layer it serves, MobileNetV2's four
  (inside the model at batch 1 the 14->7 layer 44.7 us blocked, 32.6 strided;
  docs/performance.md).

  Stride-1 layers whose output rows are as wide as the input's (the ``flat`` scheme)
  may also read X in place: 16 consecutive output pixels of a plane at a time, whatever
  rows they span, each tap one load at a fixed offset with the lanes whose tap falls
  outside X zeroed (the copy's padding); no copy, no transposes, no lanes wasted on row
  ends, the plane path's chain, the same bits. The planner picks it for every
  stride-1 layer it serves but the smallest planes in cache (MobileNetV2's 7x7 layers at
  batch 1 keep the blocked scheme; measurements in docs/performance.md).

The NumPy formulations, chosen by shape:

* ``rows`` (2-D): for each kernel column ``kw`` a copy of the (stride-phase
  split, padded, flattened) input shifted by that column's offset is stacked,
  so that for a fixed kernel row ``kh`` the ``KW`` taps of a channel form a
  (KW, L) matrix with one row stride. The conv is then ``KH`` batched
  matrix-vector products (one BLAS ``gemv`` per channel and kernel row, which
  multiplies and adds in one pass) and ``KH - 1`` adds; the bias rides in the
  first product as a row of ones. ``KW`` copies instead of the ``KH * KW`` of
  an im2col, and no ``2 * KH * KW`` separate multiply and add passes.
* ``channels_last`` (2-D, stride 1, multiplier 1, small planes): the input is
  copied channels-last into a padded wide buffer; the taps are then one
  strided view (kh, kw, N, L, C) and a single ``einsum`` multiplies and sums
  them in one pass with the channels as its contiguous inner loop. Wins where
  planes are small and channels many (the late layers of a MobileNet): there
  ``rows`` would make thousands of tiny BLAS calls.
* ``planes`` (any rank): one multiply and one add per tap over (N*C, L) views
  of the phase-split input (:mod:`keel.backends.cpu.window`).

Measured on the 2-core AMD EPYC (1 thread, 3x3, float32, interleaved), time
in us of rows / channels_last / planes at batch 1, then batch 8:
32 ch 112x112: 704 / 3310 / 964, 16284 / 28874 / 10952; 144 ch 56x56:
895 / 1933 / 1168, 13426 / 14952 / 9853; 144 ch 56x56 stride 2: 460 / 598 /
764, 4080 / 4901 / 6004; 192 ch 28x28: 340 / 521 / 802, 4875 / 4282 / 6102;
192 ch 28x28 stride 2: 203 / 198 / 329, 1893 / 1473 / 2116; 384 ch 14x14:
247 / 232 / 480, 2270 / 1732 / 3229; 576 ch 14x14 stride 2: 255 / 149 / 332,
1934 / 1026 / 2107; 960 ch 7x7: 295 / 145 / 407, 2187 / 1004 / 2802.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel import native
from keel.backends.bound import BoundCall
from keel.backends.cpu import native_window, workspace
from keel.backends.cpu import window as wnd
from keel.backends.cpu.conv_epilogue import Activation, finish
from keel.backends.cpu.conv_gemm import PhaseFill, strided, valid
from keel.native.pointers import weak as _ref
from keel.ops.schemas.conv import ConvGeometry

__all__ = ["FORMS", "DepthwiseLayout", "NodeRun", "depthwise", "depthwise_layout", "node_run"]

FORMS = ("native", "rows", "channels_last", "planes")



@dataclass(frozen=True, eq=False)     # identity-hashed: a fast workspace key
class DepthwiseLayout:
    """Shape-derived facts of one depthwise conv."""

    geo: ConvGeometry
    form: str                    # one of FORMS
    columns: int                 # L: wide positions per plane that cover every output
    block: tuple[int, int]       # images, channels computed at a time
    reason: str = ""             # why this form
    # The native form's C geometry, and the NumPy layout it falls back to.
    native: native_window.WindowGeometry | None = None
    fallback: DepthwiseLayout | None = None
    scheme: str = "auto"         # the bound native call's scheme (native_window)


def depthwise_layout(geo: ConvGeometry, form: str, block: tuple[int, int],
                     reason: str = "", scheme: str = "auto") -> DepthwiseLayout:
    """``geo`` in ``form`` (see the module docstring), as the cpu planner decided it
    (``keel.backends.cpu.planner.depthwise_form``).

    ``native|<form>``: the compiled kernel, with the NumPy ``<form>`` it runs while
    the native tier is unavailable. ``block``: the NumPy form's (images, channels)
    per block. ``scheme``: the bound native call's scheme.
    """
    win = geo.window
    name, _, numpy_form = form.partition("|")
    if name == "native":
        compiled = _native_geometry(geo)
        if compiled is None or numpy_form not in FORMS[1:]:
            raise ValueError(f"depthwise form {name!r} cannot run {win.rank}-D, "
                             f"{geo.in_channels}->{geo.out_channels} channels: "
                             f"{native_refusal(geo)} (NumPy form {numpy_form!r})")
        fallback = depthwise_layout(geo, numpy_form, block)
        if not native_window.ready():
            reason = (f"native (asked for): native kernels unavailable "
                      f"({native.status().reason}), so its NumPy form {numpy_form} runs")
        return DepthwiseLayout(geo, "native", fallback.columns, fallback.block,
                               reason, compiled, fallback, scheme)
    if form not in FORMS or (form != "planes" and win.rank != 2) or (
            form == "channels_last" and geo.out_channels != geo.in_channels):
        raise ValueError(f"depthwise form {form!r} cannot run {win.rank}-D, "
                         f"{geo.in_channels}->{geo.out_channels} channels; forms: {FORMS}")
    plan = wnd.wide_plan((1, geo.in_channels), win)
    columns = sum((o - 1) * r for o, r in zip(win.out_spatial, plan.row_strides,
                                              strict=True)) + 1
    return DepthwiseLayout(geo, form, columns, block, reason or f"{form}: asked for")


def _native_geometry(geo: ConvGeometry) -> native_window.WindowGeometry | None:
    if geo.out_channels != geo.in_channels:      # a channel multiplier: NumPy forms
        return None
    return native_window.plan(geo.in_channels, geo.window)


def native_serves(geo: ConvGeometry) -> bool:
    """Whether the compiled window kernel is ready here and serves ``geo``."""
    return native_window.ready() and _native_geometry(geo) is not None


def native_refusal(geo: ConvGeometry) -> str:
    """Why the native form does not serve ``geo``."""
    if geo.out_channels != geo.in_channels:
        return f"channel multiplier {geo.out_channels // geo.in_channels} (serves 1)"
    if _native_geometry(geo) is not None:
        return f"native kernels unavailable ({native.status().reason})"
    return (f"{geo.window.rank}-D window outside the compiled kernel's range (1-D/2-D, "
            f"strides <= {native_window.MAX_STRIDE}, <= {native_window.MAX_TAPS} taps)")


def depthwise(xp: Any, layout: DepthwiseLayout, x: Any, w: Any, b: Any, z: Any, y: Any,
              act: Activation, packed: Any = None, threads: int = 1) -> None:
    """y = act(depthwise_conv(x, w) + b + z), in blocks of images and channels.

    ``threads`` splits the native form's planes; the NumPy forms run on one.
    """
    if layout.form == "native":
        if xp is np and x.dtype == np.float32 and native_window.ready():
            _native(layout, x, w, b, z, y, act, threads)
            return
        assert layout.fallback is not None    # the native form always has one
        layout = layout.fallback
    if layout.form == "rows":
        geo = layout.geo
        w4 = workspace.form(xp, packed, "depthwise_rows", (w, b),
                            lambda xp_, a: _pack_rows(xp_, geo, a[0], a[1]))
        run = functools.partial(_rows, xp, layout, w4)
    elif layout.form == "channels_last":
        w3 = workspace.form(xp, packed, "depthwise_nhwc", (w,), _pack_channels_last)
        run = functools.partial(_channels_last, xp, layout, w3, b)
    else:
        run = functools.partial(_planes, xp, layout, w, b)
    n, c = x.shape[:2]
    mult = layout.geo.out_channels // c
    nb, cb = layout.block
    for n0 in range(0, n, nb):
        for c0 in range(0, c, cb):
            n1, c1 = min(n, n0 + nb), min(c, c0 + cb)
            whole = n1 - n0 == n and c1 - c0 == c
            out = (slice(n0, n1), slice(c0 * mult, c1 * mult))
            run(x if whole else x[n0:n1, c0:c1], c0, c1,
                None if z is None else (z if whole else z[out]), y if whole else y[out], act)


# ---- native ---------------------------------------------------------------------------------
class _Prepared:
    """A depthwise node's native call bound to its arrays (:class:`native_window.Bound`),
    run again while the kernel sees the same arrays, layout, activation and thread
    count: a model's node does every run, and then skips the argument checks and
    conversions (3.2 of the 4.5 us of a small batch-1 call). Weak references: a
    binding never keeps an array alive, and never serves another one at its address.
    """

    __slots__ = ("act", "b", "call", "layout", "threads", "w", "x", "y", "z")

    def __init__(self, layout: DepthwiseLayout, x: Any, w: Any, b: Any, z: Any, y: Any,
                 act: Activation, threads: int, call: native_window.Bound) -> None:
        self.layout, self.act, self.threads, self.call = layout, act, threads, call
        self.x, self.w, self.b, self.z, self.y = _ref(x), _ref(w), _ref(b), _ref(z), _ref(y)

    def serves(self, layout: DepthwiseLayout, x: Any, w: Any, b: Any, z: Any, y: Any,
               act: Activation, threads: int) -> bool:
        return (self.layout is layout and self.x() is x and self.y() is y and self.w() is w
                and self.b() is b and self.z() is z and self.threads == threads
                and (self.act is act or self.act == act))


# Bound calls by the ids of (X, Y, Z) and the thread: the scratch a call holds is its
# thread's.
_PREPARED: dict[tuple[int, ...], _Prepared] = {}
_PREPARED_LIMIT = 1024
_get_ident = threading.get_ident


class NodeRun:
    """A conv node's bound depthwise call behind the prepared-run interface of
    :mod:`keel.backends.cpu.conv` (``serves`` / ``run``), so a model's steady state
    can skip the plan lookup too. Made by :func:`node_run`."""

    __slots__ = ("attrs", "prepared", "variant")

    def __init__(self, variant: str, attrs: Any, prepared: _Prepared) -> None:
        self.variant, self.attrs, self.prepared = variant, attrs, prepared

    def serves(self, variant: str, x: Any, w: Any, b: Any, z: Any, y: Any, attrs: Any) -> bool:
        """Whether this is the computation of these arrays and attributes."""
        p = self.prepared
        return (self.attrs is attrs and self.variant == variant and p.x() is x
                and p.y() is y and p.w() is w and p.b() is b and p.z() is z)

    def run(self, x: Any, y: Any, threads: int) -> None:
        p = self.prepared
        if p.threads == threads:
            p.call()
        else:            # another thread count: bound afresh (and kept for the next run)
            _native(p.layout, x, p.w(), p.b(), p.z(), y, p.act, threads)


def node_run(variant: str, attrs: Any, x: Any, y: Any, z: Any) -> NodeRun | None:
    """The bound call that :func:`depthwise` just made for these arrays on this thread,
    as a :class:`NodeRun`; None when it bound none (a NumPy form, a copied input)."""
    ready = _PREPARED.get((id(x), id(y), id(z), _get_ident()))
    if ready is None or ready.x() is not x or ready.y() is not y or ready.z() is not z:
        return None
    return NodeRun(variant, attrs, ready)


def _bindable(arrays: tuple[Any, ...]) -> bool:
    """Whether the kernel runs on these arrays as they are (no copy per call)."""
    return all(a is None or (a.dtype == np.float32 and a.flags.c_contiguous) for a in arrays)


def bind(layout: DepthwiseLayout, x: Any, w: Any, b: Any, z: Any, y: Any, act: Activation,
         threads: int) -> BoundCall[None] | None:
    """The native form's call bound to these arrays, for a program step to call directly
    (the general path's plan lookup and checks, 3-4 us a call, skipped); None where the
    form is not native or the kernel would run on a copy or need a second pass."""
    if (layout.form != "native" or type(x) is not np.ndarray or x.dtype != np.float32
            or not native_window.ready()):
        return None
    bound = _bound(layout, x, w, b, z, y, act, threads)
    return None if bound is None else native_window.step(bound)


def _bound(layout: DepthwiseLayout, x: Any, w: Any, b: Any, z: Any, y: Any, act: Activation,
           threads: int) -> native_window.Bound | None:
    """The native kernel bound to these arrays (None: it would read copies of them, or
    the activation needs a pass of its own)."""
    assert layout.native is not None
    name, params = act
    clip = (float(params[0]), float(params[1])) if name == "clip" else None
    if not ((clip is not None or not name) and _bindable((x, w, b, z, y)) and (
            z is None or z is y or not np.may_share_memory(z, y))):
        return None
    return native_window.bind_depthwise_conv(x, w, b, z, y, layout.native, clip, threads,
                                             layout.scheme)


def _native(layout: DepthwiseLayout, x: Any, w: Any, b: Any, z: Any, y: Any, act: Activation,
            threads: int) -> None:
    assert layout.native is not None
    key = (id(x), id(y), id(z), _get_ident())
    ready = _PREPARED.get(key)
    if ready is not None and ready.serves(layout, x, w, b, z, y, act, threads):
        ready.call()
        return
    f32 = np.float32
    name, params = act
    clip = (float(params[0]), float(params[1])) if name == "clip" else None
    call = _bound(layout, x, w, b, z, y, act, threads)
    if call is not None:
        ready = _Prepared(layout, x, w, b, z, y, act, threads, call)
        if len(_PREPARED) >= _PREPARED_LIMIT:
            _PREPARED.clear()
        _PREPARED[key] = ready
        ready.call()
        return
    direct = y.dtype == f32 and y.flags.c_contiguous
    target = y if direct else np.empty(y.shape, f32)
    native_window.depthwise_conv(
        np.ascontiguousarray(x), np.ascontiguousarray(w, dtype=f32),
        None if b is None else np.ascontiguousarray(b, dtype=f32),
        None if z is None else np.ascontiguousarray(z, dtype=f32),
        target, layout.native, clip, threads, layout.scheme)
    if name and clip is None:         # activations other than relu / clip: one more pass
        finish(np, target, target, None, act)
    if not direct:
        y[...] = target


# ---- rows -----------------------------------------------------------------------------------
def _pack_rows(xp: Any, geo: ConvGeometry, w: Any, b: Any) -> Any:
    """W as (KH, C, mult, KW + 1): per kernel row, each channel's KW weights; the bias
    (or 0) in the last column of kernel row 0."""
    c, m = geo.in_channels, geo.out_channels
    kh, kw = geo.window.kernel
    packed = xp.zeros((kh, c, m // c, kw + 1), dtype=w.dtype)
    packed[..., :kw] = w.reshape(c, m // c, kh, kw).transpose(2, 0, 1, 3)
    if b is not None:
        packed[0, :, :, kw] = b.reshape(c, m // c)
    return packed


class _RowsBuffers:
    """Shifted copies of the input and every view the ``rows`` formulation reads."""

    def __init__(self, xp: Any, layout: DepthwiseLayout, n: int, c: int, dtype: Any) -> None:
        geo = layout.geo
        win = geo.window
        mult = geo.out_channels // geo.in_channels
        kh, kw = win.kernel
        (sh, sw), (dh, dw) = win.strides, win.dilations
        plan = wnd.wide_plan((n, c), win)
        self.fill = PhaseFill(xp, plan, dtype)
        img, pl, wq = self.fill.image, plan.plane, plan.q[1]
        ncol = layout.columns
        # shifted[r, (n, c), j, :]: for row phase r, kernel column j's phase plane
        # shifted by its column offset; the last row (j == kw) holds ones for the bias.
        self.shifted = xp.ones((sh, n * c, kw + 1, pl), dtype=dtype)
        self.copies = []
        for r in range(sh):
            for j in range(kw):
                phase = r * sw + (j * dw) % sw
                src = strided(xp, img[phase], (j * dw) // sw, (n * c, pl), (pl, 1))
                self.copies.append((self.shifted[r, :, j], src))
        self.taps = []
        for i in range(kh):
            r, shift = (i * dh) % sh, (i * dh) // sh * wq
            rows = kw + 1 if i == 0 else kw
            self.taps.append(self.shifted[r, :, :rows, shift: shift + ncol].reshape(
                n, c, rows, ncol))
        self.acc = xp.empty((n, c, mult, ncol), dtype=dtype)
        self.tmp = xp.empty((n, c, mult, ncol), dtype=dtype) if kh > 1 else None
        self.valid = valid(xp, self.acc, (n, c * mult, *plan.out), (c * mult * ncol, ncol),
                           plan.row_strides)
        self.nbytes = int(img.nbytes + self.shifted.nbytes + 2 * self.acc.nbytes)


def _rows(xp: Any, layout: DepthwiseLayout, w4: Any, x: Any, c0: int, c1: int, z: Any,
          y: Any, act: Activation) -> None:
    n, c = x.shape[:2]
    ready = workspace.bound(xp, (layout, n, c, x.dtype),
                            lambda: _RowsBuffers(xp, layout, n, c, x.dtype))
    kw = layout.geo.window.kernel[1]
    ready.fill(x)
    for dst, src in ready.copies:
        dst[...] = src
    w4 = w4[:, c0:c1]
    xp.matmul(w4[0], ready.taps[0], out=ready.acc)
    for i in range(1, len(ready.taps)):
        xp.matmul(w4[i, :, :, :kw], ready.taps[i], out=ready.tmp)
        xp.add(ready.acc, ready.tmp, out=ready.acc)
    finish(xp, ready.valid, y, z, act)


# ---- channels_last --------------------------------------------------------------------------
def _pack_channels_last(xp: Any, arrays: tuple[Any, ...]) -> Any:
    w = arrays[0]
    return xp.ascontiguousarray(w.reshape(w.shape[0], -1).T)      # (KH*KW, C)


def _channels_last(xp: Any, layout: DepthwiseLayout, w3: Any, b: Any, x: Any, c0: int,
                   c1: int, z: Any, y: Any, act: Activation) -> None:
    geo = layout.geo
    win = geo.window
    n, c, h, wd = x.shape
    kh, kw = win.kernel
    (sh, sw), (dh, dw) = win.strides, win.dilations
    ho, wo = win.out_spatial
    hp = max(h + win.pads_begin[0] + win.pads_end[0], (ho - 1) * sh + (kh - 1) * dh + 1)
    wp = max(wd + win.pads_begin[1] + win.pads_end[1], (wo - 1) * sw + (kw - 1) * dw + 1)
    key = ("depthwise_nhwc", win.pads_begin, hp, wp)
    buf = workspace.filled(xp, key, (n, hp, wp, c), x.dtype, 0.0)
    pt, pl = win.pads_begin
    buf[:, pt:pt + h, pl:pl + wd] = x.transpose(0, 2, 3, 1)
    # Strides never spoil the inner loop here: it runs over the contiguous channels.
    taps = strided(xp, buf.reshape(-1), 0, (kh, kw, n, ho, wo, c),
                   (dh * wp * c, dw * c, hp * wp * c, sh * wp * c, sw * c, 1))
    acc = workspace.empty(xp, "depthwise_nhwc_acc", (n, ho, wo, c), x.dtype)
    weights = w3[:, c0:c1].reshape(kh, kw, c)
    if xp is np:
        xp.einsum("ijnhwc,ijc->nhwc", taps, weights, out=acc)
    else:                                  # CuPy's einsum takes no ``out``
        acc[...] = xp.einsum("ijnhwc,ijc->nhwc", taps, weights)
    if b is not None:
        xp.add(acc, b[c0:c1], out=acc)
    finish(xp, acc.transpose(0, 3, 1, 2), y, z, act)


# ---- planes ---------------------------------------------------------------------------------
def _planes(xp: Any, layout: DepthwiseLayout, w: Any, b: Any, x: Any, c0: int, c1: int,
            z: Any, y: Any, act: Activation) -> None:
    geo = layout.geo
    n, c = x.shape[:2]
    mult = geo.out_channels // geo.in_channels
    plan = wnd.wide_plan(x.shape, geo.window)
    img = wnd.phase_image(xp, x, plan, 0.0, "depthwise")
    ncol, pl = layout.columns, plan.plane
    taps = len(plan.tap_offset)
    weights = w.reshape(geo.in_channels, mult, taps)[c0:c1]
    acc = workspace.empty(xp, "depthwise_acc", (n, c, mult, ncol), x.dtype)
    tmp = workspace.empty(xp, "depthwise_tmp", (n, c, mult, ncol), x.dtype)
    for t, (phase, off) in enumerate(zip(plan.tap_phase, plan.tap_offset, strict=True)):
        tap = strided(xp, img[phase], off, (n, c, 1, ncol), (c * pl, pl, 0, 1))
        xp.multiply(tap, weights[:, :, t:t + 1], out=acc if t == 0 else tmp)
        if t:
            xp.add(acc, tmp, out=acc)
    if b is not None:
        xp.add(acc, b.reshape(geo.in_channels, mult, 1)[c0:c1], out=acc)
    m = c * mult
    finish(xp, valid(xp, acc, (n, m, *plan.out), (m * ncol, ncol), plan.row_strides),
           y, z, act)
