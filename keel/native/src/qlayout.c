/* Channels-last (NHWC) 8-bit activations: the layout changes at a chain's ends and the
 * depthwise convolution inside it.
 *
 * The cpu planner keeps the int8 activations between pointwise and depthwise
 * convolutions channels-last (keel.backends.cpu.planner.int8_layouts): a pointwise
 * convolution is then one matrix product over every pixel (qgemm.c's
 * keel_qmatmul_u8s8), a residual QLinearAdd an elementwise pass in any layout, and a
 * depthwise convolution runs here with the channels in the vector lanes, so no plane
 * is ever copied or padded. keel_qtranspose_u8 changes the layout where a chain
 * starts or ends.
 *
 * The depthwise arithmetic is qgemm.c's: acc = bias + sum over taps of
 * (x - x zero point) * (w - w zero point) exactly in int32, y = clamp(round_half_even
 * (acc * mult) + y zero point, lo, hi) with the product in double, so the results are
 * the reference kernels' bit for bit. A tap that falls in the padding reads a row of
 * the zero point, which adds nothing.
 *
 *   - AVX-512 (__AVX512BW__): 32 channels a time as int16, two taps per vpdpwssd
 *     (the taps' values interleaved, as qgemm.c's depthwise_pairs does over pixels);
 *   - elsewhere: the same sums in plain C (the portable path).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"

#if defined(__AVX512BW__) && defined(__AVX512F__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define LAYOUT_AVX512 1
#else
#define LAYOUT_AVX512 0
#endif

int64_t keel_qlayout_isa(void) { return LAYOUT_AVX512 ? 2 : 0; }

/* ---- layout changes: y[n][cols][rows] = x[n][rows][cols] -------------------------------- */

#define TB 32

typedef struct {
    const uint8_t *x;
    int64_t rows, cols, strips;
    uint8_t *y;
} transpose_job;

static void transpose_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const transpose_job *j = ctx;
    (void)scratch;
    for (int64_t t = lo; t < hi; t++) {
        int64_t n = t / j->strips, r0 = (t % j->strips) * TB;
        int64_t nr = j->rows - r0 < TB ? j->rows - r0 : TB;
        const uint8_t *src = j->x + (n * j->rows + r0) * j->cols;
        uint8_t *dst = j->y + n * j->rows * j->cols + r0;
        for (int64_t c0 = 0; c0 < j->cols; c0 += TB) {
            int64_t nc = j->cols - c0 < TB ? j->cols - c0 : TB;
            uint8_t tile[TB][TB];
            for (int64_t r = 0; r < nr; r++)
                memcpy(tile[r], src + r * j->cols + c0, (size_t)nc);
            for (int64_t c = 0; c < nc; c++) {
                uint8_t *out = dst + (c0 + c) * j->rows;
                for (int64_t r = 0; r < nr; r++) out[r] = tile[r][c];
            }
        }
    }
}

/* NCHW to NHWC (rows = C, cols = H * W) or back (rows = H * W, cols = C), per image. */
int64_t keel_qtranspose_u8(const uint8_t *x, int64_t n, int64_t rows, int64_t cols, uint8_t *y,
                           int64_t parts)
{
    if (n <= 0 || rows <= 0 || cols <= 0) return 0;
    transpose_job j = {x, rows, cols, (rows + TB - 1) / TB, y};
    return run_parts(transpose_task, &j, n * j.strips, parts, 1);
}

/* ---- depthwise convolution, NHWC in and out --------------------------------------------- */

enum { G_N, G_C, G_H, G_W, G_OH, G_OW, G_KH, G_KW, G_SH, G_SW, G_DH, G_DW, G_PT, G_PL,
       G_SIZE };

#define CL 32
#define MAX_TAPS 64

typedef struct {
    int64_t g[G_SIZE];
    const uint8_t *x;
    int64_t is_signed;
    int32_t xz;
    const int32_t *taps;       /* [taps][C]: w - w zero point */
    const int32_t *bias;       /* [C] or NULL */
    const double *mult;        /* [C] */
    double zp, lo, hi;
    const uint8_t *zero_row;   /* C bytes of the x zero point: the padding */
    int32_t *pairs;            /* AVX-512: [blocks][taps / 2][2][16], lane order */
    int32_t *lane_bias;        /* AVX-512: [blocks][2][16] */
    uint8_t *y;
} dwcl_job;

/* The input pixel under tap (ky, kx) of output (oy, ox), or the padding's zero row. */
static const uint8_t *tap_pixel(const dwcl_job *j, int64_t n, int64_t oy, int64_t ox,
                                int64_t ky, int64_t kx)
{
    const int64_t *g = j->g;
    int64_t iy = oy * g[G_SH] + ky * g[G_DH] - g[G_PT];
    int64_t ix = ox * g[G_SW] + kx * g[G_DW] - g[G_PL];
    if (iy < 0 || iy >= g[G_H] || ix < 0 || ix >= g[G_W]) return j->zero_row;
    return j->x + ((n * g[G_H] + iy) * g[G_W] + ix) * g[G_C];
}

