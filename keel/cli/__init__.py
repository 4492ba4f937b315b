"""keel's command-line interface: one module per subcommand.

Each subcommand module defines ``register(app)``. Errors keel raises on
purpose print as one line on stderr (or, under ``--json``, as a JSON error
object on stdout) and exit with status 2 (``EXIT_ERROR``); ``keel validate``
exits 1 when the model ran and an output did not match (see
:mod:`keel.cli.common`); the machine running out of memory where keel did not
foresee it prints one line too and exits with status 3 (``EXIT_OUT_OF_MEMORY``); a
drop whose files do not match their manifest exits with status 4 (``EXIT_TAMPERED``).
"""

from __future__ import annotations

import importlib
import sys
import traceback

import typer

import keel
from keel.cli.common import EXIT_FAILED, report_error
from keel.errors import DropIntegrityError, KeelError

__all__ = ["EXIT_ERROR", "EXIT_OUT_OF_MEMORY", "EXIT_TAMPERED", "app", "main"]

EXIT_ERROR = EXIT_FAILED   # an error keel raised on purpose (a KeelError)
EXIT_OUT_OF_MEMORY = 3     # a MemoryError keel did not foresee
EXIT_TAMPERED = 4          # a drop whose files do not match their manifest

SUBCOMMANDS = ("probe", "plan", "backends", "bench", "drop", "demo", "convert", "run", "validate",
               "calibrate", "cache", "tune", "serve", "build")

app = typer.Typer(
    name="keel",
    help="keel: probe the machine, plan where work runs and why, run ONNX models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"keel {keel.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print keel's version and exit."),
) -> None:
    """keel: probe the machine, plan where work runs and why, run ONNX models."""


for _name in SUBCOMMANDS:
    importlib.import_module(f"keel.cli.{_name}").register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``keel`` console script: exit 0, 1 (did not match) or 2 (failed)."""
    args = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in args
    try:
        code = app(args=args, prog_name="keel", standalone_mode=False)
    except DropIntegrityError as exc:
        report_error(type(exc).__name__, str(exc), as_json)
        sys.exit(EXIT_TAMPERED)
    except KeelError as exc:
        report_error(type(exc).__name__, str(exc), as_json)
        sys.exit(EXIT_FAILED)
    except MemoryError as exc:
        report_error("OutOfMemory", f"out of memory{f' ({exc})' if str(exc) else ''}", as_json)
        sys.exit(EXIT_OUT_OF_MEMORY)
    except typer.TyperException as exc:  # usage errors: unknown option, missing argument...
        _usage_error(exc, as_json)
    except typer.Abort:
        report_error("Aborted", "aborted", as_json)
        sys.exit(EXIT_FAILED)
    except Exception as exc:  # not raised on purpose: a bug; still "could not run", never 1
        traceback.print_exc()
        report_error("InternalError", f"{type(exc).__name__}: {exc}", as_json)
        sys.exit(EXIT_FAILED)
    sys.exit(code if isinstance(code, int) else 0)


def _usage_error(exc: typer.TyperException, as_json: bool) -> None:
    if as_json:
        report_error("UsageError", exc.format_message(), as_json)
    else:
        show = getattr(exc, "show", None)       # click's usage message, with the help hint
        if callable(show):
            show()
        else:
            typer.echo(f"Error: {exc.format_message()}", err=True)
    sys.exit(EXIT_FAILED if exc.exit_code else 0)
