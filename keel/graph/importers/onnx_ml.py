"""ONNX op converters of the ``ai.onnx.ml`` domain (scikit-learn exports and the like).

The domain has its own opset (1 to 5), so its converters live in their own
:data:`ML_TABLE`, picked by the model's ``ai.onnx.ml`` opset with the same
*newest since_version not newer than the model's* rule.

Most ops carry over as they are. The rest become keel's one form of their family:

* LabelEncoder (1, 2, 4) and CategoryMapper → ``label_encoder`` with ``keys``,
  ``values`` and ``default`` tensors;
* TreeEnsembleRegressor (1, 3) and TreeEnsemble (5) → ``tree_ensemble``;
  TreeEnsembleClassifier (1, 3) → ``tree_ensemble_classifier``: the (tree id, node id)
  node lists of the old ops are laid out as TreeEnsemble-5's arrays, integer inputs
  are cast to float32 first, and the regressor's float32 output is a Cast away when X
  is double.
* ZipMap gives a sequence of maps, a value keel does not represent: importing it is an
  ``UnsupportedOperationError`` that says how to export without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.graph.importers.onnx_context import ConverterTable, ImportContext, OnnxNode
from keel.ops.registry import Op

__all__ = ["ML_CONVERTED", "ML_DIRECT", "ML_DOMAIN", "ML_TABLE"]

ML_DOMAIN = "ai.onnx.ml"
ML_TABLE = ConverterTable()

# ai.onnx.ml op_type → (keel op, since_version): attributes carry over unchanged.
ML_DIRECT: dict[str, tuple[Op, int]] = {
    "Scaler": (Op.SCALER, 1),
    "Normalizer": (Op.NORMALIZER, 1),
    "Imputer": (Op.IMPUTER, 1),
    "Binarizer": (Op.BINARIZER, 1),
    "OneHotEncoder": (Op.ONE_HOT_ENCODER, 1),
    "ArrayFeatureExtractor": (Op.ARRAY_FEATURE_EXTRACTOR, 1),
    "LinearClassifier": (Op.LINEAR_CLASSIFIER, 1),
    "LinearRegressor": (Op.LINEAR_REGRESSOR, 1),
    "SVMClassifier": (Op.SVM_CLASSIFIER, 1),
    "SVMRegressor": (Op.SVM_REGRESSOR, 1),
    "TreeEnsemble": (Op.TREE_ENSEMBLE, 5),
}


# ai.onnx.ml op_type → the keel op its converter writes (besides Casts), for the others.
ML_CONVERTED: dict[str, Op] = {
    "LabelEncoder": Op.LABEL_ENCODER, "CategoryMapper": Op.LABEL_ENCODER,
    "TreeEnsembleRegressor": Op.TREE_ENSEMBLE,
    "TreeEnsembleClassifier": Op.TREE_ENSEMBLE_CLASSIFIER,
}


def _direct(op: Op) -> Any:
    def convert(ctx: ImportContext, n: OnnxNode) -> None:
        ctx.emit(op, n.inputs, n.outputs, n.attrs)
    return convert


for _op_type, (_op, _since) in ML_DIRECT.items():
    ML_TABLE.register(_op_type, _since, _direct(_op))


# ---- lookup tables ----------------------------------------------------------------------
def _table(ctx: ImportContext, n: OnnxNode, keys: np.ndarray, values: np.ndarray,
           default: np.ndarray) -> None:
    ctx.emit(Op.LABEL_ENCODER, n.inputs, n.outputs,
             {"keys": keys, "values": values, "default": np.asarray(default, values.dtype)})


def _strings(values: Sequence[str]) -> np.ndarray:
    return np.asarray(list(values), dtype=object)


@ML_TABLE.converts("LabelEncoder", since=1)
def _label_encoder_1(ctx: ImportContext, n: OnnxNode) -> None:
    """classes_strings[i] ↔ i; the input's type says which way."""
    classes = _strings(n.attrs.get("classes_strings", ()))
    index = np.arange(len(classes), dtype=np.int64)
    if ctx.dtype_of(n.input(0)) is DType.STRING:
        _table(ctx, n, classes, index, np.asarray(n.attrs.get("default_int64", -1)))
    else:
        _table(ctx, n, index, classes,
               np.asarray(n.attrs.get("default_string", "_Unused"), dtype=object))


