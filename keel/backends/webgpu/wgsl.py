"""WGSL sources of the webgpu backend's compute shaders.

Each function returns the full source of one shader; the device builds a
pipeline once per distinct source. Conventions shared by every shader:

* every tensor binding is a whole ``read_write`` storage buffer (a buffer may
  be bound twice in one dispatch: an arena holds inputs and outputs);
* the last binding ``P`` holds the parameters as u32 words (floats and signed
  strides bit-cast); offsets and strides count elements;
* a dispatch of more than ``MAX_GROUPS`` workgroups spreads over x and y; the
  linear invocation index is ``g.x + g.y * nw.x * GROUP``;
* ``at(i, shp, st)`` is the offset of the ``i``-th element of a row-major walk
  over the ``MAX_RANK`` dims at ``P[shp..]`` with the strides at ``P[st..]``.
"""

from __future__ import annotations

import functools

__all__ = ["GROUP", "MAX_GROUPS", "MAX_RANK", "TILE", "activation", "lit"]

MAX_RANK = 8            # dims a strided walk indexes (shapes padded with 1s)
GROUP = 64              # invocations of a one-dimensional workgroup
MAX_GROUPS = 65535      # WebGPU's guaranteed workgroups per dimension
TILE = 16               # side of a matmul/conv tile in workgroup memory (16x16 invocations)


def lit(v: float) -> str:
    """A WGSL f32 literal (infinities become the largest finite float)."""
    if v != v:
        raise ValueError("no NaN literal in WGSL")
    if abs(v) == float("inf"):
        v = 3.4028235e38 if v > 0 else -3.4028235e38
    text = repr(float(v))
    return f"({text})"


def activation(name: str, params: tuple[float, ...]) -> str:
    """The WGSL expression in ``x`` of a fused epilogue (keel.ops.epilogue's names)."""
    p = [lit(v) for v in params]
    return {
        "": "x",
        "relu": "select(x, 0.0, x < 0.0)",
        "leaky_relu": f"select(x, {p[0] if p else ''} * x, x < 0.0)",
        "sigmoid": "sigmoid_(x)",
        "tanh": "tanh_(x)",
        "clip": f"min(max(x, {p[0] if p else ''}), {p[1] if len(p) > 1 else ''})",
        "hard_sigmoid": f"clamp({p[0] if p else ''} * x + {p[1] if len(p) > 1 else ''}, 0.0, 1.0)",
        "hard_swish": "x * clamp(x / 6.0 + 0.5, 0.0, 1.0)",
        "gelu": "gelu_(x)",
        "gelu_tanh": "0.5 * x * (1.0 + tanh_(0.7978845608028654 * (x + 0.044715 * x * x * x)))",
        "silu": "x * sigmoid_(x)",
    }[name]


def _header(t: str, params: int) -> str:
    enable = "enable f16;\n" if t == "f16" else ""
    return f"""{enable}
@group(0) @binding({params}) var<storage, read> P: array<u32>;

fn at(i: u32, shp: u32, st: u32) -> i32 {{
    var rem = i;
    var off = 0;
    for (var d = {MAX_RANK - 1}; d >= 0; d = d - 1) {{
        let n = P[shp + u32(d)];
        off = off + i32(rem % n) * bitcast<i32>(P[st + u32(d)]);
        rem = rem / n;
    }}
    return off;
}}

fn pf(k: u32) -> f32 {{ return bitcast<f32>(P[k]); }}
"""


_MAIN = (f"@compute @workgroup_size({GROUP})\n"
         "fn main(@builtin(global_invocation_id) g: vec3<u32>, "
         "@builtin(num_workgroups) nw: vec3<u32>) {\n"
         f"    let i = g.x + g.y * nw.x * {GROUP}u;\n")


def _buffers(t: str, names: list[str], first: int = 0) -> str:
    return "".join(f"@group(0) @binding({first + k}) var<storage, read_write> {n}: array<{t}>;\n"
                   for k, n in enumerate(names))


