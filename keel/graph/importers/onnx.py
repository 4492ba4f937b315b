"""ONNX model → keel :class:`~keel.graph.ir.Graph`.

The importer reads a path, bytes or a ``ModelProto``; checks everything a
hostile file could get wrong (undecodable bytes, impossible sizes, dangling or
twice-defined values, cycles, external data outside the model's directory);
sorts the nodes topologically; and converts each node with the converter for
its op picked by the rule *newest implementation whose since_version is not
newer than the model's opset* (see :mod:`keel.graph.importers.onnx_ops`).

Errors: a model keel cannot read is a :class:`ModelFormatError`; a well-formed
model using an op (or custom domain) keel lacks is an
:class:`UnsupportedOperationError` naming the node and op. No protobuf,
``IndexError`` or ``KeyError`` escapes.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

import numpy as np

from keel._files import read_regular
from keel.dtypes import DType
from keel.errors import (
    InvalidArgumentError,
    KeelError,
    ModelFormatError,
    UnsupportedOperationError,
    VerificationError,
)
from keel.graph.importers import onnx_control  # noqa: F401  (registers its converters)
from keel.graph.importers.onnx_context import Converter, ImportContext, OnnxNode, onnx_schema
from keel.graph.importers.onnx_ml import ML_DOMAIN, ML_TABLE
from keel.graph.importers.onnx_ms import MS_DOMAIN, MS_TABLE
from keel.graph.importers.onnx_ops import TABLE
from keel.graph.importers.onnx_preview import PREVIEW_DOMAIN, PREVIEW_TABLE, preview_opset
from keel.graph.importers.onnx_tensors import element_dtype, tensor_to_array
from keel.graph.importers.onnx_wire import SplitModel, split_model
from keel.graph.ir import Graph, Value
from keel.ops.registry import Op
from keel.ops.types import MAX_ELEMENTS, Dim, TensorType, ValueKind

__all__ = [
    "KEEL_DOMAIN",
    "MAX_MODEL_BYTES",
    "MIN_OPSET",
    "import_onnx",
    "load_model_proto",
    "max_opset",
    "supported_op_types",
]

MIN_OPSET = 7
# keel's own ops (fused forms, seed-001 ops) in exported models.
KEEL_DOMAIN = "ai.keel"
# Protobuf cannot hold more than 2 GiB; bigger weights live in external files.
MAX_MODEL_BYTES = 2**31 - 1
_DEFAULT_DOMAINS = ("", "ai.onnx")
_NO_ATTRS: Mapping[str, Any] = MappingProxyType({})


def max_opset() -> int:
    """The newest default-domain opset keel imports: the newest the onnx package knows."""
    import onnx.defs

    return int(onnx.defs.onnx_opset_version())


def import_onnx(src: str | os.PathLike[str] | bytes | Any, *,
                base_dir: str | os.PathLike[str] | None = None) -> Graph:
    """Import an ONNX model from a path, bytes or ``onnx.ModelProto``.

    External-data files are read relative to the model's directory (or
    ``base_dir`` for bytes and protos). Raises ``ModelFormatError`` for files
    keel cannot read and ``UnsupportedOperationError`` for ops keel lacks.
    """
    model, base, split = _load_split(src, base_dir)
    try:
        return _Importer(model, base, split).run()
    except (ModelFormatError, UnsupportedOperationError):
        raise
    except (InvalidArgumentError, VerificationError) as exc:
        raise ModelFormatError(f"invalid model: {exc.message}") from None
    except KeelError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError,
            UnicodeError, RecursionError, MemoryError) as exc:
        # The file parsed but holds something the checks above did not anticipate.
        raise ModelFormatError(f"invalid model: {type(exc).__name__}: {exc}") from None


def load_model_proto(src: str | os.PathLike[str] | bytes | Any,
                     base_dir: str | os.PathLike[str] | None = None) -> tuple[Any, Path | None]:
    """Parse ``src`` into a ``ModelProto``; returns it with the directory for external data."""
    import onnx

    if isinstance(src, onnx.ModelProto):
        return src, None if base_dir is None else Path(base_dir)
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _parse(bytes(src), "bytes"), None if base_dir is None else Path(base_dir)
    if isinstance(src, (str, os.PathLike)):
        path = Path(src)
        data = _read(path)
        return _parse(data, str(path)), Path(base_dir) if base_dir else path.parent
    raise InvalidArgumentError(
        f"a model is a path, bytes or onnx.ModelProto, got {type(src).__name__}"
    )


def _load_split(src: str | os.PathLike[str] | bytes | Any,
                base_dir: str | os.PathLike[str] | None,
                ) -> tuple[Any, Path | None, tuple[SplitModel, str] | None]:
    """Like :func:`load_model_proto`, with the graph's nodes left unparsed where the
    bytes allow (:mod:`keel.graph.importers.onnx_wire`): the model, the directory for
    external data, and the split with the name errors give the model."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        data, where = bytes(src), "bytes"
        base = None if base_dir is None else Path(base_dir)
    elif isinstance(src, (str, os.PathLike)):
        path = Path(src)
        data, where = _read(path), str(path)
        base = Path(base_dir) if base_dir else path.parent
    else:
        model, base = load_model_proto(src, base_dir)
        return model, base, None
    try:
        split = split_model(data)
    except Exception:  # protobuf's DecodeError and friends: the whole parse says what
        split = None
    if split is None:
        return _parse(data, where), base, None
    return split.model, base, (split, where)


