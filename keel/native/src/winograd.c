/* The transforms of a Winograd F(2x2, 3x3) convolution (Lavin & Gray, 2015).
 *
 *   Y = A^T [ (G g G^T) * (B^T d B) ] A      per 2x2 output tile and 4x4 input tile d
 *
 * The sixteen elementwise products over all tiles are sixteen matrix products
 * P[k] (M x T) = U[k] (M x C) @ V[k] (C x T), which keel runs on its packed GEMM
 * (gemm.c); this file computes V from the NCHW input and Y from P, each in one pass:
 *
 *   keel_winograd_input_f32:  V[k][c][t] = (B^T d B)[k] of tile t of channel c
 *   keel_winograd_output_f32: Y[n][m][..] = clip(A^T P[.][m][t] A + bias[m] + Z, lo, hi)
 *
 * with T = images x th x tw tiles (tile t = (image, ty, tx), tx fastest), each split over
 * keel's threads by planes (image, channel), or (by_rows) by tile rows (image, ty) with
 * every channel of each, so that a thread transforms whole tiles: those
 * its share of the products (whole columns, panel-major) reads and writes. A plane
 * (one image, one channel) is first copied into a zero-padded buffer whose rows are
 * split into even and odd columns, so the four columns of sixteen consecutive tiles
 * are four contiguous vector loads; the row transform (d B) runs on them, the column
 * transform (B^T .) on four such rows. Every value is computed the same way wherever
 * a chunk of planes starts: any split over threads gives bitwise the same result.
 *
 * Plain C11 with GNU vector extensions (vec.h: VW lanes, 16 with AVX-512, 8 with AVX, else 4).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec.h"

/* The first n < VW lanes of p into a vector (the rest zero). A memcpy of a variable
 * length here compiled to `rep movs`, which cost a third of the input transform on
 * 56 x 56 planes (28 tiles a row: every other block is partial). */
static inline vf vload_first(const float *p, int64_t n)
{
#if defined(__AVX512F__)
    return (vf)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
#else
    vf v = {0};
    for (int64_t l = 0; l < n; l++) v[l] = p[l];
    return v;
#endif
}

/* Geometry: C, H, W, OH, OW, PT, PL (pads at the top and left; the bottom and right
 * pads are whatever OH and OW leave), from an int64 array. */
enum { W_C, W_H, W_W, W_OH, W_OW, W_PT, W_PL, W_LEN };

typedef struct {
    int64_t c, h, w, oh, ow, pt, pl;
    int64_t th, tw;   /* tiles per column and per row */
    int64_t twp;      /* tw rounded up to whole vectors */
    int64_t half;     /* floats of one even or odd half-row: twp + 1 (+ slack) */
} wgeom;

static int wgeom_init(wgeom *g, const int64_t *a)
{
    g->c = a[W_C], g->h = a[W_H], g->w = a[W_W], g->oh = a[W_OH], g->ow = a[W_OW];
    g->pt = a[W_PT], g->pl = a[W_PL];
    if (g->c < 1 || g->h < 1 || g->w < 1 || g->oh < 1 || g->ow < 1 || g->pt < 0 || g->pl < 0)
        return -1;
    g->th = (g->oh + 1) / 2, g->tw = (g->ow + 1) / 2;
    g->twp = round_up(g->tw, VW);
    g->half = g->twp + VW;
    return 0;
}

/* Floats of scratch a thread needs: the split copy of a plane (input), or two output
 * rows (output). */
static int64_t input_floats(const wgeom *g) { return (2 * g->th + 2) * 2 * g->half; }
static int64_t output_floats(const wgeom *g) { return 4 * g->twp; }

/* ---- input transform ------------------------------------------------------------------ */

/* The plane's padded rows [r_lo, r_hi) of -pt .. 2 th + 1 - pt, zero-padded, as even / odd
 * column halves: row r's padded column j (input column j - pl) at
 * s[(2 r + j % 2) * half + j / 2]. */
