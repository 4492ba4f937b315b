"""Schemas of the classical machine-learning family (ONNX's ``ai.onnx.ml`` domain).

The preprocessing ops keep their ONNX attributes:

* ``scaler`` — ``(X - offset) * scale`` per column (one value broadcasts), float32 out.
* ``normalizer`` — each row divided by its max (``MAX``), L1 or L2 norm; float32 out.
* ``imputer`` — elements equal to the replaced value (NaN matches NaN) become the
  imputed value of their column; the dtype is kept.
* ``binarizer`` — 1 where ``X > threshold``, else 0, elementwise; the dtype is kept.
* ``one_hot_encoder`` — shape ``S`` → ``S + (len(cats),)`` float32; a value outside the
  categories is all zeros (``zeros=1``) or an error (``zeros=0``).
* ``array_feature_extractor`` — ``X[..., Y]``; a 1-D ``X`` gives a ``(1, len(Y))`` row.
* ``label_encoder`` — keel's one form of LabelEncoder (every version) and CategoryMapper:
  a lookup table ``keys`` → ``values`` (tensors of any dtype keel holds, strings
  included) with a scalar ``default``; float keys match NaN to NaN.

The predictors:

* ``linear_classifier`` / ``linear_regressor`` — ``X @ coefficients.T + intercepts``, then
  ``post_transform``; the classifier also gives a label per row.
* ``svm_classifier`` / ``svm_regressor`` — support-vector machines with a LINEAR, POLY,
  RBF or SIGMOID kernel (the SVC one-vs-one voting and Platt probabilities included).
* ``tree_ensemble`` and ``tree_ensemble_classifier`` — see :mod:`keel.ops.schemas.trees`.

Scores follow onnxruntime's classifier conventions, which :func:`binary_scores` and
:func:`post_transform` hold for every backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import Dim, TensorType

__all__ = [
    "NUMERIC_DTYPES",
    "POST_TRANSFORMS",
    "binary_scores",
    "check_features",
    "classifier_labels",
    "label_dtype",
    "post_transform",
    "rows_of",
    "softmax_zero",
]

NUMERIC_DTYPES = frozenset({DType.FLOAT32, DType.FLOAT64, DType.INT64, DType.INT32})
POST_TRANSFORMS = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")

Infer = list[TensorType | None]


# ---- semantics shared by every backend -------------------------------------------------------
def check_features(op: Op, x: TensorType | None, dtypes: frozenset[DType] = NUMERIC_DTYPES,
                   *, any_rank: bool = False) -> None:
    """X holds one of ``dtypes`` and is a vector or a (rows, features) matrix."""
    if x is None:
        return
    if x.dtype not in dtypes:
        allowed = ", ".join(sorted(d.value for d in dtypes))
        raise InvalidArgumentError(f"{op.value}: X must be {allowed}, got {x.dtype.value}")
    if x.shape is not None and len(x.shape) not in (1, 2) and not any_rank:
        raise InvalidArgumentError(
            f"{op.value}: X must be 1-D or 2-D (rows, features), got shape {tuple(x.shape)}")


def rows_of(shape: Sequence[Dim] | None) -> Dim:
    """The number of rows of X: a vector is one row."""
    if shape is None:
        return None
    return 1 if len(shape) == 1 else shape[0]


def label_dtype(op: Op, ints: Sequence[int], strings: Sequence[str]) -> DType:
    """int64 labels or string labels: one of the two lists, never both."""
    if ints and strings:
        raise InvalidArgumentError(f"{op.value}: give classlabels as ints or strings, not both")
    return DType.STRING if strings else DType.INT64


def classifier_labels(ints: Sequence[int], strings: Sequence[str],
                      index: np.ndarray) -> np.ndarray:
    """The class label of each row from its class index."""
    if strings:
        return np.asarray(strings, dtype=object)[index]
    if ints:
        return np.asarray(ints, dtype=np.int64)[index]
    return index.astype(np.int64)


def _probit(x: np.ndarray) -> np.ndarray:
    # onnxruntime's approximation: sqrt(2) * erfinv(2x - 1) with Winitzki's formula.
    y = 2.0 * x - 1.0
    sign = np.where(y < 0, -1.0, 1.0)
    w = (1.0 - y) * (1.0 + y)
    with np.errstate(divide="ignore", invalid="ignore"):
        log = np.log(w)
        a = 2.0 / (np.pi * 0.147) + 0.5 * log
        v = sign * np.sqrt(-a + np.sqrt(a * a - log / 0.147))
    return np.where(w == 0, 0.0, 1.41421356 * v)


def softmax_zero(s: np.ndarray) -> np.ndarray:
    """Softmax over the last axis where entries that are exactly zero stay zero."""
    top = s.max(axis=-1, keepdims=True)
    e = np.where(np.abs(s) > 1e-7, np.exp(s - top), s * np.exp(-top))
    total = e.sum(axis=-1, keepdims=True)
    safe = np.where(total == 0, 1.0, total)
    return np.where(total == 0, 0.5, e / safe)


def post_transform(scores: np.ndarray, name: str) -> np.ndarray:
    """ONNX ML's post_transform over the class axis (the last), computed in float64."""
    s = np.asarray(scores, dtype=np.float64)
    if name == "NONE":
        return s
    if name == "LOGISTIC":
        return 1.0 / (1.0 + np.exp(-s))
    if name == "SOFTMAX":
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if name == "SOFTMAX_ZERO":
        return softmax_zero(s)
    if name == "PROBIT":
        return _probit(s)
    raise InvalidArgumentError(f"post_transform must be one of {', '.join(POST_TRANSFORMS)}, "
                               f"got {name!r}")


