"""The ``cpu`` backend: optimized NumPy kernels, compiled native kernels where a C
compiler is at hand (:mod:`keel.native`), BLAS threads set through threadpoolctl."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from keel.backends.base import (
    Availability,
    Backend,
    DeviceKind,
    KernelTable,
    KernelVariant,
    LayoutDecision,
    NodePlan,
    PlanRequest,
    ProgramScope,
)
from keel.config import settings
from keel.dtypes import NARROW, DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op, OpGroup

if TYPE_CHECKING:
    from keel.hardware.profile import HardwareProfile
    from keel.ops.types import TensorType

__all__ = ["CpuBackend", "ThreadCap", "blas_threads", "default_threads",
           "resolve_threads"]


# Ops whose NumPy kernels may call BLAS (and so its thread pool): matmul-like ops,
# im2col / Winograd / depthwise convolution, quantized products, the normalizations
# that reduce rows with a dot product, global average pooling (a matrix-vector
# product) and AffineGrid (a batched matmul).
_POOLED = (OpGroup.MATMUL_LIKE | OpGroup.CONVOLUTION | OpGroup.QUANTIZATION
           | OpGroup.NORMALIZATION | frozenset({Op.GLOBAL_AVG_POOL, Op.AFFINE_GRID}))


class CpuBackend(Backend):
    """NumPy with preallocated outputs and BLAS for the heavy ops.

    ``threads`` caps the BLAS / OpenMP thread pools while a kernel that may
    call BLAS runs (``run``), or around a whole program with such a step (see
    ``_may_use_blas``), and is passed to kernels in their context. ``None``
    means ``KEEL_THREADS`` when set, else the usable cores of ``hardware``
    when a profile is given (a plan for another machine), else the cores this
    process may use (affinity mask and cgroup quota, from the hardware probe).
    :attr:`threads_reason` says which. ``hardware`` also gives the SIMD level
    and memory the backend reports. The cap holds only inside keel: the
    process-wide settings are restored afterwards.
    """

    name = "cpu"
    device = DeviceKind.CPU
    dtypes = Backend.dtypes | NARROW     # NumPy holds ml_dtypes' arrays

    def __init__(self, threads: int | None = None, *,
                 hardware: HardwareProfile | None = None) -> None:
        super().__init__()
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):
            raise InvalidArgumentError(f"threads must be a positive int or None, got {threads!r}")
        self._hardware = _check_hardware(hardware)
        self._requested_threads = threads
        self._threads_reason = None if threads is None else f"set by the caller (threads={threads})"
        self._pin_checked = False

    @property
    def threads(self) -> int:
        """The thread cap kernels run under (resolved on first use): never more than the
        CPUs of the NUMA node the threads are pinned to, unless given."""
        if self._requested_threads is None:
            threads, why = resolve_threads(self._hardware)
            cpus, _ = self.numa
            if cpus is not None and threads > len(cpus) and settings().threads is None:
                threads, why = len(cpus), f"the CPUs of one NUMA node, of the {why}"
            self._requested_threads, self._threads_reason = threads, why
        return self._requested_threads

    @threads.setter
    def threads(self, value: int | None) -> None:
        # None (also what Backend.__init__ assigns) means: resolve on first use.
        self._requested_threads = value
        self._threads_reason = None if value is None else f"set by the caller (threads={value})"

    @functools.cached_property
    def numa(self) -> tuple[frozenset[int] | None, str]:
        """The CPUs keel's threads are kept on (None: not pinned) and why: the planner's
        NUMA rule on the profile's nodes (or this machine's)."""
        from keel.backends.cpu.planner import numa_pinning

        if self._hardware is not None:
            return numa_pinning(self._hardware.cpu.numa_nodes, None, settings().numa_pin)
        from keel.hardware.cpu import numa_nodes

        return numa_pinning(numa_nodes(), _usable_cpus(), settings().numa_pin)

    def pin_threads(self) -> None:
        """Keep keel's threads on the NUMA node the plan chose, where that node's CPUs are
        this process's (a plan for another machine's profile pins nothing here), and have
        them yield as the planner decides (``planner.pool_yield``)."""
        if self._pin_checked:
            return
        self._pin_checked = True
        from keel.backends.cpu.planner import pool_yield
        from keel.native import pool

        way = pool_yield()
        pool.set_yield(way.spins, way.shared)
        cpus, _ = self.numa
        usable = _usable_cpus()
        if cpus is None or usable is None or not cpus <= usable:
            return
        if pool.pinned() != cpus:
            pool.pin(cpus)

    @property
    def threads_reason(self) -> str:
        """Where :attr:`threads` came from: the caller, ``KEEL_THREADS``, a profile, the probe."""
        threads = self.threads
        return f"{threads} threads: {self._threads_reason}"

    def _plan_notes(self) -> tuple[str, ...]:
        from keel.backends.cpu.planner import (
            Caches,
            caches,
            fetch_note,
            huge_pages_note,
            join_note,
            pool_yield,
            staging_note,
            thread_costs_note,
        )

        cpus, numa = self.numa
        sizes = caches(self._hardware)
        blocks = ("block sizes: as measured (1 MiB L2, 32 MiB last level): no L2 size read"
                  if sizes.source == Caches().source else f"block sizes: scaled to {sizes.source}")
        return (f"cpu backend, {self.threads_reason}",
                *((f"NUMA: {numa}",) if cpus is not None or "NUMA nodes" in numa else ()),
                blocks, thread_costs_note(self.threads), f"keel threads: {pool_yield().reason}",
                huge_pages_note(), fetch_note(), staging_note(), join_note())

    def _staging(self) -> tuple[int, int]:
        from keel.backends.cpu.planner import staging

        return staging()

    def _feed_in_place(self) -> tuple[int, int]:
        from keel.backends.cpu.planner import FEED_IN_PLACE_BYTES, FEED_IN_PLACE_MOST_BYTES

        return FEED_IN_PLACE_BYTES, FEED_IN_PLACE_MOST_BYTES

    def _joined(self, calls: tuple[Callable[[], object], ...]
                ) -> tuple[Callable[[], object], ...]:
        from keel.backends.cpu import native_gemm
        from keel.backends.cpu.planner import JOIN_CALLS

        return native_gemm.joined(calls) if JOIN_CALLS else calls

    def _plan_branches(self, branches: Sequence[Sequence[tuple[float, int]]]
                       ) -> tuple[int, str]:
        from keel.backends.cpu.planner import plan_branches

        return plan_branches(self.threads, branches)

    @property
    def simd_level(self) -> str | None:
        """The SIMD level plans assume: the given profile's, else this CPU's (probed)."""
        return _simd_level() if self._hardware is None else self._hardware.cpu.simd_level

    @property
    def vendor(self) -> str | None:
        """The CPU vendor plans assume: the given profile's, else this CPU's (probed)."""
        cpu = _probed_cpu() if self._hardware is None else self._hardware.cpu
        vendor = getattr(cpu, "vendor", None)
        return vendor if isinstance(vendor, str) else None

    def _check_available(self) -> Availability:
        return Availability(True, f"NumPy {np.__version__} is always available")

    def _kernels(self) -> KernelTable:
        from keel.backends.cpu import kernels

        return kernels.load()

    @property
    def xp(self) -> ModuleType:
        return np

    def _plan_node(self, request: PlanRequest) -> NodePlan:
        from keel.backends.cpu import planner

        return planner.plan(request, self.kernels)

    def plan_layouts(self, graph: Any, types: Mapping[str, TensorType | None],
                     variants: Sequence[str | None]) -> dict[int, LayoutDecision]:
        from keel.backends.cpu import planner

        decided = {**planner.int8_layouts(graph, types, variants, self.threads,
                                          self._hardware),
                   **planner.float_layouts(graph, types, variants, self.threads,
                                           self._hardware)}
        return {**decided, **planner.pool_in_conv(graph, types, variants, self.threads,
                                                  self._hardware, tuple(decided))}

    def _planner_state(self) -> Any:
        from keel.backends.cpu import planner

        return planner.state()

    def _execution_scope(self, op: Op | None) -> AbstractContextManager[Any]:
        # Only BLAS-backed kernels use the thread pools; for the rest, setting
        # and restoring the limits would cost more than the kernel itself.
        if op is not None and op not in _POOLED:
            return contextlib.nullcontext()
        return ThreadCap(self.threads)

    def _program_scope(self, kernels: Sequence[tuple[KernelVariant, DType | None, float]]
                       ) -> ProgramScope:
        threads, reason = blas_threads(self.threads, kernels)
        return ProgramScope(functools.partial(ThreadCap, threads), reason, threads)

    def _planned_scope(self, threads: int, reason: str) -> ProgramScope:
        self.pin_threads()
        return ProgramScope(functools.partial(ThreadCap, threads), reason, threads)

    def _needs_scope(self, kernels: Sequence[tuple[KernelVariant, DType | None]]) -> bool:
        # Capping costs about a microsecond a run (two openblas_set_num_threads),
        # as much as a small native kernel: a program whose steps never reach
        # BLAS skips it. Every program compiled here asks, so the threads are pinned first.
        self.pin_threads()
        return any(_may_use_blas(v, dtype) for v, dtype in kernels)

    def _capability_details(self) -> dict[str, Any]:
        from keel import native
        from keel.native import pool

        blas = [f"{lib.get('internal_api')} ({lib.get('num_threads')} threads)"
                for lib in _controller().info()]
        st = native.status()
        tier = (f"native kernels: {st.reason}" if st.available
                else f"native kernels off ({st.reason}): NumPy kernels only")
        notes = [*(f"thread pool: {b}" for b in blas), tier]
        spin = pool.spin_us() if st.available else None
        if spin is not None:
            notes.append(f"keel threads: up to {self.threads}, one pool in C shared by the "
                         f"native kernels; idle workers spin {spin} us before sleeping "
                         f"(KEEL_SPIN_US), {pool.idle_spin_us()} us once a model run has "
                         "ended (KEEL_IDLE_SPIN_US)")
        notes.append(f"threads: {self.threads_reason}")
        hardware = self._hardware
        return {
            "threads": self.threads,
            "simd_level": self.simd_level,
            "memory_bytes": (_memory_limit() if hardware is None
                             else hardware.memory.effective_limit_bytes),
            "notes": tuple(notes),
        }


def blas_threads(threads: int, kernels: Sequence[tuple[KernelVariant, DType | None, float]]
                 ) -> tuple[int, str]:
    """The BLAS thread count for a program of ``kernels`` under a cap of ``threads``, and
    why: the cpu planner's program-level decision (``planner.plan_program``), given how
    much of the work each step does and whether it may call BLAS.

    ``kernels`` are (variant, dtype, estimated work) per step, as
    :meth:`~keel.backends.base.Backend.program_scope` takes them.
    """
    from keel.backends.cpu import planner

    return planner.plan_program(threads, [(_may_use_blas(v, d), work) for v, d, work in kernels])


def _may_use_blas(variant: KernelVariant, dtype: DType | None) -> bool:
    """Whether ``variant`` may call BLAS on inputs of ``dtype``.

    A variant says so itself with ``blas=True/False`` in its metadata. Else
    the kernels of the ops in ``_POOLED`` may, except native variants on
    float32: keel's native kernels are float32 and run on keel's own threads
    (``ctx.threads``); on another dtype such a variant takes its NumPy path.
    A native variant that hands some other case it does not serve (a layout,
    a rank) to BLAS runs that call at the process's BLAS setting.
    """
    declared = variant.meta.get("blas")
    if declared is not None:
        return bool(declared)
    if variant.op not in _POOLED:
        return False
    if (variant.name in _NATIVE_FORMS or variant.meta.get("native_form")) \
            and dtype is DType.FLOAT32 and _native_available():
        return False                 # the variant's native form runs: no BLAS
    return not (variant.meta.get("requires") == "native" and dtype is DType.FLOAT32)


# Conv variants that run a native form on float32 where the tier is available: the
# depthwise window kernel; Winograd's transforms with its products on the packed GEMM.
# Other kernels say so with ``native_form=True`` in their metadata (attention).
_NATIVE_FORMS = frozenset({"depthwise", "winograd"})


class ThreadCap:
    """Caps every BLAS / OpenMP pool at ``threads`` while entered; restores what it changed.

    A pool already at ``threads`` is left alone: with OpenBLAS's pthreads
    server, calling ``openblas_set_num_threads`` even with the current value
    makes the next parallel calls wait for its workers, which on a busy
    machine costs tens of milliseconds a call (measured: a 2-thread 32x784x512
    GEMM pair went from 0.3 ms to a 40 ms median when the limit was set around
    every call, as ``threadpoolctl.threadpool_limits`` does). Reading the
    current value costs a fraction of a microsecond. Not reentrant: one
    ``with`` at a time (it may be entered again once exited).
    """

    __slots__ = ("_changed", "_threads")

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._changed: list[tuple[Any, int]] | None = None

    def __enter__(self) -> ThreadCap:
        threads = self._threads
        for lib in _pools():
            current = lib.get_num_threads()
            if current is not None and current != threads:
                lib.set_num_threads(threads)
                if self._changed is None:
                    self._changed = []
                self._changed.append((lib, current))
        return self

    def __exit__(self, *exc: object) -> None:
        changed, self._changed = self._changed, None
        if changed is None:
            return
        for lib, previous in reversed(changed):
            lib.set_num_threads(previous)
            # threadpoolctl lets only one thread set OpenBLAS's pthreads pool;
            # release it so a model run from another thread can cap it too.
            clear = getattr(lib, "clear_controlling_thread", None)
            if clear is not None:
                clear()


class _DirectPool:
    """OpenBLAS's pthreads pool through its own C entry points.

    threadpoolctl's ``set_num_threads`` for this pool adds a Python-level
    check of which thread may set it, about 3 µs per cap and restore, which
    a batch-1 run of a small model pays on every call. keel caps the pool
    only while one of its programs runs (one at a time per model), and
    restores it on exit, so it sets the C value directly.
    """

    __slots__ = ("get_num_threads", "set_num_threads")
    clear_controlling_thread = None     # nothing to release (read without an exception)

    def __init__(self, get: Callable[[], int], set_: Callable[[int], Any]) -> None:
        # The C functions themselves, not methods wrapping them: a cap and its
        # restore are three calls, each a Python frame less this way.
        self.get_num_threads = get
        self.set_num_threads = set_


def _direct(lib: Any) -> Any:
    """``lib``, or a direct handle on its C entry points where threadpoolctl has them."""
    symbol = getattr(lib, "_get_symbol", None)
    if (getattr(lib, "internal_api", "") != "openblas" or symbol is None
            or getattr(lib, "threading_layer", "") == "openmp"):
        return lib
    try:
        get, set_ = symbol("openblas_get_num_threads"), symbol("openblas_set_num_threads")
    except Exception:               # another threadpoolctl: keep its public methods
        return lib
    return lib if get is None or set_ is None else _DirectPool(get, set_)


class _Scan:
    """The loaded libraries' thread pools as last scanned, and ``sys.modules``' length
    then (-1: never scanned)."""

    __slots__ = ("controller", "modules", "pools")

    def __init__(self) -> None:
        self.modules = -1
        self.controller: Any = None
        self.pools: tuple[Any, ...] = ()


_scanned = _Scan()


def _pools() -> tuple[Any, ...]:
    """Handles on the BLAS / OpenMP thread pools loaded. Scanning the loaded libraries
    (threadpoolctl) takes about a millisecond, so it is done again only where a module
    was imported since the last scan: a library with a pool comes with an import (torch's
    libgomp, imported after keel's first cap, was never capped while the scan was done
    once a process). The check is one len() of sys.modules, a few percent of a cap and
    its restore (docs/performance.md). A library loaded through ctypes alone is seen at
    the next import."""
    scan = _scanned
    if scan.modules != len(sys.modules):
        _rescan(scan)
    return scan.pools


def _controller() -> Any:
    """threadpoolctl's controller of the pools :func:`_pools` hands out."""
    _pools()
    return _scanned.controller


