"""keel's C kernels built for aarch64 (their NEON paths) and run under qemu-user.

The kernel libraries are built with Debian's cross compiler from the same sources and
flags as a native build (:mod:`keel.native.cross`, ``-march=armv8-a``), then called by
a small aarch64 program (``cross/harness.c``) on inputs written here; what they compute
is compared with keel's reference backend on this machine. Each representative kernel
family runs: the GEMM (raw and packed operands, the epilogue, batches on the worker
pool), a convolution through the GEMM's gathered tables, the Winograd transforms
around batched products, the window kernels (pooling, depthwise conv) and the
elementwise math (activations, softmax, layer norm, attention a query row at a time), the
tree-ensemble walk, and the int8 kernels (the convolutions, the matmul and the residual
join, and the channels-last depthwise and 1x1 convolutions and layout changes of
qlayout.c, bit for bit). Skips, saying what is missing,
where the cross tools are absent (CI installs them: ``.ci/run``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keel.backends.cpu.fastmath import ACTIVATION_KINDS, SOFTMAX_MODES
from keel.backends.cpu.winograd import TRANSFORM_G
from keel.backends.reference.backend import ReferenceBackend
from keel.native.cross import CrossTarget, build_libraries, build_program, find_target
from keel.ops.registry import Op
from tests.native.cross.runner import HARNESS, Buffer, Script, Symbol
from tests.native.test_fastmath import KERNELS, _ulps

ARGS = "24q3d"           # keel_gemm_args, as native_gemm.py packs it
ACCUMULATE, CLIP = 1, 2
REF = ReferenceBackend()


@dataclass(frozen=True)
class Arm:
    """The aarch64 build: libraries, harness and the GEMM's geometry as built."""

    target: CrossTarget
    harness: Path
    libraries: dict[str, Path]
    gemm: dict[str, int]


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arm]:
    target, why = find_target("aarch64")
    if target is None:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("aarch64")
    libraries = build_libraries(target, folder)
    harness = build_program(target, HARNESS, folder / "harness")
    script = Script()
    gemm = script.library(libraries["gemm"])
    names = ("keel_gemm_mr_f32", "keel_gemm_nr_f32", "keel_gemm_workspace_f32",
             "keel_gemm_args_size", "keel_gemm_args_c_offset", "keel_conv_band_args_size")
    asked = {name: script.call(gemm, name) for name in names}
    got = script.run(target, harness)
    yield Arm(target, harness, libraries, {k: got.value(i) for k, i in asked.items()})


class Session:
    """A script with every kernel library loaded and handed the worker pool."""

    def __init__(self, arm: Arm) -> None:
        self.arm = arm
        self.script = Script()
        self.lib = {name: self.script.library(path) for name, path in arm.libraries.items()}
        pool = self.lib["threads"]
        self.script.call(pool, "keel_pool_set_spin_us", 0)
        for name, index in self.lib.items():
            if name != "threads":
                self.script.call(index, "keel_use_pool", Symbol(pool, "keel_parallel_capped"))

    def call(self, library: str, name: str, *ints: Any, floats: tuple[float, ...] = ()
             ) -> int:
        return self.script.call(self.lib[library], name, *ints, floats=floats)

    def run(self) -> Any:
        return self.script.run(self.arm.target, self.arm.harness)


