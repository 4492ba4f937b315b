"""Placement: a graph and the types of one input signature → an ``ExecutionPlan``.

For every node the plan says which backend runs it and, from that
backend's planner (``Backend.plan_node``), how: the frozen
:class:`~keel.backends.plan.NodePlan` (variant, layout, threads, BLAS
threads, chunking, workspace, precision), each with its reason. A pinned
backend runs every node or placement fails before anything runs
(``BackendSelectionError`` when the backend cannot run here,
``UnsupportedOperationError`` naming the first node it lacks). In auto
mode each node goes where the op-level selection sends it; a node the
chosen backend cannot run moves down the priority chain with the reason
recorded. Where a value crosses devices a copy is planned and counted, and
the memory plan covers every device's arena.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keel.backends import planner_constants
from keel.backends.base import Backend, DeviceKind
from keel.backends.plan import Measured, NodePlan
from keel.backends.registry import BackendRegistry
from keel.config import format_bytes
from keel.dtypes import DType
from keel.errors import (
    BackendSelectionError,
    InvalidArgumentError,
    UnsupportedOperationError,
)
from keel.graph.ir import Graph, Node
from keel.graph.memory_plan import MemoryPlan, packed_bytes, plan_steps_for_graph
from keel.hardware.profile import HardwareProfile
from keel.ops.types import TensorType
from keel.planning.interop import Region, plan_regions, spans
from keel.planning.plans import (
    HOST,
    DeviceCopy,
    ExecutionPlan,
    NodePlacement,
    lower_steps,
    precision_name,
    scratch_bytes,
)
from keel.planning.runtime_plan import gpu_kept_off, low_memory_mode
from keel.planning.work import estimated_work

__all__ = [
    "HOST",
    "DeviceCopy",
    "ExecutionPlan",
    "NodePlacement",
    "lower_steps",
    "place",
    "precision_name",
]


# ---- placing ---------------------------------------------------------------
@dataclass
class _Context:
    graph: Graph
    types: Mapping[str, TensorType | None]
    registry: BackendRegistry
    profile: Any
    policy: Any
    precision: str
    chain: list[Backend]
    device_of_value: dict[str, str] = field(default_factory=dict)
    strict: bool = False
    low_memory: str = ""           # why the machine is planned in low-memory mode ("": not)
    # placements made, by node signature (see _signature): nodes alike are placed once
    placed: dict[tuple[Any, ...], NodePlacement] = field(default_factory=dict)


def place(
    graph: Graph,
    types: Mapping[str, TensorType | None],
    registry: BackendRegistry,
    profile: Any = None,
    policy: Any = None,
    backend: str = "auto",
    precision: str = "auto",
    strict: bool | None = None,
) -> ExecutionPlan:
    """Place every node of ``graph`` for the static ``types`` of one input signature.

    ``strict`` (default: ``KEEL_STRICT``) turns a fallback down the priority
    chain into an ``UnsupportedOperationError`` naming the node.
    """
    with planner_constants.once():  # measured once for the graph and its subgraphs' plans
        return _place(graph, types, registry, profile, policy, backend, precision, strict)


def _place(graph: Graph, types: Mapping[str, TensorType | None], registry: BackendRegistry,
           profile: Any, policy: Any, backend: str, precision: str, strict: bool | None
           ) -> ExecutionPlan:
    if strict is None:
        from keel.config import settings

        strict = settings().strict
    planner_constants.refresh()     # a planner constant changed since the last plan counts
    ctx = _Context(graph, types, registry, profile, policy, precision, [], strict=strict,
                   low_memory=low_memory_mode(profile, policy))
    reasons: list[str] = _low_memory_reasons(graph, ctx.low_memory)
    if backend == "auto":
        ctx.chain = _cool_chain(_auto_chain(registry, reasons), profile, reasons)
        placements = [_memoized(ctx, n) for n in graph.nodes]
    else:
        pinned = registry.get(backend)
        reasons.append(f"backend {backend} pinned by the caller: every node runs there")
        placements = [_place_pinned(ctx, pinned, n) for n in graph.nodes]
    placements = _with_blas_threads(graph, types, registry, placements)
    placements = _with_layouts(graph, types, registry, placements)
    copies = _plan_copies(graph, types, placements)
    regions = _regions(graph, types, registry, placements, copies)
    steps = lower_steps(graph, placements, copies)
    memory = plan_steps_for_graph(graph, types, steps, concurrent=spans(regions))
    memory = dataclasses.replace(memory, prepacked_bytes=_prepacked_bytes(graph, registry,
                                                                          placements),
                                 workspace_bytes=scratch_bytes(placements))
    reasons += _summary_reasons(placements, copies, memory)
    reasons += _backend_notes(registry, placements)
    reasons += [f"branches {_region_name(graph, r)}: {r.reason}" for r in regions]
    subplans = _place_subgraphs(graph, types, registry, profile, policy, backend, precision,
                                strict)
    # One body runs at a time, beside the enclosing program's arena: the largest adds.
    inner = max((p.peak_bytes for p in subplans.values()), default=0)
    if subplans:
        reasons.append(f"subgraphs: {len(subplans)} planned, each compiled once per input "
                       f"signature; the largest needs {format_bytes(inner)} beside this "
                       "graph's memory")
    return ExecutionPlan(
        model=graph.name,
        backend=backend,
        precision=precision,
        nodes=tuple(placements),
        copies=tuple(copies),
        memory=memory.summary(),
        peak_bytes=memory.peak_bytes + inner,
        reasons=tuple(reasons),
        input_shapes=_input_shapes(graph, types),
        memory_plan=memory,
        subplans=subplans,
        regions=regions,
    )


def _regions(graph: Graph, types: Mapping[str, TensorType | None], registry: BackendRegistry,
             placements: Sequence[NodePlacement], copies: Sequence[DeviceCopy]
             ) -> tuple[Region, ...]:
    """The graph's independent branches and whether each region runs them at once (the
    cpu backend decides; a plan with device copies runs every node in order)."""
    if copies or not placements or any(p.backend != "cpu" for p in placements):
        return ()
    from keel.config import settings

    cpu = registry.instance("cpu")
    return plan_regions(graph, types, placements, int(cpu.threads or 1), settings().interop,
                        cpu.plan_branches)


def _region_name(graph: Graph, region: Region) -> str:
    return f"{graph.nodes[region.first].name} .. {graph.nodes[region.last].name}"


def _low_memory_reasons(graph: Graph, low_memory: str) -> list[str]:
    """What low-memory mode means for this graph: mapped weights, no packed copies."""
    if not low_memory:
        return []
    arrays = list(graph.initializers.values())
    mapped = [a for a in arrays if _is_mapped(a)]
    size = format_bytes(sum(int(a.nbytes) for a in mapped))
    weights = (f"{len(mapped)} of {len(arrays)} weight tensors ({size}) stay memory-mapped "
               "from the .keel file" if mapped else
               "the weights are in memory (load a .keel file to keep them memory-mapped)"
               if arrays else "the model has no weights")
    return [f"low-memory mode ({low_memory}): {weights}; kernels keep no packed copies of "
            "weights; one stream reuses one arena"]


def _is_mapped(array: Any) -> bool:
    """Whether ``array`` (or the array it views) is a memory map of a file."""
    import numpy as np

    while array is not None:
        if isinstance(array, np.memmap):
            return True
        array = getattr(array, "base", None)
    return False


def _place_subgraphs(graph: Graph, types: Mapping[str, TensorType | None],
                     registry: BackendRegistry, profile: Any, policy: Any, backend: str,
                     precision: str, strict: bool) -> dict[str, ExecutionPlan]:
    """The plan of every subgraph of ``graph``'s control-flow nodes, for the types the
    node's inputs give it, by ``"node/attribute"``."""
    from keel.graph.shape_inference import infer_graph_types
    from keel.graph.subgraphs import bound_body, subgraphs

    plans: dict[str, ExecutionPlan] = {}
    for node in graph.nodes:
        in_types = [types.get(i) if i else None for i in node.inputs]
        for attr, _ in subgraphs(node):
            body = bound_body(node, attr, in_types)
            try:
                body_types = infer_graph_types(body)
            except InvalidArgumentError:
                continue        # an If branch these types do not take: planned if it runs
            plans[f"{node.name}/{attr}"] = place(body, body_types, registry, profile, policy,
                                                 backend, precision, strict)
    return plans


