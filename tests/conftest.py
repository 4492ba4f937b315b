"""Test-wide isolation: no test reads a calibration or cache left on the machine."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_keel_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
                         ) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(Path(tmp_path_factory.getbasetemp()) / "keel-cache"))
    monkeypatch.setenv("KEEL_CALIBRATION", "off")
