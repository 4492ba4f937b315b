/* A direct 3x3 or 1x1 convolution, stride 1 or 2, with the output channels in the vector
 * lanes.
 *
 *   Y[n][m][y][x] = clip(sum over c, kh, kw of
 *                        W[m][c][kh][kw] * Xpad[n][c][S * y + kh][S * x + kw]
 *                        + bias[m] + R[n][m][y][x], lo, hi)
 *
 * for stride S, a 3x3 kernel with one pixel of zero padding on every side or a 1x1 kernel
 * with none (ResNet's convs and its downsampling shortcuts). X, Y and R are each
 * NCHW or channel-blocked, [N][C / 16][H][W][16] (flags BLOCKED_X, BLOCKED_Y, BLOCKED_R:
 * the cpu planner's float NCHWc region, whose values stay blocked between its convs).
 * The filters are packed once as [M / 16][C][K * K][16]: sixteen output channels, one
 * vector, a tap. A register tile is oc_tile blocks of 16 channels by a run of pixels of
 * one output row; per channel and kernel row it loads the tile's filter vectors once
 * and broadcasts each input value the row's taps read once, for every tap that reads it
 * (three at stride 1, one or two at stride 2; tile() below; a row that is not whole
 * 8-pixel tiles ends in a tile of its last 1 to 7 pixels and the tile's blocks; a
 * 3x3 stride-2 conv of two blocks a tile whose rows are 14 or 28 pixels may be told
 * (`wide`) to run 2 x 14 tiles instead, fewer tiles a row for the same sums), none
 * of them through lane masks (gemm.c's masked conv loads its taps through masks across
 * cache lines). X is read where it lies in either layout (a pixel's value of a channel
 * is 1 float from the next pixel's in NCHW, 16 in the blocked layout): rows above and
 * below the image read a row of zeros, the pixels left and right of a row are zeros in
 * registers. A band of `rows` output rows is stored in a buffer as [pixel][16
 * channels], then written to Y with the epilogue: whole vectors where Y is blocked,
 * transposed sixteen pixels at a time into NCHW rows where it is not (a band's last run
 * of fewer than 16 pixels through lane masks); an R in the other layout than Y's is
 * transposed the same way as it is read.
 *
 * Each element of Y is the sum over c, kh, kw in that order from 0 by fused
 * multiply-adds, then + bias, + R, clip: the masked and gathered conv tiles' chain
 * (gemm.c, the depth p = (c * K + kh) * K + kw), so bitwise their Y (3x3 stride 1) in
 * any layout, for any split over threads (the border's zeros are multiplied as a
 * zero-bordered copy would give them: an infinite filter tap gives NaN there, as in the
 * reference). A unit
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
    int64_t n, c, h, w, m;   /* X (n, c, h, w), Y (n, m, oh, ow); m a multiple of 16 */
    int64_t oh, ow;
    int64_t kernel, stride;  /* 3 (padded by one) or 1 (unpadded); 1 or 2 */
    int64_t oc_tile;         /* blocks of 16 output channels a register tile: 1 or 2 */
    int64_t rows;            /* output rows a unit (oh a multiple of it) */
    int64_t groups;          /* groups of output channels: whole register tiles each */
    const float *filters;    /* [m / 16][c][kernel * kernel][16] */
    const float *x;
    float *y;
    const float *bias;       /* m, or NULL */
    const float *res;        /* shaped like Y, or NULL */
    int64_t flags;           /* BLOCKED_CLIP, BLOCKED_X, BLOCKED_Y, BLOCKED_R */
    int64_t wide;            /* 0, or 14: 2 x 14-pixel tiles (3x3 stride 2, oc_tile 2,
                                ow a multiple of 14) */
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
    return g->oc_tile * 16 * g->rows * g->ow;
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
 * group of channels (NCHW: one group of every channel; blocked: groups of 16);
 * a row above or below the image reads zeros (ZEROS, the same address for every
 * channel). */
