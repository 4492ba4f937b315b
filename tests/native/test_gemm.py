"""The native float32 GEMM (keel/native/src/gemm.c, backends/cpu/native_gemm.py) and the
cpu MatMul / Gemm / Conv kernels that run on it: every tile remainder, strided and
transposed operands, the fused epilogue (bias, residual, alpha, clip) with NaN and
infinity, bitwise equality for any thread split and with or without packing, against
float64 NumPy, the reference backend and onnxruntime."""

from __future__ import annotations

import ctypes
import itertools
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keel import native
from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import conv as cpu_conv
from keel.backends.cpu import matmul as cpu_matmul
from keel.backends.cpu import native_gemm as ng
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu import workspace
from keel.backends.cpu.backend import CpuBackend
from keel.backends.cpu.conv_rules import conv_case, pick
from keel.backends.reference.backend import ReferenceBackend
from keel.execution.model import load_model
from keel.ops.registry import Op
from keel.ops.schema import get_schema

pytestmark = pytest.mark.usefixtures("native_gemm_tier")


@pytest.fixture
def split_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let even tiny products split over threads, so chunk edges fall anywhere."""
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _ref(a: np.ndarray, b: np.ndarray, alpha: float = 1.0, bias: Any = None,
         res: Any = None, clip: tuple[float, float] | None = None) -> np.ndarray:
    y = alpha * (a.astype(np.float64) @ b.astype(np.float64))
    if bias is not None:
        y = y + bias
    if res is not None:
        y = y + res
    if clip is not None:
        y = np.minimum(np.maximum(y, clip[0]), clip[1])
    return y


def _close(y: np.ndarray, want: np.ndarray, k: int) -> None:
    """float32 accumulation over k terms of unit-variance products."""
    tol = 1e-5 * (1 + np.sqrt(max(k, 1))) * 4
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol)


def _pack(x: np.ndarray, left: bool) -> ng.Packed:
    packed = ng.pack(x, left=left)
    assert packed is not None
    return packed


def _mr_nr() -> tuple[int, int]:
    geo = ng.geometry()
    assert geo is not None
    return geo


# ---- the kernel against float64 -----------------------------------------------------------
def _sizes(tile: int) -> list[int]:
    """1 .. 40 and every remainder of the tile just above it."""
    return sorted(set(range(1, 41)) | {tile * 3 - 1, tile * 3, tile * 3 + 1})


def test_every_row_remainder() -> None:
    rng = np.random.default_rng(0)
    mr, _ = _mr_nr()
    b = _rand(rng, 37, 45)
    packed = _pack(b, left=False)
    for m in _sizes(mr):
        a = _rand(rng, m, 37)
        y = np.full((m, 45), np.nan, np.float32)
        assert ng.gemm(a, packed, y)
        _close(y, _ref(a, b), 37)


def test_every_column_remainder() -> None:
    rng = np.random.default_rng(1)
    mr, nr = _mr_nr()
    a = _rand(rng, 2 * mr + 3, 29)
    for n in _sizes(nr):
        b = _rand(rng, 29, n)
        y = np.full((a.shape[0], n), np.nan, np.float32)
        assert ng.gemm(a, _pack(b, left=False), y)
        _close(y, _ref(a, b), 29)


@pytest.mark.parametrize("k", [*range(1, 41), 255, 256, 257, 511, 512, 513, 784])
def test_every_depth(k: int) -> None:
    """Depth blocks (KC = 256): each block's partial sums go through C and come back."""
    rng = np.random.default_rng(k)
    a, b = _rand(rng, 11, k), _rand(rng, k, 35)
    y = np.empty((11, 35), np.float32)
    assert ng.gemm(a, _pack(b, left=False), y)
    _close(y, _ref(a, b), k)


def test_random_shapes_both_packing_sides() -> None:
    rng = np.random.default_rng(2)
    for _ in range(60):
        m, k, n = (int(x) for x in rng.integers(1, 90, size=3))
        a, b = _rand(rng, m, k), _rand(rng, k, n)
        want = _ref(a, b)
        for left, right in ((a, _pack(b, left=False)), (_pack(a, left=True), b),
                            (a, b)):
            y = np.empty((m, n), np.float32)
            assert ng.gemm(left, right, y)
            _close(y, want, k)


def test_single_row_every_column_remainder_and_layout() -> None:
    """One row of A (a matrix times a vector) has its own path: pairs of panels."""
    rng = np.random.default_rng(23)
    _, nr = _mr_nr()
    for n in [*range(1, 2 * nr + 2), 3 * nr + 1, 512]:
        for k in (1, 7, 600):
            a, b = _rand(rng, 1, k), _rand(rng, k, n)
            bias = _rand(rng, n)
            want = _ref(a, b, 0.5, bias, clip=(-0.2, np.inf))
            fortran = np.asfortranarray(b)
            outs = []
            for left, right in ((a, _pack(b, left=False)), (a, b), (_pack(a, left=True), b),
                                (a[:, ::-1][:, ::-1], fortran)):
                y = np.empty((1, n), np.float32)
                assert ng.gemm(left, right, y, bias=bias, alpha=0.5, clip=(-0.2, np.inf))
                outs.append(y)
            _close(outs[0], want, k)
            for y in outs[1:]:                  # every layout of B: the same arithmetic
                np.testing.assert_array_equal(y, outs[0])
            start = _rand(rng, 1, n)
            y = start.copy()
            assert ng.gemm(a, b, y, accumulate=True)
            _close(y, _ref(a, b, res=start), k)


