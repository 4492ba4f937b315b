/* Single-precision transcendental kernels for transformer layers.
 *
 *   keel_unary_f32       y = f(x) elementwise: erf, exact GELU, tanh GELU,
 *                        sigmoid, x * sigmoid(alpha * x)
 *   keel_bias_unary_f32  y = f(x + bias) over rows (a MatMul's bias + activation)
 *   keel_layer_norm_f32  (x - mean) / sqrt(var + eps) * gamma + beta per row
 *   keel_skip_layer_norm_f32  the same of x + skip (a residual sum), in the same pass
 *   keel_softmax_f32     softmax / log-softmax along each row
 *   keel_attend_rows_f32 softmax(scale * Q Kᵀ + mask) V, one query row at a time
 *
 * NumPy spends one pass over memory per operation of a formula (exact GELU is
 * ~26 of them); these kernels read each element once and write it once, with
 * every function evaluated in registers.
 *
 * Accuracy, float32 results against float64 math (10^7 points; max / mean ulp):
 * erf 2.4 / 0.3, exact GELU 6.2 / 0.6 (4e-7 relative), sigmoid 2.4 / 0.5,
 * x * sigmoid(x) 3.2 / 0.5, tanh GELU 2.8 for x >= -1 and 2.5 (1 + |2u|) below,
 * where the rounding of its cubic argument 2u dominates.
 *   exp      Cody-Waite reduction (ln 2 in two parts) and the Cephes expf
 *            polynomial; the argument may come as a sum a + b whose low part b
 *            is added after the reduction, so exp(-x^2/2) and exp(x - max) see
 *            their exact argument. Subnormal results are kept (AVX-512 scalef,
 *            else 2^n as two normal powers of two).
 *   erfc(a)  t * exp(-a^2) * Q(u), t = 2 / (2 + a), a >= 0, u mapping t in
 *            [2/12.5, 1] onto [-1, 1]; Q the degree-8 Chebyshev interpolant of
 *            erfc(a) e^(a^2) / t there (5.4e-8 relative before float32
 *            rounding). Relative accuracy holds in the tail, where erfc is tiny,
 *            so GELU of negative x is accurate as x * erfc(-x / sqrt 2) / 2,
 *            without the cancellation of 1 + erf.
 *   erf(x)   x * S(x^2) for |x| < 1 (S: degree-6 Chebyshev interpolant of
 *            erf(x) / x in x^2 on [0, 1]), else sign(x) * (1 - erfc(|x|)).
 * The coefficients were computed in float64 with numpy.polynomial.chebyshev
 * (chebinterpolate on the stated interval, converted to a power series).
 * Sums (LayerNorm statistics, softmax denominators) accumulate in float64.
 * Special values follow the float64 formulas: NaN stays NaN, erf(+-inf) = +-1,
 * gelu(inf) = inf, gelu(-inf) = -inf * 0 = NaN (as 0.5 * x * (1 + erf(..))),
 * sigmoid(-inf) = 0; softmax of a row holding NaN or +inf is NaN, of a row of
 * -inf NaN (exp(x - max) with max = -inf) or zeros (mode 2, ONNX Attention's
 * fully masked rows).
 *
 * Every exported function takes a sub-range [lo, hi) of elements or rows, and
 * computes each element by the same instructions wherever the range starts:
 * the last partial vector goes through a stack buffer and the same vector
 * code as the rest, so any split over threads gives bitwise the same result.
 * Nothing allocates; inputs and outputs may be the same array (in place).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
/* Vectors wider than the target's registers are fine inside this file. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include "vec.h"

typedef float vfh __attribute__((vector_size(VW * 2)));     /* half a vf */
typedef double vdh __attribute__((vector_size(VW * 4)));    /* a vfh widened: one register */

/* Activation kinds: the numbering keel/backends/cpu/fastmath.py uses. */
enum { K_IDENTITY = 0, K_ERF = 1, K_GELU = 2, K_GELU_TANH = 3, K_SIGMOID = 4, K_SILU = 5 };
/* Softmax modes. */
enum { M_SOFTMAX = 0, M_LOG_SOFTMAX = 1, M_SOFTMAX_DEAD_ZERO = 2 };

static inline vf splat(float a) { return (vf){0} + a; }
static inline vf vabs(vf a) { return (vf)((vi)a & 0x7fffffff); }

/* ---- exp ------------------------------------------------------------------------- */
/* Every exp here has a non-positive argument (exp(-x^2/2), exp(-|w|), exp(x - max)),
 * so nothing overflows and only the low end needs a bound. */
