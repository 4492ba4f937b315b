"""The native int8 kernels (qgemm.c) against the reference kernels, bit for bit, on each
of their instruction paths: AVX-512 VNNI, AVX-VNNI and portable C (each where this CPU
and compiler can build and run it)."""

from __future__ import annotations

import enum
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keel import config, native
from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import native_qgemm
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.kernels import load as load_cpu
from keel.backends.plan import PlanRequest
from keel.backends.reference.kernels import load as load_reference
from keel.dtypes import DType
from keel.errors import KeelError
from keel.native import build
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType

CPU = load_cpu()
REFERENCE = load_reference()
RNG = np.random.default_rng(41)

# (flags instead of -march=native, the path that build must take, CPU flag it needs)
PATHS = [(("-march=native",), "avx512-vnni", "avx512_vnni"),
         # AVX-512 VNNI without VBMI2: the direct convolution copies its valid columns
         # out run by run instead of compressing them in a register
         (("-march=native", "-mno-avx512vbmi2"), "avx512-vnni", "avx512_vnni"),
         (("-march=native", "-mno-avx512vnni"), "avx-vnni", "avx_vnni"),
         (("-march=native", "-mno-avx512vnni", "-mno-avxvnni"), "portable", None)]
PATH_IDS = ["avx512-vnni", "avx512-vnni-no-vbmi2", "avx-vnni", "portable"]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in
            line.split(":", 1)[1].split()}


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], Path]:
    return {flags: tmp_path_factory.mktemp("qgemm") for flags, _, _ in PATHS}


@pytest.fixture(params=PATHS, ids=PATH_IDS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
         caches: dict[tuple[str, ...], Path]) -> Iterator[str]:
    """The int8 kernels built for one instruction path."""
    flags, name, needs = request.param
    if platform.machine() != "x86_64" and name != "portable":
        pytest.skip(f"{name} is an x86-64 path")
    if needs is not None and needs not in _cpu_flags():
        pytest.skip(f"this CPU lacks {needs}")
    monkeypatch.setenv("KEEL_CACHE_DIR", str(caches[flags]))
    monkeypatch.delenv("KEEL_NATIVE", raising=False)
    config.reload_settings()
    monkeypatch.setattr(build, "_ARCH_FLAGS", flags)
    native.reset()
    if not native_qgemm.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    assert native_qgemm.isa() == name
    yield name
    native.reset()


def _ctx(threads: int = 1) -> KernelContext:
    return KernelContext(np, "cpu", DeviceKind.CPU, threads)


