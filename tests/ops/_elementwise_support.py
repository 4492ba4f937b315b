"""Helpers for the elementwise, memory and reduction op tests.

Kernels run directly from the kernel tables (no backend object in between),
and ONNX's own reference evaluator serves as the oracle for keel's reference
kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from keel.dtypes import DType
from keel.ops.registry import Op
from tests.ops._kernels import run_cpu as run_cpu
from tests.ops._kernels import run_ref as run_ref

# The newest opset this onnx release knows: keel follows the latest semantics.
OPSET = onnx.defs.onnx_opset_version()

ONNX_NAMES: dict[Op, str] = {
    Op.ADD: "Add", Op.SUB: "Sub", Op.MUL: "Mul", Op.DIV: "Div", Op.POW: "Pow", Op.MOD: "Mod",
    Op.MAXIMUM: "Max", Op.MINIMUM: "Min", Op.ADD_N: "Sum", Op.EQUAL: "Equal", Op.LESS: "Less",
    Op.LESS_EQUAL: "LessOrEqual", Op.GREATER: "Greater", Op.GREATER_EQUAL: "GreaterOrEqual",
    Op.AND: "And", Op.OR: "Or", Op.XOR: "Xor", Op.BITWISE_AND: "BitwiseAnd",
    Op.BITWISE_OR: "BitwiseOr", Op.BITWISE_XOR: "BitwiseXor", Op.BIT_SHIFT: "BitShift",
    Op.PRELU: "PRelu", Op.RELU: "Relu", Op.NEG: "Neg", Op.ABS: "Abs", Op.EXP: "Exp",
    Op.LOG: "Log", Op.SQRT: "Sqrt", Op.TANH: "Tanh", Op.SIGMOID: "Sigmoid",
    Op.RECIPROCAL: "Reciprocal", Op.FLOOR: "Floor", Op.CEIL: "Ceil", Op.ROUND: "Round",
    Op.SIGN: "Sign", Op.SIN: "Sin", Op.COS: "Cos", Op.TAN: "Tan", Op.ASIN: "Asin",
    Op.ACOS: "Acos", Op.ATAN: "Atan", Op.SINH: "Sinh", Op.COSH: "Cosh", Op.ASINH: "Asinh",
    Op.ACOSH: "Acosh", Op.ATANH: "Atanh", Op.ERF: "Erf", Op.NOT: "Not",
    Op.BITWISE_NOT: "BitwiseNot", Op.ISNAN: "IsNaN", Op.ISINF: "IsInf", Op.CLIP: "Clip",
    Op.LEAKY_RELU: "LeakyRelu", Op.HARD_SIGMOID: "HardSigmoid", Op.HARD_SWISH: "HardSwish",
    Op.GELU: "Gelu", Op.ELU: "Elu", Op.SELU: "Selu", Op.CELU: "Celu", Op.SOFTPLUS: "Softplus",
    Op.SOFTSIGN: "Softsign", Op.THRESHOLDED_RELU: "ThresholdedRelu", Op.SHRINK: "Shrink",
    Op.MISH: "Mish", Op.SWISH: "Swish", Op.WHERE: "Where",
    Op.SUM: "ReduceSum", Op.MEAN: "ReduceMean", Op.REDUCE_MAX: "ReduceMax",
    Op.REDUCE_MIN: "ReduceMin", Op.REDUCE_PROD: "ReduceProd", Op.REDUCE_L1: "ReduceL1",
    Op.REDUCE_L2: "ReduceL2", Op.REDUCE_LOG_SUM: "ReduceLogSum",
    Op.REDUCE_LOG_SUM_EXP: "ReduceLogSumExp", Op.REDUCE_SUM_SQUARE: "ReduceSumSquare",
    Op.ARGMAX: "ArgMax", Op.ARGMIN: "ArgMin", Op.CUMSUM: "CumSum", Op.CUMPROD: "CumProd",
    Op.CAST: "Cast", Op.IDENTITY: "Identity",
}


def onnx_run(op_type: str, inputs: Sequence[np.ndarray | None], **attrs: Any) -> np.ndarray:
    """One ONNX node run by ONNX's reference evaluator (``None`` inputs are absent).

    bfloat16 inputs run widened to float32 and a float32 result is rounded to bfloat16:
    the evaluator computes bfloat16 through ml_dtypes' ufuncs, rounding after every step
    of a composite (Gelu, Selu), where runtimes compute in float32 and round once."""
    bf16 = DType.BFLOAT16.numpy
    if op_type != "Cast" and any(x is not None and x.dtype == bf16 for x in inputs):
        wide = [None if x is None or x.dtype != bf16 else x.astype(np.float32) for x in inputs]
        result = _onnx_node(op_type, [w if w is not None else x
                                      for w, x in zip(wide, inputs, strict=True)], **attrs)
        return result.astype(bf16) if result.dtype == np.float32 else result
    return _onnx_node(op_type, inputs, **attrs)


def _onnx_node(op_type: str, inputs: Sequence[np.ndarray | None], **attrs: Any) -> np.ndarray:
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op_type, names, ["out"], **attrs)
    graph = helper.make_graph(
        [node], "single",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs, strict=False) if x is not None],
        [helper.make_tensor_value_info("out", onnx.TensorProto.UNDEFINED, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    feeds = {n: x for n, x in zip(names, inputs, strict=False) if x is not None}
    outputs = ReferenceEvaluator(model).run(None, feeds)
    assert isinstance(outputs, list)      # no output names asked: a list
    return np.asarray(outputs[0])


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-6,
                 atol: float = 1e-6, what: str = "") -> None:
    """Same dtype and shape; floats within tolerance (NaN equal), others exact."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    if expected.dtype.kind not in "OUS" and DType.from_numpy(expected.dtype).is_narrow:
        # ml_dtypes' types: compared as the float32 values they hold (exact), NaN = NaN
        actual, expected = actual.astype(np.float32), expected.astype(np.float32)
    if expected.dtype.kind == "f":
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True,
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)
