"""The ONNX importer: sources, version rule, op conversions, and every typed error."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, ModelFormatError, UnsupportedOperationError
from keel.graph.importers.onnx import import_onnx, supported_op_types
from keel.graph.importers.onnx_context import ConverterTable
from keel.graph.importers.onnx_ops import TABLE
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from tests.graph.interp import run_graph
from tests.graph.models import init, mlp, model, rel_l2, rng, run_ort, vi

F = TensorProto.FLOAT


def untyped(name: str) -> onnx.ValueInfoProto:
    v = onnx.ValueInfoProto()
    v.name = name
    return v


def single(op_type: str, feeds: dict[str, np.ndarray], attrs: dict[str, Any] | None = None,
           opset: int = 17, inits: dict[str, np.ndarray] | None = None,
           inputs: list[str] | None = None, n_out: int = 1) -> onnx.ModelProto:
    """One node reading graph inputs ``feeds`` and initializers ``inits`` (in ``inputs`` order)."""
    inits = inits or {}
    names = inputs if inputs is not None else [*feeds, *inits]
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op_type, names, outs, **(attrs or {}))
    graph_inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                  list(v.shape)) for k, v in feeds.items()]
    return model([node], graph_inputs, [untyped(o) for o in outs],
                 [init(k, v) for k, v in inits.items()], opset=opset)


def check_against_ort(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    want = run_ort(m, feeds)
    got = run_graph(import_onnx(m), feeds)
    for out, expected in zip(m.graph.output, want, strict=True):
        value = got[out.name]
        assert value.shape == expected.shape, out.name
        assert value.dtype == expected.dtype, out.name
        if expected.dtype.kind == "f":
            assert rel_l2(value, expected) < 1e-5, out.name
        else:
            np.testing.assert_array_equal(value, expected)


R = rng(7)
X = R.standard_normal((2, 3, 4)).astype(np.float32)
IMG = R.standard_normal((1, 2, 4, 4)).astype(np.float32)
I64 = np.int64

# id, op_type, feeds, attrs, opset, initializers, explicit input order, outputs
VERSION_CASES: list[tuple[str, str, dict[str, Any], dict[str, Any], int, dict[str, Any],
                          list[str] | None, int]] = [
    ("squeeze-attr-11", "Squeeze", {"x": X[:, :1]}, {"axes": [1]}, 11, {}, None, 1),
    ("squeeze-input-13", "Squeeze", {"x": X[:, :1]}, {}, 13, {"a": np.array([1], I64)},
     None, 1),
    ("unsqueeze-attr-11", "Unsqueeze", {"x": X}, {"axes": [0, 3]}, 11, {}, None, 1),
    ("unsqueeze-input-13", "Unsqueeze", {"x": X}, {}, 13, {"a": np.array([0, 3], I64)},
     None, 1),
    ("reducemean-attr-17", "ReduceMean", {"x": X}, {"axes": [-1], "keepdims": 0}, 17, {},
     None, 1),
    ("reducemean-input-18", "ReduceMean", {"x": X}, {"keepdims": 1}, 18,
     {"a": np.array([1], I64)}, None, 1),
    ("reducesum-attr-11", "ReduceSum", {"x": X}, {"axes": [0, 2]}, 11, {}, None, 1),
    ("reducesum-all-13", "ReduceSum", {"x": X}, {"keepdims": 0}, 13, {}, None, 1),
    ("reducemax-attr-13", "ReduceMax", {"x": X}, {"axes": [1]}, 13, {}, None, 1),
    ("reducel2-attr-13", "ReduceL2", {"x": X}, {"axes": [2], "keepdims": 0}, 13, {}, None, 1),
    ("split-attr-11", "Split", {"x": X}, {"axis": 2, "split": [1, 3]}, 11, {}, None, 2),
    ("split-equal-11", "Split", {"x": X}, {"axis": 2}, 11, {}, None, 2),
    ("split-input-13", "Split", {"x": X}, {"axis": 2}, 13, {"s": np.array([3, 1], I64)},
     None, 2),
    ("split-num-outputs-18", "Split", {"x": X}, {"axis": 2, "num_outputs": 2}, 18, {}, None, 2),
    ("slice-attr-9", "Slice", {"x": X}, {"starts": [1, 0], "ends": [3, -1], "axes": [1, 2]},
     9, {}, None, 1),
    ("slice-input-10", "Slice", {"x": X}, {}, 10,
     {"s": np.array([1], I64), "e": np.array([100], I64)}, None, 1),
    ("pad-attr-10", "Pad", {"x": X}, {"pads": [0, 1, 0, 0, 1, 2], "value": 1.5}, 10, {},
     None, 1),
    ("pad-input-11", "Pad", {"x": X}, {"mode": "reflect"}, 11,
     {"p": np.array([0, 1, 1, 0, 1, 1], I64)}, None, 1),
    ("topk-attr-9", "TopK", {"x": X}, {"k": 2}, 9, {}, None, 2),
    ("topk-input-11", "TopK", {"x": X}, {"axis": 1, "largest": 0}, 11,
     {"k": np.array([2], I64)}, None, 2),
    ("clip-attr-10", "Clip", {"x": X}, {"min": -0.5, "max": 0.5}, 10, {}, None, 1),
    ("clip-min-only-10", "Clip", {"x": X}, {"min": 0.0}, 10, {}, None, 1),
    ("clip-input-13", "Clip", {"x": X}, {}, 13, {"lo": np.float32(-0.2), "hi": np.float32(0.3)},
     None, 1),
    ("upsample-7", "Upsample", {"x": IMG}, {"scales": [1.0, 1.0, 2.0, 2.0]}, 7, {}, None, 1),
    ("upsample-9-linear", "Upsample", {"x": IMG}, {"mode": "linear"}, 9,
     {"s": np.array([1, 1, 2, 2], np.float32)}, None, 1),
    ("resize-10", "Resize", {"x": IMG}, {"mode": "nearest"}, 10,
     {"s": np.array([1, 1, 2, 3], np.float32)}, None, 1),
    ("resize-11-sizes", "Resize", {"x": IMG}, {"mode": "linear"}, 11,
     {"roi": np.zeros(0, np.float32), "sc": np.zeros(0, np.float32),
      "sz": np.array([1, 2, 6, 5], I64)}, None, 1),
    ("resize-13-scales", "Resize", {"x": IMG}, {"mode": "nearest"}, 13,
     {"sc": np.array([1, 1, 2, 2], np.float32)}, ["x", "", "sc"], 1),
    ("softmax-11-axis1-3d", "Softmax", {"x": X}, {"axis": 1}, 11, {}, None, 1),
    ("softmax-11-default", "Softmax", {"x": X}, {}, 11, {}, None, 1),
    ("softmax-11-last", "Softmax", {"x": X}, {"axis": 2}, 11, {}, None, 1),
    ("logsoftmax-11-axis1", "LogSoftmax", {"x": X}, {"axis": 1}, 11, {}, None, 1),
    ("hardmax-11-axis0", "Hardmax", {"x": X}, {"axis": 0}, 11, {}, None, 1),
    ("softmax-13-axis1", "Softmax", {"x": X}, {"axis": 1}, 13, {}, None, 1),
    ("dropout-7", "Dropout", {"x": X}, {"ratio": 0.3}, 7, {}, None, 1),
    ("dropout-10", "Dropout", {"x": X}, {}, 10, {}, None, 1),
    ("dropout-12-inference", "Dropout", {"x": X}, {}, 12,
     {"r": np.float32(0.5), "t": np.array(False)}, None, 2),
    ("bn-7-spatial0", "BatchNormalization", {"x": IMG}, {"spatial": 0}, 7,
     {"s": R.uniform(0.5, 1, (2, 4, 4)).astype(np.float32),
      "b": R.standard_normal((2, 4, 4)).astype(np.float32),
      "m": R.standard_normal((2, 4, 4)).astype(np.float32),
      "v": R.uniform(0.5, 1, (2, 4, 4)).astype(np.float32)}, None, 1),
    ("bn-9", "BatchNormalization", {"x": IMG}, {"epsilon": 1e-3}, 9,
     {"s": np.ones(2, np.float32), "b": np.zeros(2, np.float32),
      "m": np.array([0.1, -0.2], np.float32), "v": np.array([1.5, 0.5], np.float32)}, None, 1),
    ("groupnorm-18", "GroupNormalization", {"x": R.standard_normal((2, 4, 3)).astype(np.float32)},
     {"num_groups": 2}, 18, {"s": np.array([1.0, 2.0], np.float32),
                             "b": np.array([0.5, -0.5], np.float32)}, None, 1),
    ("cast-13", "Cast", {"x": X}, {"to": TensorProto.INT32}, 13, {}, None, 1),
    ("castlike-15", "CastLike", {"x": X}, {}, 15, {"like": np.zeros(1, np.float64)}, None, 1),
    ("sum-3", "Sum", {"a": X, "b": X[:1], "c": X[:, :, :1]}, {}, 13, {}, None, 1),
    ("mean-3", "Mean", {"a": X, "b": X[:1], "c": X}, {}, 13, {}, None, 1),
    ("max-3", "Max", {"a": X, "b": X * 2, "c": -X}, {}, 13, {}, None, 1),
    ("min-1", "Min", {"a": X}, {}, 13, {}, None, 1),
    ("gemm-7-trans", "Gemm", {"a": X[0].T.copy()}, {"transA": 1, "alpha": 0.5, "beta": 2.0},
     7, {"b": R.standard_normal((4, 5)).astype(np.float32),
         "c": R.standard_normal(5).astype(np.float32)}, None, 1),
    ("concat-11", "Concat", {"a": X, "b": X}, {"axis": -1}, 11, {}, None, 1),
    ("shape-15-slice", "Shape", {"x": X}, {"start": 1, "end": -1}, 15, {}, None, 1),
    ("scatter-9", "Scatter", {"x": np.zeros((3, 3), np.float32)}, {"axis": 1}, 9,
     {"i": np.array([[1, 0]], I64), "u": np.ones((1, 2), np.float32)}, None, 1),
    ("argmax-12-last", "ArgMax", {"x": np.array([[1, 3, 3]], np.float32)},
     {"select_last_index": 1}, 12, {}, None, 1),
    ("constantofshape-9", "ConstantOfShape", {}, {"value": numpy_helper.from_array(
        np.array([2.5], np.float32))}, 9, {"s": np.array([2, 3], I64)}, None, 1),
    ("leakyrelu-6", "LeakyRelu", {"x": X}, {"alpha": 0.2}, 7, {}, None, 1),
    ("eyelike-dtype", "EyeLike", {"x": np.zeros((3, 4), np.float32)},
     {"dtype": TensorProto.INT32, "k": 1}, 11, {}, None, 1),
    ("globallppool-2", "GlobalLpPool", {"x": IMG}, {}, 13, {}, None, 1),
    ("globallppool-3", "GlobalLpPool", {"x": IMG}, {"p": 3}, 13, {}, None, 1),
    ("globallppool-1", "GlobalLpPool", {"x": IMG}, {"p": 1}, 13, {}, None, 1),
    ("maxpool-indices", "MaxPool", {"x": IMG}, {"kernel_shape": [2, 2]}, 12, {}, None, 2),
]


@pytest.mark.parametrize("case", VERSION_CASES, ids=[c[0] for c in VERSION_CASES])
def test_conversion_matches_onnxruntime(case: tuple[Any, ...]) -> None:
    _, op_type, feeds, attrs, opset, inits, inputs, n_out = case
    check_against_ort(single(op_type, feeds, attrs, opset, inits, inputs, n_out), feeds)


@pytest.mark.parametrize("opset, dtype", [(7, np.float32), (10, np.bool_), (12, np.bool_)])
def test_inference_dropout_mask_is_all_kept(opset: int, dtype: type) -> None:
    # The ONNX reference keeps every element at inference (mask of ones); onnxruntime
    # writes zeros for opsets 7-11, which contradicts the output it returns unchanged.
    g = import_onnx(single("Dropout", {"x": X}, {}, opset, {}, None, 2))
    out = run_graph(g, {"x": X})
    np.testing.assert_array_equal(out["y0"], X)
    assert out["y1"].dtype == dtype and out["y1"].shape == X.shape and out["y1"].all()


def test_constant_node_variants_become_initializers() -> None:
    nodes = [helper.make_node("Constant", [], ["c1"], value_float=2.0),
             helper.make_node("Constant", [], ["c2"], value_ints=[1, 2, 3]),
             helper.make_node("Constant", [], ["c3"], value=numpy_helper.from_array(
                 np.eye(3, dtype=np.float32))),
             helper.make_node("Mul", ["x", "c1"], ["m"]),
             helper.make_node("Add", ["m", "c3"], ["y"])]
    m = model(nodes, [vi("x", [3, 3])], [vi("y", [3, 3]), untyped("c2")])
    g = import_onnx(m)
    assert [n.op for n in g.nodes] == [Op.MUL, Op.ADD]
    assert g.initializers["c2"].dtype == np.int64 and list(g.initializers["c2"]) == [1, 2, 3]
    assert "c1" not in g.input_names
    x = R.standard_normal((3, 3)).astype(np.float32)
    np.testing.assert_allclose(run_graph(g, {"x": x})["y"], x * 2 + np.eye(3), rtol=1e-6)


def test_newest_converter_not_newer_than_the_opset_is_chosen() -> None:
    table = ConverterTable()
    calls: list[int] = []

    def record(version: int) -> Any:
        return lambda ctx, n: calls.append(version)

    for v in (1, 11, 13):
        table.register("Op", v, record(v))
    for opset, want in ((7, 1), (11, 11), (12, 11), (13, 13), (21, 13)):
        fn = table.lookup("Op", opset)
        assert fn is not None
        fn(None, None)  # type: ignore[arg-type]
        assert calls[-1] == want
    assert table.lookup("Op", 0) is None and table.versions("Op") == [1, 11, 13]
    with pytest.raises(ValueError, match="registered twice"):
        table.register("Op", 11, lambda ctx, n: None)


def test_old_and_new_versions_give_the_same_keel_form() -> None:
    old = import_onnx(single("Squeeze", {"x": X[:, :1]}, {"axes": [1]}, 11))
    new = import_onnx(single("Squeeze", {"x": X[:, :1]}, {}, 13, {"a": np.array([1], I64)}))
    for g in (old, new):
        (node,) = g.nodes
        assert node.op is Op.SQUEEZE and len(node.inputs) == 2
        assert list(g.initializers[node.inputs[1]]) == [1]


def test_sources_path_bytes_and_proto_agree(tmp_path: Path) -> None:
    m = mlp(rng(0))
    path = tmp_path / "mlp.onnx"
    onnx.save(m, str(path))
    graphs = [import_onnx(str(path)), import_onnx(path), import_onnx(path.read_bytes()),
              import_onnx(m)]
    for g in graphs[1:]:
        assert [n.op for n in g.nodes] == [n.op for n in graphs[0].nodes]
        assert g.outputs == graphs[0].outputs
    assert graphs[0].outputs[0].type.shape == ("N", 10)
    with pytest.raises(InvalidArgumentError, match=r"path, bytes or onnx\.ModelProto"):
        import_onnx(12345)


def test_initializer_that_is_an_input_stays_an_optional_input() -> None:
    w = np.ones((3, 3), np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = model(nodes, [vi("x", [2, 3]), vi("w", [3, 3])], [vi("y", [2, 3])], [init("w", w)])
    g = import_onnx(m)
    assert g.input_names == ["x", "w"] and g.optional_input_names == ["w"]
    assert not g.is_constant("w")
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(run_graph(g, {"x": x})["y"], x @ w)
    np.testing.assert_allclose(run_graph(g, {"x": x, "w": 2 * w})["y"], x @ (2 * w))


def test_before_ir_4_initializers_listed_as_inputs_are_constants() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = model(nodes, [vi("x", [2, 3]), vi("w", [3, 3])], [vi("y", [2, 3])],
              [init("w", np.ones((3, 3), np.float32))])
    m.ir_version = 3
    g = import_onnx(m)
    assert g.input_names == ["x"] and g.is_constant("w")


def test_nodes_out_of_order_are_sorted() -> None:
    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Neg", ["x"], ["a"])]
    g = import_onnx(model(nodes, [vi("x", [2])], [vi("y", [2])]))
    assert [n.op for n in g.nodes] == [Op.NEG, Op.RELU]


def test_value_types_come_from_inference_and_value_info() -> None:
    g = import_onnx(mlp(rng(0)))
    assert g.value_types["h1"].shape == ("N", 32)
    assert g.type_of("w1") is not None and g.type_of("w1").shape == (16, 32)  # type: ignore[union-attr]


def test_unnamed_and_duplicate_node_names_are_made_unique() -> None:
    nodes = [helper.make_node("Neg", ["x"], ["a"], name="n"),
             helper.make_node("Neg", ["a"], ["b"], name="n"),
             helper.make_node("Neg", ["b"], ["y"])]
    g = import_onnx(model(nodes, [vi("x", [2])], [vi("y", [2])]))
    names = [n.name for n in g.nodes]
    assert len(set(names)) == 3 and names[0] == "n"


# ---- external data ------------------------------------------------------------------------
def _external_model(tmp_path: Path) -> tuple[Path, np.ndarray]:
    w = rng(3).standard_normal((64, 64)).astype(np.float32)
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [vi("x", [1, 64])],
              [vi("y", [1, 64])], [init("w", w)])
    path = tmp_path / "ext.onnx"
    onnx.save_model(m, str(path), save_as_external_data=True, location="ext.bin",
                    size_threshold=0)
    return path, w


def test_external_data_is_read_relative_to_the_model(tmp_path: Path) -> None:
    path, w = _external_model(tmp_path)
    g = import_onnx(path)
    np.testing.assert_array_equal(g.initializers["w"], w)
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(run_graph(g, {"x": x})["y"], x @ w, rtol=1e-5)
    with pytest.raises(ModelFormatError, match="without a base directory"):
        import_onnx(path.read_bytes())
    g2 = import_onnx(path.read_bytes(), base_dir=tmp_path)
    np.testing.assert_array_equal(g2.initializers["w"], w)


def test_missing_external_file_is_a_format_error(tmp_path: Path) -> None:
    path, _ = _external_model(tmp_path)
    os.remove(tmp_path / "ext.bin")
    with pytest.raises(ModelFormatError, match="missing"):
        import_onnx(path)


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/passwd", "sub/../../x.bin"])
def test_external_data_outside_the_directory_is_refused(tmp_path: Path, location: str) -> None:
    path, _ = _external_model(tmp_path)
    m = onnx.load(str(path), load_external_data=False)
    for entry in m.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    (tmp_path / "outside.bin").write_bytes(b"\0" * 64)
    sub = tmp_path / "inner"
    sub.mkdir()
    bad = sub / "bad.onnx"
    onnx.save_model(m, str(bad))
    with pytest.raises(ModelFormatError, match=r"inside the model's directory|outside"):
        import_onnx(bad)


def test_external_data_shorter_than_declared_is_refused(tmp_path: Path) -> None:
    path, _ = _external_model(tmp_path)
    with open(tmp_path / "ext.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ModelFormatError, match="does not hold"):
        import_onnx(path)


# ---- errors -------------------------------------------------------------------------------
def test_op_keel_lacks_names_node_and_op() -> None:
    node = helper.make_node("Bernoulli", ["x"], ["y"], name="bern")
    m = model([node], [vi("x", [2, 3])], [untyped("y")])
    with pytest.raises(UnsupportedOperationError, match=r"Bernoulli.*bern"):
        import_onnx(m)


def test_custom_domain_op_is_unsupported() -> None:
    node = helper.make_node("FusedGemm", ["x"], ["y"], domain="com.microsoft", name="fg")
    m = model([node], [vi("x", [2])], [vi("y", [2])])
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(UnsupportedOperationError,
                       match=r"node 'fg': keel reads com\.microsoft's quantized ops"):
        import_onnx(m)


def test_non_default_attribute_without_keel_equivalent_is_unsupported() -> None:
    m = single("Range", {"a": np.float32(0), "b": np.float32(5), "c": np.float32(1)},
               {"stash_type": 11}, 28)
    with pytest.raises(UnsupportedOperationError, match="stash_type"):
        import_onnx(m)


@pytest.mark.parametrize("attrs, inits, match", [
    ({}, {"r": np.float32(0.5), "t": np.array(True)}, "training_mode is true"),
])
def test_training_dropout_is_unsupported(attrs: dict[str, Any], inits: dict[str, Any],
                                         match: str) -> None:
    with pytest.raises(UnsupportedOperationError, match=match):
        import_onnx(single("Dropout", {"x": X}, attrs, 13, inits))


def test_training_batch_norm_is_unsupported() -> None:
    p = {k: np.ones(2, np.float32) for k in "sbmv"}
    with pytest.raises(UnsupportedOperationError, match="training_mode"):
        import_onnx(single("BatchNormalization", {"x": IMG}, {"training_mode": 1}, 15, p))


def test_not_an_onnx_op_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="'Relv' is not an ONNX operator"):
        import_onnx(model([helper.make_node("Relv", ["x"], ["y"])], [vi("x", [2])],
                          [vi("y", [2])]))


def test_op_newer_than_the_model_opset_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="Gelu does not exist in opset 13"):
        import_onnx(single("Gelu", {"x": X}, {}, 13))


def test_unknown_attribute_name_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="'alpah' is not an attribute of LeakyRelu"):
        import_onnx(single("LeakyRelu", {"x": X}, {"alpah": 0.1}, 13))


@pytest.mark.parametrize("opset", [5, 99])
def test_opset_out_of_range_is_a_format_error(opset: int) -> None:
    m = mlp(rng(0))
    m.opset_import[0].version = opset
    with pytest.raises(ModelFormatError, match=f"opset {opset}; keel imports opsets 7 to"):
        import_onnx(m)


def test_missing_default_opset_is_a_format_error() -> None:
    m = mlp(rng(0))
    del m.opset_import[:]
    with pytest.raises(ModelFormatError, match="no default-domain"):
        import_onnx(m)


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (b"\xff\xff\xff\xff garbage", "not a valid ONNX protobuf"),
    (mlp(rng(0)).SerializeToString()[:40], "not a valid ONNX protobuf|has no graph"),
    (helper.make_model(helper.make_graph([], "g", [], [])).SerializeToString()[:2],
     "not a valid ONNX protobuf|has no graph"),
])
def test_corrupt_bytes_are_format_errors(data: bytes, match: str) -> None:
    with pytest.raises(ModelFormatError, match=match):
        import_onnx(data)


def test_missing_file_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="cannot read model file"):
        import_onnx(tmp_path / "nope.onnx")


def _with_initializer(t: onnx.TensorProto) -> onnx.ModelProto:
    return model([helper.make_node("Add", ["x", t.name], ["y"])], [vi("x", [2])],
                 [vi("y", [2])], [t])


def test_negative_initializer_dims_are_a_format_error() -> None:
    t = init("w", np.ones(2, np.float32))
    t.dims[0] = -2
    with pytest.raises(ModelFormatError, match="negative dimension"):
        import_onnx(_with_initializer(t))


def test_huge_declared_dims_are_a_format_error_before_allocating() -> None:
    t = init("w", np.ones(2, np.float32))
    t.dims[:] = [2**40, 2**40]
    with pytest.raises(ModelFormatError, match="more elements than keel accepts"):
        import_onnx(_with_initializer(t))


def test_raw_data_size_mismatch_is_a_format_error() -> None:
    t = init("w", np.ones(2, np.float32))
    t.dims[0] = 1000
    with pytest.raises(ModelFormatError, match="holds 8 bytes"):
        import_onnx(_with_initializer(t))


def test_impossible_input_dim_is_a_format_error() -> None:
    m = mlp(rng(0))
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = -5
    with pytest.raises(ModelFormatError, match="impossible dimension -5"):
        import_onnx(m)


def test_duplicate_outputs_are_a_format_error() -> None:
    nodes = [helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["y"])]
    with pytest.raises(ModelFormatError, match="'y' is defined twice"):
        import_onnx(model(nodes, [vi("x", [2])], [vi("y", [2])]))


def test_cycle_is_a_format_error() -> None:
    nodes = [helper.make_node("Neg", ["b"], ["a"], name="n1"),
             helper.make_node("Add", ["a", "x"], ["b"], name="n2"),
             helper.make_node("Relu", ["a"], ["y"])]
    with pytest.raises(ModelFormatError, match="cycle through nodes"):
        import_onnx(model(nodes, [vi("x", [2])], [vi("y", [2])]))


def test_undefined_input_is_a_format_error() -> None:
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")]
    with pytest.raises(ModelFormatError, match=r"adder.*'ghost'"):
        import_onnx(model(nodes, [vi("x", [2])], [vi("y", [2])]))


def test_undefined_graph_output_is_a_format_error() -> None:
    nodes = [helper.make_node("Neg", ["x"], ["a"])]
    with pytest.raises(ModelFormatError, match="graph output 'y' is not defined"):
        import_onnx(model(nodes, [vi("x", [2])], [vi("y", [2])]))


def test_missing_op_type_is_a_format_error() -> None:
    m = model([helper.make_node("Neg", ["x"], ["y"])], [vi("x", [2])], [vi("y", [2])])
    m.graph.node[0].op_type = ""
    with pytest.raises(ModelFormatError, match="has no op_type"):
        import_onnx(m)


def test_wrong_input_count_is_a_format_error() -> None:
    m = model([helper.make_node("Clip", [], ["y"], name="c")], [], [vi("y", [2])], opset=10)
    with pytest.raises(ModelFormatError,
                       match=r"node 'c' \(Clip\): has 0 inputs; Clip-6 takes 1\.\.1"):
        import_onnx(m)


def test_map_input_is_a_format_error() -> None:
    kind = helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(F, [2]))
    m = model([helper.make_node("Identity", ["s"], ["y"])],
              [helper.make_value_info("s", kind)], [untyped("y")])
    with pytest.raises(ModelFormatError, match="tensor, sequence and optional inputs only"):
        import_onnx(m)


def test_sequence_input_has_a_sequence_type() -> None:
    seq = helper.make_tensor_sequence_value_info("s", F, [2])
    m = model([helper.make_node("SequenceLength", ["s"], ["y"])], [seq], [untyped("y")])
    g = import_onnx(m)
    assert str(g.inputs[0].type) == "seq(float32[2])"
    assert str(g.outputs[0].type) == "int64[]"


def test_unsupported_element_type_is_a_format_error_naming_it() -> None:
    m = model([helper.make_node("Identity", ["x"], ["y"])], [vi("x", [2], TensorProto.COMPLEX64)],
              [untyped("y")])
    with pytest.raises(ModelFormatError, match="COMPLEX64"):
        import_onnx(m)


def test_invalid_attribute_value_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="Transpose"):
        import_onnx(single("Transpose", {"x": X}, {"perm": [0, 0, 1]}, 13))


# ---- coverage of the op table ---------------------------------------------------------------
# Ops no ONNX op imports to: the seed ops, and fusions only passes write.
KEEL_ONLY = {Op.SUM_ALL, Op.MEAN_ALL, Op.DOT, Op.CONV2D, Op.INDEX, Op.COPY, Op.FILL,
             Op.SKIP_LAYER_NORM, Op.QLINEAR_ADD}


def test_every_keel_op_that_onnx_has_is_mapped() -> None:
    from keel.graph.importers.onnx_ml import ML_CONVERTED, ML_DIRECT, ML_TABLE

    mapped = set()
    for op_type in TABLE.op_types():
        for ops in _ops_emitted(op_type):
            mapped |= ops
    mapped |= {op for op, _ in ML_DIRECT.values()} | set(ML_CONVERTED.values())
    mapped.add(Op.QGEMM)            # com.microsoft's QGemm (importers/onnx_ms.py)
    mapped.add(Op.QLINEAR_GLOBAL_AVG_POOL)   # com.microsoft's QLinearGlobalAveragePool
    assert set(ML_DIRECT) | set(ML_CONVERTED) <= set(ML_TABLE.op_types())
    assert set(Op) - KEEL_ONLY <= mapped


def _ops_emitted(op_type: str) -> list[set[Op]]:
    from keel.graph.export import ONNX_NAME
    from keel.graph.importers.onnx_ops import DIRECT, REDUCTIONS, SOFTMAXES

    found = []
    if op_type in DIRECT:
        found.append({DIRECT[op_type][0]})
    if op_type in REDUCTIONS:
        found.append({REDUCTIONS[op_type][0]})
    if op_type in SOFTMAXES:
        found.append({SOFTMAXES[op_type]})
    found.append({op for op, name in ONNX_NAME.items() if name == op_type})
    if op_type == "Attention":
        found.append({Op.ATTENTION})
    return found


def test_every_mapped_op_has_a_schema() -> None:
    from keel.graph.importers.onnx_ops import DIRECT, REDUCTIONS

    for op, _ in [*DIRECT.values(), *REDUCTIONS.values()]:
        assert get_schema(op).op is op


def test_supported_op_types_are_real_onnx_ops() -> None:
    import onnx.defs

    names = supported_op_types()
    assert "Conv" in names and "LayerNormalization" in names and len(names) > 140
    assert all(onnx.defs.has(n) for n in names)


def test_dtype_attribute_codes_become_dtypes() -> None:
    g = import_onnx(single("Cast", {"x": X}, {"to": TensorProto.FLOAT16}, 13))
    assert g.nodes[0].attrs["to"] is DType.FLOAT16
