"""int8 products and convolutions through the compiled kernels of ``qgemm.c``.

The C side multiplies 8-bit operands into int32 accumulators (AVX-512 VNNI's
``vpdpbusd``, AVX-VNNI's 256-bit form, or portable C, whichever the build for
this CPU has: :func:`isa`) and requantizes in the store; see its header
comment. This module is the NumPy-facing half: it packs constant weights once
(:func:`pack_conv` for QLinearConv's ``W[M, C/g, kh, kw]``, :func:`pack_matmul`
for a ``B[K, N]``), folds the zero points into int32 correction terms, and
calls the kernels on keel's worker threads.

The arithmetic is the reference kernels' (:mod:`keel.backends.reference.quantization`):
``acc = sum (x - x_zero_point)(w - w_zero_point) [+ bias]`` exactly in int32,
``y = saturate(round_half_even(float(acc) * multiplier) + y_zero_point)`` with the
multiplier and the product in float32 (onnxruntime's form; the multipliers travel
as float64 holding float32 values), so the 8-bit results are the reference's bit
for bit. Signed activations and unsigned weights are shifted by 128 (with
their zero points), which leaves every difference ``v - zero_point`` as it was.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

from keel import native
from keel.backends.cpu import native_gemm
from keel.backends.cpu.native_gemm import planner_rules
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, KeelError
from keel.ops.schemas.quantization import QUANT_RANGES, ConvGeometry, conv_geometry

__all__ = ["ISA_NAMES", "ConvCall", "Int8SizesError", "PackedConv", "PackedMatmul", "available",
           "check_sizes", "conv2d", "conv2d_call", "dequantize", "isa", "matmul", "max_pool",
           "pack_conv", "pack_matmul", "qlinear_add", "quantize"]

LIBRARY = "qgemm"
ISA_NAMES = {2: "avx512-vnni", 1: "avx-vnni", 0: "portable"}

_P, _I = ctypes.c_void_p, ctypes.c_int64
_T = TypeVar("_T")
# qgemm.c's enum orders, checked at load against keel_qgemm_layout (check_layout).
_KINDS = {DType.UINT8: 0, DType.INT8: 1, DType.FLOAT32: 2}      # KIND_*
_COLUMNS = {"padded": 0, "compact": 1, "rows": 2}                # COLUMNS_*
_QUANT = ("yzp", "lo", "hi", "kind")                    # QUANT_*: _quant's
_CONV_GEOMETRY = ("n", "c", "h", "w", "m", "oh", "ow", "kh", "kw", "sh", "sw", "dh", "dw",
                  "pt", "pl", "g")                               # Q_*: _ConvConstants'
_POOL_GEOMETRY = ("n", "c", "h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "pt", "pl", "dh",
                  "dw")                                          # P_*: max_pool's
_ADD = ("ra", "rb", "c")                                 # ADD_*: qlinear_add's constants
_ADD_BOUND = ("lo", "hi")                                # ADD_BOUND_*: and its bounds


class AddFlag(enum.IntFlag):
    """keel_qadd_u8's ``flags`` (qgemm.c's ADD_FLAG_*, checked at load by name): which of
    QLinearAdd's operands are int8, the others uint8."""

    A_S8 = 1
    B_S8 = 2
    Y_S8 = 4


@dataclass(frozen=True)
class _Functions:
    isa: int
    panel: int
    matmul: Any
    conv: Any
    direct: Any
    depthwise: Any
    depthwise_lanes: Any
    add: Any
    quantize: Any
    dequantize: Any
    maxpool: Any


def _load() -> _Functions | None:
    """The C functions of the loaded library (None when the tier is unavailable)."""
    lib = native.library(LIBRARY)
    return None if lib is None else _bind(lib)


class Int8SizesError(KeelError, RuntimeError):
    """A compiled int8 kernel's sizes or enum orders and the Python side's disagree (a
    build that does not match its planner: still a RuntimeError for callers that catch
    one)."""

    code = "INT8_SIZES"


