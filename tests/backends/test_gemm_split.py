"""The native GEMM's split over threads on a 16-core server, planned here from its probe:
the benchmark models' MatMul / Gemm products (and ResNet's 1x1 convs at 7x7) give every
one of 16 threads work, evenly, and the node plans say how (explain()). The pieces are
counted here from gemm.c's documented tile order and threads.c's chunks, independently of
the planner's own arithmetic."""

from __future__ import annotations

import math
from typing import Any

import onnx
import pytest
from onnx import shape_inference

from benchmarks import zoo
from keel import load_model
from keel.backends.cpu import planner
from keel.backends.cpu.backend import CpuBackend
from keel.dtypes import DType
from keel.hardware.fakes import fake_profile
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType

F32 = DType.FLOAT32
SERVER = fake_profile("x86-avx512-server")       # Xeon 8480+: 2 MiB L2 a core
AVX512_TILE = (8, 32)                            # gemm.c's tile there: 8 rows x 2 vectors


def _products(name: str, batch: int) -> list[tuple[Op, tuple[int, ...], tuple[int, ...],
                                                   dict[str, Any]]]:
    """(op, A's shape, B's shape, attributes) of the model's MatMul / Gemm nodes whose B
    is a weight (one product per node), at ``batch``."""
    model = zoo.MODELS[name].build()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = batch
    inferred = shape_inference.infer_shapes(model)
    shapes = {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
              for v in [*inferred.graph.value_info, *inferred.graph.input]}
    weights = {w.name: tuple(w.dims) for w in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm") and node.input[1] in weights:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            op = Op.MATMUL if node.op_type == "MatMul" else Op.GEMM
            found.append((op, shapes[node.input[0]], weights[node.input[1]],
                          {"trans_b": attrs.get("transB", 0)} if op is Op.GEMM else {}))
    assert found
    return found


def _thread_work(split: planner.GemmSplit, batch: int, m: int, n: int) -> list[int]:
    """Each thread's multiply-adds per unit of depth: tile u is row group u % R of column
    group (u / R) % C of product u / (R C), a group of P panels in G groups is
    [q P / G, (q + 1) P / G), and thread t takes the t-th of ``parts`` near-equal runs."""
    mr, nr = AVX512_TILE
    mp, np_ = -(-m // mr), -(-n // nr)
    r, c = split.rows, split.cols

    def size(q: int, groups: int, panels: int, width: int, whole: int) -> int:
        lo, hi = q * panels // groups * width, (q + 1) * panels // groups * width
        return max(0, min(hi, whole) - lo)

    tiles = [size(u % r, r, mp, mr, m) * size(u // r % c, c, np_, nr, n)
             for u in range(batch * r * c)]
    base, extra = divmod(len(tiles), split.parts)
    work, lo = [], 0
    for t in range(split.parts):
        hi = lo + base + (t < extra)
        work.append(sum(tiles[lo:hi]))
        lo = hi
    return work


def _even(work: list[int], split: planner.GemmSplit, m: int, n: int) -> bool:
    """Whether the busiest thread's work is within one panel of a tile (a row panel
    across its columns, or a column panel down its rows) of the mean: as even as whole
    panels allow."""
    mr, nr = AVX512_TILE
    row_panels, col_panels = math.ceil(m / mr), math.ceil(n / nr)
    rows = min(m, math.ceil(row_panels / split.rows) * mr)
    cols = min(n, math.ceil(col_panels / split.cols) * nr)
    return max(work) <= sum(work) / len(work) + max(mr * cols, rows * nr)


def _plan(op: Op, a: tuple[int, ...], b: tuple[int, ...], attrs: dict[str, Any]) -> Any:
    full = dict(get_schema(op).normalize_attrs(attrs))
    return CpuBackend(threads=16).plan_node(op, [TensorType(F32, a), TensorType(F32, b)],
                                            full, profile=SERVER)


def _mkn(op: Op, a: tuple[int, ...], b: tuple[int, ...], attrs: dict[str, Any]
         ) -> tuple[int, int, int]:
    n = b[0] if attrs.get("trans_b") else b[1]
    return math.prod(a[:-1]), a[-1], n


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("name", ["mlp", "bert_mini", "resnet18", "mobilenetv2"])
def test_every_thread_of_sixteen_gets_even_work(name: str, batch: int) -> None:
    sizes = planner.caches(SERVER)
    for op, a, b, attrs in _products(name, batch):
        m, k, n = _mkn(op, a, b, attrs)
        threads = planner.product_threads(16, 1, m, n, k, AVX512_TILE[0], (True, False))
        split = planner.gemm_split(1, m, n, k, 16, AVX512_TILE, sizes)
        if threads < 2:
            assert split.parts == 1 and split.reason.startswith("not split")
            continue
        work = _thread_work(split, 1, m, n)
        assert split.parts == len(work) == min(threads, split.pieces)
        assert sum(work) == m * n and min(work) > 0, (m, k, n, split)
        assert _even(work, split, m, n), (m, k, n, work, split.reason)
        if m * n >= 16 * 8 * 32:      # room for 16 whole micro-tiles: all 16 threads work
            assert split.parts == threads == 16, (m, k, n, split.reason)


def test_bert_minis_products_split_in_two_dimensions_on_sixteen_threads() -> None:
    """Batch 1: each projection (128 x 256 @ 256 x 256) is 16 row panels by 8 column
    panels; 16 threads get 4 x 4 tiles, where a split by rows alone would give each a
    single row panel against all of B."""
    sizes = planner.caches(SERVER)
    split = planner.gemm_split(1, 128, 256, 256, 16, AVX512_TILE, sizes)
    assert (split.rows, split.cols, split.parts) == (4, 4, 16)
    assert split.reason.startswith("2-D split 4x4 tiles of 32x64 (4 row x 4 column groups: "
                                   "16 tiles) over 16 threads, the busiest 1.00x")
    assert "within the 2048 KiB L2 (the profile's Intel(R) Xeon(R) Platinum 8480+" in (
        split.reason)
    # Batch 32: 4096 rows; every grid of 16 tiles is as even, the squarest tile wins.
    ffn = planner.gemm_split(1, 4096, 1024, 256, 16, AVX512_TILE, sizes)
    assert ffn.parts == 16 and ffn.pieces == 16


def test_the_node_plans_say_the_split_in_explain() -> None:
    """Where the native GEMM runs the node (the native tier is built) its plan states the
    grid; the NumPy kernel's plan states none."""
    model = load_model(zoo.build("bert_mini"), hardware=SERVER, threads=16)
    text = model.explain()
    projection = ("threads: 16 (16 kernel thread(s) of 16: 16,777,216 flops, at least "
                  "400,000 per thread; 2-D split 4x4 tiles of 32x64")
    for op, a, b, attrs in _products("bert_mini", 32):
        plan = _plan(op, a, b, attrs)
        m, k, n = _mkn(op, a, b, attrs)
        split = planner.gemm_split(1, m, n, k, plan.threads, AVX512_TILE,
                                   planner.caches(SERVER))
        native = plan.variant == "native"
        assert plan.threads == 16
        assert plan.reason("threads").endswith(split.reason) == native
        assert ("split" in plan.reason("threads")) == native
        # Q, K, V and output projections of 4 layers at batch 1
        assert text.count(projection) == (16 if native else 0)


@pytest.mark.parametrize("batch", [1, 32])
def test_resnets_1x1_convs_at_7x7_split_over_sixteen(batch: int) -> None:
    """A 1x1 conv's product: the packed filter (out x in) times the image (in x 49
    pixels), the image raw. Batch 1 has two column panels, so the rows must split too;
    at batch 32 each thread takes two images' worth."""
    sizes = planner.caches(SERVER)
    for out_ch, in_ch in [(512, 256), (512, 512), (2048, 512)]:
        split = planner.gemm_split(batch, out_ch, 49, in_ch, 16, AVX512_TILE, sizes,
                                   raw=(False, True))
        work = _thread_work(split, batch, out_ch, 49)
        assert split.parts == 16 and min(work) > 0
        assert sum(work) == batch * out_ch * 49 and _even(work, split, out_ch, 49), work
        assert split.pieces >= 16


def test_two_threads_keep_the_measured_1d_choices() -> None:
    """On this machine's two threads the grid is a 1-D split, the larger panel dimension
    (as measured before the grid existed): MLP at batch 32 by columns, BERT-mini's FFN
    at batch 32 by rows."""
    sizes = planner.Caches(1 << 20, 32 << 20, "test")
    mlp = planner.gemm_split(1, 32, 512, 784, 2, AVX512_TILE, sizes)
    assert (mlp.rows, mlp.cols) == (1, 2)
    ffn = planner.gemm_split(1, 4096, 1024, 256, 2, AVX512_TILE, sizes)
    assert (ffn.rows, ffn.cols) == (2, 1)
    assert planner.gemm_split(1, 32, 512, 784, 1, AVX512_TILE, sizes).parts == 1
