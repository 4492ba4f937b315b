/* int8 matrix products and 2-D convolutions: 8-bit operands, int32 accumulators and
 * the requantization to 8 bits (or float32) fused into the store.
 *
 * Every product here is  Y[i][j] = requant( sum_k R[i][k] * V[k][j] + corrections )
 * with one operand broadcast a row at a time (R) and the other loaded a vector of
 * columns at a time (V). A convolution broadcasts the weights (R = W[M][K], s8) over
 * im2col columns of the input (V, u8: one column per output pixel), so its output
 * comes out NCHW; a matmul broadcasts the activations (R = A[rows][K], u8) over the
 * weights (V = B[K][N], s8). Signed activations and unsigned weights are shifted by
 * 128 on the way in (x + 128 against zero point + 128, and the same for weights): the
 * products of (x - zero point) are unchanged.
 *
 * V lives in panels of NB = 64 columns: for each quad of k (four consecutive k), the
 * 64 columns' four bytes side by side, [K/4][NB][4], which is what one vpdpbusd takes
 * (per 32-bit lane: the sum of four u8 x s8 products, added to the lane's int32).
 * A tile is MR = 6 rows of R by the 64 columns of one panel:
 *
 *   - AVX-512 VNNI (__AVX512VNNI__): 24 zmm accumulators, 4 panel loads and 6 broadcasts
 *     per quad (the last 2 or 4 rows of an M that 6 does not divide: 8 or 16);
 *   - AVX-VNNI (__AVXVNNI__, 256 bits): the panel in four quarters of 16 columns,
 *     12 ymm accumulators each;
 *   - elsewhere: the same loops in plain C (the portable path).
 *
 * keel_qgemm_isa() says which one this build has (2, 1 or 0). Padding k to a multiple
 * of 4 puts zeros in R (the packed weights, or the caller's copy of A), so padded
 * columns of V add nothing.
 *
 * Corrections and requantization (the zero points are folded into int32 terms):
 *
 *   acc = sum R V + bias_r[i] + bias_c[j] + zr[i] * sv[j] + zv[j] * sr[i]
 *   y   = clamp(round_half_even((float)acc * mult) + y_zero_point, lo, hi)  (8-bit output)
 *   y   = (float)acc * mult                                                 (float output)
 *
 * with sv the column sums of V (computed while packing a convolution's columns) and
 * sr the row sums of R, each term present only when its arrays are, and mult one
 * float32 value (passed as a double) per row or per column. The product and the
 * rounding run in float32, as onnxruntime's and keel's reference kernels do, so an
 * 8-bit result is the reference's bit for bit. Each
 * output is computed the same way whatever the split over threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "enums.h"
#include "parallel.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define QISA 2
#elif defined(__AVXVNNI__) && defined(__AVX2__)
#include <immintrin.h>
#define QISA 1
#else
#define QISA 0
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define NB 64
#define MR 6

/* 2: AVX-512 VNNI, 1: AVX-VNNI, 0: portable C. */
int64_t keel_qgemm_isa(void) { return QISA; }
/* Columns of a V panel (the weight panels a matmul prepacks). */
int64_t keel_qgemm_panel(void) { return NB; }

static inline int32_t quad(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if QISA == 2
/* The AVX-512 tile's pieces, shared by tile() and tile_rows(): 24 accumulators as named
 * variables (an array of them is kept on the stack); a tile of at most 2 or 4 rows (the
 * last of an M that 6 does not divide) runs with 8 or 16 of them and leaves acc's other
 * rows as they were. TILE_LOADS (defined by each user) declares b0..b3, the quad's 64
 * columns, from vq. */
#define ZERO4(i) __m512i c##i##0 = _mm512_setzero_si512(), c##i##1 = c##i##0, \
                 c##i##2 = c##i##0, c##i##3 = c##i##0
#define DOT4(i) do { \
        __m512i a = _mm512_set1_epi32(quad(row[i] + 4 * q)); \
        if (r_u8) { \
            c##i##0 = _mm512_dpbusd_epi32(c##i##0, a, b0); \
            c##i##1 = _mm512_dpbusd_epi32(c##i##1, a, b1); \
            c##i##2 = _mm512_dpbusd_epi32(c##i##2, a, b2); \
            c##i##3 = _mm512_dpbusd_epi32(c##i##3, a, b3); \
        } else { \
            c##i##0 = _mm512_dpbusd_epi32(c##i##0, b0, a); \
            c##i##1 = _mm512_dpbusd_epi32(c##i##1, b1, a); \
            c##i##2 = _mm512_dpbusd_epi32(c##i##2, b2, a); \
            c##i##3 = _mm512_dpbusd_epi32(c##i##3, b3, a); \
        } \
    } while (0)
#define STORE4(i) do { \
        _mm512_storeu_si512((void *)(acc + i * NB), c##i##0); \
        _mm512_storeu_si512((void *)(acc + i * NB + 16), c##i##1); \
        _mm512_storeu_si512((void *)(acc + i * NB + 32), c##i##2); \
        _mm512_storeu_si512((void *)(acc + i * NB + 48), c##i##3); \
    } while (0)
#define QUADS(body) \
    for (int64_t q = 0; q < k4; q++) { \
        const uint8_t *vq = v + (offsets ? offsets[q] : q * NB * 4); \
        TILE_LOADS \
        body \
    }
#define TILE_ROWS() do { \
        if (mr <= 2) { \
            ZERO4(0); ZERO4(1); \
            QUADS(DOT4(0); DOT4(1);) \
            STORE4(0); STORE4(1); \
        } else if (mr <= 4) { \
            ZERO4(0); ZERO4(1); ZERO4(2); ZERO4(3); \
            QUADS(DOT4(0); DOT4(1); DOT4(2); DOT4(3);) \
            STORE4(0); STORE4(1); STORE4(2); STORE4(3); \
        } else { \
            ZERO4(0); ZERO4(1); ZERO4(2); ZERO4(3); ZERO4(4); ZERO4(5); \
            QUADS(DOT4(0); DOT4(1); DOT4(2); DOT4(3); DOT4(4); DOT4(5);) \
            STORE4(0); STORE4(1); STORE4(2); STORE4(3); STORE4(4); STORE4(5); \
        } \
    } while (0)
#define TILE_LOADS \
    __m512i b0 = _mm512_loadu_si512((const void *)vq); \
    __m512i b1 = _mm512_loadu_si512((const void *)(vq + 64)); \
    __m512i b2 = _mm512_loadu_si512((const void *)(vq + 128)); \
    __m512i b3 = _mm512_loadu_si512((const void *)(vq + 192));
#endif

/* acc[MR][NB] = R[rows][4 k4] . panel: rows [0, mr) (rows past `mr` repeat the last one
 * or are left as they were). r_u8: R holds the unsigned operand (a matmul's
 * activations), else V does (a convolution's). */
static inline void tile(const uint8_t *r, int64_t ldr, int64_t mr, const uint8_t *v,
                        const int64_t *offsets, int64_t k4, int32_t *acc, int r_u8)
{
    const uint8_t *row[MR];
    for (int i = 0; i < MR; i++) row[i] = r + (i < mr ? i : mr - 1) * ldr;
#if QISA == 2
    TILE_ROWS();
#undef TILE_LOADS
#elif QISA == 1
    for (int h = 0; h < 4; h++) {
#define ZERO2(i) __m256i c##i##0 = _mm256_setzero_si256(), c##i##1 = c##i##0
        ZERO2(0); ZERO2(1); ZERO2(2); ZERO2(3); ZERO2(4); ZERO2(5);
#define DOT2(i) do { \
            __m256i a = _mm256_set1_epi32(quad(row[i] + 4 * q)); \
            if (r_u8) { \
                c##i##0 = _mm256_dpbusd_avx_epi32(c##i##0, a, b0); \
                c##i##1 = _mm256_dpbusd_avx_epi32(c##i##1, a, b1); \
            } else { \
                c##i##0 = _mm256_dpbusd_avx_epi32(c##i##0, b0, a); \
                c##i##1 = _mm256_dpbusd_avx_epi32(c##i##1, b1, a); \
            } \
        } while (0)
        for (int64_t q = 0; q < k4; q++) {
            const uint8_t *vq = v + (offsets ? offsets[q] : q * NB * 4) + 64 * h;
            __m256i b0 = _mm256_loadu_si256((const void *)vq);
            __m256i b1 = _mm256_loadu_si256((const void *)(vq + 32));
            DOT2(0); DOT2(1); DOT2(2); DOT2(3); DOT2(4); DOT2(5);
        }
#define STORE2(i) do { \
            _mm256_storeu_si256((void *)(acc + i * NB + 16 * h), c##i##0); \
            _mm256_storeu_si256((void *)(acc + i * NB + 16 * h + 8), c##i##1); \
        } while (0)
        STORE2(0); STORE2(1); STORE2(2); STORE2(3); STORE2(4); STORE2(5);
#undef ZERO2
#undef DOT2
#undef STORE2
    }
#else
    for (int i = 0; i < MR; i++) {
        int32_t *ci = acc + i * NB;
        for (int j = 0; j < NB; j++) ci[j] = 0;
        for (int64_t q = 0; q < k4; q++) {
            const uint8_t *vq = v + (offsets ? offsets[q] : q * NB * 4);
            const uint8_t *rq = row[i] + 4 * q;
            for (int t = 0; t < 4; t++) {
                int32_t a = r_u8 ? (int32_t)rq[t] : (int32_t)(int8_t)rq[t];
                for (int j = 0; j < NB; j++) {
                    int32_t b = r_u8 ? (int32_t)(int8_t)vq[4 * j + t] : (int32_t)vq[4 * j + t];
                    ci[j] += a * b;
                }
            }
        }
    }
#endif
}

#if QISA == 2
/* tile() for a convolution whose 64 columns are `nseg` runs of 64 / nseg consecutive
 * positions of the padded layout (one output row each: see "row segments" below): run s
 * starts seg[s] bytes past the quad's own offset. Four runs are whole vector loads, eight
 * are pairs of half loads. */
#define TILE_LOADS \
    __m512i b0 = _mm512_loadu_si512((const void *)(vq + seg[0])); \
    __m512i b1 = _mm512_loadu_si512((const void *)(vq + seg[1])); \
    __m512i b2 = _mm512_loadu_si512((const void *)(vq + seg[2])); \
    __m512i b3 = _mm512_loadu_si512((const void *)(vq + seg[3]));
#define SEG8_PAIR(a, b) _mm512_inserti64x4( \
    _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(vq + seg[a]))), \
    _mm256_loadu_si256((const void *)(vq + seg[b])), 1)
static void tile_rows(const uint8_t *r, int64_t ldr, int64_t mr, const uint8_t *v,
                      const int64_t *offsets, const int64_t *seg, int64_t nseg, int64_t k4,
                      int32_t *acc)
{
    const int r_u8 = 0;
    const uint8_t *row[MR];
    for (int i = 0; i < MR; i++) row[i] = r + (i < mr ? i : mr - 1) * ldr;
    if (nseg == 4) {
        TILE_ROWS();
        return;
    }
#undef TILE_LOADS
#define TILE_LOADS \
    __m512i b0 = SEG8_PAIR(0, 1), b1 = SEG8_PAIR(2, 3); \
    __m512i b2 = SEG8_PAIR(4, 5), b3 = SEG8_PAIR(6, 7);
    TILE_ROWS();
}
#undef TILE_LOADS
#undef SEG8_PAIR
#undef TILE_ROWS
#undef QUADS
#undef STORE4
#undef DOT4
#undef ZERO4
#endif

/* The requantization: what the corrections and the store take (see the header). */
typedef struct {
    const int32_t *bias_r, *bias_c, *zr, *zv, *sr;
    const double *mult;
    int64_t mult_per_col;
    int64_t yzp, lo, hi, kind;    /* kind: 0 uint8, 1 int8, 2 float32 */
} requant;

enum { KIND_U8, KIND_S8, KIND_F32 };

/* A call's quant array: the output's zero point, range and kind, requant's last fields. */
enum { QUANT_YZP, QUANT_LO, QUANT_HI, QUANT_KIND, QUANT_LEN };
#define QUANT_FIELDS(quant) \
    (quant)[QUANT_YZP], (quant)[QUANT_LO], (quant)[QUANT_HI], (quant)[QUANT_KIND]

#if QISA == 2
/* 16 of a row's multipliers (doubles holding float32 values) as floats. */
static __m512 mult16(const double *mult, __mmask16 k)
{
    __m256 a = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd((__mmask8)k, mult));
    __m256 b = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd((__mmask8)(k >> 8), mult + 8));
    return _mm512_castsi512_ps(_mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_castps_si256(a)), _mm256_castps_si256(b), 1));
}

/* store_row on 16 lanes of float at a time: the same operations (int32 -> float,
 * times the multiplier, round half to even, plus the zero point, clamp), so the same
 * bits; the clamped values fit the output type, which vpmovdb then truncates to. */
