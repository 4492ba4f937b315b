"""The Model API: load a model, then predict, run (onnxruntime style), plan, explain.

``load_model`` reads an ONNX file, bytes, an ``onnx.ModelProto`` or a
``.keel`` file, optimizes the graph and plans it for a first input signature
(symbolic dimensions taken as 1) so that ``model.plan`` and
``model.explain()`` answer before anything runs. Each new input signature is
planned and compiled once and cached.

Weights are frozen (read-only) at load, so kernels may cache what they derive
from them. ``predict`` checks its feeds once: a call whose feeds match a
signature already run (same names, exact dtypes, NumPy arrays of the same
shapes and strides, which were C-contiguous then) goes straight to that
signature's program.

Every signature also gets an adaptive plan (seed 003), made before running
from the dtype mix, where the inputs live, the performance hint, a telemetry
snapshot taken then and the runtime history of this model on this machine.
A memory limit is checked before running: when the whole batch does not fit,
the batch is split into chunks along its first axis (the planner may shrink or
grow chunks at chunk boundaries, never in the middle of one); when not even
one item fits, ``MemoryLimitError`` states the peak the plan needs. Under the
``throughput`` hint a batch is split into sub-batches run concurrently on
separate programs and thread groups, written into one set of outputs.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from keel._files import check_path, safe_file_name
from keel._fork import renew_after_fork, reset_after_fork
from keel._gc import pausing
from keel.backends import planner_constants
from keel.backends.base import Backend, DeviceKind
from keel.backends.gpu.io import as_device_array, is_device_array
from keel.backends.registry import BackendRegistry, default_registry
from keel.config import (
    BACKEND_NAMES,
    PRECISIONS,
    cache_dir,
    format_bytes,
    format_limit,
    parse_bytes,
    settings,
)
from keel.dtypes import DType
from keel.errors import (
    BackendSelectionError,
    ExecutionError,
    InvalidArgumentError,
    KeelError,
    MemoryLimitError,
)
from keel.execution import plan_cache as _plan_cache
from keel.execution.compiled import CompiledModel
from keel.execution.program import ArenaPool, Profiler, Program, compile_program
from keel.graph.ir import Graph, Value
from keel.ops.registry import OpGroup
from keel.ops.types import TensorInfo, TensorType, ValueKind
from keel.planning import trials
from keel.planning.adaptive import AdaptivePlan, AdaptivePlanner, PlanRequest, check_hint
from keel.planning.plans import HOST, ExecutionPlan, precision_name
from keel.planning.runtime_plan import low_memory_mode

if TYPE_CHECKING:
    from keel.execution.tuning import TuneReport

__all__ = ["OPTIMIZATION_LEVELS", "Model", "TensorInfo", "load_model"]

OPTIMIZATION_LEVELS = ("none", "basic", "extended", "all")
_CACHE_SIZE = 8
# A signature gets a plan of its own (sizes known: kernels chosen for them, intermediates
# in the arena) when it is among the model's first few or when it recurs. A model whose
# shapes keep changing (a decode loop, its cache longer every step) runs the other
# signatures on one shape-generic program, planned once without sizes, instead of
# inferring shapes, placing and compiling again for each.
_FIRST_SIGNATURES = 2          # distinct signatures planned as they come
_OWN_PLAN_AT = 3               # the run of a later signature that plans it for itself
_GENERIC = ("shape-generic",)  # the cache key of the shape-generic plan
_FLOATS = {"fp16": DType.FLOAT16, "bf16": DType.BFLOAT16, "fp32": DType.FLOAT32,
           "fp64": DType.FLOAT64}

Shapes = dict[str, tuple[int, ...]]
# A signature already run: (what ``Model.plan`` reports, its program, the order of
# ``Program.input_names`` in the model's input order, or None when it is the same).
_Fast = tuple[tuple["ExecutionPlan", "AdaptivePlan | None"], "Program", list[int] | None]


@dataclass
class _Planned:
    types: dict[str, TensorType | None]
    plan: ExecutionPlan
    program: Program | None = None
    symbolic: bool = False          # planned without sizes (no peak known)
    generic: bool = False           # runs any signature (compiled without sizes)
    # Values shape inference computed for this signature (shape arithmetic): the
    # program holds them as constants instead of running the nodes that make them.
    values: dict[str, np.ndarray] = field(default_factory=dict)
    adaptive: AdaptivePlan | None = None    # the adaptive plan, for ``adaptive_key``
    adaptive_key: tuple[Any, ...] = ()
    shown: ExecutionPlan | None = None      # ``plan`` with the adaptive plan's reasons


@pausing
def load_model(
    src: str | os.PathLike[str] | bytes | Any,
    backend: str = "auto",
    precision: str = "auto",
    memory_limit: int | str | None = None,
    optimization_level: str = "all",
    threads: int | None = None,
    *,
    registry: BackendRegistry | None = None,
    hardware: Any = None,
    policy: Any = None,
    enable_profiling: bool = False,
    hint: str | None = None,
    plan_cache: bool | None = None,
    tune: bool | float = False,
    remote: str | None = None,
) -> Model:
    """Load and plan a model from a path (``.onnx``/``.keel``), bytes or ``onnx.ModelProto``.

    ``backend="remote"`` (or :func:`set_backend`'s default) runs the model a
    ``keel serve`` instance at ``remote`` serves under the path's stem instead: a
    :class:`keel.backends.remote.RemoteModel` with the same ``inputs``, ``outputs``,
    ``predict`` and ``run``.

    ``backend`` and ``precision`` given here (else ``KEEL_BACKEND`` /
    ``KEEL_PRECISION``) are authoritative: a pinned backend that cannot run
    every node raises before anything runs. ``memory_limit`` is a byte count
    or a size such as ``"512MB"`` (else ``KEEL_MEMORY_LIMIT``). ``hint`` is a
    performance hint, ``"latency"`` or ``"throughput"`` (else the policy's
    ``hint``): it sets threads, streams and the batch split.

    ``plan_cache`` (else ``KEEL_PLAN_CACHE``, on by default): a model loaded
    before with the same bytes, options, machine and keel comes from the
    compiled-plan cache (:mod:`keel.execution.plan_cache`), skipping
    optimization and placement; a new one is stored there.
    ``tune`` (True, or a time budget in seconds) first measures the kernel
    variants of the nodes not yet measured on this machine (:meth:`Model.tune`).
    """
    if optimization_level not in OPTIMIZATION_LEVELS:
        raise InvalidArgumentError(
            f"optimization_level {optimization_level!r} is not allowed; use one of "
            f"{', '.join(OPTIMIZATION_LEVELS)}")
    if isinstance(src, (str, os.PathLike)):
        check_path(src)
        src = _drop_model(src)
    if backend == "auto" and _DEFAULT_BACKEND:
        backend, remote = _DEFAULT_BACKEND[0], remote or _DEFAULT_BACKEND[1]
    if backend == "remote":
        from keel.backends.remote import load_remote

        local = {"precision": precision != "auto", "memory_limit": memory_limit is not None,
                 "optimization_level": optimization_level != "all",
                 "threads": threads is not None, "registry": registry is not None,
                 "hardware": hardware is not None, "policy": policy is not None,
                 "enable_profiling": enable_profiling, "hint": hint is not None,
                 "tune": bool(tune)}
        given = [name for name, set_ in local.items() if set_]
        if given:
            raise InvalidArgumentError(
                f"backend='remote' runs the model where the server planned it; "
                f"{', '.join(given)} cannot apply there (set them on `keel serve`)")

        return cast("Model", load_remote(src, remote))     # same surface as a Model
    env = settings()
    options: dict[str, Any] = {
        "backend": backend if backend != "auto" else (env.backend or "auto"),
        "precision": precision if precision != "auto" else (env.precision or "auto"),
        "memory_limit": memory_limit if memory_limit is not None else env.memory_limit,
        "optimization_level": optimization_level,
        "threads": threads,
        "hint": hint,
        "tune": tune,
    }
    extra: dict[str, Any] = {"registry": registry, "hardware": hardware, "policy": policy,
                             "enable_profiling": enable_profiling}
    use_cache = env.plan_cache if plan_cache is None else bool(plan_cache)
    with planner_constants.once():  # the cache key's constants are the placement's
        return _loaded(src, options, extra, use_cache)


def _loaded(src: Any, options: dict[str, Any], extra: dict[str, Any], use_cache: bool
            ) -> Model:
    """The model of ``src``: its compiled plan from the cache where ``use_cache`` finds
    it, else read and planned (and stored)."""
    slot = _cache_lookup(src, options, extra) if use_cache else None
    if slot is not None and slot.found.compiled is not None:
        compiled = slot.found.compiled
        model = Model(compiled.graph, name=compiled.graph.name or _default_name(src),
                      compiled=compiled, **options, **extra)
        model._note(slot.found.reason)
        return model
    graph, name = _read_graph(src)
    model = Model(graph, name=name, **options, **extra, release_source=True)
    if slot is not None:
        model._note(slot.found.reason, slot.store(model))
    return model


def _drop_model(src: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """A drop directory's verified model file (``keel drop``); any other path as it is."""
    if not os.path.isdir(src):      # a model file: the drop format (yaml, hashlib) not needed
        return src
    from keel.planning.drops import drop_model_path, is_drop_dir

    if not is_drop_dir(src):
        return src
    path = drop_model_path(src)
    if not path.endswith(".keel"):
        raise InvalidArgumentError(
            f"drop {os.fspath(src)!r} holds {os.path.basename(path)} for llama.cpp, which keel "
            "does not run: its flags.txt has the llama.cpp flags")
    return path


# set_backend's process-wide default for load_model: (backend, remote URL), or empty
_DEFAULT_BACKEND: list[Any] = []


def set_backend(name: str, *, remote: str | None = None) -> None:
    """The backend ``load_model`` uses when given none (seed 004's ``set_backend``):
    ``"auto"`` (back to ``KEEL_BACKEND`` or automatic), a registered backend's name, or
    ``"remote"`` with ``remote=URL`` of a ``keel serve`` instance."""
    names = {"auto", "remote", *default_registry().names()}
    if name not in names:
        raise InvalidArgumentError(f"unknown backend {name!r}; use one of "
                                   f"{', '.join(sorted(names))}")
    if name == "remote" and not remote:
        raise InvalidArgumentError("set_backend('remote') needs remote='http://host:port'")
    _DEFAULT_BACKEND[:] = [] if name == "auto" else [name, remote]


@dataclass(frozen=True)
class _CacheSlot:
    """A model's place in the plan cache: its key (None: not cacheable) and what was there."""

    key: str | None
    found: _plan_cache.Lookup
    source: _plan_cache.ModelSource | None = None

    def store(self, model: Model) -> str:
        """Store ``model``'s compiled plan under the key; returns what the plan says of it."""
        if self.key is None or self.source is None or not self.found.storable:
            return ""
        if not self.source.unchanged():
            return "compiled plan not stored in the cache: the model file changed while loading"
        return _plan_cache.store(self.key, model._compiled())


def _cache_lookup(src: Any, options: Mapping[str, Any], extra: Mapping[str, Any],
                  ) -> _CacheSlot:
    """The model's cache key and what the plan cache holds under it."""
    if extra["registry"] is not None:
        return _CacheSlot(None, _plan_cache.Lookup(None, "plan cache not used: a registry was "
                                                         "given (its backends cannot be keyed)"))
    policy = extra["policy"]
    if policy is not None and not hasattr(policy, "to_dict"):
        return _CacheSlot(None, _plan_cache.Lookup(None, "plan cache not used: the policy "
                                                         "cannot be keyed"))
    source = _plan_cache.ModelSource(src)
    digest = source.digest()
    if digest is None:
        return _CacheSlot(None, _plan_cache.Lookup(None))
    limit = options["memory_limit"]
    keyed = {**options, "memory_limit": None if limit is None else parse_bytes(limit),
             "policy": None if policy is None else policy.to_dict(),
             "tuning": _tuning_token()}
    registry = default_registry()
    backends = {"priority": registry.priority,
                "available": [b.name for b in registry.available()]}
    key = _plan_cache.cache_key(digest, keyed, extra["hardware"], backends)
    found = _plan_cache.lookup(key)
    # The key covers the model's bytes, not external weight files: such a model is never
    # stored (so never found).
    if found.compiled is None and source.may_use_external_data():
        return _CacheSlot(None, _plan_cache.Lookup(None, "plan cache not used: the model may "
                                                         "keep weights in external files"))
    return _CacheSlot(key, found, source)


def _tuning_token() -> str:
    """What ``keel tune`` measured on this machine (a plan made before a tune is stale after):
    ``untuned`` while the tuning cache's folder holds no file, without loading
    :mod:`keel.planning.tuning` (and what it imports) to say so."""
    try:
        measured = any(n.endswith(".json") for n in os.listdir(cache_dir() / "tuning"))
    except OSError:
        measured = False
    if not measured:
        return "untuned"
    from keel.planning.tuning import cached

    return str(cached().token)


def _default_name(src: Any) -> str:
    """A model's name when its graph has none: the file's stem, else ``model``."""
    if isinstance(src, (str, os.PathLike)):
        return os.path.splitext(os.path.basename(os.fspath(src)))[0]
    return "model"


def _read_graph(src: Any) -> tuple[Graph, str]:
    if isinstance(src, Graph):
        # The model freezes its weights: copy the caller's writable ones first.
        graph = src.copy()
        graph.initializers = {k: (v if not isinstance(v, np.ndarray) or _is_frozen(v)
                                  else np.array(v, copy=True))
                              for k, v in graph.initializers.items()}
        return graph, src.name
    from keel.formats.keel_format import is_keel_file, load_keel

    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        keel_file = path.endswith(".keel") or (os.path.isfile(path) and is_keel_file(path))
        graph = load_keel(path) if keel_file else _import_onnx(path)
        return graph, graph.name or _default_name(src)
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        graph = load_keel(data) if is_keel_file(data) else _import_onnx(data)
        return graph, graph.name or _default_name(src)
    if type(src).__name__ == "ModelProto":
        graph = _import_onnx(src)
        return graph, graph.name or _default_name(src)
    raise InvalidArgumentError(
        f"a model is a path (.onnx or .keel), bytes or onnx.ModelProto; got "
        f"{type(src).__name__}")


def _order_notes(graph: Graph) -> list[str]:
    """The graph passes' moves of nodes out of the imported order, with their reasons."""
    from keel.graph.passes.order_shared_reads import ORDER_KEY

    return [f"node order: {line}" for line in graph.metadata.get(ORDER_KEY, "").splitlines()]


def _optimize(graph: Graph, level: str) -> Graph:
    """The graph passes, imported when a model is optimized (not one from the plan cache)."""
    from keel.graph.passes import optimize

    return optimize(graph, level)


def _import_onnx(src: Any) -> Graph:
    """The ONNX importer, imported when a model is ONNX (a ``.keel`` load never needs it)."""
    from keel.graph.importers.onnx import import_onnx as imported

    return imported(src)


class Model:
    """A loaded, optimized model; plans and programs per input signature."""

    def __init__(self, graph: Graph, *, name: str = "", backend: str = "auto",
                 precision: str = "auto", memory_limit: int | str | None = None,
                 optimization_level: str = "all", threads: int | None = None,
                 registry: BackendRegistry | None = None, hardware: Any = None,
                 policy: Any = None, enable_profiling: bool = False,
                 hint: str | None = None,
                 compiled: CompiledModel | None = None,
                 tune: bool | float = False, release_source: bool = False) -> None:
        """``compiled`` (from the plan cache) holds ``graph`` already optimized for these
        options, the model's declared inputs and outputs and its first plan.
        ``release_source``: ``graph`` is nobody else's (``load_model``'s own import), so
        its node list is let go once the optimized graph exists: a large graph's two
        versions are not both held while the model is planned."""
        if compiled is None:
            self.input_names = list(graph.input_names)     # graph order, optional ones included
            self._declared_inputs = [v for v in graph.inputs if v.name not in graph.initializers]
            self._declared_outputs = list(graph.outputs)
        else:
            self.input_names = list(compiled.input_names)
            self._declared_inputs = list(compiled.inputs)
            self._declared_outputs = list(compiled.outputs)
        self.name = name or graph.name or "model"
        self.optimization_level = optimization_level
        self._registry = _with_threads(registry or default_registry(), threads, hardware)
        self._hardware = hardware if hardware is not None else _probe_if_gpu(self._registry)
        self._foreign = hardware is not None     # planned for a given profile, maybe elsewhere
        self._policy = policy
        self._hint = check_hint(hint if hint is not None
                                else getattr(policy, "hint", None) or settings().hint)
        self._threads = threads
        self._backend = _check_backend(backend)
        self._device_fault = ""         # why a device failed at run time ("" while none did)
        # signature -> (backend measured fastest for it, the reason); see _measure_devices
        self._trials: dict[tuple[Any, ...], tuple[str, str] | None] = {}
        self._trial_gpu: str | None = None      # the GPU backend trials use ("": none)
        # precision="auto" on a GPU: the fp16 model runs instead where it was validated
        self._half: Model | None = None
        self._half_reason = ""              # why fp16/bf16 was or was not taken ("": untried)
        self._precision = _check_precision(precision)
        self._graph = _freeze_constants(graph if compiled is not None else _convert_precision(
            _optimize(graph, optimization_level), self._precision))
        if release_source and self._graph is not graph:
            graph.nodes, graph.value_types = [], {}     # rebound: shared nodes stay intact
        self._memory_limit = None if memory_limit is None else parse_bytes(memory_limit)
        self._cache: collections.OrderedDict[tuple[Any, ...], _Planned] = \
            collections.OrderedDict()
        self._pool = ArenaPool()
        self._pool.limit = self._memory_limit
        self._lock = threading.RLock()
        renew_after_fork(self, "_lock")             # free in a child forked mid-predict
        reset_after_fork(self, Model._drop_streams)
        self._planner = AdaptivePlanner()
        self._runs: dict[tuple[Any, ...], int] = {}     # runs of each unplanned signature
        self._telemetry: Callable[[], Any] | None = self._snapshot
        self._history: Any = None                # a RuntimeHistory, made when first needed
        self._streams: _Streams | None = None
        self._profiler: Profiler | None = Profiler() if enable_profiling else None
        self._last: tuple[ExecutionPlan, AdaptivePlan | None] | None = None
        # Signatures already checked: (shape, strides) of each feed, in _fast_names
        # order -> (what ``plan`` reports, the program, its feed order or None).
        self._fast: dict[tuple[Any, ...], _Fast] = {}
        self._fast_names = tuple(v.name for v in self._declared_inputs)
        self._fast_dtypes = tuple(v.type.dtype.numpy for v in self._declared_inputs)
        # Only where no dtype conversion happens at the edges (precision="auto").
        self._fast_ok = _keeps_dtypes(self._graph, self._declared_inputs,
                                      self._declared_outputs)
        if compiled is not None:
            self._restore(compiled)
        if tune is not False:
            self.tune(budget_s=None if tune is True else tune)
        self._check_default_plan()

    # ---- description -----------------------------------------------------
    @property
    def inputs(self) -> list[TensorInfo]:
        """The inputs a caller must feed (inputs with a default initializer are left out)."""
        return [TensorInfo(v.name, v.type.shape, v.type.dtype, v.type.kind)
                for v in self._declared_inputs]

    @property
    def outputs(self) -> list[TensorInfo]:
        return [TensorInfo(v.name, v.type.shape, v.type.dtype, v.type.kind)
                for v in self._declared_outputs]

    @property
    def graph(self) -> Graph:
        """The optimized graph this model runs (do not modify)."""
        return self._graph

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def precision(self) -> str:
        return self._precision

    @property
    def memory_limit(self) -> int | None:
        return self._memory_limit

    @property
    def plan(self) -> ExecutionPlan:
        """The plan of the last run, or of the first signature (symbolic dims as 1)."""
        if self._half is not None:
            return self._half.plan
        with self._lock:
            if self._last is None:
                planned = self._default_planned()
                self._last = (self._shown(planned), planned.adaptive)
            return self._last[0]

    @property
    def adaptive_plan(self) -> AdaptivePlan | None:
        """The adaptive plan (seed 003) behind ``plan``: runtime, precision plan, hint,
        streams, chunks, telemetry and reasons; None for a plan made without sizes."""
        with self._lock:
            self.plan  # noqa: B018 - makes the default plan when nothing ran yet
            return None if self._last is None else self._last[1]

    @property
    def hint(self) -> str:
        """The performance hint: ``none``, ``latency`` or ``throughput``."""
        return self._hint

    def explain(self) -> str:
        """Per-node backend, variant, layout, threads, precision and reason; copies; peak
        memory; every node plan's fields with their reasons; once the plan has run, how
        its program sized the BLAS threads and why."""
        half = self._half
        if half is not None:
            return f"{self._half_reason}\n{half.explain()}"
        plan = self.plan
        limit = "none" if self._memory_limit is None else format_limit(self._memory_limit)
        shapes = ", ".join(f"{k}={v}" for k, v in plan.input_shapes.items()) or "none"
        head = [
            f"model {self.name!r}: backend {self._backend}, precision {self._precision}, "
            f"optimization {self.optimization_level}, memory limit {limit}",
            f"planned for input shapes {shapes}",
        ]
        if self._half_reason:
            head.append(self._half_reason)
        head += _order_notes(self.graph)
        adaptive = self.adaptive_plan
        if adaptive is not None:
            head.append(_describe_adaptive(adaptive))
        # How a compiled program sized its backends' thread pools (known once it has run).
        program = next((p.program for p in self._cache.values()
                        if plan in (p.plan, p.shown) and p.program is not None), None)
        if program is not None:
            head += [f"{name} threads: {why}" for name, why in program.scope_reasons.items()]
            if program.capture_reason:
                head.append(f"device graph: {program.capture_reason}")
        # plan.table() already states the peak: the memory report adds where it lives.
        memory = "" if plan.memory_plan is None else "\n".join(
            line for line in plan.memory_plan.report().splitlines()
            if not line.startswith("peak memory"))
        return "\n".join([*head, "", plan.table(), "", memory, "", "node plans:",
                          plan.node_plans()]).rstrip() + "\n"

    def tune(self, shapes: Mapping[str, Sequence[int]] | None = None, *,
             budget_s: float | None = None, force: bool = False,
             progress: Callable[[int, int, str], None] | None = None) -> TuneReport:
        """Time the candidate kernel variants of this model's nodes here (for ``shapes``,
        else the first signature) and cache the winners; plans made from now on use them.
        Cases already measured are skipped unless ``force``. Returns a
        :class:`~keel.execution.tuning.TuneReport`; ``progress`` defaults to a bar on stderr.
        """
        from keel.execution import tuning

        budget = tuning.DEFAULT_BUDGET_SECONDS if budget_s is None else budget_s
        with self._lock, tuning.progress_bar(progress is None) as bar:
            planned = (self._default_planned() if shapes is None else
                       self._planned(self._checked_shapes(shapes)))
            backends = {name: self._registry.get(name) for name in planned.plan.backends}
            report = tuning.tune(self._graph, planned.types, planned.plan, backends,
                                 budget_s=budget, force=force, progress=progress or bar)
            self._cache.clear()
            self._fast.clear()
            self._last = None
        return report

    def _checked_shapes(self, shapes: Mapping[str, Sequence[int]]) -> Shapes:
        names = [v.name for v in self._declared_inputs]
        checked: Shapes = {}
        for name, shape in shapes.items():
            dims = tuple(shape) if isinstance(shape, (list, tuple)) else None
            if name not in names or dims is None or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
                raise InvalidArgumentError(
                    f"shape {shape!r} for {name!r}: give a tuple of non-negative ints for one "
                    f"of the inputs {', '.join(names)}")
            checked[name] = dims
        return {**self._default_shapes(), **checked}

    # ---- settings --------------------------------------------------------
    def set_memory_limit(self, limit: int | str | None) -> None:
        """Set the memory budget (bytes or ``"512MB"``; None removes it)."""
        new = None if limit is None else parse_bytes(limit)
        with self._lock:
            old = self._memory_limit
            self._memory_limit = new
            try:
                self._check_default_plan()
            except MemoryLimitError:
                self._memory_limit = old
                raise
            self._pool.clear()
            self._pool.limit = new
            self._fast.clear()
            self._streams = None
            self._last = None

    def _drop_streams(self) -> None:
        """Forget the stream workers (in a forked child: their threads did not come along);
        the next throughput run makes new ones."""
        self._streams = None

    def set_backend(self, backend: str) -> None:
        """Pin a backend (or ``"auto"``); raises before any run if it cannot run every node."""
        name = _check_backend(backend)
        with self._lock:
            old, cache = self._backend, self._cache
            self._backend, self._cache = name, collections.OrderedDict()
            try:
                self._default_planned()
            except Exception:
                self._backend, self._cache = old, cache
                raise
            self._pool.clear()
            self._fast.clear()
            self._streams = None
            self._last = None

    def set_telemetry(self, source: Callable[[], Any] | None) -> None:
        """A callable returning a telemetry snapshot, read when a signature is planned and
        at chunk boundaries (the default takes ``take_snapshot``'s; None: no telemetry)."""
        with self._lock:
            old, self._telemetry = self._telemetry, source
            for planned in self._cache.values():
                planned.adaptive, planned.shown = None, None
            self._fast.clear()
            self._last = None
            try:
                self._check_default_plan()
            except MemoryLimitError:
                self._telemetry = old
                self._check_default_plan()
                raise

    def _snapshot(self) -> Any:
        from keel.planning.telemetry import take_snapshot

        return take_snapshot(self._hardware, probe_gpus=self._hardware is not None)

    # ---- profiling -------------------------------------------------------
    def enable_profiling(self) -> None:
        """Time every node of every run from now on."""
        self._profiler = Profiler()

    @property
    def profiler(self) -> Profiler | None:
        return self._profiler

    def end_profiling(self, path: str | os.PathLike[str] | None = None) -> str:
        """Stop profiling and write the Chrome trace JSON; returns its path.

        Without ``path``: ``keel_profile_<name>.json`` in the working folder, the model's
        name made a plain file name (``../x`` cannot lead anywhere else).
        """
        if self._profiler is None:
            raise InvalidArgumentError("profiling is not enabled; call enable_profiling() first")
        target = path if path is not None else \
            f"keel_profile_{safe_file_name(self.name, 'model')}.json"
        try:
            written = self._profiler.export(target)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot write the profile to {str(target)!r}: {exc}") \
                from None
        self._profiler = None
        return written

    # ---- running ---------------------------------------------------------
    def predict(self, feeds: Mapping[str, Any], *,
                output_device: str | None = None) -> dict[str, np.ndarray]:
        """Run the model: ``{input name: array}`` → ``{output name: array}``.

        Feeds may be NumPy arrays or arrays already on a CUDA device (CuPy, torch CUDA
        tensors, anything with ``__cuda_array_interface__`` or CUDA DLPack), taken
        without a copy. ``output_device="gpu"`` returns CuPy arrays: outputs the gpu
        made stay there (copied once on the device, never through the host).
        """
        try:
            if output_device is None and self._half is None:
                # A signature already run, first: no other call between here and the run.
                result = self._run_remembered(feeds)
                if result is not None:
                    return result
                return self._predict(feeds, None, remembered=False)
            return self._predict(feeds, output_device)
        except (ExecutionError, MemoryLimitError) as exc:
            if not self._falls_back(exc):
                raise
            warnings.warn(f"keel: {exc.message}; model {self.name!r} runs on the cpu from "
                          "now on", RuntimeWarning, stacklevel=2)
        return self._predict(feeds, output_device)

    def _predict(self, feeds: Mapping[str, Any], output_device: str | None, *,
                 remembered: bool = True) -> dict[str, np.ndarray]:
        """One run; ``remembered`` False: the caller found no program remembered for
        ``feeds``' signature just now (:meth:`_run_remembered`), so it is not looked for
        again."""
        half = self._half
        if half is not None:
            try:
                return half._predict(feeds, output_device)
            except (ExecutionError, MemoryLimitError) as exc:
                self._half = None                  # back to fp32 (which may fall back too)
                self._half_reason = (f"{half.precision} dropped: it failed at run time "
                                     f"({exc.message})")
        if output_device is not None:
            return self._predict_on_device(feeds, output_device)
        result = self._run_remembered(feeds) if remembered else None
        if result is not None:
            return result
        residency = _residency(feeds)
        arrays, shapes = self._validate(feeds)
        with self._lock:
            generic = self._generic_for(shapes, residency)
            if generic is not None:
                return self._to_declared(self._run_generic(arrays, generic, residency))
            if self._trial_wanted(shapes):
                self._measure_devices(arrays, shapes)
            planned = self._planned(shapes)
            adaptive = self._adaptive_plan(shapes, planned, residency)
            if adaptive.chunked:
                result = self._run_chunked(arrays, shapes, planned, adaptive)
            elif adaptive.streams > 1:
                result = self._run_streams(arrays, shapes, planned, adaptive)
            else:
                self._last = (self._shown(planned), adaptive)
                program = self._program(planned)
                result = program.run(arrays, profiler=self._profiler)
                self._remember(arrays, planned, program)
        return self._to_declared(result)

    def _predict_on_device(self, feeds: Mapping[str, Any], device: str) -> dict[str, Any]:
        """``predict`` whose outputs are device arrays (``output_device``)."""
        if device in ("cpu", "host"):
            return self.predict(feeds)
        if device not in ("gpu", "cuda"):
            raise InvalidArgumentError(
                f"output_device must be 'cpu' or 'gpu', got {device!r}")
        try:
            import cupy
        except ImportError as exc:
            raise BackendSelectionError(
                "gpu", f"output_device='gpu' returns CuPy arrays, and CuPy is not installed "
                       f"({exc}); install it with: pip install 'keel-runtime[cuda12]'"
            ) from None

        residency = _residency(feeds)
        arrays, shapes = self._validate(feeds)
        with self._lock:
            planned = self._planned(shapes)
            adaptive = self._adaptive_plan(shapes, planned, residency)
            if adaptive.chunked or adaptive.streams > 1 or self._generic_for(
                    shapes, residency) is not None:
                result = self.predict(feeds)      # split runs: their outputs meet on the host
                return {k: cupy.asarray(v) for k, v in result.items()}
            self._last = (self._shown(planned), adaptive)
            program = self._program(planned)
            raw = program.run(arrays, device_outputs=True)
            # Copies made here, outside the program's own memory pool: the next run
            # overwrites what the program wrote, never what the caller holds.
            declared = {v.name: v.type.dtype.numpy for v in self._declared_outputs}
            return {k: (v.copy() if isinstance(v, cupy.ndarray) else cupy.asarray(v)
                        ).astype(declared[k], copy=False) for k, v in raw.items()
                    if k in declared}

    def _run_generic(self, arrays: dict[str, np.ndarray], planned: _Planned,
                     residency: str) -> dict[str, np.ndarray]:
        # Its adaptive plan (telemetry, runtime) is made once, for no particular batch:
        # with no memory limit and no throughput hint nothing is split.
        adaptive = self._adaptive_plan({}, planned, residency)
        self._last = (replace(self._shown(planned), input_shapes=_shapes(arrays)), adaptive)
        program = self._program(planned)
        # Not remembered for the fast path: each run is counted, so that a signature that
        # recurs gets its own plan.
        return program.run(arrays, profiler=self._profiler)

    def _run_remembered(self, feeds: Any) -> dict[str, np.ndarray] | None:
        """The run of the program remembered for ``feeds``' signature (:meth:`_fast_path`);
        None when there is none."""
        fast = self._fast_path(feeds)
        if fast is None:
            return None
        (last, program, _), ordered = fast
        with self._lock:
            self._last = last
            return program.execute(ordered)

    def _fast_path(self, feeds: Any) -> tuple[_Fast, Sequence[np.ndarray]] | None:
        """The remembered program and its ordered feeds when ``feeds`` match a signature
        already run: same names, exact dtypes, NumPy arrays of the same shapes and strides
        (strides that were C-contiguous for that shape then are so now)."""
        names = self._fast_names
        if type(feeds) is not dict or len(feeds) != len(names) or self._profiler is not None:
            return None
        if len(names) == 1:                     # the common case, without building lists
            a = feeds.get(names[0])
            if type(a) is not np.ndarray or a.dtype != self._fast_dtypes[0]:
                return None
            hit = self._fast.get(((a.shape, a.strides),))
            return None if hit is None else (hit, (a,))
        arrays = []
        for name, dtype in zip(names, self._fast_dtypes, strict=True):
            a = feeds.get(name)
            if type(a) is not np.ndarray or a.dtype != dtype:
                return None
            arrays.append(a)
        hit = self._fast.get(tuple((a.shape, a.strides) for a in arrays))
        if hit is None:
            return None
        order = hit[2]
        return hit, (arrays if order is None else [arrays[i] for i in order])

    def _remember(self, arrays: Mapping[str, np.ndarray], planned: _Planned,
                  program: Program) -> None:
        """Let later calls with feeds laid out as ``arrays`` (checked, C-contiguous) skip
        validation and planning."""
        names = self._fast_names
        if any(not isinstance(a, np.ndarray) for a in arrays.values()):
            return                              # a sequence or optional input: no fast path
        if not self._fast_ok or set(arrays) != set(names) or \
                set(program.input_names) != set(names):
            return
        if len(self._fast) >= _CACHE_SIZE:
            self._fast.clear()
        order = [names.index(n) for n in program.input_names]
        key = tuple((arrays[n].shape, arrays[n].strides) for n in names)
        self._fast[key] = ((self._shown(planned), planned.adaptive), program,
                           None if order == list(range(len(names))) else order)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """onnxruntime's ``InferenceSession.run``: outputs in the order asked for."""
        names = [v.name for v in self._declared_outputs]
        if output_names is not None and (isinstance(output_names, str)
                                         or not isinstance(output_names, Iterable)):
            raise InvalidArgumentError(
                f"output_names must be a list of output names or None, got "
                f"{type(output_names).__name__}; the model's outputs are: {', '.join(names)}")
        wanted = names if output_names is None else list(output_names)
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise InvalidArgumentError(
                f"unknown output {unknown[0]!r}; the model's outputs are: {', '.join(names)}")
        result = self.predict(input_feed)
        return [result[n] for n in wanted]

    async def predict_async(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """``predict`` in a worker thread, so an event loop keeps serving."""
        import asyncio  # here: asyncio (with ssl) is 8 MB a load never needs

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.predict, feeds)

    def intermediates(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Every value the graph computes (host copies), by name; for debugging and validation."""
        arrays, shapes = self._validate(feeds)
        with self._lock:
            planned = self._planned(shapes)
            values = self._program(planned).run(arrays, keep_all=True)
        from keel.backends.cpu.qlayout import in_graph_layout

        values = in_graph_layout(values, self._graph.nodes, planned.plan.nodes)
        return {k: np.asarray(v) for k, v in values.items()}

    # ---- planning --------------------------------------------------------
    def _planned(self, shapes: Shapes, keep: bool = True) -> _Planned:
        key = tuple(sorted(shapes.items()))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        from keel.graph.shape_inference import propagate

        internal = {k: v for k, v in shapes.items() if k in self._graph.input_names}
        known = propagate(self._graph, internal)
        types = known.types
        plan = self._place(types, key)
        planned = _Planned(types, plan, values=known.values)
        if not keep:            # a size the chunk planner only weighs: cached programs stay
            return planned
        self._cache[key] = planned
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return planned

    def _program(self, planned: _Planned) -> Program:
        if planned.program is None:
            backends = {name: self._registry.get(name) for name in planned.plan.backends}
            planned.program = compile_program(self._graph, planned.plan, planned.types,
                                              backends, self._pool,
                                              shape_generic=planned.generic,
                                              values=planned.values, registry=self._registry)
        return planned.program

    def _generic_for(self, shapes: Shapes, residency: str) -> _Planned | None:
        """The shape-generic plan where this signature runs on it; None: it has (or now
        gets) a plan of its own."""
        key = tuple(sorted(shapes.items()))
        if key in self._cache or self._memory_limit is not None \
                or self._hint == "throughput" or residency != "cpu":
            return None
        planned = [k for k in self._cache if k not in (_GENERIC, ("symbolic",))]
        if len(planned) < _FIRST_SIGNATURES or any(_batch_apart(key, k) for k in planned):
            return None
        if len(self._runs) >= 4 * _CACHE_SIZE * _CACHE_SIZE:
            self._runs.clear()
        runs = self._runs[key] = self._runs.get(key, 0) + 1
        if runs >= _OWN_PLAN_AT:
            del self._runs[key]
            return None
        generic = self._cache.get(_GENERIC)
        if generic is None:
            generic = self._cache[_GENERIC] = self._generic_planned()
        self._cache.move_to_end(_GENERIC)
        return generic if generic.generic else None

    def _place(self, types: Mapping[str, TensorType | None],
               key: tuple[Any, ...] | None = None) -> ExecutionPlan:
        """Place the graph for ``types``: on the host alone after a device failed here;
        on the device measured fastest for signature ``key`` when one was measured."""
        from keel.planning.placement import place  # here: a cached plan never places

        trial = None if key is None or self._device_fault else self._trials.get(key)
        if trial is not None:
            plan = place(self._graph, types, self._registry, self._hardware, self._policy,
                         backend=trial[0], precision=self._precision)
            return replace(plan, backend="auto", reasons=(
                trial[1], *(r for r in plan.reasons if not r.startswith("backend "))))
        if not self._device_fault:
            return place(self._graph, types, self._registry, self._hardware, self._policy,
                         backend=self._backend, precision=self._precision)
        plan = place(self._graph, types, self._registry, self._hardware, self._policy,
                     backend="cpu", precision=self._precision)
        return replace(plan, backend="auto", reasons=(
            f"on the cpu since a device failed at run time here: {self._device_fault}",
            *(r for r in plan.reasons if not r.startswith("backend cpu pinned"))))

    def _trial_wanted(self, shapes: Shapes) -> bool:
        """Whether this signature's device is still to be measured: auto mode with a GPU
        backend here (see ``_measure_devices``)."""
        if self._backend != "auto" or self._device_fault or self._memory_limit is not None \
                or self._foreign or not settings().placement_trials:
            return False                # (a given hardware profile: no timing here decides)
        if tuple(sorted(shapes.items())) in self._trials:
            return False
        if self._trial_gpu is None:
            self._trial_gpu = next((b.name for b in self._registry.available()
                                    if b.device is DeviceKind.GPU), "")
        return bool(self._trial_gpu) and "cpu" in self._registry.names()

    def _measure_devices(self, arrays: Mapping[str, Any], shapes: Shapes) -> None:
        """Run this signature's first inputs with every node on the GPU and with every node
        on the cpu, and keep the faster (the plan quotes both times). A device that cannot
        run the model is left out with the reason; the per-node rules stand when neither
        can run it whole."""
        key = tuple(sorted(shapes.items()))
        times: dict[str, float] = {}
        notes: list[str] = []
        kept: dict[str, _Planned] = {}
        for name in (str(self._trial_gpu), "cpu"):
            self._trials[key] = (name, "")
            self._cache.pop(key, None)
            try:
                planned = self._planned(shapes)
                times[name] = _time_call(functools.partial(self._program(planned).run,
                                                           arrays))
                kept[name] = planned
            except KeelError as exc:
                notes.append(f"{name} cannot run it whole ({exc.message})")
        self._cache.pop(key, None)
        self._trials.pop(key, None)
        if not times:
            self._trials[key] = None              # measured nothing: the per-node rules
            return
        best, reason = trials.faster_device(times, notes)
        self._trials[key] = (best, reason)
        planned = kept[best]
        planned.plan = replace(planned.plan, reasons=(
            reason, *(r for r in planned.plan.reasons[1:])))
        self._cache[key] = planned
        if best == self._trial_gpu and self._precision == "auto" and not self._half_reason:
            self._try_half(arrays, planned, times[best])

    def _try_half(self, arrays: Mapping[str, Any], planned: _Planned, fp32_time: float) -> None:
        """precision="auto" on a GPU: run the model at fp16, then (where fp16 is not within
        tolerance or cannot run) at bf16, on these inputs, and keep the first that
        :func:`keel.planning.trials.half_precision` accepts (relative L2 error within its
        tolerance, integer outputs equal, faster); the reason says why."""
        if _native_precision(self._graph) != "fp32":
            self._half_reason = "fp16 and bf16 not tried: the model does not compute in fp32"
            return
        want = self._program(planned).run(arrays)
        tried: list[trials.HalfTrial] = []
        models: dict[str, Model] = {}
        for precision in trials.HALF_PRECISIONS:
            trial = self._half_trial(precision, arrays, want, models)
            tried.append(trial)
            if not trials.try_next(trial):
                break
        taken, self._half_reason = trials.half_precision(tried, fp32_time,
                                                         str(self._trial_gpu))
        if taken is not None:
            self._half = models[taken]

    def _half_trial(self, precision: str, arrays: Mapping[str, Any], want: Mapping[str, Any],
                    models: dict[str, Model]) -> trials.HalfTrial:
        """The model at ``precision`` on the trial gpu: its error against ``want`` and its
        median time (kept in ``models``), or why it cannot run."""
        try:
            half = Model(self._graph, name=self.name, backend=str(self._trial_gpu),
                         precision=precision, optimization_level="none",
                         registry=self._registry, hardware=self._hardware,
                         policy=self._policy, hint=self._hint)
            got = half.predict(arrays)
            error = max((_relative_error(got[k], v) for k, v in want.items()), default=0.0)
            seconds = _time_call(lambda: half.predict(arrays))
        except KeelError as exc:
            return trials.HalfTrial(precision, failure=exc.message)
        models[precision] = half
        return trials.HalfTrial(precision, error, seconds)

    def _falls_back(self, exc: KeelError) -> bool:
        """After a device kernel failed at run time in auto mode: plan every signature on
        the cpu from now on, keeping the reason (``explain`` shows it). False when the
        failure is not a device's or the backend is pinned: the caller raises it."""
        name = getattr(exc, "backend_name", "")
        if self._backend != "auto" or self._device_fault or not name:
            return False
        try:
            on_device = self._registry.get(name).device.value != HOST
        except KeelError:
            return False
        if not on_device:
            return False
        self._device_fault = f"{name}: {exc.message}"
        self._cache.clear()
        self._fast.clear()
        self._pool.clear()
        self._last = None
        return True

    def _generic_planned(self) -> _Planned:
        """The plan of every signature at once: placed from the declared (symbolic) input
        types, with no memory plan. A model that cannot be planned so never uses it."""
        from keel.graph.shape_inference import infer_graph_types

        try:
            types = infer_graph_types(self._graph, {})
            plan = self._place(types)
        except KeelError:
            return _Planned({}, self._default_planned().plan)
        if any(p.device != HOST for p in plan.nodes):    # device programs keep their sizes
            return _Planned({}, self._default_planned().plan)
        reason = ("shape-generic plan: this signature is run on the plan made once without "
                  "sizes (each kernel allocates its outputs), as every signature after the "
                  f"first {_FIRST_SIGNATURES} until it recurs {_OWN_PLAN_AT} times")
        return _Planned(types, replace(plan, memory_plan=None,
                                       reasons=(*plan.reasons, reason)), generic=True)

    def _default_shapes(self) -> Shapes:
        return {v.name: tuple(d if isinstance(d, int) else 1 for d in v.type.shape or ())
                for v in self._declared_inputs}

    def _default_planned(self) -> _Planned:
        """The plan of the first signature: symbolic dimensions as 1.

        When 1 is not a valid size for some symbolic dimension (shape inference
        rejects it), the dimensions stay symbolic: placement still answers,
        sizes and peak wait for real inputs.
        """
        try:
            return self._planned(self._default_shapes())
        except InvalidArgumentError:
            key: tuple[Any, ...] = ("symbolic",)
            if key not in self._cache:
                from keel.graph.shape_inference import infer_graph_types

                types = infer_graph_types(self._graph, {})
                plan = self._place(types)
                reason = "symbolic dimensions cannot all be 1: planned without sizes"
                self._cache[key] = _Planned(
                    types, replace(plan, reasons=(*plan.reasons, reason)), symbolic=True)
            return self._cache[key]

    def _check_default_plan(self) -> None:
        """Plan the first signature now: pins and impossible limits fail at load."""
        planned = self._default_planned()
        if not planned.symbolic:
            self._adaptive_plan(self._default_shapes(), planned)

    # ---- the plan cache --------------------------------------------------
    def _restore(self, compiled: CompiledModel) -> None:
        """Take the cached plan of the first signature instead of placing it again."""
        key = ("symbolic",) if compiled.symbolic else tuple(sorted(compiled.shapes.items()))
        self._cache[key] = _Planned(dict(compiled.types), compiled.plan,
                                    symbolic=compiled.symbolic)

    def _compiled(self) -> CompiledModel:
        """What the plan cache stores for this model: its graph, interface and first plan."""
        planned = self._default_planned()
        return CompiledModel(self._graph, tuple(self.input_names),
                             tuple(self._declared_inputs), tuple(self._declared_outputs),
                             self._default_shapes(), planned.symbolic, planned.plan,
                             planned.types)

    def _note(self, *reasons: str) -> None:
        """Add what the plan cache did to the first signature's plan."""
        said = tuple(r for r in reasons if r)
        if said:
            planned = self._default_planned()
            planned.plan = replace(planned.plan, reasons=(*planned.plan.reasons, *said))
            planned.shown = None

    def _shown(self, planned: _Planned) -> ExecutionPlan:
        """``planned.plan`` with its adaptive plan's chunk hint and reasons."""
        if planned.shown is None:
            planned.shown = self._with_hint(planned.plan, planned.adaptive)
        return planned.shown

    def _with_hint(self, plan: ExecutionPlan, adaptive: AdaptivePlan | None) -> ExecutionPlan:
        if adaptive is None:
            return plan
        hint = (adaptive.chunk_size if adaptive.chunked
                else adaptive.batch_split[0] if adaptive.streams > 1 else None)
        return replace(plan, chunk_size_hint=hint, reasons=(*plan.reasons, *adaptive.reasons))

    # ---- the adaptive plan (seed 003) ---------------------------------------
    def _adaptive_plan(self, shapes: Shapes, planned: _Planned,
                       residency: str = "cpu") -> AdaptivePlan:
        """Plan runtime, precision, streams and chunks for this signature: once, or on every
        run while it is chunked (each run then starts from a fresh snapshot and history)."""
        key = (self._memory_limit, residency, self._telemetry is None)
        hit = planned.adaptive
        if hit is not None and planned.adaptive_key == key and not hit.chunked:
            return hit
        batch = _batch_size(shapes, self._declared_inputs)
        limit = self._memory_limit
        if batch is None and limit is not None and planned.plan.peak_bytes > limit:
            raise MemoryLimitError(
                f"memory limit {format_limit(limit)} ({limit} bytes) cannot be met: the plan "
                f"needs a peak of {format_bytes(planned.plan.peak_bytes)} "
                f"({planned.plan.peak_bytes} bytes) and the inputs share no batch dimension "
                "to split into chunks",
                required_bytes=planned.plan.peak_bytes, limit_bytes=limit)
        cores, pinned = self._cores()
        learn = batch is not None and (limit is not None or self._hint == "throughput")
        request = PlanRequest(
            "graph", 1 if batch is None else batch, residency=residency,
            backend=self._backend, precision=self._precision, memory_limit=limit,
            native_precision=_native_precision(self._graph),
            telemetry=self._telemetry() if self._telemetry is not None else None,
            node_precisions=tuple((n.name, n.precision) for n in planned.plan.nodes),
            hint=self._hint, cores=cores, threads_pinned=pinned,
            splittable=batch is not None and self._splittable(shapes, batch),
            history=self._known(shapes) if learn else None, profile=self._hardware,
            low_memory=low_memory_mode(self._hardware, self._policy))
        peak_of = (self._peak_fn(shapes, planned) if batch is not None
                   else lambda _: planned.plan.peak_bytes)
        adaptive = AdaptivePlanner(_graph_runtime(planned.plan)).plan(request, peak_of)
        planned.adaptive, planned.adaptive_key, planned.shown = adaptive, key, None
        return adaptive

    def _cores(self) -> tuple[int, bool]:
        """The cores the cpu backend may use, and whether the caller fixed them
        (``threads=`` or ``KEEL_THREADS``; else the hardware profile or this machine)."""
        pinned = self._threads is not None or settings().threads is not None
        try:
            return max(1, int(getattr(self._registry.get("cpu"), "threads", 1))), pinned
        except Exception:  # no cpu backend in this registry: nothing to split across
            return 1, pinned

    def _splittable(self, shapes: Shapes, batch: int) -> bool:
        """Whether every output has the batch as its first dimension (chunks can write it)."""
        try:
            self._check_chunkable(self._planned(shapes).types, batch)
        except MemoryLimitError:
            return False
        return True

    def _history_store(self) -> Any:
        if self._history is None:
            from keel.planning.history import RuntimeHistory

            self._history = RuntimeHistory.for_model(self._graph, self._hardware)
        return self._history

    def _known(self, shapes: Shapes) -> dict[int, Any]:
        return dict(self._history_store().records(_signature(shapes)))

    def _record(self, shapes: Shapes, measured: Mapping[int, tuple[float, int]],
                mode: str = "") -> None:
        """Keep step times: chunks' under the signature, other modes' beside it."""
        if measured:
            key = _signature(shapes) + (f" ({mode})" if mode else "")
            self._history_store().record(key, measured)

    # ---- chunking --------------------------------------------------------
    def _run_chunked(self, arrays: dict[str, np.ndarray], shapes: Shapes,
                     planned: _Planned, chunk_plan: AdaptivePlan) -> dict[str, np.ndarray]:
        from keel.planning.history import StepRecord

        batch = chunk_plan.size
        outputs = self._whole_outputs(planned)
        peak_of = self._peak_fn(shapes, planned)
        known = self._known(shapes)
        measured: dict[int, tuple[float, int]] = {}
        pos = 0
        while pos < batch:
            end = min(pos + chunk_plan.chunk_size, batch)
            sub = {k: (v[pos:end] if k in self._batched else v) for k, v in arrays.items()}
            part = self._planned(self._with_batch(shapes, end - pos))
            first_run = part.program is None     # binds its arena: not a step time
            program = self._program(part)
            self._last = (self._with_hint(part.plan, chunk_plan), chunk_plan)
            start = time.perf_counter()
            program.run(sub, outputs={k: o[pos:end] for k, o in outputs.items()},
                        profiler=self._profiler)
            seconds, size = time.perf_counter() - start, end - pos
            step = None if first_run else StepRecord(size, seconds / size, 1)
            if step is not None:
                total = measured.get(size, (0.0, 0))
                measured[size] = (total[0] + seconds, total[1] + size)
            pos = end
            snapshot = self._telemetry() if self._telemetry is not None else None
            chunk_plan = self._planner.replan(chunk_plan, pos, peak_of, snapshot,
                                              step, known)
        self._last = (self._last[0], chunk_plan) if self._last is not None else None
        self._record(shapes, measured)
        return outputs

    def _whole_outputs(self, planned: _Planned) -> dict[str, np.ndarray]:
        """The whole batch's outputs, which chunks and streams write slices of."""
        return {name: np.empty(_static(planned.types[name], name), t.dtype.numpy)
                for name, t in self._output_types(planned).items()}

    # ---- streams (the throughput hint) ---------------------------------------
    def _run_streams(self, arrays: dict[str, np.ndarray], shapes: Shapes,
                     planned: _Planned, plan: AdaptivePlan) -> dict[str, np.ndarray]:
        """Split the batch as ``plan`` says and run the parts concurrently, one program,
        arena and cpu thread group per stream, each writing its slice of the outputs."""
        streams = self._streams
        if streams is None or (streams.threads, streams.count) != \
                (plan.threads_per_stream, plan.streams):
            streams = self._streams = _Streams(self._registry, plan.threads_per_stream,
                                               plan.streams, self._pool)
        outputs = self._whole_outputs(planned)
        jobs = []
        first_run = False
        pos = 0
        for index, size in enumerate(plan.batch_split):
            end = pos + size
            part_shapes = self._with_batch(shapes, size)
            first_run |= (index, _signature(part_shapes)) not in streams.programs
            program = streams.program(index, _signature(part_shapes),
                                      self._planned(part_shapes), self._graph)
            sub = {k: (v[pos:end] if k in self._batched else v) for k, v in arrays.items()}
            jobs.append((program, sub, {k: o[pos:end] for k, o in outputs.items()}))
            pos = end
        self._last = (self._shown(planned), plan)
        start = time.perf_counter()
        streams.run(jobs, self._profiler)
        if not first_run:      # streams' times are kept apart from chunks' (they overlap)
            self._record(shapes, {plan.batch_split[0]: (time.perf_counter() - start,
                                                        plan.size)}, f"{plan.streams} streams")
        return outputs

    def _peak_fn(self, shapes: Shapes, whole: _Planned) -> Callable[[int], int]:
        full_outputs = int(whole.plan.memory.get("output_bytes", 0))
        batch = _batch_size(shapes, self._declared_inputs)

        def peak(n: int) -> int:
            if n == batch:
                return whole.plan.peak_bytes
            sub = self._with_batch(shapes, n)
            part = self._planned(sub, keep=False)
            self._check_chunkable(part.types, n)
            plan = part.plan
            # Chunks write into slices of the whole batch's outputs.
            return plan.peak_bytes - int(plan.memory.get("output_bytes", 0)) + full_outputs

        return peak

    @property
    def _batched(self) -> set[str]:
        """Inputs whose first dimension is not fixed: the ones chunking splits."""
        return {v.name for v in self._declared_inputs
                if v.type.shape and not isinstance(v.type.shape[0], int)}

    def _with_batch(self, shapes: Shapes, n: int) -> Shapes:
        return {k: ((n, *s[1:]) if k in self._batched else s) for k, s in shapes.items()}

    def _check_chunkable(self, types: Mapping[str, TensorType | None], n: int) -> None:
        for v in self._graph.outputs:
            t = types.get(v.name)
            if t is None or not t.is_static or not t.shape or t.shape[0] != n:
                raise MemoryLimitError(
                    f"cannot split the batch into chunks: output {v.name!r} is {t} for "
                    f"{n} items, not {n} rows; raise the memory limit")

    def _output_types(self, planned: _Planned) -> dict[str, TensorType]:
        result = {}
        for v in self._graph.outputs:
            t = planned.types.get(v.name)
            if t is None:
                raise MemoryLimitError(f"cannot chunk: output {v.name!r} has no known shape")
            result[v.name] = t
        return result

    # ---- input validation ------------------------------------------------
    def _validate(self, feeds: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], Shapes]:
        if not isinstance(feeds, Mapping):
            raise InvalidArgumentError(
                f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
        known = {v.name: v for v in self._declared_inputs}
        optional = set(self._graph.optional_input_names)
        for name in feeds:
            if name not in known and name not in optional:
                raise InvalidArgumentError(
                    f"unknown input {name!r}; the model's inputs are: {', '.join(known)}")
        arrays: dict[str, np.ndarray] = {}
        symbols: dict[str, tuple[int, str]] = {}
        for name, v in known.items():
            if name not in feeds:
                raise InvalidArgumentError(
                    f"input {name!r} is missing; expected {_describe(v.type)}")
            arrays[name] = _check_input(name, feeds[name], v.type, symbols)
        for name in optional & set(feeds):
            v = next(x for x in self._graph.inputs if x.name == name)
            arrays[name] = _check_input(name, feeds[name], v.type, symbols)
        return self._to_internal(arrays), {k: tuple(getattr(a, "shape", ()))
                                           for k, a in arrays.items()}

    def _to_internal(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        types = {v.name: v.type.dtype for v in self._graph.inputs}
        return {k: (a if not isinstance(a, np.ndarray) or a.dtype == types[k].numpy
                    else a.astype(types[k].numpy))
                for k, a in arrays.items()}

    def _to_declared(self, result: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for v in self._declared_outputs:
            a = result[v.name]
            out[v.name] = a if not isinstance(a, np.ndarray) or a.dtype == v.type.dtype.numpy \
                else a.astype(v.type.dtype.numpy)
        return out

    def __repr__(self) -> str:
        ins = ", ".join(f"{i.name}: {_describe(TensorType(i.dtype, i.shape, i.kind))}"
                        for i in self.inputs)
        return f"<keel.Model {self.name!r} ({ins}) backend={self._backend}>"


# ---- helpers ---------------------------------------------------------------
class _Streams:
    """The throughput hint's streams: per stream an arena pool and compiled programs, on a
    cpu thread group of ``threads``; worker threads run the streams concurrently."""

    def __init__(self, registry: BackendRegistry, threads: int, count: int,
                 shared: ArenaPool) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.threads, self.count = threads, count
        self.registry = _with_threads(registry, threads)
        self.pools = [ArenaPool() for _ in range(count)]
        for pool in self.pools:
            pool.prepacked = shared.prepacked      # weights are packed once, for all
            pool.limit = shared.limit
        self.programs: dict[tuple[int, str], Program] = {}
        self.executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix="keel-stream")
        weakref.finalize(self, self.executor.shutdown, False)

    def program(self, index: int, signature: str, planned: _Planned, graph: Graph) -> Program:
        key = (index, signature)
        program = self.programs.get(key)
        if program is None:
            if len(self.programs) >= _CACHE_SIZE * self.count:
                self.programs.clear()
            backends = {name: self.registry.get(name) for name in planned.plan.backends}
            program = compile_program(graph, planned.plan, planned.types, backends,
                                      self.pools[index])
            self.programs[key] = program
        return program

    def run(self, jobs: Sequence[tuple[Program, dict[str, np.ndarray], dict[str, np.ndarray]]],
            profiler: Profiler | None) -> None:
        from keel.backends.cpu.backend import ThreadCap

        # One cap around all streams: each stream's own cap then finds BLAS already at
        # its size and changes nothing, so concurrent streams never restore each other's.
        with ThreadCap(self.threads):
            futures = [self.executor.submit(program.run, sub, outputs=out, profiler=profiler)
                       for program, sub, out in jobs]
            for future in futures:
                future.result()


def _graph_runtime(plan: ExecutionPlan) -> Callable[[PlanRequest], tuple[str, str]]:
    """The runtime of a whole graph in auto mode: where its inputs live when nodes run
    there, else where placement runs most of its nodes."""
    def choose(request: PlanRequest) -> tuple[str, str]:
        counts = plan.backends
        total = sum(counts.values())
        if request.residency in counts:
            return request.residency, (
                f"the inputs live on {request.residency}, where placement runs "
                f"{counts[request.residency]} of {total} nodes")
        name = max(sorted(counts), key=counts.__getitem__) if counts else request.residency
        moved = ("" if request.residency in ("cpu", name) else
                 f"; the inputs live on {request.residency}, where no node runs: they are "
                 f"copied first")
        return name, f"placement runs {counts.get(name, 0)} of {total} nodes there{moved}"

    return choose


def _describe_adaptive(plan: AdaptivePlan) -> str:
    threads = f"{plan.threads_per_stream} thread{'s' if plan.threads_per_stream > 1 else ''}"
    streams = (f"{plan.streams} streams of {threads} "
               f"(batch split {'+'.join(map(str, plan.batch_split))})" if plan.streams > 1
               else f"one stream of {threads}")
    chunks = (f", chunked: {plan.n_chunks} chunks of up to {plan.chunk_size}"
              if plan.chunked else "")
    source = (plan.telemetry or {}).get("source", "none")
    return (f"adaptive plan: runtime {plan.runtime}, precision {plan.precision}, hint "
            f"{plan.hint}, {streams}{chunks}; telemetry {source}")


def _residency(feeds: Any) -> str:
    """Where the feeds live: ``cpu`` for host arrays, else the device a feed reports."""
    if not isinstance(feeds, Mapping):
        return "cpu"
    for value in feeds.values():
        if isinstance(value, np.ndarray):
            continue
        device = str(getattr(value, "device", "cpu")).lower()
        if device not in ("cpu", "host"):
            return "gpu" if ("cuda" in device or device.startswith("gpu")) else device
    return "cpu"


def _shapes(arrays: Mapping[str, np.ndarray]) -> Shapes:
    return {name: tuple(a.shape) for name, a in arrays.items()}


def _batch_apart(key: tuple[Any, ...], other: tuple[Any, ...]) -> bool:
    """Whether two signatures (sorted (input, shape) pairs) differ only in their inputs'
    first (batch) dimension: such a signature gets a plan of its own, made by the same
    batch-invariant rules, so a sample's answer does not depend on the batch it came in."""
    if len(key) != len(other):
        return False
    return all(a[0] == b[0] and len(a[1]) == len(b[1]) and a[1][1:] == b[1][1:]
               for a, b in zip(key, other, strict=True))


def _signature(shapes: Shapes) -> str:
    return ";".join(f"{k}={'x'.join(map(str, v))}" for k, v in sorted(shapes.items()))


def _check_backend(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgumentError(
            f"backend must be a name such as {', '.join(BACKEND_NAMES)}; got {name!r}")
    return name.strip().lower()


def _check_precision(name: Any) -> str:
    if not isinstance(name, str) or name.strip().lower() not in PRECISIONS:
        raise InvalidArgumentError(
            f"precision {name!r} is not allowed; use one of {', '.join(PRECISIONS)}")
    return name.strip().lower()


def _with_threads(registry: BackendRegistry, threads: int | None,
                  hardware: Any = None) -> BackendRegistry:
    """A registry whose cpu backend runs with ``threads``, else with what ``hardware`` (a
    profile, perhaps of another machine) says (others shared with ``registry``)."""
    if (threads is None and hardware is None) or "cpu" not in registry.names():
        return registry
    from keel.backends.cpu.backend import CpuBackend

    cpu: Backend = CpuBackend(threads=threads, hardware=hardware)
    return registry.with_instance("cpu", cpu)


def _probe_if_gpu(registry: BackendRegistry) -> Any:
    """The hardware profile when a GPU backend could run (selection reads its free memory)."""
    if not any(b.device is DeviceKind.GPU for b in registry.available()):
        return None
    from keel.hardware import probe

    return probe()


def _keeps_dtypes(graph: Graph, inputs: Sequence[Value], outputs: Sequence[Value]) -> bool:
    """Whether the graph takes and gives every value in its declared dtype (no conversion)."""
    internal = {v.name: v.type.dtype for v in (*graph.inputs, *graph.outputs)}
    return all(internal.get(v.name) is v.type.dtype for v in (*inputs, *outputs))


def _freeze_constants(graph: Graph) -> Graph:
    """``graph`` with every weight read-only, over memory nothing else can write.

    Kernels cache what they derive from weights (a Winograd transform, a
    transposed copy) only for such arrays. An array that owns its memory is
    frozen in place; a view of memory that stays writable elsewhere is copied
    first.
    """
    for name, array in graph.initializers.items():
        if not isinstance(array, np.ndarray) or _is_frozen(array):
            continue
        if array.base is not None:
            array = np.array(array, copy=True)
        array.setflags(write=False)
        graph.initializers[name] = array
    return graph


def _is_frozen(array: np.ndarray) -> bool:
    a: Any = array
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        a = a.base
    return a is None or isinstance(a, bytes) or _read_only_map(a)


def _read_only_map(buffer: Any) -> bool:
    """Whether ``buffer`` is a read-only memory map (a ``.keel`` file's weights): nothing
    in this process can write it, so its weights stay mapped rather than copied."""
    import mmap

    if not isinstance(buffer, mmap.mmap):
        return False
    with memoryview(buffer) as view:
        return view.readonly


def _native_precision(graph: Graph) -> str:
    dtypes = [v.type.dtype for v in graph.inputs if v.type.dtype.is_float]
    dtypes += [DType.from_numpy(a.dtype) for a in graph.initializers.values()
               if a.dtype.kind == "f"]
    return precision_name(max(set(dtypes), key=dtypes.count)) if dtypes else "fp32"


def _convert_precision(graph: Graph, precision: str) -> Graph:
    """Run float math in a pinned float precision; int8/int16 quantize a float model's weights."""
    if precision == "auto":
        return graph
    native = _native_precision(graph)
    if precision == native:
        return graph
    if precision not in _FLOATS:
        if any(n.op in OpGroup.QUANTIZATION for n in graph.nodes):
            return graph
        # A float model asked to run in int8/int16: quantize its weights on load
        # (weight-only, per output channel), so they stay small in memory.
        from keel.graph.quantize import quantize_graph

        return quantize_graph(graph, precision, "weight-only")
    if native not in _FLOATS:
        return graph
    return _retype_floats(graph, _FLOATS[native], _FLOATS[precision])


def _retype_floats(graph: Graph, src: DType, dst: DType) -> Graph:
    g = graph.copy()

    def retype(t: TensorType) -> TensorType:
        return TensorType(dst, t.shape, t.kind) if t.dtype is src else t

    g.initializers = {k: (a.astype(dst.numpy) if a.dtype == src.numpy else a)
                      for k, a in g.initializers.items()}
    g.inputs = [Value(v.name, retype(v.type)) for v in g.inputs]
    g.outputs = [Value(v.name, retype(v.type)) for v in g.outputs]
    g.value_types = {k: retype(t) for k, t in g.value_types.items()}
    for node in g.nodes:
        node.attrs = {k: _retype_attr(v, src, dst) for k, v in node.attrs.items()}
    return g


def _retype_attr(value: Any, src: DType, dst: DType) -> Any:
    if isinstance(value, DType) and value is src:
        return dst
    if isinstance(value, Graph):                     # a subgraph computes in the same precision
        return _retype_floats(value, src, dst)
    if isinstance(value, np.ndarray) and value.dtype == src.numpy:
        return value.astype(dst.numpy)
    return value


def _describe(t: TensorType) -> str:
    return str(t)


def _check_input(name: str, value: Any, t: TensorType, symbols: dict[str, tuple[int, str]],
                 ) -> Any:
    if not t.is_tensor:
        return _check_value(name, value, t)
    array = _as_array(name, value, t.dtype)
    if t.shape is None:
        return _contiguous(array)
    if array.ndim != len(t.shape):
        raise InvalidArgumentError(
            f"input {name!r} has rank {array.ndim} (shape {tuple(array.shape)}); expected "
            f"rank {len(t.shape)}: {_describe(t)}")
    for axis, (want, got) in enumerate(zip(t.shape, array.shape, strict=True)):
        if isinstance(want, int) and want != got:
            raise InvalidArgumentError(
                f"input {name!r} has shape {tuple(array.shape)}; expected {_describe(t)} "
                f"(dimension {axis} must be {want})")
        if isinstance(want, str):
            seen = symbols.setdefault(want, (got, name))
            if seen[0] != got:
                raise InvalidArgumentError(
                    f"dimension {want!r} is {seen[0]} in input {seen[1]!r} but {got} in "
                    f"input {name!r}; inputs must agree on it")
    return _contiguous(array)


def _check_value(name: str, value: Any, t: TensorType) -> list[np.ndarray] | np.ndarray | None:
    """A sequence input as a list of arrays, an optional one as its value or None."""
    if value is None and t.kind in (ValueKind.OPTIONAL, ValueKind.OPTIONAL_SEQUENCE):
        return None
    if t.kind is ValueKind.OPTIONAL:
        return _contiguous(_as_array(name, value, t.dtype))
    if not isinstance(value, (list, tuple)):
        raise InvalidArgumentError(
            f"input {name!r} is a sequence ({_describe(t)}): give a list of arrays, got "
            f"{type(value).__name__}")
    return [_contiguous(_as_array(f"{name}[{k}]", item, t.dtype))
            for k, item in enumerate(value)]


def _contiguous(array: np.ndarray) -> np.ndarray:
    # np.ascontiguousarray would turn a 0-d array into a 1-d one.
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _as_array(name: str, value: Any, dtype: DType) -> np.ndarray:
    if not isinstance(value, np.ndarray) and is_device_array(value):
        array = _device_feed(name, value)
        if array.dtype != dtype.numpy:
            raise InvalidArgumentError(
                f"input {name!r} (on the gpu) has dtype {array.dtype}; expected {dtype.value}")
        return array
    if isinstance(value, np.ndarray):
        if value.dtype != dtype.numpy:
            raise InvalidArgumentError(
                f"input {name!r} has dtype {value.dtype}; expected {dtype.value}")
        return value
    if hasattr(value, "__array__") or isinstance(value, (list, tuple, int, float, bool)):
        try:
            return np.asarray(value, dtype=dtype.numpy)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgumentError(
                f"input {name!r} cannot be read as {dtype.value}: {exc}") from None
    raise InvalidArgumentError(
        f"input {name!r} must be an array, got {type(value).__name__}; expected {dtype.value}")


def _time_call(run: Callable[[], Any]) -> float:
    """The median seconds of ``run`` over the trials' timed calls, after their warm-up."""
    for _ in range(trials.WARM_RUNS):
        run()
    samples = []
    for _ in range(trials.TIMED_RUNS):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def _relative_error(got: Any, want: Any) -> float:
    """Relative L2 error of ``got`` against ``want``; integer outputs must be equal."""
    a, b = np.asarray(got), np.asarray(want)
    if a.shape != b.shape:
        return float("inf")
    if b.dtype.kind not in "fc":
        return 0.0 if np.array_equal(a, b) else float("inf")
    ref = np.asarray(b, np.float64)
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref)
                 / max(float(np.linalg.norm(ref)), 1e-30))


def _device_feed(name: str, value: Any) -> Any:
    """A feed in CUDA memory as a CuPy array over the same memory."""
    try:
        return as_device_array(value)
    except ImportError as exc:
        raise InvalidArgumentError(
            f"input {name!r} lives on a CUDA device, which needs CuPy ({exc}); "
            "install it with: pip install 'keel-runtime[cuda12]'") from None
    except Exception as exc:
        raise InvalidArgumentError(
            f"input {name!r} lives on a CUDA device but cannot be read there: "
            f"{type(exc).__name__}: {exc}") from None


def _batch_size(shapes: Shapes, inputs: Iterable[Value]) -> int | None:
    """The shared first dimension of inputs declared with a non-fixed first dimension."""
    sizes = set()
    for v in inputs:
        shape = v.type.shape
        if shape and not isinstance(shape[0], int) and shapes.get(v.name):
            sizes.add(shapes[v.name][0])
    return sizes.pop() if len(sizes) == 1 else None


def _static(t: TensorType | None, name: str) -> tuple[int, ...]:
    if t is None or not t.is_static or t.shape is None:
        raise MemoryLimitError(f"cannot chunk: output {name!r} has no static shape ({t})")
    return tuple(int(d) for d in t.shape if isinstance(d, int))
