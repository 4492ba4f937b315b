"""The native Winograd F(2x2, 3x3) convolution (native/src/winograd.c transforms, the
sixteen products on the packed GEMM) against the reference backend on random inputs:
pads (none, one, uneven), odd and even output sides (partial tiles and partial vector
blocks of tiles), channel counts off the GEMM's tile sizes, bias / residual / clip /
ReLU / other activations, batches split into chunks, bitwise equality between thread
counts, and the cases it declines."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.cpu import native_gemm as ng
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu import winograd
from keel.backends.cpu.conv_epilogue import activation
from keel.backends.reference.backend import ReferenceBackend
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry

pytestmark = pytest.mark.usefixtures("native_winograd_tier")


CASES = [
    # X, M, pads (top, left, bottom, right)
    ((1, 3, 8, 8), 16, (1, 1, 1, 1)),
    ((2, 5, 7, 11), 9, (1, 1, 1, 1)),           # odd sides: a partial tile per row / column
    ((3, 16, 9, 40), 33, (1, 1, 1, 1)),         # 20 tiles a row: a full and a partial block
    ((2, 4, 13, 6), 7, (0, 2, 1, 1)),           # uneven pads
    ((1, 8, 10, 10), 8, (0, 0, 0, 0)),          # unpadded
    ((2, 2, 1, 1), 3, (1, 1, 1, 1)),            # a 1-pixel image
    ((4, 32, 14, 14), 40, (1, 1, 1, 1)),
    ((2, 64, 5, 37), 17, (2, 1, 0, 3)),
]


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _reference(inputs: list[Any], attrs: dict[str, Any]) -> np.ndarray:
    return np.asarray(ReferenceBackend().run(Op.CONV, inputs, attrs=attrs)[0])


def _native(x: np.ndarray, w: np.ndarray, b: Any, z: Any, pads: tuple[int, ...],
            act: tuple[str, tuple[float, ...]], threads: int = 1,
            chunk: int | None = None, lanes: bool | None = None) -> np.ndarray:
    geo = conv_geometry(Op.CONV, x.shape, w.shape, {"pads": pads})
    out_hw = geo.window.out_spatial
    y = np.empty((x.shape[0], w.shape[0], *out_hw), np.float32)
    assert winograd.native_conv3x3(x, w, (pads[0], pads[1]), (out_hw[0], out_hw[1]), y, b, z,
                                   activation(*act), None, threads, chunk, lanes)
    return y


@pytest.mark.parametrize("x_shape,m,pads", CASES)
@pytest.mark.parametrize("act", [("", ()), ("relu", ()), ("clip", (-0.3, 0.4)),
                                 ("sigmoid", ())])
def test_native_winograd_matches_reference(x_shape: tuple[int, ...], m: int,
                                           pads: tuple[int, ...],
                                           act: tuple[str, tuple[float, ...]]) -> None:
    rng = np.random.default_rng(7)
    x, w, b = _rand(rng, *x_shape), _rand(rng, m, x_shape[1], 3, 3), _rand(rng, m)
    attrs = {"pads": pads, "activation": act[0], "activation_params": act[1]}
    plain = _reference([x, w, b], {"pads": pads})
    z = _rand(rng, *plain.shape)
    scale = float(np.abs(plain).max()) + float(np.abs(z).max())
    for bias, res in ((b, None), (b, z), (None, None), (None, z)):
        inputs = [x, w, b if bias is not None else np.zeros_like(b)]
        if res is not None:
            inputs.append(res)
        want = _reference(inputs, attrs)
        got = _native(x, w, bias, res, pads, act)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * scale)


def test_nan_and_infinities_are_never_lost() -> None:
    """Winograd spreads a non-finite input over its 2x2 output tiles (inf - inf in the
    transforms), as the NumPy form does; every output the reference makes non-finite is
    non-finite here, and the finite rest matches."""
    rng = np.random.default_rng(3)
    x, w = _rand(rng, 1, 4, 6, 6), _rand(rng, 5, 4, 3, 3)
    x[0, 1, 2, 3] = np.nan
    x[0, 2, 5, 5] = np.inf
    pads = (1, 1, 1, 1)
    got = _native(x, w, None, None, pads, ("", ()))
    want = _reference([x, w], {"pads": pads})
    numpy_form = np.empty_like(got)
    with np.errstate(invalid="ignore"):
        winograd.conv3x3(np, x, w, (1, 1), (6, 6), numpy_form)
    assert np.all(~np.isfinite(got[~np.isfinite(want)]))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(numpy_form))
    finite = np.isfinite(got)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4)


def test_batches_split_into_chunks_give_the_same_result() -> None:
    rng = np.random.default_rng(11)
    x, w, b = _rand(rng, 7, 8, 12, 12), _rand(rng, 6, 8, 3, 3), _rand(rng, 6)
    whole = _native(x, w, b, None, (1, 1, 1, 1), ("relu", ()))
    for chunk in (1, 3):
        np.testing.assert_array_equal(
            _native(x, w, b, None, (1, 1, 1, 1), ("relu", ()), chunk=chunk), whole)


def test_threads_give_bitwise_equal_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_CHUNK_FLOATS", 1)          # split even small planes
    rng = np.random.default_rng(5)
    x, w, b = _rand(rng, 3, 24, 15, 15), _rand(rng, 20, 24, 3, 3), _rand(rng, 20)
    z = _rand(rng, 3, 20, 15, 15)
    one = _native(x, w, b, z, (1, 1, 1, 1), ("relu", ()), threads=1)
    for threads in (2, 3, 4):
        np.testing.assert_array_equal(_native(x, w, b, z, (1, 1, 1, 1), ("relu", ()),
                                              threads=threads), one)


def test_small_planes_split_by_their_vector_work() -> None:
    # ResNet-18's layer4 at batch 1: 512 planes of 7x7, each worked as a whole vector row
    # of tiles; counted in pixels they would stay on one thread.
    for output in (False, True):
        assert cpu_planner.winograd_transform_parts(512, (7, 7), output, 2) == 2
        assert cpu_planner.winograd_transform_parts(512, (7, 7), output, 16) == 16
    assert cpu_planner.winograd_transform_parts(512, (7, 7), False, 64) > 16
    assert cpu_planner.winograd_transform_parts(1, (7, 7), False, 16) == 1


def test_small_planes_give_bitwise_equal_results_on_any_threads() -> None:
    rng = np.random.default_rng(8)
    x, w, b = _rand(rng, 1, 96, 7, 7), _rand(rng, 40, 96, 3, 3), _rand(rng, 40)
    one = _native(x, w, b, None, (1, 1, 1, 1), ("relu", ()), threads=1)
    for threads in (2, 3, 4):
        np.testing.assert_array_equal(_native(x, w, b, None, (1, 1, 1, 1), ("relu", ()),
                                              threads=threads), one)


def test_declines_what_it_does_not_serve() -> None:
    rng = np.random.default_rng(1)
    x, w = _rand(rng, 1, 4, 8, 8), _rand(rng, 4, 4, 3, 3)
    y = np.empty((1, 4, 8, 8), np.float32)
    act = activation("", ())
    assert not winograd.native_conv3x3(x.astype(np.float64), w, (1, 1), (8, 8), y, act=act)
    assert not winograd.native_conv3x3(x[:, :, :, ::-1], w, (1, 1), (8, 8), y, act=act)
    assert not winograd.native_conv3x3(x, w, (1, 1), (8, 8), y, z=np.zeros((1, 4, 8, 7),
                                                                           np.float32), act=act)


def test_filters_are_packed_once_per_frozen_weight() -> None:
    rng = np.random.default_rng(2)
    w = _rand(rng, 8, 4, 3, 3)
    w.setflags(write=False)
    x = _rand(rng, 1, 4, 6, 6)
    first = _native(x, w, None, None, (1, 1, 1, 1), ("", ()))
    packed = [v for k, v in winograd.workspace._derived.items()
              if k[0] == "winograd_native_products"]
    assert len(packed) == 1 and isinstance(packed[0][1].u, ng.Packed)
    assert packed[0][1].u.batch_stride > 0
    np.testing.assert_array_equal(_native(x, w, None, None, (1, 1, 1, 1), ("", ())), first)


@pytest.mark.parametrize(("x_shape", "m"), [((4, 24, 15, 15), 20), ((3, 16, 9, 40), 33),
                                           ((2, 40, 30, 29), 24)])
@pytest.mark.parametrize("chunk", [1, 2])
def test_tile_rows_and_planes_give_the_same_bits(x_shape: tuple[int, ...], m: int,
                                                 chunk: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Pass by pass, a chunk with fewer images than threads splits its transforms by tile
    rows (every channel of each) instead of planes: the same values, bitwise, on any
    thread count."""
    _forced(monkeypatch, _PASSES)
    rng = np.random.default_rng(3)
    x, w, b = _rand(rng, *x_shape), _rand(rng, m, x_shape[1], 3, 3), _rand(rng, m)
    z = _rand(rng, x_shape[0], m, *x_shape[2:])
    act = ("clip", (-0.5, 0.6))
    one = _native(x, w, b, z, (1, 1, 1, 1), act, threads=1, chunk=chunk)
    out_hw = x_shape[2:]
    assert not cpu_planner.winograd_by_rows(chunk, x_shape[1] + m, out_hw, 1)
    assert any(cpu_planner.winograd_by_rows(chunk, x_shape[1] + m, out_hw, t)
               for t in (2, 3, 4))                          # the tile rows split runs
    for threads in (2, 3, 4):
        np.testing.assert_array_equal(
            _native(x, w, b, z, (1, 1, 1, 1), act, threads=threads, chunk=chunk), one)
    want = _reference([x, w, b, z], {"pads": (1, 1, 1, 1), "activation": act[0],
                                     "activation_params": act[1]})
    np.testing.assert_allclose(one, want, rtol=1e-4, atol=1e-4)


