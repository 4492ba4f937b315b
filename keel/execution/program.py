"""Compile an ``ExecutionPlan`` into a flat list of steps over one arena per device.

A :class:`Program` is made for one input signature. Compiling resolves every
kernel, binds every planned intermediate to a view of its device's arena and
loads the weights each device reads. Running is then a loop over steps:
fetch the input arrays by slot, call the kernel with its preallocated output
views, store the results by slot. In steady state nothing is allocated per
step except the graph outputs (fresh arrays the caller keeps), values whose
size depends on data, and outputs of kernels that cannot write into a given
buffer (the plan lists both).

Reshape-like nodes (reshape, flatten, squeeze, unsqueeze, identity) whose
output reuses their input's bytes run as nothing at all: the output view
already reads those bytes in the new shape.

The run loop is built for per-step cost: each step is precompiled into a
tuple (kernel, context, attributes, an ``itemgetter`` over the value slots,
the bound output views), so a step costs a tuple unpack, one getter call and
the kernel call, with no dictionary lookups, attribute normalization or
validation. A backend's execution scope (the cpu backend's BLAS thread cap)
is entered once per run, not per step, and only where the program's steps
on it need it (``Backend.needs_scope``): a program of native kernels never
touches the BLAS pools. Graph outputs that a run wrote into arrays it
allocated for them are handed to the caller as they are; any other output
(a feed, a weight, arena bytes, a kernel's view of them) is copied. Kernel
variants that prepack constant inputs (``KernelVariant.prepack``) do so here,
once per model and node.

Per-node timings are taken on request (:class:`Profiler`), each around the step the
steady run executes (its bound call where it bound), and export as a Chrome trace,
the JSON onnxruntime's profiler writes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.backends.base import (
    Backend,
    KernelContext,
    KernelVariant,
    ProgramScope,
    every_value,
)
from keel.backends.bound import BoundCall, PartFailed, bare
from keel.backends.gpu.io import is_device_array
from keel.backends.gpu.io import to_host as device_to_host
from keel.config import format_bytes
from keel.dtypes import DType
from keel.errors import ExecutionError, InvalidArgumentError, KeelError, MemoryLimitError
from keel.execution.branches import run_lanes
from keel.execution.budget import SIZED_BY_VALUES, check_output, output_elements
from keel.execution.capture import Replay
from keel.execution.capture import decide as decide_capture
from keel.graph.ir import Graph
from keel.graph.memory_plan import ALIGNMENT, MemoryPlan
from keel.ops.registry import Op, OpGroup
from keel.ops.types import TensorType
from keel.planning.plans import HOST, ExecutionPlan, NodePlacement
from keel.planning.work import estimated_work

__all__ = ["ArenaPool", "Observer", "Profiler", "Program", "compile_program"]

# NumPy 2's floating-point error state, a context variable (see _Quiet); None: another
# NumPy, where np.errstate is used as it is.
_FP_STATE: Any = getattr(getattr(getattr(np, "_core", None), "_ufunc_config", None),
                         "_extobj_contextvar", None)

# Ops whose output is their input read in another shape (C order): zero-copy in place.
VIEW_OPS = frozenset({Op.RESHAPE, Op.FLATTEN, Op.SQUEEZE, Op.EXPAND_DIMS, Op.IDENTITY})

_ABSENT = -1

# How a precompiled step runs (the first field of its tuple).
_VIEW1 = 0       # one output, written into its arena view
_VIEWS = 1       # several outputs, each written into its arena view
_ALLOC = 2       # the kernel allocates its outputs
_FRESH = 3       # writes graph outputs: fresh arrays (unless the caller gives buffers)
_OTHER = 4       # device copies, unbound buffers: the general path
_FRESH1 = 5      # one output, a graph output: a fresh array (unless the caller gives one)
_MEMO = 6        # shape arithmetic of a shape-generic program: results kept per input value
_SKIP = 7        # a step a recorded run leaves out (its feed copy is staged before)
_BOUND = 8       # a call its kernel bound once for the arrays it always runs on
_HELD = 9        # a bound call writing a small graph output into a buffer copied out

# Feeds (and graph outputs) up to the size the steps' backend says (Backend.staging) are
# copied into (out of) buffers of the program's own, so that the steps reading (writing)
# them bind like the steps on arena bytes.
_THREADS_BOUND = 4          # threads a program keeps bound steps for; more and it starts afresh

# Ops a shape-generic program may remember results of (deterministic, cheap to key), and
# the largest input (in elements) a key is made of.
_MEMO_OPS = OpGroup.SHAPE | OpGroup.INDEXING | OpGroup.ELEMENTWISE | OpGroup.MEMORY
_MEMO_KEY_ELEMENTS = 64
_MEMO_SIZE = 64             # results kept per step; more and the step starts afresh

# How ``_collect`` hands out a graph output (the third field of its entry).
_AS_IS = 0       # a fresh host array this run made (a _FRESH output): no check, no copy
_COPY = 1        # a feed, a weight, arena bytes or a repeated output: always a copy
_CHECK = 2       # a kernel's own result, or on another device: copied unless it is fresh

# (kind, kernel, context, attrs, input getter, output slots (or fresh specs), output views)
_HotStep = tuple[int, Any, Any, Any, Callable[[list[Any]], Sequence[Any]], tuple[Any, ...], Any]

# Called with a value's host array as a run makes it (``Program.run(observe=...)``).
Observer = Callable[[Any], None]
# (slot, the backend to read it from (None: on the host), callback)
_Watched = tuple[int, Backend | None, Observer]


class ArenaPool:
    """One byte buffer per device, shared by the programs of one model.

    Programs run one at a time, so every signature's program can use the same
    arena; it grows when a program needs more and is never shrunk. The pool
    also keeps the prepacked constants of the model's nodes, which do not
    depend on the input signature.
    """

    def __init__(self) -> None:
        self._arenas: dict[str, Any] = {}
        self.version = 0                   # bumped whenever an arena is replaced
        self.prepacked: dict[Hashable, Any] = {}
        self.limit: int | None = None      # the model's memory limit (data-dependent sizes)

    def get(self, device: str, nbytes: int, backend: Backend) -> Any:
        arena = self._arenas.get(device)
        if arena is None or arena.nbytes < nbytes:
            arena = _aligned_bytes(backend, nbytes)
            self._arenas[device] = arena
            self.version += 1
        return arena

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._arenas.values())

    def clear(self) -> None:
        self._arenas.clear()
        self.version += 1


def _aligned_bytes(backend: Backend, nbytes: int) -> Any:
    raw = backend.allocate((nbytes + ALIGNMENT,), "uint8")
    skip = (-_address(raw)) % ALIGNMENT
    return raw[skip: skip + nbytes]


def _address(array: Any) -> int:
    iface = getattr(array, "__array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    return int(array.data.ptr)     # CuPy


@dataclass
class _Step:
    name: str
    op: str
    backend: str
    kind: str                                   # "kernel" | "copy"
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    fn: Callable[..., Sequence[Any]] | None = None
    ctx: KernelContext | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)
    out: list[Any] | None = None               # preallocated views (None: kernel allocates)
    fresh: tuple[tuple[int, tuple[int, ...], Any], ...] = ()   # graph outputs: (pos, shape, dt)
    variant: KernelVariant | None = None       # kernels: what the step runs
    dtype: DType | None = None                 # kernels: the dtype of the first input
    work: float = 0.0                          # kernels: estimated multiply-adds (elements)
    src: Backend | None = None                 # copies
    dst: Backend | None = None
    sized: int = 0                             # >0: output size read from inputs; its itemsize
    memo: dict[Any, tuple[Any, ...]] | None = None   # shape arithmetic: results by inputs


@dataclass
class ProfileEvent:
    name: str
    op: str
    backend: str
    start_ns: int
    duration_ns: int


class Profiler:
    """Collects per-node timings; exports a Chrome trace (onnxruntime's profile format)."""

    def __init__(self) -> None:
        self.events: list[ProfileEvent] = []
        self.runs: list[ProfileEvent] = []
        self._origin = time.perf_counter_ns()

    def node_totals(self) -> dict[str, float]:
        """Total microseconds per node over every profiled run."""
        totals: dict[str, float] = {}
        for e in self.events:
            totals[e.name] = totals.get(e.name, 0.0) + e.duration_ns / 1000
        return totals

    def chrome_trace(self) -> list[dict[str, Any]]:
        pid = os.getpid()

        def event(e: ProfileEvent, cat: str, suffix: str) -> dict[str, Any]:
            return {
                "cat": cat, "pid": pid, "tid": pid, "ph": "X",
                "name": f"{e.name}{suffix}",
                "ts": (e.start_ns - self._origin) / 1000, "dur": e.duration_ns / 1000,
                "args": {"op_name": e.op, "provider": e.backend},
            }

        return ([event(r, "Session", "") for r in self.runs]
                + [event(e, "Node", "_kernel_time") for e in self.events])

    def export(self, path: str | os.PathLike[str]) -> str:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.chrome_trace(), fh)
        return os.fspath(path)


