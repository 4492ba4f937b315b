"""KEEL_* environment settings, read once into a frozen dataclass.

This is the one place keel reads its ``KEEL_*`` variables: ``settings()``
reads and validates them all on first call and caches the result, and every
other module takes its values from there (the native tier's compiler,
``KEEL_NATIVE`` and worker spin included; the C code reads no environment).
``Settings.from_env(env)`` reads any mapping (tests pass their own);
``reload_settings()`` reads the environment again (tests that change it).
A bad value is an :class:`~keel.errors.InvalidArgumentError` naming the
variable and what it accepts.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.errors import InvalidArgumentError

__all__ = [
    "BACKEND_NAMES", "DEFAULT_BUILD_TIMEOUT_S", "DEFAULT_IDLE_SPIN_US", "DEFAULT_SPIN_US",
    "HINTS", "POLICY_FIELDS", "PRECISIONS", "Settings", "THREAD_COSTS", "cache_dir",
    "format_bytes",
    "format_limit", "parse_bytes", "reload_settings", "settings",
]

BACKEND_NAMES = ("auto", "gpu", "cpu", "reference", "webgpu")
PRECISIONS = ("auto", "fp32", "fp16", "bf16", "int8", "int16", "fp64")
HINTS = ("none", "latency", "throughput")     # performance hints (planning.adaptive)
# When keel measures this machine's thread costs (backends/cpu/thread_costs.py): on a
# machine with more than 2 usable cores (auto), on any (on), never (off: declared values).
THREAD_COSTS = ("auto", "on", "off")
DEFAULT_SPIN_US = 200       # how long an idle native worker spins before it sleeps
DEFAULT_IDLE_SPIN_US = 50   # how long it spins on once a model run has ended
DEFAULT_BUILD_TIMEOUT_S = 120.0   # a native kernel compile running longer is stopped

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(value: int | float | str, *, name: str = "memory limit") -> int:
    """Parse ``512MB``, ``1.5GiB``, ``1048576`` or an int into a positive byte count."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
        if not math.isfinite(number):
            raise InvalidArgumentError(f"{name} must be a finite byte count, got {value!r}")
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise InvalidArgumentError(
                f"{name} {value!r} is not a size; use a byte count or a number with a unit "
                "such as 512MB, 2GiB, 64KiB"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise InvalidArgumentError(f"{name} must be an int or a string, got {type(value).__name__}")
    result = int(number * _UNITS[unit])
    if result <= 0:
        raise InvalidArgumentError(f"{name} must be positive, got {value!r}")
    return result


def format_bytes(n: int | float | None) -> str:
    """Human-readable size with binary units (``1.5 GiB``)."""
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def format_limit(n: int) -> str:
    """A size the user gave (a memory limit), in the unit family they likely used:
    ``512MB`` (512000000 bytes) is ``512 MB``, ``512MiB`` is ``512.0 MiB``."""
    for power, unit in ((4, "TB"), (3, "GB"), (2, "MB"), (1, "kB")):
        decimal, binary = 1000 ** power, 1024 ** power
        if n >= decimal and n % decimal == 0 and n % binary != 0:
            return f"{n // decimal} {unit}"
    return format_bytes(n)


@dataclass(frozen=True)
class Settings:
    """Every ``KEEL_*`` setting, validated. ``None`` means not set (the reader's default applies).

    The policy knobs (``prefer_gpu`` .. ``allow_accelerator_experiments``, with
    ``backend`` and ``precision``) are what :class:`~keel.planning.policy.RuntimePolicy`
    layers over its defaults and file.
    """

    backend: str | None = None
    precision: str | None = None
    memory_limit: int | None = None
    threads: int | None = None
    strict: bool = False
    native: str = "auto"                  # auto | on | off
    cc: str | None = None                 # the C compiler for native kernels
    cflags: tuple[str, ...] = ()          # KEEL_CFLAGS: extra flags for native builds
    spin_us: int = DEFAULT_SPIN_US        # idle native workers spin this long, then sleep
    idle_spin_us: int = DEFAULT_IDLE_SPIN_US   # ... and this long once a run has ended
    build_timeout_s: float = DEFAULT_BUILD_TIMEOUT_S   # KEEL_BUILD_TIMEOUT: one compile's limit
    calibration: str | None = None        # a calibration file, or "off"
    cache_dir: Path = field(default_factory=lambda: _platform_cache_dir(os.environ, None))
    prefer_gpu: bool | None = None
    min_gpu_memory_gb: float | None = None
    prefer_lightweight_python_on_low_memory: bool | None = None
    lightweight_memory_threshold_gb: float | None = None
    allow_accelerator_experiments: bool | None = None
    plan_cache: bool = True               # KEEL_PLAN_CACHE: on (default) or off
    code_cache: bool = True               # KEEL_CODE_CACHE: dataclass methods' code, kept
    hint: str | None = None               # KEEL_HINT: none | latency | throughput
    batch_invariant: bool = True          # KEEL_BATCH_INVARIANT: on (default) or off
    cuda_graphs: bool = True              # KEEL_CUDA_GRAPHS: record and replay gpu runs
    placement_trials: bool = True         # KEEL_PLACEMENT_TRIALS: time gpu vs cpu per signature
    gpu_kernels: bool = True              # KEEL_GPU_KERNELS: the gpu backend's own kernels
    numa_pin: bool = True                 # KEEL_NUMA_PIN: keel's threads on one NUMA node
    interop: bool = True                  # KEEL_INTEROP: independent branches may run at once
    thread_costs: str = "auto"            # KEEL_THREAD_COSTS: auto | on | off (thread_costs)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read and validate every ``KEEL_*`` variable of ``env`` (default: ``os.environ``)."""
        env = os.environ if env is None else env
        return cls(
            backend=_choice(env, "KEEL_BACKEND", BACKEND_NAMES),
            precision=_choice(env, "KEEL_PRECISION", PRECISIONS),
            memory_limit=_size(env, "KEEL_MEMORY_LIMIT"),
            threads=_count(env, "KEEL_THREADS", minimum=1),
            strict=bool(_flag(env, "KEEL_STRICT")),
            native=_native(env),
            cc=env.get("KEEL_CC", "").strip() or None,
            cflags=tuple(shlex.split(env.get("KEEL_CFLAGS", ""))),
            spin_us=_or(_count(env, "KEEL_SPIN_US", minimum=0), DEFAULT_SPIN_US),
            idle_spin_us=_or(_count(env, "KEEL_IDLE_SPIN_US", minimum=0), DEFAULT_IDLE_SPIN_US),
            build_timeout_s=_seconds(env, "KEEL_BUILD_TIMEOUT", DEFAULT_BUILD_TIMEOUT_S),
            calibration=env.get("KEEL_CALIBRATION", "").strip() or None,
            cache_dir=_platform_cache_dir(env, None),
            prefer_gpu=_flag(env, "KEEL_PREFER_GPU"),
            min_gpu_memory_gb=_gib(env, "KEEL_MIN_GPU_MEMORY_GB"),
            prefer_lightweight_python_on_low_memory=_flag(
                env, "KEEL_PREFER_LIGHTWEIGHT_PYTHON_ON_LOW_MEMORY"),
            lightweight_memory_threshold_gb=_gib(env, "KEEL_LIGHTWEIGHT_MEMORY_THRESHOLD_GB"),
            allow_accelerator_experiments=_flag(env, "KEEL_ALLOW_ACCELERATOR_EXPERIMENTS"),
            plan_cache=_flag(env, "KEEL_PLAN_CACHE") is not False,
            code_cache=_flag(env, "KEEL_CODE_CACHE") is not False,
            hint=_choice(env, "KEEL_HINT", HINTS),
            batch_invariant=_flag(env, "KEEL_BATCH_INVARIANT") is not False,
            cuda_graphs=_flag(env, "KEEL_CUDA_GRAPHS") is not False,
            placement_trials=_flag(env, "KEEL_PLACEMENT_TRIALS") is not False,
            gpu_kernels=_flag(env, "KEEL_GPU_KERNELS") is not False,
            numa_pin=_flag(env, "KEEL_NUMA_PIN") is not False,
            interop=_flag(env, "KEEL_INTEROP") is not False,
            thread_costs=_choice(env, "KEEL_THREAD_COSTS", THREAD_COSTS) or "auto",
        )

    def policy_overrides(self) -> dict[str, Any]:
        """The policy fields these settings set (``RuntimePolicy`` field -> value)."""
        return {name: getattr(self, name) for name in POLICY_FIELDS
                if getattr(self, name) is not None}


#: the Settings fields that are RuntimePolicy fields too (``KEEL_`` + the upper-case name)
POLICY_FIELDS = ("prefer_gpu", "min_gpu_memory_gb", "prefer_lightweight_python_on_low_memory",
                 "lightweight_memory_threshold_gb", "allow_accelerator_experiments", "backend",
                 "precision", "hint")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _choice(env: Mapping[str, str], key: str, allowed: tuple[str, ...]) -> str | None:
    raw = env.get(key, "").strip().lower()
    if not raw:
        return None
    if raw not in allowed:
        raise InvalidArgumentError(f"{key}={raw!r} is not allowed; use one of {', '.join(allowed)}")
    return raw


def _size(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key, "").strip()
    return parse_bytes(raw, name=key) if raw else None


def _count(env: Mapping[str, str], key: str, *, minimum: int) -> int | None:
    """A whole number >= ``minimum``; None when unset."""
    raw = env.get(key, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < minimum:
        what = "a positive integer" if minimum == 1 else f"a whole number >= {minimum}"
        raise InvalidArgumentError(f"{key}={raw!r} must be {what}")
    return int(raw)


def _seconds(env: Mapping[str, str], key: str, default: float) -> float:
    """A finite number of seconds > 0; ``default`` when unset."""
    value = _gib(env, key, unit="seconds")
    if value == 0:
        raise InvalidArgumentError(f"{key}={env[key].strip()!r} must be a number of seconds > 0")
    return default if value is None else value


def _gib(env: Mapping[str, str], key: str, unit: str = "GiB") -> float | None:
    """A finite number of GiB (or ``unit``) >= 0; None when unset."""
    raw = env.get(key, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(f"{key}={raw!r} must be a number of {unit}") from None
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(f"{key}={raw!r} must be a finite number of {unit} >= 0")
    return value


def _flag(env: Mapping[str, str], key: str) -> bool | None:
    """True or False; None when unset."""
    raw = env.get(key, "").strip().lower()
    if not raw:
        return None
    if raw in _TRUE + _FALSE:
        return raw in _TRUE
    raise InvalidArgumentError(f"{key}={raw!r} must be one of 1/0, true/false, yes/no, on/off")


def _native(env: Mapping[str, str]) -> str:
    raw = env.get("KEEL_NATIVE", "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in _TRUE + _FALSE:
        return "on" if raw in _TRUE else "off"
    raise InvalidArgumentError(f"KEEL_NATIVE={raw!r} is not allowed; use one of auto, on, off")


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """The process-wide settings, read from the environment once (see :func:`reload_settings`)."""
    return Settings.from_env()


def reload_settings() -> Settings:
    """Read the environment again and return the new process-wide settings.

    For tests and tools that change ``os.environ`` after keel first read it.
    What was already built from the old settings stays as it was: call
    ``keel.native.reset()`` after a changed ``KEEL_NATIVE`` / ``KEEL_CC`` /
    ``KEEL_SPIN_US`` / ``KEEL_IDLE_SPIN_US``.
    """
    settings.cache_clear()
    return settings()


def cache_dir(env: Mapping[str, str] | None = None, system: str | None = None) -> Path:
    """``KEEL_CACHE_DIR``, else the platform's user cache directory under ``keel``.

    Without arguments: the process's setting (:func:`settings`). With ``env``
    (and ``system``, default this one): what that environment would give.
    """
    if env is None and system is None:
        return settings().cache_dir
    return _platform_cache_dir(os.environ if env is None else env, system)


def _platform_cache_dir(env: Mapping[str, str], system: str | None) -> Path:
    if env.get("KEEL_CACHE_DIR", "").strip():
        return Path(env["KEEL_CACHE_DIR"].strip()).expanduser()
    system = platform.system() if system is None else system
    home = Path(env.get("HOME") or Path.home())
    if system == "Windows":
        local = env.get("LOCALAPPDATA")
        return (Path(local) if local else home / "AppData" / "Local") / "keel" / "Cache"
    if system == "Darwin":
        return home / "Library" / "Caches" / "keel"
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else home / ".cache") / "keel"
