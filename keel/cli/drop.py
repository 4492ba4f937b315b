"""``keel drop MODEL --profile edge|server [--out DIR] [--json]``: a deterministic drop manifest."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from keel.planning.drops import DEFAULT_ARTIFACTS_DIR, Drop, make_drop

__all__ = ["drop_command", "register"]


def register(app: typer.Typer) -> None:
    app.command("drop")(drop_command)


def drop_command(
    model: Path = typer.Argument(..., help="The model file the drop is for."),
    profile: str = typer.Option(..., "--profile", help="Target profile: edge or server."),
    out: Path = typer.Option(Path(DEFAULT_ARTIFACTS_DIR), "--out",
                             help="Artifacts root; the drop goes to OUT/PROFILE/DROP-ID/."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Write flags.txt and manifest.yaml for MODEL on a target profile (same inputs, same bytes)."""
    _check_model(model)
    drop = make_drop(model, profile, out)
    if as_json:
        typer.echo(json.dumps(drop.to_dict(), indent=2))
        return
    Console().print(_table(drop))


def _check_model(model: Path) -> None:
    """Refuse to package a file keel cannot load (ModelFormatError names what is wrong)."""
    from keel.formats.keel_format import is_keel_file, load_keel
    from keel.graph.importers.onnx import import_onnx

    if not model.is_file():
        return  # make_drop reports a missing file with its own message
    if is_keel_file(model):
        load_keel(model)
    else:
        import_onnx(model)


def _table(drop: Drop) -> Table:
    """The model and the drop's files first; the profile's runtime-manager backends and build
    flags (rustc flags and feature gates, kept in the manifest for a native runtime build)
    last, in their own section."""
    state = "written" if drop.created else "already present, identical"
    table = Table(title=f"keel drop {drop.drop_id} ({state})", show_header=False,
                  title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    m = drop.manifest
    for label, value in (
        ("model", f"{m['model']['file']} ({m['model']['size_bytes']} bytes, "
                  f"sha256 {m['model']['sha256'][:16]}…)"),
        ("profile", f"{drop.profile}: {m['description']}"),
        ("path", drop.path),
        ("files", ", ".join(drop.files)),
    ):
        table.add_row(label, value)
    table.add_section()
    table.add_row("runtime manager", ", ".join(m["primary_backends"]) or "-")
    table.add_row("rustc flags", " ".join(m["flags"]) or "-")
    table.add_row("feature gates", ", ".join(m["feature_gates"]) or "-")
    return table
