"""Reference kernels of control flow (If, Loop, Scan, SequenceMap) and of the sequence
and optional ops.

A control-flow kernel finds each subgraph in its attributes as a *body*: a
callable the executor binds when it compiles the node (``keel.execution.control``),
which runs the subgraph's compiled program on a list of values (the formal
inputs, then the captures) and returns its outputs. The kernels here hold only
the semantics: which branch, how many iterations, what is carried and stacked.

A sequence is a Python list of arrays (each owned by the list: tensors going in
are copied), an optional value the value itself or None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from keel.backends.base import KernelContext
from keel.backends.reference.kernels import TABLE
from keel.errors import ExecutionError, InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["Body"]

Attrs = Mapping[str, Any]
Inputs = Sequence[Any]
Out = Sequence[Any] | None


class Body(Protocol):
    """A compiled subgraph, as a control-flow kernel receives it."""

    n_outputs: int

    def __call__(self, values: Sequence[Any]) -> list[Any]: ...

    def output_type(self, index: int) -> TensorType | None: ...


def _split(inputs: Inputs, attrs: Attrs) -> tuple[list[Any], list[Any]]:
    """The node's own inputs and its captured ones (the last ``len(captures)``)."""
    n = len(attrs.get("captures") or ())
    cut = len(inputs) - n
    return list(inputs[:cut]), list(inputs[cut:])


def _truth(value: Any, what: str) -> bool:
    arr = np.asarray(value)
    if arr.size != 1:
        raise InvalidArgumentError(f"{what} must hold one element, got shape {arr.shape}")
    return bool(arr.reshape(-1)[0])


def _stacked(values: list[Any], body: Body, index: int, axis: int = 0,
             reverse: bool = False) -> np.ndarray:
    """Per-iteration values stacked along a new ``axis`` (an empty stack when none ran)."""
    if not values:
        t = body.output_type(index)
        dtype = np.float32 if t is None else t.dtype.numpy
        dims = [0] + ([int(d) if isinstance(d, int) else 0 for d in t.shape]
                      if t is not None and t.shape is not None else [])
        return np.empty(tuple(dims), dtype=dtype)
    arrays = [np.asarray(v) for v in (reversed(values) if reverse else values)]
    return np.stack(arrays, axis=axis)


