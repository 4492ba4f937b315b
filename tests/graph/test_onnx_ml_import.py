"""The ai.onnx.ml importer: opsets, the old tree layouts, casts, and what it refuses.

Models are built with onnx.helper; onnxruntime is the oracle where it runs them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

import keel
from keel.errors import ModelFormatError, UnsupportedOperationError
from keel.graph.importers.onnx import import_onnx, supported_op_types
from keel.ops.registry import Op

ML = "ai.onnx.ml"


def _model(node: Any, x_type: int, x_shape: list[Any], outputs: list[tuple[str, int, Any]],
           ml_opset: int | None = 3) -> bytes:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("X", x_type, x_shape)],
        [helper.make_tensor_value_info(name, t, shape) for name, t, shape in outputs])
    opsets = [helper.make_opsetid("", 17)]
    if ml_opset is not None:
        opsets.append(helper.make_opsetid(ML, ml_opset))
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


# Two trees over 2 features: tree 0 splits twice, tree 1 is a single leaf.
_TREES: dict[str, Any] = dict(
    nodes_treeids=[0, 0, 0, 0, 0, 1], nodes_nodeids=[0, 1, 2, 3, 4, 0],
    nodes_featureids=[0, 1, 0, 0, 0, 0], nodes_values=[0.5, -0.25, 0.0, 0.0, 0.0, 0.0],
    nodes_modes=["BRANCH_LEQ", "BRANCH_GT", "LEAF", "LEAF", "LEAF", "LEAF"],
    nodes_truenodeids=[1, 3, 0, 0, 0, 0], nodes_falsenodeids=[2, 4, 0, 0, 0, 0],
    nodes_missing_value_tracks_true=[1, 0, 0, 0, 0, 0])


def _regressor(**extra: Any) -> Any:
    targets = dict(target_treeids=[0, 0, 0, 0, 1, 1], target_nodeids=[2, 3, 4, 4, 0, 0],
                   target_ids=[0, 0, 0, 1, 0, 1],
                   target_weights=[1.0, 2.0, 3.0, -1.0, 0.5, 0.25])
    return helper.make_node("TreeEnsembleRegressor", ["X"], ["Y"], domain=ML, n_targets=2,
                            **_TREES, **targets, **extra)


def _run(data: bytes, x: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle here")
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"X": x})
    return keel.load_model(data).run(None, {"X": x}), want


_X = np.array([[0.1, 0.3], [0.9, 0.0], [np.nan, -1.0], [0.5, -0.25], [-2.0, 5.0]], np.float32)


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
def test_regressor_layouts_match_onnxruntime(aggregate: str) -> None:
    data = _model(_regressor(aggregate_function=aggregate, base_values=[0.5, -0.5]),
                  TensorProto.FLOAT, [None, 2], [("Y", TensorProto.FLOAT, [None, 2])], 1)
    got, want = _run(data, _X)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_opset_3_tensors_give_what_the_lists_give() -> None:
    """TreeEnsembleRegressor-3's *_as_tensor attributes hold the same numbers."""
    plain = _model(_regressor(), TensorProto.FLOAT, [None, 2],
                   [("Y", TensorProto.FLOAT, [None, 2])], 1)
    node = _regressor()
    for attr in list(node.attribute):
        if attr.name in ("nodes_values", "target_weights"):
            node.attribute.remove(attr)
            values = np.asarray(helper.get_attribute_value(attr), np.float32)
            node.attribute.append(helper.make_attribute(
                f"{attr.name}_as_tensor", helper.make_tensor("t", TensorProto.FLOAT,
                                                             [len(values)], values)))
    tensors = _model(node, TensorProto.FLOAT, [None, 2], [("Y", TensorProto.FLOAT, [None, 2])])
    want = keel.load_model(plain).run(None, {"X": _X})
    got = keel.load_model(tensors).run(None, {"X": _X})
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize(("x_type", "dtype"), [(TensorProto.DOUBLE, np.float64),
                                               (TensorProto.INT64, np.int64)])
