"""The channel-blocked direct conv (blocked.c) through ctypes: Y = clip(conv(X, W) + bias
+ R) for a 3x3 conv with one pixel of padding on every side or an unpadded 1x1 conv, at
stride 1 or 2, the output channels in the vector lanes (the filters packed as
[M / 16][C][K * K][16]). X, Y and R are
each NCHW or channel-blocked: an (N, C, H, W) array whose bytes are ordered
[N][C / 16][H][W][16] (the cpu planner's float NCHWc region, ``planner.float_layouts``;
:func:`to_blocked` and :func:`to_nchw` change between the two). Each element of Y is the
masked and gathered conv tiles' chain of fused multiply-adds, so the form gives their
bits in either layout."""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel import native
from keel.backends.cpu import native_gemm
from keel.errors import InvalidArgumentError

__all__ = ["NCHWC", "NCHW_SIDES", "REGION_LAYOUTS", "BlockedCall", "Sides", "available",
           "Split", "pack_filters", "prepare", "to_blocked", "to_nchw"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# keel_conv_blocked_args of blocked.c: 19 int64 fields then lo, hi as doubles.
_ARGS = struct.Struct("<19q2d")
_GROUPS = 11            # where the channel groups sit in it
_X = 13                 # X's address
_OUT = (14, 16)         # and Y's and the residual's
_CLIP, _X_BLOCKED, _Y_BLOCKED, _R_BLOCKED = 2, 4, 8, 16     # blocked.c's BLOCKED_* flags
_FLAGS = {"BLOCKED_CLIP": _CLIP, "BLOCKED_X": _X_BLOCKED, "BLOCKED_Y": _Y_BLOCKED,
          "BLOCKED_R": _R_BLOCKED}                          # checked by name at load
_F4 = np.dtype(np.float32)
WIDE = 14               # pixels of the 2 x 14 register tiles blocked.c runs when told
LANES = 16              # output channels a block (one AVX-512 vector)
NCHWC = "nchwc16"       # the blocked layout's name in a plan's layout
# The layouts of a float NCHWc region's convs (X's -> Y's; "nchw->nchw": only the
# residual is blocked), as the cpu planner's float_layouts writes them.
REGION_LAYOUTS = frozenset({f"nchw->{NCHWC}", f"{NCHWC}->{NCHWC}", f"{NCHWC}->nchw",
                            "nchw->nchw"})


@dataclass(frozen=True, eq=False)
class _Functions:
    serial: Callable[..., None]
    mt: Callable[..., int]
    work: Callable[..., int]


def _functions() -> _Functions | None:
    """blocked.c's functions; None without the native tier or an AVX-512 build."""
    lib = native.library("blocked")
    return None if lib is None else _load(lib)


@functools.lru_cache(maxsize=4)
def _load(lib: native.NativeLibrary) -> _Functions | None:
    def size(symbol: str) -> int:
        return int(lib.function(symbol, [], _I64)())

    native_gemm.check_layout("keel_conv_blocked_args", _ARGS, _X, "X",
                             size("keel_conv_blocked_args_size"),
                             size("keel_conv_blocked_args_x_offset"))
    native_gemm.check_enums(lib, "keel_conv_blocked_flags", _FLAGS, "native_blocked")
    if size("keel_conv_blocked_lanes_f32") != LANES:
        return None                              # not an AVX-512 build
    return _Functions(
        serial=lib.function("keel_conv_blocked_f32", [ctypes.c_char_p, _PTR, _I64, _I64]),
        mt=lib.function("keel_conv_blocked_mt_f32", [ctypes.c_char_p, _I64, _I64], _I64),
        work=lib.function("keel_conv_blocked_workspace_f32", [ctypes.c_char_p], _I64))


def available() -> bool:
    """True when blocked.c is built for AVX-512 and loaded here."""
    return _functions() is not None


@dataclass(frozen=True)
class Sides:
    """Which of a conv's X, Y and residual are channel-blocked (the plan's layout)."""

    x: bool = False
    y: bool = False
    residual: bool = False

    @property
    def flags(self) -> int:
        return (_X_BLOCKED * self.x) | (_Y_BLOCKED * self.y) | (_R_BLOCKED * self.residual)


NCHW_SIDES = Sides()


def to_blocked(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """An NCHW (N, C, H, W) array's values as a blocked one of the same shape (C a
    multiple of 16): its bytes ordered [N][C / 16][H][W][16]."""
    n, c, h, w = a.shape
    out = np.empty(a.shape, a.dtype) if out is None else out
    out.reshape(n, c // LANES, h, w, LANES)[...] = a.reshape(
        n, c // LANES, LANES, h, w).transpose(0, 1, 3, 4, 2)
    return out


def to_nchw(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A blocked array's values (see :func:`to_blocked`) in NCHW order."""
    n, c, h, w = a.shape
    out = np.empty(a.shape, a.dtype) if out is None else out
    out.reshape(n, c // LANES, LANES, h, w)[...] = np.ascontiguousarray(a).reshape(
        n, c // LANES, h, w, LANES).transpose(0, 1, 4, 2, 3)
    return out


def pack_filters(w: np.ndarray) -> np.ndarray:
    """W (M, C, K, K), M a multiple of 16, as [M / 16][C][K * K][16] float32."""
    m, c = w.shape[:2]
    blocks = w.astype(np.float32, copy=False).reshape(m // LANES, LANES, c, -1)
    return np.ascontiguousarray(blocks.transpose(0, 2, 3, 1))


Split = Callable[[int], tuple[int, int]]
"""Threads -> (groups of output channels, chunks of the units): the planner's grid."""


class BlockedCall(native_gemm.XCall):
    """One prepared blocked conv. X is read where it lies (C-contiguous, NCHW or blocked
    as its layout says), so :meth:`with_x` rebinds the call to another X of the same
    shape; ``split`` gives, for a number of threads, the groups its output channels are
    cut into (whole register tiles each) and the chunks of its units (bands of output
    rows of one channel group of one image): the planner's grid. ``bands`` is the bands of
    all images, ``tiles`` the register tiles of output channels."""

    __slots__ = ("bands", "f", "split", "tiles")
    _X = _X             # the module's field indices above
    _OUT = _OUT

    def __init__(self, f: _Functions, values: tuple[Any, ...], bands: int, tiles: int,
                 split: Split, keep: tuple[object, ...], x_shape: tuple[int, ...]) -> None:
        super().__init__(values, keep, x_shape)
        self.f, self.bands, self.tiles, self.split = f, bands, tiles, split

    def _again(self, values: tuple[Any, ...]) -> BlockedCall:
        return BlockedCall(self.f, values, self.bands, self.tiles, self.split, self.keep,
                           self.x_shape)

    def _split_reads(self) -> Hashable:
        """The planner's split reads its thread costs (they change on a measurement)."""
        return native_gemm.planner_rules().split_reads()

    def _bind(self, threads: int) -> tuple[Callable[[], Any], tuple[object, ...]]:
        """The split's grid (InvalidArgumentError when its channel groups are not whole
        register tiles)."""
        groups, parts = self.split(threads)
        if groups < 1 or self.tiles % groups:
            raise InvalidArgumentError(
                f"blocked conv: {groups} channel group(s) of {self.tiles} register tiles; "
                "the groups must divide the tiles")
        args = _ARGS.pack(*self.values[:_GROUPS], groups, *self.values[_GROUPS + 1:])
        return native_gemm.units_call(self.f.mt, self.f.serial, (args,), self.bands * groups,
                                      parts, int(self.f.work(args)))


def prepare(x: np.ndarray, filters: np.ndarray, y: np.ndarray, oc_tile: int, rows: int,
            split: Split, *, stride: int = 1, bias: np.ndarray | None = None,
            residual: np.ndarray | None = None,
            clip: tuple[float, float] | None = None, sides: Sides = NCHW_SIDES,
            wide: bool = False) -> BlockedCall | None:
    """The :class:`BlockedCall` of a conv of X (N, C, H, W) into Y (N, M, OH, OW), both
    C-contiguous float32, ``filters`` from :func:`pack_filters`: 3x3 padded by one or 1x1
    unpadded (the filters say which), at ``stride`` 1 or 2; ``oc_tile`` blocks of 16
    channels a register tile, ``rows`` output rows a unit, ``split(threads)`` the channel
    groups and the chunks of the units (see :class:`BlockedCall`), ``sides`` which of X,
    Y and the residual are blocked, ``wide`` whether its register tiles are 2 x 14
    pixels (a 3x3 stride-2 conv of two blocks a tile, rows a multiple of 14 pixels; all
    the planner's). The residual may be Y itself where both have one layout. None when
    not served."""
    f = _functions()
    if f is None or x.dtype != _F4 or y.dtype != _F4 or x.ndim != 4 or y.ndim != 4 or not (
            x.flags.c_contiguous and y.flags.c_contiguous) or np.may_share_memory(x, y):
        return None
    n, c, h, w = x.shape
    m, taps = y.shape[1], filters.shape[2] if filters.ndim == 4 else 0
    kernel = {9: 3, 1: 1}.get(taps, 0)
    oh, ow = ((h + 2 - kernel) // stride + 1, (w + 2 - kernel) // stride + 1) if kernel == 3 \
        else ((h - 1) // stride + 1, (w - 1) // stride + 1)
    if (kernel == 0 or stride not in (1, 2) or y.shape != (n, m, oh, ow)
            or filters.shape != (m // LANES, c, taps, LANES)
            or c < 1 or rows < 1 or m % (LANES * oc_tile) or oh % rows
            or oc_tile not in (1, 2) or (sides.x and c % LANES)
            or (wide and (kernel, stride, oc_tile, ow % WIDE) != (3, 2, 2, 0))):
        return None
    in_place = (residual is not None and native_gemm.same_memory(residual, y)
                and sides.residual == sides.y)
    if not native_gemm.conv_epilogue_served(y, bias, None if in_place else residual):
        return None
    lo, hi = clip if clip is not None else (0.0, 0.0)
    values = (n, c, h, w, m, oh, ow, kernel, stride, oc_tile, rows, 1,
              native.address(filters), native.address(x),
              native.address(y), 0 if bias is None else native.address(bias),
              0 if residual is None else native.address(residual),
              (_CLIP if clip is not None else 0) | sides.flags, WIDE if wide else 0, lo, hi)
    return BlockedCall(f, values, n * (oh // rows), m // (LANES * oc_tile), split,
                       (filters, bias, residual), tuple(x.shape))
