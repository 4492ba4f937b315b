"""Depthwise convolution and pooling through the compiled window kernels.

The C side (``keel/native/src/window.c``) computes each output of a window
op once, in registers, from a phase-split copy of a band of input rows; see
its header comment. This module is the NumPy-facing half: it describes a
window as the int64 geometry array the C functions take, keeps one scratch
buffer per thread, and splits the planes (N * C) of a call into chunks on
keel's worker threads (a kernel's ``*_mt`` entry point; see
:mod:`keel.native.pool`). Each plane is computed the same way whatever the
split, so any thread count gives bitwise the same result.

Everything here takes C-contiguous float32 NumPy arrays of rank 3 or 4
(N, C, [H,] W) and windows of rank 1 or 2. :func:`plan` describes a window
without needing the library (callers cache it with their own shape plans);
:func:`ready` says whether the kernels can run now. A batch-1 call costs
about 1.5 µs of Python around the C function, so the small pools of a LeNet
gain too (4.3 µs against 6.9 µs for the NumPy kernel). Measurements:
:mod:`keel.backends.cpu.depthwise` and :mod:`keel.backends.cpu.pooling`.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel import native
from keel.backends.bound import BoundCall
from keel.backends.cpu import workspace
from keel.backends.cpu.native_gemm import planner_rules
from keel.backends.cpu.workspace import Scratch
from keel.errors import InvalidArgumentError
from keel.ops.schemas.conv import Window

__all__ = ["Bound", "WindowGeometry", "avg_counts", "avg_pool", "bind_avg_pool", "clip_bounds",
           "bind_depthwise_conv", "bind_global_avg_pool", "bind_global_max_pool",
           "bind_gather", "bind_max_pool", "bind_phase_copy", "bind_strided_copy",
           "copy_strided",
           "depthwise_conv", "global_avg_pool", "global_max_pool", "max_pool",
           "phase_geometry", "plan", "ready", "scheme_ok", "SCHEMES", "step"]

LIBRARY = "window"
# Limits of window.c (MAX_TAPS, MAX_STRIDE).
MAX_TAPS = 1024
MAX_STRIDE = 16
# The depthwise schemes, as keel_dwconv2d_mode_f32's mode.
SCHEMES = {"planes": 1, "blocked": 2, "strided": 3, "flat": 4}

_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class _Functions:
    scratch: Any
    dwconv_mode: Any
    dwconv_scheme_ok: Any   # keel_dwconv2d_scheme_ok: whether a scheme serves a geometry
    maxpool: Any
    avgpool: Any
    global_max: Any
    global_avg: Any
    dwconv_mt: Any       # the *_mt entry points: (..., planes, parts), on keel's threads
    maxpool_mt: Any
    maxpool_rows: Any    # keel_maxpool_rows_f32: stride 2 across, by output rows
    maxpool_rows_mt: Any
    maxpool_rows_scratch: Any
    maxpool_part: Any    # keel_maxpool_part_f32: output rows from part of X (a conv's rows)
    avgpool_mt: Any
    global_max_mt: Any
    global_avg_mt: Any
    phase_copy_mt: Any   # keel_phase_copy_mt_f32: stride-phase copies of planes
    strided_copy_mt: Any  # keel_strided_copy_mt: a strided view into a C-contiguous array
    gather_rows_mt: Any  # keel_gather_rows_mt: a Gather's rows, indices checked first


_loaded: tuple[native.NativeLibrary, _Functions] | None = None


def _load() -> _Functions | None:
    """The C functions of the loaded library (None when the tier is unavailable)."""
    global _loaded
    lib = native.library(LIBRARY)
    if lib is None:
        return None
    if _loaded is not None and _loaded[0] is lib:
        return _loaded[1]
    f = lib.function
    fns = _Functions(
        scratch=f("keel_window_scratch", [_P], _I),
        dwconv_mode=f("keel_dwconv2d_mode_f32", [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I],
                      _I),
        dwconv_scheme_ok=f("keel_dwconv2d_scheme_ok", [_P, _I], _I),
        maxpool=f("keel_maxpool2d_f32", [_P, _P, _P, _P, _I, _I], _I),
        avgpool=f("keel_avgpool2d_f32", [_P, _P, _P, _P, _P, _I, _I], _I),
        global_max=f("keel_global_maxpool_f32", [_P, _P, _I, _I, _I], None),
        global_avg=f("keel_global_avgpool_f32", [_P, _P, _I, _I, _I], None),
        dwconv_mt=f("keel_dwconv2d_mt_f32", [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I], _I),
        maxpool_mt=f("keel_maxpool2d_mt_f32", [_P, _P, _P, _I, _I], _I),
        maxpool_rows=f("keel_maxpool_rows_f32", [_P, _P, _P, _P, _I, _I], _I),
        maxpool_rows_mt=f("keel_maxpool_rows_mt_f32", [_P, _P, _P, _I, _I], _I),
        maxpool_rows_scratch=f("keel_maxpool_rows_scratch", [_P], _I),
        maxpool_part=f("keel_maxpool_part_f32", [_P, _I, _I, _I, _P, _P, _P, _I, _I, _I],
                       _I),
        avgpool_mt=f("keel_avgpool2d_mt_f32", [_P, _P, _P, _P, _I, _I], _I),
        global_max_mt=f("keel_global_maxpool_mt_f32", [_P, _P, _I, _I, _I], _I),
        global_avg_mt=f("keel_global_avgpool_mt_f32", [_P, _P, _I, _I, _I], _I),
        phase_copy_mt=f("keel_phase_copy_mt_f32", [_P, _P, _P, _I, _I, _I], _I),
        strided_copy_mt=f("keel_strided_copy_mt", [_P, _P, _P, _I, _I], _I),
        gather_rows_mt=f("keel_gather_rows_mt", [_P, _P, _P, _I, _I, _I, _I, _I, _I], _I),
    )
    _loaded = (lib, fns)
    return fns


def ready() -> bool:
    """Whether the window kernels are built and loaded (else ``native.status()`` says why)."""
    return _load() is not None


def _functions() -> _Functions:
    fns = _load()
    if fns is None:
        raise RuntimeError(f"native window kernels unavailable: {native.status().reason}")
    return fns


@dataclass(frozen=True, eq=False)
class WindowGeometry:
    """One window over (N, C, [H,] W) planes as the C kernels take it."""

    window: Window
    channels: int
    array: np.ndarray            # int64: C, H, W, OH, OW, KH, KW, SH, SW, DH, DW, PT, PL
    address: int
    taps_per_plane: int          # output positions times kernel taps
    _scratch: list[int] = field(default_factory=list)     # floats, asked of C once

    def parts(self, planes: int, threads: int) -> int:
        """The chunks ``planes`` planes of this window split into on up to ``threads``
        threads, each the least work of a split that wide (the planner's split_parts)."""
        rules = planner_rules()
        return rules.split_parts(rules.LeastWork.TAPS, threads, planes, self.taps_per_plane)

    def scratch_floats(self, fns: _Functions) -> int:
        """Floats of scratch a thread needs for this window (asked of the library once)."""
        if not self._scratch:
            self._scratch.append(int(fns.scratch(self.address)))
        return self._scratch[0]

    def by_rows(self) -> bool:
        """Whether its max pool runs on window.c's row kernel (the cpu planner's
        ``max_pool_by_rows``) rather than the band copies."""
        w = self.window
        return w.rank == 2 and planner_rules().max_pool_by_rows(w.kernel, w.strides,
                                                                 w.dilations)


@functools.lru_cache(maxsize=512)
def plan(channels: int, win: Window) -> WindowGeometry | None:
    """The C description of ``win`` over planes of ``channels`` channels; None if unserved."""
    if win.rank not in (1, 2) or channels < 1:
        return None
    if win.rank == 1:          # a 1-D window is a 2-D one over a single row
        win2 = Window((1, *win.in_spatial), (1, *win.kernel), (1, *win.strides),
                      (1, *win.dilations), (0, *win.pads_begin), (0, *win.pads_end),
                      (1, *win.out_spatial))
    else:
        win2 = win
    h, w = win2.in_spatial
    oh, ow = win2.out_spatial
    if (min(h, w, oh, ow) < 1 or max(win2.strides) > MAX_STRIDE or min(win2.pads_begin) < 0
            or math.prod(win2.kernel) > MAX_TAPS):
        return None
    values = (channels, h, w, oh, ow, *win2.kernel, *win2.strides, *win2.dilations,
              *win2.pads_begin)
    array = np.array(values, dtype=np.int64)
    array.setflags(write=False)
    return WindowGeometry(win, channels, array, array.ctypes.data,
                          oh * ow * math.prod(win2.kernel))


def _check(rc: int) -> None:
    if rc != 0:
        raise RuntimeError("native window kernel refused its geometry (or a worker thread "
                           "found no memory for its scratch)")


class Bound:
    """One window kernel call with its arguments converted once: calling it runs the
    kernel again on the same arrays (what a model's node does every run).

    Made by the ``bind_*`` functions below for the calling thread (a call on one
    thread holds that thread's scratch buffer) and one thread count; it keeps the
    geometry and scratch alive, not X and Y (the caller runs it only while they
    live: see ``keel.backends.cpu.pooling``).
    """

    __slots__ = ("args", "fn", "keep")

    def __init__(self, fn: Any, args: tuple[Any, ...], keep: tuple[Any, ...]) -> None:
        self.fn, self.args, self.keep = fn, args, keep

    def __call__(self) -> None:
        if self.fn(*self.args) != 0:
            _check(1)


def step(bound: Callable[[], None]) -> BoundCall[None]:
    """``bound`` (a window kernel's call, or a step running such calls only) as a
    program step marked ``native``: it runs C code only, so NumPy's floating-point
    state means nothing to it."""
    return BoundCall(bound, native=True)


def _bind(planes: int, geo: WindowGeometry, fns: _Functions, threads: int, serial: Any,
          mt: Any, head: tuple[int | None, ...], tail: tuple[int, ...] = (),
          keep: tuple[Any, ...] = (), scratch_of: Any = None) -> Bound:
    """``serial(*head, scratch, 0, planes, *tail)`` on this thread, or, when the planes
    are worth several threads, ``mt(*head, *tail, planes, parts)`` on keel's.
    ``scratch_of(geometry)``: the floats of scratch ``serial`` needs, where that is not
    the window's own (keel_window_scratch)."""
    count = geo.parts(planes, threads)
    if count <= 1:
        floats = (geo.scratch_floats(fns) if scratch_of is None
                  else int(scratch_of(geo.address)))
        # This thread's buffer, at least 16K floats (small windows share one size); the
        # call keeps it, so a later, larger buffer never frees it under the call.
        buf = workspace.thread_scratch(Scratch.WINDOW, max(floats, 1 << 14))
        return Bound(serial, (*head, int(buf.ctypes.data), 0, planes, *tail),
                     (geo, buf, *keep))
    return Bound(mt, (*head, *tail, planes, count), (geo, *keep))


def bind_max_pool(x: np.ndarray, y: np.ndarray, geo: WindowGeometry, threads: int = 1
                  ) -> Bound:
    """:func:`max_pool` of these arrays, ready to run again (C-contiguous float32): on
    the row kernel where the planner takes it (:meth:`WindowGeometry.by_rows`), else
    on the band copies."""
    fns = _functions()
    head = (native.address(x), native.address(y), geo.address)
    planes = x.shape[0] * x.shape[1]
    if geo.by_rows():
        return _bind(planes, geo, fns, threads, fns.maxpool_rows, fns.maxpool_rows_mt, head,
                     scratch_of=fns.maxpool_rows_scratch)
    return _bind(planes, geo, fns, threads, fns.maxpool, fns.maxpool_mt, head)


def row_pool(geo: WindowGeometry) -> tuple[int, int] | None:
    """(the address of window.c's keel_maxpool_part_f32, the floats of scratch it needs)
    for a max pool of ``geo`` on the row kernel, which a native conv calls on its own
    rows (gemm.c's keel_conv_pool_f32); None where the row kernel does not serve ``geo``."""
    fns = _load()
    if fns is None or not geo.by_rows():
        return None
    floats = int(fns.maxpool_rows_scratch(geo.address))
    if floats < 0:
        return None
    return int(ctypes.cast(fns.maxpool_part, ctypes.c_void_p).value or 0), floats


def bind_avg_pool(x: np.ndarray, y: np.ndarray, geo: WindowGeometry, counts: np.ndarray,
                  threads: int = 1) -> Bound:
    """:func:`avg_pool` of these arrays, ready to run again (C-contiguous float32)."""
    fns = _functions()
    head = (native.address(x), native.address(y), geo.address, native.address(counts))
    return _bind(x.shape[0] * x.shape[1], geo, fns, threads, fns.avgpool, fns.avgpool_mt,
                 head, keep=(counts,))


def bind_depthwise_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                        z: np.ndarray | None, y: np.ndarray, geo: WindowGeometry,
                        clip: tuple[float, float] | None, threads: int = 1,
                        scheme: str = "auto") -> Bound:
    """:func:`depthwise_conv` of these arrays, ready to run again (C-contiguous float32);
    ``scheme`` is the node plan's (the cpu planner's ``depthwise_scheme``; "auto" asks
    that rule for these planes and threads)."""
    fns = _functions()
    addr = native.address
    bounds = None if clip is None else clip_bounds(clip)
    head = (addr(x), addr(w), None if b is None else addr(b), None if z is None else addr(z),
            addr(y), geo.address, None if bounds is None else addr(bounds))
    if scheme not in (*SCHEMES, "auto"):
        raise InvalidArgumentError(f"unknown depthwise scheme {scheme!r}; allowed: "
                         f"{sorted((*SCHEMES, 'auto'))}")
    planes = x.shape[0] * x.shape[1]
    if scheme == "auto":
        scheme = planner_rules().depthwise_scheme(geo, planes, threads)[0]
    return _bind(planes, geo, fns, threads, fns.dwconv_mode, fns.dwconv_mt,
                 head, (SCHEMES[scheme],), (bounds,))