def _prepacked_bytes(graph: Graph, registry: BackendRegistry,
                     placements: Sequence[NodePlacement]) -> int:
    """The packed copies of constants that the placed kernels keep (one per node that
    prepacks, estimated from the constants' shapes): bytes keel holds beside the weights."""
    total = 0
    for node, placed in zip(graph.nodes, placements, strict=True):
        kernel = registry.instance(placed.backend).kernels.get(node.op, placed.variant)
        if kernel.prepack is None or (placed.plan is not None
                                      and not placed.plan.option("prepack", True)):
            continue
        consts = (graph.initializers.get(name) for name in node.inputs if name)
        total += sum(packed_bytes(c.shape, c.dtype.itemsize) for c in consts if c is not None)
    return total


def _backend_notes(registry: BackendRegistry, placements: Sequence[NodePlacement]
                   ) -> list[str]:
    """What each backend that runs nodes decided for all of them (the cpu threads)."""
    used = dict.fromkeys(p.backend for p in placements)
    return [note for name in used for note in registry.instance(name).plan_notes()]


def _auto_chain(registry: BackendRegistry, reasons: list[str]) -> list[Backend]:
    report = {name: registry.availability(name) for name in registry.priority}
    chain = registry.available()
    if not chain:
        why = "; ".join(f"{n}: {a.reason}" for n, a in report.items())
        raise BackendSelectionError("auto", f"no backend can run here ({why})")
    reasons.append("auto mode: priority chain " + " -> ".join(b.name for b in chain))
    for name, avail in report.items():
        if not avail.available and name in registry.priority:
            reasons.append(f"{name} skipped: {avail.reason}")
    for name, why in registry.manual().items():
        reasons.append(f"{name} not in the chain: {why}")
    return chain


