"""cpu kernels of the tree ensembles: a level-synchronous, vectorized forest walk.

Every (row, tree) pair holds its current node; each step moves all pairs still at
a split one level down with a handful of whole-array gathers (feature, split,
children) and one comparison, and drops the pairs that reached a leaf. The walk
takes as many steps as the deepest path; rows go in blocks so the pair arrays
stay small. Leaves are then summed (or averaged, or min/max-ed) through a dense
(leaves, targets) table, tree after tree in X's precision (float32 for float32 X) as
onnxruntime sums, so labels at near-ties agree with it. The semantics are the
reference's (:mod:`keel.backends.reference.trees`), which sums in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.cpu.kernels import TABLE
from keel.backends.reference.trees import check_columns
from keel.ops.registry import Op
from keel.ops.schemas.trees import (
    FLOAT_DTYPES,
    MEMBER,
    Forest,
    classify,
    finish_scores,
    forest_of,
)

__all__: list[str] = []

# (row, tree) pairs walked at once: bounds the walk's scratch to a few tens of MiB.
_PAIRS_PER_BLOCK = 1 << 18


def _goes_true(forest: Forest, node: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Whether each pair takes its node's true branch, for any mix of split modes."""
    split = forest.split[node]
    if forest.only_leq:
        go = v <= split
    else:
        mode = forest.mode[node]
        go = np.select([mode == 0, mode == 1, mode == 2, mode == 3, mode == 4, mode == 5],
                       [v <= split, v < split, v >= split, v > split, v == split, v != split],
                       default=False)
        for k in np.unique(node[mode == MEMBER]):
            at = node == k
            go[at] = np.isin(v[at], forest.members[int(k)])
    if forest.missing_true.any():
        go |= np.isnan(v) & forest.missing_true[node]
    return go


def _leaves(forest: Forest, x: np.ndarray) -> np.ndarray:
    """The leaf each row reaches in each tree: (rows, trees), indices into the leaf table."""
    rows, trees, n = x.shape[0], len(forest.roots), forest.n_nodes
    flat = np.ascontiguousarray(x).reshape(-1)
    children = np.stack([forest.false_next, forest.true_next], axis=1).reshape(-1)
    node = np.tile(forest.roots, rows)
    base = np.repeat(np.arange(rows, dtype=np.int64) * x.shape[1], trees)
    active = np.arange(len(node))
    cur = node.copy()
    for _ in range(forest.depth):
        go = _goes_true(forest, cur, flat[base + forest.feature[cur]])
        cur = children[2 * cur + go]
        done = cur >= n
        if done.any():
            node[active[done]] = cur[done]
            keep = ~done
            active, cur, base = active[keep], cur[keep], base[keep]
            if not len(active):
                break
    return (node - n).reshape(rows, trees)


def _totals(forest: Forest, x: np.ndarray) -> np.ndarray:
    """Aggregated leaf values per row and target, float64, block by block of rows."""
    trees = len(forest.roots)
    step = max(1, _PAIRS_PER_BLOCK // trees)
    table = forest.leaf_values32 if x.dtype == np.float32 else forest.leaf_values
    out = np.empty((x.shape[0], forest.n_targets), dtype=table.dtype)
    for start in range(0, x.shape[0], step):
        leaf = _leaves(forest, x[start:start + step])
        out[start:start + step] = _aggregate(forest, table, leaf)
    return out


def _aggregate(forest: Forest, table: np.ndarray, leaf: np.ndarray) -> np.ndarray:
    if forest.aggregate in ("SUM", "AVERAGE"):
        # cumsum adds tree after tree (a sum would add pairwise): onnxruntime's order.
        if forest.n_targets == 1:
            return np.cumsum(table[:, 0][leaf], axis=1)[:, -1:]
        return np.cumsum(table[leaf], axis=1)[:, -1]
    has = forest.leaf_has[leaf]
    fill = np.inf if forest.aggregate == "MIN" else -np.inf
    values = np.where(has, table[leaf], fill)
    best = values.min(axis=1) if forest.aggregate == "MIN" else values.max(axis=1)
    return np.where(has.any(axis=1), best, 0.0).astype(table.dtype)


def _prepare(op: Op, attrs: Attrs, x: np.ndarray) -> tuple[Forest, np.ndarray]:
    forest = forest_of(op, attrs)
    check_columns(op, forest, x[:0] if x.ndim == 2 else x)
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    return forest, x2 if x2.dtype != np.float16 else x2.astype(np.float32)


@TABLE.kernel(Op.TREE_ENSEMBLE, dtypes=FLOAT_DTYPES, host_only=True)
def tree_ensemble(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Vectorized forest walk; aggregated leaf values through post_transform."""
    forest, x = _prepare(Op.TREE_ENSEMBLE, attrs, inputs[0])
    scores = finish_scores(forest, _totals(forest, x), len(forest.roots))
    return [scores.astype(inputs[0].dtype)]


@TABLE.kernel(Op.TREE_ENSEMBLE_CLASSIFIER, dtypes=FLOAT_DTYPES, host_only=True)
def tree_ensemble_classifier(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                             out: Out) -> list[Any]:
    """Vectorized forest walk; labels and float32 class scores."""
    forest, x = _prepare(Op.TREE_ENSEMBLE_CLASSIFIER, attrs, inputs[0])
    labels, scores = classify(forest, attrs, _totals(forest, x))
    return [labels, scores]
