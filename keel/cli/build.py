"""``keel build [--json]``: build every native kernel library now and report the state."""

from __future__ import annotations

import json
from typing import Any

import typer

from keel import native
from keel.native import build as native_build

__all__ = ["build_command", "build_report", "register"]


def register(app: typer.Typer) -> None:
    app.command("build")(build_command)


def build_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Build the native kernels for this CPU now (else the first run builds them), and say,
    per library, whether it was built, found in the cache or installed, or why it failed."""
    report = build_report()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    mode = f"KEEL_NATIVE={report['mode']}"
    typer.echo(f"native kernels: {report['reason']}"
               f"{'' if mode in report['reason'] else f' ({mode})'}")
    typer.echo(f"cache: {report['cache'] or '-'}")
    for entry in report["libraries"]:
        where = entry["path"] or entry["reason"]
        typer.echo(f"  {entry['library']:<10} {entry['state']:<9} {entry['seconds']:7.1f} s  "
                   f"{where}")


def build_report() -> dict[str, Any]:
    """Plain data about the native tier after building every library (what ``--json``
    prints): mode, compiler, flags, cache folder, and per library its state."""
    libraries = native_build.build_all()
    state = native.status()
    return {"mode": state.mode, "available": state.available, "reason": state.reason,
            "compiler": state.compiler, "flags": list(state.flags), "cache": state.cache,
            "prebuilt": str(native_build.PREBUILT_DIR), "libraries": libraries}
