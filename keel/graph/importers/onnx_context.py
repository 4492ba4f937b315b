"""The machinery ONNX op converters use: the converter table and the import context.

A converter turns one ONNX node into keel nodes (and maybe initializers)
through :meth:`ImportContext.emit`. Converters are registered per
``(op_type, since_version)``; the importer picks the newest one whose
``since_version`` is not newer than the model's opset, like an ONNX runtime
picks an op version.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.dtypes import NARROW_FLOATS, DType
from keel.errors import (
    InvalidArgumentError,
    KeelError,
    ModelFormatError,
    UnsupportedOperationError,
)
from keel.graph.ir import NO_ATTRS, Graph, Node, match_attr_name
from keel.graph.shape_inference import Propagation, propagate_node
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, OpSchema, get_schema
from keel.ops.types import TensorType

__all__ = [
    "NARROW_NATIVE",
    "Converter",
    "ConverterTable",
    "ImportContext",
    "OnnxNode",
    "onnx_default",
    "onnx_schema",
]


@dataclass(slots=True)
class OnnxNode:
    """One ONNX node with its attributes decoded to Python values."""

    name: str
    op_type: str
    domain: str
    inputs: Sequence[str]       # read only: tuples from the importer (smaller than lists)
    outputs: Sequence[str]
    # Read only (a node without attributes shares one empty mapping).
    attrs: Mapping[str, Any] = field(default_factory=dict)
    # Values of enclosing scopes its subgraph attributes read (they order the nodes too).
    implicit: Sequence[str] = ()

    def input(self, index: int) -> str:
        return self.inputs[index] if index < len(self.inputs) else ""

    def output(self, index: int) -> str:
        return self.outputs[index] if index < len(self.outputs) else ""


Converter = Callable[["ImportContext", OnnxNode], None]
# (the enclosing context, an ONNX GraphProto, the types its formal inputs take) -> Graph
SubgraphImporter = Callable[["ImportContext", Any, Sequence[TensorType | None]], Graph]

# Ops that take the narrow ml_dtypes types (bfloat16, float8, float4, 4- and 2-bit
# integers) as they are. Every other op computes in a wide type: the importer casts
# narrow inputs up (floats to float32, integers to int8/uint8) and the results back.
NARROW_NATIVE = frozenset({Op.CAST, Op.QUANTIZE_LINEAR, Op.DEQUANTIZE_LINEAR, Op.BITCAST,
                           Op.IDENTITY, Op.SHAPE, Op.SIZE})


class ConverterTable:
    """Converters by ONNX op_type and the opset version they implement."""

    def __init__(self) -> None:
        self._impls: dict[str, dict[int, Converter]] = {}

    def register(self, op_type: str, since: int, fn: Converter, *,
                 replace: bool = False) -> None:
        """Add ``fn`` for ``op_type`` from opset ``since``; ``replace`` overrides one there."""
        versions = self._impls.setdefault(op_type, {})
        if since in versions and not replace:
            raise ValueError(f"converter {op_type}-{since} registered twice")
        versions[since] = fn

    def converts(self, *op_types: str, since: int) -> Callable[[Converter], Converter]:
        """Decorator: ``@TABLE.converts("Squeeze", since=13)``."""
        def wrap(fn: Converter) -> Converter:
            for op_type in op_types:
                self.register(op_type, since, fn)
            return fn
        return wrap

    def op_types(self) -> list[str]:
        return sorted(self._impls)

    def versions(self, op_type: str) -> list[int]:
        return sorted(self._impls.get(op_type, {}))

    def lookup(self, op_type: str, opset: int) -> Converter | None:
        """The newest converter with ``since <= opset``; None when there is none."""
        versions = self._impls.get(op_type, {})
        usable = [v for v in versions if v <= opset]
        return versions[max(usable)] if usable else None


class ImportContext:
    """What a converter may read and write while one ONNX graph is imported."""

    def __init__(self, opset: int, declared: Mapping[str, TensorType],
                 overridable: Iterable[str], *,
                 domain_opsets: Mapping[str, int] | None = None) -> None:
        self.opset = opset
        self.domain_opsets = dict(domain_opsets or {})
        self.nodes: list[Node] = []
        self.initializers: dict[str, np.ndarray] = {}
        self.state = Propagation()
        self.declared = dict(declared)
        self.overridable = set(overridable)
        # Value names in use, and node names: ONNX's own (made unique beforehand) and new ones.
        # None until first needed once :meth:`defer_names` is called (see there).
        self._taken: set[str] | None = set()
        self._node_names: set[str] | None = set()
        self._pending: Sequence[OnnxNode] = ()
        self.current = OnnxNode("", "", "", [], [])
        self._emitted = 0
        # Imports a subgraph attribute (set by the importer; see :meth:`subgraph`).
        self.subgraph_importer: SubgraphImporter | None = None
        # A subgraph's types are a hint: a branch not taken for these shapes may not type.
        self.lenient = False

    # ---- reading -------------------------------------------------------
    def opset_of(self, domain: str) -> int:
        """The model's opset of ``domain`` (the default domain's for "" and "ai.onnx")."""
        return self.domain_opsets.get(domain, self.opset) if domain not in ("", "ai.onnx") \
            else self.opset

    def type_of(self, name: str) -> TensorType | None:
        return self.state.types.get(name) if name else None

    def dtype_of(self, name: str) -> DType | None:
        t = self.type_of(name)
        return None if t is None else t.dtype

    def rank_of(self, name: str) -> int | None:
        t = self.type_of(name)
        return None if t is None else t.rank

    def const(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when it is known at import time (and not overridable)."""
        if not name or name in self.overridable:
            return None
        return self.state.values.get(name, self.initializers.get(name))

    def subgraph(self, attr: str, formal: Sequence[TensorType | None] = ()) -> Graph:
        """The current node's graph attribute ``attr`` imported as a keel Graph whose formal
        inputs take ``formal`` where the subgraph declares no type; it may read this
        context's values (see :mod:`keel.graph.subgraphs`)."""
        proto = self.current.attrs.get(attr)
        if proto is None or self.subgraph_importer is None:
            raise self.invalid(f"missing graph attribute {attr!r}")
        return self.subgraph_importer(self, proto, formal)

    # ---- names ---------------------------------------------------------
    def defer_names(self, pending: Sequence[OnnxNode]) -> None:
        """Build the sets of names in use only when a converter first needs one.

        ``pending`` is the list of ONNX nodes still to convert, which the importer empties
        as it goes. Most converters emit one node under ONNX's names and never ask: a large
        graph then holds no second copy of its names (two sets of 100,000 strings are a
        few megabytes). When asked, the sets are made from what is defined so far (the
        propagated types, the emitted nodes), the node being converted and ``pending``.
        """
        self._taken = self._node_names = None
        self._pending = pending

    def forget_names(self) -> None:
        """Drop the name sets (the import is done with them)."""
        self._taken, self._node_names, self._pending = set(), set(), ()

    @property
    def taken(self) -> set[str]:
        """The value names in use, ONNX's and new ones (shared with subgraph scopes)."""
        if self._taken is None:
            taken = set(self.state.types)
            taken.update(self.initializers)
            for n in (self.current, *self._pending):
                taken.update(n.inputs)
                taken.update(n.outputs)
            taken.discard("")
            self._taken = taken
        return self._taken

    @taken.setter
    def taken(self, names: set[str]) -> None:
        self._taken = names

    @property
    def node_names(self) -> set[str]:
        """The node names in use: ONNX's (made unique beforehand) and those emitted."""
        if self._node_names is None:
            self._node_names = {n.name for n in self.nodes}
            self._node_names.update(n.name for n in (self.current, *self._pending))
        return self._node_names

    # ---- writing -------------------------------------------------------
    def fresh(self, base: str) -> str:
        stem = base or "v"
        for i in range(len(self.taken) + 2):
            cand = f"{stem}_{i}" if i else stem
            if cand not in self.taken:
                self.taken.add(cand)
                return cand
        raise AssertionError("unreachable")

    def add_initializer(self, name: str, array: np.ndarray) -> str:
        """Store a constant under ``name`` (which must be new)."""
        arr = np.asarray(array)
        self.initializers[name] = arr
        if self._taken is not None:     # else the initializers hold it
            self._taken.add(name)
        self.state.values[name] = arr
        self.state.types[name] = _array_type(arr)
        return name

    def constant(self, array: Any, hint: str = "const") -> str:
        """A new initializer holding ``array``; returns its name."""
        base = f"{self.current.name}/{hint}" if self.current.name else hint
        return self.add_initializer(self.fresh(base), np.asarray(array))

    def emit(self, op: Op, inputs: Sequence[str], outputs: Sequence[str],
             attrs: Mapping[str, Any] | None = None, *,
             implied: Iterable[str] = ()) -> Node:
        """Add a keel node; ``attrs`` may use ONNX spellings and are checked by the schema.

        ONNX attributes the keel schema does not know are accepted only when
        they hold ONNX's default (or are listed in ``implied``: facts the node
        carries otherwise, like Split's ``num_outputs``); any other value means
        keel cannot honour the model, an ``UnsupportedOperationError``.
        """
        schema = self._schema(op)
        ins = _trim(list(inputs))
        outs = _trim(list(outputs))
        if op not in NARROW_NATIVE and any(self._narrow(i) for i in ins):
            return self._emit_widened(op, ins, outs, attrs, implied)
        try:
            schema.check_arity(len(ins), len(outs))
        except InvalidArgumentError as exc:
            raise self.invalid(exc.message) from None
        norm = self._attrs(schema, dict(attrs or {}), set(implied))
        node = Node(self._node_name(), op, ins, outs, norm or NO_ATTRS,
                    origin=self.current.op_type)
        self.nodes.append(node)
        if self._taken is not None:     # else the propagated types hold the outputs
            self._taken.update(o for o in outs if o)
        self._infer(node)
        return node

    def _narrow(self, name: str) -> DType | None:
        dtype = self.dtype_of(name)
        return dtype if dtype is not None and dtype.is_narrow else None

    def _emit_widened(self, op: Op, ins: list[str], outs: list[str],
                      attrs: Mapping[str, Any] | None, implied: Iterable[str]) -> Node:
        """``op`` on narrow inputs: cast them up, run ``op`` wide, cast its results back to
        the first narrow input's type (results of another type pass through)."""
        narrow = next(d for d in map(self._narrow, ins) if d is not None)
        wide_ins = [self._widen(name) for name in ins]
        wide_outs = [self.fresh(f"{o}/wide") if o else "" for o in outs]
        node = self.emit(op, wide_ins, wide_outs, attrs, implied=implied)
        for wide, name in zip(wide_outs, outs, strict=True):
            if not name:
                continue
            dtype = self.dtype_of(wide)
            if dtype is not None and dtype is _wide_type(narrow):
                self.emit(Op.CAST, [wide], [name], {"to": narrow})
            else:
                self.emit(Op.IDENTITY, [wide], [name])
        return node

    def _widen(self, name: str) -> str:
        dtype = self._narrow(name)
        if dtype is None:
            return name
        wide = self.fresh(f"{name}/wide")
        self.emit(Op.CAST, [name], [wide], {"to": _wide_type(dtype)})
        return wide

    # ---- errors --------------------------------------------------------
    def unsupported(self, detail: str) -> UnsupportedOperationError:
        n = self.current
        return UnsupportedOperationError(n.op_type, detail=f"node {n.name!r}: {detail}")

    def invalid(self, detail: str) -> ModelFormatError:
        n = self.current
        return ModelFormatError(f"node {n.name!r} ({n.op_type}): {detail}")

    # ---- internals -----------------------------------------------------
    @contextmanager
    def nested(self) -> Iterator[None]:
        """Convert other ONNX nodes from inside a converter (a subgraph imported in place);
        afterwards the current node and the naming of its keel nodes continue."""
        current, emitted = self.current, self._emitted
        self.taken.update(current.outputs)      # the sets hold the outer node's names
        self.node_names.add(current.name)
        try:
            yield
        finally:
            self.current, self._emitted = current, emitted

    def begin(self, node: OnnxNode) -> None:
        self.current = node
        self._emitted = 0

    def _node_name(self) -> str:
        base = self.current.name
        self._emitted += 1
        name = base if self._emitted == 1 else f"{base}/{self._emitted - 1}"
        k = self._emitted
        while self._emitted > 1 and name in self.node_names:
            name = f"{base}/{k}"
            k += 1
        if self._node_names is not None:     # else the emitted nodes hold it
            self._node_names.add(name)
        return name

    def _schema(self, op: Op) -> OpSchema:
        try:
            return get_schema(op)
        except UnsupportedOperationError:
            raise self.unsupported(f"keel's op {op.value!r} has no schema yet") from None

    def _attrs(self, schema: OpSchema, given: dict[str, Any],
               implied: set[str]) -> dict[str, Any]:
        names = [a.name for a in schema.attrs]
        kinds = {a.name: a.kind for a in schema.attrs}
        mapped: dict[str, Any] = {}
        for key, value in given.items():
            target = match_attr_name(key, names)
            if target is not None:
                mapped[target] = self._dtype_code(value) if kinds[target] is AttrKind.DTYPE \
                    else value
            elif key in implied:
                continue
            elif not self._onnx_knows(key):
                raise self.invalid(f"{key!r} is not an attribute of {self.current.op_type} "
                                   f"at opset {self.opset}")
            elif not self._is_default(key, value):
                raise self.unsupported(
                    f"attribute {key}={value!r} has no equivalent in keel's {schema.name}; "
                    f"keel's attributes: {', '.join(names) or 'none'}"
                )
        for spec in schema.attrs:
            if spec.default is REQUIRED and spec.name not in mapped:
                raise self.invalid(f"missing required attribute {spec.name!r}")
        try:
            return schema.normalize_attrs(mapped)
        except InvalidArgumentError as exc:
            raise self.invalid(exc.message) from None

    def _dtype_code(self, value: Any) -> Any:
        """ONNX gives element types as TensorProto codes (``to=1``); keel as DType."""
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            from keel.graph.importers.onnx_tensors import element_dtype

            return element_dtype(int(value), f"node {self.current.name!r}")
        return value

    def _onnx_knows(self, key: str) -> bool:
        schema = onnx_schema(self.current, self.opset_of(self.current.domain))
        return schema is not None and key in schema.attributes

    def _is_default(self, key: str, value: Any) -> bool:
        default = onnx_default(self.current, self.opset_of(self.current.domain), key)
        return default is not _NO_DEFAULT and _same(value, default)

    def _infer(self, node: Node) -> None:
        try:
            propagate_node(node, self.state, self.declared)
        except InvalidArgumentError as exc:  # its message names the node already
            if self.lenient:
                for o in node.outputs:
                    if o:
                        self.state.types[o] = self.declared.get(o)
                return
            raise ModelFormatError(f"{exc.message} (from ONNX {self.current.op_type})") \
                from None


