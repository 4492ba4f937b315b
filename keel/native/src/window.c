/* Sliding-window kernels over NCHW float32 planes: depthwise convolution and pooling.
 *
 * NumPy runs a window op as one pass over memory per kernel tap (multiply, add,
 * maximum...), so a 3x3 depthwise conv reads and writes its output 18 times.
 * Here each output is computed once, in registers, from a small copy of the
 * input that makes every tap a unit-stride load:
 *
 * - A band of input rows of one (n, c) plane is copied into a scratch buffer,
 *   split into stride phases: phase (a % sh, b % sw) holds padded input
 *   position (a, b) at (a / sh, b / sw). The padding (0 for conv and average
 *   pooling, -inf for max pooling) is written once per call and stays: a band
 *   copies only the input's columns, so borders cost no branches and no stores.
 * - Output (oh, ow) of the band is "wide" index j = oh * qw + ow, and the tap
 *   (kh, kw) of every output sits at j + off[tap]: one contiguous run. A few
 *   columns per row (ow >= OW) are computed and never read.
 * - The wide outputs are computed KU vectors at a time with every tap in
 *   registers (a chain of fused multiply-adds: gnu11 contracts a * b + c), then
 *   the valid ones are moved to Y together with the residual and the clip.
 * - A conv whose output rows hold 32 or more values skips the wide buffer: each row's
 *   outputs are computed from the band copy straight into Y (conv_rows), the same
 *   chain of multiply-adds, so the same values, one pass over Y fewer.
 * - Large row-strided calls prefetch their input a few bands ahead (copy_rows).
 * - Bands run as a software pipeline (copy band k, compute band k - 1, emit
 *   band k - 2, with two copy and two output buffers), so stores have retired
 *   when the loads that straddle them run.
 *
 * - Small depthwise planes may instead run 16 channels at once, one vector lane per
 *   plane (run_blocked, AVX-512 only). Each lane runs the same chain of multiply-adds, so
 *   the values are bitwise the same.
 * - 3x3 stride-2 depthwise convs padded by one (MobileNet's) may run with no band copy,
 *   the stride phases split in registers, several output rows at a time, rows of at most
 *   8 outputs two to a vector (run_s2, AVX-512 only): the same chain of multiply-adds,
 *   the same values.
 * - Stride-1 depthwise convs whose output rows are as wide as the input's may run with no
 *   copy at all, 16 consecutive output pixels of a plane at a time, each tap a load from
 *   X with the lanes outside X zeroed (run_flat, AVX-512 only): the same chain of
 *   multiply-adds, the same values.
 * - Which scheme a call runs is the caller's (the cpu planner's depthwise_scheme, which
 *   measured where each wins); keel_dwconv2d_scheme_ok says which ones serve a geometry.
 *
 * Every exported function takes the planes [lo, hi) of N * C to compute, so
 * callers split the work across threads; each plane is computed the same way
 * whatever the split, so results are bitwise identical for any thread count.
 * No global state, no allocation: the scratch buffer comes from the caller
 * (keel_window_scratch says how many floats).
 *
 * Geometry, an int64 array (see enum below): C, H, W, OH, OW, KH, KW, SH, SW,
 * DH, DW, PT, PL (pads at the beginning; the end pads follow from OH / OW, and
 * ceil-mode windows past them read padding too).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "transpose.h"
#include "vec.h"

#define KV VW                /* floats per vector */
#define KU 4                 /* vectors computed together: independent FMA chains */
#define KSTEP (KV * KU)
#define MAX_TAPS 1024
#define MAX_STRIDE 16
/* Floats of scratch a band aims at: its input copies and wide outputs stay in cache. */
#define BAND_TARGET 8192
/* How far ahead of the copy input rows are prefetched: bands, and at least floats. */
#define PREFETCH_BANDS 4
#define PREFETCH_FLOATS 8192
/* Floats of input past which a call prefetches (half the L3 cache: below, a layer's input
 * is mostly still in cache from the layer before, and prefetching measured slower),
 * and the shortest rows: the calls that gain are row-strided ones over rows of several
 * cache lines (see copy_rows; elsewhere the prefetches measured as pure cost). */
#define PREFETCH_MIN_FLOATS (1 << 22)
#define PREFETCH_MIN_WIDTH 24
/* The narrowest output rows a conv computes straight into Y (conv_rows): on MobileNetV2's
 * 112- and 56-wide layers that ran 0.65-0.85x the time of the wide scheme at batch 32
 * (0.9x at batch 1); on 28- and 14-wide ones 1.5-2.4x. */
#define DIRECT_MIN_WIDTH 32

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---- geometry ------------------------------------------------------------------------- */

enum { G_C, G_H, G_W, G_OH, G_OW, G_KH, G_KW, G_SH, G_SW, G_DH, G_DW, G_PT, G_PL, G_LEN };

typedef struct {
    int64_t c, h, w, oh, ow, kh, kw, sh, sw, dh, dw, pt, pl;
    int64_t reach_h, reach_w;   /* phase rows / columns past an output that its taps read */
    int64_t qw;                 /* phase row length */
    int64_t taps;
    int64_t band;               /* output rows per band */
    int64_t rb;                 /* phase rows per band */
    /* Column phase k of an input row: X columns first[k] + i * sw (i < count[k]) land in
     * phase columns col[k] + i; every other phase column is padding. */
    int64_t first[MAX_STRIDE], col[MAX_STRIDE], count[MAX_STRIDE];
} geom;

/* Scratch layout: two phase copies of a band, each followed by slack that the last wide
 * outputs of a band read past it, then two buffers of a band's wide outputs. */
static inline int64_t slack(const geom *g) { return KSTEP + g->qw; }
static inline int64_t copy_floats(const geom *g, int64_t band) {
    return g->sh * g->sw * (band + g->reach_h) * g->qw + slack(g);
}
static inline int64_t acc_floats(const geom *g, int64_t band) {
    return round_up(band * g->qw, KSTEP) + KV;
}
static int64_t band_floats(const geom *g, int64_t band) {
    return 2 * copy_floats(g, band) + 2 * acc_floats(g, band);
}

static void column_phases(geom *g) {
    for (int64_t k = 0; k < g->sw; k++) {
        /* Padded column b = c * sw + k reads X column b - pl. */
        int64_t c0 = g->pl - k <= 0 ? 0 : (g->pl - k + g->sw - 1) / g->sw;
        int64_t last = g->w - 1 + g->pl - k;          /* c * sw <= last */
        int64_t c1 = last < 0 ? 0 : min64(last / g->sw + 1, g->qw);
        g->col[k] = min64(c0, g->qw);
        g->count[k] = max64(0, c1 - g->col[k]);
        g->first[k] = g->col[k] * g->sw + k - g->pl;
    }
}

/* Fill g from the caller's array; 0 when the geometry is one these kernels serve. */
static int geom_init(geom *g, const int64_t *a) {
    g->c = a[G_C]; g->h = a[G_H]; g->w = a[G_W]; g->oh = a[G_OH]; g->ow = a[G_OW];
    g->kh = a[G_KH]; g->kw = a[G_KW]; g->sh = a[G_SH]; g->sw = a[G_SW];
    g->dh = a[G_DH]; g->dw = a[G_DW]; g->pt = a[G_PT]; g->pl = a[G_PL];
    if (g->c < 1 || g->h < 1 || g->w < 1 || g->oh < 1 || g->ow < 1 || g->kh < 1 || g->kw < 1
        || g->sh < 1 || g->sw < 1 || g->sh > MAX_STRIDE || g->sw > MAX_STRIDE
        || g->dh < 1 || g->dw < 1 || g->pt < 0 || g->pl < 0)
        return -1;
    g->taps = g->kh * g->kw;
    if (g->taps > MAX_TAPS) return -1;
    g->reach_h = (g->kh - 1) * g->dh / g->sh;
    g->reach_w = (g->kw - 1) * g->dw / g->sw;
    g->qw = g->ow + g->reach_w;
    int64_t band = g->oh;
    while (band > 1 && band_floats(g, band) > BAND_TARGET) band = (band + 1) / 2;
    /* Equal bands: the same rows per band whatever the plane. */
    int64_t count = (g->oh + band - 1) / band;
    g->band = (g->oh + count - 1) / count;
    g->rb = g->band + g->reach_h;
    column_phases(g);
    return 0;
}

static void tap_offsets(const geom *g, int64_t *off) {
    for (int64_t kh = 0; kh < g->kh; kh++) {
        for (int64_t kw = 0; kw < g->kw; kw++) {
            int64_t a = kh * g->dh, b = kw * g->dw;
            int64_t phase = (a % g->sh) * g->sw + b % g->sw;
            off[kh * g->kw + kw] = phase * g->rb * g->qw + (a / g->sh) * g->qw + b / g->sw;
        }
    }
}

/* ---- partial vectors: masked where AVX-512 has masks, else lane by lane --------------- */

#if defined(__AVX512F__)
static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u);
}
static inline vf load_n(const float *p, int64_t n) {
    return (vf)_mm512_maskz_loadu_ps(first_lanes(n), p);
}
static inline void store_n(float *p, vf v, int64_t n) {
    _mm512_mask_storeu_ps(p, first_lanes(n), (__m512)v);
}
#else
static inline vf load_n(const float *p, int64_t n) {
    vf v = {0};
    for (int64_t i = 0; i < n && i < KV; i++) v[i] = p[i];
    return v;
}
static inline void store_n(float *p, vf v, int64_t n) {
    for (int64_t i = 0; i < n && i < KV; i++) p[i] = v[i];
}
#endif

/* ---- band copies ------------------------------------------------------------------------ */

/* How one input row goes into its column phases, planned once per call. Unit and 2
 * column strides run whole vectors and one masked vector at the end of the row. */
typedef struct {
    int64_t ahead;              /* floats past a copied row that are prefetched (see below) */
    const float *end;           /* the end of the planes a call reads: no prefetch past it */
    int64_t region;             /* floats from one phase's band copy to the next */
    int64_t chunks;             /* vectors per row (0: the plain loop) */
    int64_t src, de, dq;        /* offsets: X columns read, phase columns written */
#if defined(__AVX512F__)
    __mmask16 la, lb, se, so;   /* masks of the last vector: loads, stores */
#endif
} rowcopy;

static rowcopy plan_rows(const geom *g, const float *end) {
    rowcopy rc = {0, end, g->rb * g->qw, 0, 0, 0, 0
#if defined(__AVX512F__)
                  , 0, 0, 0, 0
#endif
    };
#if defined(__AVX512F__)
    if (g->sw == 1 && g->count[0] > 0) {
        int64_t n = g->count[0];
        rc.chunks = (n + 15) / 16;
        rc.src = g->first[0];
        rc.de = g->col[0];
        rc.la = rc.se = first_lanes(n - 16 * (rc.chunks - 1));
    } else if (g->sw == 2) {
        /* X columns 2i go to one phase, 2i + 1 to the other (which one: pl's parity). */
        int64_t ce = g->pl / 2, co = (g->pl + 1) / 2;     /* phase columns of x[0], x[1] */
        int64_t me = min64((g->w + 1) / 2, g->qw - ce), mo = min64(g->w / 2, g->qw - co);
        int64_t most = max64(me, mo);
        if (most > 0) {
            rc.chunks = (most + 15) / 16;
            int64_t i0 = 16 * (rc.chunks - 1);
            rc.de = (g->pl & 1) * rc.region + ce;
            rc.dq = ((g->pl & 1) ^ 1) * rc.region + co;
            rc.la = first_lanes(g->w - 2 * i0);
            rc.lb = first_lanes(g->w - 2 * i0 - 16);
            rc.se = first_lanes(me - i0);
            rc.so = first_lanes(mo - i0);
        }
    }
#endif
    return rc;
}

/* Rows of the band copy, phase row ph: input rows src, src + sh * W, ... into dst, dst +
 * qw, ..., n rows. The unit and 2 column strides run whole vectors and one masked vector
 * at the end of each row. With `check`, returns whether a copied value is NaN. */