static void store_row_avx512(const int32_t *v, int64_t n, const double *mult, double m,
                             const requant *q, void *y)
{
    __m512 zp = _mm512_set1_ps((float)q->yzp), lo = _mm512_set1_ps((float)q->lo);
    __m512 hi = _mm512_set1_ps((float)q->hi), mm = _mm512_set1_ps((float)m);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 t = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(k, v + j));
        t = _mm512_mul_ps(t, mult ? mult16(mult + j, k) : mm);
        if (q->kind == KIND_F32) {
            _mm512_mask_storeu_ps((float *)y + j, k, t);
            continue;
        }
        t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(t, zp), lo), hi);
        _mm512_mask_cvtepi32_storeu_epi8((char *)y + j, k, _mm512_cvtps_epi32(t));
    }
}
#endif

/* Requantize one row of n accumulators (corrections already added) into y, in float32
 * as onnxruntime does: float(acc) * float(multiplier), rounded half to even, plus the
 * zero point, clamped. The multipliers are float32 values held in doubles. */
static void store_row(const int32_t *v, int64_t n, const double *mult, double m,
                      const requant *q, void *y)
{
#if QISA == 2
    store_row_avx512(v, n, mult, m, q, y);
    return;
#endif
    float mf = (float)m;
    if (q->kind == KIND_F32) {
        float *out = y;
        for (int64_t j = 0; j < n; j++) out[j] = (float)v[j] * (mult ? (float)mult[j] : mf);
        return;
    }
    float zp = (float)q->yzp, lo = (float)q->lo, hi = (float)q->hi;
    int32_t r[NB];
    for (int64_t j = 0; j < n; j++) {
        float t = nearbyintf((float)v[j] * (mult ? (float)mult[j] : mf)) + zp;
        r[j] = (int32_t)(t < lo ? lo : t > hi ? hi : t);
    }
    if (q->kind == KIND_U8) {
        uint8_t *out = y;
        for (int64_t j = 0; j < n; j++) out[j] = (uint8_t)r[j];
    } else {
        int8_t *out = y;
        for (int64_t j = 0; j < n; j++) out[j] = (int8_t)r[j];
    }
}

#if QISA == 2
/* Four vectors of int32 results, each lane within the 8-bit output's range, as their 64
 * bytes in order: saturating packs to int16 and to bytes (int8 or uint8; they never act)
 * and one permutation, since 128-bit lane L of the packs holds lanes 4L..4L+3 of each
 * vector (dword 4L + k is vector k's). One store where a narrowing store per 16 lanes
 * cost two operations each. */
static inline __attribute__((always_inline)) __m512i
pack_bytes(__m512i a, __m512i b, __m512i c, __m512i d, int is_signed)
{
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11,
                                            15);
    __m512i ab = _mm512_packs_epi32(a, b), cd = _mm512_packs_epi32(c, d);
    return _mm512_permutexvar_epi32(order, is_signed ? _mm512_packs_epi16(ab, cd)
                                                     : _mm512_packus_epi16(ab, cd));
}

/* Rows [0, mr) of a convolution's tile (bias and multiplier per row, no other
 * corrections, 8-bit output) requantized into out[MR][NB]: store_row's results on all
 * 64 columns, for the caller to copy the valid runs from. The same bits in fewer steps:
 * the product is clamped to [lo - zp, hi - zp] before it is rounded (rounding is
 * monotonic and those bounds are integers, so clamping first or last gives the same
 * integer), the conversion rounds half to even itself, and the zero point is added to
 * the integers; a row's four vectors of results, which fit the output type, go to bytes
 * by saturating packs and one permutation (one store a row, where a narrowing store per
 * 16 columns cost two operations each). */
static void requant_tile(const int32_t *acc, int64_t mr, int64_t i0, const requant *q,
                         uint8_t *out)
{
    __m512 lo = _mm512_set1_ps((float)(q->lo - q->yzp));
    __m512 hi = _mm512_set1_ps((float)(q->hi - q->yzp));
    __m512i zp = _mm512_set1_epi32((int32_t)q->yzp);
    for (int64_t i = 0; i < mr; i++) {
        __m512i bias = _mm512_set1_epi32(q->bias_r ? q->bias_r[i0 + i] : 0);
        __m512 m = _mm512_set1_ps((float)q->mult[i0 + i]);
        __m512i r[4];
        for (int k = 0; k < 4; k++) {
            __m512i v = _mm512_add_epi32(
                _mm512_loadu_si512((const void *)(acc + i * NB + 16 * k)), bias);
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(v), m);
            t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
            r[k] = _mm512_add_epi32(
                _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
        }
        _mm512_storeu_si512((void *)(out + i * NB),
                            pack_bytes(r[0], r[1], r[2], r[3], q->kind == KIND_S8));
    }
}
#endif

/* Store rows [i0, i0 + rows) x columns [j0, j0 + cols) of Y from a tile; sv holds the
 * tile's column sums of V (or is NULL). */
static void store(const int32_t *acc, int64_t rows, int64_t cols, int64_t i0, int64_t j0,
                  const requant *q, const int32_t *sv, void *y, int64_t ldy)
{
    size_t item = q->kind == KIND_F32 ? 4 : 1;
    for (int64_t i = 0; i < rows; i++) {
        int32_t v[NB];
        const int32_t *a = acc + i * NB;
        int32_t ri = q->bias_r ? q->bias_r[i0 + i] : 0;
        for (int64_t j = 0; j < cols; j++) v[j] = a[j] + ri;
        if (q->bias_c)
            for (int64_t j = 0; j < cols; j++) v[j] += q->bias_c[j0 + j];
        int32_t zri = q->zr && sv ? q->zr[i0 + i] : 0;
        if (zri)
            for (int64_t j = 0; j < cols; j++) v[j] += zri * sv[j];
        int32_t sri = q->zv && q->sr ? q->sr[i0 + i] : 0;
        if (sri)
            for (int64_t j = 0; j < cols; j++) v[j] += q->zv[j0 + j] * sri;
        const double *mc = q->mult_per_col ? q->mult + j0 : NULL;
        double mi = q->mult_per_col ? 0.0 : q->mult[i0 + i];
        store_row(v, cols, mc, mi, q, (char *)y + (size_t)((i0 + i) * ldy + j0) * item);
    }
}

/* ---- matmul: Y[rows][N] = A[rows][Kp] (u8) . B (s8, prepacked panels) ------------- */

typedef struct {
    const uint8_t *a, *panels;
    int64_t rows, n, kp, row_tiles;
    requant q;
    void *y;
    int64_t ldy;
} qmatmul_job;

static void qmatmul_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const qmatmul_job *j = ctx;
    int32_t *acc = (int32_t *)scratch;
    int64_t k4 = j->kp / 4;
    for (int64_t t = lo; t < hi; t++) {
        int64_t nb = t / j->row_tiles, i0 = (t % j->row_tiles) * MR;
        int64_t mr = j->rows - i0 < MR ? j->rows - i0 : MR;
        int64_t cols = j->n - nb * NB < NB ? j->n - nb * NB : NB;
        tile(j->a + i0 * j->kp, j->kp, mr, j->panels + nb * k4 * NB * 4, NULL, k4, acc, 1);
        store(acc, mr, cols, i0, nb * NB, &j->q, NULL, j->y, j->ldy);
    }
}

static int64_t tile_scratch_floats(void) { return MR * NB; }

/* Y = requant(A . B): A is rows x kp unsigned bytes (kp a multiple of 4, padded with
 * zeros), panels hold B (kp x n, signed) as ceil(n / 64) panels of [kp / 4][64][4].
 * quant = {y_zero_point, lo, hi, kind}. Returns 0, or -1 when scratch was short. */
int64_t keel_qmatmul_u8s8(const uint8_t *a, const uint8_t *panels, int64_t rows, int64_t n,
                          int64_t kp, const int32_t *bias_c, const int32_t *zv,
                          const int32_t *sr, const double *mult, int64_t mult_per_col,
                          const int64_t *quant, void *y, int64_t ldy, int64_t parts)
{
    if (rows <= 0 || n <= 0) return 0;
    qmatmul_job j = {a, panels, rows, n, kp, (rows + MR - 1) / MR,
                     {NULL, bias_c, NULL, zv, sr, mult, mult_per_col,
                      QUANT_FIELDS(quant)},
                     y, ldy};
    int64_t tasks = ((n + NB - 1) / NB) * j.row_tiles;
    return run_parts(qmatmul_task, &j, tasks, parts, tile_scratch_floats());
}

/* ---- 2-D convolution: im2col panels of the input, weights broadcast ---------------- */

/* geometry: N, C, H, W, M, OH, OW, KH, KW, SH, SW, DH, DW, PT, PL, G */
enum { Q_N, Q_C, Q_H, Q_W, Q_M, Q_OH, Q_OW, Q_KH, Q_KW, Q_SH, Q_SW, Q_DH, Q_DW, Q_PT, Q_PL,
       Q_G, Q_LEN };

typedef struct {
    const uint8_t *x;
    const uint8_t *w;          /* [M][kp] signed bytes, zero padded */
    int64_t g[Q_LEN];
    int64_t kp, blocks;        /* kp: C/G * KH * KW rounded up to 4; blocks: of NB pixels */
    uint8_t flip, pad;         /* flip: 0x80 for int8 input; pad: the zero point, flipped */
    int64_t want_sums;         /* column sums needed (some weight zero point is not 0) */
    requant q;
    void *y;
} qconv_job;

/* One row of the im2col matrix for the block's pixels: input channel c's tap (dy, dx)
 * for each of the NB pixels, the raw zero point where the tap falls in the padding.
 * The block's pixels come as runs along output rows (seg_*), so with stride 1 a run is
 * one contiguous copy. */
typedef struct {
    int64_t t, oy, ox, len;
} segment;

static void fill_row(const qconv_job *j, const uint8_t *plane, const segment *seg,
                     int64_t nseg, int64_t dy, int64_t dx, uint8_t raw_pad, uint8_t *row)
{
    const int64_t *g = j->g;
    int64_t h = g[Q_H], w = g[Q_W], sw = g[Q_SW];
    for (int64_t s = 0; s < nseg; s++) {
        uint8_t *out = row + seg[s].t;
        int64_t len = seg[s].len, iy = seg[s].oy * g[Q_SH] - g[Q_PT] + dy;
        if (iy < 0 || iy >= h) {
            memset(out, raw_pad, (size_t)len);
            continue;
        }
        const uint8_t *src = plane + iy * w;
        int64_t ix0 = seg[s].ox * sw - g[Q_PL] + dx;
        if (sw == 1) {
            int64_t a = ix0 < 0 ? -ix0 : 0, b = w - ix0 < len ? w - ix0 : len;
            if (b < a) b = a;
            if (a > len) a = b = len;
            memset(out, raw_pad, (size_t)a);
            memcpy(out + a, src + ix0 + a, (size_t)(b - a));
            memset(out + b, raw_pad, (size_t)(len - b));
            continue;
        }
#if QISA == 2
        if (sw == 2) {
            /* the pixels whose column falls inside the row, [a, b), 32 at a time: the low
             * bytes of 32 words are every other byte (masked loads stay in the row) */
            int64_t a = ix0 < 0 ? (1 - ix0) / 2 : 0, b = w - ix0 > 0 ? (w - ix0 + 1) / 2 : 0;
            if (a > len) a = len;
            if (b > len) b = len;
            if (b < a) b = a;
            memset(out, raw_pad, (size_t)a);
            for (int64_t i = a; i < b; i += 32) {
                int64_t n = b - i < 32 ? b - i : 32;
                __m512i v = _mm512_maskz_loadu_epi8(((__mmask64)1 << (2 * n - 1)) - 1,
                                                    src + ix0 + 2 * i);
                _mm256_mask_storeu_epi8(out + i, (__mmask32)(((uint64_t)1 << n) - 1),
                                        _mm512_cvtepi16_epi8(v));
            }
            memset(out + b, raw_pad, (size_t)(len - b));
            continue;
        }
#endif
        for (int64_t i = 0; i < len; i++) {
            int64_t ix = ix0 + i * sw;
            out[i] = ix >= 0 && ix < w ? src[ix] : raw_pad;
        }
    }
}

/* The columns of pixels [p0, p0 + NB) of image n, group grp, as one panel; their sums. */
static void pack_columns(const qconv_job *j, int64_t n, int64_t grp, int64_t p0,
                         uint8_t *panel, int32_t *sums)
{
    const int64_t *g = j->g;
    int64_t cg = g[Q_C] / g[Q_G], taps = g[Q_KH] * g[Q_KW], k = cg * taps;
    int64_t pixels = g[Q_OH] * g[Q_OW], ow = g[Q_OW];
    segment seg[NB];
    int64_t nseg = 0;
    for (int64_t t = 0; t < NB && p0 + t < pixels;) {
        int64_t p = p0 + t, ox = p % ow, len = ow - ox;
        if (len > NB - t) len = NB - t;
        if (len > pixels - p) len = pixels - p;
        seg[nseg++] = (segment){t, p / ow, ox, len};
        t += len;
    }
    uint8_t raw_pad = (uint8_t)(j->pad ^ j->flip);
    uint8_t rows[4][NB];
    const uint8_t *image = j->x + (n * g[Q_C] + grp * cg) * g[Q_H] * g[Q_W];
    for (int64_t q = 0; q < j->kp / 4; q++) {
        for (int r = 0; r < 4; r++) {
            int64_t kk = 4 * q + r;
            memset(rows[r], raw_pad, NB);   /* pixels past the end, and k past k's end */
            if (kk >= k) {
                memset(rows[r], 0, NB);
                continue;
            }
            int64_t c = kk / taps, ky = (kk % taps) / g[Q_KW], kx = kk % g[Q_KW];
            fill_row(j, image + c * g[Q_H] * g[Q_W], seg, nseg, ky * g[Q_DH], kx * g[Q_DW],
                     raw_pad, rows[r]);
        }
        uint32_t *dst = (uint32_t *)(void *)(panel + q * NB * 4);
        uint32_t flip = (uint32_t)j->flip * 0x01010101u;
        for (int64_t t = 0; t < NB; t++)
            dst[t] = ((uint32_t)rows[0][t] | (uint32_t)rows[1][t] << 8 |
                      (uint32_t)rows[2][t] << 16 | (uint32_t)rows[3][t] << 24) ^ flip;
        for (int r = 0; r < 4; r++)
            if (4 * q + r >= k)
                for (int64_t t = 0; t < NB; t++) panel[q * NB * 4 + 4 * t + r] = 0;
    }
    if (!j->want_sums) return;
    for (int64_t t = 0; t < NB; t++) sums[t] = 0;
    for (int64_t q = 0; q < j->kp / 4; q++) {
        const uint8_t *src = panel + q * NB * 4;
        for (int64_t t = 0; t < NB; t++)
            sums[t] += src[4 * t] + src[4 * t + 1] + src[4 * t + 2] + src[4 * t + 3];
    }
}