_TYPED = {"strings": (object, "default_string", "_Unused"),
          "int64s": (np.int64, "default_int64", -1),
          "floats": (np.float32, "default_float", -0.0)}


def _typed_list(ctx: ImportContext, attrs: Mapping[str, Any], prefix: str) -> tuple[str, Any]:
    given = [(kind, attrs[f"{prefix}_{kind}"]) for kind in _TYPED if f"{prefix}_{kind}" in attrs]
    if len(given) != 1:
        raise ctx.invalid(f"needs exactly one {prefix}_* attribute, got {len(given)}")
    return given[0]


@ML_TABLE.converts("LabelEncoder", since=2)
def _label_encoder_2(ctx: ImportContext, n: OnnxNode) -> None:
    """keys_* → values_*, with the default_* of the values' type (opset 4 adds tensors)."""
    keys = _tensor_or_list(ctx, n.attrs, "keys")
    values = _tensor_or_list(ctx, n.attrs, "values")
    default = n.attrs.get("default_tensor")
    if default is None:
        kind = {np.dtype(object): "strings", np.dtype(np.int64): "int64s"}.get(values.dtype,
                                                                             "floats")
        _, attr, fallback = _TYPED[kind]
        default = np.asarray(n.attrs.get(attr, fallback), dtype=values.dtype)
    _table(ctx, n, keys, values, np.asarray(default).reshape(-1)[:1].reshape(()))


def _tensor_or_list(ctx: ImportContext, attrs: Mapping[str, Any], prefix: str) -> np.ndarray:
    tensor = attrs.get(f"{prefix}_tensor")
    if tensor is not None:
        arr = np.asarray(tensor).reshape(-1)
        return arr.astype(object) if arr.dtype.kind in "US" else arr
    kind, values = _typed_list(ctx, attrs, prefix)
    return np.asarray(list(values), dtype=_TYPED[kind][0])


ML_TABLE.register("LabelEncoder", 4, _label_encoder_2)


@ML_TABLE.converts("CategoryMapper", since=1)
def _category_mapper(ctx: ImportContext, n: OnnxNode) -> None:
    """cats_strings[i] ↔ cats_int64s[i]; the input's type says which way."""
    strings = _strings(n.attrs.get("cats_strings", ()))
    ints = np.asarray(n.attrs.get("cats_int64s", ()), dtype=np.int64)
    if len(strings) != len(ints):
        raise ctx.invalid(f"{len(strings)} cats_strings for {len(ints)} cats_int64s")
    if ctx.dtype_of(n.input(0)) is DType.STRING:
        _table(ctx, n, strings, ints, np.asarray(n.attrs.get("default_int64", -1)))
    else:
        _table(ctx, n, ints, strings,
               np.asarray(n.attrs.get("default_string", "_Unused"), dtype=object))


@ML_TABLE.converts("ZipMap", since=1)
def _zipmap(ctx: ImportContext, n: OnnxNode) -> None:
    raise ctx.unsupported(
        "ZipMap gives a sequence of maps, which keel does not represent; export the "
        "probabilities as a tensor instead (skl2onnx: options={id(model): {'zipmap': False}} "
        "or options={'zipmap': False})")


# ---- tree ensembles, opsets 1 and 3 -----------------------------------------------------
_MODES = {"BRANCH_LEQ": 0, "BRANCH_LT": 1, "BRANCH_GTE": 2, "BRANCH_GT": 3, "BRANCH_EQ": 4,
          "BRANCH_NEQ": 5}
_POST = {"NONE": 0, "SOFTMAX": 1, "LOGISTIC": 2, "SOFTMAX_ZERO": 3, "PROBIT": 4}
_AGGREGATE = {"AVERAGE": 0, "SUM": 1, "MIN": 2, "MAX": 3}


def _floats(attrs: Mapping[str, Any], name: str, dtype: Any = np.float32) -> np.ndarray:
    """A float list attribute, or its opset-3 ``*_as_tensor`` twin (kept in its dtype)."""
    tensor = attrs.get(f"{name}_as_tensor")
    if tensor is not None:
        return np.asarray(tensor).reshape(-1)
    return np.asarray(attrs.get(name, ()), dtype=dtype).reshape(-1)