static inline __attribute__((always_inline)) int copy_rows(
        const geom *g, const rowcopy *rc, const float *src, float *dst, int64_t n, int check) {
    int64_t step = g->sh * g->w;
    /* At batch the input comes from memory. With row strides a band reads every other
     * row, phase after phase, and the hardware prefetcher alone left the copy waiting on
     * memory (MobileNetV2's stride-2 layers at batch 32 ran 1.5x slower than with this).
     * So each copy asks for the rows a few bands on, into L2 (rc->ahead > 0: run_window
     * says which calls do). */
    if (rc->ahead > 0) {
        uintptr_t a = (uintptr_t)src + (uintptr_t)rc->ahead * sizeof(float);
        uintptr_t e = a + (uintptr_t)(n * step) * sizeof(float);
        if (e > (uintptr_t)rc->end) e = (uintptr_t)rc->end;
        for (; a < e; a += 64) __builtin_prefetch((const void *)a, 0, 2);
    }
#if defined(__AVX512F__)
    int64_t last = 16 * (rc->chunks - 1);
    __mmask16 nan = 0;
    if (rc->chunks > 0 && g->sw == 1) {
        for (int64_t r = 0; r < n; r++, src += step, dst += g->qw) {
            const float *s = src + rc->src;
            float *d = dst + rc->de;
            for (int64_t i = 0; i < last; i += 16) {
                __m512 v = _mm512_loadu_ps(s + i);
                if (check) nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                _mm512_storeu_ps(d + i, v);
            }
            __m512 v = _mm512_maskz_loadu_ps(rc->la, s + last);
            if (check) nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            _mm512_mask_storeu_ps(d + last, rc->se, v);
        }
        return nan != 0;
    }
    if (rc->chunks > 0) {       /* sw == 2 */
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16,
                                              14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        for (int64_t r = 0; r < n; r++, src += step, dst += g->qw) {
            float *de = dst + rc->de, *dq = dst + rc->dq;
            for (int64_t i = 0; i < last; i += 16) {
                __m512 a = _mm512_loadu_ps(src + 2 * i), b = _mm512_loadu_ps(src + 2 * i + 16);
                if (check)
                    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)
                           | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
                _mm512_storeu_ps(de + i, _mm512_permutex2var_ps(a, even, b));
                _mm512_storeu_ps(dq + i, _mm512_permutex2var_ps(a, odd, b));
            }
            __m512 a = _mm512_maskz_loadu_ps(rc->la, src + 2 * last);
            __m512 b = _mm512_maskz_loadu_ps(rc->lb, src + 2 * last + 16);
            if (check)
                nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)
                       | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
            _mm512_mask_storeu_ps(de + last, rc->se, _mm512_permutex2var_ps(a, even, b));
            _mm512_mask_storeu_ps(dq + last, rc->so, _mm512_permutex2var_ps(a, odd, b));
        }
        return nan != 0;
    }
#endif
    int found = 0;
    for (int64_t r = 0; r < n; r++, src += step, dst += g->qw) {
        for (int64_t k = 0; k < g->sw; k++) {
            const float *s = src + g->first[k];
            float *d = dst + k * rc->region + g->col[k];
            for (int64_t i = 0; i < g->count[k]; i++) {
                float v = s[g->sw == 1 ? i : i * g->sw];
                d[i] = v;
                if (check) found |= v != v;
            }
        }
    }
    return found;
}

static void pad_rows(const geom *g, const rowcopy *rc, float *dst, int64_t n, float pad) {
    for (int64_t r = 0; r < n; r++, dst += g->qw)
        for (int64_t k = 0; k < g->sw; k++)
            for (int64_t i = 0; i < g->qw; i++) dst[k * rc->region + i] = pad;
}

/* Copy phase rows [q0, q0 + rows) of plane x into buf. Padding columns already hold
 * `pad`; padding rows are rewritten when `repad` (an earlier band of the plane may have
 * put input there; with one band per plane they never change). With `check`, returns
 * whether a copied value is NaN. */
static int fill_band(const float *x, const geom *g, const rowcopy *rc, int64_t q0,
                     int64_t rows, float pad, int repad, int check, float *buf) {
    int nan = 0;
    for (int64_t ph = 0; ph < g->sh; ph++) {
        /* Phase row q holds input row q * sh + ph - pt: rows [r0, r1) of the band read X. */
        int64_t r0 = (g->pt - ph + g->sh - 1) / g->sh - q0;
        int64_t r1 = (g->h + g->pt - ph + g->sh - 1) / g->sh - q0;
        r0 = max64(0, min64(r0, rows));
        r1 = max64(r0, min64(r1, rows));
        float *dst = buf + ph * g->sw * rc->region;
        if (r1 > r0) {
            const float *src = x + ((q0 + r0) * g->sh + ph - g->pt) * g->w;
            if (check) nan |= copy_rows(g, rc, src, dst + r0 * g->qw, r1 - r0, 1);
            else copy_rows(g, rc, src, dst + r0 * g->qw, r1 - r0, 0);
        }
        if (repad) {
            pad_rows(g, rc, dst, r0, pad);
            pad_rows(g, rc, dst + r1 * g->qw, rows - r1, pad);
        }
    }
    return nan;
}

/* ---- the wide computations: KU vectors of outputs at a time, every tap in registers --- */

/* Running max; a NaN anywhere in the window gives NaN (as np.maximum). Only bands whose
 * copy holds a NaN pay for this; the others take the plain max below. */
static inline vf vmax_nan(vf s, vf v) { return vselect((v > s) | (v != v), v, s); }

/* acc[j] = bias + sum_t w[t] * buf[j + off[t]] */
static inline __attribute__((always_inline)) void conv_wide(
        const float *buf, const int64_t *off, const float *w, int64_t taps, float bias,
        float *restrict acc, int64_t n) {
    for (int64_t j = 0; j < n; j += KSTEP) {
        vf s0 = vsplat(bias), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t t = 0; t < taps; t++) {
            const float *p = buf + off[t] + j;
            vf wt = vsplat(w[t]);
            s0 += vload(p) * wt;
            s1 += vload(p + KV) * wt;
            s2 += vload(p + 2 * KV) * wt;
            s3 += vload(p + 3 * KV) * wt;
        }
        vstore(acc + j, s0);
        vstore(acc + j + KV, s1);
        vstore(acc + j + 2 * KV, s2);
        vstore(acc + j + 3 * KV, s3);
    }
}

/* The max of a window without NaN: one max instruction a tap. */
static inline vf vmax(vf s, vf v) {
#if defined(__AVX512F__)
    return (vf)_mm512_max_ps((__m512)v, (__m512)s);
#else
    return vselect(v > s, v, s);
#endif
}

/* What reduce_wide folds the taps with: the max keeping NaN (bands whose copy holds a
 * NaN), the plain max (the others), or the sum. */
enum { RED_MAX_NAN, RED_MAX, RED_SUM };

static inline __attribute__((always_inline)) vf reduce_step(int op, vf s, vf v) {
    return op == RED_SUM ? s + v : op == RED_MAX ? vmax(s, v) : vmax_nan(s, v);
}

/* acc[j] = max_t or sum_t buf[j + off[t]] (op is a constant where this is inlined, so
 * each is its own loop). */
static inline __attribute__((always_inline)) void reduce_wide(
        int op, const float *buf, const int64_t *off, int64_t taps, float *restrict acc,
        int64_t n) {
    for (int64_t j = 0; j < n; j += KSTEP) {
        vf s0 = vsplat(op == RED_SUM ? 0.0f : -INFINITY), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t t = 0; t < taps; t++) {
            const float *p = buf + off[t] + j;
            s0 = reduce_step(op, s0, vload(p));
            s1 = reduce_step(op, s1, vload(p + KV));
            s2 = reduce_step(op, s2, vload(p + 2 * KV));
            s3 = reduce_step(op, s3, vload(p + 3 * KV));
        }
        vstore(acc + j, s0);
        vstore(acc + j + KV, s1);
        vstore(acc + j + 2 * KV, s2);
        vstore(acc + j + 3 * KV, s3);
    }
}

/* ---- moving the valid outputs of a band row to Y ---------------------------------------- */

/* min(max(v, lo), hi) with NaN kept (as NumPy's clip). */
static inline vf vclip(vf v, vf lo, vf hi) {
    v = vselect(v < lo, lo, v);
    return vselect(v > hi, hi, v);
}

/* Rows of Y: y[r][0, ow) = clip(a[r] + z[r]) for r < rows (a's rows qw apart, read past
 * ow). The flags are constants where this is inlined, so each case is its own loop. */
static inline __attribute__((always_inline)) void rows_out(
        const float *a, int64_t qw, const float *z, float *y, int64_t ow, int64_t rows,
        vf lo, vf hi, int has_z, int has_clip) {
    int64_t full = ow / KV * KV, tail = ow - full;
    for (int64_t r = 0; r < rows; r++, a += qw, y += ow, z += has_z ? ow : 0) {
        for (int64_t i = 0; i < full; i += KV) {
            vf v = vload(a + i);
            if (has_z) v += vload(z + i);
            if (has_clip) v = vclip(v, lo, hi);
            vstore(y + i, v);
        }
        if (tail) {
            vf v = vload(a + full);
            if (has_z) v += load_n(z + full, tail);
            if (has_clip) v = vclip(v, lo, hi);
            store_n(y + full, v, tail);
        }
    }
}

/* Rows of Y: y[r] = a[r] / d[r], d the window counts of the rows. */
static void avg_rows_out(const float *a, int64_t qw, const float *d, float *y, int64_t ow,
                         int64_t rows) {
    int64_t full = ow / KV * KV, tail = ow - full;
    for (int64_t r = 0; r < rows; r++, a += qw, y += ow, d += ow) {
        for (int64_t i = 0; i < full; i += KV) vstore(y + i, vload(a + i) / vload(d + i));
        if (tail) store_n(y + full, vload(a + full) / load_n(d + full, tail), tail);
    }
}

/* ---- the driver: the bands of planes [lo, hi) as a software pipeline ------------------ */

typedef enum { WIN_CONV, WIN_MAX, WIN_AVG } win_op;

typedef struct {
    win_op op;
    const float *w, *bias, *z, *clip;   /* conv */
    const float *count;                 /* avg */
} win_args;

/* y[r][i] = clip(bias + sum_t w[t] * buf[r * qw + i + off[t]] + z[r][i]) for i < ow:
 * the conv of a band straight into Y, KU vectors of a row at a time (the lanes past ow
 * read the row's padding or the next row, and are never stored). */
static inline __attribute__((always_inline)) void conv_rows(
        const float *buf, const int64_t *off, const float *w, int64_t taps, float bias,
        int64_t qw, const float *z, float *y, int64_t ow, int64_t rows, vf lo, vf hi,
        int has_z, int has_clip) {
    for (int64_t r = 0; r < rows; r++, buf += qw, y += ow, z += has_z ? ow : 0) {
        for (int64_t j = 0; j < ow; j += KSTEP) {
            vf s[KU];
            for (int u = 0; u < KU; u++) s[u] = vsplat(bias);
            for (int64_t t = 0; t < taps; t++) {
                const float *p = buf + off[t] + j;
                vf wt = vsplat(w[t]);
                for (int u = 0; u < KU; u++) s[u] += vload(p + u * KV) * wt;
            }
            for (int u = 0; u < KU; u++) {
                int64_t i = j + u * KV, n = ow - i;
                if (n <= 0) break;
                vf v = s[u];
                if (has_z) v += n >= KV ? vload(z + i) : load_n(z + i, n);
                if (has_clip) v = vclip(v, lo, hi);
                if (n >= KV) vstore(y + i, v);
                else store_n(y + i, v, n);
            }
        }
    }
}