def scheme_ok(geo: WindowGeometry, scheme: str) -> bool:
    """Whether the depthwise ``scheme`` serves ``geo`` in the loaded library (the blocked,
    strided and flat ones need AVX-512 and their geometries; "planes" serves every one)."""
    fns = _load()
    return fns is not None and fns.dwconv_scheme_ok(geo.address, SCHEMES[scheme]) == 1


def _bind_global(x: np.ndarray, y: np.ndarray, threads: int, serial: Any, mt: Any) -> Bound:
    """``serial(x, y, size, 0, planes)`` over each (N, C) plane on this thread, or ``mt``
    on keel's when the planes are worth several threads."""
    n, c = x.shape[:2]
    planes, size = n * c, math.prod(x.shape[2:])
    xa, ya = native.address(x), native.address(y)
    rules = planner_rules()
    count = rules.split_parts(rules.LeastWork.TAPS, threads, planes,
                              size * rules.GLOBAL_POOL_TAPS_PER_ELEMENT)
    if count <= 1:
        return _Unchecked(serial, (xa, ya, size, 0, planes), ())
    return Bound(mt, (xa, ya, size, planes, count), ())


def bind_global_max_pool(x: np.ndarray, y: np.ndarray, threads: int = 1) -> Bound:
    """:func:`global_max_pool` of these arrays, ready to run again (C-contiguous float32)."""
    fns = _functions()
    return _bind_global(x, y, threads, fns.global_max, fns.global_max_mt)


