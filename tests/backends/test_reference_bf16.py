"""bfloat16 as a compute dtype of the reference backend and the op schemas.

Every conformance case whose inputs are float32 runs again with those inputs
rounded to bfloat16. Where ONNX's schema lets the op take bfloat16, keel's must
too, and the result must be the float64 result on the same (bfloat16) values,
rounded to bfloat16, within one bfloat16 step (the reference computes in float32
and rounds once, so a tie may round the other way). onnxruntime's CPU provider has
bfloat16 kernels for LayerNormalization and data movement only (its Add, MatMul,
Softmax, Conv, ... are NOT_IMPLEMENTED): those are compared with it at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx.defs
import pytest

from keel.backends.registry import builtin_registry
from keel.dtypes import DType
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op
from tests.conformance.harness import OpCase, case_inputs, collect_cases

REFERENCE = builtin_registry().instance("reference")
BF16 = DType.BFLOAT16.numpy
# One bfloat16 step (8 significant bits) relative to the value.
STEP = 2.0 ** -7

# Ops whose float32 inputs are not all the same tensor type (Resize's scales stay float32).
_MIXED = frozenset({Op.RESIZE, Op.BITCAST})
# Ops ONNX lets take bfloat16 that keel does not yet: (op, why).
_NOT_YET = {
    Op.LINEAR_ATTENTION: "its float16/32/64 kernels only",
    Op.CAUSAL_CONV_WITH_STATE: "its float16/32/64 kernels only",
    Op.QUANTIZE_LINEAR: "the reference quantizes float16/32/64 inputs",
}
# Ops keel lets take bfloat16 that ONNX does not: (op, why).
_KEEL_ALSO = {
    Op.SEQUENCE_CONSTRUCT: "a keel sequence holds tensors of any dtype",
    Op.NON_MAX_SUPPRESSION: "keel's schema leaves the box dtype to the kernel",
}
# Ops that convert or reinterpret rather than compute: their own tests cover bfloat16.
_CONVERSIONS = frozenset({Op.CAST, Op.BITCAST, Op.QUANTIZE_LINEAR, Op.DEQUANTIZE_LINEAR})


def _onnx_takes_bf16() -> dict[str, bool]:
    """ONNX op name without underscores, lower case -> whether its newest schema takes
    bfloat16."""
    found = {}
    for schema in onnx.defs.get_all_schemas():
        if schema.domain == "":
            found[schema.name.lower()] = any("(bfloat16)" in t for c in schema.type_constraints
                                            for t in c.allowed_type_strs)
    return found


ONNX_BF16 = _onnx_takes_bf16()


def _as(xs: list[Any], dtype: Any) -> list[Any]:
    return [x.astype(BF16).astype(dtype) if isinstance(x, np.ndarray) and x.dtype == np.float32
            else x for x in xs]


def _float32_cases() -> list[OpCase]:
    cases = []
    for case in collect_cases():
        xs = case_inputs(case)
        first = xs[0] if xs else None
        if (isinstance(first, np.ndarray) and first.dtype == np.float32
                and case.op not in _MIXED):
            cases.append(case)
    return cases


CASES = _float32_cases()


def _onnx_verdict(op: Op) -> bool | None:
    return ONNX_BF16.get(op.value.replace("_", ""))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES
                                  if _onnx_verdict(c.op) is not None])
def test_schema_takes_bfloat16_where_onnx_does(case: OpCase) -> None:
    try:
        REFERENCE.run(case.op, _as(case_inputs(case), BF16), None, case.attrs)
        takes = True
    except (InvalidArgumentError, UnsupportedOperationError):
        takes = False
    expected = (bool(_onnx_verdict(case.op)) and case.op not in _NOT_YET) \
        or case.op in _KEEL_ALSO
    assert takes == expected, f"{case.op.value}: keel takes bfloat16 {takes}, ONNX {expected}"


def _bf16_cases() -> list[pytest.param]:  # type: ignore[valid-type]
    params = []
    for case in CASES:
        try:
            REFERENCE.run(case.op, _as(case_inputs(case), BF16), None, case.attrs)
        except (InvalidArgumentError, UnsupportedOperationError):
            continue                          # the op does not take bfloat16 (tested above)
        if case.op not in _CONVERSIONS:
            params.append(pytest.param(case, id=case.id))
    return params


@pytest.mark.parametrize("case", _bf16_cases())
def test_bfloat16_is_float64_rounded_once(case: OpCase) -> None:
    xs = case_inputs(case)
    got = REFERENCE.run(case.op, _as(xs, BF16), None, case.attrs)
    wide = REFERENCE.run(case.op, _as(xs, np.float64), None, case.attrs)
    assert len(got) == len(wide)
    for i, (g, w) in enumerate(zip(got, wide, strict=True)):
        if not isinstance(g, np.ndarray):
            continue
        assert g.shape == w.shape, f"{case.id} output {i}"
        if w.dtype != np.float64:                   # an index, a mask: the same
            np.testing.assert_array_equal(g, w, err_msg=f"{case.id} output {i}")
            continue
        assert g.dtype in (BF16, np.float32, np.float64), f"{case.id} output {i} is {g.dtype}"
        want = w.astype(g.dtype).astype(np.float64)
        np.testing.assert_allclose(g.astype(np.float64), want, rtol=STEP, atol=1e-30,
                                   equal_nan=True, err_msg=f"{case.id} output {i}")


def test_bfloat16_outputs_follow_the_schema() -> None:
    x = np.arange(-3, 3, dtype=np.float32).reshape(2, 3).astype(BF16)
    scale, bias = np.ones(3, BF16), np.zeros(3, BF16)
    y, mean, inv = REFERENCE.run(Op.LAYER_NORM, [x, scale, bias], None, {})
    assert (y.dtype, mean.dtype, inv.dtype) == (BF16, np.float32, np.float32)
    assert REFERENCE.run(Op.ARGMAX, [x], None, {})[0].dtype == np.int64
    assert REFERENCE.run(Op.CAST, [x], None, {"to": "float32"})[0].dtype == np.float32
    out = np.empty((2, 3), BF16)
    REFERENCE.run(Op.EXP, [x], [out])
    np.testing.assert_array_equal(out, np.exp(x.astype(np.float64)).astype(BF16))


def test_bfloat16_rounds_to_nearest_even() -> None:
    # 1 + 2**-8 is halfway between two bfloat16 values: nearest even is 1.0; a hair above
    # rounds up.
    one = np.array([1.0], BF16)
    half_step = np.array([2.0 ** -8], np.float32).astype(BF16)
    assert float(REFERENCE.run(Op.ADD, [one, half_step])[0][0]) == 1.0
    above = np.array([2.0 ** -8 + 2.0 ** -15], np.float32).astype(BF16)
    assert float(REFERENCE.run(Op.ADD, [one, above])[0][0]) == 1.0 + 2.0 ** -7


# ---- against onnxruntime, where its CPU provider has a bfloat16 kernel ----------------------
def _ort_bf16(op_type: str, inputs: list[np.ndarray], consts: dict[str, np.ndarray],
              **attrs: Any) -> np.ndarray:
    """One ONNX node on onnxruntime's CPU provider with bfloat16 inputs (fed as their bit
    patterns: its Python binding has no NumPy bfloat16), read back through an exact Cast to
    float32."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    names = [f"x{i}" for i in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(op_type, [*names, *consts], ["y"], **attrs),
         helper.make_node("Cast", ["y"], ["out"], to=TensorProto.FLOAT)], "bf16",
        [helper.make_tensor_value_info(n, TensorProto.BFLOAT16, x.shape)
         for n, x in zip(names, inputs, strict=True)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    feeds = {n: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(np.uint16), 16)
             for n, x in zip(names, inputs, strict=True)}
    return np.asarray(session.run_with_ort_values(["out"], feeds)[0].numpy())