def _read(path: Path) -> bytes:
    """The file's bytes: a regular file only (not a device, FIFO or folder), within the cap."""
    return read_regular(path, MAX_MODEL_BYTES,
                        why="an ONNX protobuf holds no more; larger weights go in external data")


def _parse(data: bytes, where: str) -> Any:
    import onnx

    if not data:
        raise ModelFormatError(f"model {where} is empty")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError and friends: any failure is "corrupt"
        raise ModelFormatError(
            f"model {where} is not a valid ONNX protobuf ({type(exc).__name__}: {exc})"
        ) from None
    if not model.HasField("graph"):
        raise ModelFormatError(f"model {where} has no graph (not an ONNX model?)")
    return model


# ---- the importer ---------------------------------------------------------------------
class _Importer:
    def __init__(self, model: Any, base_dir: Path | None,
                 split: tuple[SplitModel, str] | None = None) -> None:
        self.model = model
        self.split = split          # the top graph's nodes, parsed one at a time
        self.g = model.graph
        self.base_dir = base_dir
        self.ml_opset = _ml_opset(model)
        self.opset = _default_opset(model, self.ml_opset is not None)

    def run(self) -> Graph:
        initializers = self._initializers()
        inputs = self._inputs(initializers)
        declared = self._declared()
        nodes = self._nodes()
        self._check_definitions(nodes, inputs, initializers)
        nodes = _toposort(nodes, {v.name for v in inputs} | set(initializers))
        overridable = {v.name for v in inputs if v.name in initializers}
        ctx = ImportContext(self.opset, declared, overridable,
                            domain_opsets={ML_DOMAIN: self.ml_opset or 0,
                                           PREVIEW_DOMAIN: preview_opset(self.model)})
        ctx.subgraph_importer = self._subgraph
        self._seed(ctx, inputs, initializers, nodes)
        nodes.reverse()
        while nodes:            # each freed once converted
            _convert(ctx, nodes.pop())
        return self._graph(ctx, inputs, declared)

    def _subgraph(self, outer: ImportContext, proto: Any,
                  formal: Sequence[TensorType | None]) -> Graph:
        """A subgraph attribute as a keel Graph; it reads ``outer``'s values by name."""
        where = f"subgraph {proto.name or '?'!r} of node {outer.current.name!r}"
        initializers = self._initializers(proto)
        inputs = []
        for k, vi in enumerate(proto.input):
            _check_name(vi.name, f"input of {where}")
            t = _value_type(vi, f"input {vi.name!r} of {where}")
            t = t if t is not None else (formal[k] if k < len(formal) else None)
            if t is None:
                raise ModelFormatError(f"input {vi.name!r} of {where} has no type and keel "
                                       "cannot infer it")
            inputs.append(Value(vi.name, t))
        declared = self._declared(proto)
        nodes = self._nodes(proto)
        local = {v.name for v in inputs} | set(initializers)
        outside = [name for name in _free_names(proto) if name not in local]
        unknown = [name for name in outside if name not in outer.state.types]
        if unknown:
            raise ModelFormatError(f"{where} reads {unknown[0]!r}, which no enclosing graph "
                                   "defines before the node")
        self._check_definitions(nodes, inputs, initializers, proto, outside)
        nodes = _toposort(nodes, local | set(outside))
        ctx = ImportContext(self.opset, declared, outer.overridable,
                            domain_opsets=outer.domain_opsets)
        ctx.subgraph_importer = self._subgraph
        ctx.taken = outer.taken               # one namespace across scopes, as in ONNX
        ctx.lenient = True
        for name in outside:
            ctx.state.types[name] = outer.state.types[name]
            if name in outer.state.values:
                ctx.state.values[name] = outer.state.values[name]
        for name, arr in initializers.items():
            ctx.add_initializer(name, arr)
        for v in inputs:
            ctx.state.types[v.name] = v.type
            ctx.state.values.pop(v.name, None)
        ctx.node_names.update(n.name for n in nodes)
        for node in nodes:
            _convert(ctx, node)
        outputs = [Value(o.name, self._body_output_type(ctx, o.name, declared))
                   for o in proto.output]
        io = {v.name for v in inputs} | {o.name for o in outputs} | set(outside)
        types = {k: t for k, t in ctx.state.types.items()
                 if t is not None and k not in ctx.initializers and k not in io}
        return Graph(proto.name or "body", ctx.nodes, inputs, outputs, ctx.initializers,
                     types, self.opset)

    def _body_output_type(self, ctx: ImportContext, name: str,
                          declared: dict[str, TensorType]) -> TensorType:
        """A subgraph output's type; one that neither the model nor inference gives (a
        branch these shapes do not take) is float32 of unknown shape, a placeholder: the
        values the subgraph makes when it runs carry their own types."""
        try:
            return self._output_type(ctx, name, declared)
        except ModelFormatError:
            return TensorType(DType.FLOAT32, None)

    # ---- pieces --------------------------------------------------------
    def _initializers(self, g: Any = None) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        g = self.g if g is None else g
        for t in g.initializer:
            _check_name(t.name, "initializer")
            if t.name in out:
                raise ModelFormatError(f"initializer {t.name!r} is defined twice")
            out[t.name] = tensor_to_array(t, self.base_dir, f"initializer {t.name!r}")
        for sp in g.sparse_initializer:
            name = sp.values.name
            _check_name(name, "sparse initializer")
            if name in out:
                raise ModelFormatError(f"initializer {name!r} is defined twice")
            out[name] = _sparse_to_dense(sp, self.base_dir, f"sparse initializer {name!r}")
        return out

    def _inputs(self, initializers: dict[str, np.ndarray]) -> list[Value]:
        values: list[Value] = []
        seen: set[str] = set()
        for vi in self.g.input:
            _check_name(vi.name, "graph input")
            if vi.name in seen:
                raise ModelFormatError(f"graph input {vi.name!r} is declared twice")
            seen.add(vi.name)
            # Before IR version 4 every initializer had to be listed as an input;
            # those are constants, not inputs a caller may feed (as in onnxruntime).
            if vi.name in initializers and self.model.ir_version < 4:
                continue
            t = _value_type(vi, f"graph input {vi.name!r}")
            if t is None:
                raise ModelFormatError(f"graph input {vi.name!r} has no type keel reads; keel "
                                       "reads tensor, sequence and optional inputs only")
            values.append(Value(vi.name, t))
        return values

    def _declared(self, g: Any = None) -> dict[str, TensorType]:
        out: dict[str, TensorType] = {}
        g = self.g if g is None else g
        for vi in list(g.value_info) + list(g.output):
            try:
                t = _value_type(vi, f"value {vi.name!r}")
            except ModelFormatError:
                if vi.name in {o.name for o in g.output}:
                    raise
                t = None  # a bad type on an intermediate is only a hint lost
            if t is not None and vi.name:
                out[vi.name] = t
        return out

    def _nodes(self, g: Any = None) -> list[OnnxNode]:
        nodes: list[OnnxNode] = []
        names: dict[str, None] = {}     # a dict: a third of a set's bytes for many names
        strings: dict[str, str] = {}    # freed on return, before the nodes are converted
        intern = strings.setdefault
        protos = (g.node if g is not None else self.g.node if self.split is None
                  else self.split[0].nodes(self.split[1]))
        for idx, proto in enumerate(protos):
            if not proto.op_type:
                raise ModelFormatError(f"node #{idx} ({proto.name!r}) has no op_type")
            name = proto.name or f"{proto.op_type}_{idx}"
            while name in names:
                name = f"{name}_{idx}"
            names[name] = None
            attrs = _decode_attrs(proto, name, self.base_dir) if proto.attribute else _NO_ATTRS
            # protobuf hands out a new string on every read: one object per name (a
            # value's producer and its consumers share it), op type and domain
            nodes.append(OnnxNode(name, intern(proto.op_type, proto.op_type),
                                  intern(proto.domain, proto.domain),
                                  tuple([intern(i, i) for i in proto.input]),
                                  tuple([intern(o, o) for o in proto.output]), attrs,
                                  _implicit_inputs(proto) if proto.attribute else ()))
        return nodes

    def _check_definitions(self, nodes: list[OnnxNode], inputs: list[Value],
                           initializers: dict[str, np.ndarray], g: Any = None,
                           outside: Sequence[str] = ()) -> None:
        g = self.g if g is None else g
        defined = dict.fromkeys([*(v.name for v in inputs), *initializers, *outside])
        for n in nodes:
            for o in n.outputs:
                if o and o in defined:
                    raise ModelFormatError(f"value {o!r} is defined twice (again by node "
                                           f"{n.name!r})")
                defined[o] = None       # a dict: a third of a set's bytes for many names
        for n in nodes:
            for i in (*n.inputs, *n.implicit):
                if i and i not in defined:
                    raise ModelFormatError(f"node {n.name!r} ({n.op_type}) reads {i!r}, "
                                           "which no node, input or initializer defines")
        for o in g.output:
            _check_name(o.name, "graph output")
            if o.name not in defined:
                raise ModelFormatError(f"graph output {o.name!r} is not defined by any node, "
                                       "input or initializer")

    def _seed(self, ctx: ImportContext, inputs: list[Value],
              initializers: dict[str, np.ndarray], nodes: list[OnnxNode]) -> None:
        ctx.defer_names(nodes)      # every graph output is defined by a node, input or weight
        for name, arr in initializers.items():
            ctx.add_initializer(name, arr)
        for v in inputs:
            ctx.state.types[v.name] = v.type
            ctx.state.values.pop(v.name, None)

    def _graph(self, ctx: ImportContext, inputs: list[Value],
               declared: dict[str, TensorType]) -> Graph:
        outputs = [Value(o.name, self._output_type(ctx, o.name, declared))
                   for o in self.g.output]
        io = {v.name for v in inputs} | {o.name for o in outputs}
        types = ctx.state.types     # the context ends here: its table becomes the graph's
        for k in [k for k, t in types.items()
                  if t is None or k in ctx.initializers or k in io]:
            del types[k]
        graph = Graph(self.g.name or "model", ctx.nodes, inputs, outputs, ctx.initializers,
                      cast("dict[str, TensorType]", types), self.opset, self._metadata())
        ctx.forget_names()          # the names in use: freed before verify() makes its own
        graph.verify()
        return graph

    def _output_type(self, ctx: ImportContext, name: str,
                     declared: dict[str, TensorType]) -> TensorType:
        inferred = ctx.state.types.get(name)
        given = declared.get(name)
        if given is None and inferred is None:
            raise ModelFormatError(f"graph output {name!r} has no declared type and keel "
                                   "cannot infer it")
        if given is None or given.shape is None:
            return inferred if inferred is not None else given  # type: ignore[return-value]
        if inferred is None or inferred.shape is None or len(inferred.shape) != len(given.shape):
            return given
        dims = tuple(g if g is not None else i for g, i in zip(given.shape, inferred.shape,
                                                              strict=True))
        return TensorType(given.dtype, dims, given.kind)

    def _metadata(self) -> dict[str, str]:
        m = self.model
        meta = {"source": "onnx", "onnx.ir_version": str(m.ir_version),
                "onnx.opset": str(self.opset)}
        for key in ("producer_name", "producer_version", "domain", "doc_string"):
            value = getattr(m, key)
            if value:
                meta[f"onnx.{key}"] = str(value)
        if m.model_version:
            meta["onnx.model_version"] = str(m.model_version)
        if self.g.name:
            meta["onnx.graph_name"] = str(self.g.name)
        if self.g.doc_string:
            meta["onnx.graph_doc_string"] = str(self.g.doc_string)
        # keel.node_order records what one load's passes moved, never this load's.
        props = {str(p.key): str(p.value) for p in m.metadata_props
                 if str(p.key) != "keel.node_order"}
        meta.update(props)
        # Which entries are the model's own metadata_props (onnxruntime's custom_metadata_map).
        meta["onnx.metadata_props"] = json.dumps(list(props))
        return meta


