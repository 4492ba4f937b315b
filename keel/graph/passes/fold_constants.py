"""Constant folding: a node whose inputs are all constants becomes constants.

The node runs once, at optimize time, through keel's executor on the
reference backend (the executable spec; see
:func:`keel.graph.shape_inference.evaluate_node`), and its outputs become
initializers. Initializers that are
also graph inputs are not constants: the caller may feed them. Results
larger than :data:`FOLD_LIMIT_BYTES`, or whose size cannot be known first,
are left to run normally, so folding never blows up a model's size.
"""

from __future__ import annotations

import numpy as np

from keel.dtypes import DType
from keel.errors import KeelError
from keel.graph.ir import Graph, Node
from keel.graph.shape_inference import evaluate_node, propagate
from keel.ops.registry import OpGroup
from keel.ops.types import TensorType

__all__ = ["FOLD_LIMIT_BYTES", "fold_constants"]

FOLD_LIMIT_BYTES = 64 << 20
# Control flow may run long (a loop); sequences and optionals are not arrays.
_NEVER = OpGroup.CONTROL_FLOW | OpGroup.SEQUENCE


def fold_constants(graph: Graph) -> Graph:
    """A copy of ``graph`` with every foldable node replaced by its constant outputs."""
    g = graph.copy()
    try:
        types = propagate(g).types
    except KeelError:
        return g  # an ill-typed graph is reported when it is loaded or run, not here
    kept: list[Node] = []
    for node in g.nodes:
        if not _fold(g, node, types):
            kept.append(node)
    g.nodes = kept
    for name in list(g.value_types):
        if name in g.initializers:
            del g.value_types[name]
    return g


def _fold(g: Graph, node: Node, types: dict[str, TensorType | None]) -> bool:
    if node.op in _NEVER:
        return False
    present = node.present_inputs()
    if not present or not all(g.is_constant(i) for i in present):
        return False
    expected = [types.get(o) if o else None for o in node.outputs]
    if not _small_enough(node, g, expected):
        return False
    values = evaluate_node(node, [g.initializers[i] if i else None for i in node.inputs])
    if values is None or len(values) < len(node.outputs):
        return False
    results = {}
    for name, value, want in zip(node.outputs, values, expected, strict=False):
        if not name or value is None:
            continue
        checked = _conform(value, want)
        if checked is None:
            return False
        results[name] = checked
    g.initializers.update(results)
    return True


def _small_enough(node: Node, g: Graph, expected: list[TensorType | None]) -> bool:
    if node.op in OpGroup.DATA_DEPENDENT:
        # Output bounded by the input's size; the type is unknown before running.
        total = sum(g.initializers[i].nbytes for i in node.present_inputs())
        return total <= FOLD_LIMIT_BYTES
    sizes = [t.nbytes() if t is not None else None for t in expected]
    return all(s is not None and s <= FOLD_LIMIT_BYTES for s in sizes)


def _conform(value: np.ndarray, want: TensorType | None) -> np.ndarray | None:
    """The kernel's result in the inferred dtype; a shape disagreement means: do not fold."""
    if want is None:
        return value
    if want.shape is not None and want.is_static and tuple(value.shape) != tuple(want.shape):
        return None
    if want.dtype is not DType.STRING and value.dtype != want.dtype.numpy:
        return value.astype(want.dtype.numpy)
    return value
