"""Schemas of the string family (ONNX's text ops); strings are object arrays of ``str``.

* ``string_concat``: elementwise ``x + y`` with broadcasting.
* ``string_split``: each string split at ``delimiter`` (runs of whitespace when it is
  absent or empty), at most ``maxsplit`` times; outputs the pieces, padded with ``""``
  to the longest count along a new last axis, and the count of each (int64).
* ``string_normalizer``: drops the elements found in ``stopwords`` (compared with case
  or without, ``is_case_sensitive``), then changes case (``LOWER``, ``UPPER``, ``NONE``).
  The input is ``(C,)`` or ``(1, C)``; when every element is dropped the output holds
  one empty string.
* ``regex_full_match``: whether each string matches ``pattern`` whole (bool).
* ``tfidf_vectorizer``: per row of int or string tokens, how often each n-gram of the
  pool occurs (with up to ``max_skip_count`` tokens skipped between the items of an
  n-gram; 1-grams counted once), weighted by ``mode``: TF (counts), IDF (the weight
  where the count is non-zero), TFIDF (count x weight).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import TensorType, broadcast_shapes

__all__ = ["CASE_ACTIONS", "STRINGS", "TFIDF_INPUTS", "check_normalizer_shape",
           "check_tfidf_shape", "compile_pattern", "tfidf_pool"]

STRINGS = frozenset({DType.STRING})
CASE_ACTIONS = ("NONE", "LOWER", "UPPER")


def _require_strings(op: Op, types: Sequence[TensorType | None]) -> None:
    for t in types:
        if t is not None and t.dtype is not DType.STRING:
            raise InvalidArgumentError(f"{op.value} takes string tensors, got {t.dtype.value}")


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled (Python's ``re``, a superset of the RE2 syntax ONNX names)."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InvalidArgumentError(
            f"{Op.REGEX_FULL_MATCH.value}: pattern {pattern!r} is not a valid regular "
            f"expression: {exc}") from None


def check_normalizer_shape(shape: Sequence[Any]) -> None:
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[0] not in (1, None)
                                    and isinstance(shape[0], int)):
        raise InvalidArgumentError(
            f"{Op.STRING_NORMALIZER.value}: input must be (C,) or (1, C), got {tuple(shape)}")


def _infer_concat(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                  values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    _require_strings(Op.STRING_CONCAT, types)
    shapes = [t.shape for t in types if t is not None and t.shape is not None]
    if len(shapes) < len(types):
        return [TensorType(DType.STRING, None)]
    return [TensorType(DType.STRING, broadcast_shapes(*shapes))]


def _infer_split(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                 values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    _require_strings(Op.STRING_SPLIT, types)
    if attrs["maxsplit"] is not None and attrs["maxsplit"] < 0:
        raise InvalidArgumentError(
            f"{Op.STRING_SPLIT.value}: maxsplit must be >= 0, got {attrs['maxsplit']}")
    x = types[0]
    shape = None if x is None or x.shape is None else tuple(x.shape)
    return [TensorType(DType.STRING, None if shape is None else (*shape, None)),
            TensorType(DType.INT64, shape)]


def _infer_normalizer(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                      values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    _require_strings(Op.STRING_NORMALIZER, types)
    if attrs["case_change_action"] not in CASE_ACTIONS:
        raise InvalidArgumentError(
            f"{Op.STRING_NORMALIZER.value}: case_change_action "
            f"{attrs['case_change_action']!r} is not one of {', '.join(CASE_ACTIONS)}")
    x = types[0]
    if x is None or x.shape is None:
        return [TensorType(DType.STRING, None)]
    check_normalizer_shape(x.shape)
    return [TensorType(DType.STRING, (*x.shape[:-1], None))]


def _infer_regex(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                 values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    _require_strings(Op.REGEX_FULL_MATCH, types)
    compile_pattern(attrs["pattern"])
    x = types[0]
    return [TensorType(DType.BOOL, None if x is None else x.shape)]


TFIDF_INPUTS = frozenset({DType.INT32, DType.INT64, DType.STRING})
TFIDF_MODES = ("TF", "IDF", "TFIDF")


def tfidf_pool(attrs: Mapping[str, Any]) -> dict[tuple[Any, ...], int]:
    """The pool's n-grams of the sizes counted, each with its output column.

    The pool holds the 1-grams, then the 2-grams, ... (``ngram_counts`` gives where each
    size starts); the k-th n-gram of the whole pool counts into column
    ``ngram_indexes[k]``. A repeated n-gram counts into its last column.
    """
    op = Op.TFIDF_VECTORIZER
    pool = list(attrs["pool_int64s"] or attrs["pool_strings"] or ())
    starts, columns = list(attrs["ngram_counts"]), list(attrs["ngram_indexes"])
    if attrs["mode"] not in TFIDF_MODES:
        raise InvalidArgumentError(
            f"{op.value}: mode {attrs['mode']!r} is not one of {', '.join(TFIDF_MODES)}")
    if not columns or min(columns) < 0:
        raise InvalidArgumentError(f"{op.value}: ngram_indexes must be non-empty and >= 0")
    if starts != sorted(starts) or any(s < 0 or s > len(pool) for s in starts):
        raise InvalidArgumentError(
            f"{op.value}: ngram_counts {tuple(starts)} must rise within the pool of "
            f"{len(pool)} items")
    grams: dict[tuple[Any, ...], int] = {}
    k = 0
    for size, start in enumerate(starts, 1):
        end = starts[size] if size < len(starts) else len(pool)
        for at in range(start, end - size + 1, size):
            if k >= len(columns):
                raise InvalidArgumentError(
                    f"{op.value}: the pool has more n-grams than ngram_indexes entries "
                    f"({len(columns)})")
            if attrs["min_gram_length"] <= size <= attrs["max_gram_length"]:
                grams[tuple(pool[at:at + size])] = columns[k]
            k += 1
    return grams


def check_tfidf_shape(shape: Sequence[Any]) -> None:
    if len(shape) not in (1, 2):
        raise InvalidArgumentError(
            f"{Op.TFIDF_VECTORIZER.value}: input must be (C,) or (B, C), got {tuple(shape)}")


def _infer_tfidf(types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                 values: Sequence[np.ndarray | None]) -> list[TensorType | None]:
    x = types[0]
    if x is not None and x.dtype not in TFIDF_INPUTS:
        raise InvalidArgumentError(
            f"{Op.TFIDF_VECTORIZER.value} takes int32, int64 or string input, "
            f"got {x.dtype.value}")
    tfidf_pool(attrs)
    width = max(attrs["ngram_indexes"]) + 1
    if x is None or x.shape is None:
        return [TensorType(DType.FLOAT32, None)]
    check_tfidf_shape(x.shape)
    return [TensorType(DType.FLOAT32, (*x.shape[:-1], width))]


register_schema(OpSchema(
    Op.STRING_CONCAT, 2, 2, infer=_infer_concat,
    doc="ONNX StringConcat: x + y elementwise, broadcast.",
))
register_schema(OpSchema(
    Op.STRING_SPLIT, 1, 1, max_outputs=2,
    attrs=(AttrSpec("delimiter", AttrKind.STR, None), AttrSpec("maxsplit", AttrKind.INT, None)),
    infer=_infer_split,
    doc="ONNX StringSplit: the pieces of each string, padded with '' along a new last axis, "
        "and their counts (int64). No delimiter (or ''): split at runs of whitespace.",
))
register_schema(OpSchema(
    Op.STRING_NORMALIZER, 1, 1,
    attrs=(AttrSpec("case_change_action", AttrKind.STR, "NONE"),
           AttrSpec("is_case_sensitive", AttrKind.BOOL, False),
           AttrSpec("locale", AttrKind.STR, ""),
           AttrSpec("stopwords", AttrKind.STRS, ())),
    infer=_infer_normalizer,
    doc="ONNX StringNormalizer: drop stopwords, then change case; (C,) or (1, C) input.",
))
register_schema(OpSchema(
    Op.REGEX_FULL_MATCH, 1, 1, attrs=(AttrSpec("pattern", AttrKind.STR, REQUIRED),),
    infer=_infer_regex,
    doc="ONNX RegexFullMatch: whether each string matches the pattern whole.",
))
register_schema(OpSchema(
    Op.TFIDF_VECTORIZER, 1, 1,
    attrs=(AttrSpec("max_gram_length", AttrKind.INT, REQUIRED),
           AttrSpec("max_skip_count", AttrKind.INT, REQUIRED),
           AttrSpec("min_gram_length", AttrKind.INT, REQUIRED),
           AttrSpec("mode", AttrKind.STR, REQUIRED),
           AttrSpec("ngram_counts", AttrKind.INTS, REQUIRED),
           AttrSpec("ngram_indexes", AttrKind.INTS, REQUIRED),
           AttrSpec("pool_int64s", AttrKind.INTS, None),
           AttrSpec("pool_strings", AttrKind.STRS, None),
           AttrSpec("weights", AttrKind.FLOATS, None)),
    infer=_infer_tfidf,
    doc="ONNX TfIdfVectorizer: counts of the pool's n-grams (with skips) in each row of X "
        "(C,) or (B, C), weighted by mode TF, IDF or TFIDF; float32 (…, max(ngram_indexes)+1).",
))
