"""Fixtures the native tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.native.toolchain import find_compiler

ADD_ONE = "int keel_add_one(int x) { return x + 1; }\n"


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """A source folder holding one tiny library, ``adder.c`` (keel_add_one); skips the test
    where no C compiler is found."""
    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(f"native tier unavailable: {why}")
    src = tmp_path / "src"
    src.mkdir()
    (src / "adder.c").write_text(ADD_ONE)
    return src