# Math the shaders share: erf (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7) and a tanh
# that saturates instead of overflowing.
_MATH = """
// WGSL lets a compiler assume no NaN (x != x may fold to false): test the bits.
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn erf_(x: f32) -> f32 {
    let s = sign(x);
    let a = abs(x);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t
                     - 0.284496736) * t + 0.254829592) * t * exp(-a * a);
    return s * y;
}
fn erfc_pos(a: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.3275911 * a);
    return (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t
             - 0.284496736) * t + 0.254829592) * t * exp(-a * a);
}
fn gelu_(x: f32) -> f32 {
    let z = -x * 0.7071067811865476;
    let c = select(2.0 - erfc_pos(-z), erfc_pos(z), z >= 0.0);
    return 0.5 * x * c;
}
fn tanh_(x: f32) -> f32 {
    if (is_nan(x)) { return x; }
    if (abs(x) < 0.0004) { return x; }         // tanh(x) = x - x^3/3: x is exact in f32
    return tanh(clamp(x, -15.0, 15.0));
}
fn keep_nan(x: f32, y: f32) -> f32 { return select(y, x, is_nan(x)); }
// max and min where a NaN wins (NumPy's), whatever the adapter's max and min do with one.
fn maxn(a: f32, b: f32) -> f32 { return select(select(max(a, b), b, is_nan(b)), a, is_nan(a)); }
fn minn(a: f32, b: f32) -> f32 { return select(select(min(a, b), b, is_nan(b)), a, is_nan(a)); }
fn sigmoid_(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }
// exp(x) - 1 and log(1 + x) without the cancellation near 0 (Kahan's corrections).
fn expm1_(x: f32) -> f32 {
    let u = exp(x);
    let um = u - 1.0;
    if (u == 1.0 || abs(x) > 0.5 || um == -1.0) { return select(um, x, u == 1.0); }
    return um * x / log(u);
}
fn log1p_(x: f32) -> f32 {
    let u = 1.0 + x;
    if (u == 1.0) { return x; }
    return log(u) * x / (u - 1.0);
}
fn nan_() -> f32 { return bitcast<f32>(0x7fc00000u); }
// asin and acos through atan2 (the adapter's own may be far less accurate), NaN outside
// [-1, 1]; the domain edges of acosh and atanh as NumPy has them.
fn asin_(x: f32) -> f32 {
    if (is_nan(x) || abs(x) > 1.0) { return nan_(); }
    return atan2(x, sqrt((1.0 - x) * (1.0 + x)));
}
fn acos_(x: f32) -> f32 {
    if (is_nan(x) || abs(x) > 1.0) { return nan_(); }
    return atan2(sqrt((1.0 - x) * (1.0 + x)), x);
}
fn acosh_(x: f32) -> f32 { return select(acosh(x), nan_(), is_nan(x) || x < 1.0); }
fn atanh_(x: f32) -> f32 {
    if (is_nan(x) || abs(x) > 1.0) { return nan_(); }
    if (abs(x) == 1.0) { return x * 3.4028235e38 * 2.0; }
    return atanh(x);
}
fn softplus_(x: f32) -> f32 { return keep_nan(x, max(x, 0.0) + log1p_(exp(-abs(x)))); }
"""


@functools.cache
def copy_words() -> str:
    """Strided copy of elements of a whole number of u32 words (P: n, words, dst off,
    src off, shape@4, dst strides@12, src strides@20; offsets and strides in words)."""
    return (_header("f32", 2) + _buffers("u32", ["D", "S"]) + _MAIN + """
    if (i >= P[0]) { return; }
    let d = u32(i32(P[2]) + at(i, 4u, 12u));
    let s = u32(i32(P[3]) + at(i, 4u, 20u));
    for (var k = 0u; k < P[1]; k = k + 1u) { D[d + k] = S[s + k]; }
}
""")


