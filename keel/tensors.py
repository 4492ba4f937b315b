"""Tensors: :class:`TensorDesc` (what to allocate) and :class:`Tensor` (seed 004's array).

A ``Tensor`` lives on one backend. Every operation on it is dispatched
through :func:`keel.planning.selection.select_backend`: small work stays on
the CPU, large matmul-like and elementwise work moves to the GPU when one is
available and pays back the transfer, data already on the GPU stays there,
and a pinned backend (``KEEL_BACKEND``) is authoritative. The result lives
where the op ran; :func:`explain_last_dispatch` says where that was and why.

Python scalars mix with tensors the NumPy 2 way (``t * 2`` keeps ``t``'s
dtype), tensors of different dtypes are promoted with NumPy's rules, ``/``
of integers gives float64 and ``mean`` of integers is a float64 mean.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np

from keel.backends.base import Backend, DeviceKind, dtype_of
from keel.backends.registry import BackendRegistry, default_registry
from keel.dtypes import DType, as_dtype
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.types import checked_numel
from keel.planning.selection import OperationProperties, select_backend

__all__ = [
    "DispatchRecord",
    "Tensor",
    "TensorDesc",
    "explain_last_dispatch",
    "tensor",
    "use_registry",
]

_DEVICES = tuple(d.value for d in DeviceKind)


@dataclass(frozen=True, init=False)
class TensorDesc:
    """Shape, dtype and device of a tensor to allocate (seed 001's tensor descriptor)."""

    shape: tuple[int, ...]
    dtype: DType
    device: str

    def __init__(self, shape: Sequence[int] | int, dtype: DType | str,
                 device: str = "cpu") -> None:
        dims_in = (shape,) if isinstance(shape, int) else shape
        try:
            dims = tuple(operator.index(d) for d in dims_in)
        except TypeError:
            raise InvalidArgumentError(
                f"TensorDesc shape must be a sequence of ints, got {shape!r}") from None
        checked_numel(dims, what="TensorDesc shape")
        dt = as_dtype(dtype)
        if dt is DType.STRING:
            raise InvalidArgumentError("TensorDesc dtype string is not allowed; use a numeric "
                                       "or bool dtype")
        kind = str(device).strip().lower()
        if kind not in _DEVICES:
            raise InvalidArgumentError(
                f"TensorDesc device {device!r} is not allowed; use one of "
                f"{', '.join(_DEVICES)}")
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "device", kind)

    @property
    def numel(self) -> int:
        return checked_numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class DispatchRecord:
    """Where one tensor operation ran and why."""

    op: str
    backend: str
    device: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        lines = [f"{self.op} ran on {self.backend} ({self.device}): {self.reason}"]
        lines += [f"  not {b}: {r}" for b, r in self.rejected]
        return "\n".join(lines)


_STATE = threading.local()
_REGISTRY: ContextVar[BackendRegistry | None] = ContextVar("keel_tensor_registry",
                                                           default=None)


def explain_last_dispatch() -> DispatchRecord | None:
    """Where the last tensor operation of this thread ran and why (None before any)."""
    record: DispatchRecord | None = getattr(_STATE, "last", None)
    return record


@contextmanager
def use_registry(registry: BackendRegistry) -> Iterator[BackendRegistry]:
    """Dispatch tensor operations through ``registry`` inside the ``with`` block."""
    token = _REGISTRY.set(registry)
    try:
        yield registry
    finally:
        _REGISTRY.reset(token)


def _registry() -> BackendRegistry:
    return _REGISTRY.get() or default_registry()


def _backend_for_device(device: str) -> Backend:
    """The first available backend of ``device`` kind in the priority chain."""
    kind = str(device).strip().lower()
    if kind not in _DEVICES:
        raise InvalidArgumentError(
            f"device {device!r} is not allowed; use one of {', '.join(_DEVICES)}")
    reg = _registry()
    reasons = []
    for name in reg.priority:          # opt-in backends (webgpu) only once in the chain
        avail = reg.availability(name)
        if avail.available:
            backend = reg.instance(name)
            if backend.device.value == kind:
                return backend
        elif _declared_device(reg, name) in (kind, None):
            reasons.append(f"{name}: {avail.reason}")
    raise BackendSelectionError(kind, "; ".join(reasons) or f"no {kind} backend is registered")


def _declared_device(reg: BackendRegistry, name: str) -> str | None:
    try:
        return reg.instance(name).device.value
    except BackendSelectionError:
        return None


