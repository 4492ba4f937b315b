"""The indexing family: schemas, reference kernels against ONNX's oracle, cpu kernels."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu.kernels import load as load_cpu
from keel.errors import InvalidArgumentError, UnsupportedOperationError
from keel.ops.registry import Op, OpGroup
from keel.ops.schema import get_schema
from tests.conformance.cases_indexing import CASES as INDEXING_CASES
from tests.conformance.harness import OpCase, case_inputs
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

RNG = np.random.default_rng(11)
X = RNG.standard_normal((4, 5, 3)).astype(np.float32)
M = RNG.integers(-20, 20, size=(5, 6)).astype(np.int64)
TIES = np.array([[3, 1, 3, 2, 3, 1], [0, 0, 0, 0, 0, 0]], dtype=np.int64)


# ---- against onnx.reference ------------------------------------------------------

# (id, keel op, inputs, keel attrs, ONNX op_type, ONNX attrs)
ONNX_CASES: list[tuple[str, Op, list[Any], dict[str, Any], str, dict[str, Any]]] = [
    ("slice", Op.SLICE, [X, i64(1, -1), i64(100, 0), i64(0, 2), i64(1, -1)], {}, "Slice", {}),
    ("slice-neg-step-clamp", Op.SLICE, [M, i64(-1), i64(-2**63), i64(1), i64(-2)], {},
     "Slice", {}),
    ("slice-default-axes", Op.SLICE, [M, i64(1, 2), i64(4, 5)], {}, "Slice", {}),
    ("gather", Op.GATHER, [X, i64(0, -1, 2, 2)], {"axis": 1}, "Gather", {"axis": 1}),
    ("gather-2d-indices", Op.GATHER, [M, np.array([[0, -5], [4, 1]], np.int32)], {}, "Gather",
     {}),
    ("gather_elements", Op.GATHER_ELEMENTS, [M, RNG.integers(-6, 6, (5, 4))], {"axis": 1},
     "GatherElements", {"axis": 1}),
    ("gather_nd", Op.GATHER_ND, [X, np.array([[0, 1], [-1, 4], [2, -5]])], {}, "GatherND", {}),
    ("gather_nd-batch", Op.GATHER_ND, [X, np.array([[[1], [0]], [[2], [-1]], [[4], [4]],
                                                    [[0], [3]]])], {"batch_dims": 1},
     "GatherND", {"batch_dims": 1}),
    ("scatter_elements", Op.SCATTER_ELEMENTS, [M, i64(4, 0, -1, 2).reshape(2, 2),
                                               np.array([[7, 8], [9, 10]])], {"axis": 1},
     "ScatterElements", {"axis": 1}),
    ("scatter_elements-add", Op.SCATTER_ELEMENTS, [M.astype(np.float32),
                                                   i64(1, 1, 1).reshape(3, 1),
                                                   np.ones((3, 1), np.float32)],
     {"reduction": "add"}, "ScatterElements", {"reduction": "add"}),
    ("scatter_elements-max", Op.SCATTER_ELEMENTS, [M, i64(0, 0, 3).reshape(3, 1),
                                                   np.array([[50], [-50], [60]])],
     {"reduction": "max"}, "ScatterElements", {"reduction": "max"}),
    ("scatter_nd", Op.SCATTER_ND, [M, i64(1, 2, 4, -1).reshape(2, 2), i64(100, 200)], {},
     "ScatterND", {}),
    ("scatter_nd-rows-mul", Op.SCATTER_ND, [M, i64(3, 3).reshape(2, 1),
                                            np.full((2, 6), 2, np.int64)],
     {"reduction": "mul"}, "ScatterND", {"reduction": "mul"}),
    ("scatter_nd-min", Op.SCATTER_ND, [M, i64(0, 0).reshape(2, 1),
                                       np.stack([np.arange(6), -np.arange(6)])],
     {"reduction": "min"}, "ScatterND", {"reduction": "min"}),
    ("topk", Op.TOPK, [X, i64(2)], {"axis": 1}, "TopK", {"axis": 1}),
    ("topk-ties-largest", Op.TOPK, [TIES, i64(4)], {}, "TopK", {}),
    ("topk-ties-smallest", Op.TOPK, [TIES, i64(4)], {"largest": 0}, "TopK", {"largest": 0}),
    ("nonzero", Op.NONZERO, [M * (M > 5)], {}, "NonZero", {}),
    ("one_hot", Op.ONE_HOT, [i64(0, -1, 5, 2), np.array(4.0), np.array([0, 3], np.int32)], {},
     "OneHot", {}),
    ("one_hot-axis0", Op.ONE_HOT, [np.array([[1, 0], [2, -3]]), np.array(3),
                                   np.array([1.5, -1.0], np.float32)], {"axis": 0},
     "OneHot", {"axis": 0}),
    ("compress", Op.COMPRESS, [M, np.array([True, False, True])], {"axis": 0}, "Compress",
     {"axis": 0}),
    ("compress-flat", Op.COMPRESS, [M, M.reshape(-1) > 0], {}, "Compress", {}),
    ("reverse_sequence", Op.REVERSE_SEQUENCE, [M, i64(6, 0, 3, 1, 2)],
     {"batch_axis": 0, "time_axis": 1}, "ReverseSequence", {"batch_axis": 0, "time_axis": 1}),
    ("unique", Op.UNIQUE, [M.reshape(-1) % 4], {}, "Unique", {}),
    ("unique-unsorted", Op.UNIQUE, [np.array([3, 1, 3, 0, 1, 7])], {"sorted": 0}, "Unique",
     {"sorted": 0}),
    ("unique-axis", Op.UNIQUE, [np.array([[1, 2], [0, 1], [1, 2]], np.float32)], {"axis": 0},
     "Unique", {"axis": 0}),
]


@pytest.mark.parametrize("case", ONNX_CASES, ids=[c[0] for c in ONNX_CASES])
def test_reference_and_cpu_match_onnx(case: tuple[Any, ...]) -> None:
    _, op, inputs, attrs, op_type, onnx_attrs = case
    n_out = len(run_ref(op, inputs, **attrs))
    expected = onnx_run(op_type, inputs, n_outputs=n_out, **onnx_attrs)
    assert_same(run_both(op, inputs, **attrs), expected)


# ---- seed 001 semantics ------------------------------------------------------------

def test_seed_index_takes_one_entry_and_drops_the_axis() -> None:
    assert_same(run_both(Op.INDEX, [X], index=2), [X[2]])
    assert_same(run_both(Op.INDEX, [X], index=-1), [X[-1]])
    assert_same(run_both(Op.INDEX, [X], index=1, axis=-1), [X[:, :, 1]])


def test_seed_slice_takes_starts_and_ends_as_attributes() -> None:
    assert_same(run_both(Op.SLICE, [M], starts=(1, 0), ends=(3, -1)), [M[1:3, 0:-1]])
    assert_same(run_both(Op.SLICE, [M], starts=(-1,), ends=(-100,), axes=(1,), steps=(-2,)),
                [M[:, ::-2]])


def test_seed_gather_picks_rows_by_index_tensor() -> None:
    assert_same(run_both(Op.GATHER, [M, i64(4, 0, -1)]), [M[[4, 0, -1]]])


def test_topk_orders_ties_by_index_and_is_sorted() -> None:
    values, indices = run_both(Op.TOPK, [TIES[0], i64(3)], sorted=0)
    assert values.tolist() == [3, 3, 3] and indices.tolist() == [0, 2, 4]
    values, indices = run_both(Op.TOPK, [TIES[0]], k=(3,), largest=0)
    assert values.tolist() == [1, 1, 2] and indices.tolist() == [1, 5, 3]


@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("k", [1, 4, 9, 30])
def test_topk_selection_and_full_sort_paths_agree_on_ties(k: int, largest: int) -> None:
    # k <= n / 4 takes the partition path on the cpu backend, larger k the full sort.
    x = np.random.default_rng(k).integers(0, 4, size=(6, 36)).astype(np.float32)
    values, indices = run_both(Op.TOPK, [x, i64(k)], largest=largest)
    order = np.lexsort((np.broadcast_to(np.arange(36), x.shape), -x if largest else x))
    np.testing.assert_array_equal(indices, order[:, :k])
    np.testing.assert_array_equal(values, np.take_along_axis(x, order[:, :k], axis=1))


def test_one_hot_out_of_range_indices_give_all_off_rows() -> None:
    (y,) = run_both(Op.ONE_HOT, [i64(7, -4), i64(3), np.array([0.0, 1.0])])
    assert y.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_scatter_without_reduction_keeps_the_last_duplicate_write() -> None:
    (y,) = run_both(Op.SCATTER_ND, [np.zeros(3), i64(1, 1).reshape(2, 1), np.array([5.0, 6.0])])
    assert y.tolist() == [0.0, 6.0, 0.0]


# ---- the cpu kernels: out= and non-contiguous inputs -------------------------------

def test_cpu_gather_and_slice_write_into_out() -> None:
    out = np.empty((3, 6), np.int64)
    assert run_cpu(Op.GATHER, [M, i64(1, -1, 0)], out=[out])[0] is out
    np.testing.assert_array_equal(out, M[[1, -1, 0]])
    out_s = np.empty((2, 6), np.int64)
    run_cpu(Op.SLICE, [M, i64(3), i64(1), i64(0), i64(-1)], out=[out_s])
    np.testing.assert_array_equal(out_s, M[3:1:-1])
    out_x = np.empty((5, 6), np.int64)
    run_cpu(Op.SCATTER_ND, [M, i64(0, 0).reshape(1, 2), i64(99)], out=[out_x])
    assert out_x[0, 0] == 99 and (out_x.reshape(-1)[1:] == M.reshape(-1)[1:]).all()


def test_cpu_outputs_never_alias_the_input() -> None:
    (y,) = run_cpu(Op.SLICE, [M], starts=(0,), ends=(2,))
    assert not np.shares_memory(y, M)
    (y,) = run_cpu(Op.INDEX, [M], index=0)
    assert not np.shares_memory(y, M)


@pytest.mark.parametrize(("op", "extra", "attrs"), [
    (Op.INDEX, [], {"index": 1, "axis": 1}), (Op.SLICE, [i64(1), i64(-1)], {}),
    (Op.GATHER, [i64(2, 0)], {"axis": 1}), (Op.GATHER_ELEMENTS, [np.zeros((2, 3), np.int64)], {}),
    (Op.GATHER_ND, [i64(1, 2, 3, 0).reshape(2, 2)], {}), (Op.TOPK, [i64(2)], {}),
    (Op.NONZERO, [], {}), (Op.COMPRESS, [np.array([True, False, True])], {"axis": 1}),
    (Op.REVERSE_SEQUENCE, [i64(4, 1, 2)], {}), (Op.UNIQUE, [], {"axis": 1}),
    (Op.SCATTER_ELEMENTS, [i64(0, 1, 2).reshape(1, 3), np.ones((1, 3))], {}),
])
def test_cpu_handles_non_contiguous_inputs(op: Op, extra: list[Any],
                                           attrs: dict[str, Any]) -> None:
    x = (np.arange(40.0) % 7).reshape(5, 8)[1:, ::3]          # (4, 3), strided
    assert not x.flags.c_contiguous
    actual = run_cpu(op, [x, *extra], **attrs)
    assert_same(actual, run_ref(op, [x.copy(), *extra], **attrs))


def test_cpu_scatter_reduction_missing_from_the_array_library_is_unsupported() -> None:
    class NoAt:                  # an array namespace whose ufuncs lack ``.at``
        def __getattr__(self, name: str) -> Any:
            return object() if name == "multiply" else getattr(np, name)

    ctx = KernelContext(NoAt(), "fake", DeviceKind.GPU)
    attrs = get_schema(Op.SCATTER_ND).normalize_attrs({"reduction": "mul"})
    with pytest.raises(UnsupportedOperationError, match=r"reduction 'mul' needs multiply.at"):
        load_cpu().get(Op.SCATTER_ND).fn(ctx, [M, i64(0).reshape(1, 1), np.ones((1, 6), np.int64)],
                                     attrs, None)


# ---- schemas ----------------------------------------------------------------------

def test_every_indexing_op_has_a_schema_and_kernels() -> None:
    from keel.backends.reference.kernels import load as load_reference
    for op in OpGroup.INDEXING - {Op.WHERE}:
        get_schema(op)
        assert op in load_reference() and op in load_cpu(), op
    assert get_schema(Op.SLICE).value_inputs == (1, 2, 3, 4)
    assert get_schema(Op.UNIQUE).max_outputs == 4


def test_infer_shapes() -> None:
    x = ttype("float32", ("batch", 5, 3))
    idx = ttype("int64", (2, 7))
    assert infer(Op.GATHER, [x, idx], axis=1)[0] == ttype("float32", ("batch", 2, 7, 3))
    assert infer(Op.INDEX, [x], index=-1, axis=1)[0] == ttype("float32", ("batch", 3))
    assert infer(Op.SLICE, [x, None, None], [None, i64(1), i64(-1)])[0] == \
        ttype("float32", (None, 5, 3))
    assert infer(Op.SLICE, [x, ttype("int64", (1,)), ttype("int64", (1,))])[0] == \
        ttype("float32", (None, None, None))
    assert infer(Op.SLICE, [x], starts=(0, 1), ends=(2**63 - 1, 4), axes=(0, 1))[0] == \
        ttype("float32", ("batch", 3, 3))
    assert infer(Op.GATHER_ND, [x, ttype("int64", (4, 2))])[0] == ttype("float32", (4, 3))
    values, indices = infer(Op.TOPK, [x, ttype("int64", (1,))], [None, i64(2)], axis=1)
    assert values == ttype("float32", ("batch", 2, 3)) and indices == ttype("int64",
                                                                            ("batch", 2, 3))
    assert infer(Op.ONE_HOT, [idx, ttype("int64", ()), ttype("float16", (2,))],
                 [None, np.array(4), None], axis=1)[0] == ttype("float16", (2, 4, 7))


def test_data_dependent_ops_infer_unknown_dims() -> None:
    x = ttype("int64", (4, 5))
    assert infer(Op.NONZERO, [x])[0] == ttype("int64", (2, None))
    assert infer(Op.COMPRESS, [x, ttype("bool", (3,))], axis=1)[0] == ttype("int64", (4, None))
    assert infer(Op.COMPRESS, [x, ttype("bool", (3,))])[0] == ttype("int64", (None,))
    y, first, inverse, counts = infer(Op.UNIQUE, [x])
    assert y == ttype("int64", (None,)) and inverse == ttype("int64", (20,))
    assert first == counts == ttype("int64", (None,))


# ---- typed errors ------------------------------------------------------------------

ERRORS: list[tuple[str, Op, list[Any], dict[str, Any], str]] = [
    ("index-range", Op.INDEX, [M], {"index": 5}, r"index: index 5 is out of range"),
    ("index-neg-range", Op.INDEX, [M], {"index": -7, "axis": 1},
     r"index: index -7 is out of range for axis 1 of size 6"),
    ("index-scalar", Op.INDEX, [np.array(1.0)], {"index": 0}, r"rank >= 1"),
    ("slice-step0", Op.SLICE, [M, i64(0), i64(1), i64(0), i64(0)], {}, r"a step must be"),
    ("slice-lengths", Op.SLICE, [M, i64(0, 1), i64(1)], {}, r"one length"),
    ("slice-axes-repeat", Op.SLICE, [M, i64(0, 1), i64(1, 2), i64(1, -1)], {},
     r"repeat an axis"),
    ("slice-no-ends", Op.SLICE, [M], {"starts": (1,)}, r"slice needs ends"),
    ("gather-range", Op.GATHER, [M, i64(0, 5)], {}, r"gather: index 5 is out of range"),
    ("gather-neg-range", Op.GATHER, [M, i64(-7)], {"axis": 1},
     r"gather: index -7 is out of range for axis 1 of size 6"),
    ("gather-float-indices", Op.GATHER, [M, np.array([0.0])], {}, r"must be int32 or int64"),
    ("gather_elements-range", Op.GATHER_ELEMENTS, [M, np.full((5, 6), 6)], {"axis": 1},
     r"gather_elements: index 6 is out of range"),
    ("gather_elements-rank", Op.GATHER_ELEMENTS, [M, i64(0)], {}, r"ranks must match"),
    ("gather_elements-bigger", Op.GATHER_ELEMENTS, [M, np.zeros((6, 6), np.int64)], {"axis": 1},
     r"exceeds data shape"),
    ("gather_nd-range", Op.GATHER_ND, [M, i64(5, 0).reshape(1, 2)], {},
     r"gather_nd: index 5 is out of range for axis 0"),
    ("gather_nd-depth", Op.GATHER_ND, [M, i64(0, 0, 0).reshape(1, 3)], {},
     r"indexes past the data rank"),
    ("scatter_elements-range", Op.SCATTER_ELEMENTS, [M, i64(9).reshape(1, 1), i64(1).reshape(1, 1)],
     {}, r"scatter_elements: index 9 is out of range"),
    ("scatter_elements-updates", Op.SCATTER_ELEMENTS, [M, i64(0).reshape(1, 1), i64(1, 2)], {},
     r"must match indices"),
    ("scatter_elements-reduction", Op.SCATTER_ELEMENTS,
     [M, i64(0).reshape(1, 1), i64(1).reshape(1, 1)], {"reduction": "sum"},
     r"unknown reduction 'sum'"),
    ("scatter_nd-range", Op.SCATTER_ND, [M, i64(0, -7).reshape(1, 2), i64(1)], {},
     r"scatter_nd: index -7 is out of range for axis 1"),
    ("scatter_nd-updates", Op.SCATTER_ND, [M, i64(0).reshape(1, 1), i64(1)], {},
     r"expected \(1, 6\)"),
    ("topk-k", Op.TOPK, [M, i64(7)], {}, r"k 7 is out of range for an axis of size 6"),
    ("topk-k-missing", Op.TOPK, [M], {}, r"topk needs k"),
    ("one_hot-values", Op.ONE_HOT, [i64(0), i64(2), i64(0, 1, 2)], {}, r"\[off_value, on_value\]"),
    ("one_hot-depth", Op.ONE_HOT, [i64(0), i64(-2), i64(0, 1)], {}, r"depth must be >= 0"),
    ("compress-type", Op.COMPRESS, [M, i64(1, 0)], {}, r"1-D bool tensor"),
    ("compress-long", Op.COMPRESS, [M, np.ones(6, bool)], {"axis": 0},
     r"6 entries; the axis has 5"),
    ("reverse_sequence-len", Op.REVERSE_SEQUENCE, [M, i64(7, 1, 1, 1, 1, 1)], {},
     r"sequence length 7 is out of range"),
    ("reverse_sequence-batch", Op.REVERSE_SEQUENCE, [M, i64(1, 1)], {},
     r"2 entries; the batch axis has 6"),
    ("reverse_sequence-axes", Op.REVERSE_SEQUENCE, [M, i64(1)], {"batch_axis": 0},
     r"both 0"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("run", [run_ref, run_cpu], ids=["reference", "cpu"])
def test_bad_arguments_raise_typed_errors(run: Any, case: tuple[Any, ...]) -> None:
    _, op, inputs, attrs, message = case
    with pytest.raises(InvalidArgumentError, match=message):
        run(op, inputs, **attrs)


def test_out_of_range_index_is_caught_in_inference_too() -> None:
    with pytest.raises(InvalidArgumentError, match=r"index: index 3 is out of range"):
        infer(Op.INDEX, [ttype("float32", (3, 2))], index=3)
    with pytest.raises(InvalidArgumentError, match=r"k 9 is out of range"):
        infer(Op.TOPK, [ttype("float32", (3, 2)), ttype("int64", (1,))], [None, i64(9)], axis=0)


# ---- the non-NumPy branches of the cpu kernels (CuPy's signatures) ----------------

class CupyLikeNamespace:
    """NumPy behind CuPy's signatures: ``take`` has no ``mode`` (it wraps), ``argsort``
    no ``kind`` (it is stable). Runs the kernels' non-NumPy branches without a GPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def take(a: Any, indices: Any, axis: int | None = None, out: Any = None) -> Any:
        return np.take(a, indices, axis=axis, out=out, mode="wrap")

    @staticmethod
    def argsort(a: Any, axis: int = -1) -> Any:
        return np.argsort(a, axis=axis, kind="stable")


BRANCHING = [c for c in INDEXING_CASES if c.op in (Op.GATHER, Op.TOPK, Op.COMPRESS, Op.UNIQUE)]


@pytest.mark.parametrize("case", BRANCHING, ids=[c.id for c in BRANCHING])
def test_cpu_kernels_through_a_cupy_like_namespace(case: OpCase) -> None:
    ctx = KernelContext(CupyLikeNamespace(), "fake-gpu", DeviceKind.GPU)
    attrs = get_schema(case.op).normalize_attrs(case.attrs)
    actual = load_cpu().get(case.op).fn(ctx, case_inputs(case), attrs, None)
    assert_same(list(actual), run_ref(case.op, case_inputs(case), **case.attrs))