@functools.cache
def copy_bytes() -> str:
    """Copy of 1- or 2-byte elements into a contiguous word-aligned target, one output
    word per invocation (P: n, itemsize, dst word off, src off, shape@4, src strides@12)."""
    return (_header("f32", 2) + _buffers("u32", ["D", "S"]) + _MAIN + """
    let n = P[0];
    let item = P[1];
    let per = 4u / item;
    let first = i * per;
    if (first >= n) { return; }
    let mask = select(0xFFFFu, 0xFFu, item == 1u);
    var word = 0u;
    if (first + per > n) { word = D[P[2] + i]; }
    for (var j = 0u; j < per; j = j + 1u) {
        let e = first + j;
        if (e >= n) { break; }
        let sb = u32(i32(P[3]) + at(e, 4u, 12u)) * item;
        let v = (S[sb / 4u] >> ((sb % 4u) * 8u)) & mask;
        let shift = j * item * 8u;
        word = (word & ~(mask << shift)) | (v << shift);
    }
    D[P[2] + i] = word;
}
""")


@functools.cache
def fill_words() -> str:
    """Every element of a contiguous target = the value's words (P: n, words, dst off,
    then the value's words)."""
    return (_header("f32", 1) + _buffers("u32", ["D"]) + _MAIN + """
    if (i >= P[0]) { return; }
    let w = P[1];
    for (var k = 0u; k < w; k = k + 1u) { D[P[2] + i * w + k] = P[3u + k]; }
}
""")


@functools.cache
def elementwise(expr: str, arity: int, t: str, flat: bool) -> str:
    """``O = expr(a, b, c)`` over a contiguous output. P: n, out off, four f32 scalars
    ``s0..s3`` at 2..5; ``flat``: the inputs' offsets at 6.. (contiguous, same shape);
    else the shape at 6 and, per input j, its offset at 14 + 9j and strides after it."""
    names = ["a", "b", "c"][:arity]
    loads = []
    for j, n in enumerate(names):
        if flat:
            loads.append(f"    let {n} = f32(A{j}[P[{6 + j}u] + i]);")
        else:
            base = 6 + MAX_RANK + j * (MAX_RANK + 1)
            loads.append(f"    let {n} = f32(A{j}[u32(i32(P[{base}u]) + at(i, 6u, {base + 1}u))]);")
    return (_header(t, arity + 1) + _MATH + _buffers(t, ["O"] + [f"A{j}" for j in range(arity)])
            + _MAIN + "    if (i >= P[0]) { return; }\n"
            + "    let s0 = pf(2u); let s1 = pf(3u); let s2 = pf(4u); let s3 = pf(5u);\n"
            + "\n".join(loads) + f"\n    O[P[1] + i] = {t}({expr});\n}}\n")


# 64-bit integers as (low, high) u32 word pairs: WGSL has no 64-bit integer type.
# Each wraps modulo 2^64, as NumPy's int64 does.
_INT64 = """
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}
fn neg64(a: vec2<u32>) -> vec2<u32> { return add64(~a, vec2<u32>(1u, 0u)); }
fn sub64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> { return add64(a, neg64(b)); }
fn wide32(a: u32, b: u32) -> vec2<u32> {          // the full 64-bit product of two u32
    let a0 = a & 0xFFFFu; let a1 = a >> 16u; let b0 = b & 0xFFFFu; let b1 = b >> 16u;
    let p00 = a0 * b0; let p01 = a0 * b1; let p10 = a1 * b0;
    let mid = (p00 >> 16u) + (p01 & 0xFFFFu) + (p10 & 0xFFFFu);
    return vec2<u32>((p00 & 0xFFFFu) | (mid << 16u),
                     a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u));
}
fn mul64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let p = wide32(a.x, b.x);
    return vec2<u32>(p.x, p.y + a.x * b.y + a.y * b.x);
}
fn neg_(a: vec2<u32>) -> bool { return (a.y >> 31u) == 1u; }
fn abs64(a: vec2<u32>) -> vec2<u32> { return select(a, neg64(a), neg_(a)); }
fn relu64(a: vec2<u32>) -> vec2<u32> { return select(a, vec2<u32>(0u, 0u), neg_(a)); }
"""


def _epilogue(act: str) -> str:
    return f"fn act(x: f32) -> f32 {{ return {act}; }}\n"


