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
 * ((float)acc * mult) + y zero point, lo, hi) with the product in float32 (the
 * multipliers are float32 values held in doubles), as onnxruntime computes it, so the
 * results are the reference kernels' bit for bit. A tap that falls in the padding reads a row of
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

#include "enums.h"
#include "parallel.h"

#if defined(__AVX512BW__) && defined(__AVX512F__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define LAYOUT_AVX512 1
#else
#define LAYOUT_AVX512 0
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

int64_t keel_qlayout_isa(void) { return LAYOUT_AVX512 ? 2 : 0; }

/* ---- layout changes: y[n][cols][rows] = x[n][rows][cols] -------------------------------- */

#define TB 32

typedef struct {
    const uint8_t *x;
    int64_t rows, cols, strips;
    uint8_t *y;
} transpose_job;

#if defined(__SSE2__)
/* out[c][r] = in[r][c] for a 16 x 16 block of bytes: four rounds of interleaving. */
static void transpose16(const uint8_t *in, int64_t ldi, uint8_t *out, int64_t ldo)
{
    __m128i a[16], b[16];
    for (int i = 0; i < 16; i++) a[i] = _mm_loadu_si128((const __m128i *)(const void *)(in + i * ldi));
    for (int i = 0; i < 8; i++) {
        b[2 * i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 2; k++) {
            a[4 * i + k] = _mm_unpacklo_epi16(b[4 * i + k], b[4 * i + k + 2]);
            a[4 * i + k + 2] = _mm_unpackhi_epi16(b[4 * i + k], b[4 * i + k + 2]);
        }
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 4; k++) {
            b[8 * i + k] = _mm_unpacklo_epi32(a[8 * i + k], a[8 * i + k + 4]);
            b[8 * i + k + 4] = _mm_unpackhi_epi32(a[8 * i + k], a[8 * i + k + 4]);
        }
    for (int k = 0; k < 8; k++) {
        a[k] = _mm_unpacklo_epi64(b[k], b[k + 8]);
        a[k + 8] = _mm_unpackhi_epi64(b[k], b[k + 8]);
    }
    /* a[k] now holds columns in the order of the interleavings: undo it */
    static const int order[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    for (int k = 0; k < 16; k++)
        _mm_storeu_si128((__m128i *)(void *)(out + order[k] * ldo), a[k]);
}
#endif

/* out[c][r] = in[r][c] for rows [r0, r1) and columns [c0, c1), a byte at a time. */
static void transpose_bytes(const uint8_t *in, int64_t ldi, uint8_t *out, int64_t ldo, int64_t r0,
                            int64_t r1, int64_t c0, int64_t c1)
{
    for (int64_t c = c0; c < c1; c++)
        for (int64_t r = r0; r < r1; r++) out[c * ldo + r] = in[r * ldi + c];
}

#if defined(__SSE2__)
/* out[c][r] = in[r][c] for rows [0, r16) and columns [0, c16) (multiples of 16), in
 * tiles of TB columns. */
static inline __attribute__((always_inline)) void
transpose_blocks(const uint8_t *in, int64_t ldi, uint8_t *out, int64_t ldo, const int64_t r16,
                 int64_t c16)
{
    for (int64_t c0 = 0; c0 < c16; c0 += TB)
        for (int64_t r = 0; r < r16; r += 16)
            for (int64_t c = c0; c < c0 + TB && c < c16; c += 16)
                transpose16(in + r * ldi + c, ldi, out + c * ldo + r, ldo);
}
#endif

/* A strip of up to TB rows: 16 x 16 blocks where they fit (a strip's last rows as well
 * as whole strips), the rows and columns past them a byte at a time. */
static void transpose_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const transpose_job *j = ctx;
    (void)scratch;
    for (int64_t t = lo; t < hi; t++) {
        int64_t n = t / j->strips, r0 = (t % j->strips) * TB;
        int64_t nr = j->rows - r0 < TB ? j->rows - r0 : TB;
        const uint8_t *src = j->x + (n * j->rows + r0) * j->cols;
        uint8_t *dst = j->y + n * j->rows * j->cols + r0;
        int64_t r16 = 0, c16 = 0;
#if defined(__SSE2__)
        r16 = nr / 16 * 16, c16 = j->cols / 16 * 16;
        if (r16 == TB)      /* the whole strip's rows: their count a constant */
            transpose_blocks(src, j->cols, dst, j->rows, TB, c16);
        else
            transpose_blocks(src, j->cols, dst, j->rows, r16, c16);
#endif
        transpose_bytes(src, j->cols, dst, j->rows, 0, r16, c16, j->cols);
        transpose_bytes(src, j->cols, dst, j->rows, r16, nr, 0, j->cols);
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
/* The quant array of the depthwise, panel and indirect kernels: {y zero point, lo, hi}. */
enum { QL_YZP, QL_LO, QL_HI, QL_LEN };

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
    int64_t wp;                /* AVX-512: a widened row's pixels, padding included */
    int64_t hp;                /* AVX-512: a widened plane's rows, padding included */
    int64_t planes;            /* tasks are (image, channel block) planes, not rows */
    int32_t *pairs;            /* AVX-512: [blocks][taps / 2][2][16], lane order */
    int32_t *lane_bias;        /* AVX-512: [blocks][2][16] */
    double *lane_mult;         /* AVX-512: [blocks][2][16], the multipliers in lane order */
    uint8_t *y;
} dwcl_job;

/* The input pixel under tap (ky, kx) of output (oy, ox), or the padding's zero row. */
static const uint8_t *pixel_at(const int64_t *g, const uint8_t *x, const uint8_t *zero_row,
                               int64_t n, int64_t oy, int64_t ox, int64_t ky, int64_t kx)
{
    int64_t iy = oy * g[G_SH] + ky * g[G_DH] - g[G_PT];
    int64_t ix = ox * g[G_SW] + kx * g[G_DW] - g[G_PL];
    if (iy < 0 || iy >= g[G_H] || ix < 0 || ix >= g[G_W]) return zero_row;
    return x + ((n * g[G_H] + iy) * g[G_W] + ix) * g[G_C];
}

static const uint8_t *tap_pixel(const dwcl_job *j, int64_t n, int64_t oy, int64_t ox,
                                int64_t ky, int64_t kx)
{
    return pixel_at(j->g, j->x, j->zero_row, n, oy, ox, ky, kx);
}

static void requant_portable(const dwcl_job *j, const int32_t *acc, int64_t c0, int64_t nc,
                             uint8_t *out)
{
    for (int64_t k = 0; k < nc; k++) {
        float t = nearbyintf((float)acc[k] * (float)j->mult[c0 + k]) + (float)j->zp;
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
/* One padded input row as int16 (x - zero point), [wp][cw] for channels c0 .. c0 + cw
 * (cw a multiple of 32): zeros for the padding columns, for channels past C, and for the
 * whole row where src (the input row, NHWC) is NULL, a row in the padding. */
static void widen_padded_row(const dwcl_job *j, const uint8_t *src, int64_t c0, int64_t cw,
                             int16_t *row)
{
    const int64_t *g = j->g;
    int64_t c = g[G_C], wp = j->wp, pl = g[G_PL];
    if (!src) {
        memset(row, 0, (size_t)(wp * cw) * sizeof *row);
        return;
    }
    memset(row, 0, (size_t)(pl * cw) * sizeof *row);
    memset(row + (pl + g[G_W]) * cw, 0, (size_t)((wp - pl - g[G_W]) * cw) * sizeof *row);
    __m512i z = _mm512_set1_epi16((int16_t)j->xz);
    for (int64_t ix = 0; ix < g[G_W]; ix++) {
        int16_t *dst = row + (pl + ix) * cw;
        for (int64_t cc = 0; cc < cw; cc += CL) {
            int64_t left = c - c0 - cc;
            __mmask32 k = left >= CL ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
            __m256i v = _mm256_maskz_loadu_epi8(k, src + ix * c + c0 + cc);
            __m512i wide = j->is_signed ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v);
            _mm512_storeu_si512((void *)(dst + cc), _mm512_maskz_sub_epi16(k, wide, z));
        }
    }
}

/* The kh input rows under output row oy of image n, each [wp][cp] (cp: C rounded up to
 * 32), as widen_padded_row gives them. */
static void widen_rows(const dwcl_job *j, int64_t n, int64_t oy, int16_t *rows)
{
    const int64_t *g = j->g;
    int64_t c = g[G_C], cp = (c + CL - 1) / CL * CL, wp = j->wp;
    for (int64_t ky = 0; ky < g[G_KH]; ky++) {
        int64_t iy = oy * g[G_SH] + ky * g[G_DH] - g[G_PT];
        const uint8_t *src = iy < 0 || iy >= g[G_H] ? NULL : j->x + (n * g[G_H] + iy) * g[G_W] * c;
        widen_padded_row(j, src, 0, cp, rows + ky * wp * cp);
    }
}

/* 16 multipliers (float32 values held in doubles) as floats. */
static inline __m512 floats16(const double *p)
{
    __m256 a = _mm512_cvtpd_ps(_mm512_loadu_pd(p)), b = _mm512_cvtpd_ps(_mm512_loadu_pd(p + 8));
    return _mm512_castsi512_ps(_mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_castps_si256(a)), _mm256_castps_si256(b), 1));
}

