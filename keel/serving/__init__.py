"""``keel serve``: the Open Inference Protocol (KServe v2) over REST and gRPC.

Nothing here is imported by ``import keel``; the web and gRPC packages come
with the ``serve`` extra (``pip install "keel-runtime[serve]"``) and are
imported only when a server starts.
"""

from __future__ import annotations

import importlib

from keel.errors import KeelError

__all__ = ["require_serve_packages"]

_PACKAGES = {"grpc": "grpcio", "starlette": "starlette", "uvicorn": "uvicorn",
             "prometheus_client": "prometheus-client", "google.protobuf": "protobuf"}


def require_serve_packages() -> None:
    """Raise ``KeelError`` naming what is missing when the ``serve`` extra is not installed."""
    missing = []
    for module, package in _PACKAGES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise KeelError(f"keel serve needs the serve extra: pip install \"keel-runtime[serve]\" "
                        f"(missing: {', '.join(missing)})")
