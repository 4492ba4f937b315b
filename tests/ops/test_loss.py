"""The loss family: schemas, kernels against ONNX's oracle, the importer, typed errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._extra_support import assert_close, keel_run, onnx_run, run_both, run_cpu

RNG = np.random.default_rng(5)
NLL, SCE = Op.NEGATIVE_LOG_LIKELIHOOD_LOSS, Op.SOFTMAX_CROSS_ENTROPY_LOSS
ONNX = {NLL: "NegativeLogLikelihoodLoss", SCE: "SoftmaxCrossEntropyLoss"}


def _data(shape: tuple[int, ...], ignore: int | None = None) -> tuple[np.ndarray, ...]:
    x = RNG.standard_normal(shape).astype(np.float32)
    t = RNG.integers(0, shape[1], (shape[0], *shape[2:])).astype(np.int64)
    if ignore is not None:
        t.reshape(-1)[::2] = ignore
    w = (RNG.random(shape[1]) + 0.5).astype(np.float32)
    return x, t, w


@pytest.mark.parametrize("op", [NLL, SCE], ids=lambda o: o.value)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize(("weighted", "ignore"), [(False, None), (True, None), (False, 2),
                                                  (True, -1)])
def test_kernels_match_onnx(op: Op, reduction: str, weighted: bool, ignore: int | None) -> None:
    x, t, w = _data((3, 4, 2, 3), ignore)
    inputs = [x, t, w] if weighted else [x, t]
    attrs: dict[str, Any] = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    n_out = 2 if op is SCE else 1
    expected = onnx_run(ONNX[op], inputs, n_outputs=n_out, opset=22 if op is NLL else 13,
                        **attrs)
    assert_close(run_both(op, inputs, **attrs), expected, rtol=1e-5, atol=1e-6)


def test_nll_by_hand() -> None:
    x = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]], dtype=np.float64))
    t = np.array([0, 2])
    w = np.array([1.0, 1.0, 3.0])
    (none,) = run_both(NLL, [x, t, w], reduction="none")
    np.testing.assert_allclose(none, [-np.log(0.5), -3 * np.log(0.7)])
    (mean,) = run_both(NLL, [x, t, w], reduction="mean")
    np.testing.assert_allclose(mean, (-np.log(0.5) - 3 * np.log(0.7)) / 4)
    (ignored,) = run_both(NLL, [x, t], reduction="mean", ignore_index=0)
    np.testing.assert_allclose(ignored, -np.log(0.7))


def test_sce_log_prob_output_and_cpu_out_buffers() -> None:
    x, t, _ = _data((4, 5))
    loss, logp = run_both(SCE, [x, t], reduction="sum")
    np.testing.assert_allclose(np.exp(logp).sum(axis=1), 1.0, rtol=1e-6)
    bufs = [np.empty((), np.float32), np.empty((4, 5), np.float32)]
    got = run_cpu(SCE, [x, t], out=bufs, reduction="sum")
    assert got[0] is bufs[0] and got[1] is bufs[1]
    assert_close(got, [loss, logp], rtol=1e-6, atol=1e-6)


def test_all_ignored_mean_is_nan_like_onnx() -> None:
    x, t, _ = _data((2, 3))
    (loss,) = run_both(NLL, [x, np.full_like(t, 7)], ignore_index=7)
    assert np.isnan(loss)


def test_inference() -> None:
    schema = get_schema(SCE)
    x, t = TensorType(DType.FLOAT16, ("n", 4, 5)), TensorType(DType.INT32, ("n", 5))
    none = schema.infer_types([x, t], schema.normalize_attrs({"reduction": "none"}))
    assert none == [TensorType(DType.FLOAT16, ("n", 5)), x]
    mean = get_schema(NLL).infer_types([x, t], get_schema(NLL).normalize_attrs({}))
    assert mean[0] == TensorType(DType.FLOAT16, ())


@pytest.mark.parametrize(("inputs", "attrs", "match"), [
    ([np.zeros((2, 3), np.float32), np.zeros(2, np.int64)], {"reduction": "avg"},
     "reduction must be one of none, sum, mean, got 'avg'"),
    ([np.zeros((2, 3), np.float32), np.zeros((2, 1), np.int64)], {},
     r"target must have shape \(N, d1, ...\) = \(2,\)"),
    ([np.zeros((2, 3), np.float32), np.zeros(2, np.int64), np.ones(4, np.float32)], {},
     r"weight must have shape \(3,\)"),
    ([np.zeros((2, 3), np.float32), np.array([0, 3])], {},
     r"target value 3 is not a class index in \[0, 3\)"),
    ([np.zeros((2, 3), np.float32), np.array([-1, 0])], {"ignore_index": 5},
     r"target value -1 is not a class index in \[0, 3\) \(ignore_index is 5\)"),
    ([np.zeros(3, np.float32), np.zeros(3, np.int64)], {}, "input must have rank >= 2"),
])
@pytest.mark.parametrize("op", [NLL, SCE], ids=lambda o: o.value)
def test_typed_errors(op: Op, inputs: list[np.ndarray], attrs: dict[str, Any],
                      match: str) -> None:
    from tests.ops._extra_support import run_ref

    with pytest.raises(InvalidArgumentError, match=match):
        run_ref(op, inputs, **attrs)
    with pytest.raises(InvalidArgumentError, match=match):
        run_cpu(op, inputs, **attrs)


def test_schema_rejects_bad_dtypes() -> None:
    schema = get_schema(NLL)
    with pytest.raises(InvalidArgumentError, match="target must be int32 or int64, got float32"):
        schema.infer_types([TensorType(DType.FLOAT32, (2, 3)), TensorType(DType.FLOAT32, (2,))],
                           schema.normalize_attrs({}))
    with pytest.raises(InvalidArgumentError,
                       match="input must be float16, bfloat16, float32 or float64"):
        schema.infer_types([TensorType(DType.INT32, (2, 3)), TensorType(DType.INT64, (2,))],
                           schema.normalize_attrs({}))


def test_imported_models_run_end_to_end() -> None:
    x, t, w = _data((3, 4, 5), ignore=1)
    got = keel_run("SoftmaxCrossEntropyLoss", [x, t, w], n_outputs=2, opset=13,
                   reduction="mean", ignore_index=1)
    want = onnx_run("SoftmaxCrossEntropyLoss", [x, t, w], n_outputs=2, opset=13,
                    reduction="mean", ignore_index=1)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
