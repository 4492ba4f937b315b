/* Packed single-precision GEMM with a fused epilogue.
 *
 *   C[t] = clip(alpha * A[t] @ B[t] + bias + R[t], lo, hi)      t over a batch
 *
 * The micro-kernel keeps an mr x nv-vector tile of C in registers and adds one
 * rank-1 update per step of k: nv vector loads of B, mr broadcasts of A. A is
 * read from panels of MR rows (k x MR, row index fastest) and B from panels of
 * NR columns (k x NR), zero-padded at the edges. keel packs a constant operand
 * once per model (a MatMul's weight on the right, a conv's filter on the left)
 * with keel_gemm_pack_f32; the other operand is packed here block by block into
 * a small per-call workspace, or, when B's rows already hold NR contiguous
 * columns and few row panels will read them, read in place. A raw B of one depth
 * block (a 1x1 conv's input, read where it lies) runs row panel by row panel,
 * each sweeping a wide block of columns, so that C's rows stream out in long runs
 * (row_panels_first); with AVX-512, a product of few rows against such a B runs
 * in tall tiles instead, every row of C over one column vector at once (tall). A B
 * row may also be given by a table of row offsets (an implicit-GEMM convolution
 * reads the taps of a padded image that way, without an im2col matrix).
 *
 * The depth runs in blocks of KC, so a KC x NR block of B stays in cache while
 * the row panels of A pass over it; partial sums of a block go to C and come back
 * for the next one, and the epilogue (alpha, a bias per row or per column, a
 * residual R with its own leading dimension, clip) runs on the last block's
 * store, so C is written once with its final value. The clip keeps NaN
 * (x < lo and x > hi are both false for NaN), as NumPy's clip does. A column
 * map may send C's columns to arbitrary offsets of a row, or nowhere (a conv's
 * "wide" columns that fall in the padding); with AVX-512 a mapped tile is stored
 * by masked moves straight from the registers (measured on a 16 -> 16 3x3 conv on
 * 32x32 at batch 32 read through the wide layout, whose 32-column panels all cross
 * an output row: 2.40 ms through a stack buffer, 2.05 ms masked).
 *
 * Work splits into ranges of row panels or column panels of the batch, or a grid of
 * tiles (keel_gemm_tiles_f32: row groups x column groups of every product): every
 * element of C is computed by the same sequence of operations whatever range or tile
 * it falls in, so any split over threads gives bitwise the same C.
 *
 * Plain C11 with GNU vector extensions; one broadcast per ISA through its
 * intrinsic. Without a SIMD extension the vectors are lowered to scalars.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "enums.h"

#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

/* Vector width VW (floats), tile rows MR and tile vectors NV (NR = NV * VW columns).
 * AVX-512 has 32 vector registers: 8 x 32 keeps 16 accumulators, 2 B vectors and a
 * broadcast (measured on Zen 4: 8x32 107 GFLOP/s at 32x784x512, 12x32 105, 6x64 101,
 * 14x32 93). AVX has 16: 6 x 16 (12 accumulators). */
#if defined(__AVX512F__)
#define VW 16
#define DEFAULT_MR 8
#elif defined(__AVX__)
#define VW 8
#define DEFAULT_MR 6
#elif defined(__ARM_NEON) || defined(__SSE2__)
#define VW 4
#define DEFAULT_MR 6
#else
#define VW 4
#define DEFAULT_MR 4
#endif
#ifndef KEEL_GEMM_MR
#define KEEL_GEMM_MR DEFAULT_MR
#endif
#ifndef KEEL_GEMM_NV
#define KEEL_GEMM_NV 2
#endif
#define MR KEEL_GEMM_MR
#define NV KEEL_GEMM_NV
#define NR (NV * VW)
/* The lanes tiles (below) are built with AVX-512's 8 x 32 tile only (the cpu planner's
 * LANES_GRID): another tile (an 8 x 48 build, KEEL_GEMM_NV=3) runs its panels alone. */
#if defined(__AVX512F__) && KEEL_GEMM_MR == 8 && KEEL_GEMM_NV == 2
#define KEEL_LANES_BUILT 1
#else
#define KEEL_LANES_BUILT 0
#endif
/* Depth per block: each block after the first reloads the partial sums of C, so
 * fewer, deeper blocks win while a KC x NR block of B (64 KiB with AVX-512) stays
 * in L2 (measured at 32 x 784 x 512: 97 GFLOP/s with KC = 256, 102 with 512). */
#ifndef KEEL_GEMM_KC
#define KEEL_GEMM_KC 512
#endif
#define KC KEEL_GEMM_KC
/* Rows per block: an MC x KC block of A (240 KiB) stays in L2 across the column panels. */
#ifndef KEEL_GEMM_MC
#define KEEL_GEMM_MC 240
#endif
#define MC_PANELS ((KEEL_GEMM_MC + MR - 1) / MR)
/* Column panels per block: an MC x NC block of C stays in L2 across the depth blocks
 * (measured: a 128-channel 3x3 conv on 28x28 at batch 32 took 99 ms with every depth
 * block passing over the whole of C, 77 ms in blocks of 256 columns). */
#ifndef KEEL_GEMM_NC
#define KEEL_GEMM_NC 256
#endif
#define NC_PANELS ((KEEL_GEMM_NC + NR - 1) / NR)
/* Read a raw B in place (no packed copy) when a block has at most this many row
 * panels: with few rows to serve, the copy costs more than it saves (measured:
 * 16 x 144 x 1024 at 105 GFLOP/s in place, 67 packed; 512 x 4608 x 1568 at 92
 * in place, 95 packed). */
#define DIRECT_PANELS 16
/* Columns (output pixels) from which a conv's gathered taps run row panel by row panel. */
#define ROWS_FIRST_TAPS_FROM 4096
/* Floats of a packed B block of a product run row panel by row panel (256 KiB). */
#define RF_FLOATS (64 * 1024)
#define MAXR 14 /* tiles are generated for 1 .. MAXR rows (only mr <= MR run) */

#if NV > 4 || MR > MAXR
#error "gemm.c: tiles are generated for MR <= 14 and NV <= 4"
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

#define KEEL_ACCUMULATE 1 /* flags: C holds a value to add to (the first block loads it) */
#define KEEL_CLIP 2       /* flags: clip the result to [lo, hi] */
#define KEEL_STREAM 4     /* flags: B streams from memory (pack it in long runs) */
#define KEEL_NT 16        /* flags: C's final stores bypass the cache (see store_final) */
#define KEEL_TALL 32      /* flags: run in tall tiles where they fit (the cpu planner's
                             choice, keel.backends.cpu.planner.tall_tiles) */
#define KEEL_LANES 64     /* flags: run in lanes tiles where they fit (the cpu planner's
                             choice, keel.backends.cpu.planner.lanes_tiles) */
#define KEEL_LANES_TAIL 128 /* flags: the last column panel, partly filled, in lanes
                              tiles (the cpu planner's lanes_tail) */
#define KEEL_FETCH_SHIFT 8 /* flags >> 8: rows of a packed B the first row panel of a
                              column panel fetches ahead (the cpu planner's fetch_rows;
                              see column_panel) */

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }

/* A final value of C: with KEEL_NT and an aligned vector, a non-temporal store (no read
 * of the line first, not kept in cache: for an output much larger than the cache, which
 * the next layer reads from memory anyway); the writer fences before returning. */
static inline void store_final(float *p, vf v, int64_t flags)
{
#if defined(__AVX512F__)
    if ((flags & KEEL_NT) && !((uintptr_t)p & 63)) {
        _mm512_stream_ps(p, (__m512)v);
        return;
    }
#elif defined(__AVX__)
    if ((flags & KEEL_NT) && !((uintptr_t)p & 31)) {
        _mm256_stream_ps(p, (__m256)v);
        return;
    }
#endif
    (void)flags;
    store(p, v);
}

/* Every lane x (not (vf){0} + x: that is an add, which turns -0.0 into +0.0). */
static inline vf splat(float x)
{
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(x);
#elif defined(__SSE2__)
    return (vf)_mm_set1_ps(x);
#elif defined(__ARM_NEON)
    return (vf)vdupq_n_f32(x);
#else
    vf v;
    for (int i = 0; i < VW; i++) v[i] = x;
    return v;
#endif
}

/* ---- the epilogue ------------------------------------------------------------------- */

typedef struct {
    const float *bias; /* NULL, or per row (bias_kind 1) or per column (2) */
    int64_t bias_kind;
    const float *res; /* NULL, or R with leading dimension ldr */
    int64_t ldr;
    float alpha, lo, hi;
    int64_t flags;
} epilogue;

/* max(v, lo) then min(v, hi), keeping NaN: select by comparisons that are false for NaN. */
static inline vf clip(vf v, vf lo, vf hi)
{
    vi below = v < lo, above = v > hi;
    vi bits = ((vi)v & ~below) | ((vi)lo & below);
    return (vf)((bits & ~above) | ((vi)hi & above));
}

static inline float clip1(float v, float lo, float hi)
{
    if (v < lo) v = lo;
    if (v > hi) v = hi;
    return v;
}

/* The final value of C's row i, columns j .. j + VW. */
static inline vf finish(vf v, const epilogue *e, int64_t i, int64_t j)
{
    if (e->alpha != 1.0f) v *= e->alpha;
    if (e->bias_kind == 1) v += e->bias[i];
    else if (e->bias_kind == 2) v += load(e->bias + j);
    if (e->res) v += load(e->res + i * e->ldr + j);
    if (e->flags & KEEL_CLIP) v = clip(v, splat(e->lo), splat(e->hi));
    return v;
}

static inline float finish1(float v, const epilogue *e, int64_t i, int64_t j)
{
    if (e->alpha != 1.0f) v *= e->alpha;
    if (e->bias_kind == 1) v += e->bias[i];
    else if (e->bias_kind == 2) v += e->bias[j];
    if (e->res) v += e->res[i * e->ldr + j];
    if (e->flags & KEEL_CLIP) v = clip1(v, e->lo, e->hi);
    return v;
}

/* ---- the micro-kernel --------------------------------------------------------------- */

/* Where B's rows come from: row p at b + p * bs, or at b + rows[p] when rows is set. */
typedef struct {
    const float *b;
    int64_t bs;
    const int64_t *rows;
    int64_t ahead; /* 0, or floats past row p whose lines are fetched as row p is read */
} bsource;

/* acc += a[p][i] * b_p[j] for one step p. */
static inline __attribute__((always_inline)) void
rank1(int mr, int nv, const float *restrict a, const float *restrict b, vf acc[MAXR][NV])
{
    vf bv[NV];
    for (int j = 0; j < nv; j++) bv[j] = load(b + j * VW);
    for (int i = 0; i < mr; i++) {
        vf av = splat(a[i]);
        for (int j = 0; j < nv; j++) acc[i][j] += av * bv[j];
    }
}

/* acc[i][j] += sum over p < kc of a[p][i] * B[p][j] (mr rows, nv vectors), one step of
 * p after another for every tile height: an element of C is the same chain of
 * operations whether its row falls in a full tile, a short tail tile or a product of
 * one row, so a row's result does not depend on how many rows the product has (batch
 * invariance). One- and two-row tiles have few chains to hide the FMA latency; they
 * are a product's last row panel, and a product of one row runs in gemv instead.
 */
static inline __attribute__((always_inline)) void
rank_updates(int mr, int nv, int64_t kc, const float *restrict a, const bsource *s,
             vf acc[MAXR][NV])
{
    if (s->rows)
        for (int64_t p = 0; p < kc; p++) rank1(mr, nv, a + p * MR, s->b + s->rows[p], acc);
    else if (s->ahead)
        for (int64_t p = 0; p < kc; p++) {
            const float *f = s->b + p * s->bs + s->ahead;
            for (int j = 0; j < nv * VW; j += 16) __builtin_prefetch(f + j, 0, 3); /* lines */
            rank1(mr, nv, a + p * MR, s->b + p * s->bs, acc);
        }
    else
        for (int64_t p = 0; p < kc; p++) rank1(mr, nv, a + p * MR, s->b + p * s->bs, acc);
}

/* Where one tile of C goes: c points at row i0 and column jbase; column j of the
 * tile is at c + offset(j), offset(j) = j, or map[j] (negative: not stored). */
typedef struct {
    float *c;
    int64_t ldc;
    int64_t cols;       /* columns of the tile in C (<= NR) */
    const int64_t *map; /* NULL: consecutive columns */
    int64_t i0, jbase;  /* C's row and column of c (the epilogue's indices) */
    int load_c, last;
} target;

/* A tile of NR consecutive columns, all inside C: straight from registers. One body
 * for B's rows by a stride and one by a table, each with its loops unrolled and C's
 * address in locals, so the accumulators stay in registers: with the two depth loops
 * joined, the compiler kept them on the stack around each (32 stores and loads a tile,
 * the epilogue's tests per vector), which cost a shallow product (depth 16: a 1x1
 * conv's 16 -> 96 on 112x112) about a third of its multiply-adds' time. */
/* acc[i][j] + bias[i], clipped to [lo, hi] when has_clip, into C (rows ldc apart). */
static inline __attribute__((always_inline)) void
tile_rows_bias(int mr, int nv, vf acc[MAXR][NV], float *c, int64_t ldc, const float *bias,
               int has_clip, float lo, float hi)
{
    vf vlo = splat(lo), vhi = splat(hi);
#pragma GCC unroll 14
    for (int i = 0; i < mr; i++) {
        float b = bias[i];
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++) {
            vf v = acc[i][j] + b;
            if (has_clip) v = clip(v, vlo, vhi);
            store(c + i * ldc + j * VW, v);
        }
    }
}

static inline __attribute__((always_inline)) void
tile_full_body(int mr, int nv, int64_t kc, const float *a, const bsource *s, const target *t,
               const epilogue *e)
{
    vf acc[MAXR][NV];
    float *c = t->c;
    int64_t ldc = t->ldc, i0 = t->i0, j0 = t->jbase;
#pragma GCC unroll 14
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++)
            acc[i][j] = t->load_c ? load(c + i * ldc + j * VW) : (vf){0};
    rank_updates(mr, nv, kc, a, s, acc);
    if (!t->last) {
#pragma GCC unroll 14
        for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
            for (int j = 0; j < nv; j++) store(c + i * ldc + j * VW, acc[i][j]);
        return;
    }
    const epilogue le = *e; /* a local copy: C's stores cannot change it, so its tests
                               and splats are made once a tile, not once a vector */
    if (le.alpha == 1.0f && le.bias_kind == 1 && !le.res && !(le.flags & KEEL_NT)) {
        /* A conv's epilogue (a bias per row, a clip or none): finish's operations in
           its order, its tests made once a tile rather than once a vector. */
        if (le.flags & KEEL_CLIP)
            tile_rows_bias(mr, nv, acc, c, ldc, le.bias + i0, 1, le.lo, le.hi);
        else
            tile_rows_bias(mr, nv, acc, c, ldc, le.bias + i0, 0, 0.0f, 0.0f);
        return;
    }
#pragma GCC unroll 14
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++)
            store_final(c + i * ldc + j * VW, finish(acc[i][j], &le, i0 + i, j0 + j * VW),
                        le.flags);
}

static inline __attribute__((always_inline)) void
tile_full(int mr, int nv, int64_t kc, const float *a, const bsource *s, const target *t,
          const epilogue *e)
{
    if (s->rows) {
        tile_full_body(mr, nv, kc, a, s, t, e);
        return;
    }
    const bsource strided = {s->b, s->bs, NULL, s->ahead};
    tile_full_body(mr, nv, kc, a, &strided, t, e);
}

/* A tile with fewer than NR columns of C goes through a buffer on the stack: its
 * accumulators start from C's first t->cols columns (or zero), ... */
static inline __attribute__((always_inline)) void
part_begin(int mr, int nv, const target *t, float buf[MAXR][NR], vf acc[MAXR][NV])
{
    for (int i = 0; i < mr; i++) {
        memset(buf[i], 0, sizeof buf[i]);
        if (t->load_c) memcpy(buf[i], t->c + i * t->ldc, (size_t)t->cols * sizeof(float));
        for (int j = 0; j < nv; j++) acc[i][j] = load(buf[i] + j * VW);
    }
}

/* ... and only those columns are stored back, finished on the last depth block. */
static inline __attribute__((always_inline)) void
part_end(int mr, int nv, const target *t, const epilogue *e, int last, float buf[MAXR][NR],
         vf acc[MAXR][NV])
{
    for (int i = 0; i < mr; i++) {
        for (int j = 0; j < nv; j++) store(buf[i] + j * VW, acc[i][j]);
        for (int64_t j = 0; j < t->cols; j++) {
            float v = buf[i][j];
            t->c[i * t->ldc + j] = last ? finish1(v, e, t->i0 + i, t->jbase + j) : v;
        }
    }
}

#if defined(__AVX512F__)
/* A short tile by masked moves straight from the registers: the same operations on
 * every stored element as through the buffer (finish1's order, clip keeping NaN), no
 * masked-off lane read or written. The buffer's copies and scalar epilogue cost a
 * last partial column panel (49 pixels: 32 + 17) more than its FMAs: a 160 -> 960
 * product on 49 columns took 107 us against 87 on 64 (one thread, 2-core AMD EPYC
 * Zen 5); masked, see docs/performance.md. */
static inline __mmask16 part_lanes(int64_t cols, int j)
{
    int64_t left = cols - (int64_t)j * VW;
    return left >= VW ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
}

/* A short tile's accumulators from C's first t->cols columns (or zero), masked ... */
static inline __attribute__((always_inline)) void
part_load_masked(int mr, int nv, const target *t, vf acc[MAXR][NV])
{
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++)
            acc[i][j] = t->load_c ? (vf)_mm512_maskz_loadu_ps(part_lanes(t->cols, j),
                                                              t->c + i * t->ldc + j * VW)
                                  : (vf){0};
}