def _q(dtype: Any, *shape: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def _scales(*shape: int) -> np.ndarray:
    return RNG.uniform(0.002, 0.02, shape).astype(np.float32)


def _run(table: Any, op: Op, inputs: list[Any], attrs: dict[str, Any], variant: str,
         threads: int = 1, prepack: bool = False) -> np.ndarray:
    attrs = get_schema(op).normalize_attrs(attrs)
    kv = table.get(op, variant)
    ctx = _ctx(threads)
    if prepack and kv.prepack is not None:
        const = [a if i in (3, 4, 5) else None for i, a in enumerate(inputs)]
        ctx = KernelContext(np, "cpu", DeviceKind.CPU, threads, kv.prepack(ctx, const, attrs))
    return np.asarray(kv.fn(ctx, inputs, attrs, None)[0])


def _reference(op: Op, inputs: list[Any], attrs: dict[str, Any]) -> np.ndarray:
    return _run(REFERENCE, op, inputs, attrs, "default")


# (x dtype, w dtype, weight zero points, N, C, H, W, M, k, stride, pad, dilation, group)
CONVS = [
    (np.uint8, np.int8, False, 2, 3, 9, 11, 5, 3, 1, 1, 1, 1),
    (np.uint8, np.int8, True, 1, 8, 7, 7, 16, 1, 1, 0, 1, 1),
    (np.int8, np.int8, True, 3, 6, 10, 10, 9, 3, 2, 1, 1, 3),
    (np.uint8, np.uint8, True, 1, 16, 12, 12, 70, 3, 1, 1, 2, 1),
    (np.int8, np.int8, False, 2, 4, 13, 9, 4, 5, 2, 2, 1, 4),      # depthwise, 5x5
    (np.uint8, np.int8, False, 1, 33, 8, 8, 65, 3, 1, 1, 1, 1),     # k past a multiple of 4
    (np.uint8, np.int8, True, 2, 8, 9, 70, 8, 3, 1, 1, 1, 8),       # depthwise, wide rows
    (np.uint8, np.uint8, False, 1, 5, 11, 11, 5, 3, 2, 1, 1, 5),    # depthwise, stride 2
    (np.int8, np.int8, True, 1, 3, 6, 6, 3, 3, 1, 2, 2, 3),         # depthwise, dilated
    (np.int8, np.int8, False, 2, 6, 5, 37, 8, 3, 1, 1, 1, 1),       # rows of 16 pixels + tail
    (np.uint8, np.int8, False, 1, 16, 20, 20, 16, 3, 1, 1, 1, 1),
    (np.uint8, np.uint8, True, 2, 4, 11, 23, 4, 5, 1, 2, 1, 4),     # depthwise 5x5: odd taps
    (np.uint8, np.int8, True, 2, 40, 9, 9, 40, 3, 2, 1, 1, 40),     # depthwise, 32 channels + 8
    # depthwise planes past INT8_DEPTHWISE_LANES_MAX_PIXELS: the plane-wise kernel
    (np.uint8, np.int8, True, 1, 3, 40, 40, 3, 3, 1, 1, 1, 3),
    (np.int8, np.int8, False, 1, 2, 70, 66, 2, 3, 2, 1, 1, 2),
    (np.uint8, np.int8, True, 1, 3, 20, 75, 8, 7, 2, 3, 1, 1),      # stride 2, rows past 32
    (np.uint8, np.int8, False, 2, 5, 9, 8, 6, 1, 2, 0, 1, 1),       # 1x1 stride 2
    # strided, without im2col: the padded image split into the strides' phases
    (np.uint8, np.int8, False, 2, 6, 11, 10, 8, 3, 2, 1, 1, 1),     # odd and even sides
    (np.int8, np.int8, False, 1, 3, 23, 21, 7, 7, 2, 3, 1, 1),      # 7x7 stride 2
    (np.uint8, np.int8, False, 1, 5, 10, 13, 6, 3, 3, 0, 1, 1),     # stride 3, no padding
    (np.uint8, np.int8, False, 1, 9, 40, 44, 13, 3, 2, 1, 1, 1),    # rows past 16 pixels
    # small maps: a block of 64 positions spans images stacked with shared padding
    (np.uint8, np.int8, False, 5, 8, 4, 5, 10, 3, 1, 1, 1, 1),
    (np.int8, np.int8, False, 4, 6, 7, 6, 9, 3, 2, 1, 1, 1),
    (np.uint8, np.int8, False, 3, 4, 5, 5, 6, 1, 1, 2, 1, 1),       # padding past the kernel
    # compact columns (small maps, 64 channels or more): output pixels only
    (np.uint8, np.int8, False, 4, 8, 7, 7, 70, 3, 1, 1, 1, 1),
    (np.int8, np.int8, False, 3, 12, 9, 9, 64, 3, 2, 1, 1, 1),
    # row segments (output rows of 16 or 8 pixels): one output row per 16 or 8 columns
    (np.uint8, np.int8, False, 3, 10, 8, 8, 20, 3, 1, 1, 1, 1),
    (np.int8, np.int8, False, 2, 6, 9, 32, 8, 3, 2, 1, 1, 1),
    (np.uint8, np.int8, False, 3, 7, 5, 16, 13, 3, 1, 1, 1, 1),
    (np.uint8, np.int8, False, 2, 9, 8, 8, 66, 3, 1, 1, 1, 1),
]


def _conv_inputs(case: tuple[Any, ...]) -> tuple[list[Any], dict[str, Any]]:
    xdt, wdt, wzero, n, c, h, w, m, k, s, p, d, g = case
    x, wt = _q(xdt, n, c, h, w), _q(wdt, m, c // g, k, k)
    w_zp = (_q(wdt, m) // 8).astype(wdt) if wzero else np.zeros(m, wdt)
    inputs = [x, np.float32(0.05), np.array(7 if xdt is np.uint8 else -3, xdt), wt,
              _scales(m), w_zp, np.float32(0.4), np.array(100, np.uint8),
              RNG.integers(-5000, 5000, m).astype(np.int32)]
    return inputs, {"strides": [s, s], "pads": [p] * 4, "dilations": [d, d], "group": g}


@pytest.mark.parametrize("case", CONVS, ids=lambda c: "x".join(str(v) for v in c[3:]))
def test_qlinear_conv_matches_the_reference(path: str, case: tuple[Any, ...]) -> None:
    inputs, attrs = _conv_inputs(case)
    want = _reference(Op.QLINEAR_CONV, inputs, attrs)
    for threads, prepack in ((1, False), (2, True)):
        got = _run(CPU, Op.QLINEAR_CONV, inputs, attrs, "int8", threads, prepack)
        np.testing.assert_array_equal(got, want)


def _direct_columns(monkeypatch: pytest.MonkeyPatch, columns: str) -> None:
    """Every direct convolution computes ``columns`` and splits over any threads asked."""
    monkeypatch.setattr(cpu_planner, "int8_conv_columns",
                        lambda width, channels, depth=0: columns)
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)


def _matches_the_reference(inputs: list[Any], attrs: dict[str, Any], threads: int = 3) -> None:
    """The int8 variant's output is the reference's on 1 to ``threads`` threads (packed
    weights on 2)."""
    want = _reference(Op.QLINEAR_CONV, inputs, attrs)
    for count, prepack in ((1, False), (2, True), (3, False))[:threads]:
        got = _run(CPU, Op.QLINEAR_CONV, inputs, attrs, "int8", count, prepack)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("columns", ["padded", "compact", "rows"])
@pytest.mark.parametrize("chunk_positions", [1, 60, 200])
@pytest.mark.parametrize("case", [(np.uint8, np.int8, False, 5, 8, 6, 7, 14, 3, 1, 1, 1, 1),
                                  (np.int8, np.int8, False, 5, 5, 9, 8, 7, 3, 2, 1, 1, 1),
                                  (np.uint8, np.int8, False, 3, 4, 5, 21, 9, 3, 1, 1, 1, 1),
                                  (np.uint8, np.int8, False, 5, 6, 3, 16, 11, 3, 1, 1, 1, 1),
                                  (np.int8, np.int8, False, 5, 5, 11, 13, 7, 3, 2, 1, 1, 1),
                                  (np.uint8, np.int8, False, 5, 8, 9, 10, 12, 1, 2, 0, 1, 1),
                                  (np.uint8, np.int8, False, 3, 5, 6, 7, 9, 1, 1, 0, 1, 1)],
                         ids=["stride-1", "stride-2", "rows-past-16", "rows-of-16",
                              "stride-2-rows-of-7", "1x1-stride-2", "1x1-stride-1"])
def test_direct_convolution_in_chunks_of_images(path: str, monkeypatch: pytest.MonkeyPatch,
                                                chunk_positions: int, columns: str,
                                                case: tuple[Any, ...]) -> None:
    """Images stacked a few at a time (one each, two or three with a partial last chunk,
    all five): blocks that span images, chunks split between threads (the same bits on
    1, 2 and 3); the columns every padded position, output pixels only (compact), or one
    output row per 16 or 8 (rows; output rows past 16 pixels decline to im2col)."""
    monkeypatch.setattr(cpu_planner, "INT8_DIRECT_CHUNK_POSITIONS", chunk_positions)
    _direct_columns(monkeypatch, columns)
    _matches_the_reference(*_conv_inputs(case))


@pytest.mark.parametrize("columns", ["padded", "compact", "rows"])
@pytest.mark.parametrize("chunk", [2, 3, 4])
def test_direct_convolution_chunks_the_planner_picks(path: str, monkeypatch: pytest.MonkeyPatch,
                                                     chunk: int, columns: str) -> None:
    """Chunks of the images the planner picks, the last one short (5 images in chunks of
    2, 3 or 4) or not: only the last chunk's own blocks are split, and the runs of blocks
    that 1, 2 and 3 threads take (some ending inside a chunk, which both threads then
    build) give the reference's bits."""
    monkeypatch.setattr(cpu_planner, "int8_direct_chunk", lambda batch, positions, parts: chunk)
    _direct_columns(monkeypatch, columns)
    for case in [(np.uint8, np.int8, False, 5, 8, 6, 7, 14, 3, 1, 1, 1, 1),
                 (np.int8, np.int8, False, 5, 5, 9, 8, 7, 3, 2, 1, 1, 1)]:
        _matches_the_reference(*_conv_inputs(case))


@pytest.mark.parametrize("columns", ["padded", "compact", "rows"])
def test_direct_convolution_to_int8(path: str, monkeypatch: pytest.MonkeyPatch,
                                    columns: str) -> None:
    """An int8 output (the tile's requantization packs to signed bytes), saturating at
    both ends, on each kind of columns: the reference's bits on 1 and 2 threads."""
    _direct_columns(monkeypatch, columns)
    for case in [(np.uint8, np.int8, False, 3, 8, 6, 16, 14, 3, 1, 1, 1, 1),
                 (np.int8, np.int8, False, 2, 5, 9, 8, 70, 3, 2, 1, 1, 1)]:
        inputs, attrs = _conv_inputs(case)
        inputs[6], inputs[7] = np.float32(0.15), np.array(-20, np.int8)
        want = _reference(Op.QLINEAR_CONV, inputs, attrs)
        assert want.dtype == np.int8 and want.min() == -128 and want.max() == 127
        _matches_the_reference(inputs, attrs, threads=2)


def test_the_direct_chunks_divide_a_threads_share() -> None:
    """Images per chunk: about INT8_DIRECT_CHUNK_POSITIONS positions' worth, the divisor
    of a thread's share nearest to that (the larger of two as near), else that count."""
    rule = cpu_planner.int8_direct_chunk
    assert rule(32, 225, 2) == 8          # 10 wanted; 8 divides 16 (not 10, 10, 10, 2)
    assert rule(32, 841, 2) == 4          # 3 wanted: 2 and 4 as near, the larger
    assert rule(32, 3249, 2) == 1
    assert rule(32, 64, 2) == 16          # at most a thread's share
    assert rule(32, 64, 1) == 32
    assert rule(32, 841, 1) == 3          # one thread: what the positions ask for
    assert rule(32, 841, 3) == 3          # share 11: no divisor within a factor of two
    assert rule(1, 100, 2) == 1


def test_the_plan_states_the_int8_split(path: str) -> None:
    cpu_planner.forget()
    types = (TensorType(DType.UINT8, (32, 128, 28, 28)), None, None,
             TensorType(DType.INT8, (256, 128, 3, 3)))
    attrs = get_schema(Op.QLINEAR_CONV).normalize_attrs({"strides": [2, 2], "pads": [1] * 4})
    plan = cpu_planner.plan(PlanRequest(Op.QLINEAR_CONV, types, attrs, threads=2), CPU)
    why = dict(plan.reasons)["threads"]
    assert "batch 32: 4 chunk(s) of 8" in why and "2 near-equal runs" in why


def test_the_stated_split_is_the_one_that_runs(path: str) -> None:
    """A small convolution runs on fewer threads than its plan's (each thread gets at least
    MIN_FLOPS_PER_THREAD): the plan states those threads and the chunk they stack, the
    ones the kernel's prepared call passes (not the chunk of the plan's two threads)."""
    cpu_planner.forget()
    case = (np.uint8, np.int8, False, 4, 8, 8, 8, 8, 3, 1, 1, 1, 1)
    inputs, attrs = _conv_inputs(case)
    attrs = get_schema(Op.QLINEAR_CONV).normalize_attrs(attrs)
    types = (TensorType(DType.UINT8, inputs[0].shape), None, None,
             TensorType(DType.INT8, inputs[3].shape))
    plan = cpu_planner.plan(PlanRequest(Op.QLINEAR_CONV, types, attrs, threads=2), CPU)
    why = dict(plan.reasons)["threads"]
    assert "1 of 2 thread(s) run it" in why and "batch 4: 1 chunk(s) of 4" in why
    assert cpu_planner.int8_direct_chunk(4, 81, 2) == 2          # what the plan's 2 would stack
    packed = native_qgemm.pack_conv(inputs[3], inputs[5])
    geo = packed.geometry(inputs[0].shape, attrs)
    y = np.empty((4, 8, 8, 8), np.uint8)
    native_qgemm.conv2d(inputs[0], 7, packed, geo, inputs[8], np.full(8, 0.01), 100, y, 2)
    (constants,) = packed.calls.values()
    assert (constants.count, constants.chunk) == (1, 4)


def test_a_shallow_convolution_computes_compact_columns_past_row_segments() -> None:
    """Columns of at most INT8_COMPACT_MAX_DEPTH bytes take compact columns at any width,
    with enough output channels, but for the row segments' 16 and 8; deeper ones keep the
    width and channel rule."""
    rule = cpu_planner.int8_conv_columns
    assert rule(28, 128, depth=64) == "compact"          # 1x1, 64 channels
    assert rule(112, 64, depth=7 * 7 * 4) == "compact"   # 7x7 over 3 channels
    assert rule(28, 6, depth=5 * 5 * 4) == "padded"      # too few output channels
    assert rule(32, 16, depth=3 * 3 * 16) == "padded"
    assert rule(16, 32, depth=64) == "rows"
    assert rule(28, 128, depth=3 * 3 * 64) == "padded"
    assert rule(28, 128) == "padded"
    assert rule(14, 128, depth=3 * 3 * 128) == "compact"


@pytest.mark.parametrize("adt,bdt,rows,k,n", [
    (np.uint8, np.int8, 5, 7, 3), (np.uint8, np.int8, 33, 300, 130),
    (np.int8, np.uint8, 2, 64, 64), (np.int8, np.int8, 7, 129, 65)])
def test_qlinear_matmul_matches_the_reference(path: str, adt: Any, bdt: Any, rows: int, k: int,
                                              n: int) -> None:
    inputs = [_q(adt, 2, rows, k), np.float32(0.05), np.array(3, adt), _q(bdt, k, n),
              _scales(n), (_q(bdt, n) // 16).astype(bdt), np.float32(0.7),
              np.array(-4, np.int8)]
    want = _reference(Op.QLINEAR_MATMUL, inputs, {})
    for threads, prepack in ((1, False), (2, True)):
        got = _run(CPU, Op.QLINEAR_MATMUL, inputs, {}, "int8", threads, prepack)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("trans_a,trans_b,bias,quantized", [
    (False, False, True, True), (True, True, False, True), (False, True, True, False)])
def test_qgemm_matches_the_reference(path: str, trans_a: bool, trans_b: bool, bias: bool,
                                     quantized: bool) -> None:
    m, k, n = 9, 70, 67
    a = _q(np.uint8, *((k, m) if trans_a else (m, k)))
    b = _q(np.int8, *((n, k) if trans_b else (k, n)))
    inputs: list[Any] = [a, np.float32(0.05), np.array(128, np.uint8), b, _scales(n),
                         np.zeros(n, np.int8),
                         RNG.integers(-9000, 9000, n).astype(np.int32) if bias else None]
    if quantized:
        inputs += [np.float32(0.3), np.array(-2, np.int8)]
    attrs = {"alpha": 0.5, "trans_a": trans_a, "trans_b": trans_b}
    want = _reference(Op.QGEMM, inputs, attrs)
    for variant, threads, prepack in (("default", 1, False), ("int8", 1, False),
                                      ("int8", 2, True)):
        got = _run(CPU, Op.QGEMM, inputs, attrs, variant, threads, prepack)
        assert got.dtype == want.dtype
        if quantized:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_qgemm_whose_b_zero_point_is_not_a_constant_is_not_run_on_a_pack_of_zeros(
        path: str) -> None:
    """B is a constant but its zero point an input: the prepack saw no zero point (packed
    as 0), so a run with another one must not use that pack."""
    m, k, n = 5, 40, 33
    inputs: list[Any] = [_q(np.uint8, m, k), np.float32(0.05), np.array(128, np.uint8),
                         _q(np.int8, k, n), _scales(n), np.array(3, np.int8), None,
                         np.float32(0.3), np.array(-2, np.int8)]
    attrs = get_schema(Op.QGEMM).normalize_attrs({"alpha": 1.0})
    want = _reference(Op.QGEMM, inputs, attrs)
    kv = CPU.get(Op.QGEMM, "int8")
    const = [a if i in (3, 4) else None for i, a in enumerate(inputs)]
    packed = kv.prepack(_ctx(1), const, attrs)
    assert isinstance(packed, native_qgemm.PackedMatmul)
    assert not packed.serves_zero_point(inputs[5])
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, 1, packed)
    np.testing.assert_array_equal(np.asarray(kv.fn(ctx, inputs, attrs, None)[0]), want)
    inputs[5] = np.array(0, np.int8)            # the packed zero point: the pack serves
    assert packed.serves_zero_point(inputs[5])
    np.testing.assert_array_equal(np.asarray(kv.fn(ctx, inputs, attrs, None)[0]),
                                  _reference(Op.QGEMM, inputs, attrs))


def test_unserved_cases_fall_back_to_the_numpy_kernel(path: str) -> None:
    """A 1-D convolution is outside the native kernel: the variant runs the default."""
    inputs = [_q(np.uint8, 1, 3, 10), np.float32(0.1), np.array(1, np.uint8),
              _q(np.int8, 4, 3, 3), _scales(4), np.zeros(4, np.int8), np.float32(0.3),
              np.array(5, np.uint8)]
    want = _reference(Op.QLINEAR_CONV, inputs, {})
    np.testing.assert_array_equal(_run(CPU, Op.QLINEAR_CONV, inputs, {}, "int8"), want)


def test_the_plan_names_the_instruction_path(path: str) -> None:
    cpu_planner.forget()
    types = (TensorType(DType.UINT8, (1, 3, 8, 8)), None, None,
             TensorType(DType.INT8, (4, 3, 3, 3)))
    request = PlanRequest(Op.QLINEAR_CONV, types, get_schema(Op.QLINEAR_CONV).normalize_attrs({}),
                          threads=1)
    plan = cpu_planner.plan(request, CPU)
    assert plan.variant == "int8"
    reason = plan.reason("variant")
    words = {"avx512-vnni": "AVX-512 VNNI", "avx-vnni": "AVX-VNNI", "portable": "portable C"}
    assert words[path] in reason


# ---- QLinearAdd: onnxruntime's com.microsoft QLinearAdd, bit for bit -------------------------
def _onnxruntime_qlinear_add(inputs: list[Any]) -> np.ndarray:
    """onnxruntime's QLinearAdd (its x86-64 kernel) of a and b with the given parameters."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle")
    from onnx import helper, numpy_helper

    names = ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"]
    params = {n: v for n, v in zip(names, inputs, strict=True) if n not in ("a", "b")}

    def info(name: str, v: np.ndarray) -> Any:
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype),
                                             v.shape)

    graph = helper.make_graph(
        [helper.make_node("QLinearAdd", names, ["y"], domain="com.microsoft")], "g",
        [info("a", inputs[0]), info("b", inputs[3])], [info("y", np.asarray(inputs[7]))],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in params.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                     helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"a": inputs[0], "b": inputs[3]})[0])


def _add_inputs(adt: Any, bdt: Any, ydt: Any, a_shape: tuple[int, ...],
                b_shape: tuple[int, ...], scales: tuple[float, float, float],
                seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)

    def q(dt: Any, shape: tuple[int, ...]) -> np.ndarray:
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max + 1, shape).astype(dt)

    sa, sb, sy = (np.float32(s) for s in scales)
    return [q(adt, a_shape), sa, q(adt, ()), q(bdt, b_shape), sb, q(bdt, ()), sy, q(ydt, ())]


# (a, b, y dtypes, shape, scales a, b, y): odd sizes leave vector tails; random zero points
# and uniform scales put sums near halves, where float32 forms round apart
ADDS = [
    (np.uint8, np.uint8, np.uint8, (3, 5, 7, 11), (0.021, 0.034, 0.047)),
    (np.int8, np.int8, np.int8, (2, 64, 33, 33), (0.013, 0.007, 0.011)),
    (np.uint8, np.uint8, np.uint8, (1, 17), (0.5, 0.25, 0.5)),
    (np.int8, np.int8, np.int8, (3, 80), (0.25, 0.5, 0.5)),          # 64 at a time, ties
]


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("case", ADDS, ids=lambda c: "x".join(str(d) for d in c[3]))
def test_qlinear_add_gives_onnxruntimes_bytes(path: str, case: tuple[Any, ...],
                                              relu: bool) -> None:
    """Every kernel gives onnxruntime's QLinearAdd bytes (a fused ReLU: clamped at y's zero
    point), for several random zero points per case."""
    adt, bdt, ydt, shape, scales = case
    attrs = {"activation": "relu" if relu else ""}
    for seed in range(3):
        inputs = _add_inputs(adt, bdt, ydt, shape, shape, scales, seed)
        want = _onnxruntime_qlinear_add(inputs)
        if relu:
            want = np.maximum(want, inputs[7])
        np.testing.assert_array_equal(_reference(Op.QLINEAR_ADD, inputs, attrs), want)
        for variant, threads in (("default", 1), ("int8", 1), ("int8", 2), ("int8", 3)):
            got = _run(CPU, Op.QLINEAR_ADD, inputs, attrs, variant, threads)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("types", [(np.int8, np.uint8, np.int8), (np.uint8, np.int8, np.uint8),
                                   (np.int8, np.int8, np.uint8), (np.uint8, np.uint8, np.int8)],
                         ids=["s8-u8-s8", "u8-s8-u8", "s8-s8-u8", "u8-u8-s8"])
def test_mixed_type_qlinear_add_matches_the_reference(path: str, types: tuple[Any, ...]) -> None:
    """Operands and result of two 8-bit types (keel's extension: onnxruntime's QLinearAdd
    takes one type): the native pass computes the reference's form on every thread count."""
    for seed in range(3):
        inputs = _add_inputs(*types, (2, 9, 33), (2, 9, 33), (0.013, 0.007, 0.011), seed)
        want = _reference(Op.QLINEAR_ADD, inputs, {"activation": ""})
        for threads in (1, 2, 3):
            np.testing.assert_array_equal(
                _run(CPU, Op.QLINEAR_ADD, inputs, {"activation": ""}, "int8", threads), want)


@pytest.mark.parametrize("scales", [(-0.02, 0.03, 0.04), (0.02, 0.03, 0.0), (0.02, 0.03, 1e-45)],
                         ids=["negative", "zero-y-scale", "denormal-y-scale"])
def test_qlinear_add_of_unusual_scales_gives_the_numpy_kernels_bits(
        path: str, scales: tuple[float, float, float]) -> None:
    """Native where the constants stay finite, the NumPy kernel where they do not: the
    same form either way, so the same bits."""
    inputs = _add_inputs(np.uint8, np.uint8, np.uint8, (3, 70), (3, 70), scales, 5)
    with np.errstate(all="ignore"):
        want = _run(CPU, Op.QLINEAR_ADD, inputs, {"activation": ""}, "default")
        for threads in (1, 2):
            np.testing.assert_array_equal(
                _run(CPU, Op.QLINEAR_ADD, inputs, {"activation": ""}, "int8", threads), want)


@pytest.mark.parametrize("shapes", [((2, 3, 4, 5), (3, 1, 1)), ((1,), (4, 33)), ((4, 33), (1,)),
                                    ((2, 3, 1), (2, 3, 9))],
                         ids=["per-channel-b", "scalar-a", "scalar-b", "row-constant-a"])
def test_qlinear_add_broadcasting_runs_numpy_with_onnxruntimes_bytes(
        path: str, shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    for seed in range(4):
        inputs = _add_inputs(np.uint8, np.uint8, np.uint8, *shapes, (0.02, 0.03, 0.04), seed)
        want = _onnxruntime_qlinear_add(inputs)
        np.testing.assert_array_equal(_reference(Op.QLINEAR_ADD, inputs, {"activation": ""}),
                                      want)
        np.testing.assert_array_equal(
            _run(CPU, Op.QLINEAR_ADD, inputs, {"activation": ""}, "int8", 2), want)


# ---- QuantizeLinear of float32 ---------------------------------------------------------------
@pytest.mark.parametrize("zp", [np.array(7, np.uint8), np.array(-3, np.int8), None],
                         ids=["uint8", "int8", "no-zero-point"])
def test_quantize_linear_matches_the_reference(path: str, zp: Any) -> None:
    x = RNG.uniform(-9, 9, (4, 67, 411)).astype(np.float32)    # three runs of 32,768+
    flat = x.reshape(-1)
    # ties at scale 0.5, quotients past int32, and ties at the clamps of every 8-bit range
    # (x / 0.5 = y - zp + 0.5 or - 0.5 at y = 0, 255, -128, 127), spread over the lanes of
    # the 64-value blocks and the runs' partial tails
    special = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 3e9, -3e9, 0.25, 0.75, -0.25,
                        -1.25, -1.75, 124.25, 124.75, -64.25, -63.75, -62.25, 65.25, 60.75,
                        63.75, 64.25, -0.0], np.float32)
    where = np.concatenate([np.arange(22), RNG.choice(flat.size, 400, replace=False),
                            flat.size - 1 - np.arange(22)])
    flat[where] = np.resize(special, where.size)
    inputs = [x, np.float32(0.5), zp] if zp is not None else [x, np.float32(0.5)]
    attrs = get_schema(Op.QUANTIZE_LINEAR).normalize_attrs({})
    want = _run(REFERENCE, Op.QUANTIZE_LINEAR, inputs, attrs, "default")
    for threads in (1, 2, 3):
        got = _run(CPU, Op.QUANTIZE_LINEAR, inputs, attrs, "int8", threads)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


