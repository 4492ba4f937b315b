"""Run a graph in the graph tests: keel's executor with every node on the reference backend.

Passes are checked for output equivalence by running the graph before and
after them through the same executor that runs inference
(``keel.execution.evaluate.ProgramEvaluator``), placed on the executable spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from keel.execution.evaluate import ProgramEvaluator
from keel.graph.ir import Graph


def run_graph(graph: Graph, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every graph output for ``feeds`` (inputs with initializers may be left out)."""
    arrays = {k: np.asarray(v) for k, v in feeds.items()}
    return {k: np.asarray(v) for k, v in ProgramEvaluator()(graph)(arrays).items()}
