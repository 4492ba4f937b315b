"""The backend registry: who can run ops here, in which order, and why not.

A :class:`BackendRegistry` is an object (tests build fresh ones). Backends are
registered as *factories* with a priority; the factory runs once, on first
use, and its failure is recorded, not raised (``report()`` says why).
Third-party backends arrive through the ``keel.backends`` entry-point group:
each entry point names a factory (usually a ``Backend`` subclass); an integer
``priority`` attribute on it sets its priority (default 0).

The *priority chain* is the order automatic selection walks: by default every
registered backend, highest priority first; ``set_priority([...])`` replaces it
with exactly the names given (backends left out can still be pinned by name).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from keel._fork import renew_after_fork
from keel.backends.base import Availability, Backend
from keel.errors import BackendSelectionError, InvalidArgumentError
from keel.ops.registry import Op

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendFactory",
    "BackendRegistry",
    "builtin_registry",
    "default_registry",
    "register_backend",
    "set_backend_priority",
]

ENTRY_POINT_GROUP = "keel.backends"

BackendFactory = Callable[[], Backend]


class EntryPointLike(Protocol):
    """What ``load_entry_points`` needs of an entry point (``importlib.metadata.EntryPoint``)."""

    name: str

    def load(self) -> Any: ...


@dataclass
class _Entry:
    name: str
    factory: BackendFactory
    priority: int
    order: int
    instance: Backend | None = None
    failure: str | None = None        # why the factory could not build the backend
    manual: str = ""                  # why it is left out of the default chain ("": it is not)


class BackendRegistry:
    """Backends by name, a priority chain, and a record of why each is unavailable."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._chain: list[str] | None = None       # None: by priority
        self._lock = threading.RLock()
        renew_after_fork(self, "_lock")

    # ---- registration --------------------------------------------------
    def register(self, name: str, factory: BackendFactory, priority: int = 0, *,
                 replace: bool = False, manual: str = "") -> None:
        """Register ``factory`` (called once, on first use) under ``name``.

        ``manual`` (a reason) leaves the backend out of the default priority chain:
        it runs where pinned or named in ``set_priority``, and automatic selection
        never builds it (its availability check may cost seconds) and says why.
        """
        if not isinstance(name, str) or not name.strip() or name != name.strip().lower():
            raise InvalidArgumentError(
                f"backend name must be a non-empty lower-case string, got {name!r}")
        if not callable(factory):
            raise InvalidArgumentError(
                f"backend factory for {name!r} must be callable, got {type(factory).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidArgumentError(
                f"priority of backend {name!r} must be an int, got {priority!r}")
        with self._lock:
            if name in self._entries and not replace:
                raise InvalidArgumentError(
                    f"backend {name!r} is already registered; pass replace=True to replace it")
            self._entries[name] = _Entry(name, factory, priority, len(self._entries),
                                         manual=manual)

    def load_entry_points(self, entry_points: Iterable[EntryPointLike] | None = None,
                          ) -> list[str]:
        """Register the backends of the ``keel.backends`` entry-point group.

        A plugin that fails to load is registered as unavailable with the error
        as its reason; a plugin may not take the name of a registered backend.
        Returns the names registered.
        """
        eps = _installed_entry_points() if entry_points is None else entry_points
        added = []
        for ep in eps:
            if ep.name in self._entries:
                continue    # built-ins and explicit registrations win over plugins
            try:
                factory = ep.load()
            except Exception as exc:
                self._register_broken(ep.name, f"plugin failed to load: "
                                               f"{type(exc).__name__}: {exc}")
            else:
                self.register(ep.name, factory, _plugin_priority(factory))
            added.append(ep.name)
        return added

    def _register_broken(self, name: str, why: str) -> None:
        def broken() -> Backend:
            raise RuntimeError(why)

        self.register(name, broken, priority=0)
        self._entries[name].failure = why

    def with_instance(self, name: str, backend: Backend) -> BackendRegistry:
        """A new registry like this one, with ``backend`` in place of ``name``'s backend.

        Every other backend is this registry's own (built on first use, shared);
        the priority chain is the same. A model with its own cpu thread count or
        hardware profile uses one.
        """
        self._entry(name)
        own = BackendRegistry()
        for i, other in enumerate(self.names()):
            def factory(n: str = other) -> Backend:
                return backend if n == name else self.instance(n)

            own.register(other, factory, priority=-i)
        own.set_priority(self.priority)
        return own

    # ---- lookup ----------------------------------------------------------
    def manual(self) -> dict[str, str]:
        """Registered backends outside the priority chain that were registered ``manual``,
        with why they are left out."""
        chain = self.priority
        return {n: e.manual for n, e in self._entries.items() if e.manual and n not in chain}

    def names(self) -> list[str]:
        """Registered names: the priority chain first, then the rest by priority."""
        chain = self.priority
        rest = [n for n in self._by_priority(everything=True) if n not in chain]
        return chain + rest

    @property
    def priority(self) -> list[str]:
        """The priority chain automatic selection walks, first choice first."""
        return list(self._chain) if self._chain is not None else self._by_priority()

    def set_priority(self, names: Sequence[str]) -> None:
        """Replace the priority chain with exactly ``names``, in that order."""
        if isinstance(names, str) or not names:
            raise InvalidArgumentError(
                f"priority must be a non-empty list of backend names, got {names!r}")
        unknown = [n for n in names if n not in self._entries]
        if unknown:
            raise InvalidArgumentError(
                f"unknown backend {unknown[0]!r} in priority list; registered: "
                f"{', '.join(self.names())}")
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"priority list {list(names)} names a backend twice")
        self._chain = list(names)

    def instance(self, name: str) -> Backend:
        """The backend called ``name``, built on first use, available or not.

        Unknown names and factories that failed raise ``BackendSelectionError``.
        """
        entry = self._entry(name)
        with self._lock:
            if entry.instance is None and entry.failure is None:
                entry.instance, entry.failure = self._build(entry)
        if entry.instance is None:
            raise BackendSelectionError(name, entry.failure or "failed to initialize")
        return entry.instance

    def get(self, name: str) -> Backend:
        """The backend called ``name``; ``BackendSelectionError`` when it cannot run here."""
        backend = self.instance(name)
        backend.require_available()
        return backend

    def available(self) -> list[Backend]:
        """Backends of the priority chain that can run here, in priority order."""
        out = []
        for name in self.priority:
            if self.availability(name).available:
                out.append(self.instance(name))
        return out

    def availability(self, name: str) -> Availability:
        """Whether ``name`` can run here and why not; never raises for registered names."""
        try:
            return self.instance(name).availability()
        except BackendSelectionError as exc:
            if name not in self._entries:
                raise
            return Availability(False, exc.reason)

    def report(self) -> dict[str, Availability]:
        """Every registered backend, available or why not."""
        return {name: self.availability(name) for name in self.names()}

    def supported_on(self, op: Op) -> tuple[str, ...]:
        """Names of the available backends with a kernel for ``op``, in priority order."""
        return tuple(b.name for b in self._available_all() if op in b.kernels)

    # ---- internals ---------------------------------------------------------
    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise BackendSelectionError(
                str(name), f"no backend of that name is registered; registered: {known}"
            ) from None

    def _build(self, entry: _Entry) -> tuple[Backend | None, str | None]:
        try:
            backend = entry.factory()
        except Exception as exc:
            return None, f"failed to initialize: {type(exc).__name__}: {exc}"
        if not isinstance(backend, Backend):
            return None, (f"factory returned {type(backend).__name__}, "
                          "not a keel.backends.base.Backend")
        if backend.name != entry.name:
            return None, (f"factory built a backend named {backend.name!r}, "
                          f"registered as {entry.name!r}")
        backend.peers = self.supported_on
        return backend, None

    def _by_priority(self, everything: bool = False) -> list[str]:
        entries = sorted(self._entries.values(), key=lambda e: (-e.priority, e.order))
        return [e.name for e in entries if everything or not e.manual]

    def _available_all(self) -> list[Backend]:
        """The available backends, opt-in (``manual``) ones only where something already
        built them: naming where an op runs must not start a backend's drivers."""
        chain = self.priority
        return [self.instance(n) for n in self.names()
                if (n in chain or not self._entries[n].manual
                    or self._entries[n].instance is not None)
                and self.availability(n).available]

    def __repr__(self) -> str:
        return f"<BackendRegistry {self.names()}>"