def _rescan(scan: _Scan) -> None:
    from threadpoolctl import ThreadpoolController

    # The count before the scan: a module imported while it runs (another thread's) may
    # load a pool the scan missed, and must leave the count stale so the next cap scans.
    modules = len(sys.modules)
    controller = ThreadpoolController()
    pools = tuple(_direct(lib) for lib in controller.lib_controllers)
    # The pools before the count: a reader that sees the new count sees these pools.
    scan.controller, scan.pools, scan.modules = controller, pools, modules


def _native_available() -> bool:
    from keel import native

    return native.available()


def _usable_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on (None where the platform does not say)."""
    getter = getattr(os, "sched_getaffinity", None)
    return None if getter is None else frozenset(getter(0))


def resolve_threads(hardware: HardwareProfile | None = None) -> tuple[int, str]:
    """The cpu thread count when none is given, and why: ``KEEL_THREADS``, else the usable
    cores of ``hardware`` (a profile, perhaps of another machine), else this process's."""

    configured = settings().threads
    if configured is not None:
        return configured, f"KEEL_THREADS={configured}"
    if hardware is not None:
        found = _profile_threads(hardware)
        if found is not None:
            return _thermal_cap(hardware, *found)
    cores = default_threads()
    why = ("usable cores of this machine (affinity mask and cgroup quota, from the hardware "
           "probe)")
    if hardware is not None:
        why += "; the given hardware profile does not say how many cores it has"
    return cores, why


