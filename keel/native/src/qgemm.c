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
 *     per quad;
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
 *   y   = clamp(round_half_even(acc * mult) + y_zero_point, lo, hi)     (8-bit output)
 *   y   = (float)(acc * mult)                                           (float output)
 *
 * with sv the column sums of V (computed while packing a convolution's columns) and
 * sr the row sums of R, each term present only when its arrays are, and mult one
 * double per row or per column. The product and the rounding run in double, as keel's
 * reference kernels do, so an 8-bit result is the reference's bit for bit. Each
 * output is computed the same way whatever the split over threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "parallel.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define QISA 2
#elif defined(__AVXVNNI__) && defined(__AVX2__)
#include <immintrin.h>
#define QISA 1
#else
#define QISA 0
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

/* acc[MR][NB] = R[rows][4 k4] . panel, rows past `mr` repeat the last one. r_u8: R
 * holds the unsigned operand (a matmul's activations), else V does (a convolution's). */
static inline void tile(const uint8_t *r, int64_t ldr, int64_t mr, const uint8_t *v,
                        int64_t k4, int32_t *acc, int r_u8)
{
    const uint8_t *row[MR];
    for (int i = 0; i < MR; i++) row[i] = r + (i < mr ? i : mr - 1) * ldr;
#if QISA == 2
    __m512i c[MR][4];
    for (int i = 0; i < MR; i++)
        for (int t = 0; t < 4; t++) c[i][t] = _mm512_setzero_si512();
    for (int64_t q = 0; q < k4; q++) {
        const uint8_t *vq = v + q * NB * 4;
        __m512i b[4];
        for (int t = 0; t < 4; t++) b[t] = _mm512_loadu_si512((const void *)(vq + 64 * t));
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            __m512i a = _mm512_set1_epi32(quad(row[i] + 4 * q));
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++)
                c[i][t] = r_u8 ? _mm512_dpbusd_epi32(c[i][t], a, b[t])
                               : _mm512_dpbusd_epi32(c[i][t], b[t], a);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int t = 0; t < 4; t++) _mm512_storeu_si512((void *)(acc + i * NB + 16 * t), c[i][t]);
#elif QISA == 1
    for (int h = 0; h < 4; h++) {
        __m256i c[MR][2];
        for (int i = 0; i < MR; i++) c[i][0] = c[i][1] = _mm256_setzero_si256();
        for (int64_t q = 0; q < k4; q++) {
            const uint8_t *vq = v + q * NB * 4 + 64 * h;
            __m256i b0 = _mm256_loadu_si256((const void *)vq);
            __m256i b1 = _mm256_loadu_si256((const void *)(vq + 32));
#pragma GCC unroll 6
            for (int i = 0; i < MR; i++) {
                __m256i a = _mm256_set1_epi32(quad(row[i] + 4 * q));
                if (r_u8) {
                    c[i][0] = _mm256_dpbusd_avx_epi32(c[i][0], a, b0);
                    c[i][1] = _mm256_dpbusd_avx_epi32(c[i][1], a, b1);
                } else {
                    c[i][0] = _mm256_dpbusd_avx_epi32(c[i][0], b0, a);
                    c[i][1] = _mm256_dpbusd_avx_epi32(c[i][1], b1, a);
                }
            }
        }
        for (int i = 0; i < MR; i++) {
            _mm256_storeu_si256((void *)(acc + i * NB + 16 * h), c[i][0]);
            _mm256_storeu_si256((void *)(acc + i * NB + 16 * h + 8), c[i][1]);
        }
    }
#else
    for (int i = 0; i < MR; i++) {
        int32_t *ci = acc + i * NB;
        for (int j = 0; j < NB; j++) ci[j] = 0;
        for (int64_t q = 0; q < k4; q++) {
            const uint8_t *vq = v + q * NB * 4;
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

/* The requantization: what the corrections and the store take (see the header). */
typedef struct {
    const int32_t *bias_r, *bias_c, *zr, *zv, *sr;
    const double *mult;
    int64_t mult_per_col;
    int64_t yzp, lo, hi, kind;    /* kind: 0 uint8, 1 int8, 2 float32 */
} requant;

enum { KIND_U8, KIND_S8, KIND_F32 };

/* Store rows [i0, i0 + rows) x columns [j0, j0 + cols) of Y from a tile; sv holds the
 * tile's column sums of V (or is NULL). */
static void store(const int32_t *acc, int64_t rows, int64_t cols, int64_t i0, int64_t j0,
                  const requant *q, const int32_t *sv, void *y, int64_t ldy)
{
    for (int64_t i = 0; i < rows; i++) {
        const int32_t *a = acc + i * NB;
        int32_t ri = q->bias_r ? q->bias_r[i0 + i] : 0;
        int32_t zri = q->zr && sv ? q->zr[i0 + i] : 0;
        int32_t sri = q->sr ? q->sr[i0 + i] : 0;
        double mi = q->mult_per_col ? 0.0 : q->mult[i0 + i];
        int64_t base = (i0 + i) * ldy + j0;
        for (int64_t j = 0; j < cols; j++) {
            int32_t v = a[j] + ri;
            if (q->bias_c) v += q->bias_c[j0 + j];
            if (zri) v += zri * sv[j];
            if (q->zv && sri) v += q->zv[j0 + j] * sri;
            double t = (double)v * (q->mult_per_col ? q->mult[j0 + j] : mi);
            if (q->kind == KIND_F32) {
                ((float *)y)[base + j] = (float)t;
                continue;
            }
            double r = nearbyint(t) + (double)q->yzp;
            r = r < (double)q->lo ? (double)q->lo : r > (double)q->hi ? (double)q->hi : r;
            if (q->kind == KIND_U8) ((uint8_t *)y)[base + j] = (uint8_t)(int32_t)r;
            else ((int8_t *)y)[base + j] = (int8_t)(int32_t)r;
        }
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
        tile(j->a + i0 * j->kp, j->kp, mr, j->panels + nb * k4 * NB * 4, k4, acc, 1);
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
                      quant[0], quant[1], quant[2], quant[3]},
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

/* The columns of pixels [p0, p0 + NB) of image n, group grp, as one panel; their sums. */
static void pack_columns(const qconv_job *j, int64_t n, int64_t grp, int64_t p0,
                         uint8_t *panel, int32_t *sums)
{
    const int64_t *g = j->g;
    int64_t cg = g[Q_C] / g[Q_G], taps = g[Q_KH] * g[Q_KW], k = cg * taps;
    int64_t pixels = g[Q_OH] * g[Q_OW];
    int64_t oy[NB], ox[NB];
    for (int64_t t = 0; t < NB; t++) {
        int64_t p = p0 + t < pixels ? p0 + t : pixels - 1;
        oy[t] = (p / g[Q_OW]) * g[Q_SH] - g[Q_PT];
        ox[t] = (p % g[Q_OW]) * g[Q_SW] - g[Q_PL];
    }
    const uint8_t *image = j->x + (n * g[Q_C] + grp * cg) * g[Q_H] * g[Q_W];
    for (int64_t kk = 0; kk < k; kk++) {
        int64_t c = kk / taps, ky = (kk % taps) / g[Q_KW], kx = kk % g[Q_KW];
        const uint8_t *plane = image + c * g[Q_H] * g[Q_W];
        uint8_t *dst = panel + (kk >> 2) * NB * 4 + (kk & 3);
        int64_t dy = ky * g[Q_DH], dx = kx * g[Q_DW];
        for (int64_t t = 0; t < NB; t++) {
            int64_t iy = oy[t] + dy, ix = ox[t] + dx;
            int inside = iy >= 0 && iy < g[Q_H] && ix >= 0 && ix < g[Q_W];
            dst[4 * t] = inside ? (uint8_t)(plane[iy * g[Q_W] + ix] ^ j->flip) : j->pad;
        }
    }
    for (int64_t kk = k; kk < j->kp; kk++) {
        uint8_t *dst = panel + (kk >> 2) * NB * 4 + (kk & 3);
        for (int64_t t = 0; t < NB; t++) dst[4 * t] = 0;
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
            tile(j->w + i0 * j->kp, j->kp, mr, panel, j->kp / 4, acc, 0);
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
    j.q = (requant){bias_r, NULL, zr, NULL, NULL, mult, 0, quant[0], quant[1], quant[2],
                    quant[3]};
    j.y = y;
    int64_t scratch = MR * NB + NB + (kp * NB + 3) / 4;
    return run_parts(qconv_task, &j, j.g[Q_N] * j.g[Q_G] * j.blocks, parts, scratch);
}
