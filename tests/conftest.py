"""Test-wide isolation: no test reads a calibration or cache left on the machine.

The compiled-plan cache is off unless a test turns it on: a test that patches
keel's internals must plan afresh, not find a plan another test stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keel import config


@pytest.fixture(autouse=True)
def _isolated_keel_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
                         ) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(Path(tmp_path_factory.getbasetemp()) / "keel-cache"))
    monkeypatch.setenv("KEEL_CALIBRATION", "off")
    monkeypatch.setenv("KEEL_PLAN_CACHE", "off")
    config.settings.cache_clear()
