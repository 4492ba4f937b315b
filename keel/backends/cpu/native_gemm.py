"""Native float32 GEMM with prepacked operands and a fused epilogue (``native/src/gemm.c``).

``C = clip(alpha * A @ B + bias + R, lo, hi)`` in one pass over C. A BLAS call
packs both operands into its panel layout on every call; keel's weights are
constant, so the constant side (a MatMul/Gemm weight on the right, a conv
filter on the left) is packed once per model with :func:`pack`, and only the
other side is packed per call, block by block in a small per-thread workspace
(or read in place when its rows already hold the kernel's column panels). The
bias (per row or per column), a residual addend and a ReLU / clip ride on the
kernel's last store, so the output is written once, in its final layout.

Work splits over keel's worker threads (``keel.native.pool``) in a grid of tiles: row
groups x column groups of whole panels, for every product of a batch, each tile packed
in its thread's own workspace (the cpu planner's ``gemm_split`` picks the grid from the
threads and the L2); every element of C is computed by the same instructions in any
tile, so the result is bitwise the same for any thread count.

Measured on the 2-core AVX-512 development machine (AMD EPYC, Zen 4; a shared
machine, +-10 %), 1 thread, medians of interleaved runs, GFLOP/s of the bare
product (NumPy = OpenBLAS ``dot`` of contiguous operands, which packs both per
call; native = the constant operand prepacked, the other raw; onnxruntime = one
MatMul node). The kernel's own peak here is ~109 GFLOP/s (8 x 32 tiles in
cache); a single row (batch 1) takes a two-panel matrix-vector path:

=========================================  =====  ======  ===========
M x K x N                                  NumPy  native  onnxruntime
=========================================  =====  ======  ===========
32 x 784 x 512 (MLP layer 1, batch 32)       80     104     110
32 x 512 x 256                               84     103     105
1 x 784 x 512 (batch 1)                      36      41      30
4096 x 256 x 1024 (BERT-mini FFN, b32)      100     101
16 x 144 x 1024 (3x3 conv, 16 channels)      52     105      (filter on the left)
64 x 576 x 64                                90     106
128 x 1152 x 784                             99     105
512 x 4608 x 1568 (ResNet-18 last, b32)     104      92
=========================================  =====  ======  ===========

A raw B of a single depth block (a 1x1 conv's input) runs row panel by row panel
over wide column blocks; when the whole B is larger than the cpu planner's
``STREAM_BYTES`` (it
comes from memory, not cache; a conv's gathered taps count the span of the image they
are read from) gemm.c packs it in long sequential runs and
prefetches the next block: 16 x 32 x 12544 at batch 32 (MobileNetV2's first 1x1
layer) 17.3 ms -> 8.3 ms, 96 x 16 x 12544 46 -> 20 ms, 144 x 24 x 3136 17.7 ->
10.0 ms; 16 x 144 x 1024 at batch 1 (cached) stays in place at 0.047 ms. With
AVX-512, a product of 9-24 rows (or up to 256 rows with a depth of at least
twice the rows: the cpu planner's ``tall_tiles``) against such a B runs in gemm.c's
tall tiles instead:
every row of C over one 16-column vector at once, B read in place once with its rows
fetched ahead into L2 (MobileNetV2's projections at batch 32, inside the model:
16 x 32 x 12544 8.4 -> 5.1 ms, 24 x 144 x 3136 with the residual 14.3 -> 6.8 ms,
96 x 576 x 196 with the residual 10.1 -> 7.9 ms). A product of few columns on a B that
stays in L2 (the planner's ``lanes_tiles``: a 1x1 conv on 7x7 or 14x14 at batch 1) runs in
lanes tiles instead, C's rows in the vector lanes, computing only the columns there are
(320 x 960 x 49: 187 -> 133 us on AMD's Zen; docs/performance.md). On vendors outside the
planner's ``LANES_VENDORS`` (Intel's, whose shuffles share a port with an FMA unit) it
takes fewer shapes: deep products, or where the column panels waste many columns; a
conv's plan decides it for the vendor planned for (``gemm_lanes``). The lanes tiles take
a packed A only (a conv's weights): a MatMul's or Gemm's A is an activation, so their
products never run in them, whatever the vendor. A product in column panels whose last
panel holds a few columns (196 = 6 x 32 + 4) runs that panel alone in lanes tiles where
a conv's plan says so (``gemm_lanes_tail``: the planner's ``native_lanes_tail`` for the
tile and vendor planned for, the direct form's products only) and the product's shape
gives one (``lanes_tail_fits``); a call without a plan asks ``lanes_tail`` here. Where
a conv's products run wholly in lanes tiles, its filters are packed in 16-row panels only
where its plan says so (:func:`pack_a16`, the plan's ``gemm_a16``, the planner's
``native_a16`` for the vendor planned for, on Intel's cores: one load a vector instead of
joining two 8-row panels with an insert that takes an FMA unit's port); a call reads A
as it is packed, and one such a pack does not serve gets its 8-row panels, made once.
All of these give the same bits.

With its Python side (a prepared call reused per node, ~1 us) the cpu MatMul /
Gemm kernels with bias and ReLU take, in ms: 32x784x512 0.248 (NumPy + OpenBLAS
0.330), 32x512x256 0.084 (0.109), 32x256x10 0.0087 (0.0088), 1x256x10 0.0047
(0.0066). In ``benchmarks.run`` (1 thread, keel / onnxruntime time): the MLP
1.40 -> 1.11 at batch 32 and 1.63 -> 1.30 at batch 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import mmap
import struct
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar, final

import numpy as np

from keel import native
from keel.backends.bound import BoundCall, PartFailed
from keel.backends.cpu import workspace
from keel.backends.cpu.workspace import Scratch, thread_scratch
from keel.errors import ExecutionError

__all__ = ["BandCall", "Call", "Packed", "Rows", "XCall", "address", "available",
           "check_enums", "check_layout", "checked", "conv_epilogue_served", "gemm",
           "geometry", "holding", "moved_addresses", "same_memory", "pack",
           "pack_batch", "planner_rules", "prepare", "prepare_band", "strides_of",
           "units_call"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ACCUMULATE, _CLIP, _STREAM, _DIRECT, _NT, _TALL, _LANES = 1, 2, 4, 8, 16, 32, 64
_LANES_TAIL = 128       # the partly filled last column panel in lanes tiles (lanes_tail)
_FETCH_SHIFT = 8        # flags >> 8: rows of a packed B fetched ahead (gemm.c's column_panel)
# gemm.c's flags by name (its GEMM_FLAGS), checked at load (check_enums)
_FLAGS = {"KEEL_ACCUMULATE": _ACCUMULATE, "KEEL_CLIP": _CLIP, "KEEL_STREAM": _STREAM,
          "KEEL_DIRECT": _DIRECT, "KEEL_NT": _NT, "KEEL_TALL": _TALL, "KEEL_LANES": _LANES,
          "KEEL_LANES_TAIL": _LANES_TAIL, "KEEL_FETCH_SHIFT": _FETCH_SHIFT}
# keel_gemm_args of gemm.c: 24 int64 fields then alpha, lo, hi as doubles. One
# packed argument block costs ~0.3 us; 30 separate ctypes arguments cost ~3 us.
_ARGS = struct.Struct("<24q3d")
_A_FIELD = 3            # where A's address sits in it
_C_FIELD = 13           # and C's
_FLAGS_FIELD = 22       # and the flags
_RESIDUAL_FIELD = 19    # and the residual's
_ADDRESS = struct.Struct("<q")   # one address written into a call's arguments
# keel_conv_band_args of gemm.c: 21 int64 fields then lo, hi as doubles.
_BAND_ARGS = struct.Struct("<21q2d")
_BAND_X = 16            # where X's address sits in it
_BAND_OUT = (17, 19)    # and Y's and the residual's
# keel_conv_pool_args of gemm.c: 12 int64 fields (checked against its sizeof at load).
_POOL_ARGS = struct.Struct("<12q")
# _load checks both layouts against gemm.c's own sizeof and offsetof.
_F4 = np.dtype(np.float32)
_THP = Path("/sys/kernel/mm/transparent_hugepage")
_ASSUMED_HUGE_PAGE = 2 << 20   # x86-64's huge page, where the system does not say its own


@dataclass(frozen=True, eq=False)
class _Functions:
    gemm: Callable[..., None]
    gemm_mt: Callable[..., int]
    tiles_mt: Callable[..., int]     # keel_gemm_tiles_mt_f32: a grid of tiles on the pool
    calls: Callable[..., int]        # keel_gemm_calls_f32: bound calls one after another
    pack: Callable[..., None]
    band: Callable[..., None]        # keel_conv_band_f32, its _mt form, rows and workspace
    band_mt: Callable[..., int]
    band_rows: Callable[..., int]
    band_work: Callable[..., int]
    pooled: Callable[..., int]       # keel_conv_pool_f32, its _mt form and workspace
    pooled_mt: Callable[..., int]
    pooled_work: Callable[..., int]
    mr: int          # rows of a micro-tile (the panel width of a left operand)
    kc: int          # depth of a block (B's packed block, A's panel block)
    nr: int          # columns of a micro-tile (the panel width of a right operand)
    work: int        # floats of workspace one concurrent call needs
    tall: Callable[[int, int], bool]     # the cpu planner's tall-tile rule (m, k)
    lanes: Callable[[int, int, int, int], bool]   # its lanes-tile rule (batch, m, n, k)
    lanes_built: bool    # gemm.c built with lanes tiles (AVX-512, 8-row panels)


_loaded: dict[native.NativeLibrary, _Functions] = {}


def _functions() -> _Functions | None:
    """The gemm library's functions; None when the native tier is unavailable."""
    lib = native.library("gemm")
    if lib is None:
        return None
    found = _loaded.get(lib)
    if found is None:
        found = _loaded[lib] = _load(lib)
    return found


