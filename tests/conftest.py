"""Test-wide isolation: no test reads a calibration or cache left on the machine."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_keel_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
                         ) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(Path(tmp_path_factory.getbasetemp()) / "keel-cache"))
    monkeypatch.setenv("KEEL_CALIBRATION", "off")


@pytest.fixture
def fresh_tuning() -> Iterator[None]:
    """No measured variant choice (``keel tune``) from another test, before or after.

    The cache directory itself stays: it holds the native kernels built once per session.
    """
    from keel.config import cache_dir

    folder = cache_dir() / "tuning"
    shutil.rmtree(folder, ignore_errors=True)
    yield
    shutil.rmtree(folder, ignore_errors=True)
