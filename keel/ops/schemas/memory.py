"""Schemas of the memory family."""

from __future__ import annotations
