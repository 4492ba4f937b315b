"""Control flow (If, Loop, Scan), sequences and optionals in whole models, against
onnxruntime: models built with ``onnx.helper``, loaded on keel's cpu, auto and
reference placements, exported back to ONNX and through ``.keel``; a loop body
compiled once; ``explain()`` showing the subgraphs' plans."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import keel
from keel.errors import ExecutionError, InvalidArgumentError
from keel.execution.evaluate import ProgramEvaluator
from keel.formats.keel_format import load_keel, save_keel
from keel.graph.export import to_onnx
from keel.graph.importers.onnx import import_onnx
from keel.graph.passes import optimize
from keel.graph.subgraphs import captures, walk

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper as h  # noqa: E402

F, I64, B = T.FLOAT, T.INT64, T.BOOL
BACKENDS = ("cpu", "auto", "reference")


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any],
           inits: list[Any] = (), opset: int = 17) -> Any:    # type: ignore[assignment]
    graph = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _const(name: str, value: Any, dtype: Any = np.float32) -> Any:
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _ort(model: Any, feeds: dict[str, Any]) -> list[Any]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(sess.run(None, feeds))


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, list):
            assert isinstance(g, list) and len(g) == len(w)
            _same(g, w)
            continue
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _check(model: Any, feeds: dict[str, Any], backends: tuple[str, ...] = BACKENDS) -> None:
    want = _ort(model, feeds)
    for backend in backends:
        m = keel.load_model(model.SerializeToString(), backend=backend)
        _same(list(m.predict(feeds).values()), want)


# ---- the models -------------------------------------------------------------------
def if_model() -> Any:
    """y = x * scale when sum(x) > 0 (scale read from the outer graph), else -x + bias."""
    then = h.make_graph([h.make_node("Mul", ["x", "scale"], ["t"])], "then", [],
                        [h.make_tensor_value_info("t", F, [None, 3])])
    other = h.make_graph([h.make_node("Neg", ["x"], ["n"]),
                          h.make_node("Add", ["n", "bias"], ["e"])], "else", [],
                         [h.make_tensor_value_info("e", F, [None, 3])],
                         [_const("bias", [1.0, 2.0, 3.0])])
    nodes = [h.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             h.make_node("Greater", ["s", "zero"], ["c"]),
             h.make_node("Exp", ["w"], ["scale"]),
             h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    return _model(nodes, [h.make_tensor_value_info("x", F, ["n", 3])],
                  [h.make_tensor_value_info("y", F, ["n", 3])],
                  [_const("zero", 0.0), _const("w", [0.5, -1.0, 2.0])])


def loop_model() -> Any:
    """acc += x * i for i < M while sum(acc) < limit; the scan output stacks each acc."""
    body = h.make_graph(
        [h.make_node("Cast", ["i"], ["fi"], to=F),
         h.make_node("Mul", ["x", "fi"], ["xi"]),
         h.make_node("Add", ["acc", "xi"], ["acc_out"]),
         h.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
         h.make_node("Less", ["total", "limit"], ["go"]),
         h.make_node("Identity", ["acc_out"], ["scanned"])],
        "body",
        [h.make_tensor_value_info("i", I64, []), h.make_tensor_value_info("cond", B, []),
         h.make_tensor_value_info("acc", F, [2])],
        [h.make_tensor_value_info("go", B, []), h.make_tensor_value_info("acc_out", F, [2]),
         h.make_tensor_value_info("scanned", F, [2])])
    nodes = [h.make_node("Loop", ["M", "", "acc0"], ["acc_final", "history"], body=body)]
    return _model(nodes, [h.make_tensor_value_info("M", I64, []),
                          h.make_tensor_value_info("acc0", F, [2]),
                          h.make_tensor_value_info("x", F, [2])],
                  [h.make_tensor_value_info("acc_final", F, [2]),
                   h.make_tensor_value_info("history", F, [None, 2])],
                  [_const("limit", 30.0)])


def scan_model(opset: int = 17) -> Any:
    """A cumulative sum over the rows of x (axis 0) and over its columns in reverse."""
    body = h.make_graph(
        [h.make_node("Add", ["s", "row"], ["s_out"]),
         h.make_node("Identity", ["s_out"], ["y"])], "body",
        [h.make_tensor_value_info("s", F, [None]), h.make_tensor_value_info("row", F, [None])],
        [h.make_tensor_value_info("s_out", F, [None]), h.make_tensor_value_info("y", F, [None])])
    nodes = [h.make_node("Scan", ["s0", "x"], ["total", "cumsum"], body=body,
                         num_scan_inputs=1),
             h.make_node("Scan", ["c0", "x"], ["ctotal", "ccumsum"], body=body,
                         num_scan_inputs=1, scan_input_axes=[1], scan_input_directions=[1],
                         scan_output_axes=[1])]
    return _model(nodes, [h.make_tensor_value_info("x", F, [5, 4]),
                          h.make_tensor_value_info("s0", F, [4]),
                          h.make_tensor_value_info("c0", F, [5])],
                  [h.make_tensor_value_info("total", F, [4]),
                   h.make_tensor_value_info("cumsum", F, [5, 4]),
                   h.make_tensor_value_info("ctotal", F, [5]),
                   h.make_tensor_value_info("ccumsum", F, [5, 4])], opset=opset)


def detection_model() -> Any:
    """Detection post-processing: per class (a Loop), the class's scores go through
    TopK and NonMaxSuppression; kept boxes (class, score, box) are appended to a
    loop-carried table that grows; an If returns the table when any score passes the
    threshold, else one empty row per class."""
    body = h.make_graph(
        [h.make_node("Gather", ["scores", "c"], ["cls"], axis=1),                # [1, N]
         h.make_node("Squeeze", ["cls", "zero_axis"], ["cls1"]),                 # [N]
         h.make_node("TopK", ["cls1", "k"], ["top", "top_idx"]),
         h.make_node("Gather", ["boxes0", "top_idx"], ["top_boxes"], axis=0),    # [K, 4]
         h.make_node("Unsqueeze", ["top_boxes", "zero_axis"], ["tb"]),           # [1, K, 4]
         h.make_node("Unsqueeze", ["top", "zero_axis"], ["ts1"]),
         h.make_node("Unsqueeze", ["ts1", "zero_axis"], ["ts"]),                 # [1, 1, K]
         h.make_node("NonMaxSuppression", ["tb", "ts", "max_out", "iou", "thr"], ["sel"]),
         h.make_node("Gather", ["sel", "two"], ["keep"], axis=1),                # [S]
         h.make_node("Gather", ["top_boxes", "keep"], ["kb"], axis=0),           # [S, 4]
         h.make_node("Gather", ["top", "keep"], ["ks"], axis=0),                 # [S]
         h.make_node("Unsqueeze", ["ks", "one_axis"], ["ks2"]),                  # [S, 1]
         h.make_node("Cast", ["c"], ["cf"], to=F),
         h.make_node("Shape", ["ks2"], ["ks_shape"]),
         h.make_node("Expand", ["cf", "ks_shape"], ["cc"]),
         h.make_node("Concat", ["cc", "ks2", "kb"], ["rows"], axis=1),           # [S, 6]
         h.make_node("Concat", ["table", "rows"], ["table_out"], axis=0),
         h.make_node("Identity", ["cond"], ["go"])],
        "per_class",
        [h.make_tensor_value_info("c", I64, []), h.make_tensor_value_info("cond", B, []),
         h.make_tensor_value_info("table", F, [None, 6])],
        [h.make_tensor_value_info("go", B, []),
         h.make_tensor_value_info("table_out", F, [None, 6])])
    then = h.make_graph([h.make_node("Identity", ["table_final"], ["out_t"])], "then", [],
                        [h.make_tensor_value_info("out_t", F, [None, 6])])
    other = h.make_graph([h.make_node("ConstantOfShape", ["empty_shape"], ["out_e"])], "else",
                         [], [h.make_tensor_value_info("out_e", F, [None, 6])])
    nodes = [
        h.make_node("Shape", ["scores"], ["sshape"]),
        h.make_node("Gather", ["sshape", "one"], ["n_classes"], axis=0),
        h.make_node("Squeeze", ["boxes", "zero_axis"], ["boxes0"]),
        h.make_node("Loop", ["n_classes", "", "table0"], ["table_final"], body=body),
        h.make_node("ReduceMax", ["scores"], ["best"], keepdims=0),
        h.make_node("Greater", ["best", "thr"], ["any"]),
        h.make_node("If", ["any"], ["detections"], then_branch=then, else_branch=other),
    ]
    inits = [_const("zero_axis", [0], np.int64), _const("one_axis", [1], np.int64),
             _const("one", 1, np.int64), _const("two", 2, np.int64),
             _const("k", [4], np.int64), _const("max_out", [3], np.int64),
             _const("iou", [0.5]), _const("thr", 0.3),
             _const("table0", np.zeros((0, 6))), _const("empty_shape", [0, 6], np.int64)]
    return _model(nodes, [h.make_tensor_value_info("boxes", F, [1, 8, 4]),
                          h.make_tensor_value_info("scores", F, [1, 3, 8])],
                  [h.make_tensor_value_info("detections", F, [None, 6])], inits)


def sequence_model() -> Any:
    """Split x into rows (a sequence), square each (SequenceMap), insert the input
    sequence's first tensor at the front, concatenate, and give the sequence too."""
    square = h.make_graph([h.make_node("Mul", ["e", "e"], ["sq"])], "square",
                          [h.make_tensor_value_info("e", F, [None])],
                          [h.make_tensor_value_info("sq", F, [None])])
    nodes = [h.make_node("SplitToSequence", ["x"], ["rows"], axis=0, keepdims=0),
             h.make_node("SequenceMap", ["rows"], ["squares"], body=square),
             h.make_node("SequenceAt", ["extra", "zero"], ["first"]),
             h.make_node("SequenceInsert", ["squares", "first", "zero"], ["all"]),
             h.make_node("ConcatFromSequence", ["all"], ["flat"], axis=0),
             h.make_node("SequenceLength", ["all"], ["count"])]
    return _model(nodes, [h.make_tensor_value_info("x", F, [3, 4]),
                          h.make_tensor_sequence_value_info("extra", F, [None])],
                  [h.make_tensor_value_info("flat", F, [None]),
                   h.make_tensor_value_info("count", I64, []),
                   h.make_tensor_sequence_value_info("all", F, [None])],
                  [_const("zero", 0, np.int64)])


