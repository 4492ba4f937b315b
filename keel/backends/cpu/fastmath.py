"""Native float32 kernels for transformer layers (``keel/native/src/fastmath.c``).

NumPy evaluates a formula one operation at a time, each a pass over memory:
exact GELU is ~26 of them, LayerNorm ~8, softmax ~6. The native kernels read
every element once and write it once with the whole formula in registers.
Each wrapper here returns True when it computed the result and False when
the case is not served (the native tier unavailable, an array that is not a
C-contiguous NumPy float32 array, an activation without a native form); the
caller then runs its NumPy code, which the gpu backend and other dtypes use
anyway.

Accuracy against float64 math (10^7 random points; details in fastmath.c):
erf 2.4 ulp, exact GELU 6.2 ulp (4e-7 relative, mean 0.6 ulp), sigmoid 2.4 ulp,
silu 3.2 ulp, tanh GELU 2.8 ulp for x >= -1 and 2.5 (1 + |2u|) ulp below, where
the rounding of its cubic argument 2u dominates (1e-5 relative at x = -10, where
the result is ~1e-30). LayerNorm statistics and softmax sums accumulate in
float64.

Measured on the 2-core AVX-512 development machine, float32, 1 thread, medians
of interleaved runs (NumPy: keel's cpu kernel without this module):

===============================  =========  =========  ===========
op, shape                        NumPy      native     onnxruntime
===============================  =========  =========  ===========
Gelu (4096, 1024)                13.1 ms    2.8 ms     3.2 ms
Gelu tanh (4096, 1024)           5.9 ms     2.1 ms     2.7 ms
Erf (4096, 1024)                 21.3 ms    2.9 ms     2.2 ms
Sigmoid (4096, 1024)             3.9 ms     1.6 ms     1.3 ms
Swish (4096, 1024)               4.8 ms     1.9 ms
LayerNormalization (4096, 256)   1.24 ms    0.56 ms    0.58 ms
Add + LayerNorm (4096, 256)      0.67 ms*   0.55 ms    0.72 ms
Softmax (4096, 1024)             4.0 ms     2.2 ms     1.4 ms
Softmax (16384, 128)             2.0 ms     1.5 ms     0.9 ms
===============================  =========  =========  ===========

(*: NumPy's Add, then the native LayerNorm; the native column is the fused
``skip_layer_norm``, whose sum costs nothing beyond LayerNorm's own passes.)

Two threads run GELU and LayerNorm 1.9x faster than one. In BERT-mini (batch
32, 1 thread) LayerNorm drops from 12.0 to 5.5 ms, and the fused MatMul + GELU
epilogue through :func:`activation_inplace` from 33.3 to 24.1 ms per layer.

Work splits by elements or rows into chunks on keel's worker threads (each
kernel's ``*_mt`` entry point; :mod:`keel.native.pool`); every element is
computed by the same instructions wherever a chunk starts, so the result is
bitwise the same for any thread count.
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
from keel.backends.cpu import planner

__all__ = [
    "ACTIVATION_KINDS",
    "NATIVE_ACTIVATIONS",
    "SOFTMAX_MODES",
    "RowAttention",
    "activation_inplace",
    "attend_rows",
    "available",
    "bound_activation_inplace",
    "bias_activation_inplace",
    "bound_attend_rows",
    "bound_layer_norm",
    "bound_skip_layer_norm",
    "bound_softmax",
    "bound_unary",
    "layer_norm",
    "mask_layout",
    "row_attention",
    "serves",
    "skip_layer_norm",
    "softmax",
    "unary",
]

# The activation numbering of fastmath.c; "silu" is x * sigmoid(alpha * x).
ACTIVATION_KINDS: dict[str, int] = {
    "erf": 1, "gelu": 2, "gelu_tanh": 3, "sigmoid": 4, "silu": 5,
}
# Softmax modes of fastmath.c: "masked" is softmax with rows of only -inf giving
# zeros (ONNX Attention); plain softmax gives NaN there, as exp(x - max) does.
SOFTMAX_MODES: dict[str, int] = {"softmax": 0, "log_softmax": 1, "masked": 2}

_I64, _I32, _F32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


@dataclass(frozen=True)
class _Functions:
    unary: Callable[..., None]
    bias_unary: Callable[..., None]
    layer_norm: Callable[..., None]
    skip_layer_norm: Callable[..., None]
    softmax: Callable[..., None]
    unary_mt: Callable[..., int]        # the *_mt entry points: (..., n, parts)
    bias_unary_mt: Callable[..., int]
    layer_norm_mt: Callable[..., int]
    skip_layer_norm_mt: Callable[..., int]
    softmax_mt: Callable[..., int]
    attend_rows: Callable[..., int]
    attend_rows_mt: Callable[..., int]


_bound: tuple[native.NativeLibrary, _Functions] | None = None


def _functions() -> _Functions | None:
    """The library's functions; None when the native tier is unavailable.

    Asked of :func:`keel.native.library` on every call (a dictionary lookup once
    built), so ``KEEL_NATIVE=off`` with ``native.reset()`` takes effect; the
    ctypes declarations are made once per loaded library.
    """
    global _bound
    lib = native.library("fastmath")
    if lib is None:
        return None
    bound = _bound
    if bound is not None and bound[0] is lib:
        return bound[1]
    fns = _Functions(
        unary=lib.function("keel_unary_f32", [_I32, _PTR, _PTR, _I64, _I64, _F32]),
        bias_unary=lib.function("keel_bias_unary_f32",
                                [_I32, _PTR, _PTR, _PTR, _I64, _I64, _I64, _F32]),
        layer_norm=lib.function("keel_layer_norm_f32",
                                [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _F32, _I64, _I64]),
        skip_layer_norm=lib.function(
            "keel_skip_layer_norm_f32",
            [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _F32, _I64, _I64]),
        softmax=lib.function("keel_softmax_f32", [_PTR, _PTR, _I64, _I64, _I64, _I32]),
        unary_mt=lib.function("keel_unary_mt_f32", [_I32, _PTR, _PTR, _F32, _I64, _I64], _I64),
        bias_unary_mt=lib.function("keel_bias_unary_mt_f32",
                                   [_I32, _PTR, _PTR, _PTR, _I64, _F32, _I64, _I64], _I64),
        layer_norm_mt=lib.function(
            "keel_layer_norm_mt_f32",
            [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _F32, _I64, _I64], _I64),
        skip_layer_norm_mt=lib.function(
            "keel_skip_layer_norm_mt_f32",
            [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _F32, _I64, _I64], _I64),
        softmax_mt=lib.function("keel_softmax_mt_f32", [_PTR, _PTR, _I64, _I32, _I64, _I64],
                                _I64),
        attend_rows=lib.function("keel_attend_rows_f32",
                                 [*[_PTR] * 6, *[_I64] * 8, _F32, _I32, _I64, _I64], _I32),
        attend_rows_mt=lib.function("keel_attend_rows_mt_f32",
                                    [*[_PTR] * 5, *[_I64] * 8, _F32, _I32, _I64, _I64], _I64),
    )
    _bound = (lib, fns)
    return fns


def available() -> bool:
    """True when the native fastmath library is built and loaded here."""
    return _functions() is not None


def serves(*arrays: Any) -> bool:
    """True when every array is a C-contiguous NumPy float32 array (what the kernels take)."""
    return all(type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous
               for a in arrays)


def _address(a: np.ndarray | None) -> int | None:
    return None if a is None else native.address(a)


def _separate(x: np.ndarray, y: np.ndarray) -> bool:
    """``y`` is ``x``'s own memory (in place) or shares none of it."""
    return native.address(x) == native.address(y) or not np.may_share_memory(x, y)