def bind_global_avg_pool(x: np.ndarray, y: np.ndarray, threads: int = 1) -> Bound:
    """:func:`global_avg_pool` of these arrays, ready to run again (C-contiguous float32)."""
    fns = _functions()
    return _bind_global(x, y, threads, fns.global_avg, fns.global_avg_mt)


class _Unchecked(Bound):
    """A bound call of a C function that returns nothing."""

    __slots__ = ()

    def __call__(self) -> None:
        self.fn(*self.args)


def depthwise_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, z: np.ndarray | None,
                   y: np.ndarray, geo: WindowGeometry, clip: tuple[float, float] | None,
                   threads: int = 1, scheme: str = "auto") -> None:
    """``y = clip(depthwise_conv(x, w) + b + z)``: one output channel per input channel.

    ``w`` holds ``C * taps`` weights (C, 1, *kernel); ``b`` (C,) and ``z`` (like
    ``y``) may be None, and so may ``clip`` (low, high). All C-contiguous float32.
    ``scheme`` forces the C kernel's scheme (for tests and measurements): "planes"
    (plane by plane), "blocked" (16 planes at a time where the geometry allows),
    "strided" (3x3 stride-2 convs padded by one read straight from ``x``, the stride
    phases split in registers, where the geometry allows), "flat" (stride 1 with output
    rows as wide as the input's: 16 consecutive output pixels at a time read straight
    from ``x``, the taps outside it masked), or "auto" (the cpu planner's measured rule,
    ``depthwise_scheme``). Every scheme gives the same bits.
    """
    bind_depthwise_conv(x, w, b, z, y, geo, clip, threads, scheme)()


