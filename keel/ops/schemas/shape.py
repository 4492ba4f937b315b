"""Schemas of the shape family, and the shape rules their kernels share.

Shape-like parameters that ONNX passes as *inputs* (Reshape's shape, Tile's
repeats, Pad's pads, Split's sizes, Unsqueeze/Squeeze axes) are inputs here
too and are listed in ``value_inputs``. Callers of ``run_op`` may give them as
attributes of the same name instead (``shape=``, ``repeats=``, ``pads=``,
``split=``, ``axes=``); giving both is an error. The rule functions below
(``reshape_dims``, ``split_sizes``, ``pad_widths``, …) are used by ``infer``
and by every backend's kernels, so a shape is computed the same way
everywhere; they work on symbolic dims where that makes sense.

In ``infer``, an input index past the end of ``input_types`` is absent; a
``None`` type with no constant value at an earlier index is treated as a
present input of unknown value (never guessed to be absent).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeVar

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import REQUIRED, AttrKind, AttrSpec, InferFn, OpSchema, register_schema
from keel.ops.types import MAX_ELEMENTS, Dim, Shape, TensorType, broadcast_shapes, normalize_axis

__all__ = [
    "MANY_OUTPUTS",
    "UNKNOWN",
    "Unknown",
    "PAD_MODES",
    "axes_list",
    "BLOCK_MODES",
    "check_block_mode",
    "check_dims",
    "check_pad_mode",
    "check_same_dtype",
    "concat_dims",
    "depth_to_space_dims",
    "expand_dims_axes",
    "expand_dims_dims",
    "expand_shape",
    "fill_value",
    "flatten_dims",
    "host_ints",
    "host_scalar",
    "infer_param",
    "ints_param",
    "pad_constant",
    "pad_widths",
    "range_count",
    "range_values",
    "require",
    "reshape_dims",
    "shape_interval",
    "space_to_depth_dims",
    "split_layout",
    "split_sizes",
    "squeeze_dims",
    "static_dims",
    "tile_dims",
    "transpose_perm",
    "trilu_k",
]

# Upper bound on the outputs of a variadic-output op (Split).
MANY_OUTPUTS: Final = 1 << 16

Types = Sequence[TensorType | None]
Values = Sequence[Any]


class Unknown:
    """Marks a parameter given as an input whose value is not known before running."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = Unknown()
ParamT = TypeVar("ParamT", tuple[int, ...] | None, tuple[int, ...] | Unknown | None)


# ---- parameters given as an input or as an attribute ------------------------

def host_ints(value: Any, *, op: str, what: str) -> tuple[int, ...]:
    """The integers of a shape-like tensor (NumPy or CuPy) as Python ints, flattened."""
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if kind not in ("i", "u"):
        dtype = getattr(value, "dtype", type(value).__name__)
        raise InvalidArgumentError(f"{op}: {what} must be an integer tensor, got {dtype}")
    # .tolist() works the same on NumPy and CuPy arrays (one device→host copy).
    return tuple(int(v) for v in value.reshape(-1).tolist())


def host_scalar(value: Any, *, op: str, what: str) -> Any:
    """The single element of a 1-element tensor as a Python scalar."""
    size = int(getattr(value, "size", 0))
    if size != 1:
        shape = tuple(getattr(value, "shape", ()))
        raise InvalidArgumentError(f"{op}: {what} must hold exactly one element, got shape {shape}")
    return value.reshape(-1).tolist()[0]


def _both_given(op: str, index: int, name: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{op}: {name} was given both as input {index} and as attribute {name!r}; give one"
    )


def ints_param(
    op: str, inputs: Sequence[Any], index: int, attrs: Mapping[str, Any], name: str
) -> tuple[int, ...] | None:
    """Kernel side: the ints of input ``index`` or of attribute ``name``; None if neither."""
    given = inputs[index] if index < len(inputs) else None
    attr = attrs.get(name)
    if given is not None and attr is not None:
        raise _both_given(op, index, name)
    if given is not None:
        return host_ints(given, op=op, what=f"{name} (input {index})")
    return None if attr is None else tuple(attr)


def infer_param(
    op: str, types: Types, values: Values, index: int, attrs: Mapping[str, Any], name: str
) -> tuple[int, ...] | Unknown | None:
    """Infer side of :func:`ints_param`: UNKNOWN when the input is present but not constant."""
    attr = attrs.get(name)
    if index >= len(types):
        return None if attr is None else tuple(attr)
    value = values[index] if index < len(values) else None
    if value is not None:
        if attr is not None:
            raise _both_given(op, index, name)
        return host_ints(np.asarray(value), op=op, what=f"{name} (input {index})")
    if types[index] is None and attr is not None:
        return tuple(attr)          # the slot is empty and the attribute is given
    return UNKNOWN


