"""Channels-last (NHWC) 8-bit activations between int8 convolutions (``qlayout.c``).

The cpu planner (:func:`keel.backends.cpu.planner.int8_layouts`) may keep the 8-bit
values between pointwise and depthwise QLinearConv nodes (and the residual
QLinearAdd joins between them) channels-last; each such node's plan names its layout,
``"<input>-><output>"`` with ``nchw`` or ``nhwc`` on each side. A channels-last value
keeps its graph shape (N, C, H, W): only its bytes are ordered N, H, W, C, and only the
nodes of its chain read it. Inside the chain

- a pointwise convolution (1x1, stride 1, no padding, one group) is one matrix product
  over every pixel: (N*H*W, C) @ (C, M) on :func:`keel.backends.cpu.native_qgemm.matmul`,
  whose (N*H*W, M) result is channels-last already;
- a depthwise convolution runs on ``keel_qdepthwise_nhwc_u8s8``, the channels in the
  vector lanes;
- any other convolution with one group (3x3, a strided 1x1, ...) is an indirect product
  on the pointwise panels, ``keel_qconv_nhwc_u8s8``: each output pixel's taps read the
  input pixels' channel rows in place (a row of x's zero point for the padding);
- a QLinearAdd is elementwise: the same bytes in any layout;
- an 8-bit MaxPool is a byte-wise max of whole channel rows (``keel_qmaxpool_nhwc_8``).

A convolution these do not take may start a chain (its NCHW result transposed once), and a node
whose output leaves the chain writes NCHW. What the channels-last kernels do not take
runs the node's NCHW kernel between two layout changes, so every result equals the
reference kernels' bit for bit.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from keel import native
from keel.backends.base import KernelContext
from keel.backends.cpu import native_qgemm, workspace
from keel.backends.cpu.native_gemm import planner_rules
from keel.backends.plan import NodePlan
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.schemas.quantization import QUANT_RANGES, ConvGeometry

__all__ = ["NCHW", "NHWC", "ChannelsLastPack", "QuantConv", "available", "channels_last", "conv",
           "conv_kind", "global_average_pool", "in_graph_layout", "layouts", "max_pool", "pack",
           "scratch",
           "to_nchw", "to_nhwc", "weight_kind", "without_layout"]

LIBRARY = "qlayout"
_T = TypeVar("_T")
NCHW, NHWC = "nchw", "nhwc"
_P, _I = ctypes.c_void_p, ctypes.c_int64
# The slots of qlayout.c's arrays, in its enum orders (checked at load: _check_layout).
_CONV_GEOMETRY = ("n", "c", "h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "dh", "dw", "pt",
                  "pl")                        # G_*: the depthwise and indirect kernels'
_POOL_GEOMETRY = ("n", "c", "h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "pt", "pl", "dh",
                  "dw")                        # M_*: the channels-last max pool's
_QUANT = ("yzp", "lo", "hi")                   # QL_*: {y zero point, lo, hi}
_GAP = ("xzp", "yzp", "lo", "hi")              # GAP_*: the global pool's params


def _layout() -> dict[str, int]:
    """The enum values this module builds qlayout.c's arrays with, by its names."""
    return native_qgemm.slot_values((("G_", _CONV_GEOMETRY, "size"),
                                     ("M_", _POOL_GEOMETRY, "size"),
                                     ("QL_", _QUANT, "len"), ("GAP_", _GAP, "len")))


@dataclass(frozen=True)
class _Functions:
    """qlayout.c's functions, declared once per loaded library."""

    isa: int
    transpose: Any
    depthwise: Any
    pointwise: Any
    global_average: Any
    dense: Any
    max_pool: Any

    @classmethod
    @functools.lru_cache(maxsize=4)
    def of(cls, lib: native.NativeLibrary) -> _Functions:
        f = lib.function
        native_qgemm.check_sizes(lib, "keel_qlayout_geometry", planner_rules().INT8_QLAYOUT_SIZES)
        native_qgemm.check_enums(lib, "keel_qlayout_layout", _layout(), "qlayout")
        return cls(int(f("keel_qlayout_isa", [], _I)()),
                   f("keel_qtranspose_u8", [_P, _I, _I, _I, _P, _I], _I),
                   f("keel_qdepthwise_nhwc_u8s8",
                     [_P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I], _I),
                   f("keel_qpointwise_nhwc_u8s8",
                     [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I], _I),
                   f("keel_qglobal_avgpool_u8",
                     [_P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P, _I], _I),
                   f("keel_qconv_nhwc_u8s8",
                     [_P, _I, _P, _P, _P, _I, _P, _P, _P, _P, _P, _I], _I),
                   f("keel_qmaxpool_nhwc_8", [_P, _I, _P, _P, _I], _I))


