"""The zoo's models are exported once per test session, into one temporary folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import exports


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``zoo(name)``: the path of the named export (see ``benchmarks.exports``), made once."""
    reason = exports.missing_packages()
    if reason is not None:
        pytest.skip(f"the zoo exports models with torch and transformers: {reason}")
    folder = tmp_path_factory.mktemp("zoo")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = exports.EXPORTS[name](folder / f"{name}.onnx")
        return made[name]

    return get
