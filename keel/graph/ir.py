"""keel's model IR: values, nodes and graphs.

A ``Graph`` holds nodes in topological order. Values are named; a node input
of ``""`` is an absent optional input. Initializers are constant NumPy arrays.
``verify()`` checks the invariants and raises ``VerificationError``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import VerificationError
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["NO_ATTRS", "Graph", "Node", "Value", "match_attr_name"]


def _canon(name: str) -> str:
    return name.replace("_", "").lower()


# Spellings that differ between ONNX and keel schemas beyond case and underscores.
_SYNONYMS: dict[str, tuple[str, ...]] = {
    "group": ("groups",),
    "groups": ("group",),
    "epsilon": ("eps",),
    "eps": ("epsilon",),
    "to": ("dtype",),
    "dtype": ("to",),
    "keepdims": ("keep_dims",),
}


def match_attr_name(wanted: str, names: Iterable[str]) -> str | None:
    """The name among ``names`` that spells attribute ``wanted``, or None.

    ONNX spells attributes ``transA``/``keepdims``; keel schemas use snake_case
    (``trans_a``). Matching ignores case and underscores and knows a few synonyms,
    so the importer, the passes and the exporter agree on one spelling: the schema's.
    """
    pool = list(names)
    if wanted in pool:
        return wanted
    for cand in (wanted, *_SYNONYMS.get(wanted, ())):
        for name in pool:
            if _canon(name) == _canon(cand):
                return name
    return None


class _NoAttrs(dict[str, Any]):
    """The attributes of a node that has none: one empty dict shared by every such node
    (a large graph holds hundreds of thousands), which refuses to change. Give a node
    its own dict to set attributes on it."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("NO_ATTRS is shared by every node without attributes and cannot "
                        "change; give the node a dict of its own")

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = _refuse
    __ior__ = _refuse


NO_ATTRS: dict[str, Any] = _NoAttrs()


@dataclass(frozen=True)
class Value:
    """A named graph input or output with its type."""

    name: str
    type: TensorType


@dataclass(slots=True)
class Node:
    """One op application. ``attrs`` are schema-normalized.

    Slotted: a graph may hold hundreds of thousands of nodes, and a slotted node
    takes half the memory of one with an instance dictionary."""

    name: str
    op: Op
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    # Where the node came from (ONNX op_type, fused pattern) for reports.
    origin: str = ""

    def present_inputs(self) -> list[str]:
        return [i for i in self.inputs if i]

    def input(self, index: int) -> str:
        """Input ``index``, or ``""`` when it is absent or past the end."""
        return self.inputs[index] if index < len(self.inputs) else ""

    def attr(self, name: str, default: Any = None) -> Any:
        """Attribute ``name`` in ONNX or keel spelling (see :func:`match_attr_name`)."""
        key = match_attr_name(name, self.attrs)
        if key is None or self.attrs[key] is None:
            return default
        return self.attrs[key]


