"""KEEL_* environment settings, read once into a frozen dataclass.

``settings()`` reads the environment on first call and caches the result;
``Settings.from_env(env)`` reads any mapping (tests pass their own).
"""

from __future__ import annotations

import functools
import math
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from keel.errors import InvalidArgumentError

__all__ = [
    "BACKEND_NAMES", "PRECISIONS", "Settings", "cache_dir", "format_bytes", "parse_bytes",
    "settings",
]

BACKEND_NAMES = ("auto", "gpu", "cpu", "reference")
PRECISIONS = ("auto", "fp32", "fp16", "int8", "int16", "fp64")

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


@dataclass(frozen=True)
class Settings:
    """keel's environment settings. ``None`` means not set."""

    backend: str | None = None
    precision: str | None = None
    memory_limit: int | None = None
    threads: int | None = None
    strict: bool = False
    plan_cache: bool = True               # KEEL_PLAN_CACHE: on (default) or off

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        return cls(
            backend=_choice(env, "KEEL_BACKEND", BACKEND_NAMES),
            precision=_choice(env, "KEEL_PRECISION", PRECISIONS),
            memory_limit=_size(env, "KEEL_MEMORY_LIMIT"),
            threads=_threads(env),
            strict=_flag(env, "KEEL_STRICT"),
            plan_cache=_flag(env, "KEEL_PLAN_CACHE") if env.get("KEEL_PLAN_CACHE", "").strip()
            else True,
        )


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


def _threads(env: Mapping[str, str]) -> int | None:
    raw = env.get("KEEL_THREADS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidArgumentError(f"KEEL_THREADS={raw!r} must be a positive integer")
    return int(raw)


def _flag(env: Mapping[str, str], key: str) -> bool:
    raw = env.get(key, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise InvalidArgumentError(f"{key}={raw!r} must be one of 1/0, true/false, yes/no, on/off")


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """The process-wide settings, read from the environment once."""
    return Settings.from_env()


def cache_dir(env: Mapping[str, str] | None = None, system: str | None = None) -> Path:
    """``KEEL_CACHE_DIR``, else the platform's user cache directory under ``keel``."""
    env = os.environ if env is None else env
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