@functools.cache
def matmul(t: str, act: str, with_c: bool) -> str:
    """Batched tiled ``O = act(alpha * A @ B + beta * C)`` with TILE x TILE tiles of A and
    B in workgroup memory; A, B and C strided (transposes and broadcasts read in place).

    P: M, N, K, O off, A off, A row stride, A col stride, B off, B row stride, B col
    stride, C off, C row stride, C col stride, alpha, beta (0..14); batch: count at 15,
    batch shape at 16 (4 dims), A/B/C batch strides at 20/24/28. O is (batch, M, N).
    """
    c_term = ("    v = v + pf(14u) * f32(C[u32(i32(P[10]) + cb + i32(row) * bitcast<i32>(P[11])"
              " + i32(col) * bitcast<i32>(P[12]))]);\n") if with_c else ""
    names = ["O", "A", "B"] + (["C"] if with_c else [])
    return (_header(t, len(names)) + _MATH + _epilogue(act) + _buffers(t, names) + f"""
var<workgroup> ta: array<array<f32, {TILE}>, {TILE}>;
var<workgroup> tb: array<array<f32, {TILE}>, {TILE}>;

fn batch_off(b: u32, st: u32) -> i32 {{
    var rem = b;
    var off = 0;
    for (var d = 3; d >= 0; d = d - 1) {{
        let n = P[16u + u32(d)];
        off = off + i32(rem % n) * bitcast<i32>(P[st + u32(d)]);
        rem = rem / n;
    }}
    return off;
}}

@compute @workgroup_size({TILE}, {TILE})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>) {{
    let M = P[0]; let N = P[1]; let K = P[2];
    let b = wg.z;
    let row = wg.y * {TILE}u + l.y;
    let col = wg.x * {TILE}u + l.x;
    let ab = i32(P[4]) + batch_off(b, 20u);
    let bb = i32(P[7]) + batch_off(b, 24u);
    let cb = batch_off(b, 28u);
    let sam = bitcast<i32>(P[5]); let sak = bitcast<i32>(P[6]);
    let sbk = bitcast<i32>(P[8]); let sbn = bitcast<i32>(P[9]);
    var acc = 0.0;
    for (var k0 = 0u; k0 < K; k0 = k0 + {TILE}u) {{
        let ka = k0 + l.x;
        let kb = k0 + l.y;
        ta[l.y][l.x] = select(0.0, f32(A[u32(ab + i32(row) * sam + i32(ka) * sak)]),
                              row < M && ka < K);
        tb[l.y][l.x] = select(0.0, f32(B[u32(bb + i32(kb) * sbk + i32(col) * sbn)]),
                              kb < K && col < N);
        workgroupBarrier();
        for (var k = 0u; k < {TILE}u; k = k + 1u) {{ acc = acc + ta[l.y][k] * tb[k][l.x]; }}
        workgroupBarrier();
    }}
    if (row >= M || col >= N) {{ return; }}
    var v = pf(13u) * acc;
{c_term}    O[P[3] + (b * M + row) * N + col] = {t}(act(v));
}}
""")


def _conv_head(t: str, act: str, with_bias: bool, with_z: bool) -> str:
    names = ["O", "X", "Wt"] + (["Bs"] if with_bias else []) + (["Z"] if with_z else [])
    return _header(t, len(names)) + _MATH + _epilogue(act) + _buffers(t, names)


