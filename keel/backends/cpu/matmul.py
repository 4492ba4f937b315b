"""cpu kernels of the matmul family, written once against ``ctx.xp``.

Float32 MatMul (with a 2-D B) and Gemm run on the native GEMM when the native
tier is there (:mod:`keel.backends.cpu.native_gemm`): B is packed once per
model through the prepack hook, and the bias, Gemm's alpha and C, and a ReLU /
clip ride on the kernel's store; other activations run in place after it. A
node's prepared native call is kept in its prepack state and reused while the
node sees the same arrays: a steady-state call runs it before anything else
(about 0.7 us of Python; a model output, a fresh array every run, is computed
into a kept buffer and copied: 1.7 us. LeNet's Gemms at batch 1, 1 thread:
3.4 / 1.9 / 2.4 us against 5.6 / 4.0 / 7.4). Everything else (other dtypes, batched B, the gpu
backend) goes to BLAS through ``xp.matmul`` with ``out=`` (the caller's buffer
when given), and the epilogue (bias, activation) runs in place on the result.
float16 is computed in float32. Two-operand einsums are rewritten as one
batched matmul (transposes and reshapes around it); other einsums use
``xp.einsum(optimize=True)``. Integer matmuls with zero points run exactly in
float BLAS (float32 while every partial sum stays below 2**24, else float64).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out, optional_input
from keel.backends.bound import BoundCall, bare
from keel.backends.cpu import fastmath, native_gemm, planner, workspace
from keel.backends.cpu.backend import ThreadCap
from keel.backends.cpu.conv_epilogue import activation as resolved_activation
from keel.backends.cpu.kernels import TABLE
from keel.backends.plan import NodePlan
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.native.pointers import weak
from keel.ops.epilogue import in_place
from keel.ops.registry import Op
from keel.ops.schemas.matmul import (
    DTYPES,
    attention_shape,
    check_bias,
    check_dtype,
    check_zero_point,
    dot_shape,
    einsum_shape,
    gemm_shape,
    matmul_shape,
    parse_einsum,
)

__all__: list[str] = []




def _common(op: Op, arrays: Sequence[Any]) -> DType:
    return _common_dtype(op, tuple(a.dtype for a in arrays if a is not None))


@functools.lru_cache(maxsize=256)
def _common_dtype(op: Op, dtypes: tuple[Any, ...]) -> DType:
    kinds = {DType.from_numpy(d) for d in dtypes}
    if len(kinds) != 1:
        raise InvalidArgumentError(
            f"{op.value} needs inputs of one dtype, got "
            f"{', '.join(sorted(d.value for d in kinds))}"
        )
    dtype = kinds.pop()
    check_dtype(op, dtype)
    return dtype


def _compute(xp: Any, dtype: DType) -> Any:
    return _COMPUTE[dtype] if dtype in _COMPUTE else _compute_of(dtype)


@functools.lru_cache(maxsize=64)
def _compute_of(dtype: DType) -> np.dtype[Any]:
    """The dtype a kernel computes in: float16 in float32, the rest as they are."""
    return np.dtype(np.float32) if dtype is DType.FLOAT16 else dtype.numpy


_COMPUTE: dict[DType, np.dtype[Any]] = {d: _compute_of(d) for d in DTYPES[Op.MATMUL]
                                         if not d.is_narrow}    # (no ml_dtypes import)


@functools.lru_cache(maxsize=256)
def _signature(op: Op, a: Any, b: Any, c: Any) -> tuple[DType, np.dtype[Any], np.dtype[Any]]:
    """(keel dtype, NumPy dtype, compute dtype) of a two- or three-operand product
    (``c`` None when absent): checked once per dtype combination."""
    dtype = _common_dtype(op, tuple(d for d in (a, b, c) if d is not None))
    return dtype, dtype.numpy, _compute_of(dtype)


def _target(xp: Any, out: Out, shape: tuple[int, ...], dtype: Any) -> Any:
    """The caller's buffer when it can take the result directly, else a fresh array."""
    if out is not None and out[0] is not None:
        buf = out[0]
        if buf.dtype == dtype and buf.shape == shape:
            return buf
    return xp.empty(shape, dtype=dtype)


def _deliver(out: Out, y: Any, dtype: DType | np.dtype[Any]) -> list[Any]:
    if out is not None and out[0] is not None:
        if out[0] is not y:
            out[0][...] = y
        return [out[0]]
    return [y.astype(dtype.numpy if isinstance(dtype, DType) else dtype, copy=False)]


def _activation(attrs: Attrs) -> Any:
    """The fused activation as an in-place ``f(xp, y)``, or None."""
    name = attrs.get("activation")
    if not name:
        return None
    params = attrs.get("activation_params", ())
    return _in_place(name, params if isinstance(params, tuple) else tuple(params))


