"""``keel probe [--json|--yaml]``: what this machine can do, read for real."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from keel.config import format_bytes
from keel.errors import ExecutionError, InvalidArgumentError
from keel.hardware import probe
from keel.hardware.profile import CpuInfo, GpuInfo, HardwareProfile, MemoryInfo

__all__ = ["print_profile", "probe_command", "profile_table", "register"]


def register(app: typer.Typer) -> None:
    app.command("probe")(probe_command)


def probe_command(
    as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON."),
    as_yaml: bool = typer.Option(False, "--yaml", help="Print the profile as YAML."),
    webgpu: bool = typer.Option(False, "--webgpu", help="Also list the WebGPU adapters "
                                "(starts the Vulkan/Metal/DX12 drivers: seconds)."),
    costs: bool = typer.Option(False, "--thread-costs", help="Measure what a split over "
                               "keel's threads costs here (under a second once keel's "
                               "native kernels are built; a first build takes 10-30 s and "
                               "prints a line), keep it, and "
                               "print it with the least work a thread it gives."),
) -> None:
    """Probe CPU, memory, GPUs and accelerators; every gap says why."""
    if as_json and as_yaml:
        raise InvalidArgumentError("--json and --yaml are exclusive; give one of them")
    if costs:
        if as_yaml:
            raise InvalidArgumentError("--thread-costs prints text or --json, not --yaml")
        _thread_costs(as_json)
        return
    profile = probe(webgpu=True) if webgpu else probe()
    if as_json:
        typer.echo(profile.to_json())
    elif as_yaml:
        typer.echo(profile.to_yaml(), nl=False)
    else:
        print_profile(Console(), profile)


def _thread_costs(as_json: bool) -> None:
    # Their own output: the profile's JSON stays a file `--hardware` reads back.
    from keel.backends.cpu import planner, thread_costs
    from keel.backends.cpu.backend import default_threads

    try:
        thread_costs.refresh()
    except RuntimeError as exc:
        raise ExecutionError(f"cannot measure the thread costs here: {exc}") from None
    threads = default_threads()
    if as_json:
        typer.echo(json.dumps(planner.least_work_table(threads), indent=2))
    else:
        typer.echo(planner.thread_costs_note(threads))


def print_profile(console: Console, profile: HardwareProfile, notes: bool = True) -> None:
    """The readable form of a profile: one table, then the notes."""
    console.print(profile_table(profile))
    if not notes:
        return
    all_notes = [*(f"cpu.{n}" for n in profile.cpu.notes),
                 *(f"memory.{n}" for n in profile.memory.notes),
                 *(f"gpus[{g.index}].{n}" for g in profile.gpus for n in g.notes),
                 *profile.notes]
    if all_notes:
        console.print("notes (what could not be read, and why):", highlight=False)
        for note in all_notes:
            console.print(f"  - {note}", markup=False, highlight=False, soft_wrap=True)


def profile_table(profile: HardwareProfile) -> Table:
    """A two-column table of the profile's readings."""
    took = "" if profile.probe_seconds is None else f" in {profile.probe_seconds * 1000:.0f} ms"
    table = Table(title=f"keel probe: {profile.hostname or 'unknown host'} "
                        f"({profile.platform_system or '?'} {profile.platform_release or ''})"
                        f"{took}", show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("reading", overflow="fold")
    for label, value in (*_cpu_rows(profile.cpu), *_memory_rows(profile.memory),
                         *_gpu_rows(profile.gpus), *_other_rows(profile)):
        table.add_row(label, value)
    return table


def _num(value: float | int | None, unit: str = "") -> str:
    if value is None:
        return "unknown"
    return f"{value:g}{unit}" if isinstance(value, int) else f"{value:.0f}{unit}"


def _cpu_rows(cpu: CpuInfo) -> list[tuple[str, str]]:
    quota = "no cgroup quota" if cpu.cgroup_cpu_quota is None \
        else f"cgroup quota {cpu.cgroup_cpu_quota:g} cores"
    return [
        ("CPU", f"{cpu.brand or 'unknown model'} ({cpu.vendor or 'unknown vendor'}, "
                f"{cpu.architecture or 'unknown arch'})"),
        ("cores", f"{_num(cpu.logical_cores)} logical, {_num(cpu.physical_cores)} physical, "
                  f"{_num(cpu.usable_cores)} usable (affinity {_num(cpu.affinity_cores)}, "
                  f"{quota})"),
        ("frequency", f"base {_num(cpu.base_frequency_mhz, ' MHz')}, "
                      f"max {_num(cpu.max_frequency_mhz, ' MHz')}, "
                      f"current {_num(cpu.current_frequency_mhz, ' MHz')}"),
        ("SIMD", f"{cpu.simd_level}: {' '.join(cpu.simd) or 'none'} ({cpu.simd_source})"),
        ("int8 dot", int8_dot(cpu.simd)),
        ("NUMA", f"{len(cpu.numa_nodes)} node(s): "
                 + "; ".join(f"node {i}: CPUs {cpus}" for i, cpus in enumerate(cpu.numa_nodes))
                 if cpu.numa_nodes else "no nodes listed"),
    ]


def int8_dot(simd: tuple[str, ...]) -> str:
    """The int8 dot-product instructions among ``simd`` (what keel's int8 kernels use)."""
    found = [name for flag, name in (("avx512vnni", "AVX-512 VNNI"), ("avxvnni", "AVX-VNNI"))
             if flag in simd]
    if found:
        return f"{', '.join(found)} (vpdpbusd: keel's int8 kernels use the widest)"
    return "no VNNI: keel's int8 kernels take their portable path"


def _memory_rows(mem: MemoryInfo) -> list[tuple[str, str]]:
    limit = "none" if mem.cgroup_limit_bytes is None else format_bytes(mem.cgroup_limit_bytes)
    return [
        ("memory", f"{format_bytes(mem.total_bytes)} total, "
                   f"{format_bytes(mem.available_bytes)} available, cgroup limit {limit}"),
        ("usable memory", f"{format_bytes(mem.effective_limit_bytes)} limit, "
                          f"{format_bytes(mem.effective_available_bytes)} available "
                          f"({mem.source})"),
    ]


def _gpu_rows(gpus: tuple[GpuInfo, ...]) -> list[tuple[str, str]]:
    if not gpus:
        return [("GPUs", "none detected")]
    rows = []
    for g in gpus:
        extra = [f"driver {g.driver}" if g.driver else "",
                 f"compute {g.compute_capability}" if g.compute_capability else "",
                 g.pci_bus_id or ""]
        free = "" if g.free_memory_bytes is None else f", {format_bytes(g.free_memory_bytes)} free"
        rows.append((f"GPU {g.vendor} {g.index}",
                     f"{g.name or 'unnamed'}: {format_bytes(g.total_memory_bytes)}{free}; "
                     f"{', '.join(e for e in extra if e) or 'no driver details'} (via {g.source})"))
    return rows


def _other_rows(profile: HardwareProfile) -> list[tuple[str, str]]:
    accels = [f"{a.kind} {a.name} ({a.source})" for a in profile.accelerators]
    adapters = [f"{a.device or a.vendor} ({a.backend_type}, {a.adapter_type}"
                f"{', shader-f16' if a.shader_f16 else ''})" for a in profile.webgpu_adapters]
    return [
        ("accelerators", "; ".join(accels) or "none detected"),
        ("WebGPU adapters", "; ".join(adapters) or "none listed (see the notes)"),
        ("KEEL_BACKEND", profile.forced_backend or "not pinned"),
        ("python", profile.python_version or "unknown"),
    ]
