"""Schemas of the conv family."""

from __future__ import annotations