@TABLE.kernel(Op.IF, host_only=True)
def if_(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Run the branch input 0 selects on the captured values."""
    own, caps = _split(inputs, attrs)
    branch: Body = attrs["then_branch" if _truth(own[0], "If's condition") else "else_branch"]
    return list(branch(caps))


@TABLE.kernel(Op.LOOP, host_only=True)
def loop(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Run the body while ``i < M`` and ``cond``; carry values, stack scan outputs."""
    own, caps = _split(inputs, attrs)
    own += [None] * (2 - len(own))
    trip, cond, carried = own[0], own[1], list(own[2:])
    limit = None if trip is None else int(np.asarray(trip).reshape(-1)[0])
    go = True if cond is None else _truth(cond, "Loop's condition")
    body: Body = attrs["body"]
    n_carried = len(carried)
    scans: list[list[Any]] = [[] for _ in range(body.n_outputs - 1 - n_carried)]
    i = 0
    while go and (limit is None or i < limit):
        result = body([np.array(i, dtype=np.int64), np.array(go), *carried, *caps])
        go = _truth(result[0], "the Loop body's condition output")
        carried = list(result[1:1 + n_carried])
        for acc, value in zip(scans, result[1 + n_carried:], strict=True):
            acc.append(value)
        i += 1
    return [*carried, *[_stacked(acc, body, 1 + n_carried + k) for k, acc in enumerate(scans)]]


@TABLE.kernel(Op.SCAN, host_only=True)
def scan(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Run the body once per slice of the scan inputs, carrying the states."""
    own, caps = _split(inputs, attrs)
    n_scan = int(attrs["num_scan_inputs"])
    n_states = len(own) - n_scan
    states, xs = list(own[:n_states]), [np.asarray(x) for x in own[n_states:]]
    axes = [_axis(a, x.ndim, "scan_input_axes") for a, x in
            zip(_per_input(attrs.get("scan_input_axes"), n_scan), xs, strict=True)]
    backward = _per_input(attrs.get("scan_input_directions"), n_scan)
    trips = {x.shape[a] for x, a in zip(xs, axes, strict=True)}
    if len(trips) != 1:
        raise InvalidArgumentError(f"Scan's inputs have different lengths {sorted(trips)} "
                                   "along their scan axes")
    trip = trips.pop()
    body: Body = attrs["body"]
    n_out = body.n_outputs - n_states
    collected: list[list[Any]] = [[] for _ in range(n_out)]
    for t in range(trip):
        slices = [np.take(x, trip - 1 - t if back else t, axis=a)
                  for x, a, back in zip(xs, axes, backward, strict=True)]
        result = body([*states, *slices, *caps])
        states = list(result[:n_states])
        for acc, value in zip(collected, result[n_states:], strict=True):
            acc.append(value)
    out_axes = _per_input(attrs.get("scan_output_axes"), n_out)
    out_back = _per_input(attrs.get("scan_output_directions"), n_out)
    stacked = []
    for k, acc in enumerate(collected):
        rank = np.asarray(acc[0]).ndim + 1 if acc else 1
        stacked.append(_stacked(acc, body, n_states + k,
                                _axis(out_axes[k], rank, "scan_output_axes"), bool(out_back[k])))
    return [*states, *stacked]


def _per_input(values: Sequence[int] | None, n: int) -> list[int]:
    got = list(values) if values else [0] * n
    if len(got) != n:
        raise InvalidArgumentError(f"Scan has {len(got)} axes or directions for {n} values")
    return got


def _axis(axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise InvalidArgumentError(f"Scan's {what} {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


@TABLE.kernel(Op.SEQUENCE_MAP, host_only=True)
def sequence_map(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """Run the body on each element of the input sequences; each output is a sequence."""
    own, caps = _split(inputs, attrs)
    lengths = {len(x) for x in own if isinstance(x, list)}
    if len(lengths) != 1:
        raise InvalidArgumentError(f"SequenceMap's sequences differ in length: {sorted(lengths)}")
    body: Body = attrs["body"]
    results: list[list[Any]] = [[] for _ in range(body.n_outputs)]
    for i in range(lengths.pop()):
        args = [x[i] if isinstance(x, list) else x for x in own]
        for acc, value in zip(results, body([*args, *caps]), strict=True):
            acc.append(np.array(value, copy=True))
    return results


# ---- sequences ---------------------------------------------------------------------
def _sequence(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidArgumentError(f"{what} needs a sequence, got {type(value).__name__}")
    return value


def _position(value: Any, length: int, *, end_ok: bool, what: str) -> int:
    pos = int(np.asarray(value).reshape(-1)[0])
    hi = length if end_ok else length - 1
    if not -length <= pos <= hi:
        raise InvalidArgumentError(f"{what} position {pos} is out of range for a sequence of "
                                   f"{length}")
    return pos + length if pos < 0 else pos


@TABLE.kernel(Op.SEQUENCE_CONSTRUCT, host_only=True)
def sequence_construct(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    return [[np.array(x, copy=True) for x in inputs]]


@TABLE.kernel(Op.SEQUENCE_EMPTY, host_only=True)
def sequence_empty(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    return [[]]


@TABLE.kernel(Op.SEQUENCE_INSERT, host_only=True)
def sequence_insert(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    seq = list(_sequence(inputs[0], "SequenceInsert"))
    pos = len(seq) if len(inputs) < 3 or inputs[2] is None else \
        _position(inputs[2], len(seq), end_ok=True, what="SequenceInsert")
    seq.insert(pos, np.array(inputs[1], copy=True))
    return [seq]


@TABLE.kernel(Op.SEQUENCE_ERASE, host_only=True)
def sequence_erase(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    seq = list(_sequence(inputs[0], "SequenceErase"))
    if not seq:
        raise InvalidArgumentError("SequenceErase on an empty sequence")
    pos = len(seq) - 1 if len(inputs) < 2 or inputs[1] is None else \
        _position(inputs[1], len(seq), end_ok=False, what="SequenceErase")
    del seq[pos]
    return [seq]


@TABLE.kernel(Op.SEQUENCE_AT, host_only=True)
def sequence_at(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    seq = _sequence(inputs[0], "SequenceAt")
    return [seq[_position(inputs[1], len(seq), end_ok=False, what="SequenceAt")]]


@TABLE.kernel(Op.SEQUENCE_LENGTH, host_only=True)
def sequence_length(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    return [np.array(len(_sequence(inputs[0], "SequenceLength")), dtype=np.int64)]


@TABLE.kernel(Op.SPLIT_TO_SEQUENCE, host_only=True)
def split_to_sequence(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x = np.asarray(inputs[0])
    axis = int(attrs.get("axis", 0))
    if not -x.ndim <= axis < max(x.ndim, 1):
        raise InvalidArgumentError(f"SplitToSequence axis {axis} is out of range for rank "
                                   f"{x.ndim}")
    axis = axis + x.ndim if axis < 0 else axis
    split = inputs[1] if len(inputs) > 1 else None
    if split is None:
        pieces = np.split(x, x.shape[axis], axis=axis)
        if not attrs.get("keepdims", True):
            pieces = [np.squeeze(p, axis=axis) for p in pieces]
        return [[np.array(p, copy=True) for p in pieces]]
    sizes = np.asarray(split).astype(np.int64)
    n = x.shape[axis]
    if sizes.ndim == 0:
        step = int(sizes)
        if step <= 0:
            raise InvalidArgumentError(f"SplitToSequence split {step} must be positive")
        bounds = list(range(step, n, step))
    else:
        if sizes.sum() != n or (sizes < 0).any():
            raise InvalidArgumentError(f"SplitToSequence sizes {sizes.tolist()} do not add "
                                       f"up to {n}")
        bounds = np.cumsum(sizes)[:-1].tolist()
    return [[np.array(p, copy=True) for p in np.split(x, bounds, axis=axis)]]


@TABLE.kernel(Op.CONCAT_FROM_SEQUENCE, host_only=True)
def concat_from_sequence(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                         out: Out) -> list[Any]:
    seq = _sequence(inputs[0], "ConcatFromSequence")
    if not seq:
        raise InvalidArgumentError("ConcatFromSequence of an empty sequence")
    axis = int(attrs["axis"])
    if attrs.get("new_axis"):
        return [np.stack(seq, axis=axis)]
    return [np.concatenate(seq, axis=axis)]


# ---- optionals ---------------------------------------------------------------------
@TABLE.kernel(Op.OPTIONAL, host_only=True)
def optional(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    value = inputs[0] if inputs else None
    return [None if value is None else
            list(value) if isinstance(value, list) else np.array(value, copy=True)]


@TABLE.kernel(Op.OPTIONAL_HAS_ELEMENT, host_only=True)
def optional_has_element(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                         out: Out) -> list[Any]:
    return [np.array(bool(inputs) and inputs[0] is not None)]


@TABLE.kernel(Op.OPTIONAL_GET_ELEMENT, host_only=True)
def optional_get_element(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                         out: Out) -> list[Any]:
    if inputs[0] is None:
        raise ExecutionError("OptionalGetElement of an empty optional")
    return [inputs[0]]
