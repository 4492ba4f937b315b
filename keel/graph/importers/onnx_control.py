"""ONNX converters of the control-flow ops (If, Loop, Scan, SequenceMap) and of the
sequence and optional ops.

A control-flow node's graph attributes become keel Graphs (``ImportContext.subgraph``);
the values of enclosing graphs they read become the node's captures, listed after its
own inputs (see :mod:`keel.graph.subgraphs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keel.dtypes import DType
from keel.graph.importers.onnx_context import ImportContext, OnnxNode
from keel.graph.importers.onnx_ops import TABLE, _direct
from keel.graph.ir import Graph, Node, Value
from keel.graph.subgraphs import free_names
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType, ValueKind

__all__ = ["SEQUENCE_OPS"]


def _captures(*bodies: Graph) -> list[str]:
    names: list[str] = []
    for body in bodies:
        names += [n for n in free_names(body) if n not in names]
    return names


def _any_dims(t: TensorType | None) -> TensorType | None:
    """``t`` with every dim unknown: a loop-carried value or a sequence element whose
    subgraph input declares no type may take another shape on every run, so nothing in
    the subgraph may be specialised to the first one's."""
    if t is None or t.shape is None:
        return t
    return TensorType(t.dtype, tuple([None] * len(t.shape)), t.kind)


@TABLE.converts("If", since=1)
def _if(ctx: ImportContext, n: OnnxNode) -> None:
    then = ctx.subgraph("then_branch")
    other = ctx.subgraph("else_branch")
    if len(then.outputs) != len(other.outputs) or len(then.outputs) < len(n.outputs):
        raise ctx.invalid(f"its branches give {len(then.outputs)} and {len(other.outputs)} "
                          f"outputs for {len(n.outputs)} node outputs")
    caps = _captures(then, other)
    ctx.emit(Op.IF, [n.input(0), *caps], n.outputs,
             {"then_branch": then, "else_branch": other, "captures": tuple(caps)})


@TABLE.converts("Loop", since=1)
def _loop(ctx: ImportContext, n: OnnxNode) -> None:
    carried = n.inputs[2:]
    formal: list[TensorType | None] = [TensorType(DType.INT64, ()), TensorType(DType.BOOL, ()),
                                       *[_any_dims(ctx.type_of(v)) for v in carried]]
    body = ctx.subgraph("body", formal)
    if len(body.inputs) != 2 + len(carried) or len(body.outputs) < 1 + len(carried):
        raise ctx.invalid(f"its body takes {len(body.inputs)} inputs and gives "
                          f"{len(body.outputs)} outputs for {len(carried)} loop-carried values")
    caps = _captures(body)
    ctx.emit(Op.LOOP, [n.input(0), n.input(1), *carried, *caps], n.outputs,
             {"body": body, "captures": tuple(caps)})


@TABLE.converts("Scan", since=9)
def _scan(ctx: ImportContext, n: OnnxNode) -> None:
    n_scan = int(n.attrs.get("num_scan_inputs", 0))
    states = len(n.inputs) - n_scan
    if n_scan < 1 or states < 0:
        raise ctx.invalid(f"num_scan_inputs={n_scan} does not fit its {len(n.inputs)} inputs")
    axes = list(n.attrs.get("scan_input_axes") or [0] * n_scan)
    formal: list[TensorType | None] = [ctx.type_of(v) for v in n.inputs[:states]]
    for j, name in enumerate(n.inputs[states:]):
        t = ctx.type_of(name)
        if t is None or t.shape is None or j >= len(axes):
            formal.append(None)
            continue
        axis = axes[j] + len(t.shape) if axes[j] < 0 else axes[j]
        formal.append(TensorType(t.dtype, t.shape[:axis] + t.shape[axis + 1:])
                      if 0 <= axis < len(t.shape) else None)
    body = ctx.subgraph("body", formal)
    if len(body.inputs) != len(n.inputs) or len(body.outputs) < states:
        raise ctx.invalid(f"its body takes {len(body.inputs)} inputs for {len(n.inputs)} "
                          "node inputs")
    caps = _captures(body)
    attrs = {k: v for k, v in n.attrs.items() if k != "body"}
    ctx.emit(Op.SCAN, [*n.inputs, *caps], n.outputs,
             {**attrs, "body": body, "captures": tuple(caps)})


