"""The native GEMM's row-panels-first order (keel/native/src/gemm.c, row_panels_first):
a raw B read in place or packed whole per block (KEEL_STREAM when it is larger than
cache), the next block prefetched, a conv's gathered taps on large images, and 1x1
convs on the native kernel (direct or with the images stacked). Against float64
NumPy and the reference backend; any thread split gives bitwise the same result."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.cpu import conv_gemm
from keel.backends.cpu import native_gemm as ng
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.backend import CpuBackend
from keel.backends.cpu.conv_rules import conv_case, pick
from keel.backends.reference.backend import ReferenceBackend
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry
from tests.native._conv_support import prepared_flags

pytestmark = pytest.mark.usefixtures("native_gemm_tier")


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _mr_nr() -> tuple[int, int]:
    geo = ng.geometry()
    assert geo is not None
    return geo


def _gemm(a: np.ndarray, b: np.ndarray, threads: int, stream: bool,
          monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """clip(A @ B[t] + bias + R[t], -1, 2) with A packed on the left and B raw."""
    monkeypatch.setattr(cpu_planner, "STREAM_BYTES", 0 if stream else 2**40)
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)
    m, t, n = a.shape[0], b.shape[0], b.shape[2]
    rng = np.random.default_rng(5)
    bias, res = _rand(rng, m), _rand(rng, t, m, n)
    y = np.empty((t, m, n), np.float32)
    packed = ng.pack(a, left=True)
    assert packed is not None
    assert ng.gemm(packed, b, y, bias=bias, bias_rows=True, residual=res, clip=(-1.0, 2.0),
                   threads=threads)
    want = np.clip(np.einsum("mk,tkn->tmn", a.astype(np.float64), b.astype(np.float64))
                   + bias[:, None] + res, -1.0, 2.0)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    return y


@pytest.mark.parametrize("stream", [False, True])
def test_every_column_remainder_in_place_and_packed(stream: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Column remainders of the tile and of the widest block, few and many row panels."""
    mr, nr = _mr_nr()
    rng = np.random.default_rng(1)
    for m in (1, 3, mr + 1, 17 * mr + 5):
        for n in (1, nr - 1, nr + 3, 9 * nr + 7, 70 * nr + 1):
            for k in (1, 16, 33):
                _gemm(_rand(rng, m, k), _rand(rng, 2, k, n), 1, stream, monkeypatch)


