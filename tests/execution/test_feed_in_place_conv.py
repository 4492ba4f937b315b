"""A network's first conv reading a feed too large to stage, where the caller has it.

A feed over ``STAGE_FEED_BYTES`` and up to ``FEED_IN_PLACE_MOST_BYTES`` gets a buffer of
the program's where every step reading it can read it in place (a band conv's X, the
fused conv + pool's X): those steps bind and the steady run moves their X to the
caller's array each run. Whatever array the caller passes, and however it changes it
between runs, the results must be the bits the same model computes with the rule off
(the feed unstaged, the conv unbound), on 1, 2, 3 and 16 threads, and the caller's
array is never written.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from keel import native
from keel.backends.bound import BoundCall
from keel.backends.cpu import native_gemm, native_window
from keel.backends.cpu import planner as cpu_planner
from keel.errors import InvalidArgumentError
from keel.execution import program as program_module
from keel.execution.model import Model, load_model

SIZE = 150          # 3 x 150 x 150 float32: 264 KiB, over STAGE_FEED_BYTES


@pytest.fixture(autouse=True)
def _native_tier() -> None:
    if not (native_gemm.available() and native_window.ready()):
        pytest.skip(f"native tier unavailable: {native.status().reason}")


def _stem(pooled: bool, batch: int = 1, second_reader: bool = False,
          large_output: bool = False) -> bytes:
    """A network's first conv on a 3 x SIZE x SIZE image, then a global mean (a small
    graph output: held, so the whole run is bound). ``pooled``: ResNet-18's 7x7 stride-2
    conv + ReLU + 3x3 stride-2 MaxPool (the planner pools it in the conv); else
    MobileNetV2's 3x3 stride-2 conv + Clip(0, 6) (a band conv). ``second_reader``: the
    feed's own mean is a graph output too (a step that cannot read it in place).
    ``large_output``: the conv's (pool's) output is a graph output too, too large to
    hold (so the run is not all bound calls)."""
    rng = np.random.default_rng(11)
    k, out = (7, 64) if pooled else (3, 32)
    w = (rng.standard_normal((out, 3, k, k)) * 0.1).astype(np.float32)
    consts = [numpy_helper.from_array(w, "w"),
              numpy_helper.from_array(rng.standard_normal(out).astype(np.float32), "b")]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w", "b"], ["c"], kernel_shape=[k, k], strides=[2, 2],
               pads=[k // 2] * 4)]
    if pooled:
        nodes += [n("Relu", ["c"], ["r"]),
                  n("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                    pads=[1, 1, 1, 1])]
    else:
        consts += [numpy_helper.from_array(np.float32(0), "lo"),
                   numpy_helper.from_array(np.float32(6), "hi")]
        nodes.append(n("Clip", ["c", "lo", "hi"], ["p"]))
    nodes.append(n("GlobalAveragePool", ["p"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if second_reader:
        nodes.append(n("GlobalAveragePool", ["x"], ["m"]))
        outputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, None))
    if large_output:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                      [batch, 3, SIZE, SIZE])],
        outputs, consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def _load(onnx: bytes, threads: int, in_place: bool, monkeypatch: pytest.MonkeyPatch
          ) -> Model:
    """The model, its steps bound on its first runs with the rule on or off."""
    monkeypatch.setattr(cpu_planner, "FEED_IN_PLACE_MOST_BYTES",
                        1024 * 1024 if in_place else 0)
    return load_model(onnx, backend="cpu", threads=threads, plan_cache=False)


def _program(model: Model, x: np.ndarray) -> program_module.Program:
    fast = model._fast_path({"x": x})
    assert fast is not None
    return fast[0][1]


def _image(seed: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, SIZE, SIZE)).astype(
        np.float32)


def _callers_arrays(seed: int) -> list[np.ndarray]:
    """One image as a caller may pass it: C order, Fortran order, a strided view of a
    larger array, misaligned."""
    x = _image(seed)
    wide = np.zeros((1, 3, SIZE, 2 * SIZE), np.float32)
    wide[..., ::2] = x
    raw = bytearray(x.nbytes + 2)
    odd = np.frombuffer(raw, np.float32, count=x.size, offset=2).reshape(x.shape)
    odd[...] = x
    return [x, np.asfortranarray(x), wide[..., ::2], odd]


def _settled(pooled: bool, threads: int, monkeypatch: pytest.MonkeyPatch
             ) -> tuple[Model, Model, program_module.Program]:
    """The stem with the rule off, with it on after two runs, and the latter's program."""
    onnx = _stem(pooled)
    off = _load(onnx, 1, False, monkeypatch)
    model = _load(onnx, threads, True, monkeypatch)
    for _ in range(2):
        model.predict({"x": _image(0)})
    return off, model, _program(model, _image(0))