/* ... and stored back to those columns, finished on the last depth block. */
static inline __attribute__((always_inline)) void
part_store_masked(int mr, int nv, const target *t, const epilogue *e, vf acc[MAXR][NV])
{
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) {
            __mmask16 k = part_lanes(t->cols, j);
            int64_t col = t->jbase + j * VW;
            vf v = acc[i][j];
            if (t->last) {
                if (e->alpha != 1.0f) v *= e->alpha;
                if (e->bias_kind == 1) v += e->bias[t->i0 + i];
                else if (e->bias_kind == 2) v += (vf)_mm512_maskz_loadu_ps(k, e->bias + col);
                if (e->res)
                    v += (vf)_mm512_maskz_loadu_ps(k, e->res + (t->i0 + i) * e->ldr + col);
                if (e->flags & KEEL_CLIP) v = clip(v, splat(e->lo), splat(e->hi));
            }
            if (k) _mm512_mask_storeu_ps(t->c + i * t->ldc + j * VW, k, (__m512)v);
        }
}

static inline __attribute__((always_inline)) void
tile_part_masked(int mr, int nv, int64_t kc, const float *a, const bsource *s,
                 const target *t, const epilogue *e)
{
    vf acc[MAXR][NV];
    part_load_masked(mr, nv, t, acc);
    rank_updates(mr, nv, kc, a, s, acc);
    part_store_masked(mr, nv, t, e, acc);
}
#endif

static inline __attribute__((always_inline)) void
tile_part(int mr, int nv, int64_t kc, const float *a, const bsource *s, const target *t,
          const epilogue *e)
{
#if defined(__AVX512F__)
    tile_part_masked(mr, nv, kc, a, s, t, e);
#else
    float buf[MAXR][NR];
    vf acc[MAXR][NV];
    part_begin(mr, nv, t, buf, acc);
    rank_updates(mr, nv, kc, a, s, acc);
    part_end(mr, nv, t, e, t->last, buf, acc);
#endif
}

/* A run of a tile's mapped columns: tile columns j .. j + len go to offsets o .. o + len. */
typedef struct {
    int64_t j, len, o;
} run;

static int runs_of(const int64_t *map, int64_t cols, run *r)
{
    int count = 0;
    for (int64_t j = 0; j < cols;) {
        if (map[j] < 0) {
            j++;
            continue;
        }
        int64_t start = j;
        while (j + 1 < cols && map[j + 1] == map[j] + 1) j++;
        j++;
        r[count++] = (run){start, j - start, map[start]};
    }
    return count;
}

/* dst[0 .. len) = src[0 .. len) for a short run (a row of a small image, at most NR). */
static inline void copy(float *restrict dst, const float *restrict src, int64_t len)
{
#if defined(__AVX512F__)
    /* Masked moves, a vector at a time, the last one partial. Every move is masked: gcc
       turned a loop of whole-vector moves into a call to memcpy per 64 bytes (the
       gathered panels of ResNet-20's 16 -> 32 3x3 stride-2 conv at batch 1, runs of 16
       floats: 2,304 calls a conv, about a sixth of its time). */
    for (; len > 0; len -= 16, dst += 16, src += 16) {
        __mmask16 keep = (__mmask16)(len >= 16 ? 0xffffu : (1u << len) - 1u);
        _mm512_mask_storeu_ps(dst, keep, _mm512_maskz_loadu_ps(keep, src));
    }
#else
    for (int64_t q = 0; q < len; q++) dst[q] = src[q];
#endif
}

#if defined(__AVX512F__)
/* The lanes of vector v (tile columns v * VW ..) that fall in tile columns [lo, hi). */
static inline __mmask16 lanes(int64_t lo, int64_t hi, int v)
{
    int64_t a = lo - v * VW, b = hi - v * VW;
    a = a < 0 ? 0 : a > VW ? VW : a;
    b = b < 0 ? 0 : b > VW ? VW : b;
    return (__mmask16)(((1u << b) - 1u) & ~((1u << a) - 1u));
}

/* Lanes of a row's tile vectors from their runs of a mapped row (masked loads merge). */
static inline __attribute__((always_inline)) void
gather_runs(int nv, const float *row, const run *r, int runs, vf *v)
{
    for (int q = 0; q < runs; q++) {
        const float *base = row + r[q].o - r[q].j; /* tile column j lies at base + j */
        for (int j = 0; j < nv; j++) {
            __mmask16 k = lanes(r[q].j, r[q].j + r[q].len, j);
            if (k) v[j] = (vf)_mm512_mask_loadu_ps((__m512)v[j], k, base + j * VW);
        }
    }
}

/* tile_mapped with masked moves straight from the registers: a conv's wide columns
 * crossing output rows cost two or three masked stores per row and vector (masked-off
 * lanes never touch memory, so a base before the row's start is never read or written). */
static inline __attribute__((always_inline)) void
tile_mapped_masked(int mr, int nv, int64_t kc, const float *a, const bsource *s,
                   const target *t, const epilogue *e, const run *r, int runs)
{
    vf acc[MAXR][NV];
    for (int i = 0; i < mr; i++) {
        for (int j = 0; j < nv; j++) acc[i][j] = (vf){0};
        if (t->load_c) gather_runs(nv, t->c + i * t->ldc, r, runs, acc[i]);
    }
    rank_updates(mr, nv, kc, a, s, acc);
    for (int i = 0; i < mr; i++) {
        vf res[NV];
        for (int j = 0; j < nv; j++) res[j] = (vf){0};
        if (t->last && e->res) gather_runs(nv, e->res + (t->i0 + i) * e->ldr, r, runs, res);
        for (int j = 0; j < nv; j++) {
            vf v = acc[i][j];
            if (t->last) {
                if (e->alpha != 1.0f) v *= e->alpha;
                if (e->bias_kind == 1) v += e->bias[t->i0 + i];
                if (e->res) v += res[j];
                if (e->flags & KEEL_CLIP) v = clip(v, splat(e->lo), splat(e->hi));
            }
            acc[i][j] = v;
        }
        float *row = t->c + i * t->ldc;
        for (int q = 0; q < runs; q++) {
            float *base = row + r[q].o - r[q].j;
            for (int j = 0; j < nv; j++) {
                __mmask16 k = lanes(r[q].j, r[q].j + r[q].len, j);
                if (k) _mm512_mask_storeu_ps(base + j * VW, k, (__m512)acc[i][j]);
            }
        }
    }
}
#endif

/* A tile whose columns are mapped (runs of C, and columns not stored): the epilogue on
 * vectors (a per-row bias, the residual gathered by runs), stored run by run. */
static inline __attribute__((always_inline)) void
tile_mapped(int mr, int nv, int64_t kc, const float *a, const bsource *s, const target *t,
            const epilogue *e)
{
#if defined(__AVX512F__)
    {
        run rr[NR];
        int count = runs_of(t->map, t->cols, rr);
        tile_mapped_masked(mr, nv, kc, a, s, t, e, rr, count);
        return;
    }
#endif
    float buf[MAXR][NR], rbuf[NR];
    vf acc[MAXR][NV];
    run r[NR];
    int runs = runs_of(t->map, t->cols, r);
    for (int i = 0; i < mr; i++) {
        if (t->load_c) {
            memset(buf[i], 0, sizeof buf[i]);
            for (int q = 0; q < runs; q++)
                copy(buf[i] + r[q].j, t->c + i * t->ldc + r[q].o, r[q].len);
        }
        for (int j = 0; j < nv; j++) acc[i][j] = t->load_c ? load(buf[i] + j * VW) : (vf){0};
    }
    rank_updates(mr, nv, kc, a, s, acc);
    for (int i = 0; i < mr; i++) {
        const float *res = NULL;
        if (t->last && e->res) {
            memset(rbuf, 0, sizeof rbuf);
            for (int q = 0; q < runs; q++)
                copy(rbuf + r[q].j, e->res + (t->i0 + i) * e->ldr + r[q].o, r[q].len);
            res = rbuf;
        }
        for (int j = 0; j < nv; j++) {
            vf v = acc[i][j];
            if (t->last) {
                if (e->alpha != 1.0f) v *= e->alpha;
                if (e->bias_kind == 1) v += e->bias[t->i0 + i];
                if (res) v += load(res + j * VW);
                if (e->flags & KEEL_CLIP) v = clip(v, splat(e->lo), splat(e->hi));
            }
            store(buf[i] + j * VW, v);
        }
        for (int q = 0; q < runs; q++)
            copy(t->c + i * t->ldc + r[q].o, buf[i] + r[q].j, r[q].len);
    }
}

typedef void (*tile_fn)(int64_t, const float *, const bsource *, const target *,
                        const epilogue *);

/* Tiles of more rows than MR never run: CAP keeps their code one row small. */
#define CAP(MRC) ((MRC) <= MR ? (MRC) : 1)
#define TILE(MRC, NVC)                                                                         \
    static void tile_##MRC##_##NVC(int64_t kc, const float *a, const bsource *s,              \
                                   const target *t, const epilogue *e)                        \
    {                                                                                          \
        if (t->map)                                                                            \
            tile_mapped(CAP(MRC), NVC, kc, a, s, t, e);                                        \
        else if (t->cols == NVC * VW)                                                          \
            tile_full(CAP(MRC), NVC, kc, a, s, t, e);                                          \
        else                                                                                   \
            tile_part(CAP(MRC), NVC, kc, a, s, t, e);                                          \
    }

#define TILES_NV(NVC)                                                                          \
    TILE(1, NVC) TILE(2, NVC) TILE(3, NVC) TILE(4, NVC) TILE(5, NVC) TILE(6, NVC)             \
    TILE(7, NVC) TILE(8, NVC) TILE(9, NVC) TILE(10, NVC) TILE(11, NVC) TILE(12, NVC)          \
    TILE(13, NVC) TILE(14, NVC)