_BOUNDS: dict[tuple[float, float], np.ndarray] = {}


def clip_bounds(clip: tuple[float, float]) -> np.ndarray:
    """``clip`` as a float32 pair (the same array for the same bounds)."""
    pair = _BOUNDS.get(clip)
    if pair is None:
        pair = np.array(clip, dtype=np.float32)
        if len(_BOUNDS) < 256:
            _BOUNDS[clip] = pair
    return pair


def max_pool(x: np.ndarray, y: np.ndarray, geo: WindowGeometry, threads: int = 1) -> None:
    """``y`` = the max over each window; padding never wins and NaN propagates."""
    bind_max_pool(x, y, geo, threads)()


def avg_pool(x: np.ndarray, y: np.ndarray, geo: WindowGeometry, counts: np.ndarray,
             threads: int = 1) -> None:
    """``y`` = the window sums divided by ``counts`` (float32 over the output plane)."""
    bind_avg_pool(x, y, geo, counts, threads)()


@functools.lru_cache(maxsize=256)
def avg_counts(win: Window, include_pad: bool) -> np.ndarray:
    """Positions each average-pool window counts, as a read-only float32 output plane.

    With ``include_pad`` the explicit pads count; positions past them (the end
    of a ceil-mode window) never do. A window that counts nothing gives 0 (and
    0 / 0 = NaN, as the reference backend).
    """
    per_dim = []
    for i, k, s, d, pb, pe, o in zip(win.in_spatial, win.kernel, win.strides, win.dilations,
                                     win.pads_begin, win.pads_end, win.out_spatial,
                                     strict=True):
        lo, hi = (-pb, i + pe) if include_pad else (0, i)
        pos = np.arange(o)[:, None] * s - pb + np.arange(k)[None, :] * d
        per_dim.append(((pos >= lo) & (pos < hi)).sum(axis=1))
    counts = functools.reduce(np.multiply.outer, per_dim).astype(np.float32)
    counts = np.ascontiguousarray(counts.reshape(win.out_spatial))
    counts.setflags(write=False)
    return counts


