"""Schemas of the matmul family."""

from __future__ import annotations
