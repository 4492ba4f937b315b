"""Fake backends and a fake CuPy for tests: every branch runs without the hardware."""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Availability, Backend, DeviceKind, KernelContext, KernelTable
from keel.backends.registry import BackendRegistry
from keel.ops.registry import Op

__all__ = ["EmulatedCupy", "FakeCupy", "SpyBackend", "make_backend", "spy_registry"]


def _add(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
         out: Sequence[Any] | None) -> list[Any]:
    return [ctx.xp.add(inputs[0], inputs[1])]


def _relu(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
          out: Sequence[Any] | None) -> list[Any]:
    return [ctx.xp.maximum(inputs[0], 0)]


def _broken(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
            out: Sequence[Any] | None) -> list[Any]:
    if out is not None:
        out[0][...] = -1          # scribbles on what it was given, then fails
    raise RuntimeError("kernel exploded")


KERNELS: dict[Op, Callable[..., list[Any]]] = {Op.ADD: _add, Op.RELU: _relu, Op.MUL: _broken}


class SpyBackend(Backend):
    """A NumPy backend with chosen ops, availability and device that counts allocations."""

    name = "spy"
    device = DeviceKind.CPU
    ops: frozenset[Op] = frozenset({Op.ADD, Op.RELU})
    available = True
    reason = "spy backend"

    def __init__(self) -> None:
        super().__init__()
        self._xp = _CountingNumpy()

    @property
    def allocations(self) -> int:
        """Arrays made through ``xp.zeros``/``xp.empty`` (allocate, scratch outputs)."""
        return self._xp.allocations

    def _check_available(self) -> Availability:
        return Availability(self.available, self.reason)

    def _kernels(self) -> KernelTable:
        table = KernelTable(self.name)
        for op in self.ops:
            # Ops without a fake kernel get add (selection tests never run them).
            table.kernel(op, supports_out=op is Op.MUL)(KERNELS.get(op, _add))
        return table

    @property
    def xp(self) -> Any:
        return self._xp


