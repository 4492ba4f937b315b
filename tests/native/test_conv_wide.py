"""The wide layout of the native implicit-GEMM conv (conv_gemm.Wide): B read in place
through a per-tap offset table from a zero-bordered image whose rows share their
padding, garbage columns dropped by the store. Checked against the reference
backend on random inputs (pads, dilations, groups, batch stacked or per image,
bias / residual / clip / ReLU, remainders of the tile widths) and for bitwise
equality between 1 and 2 threads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel.backends.cpu import conv_gemm
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_epilogue import activation
from keel.backends.reference.backend import ReferenceBackend
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry

pytestmark = pytest.mark.usefixtures("native_gemm_tier")


CASES = [
    # X, W, attrs
    ((1, 3, 8, 8), (16, 3, 3, 3), {"pads": (1, 1, 1, 1)}),
    ((3, 16, 8, 8), (16, 16, 3, 3), {"pads": (1, 1, 1, 1)}),
    ((2, 5, 7, 11), (9, 5, 3, 3), {"pads": (1, 1, 1, 1)}),
    ((2, 4, 13, 6), (7, 4, 3, 5), {"pads": (0, 2, 1, 1)}),            # uneven pads
    ((1, 1, 28, 28), (6, 1, 5, 5), {}),                                 # unpadded: X in place
    ((3, 2, 12, 10), (5, 2, 5, 5), {}),
    ((2, 4, 11, 9), (6, 4, 3, 3), {"pads": (2, 2, 2, 2), "dilations": (2, 2)}),
    ((2, 6, 9, 9), (4, 3, 3, 3), {"pads": (1, 1, 1, 1), "group": 2}),
    ((1, 2, 1, 1), (3, 2, 3, 3), {"pads": (1, 1, 1, 1)}),              # 1-pixel image
    ((2, 3, 6, 6), (5, 3, 1, 1), {"pads": (1, 1, 1, 1)}),              # padded 1x1
    ((2, 16, 16, 16), (32, 16, 3, 3), {"pads": (1, 1, 1, 1)}),
]


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _reference(inputs: list[Any], attrs: dict[str, Any]) -> np.ndarray:
    return np.asarray(ReferenceBackend().run(Op.CONV, inputs, attrs=attrs)[0])


def _wide(x: np.ndarray, w: np.ndarray, b: Any, z: Any, attrs: dict[str, Any],
          stacked: bool, threads: int = 1) -> np.ndarray:
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm._wide_layout(geo, stacked)
    assert layout.wide is not None
    y = np.empty((geo.batch, geo.out_channels, *geo.window.out_spatial), np.float32)
    act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    assert conv_gemm.native(np, layout, x, w, b, z, y, act, None, threads)
    return y


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("act,params", [("", ()), ("relu", ()), ("clip", (-0.3, 0.4))])
def test_wide_matches_reference(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                attrs: dict[str, Any], stacked: bool, act: str,
                                params: tuple[float, ...]) -> None:
    rng = np.random.default_rng(31)
    x, w, b = _rand(rng, *x_shape), _rand(rng, *w_shape), _rand(rng, w_shape[0])
    plain = _reference([x, w, b], attrs)
    z = _rand(rng, *plain.shape)
    full = {**attrs, "activation": act, "activation_params": params}
    for bias, res in ((b, None), (b, z), (None, None), (None, z)):
        inputs = [x, w, bias] + ([] if res is None else [res])
        if bias is None:
            inputs[2] = None if res is not None else inputs[2]
            inputs = [x, w] if res is None else [x, w, np.zeros_like(b), res]
        want = _reference(inputs, full)
        got = _wide(x, w, bias, res, full, stacked)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stacked", [False, True])
def test_wide_residual_in_place_and_nan(stacked: bool) -> None:
    rng = np.random.default_rng(32)
    x, w = _rand(rng, 2, 4, 6, 7), _rand(rng, 8, 4, 3, 3)
    x[1, 2, 3, 4] = np.nan
    attrs = {"pads": (1, 1, 1, 1)}
    z = _rand(rng, 2, 8, 6, 7)
    want = _reference([x, w, np.zeros(8, np.float32), z], attrs)
    y = z.copy()
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    layout = conv_gemm._wide_layout(geo, stacked)
    assert conv_gemm.native(np, layout, x, w, None, y, y, ("", ()), None, 1)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    assert np.isnan(y[1]).any() and not np.isnan(y[0]).any()


@pytest.mark.parametrize("stacked", [False, True])
def test_wide_threads_give_bitwise_the_same(monkeypatch: pytest.MonkeyPatch,
                                            stacked: bool) -> None:
    monkeypatch.setattr(cpu_planner, "MIN_FLOPS_PER_THREAD", 1)
    rng = np.random.default_rng(33)
    x, w, b = _rand(rng, 3, 16, 10, 10), _rand(rng, 24, 16, 3, 3), _rand(rng, 24)
    attrs = {"pads": (1, 1, 1, 1), "activation": "relu"}
    one = _wide(x, w, b, None, attrs, stacked, threads=1)
    two = _wide(x, w, b, None, attrs, stacked, threads=2)
    np.testing.assert_array_equal(one, two)


def test_wide_layout_serves_only_stride_one_2d() -> None:
    strided = conv_geometry(Op.CONV, (1, 4, 8, 8), (4, 4, 3, 3),
                            {"pads": (1, 1, 1, 1), "strides": (2, 2)})
    assert conv_gemm.native_layout(strided, "wide").wide is None     # runs gathered
    unit = conv_geometry(Op.CONV, (1, 4, 8, 8), (4, 4, 3, 3), {"pads": (1, 1, 1, 1)})
    wide = conv_gemm.native_layout(unit, "wide").wide
    assert wide is not None and wide.row == 9 and not wide.stacked
    assert conv_gemm.native_layout(unit, "gathered").wide is None


@pytest.mark.parametrize("batch", [1, 3])
def test_wide_through_the_conv_kernel(batch: int) -> None:
    """A conv the rule sends to the wide layout, run as the cpu backend runs it."""
    from keel.backends.cpu.backend import CpuBackend

    rng = np.random.default_rng(34)
    # Unpadded 5x5: the output is smaller than the input, so the masked layout (taps
    # read straight from X) does not serve it and the wide one does.
    x, w, b = _rand(rng, batch, 8, 16, 16), _rand(rng, 8, 8, 5, 5), _rand(rng, 8)
    z = _rand(rng, batch, 8, 12, 12)
    attrs = {"activation": "relu"}
    geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
    assert cpu_planner.native_layout(geo).wide is not None
    want = _reference([x, w, b, z], attrs)
    for threads in (1, 2):
        got = CpuBackend(threads=threads).run(Op.CONV, [x, w, b, z], attrs=attrs,
                                              variant="native")[0]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
