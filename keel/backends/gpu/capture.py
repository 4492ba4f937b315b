"""CUDA graphs through CuPy: the gpu backend's :class:`~keel.backends.base.GraphCapture`.

Each program gets its own stream and its own CuPy memory pool. Its runs allocate
from that pool only, so the blocks a recording writes are never handed to
anything else (a block freed while recording goes back to this pool, which only
this program's runs draw from, in the same order every time). The stream is a
blocking one: work on CuPy's default stream, and the synchronous copies that
read outputs back, wait for it.

Recording uses CUDA's relaxed capture mode: a library that allocates or loads a
module while its first launch is recorded (cuBLAS, cuDNN, NVRTC) is not refused
for it. A recording that fails (a kernel that reads a device value on the host,
which synchronizes) ends the capture and raises; the program then runs step by
step and says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["CudaGraphs"]


class CudaGraphs:
    """One program's stream, memory pool and recordings on one CUDA device."""

    def __init__(self, cp: Any, device_index: int) -> None:
        self._cp = cp
        self._device = cp.cuda.Device(device_index)
        with self._device:
            self.stream = cp.cuda.Stream(non_blocking=False)
            self.pool = cp.cuda.MemoryPool()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        cp = self._cp
        with self._device, self.stream, cp.cuda.using_allocator(self.pool.malloc):
            yield

    def record(self, run: Callable[[], None]) -> Any:
        stream = self.stream
        mode = getattr(self._cp.cuda.runtime, "streamCaptureModeRelaxed", None)
        if mode is None:
            stream.begin_capture()
        else:
            stream.begin_capture(mode)
        try:
            run()
        except BaseException:
            with contextlib.suppress(Exception):   # the capture is invalid: end it
                stream.end_capture()
            raise
        return stream.end_capture()

    def launch(self, graph: Any) -> None:
        graph.launch(self.stream)

    def buffer(self, like: Any) -> Any:
        return self._cp.empty(tuple(like.shape), dtype=like.dtype)

    def stage(self, buffer: Any, value: Any) -> None:
        if isinstance(value, np.ndarray):
            buffer.set(np.ascontiguousarray(value), stream=self.stream)
        else:
            self._cp.copyto(buffer, value)
