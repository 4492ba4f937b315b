"""Depthwise convolution (one input channel per group), written against ``xp``.

A depthwise conv has no reduction over channels, so there is no GEMM to hand
to BLAS: it is a sum over kernel taps of a shifted input times a per-channel
weight. Two formulations, chosen by shape (:func:`layout`):

* ``planes`` (NCHW): the padded input is split into stride phases and
  flattened (:mod:`keel.backends.cpu.window`), so every tap of every channel
  is one (N*C, L) view with long contiguous rows; one multiply and one add per
  tap over it. Best for large planes, and the only one for strides or
  channel multipliers.
* ``channels_last`` (stride 1, multiplier 1): the input is copied channels-last
  into a padded wide buffer; the taps are then one strided view (kh, kw, N,
  L, C) and a single ``einsum`` multiplies and sums them in one pass with the
  channels as its contiguous inner loop. Best for small planes with many
  channels (the late layers of a MobileNet), where ``planes`` runs short rows.

Measured on the 2-core AMD EPYC (1 thread, batch 1, 3x3, stride 1, float32),
``channels_last`` (transposes in and out included) against ``planes``:
960 ch 7x7 148 vs 276 us, 576 ch 14x14 318 vs 466 us, 192 ch 28x28 477 vs
523 us, 144 ch 56x56 1741 vs 1365 us, 32 ch 112x112 2834 vs 695 us.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from keel.backends.cpu import window as wnd
from keel.backends.cpu import workspace
from keel.backends.cpu.conv_epilogue import Activation, finish
from keel.backends.cpu.conv_gemm import strided, valid
from keel.ops.schemas.conv import ConvGeometry

__all__ = ["DepthwiseLayout", "depthwise", "depthwise_layout"]

# channels_last serves stride-1 2-D depthwise convs with at most this many
# output pixels per plane (measured crossover between 28x28 and 56x56).
CHANNELS_LAST_MAX_PIXELS = 1024


@dataclass(frozen=True)
class DepthwiseLayout:
    """Shape-derived facts of one depthwise conv."""

    geo: ConvGeometry
    channels_last: bool
    columns: int                 # L: wide positions per plane that cover every output


def depthwise_layout(geo: ConvGeometry) -> DepthwiseLayout:
    """Pick the formulation for ``geo`` (see the module docstring)."""
    win = geo.window
    plan = wnd.wide_plan((1, geo.in_channels), win)
    columns = sum((o - 1) * r for o, r in zip(win.out_spatial, plan.row_strides,
                                              strict=True)) + 1
    channels_last = (win.rank == 2 and all(s == 1 for s in win.strides)
                     and geo.out_channels == geo.in_channels
                     and math.prod(win.out_spatial) <= CHANNELS_LAST_MAX_PIXELS)
    return DepthwiseLayout(geo, channels_last, columns)


def depthwise(xp: Any, layout: DepthwiseLayout, x: Any, w: Any, b: Any, z: Any, y: Any,
              act: Activation, packed: Any = None) -> None:
    """y = act(depthwise_conv(x, w) + b + z)."""
    if layout.channels_last:
        _channels_last(xp, layout, x, w, b, z, y, act, packed)
    else:
        _planes(xp, layout, x, w, b, z, y, act)


def _planes(xp: Any, layout: DepthwiseLayout, x: Any, w: Any, b: Any, z: Any, y: Any,
            act: Activation) -> None:
    geo = layout.geo
    n, c = x.shape[:2]
    mult = geo.out_channels // c
    plan = wnd.wide_plan(x.shape, geo.window)
    img = wnd.phase_image(xp, x, plan, 0.0, "depthwise")
    ncol, pl = layout.columns, plan.plane
    taps = len(plan.tap_offset)
    weights = w.reshape(c, mult, taps)
    acc = workspace.empty(xp, "depthwise_acc", (n, c, mult, ncol), x.dtype)
    tmp = workspace.empty(xp, "depthwise_tmp", (n, c, mult, ncol), x.dtype)
    for t, (phase, off) in enumerate(zip(plan.tap_phase, plan.tap_offset, strict=True)):
        tap = strided(xp, img[phase], off, (n, c, 1, ncol), (c * pl, pl, 0, 1))
        xp.multiply(tap, weights[:, :, t:t + 1], out=acc if t == 0 else tmp)
        if t:
            xp.add(acc, tmp, out=acc)
    if b is not None:
        xp.add(acc, b.reshape(c, mult, 1), out=acc)
    m = geo.out_channels
    finish(xp, valid(xp, acc, (n, m, *plan.out), (m * ncol, ncol), plan.row_strides),
           y, z, act)


def _channels_last(xp: Any, layout: DepthwiseLayout, x: Any, w: Any, b: Any, z: Any,
                   y: Any, act: Activation, packed: Any) -> None:
    geo = layout.geo
    win = geo.window
    n, c, h, wd = x.shape
    kh, kw = win.kernel
    dh, dw = win.dilations
    hp = h + win.pads_begin[0] + win.pads_end[0]
    wp = wd + win.pads_begin[1] + win.pads_end[1]
    plane = hp * wp
    slack = (kh - 1) * dh * wp + (kw - 1) * dw
    key = ("depthwise_nhwc", win.pads_begin, win.pads_end)
    buf = workspace.filled(xp, key, (n, plane + slack, c), x.dtype, 0.0)
    inner = buf[:, :plane].reshape(n, hp, wp, c)
    pt, pl = win.pads_begin
    inner[:, pt:pt + h, pl:pl + wd] = x.transpose(0, 2, 3, 1)
    ncol = layout.columns
    taps = strided(xp, buf.reshape(-1), 0, (kh, kw, n, ncol, c),
                   (dh * wp * c, dw * c, (plane + slack) * c, c, 1))
    w3 = workspace.form(xp, packed, "depthwise_nhwc", (w,),
                        lambda xp_, a: xp_.ascontiguousarray(
                            a[0].reshape(c, kh, kw).transpose(1, 2, 0)))
    acc = workspace.empty(xp, "depthwise_nhwc_acc", (n, ncol, c), x.dtype)
    xp.einsum("ijnlc,ijc->nlc", taps, w3, out=acc)
    if b is not None:
        xp.add(acc, b, out=acc)
    ho, wo = win.out_spatial
    finish(xp, valid(xp, acc, (n, c, ho, wo), (ncol * c, 1), (wp * c, c)), y, z, act)
