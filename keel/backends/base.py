"""The backend contract.

A backend is a small object that says whether it can run here (and why
not), what it can do, and runs ops through a table of kernels.

Writing a backend
-----------------
Subclass :class:`Backend`, set ``name`` and ``device``, and implement the
private hooks:

* ``_check_available() -> Availability`` — called once; never raises.
* ``_kernels() -> KernelTable`` — the kernels this backend runs.
* ``xp`` — the array namespace (``numpy``, ``cupy``) kernels receive.
* ``_to_device(host_array)`` / ``_to_host(array)`` — copies in and out.
* ``_synchronize()`` — wait for queued work (no-op on the CPU).

The public methods (``run``, ``allocate``, ``write``, ``read``) are final:
they validate arguments, check the op against the schema and wrap kernel
failures in typed errors. ``run`` computes into fresh arrays and copies into
the caller's outputs only once the kernel succeeded, so a failing op leaves
its outputs untouched.

Kernels
-------
A kernel is ``fn(ctx, inputs, attrs, out) -> list[array]``: ``inputs`` are
arrays of this backend (``None`` for an absent optional input), ``attrs`` the
schema-normalized attributes, ``out`` either ``None`` or preallocated output
arrays the kernel should write into (it returns them). Kernels register in a
:class:`KernelTable` with ``@table.kernel(Op.ADD)``; several *variants* of one
op may register with metadata, and a ``default`` variant is always present.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, final

import numpy as np

from keel.dtypes import DType, as_dtype
from keel.errors import (
    BackendSelectionError,
    ExecutionError,
    InvalidArgumentError,
    KeelError,
    UnsupportedOperationError,
)
from keel.ops.registry import Op, to_op
from keel.ops.schema import get_schema
from keel.ops.types import checked_numel

__all__ = [
    "Availability",
    "Backend",
    "Capabilities",
    "DeviceKind",
    "Kernel",
    "KernelContext",
    "KernelTable",
    "KernelVariant",
]


class DeviceKind(str, enum.Enum):
    CPU = "cpu"
    GPU = "gpu"


@dataclass(frozen=True)
class KernelContext:
    """What a kernel may know about where it runs."""

    xp: Any                      # the array namespace: numpy or cupy
    backend: str
    device: DeviceKind
    threads: int | None = None


Kernel = Callable[[KernelContext, Sequence[Any], Mapping[str, Any], Sequence[Any] | None],
                  Sequence[Any]]


@dataclass(frozen=True)
class KernelVariant:
    """One implementation of an op with the metadata a planner needs to choose it."""

    op: Op
    name: str
    fn: Kernel
    dtypes: frozenset[DType] | None = None      # None: any dtype
    supports_out: bool = False                   # writes into preallocated outputs
    description: str = ""
    # Free-form, typed-by-convention facts: "kernel_size": (3, 3), "stride": 1, ...
    meta: Mapping[str, Any] = field(default_factory=dict)


class KernelTable:
    """Kernels of one backend, by op and variant."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._variants: dict[Op, dict[str, KernelVariant]] = {}

    def register(self, variant: KernelVariant) -> KernelVariant:
        variants = self._variants.setdefault(variant.op, {})
        if variant.name in variants:
            raise ValueError(f"{self.backend}: {variant.op.value}/{variant.name} registered twice")
        variants[variant.name] = variant
        return variant

    def kernel(
        self,
        *ops: Op,
        variant: str = "default",
        dtypes: Iterable[DType | str] | None = None,
        supports_out: bool = False,
        description: str = "",
        **meta: Any,
    ) -> Callable[[Kernel], Kernel]:
        """Decorator: ``@table.kernel(Op.ADD, Op.SUB)`` registers ``fn`` for each op."""
        dts = None if dtypes is None else frozenset(as_dtype(d) for d in dtypes)

        def wrap(fn: Kernel) -> Kernel:
            for op in ops:
                self.register(KernelVariant(op, variant, fn, dts, supports_out,
                                            description or (fn.__doc__ or "").strip(), meta))
            return fn

        return wrap

    def update(self, other: KernelTable) -> None:
        """Register every variant of ``other`` not already present here."""
        for op, variants in other._variants.items():
            for name, v in variants.items():
                self._variants.setdefault(op, {}).setdefault(name, v)

    def ops(self) -> frozenset[Op]:
        return frozenset(op for op, v in self._variants.items() if "default" in v)

    def variants(self, op: Op) -> dict[str, KernelVariant]:
        return dict(self._variants.get(op, {}))

    def get(self, op: Op, variant: str = "default") -> KernelVariant:
        try:
            return self._variants[op][variant]
        except KeyError:
            have = ", ".join(self._variants.get(op, {})) or "none"
            raise UnsupportedOperationError(
                op.value, self.backend, detail=f"variant {variant!r}; variants here: {have}"
            ) from None

    def __contains__(self, op: object) -> bool:
        return op in self._variants and "default" in self._variants[op]  # type: ignore[index]


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str