def _default_opset(model: Any, has_ml: bool = False) -> int:
    versions = [int(o.version) for o in model.opset_import if o.domain in _DEFAULT_DOMAINS]
    if not versions and has_ml:
        return max_opset()    # an ai.onnx.ml-only model: no default-domain node to version
    if not versions:
        raise ModelFormatError("model imports no default-domain (ai.onnx) opset")
    opset, newest = max(versions), max_opset()
    if not MIN_OPSET <= opset <= newest:
        raise ModelFormatError(
            f"model uses opset {opset}; keel imports opsets {MIN_OPSET} to {newest}"
        )
    return opset


def _ml_opset(model: Any) -> int | None:
    """The model's ``ai.onnx.ml`` opset, None when it imports none."""
    versions = [int(o.version) for o in model.opset_import if o.domain == ML_DOMAIN]
    return max(versions) if versions else None


def _check_name(name: str, what: str) -> None:
    if not name:
        raise ModelFormatError(f"a {what} has an empty name")


# ---- types and attributes ---------------------------------------------------------------
def _value_type(vi: Any, what: str) -> TensorType | None:
    return _type_of(vi.type, what)


def _type_of(tp: Any, what: str) -> TensorType | None:
    """keel's type of an ONNX TypeProto: a tensor, a sequence of tensors, an optional."""
    which = tp.WhichOneof("value")
    if which == "sequence_type":
        elem = _type_of(tp.sequence_type.elem_type, what) if \
            tp.sequence_type.HasField("elem_type") else None
        return None if elem is None or not elem.is_tensor else \
            elem.as_kind(ValueKind.SEQUENCE)
    if which == "optional_type":
        elem = _type_of(tp.optional_type.elem_type, what) if \
            tp.optional_type.HasField("elem_type") else None
        if elem is None or elem.kind not in (ValueKind.TENSOR, ValueKind.SEQUENCE):
            return None
        return elem.as_kind(ValueKind.OPTIONAL if elem.is_tensor
                            else ValueKind.OPTIONAL_SEQUENCE)
    if which != "tensor_type":
        return None
    tt = tp.tensor_type
    if not tt.elem_type:
        return None
    dtype = element_dtype(tt.elem_type, what)
    if not tt.HasField("shape"):
        return TensorType(dtype, None)
    dims: list[Dim] = []
    for d in tt.shape.dim:
        kind = d.WhichOneof("value")
        if kind == "dim_value":
            if d.dim_value < 0 or d.dim_value > MAX_ELEMENTS:
                raise ModelFormatError(f"{what} has an impossible dimension {d.dim_value}")
            dims.append(int(d.dim_value))
        else:
            dims.append(str(d.dim_param) if kind == "dim_param" and d.dim_param else None)
    return TensorType(dtype, tuple(dims))