# ---- DequantizeLinear to float32 -------------------------------------------------------------
@pytest.mark.parametrize("dt, zp", [(np.uint8, np.array(131, np.uint8)),
                                    (np.int8, np.array(-5, np.int8)), (np.uint8, None)],
                         ids=["uint8", "int8", "no-zero-point"])
def test_dequantize_linear_matches_the_reference(path: str, dt: Any, zp: Any) -> None:
    x = _q(dt, 4, 67, 411)                                    # three runs of 32,768+, tails
    inputs = [x, np.float32(0.0371), zp] if zp is not None else [x, np.float32(0.0371)]
    attrs = get_schema(Op.DEQUANTIZE_LINEAR).normalize_attrs({})
    want = _run(REFERENCE, Op.DEQUANTIZE_LINEAR, inputs, attrs, "default")
    for threads in (1, 2, 3):
        got = _run(CPU, Op.DEQUANTIZE_LINEAR, inputs, attrs, "int8", threads)
        assert got.dtype == want.dtype == np.float32
        np.testing.assert_array_equal(got, want)


# ---- MaxPool on the integers -----------------------------------------------------------------
# (dtype, N, C, H, W, kernel, stride, pads [top, left, bottom, right], dilation, ceil_mode)
POOLS = [
    (np.uint8, 2, 3, 112, 112, 3, 2, [1, 1, 1, 1], 1, 0),     # ResNet-18's stem pool
    (np.int8, 2, 3, 112, 112, 3, 2, [1, 1, 1, 1], 1, 0),
    (np.uint8, 1, 4, 9, 70, 2, 2, [0, 0, 0, 0], 1, 1),        # odd side, ceil mode
    (np.int8, 3, 2, 13, 75, 3, 1, [1, 2, 0, 1], 1, 0),        # stride 1, uneven padding
    (np.uint8, 1, 2, 11, 8, 2, 1, [0, 0, 0, 0], 2, 0),        # dilated
    (np.int8, 2, 2, 5, 5, 3, 3, [2, 2, 2, 2], 1, 0),          # stride 3, padding 2
]