@dataclass(frozen=True)
class Capabilities:
    name: str
    device: DeviceKind
    available: bool
    reason: str
    dtypes: tuple[str, ...]
    ops: tuple[str, ...]
    simd_level: str | None = None
    threads: int | None = None
    memory_bytes: int | None = None
    notes: tuple[str, ...] = ()


class Backend(ABC):
    """A place where ops run. See the module docstring for the contract."""

    name: ClassVar[str]
    device: ClassVar[DeviceKind]
    dtypes: ClassVar[frozenset[DType]] = frozenset(DType) - {DType.STRING}

    def __init__(self) -> None:
        self._availability: Availability | None = None
        self._table: KernelTable | None = None
        self.threads: int | None = None

    # ---- hooks ---------------------------------------------------------
    @abstractmethod
    def _check_available(self) -> Availability: ...

    @abstractmethod
    def _kernels(self) -> KernelTable: ...

    @property
    @abstractmethod
    def xp(self) -> Any: ...

    def _to_device(self, host: np.ndarray) -> Any:
        return self.xp.asarray(host)

    def _to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def _synchronize(self) -> None:
        return None

    def _capability_details(self) -> dict[str, Any]:
        return {}

    # ---- public, final ------------------------------------------------
    @final
    def availability(self) -> Availability:
        if self._availability is None:
            try:
                self._availability = self._check_available()
            except Exception as exc:  # an availability check never raises
                self._availability = Availability(False, f"availability check failed: {exc}")
        return self._availability

    @final
    def is_available(self) -> bool:
        return self.availability().available

    @final
    def require_available(self) -> None:
        avail = self.availability()
        if not avail.available:
            raise BackendSelectionError(self.name, avail.reason)

    @property
    def kernels(self) -> KernelTable:
        if self._table is None:
            self._table = self._kernels()
        return self._table

    @final
    def supports(self, op: Op | str, dtype: DType | None = None) -> bool:
        op = to_op(op)
        if op not in self.kernels:
            return False
        if dtype is None:
            return True
        v = self.kernels.get(op)
        return (dtype in self.dtypes) and (v.dtypes is None or dtype in v.dtypes)

    @final
    def capabilities(self) -> Capabilities:
        avail = self.availability()
        details = self._capability_details() if avail.available else {}
        return Capabilities(
            name=self.name,
            device=self.device,
            available=avail.available,
            reason=avail.reason,
            dtypes=tuple(sorted(d.value for d in self.dtypes)),
            ops=tuple(sorted(o.value for o in self.kernels.ops())),
            **details,
        )

    def context(self) -> KernelContext:
        return KernelContext(self.xp, self.name, self.device, self.threads)

    @final
    def allocate(self, shape: Sequence[int], dtype: DType | str) -> Any:
        self.require_available()
        dt = as_dtype(dtype)
        if dt not in self.dtypes:
            raise InvalidArgumentError(
                f"backend {self.name!r} cannot hold {dt.value}; allowed: "
                f"{', '.join(sorted(d.value for d in self.dtypes))}"
            )
        checked_numel(tuple(shape))
        try:
            return self.xp.zeros(tuple(int(d) for d in shape), dtype=dt.numpy)
        except MemoryError as exc:
            raise ExecutionError(f"cannot allocate {tuple(shape)} {dt.value}: {exc}") from None

    @final
    def write(self, array: Any, data: Any) -> None:
        host = np.asarray(data)
        if tuple(host.shape) != tuple(array.shape) and host.size != array.size:
            raise InvalidArgumentError(
                f"cannot write data of shape {host.shape} into a tensor of shape {array.shape}"
            )
        array[...] = self._to_device(host.reshape(array.shape).astype(array.dtype, copy=False))

    @final
    def to_device(self, host: Any) -> Any:
        self.require_available()
        return self._to_device(np.asarray(host))

    @final
    def read(self, array: Any) -> np.ndarray:
        return self._to_host(array)

    @final
    def synchronize(self) -> None:
        self._synchronize()

    @final
    def run(
        self,
        op: Op | str,
        inputs: Sequence[Any],
        outputs: Sequence[Any] | None = None,
        attrs: Mapping[str, Any] | None = None,
        variant: str = "default",
    ) -> list[Any]:
        """Run one op; returns its outputs. Outputs given are written only on success."""
        self.require_available()
        op = to_op(op)
        if op not in self.kernels:
            raise UnsupportedOperationError(op.value, self.name)
        schema = get_schema(op)
        schema.check_arity(len(inputs), None if outputs is None else len(outputs))
        norm = schema.normalize_attrs(attrs or {})
        kernel = self.kernels.get(op, variant)
        try:
            results = list(kernel.fn(self.context(), list(inputs), norm, None))
        except KeelError:
            raise
        except Exception as exc:
            raise ExecutionError(f"{type(exc).__name__}: {exc}", node=op.value) from exc
        if outputs is None:
            return results
        for dst, src in zip(outputs, results, strict=True):
            if tuple(dst.shape) != tuple(src.shape):
                raise InvalidArgumentError(
                    f"{op.value}: output has shape {tuple(dst.shape)}, result has "
                    f"{tuple(src.shape)}"
                )
        for dst, src in zip(outputs, results, strict=True):
            dst[...] = src
        return list(outputs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