def test_regressor_casts_other_inputs(x_type: int, dtype: Any) -> None:
    """Double X is walked in double, the output cast to float; integer X is cast to float
    first (onnxruntime has no integer kernel: the float model is the oracle there)."""
    data = _model(_regressor(), x_type, [None, 2], [("Y", TensorProto.FLOAT, [None, 2])], 1)
    x = np.array([[0, 1], [1, -1], [-3, 2]], dtype=dtype)
    if dtype == np.int64:
        float_model = _model(_regressor(), TensorProto.FLOAT, [None, 2],
                             [("Y", TensorProto.FLOAT, [None, 2])], 1)
        got = keel.load_model(data).run(None, {"X": x})
        want = keel.load_model(float_model).run(None, {"X": x.astype(np.float32)})
    else:
        got, want = _run(data, x)
    assert got[0].dtype == np.float32
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    ops = [n.op for n in import_onnx(data).nodes]
    assert Op.TREE_ENSEMBLE in ops and Op.CAST in ops


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX"])
def test_binary_classifier_conventions_match_onnxruntime(post: str) -> None:
    """One weight column for two classes: probabilities (all >= 0) or margins."""
    for weights in ([0.1, 0.7, 0.4, 0.2], [-0.3, 0.7, -0.4, 0.2]):
        node = helper.make_node(
            "TreeEnsembleClassifier", ["X"], ["L", "P"], domain=ML, **_TREES,
            class_treeids=[0, 0, 0, 1], class_nodeids=[2, 3, 4, 0], class_ids=[0, 0, 0, 0],
            class_weights=weights, classlabels_int64s=[4, 9], post_transform=post)
        data = _model(node, TensorProto.FLOAT, [None, 2],
                      [("L", TensorProto.INT64, [None]), ("P", TensorProto.FLOAT, [None, 2])],
                      1)
        got, want = _run(data, _X)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX"])
def test_linear_classifier_binary_matches_onnxruntime(post: str) -> None:
    node = helper.make_node("LinearClassifier", ["X"], ["L", "P"], domain=ML,
                            coefficients=[0.5, -1.0], intercepts=[0.1],
                            classlabels_strings=["no", "yes"], post_transform=post)
    data = _model(node, TensorProto.FLOAT, [None, 2],
                  [("L", TensorProto.STRING, [None]), ("P", TensorProto.FLOAT, [None, 2])], 1)
    got, want = _run(data, np.nan_to_num(_X))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX"])
def test_svm_classifier_binary_matches_onnxruntime(post: str) -> None:
    for coefficients in ([0.8, -0.6], [0.8, 0.6]):
        node = helper.make_node(
            "SVMClassifier", ["X"], ["L", "P"], domain=ML, kernel_type="RBF",
            kernel_params=[0.5, 0.0, 3.0], support_vectors=[-0.5, 0.2, 0.8, -0.1],
            vectors_per_class=[1, 1], coefficients=coefficients, rho=[0.1],
            classlabels_ints=[4, 9], post_transform=post)
        data = _model(node, TensorProto.FLOAT, [None, 2],
                      [("L", TensorProto.INT64, [None]), ("P", TensorProto.FLOAT, [None, 2])],
                      1)
        got, want = _run(data, np.nan_to_num(_X))
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("coefficients", [[0.8, -0.6, 0.1, 0.3], [0.8, 0.6, 0.1, 0.3],
                                          [0.8, -0.6, 0.1, 0.3, -1.0, 1.0]])
def test_liblinear_svm_labels_match_onnxruntime(coefficients: list[float]) -> None:
    classes = len(coefficients) // 2
    node = helper.make_node("SVMClassifier", ["X"], ["L", "P"], domain=ML,
                            coefficients=coefficients, rho=[0.1], kernel_type="LINEAR",
                            kernel_params=[0.0, 0.0, 1.0],
                            classlabels_ints=list(range(4, 4 + classes)))
    data = _model(node, TensorProto.FLOAT, [None, 2],
                  [("L", TensorProto.INT64, [None]), ("P", TensorProto.FLOAT, [None, None])], 1)
    x = np.array([[-1.0, 0.5], [1.0, 0.2], [0.3, -2], [2.0, 1], [-3, -3], [-0.5, -0.2],
                  [0.1, 0.1], [0.4, 0.1]], np.float32)
    got, want = _run(data, x)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_a_model_may_import_only_the_ml_domain() -> None:
    node = helper.make_node("Scaler", ["X"], ["Y"], domain=ML, offset=[1.0], scale=[2.0])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", 1, [3])],
                              [helper.make_tensor_value_info("Y", 1, [3])])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid(ML, 1)])
    y = keel.load_model(data.SerializeToString()).run(None, {"X": np.ones(3, np.float32)})
    np.testing.assert_array_equal(y[0], [0.0, 0.0, 0.0])


def test_zipmap_says_how_to_export_without_it() -> None:
    node = helper.make_node("ZipMap", ["X"], ["Z"], domain=ML, classlabels_int64s=[0, 1])
    data = _model(node, TensorProto.FLOAT, [None, 2], [("Z", TensorProto.FLOAT, None)], 1)
    with pytest.raises(UnsupportedOperationError, match=r"sequence of maps.*zipmap"):
        keel.load_model(data)


def test_ml_node_without_the_domain_import_is_a_format_error() -> None:
    node = helper.make_node("Binarizer", ["X"], ["Y"], domain=ML)
    data = _model(node, TensorProto.FLOAT, [2], [("Y", TensorProto.FLOAT, [2])], None)
    with pytest.raises(ModelFormatError, match="does not import"):
        keel.load_model(data)