#define ROW(NVC)                                                                               \
    {tile_1_##NVC, tile_2_##NVC, tile_3_##NVC, tile_4_##NVC, tile_5_##NVC, tile_6_##NVC,      \
     tile_7_##NVC, tile_8_##NVC, tile_9_##NVC, tile_10_##NVC, tile_11_##NVC, tile_12_##NVC,   \
     tile_13_##NVC, tile_14_##NVC}

TILES_NV(1)
#if NV >= 2
TILES_NV(2)
#endif
#if NV >= 3
TILES_NV(3)
#endif
#if NV >= 4
TILES_NV(4)
#endif

/* TILES[nv - 1][mr - 1]: the tile of mr rows and nv vectors. */
static const tile_fn TILES[NV][MAXR] = {
    ROW(1),
#if NV >= 2
    ROW(2),
#endif
#if NV >= 3
    ROW(3),
#endif
#if NV >= 4
    ROW(4),
#endif
};

/* ---- packing ------------------------------------------------------------------------ */

/* The micro-kernel geometry Python packs for, and the workspace a call needs. */
int64_t keel_gemm_mr_f32(void) { return MR; }
int64_t keel_gemm_nr_f32(void) { return NR; }
int64_t keel_gemm_kc_f32(void) { return KC; }
/* The columns from which a conv's streamed taps run row panel by row panel (the cpu
   planner's output_streams asks for them; native_gemm checks it at load). */
int64_t keel_gemm_rows_first_taps_f32(void) { return ROWS_FIRST_TAPS_FROM; }
int64_t keel_gemm_workspace_f32(void)
{
    int64_t b = NC_PANELS * NR * KC > RF_FLOATS + NR * KC ? NC_PANELS * NR * KC
                                                         : RF_FLOATS + NR * KC;
    return MC_PANELS * MR * KC + b;
}

#if defined(__AVX__)
/* Eight rows (rs floats apart) of eight depth steps each, transposed: dst[p * ds + r] =
 * src[r * rs + p]. Packing a raw A (a MatMul's activations) element by element took
 * 5 us of a 32 x 784 x 512 product's 113 (thread CPU time, the 2-core Zen 5); a
 * transposed raw B (attention's Kᵀ, ds = NR) 12 us of 4 x 128 x 128 x 64's 60 (the
 * 2-core Xeon, under load). */
static inline void transpose8(const float *src, int64_t rs, float *dst, int64_t ds)
{
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + rs);
    __m256 r2 = _mm256_loadu_ps(src + 2 * rs), r3 = _mm256_loadu_ps(src + 3 * rs);
    __m256 r4 = _mm256_loadu_ps(src + 4 * rs), r5 = _mm256_loadu_ps(src + 5 * rs);
    __m256 r6 = _mm256_loadu_ps(src + 6 * rs), r7 = _mm256_loadu_ps(src + 7 * rs);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(dst + ds, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(dst + 2 * ds, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(dst + 3 * ds, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(dst + 4 * ds, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(dst + 5 * ds, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(dst + 6 * ds, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(dst + 7 * ds, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#endif

/* dst[0 .. len) = src[0 .. len), dst[len .. width) = 0: one depth step of a narrow panel. */
static inline void copy_padded(float *restrict dst, const float *restrict src, int64_t len,
                               int64_t width)
{
#if defined(__AVX512F__)
    /* Masked moves, the zeros from the masked load: gcc turned memcpy plus a loop of
       zeros into a libc memcpy call per depth step (gemm_2d's narrow panels). */
    for (int64_t q = 0; q < width; q += 16) {
        int64_t have = len - q, room = width - q;
        __mmask16 keep = (__mmask16)(have >= 16 ? 0xffffu : have > 0 ? (1u << have) - 1u : 0u);
        __mmask16 fill = (__mmask16)(room >= 16 ? 0xffffu : (1u << room) - 1u);
        _mm512_mask_storeu_ps(dst + q, fill, _mm512_maskz_loadu_ps(keep, src + q));
    }
#else
    memcpy(dst, src, (size_t)len * sizeof(float));
    for (int64_t r = len; r < width; r++) dst[r] = 0.0f;
#endif
}

/* Rows [r0, r0 + w) of the operand, depth [p0, p0 + kc), as a kc x width panel
 * block at dst (rows past w zero): element (r, p) is at src[r * rs + p * ks], or,
 * with a row table, at src[r + rows[p]] (rs == 1). */
static void pack_block(const float *src, int64_t rs, int64_t ks, const int64_t *rows,
                       int64_t r0, int64_t w, int64_t width, int64_t p0, int64_t kc,
                       float *dst)
{
    if (rs == 1) {
        for (int64_t p = 0; p < kc; p++) {
            const float *s = src + r0 + (rows ? rows[p0 + p] : (p0 + p) * ks);
            float *d = dst + p * width;
            if (w == NR && width == NR) {
                for (int j = 0; j < NV; j++) store(d + j * VW, load(s + j * VW));
                continue;
            }
            copy_padded(d, s, w, width);
        }
        return;
    }
#if defined(__AVX__)
    if (ks == 1 && width % 8 == 0 && w == width) { /* whole rows along the depth */
        for (int64_t r8 = 0; r8 < width; r8 += 8) {
            const float *s0 = src + (r0 + r8) * rs + p0;
            int64_t p = 0;
            for (; p + 8 <= kc; p += 8) transpose8(s0 + p, rs, dst + p * width + r8, width);
            for (; p < kc; p++)
                for (int r = 0; r < 8; r++) dst[p * width + r8 + r] = s0[r * rs + p];
        }
        return;
    }
#endif
    /* Rows are strided: read each row along the depth (sequential when ks == 1). */
    for (int64_t r = 0; r < w; r++) {
        const float *row = src + (r0 + r) * rs + p0 * ks;
        for (int64_t p = 0; p < kc; p++) dst[p * width + r] = row[p * ks];
    }
    for (int64_t r = w; r < width; r++)
        for (int64_t p = 0; p < kc; p++) dst[p * width + r] = 0.0f;
}

#if defined(__AVX512F__)
/* The runs of a tile's mapped columns whose offsets step by two (tile columns j .. j +
 * len read offsets o, o + 2, ...: an unpadded stride-2 conv's output rows read from X
 * itself); 0 where a column is not read or the runs average under two columns. */
static int pair_runs_of(const int64_t *map, int64_t cols, run *r)
{
    int count = 0;
    for (int64_t j = 0; j < cols;) {
        if (map[j] < 0) return 0;
        int64_t start = j;
        while (j + 1 < cols && map[j + 1] == map[j] + 2) j++;
        j++;
        r[count++] = (run){start, j - start, map[start]};
    }
    /* Consecutive offsets (a phase image's rows) make runs of one here: runs_of's. */
    return 2 * count <= cols ? count : 0;
}

/* pack_gathered's rows for runs that step by two: each 16 columns are the even floats
 * of 32 consecutive ones, two masked loads and one two-register permute (an element
 * copy a column otherwise: runs_of finds runs of one). */
static void pack_pairs(const float *src, const int64_t *rows, const run *r, int runs,
                       int64_t cols, int64_t p0, int64_t kc, float *dst)
{
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    for (int64_t p = 0; p < kc; p++) {
        const float *s = src + rows[p0 + p];
        float *d = dst + p * NR;
        for (int q = 0; q < runs; q++) {
            const float *from = s + r[q].o;
            float *to = d + r[q].j;
            for (int64_t i = 0; i < r[q].len; i += 16) {
                int64_t n = r[q].len - i < 16 ? r[q].len - i : 16; /* columns this move */
                int64_t span = 2 * n - 1;                          /* floats read */
                __mmask16 lo = (__mmask16)(span >= 16 ? 0xffffu : (1u << span) - 1u);
                __mmask16 hi = (__mmask16)(span <= 16 ? 0u : (1u << (span - 16)) - 1u);
                __m512 a = _mm512_maskz_loadu_ps(lo, from + 2 * i);
                __m512 b = _mm512_maskz_loadu_ps(hi, from + 2 * i + 16);
                __mmask16 keep = (__mmask16)(n >= 16 ? 0xffffu : (1u << n) - 1u);
                _mm512_mask_storeu_ps(to + i, keep, _mm512_permutex2var_ps(a, even, b));
            }
        }
        for (int64_t j = cols; j < NR; j++) d[j] = 0.0f;
    }
}
#endif

/* Columns [0, cols) of B (element (p, j) at src[rows[p] + map[j]]), depth [p0, p0 + kc),
 * as a kc x NR block at dst: the runs of consecutive offsets are found once, then
 * copied for every p. */
static void pack_gathered(const float *src, const int64_t *rows, const int64_t *map,
                          int64_t cols, int64_t p0, int64_t kc, float *dst)
{
    run r[NR];
#if defined(__AVX512F__)
    int pairs = pair_runs_of(map, cols, r);
    if (pairs) {
        pack_pairs(src, rows, r, pairs, cols, p0, kc, dst);
        return;
    }
#endif
    int runs = runs_of(map, cols, r);
    if (runs == 1 && r[0].len == NR) {
        for (int64_t p = 0; p < kc; p++) {
            const float *s = src + rows[p0 + p] + r[0].o;
            for (int j = 0; j < NV; j++) store(dst + p * NR + j * VW, load(s + j * VW));
        }
        return;
    }
    for (int64_t p = 0; p < kc; p++) {
        const float *s = src + rows[p0 + p];
        float *d = dst + p * NR;
        for (int q = 0; q < runs; q++) copy(d + r[q].j, s + r[q].o, r[q].len);
        for (int64_t j = cols; j < NR; j++) d[j] = 0.0f;
    }
}

/* Pack panels [lo, hi) of a rows x depth operand into panels of `width` rows.
 *
 * Element (r, p) of the operand is src[r * rs + p * ks]; panel q holds rows
 * q*width .. q*width + width - 1 as depth x width floats (row index fastest),
 * at dst + q * depth * width, rows past the end filled with zeros.
 */
void keel_gemm_pack_f32(const float *src, int64_t rows, int64_t depth, int64_t rs, int64_t ks,
                        int64_t width, float *dst, int64_t lo, int64_t hi)
{
    for (int64_t q = lo; q < hi; q++) {
        int64_t r0 = q * width;
        int64_t w = rows - r0 < width ? rows - r0 : width;
        float *d = dst + q * depth * width;
        for (int64_t p0 = 0; p0 < depth; p0 += KC) {
            int64_t kc = depth - p0 < KC ? depth - p0 : KC;
            if (rs == 1)
                pack_block(src, 1, ks, NULL, r0, w, width, p0, kc, d + p0 * width);
            else
                pack_block(src + r0 * rs, rs, ks, NULL, 0, w, width, p0, kc, d + p0 * width);
        }
    }
}

/* ---- the driver --------------------------------------------------------------------- */

/* One product of the batch, its operands resolved. */
typedef struct {
    int64_t m, n, k;
    const float *a; /* packed (a_rs == a_ks == 0) or raw */
    int64_t a_rs, a_ks;
    const float *b; /* packed (b_rs == b_cs == 0 and no rows) or raw */
    int64_t b_rs, b_cs;
    const int64_t *b_rows;
    const int64_t *b_cols;
    float *c;
    int64_t ldc;
    const int64_t *c_cols;
    float *work;
    int64_t a_ps; /* floats per row panel of A packed in work: MR * (KC, or the depth) */
    const float *a16; /* NULL, or A (the same address) packed in 16-row panels only */
} problem;

/* Where the tile at row i0, column panel starting at j0 (cols columns) goes. */
static target target_of(const problem *g, int64_t i0, int64_t j0, int64_t cols, int load_c,
                        int last)
{
    target t = {g->c + i0 * g->ldc + j0, g->ldc, cols, NULL, i0, j0, load_c, last};
    if (g->c_cols) {
        const int64_t *map = g->c_cols + j0;
        int64_t first = map[0];
        int run = cols == NR && first >= 0;
        for (int64_t j = 1; run && j < cols; j++) run = map[j] == first + j;
        t.c = g->c + i0 * g->ldc + (run ? first : 0);
        t.jbase = run ? first : 0;
        t.map = run ? NULL : map;
    }
    return t;
}

/* Whether NR column offsets are consecutive. */
static int one_run(const int64_t *map)
{
    for (int j = 1; j < NR; j++)
        if (map[j] != map[0] + j) return 0;
    return 1;
}

/* One depth block [k0, k0 + kc) of column panel jp against row panels [ib, ie): B's
 * block read in place or packed into wb, then one tile per row panel. wa: the row
 * panels' packed A block (NULL: A is packed whole). */
static void column_panel(const problem *g, const epilogue *e, int64_t jp, int64_t ib,
                         int64_t ie, int64_t k0, int64_t kc, int load_c, int last,
                         const float *wa, float *wb)
{
    int64_t m = g->m, k = g->k, j0 = jp * NR;
    int64_t cols = g->n - j0 < NR ? g->n - j0 : NR;
    int nv = (int)((cols + VW - 1) / VW);
    int b_raw = g->b_rs != 0 || g->b_cs != 0 || g->b_rows;
    bsource s = {g->b + jp * k * NR + k0 * NR, NR, NULL};
    if (g->b_cols && cols == NR && ie - ib <= DIRECT_PANELS && one_run(g->b_cols + j0)) {
        /* The panel's columns are one run of B's rows (a conv's output row of 32
           pixels): read in place through the row table. */
        s = (bsource){g->b + g->b_cols[j0], 0, g->b_rows + k0};
    } else if (g->b_cols) {
        pack_gathered(g->b, g->b_rows, g->b_cols + j0, cols, k0, kc, wb);
        s = (bsource){wb, NR, NULL};
    } else if (b_raw && g->b_cs == 1 && cols == NR && ie - ib <= DIRECT_PANELS) {
        /* B's rows hold NR contiguous columns: read them in place. */
        if (g->b_rows)
            s = (bsource){g->b + j0, 0, g->b_rows + k0};
        else
            s = (bsource){g->b + k0 * g->b_rs + j0, g->b_rs, NULL};
    } else if (b_raw) {
        if (g->b_rows || g->b_cs == 1)
            pack_block(g->b, 1, g->b_rs, g->b_rows, j0, cols, NR, k0, kc, wb);
        else
            pack_block(g->b + j0 * g->b_cs, g->b_cs, g->b_rs, NULL, 0, cols, NR, k0, kc, wb);
        s = (bsource){wb, NR, NULL};
    }
    /* The first row panel reads the packed panel from L2 or beyond (a model's weights
       together overflow the L2), line after line: the hardware's prefetchers stop at
       every 4 KiB page, so it fetches its rows a few ahead itself (KEEL_FETCH_SHIFT);
       the later row panels find them in cache. Past the panel's end it fetches the next
       panel's first rows (packed right after it); a prefetch past the array cannot fault. */
    int64_t ahead = b_raw || g->b_cols ? 0 : (e->flags >> KEEL_FETCH_SHIFT) * NR;
    for (int64_t ip = ib; ip < ie; ip++) {
        int64_t i0 = ip * MR;
        int mr = (int)(m - i0 < MR ? m - i0 : MR);
        const float *aa = wa ? wa + (ip - ib) * g->a_ps : g->a + ip * k * MR + k0 * MR;
        target t = target_of(g, i0, j0, cols, load_c, last);
        s.ahead = ip == ib ? ahead : 0;
        TILES[nv - 1][mr - 1](kc, aa, &s, &t, e);
    }
}

/* The single row of C for column panels [j_lo, j_hi) when A has one row (a matrix
 * times a vector). Each element of C is summed over p in order from 0 (or from the
 * value C holds, with KEEL_ACCUMULATE), as in the tiles: a row's result is bitwise
 * the one it gets inside a product of more rows. A lone 1 x NR tile waits on the
 * FMA latency (NV chains); up to GEMV_PANELS panels that B gives in place run
 * together, NV * GEMV_PANELS independent chains, each load of A feeding all of them.
 * A panel of a raw B that cannot be read in place is packed block by block into the
 * workspace, its sums carried over in registers. */
#define GEMV_PANELS 4

static int gemv_serves(const problem *g)
{
    return g->m == 1 && !g->b_rows && !g->b_cols && !g->c_cols;
}

/* acc[q][..] += sum over p < k of a[p * as] * B_q[p][0 .. NR), B_q's row p at b[q] + p * bs[q]. */
static inline __attribute__((always_inline)) void
gemv_panels(int np, int64_t k, const float *a, int64_t as, const float *const *b,
            const int64_t *bs, vf acc[GEMV_PANELS][NV])
{
    for (int64_t p = 0; p < k; p++) {
        vf x = splat(a[p * as]);
        for (int q = 0; q < np; q++)
            for (int j = 0; j < NV; j++) acc[q][j] += x * load(b[q] + p * bs[q] + j * VW);
    }
}

typedef void (*gemv_fn)(int64_t, const float *, int64_t, const float *const *, const int64_t *,
                        vf[GEMV_PANELS][NV]);
#define GEMV(N)                                                                                \
    static void gemv_##N(int64_t k, const float *a, int64_t as, const float *const *b,        \
                         const int64_t *bs, vf acc[GEMV_PANELS][NV])                            \
    {                                                                                          \
        gemv_panels(N, k, a, as, b, bs, acc);                                                  \
    }
GEMV(1) GEMV(2) GEMV(3) GEMV(4)
static const gemv_fn GEMVS[GEMV_PANELS] = {gemv_1, gemv_2, gemv_3, gemv_4};

/* The accumulators of C's columns j0 .. j0 + cols: the values C holds, or zero. */
static void gemv_begin(const problem *g, const epilogue *e, int64_t j0, int64_t cols,
                       vf acc[NV])
{
    float buf[NR];
    memset(buf, 0, sizeof buf);
    if (e->flags & KEEL_ACCUMULATE) memcpy(buf, g->c + j0, (size_t)cols * sizeof(float));
    for (int j = 0; j < NV; j++) acc[j] = load(buf + j * VW);
}

static void gemv_store(const problem *g, const epilogue *e, int64_t j0, int64_t cols,
                       vf acc[NV])
{
    if (cols == NR) {
        for (int j = 0; j < NV; j++)
            store_final(g->c + j0 + j * VW, finish(acc[j], e, 0, j0 + j * VW), e->flags);
        return;
    }
    float buf[NR];
    for (int j = 0; j < NV; j++) store(buf + j * VW, acc[j]);
    for (int64_t j = 0; j < cols; j++) g->c[j0 + j] = finish1(buf[j], e, 0, j0 + j);
}

/* B's panel jp when it can be read in place (packed, or NR contiguous columns). */
static const float *gemv_direct(const problem *g, int64_t jp, int64_t *bs)
{
    if (g->b_rs == 0 && g->b_cs == 0) {
        *bs = NR;
        return g->b + jp * g->k * NR;
    }
    if (g->b_cs == 1 && (jp + 1) * NR <= g->n) {
        *bs = g->b_rs;
        return g->b + jp * NR;
    }
    return NULL;
}

/* C's columns of panel jp, at most NR. */
static int64_t gemv_cols(const problem *g, int64_t jp)
{
    return g->n - jp * NR < NR ? g->n - jp * NR : NR;
}

/* One panel of a raw B, packed block by block into wb. */
static void gemv_packed(const problem *g, const epilogue *e, int64_t jp, int64_t as, float *wb)
{
    int64_t k = g->k, j0 = jp * NR, cols = gemv_cols(g, jp), packed = NR;
    const float *b[1] = {wb};
    vf acc[GEMV_PANELS][NV];
    gemv_begin(g, e, j0, cols, acc[0]);
    for (int64_t p0 = 0; p0 < k; p0 += KC) {
        int64_t kc = k - p0 < KC ? k - p0 : KC;
        if (g->b_cs == 1)
            pack_block(g->b, 1, g->b_rs, NULL, j0, cols, NR, p0, kc, wb);
        else
            pack_block(g->b + j0 * g->b_cs, g->b_cs, g->b_rs, NULL, 0, cols, NR, p0, kc, wb);
        gemv_1(kc, g->a + p0 * as, as, b, &packed, acc);
    }
    gemv_store(g, e, j0, cols, acc[0]);
}

static void gemv(const problem *g, const epilogue *e, int64_t j_lo, int64_t j_hi)
{
    int64_t as = (g->a_rs != 0 || g->a_ks != 0) ? g->a_ks : MR;
    float *wb = g->work + MC_PANELS * MR * KC;
    for (int64_t jp = j_lo; jp < j_hi;) {
        const float *b[GEMV_PANELS];
        int64_t bs[GEMV_PANELS];
        int np = 0;
        while (np < GEMV_PANELS && jp + np < j_hi &&
               (b[np] = gemv_direct(g, jp + np, &bs[np])) != NULL)
            np++;
        if (np == 0) {
            gemv_packed(g, e, jp, as, wb);
            jp++;
            continue;
        }
        vf acc[GEMV_PANELS][NV];
        for (int q = 0; q < np; q++) gemv_begin(g, e, (jp + q) * NR, gemv_cols(g, jp + q), acc[q]);
        GEMVS[np - 1](g->k, g->a, as, b, bs, acc);
        for (int q = 0; q < np; q++) gemv_store(g, e, (jp + q) * NR, gemv_cols(g, jp + q), acc[q]);
        jp += np;
    }
}

/* Whether a block of C runs row panel by row panel (see row_panels_first): a raw B
 * without tables, and C's columns in place. */
static int rows_first(const problem *g, const epilogue *e)
{
    if (g->c_cols) return 0;
    /* A conv's taps (row tables) only for large images: measured at batch 32, a 3 -> 32
       3x3 stride-2 conv on 224x224 (12544 output pixels) took 18.7 ms so against 29.7
       column panel by column panel, a 16 -> 16 3x3 conv on 32x32 (1024) 1.83 against
       1.57 (its one-run panels are read in place there). */
    if (g->b_rows) return (e->flags & KEEL_STREAM) && g->n >= ROWS_FIRST_TAPS_FROM;
    return g->b_rs != 0 || g->b_cs != 0;
}

/* Column panels per block of a row-panels-first product of depth kc: as many as
 * keep the packed B block within RF_FLOATS, at least NC_PANELS. Wide blocks write
 * C's rows and pack B's rows in long runs (measured: a 16 -> 96 1x1 conv on 112x112
 * at batch 32 took 22.2 ms in blocks of 256 columns, 19.9 ms in blocks of 4096). */
static int64_t rows_first_panels(int64_t kc)
{
    int64_t panels = RF_FLOATS / ((kc > 0 ? kc : 1) * NR);
    return panels > NC_PANELS ? panels : NC_PANELS;
}

/* Column panels ahead of the running tile whose lines of C a row-panels-first sweep
 * fetches for writing (not with KEEL_NT): a 1x1 conv's output rows are long runs the
 * stores would otherwise first read from memory line by line, eight rows at once. A
 * 16 -> 96 product on 12544 columns (MobileNetV2's 1x1 conv on 112x112, bias and clip,
 * one thread, C rotated over four arrays so that it comes from memory): 430 -> 325 us,
 * fastest of 25; with C in cache unchanged (304 -> 309). */
#ifndef RF_C_AHEAD
#define RF_C_AHEAD 4
#endif

/* The whole depth of column panels [jc, je) against row panels [ib, ie), row panel
 * by row panel, each sweeping the block's columns: C's rows are written in runs of
 * up to NC columns (a 1x1 conv's output rows of thousands of pixels stream out),
 * and B's block stays in cache across the row panels. B is packed whole into wb
 * when it streams from memory (KEEL_STREAM: the packing reads its rows in long
 * sequential runs; a 16 -> 96 1x1 conv on 112x112 at batch 32 took 46 ms with B
 * read in place panel by panel, 22 ms packed) or many row panels read it; else
 * it is read in place (a cached B: 16 x 144 x 1024 0.047 ms in place, 0.074
 * packed), only a last partial panel packed. */
static void row_panels_first(const problem *g, const epilogue *e, int64_t jc, int64_t je,
                             int64_t ib, int64_t ie, int64_t kc, int load_c, const float *wa,
                             float *wb)
{
    int64_t m = g->m, n = g->n, k = g->k;
    int pack = (e->flags & KEEL_STREAM) || ie - ib > DIRECT_PANELS || g->b_cs != 1 ||
               g->b_rows;
    int64_t in_place = pack ? jc : (je * NR > n ? je - 1 : je); /* panels below: in place */
    for (int64_t jp = in_place; jp < je; jp++) {
        int64_t j0 = jp * NR, cols = n - j0 < NR ? n - j0 : NR;
        float *d = wb + (jp - jc) * NR * kc;
        if (g->b_cols)
            pack_gathered(g->b, g->b_rows, g->b_cols + j0, cols, 0, kc, d);
        else if (g->b_rows)
            pack_block(g->b, 1, 0, g->b_rows, j0, cols, NR, 0, kc, d);
        else if (g->b_cs == 1)
            pack_block(g->b, 1, g->b_rs, NULL, j0, cols, NR, 0, kc, d);
        else
            pack_block(g->b + j0 * g->b_cs, g->b_cs, g->b_rs, NULL, 0, cols, NR, 0, kc, d);
    }
    /* While the tiles run, the next block's B (kc rows of up to `ahead` columns) is
       fetched into cache a share per tile, when it streams from memory (measured: a
       32 -> 16 1x1 conv on 112x112 at batch 32, 10.4 ms -> 8.3 ms). */
    int64_t ahead = (e->flags & KEEL_STREAM) && g->b_cs == 1 && !g->b_rows && ie * MR >= m
                        ? n - je * NR : 0;
    ahead = ahead < (je - jc) * NR ? ahead : (je - jc) * NR;
    int64_t per_row = (ahead + 15) / 16, lines = kc * per_row;
    int64_t tiles = (ie - ib) * (je - jc), share = tiles ? (lines + tiles - 1) / tiles : 0;
    int64_t line = 0;
    int c_ahead = RF_C_AHEAD > 0 && !(e->flags & KEEL_NT);
    for (int64_t ip = ib; ip < ie; ip++) {
        int64_t i0 = ip * MR;
        int mr = (int)(m - i0 < MR ? m - i0 : MR);
        const float *aa = wa ? wa + (ip - ib) * g->a_ps : g->a + ip * k * MR;
        for (int64_t jp = jc; jp < je; jp++) {
            for (int64_t q = 0; q < share && line < lines; q++, line++)
                __builtin_prefetch(g->b + (line / per_row) * g->b_rs + je * NR +
                                       (line % per_row) * 16, 0, 3);
            int64_t j0 = jp * NR, cols = n - j0 < NR ? n - j0 : NR;
            int nv = (int)((cols + VW - 1) / VW);
            if (c_ahead && jp + RF_C_AHEAD < je)
                for (int i = 0; i < mr; i++) {
                    float *cl = g->c + (i0 + i) * g->ldc + j0 + RF_C_AHEAD * NR;
                    for (int v = 0; v < NR; v += 16) __builtin_prefetch(cl + v, 1, 3);
                }
            bsource s = jp < in_place ? (bsource){g->b + j0, g->b_rs, NULL}
                                      : (bsource){wb + (jp - jc) * NR * kc, NR, NULL};
            target t = target_of(g, i0, j0, cols, load_c, 1);
            TILES[nv - 1][mr - 1](kc, aa, &s, &t, e);
        }
    }
}

/* ---- a convolution's taps read in place, lanes masked (KEEL_DIRECT) ------------------ */

/* With KEEL_DIRECT in flags, B is a stride-1 view of a convolution's source planes:
 * every plane is OH x OW (the output's own shape: X itself for a stride-1 conv whose
 * output is the size of its input, or X split by stride phase), and C's column q is
 * output pixel (q / OW, q % OW). Row p = c * T + t of B (channel c, tap t) at column q
 * is b[c * cs + off[t] + q] when the pixel (q / OW + dy[t], q % OW + dx[t]) lies in
 * the plane, else 0: a run of B's row is a run of the plane, read in place by loads
 * whose lanes outside the plane are masked off (not read: a masked lane may point
 * past the buffer). No padded copy of X and no packed B: the masks of a column
 * panel are made once, then every row panel reads the panel's taps through them.
 * b_cols holds the geometry: {T, OH, OW, cs, then dy, dx, off per tap, then for every
 * column panel and tap a bit mask of the panel's columns that read inside, then the
 * column panels of a group (below)}; A is packed (depth c * T + t), C has no column
 * map, the bias is per row.
 *
 * A group of G > 1 column panels runs row panel by row panel, each row panel over the
 * group's G panels (their masks made once): A, packed filters larger than the L2
 * (ResNet-18's 256 -> 512 3x3 stride-2 conv: 4.5 MiB against two 32-column panels at
 * batch 1), is then read once per group instead of once per column panel, while the
 * group's B stays in L2. The cpu planner gives G (masked_panel_group); each element of
 * C is the same sum either way.
 *
 * Each element of C is the same sum in the same order as through the gathered taps
 * (bitwise the same C). Measured on ResNet-20's 3x3 convs at batch 32 (1 thread, Zen 4,
 * prepared calls, interleaved medians; time against the gathered taps with the
 * zero-bordered copy of X, or the wide layout where that won): 64 -> 64 on 8x8 1701 ->
 * 1460 us (0.86: no packing of gathered runs, which took 15 %), 32 -> 32 on 16x16 1665
 * -> 1498 (0.90: no garbage columns), 16 -> 32 stride 2 on 32x32 1246 -> 1018 (0.82),
 * 32 -> 64 stride 2 993 -> 902, 3 -> 16 on 32x32 404 -> 377, 16 -> 16 on 32x32 1582 ->
 * 1615 (1.02 alone; inside the model, where X comes from memory, 1545-2040 -> 1544-1705
 * us). The whole model: 30.2 -> 27.5 ms (onnxruntime 22.4). */
#define KEEL_DIRECT 8
/* The flags by name, checked at load (keel.backends.cpu.native_gemm). */
#define GEMM_FLAGS(X)                                                                 \
    X(KEEL_ACCUMULATE) X(KEEL_CLIP) X(KEEL_STREAM) X(KEEL_DIRECT) X(KEEL_NT) X(KEEL_TALL) \
    X(KEEL_LANES) X(KEEL_LANES_TAIL) X(KEEL_FETCH_SHIFT)
KEEL_ENUM_EXPORT(keel_gemm_flags, GEMM_FLAGS)
#define DIRECT_MAX_TAPS 64
/* The residual's rows of the column panel DIRECT_RES_AHEAD panels on are fetched into
 * L2 (locality 1): one short run per row, a plane apart, which the hardware prefetcher
 * does not follow, and whose loads in the epilogue stalled the tiles (a fifth of a
 * 16 -> 16 3x3 conv on 32x32 at batch 32). Measured alone, that conv with its residual
 * (cache flushed between calls; without a residual 1872 us): 2259 us with no prefetch,
 * 2115-2130 two panels ahead, 2080-2100 four or eight ahead, 2119 four ahead into L1/L2
 * (locality 2), 2219-2251 two ahead into L1. Prefetching C's lines for writing changed
 * nothing. */
#ifndef DIRECT_RES_AHEAD
#define DIRECT_RES_AHEAD 4
#endif
#ifndef DIRECT_RES_LOCALITY
#define DIRECT_RES_LOCALITY 1
#endif

#if defined(__AVX512F__)
typedef __mmask16 lanemask;
/* An asm that reads no memory as far as the compiler knows (B does not change during
 * a call): through the intrinsic, or an asm with a memory operand, gcc stored the
 * tile's accumulators back to the stack on every step (41 GF/s instead of ~110). */
static inline vf masked_load(const float *p, lanemask m)
{
    vf v;
    __asm__("vmovups (%1), %0%{%2%}%{z%}" : "=v"(v) : "r"(p), "Yk"(m));
    return v;
}
/* An epilogue's masked read of the bias or the residual, through the intrinsic: the
 * compiler knows it reads memory, so it is neither hoisted above the test of the
 * pointer nor moved across a store (the asm above is for B's loops only). */
static inline vf epilogue_load(const float *p, lanemask m)
{
    return (vf)_mm512_maskz_loadu_ps(m, p);
}
#elif defined(__AVX__)
typedef vi lanemask;
static inline vf masked_load(const float *p, lanemask m)
{
    /* vmaskmovps: masked-off lanes are not read (no fault past the buffer). An asm for
       the reason given above. */
    vf v;
    __asm__("vmaskmovps (%1), %2, %0" : "=x"(v) : "r"(p), "x"(m));
    return v;
}
#else
typedef vi lanemask;
static inline vf masked_load(const float *p, lanemask m)
{
    vf v;
    for (int l = 0; l < VW; l++) v[l] = m[l] ? p[l] : 0.0f;
    return v;
}
#endif

/* One column panel's view of B: the image's planes and each tap's offset and masks. */
typedef struct {
    const float *b;
    int64_t channels, taps, cs;
    int64_t off[DIRECT_MAX_TAPS];
    lanemask mask[DIRECT_MAX_TAPS][NV];
} dpanel;

/* The panel's offsets and lane masks: bits[t] has bit q set when column q of the panel
 * reads tap t inside the plane (made once per layer by the caller: computing them
 * here per panel took 5 % of a 16 -> 16 3x3 conv on 32x32). */
static void direct_masks(dpanel *d, const int64_t *geo, const int64_t *bits)
{
    for (int64_t t = 0; t < d->taps; t++) {
        d->off[t] = geo[6 + 3 * t];
        uint64_t b = (uint64_t)bits[t];
        for (int j = 0; j < NV; j++) {
#if defined(__AVX512F__)
            d->mask[t][j] = (__mmask16)(b >> (j * VW));
#else
            int32_t lane[VW];
            for (int l = 0; l < VW; l++) lane[l] = (b >> (j * VW + l)) & 1 ? -1 : 0;
            memcpy(&d->mask[t][j], lane, sizeof lane);
#endif
        }
    }
}

/* acc += the panel's taps of every channel against a (p = c * T + t, MR floats a step). */
static inline __attribute__((always_inline)) void
direct_updates(int mr, int nv, const float *restrict a, const dpanel *restrict d,
               vf acc[MAXR][NV])
{
    const float *b = d->b;
    int64_t k = d->channels * d->taps, taps = d->taps, cs = d->cs;
    for (int64_t p = 0, q = 0; p < k; p++) {
        vf bv[NV];
        for (int j = 0; j < nv; j++) bv[j] = masked_load(b + d->off[q] + j * VW, d->mask[q][j]);
        for (int i = 0; i < mr; i++) {
            vf av = splat(a[p * MR + i]);
            for (int j = 0; j < nv; j++) acc[i][j] += av * bv[j];
        }
        if (++q == taps) q = 0, b += cs;
    }
}

/* One tile of NR consecutive columns of C, straight from registers: rows i0 .. i0 + mr
 * against the panel's nv vectors, every tap of every channel in order (p = c * T + t),
 * then the epilogue on the store. */
static inline __attribute__((always_inline)) void
direct_full(int mr, int nv, const float *a, const dpanel *d, const target *t,
            const epilogue *e)
{
    vf acc[MAXR][NV];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++)
            acc[i][j] = t->load_c ? load(t->c + i * t->ldc + j * VW) : (vf){0};
    direct_updates(mr, nv, a, d, acc);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++)
            store(t->c + i * t->ldc + j * VW, finish(acc[i][j], e, t->i0 + i, t->jbase + j * VW));
}

/* A tile with fewer columns of C (a 7 x 7 output's 17-column last panel): with AVX-512
 * by masked moves straight from the registers (part_load_masked), else through a buffer
 * on the stack (part_begin); the same bits either way. */
static inline __attribute__((always_inline)) void
direct_part(int mr, int nv, const float *a, const dpanel *d, const target *t,
            const epilogue *e)
{
    vf acc[MAXR][NV];
#if defined(__AVX512F__)
    part_load_masked(mr, nv, t, acc);
    direct_updates(mr, nv, a, d, acc);
    part_store_masked(mr, nv, t, e, acc);
#else
    float buf[MAXR][NR];
    part_begin(mr, nv, t, buf, acc);
    direct_updates(mr, nv, a, d, acc);
    part_end(mr, nv, t, e, 1, buf, acc);
#endif
}

typedef void (*dtile_fn)(const float *, const dpanel *, const target *, const epilogue *);

#define DTILE(MRC, NVC)                                                                        \
    static void dtile_##MRC##_##NVC(const float *a, const dpanel *d, const target *t,         \
                                    const epilogue *e)                                         \
    {                                                                                          \
        if (t->cols == NVC * VW)                                                               \
            direct_full(CAP(MRC), NVC, a, d, t, e);                                            \
        else                                                                                   \
            direct_part(CAP(MRC), NVC, a, d, t, e);                                            \
    }
#define DTILES_NV(NVC)                                                                         \
    DTILE(1, NVC) DTILE(2, NVC) DTILE(3, NVC) DTILE(4, NVC) DTILE(5, NVC) DTILE(6, NVC)       \
    DTILE(7, NVC) DTILE(8, NVC) DTILE(9, NVC) DTILE(10, NVC) DTILE(11, NVC) DTILE(12, NVC)    \
    DTILE(13, NVC) DTILE(14, NVC)
#define DROW(NVC)                                                                              \
    {dtile_1_##NVC, dtile_2_##NVC, dtile_3_##NVC, dtile_4_##NVC, dtile_5_##NVC,               \
     dtile_6_##NVC, dtile_7_##NVC, dtile_8_##NVC, dtile_9_##NVC, dtile_10_##NVC,              \
     dtile_11_##NVC, dtile_12_##NVC, dtile_13_##NVC, dtile_14_##NVC}

DTILES_NV(1)
#if NV >= 2
DTILES_NV(2)
#endif
#if NV >= 3
DTILES_NV(3)
#endif
#if NV >= 4
DTILES_NV(4)
#endif

static const dtile_fn DTILES[NV][MAXR] = {
    DROW(1),
#if NV >= 2
    DROW(2),
#endif
#if NV >= 3
    DROW(3),
#endif
#if NV >= 4
    DROW(4),
#endif
};

/* Column panels per group from the table (after the masks of every panel): the cpu
 * planner's masked_panel_group, any count (the kernel keeps no per-group state); 1 or
 * less runs column panel by column panel. */
static int64_t direct_group(const problem *g, const int64_t *geo)
{
    int64_t panels = (g->n + NR - 1) / NR;
    int64_t group = geo[4 + 3 * geo[0] + panels * geo[0]];
    return group > 1 ? (group < panels ? group : panels) : 1;
}

/* Row panels [i_lo, i_hi) x column panels [j_lo, j_hi) of a KEEL_DIRECT product, in
 * groups of the table's column panels: every row panel over a group's panels, the whole
 * depth each, before the next row panel, so C is written once and A read once per group
 * (a group of one: column panel by column panel). A panel's masks are made from the
 * table's bits once per column panel when the group is one, else per tile (T shifts of
 * a word against the tile's C x T x MR x NR multiply-adds, C channels). */
static void direct_conv(const problem *g, const epilogue *e, int64_t i_lo, int64_t i_hi,
                        int64_t j_lo, int64_t j_hi)
{
    const int64_t *geo = g->b_cols;
    dpanel d;
    d.taps = geo[0];
    d.cs = geo[3];
    if (d.taps <= 0 || d.taps > DIRECT_MAX_TAPS) return; /* the caller serves none such */
    d.channels = g->k / d.taps;
    const int64_t *bits = geo + 4 + 3 * d.taps;
    int64_t group = direct_group(g, geo);
    int load_c = (e->flags & KEEL_ACCUMULATE) != 0;
    int64_t r_rows = (i_hi * MR < g->m ? i_hi * MR : g->m) - i_lo * MR;
    for (int64_t jg = j_lo; jg < j_hi; jg += group) {
        int64_t je = jg + group < j_hi ? jg + group : j_hi;
        for (int64_t jp = jg; jp < je; jp++) {
            if (!e->res || jp + DIRECT_RES_AHEAD >= j_hi) continue;
            const float *r = e->res + (i_lo * MR) * e->ldr + jp * NR + DIRECT_RES_AHEAD * NR;
            for (int64_t i = 0; i < r_rows; i++)
                for (int64_t o = 0; o < NR; o += 64 / (int64_t)sizeof(float))
                    __builtin_prefetch(r + i * e->ldr + o, 0, DIRECT_RES_LOCALITY);
        }
        if (je - jg == 1) direct_masks(&d, geo, bits + jg * d.taps);
        for (int64_t ip = i_lo; ip < i_hi; ip++) {
            int64_t i0 = ip * MR;
            int mr = (int)(g->m - i0 < MR ? g->m - i0 : MR);
            for (int64_t jp = jg; jp < je; jp++) {
                int64_t j0 = jp * NR, cols = g->n - j0 < NR ? g->n - j0 : NR;
                int nv = (int)((cols + VW - 1) / VW);
                if (je - jg > 1) direct_masks(&d, geo, bits + jp * d.taps);
                d.b = g->b + j0;
                target t = target_of(g, i0, j0, cols, load_c, 1);
                DTILES[nv - 1][mr - 1](g->a + ip * g->k * MR, &d, &t, e);
            }
        }
    }
}

/* ---- few rows of C against a raw B: tall tiles (AVX-512) ---------------------------- */

/* A product of few rows (a 1x1 conv's projection to 16 or 24 channels: M small, K
 * deep, N thousands of pixels) against a raw B with contiguous rows runs in tall
 * tiles: up to TALL_ROWS rows of C by one vector of columns, the whole depth in
 * registers (24 accumulators; A's values are broadcast from memory by the FMAs). Every
 * B vector is loaded once for all of C's rows (the 8 x 32 tiles load it once per row
 * panel, after packing it), B is read where it lies and C is written once. Products of
 * more rows run as groups of whole row panels over the same column vector (its B rows
 * then come from L1/L2) when the depth is at least twice the rows (a projection). Each
 * element of C is the sum over p in order from 0 (or from C), as in the 8 x 32 tiles of
 * a single depth block or of stored and reloaded partial sums: bitwise the same C for
 * any split and any grouping of rows.
 *
 * B's rows lie a plane apart (12.5 KB on 56x56), so one column vector touches k lines in
 * a few of L1's sets: they are fetched into L2 (prefetcht1) a few tiles ahead, about
 * KEEL_TALL_CYCLES FMAs of work, at least 3 and at most 16 vectors. Measured alone at
 * batch 32 (1 thread, ms): 96 -> 24 on 56x56 13.3 fetched into L1 4 vectors ahead, 6.5
 * with no prefetch, 4.5-9.3 into L2 2 vectors ahead, 4.6 at 4 or more (8.9-9.1 on the
 * 8 x 32 tiles). Inside MobileNetV2 at batch 32 (interleaved medians, ms, 8 x 32 tiles
 * -> tall; onnxruntime): 32 -> 16 on 112x112 8.43 -> 5.12 (3.75), 96 -> 24 on 56x56
 * 8.87 -> 4.58 (5.71), 144 -> 24 with the residual 14.31 -> 6.84 (9.06), 144 -> 32 on
 * 28x28 3.87 -> 2.35 (2.19), 192 -> 32 with the residual 5.40 -> 3.30 (2.92), 384 -> 64
 * on 14x14 with the residual 4.34 -> 3.70 (2.86), 576 -> 96 with the residual 10.11 ->
 * 7.87 (6.57). Expansions (depth below the rows) keep the 8 x 32 tiles: tall tiles took
 * 1.36x their time on 16 -> 96 on 112x112, 1.17x on 24 -> 144 on 56x56, the same on
 * 14x14. Blocking the depth of a grouped product (128-256 deep, 256-512 columns at a
 * time, A's block in L1) changed nothing measurable (0.96-1.03x). */
#if defined(__AVX512F__)
#define TALL_ROWS 24
#ifndef KEEL_TALL_CYCLES
#define KEEL_TALL_CYCLES 8192
#endif
#ifndef KEEL_TALL_MIN_AHEAD
#define KEEL_TALL_MIN_AHEAD 3
#endif

/* Tall tiles run a packed A and a raw B of contiguous rows (no tables, no column map),
 * any number of rows; whether a product that fits runs in them is the cpu planner's
 * choice, passed as KEEL_TALL. */
static int tall_fits(const problem *g, const epilogue *e)
{
    return (e->flags & KEEL_TALL) && !(e->flags & KEEL_DIRECT) && g->a_rs == 0 &&
           g->a_ks == 0 && g->b_cs == 1 && g->b_rs != 0 && !g->b_rows && !g->b_cols &&
           !g->c_cols;
}

/* Rows [0, h) of C from row i0, columns j0 .. j0 + 16 (lanes `lane`; full: all 16).
 * a: the packed A at row i0 (a multiple of MR), ps floats between its row panels. */
static inline __attribute__((always_inline)) void
tall_tile(int h, int full, int64_t k, const float *a, int64_t ps, const float *b, int64_t bs,
          int64_t ahead, __mmask16 lane, const target *t, const epilogue *e)
{
    vf acc[TALL_ROWS];
#pragma GCC unroll 24
    for (int i = 0; i < h; i++)
        acc[i] = !t->load_c ? (vf){0}
                 : full     ? load(t->c + i * t->ldc)
                            : masked_load(t->c + i * t->ldc, lane);
    for (int64_t p = 0; p < k; p++) {
        const float *bp = b + p * bs;
        __builtin_prefetch(bp + ahead, 0, 2);
        vf bv = full ? load(bp) : masked_load(bp, lane);
#pragma GCC unroll 24
        for (int i = 0; i < h; i++) acc[i] += splat(a[(i / MR) * ps + p * MR + i % MR]) * bv;
    }
#pragma GCC unroll 24
    for (int i = 0; i < h; i++) {
        float *cp = t->c + i * t->ldc;
        if (full) {
            store_final(cp, finish(acc[i], e, t->i0 + i, t->jbase), e->flags);
            continue;
        }
        vf v = acc[i];
        if (e->alpha != 1.0f) v *= e->alpha;
        if (e->bias_kind == 1) v += e->bias[t->i0 + i];
        else if (e->bias_kind == 2) v += epilogue_load(e->bias + t->jbase, lane);
        if (e->res) v += epilogue_load(e->res + (t->i0 + i) * e->ldr + t->jbase, lane);
        if (e->flags & KEEL_CLIP) v = clip(v, splat(e->lo), splat(e->hi));
        _mm512_mask_storeu_ps(cp, lane, (__m512)v);
    }
}

typedef void (*tall_fn)(int64_t, const float *, int64_t, const float *, int64_t, int64_t,
                        __mmask16, const target *, const epilogue *);
#define TALL(H)                                                                                \
    static void tall_##H(int64_t k, const float *a, int64_t ps, const float *b, int64_t bs,   \
                         int64_t ahead, __mmask16 lane, const target *t, const epilogue *e)   \
    {                                                                                          \
        if (lane == 0xFFFF)                                                                    \
            tall_tile(H, 1, k, a, ps, b, bs, ahead, lane, t, e);                               \
        else                                                                                   \
            tall_tile(H, 0, k, a, ps, b, bs, ahead, lane, t, e);                               \
    }
TALL(1) TALL(2) TALL(3) TALL(4) TALL(5) TALL(6) TALL(7) TALL(8) TALL(9) TALL(10) TALL(11)
TALL(12) TALL(13) TALL(14) TALL(15) TALL(16) TALL(17) TALL(18) TALL(19) TALL(20) TALL(21)
TALL(22) TALL(23) TALL(24)
static const tall_fn TALLS[TALL_ROWS] = {
    tall_1,  tall_2,  tall_3,  tall_4,  tall_5,  tall_6,  tall_7,  tall_8,
    tall_9,  tall_10, tall_11, tall_12, tall_13, tall_14, tall_15, tall_16,
    tall_17, tall_18, tall_19, tall_20, tall_21, tall_22, tall_23, tall_24};

/* Row panels [i_lo, i_hi) x column panels [j_lo, j_hi) in tall tiles: vector by vector
 * of columns, every group of rows (at most TALL_ROWS, whole row panels, as even as
 * that allows) over the whole depth. */
static void tall(const problem *g, const epilogue *e, int64_t i_lo, int64_t i_hi,
                 int64_t j_lo, int64_t j_hi)
{
    int64_t r_lo = i_lo * MR, r_hi = i_hi * MR < g->m ? i_hi * MR : g->m, k = g->k;
    if (r_lo >= r_hi) return;
    int64_t groups = (r_hi - r_lo + TALL_ROWS - 1) / TALL_ROWS;
    int64_t height = ((r_hi - r_lo + groups - 1) / groups + MR - 1) / MR * MR;
    int load_c = (e->flags & KEEL_ACCUMULATE) != 0;
    int64_t work = k * (r_hi - r_lo) > 0 ? k * (r_hi - r_lo) : 1;
    int64_t ahead = (KEEL_TALL_CYCLES + work - 1) / work;
    ahead = VW * (ahead < KEEL_TALL_MIN_AHEAD ? KEEL_TALL_MIN_AHEAD : ahead > 16 ? 16 : ahead);
    for (int64_t j0 = j_lo * NR; j0 < j_hi * NR && j0 < g->n; j0 += VW) {
        int64_t cols = g->n - j0 < VW ? g->n - j0 : VW;
        __mmask16 lane = (__mmask16)((1u << cols) - 1u);
        for (int64_t i0 = r_lo; i0 < r_hi; i0 += height) {
            int h = (int)(r_hi - i0 < height ? r_hi - i0 : height);
            target t = {g->c + i0 * g->ldc + j0, g->ldc, cols, NULL, i0, j0, load_c, 1};
            TALLS[h - 1](k, g->a + i0 * k, MR * k, g->b + j0, g->b_rs, ahead, lane, &t, e);
        }
    }
}
#endif

/* ---- narrow products with C's rows in the lanes (KEEL_LANES) ------------------------ */

/* A product of few columns (a 1x1 conv on a small map at batch 1: 49 or 196 pixels)
 * fills 32-column panels and 16-column vectors of C's columns poorly: 49 columns compute
 * 64. With KEEL_LANES (the cpu planner's lanes_tiles) and the operands tall tiles take
 * (a packed A, a raw B of contiguous rows, no tables), it runs with C's rows in the
 * lanes instead: a tile is 32 (or 16) rows of C by at most LANES_COLS columns, each
 * 16-lane vector of A loaded from a 16-row panel (the cpu planner's lanes_a16) or
 * joined from two 8-row ones (lanes_tile's modes), one broadcast of B per column and
 * step, the whole depth in registers; then each 16 x columns block is transposed in
 * registers and stored by rows with masked moves. The columns of a range split into
 * tiles as even as whole columns allow (49: 9, 10, 10, 10, 10), so no lane computes a
 * column that is not there. Each element of C is the chain of fused multiply-adds of
 * the other tiles, step after step, and the epilogue's operations in their order:
 * bitwise the result of the panels (and of any split). */
#if KEEL_LANES_BUILT
#include "transpose.h"
#define LANES_COLS 12
/* Depth steps ahead that a tile fetches A's panels into L2 (0: none). Inside a model A (up
 * to 1.2 MiB for 960 -> 320) comes from L3 or memory, two 8-row panels per vector (one
 * 16-row panel with the planner's lanes_a16, which came later and kept this distance,
 * measured with two), more streams than the hardware prefetcher follows well: MobileNetV2
 * at batch 1 (1 thread, thread CPU time, processes alternating, under load) 5.49-5.61 ms
 * without, 5.17-5.42 with 32 steps; 64 ran as 32, 128 as none. Where A is hot the fetches
 * cost nothing measurable (320 x 960 x 49: 132 and 133 us). B's rows of the tile, a row
 * apart (784 bytes on a 14x14 map), are fetched into L1 as far ahead: on two threads a
 * tile's B is partly the other core's (the depthwise conv before it splits by channels),
 * and its strided rows came in one miss at a time. MobileNetV2 at batch 1 on the 2-core
 * Xeon, keel / onnxruntime in one process, processes alternating, medians of 30 under
 * heavy load (a load average of 9-12): one thread (thread CPU time) 1.020 against 1.028 in
 * four pairs and 0.988 against 1.004 in three more; two threads (wall) 0.72-0.79 against
 * 0.75-0.78 in three pairs. Alone, hot, one thread: 320 -> 1280 on 7x7 270-285 against
 * 284-287 us, 576 -> 96 on 14x14 135-139 against 144-150. Per node inside the model on two
 * threads (benchmarks/pernode, fastest of 40 passes, keel / onnxruntime): 384 -> 64 +
 * residual 56.5 / 37 -> 42.3 / 41, 576 -> 96 + residual 101.8 / 72 -> 81.1 / 76, 384 -> 96
 * 71.0 / 50 -> 59.2 / 54 (docs/performance.md). */
#ifndef KEEL_LANES_AHEAD
#define KEEL_LANES_AHEAD 32
#endif

/* A's 16 rows at depth step p: eight from row panel lo, eight from row panel hi, each
 * `step` floats a depth step (8: 8-row panels; 16: halves of 16-row panels). */
static inline vf lanes_a(const float *lo, const float *hi, int64_t p, int step)
{
    __m256 l = _mm256_loadu_ps(lo + p * step), h = _mm256_loadu_ps(hi + p * step);
    return (vf)_mm512_insertf32x8(_mm512_castps256_ps512(l), h, 1);
}

/* The finished rows 16 v .. 16 v + 16 (those below `rows`) of a tile of w columns. */
static inline __attribute__((always_inline)) void
lanes_store(int w, int v, int rows, vf acc[LANES_COLS][2], const target *t,
            const epilogue *e)
{
    __m512 r[16];
    for (int j = 0; j < 16; j++) r[j] = j < w ? (__m512)acc[j][v] : _mm512_setzero_ps();
    transpose16(r);
    __mmask16 lane = (__mmask16)((1u << w) - 1u);
    for (int l = 0; l < 16 && 16 * v + l < rows; l++) {
        int64_t i = t->i0 + 16 * v + l;
        vf x = (vf)r[l];
        if (e->alpha != 1.0f) x *= e->alpha;
        if (e->bias_kind == 1) x += e->bias[i];
        else if (e->bias_kind == 2) x += epilogue_load(e->bias + t->jbase, lane);
        if (e->res) x += epilogue_load(e->res + i * e->ldr + t->jbase, lane);
        if (e->flags & KEEL_CLIP) x = clip(x, splat(e->lo), splat(e->hi));
        _mm512_mask_storeu_ps(t->c + (16 * v + l) * t->ldc, lane, (__m512)x);
    }
}

/* Rows [0, rows) of C from t->i0 (rows <= 16 nv), columns [0, w): a[2 v], a[2 v + 1]
 * are the packed row panels of vector v, b points at the tile's first column of B.
 * `mode` says how A is packed (the cpu planner's lanes_a16): LANES_A8, in 8-row panels;
 * LANES_A16, in 16-row panels, a[v] vector v's: one load a step where two 8-row panels
 * take an insert to join, which issues on the port of the second FMA unit on Intel's
 * cores; LANES_A16_HALVES, in 16-row panels read from a half (a tile starting on an
 * odd 8-row panel): a[2 v], a[2 v + 1] are 8-row halves, 16 floats a step apart. The
 * same values in the same lanes: the same bits. */
enum { LANES_A8, LANES_A16, LANES_A16_HALVES };
static inline __attribute__((always_inline)) void
lanes_tile(int w, int nv, int mode, int64_t k, const float *const *a, const float *b,
           int64_t bs, int rows, const target *t, const epilogue *e)
{
    int step = mode == LANES_A8 ? 8 : 16;
    vf acc[LANES_COLS][2];
    for (int j = 0; j < w; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = (vf){0};
    for (int64_t p = 0; p < k; p++) {
        vf av[2];
#if KEEL_LANES_AHEAD > 0
        if (mode == LANES_A16)
            for (int q = 0; q < nv; q++)
                __builtin_prefetch(a[q] + (p + KEEL_LANES_AHEAD) * 16, 0, 2);
        else if ((p & 1) == 0 || mode == LANES_A16_HALVES)
            for (int q = 0; q < 2 * nv; q++)
                __builtin_prefetch(a[q] + (p + KEEL_LANES_AHEAD) * step, 0, 2);
        __builtin_prefetch(b + (p + KEEL_LANES_AHEAD) * bs, 0, 3);
        __builtin_prefetch(b + (p + KEEL_LANES_AHEAD) * bs + w - 1, 0, 3);
#endif
        for (int v = 0; v < nv; v++)
            av[v] = mode == LANES_A16 ? (vf)_mm512_loadu_ps(a[v] + p * 16)
                                      : lanes_a(a[2 * v], a[2 * v + 1], p, step);
        const float *bp = b + p * bs;
        for (int j = 0; j < w; j++) {
            vf bv = splat(bp[j]);
            for (int v = 0; v < nv; v++) acc[j][v] += bv * av[v];
        }
    }
    for (int v = 0; v < nv; v++) lanes_store(w, v, rows, acc, t, e);
}

typedef void (*lanes_fn)(int, int64_t, const float *const *, const float *, int64_t, int,
                         const target *, const epilogue *);
#define LANES(W, MODE, NAME)                                                                   \
    static void NAME##W(int nv, int64_t k, const float *const *a, const float *b,             \
                        int64_t bs, int rows, const target *t, const epilogue *e)             \
    {                                                                                          \
        if (nv == 2)                                                                           \
            lanes_tile(W, 2, MODE, k, a, b, bs, rows, t, e);                                   \
        else                                                                                   \
            lanes_tile(W, 1, MODE, k, a, b, bs, rows, t, e);                                   \
    }
#define LANES_ALL(W) \
    LANES(W, LANES_A8, lanes_) LANES(W, LANES_A16, lanes16_) LANES(W, LANES_A16_HALVES, halves_)
LANES_ALL(1) LANES_ALL(2) LANES_ALL(3) LANES_ALL(4) LANES_ALL(5) LANES_ALL(6) LANES_ALL(7)
LANES_ALL(8) LANES_ALL(9) LANES_ALL(10) LANES_ALL(11) LANES_ALL(12)
static const lanes_fn LANES_TILES[3][LANES_COLS] = {
    {lanes_1, lanes_2, lanes_3, lanes_4, lanes_5, lanes_6, lanes_7, lanes_8, lanes_9, lanes_10,
     lanes_11, lanes_12},
    {lanes16_1, lanes16_2, lanes16_3, lanes16_4, lanes16_5, lanes16_6, lanes16_7, lanes16_8,
     lanes16_9, lanes16_10, lanes16_11, lanes16_12},
    {halves_1, halves_2, halves_3, halves_4, halves_5, halves_6, halves_7, halves_8, halves_9,
     halves_10, halves_11, halves_12}};

/* Whether lanes tiles take the product's operands: a packed A, B's rows contiguous and
 * unmapped, C's columns plain, no accumulation into C and not a masked conv. */
static int lanes_operands(const problem *g, const epilogue *e)
{
    return !(e->flags & (KEEL_DIRECT | KEEL_ACCUMULATE)) && g->a_rs == 0 && g->a_ks == 0 &&
           g->b_cs == 1 && g->b_rs != 0 && !g->b_rows && !g->b_cols && !g->c_cols;
}

static int lanes_fit(const problem *g, const epilogue *e)
{
    return (e->flags & KEEL_LANES) && lanes_operands(g, e);
}

/* Whether the range's last column panel, the product's partial one, runs in lanes tiles
 * while the full panels run in 8 x 32 tiles (KEEL_LANES_TAIL: the cpu planner's
 * lanes_tail): the operands lanes tiles take, and the range ends at C's last column. */
static int lanes_tail_fits(const problem *g, const epilogue *e, int64_t j_hi)
{
    return (e->flags & KEEL_LANES_TAIL) && g->n % NR != 0 && j_hi * NR >= g->n &&
           lanes_operands(g, e);
}

/* Row panels [i_lo, i_hi) x column panels [j_lo, j_hi) in lanes tiles: 32 rows at a
 * time (A's block stays in L2) over every tile of the range's columns. `a16`: NULL (A in
 * 8-row panels), or A packed in 16-row panels only (row panels 2 q and 2 q + 1 of A side
 * by side in pair q, k * 16 floats a pair), read from its halves where the range starts
 * on an odd 8-row panel (a split's row group). */
static void lanes_product(const problem *g, const epilogue *e, int64_t i_lo, int64_t i_hi,
                          int64_t j_lo, int64_t j_hi, const float *a16)
{
    int64_t m = g->m, k = g->k, panels = (m + MR - 1) / MR;
    int64_t r_lo = i_lo * MR, r_hi = i_hi * MR < m ? i_hi * MR : m;
    int64_t c_lo = j_lo * NR, c_hi = j_hi * NR < g->n ? j_hi * NR : g->n;
    if (r_lo >= r_hi || c_lo >= c_hi) return;
    int64_t cols = c_hi - c_lo, tiles = (cols + LANES_COLS - 1) / LANES_COLS;
    int mode = a16 == NULL ? LANES_A8 : r_lo % 16 == 0 ? LANES_A16 : LANES_A16_HALVES;
    for (int64_t i0 = r_lo; i0 < r_hi; i0 += 32) {
        int rows = (int)(r_hi - i0 < 32 ? r_hi - i0 : 32);
        const float *a[4];
        for (int q = 0; q < 4; q++) {
            int64_t ip = i0 / MR + q;      /* a panel past A's end: its pair's (lanes unused) */
            a[q] = q > 0 && ip >= panels ? a[q - 1]
                   : mode == LANES_A8    ? g->a + ip * k * MR
                                         : a16 + ip / 2 * k * 16 + ip % 2 * 8;
        }
        if (mode == LANES_A16) {           /* a pair past A's end is never read (nv 1) */
            a[0] = a16 + i0 / 16 * k * 16;
            a[1] = a[0] + k * 16;
        }
        for (int64_t q = 0; q < tiles; q++) {
            int64_t j0 = c_lo + q * cols / tiles, j1 = c_lo + (q + 1) * cols / tiles;
            target t = {g->c + i0 * g->ldc + j0, g->ldc, j1 - j0, NULL, i0, j0, 0, 1};
            LANES_TILES[mode][j1 - j0 - 1](rows > 16 ? 2 : 1, k, a, g->b + j0, g->b_rs, rows,
                                           &t, e);
        }
    }
}
#endif

#if KEEL_LANES_BUILT
/* ---- the masked conv in lanes tiles (AVX-512) ----------------------------------------- */

/* A KEEL_DIRECT product with KEEL_LANES (the cpu planner's masked_lanes: few output
 * pixels, a stride-2 conv on a 7x7 output at batch 1) runs with C's rows in the vector
 * lanes, computing only the pixels there are (49, where the column panels compute 64):
 * the columns [c_lo, c_hi) of B are first read through the panels' masks, as the masked
 * tiles read them, into the workspace (row p, c_hi - c_lo floats), then the lanes tiles
 * run over that plain B (32 rows of C a block, A's block in L2, every column tile of the
 * range). Each element of C is the chain of fused multiply-adds of the masked tiles, the
 * same products of the same taps (a tap outside the plane is 0 in both) in the same
 * order, and the same epilogue: bitwise the masked tiles' C, for any split. */
static int direct_lanes_fit(const problem *g, const epilogue *e)
{
    /* lanes_product writes plain columns of C and reads every one of B's k rows: no
     * column map of C, and k whole taps of channels (direct_lanes_b writes those). */
    return (e->flags & KEEL_LANES) && !(e->flags & KEEL_ACCUMULATE) && !g->c_cols &&
           g->b_cols[0] > 0 && g->b_cols[0] <= DIRECT_MAX_TAPS && g->k % g->b_cols[0] == 0 &&
           g->k * g->n <= keel_gemm_workspace_f32();
}

/* B's rows over columns [c_lo, c_hi) (whole column panels [j_lo, j_hi) but the last
 * one's end) into w, row p at w + p * (c_hi - c_lo): masked loads, stores masked to
 * the columns there are. */
static void direct_lanes_b(const problem *g, int64_t j_lo, int64_t j_hi, int64_t c_hi,
                           float *w)
{
    const int64_t *geo = g->b_cols;
    dpanel d;
    d.taps = geo[0];
    d.cs = geo[3];
    d.channels = g->k / d.taps;
    int64_t ws = c_hi - j_lo * NR;
    for (int64_t jp = j_lo; jp < j_hi; jp++) {
        int64_t j0 = jp * NR, cols = c_hi - j0 < NR ? c_hi - j0 : NR;
        direct_masks(&d, geo, geo + 4 + 3 * d.taps + jp * d.taps);
        float *out = w + (j0 - j_lo * NR);
        const float *b = g->b + j0;
        for (int64_t c = 0, p = 0; c < d.channels; c++, b += d.cs)
            for (int64_t t = 0; t < d.taps; t++, p++)
                for (int v = 0; v * VW < cols; v++)
                    _mm512_mask_storeu_ps(out + p * ws + v * VW, part_lanes(cols, v),
                                          (__m512)masked_load(b + d.off[t] + v * VW,
                                                              d.mask[t][v]));
    }
}

/* Row panels [i_lo, i_hi) x column panels [j_lo, j_hi) of a KEEL_DIRECT product in lanes
 * tiles (direct_lanes_fit). */
static void direct_lanes(const problem *g, const epilogue *e, int64_t i_lo, int64_t i_hi,
                         int64_t j_lo, int64_t j_hi)
{
    int64_t c_lo = j_lo * NR, c_hi = j_hi * NR < g->n ? j_hi * NR : g->n;
    if (c_lo >= c_hi || i_lo >= i_hi) return;
    direct_lanes_b(g, j_lo, j_hi, c_hi, g->work);
    /* The plain product of the copied columns, C and the residual from column c_lo. */
    problem p = *g;
    p.n = c_hi - c_lo;
    p.b = g->work;
    p.b_rs = p.n;
    p.b_cs = 1;
    p.b_rows = p.b_cols = NULL;
    p.c = g->c + c_lo;
    epilogue ep = *e;
    if (e->res) ep.res = e->res + c_lo;
    if (e->bias_kind == 2) ep.bias = e->bias + c_lo;
    lanes_product(&p, &ep, i_lo, i_hi, 0, (p.n + NR - 1) / NR, NULL);
}
#endif

/* Whether a product of a packed B runs its whole depth in one block: up to 2 * KC deep
 * (a column panel of B, 128 KiB with AVX-512, stays in L2 across the row panels) when
 * the row panels' A of the whole depth fits the A block of the workspace. One block
 * stores C once and packs a raw A once instead of twice per column block (measured on
 * the 2-core Zen 5, thread CPU time: an MLP's 32 x 784 x 512 layer 118 -> 113 us with
 * KC = 1024 against 512). A raw B keeps the blocks of KC rows its packing is sized for. */
static int one_deep_block(const problem *g, int64_t i_lo, int64_t i_hi)
{
    int b_packed = g->b_rs == 0 && g->b_cs == 0 && !g->b_rows && !g->b_cols;
    return b_packed && g->k > KC && g->k <= 2 * KC &&
           (i_hi - i_lo) * g->k <= (int64_t)MC_PANELS * KC;
}

/* C = epilogue(alpha * A @ B) over row panels [i_lo, i_hi) and column panels [j_lo, j_hi). */
static void gemm_2d(const problem *g0, const epilogue *e, int64_t i_lo, int64_t i_hi,
                    int64_t j_lo, int64_t j_hi)
{
    problem pg = *g0;
    const problem *g = &pg;
    int64_t m = g->m, k = g->k;
    int a_raw = g->a_rs != 0 || g->a_ks != 0;
    float *wa = g->work, *wb = g->work + MC_PANELS * MR * KC;
    if (e->flags & KEEL_DIRECT) {
#if KEEL_LANES_BUILT
        if (direct_lanes_fit(g, e)) {
            direct_lanes(g, e, i_lo, i_hi, j_lo, j_hi);
            return;
        }
#endif
        direct_conv(g, e, i_lo, i_hi, j_lo, j_hi);
        return;
    }
#if KEEL_LANES_BUILT
    /* A held in 16-row panels only: every part of the product runs in lanes tiles (the
       caller prepares it so only where lanes_fit holds and a gemv would not serve). */
    if (g->a16 != NULL) {
        lanes_product(g, e, i_lo, i_hi, j_lo, j_hi, g->a16);
        return;
    }
#endif
    if (gemv_serves(g) && i_lo == 0 && i_hi == 1) {
        gemv(g, e, j_lo, j_hi);
        return;
    }
#if KEEL_LANES_BUILT
    if (lanes_fit(g, e)) {
        lanes_product(g, e, i_lo, i_hi, j_lo, j_hi, NULL);
        return;
    }
#endif
#if defined(__AVX512F__)
    if (tall_fits(g, e)) {
        tall(g, e, i_lo, i_hi, j_lo, j_hi);
        return;
    }
#endif
#if KEEL_LANES_BUILT
    if (lanes_tail_fits(g, e, j_hi)) {
        int64_t last = g->n / NR; /* the last column panel, partly filled */
        lanes_product(g, e, i_lo, i_hi, last, last + 1, NULL);
        if (j_lo >= (j_hi = last)) return;
    }
#endif
    /* Blocks of equal depth (288 = 144 + 144, not 256 + 32: a thin last block costs
       a pass over C for little work). */
    int deep = one_deep_block(g, i_lo, i_hi);
    int64_t nblocks = deep ? 1 : k > 0 ? (k + KC - 1) / KC : 1;
    int64_t kstep = k > 0 ? (k + nblocks - 1) / nblocks : 0;
    int64_t mc = deep ? i_hi - i_lo : MC_PANELS;
    pg.a_ps = MR * (deep ? k : KC);
    int by_rows = nblocks == 1 && rows_first(g, e);
    int64_t step = by_rows ? rows_first_panels(kstep) : NC_PANELS;
    int64_t held_ib = -1, held_kb = -1; /* the block of A packed in wa */
    for (int64_t jc = j_lo; jc < j_hi; jc += step) {
        int64_t je = jc + step < j_hi ? jc + step : j_hi;
        for (int64_t ib = i_lo; ib < i_hi; ib += mc) {
            int64_t ie = ib + mc < i_hi ? ib + mc : i_hi;
            for (int64_t kb = 0; kb < nblocks; kb++) {
                int64_t k0 = kb * kstep;
                int64_t kc = k - k0 < kstep ? k - k0 : kstep;
                if (a_raw && (ib != held_ib || kb != held_kb))
                    for (int64_t ip = ib; ip < ie; ip++) {
                        int64_t r0 = ip * MR, w = m - r0 < MR ? m - r0 : MR;
                        pack_block(g->a + r0 * g->a_rs, g->a_rs, g->a_ks, NULL, 0, w, MR, k0,
                                   kc, wa + (ip - ib) * g->a_ps);
                    }
                held_ib = ib, held_kb = kb;
                int load_c = kb > 0 || (e->flags & KEEL_ACCUMULATE), last = kb == nblocks - 1;
                if (by_rows) {
                    row_panels_first(g, e, jc, je, ib, ie, kc, load_c, a_raw ? wa : NULL, wb);
                    continue;
                }
                for (int64_t jp = jc; jp < je; jp++)
                    column_panel(g, e, jp, ib, ie, k0, kc, load_c, last,
                                 a_raw ? wa : NULL, wb);
            }
        }
    }
}

#define FPTR(x) ((float *)(intptr_t)(x))

/* ---- a shallow convolution by bands of output rows (keel_conv_band_f32) ------------ */

/* A dense 2-D convolution of few input channels (depth C * KH * KW up to a few
 * hundred: a network's first layer) on a large image. Per band of output rows of one
 * image, the band's B (every tap of every channel, a row of the band's output pixels
 * each) is built from X's rows in a buffer that stays in L1/L2, then the usual tiles run
 * over it and store Y's NCHW rows with the epilogue. No padded or phase-split copy of X
 * and no gathered panels: a stride-2 tap row is two masked loads and a permute per 16
 * pixels (a 3-wide kernel row padded by one: its three taps from one split, band_row3).
 * Measured on MobileNetV2's 3 -> 32 3x3 stride-2 conv on 224x224 at batch 32
 * (1 thread, inside the model, interleaved medians): 18.3 ms through the zero-bordered
 * phase copy (6.6 ms of it) and gathered panels, 12.0 ms by bands with Y's stores past
 * the cache (KEEL_NT; 16.1 -> 12.2 ms alone with them). At batch 1 (alone) 0.35 ms:
 * ~75 % the tiles (27 steps deep, ~84 GFLOP/s), ~25 % building the bands; prefetching
 * the next band's rows of X changed nothing measurable. */
typedef struct {
    int64_t n, c, h, w;                         /* X: images, channels, rows, columns */
    int64_t m, oh, ow;                          /* Y: channels, rows, columns */
    int64_t kh, kw, sh, sw, dh, dw, ph, pw;     /* kernel, strides, dilations, pads */
    int64_t a;                                  /* the filter packed as A (depth c*kh*kw) */
    int64_t x, y;                               /* X and Y, contiguous NCHW */
    int64_t bias;                               /* 0, or M floats */
    int64_t res, flags;                         /* a residual shaped as Y (or 0); KEEL_CLIP */
    double lo, hi;
} keel_conv_band_args;

/* keel_conv_band_args' size and the byte offset of X's address, checked at load as
 * keel_gemm_args' are. */
int64_t keel_conv_band_args_size(void) { return (int64_t)sizeof(keel_conv_band_args); }
int64_t keel_conv_band_args_x_offset(void) { return (int64_t)offsetof(keel_conv_band_args, x); }

/* Floats of a band's B at most (K x columns; 64 KiB: in L2 beside the tiles' rows). */
#define BAND_FLOATS (16 * 1024)

/* Output rows per band: of those whose B fits BAND_FLOATS, the count filling the
 * column panels best (224 columns of a 112-wide output: seven whole panels). */
int64_t keel_conv_band_rows_f32(const keel_conv_band_args *g)
{
    int64_t k = g->c * g->kh * g->kw, best = 1;
    double fill = 0.0;
    for (int64_t r = 1; r <= g->oh && r <= 16; r++) {
        int64_t cols = r * g->ow, width = (cols + VW - 1) / VW * VW;
        if (r > 1 && k * width > BAND_FLOATS) break;
        double f = (double)cols / (double)((cols + NR - 1) / NR * NR);
        if (f > fill + 1e-9) fill = f, best = r;
    }
    return best;
}

/* Floats between rows of a band's B: its columns rounded up to whole vectors, and one
 * vector more (a row's last vector is stored whole). */
static int64_t band_ldb(const keel_conv_band_args *g, int64_t rows)
{
    return (rows * g->ow + VW - 1) / VW * VW + VW;
}

int64_t keel_conv_band_workspace_f32(const keel_conv_band_args *g)
{
    return g->c * g->kh * g->kw * band_ldb(g, keel_conv_band_rows_f32(g));
}

#if defined(__AVX512F__)
/* The lanes l < count whose element first + l * s lies in [0, w) (s 1 or 2, l < 16). */
static inline __mmask16 band_lanes(int64_t first, int64_t w, int64_t count)
{
    int64_t lo = first < 0 ? -first : 0, hi = w - first;
    if (hi > count) hi = count;
    if (hi <= lo) return 0;
    if (lo > VW) lo = VW;
    if (hi > VW) hi = VW;
    return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}
#endif

/* dst[ox] = row[ox * s + q] for ox in [0, ow), 0 where that leaves [0, w); with AVX-512
 * dst[ow .. ow rounded up to a vector) is written too (zeros). */
static void band_row(float *restrict dst, const float *row, int64_t w, int64_t ow, int64_t s,
                     int64_t q)
{
#if defined(__AVX512F__)
    if (s == 1 || s == 2) {
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8,
                                              6, 4, 2, 0);
        for (int64_t ox = 0; ox < ow; ox += VW) {
            int64_t count = ow - ox < VW ? ow - ox : VW, first = ox * s + q;
            __m512 v;
            if (count == VW && first >= 0 && first + s * VW <= w) {
                /* Inside the row (most vectors): plain loads. */
                v = s == 1 ? _mm512_loadu_ps(row + first)
                           : _mm512_permutex2var_ps(_mm512_loadu_ps(row + first), even,
                                                    _mm512_loadu_ps(row + first + VW));
            } else if (s == 1) {
                v = _mm512_maskz_loadu_ps(band_lanes(first, w, count), row + first);
            } else {
                /* Elements first .. first + 32: the even ones are the outputs. Lane l of
                   the two loads is element first + l (+ 16); only those below
                   first + 2 * count are needed. */
                int64_t need = 2 * count;
                __mmask16 k0 = band_lanes(first, w, need < VW ? need : VW);
                __mmask16 k1 = band_lanes(first + VW, w, need - VW);
                __m512 a = _mm512_maskz_loadu_ps(k0, row + first);
                __m512 b = _mm512_maskz_loadu_ps(k1, row + first + VW);
                v = _mm512_permutex2var_ps(a, even, b);
            }
            _mm512_storeu_ps(dst + ox, v);
        }
        return;
    }
#endif
    for (int64_t ox = 0; ox < ow; ox++) {
        int64_t i = ox * s + q;
        dst[ox] = i >= 0 && i < w ? row[i] : 0.0f;
    }
}

#if defined(__AVX512F__)
/* The three taps of a stride-2 row padded by one on the left, at once: d0[ox] =
 * row[2 ox - 1], d1[ox] = row[2 ox], d2[ox] = row[2 ox + 1] (0 outside [0, w)), for ox
 * in [0, ow) and, as band_row writes, zeros up to ow rounded up to a vector. Each pair
 * of X's vectors is loaded once and split into its even and odd elements; the odd ones
 * shifted a lane are kx = 0's. The values band_row gives the three taps one by one (a
 * copy: the same bits), for a third of its loads and loop: building MobileNetV2's stem
 * bands took 29 % of the conv's time (perf, the 2-core Intel Xeon). */
static void band_row3(float *restrict d0, float *restrict d1, float *restrict d2,
                      const float *row, int64_t w, int64_t ow)
{
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6,
                                          4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512 prev = _mm512_setzero_ps();   /* lane 15: row[2 ox - 1] of the next vector */
    for (int64_t ox = 0; ox < ow; ox += VW) {
        int64_t count = ow - ox < VW ? ow - ox : VW, first = 2 * ox;
        __mmask16 keep = count == VW ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
        __m512 a, b;
        if (count == VW && first + 2 * VW <= w) {
            a = _mm512_loadu_ps(row + first);
            b = _mm512_loadu_ps(row + first + VW);
        } else {
            int64_t need = 2 * count;
            a = _mm512_maskz_loadu_ps(band_lanes(first, w, need < VW ? need : VW), row + first);
            b = _mm512_maskz_loadu_ps(band_lanes(first + VW, w, need - VW), row + first + VW);
        }
        __m512 ev = _mm512_permutex2var_ps(a, even, b), od = _mm512_permutex2var_ps(a, odd, b);
        __m512 left = _mm512_castsi512_ps(
            _mm512_alignr_epi32(_mm512_castps_si512(od), _mm512_castps_si512(prev), 15));
        _mm512_storeu_ps(d0 + ox, _mm512_maskz_mov_ps(keep, left));
        _mm512_storeu_ps(d1 + ox, ev);
        _mm512_storeu_ps(d2 + ox, od);
        prev = od;
    }
}
#endif

/* Whether band_row3 builds a channel's three taps of a kernel row (stride 2, three taps
 * one apart, padded by one on the left). */
static int band_three(const keel_conv_band_args *g)
{
#if defined(__AVX512F__)
    return g->sw == 2 && g->kw == 3 && g->dw == 1 && g->pw == 1;
#else
    (void)g;
    return 0;
#endif
}

/* The band's B: row p = (c, ky, kx), its columns the output pixels of rows oy0 ..
 * oy0 + rows, at buf + p * ldb. */
static void band_fill(const keel_conv_band_args *g, const float *x, int64_t oy0, int64_t rows,
                      int64_t ldb, float *buf)
{
    int three = band_three(g);
    for (int64_t c = 0, p = 0; c < g->c; c++)
        for (int64_t ky = 0; ky < g->kh; ky++) {
            for (int64_t r = 0; three && r < rows; r++) {
                int64_t iy = (oy0 + r) * g->sh + ky * g->dh - g->ph;
                float *d = buf + p * ldb + r * g->ow;
                if (iy < 0 || iy >= g->h) {
                    for (int64_t kx = 0; kx < 3; kx++)
                        memset(d + kx * ldb, 0, (size_t)g->ow * sizeof(float));
                    continue;
                }
#if defined(__AVX512F__)
                band_row3(d, d + ldb, d + 2 * ldb, x + (c * g->h + iy) * g->w, g->w, g->ow);
#endif
            }
            for (int64_t kx = 0; kx < g->kw; kx++, p++) {
                float *d = buf + p * ldb;
                for (int64_t r = 0; !three && r < rows; r++) {
                    int64_t iy = (oy0 + r) * g->sh + ky * g->dh - g->ph;
                    float *dr = d + r * g->ow;
                    if (iy < 0 || iy >= g->h)
                        memset(dr, 0, (size_t)g->ow * sizeof(float));
                    else
                        band_row(dr, x + (c * g->h + iy) * g->w, g->w, g->ow, g->sw,
                                 kx * g->dw - g->pw);
                }
                /* Zeros past the band's columns: the last tile's unused lanes read them. */
                for (int64_t j = rows * g->ow; j < ldb; j++) d[j] = 0.0f;
            }
        }
}

/* The tiles of a built band (`cols` columns of B at work, ldb apart) into y: output
 * channel i's columns at y + i * ldy; `jbase` the band's first column in its image's
 * plane (the epilogue's index). */
static void band_tiles(const keel_conv_band_args *g, const float *work, int64_t ldb,
                       int64_t cols, float *y, int64_t ldy, int64_t jbase, const epilogue *e)
{
    int64_t k = g->c * g->kh * g->kw, m = g->m;
    const float *a = FPTR(g->a);
    for (int64_t j0 = 0; j0 < cols; j0 += NR) {
        int64_t width = cols - j0 < NR ? cols - j0 : NR;
        int nv = (int)((width + VW - 1) / VW);
        bsource s = {work + j0, ldb, NULL};
        for (int64_t i0 = 0; i0 < m; i0 += MR) {
            int mr = (int)(m - i0 < MR ? m - i0 : MR);
            target tg = {y + i0 * ldy + j0, ldy, width, NULL, i0, jbase + j0, 0, 1};
            TILES[nv - 1][mr - 1](k, a + i0 * k, &s, &tg, e);
        }
    }
}

/* Units [u_lo, u_hi) of batch * bands, image-major (bands of keel_conv_band_rows_f32
 * rows; the last one of an image may be shorter). Every element of Y is the same sum
 * in the same order whatever the split: bitwise the same Y for any thread count.
 * `work`: keel_conv_band_workspace_f32(g) floats. */
void keel_conv_band_f32(const keel_conv_band_args *g, float *work, int64_t u_lo, int64_t u_hi)
{
    int64_t rows = keel_conv_band_rows_f32(g), bands = (g->oh + rows - 1) / rows;
    int64_t m = g->m, plane = g->oh * g->ow;
    int64_t ldb = band_ldb(g, rows);
    for (int64_t u = u_lo; u < u_hi; u++) {
        int64_t t = u / bands, oy0 = (u % bands) * rows;
        int64_t r = g->oh - oy0 < rows ? g->oh - oy0 : rows;
        band_fill(g, FPTR(g->x) + t * g->c * g->h * g->w, oy0, r, ldb, work);
        epilogue e = {FPTR(g->bias), g->bias ? 1 : 0,
                      g->res ? FPTR(g->res) + t * m * plane : NULL, plane, 1.0f,
                      (float)g->lo, (float)g->hi, g->flags & (KEEL_CLIP | KEEL_NT)};
        band_tiles(g, work, ldb, r * g->ow, FPTR(g->y) + t * m * plane + oy0 * g->ow, plane,
                   oy0 * g->ow, &e);
    }
#if defined(__SSE2__)
    if (g->flags & KEEL_NT) _mm_sfence();
#endif
}

/* ---- a shallow conv pooled while its rows are in cache (keel_conv_pool_f32) ---------- */

/* A shallow conv (the band conv's arguments; no residual, Y never stored whole)
 * followed by a max pool of its output: per band of pooled rows of one image, the conv
 * rows they read are computed up to `fill` rows at a time into a buffer of the thread's
 * (every output channel's rows [lo, hi) of the conv), then pooled from there into the
 * pooled Y by window.c's keel_maxpool_part_f32 (its address handed in, as the
 * attention's softmax is), then the rows the next step's windows no longer read are
 * dropped. ResNet-18's stem: its 3.1 MiB output at batch 1 never leaves L2. The conv's
 * rows read their taps as the gathered form does (pool_conv_rows: a zero-bordered
 * phase image of the X rows they read, the taps in place through a row table), not
 * from a band's B built tap by tap as keel_conv_band_f32 builds it: B's 147 rows of
 * ResNet-18's stem were written for every two conv rows (band_fill 14 % of the fused
 * call's time, perf), the phase image holds X's values about once. Alone (the stem's
 * conv + ReLU + pool, one process, alternating, under load, the 2-core Intel Xeon):
 * batch 1, one thread, median 1.925 against 2.041 ms (0.94x), fastest 1.593 against
 * 1.683; two threads 0.90x median; batch 32 0.90x (one thread), 0.96x (two). A band's
 * first conv row, shared with the band before it, is computed by both (the same sum:
 * the same bits). Every element is the gathered conv's and the row pool's: bitwise the
 * conv then the pool, on any split. */
typedef struct {
    int64_t pool;       /* keel_maxpool_part_f32's address */
    int64_t geometry;   /* its window geometry (window.c's) over the conv's output */
    int64_t y;          /* the pooled Y (N, M, PH, PW), contiguous */
    int64_t ph, pw;     /* pooled rows and columns */
    int64_t kh, sh, pt; /* the pool window's rows, row stride and top padding */
    int64_t bands;      /* bands of pooled rows an image: units are images x bands */
    int64_t step;       /* pooled rows a step: the buffer holds the conv rows they read */
    int64_t fill;       /* conv rows a phase image (pool_conv_rows) at most */
    int64_t scratch;    /* floats of the pool's own scratch */
} keel_conv_pool_args;

typedef int64_t (*pool_part_fn)(const float *, int64_t, int64_t, int64_t, float *,
                                const int64_t *, float *, int64_t, int64_t, int64_t);

int64_t keel_conv_pool_args_size(void) { return (int64_t)sizeof(keel_conv_pool_args); }

static int64_t round_vw(int64_t floats) { return (floats + VW - 1) / VW * VW; }

/* Conv rows the buffer holds: the most that `step` pooled rows read. */
static int64_t pool_rows_held(const keel_conv_pool_args *p)
{
    return (p->step - 1) * p->sh + p->kh;
}

/* The gathered taps' phase image of `fill` conv rows: its rows and columns a phase
 * plane (the taps of a kernel row or column reach (k - 1) * dilation / stride past the
 * output's), and its floats (every phase of every channel, and a vector of slack: a
 * row's last vector is stored whole). */
static int64_t gather_qh(const keel_conv_band_args *g, int64_t rows)
{
    return rows + (g->kh - 1) * g->dh / g->sh;
}

static int64_t gather_qw(const keel_conv_band_args *g)
{
    return g->ow + (g->kw - 1) * g->dw / g->sw;
}

static int64_t gather_floats(const keel_conv_band_args *g, const keel_conv_pool_args *p)
{
    return round_vw(g->sh * g->sw * g->c * gather_qh(g, p->fill) * gather_qw(g) + VW);
}

/* Floats of the conv's part of the workspace: the phase image, a packed panel of B
 * (K x NR) and the taps' row table (K int64). */
static int64_t pool_taps_floats(const keel_conv_band_args *g, const keel_conv_pool_args *p)
{
    int64_t k = g->c * g->kh * g->kw;
    return gather_floats(g, p) + round_vw(k * NR) + round_vw(2 * k);
}

int64_t keel_conv_pool_workspace_f32(const keel_conv_band_args *g, const keel_conv_pool_args *p)
{
    return pool_taps_floats(g, p) + round_vw(g->m * pool_rows_held(p) * g->ow) +
           round_vw(p->scratch);
}

/* Tap p = (c, ky, kx)'s offset in the phase image of `qh` rows a plane: its phase's
 * plane of channel c, then the row and column its shift reaches. */
static void gather_taps(const keel_conv_band_args *g, int64_t qh, int64_t *taps)
{
    int64_t qw = gather_qw(g), plane = qh * qw;
    for (int64_t c = 0, p = 0; c < g->c; c++)
        for (int64_t ky = 0; ky < g->kh; ky++)
            for (int64_t kx = 0; kx < g->kw; kx++, p++) {
                int64_t fh = ky * g->dh % g->sh, fw = kx * g->dw % g->sw;
                taps[p] = ((fh * g->sw + fw) * g->c + c) * plane +
                          ky * g->dh / g->sh * qw + kx * g->dw / g->sw;
            }
}

/* The phase image of conv rows [oy0, oy0 + rows): phase (fh, fw) of channel c, row u,
 * column v is X's element (c, (oy0 + u) * sh + fh - ph, v * sw + fw - pw), 0 outside
 * X (the padding). Written in address order: band_row's zeros past a row's end fall
 * on the next row before it is written. */
static void gather_fill(const keel_conv_band_args *g, const float *x, int64_t oy0,
                        int64_t qh, float *img)
{
    int64_t qw = gather_qw(g);
    for (int64_t fh = 0; fh < g->sh; fh++)
        for (int64_t fw = 0; fw < g->sw; fw++)
            for (int64_t c = 0; c < g->c; c++)
                for (int64_t u = 0; u < qh; u++, img += qw) {
                    int64_t iy = (oy0 + u) * g->sh + fh - g->ph;
                    if (iy < 0 || iy >= g->h)
                        memset(img, 0, (size_t)qw * sizeof(float));
                    else
                        band_row(img, x + (c * g->h + iy) * g->w, g->w, qw, g->sw, fw - g->pw);
                }
}

/* Conv rows [oy0, oy0 + rows) into y (output channel i's rows at y + i * ldy) from taps
 * gathered out of their phase image: a column panel inside one output row reads its
 * taps in place through the row table, one across output rows (up to NR of them, where
 * a row is one column wide) is packed (pack_gathered) first. The same tiles over the
 * same A and the same values of B as band_tiles: the same bits. */
static void pool_conv_rows(const keel_conv_band_args *g, const keel_conv_pool_args *p,
                           const float *x, int64_t oy0, int64_t rows, float *work,
                           float *y, int64_t ldy, const epilogue *e)
{
    int64_t k = g->c * g->kh * g->kw, m = g->m, ow = g->ow, qw = gather_qw(g);
    int64_t qh = gather_qh(g, rows), cols = rows * ow;
    float *img = work, *wb = work + gather_floats(g, p);
    int64_t *taps = (int64_t *)(void *)(wb + round_vw(k * NR));
    const float *a = FPTR(g->a);
    gather_fill(g, x, oy0, qh, img);
    gather_taps(g, qh, taps);
    for (int64_t j0 = 0; j0 < cols; j0 += NR) {
        int64_t width = cols - j0 < NR ? cols - j0 : NR, map[NR];
        int nv = (int)((width + VW - 1) / VW);
        for (int64_t j = 0; j < width; j++) map[j] = (j0 + j) / ow * qw + (j0 + j) % ow;
        bsource s = {img + map[0], 0, taps};
        if (width != NR || map[width - 1] != map[0] + width - 1) {
            pack_gathered(img, taps, map, width, 0, k, wb);
            s = (bsource){wb, NR, NULL};
        }
        for (int64_t i0 = 0; i0 < m; i0 += MR) {
            int mr = (int)(m - i0 < MR ? m - i0 : MR);
            target tg = {y + i0 * ldy + j0, ldy, width, NULL, i0, oy0 * ow + j0, 0, 1};
            TILES[nv - 1][mr - 1](k, a + i0 * k, &s, &tg, e);
        }
    }
}

/* Drop the buffer's rows below `lo` (it holds rows [*blo, *bhi) of every channel, `held`
 * rows apart). */
static void pool_drop(float *buf, int64_t m, int64_t held, int64_t ow, int64_t lo,
                      int64_t *blo, int64_t *bhi)
{
    if (lo >= *bhi) {
        *blo = *bhi = lo;
        return;
    }
    if (lo <= *blo) return;
    for (int64_t i = 0; i < m; i++)
        memmove(buf + i * held * ow, buf + (i * held + lo - *blo) * ow,
                (size_t)((*bhi - lo) * ow) * sizeof(float));
    *blo = lo;
}

/* What keel_conv_pool_f32 (and its _mt form) returns where the pool refused the rows it
 * was handed: a step's pooled rows, by the pool's own geometry, read a conv row outside
 * the rows computed for them ([blo, bhi): the window's rows, row stride and top padding
 * held here (kh, sh, pt) disagree with the geometry's), or the geometry is one the row
 * kernel does not serve. Python prepares both from one window
 * (native_gemm.prepare_pooled), so it is a broken invariant, reported rather than
 * pooled from rows not computed or left as unwritten output. */
#define KEEL_POOL_REFUSED (-2)

/* KEEL_POOL_REFUSED, for native_gemm to check its own copy against at load. */
int64_t keel_conv_pool_refused(void) { return KEEL_POOL_REFUSED; }

/* Pooled rows [r0, r1) of image t: 0, or KEEL_POOL_REFUSED. */
static int64_t conv_pool_band(const keel_conv_band_args *g, const keel_conv_pool_args *p,
                              float *work, int64_t t, int64_t r0, int64_t r1)
{
    int64_t m = g->m, held = pool_rows_held(p);
    float *buf = work + pool_taps_floats(g, p), *scratch = buf + round_vw(m * held * g->ow);
    const float *x = FPTR(g->x) + t * g->c * g->h * g->w;
    float *y = FPTR(p->y) + t * m * p->ph * p->pw;
    epilogue e = {FPTR(g->bias), g->bias ? 1 : 0, NULL, 0, 1.0f, (float)g->lo, (float)g->hi,
                  g->flags & KEEL_CLIP};
    pool_part_fn pool = (pool_part_fn)(intptr_t)p->pool;
    int64_t blo = 0, bhi = 0;
    for (int64_t a = r0; a < r1; a += p->step) {
        int64_t b = a + p->step < r1 ? a + p->step : r1;
        int64_t lo = a * p->sh - p->pt, hi = (b - 1) * p->sh - p->pt + p->kh;
        lo = lo < 0 ? 0 : lo;
        hi = hi > g->oh ? g->oh : hi;
        pool_drop(buf, m, held, g->ow, lo, &blo, &bhi);
        for (; bhi < hi; ) {
            int64_t r = hi - bhi < p->fill ? hi - bhi : p->fill;
            pool_conv_rows(g, p, x, bhi, r, work, buf + (bhi - blo) * g->ow, held * g->ow,
                           &e);
            bhi += r;
        }
        /* The rows computed, [blo, bhi), `held` rows apart: a window reaching past them
         * is refused, not read from a row an earlier step left in the buffer. */
        if (pool(buf, blo, bhi - blo, held, y, FPTR(p->geometry), scratch, m, a, b) != 0)
            return KEEL_POOL_REFUSED;
    }
    return 0;
}

/* Units [u_lo, u_hi) of images x bands (image-major; band j of an image its pooled rows
 * [j * PH / bands, (j + 1) * PH / bands)). `work`: keel_conv_pool_workspace_f32 floats.
 * 0, or KEEL_POOL_REFUSED at the first band the pool refused. */
int64_t keel_conv_pool_f32(const keel_conv_band_args *g, const keel_conv_pool_args *p,
                           float *work, int64_t u_lo, int64_t u_hi)
{
    for (int64_t u = u_lo; u < u_hi; u++) {
        int64_t t = u / p->bands, j = u % p->bands;
        int64_t rc = conv_pool_band(g, p, work, t, j * p->ph / p->bands,
                                    (j + 1) * p->ph / p->bands);
        if (rc != 0) return rc;
    }
    return 0;
}

/* The arguments of keel_gemm_f32: every field 8 bytes (addresses as integers), so
 * Python fills it with one struct.pack('<24q3d'). */
typedef struct {
    int64_t m, n, k;
    int64_t a, a_rs, a_ks, a_bs;     /* A: address and element strides (row, depth, batch) */
    int64_t b, b_rs, b_cs, b_bs;     /* B: address and element strides (depth, column, batch) */
    int64_t b_rows;                  /* 0, or the address of k int64 row offsets of B */
    int64_t b_cols;                  /* 0, or the address of n int64 column offsets of B */
    int64_t c, ldc, c_bs;            /* C: address, row stride, batch stride */
    int64_t c_cols;                  /* 0, or the address of n int64 column offsets of C */
    int64_t bias, bias_kind;         /* bias: address (0: none); 1 per row, 2 per column */
    int64_t res, ldr, r_bs;          /* R: address (0: none), row stride, batch stride */
    int64_t flags;                   /* KEEL_ACCUMULATE | KEEL_CLIP */
    int64_t a16;                     /* 0, or A's address: A packed in 16-row panels only */
    double alpha, lo, hi;
} keel_gemm_args;

/* 1 where the lanes tiles are built (KEEL_LANES_BUILT: AVX-512's 8 x 32 tile): only then
 * does a product read an A packed in 16-row panels only (keel_gemm_args' a16). */
int64_t keel_gemm_lanes_built_f32(void)
{
#if KEEL_LANES_BUILT
    return 1;
#else
    return 0;
#endif
}

/* The layout Python packs keel_gemm_args in, checked when native_gemm.py loads this
 * library: the struct's size and the byte offsets of C's and A's addresses (the fields a
 * prepared call rebinds). */
int64_t keel_gemm_args_size(void) { return (int64_t)sizeof(keel_gemm_args); }
int64_t keel_gemm_args_c_offset(void) { return (int64_t)offsetof(keel_gemm_args, c); }
int64_t keel_gemm_args_a_offset(void) { return (int64_t)offsetof(keel_gemm_args, a); }

#define IPTR(x) ((const int64_t *)(intptr_t)(x))

/* C[t] = clip(alpha * A[t] @ B[t] + bias + R[t], lo, hi) for a batch of products.
 *
 * Operands: A whose two strides are both 0 is packed (panels of MR rows, k * MR
 * floats each), and so is B whose two strides are 0 and has no row table
 * (panels of NR columns, k * NR floats each); a packed operand steps by a_bs /
 * b_bs floats between products (0: shared). Otherwise element (i, p) of A[t] is
 * a[t * a_bs + i * a_rs + p * a_ks] and element (p, j) of B[t] is
 * b[t * b_bs + p * b_rs + j * b_cs], or b[t * b_bs + b_rows[p] + j] with a row
 * table (then b_cs is 1), or b[t * b_bs + b_rows[p] + b_cols[j]] with both
 * tables (gathered into packed blocks: a conv's compact output pixels read
 * from a padded image). Raw operands are packed block by block into `work`
 * (keel_gemm_workspace_f32() floats, one per concurrent call) or read in place.
 *
 * Output: C[t][i][j] is c[t * c_bs + i * ldc + j], or c[t * c_bs + i * ldc +
 * c_cols[j]] with a column map (a negative entry: column j is not stored; the
 * bias is then per row).
 * bias[i] per row or bias[j] per column, then R[t][i][j] = res[t * r_bs + i *
 * ldr + j] (the column mapped as C's), are added after alpha. flags:
 * KEEL_ACCUMULATE starts from the value C holds instead of zero (alpha then
 * scales it too: callers pass alpha = 1), KEEL_CLIP clips to [lo, hi] (NaN
 * stays NaN), KEEL_STREAM packs a raw B in long runs, KEEL_TALL and KEEL_LANES run
 * tall or lanes tiles where the operands fit them, and KEEL_DIRECT reads B's
 * taps straight from a convolution's source planes through lane masks: b_cols then
 * points to the conv's geometry and mask table instead of a column table (see
 * "a convolution's taps read in place" above).
 *
 * Range: units [u_lo, u_hi) of batch * panels, product-major, where panels are
 * the column panels (ceil(n / NR)), or the row panels (ceil(m / MR)) when
 * split_rows is 1. split_rows = -B (B products) takes column panels panel-major
 * instead: unit u is column panel u / B of product u % B, so a range of units covers
 * the same columns of every product (Winograd's sixteen products over the tiles of
 * some images: the images the same thread transformed). Any division of the units
 * over calls gives the same C.
 */
static void gemm_tile(const keel_gemm_args *g, float *work, int64_t t, int64_t i_lo,
                      int64_t i_hi, int64_t j_lo, int64_t j_hi);

/* Panels [lo_p, hi_p) of product t: row panels with split_rows, else column panels. */
static void gemm_panels(const keel_gemm_args *g, float *work, int64_t t, int64_t split_rows,
                        int64_t lo_p, int64_t hi_p)
{
    int64_t mp = (g->m + MR - 1) / MR, np = (g->n + NR - 1) / NR;
    if (split_rows)
        gemm_tile(g, work, t, lo_p, hi_p, 0, np);
    else
        gemm_tile(g, work, t, 0, mp, lo_p, hi_p);
}

void keel_gemm_f32(const keel_gemm_args *g, float *work, int64_t split_rows, int64_t u_lo,
                   int64_t u_hi)
{
    int64_t m = g->m, n = g->n;
    int64_t mp = (m + MR - 1) / MR, np = (n + NR - 1) / NR;
    if (split_rows < 0) {
        int64_t batch = -split_rows;
        if (np == 0 || u_lo >= u_hi) return;
        for (int64_t t = 0; t < batch; t++) {  /* panels p with p * batch + t in range */
            int64_t lo_p = u_lo <= t ? 0 : (u_lo - t + batch - 1) / batch;
            int64_t hi_p = u_hi <= t ? 0 : (u_hi - 1 - t) / batch + 1;
            if (hi_p > np) hi_p = np;
            if (lo_p < hi_p) gemm_panels(g, work, t, 0, lo_p, hi_p);
        }
        goto fence;
    }
    int64_t panels = split_rows ? mp : np;
    if (panels == 0 || u_lo >= u_hi) return;
    for (int64_t t = u_lo / panels; t * panels < u_hi; t++) {
        int64_t lo_p = u_lo > t * panels ? u_lo - t * panels : 0;
        int64_t hi_p = u_hi < (t + 1) * panels ? u_hi - t * panels : panels;
        gemm_panels(g, work, t, split_rows, lo_p, hi_p);
    }
fence:
#if defined(__SSE2__)
    if (g->flags & KEEL_NT) _mm_sfence();
#endif
}

/* Row panels [i_lo, i_hi) x column panels [j_lo, j_hi) of product t. */
static void gemm_tile(const keel_gemm_args *g, float *work, int64_t t, int64_t i_lo,
                      int64_t i_hi, int64_t j_lo, int64_t j_hi)
{
    problem p = {g->m,
                 g->n,
                 g->k,
                 FPTR(g->a) + t * g->a_bs,
                 g->a_rs,
                 g->a_ks,
                 FPTR(g->b) + t * g->b_bs,
                 g->b_rs,
                 g->b_cs,
                 IPTR(g->b_rows),
                 IPTR(g->b_cols),
                 FPTR(g->c) + t * g->c_bs,
                 g->ldc,
                 IPTR(g->c_cols),
                 work,
                 MR * KC,
                 FPTR(g->a16)};
    epilogue e = {FPTR(g->bias),    g->bias ? g->bias_kind : 0,
                  g->res ? FPTR(g->res) + t * g->r_bs : NULL,
                  g->ldr,           (float)g->alpha,
                  (float)g->lo,     (float)g->hi,
                  g->flags};
    gemm_2d(&p, &e, i_lo, i_hi, j_lo, j_hi);
}

/* C[t] = ... as keel_gemm_f32, in a grid of tiles: every product's row panels in
 * `rows` groups and its column panels in `cols` groups (as even as whole panels
 * allow: group q of P panels in G groups is [q * P / G, (q + 1) * P / G)), tile
 * u of [u_lo, u_hi) being row group u % rows of column group (u / rows) % cols of
 * product u / (rows * cols). Consecutive tiles share their column group, so a thread
 * with several reads the same columns of B. A tile runs whole on its thread with the
 * thread's own workspace: its A rows and B columns packed there, no buffer shared.
 * Any grid and any division of the tiles over calls gives the same C (an element is
 * computed by the same operations in any tile). How the grid is chosen is the cpu
 * planner's rule (gemm_split). */
void keel_gemm_tiles_f32(const keel_gemm_args *g, float *work, int64_t rows, int64_t cols,
                         int64_t u_lo, int64_t u_hi)
{
    int64_t mp = (g->m + MR - 1) / MR, np = (g->n + NR - 1) / NR, per = rows * cols;
    if (mp == 0 || np == 0 || rows < 1 || cols < 1 || u_lo >= u_hi) return;
    for (int64_t u = u_lo; u < u_hi; u++) {
        int64_t t = u / per, rg = u % per % rows, cg = u % per / rows;
        int64_t i_lo = rg * mp / rows, i_hi = (rg + 1) * mp / rows;
        int64_t j_lo = cg * np / cols, j_hi = (cg + 1) * np / cols;
        if (i_lo < i_hi && j_lo < j_hi) gemm_tile(g, work, t, i_lo, i_hi, j_lo, j_hi);
    }
#if defined(__SSE2__)
    if (g->flags & KEEL_NT) _mm_sfence();
#endif
}

/* Row panels [r_lo, r_hi) of the `batch` products of the prepared call g (A packed, no
 * bias, residual or tables) against a raw B of n columns (row p of product t at b + t *
 * b_bs + p * ldb) into C (row i - r_lo * MR of product t at c + t * c_bs + i * ldc), on
 * the calling thread with `work`: a caller's own block of columns through the products
 * inside its own parallel task (Winograd's per-thread pipeline, winograd.c). B and C are
 * the caller's, in its cache: nothing streams. Each element is computed as keel_gemm_f32
 * computes it in the whole product, from 8-row panels or 16-row ones (a16). */
void keel_gemm_block_f32(const keel_gemm_args *g, float *work, int64_t batch, int64_t r_lo,
                         int64_t r_hi, const float *b, int64_t ldb, int64_t b_bs, float *c,
                         int64_t ldc, int64_t c_bs, int64_t n)
{
    keel_gemm_args a = *g;
    int64_t mp = (g->m + MR - 1) / MR, hi = r_hi < mp ? r_hi : mp;
    int64_t i0 = r_lo * MR, i1 = r_hi * MR < g->m ? r_hi * MR : g->m;
    if (i0 >= i1 || n < 1 || g->a_rs != 0 || g->a_ks != 0) return;
    a.n = n;
    a.b = (int64_t)(intptr_t)b, a.b_rs = ldb, a.b_cs = 1, a.b_bs = b_bs;
    a.b_rows = 0, a.b_cols = 0;
    a.c = (int64_t)(intptr_t)c, a.ldc = ldc, a.c_bs = c_bs, a.c_cols = 0;
    a.bias = 0, a.bias_kind = 0, a.res = 0;
    a.flags &= ~(int64_t)(KEEL_STREAM | KEEL_NT | KEEL_ACCUMULATE | KEEL_CLIP | KEEL_DIRECT);
    if (g->a16 != 0) {
        /* A packed in 16-row panels only (a16, A's own address): a block starting on an
           odd row panel starts inside a pair, which only A's own panel numbering reads
           (lanes_product's halves), so the block keeps A's rows and C's address is taken
           back by i0 rows, the rows below the block never written. */
        a.c -= i0 * ldc * (int64_t)sizeof(float);
        for (int64_t t = 0; t < batch; t++) keel_gemm_f32(&a, work, 1, t * mp + r_lo, t * mp + hi);
        return;
    }
    a.m = i1 - i0;
    a.a = g->a + i0 * g->k * (int64_t)sizeof(float);
    keel_gemm_f32(&a, work, 0, 0, batch * ((n + NR - 1) / NR));
}

/* ---- on keel's worker threads ------------------------------------------------------ */

#include "parallel.h"

typedef struct {
    const keel_gemm_args *g;
    int64_t split_rows;
} gemm_job;

static void gemm_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const gemm_job *j = ctx;
    keel_gemm_f32(j->g, scratch, j->split_rows, lo, hi);
}

/* keel_gemm_f32 over units [0, units) in `parts` chunks on keel's worker threads (each
 * with its own workspace). Returns 0, or -1 when a workspace could not be allocated. */
int64_t keel_gemm_mt_f32(const keel_gemm_args *g, int64_t split_rows, int64_t units,
                         int64_t parts)
{
    gemm_job j = {g, split_rows};
    return run_parts(gemm_task, &j, units, parts, keel_gemm_workspace_f32());
}

typedef struct {
    const keel_gemm_args *g;
    int64_t rows, cols;
} tiles_job;

static void tiles_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const tiles_job *j = ctx;
    keel_gemm_tiles_f32(j->g, scratch, j->rows, j->cols, lo, hi);
}

/* keel_gemm_tiles_f32 over tiles [0, units) in `parts` chunks of consecutive tiles on
 * keel's worker threads (each with its own workspace). Returns 0, or -1 when a
 * workspace could not be allocated. */
int64_t keel_gemm_tiles_mt_f32(const keel_gemm_args *g, int64_t rows, int64_t cols,
                               int64_t units, int64_t parts)
{
    tiles_job j = {g, rows, cols};
    return run_parts(tiles_task, &j, units, parts, keel_gemm_workspace_f32());
}

/* Bound products of a run one after another, without a return to the caller between
 * them (after a product that passes a model's weights through the L2, the caller's
 * interpreter finds its own code and data in L3: docs/performance.md, "Where the MLP's
 * run goes"): n entries of 6 words, a kind (0: keel_gemm_f32, 1: keel_gemm_tiles_mt_f32)
 * and that function's five arguments. Returns the index of the first entry that failed
 * (-1 from keel_gemm_tiles_mt_f32: no workspace; or a kind of neither, not run), else
 * -1. */
int64_t keel_gemm_calls_f32(const int64_t *list, int64_t n)
{
    for (int64_t i = 0; i < n; i++, list += 6) {
        const keel_gemm_args *g = (const keel_gemm_args *)(intptr_t)list[1];
        if (list[0] == 0)
            keel_gemm_f32(g, FPTR(list[2]), list[3], list[4], list[5]);
        else if (list[0] != 1 || keel_gemm_tiles_mt_f32(g, list[2], list[3], list[4],
                                                        list[5]) != 0)
            return i;
    }
    return -1;
}

static void band_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    keel_conv_band_f32(ctx, scratch, lo, hi);
}

