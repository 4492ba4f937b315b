"""Schemas of the tree-ensemble ops, and the one compiled form every backend evaluates.

keel has one form of a forest, ONNX ``TreeEnsemble``-5's (``ai.onnx.ml`` opset 5):
internal nodes in flat arrays (feature, split, mode, missing-value direction, the
true and false successors, each a node or, where the matching ``*leafs`` flag is 1,
a leaf), ``tree_roots`` indexing the nodes, and leaves as (target, weight) entries.
Two attributes extend it so the older ``TreeEnsembleRegressor`` and
``TreeEnsembleClassifier`` convert without loss: ``base_values`` (added per target
after aggregation) and ``leaf_sizes`` (leaf ``k`` owns ``leaf_sizes[k]`` consecutive
(target, weight) entries; empty: one entry each).

* ``tree_ensemble`` — X ``(N, F)`` float → Y ``(N, n_targets)`` of X's dtype: the
  leaves reached in every tree, aggregated (AVERAGE, SUM, MIN, MAX), plus
  ``base_values``, through ``post_transform`` (NONE, SOFTMAX, LOGISTIC, SOFTMAX_ZERO,
  PROBIT as the codes 0..4 of TreeEnsemble-5).
* ``tree_ensemble_classifier`` — the same forest summed per class, then a label per row
  and float32 class scores, with onnxruntime's conventions for a binary model whose
  leaves all score one class (see :func:`keel.ops.schemas.ml.binary_scores`).

Split modes are TreeEnsemble-5's codes: 0 ``x <= s``, 1 ``x < s``, 2 ``x >= s``,
3 ``x > s``, 4 ``x == s``, 5 ``x != s``, 6 ``x`` in the node's set of
``membership_values`` (the sets of the MEMBER nodes, in node order, separated by NaN).
A NaN feature goes to the true branch where ``nodes_missing_value_tracks_true`` is 1.

:func:`compile_forest` checks the attributes once (indices in range, no cycles) and
gives a :class:`Forest` of NumPy arrays; :func:`forest_of` caches it per node.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.schemas.ml import (
    POST_TRANSFORMS,
    binary_scores,
    check_features,
    classifier_labels,
    label_dtype,
    post_transform,
    rows_of,
)
from keel.ops.types import TensorType

__all__ = ["AGGREGATES", "MEMBER", "Forest", "classify", "compile_forest", "finish_scores",
           "forest_of"]

AGGREGATES = ("AVERAGE", "SUM", "MIN", "MAX")
MEMBER = 6
FLOAT_DTYPES = frozenset({DType.FLOAT16, DType.FLOAT32, DType.FLOAT64})


@dataclass(frozen=True)
class Forest:
    """A checked forest: internal nodes ``0..n-1``, leaf ``k`` at index ``n + k``."""

    roots: np.ndarray          # int64 (trees,)
    feature: np.ndarray        # int64 (n,)
    split: np.ndarray          # float64 (n,)
    mode: np.ndarray           # int8 (n,)
    missing_true: np.ndarray   # bool (n,)
    true_next: np.ndarray      # int64 (n,): a node, or n + leaf
    false_next: np.ndarray     # int64 (n,)
    members: dict[int, np.ndarray]   # MEMBER node → its set of values
    leaf_values: np.ndarray    # float64 (leaves, targets): summed weights per target
    leaf_values32: np.ndarray  # the same in float32, for sums in onnxruntime's precision
    leaf_has: np.ndarray       # bool (leaves, targets): the leaf scores that target
    depth: int                 # the longest root-to-leaf path, in splits
    n_targets: int
    base_values: np.ndarray    # float64 (targets,)
    aggregate: str
    post_transform: str
    max_feature: int
    # Facts about the arrays above, worked out once (kernels read them on every call).
    only_leq: bool             # every split is ``x <= s``
    any_missing_true: bool     # some node sends NaN to its true branch
    used_targets: np.ndarray   # the targets some leaf scores
    non_negative: bool         # no leaf weight is negative

    @property
    def n_nodes(self) -> int:
        return len(self.feature)


def _err(op: Op, detail: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{op.value}: {detail}")


def _array(attrs: Mapping[str, Any], key: str, dtype: Any) -> np.ndarray:
    value = attrs.get(key)
    return np.asarray(() if value is None else value, dtype=dtype).reshape(-1)


def _leaf_table(op: Op, attrs: Mapping[str, Any], n_targets: int) -> tuple[np.ndarray, ...]:
    targets = _array(attrs, "leaf_targetids", np.int64)
    weights = _array(attrs, "leaf_weights", np.float64)
    if len(targets) != len(weights):
        raise _err(op, f"{len(targets)} leaf_targetids for {len(weights)} leaf_weights")
    if len(targets) and (targets.min() < 0 or targets.max() >= n_targets):
        raise _err(op, f"a leaf target id is outside 0..{n_targets - 1}")
    sizes = _array(attrs, "leaf_sizes", np.int64)
    if not len(sizes):
        sizes = np.ones(len(targets), dtype=np.int64)
    if (sizes < 0).any() or int(sizes.sum()) != len(targets):
        raise _err(op, f"leaf_sizes sum to {int(sizes.sum())}, not to the {len(targets)} "
                       "leaf entries")
    owner = np.repeat(np.arange(len(sizes)), sizes)
    values = np.zeros((len(sizes), n_targets), dtype=np.float64)
    has = np.zeros((len(sizes), n_targets), dtype=bool)
    np.add.at(values, (owner, targets), weights)
    has[owner, targets] = True
    return values, has


def _successors(op: Op, attrs: Mapping[str, Any], n: int, leaves: int) -> tuple[np.ndarray, ...]:
    out = []
    for side in ("true", "false"):
        ids = _array(attrs, f"nodes_{side}nodeids", np.int64)
        flags = _array(attrs, f"nodes_{side}leafs", np.int64)
        if len(ids) != n or len(flags) != n:
            raise _err(op, f"nodes_{side}nodeids and nodes_{side}leafs need one entry per node "
                           f"({n})")
        leaf = flags != 0
        bad = (ids < 0) | np.where(leaf, ids >= leaves, ids >= n)
        if bad.any():
            raise _err(op, f"node {int(np.argmax(bad))} has a {side} successor out of range")
        out.append(np.where(leaf, ids + n, ids))
    return out[0], out[1]


def _depth(op: Op, roots: np.ndarray, true_next: np.ndarray, false_next: np.ndarray) -> int:
    """The longest path from a root, in splits; a cycle is an error."""
    n = len(true_next)
    frontier, depth = np.unique(roots), 0
    while len(frontier):
        depth += 1
        if depth > n:
            raise _err(op, "the trees have a cycle")
        nxt = np.concatenate([true_next[frontier], false_next[frontier]])
        frontier = np.unique(nxt[nxt < n])
    return depth


def _members(op: Op, attrs: Mapping[str, Any], mode: np.ndarray) -> dict[int, np.ndarray]:
    nodes = np.flatnonzero(mode == MEMBER)
    if not len(nodes):
        return {}
    values = _array(attrs, "membership_values", np.float64)
    cuts = np.flatnonzero(np.isnan(values))
    sets = np.split(values, cuts)
    sets = [s[~np.isnan(s)] for s in sets]
    if len(sets) < len(nodes):
        raise _err(op, f"{len(nodes)} MEMBER nodes but {len(sets)} sets in membership_values")
    return {int(k): sets[i] for i, k in enumerate(nodes)}


def compile_forest(op: Op, attrs: Mapping[str, Any]) -> Forest:
    """Check a forest's attributes and lay them out as arrays."""
    feature = _array(attrs, "nodes_featureids", np.int64)
    n = len(feature)
    split = _array(attrs, "nodes_splits", np.float64)
    mode = _array(attrs, "nodes_modes", np.int64)
    if len(split) != n or len(mode) != n:
        raise _err(op, "nodes_featureids, nodes_splits and nodes_modes need one entry per node")
    if n and (mode.min() < 0 or mode.max() > MEMBER or feature.min() < 0):
        raise _err(op, "a node mode is outside 0..6 or a feature id is negative")
    roots = _array(attrs, "tree_roots", np.int64)
    if not len(roots) or roots.min() < 0 or roots.max() >= n:
        raise _err(op, f"tree_roots must index the {n} nodes")
    missing = _array(attrs, "nodes_missing_value_tracks_true", np.int64)
    if len(missing) not in (0, n):
        raise _err(op, "nodes_missing_value_tracks_true needs one entry per node")
    targets = _array(attrs, "leaf_targetids", np.int64)
    n_targets = attrs.get("n_targets") or (int(targets.max()) + 1 if len(targets) else 1)
    values, has = _leaf_table(op, attrs, n_targets)
    true_next, false_next = _successors(op, attrs, n, len(values))
    base = _array(attrs, "base_values", np.float64)
    if len(base) not in (0, n_targets):
        raise _err(op, f"{len(base)} base_values for {n_targets} targets")
    missing_true = missing.astype(bool) if len(missing) else np.zeros(n, dtype=bool)
    return Forest(
        roots, feature, split, mode.astype(np.int8), missing_true,
        true_next, false_next, _members(op, attrs, mode), values, values.astype(np.float32),
        has, _depth(op, roots, true_next, false_next), n_targets,
        base if len(base) else np.zeros(n_targets), _aggregate(op, attrs),
        _post(op, attrs), int(feature.max()) if n else -1,
        bool(np.all(mode == 0)), bool(missing_true.any()),
        np.flatnonzero(has.any(axis=0)), bool((values >= 0).all()))


