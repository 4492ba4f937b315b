"""Short tiles of the native GEMM (a last column panel of fewer than the tile's columns,
gemm.c's tile_part: masked moves with AVX-512): MobileNetV2's 1x1 convs on 7 x 7 (49
output pixels: a panel of 32 and one of 17) and other remainders, with a bias, a residual
and a clip, match the reference backend on 1 and 2 threads, store no column past the
product's, and give every column bitwise what it gets inside a whole panel."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.cpu import conv_gemm
from keel.backends.cpu import native_gemm as ng
from keel.backends.cpu.conv_epilogue import activation
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry
from tests.native._conv_support import check_against_reference, rand

pytestmark = pytest.mark.usefixtures("native_gemm_tier")


# X, W of 1x1 stride-1 convs read in place ("direct"): the output pixels leave a short
# last panel of 17, 1, 31, 4 and 15 columns.
POINTWISE = [
    ((1, 160, 7, 7), (96, 160, 1, 1)),      # MobileNetV2's 160 -> 960 on 7 x 7, fewer rows
    ((2, 24, 7, 7), (40, 24, 1, 1)),
    ((1, 16, 3, 11), (9, 16, 1, 1)),       # 33 columns
    ((1, 8, 9, 7), (17, 8, 1, 1)),         # 63 columns
    ((1, 12, 6, 6), (8, 12, 1, 1)),        # 36 columns
    ((1, 5, 3, 5), (3, 5, 1, 1)),          # 15 columns: one short panel
]


def _direct(threads: int) -> Any:
    def run(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any]) -> np.ndarray:
        geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
        layout = conv_gemm.native_layout(geo, "direct")
        y = np.empty((geo.batch, geo.out_channels, *geo.window.out_spatial), np.float32)
        act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
        assert conv_gemm.native(np, layout, x, w, b, z, y, act, None, threads)
        return y
    return run


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("x_shape,w_shape", POINTWISE)
@pytest.mark.parametrize("act,params", [("", ()), ("clip", (0.0, 6.0))])
def test_pointwise_short_panels_match_the_reference(threads: int, x_shape: tuple[int, ...],
                                                    w_shape: tuple[int, ...], act: str,
                                                    params: tuple[float, ...]) -> None:
    check_against_reference(_direct(threads), x_shape, w_shape, {}, act, params)


@pytest.mark.parametrize("n", [1, 5, 17, 31, 49, 50, 63])
@pytest.mark.parametrize("threads", [1, 2])
def test_short_columns_are_bitwise_those_of_a_whole_panel(n: int, threads: int) -> None:
    """C's first n columns of a product on 64 columns (whole panels) and of the same
    product on n columns alone: the same bits, nothing stored past column n."""
    rng = np.random.default_rng(n)
    w, x, bias = rand(rng, 37, 160), rand(rng, 160, 64), rand(rng, 37)
    res = rand(rng, 37, 64)
    wp = ng.pack(w, left=True)
    assert wp is not None
    wide = np.empty((37, 64), np.float32)
    whole = ng.prepare(wp, x, wide, bias=bias, bias_rows=True, residual=res, clip=(-1.0, 2.0))
    assert whole is not None
    whole.run(threads)
    rows = np.full((37, 64), np.nan, np.float32)          # C's rows n floats apart
    short = rows[:, :n]
    call = ng.prepare(wp, np.ascontiguousarray(x[:, :n]), short, bias=bias, bias_rows=True,
                      residual=np.ascontiguousarray(res[:, :n]), clip=(-1.0, 2.0))
    assert call is not None
    call.run(threads)
    assert np.array_equal(short, wide[:, :n])
    assert np.isnan(rows[:, n:]).all()
    expect = np.clip(w.astype(np.float64) @ x[:, :n] + bias[:, None] + res[:, :n], -1.0, 2.0)
    np.testing.assert_allclose(short, expect, rtol=1e-4, atol=1e-4)
