"""Fixtures the native tests share: a tiny source folder, and the skips of a module whose
tests need a native tier (``pytestmark = pytest.mark.usefixtures("native_gemm_tier")``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel import native
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


def _needs(ready: bool) -> None:
    if not ready:
        pytest.skip(f"native tier unavailable: {native.status().reason}")


@pytest.fixture
def native_tier() -> None:
    """Skips the test where native kernels cannot run here (no compiler, KEEL_NATIVE=off)."""
    _needs(native.available())


@pytest.fixture
def native_gemm_tier() -> None:
    """Skips the test where the native GEMM (gemm.c) is not loaded."""
    from keel.backends.cpu import native_gemm

    _needs(native_gemm.available())


@pytest.fixture
def native_window_tier() -> None:
    """Skips the test where the native window kernels (window.c) are not loaded."""
    from keel.backends.cpu import native_window

    _needs(native_window.ready())


@pytest.fixture
def native_winograd_tier() -> None:
    """Skips the test where the native Winograd transforms (winograd.c) are not loaded."""
    from keel.backends.cpu import winograd

    _needs(winograd._functions() is not None)