#define EXP_LO (-170.0f)            /* exp(a) for a below is 0, even times a factor c up
                                       to 1e28; 2^n then stays within two normal powers */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f         /* 355/512: n * LN2_HI is exact for |n| < 2^15 */
#define LN2_LO (-2.12194440e-4f)
#define ROUND_MAGIC 12582912.0f     /* 1.5 * 2^23: adding it rounds to an integer */

/* p * c * 2^n for an integral n in [-246, 0] (NaN n only where p is NaN). */
static inline vf vscale(vf p, vf c, vf n)
{
#if defined(__AVX512F__)
    /* One rounding, subnormal results included. */
    return (vf)_mm512_scalef_ps((__m512)(p * c), (__m512)n);
#else
    /* 2^n as two normal powers of two; p * s1 is exact, so a subnormal result is
     * at most one subnormal step from the correctly rounded one. A NaN n (p is NaN
     * there too) becomes 0 before the conversion, which C leaves undefined for NaN. */
    n = (vf)((vi)n & (n == n));
    vi ni = __builtin_convertvector(n, vi);
    vi n1 = ni >> 1, n2 = ni - n1;
    vf s1 = (vf)((n1 + 127) << 23), s2 = (vf)((n2 + 127) << 23);
    return p * s1 * c * s2;
#endif
}

/* c * exp(a + b) for a <= 0, -inf or NaN, with b small beside a (the low part of an
 * exact argument: exp(-x^2/2), exp(x - max)); b may be NaN only where a is not
 * finite. Cody-Waite reduction, then the Cephes expf polynomial. */
static inline vf vexp_scaled(vf a, vf b, vf c)
{
    vi low = a < EXP_LO;                         /* -inf too; false for NaN */
    vf z = vselect(low, splat(EXP_LO), a);
    vf n = (z * LOG2E + ROUND_MAGIC) - ROUND_MAGIC;
    vf r = (z - n * LN2_HI) - n * LN2_LO + b;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    p = (vf)((vi)p & ~low);                      /* exactly 0: an inf factor gives NaN */
    return vscale(p, c, n);
}

static inline vf vexp(vf a) { return vexp_scaled(a, splat(0.0f), splat(1.0f)); }

/* x^2 as hi + lo with hi exact: hi squares the top 12 significant bits of x. */
static inline void vsquare2(vf x, vf *hi, vf *lo)
{
    vf xh = (vf)((vi)x & (int32_t)0xfffff000);
    *hi = xh * xh;
    *lo = (x - xh) * (x + xh);
}

/* ---- erf, erfc, GELU -------------------------------------------------------------- */
/* c * erfc(a) for a >= 0 (inf and NaN too), given a^2 = a2h + a2l. Q is a polynomial
 * in u = (t - mid) / half-width of its interval, where its coefficients are small. */
static inline vf verfc_scaled(vf a, vf a2h, vf a2l, vf c)
{
    vf t = 2.0f / (a + 2.0f);
    vf u = t * 2.380952380952381f - 1.380952380952381f;
    vf q = splat(-5.810831135e-05f);
    q = q * u + 2.468174171e-05f;
    q = q * u + 6.153885042e-04f;
    q = q * u + -6.861686124e-04f;
    q = q * u + -6.324627902e-03f;
    q = q * u + 6.311617792e-03f;
    q = q * u + 1.035207883e-01f;
    q = q * u + 3.271876574e-01f;
    q = q * u + 5.694087148e-01f;
    return vexp_scaled(-a2h, -a2l, c * t * q);
}

static inline vf verf(vf x)
{
    vf x2 = x * x;
    vf s = splat(7.875874871e-05f);
    s = s * x2 + -8.016864303e-04f;
    s = s * x2 + 5.189087242e-03f;
    s = s * x2 + -2.685421146e-02f;
    s = s * x2 + 1.128359437e-01f;
    s = s * x2 + -3.761262596e-01f;
    s = s * x2 + 1.128379107e+00f;
    vf near = x * s;
    vf a = vabs(x), h, l;
    vsquare2(a, &h, &l);
    vf far = 1.0f - verfc_scaled(a, h, l, splat(1.0f));
    far = (vf)((vi)far | ((vi)x & (int32_t)0x80000000));  /* sign of x */
    return vselect(a < 1.0f, near, far);
}

#define INV_SQRT2 0.70710678118654752f

