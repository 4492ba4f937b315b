"""The native float32 transformer kernels (keel/native/src/fastmath.c, backends/cpu/fastmath.py):
accuracy against float64 math and the reference backend, special values, every
vector-width remainder, bitwise equality for any thread split, and the cpu kernels
taking the native path."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable

import numpy as np
import pytest

from keel import config, native
from keel.backends.base import KernelTable
from keel.backends.cpu import fastmath, kernels, matmul
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.backend import CpuBackend
from keel.backends.reference.backend import ReferenceBackend
from keel.errors import InvalidArgumentError
from keel.ops.epilogue import apply_activation, reference_activation
from keel.ops.registry import Op
from keel.ops.schema import get_schema

Ref = Callable[[np.ndarray], np.ndarray]


pytestmark = pytest.mark.usefixtures("native_tier")


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the kernels split even tiny arrays over threads, so chunk edges fall mid-vector."""
    monkeypatch.setattr(cpu_planner, "MIN_CHUNK_ELEMENTS", 1)


def _erfc(x: np.ndarray) -> np.ndarray:
    return np.frompyfunc(math.erfc, 1, 1)(x).astype(np.float64)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64)


def _ref_gelu(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * _erfc(-x / math.sqrt(2.0))


def _ref_gelu_tanh(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(2u): the tanh formula without its cancellation for negative x.
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _ref_sigmoid(x: np.ndarray) -> np.ndarray:
    return reference_activation(x, "sigmoid")


def _ref_silu(x: np.ndarray) -> np.ndarray:
    return reference_activation(x, "silu")


# name, float64 reference, max error in float32 ulps of the result (measured: erf 2.4,
# gelu 6.2 (6.8 without FMA), gelu_tanh 2.8 for x >= -1 (see the tail test below),
# sigmoid 2.4, silu 3.2).
KERNELS: list[tuple[str, Ref, float]] = [
    ("erf", lambda x: _erf(x.astype(np.float64)), 3.0),
    ("gelu", _ref_gelu, 8.0),
    ("gelu_tanh", _ref_gelu_tanh, 3.0),
    ("sigmoid", _ref_sigmoid, 3.0),
    ("silu", _ref_silu, 4.0),
]


def _ulps(y: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|y - ref| in units of the float32 spacing at ref (subnormal spacing at least)."""
    exponent = np.frexp(np.abs(ref).astype(np.float32).astype(np.float64))[1]
    step = np.maximum(np.ldexp(1.0, exponent - 24), float(np.spacing(np.float32(0))))
    return np.abs(y.astype(np.float64) - ref) / step


def _unary(name: str, x: np.ndarray, alpha: float = 1.0, threads: int = 1) -> np.ndarray:
    y = np.empty_like(x)
    assert fastmath.unary(name, x, y, alpha, threads)
    return y


def test_the_library_builds_where_the_tier_is_available() -> None:
    assert fastmath.available(), native.status().failed.get("fastmath", native.status().reason)


@pytest.mark.parametrize(("name", "ref", "max_ulps"), KERNELS, ids=[k[0] for k in KERNELS])
def test_unary_accuracy_in_ulps(name: str, ref: Ref, max_ulps: float) -> None:
    rng = np.random.default_rng(1)
    lo = -1.0 if name == "gelu_tanh" else -12.0
    x = np.concatenate([rng.uniform(lo, 12.0, 200_000), rng.standard_normal(100_000),
                        rng.standard_normal(20_000) * 1e-3,
                        np.linspace(lo, 12.0, 20_001)]).astype(np.float32)
    x = x[x >= lo]
    err = _ulps(_unary(name, x), ref(x))
    assert err.max() <= max_ulps, f"{name}: {err.max():.2f} ulp at x = {x[err.argmax()]!r}"


def test_gelu_tanh_negative_side_stays_within_its_documented_bound() -> None:
    # For x < 0 the rounding of the argument w = 2u of exp(-|w|) dominates: the error
    # grows like |w| ulps (12 ulp at x = -3; 1e-5 relative at x = -10, where the
    # result is about 1e-30). Measured: at most 2.5 (1 + |w|) ulp.
    x = np.linspace(-12.0, 0.0, 200_001).astype(np.float32)
    ref = _ref_gelu_tanh(x)
    w = np.abs(1.5957691216057308 * x * (1 + 0.044715 * x.astype(np.float64) ** 2))
    assert np.all(_ulps(_unary("gelu_tanh", x), ref) <= 3.0 * (1 + w))


def test_gelu_tail_keeps_relative_accuracy_down_to_subnormals() -> None:
    x = np.linspace(-14.0, -4.0, 100_001).astype(np.float32)
    ref = _ref_gelu(x)
    y = _unary("gelu", x)
    assert np.all(_ulps(y, ref) <= 7.0)
    assert np.all(y <= 0) and np.count_nonzero(y) > 90_000


@pytest.mark.parametrize("n", [*range(1, 70), 255, 257, 1023])
def test_every_remainder_length_matches_the_vector_body(n: int) -> None:
    # The same values inside a long array and in a short one (all tail) agree bitwise.
    x = np.random.default_rng(n).standard_normal(2048).astype(np.float32) * 4
    for name, _, _ in KERNELS:
        whole = _unary(name, x)
        assert np.array_equal(_unary(name, x[:n]), whole[:n], equal_nan=True), name
        assert np.array_equal(_unary(name, x[-n:]), whole[-n:], equal_nan=True), name


F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).smallest_subnormal)
SPECIALS = np.array([math.nan, math.inf, -math.inf, 0.0, -0.0, TINY, -TINY, 1e-30, -1e-30,
                     F32_MAX, -F32_MAX, 88.0, -88.0, 90.0, -90.0, 200.0, -200.0, 1e20, -1e20],
                    dtype=np.float32)


@pytest.mark.parametrize(("name", "ref", "max_ulps"), KERNELS, ids=[k[0] for k in KERNELS])
def test_special_values_follow_the_float64_formulas(name: str, ref: Ref, max_ulps: float) -> None:
    y = _unary(name, SPECIALS)
    with np.errstate(all="ignore"):
        expected = ref(SPECIALS).astype(np.float32)
    assert np.array_equal(np.isnan(y), np.isnan(expected)), (y, expected)
    both = ~np.isnan(y)
    assert np.array_equal(np.signbit(y[both]), np.signbit(expected[both])), (y, expected)
    inf = np.isinf(expected)
    assert np.array_equal(y[inf], expected[inf])
    finite = both & ~inf
    assert np.all(_ulps(y[finite], expected[finite].astype(np.float64)) <= max_ulps + 1), \
        (y, expected)


def test_named_special_values() -> None:
    x = np.array([math.inf, -math.inf, math.nan, -0.0], dtype=np.float32)
    gelu = _unary("gelu", x)
    assert gelu[0] == math.inf and math.isnan(gelu[1]) and math.isnan(gelu[2])   # -inf * 0
    assert gelu[3] == 0 and np.signbit(gelu[3])
    assert list(_unary("erf", x)[:2]) == [1.0, -1.0]
    assert list(_unary("sigmoid", x)[:2]) == [1.0, 0.0]
    assert _unary("sigmoid", np.array([-100.0], np.float32))[0] > 0   # subnormal, not 0


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_thread_splits_are_bitwise_identical(small_chunks: None, threads: int) -> None:
    x = np.random.default_rng(7).standard_normal(1000 + 13).astype(np.float32) * 5
    for name, _, _ in KERNELS:
        assert np.array_equal(_unary(name, x, threads=1), _unary(name, x, threads=threads)), name
    rows = np.random.default_rng(8).standard_normal((37, 53)).astype(np.float32) * 5
    g, b = (np.random.default_rng(9).standard_normal(53).astype(np.float32) for _ in range(2))
    outs = []
    for t in (1, threads):
        y, m, s = np.empty_like(rows), np.empty(37, np.float32), np.empty(37, np.float32)
        assert fastmath.layer_norm(rows, g, b, y, 1e-5, m, s, threads=t)
        sm = np.empty_like(rows)
        assert fastmath.softmax(rows, sm, "softmax", threads=t)
        ba = rows.copy()
        assert fastmath.bias_activation_inplace("gelu", (), ba, b, threads=t)
        outs.append((y, m, s, sm, ba))
    for a, c in zip(*outs, strict=True):
        assert np.array_equal(a, c)


def test_large_arrays_split_over_two_threads_bitwise() -> None:
    x = np.random.default_rng(3).standard_normal(3 * 32768 + 5).astype(np.float32)
    assert np.array_equal(_unary("gelu", x, threads=1), _unary("gelu", x, threads=2))


def test_in_place_and_unserved_cases() -> None:
    x = np.random.default_rng(0).standard_normal(101).astype(np.float32)
    expected = _unary("gelu", x)
    y = x.copy()
    assert fastmath.unary("gelu", y, y)
    assert np.array_equal(y, expected)
    assert fastmath.unary("gelu", y[:50], y.reshape(101)[:50])      # same memory, other view
    assert not fastmath.unary("gelu", x.astype(np.float64), np.empty(101))
    assert not fastmath.unary("gelu", x[::2], np.empty(51, np.float32))
    assert not fastmath.unary("gelu", x[1:], x[:-1])                 # overlapping, shifted
    assert not fastmath.unary("tanh", x, np.empty_like(x))
    assert fastmath.unary("gelu", np.empty(0, np.float32), np.empty(0, np.float32))


# ---- epilogue hooks ---------------------------------------------------------------------
EPILOGUE_REFS: dict[str, Ref] = {"gelu": _ref_gelu, "gelu_tanh": _ref_gelu_tanh,
                                 "sigmoid": _ref_sigmoid, "silu": _ref_silu}


@pytest.mark.parametrize("name", sorted(EPILOGUE_REFS))
def test_activation_inplace_matches_the_epilogue(name: str) -> None:
    y = np.random.default_rng(4).standard_normal((33, 70)).astype(np.float32) * 3
    expected = EPILOGUE_REFS[name](y)
    numpy_path = apply_activation(np, y.copy(), name, ())
    got = y.copy()
    assert fastmath.activation_inplace(name, (), got)
    near = y >= -1 if name == "gelu_tanh" else np.ones(y.shape, bool)   # see the tail test
    assert np.all(_ulps(got[near], expected[near]) <= 7)
    # The NumPy path's tanh formula loses digits for x < 0 (1 + tanh(u) cancels).
    np.testing.assert_allclose(got, numpy_path, rtol=2e-6, atol=3e-7)
    np.testing.assert_allclose(got, reference_activation(y, name), rtol=1e-5, atol=1e-7)


def test_activation_inplace_declines_what_it_does_not_serve() -> None:
    y = np.ones((4, 4), np.float32)
    assert not fastmath.activation_inplace("relu", (), y)
    assert not fastmath.activation_inplace("clip", (0.0, 6.0), y)
    assert not fastmath.activation_inplace("gelu", (), y.astype(np.float64))
    assert not fastmath.activation_inplace("gelu", (), y.T[:, :2])


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "sigmoid", "silu"])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_bias_activation_equals_add_then_activation(name: str, n: int) -> None:
    rng = np.random.default_rng(n)
    y = rng.standard_normal((2, 3, n)).astype(np.float32) * 3
    bias = rng.standard_normal(n).astype(np.float32)
    expected = y + bias
    assert fastmath.activation_inplace(name, (), expected)
    assert fastmath.bias_activation_inplace(name, (), y, bias)
    assert np.array_equal(y, expected)
    assert not fastmath.bias_activation_inplace(name, (), y, bias[:-1] if n > 1 else bias[:0])


# ---- layer norm ------------------------------------------------------------------------------
def _ref_layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray | None,
                    eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    inv = 1.0 / np.sqrt(((x64 - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    y = (x64 - mean) * inv * g + (0.0 if b is None else b)
    return y, mean, inv


@pytest.mark.parametrize("k", [1, 2, 15, 16, 17, 31, 33, 64, 100, 256, 1023])
@pytest.mark.parametrize("eps", [1e-5, 1e-12, 0.1])
def test_layer_norm_rows(k: int, eps: float) -> None:
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((9, k)) * 2 + rng.standard_normal((9, 1)) * 50).astype(np.float32)
    g, b = (rng.standard_normal(k).astype(np.float32) for _ in range(2))
    for bias in (b, None):
        y, m, s = np.empty_like(x), np.empty(9, np.float32), np.empty(9, np.float32)
        assert fastmath.layer_norm(x, g, bias, y, eps, m, s)
        ry, rm, rs = _ref_layer_norm(x, g, bias, eps)
        np.testing.assert_allclose(y, ry, rtol=2e-6, atol=2e-6 * np.abs(g).max())
        np.testing.assert_allclose(m, rm[:, 0], rtol=1e-7)
        np.testing.assert_allclose(s, rs[:, 0], rtol=3e-7)


def test_layer_norm_far_from_zero_mean_and_special_rows() -> None:
    rng = np.random.default_rng(2)
    x = (1000.0 + rng.standard_normal((4, 300)) * 0.01).astype(np.float32)
    x[1] = 5.0                                           # constant row: y = beta
    x[2, 7] = math.nan
    x[3, 0] = math.inf
    g = np.ones(300, np.float32)
    b = np.full(300, 0.25, np.float32)
    y = np.empty_like(x)
    assert fastmath.layer_norm(x, g, b, y, 1e-5)
    ry = _ref_layer_norm(x[:1], g, b, 1e-5)[0]
    np.testing.assert_allclose(y[:1], ry, rtol=1e-5, atol=1e-5)
    assert np.all(y[1] == 0.25)
    assert np.all(np.isnan(y[2])) and np.all(np.isnan(y[3]))


def test_layer_norm_declines_unserved_inputs() -> None:
    x = np.ones((3, 4), np.float32)
    g = np.ones(4, np.float32)
    assert not fastmath.layer_norm(x, g, None, np.empty((3, 4)), 1e-5)       # float64 out
    assert not fastmath.layer_norm(x, g[:3], None, np.empty_like(x), 1e-5)   # wrong gamma
    assert not fastmath.layer_norm(x[:, ::2], g[:2], None, np.empty((3, 2), np.float32), 1e-5)
    assert not fastmath.layer_norm(np.ones((3, 0), np.float32), g[:0], None,
                                   np.empty((3, 0), np.float32), 1e-5)


# ---- skip layer norm (residual add fused) ------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 15, 16, 17, 31, 32, 33, 47, 100, 256, 257])
@pytest.mark.parametrize("period", [12, 4, 1])
def test_skip_layer_norm_is_bitwise_add_then_layer_norm(k: int, period: int) -> None:
    rng = np.random.default_rng(k * 7 + period)
    x = (rng.standard_normal((12, k)) * 2 + 30).astype(np.float32)
    skip = rng.standard_normal((period, k)).astype(np.float32)
    g, b = (rng.standard_normal(k).astype(np.float32) for _ in range(2))
    total = x + np.tile(skip, (12 // period, 1))
    for bias in (b, None):
        want = np.empty_like(x)
        assert fastmath.layer_norm(total, g, bias, want, 1e-5)
        y, s = np.empty_like(x), np.empty_like(x)
        assert fastmath.skip_layer_norm(x, skip, g, bias, y, 1e-5)
        assert np.array_equal(y, want)
        assert fastmath.skip_layer_norm(x, skip, g, bias, y, 1e-5, s)
        assert np.array_equal(y, want) and np.array_equal(s, total)
        ry = _ref_layer_norm(total, g, bias, 1e-5)[0]
        np.testing.assert_allclose(y, ry, rtol=2e-6, atol=2e-6 * np.abs(g).max())


def test_skip_layer_norm_in_place_and_special_rows() -> None:
    rng = np.random.default_rng(21)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    skip = rng.standard_normal((5, 40)).astype(np.float32)
    x[1], skip[1] = 3.0, -1.0                            # a constant sum: y = beta
    x[2, 3] = math.nan
    skip[3, 9] = -math.inf
    g, b = np.ones(40, np.float32), np.full(40, 0.5, np.float32)
    want = np.empty_like(x)
    with np.errstate(invalid="ignore"):
        assert fastmath.layer_norm(x + skip, g, b, want, 1e-5)
    y = x.copy()
    assert fastmath.skip_layer_norm(y, skip, g, b, y, 1e-5)          # y is x
    assert np.array_equal(y, want, equal_nan=True)
    assert np.all(y[1] == 0.5) and np.all(np.isnan(y[2])) and np.all(np.isnan(y[3]))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_skip_layer_norm_thread_splits_are_bitwise_identical(small_chunks: None,
                                                             threads: int) -> None:
    rng = np.random.default_rng(22)
    x = rng.standard_normal((37, 129)).astype(np.float32)
    skip = rng.standard_normal((37, 129)).astype(np.float32)
    g, b = (rng.standard_normal(129).astype(np.float32) for _ in range(2))
    one, many = np.empty_like(x), np.empty_like(x)
    s1, s2 = np.empty_like(x), np.empty_like(x)
    assert fastmath.skip_layer_norm(x, skip, g, b, one, 1e-5, s1, threads=1)
    assert fastmath.skip_layer_norm(x, skip, g, b, many, 1e-5, s2, threads=threads)
    assert np.array_equal(one, many) and np.array_equal(s1, s2)


def test_skip_layer_norm_declines_unserved_inputs() -> None:
    x = np.ones((4, 8), np.float32)
    g = np.ones(8, np.float32)
    y = np.empty_like(x)
    assert not fastmath.skip_layer_norm(x, x.astype(np.float64), g, None, y, 1e-5)
    assert not fastmath.skip_layer_norm(x, np.ones((3, 8), np.float32), g, None, y, 1e-5)
    assert not fastmath.skip_layer_norm(x, np.ones((4, 7), np.float32), g, None, y, 1e-5)
    assert not fastmath.skip_layer_norm(x, x[:, ::2].copy(), g, None, y[:, ::2], 1e-5)
    skip = np.ones((4, 8), np.float32)
    assert not fastmath.skip_layer_norm(x, skip, g, None, skip, 1e-5)    # writes what it reads
    assert not fastmath.skip_layer_norm(x, skip, g, None, y, 1e-5, x)    # the sum over x
    assert not fastmath.skip_layer_norm(x, skip, g, None, y, 1e-5, y)    # the sum over y
    assert not fastmath.skip_layer_norm(np.ones((4, 0), np.float32), skip[:, :0], g[:0], None,
                                        np.empty((4, 0), np.float32), 1e-5)


# ---- softmax --------------------------------------------------------------------------------
def _ref_softmax(x: np.ndarray, log: bool = False) -> np.ndarray:
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        shifted = x64 - x64.max(axis=-1, keepdims=True)
        e = np.exp(shifted)
        s = e.sum(axis=-1, keepdims=True)
        return shifted - np.log(s) if log else e / s


@pytest.mark.parametrize("n", [1, 2, 7, 15, 16, 17, 33, 128, 1000])
@pytest.mark.parametrize("mode", ["softmax", "log_softmax", "masked"])
def test_softmax_rows(n: int, mode: str) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((6, n)) * 8).astype(np.float32)
    x[1, ::3] = -math.inf                              # a causal / padding mask
    x[2] = -math.inf                                   # a fully masked row
    x[3, 0] = math.nan
    x[4, n // 2] = math.inf
    y = np.empty_like(x)
    assert fastmath.softmax(x, y, mode)
    ref = _ref_softmax(x, log=mode == "log_softmax")
    if mode == "masked":                               # ONNX Attention: attends nothing
        ref[np.all(x == -math.inf, axis=1)] = 0.0
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    finite = np.isfinite(ref)
    assert np.array_equal(y[~finite & ~np.isnan(ref)], ref[~finite & ~np.isnan(ref)])
    if mode == "log_softmax":
        np.testing.assert_allclose(y[finite], ref[finite], rtol=3e-7, atol=4e-7)
    else:
        np.testing.assert_allclose(y[finite], ref[finite], rtol=1e-6, atol=1e-37)


def test_softmax_keeps_tiny_probabilities_accurate() -> None:
    # exp(x - max) sees the exact difference: e**-80 keeps its relative accuracy.
    x = np.array([[90.3, 10.7, 0.1, -5.3, -1.1, 50.2]], np.float32)
    y = np.empty_like(x)
    assert fastmath.softmax(x, y)
    assert np.all(_ulps(y, _ref_softmax(x)) <= 2), y


def test_softmax_in_place() -> None:
    x = np.random.default_rng(5).standard_normal((10, 77)).astype(np.float32)
    expected = np.empty_like(x)
    assert fastmath.softmax(x, expected)
    assert fastmath.softmax(x, x)
    assert np.array_equal(x, expected)


# ---- the cpu kernels take the native path ---------------------------------------------------
@pytest.fixture(scope="module")
def backends() -> tuple[CpuBackend, ReferenceBackend]:
    return CpuBackend(threads=1), ReferenceBackend()


UNARY_OPS = [
    (Op.GELU, {}, "gelu", 1.0), (Op.GELU, {"approximate": "tanh"}, "gelu_tanh", 1.0),
    (Op.ERF, {}, "erf", 1.0), (Op.SIGMOID, {}, "sigmoid", 1.0),
    (Op.SWISH, {"alpha": 0.7}, "silu", 0.7),
]


@pytest.mark.parametrize(("op", "attrs", "name", "alpha"), UNARY_OPS,
                         ids=[f"{o.value}-{n}" for o, _, n, _ in UNARY_OPS])
def test_cpu_unary_kernels_run_native_and_match_reference(
        backends: tuple[CpuBackend, ReferenceBackend], op: Op, attrs: dict[str, object],
        name: str, alpha: float) -> None:
    cpu, ref = backends
    x = (np.random.default_rng(6).standard_normal((3, 5, 67)) * 3).astype(np.float32)
    got = cpu.run(op, [x], attrs=attrs)[0]
    assert np.array_equal(got, _unary(name, x, alpha))           # the native result
    np.testing.assert_allclose(got, ref.run(op, [x], attrs=attrs)[0], rtol=1e-6, atol=1e-6)
    for other in (x.astype(np.float64), x.astype(np.float16), x[:, :, ::2]):
        np.testing.assert_allclose(cpu.run(op, [other], attrs=attrs)[0],
                                   ref.run(op, [other], attrs=attrs)[0],
                                   rtol=2e-3 if other.dtype == np.float16 else 1e-5,
                                   atol=1e-3 if other.dtype == np.float16 else 1e-6)


@pytest.mark.parametrize("axis", [-1, 1, 2])
def test_cpu_layer_norm_runs_native_and_matches_reference(
        backends: tuple[CpuBackend, ReferenceBackend], axis: int) -> None:
    cpu, ref = backends
    rng = np.random.default_rng(axis + 5)
    x = (rng.standard_normal((2, 5, 33)) * 3 + 7).astype(np.float32)
    shape = x.shape[axis:] if axis >= 0 else x.shape[-1:]
    g, b = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    attrs = {"axis": axis, "epsilon": 1e-4}
    got, want = cpu.run(Op.LAYER_NORM, [x, g, b], attrs=attrs), \
        ref.run(Op.LAYER_NORM, [x, g, b], attrs=attrs)
    assert [a.shape for a in got] == [w.shape for w in want]
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)
    rows = x.reshape(-1, g.size)
    y = np.empty_like(rows)
    assert fastmath.layer_norm(rows, g.reshape(-1), b.reshape(-1), y, 1e-4)
    assert np.array_equal(got[0].reshape(y.shape), y)
    only_y = cpu.run(Op.LAYER_NORM, [x, g], outputs=[np.empty_like(x)], attrs=attrs)
    np.testing.assert_allclose(only_y[0], ref.run(Op.LAYER_NORM, [x, g], attrs=attrs)[0],
                               rtol=1e-5, atol=1e-5)


SKIPS = [((2, 5, 33), (2, 5, 33), -1), ((2, 5, 33), (5, 33), -1), ((2, 5, 33), (33,), -1),
         ((2, 5, 33), (2, 1, 33), -1), ((2, 5, 33), (1, 1, 2, 5, 33), -1),
         ((3, 4, 17), (4, 17), 1), ((3, 4, 17), (3, 1, 1), 2), ((6, 1), (6, 1), -1)]


@pytest.mark.parametrize(("shape", "skip_shape", "axis"), SKIPS,
                         ids=[f"{a}+{b}@{c}" for a, b, c in SKIPS])
def test_cpu_skip_layer_norm_matches_reference_and_add_then_layer_norm(
        backends: tuple[CpuBackend, ReferenceBackend], shape: tuple[int, ...],
        skip_shape: tuple[int, ...], axis: int) -> None:
    cpu, ref = backends
    rng = np.random.default_rng(len(skip_shape) + axis + shape[-1])
    x = (rng.standard_normal(shape) * 3 + 7).astype(np.float32)
    skip = rng.standard_normal(skip_shape).astype(np.float32)
    norm = shape[axis:] if axis >= 0 else shape[-1:]
    g, b = (rng.standard_normal(norm).astype(np.float32) for _ in range(2))
    attrs = {"axis": axis, "epsilon": 1e-4}
    got = cpu.run(Op.SKIP_LAYER_NORM, [x, skip, g, b], attrs=attrs)
    want = ref.run(Op.SKIP_LAYER_NORM, [x, skip, g, b], attrs=attrs)
    assert [a.shape for a in got] == [w.shape for w in want] == [shape, shape]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[1], want[1])
    total = np.add(x, skip.reshape(skip_shape[-len(shape):]) if len(skip_shape) > len(shape)
                   else skip)
    unfused = cpu.run(Op.LAYER_NORM, [total, g, b], attrs=attrs)[0]
    assert np.array_equal(got[0], unfused)                     # the same native row kernel
    only_y = cpu.run(Op.SKIP_LAYER_NORM, [x, skip, g], outputs=[np.empty_like(x)], attrs=attrs)
    np.testing.assert_allclose(only_y[0], ref.run(Op.SKIP_LAYER_NORM, [x, skip, g],
                                                  attrs=attrs)[0], rtol=1e-5, atol=1e-5)


def test_cpu_skip_layer_norm_other_dtypes_and_layouts(
        backends: tuple[CpuBackend, ReferenceBackend]) -> None:
    cpu, ref = backends
    rng = np.random.default_rng(31)
    x = rng.standard_normal((7, 45)).astype(np.float32)
    skip = rng.standard_normal((7, 45)).astype(np.float32)
    g, b = rng.standard_normal(45).astype(np.float32), rng.standard_normal(45).astype(np.float32)
    contiguous = cpu.run(Op.SKIP_LAYER_NORM, [x, skip, g, b])
    strided = cpu.run(Op.SKIP_LAYER_NORM, [np.asfortranarray(x), skip[:, ::-1][:, ::-1], g, b])
    assert all(np.array_equal(a, c) for a, c in zip(contiguous, strided, strict=True))
    for dt, tol in ((np.float64, 1e-12), (np.float16, 3e-3)):
        ins = [a.astype(dt) for a in (x, skip, g, b)]
        got, want = cpu.run(Op.SKIP_LAYER_NORM, ins), ref.run(Op.SKIP_LAYER_NORM, ins)
        assert [a.dtype for a in got] == [dt, dt]
        np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
        assert np.array_equal(got[1], want[1])
    stash = cpu.run(Op.SKIP_LAYER_NORM, [x, skip, g, b], attrs={"stash_type": 11})
    np.testing.assert_allclose(stash[0], contiguous[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="skip must have X's dtype"):
        cpu.run(Op.SKIP_LAYER_NORM, [x, skip.astype(np.float64), g, b])
    with pytest.raises(InvalidArgumentError, match="does not broadcast to X's shape"):
        cpu.run(Op.SKIP_LAYER_NORM, [x, np.ones((2, 45), np.float32), g, b])


@pytest.mark.parametrize("op", [Op.SOFTMAX, Op.LOG_SOFTMAX])
def test_cpu_softmax_runs_native_and_matches_reference(
        backends: tuple[CpuBackend, ReferenceBackend], op: Op) -> None:
    cpu, ref = backends
    x = (np.random.default_rng(11).standard_normal((2, 3, 45)) * 6).astype(np.float32)
    x[0, 0, :10] = -math.inf
    with np.errstate(all="ignore"):
        got, want = cpu.run(op, [x])[0], ref.run(op, [x])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    y = np.empty((6, 45), np.float32)
    assert fastmath.softmax(x.reshape(6, 45), y, op.value)
    assert np.array_equal(got.reshape(6, 45), y)
    other = cpu.run(op, [x], attrs={"axis": 1})[0]                 # not the last axis: NumPy
    np.testing.assert_allclose(other, ref.run(op, [x], attrs={"axis": 1})[0],
                               rtol=1e-5, atol=1e-6)


def test_cpu_native_results_do_not_depend_on_the_layout(
        backends: tuple[CpuBackend, ReferenceBackend]) -> None:
    cpu, _ = backends
    base = (np.random.default_rng(13).standard_normal((40, 66)) * 3).astype(np.float32)
    strided = np.asfortranarray(base)
    assert not strided.flags.c_contiguous
    g = np.ones(66, np.float32)
    for op, inputs in ((Op.GELU, [base]), (Op.ERF, [base]), (Op.SOFTMAX, [base]),
                       (Op.LAYER_NORM, [base, g])):
        contiguous = cpu.run(op, inputs)[0]
        other = cpu.run(op, [strided, *inputs[1:]])[0]
        assert np.array_equal(contiguous, other), op
        into = np.empty((66, 40), np.float32).T                     # a strided output
        kernel = kernels.load().get(op).fn          # straight in: run() stages outputs
        kernel(cpu.context(), inputs, get_schema(op).normalize_attrs({}), [into])
        assert np.array_equal(contiguous, into), op


def test_onnx_attention_softmax_zeroes_fully_masked_rows(
        backends: tuple[CpuBackend, ReferenceBackend]) -> None:
    cpu, ref = backends
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(3))
    mask = np.ones((5, 5), dtype=bool)
    mask[2] = False                                     # query 2 sees no key
    got = cpu.run(Op.ONNX_ATTENTION, [q, k, v, mask])[0]
    want = ref.run(Op.ONNX_ATTENTION, [q, k, v, mask])[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(got[:, :, 2] == 0)


def test_native_variants_are_registered_with_their_tier() -> None:
    table: KernelTable = kernels.load()
    for op in (Op.GELU, Op.ERF, Op.SIGMOID, Op.SWISH, Op.LAYER_NORM, Op.SKIP_LAYER_NORM,
               Op.SOFTMAX, Op.LOG_SOFTMAX):
        variant = table.get(op, "native")
        assert variant.meta["requires"] == "native"
        assert "native" in variant.meta["measured"]


def test_keel_native_off_runs_the_numpy_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    x = (np.random.default_rng(14).standard_normal((7, 33)) * 3).astype(np.float32)
    native_result = CpuBackend(threads=1).run(Op.GELU, [x])[0]
    monkeypatch.setenv("KEEL_NATIVE", "off")
    config.reload_settings()
    native.reset()
    try:
        assert not fastmath.available()
        assert not fastmath.unary("gelu", x, np.empty_like(x))
        assert not fastmath.activation_inplace("gelu", (), x.copy())
        numpy_result = CpuBackend(threads=1).run(Op.GELU, [x])[0]
        np.testing.assert_allclose(numpy_result, native_result, rtol=2e-6, atol=1e-7)
        assert not np.array_equal(numpy_result, native_result)     # another algorithm ran
    finally:
        native.reset()


@pytest.mark.parametrize(("shape", "skip_shape", "axis"), SKIPS[:5],
                         ids=[f"{a}+{b}@{c}" for a, b, c in SKIPS[:5]])
def test_skip_layer_norm_numpy_path_matches_reference(
        monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], skip_shape: tuple[int, ...],
        axis: int) -> None:
    rng = np.random.default_rng(41)
    x = rng.standard_normal(shape).astype(np.float32)
    skip = rng.standard_normal(skip_shape).astype(np.float32)
    g, b = (rng.standard_normal(shape[-1]).astype(np.float32) for _ in range(2))
    attrs = {"axis": axis}
    native_result = CpuBackend(threads=1).run(Op.SKIP_LAYER_NORM, [x, skip, g, b], attrs=attrs)
    monkeypatch.setenv("KEEL_NATIVE", "off")
    config.reload_settings()
    native.reset()
    try:
        assert not fastmath.skip_layer_norm(x.reshape(-1, shape[-1]), x.reshape(-1, shape[-1]),
                                            g, b, np.empty_like(x).reshape(-1, shape[-1]), 1e-5)
        got = CpuBackend(threads=1).run(Op.SKIP_LAYER_NORM, [x, skip, g, b], attrs=attrs)
        want = ReferenceBackend().run(Op.SKIP_LAYER_NORM, [x, skip, g, b], attrs=attrs)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert np.array_equal(got[1], want[1]) and np.array_equal(got[1], native_result[1])
        np.testing.assert_allclose(got[0], native_result[0], rtol=1e-5, atol=1e-5)
    finally:
        native.reset()


# ---- attention one query row at a time (keel_attend_rows_f32) ---------------------------
def _attention_case(rng: np.random.Generator, batch: tuple[int, ...], s: int, t: int,
                    d: int = 64, dv: int = 64) -> list[np.ndarray]:
    return [rng.standard_normal((*batch, n, width)).astype(np.float32)
            for n, width in ((s, d), (t, d), (t, dv))]


@pytest.mark.parametrize("mask", ["", "padding", "bool", "full", "causal"])
@pytest.mark.parametrize(("s", "t"), [(1, 1), (1, 65), (1, 5000), (3, 7)])
def test_row_attention_matches_the_reference(
        backends: tuple[CpuBackend, ReferenceBackend], mask: str, s: int, t: int) -> None:
    # One query (a decode step, up to a cache past the kernel's stack row) and a few
    # queries of few keys: the row kernel's cases (planner.attention_rows).
    assert cpu_planner.attention_rows(s, t)
    cpu, ref = backends
    rng = np.random.default_rng(21)
    inputs: list[np.ndarray] = _attention_case(rng, (2, 3), s, t, dv=40)
    attrs = {"is_causal": True} if mask == "causal" else {}
    if mask == "padding":              # GPT-2's padding mask: (B, 1, 1, T), 0 or -inf
        pad = np.where(rng.random((2, 1, 1, t)) < 0.3, -np.inf, 0).astype(np.float32)
        pad[..., -1] = 0
        inputs.append(pad)
    elif mask == "bool":
        keep = rng.random((2, 3, s, t)) < 0.6
        keep[..., 0] = True
        inputs.append(keep)
    elif mask == "full":
        inputs.append(rng.standard_normal((1, 3, s, t)).astype(np.float32))
    layout = None if len(inputs) == 3 or inputs[3].dtype == bool else (
        inputs[3].shape, inputs[3].strides)
    assert matmul._rows_kernel(inputs[0].shape, inputs[1].shape, inputs[2].shape, layout,
                               None, mask == "causal", 1) is not None
    got = cpu.run(Op.ATTENTION, inputs, attrs=attrs)[0]
    want = ref.run(Op.ATTENTION, inputs, attrs=attrs)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_row_attention_gives_nan_for_a_query_that_sees_no_key(
        backends: tuple[CpuBackend, ReferenceBackend]) -> None:
    cpu, ref = backends
    q, k, v = _attention_case(np.random.default_rng(22), (1, 2), 1, 9, d=8, dv=8)
    hidden = np.zeros((1, 2, 1, 9), np.float32)
    hidden[0, 1] = -np.inf                           # head 1 sees nothing
    got = cpu.run(Op.ATTENTION, [q, k, v, hidden])[0]
    with np.errstate(invalid="ignore"):              # the reference's -inf - -inf
        want = ref.run(Op.ATTENTION, [q, k, v, hidden])[0]
    assert np.isnan(got[0, 1]).all() and np.isnan(want[0, 1]).all()
    np.testing.assert_allclose(got[0, 0], want[0, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("small_chunks")
def test_row_attention_bits_follow_neither_the_batch_nor_the_threads() -> None:
    rng = np.random.default_rng(23)
    q, k, v = _attention_case(rng, (6, 4), 1, 33)
    mask = np.where(rng.random((6, 1, 1, 33)) < 0.2, -np.inf, 0).astype(np.float32)
    mask[..., 0] = 0
    matmul._rows_kernel.cache_clear()          # its split was planned with larger chunks

    def run(threads: int, rows: slice) -> np.ndarray:
        return CpuBackend(threads=threads).run(
            Op.ATTENTION, [q[rows], k[rows], v[rows], mask[rows]])[0]

    alone = run(1, slice(2, 3))
    for threads in (1, 2, 3):
        assert np.array_equal(run(threads, slice(None))[2:3], alone)


def test_row_attention_binds_once_and_follows_its_arrays() -> None:
    # A program's bound step: Q, K, V and Y stay put, their values change between runs.
    rng = np.random.default_rng(24)
    q, k, v = _attention_case(rng, (4,), 1, 20, d=16, dv=16)
    y = np.empty((4, 1, 16), np.float32)
    call = fastmath.bound_attend_rows(q, k, v, None, y, 0.25, False)
    assert call is not None
    ref = ReferenceBackend()
    for _ in range(2):
        call()
        want = ref.run(Op.ATTENTION, [q, k, v], attrs={"scale": 0.25})[0]
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
        k[...] = rng.standard_normal(k.shape)
    # Not served: an output overlapping an input, a mask the kernel cannot stride through.
    assert fastmath.bound_attend_rows(q, k, v, None, q, 0.25, False) is None
    wide = np.zeros((4, 1, 1, 40), np.float32)[..., ::2]
    assert fastmath.bound_attend_rows(q, k, v, wide.reshape(4, 1, 1, 20), y, 0.25,
                                      False) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bound_layer_norm_without_beta_owns_the_zeros_it_made(threads: int) -> None:
    """No beta: the call takes a zero row from a small cache; its bound form (on one
    thread or split) must keep it alive once rows of other widths evicted it and the
    freed bytes are reused."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 384)).astype(np.float32)
    gamma = rng.standard_normal(384).astype(np.float32)
    y = np.empty_like(x)
    go = fastmath.bound_layer_norm(x, gamma, None, y, 1e-5, threads=threads)
    assert go is not None
    for width in range(1, 17):              # other widths' zero rows evict this one's
        row = np.ones((1, width), np.float32)
        fastmath.bound_layer_norm(row, row[0], None, np.empty_like(row), 1e-5)
    gc.collect()
    junk = [np.full(384, 1e6, np.float32) for _ in range(4000)]     # reuses freed rows
    go()
    del junk
    d = x.astype(np.float64) - x.mean(axis=1, keepdims=True, dtype=np.float64)
    want = d / np.sqrt((d * d).mean(axis=1, keepdims=True) + 1e-5) * gamma
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
