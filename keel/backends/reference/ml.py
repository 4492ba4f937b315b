"""Reference kernels of the classical machine-learning family (ONNX's ai.onnx.ml domain).

Plain NumPy in float64; the semantics are in :mod:`keel.ops.schemas.ml`. These
kernels are whole-array already (a lookup, an elementwise pass, matrix products), so
the cpu backend registers them too (:mod:`keel.backends.cpu.ml`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schemas.ml import (
    NUMERIC_DTYPES,
    binary_scores,
    check_label_table,
    classifier_labels,
    label_dtype,
    linear_score_columns,
    linear_shape,
    post_transform,
)

__all__ = ["ENCODABLE", "linear_classify", "linear_scores", "matrix", "svm_classify", "svm_kernel"]

ENCODABLE = NUMERIC_DTYPES | {DType.STRING, DType.INT16}


def matrix(x: np.ndarray) -> np.ndarray:
    """X as (rows, features): a vector is one row."""
    return x.reshape(1, -1) if x.ndim == 1 else x


def _per_column(values: Any, dtype: Any = np.float64) -> np.ndarray:
    return np.asarray(values, dtype=dtype).reshape(-1)


@TABLE.kernel(Op.SCALER, dtypes=NUMERIC_DTYPES)
def scaler(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """(X - offset) * scale, float32."""
    x = inputs[0].astype(np.float64)
    offset = _per_column(attrs["offset"] or (0.0,))
    scale = _per_column(attrs["scale"] or (1.0,))
    return [((x - offset) * scale).astype(np.float32)]


@TABLE.kernel(Op.NORMALIZER, dtypes=NUMERIC_DTYPES)
def normalizer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Each row over its max, L1 or L2 norm; a zero norm leaves the row as it is."""
    x = matrix(inputs[0]).astype(np.float64)
    norm = attrs["norm"]
    if norm == "MAX":
        d = x.max(axis=1, keepdims=True) if x.shape[1] else np.ones((len(x), 1))
    elif norm == "L1":
        d = np.abs(x).sum(axis=1, keepdims=True)
    else:
        d = np.sqrt((x * x).sum(axis=1, keepdims=True))
    y = np.divide(x, d, out=x.copy(), where=d != 0)
    return [y.astype(np.float32).reshape(inputs[0].shape)]


@TABLE.kernel(Op.IMPUTER, dtypes=NUMERIC_DTYPES)
def imputer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Elements equal to the replaced value (NaN matches NaN) take their column's value."""
    x = inputs[0]
    if x.dtype.kind == "f":
        marker = attrs["replaced_value_float"]
        hit = np.isnan(x) if np.isnan(marker) else x == marker
        fill = _per_column(attrs["imputed_value_floats"])
    else:
        hit = x == attrs["replaced_value_int64"]
        fill = _per_column(attrs["imputed_value_int64s"], np.int64)
    if len(fill) > 1 and x.shape[-1] != len(fill):
        raise InvalidArgumentError(f"{Op.IMPUTER.value}: {len(fill)} imputed values for "
                                   f"{x.shape[-1]} columns")
    full = np.broadcast_to(fill.astype(x.dtype), x.shape)
    return [np.where(hit, full, x)]


@TABLE.kernel(Op.BINARIZER, dtypes=NUMERIC_DTYPES)
def binarizer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """1 where X > threshold, else 0 (NaN stays NaN), in X's dtype."""
    x = inputs[0]
    y = np.where(x > attrs["threshold"], 1, 0).astype(x.dtype)
    if x.dtype.kind == "f":
        y[np.isnan(x)] = np.nan
    return [y]


