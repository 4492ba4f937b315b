"""cpu kernels of the pooling family, written once against ``ctx.xp``.

Windowed pools run one elementwise op per kernel tap over contiguous "wide"
rows (see :mod:`keel.backends.cpu.window`), never a Python loop over pixels.
float16 is pooled in float16 for max (exact) and in float32 for sums.

Where the native tier is available, float32 max / average pools over 1-D and
2-D windows and the global max pool run the compiled window kernels of
:mod:`keel.backends.cpu.native_window` instead: every output computed once,
in registers, one pass over X and one over Y (numbers in ``NATIVE_MEASURED``:
0.13-0.6x the NumPy kernels' time, 0.5-1.1x onnxruntime's). Both the
``default`` kernels and the ``native`` variants take that path when it serves
the call (NumPy arrays, float32, rank 3-4, no Indices output) and the NumPy
one otherwise. The global average pool stays a BLAS gemv: it measured twice
as fast as the compiled loop on 7x7 planes. A native max / average pool
called again with the same X, Y and attributes (a model's node, every run)
runs the call bound on its first run (:class:`_PoolRun`): LeNet's pools take
2.5 us instead of 4.8 (the C kernel 1.6).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.cpu import conv_pool, native_gemm, workspace
from keel.backends.cpu import native_window as nw
from keel.backends.cpu import window as wnd
from keel.backends.cpu.kernels import TABLE
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schemas.conv import Window
from keel.ops.schemas.pooling import DTYPES, check_pool_input, pool_window

if TYPE_CHECKING:
    from keel.backends.cpu.native_qgemm import PoolGeometry

__all__: list[str] = []



def _target(xp: Any, out: Out, i: int, shape: tuple[int, ...], dtype: Any) -> Any:
    if out is not None and len(out) > i and out[i] is not None:
        return out[i]
    return xp.empty(shape, dtype=dtype)


def _lowest(dtype: Any) -> float:
    dt = np.dtype(dtype)
    return float(np.iinfo(dt).min) if dt.kind in "iu" else -np.inf


# Steady-state lookup: (op, shape, dtype, id(attrs)) -> (attrs, prepared). The attrs
# object is kept in the entry, so its id cannot be reused while the entry lives.
_FAST: dict[tuple[Any, ...], tuple[Attrs, Any]] = {}
_FAST_LIMIT = 1024


_Prepared = tuple[Window, wnd.WidePlan, "_Separable | None", "nw.WindowGeometry | None"]


def _prepare(op: Op, x: Any, attrs: Attrs) -> _Prepared:
    key = (op, x.shape, x.dtype, id(attrs))
    hit = _FAST.get(key)
    if hit is not None and hit[0] is attrs:
        return hit[1]
    prepared = _prepared(op, tuple(x.shape), x.dtype, tuple(attrs.items()))
    if len(_FAST) >= _FAST_LIMIT:
        _FAST.clear()
    _FAST[key] = (attrs, prepared)
    return prepared


@functools.lru_cache(maxsize=512)
def _prepared(op: Op, shape: tuple[int, ...], dtype: Any, attrs_key: tuple[tuple[str, Any], ...]
              ) -> _Prepared:
    """Check and resolve one pool signature (cached: a steady state pays a lookup).

    The last item is the compiled kernels' geometry (float32 1-D / 2-D windows), used
    when the native tier is ready at run time.
    """
    check_pool_input(op, shape, DType.from_numpy(dtype))
    win = pool_window(op, shape, dict(attrs_key))
    compiled = nw.plan(shape[1], win) if np.dtype(dtype) == np.float32 else None
    return win, wnd.wide_plan(shape, win), _separable(win), compiled


# ---- the native path ------------------------------------------------------------------------
NATIVE_MEASURED = (
    "2-core AMD EPYC (AVX-512), 1 thread, interleaved medians, native / NumPy kernel / "
    "onnxruntime 1.31 in us: LeNet's 2x2 stride-2 max pools at batch 1 4.3 / 6.9 / 6.4 "
    "(6x24x24) and 4.4 / 5.9 / 6.1 (16x8x8); 3x3 stride-2 pad-1 max pool 64x112x112 "
    "176 / 1373 / 187 (batch 8: 4935 / 10352 / 9210); 3x3 pad-1 average pool 64x28x28 "
    "33 / 148 / 32; global max pool 512x7x7 11.4 / 30.0 / 10.3; the bound global average "
    "pool's call alone against the NumPy kernel's BLAS gemv (under load): 512x7x7 1.6 / 2.3, "
    "1280x7x7 3.1 / 4.5, batch 32 512x7x7 39 / 59, 1280x7x7 101 / 141")


def _native(xp: Any, geo: nw.WindowGeometry | None) -> nw.WindowGeometry | None:
    """``geo`` when the compiled kernels serve this call (NumPy arrays, tier ready)."""
    return geo if geo is not None and xp is np and nw.ready() else None


def _native_pool(run: Any, x: Any, y: Any, *args: Any) -> None:
    """``run(x, y, *args)`` on C-contiguous float32 arrays, then into ``y``."""
    direct = y.flags.c_contiguous and y.dtype == np.float32
    target = y if direct else np.empty(y.shape, np.float32)
    run(np.ascontiguousarray(x), target, *args)
    if not direct:
        y[...] = target


class _PoolRun:
    """A pool node's native call bound to its arrays (:class:`nw.Bound`), run again
    while the kernel sees the same X, Y, attributes and thread count: a model's
    node does every run, and then skips the signature lookup and the argument
    conversions (~3 us of a 4.5 us LeNet pool)."""

    __slots__ = ("attrs", "call", "op", "threads", "x_ref", "y_ref")

    def __init__(self, op: Op, x: Any, y: Any, attrs: Attrs, threads: int | None,
                 call: nw.Bound) -> None:
        self.op, self.attrs, self.threads, self.call = op, attrs, threads, call
        self.x_ref, self.y_ref = weakref.ref(x), weakref.ref(y)

    def serves(self, op: Op, x: Any, y: Any, attrs: Attrs, threads: int | None) -> bool:
        return (self.attrs is attrs and self.x_ref() is x and self.y_ref() is y
                and self.op is op and self.threads == threads)


# Bound calls by (id(X), id(Y), thread): the scratch a call holds is its thread's.
_BOUND: dict[tuple[int, int, int], _PoolRun] = {}
_BOUND_LIMIT = 1024
_get_ident = threading.get_ident


def _steady(op: Op, ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> bool:
    """Run the bound call of these arrays when there is one (a model's steady state)."""
    if out is None or len(out) != 1:
        return False
    x, y = inputs[0], out[0]
    run = _BOUND.get((id(x), id(y), _get_ident()))
    if run is None or not run.serves(op, x, y, attrs, ctx.threads):
        return False
    run.call()
    return True


def _bind_native(op: Op, ctx: KernelContext, x: Any, y: Any, attrs: Attrs, out: Out,
                 bind: Any, *args: Any) -> bool:
    """Bind ``bind(x, y, *args, threads)`` to these arrays and run it: only for the
    caller's own Y with C-contiguous float32 X and Y (no copy per call); False: not
    bound (nothing written)."""
    if (out is None or len(out) != 1 or out[0] is not y or x.dtype != np.float32
            or y.dtype != np.float32 or not x.flags.c_contiguous
            or not y.flags.c_contiguous):
        return False
    run = _PoolRun(op, x, y, attrs, ctx.threads, bind(x, y, *args, ctx.threads or 1))
    if len(_BOUND) >= _BOUND_LIMIT:
        _BOUND.clear()
    _BOUND[(id(x), id(y), _get_ident())] = run
    run.call()
    return True


def _register_native(op: Op, kernel: Any, shapes: str, bind: Any = None) -> None:
    TABLE.kernel(op, variant="native", dtypes=(DType.FLOAT32,), supports_out=True,
                 requires="native", priority=10, simd=(), shapes=shapes,
                 measured=NATIVE_MEASURED, bind=bind,
                 description="compiled window kernel: every output computed once in "
                             "registers (the NumPy kernel where it does not serve)")(kernel)


@TABLE.kernel(Op.MAX_POOL, dtypes=DTYPES[Op.MAX_POOL], supports_out=True,
              simd=(), shapes="any rank, any window")
def max_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Running max over the window taps; Indices only when asked for (or ``out`` is None)."""
    if _steady(Op.MAX_POOL, ctx, inputs, attrs, out):
        return [out[0]]  # type: ignore[index]
    xp, x = ctx.xp, inputs[0]
    win, plan, separable, compiled = _prepare(Op.MAX_POOL, x, attrs)
    shape = (plan.batch, plan.channels, *plan.out)
    y = _target(xp, out, 0, shape, x.dtype)
    want_indices = out is None or len(out) > 1
    geo = None if want_indices else _native(xp, compiled)
    if geo is not None:
        if not _bind_native(Op.MAX_POOL, ctx, x, y, attrs, out, nw.bind_max_pool, geo):
            _native_pool(nw.max_pool, x, y, geo, ctx.threads or 1)
        return [y]
    if not want_indices and separable is not None:
        _max_rows_then_columns(xp, x, separable, y)
        return [y]
    img = wnd.phase_image(xp, x, plan, _lowest(x.dtype), "max_pool")
    tap_views = wnd.taps(img, plan)
    best = workspace.empty(xp, "max_pool_best", (plan.batch, plan.channels, plan.wide), x.dtype)
    if not want_indices:
        if len(tap_views) == 1:
            best[...] = tap_views[0]
        else:
            xp.maximum(tap_views[0], tap_views[1], out=best)
        for tap in tap_views[2:]:
            xp.maximum(best, tap, out=best)
        y[...] = wnd.valid(xp, best, plan)
        return [y]
    best[...] = tap_views[0]
    winner = xp.zeros(best.shape, dtype=xp.int16 if len(tap_views) < 2**15 else xp.int32)
    for t, tap in enumerate(tap_views[1:], start=1):
        better = tap > best       # strict: ties keep the first tap
        xp.maximum(best, tap, out=best)
        xp.copyto(winner, t, where=better)
    y[...] = wnd.valid(xp, best, plan)
    indices = _target(xp, out, 1, shape, xp.int64)
    indices[...] = _flat_indices(xp, wnd.valid(xp, winner, plan), x.shape, win,
                                 attrs["storage_order"])
    return [y, indices]


# ---- 8-bit max pool: the native integer kernel ---------------------------------------------
def _int8_geometry(x: Any, win: Window, out: Out) -> PoolGeometry | None:
    """The native max pool's geometry for this call (its sizes by name), or None where it
    does not serve it (Indices asked for, not a 2-D pool of NumPy arrays, the tier not
    built)."""
    from keel.backends.cpu import native_qgemm

    if (out is None or len(out) != 1 or not isinstance(x, np.ndarray) or win.rank != 2
            or not native_qgemm.available()):
        return None
    (oh, ow), (kh, kw), (sh, sw) = win.out_spatial, win.kernel, win.strides
    n, c, h, w = (int(d) for d in x.shape)
    return native_qgemm.PoolGeometry(n=n, c=c, h=h, w=w, oh=oh, ow=ow, kh=kh, kw=kw, sh=sh,
                                     sw=sw, pt=win.pads_begin[0], pl=win.pads_begin[1],
                                     dh=win.dilations[0], dw=win.dilations[1])


@TABLE.kernel(Op.MAX_POOL, variant="int8", dtypes=(DType.UINT8, DType.INT8), supports_out=True,
              requires="native", priority=10, simd=(), shapes="2-D windows, no Indices",
              description="native integer kernel (qgemm.c): a byte-wise max over whole rows, "
                          "the planes split over threads (the default kernel elsewhere)")
def max_pool_int8(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The max pool of an 8-bit tensor (the int8 graphs keep MaxPool on the integers)."""
    x = inputs[0]
    win = _prepare(Op.MAX_POOL, x, attrs)[0]
    geometry = _int8_geometry(x, win, out)
    from keel.backends.cpu import qlayout

    src, dst = qlayout.layouts(ctx)
    if (src, dst) != (qlayout.NCHW, qlayout.NCHW) and out is not None:
        def nchw(xn: np.ndarray, yn: np.ndarray) -> None:
            plain = dataclasses.replace(ctx, plan=qlayout.without_layout(ctx.plan))
            max_pool_int8(plain, [xn, *inputs[1:]], attrs, [yn])

        qlayout.max_pool(src, dst, np.ascontiguousarray(x), geometry, out[0],
                         ctx.threads or 1, nchw)
        return [out[0]]
    if geometry is None:
        return list(max_pool(ctx, inputs, attrs, out))
    from keel.backends.cpu import native_qgemm

    y = out[0]  # type: ignore[index]
    direct = y.flags.c_contiguous
    target = y if direct else np.empty(y.shape, x.dtype)
    native_qgemm.max_pool(np.ascontiguousarray(x), geometry, target, ctx.threads or 1)
    if not direct:
        y[...] = target
    return [y]


@dataclass(frozen=True)
class _Separable:
    """Index tuples of a 2-D window max taken over kernel rows, then kernel columns."""

    rows: tuple[tuple[slice, ...], ...]        # per kernel row: the X rows it reads
    cols: tuple[tuple[Any, ...], ...]          # per kernel column: the columns it reads
    height: int                                # rows of the intermediate


def _separable(win: Window) -> _Separable | None:
    """The row/column plan of a 2-D unpadded window that stays inside X, else None.

    Measured (1 thread): LeNet's 2x2 stride-2 pools take 10 us this way against
    21 us through the phase split; a padded 3x3 stride-2 pool on 112x112 runs
    faster split (520 us against 600 us for a padded copy, then rows, then columns).
    """
    if win.rank != 2 or win.padded or any(
            (o - 1) * s + e > i for o, s, e, i in
            zip(win.out_spatial, win.strides, win.effective_kernel, win.in_spatial,
                strict=True)):
        return None
    (kh, kw), (sh, sw), (dh, dw) = win.kernel, win.strides, win.dilations
    ho, wo = win.out_spatial
    every = (slice(None), slice(None))
    rows = tuple((*every, slice(k * dh, k * dh + (ho - 1) * sh + 1, sh)) for k in range(kh))
    cols = tuple((Ellipsis, slice(k * dw, k * dw + (wo - 1) * sw + 1, sw)) for k in range(kw))
    return _Separable(rows, cols, ho)


def _max_rows_then_columns(xp: Any, x: Any, sep: _Separable, y: Any) -> None:
    """A window max taken as the max over kernel rows, then over kernel columns.

    Straight from strided views of X: the row pass reads whole contiguous rows,
    and the column pass (the only one with strided inner reads) runs on the
    already shrunk array. A 2x2 stride-2 pool is two ufunc calls and no copy.
    """
    rows, cols = sep.rows, sep.cols
    if len(rows) == 1:
        t = x[rows[0]]
    else:
        t = workspace.empty(xp, "max_pool_rows", (*x.shape[:2], sep.height, x.shape[3]),
                            x.dtype)
        xp.maximum(x[rows[0]], x[rows[1]], out=t)
        for r in rows[2:]:
            xp.maximum(t, x[r], out=t)
    if len(cols) == 1:
        y[...] = t[cols[0]]
        return
    xp.maximum(t[cols[0]], t[cols[1]], out=y)
    for col in cols[2:]:
        xp.maximum(y, t[col], out=y)


def _flat_indices(xp: Any, winner: Any, x_shape: Sequence[int], win: Window,
                  storage_order: int) -> Any:
    """Flat indices into X of each output's winning tap."""
    n, c = x_shape[:2]
    spatial = list(x_shape[2:])
    rank = win.rank
    kernel_coords = _kernel_coords(tuple(win.kernel))           # (taps, rank)
    order = list(range(rank)) if storage_order == 0 else list(reversed(range(rank)))
    mult = [1] * rank
    for pos, d in enumerate(reversed(order)):
        mult[d] = int(np.prod([spatial[e] for e in list(reversed(order))[:pos]], dtype=np.int64))
    index = xp.zeros(winner.shape, dtype=xp.int64)
    coords_k = xp.asarray(kernel_coords)
    for d in range(rank):
        grid_shape = [1] * (2 + rank)
        grid_shape[2 + d] = win.out_spatial[d]
        base = (xp.arange(win.out_spatial[d], dtype=xp.int64) * win.strides[d]
                - win.pads_begin[d]).reshape(grid_shape)
        coord = base + coords_k[:, d][winner] * win.dilations[d]
        index += coord * mult[d]
    plane = int(np.prod(spatial, dtype=np.int64))
    nc = (xp.arange(n * c, dtype=xp.int64) * plane).reshape(n, c, *([1] * rank))
    return index + nc


@functools.lru_cache(maxsize=64)
def _kernel_coords(kernel: tuple[int, ...]) -> np.ndarray:
    return np.array(list(np.ndindex(*kernel)), dtype=np.int64).reshape(-1, len(kernel))


def _window_sum(xp: Any, x: Any, plan: wnd.WidePlan, tag: str) -> Any:
    """Sum of every window (zero padding), as a (N, C, wide) array."""
    img = wnd.phase_image(xp, x, plan, 0.0, tag)
    tap_views = wnd.taps(img, plan)
    acc = xp.empty((plan.batch, plan.channels, plan.wide), dtype=x.dtype)
    if len(tap_views) == 1:
        acc[...] = tap_views[0]
        return acc
    xp.add(tap_views[0], tap_views[1], out=acc)
    for tap in tap_views[2:]:
        xp.add(acc, tap, out=acc)
    return acc


def _sum_dtype(xp: Any, dtype: Any) -> Any:
    return xp.float32 if np.dtype(dtype) == np.float16 else dtype


@TABLE.kernel(Op.AVG_POOL, dtypes=DTYPES[Op.AVG_POOL], supports_out=True,
              simd=(), shapes="any rank, any window")
def avg_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Window sums times 1 / (the number of counted positions)."""
    if _steady(Op.AVG_POOL, ctx, inputs, attrs, out):
        return [out[0]]  # type: ignore[index]
    xp, x = ctx.xp, inputs[0]
    win, plan, _, compiled = _prepare(Op.AVG_POOL, x, attrs)
    geo = _native(xp, compiled)
    if geo is not None:
        y = _target(xp, out, 0, (plan.batch, plan.channels, *plan.out), x.dtype)
        counts = nw.avg_counts(win, bool(attrs["count_include_pad"]))
        if not _bind_native(Op.AVG_POOL, ctx, x, y, attrs, out, nw.bind_avg_pool, geo, counts):
            _native_pool(nw.avg_pool, x, y, geo, counts, ctx.threads or 1)
        return [y]
    xs = x.astype(_sum_dtype(xp, x.dtype), copy=False)
    acc = _window_sum(xp, xs, plan, "avg_pool")
    inv = _inverse_counts(xp, win, plan, bool(attrs["count_include_pad"]), acc.dtype)
    xp.multiply(acc, inv, out=acc)
    y = _target(xp, out, 0, (plan.batch, plan.channels, *plan.out), x.dtype)
    y[...] = wnd.valid(xp, acc, plan)
    return [y]


def _inverse_counts(xp: Any, win: Window, plan: wnd.WidePlan, include_pad: bool,
                    dtype: Any) -> Any:
    """1 / count per output (a scalar when every window counts the full kernel)."""
    extra = any((o - 1) * s + e > i + pb + pe for o, s, e, i, pb, pe in
                zip(win.out_spatial, win.strides, win.effective_kernel, win.in_spatial,
                    win.pads_begin, win.pads_end, strict=True))
    full = int(np.prod(win.kernel))
    if not extra and (include_pad or not win.padded):
        return 1.0 / full
    # Count with a one-channel image of ones: input (and explicit pads when they
    # count) hold 1, everything else 0.
    ones = xp.ones((1, 1, *win.in_spatial), dtype=dtype)
    one_plan = wnd.wide_plan(ones.shape, win)
    if include_pad:
        padded = tuple(i + pb + pe for i, pb, pe in
                       zip(win.in_spatial, win.pads_begin, win.pads_end, strict=True))
        ones = xp.ones((1, 1, *padded), dtype=dtype)
        bare = Window(padded, win.kernel, win.strides, win.dilations,
                      (0,) * win.rank, tuple(max(0, (o - 1) * s + e - p) for o, s, e, p in
                                             zip(win.out_spatial, win.strides,
                                                 win.effective_kernel, padded, strict=True)),
                      win.out_spatial)
        one_plan = wnd.wide_plan(ones.shape, bare)
    counts = _window_sum(xp, ones, one_plan, "avg_pool_counts")
    result = xp.ones((1, 1, plan.wide), dtype=dtype)
    wnd.valid(xp, result, plan)[...] = wnd.valid(xp, counts, one_plan)
    return 1.0 / xp.maximum(result, 1.0)


@TABLE.kernel(Op.LP_POOL, dtypes=DTYPES[Op.LP_POOL], supports_out=True,
              simd=(), shapes="any rank, any window")
def lp_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(window sum of |x|^p)^(1/p)."""
    xp, x = ctx.xp, inputs[0]
    p = attrs["p"]
    _, plan, _, _ = _prepare(Op.LP_POOL, x, attrs)
    xs = xp.abs(x).astype(_sum_dtype(xp, x.dtype), copy=False)
    if p == 2:
        xp.multiply(xs, xs, out=xs)
    elif p != 1:
        xp.power(xs, p, out=xs)
    acc = _window_sum(xp, xs, plan, "lp_pool")
    if p == 2:
        xp.sqrt(acc, out=acc)
    elif p != 1:
        xp.power(acc, 1.0 / p, out=acc)
    y = _target(xp, out, 0, (plan.batch, plan.channels, *plan.out), x.dtype)
    y[...] = wnd.valid(xp, acc, plan)
    return [y]


def _native_global(xp: Any, flat: Any, y: Any) -> bool:
    return xp is np and flat.dtype == np.float32 and y.dtype == np.float32 and nw.ready()


def _global(op: Op, xp: Any, x: Any, out: Out) -> tuple[Any, Any]:
    check_pool_input(op, x.shape, DType.from_numpy(x.dtype))
    n, c = x.shape[:2]
    flat = x.reshape(n, c, math.prod(x.shape[2:]))
    y = _target(xp, out, 0, (n, c, *([1] * (x.ndim - 2))), x.dtype)
    return flat, y


def _bind_global_avg_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                          out: Sequence[Any]) -> Any:
    """GlobalAveragePool for one program step: its matrix-vector product with the
    checks, views and weights made once (they cost several times the product at batch
    1); None where the kernel would convert (float16) or the buffers do not serve."""
    x = inputs[0]
    if ctx.xp is not np or type(x) is not np.ndarray or not out or x.ndim < 3:
        return None
    flat, y = _global(Op.GLOBAL_AVG_POOL, np, x, out)
    n, c, count = flat.shape
    if (count == 0 or y is not out[0] or flat.dtype != _sum_dtype(np, flat.dtype)
            or y.dtype != flat.dtype or not y.flags.c_contiguous
            or not np.shares_memory(flat, x)):
        return None
    weights = np.full((count,), 1.0 / count, dtype=flat.dtype)     # as the kernel's
    return functools.partial(np.matmul, flat, weights, out=y.reshape(n, c))


