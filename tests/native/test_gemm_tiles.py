"""The native GEMM split in two dimensions (gemm.c's keel_gemm_tiles_f32): every grid of
tiles, any division of them over threads and the planner's grid on 1 to 16 threads give
bitwise the same C, equal to NumPy's product within float32 rounding, through each of the
kernel's paths (packed and raw operands, a batch of products, tall tiles, one row, a
residual, accumulation). A packed B fetched ahead by the first row panel (the cpu planner's
fetch_rows, in the call's flags) gives the bits of the same call without it, the fetches
running past the array's end; a model's weight products match the reference backend."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from keel import native
from keel.backends.cpu import native_gemm as ng
from keel.backends.cpu import planner as cpu_planner
from keel.execution.model import load_model

RNG = np.random.default_rng(11)
THREADS = (1, 2, 3, 4, 8, 16)


pytestmark = pytest.mark.usefixtures("native_gemm_tier")


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


class Case(NamedTuple):
    call: ng.Call
    c: np.ndarray
    want: np.ndarray
    a: Any                        # kept alive: a prepared call does not hold its A


def _matmul() -> Case:
    """A MatMul node's product: raw activations on the left, the packed weight, a bias
    per column and a ReLU."""
    a, b, bias = _f(100, 300), _f(300, 200), _f(200)
    c = np.empty((100, 200), np.float32)
    call = ng.prepare(a, ng.pack(b, left=False), c, bias=bias, clip=(0.0, np.inf))
    return Case(call, c, np.maximum(a @ b + bias, 0), a)


def _pointwise() -> Case:
    """A 1x1 conv: the packed filter on the left, the raw image, a bias per row and a
    residual (rows first: B read in place)."""
    w, x, bias, r = _f(96, 64), _f(64, 300), _f(96), _f(96, 300)
    c = np.empty((96, 300), np.float32)
    wp = ng.pack(w, left=True)
    call = ng.prepare(wp, x, c, bias=bias, bias_rows=True, residual=r)
    return Case(call, c, w @ x + bias[:, None] + r, wp)


def _batched() -> Case:
    """Five products sharing the packed left operand (a conv over a batch of images)."""
    w, x = _f(40, 72), _f(5, 72, 90)
    c = np.empty((5, 40, 90), np.float32)
    wp = ng.pack(w, left=True)
    call = ng.prepare(wp, x, c)
    return Case(call, c, w @ x, wp)


def _tall() -> Case:
    """16 rows against a raw B of contiguous rows: gemm.c's tall tiles (with AVX-512)."""
    w, x = _f(16, 96), _f(96, 1000)
    c = np.empty((16, 1000), np.float32)
    wp = ng.pack(w, left=True)
    assert ng.planner_rules().tall_tiles(16, 96)
    call = ng.prepare(wp, x, c, clip=(-1.0, 1.0))
    return Case(call, c, np.clip(w @ x, -1.0, 1.0), wp)


def _lanes() -> Case:
    """A 1x1 conv on a 7x7 map: 49 columns against 200 rows (a last block of 8 rows, one
    row panel), a bias per row, a residual and a clip: gemm.c's lanes tiles (with AVX-512)."""
    w, x, bias, r = _f(200, 150), _f(150, 49), _f(200), _f(200, 49)
    c = np.empty((200, 49), np.float32)
    wp = ng.pack(w, left=True)
    assert ng.planner_rules().lanes_tiles(1, 200, 49, 150, grid=(8, 32))
    call = ng.prepare(wp, x, c, bias=bias, bias_rows=True, residual=r, clip=(-2.0, 2.0))
    return Case(call, c, np.clip(w @ x + bias[:, None] + r, -2.0, 2.0), wp)


def _lanes_tail() -> Case:
    """A 1x1 conv expanding on a 14x14 map: 196 columns (six whole column panels and 4
    columns) against 70 rows (two blocks of 32 and 6 rows, a partial row panel), a bias
    per row, a residual and a clip: the panels in 8 x 32 tiles, the last 4 columns in
    lanes tiles (KEEL_LANES_TAIL, with AVX-512)."""
    w, x, bias, r = _f(70, 48), _f(48, 196), _f(70), _f(70, 196)
    c = np.empty((70, 196), np.float32)
    wp = ng.pack(w, left=True)
    assert ng.planner_rules().lanes_tail(70, 196, 48, (8, 32), "Intel")
    assert not ng.planner_rules().lanes_tiles(1, 70, 196, 48, "Intel", (8, 32))
    call = ng.prepare(wp, x, c, bias=bias, bias_rows=True, residual=r, clip=(-2.0, 2.0),
                      lanes=False)
    return Case(call, c, np.clip(w @ x + bias[:, None] + r, -2.0, 2.0), wp)


