"""The op-level runtime interface of seed 001.

::

    rt = keel.Runtime(backend="cpu")              # "auto" | "cpu" | "gpu" | "reference" | plugin
    a = rt.allocate(keel.TensorDesc((8,), "float32"))
    rt.write(a, np.arange(8))
    c = rt.allocate(keel.TensorDesc((8,), "float32"))
    rt.run_op("add", inputs=[a, a], outputs=[c])
    rt.synchronize()
    rt.read(c)

A pinned backend (the ``backend`` argument, else ``KEEL_BACKEND``) is
resolved when the runtime is made: if it cannot run here the constructor
raises ``BackendSelectionError`` naming it, before anything is allocated.
With ``backend="auto"`` each tensor lives on a backend of its descriptor's
device and each op runs where :func:`~keel.planning.selection.select_backend`
puts it, moving inputs when needed. An op writes its outputs only after it
succeeded: a failing op leaves them untouched. A ``Runtime`` is not meant to
be shared between threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from keel.backends.base import Backend
from keel.backends.registry import BackendRegistry, default_registry
from keel.dtypes import DType
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.hardware.profile import HardwareProfile
from keel.ops.registry import Op, to_op
from keel.planning.selection import (
    Calibration,
    OperationProperties,
    Selection,
    resolve_pin,
    select_backend,
)
from keel.tensors import TensorDesc

__all__ = ["Runtime", "RuntimeTensor"]


class RuntimeTensor:
    """A tensor allocated by a :class:`Runtime`: its descriptor and its backend's array."""

    __slots__ = ("_array", "_owner", "backend", "desc")

    def __init__(self, desc: TensorDesc, backend: Backend, array: Any, owner: Runtime) -> None:
        self.desc = desc
        self.backend = backend
        self._array = array
        self._owner = owner

    @property
    def shape(self) -> tuple[int, ...]:
        return self.desc.shape

    @property
    def dtype(self) -> DType:
        return self.desc.dtype

    @property
    def device(self) -> str:
        return self.desc.device

    @property
    def freed(self) -> bool:
        return self._array is None

    @property
    def array(self) -> Any:
        """The backend's array (a NumPy or CuPy array)."""
        if self._array is None:
            raise InvalidArgumentError(f"tensor {self.desc} was freed; allocate a new one")
        return self._array

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return (f"<RuntimeTensor {self.dtype.value}{list(self.shape)} on "
                f"{self.backend.name}{state}>")