# ---- against onnxruntime ----------------------------------------------------------
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_on_a_data_dependent_condition_matches_onnxruntime(sign: float) -> None:
    x = (sign * np.abs(np.random.default_rng(0).standard_normal((4, 3)))).astype(np.float32)
    _check(if_model(), {"x": x})


@pytest.mark.parametrize("trips", [0, 3, 50])
def test_loop_accumulating_matches_onnxruntime(trips: int) -> None:
    feeds = {"M": np.array(trips, np.int64), "acc0": np.array([0.5, -1.0], np.float32),
             "x": np.array([1.0, 2.0], np.float32)}
    _check(loop_model(), feeds)


@pytest.mark.parametrize("opset", [9, 17])
def test_scan_cumulative_sum_matches_onnxruntime(opset: int) -> None:
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((5, 4)).astype(np.float32),
             "s0": np.zeros(4, np.float32), "c0": np.ones(5, np.float32)}
    _check(scan_model(opset), feeds)


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_detection_post_processing_matches_onnxruntime(scale: float) -> None:
    rng = np.random.default_rng(2)
    corners = rng.uniform(0, 10, (1, 8, 2)).astype(np.float32)
    boxes = np.concatenate([corners, corners + rng.uniform(1, 4, (1, 8, 2))], axis=2)
    scores = (rng.uniform(0, 1, (1, 3, 8)) * scale).astype(np.float32)
    _check(detection_model(), {"boxes": boxes.astype(np.float32), "scores": scores})


