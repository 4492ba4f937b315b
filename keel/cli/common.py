"""What every subcommand shares: exit codes, the JSON error object, ``--dim`` parsing.

Exit codes (documented in docs/cli.md):

* 0: the command did what was asked;
* 1 (:data:`EXIT_MISMATCH`): it ran, and the answer is "no" (``keel validate``:
  an output is outside the tolerance);
* 2 (:data:`EXIT_FAILED`): it could not run (bad arguments, a model keel cannot
  read, a missing optional package...).

Under ``--json`` an error is printed on stdout as ``{"error": {"code": ...,
"message": ...}}`` with the same exit code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import typer

from keel.errors import InvalidArgumentError

__all__ = ["EXIT_FAILED", "EXIT_MISMATCH", "error_object", "parse_dims", "report_error"]

EXIT_MISMATCH = 1
EXIT_FAILED = 2


def error_object(code: str, message: str) -> dict[str, dict[str, str]]:
    """The JSON form of an error: ``{"error": {"code": code, "message": message}}``."""
    return {"error": {"code": code, "message": message}}


def report_error(code: str, message: str, as_json: bool) -> None:
    """One line on stderr (``keel: error: ...``), or the JSON error object on stdout."""
    if as_json:
        typer.echo(json.dumps(error_object(code, message), indent=2))
    else:
        typer.echo(f"keel: error: {message}", err=True)


def parse_dims(specs: Sequence[str]) -> dict[str, int]:
    """``--dim NAME=VALUE`` options as {name: size}: sizes of symbolic dimensions."""
    dims: dict[str, int] = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        name = name.strip()
        if not sep or not name:
            raise InvalidArgumentError(f"--dim {spec!r} must look like NAME=VALUE, e.g. seq=128")
        try:
            value = int(text)
        except ValueError:
            raise InvalidArgumentError(
                f"--dim {spec!r}: the value must be an integer, got {text!r}") from None
        if value < 0:
            raise InvalidArgumentError(f"--dim {spec!r}: the value must be 0 or more")
        if name in dims:
            raise InvalidArgumentError(f"--dim {name!r} is given twice; give each dimension once")
        dims[name] = value
    return dims