def _plugin_priority(factory: Any) -> int:
    priority = getattr(factory, "priority", 0)
    return priority if isinstance(priority, int) and not isinstance(priority, bool) else 0


# ---- the built-in backends and the process-wide registry ---------------------

# Default chain gpu → cpu → reference (seed 004): the reference backend is the
# last resort, used automatically only for ops no faster backend has.
# webgpu is outside the default chain (register(manual=...)): pinned, or named in
# set_priority, it comes last, and there it is chosen only where its Backend.auto_blocked
# allows (a calibration that measured it ahead), never as a fallback before the reference.
BUILTIN_PRIORITIES = {"gpu": 300, "cpu": 200, "reference": 100, "webgpu": 50}
WEBGPU_MANUAL = ("opt-in: automatic selection does not start WebGPU drivers to decide; pin "
                 "backend='webgpu', or put it in the priority chain where `keel calibrate` "
                 "measured it ahead of the cpu backend (a CPU adapter such as llvmpipe never is)")


def _reference() -> Backend:
    from keel.backends.reference.backend import ReferenceBackend

    return ReferenceBackend()


def _cpu() -> Backend:
    from keel.backends.cpu.backend import CpuBackend

    return CpuBackend()


def _gpu() -> Backend:
    from keel.backends.gpu.backend import GpuBackend

    return GpuBackend()