@functools.cache
def conv_gemm(t: str, act: str, with_bias: bool, with_z: bool) -> str:
    """2-D convolution as an implicit GEMM per group: rows are output channels, columns
    (n, oh, ow), the reduction (c, kh, kw); input patches are gathered into workgroup
    tiles on the fly (zero outside the padding), no im2col buffer.

    P: N, C, H, W, M, OH, OW, KH, KW, stride h/w, pad top/left, dilation h/w (0..14),
    group (15), X off, W off, B off, Z off, O off (16..20).
    """
    bias = "    v = v + f32(Bs[P[18] + m]);\n" if with_bias else ""
    z = "    v = v + f32(Z[P[19] + o]);\n" if with_z else ""
    return (_conv_head(t, act, with_bias, with_z) + f"""
var<workgroup> ta: array<array<f32, {TILE}>, {TILE}>;
var<workgroup> tb: array<array<f32, {TILE}>, {TILE}>;

@compute @workgroup_size({TILE}, {TILE})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>) {{
    let N = P[0]; let C = P[1]; let H = P[2]; let W = P[3]; let M = P[4];
    let OH = P[5]; let OW = P[6]; let KH = P[7]; let KW = P[8];
    let G = P[15];
    let cg = C / G;
    let mg = M / G;
    let g = wg.z;
    let K = cg * KH * KW;
    let cols = N * OH * OW;
    let m = g * mg + wg.y * {TILE}u + l.y;
    let mrow = wg.y * {TILE}u + l.y;
    let col = wg.x * {TILE}u + l.x;
    let n = col / (OH * OW);
    let oh = (col / OW) % OH;
    let ow = col % OW;
    var acc = 0.0;
    for (var k0 = 0u; k0 < K; k0 = k0 + {TILE}u) {{
        let ka = k0 + l.x;
        ta[l.y][l.x] = select(0.0, f32(Wt[P[17] + m * K + min(ka, K - 1u)]),
                              mrow < mg && ka < K);
        let kb = k0 + l.y;
        let c = g * cg + kb / (KH * KW);
        let kh = (kb / KW) % KH;
        let kw = kb % KW;
        let ih = i32(oh * P[9] + kh * P[13]) - i32(P[11]);
        let iw = i32(ow * P[10] + kw * P[14]) - i32(P[12]);
        let inside = kb < K && col < cols && ih >= 0 && ih < i32(H) && iw >= 0 && iw < i32(W);
        let xi = select(0u, P[16] + ((n * C + c) * H + u32(ih)) * W + u32(iw), inside);
        tb[l.y][l.x] = select(0.0, f32(X[xi]), inside);
        workgroupBarrier();
        for (var k = 0u; k < {TILE}u; k = k + 1u) {{ acc = acc + ta[l.y][k] * tb[k][l.x]; }}
        workgroupBarrier();
    }}
    if (mrow >= mg || col >= cols) {{ return; }}
    let o = ((n * M + m) * OH + oh) * OW + ow;
    var v = acc;
{bias}{z}    O[P[20] + o] = {t}(act(v));
}}
""")


@functools.cache
def conv_direct(t: str, act: str, with_bias: bool, with_z: bool) -> str:
    """Convolution over (N, C, D, H, W), one invocation per output element (depthwise,
    small and 3-D convs; 1-D and 2-D ones run with unit leading spatial dims).

    P: N, C, D, H, W, M, OD, OH, OW, KD, KH, KW (0..11), strides d/h/w, pads begin d/h/w,
    dilations d/h/w (12..20), group (21), X off, W off, B off, Z off, O off (22..26).
    """
    bias = "    v = v + f32(Bs[P[24] + m]);\n" if with_bias else ""
    z = "    v = v + f32(Z[P[25] + i]);\n" if with_z else ""
    return (_conv_head(t, act, with_bias, with_z) + _MAIN + f"""
    let N = P[0]; let C = P[1]; let D = P[2]; let H = P[3]; let W = P[4]; let M = P[5];
    let OD = P[6]; let OH = P[7]; let OW = P[8]; let KD = P[9]; let KH = P[10]; let KW = P[11];
    if (i >= N * M * OD * OH * OW) {{ return; }}
    let G = P[21];
    let cg = C / G;
    let mg = M / G;
    let ow = i % OW;
    let oh = (i / OW) % OH;
    let od = (i / (OW * OH)) % OD;
    let m = (i / (OW * OH * OD)) % M;
    let n = i / (OW * OH * OD * M);
    let grp = m / mg;
    var v = 0.0;
    for (var cc = 0u; cc < cg; cc = cc + 1u) {{
      let c = grp * cg + cc;
      for (var kd = 0u; kd < KD; kd = kd + 1u) {{
        let id = i32(od * P[12] + kd * P[18]) - i32(P[15]);
        if (id < 0 || id >= i32(D)) {{ continue; }}
        for (var kh = 0u; kh < KH; kh = kh + 1u) {{
            let ih = i32(oh * P[13] + kh * P[19]) - i32(P[16]);
            if (ih < 0 || ih >= i32(H)) {{ continue; }}
            for (var kw = 0u; kw < KW; kw = kw + 1u) {{
                let iw = i32(ow * P[14] + kw * P[20]) - i32(P[17]);
                if (iw < 0 || iw >= i32(W)) {{ continue; }}
                v = v + f32(X[P[22] + (((n * C + c) * D + u32(id)) * H + u32(ih)) * W
                              + u32(iw)])
                      * f32(Wt[P[23] + (((m * cg + cc) * KD + kd) * KH + kh) * KW + kw]);
            }}
        }}
      }}
    }}
{bias}{z}    O[P[26] + i] = {t}(act(v));
}}
""")


