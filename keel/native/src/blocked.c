/* A direct 3x3 stride-1 convolution with the output channels in the vector lanes.
 *
 *   Y[n][m][y][x] = clip(sum over c, kh, kw of W[m][c][kh][kw] * Xpad[n][c][y + kh][x + kw]
 *                        + bias[m] + R[n][m][y][x], lo, hi)
 *
 * for X and Y in NCHW and one pixel of zero padding on every side (ResNet's 3x3 convs).
 * The filters are packed once as [M / 16][C][9][16]: sixteen output channels, one
 * vector, a tap. A register tile is oc_tile blocks of 16 channels by a run of pixels of
 * one output row; per channel and kernel row it loads the tile's filter vectors once
 * and broadcasts each input value of the row once, for three taps (tile() below), none
 * of them through lane masks (gemm.c's masked conv loads its taps through masks across
 * cache lines). X is read where it lies: rows above and below the image read a row of
 * zeros, the pixels left and right of a row are zeros in registers. A band of `rows` output rows
 * (rows * W a multiple of 16) is stored in a buffer as [pixel][16 channels], then
 * transposed sixteen pixels at a time into Y's NCHW rows with the epilogue.
 *
 * Each element of Y is the sum over c, kh, kw in that order from 0 by fused
 * multiply-adds, then + bias, + R, clip: the masked and gathered conv tiles' chain
 * (gemm.c, the depth p = c * 9 + kh * 3 + kw), so bitwise their Y, for any split over
 * threads (the border's zeros are multiplied as a zero-bordered copy would give them:
 * an infinite filter tap gives NaN there, as in the reference). A unit is one band of
 * one image.
 *
 * AVX-512 builds only: elsewhere keel_conv_blocked_lanes_f32 says 0 and the cpu planner
 * does not plan the form.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "parallel.h"

typedef struct {
    int64_t n, c, h, w, m;   /* X (n, c, h, w), Y (n, m, h, w); m a multiple of 16 */
    int64_t oc_tile;         /* blocks of 16 output channels a register tile: 1 or 2 */
    int64_t rows;            /* output rows a unit (rows * w a multiple of 16, h too) */
    const float *filters;    /* [m / 16][c][9][16] */
    const float *x;
    float *y;
    const float *bias;       /* m, or NULL */
    const float *res;        /* shaped like Y, or NULL */
    int64_t flags;           /* BLOCKED_CLIP */
    double lo, hi;
} keel_conv_blocked_args;

#define BLOCKED_CLIP 2

int64_t keel_conv_blocked_args_size(void) { return (int64_t)sizeof(keel_conv_blocked_args); }
int64_t keel_conv_blocked_args_x_offset(void)
{
    return (int64_t)offsetof(keel_conv_blocked_args, x);
}

/* Floats of one thread's scratch: one band's sums of a register tile's blocks. */
int64_t keel_conv_blocked_workspace_f32(const keel_conv_blocked_args *g)
{
    return g->oc_tile * 16 * g->rows * g->w;
}

#if defined(__AVX512F__)
#include <immintrin.h>

#include "transpose.h"

int64_t keel_conv_blocked_lanes_f32(void) { return 16; }

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float s) { return s - (vf){0}; }

/* gemm.c's clip, lane by lane (NaN stays NaN): the same bits as its epilogue. */
static inline vf clip(vf v, vf lo, vf hi)
{
    vi below = v < lo, above = v > hi;
    vi bits = ((vi)v & ~below) | ((vi)lo & below);
    return (vf)((bits & ~above) | ((vi)hi & above));
}


/* Where a tile reads its three kernel rows: each row's first pixel (the tile's
 * column) in channel 0 and the floats to the next channel; a row above or below the
 * image reads zeros (ZEROS, the same address for every channel). */
typedef struct {
    const float *row[3];
    int64_t cs[3];
} taps;

/* A row of zeros as wide as a tile and its border pixels. */
static const float ZEROS[32];