class Runtime:
    """Allocate tensors, run named ops on them, read results (seed 001)."""

    def __init__(self, backend: str = "auto", registry: BackendRegistry | None = None, *,
                 policy: Any = None, profile: HardwareProfile | None = None,
                 calibration: Calibration | None = None) -> None:
        if not isinstance(backend, str):
            raise InvalidArgumentError(f"backend must be a name such as 'auto', 'cpu', 'gpu' "
                                       f"or 'reference', got {backend!r}")
        self._registry = registry if registry is not None else default_registry()
        self._policy, self._profile, self._calibration = policy, profile, calibration
        pin, self._pin_source = resolve_pin(backend, policy)
        # Resolved now: a backend that cannot run here fails before any allocation.
        self._pinned = self._registry.get(pin) if pin is not None else None
        self._used: dict[str, Backend] = {}
        self.last_selection: Selection | None = None

    @property
    def backend(self) -> str:
        """The pinned backend's name, or ``"auto"``."""
        return self._pinned.name if self._pinned is not None else "auto"

    # ---- memory --------------------------------------------------------
    def allocate(self, desc: TensorDesc) -> RuntimeTensor:
        """A zero-filled tensor described by ``desc``."""
        if not isinstance(desc, TensorDesc):
            raise InvalidArgumentError(f"allocate takes a TensorDesc, got {type(desc).__name__}")
        backend = self._backend_for(desc)
        array = backend.allocate(desc.shape, desc.dtype)
        self._used[backend.name] = backend
        return RuntimeTensor(desc, backend, array, self)

    def write(self, tensor: RuntimeTensor, data: Any) -> None:
        """Copy host ``data`` (same shape or element count) into ``tensor``."""
        self._own(tensor, "write to").backend.write(tensor.array, data)

    def read(self, tensor: RuntimeTensor) -> np.ndarray:
        """A NumPy copy of ``tensor``'s data."""
        return self._own(tensor, "read").backend.read(tensor.array)

    def free(self, tensor: RuntimeTensor) -> None:
        """Release ``tensor``; using it afterwards raises ``InvalidArgumentError``."""
        self._own(tensor, "free").backend.free(tensor.array)
        tensor._array = None

    def synchronize(self) -> None:
        """Wait until every op queued on any backend this runtime used has finished."""
        for backend in self._used.values():
            backend.synchronize()

    # ---- ops -----------------------------------------------------------
    def run_op(self, name: str | Op, inputs: Sequence[RuntimeTensor | None] = (),
               outputs: Sequence[RuntimeTensor] | None = None, **attrs: Any,
               ) -> list[RuntimeTensor]:
        """Run op ``name``; write ``outputs`` (or new tensors) and return them.

        Attributes are keyword arguments (``axes=(0,)``, ``perm=(1, 0)``). ``reshape``,
        ``expand_dims`` and ``squeeze`` given one input, no shape or axes and one output
        take their target from that output's shape.
        """
        op = to_op(name)
        for label, given in (("inputs", inputs), ("outputs", () if outputs is None else outputs)):
            if isinstance(given, str) or not isinstance(given, Sequence):
                raise InvalidArgumentError(
                    f"run_op {label} must be a list of tensors, got {type(given).__name__}")
        ins = [None if t is None else self._own(t, "use") for t in inputs]
        outs = None if outputs is None else [self._own(t, "write to") for t in outputs]
        if op in _SHAPED_BY_OUTPUT and outs is not None:
            attrs = _target_from_output(op, ins, outs, attrs)
        selection = select_backend(self._properties(op, ins, outs), self._profile,
                                   self._policy, self._registry,
                                   pinned=None if self._pinned is None else self._pinned.name,
                                   calibration=self._calibration)
        backend = self._registry.instance(selection.backend)
        self._used[backend.name] = backend
        arrays = [None if t is None else _array_on(t, backend) for t in ins]
        if outs is None:
            results = backend.run(op, arrays, None, attrs)
            self.last_selection = selection
            return [self._wrap(r, backend, arrays) for r in results]
        # Outputs elsewhere get a scratch buffer on this backend, copied over on success.
        buffers = [t.array if _shares_arrays(t.backend, backend)
                   else backend.allocate(t.shape, t.dtype) for t in outs]
        backend.run(op, arrays, buffers, attrs)
        for t, buf in zip(outs, buffers, strict=True):
            if buf is not t.array:
                t.backend.write(t.array, backend.read(buf))
        self.last_selection = selection
        return list(outs)

    # ---- internals -----------------------------------------------------
    def _backend_for(self, desc: TensorDesc) -> Backend:
        if self._pinned is not None:
            if self._pinned.device.value != desc.device:
                raise InvalidArgumentError(
                    f"TensorDesc device {desc.device!r} does not match backend "
                    f"{self._pinned.name!r} (device {self._pinned.device.value}) pinned by "
                    f"{self._pin_source}; use TensorDesc(..., "
                    f"device={self._pinned.device.value!r})")
            return self._pinned
        reasons = []
        for name in self._registry.priority:
            avail = self._registry.availability(name)
            if not avail.available:
                reasons.append(f"{name}: {avail.reason}")
                continue
            backend = self._registry.instance(name)
            if backend.device.value == desc.device:
                return backend
        raise BackendSelectionError(desc.device, "; ".join(reasons)
                                    or f"no {desc.device} backend in the priority chain")

    def _own(self, tensor: Any, action: str) -> RuntimeTensor:
        if not isinstance(tensor, RuntimeTensor):
            raise InvalidArgumentError(
                f"cannot {action} a {type(tensor).__name__}; pass a tensor from "
                "Runtime.allocate or run_op")
        if tensor._owner is not self:
            raise InvalidArgumentError(f"cannot {action} a tensor of another Runtime")
        tensor.array  # noqa: B018  (raises when freed)
        return tensor

    @staticmethod
    def _properties(op: Op, ins: Sequence[RuntimeTensor | None],
                    outs: Sequence[RuntimeTensor] | None) -> OperationProperties:
        present = [t for t in ins if t is not None]
        described = present or list(outs or ())
        dtype = described[0].dtype if described else DType.FLOAT32
        return OperationProperties(
            op,
            element_count=sum(t.desc.numel for t in present),
            nbytes=sum(t.desc.nbytes for t in present),
            dtype=dtype,
            residency="gpu" if any(t.device == "gpu" for t in present) else "cpu",
        )

    def _wrap(self, result: Any, backend: Backend, inputs: Sequence[Any]) -> RuntimeTensor:
        # A result may be a view of an input (reshape); a new tensor owns its memory.
        if any(x is not None and _may_share(backend, result, x) for x in inputs):
            result = result.copy()
        desc = TensorDesc(tuple(result.shape), DType.from_numpy(result.dtype),
                          backend.device.value)
        return RuntimeTensor(desc, backend, result, self)


