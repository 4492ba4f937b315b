"""Small tools the passes share: use counts, constant lookups and a rewriter.

A pass copies the graph, finds patterns, and records replacements with a
:class:`Rewriter`; ``apply()`` puts each replacement where the *last* node of
its pattern stood (every value the pattern reads from outside is defined
before that point) and drops the rest of the pattern.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.errors import KeelError
from keel.graph.ir import Graph, Node, match_attr_name
from keel.ops.registry import Op
from keel.ops.schema import get_schema

__all__ = ["Rewriter", "const_scalar", "make_attrs", "schema_has"]


def make_attrs(op: Op, given: Mapping[str, Any]) -> dict[str, Any] | None:
    """Schema-normalized attributes from ONNX-spelled ``given``; None if keel cannot say them.

    Returns None when ``op`` has no schema or spells none of a non-default
    attribute, so a fusion that needs it is skipped rather than made wrong.
    """
    try:
        schema = get_schema(op)
    except KeelError:
        return None
    names = [a.name for a in schema.attrs]
    mapped: dict[str, Any] = {}
    for key, value in given.items():
        target = match_attr_name(key, names)
        if target is None:
            return None
        mapped[target] = value
    try:
        return schema.normalize_attrs(mapped)
    except KeelError:
        return None


def schema_has(op: Op, attr: str) -> bool:
    """True when keel's schema for ``op`` exists and spells attribute ``attr``."""
    try:
        schema = get_schema(op)
    except KeelError:
        return False
    return match_attr_name(attr, [a.name for a in schema.attrs]) is not None


def const_scalar(graph: Graph, name: str) -> float | None:
    """The value of a one-element constant, else None."""
    value = graph.constant(name) if name else None
    if value is None or value.size != 1 or value.dtype.kind not in "fiub":
        return None
    return float(np.asarray(value).reshape(-1)[0])


class Rewriter:
    """Collects pattern replacements for one graph and applies them in one sweep."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.index = {id(n): k for k, n in enumerate(graph.nodes)}
        self.producer = graph.producers()
        self.consumers = graph.consumers()
        self.outputs = set(graph.output_names)
        self._claimed: set[int] = set()
        self._at: dict[int, list[Node]] = {}
        self._drop: set[int] = set()
        self._taken: set[str] | None = None

    # ---- queries -------------------------------------------------------
    def only_use(self, value: str, consumer: Node) -> bool:
        """``value`` feeds only ``consumer`` (once) and is not a graph output."""
        if value in self.outputs:
            return False
        users = self.consumers.get(value, [])
        return len(users) == 1 and users[0] is consumer and consumer.inputs.count(value) == 1

    def uses(self, value: str) -> list[Node]:
        return self.consumers.get(value, [])

    def single_consumer(self, value: str) -> Node | None:
        """The one node reading ``value`` (once), when it is not a graph output."""
        users = self.consumers.get(value, [])
        if len(users) == 1 and self.only_use(value, users[0]):
            return users[0]
        return None

    def made_by(self, value: str, *ops: Op) -> Node | None:
        """The unclaimed node producing ``value`` when its op is one of ``ops``."""
        node = self.producer.get(value)
        if node is None or node.op not in ops or self.claimed(node):
            return None
        return node

    def claimed(self, node: Node) -> bool:
        return id(node) in self._claimed

    def fresh(self, base: str) -> str:
        if self._taken is None:
            self._taken = self.graph.names()
        return self.graph.fresh_name(base, self._taken)

    # ---- edits ---------------------------------------------------------
    def replace(self, pattern: Sequence[Node], new: Iterable[Node]) -> None:
        """Replace the nodes of ``pattern`` by ``new`` at the last pattern node's position."""
        ids = [id(n) for n in pattern]
        if any(i in self._claimed for i in ids):
            raise ValueError("a node cannot belong to two rewrites")
        self._claimed.update(ids)
        last = max(pattern, key=lambda n: self.index[id(n)])
        self._at[id(last)] = list(new)
        self._drop.update(ids)

    def apply(self) -> Graph:
        nodes: list[Node] = []
        for n in self.graph.nodes:
            if id(n) in self._at:
                nodes.extend(self._at[id(n)])
            elif id(n) not in self._drop:
                nodes.append(n)
        self.graph.nodes = nodes
        return self.graph

    @property
    def changed(self) -> bool:
        return bool(self._claimed)
