"""A fingerprint of the cpu planner's constants: what its plans are made from, besides a
node's signature and the machine.

Plans are kept and reused by key: the cpu planner's node plans by request
(``planner.plan``), the op-level path's by call (``Backend.run``) and whole compiled
plans on disk (:mod:`keel.execution.plan_cache`). An edit to a planner's source changes
the plan cache's source stamp, but a constant changed in a running process (a test's
``monkeypatch``, a script comparing thresholds) does not: without this fingerprint in
their keys, a model loaded after the change ran the plan made before it.

The fingerprint is a SHA-256 over the ``repr`` of every UPPER_CASE global of the planner
modules whose ``repr`` is plain data (numbers, strings, tuples, dicts and dataclasses of
them; functions and other objects printed by address are code, which the source stamp
covers). It is computed once and kept (:func:`current`); :func:`refresh` computes it
again, once per model planned (``placement.place``) and per plan-cache lookup, so
reading it on every op-level call costs one global read.

The gpu and webgpu planners are not covered: they are imported only with their backends,
and a key must not depend on what a process happened to import.
"""

from __future__ import annotations

import importlib
import re
from hashlib import sha256

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
            text = repr(value)
            if _ADDRESS not in text:
                digest.update(f"{name}.{key}={text}\n".encode())
    return digest.hexdigest()


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
