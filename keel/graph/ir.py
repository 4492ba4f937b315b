"""keel's model IR: values, nodes and graphs.

A ``Graph`` holds nodes in topological order. Values are named; a node input
of ``""`` is an absent optional input. Initializers are constant NumPy arrays.
``verify()`` checks the invariants and raises ``VerificationError``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import VerificationError
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["Graph", "Node", "Value"]


@dataclass(frozen=True)
class Value:
    """A named graph input or output with its type."""

    name: str
    type: TensorType


@dataclass
class Node:
    """One op application. ``attrs`` are schema-normalized."""

    name: str
    op: Op
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    # Where the node came from (ONNX op_type, fused pattern) for reports.
    origin: str = ""

    def present_inputs(self) -> list[str]:
        return [i for i in self.inputs if i]


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
    def output_names(self) -> list[str]:
        return [v.name for v in self.outputs]

    def copy(self) -> Graph:
        """A copy whose nodes and dicts may be changed freely (arrays are shared)."""
        return Graph(
            name=self.name,
            nodes=[copy.copy(n) for n in self.nodes],
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            initializers=dict(self.initializers),
            value_types=dict(self.value_types),
            opset=self.opset,
            metadata=dict(self.metadata),
        )

    def fresh_name(self, base: str) -> str:
        taken = self._all_names()
        for i in itertools.count():
            cand = f"{base}_{i}"
            if cand not in taken:
                return cand
        raise AssertionError("unreachable")

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
    def verify(self) -> None:
        """Raise ``VerificationError`` unless the graph is well formed."""
        defined: set[str] = set(self.initializers)
        for v in self.inputs:
            if v.name in defined and v.name not in self.initializers:
                raise VerificationError(f"graph input {v.name!r} is declared twice")
            defined.add(v.name)
        node_names: set[str] = set()
        for n in self.nodes:
            self._verify_node(n, defined, node_names)
        for v in self.outputs:
            if v.name not in defined:
                raise VerificationError(f"graph output {v.name!r} is produced by no node")

    def _verify_node(self, n: Node, defined: set[str], node_names: set[str]) -> None:
        if not isinstance(n.op, Op):
            raise VerificationError(f"node {n.name!r} has op {n.op!r}, not an Op")
        if n.name in node_names:
            raise VerificationError(f"node name {n.name!r} is used twice")
        node_names.add(n.name)
        for i in n.present_inputs():
            if i not in defined:
                raise VerificationError(
                    f"node {n.name!r} ({n.op.value}) reads {i!r}, which is not defined "
                    "before it (dangling value or nodes out of topological order)"
                )
        for o in n.outputs:
            if o and o in defined:
                raise VerificationError(f"value {o!r} is produced twice (by node {n.name!r})")
            if o:
                defined.add(o)

    def toposort(self) -> None:
        """Reorder nodes topologically (stable); a cycle raises ``VerificationError``."""
        available = set(self.initializers) | set(self.input_names) | {""}
        pending = list(self.nodes)
        ordered: list[Node] = []
        while pending:
            ready = [n for n in pending if all(i in available for i in n.inputs)]
            if not ready:
                names = ", ".join(n.name for n in pending[:5])
                raise VerificationError(f"graph has a cycle or dangling inputs at: {names}")
            ready_ids = {id(n) for n in ready}
            pending = [n for n in pending if id(n) not in ready_ids]
            for n in ready:
                ordered.append(n)
                available.update(n.outputs)
        self.nodes = ordered

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