/* keel_conv_band_f32 over units [0, units) in `parts` chunks on keel's worker threads
 * (each with its own band buffer). Returns 0, or -1 when a buffer could not be had. */
int64_t keel_conv_band_mt_f32(const keel_conv_band_args *g, int64_t units, int64_t parts)
{
    return run_parts(band_task, (void *)g, units, parts, keel_conv_band_workspace_f32(g));
}

typedef struct {
    const keel_conv_band_args *g;
    const keel_conv_pool_args *p;
    int64_t refused;    /* KEEL_POOL_REFUSED where a part's pool refused its rows */
} conv_pool_job;

static void conv_pool_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    conv_pool_job *j = ctx;
    if (keel_conv_pool_f32(j->g, j->p, scratch, lo, hi) != 0)
        __atomic_store_n(&j->refused, KEEL_POOL_REFUSED, __ATOMIC_RELAXED);
}

/* keel_conv_pool_f32 over units [0, units) in `parts` chunks on keel's worker threads
 * (each with its own buffers). Returns 0, -1 when a buffer could not be had, or
 * KEEL_POOL_REFUSED. */
int64_t keel_conv_pool_mt_f32(const keel_conv_band_args *g, const keel_conv_pool_args *p,
                              int64_t units, int64_t parts)
{
    conv_pool_job j = {g, p, 0};
    int64_t rc = run_parts(conv_pool_task, &j, units, parts, keel_conv_pool_workspace_f32(g, p));
    return rc != 0 ? rc : j.refused;
}

