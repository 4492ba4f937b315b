"""Conformance cases of the quantization family.

quantize_linear: every output type, per tensor / per axis / blocked, float16,
float64 and int32 inputs, exact halves (round half to even), saturation and
NaN/inf, zero-size and non-contiguous input. dequantize_linear: every input
type and granularity. dynamic_quantize_linear: mixed, one-signed and all-zero
data. qlinear_matmul: both 8-bit types, batches, per-row and per-column
parameters. qlinear_conv: groups, depthwise, strides, pads, dilations,
auto_pad, per-channel weights, bias, 1-D and 3-D, pointwise. qlinear_add: mixed
8-bit types, a fused ReLU, broadcasting. Integer outputs compare exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keel.ops.registry import Op
from tests.conformance.harness import OpCase

Gen = np.random.Generator
Make = Callable[[Gen], list[np.ndarray | None]]

F32 = np.float32
_RANGES = {np.uint8: (0, 255), np.int8: (-128, 127), np.uint16: (0, 65535),
           np.int16: (-32768, 32767), np.int32: (-100000, 100000)}


def _ints(rng: Gen, shape: Sequence[int], dtype: Any) -> np.ndarray:
    lo, hi = _RANGES[dtype]
    return rng.integers(lo, hi, size=tuple(shape), endpoint=True).astype(dtype)


def _scales(rng: Gen, shape: Sequence[int], dtype: Any = F32) -> np.ndarray:
    return rng.uniform(0.01, 0.2, tuple(shape)).astype(dtype)


def _quantize(shape: Sequence[int], zp_dtype: Any | None, scale_shape: Sequence[int] = (),
              x_dtype: Any = F32, spread: float = 20.0,
              view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = rng.uniform(-spread, spread, tuple(shape))
        x = x.astype(x_dtype) if np.dtype(x_dtype).kind == "f" else np.rint(x * 100).astype(
            x_dtype)
        zp = None if zp_dtype is None else np.asarray(_ints(rng, scale_shape, zp_dtype) // 4)
        return [x if view is None else view(x), _scales(rng, scale_shape), zp]
    return make


def _quantize_cases() -> list[OpCase]:
    op = Op.QUANTIZE_LINEAR
    cases = [OpCase(f"quantize_linear-{np.dtype(dt).name}", op, _quantize((3, 4, 5), dt))
             for dt in (np.uint8, np.int8, np.uint16, np.int16)]
    cases += [
        OpCase("quantize_linear-default-uint8", op, _quantize((4, 6), None)),
        OpCase("quantize_linear-output-dtype", op, _quantize((4, 6), None),
               {"output_dtype": "int16"}),
        OpCase("quantize_linear-axis0", op, _quantize((3, 4, 5), np.int8, (3,)), {"axis": 0}),
        OpCase("quantize_linear-axis-last", op, _quantize((3, 4, 5), np.uint8, (5,)),
               {"axis": -1}),
        OpCase("quantize_linear-blocked", op, _quantize((4, 7), np.int8, (4, 3)),
               {"axis": 1, "block_size": 3}),
        OpCase("quantize_linear-blocked-axis0", op, _quantize((6, 5, 2), np.uint16, (2, 5, 2)),
               {"axis": 0, "block_size": 4}),
        OpCase("quantize_linear-float16", op, _quantize((5, 6), np.uint8, x_dtype=np.float16)),
        OpCase("quantize_linear-float64", op, _quantize((5, 6), np.int16, x_dtype=np.float64)),
        OpCase("quantize_linear-int32", op, _quantize((5, 6), np.int8, x_dtype=np.int32)),
        OpCase("quantize_linear-precision64", op, _quantize((5, 6), np.int8),
               {"precision": "float64"}),
        OpCase("quantize_linear-saturate", op, _quantize((5, 6), np.int8, spread=1e4)),
        OpCase("quantize_linear-halves", op, lambda rng: [
            (rng.integers(-40, 40, (6, 5)) / 4).astype(F32), np.array(0.5, F32),
            np.array(3, np.int8)]),
        OpCase("quantize_linear-special", op, lambda rng: [
            np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30], F32),
            np.array(0.1, F32), np.array(128, np.uint8)]),
        OpCase("quantize_linear-empty", op, _quantize((0, 4), np.uint8)),
        OpCase("quantize_linear-nc", op, _quantize((5, 4, 3), np.int8, (4,),
                                                   view=lambda x: x.transpose(2, 1, 0)),
               {"axis": 1}),
    ]
    return cases


def _dequantize(shape: Sequence[int], x_dtype: Any, scale_shape: Sequence[int] = (),
                zero_point: bool = True, scale_dtype: Any = F32,
                view: Callable[[np.ndarray], np.ndarray] | None = None) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        x = _ints(rng, shape, x_dtype)
        zp = _ints(rng, scale_shape, x_dtype) if zero_point else None
        return [x if view is None else view(x), _scales(rng, scale_shape, scale_dtype), zp]
    return make


def _dequantize_cases() -> list[OpCase]:
    op = Op.DEQUANTIZE_LINEAR
    cases = [OpCase(f"dequantize_linear-{np.dtype(dt).name}", op, _dequantize((3, 4, 5), dt))
             for dt in (np.uint8, np.int8, np.uint16, np.int16)]
    cases += [
        OpCase("dequantize_linear-int32", op, _dequantize((4, 5), np.int32, zero_point=False)),
        OpCase("dequantize_linear-no-zero-point", op,
               _dequantize((4, 5), np.uint8, zero_point=False)),
        OpCase("dequantize_linear-axis0", op, _dequantize((3, 4, 5), np.int8, (3,)),
               {"axis": 0}),
        OpCase("dequantize_linear-axis-last", op, _dequantize((3, 4, 5), np.uint8, (5,)),
               {"axis": -1}),
        OpCase("dequantize_linear-blocked", op, _dequantize((4, 7), np.int8, (4, 2)),
               {"axis": 1, "block_size": 4}),
        OpCase("dequantize_linear-float16-scale", op,
               _dequantize((4, 5), np.uint8, scale_dtype=np.float16), rtol=5e-3, atol=5e-3),
        OpCase("dequantize_linear-float64-scale", op,
               _dequantize((4, 5), np.int16, scale_dtype=np.float64), rtol=1e-12, atol=1e-12),
        OpCase("dequantize_linear-output-float16", op, _dequantize((4, 5), np.int8),
               {"output_dtype": "float16"}, rtol=5e-3, atol=5e-3),
        OpCase("dequantize_linear-empty", op, _dequantize((2, 0), np.uint8)),
        OpCase("dequantize_linear-nc", op, _dequantize((5, 3, 4), np.int8, (3,),
                                                       view=lambda x: x.transpose(2, 1, 0)),
               {"axis": 1}),
    ]
    return cases


def _dynamic_cases() -> list[OpCase]:
    op = Op.DYNAMIC_QUANTIZE_LINEAR
    return [
        OpCase("dynamic_quantize_linear-mixed", op,
               lambda rng: [rng.uniform(-3, 5, (4, 6)).astype(F32)]),
        OpCase("dynamic_quantize_linear-positive", op,
               lambda rng: [rng.uniform(1, 5, (3, 7)).astype(F32)]),
        OpCase("dynamic_quantize_linear-negative", op,
               lambda rng: [rng.uniform(-5, -1, (8,)).astype(F32)]),
        OpCase("dynamic_quantize_linear-zeros", op, lambda rng: [np.zeros((3, 3), F32)]),
        OpCase("dynamic_quantize_linear-empty", op, lambda rng: [np.zeros((0, 3), F32)]),
        OpCase("dynamic_quantize_linear-nc", op,
               lambda rng: [rng.uniform(-2, 2, (5, 4)).astype(F32).T]),
    ]


def _qmm(a_shape: Sequence[int], b_shape: Sequence[int], a_dt: Any, b_dt: Any, y_dt: Any,
         a_param: Sequence[int] = (), b_param: Sequence[int] = (),
         y_param: Sequence[int] = ()) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        return [_ints(rng, a_shape, a_dt), _scales(rng, a_param), _ints(rng, a_param, a_dt),
                _ints(rng, b_shape, b_dt), _scales(rng, b_param), _ints(rng, b_param, b_dt),
                rng.uniform(5, 50, tuple(y_param)).astype(F32), _ints(rng, y_param, y_dt)]
    return make


def _qlinear_matmul_cases() -> list[OpCase]:
    op = Op.QLINEAR_MATMUL
    u8, i8 = np.uint8, np.int8
    return [
        OpCase("qlinear_matmul-u8", op, _qmm((4, 6), (6, 5), u8, u8, u8)),
        OpCase("qlinear_matmul-i8", op, _qmm((4, 6), (6, 5), i8, i8, i8)),
        OpCase("qlinear_matmul-mixed", op, _qmm((4, 6), (6, 5), u8, i8, i8)),
        OpCase("qlinear_matmul-batched", op, _qmm((2, 3, 4, 6), (3, 6, 5), i8, u8, u8)),
        OpCase("qlinear_matmul-per-column", op, _qmm((4, 6), (6, 5), u8, i8, u8,
                                                     b_param=(5,))),
        OpCase("qlinear_matmul-per-row", op, _qmm((4, 6), (6, 5), u8, i8, u8, a_param=(4,),
                                                  y_param=(4,))),
        OpCase("qlinear_matmul-nd-params", op, _qmm((2, 4, 6), (2, 6, 3), u8, u8, u8,
                                                    a_param=(2, 4, 1), b_param=(2, 1, 3))),
        OpCase("qlinear_matmul-vector", op, _qmm((6,), (6, 5), u8, u8, u8)),
        OpCase("qlinear_matmul-empty", op, _qmm((0, 6), (6, 5), u8, u8, u8)),
    ]


def _qconv(x_shape: Sequence[int], w_shape: Sequence[int], x_dt: Any = np.uint8,
           w_dt: Any = np.int8, y_dt: Any = np.uint8, per_channel: bool = False,
           bias: bool = False) -> Make:
    def make(rng: Gen) -> list[np.ndarray | None]:
        m = w_shape[0]
        w_param = (m,) if per_channel else ()
        inputs: list[np.ndarray | None] = [
            _ints(rng, x_shape, x_dt), np.array(0.02, F32), _ints(rng, (), x_dt),
            _ints(rng, w_shape, w_dt), _scales(rng, w_param),
            np.asarray(_ints(rng, w_param, w_dt) // 16, dtype=w_dt),
            np.array(rng.uniform(2, 10), F32), _ints(rng, (), y_dt)]
        if bias:
            inputs.append(rng.integers(-2000, 2000, (m,)).astype(np.int32))
        return inputs
    return make


def _qlinear_conv_cases() -> list[OpCase]:
    op = Op.QLINEAR_CONV
    return [
        OpCase("qlinear_conv-basic", op, _qconv((2, 3, 7, 6), (4, 3, 3, 3))),
        OpCase("qlinear_conv-i8", op, _qconv((1, 3, 5, 5), (4, 3, 3, 3), np.int8, np.int8,
                                             np.int8, bias=True)),
        OpCase("qlinear_conv-groups", op, _qconv((2, 4, 6, 6), (6, 2, 3, 3), per_channel=True,
                                                 bias=True), {"group": 2}),
        OpCase("qlinear_conv-depthwise", op, _qconv((1, 4, 6, 5), (4, 1, 3, 3)),
               {"group": 4, "pads": (1, 1, 1, 1)}),
        OpCase("qlinear_conv-strided", op, _qconv((1, 2, 9, 8), (3, 2, 3, 2)),
               {"strides": (2, 3), "pads": (1, 0, 2, 1), "dilations": (1, 2)}),
        OpCase("qlinear_conv-same-lower", op, _qconv((1, 2, 7, 7), (3, 2, 4, 4)),
               {"auto_pad": "SAME_LOWER", "strides": (2, 2)}),
        OpCase("qlinear_conv-same-upper", op, _qconv((1, 2, 6, 5), (3, 2, 3, 2)),
               {"auto_pad": "SAME_UPPER"}),
        OpCase("qlinear_conv-valid", op, _qconv((1, 2, 6, 5), (3, 2, 3, 2)),
               {"auto_pad": "VALID", "kernel_shape": (3, 2)}),
        OpCase("qlinear_conv-1d", op, _qconv((2, 3, 11), (4, 3, 3), per_channel=True),
               {"pads": (1, 1)}),
        OpCase("qlinear_conv-3d", op, _qconv((1, 2, 4, 5, 4), (3, 2, 2, 3, 2), bias=True)),
        OpCase("qlinear_conv-pointwise", op, _qconv((2, 8, 5, 5), (6, 8, 1, 1),
                                                    per_channel=True)),
        OpCase("qlinear_conv-empty-batch", op, _qconv((0, 2, 5, 5), (3, 2, 3, 3))),
    ]


def _qgemm(a_shape: Sequence[int], b_shape: Sequence[int], b_dtype: Any, bias: bool,
           out: Any | None, per_column: int = 0) -> Make:
    """QGemm inputs: uint8 A, ``b_dtype`` B, [int32 C], [y_scale, y_zero_point of ``out``]."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        n_params = (per_column,) if per_column else ()
        inputs: list[np.ndarray | None] = [
            _ints(rng, a_shape, np.uint8), _scales(rng, ()), _ints(rng, (), np.uint8),
            _ints(rng, b_shape, b_dtype), _scales(rng, n_params),
            np.zeros(n_params, b_dtype)]
        inputs.append(rng.integers(-2000, 2000, per_column or 1).astype(np.int32)
                      if bias else None)
        if out is not None:
            inputs += [np.asarray(rng.uniform(20.0, 60.0), F32), _ints(rng, (), out)]
        return inputs
    return make