/* A tile's sums over every channel and tap into buf (pixel p of block o at
 * buf + o * bstride + p * 16); wp: the filters of the tile's first block, wobs floats
 * to the next. Per channel and kernel row kh the tile's filter vectors of the three taps
 * are loaded once and each input pixel q of the row (the tile's first pixel - 1 + q) is
 * broadcast once and multiplied into the outputs q - 2 .. q as their taps kw = 2 .. 0,
 * so every output still sums its taps in the order kh, kw: 16 loads for 48
 * multiply-adds on a tile of 2 x 8 (a load of the filters and a broadcast for every tap
 * and pixel took 30). A tile at the row's left (right) end multiplies zeros for the
 * pixel before (after) the row, as a zero border would give, and reads nothing there:
 * X is read where it lies. */
static inline __attribute__((always_inline)) void
tile(int ob, int np, int left, int right, const taps *t, const float *restrict wp,
     int64_t wobs, int64_t c, float *restrict buf, int64_t bstride)
{
    vf acc[2][16];
    for (int o = 0; o < ob; o++)
        for (int p = 0; p < np; p++) acc[o][p] = (vf){0};
    for (int64_t ic = 0; ic < c; ic++)
        for (int kh = 0; kh < 3; kh++) {
            const float *xx = t->row[kh] + ic * t->cs[kh] - 1, *ww = wp + ic * 144 + kh * 48;
            vf wv[3][2];
#pragma GCC unroll 3
            for (int kw = 0; kw < 3; kw++)
#pragma GCC unroll 2
                for (int o = 0; o < ob; o++) wv[kw][o] = load(ww + kw * 16 + o * wobs);
#pragma GCC unroll 18
            for (int q = 0; q < np + 2; q++) {
                int outside = (q == 0 && left) || (q == np + 1 && right);
                vf xv = outside ? (vf){0} : splat(xx[q]);
#pragma GCC unroll 3
                for (int kw = 0; kw < 3; kw++) {
                    int p = q - kw;
                    if (p < 0 || p >= np) continue;
#pragma GCC unroll 2
                    for (int o = 0; o < ob; o++) acc[o][p] += wv[kw][o] * xv;
                }
            }
        }
    for (int o = 0; o < ob; o++)
        for (int p = 0; p < np; p++) store(buf + o * bstride + p * 16, acc[o][p]);
}

typedef void (*tile_fn)(const taps *, const float *, int64_t, int64_t, float *, int64_t);

#define TILE(OB, NP, L, R)                                                                 \
    static void tile_##OB##_##NP##_##L##R(const taps *t, const float *wp, int64_t wobs,    \
                                          int64_t c, float *buf, int64_t bstride)          \
    {                                                                                      \
        tile(OB, NP, L, R, t, wp, wobs, c, buf, bstride);                                  \
    }