/* ---- fused attention, whole heads (or blocks of their rows) per thread -----------------
 *
 * softmax(scale * Q Kᵀ + mask) V for a batch of heads, each block of a head's query
 * rows taken whole by one thread through every step: its scores = scale * Q Kᵀ on the
 * GEMM into the thread's own scratch, the causal mask and the mask added, a row softmax
 * (fastmath's keel_softmax_f32, whose address Python hands in: the same rows as its own
 * calls), then Y = P V. A head's rows are cut into `blocks` blocks of whole row panels
 * (the planner's choice: more than one only where the heads are fewer than the
 * threads); unit u is block u % blocks of head u / blocks. The products are the
 * prepared arguments `qk` and `pv` of every head (product h is head h); their scores
 * operand is rebound here to the thread's scratch. A query row is computed by the same
 * instructions whatever the split (the GEMM's rows do not depend on the panels run
 * with them): the same bits on any thread count and any number of blocks, and those
 * of the products and softmax run step by step.
 */
typedef void (*keel_rows_fn)(const float *x, float *y, int64_t n, int64_t lo, int64_t hi,
                             int32_t mode);

/* Every field 8 bytes: Python fills it with one struct.pack('<12q'). */
typedef struct {
    int64_t s, t;                     /* query rows and keys per head */
    int64_t mask, inner, mb, mh, ms;  /* float mask (0: none): address, inner heads, and
                                         element strides of outer heads, inner heads, rows */
    int64_t causal;                   /* 1: key j > query i is hidden */
    int64_t softmax, mode;            /* keel_softmax_f32's address and its mode */
    int64_t heads, blocks;            /* blocks: row blocks a head (0 or 1: whole heads) */
} keel_attention_args;