def binary_scores(score: np.ndarray, name: str, complement: bool) -> np.ndarray:
    """Two columns from one score ``s`` per row, as onnxruntime writes a binary model's.

    LOGISTIC gives ``[1 - σ(s), σ(s)]``; every other post transform leaves the score
    as it is beside its complement ``[1 - s, s]`` (``complement``: a probability) or
    its negation ``[-s, s]`` (a margin). Which one each classifier writes is its own
    convention, held by its kernel. (PROBIT, which onnxruntime writes as NaN there,
    gives ``[1 - p, p]`` of the probit.)
    """
    s = np.asarray(score, dtype=np.float64).reshape(-1)
    if name in ("LOGISTIC", "PROBIT"):
        p = post_transform(s, name)
        return np.stack([1.0 - p, p], axis=1)
    return np.stack([1.0 - s, s] if complement else [-s, s], axis=1)


def _check_post(op: Op, name: str) -> None:
    if name not in POST_TRANSFORMS:
        raise InvalidArgumentError(f"{op.value}: post_transform must be one of "
                                   f"{', '.join(POST_TRANSFORMS)}, got {name!r}")


# ---- preprocessing ---------------------------------------------------------------------------
def _per_column(op: Op, name: str, values: Sequence[Any], x: TensorType) -> None:
    if x.shape is None or len(values) <= 1:
        return
    cols = x.shape[-1]
    if isinstance(cols, int) and cols != len(values):
        raise InvalidArgumentError(f"{op.value}: {name} has {len(values)} values for "
                                   f"{cols} columns; give one value or one per column")


def _infer_scaler(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                  values: Sequence[np.ndarray | None]) -> Infer:
    x = types[0]
    check_features(Op.SCALER, x)
    if x is None:
        return [None]
    _per_column(Op.SCALER, "scale", attrs["scale"], x)
    _per_column(Op.SCALER, "offset", attrs["offset"], x)
    return [TensorType(DType.FLOAT32, x.shape)]


NORMS = ("MAX", "L1", "L2")


def _infer_normalizer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                      values: Sequence[np.ndarray | None]) -> Infer:
    x = types[0]
    if attrs["norm"] not in NORMS:
        raise InvalidArgumentError(f"{Op.NORMALIZER.value}: norm must be one of "
                                   f"{', '.join(NORMS)}, got {attrs['norm']!r}")
    check_features(Op.NORMALIZER, x)
    return [None if x is None else TensorType(DType.FLOAT32, x.shape)]


def _infer_imputer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                   values: Sequence[np.ndarray | None]) -> Infer:
    x = types[0]
    check_features(Op.IMPUTER, x)
    if x is None:
        return [None]
    imputed = attrs["imputed_value_floats"] if x.dtype.is_float \
        else attrs["imputed_value_int64s"]
    if not imputed:
        kind = "imputed_value_floats" if x.dtype.is_float else "imputed_value_int64s"
        raise InvalidArgumentError(f"{Op.IMPUTER.value}: {x.dtype.value} input needs {kind}")
    _per_column(Op.IMPUTER, "the imputed values", imputed, x)
    return [x]


