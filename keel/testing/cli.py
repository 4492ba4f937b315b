"""What a ``keel`` command run through click's ``CliRunner`` printed as JSON.

``Result.output`` is everything the command wrote, stderr included: the line a first
build of a native library writes there (``keel.native.build``) comes before the JSON
when the command happens to be the first to load that library in a test worker. A
command's JSON is its stdout alone.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["printed_json"]


def printed_json(result: Any) -> Any:
    """The JSON document ``result`` (a click ``Result``) printed on stdout."""
    return json.loads(result.stdout)
