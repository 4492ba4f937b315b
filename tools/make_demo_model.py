"""Build keel's bundled demo model: a digits classifier trained on scikit-learn's digits.

Writes ``keel/data/digits_mlp.onnx`` and ``keel/data/digits_holdout.npz`` (held-out
samples the model never saw). Needs scikit-learn; run from the repository root:

    python tools/make_demo_model.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

OUT = Path(__file__).resolve().parent.parent / "keel" / "data"
HOLDOUT = 360


def main() -> None:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=HOLDOUT, random_state=0, stratify=y
    )
    clf = MLPClassifier(hidden_layer_sizes=(128, 64), max_iter=600, random_state=0)
    clf.fit(x_train, y_train)
    print(f"scikit-learn accuracy on the held-out set: {clf.score(x_test, y_test):.4f}")

    model = _to_onnx(clf)
    onnx.checker.check_model(model)
    OUT.mkdir(parents=True, exist_ok=True)
    onnx.save(model, OUT / "digits_mlp.onnx")
    np.savez_compressed(OUT / "digits_holdout.npz", x=x_test, y=y_test)
    print(f"wrote {OUT / 'digits_mlp.onnx'} and {OUT / 'digits_holdout.npz'}")


def _to_onnx(clf: MLPClassifier) -> onnx.ModelProto:
    inits, nodes = [], []
    prev = "pixels"
    n_layers = len(clf.coefs_)
    for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True)):
        inits += [numpy_helper.from_array(w.astype(np.float32), f"W{i}"),
                  numpy_helper.from_array(b.astype(np.float32), f"B{i}")]
        out = f"h{i}" if i < n_layers - 1 else "logits"
        nodes.append(helper.make_node("Gemm", [prev, f"W{i}", f"B{i}"], [out], name=f"dense{i}"))
        if i < n_layers - 1:
            nodes.append(helper.make_node("Relu", [out], [f"a{i}"], name=f"relu{i}"))
            out = f"a{i}"
        prev = out
    nodes.append(helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1, name="softmax"))
    graph = helper.make_graph(
        nodes, "digits_mlp",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="keel-demo")
    model.ir_version = 8
    model.doc_string = "8x8 handwritten digits (scikit-learn digits) -> 10 class probabilities"
    return model


if __name__ == "__main__":
    main()