# ---- the per-thread pipeline -------------------------------------------------------------
_PASSES = cpu_planner.WinogradPipeline(0, 0, 0, 0, "pass by pass (forced)")


def _forced(monkeypatch: pytest.MonkeyPatch, pipe: Any) -> None:
    monkeypatch.setattr(cpu_planner, "winograd_pipeline", lambda *a, **k: pipe)


def test_each_chunk_takes_the_pass_lanes_of_its_own_tiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Run pass by pass with no plan's pass_lanes, each chunk asks the planner for its own
    tile count: a short last chunk is not given the first chunk's decision."""
    asked: list[int] = []
    real = cpu_planner.winograd_pass_lanes

    def recorded(c: int, m: int, tiles: int, *rest: Any) -> tuple[bool, str]:
        asked.append(tiles)
        return real(c, m, tiles, *rest)

    monkeypatch.setattr(cpu_planner, "winograd_pass_lanes", recorded)
    _forced(monkeypatch, _PASSES)
    rng = np.random.default_rng(13)
    x, w, b = _rand(rng, 5, 8, 12, 12), _rand(rng, 6, 8, 3, 3), _rand(rng, 6)
    got = _native(x, w, b, None, (1, 1, 1, 1), ("relu", ()), chunk=2)
    assert asked == [2 * 36, 2 * 36, 36]
    np.testing.assert_array_equal(got, _native(x, w, b, None, (1, 1, 1, 1), ("relu", ())))


