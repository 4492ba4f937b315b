"""Device arrays at keel's edges: feeds that already live on a CUDA device, fetches that stay.

A feed may be a CuPy array, anything with ``__cuda_array_interface__`` (a torch
CUDA tensor, a Numba device array) or anything exporting DLPack from a CUDA
device. It becomes a CuPy array over the same memory: nothing is copied, and a
program whose first step would copy the feed to the gpu uses it as it is. CuPy
is imported only when such a value is seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_device_array", "is_device_array", "to_host"]

# DLPack device types that are CUDA memory: kDLCUDA, kDLCUDAHost, kDLCUDAManaged.
_CUDA_DLPACK = frozenset({2, 3, 13})


def is_device_array(value: Any) -> bool:
    """Whether ``value`` is array data in CUDA memory (without importing CuPy)."""
    if isinstance(value, np.ndarray):
        return False
    if hasattr(value, "__cuda_array_interface__"):
        return True
    device = getattr(value, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        kind = int(device()[0])
    except Exception:
        return False
    return kind in _CUDA_DLPACK


def as_device_array(value: Any) -> Any:
    """A C-contiguous CuPy array over ``value``'s CUDA memory (copied only to make it
    contiguous)."""
    import cupy

    if isinstance(value, cupy.ndarray):
        array = value
    elif hasattr(value, "__cuda_array_interface__"):
        array = cupy.asarray(value)
    else:
        array = cupy.from_dlpack(value)
    return cupy.ascontiguousarray(array)


def to_host(value: Any) -> np.ndarray:
    """A NumPy copy of a device array (for a host node that reads a device feed)."""
    import cupy

    return np.asarray(cupy.asnumpy(as_device_array(value)))