def _code(ctx: ImportContext, table: Mapping[str, int], value: str, what: str) -> int:
    if value not in table:
        raise ctx.invalid(f"{what} {value!r} is not one of {', '.join(table)}")
    return table[value]


def _forest(ctx: ImportContext, a: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """TreeEnsemble-5's arrays from the (tree id, node id) lists of opsets 1 and 3."""
    tree = np.asarray(a.get("nodes_treeids", ()), dtype=np.int64)
    node = np.asarray(a.get("nodes_nodeids", ()), dtype=np.int64)
    modes = list(a.get("nodes_modes", ()))
    fields = [np.asarray(a.get(k, ()), dtype=np.int64) for k in
              ("nodes_featureids", "nodes_truenodeids", "nodes_falsenodeids")]
    splits = _floats(a, "nodes_values")
    missing = np.asarray(a.get("nodes_missing_value_tracks_true", ()) or [0] * len(tree),
                         dtype=np.int64)
    size = len(tree)
    if len(modes) != size or any(len(x) != size for x in (node, *fields, splits, missing)):
        raise ctx.invalid("the nodes_* attributes must all have one entry per node")
    position = {(int(t), int(k)): i for i, (t, k) in enumerate(zip(tree, node, strict=True))}
    if len(position) != size:
        raise ctx.invalid("two nodes share a (tree id, node id)")
    is_leaf = np.asarray([m == "LEAF" for m in modes], dtype=bool)
    mode = np.asarray([0 if m == "LEAF" else _code(ctx, _MODES, m, "node mode") for m in modes],
                      dtype=np.int64)
    new_index = np.where(is_leaf, np.cumsum(is_leaf) - 1, np.cumsum(~is_leaf) - 1)
    out = _internal_nodes(ctx, tree, is_leaf, new_index, position, fields, splits, mode, missing)
    out.update(_leaves(ctx, a, prefix, position, is_leaf, new_index))
    return out


def _internal_nodes(ctx: ImportContext, tree: np.ndarray, is_leaf: np.ndarray,
                    new_index: np.ndarray, position: Mapping[tuple[int, int], int],
                    fields: list[np.ndarray], splits: np.ndarray, mode: np.ndarray,
                    missing: np.ndarray) -> dict[str, Any]:
    inner = np.flatnonzero(~is_leaf)
    feature, true_ids, false_ids = (f[inner] for f in fields)
    succ: dict[str, list[int]] = {k: [] for k in ("tn", "tl", "fn", "fl")}
    for i, t, f in zip(inner, true_ids, false_ids, strict=True):
        for key, child in (("t", t), ("f", f)):
            p = position.get((int(tree[i]), int(child)))
            if p is None:
                raise ctx.invalid(f"tree {int(tree[i])} has no node {int(child)}")
            succ[key + "n"].append(int(new_index[p]))
            succ[key + "l"].append(int(is_leaf[p]))
    n_inner = len(inner)
    roots, extra = _roots(tree, is_leaf, new_index, n_inner)
    return {
        "tree_roots": roots,
        "nodes_featureids": np.concatenate([feature, np.zeros(len(extra), np.int64)]),
        "nodes_splits": np.concatenate([splits[inner], np.zeros(len(extra), splits.dtype)]),
        "nodes_modes": np.concatenate([mode[inner], np.zeros(len(extra), np.int64)]),
        "nodes_truenodeids": np.asarray(succ["tn"] + extra, dtype=np.int64),
        "nodes_falsenodeids": np.asarray(succ["fn"] + extra, dtype=np.int64),
        "nodes_trueleafs": np.asarray(succ["tl"] + [1] * len(extra), dtype=np.int64),
        "nodes_falseleafs": np.asarray(succ["fl"] + [1] * len(extra), dtype=np.int64),
        "nodes_missing_value_tracks_true": np.concatenate(
            [missing[inner], np.zeros(len(extra), np.int64)]),
    }


def _roots(tree: np.ndarray, is_leaf: np.ndarray, new_index: np.ndarray,
           n_inner: int) -> tuple[np.ndarray, list[int]]:
    """Each tree's first node; a tree that is a single leaf gets a split leading only to it."""
    _, first = np.unique(tree, return_index=True)
    roots, extra = [], []
    for p in sorted(first):
        if is_leaf[p]:
            extra.append(int(new_index[p]))
            roots.append(n_inner + len(extra) - 1)
        else:
            roots.append(int(new_index[p]))
    return np.asarray(roots, dtype=np.int64), extra


def _leaves(ctx: ImportContext, a: Mapping[str, Any], prefix: str,
            position: Mapping[tuple[int, int], int], is_leaf: np.ndarray,
            new_index: np.ndarray) -> dict[str, Any]:
    trees = np.asarray(a.get(f"{prefix}_treeids", ()), dtype=np.int64)
    nodes = np.asarray(a.get(f"{prefix}_nodeids", ()), dtype=np.int64)
    ids = np.asarray(a.get(f"{prefix}_ids", ()), dtype=np.int64)
    weights = _floats(a, f"{prefix}_weights")
    if not len(trees) == len(nodes) == len(ids) == len(weights):
        raise ctx.invalid(f"the {prefix}_* attributes must all have one entry per weight")
    owner = np.empty(len(trees), dtype=np.int64)
    for k, (t, nid) in enumerate(zip(trees, nodes, strict=True)):
        p = position.get((int(t), int(nid)))
        if p is None or not is_leaf[p]:
            raise ctx.invalid(f"a {prefix} weight names node ({int(t)}, {int(nid)}), "
                              "which is not a leaf")
        owner[k] = new_index[p]
    order = np.argsort(owner, kind="stable")
    return {"leaf_targetids": ids[order], "leaf_weights": weights[order],
            "leaf_sizes": np.bincount(owner, minlength=int(is_leaf.sum()))}


def _float_input(ctx: ImportContext, n: OnnxNode) -> str:
    """X itself when it is float, else X cast to float32 (as onnxruntime compares)."""
    x = n.input(0)
    dtype = ctx.dtype_of(x)
    if dtype is None or dtype.is_float:
        return x
    cast = ctx.fresh(f"{n.name}/x_float")
    ctx.emit(Op.CAST, [x], [cast], {"to": DType.FLOAT32})
    return cast


def _regressor(ctx: ImportContext, n: OnnxNode) -> None:
    a = n.attrs
    attrs = _forest(ctx, a, "target")
    attrs.update(
        n_targets=int(a.get("n_targets", 1)),
        aggregate_function=_code(ctx, _AGGREGATE, a.get("aggregate_function", "SUM"),
                                 "aggregate_function"),
        post_transform=_code(ctx, _POST, a.get("post_transform", "NONE"), "post_transform"),
        base_values=tuple(_floats(a, "base_values").tolist()))
    x = _float_input(ctx, n)
    if ctx.dtype_of(x) in (None, DType.FLOAT32):
        ctx.emit(Op.TREE_ENSEMBLE, [x], n.outputs, attrs)
        return
    wide = ctx.fresh(f"{n.name}/y")
    ctx.emit(Op.TREE_ENSEMBLE, [x], [wide], attrs)
    ctx.emit(Op.CAST, [wide], n.outputs, {"to": DType.FLOAT32})


def _classifier(ctx: ImportContext, n: OnnxNode) -> None:
    a = n.attrs
    attrs = _forest(ctx, a, "class")
    attrs.update(
        post_transform=_code(ctx, _POST, a.get("post_transform", "NONE"), "post_transform"),
        base_values=tuple(_floats(a, "base_values").tolist()),
        classlabels_int64s=a.get("classlabels_int64s", ()),
        classlabels_strings=a.get("classlabels_strings", ()))
    ctx.emit(Op.TREE_ENSEMBLE_CLASSIFIER, [_float_input(ctx, n)], n.outputs, attrs)


for _since in (1, 3):
    ML_TABLE.register("TreeEnsembleRegressor", _since, _regressor)
    ML_TABLE.register("TreeEnsembleClassifier", _since, _classifier)