def test_sequences_go_in_and_out_as_lists() -> None:
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32),
             "extra": [rng.standard_normal(2).astype(np.float32),
                       rng.standard_normal(5).astype(np.float32)]}
    _check(sequence_model(), feeds)
    model = keel.load_model(sequence_model().SerializeToString())
    out = model.predict(feeds)
    assert isinstance(out["all"], list) and int(out["count"]) == 4
    assert [i.kind.value for i in model.inputs] == ["tensor", "sequence"]
    assert model.outputs[2].to_dict()["kind"] == "sequence"


# ---- the pieces -------------------------------------------------------------------
def test_subgraph_outer_reads_become_captures() -> None:
    g = import_onnx(if_model())
    node = next(n for n in g.nodes if n.op.value == "if")
    assert captures(node) == ("x", "scale")
    assert node.inputs[-2:] == ["x", "scale"]
    assert [path for path, _ in walk(g)] == ["If_3/then_branch", "If_3/else_branch"]


def test_passes_keep_what_subgraphs_read() -> None:
    """Exp(w) is folded into a constant and the If reads that constant; nothing only
    a branch reads is removed as dead."""
    g = optimize(import_onnx(if_model()))
    node = next(n for n in g.nodes if n.op.value == "if")
    scale = node.inputs[-1]
    assert g.is_constant(scale)
    np.testing.assert_allclose(g.initializers[scale], np.exp([0.5, -1.0, 2.0]), rtol=1e-6)
    g.verify()