/* A block's two accumulators (vlo: channel groups of four 0, 2, 4, 6; vhi: 1, 3, 5, 7)
 * requantized into its 32 bytes in channel order: times the lane-ordered multipliers in
 * float, clamped above to hi - zero point (a whole number, so before the rounding as
 * after it; nothing then overflows the conversion, and an underflow converts to INT_MIN),
 * rounded half to even by the conversion, packed to int16 with saturation, plus the zero
 * point and clamped below to lo (saturating, so nothing wraps), packed to bytes (within
 * their range by then) and the groups put back in order. */
static inline __m256i requant32(__m512i vlo, __m512i vhi, const __m512 *m, __m512 hi,
                                __m256i zp16, __m256i lo16, int is_signed_out)
{
    __m512i w[2];
    const __m512i acc[2] = {vlo, vhi};
    for (int h = 0; h < 2; h++)
        w[h] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[h]), m[h]),
                                                hi));
    const __m256i r[4] = {_mm512_castsi512_si256(w[0]), _mm512_extracti64x4_epi64(w[0], 1),
                          _mm512_castsi512_si256(w[1]), _mm512_extracti64x4_epi64(w[1], 1)};
    /* r: groups (0, 2), (4, 6), (1, 3), (5, 7); packed per 128-bit lane */
    __m256i p0 = _mm256_max_epi16(_mm256_adds_epi16(_mm256_packs_epi32(r[0], r[2]), zp16), lo16);
    __m256i p1 = _mm256_max_epi16(_mm256_adds_epi16(_mm256_packs_epi32(r[1], r[3]), zp16), lo16);
    __m256i b = is_signed_out ? _mm256_packs_epi16(p0, p1) : _mm256_packus_epi16(p0, p1);
    return _mm256_permute4x64_epi64(b, 0xD8);   /* (0 1)(4 5)(2 3)(6 7) -> (0 1)(2 3)(4 5)(6 7) */
}

/* Two sets of accumulators (a: low and high of one pixel or row, b: of another)
 * requantized as requant32 does it, on 512-bit vectors, and packed to bytes: 128-bit
 * lane L then holds a's lane L as 8 bytes, then b's. requant_pair (two depthwise pixels,
 * lane-ordered) puts A's 32 channels then B's in order: qwords 2L (A) and 2L + 1 (B);
 * half the packs of requant32 and one permute for both pixels, the same bytes. */
static inline __m512i requant_packed(const __m512i *a, const __m512i *b, const __m512 *m,
                                     __m512 hi, __m512i zp16, __m512i lo16, int is_signed_out)
{
    __m512i w[4];
    const __m512i acc[4] = {a[0], a[1], b[0], b[1]};
    for (int h = 0; h < 4; h++)
        w[h] = _mm512_cvtps_epi32(
            _mm512_min_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[h]), m[h & 1]), hi));
    __m512i pa = _mm512_max_epi16(_mm512_adds_epi16(_mm512_packs_epi32(w[0], w[1]), zp16), lo16);
    __m512i pb = _mm512_max_epi16(_mm512_adds_epi16(_mm512_packs_epi32(w[2], w[3]), zp16), lo16);
    return is_signed_out ? _mm512_packs_epi16(pa, pb) : _mm512_packus_epi16(pa, pb);
}

static inline __m512i requant_pair(const __m512i *a, const __m512i *b, const __m512 *m,
                                   __m512 hi, __m512i zp16, __m512i lo16, int is_signed_out)
{
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                    requant_packed(a, b, m, hi, zp16, lo16, is_signed_out));
}

/* A block's 32 requantized bytes at o: whole, or the first nc through a buffer. */
static inline void store_block(uint8_t *o, __m256i bytes, int64_t nc)
{
    if (nc == CL) {
        _mm256_storeu_si256((__m256i *)(void *)o, bytes);
        return;
    }
    uint8_t tail[CL];     /* a partial block through a buffer, as pw_tile's */
    _mm256_storeu_si256((__m256i *)(void *)tail, bytes);
    memcpy(o, tail, (size_t)nc);
}

/* A view of widened int16 input for the kernel below: element (row r, tap row ky,
 * column x) of a block's channel c0 lies at src + r * ostep + ky * rstride + x * ld. */
typedef struct {
    const int16_t *src;
    int64_t ld, rstride, ostep, rows;
    uint8_t *out;
    int64_t out_row;           /* bytes between output rows */
} dw_view;

/* Output rows of the view over the 32 channels of block b: the block's tap pairs, bias
 * and multipliers held in registers across the rows (ntaps a constant where inlined).
 * Everything the loop reads is copied to locals first: the byte stores may alias it. */
