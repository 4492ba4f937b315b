"""Device arrays of the ``webgpu`` backend: a storage buffer seen through a strided view.

A :class:`WgpuArray` is a shape, a NumPy dtype, strides and an offset (both in
elements) over one :class:`Storage` (a wgpu buffer). Basic indexing, ``reshape``,
``transpose``, ``view`` and ``ravel`` make views without moving data, as NumPy
does; ``copy()`` runs a strided-copy kernel. ``np.asarray`` on one reads it back
(flushing queued work). A buffer made from host data keeps that host copy until
something writes the buffer, so a small constant (a shape, an axis list) is read
without a round trip to the device.

:class:`Namespace` is the backend's ``xp``: ``zeros``, ``empty`` and ``ndarray``,
which is what the executor and the backend contract need of it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.webgpu.device import Device

__all__ = ["Namespace", "Storage", "WgpuArray", "c_strides"]


class Storage:
    """One device buffer and, while nothing has written it, the host bytes it was made from."""

    __slots__ = ("__weakref__", "buffer", "device", "host", "nbytes")

    def __init__(self, device: Device, nbytes: int, host: np.ndarray | None = None) -> None:
        self.device = device
        self.nbytes = nbytes
        if host is None:
            self.buffer = device.buffer(nbytes)
            self.host: np.ndarray | None = None
        else:
            raw = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
            self.buffer = device.buffer_with(raw)
            self.host = raw.copy()

    def written(self) -> None:
        """Something is about to write the buffer: the host copy no longer holds."""
        self.host = None


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    step = 1
    for d in reversed(shape):
        out.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(out))


class WgpuArray:
    """A strided view of a device buffer (see the module docstring)."""

    __array_priority__ = 100

    def __init__(self, storage: Storage, shape: Sequence[int], dtype: Any,
                 strides: Sequence[int] | None = None, offset: int = 0) -> None:
        self.storage = storage
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.strides_el = c_strides(self.shape) if strides is None else tuple(strides)
        self.offset = int(offset)

    # ---- what NumPy code asks of an array ----------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def buffer(self) -> Any:
        return self.storage.buffer

    @property
    def data(self) -> _Pointer:
        """The byte offset in its buffer, where NumPy has an address (alignment checks)."""
        return _Pointer(self.offset * self.itemsize)

    @property
    def T(self) -> WgpuArray:
        return self.transpose()

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"WgpuArray(shape={self.shape}, dtype={self.dtype})"

    def is_contiguous(self) -> bool:
        want = c_strides(self.shape)
        return all(d == 1 or s == w for d, s, w in zip(self.shape, self.strides_el, want,
                                                        strict=True))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        host = self.to_host()
        return host if dtype is None else host.astype(dtype)

    def tolist(self) -> Any:
        return self.to_host().tolist()

    def to_host(self) -> np.ndarray:
        """A host copy (reads the buffer back unless its host bytes still hold)."""
        if self.size == 0:
            return np.zeros(self.shape, self.dtype)
        lo, hi = self._span()
        item = self.itemsize
        raw = self.storage.host
        if raw is not None:
            chunk = raw[lo * item: hi * item]
        else:
            chunk = self.storage.device.read(self.buffer, lo * item, (hi - lo) * item)
        flat = np.frombuffer(chunk.tobytes(), self.dtype)
        strides = tuple(s * item for s in self.strides_el)
        view = np.lib.stride_tricks.as_strided(flat[self.offset - lo:], self.shape, strides)
        return np.array(view, copy=True)

    def _span(self) -> tuple[int, int]:
        """The element range [lo, hi) of the buffer this view touches."""
        lo = hi = self.offset
        for d, s in zip(self.shape, self.strides_el, strict=True):
            if s >= 0:
                hi += (d - 1) * s
            else:
                lo += (d - 1) * s
        return lo, hi + 1

    # ---- views ------------------------------------------------------------------
    def _view(self, shape: Sequence[int], strides: Sequence[int], offset: int,
              dtype: Any = None) -> WgpuArray:
        return WgpuArray(self.storage, shape, self.dtype if dtype is None else dtype,
                         strides, offset)

    def __getitem__(self, key: Any) -> WgpuArray:
        keys = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in keys):
            at = next(i for i, k in enumerate(keys) if k is Ellipsis)
            used = sum(1 for k in keys if k is not None and k is not Ellipsis)
            keys = keys[:at] + (slice(None),) * (self.ndim - used) + keys[at + 1:]
        shape: list[int] = []
        strides: list[int] = []
        offset = self.offset
        axis = 0
        for k in keys:
            if k is None:
                shape.append(1)
                strides.append(0)
                continue
            if axis >= self.ndim:
                raise IndexError(f"too many indices for an array of rank {self.ndim}")
            dim, stride = self.shape[axis], self.strides_el[axis]
            if isinstance(k, slice):
                start, stop, step = k.indices(dim)
                shape.append(len(range(start, stop, step)))
                strides.append(stride * step)
                offset += start * stride
            else:
                i = operator.index(k)
                if not -dim <= i < dim:
                    raise IndexError(f"index {i} is out of bounds for axis {axis} of size {dim}")
                offset += (i % dim) * stride
            axis += 1
        shape += self.shape[axis:]
        strides += self.strides_el[axis:]
        return self._view(shape, strides, offset)

    def __setitem__(self, key: Any, value: Any) -> None:
        from keel.backends.webgpu import ops

        target = self if key is Ellipsis or key == () else self[key]
        ops.assign(target, value)

    def transpose(self, *axes: Any) -> WgpuArray:
        perm = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) \
            else tuple(axes)
        if not perm:
            perm = tuple(reversed(range(self.ndim)))
        return self._view([self.shape[a] for a in perm], [self.strides_el[a] for a in perm],
                          self.offset)

    def reshape(self, *shape: Any) -> WgpuArray:
        dims = list(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) \
            else list(shape)
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            dims[dims.index(-1)] = self.size // known if known else 0
        if math.prod(dims) != self.size:
            raise ValueError(f"cannot reshape an array of size {self.size} into {tuple(dims)}")
        base = self if self.is_contiguous() else self.copy()
        return base._view(dims, c_strides(dims), base.offset)

    def ravel(self) -> WgpuArray:
        return self.reshape(-1)

    def view(self, dtype: Any) -> WgpuArray:
        dt = np.dtype(dtype)
        if not self.is_contiguous() or not self.shape:
            raise ValueError("view() to another dtype needs a contiguous array of rank >= 1")
        last = self.shape[-1] * self.itemsize
        if last % dt.itemsize or (self.offset * self.itemsize) % dt.itemsize:
            raise ValueError(f"cannot view {self.dtype} as {dt}: sizes do not divide")
        shape = (*self.shape[:-1], last // dt.itemsize)
        return WgpuArray(self.storage, shape, dt, None,
                         self.offset * self.itemsize // dt.itemsize)

    def copy(self) -> WgpuArray:
        from keel.backends.webgpu import ops

        return ops.contiguous_copy(self)


class Namespace:
    """The ``xp`` of the webgpu backend: allocation only (kernels are WGSL)."""

    ndarray = WgpuArray

    def __init__(self, device: Device) -> None:
        self.device = device

    def empty(self, shape: Any, dtype: Any = np.float32) -> WgpuArray:
        dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
        dt = np.dtype(dtype)
        return WgpuArray(Storage(self.device, math.prod(dims) * dt.itemsize), dims, dt)

    zeros = empty          # new buffers are zero-filled

    def asarray(self, host: Any) -> WgpuArray:
        data = np.asarray(host)
        if not data.flags.c_contiguous:
            data = data.copy(order="C")
        return WgpuArray(Storage(self.device, data.nbytes, data), data.shape, data.dtype)

    array = asarray