def test_model_shapes() -> None:
    rng = np.random.default_rng(3)
    for m, k, n in [(32, 784, 512), (1, 784, 512), (32, 256, 10), (64, 576, 300),
                    (16, 144, 1024)]:
        a, b = _rand(rng, m, k), _rand(rng, k, n)
        y = np.empty((m, n), np.float32)
        assert ng.gemm(a, _pack(b, left=False), y)
        _close(y, _ref(a, b), k)


def test_empty_depth_gives_the_epilogue_of_zero() -> None:
    a, b = np.empty((3, 0), np.float32), np.empty((0, 5), np.float32)
    bias = np.arange(5, dtype=np.float32) - 2
    y = np.full((3, 5), np.nan, np.float32)
    assert ng.gemm(a, _pack(b, left=False), y, bias=bias, clip=(0.0, np.inf))
    np.testing.assert_array_equal(y, np.maximum(np.broadcast_to(bias, (3, 5)), 0))


# ---- operand layouts ------------------------------------------------------------------
def _views(x: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """``x`` as a contiguous, transposed, strided and reversed array (same values)."""
    yield "contiguous", x
    yield "fortran", np.asfortranarray(x)
    big = np.zeros((x.shape[0] * 2, x.shape[1] * 3), np.float32)
    big[::2, ::3] = x
    yield "strided", big[::2, ::3]
    rev = np.ascontiguousarray(x[::-1, ::-1])
    yield "reversed", rev[::-1, ::-1]


def test_strided_and_transposed_operands_match_contiguous() -> None:
    rng = np.random.default_rng(4)
    a, b = _rand(rng, 19, 70), _rand(rng, 70, 53)
    want = np.empty((19, 53), np.float32)
    assert ng.gemm(a, _pack(b, left=False), want)
    for (na, av), (nb, bv) in itertools.product(list(_views(a)), list(_views(b))):
        for right in (bv, _pack(bv, left=False)):
            y = np.empty((19, 53), np.float32)
            assert ng.gemm(av, right, y), (na, nb)
            # Packing copies values: the arithmetic, and so every bit, is the same.
            np.testing.assert_array_equal(y, want, err_msg=f"A {na}, B {nb}")


def test_packed_left_operand_matches_raw_bitwise() -> None:
    rng = np.random.default_rng(5)
    for m, k, n in [(16, 144, 1024), (64, 576, 64), (200, 300, 70), (5, 3, 2)]:
        w, x = _rand(rng, m, k), _rand(rng, k, n)
        y1, y2 = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
        assert ng.gemm(_pack(w, left=True), x, y1)
        assert ng.gemm(w, x, y2)
        np.testing.assert_array_equal(y1, y2)
        _close(y1, _ref(w, x), k)


def _advice_of(address: int) -> set[str] | None:
    """The VmFlags of the mapping that holds ``address`` (hg: huge pages asked for, nh:
    none asked for); None off Linux."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    return None


def test_large_packed_operands_lie_on_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed operand of at least the planner's HUGE_PAGE_BYTES starts on a huge-page
    boundary of a mapping of its own, its whole huge pages asked for as huge pages and
    its tail (past the last whole one) as small pages, so no huge page is taken for a
    tail; a smaller one stays on the heap. Either way the same values, so the same
    product, bit for bit. Whether the kernel grants the pages is the system's."""
    rng = np.random.default_rng(11)
    w, x = _rand(rng, 640, 1100), _rand(rng, 1100, 40)      # A packed: 2.8 MB
    assert cpu_planner.huge_pages(640 * 1100 * 4) and not cpu_planner.huge_pages(1 << 20)
    huge = _pack(w, left=True)
    ys = []
    for packed in (huge, None):
        if packed is None:
            monkeypatch.setattr(cpu_planner, "HUGE_PAGE_BYTES", 2**62)
            packed = _pack(w, left=True)
            assert packed.address % 64 == 0
        y = np.empty((640, 40), np.float32)
        assert ng.gemm(packed, x, y)
        ys.append(y)
    np.testing.assert_array_equal(ys[0], ys[1])
    _close(ys[0], _ref(w, x), 1100)
    assert any("packed operands" in note for note in CpuBackend(threads=1).plan_notes())
    here = ng.huge_pages_here()
    if not here.granted:
        assert isinstance(huge.data.base, np.ndarray) and huge.address % 64 == 0   # heap
        return
    page, size = here.page, huge.data.nbytes
    mapping = huge.data.base.obj
    assert isinstance(mapping, mmap.mmap) and huge.address % page == 0
    assert len(mapping) == -(-size // mmap.PAGESIZE) * mmap.PAGESIZE + page - mmap.PAGESIZE
    body = size // page * page
    assert 0 < body < size                     # 2.8 MB: one whole huge page and a tail
    head, tail = _advice_of(huge.address), _advice_of(huge.address + body)
    if head is not None and tail is not None:
        assert "hg" in head and "nh" not in head
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            assert "nh" in tail and "hg" not in tail


def test_a_packed_batch_asks_huge_pages_for_the_kept_operand_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_batch packs each matrix into a temporary and copies it into the kept
    operand: only the kept one is asked for on huge pages (each temporary alone is past
    HUGE_PAGE_BYTES), with each matrix's panels as pack gives them."""
    rng = np.random.default_rng(12)
    batch = np.stack([_rand(rng, 640, 1100) for _ in range(3)])     # 2.8 MB packed each
    assert cpu_planner.huge_pages(640 * 1100 * 4)
    asked: list[bool] = []
    aligned = ng._aligned

    def spy(n: int, huge: bool = False) -> np.ndarray:
        asked.append(huge)
        return aligned(n, huge)

    monkeypatch.setattr(ng, "_aligned", spy)
    packed = ng.pack_batch(batch, left=True)
    assert packed is not None and asked == [False, False, False, True]
    for t, matrix in enumerate(batch):
        alone = ng.pack(matrix, left=True)
        assert alone is not None
        size = alone.data.size
        start = t * packed.batch_stride
        np.testing.assert_array_equal(packed.data[start:start + size], alone.data)


@pytest.mark.parametrize(("m", "k", "rs"), [(16, 37, 37), (24, 8, 8), (19, 1030, 1030),
                                           (8, 13, 40), (3, 20, 20)])
def test_a_left_operand_of_rows_packs_to_its_panel_layout(m: int, k: int, rs: int) -> None:
    """Packing rows along the depth (eight whole rows transposed by blocks of eight depth
    steps, the rest one by one, a partial panel zero-filled) gives panel q, step p, row r
    at q * k * MR + p * MR + r: the element of row q * MR + r at depth p."""
    rng = np.random.default_rng(9)
    x = _rand(rng, m, rs)[:, :k]
    packed = ng.pack(x, left=True)
    assert packed is not None
    mr = packed.width
    panels = -(-m // mr)
    want = np.zeros((panels * mr, k), np.float32)
    want[:m] = x
    want = want.reshape(panels, mr, k).transpose(0, 2, 1).ravel()
    np.testing.assert_array_equal(packed.data, want)


def test_output_rows_may_be_strided() -> None:
    rng = np.random.default_rng(6)
    a, b = _rand(rng, 9, 20), _rand(rng, 20, 33)
    big = np.full((9, 50), 7.0, np.float32)
    assert ng.gemm(a, _pack(b, left=False), big[:, 5:38])
    _close(big[:, 5:38], _ref(a, b), 20)
    assert (big[:, :5] == 7).all() and (big[:, 38:] == 7).all()


def test_unserved_layouts_say_so_and_write_nothing() -> None:
    a, b = np.ones((4, 4), np.float32), np.ones((4, 4), np.float32)
    y = np.full((4, 8), 3.0, np.float32)
    assert not ng.gemm(a, b, y[:, ::2])                      # C's columns strided
    assert not ng.gemm(a.astype(np.float64), b, y[:, :4])     # not float32
    assert not ng.gemm(np.broadcast_to(a[:1, :1], (4, 4)), b, y[:, :4])   # both strides 0
    assert (y == 3).all()
    with pytest.raises(ValueError, match="do not chain"):
        ng.gemm(a, np.ones((5, 4), np.float32), y[:, :4])


# ---- the epilogue ---------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k", [(13, 37, 20), (8, 32, 300), (1, 5, 7)])
def test_bias_residual_alpha_clip(m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(7)
    a, b = _rand(rng, m, k), _rand(rng, k, n)
    col, row = _rand(rng, n), _rand(rng, m)
    res_big = _rand(rng, m, n + 9)
    res = res_big[:, 4:4 + n]                                   # its own row stride
    for clip in (None, (0.0, np.inf), (-0.5, 0.25)):
        y = np.empty((m, n), np.float32)
        assert ng.gemm(a, _pack(b, left=False), y, bias=col, residual=res, alpha=0.5,
                       clip=clip)
        _close(y, _ref(a, b, 0.5, col, res, clip), k)
        assert ng.gemm(_pack(a, left=True), b, y, bias=row, bias_rows=True, clip=clip)
        _close(y, _ref(a, b, 1.0, row[:, None], None, clip), k)


def test_accumulate_adds_to_what_c_holds() -> None:
    rng = np.random.default_rng(8)
    a, b = _rand(rng, 10, 600), _rand(rng, 600, 40)
    y = _rand(rng, 10, 40)
    start = y.copy()
    assert ng.gemm(a, _pack(b, left=False), y, accumulate=True, clip=(0.0, np.inf))
    _close(y, _ref(a, b, res=start, clip=(0.0, np.inf)), 600)


def test_nan_and_inf_propagate_through_the_clip() -> None:
    a = np.ones((3, 4), np.float32)
    b = np.ones((4, 18), np.float32)
    a[0, 1] = np.nan
    a[1, 2] = np.inf
    a[2, 3] = -np.inf
    for clip in ((0.0, np.inf), (-1.0, 1.0)):
        y = np.empty((3, 18), np.float32)
        assert ng.gemm(a, _pack(b, left=False), y, clip=clip)
        with np.errstate(invalid="ignore"):
            want = np.clip(a.astype(np.float64) @ b, *clip)      # NumPy keeps NaN
        np.testing.assert_array_equal(y, want.astype(np.float32))
    assert np.isnan(y[0]).all() and (y[1] == 1).all() and (y[2] == -1).all()


def test_clip_with_low_above_high_gives_high_as_numpy() -> None:
    a, b = np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)
    y = np.empty((2, 2), np.float32)
    assert ng.gemm(a, _pack(b, left=False), y, clip=(3.0, 1.0))
    np.testing.assert_array_equal(y, np.clip(a @ b, 3.0, 1.0))


# ---- threads and batches ----------------------------------------------------------------
@pytest.mark.parametrize("m,n,k", [(200, 70, 300), (8, 500, 100), (37, 41, 600)])
def test_threads_give_bitwise_the_same(split_small: None, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(9)
    a, b = _rand(rng, m, k), _rand(rng, k, n)
    bias, res = _rand(rng, n), _rand(rng, m, n)
    outs = []
    for threads in (1, 2, 3):
        y = np.empty((m, n), np.float32)
        assert ng.gemm(a, _pack(b, left=False), y, bias=bias, residual=res,
                       clip=(0.0, np.inf), threads=threads)
        outs.append(y)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_batches_share_the_packed_operand(split_small: None) -> None:
    rng = np.random.default_rng(10)
    w, x = _rand(rng, 24, 50), _rand(rng, 5, 50, 70)
    res = _rand(rng, 5, 24, 70)
    bias = _rand(rng, 24)
    packed = _pack(w, left=True)
    for threads in (1, 2):
        y = np.empty((5, 24, 70), np.float32)
        assert ng.gemm(packed, x, y, bias=bias, bias_rows=True, residual=res,
                       threads=threads)
        for t in range(5):
            _close(y[t], _ref(w, x[t], bias=bias[:, None], res=res[t]), 50)


@pytest.mark.parametrize("batch,n", [(5, 70), (16, 33), (3, 300)])
def test_a_batch_split_panel_major_gives_bitwise_the_same(split_small: None, batch: int,
                                                          n: int) -> None:
    """Column panels across the batch (Winograd's products) or product by product: the
    same bits for every thread count."""
    rng = np.random.default_rng(12)
    w = _rand(rng, batch, 24, 50)
    packed = ng.pack_batch(w, left=True)
    assert packed is not None
    x, res, bias = _rand(rng, batch, 50, n), _rand(rng, batch, 24, n), _rand(rng, 24)
    outs = []
    for threads, panel_major in ((1, False), (2, False), (2, True), (3, True), (7, True)):
        y = np.empty((batch, 24, n), np.float32)
        call = ng.prepare(packed, x, y, bias=bias, bias_rows=True, residual=res)
        assert call is not None
        call.run(threads, panel_major=panel_major)
        outs.append(y)
    for t in range(batch):
        _close(outs[0][t], _ref(w[t], x[t], bias=bias[:, None], res=res[t]), 50)
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])


def test_rows_and_column_map_read_and_write_anywhere() -> None:
    """B's rows at arbitrary offsets of a buffer; C's columns mapped or dropped."""
    rng = np.random.default_rng(11)
    k, n, m = 21, 45, 10
    data = _rand(rng, 2, 400).reshape(-1)
    offsets = rng.integers(0, 400 - n, size=k).astype(np.int64)
    w = _rand(rng, m, k)
    columns = np.arange(n, dtype=np.int64) * 2
    columns[::5] = -1                                        # every fifth dropped
    y = np.full((2, m, 2 * n), 5.0, np.float32)
    res = _rand(rng, 2, m, 2 * n)
    assert ng.gemm(_pack(w, left=True), ng.Rows(data, offsets, n, 400), y, residual=res,
                   bias=np.ones(m, np.float32), bias_rows=True, columns=columns)
    for t in range(2):
        b = np.stack([data[t * 400 + o: t * 400 + o + n] for o in offsets])
        want = _ref(w, b) + 1
        kept = columns >= 0
        _close(y[t][:, columns[kept]], want[:, kept] + res[t][:, columns[kept]], k)
        untouched = np.ones(2 * n, bool)
        untouched[columns[kept]] = False
        assert (y[t][:, untouched] == 5).all()


# ---- MatMul and Gemm through the cpu backend ------------------------------------------------
def _run(backend: Any, op: Op, inputs: list[Any], attrs: dict[str, Any],
         variant: str = "default") -> np.ndarray:
    return np.asarray(backend.run(op, inputs, attrs=attrs, variant=variant)[0])


MATMUL_CASES = [
    ((32, 784), (784, 512), (512,), "relu", ()),
    ((4, 7, 33), (33, 17), (17,), "", ()),
    ((33,), (33, 9), None, "clip", (-0.5, 0.5)),
    ((5, 40), (40, 3), (5, 3), "gelu", ()),
    ((2, 3, 8), (8, 6), (3, 6), "relu", ()),
]


@pytest.mark.parametrize("a_shape,b_shape,bias_shape,act,params", MATMUL_CASES)
def test_matmul_native_variant_matches_reference(a_shape: tuple[int, ...],
                                                 b_shape: tuple[int, ...],
                                                 bias_shape: tuple[int, ...] | None,
                                                 act: str, params: tuple[float, ...]) -> None:
    rng = np.random.default_rng(12)
    inputs = [_rand(rng, *a_shape), _rand(rng, *b_shape)]
    if bias_shape is not None:
        inputs.append(_rand(rng, *bias_shape))
    attrs = {"activation": act, "activation_params": params}
    want = _run(ReferenceBackend(), Op.MATMUL, inputs, attrs)
    got = _run(CpuBackend(threads=1), Op.MATMUL, inputs, attrs, variant="native")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((0, 1), (0, 1))))