def require(value: tuple[int, ...] | None, op: str, what: str) -> tuple[int, ...]:
    """A parameter that must be given (as an input or an attribute)."""
    if value is None:
        raise InvalidArgumentError(f"{op} needs {what}, got neither an input nor an attribute")
    return value


def static_dims(shape: Shape) -> tuple[int, ...]:
    """A shape whose dims are all known ints (computed from a concrete array's shape)."""
    dims = tuple(d for d in shape if isinstance(d, int))
    if len(dims) != len(shape):
        raise InvalidArgumentError(f"shape {shape} has unknown dims where concrete ones are needed")
    return dims


def _param_length(types: Types, index: int) -> int | None:
    """The static length of a 1-D shape-like input, from its type."""
    if index >= len(types) or types[index] is None:
        return None
    shape = types[index].shape  # type: ignore[union-attr]
    if shape is not None and len(shape) == 1 and isinstance(shape[0], int):
        return shape[0]
    return None


def axes_list(op: str, axes: Sequence[int], rank: int) -> list[int]:
    """Normalize ``axes`` against ``rank``; duplicates are an error."""
    norm = [normalize_axis(int(a), rank, what=f"{op} axis") for a in axes]
    if len(set(norm)) != len(norm):
        raise InvalidArgumentError(f"{op}: axes {tuple(axes)} repeat an axis (rank {rank})")
    return norm


# ---- checked arithmetic -------------------------------------------------------

def _checked_mul(a: int, b: int, what: str) -> int:
    out = a * b
    if out > MAX_ELEMENTS:
        raise InvalidArgumentError(f"{what}: {a} * {b} exceeds {MAX_ELEMENTS} (overflow)")
    return out


def _product(dims: Sequence[Dim], what: str) -> int | None:
    """Checked product of dims; None when any is not a known int."""
    total = 1
    for d in dims:
        if not isinstance(d, int):
            return None
        total = _checked_mul(total, d, what)
    return total


def check_dims(op: str, dims: Sequence[int], what: str) -> tuple[int, ...]:
    for d in dims:
        if d < 0:
            raise InvalidArgumentError(f"{op}: {what} {tuple(dims)} has a negative entry {d}")
    _product(dims, f"{op} {what} {tuple(dims)}")
    return tuple(dims)


# ---- shape rules -------------------------------------------------------------

def reshape_dims(op: str, shape: Shape, target: Sequence[int], allowzero: bool) -> Shape:
    """ONNX Reshape: 0 copies the input dim (unless ``allowzero``), one -1 is inferred."""
    out: list[Dim] = []
    infer_at: int | None = None
    for i, t in enumerate(target):
        if t == -1:
            if infer_at is not None:
                raise InvalidArgumentError(f"{op}: shape {tuple(target)} has more than one -1")
            infer_at = i
            out.append(None)
        elif t == 0 and not allowzero:
            if i >= len(shape):
                raise InvalidArgumentError(
                    f"{op}: shape {tuple(target)} copies dim {i} (0) but the input has "
                    f"rank {len(shape)}"
                )
            out.append(shape[i])
        elif t < 0:
            raise InvalidArgumentError(
                f"{op}: shape {tuple(target)} has {t}; allowed: -1, 0 or a positive size"
            )
        else:
            out.append(t)
    if allowzero and infer_at is not None and 0 in target:
        raise InvalidArgumentError(
            f"{op}: shape {tuple(target)} has both -1 and 0 with allowzero=1"
        )
    return _resolve_reshape(op, shape, tuple(out), infer_at, target)


def _resolve_reshape(
    op: str, shape: Shape, out: Shape, infer_at: int | None, target: Sequence[int]
) -> Shape:
    what = f"{op} shape {tuple(target)}"
    total = _product(shape, f"{op} input {shape}")
    if infer_at is None:
        known = _product(out, what)
        if total is not None and known is not None and known != total:
            raise InvalidArgumentError(
                f"{op}: cannot reshape {total} elements (shape {shape}) into {tuple(out)}"
            )
        return out
    rest = out[:infer_at] + out[infer_at + 1:]
    known = _product(rest, what)
    if known is None or total is None:
        inferred = _cancel_symbols(shape, rest, what)
    else:
        if known == 0 or total % known:
            raise InvalidArgumentError(
                f"{op}: cannot infer -1 in {tuple(target)} for {total} elements (shape {shape})"
            )
        inferred = total // known
    return (*out[:infer_at], inferred, *out[infer_at + 1:])


def _cancel_symbols(shape: Shape, rest: Shape, what: str) -> Dim:
    """The -1 dim when the symbolic dims of the other side cancel: the same ones on both
    sides ([b, 3, 4] → [b, -1]: 12), or one left over whose sizes cancel too ([b, s, 4,
    64] → [b, -1, 256]: s)."""
    if None in shape or None in rest:
        return None
    left = Counter(d for d in shape if isinstance(d, str))
    right = Counter(d for d in rest if isinstance(d, str))
    if right - left:
        return None
    num = _product([d for d in shape if isinstance(d, int)], what)
    den = _product([d for d in rest if isinstance(d, int)], what)
    if num is None or not den or num % den:
        return None
    over = list((left - right).elements())
    if not over:
        return num // den
    return over[0] if len(over) == 1 and num == den else None