@pytest.mark.parametrize("case", POOLS, ids=lambda c: "x".join(str(v) for v in c[1:7]))
def test_integer_max_pool_matches_the_reference(path: str, case: tuple[Any, ...]) -> None:
    dt, n, c, h, w, k, s, pads, d, ceil = case
    x = _q(dt, n, c, h, w)
    x[0, 0, :3] = np.iinfo(dt).min                  # windows whose largest value is the lowest
    attrs = get_schema(Op.MAX_POOL).normalize_attrs(
        {"kernel_shape": [k, k], "strides": [s, s], "pads": pads, "dilations": [d, d],
         "ceil_mode": ceil})
    want = np.asarray(REFERENCE.get(Op.MAX_POOL, "default").fn(_ctx(), [x], attrs, None)[0])
    for threads in (1, 2, 3):
        got = np.full(want.shape, 77, dt)
        out = CPU.get(Op.MAX_POOL, "int8").fn(_ctx(threads), [x], attrs, [got])
        assert out[0] is got
        np.testing.assert_array_equal(got, want)


def test_integer_max_pool_with_indices_runs_the_numpy_kernel(path: str) -> None:
    x = _q(np.uint8, 1, 2, 6, 6)
    attrs = get_schema(Op.MAX_POOL).normalize_attrs({"kernel_shape": [2, 2], "strides": [2, 2]})
    y, idx = CPU.get(Op.MAX_POOL, "int8").fn(_ctx(), [x], attrs, None)
    want = REFERENCE.get(Op.MAX_POOL, "default").fn(_ctx(), [x], attrs, None)
    np.testing.assert_array_equal(y, want[0])
    np.testing.assert_array_equal(idx, want[1])