/* x * Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2: for x < 0 the product x * Phi(-|x|)
 * is one rounding (the tail may be subnormal); for x >= 0, x - x * Phi(-|x|).
 * (x / sqrt 2)^2 = x^2 / 2 keeps its low part. x = inf: x - 0; x = -inf: -inf * 0. */
static inline vf vgelu(vf x)
{
    vf h, l;
    vsquare2(x, &h, &l);
    vf c = 0.5f * vselect(x == INFINITY, splat(0.0f), x);
    vf tail = verfc_scaled(vabs(x) * INV_SQRT2, 0.5f * h, 0.5f * l, c);
    return vselect(x <= 0.0f, tail, x - tail);
}

/* x * sigmoid(w) as x * e / (1 + e) for w < 0 (e = exp(-|w|): no overflow, and the
 * numerator x * e rounded once even when it is subnormal), x / (1 + e) otherwise. */
static inline vf vx_sigmoid(vf x, vf w)
{
    vf e = vexp(-vabs(w));
    vf num = vselect(w >= 0.0f, x, vexp_scaled(-vabs(w), splat(0.0f), x));
    return num / (1.0f + e);
}

#define GELU_K 1.5957691216057308f               /* 2 sqrt(2 / pi) */
#define GELU_K3 0.07135481627260025f             /* 2 sqrt(2 / pi) * 0.044715 */

/* 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3). */
static inline vf vgelu_tanh(vf x)
{
    return vx_sigmoid(x, x * (GELU_K + GELU_K3 * (x * x)));
}

static inline vf vact(int kind, vf x, float alpha)
{
    switch (kind) {
    case K_ERF: return verf(x);
    case K_GELU: return vgelu(x);
    case K_GELU_TANH: return vgelu_tanh(x);
    case K_SIGMOID: return vx_sigmoid(splat(1.0f), x);
    case K_SILU: return vx_sigmoid(x, x * alpha);
    default: return x;
    }
}

/* One loop per kind, so the switch runs once per call, not per vector. The tail
 * calls the same non-inlined function on a padded buffer: one instruction
 * sequence for every element. */
#define ACT_LOOP(KIND)                                                           \
    case KIND:                                                                   \
        for (int64_t i = 0; i < nvec; i++) {                                     \
            vf v = vload(x + i * VW);                                            \
            if (bias) v += vload(bias + i * VW);                                 \
            vstore(y + i * VW, vact(KIND, v, alpha));                            \
        }                                                                        \
        break;

__attribute__((noinline))
static void act_vectors(int kind, const float *x, const float *bias, float *y, int64_t nvec,
                        float alpha)
{
    switch (kind) {
    ACT_LOOP(K_ERF)
    ACT_LOOP(K_GELU)
    ACT_LOOP(K_GELU_TANH)
    ACT_LOOP(K_SIGMOID)
    ACT_LOOP(K_SILU)
    default:
        ACT_LOOP(K_IDENTITY)
    }
}

/* y[0:n] = f(x[0:n] + bias[0:n]) (bias may be NULL). */
static void act_span(int kind, const float *x, const float *bias, float *y, int64_t n,
                     float alpha)
{
    int64_t full = n / VW * VW;
    act_vectors(kind, x, bias, y, full / VW, alpha);
    int64_t rest = n - full;
    if (rest > 0) {
        float bx[VW] = {0}, bb[VW] = {0};
        memcpy(bx, x + full, (size_t)rest * sizeof(float));
        if (bias) memcpy(bb, bias + full, (size_t)rest * sizeof(float));
        act_vectors(kind, bx, bias ? bb : NULL, bx, 1, alpha);
        memcpy(y + full, bx, (size_t)rest * sizeof(float));
    }
}

/* y[lo:hi] = f(x[lo:hi]). */
void keel_unary_f32(int32_t kind, const float *x, float *y, int64_t lo, int64_t hi, float alpha)
{
    if (hi > lo) act_span(kind, x + lo, NULL, y + lo, hi - lo, alpha);
}

/* Rows [lo, hi) of (rows, n) matrices: y[r, :] = f(x[r, :] + bias[:]); bias may be NULL. */
void keel_bias_unary_f32(int32_t kind, const float *x, const float *bias, float *y, int64_t n,
                         int64_t lo, int64_t hi, float alpha)
{
    for (int64_t r = lo; r < hi; r++) act_span(kind, x + r * n, bias, y + r * n, n, alpha);
}