Call = Callable[[], None]     # a kernel call with its arrays bound (see bound_*)


def _call(n: int, per_item: int, threads: int | None, serial: Callable[..., None],
          mt: Callable[..., int], head: tuple[Any, ...], tail: tuple[Any, ...] = (),
          keep: tuple[Any, ...] = ()) -> Call:
    """``serial(*head, 0, n, *tail)`` over the n items on this thread, or, when they are
    worth several threads, ``mt(*head, *tail, n, parts)`` on keel's: bound, not run.
    ``keep``: arrays made here that the addresses point into (the call owns them)."""
    count = planner.split_parts(planner.LeastWork.ELEMENTS, threads or 1, n, per_item)
    if count <= 1:
        bound = functools.partial(serial, *head, 0, n, *tail)
    else:
        bound = functools.partial(_checked, mt, (*head, *tail, n, count))
    return BoundCall(bound, keep=keep, native=True)     # C code only


def _checked(mt: Callable[..., int], args: tuple[Any, ...]) -> None:
    if mt(*args) != 0:
        raise MemoryError("native kernel: no memory for a worker thread's scratch")


def _ran(call: Call | None) -> bool:
    """Run ``call`` when there is one: True when it ran."""
    if call is None:
        return False
    call()
    return True


def unary(name: str, x: Any, out: Any, alpha: float = 1.0, threads: int | None = 1) -> bool:
    """``out = f(x)`` elementwise for ``name`` in :data:`ACTIVATION_KINDS`.

    ``out`` may be ``x`` (in place) and must have its shape. False when not served.
    """
    return _ran(bound_unary(name, x, out, alpha, threads))


