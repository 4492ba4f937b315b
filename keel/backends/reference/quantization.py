"""reference kernels of the quantization family."""

from __future__ import annotations