class Program:
    """Flat steps bound to kernels and arena views; one input signature."""

    def __init__(self, *, graph: Graph, plan: ExecutionPlan, steps: list[_Step],
                 slots: dict[str, int], constants: dict[int, Any],
                 backends: dict[str, Backend], pool: ArenaPool,
                 views: dict[int, tuple[str, int, tuple[int, ...], Any]],
                 input_types: dict[str, TensorType],
                 outputs: list[tuple[str, int, str]],
                 optional: dict[str, tuple[int, Any]] | None = None,
                 shape_generic: bool = False, known: Mapping[str, int] | None = None) -> None:
        self.graph_name = graph.name
        self.shape_generic = shape_generic         # runs feeds of any shape (no arena)
        self._known = dict(known or {})            # value -> slot of a folded node's output
        self.plan = plan
        self._steps = steps
        self._slots = slots
        self._constants = constants
        self._backends = backends
        # Backends whose execution scope the steps need (a thread cap is worth
        # entering only where some step may call BLAS).
        scopes = {name: _scope(b, [s for s in steps
                                   if s.backend == name and s.variant is not None])
                  for name, b in backends.items()}
        self._scoped = tuple(sc.enter for sc in scopes.values() if sc is not None)
        if any(s.variant is not None and s.variant.bind is not None for s in steps):
            # Bound calls skip their kernels' own errstate: entered once per run instead.
            self._scoped += (_quiet,)
        self.scope_reasons = {name: sc.reason for name, sc in scopes.items()
                              if sc is not None and sc.reason}
        self._pool = pool
        self._views = views                       # slot -> (device, offset, shape, dtype)
        self._input_types = input_types
        self._input_slots = tuple(slots[name] for name in input_types)
        self._outputs = outputs                   # (graph output name, slot, device)
        self._optional = optional or {}           # input with a default: (slot, default)
        # Two slots past the named ones: one always None (absent inputs), one
        # that takes absent outputs of kernels that allocate.
        self._none_slot = len(slots)
        self._trash_slot = len(slots) + 1
        self._values: list[Any] = [None] * (len(slots) + 2)
        for slot, value in constants.items():
            self._values[slot] = value
        self._transient = tuple(s for s in range(len(self._values))
                                if s not in views and s not in constants
                                and s != self._none_slot)
        self._bound: dict[str, int] = {}          # device -> id of the arena bound
        # feeds copied into (or read in place instead of) a buffer: (slot, own buffer)
        self._staged: tuple[tuple[int, Any], ...] = ()
        # Staged feeds the bound steps read where the caller has them (_feeds_in_place):
        # (slot, its buffer, each reading call's ``point``), as compiled for _hot's thread.
        self._moving: tuple[tuple[int, Any, tuple[Callable[[Any], None], ...]], ...] = ()
        self._bound_version = -1
        self._hot: list[_HotStep] = []
        self._calls: tuple[Callable[[], object], ...] | None = None
        # Bound calls may hold the binding thread's state (a GEMM's packing workspace):
        # the steps as compiled on each thread that ran them, and the thread of _hot.
        self._threads: dict[int, tuple[list[_HotStep], Any, Any]] = {}
        self._bound_on = 0
        self._lanes_hot: dict[tuple[int, tuple[int, int]], list[tuple[int, _HotStep]]] = {}
        self._capture_decided = False
        self._direct = False             # runs go straight to the bound calls (_plan_direct)
        # The steady run as one function (_plan_direct_run), where _direct allows it.
        self._direct_run: Callable[[Sequence[Any]], dict[str, Any]] | None = None
        # Steps that may split over keel's native workers: the run's end parks them.
        self._parks = any(st.ctx is not None and (getattr(st.ctx, "threads", 1) or 1) > 1
                          and backends[st.backend].device.value == HOST for st in steps)
        self._park: Callable[[], None] | None = None
        self._compile_hot()
        self._handout = self._plan_handout()
        self._constant_ids = frozenset(id(v) for v in constants.values())   # held: ids stay
        self.dynamic = False             # compiled for inputs of unknown dimensions
        # Regions whose branches run at once (set again by compile_program, which knows
        # whether the program is dynamic), and whether their lanes set the quiet FP state.
        self._schedule: list[Any] | None = self._plan_schedule()
        self._quiet_lanes = _quiet in self._scoped
        # Feeds a host kernel reads directly: a device array given there is read back first.
        host_read = {i for st in steps if st.kind == "kernel"
                     and backends[st.backend].device.value == HOST for i in st.inputs}
        self._host_inputs = tuple(s for s in self._input_slots if s in host_read)
        # Outputs copied to the host after the last kernel: target slot -> device slot.
        last = max((i for i, st in enumerate(steps) if st.kind == "kernel"), default=-1)
        fetches = {i: st for i, st in enumerate(steps)
                   if st.kind == "copy" and i > last and st.dst is None and st.src is not None}
        self._fetch_src = {st.outputs[0]: st.inputs[0] for st in fetches.values()}
        self._fetch_steps = frozenset(fetches)
        # Device graph capture (keel.execution.capture), decided at the first run.
        self._replay: Replay | None = None
        self._capture_decided = False
        self.capture_reason = ""         # what explain() says about capture ("": host only)

    @property
    def memory(self) -> MemoryPlan | None:
        return None if self.shape_generic else self.plan.memory_plan

    @property
    def input_names(self) -> list[str]:
        """The inputs ``execute`` takes, in order (inputs with a default left out)."""
        return list(self._input_types)

    @property
    def steps(self) -> list[tuple[str, str, str]]:
        """(name, op, backend) of each step that runs, in order."""
        return [(s.name, s.op, s.backend) for s in self._steps]

    @property
    def bodies(self) -> dict[str, Any]:
        """The compiled subgraphs of its control-flow steps, by ``"node/attribute"``
        (:class:`keel.execution.control.CompiledBody`)."""
        from keel.execution.control import CompiledBody

        return {f"{s.name}/{attr}": body for s in self._steps
                for attr, body in s.attrs.items() if isinstance(body, CompiledBody)}

    def arena(self, device: str = HOST) -> Any:
        """The arena this program's views point into (after the first run)."""
        memory = self.memory
        need = 0 if memory is None else memory.arena_bytes.get(device, 0)
        return self._pool.get(device, need, self._backend_on(device))

    def planned_values(self) -> dict[str, Any]:
        """The arena view bound to each planned intermediate (binds the arenas first)."""
        self._bind()
        names = {slot: name for name, slot in self._slots.items()}
        return {names[s]: self._values[s] for s in self._views}

    # ---- running -------------------------------------------------------
    def run(self, feeds: Mapping[str, Any], *, outputs: Mapping[str, Any] | None = None,
            profiler: Profiler | None = None, keep_all: bool = False,
            observe: Mapping[str, Observer] | None = None,
            device_outputs: bool = False) -> dict[str, Any]:
        """Run once; returns ``{output name: host array}`` (or every value if ``keep_all``).

        Arrays in ``outputs`` (host, right shape and dtype) receive the results
        instead of fresh ones. ``observe`` maps value names to callbacks, each
        called once per run with the value's host array as soon as it is made
        (a feed: before the first step); the array may be arena bytes that later
        steps overwrite, so a callback reads it then and keeps no reference.

        ``device_outputs``: outputs made on a device are returned as the device arrays
        the run wrote (not copied to the host; the next run overwrites them), the
        others as host arrays.
        """
        self._bind()
        self._load_feeds(feeds)
        if device_outputs:
            return self._run_hot(None, device=True)
        if profiler is None and not keep_all and not observe:
            return self._run_hot(outputs)
        if profiler is not None and not keep_all and not observe:
            return self._run_timed(outputs, profiler)
        kept: dict[str, Any] = {}
        names = {slot: name for name, slot in self._slots.items()} if keep_all else {}
        if keep_all:                # values known when compiled: their nodes do not run
            kept.update({name: np.array(self._values[slot], copy=True)
                         for name, slot in self._known.items()})
        watch = self._watch(observe) if observe else None
        start = time.perf_counter_ns()
        scopes = self._enter_scopes()
        try:
            with every_value():         # every value kept or watched: each step writes its own
                for index, step in enumerate(self._steps):
                    self._run_step(step, outputs, profiler)
                    if keep_all:
                        kept.update(self._snapshot(step, names))
                    if watch is not None:
                        self._notify(watch.get(index, ()))
        finally:
            _exit_scopes(scopes)
            # The general kernels read the values, not the bound steps a feed read in
            # place was pointed for: point those back, so none keeps the caller's array.
            self._point_at_buffers()
        if profiler is not None:
            profiler.runs.append(ProfileEvent("model_run", self.graph_name, "", start,
                                              time.perf_counter_ns() - start))
        result = self._collect(outputs)
        self._release()
        return {**kept, **result} if keep_all else result

    def _run_timed(self, outputs: Mapping[str, Any] | None,
                   profiler: Profiler) -> dict[str, Any]:
        """One profiled run: the steps the steady run executes (bound calls where they
        bound), each timed alone, so that a node's time is its time in a steady run, not
        the general path's. Regions planned to run at once run in order here."""
        if self._bound_on != _get_ident():
            self._on_this_thread()
        start = time.perf_counter_ns()
        scopes = self._enter_scopes()
        try:
            for index, hot in enumerate(self._hot):
                t0 = time.perf_counter_ns()
                self._run_items(((index, hot),), outputs)
                self._record(profiler, self._steps[index], t0)
            profiler.runs.append(ProfileEvent("model_run", self.graph_name, "", start,
                                              time.perf_counter_ns() - start))
            return self._collect(outputs)
        finally:
            _exit_scopes(scopes)
            self._release()

    def execute(self, arrays: Sequence[Any]) -> dict[str, Any]:
        """Run with feeds already checked against this signature, in ``input_names`` order.

        The caller guarantees each array's type, dtype and shape (``Model.predict``
        does so once per call); nothing is validated here.
        """
        run = self._direct_run
        if (run is not None and self._bound_version == self._pool.version
                and self._bound_on == _get_ident()):
            return run(arrays)                  # its strict zip checks the count
        if self._bound_version != self._pool.version:
            self._bind()
        values = self._values
        for slot, value in zip(self._input_slots, arrays, strict=True):
            values[slot] = value
        for slot, default in self._optional.values():
            values[slot] = default
        self._take_staged()
        if self._direct and self._bound_on == _get_ident():
            return self._run_direct()
        return self._run_hot(None)

    def _run_direct(self) -> dict[str, Any]:
        """Every step's bound call in order, under the quiet FP state, then the outputs:
        the steady run of a host program whose steps all bound (``_direct``)."""
        try:
            if self._scoped:
                with _Quiet():
                    self._run_items((), None, self._calls)
            else:
                self._run_items((), None, self._calls)
            return self._collect(None)
        finally:
            self._release()

    def _plan_direct(self) -> bool:
        """Whether a run may go straight to the bound calls (:meth:`_run_direct`): every
        step bound, no region run at once, no device recording, and no scope but the
        quiet FP state (NumPy 2's context variable) to enter. Decided after the first
        run (which decides the recording)."""
        direct = (self._capture_decided and self._calls is not None and self._replay is None
                  and self._runs_may_be_direct())
        self._direct_run = self._plan_direct_run() if direct else None
        return direct

    def _runs_may_be_direct(self) -> bool:
        """What a direct run needs besides bound steps, known when compiled: no region
        run at once and no scope but the quiet FP state (NumPy 2's context variable)."""
        return (self._schedule is None and _FP_STATE is not None
                and self._scoped in ((), (_quiet,)))

    def _plan_direct_run(self) -> Callable[[Sequence[Any]], dict[str, Any]] | None:
        """The whole steady run as one function of the ordered feeds, where nothing but
        copies surrounds the bound calls: every feed staged (copied into the buffer its
        steps are bound to, or read in place: ``_feeds_in_place``), no optional input,
        and every output a held step's buffer handed out as a copy (what ``_collect``
        hands out as it is). The slots are left
        alone: the bound calls read and write their buffers, not the slots. None
        otherwise."""
        held = {slot: buf for kind, _, buf, slot, _, _, _ in self._hot if kind == _HELD}
        staged = dict(self._staged)
        if self._optional or any(slot not in staged for slot in self._input_slots):
            return None
        outs = []
        for name, slot, how, device in self._handout:
            if how != _AS_IS or device != HOST or slot not in held:
                return None
            outs.append((name, held[slot]))
        points = {slot: moving for slot, _, moving in self._moving}
        calls = self._joined(tuple(hot[1] for hot in self._hot))
        # Calls that run C code only read no NumPy floating-point state: none to set.
        quiet = bool(self._scoped) and not all(
            isinstance(c, BoundCall) and c.native for c in calls)
        return _direct_runner(self, tuple((staged[slot], points.get(slot, ()))
                                          for slot in self._input_slots),
                              calls, tuple(outs), quiet)

    def _joined(self, calls: tuple[Callable[[], object], ...]
                ) -> tuple[Callable[[], object], ...]:
        """The steady run's calls as its backend joins them (``Backend.joined``), where
        every step runs on one backend."""
        backends = {step.backend for step in self._steps}
        if len(backends) != 1:
            return calls
        return self._backends[backends.pop()].joined(calls)

    def _run_hot(self, outputs: Mapping[str, Any] | None, *,
                 device: bool = False) -> dict[str, Any]:
        if not self._capture_decided:
            self._decide_capture()
        if self._replay is not None:
            return self._replay.run(outputs, device=device)
        return self._run_steps(outputs, device=device)

    def _decide_capture(self) -> None:
        plan, self.capture_reason = decide_capture(self)
        self._replay = None if plan is None else Replay(self, plan)
        self._capture_decided = True
        self._direct = self._plan_direct()

    @property
    def captured(self) -> bool:
        """Whether runs replay a device graph recording (after the second run)."""
        return self._replay is not None and self._replay.captured

    def _run_steps(self, outputs: Mapping[str, Any] | None, *,
                   device: bool = False) -> dict[str, Any]:
        scoped = self._scoped
        hot = self._skipping(set(self._fetch_steps)) if device else None
        try:
            if not scoped:
                self._loop(outputs, hot)
            elif len(scoped) == 1:
                with scoped[0]():
                    self._loop(outputs, hot)
            elif len(scoped) == 2:
                with scoped[0](), scoped[1]():
                    self._loop(outputs, hot)
            else:
                scopes = self._enter_scopes()
                try:
                    self._loop(outputs, hot)
                finally:
                    _exit_scopes(scopes)
            return self._collect_device() if device else self._collect(outputs)
        finally:
            self._release()

    def _collect_device(self) -> dict[str, Any]:
        """The outputs as the run left them: device arrays where a device made them."""
        values, fetched = self._values, self._fetch_src
        return {name: values[fetched.get(slot, slot)] for name, slot, _ in self._outputs}

    def _skipping(self, indices: set[int]) -> list[_HotStep]:
        """The precompiled steps with those at ``indices`` left out."""
        return [(_SKIP, None, None, None, _nothing, (), None) if i in indices else hot
                for i, hot in enumerate(self._hot)]

    def _loop(self, outputs: Mapping[str, Any] | None,
              hot: list[_HotStep] | None = None) -> None:
        """Every step, precompiled: the loop that per-step overhead is measured on."""
        if hot is None and self._bound_on != _get_ident():
            self._on_this_thread()
        if hot is None and self._schedule is not None:
            self._run_schedule(outputs)
            return
        calls = self._calls if hot is None and outputs is None else None
        self._run_items(enumerate(self._hot if hot is None else hot), outputs, calls)

    def _run_items(self, items: Iterable[tuple[int, _HotStep]],
                   outputs: Mapping[str, Any] | None,
                   calls: Sequence[Callable[[], object]] | None = None) -> None:
        """The precompiled steps ``items`` (index, step), in order (``calls``: every step's
        bound call instead, where every step is bound)."""
        values = self._values
        i = 0
        try:
            if calls is not None:            # every step bound: nothing but the calls
                for i, call in enumerate(calls):  # noqa: B007 - i names a failing step
                    call()
                return
            for i, (kind, fn, ctx, attrs, get, slots, out) in items:
                if kind == _BOUND:
                    fn()
                elif kind == _HELD:
                    # Run as bound even where the caller gives the outputs: the call may
                    # finish work an earlier bound step handed to it (conv_pool).
                    fn()
                    values[attrs] = ctx.copy()
                elif kind == _VIEW1:
                    result = fn(ctx, get(values), attrs, out)[0]
                    if result is not out[0]:
                        # A kernel that ignored its buffer: later steps (and free
                        # views) read the planned bytes, so the result must land there.
                        out[0][...] = result
                elif kind == _FRESH1 and outputs is None:
                    slot, shape, dtype, empty = slots
                    buf = values[slot] = empty(shape, dtype=dtype)
                    result = fn(ctx, get(values), attrs, [buf])[0]
                    if result is not buf:
                        buf[...] = result
                elif kind == _ALLOC:
                    for slot, result in zip(slots, fn(ctx, get(values), attrs, None),
                                            strict=False):
                        values[slot] = result
                elif kind == _FRESH and outputs is None:
                    out = list(out)
                    for pos, slot, shape, dtype, empty in slots:
                        out[pos] = values[slot] = empty(shape, dtype=dtype)
                    for buf, result in zip(out, fn(ctx, get(values), attrs, out),
                                           strict=False):
                        if result is not buf:
                            buf[...] = result
                elif kind == _VIEWS:
                    for buf, result in zip(out, fn(ctx, get(values), attrs, out),
                                           strict=False):
                        if result is not buf:
                            buf[...] = result
                elif kind == _MEMO:
                    for slot, result in zip(slots, _remembered(fn, ctx, get(values), attrs,
                                                               out), strict=False):
                        values[slot] = result
                elif kind == _SKIP:
                    continue
                else:
                    self._general(self._steps[i], outputs)
        except KeelError as exc:
            _note(exc, self._steps[i])
            raise
        except Exception as exc:
            raise self._failed(i, exc) from exc

    def _failed(self, index: int, exc: Exception) -> ExecutionError | MemoryLimitError:
        """The ExecutionError a failure of step ``index`` (not a keel error) raises."""
        step = self._steps[index]
        return _failure(exc, step, self._backends.get(step.backend))

    # ---- independent branches at once ------------------------------------------
    def _plan_schedule(self) -> list[Any] | None:
        """The steps as segments: a tuple of step indices runs in order, a list of
        ``(key, indices)`` lanes runs at once (``run_lanes``); None: every step in order
        (no region of the plan runs at once, or this program cannot)."""
        regions = [r for r in self.plan.regions if r.concurrent]
        if not regions or self.shape_generic or self.dynamic or self.memory is None or any(
                b.device.value != HOST for b in self._backends.values()):
            return None
        index = {st.name: i for i, st in enumerate(self._steps) if st.kind == "kernel"}
        segments: list[Any] = []
        done = 0
        for number, region in enumerate(regions):
            lanes = [tuple(index[n] for n in lane if n in index) for lane in region.lanes]
            lanes = [lane for lane in lanes if lane]
            if len(lanes) < 2:
                continue
            taken = sorted(i for lane in lanes for i in lane)
            if taken != list(range(taken[0], taken[-1] + 1)) or taken[0] < done:
                return None            # not one run of steps: leave the order alone
            segments.append(tuple(range(done, taken[0])))
            segments.append([((number, k), lane) for k, lane in enumerate(lanes)])
            done = taken[-1] + 1
        if not any(isinstance(seg, list) for seg in segments):
            return None
        segments.append(tuple(range(done, len(self._steps))))
        return [seg for seg in segments if seg]

    def _run_schedule(self, outputs: Mapping[str, Any] | None) -> None:
        hot = self._hot
        for segment in self._schedule or ():
            if isinstance(segment, tuple):
                self._run_items([(i, hot[i]) for i in segment], outputs)
                continue
            (_, first), *rest = segment
            calls = [functools.partial(self._run_items, [(i, hot[i]) for i in first], outputs)]
            calls += [functools.partial(self._run_lane, key, lane, outputs) for key, lane in rest]
            run_lanes(calls)

    def _run_lane(self, key: tuple[int, int], lane: tuple[int, ...],
                  outputs: Mapping[str, Any] | None) -> None:
        """A lane on a lane thread: its steps as compiled on that thread (bound calls hold
        the binding thread's state), under the floating-point state the run's scope sets."""
        held = (_get_ident(), key)
        items = self._lanes_hot.get(held)
        if items is None:
            items = self._lanes_hot[held] = [(i, self._hot_step(self._steps[i])) for i in lane]
        if self._quiet_lanes:
            with _quiet():
                self._run_items(items, outputs)
        else:
            self._run_items(items, outputs)

    @property
    def lanes(self) -> list[list[list[str]]]:
        """The step names of each region this program runs at once, by lane."""
        return [[[self._steps[i].name for i in lane] for _, lane in seg]
                for seg in self._schedule or () if isinstance(seg, list)]

    def _enter_scopes(self) -> list[Any]:
        entered = []
        try:
            for enter in self._scoped:
                scope = enter()
                scope.__enter__()
                entered.append(scope)
        except BaseException:
            _exit_scopes(entered)
            raise
        return entered

    def _run_step(self, step: _Step, outputs: Mapping[str, Any] | None,
                  profiler: Profiler | None) -> None:
        t0 = time.perf_counter_ns() if profiler is not None else 0
        try:
            self._general(step, outputs)
        except KeelError as exc:
            _note(exc, step)
            raise
        except Exception as exc:
            raise _failure(exc, step, self._backends.get(step.backend)) from exc
        if profiler is not None:
            self._record(profiler, step, t0)

    def _record(self, profiler: Profiler, step: _Step, t0: int) -> None:
        """The time since ``t0`` of ``step``, once a device backend finished it."""
        backend = self._backends.get(step.backend)
        if backend is not None and backend.device.value != HOST:
            backend.synchronize()
        profiler.events.append(ProfileEvent(step.name, step.op, step.backend, t0,
                                            time.perf_counter_ns() - t0))

    def _general(self, step: _Step, outputs: Mapping[str, Any] | None) -> None:
        """One step by the general path: copies, fresh graph outputs, any kernel."""
        if step.kind == "copy":
            self._copy(step)
            return
        values = self._values
        ins = [values[i] if i >= 0 else None for i in step.inputs]
        if step.sized:
            self._check_size(step, ins)
        out = step.out
        if out is not None and step.fresh:
            out = list(out)
            for pos, shape, dtype in step.fresh:
                out[pos] = self._fresh_output(step, pos, shape, dtype, outputs)
        results = step.fn(step.ctx, ins, step.attrs, out)  # type: ignore[misc]
        for j, (slot, value) in enumerate(zip(step.outputs, results, strict=False)):
            if out is not None and out[j] is not None and value is not out[j]:
                out[j][...] = value
                value = out[j]
            if slot >= 0:
                values[slot] = value

    def _check_size(self, step: _Step, ins: Sequence[Any]) -> None:
        """Check a data-dependent output against what the budget leaves, before allocating."""
        n = output_elements(Op(step.op), ins, step.attrs)
        if n is not None:
            check_output(step.name, n * step.sized, self._pool.limit, self.plan.peak_bytes)

    def _fresh_output(self, step: _Step, pos: int, shape: tuple[int, ...], dtype: Any,
                      outputs: Mapping[str, Any] | None) -> Any:
        backend = self._backends[step.backend]
        if outputs is not None and backend.device.value == HOST:
            given = outputs.get(self._output_name(step.outputs[pos]))
            if given is not None:
                return given
        return backend.xp.empty(shape, dtype=dtype)

    def _copy(self, step: _Step) -> None:
        src = self._values[step.inputs[0]]
        host = src if step.src is None else step.src.read(src)
        self._values[step.outputs[0]] = host if step.dst is None else step.dst.to_device(host)

    def _collect(self, outputs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The graph outputs by name: never arena bytes, weights or feeds the caller could
        see change; the arrays this run allocated for them are handed out as they are."""
        if outputs is not None:
            return self._collect_into(outputs)
        values = self._values
        result: dict[str, Any] = {}
        for name, slot, how, device in self._handout:
            value = values[slot]
            if value is None or type(value) is list:   # an optional or a sequence
                result[name] = _owned_value(value)
                continue
            if how != _AS_IS:
                host = self._backend_on(device).read(value) if device != HOST else value
                if how == _COPY or not _owns(host) or self._is_fixed(host):
                    host = np.array(host, copy=True)
                value = host
            result[name] = value
        return result

    def _collect_into(self, outputs: Mapping[str, Any]) -> dict[str, Any]:
        """As ``_collect``, writing into the caller's arrays where ``outputs`` names one."""
        result: dict[str, Any] = {}
        values, views = self._values, self._views
        for name, slot, device in self._outputs:
            value = values[slot]
            given = outputs.get(name)
            if value is None or type(value) is list:   # an optional or a sequence
                result[name] = _owned_value(value)
                continue
            if given is not None and value is given:
                result[name] = given
                continue
            host = self._backend_on(device).read(value) if device != HOST else value
            if given is not None:
                given[...] = host
                host = given
            elif name in result or not _owns(host) or slot in views:
                # Never hand out weights, feeds, arena bytes or a view of them.
                host = np.array(host, copy=True)
            result[name] = host
        return result

    def _is_fixed(self, array: Any) -> bool:
        """Whether ``array`` is itself a feed or a weight (a kernel may return one as is)."""
        values = self._values
        return (id(array) in self._constant_ids
                or any(array is values[s] for s in self._input_slots))

    def _plan_handout(self) -> tuple[tuple[str, int, int, str], ...]:
        """How ``_collect`` hands out each graph output: (name, slot, how, device)."""
        writer: dict[int, tuple[_Step, int]] = {}        # slot -> the step writing it last
        for step in self._steps:
            for pos, slot in enumerate(step.outputs):
                writer[slot] = (step, pos)
        fixed = {*self._constants, *self._input_slots,
                 *(slot for slot, _ in self._optional.values())}
        plan = []
        seen: set[str] = set()
        for name, slot, device in self._outputs:
            how = _CHECK
            if name in seen or slot in self._views or slot in fixed:
                how = _COPY
            elif device == HOST and slot in writer:
                step, pos = writer[slot]
                backend = self._backends.get(step.backend)
                if (step.kind == "kernel" and any(p == pos for p, _, _ in step.fresh)
                        and backend is not None and backend.device.value == HOST):
                    how = _AS_IS
            seen.add(name)
            plan.append((name, slot, how, device))
        return tuple(plan)

    def _output_name(self, slot: int) -> str:
        for name, s, _ in self._outputs:
            if s == slot:
                return name
        return ""

    # ---- observing ---------------------------------------------------------
    def _watch(self, observe: Mapping[str, Observer]) -> dict[int, list[_Watched]]:
        """When each observed value is made: step index -> what to notify after it.
        Values no step writes (feeds, weights) are notified here, before the first step."""
        writer: dict[int, int] = {}
        for position, step in enumerate(self._steps):
            for out in step.outputs:
                if out >= 0:
                    writer[out] = position
        watch: dict[int, list[_Watched]] = {}
        before: list[_Watched] = []
        for name, callback in observe.items():
            slot = self._slots.get(name)
            if slot is None:
                raise InvalidArgumentError(f"observe names {name!r}, which is not a value of "
                                           f"graph {self.graph_name!r}")
            index = writer.get(slot, self._source_writer(name, writer))
            if index < 0:
                before.append((slot, None, callback))
                continue
            backend = self._backends.get(self._steps[index].backend)
            on_host = backend is None or backend.device.value == HOST
            watch.setdefault(index, []).append((slot, None if on_host else backend, callback))
        self._notify(before)
        return watch

    def _source_writer(self, name: str, writer: Mapping[int, int]) -> int:
        """The step writing the bytes that a reshape which runs as nothing reads (its output
        is a view of its input's arena bytes); -1 for values no step writes."""
        memory = self.memory
        seen: set[str] = set()
        while memory is not None and name in memory and name not in seen:
            seen.add(name)
            shares = memory.allocation(name).shares
            if not shares:
                break
            name = shares
            index = writer.get(self._slots.get(name, _ABSENT), -1)
            if index >= 0:
                return index
        return -1

    def _notify(self, watched: Sequence[_Watched]) -> None:
        for slot, backend, callback in watched:
            value = self._values[slot]
            if value is not None:
                callback(value if backend is None else backend.read(value))

    def _snapshot(self, step: _Step, names: Mapping[int, str]) -> dict[str, Any]:
        snap = {}
        for slot in step.outputs:
            if slot >= 0 and self._values[slot] is not None:
                value = self._values[slot]
                backend = self._backends.get(step.backend)
                host = backend.read(value) if backend is not None else np.asarray(value)
                snap[names[slot]] = np.array(host, copy=True)
        return snap

    def _load_feeds(self, feeds: Mapping[str, Any]) -> None:
        for name, t in self._input_types.items():
            if name not in feeds:
                raise InvalidArgumentError(f"input {name!r} is missing")
            value = feeds[name]
            shape = tuple(getattr(value, "shape", ()))
            if not t.is_tensor or (self.dynamic and len(shape) == len(t.shape or ())):
                self._values[self._slots[name]] = value
                continue
            if (shape != t.shape and not self.shape_generic) or _dtype_of(value) != t.dtype.numpy:
                raise InvalidArgumentError(
                    f"input {name!r} is {_dtype_of(value)}{list(shape)}; this program was "
                    f"compiled for {t}")
            self._values[self._slots[name]] = value
        for name, (slot, default) in self._optional.items():
            value = feeds.get(name)
            self._values[slot] = default if value is None else value
        for slot in self._host_inputs:
            value = self._values[slot]
            if type(value) is not np.ndarray and is_device_array(value):
                self._values[slot] = device_to_host(value)
        self._take_staged()

    def _take_staged(self) -> None:
        """This run's staged feeds: one read in place (``_moving``) stays where the caller
        has it, its calls pointed there, if they can read it (as the steady run does, so
        that no path copies it: ``run(outputs=...)``, a run on another thread); any
        other is copied into its buffer, the calls reading the buffer."""
        if not self._staged:        # most programs: nothing to take, every run
            return
        if self._moving and self._bound_on != _get_ident():
            self._on_this_thread()      # this thread's calls, not the last thread's
        values, moving = self._values, {slot: points for slot, _, points in self._moving}
        for slot, buf in self._staged:
            value, points = values[slot], moving.get(slot, ())
            if points and _readable_in_place(value, buf):
                for point in points:
                    point(value)
                continue
            np.copyto(buf, value)
            values[slot] = buf
            for point in points:
                point(buf)

    def _point_at_buffers(self) -> None:
        """The calls reading a feed in place read its buffer (where this run copied it):
        the steady run (:func:`_direct_runner`) may have moved them to a caller's array."""
        for _, buf, points in self._moving:
            for point in points:
                point(buf)

    def _release(self) -> None:
        # Drop references to feeds, outputs and kernel-allocated values; keep views.
        values = self._values
        for slot in self._transient:
            values[slot] = None
        if self._parks:
            self._park_workers()

    def _park_workers(self) -> None:
        """The run ended: keel's idle workers spin on only ``KEEL_IDLE_SPIN_US``, not the
        whole ``KEEL_SPIN_US`` (a user's other work pays for a spinning core)."""
        park = self._park
        if park is None:
            from keel.native import pool

            park = self._park = pool.parker()
        if park is not None:
            park()

    # ---- binding ---------------------------------------------------------
    def _bind(self) -> None:
        memory = self.memory
        if self._bound_version == self._pool.version:
            return
        if memory is None:
            self._bound_version = self._pool.version
            return
        changed = False
        for device, need in memory.arena_bytes.items():
            arena = self._pool.get(device, need, self._backend_on(device))
            if self._bound.get(device) != id(arena):
                self._bound[device] = id(arena)
                changed = True
        if changed:
            self._bind_views()
        self._bound_version = self._pool.version

    def _bind_views(self) -> None:
        for slot, (device, offset, shape, dtype) in self._views.items():
            arena = self._pool.get(device, 0, self._backend_on(device))
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            view = arena[offset: offset + nbytes].view(dtype).reshape(shape)
            self._values[slot] = view
        for step in self._steps:
            if step.out is not None:
                step.out = [self._values[s] if s >= 0 else None for s in step.outputs]
        self._staged = self._stage_buffers()
        self._threads.clear()                 # every thread binds again to the new views
        self._lanes_hot.clear()
        self._compile_hot()
        kept = self._staged_bound()
        moving = {slot for slot, _, _ in self._moving} if self._may_run_direct(kept) else set()
        copied = self._staged_copies()
        unread = {slot for slot, buf in kept
                  if slot not in moving and buf.nbytes > copied.get(slot, 0)}
        # staged only to be read in place by a direct run, and a reader cannot or the run
        # is not direct (it would copy the feed each run): the feed's steps unbound
        if unread:
            self._staged = tuple((slot, buf) for slot, buf in kept if slot not in unread)
            self._threads.clear()
            self._compile_hot()
            kept = self._staged_bound()     # a step bound only with the dropped feed
        if len(kept) != len(self._staged):  # a bind declined: its feed is not copied
            self._staged = kept
            self._direct = self._plan_direct()

    def _may_run_direct(self, staged: tuple[tuple[int, Any], ...]) -> bool:
        """Whether the steps as compiled allow the direct run (:meth:`_plan_direct` and
        :meth:`_plan_direct_run`) with these feeds ``staged``: every step bound, nothing
        else in the way (:meth:`_runs_may_be_direct`), every feed staged, no optional
        input, every output a held buffer."""
        held = {slot for kind, _, _, slot, _, _, _ in self._hot if kind == _HELD}
        ours = {slot for slot, _ in staged}
        return (self._calls is not None and self._runs_may_be_direct() and not self._optional
                and all(slot in ours for slot in self._input_slots)
                and all(how == _AS_IS and device == HOST and slot in held
                        for _, slot, how, device in self._handout))

    def _staged_bound(self) -> tuple[tuple[int, Any], ...]:
        """The staged feeds that some bound (or held) step reads: a step whose bind
        declined runs its kernel on the feed itself, so copying the feed gains nothing."""
        read = {i for step, hot in zip(self._steps, self._hot, strict=True)
                if hot[0] in (_BOUND, _HELD) for i in step.inputs}
        return tuple((slot, buf) for slot, buf in self._staged if slot in read)

    def _stage_buffers(self) -> tuple[tuple[int, Any], ...]:
        """A buffer of the program's own for each feed that a step able to bind reads
        (host programs of fixed shapes only): a feed its readers' backends copy
        (``Backend.staging``), or a larger one they may read in place
        (``Backend.feed_in_place``). Those no step binds to are dropped once the steps
        are bound (:meth:`_staged_bound`), and so is a larger one that some reader cannot
        read in place or whose run cannot be direct (:meth:`_bind_views`)."""
        if self.dynamic or self.shape_generic or any(
                b.device.value != HOST for b in self._backends.values()):
            return ()
        limit = self._staged_copies()
        for st in self._steps:      # or gives a buffer so that its steps read it in place
            if st.variant is not None and st.variant.bind is not None:
                most = self._backends[st.backend].feed_in_place()[1]
                for i in st.inputs:
                    limit[i] = max(limit[i], most)
        staged = []
        for name, t in self._input_types.items():
            slot = self._slots[name]
            if slot not in limit or not t.is_tensor or not t.is_static \
                    or np.dtype(t.dtype.numpy).kind not in "biuf":
                continue
            shape = _static_shape(t)
            if math.prod(shape) * np.dtype(t.dtype.numpy).itemsize <= limit[slot]:
                staged.append((slot, np.empty(shape, t.dtype.numpy)))
        return tuple(staged)

    def _staged_copies(self) -> dict[int, int]:
        """Each slot that a step able to bind reads: the most bytes of it that the
        backends of its readers copy into a buffer (``Backend.staging``); a larger feed
        is staged only to be read in place (``Backend.feed_in_place``)."""
        limit: dict[int, int] = {}
        for st in self._steps:
            if st.variant is not None and st.variant.bind is not None:
                most = self._backends[st.backend].staging()[0]
                for i in st.inputs:
                    limit[i] = max(limit.get(i, 0), most)
        return limit

    def _on_this_thread(self) -> None:
        """Take the steps as compiled on this thread (bound anew on a thread new here)."""
        kept = self._threads.get(_get_ident())
        if kept is None:
            self._compile_hot()
        else:
            (self._hot, self._calls, self._moving), self._bound_on = kept, _get_ident()
            self._point_at_buffers()         # this thread's last steady run moved them
            self._direct = self._plan_direct()

    def _compile_hot(self) -> None:
        """Each step as the tuple ``_loop`` unpacks (rebuilt when the views move), and the
        calls alone where every step is bound; kept for the thread binding them."""
        hot = [self._hot_step(step) for step in self._steps]
        self._hot, self._moving = hot, self._feeds_in_place(hot)
        calls: list[Callable[[], object]] | None = []
        for kind, fn, held, slot, _, _, _ in hot:
            if kind == _BOUND and calls is not None:
                calls.append(bare(fn))           # hot holds fn itself
            elif kind == _HELD and calls is not None:
                calls.append(functools.partial(_held_run, bare(fn), held, self._values, slot))
            else:
                calls = None
        self._calls = None if calls is None else tuple(calls)
        if len(self._threads) >= _THREADS_BOUND:
            self._threads.clear()
        self._bound_on = _get_ident()
        self._threads[self._bound_on] = (hot, self._calls, self._moving)
        self._direct = self._plan_direct()

    def _feeds_in_place(self, hot: list[_HotStep]
                        ) -> tuple[tuple[int, Any, tuple[Callable[[Any], None], ...]], ...]:
        """The staged feeds that the steady run reads where the caller has them: those of
        at least the bytes every reading step's backend says (``Backend.feed_in_place``;
        the cpu planner's rule and reason), read only as the first input of bound calls
        that can move it (a ``reading()`` of theirs). Those steps in ``hot`` become the
        moving calls, still reading the feed's buffer until a run moves them."""
        moving = []
        for slot, buf in self._staged:
            readers = [i for i, st in enumerate(self._steps) if slot in st.inputs]
            least = min((self._backends[self._steps[i].backend].feed_in_place()[0]
                         for i in readers), default=0)
            if not least or buf.nbytes < least or any(
                    hot[i][0] not in (_BOUND, _HELD) or self._steps[i].inputs.count(slot) != 1
                    or self._steps[i].inputs[0] != slot for i in readers):
                continue
            found = [_reading(hot[i][1], buf) for i in readers]
            calls = [call for call in found if call is not None]
            points = tuple(call.point for call in calls if call.point is not None)
            if len(points) != len(readers):
                continue
            for i, call in zip(readers, calls, strict=True):
                hot[i] = (hot[i][0], call, *hot[i][2:])
            moving.append((slot, buf, points))
        return tuple(moving)

    def _hot_step(self, step: _Step) -> _HotStep:
        if step.kind != "kernel":
            return (_OTHER, None, None, None, _nothing, (), None)
        ins = tuple(self._none_slot if i < 0 else i for i in step.inputs)
        get: Callable[[list[Any]], Sequence[Any]]
        if len(ins) == 1:
            get = operator.itemgetter(slice(ins[0], ins[0] + 1))     # a one-item list
        elif ins:
            get = operator.itemgetter(*ins)                          # a tuple
        else:
            get = _nothing
        if step.sized:
            return (_OTHER, None, None, None, _nothing, (), None)   # size checked first
        if step.out is None:
            slots = tuple(self._trash_slot if o < 0 else o for o in step.outputs)
            if step.memo is not None:
                return (_MEMO, step.fn, step.ctx, step.attrs, get, slots,
                        (step.memo, step.op == Op.SHAPE.value))
            return (_ALLOC, step.fn, step.ctx, step.attrs, get, slots, None)
        fresh = {pos for pos, _, _ in step.fresh}
        if any(b is None for i, b in enumerate(step.out) if i not in fresh):
            return (_OTHER, None, None, None, _nothing, (), None)   # not bound yet
        if step.fresh:
            empty = self._backends[step.backend].xp.empty
            if len(step.out) == 1:
                (_, shape, dtype), = step.fresh
                held = self._held_call(step, shape, dtype)
                if held is not None:
                    return (_HELD, held[0], held[1], step.outputs[0], _nothing, (), None)
                return (_FRESH1, step.fn, step.ctx, step.attrs, get,
                        (step.outputs[0], shape, dtype, empty), step.out)
            spec = tuple((pos, step.outputs[pos], shape, dtype, empty)
                         for pos, shape, dtype in step.fresh)
            return (_FRESH, step.fn, step.ctx, step.attrs, get, spec, step.out)
        bound = None if step.out is None else self._bound_call(step, step.out)
        if bound is not None:
            return (_BOUND, bound, None, None, _nothing, (), None)
        kind = _VIEW1 if len(step.out) == 1 else _VIEWS
        return (kind, step.fn, step.ctx, step.attrs, get, step.outputs, step.out)

    def _held_call(self, step: _Step, shape: tuple[int, ...],
                   dtype: Any) -> tuple[Callable[[], object], Any] | None:
        """(bound call, the buffer it writes) for a step making one small graph output:
        each run copies the buffer out (the caller keeps what it gets)."""
        if math.prod(shape) * np.dtype(dtype).itemsize > \
                self._backends[step.backend].staging()[1]:
            return None
        held = np.empty(shape, dtype)
        bound = self._bound_call(step, [held])
        return None if bound is None else (bound, held)

    def _bound_call(self, step: _Step, out: list[Any]) -> Callable[[], object] | None:
        """The step's kernel bound to its arrays, where every one of them stays put from
        run to run (arena views, weights, staged feeds' buffers) and the variant binds
        (``KernelVariant.bind``)."""
        bind = None if step.variant is None else step.variant.bind
        if bind is None or step.ctx is None or \
                self._backends[step.backend].device.value != HOST:
            return None
        values, staged = self._values, dict(self._staged)
        if any(i >= 0 and i not in self._views and i not in self._constants
               and i not in staged for i in step.inputs):
            return None
        try:
            return bind(step.ctx, [None if i < 0 else staged.get(i, values[i])
                                   for i in step.inputs], step.attrs, out)
        except Exception:          # not bound: the kernel runs (and raises) as usual
            return None

    def _backend_on(self, device: str) -> Backend:
        for backend in self._backends.values():
            if backend.device.value == device:
                return backend
        raise ExecutionError(f"no backend of this program runs on device {device!r}")

    def __repr__(self) -> str:
        return f"<Program {self.graph_name!r}: {len(self._steps)} steps>"


def _remembered(fn: Any, ctx: Any, ins: Sequence[Any], attrs: Any,
                memo: tuple[dict[Any, tuple[Any, ...]], bool]) -> Sequence[Any]:
    """A shape-arithmetic step's results: remembered for the same input values (for
    Shape, the same input shape), computed and remembered otherwise."""
    kept, of_shape = memo
    key = (ins[0].shape,) if of_shape else _value_key(ins)
    hit = None if key is None else kept.get(key)
    if hit is not None:
        return hit
    results = tuple(fn(ctx, ins, attrs, None))
    if key is not None:
        for r in results:
            if isinstance(r, np.ndarray):
                r.setflags(write=False)       # later runs read the same arrays
        if len(kept) >= _MEMO_SIZE:
            kept.clear()
        kept[key] = results
    return results


def _value_key(ins: Sequence[Any]) -> tuple[Any, ...] | None:
    """The inputs' values as a key (None when one is not a small host array)."""
    key: list[Any] = []
    for a in ins:
        if a is None:
            key.append(None)
        elif type(a) is not np.ndarray or a.size > _MEMO_KEY_ELEMENTS:
            return None
        else:
            key.append((a.shape, a.dtype.char, a.tobytes()))
    return tuple(key)


_get_ident = threading.get_ident


def _nothing(values: list[Any]) -> Sequence[Any]:
    return ()


def _reading(call: Any, buffer: Any) -> BoundCall[Any] | None:
    """``call``'s step as a call that moves its first input, ``buffer`` (a
    :class:`BoundCall`'s ``reading``), with its ``point``; None where it has none."""
    if not isinstance(call, BoundCall) or call.reading is None:
        return None
    moving = call.reading(buffer)
    return None if moving is None or moving.point is None else moving


def _first_step(calls: Sequence[Callable[[], object]], i: int) -> int:
    """The program step that call ``i`` of ``calls`` begins with (a joined call runs
    several: its ``parts``)."""
    return sum(c.parts if isinstance(c, BoundCall) else 1 for c in calls[:i])


def _direct_runner(program: Program,
                   feeds: tuple[tuple[Any, tuple[Callable[[Any], None], ...]], ...],
                   calls: tuple[Callable[[], object], ...], outputs: tuple[tuple[str, Any], ...],
                   quiet: bool) -> Callable[[Sequence[Any]], dict[str, Any]]:
    """``program``'s steady run (:meth:`Program._plan_direct_run`) with everything it
    touches bound as locals: a run is a few bytecodes around the calls, which matters at
    batch 1, where the calls themselves take 20-150 us. ``feeds``: each feed's buffer and
    the ``point`` of every call that reads it in place (none: it is copied into the
    buffer); a feed not C-contiguous and aligned, or not of its buffer's dtype and
    shape, is copied and read there. ``quiet``:
    the calls run under the quiet FP state (where some of them run NumPy).

    After a product that passes a model's weights through the L2, each Python operation
    between and after the calls costs microseconds (docs/performance.md, "Where the
    MLP's run goes"), so a run does as little as it can around them: it calls each
    bound call's function itself (:func:`bare`)."""
    name, held = outputs[0] if len(outputs) == 1 else ("", None)
    fns = tuple(bare(call) for call in calls)     # ``calls`` holds what they point into
    parks = program._parks
    owner = weakref.ref(program)        # the program holds this function: no cycle
    state, made = _FP_STATE, _Quiet._made        # _Quiet's work, without its calls

    def run(arrays: Sequence[Any]) -> dict[str, Any]:
        for (buf, points), array in zip(feeds, arrays, strict=True):
            if not points:
                np.copyto(buf, array)
                continue
            flags = array.flags
            if not (flags.c_contiguous and flags.aligned) or array.dtype != buf.dtype \
                    or array.shape != buf.shape:
                np.copyto(buf, array)
                array = buf
            for point in points:
                point(array)
        token = None
        if quiet:
            current = state.get()
            ignoring = made.get(current)
            token = state.set(_Quiet.ignoring(current) if ignoring is None else ignoring)
        i = 0
        try:
            for i, fn in enumerate(fns):          # noqa: B007 - i names a failing step
                fn()
            if held is not None:
                return {name: held.copy()}
            return {name: buf.copy() for name, buf in outputs}
        except KeelError as exc:
            _note(exc, _alive(owner)._steps[_first_step(calls, i)])
            raise
        except PartFailed as exc:
            step = _first_step(calls, i) + exc.part
            if isinstance(exc.error, KeelError):
                _note(exc.error, _alive(owner)._steps[step])
                raise exc.error from exc.error.__cause__
            raise _alive(owner)._failed(step, exc.error) from exc.error
        except Exception as exc:
            raise _alive(owner)._failed(_first_step(calls, i), exc) from exc
        finally:
            if token is not None:
                state.reset(token)
            if parks:
                _alive(owner)._park_workers()
    return run


def _alive(owner: weakref.ref[Program]) -> Program:
    """The program a run function belongs to (alive while it runs: its caller holds it)."""
    program = owner()
    assert program is not None
    return program


def _readable_in_place(value: Any, buf: np.ndarray) -> bool:
    """Whether calls bound to ``buf`` may read ``value`` instead: a C-contiguous aligned
    array of its dtype and shape."""
    if type(value) is not np.ndarray:
        return False
    flags = value.flags
    return bool(flags.c_contiguous and flags.aligned and value.dtype == buf.dtype
                and value.shape == buf.shape)


def _held_run(call: Callable[[], object], held: Any, values: list[Any], slot: int) -> None:
    """A bound call writing a graph output: computed into ``held``, handed out as a copy."""
    call()
    values[slot] = held.copy()


def _quiet() -> Any:
    """Floating-point errors ignored, as every elementwise kernel runs them."""
    return _Quiet() if _FP_STATE is not None else np.errstate(all="ignore")


class _Quiet:
    """``np.errstate(all="ignore")`` for the price of a context variable: NumPy 2 keeps
    the floating-point error state in one, and the ignoring state made from each state
    found there is remembered (``errstate`` builds it anew on every entry, about a
    microsecond)."""

    __slots__ = ("_token",)
    _made: dict[Any, Any] = {}

    def __enter__(self) -> None:
        current = _FP_STATE.get()
        quiet = self._made.get(current)
        if quiet is None:
            quiet = self.ignoring(current)
        self._token = _FP_STATE.set(quiet)

    @classmethod
    def ignoring(cls, current: Any) -> Any:
        """The ignoring state made from ``current`` (the state now), remembered."""
        with np.errstate(all="ignore"):
            quiet = _FP_STATE.get()
        if len(cls._made) >= 8:
            cls._made.clear()
        cls._made[current] = quiet
        return quiet

    def __exit__(self, *exc: object) -> None:
        _FP_STATE.reset(self._token)


def _scope(backend: Backend, steps: list[_Step]) -> ProgramScope | None:
    """The scope a program enters on ``backend`` around each run: the BLAS threads placement
    decided (every node plan on a backend carries the same ``blas_threads``, set only where
    some step needs the scope), else the backend's own scope (None: nothing to enter)."""
    plans = {(s.ctx.plan.blas_threads, s.ctx.plan.reason("blas_threads"))
             for s in steps if s.ctx is not None and s.ctx.plan is not None}
    if len(plans) == 1:
        threads, reason = next(iter(plans))
        if threads is not None:
            return backend.planned_scope(threads, reason)
    return backend.program_scope((s.variant, s.dtype, s.work) for s in steps if s.variant)


def _exit_scopes(scopes: list[Any]) -> None:
    for scope in reversed(scopes):
        scope.__exit__(None, None, None)


def _note(exc: KeelError, step: _Step) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(f"in node {step.name!r} ({step.op}) on {step.backend}")


def _failure(exc: Exception, step: _Step, backend: Backend | None = None
             ) -> ExecutionError | MemoryLimitError:
    """A kernel's exception as keel's error, naming the backend it ran on
    (``backend_name``: an auto-placed model falls back to the cpu on a device's)."""
    error: ExecutionError | MemoryLimitError
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        free = None if backend is None else backend.free_memory()
        where = "" if free is None else f"; {format_bytes(free)} free on {step.backend}"
        error = MemoryLimitError(f"{step.op} on {step.backend} in node {step.name!r} ran out "
                                 f"of memory: {exc}{where}")
    else:
        error = ExecutionError(f"{step.op} on {step.backend} failed: {type(exc).__name__}: "
                               f"{exc}", node=step.name)
    error.backend_name = step.backend   # type: ignore[union-attr]
    return error


def _owns(array: Any) -> bool:
    """True for an array that owns its memory (a kernel's fresh result)."""
    flags = getattr(array, "flags", None)
    return getattr(array, "base", None) is None and bool(getattr(flags, "owndata", False))


def _owned_value(value: list[Any] | None) -> list[Any] | None:
    """A sequence (a list of fresh host arrays) or an empty optional (None) to hand out."""
    return None if value is None else [np.array(a, copy=True) for a in value]


def _dtype_of(value: Any) -> Any:
    return getattr(value, "dtype", None)


# ---- compiling -------------------------------------------------------------
def compile_program(
    graph: Graph,
    plan: ExecutionPlan,
    types: Mapping[str, TensorType | None],
    backends: Mapping[str, Backend],
    pool: ArenaPool | None = None,
    *,
    shape_generic: bool = False,
    values: Mapping[str, Any] | None = None,
    registry: Any = None,
    dynamic: bool = False,
) -> Program:
    """Bind ``plan`` (made by ``place`` for ``types``) to kernels and arena views.

    ``shape_generic``: ``plan`` was placed without sizes (symbolic input shapes) and has
    no memory plan; the program runs feeds of any shape that fits the graph's declared
    inputs, every kernel allocating its outputs.

    ``values``: values of this signature known before running (shape inference's
    propagated constants: shapes, their arithmetic, masks made from them). A host node
    whose every output is among them does not run; its outputs are held as constants.

    The subgraphs of control-flow nodes are compiled too, each into programs of its
    own placed on ``registry`` (default: keel's); see :mod:`keel.execution.control`.
    ``dynamic`` compiles for inputs whose dimensions ``types`` leave unknown (values
    then allocate as they run): what a loop body whose shapes keep changing gets.
    """
    pool = pool or ArenaPool()
    b = _Builder(graph, plan, types, backends, pool, shape_generic=shape_generic,
                 values=values)
    b.registry, b.dynamic = registry, dynamic
    b.build()
    program = Program(
        graph=graph, plan=plan, steps=b.steps, slots=b.slots, constants=b.constants,
        backends=b.used, pool=pool, views=b.views,
        input_types=b.input_types, outputs=b.outputs, optional=b.optional,
        shape_generic=shape_generic, known=b.known,
    )
    program.dynamic = dynamic
    if dynamic:
        program._schedule = None
    return program


class _Builder:
    def __init__(self, graph: Graph, plan: ExecutionPlan,
                 types: Mapping[str, TensorType | None], backends: Mapping[str, Backend],
                 pool: ArenaPool, *, shape_generic: bool = False,
                 values: Mapping[str, Any] | None = None) -> None:
        self.graph, self.plan, self.types, self.backends = graph, plan, types, backends
        self.values = values or {}
        self.known: dict[str, int] = {}           # outputs of nodes that do not run
        # Shape-generic: values computed from shapes and constants alone.
        self.shape_derived = {n for n in graph.initializers if graph.is_constant(n)} \
            if shape_generic else set()
        self.pool = pool
        self.shape_generic = shape_generic
        self.memory = None if shape_generic else plan.memory_plan
        self.slots: dict[str, int] = {}
        self.constants: dict[int, Any] = {}
        self.views: dict[int, tuple[str, int, tuple[int, ...], Any]] = {}
        self.steps: list[_Step] = []
        self.used: dict[str, Backend] = {}
        self.input_types: dict[str, TensorType] = {}
        self.optional: dict[str, tuple[int, Any]] = {}
        self.outputs: list[tuple[str, int, str]] = []
        self.where: dict[str, str] = {}            # value -> device it lives on
        self.graph_outputs = set(graph.output_names)
        self.registry: Any = None                  # places subgraphs (None: keel's registry)
        self.dynamic = False                       # inputs may have unknown dimensions

    def slot(self, name: str) -> int:
        if not name:
            return _ABSENT
        return self.slots.setdefault(name, len(self.slots))

    def build(self) -> None:
        self._inputs()
        placements = {p.name: p for p in self.plan.nodes}
        for node in self.graph.nodes:
            placed = placements.get(node.name)
            if placed is None:
                raise ExecutionError(f"node {node.name!r} has no placement in the plan")
            self._copies_before(node.name)
            self._node(node, placed)
        self._copies_before("")
        for name in self.graph.output_names:
            device = self.where.get(name, HOST)
            if any(c.before == "" and c.value == name for c in self.plan.copies):
                device = HOST
            self.outputs.append((name, self.slot(name), device))

    def _inputs(self) -> None:
        for v in self.graph.inputs:
            t = self.types.get(v.name) or v.type
            if not t.is_static and t.is_tensor and not self.dynamic and not self.shape_generic:
                raise InvalidArgumentError(
                    f"input {v.name!r} has no static shape ({t}); compile needs one signature")
            self.input_types[v.name] = t
            self.slot(v.name)
            self.where[v.name] = HOST
        for name, value in self.graph.initializers.items():
            if name in self.input_types:          # a graph input with a default value
                del self.input_types[name]
                self.optional[name] = (self.slot(name), value)
            else:
                self.constants[self.slot(name)] = value
            self.where[name] = HOST

    def backend(self, name: str) -> Backend:
        backend = self.backends.get(name)
        if backend is None:
            raise ExecutionError(f"backend {name!r} of the plan was not given to compile")
        self.used[name] = backend
        return backend

    def _copies_before(self, before: str) -> None:
        for c in self.plan.copies:
            if c.before != before or c.dst == c.src:
                continue
            src = None if c.src == HOST else self._device_backend(c.src)
            dst = None if c.dst == HOST else self._device_backend(c.dst)
            self.steps.append(_Step(f"copy:{c.target}", "copy", c.dst, "copy",
                                    (self.slot(c.value),), (self.slot(c.target),),
                                    src=src, dst=dst))
            self.where[c.target] = c.dst

    def _device_backend(self, device: str) -> Backend:
        for p in self.plan.nodes:
            if p.device == device:
                return self.backend(p.backend)
        raise ExecutionError(f"no backend of the plan runs on device {device!r}")

    def _input_slot(self, name: str, device: str) -> int:
        if not name:
            return _ABSENT
        copied = f"{name}@{device}"
        if copied in self.slots:
            return self.slots[copied]
        if self.graph.is_constant(name) and device != HOST:
            # Weights are loaded once onto every device that reads them.
            slot = self.slot(copied)
            self.constants[slot] = self._device_backend(device).to_device(
                self.graph.initializers[name])
            return slot
        return self.slot(name)

    def _node(self, node: Any, placed: NodePlacement) -> None:
        backend = self.backend(placed.backend)
        inputs = tuple(self._input_slot(i, placed.device) for i in node.inputs)
        outputs = tuple(self.slot(o) for o in node.outputs)
        for o in node.outputs:
            if o:
                self.where[o] = placed.device
        if self._is_known(node, placed, outputs) or self._is_free_view(node):
            return
        kernel = backend.kernels.get(node.op, placed.variant)
        # The node's plan is bound here, once: the kernel reads ctx.plan, nothing per run.
        ctx = dataclasses.replace(backend.context(), plan=placed.plan)
        if kernel.prepack is not None and _keeps_packed(placed.plan):
            ctx = self._prepacked(node, kernel, backend, ctx, inputs)
        attrs = node.attrs
        if node.op in OpGroup.CONTROL_FLOW:         # subgraphs: compiled bodies the kernel runs
            from keel.execution.control import bind_bodies

            attrs = bind_bodies(node, self.types, self.plan, self.registry, self.pool)
        step = _Step(node.name, node.op.value, backend.name, "kernel", inputs, outputs,
                     fn=kernel.fn, ctx=ctx, attrs=attrs, variant=kernel,
                     dtype=self._dtype(node.inputs[0] if node.inputs else ""),
                     work=estimated_work(self.types.get, node))
        if placed.writes_out:
            self._bind_outputs(step, node, placed)
        if self.shape_generic and self._is_shape_arithmetic(node, placed):
            step.memo = {}
        if step.out is None and node.op in SIZED_BY_VALUES:
            t = self.types.get(node.outputs[0])
            step.sized = 8 if t is None else max(1, t.dtype.numpy.itemsize)
        self.steps.append(step)

    def _dtype(self, name: str) -> DType | None:
        t = self.types.get(name) if name else None
        return None if t is None else t.dtype

    def _prepacked(self, node: Any, kernel: KernelVariant, backend: Backend,
                   ctx: KernelContext, inputs: tuple[int, ...]) -> KernelContext:
        """``ctx`` carrying the variant's prepack state for this node's constant inputs."""
        consts = [self.constants.get(slot) if slot >= 0 else None for slot in inputs]
        if all(c is None for c in consts) or kernel.prepack is None:
            return ctx
        key = (backend.name, node.name, kernel.name)
        if key not in self.pool.prepacked:
            try:
                with backend.execution_scope():
                    self.pool.prepacked[key] = kernel.prepack(ctx, consts, node.attrs)
            except KeelError as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"prepacking node {node.name!r} ({node.op.value})")
                raise
            except Exception as exc:
                raise ExecutionError(
                    f"prepacking {node.op.value} ({kernel.name}) on {backend.name} failed: "
                    f"{type(exc).__name__}: {exc}", node=node.name) from exc
        state = self.pool.prepacked[key]
        return ctx if state is None else dataclasses.replace(ctx, prepacked=state)

    def _bind_outputs(self, step: _Step, node: Any, placed: NodePlacement) -> None:
        """Give the kernel arena views (and fresh graph outputs) to write into, or nothing."""
        fresh = []
        views = {}
        for pos, name in enumerate(node.outputs):
            t = self.types.get(name)
            if t is None or not t.is_static:
                return                                       # kernel allocates
            shape = _static_shape(t)
            if name in self.graph_outputs:
                fresh.append((pos, shape, t.dtype.numpy))
                continue
            if self.memory is None or name not in self.memory:
                return
            alloc = self.memory.allocation(name)
            if alloc.pool != "arena":
                return
            views[step.outputs[pos]] = (alloc.device, alloc.offset, shape, t.dtype.numpy)
        self.views.update(views)
        step.out = [None] * len(node.outputs)
        step.fresh = tuple(fresh)

    def _is_shape_arithmetic(self, node: Any, placed: NodePlacement) -> bool:
        """A host node computing from shapes and constants alone (not a graph output):
        its results depend only on its inputs' values (Shape: on its input's shape)."""
        derived = self.shape_derived
        if node.op in (Op.SHAPE, Op.SIZE):
            ok = True
        else:
            ok = node.op in _MEMO_OPS and any(node.inputs) and \
                all(not i or i in derived for i in node.inputs)
        ok = ok and placed.device == HOST and not self.graph_outputs & set(node.outputs)
        if ok:
            derived.update(o for o in node.outputs if o)
        return ok

    def _is_known(self, node: Any, placed: NodePlacement, outputs: tuple[int, ...]) -> bool:
        """A host node whose outputs are all known values: held as constants, not run."""
        values = self.values
        if not values or placed.device != HOST or not node.outputs \
                or not all(o and o in values for o in node.outputs):
            return False
        for name, slot in zip(node.outputs, outputs, strict=True):
            value = np.asarray(values[name])
            value.setflags(write=False)
            self.constants[slot] = value
            self.known[name] = slot
        return True

    def _is_free_view(self, node: Any) -> bool:
        """A reshape-like node whose output already shares its input's arena bytes."""
        if node.op not in VIEW_OPS or self.memory is None or len(node.outputs) != 1:
            return False
        out = node.outputs[0]
        src = node.inputs[0] if node.inputs else ""
        if out not in self.memory or src not in self.memory:
            return False
        a = self.memory.allocation(out)
        if a.shares != src or a.pool != "arena" or self.slots.get(src) not in self.views:
            return False            # the input's bytes must really be in the arena
        t = self.types.get(out)
        if t is None or not t.is_static:
            return False
        self.views[self.slot(out)] = (a.device, a.offset,
                                      _static_shape(t),
                                      t.dtype.numpy)
        return True


def _static_shape(t: TensorType) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape or () if isinstance(d, int))


def _keeps_packed(plan: Any) -> bool:
    """Whether the node's plan lets its kernel keep a packed copy of constant inputs (a
    low-memory plan does not: the kernel then packs per call)."""
    return plan is None or bool(plan.option("prepack", True))