def check_sizes(lib: native.NativeLibrary, function: str, names: tuple[str, ...]) -> None:
    """Fail at load, before any call, where the sizes the C ``function`` reports (in the
    order of ``names``) are not the cpu planner's ``names``: its splits count tasks in
    them."""
    sizes = np.zeros(len(names), dtype=np.int64)
    count = int(lib.function(function, [_P, _I], _I)(_ptr(sizes), len(names)))
    rules = planner_rules()
    planned = [int(getattr(rules, name)) for name in names]
    if count != len(names) or sizes.tolist() != planned:
        raise Int8SizesError(
            f"{function} reports {count} sizes {sizes.tolist()}; the cpu planner has "
            f"{dict(zip(names, planned, strict=True))}: change both sides together")


def slot_values(arrays: Sequence[tuple[str, tuple[str, ...], str]]) -> dict[str, int]:
    """The C enum values of ``arrays`` built in their slots' orders, by the C names: each
    (prefix, slot names, its length's name), as ``PREFIX_NAME`` = its index."""
    return {f"{prefix}{name.upper()}": i for prefix, names, length in arrays
            for i, name in enumerate((*names, length))}


def _layout() -> dict[str, int]:
    """The enum values this module builds its arrays with, by qgemm.c's names."""
    kinds = {"KIND_U8": _KINDS[DType.UINT8], "KIND_S8": _KINDS[DType.INT8],
             "KIND_F32": _KINDS[DType.FLOAT32]}
    columns = {f"COLUMNS_{name.upper()}": value for name, value in _COLUMNS.items()}
    return {**kinds, **columns, **slot_values((("QUANT_", _QUANT, "len"),
                                               ("Q_", _CONV_GEOMETRY, "len"),
                                               ("P_", _POOL_GEOMETRY, "len"),
                                               ("ADD_", _ADD, "len"),
                                               ("ADD_BOUND_", _ADD_BOUND, "len"))),
            **{f"ADD_FLAG_{flag.name}": int(flag) for flag in AddFlag}}


def check_enums(lib: native.NativeLibrary, function: str, want: Mapping[str, int],
                module: str) -> None:
    """native_gemm.check_enums, failing with :class:`Int8SizesError`."""
    native_gemm.check_enums(lib, function, want, module, Int8SizesError)


def check_layout(lib: native.NativeLibrary) -> None:
    """Fail at load where qgemm.c's enum values (keel_qgemm_layout, by name) are not the
    ones this module builds its arrays with."""
    check_enums(lib, "keel_qgemm_layout", _layout(), "native_qgemm")


@functools.lru_cache(maxsize=4)
def _bind(lib: native.NativeLibrary) -> _Functions:
    f = lib.function
    check_sizes(lib, "keel_qgemm_geometry", planner_rules().INT8_QGEMM_SIZES)
    check_layout(lib)
    return _Functions(
        isa=int(f("keel_qgemm_isa", [], _I)()),
        panel=int(f("keel_qgemm_panel", [], _I)()),
        matmul=f("keel_qmatmul_u8s8", [_P, _P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I],
                 _I),
        conv=f("keel_qconv2d_u8s8", [_P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P, _I], _I),
        direct=f("keel_qconv2d_direct_u8s8",
                 [_P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I], _I),
        depthwise=f("keel_qdepthwise_u8s8", [_P, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I], _I),
        depthwise_lanes=f("keel_qdepthwise_cl_u8s8", [_P, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I],
                          _I),
        add=f("keel_qadd_u8", [_P, _P, _I, _P, _P, _I, _P, _I], _I),
        quantize=f("keel_quantize_f32", [_P, _I, ctypes.c_float, _I, _I, _I, _P, _I], _I),
        dequantize=f("keel_dequantize_f32", [_P, _I, ctypes.c_float, _I, _I, _P, _I], _I),
        maxpool=f("keel_qmaxpool_8", [_P, _I, _P, _P, _I], _I),
    )


def available() -> bool:
    """Whether the int8 kernels are built and loaded (else ``native.status()`` says why)."""
    return _load() is not None