def _one_row() -> Case:
    a, b = _f(1, 900), _f(900, 700)
    c = np.empty((1, 700), np.float32)
    call = ng.prepare(a, ng.pack(b, left=False), c)
    return Case(call, c, a @ b, a)


def _deep() -> Case:
    """A packed B between one and two depth blocks deep (an MLP's 784-wide layer): a tile
    whose rows' A of the whole depth fits the workspace runs it in one block, A packed
    once for every column block; the whole 240 rows do not fit, so grids of one row group
    run two blocks and grids of more run one."""
    depth = ng.depth_block() + 272
    a, b, bias = _f(240, depth), _f(depth, 600), _f(600)
    c = np.empty((240, 600), np.float32)
    call = ng.prepare(a, ng.pack(b, left=False), c, bias=bias, clip=(0.0, np.inf))
    return Case(call, c, np.maximum(a @ b + bias, 0), a)


def _accumulate() -> Case:
    """C += A @ B over a raw A and a raw strided B (both packed block by block)."""
    a, b = _f(70, 600), _f(130, 600).T
    c = np.empty((70, 130), np.float32)
    call = ng.prepare(a, b, c, accumulate=True)
    return Case(call, c, a @ b, a)


CASES: dict[str, Callable[[], Case]] = {
    "matmul": _matmul, "pointwise": _pointwise, "batched": _batched, "tall": _tall,
    "lanes": _lanes, "lanes_tail": _lanes_tail, "one_row": _one_row,
    "accumulate": _accumulate, "deep": _deep}


def _run(call: ng.Call, c: np.ndarray, go: Callable[[], Any], start: np.ndarray) -> np.ndarray:
    c[...] = start
    go()
    return c.copy()