def _wide_type(narrow: DType) -> DType:
    """Where keel computes a narrow type: float32, or int8 / uint8 for the small integers."""
    if narrow in NARROW_FLOATS:
        return DType.FLOAT32
    return DType.INT8 if narrow.value.startswith("int") else DType.UINT8


def _trim(names: list[str]) -> list[str]:
    while names and not names[-1]:
        names.pop()
    return names


def _array_type(arr: np.ndarray) -> TensorType | None:
    try:
        return TensorType(DType.from_numpy(arr.dtype), tuple(int(d) for d in arr.shape))
    except KeelError:
        return None


_NO_DEFAULT: Any = object()


def onnx_schema(node: OnnxNode, opset: int) -> Any:
    """ONNX's schema of ``node``'s op at ``opset``, or None (custom domain, unknown op)."""
    return _onnx_schema(node.op_type, opset, node.domain or "")


@functools.lru_cache(maxsize=512)
def _onnx_schema(op_type: str, opset: int, domain: str) -> Any:
    """ONNX's schemas, asked once per op and opset (a large graph repeats a few ops)."""
    import onnx.defs

    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except Exception:  # onnx raises its own SchemaError type; any failure means "none"
        return None


def onnx_default(node: OnnxNode, opset: int, key: str) -> Any:
    """ONNX's default for attribute ``key`` of ``node`` at ``opset`` (``_NO_DEFAULT`` if none)."""
    import onnx.helper

    schema = onnx_schema(node, opset)
    if schema is None:
        return _NO_DEFAULT
    spec = schema.attributes.get(key)
    if spec is None or not spec.default_value.type:
        return _NO_DEFAULT
    return onnx.helper.get_attribute_value(spec.default_value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bytes):
        a = a.decode("utf-8", "replace")
    if isinstance(b, bytes):
        b = b.decode("utf-8", "replace")
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or not isinstance(b, (list, tuple)):
            return False
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-7, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return False
    return bool(a == b)