static void requant_portable(const dwcl_job *j, const int32_t *acc, int64_t c0, int64_t nc,
                             uint8_t *out)
{
    for (int64_t k = 0; k < nc; k++) {
        double t = nearbyint((double)acc[k] * j->mult[c0 + k]) + j->zp;
        out[k] = (uint8_t)(int32_t)(t < j->lo ? j->lo : t > j->hi ? j->hi : t);
    }
}

/* One output pixel over channels [c0, c0 + nc): plain int32 sums. */
static void pixel_portable(const dwcl_job *j, const uint8_t *const *px, int64_t c0, int64_t nc,
                           uint8_t *out)
{
    int64_t c = j->g[G_C], ntaps = j->g[G_KH] * j->g[G_KW];
    int32_t acc[CL];
    for (int64_t k = 0; k < nc; k++) acc[k] = j->bias ? j->bias[c0 + k] : 0;
    for (int64_t t = 0; t < ntaps; t++) {
        const uint8_t *p = px[t] + c0;
        const int32_t *w = j->taps + t * c + c0;
        if (j->is_signed)
            for (int64_t k = 0; k < nc; k++) acc[k] += w[k] * ((int32_t)(int8_t)p[k] - j->xz);
        else
            for (int64_t k = 0; k < nc; k++) acc[k] += w[k] * ((int32_t)p[k] - j->xz);
    }
    requant_portable(j, acc, c0, nc, out);
}

#if LAYOUT_AVX512
static inline __m512i widen(const uint8_t *p, __mmask32 k, int64_t is_signed, __m512i z)
{
    __m256i v = _mm256_maskz_loadu_epi8(k, p);
    return _mm512_sub_epi16(is_signed ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v), z);
}

/* One output pixel over the 32 channels of block b (nc of them valid). */
static void pixel_avx512(const dwcl_job *j, const uint8_t *const *px, int64_t b, int64_t nc,
                         uint8_t *out)
{
    int64_t ntaps = j->g[G_KH] * j->g[G_KW], c0 = b * CL;
    __mmask32 k = nc >= CL ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << nc) - 1);
    __m512i z = _mm512_set1_epi16((int16_t)j->xz);
    const int32_t *lb = j->lane_bias + b * 32;
    const int32_t *pr = j->pairs + b * ((ntaps + 1) / 2) * 32;
    __m512i lo = _mm512_loadu_si512((const void *)lb);
    __m512i hi = _mm512_loadu_si512((const void *)(lb + 16));
    for (int64_t t = 0; t < ntaps; t += 2) {
        __m512i a = widen(px[t] + c0, k, j->is_signed, z);
        __m512i c = t + 1 < ntaps ? widen(px[t + 1] + c0, k, j->is_signed, z)
                                  : _mm512_setzero_si512();
        lo = _mm512_dpwssd_epi32(lo, _mm512_unpacklo_epi16(a, c),
                                 _mm512_loadu_si512((const void *)(pr + t * 16)));
        hi = _mm512_dpwssd_epi32(hi, _mm512_unpackhi_epi16(a, c),
                                 _mm512_loadu_si512((const void *)(pr + t * 16 + 16)));
    }
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    __m512i sums[2] = {_mm512_permutex2var_epi64(lo, first, hi),
                       _mm512_permutex2var_epi64(lo, second, hi)};
    __m512d zp = _mm512_set1_pd(j->zp), vlo = _mm512_set1_pd(j->lo), vhi = _mm512_set1_pd(j->hi);
    for (int64_t q = 0; q < nc; q += 8) {
        __mmask8 m = nc - q >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << (nc - q)) - 1);
        __m256i v = q % 16 ? _mm512_extracti64x4_epi64(sums[q / 16], 1)
                           : _mm512_castsi512_si256(sums[q / 16]);
        __m512d t = _mm512_mul_pd(_mm512_cvtepi32_pd(v), _mm512_maskz_loadu_pd(m, j->mult + c0 + q));
        t = _mm512_roundscale_pd(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm512_min_pd(_mm512_max_pd(_mm512_add_pd(t, zp), vlo), vhi);
        _mm256_mask_cvtepi32_storeu_epi8(out + q, m, _mm512_cvtpd_epi32(t));
    }
}

/* The taps in qgemm.c's lane order: lane i of the low accumulator holds channel
 * (i / 4) * 8 + i % 4 of the block, of the high one (i / 4) * 8 + 4 + i % 4; a dword
 * holds tap t's weight in its low half and tap t + 1's in its high half. */