@pytest.mark.parametrize("c_shape", [None, (9,), (1, 9), (13, 1), (13, 9), (1,)])
def test_gemm_native_variant_matches_reference(trans_a: int, trans_b: int,
                                               c_shape: tuple[int, ...] | None) -> None:
    rng = np.random.default_rng(13)
    a = _rand(rng, *((300, 13) if trans_a else (13, 300)))
    b = _rand(rng, *((9, 300) if trans_b else (300, 9)))
    inputs = [a, b] + ([] if c_shape is None else [_rand(rng, *c_shape)])
    attrs = {"trans_a": trans_a, "trans_b": trans_b, "alpha": 0.5, "beta": 2.0,
             "activation": "relu"}
    want = _run(ReferenceBackend(), Op.GEMM, inputs, attrs)
    got = _run(CpuBackend(threads=1), Op.GEMM, inputs, attrs, variant="native")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _prepacked(op: Op, inputs: list[Any], attrs: dict[str, Any]) -> KernelContext:
    backend = CpuBackend(threads=1)
    consts = [None, *inputs[1:]]
    for c in consts[1:]:
        c.flags.writeable = False
    pack = cpu_matmul._pack_matmul if op is Op.MATMUL else cpu_matmul._pack_gemm
    state = pack(backend.context(), consts, attrs)
    return KernelContext(np, "cpu", DeviceKind.CPU, 1, state)