def _load() -> _Functions | None:
    """The loaded library's functions; None when the native tier is unavailable."""
    lib = native.library(LIBRARY)
    return _Functions.of(lib) if lib is not None else None


def available() -> bool:
    """Whether ``qlayout.c`` is built and loaded."""
    return _load() is not None


def layouts(ctx: KernelContext) -> tuple[str, str]:
    """(input layout, output layout) the node's plan gives; NCHW for both by default."""
    layout = ctx.plan.layout if ctx.plan is not None else ""
    if "->" not in layout:
        return NCHW, NCHW
    src, dst = layout.split("->", 1)
    return src, dst


def weight_kind(weight_shape: tuple[int, ...], group: int) -> str:
    """``pointwise``, ``depthwise``, ``dense`` or ``other``: the form a QLinearConv's
    weights (M, C/group, kh, kw) take, before its strides and padding are counted."""
    m = int(weight_shape[0])
    if group == 1 and all(int(k) == 1 for k in weight_shape[2:]):
        return "pointwise"
    if group == m and len(weight_shape) == 4 and int(weight_shape[1]) == 1:
        return "depthwise"
    if group == 1 and len(weight_shape) == 4 and int(weight_shape[1]) % 4 == 0:
        return "dense"
    return "other"


def conv_kind(weight_shape: Sequence[int], attrs: Mapping[str, Any]) -> str:
    """``pointwise`` (1x1, stride 1, no padding, one group), ``depthwise``, ``dense`` (one
    group, C a multiple of 4: the indirect product) or ``other``: the kind of a 2-D
    QLinearConv of these weights and (normalized) attributes, as the planner's
    int8_channels_last_kernel takes it. A 1x1 kernel at stride 1 has no padding under
    any auto_pad, so only explicit pads count."""
    shape = tuple(int(d) for d in weight_shape)
    kind = weight_kind(shape, int(attrs.get("group") or 1))
    strided = any(int(v) != 1 for v in attrs.get("strides") or ())
    if kind == "pointwise" and (strided or any(int(v) for v in attrs.get("pads") or ())):
        return "dense" if shape[1] % 4 == 0 else "other"
    return kind


def bias_known(absent: bool, bias: Any) -> bool:
    """Whether a QLinearConv's bias is known when planned or packed: a missing one is (no
    bias), a present one where it is a constant (``bias`` not None)."""
    return absent or bias is not None


def conv_constants(w: np.ndarray, w_zero_point: np.ndarray, x_zero_point: Any,
                   bias: np.ndarray | None, bias_known: bool = True) -> Any:
    """What a QLinearConv's operands say for the planner's int8_channels_last_kernel
    (an ``Int8ConvConstants``): whether the weights are symmetric and, where x's zero
    point and the bias are known (``x_zero_point`` not None, ``bias_known``), whether the
    panels' folded bias fits."""
    rules = planner_rules()
    m = int(w.shape[0])
    zp = np.broadcast_to(np.asarray(w_zero_point).reshape(-1), (m,))
    symmetric = _symmetric(zp, np.asarray(w).dtype)
    if not symmetric or x_zero_point is None or not bias_known:
        return rules.Int8ConvConstants(symmetric)
    sums = _signed_weights(np.asarray(w).reshape(m, -1)).sum(axis=1, dtype=np.int64)
    xz = np.asarray(x_zero_point)
    folded = _folded(sums, int(xz.reshape(-1)[0]), xz.dtype == np.int8, bias)
    return rules.Int8ConvConstants(True, folded is not None)