static inline void block_avx512(const dwcl_job *j, const dw_view *v, int64_t b,
                                const int64_t ntaps)
{
    const int64_t *g = j->g;
    const int64_t npairs = (ntaps + 1) / 2;
    const int64_t c = g[G_C], c0 = b * CL, kw = g[G_KW], ow = g[G_OW], rows = v->rows;
    const int64_t nc = c - c0 < CL ? c - c0 : CL, step = g[G_SW] * v->ld, ostep = v->ostep;
    const int64_t out_row = v->out_row;
    uint8_t *const out = v->out + c0;
    __m512i pairs[MAX_TAPS];
    const int16_t *base[MAX_TAPS + 1];
    const int32_t *pr = j->pairs + b * npairs * 32;
    for (int64_t p = 0; p < 2 * npairs; p++)
        pairs[p] = _mm512_loadu_si512((const void *)(pr + p * 16));
    for (int64_t t = 0; t < 2 * npairs; t++)
        base[t] = t < ntaps ? v->src + (t / kw) * v->rstride + (t % kw) * g[G_DW] * v->ld
                            : NULL;
    const __m512 mult[2] = {floats16(j->lane_mult + b * 32), floats16(j->lane_mult + b * 32 + 16)};
    const __m512i blo = _mm512_loadu_si512((const void *)(j->lane_bias + b * 32));
    const __m512i bhi = _mm512_loadu_si512((const void *)(j->lane_bias + b * 32 + 16));
    const __m512 hi = _mm512_set1_ps((float)(j->hi - j->zp));
    const __m256i zp16 = _mm256_set1_epi16((int16_t)j->zp);
    const __m256i lo16 = _mm256_set1_epi16((int16_t)j->lo);
    const __m512i zp16x2 = _mm512_set1_epi16((int16_t)j->zp);
    const __m512i lo16x2 = _mm512_set1_epi16((int16_t)j->lo);
    const int is_signed_out = j->lo < 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t ox = 0;
        /* two pixels at a time: four independent sums, one requantization for both */
        for (; ox + 2 <= ow; ox += 2) {
            __m512i va[2] = {blo, bhi}, vb[2] = {blo, bhi};
            const int64_t at = r * ostep + ox * step;
            for (int64_t p = 0; p < npairs; p++) {
                const int odd = 2 * p + 1 < ntaps;
                __m512i a = _mm512_loadu_si512((const void *)(base[2 * p] + at));
                __m512i e = odd ? _mm512_loadu_si512((const void *)(base[2 * p + 1] + at))
                                : _mm512_setzero_si512();
                __m512i a2 = _mm512_loadu_si512((const void *)(base[2 * p] + at + step));
                __m512i e2 = odd ? _mm512_loadu_si512((const void *)(base[2 * p + 1] + at + step))
                                 : _mm512_setzero_si512();
                va[0] = _mm512_dpwssd_epi32(va[0], _mm512_unpacklo_epi16(a, e), pairs[2 * p]);
                va[1] = _mm512_dpwssd_epi32(va[1], _mm512_unpackhi_epi16(a, e), pairs[2 * p + 1]);
                vb[0] = _mm512_dpwssd_epi32(vb[0], _mm512_unpacklo_epi16(a2, e2), pairs[2 * p]);
                vb[1] = _mm512_dpwssd_epi32(vb[1], _mm512_unpackhi_epi16(a2, e2),
                                            pairs[2 * p + 1]);
            }
            uint8_t *o = out + r * out_row + ox * c;
            __m512i bytes = requant_pair(va, vb, mult, hi, zp16x2, lo16x2, is_signed_out);
            store_block(o, _mm512_castsi512_si256(bytes), nc);
            store_block(o + c, _mm512_extracti64x4_epi64(bytes, 1), nc);
        }
        for (; ox < ow; ox++) {
            __m512i vlo = blo, vhi = bhi;
            const int64_t at = r * ostep + ox * step;
            for (int64_t p = 0; p < npairs; p++) {
                __m512i a = _mm512_loadu_si512((const void *)(base[2 * p] + at));
                __m512i e = 2 * p + 1 < ntaps
                    ? _mm512_loadu_si512((const void *)(base[2 * p + 1] + at))
                    : _mm512_setzero_si512();
                vlo = _mm512_dpwssd_epi32(vlo, _mm512_unpacklo_epi16(a, e), pairs[2 * p]);
                vhi = _mm512_dpwssd_epi32(vhi, _mm512_unpackhi_epi16(a, e), pairs[2 * p + 1]);
            }
            store_block(out + r * out_row + ox * c,
                        requant32(vlo, vhi, mult, hi, zp16, lo16, is_signed_out), nc);
        }
    }
}

/* block_avx512 with a 3x3 kernel's nine taps a constant (its pairs then stay in
 * registers and its loop unrolls), any other count as it comes. */
static void block_any_avx512(const dwcl_job *j, const dw_view *v, int64_t b)
{
    int64_t ntaps = j->g[G_KH] * j->g[G_KW];
    if (ntaps == 9)
        block_avx512(j, v, b, 9);
    else
        block_avx512(j, v, b, ntaps);
}

/* Image n's input under block b's 32 channels, [hp][wp][32] from input row -pad top, as
 * widen_padded_row gives its rows. */
static void widen_plane(const dwcl_job *j, int64_t n, int64_t b, int16_t *plane)
{
    const int64_t *g = j->g;
    int64_t c = g[G_C], wp = j->wp;
    for (int64_t r = 0; r < j->hp; r++) {
        int64_t iy = r - g[G_PT];
        const uint8_t *src = iy < 0 || iy >= g[G_H] ? NULL : j->x + (n * g[G_H] + iy) * g[G_W] * c;
        widen_padded_row(j, src, b * CL, CL, plane + r * wp * CL);
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
                j->lane_mult[b * 32 + half * 16 + i] = valid ? j->mult[ch] : 0.0;
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

/* Tasks: output rows (n, oy), each over every channel; or, with planes, (image n,
 * channel block b), each widening the block's input plane once and computing all its
 * output pixels with the block's taps held in registers. */
static void dwcl_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const dwcl_job *j = ctx;
    const int64_t *g = j->g;
    int64_t c = g[G_C], oh = g[G_OH], ow = g[G_OW], kh = g[G_KH], kw = g[G_KW];
    int64_t blocks = (c + CL - 1) / CL;
    const uint8_t *px[MAX_TAPS];
    (void)scratch, (void)blocks;
    for (int64_t t = lo; t < hi; t++) {
        int64_t n = t / oh, oy = t % oh;
#if LAYOUT_AVX512
        int16_t *wide = (int16_t *)(void *)scratch;
        if (j->planes) {
            int64_t image = t / blocks, b = t % blocks;
            widen_plane(j, image, b, wide);
            dw_view v = {wide, CL, g[G_DH] * j->wp * CL, g[G_SH] * j->wp * CL, oh,
                         j->y + image * oh * ow * c, ow * c};
            block_any_avx512(j, &v, b);
            continue;
        }
        int64_t cp = blocks * CL;
        widen_rows(j, n, oy, wide);
        for (int64_t b = 0; b < blocks; b++) {
            dw_view v = {wide + b * CL, cp, j->wp * cp, 0, 1, j->y + (n * oh + oy) * ow * c, 0};
            block_any_avx512(j, &v, b);
        }
        (void)px, (void)kh, (void)kw;
        continue;
#endif
        for (int64_t ox = 0; ox < ow; ox++) {
            for (int64_t k = 0; k < kh * kw; k++)
                px[k] = tap_pixel(j, n, oy, ox, k / kw, k % kw);
            uint8_t *out = j->y + ((n * oh + oy) * ow + ox) * c;
            for (int64_t c0 = 0; c0 < c; c0 += CL)
                pixel_portable(j, px, c0, c - c0 < CL ? c - c0 : CL, out + c0);
        }
    }
}

/* A depthwise 2-D convolution (groups = C = M) of the NHWC 8-bit x (is_signed: int8)
 * with zero point xz into the NHWC 8-bit y: geometry = {N, C, H, W, OH, OW, KH, KW, SH,
 * SW, DH, DW, pad top, pad left}; taps[KH * KW][C] the weights less their zero points
 * (int16 range); bias[C] int32 (or NULL); mult[C] the multipliers; quant = {y zero
 * point, lo, hi}; planes: split the work into (image, 32-channel block) planes, not
 * output rows (where the AVX-512 path runs; parts then counts planes). Returns 0, -1
 * without memory, -2 past MAX_TAPS taps. */
int64_t keel_qdepthwise_nhwc_u8s8(const uint8_t *x, int64_t is_signed, int64_t xz,
                                  const int32_t *taps, const int32_t *bias,
                                  const int64_t *geometry, const double *mult,
                                  const int64_t *quant, uint8_t *y, int64_t planes,
                                  int64_t parts)
{
    dwcl_job j;
    memcpy(j.g, geometry, sizeof j.g);
    int64_t c = j.g[G_C], ntaps = j.g[G_KH] * j.g[G_KW];
    if (j.g[G_N] <= 0 || j.g[G_OH] <= 0 || j.g[G_OW] <= 0 || c <= 0) return 0;
    if (ntaps > MAX_TAPS) return -2;
    int64_t blocks = (c + CL - 1) / CL, npairs = (ntaps + 1) / 2;
    uint8_t *zero_row = malloc((size_t)(blocks * CL));
    int32_t *lanes = malloc((size_t)(blocks * (npairs + 1) * 32) * sizeof *lanes);
    double *lane_mult = malloc((size_t)(blocks * 32) * sizeof *lane_mult);
    if (!zero_row || !lanes || !lane_mult) {
        free(zero_row), free(lanes), free(lane_mult);
        return -1;
    }
    memset(zero_row, (int)(uint8_t)xz, (size_t)(blocks * CL));
    j.x = x, j.is_signed = is_signed, j.xz = (int32_t)xz, j.taps = taps, j.bias = bias;
    j.mult = mult, j.zp = (double)quant[QL_YZP], j.lo = (double)quant[QL_LO],
    j.hi = (double)quant[QL_HI];
    j.zero_row = zero_row, j.lane_bias = lanes, j.pairs = lanes + blocks * 32, j.y = y;
    j.lane_mult = lane_mult;
    int64_t scratch = 1, tasks = j.g[G_N] * j.g[G_OH];
    j.planes = 0;
    (void)planes;
#if LAYOUT_AVX512
    arrange_lanes(&j);
    j.wp = (j.g[G_OW] - 1) * j.g[G_SW] + (j.g[G_KW] - 1) * j.g[G_DW] + 1;
    if (j.wp < j.g[G_W] + j.g[G_PL]) j.wp = j.g[G_W] + j.g[G_PL];
    j.hp = (j.g[G_OH] - 1) * j.g[G_SH] + (j.g[G_KH] - 1) * j.g[G_DH] + 1;
    j.planes = planes != 0;
    scratch = j.planes ? (j.hp * j.wp * CL + 1) / 2 : (j.g[G_KH] * j.wp * blocks * CL + 1) / 2;
    if (j.planes) tasks = j.g[G_N] * blocks;
#endif
    int64_t rc = run_parts(dwcl_task, &j, tasks, parts, scratch);
    free(zero_row), free(lanes), free(lane_mult);
    return rc;
}

/* ---- pointwise convolution: Y[P][M] = X[P][C] . W[C][M], NHWC in and out ----------------
 *
 * One matrix product over every pixel (P = N * H * W rows), the weights packed as
 * [M / 32][C / 4][32][4] int8 (M and C padded with zeros; symmetric weights: their zero
 * points are 0), so that one vpdpbusd takes a pixel's four channels (broadcast) against 16
 * output channels. A tile is MR pixels by 32 output channels in 2 * MR accumulators;
 * the store adds the bias (less x's zero point times the weights' column sums, folded by
 * the caller), requantizes with each channel's multiplier as the depthwise kernel does and
 * writes the tile's bytes. Signed x is made unsigned by flipping its top bit (the caller
 * shifts its zero point by 128). */

#define MR 12
#define NT 32

typedef struct {
    const uint8_t *x;
    int64_t p, c, m, cq, flip;
    const int8_t *w;
    const int32_t *bias;       /* [M padded to 32]: bias - x zero point * column sums */
    const double *mult;        /* [M padded to 32] */
    double zp, lo, hi;
    uint8_t *y;
} pw_job;

/* Four channels [4q, 4q + 4) of a pixel row as one dword (zeros past C), top bits flipped
 * for signed x. */
static inline int32_t pw_quad(const pw_job *j, const uint8_t *row, int64_t q)
{
    uint32_t v = 0;
    int64_t left = j->c - 4 * q;
    memcpy(&v, row + 4 * q, (size_t)(left < 4 ? left : 4));
    return (int32_t)(v ^ (uint32_t)(j->flip ? 0x80808080u : 0u));
}

static void pw_store_portable(const pw_job *j, const int32_t *acc, int64_t col0, int64_t ncols,
                              uint8_t *out)
{
    for (int64_t k = 0; k < ncols; k++) {
        float t = nearbyintf((float)(acc[k] + j->bias[col0 + k]) * (float)j->mult[col0 + k]) +
                  (float)j->zp;
        out[k] = (uint8_t)(int32_t)(t < j->lo ? j->lo : t > j->hi ? j->hi : t);
    }
}

#if LAYOUT_AVX512
static inline uint32_t load32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Two rows' accumulators (a: channels 0-15 and 16-31 of row A; b: of row B, already
 * holding the bias) requantized into 64 bytes, row A's 32 then row B's, in channel
 * order, as requant32 does it: times the multipliers in float, clamped above to
 * hi - zero point, rounded half to even by the conversion, packed to int16 with
 * saturation, plus the zero point and clamped below to lo (saturating), packed to bytes
 * and the dwords (four channels each) put back in order: the same bytes as narrowing
 * each 16 lanes on their own, in fewer instructions. */
