"""gpu kernels for the cases CuPy's own routines do not serve: ReduceMin and the
``mul`` reduction of ScatterElements / ScatterND.

* ReduceMin is the shared kernel's ReduceMax on the order-reversed input
  (``-x`` for floats, ``~x`` for integers and booleans: both exact, no overflow) with
  the result reversed back; CuPy's ``min`` reduction failed every ReduceMin case on
  CUDA 13 while its ``max`` passes them.
* ``multiply.at`` does not exist in CuPy (its ``ufunc.at`` covers add, subtract,
  maximum and minimum, through atomics). Here the updates are ordered by destination
  (a stable order: ties keep the update order) and one thread per destination
  multiplies its updates in, in that order: the same sequence of roundings as the
  reference, so the result is deterministic and bitwise the reference's.

Both register as the ``default`` variant of their op on the gpu table (they serve
every case of it); every other case runs the shared xp kernel unchanged.
"""

from __future__ import annotations

import math
from typing import Any

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.cpu.indexing import scatter_elements_setup, scatter_nd_setup
from keel.backends.gpu import fused_cuda as cu
from keel.backends.gpu.kernels import TABLE
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schemas.indexing import check_reduction

__all__: list[str] = []

_MULTIPLY_AT = r"""
if (i == 0 || order_dst[i - 1] != order_dst[i]) {
    long long d = order_dst[i];
    T acc = dst[d];
    for (long long j = i; j < count && order_dst[j] == d; ++j) acc = acc * ordered[j];
    dst[d] = acc;
}
"""


def _reversed(xp: Any, a: Any, out: Any = None) -> Any:
    """An order-reversing exact map: -a for floats, ~a for integers and booleans."""
    if a.dtype.kind == "f" or a.dtype == DType.BFLOAT16.numpy:
        return xp.negative(a, out=out)
    return xp.invert(a, out=out)


@TABLE.kernel(Op.REDUCE_MIN, supports_out=True, gpu=True, shapes="any")
def reduce_min(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """min(x) = reversed(max(reversed(x))): the shared ReduceMax on the reversed input."""
    xp = ctx.xp
    flipped = [_reversed(xp, inputs[0]), *inputs[1:]]
    results = list(cu.shared(Op.REDUCE_MAX)(ctx, flipped, attrs, out))
    return [_reversed(xp, r, out=r) for r in results]


def _multiply_at(xp: Any, dst: Any, flat_index: Any, updates: Any) -> None:
    """dst.flat[flat_index[j]] *= updates[j] for every j, in update order per destination."""
    n = int(flat_index.size)
    if n == 0:
        return
    flat_index = flat_index.reshape(-1).astype(xp.int64, copy=False)
    ordered_updates = xp.ascontiguousarray(updates).reshape(-1)
    # Unique keys (destination, position): any sort gives the same stable order.
    order = xp.argsort(flat_index * n + xp.arange(n, dtype=xp.int64))
    kernel = cu.cached((id(xp), "multiply_at"), lambda: xp.ElementwiseKernel(
        "raw T ordered, raw int64 order_dst, int64 count", "raw T dst", _MULTIPLY_AT,
        "keel_multiply_at"))
    work = dst if dst.flags.c_contiguous else xp.ascontiguousarray(dst)
    kernel(ordered_updates[order], xp.ascontiguousarray(flat_index[order]), n,
           work.reshape(-1), size=n)
    if work is not dst:
        dst[...] = work


def _flat(xp: Any, index: tuple[Any, ...], shape: tuple[int, ...]) -> Any:
    """Flat positions in ``shape`` of broadcast index arrays (negative ones from the end)."""
    parts = xp.broadcast_arrays(*index)
    flat = xp.zeros(parts[0].shape, dtype=xp.int64)
    for part, size in zip(parts, shape, strict=False):
        flat *= size
        flat += xp.where(part < 0, part + size, part)
    return flat


@TABLE.kernel(Op.SCATTER_ELEMENTS, supports_out=True, gpu=True, shapes="any")
def scatter_elements(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The shared kernel, except ``reduction="mul"``: an ordered product per destination."""
    if check_reduction("scatter_elements", attrs["reduction"]) != "mul":
        return list(cu.shared(Op.SCATTER_ELEMENTS)(ctx, inputs, attrs, out))
    xp = ctx.xp
    dst, index, updates = scatter_elements_setup(xp, inputs, attrs, out)
    _multiply_at(xp, dst, _flat(xp, index, tuple(dst.shape)), updates)
    return [dst]


@TABLE.kernel(Op.SCATTER_ND, supports_out=True, gpu=True, shapes="any")
def scatter_nd(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    """The shared kernel, except ``reduction="mul"``: an ordered product per destination."""
    if check_reduction("scatter_nd", attrs["reduction"]) != "mul":
        return list(cu.shared(Op.SCATTER_ND)(ctx, inputs, attrs, out))
    xp = ctx.xp
    dst, index, updates = scatter_nd_setup(xp, inputs, out)
    k = len(index)
    rows = _flat(xp, index, tuple(dst.shape[:k]))
    tail = math.prod(int(d) for d in dst.shape[k:])
    flat = rows.reshape(*rows.shape, 1) * tail + xp.arange(tail, dtype=xp.int64)
    _multiply_at(xp, dst, flat, updates.reshape(flat.shape))
    return [dst]