static void split_plane(const float *x, const wgeom *g, float *s, int64_t r_lo, int64_t r_hi)
{
    int64_t cols = 2 * g->half;
    /* Padded columns [a, b) hold input columns [a - pl, b - pl); a pair j (padded columns
     * 2j, 2j + 1) lies wholly inside for j in [ja, jb). */
    int64_t a = g->pl, b = g->pl + g->w < cols ? g->pl + g->w : cols;
    int64_t ja = (a + 1) / 2, jb = b / 2;
    for (int64_t r = r_lo; r < r_hi; r++) {
        float *even = s + 2 * r * g->half, *odd = even + g->half;
        int64_t ir = r - g->pt;
        if (ir < 0 || ir >= g->h) {
            memset(even, 0, (size_t)(2 * g->half) * sizeof(float));
            continue;
        }
        const float *src = x + ir * g->w - g->pl;   /* src[j] = padded column j */
        for (int64_t j = 0; j < ja; j++) {
            even[j] = 2 * j >= a && 2 * j < b ? src[2 * j] : 0.0f;
            odd[j] = 2 * j + 1 >= a && 2 * j + 1 < b ? src[2 * j + 1] : 0.0f;
        }
        for (int64_t j = ja; j < jb; j++) { /* the interior: a plain deinterleave */
            even[j] = src[2 * j];
            odd[j] = src[2 * j + 1];
        }
        /* The last pair (if the row ends inside it), then zeros: the pairs past the
           row were a loop of tests per float, a third of the input transform of a
           56 x 56 plane (20 of its 48 pairs). */
        int64_t j = jb > ja ? jb : ja;
        for (; j < g->half && 2 * j < b; j++) {
            even[j] = 2 * j >= a ? src[2 * j] : 0.0f;
            odd[j] = 2 * j + 1 >= a && 2 * j + 1 < b ? src[2 * j + 1] : 0.0f;
        }
        if (j < g->half) {
            memset(even + j, 0, (size_t)(g->half - j) * sizeof(float));
            memset(odd + j, 0, (size_t)(g->half - j) * sizeof(float));
        }
    }
}

/* d B of padded row r for tiles tx .. tx + VW: out[j], j = 0..3. */
static inline void row_transform(const float *s, const wgeom *g, int64_t r, int64_t tx, vf out[4])
{
    const float *even = s + 2 * r * g->half, *odd = even + g->half;
    vf e0 = vload(even + tx), o0 = vload(odd + tx), e1 = vload(even + tx + 1),
       o1 = vload(odd + tx + 1);
    out[0] = e0 - e1;
    out[1] = o0 + e1;
    out[2] = e1 - o0;
    out[3] = o0 - o1;
}

/* The lanes [lo, hi) of v to p + lo. */
static inline void vstore_lanes(float *p, vf v, int64_t lo, int64_t hi)
{
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(p, (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1)), (__m512)v);
#else
    for (int64_t l = lo; l < hi; l++) p[l] = v[l];
#endif
}

/* V's rows for one channel of one image (plane x): the sixteen transformed values of tile
 * t (this image's tile u = ty * tw + tx is t = t0 + u) at vc[k * stride_k + t], for the
 * image's tiles [u_lo, u_hi), which may start and end inside a tile row. A vector of
 * tiles runs down the tile rows, so that the row transforms of padded rows 2 ty + 2 and
 * 2 ty + 3 serve tile rows ty and ty + 1 (each row transformed once, not twice); only the
 * range's lanes are stored. Each tile's values are the same wherever the range starts
 * (the lanes are independent). */