static inline __m512i requant_rows(const __m512i *a, const __m512i *b, const __m512 *m,
                                   __m512 hi, __m512i zp16, __m512i lo16, int is_signed_out)
{
    __m512i bytes = requant_packed(a, b, m, hi, zp16, lo16, is_signed_out);
    /* 128-bit lane L holds dwords: A's channels 4L.., A's 16 + 4L.., B's 4L.., B's 16 + 4L.. */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_epi32(order, bytes);
}

/* Row i's `width` bytes of a tile (bytes: its 32 requantized channels) stored at out.
 * Where the block is the only one (M <= 32) a whole 32-byte store may run into the
 * rows after row i, which this tile writes next, so it is taken wherever it ends within
 * the tile's own rows; otherwise a partial block goes through a buffer (masked stores
 * are slow on some cores). */
static inline void pw_store_row(const pw_job *j, __m256i bytes, int64_t i, int64_t ncols,
                                int only_block, uint8_t *out)
{
    if (ncols == NT || (only_block && i * j->m + NT <= MR * j->m)) {
        _mm256_storeu_si256((__m256i *)(void *)out, bytes);
        return;
    }
    uint8_t tail[NT];
    _mm256_storeu_si256((__m256i *)(void *)tail, bytes);
    memcpy(out, tail, (size_t)ncols);
}

/* A tile's MR rows of accumulators (acc[i]: row i's channels col0 .. col0 + 31, the bias
 * added) requantized two rows at a time and stored: row i's ncols bytes at out + i * M
 * (out: row 0's column col0). The pointwise panels' and the indirect product's store. */
static inline __attribute__((always_inline)) void
pw_store_tile(const pw_job *j, const __m512i acc[MR][2], int64_t col0, int64_t ncols,
              uint8_t *out)
{
    const __m512 m[2] = {floats16(j->mult + col0), floats16(j->mult + col0 + 16)};
    const __m512 hi = _mm512_set1_ps((float)(j->hi - j->zp));
    const __m512i zp16 = _mm512_set1_epi16((int16_t)j->zp);
    const __m512i lo16 = _mm512_set1_epi16((int16_t)j->lo);
    const int is_signed_out = j->lo < 0, only_block = col0 == 0 && ncols == j->m;
    for (int i = 0; i < MR; i += 2) {
        __m512i bytes = requant_rows(acc[i], acc[i + 1], m, hi, zp16, lo16, is_signed_out);
        pw_store_row(j, _mm512_castsi512_si256(bytes), i, ncols, only_block, out + i * j->m);
        pw_store_row(j, _mm512_extracti64x4_epi64(bytes, 1), i + 1, ncols, only_block,
                     out + (i + 1) * j->m);
    }
}

/* Rows [r0, r0 + MR) (all within x) by the NT channels of block b; halves = 1 where the
 * block holds at most 16 channels (only the low accumulators are computed). */
static inline __attribute__((always_inline)) void pw_tile_halves(const pw_job *j, int64_t r0, int64_t b, const int halves)
{
    const int64_t col0 = b * NT, ncols = j->m - col0 < NT ? j->m - col0 : NT;
    const __m512i b0 = _mm512_loadu_si512((const void *)(j->bias + col0));
    const __m512i b1 = _mm512_loadu_si512((const void *)(j->bias + col0 + 16));
    /* named accumulators, so that they stay in registers across the depth; they start
     * at the bias (the same int32 sums, added first) */
#define PW_INIT(i) __m512i a##i##0 = b0, a##i##1 = b1
#define PW_ROW(i, quad) do { \
        __m512i v = _mm512_set1_epi32(quad); \
        a##i##0 = _mm512_dpbusd_epi32(a##i##0, v, w0); \
        if (halves == 2) a##i##1 = _mm512_dpbusd_epi32(a##i##1, v, w1); \
    } while (0)