def _random(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _gemm_args(m: int, n: int, k: int, a: tuple[Buffer, int, int, int],
               b: tuple[Buffer, int, int, int], c: tuple[Buffer, int, int],
               bias: tuple[Buffer | None, int] = (None, 0), flags: int = 0,
               alpha: float = 1.0, clip: tuple[float, float] = (0.0, 0.0),
               b_rows: Buffer | None = None, b_cols: Buffer | None = None) -> list[Any]:
    """keel_gemm_args's fields: A and B as (address, strides..., batch step), C as
    (address, row stride, batch step)."""
    return [m, n, k, *a, *b, b_rows, b_cols, *c, None, *bias, None, 0, 0, flags, None,
            alpha, *clip]


def test_the_neon_build_packs_the_argument_layout_python_writes(arm: Arm) -> None:
    g = arm.gemm
    # VW = 4 floats per NEON vector: 6 x 8 tiles (without NEON, gemm.c's scalar
    # fallback has 4 rows).
    assert (g["keel_gemm_mr_f32"], g["keel_gemm_nr_f32"]) == (6, 8)
    assert g["keel_gemm_args_size"] == struct.calcsize("<" + ARGS) == 216
    assert g["keel_gemm_args_c_offset"] == 13 * 8
    assert g["keel_conv_band_args_size"] == struct.calcsize("<21q2d")
    assert g["keel_gemm_workspace_f32"] > 0


@pytest.mark.parametrize(("name", "ref", "max_ulps"), KERNELS, ids=[k[0] for k in KERNELS])
def test_activations_match_the_float64_formulas(arm: Arm, name: str, ref: Any,
                                                max_ulps: float) -> None:
    # gelu_tanh's bound holds from -1 (below, its error grows with |x|: test_fastmath.py)
    lo = -1.0 if name == "gelu_tanh" else -9.0
    x = np.linspace(lo, 9.0, 4099).astype(np.float32)      # a partial last vector
    s = Session(arm)
    bx, by = s.script.array(x), s.script.zeros(x.nbytes)
    s.call("fastmath", "keel_unary_mt_f32", ACTIVATION_KINDS[name], bx, by, x.size, 2,
           floats=(1.0,))
    out = s.script.dump(by, np.float32, x.shape)
    y = s.run().array(out)
    err = _ulps(y, ref(x))
    assert err.max() <= max_ulps, f"{name}: {err.max():.2f} ulp at x = {x[err.argmax()]!r}"


@pytest.mark.parametrize("mode", ["softmax", "log_softmax"])
def test_softmax_matches_the_reference(arm: Arm, mode: str) -> None:
    x = _random(np.random.default_rng(2), 7, 37) * 4
    s = Session(arm)
    bx, by = s.script.array(x), s.script.zeros(x.nbytes)
    s.call("fastmath", "keel_softmax_f32", bx, by, x.shape[1], 0, x.shape[0],
           SOFTMAX_MODES[mode])
    out = s.script.dump(by, np.float32, x.shape)
    op = Op.SOFTMAX if mode == "softmax" else Op.LOG_SOFTMAX
    want = REF.run(op, [x], attrs={"axis": -1})[0]
    np.testing.assert_allclose(s.run().array(out), want, rtol=2e-6, atol=2e-6)


def test_layer_norm_matches_the_reference(arm: Arm) -> None:
    rng = np.random.default_rng(3)
    x, gamma, beta = _random(rng, 5, 67) * 3 + 1, _random(rng, 67), _random(rng, 67)
    s = Session(arm)
    bufs = [s.script.array(a) for a in (x, gamma, beta)]
    by = s.script.zeros(x.nbytes)
    s.call("fastmath", "keel_layer_norm_f32", *bufs, by, None, None, x.shape[1], 0, x.shape[0],
           floats=(1e-5,))
    out = s.script.dump(by, np.float32, x.shape)
    want = REF.run(Op.LAYER_NORM, [x, gamma, beta], attrs={"axis": -1, "epsilon": 1e-5})[0]
    np.testing.assert_allclose(s.run().array(out), want, rtol=1e-5, atol=1e-5)


def test_gemm_raw_and_packed_operands_with_the_epilogue(arm: Arm) -> None:
    rng = np.random.default_rng(4)
    m, k, n = 37, 53, 29                    # partial tiles on both sides
    a, b, bias = _random(rng, m, k), _random(rng, k, n), _random(rng, n)
    s = Session(arm)
    ba, bb, bbias = s.script.array(a), s.script.array(b), s.script.array(bias)
    work = s.script.zeros(4 * arm.gemm["keel_gemm_workspace_f32"])
    mr, nr = arm.gemm["keel_gemm_mr_f32"], arm.gemm["keel_gemm_nr_f32"]
    a_panels, b_panels = -(-m // mr), -(-n // nr)
    packed_a = s.script.zeros(4 * a_panels * mr * k)
    s.call("gemm", "keel_gemm_pack_f32", ba, m, k, k, 1, mr, packed_a, 0, a_panels)
    packed_b = s.script.zeros(4 * b_panels * nr * k)       # B's columns as the rows packed
    s.call("gemm", "keel_gemm_pack_f32", bb, n, k, 1, n, nr, packed_b, 0, b_panels)
    raw_a, raw_b = (ba, k, 1, 0), (bb, n, 1, 0)
    outs = []
    for a_args, b_args in ((raw_a, raw_b), ((packed_a, 0, 0, 0), raw_b),
                           (raw_a, (packed_b, 0, 0, 0))):
        c = s.script.zeros(4 * m * n)
        args = s.script.block(ARGS, _gemm_args(m, n, k, a_args, b_args, (c, n, 0),
                                               bias=(bbias, 2), flags=CLIP, alpha=0.5,
                                               clip=(-3.0, 2.5)))
        s.call("gemm", "keel_gemm_f32", args, work, 0, 0, b_panels)
        outs.append(s.script.dump(c, np.float32, (m, n)))
    got = s.run()
    want = np.clip(REF.run(Op.GEMM, [a, b, bias], attrs={"alpha": 0.5})[0], -3.0, 2.5)
    for out in outs:
        np.testing.assert_allclose(got.array(out), want, rtol=1e-5, atol=1e-5)


def test_batched_gemm_on_the_worker_pool_accumulates(arm: Arm) -> None:
    rng = np.random.default_rng(5)
    batch, m, k, n = 3, 19, 530, 45              # a depth over one block (KC = 512)
    a, b, c0 = _random(rng, batch, m, k), _random(rng, batch, k, n), _random(rng, batch, m, n)
    s = Session(arm)
    ba, bb, bc = s.script.array(a), s.script.array(b), s.script.array(c0)
    args = s.script.block(ARGS, _gemm_args(m, n, k, (ba, k, 1, m * k), (bb, n, 1, k * n),
                                           (bc, n, m * n), flags=ACCUMULATE))
    units = batch * -(-m // arm.gemm["keel_gemm_mr_f32"])
    rc = s.call("gemm", "keel_gemm_mt_f32", args, 1, units, 2)       # split by row panels
    out = s.script.dump(bc, np.float32, c0.shape)
    got = s.run()
    assert got.value(rc) == 0
    # Against float64: over 530 terms float32 sums differ from one order to another by
    # a few 1e-5 (the reference's own float32 product included).
    want = REF.run(Op.MATMUL, [a.astype(np.float64), b.astype(np.float64)])[0] + c0
    np.testing.assert_allclose(got.array(out), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("stride", [1, 2])
def test_convolution_through_the_gathered_gemm(arm: Arm, stride: int) -> None:
    """B's taps gathered from a padded image by row and column tables (implicit GEMM)."""
    rng = np.random.default_rng(6)
    c, h, w, m = 5, 13, 11, 7
    x, wt, bias = _random(rng, 1, c, h, w), _random(rng, m, c, 3, 3), _random(rng, m)
    xp = np.pad(x[0], ((0, 0), (1, 1), (1, 1)))
    hp, wp = xp.shape[1:]
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    rows = np.array([ci * hp * wp + ky * wp + kx for ci in range(c) for ky in range(3)
                     for kx in range(3)], np.int64)
    cols = np.array([oy * stride * wp + ox * stride for oy in range(oh) for ox in range(ow)],
                    np.int64)
    s = Session(arm)
    ba, bx = s.script.array(wt.reshape(m, c * 9)), s.script.array(xp)
    by, bbias = s.script.zeros(4 * m * oh * ow), s.script.array(bias)
    work = s.script.zeros(4 * arm.gemm["keel_gemm_workspace_f32"])
    args = s.script.block(ARGS, _gemm_args(
        m, oh * ow, c * 9, (ba, c * 9, 1, 0), (bx, 0, 1, 0), (by, oh * ow, 0),
        bias=(bbias, 1), b_rows=s.script.array(rows), b_cols=s.script.array(cols)))
    units = -(-(oh * ow) // arm.gemm["keel_gemm_nr_f32"])
    s.call("gemm", "keel_gemm_f32", args, work, 0, 0, units)
    out = s.script.dump(by, np.float32, (1, m, oh, ow))
    want = REF.run(Op.CONV, [x, wt, bias], attrs={"pads": (1, 1, 1, 1),
                                                  "strides": (stride, stride)})[0]
    np.testing.assert_allclose(s.run().array(out), want, rtol=1e-4, atol=1e-5)


def test_winograd_transforms_around_batched_products(arm: Arm) -> None:
    """F(2x2, 3x3): input transform, sixteen products on the GEMM, output transform with
    bias and clip, all on aarch64: a 3x3 convolution."""
    rng = np.random.default_rng(7)
    n, c, h, w, m = 2, 6, 11, 13, 5
    x, wt, bias = _random(rng, n, c, h, w), _random(rng, m, c, 3, 3), _random(rng, m)
    th, tw = -(-h // 2), -(-w // 2)
    t = n * th * tw
    gg = np.kron(TRANSFORM_G, TRANSFORM_G)
    u = (gg @ wt.reshape(m * c, 9).T.astype(np.float64)).reshape(16, m, c).astype(np.float32)
    s = Session(arm)
    geometry = s.script.array(np.array([c, h, w, h, w, 1, 1], np.int64))
    bx, bu, bbias = s.script.array(x), s.script.array(u), s.script.array(bias)
    v, p = s.script.zeros(4 * 16 * c * t), s.script.zeros(4 * 16 * m * t)
    y = s.script.zeros(x.dtype.itemsize * n * m * h * w)
    clip = s.script.array(np.array([-1.0, 1.5], np.float32))
    rc_in = s.call("winograd", "keel_winograd_input_f32", bx, v, geometry, n, 2)
    args = s.script.block(ARGS, _gemm_args(m, t, c, (bu, c, 1, m * c), (v, t, 1, c * t),
                                           (p, t, m * t)))
    units = 16 * -(-m // arm.gemm["keel_gemm_mr_f32"])
    rc_gemm = s.call("gemm", "keel_gemm_mt_f32", args, 1, units, 2)
    rc_out = s.call("winograd", "keel_winograd_output_f32", p, y, geometry, m, bbias, None,
                    clip, n, 2)
    out = s.script.dump(y, np.float32, (n, m, h, w))
    got = s.run()
    assert [got.value(i) for i in (rc_in, rc_gemm, rc_out)] == [0, 0, 0]
    want = REF.run(Op.CONV, [x, wt, bias], attrs={
        "pads": (1, 1, 1, 1), "activation": "clip", "activation_params": (-1.0, 1.5)})[0]
    np.testing.assert_allclose(got.array(out), want, rtol=1e-4, atol=1e-5)


def _geometry(c: int, h: int, w: int, k: int, stride: int, pad: int) -> tuple[np.ndarray, int,
                                                                               int]:
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    values = (c, h, w, oh, ow, k, k, stride, stride, 1, 1, pad, pad)
    return np.array(values, np.int64), oh, ow


@pytest.mark.parametrize(("k", "stride", "pad"), [(3, 2, 1), (2, 2, 0), (5, 1, 2)])
def test_pooling_matches_the_reference(arm: Arm, k: int, stride: int, pad: int) -> None:
    rng = np.random.default_rng(8)
    n, c, h, w = 2, 3, 17, 14
    x = _random(rng, n, c, h, w)
    geo, oh, ow = _geometry(c, h, w, k, stride, pad)
    # Average pooling counts only the window's positions inside the image.
    inside = np.pad(np.ones((h, w)), pad)
    counts = np.array([[inside[i * stride:i * stride + k, j * stride:j * stride + k].sum()
                        for j in range(ow)] for i in range(oh)], np.float32)
    s = Session(arm)
    bx, bgeo = s.script.array(x), s.script.array(geo)
    ymax, yavg = s.script.zeros(4 * n * c * oh * ow), s.script.zeros(4 * n * c * oh * ow)
    rcs = [s.call("window", "keel_maxpool2d_mt_f32", bx, ymax, bgeo, n * c, 2),
           s.call("window", "keel_avgpool2d_mt_f32", bx, yavg, bgeo, s.script.array(counts),
                  n * c, 2)]
    outs = [s.script.dump(buf, np.float32, (n, c, oh, ow)) for buf in (ymax, yavg)]
    got = s.run()
    assert [got.value(i) for i in rcs] == [0, 0]
    attrs = {"kernel_shape": (k, k), "strides": (stride, stride), "pads": (pad,) * 4}
    want_max = REF.run(Op.MAX_POOL, [x], attrs=attrs)[0]
    want_avg = REF.run(Op.AVG_POOL, [x], attrs=attrs)[0]
    np.testing.assert_array_equal(got.array(outs[0]), want_max)
    np.testing.assert_allclose(got.array(outs[1]), want_avg, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("k", "stride"), [(3, 1), (3, 2), (5, 1)])
def test_depthwise_conv_matches_the_reference(arm: Arm, k: int, stride: int) -> None:
    rng = np.random.default_rng(9)
    n, c, h, w = 2, 6, 15, 40                  # rows of 32+ outputs take the direct path
    x, wt, bias = _random(rng, n, c, h, w), _random(rng, c, 1, k, k), _random(rng, c)
    z_geo, oh, ow = _geometry(c, h, w, k, stride, k // 2)
    z = _random(rng, n, c, oh, ow)
    s = Session(arm)
    bufs = [s.script.array(a) for a in (x, wt, bias, z)]
    y = s.script.zeros(4 * n * c * oh * ow)
    clip = s.script.array(np.array([-2.0, 2.0], np.float32))
    rc = s.call("window", "keel_dwconv2d_mt_f32", *bufs, y, s.script.array(z_geo), clip, 0,
                n * c, 2)
    out = s.script.dump(y, np.float32, (n, c, oh, ow))
    got = s.run()
    assert got.value(rc) == 0
    conv = REF.run(Op.CONV, [x, wt, bias], attrs={
        "group": c, "pads": (k // 2,) * 4, "strides": (stride, stride)})[0]
    np.testing.assert_allclose(got.array(out), np.clip(conv + z, -2.0, 2.0), rtol=1e-5,
                               atol=1e-5)


# ---- attention a query row at a time (fastmath.c) --------------------------------------------
@pytest.mark.parametrize("mask", ["none", "padding", "full", "causal"])
def test_row_attention_matches_the_reference(arm: Arm, mask: str) -> None:
    """keel_attend_rows_f32 on the calling thread and keel_attend_rows_mt_f32 on the pool:
    scaled scores, the mask (read through its strides: outer head, inner head, row), the
    softmax and the weighted sum of V, one query row at a time."""
    rng = np.random.default_rng(13)
    outer, inner, s, t, d, dv = 2, 3, 3, 37, 19, 13     # partial vectors in every width
    q, k, v = (_random(rng, outer, inner, n, width) for n, width in ((s, d), (t, d), (t, dv)))
    inputs, attrs = [q, k, v], {"scale": 0.3, "is_causal": mask == "causal"}
    strides = (0, 0, 0)
    if mask == "padding":           # GPT-2's (outer, 1, 1, t) of 0 and -inf
        pad = np.where(rng.random((outer, 1, 1, t)) < 0.3, -np.inf, 0).astype(np.float32)
        pad[..., -1] = 0
        inputs.append(pad)
        strides = (t, 0, 0)
    elif mask == "full":            # (1, inner, s, t): the same for every outer head
        inputs.append(_random(rng, 1, inner, s, t))
        strides = (0, s * t, t)
    heads = outer * inner
    session = Session(arm)
    bq, bk, bv = (session.script.array(a) for a in (q, k, v))
    bmask = session.script.array(inputs[3]) if len(inputs) == 4 else None
    layout = (inner, s, t, d, dv, *strides)
    causal = int(mask == "causal")
    alone, pooled = (session.script.zeros(4 * heads * s * dv) for _ in range(2))
    rcs = [session.call("fastmath", "keel_attend_rows_f32", bq, bk, bv, bmask, alone, None,
                        *layout, causal, 0, heads, floats=(0.3,)),
           session.call("fastmath", "keel_attend_rows_mt_f32", bq, bk, bv, bmask, pooled,
                        *layout, causal, heads, 2, floats=(0.3,))]
    outs = [session.script.dump(y, np.float32, (outer, inner, s, dv)) for y in (alone, pooled)]
    got = session.run()
    assert [got.value(i) for i in rcs] == [0, 0]
    want = REF.run(Op.ATTENTION, inputs, attrs=attrs)[0]
    np.testing.assert_allclose(got.array(outs[0]), want, rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(got.array(outs[1]), got.array(outs[0]))


# ---- the tree-ensemble walk (trees.c) ---------------------------------------------------------
def test_tree_walk_matches_the_reference(arm: Arm) -> None:
    """keel_tree_leaves_f32 and keel_tree_leaves_mt_f32 walk the forest as
    ``keel.backends.cpu.trees`` lays it out (missing values going false); the leaves they
    reach, summed as the cpu kernel sums them, give the reference's scores."""
    from keel.backends.cpu import trees
    from keel.ops.schema import get_schema
    from keel.ops.schemas.trees import finish_scores, forest_of
    from tests.conformance.cases_ml import _forest

    rng = np.random.default_rng(14)
    attrs = {**_forest(9, 4, 5, 2, 19), "n_targets": 2, "base_values": (0.5, -0.25)}
    x = _random(rng, 23, 5)
    x[rng.random(x.shape) < 0.1] = np.nan
    forest = forest_of(Op.TREE_ENSEMBLE, get_schema(Op.TREE_ENSEMBLE).normalize_attrs(attrs))
    walk = trees._walk_of(forest, x.dtype)
    assert forest.only_leq and not forest.any_missing_true and walk.split.dtype == np.float32
    session = Session(arm)
    bx, feature, split, children, roots = (session.script.array(a) for a in (
        x, walk.feature, walk.split, walk.children, walk.roots))
    shape = (len(walk.roots), x.shape[0])
    alone, pooled = (session.script.zeros(4 * shape[0] * shape[1]) for _ in range(2))
    forest_args = (bx, x.shape[1], feature, split, children, roots, shape[0],
                   2 * forest.n_nodes, forest.depth)
    session.call("trees", "keel_tree_leaves_f32", *forest_args, alone, shape[1], 0, shape[1])
    rc = session.call("trees", "keel_tree_leaves_mt_f32", *forest_args, pooled, shape[1], 2)
    outs = [session.script.dump(leaf, np.int32, shape) for leaf in (alone, pooled)]
    got = session.run()
    assert got.value(rc) == 0
    leaves = got.array(outs[0])
    np.testing.assert_array_equal(got.array(outs[1]), leaves)
    totals = trees._aggregate(forest, forest.leaf_values32, leaves)
    scores = finish_scores(forest, totals, len(forest.roots))
    want = REF.run(Op.TREE_ENSEMBLE, [x], attrs=attrs)[0]
    np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-6)


# ---- the int8 kernels (qgemm.c) ------------------------------------------------------------
class _Int8Calls:
    """Stands in for the loaded int8 library of ``keel.backends.cpu.native_qgemm``: the
    module's own Python code (packing, geometry, zero-point sums, thread split) runs here,
    and each C call it makes becomes a call of the aarch64 build in the session's script.
    Arrays reach it as themselves (``_ptr`` patched) and become script buffers."""

    library = "qgemm"

    def __init__(self, session: Session, panel: int) -> None:
        self.session, self.panel, self.isa = session, panel, 0
        self.buffers: dict[int, tuple[np.ndarray, Buffer]] = {}
        self.calls: list[tuple[str, int]] = []          # (symbol, index of its result)
        for name, symbol in (("matmul", "keel_qmatmul_u8s8"), ("conv", "keel_qconv2d_u8s8"),
                             ("direct", "keel_qconv2d_direct_u8s8"),
                             ("depthwise", "keel_qdepthwise_u8s8"), ("add", "keel_qadd_u8"),
                             ("quantize", "keel_quantize_f32"),
                             ("dequantize", "keel_dequantize_f32")):
            setattr(self, name, self._caller(symbol))
        # The channel-lanes depthwise kernel is AVX-512 only: elsewhere it declines (-2),
        # and the plane-wise kernel runs, as on any build without AVX-512.
        self.depthwise_lanes = self._caller("keel_qdepthwise_cl_u8s8", returns=-2)

    def _buffer(self, value: Any) -> Any:
        if not isinstance(value, np.ndarray):
            return value
        found = self.buffers.get(id(value))
        if found is None:
            found = self.buffers[id(value)] = (value, self.session.script.array(value))
        return found[1]

    def _caller(self, symbol: str, returns: int = 0) -> Any:
        def call(*args: Any) -> int:
            ints = [self._buffer(a) for a in args if not isinstance(a, float)]
            floats = [a for a in args if isinstance(a, float)]      # C float parameters
            index = self.session.call(self.library, symbol, *ints, floats=floats)
            self.calls.append((symbol, index))
            return returns
        return call

    def run(self, result: np.ndarray) -> np.ndarray:
        """Run the script; ``result`` (an array the kernel wrote, or a view of all of it)
        as the aarch64 code left it."""
        (buffer,) = [b for a, b in self.buffers.values() if a.nbytes == result.nbytes
                     and a.ctypes.data == result.ctypes.data]
        out = self.session.script.dump(buffer, result.dtype, result.shape)
        got = self.session.run()
        want = {s: -2 if s == "keel_qdepthwise_cl_u8s8" else 0 for s, _ in self.calls}
        assert {s: got.value(i) for s, i in self.calls} == want
        return got.array(out)


@pytest.fixture
def int8_on_arm(arm: Arm, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Int8Calls]:
    from keel.backends.cpu import native_qgemm

    session = Session(arm)
    panel = session.call("qgemm", "keel_qgemm_panel")
    isa = session.call("qgemm", "keel_qgemm_isa")
    asked = session.run()
    assert asked.value(isa) == 0                       # the portable C path on aarch64
    calls = _Int8Calls(Session(arm), asked.value(panel))
    monkeypatch.setattr(native_qgemm, "_load", lambda: calls)
    monkeypatch.setattr(native_qgemm, "_ptr", lambda a: a)
    native_qgemm._bind.cache_clear()
    native_qgemm._add_arguments.cache_clear()      # it holds addresses made by _ptr
    yield calls
    native_qgemm._add_arguments.cache_clear()


def _int8(op: Op, inputs: list[Any], attrs: dict[str, Any], threads: int = 2) -> np.ndarray:
    from keel.backends.base import DeviceKind, KernelContext
    from keel.backends.cpu.kernels import load as load_cpu
    from keel.ops.schema import get_schema

    kv = load_cpu().get(op, "int8")
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, threads)
    return np.asarray(kv.fn(ctx, inputs, get_schema(op).normalize_attrs(attrs), None)[0])


def _q8(rng: np.random.Generator, dtype: Any, *shape: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


# (x dtype, weight zero points, N, C, H, W, M, k, stride, pad, group): im2col panels,
# the direct layout (stride 1, and stride 2 through its phases), depthwise, compact columns,
# row segments
INT8_CONVS = [(np.uint8, True, 2, 5, 9, 11, 7, 3, 2, 1, 1),
              (np.int8, False, 1, 8, 10, 12, 9, 3, 1, 1, 1),
              (np.uint8, False, 1, 5, 11, 10, 6, 3, 2, 1, 1),
              (np.uint8, False, 2, 6, 11, 13, 6, 3, 1, 1, 6),
              (np.uint8, False, 3, 4, 5, 6, 64, 3, 1, 1, 1),
              (np.uint8, False, 3, 5, 5, 8, 9, 3, 1, 1, 1),
              (np.int8, False, 2, 4, 9, 16, 6, 3, 2, 1, 1)]


@pytest.mark.parametrize("case", INT8_CONVS,
                         ids=["im2col", "direct", "direct-strided", "depthwise", "compact",
                              "rows-of-8", "rows-of-8-strided"])
def test_int8_convolutions_match_the_reference(int8_on_arm: _Int8Calls,
                                               case: tuple[Any, ...]) -> None:
    xdt, wzero, n, c, h, w, m, k, s, p, g = case
    rng = np.random.default_rng(10)
    w_zp = (_q8(rng, np.int8, m) // 8).astype(np.int8) if wzero else np.zeros(m, np.int8)
    inputs = [_q8(rng, xdt, n, c, h, w), np.array(0.05, np.float32),
              np.array(7 if xdt is np.uint8 else -3, xdt), _q8(rng, np.int8, m, c // g, k, k),
              rng.uniform(0.002, 0.02, m).astype(np.float32), w_zp, np.array(0.4, np.float32),
              np.array(100, np.uint8), rng.integers(-5000, 5000, m).astype(np.int32)]
    attrs = {"strides": [s, s], "pads": [p] * 4, "group": g}
    got = int8_on_arm.run(_int8(Op.QLINEAR_CONV, inputs, attrs))
    want = REF.run(Op.QLINEAR_CONV, inputs, attrs=attrs)[0]
    np.testing.assert_array_equal(got, want)


def test_int8_matmul_matches_the_reference(int8_on_arm: _Int8Calls) -> None:
    rng = np.random.default_rng(11)
    rows, k, n = 7, 70, 67                     # partial panels and a depth past a multiple of 4
    inputs = [_q8(rng, np.uint8, rows, k), np.array(0.05, np.float32), np.array(3, np.uint8),
              _q8(rng, np.int8, k, n), rng.uniform(0.002, 0.02, n).astype(np.float32),
              (_q8(rng, np.int8, n) // 16).astype(np.int8), np.array(0.7, np.float32),
              np.array(-4, np.int8)]
    got = int8_on_arm.run(_int8(Op.QLINEAR_MATMUL, inputs, {}))
    np.testing.assert_array_equal(got, REF.run(Op.QLINEAR_MATMUL, inputs)[0])


def test_int8_residual_join_matches_the_reference(int8_on_arm: _Int8Calls) -> None:
    rng = np.random.default_rng(12)
    shape = (2, 9, 7, 5)                       # odd sizes: partial vectors
    inputs = [_q8(rng, np.uint8, *shape), np.array(0.021, np.float32), np.array(5, np.uint8),
              _q8(rng, np.int8, *shape), np.array(0.034, np.float32), np.array(2, np.int8),
              np.array(0.047, np.float32), np.array(9, np.uint8)]
    attrs = {"activation": "relu"}
    got = int8_on_arm.run(_int8(Op.QLINEAR_ADD, inputs, attrs))
    np.testing.assert_array_equal(got, REF.run(Op.QLINEAR_ADD, inputs, attrs=attrs)[0])


@pytest.mark.parametrize("zp", [np.array(7, np.uint8), np.array(-3, np.int8)],
                         ids=["uint8", "int8"])
def test_quantize_linear_matches_the_reference(int8_on_arm: _Int8Calls, zp: Any) -> None:
    rng = np.random.default_rng(13)
    x = rng.uniform(-90, 90, (3, 5, 67)).astype(np.float32)      # odd size: a partial run
    x.reshape(-1)[:12] = [np.nan, np.inf, -np.inf, 3e9, 0.25, 0.75, -0.25, -1.25, 62.25,
                          60.75, -64.25, -61.75]                 # ties, some at the clamps
    inputs = [x, np.array(0.5, np.float32), zp]
    got = int8_on_arm.run(_int8(Op.QUANTIZE_LINEAR, inputs, {}))
    np.testing.assert_array_equal(got, REF.run(Op.QUANTIZE_LINEAR, inputs)[0])


@pytest.mark.parametrize("dt, zp", [(np.uint8, 131), (np.int8, -5)], ids=["uint8", "int8"])
def test_dequantize_linear_matches_the_reference(int8_on_arm: _Int8Calls, dt: Any,
                                                 zp: int) -> None:
    inputs = [_q8(np.random.default_rng(14), dt, 3, 5, 67), np.array(0.0371, np.float32),
              np.array(zp, dt)]
    got = int8_on_arm.run(_int8(Op.DEQUANTIZE_LINEAR, inputs, {}))
    np.testing.assert_array_equal(got, REF.run(Op.DEQUANTIZE_LINEAR, inputs)[0])


# ---- the channels-last int8 kernels (qlayout.c) ---------------------------------------------
class _LayoutCalls(_Int8Calls):
    """``keel.backends.cpu.qlayout``'s library on aarch64, as _Int8Calls is qgemm's."""

    library = "qlayout"

    def __init__(self, session: Session) -> None:
        super().__init__(session, 0)
        for name, symbol in (("transpose", "keel_qtranspose_u8"),
                             ("depthwise", "keel_qdepthwise_nhwc_u8s8"),
                             ("pointwise", "keel_qpointwise_nhwc_u8s8"),
                             ("global_average", "keel_qglobal_avgpool_u8"),
                             ("dense", "keel_qconv_nhwc_u8s8"),
                             ("max_pool", "keel_qmaxpool_nhwc_8")):
            setattr(self, name, self._caller(symbol))


@pytest.fixture
def layout_on_arm(arm: Arm, int8_on_arm: _Int8Calls,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[_LayoutCalls]:
    from keel.backends.cpu import qlayout

    calls = _LayoutCalls(Session(arm))
    monkeypatch.setattr(qlayout, "_load", lambda: calls)
    monkeypatch.setattr(qlayout, "_ptr", lambda a: a)
    yield calls


# (N, C, H, W, M, k, stride, pad, group): a depthwise layer, a 1x1 convolution on the
# channels-last panels and a dense 3x3 one on their indirect product, with partial
# channel blocks and pixels past whole tiles
LAYOUT_CONVS = [(2, 40, 7, 9, 40, 3, 2, 1, 40), (1, 36, 5, 5, 70, 1, 1, 0, 1),
                (2, 16, 7, 6, 40, 3, 2, 1, 1)]
LAYOUT_SYMBOLS = ["keel_qdepthwise_nhwc_u8s8", "keel_qpointwise_nhwc_u8s8",
                  "keel_qconv_nhwc_u8s8"]


@pytest.mark.parametrize(("case", "symbol"), list(zip(LAYOUT_CONVS, LAYOUT_SYMBOLS, strict=True)),
                         ids=["depthwise", "pointwise", "dense"])
def test_channels_last_int8_convolutions_match_the_reference(
        layout_on_arm: _LayoutCalls, case: tuple[int, ...], symbol: str) -> None:
    from keel.backends.base import DeviceKind, KernelContext
    from keel.backends.cpu.kernels import load as load_cpu
    from keel.backends.plan import NodePlan
    from keel.ops.schema import get_schema

    n, c, h, w, m, k, s, p, g = case
    rng = np.random.default_rng(14)
    x = _q8(rng, np.uint8, n, c, h, w)
    inputs = [np.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(x.shape),
              np.array(0.05, np.float32), np.array(7, np.uint8),
              _q8(rng, np.int8, m, c // g, k, k), rng.uniform(0.002, 0.02, m).astype(np.float32),
              np.zeros(m, np.int8), np.array(0.4, np.float32), np.array(100, np.uint8),
              rng.integers(-5000, 5000, m).astype(np.int32)]
    attrs = get_schema(Op.QLINEAR_CONV).normalize_attrs(
        {"strides": [s, s], "pads": [p] * 4, "group": g})
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, 2,
                        plan=NodePlan(variant="int8", layout="nhwc->nhwc", threads=2))
    y = np.asarray(load_cpu().get(Op.QLINEAR_CONV, "int8").fn(ctx, inputs, attrs, None)[0])
    assert {called for called, _ in layout_on_arm.calls} == {symbol}
    got = layout_on_arm.run(y)
    want = REF.run(Op.QLINEAR_CONV, [x, *inputs[1:]], attrs=attrs)[0]
    np.testing.assert_array_equal(got.reshape(n, *want.shape[2:], m).transpose(0, 3, 1, 2), want)


def test_channels_last_max_pool_matches_the_reference(layout_on_arm: _LayoutCalls) -> None:
    from keel.backends.base import DeviceKind, KernelContext
    from keel.backends.cpu.kernels import load as load_cpu
    from keel.backends.plan import NodePlan
    from keel.ops.schema import get_schema

    x = _q8(np.random.default_rng(17), np.int8, 2, 70, 7, 6)     # past a 64-byte vector
    attrs = get_schema(Op.MAX_POOL).normalize_attrs(
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})
    want = REF.run(Op.MAX_POOL, [x], attrs=attrs)[0]
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, 2,
                        plan=NodePlan(variant="int8", layout="nhwc->nhwc", threads=2))
    stored = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(x.shape)
    y = np.asarray(load_cpu().get(Op.MAX_POOL, "int8").fn(ctx, [stored], attrs,
                                                           [np.empty_like(want)])[0])
    assert {called for called, _ in layout_on_arm.calls} == {"keel_qmaxpool_nhwc_8"}
    got = layout_on_arm.run(y)
    n, c, oh, ow = want.shape
    np.testing.assert_array_equal(got.reshape(n, oh, ow, c).transpose(0, 3, 1, 2), want)


def test_layout_change_matches_numpy(layout_on_arm: _LayoutCalls) -> None:
    from keel.backends.cpu import qlayout

    x = _q8(np.random.default_rng(15), np.uint8, 2, 35, 6, 7)     # partial 32-row strips
    got = layout_on_arm.run(qlayout.to_nhwc(x, threads=2))
    np.testing.assert_array_equal(got, x.transpose(0, 2, 3, 1))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_integer_global_average_pool_matches_the_reference(layout_on_arm: _LayoutCalls,
                                                           layout: str) -> None:
    from keel.backends.base import DeviceKind, KernelContext
    from keel.backends.cpu.kernels import load as load_cpu
    from keel.backends.plan import NodePlan

    rng = np.random.default_rng(16)
    x = _q8(rng, np.int8, 3, 37, 5, 7)                  # a partial vector of channels
    stored = x if layout == "nchw" else np.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(
        x.shape)
    params = [np.array(0.07, np.float32), np.array(-6, np.int8), np.array(0.02, np.float32),
              np.array(11, np.int8)]
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, 2,
                        plan=NodePlan(variant="int8", layout=f"{layout}->nchw", threads=2))
    y = np.asarray(load_cpu().get(Op.QLINEAR_GLOBAL_AVG_POOL, "int8").fn(
        ctx, [stored, *params], {}, None)[0])
    assert {symbol for symbol, _ in layout_on_arm.calls} == {"keel_qglobal_avgpool_u8"}
    got = layout_on_arm.run(y)
    np.testing.assert_array_equal(got, REF.run(Op.QLINEAR_GLOBAL_AVG_POOL, [x, *params])[0])