/* conv_rows with the common kernel size's tap loop unrolled. */
static inline __attribute__((always_inline)) void conv_rows_taps(
        const geom *g, const win_args *e, const float *copy, const int64_t *off,
        const float *w, float b, const float *z, float *y, int64_t rows, int has_z,
        int has_clip) {
    vf lo = vsplat(has_clip ? e->clip[0] : 0.0f), hi = vsplat(has_clip ? e->clip[1] : 0.0f);
    if (g->taps == 9)
        conv_rows(copy, off, w, 9, b, g->qw, z, y, g->ow, rows, lo, hi, has_z, has_clip);
    else
        conv_rows(copy, off, w, g->taps, b, g->qw, z, y, g->ow, rows, lo, hi, has_z, has_clip);
}

/* The conv of a band of plane p straight into Y (see conv_rows; run_window says when). */
static void conv_band_out(const geom *g, const win_args *e, const float *copy,
                          const int64_t *off, float *y, int64_t p, int64_t c, int64_t oh0,
                          int64_t rows) {
    int64_t at = (p * g->oh + oh0) * g->ow;
    const float *w = e->w + c * g->taps;
    float b = e->bias != NULL ? e->bias[c] : 0.0f;
    const float *z = e->z != NULL ? e->z + at : NULL;
    float *out = y + at;
    if (z != NULL && e->clip != NULL) conv_rows_taps(g, e, copy, off, w, b, z, out, rows, 1, 1);
    else if (z != NULL) conv_rows_taps(g, e, copy, off, w, b, z, out, rows, 1, 0);
    else if (e->clip != NULL) conv_rows_taps(g, e, copy, off, w, b, z, out, rows, 0, 1);
    else conv_rows_taps(g, e, copy, off, w, b, z, out, rows, 0, 0);
}

static void compute_band(const geom *g, const win_args *e, const float *copy,
                         const int64_t *off, float *acc, int64_t c, int64_t rows, int nan) {
    int64_t n = round_up(rows * g->qw, KSTEP);
    if (e->op == WIN_MAX) {
        if (nan) reduce_wide(RED_MAX_NAN, copy, off, g->taps, acc, n);
        else reduce_wide(RED_MAX, copy, off, g->taps, acc, n);
    } else if (e->op == WIN_AVG) {
        reduce_wide(RED_SUM, copy, off, g->taps, acc, n);
    } else {
        const float *w = e->w + c * g->taps;
        float b = e->bias != NULL ? e->bias[c] : 0.0f;
        /* Common kernel sizes get a fully unrolled tap loop. */
        if (g->taps == 9) conv_wide(copy, off, w, 9, b, acc, n);
        else if (g->taps == 25) conv_wide(copy, off, w, 25, b, acc, n);
        else conv_wide(copy, off, w, g->taps, b, acc, n);
    }
}

static void emit_band(const geom *g, const win_args *e, const float *acc, float *y, int64_t p,
                      int64_t oh0, int64_t rows) {
    int64_t at = (p * g->oh + oh0) * g->ow;
    if (e->op == WIN_AVG) {
        avg_rows_out(acc, g->qw, e->count + oh0 * g->ow, y + at, g->ow, rows);
        return;
    }
    const float *z = e->z != NULL ? e->z + at : NULL;
    vf lo = vsplat(e->clip != NULL ? e->clip[0] : 0.0f);
    vf hi = vsplat(e->clip != NULL ? e->clip[1] : 0.0f);
    if (z != NULL && e->clip != NULL) rows_out(acc, g->qw, z, y + at, g->ow, rows, lo, hi, 1, 1);
    else if (z != NULL) rows_out(acc, g->qw, z, y + at, g->ow, rows, lo, hi, 1, 0);
    else if (e->clip != NULL) rows_out(acc, g->qw, z, y + at, g->ow, rows, lo, hi, 0, 1);
    else rows_out(acc, g->qw, z, y + at, g->ow, rows, lo, hi, 0, 0);
}

/* ---- small planes: 16 channels at a time ------------------------------------------------
 *
 * On planes of a few hundred outputs the plane-by-plane scheme spends more on its per-plane
 * work (copy, emit, the wide outputs past each row, weight splats) than on arithmetic. Here
 * a block of up to CB consecutive planes is computed together, one vector lane per plane:
 * the block is transposed (16 x 16 in registers) into a padded, channels-interleaved copy
 * (the 16 planes' values of one pixel are one vector), every output is a chain of vector
 * FMAs with the lanes' own weights in registers, and the outputs are transposed back to
 * NCHW with the residual and clip on the way out. Each lane runs the same chain as
 * conv_wide (bias, then fma over the taps in order, then + z, then clip), so the results
 * are bitwise those of the plane path, whatever planes share a block. AVX-512 only (the
 * transposes); elsewhere the plane path serves every plane. */
#if defined(__AVX512F__)
#define CB 16
#define BLOCKED_MAX_TAPS 25
/* Limits of the stack tables: input pixels per plane, padded pixels. */
#define BLOCKED_MAX_IN 4096
#define BLOCKED_MAX_PADDED 4096
/* The last pixels of a plane, up to this many, move by gathers and scatters instead of a
 * 16 x 16 transpose (64 shuffles for a few pixels: 7x7 planes end with one, 14x14 with
 * four). */
#define BLOCKED_GATHER_PIXELS 4
typedef struct { int64_t hp, wp; } blocked_dims;

static blocked_dims blocked_size(const geom *g) {
    blocked_dims d;
    d.hp = max64(g->pt + g->h, (g->oh - 1) * g->sh + (g->kh - 1) * g->dh + 1);
    d.wp = max64(g->pl + g->w, (g->ow - 1) * g->sw + (g->kw - 1) * g->dw + 1);
    return d;
}

static int blocked_ok(const geom *g) {
    blocked_dims d = blocked_size(g);
    return g->taps <= BLOCKED_MAX_TAPS && g->h * g->w <= BLOCKED_MAX_IN
           && d.hp * d.wp <= BLOCKED_MAX_PADDED;
}

static int64_t blocked_floats(const geom *g) {
    blocked_dims d = blocked_size(g);
    return CB * d.hp * d.wp;
}

/* Planes [p0, p0 + cb) into buf's interior: pixel f of each plane to buf + dst[f]. */
static void blocked_in(const float *x, int64_t plane, int64_t cb, const int32_t *dst,
                       float *buf, int ahead) {
    const __m512i across = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int32_t)plane));
    for (int64_t f0 = 0; f0 < plane; f0 += 16) {
        if (plane - f0 <= BLOCKED_GATHER_PIXELS) {
            /* A few pixels left: each one gather of the 16 planes' values. */
            for (int64_t f = f0; f < plane; f++)
                _mm512_storeu_ps(buf + dst[f], _mm512_mask_i32gather_ps(
                    _mm512_setzero_ps(), first_lanes(cb), across, x + f, 4));
            break;
        }
        __mmask16 m = first_lanes(plane - f0);
        __m512 r[16];
        for (int l = 0; l < 16; l++) {
            r[l] = l < cb ? _mm512_maskz_loadu_ps(m, x + l * plane + f0) : _mm512_setzero_ps();
            /* The next block's line: 16 planes at once are more streams than the hardware
             * prefetcher follows (a read past the input is only a hint: it never faults). */
            if (ahead) __builtin_prefetch(x + (CB + l) * plane + f0, 0, 3);
        }
        transpose16(r);
        int64_t n = min64(16, plane - f0);
        for (int64_t k = 0; k < n; k++) _mm512_storeu_ps(buf + dst[f0 + k], r[k]);
    }
}

/* Outputs [f0, f0 + n) of the block, n rounded up to four: out[k] = bias + sum_t w[t] *
 * buf[base[k] + off[t]] (pixel-major, CB lanes), four independent chains at a time; the
 * rest of out is zero (lanes that are not stored). */
static inline __attribute__((always_inline)) void blocked_compute(
        const float *buf, const int32_t *base, const int64_t *off, const __m512 *w,
        int64_t taps, __m512 bias, int64_t n, __m512 *out) {
    for (int q = 0; q < 16; q++) out[q] = _mm512_setzero_ps();
    for (int q = 0; q < n; q += 4) {
        __m512 s0 = bias, s1 = bias, s2 = bias, s3 = bias;
        const float *p0 = buf + base[q], *p1 = buf + base[q + 1];
        const float *p2 = buf + base[q + 2], *p3 = buf + base[q + 3];
        for (int64_t t = 0; t < taps; t++) {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(p0 + off[t]), w[t], s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(p1 + off[t]), w[t], s1);
            s2 = _mm512_fmadd_ps(_mm512_loadu_ps(p2 + off[t]), w[t], s2);
            s3 = _mm512_fmadd_ps(_mm512_loadu_ps(p3 + off[t]), w[t], s3);
        }
        out[q] = s0;
        out[q + 1] = s1;
        out[q + 2] = s2;
        out[q + 3] = s3;
    }
}

/* r (16 output pixels, CB lanes) back to planes [0, cb) of Y at one pixel (m: the pixels
 * inside the plane), + Z, clipped. */
static inline __attribute__((always_inline)) void blocked_out(
        __m512 *r, __mmask16 m, int64_t plane, int64_t cb, const float *z, float *y, vf lo,
        vf hi, int has_z, int has_clip, int ahead) {
    int64_t n = __builtin_popcount((unsigned)m);
    if (n <= BLOCKED_GATHER_PIXELS) {
        /* A few pixels: each one scatter to the cb planes (+ Z gathered the same way). */
        const __m512i across = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32((int32_t)plane));
        __mmask16 lanes = first_lanes(cb);
        for (int64_t k = 0; k < n; k++) {
            vf v = (vf)r[k];
            if (has_z)
                v += (vf)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, across,
                                                  z + k, 4);
            if (has_clip) v = vclip(v, lo, hi);
            _mm512_mask_i32scatter_ps(y + k, lanes, across, (__m512)v, 4);
        }
        return;
    }
    transpose16(r);
    for (int64_t l = 0; l < cb; l++) {
        vf v = (vf)r[l];
        if (has_z && ahead) __builtin_prefetch(z + (CB + l) * plane, 0, 3);
        if (has_z) v += (vf)_mm512_maskz_loadu_ps(m, z + l * plane);
        if (ahead) __builtin_prefetch(y + (CB + l) * plane, 1, 3);
        if (has_clip) v = vclip(v, lo, hi);
        _mm512_mask_storeu_ps(y + l * plane, m, (__m512)v);
    }
}

/* The outputs of a block: computed 16 pixels at a time and moved out at once (no buffer
 * of the block's outputs: less to keep in L1 beside the interleaved copy). */
static inline __attribute__((always_inline)) void blocked_block(
        const geom *g, const win_args *e, const float *buf, const int32_t *base,
        const int64_t *off, const __m512 *w, int64_t taps, __m512 bias, int64_t cb,
        int64_t at, float *y, int ahead, int has_z, int has_clip) {
    int64_t plane = g->oh * g->ow;
    const float *z = has_z ? e->z + at : NULL;
    vf lo = vsplat(has_clip ? e->clip[0] : 0.0f), hi = vsplat(has_clip ? e->clip[1] : 0.0f);
    for (int64_t f0 = 0; f0 < plane; f0 += 16) {
        __m512 r[16];
        blocked_compute(buf, base + f0, off, w, taps, bias, min64(16, plane - f0), r);
        blocked_out(r, first_lanes(plane - f0), plane, cb, has_z ? z + f0 : NULL,
                    y + at + f0, lo, hi, has_z, has_clip, ahead);
    }
}

static void blocked_any(const geom *g, const win_args *e, const float *buf,
                        const int32_t *base, const int64_t *off, const __m512 *w, __m512 bias,
                        int64_t cb, int64_t at, float *y, int ahead) {
    int hz = e->z != NULL, hc = e->clip != NULL;
    if (g->taps == 9) {
        if (hz && hc) blocked_block(g, e, buf, base, off, w, 9, bias, cb, at, y, ahead, 1, 1);
        else if (hz) blocked_block(g, e, buf, base, off, w, 9, bias, cb, at, y, ahead, 1, 0);
        else if (hc) blocked_block(g, e, buf, base, off, w, 9, bias, cb, at, y, ahead, 0, 1);
        else blocked_block(g, e, buf, base, off, w, 9, bias, cb, at, y, ahead, 0, 0);
    } else {
        blocked_block(g, e, buf, base, off, w, g->taps, bias, cb, at, y, ahead, hz, hc);
    }
}