def global_max_pool(x: np.ndarray, y: np.ndarray, threads: int = 1) -> None:
    """``y`` (N, C, 1...) = the max of each plane (NaN if the plane holds one)."""
    bind_global_max_pool(x, y, threads)()


def global_avg_pool(x: np.ndarray, y: np.ndarray, threads: int = 1) -> None:
    """``y`` (N, C, 1...) = the mean of each plane: summed in 16 lanes, then across
    them in a fixed order, so every thread count gives the same bits."""
    bind_global_avg_pool(x, y, threads)()


# One stride-phase copy of a plane, as (destination slices, source slices) per spatial
# dimension: phase[f][p][dst] = x[p][src] (conv_gemm's fills).
Fill = tuple[tuple[slice, ...], tuple[slice, ...]]


def phase_geometry(fills: tuple[Fill, ...], in_spatial: tuple[int, ...],
                   phase_spatial: tuple[int, ...]) -> np.ndarray | None:
    """keel_phase_copy_mt_f32's int64 geometry of 2-D ``fills`` from planes of
    ``in_spatial`` into phase planes of ``phase_spatial`` (read-only); None when a fill
    is not 2-D with positive steps."""
    if len(in_spatial) != 2 or len(phase_spatial) != 2:
        return None
    values = [len(fills), *in_spatial, *phase_spatial]
    for dst, src in fills:
        if len(dst) != 2 or len(src) != 2:
            return None
        counts = [len(range(*d.indices(q))) for d, q in zip(dst, phase_spatial, strict=True)]
        if counts != [len(range(*s.indices(n))) for s, n in zip(src, in_spatial, strict=True)]:
            return None
        values += [dst[0].indices(phase_spatial[0])[0], dst[1].indices(phase_spatial[1])[0],
                   *counts, src[0].indices(in_spatial[0])[0],
                   src[1].indices(in_spatial[1])[0], src[0].step or 1, src[1].step or 1]
    array = np.array(values, dtype=np.int64)
    array.setflags(write=False)
    return array


def bind_phase_copy(x: np.ndarray, image: np.ndarray, geometry: np.ndarray,
                    threads: int = 1) -> Bound | None:
    """The copies of ``geometry`` (:func:`phase_geometry`) from ``x`` (N, C, H, W) into
    ``image`` (F, N, C, QH, QW), split by planes and bands of their rows over keel's
    threads as the cpu planner's ``phase_copy_split`` says, ready to run again
    (C-contiguous float32); None when the kernels cannot run them."""
    fns = _load()
    if (fns is None or x.dtype != np.float32 or image.dtype != np.float32 or x.ndim != 4
            or not x.flags.c_contiguous or not image.flags.c_contiguous
            or image.shape[1:3] != x.shape[:2] or image.shape[0] != geometry[0]
            or image.shape[3:] != tuple(geometry[3:5]) or x.shape[2:] != tuple(geometry[1:3])):
        return None
    planes = x.shape[0] * x.shape[1]
    bands, count = planner_rules().phase_copy_split(planes, x.shape[2], x.shape[3], threads)
    return Bound(fns.phase_copy_mt, (native.address(x), native.address(image),
                                     native.address(geometry), planes, bands, count),
                 (geometry,))


