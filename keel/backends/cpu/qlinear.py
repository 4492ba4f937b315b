"""The ``int8`` variants of the quantized products: integer kernels on int8 weights.

QLinearConv, QLinearMatMul and QGemm run on :mod:`keel.backends.cpu.native_qgemm`
(``qgemm.c``): the constant weights are packed once per model as int8 (they stay
8-bit in memory), the products accumulate in int32 (AVX-512 VNNI, AVX-VNNI or
portable C: the planner names which, ``keel explain`` shows it) and the
requantization is fused into the store. The results equal the reference
kernels' bit for bit. What the native kernels do not take (a 1-D or 3-D
convolution, per-row activation scales, operands that are not 8-bit) runs on
the ``default`` kernels of :mod:`keel.backends.cpu.quantization`, which are
the NumPy form of the same arithmetic (and what runs with ``KEEL_NATIVE=off``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.cpu import native_qgemm, qlayout, quantization
from keel.backends.cpu.kernels import TABLE
from keel.backends.cpu.native_gemm import planner_rules
from keel.backends.reference.quantization import qlinear_add_constants, requantized
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schemas.quantization import (
    QUANT_RANGES,
    conv_geometry,
    matmul_shape,
    qgemm_scales,
    qgemm_shape,
    qlinear_global_scale,
)

__all__: list[str] = []

_UINT8 = np.dtype(np.uint8)
_FLOAT32 = np.dtype(np.float32)
_EIGHT_BITS = frozenset({_UINT8, np.dtype(np.int8)})
_META: dict[str, Any] = {"requires": "native", "priority": 10, "host_only": True, "simd": ()}


def _eight_bit(*arrays: Any) -> bool:
    return all(a is not None and a.dtype in _EIGHT_BITS for a in arrays)


def _scalar(p: Any) -> bool:
    return p is not None and math.prod(p.shape) == 1


def _multiplier(*scales: Any) -> np.ndarray:
    """a_scale * b_scale / y_scale in the scales' own type (as the reference forms it),
    rounded to float32 (the kernels' product type) and passed as float64."""
    a, b, y = scales
    return np.asarray(a * b / y).astype(np.float32).astype(np.float64).reshape(-1)


def _out(out: Out, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if out is not None and out[0].dtype == dtype and out[0].flags.c_contiguous:
        return out[0]
    return np.empty(shape, dtype=dtype)


def _deliver(y: np.ndarray, out: Out) -> list[Any]:
    if out is not None and out[0] is not y:
        out[0][...] = y
        return [out[0]]
    return [y]


def _threads(ctx: KernelContext) -> int:
    if ctx.plan is not None and ctx.plan.threads:
        return int(ctx.plan.threads)
    return int(ctx.threads or 1)


# ---- QLinearConv -----------------------------------------------------------------------------
def _pack_conv(ctx: KernelContext, const: Sequence[Any], attrs: Attrs) -> Any:
    w, w_zp = const[3], const[5]
    if not native_qgemm.available() or not _eight_bit(w, w_zp) or w.ndim != 4:
        return None
    if qlayout.layouts(ctx) != (qlayout.NCHW, qlayout.NCHW):
        # a bias input left out (or named "") has no slot or a None one, like a bias that
        # is no constant: only a missing slot is known to be absent here
        bias = const[8] if len(const) > 8 else None
        kernel = qlayout.channels_last_kernel(
            ctx.plan, w, w_zp, attrs, const[2], bias,
            bias_known=qlayout.bias_known(len(const) <= 8, bias))
        return qlayout.pack(w, w_zp, kernel)
    return native_qgemm.pack_conv(w, w_zp)


def _conv_served(x: Any, x_zp: Any, x_s: Any, y_s: Any, y_zp: Any, w: Any, w_zp: Any) -> bool:
    return (native_qgemm.available() and x.ndim == 4 and w.ndim == 4
            and _eight_bit(x, w, x_zp, w_zp, y_zp) and x_zp.dtype == x.dtype
            and w_zp.dtype == w.dtype and _scalar(x_zp) and _scalar(x_s) and _scalar(y_s)
            and _scalar(y_zp) and w_zp.size in (1, w.shape[0]))


@TABLE.kernel(Op.QLINEAR_CONV, variant="int8", dtypes=("uint8", "int8"), supports_out=True,
              prepack=_pack_conv, shapes="2-D convolutions of 8-bit data", **_META)
def qlinear_conv(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The int32-accumulating native convolution, requantized in its store; between
    the layouts the node's plan names (:mod:`keel.backends.cpu.qlayout`)."""
    src, dst = qlayout.layouts(ctx)
    if (src, dst) == (qlayout.NCHW, qlayout.NCHW):
        return _conv_nchw(ctx, inputs, attrs, out)
    x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp = inputs[:8]
    bias = optional_input(inputs, 8)
    threads = _threads(ctx)
    # a node's operands but x are the same values run after run: checked and derived once
    key = (x.shape, x.dtype, y_zp.dtype, threads,
           *_values_key(x_s, x_zp, w_s, w_zp, y_s, y_zp, bias))
    packed = ctx.prepacked
    q = packed.known(key) if isinstance(packed, qlayout.ChannelsLastPack) else None
    if q is None and _served(x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp, bias):
        if not isinstance(packed, qlayout.ChannelsLastPack):
            # weights that are no constants: packed for the kernel the plan's rule gives
            # these operands, every one of them known now
            packed = qlayout.pack(w, w_zp, qlayout.channels_last_kernel(
                ctx.plan, w, w_zp, attrs, x_zp, bias, bias_known=True, x_shape=x.shape))
        made = packed
        q = made.operands(key, lambda: _quant_conv(made, x, x_s, x_zp, w, w_s, y_s, y_zp,
                                                   bias, attrs, threads))
    if q is not None:
        geo = q.geo
    else:
        geo = conv_geometry(x.shape, w.shape, attrs)
    y = _out(out, (x.shape[0], int(w.shape[0]), *geo.out_spatial), y_zp.dtype)

    def nchw(xn: np.ndarray, yn: np.ndarray) -> np.ndarray:
        plain = dataclasses.replace(ctx, plan=qlayout.without_layout(ctx.plan))
        return np.asarray(_conv_nchw(plain, [xn, *inputs[1:]], attrs, [yn])[0])

    qlayout.conv(src, dst, x, q, y, nchw)
    return _deliver(y, out)


def _quant_conv(packed: qlayout.ChannelsLastPack, x: Any, x_s: Any, x_zp: Any, w: Any,
                w_s: Any, y_s: Any, y_zp: Any, bias: Any, attrs: Attrs,
                threads: int) -> qlayout.QuantConv:
    m = int(w.shape[0])
    return qlayout.QuantConv(
        int(x_zp.reshape(())), packed, conv_geometry(x.shape, w.shape, attrs), bias,
        np.ascontiguousarray(np.broadcast_to(_multiplier(
            x_s.reshape(()), w_s.reshape(-1), y_s.reshape(())), (m,)), dtype=np.float64),
        int(y_zp.reshape(())), threads)


def _served(x: Any, x_s: Any, x_zp: Any, w: Any, w_s: Any, w_zp: Any, y_s: Any, y_zp: Any,
            bias: Any) -> bool:
    """Whether the native kernels take these operands (else the NumPy kernel runs)."""
    return (_conv_served(x, x_zp, x_s, y_s, y_zp, w, w_zp) and w_s.size in (1, w.shape[0])
            and (bias is None or (bias.dtype == np.int32 and bias.shape == (w.shape[0],))))


def _conv_nchw(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp = inputs[:8]
    bias = optional_input(inputs, 8)
    packed = ctx.prepacked
    if isinstance(packed, qlayout.ChannelsLastPack):
        packed = packed.conv
    threads = _threads(ctx)
    key = None
    if isinstance(packed, native_qgemm.PackedConv) and isinstance(x, np.ndarray):
        # a node's operands but x are the same values run after run: its checks, geometry
        # and native call made once, reused while x's shape and type and their values recur
        key = ("nchw", x.shape, x.dtype.char, id(attrs), threads,
               *_values_key(x_s, x_zp, w_s, w_zp, y_s, y_zp, bias))
        found = packed.prepared.get(key)
        if found is not None and found[0] is attrs:
            y = _out(out, found[1], y_zp.dtype)
            found[2](x, y)
            return _deliver(y, out)
    if not _served(x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp, bias):
        return list(quantization.qlinear_conv(ctx, inputs, attrs, out))
    if not isinstance(packed, native_qgemm.PackedConv):
        packed = native_qgemm.pack_conv(w, w_zp)
    geo = packed.geometry(x.shape, attrs)
    m = int(w.shape[0])
    shape = (x.shape[0], m, *geo.out_spatial)
    y = _out(out, shape, y_zp.dtype)
    call = native_qgemm.conv2d_call(
        x, int(x_zp.reshape(())), packed, geo, bias,
        _multiplier(x_s.reshape(()), w_s.reshape(-1), y_s.reshape(())), int(y_zp.reshape(())),
        y.dtype, threads)
    if key is not None:
        packed.remember(key, (attrs, shape, call))
    call(x, y)
    return _deliver(y, out)


# ---- QLinearMatMul ---------------------------------------------------------------------------
def _pack_matmul(ctx: KernelContext, const: Sequence[Any], attrs: Attrs) -> Any:
    b, b_zp = const[3], const[5]
    if not native_qgemm.available() or not _eight_bit(b, b_zp) or b.ndim != 2 or \
            b_zp.size not in (1, b.shape[1]):
        return None
    return native_qgemm.pack_matmul(b, b_zp)


@TABLE.kernel(Op.QLINEAR_MATMUL, variant="int8", dtypes=("uint8", "int8"), supports_out=True,
              prepack=_pack_matmul, shapes="(..., K) @ 2-D (K, N), 8-bit", **_META)
def qlinear_matmul(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The int32-accumulating native product with a 2-D B, requantized in its store."""
    a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp = inputs
    served = (native_qgemm.available() and b.ndim == 2 and a.ndim >= 2
              and _eight_bit(a, b, a_zp, b_zp, y_zp) and a_zp.dtype == a.dtype
              and b_zp.dtype == b.dtype and _scalar(a_zp) and _scalar(a_s) and _scalar(y_s)
              and _scalar(y_zp) and b_zp.size in (1, b.shape[1]) and b_s.size in (1, b.shape[1]))
    if not served:
        return list(quantization.qlinear_matmul(ctx, inputs, attrs, out))
    shape = matmul_shape(Op.QLINEAR_MATMUL, a.shape, b.shape)
    packed = ctx.prepacked
    if not isinstance(packed, native_qgemm.PackedMatmul):
        packed = native_qgemm.pack_matmul(b, b_zp)
    y = _out(out, tuple(int(d) for d in shape), y_zp.dtype)  # type: ignore[arg-type]
    a2 = np.ascontiguousarray(a).reshape(-1, a.shape[-1])
    native_qgemm.matmul(a2, int(a_zp.reshape(())), packed, None,
                        _multiplier(a_s.reshape(()), b_s.reshape(-1), y_s.reshape(())),
                        DType.from_numpy(y_zp.dtype), int(y_zp.reshape(())),
                        y.reshape(-1, b.shape[1]), _threads(ctx))
    return _deliver(y, out)


# ---- QGemm -----------------------------------------------------------------------------------
def _qgemm_params(inputs: Inputs) -> tuple[Any, ...]:
    a, a_s, a_zp, b, b_s, b_zp = inputs[:6]
    a_zp = np.zeros((), a.dtype) if a_zp is None else a_zp
    b_zp = np.zeros((), b.dtype) if b_zp is None else b_zp
    return a, a_s, a_zp, b, b_s, b_zp, optional_input(inputs, 6), optional_input(
        inputs, 7), optional_input(inputs, 8)


def _pack_qgemm(ctx: KernelContext, const: Sequence[Any], attrs: Attrs) -> Any:
    b = const[3]
    if not native_qgemm.available() or b is None or not _eight_bit(b) or b.ndim != 2:
        return None
    b_zp = np.zeros((), b.dtype) if len(const) < 6 or const[5] is None else const[5]
    n = b.shape[0] if attrs["trans_b"] else b.shape[1]
    if not _eight_bit(b_zp) or b_zp.size not in (1, n):
        return None
    return native_qgemm.pack_matmul(b.T if attrs["trans_b"] else b, b_zp)


def _qgemm_out_dtype(y_s: Any, y_zp: Any) -> DType:
    if y_s is None:
        return DType.FLOAT32
    return DType.UINT8 if y_zp is None else DType.from_numpy(y_zp.dtype)


def _qgemm_numpy(a: Any, a_zp: Any, b: Any, b_zp: Any, c: Any, mult: np.ndarray,
                 out_dtype: DType, y_zp: int, attrs: Attrs) -> np.ndarray:
    """The float64 BLAS form (exact for 8-bit operands), as the reference computes it."""
    lhs = a.astype(np.float64) - float(a_zp.reshape(()))
    rhs = b.astype(np.float64) - (b_zp.astype(np.float64).reshape(-1, 1) if attrs["trans_b"]
                                  else b_zp.astype(np.float64).reshape(-1))
    acc = (lhs.T if attrs["trans_a"] else lhs) @ (rhs.T if attrs["trans_b"] else rhs)
    if c is not None:
        acc += c
    if out_dtype is DType.FLOAT32:
        return acc.astype(np.float32) * mult.astype(np.float32)
    lo, hi = QUANT_RANGES[out_dtype]
    return np.clip(requantized(acc, mult, y_zp), lo, hi).astype(out_dtype.numpy)


@dataclasses.dataclass(frozen=True)
class _QGemmCall:
    """What a QGemm node derives from its operands' shapes and constant values: checked
    once, then reused while they recur."""

    shape: tuple[int, int]
    out_dtype: DType
    mult: np.ndarray
    zp: int
    bias: np.ndarray | None
    native: bool            # the packed product serves (else the float64 form)
    y_dtype: np.dtype


@TABLE.kernel(Op.QGEMM, dtypes=("uint8", "int8"), supports_out=True, host_only=True,
              shapes="2-D, 8-bit", simd=())
def qgemm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """QGemm: the int32-accumulating native product where it serves, else float64 BLAS."""
    params = _qgemm_params(inputs)
    a, a_s, a_zp, b, b_s, b_zp, c, y_s, y_zp = params
    packed = ctx.prepacked
    if isinstance(packed, native_qgemm.PackedMatmul):
        # a node's operands but A are the same values run after run: derived once
        key = ("qgemm", a.shape, b.shape, b.dtype.char, attrs["alpha"], attrs["trans_a"],
               attrs["trans_b"], a.dtype.char, *_values_key(a_s, a_zp, b_s, b_zp, c, y_s, y_zp))
        call = packed.remembered(key, lambda: _qgemm_call(params, attrs, packed))
    else:
        call = _qgemm_call(params, attrs, packed)
        packed = _pack_qgemm(ctx, inputs, attrs) if call.native else None
    if not call.native or not isinstance(packed, native_qgemm.PackedMatmul):
        y = _qgemm_numpy(a, a_zp, b, b_zp, c, call.mult, call.out_dtype, call.zp, attrs)
        return _deliver(y, out)
    y = _out(out, call.shape, call.y_dtype)
    native_qgemm.matmul(np.ascontiguousarray(a.T if attrs["trans_a"] else a),
                        int(a_zp.reshape(())), packed, call.bias, call.mult, call.out_dtype,
                        call.zp, y, _threads(ctx))
    return _deliver(y, out)


def _qgemm_call(params: tuple[Any, ...], attrs: Attrs, packed: Any) -> _QGemmCall:
    """QGemm's checks and its operands' derived values; native where the product is (or
    can be) packed and a's zero point is one value."""
    a, a_s, a_zp, b, b_s, b_zp, c, y_s, y_zp = params
    for what, value, zp in (("a", a, a_zp), ("b", b, b_zp)):
        quantization.check_pair(Op.QGEMM, value, zp, what)
    shape = qgemm_shape(a.shape, b.shape, attrs["trans_a"], attrs["trans_b"])
    out_dtype = _qgemm_out_dtype(y_s, y_zp)
    mult = qgemm_scales(attrs["alpha"], a_s, b_s, y_s)
    zp = 0 if y_zp is None else int(y_zp.reshape(()))
    n = int(shape[1])  # type: ignore[arg-type]
    # a pack made with other zero points for B (one that is not a constant) does not serve
    native = planner_rules().int8_qgemm_serves(
        a_zp.shape, None if c is None else c.shape, n) and (
        packed.serves_zero_point(b_zp) if isinstance(packed, native_qgemm.PackedMatmul)
        else native_qgemm.available())
    bias = None if c is None or not native else np.broadcast_to(
        c.reshape(-1), (n,)).astype(np.int32)
    return _QGemmCall((int(shape[0]), n), out_dtype, mult, zp, bias,  # type: ignore[arg-type]
                      native, np.dtype(out_dtype.numpy))


TABLE.kernel(Op.QGEMM, variant="int8", dtypes=("uint8", "int8"), supports_out=True,
             prepack=_pack_qgemm, shapes="2-D, 8-bit", **_META)(qgemm)


# ---- QLinearAdd ------------------------------------------------------------------------------
def _add_served(a: Any, a_s: Any, a_zp: Any, b: Any, b_s: Any, b_zp: Any, y_s: Any,
                y_zp: Any) -> bool:
    scales = (a_s, b_s, y_s)
    return (native_qgemm.available() and a.shape == b.shape
            and _eight_bit(a, b, a_zp, b_zp, y_zp) and a_zp.dtype == a.dtype
            and b_zp.dtype == b.dtype and all(_scalar(p) for p in (*scales, a_zp, b_zp, y_zp))
            and all(s.dtype == np.float32 for s in scales))


@functools.lru_cache(maxsize=64)
def _add_constants(a_s: float, b_s: float, y_s: float, a_zp: int, b_zp: int,
                   y_zp: int) -> tuple[float, float, float] | None:
    """QLinearAdd's float32 constants for the native pass (None where one is not finite,
    a scale of 0, inf or NaN: the NumPy kernel then), made once per set of parameters.
    Both compute the same form, so any finite constants give the NumPy kernel's bits."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        constants = qlinear_add_constants(a_s, b_s, y_s, a_zp, b_zp, y_zp)
    if not all(np.isfinite(constants)):
        return None
    ra, rb, c = (float(v) for v in constants)
    return ra, rb, c


@TABLE.kernel(Op.QLINEAR_ADD, variant="int8", dtypes=("uint8", "int8"), supports_out=True,
              shapes="same-shaped 8-bit operands, float32 scales per tensor", **_META)
def qlinear_add(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One native pass over the bytes; broadcasting or other scales run the NumPy kernel.
    Elementwise, so any layout; a join that ends a channels-last chain writes NCHW, one
    that starts it (NCHW operands) writes channels-last."""
    src, dst = qlayout.layouts(ctx)
    if src != dst:
        y = _out(out, inputs[0].shape, inputs[7].dtype)
        plain = dataclasses.replace(ctx, plan=qlayout.without_layout(ctx.plan))
        same = qlinear_add(plain, inputs, attrs, [qlayout.scratch("y", y.shape, y.dtype)])[0]
        if dst == qlayout.NHWC:
            qlayout.to_nhwc(same, _threads(ctx), qlayout.channels_last(y))
        else:
            qlayout.to_nchw(qlayout.channels_last(same), _threads(ctx), y)
        return _deliver(y, out)
    a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp = inputs
    constants = _add_call(a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp)
    if not constants:
        return list(quantization.qlinear_add(ctx, inputs, attrs, out))
    y = _out(out, a.shape, y_zp.dtype)
    native_qgemm.qlinear_add(np.ascontiguousarray(a), np.ascontiguousarray(b), constants,
                             int(y_zp.reshape(())), attrs["activation"] == "relu", y,
                             _threads(ctx))
    return _deliver(y, out)


def _values_key(*operands: Any) -> tuple[Any, ...]:
    """The operands' types, shapes and values as a memo key (None for one that is absent):
    a node's operands but its data input are the same values run after run."""
    return tuple(None if a is None else (v.dtype.char, v.shape, v.tobytes())
                 for a in operands for v in (np.asarray(a),))


_ADD_CALLS: dict[tuple[Any, ...], tuple[float, float, float] | None] = {}
_KEPT_ADD_CALLS = 256


def _add_call(a: Any, a_s: Any, a_zp: Any, b: Any, b_s: Any, b_zp: Any, y_s: Any,
              y_zp: Any) -> tuple[float, float, float] | None:
    """The native pass's constants for these operands (None: the NumPy kernel serves
    them), checked once per set of operand shapes, types and parameter values (a join
    runs with the same ones every time; the checks took most of a small join's call)."""
    params = (a_s, a_zp, b_s, b_zp, y_s, y_zp)
    if not all(isinstance(v, np.ndarray) for v in (a, b, *params)):
        return _add_checked(a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp)
    key = (a.shape, b.shape, a.dtype.char, b.dtype.char, *_values_key(*params))
    if key in _ADD_CALLS:
        return _ADD_CALLS[key]
    # Read back from a local: another thread may clear the shared memo meanwhile.
    found = _add_checked(a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp)
    if len(_ADD_CALLS) >= _KEPT_ADD_CALLS:
        _ADD_CALLS.clear()
    _ADD_CALLS[key] = found
    return found


def _add_checked(a: Any, a_s: Any, a_zp: Any, b: Any, b_s: Any, b_zp: Any, y_s: Any,
                 y_zp: Any) -> tuple[float, float, float] | None:
    if not _add_served(a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp):
        return None
    return _add_constants(*(float(s.reshape(())) for s in (a_s, b_s, y_s)),
                          *(int(z.reshape(())) for z in (a_zp, b_zp, y_zp)))


# ---- QLinearGlobalAveragePool -------------------------------------------------------------------
def _gap_served(x: Any, x_s: Any, x_zp: Any, y_s: Any, y_zp: Any) -> bool:
    return (qlayout.available() and x.ndim >= 3 and _eight_bit(x, x_zp, y_zp)
            and x_zp.dtype == x.dtype and all(_scalar(p) for p in (x_s, x_zp, y_s, y_zp))
            and x_s.dtype == _FLOAT32 and y_s.dtype == _FLOAT32)


@TABLE.kernel(Op.QLINEAR_GLOBAL_AVG_POOL, variant="int8", dtypes=("uint8", "int8"),
              supports_out=True, shapes="8-bit x, float32 scales per tensor", **_META)
def qlinear_global_avg_pool(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                            out: Out) -> list[Any]:
    """One native pass (``qlayout.c``), reading NCHW or, where the node's plan reads a
    channels-last chain, its NHWC bytes (the (N, C, 1, 1) result is the same bytes in
    either layout); other cases the NumPy kernel."""
    x, x_s, x_zp, y_s, y_zp = inputs
    src, _ = qlayout.layouts(ctx)
    if not _gap_served(x, x_s, x_zp, y_s, y_zp):
        if src == qlayout.NHWC:
            x = qlayout.to_nchw(qlayout.channels_last(x), _threads(ctx))
        return list(quantization.qlinear_global_avg_pool(ctx, [x, *inputs[1:]], attrs, out))
    y = _out(out, (*x.shape[:2], *(1,) * (x.ndim - 2)), y_zp.dtype)
    size = int(np.prod(x.shape[2:]))
    qlayout.global_average_pool(np.ascontiguousarray(x), src == qlayout.NHWC,
                                float(qlinear_global_scale(x_s, y_s, size)),
                                int(x_zp.reshape(())), int(y_zp.reshape(())), y, _threads(ctx))
    return _deliver(y, out)


# ---- QuantizeLinear of float32, per tensor -----------------------------------------------------
def _quantize_served(x: Any, scale: Any, zp: Any, attrs: Attrs) -> bool:
    return (native_qgemm.available() and x.dtype == np.float32 and _scalar(scale)
            and scale.dtype == np.float32 and (zp is None or (_eight_bit(zp) and _scalar(zp)))
            and attrs["precision"] is None and attrs["output_dtype"] in (None, _out_type(zp)))


def _out_type(zp: Any) -> DType:
    return DType.UINT8 if zp is None else DType.from_numpy(zp.dtype)


@TABLE.kernel(Op.QUANTIZE_LINEAR, variant="int8", dtypes=("float32",), supports_out=True,
              shapes="float32 to 8 bits, per tensor", **_META)
def quantize_linear(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One native pass (16 lanes at a time with AVX-512); other cases the NumPy kernel."""
    x, scale, zp = inputs[0], inputs[1], optional_input(inputs, 2)
    if not _quantize_served(x, scale, zp, attrs):
        return list(quantization.quantize_linear(ctx, inputs, attrs, out))
    y = _out(out, x.shape, _UINT8 if zp is None else zp.dtype)
    native_qgemm.quantize(np.ascontiguousarray(x), float(scale.reshape(())),
                          0 if zp is None else int(zp.reshape(())), y, _threads(ctx))
    return _deliver(y, out)


# ---- DequantizeLinear of 8 bits to float32, per tensor -------------------------------------------
def _dequantize_served(x: Any, scale: Any, zp: Any, attrs: Attrs) -> bool:
    return (native_qgemm.available() and x.dtype in _EIGHT_BITS and _scalar(scale)
            and scale.dtype == np.float32 and (zp is None or (zp.dtype == x.dtype and _scalar(zp)))
            and attrs["output_dtype"] in (None, DType.FLOAT32))


@dataclasses.dataclass(frozen=True)
class Operand:
    """An operand as the served checks read it, its dtype and shape (an array is one;
    the cpu planner builds these from a node's static input types)."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]


def _add_served_of(ops: Sequence[Any], attrs: Attrs) -> bool:
    return len(ops) == 8 and _add_served(*ops)


def _quantize_served_of(ops: Sequence[Any], attrs: Attrs) -> bool:
    return _quantize_served(ops[0], ops[1], ops[2] if len(ops) > 2 else None, attrs)


def _dequantize_served_of(ops: Sequence[Any], attrs: Attrs) -> bool:
    return _dequantize_served(ops[0], ops[1], ops[2] if len(ops) > 2 else None, attrs)


# The one-pass kernels' checks by op: the kernels and the planner's split reasons ask these.
PASS_SERVED: dict[Op, Callable[[Sequence[Any], Attrs], bool]] = {
    Op.QLINEAR_ADD: _add_served_of, Op.QUANTIZE_LINEAR: _quantize_served_of,
    Op.DEQUANTIZE_LINEAR: _dequantize_served_of}


def pass_served(op: Op, operands: Sequence[Any], attrs: Attrs) -> bool:
    """Whether ``op``'s native one-pass kernel serves these operands (arrays or
    :class:`Operand`; None for an absent one) and attributes, else its NumPy kernel runs.
    QLinearAdd also needs finite constants from its values (_add_constants)."""
    served = PASS_SERVED.get(op)
    return served is not None and len(operands) >= 2 and served(operands, attrs)


@TABLE.kernel(Op.DEQUANTIZE_LINEAR, variant="int8", dtypes=("uint8", "int8"), supports_out=True,
              shapes="8 bits to float32, per tensor", **_META)
def dequantize_linear(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One native pass (16 lanes at a time with AVX-512); other cases the NumPy kernel."""
    x, scale, zp = inputs[0], inputs[1], optional_input(inputs, 2)
    if not _dequantize_served(x, scale, zp, attrs):
        return list(quantization.dequantize_linear(ctx, inputs, attrs, out))
    y = _out(out, x.shape, _FLOAT32)
    native_qgemm.dequantize(np.ascontiguousarray(x), float(scale.reshape(())),
                            0 if zp is None else int(zp.reshape(())), y, _threads(ctx))
    return _deliver(y, out)
