"""Fork safety: a child forked while another thread is inside ``predict`` predicts at once.

Each child runs under a watchdog: one that does not exit within the timeout is killed
and the test fails (before, the child blocked for ever at the model's lock)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from keel.backends.base import KernelContext
from keel.backends.registry import BackendRegistry
from keel.execution.model import Model, load_model
from keel.ops.registry import Op
from keel.testing.backends import FakeBackend, restricted_table
from keel.testing.models import make_inputs, mlp

pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
              # Python 3.12+ warns of fork in a threaded process: that is the point here.
              pytest.mark.filterwarnings("ignore:This process .* is multi-threaded"
                                         ":DeprecationWarning")]
WATCHDOG_S = 60.0


def _in_child(work: Callable[[], bool], timeout: float = WATCHDOG_S) -> int | None:
    """Fork; the child runs ``work`` and exits 0 when it returns True. The child's exit
    status, or None when it was still running after ``timeout`` seconds (then killed)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = 0 if work() else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _gated_model(armed: threading.Event, inside: threading.Event,
                 release: threading.Event) -> Model:
    """An mlp whose Relu kernel, once ``armed`` and in this process only, says it is running
    and waits: a thread in its predict holds the model's lock as long as the test wants."""
    from keel.backends.reference.kernels import load

    parent = os.getpid()

    def relu(ctx: KernelContext, ins: Sequence[Any], attrs: Mapping[str, Any],
             out: Sequence[Any] | None) -> list[Any]:
        if armed.is_set() and os.getpid() == parent:
            inside.set()
            release.wait(WATCHDOG_S)
        return [np.maximum(ins[0], 0)]

    table = restricted_table("cpu", load(), [op for op in Op if op is not Op.RELU])
    table.kernel(Op.RELU)(relu)
    registry = BackendRegistry()
    registry.register("cpu", lambda: FakeBackend("cpu", table=table))
    return load_model(mlp(in_features=8, hidden=(16,), classes=3), backend="cpu",
                      registry=registry, optimization_level="none")   # Relu stays a node


def test_a_child_forked_while_a_thread_is_inside_predict_can_predict() -> None:
    armed, inside, release = threading.Event(), threading.Event(), threading.Event()
    model = _gated_model(armed, inside, release)
    feeds = make_inputs(mlp(in_features=8, hidden=(16,), classes=3), 4)
    want = model.predict(feeds)                    # not armed yet: the expected answer
    armed.set()
    busy = threading.Thread(target=model.predict, args=(feeds,))
    busy.start()
    try:
        assert inside.wait(WATCHDOG_S)             # the thread is in predict, lock held
        code = _in_child(lambda: all(np.array_equal(model.predict(feeds)[k], v)
                                     for k, v in want.items()))
    finally:
        release.set()
        busy.join(WATCHDOG_S)
    assert code == 0


def test_children_forked_during_native_multithreaded_predicts_can_predict() -> None:
    # The reproducer: the cpu backend (native GEMM on keel's worker pool), one
    # thread predicting in a loop, the main thread forking. Without the native tier the
    # products run on OpenBLAS's own threads, whose state a fork in the middle of a call
    # can leave locked in the child: keel cannot renew another library's pool
    # (docs/models.md, fork safety).
    from keel import native

    if not native.available():
        pytest.skip(f"keel's worker pool needs the native tier: {native.status().reason}")
    onnx_model = mlp(in_features=256, hidden=(512, 256), classes=10)
    model = load_model(onnx_model, threads=2)
    feeds = make_inputs(onnx_model, 64)
    want = model.predict(feeds)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            model.predict(feeds)

    busy = threading.Thread(target=loop)
    busy.start()
    try:
        codes = []
        for _ in range(5):
            time.sleep(0.02)
            codes.append(_in_child(lambda: all(np.array_equal(model.predict(feeds)[k], v)
                                               for k, v in want.items())))
    finally:
        stop.set()
        busy.join(WATCHDOG_S)
    assert codes == [0] * 5


def test_every_lock_keel_makes_is_renewed_in_a_forked_child() -> None:
    """A new ``threading.Lock()``/``RLock()`` in keel must be registered with
    ``keel._fork.renew_after_fork`` (on the next line), or a fork could leave it held."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "keel"
    made = re.compile(r"^\s*([\w.]+)\s*(:[^=]*)?=\s*threading\.R?Lock\(\)")
    missing = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            found = made.match(line)
            if found and "renew_after_fork(" not in (lines[n + 1] if n + 1 < len(lines) else ""):
                missing.append(f"{path.relative_to(root.parent)}:{n + 1}: {line.strip()}")
    assert not missing, missing


def test_a_module_lock_held_at_fork_is_free_in_the_child() -> None:
    from keel.backends import registry

    with registry._DEFAULT_LOCK:                   # as if another thread were making it
        code = _in_child(lambda: registry.default_registry() is not None
                         and registry._DEFAULT_LOCK.acquire(timeout=5))
    assert code == 0
