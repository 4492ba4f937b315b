"""cpu kernels of the elementwise family, written once against ``ctx.xp``.

Every kernel computes in its input dtype straight into the output buffer
(``out=``); a composite activation adds at most one scratch array of the
output's size (and, for the piecewise ones, a boolean mask). An
output may alias input 0 (the schemas declare ``inplace=((0, 0),)``), so a
kernel never reads ``x`` after writing the output unless that is safe
elementwise. Only array-API calls that CuPy shares are used on arrays.

``erf`` evaluates float64 in float64 (a few ulp) and float16/float32 in
float32 within 1e-6 relative; GELU (float16/32) is the fused-epilogue GELU of
``keel.ops.epilogue``.

With the native tier (``keel.backends.cpu.fastmath``), float32 Erf, Gelu,
Sigmoid and Swish run as one compiled pass instead (a few ulp; 2-7x faster, see
``_NATIVE`` for the measurements), whatever the layout, so a result's bits never
depend on it; everything else, and the gpu backend, runs the NumPy code below.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Bind, KernelContext
from keel.backends.cpu import fastmath, planner, workspace
from keel.backends.cpu.kernels import TABLE
from keel.errors import InvalidArgumentError
from keel.ops.epilogue import apply_activation, normal_tail
from keel.ops.registry import Op
from keel.ops.schemas.elementwise import DTYPES, check_choices
from keel.ops.types import broadcast_shapes

__all__ = ["destination", "erf", "host_value"]

Attrs = Mapping[str, Any]
Impl = Callable[[Any, Any, Any, Attrs], Any]        # (xp, x, out, attrs) -> writes out


def destination(xp: Any, out: Sequence[Any] | None, shape: Sequence[Any], dtype: Any) -> Any:
    """The caller's output buffer, or a fresh uninitialised one."""
    return out[0] if out is not None else xp.empty(tuple(shape), dtype=dtype)


def host_value(array: Any) -> np.ndarray:
    """A small device array (axes, bounds) as a NumPy array on the host."""
    get = getattr(array, "get", None)          # CuPy arrays copy to the host with .get()
    return np.asarray(get() if callable(get) else array)


def _aliases(xp: Any, a: Any, b: Any) -> bool:
    return bool(xp.may_share_memory(a, b))


# ---- erf ------------------------------------------------------------------------
# |x| < _ERF_SPLIT: erf(x) = x * p(x**2), p the Taylor series of erf(x)/x in x**2
# economized (Chebyshev-truncated) on [0, _ERF_SPLIT**2].
# |x| >= _ERF_SPLIT: erf = 1 - exp(-x**2) * g(1/x) / x, where g(s) = x e^{x^2} erfc(x)
# is smooth in s = 1/x; g is a Chebyshev interpolant on s in [1/6, 1/_ERF_SPLIT],
# built from math.erfc at its nodes. For |x| >= 6, erfc(x) < 2.2e-17: erf is 1.
# Both are derived here rather than pasted as constants. Degrees: (13, 18) give
# float64 within ~2 ulp; (8, 10) give 1e-10, enough below float32's rounding.
_ERF_SPLIT = 1.25
_ERF_S_LO, _ERF_S_HI = 1.0 / 6.0, 1.0 / _ERF_SPLIT


@functools.cache
def _erf_near(degree: int, split: float = _ERF_SPLIT) -> tuple[float, ...]:
    from numpy.polynomial import chebyshev, polynomial  # derived on first use

    terms = [2.0 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1))
             for n in range(30)]                  # the Taylor series, past float64's reach
    domain = [0.0, split**2]
    cheb: Any = polynomial.Polynomial(terms).convert(kind=chebyshev.Chebyshev, domain=domain)
    truncated: Any = chebyshev.Chebyshev(cheb.coef[:degree + 1], domain=domain)
    return tuple(float(c) for c in truncated.convert(kind=polynomial.Polynomial).coef)


