"""The channel-blocked depthwise scheme of window.c (16 planes at a time, for small planes),
its stride-2 rows (3x3 stride-2 convs read straight from X) and its flat scheme (stride 1,
16 consecutive output pixels read straight from X through masks) against a float64
reference and against the plane-by-plane scheme, which all match bitwise (each output
runs the plane path's chain of fused multiply-adds), for any thread split."""

from __future__ import annotations

import numpy as np
import pytest

from keel.backends.cpu import native_window as nw
from keel.errors import InvalidArgumentError
from keel.ops.schemas.conv import Window

RNG = np.random.default_rng(23)


pytestmark = pytest.mark.usefixtures("native_window_tier")


def _window(h: int, w: int, k: tuple[int, int], s: int, d: int, p: int) -> Window:
    out = tuple((n + 2 * p - d * (kk - 1) - 1) // s + 1 for n, kk in zip((h, w), k, strict=True))
    return Window((h, w), k, (s, s), (d, d), (p, p), (p, p), out)


def _reference(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, z: np.ndarray | None,
               win: Window, clip: tuple[float, float] | None) -> np.ndarray:
    """Float64 depthwise conv by taps over a padded copy."""
    n, c, h, wd = x.shape
    (kh, kw), (sh, sw), (dh, dw) = win.kernel, win.strides, win.dilations
    (pt, pl), (oh, ow) = win.pads_begin, win.out_spatial
    pad = np.zeros((n, c, h + 2 * pt + kh * dh, wd + 2 * pl + kw * dw))
    pad[:, :, pt:pt + h, pl:pl + wd] = x
    y = np.zeros((n, c, oh, ow))
    for i in range(kh):
        for j in range(kw):
            tap = pad[:, :, i * dh: i * dh + sh * oh: sh, j * dw: j * dw + sw * ow: sw]
            y += tap * w[:, 0, i, j].astype(np.float64)[None, :, None, None]
    if b is not None:
        y += b.astype(np.float64)[None, :, None, None]
    if z is not None:
        y += z
    if clip is not None:
        y = np.clip(y, *clip)
    return y


CASES = [
    # n, c, h, w, kernel, stride, dilation, pad
    (1, 1, 7, 7, (3, 3), 1, 1, 1),
    (2, 17, 7, 7, (3, 3), 1, 1, 1),
    (1, 37, 14, 14, (3, 3), 2, 1, 1),
    (3, 5, 9, 13, (3, 3), 2, 1, 0),
    (1, 20, 28, 28, (3, 3), 1, 1, 1),
    (2, 19, 6, 5, (5, 5), 1, 1, 2),
    (1, 33, 11, 8, (1, 3), 1, 1, 1),
    (1, 16, 10, 10, (3, 3), 1, 2, 2),
    (1, 3, 1, 1, (3, 3), 1, 1, 1),
    (2, 18, 15, 4, (3, 3), 2, 1, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:4])) + f"-s{c[5]}")
@pytest.mark.parametrize("fused", ["none", "bias_clip", "bias_residual_clip"])
def test_blocked_matches_planes_bitwise_and_reference(case: tuple, fused: str) -> None:
    n, c, h, wd, k, s, d, p = case
    _check_scheme("blocked", n, c, _window(h, wd, k, s, d, p), fused)


def _check_scheme(scheme: str, n: int, c: int, win: Window, fused: str) -> None:
    """``scheme`` and "auto" against the plane scheme (bitwise) and the reference."""
    geo = nw.plan(c, win)
    assert geo is not None
    x = RNG.standard_normal((n, c, *win.in_spatial)).astype(np.float32)
    w = RNG.standard_normal((c, 1, *win.kernel)).astype(np.float32)
    b = RNG.standard_normal(c).astype(np.float32) if fused != "none" else None
    z = (RNG.standard_normal((n, c, *win.out_spatial)).astype(np.float32)
         if fused == "bias_residual_clip" else None)
    clip = (0.0, 6.0) if fused != "none" else None
    ys = {}
    for name in ("planes", scheme, "auto"):
        ys[name] = np.full((n, c, *win.out_spatial), np.nan, dtype=np.float32)
        nw.depthwise_conv(x, w, b, z, ys[name], geo, clip, 1, name)
    np.testing.assert_allclose(ys[scheme], _reference(x, w, b, z, win, clip),
                               rtol=1e-5, atol=1e-5)
    assert np.array_equal(ys[scheme], ys["planes"])
    assert np.array_equal(ys["auto"], ys["planes"])