int64_t keel_attention_args_size(void) { return (int64_t)sizeof(keel_attention_args); }

typedef struct {
    const keel_gemm_args *qk, *pv;
    const keel_attention_args *at;
} attention_job;

/* Floats of the packing workspace before a thread's scores (kept 64-byte aligned). */
static int64_t attention_work(void) { return (keel_gemm_workspace_f32() + 15) / 16 * 16; }

/* Scratch floats one thread needs: the GEMM's workspace, then one head's scores. */
int64_t keel_attention_scratch_f32(const keel_attention_args *at)
{
    return attention_work() + at->s * at->t;
}

/* Row panels [p_lo, p_hi) of head h (rows [p_lo * MR, p_hi * MR) clipped to s). */
static void attention_rows(const attention_job *j, float *work, float *scores, int64_t h,
                           int64_t p_lo, int64_t p_hi)
{
    const keel_attention_args *at = j->at;
    int64_t s = at->s, t = at->t, mp = (s + MR - 1) / MR;
    int64_t r_lo = p_lo * MR, r_hi = p_hi * MR < s ? p_hi * MR : s;
    keel_gemm_args qk = *j->qk, pv = *j->pv;
    qk.c = (int64_t)(intptr_t)scores;
    qk.ldc = t;
    qk.c_bs = 0;
    keel_gemm_f32(&qk, work, 1, h * mp + p_lo, h * mp + p_hi);
    if (at->causal)
        for (int64_t i = r_lo; i < r_hi; i++)
            for (int64_t c = i + 1; c < t; c++) scores[i * t + c] = -INFINITY;
    if (at->mask) {
        const float *m = FPTR(at->mask) + (h / at->inner) * at->mb + (h % at->inner) * at->mh;
        for (int64_t i = r_lo; i < r_hi; i++)
            for (int64_t c = 0; c < t; c++) scores[i * t + c] += m[i * at->ms + c];
    }
    ((keel_rows_fn)(intptr_t)at->softmax)(scores, scores, t, r_lo, r_hi, (int32_t)at->mode);
    pv.a = (int64_t)(intptr_t)scores;
    pv.a_rs = t;
    pv.a_ks = 1;
    pv.a_bs = 0;
    keel_gemm_f32(&pv, work, 1, h * mp + p_lo, h * mp + p_hi);
}

