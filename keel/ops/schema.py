"""Op schemas: arity, typed attributes with defaults, and type inference.

One schema per op, registered with :func:`register_schema` from the family
modules in ``keel/ops/schemas/``. Backends and the graph use the same schema:
``normalize_attrs`` checks what a caller gave, ``infer`` gives output types.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.dtypes import DType, as_dtype
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = [
    "REQUIRED",
    "AttrKind",
    "AttrSpec",
    "InferFn",
    "OpSchema",
    "all_schemas",
    "get_schema",
    "register_schema",
]


class AttrKind(str, enum.Enum):
    INT = "int"
    FLOAT = "float"
    STR = "str"
    BOOL = "bool"
    INTS = "ints"
    FLOATS = "floats"
    STRS = "strs"
    DTYPE = "dtype"
    TENSOR = "tensor"      # a NumPy array (e.g. ConstantOfShape's value)
    ANY = "any"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class AttrSpec:
    name: str
    kind: AttrKind
    default: Any = None      # REQUIRED: must be given; None: optional, absent

    def convert(self, value: Any, op: str) -> Any:
        try:
            return _CONVERTERS[self.kind](value)
        except (TypeError, ValueError, InvalidArgumentError):
            raise InvalidArgumentError(
                f"attribute {self.name!r} of {op} must be {self.kind.value}, got {value!r}"
            ) from None


def _ints(v: Any) -> tuple[int, ...]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return (int(v),)
    return tuple(_int(x) for x in v)


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        if isinstance(v, (float, np.floating)) and float(v).is_integer():
            return int(v)
        raise TypeError(v)
    return int(v)


def _bool(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)) and int(v) in (0, 1):
        return bool(v)
    raise TypeError(v)


_CONVERTERS: dict[AttrKind, Callable[[Any], Any]] = {
    AttrKind.INT: _int,
    AttrKind.FLOAT: lambda v: float(v),
    AttrKind.STR: lambda v: v.decode() if isinstance(v, bytes) else str(v),
    AttrKind.BOOL: _bool,
    AttrKind.INTS: _ints,
    AttrKind.FLOATS: lambda v: tuple(float(x) for x in (v if hasattr(v, "__iter__") else [v])),
    AttrKind.STRS: lambda v: tuple(x.decode() if isinstance(x, bytes) else str(x) for x in v),
    AttrKind.DTYPE: as_dtype,
    AttrKind.TENSOR: lambda v: np.asarray(v),
    AttrKind.ANY: lambda v: v,
}

# (input types, normalized attrs, constant input values or None) -> output types.
# A type may be None when unknown (data-dependent or unknown input).
InferFn = Callable[
    [Sequence[TensorType | None], Mapping[str, Any], Sequence[np.ndarray | None]],
    Sequence[TensorType | None],
]


@dataclass(frozen=True)
class OpSchema:
    """What an op takes and gives, independent of any backend."""

    op: Op
    min_inputs: int
    max_inputs: int | None            # None: variadic
    attrs: tuple[AttrSpec, ...] = ()
    infer: InferFn | None = None
    min_outputs: int = 1
    max_outputs: int = 1
    # Pairs (input index, output index) where the output may reuse the input buffer.
    inplace: tuple[tuple[int, int], ...] = ()
    # Input indices whose *values* (not only types) shape the output (Reshape's shape).
    value_inputs: tuple[int, ...] = ()
    doc: str = ""
    _by_name: dict[str, AttrSpec] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({a.name: a for a in self.attrs})

    @property
    def name(self) -> str:
        return self.op.value

    def check_arity(self, n_inputs: int, n_outputs: int | None = None) -> None:
        hi = "any" if self.max_inputs is None else str(self.max_inputs)
        if n_inputs < self.min_inputs or (self.max_inputs is not None
                                          and n_inputs > self.max_inputs):
            raise InvalidArgumentError(
                f"{self.name} takes {self.min_inputs}..{hi} inputs, got {n_inputs}"
            )
        if n_outputs is not None and not self.min_outputs <= n_outputs <= self.max_outputs:
            raise InvalidArgumentError(
                f"{self.name} gives {self.min_outputs}..{self.max_outputs} outputs, "
                f"got {n_outputs}"
            )

    def normalize_attrs(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Check names and types, fill defaults; unknown or missing → InvalidArgumentError."""
        unknown = sorted(set(given) - set(self._by_name))
        if unknown:
            allowed = ", ".join(self._by_name) or "none"
            raise InvalidArgumentError(
                f"unknown attribute {unknown[0]!r} for {self.name}; allowed: {allowed}"
            )
        out: dict[str, Any] = {}
        for spec in self.attrs:
            if spec.name in given and given[spec.name] is not None:
                out[spec.name] = spec.convert(given[spec.name], self.name)
            elif spec.default is REQUIRED:
                raise InvalidArgumentError(
                    f"{self.name} requires attribute {spec.name!r} ({spec.kind.value})"
                )
            else:
                out[spec.name] = spec.default
        return out

    def infer_types(
        self,
        inputs: Sequence[TensorType | None],
        attrs: Mapping[str, Any],
        values: Sequence[np.ndarray | None] | None = None,
    ) -> list[TensorType | None]:
        """Output types; ``None`` entries where they cannot be known before running."""
        if self.infer is None:
            return [None] * self.min_outputs
        vals = list(values) if values is not None else [None] * len(inputs)
        return list(self.infer(inputs, attrs, vals))


class _SchemaRegistry:
    def __init__(self) -> None:
        self._schemas: dict[Op, OpSchema] = {}
        self._loaded = False

    def register(self, schema: OpSchema) -> OpSchema:
        if schema.op in self._schemas:
            raise ValueError(f"schema for {schema.op.value} registered twice")
        self._schemas[schema.op] = schema
        return schema

    def registered(self) -> frozenset[Op]:
        """The ops registered so far (no family is imported to answer)."""
        return frozenset(self._schemas)

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            from keel.ops import schemas

            schemas.load_all()

    def get(self, op: Op) -> OpSchema:
        """``op``'s schema; its family module is imported when it is first asked for."""
        found = self._schemas.get(op)
        return found if found is not None else self._load_for(op)

    def _load_for(self, op: Op) -> OpSchema:
        from keel.ops import schemas

        module = schemas.module_of(op.value) if isinstance(op, Op) else None
        if module is not None:
            importlib.import_module(module)
        if op not in self._schemas:             # an op the table does not name: every family
            self._load()
        try:
            return self._schemas[op]
        except KeyError:
            raise UnsupportedOperationError(getattr(op, "value", str(op)),
                                            detail="no schema") from None

    def all(self) -> dict[Op, OpSchema]:
        self._load()
        return dict(self._schemas)


_REGISTRY = _SchemaRegistry()
register_schema = _REGISTRY.register
get_schema = _REGISTRY.get
all_schemas = _REGISTRY.all


def same_dtype(types: Sequence[TensorType | None]) -> DType | None:
    """The dtype shared by all known inputs (first known if they differ)."""
    for t in types:
        if t is not None:
            return t.dtype
    return None
