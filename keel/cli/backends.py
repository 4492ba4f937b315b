"""``keel backends``: every backend, whether it can run here and why not, and what it covers."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from keel.backends.registry import BackendRegistry, default_registry
from keel.config import format_bytes
from keel.errors import BackendSelectionError
from keel.ops.registry import Op, OpGroup

__all__ = ["backends", "backends_report", "register"]


def register(app: typer.Typer) -> None:
    app.command("backends")(backends)


def backends(
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="List every op covered."),
) -> None:
    """List every backend: available or why not, capabilities and op coverage."""
    report = backends_report(default_registry())
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    console = Console()
    console.print(_table(report))
    for line in _details(report):
        console.print(line, markup=False, highlight=False)
    if verbose:
        for entry in report["backends"]:
            console.print(f"[bold]{entry['name']}[/bold] ({entry['coverage']['ops']} ops): "
                          + (", ".join(entry["ops"]) or "none"))


def backends_report(registry: BackendRegistry) -> dict[str, Any]:
    """Plain data about every backend of ``registry`` (what ``--json`` prints)."""
    chain = registry.priority
    entries = [_entry(registry, name, chain) for name in registry.names()]
    return {"priority": chain, "known_ops": len(Op), "backends": entries}


def _entry(registry: BackendRegistry, name: str, chain: list[str]) -> dict[str, Any]:
    avail = registry.availability(name)
    data: dict[str, Any] = {
        "name": name,
        "available": avail.available,
        "reason": avail.reason,
        "priority": chain.index(name) + 1 if name in chain else None,
    }
    try:
        caps = registry.instance(name).capabilities().to_dict()
    except BackendSelectionError:       # its factory failed: nothing more to say
        caps = {"device": None, "dtypes": [], "ops": [], "simd_level": None,
                "threads": None, "memory_bytes": None, "notes": []}
    ops = caps.pop("ops")
    for key in ("name", "available", "reason"):
        caps.pop(key, None)
    seed = sorted(o.value for o in OpGroup.SEED_GPU_PROFILE)
    data.update(caps)
    data["coverage"] = {
        "ops": len(ops),
        "of": len(Op),
        "seed_001_gpu_profile": f"{len(set(seed) & set(ops))}/{len(seed)}",
    }
    data["ops"] = ops
    return data


def _table(report: dict[str, Any]) -> Table:
    table = Table(title="keel backends, in priority order: " + " → ".join(report["priority"]),
                  box=box.SIMPLE_HEAD)
    for col in ("backend", "device", "ok", "ops", "gpu ops", "threads", "simd", "memory"):
        table.add_column(col, no_wrap=True)
    table.caption = ("ops: keel ops it runs, of all; gpu ops: of the ops every GPU backend "
                     "must run (seed 001's GPU profile)")
    for e in report["backends"]:
        cov = e["coverage"]
        table.add_row(
            e["name"], e["device"] or "?", "yes" if e["available"] else "[red]no[/red]",
            f"{cov['ops']}/{cov['of']}", cov["seed_001_gpu_profile"],
            str(e["threads"] or "-"), e["simd_level"] or "-",
            format_bytes(e["memory_bytes"]) if e["memory_bytes"] else "-",
        )
    return table


def _details(report: dict[str, Any]) -> list[str]:
    """One line per backend: why it is (not) available, then its notes."""
    lines = []
    for e in report["backends"]:
        lines.append(f"{e['name']}: {e['reason']}")
        lines += [f"  {note}" for note in e["notes"]]
    return lines