def bound_unary(name: str, x: Any, out: Any, alpha: float = 1.0,
                threads: int | None = 1) -> Call | None:
    """:func:`unary` for these arrays, checked once: a call that runs it (for as long as
    the arrays live), or None when not served. The other ``bound_*`` functions do the
    same for their kernels."""
    fns = _functions()
    kind = ACTIVATION_KINDS.get(name)
    if (fns is None or kind is None or not serves(x, out) or x.shape != out.shape
            or not _separate(x, out)):
        return None
    px, py = _address(x), _address(out)
    return _call(x.size, 1, threads, fns.unary, fns.unary_mt, (kind, px, py), (alpha,))


# keel.ops.epilogue's activation names with a native form, and their kernel and alpha.
_EPILOGUE: dict[str, tuple[str, float]] = {
    "gelu": ("gelu", 1.0), "gelu_tanh": ("gelu_tanh", 1.0), "sigmoid": ("sigmoid", 1.0),
    "silu": ("silu", 1.0),
}
# The fused-epilogue activations activation_inplace can serve (others: NumPy).
NATIVE_ACTIVATIONS: frozenset[str] = frozenset(_EPILOGUE)


def activation_inplace(name: str, params: tuple[float, ...], y: Any,
                       threads: int | None = 1) -> bool:
    """Apply the fused-epilogue activation ``name`` (``keel.ops.epilogue`` names) to ``y``
    in place; True when done natively. The activations served (gelu, gelu_tanh,
    sigmoid, silu) take no parameters; the rest (relu, clip, ...) are single NumPy
    passes already and return False."""
    return _ran(bound_activation_inplace(name, params, y, threads))


def bound_activation_inplace(name: str, params: tuple[float, ...], y: Any,
                             threads: int | None = 1) -> Call | None:
    """:func:`activation_inplace` bound to ``y`` (see :func:`bound_unary`)."""
    found = _EPILOGUE.get(name)
    if found is None or params:
        return None
    kind, alpha = found
    return bound_unary(kind, y, y, alpha, threads)


