"""What a measurement of this machine is valid for: its hardware fingerprint.

Caches of what was measured on a machine (the GPU crossover calibration, tuned variant
choices, thread costs, the plan cache) are keyed by the fingerprint of the machine that
measured them, and ignore a file whose fingerprint is another machine's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from keel._hashing import sha256
from keel.hardware.profile import HardwareProfile


def _probe() -> HardwareProfile:
    from keel.hardware import probe

    return probe()


def hardware_fingerprint(profile: HardwareProfile | None = None) -> dict[str, Any]:
    """What a measurement is valid for: CPU model and cores, GPU names, drivers, memory."""
    prof = profile if profile is not None else _probe()
    cpu = prof.cpu
    return {"cpu": cpu.brand, "architecture": cpu.architecture,
            "logical_cores": cpu.logical_cores, "usable_cores": cpu.usable_cores,
            "gpus": [{"name": g.name, "driver": g.driver, "memory_bytes": g.total_memory_bytes}
                     for g in prof.gpus]}


def machine_fingerprint() -> dict[str, Any]:
    """This machine's :func:`hardware_fingerprint`, probed once per process (a fresh copy
    each call)."""
    return json.loads(_machine_json())


@functools.lru_cache(maxsize=1)
def _machine_json() -> str:
    return json.dumps(hardware_fingerprint(), sort_keys=True)


def fingerprint_id(fingerprint: Mapping[str, Any]) -> str:
    """A short stable hash of a fingerprint (names a cache file)."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return sha256(text.encode()).hexdigest()[:16]