def test_loop_body_is_compiled_once_for_many_iterations() -> None:
    graph = import_onnx(loop_model())
    feeds = {"M": np.array(50, np.int64), "acc0": np.zeros(2, np.float32),
             "x": np.array([0.1, 0.2], np.float32)}
    runner = ProgramEvaluator(backend="cpu")(graph)
    program = runner.program(feeds)
    assert set(program.bodies) == {"Loop_0/body"}
    body = program.bodies["Loop_0/body"]
    assert body.compiles == 1                 # compiled with the program, before running
    out = runner(feeds)
    assert out["history"].shape[0] > 10       # many iterations ran ...
    assert body.compiles == 1                 # ... on that one program


def test_a_loop_whose_carried_value_grows_compiles_a_bounded_number_of_bodies() -> None:
    from keel.execution.control import KEPT_SIGNATURES

    model = detection_model()
    graph = import_onnx(model)
    rng = np.random.default_rng(4)
    corners = rng.uniform(0, 10, (1, 8, 2)).astype(np.float32)
    feeds = {"boxes": np.concatenate([corners, corners + 2], axis=2),
             "scores": rng.uniform(0.4, 1, (1, 3, 8)).astype(np.float32)}
    runner = ProgramEvaluator(backend="cpu")(graph)
    runner(feeds)
    body = runner.program(feeds).bodies["Loop_3/body"]
    assert 1 <= body.compiles <= KEPT_SIGNATURES + 1


def test_explain_shows_the_subgraph_plans_indented() -> None:
    text = keel.load_model(if_model().SerializeToString(), backend="cpu").explain()
    assert "subgraph If_3/then_branch:" in text and "subgraph If_3/else_branch:" in text
    lines = text.splitlines()
    start = lines.index("subgraph If_3/else_branch:")
    assert any(line.startswith("    Neg_0") and "neg" in line for line in lines[start:])
    assert "subgraphs: 2 planned" in text


def test_onnx_export_round_trip_runs_on_onnxruntime() -> None:
    rng = np.random.default_rng(5)
    cases = [(if_model(), {"x": rng.standard_normal((2, 3)).astype(np.float32)}),
             (loop_model(), {"M": np.array(4, np.int64), "acc0": np.zeros(2, np.float32),
                             "x": np.ones(2, np.float32)}),
             (scan_model(), {"x": rng.standard_normal((5, 4)).astype(np.float32),
                             "s0": np.zeros(4, np.float32), "c0": np.zeros(5, np.float32)})]
    for model, feeds in cases:
        exported = to_onnx(optimize(import_onnx(model)))
        onnx.checker.check_model(exported, full_check=True)
        _same(_ort(exported, feeds), _ort(model, feeds))