@dataclass
class Graph:
    name: str
    nodes: list[Node]
    inputs: list[Value]
    outputs: list[Value]
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    # Known types of intermediate values (from the model or from inference).
    value_types: dict[str, TensorType] = field(default_factory=dict)
    opset: int = 0
    metadata: dict[str, str] = field(default_factory=dict)

    # ---- queries -------------------------------------------------------
    def producers(self) -> dict[str, Node]:
        return {out: n for n in self.nodes for out in n.outputs if out}

    def consumers(self) -> dict[str, list[Node]]:
        result: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.present_inputs():
                result.setdefault(i, []).append(n)
        return result

    def type_of(self, name: str) -> TensorType | None:
        if name in self.initializers:
            arr = self.initializers[name]
            return TensorType(DType.from_numpy(arr.dtype), tuple(int(d) for d in arr.shape))
        for v in itertools.chain(self.inputs, self.outputs):
            if v.name == name:
                return v.type
        return self.value_types.get(name)

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.inputs]

    @property
    def optional_input_names(self) -> list[str]:
        """Graph inputs that have an initializer: the caller may feed them or not."""
        return [v.name for v in self.inputs if v.name in self.initializers]

    def is_constant(self, name: str) -> bool:
        """True for an initializer the caller cannot override (not also a graph input)."""
        return name in self.initializers and name not in self.input_names

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a non-overridable initializer, else None."""
        return self.initializers[name] if self.is_constant(name) else None

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.outputs]

    def copy(self) -> Graph:
        """A copy whose nodes, their lists and dicts may be changed freely (arrays are shared)."""
        return Graph(
            name=self.name,
            nodes=[_copy_node(n) for n in self.nodes],
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            initializers=dict(self.initializers),
            value_types=dict(self.value_types),
            opset=self.opset,
            metadata=dict(self.metadata),
        )

    def fresh_name(self, base: str, taken: set[str] | None = None) -> str:
        """A name used nowhere in the graph.

        ``taken`` (from :meth:`names`, kept by the caller across many calls) saves
        scanning the graph each time; the new name is added to it.
        """
        used = self._all_names() if taken is None else taken
        for i in itertools.count():
            cand = f"{base}_{i}"
            if cand not in used:
                used.add(cand)
                return cand
        raise AssertionError("unreachable")

    def names(self) -> set[str]:
        """Every value and node name in the graph."""
        return self._all_names()

    def _all_names(self) -> set[str]:
        names = set(self.initializers) | set(self.input_names) | set(self.output_names)
        for n in self.nodes:
            names.add(n.name)
            names.update(n.inputs)
            names.update(n.outputs)
        return names

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    # ---- invariants ----------------------------------------------------
    def verify(self, outer: Iterable[str] = ()) -> None:
        """Raise ``VerificationError`` unless the graph is well formed.

        ``outer`` names the values of enclosing graphs a subgraph may read. The
        subgraphs of control-flow nodes (graph-valued attributes) are checked
        too, each seeing this graph's values and the captures its node lists.
        """
        visible = frozenset(outer)        # a subgraph's own values may shadow these
        # A dict, not a set: a third of the bytes for a large graph's names (a set keeps
        # its table at most 60% full and grows it fourfold).
        defined: dict[str, None] = dict.fromkeys(self.initializers)
        for v in self.inputs:
            if v.name in defined and v.name not in self.initializers:
                raise VerificationError(f"graph input {v.name!r} is declared twice")
            defined[v.name] = None
        for n in self.nodes:
            self._verify_node(n, defined, visible)
            for key, body in n.attrs.items():
                if isinstance(body, Graph):
                    captured = n.attrs.get("captures") or ()
                    try:
                        body.verify({*defined, *visible, *captured})
                    except VerificationError as exc:
                        raise VerificationError(
                            f"in subgraph {key!r} of node {n.name!r}: {exc.message}") from None
        for v in self.outputs:
            if v.name not in defined and v.name not in visible:
                raise VerificationError(f"graph output {v.name!r} is produced by no node")
        del defined                 # one set of names at a time: a large graph's are large
        node_names: dict[str, None] = {}
        for n in self.nodes:
            if n.name in node_names:
                raise VerificationError(f"node name {n.name!r} is used twice")
            node_names[n.name] = None

    def _verify_node(self, n: Node, defined: dict[str, None],
                     visible: frozenset[str] = frozenset()) -> None:
        if not isinstance(n.op, Op):
            raise VerificationError(f"node {n.name!r} has op {n.op!r}, not an Op")
        for i in n.present_inputs():
            if i not in defined and i not in visible:
                raise VerificationError(
                    f"node {n.name!r} ({n.op.value}) reads {i!r}, which is not defined "
                    "before it (dangling value or nodes out of topological order)"
                )
        for o in n.outputs:
            if o and o in defined:
                raise VerificationError(f"value {o!r} is produced twice (by node {n.name!r})")
            if o:
                defined[o] = None

    def toposort(self) -> None:
        """Reorder nodes topologically, keeping the given order where it is free.

        A cycle or a value that no node, input or initializer defines raises
        ``VerificationError``.
        """
        available = set(self.initializers) | set(self.input_names) | {""}
        producer: dict[str, int] = {}
        for idx, n in enumerate(self.nodes):
            for o in n.outputs:
                if o:
                    producer.setdefault(o, idx)
        waiting: list[int] = [0] * len(self.nodes)
        dependents: dict[int, list[int]] = {}
        for idx, n in enumerate(self.nodes):
            for i in set(n.inputs) - available:
                if i not in producer:
                    raise VerificationError(
                        f"node {n.name!r} ({n.op.value}) reads {i!r}, which nothing defines"
                    )
                waiting[idx] += 1
                dependents.setdefault(producer[i], []).append(idx)
        ready = [idx for idx, w in enumerate(waiting) if w == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            idx = heapq.heappop(ready)
            order.append(idx)
            for d in dependents.get(idx, ()):
                waiting[d] -= 1
                if waiting[d] == 0:
                    heapq.heappush(ready, d)
        if len(order) < len(self.nodes):
            stuck = [self.nodes[i].name for i, w in enumerate(waiting) if w > 0][:5]
            raise VerificationError(f"graph has a cycle through: {', '.join(stuck)}")
        self.nodes = [self.nodes[i] for i in order]

    def remove_unused_initializers(self) -> None:
        used = {i for n in self.nodes for i in n.inputs} | set(self.output_names)
        self.initializers = {k: v for k, v in self.initializers.items() if k in used}

    def replace_uses(self, old: str, new: str, nodes: Iterable[Node] | None = None) -> None:
        """Make every node reading ``old`` read ``new``.

        Graph outputs keep their names: a pass must not remove the producer of
        a graph output (see ``keel.graph.passes``).
        """
        for n in self.nodes if nodes is None else nodes:
            n.inputs = [new if i == old else i for i in n.inputs]


def _copy_node(n: Node) -> Node:
    # Subgraphs are copied too: a pass may change a copy's subgraph freely.
    attrs = NO_ATTRS if not n.attrs else \
        {k: v.copy() if isinstance(v, Graph) else v for k, v in n.attrs.items()}
    return Node(n.name, n.op, list(n.inputs), list(n.outputs), attrs, n.origin)