def _start(name: str, c: np.ndarray) -> np.ndarray:
    """What C holds before a run: ones where the product accumulates, else NaN (every
    element must be written)."""
    return np.ones_like(c) if name == "accumulate" else np.full_like(c, np.nan)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_planners_grid_gives_the_same_bits_on_every_thread_count(name: str) -> None:
    call, c, want, _keep = CASES[name]()
    start = _start(name, c)
    expected = want + start if name == "accumulate" else want
    first = _run(call, c, lambda: call.run(1), start)
    np.testing.assert_allclose(first, expected, rtol=2e-4, atol=2e-4)
    splits = set()
    for threads in THREADS[1:]:
        split = call.split(threads)
        splits.add((split.rows, split.cols))
        assert split.parts <= threads and split.pieces == call.batch * split.rows * split.cols
        got = _run(call, c, call.bound(threads), start)
        np.testing.assert_array_equal(got, first, err_msg=f"{threads} threads: {split.reason}")
        got = _run(call, c, lambda t=threads: call.run(t), start)
        np.testing.assert_array_equal(got, first, err_msg=f"{threads} threads (run)")
    assert len(splits) > 1                  # the grid follows the thread count


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_grid_and_division_gives_the_same_bits(name: str) -> None:
    call, c, _, _keep = CASES[name]()
    start = _start(name, c)
    first = _run(call, c, lambda: call.run(1), start)
    f = call.f
    mp, np_ = -(-call.m // f.mr), -(-call.n // f.nr)
    for r in sorted({1, 2, 3, mp}):
        for cg in sorted({1, 2, 5, np_}):
            if r > mp or cg > np_:
                continue
            units = call.batch * r * cg
            for parts in sorted({1, 2, 3, units}):
                got = _run(call, c, lambda r=r, cg=cg, units=units, parts=parts: f.tiles_mt(
                    call.args, r, cg, units, parts), start)
                np.testing.assert_array_equal(got, first, err_msg=f"{r}x{cg} in {parts}")


def test_a_grid_of_more_groups_than_panels_leaves_nothing_out() -> None:
    """Groups of no panel (more groups than panels) are empty tiles, not errors."""
    call, c, _, _keep = _matmul()
    start = _start("matmul", c)
    first = _run(call, c, lambda: call.run(1), start)
    mp, np_ = -(-call.m // call.f.mr), -(-call.n // call.f.nr)
    units = (mp + 3) * (np_ + 2)
    got = _run(call, c, lambda: call.f.tiles_mt(call.args, mp + 3, np_ + 2, units, 4), start)
    np.testing.assert_array_equal(got, first)


@pytest.mark.parametrize("shape", [(200, 150, 49), (320, 960, 49), (40, 70, 13), (96, 576, 196),
                                   (33, 5, 7), (64, 384, 784)])
def test_lanes_tiles_give_the_bits_of_the_panels(shape: tuple[int, int, int]) -> None:
    """C's rows in the lanes (KEEL_LANES) compute each element as the 8 x 32 panels and
    the tall tiles do: the same bits, whichever the planner picks for a shape."""
    m, k, n = shape
    w, x, bias, r = _f(m, k), _f(k, n), _f(m), _f(m, n)
    c = np.empty((m, n), np.float32)
    wp = ng.pack(w, left=True)
    call = ng.prepare(wp, x, c, bias=bias, bias_rows=True, residual=r, clip=(-3.0, 3.0))
    assert call is not None
    results = []
    for flags in (64, 32, 0):          # lanes, tall, panels
        values = list(call.values)
        values[22] = values[22] & ~(64 | 32) | flags
        ng.Call(call.f, tuple(values), 1, m, n, k, call.keep, call.c_layout).run(1)
        results.append(c.copy())
    np.testing.assert_allclose(results[0], np.clip(w @ x + bias[:, None] + r, -3, 3),
                               rtol=2e-4, atol=2e-4)
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


@pytest.mark.parametrize("shape", [(200, 150, 49), (40, 70, 13), (96, 576, 196),
                                   (33, 5, 7), (1280, 320, 49), (24, 100, 30)])
def test_lanes_tiles_give_the_same_bits_with_a_in_16_row_panels_only(
        shape: tuple[int, int, int]) -> None:
    """Lanes tiles reading A packed in 16-row panels only (pack_a16, the planner's
    lanes_a16) compute each element as they do from 8-row panels, on every grid and
    division of the rows (a range starting inside a pair of panels reads its halves),
    with an odd count of row panels (the last pair half zeros) and a partial last block
    of rows; a call the 16-row panels do not serve reads 8-row ones made from them."""
    if ng.geometry() != (8, 32):
        pytest.skip("lanes tiles are built only with AVX-512 8 x 32 tiles; this build's "
                    f"tile is {ng.geometry()}")
    m, k, n = shape
    w, x, bias, r = _f(m, k), _f(k, n), _f(m), _f(m, n)
    c = np.empty((m, n), np.float32)
    eight, wide = ng.pack(w, left=True), ng.pack_a16(w)
    assert eight is not None and wide is not None
    assert wide.width == 16 and wide.nbytes == 4 * -(-m // 16) * 16 * k
    calls = [ng.prepare(a, x, c, bias=bias, bias_rows=True, residual=r, clip=(-3.0, 3.0),
                        lanes=lanes) for a, lanes in ((wide, True), (eight, True),
                                                       (wide, False))]
    assert all(call is not None for call in calls)
    field = ng._FLAGS_FIELD + 1                 # where the 16-row panels' address sits
    assert calls[0].values[field] == calls[0].values[ng._A_FIELD] == wide.address
    assert calls[2].values[field] == 0 and calls[2].values[ng._A_FIELD] != wide.address
    want = np.clip(w @ x + bias[:, None] + r, -3, 3)
    mp = -(-m // 8)
    results = []
    for each in calls:
        for threads in (1, 2, 3, 16):
            c[...] = np.nan
            each.run(threads)
            results.append(c.copy())
        for rows in sorted({1, 2, 3, mp}):
            c[...] = np.nan
            each.f.tiles_mt(each.args, rows, 1, rows, rows)
            results.append(c.copy())
    np.testing.assert_allclose(results[0], want, rtol=2e-4, atol=2e-4)
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    # The kernel reads the 16-row panels: zeroed ones leave only the epilogue's terms.
    zeros = np.zeros_like(wide.data)
    values = list(calls[0].values)
    values[ng._A_FIELD] = values[field] = native.address(zeros)
    c[...] = np.nan
    ng.Call(calls[0].f, tuple(values), 1, m, n, k, (*calls[0].keep, zeros),
            calls[0].c_layout).run(1)
    np.testing.assert_array_equal(c, np.clip(bias[:, None] + r, -3, 3))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_block_of_rows_reads_a_in_16_row_panels_from_its_own_rows(batch: int) -> None:
    """gemm.c's keel_gemm_block_f32 (row panels [r_lo, r_hi) of a prepared call against
    the caller's B, Winograd's entry) on an A packed in 16-row panels only gives each
    block the bits of the same block of 8-row panels: a block starting on an odd panel,
    inside a pair, too, and the last, partial, pair."""
    if ng.geometry() != (8, 32):
        pytest.skip("lanes tiles are built only with AVX-512 8 x 32 tiles; this build's "
                    f"tile is {ng.geometry()}")
    lib = native.library("gemm")
    assert lib is not None
    i8 = ctypes.c_int64
    block = lib.function("keel_gemm_block_f32", [ctypes.c_char_p, ctypes.c_void_p] + [i8] * 3
                         + [ctypes.c_void_p, i8, i8, ctypes.c_void_p, i8, i8, i8], None)
    m, k, n = 72, 20, 13                    # nine row panels: the last pair half zeros
    w, x = _f(m, k), _f(batch, k, n)
    eight, wide = ng.pack(w, left=True), ng.pack_a16(w)
    calls = [ng.prepare(a, x[0], np.empty((m, n), np.float32), lanes=True)
             for a in (eight, wide)]
    assert all(call is not None for call in calls)
    assert calls[1].values[ng._FLAGS_FIELD + 1] == wide.address
    work = ng._work(calls[0].f)
    mp = m // 8
    for r_lo in range(mp):
        for r_hi in range(r_lo + 1, mp + 1):
            rows = 8 * (r_hi - r_lo)
            got = []
            for call in calls:
                c = np.full((batch, rows, n), np.nan, np.float32)
                block(call.args, work, batch, r_lo, r_hi, native.address(x), n, k * n,
                      native.address(c), n, rows * n, n)
                got.append(c)
            want = np.einsum("mk,bkn->bmn", w[8 * r_lo:8 * r_hi], x)
            np.testing.assert_allclose(got[0], want, rtol=2e-4, atol=2e-4)
            np.testing.assert_array_equal(got[1], got[0], err_msg=f"rows {r_lo}..{r_hi}")


# (m, k, n, batch): tails of 1 to 8 columns, rows in whole and partial blocks of 32 and
# row panels of 8, depths past one and two of the kernel's blocks (KC 512), a batch.
TAILS = [(96, 64, 196, 1), (576, 96, 196, 1), (33, 20, 33, 1), (40, 70, 72, 1),
         (100, 600, 40, 1), (64, 1100, 70, 1), (48, 30, 101, 3), (35, 16, 8, 1)]


@pytest.mark.parametrize("shape", TAILS)
def test_a_lanes_tail_gives_the_bits_of_the_panels(shape: tuple[int, int, int, int]) -> None:
    """The partly filled last column panel in lanes tiles (KEEL_LANES_TAIL) computes each
    element as the 8 x 32 tiles do: the same bits with and without it, on every grid the
    thread counts give."""
    if ng.geometry() != (8, 32):
        pytest.skip("lanes tiles are built only with AVX-512 8 x 32 tiles (gemm.c ignores "
                    f"KEEL_LANES_TAIL elsewhere); this build's tile is {ng.geometry()}")
    m, k, n, batch = shape
    w, x, bias, r = _f(m, k), _f(batch, k, n), _f(m), _f(batch, m, n)
    c = np.empty((batch, m, n), np.float32)
    wp = ng.pack(w, left=True)
    call = ng.prepare(wp, x if batch > 1 else x[0], c if batch > 1 else c[0], bias=bias,
                      bias_rows=True, residual=r if batch > 1 else r[0], clip=(-3.0, 3.0),
                      lanes=False)
    assert call is not None
    field = ng._FLAGS_FIELD
    results = []
    for tail in (ng._LANES_TAIL, 0):
        flags = int(call.values[field]) & ~ng._LANES_TAIL | tail
        values = (*call.values[:field], flags, *call.values[field + 1:])
        with_tail = ng.Call(call.f, values, call.batch, m, n, k, call.keep, call.c_layout)
        for threads in (1, 2, 3, 16):
            c[...] = np.nan
            with_tail.run(threads)
            results.append(c.copy())
    np.testing.assert_allclose(results[0], np.clip(w @ x + bias[:, None] + r, -3, 3),
                               rtol=2e-4, atol=2e-4)
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


def test_a_matmuls_product_never_takes_the_lanes_tail() -> None:
    """Lanes tiles read a packed A and a raw B (a conv's filter on the left): a MatMul's
    product, its activation A raw and its weight B packed, keeps its partly filled last
    panel in 8 x 32 tiles even where lanes_tail's shape holds, so its plan has no lanes
    tail to state; the same shape as a conv's product takes it."""
    m, k, n = 70, 48, 196
    if not ng.planner_rules().lanes_tail(m, n, k):
        pytest.skip("lanes_tail is planned on AVX-512 8 x 32 tiles of LANES_TAIL_VENDORS only")
    a, b = _f(m, k), _f(k, n)
    c = np.empty((m, n), np.float32)
    matmul = ng.prepare(a, ng.pack(b, left=False), c)
    conv = ng.prepare(ng.pack(a, left=True), b, c)
    assert matmul is not None and conv is not None
    assert not int(matmul.values[ng._FLAGS_FIELD]) & ng._LANES_TAIL
    assert int(conv.values[ng._FLAGS_FIELD]) & ng._LANES_TAIL


# ---- a packed B fetched ahead (gemm.c's column_panel) ----------------------------------

def _fetching(call: ng.Call, rows: int) -> ng.Call:
    """``call`` with ``rows`` fetched ahead instead of the planner's."""
    field = ng._FLAGS_FIELD
    flags = int(call.values[field]) & ((1 << ng._FETCH_SHIFT) - 1) | rows << ng._FETCH_SHIFT
    values = (*call.values[:field], flags, *call.values[field + 1:])
    return ng.Call(call.f, values, call.batch, call.m, call.n, call.k, call.keep,
                   call.c_layout)


# (m, k, n): whole and partial row and column panels, a depth of one row, depths past
# one and two blocks of the kernel (KC 512), and a product of many row panels.
SHAPES = [(32, 784, 512), (32, 256, 10), (9, 1, 33), (24, 40, 100), (8, 1100, 64),
          (70, 300, 200), (3, 2000, 40)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_a_packed_b_fetched_ahead_gives_the_same_bits(m: int, k: int, n: int) -> None:
    a, b, bias = _f(m, k), _f(k, n), _f(n)
    c = np.empty((m, n), np.float32)
    call = ng.prepare(a, ng.pack(b, left=False), c, bias=bias, clip=(0.0, np.inf))
    assert call is not None
    planned = cpu_planner.fetch_rows(4 * call.f.nr)
    assert int(call.values[ng._FLAGS_FIELD]) >> ng._FETCH_SHIFT == planned > 0
    want = np.maximum(a.astype(np.float64) @ b.astype(np.float64) + bias, 0)
    results = []
    for rows in (0, 1, planned, 64, 4096):
        for threads in (1, 2, 3, 16):
            c[...] = np.nan
            _fetching(call, rows).run(threads)
            results.append(c.copy())
    np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-4)
    for r in results[1:]:
        assert np.array_equal(r, results[0])


def test_a_raw_b_carries_no_fetch() -> None:
    a, b = _f(16, 64), _f(64, 48)
    c = np.empty((16, 48), np.float32)
    call = ng.prepare(a, b, c)
    assert call is not None
    assert int(call.values[ng._FLAGS_FIELD]) >> ng._FETCH_SHIFT == 0


def test_fetch_rows_cover_the_planned_bytes() -> None:
    assert cpu_planner.fetch_rows(128) * 128 == cpu_planner.FETCH_AHEAD_BYTES
    assert cpu_planner.fetch_rows(4 * cpu_planner.FETCH_AHEAD_BYTES) == 1


def _mlp() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 300])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 40])
    inits = [numpy_helper.from_array(_f(300, 200), "w1"), numpy_helper.from_array(_f(200), "b1"),
             numpy_helper.from_array(_f(40, 200), "w2"), numpy_helper.from_array(_f(40), "b2")]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "fetch", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_a_models_weight_products_match_the_reference_on_every_thread_count() -> None:
    model, x = _mlp(), {"x": _f(32, 300)}
    want = load_model(model, backend="reference").predict(x)["y"]
    got = {t: load_model(model, backend="cpu", threads=t) for t in (1, 2, 3, 16)}
    outs = [m.predict(x)["y"] for m in got.values()]
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-3)
    for out in outs[1:]:
        assert np.array_equal(out, outs[0])
    assert "fetch_rows, FETCH_AHEAD_BYTES" in got[1].explain()

