"""The normalization family: schemas, reference kernels against ONNX's oracle, cpu kernels."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._nrq_support import assert_close, onnx_run, run_both, run_cpu, run_ref

RNG = np.random.default_rng(11)


def _n(*shape: int, dtype: Any = np.float32, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(dtype)


X4 = _n(2, 4, 3, 5)
C4 = [_n(4), _n(4), _n(4), np.abs(_n(4)) + 0.5]

# (id, keel op, inputs, keel attrs, ONNX op_type, ONNX attrs, outputs compared)
ORACLE: list[tuple[str, Op, list[np.ndarray], dict[str, Any], str, dict[str, Any], int]] = [
    ("batch_norm", Op.BATCH_NORM, [X4, *C4], {"epsilon": 1e-3}, "BatchNormalization",
     {"epsilon": 1e-3}, 1),
    ("batch_norm-2d", Op.BATCH_NORM, [_n(5, 4), *C4], {}, "BatchNormalization", {}, 1),
    ("layer_norm", Op.LAYER_NORM, [X4, _n(5), _n(5)], {}, "LayerNormalization", {}, 3),
    ("layer_norm-axis1", Op.LAYER_NORM, [X4, _n(4, 3, 5)], {"axis": 1, "epsilon": 1e-2},
     "LayerNormalization", {"axis": 1, "epsilon": 1e-2}, 3),
    ("layer_norm-axis-neg2", Op.LAYER_NORM, [X4, _n(3, 5), _n(5)], {"axis": -2},
     "LayerNormalization", {"axis": -2}, 3),
    ("instance_norm", Op.INSTANCE_NORM, [X4, _n(4), _n(4)], {"epsilon": 1e-4},
     "InstanceNormalization", {"epsilon": 1e-4}, 1),
    ("group_norm-2", Op.GROUP_NORM, [X4, _n(4), _n(4)], {"num_groups": 2},
     "GroupNormalization", {"num_groups": 2}, 1),
    ("group_norm-1", Op.GROUP_NORM, [X4, _n(4), _n(4)], {"num_groups": 1, "epsilon": 1e-3},
     "GroupNormalization", {"num_groups": 1, "epsilon": 1e-3}, 1),
    ("group_norm-4", Op.GROUP_NORM, [_n(3, 4, 6), _n(4), _n(4)], {"num_groups": 4},
     "GroupNormalization", {"num_groups": 4}, 1),
    ("rms_norm", Op.RMS_NORM, [X4, _n(5)], {}, "RMSNormalization", {}, 1),
    ("rms_norm-axis1", Op.RMS_NORM, [X4, _n(4, 3, 5)], {"axis": 1, "epsilon": 1e-3},
     "RMSNormalization", {"axis": 1, "epsilon": 1e-3}, 1),
    # ONNX's LRN oracle loops over the batch axis where it means channels: keep N == C.
    ("lrn", Op.LRN, [_n(4, 4, 3, 3)], {"size": 3, "alpha": 0.2, "beta": 0.6, "bias": 1.5},
     "LRN", {"size": 3, "alpha": 0.2, "beta": 0.6, "bias": 1.5}, 1),
    ("lrn-even", Op.LRN, [_n(5, 5, 2, 2)], {"size": 4}, "LRN", {"size": 4}, 1),
    ("lp_normalization-p2", Op.LP_NORMALIZATION, [X4], {"axis": 1}, "LpNormalization",
     {"axis": 1}, 1),
    # ONNX's oracle raises x to the power p without abs: positive data for p = 1.
    ("lp_normalization-p1", Op.LP_NORMALIZATION, [np.abs(X4)], {"p": 1}, "LpNormalization",
     {"p": 1}, 1),
    ("mean_variance_norm", Op.MEAN_VARIANCE_NORM, [_n(3, 2, 4, 5, scale=3.0)], {},
     "MeanVarianceNormalization", {}, 1),
    ("mean_variance_norm-axes", Op.MEAN_VARIANCE_NORM, [_n(3, 4, 5)], {"axes": (1,)},
     "MeanVarianceNormalization", {"axes": [1]}, 1),
    *[(f"{op.value}-axis{ax}", op, [X4 * 4], {"axis": ax}, onnx_name, {"axis": ax}, 1)
      for op, onnx_name in ((Op.SOFTMAX, "Softmax"), (Op.LOG_SOFTMAX, "LogSoftmax"),
                            (Op.HARDMAX, "Hardmax"))
      for ax in (0, 2, -1)],
]


@pytest.mark.parametrize(("op", "inputs", "attrs", "onnx_op", "onnx_attrs", "n_out"),
                         [pytest.param(*c[1:], id=c[0]) for c in ORACLE])
def test_reference_matches_onnx(op: Op, inputs: list[np.ndarray], attrs: dict[str, Any],
                                onnx_op: str, onnx_attrs: dict[str, Any], n_out: int) -> None:
    expected = onnx_run(onnx_op, inputs, n_outputs=n_out, **onnx_attrs)
    actual = run_both(op, inputs, rtol=1e-4, atol=1e-5, **attrs)[:n_out]
    assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_lp_normalization_p1_uses_absolute_values() -> None:
    x = np.array([[3.0, -1.0, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    (y,) = run_both(Op.LP_NORMALIZATION, [x], p=1)
    np.testing.assert_allclose(y, [[0.75, -0.25, 0.0], [0.0, 0.0, 0.0]])


def test_lrn_matches_the_formula_when_batch_differs_from_channels() -> None:
    x = _n(1, 5, 2, 2)
    (y,) = run_both(Op.LRN, [x], size=3, alpha=0.3, beta=0.7, bias=2.0)
    square = x.astype(np.float64) ** 2
    window = np.stack([square[:, max(0, c - 1):c + 2].sum(axis=1) for c in range(5)], axis=1)
    np.testing.assert_allclose(y, x / (2.0 + 0.1 * window) ** 0.7, rtol=1e-6)


def test_group_norm_accepts_per_group_scale() -> None:
    x, scale, bias = _n(2, 6, 4), _n(2), _n(2)
    (y,) = run_both(Op.GROUP_NORM, [x, scale, bias], num_groups=2)
    (expected,) = run_ref(Op.GROUP_NORM, [x, np.repeat(scale, 3), np.repeat(bias, 3)],
                          num_groups=2)
    np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_softmax_is_stable_for_large_inputs() -> None:
    x = np.array([[1000.0, 1001.0, 1002.0], [-1e4, -1e4, -1e4]], dtype=np.float32)
    (y,) = run_both(Op.SOFTMAX, [x])
    np.testing.assert_allclose(y[0], np.exp([-2, -1, 0]) / np.exp([-2, -1, 0]).sum(), rtol=1e-6)
    np.testing.assert_allclose(y[1], [1 / 3] * 3, rtol=1e-6)
    (z,) = run_both(Op.LOG_SOFTMAX, [x])
    assert np.isfinite(z).all()


@pytest.mark.parametrize("spread", [10.0, 100.0, 200.0, 2000.0])
@pytest.mark.parametrize("offset", [0.0, 1e3, -1e3])
def test_softmax_shift_keeps_exp_in_range(spread: float, offset: float) -> None:
    # Within +-64 no shift, within a spread of 128 the block's midpoint, beyond it each
    # row's max: a wrong choice overflows or underflows a whole row (inf, nan or 0).
    x = (np.linspace(-spread / 2, spread / 2, 24).reshape(4, 6) + offset).astype(np.float32)
    x[3] = offset - spread / 2 + np.arange(6)          # one row far below the others
    for op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
        (got,) = run_cpu(op, [x])
        assert np.isfinite(got).all()
        assert_close([got], run_ref(op, [x]), rtol=1e-5, atol=1e-6)


def test_softmax_rows_in_blocks_match_the_reference() -> None:
    # Many short rows (several blocks of rows), rows longer than a block, other axes,
    # non-contiguous input, -inf entries and a row of nan.
    cases: list[tuple[np.ndarray, int]] = [
        (_n(700, 130, scale=5.0), -1), (_n(2, 70000), -1), (_n(30, 7, 40), 1),
        (_n(40, 30, scale=3.0).T, -1)]
    masked = _n(300, 260, scale=4.0)
    masked[::7, ::3] = -np.inf
    masked[5] = np.nan
    cases.append((masked, -1))
    for x, axis in cases:
        for op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
            with np.errstate(invalid="ignore"):
                want = run_ref(op, [x], axis=axis)
            assert_close(run_cpu(op, [x], axis=axis), want, rtol=2e-5, atol=1e-6)


def test_layer_norm_rows_in_blocks_match_the_reference() -> None:
    # Several blocks of short rows, rows longer than one block, a large mean offset,
    # float16 input and a non-contiguous input; Mean and InvStdDev too.
    cases = [(_n(3000, 50, scale=2.0) + 100.0, -1), (_n(2, 70000), -1), (_n(6, 5, 7), 1),
             (_n(64, 40, dtype=np.float16, scale=3.0), -1), (_n(40, 24).T, -1)]
    for x, axis in cases:
        scale, bias = _n(*x.shape[axis:]), _n(*x.shape[axis:])
        want = run_ref(Op.LAYER_NORM, [x, scale, bias], axis=axis, epsilon=1e-5)
        got = run_cpu(Op.LAYER_NORM, [x, scale, bias], axis=axis, epsilon=1e-5)
        # float32 statistics (stash_type 1): the mean of values near 100 carries ~2e-5.
        tol = 5e-3 if x.dtype == np.float16 else 1e-4 if x.mean() > 50 else 2e-5
        assert_close(got, want, rtol=tol, atol=tol)


def test_instance_and_group_norm_with_long_rows() -> None:
    # Spatial sizes past one block of rows (one row per block).
    x = _n(2, 3, 300, 250)
    args = [x, _n(3), _n(3)]
    assert_close(run_cpu(Op.INSTANCE_NORM, args), run_ref(Op.INSTANCE_NORM, args),
                 rtol=2e-5, atol=2e-5)
    args = [_n(2, 4, 90, 100), _n(4), _n(4)]
    assert_close(run_cpu(Op.GROUP_NORM, args, num_groups=2),
                 run_ref(Op.GROUP_NORM, args, num_groups=2), rtol=2e-5, atol=2e-5)


def test_hardmax_picks_the_first_maximum() -> None:
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], dtype=np.float32)
    (y,) = run_both(Op.HARDMAX, [x])
    np.testing.assert_array_equal(y, [[0, 1, 0], [1, 0, 0]])


def test_float16_is_computed_in_float32_on_cpu() -> None:
    x = _n(4, 64, dtype=np.float16, scale=4.0)
    exact = run_ref(Op.SOFTMAX, [x.astype(np.float64)])[0]
    (y,) = run_cpu(Op.SOFTMAX, [x])
    assert y.dtype == np.float16
    # One float16 rounding of the exact result, not float16 arithmetic throughout.
    np.testing.assert_allclose(y, exact, rtol=2 ** -10, atol=2 ** -14)


# ---- cpu buffers -------------------------------------------------------------------


def test_softmax_writes_into_out_and_in_place() -> None:
    x = _n(3, 7)
    expected = run_ref(Op.SOFTMAX, [x])[0]
    out = np.empty_like(x)
    (y,) = run_cpu(Op.SOFTMAX, [x], out=[out])
    assert y is out
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    x2 = x.copy()
    (z,) = run_cpu(Op.SOFTMAX, [x2], out=[x2])
    assert z is x2
    np.testing.assert_allclose(x2, expected, rtol=1e-6)


@pytest.mark.parametrize("n_out", [1, 3])
def test_layer_norm_writes_into_out(n_out: int) -> None:
    x, scale, bias = _n(4, 6), _n(6), _n(6)
    expected = run_ref(Op.LAYER_NORM, [x, scale, bias])
    out = [np.empty((4, 6), np.float32), np.empty((4, 1), np.float32),
           np.empty((4, 1), np.float32)][:n_out]
    got = run_cpu(Op.LAYER_NORM, [x, scale, bias], out=out)
    assert len(got) == n_out and all(g is o for g, o in zip(got, out, strict=True))
    assert_close(got, expected[:n_out], rtol=1e-5, atol=1e-6)


def test_float16_outputs_are_cast_into_out() -> None:
    x, scale = _n(2, 3, 4, dtype=np.float16), _n(4, dtype=np.float16)
    out = np.empty_like(x)
    (y,) = run_cpu(Op.LAYER_NORM, [x, scale], out=[out])
    assert y is out
    expected = run_ref(Op.LAYER_NORM, [x, scale])[0]
    np.testing.assert_allclose(out, expected, rtol=5e-3, atol=5e-3)


def test_layer_norm_statistics_dtype() -> None:
    x = _n(2, 8, dtype=np.float16)
    for run in (run_ref, run_cpu):
        y, mean, inv = run(Op.LAYER_NORM, [x, np.ones(8, np.float16)])
        assert (y.dtype, mean.dtype, inv.dtype) == (np.float16, np.float32, np.float32)
    _, mean64, _ = run_ref(Op.LAYER_NORM, [_n(2, 8), np.ones(8, np.float32)], stash_type=11)
    assert mean64.dtype == np.float64


# ---- schemas -------------------------------------------------------------------------


def _infer(op: Op, types: list[TensorType | None], **attrs: Any) -> list[TensorType | None]:
    schema = get_schema(op)
    return schema.infer_types(types, schema.normalize_attrs(attrs))


def test_layer_norm_infers_statistics_shapes() -> None:
    f16 = DType.FLOAT16
    y, mean, inv = _infer(Op.LAYER_NORM, [TensorType(f16, ("b", 5, 8)), TensorType(f16, (8,))])
    assert y == TensorType(f16, ("b", 5, 8))
    assert mean == inv == TensorType(DType.FLOAT32, ("b", 5, 1))


def test_infer_keeps_type_and_checks_params() -> None:
    t = TensorType(DType.FLOAT32, (2, 6, 4))
    assert _infer(Op.GROUP_NORM, [t, TensorType(DType.FLOAT32, (6,)),
                                  TensorType(DType.FLOAT32, (6,))], num_groups=3) == [t]
    assert _infer(Op.SOFTMAX, [t], axis=1) == [t]
    with pytest.raises(InvalidArgumentError, match=r"scale must have shape \(6,\)"):
        _infer(Op.INSTANCE_NORM, [t, TensorType(DType.FLOAT32, (5,)),
                                  TensorType(DType.FLOAT32, (6,))])


# ---- errors ---------------------------------------------------------------------------

ERRORS: list[tuple[str, Op, list[np.ndarray], dict[str, Any], type[Exception], str]] = [
    ("bn-training", Op.BATCH_NORM, [X4, *C4], {"training_mode": 1},
     UnsupportedOperationError, "training_mode=1"),
    ("bn-rank1", Op.BATCH_NORM, [_n(4), *C4], {}, InvalidArgumentError, "rank >= 2"),
    ("bn-param", Op.BATCH_NORM, [X4, _n(3), *C4[1:]], {}, InvalidArgumentError,
     r"scale must have shape \(4,\), got \(3,\)"),
    ("softmax-axis", Op.SOFTMAX, [X4], {"axis": 4}, InvalidArgumentError,
     r"softmax: axis 4 is out of range for rank 4; allowed: -4\.\.3"),
    ("hardmax-axis", Op.HARDMAX, [X4], {"axis": -5}, InvalidArgumentError, "axis -5"),
    ("softmax-int", Op.SOFTMAX, [np.arange(4)], {}, InvalidArgumentError,
     "X must be bfloat16, float16, float32, float64, got int64"),
    ("ln-axis", Op.LAYER_NORM, [X4, _n(5)], {"axis": 7}, InvalidArgumentError,
     "layer_norm: axis 7 is out of range"),
    ("ln-scale", Op.LAYER_NORM, [X4, _n(4)], {}, InvalidArgumentError,
     r"Scale of shape \(4,\) does not broadcast to the normalized shape \(5,\)"),
    ("ln-stash", Op.LAYER_NORM, [X4, _n(5)], {"stash_type": 10}, UnsupportedOperationError,
     "stash_type 10"),
    ("gn-groups", Op.GROUP_NORM, [X4, _n(4), _n(4)], {"num_groups": 3}, InvalidArgumentError,
     "num_groups 3 must divide the channel count 4"),
    ("gn-zero", Op.GROUP_NORM, [X4, _n(4), _n(4)], {"num_groups": 0}, InvalidArgumentError,
     "num_groups must be > 0"),
    ("rms-axis", Op.RMS_NORM, [X4, _n(5)], {"axis": -9}, InvalidArgumentError,
     "rms_norm: axis -9"),
    ("lrn-size", Op.LRN, [X4], {"size": 0}, InvalidArgumentError, "size must be > 0"),
    ("lp-p", Op.LP_NORMALIZATION, [X4], {"p": 3}, InvalidArgumentError, "p must be 1 or 2"),
    ("lp-axis", Op.LP_NORMALIZATION, [X4], {"axis": 4}, InvalidArgumentError, "axis 4"),
    ("mvn-repeat", Op.MEAN_VARIANCE_NORM, [X4], {"axes": (1, -3)}, InvalidArgumentError,
     "repeat an axis"),
    ("mvn-axis", Op.MEAN_VARIANCE_NORM, [_n(3, 4)], {}, InvalidArgumentError,
     "axes entry 2 is out of range for rank 2"),
]


@pytest.mark.parametrize(("op", "inputs", "attrs", "error", "match"),
                         [pytest.param(*c[1:], id=c[0]) for c in ERRORS])
@pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
def test_typed_errors(run: Any, op: Op, inputs: list[np.ndarray], attrs: dict[str, Any],
                      error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        run(op, inputs, **attrs)


def test_group_norm_requires_num_groups() -> None:
    with pytest.raises(InvalidArgumentError, match="requires attribute 'num_groups'"):
        get_schema(Op.GROUP_NORM).normalize_attrs({})
