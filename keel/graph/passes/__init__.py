"""Graph optimization passes, in levels like onnxruntime's.

Each pass is ``fn(graph) -> Graph``: it returns a changed copy and leaves its
input alone, and it keeps the names of graph inputs and outputs. The levels:

* ``none`` — the graph as imported;
* ``basic`` — QDQ patterns into integer nodes (Conv, Gemm, MatMul), constant
  folding, shape-subgraph folding, Identity/Dropout removal, dead-code
  elimination (repeated while they change something);
* ``extended`` — basic, then fusions: Conv+BatchNorm, LayerNorm, GELU,
  attention, MatMul+Add, readers of a shared value ordered together, Conv+residual
  Add, residual Add+LayerNorm, activations into Conv/Gemm/MatMul epilogues;
* ``all`` (default) — extended with layout work first (composing Transpose
  chains).

Adding a pass is adding a module that defines it and naming it in the
pipeline below, with the ops it rewrites (``needs``): a pass whose ops the
graph lacks is not run, and neither is a pass that already ran on the very
same graph without changing it. Both keep loading fast: most passes infer
every value's type before they look for their pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.errors import InvalidArgumentError
from keel.graph.ir import Graph
from keel.graph.passes.cancel_transposes import cancel_transposes
from keel.graph.passes.eliminate_dead import eliminate_dead
from keel.graph.passes.fold_constants import fold_constants
from keel.graph.passes.fold_shapes import fold_shapes
from keel.graph.passes.fuse_activation import fuse_activation
from keel.graph.passes.fuse_attention import fuse_attention
from keel.graph.passes.fuse_conv_bn import fuse_conv_bn
from keel.graph.passes.fuse_gelu import fuse_gelu
from keel.graph.passes.fuse_layer_norm import fuse_layer_norm
from keel.graph.passes.fuse_matmul_add import fuse_matmul_add
from keel.graph.passes.fuse_qdq import fuse_qdq
from keel.graph.passes.fuse_residual import fuse_residual
from keel.graph.passes.fuse_skip_layer_norm import fuse_skip_layer_norm
from keel.graph.passes.order_shared_reads import ORDER_KEY, order_shared_reads
from keel.graph.passes.remove_identity import remove_identity
from keel.ops.registry import Op

__all__ = [
    "LEVELS",
    "GraphPass",
    "OptimizeReport",
    "PassRecord",
    "optimize",
    "optimize_with_report",
    "passes_for",
]

LEVELS = ("none", "basic", "extended", "all")

Pass = Callable[[Graph], Graph]


@dataclass(frozen=True)
class GraphPass:
    """A pass and the ops it needs: it can change a graph only if, for each set in
    ``needs``, the graph has a node with one of its ops (no sets: always runs)."""

    name: str
    fn: Pass
    needs: tuple[frozenset[Op], ...] = ()

    def applies_to(self, ops: frozenset[Op]) -> bool:
        return all(ops & need for need in self.needs)


@dataclass(frozen=True)
class PassRecord:
    """One pass run: node counts before and after (a pass may change a graph and keep its count)."""

    name: str
    nodes_before: int
    nodes_after: int
    changed: bool


@dataclass
class OptimizeReport:
    graph: Graph
    level: str
    records: list[PassRecord] = field(default_factory=list)

    @property
    def applied(self) -> list[str]:
        """Names of the passes that changed the graph, in order, without repeats."""
        seen: list[str] = []
        for r in self.records:
            if r.changed and r.name not in seen:
                seen.append(r.name)
        return seen


def _p(fn: Pass, *needs: set[Op]) -> GraphPass:
    return GraphPass(fn.__name__, fn, tuple(frozenset(n) for n in needs))


# fold_shapes ends with fold_constants, which has just run: without Shape or
# Size it has nothing left to fold.
# fuse_qdq first: constant folding would turn its integer weights back into float ones.
BASIC = (_p(fuse_qdq, {Op.DEQUANTIZE_LINEAR},
            {Op.CONV, Op.GEMM, Op.MATMUL, Op.ADD, Op.MAX_POOL, Op.FLATTEN, Op.RESHAPE,
             Op.TRANSPOSE, Op.SQUEEZE, Op.EXPAND_DIMS, Op.GLOBAL_AVG_POOL}),
         _p(fold_constants), _p(fold_shapes, {Op.SHAPE, Op.SIZE}),
         _p(remove_identity, {Op.IDENTITY, Op.CAST}), _p(eliminate_dead))
LAYOUT = (_p(cancel_transposes, {Op.TRANSPOSE}), _p(remove_identity, {Op.IDENTITY, Op.CAST}))
# Order matters: attention before MatMul+Add (its mask Add is no bias); the
# residual Add before activations (act(conv + z), not act(conv) + z); bias Adds
# into MatMul epilogues before a residual Add joins its LayerNorm; shared reads ordered
# before the residual Add picks its conv (a shortcut moved beside the block's first conv
# leaves the Add to the second).
FUSIONS = (_p(fuse_conv_bn, {Op.CONV}, {Op.BATCH_NORM}),
           _p(fuse_layer_norm, {Op.SUB}, {Op.MEAN}),
           _p(fuse_gelu, {Op.ERF, Op.TANH}),
           _p(fuse_attention, {Op.SOFTMAX}, {Op.MATMUL}),
           _p(fuse_matmul_add, {Op.MATMUL}, {Op.ADD}),
           _p(order_shared_reads, {Op.CONV, Op.GEMM, Op.MATMUL}),
           _p(fuse_residual, {Op.CONV}, {Op.ADD}),
           _p(fuse_skip_layer_norm, {Op.LAYER_NORM}, {Op.ADD}),
           _p(fuse_activation, {Op.CONV, Op.GEMM, Op.MATMUL}),
           _p(eliminate_dead))
_ROUNDS = 3


def passes_for(level: str) -> tuple[tuple[GraphPass, ...], ...]:
    """The stages of ``level``; each stage repeats until it changes nothing (a few rounds)."""
    if level not in LEVELS:
        raise InvalidArgumentError(
            f"unknown optimization level {level!r}; allowed: {', '.join(LEVELS)}"
        )
    stages: dict[str, tuple[tuple[GraphPass, ...], ...]] = {
        "none": (),
        "basic": (BASIC,),
        "extended": (BASIC, FUSIONS),
        "all": (BASIC, LAYOUT, FUSIONS),
    }
    return stages[level]


def optimize(graph: Graph, level: str = "all") -> Graph:
    """``graph`` optimized at ``level`` (a new graph; the argument is not changed)."""
    return optimize_with_report(graph, level).graph


def optimize_with_report(graph: Graph, level: str = "all") -> OptimizeReport:
    """Like :func:`optimize`, also recording what each pass did."""
    report = OptimizeReport(graph, level)
    current = graph
    if level != "none" and ORDER_KEY in graph.metadata:
        # The record of moved nodes speaks of this optimization only: a graph optimized
        # before (and saved with its record) starts afresh.
        current = graph.copy()
        del current.metadata[ORDER_KEY]
    version = 0                         # bumped by every change to the graph
    clean: dict[str, int] = {}          # pass -> version it last ran on and left alone
    for stage in passes_for(level):
        for _ in range(_ROUNDS):
            changed = False
            for p in stage:
                ops = frozenset(n.op for n in current.nodes)
                if clean.get(p.name) == version or not p.applies_to(ops):
                    continue
                after = p.fn(current)
                diff = _differs(current, after)
                report.records.append(PassRecord(p.name, len(current.nodes),
                                                 len(after.nodes), diff))
                changed |= diff
                current = after
                if diff:
                    version += 1
                else:
                    clean[p.name] = version
            if not changed:
                break
    if level != "none":
        current = _optimize_subgraphs(current, level)
        current.verify()
    report.graph = current
    return report


def _optimize_subgraphs(graph: Graph, level: str) -> Graph:
    """``graph`` with each subgraph optimized at ``level`` as the graph it runs as: its
    formal inputs as declared, its captures as inputs typed as the enclosing graph
    types them (a subgraph with a capture of unknown type is left as it is). Nodes a
    body's passes moved are recorded in ``graph``'s ``keel.node_order``, each line
    naming the body."""
    from keel.errors import KeelError
    from keel.graph.shape_inference import propagate
    from keel.graph.subgraphs import captured_inputs, captures, executable, subgraphs

    if not any(subgraphs(n) for n in graph.nodes):
        return graph
    try:
        types = propagate(graph).types
    except KeelError:
        return graph
    g = graph.copy()
    moves: list[str] = []
    for node in g.nodes:
        names = captures(node)
        cap_types = [types.get(i) for i in captured_inputs(node)]
        if any(t is None for t in cap_types):
            continue
        for attr, body in subgraphs(node):
            better = optimize(executable(body, names, cap_types), level)
            moves.extend(f"in {node.name}'s {attr}: {line}"
                         for line in better.metadata.get(ORDER_KEY, "").splitlines())
            node.attrs[attr] = Graph(body.name, better.nodes, list(body.inputs),
                                     better.outputs, better.initializers,
                                     better.value_types, body.opset, body.metadata)
    if moves:
        g.metadata[ORDER_KEY] = "\n".join([*g.metadata.get(ORDER_KEY, "").splitlines(), *moves])
    return g


def _differs(before: Graph, after: Graph) -> bool:
    if len(before.nodes) != len(after.nodes) or set(before.initializers) != set(
            after.initializers):
        return True
    return any(a.op != b.op or a.inputs != b.inputs or a.outputs != b.outputs
               or not _same_attrs(a.attrs, b.attrs)
               for a, b in zip(before.nodes, after.nodes, strict=True))


def _same_attrs(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if x is y:
            continue
        if isinstance(x, Graph) and isinstance(y, Graph):    # a subgraph (copied by a pass)
            if _differs(x, y) or x.input_names != y.input_names or \
                    x.output_names != y.output_names:
                return False
            continue
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif type(x) is not type(y) or not _equal(x, y):
            return False
    return True


def _equal(x: Any, y: Any) -> bool:
    try:
        return bool(x == y)
    except (TypeError, ValueError):      # e.g. tuples holding arrays: call them different
        return False
