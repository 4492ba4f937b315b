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
* ``_to_device(host_array)`` / ``_to_host(array)`` — copies in and out
  (defaults: ``xp.array(host)`` and ``np.array(array)``; both copy).
* ``_synchronize()`` — wait for queued work (no-op on the CPU).

Optional hooks, with defaults that suit a NumPy backend:

* ``_is_native(array) -> bool`` — whether ``run`` may take the array as is.
* ``_validate_tensor(shape, dtype)`` — reject tensors this backend cannot hold
  (raise ``InvalidArgumentError``); called by ``allocate`` and ``to_device``.
* ``_execution_scope(op)`` — a context manager around kernel calls (thread
  limits, the current device); ``op`` is ``None`` around a whole program.
* ``_needs_scope(kernels) -> bool`` — whether a program running only these
  kernels (pairs of a variant and the dtype of its first input) needs
  ``_execution_scope(None)`` at all (default: True); a backend whose scope is
  a cost with no effect for some kernels says False.
* ``_free(array)`` — give memory back early (a memory pool, a device buffer).
* ``_capability_details()`` — extra ``Capabilities`` fields (simd_level,
  threads, memory_bytes, notes).
* ``_plan_node(request) -> NodePlan`` — the backend's planner: every decision
  about how a node runs (variant, layout, threads, ...) with its reason
  (:mod:`keel.backends.plan`). The default picks the highest-priority variant;
  a backend with decisions of its own keeps them in one ``planner`` module.
  ``_planner_state()`` returns what else its plans depend on (loaded tiers).
* ``_plan_notes()``, ``_plan_branches(branches)``, ``_staging()``,
  ``_feed_in_place()``, ``_joined(calls)`` — its planner's decisions for a whole plan,
  behind the final ``plan_notes``, ``plan_branches``, ``staging``, ``feed_in_place``
  and ``joined``: the notes a plan's reasons carry, how many independent branches run
  at once, the bytes up to which feeds and outputs are staged, from which a staged feed
  is read in place, and which consecutive bound calls run as one (defaults: none, in
  order, nothing, never, none).

Planners decide, kernels execute: ``plan_node`` is asked once per node when a
model is placed, and the executor hands the plan to the kernel as
``ctx.plan``. ``run`` (the op-level path, no placement) asks ``plan_node``
from the real shapes for a variant that dispatches (``dispatcher=True``).

The public methods (``run``, ``allocate``, ``free``, ``write``, ``read``,
``to_device``) are final: they validate arguments, check the op against the
schema and wrap kernel failures in typed errors. ``run`` computes into fresh
arrays and copies into the caller's outputs only once the kernel succeeded
and every result matches its output's shape and dtype, so a failing op leaves
its outputs untouched. An op the backend lacks raises
``UnsupportedOperationError`` naming the backends that have it (known once a
registry has set ``peers``).

Kernels
-------
A kernel is ``fn(ctx, inputs, attrs, out) -> list[array]``: ``inputs`` are
arrays of this backend (``None`` for an absent optional input), ``attrs`` the
schema-normalized attributes, ``out`` either ``None`` or preallocated output
arrays the kernel should write into (it returns them). Kernels register in a
:class:`KernelTable` with ``@table.kernel(Op.ADD)``; several *variants* of one
op may register with metadata, and a ``default`` variant is always present.
``dtypes`` on a variant lists the dtypes of its first input it accepts; ``run``
turns any other into ``UnsupportedOperationError``. Strings are outside every
backend's ``dtypes``; a kernel that names ``string`` among its own takes them
(object arrays: the table-lookup ops of the ML family). A ``cpu`` kernel that only
works with NumPy (not with CuPy through ``ctx.xp``) registers with
``host_only=True`` in its metadata; the ``gpu`` backend leaves it out.