static void arrange_lanes(dwcl_job *j)
{
    int64_t c = j->g[G_C], ntaps = j->g[G_KH] * j->g[G_KW], blocks = (c + CL - 1) / CL;
    int64_t npairs = (ntaps + 1) / 2;
    for (int64_t b = 0; b < blocks; b++)
        for (int half = 0; half < 2; half++)
            for (int i = 0; i < 16; i++) {
                int64_t ch = b * CL + (i / 4) * 8 + 4 * half + i % 4;
                int valid = ch < c;
                j->lane_bias[b * 32 + half * 16 + i] = valid && j->bias ? j->bias[ch] : 0;
                for (int64_t p = 0; p < npairs; p++) {
                    int32_t wa = valid ? j->taps[2 * p * c + ch] : 0;
                    int32_t wb = valid && 2 * p + 1 < ntaps ? j->taps[(2 * p + 1) * c + ch] : 0;
                    j->pairs[((b * npairs + p) * 2 + half) * 16 + i] =
                        (int32_t)((uint32_t)(uint16_t)(int16_t)wa |
                                  (uint32_t)(uint16_t)(int16_t)wb << 16);
                }
            }
}
#endif

/* Tasks: output rows (n, oy); each computes the row's pixels over every channel. */
static void dwcl_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const dwcl_job *j = ctx;
    const int64_t *g = j->g;
    (void)scratch;
    int64_t c = g[G_C], oh = g[G_OH], ow = g[G_OW], kh = g[G_KH], kw = g[G_KW];
    const uint8_t *px[MAX_TAPS];
    for (int64_t t = lo; t < hi; t++) {
        int64_t n = t / oh, oy = t % oh;
        for (int64_t ox = 0; ox < ow; ox++) {
            for (int64_t k = 0; k < kh * kw; k++)
                px[k] = tap_pixel(j, n, oy, ox, k / kw, k % kw);
            uint8_t *out = j->y + ((n * oh + oy) * ow + ox) * c;
            for (int64_t c0 = 0; c0 < c; c0 += CL) {
                int64_t nc = c - c0 < CL ? c - c0 : CL;
#if LAYOUT_AVX512
                pixel_avx512(j, px, c0 / CL, nc, out + c0);
#else
                pixel_portable(j, px, c0, nc, out + c0);
#endif
            }
        }
    }
}

/* A depthwise 2-D convolution (groups = C = M) of the NHWC 8-bit x (is_signed: int8)
 * with zero point xz into the NHWC 8-bit y: geometry = {N, C, H, W, OH, OW, KH, KW, SH,
 * SW, DH, DW, pad top, pad left}; taps[KH * KW][C] the weights less their zero points
 * (int16 range); bias[C] int32 (or NULL); mult[C] the multipliers; quant = {y zero
 * point, lo, hi}. Returns 0, -1 without memory, -2 past MAX_TAPS taps. */
int64_t keel_qdepthwise_nhwc_u8s8(const uint8_t *x, int64_t is_signed, int64_t xz,
                                  const int32_t *taps, const int32_t *bias,
                                  const int64_t *geometry, const double *mult,
                                  const int64_t *quant, uint8_t *y, int64_t parts)
{
    dwcl_job j;
    memcpy(j.g, geometry, sizeof j.g);
    int64_t c = j.g[G_C], ntaps = j.g[G_KH] * j.g[G_KW];
    if (j.g[G_N] <= 0 || j.g[G_OH] <= 0 || j.g[G_OW] <= 0 || c <= 0) return 0;
    if (ntaps > MAX_TAPS) return -2;
    int64_t blocks = (c + CL - 1) / CL, npairs = (ntaps + 1) / 2;
    uint8_t *zero_row = malloc((size_t)(blocks * CL));
    int32_t *lanes = malloc((size_t)(blocks * (npairs + 1) * 32) * sizeof *lanes);
    if (!zero_row || !lanes) {
        free(zero_row), free(lanes);
        return -1;
    }
    memset(zero_row, (int)(uint8_t)xz, (size_t)(blocks * CL));
    j.x = x, j.is_signed = is_signed, j.xz = (int32_t)xz, j.taps = taps, j.bias = bias;
    j.mult = mult, j.zp = (double)quant[0], j.lo = (double)quant[1], j.hi = (double)quant[2];
    j.zero_row = zero_row, j.lane_bias = lanes, j.pairs = lanes + blocks * 32, j.y = y;
#if LAYOUT_AVX512
    arrange_lanes(&j);
#endif
    int64_t rc = run_parts(dwcl_task, &j, j.g[G_N] * j.g[G_OH], parts, 1);
    free(zero_row), free(lanes);
    return rc;
}