def _infer_binarizer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                     values: Sequence[np.ndarray | None]) -> Infer:
    check_features(Op.BINARIZER, types[0], any_rank=True)
    return [types[0]]


_ENCODABLE = NUMERIC_DTYPES | {DType.STRING}


def _infer_one_hot(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                   values: Sequence[np.ndarray | None]) -> Infer:
    x = types[0]
    ints, strings = attrs["cats_int64s"], attrs["cats_strings"]
    if bool(ints) == bool(strings):
        raise InvalidArgumentError(f"{Op.ONE_HOT_ENCODER.value}: give exactly one of "
                                   "cats_int64s and cats_strings")
    if x is None:
        return [None]
    if (x.dtype is DType.STRING) != bool(strings):
        needed = "cats_strings" if x.dtype is DType.STRING else "cats_int64s"
        raise InvalidArgumentError(f"{Op.ONE_HOT_ENCODER.value}: {x.dtype.value} input needs "
                                   f"{needed}")
    if x.dtype not in _ENCODABLE:
        raise InvalidArgumentError(f"{Op.ONE_HOT_ENCODER.value}: X must be numeric or string, "
                                   f"got {x.dtype.value}")
    n = len(ints or strings)
    return [TensorType(DType.FLOAT32, None if x.shape is None else (*x.shape, n))]


def _infer_feature_extractor(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                             values: Sequence[np.ndarray | None]) -> Infer:
    x, y = types[0], types[1]
    if y is not None and y.dtype is not DType.INT64:
        raise InvalidArgumentError(f"{Op.ARRAY_FEATURE_EXTRACTOR.value}: Y must be int64 "
                                   f"indices, got {y.dtype.value}")
    if x is None:
        return [None]
    if x.shape is None or y is None:
        return [TensorType(x.dtype, None)]
    if len(x.shape) == 0:
        raise InvalidArgumentError(f"{Op.ARRAY_FEATURE_EXTRACTOR.value}: X must have at "
                                   "least one axis")
    count = y.numel()
    lead = (1,) if len(x.shape) == 1 else tuple(x.shape[:-1])
    return [TensorType(x.dtype, (*lead, count))]


def check_label_table(keys: np.ndarray, values: np.ndarray, default: np.ndarray) -> None:
    """One-dimensional keys and values of one length, a one-element default of the values' type."""
    op = Op.LABEL_ENCODER.value
    if keys.ndim != 1 or values.ndim != 1 or len(keys) != len(values):
        raise InvalidArgumentError(f"{op}: keys and values must be 1-D of one length, got "
                                   f"shapes {keys.shape} and {values.shape}")
    if default.size != 1:
        raise InvalidArgumentError(f"{op}: default must hold one value, got {default.size}")
    if DType.from_numpy(default.dtype) is not DType.from_numpy(values.dtype):
        raise InvalidArgumentError(f"{op}: default is {default.dtype}, values are "
                                   f"{values.dtype}; they must match")


def _infer_label_encoder(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                         values: Sequence[np.ndarray | None]) -> Infer:
    keys, vals, default = attrs["keys"], attrs["values"], attrs["default"]
    check_label_table(keys, vals, default)
    x = types[0]
    key_type = DType.from_numpy(keys.dtype)
    if x is not None and x.dtype is not key_type and len(keys):
        raise InvalidArgumentError(f"{Op.LABEL_ENCODER.value}: X is {x.dtype.value}, the "
                                   f"keys are {key_type.value}; they must match")
    out = DType.from_numpy(vals.dtype)
    return [None if x is None else TensorType(out, x.shape)]


# ---- linear models ---------------------------------------------------------------------------
def linear_shape(op: Op, coefficients: Sequence[float], intercepts: Sequence[float],
                 features: Dim) -> tuple[int, int]:
    """(outputs, features) of a coefficient list with one intercept per output."""
    n = len(coefficients)
    rows = len(intercepts) if intercepts else None
    if rows is None and isinstance(features, int) and features > 0:
        rows = n // features
    if rows is None:
        rows = 1
    if rows <= 0 or n % rows or (isinstance(features, int) and n != rows * features):
        raise InvalidArgumentError(
            f"{op.value}: {n} coefficients do not split into {rows} rows of "
            f"{features if features is not None else 'the'} features")
    return rows, n // rows


def linear_score_columns(rows: int, n_labels: int) -> int:
    """A single score row for two classes is written as two columns."""
    return 2 if rows == 1 and n_labels == 2 else rows