/* ---- layer normalization ------------------------------------------------------------ */
/* A float64 accumulator of VW lanes, as two register-sized halves (a wider vector
 * type would live in memory and put a store-to-load delay in every iteration). */
typedef struct { vdh lo, hi; } acc_t;

#if defined(__clang__) || __GNUC__ >= 12
#if VW == 16
#define LOW_HALF 0, 1, 2, 3, 4, 5, 6, 7
#define HIGH_HALF 8, 9, 10, 11, 12, 13, 14, 15
#elif VW == 8
#define LOW_HALF 0, 1, 2, 3
#define HIGH_HALF 4, 5, 6, 7
#else
#define LOW_HALF 0, 1
#define HIGH_HALF 2, 3
#endif
static inline void widen(vf v, vdh *lo, vdh *hi)
{
    *lo = __builtin_convertvector(__builtin_shufflevector(v, v, LOW_HALF), vdh);
    *hi = __builtin_convertvector(__builtin_shufflevector(v, v, HIGH_HALF), vdh);
}
#else
static inline void widen(vf v, vdh *lo, vdh *hi)
{
    vfh l, h;
    memcpy(&l, &v, sizeof l);
    memcpy(&h, (const char *)&v + sizeof l, sizeof h);
    *lo = __builtin_convertvector(l, vdh);
    *hi = __builtin_convertvector(h, vdh);
}
#endif

static inline void acc_add(acc_t *a, vf v)
{
    vdh l, h;
    widen(v, &l, &h);
    a->lo += l;
    a->hi += h;
}

static inline void acc_add_squares(acc_t *a, vf v)
{
    vdh l, h;
    widen(v, &l, &h);
    a->lo += l * l;
    a->hi += h * h;
}

/* Pairwise, halving the lanes each step (a short dependency chain for short rows). */
static inline double acc_total(acc_t a0, acc_t a1)
{
    vdh t = (a0.lo + a1.lo) + (a0.hi + a1.hi);
    double h[VW / 2];
    memcpy(h, &t, sizeof h);
    for (int w = VW / 4; w > 0; w /= 2)
        for (int j = 0; j < w; j++) h[j] += h[j + w];
    return h[0];
}

/* Sum of a row in float64 (two accumulators for the adder's latency). */
static double row_sum(const float *x, int64_t k)
{
    acc_t a0 = {0}, a1 = {0};
    int64_t i = 0;
    for (; i + 2 * VW <= k; i += 2 * VW) {
        acc_add(&a0, vload(x + i));
        acc_add(&a1, vload(x + i + VW));
    }
    for (; i + VW <= k; i += VW) acc_add(&a0, vload(x + i));
    double s = acc_total(a0, a1);
    for (; i < k; i++) s += x[i];
    return s;
}

/* Sum of (x - m)^2 in float64, m = mh + ml (x - mh is exact near the mean). */
static double row_centered_squares(const float *x, int64_t k, float mh, float ml)
{
    acc_t a0 = {0}, a1 = {0};
    int64_t i = 0;
    for (; i + 2 * VW <= k; i += 2 * VW) {
        acc_add_squares(&a0, (vload(x + i) - mh) - ml);
        acc_add_squares(&a1, (vload(x + i + VW) - mh) - ml);
    }
    for (; i + VW <= k; i += VW) acc_add_squares(&a0, (vload(x + i) - mh) - ml);
    double s = acc_total(a0, a1);
    for (; i < k; i++) {
        double d = (double)((x[i] - mh) - ml);
        s += d * d;
    }
    return s;
}

static inline vf norm_vec(vf v, float mh, float ml, float inv, vf g, vf b)
{
    return ((v - mh) - ml) * inv * g + b;
}

static void norm_row(const float *x, const float *g, const float *b, float *y, int64_t k,
                     float mh, float ml, float inv)
{
    int64_t i = 0;
    for (; i + VW <= k; i += VW)
        vstore(y + i, norm_vec(vload(x + i), mh, ml, inv, vload(g + i), vload(b + i)));
    int64_t rest = k - i;
    if (rest > 0) {
        float bx[VW] = {0}, bg[VW] = {0}, bb[VW] = {0};
        memcpy(bx, x + i, (size_t)rest * sizeof(float));
        memcpy(bg, g + i, (size_t)rest * sizeof(float));
        memcpy(bb, b + i, (size_t)rest * sizeof(float));
        vstore(bx, norm_vec(vload(bx), mh, ml, inv, vload(bg), vload(bb)));
        memcpy(y + i, bx, (size_t)rest * sizeof(float));
    }
}