def expand_dims_dims(op: str, shape: Shape, axes: Sequence[int]) -> Shape:
    """Unsqueeze: insert size-1 dims at ``axes`` (normalized against the output rank)."""
    rank = len(shape) + len(axes)
    norm = set(axes_list(op, axes, rank))
    it = iter(shape)
    return tuple(1 if i in norm else next(it) for i in range(rank))


def squeeze_dims(op: str, shape: Shape, axes: Sequence[int] | None) -> Shape | None:
    """Remove ``axes`` (each must be 1), or every size-1 dim; None if that depends on symbols."""
    if axes is None:
        if any(not isinstance(d, int) for d in shape):
            return None
        return tuple(d for d in shape if d != 1)
    norm = set(axes_list(op, axes, len(shape)))
    for a in sorted(norm):
        if isinstance(shape[a], int) and shape[a] != 1:
            raise InvalidArgumentError(
                f"{op}: cannot squeeze axis {a} of size {shape[a]} (shape {shape}); "
                "only size-1 axes can be squeezed"
            )
    return tuple(d for i, d in enumerate(shape) if i not in norm)


def transpose_perm(op: str, perm: Sequence[int] | None, rank: int) -> tuple[int, ...]:
    """A full permutation of ``range(rank)``; default reverses the axes."""
    if perm is None:
        return tuple(range(rank - 1, -1, -1))
    if len(perm) != rank:
        raise InvalidArgumentError(
            f"{op}: perm {tuple(perm)} has {len(perm)} entries for rank {rank}"
        )
    norm = axes_list(op, perm, rank)
    return tuple(norm)


def flatten_dims(op: str, shape: Shape, axis: int) -> Shape:
    rank = len(shape)
    if not -rank <= axis <= rank:
        raise InvalidArgumentError(f"{op}: axis {axis} is out of range; allowed: {-rank}..{rank}")
    axis = axis + rank if axis < 0 else axis
    return (_product(shape[:axis], f"{op} {shape}"), _product(shape[axis:], f"{op} {shape}"))


def tile_dims(op: str, shape: Shape, repeats: Sequence[int]) -> Shape:
    if len(repeats) != len(shape):
        raise InvalidArgumentError(
            f"{op}: repeats {tuple(repeats)} has {len(repeats)} entries; the input has rank "
            f"{len(shape)}"
        )
    check_dims(op, repeats, "repeats")
    out = tuple(d * r if isinstance(d, int) else (d if r == 1 else None)
                for d, r in zip(shape, repeats, strict=True))
    _product(out, f"{op} output {out}")
    return out


