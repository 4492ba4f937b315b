"""What the native conv layout tests share: random inputs, the reference backend's conv,
and the check of one layout against it over bias / residual combinations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import keel.backends.cpu.conv  # noqa: F401  (registers the conv kernels on TABLE)
from keel.backends.base import KernelContext
from keel.backends.cpu.kernels import TABLE
from keel.backends.reference.backend import ReferenceBackend
from keel.ops.registry import Op

# A conv under test: (x, w, bias or None, residual or None, attrs) -> y.
ConvRun = Callable[[np.ndarray, np.ndarray, Any, Any, dict[str, Any]], np.ndarray]


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def prepared_state(w: np.ndarray, b: np.ndarray, attrs: dict[str, Any], act: str = "",
                   params: tuple[float, ...] = ()) -> Any:
    """The native conv node's prepack state for these (now read-only) weights, as a
    model's node holds it."""
    w.setflags(write=False)
    b.setflags(write=False)
    full = {"group": 1, "dilations": (1, 1), **attrs, "activation": act,
            "activation_params": params}
    kernel = TABLE.get(Op.CONV, "native")
    assert kernel.prepack is not None
    return kernel.prepack(KernelContext(np, "cpu", "cpu", 1, None), [None, w, b], full)


def reference(inputs: list[Any], attrs: dict[str, Any]) -> np.ndarray:
    return np.asarray(ReferenceBackend().run(Op.CONV, inputs, attrs=attrs)[0])


def check_against_reference(run: ConvRun, x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                            attrs: dict[str, Any], act: str, params: tuple[float, ...],
                            seed: int = 7) -> None:
    """``run`` with and without a bias and a residual, under ``act`` (none, relu or
    clip), matches the reference conv followed by the residual add and the activation."""
    rng = np.random.default_rng(seed)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    plain = reference([x, w, b], attrs)
    z = rand(rng, *plain.shape)
    full = {**attrs, "activation": act, "activation_params": params}
    lo, hi = params if act == "clip" else (-np.inf, np.inf)
    for bias, res in ((b, None), (b, z), (None, None), (None, z)):
        expect = reference([x, w] + ([] if bias is None else [bias]), attrs)
        if res is not None:
            expect = expect + res
        expect = np.maximum(expect, 0) if act == "relu" else np.clip(expect, lo, hi)
        np.testing.assert_allclose(run(x, w, bias, res, full), expect, rtol=1e-4, atol=1e-4)


def run_layout(layout: Any, x: np.ndarray, w: np.ndarray, b: Any, z: Any,
               attrs: dict[str, Any], threads: int = 1,
               y: np.ndarray | None = None) -> np.ndarray:
    """``layout`` (a conv_gemm.NativeLayout) run by conv_gemm.native into ``y`` (made when
    None) under the activation ``attrs`` name; it must be served."""
    from keel.backends.cpu import conv_gemm
    from keel.backends.cpu.conv_epilogue import activation

    geo = layout.geo
    if y is None:
        y = np.empty((x.shape[0], geo.out_channels, *geo.window.out_spatial), np.float32)
    act = activation(attrs.get("activation", ""), attrs.get("activation_params", ()))
    assert conv_gemm.native(np, layout, x, w, b, z, y, act, None, threads)
    return y


def check_residual_in_place(run: Callable[..., np.ndarray], x_shape: tuple[int, ...],
                            w_shape: tuple[int, ...], attrs: dict[str, Any]) -> None:
    """Z is Y itself: ``run(x, w, b, z, attrs, y=y)`` adds the product to what Y holds."""
    rng = np.random.default_rng(3)
    x, w, b = rand(rng, *x_shape), rand(rng, *w_shape), rand(rng, w_shape[0])
    plain = reference([x, w, b], attrs)
    y = rand(rng, *plain.shape)
    expect = plain + y
    got = run(x, w, b, y, attrs, y=y)
    assert got is y
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)


def prepared_flags(monkeypatch: Any, flag: int) -> list[bool]:
    """Whether each GEMM call prepared from now on (native_gemm.prepare, spied on through
    ``monkeypatch``) carries ``flag`` (one of native_gemm's KEEL_* bits)."""
    from keel.backends.cpu import native_gemm

    carried: list[bool] = []
    prepare = native_gemm.prepare

    def spy(*args: Any, **kwargs: Any) -> Any:
        call = prepare(*args, **kwargs)
        if call is not None:
            carried.append(bool(int(call.values[native_gemm._FLAGS_FIELD]) & flag))
        return call

    monkeypatch.setattr(native_gemm, "prepare", spy)
    return carried