/* One row given its float64 sum: the variance of the centered row, then y. Returns
 * 1 / sqrt(var + eps); *mean_out receives the mean's high part. */
static float layer_norm_row(const float *xr, double total, const float *gamma,
                            const float *beta, float *yr, int64_t k, float eps, float *mean_out)
{
    double m = total / (double)k;
    float mh = (float)m, ml = (float)(m - (double)mh);
    double var = row_centered_squares(xr, k, mh, ml) / (double)k;
    double inv = 1.0 / sqrt(var + (double)eps);
    norm_row(xr, gamma, beta, yr, k, mh, ml, (float)inv);
    *mean_out = mh;
    return (float)inv;
}

/* Rows [lo, hi) of (rows, k) x: y = (x - mean) / sqrt(var + eps) * gamma + beta, the
 * statistics in float64 (mean, then the centered squares). mean and inv_std (one
 * float per row) may be NULL. k > 0. */
void keel_layer_norm_f32(const float *x, const float *gamma, const float *beta, float *y,
                         float *mean, float *inv_std, int64_t k, float eps, int64_t lo,
                         int64_t hi)
{
    for (int64_t r = lo; r < hi; r++) {
        const float *xr = x + r * k;
        float mh;
        float inv = layer_norm_row(xr, row_sum(xr, k), gamma, beta, y + r * k, k, eps, &mh);
        if (mean) mean[r] = mh;
        if (inv_std) inv_std[r] = inv;
    }
}

/* s = x + skip over a row, returning the sum of s in float64: the additions of
 * row_sum in the same order, so the statistics equal row_sum(s) bit for bit. s may
 * be x (in place). */
static double add_row_sum(const float *x, const float *skip, float *s, int64_t k)
{
    acc_t a0 = {0}, a1 = {0};
    int64_t i = 0;
    for (; i + 2 * VW <= k; i += 2 * VW) {
        vf u = vload(x + i) + vload(skip + i), v = vload(x + i + VW) + vload(skip + i + VW);
        vstore(s + i, u);
        vstore(s + i + VW, v);
        acc_add(&a0, u);
        acc_add(&a1, v);
    }
    for (; i + VW <= k; i += VW) {
        vf u = vload(x + i) + vload(skip + i);
        vstore(s + i, u);
        acc_add(&a0, u);
    }
    double t = acc_total(a0, a1);
    for (; i < k; i++) {
        s[i] = x[i] + skip[i];
        t += s[i];
    }
    return t;
}

/* Rows [lo, hi) of (rows, k) x: s = x + skip, then keel_layer_norm_f32 of s (bitwise
 * the same as an Add followed by it). Row r adds skip row r % skip_rows (a skip
 * broadcast over leading axes). s is written to sum when sum is not NULL (a graph
 * that reads the residual sum elsewhere), else to y, which is then normalized in
 * place: one pass over x and skip, the row staying in cache. y may be x. k > 0. */
void keel_skip_layer_norm_f32(const float *x, const float *skip, int64_t skip_rows,
                              const float *gamma, const float *beta, float *y, float *sum,
                              int64_t k, float eps, int64_t lo, int64_t hi)
{
    for (int64_t r = lo; r < hi; r++) {
        float *yr = y + r * k;
        float *sr = sum ? sum + r * k : yr;
        double total = add_row_sum(x + r * k, skip + (r % skip_rows) * k, sr, k);
        float mh;
        layer_norm_row(sr, total, gamma, beta, yr, k, eps, &mh);
    }
}

/* ---- softmax ------------------------------------------------------------------------ */
/* The row maximum; NaN when the row holds a NaN (as NumPy's max). Four running
 * maxima hide the compare-and-select latency. */