def _webgpu() -> Backend:
    from keel.backends.webgpu.backend import WebGpuBackend

    return WebGpuBackend()


def builtin_registry() -> BackendRegistry:
    """A fresh registry with keel's own backends only (no plugins)."""
    registry = BackendRegistry()
    registry.register("reference", _reference, BUILTIN_PRIORITIES["reference"])
    registry.register("cpu", _cpu, BUILTIN_PRIORITIES["cpu"])
    registry.register("gpu", _gpu, BUILTIN_PRIORITIES["gpu"])
    registry.register("webgpu", _webgpu, BUILTIN_PRIORITIES["webgpu"], manual=WEBGPU_MANUAL)
    return registry


_DEFAULT: BackendRegistry | None = None
_DEFAULT_LOCK = threading.Lock()
renew_after_fork(sys.modules[__name__], "_DEFAULT_LOCK")   # free in a forked child


def _installed_entry_points() -> Iterable[Any]:
    """The installed ``keel.backends`` entry points. ``importlib.metadata`` (2 MB and tens
    of ms of imports: email, socket, csv...) is asked only when some distribution on
    ``sys.path`` may declare one (:func:`_may_declare_backends`)."""
    if not _may_declare_backends():
        return []
    from importlib import metadata

    return metadata.entry_points(group=ENTRY_POINT_GROUP)


def _may_declare_backends() -> bool:
    """Whether an ``entry_points.txt`` of a distribution on ``sys.path`` names the group,
    or a path entry cannot be scanned here (a zip file: then importlib.metadata decides)."""
    header = f"[{ENTRY_POINT_GROUP}]"
    for entry in sys.path:
        folder = entry or "."
        try:
            names = os.listdir(folder)
        except NotADirectoryError:
            return True
        except OSError:
            continue                      # a missing folder holds no distribution
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            try:
                with open(os.path.join(folder, name, "entry_points.txt"), "rb") as f:
                    if header.encode() in f.read():
                        return True
            except OSError:
                continue
    return False


def default_registry() -> BackendRegistry:
    """The process-wide registry: built-ins plus entry-point plugins, made on first use."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            registry = builtin_registry()
            registry.load_entry_points()
            _DEFAULT = registry
        return _DEFAULT


def register_backend(name: str, factory: BackendFactory, priority: int = 0, *,
                     replace: bool = False) -> None:
    """Register a backend in the process-wide registry."""
    default_registry().register(name, factory, priority, replace=replace)


def set_backend_priority(names: Sequence[str]) -> None:
    """Set the process-wide priority chain (seed 004: ``["gpu", "cpu", "reference"]``)."""
    default_registry().set_priority(names)