def _load(lib: native.NativeLibrary) -> _Functions:
    def size(symbol: str) -> int:
        return int(lib.function(symbol, [], _I64)())

    check_layout("keel_gemm_args", _ARGS, _C_FIELD, "C",
                  size("keel_gemm_args_size"), size("keel_gemm_args_c_offset"))
    check_layout("keel_gemm_args", _ARGS, _A_FIELD, "A",
                  size("keel_gemm_args_size"), size("keel_gemm_args_a_offset"))
    check_layout("keel_conv_band_args", _BAND_ARGS, _BAND_X, "X",
                  size("keel_conv_band_args_size"), size("keel_conv_band_args_x_offset"))
    check_enums(lib, "keel_gemm_flags", _FLAGS, "native_gemm")
    if size("keel_conv_pool_args_size") != _POOL_ARGS.size:
        raise ArgsLayoutError(f"keel_conv_pool_args is {size('keel_conv_pool_args_size')} "
                              f"bytes in gemm.c, {_POOL_ARGS.size} here: change both together")
    if size("keel_conv_pool_refused") != _POOL_REFUSED:
        raise ArgsLayoutError(f"gemm.c's KEEL_POOL_REFUSED is {size('keel_conv_pool_refused')}"
                              f", native_gemm's _POOL_REFUSED {_POOL_REFUSED}: change both "
                              "together")
    taps_from = size("keel_gemm_rows_first_taps_f32")
    if taps_from != planner_rules().ROWS_FIRST_TAPS_FROM:
        raise ArgsLayoutError(
            f"gemm.c runs taps row panel by row panel from {taps_from} columns, the cpu "
            f"planner's ROWS_FIRST_TAPS_FROM is {planner_rules().ROWS_FIRST_TAPS_FROM}: "
            "change both together")
    grid, built = (size("keel_gemm_mr_f32"), size("keel_gemm_nr_f32")), size(
        "keel_gemm_lanes_built_f32") == 1
    if built != planner_rules().lanes_built(grid):
        raise ArgsLayoutError(
            f"gemm.c {'builds' if built else 'does not build'} lanes tiles with its "
            f"{grid[0]} x {grid[1]} tiles, the cpu planner's LANES_GRID is "
            f"{planner_rules().LANES_GRID}: change both together")
    return _Functions(
        gemm=lib.function("keel_gemm_f32", [ctypes.c_char_p, _PTR, _I64, _I64, _I64]),
        gemm_mt=lib.function("keel_gemm_mt_f32", [ctypes.c_char_p, _I64, _I64, _I64], _I64),
        tiles_mt=lib.function("keel_gemm_tiles_mt_f32",
                              [ctypes.c_char_p, _I64, _I64, _I64, _I64], _I64),
        calls=lib.function("keel_gemm_calls_f32", [_PTR, _I64], _I64),
        pack=lib.function("keel_gemm_pack_f32",
                          [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64]),
        band=lib.function("keel_conv_band_f32", [ctypes.c_char_p, _PTR, _I64, _I64]),
        band_mt=lib.function("keel_conv_band_mt_f32", [ctypes.c_char_p, _I64, _I64], _I64),
        band_rows=lib.function("keel_conv_band_rows_f32", [ctypes.c_char_p], _I64),
        band_work=lib.function("keel_conv_band_workspace_f32", [ctypes.c_char_p], _I64),
        pooled=lib.function("keel_conv_pool_f32",
                            [ctypes.c_char_p, ctypes.c_char_p, _PTR, _I64, _I64], _I64),
        pooled_mt=lib.function("keel_conv_pool_mt_f32",
                               [ctypes.c_char_p, ctypes.c_char_p, _I64, _I64], _I64),
        pooled_work=lib.function("keel_conv_pool_workspace_f32",
                                 [ctypes.c_char_p, ctypes.c_char_p], _I64),
        mr=grid[0], nr=grid[1], kc=size("keel_gemm_kc_f32"),
        work=size("keel_gemm_workspace_f32"), tall=planner_rules().tall_tiles,
        lanes=planner_rules().lanes_tiles, lanes_built=built)


@functools.cache
def planner_rules() -> ModuleType:
    """The cpu planner module, whose rules (tall tiles, the least work per thread) the
    native kernels obey; imported on first use, since the planner imports them."""
    from keel.backends.cpu import planner

    return planner


class ArgsLayoutError(RuntimeError):
    """gemm.c's argument struct and the layout this module packs it in disagree."""


def check_layout(name: str, packer: struct.Struct, field: int, what: str, size: int,
                  offset: int) -> None:
    """Fail at load, before any call, when the C struct ``name`` (``size`` bytes, the
    rebound address ``what`` at byte ``offset``) is not the one ``packer`` writes."""
    if packer.size != size or 8 * field != offset:
        raise ArgsLayoutError(
            f"the C struct {name} is {size} bytes with {what}'s address at byte {offset}; "
            f"keel packs {packer.format!r} ({packer.size} bytes) with it at byte "
            f"{8 * field}: change both sides together")


