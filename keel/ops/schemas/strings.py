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

__all__ = ["CASE_ACTIONS", "STRINGS", "check_normalizer_shape", "compile_pattern"]

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
