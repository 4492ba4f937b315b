/* How a kernel library reaches keel's worker threads (threads.c).
 *
 * keel.native.build loads threads.c's library and hands every kernel library the
 * address of its keel_parallel_capped through keel_use_pool, so one pool of workers serves
 * them all (separate pools would spin against each other). A library whose pool was
 * never set (threads.c failed to build) runs the chunks in order on the calling
 * thread: the same chunks, so the same results.
 */
#ifndef KEEL_PARALLEL_H
#define KEEL_PARALLEL_H

#include <stdint.h>
#include <stdlib.h>

/* One chunk [lo, hi) of a job; scratch is the running thread's own buffer. */
typedef void (*keel_task)(void *ctx, float *scratch, int64_t lo, int64_t hi);
typedef int64_t (*keel_parallel_fn)(keel_task fn, void *ctx, int64_t n, int64_t parts,
                                    int64_t threads, int64_t scratch_floats);

static keel_parallel_fn keel_pool_run = 0;

void keel_use_pool(keel_parallel_fn fn) { keel_pool_run = fn; }

/* fn over [0, n) in `parts` near-equal contiguous chunks (threads.c's split) on at most
 * `threads` threads (0: as many as chunks), on the pool when there is one: the chunks
 * past the threads' own claimed one at a time. Returns 0, or -1 when no scratch could
 * be had. */
static inline int64_t run_parts_capped(keel_task fn, void *ctx, int64_t n, int64_t parts,
                                       int64_t threads, int64_t scratch_floats)
{
    if (keel_pool_run) return keel_pool_run(fn, ctx, n, parts, threads, scratch_floats);
    if (n <= 0) return 0;
    if (parts > n) parts = n;
    if (parts < 1) parts = 1;
    size_t bytes = ((size_t)(scratch_floats > 0 ? scratch_floats : 1) * sizeof(float) + 63) / 64
                   * 64;
    float *scratch = aligned_alloc(64, bytes);
    if (!scratch) return -1;
    int64_t base = n / parts, extra = n % parts, lo = 0;
    for (int64_t c = 0; c < parts; c++) {
        int64_t hi = lo + base + (c < extra);
        fn(ctx, scratch, lo, hi);
        lo = hi;
    }
    free(scratch);
    return 0;
}

/* fn over [0, n) in `parts` chunks on up to `parts` threads (run_parts_capped). */
static inline int64_t run_parts(keel_task fn, void *ctx, int64_t n, int64_t parts,
                                int64_t scratch_floats)
{
    return run_parts_capped(fn, ctx, n, parts, 0, scratch_floats);
}

#endif
