"""Winograd F(2x2, 3x3) convolution (Lavin & Gray, 2015), written against ``xp``.

Each 2x2 output tile comes from a 4x4 input tile: ``Y = A^T [(G g G^T) * (B^T d
B)] A``. The 16 elementwise products over all tiles become 16 matrix products
``(tiles x C) @ (C x M)``, 2.25x fewer multiply-adds than im2col + GEMM.

The transforms are short sums of shifted copies, which NumPy runs one pass
each; to keep every pass on long contiguous runs the input is first laid out
channels-last and split by row/column parity (``D[n, py, qy, px, qx, c] =
padded[n, c, 2 qy + py, 2 qx + px]``): every 4x4-tile element is then a
contiguous slab. The GEMMs write tile-major results whose output transform
lands in an NHWC image, transposed to NCHW once at the end.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel import native
from keel.backends.bound import BoundCall
from keel.backends.cpu import native_gemm, planner, workspace
from keel.backends.cpu.conv_epilogue import Activation, finish
from keel.backends.cpu.native_window import Bound, clip_bounds

__all__ = ["TRANSFORM_G", "conv3x3", "native_conv3x3"]

# G (4x3): the filter transform; B^T and A^T are applied as explicit sums below.
TRANSFORM_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
_GG = np.kron(TRANSFORM_G, TRANSFORM_G)            # (16, 9): vec(G g G^T) = GG @ vec(g)

# Images per chunk: the cpu planner's (keel.backends.cpu.planner.winograd_form); None
# runs the whole batch at once.


def filter_transform(xp: Any, w: Any) -> Any:
    """U^T (4, 4, C, M) = G w G^T for every (m, c) filter, as a view of (4, 4, M, C).

    One GEMM with the filters as its transposed operand; each U[i, j]^T is a
    Fortran-ordered (C, M) matrix, which BLAS takes as is.
    """
    m, c = w.shape[:2]
    gg = xp.asarray(_GG, dtype=w.dtype)
    u = xp.matmul(gg, w.reshape(m * c, 9).T)        # (16, M*C)
    return u.reshape(4, 4, m, c).transpose(0, 1, 3, 2)


def conv3x3(xp: Any, x: Any, w: Any, pads_begin: tuple[int, int], out_hw: tuple[int, int],
            y: Any, bias: Any = None, z: Any = None, act: Activation = ("", ()),
            packed: Any = None, chunk: int | None = None) -> None:
    """y (N, M, Ho, Wo) = act(conv(x, w) + bias + z) for a 3x3, stride 1, dilation 1,
    group 1 conv, ``chunk`` images at a time (None: all)."""
    n = x.shape[0]
    chunk = n if chunk is None else max(1, min(n, chunk))
    u = workspace.form(xp, packed, "winograd_u", (w,), lambda xp_, a: filter_transform(xp_, a[0]))
    for n0 in range(0, n, chunk):
        n1 = min(n, n0 + chunk)
        _conv_chunk(xp, x[n0:n1], u, pads_begin, out_hw, y[n0:n1], bias,
                    None if z is None else z[n0:n1], act)


def _conv_chunk(xp: Any, x: Any, u: Any, pads_begin: tuple[int, int],
                out_hw: tuple[int, int], y: Any, bias: Any, z: Any, act: Activation) -> None:
    n, c = x.shape[:2]
    m = u.shape[3]
    th, tw = -(-out_hw[0] // 2), -(-out_hw[1] // 2)
    d = _split_input(xp, x, pads_begin, th, tw)
    v = _input_transform(xp, d, n, th, tw, c)
    t = n * th * tw
    prod = workspace.empty(xp, "winograd_m", (4, 4, t, m), x.dtype)
    xp.matmul(v.reshape(4, 4, t, c), u, out=prod)
    if bias is not None:
        # A^T has ones in column 1, so M[1, 1] reaches every output of a tile once.
        xp.add(prod[1, 1], bias, out=prod[1, 1])
    image = _output_transform(xp, prod, n, th, tw, m)
    finish(xp, image[:, : out_hw[0], : out_hw[1]].transpose(0, 3, 1, 2), y, z, act)


def _split_input(xp: Any, x: Any, pads_begin: tuple[int, int], th: int, tw: int) -> Any:
    """D (N, 2, th+1, 2, tw+1, C): padded input, channels last, split by parity."""
    n, c, h, w = x.shape
    pt, pl = pads_begin
    key = ("winograd_d", h, w, pt, pl)
    d = workspace.filled(xp, key, (n, 2, th + 1, 2, tw + 1, c), x.dtype, 0.0)
    xt = x.transpose(0, 2, 3, 1)
    for py in range(2):
        h0 = (py - pt) % 2
        q0, nh = (h0 + pt) // 2, len(range(h0, h, 2))
        for px in range(2):
            w0 = (px - pl) % 2
            p0, nw = (w0 + pl) // 2, len(range(w0, w, 2))
            d[:, py, q0:q0 + nh, px, p0:p0 + nw, :] = xt[:, h0::2, w0::2, :]
    return d


def _input_transform(xp: Any, d: Any, n: int, th: int, tw: int, c: int) -> Any:
    """V (4, 4, N, th, tw, C) = B^T d B for every tile, B^T = [[1,0,-1,0],[0,1,1,0],
    [0,-1,1,0],[0,1,0,-1]].

    Columns first, over whole parity rows (long runs); the row pass then reads
    th consecutive rows of one slab: fully contiguous operands.
    """
    cols = [d[:, :, :, j % 2, j // 2: j // 2 + tw] for j in range(4)]   # (N, 2, th+1, tw, C)
    t1 = workspace.empty(xp, "winograd_t1", (4, n, 2, th + 1, tw, c), d.dtype)
    _bt(xp, cols, t1)
    v = workspace.empty(xp, "winograd_v", (4, 4, n, th, tw, c), d.dtype)
    for s in range(4):
        rows = [t1[s][:, i % 2, i // 2: i // 2 + th] for i in range(4)]  # (N, th, tw, C)
        _bt(xp, rows, v[:, s])
    return v


def _bt(xp: Any, s: list[Any], out: Any) -> None:
    xp.subtract(s[0], s[2], out=out[0])
    xp.add(s[1], s[2], out=out[1])
    xp.subtract(s[2], s[1], out=out[2])
    xp.subtract(s[1], s[3], out=out[3])


def _at(xp: Any, s: Any, out0: Any, out1: Any) -> None:
    """A^T = [[1, 1, 1, 0], [0, 1, -1, -1]] along the first axis of ``s``."""
    xp.add(s[0], s[1], out=out0)
    xp.add(out0, s[2], out=out0)
    xp.subtract(s[1], s[2], out=out1)
    xp.subtract(out1, s[3], out=out1)


def _output_transform(xp: Any, prod: Any, n: int, th: int, tw: int, m: int) -> Any:
    """The NHWC image (N, 2 th, 2 tw, M) of A^T M A over every tile."""
    t = n * th * tw
    o1 = workspace.empty(xp, "winograd_o1", (2, 4, t, m), prod.dtype)
    _at(xp, prod, o1[0], o1[1])
    image = workspace.empty(xp, "winograd_y", (n, th, 2, tw, 2, m), prod.dtype)
    for r in range(2):
        cols = o1[r].reshape(4, n, th, tw, m)
        _at(xp, cols, image[:, :, r, :, 0], image[:, :, r, :, 1])
    return image.reshape(n, 2 * th, 2 * tw, m)



# ---- the native form: transforms in C (native/src/winograd.c), products on the packed GEMM
_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class _Functions:
    input: Any
    output: Any
    fused: Any          # keel_winograd_fused_f32: the per-thread pipeline
    product: int        # the address of gemm.c's keel_gemm_block_f32
    mr: int             # rows of the GEMM's row panels
    work: int           # floats of the GEMM's workspace


_loaded: tuple[native.NativeLibrary, _Functions] | None = None


def _functions() -> _Functions | None:
    """The transforms of the loaded library; None when the native tier is unavailable."""
    global _loaded
    lib = native.library("winograd")
    if lib is None or not native_gemm.available():
        return None
    if _loaded is not None and _loaded[0] is lib:
        return _loaded[1]
    gemm = native.library("gemm")
    product = None if gemm is None else gemm.address("keel_gemm_block_f32")
    if gemm is None or not product:
        return None

    def size(symbol: str) -> int:
        assert gemm is not None
        return int(gemm.function(symbol, [], _I)())

    fns = _Functions(
        input=lib.function("keel_winograd_input_f32", [_P, _P, _P, _I, _I, _I], _I),
        output=lib.function("keel_winograd_output_f32",
                            [_P, _P, _P, _I, _P, _P, _P, _I, _I, _I], _I),
        fused=lib.function("keel_winograd_fused_f32",
                           [_P, _P, _P, _I, _P, _P, _P, _I, ctypes.c_char_p, _P, _P, _I], _I),
        product=product, mr=size("keel_gemm_mr_f32"), work=size("keel_gemm_workspace_f32"),
    )
    _loaded = (lib, fns)
    return fns


def _packed_filters(xp: Any, arrays: tuple[Any, ...]) -> Any:
    """U (16 products of M x C), G w G^T for every filter, packed as left GEMM operands."""
    w = arrays[0]
    m, c = w.shape[:2]
    u = (_GG.astype(np.float32) @ w.reshape(m * c, 9).T).reshape(16, m, c)
    return native_gemm.pack_batch(np.ascontiguousarray(u, dtype=np.float32), left=True)


def _contiguous_f32(*arrays: Any) -> bool:
    return all(a is None or (type(a) is np.ndarray and a.dtype == np.float32
                             and a.flags.c_contiguous) for a in arrays)


def native_conv3x3(x: Any, w: Any, pads_begin: tuple[int, int], out_hw: tuple[int, int],
                   y: Any, bias: Any = None, z: Any = None, act: Activation = ("", ()),
                   packed: Any = None, threads: int = 1, chunk: int | None = None,
                   lanes: bool | None = None, pass_lanes: bool | None = None,
                   pipeline: tuple[int, ...] | None = None) -> bool:
    """:func:`conv3x3` with the transforms compiled and the sixteen products on keel's
    packed GEMM, split over ``threads``, ``chunk`` images at a time (None: all), the
    products in lanes tiles or in panels as ``lanes`` says (its plan's
    ``winograd_lanes``: the pipeline's, and the passes' products in tall tiles) and, run
    pass by pass, a chunk's wider products as ``pass_lanes`` says (its plan's
    ``winograd_pass_lanes``), as the per-thread pipeline or pass by pass as ``pipeline``
    says (its plan's ``winograd_pipeline``, for the profile planned for); None, a call
    the planner did not see: the rules for this machine's vendor and caches. False when
    not served (nothing written): the native tier unavailable, or arrays that are not
    C-contiguous float32."""
    fns = _functions()
    if fns is None or not _contiguous_f32(x, w, y, bias, z) or (
            z is not None and z.shape != y.shape):
        return False
    m = w.shape[0]
    products, geo, clip = _operands(x, w, pads_begin, out_hw, act, packed)
    name = act[0]
    lanes = planner.winograd_lanes()[0] if lanes is None else lanes
    fused = _fused(fns, x, y, bias, z, clip, geo, products, m, threads, out_hw, lanes,
                   pipeline)
    if fused is not None:
        _ok(fns.fused(*fused[0]))
    else:
        _run_passes(_passes(fns, x, y, bias, z, clip, geo, products, m, threads, out_hw,
                            chunk, lanes, pass_lanes))
    if name and name != "clip":
        finish(np, y, y, None, act)
    return True


# One chunk of images pass by pass: its input transform, its sixteen products and its
# output transform, each a call of no arguments.
_Pass = tuple[Callable[[], int], Callable[[], Any], Callable[[], int]]


def _passes(fns: _Functions, x: Any, y: Any, bias: Any, z: Any, clip: Any, geo: Any,
            products: _Products, m: int, threads: int, out_hw: tuple[int, int],
            chunk: int | None, lanes: bool, pass_lanes: bool | None) -> list[_Pass]:
    """The conv pass by pass, ``chunk`` images at a time (None: all), as calls with their
    arguments converted once: the input transform of a chunk over every thread into V,
    the sixteen products into P, the output transform (bias, Z and the clip) into Y.
    V and P are this thread's workspace; the calls keep them, U, the geometry and the
    clip alive, not X, Y, the bias or Z."""
    n, c = x.shape[:2]
    tiles = -(-out_hw[0] // 2) * -(-out_hw[1] // 2)
    chunk = n if chunk is None else max(1, min(n, chunk))
    v_all = workspace.empty(np, "winograd_native_v", (16 * c * chunk * tiles,), np.float32)
    p_all = workspace.empty(np, "winograd_native_p", (16 * m * chunk * tiles,), np.float32)
    addr = native.address
    passes: list[_Pass] = []
    for n0 in range(0, n, chunk):
        k = min(chunk, n - n0)
        t = k * tiles
        v = v_all[:16 * c * t].reshape(16, c, t)
        p = p_all[:16 * m * t].reshape(16, m, t)
        zs = None if z is None else z[n0:n0 + k]
        # By tile rows, a thread transforms the tiles its share of the products reads.
        by_rows = planner.winograd_by_rows(k, c + m, out_hw, threads, filters=m * c)
        transform_in = functools.partial(
            fns.input, addr(x[n0:n0 + k]), addr(v), addr(geo), k,
            planner.winograd_parts(k, c, out_hw, False, threads, by_rows), by_rows)
        call = native_gemm.prepare(products.u, v, p)
        if call is None:
            raise RuntimeError("native GEMM refused the Winograd products")
        # The lanes tiles the plan gives (not prepare's rule for this machine's vendor);
        # tall tiles for one vector of tiles, or where tall_tiles takes U's shape.
        # Each chunk's own: a short last chunk may take other tiles than the first.
        one_vector = planner.winograd_tall(t)
        chunk_lanes = (planner.winograd_pass_lanes(c, m, t)[0] if pass_lanes is None
                       else pass_lanes)
        call = native_gemm.with_tiles(call, one_vector or planner.tall_tiles(m, c),
                                      lanes if one_vector else chunk_lanes)
        # Panel-major: a thread's share of the sixteen products is the same tiles of each
        # (those of the images, or tile rows, it transformed: the pool gives each thread
        # the same chunk index); product by product where U outweighs the tiles.
        product = call.bound(threads,
                             panel_major=not planner.winograd_by_product(c, m, t, threads))
        transform_out = functools.partial(
            fns.output, addr(p), addr(y[n0:n0 + k]), addr(geo), m,
            None if bias is None else addr(bias), None if zs is None else addr(zs),
            None if clip is None else addr(clip), k,
            planner.winograd_parts(k, m, out_hw, True, threads, by_rows), by_rows)
        passes.append((native_gemm.holding(transform_in, v_all, geo), product,
                       native_gemm.holding(transform_out, p_all, geo, clip, products)))
    return passes


def _run_passes(passes: list[_Pass]) -> None:
    for transform_in, product, transform_out in passes:
        _ok(transform_in())
        product()
        _ok(transform_out())


def bind_conv3x3(x: Any, w: Any, pads_begin: tuple[int, int], out_hw: tuple[int, int],
                 y: Any, bias: Any, z: Any, act: Activation, packed: Any, threads: int,
                 lanes: bool | None, pipeline: tuple[int, ...] | None,
                 chunk: int | None = None, pass_lanes: bool | None = None
                 ) -> Callable[[], None] | None:
    """:func:`native_conv3x3` of these arrays as a call of no arguments, for a program
    step (the plan lookup, checks and argument conversions of each call made once: the
    same C calls, so the same bits): the per-thread pipeline, or pass by pass ``chunk``
    images at a time with the chunks' wider products as ``pass_lanes`` says (the plan's
    chunk and ``winograd_pass_lanes``); None where its activation is not the kernel's
    (the step then runs as usual). The call keeps what its addresses point into but X,
    W, Y, the bias and Z (V and P are this thread's workspace: run it on this thread),
    and runs only while they live; it runs C code only (marked ``native``)."""
    fns = _functions()
    if fns is None or act[0] not in ("", "clip") or not _contiguous_f32(x, w, y, bias, z) or (
            z is not None and z.shape != y.shape):
        return None
    products, geo, clip = _operands(x, w, pads_begin, out_hw, act, packed)
    lanes = planner.winograd_lanes()[0] if lanes is None else lanes
    fused = _fused(fns, x, y, bias, z, clip, geo, products, w.shape[0], threads, out_hw,
                   lanes, pipeline)
    if fused is None:
        return BoundCall(functools.partial(_run_passes, _passes(
            fns, x, y, bias, z, clip, geo, products, w.shape[0], threads, out_hw, chunk,
            lanes, pass_lanes)), native=True)
    return BoundCall(functools.partial(_run_fused, fns.fused, fused[0]),
                     keep=(products, *fused[1]), native=True)


def _run_fused(fn: Callable[..., int], args: tuple[Any, ...]) -> None:
    _ok(fn(*args))


def _operands(x: Any, w: Any, pads_begin: tuple[int, int], out_hw: tuple[int, int],
              act: Activation, packed: Any) -> tuple[_Products, Any, Any]:
    """The node's packed products, the transforms' geometry and the clip's bounds (None
    without a clip)."""
    products = workspace.form(np, packed, "winograd_native_products", (w,), _products)
    geo = _geometry(x.shape[1], x.shape[2], x.shape[3], out_hw[0], out_hw[1], *pads_begin)
    name, params = act
    clip = clip_bounds((params[0], params[1])) if name == "clip" else None
    return products, geo, clip


def _fused(fns: _Functions, x: Any, y: Any, bias: Any, z: Any, clip: Any, geo: Any,
           products: _Products, m: int, threads: int, out_hw: tuple[int, int], lanes: bool,
           pipeline: tuple[int, ...] | None) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """keel_winograd_fused_f32's arguments for these arrays and what their addresses point
    into, where the conv runs as the per-thread pipeline; None where it runs pass by pass."""
    n, c = x.shape[:2]
    oh, ow = out_hw
    pipe = (planner.planned_pipeline(pipeline, n, threads)
            or planner.winograd_pipeline(n, c, m, out_hw, threads, lanes=lanes))
    if not pipe.tiles:
        return None
    tiles = -(-oh // 2) * -(-ow // 2)
    call = products.tiled(planner.winograd_tall(min(pipe.tiles, n * tiles)), lanes)
    sizes = _geometry(pipe.tiles, pipe.panels, fns.mr, fns.work, int(pipe.last_first),
                      pipe.threads)
    addr = native.address
    args = (addr(x), addr(y), addr(geo), m, None if bias is None else addr(bias),
            None if z is None else addr(z), None if clip is None else addr(clip), n,
            call.args, fns.product, addr(sizes), pipe.parts)
    return args, (call, geo, sizes, clip)


@dataclass(frozen=True)
class _Products:
    """The packed U and the prepared call of its sixteen products, whose B and C each
    pipeline block rebinds to its own scratch (the call holds U's address, so they
    live together), in each tiling the planner may ask for."""

    u: Any
    calls: dict[tuple[bool, bool], native_gemm.Call]   # by (tall, lanes)

    def tiled(self, tall: bool, lanes: bool) -> native_gemm.Call:
        """The call in tall tiles or not (planner.winograd_tall), in lanes tiles or in
        panels (the plan's winograd_lanes)."""
        return self.calls[tall, lanes]


def _products(xp: Any, arrays: tuple[Any, ...]) -> _Products:
    u = _packed_filters(xp, arrays)
    m, c = arrays[0].shape[:2]
    columns = 16                       # any: each block gives its own B, C and columns
    call = native_gemm.prepare(u, np.zeros((16, c, columns), np.float32),
                               np.zeros((16, m, columns), np.float32))
    if call is None:
        raise RuntimeError("native GEMM refused the Winograd products")
    # The tiles prepare chose for the stand-in columns are not the blocks': the plan
    # (winograd_lanes) and the planner's winograd_tall decide, call by call.
    return _Products(u, {(tall, lanes): native_gemm.with_tiles(call, tall, lanes)
                         for tall in (False, True) for lanes in (False, True)})


@functools.lru_cache(maxsize=256)
def _geometry(*values: int) -> np.ndarray:
    """winograd.c's geometry array (C, H, W, OH, OW, PT, PL), or the pipeline's sizes
    (tiles a block, row panels a product block, the GEMM's MR and workspace floats, the
    blocks' order: planner.pipeline_order, the threads: 0 for one a chunk), made once
    per shape."""
    array = np.array(values, dtype=np.int64)
    array.setflags(write=False)
    return array


def _ok(rc: int) -> None:
    if rc != 0:
        raise RuntimeError("native Winograd transform refused its geometry (or a worker "
                           "thread found no memory for its scratch)")


def bound_input_transform(planes: int, hw: tuple[int, int]) -> Bound | None:
    """The compiled input transform of one image of ``planes`` planes of ``hw`` pixels
    (a 3x3 conv padded by one) on the calling thread, ready to run again: what
    thread_costs times as the Winograd family's one-thread rate. None without the
    native tier."""
    fns = _functions()
    if fns is None:
        return None
    h, w = hw
    tiles = -(-h // 2) * -(-w // 2)
    x = np.ones((1, planes, h, w), np.float32)
    v = np.empty(16 * planes * tiles, np.float32)
    geo = _geometry(planes, h, w, h, w, 1, 1)
    return Bound(fns.input, (native.address(x), native.address(v), native.address(geo), 1, 1,
                             0), (x, v, geo))
