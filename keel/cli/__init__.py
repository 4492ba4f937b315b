"""keel's command-line interface: one module per subcommand.

Each subcommand module defines ``register(app)``. Errors keel raises on
purpose print as one line on stderr and exit with status 2 (``EXIT_ERROR``);
the machine running out of memory where keel did not foresee it prints one
line too and exits with status 3 (``EXIT_OUT_OF_MEMORY``). A traceback (status
1) is a bug.
"""

from __future__ import annotations

import importlib
import sys

import typer

from keel.errors import KeelError

__all__ = ["EXIT_ERROR", "EXIT_OUT_OF_MEMORY", "app", "main"]

EXIT_ERROR = 2             # an error keel raised on purpose (a KeelError)
EXIT_OUT_OF_MEMORY = 3     # a MemoryError keel did not foresee

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
        sys.exit(EXIT_ERROR)
    except MemoryError as exc:
        typer.echo(f"keel: error: out of memory{f' ({exc})' if str(exc) else ''}", err=True)
        sys.exit(EXIT_OUT_OF_MEMORY)
