"""The shape family: schemas, reference kernels against ONNX's oracle, cpu kernels."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest

from keel.errors import InvalidArgumentError
from keel.ops.registry import Op, OpGroup
from keel.ops.schema import get_schema
from tests.ops._shape_indexing_support import (
    assert_same,
    i64,
    infer,
    onnx_run,
    run_both,
    run_cpu,
    run_ref,
    ttype,
)

LATEST = onnx.defs.onnx_opset_version()   # SpaceToDepth has mode only in the newest
RNG = np.random.default_rng(7)
X234 = RNG.standard_normal((2, 3, 4)).astype(np.float32)
I34 = RNG.integers(-9, 9, size=(3, 4)).astype(np.int64)
NCHW = RNG.standard_normal((2, 8, 3, 2)).astype(np.float32)


# ---- against onnx.reference ------------------------------------------------------

# (id, keel op, inputs, keel attrs, ONNX op_type, ONNX inputs (None: same), ONNX attrs)
ONNX_CASES: list[tuple[str, Op, list[Any], dict[str, Any], str, list[Any] | None,
                       dict[str, Any]]] = [
    ("reshape", Op.RESHAPE, [X234, i64(0, -1)], {}, "Reshape", None, {}),
    ("reshape-allowzero", Op.RESHAPE, [np.zeros((0, 3), np.float32), i64(3, 0)],
     {"allowzero": 1}, "Reshape", None, {"allowzero": 1}),
    ("unsqueeze", Op.EXPAND_DIMS, [X234, i64(-1, 1)], {}, "Unsqueeze", None, {}),
    ("squeeze", Op.SQUEEZE, [np.zeros((1, 3, 1), np.int64), i64(-1)], {}, "Squeeze", None, {}),
    ("squeeze-all", Op.SQUEEZE, [np.ones((1, 3, 1), np.float16)], {}, "Squeeze", None, {}),
    ("transpose", Op.TRANSPOSE, [X234], {"perm": (2, 0, 1)}, "Transpose", None,
     {"perm": [2, 0, 1]}),
    ("transpose-default", Op.TRANSPOSE, [I34], {}, "Transpose", None, {}),
    ("flatten", Op.FLATTEN, [X234], {"axis": -1}, "Flatten", None, {"axis": -1}),
    ("flatten-0", Op.FLATTEN, [X234], {"axis": 0}, "Flatten", None, {"axis": 0}),
    ("expand", Op.EXPAND, [np.arange(3, dtype=np.float32).reshape(3, 1), i64(2, 1, 4)], {},
     "Expand", None, {}),
    ("shape", Op.SHAPE, [X234], {"start": -2}, "Shape", None, {"start": -2}),
    ("size", Op.SIZE, [X234], {}, "Size", None, {}),
    ("concat", Op.CONCAT, [I34, I34[:, :1]], {"axis": -1}, "Concat", None, {"axis": -1}),
    ("split", Op.SPLIT, [X234, i64(1, 3)], {"axis": 2}, "Split", None, {"axis": 2}),
    ("split-num", Op.SPLIT, [np.arange(7.0)], {"num_outputs": 3}, "Split", None,
     {"num_outputs": 3}),
    ("tile", Op.TILE, [I34, i64(2, 1)], {}, "Tile", None, {}),
    ("pad-constant", Op.PAD, [I34, i64(1, 0, 0, 2), np.array(5, np.int64)], {}, "Pad", None,
     {"mode": "constant"}),
    ("pad-reflect", Op.PAD, [X234, i64(1, 2, 0, 1)], {"mode": "reflect", "axes": (1, 2)}, "Pad",
     [X234, i64(1, 2, 0, 1), None, i64(1, 2)], {"mode": "reflect"}),
    ("pad-edge-axes", Op.PAD, [X234, i64(2, 3), None, i64(-1)], {"mode": "edge"}, "Pad", None,
     {"mode": "edge"}),
    ("pad-wrap", Op.PAD, [I34, i64(2, 3, 1, 4)], {"mode": "wrap"}, "Pad", None,
     {"mode": "wrap"}),
    ("depth_to_space-dcr", Op.DEPTH_TO_SPACE, [NCHW], {"blocksize": 2}, "DepthToSpace", None,
     {"blocksize": 2}),
    ("depth_to_space-crd", Op.DEPTH_TO_SPACE, [NCHW], {"blocksize": 2, "mode": "CRD"},
     "DepthToSpace", None, {"blocksize": 2, "mode": "CRD"}),
    ("space_to_depth", Op.SPACE_TO_DEPTH, [NCHW.reshape(2, 2, 6, 4)], {"blocksize": 2},
     "SpaceToDepth", None, {"blocksize": 2}),
    ("space_to_depth-crd", Op.SPACE_TO_DEPTH, [NCHW.reshape(2, 2, 6, 4)],
     {"blocksize": 2, "mode": "CRD"}, "SpaceToDepth", None, {"blocksize": 2, "mode": "CRD"}),
    ("constant_of_shape", Op.CONSTANT_OF_SHAPE, [i64(2, 3)],
     {"value": np.array([3], np.int32)}, "ConstantOfShape", None,
     {"value": np.array([3], np.int32)}),
    ("constant_of_shape-default", Op.CONSTANT_OF_SHAPE, [i64(4)], {}, "ConstantOfShape", None,
     {}),
    ("range-int", Op.RANGE, [np.array(10, np.int64), np.array(-3, np.int64),
                             np.array(-4, np.int64)], {}, "Range", None, {}),
    ("range-float", Op.RANGE, [np.array(0.5, np.float32), np.array(3, np.float32),
                               np.array(0.75, np.float32)], {}, "Range", None, {}),
    ("eye_like", Op.EYE_LIKE, [I34], {"k": 1, "dtype": "float32"}, "EyeLike", None,
     {"k": 1, "dtype": 1}),
    ("trilu-upper", Op.TRILU, [X234, i64(1)], {}, "Trilu", None, {}),
    ("trilu-lower", Op.TRILU, [X234], {"upper": 0}, "Trilu", None, {"upper": 0}),
]


@pytest.mark.parametrize("case", ONNX_CASES, ids=[c[0] for c in ONNX_CASES])
def test_reference_and_cpu_match_onnx(case: tuple[Any, ...]) -> None:
    _, op, inputs, attrs, op_type, onnx_inputs, onnx_attrs = case
    expected = onnx_run(op_type, inputs if onnx_inputs is None else onnx_inputs,
                        n_outputs=len(run_ref(op, inputs, **attrs)), opset=LATEST,
                        **onnx_attrs)
    assert_same(run_both(op, inputs, **attrs), expected)


# ---- seed 001 semantics ------------------------------------------------------------

def test_seed_reshape_takes_the_shape_as_an_attribute() -> None:
    x = np.arange(24.0).reshape(2, 3, 4)
    (y,) = run_both(Op.RESHAPE, [x], shape=(4, -1))
    np.testing.assert_array_equal(y, x.reshape(4, 6))


def test_seed_expand_dims_inserts_one_axis() -> None:
    x = np.arange(6.0).reshape(2, 3)
    assert run_both(Op.EXPAND_DIMS, [x], axis=1)[0].shape == (2, 1, 3)
    assert run_both(Op.EXPAND_DIMS, [x], axis=-1)[0].shape == (2, 3, 1)


def test_seed_squeeze_drops_every_size1_axis_by_default() -> None:
    x = np.arange(3.0).reshape(1, 3, 1)
    (y,) = run_both(Op.SQUEEZE, [x])
    np.testing.assert_array_equal(y, [0.0, 1.0, 2.0])


def test_seed_transpose_reverses_axes_by_default() -> None:
    (y,) = run_both(Op.TRANSPOSE, [X234])
    np.testing.assert_array_equal(y, X234.T)


def test_negative_pads_crop_before_padding() -> None:
    x = np.arange(4.0)
    # onnxruntime's results for these pads (crop first, then pad).
    assert run_both(Op.PAD, [x, i64(2, -2)], mode="edge")[0].tolist() == [0, 0, 0, 1]
    assert run_both(Op.PAD, [x, i64(2, -2)], mode="wrap")[0].tolist() == [0, 1, 0, 1]
    assert run_both(Op.PAD, [x, i64(-1, 2)], mode="reflect")[0].tolist() == [1, 2, 3, 2, 1]


def test_wrap_pad_longer_than_the_axis_repeats_it() -> None:
    x = np.arange(4.0)
    assert run_both(Op.PAD, [x, i64(5, 0)], mode="wrap")[0].tolist() == [3, 0, 1, 2, 3, 0, 1,
                                                                         2, 3]


def test_split_uses_the_output_count_when_nothing_else_is_given() -> None:
    x = np.arange(6.0)
    out = [np.empty(2), np.empty(2), np.empty(2)]
    assert [p.tolist() for p in run_cpu(Op.SPLIT, [x], out=out)] == [[0, 1], [2, 3], [4, 5]]


# ---- the cpu kernels: views, out=, non-contiguous inputs --------------------------

@pytest.mark.parametrize(("op", "attrs"), [
    (Op.RESHAPE, {"shape": (6, 4)}), (Op.EXPAND_DIMS, {"axis": 0}), (Op.SQUEEZE, {}),
    (Op.FLATTEN, {"axis": 2}),
])
def test_cpu_reshape_like_ops_return_views(op: Op, attrs: dict[str, Any]) -> None:
    x = X234.reshape(2, 3, 4, 1) if op is Op.SQUEEZE else X234
    (y,) = run_cpu(op, [x], **attrs)
    assert np.shares_memory(x, y)
    np.testing.assert_array_equal(y, run_ref(op, [x], **attrs)[0])


def test_cpu_kernels_write_into_out() -> None:
    out = np.empty((3, 5), np.int64)
    (y,) = run_cpu(Op.CONCAT, [I34, I34[:, :1]], out=[out], axis=1)
    assert y is out and (out == np.concatenate([I34, I34[:, :1]], axis=1)).all()
    out_t = np.empty((4, 3), np.int64)
    assert run_cpu(Op.TRANSPOSE, [I34], out=[out_t])[0] is out_t
    np.testing.assert_array_equal(out_t, I34.T)
    out_tile = np.empty((6, 8), np.int64)
    run_cpu(Op.TILE, [I34, i64(2, 2)], out=[out_tile])
    np.testing.assert_array_equal(out_tile, np.tile(I34, (2, 2)))


def test_cpu_out_with_the_wrong_shape_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match=r"output 0 has shape \(2, 2\)"):
        run_cpu(Op.TRANSPOSE, [I34], out=[np.empty((2, 2), np.int64)])


def test_cpu_tile_into_a_non_contiguous_out() -> None:
    buffer = np.zeros((6, 16), np.int64)
    run_cpu(Op.TILE, [I34, i64(2, 2)], out=[buffer[:, ::2]])
    np.testing.assert_array_equal(buffer[:, ::2], np.tile(I34, (2, 2)))


@pytest.mark.parametrize(("op", "extra", "attrs"), [
    (Op.RESHAPE, [i64(-1)], {}), (Op.TRANSPOSE, [], {"perm": (1, 0)}),
    (Op.PAD, [i64(1, 2, 3, 1)], {"mode": "reflect"}), (Op.TILE, [i64(2, 3)], {}),
    (Op.EXPAND, [i64(2, 1, 1)], {}), (Op.TRILU, [], {}),
    (Op.SPLIT, [i64(1, 2)], {"axis": 1}),
])
def test_cpu_handles_non_contiguous_inputs(op: Op, extra: list[Any],
                                           attrs: dict[str, Any]) -> None:
    x = np.arange(40.0).reshape(5, 8)[1:, ::3]          # (4, 3), strided
    assert not x.flags.c_contiguous
    for a, e in zip(run_cpu(op, [x, *extra], **attrs), run_ref(op, [x.copy(), *extra], **attrs),
                    strict=True):
        np.testing.assert_array_equal(a, e)


# ---- schemas ----------------------------------------------------------------------

def test_reshape_like_ops_are_marked_in_place_and_value_inputs_declared() -> None:
    for op in (Op.RESHAPE, Op.EXPAND_DIMS, Op.SQUEEZE, Op.FLATTEN):
        assert get_schema(op).inplace == ((0, 0),)
    assert get_schema(Op.TRANSPOSE).inplace == ()
    assert get_schema(Op.RESHAPE).value_inputs == (1,)
    assert get_schema(Op.PAD).value_inputs == (1, 3)
    assert get_schema(Op.RANGE).value_inputs == (0, 1, 2)
    assert get_schema(Op.SPLIT).max_outputs > 1000


def test_every_shape_op_has_a_schema_and_kernels() -> None:
    from keel.backends.cpu.kernels import load as cpu
    from keel.backends.reference.kernels import load as ref
    for op in OpGroup.SHAPE - {Op.RESIZE}:
        get_schema(op)
        assert op in ref() and op in cpu(), op


def test_infer_with_constant_shape_inputs() -> None:
    x = ttype("float32", ("batch", 3, 4))
    assert infer(Op.RESHAPE, [x, ttype("int64", (2,))], [None, i64(0, -1)])[0] == \
        ttype("float32", ("batch", 12))
    assert infer(Op.RESHAPE, [x, ttype("int64", (3,))], [None, None])[0] == \
        ttype("float32", (None, None, None))
    assert infer(Op.EXPAND, [x, ttype("int64", (4,))], [None, i64(2, 1, 1, 1)])[0] == \
        ttype("float32", (2, "batch", 3, 4))
    assert infer(Op.SQUEEZE, [ttype("float32", (1, "n", 1))])[0] == ttype("float32", None)
    assert infer(Op.CONCAT, [x, ttype("float32", ("batch", 5, 4))], axis=1)[0] == \
        ttype("float32", ("batch", 8, 4))
    assert infer(Op.SHAPE, [x], start=1)[0] == ttype("int64", (2,))
    assert infer(Op.PAD, [x, ttype("int64", (2,))], [None, i64(1, 2)], axes=(-1,))[0] == \
        ttype("float32", ("batch", 3, 7))


def test_infer_split_and_range() -> None:
    out = infer(Op.SPLIT, [ttype("float16", (4, 7))], axis=1, num_outputs=3)
    assert [t.shape for t in out if t is not None] == [(4, 3), (4, 3), (4, 1)]
    scalars = [ttype("int64", ())] * 3
    assert infer(Op.RANGE, scalars, [np.array(0), np.array(10), np.array(3)])[0] == \
        ttype("int64", (4,))
    assert infer(Op.RANGE, scalars)[0] == ttype("int64", (None,))
    assert infer(Op.CONSTANT_OF_SHAPE, [ttype("int64", (2,))], [i64(2, 5)],
                 value=np.array([1], np.int32))[0] == ttype("int32", (2, 5))


# ---- typed errors ------------------------------------------------------------------

ERRORS: list[tuple[str, Op, list[Any], dict[str, Any], str]] = [
    ("reshape-count", Op.RESHAPE, [X234, i64(5, 5)], {}, r"cannot reshape 24 elements"),
    ("reshape-two-infer", Op.RESHAPE, [X234, i64(-1, -1)], {}, r"more than one -1"),
    ("reshape-negative", Op.RESHAPE, [X234, i64(-2, 12)], {}, r"has -2; allowed"),
    ("reshape-both", Op.RESHAPE, [X234, i64(24)], {"shape": (24,)}, r"both as input 1"),
    ("reshape-none", Op.RESHAPE, [X234], {}, r"reshape needs a shape"),
    ("reshape-float-shape", Op.RESHAPE, [X234, np.array([24.0])], {},
     r"must be an integer tensor"),
    ("expand_dims-repeat", Op.EXPAND_DIMS, [X234], {"axes": (0, -5)}, r"repeat an axis"),
    ("expand_dims-range", Op.EXPAND_DIMS, [X234], {"axis": 4}, r"out of range for rank 4"),
    ("squeeze-not-one", Op.SQUEEZE, [X234], {"axes": (1,)}, r"cannot squeeze axis 1 of size 3"),
    ("transpose-perm", Op.TRANSPOSE, [X234], {"perm": (0, 0, 1)}, r"repeat an axis"),
    ("transpose-length", Op.TRANSPOSE, [X234], {"perm": (0, 1)}, r"2 entries for rank 3"),
    ("flatten-axis", Op.FLATTEN, [X234], {"axis": 4}, r"axis 4 is out of range"),
    ("expand-shape", Op.EXPAND, [X234, i64(3, 3)], {}, r"cannot be broadcast"),
    ("concat-dtype", Op.CONCAT, [I34, I34.astype(np.int32)], {}, r"share one dtype"),
    ("concat-shape", Op.CONCAT, [I34, I34.T], {}, r"differ off axis 0"),
    ("split-sum", Op.SPLIT, [X234, i64(1, 2)], {}, r"sums to 3; the axis has size 2"),
    ("split-nothing", Op.SPLIT, [X234], {}, r"needs split sizes or num_outputs"),
    ("tile-length", Op.TILE, [X234, i64(2)], {}, r"1 entries; the input has rank 3"),
    ("tile-negative", Op.TILE, [I34, i64(-1, 2)], {}, r"negative entry -1"),
    ("pad-length", Op.PAD, [I34, i64(1, 1)], {}, r"expected 4"),
    ("pad-mode", Op.PAD, [I34, i64(1, 1, 1, 1)], {"mode": "mirror"}, r"unknown mode 'mirror'"),
    ("pad-reflect-long", Op.PAD, [I34, i64(3, 0, 0, 0)], {"mode": "reflect"},
     r"at most 2"),
    ("pad-edge-empty", Op.PAD, [np.zeros((0, 2)), i64(1, 0, 0, 0)], {"mode": "edge"},
     r"it is empty"),
    ("pad-crop-too-much", Op.PAD, [I34, i64(-2, 0, -2, 0)], {}, r"remove more than"),
    ("depth_to_space-channels", Op.DEPTH_TO_SPACE, [NCHW[:, :6]], {"blocksize": 2},
     r"channels 6 are not divisible"),
    ("depth_to_space-rank", Op.DEPTH_TO_SPACE, [X234], {"blocksize": 2}, r"rank-4 NCHW"),
    ("space_to_depth-spatial", Op.SPACE_TO_DEPTH, [NCHW], {"blocksize": 2},
     r"not divisible by blocksize 2"),
    ("constant_of_shape-negative", Op.CONSTANT_OF_SHAPE, [i64(2, -3)], {},
     r"negative entry -3"),
    ("constant_of_shape-value", Op.CONSTANT_OF_SHAPE, [i64(2)],
     {"value": np.array([1, 2])}, r"value must hold one element"),
    ("range-delta", Op.RANGE, [np.array(0), np.array(5), np.array(0)], {}, r"delta must not"),
    ("range-dtypes", Op.RANGE, [np.array(0), np.array(5.0), np.array(1)], {},
     r"share one dtype"),
    ("eye_like-rank", Op.EYE_LIKE, [X234], {}, r"rank-2 input"),
    ("trilu-rank", Op.TRILU, [np.arange(3)], {}, r"rank >= 2"),
    ("trilu-k-float", Op.TRILU, [I34, np.array(1.5)], {}, r"k must be an integer"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
def test_bad_arguments_raise_typed_errors(run: Any, case: tuple[Any, ...]) -> None:
    _, op, inputs, attrs, message = case
    with pytest.raises(InvalidArgumentError, match=message):
        run(op, inputs, **attrs)


def test_unknown_attribute_and_missing_required_one() -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown attribute 'shapes' for reshape"):
        get_schema(Op.RESHAPE).normalize_attrs({"shapes": (1,)})
    with pytest.raises(InvalidArgumentError, match=r"requires attribute 'blocksize'"):
        get_schema(Op.DEPTH_TO_SPACE).normalize_attrs({})


# ---- checked arithmetic on user-controlled shapes -----------------------------------

HUGE = 2**40


@pytest.mark.parametrize(("op", "inputs", "attrs"), [
    (Op.TILE, [np.zeros((2, 3), np.float32), i64(HUGE, HUGE)], {}),
    (Op.EXPAND, [np.zeros((1, 1), np.float32), i64(HUGE, HUGE)], {}),
    (Op.CONSTANT_OF_SHAPE, [i64(HUGE, HUGE, 4)], {}),
    (Op.RESHAPE, [np.zeros(4, np.float32), i64(HUGE, HUGE, 0)], {"allowzero": 1}),
], ids=["tile", "expand", "constant_of_shape", "reshape"])
@pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
def test_shape_overflow_is_an_invalid_argument(run: Any, op: Op, inputs: list[Any],
                                              attrs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match=r"overflow"):
        run(op, inputs, **attrs)


def test_overflow_in_inference_of_reshape_and_range() -> None:
    with pytest.raises(InvalidArgumentError, match=r"overflow"):
        infer(Op.RESHAPE, [ttype("float32", (4,)), ttype("int64", (2,))],
              [None, i64(2**62, 4)])
    scalars = [ttype("int64", ())] * 3
    with pytest.raises(InvalidArgumentError, match=r"overflow"):
        infer(Op.RANGE, scalars, [np.array(0), np.array(2**63 - 1), np.array(1)])
