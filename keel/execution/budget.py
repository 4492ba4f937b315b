"""Data-dependent output sizes, checked before a kernel allocates them.

Most values have a size known when the plan is made: the memory plan places
them and the model's memory limit is checked against the plan's peak before
anything runs. A few ops take the size of their output from the *values* of
an input (``ConstantOfShape``'s shape, ``Expand``'s shape, ``Tile``'s repeats,
``Range``'s bounds, ``Resize``'s sizes or scales, ``OneHot``'s depth, ``Pad``'s
pads, ``TopK``'s k), or from the data itself (``NonZero``'s and ``Compress``'s
count of true elements, counted before the kernel runs; ``Unique``'s at most
every element); when those inputs are computed at run time the size is only
known then, and the kernel allocates the output itself.

For those steps the program reads the size from the actual inputs just before
the kernel runs (:func:`output_elements`) and :func:`check_output` compares
its bytes with what is left of the budget: the memory limit less the plan's
peak, or, without a limit, the memory the machine has available. A request
beyond it raises :class:`~keel.errors.MemoryLimitError` naming the node and
the bytes, and nothing is allocated. Steps whose outputs are planned never
reach this check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.config import format_bytes, format_limit
from keel.errors import MemoryLimitError
from keel.ops.registry import Op

__all__ = ["SIZED_BY_VALUES", "available_memory", "check_output", "output_elements"]

# Below this many bytes an output is not worth reading the machine's free memory for.
_SMALL = 64 << 20

Elements = Callable[[Sequence[Any], Mapping[str, Any]], int | None]


def _ints(value: Any) -> list[int]:
    return [int(v) for v in value.reshape(-1)] if hasattr(value, "reshape") else []


def _product(dims: Sequence[int]) -> int | None:
    return None if any(d < 0 for d in dims) else math.prod(dims)


def _constant_of_shape(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    return _product(_ints(ins[0]))


def _expand(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    shape, target = list(ins[0].shape), _ints(ins[1])
    n = max(len(shape), len(target))
    shape, target = [1] * (n - len(shape)) + shape, [1] * (n - len(target)) + target
    return _product([max(a, b) if 1 in (a, b) else a for a, b in zip(shape, target,
                                                                        strict=True)])


def _tile(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    repeats = _ints(ins[1])
    if len(repeats) != ins[0].ndim:
        return None
    return _product([d * r for d, r in zip(ins[0].shape, repeats, strict=True)])


def _range(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    start, limit, delta = (float(v.reshape(-1)[0]) for v in ins[:3])
    if delta == 0 or not all(math.isfinite(v) for v in (start, limit, delta)):
        return None
    return max(0, math.ceil((limit - start) / delta))


def _axes(ins: Sequence[Any], attrs: Mapping[str, Any], at: int, count: int) -> list[int]:
    given = ins[at] if len(ins) > at and ins[at] is not None else attrs.get("axes")
    axes = _ints(given) if hasattr(given, "reshape") else list(given or [])
    return axes if axes else list(range(count))


def _resize(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    dims = list(ins[0].shape)
    sizes = ins[3] if len(ins) > 3 and ins[3] is not None and ins[3].size else None
    scales = ins[2] if len(ins) > 2 and ins[2] is not None and ins[2].size else None
    if sizes is not None:
        given: list[float] = [float(v) for v in _ints(sizes)]
    elif scales is not None:
        given = [float(s) for s in scales.reshape(-1)]
    else:
        return None
    axes = attrs.get("axes") or list(range(len(given)))
    if len(axes) != len(given):
        return None
    for axis, g in zip(axes, given, strict=True):
        dims[axis] = int(g) if sizes is not None else math.floor(dims[axis] * g)
    return _product(dims)


def _one_hot(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    depth = _ints(ins[1])
    return None if len(depth) != 1 or depth[0] < 0 else int(ins[0].size) * depth[0]


def _pad(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    pads = _ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(attrs.get("pads", ()))
    dims = list(ins[0].shape)
    axes = _axes(ins, attrs, 3, len(dims))
    if len(pads) != 2 * len(axes):
        return None
    for i, axis in enumerate(axes):
        dims[axis] += pads[i] + pads[i + len(axes)]
    return _product(dims)


def _in_units(elements: int, itemsize: int, extra_int64: int) -> int:
    """``elements`` of the first output plus ``extra_int64`` int64 elements of the others,
    counted in the first output's itemsize (the unit the program multiplies by)."""
    return elements + -(-extra_int64 * 8 // max(itemsize, 1))


def _nonzero(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    x = ins[0]
    return max(1, x.ndim) * int(np.count_nonzero(x))      # int64 coordinates


def _topk(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    x, k = ins[0], _ints(ins[1])
    axis = int(attrs.get("axis", -1)) % max(x.ndim, 1)
    if len(k) != 1 or k[0] < 0 or x.ndim == 0 or x.shape[axis] == 0:
        return None
    n = x.size // x.shape[axis] * min(k[0], x.shape[axis])
    return _in_units(n, x.dtype.itemsize, n)              # values, then int64 indices


def _compress(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    x, condition = ins[0], np.asarray(ins[1]).reshape(-1)
    axis = attrs.get("axis")
    along = x.size if axis is None else x.shape[int(axis) % x.ndim]
    kept = int(np.count_nonzero(condition[:along]))
    return kept if axis is None else kept * (x.size // max(along, 1))


def _unique(ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    x = ins[0]        # at most every element, with first indices, inverse and counts
    return _in_units(x.size, x.dtype.itemsize, 3 * x.size)


# Ops whose output size comes from an input's values, and how to read it.
SIZED_BY_VALUES: dict[Op, Elements] = {
    Op.CONSTANT_OF_SHAPE: _constant_of_shape, Op.EXPAND: _expand, Op.TILE: _tile,
    Op.RANGE: _range, Op.RESIZE: _resize, Op.ONE_HOT: _one_hot, Op.PAD: _pad,
    Op.NONZERO: _nonzero, Op.TOPK: _topk, Op.COMPRESS: _compress, Op.UNIQUE: _unique,
}


def output_elements(op: Op, ins: Sequence[Any], attrs: Mapping[str, Any]) -> int | None:
    """The element count ``op`` will produce from ``ins``; None when it cannot tell
    (the kernel then reports the bad input itself)."""
    fn = SIZED_BY_VALUES.get(op)
    if fn is None:
        return None
    try:
        return fn(ins, attrs)
    except (TypeError, ValueError, IndexError, AttributeError, OverflowError):
        return None


def available_memory() -> int | None:
    """Bytes this process may still allocate (cgroup aware); None when unknown."""
    from keel.hardware.memory import probe_memory
    from keel.hardware.sources import ProbeSources

    try:
        return probe_memory(ProbeSources.real()).effective_available_bytes
    except Exception:  # an unreadable probe leaves the kernel to try
        return None


def check_output(node: str, nbytes: int, limit: int | None, planned: int) -> None:
    """Raise ``MemoryLimitError`` if ``nbytes`` more for ``node`` would break the budget:
    ``limit`` less the ``planned`` peak, or the machine's available memory."""
    if limit is not None:
        left = max(0, limit - planned)
        if nbytes > left:
            raise MemoryLimitError(
                f"node {node!r} needs {format_bytes(nbytes)} ({nbytes} bytes) for an output "
                f"whose size is only known at run time, but the memory limit "
                f"{format_limit(limit)} ({limit} bytes) leaves {left} bytes after the plan's "
                f"peak of {planned} bytes", required_bytes=nbytes, limit_bytes=limit)
        return
    if nbytes < _SMALL:
        return
    free = available_memory()
    if free is not None and nbytes > free:
        raise MemoryLimitError(
            f"node {node!r} needs {format_bytes(nbytes)} ({nbytes} bytes) for an output whose "
            f"size is only known at run time, more than the {free} bytes this machine has "
            "available", required_bytes=nbytes, limit_bytes=free)
