/* Tree-ensemble walk (keel/backends/cpu/trees.py): the leaf each (tree, row) pair
 * reaches, for forests whose every split is `x <= split` (NaN goes false), in the
 * walk's layout: node k's feature and split at position 2k, its false and true
 * children (as positions) at children[2k] and children[2k + 1]; positions from `end`
 * on are leaves, leaf l at end + 2l.
 *
 *   keel_tree_leaves_f32     float32 rows and splits
 *   keel_tree_leaves_mt_f32  the same over rows in chunks on keel's worker threads
 *
 * Each pair is walked alone, tree after tree for a block of rows (the tree's nodes stay
 * in cache while the rows go through it), so any split of the rows gives the same
 * leaves. At most `depth` steps, as the NumPy walk takes. Nothing allocates. */
#include <stdint.h>

#include "parallel.h"

/* Rows [lo, hi) of x (rows, cols): leaf[t * rows + r] for every tree t. */
void keel_tree_leaves_f32(const float *x, int64_t cols, const int32_t *feature,
                          const float *split, const int32_t *children, const int32_t *roots,
                          int64_t trees, int64_t end, int64_t depth, int32_t *leaf,
                          int64_t rows, int64_t lo, int64_t hi)
{
    for (int64_t t = 0; t < trees; t++) {
        int32_t *out = leaf + t * rows;
        for (int64_t r = lo; r < hi; r++) {
            const float *row = x + r * cols;
            int64_t pos = roots[t];
            for (int64_t s = 0; s < depth && pos < end; s++)
                pos = children[pos + (row[feature[pos]] <= split[pos])];
            out[r] = (int32_t)((pos - end) / 2);
        }
    }
}

typedef struct {
    const float *x, *split;
    const int32_t *feature, *children, *roots;
    int32_t *leaf;
    int64_t cols, trees, end, depth, rows;
} walk_job;

static void walk_task(void *ctx, float *scratch, int64_t lo, int64_t hi)
{
    const walk_job *j = ctx;
    (void)scratch;
    keel_tree_leaves_f32(j->x, j->cols, j->feature, j->split, j->children, j->roots, j->trees,
                         j->end, j->depth, j->leaf, j->rows, lo, hi);
}

/* keel_tree_leaves_f32 over all rows in `parts` chunks of rows. Returns 0, or -1 when a
 * thread's scratch could not be had. */
int64_t keel_tree_leaves_mt_f32(const float *x, int64_t cols, const int32_t *feature,
                                const float *split, const int32_t *children,
                                const int32_t *roots, int64_t trees, int64_t end, int64_t depth,
                                int32_t *leaf, int64_t rows, int64_t parts)
{
    walk_job j = {.x = x, .split = split, .feature = feature, .children = children,
                  .roots = roots, .leaf = leaf, .cols = cols, .trees = trees, .end = end,
                  .depth = depth, .rows = rows};
    return run_parts(walk_task, &j, rows, parts, 0);
}