def isa() -> str | None:
    """The instruction set the loaded build multiplies with: ``avx512-vnni``,
    ``avx-vnni`` or ``portable``; None when the kernels are not available."""
    fns = _load()
    return None if fns is None else ISA_NAMES[fns.isa]


def _functions() -> _Functions:
    fns = _load()
    if fns is None:
        raise RuntimeError(f"native int8 kernels unavailable: {native.status().reason}")
    return fns


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else int(a.ctypes.data)


def _signed(w: np.ndarray, zero_point: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w`` and its zero point as int8 and int32 (uint8 shifted down by 128)."""
    if w.dtype == np.uint8:
        return (w.astype(np.int16) - 128).astype(np.int8), zero_point.astype(np.int32) - 128
    return w.astype(np.int8, copy=False), zero_point.astype(np.int32)


def _unsigned_shift(dtype: np.dtype) -> int:
    """What makes an activation of ``dtype`` unsigned: 128 for int8, 0 for uint8."""
    return 128 if dtype == np.int8 else 0


def slots(names: tuple[str, ...], dtype: Any = np.int64, **values: float) -> np.ndarray:
    """``values`` as the array (int64 unless ``dtype``) a kernel reads, in its enum order
    ``names``."""
    return np.array([values[name] for name in names], dtype=dtype)


def _quant(out: DType, y_zero_point: int) -> np.ndarray:
    if out is DType.FLOAT32:
        return slots(_QUANT, yzp=0, lo=0, hi=0, kind=_KINDS[out])
    lo, hi = QUANT_RANGES[out]
    return slots(_QUANT, yzp=y_zero_point, lo=lo, hi=hi, kind=_KINDS[out])


# ---- convolution -------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PackedConv:
    """QLinearConv weights as the kernel takes them: [M][kp] int8, k padded to 4."""

    weights: np.ndarray          # (M, kp) int8
    k: int                       # C/g * kh * kw
    kp: int
    zero_points: np.ndarray      # (M,) int32, shifted like the weights
    row_sums: np.ndarray         # (M,) int32: sum over k of the shifted weights
    shape: tuple[int, ...]
    # [M][kh][kw][c4] (c4: C/g rounded up to 4) for the kernel without im2col (any stride);
    # None when a weight zero point is not 0
    direct: np.ndarray | None = None
    taps: np.ndarray | None = None       # (M, kh * kw) int8: one input channel per output
    # the arrays conv2d derives from a call's constants (_conv_constants), by those constants
    calls: dict[tuple[Any, ...], _ConvConstants] = field(default_factory=dict, repr=False)
    # the geometry of a call, by (x's shape, id(attrs)), with the attrs kept (so their id is
    # not reused while the entry lives)
    geometries: dict[tuple[Any, ...], tuple[Mapping[str, Any], ConvGeometry]] = field(
        default_factory=dict, repr=False)
    # a node's prepared conv2d calls (conv2d_call) by its caller's key, with what the
    # caller keeps beside them
    prepared: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    def remember(self, key: tuple[Any, ...], value: Any) -> None:
        """Keep ``value`` under ``key`` in :attr:`prepared` (at most _KEPT_CALLS)."""
        if len(self.prepared) >= _KEPT_CALLS:
            self.prepared.clear()
        self.prepared[key] = value

    def geometry(self, x_shape: tuple[int, ...], attrs: Mapping[str, Any]) -> ConvGeometry:
        """conv_geometry for x of ``x_shape`` and these weights, resolved once per node
        (resolving it took a third of a small layer's Python time)."""
        key = (x_shape, id(attrs))
        found = self.geometries.get(key)
        if found is not None and found[0] is attrs:
            return found[1]
        geo = conv_geometry(x_shape, self.shape, attrs)
        if len(self.geometries) >= _KEPT_CALLS:
            self.geometries.clear()
        self.geometries[key] = (attrs, geo)
        return geo

    @property
    def nbytes(self) -> int:
        return int(self.weights.nbytes + self.zero_points.nbytes + self.row_sums.nbytes)


@dataclass(frozen=True)
class _ConvConstants:
    """What conv2d passes the kernel besides x and y, for one set of a node's constants."""

    bias_r: np.ndarray           # (M,) int32: the bias and the zero points' constant terms
    geometry: np.ndarray         # int64, qgemm.c's geometry enum
    mult: np.ndarray             # (M,) float64
    quant: np.ndarray            # int64: y's zero point, range and kind
    count: int                   # parts for the worker threads
    chunk: int                   # images per chunk of the direct kernel's layout

    @functools.cached_property
    def pointers(self) -> tuple[Any, Any, Any, Any]:
        """bias_r's, geometry's, mult's and quant's addresses, as the kernels take them."""
        return _ptr(self.bias_r), _ptr(self.geometry), _ptr(self.mult), _ptr(self.quant)


_KEPT_CALLS = 8     # sets of constants a PackedConv remembers (one per node, as a rule)


def _conv_constants(x: np.ndarray, xz: int, packed: PackedConv, geo: ConvGeometry,
                    bias: np.ndarray | None, multiplier: np.ndarray, y_dtype: np.dtype,
                    y_zero_point: int, threads: int) -> _ConvConstants:
    """The kernel's constant arguments for this call, computed once per set of them: a
    node runs with the same ones every time, and computing them took as long as a small
    layer's products."""
    key = (x.shape, xz, geo, None if bias is None else bias.tobytes(), multiplier.tobytes(),
           y_dtype.char, int(y_zero_point), threads)
    found = packed.calls.get(key)
    if found is not None:
        return found
    n, c, h, w_ = (int(d) for d in x.shape)
    m = packed.weights.shape[0]
    row = -xz * packed.row_sums.astype(np.int64) + packed.k * xz * packed.zero_points.astype(
        np.int64)
    if bias is not None:
        row = row + bias.astype(np.int64)
    (oh, ow), (kh, kw) = geo.out_spatial, geo.kernel
    split = planner_rules().int8_direct_split(n, geo.group, oh * ow, packed.k, m,
                                              image_positions(h, w_, geo), threads)
    found = _ConvConstants(
        np.ascontiguousarray(row, dtype=np.int32),
        slots(_CONV_GEOMETRY, n=n, c=c, h=h, w=w_, m=m, oh=oh, ow=ow, kh=kh, kw=kw,
              sh=geo.strides[0], sw=geo.strides[1], dh=geo.dilations[0],
              dw=geo.dilations[1], pt=geo.pads_begin[0], pl=geo.pads_begin[1], g=geo.group),
        np.ascontiguousarray(np.broadcast_to(multiplier.reshape(-1), (m,)), dtype=np.float64),
        _quant(DType.from_numpy(y_dtype), y_zero_point), split.parts, split.chunk)
    if len(packed.calls) >= _KEPT_CALLS:
        packed.calls.clear()
    packed.calls[key] = found
    return found


def image_positions(h: int, w: int, geo: ConvGeometry) -> int:
    """About how many positions one image of an h x w input takes in the direct kernel's
    stacked layout (a stride phase's padded rows times its columns)."""
    (sh, sw), (pt, pl) = geo.strides, geo.pads_begin
    return -(-(h + pt) // sh) * -(-(w + pl) // sw)


def pack_conv(w: np.ndarray, w_zero_point: np.ndarray) -> PackedConv:
    """Pack a 2-D convolution's 8-bit weights (M, C/g, kh, kw) once."""
    m = int(w.shape[0])
    k = int(math.prod(w.shape[1:]))
    kp = -(-k // 4) * 4
    zp = np.broadcast_to(np.asarray(w_zero_point).reshape(-1), (m,))
    ws, zs = _signed(np.asarray(w).reshape(m, k), zp)
    packed = np.zeros((m, kp), dtype=np.int8)
    packed[:, :k] = ws
    return PackedConv(packed, k, kp, np.ascontiguousarray(zs, dtype=np.int32),
                      ws.sum(axis=1, dtype=np.int64).astype(np.int32), tuple(w.shape),
                      _direct_layout(ws.reshape(w.shape)) if w.ndim == 4 and not np.any(zs)
                      else None,
                      np.ascontiguousarray(ws) if w.ndim == 4 and w.shape[1] == 1 else None)


def _direct_layout(w: np.ndarray) -> np.ndarray:
    m, c, kh, kw = w.shape
    c4 = -(-c // 4) * 4
    out = np.zeros((m, kh, kw, c4), dtype=np.int8)
    out[..., :c] = w.transpose(0, 2, 3, 1)
    return out.reshape(m, kh * kw * c4)


def conv2d(x: np.ndarray, x_zero_point: int, packed: PackedConv, geo: ConvGeometry,
           bias: np.ndarray | None, multiplier: np.ndarray, y_zero_point: int, y: np.ndarray,
           threads: int = 1) -> None:
    """``y`` (N, M, OH, OW) = requantized convolution of the 8-bit NCHW ``x``."""
    conv2d_call(x, x_zero_point, packed, geo, bias, multiplier, y_zero_point, y.dtype,
                threads)(x, y)


@dataclass(frozen=True)
class ConvCall:
    """conv2d's kernel calls for one node's shapes and constants, every argument but x's
    and y's addresses derived once: ``fn(x, *head, y, *tail)`` for each kernel that may
    take the geometry, in conv2d's order (a kernel's -2 passes to the next), the arrays
    those addresses point into kept alive here."""

    kernels: tuple[tuple[Any, tuple[Any, ...], tuple[Any, ...]], ...]
    keep: tuple[Any, ...]

    def __call__(self, x: np.ndarray, y: np.ndarray) -> None:
        xc = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        xp, yp = _ptr(xc), _ptr(y)
        for fn, head, tail in self.kernels:
            rc = fn(xp, *head, yp, *tail)
            if rc != -2:
                _check(rc)
                return
        raise InvalidArgumentError(f"native int8 convolution: geometry of {x.shape} not taken")


def conv2d_call(x: np.ndarray, x_zero_point: int, packed: PackedConv, geo: ConvGeometry,
                bias: np.ndarray | None, multiplier: np.ndarray, y_zero_point: int,
                y_dtype: np.dtype, threads: int = 1) -> ConvCall:
    """conv2d's calls for x of this shape and type and these constants (a node prepares
    them once: they took as long as a small layer's products)."""
    fns = _functions()
    c, m = int(x.shape[1]), packed.weights.shape[0]
    shift = _unsigned_shift(x.dtype)
    xz = int(x_zero_point) + shift
    consts = _conv_constants(x, xz, packed, geo, bias, multiplier, np.dtype(y_dtype),
                             y_zero_point, threads)
    bias_r, geometry, mult, quant, count = (consts.bias_r, consts.geometry, consts.mult,
                                            consts.quant, consts.count)
    (oh, ow), (kh, kw) = geo.out_spatial, geo.kernel
    kernels: list[tuple[Any, tuple[Any, ...], tuple[Any, ...]]] = []
    keep: list[Any] = [consts]
    if packed.taps is not None and geo.group == c == m:
        raw = np.ascontiguousarray(bias, dtype=np.int32) if bias is not None else None
        keep.append(raw)
        head = (int(x.dtype == np.int8), int(x_zero_point), _ptr(packed.taps),
                _ptr(packed.zero_points) if np.any(packed.zero_points) else None,
                _ptr(geometry), _ptr(raw), _ptr(mult), _ptr(quant))
        if planner_rules().int8_depthwise_lanes(oh * ow):
            kernels.append((fns.depthwise_lanes, head, (count,)))
        kernels.append((fns.depthwise, head, (count,)))
    if packed.direct is not None and geo.group == 1 and geo.dilations == (1, 1):
        c4 = packed.direct.shape[1] // (kh * kw)
        p_bias, p_geometry, p_mult, p_quant = consts.pointers
        columns = _COLUMNS[planner_rules().int8_conv_columns(ow, m, packed.direct.shape[1])]
        kernels.append((fns.direct, (shift, xz & 0xFF, _ptr(packed.direct), c4, p_geometry,
                                     p_bias, p_mult, p_quant), (consts.chunk, count, columns)))
    zr = -packed.zero_points
    keep.append(zr)
    kernels.append((fns.conv, (shift, xz & 0xFF, _ptr(packed.weights), packed.kp,
                               _ptr(geometry), _ptr(bias_r), _ptr(zr) if np.any(zr) else None,
                               _ptr(mult), _ptr(quant)), (count,)))
    return ConvCall(tuple(kernels), tuple(keep))


# ---- matmul ------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PackedMatmul:
    """A constant B (K, N) as the kernel's panels of 64 columns: [N/64][kp/4][64][4]."""

    panels: np.ndarray           # int8
    k: int
    kp: int
    n: int
    zero_points: np.ndarray      # (N,) int32, shifted like the weights
    col_sums: np.ndarray         # (N,) int64: sum over k of the shifted weights
    # B's zero points as packed, one per column (a node whose zero point is not a
    # constant runs with another value: serves_zero_point says whether this pack holds)
    source_zero_points: np.ndarray | None = field(default=None, repr=False)
    # the arrays matmul derives from a call's constants (_matmul_constants), and what a
    # node's kernel derives from its other operands (keyed by the caller), by those values
    calls: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return int(self.panels.nbytes + self.zero_points.nbytes + self.col_sums.nbytes)

    def serves_zero_point(self, b_zero_point: np.ndarray) -> bool:
        """Whether B was packed with these zero point(s) (scalar or per column)."""
        if self.source_zero_points is None:
            return True
        given = np.asarray(b_zero_point).reshape(-1)
        return given.size in (1, self.n) and bool(np.array_equal(
            np.broadcast_to(given, (self.n,)), self.source_zero_points))

    def remembered(self, key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
        """What ``make`` derives for ``key``, made once: a node calls with the same
        constants run after run (at most _KEPT_CALLS sets kept)."""
        found = self.calls.get(key)
        if found is None:
            if len(self.calls) >= _KEPT_CALLS:
                self.calls.clear()
            found = self.calls[key] = make()
        return cast(_T, found)


@dataclass(frozen=True)
class _MatmulConstants:
    """What matmul passes the kernel besides A, its row sums and y, for one set of a
    node's constants: the addresses of the arrays kept here, and the parts."""

    arrays: tuple[np.ndarray | None, ...]
    bias: Any
    zero_points: Any
    mult: Any
    quant: Any
    count: int


def _matmul_constants(packed: PackedMatmul, rows: int, az: int, bias: np.ndarray | None,
                      multiplier: np.ndarray, out: DType, y_zero_point: int,
                      threads: int) -> _MatmulConstants:
    """matmul's constant arguments, made once per set of them (they took most of a small
    product's call: LeNet's 32 x 400 x 120 QGemm about 20 of its 29 us)."""
    key = ("matmul", rows, az, None if bias is None else (bias.dtype.char, bias.tobytes()),
           multiplier.dtype.char, multiplier.shape, multiplier.tobytes(), out,
           int(y_zero_point), threads)
    return packed.remembered(key, lambda: _make_matmul_constants(
        packed, rows, az, bias, multiplier, out, y_zero_point, threads))


def _make_matmul_constants(packed: PackedMatmul, rows: int, az: int, bias: np.ndarray | None,
                           multiplier: np.ndarray, out: DType, y_zero_point: int,
                           threads: int) -> _MatmulConstants:
    col = -az * packed.col_sums + packed.k * az * packed.zero_points.astype(np.int64)
    if bias is not None:
        col = col + bias.astype(np.int64)
    bias_c = np.ascontiguousarray(col, dtype=np.int32)
    zv = np.ascontiguousarray(-packed.zero_points) if np.any(packed.zero_points) else None
    mult = np.ascontiguousarray(np.broadcast_to(multiplier.reshape(-1), (packed.n,)),
                                dtype=np.float64)
    quant = _quant(out, y_zero_point)
    count = planner_rules().int8_matmul_split(rows, packed.k, packed.n, threads).parts
    return _MatmulConstants((bias_c, zv, mult, quant), _ptr(bias_c), _ptr(zv), _ptr(mult),
                            _ptr(quant), count)


def pack_matmul(b: np.ndarray, b_zero_point: np.ndarray) -> PackedMatmul:
    """Pack a constant 8-bit B (K, N) and its zero point(s) (scalar or per column) once."""
    panel = _functions().panel
    k, n = (int(d) for d in b.shape)
    kp, np_ = -(-k // 4) * 4, -(-n // panel) * panel
    zp = np.broadcast_to(np.asarray(b_zero_point).reshape(-1), (n,))
    bs, zs = _signed(np.asarray(b), zp)
    padded = np.zeros((kp, np_), dtype=np.int8)
    padded[:k, :n] = bs
    panels = np.ascontiguousarray(
        padded.reshape(kp // 4, 4, np_ // panel, panel).transpose(2, 0, 3, 1))
    return PackedMatmul(panels, k, kp, n, np.ascontiguousarray(zs, dtype=np.int32),
                        bs.sum(axis=0, dtype=np.int64), np.array(zp))


def matmul(a: np.ndarray, a_zero_point: int, packed: PackedMatmul, bias: np.ndarray | None,
           multiplier: np.ndarray, out: DType, y_zero_point: int, y: np.ndarray,
           threads: int = 1) -> None:
    """``y`` (rows, N) = requantized (or float, ``out`` FLOAT32) ``a`` (rows, K) @ B."""
    fns = _functions()
    rows = int(a.shape[0])
    shift = _unsigned_shift(a.dtype)
    az = int(a_zero_point) + shift
    if not shift and packed.kp == packed.k and a.flags.c_contiguous:
        au = a                      # already the kernel's operand: no copy
    else:
        au = np.zeros((rows, packed.kp), dtype=np.uint8)
        au[:, :packed.k] = a.view(np.uint8) ^ np.uint8(0x80) if shift else a
    consts = _matmul_constants(packed, rows, az, bias, multiplier, out, y_zero_point, threads)
    sr = None
    if consts.zero_points is not None:
        sr = au.sum(axis=1, dtype=np.int64).astype(np.int32)
    rc = fns.matmul(_ptr(au), _ptr(packed.panels), rows, packed.n, packed.kp, consts.bias,
                    consts.zero_points, _ptr(sr), consts.mult, 1, consts.quant,
                    _ptr(y), packed.n, consts.count)
    _check(rc)


# ---- QLinearAdd ---------------------------------------------------------------------------
def qlinear_add(a: np.ndarray, b: np.ndarray, constants: tuple[float, float, float],
                y_zero_point: int, relu: bool, y: np.ndarray, threads: int = 1) -> None:
    """``y`` = onnxruntime's QLinearAdd of same-shaped contiguous 8-bit ``a`` and ``b``:
    ``constants`` the finite float32 ra, rb and c of the reference's
    ``qlinear_add_constants``; a fused ReLU clamps at ``y_zero_point``."""
    flags = _add_flags(a.dtype, b.dtype, y.dtype)
    args = _add_arguments(constants, y_zero_point, relu, y.dtype.char, a.size, threads)
    rc = _functions().add(_ptr(a), _ptr(b), a.size, args.constants, args.bounds, flags,
                          _ptr(y), args.count)
    _check(rc)


@functools.lru_cache(maxsize=8)
def _add_flags(a: np.dtype, b: np.dtype, y: np.dtype) -> int:
    """keel_qadd_u8's flags for operands of these 8-bit types (a plain int for the call)."""
    flags = AddFlag(0)
    for dtype, flag in ((a, AddFlag.A_S8), (b, AddFlag.B_S8), (y, AddFlag.Y_S8)):
        if dtype == np.int8:
            flags |= flag
    return int(flags)


@dataclass(frozen=True)
class _AddArguments:
    """What qlinear_add passes besides the operands: the addresses of its constants and
    bounds (the arrays kept alive here) and the parts for the threads."""

    arrays: tuple[np.ndarray, np.ndarray]
    constants: Any
    bounds: Any
    count: int


@functools.lru_cache(maxsize=64)
def _add_arguments(constants: tuple[float, float, float], y_zero_point: int, relu: bool,
                   y_type: str, size: int, threads: int) -> _AddArguments:
    """qlinear_add's constant arguments, made once per set of them (a residual join runs
    with the same ones every time; making them took a third of a small join's call)."""
    lo, hi = QUANT_RANGES[DType.from_numpy(np.dtype(y_type))]
    ra, rb, zero_points = constants
    c = slots(_ADD, np.float32, ra=ra, rb=rb, c=zero_points)
    b = slots(_ADD_BOUND, lo=max(lo, y_zero_point) if relu else lo, hi=hi)
    count = planner_rules().int8_pass_parts(size, threads)
    return _AddArguments((c, b), _ptr(c), _ptr(b), count)


# ---- QuantizeLinear --------------------------------------------------------------------------
def quantize(x: np.ndarray, scale: float, y_zero_point: int, y: np.ndarray,
             threads: int = 1) -> None:
    """``y`` (8-bit) = QuantizeLinear of the contiguous float32 ``x`` with one float32
    ``scale`` and zero point, as the NumPy kernel computes it."""
    lo, hi = QUANT_RANGES[DType.from_numpy(y.dtype)]
    count = planner_rules().int8_pass_parts(x.size, threads)
    _check(_functions().quantize(_ptr(x), x.size, scale, y_zero_point, lo, hi, _ptr(y), count))


def dequantize(x: np.ndarray, scale: float, x_zero_point: int, y: np.ndarray,
               threads: int = 1) -> None:
    """``y`` (float32) = DequantizeLinear of the contiguous 8-bit ``x`` with one float32
    ``scale`` and zero point, as the NumPy kernel computes it."""
    count = planner_rules().int8_pass_parts(x.size, threads)
    _check(_functions().dequantize(_ptr(x), x.size, scale, x_zero_point,
                                   int(x.dtype == np.int8), _ptr(y), count))


# ---- MaxPool on the integers -----------------------------------------------------------------
@dataclass(frozen=True)
class PoolGeometry:
    """An int8 max pool's sizes, by name: qgemm.c's (P_*) and qlayout.c's (M_*) arrays are
    built from the names in their checked enum orders (:meth:`array`), so no order is
    written twice."""

    n: int
    c: int
    h: int
    w: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int
    pt: int
    pl: int
    dh: int
    dw: int

    def array(self, order: tuple[str, ...] = _POOL_GEOMETRY) -> np.ndarray:
        """The int64 array of these sizes in ``order`` (a kernel's enum order)."""
        return slots(order, **dataclasses.asdict(self))


def max_pool(x: np.ndarray, geometry: PoolGeometry, y: np.ndarray, threads: int = 1) -> None:
    """``y`` (N, C, OH, OW) = the 2-D window max of the contiguous 8-bit ``x`` (N, C, H, W),
    the padding never chosen."""
    g = geometry
    count = planner_rules().int8_max_pool_plane_parts(g.n * g.c, g.h * g.w, threads)
    rc = _functions().maxpool(_ptr(x), int(x.dtype == np.int8), _ptr(_pool_array(geometry)),
                              _ptr(y), count)
    if rc == -2:
        raise InvalidArgumentError(f"native int8 max pool: geometry {geometry} not taken")
    _check(rc)


@functools.lru_cache(maxsize=64)
def _pool_array(geometry: PoolGeometry) -> np.ndarray:
    return geometry.array()


def _check(rc: int) -> None:
    if rc != 0:
        raise MemoryError("native int8 kernel: no scratch memory for a worker thread")