# window.c's COPY_MAX_RANK: the most dimensions keel_strided_copy_mt takes.
COPY_MAX_RANK = 8


def copy_strided(view: np.ndarray, dst: np.ndarray, threads: int) -> bool:
    """``dst[...] = view`` split by rows over keel's threads (a Transpose's copy: NumPy's
    runs on one thread); False when not served (nothing written): see
    :func:`bind_strided_copy`."""
    call = bind_strided_copy(view, dst, threads)
    if call is None:
        return False
    call()
    return True


def bind_strided_copy(view: np.ndarray, dst: np.ndarray, threads: int,
                      chunks: int | None = None) -> Bound | None:
    """The copy of :func:`copy_strided`, ready to run again on the same arrays; None when
    not served: the kernels absent, too little work for a second thread (the planner's
    least copy work each), a ``dst`` that is not C-contiguous of the view's shape and
    dtype, elements of another size than 1, 2, 4 or 8 bytes, or overlapping arrays.
    ``chunks``: that many, 1 included (one thread's rate, as thread_costs measures it)."""
    fns = _load()
    elem = view.dtype.itemsize
    n = view.shape[-1] if view.ndim else 0
    rows = view.size // n if n else 0
    rules = planner_rules()
    count = chunks or rules.split_parts(rules.LeastWork.COPY, threads, rows, n)
    if (fns is None or count < 1 or (chunks is None and count <= 1)
            or dst.shape != view.shape or dst.dtype != view.dtype
            or not dst.flags.c_contiguous or view.ndim > COPY_MAX_RANK
            or elem not in (1, 2, 4, 8) or view.dtype.hasobject
            or any(s % elem for s in view.strides) or np.may_share_memory(view, dst)):
        return None
    geometry = np.array([view.ndim, elem, *view.shape, *(s // elem for s in view.strides)],
                        dtype=np.int64)
    return Bound(fns.strided_copy_mt, (native.address(view), native.address(dst),
                                       native.address(geometry), rows, count), (geometry,))


def bind_gather(x: np.ndarray, indices: np.ndarray, dst: np.ndarray, axis: int,
                threads: int) -> Callable[[], int] | None:
    """``dst[...] = take(x, indices, axis)`` as window.c's row copy, split by rows (one
    index's slice each) over up to ``threads`` threads as the planner's least copy work
    allows, ready to run again on the same arrays: it returns 0, 1 (nothing written)
    when an index lies outside ``[-size, size)``, or -1 where a worker found no memory
    for its scratch (indexing.gather_failed names each).
    None when not served: the kernels absent, any of the three not an ndarray (a NumPy
    scalar has no buffer to pass), arrays not C-contiguous, a read-only ``dst`` (NumPy's
    take refuses it), indices other than native int32 or int64, ``dst`` not of the
    gather's shape and dtype, or an output sharing memory with an input."""
    fns = _load()
    if fns is None or not all(isinstance(a, np.ndarray) for a in (x, indices, dst)):
        return None
    shape = x.shape[:axis] + indices.shape + x.shape[axis + 1:]
    if (not 0 <= axis < x.ndim or x.dtype.hasobject or not dst.flags.writeable
            or not x.flags.c_contiguous or not dst.flags.c_contiguous
            or not indices.flags.c_contiguous or indices.dtype.kind != "i"
            or indices.dtype.itemsize not in (4, 8) or not indices.dtype.isnative
            or dst.shape != shape or dst.dtype != x.dtype
            or np.may_share_memory(dst, x) or np.may_share_memory(dst, indices)):
        return None
    rules = planner_rules()
    outer, inner = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1:])
    count = rules.gather_parts(threads, *rules.gather_rows(x.shape, indices.size, axis))
    return functools.partial(
        fns.gather_rows_mt, native.address(x), native.address(dst), native.address(indices),
        indices.dtype.itemsize, outer, indices.size, x.shape[axis], inner * x.dtype.itemsize,
        count)