def _features(x: TensorType) -> Dim:
    return None if x.shape is None else x.shape[-1]


def _infer_linear_classifier(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                             values: Sequence[np.ndarray | None]) -> Infer:
    op, x = Op.LINEAR_CLASSIFIER, types[0]
    _check_post(op, attrs["post_transform"])
    ints, strings = attrs["classlabels_ints"], attrs["classlabels_strings"]
    labels = label_dtype(op, ints, strings)
    check_features(op, x)
    if x is None:
        return [None, None]
    rows, _ = linear_shape(op, attrs["coefficients"], attrs["intercepts"], _features(x))
    n = rows_of(x.shape)
    cols = linear_score_columns(rows, len(ints or strings))
    return [TensorType(labels, (n,)), TensorType(DType.FLOAT32, (n, cols))]


def _infer_linear_regressor(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                            values: Sequence[np.ndarray | None]) -> Infer:
    op, x = Op.LINEAR_REGRESSOR, types[0]
    _check_post(op, attrs["post_transform"])
    check_features(op, x)
    if x is None:
        return [None]
    intercepts = attrs["intercepts"] or (0.0,) * attrs["targets"]
    if len(intercepts) != attrs["targets"]:
        raise InvalidArgumentError(f"{op.value}: {len(intercepts)} intercepts for "
                                   f"{attrs['targets']} targets")
    rows, _ = linear_shape(op, attrs["coefficients"], intercepts, _features(x))
    return [TensorType(DType.FLOAT32, (rows_of(x.shape), rows))]


# ---- support-vector machines ----------------------------------------------------------------
KERNELS = ("LINEAR", "POLY", "RBF", "SIGMOID")


def check_kernel(op: Op, attrs: Mapping[str, Any]) -> None:
    if attrs["kernel_type"] not in KERNELS:
        raise InvalidArgumentError(f"{op.value}: kernel_type must be one of "
                                   f"{', '.join(KERNELS)}, got {attrs['kernel_type']!r}")
    if attrs["kernel_params"] and len(attrs["kernel_params"]) != 3:
        raise InvalidArgumentError(f"{op.value}: kernel_params is (gamma, coef0, degree), got "
                                   f"{len(attrs['kernel_params'])} values")
    _check_post(op, attrs["post_transform"])


def svm_classes(attrs: Mapping[str, Any]) -> int:
    return max(len(attrs["classlabels_ints"] or attrs["classlabels_strings"]), 1)


def svm_score_columns(attrs: Mapping[str, Any]) -> int:
    """How many score columns an SVMClassifier writes.

    liblinear mode (no support vectors): one per class. SVC mode: one per class with
    Platt probabilities, else one per pair of classes, a single pair written as two
    columns.
    """
    classes = svm_classes(attrs)
    if sum(attrs["vectors_per_class"]) == 0 or attrs["prob_a"]:
        return classes
    pairs = classes * (classes - 1) // 2
    if pairs == 1 and len(attrs["rho"]) == 1:
        return 2
    return pairs


def _infer_svm_classifier(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                          values: Sequence[np.ndarray | None]) -> Infer:
    op, x = Op.SVM_CLASSIFIER, types[0]
    check_kernel(op, attrs)
    labels = label_dtype(op, attrs["classlabels_ints"], attrs["classlabels_strings"])
    check_features(op, x)
    if x is None:
        return [None, None]
    n = rows_of(x.shape)
    return [TensorType(labels, (n,)), TensorType(DType.FLOAT32, (n, svm_score_columns(attrs)))]


def _infer_svm_regressor(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                         values: Sequence[np.ndarray | None]) -> Infer:
    op, x = Op.SVM_REGRESSOR, types[0]
    check_kernel(op, attrs)
    check_features(op, x)
    return [None if x is None else TensorType(DType.FLOAT32, (rows_of(x.shape), 1))]


_CLASS_LABELS = (AttrSpec("classlabels_ints", AttrKind.INTS, ()),
                 AttrSpec("classlabels_strings", AttrKind.STRS, ()))
_SVM = (AttrSpec("coefficients", AttrKind.FLOATS, ()),
        AttrSpec("kernel_params", AttrKind.FLOATS, ()),
        AttrSpec("kernel_type", AttrKind.STR, "LINEAR"),
        AttrSpec("post_transform", AttrKind.STR, "NONE"),
        AttrSpec("rho", AttrKind.FLOATS, ()),
        AttrSpec("support_vectors", AttrKind.FLOATS, ()))