static void qconv_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const qconv_job *j = ctx;
    const int64_t *g = j->g;
    int64_t groups = g[Q_G], mg = g[Q_M] / groups, pixels = g[Q_OH] * g[Q_OW];
    int32_t *acc = (int32_t *)scratch;
    int32_t *sums = acc + MR * NB;
    uint8_t *panel = (uint8_t *)(sums + NB);
    for (int64_t t = lo; t < hi; t++) {
        int64_t n = t / (groups * j->blocks), grp = (t / j->blocks) % groups;
        int64_t p0 = (t % j->blocks) * NB;
        int64_t cols = pixels - p0 < NB ? pixels - p0 : NB;
        pack_columns(j, n, grp, p0, panel, sums);
        char *yn = (char *)j->y + n * g[Q_M] * pixels * (j->q.kind == KIND_F32 ? 4 : 1);
        for (int64_t m = 0; m < mg; m += MR) {
            int64_t i0 = grp * mg + m, mr = mg - m < MR ? mg - m : MR;
            tile(j->w + i0 * j->kp, j->kp, mr, panel, NULL, j->kp / 4, acc, 0);
#if QISA == 2
            if (j->q.kind != KIND_F32 && !j->want_sums) {
                uint8_t bytes[MR * NB];
                requant_tile(acc, mr, i0, &j->q, bytes);
                for (int64_t i = 0; i < mr; i++)
                    memcpy((uint8_t *)yn + (i0 + i) * pixels + p0, bytes + i * NB, (size_t)cols);
                continue;
            }
#endif
            store(acc, mr, cols, i0, p0, &j->q, j->want_sums ? sums : NULL, yn, pixels);
        }
    }
}

/* Y = requant(conv(x, w)) for an NCHW 8-bit x (flip = 0x80 when it is signed; pad = its
 * zero point, flipped the same way), w packed as [M][kp] signed bytes, geometry as in
 * the enum above. bias_r: per output channel (the bias and the zero points' constant
 * terms), zr: per output channel, minus its weight zero point (NULL when all are 0).
 * mult: one double per output channel. quant = {y_zero_point, lo, hi, kind}. */
int64_t keel_qconv2d_u8s8(const uint8_t *x, int64_t flip, int64_t pad, const uint8_t *w,
                          int64_t kp, const int64_t *geometry, const int32_t *bias_r,
                          const int32_t *zr, const double *mult, const int64_t *quant, void *y,
                          int64_t parts)
{
    qconv_job j;
    memcpy(j.g, geometry, sizeof j.g);
    int64_t pixels = j.g[Q_OH] * j.g[Q_OW];
    if (j.g[Q_N] <= 0 || pixels <= 0 || j.g[Q_G] <= 0) return 0;
    j.x = x, j.w = w, j.kp = kp, j.blocks = (pixels + NB - 1) / NB;
    j.flip = (uint8_t)flip, j.pad = (uint8_t)pad, j.want_sums = zr != NULL;
    j.q = (requant){bias_r, NULL, zr, NULL, NULL, mult, 0, QUANT_FIELDS(quant)};
    j.y = y;
    int64_t scratch = MR * NB + NB + (kp * NB + 3) / 4;
    return run_parts(qconv_task, &j, j.g[Q_N] * j.g[Q_G] * j.blocks, parts, scratch);
}

/* ---- convolution without im2col ---------------------------------------------------
 *
 * The images are copied once into a zero-point-padded layout of channel quads (four
 * channels' bytes side by side per padded pixel), and the outputs are computed over
 * padded positions p = (image * Hs + oy) * Ws + ox: the columns past OW and the rows
 * past OH are computed and dropped. A chunk of images is stacked in one layout, each
 * image's padding shared with its neighbours' (the rows below one image are the rows
 * above the next, as the columns right of a row are the columns left of the next), so
 * a block of 64 positions may span images and small maps waste fewer columns.
 *
 * With stride 1 that layout is [C4/4][chunk * Hs * Ws + slack][4]: for tap (ky, kx)
 * and channel quad cq, the 64 positions of a block are 256 contiguous bytes, at
 * ((cq * plane + p0 + ky * Ws + kx) * 4). With strides (sh, sw) the padded images are
 * split into sh * sw phases (phase (ry, rx): the padded pixels whose row and column are
 * ry and rx modulo the strides), [sh * sw][C4/4][plane][4], Hs and Ws then counting a
 * phase's rows and columns: output (oy, ox) reads tap (ky, kx) at phase (ky mod sh,
 * kx mod sw), position (oy + ky / sh) * Ws + ox + kx / sw, so a block's positions are
 * again contiguous. The tile reads them in place, through one offset per k quad, with
 * the weights packed in the same order, [M][KH][KW][C4]. */

typedef struct {
    const uint8_t *x, *w;
    int64_t g[Q_LEN];
    int64_t c4, hs, ws, plane, kp;   /* hs, ws: a phase's rows per image, columns per row */
    int64_t chunk, blocks;           /* images per chunk; blocks of NB columns per chunk */
    int64_t columns;                 /* COLUMNS_*: which positions a block's columns are */
    int64_t nseg;                    /* COLUMNS_ROWS: output rows per block (4 or 8) */
    uint8_t flip, pad;
    requant q;
    void *y;
} qdirect_job;

/* A block's 64 columns: consecutive padded positions, output pixels only (compact), or
 * one output row per 16 or 8 of them (rows). */
enum { COLUMNS_PADDED, COLUMNS_COMPACT, COLUMNS_ROWS };

/* Padded input row y of channel quad cq (its four channels' rows at src) as quads,
 * into line[0, Ws * sw): the zero point where the row has no pixel. */
static void quad_line(const qdirect_job *j, const uint8_t *const src[4], int64_t y,
                      uint32_t *line)
{
    int64_t w = j->g[Q_W];
    uint32_t pad = (uint32_t)j->pad * 0x01010101u, flip = (uint32_t)j->flip * 0x01010101u;
    for (int64_t i = 0; i < j->ws * j->g[Q_SW]; i++) line[i] = pad;
    uint32_t *row = line + j->g[Q_PL];
    int64_t xx = 0;
#if defined(__SSE2__)
    /* 16 pixels at a time: the four channels' bytes interleaved by unpacking */
    __m128i vflip = _mm_set1_epi8((char)j->flip);
    for (; xx + 16 <= w; xx += 16) {
        __m128i c[4];
        for (int r = 0; r < 4; r++)
            c[r] = src[r] ? _mm_loadu_si128((const __m128i *)(const void *)(src[r] + y * w + xx))
                          : _mm_setzero_si128();
        __m128i lo01 = _mm_unpacklo_epi8(c[0], c[1]), hi01 = _mm_unpackhi_epi8(c[0], c[1]);
        __m128i lo23 = _mm_unpacklo_epi8(c[2], c[3]), hi23 = _mm_unpackhi_epi8(c[2], c[3]);
        __m128i *out = (__m128i *)(void *)(row + xx);
        _mm_storeu_si128(out, _mm_xor_si128(_mm_unpacklo_epi16(lo01, lo23), vflip));
        _mm_storeu_si128(out + 1, _mm_xor_si128(_mm_unpackhi_epi16(lo01, lo23), vflip));
        _mm_storeu_si128(out + 2, _mm_xor_si128(_mm_unpacklo_epi16(hi01, hi23), vflip));
        _mm_storeu_si128(out + 3, _mm_xor_si128(_mm_unpackhi_epi16(hi01, hi23), vflip));
    }
    for (; xx + 8 <= w; xx += 8) {      /* 8 at a time (small maps' rows) */
        __m128i c[4];
        for (int r = 0; r < 4; r++)
            c[r] = src[r] ? _mm_loadl_epi64((const __m128i *)(const void *)(src[r] + y * w + xx))
                          : _mm_setzero_si128();
        __m128i lo01 = _mm_unpacklo_epi8(c[0], c[1]), lo23 = _mm_unpacklo_epi8(c[2], c[3]);
        __m128i *out = (__m128i *)(void *)(row + xx);
        _mm_storeu_si128(out, _mm_xor_si128(_mm_unpacklo_epi16(lo01, lo23), vflip));
        _mm_storeu_si128(out + 1, _mm_xor_si128(_mm_unpackhi_epi16(lo01, lo23), vflip));
    }
#endif
    for (; xx < w; xx++) {
        uint32_t v = 0;
        for (int r = 0; r < 4; r++) v |= (uint32_t)(src[r] ? src[r][y * w + xx] : 0) << (8 * r);
        row[xx] = v ^ flip;
    }
}

/* Images [n0, n0 + count) as padded channel quads, stacked and split into the strides'
 * phases (see above); only the phases some tap reads (ry < KH, rx < KW). line: scratch
 * for one padded row. */
static void build_quads(const qdirect_job *j, int64_t n0, int64_t count, uint8_t *xq,
                        uint32_t *line)
{
    const int64_t *g = j->g;
    int64_t c = g[Q_C], h = g[Q_H], w = g[Q_W], sh = g[Q_SH], sw = g[Q_SW], cq4 = j->c4 / 4;
    int64_t ry_end = sh < g[Q_KH] ? sh : g[Q_KH], rx_end = sw < g[Q_KW] ? sw : g[Q_KW];
    uint32_t pad = (uint32_t)j->pad * 0x01010101u;
    uint32_t *all = (uint32_t *)(void *)xq;
    for (int64_t ry = 0; ry < ry_end; ry++)
        for (int64_t rx = 0; rx < rx_end; rx++) {
            uint32_t *phase = all + (ry * sw + rx) * cq4 * j->plane;
            for (int64_t i = 0; i < cq4 * j->plane; i++) phase[i] = pad;
        }
    for (int64_t img = 0; img < count; img++)
        for (int64_t cq = 0; cq < cq4; cq++) {
            const uint8_t *src[4];
            for (int r = 0; r < 4; r++)
                src[r] = 4 * cq + r < c ? j->x + (((n0 + img) * c) + 4 * cq + r) * h * w : NULL;
            for (int64_t y = 0; y < h; y++) {
                int64_t yp = y + g[Q_PT];
                if (yp % sh >= ry_end) continue;
                quad_line(j, src, y, line);
                for (int64_t rx = 0; rx < rx_end; rx++) {
                    uint32_t *dst = all + (((yp % sh) * sw + rx) * cq4 + cq) * j->plane +
                                    (img * j->hs + yp / sh) * j->ws;
                    if (sw == 1) {
                        memcpy(dst, line, (size_t)j->ws * sizeof *line);
                        continue;
                    }
                    int64_t i = 0;
#if QISA == 2
                    if (sw == 2) {
                        /* 16 at a time: every other quad of 32, picked by one permutation;
                         * the last ones by masked loads (inside the line's 2 ws quads) and a
                         * masked store */
                        const __m512i pick = _mm512_add_epi32(
                            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                              28, 30), _mm512_set1_epi32((int)rx));
                        for (; i < j->ws; i += 16) {
                            int64_t n = j->ws - i < 16 ? j->ws - i : 16, left = 2 * (j->ws - i);
                            __mmask16 ka = left >= 16 ? (__mmask16)0xFFFF
                                                      : (__mmask16)((1u << left) - 1);
                            __mmask16 kb = left >= 32 ? (__mmask16)0xFFFF : left > 16
                                           ? (__mmask16)((1u << (left - 16)) - 1) : 0;
                            __m512i a = _mm512_maskz_loadu_epi32(ka, line + 2 * i);
                            __m512i b = _mm512_maskz_loadu_epi32(kb, line + 2 * i + 16);
                            _mm512_mask_storeu_epi32(dst + i, (__mmask16)((1u << n) - 1),
                                                     _mm512_permutex2var_epi32(a, pick, b));
                        }
                    }
#endif
                    for (; i < j->ws; i++) dst[i] = line[rx + i * sw];
                }
            }
        }
}

/* Position p of a chunk: in *at the output index (image * M * OH * OW + oy * OW + ox) it
 * computes, and whether that is an output at all (ox < OW, oy < OH). */
