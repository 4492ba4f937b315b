"""cuDNN for the gpu backend, through NVIDIA's ``nvidia-cudnn-frontend`` package.

CuPy 14 no longer ships a cuDNN binding (``cupy.cudnn`` is gone), so keel
reaches cuDNN through the frontend's Python package (module ``cudnn``): its
graph API builds a fused operation graph (conv, bias, residual add,
activation), asks cuDNN's heuristics for engines, and executes on device
pointers and a stream that keel passes in. It loads the ``libcudnn.so.9`` of
the ``nvidia-cudnn-cu*`` wheel that CuPy/torch installs put in site-packages.

Nothing here is imported with keel: :data:`LIBRARY` imports ``cudnn`` the
first time a planner asks whether cuDNN is available, and remembers the
answer with its reason (a missing package, a library that does not load, a
version too old). Handles are made lazily, one per (thread, device): cuDNN
forbids sharing a handle between threads that run at once.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from keel._fork import renew_after_fork
from keel.backends.base import Availability

__all__ = ["INSTALL_HINT", "LIBRARY", "CudnnLibrary"]

INSTALL_HINT = "install it with: pip install 'keel-runtime[cuda12]' (nvidia-cudnn-frontend)"
# The graph API keel builds (fused conv + pointwise graphs, numerical-note filters)
# needs cuDNN 8.9 or newer; version numbers read major * 10000 + minor * 100 (9.x) or
# major * 1000 + minor * 100 (8.x).
_OLDEST = (8, 9)


def _version(number: int) -> tuple[int, int]:
    """(major, minor) of ``cudnn.backend_version()`` (9.19.0 reads 91900, 8.9.7 reads 8907)."""
    if number >= 10000:
        return number // 10000, number // 100 % 100
    return number // 1000, number // 100 % 10


class CudnnLibrary:
    """The ``cudnn`` module, its availability (checked once) and per-thread handles.

    ``loader`` replaces ``importlib.import_module("cudnn")`` (tests pass a fake).
    """

    def __init__(self, loader: Callable[[], Any] | None = None) -> None:
        self._loader = loader or (lambda: importlib.import_module("cudnn"))
        self._module: Any = None
        self._availability: Availability | None = None
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")       # free in a forked child
        self._local = threading.local()

    @property
    def module(self) -> Any:
        """The imported ``cudnn`` module (check :meth:`availability` first)."""
        if self._module is None:
            self._module = self._loader()
        return self._module

    def availability(self) -> Availability:
        """Whether cuDNN can run conv graphs here, and why (not); decided once."""
        with self._lock:
            if self._availability is None:
                self._availability = self._check()
            return self._availability

    def _check(self) -> Availability:
        try:
            cudnn = self.module
        except ImportError as exc:
            return Availability(False, f"nvidia-cudnn-frontend is not installed ({exc}); "
                                       f"{INSTALL_HINT}")
        except Exception as exc:
            return Availability(False, f"nvidia-cudnn-frontend failed to import: "
                                       f"{type(exc).__name__}: {exc}")
        try:
            number = int(cudnn.backend_version())
        except Exception as exc:       # the frontend loads, libcudnn.so.9 does not
            return Availability(False, f"the cuDNN library did not load: "
                                       f"{type(exc).__name__}: {exc}")
        major, minor = _version(number)
        if (major, minor) < _OLDEST:
            return Availability(False, f"cuDNN {major}.{minor} is older than the "
                                       f"{_OLDEST[0]}.{_OLDEST[1]} its graph API needs")
        frontend = getattr(cudnn, "__version__", "?")
        return Availability(True, f"cuDNN {major}.{minor} (nvidia-cudnn-frontend {frontend})")

    def handle(self, device: int) -> Any:
        """This thread's cuDNN handle on ``device`` (made on first use, kept)."""
        handles: dict[int, Any] | None = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = {}
        found = handles.get(device)
        if found is None:
            found = handles[device] = self.module.create_handle()
        return found

    def bind_stream(self, handle: Any, stream: int) -> None:
        """Run ``handle``'s work on ``stream`` (the frontend skips an unchanged stream)."""
        self.module.set_stream(handle, stream)


LIBRARY = CudnnLibrary()