/* The lanes' weights of taps [0, taps) and their bias for planes [p0, p0 + cb) (channel
 * of plane p: p mod C; lanes past cb zero). Up to 16 taps, each channel's taps are one
 * masked load of its row of W, moved into lane l by a transpose of the block's rows: a
 * division per plane and tap and 160 scalar loads a block cost more than the FMAs of a
 * 7x7 layer. */
static void blocked_weights(const geom *g, const win_args *e, int64_t p0, int64_t cb,
                            __m512 *w, __m512 *bias) {
    float lanes[CB] __attribute__((aligned(64)));
    int64_t c0 = p0 % g->c, c = c0;
    for (int64_t l = 0; l < CB; l++, c = c + 1 == g->c ? 0 : c + 1)
        lanes[l] = l < cb && e->bias != NULL ? e->bias[c] : 0.0f;
    *bias = _mm512_load_ps(lanes);
    if (g->taps <= 16) {
        __m512 r[16];
        c = c0;
        for (int64_t l = 0; l < CB; l++, c = c + 1 == g->c ? 0 : c + 1)
            r[l] = l < cb ? _mm512_maskz_loadu_ps(first_lanes(g->taps), e->w + c * g->taps)
                          : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t t = 0; t < g->taps; t++) w[t] = r[t];
        return;
    }
    for (int64_t t = 0; t < g->taps; t++) {
        c = c0;
        for (int64_t l = 0; l < CB; l++, c = c + 1 == g->c ? 0 : c + 1)
            lanes[l] = l < cb ? e->w[c * g->taps + t] : 0.0f;
        w[t] = _mm512_load_ps(lanes);
    }
}

static void run_blocked(const float *x, float *y, const geom *g, const win_args *e,
                        float *scratch, int64_t lo, int64_t hi) {
    blocked_dims d = blocked_size(g);
    int64_t in_plane = g->h * g->w, out_plane = g->oh * g->ow;
    float *buf = scratch;
    int32_t dst[BLOCKED_MAX_IN], base[BLOCKED_MAX_PADDED + 16];
    int64_t off[BLOCKED_MAX_TAPS];
    for (int64_t f = 0; f < in_plane; f++)
        dst[f] = (int32_t)(((g->pt + f / g->w) * d.wp + g->pl + f % g->w) * CB);
    /* Output pixel f reads from base[f]; the pixels past the plane in the last 16 read
     * the corner (finite values, never stored). */
    for (int64_t f = 0; f < round_up(out_plane, 16); f++)
        base[f] = f < out_plane
                  ? (int32_t)(((f / g->ow) * g->sh * d.wp + (f % g->ow) * g->sw) * CB) : 0;
    for (int64_t kh = 0; kh < g->kh; kh++)
        for (int64_t kw = 0; kw < g->kw; kw++)
            off[kh * g->kw + kw] = (kh * g->dh * d.wp + kw * g->dw) * CB;
    /* The padding is written once: blocks overwrite only the interior. */
    memset(buf, 0, (size_t)(CB * d.hp * d.wp) * sizeof(float));
    for (int64_t p0 = lo; p0 < hi; p0 += CB) {
        int64_t cb = min64(CB, hi - p0);
        __m512 w[BLOCKED_MAX_TAPS], bias;
        blocked_weights(g, e, p0, cb, w, &bias);
        /* Planes past hi are prefetched only when they are this call's (never past the
         * arrays; another thread's planes are its own to fetch). */
        int ahead = hi - p0 > CB;
        blocked_in(x + p0 * in_plane, in_plane, cb, dst, buf, ahead);
        blocked_any(g, e, buf, base, off, w, bias, cb, p0 * out_plane, y, ahead);
    }
}
#endif

#if defined(__AVX512F__)
/* 3x3 stride-2 depthwise convs with one padding row and column at the beginning
 * (MobileNet's downsampling layers) run straight from X, no band copy: the even and
 * odd input columns of an output vector are split in registers (a permute of two
 * loads; the columns 2j - 1 from loads one column earlier), input rows and columns
 * outside X are zero vectors (the copy's padding), and each output is the same chain
 * as conv_rows (bias, then a multiply-add per tap in order, + Z, clip): the same bits.
 * Output rows run S2_CHAINS vectors at a time (S2_CHAINS / nv rows of nv vectors), each
 * input row split once for both output rows it feeds: alone, one thread, that took
 * 0.72-0.79x the time of one row at a time on 56 -> 28 and 28 -> 14 (2-core Intel Xeon). */
#define S2_CHAINS 8       /* output vectors computed together: independent FMA chains */

static int s2_ok(const geom *g) {
    return g->kh == 3 && g->kw == 3 && g->sh == 2 && g->sw == 2 && g->dh == 1 && g->dw == 1
           && g->pt == 1 && g->pl == 1;
}

/* Input row `row` (W columns) at the columns 2j - 1, 2j, 2j + 1 of outputs [j0, j0 + 16);
 * prev: the odd columns of the outputs before (column 2j0 - 1 in its last lane), then
 * this vector's. */
static inline __attribute__((always_inline)) void s2_columns(
        const float *row, int64_t w, int64_t j0, __m512 *prev, __m512 *col) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16,
                                          14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    int64_t c = 2 * j0;
    __m512 a = _mm512_maskz_loadu_ps(first_lanes(w - c), row + c);
    __m512 b = _mm512_maskz_loadu_ps(first_lanes(w - c - 16), row + c + 16);
    __m512 o = _mm512_permutex2var_ps(a, odd, b);
    col[0] = _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(o),
                                                     _mm512_castps_si512(*prev), 15));
    col[1] = _mm512_permutex2var_ps(a, even, b);
    col[2] = o;
    *prev = o;
}

/* Output rows [i0, i0 + nr) of one plane, the nv vectors of outputs from column j (x: the
 * plane, wt: its nine weights splat; z, y: the plane's). The rows' nr * nv sums are
 * independent chains, and each input row they read (2 i0 - 1 .. 2 i0 + 2 nr - 1) is
 * loaded and split once for the one or two output rows that use it: an output row's taps
 * still come in order (kh = 0, 1, 2, each kw = 0, 1, 2), so each output is the same chain. */
static inline __attribute__((always_inline)) void s2_group(
        const geom *g, const float *x, const __m512 *wt, __m512 bias, int64_t i0, int64_t j,
        const float *z, float *y, vf lo, vf hi, int nr, int nv, int has_z, int has_clip) {
    __m512 s[S2_CHAINS];
    for (int k = 0; k < nr * nv; k++) s[k] = bias;
#pragma GCC unroll 17
    for (int rr = 0; rr < 2 * nr + 1; rr++) {
        int64_t r = 2 * i0 - 1 + rr;
        int inside = r >= 0 && r < g->h;
        /* The odd column before the first vector: column -1 is padding. */
        __m512 prev = inside && j > 0 ? _mm512_set1_ps(x[r * g->w + 2 * j - 1])
                                      : _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int u = 0; u < nv; u++) {
            __m512 col[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            if (inside) s2_columns(x + r * g->w, g->w, j + u * KV, &prev, col);
#pragma GCC unroll 8
            for (int k = 0; k < nr; k++) {
                int kh = rr - 2 * k;
                if (kh < 0 || kh > 2) continue;
                for (int kw = 0; kw < 3; kw++)
                    s[k * nv + u] = _mm512_fmadd_ps(col[kw], wt[kh * 3 + kw], s[k * nv + u]);
            }
        }
    }
    for (int k = 0; k < nr && i0 + k < g->oh; k++) {
        for (int u = 0; u < nv; u++) {
            int64_t at = (i0 + k) * g->ow + j + u * KV, n = g->ow - j - u * KV;
            if (n <= 0) break;
            vf v = (vf)s[k * nv + u];
            if (has_z) v += load_n(z + at, n);
            if (has_clip) v = vclip(v, lo, hi);
            store_n(y + at, v, n);
        }
    }
}

/* One plane's outputs, nv vectors of a row at a time, S2_CHAINS / nv rows together (the
 * last group's rows past OH read zero rows and are not stored: one body to compile). */
static inline __attribute__((always_inline)) void s2_plane(
        const geom *g, const float *x, const __m512 *wt, __m512 bias, const float *z,
        float *y, vf lo, vf hi, int nv, int has_z, int has_clip) {
    const int nr = S2_CHAINS / nv;
    for (int64_t j = 0; j < g->ow; j += nv * KV) {
        for (int64_t i = 0; i < g->oh; i += nr)
            s2_group(g, x, wt, bias, i, j, z, y, lo, hi, nr, nv, has_z, has_clip);
    }
}

static inline __attribute__((always_inline)) void s2_planes(
        const float *x, float *y, const geom *g, const win_args *e, int64_t lo, int64_t hi,
        int has_z, int has_clip) {
    int64_t in_plane = g->h * g->w, out_plane = g->oh * g->ow;
    int nv = (int)min64(KU, (g->ow + KV - 1) / KV);
    vf vlo = vsplat(has_clip ? e->clip[0] : 0.0f), vhi = vsplat(has_clip ? e->clip[1] : 0.0f);
    for (int64_t p = lo; p < hi; p++) {
        int64_t c = p % g->c;
        __m512 wt[9];
        for (int t = 0; t < 9; t++) wt[t] = _mm512_set1_ps(e->w[c * 9 + t]);
        __m512 bias = _mm512_set1_ps(e->bias != NULL ? e->bias[c] : 0.0f);
        const float *xp = x + p * in_plane, *zp = has_z ? e->z + p * out_plane : NULL;
        float *yp = y + p * out_plane;
        if (nv == 4) s2_plane(g, xp, wt, bias, zp, yp, vlo, vhi, 4, has_z, has_clip);
        else if (nv == 3) s2_plane(g, xp, wt, bias, zp, yp, vlo, vhi, 3, has_z, has_clip);
        else if (nv == 2) s2_plane(g, xp, wt, bias, zp, yp, vlo, vhi, 2, has_z, has_clip);
        else s2_plane(g, xp, wt, bias, zp, yp, vlo, vhi, 1, has_z, has_clip);
    }
}

/* Narrow planes (output rows of at most 8, input rows of at most 16: MobileNet's 14 -> 7)
 * put two output rows in a vector, row i in lanes 0-7 and row i + 1 in lanes 8-15, where
 * a vector a row would leave half its lanes empty. Tap (kh, kw) is one permute of the
 * two input rows 2i - 1 + kh and 2i + 1 + kh (each one masked load), lane 8k + j taking
 * column 2j - 1 + kw of the second when k = 1; the lanes past a row or left of X are
 * zeroed by the permute's mask, columns past X by the loads'. The sums are then moved
 * together (lane 8k + j to k * OW + j, as Y holds the two rows) for + Z, the clip and one
 * store: each output is the same chain as conv_rows, the same bits. */
static int s2_pairs_ok(const geom *g) { return g->ow <= 8 && g->w <= 16; }

static inline __attribute__((always_inline)) void s2_pairs(
        const geom *g, const float *x, const __m512 *wt, __m512 bias, const float *z,
        float *y, vf lo, vf hi, const __m512i *idx, const __mmask16 *m, __m512i pack,
        int has_z, int has_clip) {
    __mmask16 cols = first_lanes(g->w);
    for (int64_t i = 0; i < g->oh; i += 2) {
        __m512 rows[5];     /* input rows 2i - 1 .. 2i + 3, zero outside X */
        for (int k = 0; k < 5; k++) {
            int64_t r = 2 * i - 1 + k;
            rows[k] = r >= 0 && r < g->h ? _mm512_maskz_loadu_ps(cols, x + r * g->w)
                                         : _mm512_setzero_ps();
        }
        __m512 s = bias;
        for (int kh = 0; kh < 3; kh++)
            for (int kw = 0; kw < 3; kw++)
                s = _mm512_fmadd_ps(_mm512_maskz_permutex2var_ps(m[kw], rows[kh], idx[kw],
                                                                 rows[kh + 2]),
                                    wt[kh * 3 + kw], s);
        int64_t n = min64(2, g->oh - i) * g->ow;
        vf v = (vf)_mm512_permutexvar_ps(pack, s);
        if (has_z) v += load_n(z + i * g->ow, n);
        if (has_clip) v = vclip(v, lo, hi);
        store_n(y + i * g->ow, v, n);
    }
}