def tensor(data: Any, device: str = "cpu", dtype: DType | str | None = None) -> Tensor:
    """A tensor holding a copy of ``data`` (anything ``numpy.asarray`` takes) on ``device``."""
    if isinstance(data, Tensor):
        host = data.numpy()
    else:
        try:
            host = np.asarray(data)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"cannot make a tensor from {type(data).__name__}: "
                                       f"{exc}") from None
        if host.dtype.kind in "OUSV":
            raise InvalidArgumentError(
                f"cannot make a tensor from {type(data).__name__} {data!r:.60}: it is not "
                "numeric data (a number, a nested list of numbers or an array)")
    if dtype is not None:
        host = host.astype(as_dtype(dtype).numpy)
    backend = _backend_for_device(device)
    return Tensor(backend.to_device(host), backend)


class Tensor:
    """An n-dimensional array on one backend; operations dispatch with reasons.

    Make one with :func:`keel.tensor`. Tensors are immutable: every operation
    gives a new tensor (which may share memory with its input, e.g. a reshape).
    """

    __slots__ = ("_array", "_backend", "_dtype")
    __array_priority__ = 1000        # NumPy defers ``ndarray + Tensor`` to Tensor

    def __init__(self, array: Any, backend: Backend) -> None:
        self._array = array
        self._backend = backend
        self._dtype = dtype_of(array)

    # ---- description ---------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self._array.shape)

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def device(self) -> str:
        return self._backend.device.value

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return checked_numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        if not self.shape:
            raise InvalidArgumentError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", threshold=20, prefix="Tensor(")
        return f"Tensor({body}, dtype={self.dtype.value}, device={self.device})"

    # ---- moving data ---------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A NumPy copy of the data (on the host)."""
        return self._backend.read(self._array)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        host = self.numpy()
        return host if dtype is None else host.astype(dtype, copy=False)

    def to_device(self, device: str) -> Tensor:
        """This tensor on ``device`` ("cpu" or "gpu"); itself when already there."""
        backend = _backend_for_device(device)
        if backend.device is self._backend.device:
            return self
        return Tensor(backend.to_device(self.numpy()), backend)

    def item(self) -> Any:
        if self.size != 1:
            raise InvalidArgumentError(f"item() needs a tensor of one element, shape is "
                                       f"{self.shape}")
        return self.numpy().reshape(()).item()

    def __bool__(self) -> bool:
        if self.size != 1:
            raise InvalidArgumentError(
                f"the truth value of a tensor of shape {self.shape} is ambiguous")
        return bool(self.item())

    # ---- arithmetic ----------------------------------------------------
    def __add__(self, other: Any) -> Tensor:
        return _binary(Op.ADD, self, other)

    def __radd__(self, other: Any) -> Tensor:
        return _binary(Op.ADD, other, self)

    def __sub__(self, other: Any) -> Tensor:
        return _binary(Op.SUB, self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return _binary(Op.SUB, other, self)

    def __mul__(self, other: Any) -> Tensor:
        return _binary(Op.MUL, self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return _binary(Op.MUL, other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return _binary(Op.DIV, self, other, true_division=True)

    def __rtruediv__(self, other: Any) -> Tensor:
        return _binary(Op.DIV, other, self, true_division=True)

    def __matmul__(self, other: Any) -> Tensor:
        return _binary(Op.MATMUL, self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return _binary(Op.MATMUL, other, self)

    def __neg__(self) -> Tensor:
        return _run(Op.NEG, [self])

    def __abs__(self) -> Tensor:
        return _run(Op.ABS, [self])

    def abs(self) -> Tensor:
        return _run(Op.ABS, [self])

    # ---- comparisons (elementwise, bool results) -----------------------
    def __lt__(self, other: Any) -> Tensor:
        return _binary(Op.LESS, self, other)

    def __le__(self, other: Any) -> Tensor:
        return _binary(Op.LESS_EQUAL, self, other)

    def __gt__(self, other: Any) -> Tensor:
        return _binary(Op.GREATER, self, other)

    def __ge__(self, other: Any) -> Tensor:
        return _binary(Op.GREATER_EQUAL, self, other)

    def __eq__(self, other: Any) -> Tensor:  # type: ignore[override]
        return _binary(Op.EQUAL, self, other)

    def __ne__(self, other: Any) -> Tensor:  # type: ignore[override]
        return _run(Op.NOT, [_binary(Op.EQUAL, self, other)])

    __hash__ = None  # type: ignore[assignment]

    # ---- reductions ----------------------------------------------------
    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Sum over ``axis`` (all axes when None), as ``numpy.sum``."""
        return _reduce(Op.SUM_ALL, Op.SUM, self, axis, keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Mean over ``axis`` (all axes when None); integers give a float64 mean."""
        x = self.astype(DType.FLOAT64) if self.dtype.is_int or self.dtype is DType.BOOL \
            else self
        return _reduce(Op.MEAN_ALL, Op.MEAN, x, axis, keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Maximum over ``axis`` (all axes when None)."""
        if self.size == 0:
            raise InvalidArgumentError(f"max of an empty tensor (shape {self.shape})")
        return _reduce(None, Op.REDUCE_MAX, self, axis, keepdims)

    # ---- shape -----------------------------------------------------------
    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        """The same elements in a new shape (one dimension may be -1)."""
        dims = _dims(shape)
        return _run(Op.RESHAPE, [self], shape=dims)

    def transpose(self, *axes: int | Sequence[int]) -> Tensor:
        """Axes permuted by ``axes`` (reversed when none are given)."""
        perm = _dims(axes)
        return _run(Op.TRANSPOSE, [self], **({"perm": perm} if perm else {}))

    @property
    def T(self) -> Tensor:
        return self.transpose()

    def astype(self, dtype: DType | str) -> Tensor:
        """A copy converted to ``dtype`` (ONNX Cast semantics)."""
        target = as_dtype(dtype)
        if target is self.dtype:
            return self
        return _run(Op.CAST, [self], to=target)


# ---- dispatch ----------------------------------------------------------------

def _dims(args: Sequence[int | Sequence[int]]) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (Sequence, np.ndarray)):
        args = tuple(args[0])
    try:
        return tuple(operator.index(a) for a in args)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"dimensions must be ints, got {args!r}") from None


def _reduce(whole: Op | None, along: Op, x: Tensor, axis: int | Sequence[int] | None,
            keepdims: bool) -> Tensor:
    if axis is None and not keepdims and whole is not None:
        return _run(whole, [x])
    attrs: dict[str, Any] = {"keepdims": bool(keepdims)}
    if axis is not None:
        attrs["axes"] = (axis,) if isinstance(axis, int) else tuple(axis)
    return _run(along, [x], **attrs)


def _binary(op: Op, a: Any, b: Any, *, true_division: bool = False) -> Tensor:
    like = a if isinstance(a, Tensor) else b
    ta, tb = _as_tensor(a, like), _as_tensor(b, like)
    target = np.result_type(_promotable(a), _promotable(b))
    if true_division and target.kind in "biu":
        target = np.dtype(np.float64)
    dt = DType.from_numpy(target)
    return _run(op, [ta.astype(dt), tb.astype(dt)])


def _promotable(x: Any) -> Any:
    # Tensors promote by dtype; Python scalars stay "weak" (NumPy 2 rules).
    if isinstance(x, Tensor):
        return x.dtype.numpy
    if isinstance(x, (bool, int, float)):
        return x
    return np.asarray(x).dtype


def _as_tensor(x: Any, like: Tensor) -> Tensor:
    if isinstance(x, Tensor):
        return x
    try:
        if isinstance(x, (bool, int, float)):
            host = np.asarray(x, dtype=np.result_type(like.dtype.numpy, x))
        else:
            host = np.asarray(x)
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"cannot combine a {like.dtype.value} tensor with {x!r}: {exc}") from None
    return Tensor(like._backend.to_device(host), like._backend)


def _run(op: Op, operands: Sequence[Tensor], **attrs: Any) -> Tensor:
    reg = _registry()
    props = OperationProperties(
        op,
        element_count=sum(t.size for t in operands),
        nbytes=sum(t.nbytes for t in operands),
        dtype=operands[0].dtype,
        residency="gpu" if any(t.device == "gpu" for t in operands) else "cpu",
    )
    selection = select_backend(props, registry=reg)
    backend = reg.instance(selection.backend)
    arrays = [_on(t, backend) for t in operands]
    results = backend.run(op, arrays, None, attrs)
    _STATE.last = DispatchRecord(op.value, backend.name, backend.device.value,
                                 selection.reason, selection.rejected)
    return Tensor(results[0], backend)


def _on(t: Tensor, backend: Backend) -> Any:
    """``t``'s array as an array of ``backend`` (copied across devices when needed)."""
    if t._backend is backend or t._backend.xp is backend.xp:
        return t._array
    return backend.to_device(t.numpy())