@functools.cache
def _erf_tail(degree: int) -> tuple[float, ...]:
    """Power-series coefficients, in u in [-1, 1] mapping s, of the tail's g."""
    from numpy.polynomial import chebyshev

    def g(u: np.ndarray) -> np.ndarray:
        x = 1.0 / ((u + 1.0) / 2.0 * (_ERF_S_HI - _ERF_S_LO) + _ERF_S_LO)
        return np.array([math.erfc(v) * math.exp(v * v) * v for v in x.tolist()])
    interpolate: Any = chebyshev.chebinterpolate      # numpy's stubs want scalar functions
    return tuple(float(c) for c in chebyshev.cheb2poly(interpolate(g, degree)))


# float16 and float32 are evaluated in float32 (float16 through a float32 copy):
#   |x| < 0.5:  erf(x) = x * p(x**2), p the economized Taylor series of degree 5
#               (truncation below 3e-8 relative);
#   otherwise:  erf(x) = sign(x) * (1 - 2 Phi(-sqrt(2) |x|)), with the normal tail
#               Phi(-a) of keel.ops.epilogue (the fit GELU uses), where erf >= 0.52
#               so the fit's 1.2e-7 relative error on erfc stays below it on erf.
# Relative error below 1e-6 against float64 (a few float32 roundings), at about a
# quarter of the cost of evaluating in float64.
_ERF32_SPLIT = 0.5


def _horner(xp: Any, t: Any, coefs: Sequence[float], acc: Any) -> Any:
    acc.fill(coefs[-1])
    for c in reversed(coefs[:-1]):
        acc *= t
        acc += c
    return acc


def erf(xp: Any, x: Any, out: Any) -> Any:
    """The error function of ``x`` into ``out`` (which may be ``x``).

    float64 is evaluated in float64 within a few ulp; float32 and float16 in
    float32 within 1e-6 relative (see the notes above).
    """
    if x.dtype == np.float64:
        block = _erf64
    elif x.dtype == np.float32:
        block = _erf32
    else:
        wide = x.astype(xp.float32)
        erf(xp, wide, wide)
        xp.copyto(out, wide, casting="same_kind")
        return out
    if out.dtype != x.dtype:                 # the blocks write out's bits as x's dtype
        xp.copyto(out, erf(xp, x, xp.empty_like(x)), casting="same_kind")
        return out
    if xp is not np or x.size <= planner.ERF_BLOCK_ELEMENTS or not (out.flags.c_contiguous
                                                     and x.flags.c_contiguous):
        return block(xp, x, out)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat_x.shape[0], planner.ERF_BLOCK_ELEMENTS):
        part = slice(start, start + planner.ERF_BLOCK_ELEMENTS)
        block(xp, flat_x[part], flat_out[part])
    return out


def _erf64(xp: Any, x: Any, out: Any) -> Any:
    return _erf(xp, x, out, (_erf_near(13), _erf_tail(18)))


def _erf32(xp: Any, x: Any, out: Any) -> Any:
    """float32 erf of one block (see the notes above); scratch buffers are reused.

    The branch choice and the sign go through the float bits: NumPy's masked
    ``copyto`` and ``copysign`` cost 150 us and 36 us per 64 Ki elements here,
    the integer passes replacing them ~5 us each.
    """
    shape = x.shape
    a, q, u, w = (workspace.empty(xp, ("erf32", slot), shape, xp.float32) for slot in range(4))
    near = workspace.empty(xp, "erf32.near", shape, xp.int32)
    qi, ui, wi = q.view(xp.int32), u.view(xp.int32), w.view(xp.int32)
    xp.abs(x, out=a)
    xp.less(a, _ERF32_SPLIT, out=near)
    xp.negative(near, out=near)                         # all bits set where |x| < split
    xp.multiply(a, math.sqrt(2.0), out=a)
    normal_tail(xp, a, q, u, w)
    xp.multiply(q, -2.0, out=q)
    xp.add(q, 1.0, out=q)                               # erf(|x|) for |x| >= split
    xp.bitwise_and(x.view(xp.int32), _SIGN_BIT, out=wi)
    xp.bitwise_or(qi, wi, out=qi)                       # with the sign of x
    xp.multiply(x, x, out=w)
    _horner(xp, w, _erf_near(5, _ERF32_SPLIT), u)
    xp.multiply(u, x, out=u)                            # erf(x) for |x| < split
    xp.bitwise_xor(ui, qi, out=ui)                      # q ^ ((q ^ u) & near): u or q
    xp.bitwise_and(ui, near, out=ui)
    xp.bitwise_xor(ui, qi, out=out.view(xp.int32))
    return out


