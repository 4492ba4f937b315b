"""The native GEMM's full tiles with a conv's epilogue (a bias per row, a clip or none):
gemm.c runs it with its tests made once a tile (tile_rows_bias). It must give bitwise the
C of the general epilogue (the same tiles with non-temporal stores asked for, and the tall
tiles), NaN and infinities included, on 1 to 16 threads, and NumPy's product within
float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from keel.backends.cpu import native_gemm as ng

RNG = np.random.default_rng(29)


pytestmark = pytest.mark.usefixtures("native_gemm_tier")


def _operands(m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w = RNG.standard_normal((m, k)).astype(np.float32)
    x = RNG.standard_normal((k, n)).astype(np.float32)
    bias = RNG.standard_normal(m).astype(np.float32)
    x[3, 7] = np.nan                 # a NaN column, and infinities that clip or not
    x[1, 40] = np.inf
    w[5, 2] = -np.inf
    return w, x, bias


@pytest.mark.parametrize("shape", [(96, 16, 1000), (16, 32, 333), (21, 24, 70)])
@pytest.mark.parametrize("clip", [None, (0.0, 6.0), (-np.inf, 0.5)])
@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_conv_epilogue_matches_the_general_one(shape: tuple[int, int, int],
                                               clip: tuple[float, float] | None,
                                               threads: int) -> None:
    m, k, n = shape
    w, x, bias = _operands(m, k, n)
    wp = ng.pack(w, left=True)
    outs = {}
    for name in ("fast", "nt", "tall"):
        c = np.full((m, n), -7.0, np.float32)
        call = ng.prepare(wp, x, c, bias=bias, bias_rows=True, clip=clip, nt=name == "nt")
        assert call is not None
        if name == "tall":
            call = ng.with_tiles(call, True, False)
        call.run(threads)
        outs[name] = c
    # The same bits, NaN payloads and signed zeros included.
    assert outs["fast"].tobytes() == outs["nt"].tobytes()
    assert outs["fast"].tobytes() == outs["tall"].tobytes()
    with np.errstate(invalid="ignore", over="ignore"):
        want = w.astype(np.float64) @ x.astype(np.float64) + bias[:, None]
        if clip is not None:
            want = np.where(np.isnan(want), want, np.clip(want, *clip))
    np.testing.assert_allclose(outs["fast"], want.astype(np.float32), rtol=1e-4, atol=1e-4)