static inline __attribute__((always_inline)) void s2_narrow_planes(
        const float *x, float *y, const geom *g, const win_args *e, int64_t lo, int64_t hi,
        int has_z, int has_clip) {
    int64_t in_plane = g->h * g->w, out_plane = g->oh * g->ow;
    vf vlo = vsplat(has_clip ? e->clip[0] : 0.0f), vhi = vsplat(has_clip ? e->clip[1] : 0.0f);
    /* idx[kw]: lane 8k + j reads column 2j - 1 + kw of row k (16 + that for k = 1); m[kw]
     * keeps the lanes whose j is an output and whose column is not left of X. pack: lane
     * k * OW + j takes lane 8k + j. */
    int32_t lanes[16] __attribute__((aligned(64)));
    __m512i idx[3];
    __mmask16 m[3];
    for (int kw = 0; kw < 3; kw++) {
        unsigned bits = 0;
        for (int l = 0; l < 16; l++) {
            int j = l % 8, col = 2 * j - 1 + kw;
            lanes[l] = (l / 8) * 16 + (col < 0 ? 0 : col);
            bits |= (unsigned)(j < g->ow && col >= 0) << l;
        }
        idx[kw] = _mm512_load_si512(lanes);
        m[kw] = (__mmask16)bits;
    }
    for (int l = 0; l < 16; l++)
        lanes[l] = l < 2 * g->ow ? (int32_t)((l / g->ow) * 8 + l % g->ow) : 0;
    __m512i pack = _mm512_load_si512(lanes);
    for (int64_t p = lo, c = lo % g->c; p < hi; p++, c = c + 1 == g->c ? 0 : c + 1) {
        __m512 wt[9];
        for (int t = 0; t < 9; t++) wt[t] = _mm512_set1_ps(e->w[c * 9 + t]);
        __m512 bias = _mm512_set1_ps(e->bias != NULL ? e->bias[c] : 0.0f);
        s2_pairs(g, x + p * in_plane, wt, bias, has_z ? e->z + p * out_plane : NULL,
                 y + p * out_plane, vlo, vhi, idx, m, pack, has_z, has_clip);
    }
}

static void run_s2(const float *x, float *y, const geom *g, const win_args *e, int64_t lo,
                   int64_t hi) {
    /* MobileNet's epilogue (bias and clip, no residual) compiled on its own, the others
     * testing theirs at run time: the unrolled groups are large, and four copies of them
     * doubled the library's build time. */
    int hz = e->z != NULL, hc = e->clip != NULL;
    if (s2_pairs_ok(g)) {
        if (!hz && hc) s2_narrow_planes(x, y, g, e, lo, hi, 0, 1);
        else s2_narrow_planes(x, y, g, e, lo, hi, hz, hc);
    } else {
        if (!hz && hc) s2_planes(x, y, g, e, lo, hi, 0, 1);
        else s2_planes(x, y, g, e, lo, hi, hz, hc);
    }
}
#endif

#if defined(__AVX512F__)
/* Stride-1 depthwise convs whose output rows are as wide as the input's (padded as
 * "same" in width: MobileNet's) run straight from X, 16 consecutive output pixels of a
 * plane at a time whatever rows they span: output pixel f reads input pixel f + off[t]
 * for every tap t, a masked load whose mask drops the lanes whose tap falls outside X
 * (they read as the copy's zero padding). No band copy, no wide outputs past each row,
 * no emit pass, and small planes waste no lanes on row ends (a 14 x 14 plane is 13
 * vectors, a 7 x 7 one 4). Each output is the same chain as conv_wide (bias, then a
 * multiply-add per tap in order, + Z, clip): the same bits.
 *
 * The masks: a lane's column test depends only on its pixel modulo W, so the vectors
 * whose rows all keep every tap inside X (the interior) take their masks from a table
 * of the period of 16v mod W; the few vectors at the top and bottom have their own. */
#define FLAT_MAX_TAPS 25
#define FLAT_MAX_PERIOD 64     /* vectors until 16v mod W repeats: W / gcd(W, 16) */
#define FLAT_MAX_EDGE 64       /* vectors at the top and bottom with row masks */
#define FLAT_KU 8              /* vectors computed together: independent FMA chains */

typedef struct {
    int64_t plane, vectors;    /* output pixels and vectors of a plane */
    int64_t period;            /* the interior masks repeat every `period` vectors */
    int64_t va, vb;            /* the interior: vectors [va, vb) */
    int64_t off[FLAT_MAX_TAPS];
} flat_dims;

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) { int64_t t = a % b; a = b; b = t; }
    return a;
}

/* The interior [va, vb): every lane's row keeps every tap's row inside X, the whole
 * vector lies inside the plane, and so do all its taps' 16 values (the interior's loads
 * are not masked: a column past a row's end reads the next row, inside the plane). */
static void flat_size(const geom *g, flat_dims *d) {
    d->plane = g->oh * g->ow;
    d->vectors = (d->plane + 15) / 16;
    d->period = g->w / gcd64(g->w, 16);
    int64_t lowest = 0, highest = 0;
    for (int64_t kh = 0; kh < g->kh; kh++) {
        for (int64_t kw = 0; kw < g->kw; kw++) {
            int64_t o = (kh * g->dh - g->pt) * g->w + kw * g->dw - g->pl;
            d->off[kh * g->kw + kw] = o;
            lowest = min64(lowest, o);
            highest = max64(highest, o);
        }
    }
    int64_t last_row = g->h - 1 + g->pt - (g->kh - 1) * g->dh;    /* of an interior lane */
    d->va = 0;
    while (d->va < d->vectors && (16 * d->va / g->w < g->pt || 16 * d->va + lowest < 0))
        d->va++;
    d->vb = d->va;
    while (d->vb < d->vectors && 16 * d->vb + 15 < d->plane
           && (16 * d->vb + 15) / g->w <= last_row && 16 * d->vb + 15 + highest < g->h * g->w)
        d->vb++;
}

static int flat_ok(const geom *g) {
    if (g->sh != 1 || g->sw != 1 || g->ow != g->w || g->taps > FLAT_MAX_TAPS) return 0;
    flat_dims d;
    flat_size(g, &d);
    return d.period <= FLAT_MAX_PERIOD && d.vectors - (d.vb - d.va) <= FLAT_MAX_EDGE;
}

/* The masks of vector v's taps, m[kh * KW + kw]: lane l keeps tap (kh, kw) where output
 * pixel 16v + l is in the plane and its tap's row and column lie inside X. With `rows`
 * 0 (an interior vector) only the columns are tested, and m holds one mask a kw. */
static void flat_masks(const geom *g, int64_t plane, int64_t v, int rows, __mmask16 *m) {
    int64_t row[16], col[16], i = 16 * v / g->w, j = 16 * v % g->w;
    for (int l = 0; l < 16; l++) {
        row[l] = 16 * v + l < plane ? i : -g->h - g->kh * g->dh;    /* past the plane */
        col[l] = j;
        if (++j == g->w) j = 0, i++;
    }
    for (int64_t kh = 0; kh < (rows ? g->kh : 1); kh++) {
        for (int64_t kw = 0; kw < g->kw; kw++) {
            unsigned bits = 0;
            for (int l = 0; l < 16; l++) {
                int64_t r = row[l] + kh * g->dh - g->pt, c = col[l] + kw * g->dw - g->pl;
                bits |= (unsigned)((!rows || (r >= 0 && r < g->h)) && c >= 0 && c < g->w) << l;
            }
            m[kh * g->kw + kw] = (__mmask16)bits;
        }
    }
}

/* Vectors [v, v + nv) of one plane (x, z, y: the plane's; wt: its weights splat). The
 * masks: m[u * taps + t] at the edges; in the interior (kws: the kernel's width) one a
 * column, m[u * kws + t % kws], and none for column `full` (every lane inside X). */
static inline __attribute__((always_inline)) void flat_vectors(
        const float *x, const __mmask16 *m, const int64_t *off, const __m512 *wt,
        int64_t taps, int64_t kws, int64_t full, __m512 bias, int64_t v, int nv,
        int64_t plane, const float *z, float *y, vf lo, vf hi, int has_z, int has_clip) {
    __m512 s[FLAT_KU];
    const __m512i ident = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const float *p = x + 16 * v;
    for (int u = 0; u < nv; u++) s[u] = bias;
    for (int64_t t = 0; t < taps; t++) {
        for (int u = 0; u < nv; u++) {
            const float *at = p + 16 * u + off[t];
            __m512 in = kws == 0 ? _mm512_maskz_loadu_ps(m[u * taps + t], at)
                        : t % kws == full ? _mm512_loadu_ps(at)
                        : _mm512_maskz_permutexvar_ps(m[u * kws + t % kws], ident,
                                                      _mm512_loadu_ps(at));
            s[u] = _mm512_fmadd_ps(in, wt[t], s[u]);
        }
    }
    for (int u = 0; u < nv; u++) {
        int64_t at = 16 * (v + u), n = plane - at;
        vf r = (vf)s[u];
        if (has_z) r += load_n(z + at, n);
        if (has_clip) r = vclip(r, lo, hi);
        store_n(y + at, r, n);
    }
}

static inline __attribute__((always_inline)) void flat_planes(
        const float *x, float *y, const geom *g, const win_args *e, const flat_dims *d,
        const __mmask16 *inner, const __mmask16 *edge, int64_t taps, int64_t kws,
        int64_t full, int64_t lo, int64_t hi, int has_z, int has_clip) {
    int64_t in_plane = g->h * g->w, plane = d->plane;
    vf vlo = vsplat(has_clip ? e->clip[0] : 0.0f), vhi = vsplat(has_clip ? e->clip[1] : 0.0f);
    for (int64_t p = lo, c = lo % g->c; p < hi; p++, c = c + 1 == g->c ? 0 : c + 1) {
        __m512 wt[FLAT_MAX_TAPS];
        for (int64_t t = 0; t < taps; t++) wt[t] = _mm512_set1_ps(e->w[c * taps + t]);
        __m512 bias = _mm512_set1_ps(e->bias != NULL ? e->bias[c] : 0.0f);
        const float *xp = x + p * in_plane, *zp = has_z ? e->z + p * plane : NULL;
        float *yp = y + p * plane;
        const __mmask16 *em = edge;
        for (int64_t v = 0; v < d->va; v++, em += taps)
            flat_vectors(xp, em, d->off, wt, taps, 0, -1, bias, v, 1, plane, zp, yp, vlo,
                         vhi, has_z, has_clip);
        int64_t v = d->va, q = d->va % d->period;
        for (; v + FLAT_KU <= d->vb; v += FLAT_KU) {
            flat_vectors(xp, inner + q * kws, d->off, wt, taps, kws, full, bias, v, FLAT_KU,
                         plane, zp, yp, vlo, vhi, has_z, has_clip);
            q = (q + FLAT_KU) % d->period;
        }
        for (; v < d->vb; v++) {
            flat_vectors(xp, inner + q * kws, d->off, wt, taps, kws, full, bias, v, 1, plane,
                         zp, yp, vlo, vhi, has_z, has_clip);
            if (++q == d->period) q = 0;
        }
        for (v = d->vb; v < d->vectors; v++, em += taps)
            flat_vectors(xp, em, d->off, wt, taps, 0, -1, bias, v, 1, plane, zp, yp, vlo,
                         vhi, has_z, has_clip);
    }
}