def test_default_kernel_takes_the_native_path_when_prepacked() -> None:
    rng = np.random.default_rng(14)
    a, b, bias = _rand(rng, 32, 200), _rand(rng, 200, 64), _rand(rng, 64)
    attrs = {"activation": "relu", "activation_params": ()}
    ctx = _prepacked(Op.MATMUL, [a, b, bias], attrs)
    assert isinstance(ctx.prepacked, cpu_matmul._Operands)
    assert ctx.prepacked.native is not None and ctx.prepacked.rhs is b       # no copy kept
    y = np.empty((32, 64), np.float32)
    got = cpu_matmul.matmul(ctx, [a, b, bias], attrs, [y])[0]
    assert got is y
    raw = np.empty((32, 64), np.float32)
    assert ng.gemm(a, b, raw, bias=bias, clip=(0.0, np.inf))
    np.testing.assert_array_equal(y, raw)              # the native kernel's bits
    # The prepared call is reused on the next run with the same arrays.
    assert len(ctx.prepacked.calls) == 1
    a[...] = _rand(rng, 32, 200)
    cpu_matmul.matmul(ctx, [a, b, bias], attrs, [y])
    _close(y, _ref(a, b, bias=bias, clip=(0.0, np.inf)), 200)
    assert len(ctx.prepacked.calls) == 1