def test_blocked_propagates_nan_like_planes() -> None:
    win = _window(7, 7, (3, 3), 1, 1, 1)
    geo = nw.plan(21, win)
    assert geo is not None
    x = RNG.standard_normal((1, 21, 7, 7)).astype(np.float32)
    x[0, 3, 2, 4] = np.nan
    x[0, 20, 0, 0] = np.inf
    x[0, 7, 6, 6] = np.nan          # the plane's last pixel: gathered, not transposed
    z = RNG.standard_normal((1, 21, 7, 7)).astype(np.float32)
    z[0, 9, 6, 6] = np.nan          # the residual's last pixel, added to a scattered one
    z[0, 10, 6, 6] = -np.inf
    w = RNG.standard_normal((21, 1, 3, 3)).astype(np.float32)
    ys = {}
    for scheme in ("planes", "blocked"):
        ys[scheme] = np.empty((1, 21, 7, 7), dtype=np.float32)
        nw.depthwise_conv(x, w, None, z, ys[scheme], geo, (0.0, 6.0), 1, scheme)
    assert np.isnan(ys["blocked"][0, 3, 1:4, 3:6]).all()
    assert np.isnan(ys["blocked"][0, 7, 5:, 5:]).all()
    assert np.isnan(ys["blocked"][0, 9, 6, 6]) and ys["blocked"][0, 10, 6, 6] == 0.0
    assert not np.isnan(ys["blocked"][0, 2]).any()
    np.testing.assert_array_equal(ys["blocked"], ys["planes"])


