"""The compiled window kernels (depthwise conv, max / average / global pools) against the
reference backend on random inputs, their fallbacks, and thread-count determinism."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from keel import config, native
from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import depthwise
from keel.backends.cpu import native_window as nw
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.kernels import load as load_cpu
from keel.backends.reference.kernels import load as load_reference
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.conv import conv_geometry
from keel.ops.types import TensorType
from keel.planning.variants import choose_variant

CPU = load_cpu()
REFERENCE = load_reference()
RNG = np.random.default_rng(11)


pytestmark = pytest.mark.usefixtures("native_window_tier")


@pytest.fixture
def native_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KEEL_NATIVE", "off")
    config.reload_settings()
    native.reset()
    yield
    monkeypatch.delenv("KEEL_NATIVE")
    config.reload_settings()
    native.reset()


def _f(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def _cpu(op: Op, inputs: Sequence[np.ndarray | None], variant: str = "default",
         threads: int = 1, outputs: int = 1, **attrs: Any) -> list[np.ndarray]:
    """A cpu kernel writing into ``outputs`` fresh buffers (so max_pool skips Indices)."""
    norm = get_schema(op).normalize_attrs(attrs)
    ref_y = _ref(op, inputs, **attrs)
    out = [np.empty_like(r) for r in ref_y[:outputs]]
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, threads)
    return list(CPU.get(op, variant).fn(ctx, list(inputs), norm, out))


def _ref(op: Op, inputs: Sequence[np.ndarray | None], **attrs: Any) -> list[np.ndarray]:
    norm = get_schema(op).normalize_attrs(attrs)
    ctx = KernelContext(np, "reference", DeviceKind.CPU)
    return list(REFERENCE.get(op).fn(ctx, list(inputs), norm, None))


def _close(got: np.ndarray, want: np.ndarray, tol: float = 1e-5) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, equal_nan=True)


# ---- depthwise convolution --------------------------------------------------------------
# MobileNetV2's depthwise layers (channels, stride) at small spatial sizes.
MOBILENET = [(32, 1), (96, 2), (144, 1), (144, 2), (192, 1), (192, 2), (384, 1), (576, 1),
             (576, 2), (960, 1)]


def _dw(x_shape: tuple[int, ...], kernel: tuple[int, ...], **attrs: Any
        ) -> tuple[list[np.ndarray | None], dict[str, Any]]:
    c = x_shape[1]
    attrs = {"group": c, "kernel_shape": kernel, **attrs}
    return [_f(*x_shape), _f(c, 1, *kernel), _f(c)], attrs


def _form(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> str:
    x, w = inputs[0], inputs[1]
    assert x is not None and w is not None
    norm = get_schema(Op.CONV).normalize_attrs(attrs)
    return cpu_planner.depthwise_layout(conv_geometry(Op.CONV, x.shape, w.shape, norm)).form


@pytest.mark.parametrize(("channels", "stride"), MOBILENET)
@pytest.mark.parametrize("side", [7, 10])
def test_mobilenet_depthwise_layers(channels: int, stride: int, side: int) -> None:
    inputs, attrs = _dw((1, channels, side, side), (3, 3), pads=(1, 1, 1, 1),
                        strides=(stride, stride), activation="clip",
                        activation_params=(0.0, 6.0))
    assert _form(inputs, attrs) == "native"
    (want,) = _ref(Op.CONV, inputs, **attrs)
    for variant in ("default", "depthwise"):
        (got,) = _cpu(Op.CONV, inputs, variant, **attrs)
        _close(got, want)


@pytest.mark.parametrize(("x", "kernel", "attrs"), [
    ((2, 3, 13, 11), (3, 3), {"pads": (1, 1, 1, 1), "strides": (3, 3)}),
    ((1, 4, 9, 17), (5, 5), {"pads": (2, 2, 2, 2)}),
    ((1, 5, 16, 15), (5, 5), {"pads": (1, 2, 2, 1), "strides": (2, 2)}),
    ((2, 2, 17, 19), (7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 1)}),
    ((1, 3, 12, 12), (3, 3), {"pads": (2, 2, 2, 2), "dilations": (2, 2)}),
    ((1, 3, 14, 13), (3, 2), {"pads": (0, 1, 2, 0), "dilations": (2, 3), "strides": (2, 3)}),
    ((3, 6, 5, 8), (1, 1), {}),
    ((1, 2, 1, 1), (1, 1), {}),
    ((1, 2, 3, 3), (3, 3), {"pads": (1, 1, 1, 1)}),
    ((1, 3, 40, 41), (3, 3), {"auto_pad": "SAME_UPPER", "strides": (2, 2)}),
    ((1, 4, 150, 33), (3, 3), {"pads": (1, 1, 1, 1)}),            # several bands per plane
    ((1, 3, 70, 130), (3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    # Rows of 32+ outputs go straight to Y (window.c's conv_rows): tails of every width.
    ((2, 3, 20, 56), (3, 3), {"pads": (1, 1, 1, 1)}),
    ((1, 4, 9, 120), (5, 5), {"pads": (2, 2, 2, 2)}),
    ((1, 3, 30, 128), (3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}),
    ((1, 2, 12, 118), (3, 3), {"pads": (2, 2, 2, 2), "dilations": (2, 2)}),
    ((1, 2, 150, 112), (3, 3), {"pads": (1, 1, 1, 1)}),            # several bands per plane
    ((1, 2, 7, 61), (3, 3), {"pads": (0, 1, 2, 0), "strides": (1, 1)}),
    ((2, 3, 31), (5,), {"pads": (2, 1), "strides": (2,)}),         # 1-D
    ((1, 2, 300), (3,), {"pads": (1, 1), "dilations": (3,)}),
])
def test_depthwise_geometries(x: tuple[int, ...], kernel: tuple[int, ...],
                              attrs: dict[str, Any]) -> None:
    inputs, attrs = _dw(x, kernel, **attrs)
    assert _form(inputs, attrs) == "native"
    (want,) = _ref(Op.CONV, inputs, **attrs)
    (got,) = _cpu(Op.CONV, inputs, "depthwise", **attrs)
    _close(got, want)


@pytest.mark.parametrize(("activation", "params"), [
    ("", ()), ("relu", ()), ("clip", (-0.5, 0.25)), ("hard_swish", ()), ("sigmoid", ())])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_depthwise_epilogue(activation: str, params: tuple[float, ...], with_bias: bool,
                            with_residual: bool) -> None:
    inputs, attrs = _dw((2, 5, 11, 9), (3, 3), pads=(1, 1, 1, 1), activation=activation,
                        activation_params=params)
    inputs[2] = inputs[2] if with_bias else None
    if with_residual:
        inputs.append(_f(2, 5, 11, 9))
    (want,) = _ref(Op.CONV, inputs, **attrs)
    (got,) = _cpu(Op.CONV, inputs, "depthwise", **attrs)
    _close(got, want)


def test_depthwise_nan_and_inf_propagate_as_in_the_reference() -> None:
    inputs, attrs = _dw((1, 3, 9, 9), (3, 3), pads=(1, 1, 1, 1), activation="relu")
    x = inputs[0]
    assert x is not None
    x[0, 0, 4, 4] = np.nan
    x[0, 1, 0, 0] = np.inf
    x[0, 2, 8, 8] = -np.inf
    (want,) = _ref(Op.CONV, inputs, **attrs)
    (got,) = _cpu(Op.CONV, inputs, "depthwise", **attrs)
    assert np.isnan(got).sum() == np.isnan(want).sum() > 0
    _close(got, want)


def test_depthwise_noncontiguous_input_and_output() -> None:
    inputs, attrs = _dw((2, 4, 10, 12), (3, 3), pads=(1, 1, 1, 1))
    x = inputs[0]
    assert x is not None
    strided = np.repeat(x, 2, axis=3)[..., ::2]          # same values, not contiguous
    (want,) = _ref(Op.CONV, inputs, **attrs)
    norm = get_schema(Op.CONV).normalize_attrs(attrs)
    big = np.zeros((2, 4, 10, 24), np.float32)
    y = big[..., ::2]
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, 1)
    CPU.get(Op.CONV, "depthwise").fn(ctx, [strided, *inputs[1:]], norm, [y])
    _close(y, want)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_depthwise_other_dtypes_run_the_numpy_form(dtype: Any) -> None:
    inputs, attrs = _dw((1, 4, 9, 9), (3, 3), pads=(1, 1, 1, 1))
    inputs = [None if a is None else a.astype(dtype) for a in inputs]
    (want,) = _ref(Op.CONV, inputs, **attrs)
    (got,) = _cpu(Op.CONV, inputs, "depthwise", **attrs)
    _close(got, want, 1e-5 if dtype == np.float64 else 2e-2)


def test_depthwise_multiplier_stays_numpy_and_says_why() -> None:
    x, w = _f(1, 4, 8, 8), _f(8, 1, 3, 3)
    norm = get_schema(Op.CONV).normalize_attrs({"group": 4, "kernel_shape": (3, 3)})
    layout = cpu_planner.depthwise_layout(conv_geometry(Op.CONV, x.shape, w.shape, norm))
    assert layout.form != "native" and "channel multiplier 2" in layout.reason
    with pytest.raises(ValueError, match="form 'native' cannot run"):
        cpu_planner.depthwise_layout(conv_geometry(Op.CONV, x.shape, w.shape, norm), "native")
    (want,) = _ref(Op.CONV, [x, w], group=4, kernel_shape=(3, 3))
    (got,) = _cpu(Op.CONV, [x, w], "depthwise", group=4, kernel_shape=(3, 3))
    _close(got, want)


def test_native_layout_names_itself_and_its_fallback() -> None:
    inputs, attrs = _dw((1, 32, 20, 20), (3, 3), pads=(1, 1, 1, 1))
    x, w = inputs[0], inputs[1]
    assert x is not None and w is not None
    norm = get_schema(Op.CONV).normalize_attrs(attrs)
    layout = cpu_planner.depthwise_layout(conv_geometry(Op.CONV, x.shape, w.shape, norm))
    assert layout.form == "native" and layout.reason.startswith("native: compiled")
    assert layout.fallback is not None and layout.fallback.form in depthwise.FORMS[1:]


def test_native_off_gives_the_numpy_form_with_the_reason(native_off: None) -> None:
    inputs, attrs = _dw((1, 8, 9, 9), (3, 3), pads=(1, 1, 1, 1))
    x, w = inputs[0], inputs[1]
    assert x is not None and w is not None
    norm = get_schema(Op.CONV).normalize_attrs(attrs)
    geo = conv_geometry(Op.CONV, x.shape, w.shape, norm)
    layout = cpu_planner.depthwise_layout(geo)
    assert layout.form != "native"
    assert "native kernels unavailable (disabled by KEEL_NATIVE=off)" in layout.reason
    asked = cpu_planner.depthwise_layout(geo, "native")       # runs its NumPy fallback
    assert asked.form == "native" and "so its NumPy form" in asked.reason
    y = np.empty(geo.out_shape, np.float32)
    depthwise.depthwise(np, asked, x, w, inputs[2], None, y, ("", ()))
    _close(y, _ref(Op.CONV, inputs, **attrs)[0])
    (want,) = _ref(Op.CONV, inputs, **attrs)
    (got,) = _cpu(Op.CONV, inputs, "depthwise", **attrs)
    _close(got, want)
    (pooled,) = _cpu(Op.MAX_POOL, [x], "native", kernel_shape=(2, 2))
    np.testing.assert_array_equal(pooled, _ref(Op.MAX_POOL, [x], kernel_shape=(2, 2))[0])


# ---- pooling --------------------------------------------------------------------------------
POOL_WINDOWS = [
    ((1, 6, 24, 24), {"kernel_shape": (2, 2), "strides": (2, 2)}),         # LeNet
    ((2, 16, 8, 8), {"kernel_shape": (2, 2), "strides": (2, 2)}),
    ((1, 3, 17, 15), {"kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}),
    ((2, 2, 13, 11), {"kernel_shape": (3, 3), "strides": (3, 3), "pads": (0, 1, 2, 1)}),
    ((1, 3, 9, 10), {"kernel_shape": (1, 1)}),
    ((1, 2, 19, 20), {"kernel_shape": (5, 5), "pads": (2, 2, 2, 2)}),
    ((1, 2, 21, 22), {"kernel_shape": (7, 7), "strides": (2, 2), "pads": (3, 3, 3, 3)}),
    ((1, 2, 12, 13), {"kernel_shape": (3, 3), "dilations": (2, 2), "pads": (1, 2, 1, 2)}),
    ((1, 3, 10, 11), {"kernel_shape": (3, 3), "strides": (2, 2), "ceil_mode": True}),
    ((1, 3, 11, 10), {"kernel_shape": (2, 3), "strides": (3, 2), "pads": (1, 0, 0, 1),
                      "ceil_mode": True}),
    ((1, 2, 160, 40), {"kernel_shape": (3, 3), "pads": (1, 1, 1, 1)}),     # several bands
    ((2, 3, 29), {"kernel_shape": (3,), "strides": (2,), "pads": (1, 0), "ceil_mode": True}),
    ((1, 1, 1, 1), {"kernel_shape": (1, 1)}),
]


@pytest.mark.parametrize(("x", "attrs"), POOL_WINDOWS)
def test_max_pool(x: tuple[int, ...], attrs: dict[str, Any]) -> None:
    xs = _f(*x)
    (want, _) = _ref(Op.MAX_POOL, [xs], **attrs)
    for variant in ("default", "native"):
        (got,) = _cpu(Op.MAX_POOL, [xs], variant, **attrs)
        np.testing.assert_array_equal(got, want)          # a max is exact


@pytest.mark.parametrize(("x", "attrs"), POOL_WINDOWS)
@pytest.mark.parametrize("include_pad", [False, True])
def test_avg_pool(x: tuple[int, ...], attrs: dict[str, Any], include_pad: bool) -> None:
    xs = _f(*x)
    (want,) = _ref(Op.AVG_POOL, [xs], count_include_pad=include_pad, **attrs)
    for variant in ("default", "native"):
        (got,) = _cpu(Op.AVG_POOL, [xs], variant, count_include_pad=include_pad, **attrs)
        _close(got, want)


def test_max_pool_nan_propagates_and_infinities_win_or_lose() -> None:
    x = _f(1, 2, 8, 9)
    x[0, 0, 3, 3] = np.nan
    x[0, 1, 0, 0] = np.inf
    x[0, 1, 5:7, 5:7] = -np.inf
    attrs: dict[str, Any] = {"kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}
    (got,) = _cpu(Op.MAX_POOL, [x], "native", **attrs)
    # NaN anywhere in a window gives NaN (as np.maximum); elsewhere the reference's max.
    windows = np.zeros((1, 2, 4, 5), bool)
    windows[0, 0, 1:3, 1:3] = True                       # the windows that hold (3, 3)
    np.testing.assert_array_equal(np.isnan(got), windows)
    (want, _) = _ref(Op.MAX_POOL, [x], **attrs)
    np.testing.assert_array_equal(got[~windows], want[~windows])
    assert got[0, 1, 0, 0] == np.inf and got[0, 1, 3, 3] > -np.inf


def test_max_pool_nan_in_one_band_of_several() -> None:
    """Bands whose copy holds a NaN take the NaN-propagating max; the others do not."""
    x = _f(1, 2, 200, 40)
    x[0, 1, 150, 7] = np.nan
    attrs: dict[str, Any] = {"kernel_shape": (3, 3), "pads": (1, 1, 1, 1)}
    (got,) = _cpu(Op.MAX_POOL, [x], "native", **attrs)
    windows = np.zeros(got.shape, bool)
    windows[0, 1, 149:152, 6:9] = True
    np.testing.assert_array_equal(np.isnan(got), windows)
    (want, _) = _ref(Op.MAX_POOL, [x], **attrs)
    np.testing.assert_array_equal(got[~windows], want[~windows])


@pytest.mark.parametrize("op", [Op.MAX_POOL, Op.AVG_POOL, Op.GLOBAL_MAX_POOL])
def test_pools_of_noncontiguous_arrays(op: Op) -> None:
    x = _f(2, 3, 9, 20)[..., ::2]                        # (2, 3, 9, 10), not contiguous
    attrs: dict[str, Any] = {} if op is Op.GLOBAL_MAX_POOL else {
        "kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}
    want = _ref(op, [x], **attrs)[0]
    norm = get_schema(op).normalize_attrs(attrs)
    y = np.zeros((*want.shape[:-1], 2 * want.shape[-1]), np.float32)[..., ::2]
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, 1)
    CPU.get(op, "native").fn(ctx, [x], norm, [y])
    _close(y, want)


def test_max_pool_all_infinite_window_gives_minus_inf() -> None:
    x = np.full((1, 1, 4, 4), -np.inf, np.float32)
    (got,) = _cpu(Op.MAX_POOL, [x], "native", kernel_shape=(2, 2), pads=(1, 1, 1, 1))
    assert np.all(got == -np.inf)


def test_max_pool_indices_run_the_numpy_kernel() -> None:
    x = _f(1, 3, 8, 8)
    want = _ref(Op.MAX_POOL, [x], kernel_shape=(2, 2), strides=(2, 2))
    got = _cpu(Op.MAX_POOL, [x], "native", outputs=2, kernel_shape=(2, 2), strides=(2, 2))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("shape", [(1, 1280, 7, 7), (2, 5, 3), (2, 3, 4, 5, 6), (1, 4, 1, 1),
                                   (3, 7, 19, 23), (1, 2, 16), (1, 3, 17)])
def test_global_max_pool(shape: tuple[int, ...]) -> None:
    x = _f(*shape)
    (want,) = _ref(Op.GLOBAL_MAX_POOL, [x])
    for variant in ("default", "native"):
        (got,) = _cpu(Op.GLOBAL_MAX_POOL, [x], variant)
        np.testing.assert_array_equal(got, want)


def test_global_max_pool_nan() -> None:
    x = _f(2, 3, 5, 5)
    x[1, 2, 4, 4] = np.nan
    (got,) = _cpu(Op.GLOBAL_MAX_POOL, [x], "native")
    assert np.isnan(got[1, 2, 0, 0]) and np.isnan(got).sum() == 1


@pytest.mark.parametrize("shape", [(1, 1280, 7, 7), (2, 5, 3), (2, 3, 4, 5, 6), (1, 4, 1, 1),
                                   (3, 7, 19, 23), (1, 2, 16), (1, 3, 17), (1, 2, 32),
                                   (1, 2, 48)])
def test_global_avg_pool(shape: tuple[int, ...]) -> None:
    x = _f(*shape)
    (want,) = _ref(Op.GLOBAL_AVG_POOL, [x])
    for variant in ("default", "native"):
        (got,) = _cpu(Op.GLOBAL_AVG_POOL, [x], variant)
        _close(got, want)


def test_global_avg_pool_nan_and_infinities_stay_in_their_plane() -> None:
    x = _f(2, 3, 5, 5)
    x[1, 2, 4, 4], x[0, 1, 0, 0] = np.nan, np.inf
    (got,) = _cpu(Op.GLOBAL_AVG_POOL, [x], "native")
    (want,) = _ref(Op.GLOBAL_AVG_POOL, [x])
    _close(got, want)
    assert np.isnan(got[1, 2, 0, 0]) and np.isposinf(got[0, 1, 0, 0])


def test_global_avg_pool_of_a_noncontiguous_input() -> None:
    x = _f(2, 6, 9, 9)[:, ::2, 1:, :]
    (want,) = _ref(Op.GLOBAL_AVG_POOL, [x])
    (got,) = _cpu(Op.GLOBAL_AVG_POOL, [x], "native")
    _close(got, want)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_pools_of_other_dtypes_run_the_numpy_kernels(dtype: Any) -> None:
    x = _f(1, 3, 9, 9, dtype=dtype)
    attrs: dict[str, Any] = {"kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}
    for op in (Op.MAX_POOL, Op.AVG_POOL):
        want = _ref(op, [x], **attrs)[0]
        (got,) = _cpu(op, [x], "native", **attrs)
        _close(got, want, 1e-5 if dtype == np.float64 else 2e-3)


def test_native_pool_variants_are_chosen_for_float32() -> None:
    attrs = get_schema(Op.MAX_POOL).normalize_attrs({"kernel_shape": (2, 2)})
    name, why = choose_variant(Op.MAX_POOL, [TensorType(DType.FLOAT32, (1, 4, 8, 8))], attrs,
                               CPU)
    assert name == "native" and "highest priority" in why
    name, _ = choose_variant(Op.MAX_POOL, [TensorType(DType.FLOAT16, (1, 4, 8, 8))], attrs, CPU)
    assert name == "default"


# ---- threads ----------------------------------------------------------------------------
def test_threads_give_bitwise_equal_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_CHUNK_TAPS", 1)          # split even small calls
    inputs, attrs = _dw((3, 7, 23, 21), (3, 3), pads=(1, 1, 1, 1), strides=(2, 2),
                        activation="clip", activation_params=(0.0, 6.0))
    inputs.append(_f(3, 7, 12, 11))
    x, w, b, z = inputs
    assert x is not None and w is not None
    norm = get_schema(Op.CONV).normalize_attrs(attrs)
    layout = cpu_planner.depthwise_layout(conv_geometry(Op.CONV, x.shape, w.shape, norm))
    one, two = (np.empty((3, 7, 12, 11), np.float32) for _ in range(2))
    depthwise.depthwise(np, layout, x, w, b, z, one, ("clip", (0.0, 6.0)), threads=1)
    depthwise.depthwise(np, layout, x, w, b, z, two, ("clip", (0.0, 6.0)), threads=2)
    assert one.tobytes() == two.tobytes()
    xs = _f(3, 7, 20, 19)
    pool: dict[str, Any] = {"kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}
    for op, kw in ((Op.MAX_POOL, pool), (Op.AVG_POOL, pool), (Op.GLOBAL_MAX_POOL, {}),
                   (Op.GLOBAL_AVG_POOL, {})):
        single = _cpu(op, [xs], "native", threads=1, **kw)[0]
        double = _cpu(op, [xs], "native", threads=2, **kw)[0]
        assert single.tobytes() == double.tobytes(), op


# ---- portable builds ------------------------------------------------------------------------
PORTABLE_FLAGS = {"x86_64": [("-march=x86-64",), ("-mavx2", "-mfma")]}


def _portable_library(tmp: Any, flags: tuple[str, ...]) -> Any:
    """window.c built with ``flags`` instead of -march=native."""
    import ctypes
    import subprocess

    from keel.native.build import SOURCE_DIR
    from keel.native.toolchain import BASE_FLAGS, find_compiler

    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(f"native tier unavailable: {why}")
    target = tmp / f"window{len(flags)}.so"
    done = subprocess.run([compiler.path, *BASE_FLAGS, *flags, "-o", str(target),
                           str(SOURCE_DIR / "window.c"), "-lm"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(target))


@pytest.mark.parametrize("flags", PORTABLE_FLAGS.get(__import__("platform").machine(), []))
def test_portable_builds_match_the_native_one(tmp_path: Any, flags: tuple[str, ...]) -> None:
    """The plain-C (vector-extension) paths give the native build's results."""
    import ctypes

    lib = _portable_library(tmp_path, flags)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    scratch = lib.keel_window_scratch
    scratch.argtypes, scratch.restype = [ptr], i64
    conv = lib.keel_dwconv2d_f32
    conv.argtypes, conv.restype = [ptr] * 8 + [i64, i64], i64
    pool = lib.keel_maxpool2d_f32
    pool.argtypes, pool.restype = [ptr] * 4 + [i64, i64], i64
    avg = lib.keel_avgpool2d_f32
    avg.argtypes, avg.restype = [ptr] * 5 + [i64, i64], i64
    gmax = lib.keel_global_maxpool_f32
    gmax.argtypes, gmax.restype = [ptr, ptr, i64, i64, i64], None
    gavg = lib.keel_global_avgpool_f32
    gavg.argtypes, gavg.restype = [ptr, ptr, i64, i64, i64], None
    for x_shape, attrs in ((1, 5, 23, 37), {"pads": (1, 2, 2, 1), "strides": (2, 2)}), \
            ((2, 3, 9, 8), {"pads": (1, 1, 1, 1), "strides": (1, 3), "dilations": (2, 1)}), \
            ((1, 2, 6, 60), {"pads": (1, 1, 1, 1)}):
        inputs, full = _dw(x_shape, (3, 3), activation="clip", activation_params=(0.0, 1.0),
                           **attrs)
        x, w, b = (np.ascontiguousarray(a) for a in inputs if a is not None)
        norm = get_schema(Op.CONV).normalize_attrs(full)
        layout = cpu_planner.depthwise_layout(conv_geometry(Op.CONV, x.shape, w.shape, norm))
        geo = layout.native
        assert geo is not None
        want = np.empty(layout.geo.out_shape, np.float32)
        depthwise.depthwise(np, layout, x, w, b, None, want, ("clip", (0.0, 1.0)))
        got = np.empty_like(want)
        buf = np.empty(scratch(geo.address), np.float32)
        clip = np.array([0.0, 1.0], np.float32)
        planes = x.shape[0] * x.shape[1]
        assert conv(x.ctypes.data, w.ctypes.data, b.ctypes.data, None, got.ctypes.data,
                    geo.address, clip.ctypes.data, buf.ctypes.data, 0, planes) == 0
        _close(got, want)
        (pooled, _) = _ref(Op.MAX_POOL, [x], kernel_shape=(3, 3), **attrs)
        pool_geo = nw.plan(x.shape[1], pooled_window(x.shape, attrs))
        assert pool_geo is not None
        got_pool = np.empty_like(pooled)
        buf = np.empty(scratch(pool_geo.address), np.float32)
        assert pool(x.ctypes.data, got_pool.ctypes.data, pool_geo.address, buf.ctypes.data,
                    0, planes) == 0
        np.testing.assert_array_equal(got_pool, pooled)
        (mean,) = _ref(Op.AVG_POOL, [x], kernel_shape=(3, 3), **attrs)
        counts = nw.avg_counts(pool_geo.window, False)
        assert avg(x.ctypes.data, got_pool.ctypes.data, pool_geo.address, counts.ctypes.data,
                   buf.ctypes.data, 0, planes) == 0
        _close(got_pool, mean)
        x[0, 0, 1, 1] = np.nan
        top = np.empty(x.shape[:2], np.float32)
        gmax(x.ctypes.data, top.ctypes.data, x.shape[2] * x.shape[3], 0, planes)
        want_top = x.max(axis=(2, 3))
        np.testing.assert_array_equal(top, want_top)
        gavg(x.ctypes.data, top.ctypes.data, x.shape[2] * x.shape[3], 0, planes)
        _close(top, x.astype(np.float64).mean(axis=(2, 3)).astype(np.float32))


def pooled_window(shape: tuple[int, ...], attrs: dict[str, Any]) -> Any:
    from keel.ops.schemas.pooling import pool_window

    norm = get_schema(Op.MAX_POOL).normalize_attrs({"kernel_shape": (3, 3), **attrs})
    return pool_window(Op.MAX_POOL, shape, norm)