@pytest.mark.parametrize("stream", [False, True])
def test_transposed_b_is_packed(stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    b = _rand(rng, 3, 300, 40).transpose(0, 2, 1)          # (3, 40, 300), column stride 40
    _gemm(_rand(rng, 20, 40), b, 1, stream, monkeypatch)


@pytest.mark.parametrize("m,k,n", [(96, 16, 5000), (16, 32, 9000), (13, 7, 2100)])
def test_threads_give_bitwise_the_same(m: int, k: int, n: int,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    a, b = _rand(rng, m, k), _rand(rng, 3, k, n)
    for stream in (False, True):
        outs = [_gemm(a, b, threads, stream, monkeypatch) for threads in (1, 2, 3)]
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(outs[0], outs[2])


def test_in_place_and_packed_b_agree_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(4)
    a, b = _rand(rng, 40, 24), _rand(rng, 2, 24, 3000)
    np.testing.assert_array_equal(_gemm(a, b, 1, False, monkeypatch),
                                  _gemm(a, b, 1, True, monkeypatch))


def _run(backend: Any, inputs: list[Any], attrs: dict[str, Any], variant: str) -> np.ndarray:
    return np.asarray(backend.run(Op.CONV, inputs, attrs=attrs, variant=variant)[0])


CONVS = [
    # X, W, attrs: 1x1 read in place (14x14: 88 % full panels), stacked (7x7), a large
    # image's gathered taps (>= 4096 output pixels), strided.
    ((3, 24, 14, 14), (40, 24, 1, 1), {}),
    ((4, 20, 7, 7), (36, 20, 1, 1), {}),
    ((2, 3, 66, 66), (8, 3, 3, 3), {"pads": (1, 1, 1, 1)}),
    ((2, 3, 131, 129), (16, 3, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", CONVS)
def test_convs_match_reference_with_bitwise_thread_splits(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "STREAM_BYTES", 0)      # small inputs take the streaming path
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)
    rng = np.random.default_rng(6)
    x, w, b = _rand(rng, *x_shape), _rand(rng, *w_shape), _rand(rng, w_shape[0])
    full = {**attrs, "activation": "clip", "activation_params": (-0.5, 1.5)}
    plain = _run(ReferenceBackend(), [x, w, b], attrs, "default")
    z = _rand(rng, *plain.shape)
    for inputs in ([x, w, b], [x, w, b, z]):
        want = _run(ReferenceBackend(), inputs, full, "default")
        outs = [_run(CpuBackend(threads=t), inputs, full, "native") for t in (1, 2)]
        np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(outs[0], outs[1])


def test_pointwise_layouts() -> None:
    """14x14 reads X in place; 7x7 at batch 32 stacks the images (49 of 64 columns)."""
    def layout(n: int, side: int) -> conv_gemm.NativeLayout:
        geo = conv_geometry(Op.CONV, (n, 16, side, side), (32, 16, 1, 1), {})
        return cpu_planner.native_layout(geo)

    assert layout(32, 14).direct
    stacked = layout(32, 7)
    assert not stacked.direct and stacked.stacked
    assert layout(1, 7).direct


def test_default_takes_1x1_natively_at_any_batch() -> None:
    rules = cpu_planner.available_rules()

    def choice(n: int, side: int) -> tuple[str, str]:
        case = conv_case(Op.CONV, (n, 64, side, side), (384, 64, 1, 1), {}, "float32")
        assert case is not None
        return pick(case, rules)

    name, why = choice(32, 14)
    assert name == "native" and "0.77-1.01x the pointwise GEMM's time" in why
    assert choice(32, 7)[0] == "native"                   # stacked: 1568 pixels
    name, why = choice(1, 14)
    assert name == "native" and "level at batch 1 on one thread and 0.75x on two" in why
    assert choice(1, 7)[0] == "native"                    # 49 pixels
    conv = conv_case(Op.CONV, (1, 64, 7, 7), (384, 64, 1, 1), {}, "float64")
    assert conv is not None and pick(conv, rules)[0] == "pointwise"     # native: float32


def _gathered(batch: int) -> tuple[ng.Rows, np.ndarray]:
    """A gathered B of 16 taps x 5000 columns (rows of 50 pixels, 3 apart in the
    buffer, as output rows in a phase image) over `batch` buffers of 20,000 floats,
    and the same B as a dense (batch, 16, 5000) array."""
    rng = np.random.default_rng(7)
    data = _rand(rng, batch * 20000)
    offsets = np.arange(16, dtype=np.int64) * 700
    columns = np.arange(5000, dtype=np.int64) + (np.arange(5000) // 50) * 3
    dense = np.stack([data[t * 20000 + offsets[:, None] + columns[None, :]]
                      for t in range(batch)])
    return ng.Rows(data, offsets, 5000, 20000, columns), dense


@pytest.mark.parametrize("batch,streams", [(1, False), (2, True)])
def test_gathered_taps_stream_by_the_span_they_read(batch: int, streams: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A gathered B streams by the bytes of the buffer span it reads (one buffer:
    63 KB; two: 143 KB), not by its k x n taps (320 KB a product): with STREAM_BYTES
    at 100 KB one product reads from cache, two stream. Either way the same bits and
    the product of the dense taps."""
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)
    b, dense = _gathered(batch)
    a = _rand(np.random.default_rng(8), 70, 16)
    packed = ng.pack(a, left=True)
    assert packed is not None
    outs = []
    for limit in (100_000, 2**40):
        monkeypatch.setattr(cpu_planner, "STREAM_BYTES", limit)
        y = np.empty((batch, 70, 5000), np.float32)
        call = ng.prepare(packed, b, y, clip=(-1.0, 2.0))
        assert call is not None
        stream = bool(int(call.values[ng._FLAGS_FIELD]) & ng._STREAM)
        assert stream == (streams and limit == 100_000)
        for threads in (1, 2):
            call.run(threads)
            outs.append(y.copy())
    want = np.clip(np.einsum("mk,tkn->tmn", a.astype(np.float64), dense.astype(np.float64)),
                   -1.0, 2.0)
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-4)
    for out in outs[1:]:
        np.testing.assert_array_equal(outs[0], out)


def test_gathered_taps_stream_for_an_output_larger_than_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Gathered taps of one image stream where the plan says so (the planner's
    output_streams: one image of the conv, at least ROWS_FIRST_TAPS_FROM columns, an
    output larger than STREAM_BYTES; here 1 MB against C's 1.4 MB and the image's
    63 KB), so that gemm.c writes C row panel by row panel: the same bits as column
    panel by column panel, at 1 and 2 threads, and the product of the dense taps."""
    assert cpu_planner.output_streams(1, 5000, 3 << 20)
    assert not cpu_planner.output_streams(2, 5000, 3 << 20)
    assert not cpu_planner.output_streams(1, cpu_planner.ROWS_FIRST_TAPS_FROM - 1, 3 << 20)
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)
    monkeypatch.setattr(cpu_planner, "STREAM_BYTES", 1_000_000)
    b, dense = _gathered(1)
    a = _rand(np.random.default_rng(9), 70, 16)
    packed = ng.pack(a, left=True)
    assert packed is not None
    outs = []
    for streams in (True, False):
        y = np.empty((1, 70, 5000), np.float32)
        call = ng.prepare(packed, b, y, bias=_rand(np.random.default_rng(3), 70),
                          bias_rows=True, clip=(-1.0, 2.0), output_streams=streams)
        assert call is not None
        stream = bool(int(call.values[ng._FLAGS_FIELD]) & ng._STREAM)
        assert stream == streams
        for threads in (1, 2):
            y.fill(np.nan)
            call.run(threads)
            outs.append(y.copy())
    bias = _rand(np.random.default_rng(3), 70)
    want = np.clip(np.einsum("mk,tkn->tmn", a.astype(np.float64), dense.astype(np.float64))
                   + bias[:, None], -1.0, 2.0)
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-4)
    for out in outs[1:]:
        np.testing.assert_array_equal(outs[0], out)


def _conv_model(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                attrs: dict[str, Any]) -> Any:
    from onnx import TensorProto, helper, numpy_helper

    w = _rand(np.random.default_rng(11), *w_shape) * np.float32(0.1)
    out = conv_geometry(Op.CONV, x_shape, w_shape, attrs)
    y_shape = (x_shape[0], w_shape[0], *out.window.out_spatial)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


STEM = ((1, 3, 224, 224), (64, 3, 7, 7),
        {"strides": [2, 2], "pads": [3, 3, 3, 3], "kernel_shape": [7, 7]})
STACKED = ((32, 320, 7, 7), (1280, 320, 1, 1), {})     # 1568 columns of 32 images


@pytest.mark.parametrize("conv,streams", [(STEM, True), (STACKED, False)])
def test_the_plan_decides_which_gathered_outputs_stream(
        conv: tuple[Any, ...], streams: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner marks a gathered conv's taps to stream for its output by the conv's
    images, not the GEMM's batch: ResNet-18's stem at batch 1 streams (its output
    3.1 MiB, 12544 columns); a 1x1 conv whose 32 images are stacked in one product of
    batch 1 (7.7 MiB of output) does not. The prepared call carries what the plan and
    explain() say, and the result is the reference's."""
    import keel

    model = _conv_model(*conv)
    loaded = keel.load_model(model, backend="cpu", threads=1)
    plans = [n.plan for n in loaded.plan.nodes if n.plan is not None]
    assert len(plans) == 1 and bool(plans[0].option("output_streams", False)) is streams
    assert ("(output_streams)" in loaded.explain()) is streams
    flags = prepared_flags(monkeypatch, ng._STREAM)
    x = _rand(np.random.default_rng(12), *conv[0])
    got = loaded.run(None, {"x": x})[0]
    assert flags and set(flags) == {streams}
    want = keel.load_model(model, backend="reference").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gathered_outputs_of_few_columns_do_not_stream() -> None:
    """One image of fewer than ROWS_FIRST_TAPS_FROM output pixels is not marked, however
    large its output (gemm.c runs such taps column panel by column panel anyway): a
    64 -> 512 3x3 conv on 56x56 (3136 pixels, 6.1 MiB of output); on 112x112 it is."""
    for side, streams in ((56, False), (112, True)):
        geo = conv_geometry(Op.CONV, (1, 64, side, side), (512, 64, 3, 3),
                            {"pads": [1, 1, 1, 1]})
        assert cpu_planner.native_tiles(geo, "gathered")[1] is streams
        assert ("(output_streams)" in cpu_planner._output_streams_reason(geo)) is streams
