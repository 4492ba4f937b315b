"""``keel cache [list|clear] [--json]``: the compiled-plan cache's entries, or empty it."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from keel.config import format_bytes
from keel.errors import InvalidArgumentError
from keel.execution import plan_cache

__all__ = ["ACTIONS", "cache_command", "cache_report", "register"]

ACTIONS = ("list", "clear")


def register(app: typer.Typer) -> None:
    app.command("cache")(cache_command)


def cache_command(
    action: str = typer.Argument("list", help="list (the default) or clear."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List the compiled plans cached on disk (model, size, age, key), or remove them all."""
    if action not in ACTIONS:
        raise InvalidArgumentError(
            f"keel cache: unknown action {action!r}; use one of {', '.join(ACTIONS)}")
    if action == "clear":
        removed = plan_cache.clear()
        if as_json:
            typer.echo(json.dumps({"folder": str(plan_cache.plans_dir()), "removed": removed}))
        else:
            typer.echo(f"removed {removed} cached plan(s) from {plan_cache.plans_dir()}")
        return
    report = cache_report()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    Console().print(_table(report))


def cache_report() -> dict[str, Any]:
    """Plain data about the cache (what ``list --json`` prints)."""
    entries = plan_cache.entries()
    return {"folder": str(plan_cache.plans_dir()),
            "max_entries": plan_cache.MAX_ENTRIES, "max_bytes": plan_cache.MAX_BYTES,
            "total_bytes": sum(e.size_bytes for e in entries),
            "entries": [e.to_dict() for e in entries]}


def _table(report: dict[str, Any]) -> Table:
    count = len(report["entries"])
    table = Table(title=f"{count} cached plan(s), {format_bytes(report['total_bytes'])}, in "
                        f"{report['folder']}", title_justify="left",
                  caption=f"kept: the {report['max_entries']} most recently used, "
                          f"{format_bytes(report['max_bytes'])} at most", caption_justify="left")
    for column in ("model", "size", "age", "key"):
        table.add_column(column, no_wrap=column != "model")
    for e in report["entries"]:
        table.add_row(e["model"], format_bytes(e["size_bytes"]), _age(e["age_s"]), e["key"][:12])
    return table


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"
