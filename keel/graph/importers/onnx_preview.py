"""ONNX op converters of the ``ai.onnx.preview`` domain: FlexAttention.

FlexAttention (preview opset 1) is scaled dot-product attention whose scores and
probabilities pass through optional modifier subgraphs (``score_mod``, ``prob_mod``:
one tensor in, one of the same shape out). keel writes it as the ops it computes, in
the order ONNX's reference does: Q and K each scaled by ``sqrt(scale)``, ``Q @ K^T``
in the input type, the scores cast to the softmax precision, ``score_mod``'s nodes,
Softmax over the keys, ``prob_mod``'s nodes, ``@ V`` in the softmax precision, a cast
back. A modifier's nodes are imported in place, renamed into the model's namespace,
so every later pass and backend sees ordinary ops. Grouped heads gather their K/V head.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.graph.importers.onnx_context import ConverterTable, ImportContext, OnnxNode
from keel.ops.registry import Op

__all__ = ["PREVIEW_DOMAIN", "PREVIEW_TABLE", "preview_opset"]

PREVIEW_DOMAIN = "ai.onnx.preview"
PREVIEW_TABLE = ConverterTable()


def preview_opset(model: Any) -> int:
    """The model's ``ai.onnx.preview`` opset (0 when it imports none)."""
    versions = [int(o.version) for o in model.opset_import if o.domain == PREVIEW_DOMAIN]
    return max(versions, default=0)


@PREVIEW_TABLE.converts("FlexAttention", since=1)
def _flex_attention(ctx: ImportContext, n: OnnxNode) -> None:
    q, k, v = n.inputs[:3]
    types = [ctx.type_of(name) for name in (q, k, v)]
    if any(t is None or t.shape is None or len(t.shape) != 4 for t in types):
        raise ctx.invalid("Q, K and V must be rank-4 tensors of known rank")
    dtype = ctx.dtype_of(q) or DType.FLOAT32
    scale = n.attrs.get("scale")
    head = types[0].shape[3] if types[0] is not None and types[0].shape is not None else None
    if scale is None:
        if not isinstance(head, int):
            raise ctx.unsupported("the head size is not known at import (for the default scale)")
        scale = 1.0 / float(np.sqrt(head))
    precision = _softmax_dtype(ctx, n, dtype)
    k, v = _grouped(ctx, n, k, v)
    root = np.sqrt(np.float32(scale))
    sq = ctx.constant(np.asarray(root, dtype=_wide(dtype).numpy).astype(dtype.numpy), "sqrt_scale")
    qs, ks, kt, scores = (ctx.fresh(f"{n.outputs[0]}/{s}") for s in ("q", "k", "kt", "scores"))
    ctx.emit(Op.MUL, [q, sq], [qs])
    ctx.emit(Op.MUL, [k, sq], [ks])
    ctx.emit(Op.TRANSPOSE, [ks], [kt], {"perm": (0, 1, 3, 2)})
    ctx.emit(Op.MATMUL, [qs, kt], [scores])
    scores = _cast(ctx, scores, precision)
    scores = _modify(ctx, n, "score_mod", scores)
    probs = ctx.fresh(f"{n.outputs[0]}/probs")
    ctx.emit(Op.SOFTMAX, [scores], [probs], {"axis": -1})
    probs = _modify(ctx, n, "prob_mod", probs)
    y = ctx.fresh(f"{n.outputs[0]}/y")
    ctx.emit(Op.MATMUL, [probs, _cast(ctx, v, precision)], [y])
    ctx.emit(Op.CAST, [y], n.outputs[:1], {"to": ctx.dtype_of(n.inputs[2]) or dtype})


def _wide(dtype: DType) -> DType:
    return dtype if dtype.is_float else DType.FLOAT32


def _softmax_dtype(ctx: ImportContext, n: OnnxNode, dtype: DType) -> DType:
    """``softmax_precision``, else float32 below 32 bits, else the input type."""
    code = n.attrs.get("softmax_precision")
    if code is not None:
        from keel.graph.importers.onnx_tensors import element_dtype

        return element_dtype(int(code), f"softmax_precision of node {n.name!r}")
    return DType.FLOAT32 if dtype.itemsize < 4 else dtype


def _cast(ctx: ImportContext, name: str, dtype: DType) -> str:
    if ctx.dtype_of(name) is dtype:
        return name
    out = ctx.fresh(f"{name}/{dtype.value}")
    ctx.emit(Op.CAST, [name], [out], {"to": dtype})
    return out


def _grouped(ctx: ImportContext, n: OnnxNode, k: str, v: str) -> tuple[str, str]:
    """K and V with query head h reading K/V head h // (q_heads / kv_heads)."""
    qt, kt = ctx.type_of(n.inputs[0]), ctx.type_of(k)
    hq = qt.shape[1] if qt is not None and qt.shape is not None else None
    hkv = kt.shape[1] if kt is not None and kt.shape is not None else None
    if hq == hkv:
        return k, v
    if not isinstance(hq, int) or not isinstance(hkv, int) or hkv <= 0 or hq % hkv:
        raise ctx.invalid(f"the query head count {hq} must be a multiple of the key/value "
                          f"head count {hkv}")
    index = ctx.constant(np.arange(hq, dtype=np.int64) // (hq // hkv), "kv_heads")
    out = []
    for name in (k, v):
        grown = ctx.fresh(f"{name}/grouped")
        ctx.emit(Op.GATHER, [name, index], [grown], {"axis": 1})
        out.append(grown)
    return out[0], out[1]


def _modify(ctx: ImportContext, n: OnnxNode, attr: str, value: str) -> str:
    """``value`` through the modifier subgraph ``attr`` (unchanged when absent)."""
    if attr not in n.attrs:
        return value
    graph = n.attrs[attr]
    if graph is None or not hasattr(graph, "node"):
        raise ctx.unsupported(f"{attr}: the subgraph was not read")
    if len(graph.input) != 1 or len(graph.output) != 1:
        raise ctx.invalid(f"{attr} must take one input and give one output, got "
                          f"{len(graph.input)} and {len(graph.output)}")
    return _inline(ctx, n, graph, value, attr)


def _inline(ctx: ImportContext, outer: OnnxNode, graph: Any, value: str, attr: str) -> str:
    """Import ``graph``'s nodes in place, its input bound to ``value``; its output's name.
    Names the subgraph defines are renamed apart; others read the enclosing graph."""
    from keel.graph.importers.onnx import _convert, _decode_attrs
    from keel.graph.importers.onnx_tensors import tensor_to_array

    prefix = f"{outer.name}/{attr}"
    names = {graph.input[0].name: value}
    for t in graph.initializer:
        names[t.name] = ctx.constant(tensor_to_array(t, None, f"initializer {t.name!r} of "
                                                     f"{prefix}"), f"{attr}/{t.name}")
    with ctx.nested():
        for i, proto in enumerate(graph.node):
            for o in proto.output:
                if o:
                    names[o] = ctx.fresh(f"{prefix}/{o}")
            name = f"{prefix}/{proto.name or proto.op_type + '_' + str(i)}"
            ctx.node_names.add(name)
            _convert(ctx, OnnxNode(name, proto.op_type, proto.domain,
                                   [names.get(x, x) for x in proto.input],
                                   [names.get(x, x) for x in proto.output],
                                   _decode_attrs(proto, name, None)))
    result = graph.output[0].name
    if result not in names:
        raise ctx.invalid(f"{attr}'s output {result!r} is not computed inside it")
    return names[result]