def test_keel_file_round_trip_keeps_subgraphs(tmp_path: Any) -> None:
    path = tmp_path / "detect.keel"
    save_keel(import_onnx(detection_model()), path)
    graph = load_keel(path)
    assert [p for p, _ in walk(graph)] == ["Loop_3/body", "If_6/then_branch",
                                           "If_6/else_branch"]
    rng = np.random.default_rng(6)
    corners = rng.uniform(0, 10, (1, 8, 2)).astype(np.float32)
    feeds = {"boxes": np.concatenate([corners, corners + 3], axis=2),
             "scores": rng.uniform(0, 1, (1, 3, 8)).astype(np.float32)}
    got = keel.load_model(str(path)).predict(feeds)
    _same([got["detections"]], _ort(detection_model(), feeds))


def test_empty_optional_and_bad_sequence_feeds_are_clear_errors() -> None:
    nodes = [h.make_node("Optional", [], ["o"], type=h.make_tensor_type_proto(F, [2])),
             h.make_node("OptionalGetElement", ["o"], ["y"])]
    model = _model(nodes, [], [h.make_tensor_value_info("y", F, [2])], opset=18)
    with pytest.raises(ExecutionError, match="empty optional"):
        keel.load_model(model.SerializeToString()).predict({})
    seq = keel.load_model(sequence_model().SerializeToString())
    with pytest.raises(InvalidArgumentError, match="give a list of arrays"):
        seq.predict({"x": np.zeros((3, 4), np.float32), "extra": np.zeros(2, np.float32)})


def test_a_loop_carried_value_that_grows_is_not_specialised_to_its_first_shape() -> None:
    """Each iteration appends the carried vector's current length to it: Shape inside
    the body must be read per iteration, never folded from the first one."""
    body = h.make_graph(
        [h.make_node("Shape", ["acc"], ["n"]),
         h.make_node("Cast", ["n"], ["nf"], to=F),
         h.make_node("Concat", ["acc", "nf"], ["acc_out"], axis=0),
         h.make_node("Identity", ["cond"], ["go"])], "grow",
        [h.make_tensor_value_info("i", I64, []), h.make_tensor_value_info("cond", B, []),
         h.make_tensor_value_info("acc", F, None)],
        [h.make_tensor_value_info("go", B, []), h.make_tensor_value_info("acc_out", F, None)])
    model = _model([h.make_node("Loop", ["M", "", "acc0"], ["acc"], body=body)],
                   [h.make_tensor_value_info("M", I64, []),
                    h.make_tensor_value_info("acc0", F, [2])],
                   [h.make_tensor_value_info("acc", F, [None])])
    _check(model, {"M": np.array(5, np.int64), "acc0": np.array([7.0, 8.0], np.float32)})


def test_optimization_reaches_into_subgraphs() -> None:
    """A branch's constant subexpression is folded and its MatMul + Add fused, and the
    optimized model still matches onnxruntime."""
    then = h.make_graph([h.make_node("Exp", ["c"], ["ec"]),
                         h.make_node("MatMul", ["x", "w"], ["xw"]),
                         h.make_node("Add", ["xw", "ec"], ["t"])], "then", [],
                        [h.make_tensor_value_info("t", F, [None, 3])],
                        [_const("c", [0.1, 0.2, 0.3]),
                         _const("w", np.arange(9).reshape(3, 3) / 9.0)])
    other = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [],
                         [h.make_tensor_value_info("e", F, [None, 3])])
    model = _model([h.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
                    h.make_node("Greater", ["s", "zero"], ["c0"]),
                    h.make_node("If", ["c0"], ["y"], then_branch=then, else_branch=other)],
                   [h.make_tensor_value_info("x", F, [2, 3])],
                   [h.make_tensor_value_info("y", F, [2, 3])], [_const("zero", 0.0)])
    g = optimize(import_onnx(model))
    branch = next(b for p, b in walk(g) if p.endswith("then_branch"))
    assert [n.op.value for n in branch.nodes] == ["gemm"]
    _check(model, {"x": np.ones((2, 3), np.float32)})