def _cool_chain(chain: list[Backend], profile: Any, reasons: list[str]) -> list[Backend]:
    """``chain`` without its GPU backends while the profile reads every GPU near its
    thermal limit (the runtime plan's rule); unchanged when nothing else could run."""
    hot = gpu_kept_off(profile) if isinstance(profile, HardwareProfile) else ""
    cool = [b for b in chain if b.device is not DeviceKind.GPU]
    if not hot or len(cool) == len(chain) or not cool:
        return chain
    reasons.append(f"{', '.join(b.name for b in chain if b not in cool)} skipped: {hot}")
    return cool


def _node_dtype(ctx: _Context, node: Node) -> DType | None:
    for name in node.present_inputs():
        t = ctx.types.get(name)
        if t is not None:
            return t.dtype
    return None


def _needs(node: Node, dtype: DType | None, backend: Backend) -> str:
    """What ``node`` needs that ``backend`` lacks, with the backend's note on the dtype."""
    if dtype is None:
        return node.op.value
    return f"{node.op.value} on {_held_note(dtype, backend)}"


def _place_pinned(ctx: _Context, backend: Backend, node: Node) -> NodePlacement:
    dtype = _node_dtype(ctx, node)
    if not backend.supports(node.op, dtype):
        what = _needs(node, dtype, backend)
        raise UnsupportedOperationError(
            node.op.value, backend.name,
            supported_on=ctx.registry.supported_on(node.op),
            detail=f"node {node.name!r} needs {what}; a pinned backend never falls back",
        )
    made = _unheld_output(ctx, node, backend)
    if made is not None:
        raise UnsupportedOperationError(
            node.op.value, backend.name,
            supported_on=ctx.registry.supported_on(node.op),
            detail=f"node {node.name!r} makes {_held_note(made, backend)}; a pinned backend "
                   "never falls back",
        )
    return _finish(ctx, node, backend, [f"pinned to {backend.name}"])


def _held_note(dtype: DType, backend: Backend) -> str:
    """``dtype``, with the backend's note on why it does not hold it (if it has one)."""
    note = backend.dtype_notes.get(dtype)
    return dtype.value + (f" ({backend.name} holds no {dtype.value}: {note})" if note else "")