def _bf16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(BF16)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("shape", [(2, 8), (3, 5, 16), (4, 100)])
def test_layer_norm_matches_onnxruntime_in_bfloat16(backend: str, shape: tuple[int, ...]
                                                    ) -> None:
    rng = np.random.default_rng(len(shape))
    x, scale, bias = _bf16(rng, *shape), _bf16(rng, shape[-1]), _bf16(rng, shape[-1])
    got = builtin_registry().instance(backend).run(Op.LAYER_NORM, [x, scale, bias])[0]
    want = _ort_bf16("LayerNormalization", [x, scale, bias], {})
    assert got.dtype == BF16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=STEP, atol=STEP)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_data_movement_matches_onnxruntime_in_bfloat16_exactly(backend: str) -> None:
    rng = np.random.default_rng(9)
    run = builtin_registry().instance(backend).run
    x, y = _bf16(rng, 3, 4), _bf16(rng, 2, 4)
    index = np.array([2, 0], np.int64)
    cases = [
        (run(Op.TRANSPOSE, [x], attrs={"perm": (1, 0)}), _ort_bf16("Transpose", [x], {})),
        (run(Op.CONCAT, [x, y], attrs={"axis": 0}), _ort_bf16("Concat", [x, y], {}, axis=0)),
        (run(Op.GATHER, [x, index]), _ort_bf16("Gather", [x], {"i": index})),
        (run(Op.RESHAPE, [x, np.array([4, 3], np.int64)]),
         _ort_bf16("Reshape", [x], {"s": np.array([4, 3], np.int64)})),
    ]
    for got, want in cases:
        assert got[0].dtype == BF16
        np.testing.assert_array_equal(got[0].astype(np.float32), want)
