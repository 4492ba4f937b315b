"""Conformance cases of the classical machine-learning family (ONNX's ai.onnx.ml).

Preprocessing: scaler (per-column and broadcast, int input), normalizer (MAX, L1,
L2, zero rows, a vector), imputer (NaN and value markers), binarizer, one-hot
encoder (ints, strings, floats), array feature extractor, label encoder (string,
int and float tables, NaN keys, defaults). Linear models and SVMs: multi-class and
binary, every post transform, every kernel, Platt probabilities. Tree ensembles:
random forests with every split mode, NaN routing, each aggregate, base values,
several weights per leaf, float32/float64 and binary and multi-class classifiers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]
F32, F64, I64 = np.float32, np.float64, np.int64
WORDS = ("red", "green", "blue", "cyan", "magenta")


def _x(shape: tuple[int, ...], dtype: Any = F32, nan: bool = False, zero_row: bool = False,
       ) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        if np.dtype(dtype).kind == "i":
            return [rng.integers(-3, 4, size=shape).astype(dtype)]
        x = rng.standard_normal(shape).astype(dtype)
        if nan:
            x[rng.random(shape) < 0.2] = np.nan
        if zero_row:
            x[0] = 0
        return [x]
    return make


def _words(shape: tuple[int, ...], extra: str | None = None) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        pool = WORDS + ((extra,) if extra else ())
        return [np.asarray(pool, dtype=object)[rng.integers(0, len(pool), size=shape)]]
    return make


def _preprocessing() -> list[OpCase]:
    return [
        OpCase("scaler-columns", Op.SCALER, _x((6, 4)),
               {"offset": (0.5, -1.0, 0.0, 2.0), "scale": (2.0, 0.5, 1.0, -1.0)}),
        OpCase("scaler-broadcast-int", Op.SCALER, _x((5, 3), I64), {"offset": (1.0,),
                                                                     "scale": (0.25,)}),
        OpCase("scaler-f64-vector", Op.SCALER, _x((4,), F64), {"scale": (3.0,)}),
        OpCase("normalizer-max", Op.NORMALIZER, _x((5, 4), zero_row=True), {"norm": "MAX"}),
        OpCase("normalizer-l1", Op.NORMALIZER, _x((5, 4), zero_row=True), {"norm": "L1"}),
        OpCase("normalizer-l2-f64", Op.NORMALIZER, _x((5, 4), F64), {"norm": "L2"}),
        OpCase("normalizer-l2-vector", Op.NORMALIZER, _x((6,)), {"norm": "L2"}),
        OpCase("imputer-nan", Op.IMPUTER, _x((6, 3), nan=True),
               {"imputed_value_floats": (1.0, 2.0, 3.0), "replaced_value_float": float("nan")}),
        OpCase("imputer-int", Op.IMPUTER, _x((6, 3), I64),
               {"imputed_value_int64s": (9,), "replaced_value_int64": 0}),
        OpCase("binarizer", Op.BINARIZER, _x((4, 5), nan=True), {"threshold": 0.25}),
        OpCase("binarizer-int", Op.BINARIZER, _x((4, 5), I64), {"threshold": 1.0}),
        OpCase("one-hot-ints", Op.ONE_HOT_ENCODER, _x((4, 2), I64),
               {"cats_int64s": (-2, 0, 1, 3)}),
        OpCase("one-hot-strings", Op.ONE_HOT_ENCODER, _words((3, 2), "black"),
               {"cats_strings": WORDS[:4]}),
        OpCase("one-hot-floats", Op.ONE_HOT_ENCODER, _x((5,), F64), {"cats_int64s": (-1, 0, 1)}),
        OpCase("feature-extractor", Op.ARRAY_FEATURE_EXTRACTOR,
               lambda rng: [*_x((3, 5))(rng), np.array([4, 0, 2, 2], I64)]),
        OpCase("feature-extractor-vector", Op.ARRAY_FEATURE_EXTRACTOR,
               lambda rng: [*_x((6,), I64)(rng), np.array([1, 5], I64)]),
        OpCase("feature-extractor-strings", Op.ARRAY_FEATURE_EXTRACTOR,
               lambda rng: [*_words((2, 4))(rng), np.array([3], I64)]),
    ]


def _label_encoders() -> list[OpCase]:
    words = np.asarray(WORDS[:3], dtype=object)
    return [
        OpCase("label-encoder-string-int", Op.LABEL_ENCODER, _words((3, 4)),
               {"keys": words, "values": np.array([7, 8, 9], I64), "default": np.array(-1)}),
        OpCase("label-encoder-int-string", Op.LABEL_ENCODER, _x((2, 5), I64),
               {"keys": np.array([-1, 0, 2], I64), "values": words,
                "default": np.array("none", dtype=object)}),
        OpCase("label-encoder-float-nan", Op.LABEL_ENCODER,
               lambda rng: [np.array([0.5, np.nan, 2.0, -1.0, 0.5], F32)],
               {"keys": np.array([0.5, np.nan, 2.0], F32), "values": np.array([1.0, 2.0, 3.0],
                                                                                F32),
                "default": np.array(-0.0, F32)}),
        OpCase("label-encoder-int-float", Op.LABEL_ENCODER, _x((6,), I64),
               {"keys": np.array([1, 2, 3], I64), "values": np.array([0.1, 0.2, 0.3], F64),
                "default": np.array(9.5, F64)}),
    ]


def _linear(out: int, features: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"coefficients": tuple(rng.standard_normal(out * features).round(3).tolist()),
            "intercepts": tuple(rng.standard_normal(out).round(3).tolist())}


def _linear_models() -> list[OpCase]:
    op = Op.LINEAR_CLASSIFIER
    cases = [OpCase(f"linear-classifier-{post.lower()}", op, _x((6, 4)),
                    {**_linear(3, 4, 1), "classlabels_ints": (3, 5, 7), "post_transform": post})
             for post in ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO")]
    cases += [
        OpCase("linear-classifier-binary-strings", op, _x((7, 3)),
               {**_linear(1, 3, 2), "classlabels_strings": ("no", "yes"),
                "post_transform": "LOGISTIC"}),
        OpCase("linear-classifier-binary-int-input", op, _x((5, 3), I64),
               {**_linear(1, 3, 3), "classlabels_ints": (0, 1)}),
        OpCase("linear-regressor", Op.LINEAR_REGRESSOR, _x((6, 4)),
               {**_linear(2, 4, 4), "targets": 2}),
        OpCase("linear-regressor-f64-vector", Op.LINEAR_REGRESSOR, _x((4,), F64),
               {"coefficients": (0.5, -1.0, 2.0, 0.25)}),
    ]
    return cases


def _svm(classes: int, per_class: int, features: int, seed: int, kernel: str,
         proba: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    count = classes * per_class
    pairs = classes * (classes - 1) // 2
    attrs: dict[str, Any] = {
        "kernel_type": kernel, "kernel_params": (0.3, 0.5, 3.0),
        "support_vectors": tuple(rng.standard_normal(count * features).round(3).tolist()),
        "coefficients": tuple(rng.standard_normal((classes - 1) * count).round(3).tolist()),
        "vectors_per_class": (per_class,) * classes,
        "rho": tuple(rng.standard_normal(pairs).round(3).tolist()),
        "classlabels_ints": tuple(range(classes)),
    }
    if proba:
        attrs["prob_a"] = tuple((-rng.random(pairs) * 3).round(3).tolist())
        attrs["prob_b"] = tuple(rng.standard_normal(pairs).round(3).tolist())
    return attrs


def _svms() -> list[OpCase]:
    op = Op.SVM_CLASSIFIER
    cases = [OpCase(f"svm-classifier-{kernel.lower()}", op, _x((5, 3)), _svm(3, 2, 3, 5, kernel))
             for kernel in ("LINEAR", "POLY", "RBF", "SIGMOID")]
    cases += [
        OpCase("svm-classifier-platt", op, _x((6, 3)), _svm(3, 3, 3, 6, "RBF", proba=True),
               rtol=1e-4, atol=1e-5),
        OpCase("svm-classifier-binary", op, _x((6, 2)),
               {**_svm(2, 3, 2, 7, "RBF"), "post_transform": "LOGISTIC"}),
        OpCase("svm-classifier-liblinear", op, _x((5, 3)),
               {"coefficients": (1.0, -0.5, 0.25, -1.0, 0.5, 2.0), "rho": (0.1,),
                "classlabels_strings": ("a", "b")}),
        OpCase("svm-regressor-rbf", Op.SVM_REGRESSOR, _x((6, 3)),
               {"kernel_type": "RBF", "kernel_params": (0.4, 0.0, 0.0), "n_supports": 4,
                "support_vectors": tuple(np.linspace(-1, 1, 12).round(3).tolist()),
                "coefficients": (0.5, -1.0, 0.25, 2.0), "rho": (0.3,)}),
        OpCase("svm-regressor-linear-one-class", Op.SVM_REGRESSOR, _x((6, 3), F64),
               {"coefficients": (0.5, -1.0, 0.25), "rho": (0.1,), "one_class": True}),
    ]
    return cases


def _forest(trees: int, depth: int, features: int, targets: int, seed: int, *,
            modes: tuple[int, ...] = (0,), split_dtype: Any = F32,
            nan_true: bool = False) -> dict[str, Any]:
    """Random complete trees in TreeEnsemble-5's layout, one leaf entry per target."""
    rng = np.random.default_rng(seed)
    inner = 2 ** depth - 1
    nodes: dict[str, list[Any]] = {k: [] for k in ("feat", "split", "mode", "tn", "fn", "tl",
                                                   "fl", "miss")}
    roots: list[int] = []
    members: list[float] = []
    leaf_t: list[int] = []
    leaf_w: list[float] = []
    for t in range(trees):
        roots.append(t * inner)
        for k in range(inner):
            mode = int(rng.choice(modes))
            nodes["feat"].append(int(rng.integers(0, features)))
            nodes["split"].append(round(float(rng.standard_normal()), 2))
            nodes["mode"].append(mode)
            if mode == 6:
                members += [-1.0, 0.0, 1.0, float("nan")]
                nodes["split"][-1] = 0.0
            nodes["miss"].append(int(nan_true and rng.random() < 0.5))
            for side, child in (("t", 2 * k + 1), ("f", 2 * k + 2)):
                is_leaf = child >= inner
                nodes[side + "n"].append(len(leaf_t) // targets + (child - inner) if is_leaf
                                         else t * inner + child)
                nodes[side + "l"].append(int(is_leaf))
        for _ in range(inner + 1):
            leaf_t += list(range(targets))
            leaf_w += rng.standard_normal(targets).round(3).tolist()
    return {
        "tree_roots": roots, "nodes_featureids": nodes["feat"],
        "nodes_splits": np.asarray(nodes["split"], split_dtype), "nodes_modes": nodes["mode"],
        "nodes_truenodeids": nodes["tn"], "nodes_falsenodeids": nodes["fn"],
        "nodes_trueleafs": nodes["tl"], "nodes_falseleafs": nodes["fl"],
        "nodes_missing_value_tracks_true": nodes["miss"],
        "membership_values": np.asarray(members, split_dtype) if members else None,
        "leaf_targetids": leaf_t, "leaf_weights": np.asarray(leaf_w, split_dtype),
        "leaf_sizes": [targets] * (trees * (inner + 1)) if targets > 1 else [],
    }


