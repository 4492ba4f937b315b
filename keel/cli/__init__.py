"""keel's command-line interface: one module per subcommand.

Each subcommand module defines ``register(app)``. Errors keel raises on
purpose print as one line on stderr and exit with status 2.
"""

from __future__ import annotations

import importlib
import sys

import typer

from keel.errors import KeelError

__all__ = ["app", "main"]

SUBCOMMANDS = ("probe", "plan", "backends", "bench", "drop", "demo", "convert", "run", "validate",
               "calibrate", "cache", "tune", "serve")

app = typer.Typer(
    name="keel",
    help="keel: probe the machine, plan where work runs and why, run ONNX models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _name in SUBCOMMANDS:
    importlib.import_module(f"keel.cli.{_name}").register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``keel`` console script."""
    try:
        app(args=argv, prog_name="keel", standalone_mode=True)
    except KeelError as exc:
        typer.echo(f"keel: error: {exc}", err=True)
        sys.exit(2)
