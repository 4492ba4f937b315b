"""cpu kernels of the tree ensembles: a level-synchronous, vectorized forest walk.

Every (tree, row) pair holds its current node; each step moves all pairs one level
down with a handful of whole-array gathers (feature, split, children; int32) and one
comparison, and sets aside the pairs that reached a leaf once enough have. The walk
takes as many steps as the deepest path; rows go in blocks so the pair arrays stay
small. Leaves are then summed (or averaged, or min/max-ed) through a dense
(leaves, targets) table, tree after tree in X's precision (float32 for float32 X) as
onnxruntime sums, so labels at near-ties agree with it. The semantics are the
reference's (:mod:`keel.backends.reference.trees`), which sums in float64.

Float32 rows through forests whose splits are all ``x <= split`` with missing values
going false (scikit-learn's exports) walk natively instead (``keel/native/src/trees.c``:
each pair alone, tree after tree over a block of rows; the same leaves), when the native
tier is loaded; at batch 1024 a 100-round gradient-boosting classifier went from
about 4 ms on the NumPy walk to 2.3 (onnxruntime 3.3; 1 thread, a loaded machine).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from keel import native
from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.cpu import planner
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

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

__all__: list[str] = []



@dataclass(frozen=True)
class _Walk:
    """The forest as the walk reads it. A pair's position is ``2 * node``: node ``k``'s
    feature and split sit at ``2k``, its false and true children (as positions) at
    ``2k`` and ``2k + 1``, so one step is ``children[position + went_true]``. Leaves
    are nodes ``n + leaf`` that loop on themselves (their split is NaN: never true).
    Indices are int32; splits are in X's precision where that is exact."""

    feature: np.ndarray
    split: np.ndarray
    children: np.ndarray
    roots: np.ndarray


_WALKS: dict[tuple[int, str], tuple[Forest, _Walk]] = {}


def _twice(values: np.ndarray) -> np.ndarray:
    return np.repeat(values, 2)


def _walk_of(forest: Forest, dtype: np.dtype[Any]) -> _Walk:
    key = (id(forest), dtype.str)
    hit = _WALKS.get(key)
    if hit is not None and hit[0] is forest:
        return hit[1]
    n, leaves = forest.n_nodes, len(forest.leaf_values)
    loop = np.arange(n, n + leaves, dtype=np.int64)
    split = forest.split
    if dtype == np.float32 and np.array_equal(split.astype(np.float32), split):
        split = split.astype(np.float32)   # exact: the comparisons do not change
    false_next = np.concatenate([forest.false_next, loop])
    true_next = np.concatenate([forest.true_next, loop])
    walk = _Walk(
        _twice(np.concatenate([forest.feature, np.zeros(leaves, np.int64)])).astype(np.int32),
        _twice(np.concatenate([split, np.full(leaves, np.nan, split.dtype)])),
        (2 * np.stack([false_next, true_next], axis=1).reshape(-1)).astype(np.int32),
        (2 * forest.roots).astype(np.int32))
    if len(_WALKS) >= 64:
        _WALKS.clear()
    _WALKS[key] = (forest, walk)
    return walk


def _goes_true(forest: Forest, pos: np.ndarray, v: np.ndarray, split: np.ndarray,
               go: np.ndarray) -> None:
    """``go[i]``: whether pair ``i`` takes its node's true branch (a leaf never does)."""
    np.less_equal(v, split, out=go)
    if forest.only_leq and not forest.any_missing_true:
        return
    node = pos // 2
    inner = node < forest.n_nodes
    k = np.minimum(node, forest.n_nodes - 1)
    if not forest.only_leq:
        mode = np.where(inner, forest.mode[k], 0)
        go[:] = np.select([mode == 0, mode == 1, mode == 2, mode == 3, mode == 4, mode == 5],
                          [v <= split, v < split, v >= split, v > split, v == split,
                           v != split], default=False) & inner
        for m in np.unique(node[inner & (mode == MEMBER)]):
            at = node == m
            go[at] = np.isin(v[at], forest.members[int(m)])
    if forest.any_missing_true:
        go |= np.isnan(v) & forest.missing_true[k] & inner


