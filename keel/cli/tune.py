"""``keel tune MODEL``: time each node's candidate kernel variants here and cache the winners."""

from __future__ import annotations

import json

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from keel.errors import InvalidArgumentError
from keel.execution import tuning
from keel.execution.model import Model, load_model
from keel.planning.calibration import format_seconds

__all__ = ["parse_input_shapes", "register", "tune_command", "tune_table"]


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_command)


def tune_command(
    model: str = typer.Argument(..., help="Model file (.onnx or .keel)."),
    batch: int = typer.Option(1, "--batch", min=1,
                              help="Size of symbolic first dimensions (others are 1)."),
    budget: float = typer.Option(tuning.DEFAULT_BUDGET_SECONDS, "--budget",
                                 help="Seconds the measurements may take in all."),
    input_shape: list[str] = typer.Option(
        [], "--input-shape", help="NAME=1x3x224x224: an input's shape (repeatable)."),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="Threads the model runs with (default: KEEL_THREADS, "
                                       "else the usable cores); tuned per thread count."),
    force: bool = typer.Option(False, "--force", help="Measure cached cases again."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Time the kernel variants of MODEL's nodes on this machine; plans then use the winners."""
    loaded = load_model(model, threads=threads)
    shapes = _shapes(loaded, batch, parse_input_shapes(input_shape))
    with tuning.progress_bar(enabled=not as_json) as bar:
        report = loaded.tune(shapes, budget_s=budget, force=force, progress=bar)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    console = Console()
    if not report.nothing_to_tune:
        console.print(tune_table(report))
    console.print(report.message(), markup=False, highlight=False, soft_wrap=True)


def parse_input_shapes(specs: list[str]) -> dict[str, tuple[int, ...]]:
    """``NAME=1x3x224x224`` options as {name: shape}."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, sep, dims = spec.partition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x")) if dims.strip() else ()
        except ValueError:
            shape = ()
        if not sep or not name or not shape or any(d < 0 for d in shape):
            raise InvalidArgumentError(
                f"--input-shape {spec!r} must look like NAME=1x3x224x224 (non-negative "
                "integers joined by x)")
        if name in shapes:
            raise InvalidArgumentError(f"--input-shape gives {name!r} twice; give it once")
        shapes[name] = shape
    return shapes


def _shapes(model: Model, batch: int, given: dict[str, tuple[int, ...]]
            ) -> dict[str, tuple[int, ...]]:
    names = [i.name for i in model.inputs]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InvalidArgumentError(
            f"--input-shape names {', '.join(unknown)}, not an input of the model; its "
            f"inputs: {', '.join(names) or 'none'}")
    return {i.name: given.get(i.name) or tuple(
                d if isinstance(d, int) else (batch if k == 0 else 1)
                for k, d in enumerate(i.shape or ()))
            for i in model.inputs}


def tune_table(report: tuning.TuneReport) -> Table:
    """One row per case: its candidates' medians, the winner and by how much it won."""
    table = Table(title=f"keel tune {report.model} ({report.threads} thread"
                        f"{'s' if report.threads != 1 else ''})",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("case", overflow="fold", ratio=3)
    for column in ("nodes", "candidates (median)", "winner", "ratio", "status"):
        table.add_column(column, overflow="fold", ratio=1 if column != "candidates (median)"
                         else 2)
    for case in report.cases:
        t = case.tuned
        medians = ", ".join(case.candidates) if t is None else ", ".join(
            f"{x.variant} {format_seconds(x.median_s)}" for x in t.timings)
        table.add_row(case.description, str(len(case.nodes)), medians,
                      "-" if t is None else t.winner,
                      "-" if t is None else f"{t.ratio:.2f}x",
                      "; ".join((case.status, *case.notes)))
    return table