static inline int position_output(const qdirect_job *j, int64_t p, int64_t *at)
{
    const int64_t *g = j->g;
    int64_t row = p / j->ws, ox = p % j->ws, img = row / j->hs, oy = row % j->hs;
    *at = img * g[Q_M] * g[Q_OH] * g[Q_OW] + oy * g[Q_OW] + ox;
    return ox < g[Q_OW] && oy < g[Q_OH];
}

#if QISA == 2 && defined(__AVX512VBMI2__)
/* A block's output columns of one image: which of the 64 positions, how many, and the
 * output index of the first (the rest follow it in order). */
typedef struct {
    __mmask64 mask;
    int64_t count, first;
} block_columns;

/* The block at p0's output columns, one entry per image they belong to (positions
 * before `end` only); returns how many entries. Steps through the positions' rows and
 * images rather than dividing for each. */
static int64_t block_runs(const qdirect_job *j, int64_t p0, int64_t end, block_columns *runs)
{
    const int64_t *g = j->g;
    int64_t nrun = 0, last = -1, stop = p0 + NB < end ? p0 + NB : end;
    int64_t row = p0 / j->ws, ox = p0 % j->ws, img = row / j->hs, oy = row % j->hs;
    /* a padded row's piece at a time: its positions [p, p + n), of which the first
     * `out` (those left of OW, in an output row) are outputs */
    for (int64_t p = p0; p < stop;) {
        int64_t n = j->ws - ox < stop - p ? j->ws - ox : stop - p;
        int64_t out = oy < g[Q_OH] && ox < g[Q_OW] ? (g[Q_OW] - ox < n ? g[Q_OW] - ox : n) : 0;
        if (out) {
            if (img != last) {
                last = img;
                runs[nrun++] = (block_columns){0, 0, img * g[Q_M] * g[Q_OH] * g[Q_OW] +
                                                         oy * g[Q_OW] + ox};
            }
            __mmask64 bits = out == 64 ? ~(__mmask64)0 : ((__mmask64)1 << out) - 1;
            runs[nrun - 1].mask |= bits << (p - p0);
            runs[nrun - 1].count += out;
        }
        p += n;
        ox = 0;
        if (++oy == j->hs) oy = 0, img++;
    }
    return nrun;
}
#endif

/* The positions from p to the end of p's row or of block p0: how many (what p steps
 * by), and in *len how many of them are outputs (0 in the padding), the first of which
 * is output *at. */
static inline int64_t padded_run(const qdirect_job *j, int64_t p, int64_t p0, int64_t *len,
                                 int64_t *at)
{
    int64_t ox = p % j->ws, ow = j->g[Q_OW];
    int64_t run = j->ws - ox < p0 + NB - p ? j->ws - ox : p0 + NB - p;
    *len = !position_output(j, p, at) ? 0 : ow - ox < run ? ow - ox : run;
    return run;
}

/* ---- compact columns: output pixels only ----
 *
 * The padded layout's blocks compute the padding's positions too and drop them (on a 7x7
 * map 77% of the columns are outputs, on 8x8 79%). A compact block's 64 columns are
 * output pixels only, in order: before its products it copies, for every k quad, the
 * quads its pixels read from the padded layout into a panel [k4][NB][4] (a run of an
 * output row's pixels at a time), and every row tile of M reads that panel. */

/* A run of a compact block's columns within one output row: its first column, the padded
 * position its first pixel reads at tap (0, 0), how many, and its first output index. */
typedef struct {
    int64_t t, p, len, at;
} compact_run;

/* Compact block b of a chunk of `count` images as runs (returns how many; *cols: the
 * block's columns, 0 past the chunk's outputs). */
static int64_t compact_runs(const qdirect_job *j, int64_t b, int64_t count, compact_run *runs,
                            int64_t *cols)
{
    const int64_t *g = j->g;
    int64_t pixels = g[Q_OH] * g[Q_OW], idx = b * NB, end = count * pixels, n = 0;
    if (end > idx + NB) end = idx + NB;
    *cols = end > idx ? end - idx : 0;
    while (idx < end) {
        int64_t img = idx / pixels, pix = idx % pixels, ox = pix % g[Q_OW];
        int64_t len = g[Q_OW] - ox < end - idx ? g[Q_OW] - ox : end - idx;
        runs[n++] = (compact_run){idx - b * NB, (img * j->hs + pix / g[Q_OW]) * j->ws + ox, len,
                                  img * g[Q_M] * pixels + pix};
        idx += len;
    }
    return n;
}

/* The compact block's panel [k4][NB][4] from the padded layout xq. With AVX-512 each run
 * is copied 16 quads at a time by whole loads and stores: what a store writes past its run
 * the next run (or the next k quad, or the panel's slack) writes over. */
static void gather_panel(const uint8_t *xq, const int64_t *offsets, int64_t k4,
                         const compact_run *runs, int64_t nrun, uint8_t *panel)
{
    for (int64_t q = 0; q < k4; q++) {
        const uint8_t *base = xq + offsets[q];
        uint8_t *dst = panel + q * NB * 4;
        for (int64_t r = 0; r < nrun; r++) {
            const uint8_t *src = base + runs[r].p * 4;
            uint8_t *to = dst + runs[r].t * 4;
#if QISA == 2
            for (int64_t i = 0; i < runs[r].len; i += 16)
                _mm512_storeu_si512((void *)(to + 4 * i),
                                    _mm512_loadu_si512((const void *)(src + 4 * i)));
#else
            memcpy(to, src, (size_t)runs[r].len * 4);
#endif
        }
    }
}

/* The products of compact block `runs` (cols columns) for every row tile, stored: each
 * image's columns are consecutive outputs (its runs follow one another). */
static void compact_block(const qdirect_job *j, const uint8_t *panel, const compact_run *runs,
                          int64_t nrun, int32_t *acc, char *yn)
{
    const int64_t *g = j->g;
    int64_t m = g[Q_M], pixels = g[Q_OH] * g[Q_OW];
    for (int64_t i0 = 0; i0 < m; i0 += MR) {
        int64_t mr = m - i0 < MR ? m - i0 : MR;
        tile(j->w + i0 * j->kp, j->kp, mr, panel, NULL, j->kp / 4, acc, 0);
#if QISA == 2
        uint8_t bytes[MR * NB];
        if (j->q.kind != KIND_F32) requant_tile(acc, mr, i0, &j->q, bytes);
#endif
        for (int64_t r = 0; r < nrun;) {
            int64_t t0 = runs[r].t, at = runs[r].at, len = runs[r].len;
            while (++r < nrun && runs[r].at == at + len) len += runs[r].len;
#if QISA == 2
            if (j->q.kind != KIND_F32) {
                for (int64_t i = 0; i < mr; i++)
                    memcpy((uint8_t *)yn + (i0 + i) * pixels + at, bytes + i * NB + t0,
                           (size_t)len);
                continue;
            }
#endif
            store(acc + t0, mr, len, i0, at, &j->q, NULL, yn, pixels);
        }
    }
}

/* ---- row segments: one output row per 16 (or 8) columns ----
 *
 * Where the output rows are at most 16 pixels wide, a block's 64 columns can be 4 runs of
 * 16 padded positions (8 runs of 8 where they are at most 8 wide), each starting at an
 * output row's first pixel: the tile reads each run in place (a whole vector load, or a
 * half), so no copy is made and the columns past the row's end are the only ones dropped
 * (none on 16- and 8-pixel rows, where the padded layout drops a column per row and a
 * row per image). The block's rows follow each other through the chunk's images. */

/* Block b's output rows of a chunk of `count` images: seg[s], the byte offset in the
 * layout of row s's first position, and at[s], its first output index; returns how many
 * rows (the rest repeat row 0's offset and are not stored). */
static int64_t row_segments(const qdirect_job *j, int64_t b, int64_t count, int64_t *seg,
                            int64_t *at)
{
    const int64_t *g = j->g;
    int64_t oh = g[Q_OH], rows = count * oh, n = 0;
    for (int64_t s = 0; s < j->nseg; s++) {
        int64_t rr = b * j->nseg + s;
        if (rr >= rows) {
            seg[s] = seg[0];
            continue;
        }
        int64_t img = rr / oh, oy = rr % oh;
        seg[s] = (img * j->hs + oy) * j->ws * 4;
        at[s] = img * g[Q_M] * oh * g[Q_OW] + oy * g[Q_OW];
        n++;
    }
    return n;
}

/* The products of a row-segment block (`rows` output rows, offsets seg, outputs at) for
 * every row tile, stored. Without AVX-512 the runs are first copied into a panel. */
static void rows_block(const qdirect_job *j, const uint8_t *xq, const int64_t *offsets,
                       const int64_t *seg, const int64_t *at, int64_t rows, uint8_t *panel,
                       int32_t *acc, char *yn)
{
    const int64_t *g = j->g;
    int64_t m = g[Q_M], pixels = g[Q_OH] * g[Q_OW], ow = g[Q_OW], k4 = j->kp / 4;
    int64_t width = NB / j->nseg;
    /* one run of outputs: full rows of one image, one after the other */
    int whole = ow == width && at[rows - 1] == at[0] + (rows - 1) * ow;
#if QISA != 2
    for (int64_t q = 0; q < k4; q++)
        for (int64_t s = 0; s < j->nseg; s++)
            memcpy(panel + q * NB * 4 + s * width * 4, xq + offsets[q] + seg[s],
                   (size_t)width * 4);
#else
    (void)panel;
#endif
    for (int64_t i0 = 0; i0 < m; i0 += MR) {
        int64_t mr = m - i0 < MR ? m - i0 : MR;
#if QISA == 2
        tile_rows(j->w + i0 * j->kp, j->kp, mr, xq, offsets, seg, j->nseg, k4, acc);
        if (j->q.kind != KIND_F32) {
            uint8_t bytes[MR * NB];
            requant_tile(acc, mr, i0, &j->q, bytes);
            __mmask64 head = whole && rows * ow == NB ? ~(__mmask64)0
                             : ((__mmask64)1 << (whole ? rows * ow : ow)) - 1;
            for (int64_t s = 0; s < (whole ? 1 : rows); s++)
                for (int64_t i = 0; i < mr; i++)
                    _mm512_mask_storeu_epi8((uint8_t *)yn + (i0 + i) * pixels + at[s], head,
                                            _mm512_maskz_loadu_epi8(
                                                head, bytes + i * NB + s * width));
            continue;
        }
#else
        tile(j->w + i0 * j->kp, j->kp, mr, panel, NULL, k4, acc, 0);
#endif
        if (whole) {
            store(acc, mr, rows * ow, i0, at[0], &j->q, NULL, yn, pixels);
            continue;
        }
        for (int64_t s = 0; s < rows; s++)
            store(acc + s * width, mr, ow, i0, at[s], &j->q, NULL, yn, pixels);
    }
}

static void qdirect_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const qdirect_job *j = ctx;
    const int64_t *g = j->g;
    int64_t m = g[Q_M], pixels = g[Q_OH] * g[Q_OW], k4 = j->kp / 4;
    int32_t *acc = (int32_t *)scratch;
    int64_t *offsets = (int64_t *)(acc + MR * NB);
    uint8_t *xq = (uint8_t *)(offsets + k4);
    uint32_t *line = (uint32_t *)(void *)(xq + g[Q_SH] * g[Q_SW] * j->c4 * j->plane);
    for (int64_t q = 0; q < k4; q++) {
        int64_t cq = q % (j->c4 / 4), tap = q / (j->c4 / 4);
        int64_t ky = tap / g[Q_KW], kx = tap % g[Q_KW];
        int64_t phase = (ky % g[Q_SH]) * g[Q_SW] + kx % g[Q_SW];
        offsets[q] = ((phase * (j->c4 / 4) + cq) * j->plane + (ky / g[Q_SH]) * j->ws +
                      kx / g[Q_SW]) * 4;
    }
    int64_t built = -1;
    for (int64_t t = lo; t < hi; t++) {
        int64_t chunk = t / j->blocks, p0 = (t % j->blocks) * NB, n0 = chunk * j->chunk;
        int64_t count = g[Q_N] - n0 < j->chunk ? g[Q_N] - n0 : j->chunk;
        int64_t end = count * j->hs * j->ws;     /* the chunk's positions */
        compact_run pieces[NB];
        int64_t seg[8], at[8];
        int64_t cols = 0, npiece = 0;
        if (j->columns == COLUMNS_COMPACT)
            npiece = compact_runs(j, t % j->blocks, count, pieces, &cols);
        else if (j->columns == COLUMNS_ROWS)
            cols = row_segments(j, t % j->blocks, count, seg, at);
        if (j->columns == COLUMNS_PADDED ? p0 >= end : !cols) continue;
        if (chunk != built) {
            build_quads(j, n0, count, xq, line);
            built = chunk;
        }
        char *yn = (char *)j->y + n0 * m * pixels * (j->q.kind == KIND_F32 ? 4 : 1);
        uint8_t *panel = (uint8_t *)(line + j->ws * g[Q_SW]);
        if (j->columns == COLUMNS_ROWS) {
            rows_block(j, xq, offsets, seg, at, cols, panel, acc, yn);
            continue;
        }
        if (j->columns == COLUMNS_COMPACT) {
            gather_panel(xq, offsets, k4, pieces, npiece, panel);
            compact_block(j, panel, pieces, npiece, acc, yn);
            continue;
        }
#if QISA == 2 && defined(__AVX512VBMI2__)
        block_columns runs[NB];
        int64_t nrun = block_runs(j, p0, end, runs);
        if (!nrun) continue;
#endif
        for (int64_t i0 = 0; i0 < m; i0 += MR) {
            int64_t mr = m - i0 < MR ? m - i0 : MR;
            tile(j->w + i0 * j->kp, j->kp, mr, xq + p0 * 4, offsets, k4, acc, 0);
#if QISA == 2
            if (j->q.kind != KIND_F32) {
                /* the whole tile requantized at once, its output columns copied out */
                uint8_t bytes[MR * NB];
                requant_tile(acc, mr, i0, &j->q, bytes);
#if defined(__AVX512VBMI2__)
                /* each image's columns, in order, are consecutive outputs: compress them
                 * together (in a register; the memory form is slow on some cores) */
                for (int64_t r = 0; r < nrun; r++) {
                    __mmask64 head = runs[r].count == 64 ? ~(__mmask64)0
                                                         : ((__mmask64)1 << runs[r].count) - 1;
                    for (int64_t i = 0; i < mr; i++) {
                        __m512i row = _mm512_loadu_si512((const void *)(bytes + i * NB));
                        _mm512_mask_storeu_epi8((uint8_t *)yn + (i0 + i) * pixels + runs[r].first,
                                                head, _mm512_maskz_compress_epi8(runs[r].mask, row));
                    }
                }
                continue;
#endif
                for (int64_t p = p0; p < p0 + NB && p < end;) {
                    int64_t len, at, run = padded_run(j, p, p0, &len, &at);
                    for (int64_t i = 0; len && i < mr; i++)
                        memcpy((uint8_t *)yn + (i0 + i) * pixels + at, bytes + i * NB + (p - p0),
                               (size_t)len);
                    p += run;
                }
                continue;
            }
#endif
            /* the block's output columns, one output row at a time */
            for (int64_t p = p0; p < p0 + NB && p < end;) {
                int64_t len, at, run = padded_run(j, p, p0, &len, &at);
                if (len) store(acc + (p - p0), mr, len, i0, at, &j->q, NULL, yn, pixels);
                p += run;
            }
        }
    }
}