def test_prepacked_and_plain_native_calls_agree_bitwise() -> None:
    rng = np.random.default_rng(15)
    a, b, c = _rand(rng, 20, 70), _rand(rng, 50, 70), _rand(rng, 50)
    attrs = {"trans_a": 0, "trans_b": 1, "alpha": 1.0, "beta": 1.0, "activation": "",
             "activation_params": ()}
    ctx = _prepacked(Op.GEMM, [a, b, c], attrs)
    packed = np.asarray(cpu_matmul.gemm(ctx, [a, b, c], attrs, None)[0])
    plain = _run(CpuBackend(threads=1), Op.GEMM, [a, b, c], attrs, variant="native")
    np.testing.assert_array_equal(packed, plain)


def test_matmul_threads_give_bitwise_the_same(split_small: None) -> None:
    rng = np.random.default_rng(16)
    inputs = [_rand(rng, 3, 50, 120), _rand(rng, 120, 90), _rand(rng, 90)]
    attrs = {"activation": "relu", "activation_params": ()}
    one = _run(CpuBackend(threads=1), Op.MATMUL, inputs, attrs, variant="native")
    two = _run(CpuBackend(threads=2), Op.MATMUL, inputs, attrs, variant="native")
    np.testing.assert_array_equal(one, two)


def test_float16_and_batched_b_fall_back_correctly() -> None:
    rng = np.random.default_rng(17)
    cases = [[_rand(rng, 6, 10).astype(np.float16), _rand(rng, 10, 4).astype(np.float16)],
             [_rand(rng, 2, 6, 10), _rand(rng, 2, 10, 4)],
             [_rand(rng, 6, 10).astype(np.float64), _rand(rng, 10, 4).astype(np.float64)]]
    for inputs in cases:
        want = _run(ReferenceBackend(), Op.MATMUL, inputs, {})
        got = _run(CpuBackend(threads=1), Op.MATMUL, inputs, {}, variant="native")
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=2e-3, atol=2e-3)


