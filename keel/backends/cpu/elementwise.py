"""cpu kernels of the elementwise family."""

from __future__ import annotations