#define PW_ROWS(quad) do { \
        PW_ROW(0, quad(0)); PW_ROW(1, quad(1)); PW_ROW(2, quad(2)); PW_ROW(3, quad(3)); \
        PW_ROW(4, quad(4)); PW_ROW(5, quad(5)); PW_ROW(6, quad(6)); PW_ROW(7, quad(7)); \
        PW_ROW(8, quad(8)); PW_ROW(9, quad(9)); PW_ROW(10, quad(10)); PW_ROW(11, quad(11)); \
    } while (0)
#define PW_WEIGHTS(q) \
    __m512i w0 = _mm512_loadu_si512((const void *)(w + (q) * NT * 4)); \
    __m512i w1 = halves == 2 ? _mm512_loadu_si512((const void *)(w + (q) * NT * 4 + 64)) : w0
    PW_INIT(0); PW_INIT(1); PW_INIT(2); PW_INIT(3); PW_INIT(4); PW_INIT(5);
    PW_INIT(6); PW_INIT(7); PW_INIT(8); PW_INIT(9); PW_INIT(10); PW_INIT(11);
    const int8_t *w = j->w + b * j->cq * NT * 4;
    const uint8_t *x = j->x + r0 * j->c;
    int64_t c = j->c, full = c / 4;
    if (j->flip) {
        for (int64_t q = 0; q < full; q++) {
            PW_WEIGHTS(q);
            const uint8_t *xq = x + 4 * q;
#define PW_FLIPPED(i) ((int32_t)(load32(xq + (i) * c) ^ 0x80808080u))
            PW_ROWS(PW_FLIPPED);
#undef PW_FLIPPED
        }
    } else {
        /* unsigned x: each broadcast a load the product can take as its operand */
        for (int64_t q = 0; q < full; q++) {
            PW_WEIGHTS(q);
            const uint8_t *xq = x + 4 * q;
#define PW_LOADED(i) ((int32_t)load32(xq + (i) * c))
            PW_ROWS(PW_LOADED);
#undef PW_LOADED
        }
    }
    for (int64_t q = full; q < j->cq; q++) {
        PW_WEIGHTS(q);
#define PW_TAIL(i) pw_quad(j, x + (i) * c, q)
        PW_ROWS(PW_TAIL);
#undef PW_TAIL
    }
    const __m512i acc[MR][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41},
                                {a50, a51}, {a60, a61}, {a70, a71}, {a80, a81}, {a90, a91},
                                {a100, a101}, {a110, a111}};
#undef PW_WEIGHTS
#undef PW_ROWS
#undef PW_ROW
#undef PW_INIT
    pw_store_tile(j, acc, col0, ncols, j->y + r0 * j->m + col0);
}

/* pw_tile_halves with the block's width a constant: the products of the high half
 * skipped where the block holds at most 16 channels. */
static void pw_tile(const pw_job *j, int64_t r0, int64_t b)
{
    if (j->m - b * NT <= 16)
        pw_tile_halves(j, r0, b, 1);
    else
        pw_tile_halves(j, r0, b, 2);
}
#endif

/* Rows [r0, r0 + rows) by block b, one row at a time (the portable path, and the rows
 * past the last whole tile). */
static void pw_rows(const pw_job *j, int64_t r0, int64_t rows, int64_t b)
{
    int64_t col0 = b * NT, ncols = j->m - col0 < NT ? j->m - col0 : NT;
    const int8_t *w = j->w + b * j->cq * NT * 4;
    for (int64_t r = r0; r < r0 + rows; r++) {
        int32_t acc[NT] = {0};
        for (int64_t q = 0; q < j->cq; q++) {
            uint32_t v = (uint32_t)pw_quad(j, j->x + r * j->c, q);
            for (int64_t k = 0; k < ncols; k++)
                for (int e = 0; e < 4; e++)
                    acc[k] += (int32_t)((v >> (8 * e)) & 0xFFu) * w[(q * NT + k) * 4 + e];
        }
        pw_store_portable(j, acc, col0, ncols, j->y + r * j->m + col0);
    }
}

/* Tile t's pixel rows asked into cache (where t is one of this chunk's, before `end`),
 * PREFETCH_TILES tiles ahead of the one computing: a tile reads its rows four bytes at a
 * time across all of them, which the hardware's prefetchers follow too late where x
 * comes from memory (MobileNetV2's 96 -> 24 channel 1x1 layer at 56x56, batch 32, one
 * thread, in the model: 1.32 ms without, 0.93 ms with, measured under load). */
#define PREFETCH_TILES 2

static inline void pw_prefetch(const pw_job *j, int64_t t, int64_t end)
{
#if defined(__SSE2__)
    if (t >= end) return;
    int64_t from = t * MR * j->c, to = (t + 1) * MR * j->c;
    if (to > j->p * j->c) to = j->p * j->c;
    for (int64_t at = from; at < to; at += 64) _mm_prefetch((const char *)(j->x + at), _MM_HINT_T0);
#else
    (void)j, (void)t, (void)end;
#endif
}

#if LAYOUT_AVX512
/* The last `rows` (< MR) pixel rows from r0 as a whole tile: copied into MR rows (the
 * rest zeros), computed by pw_tile into a tile of outputs, their valid rows copied out.
 * A row-at-a-time C loop took them before: at 7x7, batch 32 (1568 pixels, 8 past the
 * last whole tile) a 160 -> 960 layer ran 1.29x the time per image of batch 24 (whole
 * tiles only), measured under load. Returns -1 where no buffer could be had (the
 * caller then takes the rows one at a time). */
static int pw_last_tile(const pw_job *j, int64_t r0, int64_t rows, int64_t blocks)
{
    uint8_t *xb = calloc((size_t)(MR * j->c + MR * j->m + NT), 1);
    if (!xb) return -1;
    uint8_t *yb = xb + MR * j->c;
    memcpy(xb, j->x + r0 * j->c, (size_t)(rows * j->c));
    pw_job jt = *j;
    jt.x = xb, jt.p = MR, jt.y = yb;
    for (int64_t b = 0; b < blocks; b++) pw_tile(&jt, 0, b);
    memcpy(j->y + r0 * j->m, yb, (size_t)(rows * j->m));
    free(xb);
    return 0;
}
#endif

static void pw_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const pw_job *j = ctx;
    (void)scratch;
    int64_t blocks = (j->m + NT - 1) / NT;
    for (int64_t t = lo; t < hi; t++) {
        int64_t r0 = t * MR, rows = j->p - r0 < MR ? j->p - r0 : MR;
        pw_prefetch(j, t + PREFETCH_TILES, hi);
#if LAYOUT_AVX512
        if (rows < MR && pw_last_tile(j, r0, rows, blocks) == 0) continue;
#endif
        for (int64_t b = 0; b < blocks; b++) {
#if LAYOUT_AVX512
            if (rows == MR) {
                pw_tile(j, r0, b);
                continue;
            }
#endif
            pw_rows(j, r0, rows, b);
        }
    }
}

/* y[P][M] (8-bit, NHWC) = the requantized product of the NHWC 8-bit x[P][C] (is_signed:
 * int8) and the packed weights w ([M/32][C/4][32][4], zero points 0); bias[M padded to 32]
 * int32 with x's zero point folded in (x's zero point + 128 for signed x); mult[M padded to
 * 32]; quant = {y zero point, lo, hi}. Tasks: tiles of MR pixels. */
