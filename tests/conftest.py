"""Test-wide isolation: no test reads a calibration or cache left on the machine, and
keel's settings (read once per process, :func:`keel.config.settings`) follow each test's
environment: read again once it is patched and once the patches are undone."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel import config


@pytest.fixture(autouse=True)
def _planner_plans_do_not_outlive_a_test() -> Iterator[None]:
    # Tests lower the cpu planner's thresholds with monkeypatch; a plan it kept under
    # them must not answer a later test's request.
    yield
    from keel.backends.cpu import planner

    planner.forget()


@pytest.fixture(autouse=True)
def _settings_follow_the_environment() -> Iterator[None]:
    # Set up before monkeypatch (below), so torn down after its patches are undone.
    yield
    config.reload_settings()


@pytest.fixture(autouse=True)
def _isolated_keel_cache(_settings_follow_the_environment: None,
                         monkeypatch: pytest.MonkeyPatch,
                         tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(Path(tmp_path_factory.getbasetemp()) / "keel-cache"))
    monkeypatch.setenv("KEEL_CALIBRATION", "off")
    monkeypatch.setenv("KEEL_PLAN_CACHE", "off")
    # The declared least work a thread, on any machine: a test of the measured values
    # asks for them (KEEL_THREAD_COSTS=on).
    monkeypatch.setenv("KEEL_THREAD_COSTS", "off")
    config.reload_settings()


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