/* Floats of scratch keel_qconv2d_direct_u8s8 needs per thread for this geometry. */
static int64_t direct_scratch(const qdirect_job *j)
{
    return MR * NB + 2 * (j->kp / 4) + j->g[Q_SH] * j->g[Q_SW] * j->c4 / 4 * j->plane +
           j->ws * j->g[Q_SW] + (j->columns != COLUMNS_PADDED ? j->kp / 4 * NB + 16 : 0);
}

/* An image's rows (or a row's columns) in one phase of the stacked layout: room for the
 * input and its leading padding, for what the last outputs read past it (which may be
 * the next image's leading padding: `lead`), and for `out` outputs at `stride`, in
 * whole multiples of the stride. */
static int64_t stacked_pitch(int64_t size, int64_t lead, int64_t out, int64_t k,
                             int64_t stride)
{
    int64_t need = size + lead, reach = (out - 1) * stride + k - lead;
    if (need < reach) need = reach;
    if (need < out * stride) need = out * stride;
    return (need + stride - 1) / stride;
}

/* Blocks of NB columns a chunk of `count` stacked images has (the last chunk may hold
 * fewer images than the others, and has only its own blocks). */
static int64_t chunk_blocks(const qdirect_job *j, int64_t count)
{
    const int64_t *g = j->g;
    if (j->columns == COLUMNS_ROWS) return (g[Q_OH] * count + j->nseg - 1) / j->nseg;
    int64_t per_image = j->columns == COLUMNS_COMPACT ? g[Q_OH] * g[Q_OW] : j->hs * j->ws;
    return (per_image * count + NB - 1) / NB;
}

/* keel_qconv2d_u8s8 for one group, no dilation and weight zero points all 0, from
 * weights packed as [M][KH][KW][c4] (c4: C rounded up to 4), kp = KH * KW * c4.
 * chunk_images: how many images each chunk stacks into one layout (the caller's
 * choice; clamped to [1, N]); the chunks' blocks of columns, the last chunk's own count
 * of them included, are what the `parts` threads split in near-equal runs.
 * columns: COLUMNS_PADDED (0), COLUMNS_COMPACT (1) or COLUMNS_ROWS (2: output rows at
 * most 16 pixels wide, else -2); see above. Returns -2 for a geometry it does not take. */
int64_t keel_qconv2d_direct_u8s8(const uint8_t *x, int64_t flip, int64_t pad, const uint8_t *w,
                                 int64_t c4, const int64_t *geometry, const int32_t *bias_r,
                                 const double *mult, const int64_t *quant, void *y,
                                 int64_t chunk_images, int64_t parts, int64_t columns)
{
    qdirect_job j;
    memcpy(j.g, geometry, sizeof j.g);
    const int64_t *g = j.g;
    if (g[Q_N] <= 0 || g[Q_OH] <= 0 || g[Q_OW] <= 0) return 0;
    if (g[Q_SH] <= 0 || g[Q_SW] <= 0 || g[Q_G] != 1 || c4 % 4 || g[Q_DH] != 1 || g[Q_DW] != 1)
        return -2;
    j.x = x, j.w = w, j.c4 = c4;
    j.hs = stacked_pitch(g[Q_H], g[Q_PT], g[Q_OH], g[Q_KH], g[Q_SH]);
    j.ws = stacked_pitch(g[Q_W], g[Q_PL], g[Q_OW], g[Q_KW], g[Q_SW]);
    int64_t image = j.hs * j.ws;
    j.chunk = chunk_images < 1 ? 1 : chunk_images > g[Q_N] ? g[Q_N] : chunk_images;
    j.plane = j.chunk * image + NB + ((g[Q_KH] - 1) / g[Q_SH] + 1) * j.ws + g[Q_KW] + 16;
    j.kp = g[Q_KH] * g[Q_KW] * c4;
    j.columns = columns;
    j.nseg = g[Q_OW] <= NB / 8 ? 8 : 4;
    if (columns < COLUMNS_PADDED || columns > COLUMNS_ROWS ||
        (columns == COLUMNS_ROWS && g[Q_OW] > NB / 4))
        return -2;
    j.blocks = chunk_blocks(&j, j.chunk);
    j.flip = (uint8_t)flip, j.pad = (uint8_t)pad;
    j.q = (requant){bias_r, NULL, NULL, NULL, NULL, mult, 0, QUANT_FIELDS(quant)};
    j.y = y;
    int64_t chunks = (g[Q_N] + j.chunk - 1) / j.chunk;
    int64_t tasks = (chunks - 1) * j.blocks + chunk_blocks(&j, g[Q_N] - (chunks - 1) * j.chunk);
    return run_parts(qdirect_task, &j, tasks, parts, direct_scratch(&j));
}

/* ---- depthwise convolution ---------------------------------------------------------------
 *
 * One output channel per input channel (groups = C = M): each plane is copied once into a
 * zero-padded int16 plane of (x - zero point), then every output row sums its taps over
 * whole rows of that copy in int32 (a loop the compiler vectorizes), and is requantized. */

typedef struct {
    const uint8_t *x;
    const int8_t *w;            /* [C][KH][KW], signed */
    const int32_t *wz;          /* [C] weight zero points (shifted like the weights) */
    int64_t g[Q_LEN];
    int64_t hp, wp;
    int32_t xz;                 /* the input's zero point, in the input's own type */
    int64_t is_signed;
    requant q;
    void *y;
} qdepth_job;

#define DW_TAPS 64     /* the most taps the paired AVX-512 loop takes (8 x 8) */
#define DW_SLACK 64    /* int16 values past a plane (and int32 past acc) it may touch */

#if QISA == 2
/* acc[0, span) = bias + sum over taps t of taps[t] * plane[offset(t) + i], two taps per
 * vpdpwssd: the two planes' int16 values interleaved (unpacklo/hi), each dword lane
 * taking tap a's value in its low half and tap b's in its high half, against a dword of
 * the two taps. unpack works within 128-bit lanes, so the two accumulators hold the 32
 * outputs in the order (0-3, 8-11, ...), (4-7, 12-15, ...): one permutation puts them
 * back. The sums are exact in int32, as the plain loop's are. Reads up to 31 values
 * past the last one used; writes acc up to span rounded up to 32. */
static void depthwise_pairs(const int16_t *plane, const int64_t *offsets, int64_t ntaps,
                            const int32_t *taps, int32_t bias, int64_t span, int32_t *acc)
{
    __m512i pairs[DW_TAPS / 2];
    for (int64_t t = 0; t < ntaps; t += 2) {
        uint32_t b = t + 1 < ntaps ? (uint32_t)(uint16_t)(int16_t)taps[t + 1] : 0u;
        pairs[t / 2] = _mm512_set1_epi32((int32_t)((uint32_t)(uint16_t)(int16_t)taps[t] |
                                                   b << 16));
    }
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    __m512i vbias = _mm512_set1_epi32(bias);
    for (int64_t i = 0; i < span; i += 32) {
        __m512i lo = vbias, hi = vbias;
        for (int64_t t = 0; t < ntaps; t += 2) {
            __m512i a = _mm512_loadu_si512((const void *)(plane + offsets[t] + i));
            __m512i b = t + 1 < ntaps
                ? _mm512_loadu_si512((const void *)(plane + offsets[t + 1] + i))
                : _mm512_setzero_si512();
            lo = _mm512_dpwssd_epi32(lo, _mm512_unpacklo_epi16(a, b), pairs[t / 2]);
            hi = _mm512_dpwssd_epi32(hi, _mm512_unpackhi_epi16(a, b), pairs[t / 2]);
        }
        _mm512_storeu_si512((void *)(acc + i), _mm512_permutex2var_epi64(lo, first, hi));
        _mm512_storeu_si512((void *)(acc + i + 16), _mm512_permutex2var_epi64(lo, second, hi));
    }
}
#endif

/* acc[0, span) = bias + the taps' sums over the whole stride-1 plane, one loop per tap. */
static void depthwise_span(const int16_t *plane, const qdepth_job *j, const int8_t *taps,
                           int32_t wz, int32_t bias, int64_t span, int32_t *acc)
{
    const int64_t *g = j->g;
    for (int64_t i = 0; i < span; i++) acc[i] = bias;
    for (int64_t ky = 0; ky < g[Q_KH]; ky++)
        for (int64_t kx = 0; kx < g[Q_KW]; kx++) {
            int32_t tap = (int32_t)taps[ky * g[Q_KW] + kx] - wz;
            const int16_t *p = plane + ky * g[Q_DH] * j->wp + kx * g[Q_DW];
            for (int64_t i = 0; i < span; i++) acc[i] += tap * p[i];
        }
}

/* One input row as int16 (x - zero point). */
static void widen_row(const uint8_t *src, int64_t w, int64_t is_signed, int32_t xz, int16_t *row)
{
    int64_t xx = 0;
#if QISA == 2
    __m512i z = _mm512_set1_epi16((int16_t)xz);
    for (; xx < w; xx += 32) {
        __mmask32 k = w - xx >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (w - xx)) - 1);
        __m256i v = _mm256_maskz_loadu_epi8(k, src + xx);
        __m512i wide = is_signed ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v);
        _mm512_mask_storeu_epi16(row + xx, k, _mm512_sub_epi16(wide, z));
    }
#endif
    if (is_signed)
        for (; xx < w; xx++) row[xx] = (int16_t)((int8_t)src[xx] - xz);
    else
        for (; xx < w; xx++) row[xx] = (int16_t)(src[xx] - xz);
}

#if QISA == 2
/* A strided depthwise channel, an output row at a time through depthwise_pairs: the
 * padded plane's columns split into sw phases (phase r: the columns x = r mod sw,
 * [hp][wq] each), so each tap reads one phase contiguously. */