def channels_last_kernel(plan: NodePlan | None, w: np.ndarray, w_zero_point: np.ndarray,
                         attrs: Mapping[str, Any], x_zero_point: Any = None,
                         bias: np.ndarray | None = None, bias_known: bool = False,
                         x_shape: Sequence[int] | None = None) -> str:
    """The channels-last kernel a QLinearConv runs: its plan's ``int8_kernel`` (decided
    from the graph's constant weights), else the planner's rule on these operands (the
    weights were not constants when it planned)."""
    decided = plan.option("int8_kernel") if plan is not None else None
    if decided is not None:
        return str(decided)
    found = planner_rules().int8_channels_last_kernel(
        conv_kind(w.shape, attrs), w.shape, x_shape,
        conv_constants(w, w_zero_point, x_zero_point, bias, bias_known))
    return "nchw" if found is None else str(found)


def without_layout(plan: NodePlan | None) -> NodePlan | None:
    """``plan`` with no layout: the node's NCHW kernel, as a layout path's fallback runs it."""
    return None if plan is None else dataclasses.replace(plan, layout="")


def in_graph_layout(values: dict[str, Any], nodes: Sequence[Any],
                    placements: Sequence[Any]) -> dict[str, Any]:
    """``values`` (a run's values by name) with every channels-last one (the output of a
    node whose plan's layout ends in ``nhwc``) and every channel-blocked one (a float
    NCHWc region's, ``nchwc16``) put back in its graph's NCHW order;
    ``placements`` are the plan's, node for node."""
    from keel.backends.cpu import native_blocked

    out = dict(values)
    for node, placed in zip(nodes, placements, strict=True):
        name = node.outputs[0] if node.outputs else ""
        if placed.layout.endswith("->" + native_blocked.NCHWC) and name in out:
            out[name] = native_blocked.to_nchw(np.asarray(out[name]))
        elif placed.layout.endswith("->" + NHWC) and name in out:
            v = np.asarray(out[name])
            n, c, h, w = v.shape
            out[name] = np.ascontiguousarray(v.reshape(n, h, w, c).transpose(0, 3, 1, 2))
    return out


# ---- layout changes ------------------------------------------------------------------------
def _transpose(x: np.ndarray, n: int, rows: int, cols: int, y: np.ndarray, threads: int) -> None:
    """y[n][cols][rows] = x[n][rows][cols] for contiguous 8-bit x and y."""
    fns = _load()
    if fns is None:
        y.reshape(n, cols, rows)[...] = x.reshape(n, rows, cols).transpose(0, 2, 1)
        return
    count = planner_rules().int8_transpose_parts(n, rows, cols, threads)
    _check(fns.transpose(_ptr(x), n, rows, cols, _ptr(y), count))


def to_nhwc(x: np.ndarray, threads: int = 1, y: np.ndarray | None = None) -> np.ndarray:
    """The NCHW ``x`` (N, C, H, W) as channels-last bytes, shaped (N, H, W, C)."""
    n, c, h, w = (int(d) for d in x.shape)
    y = np.empty((n, h, w, c), x.dtype) if y is None else y
    _transpose(np.ascontiguousarray(x), n, c, h * w, y, threads)
    return y


def to_nchw(x_cl: np.ndarray, threads: int = 1, y: np.ndarray | None = None) -> np.ndarray:
    """The channels-last ``x_cl`` (N, H, W, C) as NCHW (N, C, H, W)."""
    n, h, w, c = (int(d) for d in x_cl.shape)
    y = np.empty((n, c, h, w), x_cl.dtype) if y is None else y
    _transpose(np.ascontiguousarray(x_cl), n, h * w, c, y, threads)
    return y


def channels_last(a: np.ndarray) -> np.ndarray:
    """The bytes of a channels-last value kept in its graph shape (N, C, H, W), as
    (N, H, W, C)."""
    n, c, h, w = a.shape
    return np.ascontiguousarray(a).reshape(n, h, w, c)


