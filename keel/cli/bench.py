"""``keel bench MODEL``: time a model on keel, optionally beside onnxruntime."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from keel.bench import BenchConfig, ModelReport, bench_model
from keel.cli.common import parse_dims
from keel.errors import InvalidArgumentError, ModelFormatError

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise InvalidArgumentError(
            f"{what} must be comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise InvalidArgumentError(f"{what} must be positive integers, got {text!r}")
    return values


def bench(
    model: Path = typer.Argument(..., help="ONNX or .keel model file."),
    vs: str = typer.Option("", "--vs", help="Compare with: onnxruntime, or torch (the same "
                                            "graph run by torch; on CUDA with --backend gpu)."),
    batch: str = typer.Option("1,32", "--batch",
                              help="Batch sizes (the symbolic first dimension), comma separated."),
    dims: list[str] = typer.Option([], "--dim",
                                   help="NAME=VALUE: size of a symbolic dimension (repeatable)."),
    threads: str = typer.Option("1", "--threads", help="Thread counts, comma separated."),
    backend: str = typer.Option("cpu", "--backend", help="keel backend to time."),
    passes: int = typer.Option(5, "--passes", min=1, help="Alternating passes."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG chart here."),
) -> None:
    """Time MODEL at each batch size and thread count; with --vs, side by side."""
    if not model.is_file():
        raise ModelFormatError(f"model file {str(model)!r} does not exist")
    config = BenchConfig(batches=_ints(batch, "--batch"), threads=_ints(threads, "--threads"),
                         passes=passes, backend=backend, vs=vs or None,
                         dims=tuple(parse_dims(dims).items()))
    data = model.read_bytes()
    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True, disable=as_json) as progress:
        task = progress.add_task(f"benchmarking {model.name}", total=None)
        report = bench_model(model.stem, data, config,
                             progress=lambda msg: progress.update(task, description=msg))
    if plot is not None:
        _plot(report, plot)
    if as_json:
        typer.echo(report.to_json())
    else:
        Console().print(_table(report))


def _table(report: ModelReport) -> Table:
    table = Table(title=f"{report.model}: median latency (ms), p90, throughput")
    for col in ("runtime", "batch", "threads", "median ms", "p90 ms", "samples/s"):
        table.add_column(col)
    for m in report.measurements:
        table.add_row(m.runtime, str(m.batch), str(m.threads), f"{m.median_ms:.3f}",
                      f"{m.p90_ms:.3f}", f"{m.throughput:.1f}")
    for key, ratio in report.ratios.items():
        other = "torch" if any(m.runtime.startswith("torch") for m in report.measurements) \
            else "ort"
        table.caption = (table.caption or "") + f"  {key}: keel/{other} = {ratio:.2f}"
    return table


def _plot(report: ModelReport, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError(
            "--plot needs matplotlib (pip install 'keel-runtime[bench]')"
        ) from None
    labels = sorted({f"b{m.batch}/t{m.threads}" for m in report.measurements})
    runtimes = sorted({m.runtime for m in report.measurements})
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 3, 4))
    width = 0.8 / max(len(runtimes), 1)
    for i, rt in enumerate(runtimes):
        by = {f"b{m.batch}/t{m.threads}": m.median_ms for m in report.measurements
              if m.runtime == rt}
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [by.get(lbl, 0.0) for lbl in labels], width, label=rt)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels)
    ax.set_ylabel("median latency (ms)")
    ax.set_title(f"{report.model}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