def _qgemm_cases() -> list[OpCase]:
    op = Op.QGEMM
    u8, i8 = np.uint8, np.int8
    return [
        OpCase("qgemm-u8-out", op, _qgemm((4, 6), (6, 5), i8, True, u8, per_column=5)),
        OpCase("qgemm-i8-out-trans-b", op, _qgemm((3, 7), (5, 7), i8, False, i8),
               {"trans_b": True}),
        OpCase("qgemm-float-out", op, _qgemm((4, 6), (6, 5), u8, True, None, per_column=5),
               {"alpha": 0.5}, rtol=1e-5, atol=1e-4),
        OpCase("qgemm-trans-a", op, _qgemm((6, 4), (6, 5), i8, False, u8), {"trans_a": True}),
    ]


def _qlinear_add(a_shape: Sequence[int], b_shape: Sequence[int], a_dtype: Any, b_dtype: Any,
                 out: Any) -> Make:
    """QLinearAdd inputs: a and b with their per-tensor parameters, then y's."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        def zero_point(dtype: Any) -> np.ndarray:
            return np.asarray(_ints(rng, (), dtype) // 4)

        return [_ints(rng, a_shape, a_dtype), _scales(rng, ()), zero_point(a_dtype),
                _ints(rng, b_shape, b_dtype), _scales(rng, ()), zero_point(b_dtype),
                _scales(rng, ()), zero_point(out)]
    return make


def _qlinear_add_cases() -> list[OpCase]:
    op = Op.QLINEAR_ADD
    u8, i8 = np.uint8, np.int8
    return [
        OpCase("qlinear_add-u8", op, _qlinear_add((2, 3, 5, 7), (2, 3, 5, 7), u8, u8, u8)),
        OpCase("qlinear_add-mixed-relu", op, _qlinear_add((4, 33), (4, 33), i8, u8, i8),
               {"activation": "relu"}),
        OpCase("qlinear_add-broadcast", op, _qlinear_add((2, 3, 4), (3, 1), u8, i8, u8)),
    ]


def _qlinear_global_avg_pool(shape: Sequence[int], dtype: Any) -> Make:
    """QLinearGlobalAveragePool inputs: x and its per-tensor parameters, then y's."""
    def make(rng: Gen) -> list[np.ndarray | None]:
        return [_ints(rng, shape, dtype), _scales(rng, ()), np.asarray(_ints(rng, (), dtype) // 4),
                _scales(rng, ()), np.asarray(_ints(rng, (), dtype) // 4)]
    return make


def _qlinear_global_avg_pool_cases() -> list[OpCase]:
    op = Op.QLINEAR_GLOBAL_AVG_POOL
    return [
        OpCase("qlinear_global_avg_pool-u8", op, _qlinear_global_avg_pool((2, 5, 7, 7), np.uint8)),
        OpCase("qlinear_global_avg_pool-i8-1d", op,
               _qlinear_global_avg_pool((3, 300, 11), np.int8)),
    ]


CASES: list[OpCase] = [*_quantize_cases(), *_dequantize_cases(), *_dynamic_cases(),
                       *_qlinear_matmul_cases(), *_qlinear_conv_cases(), *_qgemm_cases(),
                       *_qlinear_add_cases(), *_qlinear_global_avg_pool_cases()]
