"""load_model runs with the cyclic garbage collector paused and restores it after."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

import keel
from keel import _gc


def _relu() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def test_a_load_restores_the_collector_as_it_was() -> None:
    assert gc.isenabled()
    model = keel.load_model(_relu(), plan_cache=False)
    assert gc.isenabled()
    np.testing.assert_array_equal(model.predict({"x": np.array([-1, 2], np.float32)})["y"],
                                  [0, 2])
    gc.disable()
    try:
        keel.load_model(_relu(), plan_cache=False)
        assert not gc.isenabled()                # off before: still off
    finally:
        gc.enable()


def test_a_failed_load_restores_the_collector() -> None:
    with pytest.raises(keel.KeelError):
        keel.load_model(b"not a model", plan_cache=False)
    assert gc.isenabled()


def test_overlapping_pauses_resume_when_the_last_ends() -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with _gc.paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    with _gc.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()                    # the other pause still runs
    release.set()
    thread.join(10)
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_child_forked_during_a_load_collects_again() -> None:
    with _gc.paused():
        pid = os.fork()
        if pid == 0:                              # the child: no load runs here
            os._exit(0 if gc.isenabled() and _gc._depth == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
