"""Schemas of the indexing family, and the index rules their kernels share.

``index`` is seed 001's integer indexing: ``index(x, index=i, axis=0)`` takes
the slice ``i`` along ``axis`` and drops that axis (``x[i]`` for axis 0);
``i`` may be negative (``-1`` is the last), anything outside ``[-n, n)`` is
an :class:`InvalidArgumentError`. ``slice`` is ONNX Slice (starts, ends,
axes, steps as inputs 1..4, or as attributes for ``run_op`` callers), with
ONNX's clamping and negative steps. The other ops follow ONNX. Every
out-of-range index is an :class:`InvalidArgumentError` naming the op and the
index, never an ``IndexError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, InferFn, OpSchema, register_schema
from keel.ops.schemas.shape import Unknown, axes_list, host_ints, infer_param
from keel.ops.types import Dim, Shape, TensorType, normalize_axis

__all__ = [
    "REDUCTIONS",
    "SliceParams",
    "check_index",
    "check_index_dtype",
    "check_indices",
    "check_reduction",
    "compress_layout",
    "elements_check",
    "gather_nd_dims",
    "one_hot_depth",
    "one_hot_dims",
    "reverse_axes",
    "scatter_nd_depth",
    "sequence_lengths",
    "slice_dims",
    "slice_index",
    "slice_params",
    "topk_k",
    "updates_like",
]

Types = Sequence[TensorType | None]
Values = Sequence[Any]

# Scatter reductions and the NumPy ufunc names that apply them.
REDUCTIONS: Final = {"none": "", "add": "add", "mul": "multiply", "max": "maximum",
                     "min": "minimum"}


# ---- index checks (duck-typed: NumPy or CuPy arrays) -------------------------------

def check_index_dtype(op: str, indices: Any, what: str = "indices") -> None:
    """Indices must be an integer tensor."""
    kind = getattr(getattr(indices, "dtype", None), "kind", None)
    if kind not in ("i", "u"):
        raise InvalidArgumentError(
            f"{op}: {what} must be int32 or int64, got {getattr(indices, 'dtype', indices)!r}"
        )


def check_indices(op: str, indices: Any, size: int, what: str = "axis") -> None:
    """Every index must lie in ``[-size, size)``; otherwise name the first bad one."""
    check_index_dtype(op, indices)
    if indices.ndim == 0:                   # one index (shape arithmetic): no reductions
        lo = hi = int(indices)
    elif int(indices.size) == 0:
        return
    else:
        lo, hi = int(indices.min()), int(indices.max())
    if lo < -size or hi >= size:
        bad = lo if lo < -size else hi
        raise InvalidArgumentError(
            f"{op}: index {bad} is out of range for {what} of size {size}; "
            f"allowed: {-size}..{size - 1}"
        )


def check_index(op: str, index: int, size: Dim, axis: int) -> int:
    """One Python int index into an axis; returns it made non-negative."""
    if isinstance(size, int) and not -size <= index < size:
        raise InvalidArgumentError(
            f"{op}: index {index} is out of range for axis {axis} of size {size}; "
            f"allowed: {-size}..{size - 1}"
        )
    return index + size if index < 0 and isinstance(size, int) else index


# ---- slice -----------------------------------------------------------------------

SliceParams = dict[int, tuple[int, int, int]]   # axis -> (start, end, step), unclamped


def slice_params(
    op: str, rank: int, starts: Sequence[int], ends: Sequence[int],
    axes: Sequence[int] | None, steps: Sequence[int] | None,
) -> SliceParams:
    """Check ONNX Slice's parameters and pair them per axis."""
    n = len(starts)
    axes_t = tuple(range(n)) if axes is None else tuple(axes)
    steps_t = (1,) * n if steps is None else tuple(steps)
    if not len(ends) == len(axes_t) == len(steps_t) == n:
        raise InvalidArgumentError(
            f"{op}: starts, ends, axes, steps must have one length; got {n}, {len(ends)}, "
            f"{len(axes_t)}, {len(steps_t)}"
        )
    if 0 in steps_t:
        raise InvalidArgumentError(f"{op}: steps {steps_t} contain 0; a step must be non-zero")
    norm = axes_list(op, axes_t, rank)
    return {a: (int(s), int(e), int(st))
            for a, s, e, st in zip(norm, starts, ends, steps_t, strict=True)}


