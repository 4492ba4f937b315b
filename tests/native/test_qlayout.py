"""Channels-last int8 convolutions (qlayout.c, keel.backends.cpu.qlayout) against the
reference kernels, bit for bit: every layout pair a plan can name, on the AVX-512 and the
portable C paths, at one and two threads."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

from keel import native
from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu import qlayout
from keel.backends.cpu.kernels import load as load_cpu
from keel.backends.plan import NodePlan
from keel.backends.reference.kernels import load as load_reference
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from tests.native.test_qgemm import caches, path  # noqa: F401  (the fixtures)

CPU = load_cpu()
REFERENCE = load_reference()
RNG = np.random.default_rng(17)

# the int8 kernels built for each instruction path (test_qgemm's fixture): qlayout.c
# takes its AVX-512 path where the build has AVX-512 VNNI, else its portable C
LAYOUTS = ["nchw->nhwc", "nhwc->nhwc", "nhwc->nchw"]


@pytest.fixture
def layout_path(path: str) -> int:  # noqa: F811  (test_qgemm's fixture)
    if not qlayout.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    fns = qlayout._load()
    isa = 2 if path.startswith("avx512") else 0
    assert fns is not None and fns.isa == isa
    return isa


def _q(dtype: Any, *shape: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def _stored(a: np.ndarray, layout: str) -> np.ndarray:
    """``a`` (N, C, H, W) as a value of that graph shape holds it in ``layout``."""
    return a if layout == "nchw" else np.ascontiguousarray(a.transpose(0, 2, 3, 1)).reshape(
        a.shape)


def _read(a: np.ndarray, layout: str) -> np.ndarray:
    n, c, h, w = a.shape
    return a if layout == "nchw" else a.reshape(n, h, w, c).transpose(0, 3, 1, 2)


# (x dtype, w dtype, weight zero points, N, C, H, W, M, k, stride, pad, dilation, group)
CONVS = [
    (np.uint8, np.int8, False, 2, 40, 9, 9, 24, 1, 1, 0, 1, 1),        # pointwise
    (np.int8, np.uint8, True, 1, 6, 5, 7, 70, 1, 1, 0, 1, 1),          # weight zero points
    (np.int8, np.int8, False, 1, 6, 5, 7, 70, 1, 1, 0, 1, 1),          # C, M, pixels past tiles
    (np.uint8, np.int8, False, 3, 64, 4, 4, 32, 1, 1, 0, 1, 1),        # whole tiles
    (np.uint8, np.int8, False, 1, 760, 3, 5, 720, 1, 1, 0, 1, 1),      # large: matrix product
    (np.uint8, np.int8, False, 2, 20, 6, 7, 8, 1, 1, 0, 1, 1),         # 8 channels: one half
    (np.int8, np.int8, False, 1, 36, 5, 8, 16, 1, 1, 0, 1, 1),         # 16, int8 out
    (np.uint8, np.int8, False, 2, 24, 5, 5, 48, 1, 1, 0, 1, 1),        # 32 + 16 channels
    (np.uint8, np.int8, False, 2, 96, 12, 12, 96, 3, 2, 1, 1, 96),     # depthwise, stride 2
    (np.uint8, np.int8, True, 1, 40, 7, 9, 40, 3, 1, 1, 1, 40),        # 32 channels + 8
    (np.int8, np.int8, True, 2, 5, 11, 10, 5, 5, 1, 2, 2, 5),          # 5x5, dilated
    (np.uint8, np.uint8, False, 1, 3, 13, 13, 16, 3, 2, 1, 1, 1),      # other: NCHW kernel
    (np.uint8, np.int8, False, 1, 8, 6, 6, 8, 1, 2, 0, 1, 1),          # 1x1 stride 2: dense
    (np.uint8, np.int8, False, 2, 16, 9, 9, 40, 3, 1, 1, 1, 1),        # dense 3x3: 32 + 8
    (np.int8, np.int8, False, 1, 64, 7, 7, 64, 3, 1, 1, 1, 1),         # dense, int8 x
    (np.uint8, np.int8, False, 3, 32, 8, 8, 72, 3, 2, 1, 1, 1),        # dense 3x3 stride 2
    (np.uint8, np.int8, False, 1, 12, 11, 11, 16, 7, 2, 3, 1, 1),      # dense 7x7: 16 channels
    (np.int8, np.int8, False, 2, 20, 10, 9, 24, 3, 1, 2, 2, 1),        # dense, dilated
    (np.uint8, np.uint8, True, 1, 8, 6, 6, 40, 3, 1, 1, 1, 1),         # dense, w zero points
    (np.uint8, np.int8, False, 2, 128, 5, 5, 96, 1, 2, 0, 1, 1),       # 1x1 stride 2, wide
]


def _inputs(case: tuple[Any, ...]) -> tuple[list[Any], dict[str, Any]]:
    xdt, wdt, wzero, n, c, h, w, m, k, s, p, d, g = case
    x, wt = _q(xdt, n, c, h, w), _q(wdt, m, c // g, k, k)
    w_zp = (_q(wdt, m) // 8).astype(wdt) if wzero else np.zeros(m, wdt)
    inputs = [x, np.float32(0.05), np.array(7 if xdt is np.uint8 else -3, xdt), wt,
              RNG.uniform(0.002, 0.02, m).astype(np.float32), w_zp, np.float32(0.4),
              np.array(100, np.uint8) if xdt is np.uint8 else np.array(-20, np.int8),
              RNG.integers(-5000, 5000, m).astype(np.int32)]
    attrs = {"strides": [s, s], "pads": [p] * 4, "dilations": [d, d], "group": g}
    return inputs, get_schema(Op.QLINEAR_CONV).normalize_attrs(attrs)


def _run(inputs: list[Any], attrs: dict[str, Any], layout: str, threads: int,
         prepack: bool) -> np.ndarray:
    kv = CPU.get(Op.QLINEAR_CONV, "int8")
    plan = NodePlan(variant="int8", layout=layout, threads=threads)
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, threads, plan=plan)
    if prepack and kv.prepack is not None:
        const = [a if i in (3, 4, 5) else None for i, a in enumerate(inputs)]
        ctx = dataclasses.replace(ctx, prepacked=kv.prepack(ctx, const, attrs))
    return np.asarray(kv.fn(ctx, inputs, attrs, None)[0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CONVS, ids=lambda c: "x".join(str(v) for v in c[3:]))
def test_channels_last_conv_matches_the_reference(layout_path: int, case: tuple[Any, ...],
                                                  layout: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    inputs, attrs = _inputs(case)
    want = REFERENCE.get(Op.QLINEAR_CONV, "default").fn(
        KernelContext(np, "reference", DeviceKind.CPU), inputs, attrs, None)[0]
    src, dst = layout.split("->")
    kind = qlayout.conv_kind(inputs[3].shape, attrs)
    if layout == "nhwc->nhwc" and kind != "other" and not (kind == "dense" and case[2]):
        # served channels-last: no layout change at all (the NCHW fallback would make one;
        # dense weights with zero points take it)
        monkeypatch.setattr(qlayout, "_transpose", _no_layout_change)
    stored = [_stored(inputs[0], src), *inputs[1:]]
    for threads, prepack in ((1, False), (2, True), (3, True)):
        got = _run(stored, attrs, layout, threads, prepack)
        assert got.shape == want.shape
        np.testing.assert_array_equal(_read(got, dst), want)


DEPTHWISE = [case for case in CONVS if case[-1] > 1] + [
    (np.uint8, np.int8, False, 2, 70, 30, 30, 70, 3, 1, 1, 1, 70),    # a 30x30 plane
]


@pytest.mark.parametrize("y_scale", [0.4, 1e-9], ids=["", "saturating"])
@pytest.mark.parametrize("plane_max", [0, 1 << 30], ids=["rows", "planes"])
@pytest.mark.parametrize("case", DEPTHWISE, ids=lambda c: "x".join(str(v) for v in c[3:]))
def test_depthwise_split_by_rows_or_planes(layout_path: int, case: tuple[Any, ...],
                                           plane_max: int, y_scale: float,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The depthwise kernel's two splits of the work, by output rows and by (image,
    channel block) planes, each against the reference; with a tiny output scale the
    scaled sums pass the int32 range both ways and every result saturates."""
    from keel.backends.cpu import planner

    monkeypatch.setattr(planner, "INT8_DEPTHWISE_PLANE_MAX_BYTES", plane_max)
    inputs, attrs = _inputs(case)
    inputs[6] = np.float32(y_scale)
    want = REFERENCE.get(Op.QLINEAR_CONV, "default").fn(
        KernelContext(np, "reference", DeviceKind.CPU), inputs, attrs, None)[0]
    monkeypatch.setattr(qlayout, "_transpose", _no_layout_change)
    stored = [_stored(inputs[0], "nhwc"), *inputs[1:]]
    for threads in (1, 2):
        got = _run(stored, attrs, "nhwc->nhwc", threads, True)
        np.testing.assert_array_equal(_read(got, "nhwc"), want)