def test_the_plan_runs_an_integer_max_pool_on_the_int8_variant(path: str) -> None:
    cpu_planner.forget()
    for dtype, variant in ((DType.UINT8, "int8"), (DType.INT8, "int8"), (DType.FLOAT32, "native")):
        request = PlanRequest(Op.MAX_POOL, (TensorType(dtype, (32, 64, 112, 112)),),
                              get_schema(Op.MAX_POOL).normalize_attrs({"kernel_shape": [3, 3]}),
                              threads=1)
        assert cpu_planner.plan(request, CPU).variant == variant


def test_a_packed_convolution_resolves_each_call_geometry(path: str) -> None:
    """The geometry kept per (input shape, attrs) is conv_geometry's for that call: other
    attributes or another input shape resolve again."""
    from keel.ops.schemas.quantization import conv_geometry

    packed = native_qgemm.pack_conv(_q(np.int8, 4, 3, 3, 3), np.zeros(4, np.int8))
    schema = get_schema(Op.QLINEAR_CONV)
    attrs = [schema.normalize_attrs({"pads": [1] * 4}), schema.normalize_attrs({"strides": [2, 2]})]
    for shape in ((1, 3, 8, 8), (2, 3, 9, 5), (1, 3, 8, 8)):
        for a in attrs:
            assert packed.geometry(shape, a) == conv_geometry(shape, packed.shape, a)


