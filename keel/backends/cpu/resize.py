"""cpu kernels of the resize family."""

from __future__ import annotations
