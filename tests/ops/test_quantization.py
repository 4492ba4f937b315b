"""The quantization family: schemas, reference kernels against ONNX's oracle, cpu kernels.

Integer outputs must match ONNX's reference evaluator exactly: the kernels keep
the precision ONNX uses where rounding makes it visible.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from tests.ops._nrq_support import assert_close, onnx_run, run_both, run_cpu, run_ref

RNG = np.random.default_rng(3)
F32 = np.float32


def _f(*shape: int, lo: float = -20.0, hi: float = 20.0, dtype: Any = F32) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(dtype)


def _s(*shape: int) -> np.ndarray:
    return RNG.uniform(0.02, 0.3, shape).astype(F32)


def _q(dtype: Any, *shape: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def _zp(dtype: Any, *shape: int) -> np.ndarray:
    return np.asarray(_q(dtype, *shape) // 4, dtype=dtype)


X = _f(3, 4, 6)

# (id, keel op, inputs, keel attrs, ONNX op_type, ONNX attrs, number of outputs)
ORACLE: list[tuple[str, Op, list[Any], dict[str, Any], str, dict[str, Any], int]] = [
    ("q-uint8-default", Op.QUANTIZE_LINEAR, [X, np.array(0.1, F32)], {}, "QuantizeLinear",
     {}, 1),
    *[(f"q-{np.dtype(dt).name}", Op.QUANTIZE_LINEAR, [X, _s(), _zp(dt)], {}, "QuantizeLinear",
       {}, 1) for dt in (np.uint8, np.int8, np.uint16, np.int16)],
    ("q-axis0", Op.QUANTIZE_LINEAR, [X, _s(3), _zp(np.int8, 3)], {"axis": 0},
     "QuantizeLinear", {"axis": 0}, 1),
    ("q-axis-last", Op.QUANTIZE_LINEAR, [X, _s(6), _zp(np.uint8, 6)], {"axis": -1},
     "QuantizeLinear", {"axis": -1}, 1),
    ("q-blocked", Op.QUANTIZE_LINEAR, [X, _s(3, 4, 2), _zp(np.int16, 3, 4, 2)],
     {"axis": 2, "block_size": 4}, "QuantizeLinear", {"axis": 2, "block_size": 4}, 1),
    ("q-output-dtype", Op.QUANTIZE_LINEAR, [X, np.array(0.05, F32)],
     {"output_dtype": "int16"}, "QuantizeLinear", {"output_dtype": TensorProto.INT16}, 1),
    ("q-float16", Op.QUANTIZE_LINEAR,
     [X.astype(np.float16), np.array(0.07, np.float16), np.array(3, np.int8)], {},
     "QuantizeLinear", {}, 1),
    ("q-precision", Op.QUANTIZE_LINEAR, [X, np.array(0.1, F32), np.array(1, np.int8)],
     {"precision": "float64"}, "QuantizeLinear", {"precision": TensorProto.DOUBLE}, 1),
    *[(f"dq-{np.dtype(dt).name}", Op.DEQUANTIZE_LINEAR, [_q(dt, 3, 4), _s(), _zp(dt)], {},
       "DequantizeLinear", {}, 1) for dt in (np.uint8, np.int8, np.uint16, np.int16)],
    ("dq-int32", Op.DEQUANTIZE_LINEAR, [_q(np.int16, 3, 4).astype(np.int32), _s()], {},
     "DequantizeLinear", {}, 1),
    ("dq-axis", Op.DEQUANTIZE_LINEAR, [_q(np.uint8, 3, 4, 5), _s(4), _zp(np.uint8, 4)], {},
     "DequantizeLinear", {}, 1),
    ("dq-blocked", Op.DEQUANTIZE_LINEAR, [_q(np.int8, 5, 4), _s(2, 4), _zp(np.int8, 2, 4)],
     {"axis": 0, "block_size": 3}, "DequantizeLinear", {"axis": 0, "block_size": 3}, 1),
    ("dyn-mixed", Op.DYNAMIC_QUANTIZE_LINEAR, [_f(4, 5, lo=-2, hi=7)], {},
     "DynamicQuantizeLinear", {}, 3),
    ("dyn-positive", Op.DYNAMIC_QUANTIZE_LINEAR, [_f(6, lo=1, hi=3)], {},
     "DynamicQuantizeLinear", {}, 3),
    ("dyn-zeros", Op.DYNAMIC_QUANTIZE_LINEAR, [np.zeros((2, 3), F32)], {},
     "DynamicQuantizeLinear", {}, 3),
]


def _qmm(a: np.ndarray, b: np.ndarray, y_dtype: Any, b_scale: np.ndarray | None = None,
         b_zp: np.ndarray | None = None) -> list[np.ndarray]:
    return [a, np.array(0.03, F32), _zp(a.dtype.type), b,
            np.array(0.05, F32) if b_scale is None else b_scale,
            _zp(b.dtype.type) if b_zp is None else b_zp,
            np.array(0.4, F32), _zp(y_dtype)]


ORACLE += [
    ("qmm-u8", Op.QLINEAR_MATMUL, _qmm(_q(np.uint8, 4, 7), _q(np.uint8, 7, 3), np.uint8), {},
     "QLinearMatMul", {}, 1),
    ("qmm-i8", Op.QLINEAR_MATMUL, _qmm(_q(np.int8, 4, 7), _q(np.int8, 7, 3), np.int8), {},
     "QLinearMatMul", {}, 1),
    ("qmm-batched", Op.QLINEAR_MATMUL, _qmm(_q(np.uint8, 2, 4, 7), _q(np.int8, 7, 3), np.uint8),
     {}, "QLinearMatMul", {}, 1),
    ("qmm-per-column", Op.QLINEAR_MATMUL,
     _qmm(_q(np.uint8, 4, 7), _q(np.int8, 7, 3), np.int8, _s(3), _zp(np.int8, 3)), {},
     "QLinearMatMul", {}, 1),
]


def _qconv(x: np.ndarray, w: np.ndarray, per_channel: bool = False,
           bias: bool = False) -> list[np.ndarray]:
    m = w.shape[0]
    shape = (m,) if per_channel else ()
    inputs = [x, np.array(0.02, F32), _zp(x.dtype.type), w, _s(*shape),
              np.zeros(shape, w.dtype), np.array(1.5, F32), _zp(np.uint8)]
    if bias:
        inputs.append(np.asarray(RNG.integers(-3000, 3000, m), dtype=np.int32))
    return inputs


ORACLE += [
    ("qconv", Op.QLINEAR_CONV, _qconv(_q(np.uint8, 1, 3, 6, 5), _q(np.int8, 4, 3, 3, 3)), {},
     "QLinearConv", {}, 1),
    ("qconv-groups-bias", Op.QLINEAR_CONV,
     _qconv(_q(np.uint8, 2, 4, 5, 5), _q(np.int8, 6, 2, 3, 3), per_channel=True, bias=True),
     {"group": 2, "pads": (1, 1, 1, 1)}, "QLinearConv", {"group": 2, "pads": [1, 1, 1, 1]}, 1),
    ("qconv-strided", Op.QLINEAR_CONV, _qconv(_q(np.int8, 1, 2, 9, 8), _q(np.int8, 3, 2, 3, 2)),
     {"strides": (2, 3), "dilations": (1, 2), "pads": (0, 1, 2, 0)}, "QLinearConv",
     {"strides": [2, 3], "dilations": [1, 2], "pads": [0, 1, 2, 0]}, 1),
    ("qconv-same-upper", Op.QLINEAR_CONV,
     _qconv(_q(np.uint8, 1, 2, 7, 6), _q(np.uint8, 3, 2, 4, 3)),
     {"auto_pad": "SAME_UPPER", "strides": (2, 2)}, "QLinearConv",
     {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, 1),
]


@pytest.mark.parametrize(("op", "inputs", "attrs", "onnx_op", "onnx_attrs", "n_out"),
                         [pytest.param(*c[1:], id=c[0]) for c in ORACLE])
def test_reference_matches_onnx(op: Op, inputs: list[Any], attrs: dict[str, Any],
                                onnx_op: str, onnx_attrs: dict[str, Any], n_out: int) -> None:
    expected = onnx_run(onnx_op, inputs, n_outputs=n_out, **onnx_attrs)
    assert_close(run_both(op, inputs, rtol=1e-6, atol=1e-7, **attrs), expected,
                 rtol=1e-6, atol=1e-7)


def test_rounds_half_to_even_and_saturates() -> None:
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 300.0, -300.0, np.inf, np.nan], F32)
    (y,) = run_both(Op.QUANTIZE_LINEAR, [x, np.array(1.0, F32), np.array(0, np.int8)])
    np.testing.assert_array_equal(y, [0, 2, 2, 0, -2, 127, -128, 127, 0])
    (u,) = run_both(Op.QUANTIZE_LINEAR, [x[:3], np.array(0.5, F32), np.array(250, np.uint8)])
    np.testing.assert_array_equal(u, [251, 253, 255])


def test_per_row_parameters_of_qlinear_matmul() -> None:
    a, b = _q(np.uint8, 3, 4), _q(np.uint8, 4, 2)
    a_s, a_zp = _s(3), _zp(np.uint8, 3)
    inputs = [a, a_s, a_zp, b, np.array(0.1, F32), np.array(7, np.uint8),
              np.array(0.5, F32), np.array(9, np.uint8)]
    (y,) = run_both(Op.QLINEAR_MATMUL, inputs)
    for row in range(3):
        one = [a[row:row + 1], np.asarray(a_s[row]), np.asarray(a_zp[row]), *inputs[3:]]
        np.testing.assert_array_equal(y[row:row + 1], run_ref(Op.QLINEAR_MATMUL, one)[0])


def test_qlinear_conv_1d_and_3d_match_the_float_convolution() -> None:
    for x_shape, w_shape in (((2, 3, 9), (4, 3, 3)), ((1, 2, 3, 4, 3), (2, 2, 2, 2, 2))):
        x, w = _q(np.uint8, *x_shape), _q(np.int8, *w_shape)
        inputs = [x, np.array(1.0, F32), np.array(0, np.uint8), w, np.array(1.0, F32),
                  np.array(0, np.int8), np.array(64.0, F32), np.array(0, np.int8)]
        (y,) = run_both(Op.QLINEAR_CONV, inputs)
        # Direct sum for the first output element.
        k = w_shape[2:]
        index: tuple[Any, ...] = (0, slice(None), *(slice(0, n) for n in k))
        window = x[index].astype(np.int64)
        acc = int((window * w[0].astype(np.int64)).sum())
        assert y.flat[0] == np.clip(np.rint(acc / 64.0), -128, 127)


# ---- cpu buffers ----------------------------------------------------------------------


def test_cpu_writes_into_out() -> None:
    out = np.empty(X.shape, np.int8)
    inputs = [X, np.array(0.1, F32), np.array(2, np.int8)]
    (y,) = run_cpu(Op.QUANTIZE_LINEAR, inputs, out=[out])
    assert y is out
    np.testing.assert_array_equal(out, run_ref(Op.QUANTIZE_LINEAR, inputs)[0])
    buffers = [np.empty(X.shape, np.uint8), np.empty((), F32), np.empty((), np.uint8)]
    got = run_cpu(Op.DYNAMIC_QUANTIZE_LINEAR, [X], out=buffers)
    assert all(g is b for g, b in zip(got, buffers, strict=True))
    assert_close(got, run_ref(Op.DYNAMIC_QUANTIZE_LINEAR, [X]))
    q = _q(np.int8, 3, 4)
    dq_out = np.empty((3, 4), F32)
    (d,) = run_cpu(Op.DEQUANTIZE_LINEAR, [q, _s(), _zp(np.int8)], out=[dq_out])
    assert d is dq_out


# ---- schemas ----------------------------------------------------------------------------


def _infer(op: Op, types: list[TensorType | None], **attrs: Any) -> list[TensorType | None]:
    schema = get_schema(op)
    return schema.infer_types(types, schema.normalize_attrs(attrs))


def _t(dtype: str, *shape: Any) -> TensorType:
    return TensorType(DType(dtype), tuple(shape))


def test_infer_output_types() -> None:
    x = _t("float32", "n", 4)
    assert _infer(Op.QUANTIZE_LINEAR, [x, _t("float32")]) == [_t("uint8", "n", 4)]
    assert _infer(Op.QUANTIZE_LINEAR, [x, _t("float32"), _t("int16")]) == [_t("int16", "n", 4)]
    assert _infer(Op.QUANTIZE_LINEAR, [x, _t("float32")], output_dtype="int8") == [
        _t("int8", "n", 4)]
    assert _infer(Op.DEQUANTIZE_LINEAR, [_t("int8", 2, 3), _t("float16", 3), _t("int8", 3)],
                  axis=-1) == [_t("float16", 2, 3)]
    assert _infer(Op.DYNAMIC_QUANTIZE_LINEAR, [x]) == [
        _t("uint8", "n", 4), _t("float32"), _t("uint8")]
    mm = [_t("uint8", 5, "m", 4), None, None, _t("int8", 4, 3), None, None, None, _t("int8")]
    assert _infer(Op.QLINEAR_MATMUL, mm) == [_t("int8", 5, "m", 3)]
    conv = [_t("uint8", 1, 4, 9, 9), None, None, _t("int8", 6, 2, 3, 3), None, None, None,
            _t("uint8")]
    assert _infer(Op.QLINEAR_CONV, conv, group=2, strides=(2, 2), pads=(1, 1, 1, 1)) == [
        _t("uint8", 1, 6, 5, 5)]


# ---- errors ------------------------------------------------------------------------------

U8 = np.array(3, np.uint8)
ERRORS: list[tuple[str, Op, list[Any], dict[str, Any], str]] = [
    ("q-output-type", Op.QUANTIZE_LINEAR, [X, np.array(0.1, F32)], {"output_dtype": "int32"},
     "output type must be one of float4_e2m1fn, float8_e4m3fn, .*, uint8, got int32"),
    ("q-type-mismatch", Op.QUANTIZE_LINEAR, [X, np.array(0.1, F32), U8],
     {"output_dtype": "int8"}, "output_dtype int8 differs from the zero point's type uint8"),
    ("q-x-type", Op.QUANTIZE_LINEAR, [np.ones(3, np.uint8), np.array(0.1, F32)], {},
     "x must be one of float16, float32, float64, int32, got uint8"),
    ("q-scale-shape", Op.QUANTIZE_LINEAR, [X, _s(5)], {},
     r"y_scale of shape \(5,\) must be a scalar or 1-D with x.shape\[1\] = 4 entries"),
    ("q-axis", Op.QUANTIZE_LINEAR, [X, _s(4)], {"axis": 3},
     "quantize_linear: axis 3 is out of range for rank 3"),
    ("q-block-negative", Op.QUANTIZE_LINEAR, [X, _s(3, 4, 2)], {"block_size": -1},
     "block_size must be >= 0"),
    ("q-block-shape", Op.QUANTIZE_LINEAR, [X, _s(3, 4, 3)], {"axis": 2, "block_size": 4},
     r"blocked y_scale must have shape \(3, 4, 2\)"),
    ("q-precision", Op.QUANTIZE_LINEAR, [X, np.array(0.1, F32)], {"precision": "int32"},
     "precision must be a float type"),
    ("dq-x-type", Op.DEQUANTIZE_LINEAR, [X, np.array(0.1, F32)], {},
     "x must be one of float4_e2m1fn, .*, uint8, got float32"),
    ("dq-zp-type", Op.DEQUANTIZE_LINEAR, [_q(np.int8, 3), np.array(0.1, F32), U8], {},
     "x_zero_point must have x's type int8, got uint8"),
    ("dq-scale-type", Op.DEQUANTIZE_LINEAR, [_q(np.int8, 3), np.array(1, np.int32)], {},
     "x_scale must be one of float16, float32, float64, got int32"),
    ("dyn-type", Op.DYNAMIC_QUANTIZE_LINEAR, [X.astype(np.float64)], {},
     "x must be one of float32, got float64"),
    ("qmm-inner", Op.QLINEAR_MATMUL, _qmm(_q(np.uint8, 4, 7), _q(np.uint8, 6, 3), np.uint8),
     {}, r"inner dimensions differ: a \(4, 7\) and b \(6, 3\)"),
    ("qmm-y-type", Op.QLINEAR_MATMUL, _qmm(_q(np.uint8, 4, 7), _q(np.uint8, 7, 3), np.int16),
     {}, "y_zero_point must be one of int8, uint8, got int16"),
    ("qmm-zp-type", Op.QLINEAR_MATMUL,
     [_q(np.uint8, 2, 2), np.array(0.1, F32), np.array(1, np.int8), *_qmm(
         _q(np.uint8, 2, 2), _q(np.uint8, 2, 2), np.uint8)[3:]], {},
     "the zero point of a must have its type uint8, got int8"),
    ("qmm-param-shape", Op.QLINEAR_MATMUL,
     _qmm(_q(np.uint8, 4, 7), _q(np.uint8, 7, 3), np.uint8, _s(4), _zp(np.uint8, 4)), {},
     r"b_zero_point of shape \(4,\) must be a scalar, a per-col vector of 3 entries"),
    ("qconv-channels", Op.QLINEAR_CONV, _qconv(_q(np.uint8, 1, 3, 5, 5),
                                               _q(np.int8, 4, 2, 3, 3)), {},
     "x channels 3 must equal w.shape"),
    ("qconv-kernel", Op.QLINEAR_CONV, _qconv(_q(np.uint8, 1, 2, 2, 2),
                                             _q(np.int8, 4, 2, 3, 3)), {},
     "the dilated kernel"),
    ("qconv-auto-pad", Op.QLINEAR_CONV, _qconv(_q(np.uint8, 1, 2, 5, 5),
                                               _q(np.int8, 4, 2, 3, 3)), {"auto_pad": "SAME"},
     "auto_pad 'SAME' is not supported"),
    ("qconv-kernel-shape", Op.QLINEAR_CONV, _qconv(_q(np.uint8, 1, 2, 5, 5),
                                                   _q(np.int8, 4, 2, 3, 3)),
     {"kernel_shape": (2, 2)}, r"kernel_shape \(2, 2\) differs from w.shape\[2:\]"),
    ("qconv-bias", Op.QLINEAR_CONV,
     [*_qconv(_q(np.uint8, 1, 2, 5, 5), _q(np.int8, 4, 2, 3, 3)), np.zeros(4, np.int64)], {},
     "B must be int32 of shape"),
    ("qconv-x-scale", Op.QLINEAR_CONV,
     [_q(np.uint8, 1, 2, 5, 5), _s(2), *_qconv(_q(np.uint8, 1, 2, 5, 5),
                                               _q(np.int8, 4, 2, 3, 3))[2:]], {},
     r"x_scale must be a scalar, got shape \(2,\)"),
    ("qconv-w-scale", Op.QLINEAR_CONV,
     [*_qconv(_q(np.uint8, 1, 2, 5, 5), _q(np.int8, 4, 2, 3, 3))[:4], _s(3),
      *_qconv(_q(np.uint8, 1, 2, 5, 5), _q(np.int8, 4, 2, 3, 3))[5:]], {},
     r"w_scale must be a scalar or have shape \(4,\)"),
]


@pytest.mark.parametrize(("op", "inputs", "attrs", "match"),
                         [pytest.param(*c[1:], id=c[0]) for c in ERRORS])
@pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
def test_typed_errors(run: Any, op: Op, inputs: list[Any], attrs: dict[str, Any],
                      match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        run(op, inputs, **attrs)
