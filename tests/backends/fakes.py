"""Fake backends and a fake CuPy for tests: every branch runs without the hardware."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Availability, Backend, DeviceKind, KernelContext, KernelTable
from keel.backends.registry import BackendRegistry
from keel.ops.registry import Op

__all__ = ["EmulatedCupy", "FakeCudnn", "FakeCupy", "SpyBackend", "make_backend",
           "spy_registry"]


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

        # The "current stream", and a clock that fake device work advances (ms).
        self.stream = types.SimpleNamespace(ptr=0x5742, is_capturing=lambda: False)
        self.clock = 0.0

        class _Event:
            def __init__(self) -> None:
                self.at = 0.0

            def record(self) -> None:
                self.at = fake.clock

            def synchronize(self) -> None:
                return None

        def elapsed(start: _Event, end: _Event) -> float:
            return end.at - start.at

        runtime = types.SimpleNamespace(getDeviceCount=count, getDeviceProperties=props,
                                        getDevice=lambda: 0)
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=_Device, Event=_Event,
                                          get_elapsed_time=elapsed,
                                          get_current_stream=lambda: fake.stream)

    def advance(self, ms: float) -> None:
        """Device work of ``ms`` milliseconds ran (what events record)."""
        self.clock += ms

    def arange(self, *args: Any, **kwargs: Any) -> Any:
        if self._smoke_error is not None:
            raise self._smoke_error
        return np.arange(*args, **kwargs)

    def asnumpy(self, array: Any) -> np.ndarray:
        return np.array(array, copy=True)         # a device-to-host copy, as CuPy's

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


# ---- a fake nvidia-cudnn-frontend ------------------------------------------------------
class _FakeTensor:
    def __init__(self, uid: int, dim: Sequence[int], stride: Sequence[int], data_type: Any,
                 virtual: bool) -> None:
        self.uid, self.dim, self.stride = uid, list(dim), list(stride)
        self.data_type, self.virtual = data_type, virtual

    def set_output(self, value: bool) -> _FakeTensor:
        self.virtual = not value
        return self

    def set_data_type(self, data_type: Any) -> _FakeTensor:
        self.data_type = data_type
        return self

    def set_dim(self, dim: Sequence[int]) -> _FakeTensor:
        self.dim = list(dim)
        return self

    def set_stride(self, stride: Sequence[int]) -> _FakeTensor:
        self.stride = list(stride)
        return self


def _bfloat16() -> np.dtype[Any]:
    from keel.dtypes import DType

    return DType.BFLOAT16.numpy


_CUDNN_TYPES: dict[Any, Callable[[], np.dtype[Any]]] = {
    "HALF": lambda: np.dtype(np.float16), "BFLOAT16": _bfloat16,
    "FLOAT": lambda: np.dtype(np.float32), None: lambda: np.dtype(np.float32)}


def _host_view(address: int, t: _FakeTensor) -> np.ndarray:
    """The array a device pointer names, read as the tensor describes it (host memory)."""
    dtype = _CUDNN_TYPES[t.data_type]()
    span = 1 + sum((d - 1) * s for d, s in zip(t.dim, t.stride, strict=True))
    buf = (ctypes.c_char * (span * dtype.itemsize)).from_address(address)
    flat = np.frombuffer(memoryview(buf), dtype=dtype)
    return np.lib.stride_tricks.as_strided(
        flat, tuple(t.dim), tuple(s * dtype.itemsize for s in t.stride))


def _cross_correlation(x: np.ndarray, w: np.ndarray, pre: Sequence[int], post: Sequence[int],
                       stride: Sequence[int], dilation: Sequence[int]) -> np.ndarray:
    """cuDNN's conv_fprop by definition, in float64: groups = C / W's channels."""
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    g = c // cg
    xp = np.pad(x, [(0, 0), (0, 0), *zip(pre, post, strict=True)])
    out = [(xp.shape[2 + i] - (w.shape[2 + i] - 1) * dilation[i] - 1) // stride[i] + 1
           for i in range(len(stride))]
    xg = xp.reshape(n, g, cg, *xp.shape[2:])
    wg = w.reshape(g, m // g, cg, *w.shape[2:])
    y = np.zeros((n, g, m // g, *out))
    for offs in itertools.product(*(range(k) for k in w.shape[2:])):
        taps = tuple(slice(o * d, o * d + (size - 1) * s + 1, s)
                     for o, d, s, size in zip(offs, dilation, stride, out, strict=True))
        tap: tuple[Any, ...] = (Ellipsis, *offs)
        y += np.einsum("ngc...,gmc->ngm...", xg[(slice(None),) * 3 + taps], wg[tap])
    return y.reshape(n, m, *out)


class _FakeGraph:
    """A cuDNN frontend graph that records what it is told and computes on the host."""

    def __init__(self, lib: FakeCudnn, **kwargs: Any) -> None:
        self.lib, self.kwargs = lib, kwargs
        self.ops: list[tuple[str, list[_FakeTensor], dict[str, Any], _FakeTensor]] = []
        self.tensors: list[_FakeTensor] = []
        self.notes_deselected: list[Any] = []
        self.heuristics: list[Any] = []
        self.built = False
        self.policy: Any = None
        self._plan_index = 0
        self.timed: list[int] = []

    def _tensor(self, dim: Sequence[int] = (), stride: Sequence[int] = (),
                data_type: Any = None, virtual: bool = True) -> _FakeTensor:
        t = _FakeTensor(len(self.tensors) + 1, dim, stride, data_type, virtual)
        self.tensors.append(t)
        return t

    def tensor(self, name: str = "", dim: Sequence[int] = (), stride: Sequence[int] = (),
               data_type: Any = None) -> _FakeTensor:
        return self._tensor(dim, stride, data_type, virtual=False)

    def _op(self, kind: str, inputs: list[_FakeTensor], **params: Any) -> _FakeTensor:
        out = self._tensor()
        self.ops.append((kind, inputs, params, out))
        return out

    def conv_fprop(self, image: _FakeTensor, weight: _FakeTensor, **params: Any) -> _FakeTensor:
        return self._op("conv_fprop", [image, weight], **params)

    def bias(self, input: _FakeTensor, bias: _FakeTensor, name: str = "") -> _FakeTensor:
        return self._op("bias", [input, bias])

    def add(self, a: _FakeTensor, b: _FakeTensor, name: str = "") -> _FakeTensor:
        return self._op("add", [a, b])

    def relu(self, input: _FakeTensor, lower_clip: float | None = None,
             upper_clip: float | None = None, name: str = "") -> _FakeTensor:
        return self._op("relu", [input], lower_clip=lower_clip, upper_clip=upper_clip)

    def validate(self) -> None:
        return None

    def build_operation_graph(self) -> None:
        return None

    def create_execution_plans(self, modes: Sequence[Any]) -> None:
        self.heuristics = list(modes)

    def deselect_numeric_notes(self, notes: Sequence[Any]) -> None:
        self.notes_deselected.extend(notes)

    def check_support(self) -> None:
        why = self.lib.decline(tuple(op[0] for op in self.ops), self.ops)
        if why:
            raise RuntimeError(f"cudnnGraphNotSupportedError: {why}")

    def build_plans(self, policy: Any = None) -> None:
        why = self.lib.decline_build(tuple(op[0] for op in self.ops))
        if why:
            raise RuntimeError(f"no plan could be built: {why}")
        self.policy = policy
        if not self.built:
            self.lib.builds.append(self)
        self.built = True

    @property
    def costs(self) -> tuple[float, ...]:
        costs = self.lib.plan_costs
        return tuple(costs(tuple(op[0] for op in self.ops)) if callable(costs) else costs)

    def get_execution_plan_count(self) -> int:
        return len(self.costs)

    def get_workspace_size_plan_at_index(self, index: int) -> int:
        return 1024 * (index + 1)

    def select_plan(self, index: int) -> None:
        self._plan_index = index

    def get_workspace_size(self) -> int:
        return 1024 * (self._plan_index + 1)

    def get_plan_name_at_index(self, index: int) -> str:
        return f"fake_engine_{index}"

    def execute_plan_at_index(self, pack: Mapping[int, int], workspace: int, index: int = 0,
                              handle: Any = None) -> None:
        self.timed.append(index)
        self._run(pack, index)

    def execute(self, pack: Mapping[int, int], workspace: int, handle: Any = None) -> None:
        self.lib.executions.append((handle, self.lib.handle_streams.get(id(handle))))
        self._run(pack, self._plan_index)

    def _run(self, pack: Mapping[int, int], index: int) -> None:
        self.lib.tick(self.costs[index])
        values: dict[int, np.ndarray] = {
            t.uid: _host_view(pack[t.uid], t).astype(np.float64)
            for t in self.tensors if not t.virtual and t.uid in pack and t is not self._out}
        for kind, inputs, params, out in self.ops:
            a = [values[t.uid] for t in inputs]
            if kind == "conv_fprop":
                r = _cross_correlation(a[0], a[1], params["pre_padding"],
                                       params["post_padding"], params["stride"],
                                       params["dilation"])
            elif kind in ("bias", "add"):
                r = a[0] + a[1]
            else:
                lo, hi = params["lower_clip"], params["upper_clip"]
                r = np.clip(a[0], 0.0 if lo is None else lo, np.inf if hi is None else hi)
            values[out.uid] = r
        target = _host_view(pack[self._out.uid], self._out)
        target[...] = values[self._out.uid]

    @property
    def _out(self) -> _FakeTensor:
        return self.ops[-1][3]


class FakeCudnn(types.ModuleType):
    """Enough of the ``cudnn`` module (nvidia-cudnn-frontend) for keel's cudnn conv,
    computing on the host from the pointers it is given. ``decline(kinds, ops)``
    returns why a graph of those op kinds is not supported (None: it is)."""

    def __init__(self, version: int = 91900, *, load_error: Exception | None = None,
                 decline: Callable[..., str | None] | None = None,
                 plan_costs: Sequence[float] | Callable[..., Sequence[float]] = (1.0,),
                 tick: Callable[[float], None] = lambda ms: None,
                 decline_build: Callable[..., str | None] | None = None) -> None:
        super().__init__("cudnn")
        self.__version__ = "0.0-fake"
        self._version, self._load_error = version, load_error
        self.decline = decline or (lambda kinds, ops: None)
        # Why building a graph of these op kinds fails after check_support passed (None: it
        # builds).
        self.decline_build = decline_build or (lambda kinds: None)
        # Milliseconds each ranked plan takes (or a function of a graph's op kinds giving
        # them); running one reports its cost to ``tick``.
        self.plan_costs, self.tick = plan_costs, tick
        self.builds: list[_FakeGraph] = []
        self.executions: list[tuple[Any, Any]] = []
        self.handles: list[object] = []
        self.handle_streams: dict[int, int] = {}
        self.data_type = types.SimpleNamespace(FLOAT="FLOAT", HALF="HALF", BFLOAT16="BFLOAT16")
        self.heur_mode = types.SimpleNamespace(A="A", B="B", FALLBACK="FALLBACK")
        self.build_plan_policy = types.SimpleNamespace(ALL="ALL",
                                                       HEURISTICS_CHOICE="HEURISTICS_CHOICE")
        self.numerical_note = types.SimpleNamespace(
            TENSOR_CORE="TENSOR_CORE", DOWN_CONVERT_INPUTS="DOWN_CONVERT_INPUTS",
            NONDETERMINISTIC="NONDETERMINISTIC")
        lib = self

        def pygraph(**kwargs: Any) -> _FakeGraph:
            return _FakeGraph(lib, **kwargs)

        self.pygraph = pygraph

    def backend_version(self) -> int:
        if self._load_error is not None:
            raise self._load_error
        return self._version

    def create_handle(self) -> object:
        handle = object()
        self.handles.append(handle)
        return handle

    def set_stream(self, handle: object, stream: int) -> None:
        self.handle_streams[id(handle)] = stream


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


# cuBLAS's GemmEx calls as cupy.cuda.cublas binds them: column-major operands named by
# device pointers (host memory here), computed in float32 and stored in the output type.
_CUDA_TYPES = {0: np.dtype(np.float32), 2: np.dtype(np.float16)}


def _cuda_type(code: int) -> np.dtype[Any]:
    return _bfloat16() if code == 14 else _CUDA_TYPES[code]      # 14: CUDA_R_16BF


def _column_major(address: int, code: int, rows: int, cols: int, ld: int) -> np.ndarray:
    dtype = _cuda_type(code)
    assert ld >= rows, f"leading dimension {ld} < rows {rows}"
    span = (cols - 1) * ld + rows if rows and cols else 0
    buf = (ctypes.c_char * (span * dtype.itemsize)).from_address(address)
    flat = np.frombuffer(memoryview(buf), dtype=dtype)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols),
                                           (dtype.itemsize, ld * dtype.itemsize))


class _Cublas(types.SimpleNamespace):
    """``cupy.cuda.cublas``'s gemmEx and gemmStridedBatchedEx on host memory."""

    CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 68, -1

    def __init__(self) -> None:
        super().__init__(calls=[], streams={})

    def setStream(self, handle: int, stream: int) -> None:
        self.streams[handle] = stream

    def _one(self, ta: int, tb: int, m: int, n: int, k: int, alpha: int, a: int, at: int,
             lda: int, b: int, bt: int, ldb: int, beta: int, c: int, ct: int,
             ldc: int) -> None:
        scale, shift = (float(ctypes.c_float.from_address(p).value) for p in (alpha, beta))
        x = _column_major(a, at, *((k, m) if ta else (m, k)), lda).astype(_F32)
        w = _column_major(b, bt, *((n, k) if tb else (k, n)), ldb).astype(_F32)
        y = _column_major(c, ct, m, n, ldc)
        wide = scale * ((x.T if ta else x) @ (w.T if tb else w))
        y[...] = wide + shift * y.astype(_F32) if shift else wide

    def gemmEx(self, handle: int, ta: int, tb: int, m: int, n: int, k: int,
               alpha: int, a: int, at: int, lda: int, b: int, bt: int, ldb: int, beta: int,
               c: int, ct: int, ldc: int, compute: int, algo: int) -> None:
        self.calls.append(("gemmEx", at, bt, ct, compute))
        self._one(ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc)

    def gemmStridedBatchedEx(self, handle: int, ta: int, tb: int, m: int, n: int,
                             k: int, alpha: int, a: int, at: int, lda: int, sa: int, b: int,
                             bt: int, ldb: int, sb: int, beta: int, c: int, ct: int, ldc: int,
                             sc: int, count: int, compute: int, algo: int) -> None:
        self.calls.append(("gemmStridedBatchedEx", at, bt, ct, compute))
        size = {t: _cuda_type(t).itemsize for t in (at, bt, ct)}
        for i in range(count):
            self._one(ta, tb, m, n, k, alpha, a + i * sa * size[at], at, lda,
                      b + i * sb * size[bt], bt, ldb, beta, c + i * sc * size[ct], ct, ldc)


class EmulatedCupy(FakeCupy):
    """The fake CuPy with NumPy twins of keel's CUDA kernels (see above) and of the cuBLAS
    calls keel makes itself (``cuda.cublas``)."""

    def __init__(self) -> None:
        super().__init__()
        self.RawKernel = _RawKernel
        self.ElementwiseKernel = _ElementwiseKernel
        self.ndarray = np.ndarray
        self.cuda.cublas = _Cublas()
        self.cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 0x0B1A5)
        self.cuda.runtime.CUDA_R_16BF = 14