static float row_max(const float *x, int64_t n)
{
    vf m0 = splat(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    vi nan = {0};
    int64_t i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW) {
        vf v0 = vload(x + i), v1 = vload(x + i + VW);
        vf v2 = vload(x + i + 2 * VW), v3 = vload(x + i + 3 * VW);
        m0 = vselect(v0 > m0, v0, m0);
        m1 = vselect(v1 > m1, v1, m1);
        m2 = vselect(v2 > m2, v2, m2);
        m3 = vselect(v3 > m3, v3, m3);
        nan |= (v0 != v0) | (v1 != v1) | (v2 != v2) | (v3 != v3);
    }
    for (; i + VW <= n; i += VW) {
        vf v = vload(x + i);
        m0 = vselect(v > m0, v, m0);
        nan |= v != v;
    }
    m0 = vselect(m1 > m0, m1, m0);
    m2 = vselect(m3 > m2, m3, m2);
    m0 = vselect(m2 > m0, m2, m0);
    float h[VW];
    int32_t bad[VW];
    memcpy(h, &m0, sizeof h);
    memcpy(bad, &nan, sizeof bad);
    for (int w = VW / 2; w > 0; w /= 2)             /* pairwise, halving the lanes */
        for (int j = 0; j < w; j++) {
            h[j] = h[j + w] > h[j] ? h[j + w] : h[j];
            bad[j] |= bad[j + w];
        }
    float s = h[0];
    int any_nan = bad[0];
    for (; i < n; i++) {
        s = x[i] > s ? x[i] : s;
        any_nan |= x[i] != x[i];
    }
    return any_nan ? NAN : s;
}

/* exp(x - m) with the difference's rounding error fed to exp (TwoSum). */
static inline vf exp_shifted(vf x, float m)
{
    vf s = x - m;
    vf bb = s - x;
    vf err = (x - (s - bb)) + (-m - bb);
    return vexp_scaled(s, err, splat(1.0f));
}

/* Vectors of exp values summed in float32 before each float64 accumulation:
 * widening to float64 costs as much as the exp itself, so it runs once per block
 * (a lane's block sum of at most 8 terms in [0, 1] is within 4 ulp). */
#define SUM_BLOCK 8

/* y = exp(x - m) over a row (y may be NULL); returns the sum (float64). */
static double exp_row(const float *x, float *y, int64_t n, float m)
{
    acc_t a0 = {0}, a1 = {0};
    int64_t i = 0;
    while (i + VW <= n) {
        vf block = splat(0.0f);
        for (int j = 0; j < SUM_BLOCK && i + VW <= n; j++, i += VW) {
            vf e = exp_shifted(vload(x + i), m);
            if (y) vstore(y + i, e);
            block += e;
        }
        acc_add(&a0, block);
    }
    double s = acc_total(a0, a1);
    int64_t rest = n - i;
    if (rest > 0) {
        float b[VW];
        for (int j = 0; j < VW; j++) b[j] = j < rest ? x[i + j] : -INFINITY;
        vf e = exp_shifted(vload(b), m);
        vstore(b, e);
        for (int j = 0; j < rest; j++) s += b[j];
        if (y) memcpy(y + i, b, (size_t)rest * sizeof(float));
    }
    return s;
}

static void scale_row(float *y, int64_t n, float c)
{
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(y + i, vload(y + i) * c);
    for (; i < n; i++) y[i] *= c;
}

/* (x - m) - log_sum, the difference's rounding error added back (TwoSum). */
static inline vf log_vec(vf x, float m, float log_sum)
{
    vf s = x - m;
    vf bb = s - x;
    vf err = (x - (s - bb)) + (-m - bb);
    vi finite = (s - s) == 0;
    return (s - log_sum) + (vf)((vi)err & finite);
}

static void log_row(const float *x, float *y, int64_t n, float m, float log_sum)
{
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(y + i, log_vec(vload(x + i), m, log_sum));
    int64_t rest = n - i;
    if (rest > 0) {
        float b[VW] = {0};
        memcpy(b, x + i, (size_t)rest * sizeof(float));
        vstore(b, log_vec(vload(b), m, log_sum));
        memcpy(y + i, b, (size_t)rest * sizeof(float));
    }
}

/* Rows [lo, hi) of (rows, n) matrices, along each row (n > 0): mode 0 softmax,
 * 1 log-softmax, 2 softmax with rows of only -inf giving zeros. */
void keel_softmax_f32(const float *x, float *y, int64_t n, int64_t lo, int64_t hi, int32_t mode)
{
    for (int64_t r = lo; r < hi; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float m = row_max(xr, n);
        if (mode == M_SOFTMAX_DEAD_ZERO && m == -INFINITY) {
            memset(yr, 0, (size_t)n * sizeof(float));
            continue;
        }
        if (mode == M_LOG_SOFTMAX) {
            double s = exp_row(xr, NULL, n, m);
            log_row(xr, yr, n, m, (float)log(s));
            continue;
        }
        double s = exp_row(xr, yr, n, m);
        scale_row(yr, n, (float)(1.0 / s));
    }
}