static void input_tiles(const float *x, const wgeom *g, float *vc, int64_t stride_k,
                        int64_t t0, float *s, int64_t u_lo, int64_t u_hi)
{
    int64_t ty_lo = u_lo / g->tw, ty_hi = (u_hi - 1) / g->tw + 1;
    split_plane(x, g, s, 2 * ty_lo, 2 * ty_hi + 2);
    int64_t x_first = ty_hi - ty_lo == 1 ? u_lo - ty_lo * g->tw : 0;
    for (int64_t tx = x_first - x_first % VW; tx < g->tw; tx += VW) {
        vf d[4][4];
        row_transform(s, g, 2 * ty_lo, tx, d[0]);
        row_transform(s, g, 2 * ty_lo + 1, tx, d[1]);
        for (int64_t ty = ty_lo; ty < ty_hi; ty++) {
            row_transform(s, g, 2 * ty + 2, tx, d[2]);
            row_transform(s, g, 2 * ty + 3, tx, d[3]);
            int64_t xa = ty == ty_lo ? u_lo - ty * g->tw : 0;
            int64_t xe = u_hi - ty * g->tw < g->tw ? u_hi - ty * g->tw : g->tw;
            int64_t lo = xa > tx ? xa - tx : 0, hi = xe - tx < VW ? xe - tx : VW;
            if (lo < hi) {
                vf out[16];
                for (int j = 0; j < 4; j++) {
                    out[j] = d[0][j] - d[2][j];
                    out[4 + j] = d[1][j] + d[2][j];
                    out[8 + j] = d[2][j] - d[1][j];
                    out[12 + j] = d[1][j] - d[3][j];
                }
                float *dst = vc + t0 + ty * g->tw + tx;
                if (lo == 0 && hi == VW) {
                    for (int k = 0; k < 16; k++) vstore(dst + k * stride_k, out[k]);
                } else {
                    for (int k = 0; k < 16; k++) vstore_lanes(dst + k * stride_k, out[k], lo, hi);
                }
            }
            for (int j = 0; j < 4; j++) d[0][j] = d[2][j], d[1][j] = d[3][j];
        }
    }
}

/* input_tiles for the whole tile rows [ty_lo, ty_hi). */
static void input_plane(const float *x, const wgeom *g, float *vc, int64_t stride_k,
                        int64_t t0, float *s, int64_t ty_lo, int64_t ty_hi)
{
    input_tiles(x, g, vc, stride_k, t0, s, ty_lo * g->tw, ty_hi * g->tw);
}

/* ---- output transform ----------------------------------------------------------------- */

typedef struct {
    const float *bias; /* per output channel, or NULL */
    const float *z;    /* a residual shaped like Y, or NULL */
    float lo, hi;
    int clip;
} wepilogue;

static inline float bias_of(const wepilogue *e, int64_t m) { return e->bias ? e->bias[m] : 0.0f; }

/* row[2 l] = left[l], row[2 l + 1] = right[l] for the VW lanes: with AVX-512 two
 * permutes and two stores (the float by float stores were a third of the output
 * transform's time). */
static inline void interleave_store(float *row, vf left, vf right)
{
#if defined(__AVX512F__)
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                         15, 31);
    _mm512_storeu_ps(row, _mm512_permutex2var_ps((__m512)left, lo, (__m512)right));
    _mm512_storeu_ps(row + 16, _mm512_permutex2var_ps((__m512)left, hi, (__m512)right));
#else
    for (int l = 0; l < VW; l++) {
        row[2 * l] = left[l];
        row[2 * l + 1] = right[l];
    }
#endif
}

/* Y's plane (OH, OW) for one output channel of one image, whose bias is b, from its
 * products: the sixteen values of tile t (this image's tile u = ty * tw + tx is t = t0 +
 * u) at pc[k * stride_k + t]; the outputs of the image's tiles [u_lo, u_hi), which may
 * start and end inside a tile row; z is the residual's plane or NULL. Each output value
 * is computed the same way wherever the range starts. */