static void depthwise_strided(const qdepth_job *j, const int16_t *plane, int16_t *phases,
                              const int32_t *shifted, int32_t bias, int32_t *acc, int64_t ch,
                              char *out, size_t item)
{
    const int64_t *g = j->g;
    int64_t oh = g[Q_OH], ow = g[Q_OW], kh = g[Q_KH], kw = g[Q_KW], sh = g[Q_SH], sw = g[Q_SW];
    int64_t wq = (j->wp + sw - 1) / sw;
    for (int64_t r = 0; r < sw; r++)
        for (int64_t y = 0; y < j->hp; y++) {
            int16_t *dst = phases + (r * j->hp + y) * wq;
            const int16_t *row = plane + y * j->wp + r;
            int64_t n = (j->wp - r + sw - 1) / sw;     /* the phase's columns in the row */
            int64_t x = 0;
            if (sw == 2) {
                /* 32 at a time: every other value of 64, picked by one permutation */
                static const int16_t picks[32] = {
                    0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                    32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
                const __m512i even = _mm512_loadu_si512((const void *)picks);
                for (; x + 32 <= n && 2 * x + 64 <= j->wp - r; x += 32) {
                    __m512i a = _mm512_loadu_si512((const void *)(row + 2 * x));
                    __m512i b = _mm512_loadu_si512((const void *)(row + 2 * x + 32));
                    _mm512_storeu_si512((void *)(dst + x), _mm512_permutex2var_epi16(a, even, b));
                }
            }
            for (; x < n; x++) dst[x] = row[x * sw];
            for (int64_t x = n; x < wq; x++) dst[x] = 0;
        }
    int64_t offsets[DW_TAPS];
    for (int64_t oy = 0; oy < oh; oy++) {
        for (int64_t t = 0; t < kh * kw; t++) {
            int64_t col = (t % kw) * g[Q_DW], row = oy * sh + (t / kw) * g[Q_DH];
            offsets[t] = ((col % sw) * j->hp + row) * wq + col / sw;
        }
        depthwise_pairs(phases, offsets, kh * kw, shifted, bias, ow, acc);
        for (int64_t o = 0; o < ow; o += NB)
            store_row(acc + o, ow - o < NB ? ow - o : NB, NULL, j->q.mult[ch], &j->q,
                      out + (size_t)(oy * ow + o) * item);
    }
}
#endif

/* int16 values of the scratch's plane, then of its phases (strided), before acc. */
static int64_t depth_plane_values(const qdepth_job *j)
{
    return (j->hp * j->wp + DW_SLACK + 1) / 2 * 2;
}

static int64_t depth_phase_values(const qdepth_job *j)
{
    int64_t sw = j->g[Q_SW];
    return sw == 1 && j->g[Q_SH] == 1 ? 0
        : (sw * j->hp * ((j->wp + sw - 1) / sw) + DW_SLACK + 1) / 2 * 2;
}

static void qdepth_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const qdepth_job *j = ctx;
    const int64_t *g = j->g;
    int64_t c = g[Q_C], h = g[Q_H], w = g[Q_W], oh = g[Q_OH], ow = g[Q_OW];
    int64_t kh = g[Q_KH], kw = g[Q_KW], sh = g[Q_SH], sw = g[Q_SW];
    int16_t *plane = (int16_t *)scratch;
    int16_t *phases = plane + depth_plane_values(j);
    int32_t *acc = (int32_t *)(void *)(phases + depth_phase_values(j));
    size_t item = j->q.kind == KIND_F32 ? 4 : 1;
    for (int64_t t = lo; t < hi; t++) {
        int64_t ch = t % c;
        const uint8_t *src = j->x + t * h * w;
        memset(plane, 0, (size_t)(j->hp * j->wp + DW_SLACK) * sizeof *plane);
        for (int64_t y = 0; y < h; y++)
            widen_row(src + y * w, w, j->is_signed, j->xz,
                      plane + (y + g[Q_PT]) * j->wp + g[Q_PL]);
        const int8_t *taps = j->w + ch * kh * kw;
        int32_t wz = j->wz ? j->wz[ch] : 0;
        char *out = (char *)j->y + (size_t)(t * oh * ow) * item;
        int32_t bias = j->q.bias_r ? j->q.bias_r[ch] : 0;
#if QISA == 2
        int32_t shifted[DW_TAPS];
        int64_t offsets[DW_TAPS];
        int paired = kh * kw <= DW_TAPS;
        for (int64_t k = 0; paired && k < kh * kw; k++) {
            shifted[k] = (int32_t)taps[k] - wz;
            offsets[k] = (k / kw) * g[Q_DH] * j->wp + (k % kw) * g[Q_DW];
        }
        if (paired && (sh != 1 || sw != 1)) {
            depthwise_strided(j, plane, phases, shifted, bias, acc, ch, out, item);
            continue;
        }
#endif
        if (sh == 1 && sw == 1) {
            /* every output row at once, over padded row positions (the columns past
             * ow are computed and dropped): one long loop per tap */
            int64_t span = (oh - 1) * j->wp + ow;
#if QISA == 2
            if (paired)
                depthwise_pairs(plane, offsets, kh * kw, shifted, bias, span, acc);
            else
#endif
                depthwise_span(plane, j, taps, wz, bias, span, acc);
            for (int64_t oy = 0; oy < oh; oy++)
                for (int64_t o = 0; o < ow; o += NB)
                    store_row(acc + oy * j->wp + o, ow - o < NB ? ow - o : NB, NULL,
                              j->q.mult[ch], &j->q, out + (size_t)(oy * ow + o) * item);
            continue;
        }
        for (int64_t oy = 0; oy < oh; oy++) {
            for (int64_t ox = 0; ox < ow; ox++) acc[ox] = bias;
            for (int64_t ky = 0; ky < kh; ky++) {
                const int16_t *in = plane + (oy * sh + ky * g[Q_DH]) * j->wp;
                for (int64_t kx = 0; kx < kw; kx++) {
                    int32_t tap = (int32_t)taps[ky * kw + kx] - wz;
                    const int16_t *p = in + kx * g[Q_DW];
                    if (sw == 1)
                        for (int64_t ox = 0; ox < ow; ox++) acc[ox] += tap * p[ox];
                    else
                        for (int64_t ox = 0; ox < ow; ox++) acc[ox] += tap * p[ox * sw];
                }
            }
            for (int64_t o = 0; o < ow; o += NB)
                store_row(acc + o, ow - o < NB ? ow - o : NB, NULL, j->q.mult[ch], &j->q,
                          out + (size_t)(oy * ow + o) * item);
        }
    }
}

/* The padded plane's size and the job's arguments (j->g already set). */
static void depth_setup(qdepth_job *j, const uint8_t *x, int64_t is_signed, int64_t xz,
                        const int8_t *w, const int32_t *wz, const int32_t *bias_r,
                        const double *mult, const int64_t *quant, void *y)
{
    const int64_t *g = j->g;
    j->hp = (g[Q_OH] - 1) * g[Q_SH] + (g[Q_KH] - 1) * g[Q_DH] + 1;
    j->wp = (g[Q_OW] - 1) * g[Q_SW] + (g[Q_KW] - 1) * g[Q_DW] + 1;
    if (j->hp < g[Q_H] + g[Q_PT]) j->hp = g[Q_H] + g[Q_PT];
    if (j->wp < g[Q_W] + g[Q_PL]) j->wp = g[Q_W] + g[Q_PL];
    j->x = x, j->w = w, j->wz = wz, j->xz = (int32_t)xz, j->is_signed = is_signed;
    j->q = (requant){bias_r, NULL, NULL, NULL, NULL, mult, 0, QUANT_FIELDS(quant)};
    j->y = y;
}

/* A depthwise 2-D convolution (groups = C = M) of an NCHW 8-bit x (is_signed: int8) with
 * zero point xz, weights [C][KH][KW] as signed bytes with zero points wz (or NULL: all 0),
 * bias_r: the int32 bias per channel (or NULL). Other arguments as keel_qconv2d_u8s8. */
int64_t keel_qdepthwise_u8s8(const uint8_t *x, int64_t is_signed, int64_t xz, const int8_t *w,
                             const int32_t *wz, const int64_t *geometry, const int32_t *bias_r,
                             const double *mult, const int64_t *quant, void *y, int64_t parts)
{
    qdepth_job j;
    memcpy(j.g, geometry, sizeof j.g);
    if (j.g[Q_N] <= 0 || j.g[Q_OH] <= 0 || j.g[Q_OW] <= 0) return 0;
    if (j.g[Q_G] != j.g[Q_C] || j.g[Q_M] != j.g[Q_C]) return -2;
    depth_setup(&j, x, is_signed, xz, w, wz, bias_r, mult, quant, y);
    int64_t floats = (depth_plane_values(&j) + depth_phase_values(&j)) / 2 +
                     j.g[Q_OH] * j.wp + 16 + DW_SLACK;
    return run_parts(qdepth_task, &j, j.g[Q_N] * j.g[Q_C], parts, floats);
}

/* ---- QLinearAdd, onnxruntime's form ------------------------------------------------------
 *
 * y = saturate(round_half_even(fma(a, ra, fma(b, rb, c)))) with the raw integers a and b
 * in float32 and the constants ra = a_scale / y_scale, rb = b_scale / y_scale and c (the
 * zero points' part, y's included) that the caller forms (qlinear_add_constants in the
 * reference backend): onnxruntime's x86-64 vector kernel, bit for bit. A fused ReLU raises
 * the lower bound to y's zero point. The constants are finite (the caller's check). */

/* keel_qadd_u8's flags: the operands that are int8 (the others uint8). */
enum { ADD_FLAG_A_S8 = 1, ADD_FLAG_B_S8 = 2, ADD_FLAG_Y_S8 = 4 };

typedef struct {
    const uint8_t *a, *b;
    float ra, rb, c, lo, hi;
    int64_t flags;
    uint8_t *y;
} qadd_job;

static inline float qadd_one(const qadd_job *j, int64_t i)
{
    float va = j->flags & ADD_FLAG_A_S8 ? (float)(int8_t)j->a[i] : (float)j->a[i];
    float vb = j->flags & ADD_FLAG_B_S8 ? (float)(int8_t)j->b[i] : (float)j->b[i];
    float t = nearbyintf(__builtin_fmaf(va, j->ra, __builtin_fmaf(vb, j->rb, j->c)));
    return t < j->lo ? j->lo : t > j->hi ? j->hi : t;
}

#if QISA == 2
/* The constants of qadd_lanes, as vectors. */
typedef struct {
    __m512 ra, rb, c, lo, hi;
} qadd_vectors;

static inline __m512 qadd_widen(__m128i x, int64_t is_signed)
{
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(x) : _mm512_cvtepu8_epi32(x));
}

/* 16 outputs (int32) from 16 bytes of a and of b, qadd_one's steps on 16 lanes, the
 * signedness flags constants where inlined. The clamp comes before the rounding: the
 * bounds are integers and rounding is monotone, so the bits are the same. */
static inline __attribute__((always_inline)) __m512i
qadd_lanes(const qadd_vectors *v, __m128i a, __m128i b, int64_t flags)
{
    __m512 t = _mm512_fmadd_ps(qadd_widen(a, flags & ADD_FLAG_A_S8), v->ra,
                               _mm512_fmadd_ps(qadd_widen(b, flags & ADD_FLAG_B_S8), v->rb,
                                               v->c));
    t = _mm512_min_ps(_mm512_max_ps(t, v->lo), v->hi);
    return _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* y[lo, hi): 64 bytes at a time, the four int32 results (in y's range) packed with
 * saturation that never acts, their 4-byte groups put back in order; then 16 at a time
 * under a mask. Returns where it stopped (hi). */
static inline __attribute__((always_inline)) int64_t
qadd_run(const qadd_job *j, int64_t i, int64_t hi, int64_t flags)
{
    const qadd_vectors v = {_mm512_set1_ps(j->ra), _mm512_set1_ps(j->rb), _mm512_set1_ps(j->c),
                            _mm512_set1_ps(j->lo), _mm512_set1_ps(j->hi)};
    const uint8_t *a = j->a, *b = j->b;
    for (; i + 64 <= hi; i += 64) {
        __m512i r[4];
        for (int q = 0; q < 4; q++)
            r[q] = qadd_lanes(&v, _mm_loadu_si128((const __m128i *)(const void *)(a + i + 16 * q)),
                              _mm_loadu_si128((const __m128i *)(const void *)(b + i + 16 * q)),
                              flags);
        _mm512_storeu_si512((void *)(j->y + i),
                            pack_bytes(r[0], r[1], r[2], r[3], (flags & ADD_FLAG_Y_S8) != 0));
    }
    for (; i < hi; i += 16) {
        __mmask16 k = hi - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (hi - i)) - 1);
        __m512i r = qadd_lanes(&v, _mm_maskz_loadu_epi8(k, a + i), _mm_maskz_loadu_epi8(k, b + i),
                               flags);
        _mm_mask_storeu_epi8(j->y + i, k, _mm512_cvtepi32_epi8(r));
    }
    return hi;
}
#endif

static void qadd_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const qadd_job *j = ctx;
    (void)scratch;
    int64_t i = lo;
#if QISA == 2
    /* one loop per signedness (each case a set of ADD_FLAG_* bits), the flags constants in it */
    switch (j->flags & (ADD_FLAG_A_S8 | ADD_FLAG_B_S8 | ADD_FLAG_Y_S8)) {
    case 0: i = qadd_run(j, i, hi, 0); break;
    case 1: i = qadd_run(j, i, hi, 1); break;
    case 2: i = qadd_run(j, i, hi, 2); break;
    case 3: i = qadd_run(j, i, hi, 3); break;
    case 4: i = qadd_run(j, i, hi, 4); break;
    case 5: i = qadd_run(j, i, hi, 5); break;
    case 6: i = qadd_run(j, i, hi, 6); break;
    default: i = qadd_run(j, i, hi, 7); break;
    }
#endif
    for (; i < hi; i++) {
        int32_t t = (int32_t)qadd_one(j, i);
        j->y[i] = (uint8_t)(j->flags & ADD_FLAG_Y_S8 ? (uint8_t)(int8_t)t : (uint8_t)t);
    }
}

/* The slots of keel_qadd_u8's constants (ADD_*: ra, rb, c, qadd_job's) and bounds
 * (ADD_BOUND_*: y's lo and hi) arrays, exported with the layout below. */
enum { ADD_RA, ADD_RB, ADD_C, ADD_LEN };
enum { ADD_BOUND_LO, ADD_BOUND_HI, ADD_BOUND_LEN };