# ---- packing -------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ChannelsLastPack:
    """A QLinearConv's weights for its channels-last ``kernel``: the panels
    [M/32][K/4][32][4] and column sums (``panels``, ``indirect``), the matrix product's
    panels (``matmul``) or a depthwise convolution's taps [kh * kw][C] less their zero
    points (``depthwise``); with ``nchw`` only the NCHW kernel's ``conv``."""

    conv: native_qgemm.PackedConv
    kernel: str                      # the planner's int8_channels_last_kernel
    pointwise: native_qgemm.PackedMatmul | None = None
    panels: np.ndarray | None = None
    col_sums: np.ndarray | None = None
    taps: np.ndarray | None = None
    last: list[tuple[Any, Any]] = dataclasses.field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        extra = self.pointwise.nbytes if self.pointwise is not None else 0
        return int(self.conv.nbytes + extra + sum(
            a.nbytes for a in (self.panels, self.col_sums, self.taps) if a is not None))

    def known(self, key: Any) -> Any:
        """What :meth:`operands` made for ``key`` while it is the last key; else None."""
        last = self.last[0] if self.last else None
        return last[1] if last is not None and last[0] == key else None

    def operands(self, key: Any, make: Callable[[], _T]) -> _T:
        """What ``make`` derives for ``key`` (a call's input shape and its other operands'
        values), made once: a node calls with the same key run after run, so the last
        key's are kept and reused while it recurs."""
        last = self.last[0] if self.last else None
        if last is not None and last[0] == key:
            return cast(_T, last[1])
        made = make()
        self.last[:] = [(key, made)]
        return made


def _symmetric(zero_points: np.ndarray, dtype: np.dtype) -> bool:
    """Whether the weights' zero points are all 0 as signed bytes (the panels' form)."""
    return not np.any(zero_points.astype(np.int16) - (128 if dtype == np.uint8 else 0))


def _signed_weights(w2: np.ndarray) -> np.ndarray:
    """Symmetric weights as signed values (uint8 ones less 128), int16."""
    return w2.astype(np.int16) - (128 if w2.dtype == np.uint8 else 0)


def _folded(sums: np.ndarray, x_zero_point: int, signed: bool,
            bias: np.ndarray | None) -> np.ndarray | None:
    """The panels' bias: x's zero point (+ 128 for signed x) folded in over every column
    sum, plus the bias; None where it passes the planner's INT8_FOLD_MAX (the int32 sums
    could overflow)."""
    folded = -(x_zero_point + (128 if signed else 0)) * sums
    if bias is not None:
        folded = folded + np.asarray(bias).astype(np.int64)
    if np.abs(folded).max(initial=0) >= planner_rules().INT8_FOLD_MAX:
        return None
    return folded