@pytest.mark.parametrize("case", [CONVS[0], CONVS[9]], ids=["pointwise", "depthwise"])
def test_operands_derived_once_follow_their_values(layout_path: int,
                                                   case: tuple[Any, ...]) -> None:
    """A node's operands are derived once and reused run after run: a run whose scales,
    bias or batch differ from the last one's (a new value, or the same array changed in
    place) still gets the reference's result."""
    inputs, attrs = _inputs(case)
    inputs[6] = np.array(0.4, np.float32)
    kv = CPU.get(Op.QLINEAR_CONV, "int8")
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, 2,
                        plan=NodePlan(variant="int8", layout="nhwc->nhwc", threads=2))
    assert kv.prepack is not None
    ctx = dataclasses.replace(ctx, prepacked=kv.prepack(
        ctx, [a if i in (3, 4, 5) else None for i, a in enumerate(inputs)], attrs))
    reference = REFERENCE.get(Op.QLINEAR_CONV, "default").fn

    def check() -> None:
        want = reference(KernelContext(np, "reference", DeviceKind.CPU), inputs, attrs, None)[0]
        got = kv.fn(ctx, [_stored(inputs[0], "nhwc"), *inputs[1:]], attrs, None)[0]
        np.testing.assert_array_equal(_read(np.asarray(got), "nhwc"), want)

    check()
    check()                                     # the same operands: reused
    inputs[6][...] = np.float32(0.1)            # y scale changed in place
    check()
    inputs[8] = inputs[8] // 3                  # a new bias
    check()
    inputs[0] = np.concatenate([inputs[0], inputs[0][:1] // 2])   # another batch
    check()


def _no_layout_change(*args: Any) -> None:
    raise AssertionError("a channels-last chain node changed layouts")


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 70, 33, 3), (3, 1, 1, 1), (2, 49, 7, 7),
                                   (1, 20, 6, 6)])