/* y[n] = QLinearAdd(a[n], b[n]) for same-shaped 8-bit a and b. constants: ADD_* (ra, rb
 * and c); bounds: ADD_BOUND_* (y's lo, raised to y's zero point for a fused ReLU, and
 * hi); flags: ADD_FLAG_*. The n elements split into `parts` contiguous runs, one per
 * thread. */
int64_t keel_qadd_u8(const uint8_t *a, const uint8_t *b, int64_t n, const float *constants,
                     const int64_t *bounds, int64_t flags, uint8_t *y, int64_t parts)
{
    if (n <= 0) return 0;
    qadd_job j = {a, b, constants[ADD_RA], constants[ADD_RB], constants[ADD_C],
                  (float)bounds[ADD_BOUND_LO], (float)bounds[ADD_BOUND_HI], flags, y};
    return run_parts(qadd_task, &j, n, parts, 1);
}

/* ---- QuantizeLinear of float32 to 8 bits, per tensor -------------------------------------
 *
 * y = saturate(round_half_even(x / scale) + zero point), NaN to 0, with the float32
 * division keel's NumPy kernel makes. The vector paths clamp the quotient to
 * [lo - zp, hi - zp] before rounding it and add the zero point to the integer: the bounds
 * are integers and rounding is monotone, so this gives the bits of rounding, adding in
 * float32 and clamping after. They hold y - lo (0 to 255) in the int32 lanes, pack four
 * vectors to 64 bytes with unsigned saturation (which never acts) and add lo back as a
 * byte, so both 8-bit types share one pack and one unmasked store (64 bytes with AVX-512,
 * 32 with AVX2; the last values run the scalar loop there). A masked vpmovdb to memory per
 * 16 lanes cost three times onnxruntime's time on AMD Zen. */

typedef struct {
    const float *x;
    float scale, zp, lo, hi;
    uint8_t *y;
} quantize_job;

#if QISA == 2
#define QLANES 16
typedef __m512 qvf;
typedef __m512i qvi;
#define qset1_ps _mm512_set1_ps
#define qset1_epi32 _mm512_set1_epi32
#define qloadu_ps _mm512_loadu_ps
#elif QISA == 1
#define QLANES 8
typedef __m256 qvf;
typedef __m256i qvi;
#define qset1_ps _mm256_set1_ps
#define qset1_epi32 _mm256_set1_epi32
#define qloadu_ps _mm256_loadu_ps
#endif

#if QISA != 0
typedef struct {
    qvf s, lo, hi;
    qvi shift, nan;
} quantize_consts;
#endif

#if QISA == 2
/* y - lo of 16 lanes as int32 */
static inline qvi quantize_lanes(const quantize_consts *c, qvf x)
{
    __m512 d = _mm512_div_ps(x, c->s);
    __mmask16 ordered = _mm512_cmp_ps_mask(d, d, _CMP_ORD_Q);
    __m512i r = _mm512_cvt_roundps_epi32(_mm512_min_ps(_mm512_max_ps(d, c->lo), c->hi),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_mask_add_epi32(c->nan, ordered, r, c->shift);
}

/* y[0, 64) = the bytes of four vectors of y - lo, plus lo */
static inline void quantize_store(uint8_t *y, qvi a, qvi b, qvi c, qvi d, int8_t lo)
{
    _mm512_storeu_si512((void *)y, _mm512_add_epi8(pack_bytes(a, b, c, d, 0),
                                                   _mm512_set1_epi8(lo)));
}
#elif QISA == 1
/* y - lo of 8 lanes as int32 */
static inline qvi quantize_lanes(const quantize_consts *c, qvf x)
{
    __m256 d = _mm256_div_ps(x, c->s);
    __m256 ordered = _mm256_cmp_ps(d, d, _CMP_ORD_Q);
    __m256 t = _mm256_round_ps(_mm256_min_ps(_mm256_max_ps(d, c->lo), c->hi),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_blendv_epi8(c->nan, _mm256_add_epi32(_mm256_cvtps_epi32(t), c->shift),
                              _mm256_castps_si256(ordered));
}

/* y[0, 32) = the bytes of four vectors of y - lo, plus lo */
static inline void quantize_store(uint8_t *y, qvi a, qvi b, qvi c, qvi d, int8_t lo)
{
    __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)y, _mm256_add_epi8(bytes, _mm256_set1_epi8(lo)));
}
#endif

static void quantize_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const quantize_job *j = ctx;
    (void)scratch;
    int64_t i = lo;
#if QISA != 0
    const quantize_consts c = {qset1_ps(j->scale), qset1_ps(j->lo - j->zp),
                               qset1_ps(j->hi - j->zp), qset1_epi32((int32_t)(j->zp - j->lo)),
                               qset1_epi32((int32_t)-j->lo)};
    const float *xs = j->x;
    uint8_t *ys = j->y;
    int8_t base = (int8_t)(int32_t)j->lo;
    for (; i + 4 * QLANES <= hi; i += 4 * QLANES) {
        const float *x = xs + i;
        quantize_store(ys + i, quantize_lanes(&c, qloadu_ps(x)),
                       quantize_lanes(&c, qloadu_ps(x + QLANES)),
                       quantize_lanes(&c, qloadu_ps(x + 2 * QLANES)),
                       quantize_lanes(&c, qloadu_ps(x + 3 * QLANES)), base);
    }
#endif
#if QISA == 2
    for (; i < hi; i += 16) {
        __mmask16 k = hi - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (hi - i)) - 1);
        __m128i b = _mm512_cvtepi32_epi8(quantize_lanes(&c, _mm512_maskz_loadu_ps(k, xs + i)));
        _mm_mask_storeu_epi8(ys + i, k, _mm_add_epi8(b, _mm_set1_epi8(base)));
    }
#endif
    for (; i < hi; i++) {
        float t = nearbyintf(j->x[i] / j->scale) + j->zp;
        t = t != t ? 0.0f : t < j->lo ? j->lo : t > j->hi ? j->hi : t;
        j->y[i] = (uint8_t)(int32_t)t;
    }
}

/* y[n] = QuantizeLinear(x[n]) with one scale and zero point zp, y's type spanning [lo, hi].
 * The n elements split into `parts` contiguous runs. */
int64_t keel_quantize_f32(const float *x, int64_t n, float scale, int64_t zp, int64_t lo,
                          int64_t hi, uint8_t *y, int64_t parts)
{
    if (n <= 0) return 0;
    quantize_job j = {x, scale, (float)zp, (float)lo, (float)hi, y};
    return run_parts(quantize_task, &j, n, parts, 1);
}

/* DequantizeLinear of 8 bits to float32, per tensor: y = (float)(x - zp) * scale, the
 * exact integer difference times the scale in float32, as keel's NumPy kernel does it
 * (the vector types and lane counts of QuantizeLinear's paths above). */

typedef struct {
    const uint8_t *x;
    float scale;
    int32_t zp;
    int is_signed;
    float *y;
} dequantize_job;

#if QISA == 2
/* y[0, 16) = (float)(x - zp) * s */
static inline void dequantize_lanes(const uint8_t *x, int is_signed, qvi zp, qvf s, float *y)
{
    __m128i b = _mm_loadu_si128((const __m128i *)x);
    __m512i v = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, zp)), s));
}
#elif QISA == 1
/* y[0, 8) = (float)(x - zp) * s */
static inline void dequantize_lanes(const uint8_t *x, int is_signed, qvi zp, qvf s, float *y)
{
    __m128i b = _mm_loadl_epi64((const __m128i *)x);
    __m256i v = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, zp)), s));
}
#endif

static void dequantize_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const dequantize_job *j = ctx;
    (void)scratch;
    int64_t i = lo;
#if QISA != 0
    const qvf s = qset1_ps(j->scale);
    const qvi zp = qset1_epi32(j->zp);
    for (; i + QLANES <= hi; i += QLANES) dequantize_lanes(j->x + i, j->is_signed, zp, s, j->y + i);
#endif
    for (; i < hi; i++) {
        int32_t v = j->is_signed ? (int32_t)(int8_t)j->x[i] : (int32_t)j->x[i];
        j->y[i] = (float)(v - j->zp) * j->scale;
    }
}
#undef qset1_ps
#undef qset1_epi32
#undef qloadu_ps

/* y[n] = DequantizeLinear(x[n]) (8-bit, int8 where is_signed) with one scale and zero
 * point; the n elements split into `parts` contiguous runs. */
int64_t keel_dequantize_f32(const uint8_t *x, int64_t n, float scale, int64_t zp,
                            int64_t is_signed, float *y, int64_t parts)
{
    if (n <= 0) return 0;
    dequantize_job j = {x, scale, (int32_t)zp, is_signed != 0, y};
    return run_parts(dequantize_task, &j, n, parts, 1);
}

/* ---- depthwise convolution, channels in the vector lanes ---------------------------------
 *
 * For small planes (where the per-plane work of qdepth_task outweighs its sums): a task
 * takes one image and a block of 32 channels, copies the block's padded input once as
 * [Hp * Wp][32] int16 (x - zero point), and for each output pixel sums its taps two at a
 * time with vpdpwssd over the 32 channels, as depthwise_pairs does over pixels (the same
 * interleaving, so the same lane order, undone by one permutation). The 32 sums are
 * requantized with the channels' multipliers (store_row, per column) into [pixels][32]
 * bytes, copied out to NCHW at the end. Exact int32 sums: the same bits as qdepth_task. */

#if QISA == 2
#define CL 32

static void qdepth_cl_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const qdepth_job *j = ctx;
    const int64_t *g = j->g;
    int64_t c = g[Q_C], h = g[Q_H], w = g[Q_W], oh = g[Q_OH], ow = g[Q_OW];
    int64_t kh = g[Q_KH], kw = g[Q_KW], ntaps = kh * kw, blocks = (c + CL - 1) / CL;
    int16_t *xt = (int16_t *)scratch;
    uint8_t *yt = (uint8_t *)(xt + j->hp * j->wp * CL);
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t t = lo; t < hi; t++) {
        int64_t n = t / blocks, c0 = (t % blocks) * CL, nc = c - c0 < CL ? c - c0 : CL;
        /* lane i of the low accumulator holds channel (i / 4) * 8 + i % 4, of the high
         * one channel (i / 4) * 8 + 4 + i % 4 */
        int32_t bias[2][16], pairs[DW_TAPS / 2][2][16];
        for (int half = 0; half < 2; half++)
            for (int i = 0; i < 16; i++) {
                int64_t k = (i / 4) * 8 + 4 * half + i % 4, ch = c0 + k;
                int valid = k < nc;
                int32_t wz = valid && j->wz ? j->wz[ch] : 0;
                bias[half][i] = valid && j->q.bias_r ? j->q.bias_r[ch] : 0;
                for (int64_t p = 0; p < ntaps; p += 2) {
                    int32_t a = valid ? (int32_t)j->w[ch * ntaps + p] - wz : 0;
                    int32_t b = valid && p + 1 < ntaps ? (int32_t)j->w[ch * ntaps + p + 1] - wz : 0;
                    pairs[p / 2][half][i] = (int32_t)((uint32_t)(uint16_t)(int16_t)a |
                                                      (uint32_t)(uint16_t)(int16_t)b << 16);
                }
            }
        memset(xt, 0, (size_t)(j->hp * j->wp * CL) * sizeof *xt);
        for (int64_t k = 0; k < nc; k++) {
            const uint8_t *src = j->x + ((n * c) + c0 + k) * h * w;
            for (int64_t y = 0; y < h; y++) {
                int16_t *row = xt + ((y + g[Q_PT]) * j->wp + g[Q_PL]) * CL + k;
                if (j->is_signed)
                    for (int64_t x = 0; x < w; x++)
                        row[x * CL] = (int16_t)((int8_t)src[y * w + x] - j->xz);
                else
                    for (int64_t x = 0; x < w; x++)
                        row[x * CL] = (int16_t)(src[y * w + x] - j->xz);
            }
        }
        __m512i blo = _mm512_loadu_si512((const void *)bias[0]);
        __m512i bhi = _mm512_loadu_si512((const void *)bias[1]);
        for (int64_t oy = 0; oy < oh; oy++)
            for (int64_t ox = 0; ox < ow; ox++) {
                __m512i vlo = blo, vhi = bhi;
                for (int64_t p = 0; p < ntaps; p += 2) {
                    int64_t ky = p / kw, kx = p % kw;
                    const int16_t *pa = xt + ((oy * g[Q_SH] + ky * g[Q_DH]) * j->wp +
                                              ox * g[Q_SW] + kx * g[Q_DW]) * CL;
                    __m512i a = _mm512_loadu_si512((const void *)pa), b = _mm512_setzero_si512();
                    if (p + 1 < ntaps) {
                        int64_t ky1 = (p + 1) / kw, kx1 = (p + 1) % kw;
                        b = _mm512_loadu_si512((const void *)(
                            xt + ((oy * g[Q_SH] + ky1 * g[Q_DH]) * j->wp + ox * g[Q_SW] +
                                  kx1 * g[Q_DW]) * CL));
                    }
                    vlo = _mm512_dpwssd_epi32(vlo, _mm512_unpacklo_epi16(a, b),
                                              _mm512_loadu_si512((const void *)pairs[p / 2][0]));
                    vhi = _mm512_dpwssd_epi32(vhi, _mm512_unpackhi_epi16(a, b),
                                              _mm512_loadu_si512((const void *)pairs[p / 2][1]));
                }
                int32_t sums[CL];
                _mm512_storeu_si512((void *)sums, _mm512_permutex2var_epi64(vlo, first, vhi));
                _mm512_storeu_si512((void *)(sums + 16),
                                    _mm512_permutex2var_epi64(vlo, second, vhi));
                store_row(sums, nc, j->q.mult + c0, 0.0, &j->q, yt + (oy * ow + ox) * CL);
            }
        uint8_t *out = (uint8_t *)j->y + (n * c + c0) * oh * ow;
        for (int64_t k = 0; k < nc; k++)
            for (int64_t p = 0; p < oh * ow; p++) out[k * oh * ow + p] = yt[p * CL + k];
    }
}
#endif

