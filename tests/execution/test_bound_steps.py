"""Steps bound once to the arrays they always run on (``KernelVariant.bind``): a bound
run computes bitwise what the kernels compute unbound, follows new feed values, binds
again when the arena moves, and keeps the kernels' checks on data."""

from __future__ import annotations

import itertools
import math
import threading
import warnings
from typing import Any

import numpy as np
import pytest
from onnx import GraphProto, TensorProto, helper, numpy_helper

from keel.backends.bound import bare
from keel.backends.cpu import fastmath
from keel.errors import InvalidArgumentError
from keel.execution import program as program_module
from keel.execution.model import Model, load_model

HEADS, DIM, PAST, VOCAB = 2, 8, 5, 11
WIDTH = HEADS * DIM


def _serialized(graph: GraphProto) -> bytes:
    """``graph`` as an opset-17 model's bytes."""
    return bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                                   ).SerializeToString())


def _const(name: str, value: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(value, name)


def decode_step() -> bytes:
    """One attention step over a key cache, as exporters write it: an embedding gather,
    LayerNorm, a fused QKV product, Split, head reshapes and transposes, the cache Concat
    (a graph output), a causal-style mask made by Cast/Expand/Where, Softmax, IsNaN, the
    value product, Gemm, an exact GELU and a final residual LayerNorm."""
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)

    inits = [
        _const("table", w(VOCAB, WIDTH)), _const("g1", 1 + w(WIDTH)), _const("b1", w(WIDTH)),
        _const("wqkv", w(WIDTH, 3 * WIDTH)), _const("bqkv", w(3 * WIDTH)),
        _const("heads", np.array([1, 1, HEADS, DIM], np.int64)),
        _const("flat", np.array([1, WIDTH], np.int64)),
        _const("ids_shape", np.array([1, 1], np.int64)),
        _const("mask_axes", np.array([1, 2], np.int64)),
        _const("mask_full", np.array([1, HEADS, 1, 1], np.int64)),
        _const("scale", np.array(1 / math.sqrt(DIM), np.float32)),
        _const("neg", np.array([-np.inf], np.float32)), _const("zero", np.array([0], np.float32)),
        _const("wo", w(WIDTH, WIDTH)), _const("bo", w(WIDTH)),
        _const("sqrt2", np.array(math.sqrt(2), np.float32)),
        _const("one", np.array(1, np.float32)), _const("half", np.array(0.5, np.float32)),
        _const("g2", 1 + w(WIDTH)), _const("b2", w(WIDTH)),
    ]
    n = helper.make_node
    nodes = [
        n("Reshape", ["ids", "ids_shape"], ["ids2"]),
        n("Gather", ["table", "ids2"], ["emb"], axis=0),
        n("Add", ["emb", "x"], ["h"]),
        n("LayerNormalization", ["h", "g1", "b1"], ["n1"], axis=-1),
        n("MatMul", ["n1", "wqkv"], ["qkv0"]), n("Add", ["qkv0", "bqkv"], ["qkv"]),
        n("Split", ["qkv"], ["q", "k", "v"], axis=2, num_outputs=3),
        *(n("Reshape", [t, "heads"], [f"{t}r"]) for t in "qkv"),
        *(n("Transpose", [f"{t}r"], [f"{t}4"], perm=[0, 2, 1, 3]) for t in "qkv"),
        n("Concat", ["past", "k4"], ["present"], axis=2),
        n("Concat", ["past", "v4"], ["values"], axis=2),
        n("Transpose", ["present"], ["kt"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q4", "kt"], ["s0"]), n("Mul", ["s0", "scale"], ["s"]),
        n("Cast", ["mask"], ["mb"], to=TensorProto.BOOL),
        n("Unsqueeze", ["mb", "mask_axes"], ["mb4"]),
        n("Expand", ["mb4", "mask_full"], ["mbe"]),
        n("Where", ["mbe", "s", "neg"], ["sm"]),
        n("Softmax", ["sm"], ["p0"], axis=-1),
        n("IsNaN", ["p0"], ["nan"]), n("Where", ["nan", "zero", "p0"], ["p"]),
        n("MatMul", ["p", "values"], ["o4"]),
        n("Transpose", ["o4"], ["o3"], perm=[0, 2, 1, 3]),
        n("Reshape", ["o3", "flat"], ["o"]),
        n("Gemm", ["o", "wo", "bo"], ["y"]),
        n("Div", ["y", "sqrt2"], ["yd"]), n("Erf", ["yd"], ["ye"]),
        n("Add", ["ye", "one"], ["y1"]), n("Mul", ["y", "y1"], ["yg0"]),
        n("Mul", ["yg0", "half"], ["yg"]),
        n("Reshape", ["h", "flat"], ["h2"]), n("Add", ["yg", "h2"], ["r"]),
        n("LayerNormalization", ["r", "g2", "b2"], ["out"], axis=-1),
    ]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    graph = helper.make_graph(
        nodes, "decode_step",
        [helper.make_tensor_value_info("ids", i64, [1, 1]),
         helper.make_tensor_value_info("x", f32, [1, 1, WIDTH]),
         helper.make_tensor_value_info("mask", i64, [1, "total"]),
         helper.make_tensor_value_info("past", f32, [1, HEADS, "past", DIM])],
        [helper.make_tensor_value_info("out", f32, None),
         helper.make_tensor_value_info("present", f32, None)],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def feeds(seed: int, past: int = PAST) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((1, past + 1), np.int64)
    mask[0, 0] = 0                                     # one cache position hidden
    return {"ids": rng.integers(0, VOCAB, (1, 1)).astype(np.int64),
            "x": rng.standard_normal((1, 1, WIDTH)).astype(np.float32),
            "mask": mask,
            "past": rng.standard_normal((1, HEADS, past, DIM)).astype(np.float32)}


def unbound(model: Model, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same run step by step through the kernels (``intermediates`` binds nothing)."""
    values = model.intermediates(inputs)
    return {info.name: values[info.name] for info in model.outputs}


def steady_program(model: Model, inputs: dict[str, np.ndarray]) -> Any:
    """The program a steady run of ``inputs``' shapes runs, after one run."""
    model.predict(inputs)
    fast = model._fast_path(inputs)
    assert fast is not None
    return fast[0][1]


def bound_kinds(model: Model, inputs: dict[str, np.ndarray]) -> list[str]:
    fast = model._fast_path(inputs)
    assert fast is not None
    (_, program, _), _ = fast
    return [step.op for step, hot in zip(program._steps, program._hot, strict=True)
            if hot[0] == program_module._BOUND]


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model(decode_step(), backend="cpu", threads=1)


def test_bound_steps_compute_bitwise_what_the_kernels_compute(model: Model) -> None:
    first = feeds(1)
    model.predict(first)
    kinds = bound_kinds(model, first)
    # The steps reading only arena views and weights bind; those reading a feed or
    # making a graph output (a fresh array per call) run their kernels.
    expected = {"split", "transpose", "where", "expand", "isnan", "gather", "mul"}
    if fastmath.available():                 # the native products and softmax bind too
        expected |= {"gemm", "matmul", "softmax"}
    assert expected <= set(kinds)
    for seed in (2, 3, 4):                    # new values in the same arrays' places
        inputs = feeds(seed)
        got = model.predict(inputs)
        want = unbound(model, inputs)
        for name in ("out", "present"):
            np.testing.assert_array_equal(got[name], want[name])


def test_a_profiled_run_times_the_bound_steps_the_steady_run_executes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiling runs the steps as the steady run does (bound calls where they bound,
    never the general path for those), gives every step a time, and computes bitwise the
    unprofiled result."""
    model = load_model(decode_step(), backend="cpu", threads=1)
    inputs = feeds(10)
    want = model.predict(inputs)
    fast = model._fast_path(inputs)
    assert fast is not None
    (_, program, _), _ = fast
    bound = {step.name for step, hot in zip(program._steps, program._hot, strict=True)
             if hot[0] == program_module._BOUND}
    assert bound
    general: list[str] = []
    run_general = program_module.Program._general

    def spy(self: program_module.Program, step: program_module._Step,
            outputs: object) -> None:
        general.append(step.name)
        run_general(self, step, outputs)  # type: ignore[arg-type]

    monkeypatch.setattr(program_module.Program, "_general", spy)
    model.enable_profiling()
    for _ in range(2):
        got = model.predict(inputs)
        for name in ("out", "present"):
            np.testing.assert_array_equal(got[name], want[name])
    profiler = model.profiler
    assert profiler is not None and len(profiler.runs) == 2
    names = [name for name, _, _ in program.steps]
    assert [e.name for e in profiler.events] == names * 2
    assert all(e.duration_ns > 0 for e in profiler.events)
    assert not bound & set(general)       # the general path ran no bound step


def test_bound_steps_match_onnxruntime(model: Model) -> None:
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(decode_step(), providers=["CPUExecutionProvider"])
    for seed in (5, 6):
        inputs = feeds(seed)
        got = model.predict(inputs)
        want = dict(zip(("out", "present"), session.run(["out", "present"], inputs),
                        strict=True))
        for name, ref in want.items():
            err = np.linalg.norm(got[name] - ref) / np.linalg.norm(ref)
            assert err < 1e-5, (name, err)


def test_bound_steps_bind_again_when_the_arena_moves() -> None:
    model = load_model(decode_step(), backend="cpu", threads=1)
    small, large = feeds(7), feeds(8, past=40)
    want_small, want_large = unbound(model, small), unbound(model, large)
    np.testing.assert_array_equal(model.predict(small)["out"], want_small["out"])
    # The larger signature grows the shared arena: the first program's views move.
    np.testing.assert_array_equal(model.predict(large)["out"], want_large["out"])
    np.testing.assert_array_equal(model.predict(small)["out"], want_small["out"])
    assert bound_kinds(model, small)


def test_a_bound_gather_still_checks_its_indices(model: Model) -> None:
    inputs = feeds(9)
    model.predict(inputs)
    assert "gather" in bound_kinds(model, inputs)
    bad = dict(inputs, ids=np.array([[VOCAB + 3]], np.int64))
    with pytest.raises(InvalidArgumentError, match="out of range"):
        model.predict(bad)
    # The failed run left nothing behind: the next one is right.
    np.testing.assert_array_equal(model.predict(inputs)["out"], unbound(model, inputs)["out"])


def overflow_model() -> bytes:
    n = helper.make_node
    graph = helper.make_graph(
        [n("Relu", ["x"], ["a"]), n("Abs", ["x"], ["b"]), n("Add", ["a", "b"], ["s"]),
         n("Neg", ["s"], ["y"])],
        "overflow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def test_bound_steps_overflow_quietly_as_their_kernels_do() -> None:
    model = load_model(overflow_model(), backend="cpu", threads=1)
    x = np.array([3e38, 1.0, -2.0, 0.0], np.float32)
    model.predict({"x": x})
    assert "add" in bound_kinds(model, {"x": x})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = model.predict({"x": x})["y"]
    np.testing.assert_array_equal(y, [-np.inf, -2.0, -2.0, -0.0])


def test_a_run_on_another_thread_computes_the_same(model: Model) -> None:
    """A bound native product packs into the workspace of the thread it was bound on:
    another thread binds the program's steps for itself (bitwise the same result)."""
    inputs = feeds(11)
    here = model.predict(inputs)
    fast = model._fast_path(inputs)
    assert fast is not None
    program = fast[0][1]
    there: dict[str, dict[str, np.ndarray]] = {}
    worker = threading.Thread(target=lambda: there.setdefault("out", model.predict(inputs)))
    worker.start()
    worker.join()
    for name in ("out", "present"):
        np.testing.assert_array_equal(there["out"][name], here[name])
    assert worker.ident in program._threads and threading.get_ident() in program._threads
    np.testing.assert_array_equal(model.predict(inputs)["out"], here["out"])


HEAD_W = np.random.default_rng(1).standard_normal((24, 8, 1, 1)).astype(np.float32)


def conv_pool_head() -> bytes:
    """A conv, ReLU, GlobalAveragePool and Flatten: a classifier's end."""
    n = helper.make_node
    graph = helper.make_graph(
        [n("Conv", ["x", "w"], ["c"]), n("Relu", ["c"], ["r"]),
         n("GlobalAveragePool", ["r"], ["p"]), n("Flatten", ["p"], ["y"])], "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 7, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [_const("w", HEAD_W)])
    return _serialized(graph)


def test_a_bound_global_average_pool_computes_what_its_kernel_does() -> None:
    model = load_model(conv_pool_head(), backend="cpu", threads=1)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 8, 7, 7)).astype(np.float32)
    model.predict({"x": x})
    assert "global_avg_pool" in bound_kinds(model, {"x": x})
    for _ in range(2):                            # new values in the same places
        x = rng.standard_normal((2, 8, 7, 7)).astype(np.float32)
        got = model.predict({"x": x})["y"]
        np.testing.assert_array_equal(got, unbound(model, {"x": x})["y"])
        r = np.maximum(np.einsum("mc,nchw->nmhw", HEAD_W[:, :, 0, 0], x), 0)
        np.testing.assert_allclose(got, r.mean(axis=(2, 3)), rtol=1e-5, atol=1e-6)


def c_calls_model(act: str) -> bytes:
    """A 3x3 conv and ``act``, a 1x1 conv and ReLU, MaxPool and GlobalAveragePool."""
    rng = np.random.default_rng(8)
    n = helper.make_node
    graph = helper.make_graph(
        [n("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), n(act, ["c1"], ["r1"]),
         n("Conv", ["r1", "w2"], ["c2"]), n("Relu", ["c2"], ["r2"]),
         n("MaxPool", ["r2"], ["m"], kernel_shape=[2, 2], strides=[2, 2]),
         n("GlobalAveragePool", ["m"], ["y"])], "c_calls",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [_const("w1", rng.standard_normal((16, 16, 3, 3)).astype(np.float32)),
         _const("w2", rng.standard_normal((32, 16, 1, 1)).astype(np.float32))])
    return _serialized(graph)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("act", ["Relu", "LeakyRelu"])
def test_steps_that_run_c_code_only_are_marked_native(act: str, threads: int) -> None:
    """The convs' (blocked, Winograd or GEMM), the pools' and the window kernels' bound
    calls run C code only and say so, so a run of nothing else sets no NumPy
    floating-point state; a conv whose activation is a NumPy pass after its C call
    (LeakyRelu) is not marked. Either way the bits of the unbound run."""
    from keel import native
    from keel.backends.bound import BoundCall

    model = load_model(c_calls_model(act), backend="cpu", threads=threads)
    rng = np.random.default_rng(10)
    program = steady_program(model, {"x": rng.standard_normal((1, 16, 16, 16)).astype(
        np.float32)})
    if native.available():
        marked = [isinstance(hot[1], BoundCall) and hot[1].native for hot in program._hot]
        assert [step.op for step in program._steps] == [
            "conv", "conv", "max_pool", "global_avg_pool"]
        assert marked == [act == "Relu", True, True, True]
    for _ in range(2):
        x = rng.standard_normal((1, 16, 16, 16)).astype(np.float32)
        np.testing.assert_array_equal(model.predict({"x": x})["y"],
                                      unbound(model, {"x": x})["y"])
    if program_module._FP_STATE is not None:
        if native.available():                          # every step a bound call
            assert program._direct_run is not None      # the steady run, one function
        # The steady run quiets NumPy's state by the ignoring state it remembers for the
        # state it finds (_Quiet._made): a state it never found before gets one on a run
        # that sets it, and none on a run of C calls only.
        with np.errstate(over="warn", under="ignore", divide="warn", invalid="warn"):
            found = program_module._FP_STATE.get()
            model.predict({"x": x})
        sets = found in program_module._Quiet._made
        assert sets is not all(isinstance(hot[1], BoundCall) and hot[1].native
                               for hot in program._hot)
        assert sets is (act != "Relu" or not native.available())


CONV_W = np.random.default_rng(2).standard_normal((6, 1, 5, 5)).astype(np.float32)
CONV_B = np.random.default_rng(3).standard_normal(6).astype(np.float32)
CONV2_W = np.random.default_rng(4).standard_normal((8, 6, 3, 3)).astype(np.float32)


def small_cnn() -> bytes:
    """LeNet's front at batch 1: a conv reading the feed, ReLU, MaxPool, a conv with
    padding, AveragePool, Flatten and a ReLU making the graph output."""
    n = helper.make_node
    graph = helper.make_graph(
        [n("Conv", ["x", "w", "b"], ["c"]), n("Relu", ["c"], ["r"]),
         n("MaxPool", ["r"], ["m"], kernel_shape=[2, 2], strides=[2, 2]),
         n("Conv", ["m", "w2"], ["c2"], pads=[1, 1, 1, 1]),
         n("AveragePool", ["c2"], ["a"], kernel_shape=[2, 2], strides=[2, 2]),
         n("Flatten", ["a"], ["f"]), n("Relu", ["f"], ["y"])], "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [_const("w", CONV_W), _const("b", CONV_B), _const("w2", CONV2_W)])
    return _serialized(graph)


@pytest.mark.parametrize("threads", [1, 2])
def test_bound_convolutions_and_pools_compute_what_their_kernels_do(threads: int) -> None:
    """Conv (native implicit GEMM), MaxPool and AveragePool bind; a run of a program whose
    steps all bound goes straight to the calls, bitwise what the kernels compute."""
    from keel import native

    ort = pytest.importorskip("onnxruntime")
    model = load_model(small_cnn(), backend="cpu", threads=threads)
    session = ort.InferenceSession(small_cnn(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
    program = steady_program(model, {"x": x})
    if native.available():                   # the compiled kernels bind
        assert {"conv", "max_pool", "avg_pool"} <= set(bound_kinds(model, {"x": x}))
        assert program._direct and program._direct_run is not None   # one function
    for _ in range(3):                       # new values in the same places
        x = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
        got = model.predict({"x": x})["y"]
        np.testing.assert_array_equal(got, unbound(model, {"x": x})["y"])
        (want,) = session.run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The caller keeps what it got: the next run does not write into it.
    kept = got.copy()
    model.predict({"x": x + 1})
    np.testing.assert_array_equal(got, kept)
    with pytest.raises(InvalidArgumentError):
        model.predict({"x": x[..., :8]})     # a feed of another shape is still checked


def lookup_model() -> bytes:
    """Gather rows of a table by a fed index, then ReLU: every step binds (the small feed
    and output through the program's own buffers)."""
    table = np.random.default_rng(6).standard_normal((VOCAB, WIDTH)).astype(np.float32)
    n = helper.make_node
    graph = helper.make_graph(
        [n("Gather", ["table", "ids"], ["rows"], axis=0), n("Relu", ["rows"], ["y"])],
        "lookup", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, WIDTH])],
        [_const("table", table)])
    return _serialized(graph)


def test_a_failing_step_of_a_direct_run_names_its_node_and_leaves_nothing_behind() -> None:
    model = load_model(lookup_model(), backend="cpu", threads=1)
    good = {"ids": np.array([0, 4, VOCAB - 1], np.int64)}
    want = model.predict(good)["y"]
    fast = model._fast_path(good)
    assert fast is not None and fast[0][1]._direct and fast[0][1]._direct_run is not None
    with pytest.raises(InvalidArgumentError, match="out of range") as failure:
        model.predict({"ids": np.array([0, VOCAB + 2, 1], np.int64)})
    assert any("(gather)" in note for note in getattr(failure.value, "__notes__", ()))
    np.testing.assert_array_equal(model.predict(good)["y"], want)
    np.testing.assert_array_equal(want, np.maximum(unbound(model, good)["y"], 0))


def linear_norm(rows: int, width: int = 256) -> bytes:
    """x (rows, width) @ W + b, then LayerNorm: the feed is read by the product and the
    graph output written by the LayerNorm."""
    rng = np.random.default_rng(rows)
    n = helper.make_node
    graph = helper.make_graph(
        [n("MatMul", ["x", "w"], ["p"]), n("Add", ["p", "b"], ["h"]),
         n("LayerNormalization", ["h", "g", "beta"], ["y"], axis=-1)],
        "linear_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, width])],
        [_const("w", (rng.standard_normal((width, width)) / 16).astype(np.float32)),
         _const("b", rng.standard_normal(width).astype(np.float32)),
         _const("g", rng.standard_normal(width).astype(np.float32)),
         _const("beta", rng.standard_normal(width).astype(np.float32))])
    return _serialized(graph)


@pytest.mark.parametrize("threads", [1, 2])
def test_feeds_and_outputs_up_to_the_planners_sizes_are_staged_and_every_step_binds(
        threads: int) -> None:
    """A batch-32 row block (32 KiB feed and output) runs as one function of its feed,
    bitwise what the kernels compute; a feed over STAGE_FEED_BYTES and an output over
    HOLD_BYTES are not copied, and the steps on them run their kernels."""
    from keel import native
    from keel.backends.cpu import planner

    ort = pytest.importorskip("onnxruntime")
    width = 256
    big = planner.STAGE_FEED_BYTES // (4 * width) + 1       # rows: just over the sizes
    for rows, staged in ((32, True), (big, False)):
        onnx_model = linear_norm(rows, width)
        model = load_model(onnx_model, backend="cpu", threads=threads)
        session = ort.InferenceSession(onnx_model, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, width)).astype(np.float32)
        model.predict({"x": x})
        program = model._fast_path({"x": x})[0][1]
        kinds = [hot[0] for hot in program._hot]    # the product's, the LayerNorm's
        if native.available():
            assert kinds == ([program_module._BOUND, program_module._HELD] if staged
                             else [program_module._VIEW1, program_module._FRESH1])
            assert (program._direct_run is not None) is staged
        got = []
        for _ in range(3):                   # new values in the same places
            x = rng.standard_normal((rows, width)).astype(np.float32)
            got.append(model.predict({"x": x})["y"])
            np.testing.assert_array_equal(got[-1], unbound(model, {"x": x})["y"])
            (want,) = session.run(None, {"x": x})
            np.testing.assert_allclose(got[-1], want, rtol=1e-4, atol=1e-4)
        assert not any(np.shares_memory(a, b) for a, b in itertools.pairwise(got))


def linear_gelu(rows: int, width: int = 64, hidden: int = 256) -> bytes:
    """x @ W + b, then the Erf form of GELU as exported, then a second product: the
    GELU fuses into the first product's epilogue, run after its native call."""
    rng = np.random.default_rng(hidden)
    n = helper.make_node
    graph = helper.make_graph(
        [n("MatMul", ["x", "w"], ["p"]), n("Add", ["p", "b"], ["h"]),
         n("Div", ["h", "root2"], ["half"]), n("Erf", ["half"], ["e"]),
         n("Add", ["e", "one"], ["e1"]), n("Mul", ["h", "e1"], ["he"]),
         n("Mul", ["he", "halfc"], ["g"]), n("MatMul", ["g", "w2"], ["y"])],
        "linear_gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, width])],
        [_const("w", (rng.standard_normal((width, hidden)) / 8).astype(np.float32)),
         _const("b", rng.standard_normal(hidden).astype(np.float32)),
         _const("w2", (rng.standard_normal((hidden, width)) / 16).astype(np.float32)),
         _const("root2", np.array([math.sqrt(2.0)], np.float32)),
         _const("one", np.array([1.0], np.float32)),
         _const("halfc", np.array([0.5], np.float32))])
    return _serialized(graph)


@pytest.mark.parametrize("rows", [1, 32])
def test_a_products_fused_gelu_binds_after_its_call_bitwise_at_every_thread_count(
        rows: int) -> None:
    """The product's bound step is its native call and then the bound GELU pass, with
    no Python between them; it computes bitwise what the kernel computes, and the same
    bits on 1, 2, 3 and 16 threads."""
    from keel import native
    from keel.backends.cpu import matmul

    ort = pytest.importorskip("onnxruntime")
    onnx_model = linear_gelu(rows)
    session = ort.InferenceSession(onnx_model, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
    results = []
    for threads in (1, 2, 3, 16):
        model = load_model(onnx_model, backend="cpu", threads=threads)
        model.predict({"x": x})
        program = model._fast_path({"x": x})[0][1]
        first = next(hot for step, hot in zip(program._steps, program._hot, strict=True)
                     if step.attrs.get("activation") == "gelu")
        if native.available():
            assert first[0] == program_module._BOUND
            assert getattr(bare(first[1]), "func", None) is matmul._in_turn
        results.append(model.predict({"x": x})["y"])
        np.testing.assert_array_equal(results[-1], unbound(model, {"x": x})["y"])
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    (want,) = session.run(None, {"x": x})
    np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-4)


def conv_residual(side: int, channels: int = 16) -> bytes:
    """One 3x3 conv whose Add takes a second graph input, then ReLU: the single-node
    model a first benchmark often is. The feed residual is read by the conv's epilogue
    (never written: it is the caller's array)."""
    rng = np.random.default_rng(side)
    n = helper.make_node
    shape = [1, channels, side, side]
    graph = helper.make_graph(
        [n("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
         n("Add", ["c", "r"], ["a"]), n("Relu", ["a"], ["y"])],
        "conv_residual", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                          helper.make_tensor_value_info("r", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [_const("w", (rng.standard_normal((channels, channels, 3, 3)) / 12
                      ).astype(np.float32)),
         _const("b", rng.standard_normal(channels).astype(np.float32))])
    return _serialized(graph)


@pytest.mark.parametrize("side", [32, 64])
def test_a_conv_with_a_feed_residual_fuses_and_runs_bound_bitwise_at_every_thread_count(
        side: int) -> None:
    """The Add of a feed and the ReLU fuse into the conv (one step). At 32x32 (64 KiB
    feeds and output) the run is one function of the feeds; at 64x64 the output is over
    HOLD_BYTES and the conv's prepared call moves to each new output. Either way: the
    kernel's bits, the same on 1, 2, 3 and 16 threads, onnxruntime's values, the feeds
    untouched and every output a new array."""
    from keel import native

    ort = pytest.importorskip("onnxruntime")
    onnx_model = conv_residual(side)
    session = ort.InferenceSession(onnx_model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(side)
    shape = (1, 16, side, side)
    runs = [{k: rng.standard_normal(shape).astype(np.float32) for k in ("x", "r")}
            for _ in range(3)]
    results: dict[int, list[np.ndarray]] = {}
    for threads in (1, 2, 3, 16):
        model = load_model(onnx_model, backend="cpu", threads=threads)
        model.predict(runs[0])
        program = model._fast_path(runs[0])[0][1]
        assert [step.op for step in program._steps] == ["conv"]
        if native.available() and side == 32:
            assert program._direct_run is not None
        got = results[threads] = []
        for inputs in runs:
            kept = {k: v.copy() for k, v in inputs.items()}
            got.append(model.predict(inputs)["y"])
            for k, v in inputs.items():
                np.testing.assert_array_equal(v, kept[k])
            np.testing.assert_array_equal(got[-1], unbound(model, inputs)["y"])
            (want,) = session.run(None, inputs)
            np.testing.assert_allclose(got[-1], want, rtol=1e-4, atol=1e-4)
        assert not any(np.shares_memory(a, b) for a, b in itertools.pairwise(got))
    for threads in (2, 3, 16):
        for a, b in zip(results[1], results[threads], strict=True):
            np.testing.assert_array_equal(a, b)


def layer_norm_model(dtype: type) -> tuple[bytes, dict[str, np.ndarray]]:
    """One LayerNorm of a small fed row block: its bind serves float32 and declines
    float64 (the kernel then runs on the feed as it is)."""
    rng = np.random.default_rng(9)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "g", "beta"], ["y"], axis=-1)],
        "layer_norm", [helper.make_tensor_value_info("x", elem, [4, WIDTH])],
        [helper.make_tensor_value_info("y", elem, [4, WIDTH])],
        [_const("g", rng.standard_normal(WIDTH).astype(dtype)),
         _const("beta", rng.standard_normal(WIDTH).astype(dtype))])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx_model.SerializeToString(), {"x": rng.standard_normal((4, WIDTH)).astype(dtype)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_feed_is_staged_only_where_a_step_bound_to_it(dtype: type) -> None:
    """A small feed is copied into the program's own buffer only where the step reading
    it bound (float32 LayerNorm); where the bind declines (float64) the feed is read as
    it is, and either way the results are what the kernel computes unbound."""
    from keel import native

    onnx_model, feeds = layer_norm_model(dtype)
    model = load_model(onnx_model, backend="cpu", threads=1)
    model.predict(feeds)
    program = model._fast_path(feeds)[0][1]
    (kind,) = [hot[0] for hot in program._hot]
    binds = dtype is np.float32 and native.available()
    assert kind == (program_module._HELD if binds else program_module._FRESH1)
    assert [slot for slot, _ in program._staged] == ([program._slots["x"]] if binds else [])
    rng = np.random.default_rng(10)
    for _ in range(3):                        # new values in the same places
        x = rng.standard_normal((4, WIDTH)).astype(dtype)
        got = model.predict({"x": x})["y"]
        np.testing.assert_array_equal(got, unbound(model, {"x": x})["y"])
        mean = x.mean(-1, keepdims=True)
        want = (x - mean) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * \
            model_constant(onnx_model, "g") + model_constant(onnx_model, "beta")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def model_constant(onnx_model: bytes, name: str) -> np.ndarray:
    from onnx import load_from_string
    (init,) = [i for i in load_from_string(onnx_model).graph.initializer if i.name == name]
    return numpy_helper.to_array(init)
