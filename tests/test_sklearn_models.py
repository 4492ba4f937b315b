"""scikit-learn pipelines exported by skl2onnx run on keel as on onnxruntime.

Small models are trained here (no files, no downloads), converted with skl2onnx
(ai.onnx.ml opset 3, probabilities as a tensor: ``zipmap=False``), and run on
keel's cpu backend. Labels must equal onnxruntime's exactly and probabilities and
regression outputs must be within 1e-5; labels must also agree with scikit-learn's
own ``predict`` (float32 export of a float64 model: a row or two may sit on a
boundary, so at most 1 % may differ).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import keel
from keel.errors import UnsupportedOperationError

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle of these tests")
pytest.importorskip("sklearn", reason="scikit-learn trains the models")
pytest.importorskip("skl2onnx", reason="skl2onnx exports the models")

TOLERANCE = 1e-5
OPSETS = {"": 17, "ai.onnx.ml": 3}


@dataclass(frozen=True)
class Export:
    model: Any                       # the fitted scikit-learn estimator
    onnx: bytes
    feeds: dict[str, np.ndarray]
    sklearn_input: Any               # what scikit-learn's predict takes
    classifier: bool


def _data(rows: int = 240, features: int = 5) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, features)).astype(np.float32)
    margin = x[:, 0] + 0.5 * x[:, 1] - 0.25 * x[:, 2]
    targets = {
        "binary": (margin > 0).astype(np.int64),
        "three": np.digitize(margin, [-0.5, 0.5]).astype(np.int64),
        "words": np.asarray(["low", "mid", "high"], dtype=object)[np.digitize(margin,
                                                                              [-0.5, 0.5])],
        "value": (2 * x[:, 0] + x[:, 1] ** 2 - x[:, 3]).astype(np.float64),
    }
    return x, targets


def _export(model: Any, target: str, **convert: Any) -> Export:
    from skl2onnx import to_onnx

    x, targets = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # convergence warnings of the tiny fits
        model.fit(x, targets[target])
    classifier = hasattr(model, "classes_")
    # Classifiers end in a ZipMap unless told not to; LinearSVC has no ZipMap to drop.
    zipmap = classifier and type(model).__name__ != "LinearSVC"
    options = {"zipmap": False} if zipmap else None
    proto = to_onnx(model, x[:1], options=options, target_opset=OPSETS, **convert)
    return Export(model, proto.SerializeToString(), {"X": x}, x, classifier)


def _column_transformer() -> Export:
    """Imputer + scaler on numbers, one-hot on strings, then logistic regression."""
    pd = pytest.importorskip("pandas", reason="the column transformer is fitted on a DataFrame")
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType, StringTensorType
    from sklearn.compose import ColumnTransformer
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline, make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    rng = np.random.default_rng(3)
    n = 160
    frame = pd.DataFrame({"a": rng.standard_normal(n).astype(np.float32),
                          "b": rng.standard_normal(n).astype(np.float32),
                          "c": rng.choice(["x", "y", "z"], n), "d": rng.choice(["p", "q"], n)})
    frame.loc[rng.random(n) < 0.1, "a"] = np.nan
    y = np.where(frame.b + (frame.c == "x") > 0.3, "yes", "no")
    columns = ColumnTransformer([
        ("num", make_pipeline(SimpleImputer(), StandardScaler()), ["a", "b"]),
        ("cat", OneHotEncoder(handle_unknown="ignore"), ["c", "d"])])
    model = Pipeline([("pre", columns), ("clf", LogisticRegression())]).fit(frame, y)
    types = [("a", FloatTensorType([None, 1])), ("b", FloatTensorType([None, 1])),
             ("c", StringTensorType([None, 1])), ("d", StringTensorType([None, 1]))]
    proto = convert_sklearn(model, initial_types=types, target_opset=OPSETS,
                            options={id(model.named_steps["clf"]): {"zipmap": False}})
    feeds = {"a": frame[["a"]].to_numpy(np.float32), "b": frame[["b"]].to_numpy(np.float32),
             "c": frame[["c"]].to_numpy(object), "d": frame[["d"]].to_numpy(object)}
    return Export(model, proto.SerializeToString(), feeds, frame, True)


def _sk(name: str) -> Any:
    import sklearn.ensemble
    import sklearn.linear_model
    import sklearn.pipeline
    import sklearn.preprocessing
    import sklearn.svm
    import sklearn.tree

    for module in (sklearn.ensemble, sklearn.linear_model, sklearn.pipeline,
                   sklearn.preprocessing, sklearn.svm, sklearn.tree):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)


def _pipeline(*steps: Any) -> Any:
    return _sk("make_pipeline")(*steps)


BUILDERS: dict[str, Callable[[], Export]] = {
    "scaler-logistic-regression": lambda: _export(
        _pipeline(_sk("StandardScaler")(), _sk("LogisticRegression")()), "three"),
    "logistic-regression-binary": lambda: _export(_sk("LogisticRegression")(), "binary"),
    "logistic-regression-string-labels": lambda: _export(_sk("LogisticRegression")(), "words"),
    "random-forest-classifier": lambda: _export(
        _sk("RandomForestClassifier")(n_estimators=12, max_depth=6, random_state=0), "three"),
    "random-forest-binary": lambda: _export(
        _sk("RandomForestClassifier")(n_estimators=12, random_state=0), "binary"),
    "random-forest-regressor": lambda: _export(
        _sk("RandomForestRegressor")(n_estimators=12, max_depth=8, random_state=0), "value"),
    "gradient-boosting-binary": lambda: _export(
        _sk("GradientBoostingClassifier")(n_estimators=15, random_state=0), "binary"),
    "gradient-boosting-multiclass": lambda: _export(
        _sk("GradientBoostingClassifier")(n_estimators=10, random_state=0), "three"),
    "gradient-boosting-regressor": lambda: _export(
        _sk("GradientBoostingRegressor")(n_estimators=20, random_state=0), "value"),
    "decision-tree-classifier": lambda: _export(
        _sk("DecisionTreeClassifier")(random_state=0), "words"),
    "decision-tree-regressor": lambda: _export(
        _sk("DecisionTreeRegressor")(max_depth=6, random_state=0), "value"),
    "linear-svc": lambda: _export(_sk("LinearSVC")(), "three"),
    "linear-svc-binary": lambda: _export(_sk("LinearSVC")(), "binary"),
    "svc-rbf-probabilities": lambda: _export(
        _sk("SVC")(probability=True, random_state=0), "three"),
    "svc-poly-binary": lambda: _export(
        _sk("SVC")(kernel="poly", degree=2, probability=True, random_state=0), "binary"),
    "svc-rbf-binary-margins": lambda: _export(_sk("SVC")(), "binary"),
    "svc-linear-multiclass-votes": lambda: _export(_sk("SVC")(kernel="linear"), "three"),
    "svr": lambda: _export(_sk("SVR")(), "value"),
    "normalizer-binarizer-linear-regression": lambda: _export(
        _pipeline(_sk("Normalizer")(), _sk("Binarizer")(threshold=0.1),
                  _sk("LinearRegression")()), "value"),
    "column-transformer-imputer-one-hot": _column_transformer,
}


@functools.cache
def exported(name: str) -> Export:
    return BUILDERS[name]()


def _run_both(export: Export) -> tuple[list[np.ndarray], list[np.ndarray]]:
    session = ort.InferenceSession(export.onnx, providers=["CPUExecutionProvider"])
    expected = session.run(None, export.feeds)
    got = keel.load_model(export.onnx, backend="cpu").run(None, export.feeds)
    return expected, got


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_matches_onnxruntime(name: str) -> None:
    expected, got = _run_both(exported(name))
    assert len(got) == len(expected)
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape
        if e.dtype.kind == "f":
            np.testing.assert_allclose(g, e, rtol=TOLERANCE, atol=TOLERANCE)
        else:
            np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_matches_sklearn(name: str) -> None:
    export = exported(name)
    _, got = _run_both(export)
    want = export.model.predict(export.sklearn_input)
    if export.classifier:
        differ = np.mean(got[0].reshape(-1) != want.reshape(-1))
        assert differ <= 0.01, f"{differ:.1%} of the labels differ from scikit-learn's"
    else:
        np.testing.assert_allclose(got[0].reshape(-1), want, rtol=1e-4, atol=1e-4)


def test_probabilities_match_predict_proba() -> None:
    export = exported("random-forest-classifier")
    _, got = _run_both(export)
    np.testing.assert_allclose(got[1], export.model.predict_proba(export.sklearn_input),
                               atol=1e-5)


def test_batch_of_one_matches_the_batch() -> None:
    export = exported("gradient-boosting-multiclass")
    model = keel.load_model(export.onnx, backend="cpu")
    x = export.feeds["X"]
    whole = model.run(None, {"X": x})
    for i in (0, 17):
        row = model.run(None, {"X": x[i:i + 1]})
        np.testing.assert_array_equal(row[0], whole[0][i:i + 1])
        np.testing.assert_allclose(row[1], whole[1][i:i + 1], rtol=1e-6, atol=1e-7)


def test_threads_give_the_same_bits() -> None:
    """A forest big enough to walk on several threads gives what one thread gives."""
    from skl2onnx import to_onnx

    x, targets = _data(rows=600)
    model = _sk("RandomForestClassifier")(n_estimators=60, random_state=0).fit(
        x, targets["three"])
    proto = to_onnx(model, x[:1], options={"zipmap": False}, target_opset=OPSETS)
    runs = [keel.load_model(proto.SerializeToString(), backend="cpu", threads=t).run(
        None, {"X": x}) for t in (1, 3)]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1].tobytes() == runs[1][1].tobytes()
    np.testing.assert_array_equal(runs[0][0], model.predict(x))


def test_the_native_walk_gives_the_numpy_walks_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradient boosting (sklearn's ``x <= split`` trees: the native walk's case) gives the
    same labels and scores with the native tier and without it."""
    from skl2onnx import to_onnx

    from keel import config, native

    x, targets = _data(rows=300)
    model = _sk("GradientBoostingClassifier")(n_estimators=20, random_state=0).fit(
        x, targets["three"])
    data = to_onnx(model, x[:1], options={"zipmap": False},
                   target_opset=OPSETS).SerializeToString()
    native_run = keel.load_model(data, backend="cpu").run(None, {"X": x})
    monkeypatch.setenv("KEEL_NATIVE", "off")
    config.reload_settings()
    native.reset()
    try:
        numpy_run = keel.load_model(data, backend="cpu").run(None, {"X": x})
    finally:
        monkeypatch.delenv("KEEL_NATIVE")
        config.reload_settings()
        native.reset()
    np.testing.assert_array_equal(native_run[0], numpy_run[0])
    assert native_run[1].tobytes() == numpy_run[1].tobytes()
    np.testing.assert_array_equal(native_run[0], model.predict(x))