Prepacking constant inputs
--------------------------
A variant may transform its constant inputs (weights) once per model instead
of on every call: register it with ``prepack=fn``, where
``fn(ctx, const_inputs, attrs) -> state`` receives the node's inputs that are
graph constants (arrays of this backend, read-only) and ``None`` in place of
every input that is not, plus the node's attributes. It returns any object
the kernel can use, or ``None`` when it has nothing to prepack. The executor
calls it when it compiles a program, for every node of that variant with at
least one constant input, inside the backend's ``execution_scope()``; the
state is computed once per model and node (programs for other input shapes
share it) and reaches the kernel as ``ctx.prepacked``. The kernel still gets
every input as usual, so it must give the same result whether ``ctx.prepacked``
is its state or ``None`` (``Backend.run`` and the op-level runtime never
prepack)::

    def _pack(ctx, const_inputs, attrs):
        w = const_inputs[1]
        if w is None or not attrs["trans_b"]:
            return None
        return ctx.xp.ascontiguousarray(w.T)          # (K, N), contiguous

    @TABLE.kernel(Op.GEMM, supports_out=True, prepack=_pack)
    def gemm(ctx, inputs, attrs, out):
        wt = ctx.prepacked                            # None: not prepacked
        b = inputs[1].T if wt is None else wt
        ...

A prepack may raise ``KeelError`` for constants it rejects; any other
exception becomes an ``ExecutionError`` naming the node. Its state lives as
long as the model: a transformed copy of a weight adds its size to the
model's memory.

