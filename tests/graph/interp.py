"""A tiny graph interpreter for tests: each node runs its reference kernel.

It lets the graph tests check passes for output equivalence without the
executor (which plans memory and backends); it is not part of keel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.reference.kernels import load
from keel.errors import ExecutionError, KeelError
from keel.graph.ir import Graph

CTX = KernelContext(np, "reference", DeviceKind.CPU)


def run_graph(graph: Graph, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every graph output for ``feeds`` (inputs with initializers may be left out)."""
    table = load()
    env: dict[str, Any] = dict(graph.initializers)
    env.update({k: np.asarray(v) for k, v in feeds.items()})
    for name in graph.input_names:
        if name not in env:
            raise KeyError(f"missing feed {name!r}")
    for node in graph.nodes:
        inputs = [env[i] if i else None for i in node.inputs]
        try:
            outs = table.get(node.op).fn(CTX, inputs, node.attrs, None)
        except KeelError:
            raise
        except Exception as exc:
            raise ExecutionError(f"{type(exc).__name__}: {exc}", node=node.name) from exc
        for name, value in zip(node.outputs, outs, strict=False):
            if name:
                env[name] = np.asarray(value)
    return {name: env[name] for name in graph.output_names}