def _trees() -> list[OpCase]:
    op = Op.TREE_ENSEMBLE
    cases = [
        OpCase("tree-ensemble-sum", op, _x((9, 4)), {**_forest(5, 3, 4, 1, 10)}),
        OpCase("tree-ensemble-average-targets", op, _x((7, 3)),
               {**_forest(4, 2, 3, 2, 11), "aggregate_function": 0, "n_targets": 2,
                "base_values": (0.5, -0.5)}),
        OpCase("tree-ensemble-min", op, _x((6, 3)), {**_forest(3, 3, 3, 1, 12),
                                                     "aggregate_function": 2}),
        OpCase("tree-ensemble-max-logistic", op, _x((6, 3)),
               {**_forest(3, 3, 3, 1, 13), "aggregate_function": 3, "post_transform": 2}),
        OpCase("tree-ensemble-modes-nan", op, _x((12, 4), nan=True),
               {**_forest(4, 3, 4, 1, 14, modes=(0, 1, 2, 3, 4, 5, 6), nan_true=True)}),
        OpCase("tree-ensemble-f64-softmax", op, _x((5, 4), F64),
               {**_forest(3, 2, 4, 3, 15, split_dtype=F64), "post_transform": 1},
               rtol=1e-10, atol=1e-12),
    ]
    cls = Op.TREE_ENSEMBLE_CLASSIFIER
    cases += [
        OpCase("tree-classifier-multiclass", cls, _x((8, 4)),
               {**_forest(4, 3, 4, 3, 16), "classlabels_int64s": (10, 20, 30),
                "post_transform": 1}),
        OpCase("tree-classifier-binary-logistic", cls, _x((8, 3)),
               {**_forest(4, 2, 3, 1, 17), "classlabels_strings": ("no", "yes"),
                "post_transform": 2, "base_values": (0.2,)}),
        OpCase("tree-classifier-binary-positive", cls, _x((8, 3)),
               {**_forest(3, 2, 3, 1, 18), "classlabels_int64s": (0, 1),
                "leaf_weights": np.linspace(0.0, 0.3, 12, dtype=F32)}),
    ]
    return cases


CASES: list[OpCase] = [*_preprocessing(), *_label_encoders(), *_linear_models(), *_svms(),
                       *_trees()]