int64_t keel_qpointwise_nhwc_u8s8(const uint8_t *x, int64_t is_signed, int64_t p, int64_t c,
                                  int64_t m, const int8_t *w, const int32_t *bias,
                                  const double *mult, const int64_t *quant, uint8_t *y,
                                  int64_t parts)
{
    if (p <= 0 || m <= 0) return 0;
    pw_job j = {x, p, c, m, (c + 3) / 4, is_signed, w, bias, mult, (double)quant[QL_YZP],
                (double)quant[QL_LO], (double)quant[QL_HI], y};
    return run_parts(pw_task, &j, (p + MR - 1) / MR, parts, 1);
}

/* ---- dense convolution, NHWC in and out: an indirect product ------------------------------
 * A convolution with one group is the product of each output pixel's taps x C input
 * bytes with the weights [M/32][taps * C/4][32][4] (k = tap * C + channel, zero points
 * 0), on the pointwise panels' tile: MR output pixels by 32 output channels in
 * registers. Nothing is copied: a tile first lists, for every tap, the address of each of
 * its pixels' input rows (the C channel bytes of the pixel under that tap, read in place
 * from the NHWC x, or a row of x's zero point where the tap falls in the padding, which
 * the bias's fold of x's zero point cancels), then reads four channels of each row per
 * broadcast. Only real output pixels are computed; C is a multiple of 4. */

typedef struct {
    pw_job pw;                 /* x unused; p = N * OH * OW; c = C; cq = taps * C / 4 */
    int64_t g[G_SIZE];
    int64_t ntaps;
    const uint8_t *x;
    const int32_t *offsets;    /* [OH * OW][taps]: the input row's offset in its image, or -1 */
    const uint8_t *zero_row;   /* C bytes of x's zero point */
} ic_job;

/* rows[t * MR + i]: tile pixel i's input row under tap t (pixels past P: the zero row). */
static void ic_rows(const ic_job *j, int64_t r0, const uint8_t **rows)
{
    const int64_t *g = j->g, ntaps = j->ntaps;
    const int64_t plane = g[G_OH] * g[G_OW], image = g[G_H] * g[G_W] * g[G_C];
    int64_t n = r0 / plane, pix = r0 % plane;
    for (int64_t i = 0; i < MR; i++) {
        if (r0 + i >= j->pw.p) {
            for (int64_t t = 0; t < ntaps; t++) rows[t * MR + i] = j->zero_row;
            continue;
        }
        const uint8_t *base = j->x + n * image;
        const int32_t *o = j->offsets + pix * ntaps;
        for (int64_t t = 0; t < ntaps; t++) rows[t * MR + i] = o[t] < 0 ? j->zero_row : base + o[t];
        if (++pix == plane) pix = 0, n++;
    }
}

/* One pixel's outputs of block b (the portable path): plain int32 sums. */
static void ic_pixel(const ic_job *j, const uint8_t *const *rows, int64_t i, int64_t b,
                     uint8_t *out)
{
    const pw_job *pw = &j->pw;
    int64_t col0 = b * NT, ncols = pw->m - col0 < NT ? pw->m - col0 : NT, cq = pw->c / 4;
    const int8_t *w = pw->w + b * pw->cq * NT * 4;
    int32_t acc[NT] = {0};
    for (int64_t t = 0; t < j->ntaps; t++) {
        const uint8_t *row = rows[t * MR + i];
        for (int64_t q = 0; q < cq; q++) {
            const int8_t *wq = w + (t * cq + q) * NT * 4;
            for (int e = 0; e < 4; e++) {
                int32_t v = (int32_t)(row[4 * q + e] ^ (pw->flip ? 0x80u : 0u));
                for (int64_t k = 0; k < ncols; k++) acc[k] += v * wq[k * 4 + e];
            }
        }
    }
    pw_store_portable(pw, acc, col0, ncols, out);
}

#if LAYOUT_AVX512
/* The tile's MR pixels by block b (halves = 1: at most 16 channels) into out (MR rows of
 * M bytes), their input rows listed in rows. */
static inline __attribute__((always_inline)) void
ic_tile_halves(const ic_job *j, const uint8_t *const *rows, int64_t b, uint8_t *out,
               const int halves, const int flip)
{
    const pw_job *pw = &j->pw;
    const int64_t col0 = b * NT, ncols = pw->m - col0 < NT ? pw->m - col0 : NT;
    const __m512i b0 = _mm512_loadu_si512((const void *)(pw->bias + col0));
    const __m512i b1 = _mm512_loadu_si512((const void *)(pw->bias + col0 + 16));
#define IC_INIT(i) __m512i a##i##0 = b0, a##i##1 = b1
#define IC_ROW(i) do { \
        __m512i v = _mm512_set1_epi32((int32_t)load32(p##i + 4 * q)); \
        if (flip) v = _mm512_xor_si512(v, top); \
        a##i##0 = _mm512_dpbusd_epi32(a##i##0, v, w0); \
        if (halves == 2) a##i##1 = _mm512_dpbusd_epi32(a##i##1, v, w1); \
    } while (0)
    IC_INIT(0); IC_INIT(1); IC_INIT(2); IC_INIT(3); IC_INIT(4); IC_INIT(5);
    IC_INIT(6); IC_INIT(7); IC_INIT(8); IC_INIT(9); IC_INIT(10); IC_INIT(11);
    const __m512i top = _mm512_set1_epi8((char)0x80);
    const int64_t cq = pw->c / 4;
    const int8_t *w = pw->w + b * pw->cq * NT * 4;
    for (int64_t t = 0; t < j->ntaps; t++, w += cq * NT * 4) {
        const uint8_t *const *r = rows + t * MR;
        const uint8_t *p0 = r[0], *p1 = r[1], *p2 = r[2], *p3 = r[3], *p4 = r[4], *p5 = r[5],
                      *p6 = r[6], *p7 = r[7], *p8 = r[8], *p9 = r[9], *p10 = r[10], *p11 = r[11];
        for (int64_t q = 0; q < cq; q++) {
            __m512i w0 = _mm512_loadu_si512((const void *)(w + q * NT * 4));
            __m512i w1 = halves == 2 ? _mm512_loadu_si512((const void *)(w + q * NT * 4 + 64))
                                     : w0;
            IC_ROW(0); IC_ROW(1); IC_ROW(2); IC_ROW(3); IC_ROW(4); IC_ROW(5);
            IC_ROW(6); IC_ROW(7); IC_ROW(8); IC_ROW(9); IC_ROW(10); IC_ROW(11);
        }
    }
#undef IC_ROW
#undef IC_INIT
    const __m512i acc[MR][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41},
                                {a50, a51}, {a60, a61}, {a70, a71}, {a80, a81}, {a90, a91},
                                {a100, a101}, {a110, a111}};
    pw_store_tile(pw, acc, col0, ncols, out + col0);
}
#endif

#if LAYOUT_AVX512
/* ic_tile_halves with the block's width and x's signedness constants. */
static void ic_tile(const ic_job *j, const uint8_t *const *rows, int64_t b, uint8_t *out)
{
    int narrow = j->pw.m - b * NT <= 16;
    if (j->pw.flip) {
        if (narrow) ic_tile_halves(j, rows, b, out, 1, 1);
        else ic_tile_halves(j, rows, b, out, 2, 1);
    } else {
        if (narrow) ic_tile_halves(j, rows, b, out, 1, 0);
        else ic_tile_halves(j, rows, b, out, 2, 0);
    }
}
#endif

static void ic_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const ic_job *j = ctx;
    const pw_job *pw = &j->pw;
    const uint8_t **rows = (const uint8_t **)(void *)scratch;
    uint8_t *last = (uint8_t *)(void *)(rows + j->ntaps * MR);   /* MR rows of M bytes */
    int64_t blocks = (pw->m + NT - 1) / NT;
    for (int64_t t = lo; t < hi; t++) {
        int64_t r0 = t * MR, count = pw->p - r0 < MR ? pw->p - r0 : MR;
        uint8_t *out = count == MR ? pw->y + r0 * pw->m : last;
        ic_rows(j, r0, rows);
        for (int64_t b = 0; b < blocks; b++) {
#if LAYOUT_AVX512
            ic_tile(j, rows, b, out);
#else
            for (int64_t i = 0; i < count; i++) ic_pixel(j, rows, i, b, out + i * pw->m + b * NT);
#endif
        }
        if (count < MR) memcpy(pw->y + r0 * pw->m, last, (size_t)(count * pw->m));
    }
}