def _unheld_output(ctx: _Context, node: Node, backend: Backend) -> DType | None:
    """The first output dtype of ``node`` that ``backend`` cannot hold (a Cast's target)."""
    for name in node.outputs:
        t = ctx.types.get(name)
        if t is not None and t.dtype is not DType.STRING and t.dtype not in backend.dtypes:
            return t.dtype
    return None


def _memoized(ctx: _Context, node: Node) -> NodePlacement:
    """``_place_auto``'s placement of ``node``, made once per node signature: a placement
    depends only on the node's op, attributes, input and output types, which inputs are
    constants and where its inputs live (a 100,000-node chain of one op is placed once)."""
    key = _signature(ctx, node)
    if key is None:
        return _place_auto(ctx, node)
    found = ctx.placed.get(key)
    if found is None:
        found = ctx.placed[key] = _place_auto(ctx, node)
        return found
    for out in node.outputs:
        if out:
            ctx.device_of_value[out] = found.device
    return NodePlacement(node.name, found.op, found.backend, found.variant, found.precision,
                         found.reasons, found.device, found.writes_out, found.plan)


def _signature(ctx: _Context, node: Node) -> tuple[Any, ...] | None:
    """What a node's placement depends on; None when an attribute is not hashable."""
    key = (node.op, tuple(ctx.types.get(i) if i else None for i in node.inputs),
           tuple(ctx.graph.is_constant(i) for i in node.inputs if i),
           tuple(ctx.types.get(o) if o else None for o in node.outputs),
           _residency(ctx, node), tuple(sorted(node.attrs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _place_auto(ctx: _Context, node: Node) -> NodePlacement:
    dtype = _node_dtype(ctx, node)
    head = ctx.chain[0]
    if ctx.strict and not head.supports(node.op, dtype):
        raise UnsupportedOperationError(
            node.op.value, head.name,
            supported_on=[b.name for b in ctx.chain if b.supports(node.op, dtype)],
            detail=f"node {node.name!r} would fall back from {head.name}, the first "
                   "backend of the priority chain; KEEL_STRICT forbids fallbacks",
        )
    preferred, reasons = _select(ctx, node, dtype)
    names = [b.name for b in ctx.chain]
    start = names.index(preferred) if preferred in names else 0
    for candidate in ctx.chain[start:] + ctx.chain[:start]:
        if candidate.supports(node.op, dtype):
            return _finish(ctx, node, candidate, reasons)
        what = _needs(node, dtype, candidate)
        reasons.append(f"{candidate.name} has no kernel for {what}: next in the chain")
    raise UnsupportedOperationError(
        node.op.value, supported_on=(),
        detail=f"node {node.name!r}: no available backend ({', '.join(names)}) runs "
               f"{node.op.value}" + ("" if dtype is None else f" on {dtype.value}"),
    )


def _select(ctx: _Context, node: Node, dtype: DType | None) -> tuple[str, list[str]]:
    """The op-level selection's choice for this node, with its reasons."""
    from keel.planning.selection import OperationProperties, select_backend

    numel, nbytes = _node_size(ctx, node)
    residency = _residency(ctx, node)
    props = OperationProperties(node.op, numel, nbytes, dtype or DType.FLOAT32, residency)
    try:
        sel = select_backend(props, ctx.profile, ctx.policy, ctx.registry)
    except (BackendSelectionError, UnsupportedOperationError) as exc:
        return ctx.chain[0].name, [f"op-level selection declined ({exc.message}); "
                                   "walking the chain"]
    reasons = [sel.reason] + [f"{name} rejected: {why}" for name, why in sel.rejected]
    return sel.backend, reasons


def _node_size(ctx: _Context, node: Node) -> tuple[int, int]:
    numel = nbytes = 0
    # Inputs only: OperationProperties (and measured crossovers) are about the data moved in.
    for name in node.present_inputs():
        t = ctx.types.get(name)
        n = None if t is None else t.numel()
        if t is not None and n is not None:
            numel = max(numel, n)
            nbytes += n * t.dtype.itemsize
    return numel, nbytes


def _residency(ctx: _Context, node: Node) -> str:
    for name in node.present_inputs():
        if name in ctx.device_of_value:
            return ctx.device_of_value[name]
    return HOST


def _finish(ctx: _Context, node: Node, backend: Backend, reasons: list[str]) -> NodePlacement:
    device = backend.device.value
    for out in node.outputs:
        if out:
            ctx.device_of_value[out] = device
    precision, why_p = _node_precision(ctx, node)
    plan = _node_plan(ctx, node, backend, precision)
    variant = plan.variant
    writes_out = backend.kernels.get(node.op, variant).supports_out and _static_outputs(ctx, node)
    return NodePlacement(node.name, node.op.value, backend.name, variant, precision,
                         (*reasons, f"variant {variant}: {plan.reason('variant')}", why_p),
                         device, writes_out, plan)


def _static_outputs(ctx: _Context, node: Node) -> bool:
    outs = node.outputs
    if not outs or any(not o for o in outs):
        return False
    types = [ctx.types.get(o) for o in outs]
    return all(t is not None and t.is_static for t in types)


def _node_plan(ctx: _Context, node: Node, backend: Backend, precision: str) -> NodePlan:
    """The backend planner's plan for ``node``; a variant measured on this machine
    (``keel tune``'s cache) overrides its declared rules, and otherwise the tuning
    cache's note joins the variant's reason."""
    input_types = [ctx.types.get(i) if i else None for i in node.inputs]
    measured, note = _measured(ctx, node, backend, input_types)
    plan = backend.plan_node(node.op, input_types, node.attrs, profile=ctx.profile,
                             precision=precision, measured=measured,
                             low_memory=ctx.low_memory,
                             constants=tuple(bool(i) and ctx.graph.is_constant(i)
                                             for i in node.inputs))
    if plan.variant not in backend.kernels.variants(node.op):
        raise UnsupportedOperationError(
            node.op.value, backend.name,
            detail=f"node {node.name!r}: the planner chose unknown variant {plan.variant!r}")
    if note and (measured is None or plan.variant != measured.variant):
        reasons = tuple((f, f"{why}; {note}" if f == "variant" else why)
                        for f, why in plan.reasons)
        plan = dataclasses.replace(plan, reasons=reasons)
    return plan


def _measured(ctx: _Context, node: Node, backend: Backend,
              input_types: Sequence[TensorType | None]) -> tuple[Measured | None, str]:
    """(A variant measured on this machine for this node's shapes, the tuning cache's
    note): (None, note) where the backend's declared rules decide."""
    try:
        tuning = importlib.import_module("keel.planning.tuning")
    except ImportError:
        return None, ""
    found = tuning.lookup(ctx.graph, node, input_types, backend, ctx.profile)
    if found is None:
        return None, ""
    if found.variant is None:
        return None, str(found.reason)
    return Measured(str(found.variant), str(found.reason)), ""


def _node_precision(ctx: _Context, node: Node) -> tuple[str, str]:
    out = next((o for o in node.outputs if o), "")
    t = ctx.types.get(out)
    native = precision_name(None if t is None else t.dtype)
    if ctx.precision == "auto":
        return native, f"precision {native}: the model's own"
    return native, f"precision {native}: requested {ctx.precision}"


# ---- copies and lowering ---------------------------------------------------
def _with_blas_threads(graph: Graph, types: Mapping[str, TensorType | None],
                       registry: BackendRegistry, placements: list[NodePlacement],
                       ) -> list[NodePlacement]:
    """Every node plan with its backend's program-level BLAS decision: the scope a program
    of these steps enters on each backend (the cpu planner's ``plan_program``), made here
    from the same steps, dtypes and work the program will run, so the plan shows it."""
    decided: dict[str, tuple[int | None, str]] = {}
    for name in dict.fromkeys(p.backend for p in placements):
        backend = registry.get(name)
        kernels = [(backend.kernels.get(node.op, placed.variant),
                    _first_dtype(types, node), estimated_work(types.get, node))
                   for node, placed in zip(graph.nodes, placements, strict=True)
                   if placed.backend == name]
        scope = backend.program_scope(kernels)
        decided[name] = ((None, "no step on this backend may call BLAS: its pools are left "
                                "as they are") if scope is None
                         else (scope.threads, scope.reason or "the backend's program scope"))
    planned: dict[tuple[int, str], NodePlan] = {}   # plans are shared by nodes alike

    def with_threads(p: NodePlacement) -> NodePlacement:
        if p.plan is None:
            return p
        key = (id(p.plan), p.backend)
        plan = planned.get(key)
        if plan is None:
            plan = planned[key] = p.plan.with_field("blas_threads", *decided[p.backend])
        return NodePlacement(p.name, p.op, p.backend, p.variant, p.precision, p.reasons,
                             p.device, p.writes_out, plan)

    return [with_threads(p) for p in placements]


def _with_layouts(graph: Graph, types: Mapping[str, TensorType | None],
                  registry: BackendRegistry, placements: list[NodePlacement],
                  ) -> list[NodePlacement]:
    """Every node plan with its backend's whole-graph layout decision, where it made one
    (the cpu planner's int8 channels-last chains and float NCHWc regions)."""
    placed = list(placements)
    for name in dict.fromkeys(p.backend for p in placements):
        variants = [p.variant if p.backend == name else None for p in placements]
        for i, decided in registry.get(name).plan_layouts(graph, types, variants).items():
            p = placed[i]
            if p.plan is not None:
                plan = p.plan if decided.layout is None else p.plan.with_field(
                    "layout", decided.layout, decided.reason)
                if decided.threads_reason:
                    plan = plan.with_field("threads", plan.threads, decided.threads_reason)
                for option, value, why in decided.options:
                    plan = plan.with_option(option, value, why)
                for field, value, why in decided.fields:
                    plan = plan.with_field(field, value, why)
                placed[i] = dataclasses.replace(p, plan=plan)
    return placed


def _first_dtype(types: Mapping[str, TensorType | None], node: Node) -> DType | None:
    t = types.get(node.inputs[0]) if node.inputs and node.inputs[0] else None
    return None if t is None else t.dtype


def _plan_copies(graph: Graph, types: Mapping[str, TensorType | None],
                 placements: Sequence[NodePlacement]) -> list[DeviceCopy]:
    where: dict[str, str] = {name: HOST for name in graph.input_names}
    copies: list[DeviceCopy] = []
    made: set[tuple[str, str]] = set()
    for node, placed in zip(graph.nodes, placements, strict=True):
        for name in node.present_inputs():
            src = where.get(name)
            # Weights are loaded once on every device that reads them: no run-time copy.
            if src is None or src == placed.device or (name, placed.device) in made:
                continue
            made.add((name, placed.device))
            copies.append(DeviceCopy(name, f"{name}@{placed.device}", src, placed.device,
                                     node.name, _nbytes(types.get(name))))
        for out in node.outputs:
            if out:
                where[out] = placed.device
    for name in dict.fromkeys(graph.output_names):
        src = where.get(name, HOST)
        if src != HOST:
            copies.append(DeviceCopy(name, name, src, HOST, "", _nbytes(types.get(name))))
    return copies


def _nbytes(t: TensorType | None) -> int | None:
    return None if t is None else t.nbytes()


def _input_shapes(graph: Graph, types: Mapping[str, TensorType | None],
                  ) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for v in graph.inputs:
        t = types.get(v.name)
        if t is not None and t.is_static:
            shapes[v.name] = tuple(int(d) for d in t.shape or ())  # type: ignore[arg-type]
    return shapes


def _summary_reasons(placements: Sequence[NodePlacement], copies: Sequence[DeviceCopy],
                     memory: MemoryPlan) -> list[str]:
    counts: dict[str, int] = {}
    for p in placements:
        counts[p.backend] = counts.get(p.backend, 0) + 1
    moved = [p for p in placements if any("next in the chain" in r for r in p.reasons)]
    lines = [", ".join(f"{n} node{'s' if n != 1 else ''} on {b}" for b, n in counts.items())
             or "empty graph: nothing to place"]
    if moved:
        lines.append(f"{len(moved)} node(s) moved down the chain: "
                     + ", ".join(f"{p.name} ({p.op}) -> {p.backend}" for p in moved[:8]))
    lines.append(f"{len(copies)} device cop{'y' if len(copies) == 1 else 'ies'} planned")
    lines.append(memory.report().splitlines()[0])
    return lines