Binding a step
--------------
A program calls most of its kernels with the same arrays on every run: views of
its arena, the weights. A variant may register ``bind=fn``, where
``fn(ctx, inputs, attrs, out) -> thunk`` receives those very arrays (``out``:
the output buffers) and returns a callable of no arguments that computes exactly
what ``kernel(ctx, inputs, attrs, out)`` would write into ``out``, with every
check and decision made once here instead of on each call (a native call with
its addresses bound, a ufunc with its operands); or ``None`` where it does not
serve the case (the kernel then runs as usual). The executor binds a step only
when all of its inputs and outputs stay put between runs, binds again when they
move (a larger arena), calls a thunk only on the thread that bound it (a bound
call may hold that thread's state, such as the GEMM's packing workspace; another
thread binds its own), calls it under ``np.errstate(all="ignore")`` (a profiled
run times each bound call alone), and never binds for observing,
``intermediates`` or the op-level ``run``. A bind must not raise for a case it
cannot serve (it returns ``None``), and it must not compute
anything the kernel would not (it may prepare the kernel's own kept state). A
thunk that the executor may do more with (join with its neighbours, run without
NumPy's floating-point state, move the array it reads) is a
:class:`keel.backends.bound.BoundCall`, whose typed fields say what.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import operator
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, final

import numpy as np

from keel.backends.plan import (
    LayoutDecision,
    Measured,
    NodePlan,
    PlanRequest,
    default_plan,
    request_types,
)
from keel.dtypes import NARROW, DType, as_dtype
from keel.errors import (
    BackendSelectionError,
    ExecutionError,
    InvalidArgumentError,
    KeelError,
    UnsupportedOperationError,
)
from keel.ops.registry import Op, OpGroup, to_op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType, checked_numel

__all__ = [
    "Availability",
    "Backend",
    "Bind",
    "Capabilities",
    "DeviceKind",
    "Kernel",
    "KernelContext",
    "KernelTable",
    "KernelVariant",
    "LayoutDecision",
    "Measured",
    "NodePlan",
    "PlanRequest",
    "ProgramScope",
    "every_value",
    "every_value_wanted",
    "Prepack",
    "VariantChooser",
    "dtype_of",
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
    prepacked: Any = None        # the variant's prepack state for this node, if any
    plan: NodePlan | None = None  # what the backend's planner decided for this node


Kernel = Callable[[KernelContext, Sequence[Any], Mapping[str, Any], Sequence[Any] | None],
                  Sequence[Any]]
# (ctx, constant inputs (None where not constant), attrs) -> state for ctx.prepacked, or None
Prepack = Callable[[KernelContext, Sequence[Any], Mapping[str, Any]], Any]
# (ctx, inputs, attrs, out) -> a thunk computing the kernel's result into out, or None
Bind = Callable[[KernelContext, Sequence[Any], Mapping[str, Any], Sequence[Any]],
                Callable[[], object] | None]


@dataclass(frozen=True)
class ProgramScope:
    """How a program enters a backend's scope each run: ``enter()`` makes the context
    manager; ``reason`` says how it was sized ("" when there is nothing to say)."""

    enter: Callable[[], AbstractContextManager[Any]]
    reason: str
    threads: int | None = None     # the thread count it sets, where it sets one (BLAS)


class GraphCapture(Protocol):
    """A device's way to record a run's launches once and replay them (CUDA graphs).

    One per program (:mod:`keel.execution.capture`): its own stream and memory pool,
    so what a recording points at is never handed to anything else.
    """

    def scope(self) -> AbstractContextManager[Any]:
        """Enter the stream and memory pool every run of the program uses."""
        ...

    def record(self, run: Callable[[], None]) -> Any:
        """Record ``run``'s launches without executing them; raises when it cannot."""
        ...

    def launch(self, graph: Any) -> None:
        """Replay a recording on the stream."""
        ...

    def buffer(self, like: Any) -> Any:
        """A device array that stays put, shaped and typed as ``like`` (host or device)."""
        ...

    def stage(self, buffer: Any, value: Any) -> None:
        """Copy ``value`` (a host or device array) into ``buffer`` on the stream."""
        ...


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
    prepack: Prepack | None = None               # once per model: see the module docstring
    bind: Bind | None = None                     # once per program step: the module docstring


# (op, input types, attrs, table) -> (variant, why): a backend planner's variant choice.
VariantChooser = Callable[[Op, Sequence[TensorType | None], Mapping[str, Any], "KernelTable"],
                          tuple[str, str]]


class KernelTable:
    """Kernels of one backend, by op and variant.

    ``chooser`` is the backend planner's variant choice for this table (None: the
    highest priority decides), so that a planning module holding only a table
    (``keel.planning.variants.choose_variant``) asks the backend's own rules.
    """

    def __init__(self, backend: str, chooser: VariantChooser | None = None) -> None:
        self.backend = backend
        self.chooser = chooser
        self._variants: dict[Op, dict[str, KernelVariant]] = {}
        # Modules that register each op's variants, () once imported (see :meth:`defer`).
        self._deferred: dict[Op, Sequence[str]] | None = None
        self._load_all: Callable[[], object] | None = None

    def defer(self, modules: Mapping[Op, Sequence[str]], load_all: Callable[[], object]) -> None:
        """Import kernel modules when their ops are first asked for, not all at once.

        ``modules`` names, for each op, the modules whose import registers its variants
        (in the order a whole load imports them); an op it does not name, and every
        question about all ops (:meth:`ops`, :meth:`update`), calls ``load_all``, which
        imports every module. A process that runs one model then imports the kernels of
        that model's ops only.
        """
        self._deferred, self._load_all = dict(modules), load_all

    def _ensure(self, op: Op) -> None:
        deferred = self._deferred
        if deferred is None:
            return
        modules = deferred.get(op)
        if modules is None:
            self._ensure_all()
            return
        for name in modules:        # waits for a module another thread is importing
            importlib.import_module(name)
        deferred[op] = ()

    def _ensure_all(self) -> None:
        load_all = self._load_all
        if load_all is not None:
            load_all()
        self._deferred = self._load_all = None

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
        prepack: Prepack | None = None,
        bind: Bind | None = None,
        **meta: Any,
    ) -> Callable[[Kernel], Kernel]:
        """Decorator: ``@table.kernel(Op.ADD, Op.SUB)`` registers ``fn`` for each op.

        ``prepack`` transforms constant inputs once per model (see the module
        docstring); the kernel finds its result in ``ctx.prepacked``. ``bind``
        prepares a program step's call once for the arrays it always runs on.
        """
        dts = None if dtypes is None else frozenset(as_dtype(d) for d in dtypes)

        def wrap(fn: Kernel) -> Kernel:
            for op in ops:
                self.register(KernelVariant(op, variant, fn, dts, supports_out,
                                            description or (fn.__doc__ or "").strip(), meta,
                                            prepack, bind))
            return fn

        return wrap

    def update(self, other: KernelTable) -> None:
        """Register every variant of ``other`` not already present here."""
        other._ensure_all()
        for op, variants in other._variants.items():
            for name, v in variants.items():
                self._variants.setdefault(op, {}).setdefault(name, v)

    def ops(self) -> frozenset[Op]:
        self._ensure_all()
        return frozenset(op for op, v in self._variants.items() if "default" in v)

    def variants(self, op: Op) -> dict[str, KernelVariant]:
        self._ensure(op)
        return dict(self._variants.get(op, {}))

    def get(self, op: Op, variant: str = "default") -> KernelVariant:
        self._ensure(op)
        try:
            return self._variants[op][variant]
        except KeyError:
            have = ", ".join(self._variants.get(op, {})) or "none"
            raise UnsupportedOperationError(
                op.value, self.backend, detail=f"variant {variant!r}; variants here: {have}"
            ) from None

    def __contains__(self, op: object) -> bool:
        if isinstance(op, Op):
            self._ensure(op)
        return op in self._variants and "default" in self._variants[op]  # type: ignore[index]


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and why (not)."""

    available: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "reason": self.reason}


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers: plain data that prints as JSON."""

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

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["device"] = self.device.value
        data["dtypes"], data["ops"], data["notes"] = (
            list(self.dtypes), list(self.ops), list(self.notes))
        return data


# Plans kept for the op-level path's calls (per backend), by call signature.
_CALL_PLANS = 256
# Ops whose inputs may be sequences (lists of arrays).
_SEQUENCE_OPS = OpGroup.SEQUENCE | OpGroup.CONTROL_FLOW

# (op) -> names of the backends that have a kernel for it; set by a registry.
PeerLookup = Callable[[Op], Sequence[str]]


class Backend(ABC):
    """A place where ops run. See the module docstring for the contract."""

    name: ClassVar[str]
    device: ClassVar[DeviceKind]
    # The narrow ml_dtypes types live on NumPy backends only (those add them).
    dtypes: ClassVar[frozenset[DType]] = frozenset(DType) - {DType.STRING} - NARROW
    # Why a dtype outside ``dtypes`` is not held, for the errors that refuse it.
    dtype_notes: ClassVar[Mapping[DType, str]] = {}

    def __init__(self) -> None:
        self._availability: Availability | None = None
        self._table: KernelTable | None = None
        self.threads: int | None = None
        self.peers: PeerLookup | None = None
        self._call_plans: dict[tuple[Any, ...], NodePlan] = {}

    # ---- hooks ---------------------------------------------------------
    @abstractmethod
    def _check_available(self) -> Availability: ...

    @abstractmethod
    def _kernels(self) -> KernelTable: ...

    @property
    @abstractmethod
    def xp(self) -> Any: ...

    def _to_device(self, host: np.ndarray) -> Any:
        return self.xp.array(host, copy=True)

    def _to_host(self, array: Any) -> np.ndarray:
        return np.array(array, copy=True)

    def _is_native(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def _validate_tensor(self, shape: tuple[int, ...], dtype: DType) -> None:
        return None

    def _execution_scope(self, op: Op | None) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def _needs_scope(self, kernels: Sequence[tuple[KernelVariant, DType | None]]) -> bool:
        return True

    def _program_scope(self, kernels: Sequence[tuple[KernelVariant, DType | None, float]]
                       ) -> ProgramScope:
        return ProgramScope(self.execution_scope, "")

    def _planned_scope(self, threads: int, reason: str) -> ProgramScope:
        return ProgramScope(self.execution_scope, reason, threads)

    def _free(self, array: Any) -> None:
        return None

    def _synchronize(self) -> None:
        return None

    def free_memory(self) -> int | None:
        """Bytes free on this backend's device now (None: not known or not a device)."""
        return None

    def graph_capture(self) -> tuple[GraphCapture | None, str]:
        """A fresh recorder for one program (its own stream and pool), or None and why."""
        return None, f"{self.name} does not record graphs"

    def _capability_details(self) -> dict[str, Any]:
        return {}

    def _staging(self) -> tuple[int, int]:
        return 0, 0

    def _feed_in_place(self) -> tuple[int, int]:
        return 0, 0

    def _joined(self, calls: tuple[Callable[[], object], ...]
                ) -> tuple[Callable[[], object], ...]:
        return calls

    def _plan_notes(self) -> Sequence[str]:
        return ()

    def _plan_branches(self, branches: Sequence[Sequence[tuple[float, int]]]
                       ) -> tuple[int, str]:
        return 1, f"in order: the {self.name} backend runs one node at a time"

    def _plan_node(self, request: PlanRequest) -> NodePlan:
        return default_plan(request, self.kernels, self.threads)

    def _planner_state(self) -> Any:
        """What the planner reads besides a call's signature (loaded kernel tiers): a
        plan kept for the op-level path is reused only while this is unchanged."""
        return None

    # ---- planning ------------------------------------------------------
    @final
    def plan_node(self, op: Op | str, input_types: Sequence[TensorType | None],
                  attrs: Mapping[str, Any] | None = None, *, threads: int | None = None,
                  profile: Any = None, precision: str = "",
                  measured: Measured | None = None, low_memory: str = "",
                  constants: tuple[bool, ...] | None = None) -> NodePlan:
        """What this backend's planner decides for one node, each field with its reason.

        ``input_types`` are the node's input types (None for an absent input),
        ``attrs`` its schema-normalized attributes; ``threads`` the thread
        count planned for (default: the backend's), ``profile`` the hardware
        profile planned for, ``precision`` the precision placement decided and
        ``measured`` a choice measured on this machine (a tuning cache hit),
        which overrides the declared rules where this backend has that variant;
        ``low_memory`` why the machine is planned in low-memory mode ("" when not);
        ``constants`` which inputs are constants of the graph (None: not said).
        """
        request = PlanRequest(to_op(op), tuple(input_types), dict(attrs or {}),
                              self.threads if threads is None else threads, profile,
                              precision, measured, low_memory, constants)
        return self._plan_node(request)

    def plan_layouts(self, graph: Any, types: Mapping[str, TensorType | None],
                     variants: Sequence[str | None]) -> dict[int, LayoutDecision]:
        """Layouts decided over the whole graph (values kept in another layout between
        this backend's nodes): {node index: LayoutDecision}, its threads reason the split
        the node's kernel runs in that layout ("": its plan's stands), its options the
        plan's options that follow from it; ``variants[i]`` is node i's variant here,
        None where it runs elsewhere. None by default."""
        return {}

    # ---- availability and capabilities ---------------------------------
    @final
    def availability(self) -> Availability:
        """Whether this backend can run here; checked once, never raises."""
        if self._availability is None:
            try:
                self._availability = self._check_available()
            except Exception as exc:  # an availability check never raises
                self._availability = Availability(
                    False, f"availability check failed: {type(exc).__name__}: {exc}")
        return self._availability

    @final
    def is_available(self) -> bool:
        return self.availability().available

    @final
    def require_available(self) -> None:
        """Raise ``BackendSelectionError`` naming this backend when it cannot run here."""
        avail = self.availability()
        if not avail.available:
            raise BackendSelectionError(self.name, avail.reason)

    @property
    def kernels(self) -> KernelTable:
        if self._table is None:
            self._table = self._kernels()
        return self._table

    @final
    def supports(self, op: Op | str, dtype: DType | str | None = None) -> bool:
        """Whether a default kernel for ``op`` exists here (for ``dtype``, when given)."""
        op = to_op(op)
        if op not in self.kernels:
            return False
        if dtype is None:
            return True
        dt = as_dtype(dtype)
        v = self.kernels.get(op)
        return _takes(self.dtypes, v, dt)

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

    def auto_blocked(self, props: Any, measured: Callable[[], Any] | None = None
                     ) -> str | None:
        """Why automatic selection must not choose this backend for an op (``props``: its
        ``keel.planning.selection.OperationProperties``); None: it may (the default).
        ``measured()`` gives what ``keel calibrate --gpu <this backend>`` measured for the
        op's group and dtype, ``(crossover bytes or None, source)``, or None."""
        return None

    @final
    def plan_notes(self) -> tuple[str, ...]:
        """What this backend decided for every node it runs, for a plan's reasons (the cpu
        backend: its thread count and where it came from). Default: nothing."""
        return tuple(self._plan_notes())

    @final
    def staging(self) -> tuple[int, int]:
        """(feed bytes, graph output bytes) up to which a fixed-shape host program copies
        a feed into (an output out of) a buffer of its own so that this backend's steps
        on it bind (``KernelVariant.bind``). Default: nothing staged."""
        return self._staging()

    @final
    def feed_in_place(self) -> tuple[int, int]:
        """(least, most) bytes: from ``least`` a staged feed that this backend's bound
        steps read only as an input they can move (a bound call's ``reading``) is read
        where the caller has it, not copied into its buffer; a feed too large to stage
        (``staging``) but of at most ``most`` bytes is given a buffer all the same where
        every step reading it then reads it so. (0, 0): never (the default)."""
        return self._feed_in_place()

    @final
    def joined(self, calls: tuple[Callable[[], object], ...]
               ) -> tuple[Callable[[], object], ...]:
        """A steady run's bound calls of this backend's steps, in order, with runs of
        consecutive calls made one call where the backend can (the same work, in the same
        order). Default: as they are."""
        return self._joined(calls)

    @final
    def plan_branches(self, branches: Sequence[Sequence[tuple[float, int]]]
                      ) -> tuple[int, str]:
        """How many lanes a region of independent ``branches`` of this backend's nodes runs
        in at once (1: in order), and why; each branch is its nodes' (estimated work, kernel
        threads). Default: in order."""
        return self._plan_branches(branches)

    @final
    def execution_scope(self, op: Op | None = None) -> AbstractContextManager[Any]:
        """The context kernels of this backend run in (thread limits, current device).

        ``run`` enters it around every kernel with its op (a backend may skip
        what that op does not need); an executor calling kernels directly
        enters it once, without an op, around a whole program.
        """
        return self._execution_scope(op)

    @final
    def program_scope(self, kernels: Iterable[tuple[KernelVariant, DType | None, float]]
                      ) -> ProgramScope | None:
        """What a compiled program enters around each run on this backend; None: nothing.

        ``kernels`` are (variant, dtype of its first input or None, estimated
        work: multiply-adds, or elements for ops without a reduction) for each
        step the program runs here. A backend may size its scope by them (the
        cpu backend picks the BLAS thread count for the whole program).
        """
        ks = tuple(kernels)
        if not self._needs_scope(tuple((v, d) for v, d, _ in ks)):
            return None
        return self._program_scope(ks)

    @final
    def planned_scope(self, threads: int, reason: str) -> ProgramScope:
        """The scope a program enters on this backend for a decision its plan already holds:
        ``threads`` BLAS threads (the node plans' ``blas_threads``) for ``reason``. The
        executor takes this instead of sizing the scope again, so the plan shown is the
        plan run."""
        return self._planned_scope(threads, reason)

    @final
    def needs_scope(self, kernels: Iterable[tuple[KernelVariant, DType | None]]) -> bool:
        """Whether these kernels must run inside ``execution_scope()``.

        ``kernels`` are (variant, dtype of its first input or None) pairs. An
        executor asks once per program, with the steps it runs on this
        backend; when False it calls them without entering the scope.
        """
        return self._needs_scope(tuple(kernels))

    # ---- memory --------------------------------------------------------
    @final
    def allocate(self, shape: Sequence[int], dtype: DType | str) -> Any:
        """A zero-filled array of this backend."""
        self.require_available()
        dims, dt = self._checked_tensor(shape, dtype)
        try:
            with self.execution_scope():
                return self.xp.zeros(dims, dtype=dt.numpy)
        except MemoryError as exc:
            raise ExecutionError(f"cannot allocate {dims} {dt.value}: {exc}") from None

    @final
    def free(self, array: Any) -> None:
        """Give ``array``'s memory back early; the array must not be used afterwards."""
        self._free(array)

    @final
    def write(self, array: Any, data: Any) -> None:
        """Copy host ``data`` (same shape, or same element count) into ``array``."""
        host = np.asarray(data)
        if tuple(host.shape) != tuple(array.shape) and host.size != array.size:
            raise InvalidArgumentError(
                f"cannot write data of shape {host.shape} into a tensor of shape {array.shape}"
            )
        if not np.can_cast(host.dtype, array.dtype, casting="same_kind"):
            raise InvalidArgumentError(
                f"cannot write {host.dtype} data into a tensor of dtype {array.dtype} without "
                "changing its kind; convert it first"
            )
        array[...] = self._to_device(host.reshape(array.shape).astype(array.dtype, copy=False))

    @final
    def to_device(self, host: Any) -> Any:
        """A copy of host data as an array of this backend (``None`` stays ``None``)."""
        if host is None:
            return None
        self.require_available()
        if not isinstance(host, np.ndarray) and self._is_native(host):
            return host                    # already this backend's array: nothing to copy
        data = np.asarray(host)
        self._checked_tensor(data.shape, DType.from_numpy(data.dtype))
        with self.execution_scope():
            return self._to_device(data)

    @final
    def read(self, array: Any) -> np.ndarray:
        """A host (NumPy) copy of ``array``."""
        return self._to_host(array)

    @final
    def synchronize(self) -> None:
        self._synchronize()

    def _checked_tensor(self, shape: Sequence[int], dtype: DType | str) -> tuple[
            tuple[int, ...], DType]:
        dt = as_dtype(dtype)
        if dt not in self.dtypes:
            note = self.dtype_notes.get(dt)
            raise InvalidArgumentError(
                f"backend {self.name!r} cannot hold {dt.value}"
                + (f" ({note})" if note else "") + "; allowed: "
                f"{', '.join(sorted(d.value for d in self.dtypes))}"
            )
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise InvalidArgumentError(
                f"shape {tuple(shape)!r} must hold integers only") from None
        checked_numel(dims)
        self._validate_tensor(dims, dt)
        return dims, dt

    # ---- running ops ---------------------------------------------------
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
            raise UnsupportedOperationError(op.value, self.name, supported_on=self._peers(op))
        schema = get_schema(op)
        schema.check_arity(len(inputs), None if outputs is None else len(outputs))
        norm = schema.normalize_attrs(attrs or {})
        kernel = self.kernels.get(op, variant)
        self._check_inputs(op, kernel, inputs)
        for i, o in enumerate(outputs or ()):
            if not self._is_native(o):
                raise InvalidArgumentError(
                    f"{op.value}: output {i} is a {type(o).__module__}.{type(o).__name__}; "
                    f"backend {self.name!r} writes into its own arrays only")
        try:
            with self.execution_scope(op):
                # A kernel that writes into buffers gets scratch ones shaped like the
                # outputs (``fill`` learns its shape from them); the caller's
                # outputs are written only once everything succeeded.
                scratch = None if outputs is None or not kernel.supports_out else [
                    self.xp.empty(tuple(o.shape), dtype=o.dtype) for o in outputs]
                results = list(kernel.fn(self._call_context(op, kernel, inputs, norm),
                                         list(inputs), norm, scratch))
        except KeelError:
            raise
        except Exception as exc:
            raise ExecutionError(f"{type(exc).__name__}: {exc}", node=op.value) from exc
        if outputs is None:
            return results
        _check_results(op, outputs, results)
        for dst, src in zip(outputs, results, strict=True):
            dst[...] = src
        return list(outputs)

    def _call_context(self, op: Op, kernel: KernelVariant, inputs: Sequence[Any],
                      attrs: Mapping[str, Any]) -> KernelContext:
        """The context of an op-level call: a dispatching variant gets the plan the
        planner makes from the real shapes (no placement made one)."""
        if not kernel.meta.get("dispatcher"):
            return self.context()
        # The same call again (shapes, dtypes, attributes, threads, the planner's state)
        # reuses its plan.
        key = (op, self.threads, self._planner_state(),
               tuple(None if x is None else (x.shape, x.dtype) for x in inputs),
               tuple(attrs.items()))
        try:
            plan = self._call_plans.get(key)
        except TypeError:                     # an unhashable attribute: plan afresh
            plan = self.plan_node(op, request_types(inputs), attrs)
        else:
            if plan is None:
                if len(self._call_plans) >= _CALL_PLANS:
                    self._call_plans.clear()
                plan = self._call_plans[key] = self.plan_node(op, request_types(inputs), attrs)
        return KernelContext(self.xp, self.name, self.device, self.threads, None, plan)

    def _peers(self, op: Op) -> tuple[str, ...]:
        if self.peers is None:
            return ()
        return tuple(name for name in self.peers(op) if name != self.name)

    def _check_inputs(self, op: Op, kernel: KernelVariant, inputs: Sequence[Any]) -> None:
        takes_sequences = op in _SEQUENCE_OPS
        for i, value in enumerate(inputs):
            # A sequence value (for the ops that take one) is a list of arrays, each
            # checked as a tensor.
            for x in value if takes_sequences and isinstance(value, list) else [value]:
                if x is None:
                    continue
                if not self._is_native(x):
                    raise InvalidArgumentError(
                        f"{op.value}: input {i} is a {type(x).__module__}.{type(x).__name__}; "
                        f"backend {self.name!r} takes its own arrays (use to_device first)"
                    )
                self._validate_tensor(tuple(x.shape), dtype_of(x))
        first = next((x for x in inputs if x is not None and not isinstance(x, list)), None)
        if first is None:
            return
        dt = dtype_of(first)
        if not _takes(self.dtypes, kernel, dt):
            allowed = kernel.dtypes if kernel.dtypes is not None else self.dtypes
            raise UnsupportedOperationError(
                op.value, self.name, supported_on=self._peers(op),
                detail=f"dtype {dt.value}; this backend takes "
                       f"{', '.join(sorted(d.value for d in allowed & self.dtypes))}",
            )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


_DTYPES: dict[Any, DType] = {}


def dtype_of(array: Any) -> DType:
    """The keel dtype of a NumPy or CuPy array (memoized: this runs for every input)."""
    dt = _DTYPES.get(array.dtype)
    if dt is None:
        dt = _DTYPES[array.dtype] = DType.from_numpy(array.dtype)
    return dt


def _check_results(op: Op, outputs: Sequence[Any], results: Sequence[Any]) -> None:
    """Every result must match its output buffer before any buffer is written."""
    if len(outputs) != len(results):
        raise InvalidArgumentError(
            f"{op.value}: {len(outputs)} outputs given, the op produced {len(results)}"
        )
    for i, (dst, src) in enumerate(zip(outputs, results, strict=True)):
        if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
            raise InvalidArgumentError(
                f"{op.value}: output {i} is {dst.dtype}{list(dst.shape)}, the result is "
                f"{src.dtype}{list(src.shape)}"
            )


# Shorthands for kernel signatures, shared by every backend's family modules.
def _takes(held: frozenset[DType], kernel: KernelVariant, dt: DType) -> bool:
    """Whether ``kernel`` runs on ``dt`` here: a dtype the backend holds for every op, or
    one the kernel names itself (strings, for the table-lookup ops of a NumPy backend)."""
    if kernel.dtypes is None:
        return dt in held
    return dt in kernel.dtypes and (dt in held or dt is DType.STRING)


Inputs = Sequence[Any]
Attrs = Mapping[str, Any]
Out = Sequence[Any] | None


_EVERY_VALUE = threading.local()


@contextlib.contextmanager
def every_value() -> Any:
    """A run on this thread in which every value is kept or watched (a program's general
    path: ``keep_all``, ``observe``): a step that would leave its output to a later
    step's call (cpu's conv_pool: a conv pooled in its pool's step) computes it."""
    before = getattr(_EVERY_VALUE, "on", False)
    _EVERY_VALUE.on = True
    try:
        yield
    finally:
        _EVERY_VALUE.on = before


def every_value_wanted() -> bool:
    """Whether this thread runs inside :func:`every_value`."""
    return bool(getattr(_EVERY_VALUE, "on", False))


def optional_input(inputs: Inputs, i: int) -> Any:
    """Input ``i``, or None when the caller gave fewer inputs (an absent optional one)."""
    return inputs[i] if i < len(inputs) else None