/* keel_qdepthwise_u8s8 with the channels in the vector lanes (8-bit output); -2 where
 * this build or the geometry has no such path. */
int64_t keel_qdepthwise_cl_u8s8(const uint8_t *x, int64_t is_signed, int64_t xz,
                                const int8_t *w, const int32_t *wz, const int64_t *geometry,
                                const int32_t *bias_r, const double *mult,
                                const int64_t *quant, void *y, int64_t parts)
{
#if QISA == 2
    qdepth_job j;
    memcpy(j.g, geometry, sizeof j.g);
    if (j.g[Q_N] <= 0 || j.g[Q_OH] <= 0 || j.g[Q_OW] <= 0) return 0;
    if (j.g[Q_G] != j.g[Q_C] || j.g[Q_M] != j.g[Q_C] || quant[QUANT_KIND] == KIND_F32 ||
        j.g[Q_KH] * j.g[Q_KW] > DW_TAPS)
        return -2;
    depth_setup(&j, x, is_signed, xz, w, wz, bias_r, mult, quant, y);
    int64_t floats = j.hp * j.wp * CL / 2 + j.g[Q_OH] * j.g[Q_OW] * CL / 4 + 16;
    int64_t blocks = (j.g[Q_C] + CL - 1) / CL;
    return run_parts(qdepth_cl_task, &j, j.g[Q_N] * blocks, parts, floats);
#else
    (void)x, (void)is_signed, (void)xz, (void)w, (void)wz, (void)geometry, (void)bias_r;
    (void)mult, (void)quant, (void)y, (void)parts;
    return -2;
#endif
}

/* ---- max pool on 8-bit integers -----------------------------------------------------------
 *
 * The int8 graphs keep a MaxPool between DequantizeLinear and QuantizeLinear on the integers
 * (the max of uint8 or int8 values: exact). One plane at a time, one output row at a time:
 * the rows its window reads are reduced to one padded row (the type's lowest value in the
 * padding), the window's columns then to a full-resolution row, and the output keeps every
 * stride-th column of it. Each step is a byte-wise max over a whole row (vectorized by the
 * compiler; the pick of every other byte, a stride of 2, by vpmovwb with AVX-512). */

enum { P_N, P_C, P_H, P_W, P_OH, P_OW, P_KH, P_KW, P_SH, P_SW, P_PT, P_PL, P_DH, P_DW,
       P_LEN };

typedef struct {
    const void *x;
    void *y;
    int64_t g[P_LEN];
    const uint8_t *end;  /* past the input's last byte */
    int64_t wp;          /* the padded row's width */
    int64_t is_signed;
} qpool_job;

#define QPOOL_PLANE(T, LOWEST)                                                                \
    static void qpool_plane_##T(const qpool_job *j, const T *x, T *y, T *vm, T *hm)            \
    {                                                                                           \
        const int64_t *g = j->g;                                                                \
        int64_t w = g[P_W], ow = g[P_OW], sw = g[P_SW], reach = (ow - 1) * sw + 1;              \
        for (int64_t i = 0; i < j->wp; i++) vm[i] = LOWEST;                                     \
        for (int64_t oy = 0; oy < g[P_OH]; oy++) {                                              \
            T *row = vm + g[P_PL];                                                              \
            int64_t rows = 0;                                                                   \
            for (int64_t ky = 0; ky < g[P_KH]; ky++) {                                          \
                int64_t iy = oy * g[P_SH] - g[P_PT] + ky * g[P_DH];                             \
                if (iy < 0 || iy >= g[P_H]) continue;                                           \
                const T *src = x + iy * w;                                                      \
                if (!rows++) {                                                                  \
                    memcpy(row, src, (size_t)w * sizeof(T));                                    \
                    continue;                                                                   \
                }                                                                               \
                for (int64_t i = 0; i < w; i++) row[i] = row[i] > src[i] ? row[i] : src[i];     \
            }                                                                                   \
            if (!rows)                                                                          \
                for (int64_t i = 0; i < w; i++) row[i] = LOWEST;                                \
            memcpy(hm, vm, (size_t)reach * sizeof(T));                                          \
            for (int64_t kx = 1; kx < g[P_KW]; kx++) {                                          \
                const T *s = vm + kx * g[P_DW];                                                 \
                for (int64_t i = 0; i < reach; i++) hm[i] = hm[i] > s[i] ? hm[i] : s[i];        \
            }                                                                                   \
            pick_columns((const uint8_t *)hm, ow, sw, (uint8_t *)(y + oy * ow));                \
        }                                                                                       \
    }

/* out[i] = row[i * stride], i < n (row has 64 bytes of slack past its last pick). */
static void pick_columns(const uint8_t *row, int64_t n, int64_t stride, uint8_t *out)
{
    if (stride == 1) {
        memcpy(out, row, (size_t)n);
        return;
    }
    int64_t i = 0;
#if QISA == 2
    for (; stride == 2 && i + 32 <= n; i += 32)     /* the low byte of each 16-bit lane */
        _mm256_storeu_si256((__m256i *)(void *)(out + i),
                            _mm512_cvtepi16_epi8(_mm512_loadu_si512((const void *)(row + 2 * i))));
#endif
    for (; i < n; i++) out[i] = row[i * stride];
}

QPOOL_PLANE(uint8_t, 0)
QPOOL_PLANE(int8_t, -128)

#if QISA == 2
static inline __m512i max8(__m512i a, __m512i b, int64_t is_signed)
{
    return is_signed ? _mm512_max_epi8(a, b) : _mm512_max_epu8(a, b);
}

static inline __mmask64 head_mask(int64_t n)
{
    return n >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << n) - 1;
}

/* qpool_plane_* for strides of 1 or 2 along the row, 64 bytes at a time: the window's rows
 * reduced through masked loads (nothing read past a row), then each 64 columns of the
 * window max taken from unaligned loads of that row (vm has 128 bytes of slack) and, with
 * a stride of 2, their even bytes kept by vpmovwb. */
static void qpool_plane_avx512(const qpool_job *j, const uint8_t *x, uint8_t *y, uint8_t *vm)
{
    const int64_t *g = j->g;
    int64_t w = g[P_W], ow = g[P_OW], sw = g[P_SW], step = 64 / sw;
    __m512i lowest = _mm512_set1_epi8(j->is_signed ? (char)-128 : 0);
    memset(vm, j->is_signed ? 0x80 : 0, (size_t)(j->wp + 128));
    for (int64_t oy = 0; oy < g[P_OH]; oy++) {
        for (int64_t c = 0; c < w; c += 64) {
            __mmask64 m = head_mask(w - c);
            __m512i v = lowest;
            for (int64_t ky = 0; ky < g[P_KH]; ky++) {
                int64_t iy = oy * g[P_SH] - g[P_PT] + ky * g[P_DH];
                if (iy < 0 || iy >= g[P_H]) continue;
                /* a whole load where the input goes on past these 64 bytes (the masked
                 * form is slow here; the bytes past the row are not stored) */
                const uint8_t *at = x + iy * w + c;
                v = max8(v, at + 64 <= j->end ? _mm512_loadu_si512((const void *)at)
                                              : _mm512_maskz_loadu_epi8(m, at), j->is_signed);
            }
            _mm512_mask_storeu_epi8(vm + g[P_PL] + c, m, v);
        }
        uint8_t *out = y + oy * ow;
        for (int64_t o = 0; o < ow; o += step) {
            const uint8_t *at = vm + o * sw;
            __m512i v = _mm512_loadu_si512((const void *)at);
            for (int64_t kx = 1; kx < g[P_KW]; kx++)
                v = max8(v, _mm512_loadu_si512((const void *)(at + kx * g[P_DW])), j->is_signed);
            __mmask64 m = head_mask(ow - o);
            if (sw == 1)
                _mm512_mask_storeu_epi8(out + o, m, v);
            else
                _mm256_mask_storeu_epi8(out + o, (__mmask32)m, _mm512_cvtepi16_epi8(v));
        }
    }
}
#endif

static void qpool_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const qpool_job *j = ctx;
    const int64_t *g = j->g;
    int64_t in = g[P_H] * g[P_W], out = g[P_OH] * g[P_OW];
    uint8_t *vm = (uint8_t *)scratch, *hm = vm + j->wp + 128;
    for (int64_t t = lo; t < hi; t++) {
        const uint8_t *x = (const uint8_t *)j->x + t * in;
        uint8_t *y = (uint8_t *)j->y + t * out;
#if QISA == 2
        if (g[P_SW] <= 2) {
            qpool_plane_avx512(j, x, y, vm);
            continue;
        }
#endif
        if (j->is_signed)
            qpool_plane_int8_t(j, (const int8_t *)x, (int8_t *)y, (int8_t *)vm, (int8_t *)hm);
        else
            qpool_plane_uint8_t(j, x, y, vm, hm);
    }
}

/* y[N][C][OH][OW] = the max over each 2-D window of x[N][C][H][W] (uint8, or int8 where
 * is_signed), the padding never chosen; geometry: N, C, H, W, OH, OW, KH, KW, SH, SW,
 * PT, PL, DH, DW. 0, or -2 for a geometry it does not take. */
int64_t keel_qmaxpool_8(const void *x, int64_t is_signed, const int64_t *geometry, void *y,
                        int64_t parts)
{
    qpool_job j;
    memcpy(j.g, geometry, sizeof j.g);
    const int64_t *g = j.g;
    for (int i = 0; i < P_LEN; i++)
        if (g[i] < (i == P_PT || i == P_PL ? 0 : 1)) return i < P_OW && !g[i] ? 0 : -2;
    j.x = x, j.y = y, j.is_signed = is_signed;
    j.end = (const uint8_t *)x + g[P_N] * g[P_C] * g[P_H] * g[P_W];
    int64_t reach = (g[P_OW] - 1) * g[P_SW] + (g[P_KW] - 1) * g[P_DW] + 1;
    j.wp = g[P_PL] + g[P_W] > reach ? g[P_PL] + g[P_W] : reach;
    return run_parts(qpool_task, &j, g[P_N] * g[P_C], parts, (2 * (j.wp + 128) + 3) / 4 + 16);
}

/* The sizes the planner's splits count in (keel.backends.cpu.native_qgemm checks the cpu
 * planner's INT8_* values against them at load). Writes at most n of: NB (output positions
 * of a direct-kernel block, columns of a matmul panel), MR (rows of a matmul tile),
 * DW_TAPS (the most taps the lanes depthwise kernel takes); returns 3. */
int64_t keel_qgemm_geometry(int64_t *out, int64_t n)
{
    const int64_t sizes[] = {NB, MR, DW_TAPS};
    const int64_t count = (int64_t)(sizeof sizes / sizeof sizes[0]);
    for (int64_t i = 0; i < n && i < count; i++) out[i] = sizes[i];
    return count;
}

/* The enum values keel.backends.cpu.native_qgemm builds its arrays with (it checks them at
 * load, as the sizes above), by name: KIND_*, COLUMNS_*, the quant array's slots
 * (QUANT_*), the conv geometry's (Q_*), the max pool geometry's (P_*) and QLinearAdd's
 * constants (ADD_*), bounds (ADD_BOUND_*) and flags (ADD_FLAG_*), each array with its
 * length (keel_qgemm_layout and keel_qgemm_layout_names: see enums.h). */
#define QGEMM_LAYOUT(X) \
    X(KIND_U8) X(KIND_S8) X(KIND_F32) X(COLUMNS_PADDED) X(COLUMNS_COMPACT) X(COLUMNS_ROWS) \
    X(QUANT_YZP) X(QUANT_LO) X(QUANT_HI) X(QUANT_KIND) X(QUANT_LEN) \
    X(Q_N) X(Q_C) X(Q_H) X(Q_W) X(Q_M) X(Q_OH) X(Q_OW) X(Q_KH) X(Q_KW) X(Q_SH) X(Q_SW) \
    X(Q_DH) X(Q_DW) X(Q_PT) X(Q_PL) X(Q_G) X(Q_LEN) \
    X(P_N) X(P_C) X(P_H) X(P_W) X(P_OH) X(P_OW) X(P_KH) X(P_KW) X(P_SH) X(P_SW) X(P_PT) \
    X(P_PL) X(P_DH) X(P_DW) X(P_LEN) \
    X(ADD_RA) X(ADD_RB) X(ADD_C) X(ADD_LEN) X(ADD_BOUND_LO) X(ADD_BOUND_HI) X(ADD_BOUND_LEN) \
    X(ADD_FLAG_A_S8) X(ADD_FLAG_B_S8) X(ADD_FLAG_Y_S8)

KEEL_ENUM_EXPORT(keel_qgemm_layout, QGEMM_LAYOUT)