def _aggregate(op: Op, attrs: Mapping[str, Any]) -> str:
    code = attrs.get("aggregate_function", 1)
    if not 0 <= code < len(AGGREGATES):
        raise _err(op, f"aggregate_function must be 0..3 ({', '.join(AGGREGATES)}), got {code}")
    return AGGREGATES[code]


def _post(op: Op, attrs: Mapping[str, Any]) -> str:
    code = attrs["post_transform"]
    if not 0 <= code < len(POST_TRANSFORMS):
        raise _err(op, f"post_transform must be 0..4 ({', '.join(POST_TRANSFORMS)}), got {code}")
    return POST_TRANSFORMS[code]


# One compiled forest per node: kernels get the node's attribute objects on every call,
# so the key is their identity; each entry keeps its attributes alive, so no id is reused
# while the entry stands.
_CACHE: OrderedDict[tuple[int, ...], tuple[tuple[Any, ...], Forest]] = OrderedDict()
_CACHE_SIZE = 64
_KEYED = ("nodes_featureids", "nodes_splits", "leaf_weights", "tree_roots", "base_values")


def forest_of(op: Op, attrs: Mapping[str, Any]) -> Forest:
    """:func:`compile_forest`, cached per node (the node's attributes, by identity)."""
    held = tuple(attrs.get(k) for k in _KEYED)
    key = (*(id(v) for v in held), int(attrs.get("aggregate_function", 1)),
           int(attrs["post_transform"]))
    hit = _CACHE.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], held, strict=True)):
        _CACHE.move_to_end(key)
        return hit[1]
    forest = compile_forest(op, attrs)
    _CACHE[key] = (held, forest)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return forest