static void output_tiles(const float *pc, int64_t stride_k, int64_t t0, float b, const wgeom *g,
                         float *y, const wepilogue *e, const float *z, float *s, int64_t u_lo,
                         int64_t u_hi)
{
    float *r0 = s, *r1 = s + 2 * g->twp;
    int64_t ty_lo = u_lo / g->tw, ty_hi = (u_hi - 1) / g->tw + 1;
    for (int64_t ty = ty_lo; ty < ty_hi; ty++) {
        const float *pt = pc + (t0 + ty * g->tw);
        int64_t xa = ty == ty_lo ? u_lo - ty * g->tw : 0;
        int64_t xe = u_hi - ty * g->tw < g->tw ? u_hi - ty * g->tw : g->tw;
        for (int64_t tx = xa; tx < xe; tx += VW) {
            vf q[16];
            int64_t n = xe - tx < VW ? xe - tx : VW;
            if (n == VW) {
                for (int k = 0; k < 16; k++) q[k] = vload(pt + k * stride_k + tx);
            } else {
                for (int k = 0; k < 16; k++) q[k] = vload_first(pt + k * stride_k + tx, n);
            }
            /* A^T = [[1, 1, 1, 0], [0, 1, -1, -1]] down the rows i, then along j. */
            vf a[2][4];
            for (int j = 0; j < 4; j++) {
                a[0][j] = q[j] + q[4 + j] + q[8 + j];
                a[1][j] = q[4 + j] - q[8 + j] - q[12 + j];
            }
            for (int r = 0; r < 2; r++) {
                vf left = a[r][0] + a[r][1] + a[r][2], right = a[r][1] - a[r][2] - a[r][3];
                float *row = (r ? r1 : r0) + 2 * tx;
                if (n == VW) {
                    interleave_store(row, left, right);
                } else {   /* only the range's lanes: the rows end at 2 twp floats */
                    for (int64_t l = 0; l < n; l++) {
                        row[2 * l] = left[l];
                        row[2 * l + 1] = right[l];
                    }
                }
            }
        }
        int64_t oe = 2 * xe < g->ow ? 2 * xe : g->ow;
        for (int r = 0; r < 2; r++) {
            int64_t oy = 2 * ty + r;
            if (oy >= g->oh) break;
            const float *src = r ? r1 : r0;
            float *dst = y + oy * g->ow;
            const float *zr = z ? z + oy * g->ow : NULL;
            int64_t ox = 2 * xa;
            vf vb = vsplat(b), lo = vsplat(e->lo), hi = vsplat(e->hi);
            for (; ox + VW <= oe; ox += VW) {
                vf v = vload(src + ox) + vb;
                if (zr) v += vload(zr + ox);
                if (e->clip) { /* NaN stays NaN: both comparisons are false for it */
                    v = vselect(v < lo, lo, v);
                    v = vselect(v > hi, hi, v);
                }
                vstore(dst + ox, v);
            }
            for (; ox < oe; ox++) {
                float v = src[ox] + b;
                if (zr) v += zr[ox];
                if (e->clip) {
                    if (v < e->lo) v = e->lo;
                    if (v > e->hi) v = e->hi;
                }
                dst[ox] = v;
            }
        }
    }
}

/* output_tiles for the whole tile rows [ty_lo, ty_hi). */
static void output_plane(const float *pc, int64_t stride_k, int64_t t0, float b, const wgeom *g,
                         float *y, const wepilogue *e, const float *z, float *s, int64_t ty_lo,
                         int64_t ty_hi)
{
    output_tiles(pc, stride_k, t0, b, g, y, e, z, s, ty_lo * g->tw, ty_hi * g->tw);
}

/* ---- exported kernels ----------------------------------------------------------------- */

#include "parallel.h"

/* Floats of scratch per thread for this geometry (input or output transform); -1 if the
 * geometry is not one this file serves. */
int64_t keel_winograd_scratch(const int64_t *geometry)
{
    wgeom g;
    if (wgeom_init(&g, geometry) != 0) return -1;
    int64_t a = input_floats(&g), b = output_floats(&g);
    return a > b ? a : b;
}

typedef struct {
    const float *x;
    float *v;
    const wgeom *g;
    int64_t t_total;
} input_job;