def _clamped(dim: int, start: int, end: int, step: int) -> tuple[int, int, int]:
    # Python's slice clamping is ONNX's: negatives count from the back, then
    # clamp to [0, dim] (step > 0) or [-1, dim - 1] (step < 0).
    return slice(start, end, step).indices(dim)


def slice_dims(shape: Shape, params: SliceParams) -> Shape:
    """Output dims; a sliced symbolic dim is unknown unless the slice takes it whole."""
    out: list[Dim] = []
    for axis, d in enumerate(shape):
        if axis not in params:
            out.append(d)
        elif isinstance(d, int):
            out.append(len(range(*_clamped(d, *params[axis]))))
        else:
            start, end, step = params[axis]
            whole = start == 0 and step == 1 and end >= 2**62
            out.append(d if whole else None)
    return tuple(out)


def slice_index(shape: Sequence[int], params: SliceParams) -> tuple[slice, ...]:
    """Python slices that implement the op on an array of ``shape``."""
    out = []
    for axis, d in enumerate(shape):
        if axis not in params:
            out.append(slice(None))
            continue
        start, end, step = _clamped(d, *params[axis])
        # A clamped end of -1 means "before element 0", which Python spells None.
        out.append(slice(start, end if end >= 0 else None, step))
    return tuple(out)


# ---- other shape rules ------------------------------------------------------------

def gather_nd_dims(op: str, data: Shape, indices: Shape, batch_dims: int) -> Shape | None:
    """ONNX GatherND's output dims; None when the index depth is not known."""
    if not indices or not isinstance(indices[-1], int):
        if not indices:
            raise InvalidArgumentError(f"{op}: indices must have rank >= 1")
        return None
    k = indices[-1]
    if batch_dims < 0 or batch_dims >= min(len(data), len(indices)):
        raise InvalidArgumentError(
            f"{op}: batch_dims {batch_dims} must be in 0..{min(len(data), len(indices)) - 1}"
        )
    if k < 1 or batch_dims + k > len(data):
        raise InvalidArgumentError(
            f"{op}: indices' last dim {k} indexes past the data rank {len(data)} "
            f"(batch_dims {batch_dims})"
        )
    for i in range(batch_dims):
        a, b = data[i], indices[i]
        if isinstance(a, int) and isinstance(b, int) and a != b:
            raise InvalidArgumentError(
                f"{op}: batch dim {i} differs: data {data}, indices {indices}"
            )
    return tuple(indices[:-1]) + tuple(data[batch_dims + k:])


def one_hot_dims(op: str, indices: Shape, depth: int, axis: int) -> Shape:
    if depth < 0:
        raise InvalidArgumentError(f"{op}: depth must be >= 0, got {depth}")
    ax = normalize_axis(axis, len(indices) + 1, what=f"{op} axis")
    return (*indices[:ax], depth, *indices[ax:])


def elements_check(op: str, data: Shape, indices: Shape, axis: int) -> int:
    """GatherElements/ScatterElements: same rank, index dims off ``axis`` ≤ data dims."""
    if len(data) != len(indices):
        raise InvalidArgumentError(
            f"{op}: indices of rank {len(indices)} for data of rank {len(data)}; ranks must match"
        )
    ax = normalize_axis(axis, len(data), what=f"{op} axis")
    for i, (d, k) in enumerate(zip(data, indices, strict=True)):
        if i != ax and isinstance(d, int) and isinstance(k, int) and k > d:
            raise InvalidArgumentError(
                f"{op}: indices shape {indices} exceeds data shape {data} on axis {i}"
            )
    return ax


