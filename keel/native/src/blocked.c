/* A direct 3x3 stride-1 convolution with the output channels in the vector lanes.
 *
 *   Y[n][m][y][x] = clip(sum over c, kh, kw of W[m][c][kh][kw] * Xpad[n][c][y + kh][x + kw]
 *                        + bias[m] + R[n][m][y][x], lo, hi)
 *
 * for one pixel of zero padding on every side (ResNet's 3x3 convs). X, Y and R are each
 * NCHW or channel-blocked, [N][C / 16][H][W][16] (flags BLOCKED_X, BLOCKED_Y, BLOCKED_R:
 * the cpu planner's float NCHWc region, whose values stay blocked between its convs).
 * The filters are packed once as [M / 16][C][9][16]: sixteen output channels, one
 * vector, a tap. A register tile is oc_tile blocks of 16 channels by a run of pixels of
 * one output row; per channel and kernel row it loads the tile's filter vectors once
 * and broadcasts each input value of the row once, for three taps (tile() below), none
 * of them through lane masks (gemm.c's masked conv loads its taps through masks across
 * cache lines). X is read where it lies in either layout (a pixel's value of a channel
 * is 1 float from the next pixel's in NCHW, 16 in the blocked layout): rows above and
 * below the image read a row of zeros, the pixels left and right of a row are zeros in
 * registers. A band of `rows` output rows (rows * W a multiple of 16) is stored in a
 * buffer as [pixel][16 channels], then written to Y with the epilogue: whole vectors
 * where Y is blocked, transposed sixteen pixels at a time into NCHW rows where it is
 * not (an R in the other layout than Y's is transposed the same way as it is read).
 *
 * Each element of Y is the sum over c, kh, kw in that order from 0 by fused
 * multiply-adds, then + bias, + R, clip: the masked and gathered conv tiles' chain
 * (gemm.c, the depth p = c * 9 + kh * 3 + kw), so bitwise their Y in any layout, for
 * any split over threads (the border's zeros are multiplied as a zero-bordered copy
 * would give them: an infinite filter tap gives NaN there, as in the reference). A unit
 * is one band of one group of output channels (`groups` equal groups of whole register
 * tiles: the planner's grid of bands x channel groups) of one image.
 *
 * AVX-512 builds only: elsewhere keel_conv_blocked_lanes_f32 says 0 and the cpu planner
 * does not plan the form.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "enums.h"
#include "parallel.h"

typedef struct {
    int64_t n, c, h, w, m;   /* X (n, c, h, w), Y (n, m, h, w); m a multiple of 16 */
    int64_t oc_tile;         /* blocks of 16 output channels a register tile: 1 or 2 */
    int64_t rows;            /* output rows a unit (rows * w a multiple of 16, h too) */
    int64_t groups;          /* groups of output channels: whole register tiles each */
    const float *filters;    /* [m / 16][c][9][16] */
    const float *x;
    float *y;
    const float *bias;       /* m, or NULL */
    const float *res;        /* shaped like Y, or NULL */
    int64_t flags;           /* BLOCKED_CLIP, BLOCKED_X, BLOCKED_Y, BLOCKED_R */
    double lo, hi;
} keel_conv_blocked_args;

#define BLOCKED_CLIP 2
#define BLOCKED_X 4              /* X is [n][c / 16][h][w][16] (else NCHW) */
#define BLOCKED_Y 8              /* Y is [n][m / 16][h][w][16] */
#define BLOCKED_R 16             /* R is [n][m / 16][h][w][16] */

/* The flags by name, checked at load (keel.backends.cpu.native_blocked). */
#define BLOCKED_FLAGS(X) X(BLOCKED_CLIP) X(BLOCKED_X) X(BLOCKED_Y) X(BLOCKED_R)
KEEL_ENUM_EXPORT(keel_conv_blocked_flags, BLOCKED_FLAGS)

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
 * column) in channel 0, the floats to the next channel of a group and to the next
 * group of `gsize` channels (NCHW: one group of every channel; blocked: groups of 16);
 * a row above or below the image reads zeros (ZEROS, the same address for every
 * channel). */
typedef struct {
    const float *row[3];
    int64_t cs[3], gs[3];
    int64_t gsize;
} taps;

/* A row of zeros as wide as a tile and its border pixels, 16 floats a pixel. */
static const float ZEROS[18 * 16 + 16];