# ---- requantization: onnxruntime's float32 product ------------------------------------------

NEAR_TIE_ACC = 255 * 127


def _near_tie_multipliers() -> np.ndarray:
    """float32 multipliers m for which float32(NEAR_TIE_ACC) * m rounds to another integer
    than the exact (double) product does: the products fall within a float32 ulp of a half."""
    found = []
    for k in range(64):
        m = np.float32((k + 0.5) / NEAR_TIE_ACC)
        for _ in range(3):
            exact = np.rint(NEAR_TIE_ACC * np.float64(m))
            if exact != np.rint(np.float32(NEAR_TIE_ACC) * m):
                found.append(m)
            m = np.nextafter(m, np.float32(1), dtype=np.float32)
    return np.asarray(found, np.float32)


def _onnxruntime(op_type: str, inputs: list[Any], **attrs: Any) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle")
    from onnx import TensorProto, helper, numpy_helper

    names = [f"in{i}" for i in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(op_type, names, ["y"], **attrs)], "g",
        [helper.make_tensor_value_info(names[0], helper.np_dtype_to_tensor_dtype(inputs[0].dtype),
                                       inputs[0].shape)],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in zip(names[1:], inputs[1:],
                                                                   strict=True)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {names[0]: inputs[0]})[0])


def _near_tie_cases() -> list[tuple[Op, str, list[Any], dict[str, Any]]]:
    mult = _near_tie_multipliers()
    m = mult.size
    one, u0, i0 = np.float32(1.0), np.array(0, np.uint8), np.zeros(m, np.int8)
    depthwise_w = RNG.integers(-127, 128, (m, 1, 3, 3)).astype(np.int8)
    depthwise_w[:, :, 1, 1] = 127
    depthwise_x = np.zeros((1, m, 3, 3), np.uint8)
    depthwise_x[:, :, 1, 1] = 255
    return [
        (Op.QLINEAR_MATMUL, "QLinearMatMul",
         [np.full((3, 1), 255, np.uint8), one, u0, np.full((1, m), 127, np.int8), mult, i0,
          one, u0], {}),
        (Op.QLINEAR_CONV, "QLinearConv",
         [np.full((2, 1, 4, 5), 255, np.uint8), one, u0, np.full((m, 1, 1, 1), 127, np.int8),
          mult, i0, one, u0], {}),
        (Op.QLINEAR_CONV, "QLinearConv",
         [depthwise_x, one, u0, depthwise_w, mult, i0, one, u0],
         {"group": m, "pads": [1, 1, 1, 1]}),
    ]