@functools.cache
def mask_scores(t: str, causal: bool, boolean: bool) -> str:
    """Attention scores (..., S, T), contiguous, masked in place before the softmax: a
    key after its query (``causal``: j > q) or where the boolean mask is false gets the
    most negative finite value of ``t`` (exp of it less the row's maximum is 0).

    P: n, S, T, scores off (0..3); with ``boolean`` the mask's byte offset (4), the
    scores' shape at 5 and the mask's strides (in bytes, 0 where it repeats) after it.
    """
    low = "-65504.0" if t == "f16" else "-3.4028235e38"
    keep = ["j <= q"] if causal else []
    if boolean:
        keep.append("((M[b / 4u] >> ((b % 4u) * 8u)) & 0xFFu) != 0u")
    load = (f"    let b = u32(i32(P[4]) + at(i, 5u, {5 + MAX_RANK}u));\n" if boolean else "")
    return (_header(t, 1 + int(boolean)) + _buffers(t, ["O"])
            + (_buffers("u32", ["M"], 1) if boolean else "") + _MAIN + f"""
    if (i >= P[0]) {{ return; }}
    let j = i % P[2];
    let q = (i / P[2]) % P[1];
{load}    if (!({" && ".join(keep)})) {{ O[P[3] + i] = {t}({low}); }}
}}
""")


@functools.cache
def pool3d(t: str, kind: str, indices: bool = False) -> str:
    """Max or average pooling over (N, C, D, H, W), one invocation per output element;
    1-D and 2-D pools run here with unit leading spatial dims.

    P: NC, D, H, W, OD, OH, OW, KD, KH, KW, strides d/h/w, pads begin d/h/w, dilations
    d/h/w, count_include_pad (0..19), X off, O off (20, 21), pads end d/h/w (22..24); with
    ``indices`` (max only) the int64 Indices output's offset in words (25) and the storage
    order (26: 1 is column-major, the last spatial dim slowest). Padding past the pads
    (ceil mode) never counts. Max: the first maximum wins, and the first NaN beats any
    number.
    """
    names = ["O", "X"]
    decl = _buffers(t, names) + ("@group(0) @binding(2) var<storage, read_write> Ix: "
                                 "array<u32>;\n" if indices else "")
    if kind == "max":
        step = ("if (!nan && (x > v || is_nan(x))) { v = x; nan = is_nan(x); "
                "arg = select((u32(id) * H + u32(ih)) * W + u32(iw), "
                "(u32(iw) * H + u32(ih)) * D + u32(id), P[26] == 1u); }")
    else:
        step = "v = v + x;"
    final = "v" if kind == "max" else "v / f32(select(count, full, P[19] == 1u))"
    store = ("    Ix[P[25] + 2u * i] = nc * D * H * W + arg;\n"
             "    Ix[P[25] + 2u * i + 1u] = 0u;\n" if indices else "")
    return (_header(t, len(names) + int(indices)) + _MATH + decl + _MAIN + f"""
    let D = P[1]; let H = P[2]; let W = P[3]; let OD = P[4]; let OH = P[5]; let OW = P[6];
    if (i >= P[0] * OD * OH * OW) {{ return; }}
    let ow = i % OW;
    let oh = (i / OW) % OH;
    let od = (i / (OW * OH)) % OD;
    let nc = i / (OW * OH * OD);
    var v = {"-3.4028235e38" if kind == "max" else "0.0"};
    var nan = false;
    var arg = 0u;
    var count = 0u;
    var full = 0u;
    for (var kd = 0u; kd < P[7]; kd = kd + 1u) {{
      let id = i32(od * P[10] + kd * P[16]) - i32(P[13]);
      for (var kh = 0u; kh < P[8]; kh = kh + 1u) {{
        let ih = i32(oh * P[11] + kh * P[17]) - i32(P[14]);
        for (var kw = 0u; kw < P[9]; kw = kw + 1u) {{
            let iw = i32(ow * P[12] + kw * P[18]) - i32(P[15]);
            if (id < i32(D) + i32(P[22]) && ih < i32(H) + i32(P[23])
                && iw < i32(W) + i32(P[24])) {{ full = full + 1u; }}
            if (id < 0 || id >= i32(D) || ih < 0 || ih >= i32(H) || iw < 0 || iw >= i32(W)) {{
                continue;
            }}
            let x = f32(X[P[20] + ((nc * D + u32(id)) * H + u32(ih)) * W + u32(iw)]);
            {step}
            count = count + 1u;
        }}
      }}
    }}
    O[P[21] + i] = {t}({final});
{store}}}
""")