_SIGN_BIT = np.int32(-2**31)


def _erf(xp: Any, x: Any, out: Any, coefs: tuple[Sequence[float], Sequence[float]]) -> Any:
    near_coefs, tail_coefs = coefs
    a = x.astype(xp.float64)
    xp.abs(a, out=a)
    small = xp.minimum(a, _ERF_SPLIT)
    t = small * small
    near = _horner(xp, t, near_coefs, xp.empty_like(a))
    near *= small                                       # erf(|x|) for |x| < split
    xp.clip(a, _ERF_SPLIT, 6.0, out=small)              # the tail's argument
    xp.reciprocal(small, out=t)                         # s = 1 / x
    u = (2.0 * t - (_ERF_S_LO + _ERF_S_HI)) * (1.0 / (_ERF_S_HI - _ERF_S_LO))
    far = _horner(xp, u, tail_coefs, u.copy())
    far *= t
    xp.multiply(small, small, out=small)
    xp.negative(small, out=small)
    xp.exp(small, out=small)
    far *= small
    xp.subtract(1.0, far, out=far)                      # erf(|x|) for |x| >= split
    far = xp.where(a < _ERF_SPLIT, near, far)
    xp.copysign(far, x, out=far)
    xp.copyto(out, far, casting="same_kind")
    return out


# ---- unary ------------------------------------------------------------------------
def _ufunc(name: str) -> Impl:
    return lambda xp, x, d, a: getattr(xp, name)(x, out=d)


def _scratch(xp: Any, d: Any) -> Any:
    return xp.empty(d.shape, dtype=d.dtype)