def test_onnxruntime_requantizes_in_float32() -> None:
    """The oracle of the test below: onnxruntime's bytes are the float32 product's, which
    differ from the exact product's on every one of these multipliers."""
    mult = _near_tie_multipliers()
    assert mult.size >= 8
    _, op_type, inputs, attrs = _near_tie_cases()[0]
    want = _onnxruntime(op_type, inputs, **attrs)[0]
    np.testing.assert_array_equal(want, np.rint(np.float32(NEAR_TIE_ACC) * mult))
    assert (want != np.rint(np.float64(NEAR_TIE_ACC) * mult.astype(np.float64))).all()


@pytest.mark.parametrize("case", [0, 1, 2], ids=["matmul", "conv-1x1", "depthwise"])
def test_requantization_is_onnxruntimes_float32_product(path: str, case: int) -> None:
    """Accumulators of NEAR_TIE_ACC times multipliers where float32 and exact products
    round apart: the native kernels, the NumPy kernels and the reference all give
    onnxruntime's bytes."""
    op, op_type, inputs, attrs = _near_tie_cases()[case]
    want = _onnxruntime(op_type, inputs, **attrs)
    for got in (_reference(op, inputs, attrs), _run(CPU, op, inputs, attrs, "default"),
                _run(CPU, op, inputs, attrs, "int8"),
                _run(CPU, op, inputs, attrs, "int8", 2, True)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("library", "function", "names"), [
    ("qgemm", "keel_qgemm_geometry", "INT8_QGEMM_SIZES"),
    ("qlayout", "keel_qlayout_geometry", "INT8_QLAYOUT_SIZES")])