def test_keel_file_round_trip(tmp_path: Any) -> None:
    """A forest lives in node attributes; the .keel file keeps them (and string labels)."""
    from keel.formats.keel_format import save_keel
    from keel.graph.importers.onnx import import_onnx

    export = exported("decision-tree-classifier")
    save_keel(import_onnx(export.onnx), tmp_path / "tree.keel")
    want = keel.load_model(export.onnx).run(None, export.feeds)
    got = keel.load_model(tmp_path / "tree.keel").run(None, export.feeds)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_label_encoder_export() -> None:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType

    encoder = _sk("LabelEncoder")().fit(["red", "green", "blue"])
    proto = convert_sklearn(encoder, initial_types=[("X", StringTensorType([None]))],
                            target_opset={"": 17, "ai.onnx.ml": 2})
    words = np.asarray(["blue", "red", "green", "red"], dtype=object)
    got = keel.load_model(proto.SerializeToString()).run(None, {"X": words})
    np.testing.assert_array_equal(got[0], encoder.transform(words))


def test_zipmap_is_refused_with_the_way_out() -> None:
    """skl2onnx's default classifier output is a ZipMap: keel says how to export without it."""
    from skl2onnx import to_onnx

    x, targets = _data()
    model = _sk("LogisticRegression")().fit(x, targets["binary"])
    proto = to_onnx(model, x[:1], target_opset=OPSETS)
    with pytest.raises(UnsupportedOperationError, match="zipmap"):
        keel.load_model(proto.SerializeToString())
