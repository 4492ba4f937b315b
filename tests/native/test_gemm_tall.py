"""The native GEMM's tall tiles (keel/native/src/gemm.c, tall): few rows of C (a 1x1
conv's projection) or a deep product of up to 256 rows against a raw B with contiguous
rows, every row of a column vector in registers. Every column remainder of the 16-wide
vector, every row count of a tile and of its groups, each part of the epilogue and
NaN / inf against float64 NumPy; thread splits (by columns, rows or the batch) and
the packed-B tiles give bitwise the same C."""

from __future__ import annotations

import numpy as np
import pytest

from keel.backends.cpu import native_gemm as ng
from keel.backends.cpu import planner as cpu_planner

pytestmark = pytest.mark.usefixtures("native_gemm_tier")


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _want(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.einsum("mk,tkn->tmn", a.astype(np.float64), b.astype(np.float64))


def _packed(a: np.ndarray) -> ng.Packed:
    p = ng.pack(a, left=True)
    assert p is not None
    return p


# (m, k): one tile of 9 .. 24 rows (a last row panel of 1, 5 or all 8 rows), groups of
# rows over one column vector (k >= 2 m), and a depth past the regular tiles' block.
SHAPES = [(9, 5), (13, 32), (16, 32), (23, 7), (24, 144), (25, 50), (40, 96), (96, 200),
          (24, 600), (130, 300)]
COLUMNS = (1, 15, 16, 17, 31, 33, 47, 100)


@pytest.mark.parametrize("m,k", SHAPES)
def test_every_column_remainder_with_the_full_epilogue(m: int, k: int) -> None:
    rng = np.random.default_rng(m * 1000 + k)
    a = _rand(rng, m, k)
    for n in COLUMNS:
        b = _rand(rng, 2, k, n)
        bias, res = _rand(rng, m), _rand(rng, 2, m, n)
        y = np.empty((2, m, n), np.float32)
        assert ng.gemm(_packed(a), b, y, bias=bias, bias_rows=True, residual=res,
                       alpha=0.5, clip=(-1.0, 2.0))
        want = np.clip(0.5 * _want(a, b) + bias[:, None] + res, -1.0, 2.0)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k", [(16, 40), (24, 9), (64, 130)])
def test_column_bias_and_accumulate(m: int, k: int) -> None:
    rng = np.random.default_rng(7)
    a = _rand(rng, m, k)
    for n in (17, 64, 70):
        b, bias, start = _rand(rng, 3, k, n), _rand(rng, n), _rand(rng, 3, m, n)
        y = np.empty((3, m, n), np.float32)
        assert ng.gemm(_packed(a), b, y, bias=bias)
        np.testing.assert_allclose(y, _want(a, b) + bias, rtol=1e-4, atol=1e-4)
        y[...] = start
        assert ng.gemm(_packed(a), b, y, accumulate=True)
        np.testing.assert_allclose(y, _want(a, b) + start, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k", [(16, 32), (24, 60), (72, 150)])
def test_nan_and_inf_propagate(m: int, k: int) -> None:
    rng = np.random.default_rng(8)
    a, b = _rand(rng, m, k), _rand(rng, 2, k, 50)
    a[3, 5] = np.inf
    a[m - 1, 0] = np.nan
    b[0, 7, 20] = np.nan
    b[1, 2, 49] = -np.inf
    y = np.empty((2, m, 50), np.float32)
    assert ng.gemm(_packed(a), b, y, clip=(-1.0, 2.0))
    with np.errstate(invalid="ignore"):
        want = np.clip(_want(a, b), -1.0, 2.0)
    assert np.isnan(want).any() and np.isinf(_want(a, b)).any()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k,t,n", [(24, 96, 1, 20), (24, 96, 1, 3000), (16, 32, 3, 777),
                                     (96, 576, 1, 196), (40, 100, 2, 50)])
def test_threads_give_bitwise_the_same(m: int, k: int, t: int, n: int,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Columns, row panels (one product of few columns) or the batch split over threads."""
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)
    rng = np.random.default_rng(9)
    a, b, bias, res = _rand(rng, m, k), _rand(rng, t, k, n), _rand(rng, m), _rand(rng, t, m, n)
    outs = []
    for threads in (1, 2, 3):
        y = np.empty((t, m, n), np.float32)
        assert ng.gemm(_packed(a), b, y, bias=bias, bias_rows=True, residual=res,
                       clip=(0.0, 6.0), threads=threads)
        outs.append(y)
    np.testing.assert_allclose(outs[0], np.clip(_want(a, b) + bias[:, None] + res, 0, 6),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("m,k", [(16, 32), (24, 144), (96, 576)])
def test_packed_b_tiles_agree_bitwise(m: int, k: int) -> None:
    """Whole row panels sum every step in the same order as the 8 x 32 tiles over a
    packed B (partial sums of a deep product stored and reloaded exactly)."""
    rng = np.random.default_rng(10)
    a, b = _rand(rng, m, k), _rand(rng, k, 300)
    pb = ng.pack(b, left=False)
    assert pb is not None
    raw, packed = np.empty((m, 300), np.float32), np.empty((m, 300), np.float32)
    assert ng.gemm(_packed(a), b, raw) and ng.gemm(_packed(a), pb, packed)
    np.testing.assert_array_equal(raw, packed)
    np.testing.assert_allclose(raw, _want(a, b[None])[0], rtol=1e-4, atol=1e-4)