def bias_activation_inplace(name: str, params: tuple[float, ...], y: Any, bias: Any,
                            threads: int | None = 1) -> bool:
    """``y = act(y + bias)`` in one pass, ``y`` of shape (..., n) and ``bias`` of n
    elements (a MatMul's bias along the last axis); ``name`` as in
    :func:`activation_inplace`. False when not served (then nothing was written)."""
    fns = _functions()
    found = _EPILOGUE.get(name)
    if (fns is None or found is None or params or not serves(y, bias) or y.ndim < 1
            or bias.size != y.shape[-1] or bias.size == 0):
        return False
    kind, alpha = ACTIVATION_KINDS[found[0]], found[1]
    n = bias.size
    py, pb = _address(y), _address(bias)
    return _ran(_call(y.size // n, n, threads, fns.bias_unary, fns.bias_unary_mt,
                      (kind, py, pb, py, n), (alpha,)))


@functools.lru_cache(maxsize=8)
def _zeros(k: int) -> np.ndarray:
    z = np.zeros(k, dtype=np.float32)
    z.flags.writeable = False
    return z


def layer_norm(x: Any, gamma: Any, beta: Any | None, y: Any, epsilon: float,
               mean: Any | None = None, inv_std: Any | None = None,
               threads: int | None = 1) -> bool:
    """Rows of ``x`` (rows, k) standardized into ``y``, then ``* gamma + beta`` (k each;
    ``beta`` None: no shift). ``mean``/``inv_std`` (rows elements each), when given,
    receive the statistics. False when not served (nothing was written)."""
    return _ran(bound_layer_norm(x, gamma, beta, y, epsilon, mean, inv_std, threads))


def bound_layer_norm(x: Any, gamma: Any, beta: Any | None, y: Any, epsilon: float,
                     mean: Any | None = None, inv_std: Any | None = None,
                     threads: int | None = 1) -> Call | None:
    """:func:`layer_norm` bound to these arrays (see :func:`bound_unary`)."""
    fns = _functions()
    if fns is None or x.ndim != 2 or y.shape != x.shape or x.shape[1] == 0:
        return None
    rows, k = x.shape
    beta = _zeros(k) if beta is None else beta
    stats = [s for s in (mean, inv_std) if s is not None]
    if (not serves(x, y, gamma, beta, *stats) or gamma.size != k or beta.size != k
            or any(s.size != rows for s in stats) or not _separate(x, y)):
        return None
    args = (_address(x), _address(gamma), _address(beta), _address(y), _address(mean),
            _address(inv_std), k, epsilon)
    return _call(rows, k, threads, fns.layer_norm, fns.layer_norm_mt, args, keep=(beta,))


def skip_layer_norm(x: Any, skip: Any, gamma: Any, beta: Any | None, y: Any, epsilon: float,
                    total: Any | None = None, threads: int | None = 1) -> bool:
    """``s = x + skip``, then the rows of ``s`` (rows, k) standardized into ``y`` and
    ``* gamma + beta``, in one pass; bitwise :func:`layer_norm` of ``np.add(x, skip)``.
    ``skip`` is (p, k) with p dividing rows: row r adds skip row r % p (a skip
    broadcast over leading axes). ``total`` (rows, k), when given, receives ``s``.
    ``y`` may be ``x``. False when not served (nothing was written)."""
    return _ran(bound_skip_layer_norm(x, skip, gamma, beta, y, epsilon, total, threads))


def bound_skip_layer_norm(x: Any, skip: Any, gamma: Any, beta: Any | None, y: Any,
                          epsilon: float, total: Any | None = None,
                          threads: int | None = 1) -> Call | None:
    """:func:`skip_layer_norm` bound to these arrays (see :func:`bound_unary`)."""
    fns = _functions()
    if (fns is None or x.ndim != 2 or skip.ndim != 2 or y.shape != x.shape
            or x.shape[1] == 0 or skip.shape[1] != x.shape[1]):
        return None
    rows, k = x.shape
    period = skip.shape[0]
    beta = _zeros(k) if beta is None else beta
    outs = (y,) if total is None else (y, total)
    if (not serves(x, skip, gamma, beta, *outs) or gamma.size != k or beta.size != k
            or period == 0 or rows % period or not _separate(x, y)
            or not _skip_fits(x, skip, y, total)):
        return None
    args = (_address(x), _address(skip), period, _address(gamma), _address(beta), _address(y),
            _address(total), k, epsilon)
    return _call(rows, k, threads, fns.skip_layer_norm, fns.skip_layer_norm_mt, args,
                 keep=(beta,))