/* ---- attention, one query row at a time ---------------------------------------------- */
/* The dot product of two rows of n floats: VW lanes, then the lanes pairwise. */
static float row_dot(const float *a, const float *b, int64_t n)
{
    vf acc0 = splat(0.0f), acc1 = acc0;
    int64_t i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        acc0 += vload(a + i) * vload(b + i);
        acc1 += vload(a + i + VW) * vload(b + i + VW);
    }
    for (; i + VW <= n; i += VW) acc0 += vload(a + i) * vload(b + i);
    acc0 += acc1;
    float h[VW];
    memcpy(h, &acc0, sizeof h);
    for (int w = VW / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) h[j] += h[j + w];
    float s = h[0];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y += c * x over n floats. */
static void row_axpy(float *y, const float *x, int64_t n, float c)
{
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(y + i, vload(y + i) + c * vload(x + i));
    for (; i < n; i++) y[i] += c * x[i];
}

/* Heads [lo, hi) of attention with q (heads, s, d), k (heads, t, d), v (heads, t, dv) and
 * y (heads, s, dv), all contiguous, for short sequences (each query row's scores fit
 * `scratch`, t floats). Per query row: scores_j = scale * q·k_j (+ mask, a row of t
 * floats at (h / inner) * mb + (h % inner) * mh + i * ms; NULL: none; -inf for j > i
 * under causal), then y = sum_j exp(scores_j - max) v_j / sum_j exp(scores_j - max).
 * A row whose scores are all -inf, or hold a NaN, gives NaN (as the reference's
 * softmax). Each head is computed alone, by the same instructions for any [lo, hi). */
static void attend_rows(const float *q, const float *k, const float *v, const float *mask,
                        float *y, float *scratch, int64_t inner, int64_t s, int64_t t,
                        int64_t d, int64_t dv, int64_t mb, int64_t mh, int64_t ms,
                        float scale, int32_t causal, int64_t lo, int64_t hi)
{
    for (int64_t h = lo; h < hi; h++) {
        const float *kh = k + h * t * d, *vh = v + h * t * dv;
        const float *mh_row = mask ? mask + (h / inner) * mb + (h % inner) * mh : NULL;
        for (int64_t i = 0; i < s; i++) {
            const float *qi = q + (h * s + i) * d;
            float *yi = y + (h * s + i) * dv;
            for (int64_t j = 0; j < t; j++) scratch[j] = scale * row_dot(qi, kh + j * d, d);
            if (mh_row) {
                const float *mi = mh_row + i * ms;
                for (int64_t j = 0; j < t; j++) scratch[j] += mi[j];
            }
            if (causal)
                for (int64_t j = i + 1; j < t; j++) scratch[j] = -INFINITY;
            float m = row_max(scratch, t);
            if (m == -INFINITY || m != m) {
                for (int64_t c = 0; c < dv; c++) yi[c] = NAN;
                continue;
            }
            double total = exp_row(scratch, scratch, t, m);
            memset(yi, 0, (size_t)dv * sizeof(float));
            for (int64_t j = 0; j < t; j++) row_axpy(yi, vh + j * dv, dv, scratch[j]);
            scale_row(yi, dv, (float)(1.0 / total));
        }
    }
}

/* The scores of up to this many keys live on the stack; longer rows need `scratch`. */
#define ATTEND_STACK 4096

/* attend_rows on this thread; `scratch` (t floats) may be NULL for t <= ATTEND_STACK.
 * Returns 0, or -1 (nothing written) when a longer row comes without scratch. */
int32_t keel_attend_rows_f32(const float *q, const float *k, const float *v, const float *mask,
                             float *y, float *scratch, int64_t inner, int64_t s, int64_t t,
                             int64_t d, int64_t dv, int64_t mb, int64_t mh, int64_t ms,
                             float scale, int32_t causal, int64_t lo, int64_t hi)
{
    float stack[ATTEND_STACK];
    if (!scratch) {
        if (t > ATTEND_STACK) return -1;
        scratch = stack;
    }
    attend_rows(q, k, v, mask, y, scratch, inner, s, t, d, dv, mb, mh, ms, scale, causal, lo,
                hi);
    return 0;
}

/* ---- on keel's worker threads ------------------------------------------------------
 * Each kernel above over [0, n) (elements for unary, rows for the others) in `parts`
 * chunks on keel's worker threads; every element or row is computed as it would be on
 * one thread. Return 0, or -1 when a thread's scratch could not be allocated. */

#include "parallel.h"

