"""keel :class:`~keel.graph.ir.Graph` → ONNX ``ModelProto``.

Every op with an ONNX counterpart is written as that op (at opset
:data:`EXPORT_OPSET`, or newer where an op needs it). keel's fused forms have
two spellings:

* ``custom_domain=False`` (default): their standard ONNX decomposition
  (Conv → Add(Z) → activation, MatMul → Add(bias), attention as
  Transpose/MatMul/Mul/Add/Softmax/MatMul, skip_layer_norm as Add →
  LayerNormalization), so onnxruntime and any ONNX tool run the exported model;
* ``custom_domain=True``: single nodes in keel's domain ``ai.keel``, which
  keel re-imports as they are, fused; onnxruntime cannot run those nodes.

Nodes ONNX cannot say at all (keel's seed ops such as ``sum_all``, or an
attribute with no ONNX spelling) are always written in ``ai.keel``. A model
using that domain carries the metadata entry ``keel.custom_domain``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType, pack
from keel.graph.importers.onnx import KEEL_DOMAIN
from keel.graph.importers.onnx_control import SEQUENCE_OPS
from keel.graph.importers.onnx_ops import DIRECT, REDUCTIONS, SOFTMAXES
from keel.graph.ir import Graph, Node, match_attr_name
from keel.graph.subgraphs import captured_inputs, captures, subgraphs, walk
from keel.ops.registry import Op
from keel.ops.types import TensorType, ValueKind

__all__ = ["EXPORT_IR_VERSION", "EXPORT_OPSET", "to_onnx"]

EXPORT_OPSET = 21
# IR version 10 (onnx 1.16): new enough for every op used, old enough for
# the onnxruntime releases people run.
EXPORT_IR_VERSION = 10

_PREFERRED = {Op.SCATTER_ELEMENTS: "ScatterElements", Op.IDENTITY: "Identity"}
# Control-flow ops: written with their subgraphs as graph attributes.
_CONTROL_NAME = {Op.IF: "If", Op.LOOP: "Loop", Op.SCAN: "Scan",
                 Op.SEQUENCE_MAP: "SequenceMap"}
_SPECIAL = {
    Op.CLIP: "Clip", Op.SQUEEZE: "Squeeze", Op.EXPAND_DIMS: "Unsqueeze", Op.SPLIT: "Split",
    Op.SLICE: "Slice", Op.PAD: "Pad", Op.TOPK: "TopK", Op.RESIZE: "Resize", Op.CAST: "Cast",
    Op.BATCH_NORM: "BatchNormalization", Op.GROUP_NORM: "GroupNormalization",
    Op.MAXIMUM: "Max", Op.MINIMUM: "Min", Op.ADD_N: "Sum",
}


def _onnx_names() -> dict[Op, str]:
    names: dict[Op, str] = {}
    for op_type, (op, _) in DIRECT.items():
        names.setdefault(op, op_type)
    for op_type, (op, _) in REDUCTIONS.items():
        names[op] = op_type
    for op_type, op in SOFTMAXES.items():
        names[op] = op_type
    names.update(_SPECIAL)
    names.update(_PREFERRED)
    names.update({op: op_type for op_type, op, _ in SEQUENCE_OPS})
    names.update(_CONTROL_NAME)
    return names


ONNX_NAME = _onnx_names()


def to_onnx(graph: Graph, *, custom_domain: bool = False) -> Any:
    """An ONNX ``ModelProto`` equivalent to ``graph`` (see the module docstring)."""
    import onnx.helper

    w = _Writer(graph, custom_domain)
    g = w.graph_proto()
    opsets = [onnx.helper.make_opsetid("", w.opset)]
    if w.used_keel_domain:
        opsets.append(onnx.helper.make_opsetid(KEEL_DOMAIN, 1))
    model = onnx.helper.make_model(g, opset_imports=opsets, producer_name="keel",
                                   ir_version=EXPORT_IR_VERSION)
    # keel.node_order records what this load's passes moved; a reload makes its own.
    meta = {k: v for k, v in graph.metadata.items()
            if not k.startswith("onnx.") and k != "keel.node_order"}
    if w.used_keel_domain:
        meta["keel.custom_domain"] = KEEL_DOMAIN
    onnx.helper.set_model_props(model, meta)
    return model


class _Writer:
    def __init__(self, graph: Graph, custom_domain: bool, opset: int | None = None,
                 taken: set[str] | None = None) -> None:
        self.graph = graph
        self.custom_domain = custom_domain
        self.nodes: list[Any] = []
        self.extra_init: dict[str, np.ndarray] = {}
        self.renamed_init: dict[str, str] = {}
        self.opset = _needed_opset(graph) if opset is None else opset
        self.used_keel_domain = False
        # One namespace across a graph and its subgraphs, as ONNX wants.
        self._taken = taken if taken is not None else _all_names(graph)

    def graph_proto(self) -> Any:
        """The whole graph (its subgraphs inside their nodes) as an ONNX GraphProto."""
        import onnx.helper

        for node in self.graph.nodes:
            self.node(node)
        self.outputs_from_initializers()
        return onnx.helper.make_graph(
            self.nodes, self.graph.name or "keel",
            [_value_info(v.name, v.type) for v in self.graph.inputs],
            [_value_info(v.name, v.type) for v in self.graph.outputs], self.initializers(),
            value_info=self.value_infos())

    # ---- nodes ---------------------------------------------------------
    def node(self, n: Node) -> None:
        fused = _is_fused(n)
        if n.op in _CONTROL_NAME:
            self.control(n)
        elif n.op is Op.OPTIONAL and n.attrs.get("type") is not None:
            self.optional(n)
        elif fused and self.custom_domain:
            self.keel_node(n)
        elif n.op is Op.ATTENTION and not n.attr("is_causal", False):
            self.attention(n)
        elif n.op is Op.ATTENTION:
            self.keel_node(n)  # a causal mask has no compact ONNX spelling below opset 23
        elif n.op is Op.SKIP_LAYER_NORM:
            self.skip_layer_norm(n)
        elif fused:
            self.epilogue(n)
        elif n.op in ONNX_NAME and self.standard(n, ONNX_NAME[n.op], n.inputs, n.outputs,
                                                 n.name, n.attrs):
            return
        else:
            self.keel_node(n)

    def standard(self, n: Node, op_type: str, inputs: Sequence[str], outputs: Sequence[str],
                 name: str, attrs: dict[str, Any]) -> bool:
        """Write ``op_type``; False (writing nothing) when an attribute has no ONNX spelling."""
        import onnx.defs
        import onnx.helper

        schema = onnx.defs.get_schema(op_type, self.opset)
        converted = _onnx_attrs(n.op, attrs, schema)
        if converted is None:
            return False
        self.nodes.append(onnx.helper.make_node(op_type, list(inputs), list(outputs),
                                                name=name, **converted))
        return True

    def control(self, n: Node) -> None:
        """If, Loop, Scan or SequenceMap with its subgraphs as graph attributes: each reads
        the enclosing values by the names they have here (its captures renamed)."""
        import onnx.helper

        names = captures(n)
        outer = captured_inputs(n)
        rename = {c: o for c, o in zip(names, outer, strict=True) if c != o}
        own = list(n.inputs[:len(n.inputs) - len(names)])
        if n.op is Op.LOOP:
            own += [""] * (2 - len(own))
        attrs: dict[str, Any] = {}
        for attr, body in subgraphs(n):
            sub = _Writer(_renamed(body, rename), self.custom_domain, self.opset, self._taken)
            attrs[attr] = sub.graph_proto()
            self.used_keel_domain |= sub.used_keel_domain
        if n.op is Op.SCAN:
            attrs.update({k: list(v) if isinstance(v, tuple) else v for k, v in n.attrs.items()
                          if k.startswith(("num_", "scan_")) and v is not None})
        self.nodes.append(onnx.helper.make_node(_CONTROL_NAME[n.op], own, list(n.outputs),
                                                name=n.name, **attrs))

    def optional(self, n: Node) -> None:
        import onnx.helper

        self.nodes.append(onnx.helper.make_node("Optional", list(n.inputs), list(n.outputs),
                                                name=n.name, type=_type_proto(n.attrs["type"])))

    def keel_node(self, n: Node) -> None:
        import onnx.helper

        attrs = {k: _keel_attr(v) for k, v in n.attrs.items() if _keel_attr(v) is not None}
        self.nodes.append(onnx.helper.make_node(n.op.value, n.inputs, n.outputs, name=n.name,
                                                domain=KEEL_DOMAIN, **attrs))
        self.used_keel_domain = True

    def emit(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str,
             **attrs: Any) -> None:
        import onnx.helper

        self.nodes.append(onnx.helper.make_node(op_type, list(inputs), list(outputs),
                                                name=self.fresh(name), **attrs))

    def fresh(self, base: str) -> str:
        return self.graph.fresh_name(base, self._taken)

    def const(self, value: Any, like: str, hint: str) -> str:
        name = self.fresh(hint)
        dtype = self.dtype(like)
        self.extra_init[name] = np.asarray(value, dtype=dtype.numpy)
        return name

    def dtype(self, value: str) -> DType:
        t = self.graph.type_of(value)
        return t.dtype if t is not None and t.dtype.is_float else DType.FLOAT32

    # ---- fused forms, decomposed ----------------------------------------
    def epilogue(self, n: Node) -> None:
        """CONV/GEMM/MATMUL with Z, bias or activation as base op → Add → activation."""
        base_inputs = n.inputs[:3] if n.op is Op.CONV else n.inputs[:2 if n.op is Op.MATMUL
                                                                    else 3]
        extra = n.input(3) if n.op is Op.CONV else (n.input(2) if n.op is Op.MATMUL else "")
        act = str(n.attr("activation", "") or "")
        out = n.outputs[0]
        plain = {k: v for k, v in n.attrs.items() if k not in ("activation",
                                                                "activation_params")}
        cur = self.fresh(f"{out}/base") if (extra or act) else out
        self.standard(n, ONNX_NAME[n.op], base_inputs, [cur], n.name, plain)
        if extra:
            nxt = self.fresh(f"{out}/sum") if act else out
            self.emit("Add", [cur, extra], [nxt], f"{n.name}/add")
            cur = nxt
        if act:
            self.activation(act, tuple(n.attr("activation_params", ()) or ()), cur, out,
                            n.name)

    def activation(self, act: str, params: tuple[float, ...], x: str, y: str,
                   name: str) -> None:
        from keel.ops.epilogue import resolve_activation

        _, p = resolve_activation(act, params)
        simple = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh",
                  "hard_swish": "HardSwish"}
        if act in simple:
            self.emit(simple[act], [x], [y], f"{name}/{act}")
        elif act == "leaky_relu":
            self.emit("LeakyRelu", [x], [y], f"{name}/{act}", alpha=float(p[0]))
        elif act == "hard_sigmoid":
            self.emit("HardSigmoid", [x], [y], f"{name}/{act}", alpha=float(p[0]),
                      beta=float(p[1]))
        elif act in ("gelu", "gelu_tanh"):
            self.emit("Gelu", [x], [y], f"{name}/{act}",
                      approximate="tanh" if act == "gelu_tanh" else "none")
        elif act == "clip":
            lo = "" if np.isneginf(p[0]) else self.const(p[0], y, f"{name}/min")
            hi = "" if np.isposinf(p[1]) else self.const(p[1], y, f"{name}/max")
            self.emit("Clip", [x, lo, hi], [y], f"{name}/{act}")
        elif act == "silu":
            sig = self.fresh(f"{y}/sigmoid")
            self.emit("Sigmoid", [x], [sig], f"{name}/sigmoid")
            self.emit("Mul", [x, sig], [y], f"{name}/silu")

    def attention(self, n: Node) -> None:
        """softmax(Q·Kᵀ·scale + mask)·V in plain ONNX ops."""
        q, k, v, mask = n.input(0), n.input(1), n.input(2), n.input(3)
        out, name = n.outputs[0], n.name
        kt, s, scaled, p = (self.fresh(f"{out}/{x}") for x in ("kt", "scores", "scaled", "p"))
        self.emit("Transpose", [k], [kt], f"{name}/kt", perm=[0, 1, 3, 2])
        self.emit("MatMul", [q, kt], [s], f"{name}/qk")
        self.emit("Mul", [s, self.scale(n, q)], [scaled], f"{name}/scale")
        if mask:
            masked = self.fresh(f"{out}/masked")
            self.emit("Add", [scaled, mask], [masked], f"{name}/mask")
            scaled = masked
        self.emit("Softmax", [scaled], [p], f"{name}/softmax", axis=-1)
        self.emit("MatMul", [p, v], [out], f"{name}/pv")

    def skip_layer_norm(self, n: Node) -> None:
        """Add(X, skip) → LayerNormalization; the sum keeps its name when it is an output."""
        out = n.outputs[0]
        total = n.outputs[1] if len(n.outputs) > 1 and n.outputs[1] else \
            self.fresh(f"{out}/sum")
        self.emit("Add", n.inputs[:2], [total], f"{n.name}/add")
        params = [n.inputs[2]] + ([n.input(3)] if n.input(3) else [])
        self.emit("LayerNormalization", [total, *params], [out], f"{n.name}/layer_norm",
                  axis=int(n.attr("axis", -1)), epsilon=float(n.attr("epsilon", 1e-5)),
                  stash_type=int(n.attr("stash_type", 1)))

    def scale(self, n: Node, q: str) -> str:
        scale = n.attr("scale", None)
        if scale is not None:
            return self.const(float(scale), q, f"{n.name}/scale_value")
        t = self.graph.type_of(q)
        if t is not None and t.shape is not None and len(t.shape) == 4 and \
                isinstance(t.shape[3], int) and t.shape[3] > 0:
            return self.const(1.0 / np.sqrt(t.shape[3]), q, f"{n.name}/scale_value")
        d, df, root, inv = (self.fresh(f"{n.outputs[0]}/{x}") for x in ("d", "df", "root",
                                                                         "inv"))
        self.emit("Shape", [q], [d], f"{n.name}/d", start=-1)
        self.emit("CastLike", [d, q], [df], f"{n.name}/df")
        self.emit("Sqrt", [df], [root], f"{n.name}/root")
        self.emit("Reciprocal", [root], [inv], f"{n.name}/inv")
        return inv

    # ---- graph parts ---------------------------------------------------
    def outputs_from_initializers(self) -> None:
        """ONNX wants outputs made by nodes: a folded output gets an Identity."""
        for name in self.graph.output_names:
            if name in self.graph.initializers and name not in self.graph.input_names:
                src = self.fresh(f"{name}/value")
                self.renamed_init[name] = src
                self.emit("Identity", [src], [name], f"{name}/identity")

    def initializers(self) -> list[Any]:
        return [tensor_proto(np.asarray(arr), self.renamed_init.get(name, name))
                for name, arr in {**self.graph.initializers, **self.extra_init}.items()]

    def value_infos(self) -> list[Any]:
        io = set(self.graph.input_names) | set(self.graph.output_names)
        return [_value_info(k, t) for k, t in self.graph.value_types.items()
                if k not in io and k not in self.graph.initializers]


def _needed_opset(graph: Graph) -> int:
    """EXPORT_OPSET, or newer when the graph (or a subgraph) uses an ONNX op introduced
    later."""
    first = _first_versions()
    graphs = [graph, *(body for _, body in walk(graph))]
    used = [first.get(ONNX_NAME[n.op], 1) for g in graphs for n in g.nodes if n.op in ONNX_NAME]
    return max([EXPORT_OPSET, *used])


def _all_names(graph: Graph) -> set[str]:
    names = graph.names()
    for _, body in walk(graph):
        names |= body.names()
    return names


def _renamed(body: Graph, rename: dict[str, str]) -> Graph:
    """``body`` reading the enclosing values ``rename`` maps its captures to."""
    if not rename:
        return body
    g = body.copy()
    for old, new in rename.items():
        g.replace_uses(old, new)
    g.outputs = [type(v)(rename.get(v.name, v.name), v.type) for v in g.outputs]
    return g



@functools.lru_cache(maxsize=1)
def _first_versions() -> dict[str, int]:
    import onnx.defs

    first: dict[str, int] = {}
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain == "":
            first[s.name] = min(first.get(s.name, s.since_version), s.since_version)
    return first


def _is_fused(n: Node) -> bool:
    if n.op in (Op.ATTENTION, Op.SKIP_LAYER_NORM):
        return True
    if n.op not in (Op.CONV, Op.GEMM, Op.MATMUL):
        return False
    extra = n.input(3) if n.op is Op.CONV else (n.input(2) if n.op is Op.MATMUL else "")
    return bool(extra or n.attr("activation", ""))


def _onnx_attrs(op: Op, attrs: dict[str, Any], schema: Any) -> dict[str, Any] | None:
    """keel attributes in ONNX spelling; None when one of them has no ONNX equivalent."""
    import onnx.helper

    names = list(schema.attributes)
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        if value is None or (key in ("activation", "activation_params") and not value):
            continue
        target = match_attr_name(key, names)
        if target is None:
            if _is_keel_default(op, key, value):
                continue
            return None
        spec = schema.attributes[target]
        if spec.default_value.type:
            if _equal(value, onnx.helper.get_attribute_value(spec.default_value)):
                continue
        elif isinstance(value, (tuple, list)) and not value:
            continue
        out[target] = _onnx_value(value)
    return out


def _is_keel_default(op: Op, key: str, value: Any) -> bool:
    from keel.ops.schema import get_schema

    try:
        spec = next(a for a in get_schema(op).attrs if a.name == key)
    except (StopIteration, Exception):
        return False
    return _equal(value, spec.default)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return False
    a, b = _onnx_value(a), _onnx_value(b)
    if isinstance(a, bytes):
        a = a.decode()
    if isinstance(b, bytes):
        b = b.decode()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    try:
        return bool(a == b)
    except Exception:
        return False


def tensor_proto(array: np.ndarray, name: str = "") -> Any:
    """An ONNX ``TensorProto`` of ``array``; ml_dtypes' types as raw data (4- and 2-bit
    elements packed), which every onnx release that knows the type reads."""
    from onnx import helper, numpy_helper

    if array.dtype.kind in "OUS" or not DType.from_numpy(array.dtype).is_narrow:
        return numpy_helper.from_array(array, name)
    dtype = DType.from_numpy(array.dtype)
    return helper.make_tensor(name, dtype.onnx, array.shape, pack(array), raw=True)


def _onnx_value(value: Any) -> Any:
    if isinstance(value, DType):
        return value.onnx
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, np.ndarray):
        return tensor_proto(value)
    if isinstance(value, tuple):
        return [_onnx_value(v) for v in value]
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


def _keel_attr(value: Any) -> Any:
    """An ``ai.keel`` attribute value: keel spelling, dtypes as their names."""
    if value is None or (isinstance(value, (tuple, list)) and not value):
        return None
    if isinstance(value, DType):
        return value.value
    return _onnx_value(value)


def _value_info(name: str, t: TensorType) -> Any:
    import onnx.helper

    return onnx.helper.make_value_info(name, _type_proto(t))


def _type_proto(t: TensorType) -> Any:
    """ONNX's TypeProto of ``t``: a tensor, a sequence of tensors or an optional."""
    import onnx.helper

    shape = None if t.shape is None else [d for d in t.shape]
    tensor = onnx.helper.make_tensor_type_proto(t.dtype.onnx, shape)
    if t.kind is ValueKind.SEQUENCE:
        return onnx.helper.make_sequence_type_proto(tensor)
    if t.kind is ValueKind.OPTIONAL:
        return onnx.helper.make_optional_type_proto(tensor)
    if t.kind is ValueKind.OPTIONAL_SEQUENCE:
        return onnx.helper.make_optional_type_proto(
            onnx.helper.make_sequence_type_proto(tensor))
    return tensor