static void input_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const input_job *j = ctx;
    const wgeom *g = j->g;
    int64_t tiles = g->th * g->tw, plane = g->h * g->w;
    for (int64_t q = lo; q < hi; q++) {
        int64_t i = q / g->c, c = q % g->c;
        input_plane(j->x + q * plane, g, j->v + c * j->t_total, g->c * j->t_total, i * tiles, s,
                    0, g->th);
    }
}

/* The tile rows [lo, hi) of the images (row q: image q / th, tile row q % th), a run per
 * image: fn(ctx, s, image, first tile row, end tile row). */
typedef void (*rows_fn)(const void *ctx, float *s, int64_t i, int64_t a, int64_t b);

static void each_image_rows(rows_fn fn, const void *ctx, float *s, int64_t th, int64_t lo,
                            int64_t hi)
{
    for (int64_t q = lo; q < hi;) {
        int64_t i = q / th, a = q % th, b = hi - i * th < th ? hi - i * th : th;
        fn(ctx, s, i, a, b);
        q = i * th + b;
    }
}

/* Tile rows [a, b) of image i, every channel: a thread's share is whole tiles, the
 * columns of V its products read. */
static void input_rows(const void *ctx, float *s, int64_t i, int64_t a, int64_t b)
{
    const input_job *j = ctx;
    const wgeom *g = j->g;
    int64_t tiles = g->th * g->tw, plane = g->h * g->w;
    for (int64_t c = 0; c < g->c; c++)
        input_plane(j->x + (i * g->c + c) * plane, g, j->v + c * j->t_total,
                    g->c * j->t_total, i * tiles, s, a, b);
}

static void input_rows_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const input_job *j = ctx;
    each_image_rows(input_rows, ctx, s, j->g->th, lo, hi);
}

/* V (16, C, T) from X (images, C, H, W), T = images * th * tw, over `parts` chunks of
 * the images' planes on keel's threads, or with by_rows of their tile rows (every
 * channel of each): the same V. Returns 0, or -1 for an unserved geometry or no
 * scratch. */
int64_t keel_winograd_input_f32(const float *x, float *v, const int64_t *geometry,
                                int64_t images, int64_t parts, int64_t by_rows)
{
    wgeom g;
    if (wgeom_init(&g, geometry) != 0) return -1;
    input_job j = {x, v, &g, images * g.th * g.tw};
    return run_parts(by_rows ? input_rows_task : input_task, &j,
                     images * (by_rows ? g.th : g.c), parts, keel_winograd_scratch(geometry));
}

typedef struct {
    const float *p;
    float *y;
    const wgeom *g;
    int64_t m, t_total;
    wepilogue e;
} output_job;

static void output_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const output_job *j = ctx;
    const wgeom *g = j->g;
    int64_t tiles = g->th * g->tw, plane = g->oh * g->ow;
    for (int64_t q = lo; q < hi; q++) {
        int64_t i = q / j->m, m = q % j->m;
        output_plane(j->p + m * j->t_total, j->m * j->t_total, i * tiles, bias_of(&j->e, m), g,
                     j->y + q * plane, &j->e, j->e.z ? j->e.z + q * plane : NULL, s, 0, g->th);
    }
}

/* Tile rows [a, b) of image i, every output channel. */
static void output_rows(const void *ctx, float *s, int64_t i, int64_t a, int64_t b)
{
    const output_job *j = ctx;
    const wgeom *g = j->g;
    int64_t tiles = g->th * g->tw, plane = g->oh * g->ow;
    for (int64_t m = 0; m < j->m; m++) {
        int64_t o = (i * j->m + m) * plane;
        output_plane(j->p + m * j->t_total, j->m * j->t_total, i * tiles, bias_of(&j->e, m), g,
                     j->y + o, &j->e, j->e.z ? j->e.z + o : NULL, s, a, b);
    }
}

static void output_rows_task(void *ctx, float *s, int64_t lo, int64_t hi)
{
    const output_job *j = ctx;
    each_image_rows(output_rows, ctx, s, j->g->th, lo, hi);
}