# Seed 001's shape ops: with one input and no target, the output's shape is the target.
_SHAPED_BY_OUTPUT = {Op.RESHAPE: "shape", Op.EXPAND_DIMS: "axes", Op.SQUEEZE: "axes"}


def _target_from_output(op: Op, ins: Sequence[RuntimeTensor | None],
                        outs: Sequence[RuntimeTensor], attrs: dict[str, Any]) -> dict[str, Any]:
    """``attrs`` with the shape or axes that turn ``ins[0]`` into ``outs[0]``'s shape, when
    the call gives neither (no second input, no ``shape``/``axes``/``axis`` attribute)."""
    given = any(attrs.get(k) is not None for k in ("shape", "axes", "axis"))
    if given or len(ins) != 1 or ins[0] is None or len(outs) != 1:
        return attrs
    src, dst = ins[0].shape, outs[0].shape
    if op is Op.RESHAPE:
        if ins[0].desc.numel != outs[0].desc.numel:
            raise InvalidArgumentError(
                f"reshape: the input {src} has {ins[0].desc.numel} elements but the output "
                f"{dst} holds {outs[0].desc.numel}; give an output of the same element count "
                "or a shape")
        return {**attrs, "shape": dst}
    wider, narrower = (dst, src) if op is Op.EXPAND_DIMS else (src, dst)
    axes = _unit_axes(wider, narrower)
    if axes is None:
        verb = "inserted" if op is Op.EXPAND_DIMS else "removed"
        raise InvalidArgumentError(
            f"{op.value}: the output shape {dst} is not the input shape {src} with size-1 "
            f"dims {verb}; give axes")
    return {**attrs, "axes": axes}


def _unit_axes(wider: tuple[int, ...], narrower: tuple[int, ...]) -> tuple[int, ...] | None:
    """The axes of ``wider`` that, all of size 1 and removed, leave ``narrower``; None if
    there are none such. Matching greedily is enough: skipping a 1 that also matches gives
    the same dims."""
    axes: list[int] = []
    i = 0
    for j, d in enumerate(wider):
        if i < len(narrower) and narrower[i] == d:
            i += 1
        elif d == 1:
            axes.append(j)
        else:
            return None
    return tuple(axes) if i == len(narrower) else None


def _shares_arrays(a: Backend, b: Backend) -> bool:
    """Whether arrays of ``a`` can be used by ``b`` as they are."""
    return a is b or a.xp is b.xp


def _array_on(tensor: RuntimeTensor, backend: Backend) -> Any:
    if _shares_arrays(tensor.backend, backend):
        return tensor.array
    return backend.to_device(tensor.backend.read(tensor.array))


def _may_share(backend: Backend, a: Any, b: Any) -> bool:
    may_share = getattr(backend.xp, "may_share_memory", None)
    return bool(may_share(a, b)) if may_share is not None else a is b