# ---- from leaf sums to outputs (every backend) --------------------------------------------
def finish_scores(forest: Forest, total: np.ndarray, trees: int) -> np.ndarray:
    """``tree_ensemble``'s output from the aggregated leaf values (rows, targets).

    The arithmetic stays in ``total``'s dtype up to the post transform (float64).
    """
    scores = total / total.dtype.type(trees) if forest.aggregate == "AVERAGE" else total
    return post_transform(scores + forest.base_values.astype(total.dtype),
                          forest.post_transform)


def classify(forest: Forest, attrs: Mapping[str, Any], total: np.ndarray,
             ) -> tuple[np.ndarray, np.ndarray]:
    """Labels and float32 scores of ``tree_ensemble_classifier`` from per-class leaf sums.

    A two-class model whose leaves all score one class is binary: that score ``s``
    picks class 1 when above 0.5 (weights all non-negative: a probability, written
    beside its complement) or above 0 (a margin, beside its negation), two columns by
    :func:`binary_scores`. Otherwise the
    label is the best class before ``post_transform``. Sums and base values are added
    in ``total``'s dtype, so labels at near-ties follow that precision.
    """
    ints, strings = attrs["classlabels_int64s"], attrs["classlabels_strings"]
    classes = max(len(ints or strings), forest.n_targets)
    used = forest.used_targets
    if classes == 2 and len(used) == 1:
        k = int(used[0])
        s = total[:, k] + total.dtype.type(forest.base_values[k])
        positive = forest.non_negative
        index = (s > (0.5 if positive else 0.0)).astype(np.int64)
        scores = binary_scores(s, forest.post_transform, complement=positive)
        return classifier_labels(ints, strings, index), scores.astype(np.float32)
    raw = np.zeros((len(total), classes), dtype=total.dtype)
    raw[:, :forest.n_targets] = total + forest.base_values.astype(total.dtype)
    index = np.argmax(raw, axis=1) if classes else np.zeros(len(raw), np.int64)
    scores = post_transform(raw, forest.post_transform)
    return classifier_labels(ints, strings, index), scores.astype(np.float32)