/* Y (images, M, OH, OW) = clip(A^T P A + bias + Z, lo, hi) from P (16, M, T); bias (M)
 * and Z (like Y) may be NULL, clip = {lo, hi} or NULL. Over `parts` chunks of the output
 * planes on keel's threads, or with by_rows of the images' tile rows (every output
 * channel of each): the same Y. Returns 0, or -1 for an unserved geometry or no
 * scratch. */
int64_t keel_winograd_output_f32(const float *p, float *y, const int64_t *geometry, int64_t m,
                                 const float *bias, const float *z, const float *clip,
                                 int64_t images, int64_t parts, int64_t by_rows)
{
    wgeom g;
    if (wgeom_init(&g, geometry) != 0 || m < 1) return -1;
    output_job j = {p, y, &g, m, images * g.th * g.tw,
                    {bias, z, clip ? clip[0] : 0.0f, clip ? clip[1] : 0.0f, clip != NULL}};
    return run_parts(by_rows ? output_rows_task : output_task, &j,
                     images * (by_rows ? g.th : m), parts, keel_winograd_scratch(geometry));
}

/* ---- the per-thread pipeline ------------------------------------------------------------
 *
 * Every pass of a block of tiles on one thread, in its own scratch: the block's input
 * transform into V (16, C, n), the sixteen products P = U V a block of output channels
 * at a time (gemm.c's keel_gemm_block_f32, whose address Python hands in with the
 * prepared call of U), and the output transform of those channels, with the epilogue.
 * A block is `tiles` consecutive tiles over the images (tile t = (image, ty, tx), tx
 * fastest), starting and ending anywhere in a tile row, so that blocks can be whole
 * vectors of tiles; threads take whole blocks. V and P of a block stay in the thread's cache between the passes
 * (the cpu planner sizes them to its L2: planner.winograd_pipeline), nothing is shared
 * but X, U and Y, and one dispatch runs the whole conv. Each tile is transformed as in
 * the passes above and each element of P is computed as the full product computes it
 * (gemm.c: the same sum in the same order for any columns and rows), so the result is
 * bitwise that of the passes, for any block size and any split over threads. */

/* keel_gemm_block_f32: rows panels [r_lo, r_hi) of the `batch` products of the prepared
 * call `call` against B (rows ldb floats apart, products b_bs apart) into C (rows ldc
 * apart, products c_bs apart), n columns, on the calling thread. */
typedef void (*block_product)(const void *call, float *work, int64_t batch, int64_t r_lo,
                              int64_t r_hi, const float *b, int64_t ldb, int64_t b_bs, float *c,
                              int64_t ldc, int64_t c_bs, int64_t n);

/* The pipeline's sizes, from an int64 array: tiles per block (any count: a block may
 * start and end inside a tile row or span images), row panels of output
 * channels per channel block, the GEMM's rows of a row panel (MR), floats of the GEMM's
 * workspace, and the blocks' order over the chunks (the cpu planner's choice,
 * planner.winograd_pipeline: 0 in order, 1 from the last). */
enum { F_TILES, F_PANELS, F_MR, F_WORK, F_LAST_FIRST, F_THREADS, F_LEN };

typedef struct {
    const float *x;
    float *y;
    const wgeom *g;
    int64_t m;
    wepilogue e;
    const void *call;
    block_product product;
    int64_t tiles, panels, mr, work; /* the sizes above */
    int64_t last_first;               /* chunk [lo, hi) runs blocks [B - hi, B - lo) */
    int64_t all_tiles;                /* images x th x tw */
    int64_t ld;                      /* floats per row of the block's V and P */
} fused_job;

static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

/* The scratch of one thread: the GEMM's workspace, V, P, then the transforms' buffer. */
static int64_t fused_floats(const fused_job *j, int64_t transform)
{
    int64_t mb = j->panels * j->mr;
    return up16(j->work) + 16 * j->g->c * j->ld + 16 * mb * j->ld + up16(transform);
}

/* fn(j, s, image i, the image's tiles [u_lo, u_hi), their first column in the block) for
 * each image the block's tiles [t_lo, t_hi) cover. */