class _CountingNumpy(types.SimpleNamespace):
    """NumPy, counting the arrays made with ``zeros`` and ``empty``."""

    def __init__(self) -> None:
        super().__init__(allocations=0)

    def zeros(self, *args: Any, **kwargs: Any) -> np.ndarray:
        self.allocations += 1
        return np.zeros(*args, **kwargs)

    def empty(self, *args: Any, **kwargs: Any) -> np.ndarray:
        self.allocations += 1
        return np.empty(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


def make_backend(name: str, *, device: DeviceKind = DeviceKind.CPU,
                 ops: Sequence[Op] = (Op.ADD, Op.RELU), available: bool = True,
                 reason: str = "", priority: int = 0) -> type[SpyBackend]:
    """A SpyBackend subclass called ``name`` (a factory for registries)."""
    attrs = {"name": name, "device": device, "ops": frozenset(ops), "available": available,
             "reason": reason or (f"{name} is here" if available else f"{name} is missing"),
             "priority": priority}
    return type(f"Spy_{name}", (SpyBackend,), attrs)


def spy_registry(**specs: dict[str, Any]) -> BackendRegistry:
    """A fresh registry of spy backends: ``spy_registry(cpu={...}, gpu={...})``."""
    registry = BackendRegistry()
    for name, spec in specs.items():
        spec = dict(spec)
        priority = spec.pop("priority", 0)
        registry.register(name, make_backend(name, **spec), priority)
    return registry


class FakeCupy(types.ModuleType):
    """Enough of CuPy, backed by NumPy, to run the gpu backend's code paths."""

    def __init__(self, devices: int = 1, *, device_error: Exception | None = None,
                 smoke_error: Exception | None = None) -> None:
        super().__init__("cupy")
        self.__version__ = "0.0-fake"
        self.synchronized = 0
        self._smoke_error = smoke_error
        fake = self

        class _Device(contextlib.AbstractContextManager[Any]):
            def __init__(self, index: int = 0) -> None:
                self.index = index

            def __exit__(self, *exc: object) -> None:
                return None

            def synchronize(self) -> None:
                fake.synchronized += 1

        def count() -> int:
            if device_error is not None:
                raise device_error
            return devices

        def props(index: int) -> dict[str, Any]:
            return {"name": b"Fake GPU", "totalGlobalMem": 8 * 1024**3, "major": 9, "minor": 0}

        runtime = types.SimpleNamespace(getDeviceCount=count, getDeviceProperties=props)
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=_Device)

    def arange(self, *args: Any, **kwargs: Any) -> Any:
        if self._smoke_error is not None:
            raise self._smoke_error
        return np.arange(*args, **kwargs)

    def asnumpy(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


# ---- an emulating CuPy: the gpu backend's own kernels without a GPU ------------------------
# Each of keel's CUDA kernels (keel/backends/gpu/fused_*.py) has a NumPy twin here with the
# same argument list and semantics (float32 arithmetic, float16 storage). Running the gpu
# backend's own variants on it checks everything around the CUDA code: argument order and
# count (read from the kernel's source), contiguity, shapes, dtypes and the Python logic;
# the CUDA code itself runs only on a real GPU.
_F32 = np.float32


def _given(arg: Any) -> Any:
    """An optional pointer argument: None where the kernel got a null pointer."""
    return None if isinstance(arg, np.uint64) else arg


def _emulate_layer_norm(rows: int, args: Sequence[Any]) -> None:
    x, skip, gamma, beta, y, total, mean_out, rstd_out, k, period, eps = args
    k, period = int(k), int(period)
    xr = x.reshape(rows, k).astype(_F32)
    if _given(skip) is not None:
        s = skip.reshape(period, k).astype(_F32)
        xr = (xr + s[np.arange(rows) % period]).astype(x.dtype).astype(_F32)
        if _given(total) is not None:
            total.reshape(rows, k)[...] = xr
    mean = xr.sum(1, dtype=_F32) / _F32(k)
    rstd = 1 / np.sqrt(((xr - mean[:, None]) ** 2).sum(1, dtype=_F32) / _F32(k) + _F32(eps))
    o = (xr - mean[:, None]) * rstd[:, None] * gamma.astype(_F32)
    if _given(beta) is not None:
        o = o + beta.astype(_F32)
    y.reshape(rows, k)[...] = o
    if _given(mean_out) is not None:
        mean_out.reshape(-1)[:] = mean
        rstd_out.reshape(-1)[:] = rstd


def _emulate_softmax(rows: int, args: Sequence[Any]) -> None:
    src, out, n, scale, causal, s, log = args
    x = src.reshape(rows, int(n)).astype(_F32) * _F32(scale)
    if causal:
        x = np.where(np.arange(int(n))[None, :] > (np.arange(rows) % int(s))[:, None],
                     -np.inf, x)
    with np.errstate(all="ignore"):
        top = np.max(np.where(np.isnan(x), -np.inf, x), axis=1, keepdims=True)
        e = np.exp(x - top)
        total = e.sum(1, keepdims=True)
        out.reshape(rows, int(n))[...] = (x - top - np.log(total)) if log else e / total


def _emulate_pool2d(blocks: int, args: Sequence[Any]) -> None:
    x, y, total, *ints = args
    h, w, oh, ow, kh, kw, sh, sw, dh, dw, ph, pw, eh, ew, mode = (int(v) for v in ints)
    planes = int(total) // (oh * ow)
    xi, yo = x.reshape(planes, h, w).astype(_F32), y.reshape(planes, oh, ow)
    for oy in range(oh):
        for ox in range(ow):
            acc, count = np.full(planes, 0.0 if mode else -np.inf, _F32), 0
            for a in range(kh):
                for b in range(kw):
                    iy, ix = oy * sh - ph + a * dh, ox * sw - pw + b * dw
                    inside = 0 <= iy < h and 0 <= ix < w
                    count += (iy < h + eh and ix < w + ew) if mode == 2 else inside
                    if inside:
                        v = xi[:, iy, ix]
                        acc = acc + v if mode else np.where((v > acc) | np.isnan(v), v, acc)
            yo[:, oy, ox] = acc / count if mode else acc


def _emulate_row_reduce(rows: int, args: Sequence[Any]) -> None:
    x, y, n, mode = args
    xr = x.reshape(rows, int(n)).astype(_F32)
    y.reshape(-1)[:] = xr.max(1) if mode else xr.sum(1, dtype=_F32) / _F32(n)


_RAW: dict[str, Callable[[int, Sequence[Any]], None]] = {
    "keel_layer_norm": _emulate_layer_norm, "keel_softmax": _emulate_softmax,
    "keel_pool2d": _emulate_pool2d, "keel_row_reduce": _emulate_row_reduce}


class _RawKernel:
    def __init__(self, code: str, name: str) -> None:
        head = f'extern "C" __global__ void {name}('
        assert head in code, f"{name} is not defined in its source"
        self.name, self.arity = name, code.split(head)[1].split(")")[0].count(",") + 1

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                 shared_mem: int = 0) -> None:
        assert len(args) == self.arity, f"{self.name}: {len(args)} args for {self.arity}"
        assert block[0] % 32 == 0 and 32 <= block[0] <= 1024, block
        for a in args:
            assert isinstance(a, (np.ndarray, np.generic)), f"{self.name}: {type(a)}"
            assert not isinstance(a, np.ndarray) or a.flags.c_contiguous, self.name
        _RAW[self.name](grid[0], args)