def _leaves(forest: Forest, x: np.ndarray) -> np.ndarray:
    """The leaf each row reaches in each tree: (trees, rows), indices into the leaf table.

    Pairs are tree-major (all rows of tree 0, then tree 1, ...), so the leaf sums that
    follow add whole rows tree after tree. A step writes into buffers made once, with
    ``take(mode="clip")`` (every index is in range by construction). Pairs at a leaf
    stay there; once a quarter of the pairs still walking have arrived, they are set
    aside and the rest walk on.
    """
    walk = _walk_of(forest, x.dtype)
    rows, end = x.shape[0], 2 * forest.n_nodes
    native_leaves = _native_leaves(forest, walk, x)
    if native_leaves is not None:
        return native_leaves
    flat = np.ascontiguousarray(x).reshape(-1)
    pos = np.repeat(walk.roots, rows)
    base = np.tile(np.arange(rows, dtype=np.int32) * np.int32(x.shape[1]), len(walk.roots))
    result, active = pos, None
    index, v = np.empty_like(pos), np.empty(len(pos), dtype=flat.dtype)
    split, go = np.empty(len(pos), dtype=walk.split.dtype), np.empty(len(pos), dtype=bool)
    feature, splits, children = walk.feature.take, walk.split.take, walk.children.take
    for _ in range(forest.depth):
        feature(pos, out=index, mode="clip")
        np.add(index, base, out=index)
        flat.take(index, out=v, mode="clip")
        splits(pos, out=split, mode="clip")
        _goes_true(forest, pos, v, split, go)
        np.add(pos, go, out=index)
        children(index, out=pos, mode="clip")
        arrived = np.count_nonzero(pos >= end)
        if arrived == len(pos):
            break
        if planner.TREE_SET_ASIDE * arrived >= len(pos):
            if active is None:
                result, active = pos.copy(), np.arange(len(pos))
            else:
                result[active] = pos
            keep = pos < end
            active, pos, base = active[keep], pos[keep], base[keep]
            index, v, split, go = index[: len(pos)], v[: len(pos)], split[: len(pos)], \
                go[: len(pos)]
    if active is None:
        result = pos
    else:
        result[active] = pos
    return (result // 2 - forest.n_nodes).reshape(len(walk.roots), rows)


def _native_leaves(forest: Forest, walk: _Walk, x: np.ndarray) -> np.ndarray | None:
    """:func:`_leaves` on the native walk (``keel/native/src/trees.c``): float32 rows and
    splits, every split ``x <= split`` with missing values going false (what
    scikit-learn exports). None where it does not serve (the NumPy walk then runs)."""
    if (x.dtype != np.float32 or walk.split.dtype != np.float32 or not forest.only_leq
            or forest.any_missing_true):
        return None
    fn = _native_walk()
    if fn is None:
        return None
    rows = x.shape[0]
    x = np.ascontiguousarray(x)
    leaf = np.empty((len(walk.roots), rows), np.int32)
    fn(native.address(x), x.shape[1], native.address(walk.feature),
       native.address(walk.split), native.address(walk.children),
       native.address(walk.roots), len(walk.roots), 2 * forest.n_nodes, forest.depth,
       native.address(leaf), rows, 0, rows)
    return leaf


def _native_walk() -> Callable[..., None] | None:
    """``keel_tree_leaves_f32``; None when the native tier is unavailable (asked of
    :func:`keel.native.library` on every call, so ``KEEL_NATIVE=off`` takes effect)."""
    global _bound
    lib = native.library("trees")
    if lib is None:
        return None
    if _bound is None or _bound[0] is not lib:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        _bound = (lib, lib.function(
            "keel_tree_leaves_f32", [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64,
                                     i64, i64]))
    return _bound[1]


_bound: tuple[Any, Callable[..., None]] | None = None


@functools.lru_cache(maxsize=4)
def _pool(threads: int) -> ThreadPoolExecutor:
    from concurrent.futures import ThreadPoolExecutor  # (and logging): tree models only

    return ThreadPoolExecutor(threads, thread_name_prefix="keel-trees")


def _totals(forest: Forest, x: np.ndarray, threads: int | None) -> np.ndarray:
    """Aggregated leaf values per row and target, block by block of rows.

    Blocks run on up to ``threads`` threads (NumPy's gathers release the GIL); each
    row's result is the same whatever the blocks, so the output is too.
    """
    rows, trees = x.shape[0], len(forest.roots)
    parts = max(1, min(threads or 1, rows * trees // planner.TREE_PARALLEL_PAIRS))
    step = max(1, min(planner.TREE_PAIRS_PER_BLOCK // trees, -(-rows // parts)))
    table = forest.leaf_values32 if x.dtype == np.float32 else forest.leaf_values
    out = np.empty((rows, forest.n_targets), dtype=table.dtype)

    def run(start: int) -> None:
        leaf = _leaves(forest, x[start:start + step])
        out[start:start + step] = _aggregate(forest, table, leaf)

    starts = range(0, rows, step)
    if parts > 1 and len(starts) > 1:
        list(_pool(parts).map(run, starts))
    else:
        for start in starts:
            run(start)
    return out


def _aggregate(forest: Forest, table: np.ndarray, leaf: np.ndarray) -> np.ndarray:
    """(trees, rows) leaves → (rows, targets); sums add tree after tree (axis 0)."""
    if forest.aggregate in ("SUM", "AVERAGE"):
        # Target by target: a 1-D gather of (trees, rows) scalars summed over the trees
        # adds in the same order as gathering (trees, rows, targets) rows, in a fraction
        # of the time (no (trees, rows, targets) temporary).
        out = np.empty((leaf.shape[1], table.shape[1]), dtype=table.dtype)
        for j in range(table.shape[1]):
            np.sum(np.ascontiguousarray(table[:, j]).take(leaf), axis=0, out=out[:, j])
        return out
    has = forest.leaf_has[leaf]
    fill = np.inf if forest.aggregate == "MIN" else -np.inf
    values = np.where(has, table[leaf], fill)
    best = values.min(axis=0) if forest.aggregate == "MIN" else values.max(axis=0)
    return np.where(has.any(axis=0), best, 0.0).astype(table.dtype)


def _prepare(op: Op, attrs: Attrs, x: np.ndarray) -> tuple[Forest, np.ndarray]:
    forest = forest_of(op, attrs)
    check_columns(op, forest, x[:0] if x.ndim == 2 else x)
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    return forest, x2 if x2.dtype != np.float16 else x2.astype(np.float32)


@TABLE.kernel(Op.TREE_ENSEMBLE, dtypes=FLOAT_DTYPES, host_only=True)
def tree_ensemble(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Vectorized forest walk; aggregated leaf values through post_transform."""
    forest, x = _prepare(Op.TREE_ENSEMBLE, attrs, inputs[0])
    scores = finish_scores(forest, _totals(forest, x, ctx.threads), len(forest.roots))
    return [scores.astype(inputs[0].dtype)]


@TABLE.kernel(Op.TREE_ENSEMBLE_CLASSIFIER, dtypes=FLOAT_DTYPES, host_only=True)
def tree_ensemble_classifier(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                             out: Out) -> list[Any]:
    """Vectorized forest walk; labels and float32 class scores."""
    forest, x = _prepare(Op.TREE_ENSEMBLE_CLASSIFIER, attrs, inputs[0])
    labels, scores = classify(forest, attrs, _totals(forest, x, ctx.threads))
    return [labels, scores]
