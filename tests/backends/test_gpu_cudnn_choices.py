"""cuDNN engine choices kept on disk: a later process builds the engine an earlier one
measured fastest, and a file of another GPU, another engine ranking, garbage or another
user's is never taken. Runs on the fake cuDNN frontend and the fake CuPy (host memory)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from keel import config
from keel.backends.gpu import cudnn_choices, cudnn_graph, cudnn_lib
from keel.backends.gpu.backend import GpuBackend
from keel.backends.gpu.cudnn_lib import CudnnLibrary
from keel.backends.reference.backend import ReferenceBackend
from keel.ops.registry import Op
from tests.backends.fakes import FakeCudnn, FakeCupy
from tests.backends.test_gpu_cudnn import _attrs, _inputs

ATTRS = _attrs(pads=(1, 1, 1, 1))
X, W = (2, 3, 5, 5), (4, 3, 3, 3)


@pytest.fixture
def cache_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KEEL_PLAN_CACHE", "on")
    config.reload_settings()
    return tmp_path / "cudnn"


def _process(monkeypatch: pytest.MonkeyPatch, version: int = 91900,
             names: tuple[str, ...] = ()) -> tuple[FakeCudnn, FakeCupy]:
    """What a fresh process has: a new library object (nothing built in memory yet) and a
    fresh view of the cache files."""
    cupy = FakeCupy()
    fake = FakeCudnn(version, plan_costs=(3.0, 1.0, 2.0), tick=cupy.advance)
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(lambda: fake))
    monkeypatch.setattr(cudnn_choices, "_CACHES", {})
    monkeypatch.setattr(cudnn_graph, "_COMPILED", {})
    return fake, cupy


def _run(cupy: FakeCupy) -> tuple[np.ndarray, str]:
    arrays = _inputs(X, W)
    got = GpuBackend(cupy_module=cupy).run(Op.CONV, arrays, attrs=ATTRS, variant="cudnn")[0]
    want = ReferenceBackend().run(Op.CONV, arrays, attrs=ATTRS)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rows = [r for r in cudnn_graph.built() if r["x"] == X]
    return got, rows[-1]["engine"]


def _entries(folder: Path) -> dict[str, dict[str, object]]:
    (path,) = folder.glob("engines-*.json")
    data = json.loads(path.read_text())
    assert data["format"] == cudnn_choices.FILE_FORMAT
    return data["entries"]


def test_a_later_process_builds_only_the_engine_measured_fastest(
        cache_on: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, cupy = _process(monkeypatch)
    first, how = _run(cupy)
    assert how.startswith("fake_engine_1, fastest of 3 engines")
    assert sorted(set(fake.builds[0].timed)) == [0, 1, 2]
    (entry,) = _entries(cache_on).values()
    assert entry == {"fusion": "conv + bias", "plan": 1, "engine": "fake_engine_1", "ms": 1.0}

    fake, cupy = _process(monkeypatch)
    again, how = _run(cupy)
    assert how.startswith("fake_engine_1, measured fastest earlier on this GPU (1.000 ms)")
    assert len(fake.builds) == 1 and fake.builds[0].timed == []    # nothing timed
    assert fake.builds[0]._plan_index == 1
    np.testing.assert_array_equal(again, first)


def test_choices_of_another_cudnn_are_not_taken(cache_on: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _run(_process(monkeypatch, version=91900)[1])
    fake, cupy = _process(monkeypatch, version=92000)
    _, how = _run(cupy)
    assert "fastest of 3 engines" in how and fake.builds[0].timed
    assert len(list(cache_on.glob("engines-*.json"))) == 2     # one file per identity


def test_an_engine_ranked_elsewhere_now_is_measured_again(
        cache_on: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(_process(monkeypatch)[1])
    (path,) = cache_on.glob("engines-*.json")
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["engine"] = "an_engine_cudnn_no_longer_ranks_there"
    path.write_text(json.dumps(data))
    fake, cupy = _process(monkeypatch)
    _, how = _run(cupy)
    assert "fastest of 3 engines" in how and fake.builds[0].timed
    assert [e["engine"] for e in _entries(cache_on).values()] == ["fake_engine_1"]


def test_a_damaged_file_is_ignored_then_replaced(cache_on: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _run(_process(monkeypatch)[1])
    (path,) = cache_on.glob("engines-*.json")
    path.write_bytes(b"\x00{not json")
    _, cupy = _process(monkeypatch)
    _, how = _run(cupy)
    assert "fastest of 3 engines" in how
    assert [e["plan"] for e in _entries(cache_on).values()] == [1]


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no POSIX file modes here")
def test_a_file_others_can_write_is_neither_read_nor_written(
        cache_on: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(_process(monkeypatch)[1])
    (path,) = cache_on.glob("engines-*.json")
    before = path.read_text()
    path.chmod(0o666)
    fake, cupy = _process(monkeypatch)
    _, how = _run(cupy)
    assert "fastest of 3 engines" in how and fake.builds[0].timed
    (store,) = cudnn_choices._CACHES.values()
    assert store.status.startswith("refused")
    assert path.read_text() == before


def test_no_file_with_the_plan_cache_off(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KEEL_PLAN_CACHE", "off")
    config.reload_settings()
    _run(_process(monkeypatch)[1])
    assert not (tmp_path / "cudnn").exists()