#define TILES(OB, NP) TILE(OB, NP, 0, 0) TILE(OB, NP, 1, 0) TILE(OB, NP, 0, 1) TILE(OB, NP, 1, 1)
TILES(1, 8)
TILES(1, 16)
TILES(2, 8)
#define EDGES(OB, NP)                                                                      \
    {tile_##OB##_##NP##_00, tile_##OB##_##NP##_10, tile_##OB##_##NP##_01,                  \
     tile_##OB##_##NP##_11}
/* By shape (1 x 8, 1 x 16, 2 x 8), then left + 2 * right. */
static const tile_fn TILE_FNS[3][4] = {EDGES(1, 8), EDGES(1, 16), EDGES(2, 8)};

/* One band's tiles of blocks [ob0, ob0 + oc_tile) of image x from output row y0. */
static void band_sums(const keel_conv_blocked_args *g, const float *x, int64_t y0,
                      int64_t ob0, float *buf)
{
    int64_t w = g->w, c = g->c, band = g->rows * w, plane = g->h * w;
    const float *wp = g->filters + ob0 * c * 144;
    for (int64_t r = 0; r < g->rows; r++) {
        taps t;
        for (int kh = 0; kh < 3; kh++) {
            int64_t yr = y0 + r - 1 + kh;
            int inside = yr >= 0 && yr < g->h;
            t.row[kh] = inside ? x + yr * w : ZEROS + 1;
            t.cs[kh] = inside ? plane : 0;
        }
        const float *row[3] = {t.row[0], t.row[1], t.row[2]};
        for (int64_t x0 = 0; x0 < w;) {
            int np = g->oc_tile == 2 || x0 + 16 > w ? 8 : 16;
            int shape = g->oc_tile == 2 ? 2 : np == 16;
            int edges = (x0 == 0) + 2 * (x0 + np == w);
            for (int kh = 0; kh < 3; kh++) t.row[kh] = row[kh] + (t.cs[kh] ? x0 : 0);
            TILE_FNS[shape][edges](&t, wp, c * 144, c, buf + (r * w + x0) * 16, band * 16);
            x0 += np;
        }
    }
}

/* The band's sums in buf into Y's NCHW rows from pixel `at` of each plane of blocks
 * [ob0, ob0 + oc_tile), sixteen pixels a transpose, with the epilogue. */
static void band_store(const keel_conv_blocked_args *g, const float *buf, int64_t image,
                       int64_t at, int64_t ob0)
{
    int64_t band = g->rows * g->w, plane = g->h * g->w;
    int clipped = (g->flags & BLOCKED_CLIP) != 0;
    vf lo = splat((float)g->lo), hi = splat((float)g->hi);
    for (int64_t o = 0; o < g->oc_tile; o++)
        for (int64_t p0 = 0; p0 < band; p0 += 16) {
            __m512 v[16];
            for (int j = 0; j < 16; j++)
                v[j] = _mm512_loadu_ps(buf + (o * band + p0 + j) * 16);
            transpose16(v);
            for (int j = 0; j < 16; j++) {
                int64_t ch = (ob0 + o) * 16 + j, to = (image * g->m + ch) * plane + at + p0;
                vf s = (vf)v[j];
                if (g->bias) s += g->bias[ch];
                if (g->res) s += load(g->res + to);
                if (clipped) s = clip(s, lo, hi);
                store(g->y + to, s);
            }
        }
}

/* Units [lo, hi): unit u is band u % bands of image u / bands. */
void keel_conv_blocked_f32(const keel_conv_blocked_args *g, float *scratch, int64_t lo,
                           int64_t hi)
{
    int64_t bands = g->h / g->rows;
    for (int64_t u = lo; u < hi;) {
        int64_t image = u / bands, end = (image + 1) * bands < hi ? (image + 1) * bands : hi;
        const float *x = g->x + image * g->c * g->h * g->w;
        for (int64_t ob0 = 0; ob0 < g->m / 16; ob0 += g->oc_tile)
            for (int64_t b = u; b < end; b++) {
                int64_t y0 = b % bands * g->rows;
                band_sums(g, x, y0, ob0, scratch);
                band_store(g, scratch, image, y0 * g->w, ob0);
            }
        u = end;
    }
}
#else
int64_t keel_conv_blocked_lanes_f32(void) { return 0; }

void keel_conv_blocked_f32(const keel_conv_blocked_args *g, float *scratch, int64_t lo,
                           int64_t hi)
{
    (void)g, (void)scratch, (void)lo, (void)hi;
}
#endif

static void blocked_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    keel_conv_blocked_f32(ctx, scratch, lo, hi);
}

/* keel_conv_blocked_f32 over units [0, units) in `parts` chunks on keel's worker threads
 * (each with its own scratch). Returns 0, or -1 when a scratch could not be had. */
int64_t keel_conv_blocked_mt_f32(const keel_conv_blocked_args *g, int64_t units,
                                 int64_t parts)
{
    return run_parts(blocked_task, (void *)g, units, parts,
                     keel_conv_blocked_workspace_f32(g));
}