@TABLE.kernel(Op.GLOBAL_AVG_POOL, dtypes=DTYPES[Op.GLOBAL_AVG_POOL], supports_out=True,
              simd=(), shapes="any rank", bind=_bind_global_avg_pool)
def global_avg_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Mean over the flattened spatial dims, as one matrix-vector product.

    ``X (N*C, P) @ (1/P, ..., 1/P)`` runs in BLAS: measured 4 us against 15 us
    for ``sum(axis=-1)`` on a (1, 512, 7, 7) input (NumPy's pairwise sum pays per
    short row).
    """
    xp = ctx.xp
    flat, y = _global(Op.GLOBAL_AVG_POOL, xp, inputs[0], out)
    n, c, count = flat.shape
    if count == 0:
        y[...] = np.nan
        return [y]
    compute = _sum_dtype(xp, flat.dtype)
    weights = workspace.filled(xp, "global_avg_pool_weights", (count,), compute, 1.0 / count)
    src = flat.astype(compute, copy=False)
    if y.dtype == compute and y.flags.c_contiguous:
        xp.matmul(src, weights, out=y.reshape(n, c))
    else:
        y.reshape(n, c)[...] = xp.matmul(src, weights)
    return [y]


@TABLE.kernel(Op.GLOBAL_MAX_POOL, dtypes=DTYPES[Op.GLOBAL_MAX_POOL], supports_out=True,
              simd=(), shapes="any rank")
def global_max_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Max over the flattened spatial dims."""
    if _steady(Op.GLOBAL_MAX_POOL, ctx, inputs, attrs, out):
        return [out[0]]  # type: ignore[index]
    xp = ctx.xp
    flat, y = _global(Op.GLOBAL_MAX_POOL, xp, inputs[0], out)
    if flat.shape[-1] and _native_global(xp, flat, y):
        if not _bind_native(Op.GLOBAL_MAX_POOL, ctx, inputs[0], y, attrs, out,
                            nw.bind_global_max_pool):
            _native_pool(nw.global_max_pool, flat, y, ctx.threads or 1)
        return [y]
    y.reshape(flat.shape[:2])[...] = flat.max(axis=-1)
    return [y]


