"""Schemas of the pooling family."""

from __future__ import annotations