def _panels(conv: native_qgemm.PackedConv, w2: np.ndarray, kernel: str) -> ChannelsLastPack:
    """The (M, K) weights w2 as the panels [M/32][K/4][32][4] (signed) and column sums."""
    m, c = w2.shape
    signed = _signed_weights(w2)
    columns = planner_rules().INT8_PANEL_COLUMNS
    mp, cp = -(-m // columns) * columns, -(-c // 4) * 4
    padded = np.zeros((mp, cp), np.int8)
    padded[:m, :c] = signed
    panels = padded.reshape(mp // columns, columns, cp // 4, 4).transpose(0, 2, 1, 3)
    return ChannelsLastPack(conv, kernel, panels=np.ascontiguousarray(panels),
                            col_sums=signed.sum(axis=1, dtype=np.int64))


def pack(w: np.ndarray, w_zero_point: np.ndarray, kernel: str) -> ChannelsLastPack:
    """Pack a QLinearConv's 8-bit weights (M, C/g, kh, kw) once for ``kernel`` (the
    planner's int8_channels_last_kernel: see :func:`channels_last_kernel`)."""
    conv = native_qgemm.pack_conv(w, w_zero_point)
    m = int(w.shape[0])
    zp = np.broadcast_to(np.asarray(w_zero_point).reshape(-1), (m,))
    if kernel == "matmul":
        w2 = np.asarray(w).reshape(m, -1)
        return ChannelsLastPack(conv, kernel, pointwise=native_qgemm.pack_matmul(
            np.ascontiguousarray(w2.T), zp))
    if kernel == "panels":
        return _panels(conv, np.asarray(w).reshape(m, -1), kernel)
    if kernel == "indirect":
        # k = tap * C + channel: a tap's C channels contiguous, as an input pixel's row
        w2 = np.asarray(w).reshape(m, int(w.shape[1]), -1).transpose(0, 2, 1).reshape(m, -1)
        return _panels(conv, w2, kernel)
    if kernel == "depthwise":
        taps = np.asarray(w).reshape(m, -1).astype(np.int32) - zp.astype(np.int32)[:, None]
        return ChannelsLastPack(conv, kernel, taps=np.ascontiguousarray(taps.T))
    return ChannelsLastPack(conv, "nchw")


# ---- the kernels ---------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantConv:
    """One QLinearConv call's operands, as the channels-last kernels take them."""

    x_zero_point: int
    packed: ChannelsLastPack
    geo: ConvGeometry
    bias: np.ndarray | None
    multiplier: np.ndarray          # per output channel, float64
    y_zero_point: int
    threads: int
    # the native call for each (kernel, x shape, x dtype, y dtype), derived once
    calls: dict[Any, _NativeCall | None] = dataclasses.field(
        default_factory=dict, compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class _NativeCall:
    """A native kernel's call with every argument but x's and y's addresses derived
    once: ``fn(x, *head, y, *tail)``, the arrays those addresses point into kept alive
    with it."""

    fn: Any
    head: tuple[int | None, ...]
    tail: tuple[int, ...]
    keep: tuple[Any, ...]

    def __call__(self, x: np.ndarray, y: np.ndarray) -> int:
        return int(self.fn(_ptr(x), *self.head, _ptr(y), *self.tail))


def _call(q: QuantConv, kind: str, x_cl: np.ndarray, y_cl: np.ndarray,
          make: Callable[[QuantConv, np.ndarray, np.ndarray], _NativeCall | None]) -> bool:
    """Run ``q``'s native call of ``kind`` on ``x_cl`` into ``y_cl``, made by ``make`` the
    first time these shapes and types come; False where that kernel cannot run (no
    call, or the kernel's -2: a geometry it does not take)."""
    key = (kind, x_cl.shape, x_cl.dtype, y_cl.dtype)
    if key not in q.calls:
        q.calls[key] = make(q, x_cl, y_cl)
    call = q.calls[key]
    if call is None:
        return False
    rc = call(x_cl, y_cl)
    if rc == -2:
        return False
    _check(rc)
    return True


def _matmul(q: QuantConv, x_cl: np.ndarray, y_cl: np.ndarray) -> bool:
    """qgemm.c's product over every pixel: (N*H*W, C) @ (C, M), channels-last already."""
    pm = q.packed.pointwise
    if pm is None:
        return False
    native_qgemm.matmul(x_cl.reshape(-1, x_cl.shape[-1]), q.x_zero_point, pm, q.bias,
                        q.multiplier, DType.from_numpy(y_cl.dtype), q.y_zero_point,
                        y_cl.reshape(-1, y_cl.shape[-1]), q.threads)
    return True


def _panel_product(q: QuantConv, x_cl: np.ndarray, y_cl: np.ndarray) -> bool:
    """``keel_qpointwise_nhwc_u8s8`` over every pixel; False where it cannot run."""
    return _call(q, "panels", x_cl, y_cl, _panel_call)


def _panel_call(q: QuantConv, x_cl: np.ndarray, y_cl: np.ndarray) -> _NativeCall | None:
    fns, panels, sums = _load(), q.packed.panels, q.packed.col_sums
    if fns is None or panels is None or sums is None:
        return None
    c, m = int(x_cl.shape[-1]), int(y_cl.shape[-1])
    pixels = int(x_cl.size // max(1, c))
    signed = x_cl.dtype == np.int8
    folded = _panel_operands(q, signed, y_cl.dtype)
    if folded is None:
        return None
    bias, mult, quant = folded
    count = planner_rules().int8_panel_split(pixels, c, m, q.threads).parts
    return _NativeCall(fns.pointwise, (int(signed), pixels, c, m, _ptr(panels), _ptr(bias),
                                       _ptr(mult), _ptr(quant)), (count,),
                       (panels, bias, mult, quant))


def _panel_operands(q: QuantConv, signed: bool, y_dtype: np.dtype
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The panels' bias (x's zero point, + 128 for signed x, folded in over every column
    sum) and multipliers, padded to whole blocks, and {y zero point, lo, hi}; None where
    the folded bias could overflow the int32 sums."""
    panels, sums = q.packed.panels, q.packed.col_sums
    assert panels is not None and sums is not None
    m = int(sums.shape[0])
    folded = _folded(sums, q.x_zero_point, signed, q.bias)
    if folded is None:
        return None
    mp = panels.shape[0] * planner_rules().INT8_PANEL_COLUMNS
    bias, mult = np.zeros(mp, np.int32), np.zeros(mp, np.float64)
    bias[:m], mult[:m] = folded, q.multiplier
    lo, hi = QUANT_RANGES[DType.from_numpy(y_dtype)]
    return bias, mult, native_qgemm.slots(_QUANT, yzp=q.y_zero_point, lo=lo, hi=hi)


def _dense(q: QuantConv, x_cl: np.ndarray, y_cl: np.ndarray) -> bool:
    return _call(q, "dense", x_cl, y_cl, _dense_call)


def _dense_call(q: QuantConv, x_cl: np.ndarray, y_cl: np.ndarray) -> _NativeCall | None:
    """``keel_qconv_nhwc_u8s8``: the indirect product over the output pixels' taps, its
    table of tap offsets and its row of x's zero point built here once, with the call."""
    fns, panels = _load(), q.packed.panels
    n, h, w, c = (int(d) for d in x_cl.shape)
    if (fns is None or panels is None or c % 4
            or h * w * c > planner_rules().INT8_INDIRECT_MAX_IMAGE_BYTES):
        return None
    signed = x_cl.dtype == np.int8
    operands = _panel_operands(q, signed, y_cl.dtype)
    if operands is None:
        return None
    bias, mult, quant = operands
    geo, m = q.geo, int(y_cl.shape[-1])
    (oh, ow), (kh, kw) = geo.out_spatial, geo.kernel
    geometry = _conv_geometry(geo, n, c, h, w)
    offsets = tap_offsets(geo, h, w, c)
    zero_row = np.full(c, q.x_zero_point & 0xFF, dtype=np.uint8)
    count = planner_rules().int8_panel_split(n * oh * ow, kh * kw * c, m, q.threads).parts
    return _NativeCall(fns.dense, (int(signed), _ptr(geometry), _ptr(offsets), _ptr(zero_row), m,
                                   _ptr(panels), _ptr(bias), _ptr(mult), _ptr(quant)),
                       (count,), (panels, bias, mult, quant, geometry, offsets, zero_row))


def _conv_geometry(geo: ConvGeometry, n: int, c: int, h: int, w: int) -> np.ndarray:
    """qlayout.c's geometry (G_*) of ``geo`` over NHWC x of (n, h, w, c)."""
    (oh, ow), (kh, kw) = geo.out_spatial, geo.kernel
    return native_qgemm.slots(_CONV_GEOMETRY, n=n, c=c, h=h, w=w, oh=oh, ow=ow, kh=kh, kw=kw,
                              sh=geo.strides[0], sw=geo.strides[1], dh=geo.dilations[0],
                              dw=geo.dilations[1], pt=geo.pads_begin[0],
                              pl=geo.pads_begin[1])


def tap_offsets(geo: ConvGeometry, h: int, w: int, c: int) -> np.ndarray:
    """The indirect product's table: for each output pixel (oy, ox) of an image and tap
    (ky, kx), the byte offset of its input pixel's channel row within the NHWC image
    (h x w x c bytes), or -1 where the tap falls in the padding; (OH * OW, KH * KW)
    int32."""
    (oh, ow), (kh, kw) = geo.out_spatial, geo.kernel
    (sh, sw), (dh, dw) = geo.strides, geo.dilations
    iy = (np.arange(oh)[:, None, None, None] * sh + np.arange(kh)[None, None, :, None] * dh
          - geo.pads_begin[0])
    ix = (np.arange(ow)[None, :, None, None] * sw + np.arange(kw)[None, None, None, :] * dw
          - geo.pads_begin[1])
    inside = (iy >= 0) & (iy < h) & (ix >= 0) & (ix < w)
    offsets = np.where(inside, (iy * w + ix) * c, -1)
    return np.ascontiguousarray(offsets.reshape(oh * ow, kh * kw), dtype=np.int32)


def lanes_available() -> bool:
    """Whether the loaded ``qlayout.c`` has its AVX-512 paths (the depthwise kernel's
    plane split among them)."""
    fns = _load()
    return fns is not None and fns.isa > 0


def plane_bytes(geo: ConvGeometry, w: int) -> int:
    """Bytes of one 32-channel block's input plane widened to int16, padding included
    (what the depthwise kernel keeps whole in cache when it splits the work by planes)."""
    (oh, ow), (kh, kw) = geo.out_spatial, geo.kernel
    (sh, sw), (dh, dw) = geo.strides, geo.dilations
    hp = (oh - 1) * sh + (kh - 1) * dh + 1
    wp = max((ow - 1) * sw + (kw - 1) * dw + 1, w + geo.pads_begin[1])
    return hp * wp * planner_rules().INT8_DEPTHWISE_LANES * 2


def _depthwise(q: QuantConv, x_cl: np.ndarray, y_cl: np.ndarray) -> bool:
    return _call(q, "depthwise", x_cl, y_cl, _depthwise_call)


def _depthwise_call(q: QuantConv, x_cl: np.ndarray, y_cl: np.ndarray) -> _NativeCall | None:
    fns, taps = _load(), q.packed.taps
    if fns is None or taps is None:
        return None
    geo = q.geo
    n, h, w, c = (int(d) for d in x_cl.shape)
    (oh, ow), (kh, kw) = geo.out_spatial, geo.kernel
    geometry = _conv_geometry(geo, n, c, h, w)
    lo, hi = QUANT_RANGES[DType.from_numpy(y_cl.dtype)]
    quant = native_qgemm.slots(_QUANT, yzp=q.y_zero_point, lo=lo, hi=hi)
    bias = None if q.bias is None else np.ascontiguousarray(q.bias, dtype=np.int32)
    split = planner_rules().int8_depthwise_split(n, c, oh, ow, kh * kw, plane_bytes(geo, w),
                                                 q.threads, fns.isa > 0)
    mult = q.multiplier
    return _NativeCall(fns.depthwise, (int(x_cl.dtype == np.int8), q.x_zero_point, _ptr(taps),
                                       _ptr(bias), _ptr(geometry), _ptr(mult), _ptr(quant)),
                       (int(split.planes), split.parts), (taps, bias, geometry, mult, quant))


_CHANNELS_LAST: dict[str, Callable[[QuantConv, np.ndarray, np.ndarray], bool]] = {
    "panels": _panel_product, "matmul": _matmul, "depthwise": _depthwise, "indirect": _dense}


def scratch(key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A reusable buffer (this thread's, kept between calls: no page faults per run)."""
    return workspace.empty(np, ("qlayout", key), shape, dtype)


def conv(src: str, dst: str, x: np.ndarray, q: QuantConv | None,
         y: np.ndarray, nchw: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """Run one QLinearConv between layouts: ``x`` and ``y`` in their graph shapes, their
    bytes in ``src`` and ``dst`` order. ``q``'s channels-last kernel (its pack's) runs
    (None: the native kernels do not take the operands); otherwise, or where it cannot
    run (an operand known only now rules it out), ``nchw`` (the NCHW kernel: NCHW x into
    an NCHW buffer, returning its result) between layout changes. Returns ``y``."""
    threads = 1 if q is None else q.threads
    n, m, oh, ow = (int(d) for d in y.shape)
    run = _CHANNELS_LAST.get(q.packed.kernel) if q is not None else None
    if run is not None and q is not None:
        x_cl = channels_last(x) if src == NHWC else to_nhwc(
            x, threads, scratch("x", (x.shape[0], *x.shape[2:], x.shape[1]), x.dtype))
        y_cl = y.reshape(n, oh, ow, m) if dst == NHWC else scratch("y", (n, oh, ow, m),
                                                                   y.dtype)
        if run(q, x_cl, y_cl):
            if dst == NCHW:
                to_nchw(y_cl, threads, y)
            return y
    x_n = x if src == NCHW else to_nchw(channels_last(x), threads,
                                        scratch("x", x.shape, x.dtype))
    if dst == NHWC:
        y_n = nchw(x_n, scratch("y", y.shape, y.dtype))
        to_nhwc(y_n, threads, y.reshape(n, oh, ow, m))
    else:
        y_n = nchw(x_n, y)
        if y_n is not y:
            y[...] = y_n
    return y


# ---- MaxPool ---------------------------------------------------------------------------------
def max_pool(src: str, dst: str, x: np.ndarray, geometry: native_qgemm.PoolGeometry | None,
             y: np.ndarray, threads: int, nchw: Callable[[np.ndarray, np.ndarray], None]
             ) -> None:
    """``y`` = the 2-D window max of the 8-bit ``x``, both in their graph shapes, their
    bytes in ``src`` and ``dst`` order; ``geometry`` as
    :func:`keel.backends.cpu.native_qgemm.max_pool`'s (None: a pool the native kernels do
    not take); ``nchw`` the NCHW kernel (x into y), which runs between layout changes
    where x is NCHW or the native kernel cannot run."""
    fns = _load()
    n, c, oh, ow = (int(d) for d in y.shape)
    if src == NCHW or fns is None or geometry is None:
        x_n = x if src == NCHW else to_nchw(channels_last(x), threads,
                                            scratch("x", x.shape, x.dtype))
        if dst == NCHW:
            nchw(x_n, y)
            return
        y_n = scratch("y", y.shape, y.dtype)
        nchw(x_n, y_n)
        to_nhwc(y_n, threads, y.reshape(n, oh, ow, c))
        return
    y_cl = y.reshape(n, oh, ow, c) if dst == NHWC else scratch("y", (n, oh, ow, c), y.dtype)
    count = planner_rules().int8_max_pool_parts(n * oh, ow, c, threads)
    rc = fns.max_pool(_ptr(x), int(x.dtype == np.int8), _ptr(_pool_geometry(geometry)),
                      _ptr(y_cl), count)
    if rc == -2:
        raise InvalidArgumentError(f"channels-last int8 max pool: geometry {geometry} not taken")
    _check(rc)
    if dst == NCHW:
        to_nchw(y_cl, threads, y)


@functools.lru_cache(maxsize=64)
def _pool_geometry(geometry: native_qgemm.PoolGeometry) -> np.ndarray:
    return geometry.array(_POOL_GEOMETRY)


# ---- QLinearGlobalAveragePool ------------------------------------------------------------
def global_average_pool(x: np.ndarray, nhwc: bool, scale: float, x_zero_point: int,
                        y_zero_point: int, y: np.ndarray, threads: int = 1) -> None:
    """``y`` (N, C, 1, 1) = onnxruntime's QLinearGlobalAveragePool of the contiguous 8-bit
    ``x`` in its graph shape (N, C, H, W), its bytes NCHW or (``nhwc``) channels-last;
    ``scale`` the float32 multiplier (``qlinear_global_scale``). Needs the native kernel
    (:func:`available`)."""
    fns = _load()
    if fns is None:
        raise RuntimeError(f"native layout kernels unavailable: {native.status().reason}")
    n, c = int(x.shape[0]), int(x.shape[1])
    hw = int(x.size // max(1, n * c))
    lo, hi = QUANT_RANGES[DType.from_numpy(y.dtype)]
    params = _gap_params(x_zero_point, y_zero_point, lo, hi)
    count = planner_rules().int8_global_pool_parts(n, c, hw, threads)
    _check(fns.global_average(_ptr(x), int(x.dtype == np.int8), int(nhwc), n, c, hw,
                              scale, _ptr(params), _ptr(y), count))


@functools.lru_cache(maxsize=64)
def _gap_params(x_zero_point: int, y_zero_point: int, lo: int, hi: int) -> np.ndarray:
    return native_qgemm.slots(_GAP, xzp=x_zero_point, yzp=y_zero_point, lo=lo, hi=hi)


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else int(a.ctypes.data)


def _check(rc: int) -> None:
    if rc != 0:
        raise MemoryError("native layout kernel: no scratch memory")