def _unit(t: Any) -> Any:
    return np.where(t < 0, 0, np.where(t > 1, 1, t))


_ACTIVATIONS: dict[str, Callable[[Any, Any, Any], Any]] = {
    "identity": lambda v, p0, p1: v,
    "relu": lambda v, p0, p1: np.where(v < 0, 0, v),
    "leaky_relu": lambda v, p0, p1: np.where(v >= 0, v, p0 * v),
    "sigmoid": lambda v, p0, p1: 1 / (1 + np.exp(-v)),
    "tanh": lambda v, p0, p1: np.tanh(v),
    "clip": lambda v, p0, p1: np.where(v < p0, p0, np.where(v > p1, p1, v)),
    "hard_sigmoid": lambda v, p0, p1: _unit(p0 * v + p1),
    "hard_swish": lambda v, p0, p1: v * _unit(v / 6 + 0.5),
    "gelu": lambda v, p0, p1: 0.5 * v * np.vectorize(math.erfc, otypes=[_F32])(
        -v / math.sqrt(2)),
    "gelu_tanh": lambda v, p0, p1: 0.5 * v * (1 + np.tanh(
        math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))),
    "silu": lambda v, p0, p1: v / (1 + np.exp(-v)),
}


class _ElementwiseKernel:
    def __init__(self, in_params: str, out_params: str, operation: str, name: str,
                 preamble: str = "") -> None:
        self.name = name
        self.arity = in_params.count(",") + out_params.count(",") + 2

    def __call__(self, *args: Any, size: int | None = None) -> None:
        assert len(args) == self.arity, f"{self.name}: {len(args)} args for {self.arity}"
        if self.name == "keel_multiply_at":
            ordered, order_dst, count, dst = args
            assert size == count == ordered.size == order_dst.size
            for i in range(count):
                dst[order_dst[i]] = dst[order_dst[i]] * ordered[i]
            return
        form, act = self.name[len("keel_"):].split("_", 1)
        f = _ACTIVATIONS[act]
        *operands, p0, p1, y = args
        with np.errstate(all="ignore"):
            if form == "unary":
                v = np.asarray(operands[0], _F32)
            elif form == "scale":
                v = _F32(operands[0]) * y.astype(_F32)
            else:
                c, alpha, beta = operands
                assert c.dtype == y.dtype
                v = _F32(alpha) * y.astype(_F32) + _F32(beta) * c.astype(_F32)
            y[...] = f(v, _F32(p0), _F32(p1))


class EmulatedCupy(FakeCupy):
    """The fake CuPy with NumPy twins of keel's CUDA kernels (see above)."""

    def __init__(self) -> None:
        super().__init__()
        self.RawKernel = _RawKernel
        self.ElementwiseKernel = _ElementwiseKernel
        self.ndarray = np.ndarray
