"""One WebGPU device through ``wgpu``: adapters, buffers, pipelines and batched dispatches.

``wgpu`` is imported on first use (:func:`load_wgpu`), never when keel is
imported. :func:`describe_adapters` lists every adapter wgpu-native finds (the
hardware probe records it); :class:`Device` owns the device keel computes on.

Every kernel launch goes through :meth:`Device.dispatch`: compute pipelines are
built once per WGSL source, a bind group once per set of buffers and
parameters, and dispatches are recorded into one open compute pass that is
submitted only when the host needs a result (a read) or writes a buffer that
queued work may still read. So a model's run is recorded and submitted once,
with no round trip between its nodes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from keel._fork import renew_after_fork
from keel.hardware.profile import WebGpuAdapterInfo
from keel.hardware.webgpu import adapter_info, describe_adapters, load_wgpu

__all__ = [
    "AdapterInfo",
    "Device",
    "describe_adapters",
    "load_wgpu",
]

# Bind groups and parameter buffers kept for reuse (memo sizes, not decisions).
_BIND_GROUPS = 256
_PARAMS = 4096


AdapterInfo = WebGpuAdapterInfo      # what the probe lists (keel.hardware.webgpu reads it)


class Device:
    """The device keel runs WGSL kernels on, with its caches and the open compute pass."""

    def __init__(self, wgpu: Any, adapter: Any) -> None:
        self.wgpu = wgpu
        self.adapter = adapter
        self.info = adapter_info(adapter)
        features = ["shader-f16"] if self.info.shader_f16 else []
        limits = {k: v for k, v in dict(adapter.limits).items()
                  if k in ("max-storage-buffer-binding-size", "max-buffer-size",
                           "max-storage-buffers-per-shader-stage",
                           "max-compute-workgroup-storage-size")}
        self.device = adapter.request_device_sync(required_features=features,
                                                  required_limits=limits)
        self.queue = self.device.queue
        self.usage = (wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
                      | wgpu.BufferUsage.COPY_DST)
        self._pipelines: dict[str, Any] = {}
        self._bind_groups: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._params: OrderedDict[bytes, Any] = OrderedDict()
        self._encoder: Any = None
        self._pass: Any = None
        self._lock = threading.RLock()
        renew_after_fork(self, "_lock")     # (the device itself does not survive a fork)
        self.dispatches = 0          # dispatches recorded, for tests and reports
        self.submits = 0

    @property
    def storage_bindings(self) -> int:
        """Storage buffers one shader may bind (the device's limit)."""
        return int(dict(self.device.limits)["max-storage-buffers-per-shader-stage"])

    # ---- buffers ---------------------------------------------------------------
    def buffer(self, nbytes: int) -> Any:
        """A zero-filled storage buffer of at least ``nbytes`` (rounded up to 4, at least 4)."""
        size = max(4, (int(nbytes) + 3) // 4 * 4)
        return self.device.create_buffer(size=size, usage=self.usage)

    def buffer_with(self, data: np.ndarray) -> Any:
        """A storage buffer holding ``data``'s bytes (padded to a multiple of 4)."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if raw.size % 4 or raw.size == 0:
            raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])
        return self.device.create_buffer_with_data(data=raw, usage=self.usage)

    def write(self, buffer: Any, offset: int, data: np.ndarray) -> None:
        """Copy host bytes into ``buffer`` at byte ``offset`` after the queued work."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        lo = offset // 4 * 4
        hi = (offset + raw.size + 3) // 4 * 4
        with self._lock:
            if lo != offset or hi != offset + raw.size:    # keep the bytes around it
                whole = self.read(buffer, lo, hi - lo).copy()
                whole[offset - lo: offset - lo + raw.size] = raw
                raw = whole
            self.flush()
            self.queue.write_buffer(buffer, lo, raw)

    def read(self, buffer: Any, offset: int, nbytes: int) -> np.ndarray:
        """The bytes ``[offset, offset + nbytes)`` of ``buffer`` once queued work finished."""
        lo = offset // 4 * 4
        hi = max(lo + 4, (offset + nbytes + 3) // 4 * 4)
        with self._lock:
            self.flush()
            data = self.queue.read_buffer(buffer, lo, hi - lo)
        return np.frombuffer(data, np.uint8)[offset - lo: offset - lo + nbytes]

    # ---- kernels --------------------------------------------------------------
    def pipeline(self, source: str) -> Any:
        found = self._pipelines.get(source)
        if found is None:
            module = self.device.create_shader_module(code=source)
            found = self.device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": "main"})
            self._pipelines[source] = found
        return found

    def dispatch(self, source: str, buffers: Sequence[Any], params: np.ndarray,
                 groups: tuple[int, int, int]) -> None:
        """Record one dispatch of ``source``: binding i is ``buffers[i]`` (whole buffers),
        the last binding the u32 words of ``params``. Nothing runs until a flush."""
        if groups[0] == 0 or groups[1] == 0 or groups[2] == 0:
            return
        with self._lock:
            pipeline = self.pipeline(source)
            bind = self._bind_group(pipeline, buffers, self._param_buffer(params))
            if self._pass is None:
                self._encoder = self.device.create_command_encoder()
                self._pass = self._encoder.begin_compute_pass()
            self._pass.set_pipeline(pipeline)
            self._pass.set_bind_group(0, bind)
            self._pass.dispatch_workgroups(*groups)
            self.dispatches += 1

    def flush(self) -> None:
        """Submit the recorded dispatches (one command buffer)."""
        with self._lock:
            if self._pass is None:
                return
            self._pass.end()
            self.queue.submit([self._encoder.finish()])
            self._pass = self._encoder = None
            self.submits += 1

    def _param_buffer(self, params: np.ndarray) -> Any:
        key = np.ascontiguousarray(params, dtype=np.uint32).tobytes() or b"\0\0\0\0"
        found = self._params.get(key)
        if found is None:
            found = self.device.create_buffer_with_data(
                data=key, usage=self.wgpu.BufferUsage.STORAGE)
            if len(self._params) >= _PARAMS:
                self._params.popitem(last=False)
            self._params[key] = found
        else:
            self._params.move_to_end(key)
        return found

    def _bind_group(self, pipeline: Any, buffers: Sequence[Any], params: Any) -> Any:
        key = (pipeline, *buffers, params)
        found = self._bind_groups.get(key)
        if found is None:
            entries = [{"binding": i, "resource": {"buffer": b}}
                       for i, b in enumerate((*buffers, params))]
            found = self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                                  entries=entries)
            if len(self._bind_groups) >= _BIND_GROUPS:
                self._bind_groups.popitem(last=False)
            self._bind_groups[key] = found
        else:
            self._bind_groups.move_to_end(key)
        return found
