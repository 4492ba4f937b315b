"""Import → export → ONNX's evaluator for the loss, attention, vision, signal, recurrent and
numeric ops: each is written back as the same standard ONNX op with the same results."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from keel.graph.export import to_onnx
from keel.graph.importers.onnx import import_onnx
from tests.ops._extra_support import feeds, onnx_model

RNG = np.random.default_rng(55)


def _n(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


CASES: list[tuple[str, list[Any], dict[str, Any], int, int]] = [
    ("NegativeLogLikelihoodLoss", [_n(3, 4), np.array([0, 1, 3])], {"reduction": "sum"}, 22, 1),
    ("SoftmaxCrossEntropyLoss", [_n(3, 4), np.array([0, 1, 3])], {"ignore_index": 1}, 13, 2),
    ("Attention", [_n(1, 2, 3, 4), _n(1, 2, 5, 4), _n(1, 2, 5, 4)], {"softcap": 2.0}, 23, 1),
    ("RotaryEmbedding", [_n(1, 2, 3, 4), _n(1, 3, 2), _n(1, 3, 2)], {}, 23, 1),
    ("GridSample", [_n(1, 2, 4, 4), RNG.uniform(-1, 1, (1, 3, 3, 2)).astype(np.float32)],
     {"mode": "cubic"}, 22, 1),
    ("Col2Im", [_n(1, 4, 9), np.array([4, 4]), np.array([2, 2])], {}, 18, 1),
    ("DFT", [_n(2, 8, 1), None, np.array(1)], {"onesided": 1}, 20, 1),
    ("HannWindow", [np.array(8)], {"periodic": 0}, 17, 1),
    ("LSTM", [_n(3, 2, 3), _n(1, 16, 3), _n(1, 16, 4)], {"direction": "forward"}, 22, 3),
    ("GRU", [_n(3, 2, 3), _n(2, 12, 3), _n(2, 12, 4)],
     {"direction": "bidirectional", "activations": ["Sigmoid", "Tanh", "HardSigmoid", "Tanh"],
      "activation_alpha": [0.3], "activation_beta": [0.4]}, 22, 2),
    ("Det", [_n(2, 3, 3)], {}, 22, 1),
]


@pytest.mark.parametrize(("op_type", "inputs", "attrs", "opset", "n_out"),
                         [pytest.param(*c, id=c[0]) for c in CASES])
def test_import_export_round_trip(op_type: str, inputs: list[Any], attrs: dict[str, Any],
                                  opset: int, n_out: int) -> None:
    model = onnx_model(op_type, inputs, n_outputs=n_out, opset=opset, **attrs)
    exported = to_onnx(import_onnx(model))
    onnx.checker.check_model(exported)
    assert [n.op_type for n in exported.graph.node] == [op_type]
    assert all(n.domain == "" for n in exported.graph.node)
    given = {i.name for i in exported.graph.input}
    got = ReferenceEvaluator(exported).run(None, {k: v for k, v in feeds(inputs).items()
                                                  if k in given})
    want = ReferenceEvaluator(model).run(None, feeds(inputs))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