def test_ml_ops_keel_lacks_are_unsupported() -> None:
    node = helper.make_node("FeatureVectorizer", ["X"], ["Y"], domain=ML, inputdimensions=[2])
    data = _model(node, TensorProto.FLOAT, [None, 2], [("Y", TensorProto.FLOAT, [None, 2])], 1)
    with pytest.raises(UnsupportedOperationError, match=r"no implementation of this ai\.onnx\.ml"):
        keel.load_model(data)
    assert "TreeEnsemble" in supported_op_types(ML)
    assert "TreeEnsemble" not in supported_op_types()


@pytest.mark.parametrize(("edit", "match"), [
    ({"nodes_truenodeids": [1, 7, 0, 0, 0, 0]}, "has no node 7"),
    ({"nodes_truenodeids": [1, 0, 0, 0, 0, 0]}, "cycle"),
    ({"nodes_modes": ["BRANCH_LEQ", "SPLIT", "LEAF", "LEAF", "LEAF", "LEAF"]}, "not one of"),
    ({"nodes_values": [0.5]}, "one entry per node"),
])
def test_broken_forests_are_format_errors(edit: dict[str, Any], match: str) -> None:
    node = _regressor()
    for attr in list(node.attribute):
        if attr.name in edit:
            node.attribute.remove(attr)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in edit.items())
    data = _model(node, TensorProto.FLOAT, [None, 2], [("Y", TensorProto.FLOAT, [None, 2])])
    with pytest.raises(ModelFormatError, match=match):
        keel.load_model(data)


_F = TensorProto.FLOAT
_PREPROCESSING: dict[str, tuple[Any, int, np.ndarray, int, int]] = {
    # name: (node, ml opset, X, X type, Y type)
    "scaler": (helper.make_node("Scaler", ["X"], ["Y"], domain=ML, offset=[0.5, -1.0, 0.0],
                                scale=[2.0, 0.5, -1.0]), 1, _X[:, :1].repeat(3, 1), _F, _F),
    "normalizer-max": (helper.make_node("Normalizer", ["X"], ["Y"], domain=ML, norm="MAX"), 1,
                       np.array([[1, -2, 3], [-1, -2, -4], [0, 0, 0]], np.float32), _F, _F),
    "normalizer-l1": (helper.make_node("Normalizer", ["X"], ["Y"], domain=ML, norm="L1"), 1,
                      np.array([[1, -2, 3], [-1, -2, -4], [0, 0, 0]], np.float32), _F, _F),
    "normalizer-l2": (helper.make_node("Normalizer", ["X"], ["Y"], domain=ML, norm="L2"), 1,
                      np.array([[1, -2, 3], [-1, -2, -4], [0, 0, 0]], np.float32), _F, _F),
    "imputer": (helper.make_node("Imputer", ["X"], ["Y"], domain=ML,
                                 imputed_value_floats=[7.0, 8.0],
                                 replaced_value_float=float("nan")), 1, _X, _F, _F),
    "binarizer": (helper.make_node("Binarizer", ["X"], ["Y"], domain=ML, threshold=0.2), 1,
                  np.nan_to_num(_X), _F, _F),
    "one-hot": (helper.make_node("OneHotEncoder", ["X"], ["Y"], domain=ML,
                                 cats_int64s=[0, 2, 5]), 1,
                np.array([[0, 2], [5, 1]], np.int64), TensorProto.INT64, _F),
    "one-hot-strings": (helper.make_node("OneHotEncoder", ["X"], ["Y"], domain=ML,
                                         cats_strings=["a", "b"]), 1,
                        np.array([["a", "c"], ["b", "a"]], object), TensorProto.STRING, _F),
    "category-mapper": (helper.make_node("CategoryMapper", ["X"], ["Y"], domain=ML,
                                         cats_strings=["a", "b"], cats_int64s=[5, 6]), 1,
                        np.array(["b", "z", "a"], object), TensorProto.STRING,
                        TensorProto.INT64),
    "label-encoder-floats": (helper.make_node("LabelEncoder", ["X"], ["Y"], domain=ML,
                                              keys_floats=[0.5, 1.5], values_strings=["x", "y"],
                                              default_string="?"), 2,
                             np.array([1.5, 0.5, 2.0], np.float32), _F, TensorProto.STRING),
}


@pytest.mark.parametrize("name", sorted(_PREPROCESSING))
def test_preprocessing_matches_onnxruntime(name: str) -> None:
    node, opset, x, x_type, y_type = _PREPROCESSING[name]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", x_type, None)],
                              [helper.make_tensor_value_info("Y", y_type, None)])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(ML, opset)],
                             ir_version=9).SerializeToString()
    got, want = _run(data, x)
    assert got[0].shape == want[0].shape
    if want[0].dtype.kind == "f":
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
    else:
        np.testing.assert_array_equal(got[0], want[0])
