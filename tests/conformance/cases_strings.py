"""Conformance cases of the string family: concatenation with broadcasting, splits on
a delimiter or whitespace with and without maxsplit (empty strings and tensors too),
normalization with stopwords and case changes, full regular-expression matches,
TfIdfVectorizer in its three modes with and without skips, on ints and strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

WORDS = ("alpha", "Beta", "gamma", "", "δέλτα", "the", "The", "a b  c", "x,y,,z", "1-2-3")
# StringNormalizer's inputs: single words without accents. ONNX's spec drops whole
# elements only; onnx's reference evaluator also strips accents, removes stopwords
# inside multi-word strings and drops empty strings, which keel (following the spec)
# does not, so inputs where the two would differ are left out of these cases.
TOKENS = ("alpha", "Beta", "gamma", "The", "the", "GAMMA", "delta", "x1", "Ubel", "y")


def _strings(shape: Sequence[int], pool: Sequence[str] = WORDS) -> np.ndarray:
    values = np.empty(int(np.prod(shape)), dtype=object)
    values[:] = [pool[i % len(pool)] for i in range(values.size)]
    return values.reshape(tuple(shape))


def _given(*arrays: np.ndarray) -> Make:
    return lambda rng: [a.copy() for a in arrays]


def _shuffled(shape: Sequence[int]) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        flat = _strings(shape).reshape(-1)
        return [flat[rng.permutation(flat.size)].reshape(tuple(shape))]
    return make


CASES: list[OpCase] = [
    OpCase("string_concat", Op.STRING_CONCAT,
           lambda rng: [*_shuffled((2, 3))(rng), *_shuffled((2, 3))(rng)]),
    OpCase("string_concat-broadcast", Op.STRING_CONCAT,
           _given(_strings((2, 3)), _strings((3,), ("-x", "", "ü")))),
    OpCase("string_concat-scalar", Op.STRING_CONCAT,
           _given(_strings(()), _strings((4,)))),
    OpCase("string_split-whitespace", Op.STRING_SPLIT, _given(_strings((2, 5)))),
    OpCase("string_split-comma", Op.STRING_SPLIT, _given(_strings((10,))),
           {"delimiter": ","}),
    OpCase("string_split-maxsplit", Op.STRING_SPLIT, _given(_strings((10,))),
           {"delimiter": "-", "maxsplit": 1}),
    OpCase("string_split-empty", Op.STRING_SPLIT, _given(_strings((0, 2)))),
    OpCase("string_normalizer-lower-stopwords", Op.STRING_NORMALIZER,
           _given(_strings((10,), TOKENS)),
           {"case_change_action": "LOWER", "stopwords": ("the", "gamma")}),
    OpCase("string_normalizer-case-sensitive", Op.STRING_NORMALIZER,
           _given(_strings((1, 10), TOKENS)),
           {"case_change_action": "UPPER", "is_case_sensitive": True, "stopwords": ("the",)}),
    OpCase("string_normalizer-all-dropped", Op.STRING_NORMALIZER,
           _given(_strings((1, 2), ("x", "X"))),
           {"case_change_action": "LOWER", "stopwords": ("x",)}),
    OpCase("regex_full_match", Op.REGEX_FULL_MATCH, _given(_strings((2, 5))),
           {"pattern": r"[a-z]+"}),
    OpCase("regex_full_match-digits", Op.REGEX_FULL_MATCH, _given(_strings((10,))),
           {"pattern": r"\d(-\d)*"}),
    *(OpCase(f"tfidf_vectorizer-{mode}-skip{skip}", Op.TFIDF_VECTORIZER,
             _given(np.array([[1, 1, 3, 3, 3, 7], [8, 6, 7, 5, 6, 8]], np.int32)),
             {"max_gram_length": 2, "max_skip_count": skip, "min_gram_length": 1,
              "mode": mode, "ngram_counts": (0, 4), "ngram_indexes": tuple(range(7)),
              "pool_int64s": (2, 3, 5, 4, 5, 6, 7, 8, 6, 7),
              "weights": (0.5, 1.0, 2.0, 0.25, 1.5, 3.0, 1.0)})
      for mode in ("TF", "IDF", "TFIDF") for skip in (0, 2)),
    OpCase("tfidf_vectorizer-strings-bigrams", Op.TFIDF_VECTORIZER,
           _given(_strings((7,), ("a", "b", "a", "b", "c", "b", "c"))),
           {"max_gram_length": 2, "max_skip_count": 1, "min_gram_length": 2, "mode": "TF",
            "ngram_counts": (0, 2), "ngram_indexes": (0, 1, 2, 3),
            "pool_strings": ("a", "c", "a", "b", "b", "c")}),
]