static void run_flat(const float *x, float *y, const geom *g, const win_args *e, int64_t lo,
                     int64_t hi) {
    flat_dims d;
    flat_size(g, &d);
    /* inner: the interior's column masks of vectors k < period + FLAT_KU - 1 (they hold
     * for every vector v with v mod period == k mod period), so a group starting anywhere
     * in the period reads on; edge: the top's masks, then the bottom's. */
    __mmask16 inner[(FLAT_MAX_PERIOD + FLAT_KU) * FLAT_MAX_TAPS];
    __mmask16 edge[FLAT_MAX_EDGE * FLAT_MAX_TAPS];
    int64_t taps = g->taps, kws = g->kw;
    for (int64_t k = 0; k < d.period + FLAT_KU - 1; k++)
        flat_masks(g, d.plane, k, 0, inner + k * kws);
    __mmask16 *em = edge;
    for (int64_t v = 0; v < d.va; v++, em += taps) flat_masks(g, d.plane, v, 1, em);
    for (int64_t v = d.vb; v < d.vectors; v++, em += taps) flat_masks(g, d.plane, v, 1, em);
    /* MobileNet's 3x3 padded by one: the middle column never leaves X. */
    int centered = taps == 9 && kws == 3 && g->dw == 1 && g->pl == 1;
    int hz = e->z != NULL, hc = e->clip != NULL;
    if (centered) {
        if (hz && hc) flat_planes(x, y, g, e, &d, inner, edge, 9, 3, 1, lo, hi, 1, 1);
        else if (hz) flat_planes(x, y, g, e, &d, inner, edge, 9, 3, 1, lo, hi, 1, 0);
        else if (hc) flat_planes(x, y, g, e, &d, inner, edge, 9, 3, 1, lo, hi, 0, 1);
        else flat_planes(x, y, g, e, &d, inner, edge, 9, 3, 1, lo, hi, 0, 0);
    } else {
        flat_planes(x, y, g, e, &d, inner, edge, taps, kws, -1, lo, hi, hz, hc);
    }
}
#endif

/* The depthwise schemes a call may ask for (keel_dwconv2d_mode_f32's mode). */
enum { SCHEME_PLANES = 1, SCHEME_BLOCKED = 2, SCHEME_STRIDED = 3, SCHEME_FLAT = 4 };

/* Whether scheme `mode` serves geometry g in this build (the plane path serves all). */
static int scheme_ok(const geom *g, int64_t mode) {
#if defined(__AVX512F__)
    if (mode == SCHEME_BLOCKED) return blocked_ok(g);
    if (mode == SCHEME_STRIDED) return s2_ok(g);
    if (mode == SCHEME_FLAT) return flat_ok(g);
#endif
    return mode == SCHEME_PLANES;
}

static int64_t run_window(const float *x, float *y, const int64_t *geometry,
                          const win_args *e, float *scratch, int64_t lo, int64_t hi,
                          int64_t mode) {
    geom g;
    int64_t off[MAX_TAPS];
    if (geom_init(&g, geometry) != 0) return -1;
#if defined(__AVX512F__)
    if (e->op == WIN_CONV && mode == SCHEME_BLOCKED && blocked_ok(&g)) {
        run_blocked(x, y, &g, e, scratch, lo, hi);
        return 0;
    }
    if (e->op == WIN_CONV && mode == SCHEME_STRIDED && s2_ok(&g)) {
        run_s2(x, y, &g, e, lo, hi);
        return 0;
    }
    if (e->op == WIN_CONV && mode == SCHEME_FLAT && flat_ok(&g)) {
        run_flat(x, y, &g, e, lo, hi);
        return 0;
    }
#else
    (void)mode;         /* the plane path is the only scheme without AVX-512 */
#endif
    tap_offsets(&g, off);
    int64_t cf = copy_floats(&g, g.band), af = acc_floats(&g, g.band);
    float *copy[2] = {scratch, scratch + cf};
    float *acc[2] = {scratch + 2 * cf, scratch + 2 * cf + af};
    float pad = e->op == WIN_MAX ? -INFINITY : 0.0f;
    /* Padding everywhere once; the slack too, so garbage outputs stay finite. */
    for (int64_t i = 0; i < 2 * cf; i++) scratch[i] = pad;
    int64_t bands = (g.oh + g.band - 1) / g.band, items = (hi - lo) * bands;
    int64_t plane = g.h * g.w;
    /* Wide rows go straight to Y (conv_rows) where the lanes computed past each row are
     * few; the wide scheme with its separate emit pass serves the narrow planes. */
    int direct = e->op == WIN_CONV && g.ow >= DIRECT_MIN_WIDTH
                 && round_up(g.ow, KSTEP) * 6 <= g.ow * 7;
    rowcopy rc = plan_rows(&g, x + hi * plane);
    if (g.sh > 1 && g.w >= PREFETCH_MIN_WIDTH && (hi - lo) * plane > PREFETCH_MIN_FLOATS)
        rc.ahead = max64(PREFETCH_BANDS * g.band * g.sh * g.w, PREFETCH_FLOATS);
    /* A software pipeline: copy band k, compute band k - 1, emit band k - 2 (the plane and
     * first row of the last three bands are kept in a ring: no divisions per band). Loads
     * then read stores made an iteration earlier; on small planes, loads that straddle
     * stores still in flight would cost more than the arithmetic. */
    int64_t ring_p[4] = {0}, ring_c[4] = {0}, ring_oh[4] = {0}, p = lo, c = lo % g.c, oh0 = 0;
    int ring_nan[4] = {0};
    for (int64_t k = 0; k < items + 2; k++) {
        if (k < items) {
            ring_p[k & 3] = p;
            ring_c[k & 3] = c;
            ring_oh[k & 3] = oh0;
            ring_nan[k & 3] = fill_band(x + p * plane, &g, &rc, oh0,
                                        min64(g.oh - oh0, g.band) + g.reach_h, pad, bands > 1,
                                        e->op == WIN_MAX, copy[k & 1]);
            oh0 += g.band;
            if (oh0 >= g.oh) {
                oh0 = 0;
                p++;
                c = c + 1 == g.c ? 0 : c + 1;
            }
        }
        if (k >= 1 && k <= items) {
            int64_t i = (k - 1) & 3;
            if (direct)
                conv_band_out(&g, e, copy[(k - 1) & 1], off, y, ring_p[i], ring_c[i],
                              ring_oh[i], min64(g.oh - ring_oh[i], g.band));
            else
                compute_band(&g, e, copy[(k - 1) & 1], off, acc[(k - 1) & 1], ring_c[i],
                             min64(g.oh - ring_oh[i], g.band), ring_nan[i]);
        }
        if (k >= 2 && !direct) {
            int64_t i = (k - 2) & 3;
            emit_band(&g, e, acc[k & 1], y, ring_p[i], ring_oh[i],
                      min64(g.oh - ring_oh[i], g.band));
        }
    }
    return 0;
}

/* ---- exported kernels ----------------------------------------------------------------- */

/* Y = clip(depthwise_conv(X, W) + B + Z) over planes [lo, hi) of N * C (multiplier 1),
 * plane by plane (every build's scheme; keel_dwconv2d_mode_f32 takes the others).
 * W is (C, 1, KH, KW); B (C,) or NULL; Z like Y or NULL; clip = {low, high} or NULL.
 * Returns 0, or -1 for a geometry it does not serve (then nothing is written). */
int64_t keel_dwconv2d_f32(const float *x, const float *w, const float *bias, const float *z,
                          float *y, const int64_t *geometry, const float *clip,
                          float *scratch, int64_t lo, int64_t hi) {
    win_args e = {WIN_CONV, w, bias, z, clip, NULL};
    return run_window(x, y, geometry, &e, scratch, lo, hi, SCHEME_PLANES);
}

/* keel_dwconv2d_f32 by scheme `mode` (the cpu planner's depthwise_scheme): 1 the planes
 * one by one, 2 the channel blocks (16 planes at a time), 3 the stride-2 rows straight
 * from X, 4 the stride-1 flat vectors straight from X; a scheme that does not serve the
 * geometry (keel_dwconv2d_scheme_ok) runs as planes. Every scheme gives the same bits. */
int64_t keel_dwconv2d_mode_f32(const float *x, const float *w, const float *bias,
                               const float *z, float *y, const int64_t *geometry,
                               const float *clip, float *scratch, int64_t lo, int64_t hi,
                               int64_t mode) {
    win_args e = {WIN_CONV, w, bias, z, clip, NULL};
    return run_window(x, y, geometry, &e, scratch, lo, hi, mode);
}

/* 1 if depthwise scheme `mode` (as keel_dwconv2d_mode_f32 takes it) serves the geometry
 * in this build, 0 if not, -1 for a geometry no scheme serves. */
int64_t keel_dwconv2d_scheme_ok(const int64_t *geometry, int64_t mode) {
    geom g;
    if (geom_init(&g, geometry) != 0) return -1;
    return scheme_ok(&g, mode);
}

/* Y = max over each window (padding never wins; NaN propagates) for planes [lo, hi). */
int64_t keel_maxpool2d_f32(const float *x, float *y, const int64_t *geometry, float *scratch,
                           int64_t lo, int64_t hi) {
    win_args e = {WIN_MAX, NULL, NULL, NULL, NULL, NULL};
    return run_window(x, y, geometry, &e, scratch, lo, hi, SCHEME_PLANES);
}

/* ---- max pooling by output rows: stride 2 across, dilation 1 ---------------------------
 *
 * A float MaxPool with two columns between outputs and at most three taps across
 * (ResNet's 3x3 stride-2 pool after its stem) runs without the band copies, an output
 * row at a time. With AVX-512, sixteen outputs from two vectors of 16 columns (and the
 * first of the next two): each the max over the window's input rows, loaded in place
 * (masked: columns outside the row are -inf, padding never wins while a window holds an
 * input), then the even lanes (tap 0), the odd ones (tap 1) and the even ones one
 * column on (tap 2) by permutes. The plain max instruction serves rows without NaN; a
 * row whose loads hold a NaN is computed again with the max keeping NaN (vmax_nan).
 * Elsewhere, each output row's column maxima go into a row of scratch padded with -inf,
 * then each output takes the max of its columns there. The cpu planner says where it
 * runs (max_pool_by_rows). */

static int rows_ok(const geom *g) {
    return g->sw == 2 && g->kw <= 3 && g->dw == 1 && g->dh == 1;
}
/* The scratch row: every column an output's taps read, padded to whole vectors. */
static int64_t rows_width(const geom *g) { return 2 * round_up(g->ow, KV) + g->kw + 2 * KV; }

/* Floats of scratch keel_maxpool_rows_f32 needs; -1 for a geometry it does not serve. */
int64_t keel_maxpool_rows_scratch(const int64_t *geometry) {
    geom g;
    if (geom_init(&g, geometry) != 0 || !rows_ok(&g)) return -1;
    return rows_width(&g);
}

#if defined(__AVX512F__)
/* The max over input rows [r0, r1) of the 16 columns from c (-inf outside [0, w)); with
 * keep_nan the max keeping NaN, else the plain one, *nan collecting the lanes that were
 * NaN. */
static inline __attribute__((always_inline)) vf column_max16(
        const float *x, const geom *g, int64_t r0, int64_t r1, int64_t c, int keep_nan,
        __mmask16 *nan) {
    /* Plain loads inside the row (masked ones measured 2.6x slower from memory). */
    int whole = c >= 0 && c + KV <= g->w;
    __mmask16 in = first_lanes(g->w - c);
    if (c < 0) in &= (__mmask16)~first_lanes(-c);
    const __m512 lowest = _mm512_set1_ps(-INFINITY);
    vf s = (vf)lowest;
    for (int64_t r = r0; r < r1; r++) {
        const float *p = x + r * g->w + c;
        __m512 v = whole ? _mm512_loadu_ps(p) : _mm512_mask_loadu_ps(lowest, in, p);
        if (keep_nan) {
            s = r == r0 ? (vf)v : vmax_nan(s, (vf)v);
        } else {
            *nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            s = r == r0 ? (vf)v : vmax(s, (vf)v);
        }
    }
    return s;
}

