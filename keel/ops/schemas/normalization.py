"""Schemas of the normalization family."""

from __future__ import annotations