@functools.cache
def rows(t: str, kind: str, bias: bool = False, skip: bool = False, stats: bool = False,
         total: bool = False) -> str:
    """One workgroup per row of a contiguous (rows, L) input: ``sum``/``mean``/``max``/
    ``min``/``prod`` reductions to one value per row, ``softmax`` or ``log_softmax`` of each
    row, or ``layer_norm`` (with
    optional bias, skip input added first, Mean/InvStdDev outputs, and the sum X + skip as
    an output), each with a fixed-order tree reduction in workgroup memory, so a row's
    result does not depend on timing.

    P: rows, L, X off, O off, epsilon (f32), scale off, bias off, mean off, inv-std off,
    skip off, skip numel, sum-out off (0..11). Bindings: O, X, then those the kind uses
    in the order scale, bias, skip, mean, inv-std, sum-out.
    """
    names = ["O", "X"]
    if kind == "layer_norm":
        names += ["Sc"] + (["Bi"] if bias else []) + (["Sk"] if skip else []) \
            + (["Mn", "Iv"] if stats else []) + (["Su"] if total else [])
    first = "max" if kind in ("max", "softmax", "log_softmax") else \
        kind if kind in ("min", "prod") else "sum"
    gather, start, combine = {
        "max": ("v = maxn(v, xin(base + j));", "bitcast<f32>(0xff800000u)",     # -inf
                "maxn(red[k], red[k + s])"),
        "min": ("v = minn(v, xin(base + j));", "bitcast<f32>(0x7f800000u)",     # +inf
                "minn(red[k], red[k + s])"),
        "prod": ("v = v * xin(base + j);", "1.0", "red[k] * red[k + s]"),
        "sum": ("v = v + xin(base + j);", "0.0", "red[k] + red[k + s]"),
    }[first]
    xin = ("return f32(X[k]) + f32(Sk[P[9] + (k - P[2]) % P[10]]);" if skip
           else "return f32(X[k]);")
    if kind in ("sum", "max", "min", "prod"):
        body = "    if (l.x == 0u) { O[P[3] + r] = T(red[0]); }\n"
    elif kind == "mean":
        body = "    if (l.x == 0u) { O[P[3] + r] = T(red[0] / f32(L)); }\n"
    elif kind in ("softmax", "log_softmax"):
        value = "(xin(base + j) - mx) - log(total)" if kind == "log_softmax" \
            else "exp(xin(base + j) - mx) / total"
        body = """
    let mx = red[0];
    workgroupBarrier();
    var s = 0.0;
    for (var j = l.x; j < L; j = j + G) { s = s + exp(xin(base + j) - mx); }
    red[l.x] = s;
    tree(l.x);
    let total = red[0];
    for (var j = l.x; j < L; j = j + G) {
        O[P[3] + r * L + j] = T(""" + value + """);
    }
"""
    else:
        body = ("""
    let mean = red[0] / f32(L);
    workgroupBarrier();
    var s = 0.0;
    for (var j = l.x; j < L; j = j + G) { let d = xin(base + j) - mean; s = s + d * d; }
    red[l.x] = s;
    tree(l.x);
    let inv = 1.0 / sqrt(red[0] / f32(L) + pf(4u));
    for (var j = l.x; j < L; j = j + G) {
        let x = T(xin(base + j));
        var y = (f32(x) - mean) * inv * f32(Sc[P[5] + j]);
""" + ("        y = y + f32(Bi[P[6] + j]);\n" if bias else "")
            + "        O[P[3] + r * L + j] = T(y);\n"
            + ("        Su[P[11] + r * L + j] = x;\n" if total else "") + "    }\n"
            + ("    if (l.x == 0u) { Mn[P[7] + r] = mean; Iv[P[8] + r] = inv; }\n"
               if stats else ""))
    decl = "".join(f"@group(0) @binding({k}) var<storage, read_write> {n}: "
                   f"array<{'f32' if n in ('Mn', 'Iv') else t}>;\n"   # statistics: float32
                   for k, n in enumerate(names))
    return (_header(t, len(names)) + _MATH + f"alias T = {t};\n" + decl + f"""
const G = {GROUP}u;
var<workgroup> red: array<f32, {GROUP}>;

fn xin(k: u32) -> f32 {{ {xin} }}

fn tree(k: u32) {{
    workgroupBarrier();
    for (var s = G / 2u; s > 0u; s = s / 2u) {{
        if (k < s) {{ red[k] = red[k] + red[k + s]; }}
        workgroupBarrier();
    }}
}}

fn tree_first(k: u32) {{
    workgroupBarrier();
    for (var s = G / 2u; s > 0u; s = s / 2u) {{
        if (k < s) {{ red[k] = {combine}; }}
        workgroupBarrier();
    }}
}}

@compute @workgroup_size({GROUP})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_id) l: vec3<u32>) {{
    let r = wg.x + wg.y * nw.x;
    if (r >= P[0]) {{ return; }}
    let L = P[1];
    let base = P[2] + r * L;
    var v = {start};
    for (var j = l.x; j < L; j = j + G) {{ {gather} }}
    red[l.x] = v;
    tree_first(l.x);
{body}}}
""")