def _profile_threads(hardware: HardwareProfile) -> tuple[int, str] | None:
    cpu = hardware.cpu
    label = cpu.brand or cpu.architecture or "unnamed CPU"
    if cpu.usable_cores:
        return cpu.usable_cores, (f"usable cores of the given hardware profile ({label}: "
                                  f"{cpu.usable_cores} usable of {cpu.logical_cores} "
                                  "logical cores)")
    if cpu.logical_cores:
        return cpu.logical_cores, (f"logical cores of the given hardware profile ({label}; "
                                   "it does not say how many are usable)")
    return None


def _thermal_cap(hardware: HardwareProfile, cores: int, why: str) -> tuple[int, str]:
    """Fewer threads while the profile reads the CPU throttling for heat."""
    from keel.hardware.thermal import cpu_throttling, throttled_threads

    hot = cpu_throttling(hardware)
    if not hot:
        return cores, why
    fewer = throttled_threads(cores)
    return fewer, f"{fewer} of the {why}, because the {hot} is throttling for heat"


def _check_hardware(hardware: Any) -> HardwareProfile | None:
    if hardware is None:
        return None
    from keel.hardware.profile import HardwareProfile

    if not isinstance(hardware, HardwareProfile):
        raise InvalidArgumentError(f"hardware must be a keel.hardware.HardwareProfile or None, "
                                   f"got {type(hardware).__name__}")
    return hardware


@functools.lru_cache(maxsize=1)
def default_threads() -> int:
    """The cores this process may use: the probe's ``usable_cores``, else the affinity mask."""
    cpu = _probed_cpu()
    cores = getattr(cpu, "usable_cores", None)
    if isinstance(cores, int) and cores > 0:
        return cores
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _probed_cpu() -> Any:
    from keel.hardware.cpu import this_cpu

    return this_cpu()


def _memory_limit() -> int | None:
    """The memory this process may use (cgroup aware), as the probe reads it."""
    from keel.hardware.memory import probe_memory
    from keel.hardware.sources import ProbeSources

    try:
        return probe_memory(ProbeSources.real()).effective_limit_bytes
    except Exception:  # a capability report never fails; None reads as unknown
        return None


def _simd_level() -> str | None:
    level = getattr(_probed_cpu(), "simd_level", None)
    return level if isinstance(level, str) else None