/* y (NHWC, 8-bit) = the requantized 2-D convolution (one group) of the NHWC 8-bit x
 * (is_signed: int8); geometry = {N, C, H, W, OH, OW, KH, KW, SH, SW, DH, DW, pad top,
 * pad left}; offsets[OH * OW][KH * KW] each output pixel's taps' input row offsets within
 * an image (bytes), -1 where the tap falls in the padding; zero_row: C bytes of x's zero
 * point (both depend only on the geometry and the zero point: the caller builds them once
 * with its prepared call); w the packed weights [M/32][KH * KW * C/4][32][4] (zero points
 * 0); bias[M padded to 32] int32 with x's zero point folded in over every tap (x's zero
 * point + 128 for signed x); mult[M padded to 32]; quant = {y zero point, lo, hi}. Tasks:
 * tiles of MR output pixels. 0, -1 (no memory) or -2 (C not a multiple of 4, or an image
 * past 2 GiB). */
int64_t keel_qconv_nhwc_u8s8(const uint8_t *x, int64_t is_signed, const int64_t *geometry,
                             const int32_t *offsets, const uint8_t *zero_row, int64_t m,
                             const int8_t *w, const int32_t *bias, const double *mult,
                             const int64_t *quant, uint8_t *y, int64_t parts)
{
    ic_job j;
    memcpy(j.g, geometry, sizeof j.g);
    const int64_t *g = j.g, c = g[G_C];
    int64_t p = g[G_N] * g[G_OH] * g[G_OW];
    if (p <= 0 || m <= 0) return 0;
    if (c <= 0 || c % 4 || g[G_H] * g[G_W] * c > INT32_MAX) return -2;   /* int32 offsets */
    j.ntaps = g[G_KH] * g[G_KW];
    j.x = x;
    pw_job pw = {x, p, c, m, j.ntaps * c / 4, is_signed, w, bias, mult,
                 (double)quant[QL_YZP], (double)quant[QL_LO], (double)quant[QL_HI], y};
    j.pw = pw;
    j.zero_row = zero_row, j.offsets = offsets;
    int64_t floats = (j.ntaps * MR * (int64_t)sizeof(void *) + MR * m + 3) / 4 + 16;
    return run_parts(ic_task, &j, (p + MR - 1) / MR, parts, floats);
}

/* ---- int8 MaxPool, NHWC in and out ------------------------------------------------------
 * Each output pixel's C bytes are the byte-wise max of the whole channel rows of the input
 * pixels under its window (taps in the padding never chosen); geometry as
 * keel_qmaxpool_8's: N, C, H, W, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW. Tasks: output
 * rows (image, oy). */
enum { M_N, M_C, M_H, M_W, M_OH, M_OW, M_KH, M_KW, M_SH, M_SW, M_PT, M_PL, M_DH, M_DW,
       M_SIZE };

typedef struct {
    int64_t g[M_SIZE];
    const uint8_t *x;
    int64_t is_signed;
    uint8_t *y;
} mpcl_job;

/* out[k] = max(out[k], row[k]) for k < c (the signed bytes' order where is_signed). */
static void max_row(uint8_t *out, const uint8_t *row, int64_t c, int64_t is_signed)
{
    if (is_signed) {
        int8_t *o = (int8_t *)(void *)out;
        const int8_t *r = (const int8_t *)(const void *)row;
        for (int64_t k = 0; k < c; k++) o[k] = r[k] > o[k] ? r[k] : o[k];
    } else {
        for (int64_t k = 0; k < c; k++) out[k] = row[k] > out[k] ? row[k] : out[k];
    }
}

/* The valid taps of one output pixel: rows ky in [ky0, ky1), columns kx in [kx0, kx1),
 * the first at x0; rs and cs the byte steps from one tap row (column) to the next. */
typedef struct {
    const uint8_t *x0;
    int64_t rows, cols, rs, cs;
} mp_window;

#if LAYOUT_AVX512
/* out's C bytes = the max over the window's rows, whole 64-byte runs in a register (plain
 * loads: masked ones are slow), the tail under a mask; is_signed a constant where it is
 * inlined. */
static inline __attribute__((always_inline)) void
max_window(const mp_window *w, int64_t c, int64_t is_signed, uint8_t *out)
{
    const __m512i lowest = _mm512_set1_epi8(is_signed ? (char)-128 : 0);
    int64_t k = 0;
    for (; k + 64 <= c; k += 64) {
        __m512i v = lowest;
        const uint8_t *row = w->x0 + k;
        for (int64_t ky = 0; ky < w->rows; ky++, row += w->rs)
            for (int64_t kx = 0; kx < w->cols; kx++) {
                __m512i r = _mm512_loadu_si512((const void *)(row + kx * w->cs));
                v = is_signed ? _mm512_max_epi8(v, r) : _mm512_max_epu8(v, r);
            }
        _mm512_storeu_si512((void *)(out + k), v);
    }
    if (k < c) {
        __mmask64 mk = ((__mmask64)1 << (c - k)) - 1;
        __m512i v = lowest;
        const uint8_t *row = w->x0 + k;
        for (int64_t ky = 0; ky < w->rows; ky++, row += w->rs)
            for (int64_t kx = 0; kx < w->cols; kx++) {
                __m512i r = _mm512_maskz_loadu_epi8(mk, row + kx * w->cs);
                v = is_signed ? _mm512_max_epi8(v, r) : _mm512_max_epu8(v, r);
            }
        _mm512_mask_storeu_epi8(out + k, mk, v);
    }
}
#else
static inline void max_window(const mp_window *w, int64_t c, int64_t is_signed, uint8_t *out)
{
    memset(out, is_signed ? 0x80 : 0, (size_t)c);
    const uint8_t *row = w->x0;
    for (int64_t ky = 0; ky < w->rows; ky++, row += w->rs)
        for (int64_t kx = 0; kx < w->cols; kx++) max_row(out, row + kx * w->cs, c, is_signed);
}
#endif

/* The valid taps [*lo, *hi) of a window starting at input index at, k taps dil apart,
 * over an extent of size. */
static void valid_taps(int64_t at, int64_t k, int64_t dil, int64_t size, int64_t *lo,
                       int64_t *hi)
{
    int64_t a = at < 0 ? (-at + dil - 1) / dil : 0, b = k;
    while (b > a && at + (b - 1) * dil >= size) b--;
    *lo = a, *hi = b > a ? b : a;
}

/* One output row (image n, row oy): its pixels' windows, is_signed a constant where it
 * is inlined. */
static inline __attribute__((always_inline)) void
mpcl_row(const mpcl_job *j, int64_t n, int64_t oy, int64_t is_signed)
{
    const int64_t *g = j->g, c = g[M_C];
    int64_t iy = oy * g[M_SH] - g[M_PT], ky0, ky1;
    valid_taps(iy, g[M_KH], g[M_DH], g[M_H], &ky0, &ky1);
    mp_window w = {NULL, ky1 - ky0, 0, g[M_DH] * g[M_W] * c, g[M_DW] * c};
    const uint8_t *x = j->x + ((n * g[M_H] + iy + ky0 * g[M_DH]) * g[M_W]) * c;
    uint8_t *out = j->y + (n * g[M_OH] + oy) * g[M_OW] * c;
    for (int64_t ox = 0; ox < g[M_OW]; ox++, out += c) {
        int64_t ix = ox * g[M_SW] - g[M_PL], kx0, kx1;
        valid_taps(ix, g[M_KW], g[M_DW], g[M_W], &kx0, &kx1);
        w.x0 = x + (ix + kx0 * g[M_DW]) * c, w.cols = kx1 - kx0;
        max_window(&w, c, is_signed, out);
    }
}

