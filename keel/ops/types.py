"""Tensor types and checked shape arithmetic.

A dimension is an ``int`` when known, a ``str`` when symbolic (``"batch"``)
and ``None`` when unknown. Products of user-controlled dimensions are
checked: an overflow is an :class:`InvalidArgumentError`, never a wrap.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from keel.dtypes import DType
from keel.errors import InvalidArgumentError

__all__ = [
    "MAX_ELEMENTS",
    "Dim",
    "Shape",
    "TensorType",
    "ValueKind",
    "broadcast_shapes",
    "checked_numel",
    "normalize_axis",
]

Dim = int | str | None
Shape = tuple[Dim, ...]

# Largest element count keel accepts for one tensor (2**62: far past any real
# memory, well inside int64 so byte counts cannot wrap either).
MAX_ELEMENTS = 2**62


class ValueKind(str, Enum):
    """What a value holds: a tensor, a sequence (list) of tensors, or an optional one."""

    TENSOR = "tensor"
    SEQUENCE = "sequence"
    OPTIONAL = "optional"                    # an optional tensor: the tensor or None
    OPTIONAL_SEQUENCE = "optional_sequence"  # an optional sequence: a list or None


@dataclass(frozen=True)
class TensorType:
    """A tensor's dtype and (possibly symbolic) shape.

    A sequence or optional value (``kind``) has the dtype and shape of its
    elements; it has no static shape or size of its own.
    """

    dtype: DType
    shape: Shape | None          # None: rank unknown
    kind: ValueKind = ValueKind.TENSOR

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def is_tensor(self) -> bool:
        return self.kind is ValueKind.TENSOR

    @property
    def is_static(self) -> bool:
        return (self.kind is ValueKind.TENSOR and self.shape is not None
                and all(isinstance(d, int) for d in self.shape))

    def element(self) -> TensorType:
        """The type of one element (of a sequence) or of the held value (of an optional)."""
        return TensorType(self.dtype, self.shape)

    def as_kind(self, kind: ValueKind) -> TensorType:
        return TensorType(self.dtype, self.shape, kind)

    def numel(self) -> int | None:
        if not self.is_static:
            return None
        return checked_numel(self.shape)  # type: ignore[arg-type]

    def nbytes(self) -> int | None:
        n = self.numel()
        return None if n is None else n * self.dtype.itemsize

    def __str__(self) -> str:
        dims = "?" if self.shape is None else ", ".join("?" if d is None else str(d)
                                                       for d in self.shape)
        text = f"{self.dtype.value}[{dims}]"
        if self.kind is ValueKind.SEQUENCE:
            return f"seq({text})"
        if self.kind is ValueKind.OPTIONAL:
            return f"optional({text})"
        if self.kind is ValueKind.OPTIONAL_SEQUENCE:
            return f"optional(seq({text}))"
        return text


def checked_numel(shape: Iterable[int], *, what: str = "shape") -> int:
    """The element count of ``shape``, checked for negatives and overflow."""
    total = 1
    dims = tuple(shape)
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise InvalidArgumentError(f"{what} {dims} has a non-integer dimension {d!r}")
        if d < 0:
            raise InvalidArgumentError(f"{what} {dims} has a negative dimension {d}")
        total *= d
        if total > MAX_ELEMENTS:
            raise InvalidArgumentError(
                f"{what} {dims} has more than {MAX_ELEMENTS} elements (overflow)"
            )
    return total


def normalize_axis(axis: int, rank: int, *, what: str = "axis") -> int:
    """Map a possibly negative axis into ``[0, rank)``; out of range is an error."""
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise InvalidArgumentError(f"{what} must be an int, got {axis!r}")
    if not -rank <= axis < max(rank, 1):
        raise InvalidArgumentError(
            f"{what} {axis} is out of range for rank {rank}; allowed: {-rank}..{rank - 1}"
        )
    return axis + rank if axis < 0 else axis


def broadcast_shapes(*shapes: Sequence[Dim]) -> Shape:
    """NumPy broadcasting over possibly symbolic shapes."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(-rank, 0):
        dims = [s[i] for s in shapes if len(s) >= -i]
        out.append(_broadcast_dim(dims, shapes))
    return tuple(out)


def _broadcast_dim(dims: list[Dim], shapes: Sequence[Sequence[Dim]]) -> Dim:
    known = {d for d in dims if isinstance(d, int) and d != 1}
    if len(known) > 1:
        raise InvalidArgumentError(
            f"shapes {', '.join(str(tuple(s)) for s in shapes)} cannot be broadcast together"
        )
    if known:
        return known.pop()
    symbolic = [d for d in dims if not isinstance(d, int)]
    if not symbolic:
        return 1
    names = set(symbolic)
    return names.pop() if len(names) == 1 and None not in names else None


@dataclass(frozen=True)
class TensorInfo:
    """A model input or output: name, shape (ints, symbolic names, None) and dtype; a
    sequence or optional value's ``kind`` says so (its shape and dtype are its
    elements')."""

    name: str
    shape: tuple[Dim, ...] | None
    dtype: DType
    kind: ValueKind = ValueKind.TENSOR

    def __repr__(self) -> str:
        kind = "" if self.kind is ValueKind.TENSOR else f", kind={self.kind!r}"
        return (f"TensorInfo(name={self.name!r}, shape={self.shape!r}, "
                f"dtype={self.dtype!r}{kind})")

    def to_dict(self) -> dict[str, Any]:
        shape = None if self.shape is None else list(self.shape)
        kind = {} if self.kind is ValueKind.TENSOR else {"kind": self.kind.value}
        return {"name": self.name, "shape": shape, "dtype": self.dtype.value, **kind}
