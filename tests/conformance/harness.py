"""Conformance cases: one op, generated inputs, attributes and tolerances.

Each family module ``cases_<family>.py`` exposes ``CASES: list[OpCase]``;
``test_conformance.py`` runs every case on every available backend against the
reference backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.ops.registry import Op

__all__ = ["OpCase"]


@dataclass(frozen=True)
class OpCase:
    id: str
    op: Op
    inputs: Callable[[np.random.Generator], list[np.ndarray | None]]
    attrs: dict[str, Any] = field(default_factory=dict)
    rtol: float = 1e-5
    atol: float = 1e-6
