"""Memory probe: total and available RAM, the cgroup limit, and what is effectively usable.

Total and available come from ``/proc/meminfo`` on Linux (psutil only where it cannot
be read), elsewhere from psutil when importable, else ``sysctl hw.memsize`` (macOS).
On Linux the cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``, the
tightest level of the hierarchy) caps the effective limit, and the cgroup's usage
minus its reclaimable page cache caps what is effectively available.
"""

from __future__ import annotations

from typing import Any

from keel.hardware.profile import MemoryInfo
from keel.hardware.sources import (
    CgroupDirs,
    Notes,
    ProbeSources,
    cgroup_dirs,
    parse_key_values,
    to_int,
)

__all__ = ["UNLIMITED_THRESHOLD", "probe_memory"]

#: cgroup limits at or above this are "no limit" (v1 writes PAGE_COUNTER_MAX pages).
UNLIMITED_THRESHOLD = 1 << 60


def probe_memory(src: ProbeSources) -> MemoryInfo:
    """Read memory totals and limits from ``src``; never raises for missing data."""
    notes = Notes()
    total, available, source = _system_memory(src, notes)
    limit = usage = None
    if src.platform.system == "Linux":
        limit, usage, where = _cgroup(src, notes)
        if where:
            source = f"{source}+{where}"
    else:
        notes.add("cgroup_limit_bytes", f"{src.platform.system} has no cgroups")
    effective = _min_known(total, limit)
    headroom = None if limit is None or usage is None else max(0, limit - usage)
    effective_available = _min_known(available, headroom)
    if effective is None:
        notes.add("effective_limit_bytes", "neither total memory nor a cgroup limit is known")
    if effective_available is None:
        notes.add("effective_available_bytes", "available memory is unknown")
    if limit is not None and usage is None:
        notes.add("cgroup_usage", "cgroup usage is unreadable; available not capped by it")
    return MemoryInfo(
        total_bytes=total,
        available_bytes=available,
        cgroup_limit_bytes=limit,
        effective_limit_bytes=effective,
        effective_available_bytes=effective_available,
        source=source,
        notes=notes.as_tuple(),
    )


def _min_known(*values: int | None) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _system_memory(src: ProbeSources, notes: Notes) -> tuple[int | None, int | None, str]:
    # On Linux psutil reads /proc/meminfo too, and importing it is about 8 ms of a fresh
    # process: it is asked only where that file cannot be read.
    text = src.read("/proc/meminfo") if src.platform.system == "Linux" else None
    if text is not None:
        return _meminfo(text, notes)
    psutil, why = src.module("psutil")
    if psutil is not None:
        try:
            vm = psutil.virtual_memory()
            return int(vm.total), int(vm.available), "psutil"
        except Exception as exc:  # psutil raises platform-specific errors
            why = f"psutil.virtual_memory failed: {exc}"
    if src.platform.system == "Linux":
        why = f"{why}; /proc/meminfo is not readable"
    elif src.platform.system == "Darwin":
        return _sysctl_memsize(src, notes, why)
    notes.add("total_bytes", why)
    notes.add("available_bytes", why)
    return None, None, "none"


def _meminfo(text: str, notes: Notes) -> tuple[int | None, int | None, str]:
    kv = {k: to_int(v.split()[0]) if v else None for k, v in parse_key_values(text).items()}
    total, available = kv.get("MemTotal"), kv.get("MemAvailable")
    if total is None:
        notes.add("total_bytes", "/proc/meminfo has no MemTotal")
    if available is None:
        notes.add("available_bytes", "/proc/meminfo has no MemAvailable (kernel < 3.14)")
    kib = 1024
    return (None if total is None else total * kib,
            None if available is None else available * kib, "/proc/meminfo")


def _sysctl_memsize(src: ProbeSources, notes: Notes,
                    why: str) -> tuple[int | None, int | None, str]:
    answer = src.run("sysctl", "-n", "hw.memsize")
    total = to_int(answer.output) if answer.ok else None
    if total is None:
        notes.add("total_bytes", f"{why}; sysctl hw.memsize: {answer.reason or 'not a number'}")
    notes.add("available_bytes", f"{why}; macOS exposes no available-memory sysctl")
    return total, None, "sysctl" if total is not None else "none"


def _cgroup(src: ProbeSources, notes: Notes) -> tuple[int | None, int | None, str]:
    dirs, why = cgroup_dirs(src, "memory")
    if dirs is None:
        notes.add("cgroup_limit_bytes", why)
        return None, None, ""
    limit_file = "memory.max" if dirs.version == "v2" else "memory.limit_in_bytes"
    limits = [to_int(text) for _, text in dirs.read(src, limit_file)]
    real = [v for v in limits if v is not None and v < UNLIMITED_THRESHOLD]
    if not real:
        notes.add("cgroup_limit_bytes", f"cgroup {dirs.version} at {dirs.dirs[0]} "
                  "sets no memory limit")
        return None, None, ""
    return min(real), _usage(src, dirs), f"cgroup {dirs.version}"


def _usage(src: ProbeSources, dirs: CgroupDirs) -> int | None:
    """Usage of the process's own cgroup, minus inactive page cache (reclaimable)."""
    leaf = dirs.dirs[0]
    name = "memory.current" if dirs.version == "v2" else "memory.usage_in_bytes"
    usage = to_int(src.read(f"{leaf}/{name}"))
    if usage is None:
        return None
    stat: dict[str, Any] = parse_key_values(src.read(f"{leaf}/memory.stat") or "", sep=" ")
    key = "inactive_file" if dirs.version == "v2" else "total_inactive_file"
    inactive = to_int(stat.get(key)) or 0
    return max(0, usage - inactive)