def _bind_global_avg_pool_native(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                                 out: Sequence[Any]) -> Any:
    """GlobalAveragePool's compiled call bound for one program step; None where the
    arrays are not C-contiguous float32 NumPy arrays (the kernel then runs as usual)."""
    x = inputs[0]
    if (ctx.xp is not np or type(x) is not np.ndarray or not out or x.ndim < 3
            or not nw.ready()):
        return None
    y = out[0]
    if (type(y) is not np.ndarray or x.dtype != np.float32 or y.dtype != np.float32
            or not x.flags.c_contiguous or not y.flags.c_contiguous or x.size == 0
            or y.shape != (*x.shape[:2], *([1] * (x.ndim - 2)))):
        return None
    return nw.step(nw.bind_global_avg_pool(x, y, ctx.threads or 1))


def global_avg_pool_native(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out
                           ) -> list[Any]:
    """Mean over the flattened spatial dims in the compiled row-mean kernel, split over
    planes on keel's threads (the NumPy kernel where it does not serve)."""
    if _steady(Op.GLOBAL_AVG_POOL, ctx, inputs, attrs, out):
        return [out[0]]  # type: ignore[index]
    xp = ctx.xp
    flat, y = _global(Op.GLOBAL_AVG_POOL, xp, inputs[0], out)
    if not (flat.shape[-1] and _native_global(xp, flat, y)):
        return list(global_avg_pool(ctx, inputs, attrs, out))
    if not _bind_native(Op.GLOBAL_AVG_POOL, ctx, inputs[0], y, attrs, out,
                        nw.bind_global_avg_pool):
        _native_pool(nw.global_avg_pool, flat, y, ctx.threads or 1)
    return [y]


