"""Fuzzing the model loaders with truncated and bit-flipped files.

Every damaged copy of a valid ONNX model (and of a valid ``.keel`` file) must
either raise ``ModelFormatError`` or load into a graph that verifies and runs
(a flipped weight bit makes a different but valid model). Nothing else may
escape, and no case may take longer than a fixed bound. The cases come from
fixed seeds, so a failure reproduces.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from keel.errors import KeelError, ModelFormatError
from keel.formats.keel_format import load_keel, save_keel
from keel.graph.importers.onnx import import_onnx
from keel.graph.ir import Graph
from keel.graph.passes import optimize
from tests.graph import models as M
from tests.graph.interp import run_graph
from tests.graph.test_passes import feeds_of

# Flipped weight bits make infinities and NaNs; the kernels' overflow warnings are expected.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CASE_SECONDS = 2.0
TRUNCATIONS = 20
FLIPS = 60


class CaseTimeout(Exception):
    """A single fuzz case ran past CASE_SECONDS."""


@contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (SIGALRM), and check the elapsed time anyway."""
    use_alarm = hasattr(signal, "setitimer")
    if use_alarm:
        def on_alarm(signum: int, frame: Any) -> None:
            raise CaseTimeout(f"case ran past {seconds} s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.perf_counter()
    try:
        yield
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    if time.perf_counter() - start > seconds:
        raise CaseTimeout(f"case ran past {seconds} s")


def damaged(blob: bytes, seed: int) -> Iterator[tuple[str, bytes]]:
    """Truncations at random points and copies with 1-3 random bits flipped."""
    r = np.random.default_rng(seed)
    for _ in range(TRUNCATIONS):
        cut = int(r.integers(0, len(blob)))
        yield f"truncated at {cut}", blob[:cut]
    for _ in range(FLIPS):
        data = bytearray(blob)
        where = []
        for _ in range(int(r.integers(1, 4))):
            pos, bit = int(r.integers(0, len(data))), int(r.integers(0, 8))
            data[pos] ^= 1 << bit
            where.append(f"{pos}.{bit}")
        yield f"bits {','.join(where)} flipped", bytes(data)


def outcome(load: Callable[[bytes], Graph], data: bytes) -> str:
    """'format-error', 'loads-and-runs' or 'loads, run refused'; anything else propagates."""
    try:
        graph = load(data)
    except ModelFormatError:
        return "format-error"
    graph.verify()
    try:
        run_graph(graph, feeds_of(graph, np.random.default_rng(0), batch=2))
    except KeelError:
        return "loads, run refused"  # a damaged but well-formed model the kernels reject
    return "loads-and-runs"


MODELS: dict[str, Callable[[np.random.Generator], Any]] = {
    "mlp": M.mlp, "resnet_block": M.conv_bn_block, "transformer": M.transformer,
    "ln_gelu": M.layer_norm_gelu, "mlp_opset11": lambda r: M.mlp(r, opset=11)}


def _onnx_bytes(name: str) -> bytes:
    data: bytes = MODELS[name](np.random.default_rng(1)).SerializeToString()
    return data


def _keel_bytes(name: str, tmp_path: Any, compress: bool) -> bytes:
    graph = optimize(import_onnx(MODELS[name](np.random.default_rng(1))))
    path = tmp_path / f"{name}.keel"
    save_keel(graph, path, compress=compress)
    return path.read_bytes()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_damaged_onnx_models_fail_cleanly(name: str) -> None:
    tally = _fuzz(import_onnx, _onnx_bytes(name), seed=sorted(MODELS).index(name))
    assert tally["format-error"] >= TRUNCATIONS // 2, tally


@pytest.mark.parametrize("name", ["mlp", "transformer", "resnet_block"])
@pytest.mark.parametrize("compress", [False, True])
def test_damaged_keel_files_fail_cleanly(name: str, compress: bool, tmp_path: Any) -> None:
    tally = _fuzz(load_keel, _keel_bytes(name, tmp_path, compress), seed=100 + compress)
    # Checksums cover the header and every blob; only a flip in alignment padding loads.
    assert tally["format-error"] + tally["loads-and-runs"] == TRUNCATIONS + FLIPS, tally
    assert tally["format-error"] >= TRUNCATIONS + FLIPS - 5, tally


def _fuzz(load: Callable[[bytes], Graph], blob: bytes, seed: int) -> Counter[str]:
    assert outcome(load, blob) == "loads-and-runs"
    tally: Counter[str] = Counter()
    for label, data in damaged(blob, seed):
        try:
            with time_bound(CASE_SECONDS):
                tally[outcome(load, data)] += 1
        except CaseTimeout:
            pytest.fail(f"{label}: loading took longer than {CASE_SECONDS} s")
        except Exception as exc:
            pytest.fail(f"{label}: {type(exc).__name__} escaped: {exc}")
    return tally


def test_damaged_external_data_fails_cleanly(tmp_path: Any) -> None:
    import onnx

    model = M.mlp(np.random.default_rng(1))
    path = tmp_path / "ext.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="w.bin",
                    size_threshold=0)
    weights = (tmp_path / "w.bin").read_bytes()
    r = np.random.default_rng(7)
    for _ in range(20):
        cut = int(r.integers(0, len(weights)))
        (tmp_path / "w.bin").write_bytes(weights[:cut])
        with time_bound(CASE_SECONDS), pytest.raises(ModelFormatError):
            import_onnx(path)
