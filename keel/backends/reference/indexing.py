"""reference kernels of the indexing family."""

from __future__ import annotations