/* One output row from input rows [r0, r1); 0, or nonzero where keep_nan is 0 and a load
 * held a NaN (the row is then to be computed again with keep_nan). */
static inline __attribute__((always_inline)) __mmask16 pool_row16(
        const float *x, const geom *g, int64_t r0, int64_t r1, float *y, int keep_nan) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6,
                                          4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i next = _mm512_set_epi32(16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3,
                                          2, 1);
    __mmask16 nan = 0;
    vf a = column_max16(x, g, r0, r1, -g->pl, keep_nan, &nan);
    for (int64_t o = 0; o < g->ow; o += KV) {
        int64_t c = 2 * o - g->pl;
        vf b = column_max16(x, g, r0, r1, c + KV, keep_nan, &nan);
        vf n = column_max16(x, g, r0, r1, c + 2 * KV, keep_nan, &nan);
        vf s0 = (vf)_mm512_permutex2var_ps((__m512)a, even, (__m512)b), s = s0;
        if (g->kw >= 2) {
            vf t1 = (vf)_mm512_permutex2var_ps((__m512)a, odd, (__m512)b);
            s = keep_nan ? vmax_nan(s, t1) : vmax(s, t1);
        }
        if (g->kw == 3) {
            vf t2 = (vf)_mm512_permutex2var_ps((__m512)s0, next, (__m512)n);
            s = keep_nan ? vmax_nan(s, t2) : vmax(s, t2);
        }
        store_n(y + o, s, g->ow - o);
        a = n;
    }
    return nan;
}

static void pool_row(const float *x, const geom *g, int64_t r0, int64_t r1, float *scratch,
                     float *y) {
    (void)scratch;
    if (r1 <= r0) {
        for (int64_t o = 0; o < g->ow; o++) y[o] = -INFINITY;
        return;
    }
    if (pool_row16(x, g, r0, r1, y, 0)) pool_row16(x, g, r0, r1, y, 1);
}
#else
/* b[j] = max over input rows [r0, r1) of column j - pl, -inf where that is no column. */
static void column_max(const float *x, const geom *g, int64_t r0, int64_t r1, float *b) {
    int64_t wb = rows_width(g), w = g->w, pl = g->pl;
    for (int64_t j = 0; j < wb; j++) b[j] = -INFINITY;
    if (r1 <= r0) return;
    const float *top = x + r0 * w;
    int64_t i = 0;
    for (; i + KV <= w; i += KV) {
        vf s = vload(top + i);
        for (int64_t r = r0 + 1; r < r1; r++) s = vmax_nan(s, vload(x + r * w + i));
        vstore(b + pl + i, s);
    }
    for (; i < w; i++) {
        float s = top[i];
        for (int64_t r = r0 + 1; r < r1; r++) {
            float v = x[r * w + i];
            s = (v > s || v != v) ? v : s;
        }
        b[pl + i] = s;
    }
}

static void pool_row(const float *x, const geom *g, int64_t r0, int64_t r1, float *b,
                     float *y) {
    column_max(x, g, r0, r1, b);
    for (int64_t o = 0; o < g->ow; o++) {
        float s = b[2 * o];
        for (int64_t t = 1; t < g->kw; t++) {
            float v = b[2 * o + t];
            s = (v > s || v != v) ? v : s;
        }
        y[o] = s;
    }
}
#endif

/* Output rows [oy_lo, oy_hi) of `planes` planes whose input rows from row0 on x holds
 * (plane p at x + p * stride * w; its output plane at y + p * oh * ow). */
static void pool_planes(const float *x, int64_t row0, int64_t stride, float *y, const geom *g,
                        float *scratch, int64_t planes, int64_t oy_lo, int64_t oy_hi) {
    for (int64_t p = 0; p < planes; p++) {
        const float *xp = x + p * stride * g->w;
        float *yp = y + p * g->oh * g->ow;
        for (int64_t oy = oy_lo; oy < oy_hi; oy++) {
            int64_t r = oy * g->sh - g->pt;
            pool_row(xp, g, max64(r, 0) - row0, min64(r + g->kh, g->h) - row0, scratch,
                     yp + oy * g->ow);
        }
    }
}

/* Y = max over each window for planes [lo, hi) (the geometry rows_ok serves; scratch of
 * keel_maxpool_rows_scratch floats); -1 for another geometry (nothing written). */
int64_t keel_maxpool_rows_f32(const float *x, float *y, const int64_t *geometry, float *scratch,
                              int64_t lo, int64_t hi) {
    geom g;
    if (geom_init(&g, geometry) != 0 || !rows_ok(&g)) return -1;
    pool_planes(x + lo * g.h * g.w, 0, g.h, y + lo * g.oh * g.ow, &g, scratch, hi - lo, 0,
                g.oh);
    return 0;
}

/* Output rows [oy_lo, oy_hi) of `planes` planes from part of X: x holds rows [row0, row0
 * + rows) of every plane, written ones (plane p at x + p * stride * w, stride >= rows: a
 * buffer's capacity may exceed the rows written in it), y every output row (plane p at
 * y + p * oh * ow). For a kernel that pools a conv's rows while they are in cache
 * (gemm.c's keel_conv_pool_f32, which calls it through its address). The row loop of
 * keel_maxpool_rows_f32 (pool_planes) on the same input rows: bitwise its values. -1 for
 * a geometry it does not serve or an output row reading an input row outside [row0,
 * row0 + rows) (nothing written). */
int64_t keel_maxpool_part_f32(const float *x, int64_t row0, int64_t rows, int64_t stride,
                              float *y, const int64_t *geometry, float *scratch,
                              int64_t planes, int64_t oy_lo, int64_t oy_hi) {
    geom g;
    if (geom_init(&g, geometry) != 0 || !rows_ok(&g)) return -1;
    if (oy_lo < 0 || oy_hi > g.oh || rows < 0 || stride < rows) return -1;
    if (oy_lo < oy_hi && (max64(oy_lo * g.sh - g.pt, 0) < row0
                          || min64((oy_hi - 1) * g.sh - g.pt + g.kh, g.h) > row0 + rows))
        return -1;
    pool_planes(x, row0, stride, y, &g, scratch, planes, oy_lo, oy_hi);
    return 0;
}

/* Y = window sum / count for planes [lo, hi); count (OH, OW) holds the positions each
 * window counts (it carries count_include_pad). */
int64_t keel_avgpool2d_f32(const float *x, float *y, const int64_t *geometry,
                           const float *count, float *scratch, int64_t lo, int64_t hi) {
    win_args e = {WIN_AVG, NULL, NULL, NULL, NULL, count};
    return run_window(x, y, geometry, &e, scratch, lo, hi, SCHEME_PLANES);
}

/* y[p] = max of plane p (NaN if it holds one), for p in [lo, hi). */
void keel_global_maxpool_f32(const float *x, float *y, int64_t size, int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; p++) {
        const float *a = x + p * size;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 s = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (; i + 16 <= size; i += 16) {
            __m512 v = _mm512_loadu_ps(a + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            s = _mm512_max_ps(v, s);
        }
        if (i < size) {
            __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(size - i),
                                            a + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            s = _mm512_max_ps(v, s);
        }
        y[p] = nan ? NAN : _mm512_reduce_max_ps(s);
#else
        vf s = vsplat(-INFINITY);
        for (; i + KV <= size; i += KV) s = vmax_nan(s, vload(a + i));
        float m = -INFINITY;
        for (int k = 0; k < KV; k++) m = (s[k] > m || s[k] != s[k]) ? s[k] : m;
        for (; i < size; i++) m = (a[i] > m || a[i] != a[i]) ? a[i] : m;
        y[p] = m;
#endif
    }
}

/* y[p] = the mean of plane p, for p in [lo, hi): the plane summed in 16 lanes (then
 * across them in a fixed order) and divided by its size, so a plane's value does not
 * depend on which thread computes it. */
void keel_global_avgpool_f32(const float *x, float *y, int64_t size, int64_t lo, int64_t hi) {
    const float n = (float)size;
    for (int64_t p = lo; p < hi; p++) {
        const float *a = x + p * size;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 s = _mm512_setzero_ps(), t = _mm512_setzero_ps();
        for (; i + 32 <= size; i += 32) {
            s = _mm512_add_ps(s, _mm512_loadu_ps(a + i));
            t = _mm512_add_ps(t, _mm512_loadu_ps(a + i + 16));
        }
        if (i + 16 <= size) {
            s = _mm512_add_ps(s, _mm512_loadu_ps(a + i));
            i += 16;
        }
        if (i < size) t = _mm512_add_ps(t, _mm512_maskz_loadu_ps(first_lanes(size - i), a + i));
        y[p] = _mm512_reduce_add_ps(_mm512_add_ps(s, t)) / n;
#else
        vf s = vsplat(0.0f);
        for (; i + KV <= size; i += KV) s = s + vload(a + i);
        float m = 0.0f;
        for (int k = 0; k < KV; k++) m += s[k];
        for (; i < size; i++) m += a[i];
        y[p] = m / n;
#endif
    }
}

/* Floats of scratch the kernels need for this geometry (per calling thread); -1 if unserved. */
int64_t keel_window_scratch(const int64_t *geometry) {
    geom g;
    if (geom_init(&g, geometry) != 0) return -1;
#if defined(__AVX512F__)
    if (blocked_ok(&g)) return max64(band_floats(&g, g.band), blocked_floats(&g));
#endif
    return band_floats(&g, g.band);
}

/* ---- on keel's worker threads ------------------------------------------------------ */

#include <stdatomic.h>

#include "parallel.h"

typedef struct {
    const float *x;
    float *y;
    const int64_t *geometry;
    win_args e;
    int64_t mode;
    _Atomic int64_t rc;
} window_job;

static void window_task(void *ctx, float *scratch, int64_t lo, int64_t hi) {
    window_job *j = ctx;
    if (run_window(j->x, j->y, j->geometry, &j->e, scratch, lo, hi, j->mode) != 0)
        atomic_store(&j->rc, -1);
}

/* run_window over planes [0, planes) in `parts` chunks; -1 for a geometry it does not
 * serve (then nothing is written) or when scratch could not be allocated. */
static int64_t window_mt(window_job *j, int64_t planes, int64_t parts) {
    int64_t floats = keel_window_scratch(j->geometry);
    if (floats < 0) return -1;
    atomic_init(&j->rc, 0);
    if (run_parts(window_task, j, planes, parts, floats) != 0) return -1;
    return atomic_load(&j->rc);
}

/* keel_dwconv2d_mode_f32 over planes [0, planes) in `parts` chunks on keel's threads. */
int64_t keel_dwconv2d_mt_f32(const float *x, const float *w, const float *bias,
                             const float *z, float *y, const int64_t *geometry,
                             const float *clip, int64_t mode, int64_t planes, int64_t parts) {
    window_job j = {x, y, geometry, {WIN_CONV, w, bias, z, clip, NULL}, mode, 0};
    return window_mt(&j, planes, parts);
}

/* keel_maxpool2d_f32 over planes [0, planes) in `parts` chunks on keel's threads. */
int64_t keel_maxpool2d_mt_f32(const float *x, float *y, const int64_t *geometry,
                              int64_t planes, int64_t parts) {
    window_job j = {x, y, geometry, {WIN_MAX, NULL, NULL, NULL, NULL, NULL}, 0, 0};
    return window_mt(&j, planes, parts);
}

typedef struct {
    const float *x;
    float *y;
    const int64_t *geometry;
} rows_job;

static void rows_task(void *ctx, float *scratch, int64_t lo, int64_t hi) {
    const rows_job *j = ctx;
    keel_maxpool_rows_f32(j->x, j->y, j->geometry, scratch, lo, hi);
}