def check_reduction(op: str, reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise InvalidArgumentError(
            f"{op}: unknown reduction {reduction!r}; allowed: {', '.join(REDUCTIONS)}"
        )
    return reduction


def updates_like(op: str, indices: tuple[int, ...], updates: tuple[int, ...]) -> None:
    """Updates must be shaped like the indices (ScatterElements)."""
    if tuple(indices) != tuple(updates):
        raise InvalidArgumentError(
            f"{op}: updates have shape {tuple(updates)}; they must match indices {tuple(indices)}"
        )


def scatter_nd_depth(op: str, data: tuple[int, ...], indices: tuple[int, ...],
                     updates: tuple[int, ...]) -> int:
    """ScatterND's index depth k, with updates shaped indices[:-1] + data[k:]."""
    if not indices or not 1 <= indices[-1] <= len(data):
        raise InvalidArgumentError(
            f"{op}: indices shape {indices} must end in a depth 1..{len(data)} (data rank)"
        )
    k = indices[-1]
    expected = tuple(indices[:-1]) + tuple(data[k:])
    if tuple(updates) != expected:
        raise InvalidArgumentError(
            f"{op}: updates have shape {tuple(updates)}; expected {expected}"
        )
    return k


def compress_layout(op: str, x: Any, condition: Any, axis: int | None) -> tuple[Any, int]:
    """(array to select from, axis); the condition must be bool and not too long."""
    if condition.dtype.kind != "b" or condition.ndim != 1:
        raise InvalidArgumentError(
            f"{op}: condition must be a 1-D bool tensor, got "
            f"{condition.dtype}{list(condition.shape)}"
        )
    flat, ax = (x.reshape(-1), 0) if axis is None else (
        x, normalize_axis(axis, x.ndim, what=f"{op} axis"))
    if condition.shape[0] > flat.shape[ax]:
        raise InvalidArgumentError(
            f"{op}: condition has {condition.shape[0]} entries; the axis has {flat.shape[ax]}"
        )
    return flat, ax


def sequence_lengths(op: str, seq: Any, batch: int, time: int) -> tuple[int, ...]:
    """The per-batch lengths, each in 0..time."""
    lens = host_ints(seq, op=op, what="sequence_lens")
    if len(lens) != batch:
        raise InvalidArgumentError(
            f"{op}: sequence_lens has {len(lens)} entries; the batch axis has {batch}")
    for n in lens:
        if not 0 <= n <= time:
            raise InvalidArgumentError(
                f"{op}: sequence length {n} is out of range; allowed: 0..{time}")
    return lens


# ---- infer functions --------------------------------------------------------------

def _x(types: Types) -> TensorType | None:
    return types[0] if types else None


def _infer_index(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None or x.shape is None:
        return [x]
    if not x.shape:
        raise InvalidArgumentError("index needs an input of rank >= 1, got a scalar")
    ax = normalize_axis(attrs["axis"], len(x.shape), what="index axis")
    check_index("index", attrs["index"], x.shape[ax], ax)
    return [TensorType(x.dtype, x.shape[:ax] + x.shape[ax + 1:])]


def _infer_slice(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    args = [infer_param("slice", types, values, i, attrs, name)
            for i, name in enumerate(("starts", "ends", "axes", "steps"), 1)]
    if args[0] is None or args[1] is None:
        raise InvalidArgumentError("slice needs starts and ends (inputs 1, 2 or attributes)")
    if x.shape is None or any(isinstance(a, Unknown) for a in args):
        return [TensorType(x.dtype, None if x.shape is None else (None,) * len(x.shape))]
    params = slice_params("slice", len(x.shape), *args)  # type: ignore[arg-type]
    return [TensorType(x.dtype, slice_dims(x.shape, params))]


def _infer_gather(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x, idx = _x(types), types[1] if len(types) > 1 else None
    if x is None:
        return [None]
    if idx is not None:
        _check_index_type("gather", idx)
    if x.shape is None or idx is None or idx.shape is None:
        return [TensorType(x.dtype, None)]
    ax = normalize_axis(attrs["axis"], len(x.shape), what="gather axis")
    return [TensorType(x.dtype, x.shape[:ax] + idx.shape + x.shape[ax + 1:])]


def _check_index_type(op: str, t: TensorType) -> None:
    if not t.dtype.is_int:
        raise InvalidArgumentError(f"{op}: indices must be int32 or int64, got {t.dtype.value}")


def _infer_gather_elements(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x, idx = types[0], types[1]
    if x is None:
        return [None]
    if idx is None or idx.shape is None or x.shape is None:
        return [TensorType(x.dtype, None if idx is None else idx.shape)]
    _check_index_type("gather_elements", idx)
    elements_check("gather_elements", x.shape, idx.shape, attrs["axis"])
    return [TensorType(x.dtype, idx.shape)]


def _infer_gather_nd(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x, idx = types[0], types[1]
    if x is None:
        return [None]
    if idx is None or idx.shape is None or x.shape is None:
        return [TensorType(x.dtype, None)]
    _check_index_type("gather_nd", idx)
    return [TensorType(x.dtype, gather_nd_dims("gather_nd", x.shape, idx.shape,
                                               attrs["batch_dims"]))]


def _infer_scatter(op: str) -> InferFn:
    def infer(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
        check_reduction(op, attrs["reduction"])
        x = _x(types)
        idx = types[1] if len(types) > 1 else None
        if idx is not None:
            _check_index_type(op, idx)
        return [x]
    return infer


def _infer_topk(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None, None]
    k = infer_param("topk", types, values, 1, attrs, "k")
    if k is None:
        raise InvalidArgumentError("topk needs k (input 1 or attribute 'k')")
    if x.shape is None:
        return [TensorType(x.dtype, None), TensorType(DType.INT64, None)]
    ax = normalize_axis(attrs["axis"], len(x.shape), what="topk axis")
    kd: Dim = None if isinstance(k, Unknown) else topk_k("topk", k, x.shape[ax])
    shape = (*x.shape[:ax], kd, *x.shape[ax + 1:])
    return [TensorType(x.dtype, shape), TensorType(DType.INT64, shape)]


def topk_k(op: str, k: Sequence[int], size: Dim) -> int:
    """The single k of TopK, checked against the axis size."""
    if len(k) != 1:
        raise InvalidArgumentError(f"{op}: k must hold one value, got {tuple(k)}")
    kk = int(k[0])
    if kk < 0 or (isinstance(size, int) and kk > size):
        raise InvalidArgumentError(f"{op}: k {kk} is out of range for an axis of size {size}")
    return kk


def _infer_nonzero(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    rank = None if x is None or x.shape is None else len(x.shape)
    return [TensorType(DType.INT64, (rank, None))]


def _infer_one_hot(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    idx, vals = types[0], types[2] if len(types) > 2 else None
    if vals is None:
        return [None]
    depth_value = values[1] if len(values) > 1 else None
    if idx is None or idx.shape is None:
        return [TensorType(vals.dtype, None)]
    if depth_value is None:
        ax = normalize_axis(attrs["axis"], len(idx.shape) + 1, what="one_hot axis")
        return [TensorType(vals.dtype, (*idx.shape[:ax], None, *idx.shape[ax:]))]
    depth = one_hot_depth("one_hot", depth_value)
    return [TensorType(vals.dtype, one_hot_dims("one_hot", idx.shape, depth, attrs["axis"]))]


def one_hot_depth(op: str, depth: Any) -> int:
    """OneHot's depth: one element, integer or float (floored as onnxruntime does)."""
    size = int(getattr(depth, "size", 0))
    if size != 1:
        raise InvalidArgumentError(f"{op}: depth must hold one element, got {size}")
    value = depth.reshape(-1).tolist()[0]
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{op}: depth must be a number, got {value!r}")
    return int(value)


def _infer_compress(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    if attrs["axis"] is None or x.shape is None:
        return [TensorType(x.dtype, (None,) if attrs["axis"] is None else None)]
    ax = normalize_axis(attrs["axis"], len(x.shape), what="compress axis")
    return [TensorType(x.dtype, (*x.shape[:ax], None, *x.shape[ax + 1:]))]


def _infer_reverse_sequence(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is not None and x.shape is not None:
        reverse_axes("reverse_sequence", len(x.shape), attrs)
    return [x]


def reverse_axes(op: str, rank: int, attrs: Mapping[str, Any]) -> tuple[int, int]:
    """(time_axis, batch_axis), checked: rank >= 2 and two different axes."""
    if rank < 2:
        raise InvalidArgumentError(f"{op} needs rank >= 2, got rank {rank}")
    t = normalize_axis(attrs["time_axis"], rank, what=f"{op} time_axis")
    b = normalize_axis(attrs["batch_axis"], rank, what=f"{op} batch_axis")
    if t == b:
        raise InvalidArgumentError(f"{op}: time_axis and batch_axis are both {t}")
    return t, b


def _infer_unique(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    i64 = DType.INT64
    if x is None:
        return [None, TensorType(i64, (None,)), TensorType(i64, (None,)),
                TensorType(i64, (None,))]
    axis = attrs["axis"]
    n: Dim
    if x.shape is None:
        y, n = TensorType(x.dtype, None), None
    elif axis is None:
        y, n = TensorType(x.dtype, (None,)), x.numel()
    else:
        ax = normalize_axis(axis, len(x.shape), what="unique axis")
        y, n = TensorType(x.dtype, (*x.shape[:ax], None, *x.shape[ax + 1:])), x.shape[ax]
    return [y, TensorType(i64, (None,)), TensorType(i64, (n,)), TensorType(i64, (None,))]


# ---- registration -----------------------------------------------------------------

def _register(op: Op, lo: int, hi: int | None, attrs: Sequence[AttrSpec], infer: InferFn,
              doc: str, **kw: Any) -> None:
    register_schema(OpSchema(op, lo, hi, attrs=tuple(attrs), infer=infer, doc=doc, **kw))


A = AttrSpec
K = AttrKind

_register(Op.INDEX, 1, 1, [A("index", K.INT, REQUIRED), A("axis", K.INT, 0)], _infer_index,
          "Seed 001 indexing: the slice at integer `index` along `axis` (default 0), with that "
          "axis removed (x[index] for axis 0). Negative indices count from the end.")
_register(Op.SLICE, 1, 5, [A("starts", K.INTS), A("ends", K.INTS), A("axes", K.INTS),
                           A("steps", K.INTS)], _infer_slice,
          "ONNX Slice: starts, ends, [axes], [steps] as inputs 1..4 (or attributes of those "
          "names); negative values count from the back, out-of-range ones clamp, steps may be "
          "negative.", value_inputs=(1, 2, 3, 4))
_register(Op.GATHER, 2, 2, [A("axis", K.INT, 0)], _infer_gather,
          "ONNX Gather: take `indices` (int32/int64, negative from the end) along `axis`; "
          "output dims = data[:axis] + indices + data[axis+1:].")
_register(Op.GATHER_ELEMENTS, 2, 2, [A("axis", K.INT, 0)], _infer_gather_elements,
          "ONNX GatherElements: out[i][j] = data[indices[i][j]][j] (axis 0); output shaped like "
          "indices.")
_register(Op.GATHER_ND, 2, 2, [A("batch_dims", K.INT, 0)], _infer_gather_nd,
          "ONNX GatherND with batch_dims.")
_register(Op.SCATTER_ELEMENTS, 3, 3, [A("axis", K.INT, 0), A("reduction", K.STR, "none")],
          _infer_scatter("scatter_elements"),
          "ONNX ScatterElements: a copy of data with updates written at indices along `axis`; "
          "reduction none (last write wins), add, mul, max, min.")
_register(Op.SCATTER_ND, 3, 3, [A("reduction", K.STR, "none")], _infer_scatter("scatter_nd"),
          "ONNX ScatterND: a copy of data with updates at index tuples; reduction none, add, mul, "
          "max, min.")
_register(Op.TOPK, 1, 2, [A("axis", K.INT, -1), A("largest", K.BOOL, True),
                          A("sorted", K.BOOL, True), A("k", K.INTS)], _infer_topk,
          "ONNX TopK: the k (input 1 or attribute `k`) largest (or smallest) values and their "
          "int64 indices along `axis`; equal values keep the lower index first. Output is "
          "always sorted (allowed for sorted=0).",
          min_outputs=2, max_outputs=2, value_inputs=(1,))
_register(Op.NONZERO, 1, 1, [], _infer_nonzero,
          "ONNX NonZero: int64 [rank, count] indices of non-zero elements, row-major order.")
_register(Op.ONE_HOT, 3, 3, [A("axis", K.INT, -1)], _infer_one_hot,
          "ONNX OneHot: inputs indices, depth, values=[off, on]; indices in [-depth, depth) "
          "(negative from the end), others give an all-off row.", value_inputs=(1,))
_register(Op.COMPRESS, 2, 2, [A("axis", K.INT)], _infer_compress,
          "ONNX Compress: keep the slices (or, without axis, the flat elements) where the bool "
          "condition is true; a short condition drops the rest.")
_register(Op.REVERSE_SEQUENCE, 2, 2, [A("batch_axis", K.INT, 1), A("time_axis", K.INT, 0)],
          _infer_reverse_sequence,
          "ONNX ReverseSequence: reverse the first sequence_lens[b] steps of each batch entry.")
_register(Op.UNIQUE, 1, 1, [A("sorted", K.BOOL, True), A("axis", K.INT)], _infer_unique,
          "ONNX Unique: outputs Y, first-occurrence indices, inverse indices, counts (int64); "
          "sorted=0 orders by first occurrence. Without axis the input is flattened.",
          min_outputs=1, max_outputs=4)