@TABLE.converts("Scan", since=8)
def _scan8(ctx: ImportContext, n: OnnxNode) -> None:
    """Scan-8 runs a batch (axis 0 of every input) of scans over axis 1: a Loop over the
    batch whose body slices one batch element and runs Scan-9 on it; the Loop stacks the
    per-element results along axis 0."""
    if n.input(0):
        raise ctx.unsupported("Scan-8 with sequence_lens (keel runs Scan-8 over whole "
                              "sequences only)")
    values = n.inputs[1:]
    n_scan = int(n.attrs.get("num_scan_inputs", 0))
    states = len(values) - n_scan
    if n_scan < 1 or states < 0:
        raise ctx.invalid(f"num_scan_inputs={n_scan} does not fit its {len(n.inputs)} inputs")
    formal = [_drop_dims(ctx.type_of(v), 1 if k < states else 2) for k, v in enumerate(values)]
    body = ctx.subgraph("body", formal)
    if len(body.inputs) != len(values) or len(body.outputs) < states:
        raise ctx.invalid(f"its body takes {len(body.inputs)} inputs for {len(values)} values")
    inner_caps = _captures(body)
    i, cond, go = ctx.fresh(f"{n.name}/i"), ctx.fresh(f"{n.name}/cond"), \
        ctx.fresh(f"{n.name}/go")
    picked = [ctx.fresh(f"{v}/item") for v in values]
    outs = [ctx.fresh(f"{o or 'unused'}/item") for o in n.outputs]
    nodes = [Node(f"{n.name}/pick{k}", Op.GATHER, [v, i], [p], {"axis": 0})
             for k, (v, p) in enumerate(zip(values, picked, strict=True))]
    scan_attrs = {"body": body, "num_scan_inputs": n_scan, "captures": tuple(inner_caps)}
    directions = n.attrs.get("directions")
    if directions:
        scan_attrs["scan_input_directions"] = tuple(directions)
    nodes.append(Node(f"{n.name}/scan", Op.SCAN, [*picked, *inner_caps], outs,
                      get_schema(Op.SCAN).normalize_attrs(scan_attrs)))
    nodes.append(Node(f"{n.name}/go", Op.IDENTITY, [cond], [go]))
    # Per batch element: the final states, and the scan outputs over the sequence.
    declared = [v.type if k < states or v.type.shape is None else
                TensorType(v.type.dtype, (None, *v.type.shape))
                for k, v in enumerate(body.outputs)]
    loop_body = Graph(
        f"{n.name}/batch", nodes,
        [Value(i, TensorType(DType.INT64, ())), Value(cond, TensorType(DType.BOOL, ()))],
        [Value(go, TensorType(DType.BOOL, ())),
         *[Value(o, t) for o, t in zip(outs, declared, strict=False)]])
    shape, count = ctx.fresh(f"{n.name}/shape"), ctx.fresh(f"{n.name}/batch")
    ctx.emit(Op.SHAPE, [values[0]], [shape], {"start": 0, "end": 1})
    ctx.emit(Op.RESHAPE, [shape, ctx.constant(np.array([], np.int64), "scalar")], [count])
    caps = _captures(loop_body)
    ctx.emit(Op.LOOP, [count, "", *caps], n.outputs,
             {"body": loop_body, "captures": tuple(caps)})


def _drop_dims(t: TensorType | None, count: int) -> TensorType | None:
    """``t`` without its first ``count`` dims (the batch, and the sequence of a scan input)."""
    if t is None or t.shape is None or len(t.shape) < count:
        return t
    return TensorType(t.dtype, t.shape[count:])


@TABLE.converts("SequenceMap", since=17)
def _sequence_map(ctx: ImportContext, n: OnnxNode) -> None:
    formal: list[TensorType | None] = []
    for name in n.inputs:
        t = ctx.type_of(name)
        formal.append(None if t is None else
                      _any_dims(t.element()) if t.kind is ValueKind.SEQUENCE else t)
    body = ctx.subgraph("body", formal)
    if len(body.inputs) != len(n.inputs) or len(body.outputs) != len(n.outputs):
        raise ctx.invalid(f"its body takes {len(body.inputs)} inputs and gives "
                          f"{len(body.outputs)} outputs for a node of {len(n.inputs)} and "
                          f"{len(n.outputs)}")
    caps = _captures(body)
    ctx.emit(Op.SEQUENCE_MAP, [*n.inputs, *caps], n.outputs,
             {"body": body, "captures": tuple(caps)})


SEQUENCE_OPS: Sequence[tuple[str, Op, int]] = (
    ("SequenceConstruct", Op.SEQUENCE_CONSTRUCT, 11),
    ("SequenceEmpty", Op.SEQUENCE_EMPTY, 11),
    ("SequenceInsert", Op.SEQUENCE_INSERT, 11),
    ("SequenceErase", Op.SEQUENCE_ERASE, 11),
    ("SequenceAt", Op.SEQUENCE_AT, 11),
    ("SequenceLength", Op.SEQUENCE_LENGTH, 11),
    ("SplitToSequence", Op.SPLIT_TO_SEQUENCE, 11),
    ("ConcatFromSequence", Op.CONCAT_FROM_SEQUENCE, 11),
    ("Optional", Op.OPTIONAL, 15),
    ("OptionalHasElement", Op.OPTIONAL_HAS_ELEMENT, 15),
    ("OptionalGetElement", Op.OPTIONAL_GET_ELEMENT, 15),
)

for _op_type, _op, _since in SEQUENCE_OPS:
    TABLE.register(_op_type, _since, _direct(_op))