typedef struct {
    const float *q, *k, *v, *mask;
    float *y;
    int64_t inner, s, t, d, dv, mb, mh, ms;
    float scale;
    int32_t causal;
} att_job;

static void attend_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const att_job *j = ctx;
    attend_rows(j->q, j->k, j->v, j->mask, j->y, s, j->inner, j->s, j->t, j->d, j->dv,
                         j->mb, j->mh, j->ms, j->scale, j->causal, lo, hi);
}

/* keel_attend_rows_f32 over `heads` heads in `parts` chunks, each thread's scratch its
 * own. */
int64_t keel_attend_rows_mt_f32(const float *q, const float *k, const float *v,
                                const float *mask, float *y, int64_t inner, int64_t s,
                                int64_t t, int64_t d, int64_t dv, int64_t mb, int64_t mh,
                                int64_t ms, float scale, int32_t causal, int64_t heads,
                                int64_t parts)
{
    att_job j = {.q = q, .k = k, .v = v, .mask = mask, .y = y, .inner = inner, .s = s, .t = t,
                 .d = d, .dv = dv, .mb = mb, .mh = mh, .ms = ms, .scale = scale,
                 .causal = causal};
    return run_parts(attend_task, &j, heads, parts, t);
}

typedef struct {
    int32_t kind, mode;
    const float *x, *skip, *gamma, *beta, *bias;
    float *y, *mean, *inv_std, *sum;
    int64_t k, skip_rows;
    float eps, alpha;
} fm_job;

static void unary_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const fm_job *j = ctx;
    (void)s;
    keel_unary_f32(j->kind, j->x, j->y, lo, hi, j->alpha);
}

static void bias_unary_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const fm_job *j = ctx;
    (void)s;
    keel_bias_unary_f32(j->kind, j->x, j->bias, j->y, j->k, lo, hi, j->alpha);
}

static void layer_norm_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const fm_job *j = ctx;
    (void)s;
    keel_layer_norm_f32(j->x, j->gamma, j->beta, j->y, j->mean, j->inv_std, j->k, j->eps, lo,
                        hi);
}

static void skip_layer_norm_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const fm_job *j = ctx;
    (void)s;
    keel_skip_layer_norm_f32(j->x, j->skip, j->skip_rows, j->gamma, j->beta, j->y, j->sum, j->k,
                             j->eps, lo, hi);
}

static void softmax_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const fm_job *j = ctx;
    (void)s;
    keel_softmax_f32(j->x, j->y, j->k, lo, hi, j->mode);
}

int64_t keel_unary_mt_f32(int32_t kind, const float *x, float *y, float alpha, int64_t n,
                          int64_t parts)
{
    fm_job j = {.kind = kind, .x = x, .y = y, .alpha = alpha};
    return run_parts(unary_task, &j, n, parts, 0);
}

int64_t keel_bias_unary_mt_f32(int32_t kind, const float *x, const float *bias, float *y,
                               int64_t k, float alpha, int64_t rows, int64_t parts)
{
    fm_job j = {.kind = kind, .x = x, .bias = bias, .y = y, .k = k, .alpha = alpha};
    return run_parts(bias_unary_task, &j, rows, parts, 0);
}

int64_t keel_layer_norm_mt_f32(const float *x, const float *gamma, const float *beta, float *y,
                               float *mean, float *inv_std, int64_t k, float eps, int64_t rows,
                               int64_t parts)
{
    fm_job j = {.x = x, .gamma = gamma, .beta = beta, .y = y, .mean = mean, .inv_std = inv_std,
                .k = k, .eps = eps};
    return run_parts(layer_norm_task, &j, rows, parts, 0);
}

int64_t keel_skip_layer_norm_mt_f32(const float *x, const float *skip, int64_t skip_rows,
                                    const float *gamma, const float *beta, float *y, float *sum,
                                    int64_t k, float eps, int64_t rows, int64_t parts)
{
    fm_job j = {.x = x, .skip = skip, .skip_rows = skip_rows, .gamma = gamma, .beta = beta,
                .y = y, .sum = sum, .k = k, .eps = eps};
    return run_parts(skip_layer_norm_task, &j, rows, parts, 0);
}

int64_t keel_softmax_mt_f32(const float *x, float *y, int64_t n, int32_t mode, int64_t rows,
                            int64_t parts)
{
    fm_job j = {.x = x, .y = y, .k = n, .mode = mode};
    return run_parts(softmax_task, &j, rows, parts, 0);
}