@pytest.mark.parametrize("scheme", ["blocked", "auto"])
def test_blocked_threads_bitwise_equal(scheme: str) -> None:
    # 1000 planes of 7x7: enough for two chunks, split mid-block (500 = 31 * 16 + 4).
    win = _window(7, 7, (3, 3), 1, 1, 1)
    c = 250
    geo = nw.plan(c, win)
    assert geo is not None and geo.parts(4 * c, 2) == 2
    x = RNG.standard_normal((4, c, 7, 7)).astype(np.float32)
    w = RNG.standard_normal((c, 1, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(c).astype(np.float32)
    y1 = np.empty((4, c, 7, 7), dtype=np.float32)
    y2 = np.empty_like(y1)
    nw.depthwise_conv(x, w, b, None, y1, geo, (0.0, 6.0), 1, scheme)
    nw.depthwise_conv(x, w, b, None, y2, geo, (0.0, 6.0), 2, scheme)
    assert np.array_equal(y1, y2)
    np.testing.assert_allclose(y1, _reference(x, w, b, None, win, (0.0, 6.0)),
                               rtol=1e-5, atol=1e-5)


def test_bind_scheme_is_the_calls_own() -> None:
    """The scheme is the node plan's, passed to each bound call: no process-wide switch."""
    win = _window(14, 14, (3, 3), 2, 1, 1)
    geo = nw.plan(24, win)
    assert geo is not None
    x = RNG.standard_normal((1, 24, 14, 14)).astype(np.float32)
    w = RNG.standard_normal((24, 1, 3, 3)).astype(np.float32)
    out = {}
    for scheme in ("planes", "blocked", "auto"):
        out[scheme] = np.empty((1, 24, 7, 7), dtype=np.float32)
        nw.bind_depthwise_conv(x, w, None, None, out[scheme], geo, None, 1, scheme)()
    assert np.array_equal(out["planes"], out["blocked"])
    assert np.array_equal(out["planes"], out["auto"])
    np.testing.assert_allclose(out["blocked"], _reference(x, w, None, None, win, None),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="unknown depthwise scheme 'tiles'"):
        nw.bind_depthwise_conv(x, w, None, None, out["auto"], geo, None, 1, "tiles")


STRIDED_CASES = [
    # n, c, h, w: 3x3 stride 2 padded by one (MobileNet's downsampling depthwise layers)
    (1, 3, 112, 112),       # rows of 56: four vectors, the last half used
    (2, 5, 56, 56),
    (1, 7, 28, 28),
    (1, 17, 14, 14),        # rows of 7: two output rows a vector
    (1, 5, 15, 16),         # rows of 8 from input rows of 16: a vector's two full halves
    (2, 3, 13, 9),          # rows of 5, seven of them: the last pair holds one row
    (1, 3, 9, 17),          # rows of 9 from 17: one row a vector again
    (1, 4, 15, 33),         # odd sizes: the last window reads past X's end
    (2, 3, 9, 130),         # 65 outputs a row: a second pass of vectors
    (1, 2, 1, 2),
    (1, 2, 3, 1),
]


@pytest.mark.parametrize("case", STRIDED_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("fused", ["none", "bias_clip", "bias_residual_clip"])
def test_strided_matches_planes_bitwise_and_reference(case: tuple, fused: str) -> None:
    n, c, h, wd = case
    _check_scheme("strided", n, c, _window(h, wd, (3, 3), 2, 1, 1), fused)


def _with_specials(scheme: str, win: Window, specials: dict[tuple[int, int, int], float]
                   ) -> dict[str, np.ndarray]:
    """``scheme`` and the plane scheme on 6 channels of ``win`` whose X holds ``specials``
    ({(channel, row, column): value}) and whose channel 5 has an infinite first weight
    (0 * inf in the padding)."""
    geo = nw.plan(6, win)
    assert geo is not None
    x = RNG.standard_normal((1, 6, *win.in_spatial)).astype(np.float32)
    for (c, i, j), value in specials.items():
        x[0, c, i, j] = value
    w = RNG.standard_normal((6, 1, 3, 3)).astype(np.float32)
    w[5, 0, 0, 0] = np.inf
    ys = {}
    for name in ("planes", scheme):
        ys[name] = np.empty((1, 6, *win.out_spatial), dtype=np.float32)
        nw.depthwise_conv(x, w, None, None, ys[name], geo, None, 1, name)
    np.testing.assert_array_equal(ys[scheme], ys["planes"])
    return ys


def test_strided_propagates_nan_and_inf_like_planes() -> None:
    ys = _with_specials("strided", _window(30, 40, (3, 3), 2, 1, 1), {
        (1, 0, 0): np.nan,          # the first row and column: next to the padding
        (2, 29, 39): np.inf,        # the last ones
        (3, 7, 16): -np.inf})       # between two output vectors' columns
    assert np.isnan(ys["strided"][0, 1, 0, 0]) and np.isnan(ys["strided"][0, 5, 0]).all()
    assert not np.isnan(ys["strided"][0, 0]).any()


def test_strided_two_rows_a_vector_propagate_nan_and_inf_like_planes() -> None:
    ys = _with_specials("strided", _window(14, 14, (3, 3), 2, 1, 1), {
        (1, 0, 0): np.nan,          # the first row and column: next to the padding
        (2, 13, 13): np.inf,        # the last ones (read by no output: even size)
        (3, 3, 13): -np.inf,        # a row's last column, beside the next row's first
        (4, 4, 0): np.nan})         # a row's first column (column 2j of output j = 0)
    assert np.isnan(ys["strided"][0, 1, 0, 0]) and np.isnan(ys["strided"][0, 5, 0]).all()
    assert np.isnan(ys["strided"][0, 4, 2, 0]) and np.isnan(ys["strided"][0, 4]).sum() == 1
    y3 = ys["strided"][0, 3]
    assert np.isinf(y3[1:3, 6]).all() and np.isfinite(y3[:, :6]).all()
    assert not np.isnan(ys["strided"][0, 0]).any()


FLAT_CASES = [
    # n, c, h, w, kernel, dilation, pad (stride 1; "flat" serves output rows of W values)
    (1, 3, 112, 112, (3, 3), 1, 1),     # 16 vectors a row: rows never share a vector
    (2, 5, 56, 56, (3, 3), 1, 1),
    (1, 7, 28, 28, (3, 3), 1, 1),
    (1, 17, 14, 14, (3, 3), 1, 1),      # vectors span rows: column masks inside vectors
    (2, 17, 7, 7, (3, 3), 1, 1),
    (1, 4, 15, 33, (3, 3), 1, 1),       # odd sizes: a period of 33 vectors
    (2, 19, 6, 5, (5, 5), 1, 2),        # more taps, two padding columns
    (1, 33, 11, 8, (1, 3), 1, 1),       # padded rows: OH (13) above H
    (1, 16, 10, 10, (3, 3), 2, 2),      # dilated
    (1, 3, 1, 1, (3, 3), 1, 1),         # a plane of one pixel: only the edge masks
    (1, 3, 40, 8, (3, 3), 1, 1),        # a period of one vector over a long plane
    (2, 2, 30, 12, (3, 3), 1, 1),       # a period of three, shorter than a group
    (1, 2, 9, 130, (3, 3), 1, 1),       # a period of 65 vectors: served as planes
    (1, 3, 8, 8, (3, 3), 1, 0),         # 6x6 outputs of 8x8: rows narrower, as planes
]


@pytest.mark.parametrize("case", FLAT_CASES, ids=lambda c: "x".join(map(str, c[:4]))
                         + f"-k{c[4][0]}{c[4][1]}-d{c[5]}")
@pytest.mark.parametrize("fused", ["none", "bias_clip", "bias_residual_clip"])
def test_flat_matches_planes_bitwise_and_reference(case: tuple, fused: str) -> None:
    n, c, h, wd, k, d, p = case
    _check_scheme("flat", n, c, _window(h, wd, k, 1, d, p), fused)


def test_flat_serves_only_unit_strides_and_full_rows() -> None:
    def serves(h: int, w: int, s: int, p: int) -> bool:
        geo = nw.plan(4, _window(h, w, (3, 3), s, 1, p))
        assert geo is not None
        return nw.scheme_ok(geo, "flat")

    assert serves(14, 14, 1, 1) and serves(7, 9, 1, 1)
    assert not serves(14, 14, 2, 1)          # strided
    assert not serves(14, 14, 1, 0)          # output rows of 12 from rows of 14
    assert not serves(9, 130, 1, 1)          # masks repeating every 65 vectors


def test_flat_propagates_nan_and_inf_like_planes() -> None:
    ys = _with_specials("flat", _window(14, 14, (3, 3), 1, 1, 1), {
        (1, 0, 0): np.nan,          # the first row and column: next to the padding
        (2, 13, 13): np.inf,        # the last ones
        (3, 5, 13): -np.inf,        # a row's end, read by the next row's start
        (4, 6, 0): np.nan})         # a row's start, read by the row before's end
    assert np.isnan(ys["flat"][0, 1, 0, 0]) and np.isnan(ys["flat"][0, 5]).any()
    assert not np.isnan(ys["flat"][0, 0]).any()
    assert np.isfinite(ys["flat"][0, 3, 6, 0]) and np.isfinite(ys["flat"][0, 4, 5, 13])


@pytest.mark.parametrize("threads", [2, 3, 16])
@pytest.mark.parametrize("scheme, side, stride", [("strided", 56, 2), ("strided", 14, 2),
                                                 ("flat", 28, 1)])
def test_scheme_threads_bitwise_equal(scheme: str, side: int, stride: int,
                                      threads: int) -> None:
    """A scheme split over threads gives the plane scheme's bits on one."""
    win = _window(side, side, (3, 3), stride, 1, 1)
    n, c = (2 if side >= 28 else 8), 37      # small planes: enough of them for two threads
    geo = nw.plan(c, win)
    assert geo is not None and geo.parts(n * c, 2) == 2
    x = RNG.standard_normal((n, c, side, side)).astype(np.float32)
    w = RNG.standard_normal((c, 1, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(c).astype(np.float32)
    y1 = np.empty((n, c, *win.out_spatial), dtype=np.float32)
    yt = np.empty_like(y1)
    nw.depthwise_conv(x, w, b, None, y1, geo, (0.0, 6.0), 1, "planes")
    nw.depthwise_conv(x, w, b, None, yt, geo, (0.0, 6.0), threads, scheme)
    assert np.array_equal(y1, yt)


# MobileNetV2's 3x3 depthwise layers (channels, input side, stride) and the scheme the
# cpu planner gives each at (batch, threads): the measured rule (planner.depthwise_scheme).
MOBILENET_LAYERS = [(32, 112, 1), (96, 112, 2), (144, 56, 1), (144, 56, 2), (192, 28, 1),
                    (192, 28, 2), (384, 14, 1), (576, 14, 1), (576, 14, 2), (960, 7, 1)]
MOBILENET_SCHEMES = {
    (1, 1): ["flat", "strided", "flat", "strided", "flat", "strided", "flat", "flat",
             "strided", "blocked"],
    (1, 2): ["flat", "strided", "flat", "strided", "flat", "strided", "flat", "flat",
             "strided", "blocked"],
    (32, 1): ["flat", "strided", "flat", "strided", "flat", "strided", "flat", "flat",
              "strided", "flat"],
}


@pytest.mark.parametrize("batch_threads", sorted(MOBILENET_SCHEMES))
def test_planner_picks_the_measured_scheme(batch_threads: tuple[int, int]) -> None:
    """The scheme of each MobileNetV2 layer is the planner's, with its reason."""
    from keel.backends.cpu import planner

    batch, threads = batch_threads
    got = []
    for c, side, s in MOBILENET_LAYERS:
        geo = nw.plan(c, _window(side, side, (3, 3), s, 1, 1))
        assert geo is not None
        scheme, why = planner.depthwise_scheme(geo, batch * c, threads)
        assert why.startswith(f"{scheme}: ")
        got.append(scheme)
    assert got == MOBILENET_SCHEMES[batch_threads]


def test_explain_names_the_depthwise_scheme_and_why() -> None:
    """A depthwise node's plan carries the scheme its call runs, and explain() says why."""
    import onnx
    from onnx import TensorProto, helper

    import keel

    w = RNG.standard_normal((960, 1, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], group=960, pads=[1, 1, 1, 1],
                          kernel_shape=[3, 3])], "dw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 960, 7, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 960, 7, 7])],
        [onnx.numpy_helper.from_array(w, "w")])
    model = keel.load_model(helper.make_model(graph).SerializeToString(), threads=2,
                            backend="cpu")
    plans = [n.plan for n in model.plan.nodes if n.plan is not None]
    assert [p.option("depthwise_scheme") for p in plans] == ["blocked"]
    assert "depthwise_scheme: blocked (blocked: 16 planes at once" in model.explain()


@pytest.mark.parametrize("c, side, s", [(576, 14, 2), (96, 28, 2), (40, 7, 1)])
def test_planned_scheme_bitwise_across_threads(c: int, side: int, s: int) -> None:
    """The planner's scheme at 1, 2, 3 and 16 threads: the plane scheme's bits."""
    win = _window(side, side, (3, 3), s, 1, 1)
    geo = nw.plan(c, win)
    assert geo is not None
    x = RNG.standard_normal((2, c, side, side)).astype(np.float32)
    w = RNG.standard_normal((c, 1, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(c).astype(np.float32)
    want = np.empty((2, c, *win.out_spatial), dtype=np.float32)
    nw.depthwise_conv(x, w, b, None, want, geo, (0.0, 6.0), 1, "planes")
    for threads in (1, 2, 3, 16):
        y = np.full_like(want, np.nan)
        nw.depthwise_conv(x, w, b, None, y, geo, (0.0, 6.0), threads, "auto")
        assert np.array_equal(y, want), threads


@pytest.mark.parametrize(("kernel", "dilation", "pad"), [((5, 5), 1, 2), ((3, 3), 2, 2)])
def test_flat_scheme_only_on_the_measured_kernel(kernel: tuple[int, int], dilation: int,
                                                 pad: int) -> None:
    """The flat scheme serves other stride-1 kernels too (window.c's generic path), but
    was measured only on 3x3 undilated convs padded by one: elsewhere the planner keeps
    the blocked and plane rules."""
    from keel.backends.cpu import planner

    geo = nw.plan(192, _window(28, 28, kernel, 1, dilation, pad))
    assert geo is not None and nw.scheme_ok(geo, "flat")
    scheme, why = planner.depthwise_scheme(geo, 192, 1)
    assert scheme != "flat" and why.startswith(f"{scheme}: ")