def test_keel_onnxruntime_describes_and_runs_sequences_as_onnxruntime_does() -> None:
    import keel.onnxruntime as kort

    feeds = {"x": np.ones((3, 4), np.float32), "extra": [np.full(2, 5.0, np.float32)]}
    described = []
    for module in (ort, kort):
        sess = module.InferenceSession(sequence_model().SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        described.append([(a.name, a.type, a.shape)
                          for a in (*sess.get_inputs(), *sess.get_outputs())])
        _same(sess.run(None, feeds), _ort(sequence_model(), feeds))
    assert described[0] == described[1]


def test_scan_8_runs_each_batch_element_and_matches_onnxruntime() -> None:
    """Scan-8: a batch (axis 0) of running sums over axis 1, the second input reversed."""
    body = h.make_graph(
        [h.make_node("Add", ["s", "a"], ["s1"]), h.make_node("Add", ["s1", "b"], ["s_out"]),
         h.make_node("Identity", ["s_out"], ["y"])], "body",
        [h.make_tensor_value_info("s", F, [2]), h.make_tensor_value_info("a", F, [2]),
         h.make_tensor_value_info("b", F, [2])],
        [h.make_tensor_value_info("s_out", F, [2]), h.make_tensor_value_info("y", F, [2])])
    model = _model([h.make_node("Scan", ["", "s0", "xa", "xb"], ["total", "ys"], body=body,
                                num_scan_inputs=2, directions=[0, 1])],
                   [h.make_tensor_value_info("s0", F, [3, 2]),
                    h.make_tensor_value_info("xa", F, [3, 4, 2]),
                    h.make_tensor_value_info("xb", F, [3, 4, 2])],
                   [h.make_tensor_value_info("total", F, [3, 2]),
                    h.make_tensor_value_info("ys", F, [3, 4, 2])], opset=8)
    rng = np.random.default_rng(7)
    _check(model, {"s0": np.zeros((3, 2), np.float32),
                   "xa": rng.standard_normal((3, 4, 2)).astype(np.float32),
                   "xb": np.arange(24, dtype=np.float32).reshape(3, 4, 2)})


def test_a_memory_limit_holds_inside_a_loop_body() -> None:
    """A body's run-time-sized output counts against the model's memory limit, as the
    graph's own do: ConstantOfShape of a fed size inside a Loop raises MemoryLimitError."""
    from keel.errors import MemoryLimitError

    body = h.make_graph(
        [h.make_node("ConstantOfShape", ["n"], ["big"],
                     value=h.make_tensor("v", T.FLOAT, [1], [1.0])),
         h.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
         h.make_node("Add", ["acc", "s"], ["acc_out"]),
         h.make_node("Identity", ["cond"], ["cond_out"])], "body",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("cond", T.BOOL, []),
         h.make_tensor_value_info("acc", T.FLOAT, [])],
        [h.make_tensor_value_info("cond_out", T.BOOL, []),
         h.make_tensor_value_info("acc_out", T.FLOAT, [])])
    graph = h.make_graph(
        [h.make_node("Loop", ["trips", "", "acc0"], ["total"], body=body)], "sized_loop",
        [h.make_tensor_value_info("n", T.INT64, [1]),
         h.make_tensor_value_info("trips", T.INT64, []),
         h.make_tensor_value_info("acc0", T.FLOAT, [])],
        [h.make_tensor_value_info("total", T.FLOAT, [])])
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    feeds = {"n": np.array([1000], np.int64), "trips": np.array(2, np.int64),
             "acc0": np.array(0.0, np.float32)}
    model = keel.load_model(proto.SerializeToString(), backend="cpu", memory_limit="100MB")
    np.testing.assert_allclose(model.predict(feeds)["total"], _ort(proto, feeds)[0])
    with pytest.raises(MemoryLimitError, match=r"ConstantOfShape|constant_of_shape"):
        model.predict({**feeds, "n": np.array([500_000_000], np.int64)})