typedef void (*span_fn)(const fused_job *j, float *s, int64_t i, int64_t u_lo, int64_t u_hi,
                        int64_t col, int64_t m0, int64_t m1, float *buf);

static void each_image_span(span_fn fn, const fused_job *j, float *s, int64_t t_lo,
                            int64_t t_hi, int64_t m0, int64_t m1, float *buf)
{
    int64_t tiles = j->g->th * j->g->tw;
    for (int64_t t = t_lo; t < t_hi;) {
        int64_t i = t / tiles, u_lo = t - i * tiles;
        int64_t u_hi = t_hi - i * tiles < tiles ? t_hi - i * tiles : tiles;
        fn(j, s, i, u_lo, u_hi, t - t_lo, m0, m1, buf);
        t = i * tiles + u_hi;
    }
}

/* Fetch into the cache the rows of plane x that the tiles [u_lo, u_hi) read. */
static void prefetch_tiles(const float *x, const wgeom *g, int64_t u_lo, int64_t u_hi)
{
    int64_t r0 = 2 * (u_lo / g->tw) - g->pt, r1 = 2 * ((u_hi - 1) / g->tw + 1) + 2 - g->pt;
    r0 = r0 < 0 ? 0 : r0;
    r1 = r1 > g->h ? g->h : r1;
    const char *p = (const char *)(x + r0 * g->w), *end = (const char *)(x + r1 * g->w);
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 3);
}

/* The input transform of image i's tiles [u_lo, u_hi), every channel, into the block's V.
 * A block's rows of one plane are a few KiB, each a page of its own: the hardware's
 * stream prefetch does not start before the transform waits on them, so the next
 * channel's rows are fetched while this one's are transformed. */
static void fused_input(const fused_job *j, float *s, int64_t i, int64_t u_lo, int64_t u_hi,
                        int64_t col, int64_t m0, int64_t m1, float *v)
{
    (void)m0, (void)m1;
    const wgeom *g = j->g;
    int64_t in_plane = g->h * g->w;
    const float *x = j->x + i * g->c * in_plane;
    prefetch_tiles(x, g, u_lo, u_hi);
    for (int64_t c = 0; c < g->c; c++) {
        if (c + 1 < g->c) prefetch_tiles(x + (c + 1) * in_plane, g, u_lo, u_hi);
        input_tiles(x + c * in_plane, g, v + c * j->ld, g->c * j->ld, col - u_lo, s, u_lo,
                    u_hi);
    }
}

/* The output transform of image i's tiles [u_lo, u_hi), output channels [m0, m1), from the
 * block's P. */
static void fused_output(const fused_job *j, float *s, int64_t i, int64_t u_lo, int64_t u_hi,
                         int64_t col, int64_t m0, int64_t m1, float *p)
{
    const wgeom *g = j->g;
    int64_t out_plane = g->oh * g->ow, mb = j->panels * j->mr;
    for (int64_t m = m0; m < m1; m++) {
        int64_t o = (i * j->m + m) * out_plane;
        output_tiles(p + (m - m0) * j->ld, mb * j->ld, col - u_lo, bias_of(&j->e, m), g,
                     j->y + o, &j->e, j->e.z ? j->e.z + o : NULL, s, u_lo, u_hi);
    }
}

/* Block q: the input transform of its tiles (a span per image), then channel block by
 * channel block the products and the output transform. */