@functools.cache
def arg_rows(t: str, kind: str, last: bool) -> str:
    """ArgMax (``kind`` "max") or ArgMin of each row of a contiguous (rows, L) input, one
    invocation per row, as int64 (two u32 words). The first extreme wins (the last with
    ``last``); a NaN is an extreme, as NumPy's argmax and argmin have it.

    P: rows, L, X off, O off in words (0..3). ``t``: f32, f16 or i32.
    """
    v = "i32" if t == "i32" else "f32"
    nan = "false" if t == "i32" else "is_nan(x)"
    cmp = ">" if kind == "max" else "<"
    if last:
        take = f"{nan} || (!found_nan && x {cmp}= best)"
    else:
        take = f"!found_nan && ({nan} || x {cmp} best)"
    return (_header(t, 2) + _MATH + _buffers("u32", ["O"]) + _buffers(t, ["X"], 1) + _MAIN + f"""
    if (i >= P[0]) {{ return; }}
    let L = P[1];
    let base = P[2] + i * L;
    var best = {v}(X[base]);
    var arg = 0u;
    var found_nan = {"false" if t == "i32" else "is_nan(f32(best))"};
    for (var j = 1u; j < L; j = j + 1u) {{
        let x = {v}(X[base + j]);
        if ({take}) {{ best = x; arg = j; found_nan = found_nan || {nan}; }}
    }}
    O[P[3] + 2u * i] = arg;
    O[P[3] + 2u * i + 1u] = 0u;
}}
""")