def test_layout_changes_round_trip(layout_path: int, shape: tuple[int, ...]) -> None:
    x = _q(np.uint8, *shape)
    cl = qlayout.to_nhwc(x, threads=2)
    np.testing.assert_array_equal(cl, x.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(qlayout.to_nchw(cl, threads=2), x)


# (x dtype, N, C, H, W, x scale, y scale): 7x7 planes (MobileNetV2's), channels past a
# 256-channel task, a plane wider than a vector, and a multiplier that saturates
POOLS = [(np.uint8, 3, 40, 7, 7, 0.02, 0.013), (np.int8, 2, 300, 5, 3, 0.5, 0.03),
         (np.uint8, 1, 5, 17, 19, 0.001, 0.0007), (np.int8, 4, 33, 2, 2, 0.9, 0.001)]


@pytest.mark.parametrize("layout", ["nchw->nchw", "nhwc->nchw"])
@pytest.mark.parametrize("case", POOLS, ids=lambda c: "x".join(str(v) for v in c[1:5]))
def test_global_average_pool_matches_the_reference(layout_path: int, case: tuple[Any, ...],
                                                   layout: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The integer global average pool reading NCHW or a chain's channels-last bytes
    (served in place: no layout change), at 1, 2 and 3 threads, gives the reference's
    bytes (onnxruntime's arithmetic; tests/graph/test_qlinear_global_avg_pool.py compares
    with onnxruntime itself)."""
    dtype, n, c, h, w, x_scale, y_scale = case
    x = _q(dtype, n, c, h, w)
    zp = np.array(9 if dtype is np.uint8 else -4, dtype)
    inputs = [x, np.float32(x_scale), zp, np.float32(y_scale), np.array(120, dtype) // 2]
    want = REFERENCE.get(Op.QLINEAR_GLOBAL_AVG_POOL, "default").fn(
        KernelContext(np, "reference", DeviceKind.CPU), inputs, {}, None)[0]
    assert want.shape == (n, c, 1, 1)
    monkeypatch.setattr(qlayout, "_transpose", _no_layout_change)
    kv = CPU.get(Op.QLINEAR_GLOBAL_AVG_POOL, "int8")
    for threads in (1, 2, 3):
        plan = NodePlan(variant="int8", layout=layout, threads=threads)
        ctx = KernelContext(np, "cpu", DeviceKind.CPU, threads, plan=plan)
        stored = [_stored(x, layout.split("->")[0]), *inputs[1:]]
        got = np.asarray(kv.fn(ctx, stored, {}, None)[0])
        np.testing.assert_array_equal(got, want)


# (x dtype, N, C, H, W, kernel, stride, pad, dilation): ResNet-18's 3x3 stride-2 pool,
# channels past a 64-byte vector, a window in the padding on both sides, a dilated one
MAX_POOLS = [(np.uint8, 2, 64, 11, 12, 3, 2, 1, 1), (np.int8, 1, 70, 6, 5, 3, 1, 1, 1),
             (np.uint8, 3, 5, 9, 9, 2, 2, 0, 1), (np.int8, 2, 130, 7, 7, 3, 2, 2, 2)]


@pytest.mark.parametrize("layout", [*LAYOUTS, "nchw->nchw"])
@pytest.mark.parametrize("case", MAX_POOLS, ids=lambda c: "x".join(str(v) for v in c[1:]))
def test_max_pool_in_either_layout_matches_the_reference(layout_path: int,
                                                         case: tuple[Any, ...], layout: str,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The 8-bit MaxPool between any two layouts gives the reference's bytes at 1, 2 and 3
    threads; inside a chain (nhwc->nhwc) with no layout change."""
    dtype, n, c, h, w, k, s, p, d = case
    x = _q(dtype, n, c, h, w)
    attrs = get_schema(Op.MAX_POOL).normalize_attrs(
        {"kernel_shape": [k, k], "strides": [s, s], "pads": [p] * 4, "dilations": [d, d]})
    want = REFERENCE.get(Op.MAX_POOL, "default").fn(
        KernelContext(np, "reference", DeviceKind.CPU), [x], attrs, None)[0]
    src, dst = layout.split("->")
    if layout == "nhwc->nhwc":
        monkeypatch.setattr(qlayout, "_transpose", _no_layout_change)
    kv = CPU.get(Op.MAX_POOL, "int8")
    for threads in (1, 2, 3):
        plan = NodePlan(variant="int8", layout=layout, threads=threads)
        ctx = KernelContext(np, "cpu", DeviceKind.CPU, threads, plan=plan)
        got = np.asarray(kv.fn(ctx, [_stored(x, src)], attrs, [np.empty_like(want)])[0])
        np.testing.assert_array_equal(_read(got, dst), want)


@pytest.mark.parametrize("case", [
    (np.uint8, np.int8, False, 1, 16, 6, 6, 32, 3, 1, 1, 1, 1),       # dense, small: 1 thread
    (np.uint8, np.int8, False, 4, 64, 14, 14, 64, 3, 1, 1, 1, 1),     # dense: 2 threads
    (np.uint8, np.int8, False, 4, 64, 14, 14, 64, 1, 1, 0, 1, 1),     # 1x1 panels
    (np.uint8, np.int8, False, 2, 64, 14, 14, 64, 3, 1, 1, 1, 64),    # depthwise
], ids=["dense-small", "dense", "pointwise", "depthwise"])
def test_the_stated_split_is_the_one_that_runs(layout_path: int, case: tuple[Any, ...]) -> None:
    """The chain's layout reason states the threads the channels-last kernel runs on (the
    planner's choice), and the prepared call passes that count."""
    inputs, attrs = _inputs(case)
    stored = [_stored(inputs[0], "nhwc"), *inputs[1:]]
    kv = CPU.get(Op.QLINEAR_CONV, "int8")
    assert kv.prepack is not None
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, 2,
                        plan=NodePlan(variant="int8", layout="nhwc->nhwc", threads=2))
    packed = kv.prepack(ctx, [a if i in (3, 4, 5) else None for i, a in enumerate(inputs)],
                        attrs)
    ctx = dataclasses.replace(ctx, prepacked=packed)
    y = np.asarray(kv.fn(ctx, stored, attrs, None)[0])
    why = cpu_planner.int8_layout_split_reason(packed.kernel, inputs[0].shape, inputs[3].shape,
                                               y.shape, attrs, 2)
    stated = re.search(r"on (\d+) of 2 thread", why)
    (call,) = packed.last[0][1].calls.values()
    assert stated is not None and call is not None and call.tail[-1] == int(stated.group(1))
    assert int(stated.group(1)) == (1 if case[3] == 1 else 2)
