"""The pooling family: hand-computed cases, reference vs ONNX, cpu vs reference, the
wide-window layout and schema errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.cpu import window as wnd
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.pooling import pool_window
from keel.ops.types import TensorType
from tests.ops._matconv_support import cpu, onnx_reference, onnxruntime_node, ref

RNG = np.random.default_rng(5)


def _f(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def test_max_pool_by_hand() -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    for kernel in (ref, cpu):
        y, indices = kernel(Op.MAX_POOL, [x], kernel_shape=(2, 2), strides=(2, 2))
        np.testing.assert_array_equal(y[0, 0], [[5, 7], [13, 15]])
        np.testing.assert_array_equal(indices[0, 0], [[5, 7], [13, 15]])


def test_avg_pool_padding_counts_only_when_asked() -> None:
    x = np.ones((1, 1, 2, 2), np.float32)
    for kernel in (ref, cpu):
        (y,) = kernel(Op.AVG_POOL, [x], kernel_shape=(2, 2), pads=(1, 1, 1, 1))
        np.testing.assert_array_equal(y, np.ones((1, 1, 3, 3)))
        (y,) = kernel(Op.AVG_POOL, [x], kernel_shape=(2, 2), pads=(1, 1, 1, 1),
                      count_include_pad=1)
        np.testing.assert_array_equal(y[0, 0], [[0.25, 0.5, 0.25], [0.5, 1, 0.5],
                                                [0.25, 0.5, 0.25]])


# ---- reference against ONNX -----------------------------------------------------------------
_WINDOWS: list[dict[str, Any]] = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [2, 3], "strides": [1, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
]


@pytest.mark.parametrize("attrs", _WINDOWS)
def test_reference_max_pool_matches_onnx(attrs: dict[str, Any]) -> None:
    x = _f(2, 3, 8, 9)
    want = onnx_reference("MaxPool", [x], out_types=(np.float32, np.int64), **attrs)
    got = ref(Op.MAX_POOL, [x], **attrs)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("attrs", _WINDOWS)
@pytest.mark.parametrize("include", [0, 1])
def test_reference_avg_pool_matches_onnx(attrs: dict[str, Any], include: int) -> None:
    x = _f(1, 2, 8, 9)
    want = onnx_reference("AveragePool", [x], count_include_pad=include, **attrs)[0]
    got = ref(Op.AVG_POOL, [x], count_include_pad=include, **attrs)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_reference_lp_and_global_pools_match_onnx() -> None:
    x = _f(2, 3, 7, 6)
    np.testing.assert_allclose(ref(Op.LP_POOL, [x], kernel_shape=(3, 2), strides=(2, 2), p=3)[0],
                               onnx_reference("LpPool", [x], kernel_shape=[3, 2],
                                              strides=[2, 2], p=3)[0], rtol=1e-5)
    for op, name in ((Op.GLOBAL_AVG_POOL, "GlobalAveragePool"),
                     (Op.GLOBAL_MAX_POOL, "GlobalMaxPool")):
        np.testing.assert_allclose(ref(op, [x])[0], onnx_reference(name, [x])[0], rtol=1e-6)


def test_max_pool_indices_in_column_major_match_onnxruntime() -> None:
    pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle for storage_order=1 "
                        "(onnx's reference evaluator ignores the attribute)")
    x = _f(2, 2, 7, 6)
    attrs: dict[str, Any] = {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1],
                             "storage_order": 1}
    want = onnxruntime_node("MaxPool", [x], out_types=(np.float32, np.int64), **attrs)
    for kernel in (ref, cpu):
        got = kernel(Op.MAX_POOL, [x], **attrs)
        np.testing.assert_array_equal(got[1], want[1])


def test_lp_pool_with_padding_matches_onnxruntime() -> None:
    pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle for padded LpPool "
                        "(onnx's reference evaluator rescales padded windows)")
    x = _f(1, 2, 6, 6)
    attrs: dict[str, Any] = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "p": 2}
    want = onnxruntime_node("LpPool", [x], **attrs)[0]
    np.testing.assert_allclose(ref(Op.LP_POOL, [x], **attrs)[0], want, rtol=1e-5, atol=1e-6)


# ---- cpu against the reference -----------------------------------------------------------------
@pytest.mark.parametrize("op", [Op.MAX_POOL, Op.AVG_POOL, Op.LP_POOL])
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)},
    {"kernel_shape": (2, 3), "strides": (3, 1), "dilations": (2, 1), "ceil_mode": 1},
    {"kernel_shape": (3, 3), "strides": (3, 3), "pads": (1, 0, 1, 2), "ceil_mode": 1},
    {"kernel_shape": (3,), "strides": (2,), "pads": (1, 1)},
    {"kernel_shape": (2, 2, 3), "strides": (2, 1, 2), "pads": (0, 1, 1, 1, 0, 1)},
])
def test_cpu_pools_match_reference(op: Op, attrs: dict[str, Any]) -> None:
    rank = len(attrs["kernel_shape"])
    x = _f(2, 3, *(9, 8, 7)[:rank], dtype=np.float64)
    want = ref(op, [x], **attrs)
    got = cpu(op, [x], **attrs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12)


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": (2, 2), "strides": (2, 2)},                     # LeNet's pools
    {"kernel_shape": (3, 2), "strides": (1, 2), "dilations": (2, 1)},
    {"kernel_shape": (1, 3), "strides": (2, 1)},
    {"kernel_shape": (3, 1), "strides": (2, 2)},
    {"kernel_shape": (2, 2), "strides": (2, 2), "ceil_mode": 1},     # reaches past X
])
def test_cpu_max_pool_rows_then_columns_matches_reference(attrs: dict[str, Any]) -> None:
    """Unpadded 2-D max pools without indices take rows, then columns, from X itself."""
    x = _f(2, 3, 9, 8)
    want = ref(Op.MAX_POOL, [x], **attrs)[0]
    y = np.empty(want.shape, np.float32)
    assert cpu(Op.MAX_POOL, [x], out=[y], **attrs) == [y]
    np.testing.assert_array_equal(y, want)
    x[0, 0, 0, 0] = np.nan                                           # NaN wins, as in max
    cpu(Op.MAX_POOL, [x], out=[y], **attrs)
    assert np.isnan(y[0, 0, 0, 0])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the reference's mean of nothing
@pytest.mark.parametrize("shape", [(1, 64, 8, 8), (3, 5, 7, 7), (2, 4, 6), (1, 2, 0, 3)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_cpu_global_average_pool_matches_reference(shape: tuple[int, ...], dtype: Any) -> None:
    x = _f(*shape, dtype=dtype)
    want = ref(Op.GLOBAL_AVG_POOL, [x])[0]
    (got,) = cpu(Op.GLOBAL_AVG_POOL, [x])
    assert got.dtype == dtype and got.shape == want.shape
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_cpu_max_pool_computes_indices_only_when_asked() -> None:
    x = _f(1, 2, 7, 7)
    attrs: dict[str, Any] = {"kernel_shape": (3, 3), "pads": (1, 1, 1, 1)}
    want = ref(Op.MAX_POOL, [x], **attrs)
    y = np.empty(want[0].shape, np.float32)
    assert cpu(Op.MAX_POOL, [x], out=[y], **attrs) == [y]
    np.testing.assert_array_equal(y, want[0])
    pair: list[np.ndarray] = [np.empty(want[0].shape, np.float32),
                              np.empty(want[1].shape, np.int64)]
    got = cpu(Op.MAX_POOL, [x], out=pair, **attrs)
    assert got[0] is pair[0] and got[1] is pair[1]
    np.testing.assert_array_equal(pair[1], want[1])


def test_max_pool_of_integers_pads_with_the_lowest_value() -> None:
    x = np.full((1, 1, 3, 3), -128, np.int8)
    for kernel in (ref, cpu):
        y, _ = kernel(Op.MAX_POOL, [x], kernel_shape=(3, 3), pads=(1, 1, 1, 1))
        assert y.dtype == np.int8 and (y == -128).all()


# ---- the wide-window layout ----------------------------------------------------------------
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 2, 0, 1)},
    {"kernel_shape": (2, 3), "strides": (1, 3), "dilations": (3, 1)},
    {"kernel_shape": (3,), "strides": (1,)},
])
def test_window_taps_are_the_windows(attrs: dict[str, Any]) -> None:
    rank = len(attrs["kernel_shape"])
    x = _f(2, 3, *(10, 11)[:rank])
    win = pool_window(Op.MAX_POOL, x.shape, get_schema(Op.MAX_POOL).normalize_attrs(attrs))
    plan = wnd.wide_plan(x.shape, win)
    taps = wnd.taps(wnd.phase_image(np, x, plan, np.nan, "test"), plan)
    padded = np.pad(x, [(0, 0), (0, 0), *zip(win.pads_begin, win.pads_end, strict=True)],
                    constant_values=np.nan)
    for t, offs in enumerate(np.ndindex(*win.kernel)):
        index: tuple[slice, ...] = (slice(None), slice(None), *(
            slice(o * d, o * d + (n - 1) * s + 1, s) for o, d, s, n in
            zip(offs, win.dilations, win.strides, win.out_spatial, strict=True)))
        np.testing.assert_array_equal(wnd.valid(np, taps[t], plan), padded[index])


# ---- schema errors -------------------------------------------------------------------------------
def test_pool_schema_errors() -> None:
    schema = get_schema(Op.MAX_POOL)
    with pytest.raises(InvalidArgumentError, match="requires attribute 'kernel_shape'"):
        schema.normalize_attrs({})
    f32 = DType.FLOAT32
    with pytest.raises(InvalidArgumentError, match="kernel_shape needs 2 values"):
        schema.infer_types([TensorType(f32, (1, 3, 5, 5))],
                           schema.normalize_attrs({"kernel_shape": (3,)}))
    with pytest.raises(InvalidArgumentError, match="storage_order must be 0 or 1"):
        schema.infer_types([TensorType(f32, (1, 3, 5, 5))],
                           schema.normalize_attrs({"kernel_shape": (3, 3), "storage_order": 2}))
    with pytest.raises(InvalidArgumentError, match="does not take int32"):
        schema.infer_types([TensorType(DType.INT32, (1, 3, 5, 5))],
                           schema.normalize_attrs({"kernel_shape": (3, 3)}))
    out = schema.infer_types([TensorType(f32, ("n", 3, 112, 112))],
                             schema.normalize_attrs({"kernel_shape": (3, 3), "strides": (2, 2),
                                                     "pads": (1, 1, 1, 1)}))
    assert out == [TensorType(f32, ("n", 3, 56, 56)), TensorType(DType.INT64, ("n", 3, 56, 56))]
    gap = get_schema(Op.GLOBAL_AVG_POOL)
    assert gap.infer_types([TensorType(f32, (2, 8, 7, 7))], {}) == [
        TensorType(f32, (2, 8, 1, 1))]
