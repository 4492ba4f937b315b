"""A fingerprint of the cpu planner's constants: what its plans are made from, besides a
node's signature and the machine.

Plans are kept and reused by key: the cpu planner's node plans by request
(``planner.plan``), the op-level path's by call (``Backend.run``) and whole compiled
plans on disk (:mod:`keel.execution.plan_cache`). An edit to a planner's source changes
the plan cache's source stamp, but a constant changed in a running process (a test's
``monkeypatch``, a script comparing thresholds) does not: without this fingerprint in
their keys, a model loaded after the change ran the plan made before it.

The fingerprint is a SHA-256 over a canonical text of every UPPER_CASE global of the
planner modules that is plain data (numbers, strings, enums, and tuples, lists, sets,
dicts and dataclasses of them; functions and other objects printed by address are code,
which the source stamp covers). Sets are written with their members sorted and enums by
name, never by ``repr``: a set's ``repr`` follows the process's string hash seed, and
the compiled-plan cache on disk must find the same key in every process. It is computed
once and kept (:func:`current`); :func:`refresh` computes it again, once per model
planned (``placement.place``) and per plan-cache lookup, so reading it on every op-level
call costs one global read.

The gpu and webgpu planners are not covered: they are imported only with their backends,
and a key must not depend on what a process happened to import.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import re
from hashlib import sha256
from typing import Any

__all__ = ["current", "measure", "refresh"]

PLANNER_MODULES = ("keel.backends.plan", "keel.backends.cpu.planner",
                   "keel.backends.cpu.conv_rules")
_CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
_CACHES = frozenset({"keel.backends.cpu.planner._PLANS"})   # kept plans, not their data
_ADDRESS = " at 0x"                                          # how objects without data print

_kept: str | None = None


def measure() -> str:
    """The fingerprint of the planner modules' constants as they are now."""
    digest = sha256()
    for name in PLANNER_MODULES:
        module = importlib.import_module(name)
        for key, value in sorted(vars(module).items()):
            if not _CONSTANT.match(key) or f"{name}.{key}" in _CACHES:
                continue
            text = _canonical(value)
            if text is not None:
                digest.update(f"{name}.{key}={text}\n".encode())
    return digest.hexdigest()


def _canonical(value: Any) -> str | None:
    """``value`` as text the same in every process (None: not plain data)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (set, frozenset)):
        return _joined("set", value, ordered=True)
    if isinstance(value, (tuple, list)):
        return _joined(type(value).__name__, value, ordered=False)
    if isinstance(value, dict):
        keys = _texts(value.keys())
        values = _texts(value.values())
        if keys is None or values is None:
            return None
        pairs = sorted(zip(keys, values, strict=True))
        return "dict{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        inner = _canonical(fields)
        return None if inner is None else f"{type(value).__qualname__}{inner}"
    text = repr(value)
    return None if _ADDRESS in text else text


def _texts(members: Any) -> list[str] | None:
    """Each member's canonical text (None where one is not plain data)."""
    texts: list[str] = []
    for member in members:
        text = _canonical(member)
        if text is None:
            return None
        texts.append(text)
    return texts


def _joined(kind: str, members: Any, ordered: bool) -> str | None:
    texts = _texts(members)
    if texts is None:
        return None
    return f"{kind}(" + ",".join(sorted(texts) if ordered else texts) + ")"


def current() -> str:
    """The fingerprint last computed (computed now the first time)."""
    global _kept
    if _kept is None:
        _kept = measure()
    return _kept


def refresh() -> str:
    """Compute the fingerprint again and keep it: at the start of each model's planning,
    so a constant changed since the last one gives fresh plans."""
    global _kept
    _kept = measure()
    return _kept