/* keel_maxpool_rows_f32 over planes [0, planes) in `parts` chunks on keel's threads. */
int64_t keel_maxpool_rows_mt_f32(const float *x, float *y, const int64_t *geometry,
                                 int64_t planes, int64_t parts) {
    int64_t floats = keel_maxpool_rows_scratch(geometry);
    if (floats < 0) return -1;
    rows_job j = {x, y, geometry};
    return run_parts(rows_task, &j, planes, parts, floats) != 0 ? -1 : 0;
}

/* keel_avgpool2d_f32 over planes [0, planes) in `parts` chunks on keel's threads. */
int64_t keel_avgpool2d_mt_f32(const float *x, float *y, const int64_t *geometry,
                              const float *count, int64_t planes, int64_t parts) {
    window_job j = {x, y, geometry, {WIN_AVG, NULL, NULL, NULL, NULL, count}, 0, 0};
    return window_mt(&j, planes, parts);
}

typedef struct {
    const float *x;
    float *y;
    int64_t size;
} global_job;

static void global_max_task(void *ctx, float *scratch, int64_t lo, int64_t hi) {
    const global_job *j = ctx;
    (void)scratch;
    keel_global_maxpool_f32(j->x, j->y, j->size, lo, hi);
}

static void global_avg_task(void *ctx, float *scratch, int64_t lo, int64_t hi) {
    const global_job *j = ctx;
    (void)scratch;
    keel_global_avgpool_f32(j->x, j->y, j->size, lo, hi);
}

/* keel_global_avgpool_f32 over planes [0, planes) in `parts` chunks on keel's threads. */
int64_t keel_global_avgpool_mt_f32(const float *x, float *y, int64_t size, int64_t planes,
                                   int64_t parts) {
    global_job j = {x, y, size};
    return run_parts(global_avg_task, &j, planes, parts, 0);
}

/* keel_global_maxpool_f32 over planes [0, planes) in `parts` chunks on keel's threads. */
int64_t keel_global_maxpool_mt_f32(const float *x, float *y, int64_t size, int64_t planes,
                                   int64_t parts) {
    global_job j = {x, y, size};
    return run_parts(global_max_task, &j, planes, parts, 0);
}

/* Stride-phase copies of NCHW planes (the native conv's phase images; conv_gemm.py).
 *
 * geometry: F, H, W, QH, QW, then per fill f eight values U0, V0, ROWS, COLS, R0, C0, SH,
 * SW: y[f][p][U0 + i][V0 + j] = x[p][R0 + i * SH][C0 + j * SW] for i < ROWS, j < COLS.
 * x is (planes, H, W), y is (F, planes, QH, QW), both C-contiguous; nothing else of y
 * is written. Each fill's ROWS rows of a plane are cut into BANDS bands (the cpu
 * planner's phase_copy_split: a batch-1 stem has 3 planes for 16 threads), unit u being
 * band u % BANDS of plane u / BANDS: that band of every fill's rows (rows of y, fill by
 * fill; not of x). Units [lo, hi): a copy, so any split gives the same bytes. */
typedef struct {
    const float *x;
    float *y;
    const int64_t *geometry;
    int64_t planes;
    int64_t bands;
} phase_job;

/* t[i] = s[2 * i] for i < cols: a stride-2 phase's row. With AVX-512 two loads and one
 * permute make 16 of them; the loads' lanes past s[2 * (cols - 1)] are masked off (not
 * read: the row may end the buffer). The same bytes as the scalar loop. ResNet-20's
 * phase copies alone (one thread, thread CPU time, medians, under load; scalar ->
 * permuted): 16 channels of 32x32 into the 3x3 stride-2 conv's four phases 254 -> 170 us
 * at batch 32 and 5.5 -> 3.3 us at batch 1, 32 channels of 16x16 189 -> 146 us at batch
 * 32, the 1x1 stride-2 conv's one phase 76 -> 67 us at batch 32 and 1.9 -> 1.4 at 1. */
static void copy_stride2(float *t, const float *s, int64_t cols) {
#if defined(__AVX512F__)
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                           26, 28, 30);
    int64_t i = 0;
    for (; i + 16 <= cols; i += 16) {
        __m512 lo = _mm512_loadu_ps(s + 2 * i);
        __m512 hi = _mm512_maskz_loadu_ps((__mmask16)0x7fff, s + 2 * i + 16);
        _mm512_storeu_ps(t + i, _mm512_permutex2var_ps(lo, even, hi));
    }
    if (i < cols) {
        int64_t left = cols - i, need = 2 * left - 1; /* floats from s + 2 * i: 1 .. 29 */
        __mmask16 mlo = (__mmask16)(need >= 16 ? 0xffffu : (1u << need) - 1u);
        __mmask16 mhi = (__mmask16)(need > 16 ? (1u << (need - 16)) - 1u : 0u);
        __m512 lo = _mm512_maskz_loadu_ps(mlo, s + 2 * i);
        __m512 hi = _mm512_maskz_loadu_ps(mhi, s + 2 * i + 16);
        _mm512_mask_storeu_ps(t + i, (__mmask16)((1u << left) - 1u),
                              _mm512_permutex2var_ps(lo, even, hi));
    }
#else
    for (int64_t i = 0; i < cols; i++) t[i] = s[2 * i];
#endif
}

static void phase_copy_planes(const phase_job *j, int64_t lo, int64_t hi) {
    const int64_t *g = j->geometry;
    int64_t fills = g[0], h = g[1], w = g[2], qh = g[3], qw = g[4], bands = j->bands;
    for (int64_t u = lo; u < hi; u++) {       /* every fill of a band while it is in cache */
        int64_t p = u / bands, b = u % bands;
        for (int64_t f = 0; f < fills; f++) {
            const int64_t *d = g + 5 + 8 * f;
            int64_t u0 = d[0], v0 = d[1], rows = d[2], cols = d[3], r0 = d[4], c0 = d[5];
            int64_t sh = d[6], sw = d[7];
            const float *src = j->x + p * h * w + r0 * w + c0;
            float *dst = j->y + (f * j->planes + p) * qh * qw + u0 * qw + v0;
            for (int64_t i = rows * b / bands; i < rows * (b + 1) / bands; i++) {
                const float *s = src + i * sh * w;
                float *t = dst + i * qw;
                if (sw == 1) {
                    memcpy(t, s, (size_t)cols * sizeof(float));
                } else if (sw == 2) {
                    copy_stride2(t, s, cols);
                } else {
                    for (int64_t c = 0; c < cols; c++) t[c] = s[c * sw];
                }
            }
        }
    }
}

static void phase_task(void *ctx, float *scratch, int64_t lo, int64_t hi) {
    (void)scratch;
    phase_copy_planes(ctx, lo, hi);
}

/* The copies above over planes [0, planes), each fill's rows of a plane in `bands`
 * bands, in `parts` chunks of those units on keel's threads. */
int64_t keel_phase_copy_mt_f32(const float *x, float *y, const int64_t *geometry,
                               int64_t planes, int64_t bands, int64_t parts) {
    if (bands < 1) return 1;
    phase_job j = {x, y, geometry, planes, bands};
    return run_parts(phase_task, &j, planes * bands, parts, 0);
}

/* A strided view copied into a C-contiguous array (a Transpose's materialization).
 *
 * geometry: RANK (1..8), ELEM (bytes: 1, 2, 4 or 8), then RANK dims, then RANK strides
 * of x in elements. y is C-contiguous of those dims. Rows (every index but the last)
 * [lo, hi): a copy, so any split gives the same bytes. */
#define COPY_MAX_RANK 8

typedef struct {
    const char *x;
    char *y;
    const int64_t *geometry;
} strided_job;

static void strided_rows(const strided_job *j, int64_t lo, int64_t hi) {
    const int64_t *g = j->geometry;
    int64_t rank = g[0], elem = g[1];
    const int64_t *dims = g + 2, *strides = g + 2 + rank;
    int64_t n = dims[rank - 1], step = strides[rank - 1] * elem;
    int64_t idx[COPY_MAX_RANK] = {0}, rest = lo, offset = 0;
    for (int64_t d = rank - 2; d >= 0; d--) {       /* the first row's index and offset */
        idx[d] = rest % dims[d];
        rest /= dims[d];
        offset += idx[d] * strides[d];
    }
    for (int64_t r = lo; r < hi; r++) {
        const char *s = j->x + offset * elem;
        char *t = j->y + r * n * elem;
        if (step == elem) {
            memcpy(t, s, (size_t)(n * elem));
        } else if (elem == 4) {
            for (int64_t c = 0; c < n; c++) memcpy(t + 4 * c, s + c * step, 4);
        } else {
            for (int64_t c = 0; c < n; c++) memcpy(t + elem * c, s + c * step, (size_t)elem);
        }
        for (int64_t d = rank - 2; d >= 0; d--) {   /* the next row: an odometer */
            offset += strides[d];
            if (++idx[d] < dims[d]) break;
            offset -= idx[d] * strides[d];
            idx[d] = 0;
        }
    }
}

static void strided_task(void *ctx, float *scratch, int64_t lo, int64_t hi) {
    (void)scratch;
    strided_rows(ctx, lo, hi);
}

/* The copy above over rows [0, rows) in `parts` chunks on keel's threads; -1 for a
 * geometry it does not take (nothing is written then). */
int64_t keel_strided_copy_mt(const void *x, void *y, const int64_t *geometry, int64_t rows,
                             int64_t parts) {
    int64_t rank = geometry[0], elem = geometry[1];
    if (rank < 1 || rank > COPY_MAX_RANK || (elem != 1 && elem != 2 && elem != 4 && elem != 8))
        return -1;
    strided_job j = {x, y, geometry};
    return run_parts(strided_task, &j, rows, parts, 0);
}

/* A Gather along one axis (an embedding lookup: axis 0 of a table): for each of `outer`
 * leading indices and each of `count` indices i, y's next `inner` bytes are x's at
 * [o][indices[i]], an index below 0 counting from the end of the axis's `size` entries.
 * Rows (o, i) [lo, hi): a copy, so any split gives the same bytes. */
typedef struct {
    const char *x;
    char *y;
    const void *indices;
    int64_t index_bytes, count, size, inner;
} gather_job;

static inline int64_t raw_index(const void *indices, int64_t index_bytes, int64_t i) {
    return index_bytes == 8 ? ((const int64_t *)indices)[i] : ((const int32_t *)indices)[i];
}

static inline int64_t gather_index(const gather_job *j, int64_t i) {
    int64_t k = raw_index(j->indices, j->index_bytes, i);
    return k < 0 ? k + j->size : k;
}

static void gather_rows(const gather_job *j, int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
        int64_t o = r / j->count, k = gather_index(j, r % j->count);
        memcpy(j->y + r * j->inner, j->x + (o * j->size + k) * j->inner, (size_t)j->inner);
    }
}

static void gather_task(void *ctx, float *scratch, int64_t lo, int64_t hi) {
    (void)scratch;
    gather_rows(ctx, lo, hi);
}

/* The gather above over rows [0, outer x count) in `parts` chunks on keel's threads.
 * Every index is checked first, so an index outside [-size, size) writes nothing and
 * returns 1 (the caller names it); 2 for indices of another width than 4 or 8 bytes or
 * a negative size, nothing written; -1 where a worker found no memory for its scratch. */
int64_t keel_gather_rows_mt(const void *x, void *y, const void *indices, int64_t index_bytes,
                            int64_t outer, int64_t count, int64_t size, int64_t inner,
                            int64_t parts) {
    if ((index_bytes != 4 && index_bytes != 8) || inner < 0 || size < 0) return 2;
    gather_job j = {x, y, indices, index_bytes, count, size, inner};
    for (int64_t i = 0; i < count; i++) {
        int64_t k = raw_index(indices, index_bytes, i);
        if (k < -size || k >= size) return 1;
    }
    if (outer * count == 0) return 0;
    return run_parts(gather_task, &j, outer * count, parts, 0);
}