static void fused_block(const fused_job *j, float *scratch, int64_t q)
{
    const wgeom *g = j->g;
    int64_t t_lo = q * j->tiles,
            t_hi = t_lo + j->tiles < j->all_tiles ? t_lo + j->tiles : j->all_tiles;
    int64_t n = t_hi - t_lo, ld = j->ld, mb = j->panels * j->mr;
    float *work = scratch, *v = work + up16(j->work), *p = v + 16 * g->c * ld,
          *s = p + 16 * mb * ld;
    /* The products run on whole vectors of columns: a partial one costs the GEMM a trip
       through a buffer per tile (a block of 56 tiles of 64 channels took 1.5x the time of
       one of 64). The columns past the block's tiles are zero and their products unread;
       every other column of P is computed alike either way. */
    int64_t cols = up16(n);
    if (cols > n)
        for (int64_t row = 0; row < 16 * g->c; row++)
            memset(v + row * ld + n, 0, (size_t)(cols - n) * sizeof(float));
    each_image_span(fused_input, j, s, t_lo, t_hi, 0, 0, v);
    int64_t all_panels = (j->m + j->mr - 1) / j->mr;
    for (int64_t p0 = 0; p0 < all_panels; p0 += j->panels) {
        int64_t p1 = p0 + j->panels < all_panels ? p0 + j->panels : all_panels;
        int64_t m0 = p0 * j->mr, m1 = p1 * j->mr < j->m ? p1 * j->mr : j->m;
        j->product(j->call, work, 16, p0, p1, v, ld, g->c * ld, p, ld, mb * ld, cols);
        each_image_span(fused_output, j, s, t_lo, t_hi, m0, m1, p);
    }
}

/* Chunk [lo, hi) of the blocks runs blocks [lo, hi), or with last_first blocks
 * [B - hi, B - lo): the planner decides which order keeps the busiest thread's tiles
 * fewest (keel's split gives the first chunks one block more; the last block may be
 * partial). Each block is computed alike wherever it runs: the same bits either way. */
static void fused_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const fused_job *j = ctx;
    int64_t blocks = (j->all_tiles + j->tiles - 1) / j->tiles;
    int64_t a = j->last_first ? blocks - hi : lo, b = j->last_first ? blocks - lo : hi;
    for (int64_t q = a; q < b; q++) fused_block(j, scratch, q);
}

/* Y (images, M, OH, OW) = clip(conv(X, W) + bias + Z, lo, hi) as keel_winograd_input_f32,
 * the products and keel_winograd_output_f32 give it, each block of `sizes[F_TILES]`
 * tiles through all three on one thread, the blocks in `parts` chunks on keel's threads
 * (in the order sizes[F_LAST_FIRST] gives), at most sizes[F_THREADS] of them (0: one a
 * chunk; fewer threads than chunks take the chunks past their own one at a time).
 * `call` is the prepared product of the packed U (16 products, M x C, gemm.c's
 * keel_gemm_args) and `product` gemm.c's keel_gemm_block_f32. Returns 0, or -1 for an
 * unserved geometry or sizes, or no scratch. */
int64_t keel_winograd_fused_f32(const float *x, float *y, const int64_t *geometry, int64_t m,
                                const float *bias, const float *z, const float *clip,
                                int64_t images, const void *call, block_product product,
                                const int64_t *sizes, int64_t parts)
{
    wgeom g;
    if (wgeom_init(&g, geometry) != 0 || m < 1 || images < 1 || !call || !product) return -1;
    if (sizes[F_TILES] < 1 || sizes[F_PANELS] < 1 || sizes[F_MR] < 1 || sizes[F_WORK] < 0
        || (sizes[F_LAST_FIRST] != 0 && sizes[F_LAST_FIRST] != 1) || sizes[F_THREADS] < 0)
        return -1;
    fused_job j = {x, y, &g, m,
                   {bias, z, clip ? clip[0] : 0.0f, clip ? clip[1] : 0.0f, clip != NULL},
                   call, product, sizes[F_TILES], sizes[F_PANELS], sizes[F_MR], sizes[F_WORK],
                   sizes[F_LAST_FIRST], images * g.th * g.tw, 0};
    j.ld = up16(j.tiles < j.all_tiles ? j.tiles : j.all_tiles);
    int64_t blocks = (j.all_tiles + j.tiles - 1) / j.tiles;
    return run_parts_capped(fused_task, &j, blocks, parts, sizes[F_THREADS],
                            fused_floats(&j, keel_winograd_scratch(geometry)));
}