register_schema(OpSchema(
    Op.SCALER, 1, 1, attrs=(AttrSpec("offset", AttrKind.FLOATS, ()),
                            AttrSpec("scale", AttrKind.FLOATS, ())),
    infer=_infer_scaler, doc="ONNX ML Scaler: (X - offset) * scale, float32 out.",
))
register_schema(OpSchema(
    Op.NORMALIZER, 1, 1, attrs=(AttrSpec("norm", AttrKind.STR, "MAX"),),
    infer=_infer_normalizer, doc="ONNX ML Normalizer: rows divided by their MAX, L1 or L2.",
))
register_schema(OpSchema(
    Op.IMPUTER, 1, 1, attrs=(AttrSpec("imputed_value_floats", AttrKind.FLOATS, ()),
                             AttrSpec("imputed_value_int64s", AttrKind.INTS, ()),
                             AttrSpec("replaced_value_float", AttrKind.FLOAT, 0.0),
                             AttrSpec("replaced_value_int64", AttrKind.INT, 0)),
    infer=_infer_imputer, doc="ONNX ML Imputer: replace a marker value per column.",
))
register_schema(OpSchema(
    Op.BINARIZER, 1, 1, attrs=(AttrSpec("threshold", AttrKind.FLOAT, 0.0),),
    infer=_infer_binarizer, doc="ONNX ML Binarizer: 1 where X > threshold, else 0.",
))
register_schema(OpSchema(
    Op.ONE_HOT_ENCODER, 1, 1, attrs=(AttrSpec("cats_int64s", AttrKind.INTS, ()),
                                     AttrSpec("cats_strings", AttrKind.STRS, ()),
                                     AttrSpec("zeros", AttrKind.BOOL, True)),
    infer=_infer_one_hot, doc="ONNX ML OneHotEncoder: one float column per category.",
))
register_schema(OpSchema(
    Op.ARRAY_FEATURE_EXTRACTOR, 2, 2, infer=_infer_feature_extractor,
    doc="ONNX ML ArrayFeatureExtractor: X[..., Y].",
))
register_schema(OpSchema(
    Op.LABEL_ENCODER, 1, 1, attrs=(AttrSpec("keys", AttrKind.TENSOR, REQUIRED),
                                   AttrSpec("values", AttrKind.TENSOR, REQUIRED),
                                   AttrSpec("default", AttrKind.TENSOR, REQUIRED)),
    infer=_infer_label_encoder,
    doc="ONNX ML LabelEncoder and CategoryMapper: a keys → values table with a default.",
))
_LINEAR = (AttrSpec("coefficients", AttrKind.FLOATS, REQUIRED),
           AttrSpec("intercepts", AttrKind.FLOATS, ()),
           AttrSpec("post_transform", AttrKind.STR, "NONE"))
register_schema(OpSchema(
    Op.LINEAR_CLASSIFIER, 1, 1, attrs=(
        *_LINEAR, AttrSpec("multi_class", AttrKind.INT, 0), *_CLASS_LABELS),
    infer=_infer_linear_classifier, min_outputs=2, max_outputs=2,
    doc="ONNX ML LinearClassifier: labels and scores of a linear model.",
))
register_schema(OpSchema(
    Op.LINEAR_REGRESSOR, 1, 1, attrs=(*_LINEAR, AttrSpec("targets", AttrKind.INT, 1)),
    infer=_infer_linear_regressor, doc="ONNX ML LinearRegressor: X @ W.T + b.",
))
register_schema(OpSchema(
    Op.SVM_CLASSIFIER, 1, 1, attrs=(
        *_SVM, *_CLASS_LABELS, AttrSpec("prob_a", AttrKind.FLOATS, ()),
        AttrSpec("prob_b", AttrKind.FLOATS, ()),
        AttrSpec("vectors_per_class", AttrKind.INTS, ())),
    infer=_infer_svm_classifier, min_outputs=2, max_outputs=2,
    doc="ONNX ML SVMClassifier: one-vs-one SVC or liblinear scores, labels, probabilities.",
))
register_schema(OpSchema(
    Op.SVM_REGRESSOR, 1, 1, attrs=(
        *_SVM, AttrSpec("n_supports", AttrKind.INT, 0), AttrSpec("one_class", AttrKind.BOOL,
                                                                 False)),
    infer=_infer_svm_regressor, doc="ONNX ML SVMRegressor: a kernel expansion plus rho.",
))