/* A tile's sums over every channel and tap into buf (pixel p of block o at
 * buf + o * bstride + p * 16); wp: the filters of the tile's first block, wobs floats
 * to the next. Per channel and kernel row kh the tile's filter vectors of the three taps
 * are loaded once and each input pixel q of the row (the tile's first pixel - 1 + q) is
 * broadcast once and multiplied into the outputs q - 2 .. q as their taps kw = 2 .. 0,
 * so every output still sums its taps in the order kh, kw: 16 loads for 48
 * multiply-adds on a tile of 2 x 8 (a load of the filters and a broadcast for every tap
 * and pixel took 30 loads for them). A tile at the row's left (right) end multiplies zeros for the
 * pixel before (after) the row, as a zero border would give, and reads nothing there:
 * X is read where it lies. */
static inline __attribute__((always_inline)) void
tile(int ob, int np, int left, int right, int ps, const taps *t, const float *restrict wp,
     int64_t wobs, int64_t c, float *restrict buf, int64_t bstride)
{
    vf acc[2][16];
    for (int o = 0; o < ob; o++)
        for (int p = 0; p < np; p++) acc[o][p] = (vf){0};
    for (int64_t ic = 0; ic < c; ic++)
        for (int kh = 0; kh < 3; kh++) {
            int64_t g = ic / t->gsize, ci = ic - g * t->gsize;
            const float *xx = t->row[kh] + g * t->gs[kh] + ci * t->cs[kh] - ps;
            const float *ww = wp + ic * 144 + kh * 48;
            vf wv[3][2];
#pragma GCC unroll 3
            for (int kw = 0; kw < 3; kw++)
#pragma GCC unroll 2
                for (int o = 0; o < ob; o++) wv[kw][o] = load(ww + kw * 16 + o * wobs);
#pragma GCC unroll 18
            for (int q = 0; q < np + 2; q++) {
                int outside = (q == 0 && left) || (q == np + 1 && right);
                vf xv = outside ? (vf){0} : splat(xx[q * ps]);
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

#define TILE(OB, NP, L, R, PS)                                                             \
    static void tile_##OB##_##NP##_##L##R##_##PS(const taps *t, const float *wp,           \
                                                 int64_t wobs, int64_t c, float *buf,      \
                                                 int64_t bstride)                          \
    {                                                                                      \
        tile(OB, NP, L, R, PS, t, wp, wobs, c, buf, bstride);                              \
    }
#define TILES(OB, NP, PS)                                                                  \
    TILE(OB, NP, 0, 0, PS) TILE(OB, NP, 1, 0, PS) TILE(OB, NP, 0, 1, PS) TILE(OB, NP, 1, 1, PS)
TILES(1, 8, 1)
TILES(1, 16, 1)
TILES(2, 8, 1)
TILES(1, 8, 16)
TILES(1, 16, 16)
TILES(2, 8, 16)
#define EDGES(OB, NP, PS)                                                                  \
    {tile_##OB##_##NP##_00_##PS, tile_##OB##_##NP##_10_##PS, tile_##OB##_##NP##_01_##PS,   \
     tile_##OB##_##NP##_11_##PS}
/* By X's layout (NCHW, blocked), shape (1 x 8, 1 x 16, 2 x 8), then left + 2 * right. */
static const tile_fn TILE_FNS[2][3][4] = {
    {EDGES(1, 8, 1), EDGES(1, 16, 1), EDGES(2, 8, 1)},
    {EDGES(1, 8, 16), EDGES(1, 16, 16), EDGES(2, 8, 16)}};

/* One band's tiles of blocks [ob0, ob0 + oc_tile) of image x from output row y0. */
static void band_sums(const keel_conv_blocked_args *g, const float *x, int64_t y0,
                      int64_t ob0, float *buf)
{
    int64_t w = g->w, c = g->c, band = g->rows * w, plane = g->h * w;
    int blocked = (g->flags & BLOCKED_X) != 0;
    int64_t ps = blocked ? 16 : 1;
    const float *wp = g->filters + ob0 * c * 144;
    for (int64_t r = 0; r < g->rows; r++) {
        taps t;
        t.gsize = blocked ? 16 : c;
        for (int kh = 0; kh < 3; kh++) {
            int64_t yr = y0 + r - 1 + kh;
            int inside = yr >= 0 && yr < g->h;
            t.row[kh] = inside ? x + yr * w * ps : ZEROS + 16;
            t.cs[kh] = inside ? (blocked ? 1 : plane) : 0;
            t.gs[kh] = inside && blocked ? plane * 16 : 0;
        }
        const float *row[3] = {t.row[0], t.row[1], t.row[2]};
        for (int64_t x0 = 0; x0 < w;) {
            int np = g->oc_tile == 2 || x0 + 16 > w ? 8 : 16;
            int shape = g->oc_tile == 2 ? 2 : np == 16;
            int edges = (x0 == 0) + 2 * (x0 + np == w);
            for (int kh = 0; kh < 3; kh++) t.row[kh] = row[kh] + (t.cs[kh] ? x0 * ps : 0);
            TILE_FNS[blocked][shape][edges](&t, wp, c * 144, c, buf + (r * w + x0) * 16,
                                            band * 16);
            x0 += np;
        }
    }
}

/* Sixteen vectors of 16 floats from `at`, `step` floats apart, transposed: r[j] is the
 * j-th float of each (R's 16 channels of 16 pixels in the other layout than Y's). */
static inline void load_transposed(const float *at, int64_t step, __m512 *r)
{
    for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_ps(at + j * step);
    transpose16(r);
}

/* The band's sums in buf into Y from pixel `at` of each plane of blocks
 * [ob0, ob0 + oc_tile), sixteen pixels at a time, with the epilogue: whole vectors
 * into a blocked Y, transposed into NCHW rows otherwise. */
static void band_store(const keel_conv_blocked_args *g, const float *buf, int64_t image,
                       int64_t at, int64_t ob0)
{
    int64_t band = g->rows * g->w, plane = g->h * g->w, blocks = g->m / 16;
    int clipped = (g->flags & BLOCKED_CLIP) != 0, y_blocked = (g->flags & BLOCKED_Y) != 0;
    int r_blocked = (g->flags & BLOCKED_R) != 0;
    vf lo = splat((float)g->lo), hi = splat((float)g->hi);
    for (int64_t o = 0; o < g->oc_tile; o++) {
        int64_t ob = ob0 + o;
        /* where block ob's pixel at + p0 lies in a blocked and in an NCHW array */
        int64_t bat = ((image * blocks + ob) * plane + at) * 16;
        int64_t nat = (image * g->m + ob * 16) * plane + at;
        for (int64_t p0 = 0; p0 < band; p0 += 16) {
            __m512 v[16], r[16];
            for (int j = 0; j < 16; j++)
                v[j] = _mm512_loadu_ps(buf + (o * band + p0 + j) * 16);
            if (!y_blocked) transpose16(v);
            if (g->res && r_blocked != y_blocked)
                load_transposed(r_blocked ? g->res + bat + p0 * 16 : g->res + nat + p0,
                                r_blocked ? 16 : plane, r);
            for (int j = 0; j < 16; j++) {
                /* j: a pixel of a blocked Y, a channel of an NCHW one */
                int64_t to = y_blocked ? bat + (p0 + j) * 16 : nat + j * plane + p0;
                vf s = (vf)v[j];
                if (g->bias)
                    s += y_blocked ? load(g->bias + ob * 16) : splat(g->bias[ob * 16 + j]);
                if (g->res) s += r_blocked == y_blocked ? load(g->res + to) : (vf)r[j];
                if (clipped) s = clip(s, lo, hi);
                store(g->y + to, s);
            }
        }
    }
}

/* Units [lo, hi): unit u is band u % bands of channel group u / bands % groups of image
 * u / (bands * groups); a run of one group's bands takes each register tile's filters
 * through all its bands. */
void keel_conv_blocked_f32(const keel_conv_blocked_args *g, float *scratch, int64_t lo,
                           int64_t hi)
{
    int64_t bands = g->h / g->rows, per = g->m / 16 / g->groups;
    for (int64_t u = lo; u < hi;) {
        int64_t run = u / bands, end = (run + 1) * bands < hi ? (run + 1) * bands : hi;
        int64_t image = run / g->groups, first = run % g->groups * per;
        const float *x = g->x + image * g->c * g->h * g->w;
        for (int64_t ob0 = first; ob0 < first + per; ob0 += g->oc_tile)
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