# ---- Conv through the cpu backend ---------------------------------------------------------
CONV_CASES = [
    # X shape, W shape, attrs
    ((2, 3, 9, 9), (5, 3, 3, 3), {"pads": (1, 1, 1, 1)}),
    ((1, 16, 32, 32), (16, 16, 3, 3), {"pads": (1, 1, 1, 1)}),
    ((3, 8, 7, 7), (12, 8, 3, 3), {"pads": (1, 1, 1, 1)}),                 # stacked batch
    ((2, 8, 15, 13), (12, 8, 3, 3), {"strides": (2, 2), "pads": (1, 1, 1, 1)}),
    ((2, 8, 7, 7), (12, 8, 1, 1), {}),                                      # 1x1: direct B
    ((2, 8, 8, 8), (12, 8, 1, 1), {"strides": (2, 2)}),
    ((2, 8, 10, 10), (12, 4, 3, 3), {"group": 2, "pads": (1, 0, 2, 1)}),
    ((1, 3, 20, 20), (4, 3, 5, 5), {"dilations": (2, 2), "pads": (2, 2, 2, 2)}),
    ((2, 4, 11), (6, 4, 3), {"pads": (1, 1)}),
    ((1, 2, 5, 6, 7), (3, 2, 3, 3, 3), {"pads": (1, 1, 1, 1, 1, 1)}),
    ((1, 3, 40, 40), (8, 3, 7, 7), {"strides": (2, 2), "pads": (3, 3, 3, 3)}),
    ((2, 1, 12, 12), (3, 1, 5, 5), {}),                                     # unpadded KxK
    ((2, 300, 4, 4), (70, 300, 3, 3), {"pads": (1, 1, 1, 1)}),             # K > the block
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", CONV_CASES)
@pytest.mark.parametrize("act,params", [("relu", ()), ("", ()), ("clip", (-0.3, 0.4)),
                                        ("leaky_relu", (0.1,))])
def test_conv_native_variant_matches_reference(x_shape: tuple[int, ...],
                                               w_shape: tuple[int, ...], attrs: dict[str, Any],
                                               act: str, params: tuple[float, ...]) -> None:
    rng = np.random.default_rng(18)
    x, w, b = _rand(rng, *x_shape), _rand(rng, *w_shape), _rand(rng, w_shape[0])
    plain = _run(ReferenceBackend(), Op.CONV, [x, w, b], attrs)
    z = _rand(rng, *plain.shape)
    full = {**attrs, "activation": act, "activation_params": params}
    for inputs in ([x, w, b], [x, w, b, z], [x, w]):
        want = _run(ReferenceBackend(), Op.CONV, inputs, full)
        got = _run(CpuBackend(threads=1), Op.CONV, inputs, full, variant="native")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x_shape,w_shape,attrs", CONV_CASES[:4])
def test_conv_threads_and_prepacking_give_bitwise_the_same(
        split_small: None, x_shape: tuple[int, ...], w_shape: tuple[int, ...],
        attrs: dict[str, Any]) -> None:

    rng = np.random.default_rng(19)
    x, w, b = _rand(rng, *x_shape), _rand(rng, *w_shape), _rand(rng, w_shape[0])
    w.flags.writeable = b.flags.writeable = False
    norm = get_schema(Op.CONV).normalize_attrs({**attrs, "activation": "relu"})
    outs = [_run(CpuBackend(threads=t), Op.CONV, [x, w, b], norm, variant="native")
            for t in (1, 2, 3)]
    state = cpu_conv._prepack(CpuBackend().context(), [None, w, b], norm)
    kernel = CpuBackend().kernels.get(Op.CONV, "native").fn
    for _ in range(2):           # the second run reuses the prepared calls
        ctx = KernelContext(np, "cpu", DeviceKind.CPU, 2, state)
        outs.append(np.asarray(kernel(ctx, [x, w, b], norm, None)[0]))
    for other in outs[1:]:
        np.testing.assert_array_equal(outs[0], other)


def test_conv_residual_may_be_the_output_itself() -> None:
    rng = np.random.default_rng(20)
    x, w, b = _rand(rng, 2, 6, 9, 9), _rand(rng, 7, 6, 3, 3), _rand(rng, 7)
    attrs = {"pads": (1, 1, 1, 1), "activation": "relu"}
    z = _rand(rng, 2, 7, 9, 9)
    want = _run(ReferenceBackend(), Op.CONV, [x, w, b, z], attrs)

    norm = get_schema(Op.CONV).normalize_attrs(attrs)
    y = z.copy()
    kernel = CpuBackend().kernels.get(Op.CONV, "native").fn
    got = kernel(KernelContext(np, "cpu", DeviceKind.CPU, 1, None), [x, w, b, y], norm, [y])[0]
    assert got is y
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_conv_default_picks_native_for_few_channels_and_says_why() -> None:

    small = conv_case(Op.CONV, (32, 16, 32, 32), (16, 16, 3, 3), {"pads": (1, 1, 1, 1)},
                      "float32")
    big = conv_case(Op.CONV, (1, 256, 14, 14), (256, 256, 3, 3), {"pads": (1, 1, 1, 1)},
                    "float32")
    one = conv_case(Op.CONV, (1, 32, 8, 8), (64, 32, 1, 1), {}, "float32")
    assert small is not None and big is not None and one is not None
    rules = cpu_planner.available_rules()
    assert pick(small, rules)[0] == "native"
    name, why = pick(big, rules)
    assert name != "native" and "not native: 256 channels per group > 64" in why
    assert pick(one, rules)[0] == "native"          # 1x1 stride 1: native at any batch


def test_conv_without_the_native_tier_runs_numpy(monkeypatch: pytest.MonkeyPatch) -> None:

    rng = np.random.default_rng(21)
    x, w = _rand(rng, 1, 4, 8, 8), _rand(rng, 4, 4, 3, 3)
    attrs = {"pads": (1, 1, 1, 1)}
    want = _run(ReferenceBackend(), Op.CONV, [x, w], attrs)
    monkeypatch.setattr(ng, "_functions", lambda: None)
    assert all(r.variant != "native" for r in cpu_planner.available_rules())
    got = _run(CpuBackend(threads=1), Op.CONV, [x, w], attrs, variant="native")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    a, m = _rand(rng, 8, 8), _rand(rng, 8, 5)
    got = _run(CpuBackend(threads=1), Op.MATMUL, [a, m], {}, variant="native")
    np.testing.assert_allclose(got, a.astype(np.float64) @ m, rtol=1e-5, atol=1e-5)


# ---- a model against onnxruntime --------------------------------------------------------------
def _model() -> Any:
    onnx = pytest.importorskip("onnx", reason="onnx builds the test model")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(22)

    def init(name: str, *shape: int) -> Any:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32),
                                       name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "x"], ["s"]),
        helper.make_node("Relu", ["s"], ["r2"]),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Flatten", ["c3"], ["f"]),
        helper.make_node("Gemm", ["f", "g1", "gb1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("MatMul", ["hr", "m2"], ["o1"]),
        helper.make_node("Add", ["o1", "mb2"], ["y"]),
    ]
    inits = [init("w1", 8, 8, 3, 3), init("b1", 8), init("w2", 8, 8, 3, 3), init("b2", 8),
             init("w3", 16, 8, 3, 3), init("g1", 40, 16 * 5 * 5), init("gb1", 40),
             init("m2", 40, 10), init("mb2", 10)]
    graph = helper.make_graph(
        nodes, "native_gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             ["n", 8, 10, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8), onnx


@pytest.mark.parametrize("batch", [1, 5])
def test_model_matches_onnxruntime(batch: int) -> None:
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle")

    proto, _ = _model()
    x = np.random.default_rng(batch).standard_normal((batch, 8, 10, 10)).astype(np.float32)
    want = ort.InferenceSession(proto.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    model = load_model(proto, backend="cpu", threads=1)
    got = model.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    again = model.run(None, {"x": x})[0]              # prepared calls reused
    np.testing.assert_array_equal(got, again)


def test_argument_structs_agree_with_gemm_c() -> None:
    """The layouts native_gemm.py packs are the C structs' own (sizeof, offsetof)."""
    lib = native.library("gemm")
    assert lib is not None

    def size(symbol: str) -> int:
        return int(lib.function(symbol, [], ng._I64)())

    assert size("keel_gemm_args_size") == ng._ARGS.size == 27 * 8
    assert size("keel_gemm_args_c_offset") == 8 * ng._C_FIELD
    assert size("keel_conv_band_args_size") == ng._BAND_ARGS.size == 23 * 8
    assert size("keel_conv_band_args_x_offset") == 8 * ng._BAND_X


def test_each_thread_keeps_its_own_aligned_scratch_by_use() -> None:
    """thread_scratch (the GEMM's packing workspace, attention's scores): kept per thread
    and use, 64-byte aligned, replaced by a larger one only where a call needs more."""
    import threading

    def on_a_new_thread(check: Callable[[], np.ndarray]) -> np.ndarray:
        kept: list[np.ndarray] = []
        worker = threading.Thread(target=lambda: kept.append(check()))
        worker.start()
        worker.join()
        assert kept, "the check failed on its thread"
        return kept[0]

    def mine() -> np.ndarray:
        first = workspace.thread_scratch(workspace.Scratch.WORK, 100)
        assert first.size >= 100 and first.ctypes.data % 64 == 0
        assert workspace.thread_scratch(workspace.Scratch.WORK, 60) is first
        assert workspace.thread_scratch(workspace.Scratch.ATTENTION, 100) is not first
        grown = workspace.thread_scratch(workspace.Scratch.WORK, first.size + 1000)
        assert grown.ctypes.data % 64 == 0 and grown is not first
        assert workspace.thread_scratch(workspace.Scratch.WORK, 100) is grown
        return grown

    one, other = on_a_new_thread(mine), on_a_new_thread(mine)
    assert not np.shares_memory(one, other)


def test_the_flags_are_checked_by_name_at_load() -> None:
    """gemm.c's flags, the fetch-ahead shift among them, are native_gemm's by name."""
    lib = native.library("gemm")
    assert lib is not None
    ng.check_enums(lib, "keel_gemm_flags", ng._FLAGS, "native_gemm")
    moved = {**ng._FLAGS, "KEEL_FETCH_SHIFT": ng._FETCH_SHIFT + 1}
    with pytest.raises(ng.ArgsLayoutError, match=r"keel_gemm_flags.*KEEL_FETCH_SHIFT"):
        ng.check_enums(lib, "keel_gemm_flags", moved, "native_gemm")


def test_a_mismatched_argument_struct_fails_at_load() -> None:
    with pytest.raises(ng.ArgsLayoutError, match=r"keel_gemm_args is 224 bytes.*'<24q3d'"):
        ng.check_layout("keel_gemm_args", ng._ARGS, ng._C_FIELD, "C", 224, 104)
    with pytest.raises(ng.ArgsLayoutError, match=r"C's address at byte 112.*at byte 104"):
        ng.check_layout("keel_gemm_args", ng._ARGS, ng._C_FIELD, "C", 216, 112)


def test_the_pool_s_refusal_code_is_checked_against_gemm_c_at_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """native_gemm's _POOL_REFUSED is gemm.c's KEEL_POOL_REFUSED (its getter's value);
    another value fails the load."""
    lib = native.library("gemm")
    assert lib is not None
    assert lib.function("keel_conv_pool_refused", [], ctypes.c_int64)() == ng._POOL_REFUSED
    ng._load(lib)
    monkeypatch.setattr(ng, "_POOL_REFUSED", ng._POOL_REFUSED - 1)
    with pytest.raises(ng.ArgsLayoutError, match="KEEL_POOL_REFUSED is -2"):
        ng._load(lib)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_call_reads_a_moved_a_only_where_its_a_is_the_buffer_named(threads: int) -> None:
    """``bound_reading(threads, buffer)`` moves A only for a call whose A is ``buffer``:
    for any other array (a copy of the feed, another operand) there is no moving call,
    and a moving call pointed at another array computes that array's product, bitwise
    what a call prepared on it computes."""
    rng = np.random.default_rng(11)
    a, b = _rand(rng, 64, 96), _rand(rng, 96, 80)
    c = np.empty((64, 80), np.float32)
    call = ng.prepare(a, b, c)
    assert call is not None
    assert call.bound_reading(threads, a.copy()) is None
    assert call.bound_reading(threads, b) is None
    moving = call.bound_reading(threads, a)
    assert moving is not None and moving.point is not None
    other = _rand(rng, 64, 96)
    moving.point(other)
    moving()
    want = np.empty_like(c)
    again = ng.prepare(other, b, want)
    assert again is not None
    again.run(threads)
    np.testing.assert_array_equal(c, want)
    packed = ng.prepare(_pack(a, True), b, c)       # A packed: not an array to move
    assert packed is not None and packed.bound_reading(threads, a) is None