def _sigmoid(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    xp.negative(x, out=d)
    xp.exp(d, out=d)
    d += 1
    xp.reciprocal(d, out=d)


def _swish(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    s = xp.multiply(x, -a["alpha"], out=_scratch(xp, d))
    xp.exp(s, out=s)
    s += 1
    xp.divide(x, s, out=d)


def _gelu(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    if a["approximate"] == "none" and x.dtype == np.float64:
        # float64 keeps its precision: erf to a few ulp (the epilogue's fit: 1.2e-7).
        s = xp.multiply(x, 1.0 / math.sqrt(2.0), out=_scratch(xp, d))
        erf(xp, s, s)
        s += 1
        s *= 0.5
        xp.multiply(x, s, out=d)
        return
    # float16/32: the fused-epilogue GELU, exact form without cancellation
    # (relative error below 1e-6 for x >= -4 in float32), or the tanh form.
    apply_activation(xp, x, "gelu_tanh" if a["approximate"] == "tanh" else "gelu", (), out=d)


def _elu(xp: Any, x: Any, d: Any, alpha: float, gamma: float = 1.0) -> None:
    # max(x, 0) + alpha * expm1(min(x, 0)): one formula for both branches.
    s = xp.minimum(x, 0, out=_scratch(xp, d))
    xp.expm1(s, out=s)
    s *= alpha
    xp.maximum(x, 0, out=d)
    d += s
    if gamma != 1.0:
        d *= gamma


def _celu(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    s = xp.divide(x, a["alpha"], out=_scratch(xp, d))
    xp.expm1(s, out=s)
    s *= a["alpha"]
    xp.minimum(s, 0, out=s)
    xp.maximum(x, 0, out=d)
    d += s


def _leaky_relu(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    s = xp.minimum(x, 0, out=_scratch(xp, d))
    s *= a["alpha"]
    xp.maximum(x, 0, out=d)
    d += s


def _hard_sigmoid(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    xp.multiply(x, a["alpha"], out=d)
    d += a["beta"]
    xp.clip(d, 0, 1, out=d)


def _hard_swish(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    s = xp.divide(x, 6, out=_scratch(xp, d))
    s += 0.5
    xp.clip(s, 0, 1, out=s)
    xp.multiply(x, s, out=d)


def _softsign(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    s = xp.abs(x, out=_scratch(xp, d))
    s += 1
    xp.divide(x, s, out=d)


def _mish(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    s = xp.logaddexp(x, 0, out=_scratch(xp, d))
    xp.tanh(s, out=s)
    xp.multiply(x, s, out=d)


def _thresholded_relu(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    drop = xp.greater(x, a["alpha"])
    xp.logical_not(drop, out=drop)                          # NaN is dropped too
    if not _aliases(xp, d, x):
        xp.copyto(d, x)
    xp.copyto(d, 0, where=drop)


def _shrink(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    if d.dtype.kind != "f":
        # Integers: float bias, then truncation back (ONNX computes the same way).
        wide = xp.empty(d.shape, dtype=xp.float64)
        _shrink(xp, x.astype(xp.float64), wide, a)
        xp.copyto(d, wide, casting="unsafe")
        return
    low, high = xp.less(x, -a["lambd"]), xp.greater(x, a["lambd"])
    s = xp.subtract(x, a["bias"], out=_scratch(xp, d))
    xp.add(x, a["bias"], out=d)
    xp.copyto(d, s, where=high)
    xp.copyto(d, 0, where=xp.logical_not(xp.logical_or(low, high, out=low), out=low))


_UNARY: dict[Op, Impl] = {
    Op.RELU: lambda xp, x, d, a: (xp.clip(x, 0, xp.inf, out=d) if x.dtype.kind == "f"
                                  else xp.maximum(x, 0, out=d)),
    Op.NEG: _ufunc("negative"),
    Op.ABS: _ufunc("abs"),
    Op.SIGN: _ufunc("sign"),
    Op.EXP: _ufunc("exp"),
    Op.LOG: _ufunc("log"),
    Op.SQRT: _ufunc("sqrt"),
    Op.TANH: _ufunc("tanh"),
    Op.SIGMOID: _sigmoid,
    Op.RECIPROCAL: _ufunc("reciprocal"),
    Op.FLOOR: _ufunc("floor"),
    Op.CEIL: _ufunc("ceil"),
    Op.ROUND: _ufunc("rint"),                 # half to even
    Op.SIN: _ufunc("sin"),
    Op.COS: _ufunc("cos"),
    Op.TAN: _ufunc("tan"),
    Op.ASIN: _ufunc("arcsin"),
    Op.ACOS: _ufunc("arccos"),
    Op.ATAN: _ufunc("arctan"),
    Op.SINH: _ufunc("sinh"),
    Op.COSH: _ufunc("cosh"),
    Op.ASINH: _ufunc("arcsinh"),
    Op.ACOSH: _ufunc("arccosh"),
    Op.ATANH: _ufunc("arctanh"),
    Op.ERF: lambda xp, x, d, a: erf(xp, x, d),
    Op.NOT: _ufunc("logical_not"),
    Op.BITWISE_NOT: _ufunc("invert"),
    Op.LEAKY_RELU: _leaky_relu,
    Op.HARD_SIGMOID: _hard_sigmoid,
    Op.HARD_SWISH: _hard_swish,
    Op.GELU: _gelu,
    Op.ELU: lambda xp, x, d, a: _elu(xp, x, d, a["alpha"]),
    Op.SELU: lambda xp, x, d, a: _elu(xp, x, d, a["alpha"], a["gamma"]),
    Op.CELU: _celu,
    Op.SOFTPLUS: lambda xp, x, d, a: xp.logaddexp(x, 0, out=d),
    Op.SOFTSIGN: _softsign,
    Op.THRESHOLDED_RELU: _thresholded_relu,
    Op.SHRINK: _shrink,
    Op.MISH: _mish,
    Op.SWISH: _swish,
    Op.ISNAN: _ufunc("isnan"),
}


# Ops with a native float32 form: (fastmath kernel name, alpha) from the attributes,
# and the single-op measurement behind the variant: (4096, 1024) float32, 1 thread,
# medians of interleaved runs on the 2-core AVX-512 development machine.
NativeForm = Callable[[Attrs], tuple[str, float]]
_NATIVE: dict[Op, tuple[NativeForm, str]] = {
    Op.ERF: (lambda a: ("erf", 1.0),
             "(4096, 1024) f32, 1 thread: 21.3 ms NumPy, 2.9 ms native, 2.2 ms onnxruntime"),
    Op.GELU: (lambda a: ("gelu_tanh" if a["approximate"] == "tanh" else "gelu", 1.0),
              "(4096, 1024) f32, 1 thread: exact 13.1 ms NumPy, 2.8 ms native, 3.2 ms "
              "onnxruntime; tanh 5.9 ms NumPy, 2.1 ms native, 2.7 ms onnxruntime"),
    Op.SIGMOID: (lambda a: ("sigmoid", 1.0),
                 "(4096, 1024) f32, 1 thread: 3.9 ms NumPy, 1.6 ms native, "
                 "1.3 ms onnxruntime"),
    Op.SWISH: (lambda a: ("silu", float(a["alpha"])),
               "(4096, 1024) f32, 1 thread: 4.8 ms NumPy, 1.9 ms native"),
}


def _native_unary(form: tuple[str, float], x: Any, d: Any, threads: int | None) -> bool:
    """The native kernel for float32, whatever the layout: a strided input is copied
    (one pass) so that the result's bits never depend on the layout."""
    if x.dtype != np.float32 or d.dtype != np.float32:
        return False
    name, alpha = form
    src = x if x.flags.c_contiguous else np.ascontiguousarray(x)
    if d.flags.c_contiguous:
        return fastmath.unary(name, src, d, alpha, threads)
    staged = np.empty(d.shape, np.float32)
    if not fastmath.unary(name, src, staged, alpha, threads):
        return False
    d[...] = staged
    return True


def _unary_kernel(op: Op, impl: Impl, result: Any = None) -> Callable[..., list[Any]]:
    native_form = _NATIVE[op][0] if op in _NATIVE else None

    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        check_choices(op, attrs)
        x = inputs[0]
        d = destination(ctx.xp, out, x.shape, result or x.dtype)
        if (native_form is not None and ctx.xp is np
                and _native_unary(native_form(attrs), x, d, ctx.threads)):
            return [d]
        with np.errstate(all="ignore"):
            if x.ndim == 0:         # ufuncs turn 0-d results into scalars: run as (1,)
                impl(ctx.xp, x.reshape(1), d.reshape(1), attrs)
            else:
                impl(ctx.xp, x, d, attrs)
        return [d]
    return kernel


def _isinf(xp: Any, x: Any, d: Any, a: Attrs) -> None:
    if a["detect_positive"] and a["detect_negative"]:
        xp.isinf(x, out=d)
    elif a["detect_positive"] or a["detect_negative"]:
        xp.equal(x, math.inf if a["detect_positive"] else -math.inf, out=d)
    else:
        d.fill(False)


def _bound(xp: Any, inputs: Sequence[Any], index: int, attrs: Attrs, name: str,
           dtype: Any) -> Any:
    """Clip's bound ``name`` from input ``index`` or the attribute, in ``dtype``."""
    given = inputs[index] if len(inputs) > index else None
    if given is not None and attrs.get(name) is not None:
        raise InvalidArgumentError(
            f"clip got its {name} twice: as input {index} and as attribute {name!r}"
        )
    if given is not None:
        if given.size != 1:
            raise InvalidArgumentError(
                f"clip input {index} ({name}) must hold one element, got shape {given.shape}"
            )
        return given.reshape(()).astype(dtype, copy=False)
    if attrs.get(name) is None:
        return None
    value = float(attrs[name])
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return xp.asarray(int(min(max(value, float(info.min)), float(info.max))), dtype=dtype)
    return xp.asarray(value, dtype=dtype)


def _clip(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
          out: Sequence[Any] | None) -> list[Any]:
    xp, x = ctx.xp, inputs[0]
    lo = _bound(xp, inputs, 1, attrs, "min", x.dtype)
    hi = _bound(xp, inputs, 2, attrs, "max", x.dtype)
    d = destination(xp, out, x.shape, x.dtype)
    if lo is not None:
        xp.maximum(x, lo, out=d)
    elif not _aliases(xp, d, x):
        xp.copyto(d, x)
    if hi is not None:
        xp.minimum(d, hi, out=d)
    return [d]


def _unary_bind(op: Op, impl: Impl) -> Bind:
    """The unary kernel's call for one program step (``KernelVariant.bind``): the native
    pass or the NumPy code the kernel would run, checked once."""
    native_form = _NATIVE[op][0] if op in _NATIVE else None

    def bind(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
             out: Sequence[Any]) -> Callable[[], object] | None:
        check_choices(op, attrs)
        x, d = inputs[0], out[0]
        if ctx.xp is not np or x.ndim == 0 or d.shape != x.shape:
            return None
        if native_form is not None and x.dtype == np.float32 and d.dtype == np.float32:
            name, alpha = native_form(attrs)
            return fastmath.bound_unary(name, x, d, alpha, ctx.threads) \
                if x.flags.c_contiguous and d.flags.c_contiguous else None
        return functools.partial(impl, np, x, d, attrs)
    return bind


for _op, _impl in _UNARY.items():
    _result = np.bool_ if _op is Op.ISNAN else None
    _kernel = _unary_kernel(_op, _impl, _result)
    _bind = _unary_bind(_op, _impl)
    TABLE.kernel(_op, dtypes=DTYPES[_op], supports_out=True, bind=_bind)(_kernel)
    if _op in _NATIVE:
        # The same entry point: it takes the native path whenever it serves the case.
        TABLE.kernel(_op, variant="native", dtypes=("float32",), supports_out=True,
                     requires="native", priority=1, simd=(), shapes="float32, any shape",
                     measured=_NATIVE[_op][1], bind=_bind)(_kernel)
TABLE.kernel(Op.ISINF, dtypes=DTYPES[Op.ISINF], supports_out=True)(
    _unary_kernel(Op.ISINF, _isinf, np.bool_))
TABLE.kernel(Op.CLIP, dtypes=DTYPES[Op.CLIP], supports_out=True)(_clip)


# ---- binary ----------------------------------------------------------------------
BinaryImpl = Callable[[Any, Any, Any, Any, Attrs], Any]   # (xp, a, b, out, attrs)


class _BinaryUfunc:
    """A binary op that is one NumPy/CuPy ufunc call (bindable to its operands)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, xp: Any, a: Any, b: Any, d: Any, attrs: Attrs) -> Any:
        return getattr(xp, self.name)(a, b, out=d)


def _binary_ufunc(name: str) -> BinaryImpl:
    return _BinaryUfunc(name)


def _div(xp: Any, a: Any, b: Any, d: Any, attrs: Attrs) -> None:
    if d.dtype.kind == "f":
        xp.divide(a, b, out=d)
        return
    # Truncating integer division: (a - fmod(a, b)) is an exact multiple of b.
    rest = xp.fmod(a, b)
    xp.subtract(a, rest, out=d)
    xp.floor_divide(d, b, out=d)


def _pow(xp: Any, a: Any, b: Any, d: Any, attrs: Attrs) -> None:
    if d.dtype.kind == "f":
        xp.power(a, b.astype(d.dtype, copy=False), out=d)
    elif b.dtype.kind == "f":
        wide = xp.power(a.astype(xp.float64), b.astype(xp.float64))
        xp.copyto(d, wide, casting="unsafe")            # truncates toward zero (ONNX)
    else:
        negative = b < 0
        inverse = None
        if bool(negative.any()):
            # a ** -n truncated toward zero: ±1 for |a| == 1, else 0. Computed
            # before d is written: d may be a's buffer.
            one = xp.abs(a) == 1
            inverse = xp.where(one, xp.where(b % 2 == 0, 1, a), 0).astype(d.dtype)
        xp.power(a, xp.maximum(b, 0).astype(d.dtype), out=d)
        if inverse is not None:
            xp.copyto(d, inverse, where=negative)


def _mod(xp: Any, a: Any, b: Any, d: Any, attrs: Attrs) -> None:
    (xp.fmod if attrs["fmod"] == 1 else xp.remainder)(a, b, out=d)


def _bit_shift(xp: Any, a: Any, b: Any, d: Any, attrs: Attrs) -> None:
    bits = a.dtype.itemsize * 8
    invalid = xp.logical_or(b < 0, b >= bits)
    shift = xp.where(invalid, 0, b).astype(a.dtype)
    if attrs["direction"] == "LEFT":
        # Shift the unsigned bit pattern: bits past the sign bit are dropped.
        unsigned = np.dtype(f"u{a.dtype.itemsize}")
        xp.left_shift(a.view(unsigned), shift.view(unsigned), out=d.view(unsigned))
        xp.copyto(d, 0, where=invalid)
        return
    fill = xp.right_shift(a, bits - 1) if a.dtype.kind == "i" else 0   # sign extension
    xp.right_shift(a, shift, out=d)
    xp.copyto(d, fill, where=invalid)


def _prelu(xp: Any, x: Any, slope: Any, d: Any, attrs: Attrs) -> None:
    # max(x, 0) + slope * min(x, 0); slope broadcasts to X.
    s = xp.minimum(x, 0)
    s *= slope
    xp.maximum(x, 0, out=d)
    d += s


_BINARY: dict[Op, BinaryImpl] = {
    Op.ADD: _binary_ufunc("add"),
    Op.SUB: _binary_ufunc("subtract"),
    Op.MUL: _binary_ufunc("multiply"),
    Op.DIV: _div,
    Op.POW: _pow,
    Op.MOD: _mod,
    Op.EQUAL: _binary_ufunc("equal"),
    Op.LESS: _binary_ufunc("less"),
    Op.LESS_EQUAL: _binary_ufunc("less_equal"),
    Op.GREATER: _binary_ufunc("greater"),
    Op.GREATER_EQUAL: _binary_ufunc("greater_equal"),
    Op.AND: _binary_ufunc("logical_and"),
    Op.OR: _binary_ufunc("logical_or"),
    Op.XOR: _binary_ufunc("logical_xor"),
    Op.BITWISE_AND: _binary_ufunc("bitwise_and"),
    Op.BITWISE_OR: _binary_ufunc("bitwise_or"),
    Op.BITWISE_XOR: _binary_ufunc("bitwise_xor"),
    Op.BIT_SHIFT: _bit_shift,
    Op.PRELU: _prelu,
}
_PREDICATES = frozenset({Op.EQUAL, Op.LESS, Op.LESS_EQUAL, Op.GREATER, Op.GREATER_EQUAL})


def _binary_kernel(op: Op, impl: BinaryImpl) -> Callable[..., list[Any]]:
    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        check_choices(op, attrs)
        a, b = inputs[0], inputs[1]
        if b.dtype != a.dtype and op is not Op.POW:
            b = b.astype(a.dtype)
        shape = _broadcast(a.shape, b.shape)
        d = destination(ctx.xp, out, shape, np.bool_ if op in _PREDICATES else a.dtype)
        with np.errstate(all="ignore"):
            if d.ndim == 0:         # as for unary ops: rank 0 runs as one element
                impl(ctx.xp, a.reshape(1), b.reshape(1), d.reshape(1), attrs)
            else:
                impl(ctx.xp, a, b, d, attrs)
        return [d]
    return kernel


def _binary_bind(op: Op, impl: BinaryImpl) -> Bind | None:
    """A one-ufunc binary op's call for one program step (``KernelVariant.bind``)."""
    if not isinstance(impl, _BinaryUfunc):
        return None
    ufunc = getattr(np, impl.name)

    def bind(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
             out: Sequence[Any]) -> Callable[[], object] | None:
        check_choices(op, attrs)
        a, b, d = inputs[0], inputs[1], out[0]
        if (ctx.xp is not np or a.dtype != b.dtype or d.ndim == 0
                or tuple(broadcast_shapes(a.shape, b.shape)) != d.shape):
            return None
        return functools.partial(ufunc, a, b, out=d)
    return bind


@functools.lru_cache(maxsize=512)
def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[Any, ...]:
    """The broadcast shape of two operands, checked once per pair of shapes."""
    return tuple(broadcast_shapes(a, b))


def _variadic(name: str) -> Callable[..., list[Any]]:
    """``name`` folded over the inputs left to right into one output (Max, Min, Sum)."""
    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
               out: Sequence[Any] | None) -> list[Any]:
        xp, first = ctx.xp, inputs[0]
        fn = getattr(xp, name)                          # NaN propagates
        shape = broadcast_shapes(*(x.shape for x in inputs))
        d = destination(xp, out, shape, first.dtype)
        if len(inputs) == 1:
            xp.copyto(d, first)
            return [d]
        fn(first, inputs[1].astype(first.dtype, copy=False), out=d)
        for x in inputs[2:]:
            fn(d, x.astype(first.dtype, copy=False), out=d)
        return [d]
    return kernel


def _where(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
           out: Sequence[Any] | None) -> list[Any]:
    xp, (cond, x, y) = ctx.xp, inputs
    d = destination(xp, out, broadcast_shapes(cond.shape, x.shape, y.shape), x.dtype)
    if _aliases(xp, d, x):               # output reuses X (inplace): only Y moves
        xp.copyto(d, y, where=xp.logical_not(cond), casting="unsafe")
    else:
        xp.copyto(d, y, casting="unsafe")
        xp.copyto(d, x, where=cond)
    return [d]


def _bind_where(ctx: KernelContext, inputs: Sequence[Any], attrs: Attrs,
                out: Sequence[Any]) -> Callable[[], object] | None:
    """Where's two copies for one program step (``KernelVariant.bind``)."""
    (cond, x, y), d = inputs, out[0]
    if ctx.xp is not np or tuple(broadcast_shapes(cond.shape, x.shape, y.shape)) != d.shape:
        return None
    if _aliases(np, d, x):               # output reuses X (inplace): only Y moves
        def where_inplace() -> None:
            np.copyto(d, y, where=np.logical_not(cond), casting="unsafe")
        return where_inplace

    def where() -> None:
        np.copyto(d, y, casting="unsafe")
        np.copyto(d, x, where=cond)
    return where


for _op, _binary_impl in _BINARY.items():
    TABLE.kernel(_op, dtypes=DTYPES[_op], supports_out=True,
                 bind=_binary_bind(_op, _binary_impl))(_binary_kernel(_op, _binary_impl))
TABLE.kernel(Op.MAXIMUM, dtypes=DTYPES[Op.MAXIMUM], supports_out=True)(_variadic("maximum"))
TABLE.kernel(Op.MINIMUM, dtypes=DTYPES[Op.MINIMUM], supports_out=True)(_variadic("minimum"))
TABLE.kernel(Op.ADD_N, dtypes=DTYPES[Op.ADD_N], supports_out=True)(_variadic("add"))
TABLE.kernel(Op.WHERE, dtypes=DTYPES[Op.WHERE], supports_out=True, bind=_bind_where)(_where)