# ---- schemas ----------------------------------------------------------------------------
def _infer_forest(op: Op, x: TensorType | None, attrs: Mapping[str, Any]) -> int:
    forest = forest_of(op, attrs)
    if x is not None and x.shape is not None and len(x.shape) == 2:
        cols = x.shape[1]
        if isinstance(cols, int) and forest.max_feature >= cols:
            raise _err(op, f"a node reads feature {forest.max_feature}; X has {cols}")
    return forest.n_targets


def _infer_tree_ensemble(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                         values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    check_features(Op.TREE_ENSEMBLE, x, FLOAT_DTYPES)
    targets = _infer_forest(Op.TREE_ENSEMBLE, x, attrs)
    return [None if x is None else TensorType(x.dtype, (rows_of(x.shape), targets))]


def _infer_classifier(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                      values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    op, x = Op.TREE_ENSEMBLE_CLASSIFIER, types[0]
    ints, strings = attrs["classlabels_int64s"], attrs["classlabels_strings"]
    labels = label_dtype(op, ints, strings)
    check_features(op, x, FLOAT_DTYPES)
    targets = _infer_forest(op, x, attrs)
    classes = len(ints or strings)
    if targets > max(classes, 1):
        raise _err(op, f"leaves score class {targets - 1}; there are {classes} class labels")
    if x is None:
        return [None, None]
    n = rows_of(x.shape)
    return [TensorType(labels, (n,)), TensorType(DType.FLOAT32, (n, max(classes, targets)))]


FOREST_ATTRS = (
    AttrSpec("tree_roots", AttrKind.INTS, REQUIRED),
    AttrSpec("nodes_featureids", AttrKind.INTS, REQUIRED),
    AttrSpec("nodes_splits", AttrKind.TENSOR, REQUIRED),
    AttrSpec("nodes_modes", AttrKind.INTS, REQUIRED),
    AttrSpec("nodes_truenodeids", AttrKind.INTS, REQUIRED),
    AttrSpec("nodes_falsenodeids", AttrKind.INTS, REQUIRED),
    AttrSpec("nodes_trueleafs", AttrKind.INTS, REQUIRED),
    AttrSpec("nodes_falseleafs", AttrKind.INTS, REQUIRED),
    AttrSpec("nodes_missing_value_tracks_true", AttrKind.INTS, ()),
    AttrSpec("nodes_hitrates", AttrKind.TENSOR, None),
    AttrSpec("membership_values", AttrKind.TENSOR, None),
    AttrSpec("leaf_targetids", AttrKind.INTS, REQUIRED),
    AttrSpec("leaf_weights", AttrKind.TENSOR, REQUIRED),
    AttrSpec("leaf_sizes", AttrKind.INTS, ()),
    AttrSpec("base_values", AttrKind.FLOATS, ()),
    AttrSpec("post_transform", AttrKind.INT, 0),
)

register_schema(OpSchema(
    Op.TREE_ENSEMBLE, 1, 1, attrs=(*FOREST_ATTRS, AttrSpec("n_targets", AttrKind.INT, None),
                                   AttrSpec("aggregate_function", AttrKind.INT, 1)),
    infer=_infer_tree_ensemble,
    doc="ONNX ML TreeEnsemble (and TreeEnsembleRegressor): aggregated leaf weights.",
))
register_schema(OpSchema(
    Op.TREE_ENSEMBLE_CLASSIFIER, 1, 1, attrs=(
        *FOREST_ATTRS, AttrSpec("classlabels_int64s", AttrKind.INTS, ()),
        AttrSpec("classlabels_strings", AttrKind.STRS, ())),
    infer=_infer_classifier, min_outputs=2, max_outputs=2,
    doc="ONNX ML TreeEnsembleClassifier: summed class weights, labels and scores.",
))