@pytest.mark.parametrize(("x_shape", "m"), [((2, 24, 15, 15), 20), ((3, 16, 9, 40), 33),
                                           ((1, 64, 56, 56), 64), ((2, 40, 30, 29), 24),
                                           ((3, 9, 7, 7), 17)])
def test_the_pipeline_gives_the_passes_bits_for_any_block_and_threads(
        x_shape: tuple[int, ...], m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of any tiles (whole vectors of 16, counts that are not a multiple of a tile
    row, starting and ending inside tile rows and spanning images, the whole batch),
    product blocks of any output channels, on 1, 2, 3, 4 and 16 threads: bitwise the
    passes' result, which matches the reference."""
    rng = np.random.default_rng(9)
    x, w, b = _rand(rng, *x_shape), _rand(rng, m, x_shape[1], 3, 3), _rand(rng, m)
    z = _rand(rng, x_shape[0], m, *x_shape[2:])
    act = ("clip", (-0.5, 0.6))
    _forced(monkeypatch, _PASSES)
    passes = _native(x, w, b, z, (1, 1, 1, 1), act)
    want = _reference([x, w, b, z], {"pads": (1, 1, 1, 1), "activation": act[0],
                                     "activation_params": act[1]})
    np.testing.assert_allclose(passes, want, rtol=1e-4, atol=1e-4)
    tw = -(-x_shape[3] // 2)
    tiles = x_shape[0] * -(-x_shape[2] // 2) * tw
    sizes = {1, 5, 16, 17, 32, tw + 1, 2 * tw - 3, 48, tiles // 2 + 1, tiles - 1, tiles}
    for block in sorted(t for t in sizes if 0 < t <= tiles):
        blocks = -(-tiles // block)
        for panels in (1, 3, 64):
            for threads in (1, 2, 3, 4, 16):
                parts = min(threads, blocks)
                _forced(monkeypatch, cpu_planner.WinogradPipeline(block, panels, blocks,
                                                                  parts, "forced"))
                got = _native(x, w, b, z, (1, 1, 1, 1), act, threads=threads)
                np.testing.assert_array_equal(got, passes,
                                              err_msg=f"{block} {panels} {threads}")


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 16])
def test_as_planned_any_threads_give_the_same_bits(threads: int) -> None:
    """The planner's own choice (pipeline or passes, and its blocks) on each thread count:
    the result of one thread, bitwise."""
    rng = np.random.default_rng(4)
    x, w, b = _rand(rng, 4, 32, 28, 28), _rand(rng, 48, 32, 3, 3), _rand(rng, 48)
    z = _rand(rng, 4, 48, 28, 28)
    one = _native(x, w, b, z, (1, 1, 1, 1), ("relu", ()), threads=1)
    assert cpu_planner.winograd_pipeline(4, 32, 48, (28, 28), threads).tiles > 0
    np.testing.assert_array_equal(_native(x, w, b, z, (1, 1, 1, 1), ("relu", ()),
                                          threads=threads), one)
    np.testing.assert_allclose(one, _reference([x, w, b, z], {"pads": (1, 1, 1, 1),
                                                              "activation": "relu"}),
                               rtol=1e-4, atol=1e-4)


def test_the_pipeline_is_sized_to_the_l2_and_split_evenly() -> None:
    small = cpu_planner.Caches(256 << 10, 32 << 20, "a small L2")
    large = cpu_planner.Caches(2 << 20, 32 << 20, "a large L2")
    for sizes in (small, large):
        for threads in (1, 2, 16):
            pipe = cpu_planner.winograd_pipeline(32, 64, 64, (56, 56), threads, sizes)
            assert pipe.tiles > 0, pipe.reason
            assert pipe.tiles % cpu_planner.PIPELINE_VECTOR == 0     # whole vectors
            v = 16 * 64 * pipe.tiles * 4                      # a block's V, float32
            p = 16 * pipe.panels * 8 * pipe.tiles * 4         # its P of a product block
            assert v <= sizes.l2 * cpu_planner.PIPELINE_L2_SHARE
            assert p <= sizes.l2 * cpu_planner.PIPELINE_P_SHARE or pipe.panels == 1
            assert pipe.blocks == -(-32 * 28 * 28 // pipe.tiles)
            assert pipe.parts == min(threads, pipe.blocks)
            assert -(-pipe.blocks // pipe.parts) * pipe.parts <= \
                cpu_planner.EVEN_SPLIT * pipe.blocks
            assert "per-thread pipeline" in pipe.reason and sizes.source in pipe.reason
            assert f"of {pipe.tiles} tiles" in pipe.reason
    assert (cpu_planner.winograd_pipeline(32, 64, 64, (56, 56), 1, small).tiles
            < cpu_planner.winograd_pipeline(32, 64, 64, (56, 56), 1, large).tiles)


def test_an_empty_batch_runs_pass_by_pass_and_says_why() -> None:
    """At batch 0 there are no tiles: the reason says so, not that a tile does not fit
    the L2 (64 channels' tile of V fits any L2 here)."""
    sizes = cpu_planner.Caches(2 << 20, 32 << 20, "test")
    for threads in (1, 2):
        pipe = cpu_planner.winograd_pipeline(0, 64, 64, (56, 56), threads, sizes)
        assert pipe.tiles == 0 and "no tiles" in pipe.reason
        assert "does not fit" not in pipe.reason


def test_blocks_are_whole_vectors_of_tiles_where_the_total_allows() -> None:
    """128 -> 128 on 28x28 (14 tiles a tile row) at batch 1: blocks of whole vectors of
    tiles, only the last one partial; on 16 threads its 196 tiles still split evenly
    (in blocks that cannot all be whole vectors), and the bytes each form moves decide."""
    sizes = cpu_planner.Caches(1 << 20, 32 << 20, "test")
    one = cpu_planner.winograd_pipeline(1, 128, 128, (28, 28), 1, sizes)
    assert one.tiles == 64 and one.blocks == 4 and "the last block 4" in one.reason
    many = cpu_planner.winograd_pipeline(1, 128, 128, (28, 28), 16, sizes)
    assert "16 block(s) of 13 tiles (padded to 16) in 16 piece(s)" in many.reason
    assert many.tiles == 0 and "read again by every block" in many.reason


def test_the_planner_orders_the_pipeline_blocks_for_the_busiest_thread() -> None:
    """ResNet-18's 64-channel convs at batch 1 on two threads (784 tiles in 7 blocks of
    128, the last 16): from the last the busiest thread takes 400 tiles, in order 512; the
    choice is the plan's and its reason says so. Every count is keel's split of the
    blocks (keel.native.pool.chunks), counted here independently."""
    from keel.native import pool

    def busiest(tiles: int, block: int, parts: int, last_first: bool) -> int:
        blocks = -(-tiles // block)
        sizes = [min(block, tiles - q * block) for q in range(blocks)]
        return max(sum(sizes[blocks - hi:blocks - lo] if last_first else sizes[lo:hi])
                   for lo, hi in pool.chunks(blocks, parts))

    assert cpu_planner.pipeline_order(784, 128, 2) == (
        True, "blocks from the last (the busiest thread 400 tiles, 512 in order)")
    for tiles, block, parts in ((784, 128, 2), (784, 128, 3), (49, 32, 2), (196, 13, 16),
                                (100, 7, 3), (64, 16, 4), (17, 16, 1)):
        last_first, why = cpu_planner.pipeline_order(tiles, block, parts)
        ours = busiest(tiles, block, parts, last_first)
        assert ours <= busiest(tiles, block, parts, not last_first)
        assert f"the busiest thread {ours} tiles" in why
    sizes = cpu_planner.Caches(1 << 20, 32 << 20, "test")
    pipe = cpu_planner.winograd_pipeline(1, 64, 64, (56, 56), 2, sizes)
    assert pipe.tiles == 128 and pipe.parts == 2 and pipe.last_first
    assert "blocks from the last (the busiest thread 400 tiles, 512 in order)" in pipe.reason


def test_pipeline_blocks_split_evenly_counted_in_tiles() -> None:
    """128 -> 128 on 28 x 28 at batch 1 (196 tiles, U of 1 MiB not held in a 1 MiB L2):
    on one thread blocks of 64; on two, blocks of 64 would leave one thread 128 tiles and
    the other 68 (even in blocks, 1.31x an even share in tiles), so the planner takes
    blocks of 48 (100 and 96 tiles), not of 49 (each padded to 64 product columns)."""
    sizes = cpu_planner.Caches(1 << 20, 32 << 20, "test")
    one = cpu_planner.winograd_pipeline(1, 128, 128, (28, 28), 1, sizes)
    assert (one.tiles, one.blocks, one.busiest) == (64, 4, 196)
    old_busiest = min(cpu_planner._busiest(196, 64, 2, last) for last in (False, True))
    assert old_busiest == 128 and old_busiest * 2 > cpu_planner.EVEN_SPLIT * 196
    two = cpu_planner.winograd_pipeline(1, 128, 128, (28, 28), 2, sizes)
    assert (two.tiles, two.blocks, two.parts, two.busiest) == (48, 5, 2, 100), two.reason
    assert "the busiest thread 100 tiles" in two.reason
    for threads in (2, 3, 4, 16):
        pipe = cpu_planner.winograd_pipeline(1, 128, 128, (28, 28), threads, sizes)
        if pipe.tiles:
            assert pipe.busiest * pipe.parts <= cpu_planner.EVEN_SPLIT * 196, threads


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_the_planned_blocks_give_one_threads_bits(threads: int) -> None:
    """The planner's blocks for 128 -> 128 on 28 x 28 at batch 1 differ with the threads
    (64 tiles on one, 48 on two): each tile is computed alike in any block, so the result
    is bitwise one thread's, which matches the reference."""
    rng = np.random.default_rng(5)
    x, w, b = _rand(rng, 1, 128, 28, 28), _rand(rng, 128, 128, 3, 3), _rand(rng, 128)
    z = _rand(rng, 1, 128, 28, 28)
    act = ("clip", (-0.5, 0.6))
    one = _native(x, w, b, z, (1, 1, 1, 1), act, threads=1)
    got = _native(x, w, b, z, (1, 1, 1, 1), act, threads=threads)
    assert got.tobytes() == one.tobytes()
    want = _reference([x, w, b, z], {"pads": (1, 1, 1, 1), "activation": act[0],
                                     "activation_params": act[1]})
    np.testing.assert_allclose(one, want, rtol=1e-4, atol=1e-4)


_CLIP = ("clip", (-0.5, 0.6))


def _passes_case(seed: int, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, ...]:
    """A 24 -> 20 conv on two 15 x 15 images (128 tiles) with its epilogue: the arrays
    and the passes' result."""
    rng = np.random.default_rng(seed)
    x, w, b = _rand(rng, 2, 24, 15, 15), _rand(rng, 20, 24, 3, 3), _rand(rng, 20)
    z = _rand(rng, 2, 20, 15, 15)
    _forced(monkeypatch, _PASSES)
    return x, w, b, z, _native(x, w, b, z, (1, 1, 1, 1), _CLIP)


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_either_block_order_gives_the_same_bits(threads: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's blocks in order and from the last (winograd.c runs the order the
    plan passes): bitwise the same result, a partial last block included."""
    x, w, b, z, want = _passes_case(21, monkeypatch)
    act = _CLIP
    tiles = 2 * 8 * 8                                   # 128 tiles: blocks of 48, the last 32
    for last_first in (False, True):
        _forced(monkeypatch, cpu_planner.WinogradPipeline(
            48, 2, 3, min(threads, 3), "forced", last_first))
        got = _native(x, w, b, z, (1, 1, 1, 1), act, threads=threads)
        assert got.tobytes() == want.tobytes(), (threads, last_first, tiles)


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_more_chunks_than_threads_give_the_same_bits(threads: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's blocks in more chunks than threads (claimed one at a time past each
    thread's first, threads.c's keel_parallel_capped), in either order: bitwise the
    passes' result, as the planner plans them at 1, 2 and 4 chunks a thread."""
    x, w, b, z, want = _passes_case(23, monkeypatch)
    act = _CLIP
    blocks = 8                                          # 128 tiles in blocks of 16
    for per_thread in (1, 2, 3, 4):
        used = min(threads, blocks)
        for last_first in (False, True):
            _forced(monkeypatch, cpu_planner.WinogradPipeline(
                16, 2, blocks, min(blocks, used * per_thread), "forced", last_first,
                threads=used))
            got = _native(x, w, b, z, (1, 1, 1, 1), act, threads=threads)
            assert got.tobytes() == want.tobytes(), (threads, per_thread, last_first)
    monkeypatch.undo()
    for per_thread in (1, 2, 4):
        pipe = cpu_planner.winograd_pipeline(1, 64, 64, (56, 56), threads,
                                             per_thread=per_thread)
        assert pipe.tiles and pipe.threads == min(threads, pipe.blocks)
        assert pipe.parts == min(pipe.blocks, pipe.threads * per_thread)
        assert ("claimed one at a time" in pipe.reason) == (pipe.parts > pipe.threads)


def test_the_chunks_a_thread_are_read_at_each_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting PIPELINE_CHUNKS_PER_THREAD changes the next plan (the cached plan is keyed
    on it, not bound to its value at import)."""
    one = cpu_planner.winograd_pipeline(1, 64, 64, (56, 56), 2)
    monkeypatch.setattr(cpu_planner, "PIPELINE_CHUNKS_PER_THREAD", 2)
    two = cpu_planner.winograd_pipeline(1, 64, 64, (56, 56), 2)
    assert two == cpu_planner.winograd_pipeline(1, 64, 64, (56, 56), 2, per_thread=2)
    assert one.tiles and two.parts > one.parts


@pytest.mark.parametrize(("x_shape", "m"), [((1, 64, 6, 6), 64), ((2, 64, 5, 5), 56),
                                           ((1, 96, 5, 9), 72)])
def test_products_split_product_by_product_give_the_same_bits(
        x_shape: tuple[int, ...], m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where U outweighs the tiles (winograd_by_product) the passes' products split
    product by product (the GEMM's tile grid) and the transforms by planes: on 2, 3, 4
    and 16 threads bitwise the result of one thread, which matches the reference."""
    rng = np.random.default_rng(23)
    x, w, b = _rand(rng, *x_shape), _rand(rng, m, x_shape[1], 3, 3), _rand(rng, m)
    z = _rand(rng, x_shape[0], m, *x_shape[2:])
    act = ("relu", ())
    tiles = x_shape[0] * -(-x_shape[2] // 2) * -(-x_shape[3] // 2)
    c = x_shape[1]
    assert not cpu_planner.winograd_by_product(c, m, tiles, 1)
    _forced(monkeypatch, _PASSES)
    one = _native(x, w, b, z, (1, 1, 1, 1), act)
    np.testing.assert_allclose(one, _reference([x, w, b, z], {"pads": (1, 1, 1, 1),
                                                              "activation": "relu"}),
                               rtol=1e-4, atol=1e-4)
    for threads in (2, 3, 4, 16):
        assert cpu_planner.winograd_by_product(c, m, tiles, threads)
        assert not cpu_planner.winograd_by_rows(x_shape[0], c + m, x_shape[2:], threads,
                                                filters=m * c)
        got = _native(x, w, b, z, (1, 1, 1, 1), act, threads=threads)
        assert got.tobytes() == one.tobytes(), threads


def test_resnet18s_256_channel_products_split_by_product_on_two_threads() -> None:
    """U of 4 MiB against 49 tiles: on two threads the passes, each thread half of U,
    and the plan says so; on one thread the passes as before."""
    sizes = cpu_planner.Caches(1 << 20, 32 << 20, "test")
    assert cpu_planner.winograd_by_product(256, 256, 49, 2)
    assert not cpu_planner.winograd_by_product(256, 256, 49, 1)
    assert not cpu_planner.winograd_by_product(64, 64, 784, 2)    # the 64-channel layers
    two = cpu_planner.winograd_pipeline(1, 256, 256, (14, 14), 2, sizes)
    assert two.tiles == 0 and "the products split product by product" in two.reason
    assert cpu_planner.winograd_pipeline(1, 256, 256, (14, 14), 1, sizes).tiles == 0


def test_the_passes_stay_where_the_filters_outweigh_the_tiles() -> None:
    """ResNet-18's 512-channel layer (U of 16 MiB, 16 tiles an image) at batch 32: each
    block would read U again, which the passes read once a chunk; and where there are
    fewer tiles than threads the passes split by planes."""
    sizes = cpu_planner.Caches(1 << 20, 32 << 20, "test")
    deep = cpu_planner.winograd_pipeline(32, 512, 512, (7, 7), 1, sizes)
    assert deep.tiles == 0 and deep.reason.startswith("pass by pass") and "U " in deep.reason
    few = cpu_planner.winograd_pipeline(1, 16, 16, (6, 6), 16, sizes)
    assert few.tiles == 0 and "9 tile(s) for 16 threads" in few.reason


def _conv_model(n: int, c: int, m: int, side: int) -> bytes:
    """Conv (3x3, pad 1, bias) + Relu + Add of the input's conv twin: a residual block's
    fused epilogue."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(12)
    inits = [numpy_helper.from_array(_rand(rng, m, c, 3, 3) * 0.1, "w"),
             numpy_helper.from_array(_rand(rng, m), "b"),
             numpy_helper.from_array(_rand(rng, m, m, 3, 3) * 0.1, "w2")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["t"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["t"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["u"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["u", "r"], ["y"])]
    graph = helper.make_graph(
        nodes, "winograd_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, m, side, side])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def test_a_model_gives_the_same_bits_on_any_threads_and_explains_its_form() -> None:
    from keel import load_model

    model = _conv_model(2, 128, 128, 28)
    x = _rand(np.random.default_rng(13), 2, 128, 28, 28)
    results, forms = {}, set()
    for threads in (1, 2, 3, 4, 16):
        loaded = load_model(model, backend="cpu", threads=threads, plan_cache=False)
        convs = [n.plan for n in loaded.plan.nodes if n.op == "conv"]
        assert len(convs) == 2
        for plan in convs:
            assert plan is not None and "winograd" in (plan.variant,
                                                       plan.option("conv_variant"))
            why = plan.reason("winograd_pipeline")        # stated there only
            form = "per-thread pipeline" if "per-thread pipeline:" in why else "pass by pass"
            assert f"on {threads} thread(s) {form}" in why
            assert "pipeline" not in plan.reason("layout") + plan.reason("chunk")
            forms.add(form)
        results[threads] = loaded.predict({"x": x})["y"]
    assert "per-thread pipeline" in forms
    for threads, y in results.items():
        np.testing.assert_array_equal(y, results[1], err_msg=f"{threads} threads")
    want = load_model(model, backend="reference").predict({"x": x})["y"]
    np.testing.assert_allclose(results[1], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("x_shape", "m"), [((1, 48, 7, 7), 56), ((1, 16, 5, 8), 30),
                                           ((2, 24, 7, 7), 33), ((1, 8, 3, 3), 9)])
@pytest.mark.parametrize("pipeline", [False, True])
def test_products_of_one_vector_of_tiles_in_tall_tiles_give_the_same_bits(
        x_shape: tuple[int, ...], m: int, pipeline: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's winograd_tall (a 7 x 7 map at batch 1: 16 tiles) against the 8 x 32
    tiles, pass by pass and as the pipeline, on 1 to 16 threads: the same bits."""
    rng = np.random.default_rng(13)
    x, w, b = _rand(rng, *x_shape), _rand(rng, m, x_shape[1], 3, 3), _rand(rng, m)
    z = _rand(rng, x_shape[0], m, *x_shape[2:])
    act = ("relu", ())
    tiles = x_shape[0] * -(-x_shape[2] // 2) * -(-x_shape[3] // 2)
    assert cpu_planner.winograd_tall(16) and not cpu_planner.winograd_tall(49)
    pipe = cpu_planner.WinogradPipeline(min(tiles, 16), 2, -(-tiles // 16), 1, "forced")
    _forced(monkeypatch, pipe if pipeline else _PASSES)
    monkeypatch.setattr(cpu_planner, "winograd_tall", lambda columns: False)
    want = _native(x, w, b, z, (1, 1, 1, 1), act)
    np.testing.assert_allclose(want, _reference([x, w, b, z], {"pads": (1, 1, 1, 1),
                                                               "activation": "relu"}),
                               rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(cpu_planner, "winograd_tall", lambda columns: True)
    for threads in (1, 2, 3, 4, 16):
        if pipeline:
            _forced(monkeypatch, cpu_planner.WinogradPipeline(
                pipe.tiles, pipe.panels, pipe.blocks, min(threads, pipe.blocks), "forced"))
        got = _native(x, w, b, z, (1, 1, 1, 1), act, threads=threads)
        assert got.tobytes() == want.tobytes(), threads


@pytest.mark.parametrize(("x_shape", "m"), [((2, 24, 15, 15), 20), ((1, 64, 28, 28), 40),
                                           ((1, 48, 7, 7), 56)])
@pytest.mark.parametrize("pipeline", [False, True])
def test_products_in_lanes_tiles_or_panels_give_the_same_bits(
        x_shape: tuple[int, ...], m: int, pipeline: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Either answer of the plan's winograd_lanes (the vendor's faster form), pass by
    pass and as the pipeline, on 1 to 16 threads: the same bits as one thread in 8 x 32
    panels, which match the reference."""
    rng = np.random.default_rng(17)
    x, w, b = _rand(rng, *x_shape), _rand(rng, m, x_shape[1], 3, 3), _rand(rng, m)
    z = _rand(rng, x_shape[0], m, *x_shape[2:])
    tiles = x_shape[0] * -(-x_shape[2] // 2) * -(-x_shape[3] // 2)
    block = min(tiles, 48)
    results = []
    for lanes in (False, True):
        for threads in (1, 2, 3, 16):
            pieces = min(threads, -(-tiles // block))
            _forced(monkeypatch, cpu_planner.WinogradPipeline(
                block, 2, -(-tiles // block), pieces, "forced") if pipeline else _PASSES)
            results.append(_native(x, w.copy(), b, z, (1, 1, 1, 1), _CLIP, threads=threads,
                                   lanes=lanes))
    np.testing.assert_allclose(results[0], np.clip(_reference(
        [x, w, b], {"pads": (1, 1, 1, 1)}) + z, *_CLIP[1]), rtol=1e-4, atol=1e-4)
    assert all(r.tobytes() == results[0].tobytes() for r in results[1:])


def test_lanes_tiles_for_the_vendors_measured_faster() -> None:
    """AMD's cores run Winograd's products in lanes tiles; Intel's and unknown ones in
    8 x 32 panels, and the reason says which."""
    assert cpu_planner.winograd_lanes("AMD")[0]
    for vendor in ("Intel", None):
        lanes, why = cpu_planner.winograd_lanes(vendor)
        assert not lanes and "panels" in why


@pytest.mark.parametrize("vendor", ["Hygon", "ARM", None])
def test_lanes_reason_claims_no_measurement_on_other_vendors(vendor: str | None) -> None:
    """The panels' reason names the shared port only for Intel, where it was measured;
    elsewhere (Hygon's Zen-derived cores included) it says it was not measured."""
    assert "share a port" in cpu_planner.winograd_lanes("Intel")[1]
    lanes, why = cpu_planner.winograd_lanes(vendor)
    assert not lanes and "not measured on" in why and "share a port" not in why


@pytest.mark.parametrize("threads", [2, 3, 16])
def test_convs_run_pass_by_pass_bind_as_steps_with_the_kernels_bits(threads: int) -> None:
    """A conv planned pass by pass on several threads (U of 128 x 128 filters
    outweighs 16 tiles: the products in tall tiles, as ResNet-18's 512-channel layer's)
    binds as a program step, as the per-thread pipeline does: its transforms and
    products with their arguments converted once. Bound runs give bitwise what the
    kernels give run step by step, and the bits of one thread (the pipeline)."""
    from keel import load_model
    from keel.execution import program as program_module

    model = _conv_model(1, 128, 128, 7)
    rng = np.random.default_rng(14)
    loaded = load_model(model, backend="cpu", threads=threads, plan_cache=False)
    plans = [n.plan for n in loaded.plan.nodes if n.op == "conv"]
    assert all(p is not None and "pass by pass" in p.reason("winograd_pipeline")
               for p in plans)
    x = _rand(rng, 1, 128, 7, 7)
    loaded.predict({"x": x})
    fast = loaded._fast_path({"x": x})
    assert fast is not None
    program = fast[0][1]
    bound = (program_module._BOUND, program_module._HELD)    # _HELD: the graph output's
    kinds = [step.op for step, hot in zip(program._steps, program._hot, strict=True)
             if hot[0] in bound]
    assert kinds.count("conv") == 2
    for seed in (15, 16):
        x = _rand(np.random.default_rng(seed), 1, 128, 7, 7)
        got = loaded.predict({"x": x})["y"]
        np.testing.assert_array_equal(got, loaded.intermediates({"x": x})["y"])
        one = load_model(model, backend="cpu", threads=1, plan_cache=False)
        assert got.tobytes() == one.predict({"x": x})["y"].tobytes()
        want = load_model(model, backend="reference").predict({"x": x})["y"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