def _bind_window(op: Op, ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                 out: Sequence[Any]) -> Any:
    """The compiled window call of MaxPool (Y only) or AveragePool bound for one program
    step, as the kernel binds it on its first run; None where the compiled kernels do
    not serve these arrays (the kernel then runs as usual)."""
    x = inputs[0]
    if (ctx.xp is not np or type(x) is not np.ndarray or len(out) != 1
            or type(out[0]) is not np.ndarray):
        return None
    y = out[0]
    win, plan, _, compiled = _prepare(op, x, attrs)
    geo = _native(np, compiled)
    if (geo is None or y.shape != (plan.batch, plan.channels, *plan.out)
            or x.dtype != np.float32 or y.dtype != np.float32
            or not x.flags.c_contiguous or not y.flags.c_contiguous):
        return None
    if op is Op.MAX_POOL:
        pool = nw.bind_max_pool(x, y, geo, ctx.threads or 1)
        split = None if ctx.plan is None else ctx.plan.option("pool_in_conv")
        waits = None if split is None else conv_pool.waiting(
            pool, x, y, geo, native_gemm.PoolSplit(*split), ctx.threads or 1)
        # a waiting step runs the pool's call or the fused conv + pool's: C code only
        return nw.step(pool if waits is None else waits)
    counts = nw.avg_counts(win, bool(attrs["count_include_pad"]))
    return nw.step(nw.bind_avg_pool(x, y, geo, counts, ctx.threads or 1))


_register_native(Op.MAX_POOL, max_pool, "1-D/2-D windows (Y only: Indices run the NumPy kernel)",
                 functools.partial(_bind_window, Op.MAX_POOL))
_register_native(Op.AVG_POOL, avg_pool, "1-D/2-D windows",
                 functools.partial(_bind_window, Op.AVG_POOL))
_register_native(Op.GLOBAL_MAX_POOL, global_max_pool, "any rank")
_register_native(Op.GLOBAL_AVG_POOL, global_avg_pool_native, "any rank",
                 _bind_global_avg_pool_native)