def _decode_attrs(proto: Any, node: str, base_dir: Path | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for a in proto.attribute:
        if not a.name or a.name in attrs:
            raise ModelFormatError(f"node {node!r} has an unnamed or repeated attribute "
                                   f"{a.name!r}")
        if a.ref_attr_name:
            raise ModelFormatError(f"node {node!r}: attribute {a.name!r} refers to a function "
                                   "attribute outside a function")
        attrs[a.name] = _attr_value(a, f"attribute {a.name!r} of node {node!r}", base_dir)
    return attrs


def _attr_value(a: Any, what: str, base_dir: Path | None) -> Any:
    kind = int(a.type)
    if kind == 1:
        return float(a.f)
    if kind == 2:
        return int(a.i)
    if kind == 3:
        return bytes(a.s).decode("utf-8", "replace")
    if kind == 4:
        return tensor_to_array(a.t, base_dir, what)
    if kind == 5:            # GRAPH: imported by the node's converter (ImportContext.subgraph)
        return a.g
    if kind == 13:           # TYPE_PROTO (Optional's type)
        return _type_of(a.tp, what)
    if kind == 10:           # GRAPHS: only ops keel rejects use them
        return None
    if kind == 6:
        return tuple(float(x) for x in a.floats)
    if kind == 7:
        return tuple(int(x) for x in a.ints)
    if kind == 8:
        return tuple(bytes(s).decode("utf-8", "replace") for s in a.strings)
    if kind == 9:
        return tuple(tensor_to_array(t, base_dir, what) for t in a.tensors)
    if kind == 11:
        return _sparse_to_dense(a.sparse_tensor, base_dir, what)
    raise ModelFormatError(f"{what} has no valid type ({kind})")


def _sparse_to_dense(sp: Any, base_dir: Path | None, what: str) -> np.ndarray:
    from keel.graph.importers.onnx_tensors import dims_of

    shape = dims_of(sp.dims, what)
    values = tensor_to_array(sp.values, base_dir, what).reshape(-1)
    indices = tensor_to_array(sp.indices, base_dir, what).astype(np.int64)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel > (1 << 28):
        raise ModelFormatError(f"{what} densifies to {numel} elements; keel's limit is 2**28")
    if indices.ndim == 2 and indices.shape[1] == len(shape) and len(shape):
        indices = np.ravel_multi_index(tuple(indices.T), shape)  # raises on out of range
    indices = indices.reshape(-1)
    if len(indices) != len(values) or (indices.size and (indices.min() < 0
                                                         or indices.max() >= numel)):
        raise ModelFormatError(f"{what} has indices that do not match its values or shape")
    dense = np.zeros(numel, dtype=values.dtype)
    dense[indices] = values
    return dense.reshape(shape)


def _implicit_inputs(proto: Any) -> list[str]:
    """The names the graph attributes of node ``proto`` read from enclosing scopes."""
    names: list[str] = []
    for a in proto.attribute:
        graphs = [a.g] if a.type == 5 else list(a.graphs) if a.type == 10 else []
        for g in graphs:
            names += [n for n in _free_names(g) if n not in names]
    return names


def _free_names(g: Any) -> list[str]:
    """Names GraphProto ``g`` (and graphs nested in it) reads without defining them."""
    defined = {vi.name for vi in g.input} | {t.name for t in g.initializer} | \
        {sp.values.name for sp in g.sparse_initializer} | \
        {o for n in g.node for o in n.output if o}
    free: list[str] = []
    for n in g.node:
        for name in (*n.input, *_implicit_inputs(n)):
            if name and name not in defined and name not in free:
                free.append(name)
    for o in g.output:
        if o.name not in defined and o.name not in free:
            free.append(o.name)
    return free


# ---- ordering and conversion ------------------------------------------------------------
def _toposort(nodes: list[OnnxNode], available: set[str]) -> list[OnnxNode]:
    """Stable topological order; a cycle is a ModelFormatError."""
    if _in_order(nodes, available):     # as exporters write them: nothing to build
        return nodes
    producer = {o: k for k, n in enumerate(nodes) for o in n.outputs if o}
    waiting = [0] * len(nodes)
    dependents: dict[int, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in {i for i in (*n.inputs, *n.implicit) if i and i not in available}:
            waiting[k] += 1
            dependents.setdefault(producer[i], []).append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for d in dependents.get(k, ()):
            waiting[d] -= 1
            if not waiting[d]:
                heapq.heappush(ready, d)
    if len(order) != len(nodes):
        stuck = [nodes[k].name for k, w in enumerate(waiting) if w][:5]
        raise ModelFormatError(f"the graph has a cycle through nodes {', '.join(stuck)}")
    return [nodes[k] for k in order]


def _in_order(nodes: list[OnnxNode], available: set[str]) -> bool:
    """Whether every node reads only values defined before it."""
    seen = dict.fromkeys(available)     # a dict: a third of a set's bytes for many names
    for n in nodes:
        if any(i and i not in seen for i in n.inputs) or \
                any(i and i not in seen for i in n.implicit):
            return False
        seen.update(dict.fromkeys(n.outputs))
    return True


def _convert(ctx: ImportContext, n: OnnxNode) -> None:
    ctx.begin(n)
    if n.domain == KEEL_DOMAIN:
        _convert_keel(ctx, n)
        return
    converter: Converter | None
    if n.domain == ML_DOMAIN:
        converter = _ml_converter(ctx, n)
    elif n.domain == MS_DOMAIN:
        converter = MS_TABLE.lookup(n.op_type, 1)
        if converter is None:
            raise ctx.unsupported(f"keel reads {MS_DOMAIN}'s quantized ops "
                                  f"({', '.join(MS_TABLE.op_types())}), not this one")
        converter(ctx, n)
        return
    elif n.domain == PREVIEW_DOMAIN and ctx.opset_of(PREVIEW_DOMAIN):
        converter = PREVIEW_TABLE.lookup(n.op_type, ctx.opset_of(PREVIEW_DOMAIN))
    elif n.domain not in _DEFAULT_DOMAINS:
        raise ctx.unsupported(f"custom domain {n.domain!r} (keel reads the default ONNX "
                              f"domain, {ML_DOMAIN!r}, {KEEL_DOMAIN!r} and {MS_DOMAIN}'s "
                              "quantized ops)")
    else:
        converter = TABLE.lookup(n.op_type, ctx.opset)
    if converter is None:
        raise _no_converter(ctx, n)
    _check_onnx_arity(ctx, n)
    converter(ctx, n)


def _check_onnx_arity(ctx: ImportContext, n: OnnxNode) -> None:
    """The node's input and output counts fit the ONNX op (converters rely on it)."""
    schema = onnx_schema(n, ctx.opset_of(n.domain))
    if schema is None:
        return
    for what, count, lo, hi in (("inputs", len(n.inputs), schema.min_input, schema.max_input),
                                ("outputs", len(n.outputs), schema.min_output,
                                 schema.max_output)):
        if not lo <= count <= hi:
            raise ctx.invalid(f"has {count} {what}; {n.op_type}-{schema.since_version} takes "
                              f"{lo}..{hi}")
    if any(not o for o in n.outputs[:schema.min_output]):
        raise ctx.invalid("a required output has no name")


def _ml_converter(ctx: ImportContext, n: OnnxNode) -> Converter:
    opset = ctx.opset_of(ML_DOMAIN)
    if not opset:
        raise ModelFormatError(f"node {n.name!r} ({n.op_type}) is in {ML_DOMAIN}, which the "
                               "model does not import (no opset_import entry)")
    converter = ML_TABLE.lookup(n.op_type, opset)
    if converter is not None:
        return converter
    versions = ML_TABLE.versions(n.op_type)
    if onnx_schema(n, opset) is None:
        raise ModelFormatError(f"node {n.name!r}: {n.op_type!r} is not an operator of "
                               f"{ML_DOMAIN} opset {opset}")
    if versions:
        raise ctx.unsupported(f"keel implements {ML_DOMAIN} versions {versions}; the model's "
                              f"{ML_DOMAIN} opset is {opset}")
    raise ctx.unsupported(f"keel has no implementation of this {ML_DOMAIN} operator")


def _no_converter(ctx: ImportContext, n: OnnxNode) -> KeelError:
    import onnx.defs

    if not onnx.defs.has(n.op_type):
        return ModelFormatError(f"node {n.name!r}: {n.op_type!r} is not an ONNX operator")
    try:
        onnx.defs.get_schema(n.op_type, ctx.opset)
    except Exception:  # onnx's SchemaError: the op does not exist yet at this opset
        return ModelFormatError(f"node {n.name!r}: {n.op_type} does not exist in opset "
                                f"{ctx.opset}, which the model declares")
    versions = TABLE.versions(n.op_type)
    if versions:
        return ctx.unsupported(f"keel implements versions {versions}; the model's opset is "
                               f"{ctx.opset}")
    return ctx.unsupported("keel has no implementation of this ONNX operator")


def _convert_keel(ctx: ImportContext, n: OnnxNode) -> None:
    """Nodes of keel's own domain carry keel op names and attribute names."""
    try:
        op = Op(n.op_type)
    except ValueError:
        raise ctx.invalid(f"{n.op_type!r} is not a keel op") from None
    ctx.emit(op, n.inputs, n.outputs, n.attrs)


def supported_op_types(domain: str = "") -> list[str]:
    """Every ONNX op_type the importer converts in ``domain`` (default: ai.onnx; also
    ai.onnx.ml and com.microsoft)."""
    if domain == MS_DOMAIN:
        return MS_TABLE.op_types()
    return ML_TABLE.op_types() if domain == ML_DOMAIN else TABLE.op_types()