def _skip_fits(x: np.ndarray, skip: np.ndarray, y: np.ndarray, total: np.ndarray | None) -> bool:
    """What the kernel writes (y, total) overlaps nothing it still reads: skip rows
    are read again for later rows, and total is written before y is."""
    if np.may_share_memory(skip, y):
        return False
    return total is None or (total.shape == x.shape and not any(
        np.may_share_memory(total, a) for a in (x, skip, y)))


def softmax(x: Any, y: Any, mode: str = "softmax", threads: int | None = 1) -> bool:
    """Softmax of each row of ``x`` (rows, n) into ``y`` (may be ``x``); ``mode`` one of
    :data:`SOFTMAX_MODES`. False when not served (nothing was written)."""
    return _ran(bound_softmax(x, y, mode, threads))


def bound_softmax(x: Any, y: Any, mode: str = "softmax",
                  threads: int | None = 1) -> Call | None:
    """:func:`softmax` bound to these arrays (see :func:`bound_unary`)."""
    fns = _functions()
    code = SOFTMAX_MODES.get(mode)
    if (fns is None or code is None or x.ndim != 2 or y.shape != x.shape
            or x.shape[1] == 0 or not serves(x, y) or not _separate(x, y)):
        return None
    rows, n = x.shape
    px, py = _address(x), _address(y)
    return _call(rows, n, threads, fns.softmax, fns.softmax_mt, (px, py, n), (code,))



def softmax_kernel() -> tuple[int, int] | None:
    """(the address of keel_softmax_f32, its softmax mode), for a kernel of another
    library that runs rows through it; None when the native tier is not loaded."""
    lib = native.library("fastmath") if _functions() is not None else None
    found = None if lib is None else lib.address("keel_softmax_f32")
    return None if not found else (found, SOFTMAX_MODES["softmax"])


# Scores of up to this many keys per row live on the native kernel's stack
# (fastmath.c's ATTEND_STACK); longer rows get a scratch row from here.
_ATTEND_STACK = 4096


@dataclass(frozen=True)
class RowAttention:
    """``keel_attend_rows_f32`` for one layout: ``heads`` heads of ``s`` query rows and
    ``t`` keys, the mask read at element strides ``mask`` = (inner heads, outer-head
    stride, inner-head stride, row stride), or without one. Made once per layout
    (:func:`row_attention`); :meth:`run` takes the arrays of a call."""

    serial: Callable[..., int]
    mt: Callable[..., int]
    heads: int
    tail: tuple[Any, ...]          # inner, s, t, d, dv, mb, mh, ms, scale, causal
    parts: int
    scratch: bool                  # rows too long for the kernel's stack

    def run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
            y: np.ndarray) -> None:
        """``y`` for C-contiguous float32 ``q``, ``k``, ``v``, ``y`` of the layout's
        shapes and a float32 mask whose strides are the layout's (None: no mask)."""
        address = native.address
        head = (address(q), address(k), address(v), None if mask is None else address(mask),
                address(y))
        if self.parts > 1:
            _checked(self.mt, (*head, *self.tail, self.heads, self.parts))
            return
        scratch = np.empty(self.tail[2], np.float32) if self.scratch else None
        self.serial(*head, None if scratch is None else address(scratch), *self.tail, 0,
                    self.heads)

    def bind(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
             y: np.ndarray) -> Call:
        """:meth:`run` for arrays that stay put: every argument computed once (the call
        holds the arrays, and the scratch row it needs)."""
        head = tuple(_address(a) for a in (q, k, v, mask, y))
        if self.parts > 1:
            return functools.partial(_holding, (q, k, v, mask, y), _checked, self.mt,
                                     (*head, *self.tail, self.heads, self.parts))
        scratch = np.empty(self.tail[2], np.float32) if self.scratch else None
        return functools.partial(_holding, (q, k, v, mask, y, scratch), self.serial, *head,
                                 _address(scratch), *self.tail, 0, self.heads)