def _epilogue(xp: Any, y: Any, addend: Any, attrs: Attrs, packed: _Operands,
              node_plan: NodePlan | None) -> None:
    """y += addend, then the fused activation, in place: block by block of rows (the
    plan's epilogue_block elements) so that both passes run on a block in cache."""
    run = packed.run if packed.attrs is attrs else _activation(attrs)
    if run is None or addend is None:
        if addend is not None:
            xp.add(y, addend, out=y)
        if run is not None:
            run(xp, y)
        return
    n = y.shape[-1] if y.ndim else 1
    size = planner.block(node_plan, "epilogue_block")
    if (xp is np and y.ndim >= 2 and y.size > 2 * size and y.flags.c_contiguous
            and addend.ndim >= 1 and addend.size == addend.shape[-1] == n):
        rows, row = y.reshape(-1, n), addend.reshape(n)
        step = max(1, size // n)
        for r in range(0, rows.shape[0], step):
            block = rows[r:r + step]
            xp.add(block, row, out=block)
            run(xp, block)
        return
    xp.add(y, addend, out=y)
    run(xp, y)


@functools.lru_cache(maxsize=256)
def _in_place(name: str, params: tuple[float, ...]) -> Any:
    """The fused activation as ``f(xp, y, threads=1)``: the native one-pass kernel, split
    over ``threads``, where it serves (float32, C-contiguous, NumPy), else the NumPy
    passes of :mod:`keel.ops.epilogue`."""
    run = in_place(name, params)
    if run is None:
        return None
    native_served = name in fastmath.NATIVE_ACTIVATIONS

    def apply(xp: Any, y: Any, threads: int = 1) -> None:
        if not (native_served and xp is np
                and fastmath.activation_inplace(name, params, y, threads)):
            run(xp, y)

    return apply


# ---- matmul, dot, gemm ---------------------------------------------------------------
# Shape checks are pure functions of the shapes: cached, so a steady-state call pays
# one dictionary lookup instead of re-deriving them.
Setup = tuple[tuple[int, ...], DType, np.dtype[Any], np.dtype[Any]]


@functools.lru_cache(maxsize=1024)
def _matmul_setup(a: tuple[int, ...], adt: Any, b: tuple[int, ...], bdt: Any,
                  bias: tuple[int, ...] | None, biasdt: Any) -> Setup:
    """(output shape, dtype, NumPy dtype, compute dtype), checked once per signature."""
    dtype, npdt, ct = _signature(Op.MATMUL, adt, bdt, biasdt)
    shape = matmul_shape(a, b)
    if bias is not None:
        check_bias(Op.MATMUL, shape, bias)
    return tuple(int(d) for d in shape if isinstance(d, int)), dtype, npdt, ct


@functools.lru_cache(maxsize=1024)
def _gemm_setup(a: tuple[int, ...], adt: Any, b: tuple[int, ...], bdt: Any,
                c: tuple[int, ...] | None, cdt: Any, trans_a: bool, trans_b: bool) -> Setup:
    """(output shape, dtype, NumPy dtype, compute dtype), checked once per signature."""
    dtype, npdt, ct = _signature(Op.GEMM, adt, bdt, cdt)
    shape = gemm_shape(a, b, trans_a, trans_b)
    if c is not None:
        check_bias(Op.GEMM, shape, c, "C")
    return tuple(int(d) for d in shape if isinstance(d, int)), dtype, npdt, ct


@dataclass(frozen=True)
class _Operands:
    """A node's constant operands in the form its BLAS call takes (the prepack state).

    ``rhs`` is B as one C-contiguous (K, N) matrix of the compute dtype
    (transposed once for gemm's ``trans_b``), ``addend`` the bias (matmul) or
    beta * C (gemm) in the compute dtype; ``*_src`` are the arrays they were made
    from, so a kernel called with other arrays recomputes instead. ``native`` is
    B packed for the native GEMM (then ``rhs`` is kept only when it is B itself:
    the NumPy path, run only for cases the native one does not serve, makes a
    transposed or converted copy per call).
    """

    rhs_src: Any = None
    rhs: Any = None
    addend_src: Any = None
    addend: Any = None
    attrs: Any = None       # the node's attributes, and their fused activation resolved
    run: Any = None         # once (``_activation``); None: no activation
    native: native_gemm.Packed | None = None
    # Prepared native runs by (id(A), thread): see ``_native``.
    calls: dict[tuple[int, int], Any] = field(default_factory=dict)


def _rhs(xp: Any, b: Any, trans: bool, ct: Any) -> Any:
    """B as BLAS takes it fastest: C-contiguous (K, N) (batched B is left as is).

    A transposed view costs OpenBLAS 30-50 % more at small M (measured at
    32x784x512: 0.44 ms against 0.32 ms contiguous), and one layout for every
    call keeps the result bitwise the same with and without prepacking.
    """
    b = b.astype(ct, copy=False)
    if trans:
        b = b.T
    return xp.ascontiguousarray(b) if b.ndim == 2 else b


def _frozen(xp: Any, made: Any, src: Any) -> Any:
    """``made``, read-only when it is a new array of ours (never the caller's ``src``)."""
    if xp is np and made is not src and made.base is None:
        made.flags.writeable = False
    return made


def _pack_matmul(ctx: KernelContext, consts: Inputs, attrs: Attrs) -> _Operands | None:
    b, bias = consts[1], optional_input(consts, 2)
    if b is None and bias is None:
        return None
    ct = _compute(ctx.xp, DType.from_numpy((b if b is not None else bias).dtype))
    xp = ctx.xp
    packed = _native_pack(xp, b, False, ct)
    rhs = None if b is None else _kept_rhs(xp, _rhs(xp, b, False, ct), b, packed)
    return _Operands(b, rhs, bias,
                     None if bias is None else _frozen(xp, bias.astype(ct, copy=False), bias),
                     attrs, _activation(attrs), packed)


def _pack_gemm(ctx: KernelContext, consts: Inputs, attrs: Attrs) -> _Operands | None:
    b, c = consts[1], optional_input(consts, 2)
    if b is None and c is None:
        return None
    dtype = DType.from_numpy((b if b is not None else c).dtype)
    ct = _compute(ctx.xp, dtype)
    xp = ctx.xp
    packed = _native_pack(xp, b, attrs["trans_b"], ct)
    rhs = None if b is None else _kept_rhs(xp, _rhs(xp, b, attrs["trans_b"], ct), b, packed)
    addend = None if c is None else _frozen(xp, _gemm_addend(c, attrs["beta"], ct, dtype), c)
    return _Operands(b, rhs, c, addend, attrs, _activation(attrs), packed)


def _kept_rhs(xp: Any, rhs: Any, b: Any, packed: native_gemm.Packed | None) -> Any:
    """The BLAS form of B to keep: none beside a native packing unless it is B itself
    (a transposed or converted copy would double the weight's memory for a path
    that then runs only for cases the native kernel does not serve)."""
    if packed is not None and rhs is not b:
        return None
    return _frozen(xp, rhs, b)


def _native_pack(xp: Any, b: Any, trans: bool, ct: Any) -> native_gemm.Packed | None:
    """B (K, N) packed for the native GEMM when it serves this B, else None."""
    if xp is not np or b is None or b.ndim != 2 or ct != np.float32:
        return None
    b32 = b.astype(np.float32, copy=False)
    return native_gemm.pack(b32.T if trans else b32, left=False)


def _gemm_addend(c: Any, beta: float, ct: Any, dtype: DType) -> Any:
    """beta * C in the compute dtype (integer gemm: beta acts as an integer)."""
    c2 = c.astype(ct, copy=False)
    if beta != 1.0:
        c2 = c2 * (beta if dtype.is_float else int(beta))
    return c2


def _product(xp: Any, a: Any, b: Any, y: Any, threads: int | None = None) -> None:
    """``y = a @ b`` (NumPy matmul semantics) as one BLAS call where the shapes allow,
    with BLAS capped at ``threads`` (a program of native variants runs without the
    cap, so a case one of them hands to BLAS caps it here; where the cap is already
    in place this only reads the pool's size).

    With a 2-D B, the leading dimensions of A fold into the rows of one GEMM:
    NumPy's matmul would loop a GEMM per leading index instead (measured: 6.0 ms
    against 5.5 ms for (32, 128, 256) @ (256, 256)). ``dot`` also skips the
    gufunc machinery of ``matmul``, worth ~1 us a call for a single row.
    """
    if threads and xp is np:
        with ThreadCap(threads):
            _product(xp, a, b, y)
        return
    if b.ndim == 2 and y.flags.c_contiguous:
        if a.ndim <= 2:
            xp.dot(a, b, out=y)
        else:
            xp.dot(a.reshape(-1, a.shape[-1]), b, out=y.reshape(-1, b.shape[1]))
        return
    xp.matmul(a, b, out=y)


# ---- the native path -----------------------------------------------------------------
_NATIVE_SHAPES = "float32 (float16 computed in float32), A of any rank, 2-D B"
_NATIVE_MEASURED = (
    "2-core AMD EPYC (Zen 4, AVX-512), 1 thread, B prepacked, medians of interleaved runs: "
    "32x784x512 with bias and ReLU 0.25 ms against 0.33 ms for OpenBLAS + NumPy epilogue "
    "(onnxruntime 0.23 ms); 32x512x256 0.086 ms against 0.105 ms")


@TABLE.kernel(Op.MATMUL, dtypes=DTYPES[Op.MATMUL], supports_out=True, simd=(),
              prepack=_pack_matmul, shapes="any ranks (NumPy matmul broadcasting)")
def matmul(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """act(A @ B + bias): the native GEMM where it serves (float32 with a 2-D B: B
    packed once, bias, residual and ReLU/clip fused into its store), else BLAS
    into the output and the epilogue in place."""
    state = ctx.prepacked
    if out is not None and state.__class__ is _Operands and _steady(state, inputs, attrs, out,
                                                                   ctx):
        return [out[0]]
    xp = ctx.xp
    a, b = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    shape, _, npdt, ct = _matmul_setup(a.shape, a.dtype, b.shape, b.dtype,
                                       None if bias is None else bias.shape,
                                       None if bias is None else bias.dtype)
    packed = ctx.prepacked if isinstance(ctx.prepacked, _Operands) else _NOTHING
    addend = None if bias is None else (
        packed.addend if packed.addend_src is bias else bias.astype(ct, copy=False))
    y = _target(xp, out, shape, ct)
    if xp is np and b.ndim == 2 and ct == np.float32 and y.size and _native_tier():
        a2 = a.astype(ct, copy=False)
        a2 = a2.reshape(math.prod(a2.shape[:-1]), a2.shape[-1])
        if _native(ctx, a, a2, b, b, packed, y, addend, attrs, 1.0, out):
            return _deliver(out, y, npdt)
    rhs = packed.rhs if packed.rhs_src is b and packed.rhs is not None else _rhs(
        xp, b, False, ct)
    if y.size:
        _product(xp, a.astype(ct, copy=False), rhs, y, _blas(ctx))
    _epilogue(xp, y, addend, attrs, packed, ctx.plan)
    return _deliver(out, y, npdt)


def _bind_product(kernel: Any) -> Any:
    """A bind (``KernelVariant.bind``) for matmul and gemm: the node's kept native call
    (prepared by running the kernel once), or for float32 products of two activations
    without a bias or activation, the BLAS call the kernel makes."""
    def bind(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
             out: Sequence[Any]) -> Callable[[], object] | None:
        if ctx.xp is not np or len(out) != 1:
            return None
        state, a, y = ctx.prepacked, inputs[0], out[0]
        if state.__class__ is not _Operands:
            return _bind_blas(ctx, inputs, attrs, y) if kernel is matmul else None
        kernel(ctx, inputs, attrs, out)             # prepares the node's native call
        run = state.calls.get((id(a), _get_ident()))
        if run is None or run.a_ref() is not a or run.attrs is not attrs \
                or run.hold is not None or run.y_ref() is not y:
            return None
        split = _split(ctx)
        # The call packs into this thread's workspace: programs run bound calls only on
        # the thread that bound them.
        if run.rest is None and run.threads == split:
            if run.after is None:                    # the C call itself
                return _reading_a(run.go, run.call, split, None)
            activation = _bound_activation(attrs, y, ctx.threads or 1)
            if activation is not None:               # the C call, then the native pass
                return _reading_a(_then(run.go, activation), run.call, split, activation)
        return functools.partial(run.into, y, ctx.threads or 1, split)
    return bind


def _reading_a(call: BoundCall, native: native_gemm.Call, split: int,
               activation: Callable[[], object] | None) -> BoundCall:
    """``call`` with its ``reading``: the same step as a call whose A moves
    (:meth:`native_gemm.Call.bound_reading`; its ``point(array)`` moves it), or None
    where it cannot. A program reads a feed in place through it (the cpu planner's
    ``FEED_IN_PLACE_BYTES``)."""
    def reading(buffer: Any) -> BoundCall | None:
        go = native.bound_reading(split, buffer)
        if go is None or activation is None:
            return go
        return dataclasses.replace(_then(go, activation), point=go.point)
    return dataclasses.replace(call, reading=reading)


def _then(product: BoundCall, activation: Callable[[], object]) -> BoundCall:
    """``product``, then ``activation``: one call of both functions themselves, holding
    what each holds."""
    return BoundCall(functools.partial(_in_turn, product.fn, bare(activation)),
                     keep=(product, activation))


def _bound_activation(attrs: Attrs, y: Any, threads: int) -> Callable[[], object] | None:
    """The fused activation a native product runs after its call (``_NativeRun.after``),
    bound to ``y``: the same native pass, its checks made once; None when NumPy runs it."""
    name = attrs.get("activation")
    params = attrs.get("activation_params", ())
    if not name:
        return None
    return fastmath.bound_activation_inplace(
        name, params if isinstance(params, tuple) else tuple(params), y, threads)


def _in_turn(first: Callable[[], object], second: Callable[[], object]) -> None:
    first()
    second()


def _bind_blas(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
               y: Any) -> Callable[[], object] | None:
    """The BLAS product ``matmul`` runs for two float32 activations, into ``y``."""
    if len(inputs) != 2 or attrs.get("activation"):
        return None
    a, b = inputs
    if a.dtype != np.float32 or b.dtype != np.float32 or y.dtype != np.float32 or \
            b.ndim == 2 or _rhs(np, b, False, np.float32) is not b or \
            y.shape != _matmul_setup(a.shape, a.dtype, b.shape, b.dtype, None, None)[0]:
        return None
    return functools.partial(_product, np, a, b, y, _blas(ctx))


# The same kernel, as the variant a plan names when the native tier is there.
TABLE.kernel(Op.MATMUL, variant="native", dtypes=DTYPES[Op.MATMUL], supports_out=True,
             simd=(), prepack=_pack_matmul, requires="native", priority=10,
             shapes=_NATIVE_SHAPES, measured=_NATIVE_MEASURED, bind=_bind_product(matmul))(matmul)


_NOTHING = _Operands()


@TABLE.kernel(Op.DOT, dtypes=DTYPES[Op.DOT], supports_out=True, simd=(),
              shapes="any ranks (numpy.dot)")
def dot(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """numpy.dot; 1-D . 1-D gives a 0-D array (seed 001)."""
    xp = ctx.xp
    a, b = inputs
    dtype = _common(Op.DOT, [a, b])
    shape = dot_shape(a.shape, b.shape)
    ct = _compute(xp, dtype)
    y = xp.asarray(xp.dot(a.astype(ct, copy=False), b.astype(ct, copy=False)))
    return _deliver(out, y.reshape(shape), dtype)


@TABLE.kernel(Op.GEMM, dtypes=DTYPES[Op.GEMM], supports_out=True, simd=(),
              prepack=_pack_gemm, shapes="2-D A and B, C broadcast to (M, N)")
def gemm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """act(alpha * A' @ B' + beta * C): the native GEMM where it serves (float32: B
    packed once, alpha, C and ReLU/clip fused into its store), else BLAS into the
    output and the rest in place."""
    state = ctx.prepacked
    if out is not None and state.__class__ is _Operands and _steady(state, inputs, attrs, out,
                                                                   ctx):
        return [out[0]]
    xp = ctx.xp
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    trans_a, trans_b = attrs["trans_a"], attrs["trans_b"]
    shape, dtype, npdt, ct = _gemm_setup(a.shape, a.dtype, b.shape, b.dtype,
                                         None if c is None else c.shape,
                                         None if c is None else c.dtype, trans_a, trans_b)
    packed = ctx.prepacked if isinstance(ctx.prepacked, _Operands) else _NOTHING
    a2 = a.astype(ct, copy=False)
    alpha, beta = attrs["alpha"], attrs["beta"]
    addend = None
    if c is not None and beta != 0.0:
        addend = packed.addend if packed.addend_src is c else _gemm_addend(c, beta, ct, dtype)
    y = _target(xp, out, shape, ct)
    if (xp is np and ct == np.float32 and y.size and _native_tier()
            and _native(ctx, a, a2.T if trans_a else a2, b, b.T if trans_b else b, packed, y,
                        addend, attrs, alpha, out)):
        return _deliver(out, y, npdt)
    rhs = packed.rhs if packed.rhs_src is b and packed.rhs is not None else _rhs(
        xp, b, trans_b, ct)
    if y.size:
        _product(xp, a2.T if trans_a else a2, rhs, y, _blas(ctx))
    if alpha != 1.0:    # integer gemm: alpha and beta act as integers
        xp.multiply(y, alpha if dtype.is_float else int(alpha), out=y)
    _epilogue(xp, y, addend, attrs, packed, ctx.plan)
    return _deliver(out, y, npdt)


TABLE.kernel(Op.GEMM, variant="native", dtypes=DTYPES[Op.GEMM], supports_out=True, simd=(),
             prepack=_pack_gemm, requires="native", priority=10,
             shapes=_NATIVE_SHAPES, measured=_NATIVE_MEASURED, bind=_bind_product(gemm))(gemm)


def _native_tier() -> bool:
    return native_gemm.available()


def _native(ctx: KernelContext, a: Any, a2: Any, b: Any, bt: Any, packed: _Operands, y: Any,
            addend: Any, attrs: Attrs, alpha: float, out: Out) -> bool:
    """``y = act(alpha * a2 @ bt + addend)`` by the native GEMM; False when not served
    (then nothing is written). ``a2`` is input ``a`` as a 2-D float32 matrix, ``bt``
    the (K, N) view of input ``b`` (its packed form is used when ``packed`` was
    made from ``b``).

    A model calls a node with the same arrays every run (views of its arena, a
    fresh output array for a model output), so the prepared call is kept in the
    node's prepack state by the identity of A and the thread (:class:`_NativeRun`),
    and a steady-state call skips the argument checks (~5 us): only when
    everything else it reads is the node's own constants, and ``a2`` is ``a`` or
    a view of it (a converted copy would move). The kernels' entry points run a
    kept call before anything else (:func:`_steady`).
    """
    cacheable = (packed is not _NOTHING and packed.native is not None and packed.rhs_src is b
                 and (addend is None or addend is packed.addend)
                 and (a2 is a or not a2.flags.owndata))
    key = (id(a), _get_ident())
    hit = packed.calls.get(key) if cacheable else None
    run = None
    if hit is not None and hit.a_ref() is a and hit.attrs is attrs:
        if hit.y_ref() is y:
            run = hit
        elif out is None or not np.may_share_memory(a2, y):
            # A fresh Y every run (a model's output): computed into a buffer of the
            # run's own and copied out when small, else the call retargeted to Y.
            run = _NativeRun.fresh(hit, a2, bt, packed, b, y, addend, attrs, alpha)
            if run is not None:
                packed.calls[key] = run
    if run is None:
        prepared = _prepare_native(a2, bt, packed, b, y, addend, attrs, alpha, out)
        if prepared is None:
            return False
        run = _NativeRun(a, y, attrs, *prepared)
        if cacheable:
            if len(packed.calls) >= _CALLS_PER_NODE:
                packed.calls.clear()
            packed.calls[key] = run
    return run.into(y, ctx.threads or 1, _split(ctx))


_get_ident = threading.get_ident



class _NativeRun:
    """A node's prepared native product for one A: the call, what runs after it, and
    where it writes (Y itself, or ``hold`` copied to whichever Y the run gets)."""

    __slots__ = ("a_ref", "after", "attrs", "call", "go", "hold", "rest", "strides",
                 "threads", "y_ref")
    rest: Any
    hold: Any
    go: Any

    def __init__(self, a: Any, y: Any, attrs: Attrs, call: native_gemm.Call, rest: Any,
                 after: Any, hold: Any = None) -> None:
        self.a_ref = weakref.ref(a)
        self.y_ref = weak(None) if hold is not None else weakref.ref(y)
        self.attrs, self.call, self.rest, self.after, self.hold = attrs, call, rest, after, hold
        self.strides = None if hold is None else (hold.shape, hold.strides)
        self.threads, self.go = 0, None     # the thread count ``go`` was bound for

    def _run(self, threads: int) -> None:
        if threads != self.threads:
            self.go, self.threads = self.call.bound(threads), threads
        self.go()

    @staticmethod
    def fresh(hit: _NativeRun, a2: Any, bt: Any, packed: _Operands, b: Any, y: Any,
              addend: Any, attrs: Attrs, alpha: float) -> _NativeRun | None:
        """``hit``'s product for a new Y (of the same layout); None when not served."""
        a = hit.a_ref()
        if hit.hold is not None or y.dtype != np.float32 or not y.flags.c_contiguous:
            return None
        if y.nbytes <= planner.HOLD_BYTES:
            hold = np.empty(y.shape, np.float32)
            prepared = _prepare_native(a2, bt, packed, b, hold, addend, attrs, alpha, None)
            return None if prepared is None else _NativeRun(a, y, attrs, *prepared, hold=hold)
        call = hit.call.retarget(y if y.ndim == 2 else y.reshape(-1, y.shape[-1] if y.ndim
                                                                  else 1))
        if call is None:
            return None
        run = _NativeRun(a, y, attrs, call, hit.rest, hit.after)
        if call is hit.call:                # Y where the last one was: its bound call stands
            run.go, run.threads = hit.go, hit.threads
        return run

    def into(self, y: Any, threads: int, split: int) -> bool:
        """Compute into ``y`` (Y itself, or any C-contiguous float32 array of Y's shape
        not overlapping A when the run writes its own buffer), the product split over
        ``split`` threads and the activation over ``threads``; False: not served."""
        hold = self.hold
        target: Any
        if hold is None:
            if self.y_ref() is not y:
                return False
            target = y
        else:
            if (y.shape, y.strides) != self.strides or y.dtype != np.float32:
                return False
            a = self.a_ref()
            if a is None or np.may_share_memory(a, y):
                return False
            target = hold
        if split == self.threads:
            self.go()
        else:
            self._run(split)
        rest = self.rest
        if rest is not None:
            np.add(target, rest, out=target)
        after = self.after
        if after is not None:
            after(np, target, threads)
        if hold is not None:
            y[...] = hold
        return True


def _steady(state: Any, inputs: Inputs, attrs: Attrs, out: Out, ctx: KernelContext) -> bool:
    """Run a node's kept native product when these are the arrays it was prepared for
    (the steady state of a model); False: take the full path."""
    a = inputs[0]
    run = state.calls.get((id(a), _get_ident()))
    return (run is not None and run.a_ref() is a and run.attrs is attrs
            and inputs[1] is state.rhs_src
            and (inputs[2] if len(inputs) > 2 else None) is state.addend_src
            and run.into(out[0], ctx.threads or 1, _split(ctx)))  # type: ignore[index]


def _blas(ctx: KernelContext) -> int | None:
    """The BLAS threads a BLAS call of this node runs on: its plan's (the program's BLAS
    decision, filled in at placement), else the node's threads (a node planned without
    one, e.g. a native variant's case handed to BLAS in a program that caps nothing)."""
    plan = ctx.plan
    return plan.blas_threads if plan is not None and plan.blas_threads else ctx.threads


def _split(ctx: KernelContext) -> int:
    """The threads the node's product splits over: its plan's (the cpu planner's, from
    the product's flops), else the backend's (the GEMM then splits by the same rule)."""
    plan = ctx.plan
    return (plan.threads if plan is not None and plan.threads else ctx.threads) or 1


_CALLS_PER_NODE = 8


def _prepare_native(a2: Any, bt: Any, packed: _Operands, b: Any, y: Any, addend: Any,
                    attrs: Attrs, alpha: float, out: Out) -> tuple[Any, Any, Any] | None:
    """(native call, addend left to add after it, activation to run after it), or None."""
    if not y.flags.c_contiguous or a2.dtype != np.float32:
        return None
    if out is not None and out[0] is y and (
            np.may_share_memory(a2, y) or (addend is not None and np.may_share_memory(addend, y))):
        return None             # the kernel reads its inputs while it writes y
    rhs = packed.native if packed.native is not None and packed.rhs_src is b else (
        bt.astype(np.float32, copy=False))
    clip, after = _native_activation(attrs)
    bias, rows, res, rest = _fused_addend(addend, y.shape)
    if rest is not None:        # added after the product: the activation comes after it
        clip, after = None, _activation(attrs)
    n = y.shape[-1] if y.ndim else 1
    call = native_gemm.prepare(a2, rhs, y if y.ndim == 2 else y.reshape(-1, n), bias=bias,
                               bias_rows=rows, residual=res, alpha=alpha, clip=clip)
    return None if call is None else (call, rest, after)


def _native_activation(attrs: Attrs) -> tuple[tuple[float, float] | None, Any]:
    """(clip bounds the kernel applies, in-place activation to run after it)."""
    name = attrs.get("activation")
    if not name:
        return None, None
    params = attrs.get("activation_params", ())
    return _native_activation_of(name, params if isinstance(params, tuple) else tuple(params))


@functools.lru_cache(maxsize=256)
def _native_activation_of(name: str, params: tuple[float, ...]
                          ) -> tuple[tuple[float, float] | None, Any]:
    resolved, p = resolved_activation(name, params)
    if resolved == "clip":                      # relu arrives as clip(0, inf)
        return (p[0], p[1]), None
    return None, _in_place(name, params)


def _fused_addend(addend: Any, shape: tuple[int, ...]) -> tuple[Any, bool, Any, Any]:
    """``addend`` in the kernel's epilogue forms: (bias vector, per row?, residual
    matrix, rest to add afterwards), for an output of ``shape``."""
    if addend is None:
        return None, False, None, None
    n = shape[-1] if shape else 1
    if addend.size == 1:
        return np.full(n, addend.reshape(()), dtype=np.float32), False, None, None
    if addend.shape[-1] == n and addend.size == n:
        return np.ascontiguousarray(addend.reshape(n)), False, None, None
    if len(shape) == 2 and addend.shape == (shape[0], 1):
        return np.ascontiguousarray(addend.reshape(shape[0])), True, None, None
    if tuple(addend.shape) == tuple(shape) and (addend.ndim == 2 or addend.flags.c_contiguous):
        return None, False, addend.reshape(-1, n), None
    return None, False, None, addend


# ---- einsum ----------------------------------------------------------------------------
@TABLE.kernel(Op.EINSUM, dtypes=DTYPES[Op.EINSUM], supports_out=True, simd=(),
              shapes="two operands: one batched GEMM; else xp.einsum(optimize=True)")
def einsum(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """numpy.einsum semantics; two-operand contractions as one batched matmul."""
    xp = ctx.xp
    dtype = _common(Op.EINSUM, inputs)
    equation = attrs["equation"].replace(" ", "")
    shape = einsum_shape(equation, [x.shape for x in inputs])
    ct = _compute(xp, dtype)
    ops = [x.astype(ct, copy=False) for x in inputs]
    labels, output = parse_einsum(equation, [x.ndim for x in inputs])
    y = None
    if len(ops) == 2:
        y = _einsum_pair(xp, ops[0], ops[1], labels[0], labels[1], output)
    if y is None:
        y = xp.einsum(equation, *ops, optimize=len(ops) > 1)
    return _deliver(out, xp.asarray(y).reshape(shape), dtype)


def _einsum_pair(xp: Any, a: Any, b: Any, la: list[str], lb: list[str],
                 lo: list[str]) -> Any:
    """The contraction of two operands as one batched matmul; None if it is not one."""
    if len(set(la)) != len(la) or len(set(lb)) != len(lb):
        return None                                    # diagonals: leave to einsum
    a, la = _sum_private(a, la, lb, lo)
    b, lb = _sum_private(b, lb, la, lo)
    size = {**dict(zip(lb, b.shape, strict=True)), **dict(zip(la, a.shape, strict=True))}
    batch = [lab for lab in lo if lab in la and lab in lb]
    inner = [lab for lab in la if lab in lb and lab not in lo]
    left = [lab for lab in la if lab not in lb]
    right = [lab for lab in lb if lab not in la]
    if any(dict(zip(la, a.shape, strict=True))[lab] != dict(zip(lb, b.shape, strict=True))[lab]
           for lab in inner):
        return None                                    # broadcast contraction: rare
    k = math.prod(size[lab] for lab in inner)
    a3 = a.transpose([la.index(x) for x in (*batch, *left, *inner)])
    a3 = a3.reshape((*a3.shape[:len(batch)], math.prod(size[x] for x in left), k))
    b3 = b.transpose([lb.index(x) for x in (*batch, *inner, *right)])
    b3 = b3.reshape((*b3.shape[:len(batch)], k, math.prod(size[x] for x in right)))
    y = xp.matmul(a3, b3)
    y = y.reshape((*y.shape[:len(batch)], *(size[x] for x in left), *(size[x] for x in right)))
    have = [*batch, *left, *right]
    return y.transpose([have.index(x) for x in lo])


def _sum_private(a: Any, la: list[str], other: list[str], lo: list[str]) -> tuple[Any, list[str]]:
    """Sum out the labels only ``a`` has that the output drops."""
    private = [i for i, lab in enumerate(la) if lab not in other and lab not in lo]
    if not private:
        return a, la
    return a.sum(axis=tuple(private)), [lab for i, lab in enumerate(la) if i not in private]


# ---- integer matmul ----------------------------------------------------------------------
@TABLE.kernel(Op.MATMUL_INTEGER, dtypes=DTYPES[Op.MATMUL_INTEGER], supports_out=True,
              simd=(), shapes="any ranks (NumPy matmul broadcasting)")
def matmul_integer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(A - a_zero_point) @ (B - b_zero_point) exactly, through float BLAS."""
    xp = ctx.xp
    a, b, azp, bzp = inputs[0], inputs[1], optional_input(inputs, 2), optional_input(inputs, 3)
    for i, x in enumerate(inputs):
        if x is not None:
            check_dtype(Op.MATMUL_INTEGER, DType.from_numpy(x.dtype), what=f"input {i}")
    shape = matmul_shape(a.shape, b.shape, Op.MATMUL_INTEGER)
    k = a.shape[-1]
    # |a - zp|, |b - zp| <= 255: partial sums are exact in float32 below 2**24.
    ft = xp.float32 if k * 255 * 255 < 2**24 else xp.float64
    af, bf = a.astype(ft), b.astype(ft)
    if azp is not None:
        rows = a.shape[-2] if a.ndim > 1 else 1
        check_zero_point(Op.MATMUL_INTEGER, "a_zero_point", azp.shape, (rows,), "row")
        zp = azp.astype(ft).reshape(-1)
        xp.subtract(af, zp.reshape(-1, 1) if zp.size > 1 else zp[0], out=af)
    if bzp is not None:
        cols = b.shape[-1] if b.ndim > 1 else 1
        check_zero_point(Op.MATMUL_INTEGER, "b_zero_point", bzp.shape, (cols,), "column")
        xp.subtract(bf, bzp.astype(ft).reshape(-1), out=bf)
    y = xp.rint(xp.matmul(af, bf)).astype(xp.int64).astype(xp.int32)
    return _deliver(out, y.reshape(shape), DType.INT32)


# ---- attention -----------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _attention_plan(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...],
                    mask: tuple[int, ...] | None) -> tuple[int, ...]:
    shape = attention_shape(q, k, v, mask)
    return tuple(int(d) for d in shape if isinstance(d, int))


def _bind_attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                    out: Sequence[Any]) -> Callable[[], object] | None:
    """Attention's block loop for one program step (``KernelVariant.bind``): Q, K, V of
    the compute dtype without a mask, every view and buffer made once (buffers of its
    own: a workspace is shared by whatever runs on the thread)."""
    q, k, v, y = inputs[0], inputs[1], inputs[2], out[0]
    if ctx.xp is not np or optional_input(inputs, 3) is not None:
        return None
    rows = _rows_call(q, k, v, None, y, attrs, ctx.threads or 1, bound=True)
    if rows is not None:
        return rows
    if _native_attention(q, k):
        return _bound_native(q, k, v, y, attrs, ctx.threads or 1)
    ct = _compute(np, _common(Op.ATTENTION, [q, k, v]))
    if (any(t.dtype != ct for t in (q, k, v, y)) or not y.size or not _blockable(q, k, v, y)
            or y.shape != _attention_plan(q.shape, k.shape, v.shape, None)):
        return None
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    return _AttentionBlocks(q, k, v, None, y, scale, attrs["is_causal"],
                            planner.block(ctx.plan, "attention_block"), own=True)


def _bound_native(q: Any, k: Any, v: Any, y: Any, attrs: Attrs,
                  threads: int) -> Callable[[], object] | None:
    """The native attention prepared once for a program step's own arrays (float32,
    C-contiguous, the same batch dimensions, no mask): its per-call preparation (~30 us
    at BERT-mini's batch 1) is gone from every run. None: the kernel serves each call."""
    if (any(a.dtype != np.float32 or not a.flags.c_contiguous for a in (q, k, v, y))
            or not _blockable(q, k, v, y)
            or y.shape != _attention_plan(q.shape, k.shape, v.shape, None)):
        return None
    s, d, t, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    batch = q.shape[:-2]
    heads = math.prod(batch)
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(d)
    call = _whole_heads_call(q.reshape(heads, s, d), k.reshape(heads, t, d),
                             v.reshape(heads, t, dv), None, y.reshape(heads, s, dv), batch,
                             scale, bool(attrs["is_causal"]), threads, own=True)
    return None if call is None else call.run


@TABLE.kernel(Op.ATTENTION, dtypes=DTYPES[Op.ATTENTION], supports_out=True, simd=(),
              shapes="Q (..., S, D), K (..., T, D), V (..., T, Dv)", native_form=True,
              bind=_bind_attention)
def attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """softmax(Q K^T * scale + mask) V: per block of heads, two GEMMs and a softmax
    that stays in cache."""
    xp = ctx.xp
    q, k, v, mask = inputs[0], inputs[1], inputs[2], optional_input(inputs, 3)
    if xp is np:
        done = _attention_rows(q, k, v, mask, attrs, out, ctx.threads or 1)
        if done is not None:
            return done
    dtype = _common(Op.ATTENTION, [q, k, v])
    shape = _attention_plan(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    ct = _compute(xp, dtype)
    q, k, v = (t.astype(ct, copy=False) for t in (q, k, v))
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    y = _target(xp, out, shape, ct)
    if y.size:
        block = planner.block(ctx.plan, "attention_block")
        causal = attrs["is_causal"]
        rows = None if xp is not np else _rows_call(q, k, v, mask, y, attrs, ctx.threads or 1)
        if rows is not None:
            rows()
        elif xp is not np or not _blockable(q, k, v, y):
            _attention_batched(xp, q, k, v, mask, y, scale, causal)
        elif not _attention_native(q, k, v, mask, y, scale, causal, block, ctx.threads or 1):
            _attention_blocks(q, k, v, mask, y, scale, causal, block)
    return _deliver(out, y, dtype)


def _attention_rows(q: Any, k: Any, v: Any, mask: Any, attrs: Attrs, out: Out,
                    threads: int) -> list[Any] | None:
    """A call on the native row kernel with as little as possible done per call (a decode
    step's K and V are new arrays every step, so its attention is never bound): float32
    C-contiguous Q, K, V, a float32 or boolean mask whose strides the kernel can follow;
    the rest per layout, once (:func:`_rows_kernel`). None: the general path serves it."""
    f32 = np.float32
    if (q.dtype != f32 or k.dtype != f32 or v.dtype != f32 or not q.flags.c_contiguous
            or not k.flags.c_contiguous or not v.flags.c_contiguous
            or not fastmath.available()):
        return None
    if mask is not None and mask.dtype != f32:
        if mask.dtype != np.bool_:
            return None
        mask = np.where(mask, f32(0), f32(-np.inf))
    found = _rows_kernel(q.shape, k.shape, v.shape,
                         None if mask is None else (mask.shape, mask.strides),
                         attrs["scale"], bool(attrs["is_causal"]), threads)
    if found is None:
        return None
    kernel, shape = found
    y = out[0] if out is not None and len(out) and out[0] is not None else None
    if y is None or y.dtype != f32 or y.shape != shape or not y.flags.c_contiguous \
            or np.may_share_memory(y, k) or np.may_share_memory(y, v):
        y = np.empty(shape, f32)
    kernel.run(q, k, v, mask, y)
    return _deliver(out, y, DType.FLOAT32)


@functools.lru_cache(maxsize=256)
def _rows_kernel(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...],
                 mask: tuple[tuple[int, ...], tuple[int, ...]] | None, scale: float | None,
                 causal: bool, threads: int
                 ) -> tuple[fastmath.RowAttention, tuple[int, ...]] | None:
    """(the row kernel, Y's shape) for Q, K, V of these shapes and a float32 mask of this
    (shape, strides) where the planner gives the heads to the row kernel
    (``planner.attention_rows``) and the batch dimensions match; None otherwise. Checks
    the shapes (raising as the general path does)."""
    shape = _attention_plan(q, k, v, None if mask is None else mask[0])
    batch, s, t = q[:-2], q[-2], k[-2]
    if (len(q) < 3 or k[:-2] != batch or v[:-2] != batch or not t
            or not planner.attention_rows(s, t)):
        return None
    layout = None if mask is None else _mask_strides(*mask, batch, s, t)
    if mask is not None and layout is None:
        return None
    heads = math.prod(batch)
    kernel = fastmath.row_attention((heads, s, q[-1]), (heads, t, k[-1]), (heads, t, v[-1]),
                                    layout, scale if scale is not None else 1 / math.sqrt(q[-1]),
                                    causal, threads)
    return None if kernel is None else (kernel, shape)


def _mask_strides(shape: tuple[int, ...], strides: tuple[int, ...], batch: tuple[int, ...],
                  s: int, t: int) -> tuple[int, int, int, int] | None:
    """The row kernel's mask layout (inner heads, outer-head, inner-head and row strides
    in elements) of a float32 mask of ``shape`` and byte ``strides`` broadcast to
    (*batch, s, t); None when one stride per level cannot say it."""
    rank = len(batch) + 2
    if len(shape) > rank:
        return None
    shape = (1,) * (rank - len(shape)) + tuple(shape)
    strides = (0,) * (rank - len(strides)) + tuple(strides)
    step = [0 if n == 1 else st // 4 for n, st in zip(shape, strides, strict=True)]
    if shape[-1] != t or (t > 1 and step[-1] != 1) or shape[-2] not in (1, s) \
            or any(st % 4 for st in strides):
        return None
    outer = [i for i in range(len(batch) - 1) if shape[i] != 1]
    if len(outer) > 1 or (outer and outer[0] != len(batch) - 2):
        return None                  # the outer heads span several varying dimensions
    mb = step[outer[0]] if outer else 0
    return batch[-1], mb, step[len(batch) - 1], step[-2]


def _rows_call(q: Any, k: Any, v: Any, mask: Any, y: Any, attrs: Attrs, threads: int,
               bound: bool = False) -> Callable[[], None] | None:
    """The native row kernel's call (``fastmath.attend_rows``) for these arrays, where
    the planner gives it their heads (``planner.attention_rows``): float32, the same batch
    dimensions, a mask broadcast to them. ``bound``: a call kept for later runs, so
    only on the caller's own memory (no copies of Q, K, V or the mask made here)."""
    if (q.dtype != np.float32 or not _blockable(q, k, v, y)
            or not planner.attention_rows(q.shape[-2], k.shape[-2])
            or not fastmath.available()):
        return None
    batch, s, t = q.shape[:-2], q.shape[-2], k.shape[-2]
    heads = math.prod(batch)
    if bound and not all(a.flags.c_contiguous for a in (q, k, v)):
        return None
    q3, k3, v3 = (np.ascontiguousarray(a.reshape(heads, *a.shape[-2:])) for a in (q, k, v))
    m4 = None if mask is None else _row_mask(mask, batch, s, t)
    if bound and mask is not None and (m4 is None or not np.may_share_memory(m4, mask)):
        return None
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    return fastmath.bound_attend_rows(q3, k3, v3, m4, y.reshape(heads, s, -1), scale,
                                      bool(attrs["is_causal"]), threads)


def _row_mask(mask: Any, batch: tuple[int, ...], s: int, t: int) -> Any:
    """The mask as float32 (a boolean one as 0 / -inf) broadcast to (outer, inner, s, t),
    the heads split at the last batch dimension; a view where the broadcast allows."""
    if mask.dtype == np.bool_:
        mask = np.where(mask, np.float32(0), np.float32(-np.inf))
    full = np.broadcast_to(mask.astype(np.float32, copy=False), (*batch, s, t))
    return full.reshape(math.prod(batch[:-1]), batch[-1], s, t)


def _blockable(q: Any, k: Any, v: Any, y: Any) -> bool:
    """Q, K, V with the same batch dimensions (no broadcasting) and a contiguous Y."""
    batch = q.shape[:-2]
    return (q.ndim >= 3 and k.shape[:-2] == batch and v.shape[:-2] == batch
            and y.flags.c_contiguous and k.shape[-2] > 0)


def _attention_batched(xp: Any, q: Any, k: Any, v: Any, mask: Any, y: Any, scale: float,
                       causal: bool) -> None:
    """Every head at once with batched matmuls (any broadcasting; CuPy)."""
    s, t = q.shape[-2], k.shape[-2]
    if q.shape[-1] < t:             # scale the smaller of Q and the scores
        scores = xp.matmul(q * scale, xp.swapaxes(k, -1, -2))
    else:
        scores = xp.matmul(q, xp.swapaxes(k, -1, -2))
        xp.multiply(scores, scale, out=scores)
    if causal:
        scores = xp.where(xp.triu(xp.ones((s, t), dtype=bool), k=1), -np.inf, scores)
    if mask is not None:
        if mask.dtype == np.bool_:
            scores = xp.where(mask, scores, -np.inf)
        else:
            xp.add(scores, mask.astype(scores.dtype, copy=False), out=scores)
    xp.subtract(scores, scores.max(axis=-1, keepdims=True), out=scores)
    xp.exp(scores, out=scores)
    xp.divide(scores, scores.sum(axis=-1, keepdims=True), out=scores)
    xp.matmul(scores, v, out=y)


# exp(s) for |s| <= this neither overflows nor leaves the normal float32 range,
# and a row of up to 2**30 such terms sums below float32's maximum.
_EXP_SAFE = 64.0


def _attention_blocks(q: Any, k: Any, v: Any, mask: Any, y: Any, scale: float,
                      causal: bool, block: int) -> None:
    """NumPy: one block of heads at a time (about ``block`` elements of scores, the
    plan's attention_block), every buffer reused (:class:`_AttentionBlocks`)."""
    _AttentionBlocks(q, k, v, mask, y, scale, causal, block)()


class _AttentionBlocks:
    """Attention over blocks of heads, its views and buffers made once.

    Per block: scores = (Q * scale) K^T (BLAS), + mask, exp, row sums as a GEMV
    with a ones vector, Y = exp(scores) V (BLAS), Y /= row sums (dividing the
    (S, Dv) output is cheaper than the (S, T) weights when Dv < T). The softmax
    shift is one scalar per block when the block's scores span little enough
    (two contiguous reductions, against a row-wise max and a broadcast subtract
    at ~7x their cost), else the row maximum. ``own``: buffers of its own instead
    of the thread's workspace, for a call kept beyond this one (a bound step, run
    with floating-point errors ignored by the program).
    """

    def __init__(self, q: Any, k: Any, v: Any, mask: Any, y: Any, scale: float,
                 causal: bool, block: int, own: bool = False) -> None:
        s, d, t, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
        batch = q.shape[:-2]
        heads = math.prod(batch)
        q3, k3, v3 = q.reshape(heads, s, d), k.reshape(heads, t, d), v.reshape(heads, t, dv)
        y3 = y.reshape(heads, s, dv)
        g = max(1, min(heads, block // max(1, s * t)))
        dt = q.dtype
        space = _OwnSpace() if own else workspace
        qs = space.empty(np, "attention.q", (g, s, d), dt)
        sc = space.empty(np, "attention.scores", (g, s, t), dt)
        sums = space.empty(np, "attention.sums", (g, s, 1), dt)
        self.ones = workspace.filled(np, "attention.ones", (t, 1), dt, 1.0)
        if own:
            self.ones = self.ones.copy()
        self.future = None if not causal else workspace.bound(
            np, ("attention.future", s, t), lambda: np.triu(np.ones((s, t), dtype=bool), k=1))
        self.masks = None if mask is None else _MaskBlocks(mask, batch, s, t, dt)
        self.scale = scale
        self.exp = _shifted_exp if own else _exp_shifted
        self.blocks = [(i, j, qs[:j - i], q3[i:j], k3[i:j].swapaxes(-1, -2), sc[:j - i],
                        sums[:j - i], v3[i:j], y3[i:j])
                       for i, j in _head_blocks(batch, g, per_last_axis=self.masks is not None)]

    def __call__(self) -> None:
        future, masks, ones, scale, exp = self.future, self.masks, self.ones, self.scale, self.exp
        for i, j, qs, q, kt, scores, rows, v, out in self.blocks:
            np.multiply(q, scale, out=qs)
            np.matmul(qs, kt, out=scores)
            if future is not None:
                np.copyto(scores, -np.inf, where=future)
            if masks is not None:
                masks.apply(scores, i, j)
            exp(scores)
            np.matmul(scores, ones, out=rows)
            np.matmul(scores, v, out=out)
            np.divide(out, rows, out=out)


class _OwnSpace:
    """``workspace.empty``'s signature over fresh arrays."""

    @staticmethod
    def empty(xp: Any, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        return xp.empty(shape, dtype=dtype)


def _native_attention(q: Any, k: Any) -> bool:
    """Whether the native attention takes Q and K (the planner's size rule, float32, the
    native tier loaded)."""
    return (q.dtype == np.float32 and planner.attention_native(q.shape[-2] * k.shape[-2])
            and native_gemm.available() and fastmath.available())


def _attention_native(q: Any, k: Any, v: Any, mask: Any, y: Any, scale: float, causal: bool,
                      block: int, threads: int) -> bool:
    """float32 on the native kernels, split over batch x heads on keel's threads: each
    thread takes whole heads through every step (gemm.c's keel_attention_f32: scores =
    scale * Q K^T on the native GEMM into its own scratch, the masks, the row softmax,
    Y = P V), so a head's scores never leave the core that made them. Every head is
    computed the same way whatever the split: the same bits on any thread count. Where
    that kernel cannot take the operands, blocks of heads step by step
    (:func:`_attention_steps`). False (nothing written) where the native tier does not
    serve it."""
    if not _native_attention(q, k):
        return False
    s, d, t, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    batch = q.shape[:-2]
    heads = math.prod(batch)
    q3, k3, v3 = q.reshape(heads, s, d), k.reshape(heads, t, d), v.reshape(heads, t, dv)
    y3 = y.reshape(heads, s, dv)
    if _attention_whole_heads(q3, k3, v3, mask, y3, batch, scale, causal, threads):
        return True
    _attention_steps(q3, k3, v3, mask, y3, batch, scale, causal, block, threads)
    return True


def _attention_whole_heads(q3: Any, k3: Any, v3: Any, mask: Any, y3: Any,
                           batch: tuple[int, ...], scale: float, causal: bool,
                           threads: int) -> bool:
    """Whole heads per thread (see :func:`_attention_native`); False when not served."""
    call = _whole_heads_call(q3, k3, v3, mask, y3, batch, scale, causal, threads)
    if call is None:
        return False
    call.run()
    return True


def _whole_heads_call(q3: Any, k3: Any, v3: Any, mask: Any, y3: Any, batch: tuple[int, ...],
                      scale: float, causal: bool, threads: int,
                      own: bool = False) -> native_gemm.AttentionCall | None:
    """gemm.c's attention over heads (or blocks of their rows: planner.attention_split)
    prepared for these arrays; None where it cannot take them. ``own``: a scores template
    of its own rather than the thread's workspace, for a call kept beyond this one."""
    heads, s, t = q3.shape[0], q3.shape[1], k3.shape[1]
    softmax = fastmath.softmax_kernel()
    m4 = None if mask is None else _row_mask(mask, batch, s, t)
    layout = fastmath.mask_layout(m4, heads, s, t)
    if softmax is None or layout is None:
        return None
    # Only the scores' layout matters: gemm.c rebinds them to each thread's scratch.
    one = np.empty((s, t), q3.dtype) if own else \
        workspace.empty(np, "attention.head_scores", (s, t), q3.dtype)
    scores = np.lib.stride_tricks.as_strided(one, (heads, s, t), (0, *one.strides))
    qk = native_gemm.prepare(q3, k3.swapaxes(-1, -2), scores, alpha=scale)
    pv = native_gemm.prepare(scores, v3, y3)
    if qk is None or pv is None:
        return None
    return native_gemm.prepare_attention(qk, pv, s, t, m4, layout, causal, softmax,
                                         planner.attention_split(heads, s, threads))


def _attention_steps(q3: Any, k3: Any, v3: Any, mask: Any, y3: Any, batch: tuple[int, ...],
                     scale: float, causal: bool, block: int, threads: int) -> None:
    """Per block of heads, the products and the softmax each split over the threads (the
    heads of a block divided among them); each thread's share of a block is about
    ``block`` elements of scores."""
    heads, s, t = q3.shape[0], q3.shape[1], k3.shape[1]
    g = planner.attention_heads(block, s * t, heads, threads)
    sc = workspace.empty(np, "attention.native_scores", (g, s, t), q3.dtype)
    future = None if not causal else workspace.bound(
        np, ("attention.future", s, t), lambda: np.triu(np.ones((s, t), dtype=bool), k=1))
    masks = None if mask is None else _MaskBlocks(mask, batch, s, t, q3.dtype)
    for i, j in _head_blocks(batch, g, per_last_axis=masks is not None):
        scores = sc[:j - i]
        _native_product(q3[i:j], k3[i:j].swapaxes(-1, -2), scores, scale, threads)
        if future is not None:
            np.copyto(scores, -np.inf, where=future)
        if masks is not None:
            masks.apply(scores, i, j)
        rows = scores.reshape(-1, t)
        if not fastmath.softmax(rows, rows, "softmax", threads):
            _softmax_numpy(scores)
        _native_product(scores, v3[i:j], y3[i:j], 1.0, threads)


def _native_product(a: Any, b: Any, c: Any, alpha: float, threads: int) -> None:
    """c = alpha * a @ b (batched) on the native GEMM; NumPy where it does not serve."""
    call = native_gemm.prepare(a, b, c, alpha=alpha)
    if call is not None:
        call.run(threads)
        return
    np.matmul(a, b, out=c)
    if alpha != 1.0:
        c *= c.dtype.type(alpha)


def _softmax_numpy(scores: Any) -> None:
    """Row softmax in place (an all -inf row gives NaN, as the reference's does)."""
    with np.errstate(invalid="ignore"):
        np.subtract(scores, scores.max(axis=-1, keepdims=True), out=scores)
        np.exp(scores, out=scores)
        np.divide(scores, scores.sum(axis=-1, keepdims=True), out=scores)


def _head_blocks(batch: tuple[int, ...], g: int,
                 per_last_axis: bool) -> Iterator[tuple[int, int]]:
    """[i, j) ranges of flattened heads, at most ``g`` long; with ``per_last_axis``
    no range crosses a step of the batch dimensions before the last one (so a
    block's mask is a plain slice of the broadcast mask)."""
    heads = math.prod(batch)
    inner = batch[-1] if per_last_axis else heads
    for start in range(0, heads, inner):
        for i in range(start, start + inner, g):
            yield i, min(i + g, start + inner)


class _MaskBlocks:
    """The mask of a block of heads, as a broadcast view of the caller's mask."""

    def __init__(self, mask: Any, batch: tuple[int, ...], s: int, t: int, dt: Any) -> None:
        self.boolean = mask.dtype == np.bool_
        # A boolean mask keeps True = attend: hide the rest. Computed at the mask's
        # own (unbroadcast) size.
        base = np.logical_not(mask) if self.boolean else mask.astype(dt, copy=False)
        self.inner = batch[-1]
        outer = math.prod(batch[:-1])
        self.full = np.broadcast_to(base, (*batch, s, t)).reshape(outer, self.inner, s, t)

    def apply(self, scores: Any, i: int, j: int) -> None:
        o, h = divmod(i, self.inner)
        piece = self.full[o, h:h + (j - i)]
        if self.boolean:
            np.copyto(scores, -np.inf, where=piece)
        else:
            np.add(scores, piece, out=scores)


def _exp_shifted(scores: Any) -> None:
    """exp(scores - shift) in place, with a shift that keeps every row's sum finite
    and nonzero (a row of -inf gives nan, as the reference's max-subtraction does)."""
    with np.errstate(invalid="ignore", over="ignore"):
        _shifted_exp(scores)


def _shifted_exp(scores: Any) -> None:
    """:func:`_exp_shifted` for a caller that has floating-point errors ignored already
    (a bound step: the program ignores them around the run)."""
    flat = scores.reshape(-1)
    hi, lo = float(np.maximum.reduce(flat)), float(np.minimum.reduce(flat))
    if lo >= -_EXP_SAFE and hi <= _EXP_SAFE:
        pass                                   # exp cannot overflow nor underflow
    elif hi - lo <= 2 * _EXP_SAFE:
        np.subtract(scores, scores.dtype.type((hi + lo) / 2), out=scores)
    else:                                      # wide spread, inf or nan: per row
        np.subtract(scores, scores.max(axis=-1, keepdims=True), out=scores)
    np.exp(scores, out=scores)