static void attention_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const attention_job *j = ctx;
    int64_t blocks = j->at->blocks > 1 ? j->at->blocks : 1;
    int64_t mp = (j->at->s + MR - 1) / MR;
    for (int64_t u = lo; u < hi; u++) {
        int64_t b = u % blocks;       /* group b of the mp panels in `blocks` even groups */
        int64_t p_lo = b * mp / blocks, p_hi = (b + 1) * mp / blocks;
        if (p_lo < p_hi)
            attention_rows(j, scratch, scratch + attention_work(), u / blocks, p_lo, p_hi);
    }
}

/* Units [lo, hi) (heads x row blocks, above) on the calling thread, with `scratch` of
 * keel_attention_scratch_f32 floats (64-byte aligned). */
void keel_attention_f32(const keel_gemm_args *qk, const keel_gemm_args *pv,
                        const keel_attention_args *at, float *scratch, int64_t lo, int64_t hi)
{
    attention_job j = {qk, pv, at};
    attention_task(&j, scratch, lo, hi);
}

/* Every unit (heads x row blocks) in `parts` contiguous runs on keel's worker threads,
 * each with its own scratch. Returns 0, or -1 when a scratch could not be allocated. */
int64_t keel_attention_mt_f32(const keel_gemm_args *qk, const keel_gemm_args *pv,
                              const keel_attention_args *at, int64_t parts)
{
    attention_job j = {qk, pv, at};
    int64_t units = at->heads * (at->blocks > 1 ? at->blocks : 1);
    return run_parts(attention_task, &j, units, parts, keel_attention_scratch_f32(at));
}
