"""Launching WGSL kernels on :class:`~keel.backends.webgpu.array.WgpuArray` views.

Every kernel here binds whole buffers and passes each view's offset and strides
(in elements) as parameters, so a transposed, sliced or broadcast view is read
in place, without a copy first. Outputs are contiguous.

Parameters travel as one array of u32 words (floats bit-cast), the kernel's
last binding. Tensors of rank up to :data:`MAX_RANK` are indexed directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.webgpu import wgsl
from keel.backends.webgpu.array import Namespace, Storage, WgpuArray, c_strides
from keel.backends.webgpu.device import Device
from keel.errors import InvalidArgumentError
from keel.ops.schemas.conv import Window

__all__ = [
    "MAX_RANK",
    "Params",
    "assign",
    "broadcast_strides",
    "c_strides",
    "contiguous",
    "contiguous_copy",
    "device_of",
    "empty_like",
    "fresh",
    "groups_for",
    "launch",
    "lifted",
    "out_array",
    "scalar_type",
]

MAX_RANK = wgsl.MAX_RANK


class Params:
    """The u32 words of a kernel's parameters."""

    def __init__(self) -> None:
        self.words: list[int] = []

    def u(self, *values: int) -> Params:
        self.words += [int(v) & 0xFFFFFFFF for v in values]
        return self

    def f(self, *values: float) -> Params:
        self.words += [int(w) for w in np.array(values, np.float32).view(np.uint32)]
        return self

    def dims(self, values: Sequence[int], fill: int) -> Params:
        """``values`` padded on the left to MAX_RANK with ``fill`` (shapes 1, strides 0)."""
        if len(values) > MAX_RANK:
            raise InvalidArgumentError(f"webgpu kernels index tensors of rank <= {MAX_RANK}, "
                                       f"got rank {len(values)}")
        return self.u(*([fill] * (MAX_RANK - len(values)) + list(values)))

    def array(self) -> np.ndarray:
        return np.array(self.words or [0], np.uint32)


def scalar_type(dtype: np.dtype) -> str:
    """The WGSL scalar type of a float dtype this backend computes in."""
    if dtype == np.float32:
        return "f32"
    if dtype == np.float16:
        return "f16"
    raise InvalidArgumentError(f"webgpu kernels compute in float32 or float16, got {dtype}")


def device_of(*arrays: Any) -> Device:
    for a in arrays:
        if isinstance(a, WgpuArray):
            return a.storage.device
    raise InvalidArgumentError("no device array among the inputs")


def fresh(device: Device, shape: Sequence[int], dtype: Any) -> WgpuArray:
    return Namespace(device).empty(tuple(shape), dtype)


def empty_like(x: WgpuArray, shape: Sequence[int] | None = None, dtype: Any = None
               ) -> WgpuArray:
    return fresh(x.storage.device, x.shape if shape is None else shape,
                 x.dtype if dtype is None else dtype)