@TABLE.kernel(Op.ONE_HOT_ENCODER, dtypes=ENCODABLE)
def one_hot_encoder(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One float32 column per category; numbers are compared as int64 (truncated)."""
    x = inputs[0]
    if x.dtype == object:
        cats: np.ndarray = np.asarray(attrs["cats_strings"], dtype=object)
        keys = x
    else:
        cats = np.asarray(attrs["cats_int64s"], dtype=np.int64)
        keys = x.astype(np.int64) if x.dtype.kind != "f" else np.trunc(x)
    y = (keys[..., None] == cats).astype(np.float32)
    if not attrs["zeros"] and not y.any(axis=-1).all():
        raise InvalidArgumentError(f"{Op.ONE_HOT_ENCODER.value}: a value is not one of the "
                                   "categories and zeros=0")
    return [y]


@TABLE.kernel(Op.ARRAY_FEATURE_EXTRACTOR, dtypes=ENCODABLE)
def array_feature_extractor(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                            out: Out) -> list[Any]:
    """X[..., Y] (a 1-D X gives one row)."""
    x, index = inputs[0], np.asarray(inputs[1]).reshape(-1)
    if x.ndim == 0 or (index.size and (index.min() < 0 or index.max() >= x.shape[-1])):
        raise InvalidArgumentError(f"{Op.ARRAY_FEATURE_EXTRACTOR.value}: an index is outside "
                                   f"0..{x.shape[-1] - 1 if x.ndim else -1}")
    y = x[..., index]
    return [y.reshape(1, -1) if x.ndim == 1 else y]


@TABLE.kernel(Op.LABEL_ENCODER, dtypes=ENCODABLE | {DType.FLOAT64})
def label_encoder(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """values[k] where X equals keys[k] (the first such k; NaN matches NaN), else default."""
    x = inputs[0]
    keys, values, default = attrs["keys"], attrs["values"], attrs["default"]
    check_label_table(keys, values, default)
    table: dict[Any, Any] = {}
    for k, v in zip(keys.tolist(), values.tolist(), strict=True):
        table.setdefault("nan" if _is_nan(k) else k, v)
    fallback = default.reshape(-1)[0]
    flat = [table.get("nan" if _is_nan(k) else k, fallback) for k in x.reshape(-1).tolist()]
    return [np.asarray(flat, dtype=values.dtype).reshape(x.shape)]


def _is_nan(k: Any) -> bool:
    return isinstance(k, float) and k != k


# ---- linear models ---------------------------------------------------------------------------
def linear_scores(x: np.ndarray, attrs: Attrs, op: Op) -> np.ndarray:
    """X @ W.T + b in float64, W laid out (outputs, features)."""
    x2 = matrix(x).astype(np.float64)
    rows, cols = linear_shape(op, attrs["coefficients"], attrs["intercepts"], x2.shape[1])
    w = np.asarray(attrs["coefficients"], dtype=np.float64).reshape(rows, cols)
    b = np.asarray(attrs["intercepts"] or (0.0,) * rows, dtype=np.float64)
    return x2 @ w.T + b


def linear_classify(scores: np.ndarray, attrs: Attrs) -> tuple[np.ndarray, np.ndarray]:
    """Labels and float32 scores from raw linear scores (onnxruntime's conventions)."""
    ints, strings = attrs["classlabels_ints"], attrs["classlabels_strings"]
    label_dtype(Op.LINEAR_CLASSIFIER, ints, strings)
    n_labels = len(ints or strings)
    post = attrs["post_transform"]
    if scores.shape[1] == 1:       # one score: positive means the second class
        s = scores[:, 0]
        labels = classifier_labels(ints, strings, (s > 0).astype(np.int64))
        if linear_score_columns(1, n_labels) == 2:
            return labels, binary_scores(s, post, complement=True).astype(np.float32)
        return labels, post_transform(scores, post).astype(np.float32)
    return classifier_labels(ints, strings, np.argmax(scores, axis=1)), \
        post_transform(scores, post).astype(np.float32)


@TABLE.kernel(Op.LINEAR_CLASSIFIER, dtypes=NUMERIC_DTYPES)
def linear_classifier(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Scores X @ W.T + b; the label of the best score (of its sign for one score)."""
    labels, scores = linear_classify(linear_scores(inputs[0], attrs, Op.LINEAR_CLASSIFIER),
                                     attrs)
    return [labels, scores]


@TABLE.kernel(Op.LINEAR_REGRESSOR, dtypes=NUMERIC_DTYPES)
def linear_regressor(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """X @ W.T + b through post_transform, float32."""
    scores = linear_scores(inputs[0], attrs, Op.LINEAR_REGRESSOR)
    return [post_transform(scores, attrs["post_transform"]).astype(np.float32)]


# ---- support-vector machines ----------------------------------------------------------------
def svm_kernel(x: np.ndarray, vectors: np.ndarray, attrs: Attrs) -> np.ndarray:
    """The kernel between every row of ``x`` and every vector: (rows, vectors), float64."""
    gamma, coef0, degree = (tuple(attrs["kernel_params"]) or (0.0, 0.0, 0.0))[:3]
    kind = attrs["kernel_type"]
    dot = x @ vectors.T
    if kind == "RBF":
        # |x - v|^2 = |x|^2 + |v|^2 - 2 x.v: (rows, vectors) memory, not (rows, vectors, features)
        d2 = (x * x).sum(axis=1)[:, None] + (vectors * vectors).sum(axis=1)[None, :] - 2 * dot
        return np.exp(-gamma * np.maximum(d2, 0.0))
    if kind == "POLY":
        return (gamma * dot + coef0) ** int(degree)
    if kind == "SIGMOID":
        return np.tanh(gamma * dot + coef0)
    return dot


def _support_vectors(attrs: Attrs, count: int, features: int, op: Op) -> np.ndarray:
    sv = np.asarray(attrs["support_vectors"], dtype=np.float64)
    if sv.size != count * features:
        raise InvalidArgumentError(f"{op.value}: {sv.size} support-vector values are not "
                                   f"{count} vectors of {features} features")
    return sv.reshape(count, features)


@TABLE.kernel(Op.SVM_REGRESSOR, dtypes=NUMERIC_DTYPES)
def svm_regressor(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """sum_j coef_j K(x, sv_j) + rho (a plain dot product without support vectors)."""
    x = matrix(inputs[0]).astype(np.float64)
    coef = np.asarray(attrs["coefficients"], dtype=np.float64)
    count = attrs["n_supports"]
    if count > 0:
        s = svm_kernel(x, _support_vectors(attrs, count, x.shape[1], Op.SVM_REGRESSOR),
                       attrs) @ coef
    else:
        s = x @ coef.reshape(-1)[: x.shape[1]]
    s = s + (attrs["rho"] or (0.0,))[0]
    if attrs["one_class"]:
        s = np.where(s > 0, 1.0, -1.0)
    return [s.astype(np.float32).reshape(-1, 1)]


def pair_probabilities(r: np.ndarray) -> np.ndarray:
    """libsvm's multi-class probabilities from pairwise ones ``r`` (rows, k, k), per row."""
    rows, k = r.shape[0], r.shape[1]
    q = -r.transpose(0, 2, 1) * r
    diag = (r ** 2).sum(axis=1) - np.einsum("nii->ni", r) ** 2
    q[:, np.arange(k), np.arange(k)] = diag
    p = np.full((rows, k), 1.0 / k)
    active = np.ones(rows, dtype=bool)
    for _ in range(max(100, k)):
        qp = np.einsum("nij,nj->ni", q, p)
        pqp = (p * qp).sum(axis=1)
        active &= np.abs(qp - pqp[:, None]).max(axis=1) >= 0.005 / k
        if not active.any():
            break
        for t in range(k):
            diff = np.where(active, (pqp - qp[:, t]) / q[:, t, t], 0.0)
            p[:, t] += diff
            pqp = (pqp + diff * (diff * q[:, t, t] + 2 * qp[:, t])) / (1 + diff) ** 2
            p /= (1 + diff)[:, None]
            qp = (qp + diff[:, None] * q[:, t, :]) / (1 + diff)[:, None]
    return p


def _svc_scores(x: np.ndarray, attrs: Attrs, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One-vs-one decision values (rows, pairs) and votes (rows, classes)."""
    per_class = np.asarray(attrs["vectors_per_class"], dtype=np.int64)
    count = int(per_class.sum())
    kernel = svm_kernel(x, _support_vectors(attrs, count, x.shape[1], Op.SVM_CLASSIFIER), attrs)
    coef = np.asarray(attrs["coefficients"], dtype=np.float64).reshape(-1, count)
    start = np.concatenate([[0], np.cumsum(per_class)[:-1]])
    rho = np.asarray(attrs["rho"], dtype=np.float64)
    pairs: list[np.ndarray] = []
    votes = np.zeros((len(x), classes))
    for i in range(classes):
        for j in range(i + 1, classes):
            si, sj = slice(start[i], start[i] + per_class[i]), slice(start[j],
                                                                     start[j] + per_class[j])
            s = rho[len(pairs)] + kernel[:, si] @ coef[j - 1, si] + kernel[:, sj] @ coef[i, sj]
            votes[:, i] += s > 0
            votes[:, j] += s <= 0
            pairs.append(s)
    return np.stack(pairs, axis=1) if pairs else np.zeros((len(x), 0)), votes


def _platt(scores: np.ndarray, attrs: Attrs, classes: int) -> np.ndarray:
    a = np.asarray(attrs["prob_a"], dtype=np.float64)
    b = np.asarray(attrs["prob_b"], dtype=np.float64)
    val = np.clip(1.0 / (1.0 + np.exp(scores * a + b)), 1e-7, 1 - 1e-7)
    r = np.zeros((len(scores), classes, classes))
    iu = np.triu_indices(classes, 1)
    r[:, iu[0], iu[1]] = val
    r[:, iu[1], iu[0]] = 1 - val
    return pair_probabilities(r)


def svm_classify(x: np.ndarray, attrs: Attrs) -> tuple[np.ndarray, np.ndarray]:
    """Labels and float32 scores of an SVMClassifier (onnxruntime's conventions)."""
    ints, strings = attrs["classlabels_ints"], attrs["classlabels_strings"]
    label_dtype(Op.SVM_CLASSIFIER, ints, strings)
    classes = max(len(ints or strings), 1)
    post = attrs["post_transform"]
    if sum(attrs["vectors_per_class"]) == 0:
        coef = np.asarray(attrs["coefficients"], dtype=np.float64).reshape(classes, -1)
        scores = x @ coef.T + (attrs["rho"] or (0.0,))[0]
        best = np.argmax(scores, axis=1)
        if len(attrs["rho"]) == 1 and classes == 2:
            # onnxruntime's binary rule: a high enough best score means the second class
            # (0.5 when every coefficient is non-negative, else 0).
            top = scores[np.arange(len(x)), best]
            high = top >= 0.5 if min(attrs["coefficients"]) >= 0 else top > 0
            best = np.where(high, 1, best)
        return classifier_labels(ints, strings, best), \
            post_transform(scores, post).astype(np.float32)
    pairs, votes = _svc_scores(x, attrs, classes)
    best = np.argmax(votes, axis=1)
    if attrs["prob_a"]:
        return classifier_labels(ints, strings, best), \
            post_transform(_platt(pairs, attrs, classes), post).astype(np.float32)
    if pairs.shape[1] == 1 and len(attrs["rho"]) == 1:
        return classifier_labels(ints, strings, best), \
            binary_scores(pairs[:, 0], post, complement=post != "NONE").astype(np.float32)
    return classifier_labels(ints, strings, best), post_transform(pairs, post).astype(np.float32)


@TABLE.kernel(Op.SVM_CLASSIFIER, dtypes=NUMERIC_DTYPES)
def svm_classifier(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """One-vs-one votes (or liblinear scores), labels, and scores or Platt probabilities."""
    labels, scores = svm_classify(matrix(inputs[0]).astype(np.float64), attrs)
    return [labels, scores]