static void mpcl_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    (void)scratch;
    const mpcl_job *j = ctx;
    for (int64_t t = lo; t < hi; t++) {
        int64_t n = t / j->g[M_OH], oy = t % j->g[M_OH];
        if (j->is_signed)
            mpcl_row(j, n, oy, 1);
        else
            mpcl_row(j, n, oy, 0);
    }
}

/* y[N][OH][OW][C] = the max over each 2-D window of x[N][H][W][C] (uint8, or int8 where
 * is_signed). 0, or -2 for a geometry it does not take. */
int64_t keel_qmaxpool_nhwc_8(const uint8_t *x, int64_t is_signed, const int64_t *geometry,
                             uint8_t *y, int64_t parts)
{
    mpcl_job j;
    memcpy(j.g, geometry, sizeof j.g);
    for (int i = 0; i < M_SIZE; i++)
        if (j.g[i] < (i == M_PT || i == M_PL ? 0 : 1)) return i < M_OW && !j.g[i] ? 0 : -2;
    j.x = x, j.is_signed = is_signed, j.y = y;
    return run_parts(mpcl_task, &j, j.g[M_N] * j.g[M_OH], parts, 16);
}

/* ---- QLinearGlobalAveragePool ------------------------------------------------------------
 * onnxruntime's integer global average (its MLAS arithmetic on x86-64): per image and
 * channel, acc = the sum of the plane's hw 8-bit values minus hw * x zero point, in int32
 * (wrapping, as its vector adds do), then y = round_half_even(clamp((float)acc * scale,
 * lo - y zero point, hi - y zero point)) + y zero point, scale the float32
 * x_scale / (y_scale * hw). The clamps are written as vmaxps/vminps compute them (NaN
 * gives the lower bound). x is NCHW (a channel's values contiguous) or NHWC (a pixel's
 * channels contiguous); y is (N, C). Tasks: (image, block of GAP_CB channels). */

#define GAP_CB 256
/* The global pool's params: {x zero point, y zero point, lo, hi}. */
enum { GAP_XZP, GAP_YZP, GAP_LO, GAP_HI, GAP_LEN };

typedef struct {
    const uint8_t *x;
    int64_t is_signed, nhwc, c, hw, blocks;
    uint32_t bias;
    float scale, lo, hi;
    int32_t zp;
    uint8_t *y;
} gap_job;


static void gap_sums_nchw(const gap_job *j, const uint8_t *x, int64_t nc, uint32_t *acc)
{
    for (int64_t k = 0; k < nc; k++, x += j->hw) {
        uint32_t s = 0;
        if (j->is_signed) {
            const int8_t *v = (const int8_t *)(const void *)x;
            for (int64_t i = 0; i < j->hw; i++) s += (uint32_t)(int32_t)v[i];
        } else {
            for (int64_t i = 0; i < j->hw; i++) s += x[i];
        }
        acc[k] = s;
    }
}

static void gap_sums_nhwc(const gap_job *j, const uint8_t *x, int64_t nc, uint32_t *acc)
{
    memset(acc, 0, (size_t)nc * sizeof *acc);
    for (int64_t p = 0; p < j->hw; p++, x += j->c) {
        if (j->is_signed) {
            const int8_t *v = (const int8_t *)(const void *)x;
            for (int64_t k = 0; k < nc; k++) acc[k] += (uint32_t)(int32_t)v[k];
        } else {
            for (int64_t k = 0; k < nc; k++) acc[k] += x[k];
        }
    }
}

static void gap_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const gap_job *j = ctx;
    uint32_t acc[GAP_CB];
    (void)scratch;
    for (int64_t t = lo; t < hi; t++) {
        int64_t n = t / j->blocks, c0 = (t % j->blocks) * GAP_CB;
        int64_t nc = j->c - c0 < GAP_CB ? j->c - c0 : GAP_CB;
        if (j->nhwc)
            gap_sums_nhwc(j, j->x + n * j->hw * j->c + c0, nc, acc);
        else
            gap_sums_nchw(j, j->x + (n * j->c + c0) * j->hw, nc, acc);
        uint8_t *y = j->y + n * j->c + c0;
        for (int64_t k = 0; k < nc; k++) {
            float v = (float)(int32_t)(acc[k] + j->bias) * j->scale;
            v = v > j->lo ? v : j->lo;
            v = v < j->hi ? v : j->hi;
            y[k] = (uint8_t)((int32_t)nearbyintf(v) + j->zp);
        }
    }
}

/* y[N][C] = onnxruntime's QLinearGlobalAveragePool of the 8-bit x (is_signed: int8) with
 * hw values per channel, NCHW or (nhwc) channels-last; params = {x zero point, y zero
 * point, lo, hi} (y's type's bounds), scale as above. */
int64_t keel_qglobal_avgpool_u8(const uint8_t *x, int64_t is_signed, int64_t nhwc, int64_t n,
                                int64_t c, int64_t hw, float scale, const int64_t *params,
                                uint8_t *y, int64_t parts)
{
    if (n <= 0 || c <= 0) return 0;
    int32_t zp = (int32_t)params[GAP_YZP];
    gap_job j = {x, is_signed, nhwc, c, hw, (c + GAP_CB - 1) / GAP_CB,
                 (uint32_t)0 - (uint32_t)params[GAP_XZP] * (uint32_t)hw, scale,
                 (float)(params[GAP_LO] - zp), (float)(params[GAP_HI] - zp), zp, y};
    return run_parts(gap_task, &j, n * j.blocks, parts, 1);
}

/* ---- the sizes the planner's splits count in --------------------------------------------
 * keel.backends.cpu.qlayout reads them at load and checks the cpu planner's INT8_* values
 * against them (a split counts tasks in these units), so neither side drifts alone. Writes
 * at most n of: TB (rows of a transpose strip), CL (channels of a depthwise block),
 * MAX_TAPS (the most taps the depthwise kernel takes), MR (output pixels of a panel tile),
 * NT (output channels of a panel), GAP_CB (channels of a global-pool task); returns 6. */
int64_t keel_qlayout_geometry(int64_t *out, int64_t n)
{
    const int64_t sizes[] = {TB, CL, MAX_TAPS, MR, NT, GAP_CB};
    const int64_t count = (int64_t)(sizeof sizes / sizeof sizes[0]);
    for (int64_t i = 0; i < n && i < count; i++) out[i] = sizes[i];
    return count;
}

/* The enum values keel.backends.cpu.qlayout builds its arrays with (it checks them at load,
 * as the sizes above), by name: the depthwise and indirect geometry's slots (G_*), the
 * max pool geometry's (M_*), the quant array's (QL_*) and the global pool's params'
 * (GAP_*), each with its length (keel_qlayout_layout and keel_qlayout_layout_names: see
 * enums.h). */
#define QLAYOUT_LAYOUT(X) \
    X(G_N) X(G_C) X(G_H) X(G_W) X(G_OH) X(G_OW) X(G_KH) X(G_KW) X(G_SH) X(G_SW) X(G_DH) \
    X(G_DW) X(G_PT) X(G_PL) X(G_SIZE) \
    X(M_N) X(M_C) X(M_H) X(M_W) X(M_OH) X(M_OW) X(M_KH) X(M_KW) X(M_SH) X(M_SW) X(M_PT) \
    X(M_PL) X(M_DH) X(M_DW) X(M_SIZE) \
    X(QL_YZP) X(QL_LO) X(QL_HI) X(QL_LEN) X(GAP_XZP) X(GAP_YZP) X(GAP_LO) X(GAP_HI) X(GAP_LEN)

KEEL_ENUM_EXPORT(keel_qlayout_layout, QLAYOUT_LAYOUT)