def check_enums(lib: native.NativeLibrary, function: str, want: Mapping[str, int],
                module: str, error: type[Exception] = ArgsLayoutError) -> None:
    """Fail at load, before any call, where the C enum values ``function`` reports (its
    ``_names`` companion names them: enums.h's KEEL_ENUM_EXPORT) are not ``want``, those
    ``module`` builds its arrays with."""
    values = np.zeros(len(want) + 1, dtype=np.int64)
    count = int(lib.function(function, [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64)(
        values.ctypes.data, len(values)))
    names = lib.function(f"{function}_names", [], ctypes.c_char_p)().decode().split()
    got = dict(zip(names, values[:count].tolist(), strict=False))
    if count != len(names) or got != dict(want):
        raise error(f"{function} reports {got}; {module} builds its arrays with "
                    f"{dict(want)}: change both sides together")


def same_memory(z: Any, y: Any) -> bool:
    """``z`` is ``y``'s memory read the same way (a kernel then adds to what Y holds)."""
    return z is y or (z.strides == y.strides and address(z) == address(y))


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first element (remembered per array: see keel.native)."""
    return int(native.address(a))


def available() -> bool:
    """True when the native GEMM is built and loaded here."""
    return _functions() is not None


def geometry() -> tuple[int, int] | None:
    """(rows, columns) of the kernel's micro-tile; None when unavailable."""
    f = _functions()
    return None if f is None else (f.mr, f.nr)


def depth_block() -> int:
    """The depth of the kernel's blocks (gemm.c's KC; 512 where the tier is unavailable,
    gemm.c's default, for plans made without it)."""
    f = _functions()
    return 512 if f is None else f.kc


def workspace_floats() -> int:
    """Floats of the packing workspace each call has (gemm.c's keel_gemm_workspace_f32);
    0 where the tier is unavailable."""
    f = _functions()
    return 0 if f is None else f.work


@dataclass(frozen=True, eq=False)
class Packed:
    """A constant operand in the kernel's panel layout (see :func:`pack`)."""

    data: np.ndarray      # the panels (64-byte aligned)
    address: int
    left: bool            # the left operand A (M, K); else the right one B (K, N)
    rows: int             # M for a left operand, N for a right one
    depth: int            # K
    width: int            # the panel width it was packed for (MR or NR; 2 MR: pack_a16)
    batch_stride: int = 0     # floats from one product's panels to the next (pack_batch)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True, eq=False)
class Rows:
    """A right operand B whose rows lie anywhere in a flat buffer (no im2col matrix).

    Element (p, j) of product t is ``data[t * batch_stride + offsets[p] + j]``, or
    ``data[t * batch_stride + offsets[p] + columns[j]]`` with a column table: the
    taps of a convolution read straight from a padded image, each a run of ``n``
    "wide" output columns, or gathered to the output pixels.
    """

    data: np.ndarray          # 1-D float32
    offsets: np.ndarray       # (K,) int64
    n: int
    batch_stride: int = 0
    columns: np.ndarray | None = None     # (n,) int64


def strides_of(a: np.ndarray) -> tuple[int, ...] | None:
    """``a``'s strides in elements; None when one is not a whole number of them."""
    out = []
    for s in a.strides:
        q, r = divmod(s, a.itemsize)
        if r:
            return None
        out.append(q)
    return tuple(out)


def pack(matrix: np.ndarray, left: bool) -> Packed | None:
    """``matrix`` (float32, any strides) packed as the left operand A (M, K) or the
    right operand B (K, N); None when the native tier is unavailable."""
    return _pack(matrix, left, huge=True)


def _pack(matrix: np.ndarray, left: bool, huge: bool) -> Packed | None:
    """:func:`pack`, its panels on huge pages where ``huge`` (a kept operand) and the
    planner's ``huge_pages`` take their size; a temporary one stays off them."""
    f = _functions()
    if f is None:
        return None
    if matrix.dtype != _F4 or matrix.ndim != 2:
        raise ValueError(f"pack takes a 2-D float32 matrix, got {matrix.dtype}{matrix.shape}")
    st = strides_of(matrix)
    if st is None or st == (0, 0):
        matrix, st = np.ascontiguousarray(matrix), strides_of(np.ascontiguousarray(matrix))
    assert st is not None
    width = f.mr if left else f.nr
    if left:
        rows, depth, rs, ks = matrix.shape[0], matrix.shape[1], st[0], st[1]
    else:
        rows, depth, rs, ks = matrix.shape[1], matrix.shape[0], st[1], st[0]
    panels = -(-rows // width)
    data = _aligned(panels * depth * width, huge=huge)
    if data.size:
        f.pack(native.address(matrix), rows, depth, rs, ks, width, native.address(data),
               0, panels)
    data.flags.writeable = False
    return Packed(data, native.address(data) if data.size else 0, left, rows, depth, width)


def pack_batch(matrices: np.ndarray, left: bool) -> Packed | None:
    """A batch of matrices (T, M, K) or (T, K, N), each packed as :func:`pack` does,
    one after another: product t of a batched :func:`gemm` reads matrix t. None when
    the native tier is unavailable."""
    f = _functions()
    if f is None:
        return None
    if matrices.dtype != _F4 or matrices.ndim != 3:
        raise ValueError(f"pack_batch takes (T, rows, columns) float32 matrices, got "
                         f"{matrices.dtype}{matrices.shape}")
    if len(matrices) == 0:
        raise ValueError("pack_batch takes at least one matrix")
    parts = [_pack(m, left, huge=False) for m in matrices]     # copied into ``data``
    size = parts[0].data.size if parts[0] is not None else 0
    stride = -(-size // 16) * 16           # each product's panels start on a cache line
    data = _aligned(stride * len(parts), huge=True)
    for t, p in enumerate(parts):
        assert p is not None
        data[t * stride:t * stride + size] = p.data
    data.flags.writeable = False
    first = parts[0]
    assert first is not None
    return Packed(data, native.address(data), left, first.rows, first.depth, first.width,
                  stride)


def pack_a16(matrix: np.ndarray) -> Packed | None:
    """``matrix`` (M, K) packed as the left operand in 16-row panels only (pair q: row
    panels 2q and 2q + 1 side by side at each depth step, a last odd panel beside
    zeros), for a product its plan runs wholly in lanes tiles (the plan's ``gemm_a16``,
    the planner's ``native_a16``): gemm.c's lanes tiles load a vector of 16 rows where
    they joined two panels with an insert. The same values in the same lanes: the same
    bits. A build without lanes tiles (running a plan made for one with them) gets
    :func:`pack`'s 8-row panels at once; None when the native tier is unavailable."""
    f = _functions()
    if f is None or not f.lanes_built or matrix.dtype != _F4 or matrix.ndim != 2 or (
            not matrix.size):
        return pack(matrix, left=True)
    # Written straight from the matrix: no 8-row panels made on the way, whose freed
    # memory the allocator would keep.
    (m, k), w = matrix.shape, 2 * f.mr
    whole, part = divmod(m, w)
    out = _aligned(-(-m // w) * k * w, huge=True)
    view = out.reshape(-1, k, w)
    view[:whole] = matrix[:whole * w].reshape(whole, w, k).transpose(0, 2, 1)
    if part:
        view[whole, :, :part] = matrix[whole * w:].T
        view[whole, :, part:] = 0.0
    out.flags.writeable = False
    return Packed(out, native.address(out), True, m, k, w)


# The 8-row panels of each 16-row pack that a call it does not serve reads, made once.
_EIGHT_ROWS: weakref.WeakKeyDictionary[Packed, Packed] = weakref.WeakKeyDictionary()


def _eight_rows(a: Packed) -> Packed:
    """:func:`pack_a16`'s ``a`` again in 8-row panels, for a call whose product does
    not run wholly in lanes tiles (the same values: the same bits)."""
    held = _EIGHT_ROWS.get(a)
    if held is not None:
        return held
    w = a.width // 2
    panels, k = -(-a.rows // w), a.depth
    src = a.data.reshape(-1, k, a.width)
    out = _aligned(panels * k * w, huge=True)
    view = out.reshape(panels, k, w)
    view[0::2] = src[:, :, :w]
    view[1::2] = src[:panels // 2, :, w:]
    out.flags.writeable = False
    held = _EIGHT_ROWS[a] = Packed(out, native.address(out), True, a.rows, k, w)
    return held


def _aligned(n: int, huge: bool = False) -> np.ndarray:
    """``n`` float32 starting on a 64-byte boundary (a cache line, one AVX-512 vector);
    ``huge`` (a packed operand, read at every pass): from fresh huge pages where the
    planner's ``huge_pages`` takes that size and the system can be asked."""
    if huge and planner_rules().huge_pages(4 * n):
        held = _huge(4 * n)
        if held is not None:
            return held
    return workspace.aligned(n)


@dataclass(frozen=True)
class HugePages:
    """What this machine does with memory asked for as huge pages: whether it can be
    asked (MADV_HUGEPAGE), the transparent huge pages mode (None: not said), and the
    page size (``page_said``: read from the system, else x86-64's 2 MiB assumed)."""

    advisable: bool
    mode: str | None
    page: int
    page_said: bool

    @property
    def granted(self) -> bool:
        """Whether advised memory may get huge pages here."""
        return self.advisable and self.mode != "never"


@functools.cache
def huge_pages_here() -> HugePages:
    """This machine's :class:`HugePages` (read once)."""
    try:
        enabled = (_THP / "enabled").read_text()
        mode: str | None = enabled[enabled.index("[") + 1:enabled.index("]")]
    except (OSError, ValueError):
        mode = None
    try:
        page, said = int((_THP / "hpage_pmd_size").read_text()), True
    except (OSError, ValueError):
        page, said = _ASSUMED_HUGE_PAGE, False
    return HugePages(hasattr(mmap, "MADV_HUGEPAGE"), mode, page, said)


def _huge(size: int) -> np.ndarray | None:
    """``size`` bytes of float32 on fresh anonymous memory, starting on a huge-page
    boundary, its whole huge pages asked for as huge pages before any page is touched
    (None where the system cannot be asked or gives no mapping). Memory from the heap
    may already hold small pages, which asking later does not change; the array keeps
    its mapping alive.

    The mapping is ``size`` (to a small page) plus the slack that aligns it; the slack
    and the tail past the last whole huge page are marked as no huge pages, so that
    under THP "always" a touched tail does not take a whole huge page."""
    here = huge_pages_here()
    if not here.granted:
        return None
    page, small = here.page, mmap.PAGESIZE
    length = -(-size // small) * small + page - small
    try:
        whole = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
    except OSError:
        return None
    start = -ctypes.addressof(ctypes.c_char.from_buffer(whole)) % page
    body = size // page * page
    # Where the system refuses the advice, the mapping still serves.
    with contextlib.suppress(OSError):
        if body:
            whole.madvise(mmap.MADV_HUGEPAGE, start, body)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            if start:
                whole.madvise(mmap.MADV_NOHUGEPAGE, 0, start)
            if start + body < length:
                whole.madvise(mmap.MADV_NOHUGEPAGE, start + body, length - start - body)
    return np.frombuffer(whole, dtype=np.float32, count=size // 4, offset=start)


def _work(f: _Functions) -> int:
    """The address of this thread's packing workspace (f.work floats, ~200 KiB)."""
    return int(native.address(thread_scratch(Scratch.WORK, f.work)))


def _misaligned(strides: tuple[int, ...]) -> bool:
    """Whether a byte stride is not a whole number of float32 elements."""
    bits = 0
    for s in strides:
        bits |= s
    return bool(bits & 3)


def _operand(x: np.ndarray | Packed | Rows, left: bool, f: _Functions
             ) -> tuple[int, int, int, int, int, int] | None:
    """(address, two element strides, batch stride, rows, depth) of an operand.

    The strides are A's (row, depth) or B's (depth, column), as gemm.c takes
    them; ``rows`` is M for A and N for B. A packed operand has strides (0, 0,
    0); None when an array's strides are not whole elements or it would read as
    packed (both strides 0).
    """
    if isinstance(x, Packed):
        if x.width != (f.mr if left else f.nr) or x.left != left:
            return None
        return x.address, 0, 0, x.batch_stride, x.rows, x.depth
    if isinstance(x, Rows):
        if left or x.data.dtype != _F4 or x.offsets.dtype != np.int64 or (
                x.columns is not None and (x.columns.dtype != np.int64
                                           or x.columns.shape != (x.n,))):
            return None
        # Element (p, j) at data[offsets[p] + j]: depth stride 0, column stride 1.
        return native.address(x.data), 0, 1, x.batch_stride, x.n, x.offsets.shape[0]
    st = x.strides
    if x.dtype != _F4 or _misaligned(st):
        return None
    bs = st[0] >> 2 if x.ndim == 3 else 0
    # gemm.c's order: A (row stride, depth stride), B (depth stride, column stride).
    s0, s1 = st[-2] >> 2, st[-1] >> 2
    if s0 == 0 and s1 == 0:
        if x.size:
            return None
        s1 = 1                  # empty (NumPy gives it zero strides): nothing is read
    rows, depth = (x.shape[-2], x.shape[-1]) if left else (x.shape[-1], x.shape[-2])
    return native.address(x), s0, s1, bs, rows, depth


def gemm(a: np.ndarray | Packed, b: np.ndarray | Packed | Rows, c: np.ndarray, *,
         bias: np.ndarray | None = None, bias_rows: bool = False,
         residual: np.ndarray | None = None, alpha: float = 1.0,
         clip: tuple[float, float] | None = None, accumulate: bool = False,
         columns: np.ndarray | None = None, threads: int = 1) -> bool:
    """``c = clip(alpha * a @ b + bias + residual)``; False when not served (nothing written).

    ``a`` (M, K) or (T, M, K), ``b`` (K, N) or (T, K, N): float32 arrays with any
    element strides, or :class:`Packed` constants (shared by the batch); ``b``
    may also be :class:`Rows`. ``c`` (M, N) or (T, M, N) float32 with unit
    column stride; ``residual`` the same shape with unit column stride.
    ``columns`` (N int64 offsets, negative: dropped) maps column j of the
    product to column ``columns[j]`` of ``c`` and ``residual``, whose rows then
    have any length. ``bias``: a C-contiguous float32 vector of M
    (``bias_rows``) or N values (per column only without ``columns``).
    ``accumulate`` adds the product to what ``c`` holds (with ``alpha`` 1). None
    of the inputs may overlap ``c`` (the residual may be ``c`` itself only
    through ``accumulate``).
    """
    call = prepare(a, b, c, bias=bias, bias_rows=bias_rows, residual=residual, alpha=alpha,
                   clip=clip, accumulate=accumulate, columns=columns)
    if call is None:
        return False
    call.run(threads)
    return True


class Call:
    """One prepared :func:`gemm`: the kernel's arguments, ready to run again.

    The arguments hold the arrays' addresses. The call keeps B, the bias and the
    residual alive; A and C it does not (a caller caching calls must not pin
    the arrays they live in): run it only while those two live.
    """

    __slots__ = ("args", "batch", "c_layout", "f", "k", "keep", "m", "n", "values")

    def __init__(self, f: _Functions, values: tuple[float, ...], batch: int, m: int, n: int,
                 k: int, keep: tuple[object, ...], c_layout: tuple[object, ...]) -> None:
        self.f, self.values, self.args = f, values, _ARGS.pack(*values)
        self.batch, self.m, self.n, self.k = batch, m, n, k
        self.keep, self.c_layout = keep, c_layout

    def retarget(self, c: np.ndarray) -> Call | None:
        """The same call writing into ``c`` instead (None unless ``c`` has the shape,
        strides and dtype of the C it was prepared for): a model's outputs are fresh
        arrays every run, its other buffers the same ones. This call itself where ``c``
        lies where its C did (the allocator often hands a freed output's bytes to the
        next one of its size)."""
        if (c.shape, c.strides, c.dtype) != self.c_layout:
            return None
        address = native.address(c)
        if address == self.values[_C_FIELD]:
            return self         # a new array in the old one's place: the same call
        values = (*self.values[:_C_FIELD], address, *self.values[_C_FIELD + 1:])
        return Call(self.f, values, self.batch, self.m, self.n, self.k, self.keep,
                    self.c_layout)

    def moved(self, lo: int, hi: int, delta: int) -> Call:
        """The same call with C's (and the residual's) address moved by ``delta`` where it
        lies in ``[lo, hi)``: the output array it writes a view of moved, its layout kept."""
        values = moved_addresses(self.values, (_C_FIELD, _RESIDUAL_FIELD), lo, hi, delta)
        return Call(self.f, values, self.batch, self.m, self.n, self.k, self.keep,
                    self.c_layout)

    def split(self, threads: int) -> Any:
        """The cpu planner's tile grid of this call under a cap of ``threads``
        (:func:`keel.backends.cpu.planner.gemm_split`, for this machine's caches)."""
        values = self.values
        raw = (values[4] != 0 or values[5] != 0,
               values[8] != 0 or values[9] != 0 or values[11] != 0)
        return planner_rules().gemm_split(self.batch, self.m, self.n, self.k, threads,
                                          (self.f.mr, self.f.nr), raw=raw,
                                          lanes=bool(int(values[_FLAGS_FIELD]) & _LANES))

    def bound(self, threads: int, panel_major: bool = False) -> BoundCall:
        """``run(threads, panel_major)`` as a callable with no arguments, for the calling
        thread.

        The C function with its arguments converted once (the split included, and
        on one thread this thread's packing workspace): ~1 us less per call than
        :meth:`run`, which recomputes them each time (a third of a small GEMM's
        time). The same C call with the same arguments: bitwise the same result.
        The callable keeps the call (and the workspace) alive; run it only on this
        thread, while the call's A and C live.
        """
        return self._bound(threads, self.args, panel_major)

    def bound_reading(self, threads: int, a: np.ndarray) -> BoundCall | None:
        """:meth:`bound` on arguments of its own, whose A its ``point(array)`` moves: the
        call then reads A from ``array`` (C-contiguous, aligned, A's shape and dtype),
        until the next ``point``. For an A that is a model's feed, read where the caller
        has it instead of copied into the buffer ``a`` the call is bound to (a pass over
        it saved). None where A is a packed operand (its layout is not an array's) or
        not ``a`` (the call reads a copy of it, or another array: moving it would
        point the call at the wrong data)."""
        packed = self.values[_A_FIELD + 1] == 0 and self.values[_A_FIELD + 2] == 0
        if packed or self.values[_A_FIELD] != native.address(a):
            return None
        args = ctypes.create_string_buffer(self.args, len(self.args))
        return dataclasses.replace(self._bound(threads, args),
                                   point=functools.partial(_point, args))

    def _bound(self, threads: int, args: Any, panel_major: bool = False) -> BoundCall:
        """The call on ``args``, marked ``native``: it runs C code only, so NumPy's
        floating-point state means nothing to it (a program whose bound calls are all
        such runs them without setting it)."""
        f = self.f
        split = self._split(threads, panel_major)
        at = ctypes.cast(args, ctypes.c_void_p).value or 0  # the bytes' own buffer, held
        if split is not None:
            return BoundCall(functools.partial(checked, split[0], args, *split[2:]),
                             keep=(self, args), native=True,
                             entry=(_TILES_ENTRY, at, *split[2:]))
        units = self.batch * -(-self.n // f.nr)
        work = thread_scratch(Scratch.WORK, f.work)
        at_work = int(native.address(work))
        return BoundCall(functools.partial(f.gemm, args, at_work, 0, 0, units),
                         keep=(self, work, args), native=True,
                         entry=(_GEMM_ENTRY, at, at_work, 0, 0, units))

    def run(self, threads: int, panel_major: bool = False) -> None:
        """Compute, split over up to ``threads`` threads when the product is big enough.

        ``panel_major``: a batch of products splits by column panels across the batch
        (a thread's share is the same columns of every product) instead of product by
        product; the same result either way."""
        f = self.f
        split = self._split(threads, panel_major)
        if split is None:
            # Column panels: any split gives the same result, so one call does them all.
            f.gemm(self.args, _work(f), 0, 0, self.batch * -(-self.n // f.nr))
        else:
            checked(*split)

    def _split(self, threads: int, panel_major: bool = False) -> tuple[Any, ...] | None:
        """The ``*_mt`` kernel and its arguments of a call split over threads; None for
        one thread. ``panel_major``: column panels panel-major over the batch's products
        (split_rows -B of keel_gemm_mt_f32); else the planner's tile grid."""
        f = self.f
        if panel_major and self.batch > 1:
            parts = planner_rules().gemm_threads(
                threads, 2 * self.batch * self.m * self.n * self.k)
            units = self.batch * -(-self.n // f.nr)
            return None if parts <= 1 else (f.gemm_mt, self.args, -self.batch, units,
                                             min(parts, units))
        split = self.split(threads)
        if split.parts <= 1:
            return None
        return f.tiles_mt, self.args, split.rows, split.cols, split.pieces, split.parts


_GEMM_ENTRY, _TILES_ENTRY = 0, 1      # keel_gemm_calls_f32's kinds of entry


def joined(calls: Sequence[Callable[[], object]]) -> tuple[Callable[[], object], ...]:
    """``calls`` with each run of consecutive bound products (:meth:`Call.bound`, their
    ``entry``) made one call of keel_gemm_calls_f32: they run one after another in C,
    not through the interpreter, whose code and data a product's weights push out of the
    cache (the cpu planner's ``JOIN_CALLS``). The same C calls: bitwise the same results;
    a joined call that fails raises :class:`PartFailed` naming the step that failed."""
    f = _functions()
    if f is None:
        return tuple(calls)
    out: list[Callable[[], object]] = []
    run: list[BoundCall[Any]] = []
    for call in (*calls, None):
        if isinstance(call, BoundCall) and call.entry is not None:
            run.append(call)
            continue
        out.extend(run if len(run) < 2 else (_joined_call(f, run),))
        run = []
        if call is not None:
            out.append(call)
    return tuple(out)


def _joined_call(f: _Functions, calls: list[BoundCall]) -> BoundCall:
    entries = np.array([c.entry for c in calls], dtype=np.int64)
    return BoundCall(functools.partial(_run_joined, f.calls, int(entries.ctypes.data),
                                       len(calls), entries),
                     keep=(entries, *calls), native=True, parts=len(calls))


def _run_joined(calls: Callable[..., int], at: int, n: int, entries: np.ndarray) -> None:
    """keel_gemm_calls_f32 over the ``n`` rows of ``entries`` (at address ``at``); the
    index it returns on a failure is the step that failed (:class:`PartFailed`)."""
    failed = calls(at, n)
    if failed >= 0:
        kind = int(entries[failed, 0])
        raise PartFailed(failed, MemoryError(
            "native kernel: no memory for a worker thread's workspace")
            if kind in (_GEMM_ENTRY, _TILES_ENTRY) else
            ValueError(f"a joined product's entry of kind {kind}; the kinds are "
                       f"{_GEMM_ENTRY} and {_TILES_ENTRY}"))


def _point(args: Any, array: np.ndarray) -> None:
    """A :meth:`Call.bound_reading` call's A moved to ``array``."""
    _ADDRESS.pack_into(args, 8 * _A_FIELD, native.address(array))


def _point_x(args: Any, array: np.ndarray) -> None:
    """A :meth:`BandCall.bound_reading` call's X moved to ``array``."""
    _ADDRESS.pack_into(args, 8 * _BAND_X, native.address(array))


def moved_addresses(values: tuple[Any, ...], fields: tuple[int, ...], lo: int, hi: int,
           delta: int) -> tuple[Any, ...]:
    """``values`` with the addresses at ``fields`` that lie in ``[lo, hi)`` moved by ``delta``."""
    moved = list(values)
    for i in fields:
        if lo <= moved[i] < hi:
            moved[i] += delta
    return tuple(moved)


def holding(bound: Callable[[], object], *owners: object) -> BoundCall:
    """``bound`` keeping ``owners`` alive: its arguments are raw addresses, and the
    call's ``keep`` is the only owner of arrays made when it was prepared (a scalar
    bias broadcast to a row, a copied residual), whoever else drops the call."""
    return BoundCall(bound, keep=owners)


# What keel_conv_pool_f32 (and its _mt form) return where the pool refused the rows it was
# handed (gemm.c's KEEL_POOL_REFUSED, checked at load): a prepared call whose pool window
# reads conv rows the call did not compute, which prepare_pooled never makes.
_POOL_REFUSED = -2


def checked(fn: Callable[..., int], *args: Any) -> None:
    """Run a ``*_mt`` kernel (or a serial one that reports): its -1 means a worker could
    not allocate its workspace; gemm.c's KEEL_POOL_REFUSED that a pooled conv's pool
    refused its rows (ExecutionError: its output is incomplete)."""
    rc = fn(*args)
    if rc == _POOL_REFUSED:
        raise ExecutionError("native conv + max pool: the pool refused the conv rows it was "
                             "handed (its window reads conv rows the call did not compute); the "
                             "pooled output is incomplete")
    if rc != 0:
        raise MemoryError("native kernel: no memory for a worker thread's workspace")


def prepare(a: np.ndarray | Packed, b: np.ndarray | Packed | Rows, c: np.ndarray, *,
            bias: np.ndarray | None = None, bias_rows: bool = False,
            residual: np.ndarray | None = None, alpha: float = 1.0,
            clip: tuple[float, float] | None = None, accumulate: bool = False,
            columns: np.ndarray | None = None, masks: np.ndarray | None = None,
            nt: bool = False, lanes: bool | None = None,
            output_streams: bool = False, tail: bool | None = None) -> Call | None:
    """The :class:`Call` computing :func:`gemm`'s product; None when not served.

    ``nt``: C's final values are stored past the cache where they are whole aligned
    vectors (for a C much larger than the cache, read from memory by whoever reads
    it next; the kernel fences before it returns).

    ``lanes``: the product runs in lanes tiles where its operands fit them, or not, as
    the caller's plan says (the planner's native_tiles, for the vendor and tile planned
    for: ``lanes_tiles``, or with ``masks`` ``masked_lanes``); None: those rules for
    this machine. ``tail``: its partly filled last column panel runs in lanes tiles
    where its shape gives one (``lanes_tail_fits``), or not, as the plan says (the
    planner's native_lanes_tail); None: ``lanes_tail`` for this machine. ``output_streams``: a
    conv's gathered taps stream for its output's sake (the planner's output_streams,
    which counts the conv's images: gemm.c then writes C row panel by row panel).

    ``masks`` (with a :class:`Rows` right operand and no ``columns``) runs gemm.c's
    masked mode (KEEL_DIRECT): B's taps are read straight from the convolution's
    source planes, each column panel's lanes masked by the table (int64: the conv
    geometry, then per column panel and tap the bits of the columns whose tap lies
    inside the plane; see ``keel.backends.cpu.conv_gemm.Masked``), in lanes tiles where
    ``lanes`` (or the planner's ``masked_lanes``) takes the product and an image's taps
    fit the workspace.
    """
    f = _functions()
    if f is None or c.dtype != _F4:
        return None
    wide = (a if isinstance(a, Packed) and a.left and a.width == 2 * f.mr
            and a.batch_stride == 0 else None)           # A in 16-row panels only
    ra = (_operand(a, True, f) if wide is None
          else (wide.address, 0, 0, 0, wide.rows, wide.depth))
    rb = _operand(b, False, f)
    cs = c.strides
    if ra is None or rb is None or cs[-1] != 4 or _misaligned(cs) or (
            masks is not None and (not isinstance(b, Rows) or b.columns is not None
                                   or columns is not None or masks.dtype != np.int64
                                   or not masks.flags.c_contiguous)):
        return None
    m, k, n = ra[4], ra[5], rb[4]
    batch = c.shape[0] if c.ndim == 3 else 1
    _check_shapes(m, k, n, rb[5], c, columns)
    res = _residual(residual, c)
    if res is None or (bias is not None and (bias.shape != ((m,) if bias_rows else (n,))
                                             or (columns is not None and not bias_rows))):
        return None
    streams = output_streams and isinstance(b, Rows) and b.columns is not None
    in_lanes = f.lanes(batch, m, n, k) if lanes is None else lanes
    flags = (_ACCUMULATE if accumulate else 0) | (_CLIP if clip is not None else 0) | (
        _STREAM if streams or _b_bytes(b, batch, k, n) > planner_rules().STREAM_BYTES
        else 0) | (
        _DIRECT if masks is not None else 0) | (_NT if nt else 0) | (
        _TALL if f.tall(m, k) else 0) | (_LANES if _plain(ra, rb) and columns is None and (
            masks is None and not accumulate and in_lanes) else 0) | (
        _LANES if masks is not None and not accumulate and _masked_lanes(m, n, k, lanes, f)
        else 0) | (
        _LANES_TAIL if _plain(ra, rb) and columns is None and masks is None
        and not accumulate and _lanes_tail(m, n, k, tail) else 0) | (
        planner_rules().fetch_rows(4 * f.nr) << _FETCH_SHIFT if isinstance(b, Packed) else 0)
    lo, hi = clip if clip is not None else (0.0, 0.0)
    # A in 16-row panels only serves a product gemm.c runs wholly in lanes tiles (the
    # conditions of its lanes_fit; one row would run as a gemv); any other reads 8 rows.
    if wide is not None and not (flags & _LANES and masks is None and m > 1
                                 and f.lanes_built):
        a, wide = _eight_rows(wide), None
        ra = (a.address, 0, 0, 0, a.rows, a.depth)
    values = (m, n, k, *ra[:4], *rb[:4],
              native.address(b.offsets) if isinstance(b, Rows) else 0,
              native.address(masks) if masks is not None else
              native.address(b.columns) if isinstance(b, Rows) and b.columns is not None else 0,
              native.address(c), cs[-2] >> 2, cs[0] >> 2 if c.ndim == 3 else 0,
              0 if columns is None else native.address(columns),
              0 if bias is None else native.address(bias),
              2 - bias_rows, *res, flags, 0 if wide is None else wide.address, alpha,
              lo, hi)
    return Call(f, values, batch, m, n, k, (b, bias, residual, columns, masks,
                                            a if isinstance(a, Packed) else None),
                (c.shape, c.strides, c.dtype))


def with_tiles(call: Call, tall: bool, lanes: bool) -> Call:
    """``call`` with gemm.c's tall and lanes tiles asked for or not, whatever
    ``tall_tiles``, ``lanes_tiles`` and ``lanes_tail`` say of the shape it was prepared
    with (no lanes tail: its rule does not know the caller's columns): for a caller
    whose own planner rule knows the product's real columns (Winograd's products, whose
    pipeline prepares one call for every block). Every tiling sums each element of C the
    same way: the same bits either way."""
    flags = int(call.values[_FLAGS_FIELD]) & ~(_TALL | _LANES | _LANES_TAIL)
    flags |= (_TALL if tall else 0) | (_LANES if lanes else 0)
    values = (*call.values[:_FLAGS_FIELD], flags, *call.values[_FLAGS_FIELD + 1:])
    return Call(call.f, values, call.batch, call.m, call.n, call.k, call.keep, call.c_layout)


def _b_bytes(b: np.ndarray | Packed | Rows, batch: int, k: int, n: int) -> int:
    """The bytes of memory the products read B from, against the planner's STREAM_BYTES.

    A gathered B (a :class:`Rows` with a column table: a strided conv's taps from its
    phase image) reads only the span of its buffer its rows and columns reach, far less
    than its k x n taps (ResNet-18's 7x7 stem at batch 1: a 0.6 MiB phase image, 7.4 MB
    of taps), and that span decides whether B comes from cache; any other B is k x n
    floats a product.
    """
    if isinstance(b, Rows) and b.columns is not None and b.offsets.size and b.columns.size:
        span = int(b.offsets.max()) + int(b.columns.max()) + 1
        return 4 * ((batch - 1) * b.batch_stride + span)
    return 4 * batch * k * n


def _masked_lanes(m: int, n: int, k: int, planned: bool | None, f: _Functions) -> bool:
    """A masked product in lanes tiles: as its plan says (``planned``) where an image's
    taps (k x n floats) fit the workspace; None: the planner's masked_lanes here."""
    if planned is None:
        return bool(planner_rules().masked_lanes(m, n, k))
    return planned and not (f.work and k * n > f.work)


def _lanes_tail(m: int, n: int, k: int, planned: bool | None) -> bool:
    """A product's last column panel in lanes tiles: where its plan takes lanes tails
    (``planned``) and its shape gives one; None: the planner's lanes_tail here."""
    if planned is None:
        return bool(planner_rules().lanes_tail(m, n, k))
    return planned and bool(planner_rules().lanes_tail_fits(m, n, k))


def _plain(ra: tuple[int, ...], rb: tuple[int, ...]) -> bool:
    """Whether A is packed and B raw with contiguous rows (a depth stride: no row
    table): the operands gemm.c's tall and lanes tiles take."""
    return ra[1] == ra[2] == 0 and rb[2] == 1 and rb[1] != 0


def _check_shapes(m: int, k: int, n: int, kb: int, c: np.ndarray,
                  columns: np.ndarray | None) -> None:
    """The operands chain and C (through its column map) holds the product."""
    if kb != k or c.shape[-2] != m or (columns is None and c.shape[-1] != n):
        raise ValueError(f"gemm shapes do not chain: A {m}x{k}, B {kb}x{n}, C {c.shape}")
    if columns is not None and (
            columns.dtype != np.int64 or columns.shape != (n,) or not columns.flags.c_contiguous
            or (n and int(columns.max()) >= c.shape[-1])):
        raise ValueError(f"gemm column map must be {n} int64 offsets below {c.shape[-1]}")


def _residual(r: np.ndarray | None, c: np.ndarray) -> tuple[int, int, int] | None:
    if r is None:
        return 0, 0, 0
    st = r.strides
    if r.dtype != _F4 or r.shape != c.shape or st[-1] != 4 or _misaligned(st):
        return None
    return native.address(r), st[-2] >> 2, st[0] >> 2 if r.ndim == 3 else 0




_XC = TypeVar("_XC", bound="XCall")


class XCall(ABC):
    """A prepared native conv call that reads X where it lies (C-contiguous, as it was
    prepared) and splits its units over threads: :class:`BandCall` and
    native_blocked.BlockedCall. ``values`` are its argument struct's fields, X's address
    at ``_X`` and Y's and the residual's at ``_OUT``; a subclass remakes itself from
    changed values (``_again``) and binds its run (``bound``)."""

    __slots__ = ("_last", "keep", "values", "x_shape")
    _X: ClassVar[int]
    _OUT: ClassVar[tuple[int, ...]]

    def __init__(self, values: tuple[Any, ...], keep: tuple[object, ...],
                 x_shape: tuple[int, ...]) -> None:
        self.values, self.keep, self.x_shape = values, keep, x_shape
        # run()'s bound form: ((threads, the thread it was bound on, what the split reads
        # beyond them), its function, the workspace it writes). Not a BoundCall: that
        # keeps this call, and a cycle would hold the operands until the cyclic GC runs.
        self._last: tuple[tuple[int, int, Hashable], Callable[[], Any],
                          tuple[object, ...]] | None = None

    @abstractmethod
    def _again(self: _XC, values: tuple[Any, ...]) -> _XC:
        """The same call with ``values``."""

    @abstractmethod
    def _bind(self, threads: int) -> tuple[Callable[[], Any], tuple[object, ...]]:
        """``run(threads)`` as a function of no arguments and the workspace it writes
        (what it points into beyond ``keep``)."""

    def _split_reads(self) -> Hashable:
        """What the split of :meth:`_bind` reads beyond the thread count (run binds
        again when it changes): nothing here."""
        return None

    @final
    def bound(self, threads: int) -> BoundCall[Any]:
        """``run(threads)`` as a callable with no arguments (see :meth:`Call.bound`),
        keeping this call (and so its operands) and its workspace; marked ``native``: C
        code only. Where the split reads more than the threads (the planner's thread
        costs), it is asked again when that changes, as :meth:`run` does."""
        reads = self._split_reads()
        fn, work = self._bind(threads)
        if reads is None:
            return BoundCall(fn, keep=(self, *work), native=True)
        return BoundCall(_Resplit(self, threads, reads, fn, work), keep=(self,), native=True)

    @final
    def with_x(self: _XC, x: np.ndarray) -> _XC | None:
        """The same call reading ``x`` (None unless it is a C-contiguous float32 array of
        the shape it was prepared for)."""
        if x.shape != self.x_shape or x.dtype != _F4 or not x.flags.c_contiguous:
            return None
        i = self._X
        return self._again((*self.values[:i], native.address(x), *self.values[i + 1:]))

    @final
    def moved(self: _XC, lo: int, hi: int, delta: int) -> _XC:
        """The same call with Y's (and the residual's) address moved (see
        :meth:`Call.moved`)."""
        return self._again(moved_addresses(self.values, self._OUT, lo, hi, delta))

    @final
    def run(self, threads: int) -> None:
        """Compute, the units split over up to ``threads`` threads: bound on the first run
        for a thread count and calling thread (a bound call on one thread uses that
        thread's workspace, and bound again where what its split reads changes: the
        planner's thread costs), then called as bound, its arguments and split not made
        again each run."""
        key = (threads, threading.get_ident(), self._split_reads())
        last = self._last
        if last is None or last[0] != key:
            last = self._last = (key, *self._bind(threads))
        last[1]()


class _Resplit:
    """An :class:`XCall` bound for ``threads`` whose split reads the planner's thread
    costs: bound again when they change (measured, refreshed, or measured only after the
    program bound: ``thread_costs``' ``again``), so a program's step follows them as an
    unbound run does. The split changes the speed only, never the bits."""

    __slots__ = ("call", "fn", "reads", "threads", "work")

    def __init__(self, call: XCall, threads: int, reads: Hashable, fn: Callable[[], Any],
                 work: tuple[object, ...]) -> None:
        self.call, self.threads, self.reads, self.fn, self.work = call, threads, reads, fn, work

    def __call__(self) -> None:
        reads = self.call._split_reads()
        if reads != self.reads:
            self.fn, self.work = self.call._bind(self.threads)
            self.reads = reads
        self.fn()


def units_call(mt: Callable[..., int], serial: Callable[..., Any], args: tuple[object, ...],
               units: int, parts: int, floats: int, *, serial_reports: bool = False
               ) -> tuple[Callable[[], Any], tuple[object, ...]]:
    """``units`` units of the call of argument blocks ``args`` in ``parts`` chunks on
    keel's threads (``mt``, each worker with its own scratch), or on this thread
    (``serial``) with this thread's workspace of at least ``floats`` floats, returned with
    it. ``serial_reports``: the serial call returns a code too (:func:`checked`)."""
    if parts > 1:
        return functools.partial(checked, mt, *args, units, parts), ()
    work = thread_scratch(Scratch.WORK, floats)
    tail = (int(native.address(work)), 0, units)
    if serial_reports:
        return functools.partial(checked, serial, *args, *tail), (work,)
    return functools.partial(serial, *args, *tail), (work,)


class BandCall(XCall):
    """One prepared shallow convolution by bands of output rows (gemm.c's
    keel_conv_band_f32): Y = clip(conv(X, W) + bias + R) for a dense 2-D conv whose
    filter is packed as the GEMM's left operand. X is read where it lies (C-contiguous
    NCHW), so :meth:`with_x` rebinds the call to another X of the same shape."""

    __slots__ = ("args", "f", "units")
    _X = _BAND_X
    _OUT = _BAND_OUT

    def __init__(self, f: _Functions, values: tuple[Any, ...], units: int,
                 keep: tuple[object, ...], x_shape: tuple[int, ...]) -> None:
        super().__init__(values, keep, x_shape)
        self.f, self.args, self.units = f, _BAND_ARGS.pack(*values), units

    def _again(self, values: tuple[Any, ...]) -> BandCall:
        return BandCall(self.f, values, self.units, self.keep, self.x_shape)

    def _bind(self, threads: int) -> tuple[Callable[[], Any], tuple[object, ...]]:
        """The bands split over up to ``threads`` threads."""
        return self._bind_on(self.args, threads)

    def _bind_on(self, args: Any, threads: int) -> tuple[Callable[[], Any], tuple[object, ...]]:
        return units_call(self.f.band_mt, self.f.band, (args,), self.units,
                          max(1, min(threads, self.units)), self.f.work)

    def bound_reading(self, threads: int, x: np.ndarray) -> BoundCall | None:
        """:meth:`bound` on arguments of its own, whose X its ``point(array)`` moves (as
        :meth:`Call.bound_reading` moves A): the call then reads X from ``array``, which
        the caller gives C-contiguous, aligned, of X's shape and float32, until the next
        ``point``. None where the call does not read ``x`` itself."""
        if self.values[_BAND_X] != native.address(x) or x.shape != self.x_shape:
            return None
        args = ctypes.create_string_buffer(self.args, len(self.args))
        fn, work = self._bind_on(args, threads)
        return BoundCall(fn, keep=(self, args, *work), native=True,
                         point=functools.partial(_point_x, args))


def prepare_band(x: np.ndarray, a: Packed, y: np.ndarray, kernel: tuple[int, ...],
                 strides: tuple[int, ...], dilations: tuple[int, ...],
                 pads: tuple[int, ...], *, bias: np.ndarray | None = None,
                 residual: np.ndarray | None = None,
                 clip: tuple[float, float] | None = None, nt: bool = False
                 ) -> BandCall | None:
    """The :class:`BandCall` of a dense 2-D conv of X (N, C, H, W) into Y (N, M, OH, OW),
    both C-contiguous float32, with the filter ``a`` packed as the left operand (M, C *
    KH * KW); ``pads`` are the top and left padding. ``nt``: Y's stores bypass the
    cache (for a Y much larger than the cache). None when not served (a band's
    buffer larger than the workspace, operands of the wrong kind)."""
    f = _functions()
    if f is None or x.dtype != _F4 or y.dtype != _F4 or x.ndim != 4 or y.ndim != 4 or not (
            x.flags.c_contiguous and y.flags.c_contiguous) or not a.left or a.width != f.mr:
        return None
    n, c, h, w = x.shape
    m, oh, ow = y.shape[1:]
    if not len(kernel) == len(strides) == len(dilations) == len(pads) == 2:
        return None
    if y.shape[0] != n or a.rows != m or a.depth != c * kernel[0] * kernel[1]:
        raise ValueError(f"conv band shapes do not chain: X {x.shape}, Y {y.shape}, "
                         f"filter {a.rows}x{a.depth}")
    if not conv_epilogue_served(y, bias, residual):
        return None
    lo, hi = clip if clip is not None else (0.0, 0.0)
    values = (n, c, h, w, m, oh, ow, *kernel, *strides, *dilations, *pads, a.address,
              native.address(x), native.address(y),
              0 if bias is None else native.address(bias),
              0 if residual is None else native.address(residual),
              (_CLIP if clip is not None else 0) | (_NT if nt else 0), lo, hi)
    args = _BAND_ARGS.pack(*values)
    if f.band_work(args) > f.work:
        return None
    units = n * -(-oh // int(f.band_rows(args)))
    return BandCall(f, values, units, (a, bias, residual), tuple(x.shape))


def conv_epilogue_served(y: np.ndarray, bias: np.ndarray | None,
                         residual: np.ndarray | None) -> bool:
    """Whether a conv kernel writing Y (N, M, ...) can read ``bias`` (M,) and ``residual``
    (shaped like Y) as they are: C-contiguous float32, the residual not overlapping Y."""
    if residual is not None and (residual.shape != y.shape or residual.dtype != _F4
                                 or not residual.flags.c_contiguous
                                 or np.may_share_memory(residual, y)):
        return False
    return bias is None or (bias.shape == (y.shape[1],) and bias.dtype == _F4
                            and bias.flags.c_contiguous)


def band_rows(channels: int, kernel: tuple[int, ...], out: tuple[int, ...]) -> int | None:
    """Output rows per band of :func:`prepare_band` for a conv of ``channels`` input
    channels, a ``kernel`` (KH, KW) window and an ``out`` (OH, OW) output (gemm.c's
    keel_conv_band_rows_f32, which reads no array); None without the native tier."""
    f = _functions()
    if f is None or len(kernel) != 2 or len(out) != 2:
        return None
    values = (1, channels, 1, 1, 1, *out, *kernel, 1, 1, 1, 1, 0, 0, *([0] * 6), 0.0, 0.0)
    return int(f.band_rows(_BAND_ARGS.pack(*values)))


# ---- fused attention, whole heads or row blocks per thread (gemm.c's keel_attention_f32)
_ATTENTION_ARGS = struct.Struct("<12q")


@dataclass(frozen=True)
class _AttentionFunctions:
    serial: Callable[..., None]
    mt: Callable[..., int]
    scratch: Callable[..., int]


@functools.cache
def _attention_functions(lib: native.NativeLibrary) -> _AttentionFunctions:
    size = int(lib.function("keel_attention_args_size", [], _I64)())
    if size != _ATTENTION_ARGS.size:
        raise ArgsLayoutError(f"gemm.c's keel_attention_args is {size} bytes; native_gemm.py "
                              f"packs {_ATTENTION_ARGS.size}: change both sides together")
    args = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
    return _AttentionFunctions(
        serial=lib.function("keel_attention_f32", [*args, _PTR, _I64, _I64]),
        mt=lib.function("keel_attention_mt_f32", [*args, _I64], _I64),
        scratch=lib.function("keel_attention_scratch_f32", [ctypes.c_char_p], _I64))


class AttentionCall:
    """One prepared :func:`prepare_attention`: the kernel's arguments packed once, ready
    to run again while the arrays it was prepared on live (a program step's bound
    call)."""

    __slots__ = ("args", "fns", "keep", "parts", "pv", "qk", "units")

    def __init__(self, fns: _AttentionFunctions, qk: Call, pv: Call, args: bytes, units: int,
                 parts: int, keep: object) -> None:
        self.fns, self.qk, self.pv, self.args = fns, qk, pv, args
        self.units, self.parts, self.keep = units, parts, keep

    def run(self) -> None:
        if self.parts > 1:
            checked(self.fns.mt, self.qk.args, self.pv.args, self.args, self.parts)
            return
        held = thread_scratch(Scratch.ATTENTION, int(self.fns.scratch(self.args)))
        self.fns.serial(self.qk.args, self.pv.args, self.args, native.address(held), 0,
                        self.units)


def prepare_attention(qk: Call, pv: Call, s: int, t: int, mask: Any,
                      layout: tuple[int, int, int, int], causal: bool,
                      softmax: tuple[int, int], split: tuple[int, int]) -> AttentionCall | None:
    """softmax(scores + mask) V for every head, each head's rows in ``split`` = (row
    blocks a head, parts) (the planner's attention_split): whole blocks of rows on one
    of ``parts`` threads, their scores in that thread's scratch. ``qk``: the prepared
    scale * Q Kᵀ of every head (its C is rebound per thread), ``pv``: P V into Y, its A
    the scores; ``mask`` a float32 array read at ``layout`` (fastmath.mask_layout) or
    None; ``softmax`` (the address of fastmath's keel_softmax_f32, its mode). None when
    the native tier is not loaded."""
    lib = native.library("gemm")
    if lib is None:
        return None
    fns = _attention_functions(lib)
    heads, (blocks, parts) = qk.batch, split
    inner, mb, mh, ms = layout
    args = _ATTENTION_ARGS.pack(s, t, 0 if mask is None else native.address(mask), inner,
                                mb, mh, ms, int(causal), softmax[0], softmax[1], heads, blocks)
    return AttentionCall(fns, qk, pv, args, heads * blocks, parts, mask)


def attention(qk: Call, pv: Call, s: int, t: int, mask: Any, layout: tuple[int, int, int, int],
              causal: bool, softmax: tuple[int, int], split: tuple[int, int]) -> bool:
    """:func:`prepare_attention`'s call, run once. False when the native tier is not
    loaded (nothing written)."""
    call = prepare_attention(qk, pv, s, t, mask, layout, causal, softmax, split)
    if call is None:
        return False
    call.run()
    return True


@dataclass(frozen=True)
class PoolSplit:
    """How a conv pooled while its rows are in cache runs (the cpu planner's
    ``pool_in_conv_split``): ``bands`` bands of pooled rows an image (the units are
    images x bands), ``step`` pooled rows a step (the buffer holds the conv rows they
    read), ``fill`` conv rows a phase image of their taps at most."""

    bands: int
    step: int
    fill: int


@dataclass(frozen=True)
class RowPool:
    """The max pool a conv's rows go through (window.c's keel_maxpool_part_f32): its
    address, its window geometry's address (kept alive by ``keep``), its scratch floats,
    and the window's rows: kernel, stride, top padding."""

    function: int
    geometry: int
    scratch: int
    kh: int
    sh: int
    pt: int
    keep: object


class PooledCall:
    """A band conv (:class:`BandCall`, its Y never stored) pooled band by band into the
    pooled Y while its rows are in cache (gemm.c's keel_conv_pool_f32)."""

    __slots__ = ("args", "band", "f", "keep", "pool_args", "units")

    def __init__(self, f: _Functions, band: BandCall, pool_args: bytes, units: int,
                 keep: tuple[object, ...]) -> None:
        self.f, self.band, self.pool_args, self.units, self.keep = f, band, pool_args, units, keep
        # The conv's arguments, X's address rewritten in place for each new X (point_x).
        self.args = ctypes.create_string_buffer(band.args, len(band.args))

    def point_x(self, x: np.ndarray) -> bool:
        """Read ``x`` from now on (a bound call sees it too); False (nothing changed)
        unless it is a C-contiguous float32 array of the shape prepared for."""
        if x.shape != self.band.x_shape or x.dtype != _F4 or not x.flags.c_contiguous:
            return False
        _ADDRESS.pack_into(self.args, _BAND_X * 8, native.address(x))
        return True

    def bound(self, threads: int) -> Callable[[], Any]:
        """The call as a callable with no arguments, its units over up to ``threads``
        threads."""
        call, work = units_call(self.f.pooled_mt, self.f.pooled, (self.args, self.pool_args),
                                self.units, max(1, min(threads, self.units)),
                                int(self.f.pooled_work(self.args, self.pool_args)),
                                serial_reports=True)
        return holding(call, self, *work)


def prepare_pooled(band: BandCall, y: np.ndarray, pool: RowPool, split: PoolSplit
                   ) -> PooledCall | None:
    """``band``'s conv pooled by ``pool`` into ``y`` (N, M, PH, PW), C-contiguous float32;
    None where not served (a residual, Y's stores past the cache, another Y)."""
    f = _functions()
    n, m = band.values[0], band.values[4]
    if (f is None or band.values[19] or band.values[20] & _NT or y.dtype != _F4
            or not y.flags.c_contiguous or y.ndim != 4 or y.shape[:2] != (n, m)
            or min(split.bands, split.step, split.fill) < 1):
        return None
    ph, pw = y.shape[2:]
    args = _POOL_ARGS.pack(pool.function, pool.geometry, native.address(y), ph, pw, pool.kh,
                           pool.sh, pool.pt, split.bands, split.step, split.fill, pool.scratch)
    return PooledCall(f, band, args, n * split.bands, (y, pool.keep))
