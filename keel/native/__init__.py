"""Native kernels: small C sources keel compiles for this CPU at first use.

See :mod:`keel.native.build` for how libraries are built, cached and
loaded, :mod:`keel.native.toolchain` for the compiler and flags, and
:mod:`keel.native.pool` for the worker threads that split a kernel's work.
Without a C compiler (or with ``KEEL_NATIVE=off``) :func:`library` returns
None and keel runs its NumPy kernels; :func:`status` says why.
"""

from keel.native.build import NativeLibrary, NativeStatus, available, library, mode, reset, status
from keel.native.pointers import address

__all__ = [
    "NativeLibrary", "NativeStatus", "address", "available", "library", "mode", "reset", "status",
]