def split_sizes(
    op: str, dim: int, split: Sequence[int] | None, num_outputs: int | None
) -> tuple[int, ...]:
    """Sizes of Split's outputs: explicit ``split``, or ``num_outputs`` ceil-sized chunks."""
    if split is not None and num_outputs is not None:
        raise InvalidArgumentError(f"{op}: give split sizes or num_outputs, not both")
    if split is not None:
        check_dims(op, split, "split")
        if sum(split) != dim:
            raise InvalidArgumentError(
                f"{op}: split {tuple(split)} sums to {sum(split)}; the axis has size {dim}"
            )
        return tuple(split)
    if num_outputs is None:
        raise InvalidArgumentError(
            f"{op} needs split sizes or num_outputs (the number of outputs), got neither"
        )
    if num_outputs < 1:
        raise InvalidArgumentError(f"{op}: num_outputs must be >= 1, got {num_outputs}")
    chunk = -(-dim // num_outputs)
    last = dim - chunk * (num_outputs - 1)
    if last < 0:
        raise InvalidArgumentError(
            f"{op}: an axis of size {dim} cannot be split into {num_outputs} chunks of {chunk}"
        )
    return (chunk,) * (num_outputs - 1) + (last,)


PAD_MODES: Final = ("constant", "reflect", "edge", "wrap")


def pad_widths(
    op: str, shape: Shape, pads: Sequence[int], axes: Sequence[int] | None
) -> list[tuple[int, int]]:
    """Per-dim (before, after) from ONNX pads ``[b1, b2, …, e1, e2, …]`` over ``axes``."""
    rank = len(shape)
    axes_n = list(range(rank)) if axes is None else axes_list(op, axes, rank)
    if len(pads) != 2 * len(axes_n):
        raise InvalidArgumentError(
            f"{op}: pads {tuple(pads)} has {len(pads)} entries; expected {2 * len(axes_n)} "
            f"(2 per padded axis)"
        )
    widths = [(0, 0)] * rank
    for i, a in enumerate(axes_n):
        widths[a] = (int(pads[i]), int(pads[i + len(axes_n)]))
    for d, (b, e) in zip(shape, widths, strict=True):
        if isinstance(d, int) and d + b + e < 0:
            raise InvalidArgumentError(
                f"{op}: pads {tuple(pads)} remove more than the {d} elements of an axis"
            )
    return widths


def check_pad_mode(op: str, mode: str, shape: Sequence[int],
                   widths: Sequence[tuple[int, int]]) -> None:
    """Mode limits (as onnxruntime): reflect ≤ size-1, edge/wrap need a non-empty axis."""
    if mode not in PAD_MODES:
        raise InvalidArgumentError(f"{op}: unknown mode {mode!r}; allowed: {', '.join(PAD_MODES)}")
    if mode == "constant":
        return
    for axis, (d, (b, e)) in enumerate(zip(shape, widths, strict=True)):
        kept = d + min(b, 0) + min(e, 0)          # negative pads crop first
        grow = max(b, e, 0)
        if grow and kept == 0:
            raise InvalidArgumentError(f"{op}: mode {mode!r} cannot pad axis {axis}: it is empty")
        if mode == "reflect" and grow > kept - 1:
            raise InvalidArgumentError(
                f"{op}: mode 'reflect' pads axis {axis} by {grow}; allowed at most {kept - 1} "
                f"(axis size {kept})"
            )


def pad_constant(inputs: Sequence[Any], attrs: Mapping[str, Any]) -> Any:
    """Pad's constant: input 2, or attribute ``value``, or 0."""
    given = inputs[2] if len(inputs) > 2 else None
    if given is not None and attrs["value"] is not None:
        raise _both_given("pad", 2, "value")
    if given is not None:
        return host_scalar(given, op="pad", what="constant_value (input 2)")
    return 0 if attrs["value"] is None else attrs["value"]


def trilu_k(inputs: Sequence[Any], attrs: Mapping[str, Any]) -> int:
    """Trilu's diagonal: input 1, or attribute ``k``, or 0."""
    given = inputs[1] if len(inputs) > 1 else None
    if given is not None and attrs["k"] is not None:
        raise _both_given("trilu", 1, "k")
    if given is None:
        return 0 if attrs["k"] is None else int(attrs["k"])
    value = host_scalar(given, op="trilu", what="k (input 1)")
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"trilu: k must be an integer, got {value!r}")
    return value


def depth_to_space_dims(op: str, shape: Shape, blocksize: int) -> Shape:
    n, c, h, w = _rank4(op, shape)
    _check_block(op, blocksize)
    if isinstance(c, int) and c % (blocksize * blocksize):
        raise InvalidArgumentError(
            f"{op}: channels {c} are not divisible by blocksize² = {blocksize * blocksize}"
        )
    return (n, _div(c, blocksize * blocksize), _mul(h, blocksize, op), _mul(w, blocksize, op))


BLOCK_MODES: Final = ("DCR", "CRD")


def check_block_mode(op: str, mode: str) -> str:
    """DepthToSpace/SpaceToDepth order: DCR (depth-column-row) or CRD (column-row-depth)."""
    if mode not in BLOCK_MODES:
        raise InvalidArgumentError(f"{op}: unknown mode {mode!r}; allowed: DCR, CRD")
    return mode


def space_to_depth_dims(op: str, shape: Shape, blocksize: int) -> Shape:
    n, c, h, w = _rank4(op, shape)
    _check_block(op, blocksize)
    for d in (h, w):
        if isinstance(d, int) and d % blocksize:
            raise InvalidArgumentError(
                f"{op}: spatial dims {(h, w)} are not divisible by blocksize {blocksize}"
            )
    return (n, _mul(c, blocksize * blocksize, op), _div(h, blocksize), _div(w, blocksize))


def depth_to_space_blocks(x: Any, blocksize: int, mode: str) -> tuple[Any, tuple[int, ...]]:
    """DepthToSpace of the NCHW array ``x`` (anything with ``reshape``/``transpose``) as a
    6-D permuted view whose elements, read in order, are the output's, and the output's
    shape (checked)."""
    check_block_mode("depth_to_space", mode)
    final = static_dims(depth_to_space_dims("depth_to_space", x.shape, blocksize))
    n, c, h, w = x.shape
    b = blocksize
    if mode == "DCR":
        return x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2), final
    return x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3), final


