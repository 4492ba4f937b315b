"""Reference kernels of the string family: Python's ``str`` methods over object arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.ops.registry import Op
from keel.ops.schemas.strings import (
    STRINGS,
    TFIDF_INPUTS,
    check_normalizer_shape,
    check_tfidf_shape,
    compile_pattern,
    tfidf_pool,
)

__all__: list[str] = []


def _strings(values: Any, shape: tuple[int, ...]) -> np.ndarray:
    """An object array of ``shape`` holding ``values`` (a flat iterable of str)."""
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out.reshape(shape)


@TABLE.kernel(Op.STRING_CONCAT, dtypes=STRINGS)
def string_concat(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """x + y, broadcast."""
    x, y = np.broadcast_arrays(inputs[0], inputs[1])
    joined = [str(a) + str(b) for a, b in zip(x.reshape(-1), y.reshape(-1), strict=True)]
    return [_strings(joined, x.shape)]


@TABLE.kernel(Op.STRING_SPLIT, dtypes=STRINGS)
def string_split(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The pieces of each string, padded with '' to the longest count, and the counts."""
    x = inputs[0]
    sep = attrs["delimiter"] or None
    most = -1 if attrs["maxsplit"] is None else attrs["maxsplit"]
    pieces = [str(s).split(sep, most) for s in x.reshape(-1)]
    counts = np.array([len(p) for p in pieces], dtype=np.int64).reshape(x.shape)
    width = max((len(p) for p in pieces), default=0)
    padded = [piece for p in pieces for piece in p + [""] * (width - len(p))]
    return [_strings(padded, (*x.shape, width)), counts]


@TABLE.kernel(Op.STRING_NORMALIZER, dtypes=STRINGS)
def string_normalizer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Drop the stopwords, then change case; one '' when nothing is left."""
    x = inputs[0]
    check_normalizer_shape(x.shape)
    sensitive = attrs["is_case_sensitive"]
    stops = {w if sensitive else w.lower() for w in attrs["stopwords"]}
    kept = [str(s) for s in x.reshape(-1) if (str(s) if sensitive else str(s).lower())
            not in stops]
    action = attrs["case_change_action"]
    if action == "LOWER":
        kept = [s.lower() for s in kept]
    elif action == "UPPER":
        kept = [s.upper() for s in kept]
    kept = kept or [""]
    return [_strings(kept, (*x.shape[:-1], len(kept)))]


@TABLE.kernel(Op.REGEX_FULL_MATCH, dtypes=STRINGS)
def regex_full_match(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Whether each string matches ``pattern`` whole."""
    x = inputs[0]
    regex = compile_pattern(attrs["pattern"])
    found = [regex.fullmatch(str(s)) is not None for s in x.reshape(-1)]
    return [np.array(found, dtype=bool).reshape(x.shape)]


@TABLE.kernel(Op.TFIDF_VECTORIZER, dtypes=TFIDF_INPUTS)
def tfidf_vectorizer(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """n-gram counts per row (each skip distance; 1-grams once), then the mode's weights."""
    x = inputs[0]
    check_tfidf_shape(x.shape)
    grams = tfidf_pool(attrs)
    width = max(attrs["ngram_indexes"]) + 1
    rows = x.reshape(-1, x.shape[-1])
    counts = np.zeros((rows.shape[0], width), np.float32)
    lo, hi = attrs["min_gram_length"], attrs["max_gram_length"]
    for r, row in enumerate(rows):
        items = [str(v) for v in row] if x.dtype == object else [int(v) for v in row]
        for skip in range(1, attrs["max_skip_count"] + 2):
            for size in range(max(lo, 1 if skip == 1 else 2), hi + 1):
                for start in range(len(items) - (size - 1) * skip):
                    column = grams.get(tuple(items[start:start + (size - 1) * skip + 1:skip]))
                    if column is not None:
                        counts[r, column] += 1
    return [_weighted(counts, attrs).reshape(*x.shape[:-1], width)]


def _weighted(counts: np.ndarray, attrs: Attrs) -> np.ndarray:
    weights = np.asarray(attrs["weights"] or (), np.float32)
    if attrs["mode"] == "TF":
        return counts
    if attrs["mode"] == "IDF":
        return np.where(counts > 0, weights if weights.size else np.float32(1), np.float32(0))
    return counts * weights if weights.size else counts
