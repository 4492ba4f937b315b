"""Schemas of the control-flow ops (If, Loop, Scan, SequenceMap) and of the sequence and
optional ops.

A control-flow node holds its subgraphs as attributes (keel ``Graph`` objects:
``then_branch``/``else_branch``, ``body``). Values of the enclosing graph that a
subgraph reads are *captured*: the node lists them as its last inputs and names
them, as the subgraph reads them, in attribute ``captures`` (the i-th capture
binds the i-th of those inputs). The output types of a control-flow node come
from its subgraphs' types (``keel.graph.shape_inference`` propagates through
them); the rules here read only what the subgraphs declare.

A sequence value is a list of tensors, an optional value a tensor (or list) or
nothing; their types (``ValueKind``) carry the element's dtype and shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, OpSchema, register_schema
from keel.ops.types import TensorType, ValueKind

__all__ = ["MAX_OUTPUTS", "merge_types"]

# Control-flow nodes give as many outputs as their subgraphs do.
MAX_OUTPUTS = 1 << 16

_Types = Sequence[TensorType | None]
_Values = Sequence[np.ndarray | None]

_CAPTURES = AttrSpec("captures", AttrKind.STRS, ())


def merge_types(a: TensorType | None, b: TensorType | None) -> TensorType | None:
    """The type both ``a`` and ``b`` fit: dims that differ become unknown."""
    if a is None or b is None or a.dtype != b.dtype or a.kind != b.kind:
        return None if a is None or b is None or a.dtype != b.dtype else \
            TensorType(a.dtype, None, a.kind)
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return TensorType(a.dtype, None, a.kind)
    dims = tuple(x if x == y else None for x, y in zip(a.shape, b.shape, strict=True))
    return TensorType(a.dtype, dims, a.kind)


def _declared_outputs(body: Any) -> list[TensorType | None]:
    outputs = getattr(body, "outputs", None) or []
    return [getattr(v, "type", None) for v in outputs]


def _if_infer(inputs: _Types, attrs: Mapping[str, Any], values: _Values) -> list[TensorType | None]:
    then = _declared_outputs(attrs["then_branch"])
    other = _declared_outputs(attrs["else_branch"])
    if len(then) != len(other):
        raise InvalidArgumentError(f"If's branches give {len(then)} and {len(other)} outputs; "
                                   "they must give the same number")
    return [merge_types(a, b) for a, b in zip(then, other, strict=True)]


def _loop_infer(inputs: _Types, attrs: Mapping[str, Any],
                values: _Values) -> list[TensorType | None]:
    outs = _declared_outputs(attrs["body"])[1:]
    carried = len(getattr(attrs["body"], "inputs", [])) - 2
    result: list[TensorType | None] = []
    for k, t in enumerate(outs):
        if k < carried:
            given = inputs[2 + k] if 2 + k < len(inputs) else None
            result.append(merge_types(given, t) if given is not None and t is not None
                          else given or t)
        else:
            result.append(_stacked(t))
    return result


def _scan_infer(inputs: _Types, attrs: Mapping[str, Any],
                values: _Values) -> list[TensorType | None]:
    outs = _declared_outputs(attrs["body"])
    states = len(getattr(attrs["body"], "inputs", [])) - int(attrs["num_scan_inputs"])
    return [t if k < states else _stacked(t) for k, t in enumerate(outs)]


def _stacked(t: TensorType | None) -> TensorType | None:
    """A per-iteration value stacked along a new first axis of unknown length."""
    if t is None:
        return None
    return TensorType(t.dtype, None if t.shape is None else (None, *t.shape))


def _map_infer(inputs: _Types, attrs: Mapping[str, Any],
               values: _Values) -> list[TensorType | None]:
    return [None if t is None else TensorType(t.dtype, t.shape, ValueKind.SEQUENCE)
            for t in _declared_outputs(attrs["body"])]


for _op, _attrs, _infer, _min_in, _doc in (
    (Op.IF, (AttrSpec("then_branch", AttrKind.ANY, REQUIRED),
             AttrSpec("else_branch", AttrKind.ANY, REQUIRED)), _if_infer, 1,
     "ONNX If: runs then_branch when input 0 (one boolean) is true, else else_branch; "
     "the outputs are the branch's."),
    (Op.LOOP, (AttrSpec("body", AttrKind.ANY, REQUIRED),), _loop_infer, 2,
     "ONNX Loop: inputs M (trip count, optional), cond (optional) and the loop-carried "
     "values; the body runs while i < M and cond; outputs: the final carried values, then "
     "the body's scan outputs stacked along a new first axis."),
    (Op.SCAN, (AttrSpec("body", AttrKind.ANY, REQUIRED),
               AttrSpec("num_scan_inputs", AttrKind.INT, REQUIRED),
               AttrSpec("scan_input_axes", AttrKind.INTS, None),
               AttrSpec("scan_input_directions", AttrKind.INTS, None),
               AttrSpec("scan_output_axes", AttrKind.INTS, None),
               AttrSpec("scan_output_directions", AttrKind.INTS, None)), _scan_infer, 1,
     "ONNX Scan (opset 9+): the body runs once per slice of the scan inputs along their "
     "axes, carrying the state values; outputs: final states, then stacked scan outputs."),
    (Op.SEQUENCE_MAP, (AttrSpec("body", AttrKind.ANY, REQUIRED),), _map_infer, 1,
     "ONNX SequenceMap: the body runs once per element of the input sequence (sequence "
     "inputs give their element, tensors themselves); each output is a sequence."),
):
    register_schema(OpSchema(_op, _min_in, None, (*_attrs, _CAPTURES), infer=_infer,
                             min_outputs=1, max_outputs=MAX_OUTPUTS, doc=_doc))


# ---- sequences and optionals ----------------------------------------------------------
def _seq_of(t: TensorType | None) -> TensorType | None:
    return None if t is None else TensorType(t.dtype, t.shape, ValueKind.SEQUENCE)


def _construct_infer(inputs: _Types, attrs: Mapping[str, Any],
                     values: _Values) -> list[TensorType | None]:
    known = [t for t in inputs if t is not None]
    if not known:
        return [None]
    if len({t.dtype for t in known}) > 1:
        raise InvalidArgumentError("SequenceConstruct's inputs must share one dtype, got "
                                   + ", ".join(sorted({t.dtype.value for t in known})))
    merged: TensorType | None = known[0]
    for t in known[1:]:
        merged = merge_types(merged, t)
    return [_seq_of(merged)]


def _empty_infer(inputs: _Types, attrs: Mapping[str, Any],
                 values: _Values) -> list[TensorType | None]:
    dtype = attrs.get("dtype") or DType.FLOAT32
    return [TensorType(dtype, None, ValueKind.SEQUENCE)]


def _insert_infer(inputs: _Types, attrs: Mapping[str, Any],
                  values: _Values) -> list[TensorType | None]:
    seq, tensor = inputs[0], inputs[1]
    if seq is None:
        return [_seq_of(tensor)]
    if tensor is not None and tensor.dtype != seq.dtype:
        raise InvalidArgumentError(f"SequenceInsert puts a {tensor.dtype.value} tensor into "
                                   f"a sequence of {seq.dtype.value}")
    return [TensorType(seq.dtype, None, ValueKind.SEQUENCE)]


def _same_seq(inputs: _Types, attrs: Mapping[str, Any],
              values: _Values) -> list[TensorType | None]:
    t = inputs[0]
    return [None if t is None else TensorType(t.dtype, t.shape, ValueKind.SEQUENCE)]


def _at_infer(inputs: _Types, attrs: Mapping[str, Any],
              values: _Values) -> list[TensorType | None]:
    t = inputs[0]
    return [None if t is None else t.element()]


def _length_infer(inputs: _Types, attrs: Mapping[str, Any],
                  values: _Values) -> list[TensorType | None]:
    return [TensorType(DType.INT64, ())]


def _split_infer(inputs: _Types, attrs: Mapping[str, Any],
                 values: _Values) -> list[TensorType | None]:
    t = inputs[0]
    if t is None:
        return [None]
    rank = t.rank
    keep = bool(attrs.get("keepdims", True)) or (len(inputs) > 1 and inputs[1] is not None)
    shape = None if rank is None else tuple([None] * (rank if keep else rank - 1))
    return [TensorType(t.dtype, shape, ValueKind.SEQUENCE)]


def _concat_infer(inputs: _Types, attrs: Mapping[str, Any],
                  values: _Values) -> list[TensorType | None]:
    t = inputs[0]
    if t is None:
        return [None]
    rank = t.rank
    if rank is None:
        return [TensorType(t.dtype, None)]
    new = 1 if attrs.get("new_axis") else 0
    return [TensorType(t.dtype, tuple([None] * (rank + new)))]


def _optional_infer(inputs: _Types, attrs: Mapping[str, Any],
                    values: _Values) -> list[TensorType | None]:
    t = inputs[0] if inputs else None
    if t is None:
        t = attrs.get("type")
    if t is None:
        return [None]
    kind = ValueKind.OPTIONAL_SEQUENCE if t.kind in (ValueKind.SEQUENCE,
                                                     ValueKind.OPTIONAL_SEQUENCE) \
        else ValueKind.OPTIONAL
    return [TensorType(t.dtype, t.shape, kind)]


def _has_infer(inputs: _Types, attrs: Mapping[str, Any],
               values: _Values) -> list[TensorType | None]:
    return [TensorType(DType.BOOL, ())]


def _get_infer(inputs: _Types, attrs: Mapping[str, Any],
               values: _Values) -> list[TensorType | None]:
    t = inputs[0]
    if t is None:
        return [None]
    if t.kind is ValueKind.OPTIONAL_SEQUENCE:
        return [TensorType(t.dtype, t.shape, ValueKind.SEQUENCE)]
    if t.kind is ValueKind.OPTIONAL:
        return [t.element()]
    return [t]


for _seq_op, _lo, _hi, _seq_attrs, _seq_infer, _seq_doc in (
    (Op.SEQUENCE_CONSTRUCT, 1, None, (), _construct_infer,
     "A sequence of the inputs, in order (ONNX SequenceConstruct)."),
    (Op.SEQUENCE_EMPTY, 0, 0, (AttrSpec("dtype", AttrKind.DTYPE, None),), _empty_infer,
     "An empty sequence of 'dtype' (default float32) tensors (ONNX SequenceEmpty)."),
    (Op.SEQUENCE_INSERT, 2, 3, (), _insert_infer,
     "The sequence with the tensor inserted at 'position' (default: at the end)."),
    (Op.SEQUENCE_ERASE, 1, 2, (), _same_seq,
     "The sequence without the tensor at 'position' (default: the last)."),
    (Op.SEQUENCE_AT, 2, 2, (), _at_infer,
     "The tensor at 'position' of the sequence (negative counts from the end)."),
    (Op.SEQUENCE_LENGTH, 1, 1, (), _length_infer,
     "The number of tensors in the sequence, an int64 scalar."),
    (Op.SPLIT_TO_SEQUENCE, 1, 2, (AttrSpec("axis", AttrKind.INT, 0),
                                  AttrSpec("keepdims", AttrKind.BOOL, True)), _split_infer,
     "The input split along 'axis' into a sequence (ONNX SplitToSequence): by the sizes "
     "input 1 gives (a scalar: pieces of that size), else into pieces of size 1 "
     "(squeezed unless 'keepdims')."),
    (Op.CONCAT_FROM_SEQUENCE, 1, 1, (AttrSpec("axis", AttrKind.INT, REQUIRED),
                                     AttrSpec("new_axis", AttrKind.BOOL, False)),
     _concat_infer,
     "The sequence's tensors concatenated along 'axis' (stacked on a new axis when "
     "'new_axis')."),
    (Op.OPTIONAL, 0, 1, (AttrSpec("type", AttrKind.ANY, None),), _optional_infer,
     "An optional holding input 0, or an empty optional of 'type' (a TensorType)."),
    (Op.OPTIONAL_HAS_ELEMENT, 0, 1, (), _has_infer,
     "Whether the optional input holds a value (false for an absent input)."),
    (Op.OPTIONAL_GET_ELEMENT, 1, 1, (), _get_infer,
     "The value an optional holds (an empty one is an error); a tensor or sequence as "
     "it is."),
):
    register_schema(OpSchema(_seq_op, _lo, _hi, _seq_attrs, infer=_seq_infer, doc=_seq_doc))