def test_the_planners_int8_sizes_are_the_compiled_kernels(
        library: str, function: str, names: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's splits count tasks in the C kernels' sizes: the load checks each
    against what the library reports, and one that differs fails it."""
    lib = native.library(library)
    if lib is None:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    native_qgemm.check_sizes(lib, function, getattr(cpu_planner, names))
    name = getattr(cpu_planner, names)[-1]
    monkeypatch.setattr(cpu_planner, name, getattr(cpu_planner, name) + 1)
    with pytest.raises(KeelError, match=f"{name}.*change both sides") as failed:
        native_qgemm.check_sizes(lib, function, getattr(cpu_planner, names))
    assert isinstance(failed.value, native_qgemm.Int8SizesError)


def test_the_int8_arrays_follow_the_compiled_enum_orders(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """native_qgemm builds its kind, column, quant, geometry and QLinearAdd values in
    qgemm.c's enum orders: the load checks them against keel_qgemm_layout, and one that
    differs fails it."""
    lib = native.library("qgemm")
    if lib is None:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    native_qgemm.check_layout(lib)
    swapped = ("n", "c", "h", "w", "m", "oh", "ow", "kh", "kw", "sh", "sw", "pt", "pl", "dh",
               "dw", "g")
    monkeypatch.setattr(native_qgemm, "_CONV_GEOMETRY", swapped)
    with pytest.raises(native_qgemm.Int8SizesError, match=r"keel_qgemm_layout.*change both"):
        native_qgemm.check_layout(lib)
    monkeypatch.undo()
    monkeypatch.setattr(native_qgemm, "_COLUMNS", {"padded": 0, "rows": 1, "compact": 2})
    with pytest.raises(native_qgemm.Int8SizesError, match=r"keel_qgemm_layout.*change both"):
        native_qgemm.check_layout(lib)
    for name, swapped in (("_ADD", ("rb", "ra", "c")), ("_ADD_BOUND", ("hi", "lo"))):
        monkeypatch.undo()          # QLinearAdd's constants and bounds, by name too
        monkeypatch.setattr(native_qgemm, name, swapped)
        with pytest.raises(native_qgemm.Int8SizesError,
                           match=r"keel_qgemm_layout.*ADD_.*change both"):
            native_qgemm.check_layout(lib)
    monkeypatch.undo()              # and keel_qadd_u8's flags, by name
    monkeypatch.setattr(native_qgemm, "AddFlag",
                        enum.IntFlag("AddFlag", {"A_S8": 2, "B_S8": 1, "Y_S8": 4}))
    with pytest.raises(native_qgemm.Int8SizesError,
                       match=r"keel_qgemm_layout.*ADD_FLAG_.*change both"):
        native_qgemm.check_layout(lib)


@pytest.mark.parametrize(("name", "swapped"), [
    ("_CONV_GEOMETRY", ("n", "c", "h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "pt", "pl",
                        "dh", "dw")),
    ("_POOL_GEOMETRY", ("n", "c", "h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "dh", "dw",
                        "pt", "pl")),
    ("_QUANT", ("lo", "yzp", "hi")), ("_GAP", ("yzp", "xzp", "lo", "hi"))])
def test_the_channels_last_arrays_follow_qlayouts_enum_orders(
        name: str, swapped: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """qlayout builds its geometry, max pool, quant and global pool arrays in qlayout.c's
    enum orders: the load checks them against keel_qlayout_layout, and an order that
    differs fails it with a typed error."""
    from keel.backends.cpu import qlayout

    lib = native.library("qlayout")
    if lib is None:
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    native_qgemm.check_enums(lib, "keel_qlayout_layout", qlayout._layout(), "qlayout")
    monkeypatch.setattr(qlayout, name, swapped)
    with pytest.raises(native_qgemm.Int8SizesError,
                       match=r"keel_qlayout_layout reports .*qlayout builds .*change both"):
        native_qgemm.check_enums(lib, "keel_qlayout_layout", qlayout._layout(), "qlayout")


def test_the_int8_max_pool_geometry_is_built_by_name() -> None:
    """The int8 max pool's sizes are named once (PoolGeometry) and laid out in each
    kernel's checked order: qgemm.c's P_* and qlayout.c's M_* hold each size where its
    name says."""
    from keel.backends.cpu import qlayout

    sizes = dict(zip(native_qgemm._POOL_GEOMETRY, range(1, 15), strict=True))
    geometry = native_qgemm.PoolGeometry(**sizes)
    for order in (native_qgemm._POOL_GEOMETRY, qlayout._POOL_GEOMETRY, tuple(sorted(sizes))):
        assert geometry.array(order).tolist() == [sizes[name] for name in order]


@pytest.mark.parametrize(("rows", "parts"), [(4, 1), (64, 2)])
def test_a_qgemm_plan_states_the_split_its_product_runs(path: str, rows: int,
                                                         parts: int) -> None:
    """The plan's threads reason names the parts qgemm.c's product runs on (a small one on
    fewer threads than the plan's: each thread gets at least MIN_FLOPS_PER_THREAD), and the
    packed product's call passes those parts."""
    cpu_planner.forget()
    a, b = _q(np.uint8, rows, 100), _q(np.int8, 100, 120)
    f32, scalar = TensorType(DType.FLOAT32, ()), TensorType(DType.UINT8, ())
    types = (TensorType(DType.UINT8, a.shape), f32, scalar, TensorType(DType.INT8, b.shape), f32,
             TensorType(DType.INT8, ()))
    attrs = get_schema(Op.QGEMM).normalize_attrs({})
    plan = cpu_planner.plan(PlanRequest(Op.QGEMM, types, attrs, threads=2), CPU)
    assert plan.variant == "int8"
    assert f"int8 product: {parts} of 2 thread(s) run it" in plan.reason("threads")
    packed = native_qgemm.pack_matmul(b, np.zeros((), np.int8))
    y = np.empty((rows, 120), np.uint8)
    native_qgemm.matmul(a, 3, packed, None, np.full(120, 0.001), DType.UINT8, 5, y, 2)
    (constants,) = packed.calls.values()
    assert constants.count == parts


@pytest.mark.parametrize(("shape", "parts"), [((1, 8, 16, 16), 1), ((4, 32, 28, 28), 2)])
def test_a_qlinear_add_plan_states_the_parts_its_pass_runs(path: str, shape: tuple[int, ...],
                                                          parts: int) -> None:
    cpu_planner.forget()
    u8, f32 = TensorType(DType.UINT8, shape), TensorType(DType.FLOAT32, ())
    zp = TensorType(DType.UINT8, ())
    types = (u8, f32, zp, u8, f32, zp, f32, zp)
    attrs = get_schema(Op.QLINEAR_ADD).normalize_attrs({})
    plan = cpu_planner.plan(PlanRequest(Op.QLINEAR_ADD, types, attrs, threads=2), CPU)
    assert plan.variant == "int8"
    assert f"on {parts} of 2 thread(s)" in plan.reason("threads")
    assert cpu_planner.int8_pass_parts(int(np.prod(shape)), 2) == parts
