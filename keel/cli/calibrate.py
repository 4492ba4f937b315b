"""``keel calibrate``: measure from which size the GPU pays back its transfers here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from keel.ops.registry import OpGroup
from keel.planning.calibration import (
    DEFAULT_GROUPS,
    Calibration,
    CalibrationStatus,
    calibrate,
    find_calibration,
    format_seconds,
    format_size,
    group_name,
    save,
)

__all__ = ["calibrate_command", "calibration_table", "register"]


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_command)


def calibrate_command(
    quick: bool = typer.Option(False, "--quick",
                               help="Fewer sizes (10 kB to 10 MB), 3 repeats, a 20 s budget."),
    groups: list[str] | None = typer.Option(
        None, "--groups", help=f"Op groups to measure, comma-separated or repeated "
                               f"(default: {', '.join(DEFAULT_GROUPS)})."),
    dtypes: list[str] | None = typer.Option(
        None, "--dtypes", help="Dtypes to measure, comma-separated or repeated "
                               "(default: float32)."),
    budget: float | None = typer.Option(
        None, "--budget", help="Seconds the whole sweep may take (default 120, 20 with "
                               "--quick)."),
    as_json: bool = typer.Option(False, "--json", help="Print the calibration as JSON."),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Write the calibration here instead of the cache."),
    show: bool = typer.Option(
        False, "--show", help="Measure nothing: print the calibration selection uses now, "
                              "and why."),
    gpu: str | None = typer.Option(
        None, "--gpu", help="The GPU backend to time (webgpu); default: the first GPU "
                            "backend of the priority chain. Kept in its own cache file."),
) -> None:
    """Time each op group on the CPU and the GPU and record where the GPU starts to win."""
    if show:
        _show(find_calibration(gpu=gpu or ""), as_json)
        return
    kwargs: dict[str, Any] = {"quick": quick, "budget_seconds": budget, "gpu": gpu}
    if groups:
        kwargs["groups"] = _split(groups)
    if dtypes:
        kwargs["dtypes"] = _split(dtypes)
    calibration = _measure(kwargs, progress_bar=not as_json)
    path = save(calibration, output, gpu=gpu or "")
    if as_json:
        typer.echo(json.dumps({**calibration.to_dict(), "saved_to": str(path)}, indent=2,
                              ensure_ascii=False))
        return
    console = Console()
    _print(console, calibration)
    console.print(f"saved to {path}", markup=False, highlight=False, soft_wrap=True)


def _split(values: list[str]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _measure(kwargs: dict[str, Any], progress_bar: bool) -> Calibration:
    """Run the sweep, with a progress bar on stderr when it is a terminal."""
    err = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True,
                  disable=not (progress_bar and err.is_terminal)) as bar:
        task = bar.add_task("calibrating", total=None)

        def report(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=label)

        return calibrate(progress=report, **kwargs)


def _print(console: Console, calibration: Calibration) -> None:
    if not calibration.has_gpu:
        console.print(f"no GPU: nothing to calibrate ({calibration.no_gpu})", markup=False,
                      highlight=False, soft_wrap=True)
        return
    for kind in ("gpu", "cpu"):      # "<backend>: <what it runs on>"
        console.print(calibration.devices.get(kind, f"{kind}: unknown"), markup=False,
                      highlight=False, soft_wrap=True)
    console.print(calibration_table(calibration))
    if calibration.notes:
        console.print("notes:", highlight=False)
        for note in calibration.notes:
            console.print(f"  - {note}", markup=False, highlight=False, soft_wrap=True)


def calibration_table(calibration: Calibration) -> Table:
    """One row per op group and dtype measured: the crossover and the times behind it."""
    table = Table(title=f"keel calibrate ({calibration.source})",
                  caption="times: medians at the crossover size, or at the largest size "
                          "measured where the GPU never won; gpu+copies: data on the host, "
                          "resident: data on the GPU",
                  title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, padding=(0, 1, 0, 0))   # fits 80 columns
    for column in ("op group", "op", "dtype", "GPU from", "cpu", "gpu+copies", "resident"):
        table.add_column(column, no_wrap=True)
    for group, dtype in _pairs(calibration):
        points = calibration.measured(group, dtype)
        at = calibration.evidence(group, dtype) or points[-1]
        table.add_row(group_name(group), at.op.value, dtype,
                      _crossover_text(calibration, group, dtype),
                      format_seconds(at.cpu_seconds), format_seconds(at.gpu_seconds),
                      format_seconds(at.gpu_resident_seconds))
    return table


def _pairs(calibration: Calibration) -> list[tuple[OpGroup, str]]:
    seen = dict.fromkeys((m.group, m.dtype.value) for m in calibration.measurements)
    return list(seen)


def _crossover_text(calibration: Calibration, group: OpGroup, dtype: str) -> str:
    entry = calibration.lookup(group, dtype)
    if entry is None:
        return "static"               # inconclusive: the notes say why
    return "never" if entry[1] is None else format_size(entry[1])


def _show(status: CalibrationStatus, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(status.to_dict(), indent=2, ensure_ascii=False))
        return
    console = Console()
    console.print(status.reason, markup=False, highlight=False, soft_wrap=True)
    if status.calibration is not None:
        _print(console, status.calibration)
