"""Typed element maps: WGSL kernels over any dtype the webgpu backend holds.

The float kernels (:mod:`keel.backends.webgpu.elementwise`) read and write
float32 or float16 arrays. Casts, comparisons, logic, ``where`` and integer
division mix dtypes, and some of them are narrower than a WGSL word: here every
tensor is bound as ``array<u32>`` and each dtype (a *kind*) has a load that
decodes element ``e`` into the value WGSL computes with, and a store that
encodes it back:

======= ================ ======================================================
kind    computes as      stored as
======= ================ ======================================================
f32     ``f32``          one word (bit-cast)
f16     ``f32``          half a word (``unpack2x16float`` / ``pack2x16float``,
                         core WGSL: no ``shader-f16`` needed)
i32     ``i32``          one word
i64     ``vec2<u32>``    two words, low first (wgsl's ``*64`` helpers)
u8, i8  ``i32``          a byte (i8 sign-extended on load; stores keep the low
                         byte, so integer arithmetic wraps as NumPy's does)
bool    ``i32`` (0 / 1)  a byte
======= ================ ======================================================

An output of 1- or 2-byte elements is written one word per invocation (the
elements of a word computed by one invocation), so no two invocations write
one word. Inputs are read through their strides (broadcast, transposed and
sliced views in place).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.webgpu import wgsl
from keel.backends.webgpu.array import WgpuArray
from keel.backends.webgpu.ops import (
    Params,
    broadcast_strides,
    device_of,
    fresh,
    groups_for,
    launch,
)
from keel.errors import InvalidArgumentError

__all__ = ["KINDS", "MATH64", "NAMES", "constant_words", "domain", "head", "kind_of",
           "launch_typed", "map_source", "output", "run_map", "store_word", "typed_constant",
           "typed_source"]

NAMES = "abcd"          # what a map's expression calls inputs 0, 1, 2, 3

# NumPy dtype -> kind (the dtypes the backend holds).
KINDS: dict[np.dtype, str] = {
    np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64", np.dtype(np.uint8): "u8", np.dtype(np.int8): "i8",
    np.dtype(np.bool_): "bool",
}
_DOMAIN = {"f32": "f32", "f16": "f32", "i32": "i32", "i64": "vec2<u32>", "u8": "i32",
           "i8": "i32", "bool": "i32"}
_BYTES = {"f32": 4, "f16": 2, "i32": 4, "i64": 8, "u8": 1, "i8": 1, "bool": 1}

# 64-bit helpers beyond wgsl's add/sub/mul: comparisons, division, conversions to and
# from f32 (correctly rounded to nearest even, as NumPy converts).
MATH64 = """
fn eq64(a: vec2<u32>, b: vec2<u32>) -> bool { return a.x == b.x && a.y == b.y; }
fn ltu64(a: vec2<u32>, b: vec2<u32>) -> bool { return a.y < b.y || (a.y == b.y && a.x < b.x); }
fn lt64(a: vec2<u32>, b: vec2<u32>) -> bool {
    let ha = bitcast<i32>(a.y); let hb = bitcast<i32>(b.y);
    return ha < hb || (ha == hb && a.x < b.x);
}
fn shl64(a: vec2<u32>, k: u32) -> vec2<u32> {
    if (k == 0u) { return a; }
    if (k >= 32u) { return vec2<u32>(0u, a.x << (k - 32u)); }
    return vec2<u32>(a.x << k, (a.y << k) | (a.x >> (32u - k)));
}
fn udivmod64(n: vec2<u32>, d: vec2<u32>) -> vec4<u32> {   // (quotient, remainder)
    var q = vec2<u32>(0u, 0u);
    var r = vec2<u32>(0u, 0u);
    for (var k = 63; k >= 0; k = k - 1) {
        let word = select(n.x, n.y, k >= 32);
        r = shl64(r, 1u);
        r.x = r.x | ((word >> (u32(k) % 32u)) & 1u);
        q = shl64(q, 1u);
        if (!ltu64(r, d)) { r = sub64(r, d); q.x = q.x | 1u; }
    }
    return vec4<u32>(q, r);
}
fn div64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {        // truncates toward zero
    let qr = udivmod64(abs64(a), abs64(b));
    return select(qr.xy, neg64(qr.xy), neg_(a) != neg_(b));
}
fn rem64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {        // the sign of a (C's fmod)
    let qr = udivmod64(abs64(a), abs64(b));
    return select(qr.zw, neg64(qr.zw), neg_(a));
}
fn mod64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {        // the sign of b (floor)
    let r = rem64(a, b);
    return select(r, add64(r, b), (r.x | r.y) != 0u && neg_(r) != neg_(b));
}
fn u64_to_f32(a: vec2<u32>) -> f32 {
    if (a.y == 0u && a.x < 0x1000000u) { return f32(a.x); }        // exact
    let lz = select(countLeadingZeros(a.y), 32u + countLeadingZeros(a.x), a.y == 0u);
    let n = shl64(a, lz);                        // the leading 1 at bit 63
    var m = n.y >> 8u;                           // 24 significant bits
    let rest = n.y & 0xFFu;
    let half = rest == 0x80u && n.x == 0u;
    if (rest > 0x80u || (rest == 0x80u && !half) || (half && (m & 1u) == 1u)) {
        m = m + 1u;
    }
    var e = 63u - lz;
    if (m == 0x1000000u) { m = m >> 1u; e = e + 1u; }
    return bitcast<f32>(((e + 127u) << 23u) | (m & 0x7FFFFFu));
}
fn i64_to_f32(a: vec2<u32>) -> f32 {
    let v = u64_to_f32(abs64(a));
    return select(v, -v, neg_(a));
}
fn f32_to_i64(x: f32) -> vec2<u32> {                       // truncates toward zero
    let a = trunc(abs(x));
    let hi = floor(a / 4294967296.0);
    let v = vec2<u32>(u32(a - hi * 4294967296.0), u32(hi));
    return select(v, neg64(v), x < 0.0);
}
fn sign64(a: vec2<u32>) -> vec2<u32> {
    if (neg_(a)) { return vec2<u32>(0xFFFFFFFFu, 0xFFFFFFFFu); }
    return vec2<u32>(select(0u, 1u, (a.x | a.y) != 0u), 0u);
}
fn sar64(a: vec2<u32>, k: u32) -> vec2<u32> {     // arithmetic shift right, k < 64
    let h = bitcast<i32>(a.y);
    if (k == 0u) { return a; }
    if (k >= 32u) {
        return vec2<u32>(bitcast<u32>(h >> min(k - 32u, 31u)), bitcast<u32>(h >> 31u));
    }
    return vec2<u32>((a.x >> k) | (a.y << (32u - k)), bitcast<u32>(h >> k));
}
fn nonzero_f(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) != 0u; }
fn mod32(a: i32, b: i32) -> i32 {
    let r = a % b;
    return select(r, r + b, r != 0 && ((r < 0) != (b < 0)));
}
fn fmodf_(a: f32, b: f32) -> f32 {           // exact, as C's fmod: |a| less multiples of |b|
    let m = abs(b);
    var r = abs(a);
    if (is_nan(a) || is_nan(b) || m == 0.0 || r > 3.4028235e38) {
        return bitcast<f32>(0x7fc00000u);
    }
    for (var k = 0; k < 300 && r >= m; k = k + 1) {
        var t = ldexp(m, frexp(r).exp - frexp(m).exp);
        if (t > r) { t = t * 0.5; }
        r = r - t;                               // exact: t <= r < 2t
    }
    return select(r, -r, a < 0.0);
}
fn modf_(a: f32, b: f32) -> f32 {            // the sign of b, as NumPy's mod
    let r = fmodf_(a, b);
    return select(r, r + b, r != 0.0 && ((r < 0.0) != (b < 0.0)));
}
"""


def kind_of(dtype: Any) -> str:
    found = KINDS.get(np.dtype(dtype))
    if found is None:
        raise InvalidArgumentError(f"webgpu holds no {np.dtype(dtype)} tensors")
    return found


def domain(kind: str) -> str:
    """The WGSL type a kind computes as."""
    return _DOMAIN[kind]


def _load(kind: str, j: int) -> str:
    """``fn ld{j}(e) -> domain``: element ``e`` of binding ``A{j}``."""
    a = f"A{j}"
    body = {
        "f32": f"bitcast<f32>({a}[e])",
        "f16": f"unpack2x16float({a}[e / 2u])[e % 2u]",
        "i32": f"bitcast<i32>({a}[e])",
        "i64": f"vec2<u32>({a}[2u * e], {a}[2u * e + 1u])",
        "u8": f"i32(({a}[e / 4u] >> ((e % 4u) * 8u)) & 0xFFu)",
        "bool": f"i32(({a}[e / 4u] >> ((e % 4u) * 8u)) & 0xFFu)",
        "i8": f"bitcast<i32>({a}[e / 4u] << (24u - (e % 4u) * 8u)) >> 24u",
    }[kind]
    return f"fn ld{j}(e: u32) -> {_DOMAIN[kind]} {{ return {body}; }}\n"


def store_word(kind: str) -> str:
    """The bits of the domain value ``v`` as the kind stores them (a 1- or 2-byte kind:
    in the low bits of a u32)."""
    return {
        "f32": "bitcast<u32>(v)",
        "i32": "bitcast<u32>(v)",
        "f16": "pack2x16float(vec2<f32>(v, 0.0)) & 0xFFFFu",
        "u8": "bitcast<u32>(v) & 0xFFu",
        "i8": "bitcast<u32>(v) & 0xFFu",
        "bool": "select(0u, 1u, v != 0)",
    }[kind]


def _main(out: str) -> str:
    """The entry point: one invocation per element (4- and 8-byte kinds) or per output
    word (1- and 2-byte kinds), storing ``val(k)`` at element ``P[1] + k``."""
    if out == "i64":
        return wgsl._MAIN + """    if (i >= P[0]) { return; }
    let v = val(i);
    O[2u * (P[1] + i)] = v.x;
    O[2u * (P[1] + i) + 1u] = v.y;
}
"""
    if _BYTES[out] == 4:
        return wgsl._MAIN + f"""    if (i >= P[0]) {{ return; }}
    let v = val(i);
    O[P[1] + i] = {store_word(out)};
}}
"""
    item = _BYTES[out]
    per = 4 // item
    mask = "0xFFu" if item == 1 else "0xFFFFu"
    return wgsl._MAIN + f"""    let first = i * {per}u;
    if (first >= P[0]) {{ return; }}
    let w = (P[1] * {item}u) / 4u + i;
    var word = 0u;
    if (first + {per}u > P[0]) {{ word = O[w]; }}
    for (var j = 0u; j < {per}u; j = j + 1u) {{
        if (first + j >= P[0]) {{ break; }}
        let v = val(first + j);
        let shift = j * {item * 8}u;
        word = (word & ~({mask} << shift)) | (({store_word(out)}) << shift);
    }}
    O[w] = word;
}}
"""


_COORD = f"""
fn coord(k: u32, d: u32) -> u32 {{         // dim d of the k-th element of the shape at P[6..]
    var rem = k;
    for (var e = {wgsl.MAX_RANK - 1}u; e > d; e = e - 1u) {{ rem = rem / P[6u + e]; }}
    return rem % P[6u + d];
}}
"""


def typed_source(kinds: Sequence[str], out: str, body: str) -> str:
    """A typed kernel: inputs of ``kinds`` (loads ``ld0``, ``ld1``, ...), the output of
    kind ``out``, and ``body``, the statements of ``fn val(k: u32)`` that return the
    domain value of output element ``k``. ``P[0]`` is the element count, ``P[1]`` the
    output's offset, ``P[2..5]`` four free words, ``P[6..]`` the output's shape."""
    return (wgsl._header("f32", len(kinds) + 1) + wgsl._MATH + wgsl._INT64 + MATH64 + _COORD
            + wgsl._buffers("u32", ["O"] + [f"A{j}" for j in range(len(kinds))])
            + "".join(_load(k, j) for j, k in enumerate(kinds))
            + f"fn val(k: u32) -> {_DOMAIN[out]} {{\n{body}}}\n" + _main(out))


@functools.cache
def map_source(expr: str, kinds: tuple[str, ...], out: str) -> str:
    """``O = expr(a, b, c, d)`` with input j of kind ``kinds[j]`` decoded to its domain,
    ``expr`` of the output kind's domain. P as :func:`keel.backends.webgpu.wgsl.elementwise`
    lays out its strided form (offsets and strides in elements)."""
    loads = []
    for j in range(len(kinds)):
        base = 6 + wgsl.MAX_RANK + j * (wgsl.MAX_RANK + 1)
        loads.append(f"    let {NAMES[j]} = ld{j}(u32(i32(P[{base}u]) + "
                     f"at(k, 6u, {base + 1}u)));\n")
    return typed_source(kinds, out, "".join(loads) + f"    return {expr};\n")


def typed_constant(kind: str) -> str:
    """The domain value of ``kind`` held in P[2] (and P[3] for int64)."""
    return {"f32": "bitcast<f32>(P[2])", "i32": "bitcast<i32>(P[2])",
            "vec2<u32>": "vec2<u32>(P[2], P[3])"}[domain(kind)]


def constant_words(value: Any, dtype: np.dtype) -> list[int]:
    """``value`` (as ``dtype`` first) in the words :func:`typed_constant` reads."""
    with np.errstate(all="ignore"):
        v = np.asarray(value).astype(dtype)
    if dtype.kind == "f":
        return [int(v.astype(np.float32).reshape(1).view(np.uint32)[0])]
    wide = np.int64 if dtype == np.int64 else np.int32
    return [int(w) for w in v.astype(wide).reshape(1).view(np.uint32)]


def launch_typed(source: str, y: WgpuArray, xs: Sequence[WgpuArray], params: Params) -> None:
    """Dispatch a typed kernel writing ``y`` (one invocation per element or output word)."""
    per = max(1, 4 // y.itemsize)
    launch(source, [y, *xs], params, groups_for(-(-y.size // per)), [y])


def head(y: WgpuArray, words: Sequence[int] = ()) -> Params:
    """P[0..13]: the count, ``y``'s offset, four free words (``words``), ``y``'s shape."""
    free = [*words, 0, 0, 0, 0][:4]
    return Params().u(y.size, y.offset, *free).dims(y.shape, 1)


def run_map(expr: str, xs: Sequence[WgpuArray], dtype: Any, out: Sequence[Any] | None = None,
            shape: Sequence[int] | None = None) -> WgpuArray:
    """``expr`` over ``xs`` broadcast together (to ``shape`` when given), as ``dtype``."""
    dt = np.dtype(dtype)
    kinds = tuple(kind_of(x.dtype) for x in xs)
    target = tuple(shape) if shape is not None else tuple(
        int(d) for d in np.broadcast_shapes(*(x.shape for x in xs)))
    y = output(device_of(*xs), out, target, dt)
    if y.size == 0:
        return y
    params = head(y)
    for x in xs:
        params.u(x.offset).dims(broadcast_strides(x, y.shape), 0)
    launch_typed(map_source(expr, kinds, kind_of(dt)), y, xs, params)
    return y


def output(device: Any, out: Sequence[Any] | None, shape: tuple[int, ...],
            dtype: np.dtype) -> WgpuArray:
    """The caller's buffer when it is contiguous, of ``shape`` and ``dtype``, and starts on
    a word (sub-word outputs are written a word at a time); else a fresh array."""
    if out:
        o = out[0]
        if isinstance(o, WgpuArray) and o.is_contiguous() and o.shape == shape \
                and o.dtype == dtype and (o.offset * o.itemsize) % 4 == 0:
            return o
    return fresh(device, shape, dtype)