typedef struct {
    const float *row[3];
    int64_t cs[3], gs[3];
} taps;

/* A row of zeros as wide as a tile's input pixels (33 at stride 2) and a pixel before
 * it, 16 floats a pixel. */
static const float ZEROS[34 * 16 + 16];

/* A tile's sums over every channel and tap of a K x K kernel at stride S into buf (pixel p
 * of block o at buf + o * bstride + p * 16); wp: the filters of the tile's first block,
 * wobs floats to the next. Per channel and kernel row kh the tile's filter vectors of
 * the row's taps are loaded once and each input pixel q of the row that a tap reads (the
 * tile's first pixel's column S * x0 - K / 2, + q) is broadcast once and multiplied into
 * every output p whose tap kw = q - S * p reads it (an output's taps come in rising q,
 * so every output still sums its taps in the order kh, kw): at stride 1, 16
 * loads for 48 multiply-adds on a tile of 2 x 8 (a load of the filters and a broadcast
 * for every tap and pixel took 30 loads for them). A 3x3 tile at the row's left (right)
 * end multiplies zeros for the pixel before (after) the row, as a zero border would
 * give, and reads nothing there: X is read where it lies. */
static inline __attribute__((always_inline)) void
tile(int K, int S, int ob, int np, int left, int right, int ps, const taps *t,
     const float *restrict wp, int64_t wobs, int64_t c, float *restrict buf, int64_t bstride)
{
    vf acc[2][16];
    int last = S * (np - 1) + K - 1;    /* the last input pixel a tap reads */
    for (int o = 0; o < ob; o++)
        for (int p = 0; p < np; p++) acc[o][p] = (vf){0};
    for (int64_t ic = 0; ic < c; ic++)
        for (int kh = 0; kh < K; kh++) {
            /* X's channel group and place in it: PS says the layout (a blocked X's
             * groups are 16 channels, an NCHW one's a single group), so no division */
            int64_t g = ps == 16 ? ic >> 4 : 0, ci = ps == 16 ? ic & 15 : ic;
            const float *xx = t->row[kh] + g * t->gs[kh] + ci * t->cs[kh] - K / 2 * ps;
            const float *ww = wp + (ic * K + kh) * K * 16;
            vf wv[3][2];
#pragma GCC unroll 3
            for (int kw = 0; kw < K; kw++)
#pragma GCC unroll 2
                for (int o = 0; o < ob; o++) wv[kw][o] = load(ww + kw * 16 + o * wobs);
#pragma GCC unroll 34
            for (int q = 0; q <= last; q++) {
                int read = 0;
#pragma GCC unroll 3
                for (int kw = 0; kw < K; kw++)
                    read |= q >= kw && (q - kw) % S == 0 && (q - kw) / S < np;
                if (!read) continue;
                int outside = K == 3 && ((q == 0 && left) || (q == last && right));
                vf xv = outside ? (vf){0} : splat(xx[q * ps]);
#pragma GCC unroll 3
                for (int kw = 0; kw < K; kw++) {
                    int d = q - kw, p = d / S;
                    if (d < 0 || d % S || p >= np) continue;
#pragma GCC unroll 2
                    for (int o = 0; o < ob; o++) acc[o][p] += wv[kw][o] * xv;
                }
            }
        }
    for (int o = 0; o < ob; o++)
        for (int p = 0; p < np; p++) store(buf + o * bstride + p * 16, acc[o][p]);
}

typedef void (*tile_fn)(const taps *, const float *, int64_t, int64_t, float *, int64_t);

#define TILE(K, S, OB, NP, L, R, PS)                                                       \
    static void tile_##K##S##_##OB##_##NP##_##L##R##_##PS(                                 \
        const taps *t, const float *wp, int64_t wobs, int64_t c, float *buf,               \
        int64_t bstride)                                                                   \
    {                                                                                      \
        tile(K, S, OB, NP, L, R, PS, t, wp, wobs, c, buf, bstride);                        \
    }