def space_to_depth_blocks(x: Any, blocksize: int, mode: str) -> tuple[Any, tuple[int, ...]]:
    """SpaceToDepth of ``x`` as :func:`depth_to_space_blocks` gives DepthToSpace (the
    inverse in the same mode)."""
    final = static_dims(space_to_depth_dims("space_to_depth", x.shape, blocksize))
    n, c, h, w = x.shape
    b = blocksize
    perm = (0, 3, 5, 1, 2, 4) if check_block_mode("space_to_depth", mode) == "DCR" \
        else (0, 1, 3, 5, 2, 4)
    return x.reshape(n, c, h // b, b, w // b, b).transpose(perm), final


def _rank4(op: str, shape: Shape) -> Shape:
    if len(shape) != 4:
        raise InvalidArgumentError(f"{op} needs a rank-4 NCHW input, got shape {shape}")
    return shape


def _check_block(op: str, blocksize: int) -> None:
    if blocksize < 1:
        raise InvalidArgumentError(f"{op}: blocksize must be >= 1, got {blocksize}")


def _div(d: Dim, k: int) -> Dim:
    return d // k if isinstance(d, int) else None


def _mul(d: Dim, k: int, op: str) -> Dim:
    return _checked_mul(d, k, op) if isinstance(d, int) else None


def shape_interval(rank: int, start: int, end: int | None) -> tuple[int, int]:
    """ONNX Shape's [start, end): negative counts from the back, both clamped to [0, rank]."""
    def clamp(v: int) -> int:
        return min(max(v + rank if v < 0 else v, 0), rank)
    lo, hi = clamp(start), rank if end is None else clamp(end)
    return lo, max(lo, hi)


def range_count(op: str, start: Any, limit: Any, delta: Any) -> int:
    """ONNX Range's element count ``max(ceil((limit - start) / delta), 0)``, checked."""
    if delta == 0:
        raise InvalidArgumentError(f"{op}: delta must not be 0")
    if all(isinstance(v, int) for v in (start, limit, delta)):
        count = max(-((start - limit) // delta), 0)    # exact ceil for ints
    else:
        span = float(limit) - float(start)
        if not math.isfinite(span / float(delta)):
            raise InvalidArgumentError(
                f"{op}: start {start}, limit {limit}, delta {delta} do not give a finite count"
            )
        count = max(math.ceil(span / float(delta)), 0)
    if count > MAX_ELEMENTS:
        raise InvalidArgumentError(f"{op}: {count} elements exceed {MAX_ELEMENTS} (overflow)")
    return count


def range_values(op: str, inputs: Sequence[Any]) -> np.ndarray:
    """Range's values from its three scalar inputs (read on the host), in their dtype."""
    check_same_dtype(op, [x.dtype for x in inputs])
    start, limit, delta = (host_scalar(x, op=op, what=name)
                           for x, name in zip(inputs, ("start", "limit", "delta"), strict=True))
    count = range_count(op, start, limit, delta)
    dtype = inputs[0].dtype
    if dtype.kind in "iu":
        return (start + np.arange(count, dtype=np.int64) * delta).astype(dtype)
    return (np.float64(start) + np.arange(count, dtype=np.float64) * np.float64(delta)
            ).astype(dtype)


def split_layout(op: str, shape: Sequence[int], inputs: Sequence[Any],
                 attrs: Mapping[str, Any], outputs: Sequence[Any] | None
                 ) -> tuple[int, tuple[int, ...]]:
    """Split's axis and output sizes (the count from ``outputs`` when nothing else says)."""
    axis = normalize_axis(attrs["axis"], len(shape), what="split axis")
    num = attrs["num_outputs"]
    given = ints_param(op, inputs, 1, attrs, "split")
    if given is None and num is None and outputs is not None:
        num = len(outputs)
    return axis, split_sizes(op, shape[axis], given, num)


# ---- infer functions ---------------------------------------------------------

def _x(types: Types) -> TensorType | None:
    return types[0] if types else None


def _infer_reshape(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    target = infer_param("reshape", types, values, 1, attrs, "shape")
    if target is None:
        raise InvalidArgumentError("reshape needs a shape (input 1 or attribute 'shape')")
    if isinstance(target, Unknown):
        n = _param_length(types, 1)
        return [TensorType(x.dtype, None if n is None else (None,) * n)]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    return [TensorType(x.dtype, reshape_dims("reshape", x.shape, target, attrs["allowzero"]))]


def expand_dims_axes(op: str, axes: ParamT, axis: int | None) -> ParamT | tuple[int, ...]:
    """Unsqueeze's axes from ``axes`` (input 1 or attribute) or seed 001's ``axis``."""
    if axis is not None:
        if axes is not None:
            raise InvalidArgumentError(f"{op}: give 'axis' or 'axes', not both")
        return (axis,)
    return axes


def _infer_expand_dims(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    axes = expand_dims_axes(
        "expand_dims", infer_param("expand_dims", types, values, 1, attrs, "axes"), attrs["axis"])
    if axes is None:
        raise InvalidArgumentError("expand_dims needs 'axis' or axes (input 1 or attribute)")
    if isinstance(axes, Unknown) or x.shape is None:
        n = _param_length(types, 1)
        rank = None if x.shape is None or n is None else len(x.shape) + n
        return [TensorType(x.dtype, None if rank is None else (None,) * rank)]
    return [TensorType(x.dtype, expand_dims_dims("expand_dims", x.shape, axes))]


def _infer_squeeze(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    axes = infer_param("squeeze", types, values, 1, attrs, "axes")
    if isinstance(axes, Unknown) or x.shape is None:
        return [TensorType(x.dtype, None)]
    return [TensorType(x.dtype, squeeze_dims("squeeze", x.shape, axes))]


def _infer_transpose(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None or x.shape is None:
        return [x]
    perm = transpose_perm("transpose", attrs["perm"], len(x.shape))
    return [TensorType(x.dtype, tuple(x.shape[p] for p in perm))]


def _infer_flatten(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None or x.shape is None:
        return [None if x is None else TensorType(x.dtype, (None, None))]
    return [TensorType(x.dtype, flatten_dims("flatten", x.shape, attrs["axis"]))]


def _infer_expand(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    shape = infer_param("expand", types, values, 1, attrs, "shape")
    if shape is None:
        raise InvalidArgumentError("expand needs a shape (input 1 or attribute 'shape')")
    if isinstance(shape, Unknown) or x.shape is None:
        n = _param_length(types, 1)
        rank = None if x.shape is None or n is None else max(len(x.shape), n)
        return [TensorType(x.dtype, None if rank is None else (None,) * rank)]
    return [TensorType(x.dtype, expand_shape("expand", x.shape, shape))]


def expand_shape(op: str, shape: Shape, target: Sequence[int]) -> Shape:
    """ONNX Expand: bidirectional broadcast of the input shape with ``target``."""
    check_dims(op, target, "shape")
    try:
        out = broadcast_shapes(shape, tuple(target))
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"{op}: input shape {tuple(shape)} cannot be broadcast to {tuple(target)}"
        ) from None
    _product(out, f"{op} output {out}")
    return out


def _infer_shape(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None or x.shape is None:
        return [TensorType(DType.INT64, (None,))]
    lo, hi = shape_interval(len(x.shape), attrs["start"], attrs["end"])
    return [TensorType(DType.INT64, (hi - lo,))]


def _infer_size(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    return [TensorType(DType.INT64, ())]


def concat_dims(op: str, shapes: Sequence[Shape], axis: int) -> Shape:
    """Concat's output shape; every input has the same rank and dims off ``axis``."""
    rank = len(shapes[0])
    ax = normalize_axis(axis, rank, what=f"{op} axis")
    out: list[Dim] = list(shapes[0])
    for s in shapes[1:]:
        if len(s) != rank:
            raise InvalidArgumentError(f"{op}: inputs have ranks {len(shapes[0])} and {len(s)}")
        for i, (a, b) in enumerate(zip(out, s, strict=True)):
            if i != ax and isinstance(a, int) and isinstance(b, int) and a != b:
                raise InvalidArgumentError(
                    f"{op}: shapes {tuple(shapes[0])} and {tuple(s)} differ off axis {ax}"
                )
            if i != ax and not isinstance(a, int):
                out[i] = b
    along = [s[ax] for s in shapes]
    if all(isinstance(d, int) for d in along):
        total = sum(d for d in along if isinstance(d, int))
        if total > MAX_ELEMENTS:
            raise InvalidArgumentError(f"{op}: the joined axis has {total} elements (overflow)")
        out[ax] = total
    else:
        out[ax] = None
    return tuple(out)


def check_same_dtype(op: str, dtypes: Sequence[Any]) -> None:
    first = dtypes[0] if dtypes else None
    if all(d == first for d in dtypes):    # the usual case, without naming each dtype
        return
    if len({str(d) for d in dtypes}) > 1:
        raise InvalidArgumentError(
            f"{op}: inputs must share one dtype, got {', '.join(str(d) for d in dtypes)}"
        )


def _infer_concat(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    if any(t is None for t in types):
        known = [t for t in types if t is not None]
        return [TensorType(known[0].dtype, None) if known else None]
    ts = [t for t in types if t is not None]
    check_same_dtype("concat", [t.dtype.value for t in ts])
    if any(t.shape is None for t in ts):
        return [TensorType(ts[0].dtype, None)]
    shapes = [t.shape for t in ts if t.shape is not None]
    return [TensorType(ts[0].dtype, concat_dims("concat", shapes, attrs["axis"]))]


def _infer_split(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    split = infer_param("split", types, values, 1, attrs, "split")
    n = attrs["num_outputs"]
    if isinstance(split, tuple):
        n = len(split)
    elif isinstance(split, Unknown):
        n = _param_length(types, 1)
    if x is None or n is None:
        # Without split sizes or num_outputs the count comes from the node's outputs.
        return [None] * (n or 1)
    if x.shape is None or isinstance(split, Unknown):
        return [TensorType(x.dtype, None)] * n
    ax = normalize_axis(attrs["axis"], len(x.shape), what="split axis")
    dim = x.shape[ax]
    if not isinstance(dim, int):
        sizes: Sequence[Dim] = split if split is not None else (None,) * n
    else:
        sizes = split_sizes("split", dim, split, None if split is not None else n)
    return [TensorType(x.dtype, (*x.shape[:ax], s, *x.shape[ax + 1:])) for s in sizes]


def _infer_tile(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    repeats = infer_param("tile", types, values, 1, attrs, "repeats")
    if repeats is None:
        raise InvalidArgumentError("tile needs repeats (input 1 or attribute 'repeats')")
    if x.shape is None or isinstance(repeats, Unknown):
        return [TensorType(x.dtype, None if x.shape is None else (None,) * len(x.shape))]
    return [TensorType(x.dtype, tile_dims("tile", x.shape, repeats))]


def _infer_pad(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    if attrs["mode"] not in PAD_MODES:
        raise InvalidArgumentError(
            f"pad: unknown mode {attrs['mode']!r}; allowed: {', '.join(PAD_MODES)}")
    pads = infer_param("pad", types, values, 1, attrs, "pads")
    axes = infer_param("pad", types, values, 3, attrs, "axes")
    if pads is None:
        raise InvalidArgumentError("pad needs pads (input 1 or attribute 'pads')")
    if x.shape is None or isinstance(pads, Unknown) or isinstance(axes, Unknown):
        return [TensorType(x.dtype, None if x.shape is None else (None,) * len(x.shape))]
    widths = pad_widths("pad", x.shape, pads, axes)
    out = tuple(d + b + e if isinstance(d, int) else (d if b == e == 0 else None)
                for d, (b, e) in zip(x.shape, widths, strict=True))
    _product(out, f"pad output {out}")
    return [TensorType(x.dtype, out)]


def _infer_d2s(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None or x.shape is None:
        return [x]
    check_block_mode("depth_to_space", attrs["mode"])
    return [TensorType(x.dtype, depth_to_space_dims("depth_to_space", x.shape, attrs["blocksize"]))]


def _infer_s2d(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    check_block_mode("space_to_depth", attrs["mode"])
    if x is None or x.shape is None:
        return [x]
    return [TensorType(x.dtype, space_to_depth_dims("space_to_depth", x.shape, attrs["blocksize"]))]


def fill_value(op: str, value: Any) -> np.ndarray:
    """ConstantOfShape's 1-element ``value`` (default float32 0) as a 0-d array."""
    if value is None:
        return np.zeros((), dtype=np.float32)
    arr = np.asarray(value)
    if arr.size != 1:
        raise InvalidArgumentError(f"{op}: value must hold one element, got shape {arr.shape}")
    DType.from_numpy(arr.dtype)
    return arr.reshape(())


def _infer_constant_of_shape(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    dtype = DType.from_numpy(fill_value("constant_of_shape", attrs["value"]).dtype)
    shape = infer_param("constant_of_shape", types, values, 0, attrs, "shape")
    if shape is None:
        raise InvalidArgumentError("constant_of_shape needs a shape (input 0 or attribute 'shape')")
    if isinstance(shape, Unknown):
        n = _param_length(types, 0)
        return [TensorType(dtype, None if n is None else (None,) * n)]
    return [TensorType(dtype, check_dims("constant_of_shape", shape, "shape"))]


def _infer_range(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    check_same_dtype("range", [t.dtype.value for t in types if t is not None])
    vals = [values[i] if i < len(values) else None for i in range(3)]
    if any(v is None for v in vals):
        return [TensorType(x.dtype, (None,))]
    scalars = [host_scalar(np.asarray(v), op="range", what=name)
               for v, name in zip(vals, ("start", "limit", "delta"), strict=True)]
    return [TensorType(x.dtype, (range_count("range", *scalars),))]


def _infer_eye_like(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is None:
        return [None]
    if x.shape is not None and len(x.shape) != 2:
        raise InvalidArgumentError(f"eye_like needs a rank-2 input, got shape {x.shape}")
    return [TensorType(attrs["dtype"] or x.dtype, x.shape)]


def _infer_trilu(types: Types, attrs: Mapping[str, Any], values: Values) -> list[Any]:
    x = _x(types)
    if x is not None and x.shape is not None and len(x.shape) < 2:
        raise InvalidArgumentError(f"trilu needs rank >= 2, got shape {x.shape}")
    return [x]


# ---- registration --------------------------------------------------------------

def _register(op: Op, lo: int, hi: int | None, attrs: Sequence[AttrSpec], infer: InferFn,
              doc: str, **kw: Any) -> None:
    register_schema(OpSchema(op, lo, hi, attrs=tuple(attrs), infer=infer, doc=doc, **kw))


A = AttrSpec
K = AttrKind
_ALIAS = ((0, 0),)   # the output is the input's bytes in a new shape

_register(Op.RESHAPE, 1, 2, [A("shape", K.INTS), A("allowzero", K.BOOL, False)], _infer_reshape,
          "ONNX Reshape. The target shape is input 1 (or attribute `shape`); 0 copies the input "
          "dim at that position unless allowzero=1, one -1 is inferred.",
          value_inputs=(1,), inplace=_ALIAS)
_register(Op.EXPAND_DIMS, 1, 2, [A("axis", K.INT), A("axes", K.INTS)], _infer_expand_dims,
          "Insert size-1 dims. Seed 001: attribute `axis`; ONNX Unsqueeze: axes as input 1 "
          "(opset >= 13) or attribute `axes`, normalized against the output rank.",
          value_inputs=(1,), inplace=_ALIAS)
_register(Op.SQUEEZE, 1, 2, [A("axes", K.INTS)], _infer_squeeze,
          "Remove size-1 dims: `axes` (input 1 or attribute) or, when absent, every size-1 dim.",
          value_inputs=(1,), inplace=_ALIAS)
_register(Op.TRANSPOSE, 1, 1, [A("perm", K.INTS)], _infer_transpose,
          "Permute axes by `perm` (default: reversed).")
_register(Op.FLATTEN, 1, 1, [A("axis", K.INT, 1)], _infer_flatten,
          "ONNX Flatten: 2-D (prod(dims[:axis]), prod(dims[axis:])).", inplace=_ALIAS)
_register(Op.EXPAND, 1, 2, [A("shape", K.INTS)], _infer_expand,
          "ONNX Expand: broadcast the input with the shape in input 1 (or attribute `shape`), "
          "bidirectionally.", value_inputs=(1,))
_register(Op.SHAPE, 1, 1, [A("start", K.INT, 0), A("end", K.INT)], _infer_shape,
          "ONNX Shape: the input's dims [start, end) as int64.")
_register(Op.SIZE, 1, 1, [], _infer_size, "ONNX Size: the element count as an int64 scalar.")
_register(Op.CONCAT, 1, None, [A("axis", K.INT, 0)], _infer_concat,
          "Join inputs of one dtype along `axis`.")
_register(Op.SPLIT, 1, 2, [A("axis", K.INT, 0), A("split", K.INTS), A("num_outputs", K.INT)],
          _infer_split,
          "ONNX Split: sizes from input 1 (or attribute `split`) or `num_outputs` chunks of "
          "ceil(dim / n) (last one smaller). With neither, the number of outputs decides; "
          "graph importers set num_outputs from the node.",
          max_outputs=MANY_OUTPUTS, value_inputs=(1,))
_register(Op.TILE, 1, 2, [A("repeats", K.INTS)], _infer_tile,
          "ONNX Tile: repeat the input `repeats[i]` times along each axis (input 1 or attribute).",
          value_inputs=(1,))
_register(Op.PAD, 1, 4, [A("mode", K.STR, "constant"), A("pads", K.INTS), A("value", K.FLOAT),
                         A("axes", K.INTS)], _infer_pad,
          "ONNX Pad: inputs data, pads, [constant_value], [axes] (or attributes `pads`, `value`, "
          "`axes`). Modes constant, reflect (pad <= size-1), edge, wrap. Negative pads crop "
          "first, then the rest is padded (as onnxruntime).",
          value_inputs=(1, 3))
_register(Op.DEPTH_TO_SPACE, 1, 1, [A("blocksize", K.INT, REQUIRED), A("mode", K.STR, "DCR")],
          _infer_d2s, "ONNX DepthToSpace on NCHW, modes DCR and CRD.")
_register(Op.SPACE_TO_DEPTH, 1, 1, [A("blocksize", K.INT, REQUIRED), A("mode", K.STR, "DCR")],
          _infer_s2d, "ONNX SpaceToDepth on NCHW, modes DCR and CRD (the inverse of "
          "depth_to_space in the same mode).")
_register(Op.CONSTANT_OF_SHAPE, 0, 1, [A("value", K.TENSOR), A("shape", K.INTS)],
          _infer_constant_of_shape,
          "ONNX ConstantOfShape: shape from input 0 (or attribute `shape`), filled with the "
          "1-element `value` (default float32 0).", value_inputs=(0,))
_register(Op.RANGE, 3, 3, [], _infer_range,
          "ONNX Range: scalars start, limit, delta; max(ceil((limit-start)/delta), 0) elements.",
          value_inputs=(0, 1, 2))
_register(Op.EYE_LIKE, 1, 1, [A("k", K.INT, 0), A("dtype", K.DTYPE)], _infer_eye_like,
          "ONNX EyeLike: ones on diagonal k of a 2-D tensor shaped like the input.")
_register(Op.TRILU, 1, 2, [A("upper", K.BOOL, True), A("k", K.INT)], _infer_trilu,
          "ONNX Trilu: keep the upper (or lower) triangle from diagonal k (input 1 or "
          "attribute `k`, default 0) of the last two dims.")