def groups_for(n: int, per_group: int = wgsl.GROUP) -> tuple[int, int, int]:
    """Workgroups for ``n`` invocations, spread over x and y past the per-dimension cap."""
    total = -(-n // per_group)
    if total <= wgsl.MAX_GROUPS:
        return (total, 1 if total else 0, 1)
    return (wgsl.MAX_GROUPS, -(-total // wgsl.MAX_GROUPS), 1)


def launch(source: str, arrays: Sequence[WgpuArray], params: Params,
           groups: tuple[int, int, int], outputs: Sequence[WgpuArray] = ()) -> None:
    """Record one dispatch; ``outputs`` are the arrays it writes (their host copies go)."""
    device = arrays[0].storage.device
    for o in outputs:
        o.storage.written()
    device.dispatch(source, [a.buffer for a in arrays], params.array(), groups)


def lifted(win: Window, rank: int, what: str) -> Window:
    """``win`` with unit spatial dims put in front up to ``rank`` (a 1-D window as a 2-D
    one of height 1): the same memory layout, so a shader of ``rank`` dims runs it."""
    pad = rank - win.rank
    if pad < 0:
        raise InvalidArgumentError(f"webgpu {what} runs windows of up to {rank} spatial dims, "
                                   f"got {win.rank}")
    one, zero = (1,) * pad, (0,) * pad
    return Window(in_spatial=one + win.in_spatial, kernel=one + win.kernel,
                  strides=one + win.strides, dilations=one + win.dilations,
                  pads_begin=zero + win.pads_begin, pads_end=zero + win.pads_end,
                  out_spatial=one + win.out_spatial)


def broadcast_strides(x: WgpuArray, shape: Sequence[int]) -> list[int]:
    """``x``'s strides seen at ``shape`` (NumPy broadcasting: 0 where it repeats)."""
    pad = len(shape) - x.ndim
    if pad < 0:
        raise InvalidArgumentError(f"cannot broadcast shape {x.shape} to {tuple(shape)}")
    out = [0] * pad
    for d, s, want in zip(x.shape, x.strides_el, shape[pad:], strict=True):
        if d == want:
            out.append(s if d != 1 else 0)
        elif d == 1:
            out.append(0)
        else:
            raise InvalidArgumentError(f"cannot broadcast shape {x.shape} to {tuple(shape)}")
    return out


# ---- copies ---------------------------------------------------------------------

def contiguous_copy(x: WgpuArray) -> WgpuArray:
    out = empty_like(x)
    _copy_into(out, x)
    return out


def contiguous(x: WgpuArray) -> WgpuArray:
    """``x`` itself when contiguous, else a contiguous copy."""
    return x if x.is_contiguous() else contiguous_copy(x)


def assign(target: WgpuArray, value: Any) -> None:
    """``target[...] = value``: a device array (broadcast, same dtype) or host data."""
    if isinstance(value, WgpuArray):
        if value.dtype != target.dtype:
            raise InvalidArgumentError(
                f"cannot assign {value.dtype} to a {target.dtype} device array; cast first")
        _copy_into(target, value)
        return
    host = np.broadcast_to(np.asarray(value, dtype=target.dtype), target.shape)
    if target.size == 0:
        return
    if target.is_contiguous():
        target.storage.written()
        target.storage.device.write(target.buffer, target.offset * target.itemsize,
                                    np.ascontiguousarray(host))
        return
    dev = target.storage.device
    _copy_into(target, WgpuArray(Storage(dev, host.nbytes, np.ascontiguousarray(host)),
                                 host.shape, host.dtype))


def _copy_into(dst: WgpuArray, src: WgpuArray) -> None:
    if dst.size == 0:
        return
    strides = broadcast_strides(src, dst.shape)
    item = dst.itemsize
    if item % 4 == 0:
        words = item // 4
        params = (Params().u(dst.size, words, dst.offset * words, src.offset * words)
                  .dims(dst.shape, 1).dims([s * words for s in dst.strides_el], 0)
                  .dims([s * words for s in strides], 0))
        launch(wgsl.copy_words(), [dst, src], params, groups_for(dst.size), [dst])
        return
    # 1- and 2-byte elements: one invocation per output word of a contiguous target.
    if not dst.is_contiguous():
        raise InvalidArgumentError(f"webgpu copies {dst.dtype} only into contiguous targets")
    if (dst.offset * item) % 4:       # an unaligned small tensor: through the host
        assign(dst, np.broadcast_to(src.to_host(), dst.shape))
        return
    per = 4 // item
    nwords = -(-dst.size // per)
    params = (Params().u(dst.size, item, dst.offset * item // 4, src.offset)
              .dims(dst.shape, 1).dims(strides, 0))
    launch(wgsl.copy_bytes(), [dst, src], params, groups_for(nwords), [dst])


def out_array(device: Device, out: Sequence[Any] | None, i: int, shape: Sequence[int],
              dtype: Any) -> WgpuArray:
    """Output ``i``: the caller's buffer when it is a contiguous array of the right kind,
    else a fresh one (the executor copies a result that is not its buffer)."""
    if out is not None and i < len(out):
        o = out[i]
        if isinstance(o, WgpuArray) and o.is_contiguous() and o.shape == tuple(shape) \
                and o.dtype == np.dtype(dtype):
            return o
    return fresh(device, shape, dtype)