def _run(model: Model, x: np.ndarray) -> bytes:
    """The run's output bits; the caller's array is left as it was."""
    before = x.copy()
    y = model.predict({"x": x})["y"]
    assert np.array_equal(x, before), "the caller's array was written"
    return np.asarray(y).tobytes()


@pytest.mark.parametrize("pooled", [False, True])
def test_a_first_conv_reads_the_feed_in_place_and_computes_the_unstaged_bits(
        pooled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step binds and the run is the direct one, reading the caller's array; each
    run gives the bits of the model with the rule off for the same values, on 1, 2, 3
    and 16 threads, whatever array it is given: another array each run, a view, one of
    another order or dtype, one the caller changes between runs, one freed and its
    memory given to the next, and (run by the program itself) one of another dtype (a
    call still reading the first run's array, or the buffer, gives other bits)."""
    onnx = _stem(pooled)
    off = _load(onnx, 1, False, monkeypatch)
    want = {seed: _run(off, _image(seed)) for seed in range(3)}
    assert len(set(want.values())) == 3
    for threads in (1, 2, 3, 16):
        model = _load(onnx, threads, True, monkeypatch)
        for _ in range(2):
            assert _run(model, _image(0)) == want[0]           # the first runs bind
        program = _program(model, _image(0))
        assert [slot for slot, _, _ in program._moving] == [program._input_slots[0]]
        assert program._direct_run is not None
        for seed in (1, 2, 0):
            for x in _callers_arrays(seed):
                assert _run(model, x) == want[seed], (threads, seed, x.flags, x.dtype)
        with pytest.raises(InvalidArgumentError):          # predict checks the dtype
            model.predict({"x": _image(1).astype(np.float64)})
        # the steady run itself copies an array it cannot read (here: of another dtype)
        assert np.asarray(program.execute([_image(1).astype(np.float64)])["y"]
                          ).tobytes() == want[1]
        assert _run(model, _image(2)) == want[2]
        changed = _image(1)
        assert _run(model, changed) == want[1]
        changed[...] = _image(2)                            # same array, new values
        assert _run(model, changed) == want[2]
        for seed in (0, 1, 2):      # a new array each run, a view of a larger one
            base = np.concatenate([_image(seed + 1, 3), _image(seed)])
            assert _run(model, base[3:]) == want[seed]
            gone = weakref.ref(base)
            del base
            gc.collect()
            assert gone() is None, "the program keeps the caller's array alive"


@pytest.mark.parametrize("pooled", [False, True])
def test_every_step_of_the_steady_run_is_c_only(pooled: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The conv (and the fused pool) are marked ``native``, so the run sets no NumPy
    floating-point state."""
    model = _load(_stem(pooled), 1, True, monkeypatch)
    x = _image(0)
    for _ in range(2):
        model.predict({"x": x})
    run = _program(model, x)._direct_run
    assert run is not None
    cells = dict(zip(run.__code__.co_freevars, run.__closure__ or (), strict=True))
    calls = cells["calls"].cell_contents
    assert all(isinstance(c, BoundCall) and c.native for c in calls)
    assert cells["quiet"].cell_contents is False


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("why", ["second_reader", "large_output"])
def test_a_feed_that_would_be_copied_each_run_is_not_staged(
        pooled: bool, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that cannot move (the feed's own mean), or a run that is not all bound
    calls (a graph output too large to hold), would copy the feed each run: it gets no
    buffer and its steps run unbound, as with the rule off."""
    onnx = _stem(pooled, **{why: True})
    off = _load(onnx, 1, False, monkeypatch)
    model = _load(onnx, 2, True, monkeypatch)
    for seed in (0, 1, 1, 2):
        x = _image(seed)
        got, want = model.predict({"x": x}), off.predict({"x": x})
        assert got.keys() == want.keys() and len(got) == 2
        for name in got:
            assert np.asarray(got[name]).tobytes() == np.asarray(want[name]).tobytes()
    program = _program(model, _image(0))
    assert program._staged == () and program._moving == ()


def test_a_feed_over_the_most_is_not_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four images (1.03 MiB) are over FEED_IN_PLACE_MOST_BYTES: no buffer, as before."""
    onnx = _stem(False, batch=4)
    model = _load(onnx, 1, True, monkeypatch)
    x = _image(0, batch=4)
    for _ in range(2):
        got = model.predict({"x": x})["y"]
    assert _program(model, x)._staged == ()
    assert np.asarray(got).tobytes() == np.asarray(
        _load(onnx, 1, False, monkeypatch).predict({"x": x})["y"]).tobytes()


def test_explain_states_the_rule() -> None:
    model = load_model(_stem(False), backend="cpu", threads=1)
    text = model.explain()
    assert "FEED_IN_PLACE_MOST_BYTES" in text and "a band conv's X" in text


@pytest.mark.parametrize("pooled", [False, True])
def test_a_run_that_cannot_be_direct_does_not_stage_the_feed(
        pooled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without NumPy 2's FP context variable (NumPy 1.x) no run is direct: the execute
    path would copy the feed each run, so it gets no buffer, as with the rule off."""
    monkeypatch.setattr(program_module, "_FP_STATE", None)
    onnx = _stem(pooled)
    off = _load(onnx, 1, False, monkeypatch)
    model = _load(onnx, 1, True, monkeypatch)
    for seed in (0, 1, 1, 2):
        assert _run(model, _image(seed)) == _run(off, _image(seed))
    program = _program(model, _image(0))
    assert program._direct_run is None
    assert program._staged == () and program._moving == ()


@pytest.mark.parametrize("pooled", [False, True])
def test_a_run_into_given_outputs_reads_the_feed_in_place(
        pooled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Program.run(outputs=...)`` (memory-limited chunks, throughput streams) points
    the calls at the caller's array as the steady run does: the feed's buffer is not
    written, and an array they cannot read (Fortran order) is copied there."""
    off, model, program = _settled(pooled, 2, monkeypatch)
    ((_, buf, _),) = program._moving
    for seed in (1, 2):
        want = _run(off, _image(seed))
        out = {"y": np.empty((1, 64 if pooled else 32, 1, 1), np.float32)}
        buf[...] = np.nan
        program.run({"x": _image(seed)}, outputs=out)
        assert out["y"].tobytes() == want and np.isnan(buf).all()
        program.run({"x": np.asfortranarray(_image(seed))}, outputs=out)
        assert out["y"].tobytes() == want and np.array_equal(buf, _image(seed))
        assert _run(model, _image(seed)) == want        # the steady run points anew


@pytest.mark.parametrize("pooled", [False, True])
def test_a_keep_all_or_observed_run_lets_go_of_the_caller_s_array(
        pooled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_all and observe run the general kernels, not the bound steps the feed's
    calls were pointed for: the calls are pointed back after the run, so the program
    keeps no reference to the caller's array (the fused stem's step held it)."""
    off, _, program = _settled(pooled, 1, monkeypatch)
    want = _run(off, _image(3))
    for how in ({"keep_all": True}, {"observe": {"x": lambda value: None}}):
        x = _image(3)
        gone = weakref.ref(x)
        assert program.run({"x": x}, **how)["y"].tobytes() == want
        del x
        gc.collect()
        assert gone() is None, how


def test_a_small_feed_read_only_with_a_dropped_feed_is_not_staged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``x + s`` then the conv: the large feed ``x`` is dropped (its reader, the Add,
    cannot move it), and the Add, bound no more, was the only bound step reading the
    small feed ``s``: it is not staged either (copying it gains nothing)."""
    n = helper.make_node
    w = (np.random.default_rng(1).standard_normal((32, 3, 3, 3)) * 0.1).astype(np.float32)
    nodes = [n("Add", ["x", "s"], ["a"]),
             n("Conv", ["a", "w"], ["c"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4),
             n("GlobalAveragePool", ["c"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIZE, SIZE]),
                     helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 3, SIZE, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    onnx = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()
    feeds = {"x": _image(0), "s": _image(1)[..., :1].copy()}
    want = _load(onnx, 1, False, monkeypatch).predict(feeds)["y"]
    model = _load(onnx, 1, True, monkeypatch)
    for _ in range(3):
        got = model.predict(feeds)["y"]
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    fast = model._fast_path(feeds)
    assert fast is not None
    assert fast[0][1]._staged == ()