#define TILES3(S, OB, NP, PS)                                                              \
    TILE(3, S, OB, NP, 0, 0, PS) TILE(3, S, OB, NP, 1, 0, PS) TILE(3, S, OB, NP, 0, 1, PS)  \
    TILE(3, S, OB, NP, 1, 1, PS)
#define SHAPES3(S, PS) TILES3(S, 1, 8, PS) TILES3(S, 1, 16, PS) TILES3(S, 2, 8, PS)
#define SHAPES1(S, PS)                                                                     \
    TILE(1, S, 1, 8, 0, 0, PS) TILE(1, S, 1, 16, 0, 0, PS) TILE(1, S, 2, 8, 0, 0, PS)
SHAPES3(1, 1)
SHAPES3(1, 16)
SHAPES3(2, 1)
SHAPES3(2, 16)
SHAPES1(1, 1)
SHAPES1(1, 16)
SHAPES1(2, 1)
SHAPES1(2, 16)
#define EDGES3(S, OB, NP, PS)                                                              \
    {tile_3##S##_##OB##_##NP##_00_##PS, tile_3##S##_##OB##_##NP##_10_##PS,                 \
     tile_3##S##_##OB##_##NP##_01_##PS, tile_3##S##_##OB##_##NP##_11_##PS}
#define EDGES1(S, OB, NP, PS) /* a 1x1 tile reads no border */                             \
    {tile_1##S##_##OB##_##NP##_00_##PS, tile_1##S##_##OB##_##NP##_00_##PS,                 \
     tile_1##S##_##OB##_##NP##_00_##PS, tile_1##S##_##OB##_##NP##_00_##PS}
#define LAYOUTS(E, S)                                                                      \
    {{E(S, 1, 8, 1), E(S, 1, 16, 1), E(S, 2, 8, 1)},                                       \
     {E(S, 1, 8, 16), E(S, 1, 16, 16), E(S, 2, 8, 16)}}
/* By kernel and stride (3x3 stride 1 and 2, 1x1 stride 1 and 2), X's layout (NCHW,
 * blocked), shape (1 x 8, 1 x 16, 2 x 8), then left + 2 * right. */
static const tile_fn TILE_FNS[4][2][3][4] = {LAYOUTS(EDGES3, 1), LAYOUTS(EDGES3, 2),
                                             LAYOUTS(EDGES1, 1), LAYOUTS(EDGES1, 2)};

/* A row's last 1 to 7 pixels (an output row that is not whole 8-pixel tiles: ResNet-18's
 * 28, 14 and 7), the register tile's one or two blocks of 16 channels: two blocks keep
 * 2 x NP sums in flight and load each input value once for both (one block a tile left
 * a 7-pixel row 7 chains of multiply-adds and twice the broadcasts). */
#define TAIL3(S, NP, PS) TILES3(S, 1, NP, PS) TILES3(S, 2, NP, PS)
#define TAIL1(S, NP, PS) TILE(1, S, 1, NP, 0, 0, PS) TILE(1, S, 2, NP, 0, 0, PS)
#define TAILS(T, S, PS)                                                                    \
    T(S, 1, PS) T(S, 2, PS) T(S, 3, PS) T(S, 4, PS) T(S, 5, PS) T(S, 6, PS) T(S, 7, PS)
TAILS(TAIL3, 1, 1)
TAILS(TAIL3, 1, 16)
TAILS(TAIL3, 2, 1)
TAILS(TAIL3, 2, 16)
TAILS(TAIL1, 1, 1)
TAILS(TAIL1, 1, 16)
TAILS(TAIL1, 2, 1)
TAILS(TAIL1, 2, 16)
#define TAIL_EDGES(E, S, OB, PS)                                                           \
    {E(S, OB, 1, PS), E(S, OB, 2, PS), E(S, OB, 3, PS), E(S, OB, 4, PS), E(S, OB, 5, PS),    \
     E(S, OB, 6, PS), E(S, OB, 7, PS)}
#define TAIL_LAYOUTS(E, S)                                                                 \
    {{TAIL_EDGES(E, S, 1, 1), TAIL_EDGES(E, S, 2, 1)},                                     \
     {TAIL_EDGES(E, S, 1, 16), TAIL_EDGES(E, S, 2, 16)}}
/* As TILE_FNS, by the blocks a tile less one and the tail's pixels less one in place of
 * the shape. */
static const tile_fn TAIL_FNS[4][2][2][7][4] = {
    TAIL_LAYOUTS(EDGES3, 1), TAIL_LAYOUTS(EDGES3, 2), TAIL_LAYOUTS(EDGES1, 1),
    TAIL_LAYOUTS(EDGES1, 2)};

/* Two blocks by 14 pixels of a 3x3 stride-2 tile (`wide`): 28 sums, so fewer filter
 * loads and tile starts a row than 8 + 6 or 8 + 8 + 8 + 4 pixels. */
TILES3(2, 2, 14, 1)
TILES3(2, 2, 14, 16)
static const tile_fn WIDE_FNS[2][4] = {EDGES3(2, 2, 14, 1), EDGES3(2, 2, 14, 16)};

/* One band's tiles of blocks [ob0, ob0 + oc_tile) of image x from output row y0. */
static void band_sums(const keel_conv_blocked_args *g, const float *x, int64_t y0,
                      int64_t ob0, float *buf)
{
    int64_t ow = g->ow, c = g->c, band = g->rows * ow, plane = g->h * g->w;
    int K = (int)g->kernel, S = (int)g->stride;
    int blocked = (g->flags & BLOCKED_X) != 0;
    int64_t ps = blocked ? 16 : 1;
    const float *wp = g->filters + ob0 * c * K * K * 16;
    const tile_fn(*fns)[4] = TILE_FNS[(K == 1) * 2 + (S == 2)][blocked];
    const tile_fn(*tails)[4] = TAIL_FNS[(K == 1) * 2 + (S == 2)][blocked][g->oc_tile - 1];
    /* the wide tiles only where they fit the row (the caller's promise, checked) */
    int wide = g->wide == 14 && K == 3 && S == 2 && g->oc_tile == 2 && ow % 14 == 0;
    for (int64_t r = 0; r < g->rows; r++) {
        taps t;
        for (int kh = 0; kh < K; kh++) {
            int64_t yr = S * (y0 + r) - K / 2 + kh;
            int inside = yr >= 0 && yr < g->h;
            t.row[kh] = inside ? x + yr * g->w * ps : ZEROS + 16;
            t.cs[kh] = inside ? (blocked ? 1 : plane) : 0;
            t.gs[kh] = inside && blocked ? plane * 16 : 0;
        }
        const float *row[3] = {t.row[0], t.row[1], t.row[2]};
        for (int64_t x0 = 0; x0 < ow;) {
            int64_t left = ow - x0;
            int np = wide ? 14
                     : left < 8 ? (int)left : g->oc_tile == 2 || left < 16 ? 8 : 16;
            int shape = g->oc_tile == 2 ? 2 : np == 16;
            /* the tile's first and last taps' columns outside the row */
            int edges = (S * x0 - K / 2 < 0) + 2 * (S * (x0 + np - 1) + K / 2 >= g->w);
            for (int kh = 0; kh < K; kh++)
                t.row[kh] = row[kh] + (t.cs[kh] ? S * x0 * ps : 0);
            float *at = buf + (r * ow + x0) * 16;
            if (wide)
                WIDE_FNS[blocked][edges](&t, wp, c * K * K * 16, c, at, band * 16);
            else if (np < 8) /* the row's tail: the tile's blocks together */
                tails[np - 1][edges](&t, wp, c * K * K * 16, c, at, band * 16);
            else
                fns[shape][edges](&t, wp, c * K * K * 16, c, at, band * 16);
            x0 += np;
        }
    }
}

/* `n` vectors of `lanes` floats from `at`, `step` floats apart (the rest zeros),
 * transposed: r[j] is the j-th float of each (R's 16 channels of 16 pixels in the other
 * layout than Y's; fewer at a band's last pixels). */
static inline void load_transposed(const float *at, int64_t step, int n, __mmask16 lanes,
                                   __m512 *r)
{
    for (int j = 0; j < 16; j++)
        r[j] = j < n ? _mm512_maskz_loadu_ps(lanes, at + j * step) : _mm512_setzero_ps();
    transpose16(r);
}

/* The band's sums in buf into Y from pixel `at` of each plane of blocks
 * [ob0, ob0 + oc_tile), sixteen pixels at a time (the band's last run may be fewer, read
 * and written through lane masks), with the epilogue: whole vectors into a blocked Y,
 * transposed into NCHW rows otherwise. */
static void band_store(const keel_conv_blocked_args *g, const float *buf, int64_t image,
                       int64_t at, int64_t ob0)
{
    int64_t band = g->rows * g->ow, plane = g->oh * g->ow, blocks = g->m / 16;
    int clipped = (g->flags & BLOCKED_CLIP) != 0, y_blocked = (g->flags & BLOCKED_Y) != 0;
    int r_blocked = (g->flags & BLOCKED_R) != 0;
    vf lo = splat((float)g->lo), hi = splat((float)g->hi);
    for (int64_t o = 0; o < g->oc_tile; o++) {
        int64_t ob = ob0 + o;
        /* where block ob's pixel at + p0 lies in a blocked and in an NCHW array */
        int64_t bat = ((image * blocks + ob) * plane + at) * 16;
        int64_t nat = (image * g->m + ob * 16) * plane + at;
        for (int64_t p0 = 0; p0 < band; p0 += 16) {
            int n = band - p0 < 16 ? (int)(band - p0) : 16;  /* pixels in this run */
            __mmask16 run = (__mmask16)((1u << n) - 1);
            __m512 v[16], r[16];
            for (int j = 0; j < 16; j++)
                v[j] = j < n ? _mm512_loadu_ps(buf + (o * band + p0 + j) * 16)
                             : _mm512_setzero_ps();
            if (!y_blocked) transpose16(v);
            if (g->res && r_blocked != y_blocked) {
                if (r_blocked)       /* n pixels of 16 channels */
                    load_transposed(g->res + bat + p0 * 16, 16, n, 0xffff, r);
                else                 /* 16 channels of n pixels */
                    load_transposed(g->res + nat + p0, plane, 16, run, r);
            }
            /* j: a pixel of a blocked Y (n of them), a channel of an NCHW one (its n
             * pixels through the mask) */
            for (int j = 0; j < (y_blocked ? n : 16); j++) {
                int64_t to = y_blocked ? bat + (p0 + j) * 16 : nat + j * plane + p0;
                __mmask16 lanes = y_blocked ? 0xffff : run;
                vf s = (vf)v[j];
                if (g->bias)
                    s += y_blocked ? load(g->bias + ob * 16) : splat(g->bias[ob * 16 + j]);
                if (g->res)
                    s += r_blocked == y_blocked ? (vf)_mm512_maskz_loadu_ps(lanes, g->res + to)
                                                : (vf)r[j];
                if (clipped) s = clip(s, lo, hi);
                _mm512_mask_storeu_ps(g->y + to, lanes, (__m512)s);
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
    int64_t bands = g->oh / g->rows, per = g->m / 16 / g->groups;
    for (int64_t u = lo; u < hi;) {
        int64_t run = u / bands, end = (run + 1) * bands < hi ? (run + 1) * bands : hi;
        int64_t image = run / g->groups, first = run % g->groups * per;
        const float *x = g->x + image * g->c * g->h * g->w;
        for (int64_t ob0 = first; ob0 < first + per; ob0 += g->oc_tile)
            for (int64_t b = u; b < end; b++) {
                int64_t y0 = b % bands * g->rows;
                band_sums(g, x, y0, ob0, scratch);
                band_store(g, scratch, image, y0 * g->ow, ob0);
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
