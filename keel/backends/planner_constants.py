"""A fingerprint of the cpu planner's constants: what its plans are made from, besides a
node's signature and the machine.

Plans are kept and reused by key: the cpu planner's node plans by request
(``planner.plan``), the op-level path's by call (``Backend.run``) and whole compiled
plans on disk (:mod:`keel.execution.plan_cache`). An edit to a planner's source changes
the plan cache's source stamp, but a constant changed in a running process (a test's
``monkeypatch``, a script comparing thresholds) does not: without this fingerprint in
their keys, a model loaded after the change ran the plan made before it.

The fingerprint is two checksums (zlib's CRC-32 and Adler-32) and the length of a
canonical text of every UPPER_CASE global of the planner modules (numbers, strings, enums,
and tuples, lists, sets, dicts and dataclasses of them; functions and other objects
printed by address are code, which the source stamp covers, written as a placeholder).
Sets are written with their members sorted and enums by name, never by ``repr``: a set's
``repr`` follows the process's string hash seed, and the compiled-plan cache on disk must
find the same key in every process. It is computed once and kept (:func:`current`);
:func:`refresh` computes it again (about 0.4 ms on the 2-core Xeon: texts of values that
cannot change in place are kept) once per :func:`once` scope: a model's load (its
plan-cache key and, on a miss, its placement) or a placement (``placement.place``, its
If / Loop bodies' placements inside it). Reading it on every op-level call costs one
global read.

The gpu and webgpu planners are not covered: they are imported only with their backends,
and a key must not depend on what a process happened to import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import re
import threading
import zlib
from collections.abc import Iterator
from typing import Any

__all__ = ["current", "measure", "once", "refresh"]

PLANNER_MODULES = ("keel.backends.plan", "keel.backends.cpu.planner",
                   "keel.backends.cpu.conv_rules")
_CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
_CACHES = frozenset({"keel.backends.cpu.planner._PLANS"})   # kept plans, not their data
_ADDRESS = " at 0x"                                          # how objects without data print

_CODE = "<code>"                                             # such an object's text

_kept: str | None = None
# Texts of constants that cannot change in place (numbers, strings, enums, tuples and
# frozen sets and dataclasses of them), kept with the value they were written from: a
# fingerprint rewrites only those rebound since (a test's monkeypatch) and the mutable
# ones (dicts, lists, sets), so a model's load does not pay for every constant's text.
_TEXTS: dict[str, tuple[Any, str]] = {}
# ... and of frozen dataclass records inside the mutable ones (RULES' ConvRules), by
# identity, the record kept with its text so that its id is not reused.
_RECORDS: dict[int, tuple[Any, str]] = {}


def measure() -> str:
    """The fingerprint of the planner modules' constants as they are now."""
    lines = []
    for name in PLANNER_MODULES:
        module = importlib.import_module(name)
        for key, value in sorted(vars(module).items()):
            qualified = f"{name}.{key}"
            if _CONSTANT.match(key) and qualified not in _CACHES:
                lines.append(f"{qualified}={_text(qualified, value)}\n")
    data = "".join(lines).encode()
    # two checksums and the length (zlib: hashlib's OpenSSL is not loaded for a .keel run)
    return f"{zlib.crc32(data):08x}{zlib.adler32(data):08x}{len(data):x}"


def _text(qualified: str, value: Any) -> str:
    kept = _TEXTS.get(qualified)
    if kept is not None and kept[0] is value:
        return kept[1]
    text = _canonical(value)
    if _frozen(value):
        _TEXTS[qualified] = (value, text)
    return text


def _canonical(value: Any) -> str:
    """``value`` as text the same in every process: sets sorted, enums by name; an object
    printed by address (a function: code, which the source stamp covers) as _CODE."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (set, frozenset)):
        return "set(" + ",".join(sorted(_canonical(m) for m in value)) + ")"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ",".join(_canonical(m) for m in value) + ")"
    if isinstance(value, dict):
        pairs = sorted((_canonical(k), _canonical(v)) for k, v in value.items())
        return "dict{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kept = _RECORDS.get(id(value))
        if kept is not None and kept[0] is value:
            return kept[1]
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        text = f"{type(value).__qualname__}{_canonical(fields)}"
        if _frozen(value):
            _RECORDS[id(value)] = (value, text)
        return text
    if callable(value) and not isinstance(value, type):
        return _CODE                    # a function, builtin or not
    text = repr(value)
    return _CODE if _ADDRESS in text else text


def _frozen(value: Any) -> bool:
    """Whether ``value`` cannot change in place (so its text can be kept with it)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, enum.Enum)):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_frozen(m) for m in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        params = getattr(value, "__dataclass_params__", None)
        return bool(getattr(params, "frozen", False)) and all(
            _frozen(getattr(value, f.name)) for f in dataclasses.fields(value))
    return callable(value)              # code: its text is _CODE whatever it does


def current() -> str:
    """The fingerprint last computed (computed now the first time); inside a
    :func:`once` scope that measured, the one it measured, whatever other threads did
    since."""
    global _kept
    scoped: str | None = getattr(_scope, "kept", None)
    if scoped is not None:
        return scoped
    if _kept is None:
        _kept = measure()
    return _kept


# This thread's once() scopes: how deep, and the fingerprint refresh() measured in them.
_scope = threading.local()


def refresh() -> str:
    """Compute the fingerprint again and keep it: at the start of each model's planning,
    so a constant changed since the last one gives fresh plans. Inside a :func:`once`
    scope, only the first call measures; the others give what it kept."""
    global _kept
    scoped: str | None = getattr(_scope, "kept", None)
    if scoped is not None:
        return scoped
    _kept = measured = measure()
    if getattr(_scope, "depth", 0) > 0:
        _scope.kept = measured
    return measured


@contextlib.contextmanager
def once() -> Iterator[None]:
    """A scope in which :func:`refresh` measures the constants once (on this thread): the
    steps of one load or placement see the same constants, so measuring them again
    between its steps would cost 0.4 ms each for nothing. Scopes nest; the outermost
    ends it."""
    depth = getattr(_scope, "depth", 0)
    _scope.depth = depth + 1
    try:
        yield
    finally:
        _scope.depth = depth
        if depth == 0:
            _scope.kept = None
