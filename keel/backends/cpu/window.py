"""Sliding windows as flat slices: the engine of pooling and depthwise convolution.

NumPy pays a fixed cost per innermost loop, so an op over a strided window
view (rows of a few dozen elements) runs several times slower than the same
op over one long contiguous run. This module lays the (padded) input out so
that a kernel tap of *every* output position of *every* image and channel is
one contiguous slice:

* the padded input is split into ``stride`` phases per spatial dim
  (``phase[φ][q] = padded[q * stride + φ]``), so a strided window becomes a
  unit-stride one inside a phase; phases are the outermost axis;
* within a phase the (N, C, *q) image is flat. Output position ``o`` of
  plane ``(n, c)`` lives at flat index ``(n * C + c) * plane + sum(o_d *
  qs_d)`` (``qs_d`` the phase image's row strides), and the tap at kernel
  offset ``k`` is the same index shifted by ``sum((k_d * d_d) // s_d * qs_d)``
  in phase ``(k_d * d_d) % s_d``: one slice of length ``N * C * plane``.

A window op then runs one elementwise op per tap over ``(N, C, plane)``
arrays (positions past an output row read neighbouring data: garbage that is
never extracted) and takes the valid positions once at the end.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from keel.backends.cpu import workspace
from keel.ops.schemas.conv import Window

__all__ = ["WidePlan", "phase_image", "taps", "valid", "wide_plan"]


@dataclass(frozen=True)
class WidePlan:
    """Where every tap of a window lives in the phase-split, flattened input."""

    batch: int
    channels: int
    strides: tuple[int, ...]
    q: tuple[int, ...]                    # phase image dims
    out: tuple[int, ...]
    tap_phase: tuple[int, ...]            # per tap (row-major kernel offsets)
    tap_offset: tuple[int, ...]
    pads_begin: tuple[int, ...]
    in_spatial: tuple[int, ...]
    # Per phase: (destination slices in the phase image, source slices of X).
    fills: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...] = ()

    @property
    def phases(self) -> int:
        return math.prod(self.strides)

    @property
    def plane(self) -> int:
        """Elements per (n, c) plane of a phase: the last axis of every tap."""
        return math.prod(self.q)

    @property
    def wide(self) -> int:
        return self.plane

    @property
    def slack(self) -> int:
        """Room after the last plane so that the most shifted tap stays in bounds."""
        return max(self.tap_offset, default=0)

    @property
    def row_strides(self) -> tuple[int, ...]:
        return tuple(math.prod(self.q[d + 1:]) for d in range(len(self.q)))


def wide_plan(x_shape: Sequence[int], win: Window) -> WidePlan:
    """Plan the phase split of X (N, C, *spatial) for ``win`` (cached per shape and window)."""
    return _wide_plan(tuple(int(d) for d in x_shape[:2]), win)


@functools.lru_cache(maxsize=512)
def _wide_plan(nc: tuple[int, ...], win: Window) -> WidePlan:
    rank = win.rank
    reach = [(k - 1) * d // s for k, d, s in zip(win.kernel, win.dilations, win.strides,
                                                 strict=True)]
    q = tuple(max(o + r, -(-(i + pb) // s)) for o, r, i, pb, s in
              zip(win.out_spatial, reach, win.in_spatial, win.pads_begin, win.strides,
                  strict=True))
    qs = [math.prod(q[d + 1:]) for d in range(rank)]
    phase_strides = [math.prod(win.strides[d + 1:]) for d in range(rank)]
    tap_phase: list[int] = []
    tap_offset: list[int] = []
    for offs in itertools.product(*(range(k) for k in win.kernel)):
        at = [k * d for k, d in zip(offs, win.dilations, strict=True)]
        tap_phase.append(sum((a % s) * ps for a, s, ps in
                             zip(at, win.strides, phase_strides, strict=True)))
        tap_offset.append(sum((a // s) * r for a, s, r in zip(at, win.strides, qs, strict=True)))
    return WidePlan(nc[0], nc[1], tuple(win.strides), q, tuple(win.out_spatial),
                    tuple(tap_phase), tuple(tap_offset), tuple(win.pads_begin),
                    tuple(win.in_spatial), _fills(win))


def _fills(win: Window) -> tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]:
    """Where each phase's input elements go: phase[q0 : q0 + count] = x[first::stride]."""
    fills = []
    for phis in itertools.product(*(range(s) for s in win.strides)):
        dst: list[slice] = []
        src: list[slice] = []
        for phi, s, pb, size in zip(phis, win.strides, win.pads_begin, win.in_spatial,
                                    strict=True):
            first = (phi - pb) % s            # first input index landing in this phase
            count = len(range(first, size, s))
            q0 = (first + pb) // s
            dst.append(slice(q0, q0 + count))
            src.append(slice(first, size, s))
        fills.append((tuple(dst), tuple(src)))
    return tuple(fills)


def phase_image(xp: Any, x: Any, plan: WidePlan, fill: float, tag: str = "window") -> Any:
    """X laid out as (phases, N * C * plane + slack); padding holds ``fill``."""
    n, c = plan.batch, plan.channels
    size = n * c * plan.plane
    key = (tag, plan.strides, plan.q, plan.pads_begin, plan.in_spatial)
    img = workspace.filled(xp, key, (plan.phases, size + plan.slack), x.dtype, fill)
    every = (slice(None), slice(None))
    for p, (dst, src) in enumerate(plan.fills):
        dst_index: tuple[slice, ...] = every + dst
        src_index: tuple[slice, ...] = every + src
        img[p, :size].reshape(n, c, *plan.q)[dst_index] = x[src_index]
    return img


def taps(img: Any, plan: WidePlan) -> list[Any]:
    """One contiguous (N, C, plane) view per kernel tap, in row-major kernel order."""
    n, c, plane = plan.batch, plan.channels, plan.plane
    size = n * c * plane
    return [img[p, off:off + size].reshape(n, c, plane) for p, off in
            zip(plan.tap_phase, plan.tap_offset, strict=True)]


def valid(xp: Any, wide: Any, plan: WidePlan) -> Any:
    """The (..., *out) view of the valid positions of a (..., plane) array."""
    item = wide.itemsize
    lead = wide.shape[:-1]
    lead_strides = wide.strides[:-1]
    if wide.size and wide.strides[-1] != item:
        raise ValueError("the plane axis must be contiguous")
    strides = (*lead_strides, *(r * item for r in plan.row_strides))
    return xp.lib.stride_tricks.as_strided(wide, (*lead, *plan.out), strides)