def _holding(arrays: tuple[Any, ...], fn: Callable[..., object], *args: Any) -> None:
    """``fn(*args)``, ``arrays`` (what the arguments point into) kept alive with the call."""
    fn(*args)


def row_attention(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...],
                  mask: tuple[int, int, int, int] | None, scale: float, causal: bool,
                  threads: int | None = 1) -> RowAttention | None:
    """The row kernel for ``q`` (heads, s, d), ``k`` (heads, t, d), ``v`` (heads, t, dv)
    and a mask layout as :class:`RowAttention` describes; None when the native tier is
    not loaded."""
    fns = _functions()
    if fns is None or len(q) != 3 or not k[1]:
        return None
    heads, s, d = q
    t, dv = k[1], v[2]
    inner, mb, mh, ms = (1, 0, 0, 0) if mask is None else mask
    count = planner.split_parts(planner.LeastWork.ELEMENTS, threads or 1, heads,
                                s * t * (d + dv))
    return RowAttention(fns.attend_rows, fns.attend_rows_mt, heads,
                        (inner, s, t, d, dv, mb, mh, ms, scale, int(causal)), count,
                        t > _ATTEND_STACK)


def attend_rows(q: Any, k: Any, v: Any, mask: Any | None, y: Any, scale: float, causal: bool,
                threads: int | None = 1) -> bool:
    """Attention one query row at a time: ``q`` (heads, s, d), ``k`` (heads, t, d), ``v``
    (heads, t, dv) and ``y`` (heads, s, dv) C-contiguous float32; ``mask`` None or a
    float32 (outer, inner, s, t) view, heads = outer x inner, its last axis contiguous
    (the others may be broadcast: stride 0). Rows whose scores are all -inf give NaN.
    False when not served (nothing written)."""
    return _ran(bound_attend_rows(q, k, v, mask, y, scale, causal, threads))


def bound_attend_rows(q: Any, k: Any, v: Any, mask: Any | None, y: Any, scale: float,
                      causal: bool, threads: int | None = 1) -> Call | None:
    """:func:`attend_rows` bound to these arrays (see :func:`bound_unary`)."""
    if not serves(q, k, v, y) or q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        return None
    heads, s, d = q.shape
    t, dv = k.shape[1], v.shape[2]
    layout = mask_layout(mask, heads, s, t)
    if (k.shape != (heads, t, d) or v.shape != (heads, t, dv) or y.shape != (heads, s, dv)
            or layout is None or any(np.may_share_memory(y, a) for a in (q, k, v))):
        return None
    kernel = row_attention(q.shape, k.shape, v.shape, None if mask is None else layout,
                           scale, causal, threads)
    return None if kernel is None else kernel.bind(q, k, v, mask, y)


def mask_layout(mask: Any | None, heads: int, s: int,
                t: int) -> tuple[int, int, int, int] | None:
    """(inner heads, element strides of the outer heads, inner heads and rows) of a
    row-kernel mask (see :func:`attend_rows`); (1, 0, 0, 0) without one; None when the
    kernel cannot read it."""
    if mask is None:
        return 1, 0, 0, 0
    if (type(mask) is not np.ndarray or mask.dtype != np.float32 or mask.ndim != 4
            or mask.shape[2:] != (s, t) or mask.shape[0] * mask.shape[1] != heads
            or (t > 1 and mask.strides[3] != 4) or any(x % 4 for x in mask.strides)):
        return None
    return mask.shape[1], mask.strides[0] // 4, mask.strides[1] // 4, mask.strides[2] // 4
