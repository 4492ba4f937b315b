"""Reference kernels of the tree ensembles: every row walks every tree, one split at a time.

The forest is checked and laid out once (:func:`keel.ops.schemas.trees.forest_of`);
leaf values are aggregated in float64.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.trees import (
    FLOAT_DTYPES,
    MEMBER,
    Forest,
    classify,
    finish_scores,
    forest_of,
)

__all__ = ["check_columns"]


def _goes_true(forest: Forest, node: int, x: float) -> bool:
    if math.isnan(x) and forest.missing_true[node]:
        return True
    s, mode = float(forest.split[node]), int(forest.mode[node])
    if mode == MEMBER:
        return bool(np.isin(x, forest.members[node]))
    return (x <= s, x < s, x >= s, x > s, x == s, x != s)[mode]


def _leaf(forest: Forest, row: np.ndarray, root: int) -> int:
    node, n = root, forest.n_nodes
    while node < n:
        go = _goes_true(forest, node, float(row[forest.feature[node]]))
        node = int(forest.true_next[node] if go else forest.false_next[node])
    return node - n


def _aggregate(forest: Forest, leaves: list[int]) -> np.ndarray:
    values, has = forest.leaf_values[leaves], forest.leaf_has[leaves]
    if forest.aggregate in ("SUM", "AVERAGE"):
        return values.sum(axis=0)
    pick = np.min if forest.aggregate == "MIN" else np.max
    return np.asarray([pick(values[has[:, t], t]) if has[:, t].any() else 0.0
                       for t in range(forest.n_targets)])


def check_columns(op: Op, forest: Forest, x: np.ndarray) -> np.ndarray:
    """X as float64 (rows, features), wide enough for every split."""
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    if x2.ndim != 2 or forest.max_feature >= x2.shape[1]:
        raise InvalidArgumentError(f"{op.value}: a node reads feature {forest.max_feature}; "
                                   f"X has shape {x.shape}")
    return x2.astype(np.float64)


def _totals(op: Op, attrs: Attrs, x: np.ndarray) -> tuple[Forest, np.ndarray]:
    forest = forest_of(op, attrs)
    rows = check_columns(op, forest, x)
    totals = np.zeros((len(rows), forest.n_targets))
    for i, row in enumerate(rows):
        totals[i] = _aggregate(forest, [_leaf(forest, row, int(r)) for r in forest.roots])
    return forest, totals


@TABLE.kernel(Op.TREE_ENSEMBLE, dtypes=FLOAT_DTYPES)
def tree_ensemble(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Aggregated leaf values per target, plus base values, through post_transform."""
    forest, totals = _totals(Op.TREE_ENSEMBLE, attrs, inputs[0])
    return [finish_scores(forest, totals, len(forest.roots)).astype(inputs[0].dtype)]


@TABLE.kernel(Op.TREE_ENSEMBLE_CLASSIFIER, dtypes=FLOAT_DTYPES)
def tree_ensemble_classifier(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                             out: Out) -> list[Any]:
    """Summed class weights per row → labels and float32 scores."""
    forest, totals = _totals(Op.TREE_ENSEMBLE_CLASSIFIER, attrs, inputs[0])
    labels, scores = classify(forest, attrs, totals)
    return [labels, scores]
