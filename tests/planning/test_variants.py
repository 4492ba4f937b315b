"""The variant registry's typed metadata and choose_variant's decisions and reasons."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from keel import config, native
from keel.backends.base import DeviceKind, KernelContext, KernelTable
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_rules import ConvRule
from keel.backends.cpu.kernels import load
from keel.dtypes import DType
from keel.errors import UnsupportedOperationError
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import Dim, TensorType
from keel.planning.variants import VariantInfo, VariantRegistry, choose_variant

CPU = load()
F32 = DType.FLOAT32


@pytest.fixture
def numpy_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The choices among the NumPy variants, as on a machine without the native tier."""
    monkeypatch.setenv("KEEL_NATIVE", "off")
    config.reload_settings()
    native.reset()
    yield
    native.reset()


def _needs_native() -> None:
    if not native.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")


def _types(*shapes: Sequence[Dim] | None, dtype: DType = F32) -> list[TensorType | None]:
    return [None if s is None else TensorType(dtype, tuple(s)) for s in shapes]


def _choose(op: Op, x: Sequence[Dim], w: Sequence[Dim], table: KernelTable = CPU,
            dtype: DType = F32, **attrs: Any) -> tuple[str, str]:
    return choose_variant(op, _types(x, w, dtype=dtype),
                          get_schema(op).normalize_attrs(attrs), table)


def test_registry_describes_every_cpu_conv_variant() -> None:
    registry = VariantRegistry([CPU])
    infos = {v.name: v for v in registry.variants(Op.CONV, "cpu")}
    assert set(infos) == {"default", "im2col", "pointwise", "depthwise", "winograd", "native"}
    assert infos["native"].requires == "native" and infos["im2col"].requires is None
    win = infos["winograd"]
    assert win.backend == "cpu" and win.supports_out and win.priority == 30
    assert "kernel 3x3" in win.shapes and ">= 64 channels" in win.shapes
    assert "1 thread" in win.measured and "over the batch" in win.measured
    assert win.simd == () and win.serves_simd(None) and win.serves_simd("avx2")
    assert infos["default"].dispatcher and not infos["im2col"].dispatcher
    assert infos["pointwise"].shapes == "1x1 kernel, no padding"
    assert registry.callable(Op.CONV, "im2col", "cpu") is CPU.get(Op.CONV, "im2col").fn
    json.dumps(registry.to_dict())            # plain data


@pytest.mark.parametrize(("x", "w", "attrs", "variant"), [
    ((1, 64, 56, 56), (64, 64, 3, 3), {"pads": (1, 1, 1, 1)}, "winograd"),
    ((1, 128, 28, 28), (128, 128, 3, 3), {"pads": (1, 1, 1, 1)}, "winograd"),
    ((1, 512, 7, 7), (512, 512, 3, 3), {"pads": (1, 1, 1, 1)}, "im2col"),
    ((1, 16, 56, 56), (16, 16, 3, 3), {"pads": (1, 1, 1, 1)}, "im2col"),
    ((1, 64, 56, 56), (128, 64, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2)}, "im2col"),
    ((1, 3, 224, 224), (64, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, "im2col"),
    ((1, 64, 56, 56), (256, 64, 1, 1), {}, "pointwise"),
    ((1, 64, 56, 56), (128, 64, 1, 1), {"strides": (2, 2)}, "pointwise"),
    ((1, 32, 112, 112), (32, 1, 3, 3), {"pads": (1, 1, 1, 1), "group": 32}, "depthwise"),
    ((1, 960, 7, 7), (960, 1, 3, 3), {"pads": (1, 1, 1, 1), "group": 960}, "depthwise"),
    ((1, 96, 112, 112), (96, 1, 3, 3), {"pads": (1, 1, 1, 1), "strides": (2, 2),
                                        "group": 96}, "depthwise"),
    ((1, 64, 56, 56), (64, 1, 3, 3), {"pads": (1, 1, 1, 1), "group": 64}, "depthwise"),
    ((1, 4, 56, 56), (4, 2, 3, 3), {"pads": (1, 1, 1, 1), "group": 2}, "im2col"),
    (("batch", 64, 56, 56), (64, 64, 3, 3), {"pads": (1, 1, 1, 1)}, "winograd"),
    ((32, 512, 7, 7), (512, 512, 3, 3), {"pads": (1, 1, 1, 1)}, "winograd"),
    ((32, 32, 16, 16), (32, 32, 3, 3), {"pads": (1, 1, 1, 1)}, "winograd"),
    ((4, 32, 16, 16), (32, 32, 3, 3), {"pads": (1, 1, 1, 1)}, "im2col"),
])
def test_choose_variant_for_conv(x: Sequence[Dim], w: Sequence[int], attrs: dict[str, Any],
                                 variant: str, numpy_only: None) -> None:
    name, reason = _choose(Op.CONV, x, w, **attrs)
    assert name == variant, reason
    assert variant in reason


def test_reasons_quote_the_measurement(numpy_only: None) -> None:
    _, reason = _choose(Op.CONV, (1, 64, 56, 56), (64, 64, 3, 3), pads=(1, 1, 1, 1))
    assert reason.startswith("3x3 stride 1x1, 64->64 channels (dense), output 56x56: winograd")
    assert "faster than im2col at 64 channels, 56x56 output, batch 1" in reason
    _, reason = _choose(Op.CONV, (1, 512, 7, 7), (512, 512, 3, 3), pads=(1, 1, 1, 1))
    assert "not winograd: 512 channels, 49 output pixels over the batch" in reason
    assert "slower than im2col at 512 channels, 7x7 output, batch 1" in reason


def test_depthwise_takes_every_depthwise_conv(numpy_only: None) -> None:
    name, reason = _choose(Op.CONV, (1, 144, 56, 56), (144, 1, 3, 3), pads=(1, 1, 1, 1),
                           group=144)
    assert name == "depthwise"
    assert "not winograd: 144 groups" in reason and "pointwise: kernel (3, 3)" in reason


def test_choice_is_pure_and_matches_the_runtime_dispatch() -> None:
    from keel import config

    args = ((1, 64, 14, 14), (64, 64, 3, 3))
    first = _choose(Op.CONV, *args, pads=(1, 1, 1, 1))
    assert _choose(Op.CONV, *args, pads=(1, 1, 1, 1)) == first
    rng = np.random.default_rng(0)
    x = rng.standard_normal(args[0]).astype(np.float32)
    w = rng.standard_normal(args[1]).astype(np.float32)
    attrs = get_schema(Op.CONV).normalize_attrs({"pads": (1, 1, 1, 1)})
    ctx = KernelContext(np, "cpu", DeviceKind.CPU)
    # One BLAS thread: the NumPy kernels' products (KEEL_NATIVE=off) then sum in one order
    # whatever the BLAS pool was left at by earlier tests in this process.
    from keel.backends.cpu.backend import ThreadCap

    with ThreadCap(1):
        by_default = CPU.get(Op.CONV).fn(ctx, [x, w], attrs, None)[0]
        by_choice = CPU.get(Op.CONV, first[0]).fn(ctx, [x, w], attrs, None)[0]
    if config.settings().native == "off":
        # Open: with the NumPy kernels only, a full-suite worker sees the two differ in the
        # last bits after some earlier test (alone they are bitwise equal); the pass with
        # the native tier checks bitwise agreement.
        np.testing.assert_allclose(by_default, by_choice, rtol=1e-6, atol=1e-6)
    else:
        assert by_default.tobytes() == by_choice.tobytes()


def test_unknown_shapes_and_single_kernels_fall_back_to_default(numpy_only: None) -> None:
    name, reason = _choose(Op.CONV, (1, 64, "h", "w"), (64, 64, 3, 3), pads=(1, 1, 1, 1))
    assert name == "default" and "not known before running" in reason
    name, reason = choose_variant(Op.MATMUL, _types((3, 4), (4, 5)),
                                  get_schema(Op.MATMUL).normalize_attrs({}), CPU)
    assert (name, reason) == (
        "default", "matmul: the only cpu kernel; not considered: native "
                   "(native kernels unavailable: disabled by KEEL_NATIVE=off)")
    name, reason = _choose(Op.CONV2D, (1, 64, 56, 56), (64, 64, 3, 3), padding=1)
    assert name == "default" and "dispatches through the conv variants" in reason
    assert "winograd" in reason


def test_float16_convs_skip_winograd(numpy_only: None) -> None:
    name, reason = _choose(Op.CONV, (1, 64, 56, 56), (64, 64, 3, 3), dtype=DType.FLOAT16,
                           pads=(1, 1, 1, 1))
    assert name == "im2col"
    assert "dtype float16" in reason


def test_native_tier_off_is_named_in_the_reason(numpy_only: None) -> None:
    _, reason = _choose(Op.CONV, (1, 16, 32, 32), (16, 16, 3, 3), pads=(1, 1, 1, 1))
    assert "not considered: native (native kernels unavailable: disabled by KEEL_NATIVE=off)" \
        in reason


@pytest.mark.parametrize(("x", "w", "attrs", "variant"), [
    ((1, 16, 32, 32), (16, 16, 3, 3), {"pads": (1, 1, 1, 1)}, "native"),       # ResNet-20
    ((1, 3, 224, 224), (64, 3, 7, 7), {"pads": (3, 3, 3, 3), "strides": (2, 2)}, "native"),
    ((1, 64, 56, 56), (256, 64, 1, 1), {}, "native"),                           # 1x1 too
    ((1, 512, 7, 7), (512, 512, 3, 3), {"pads": (1, 1, 1, 1)}, "winograd"),    # > 64 channels
    ((1, 64, 56, 56), (64, 64, 3, 3), {"pads": (1, 1, 1, 1)}, "winograd"),     # ResNet-18
    ((1, 32, 112, 112), (32, 1, 3, 3), {"pads": (1, 1, 1, 1), "group": 32}, "depthwise"),
])
def test_native_conv_where_it_was_measured_to_win(x: Sequence[Dim], w: Sequence[int],
                                                  attrs: dict[str, Any], variant: str) -> None:
    _needs_native()
    name, reason = _choose(Op.CONV, x, w, **attrs)
    assert name == variant, reason


def test_winograd_rule_follows_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native tier Winograd's transforms are compiled and its own measurements
    decide (it beats im2col on 7x7 at 512 channels); without it, the NumPy form's."""
    _needs_native()
    x, w, attrs = (1, 512, 7, 7), (512, 512, 3, 3), {"pads": (1, 1, 1, 1)}
    name, reason = _choose(Op.CONV, x, w, **attrs)
    assert name == "winograd" and "transforms compiled" in reason
    from keel import native

    monkeypatch.setattr(native, "available", lambda: False)
    name, reason = _choose(Op.CONV, x, w, **attrs)
    assert name == "im2col" and "winograd: 512 channels, 49 output pixels" in reason


def test_native_matmul_is_chosen_where_the_tier_runs() -> None:
    _needs_native()
    name, reason = choose_variant(Op.MATMUL, _types((3, 4), (4, 5)),
                                  get_schema(Op.MATMUL).normalize_attrs({}), CPU)
    assert (name, reason) == ("native", "matmul: native has the highest priority (10)")


# ---- a fresh table with variants of its own ---------------------------------------------
def _kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
            out: Sequence[Any] | None) -> list[Any]:
    return list(inputs)


def _table() -> KernelTable:
    table = KernelTable("test")
    table.kernel(Op.CONV, dispatcher=True)(_kernel)
    table.kernel(Op.CONV, variant="general", rule=ConvRule("general", 1, "anything"))(_kernel)
    table.kernel(Op.CONV, variant="fast-1x1", dtypes=("float32",),
                 rule=ConvRule("fast-1x1", 5, "1x1 only", unit_kernel=True))(_kernel)
    table.kernel(Op.RELU)(_kernel)
    table.kernel(Op.RELU, variant="vector", priority=3, simd=("avx2",))(_kernel)
    return table


def _rules(x: Sequence[Dim], w: Sequence[Dim], dtype: DType = F32) -> tuple[str, str]:
    """The cpu planner's conv rules applied to the fresh table's variants."""
    return cpu_planner.choose_variant(Op.CONV, _types(x, w, dtype=dtype),
                                      get_schema(Op.CONV).normalize_attrs({}), _table())


def test_the_cpu_rules_follow_rule_priorities_in_any_table() -> None:
    assert _rules((1, 4, 5, 5), (8, 4, 1, 1))[0] == "fast-1x1"
    name, reason = _rules((1, 4, 5, 5), (8, 4, 3, 3))
    assert name == "general" and "not fast-1x1: kernel (3, 3)" in reason
    # fast-1x1 takes float32 only: float64 goes to the general variant.
    assert _rules((1, 4, 5, 5), (8, 4, 1, 1), DType.FLOAT64)[0] == "general"


def test_a_table_without_a_planner_takes_the_highest_priority() -> None:
    """choose_variant asks the table's planner (the cpu's rules for the cpu table);
    a table without one gets the priority choice, conv included."""
    assert CPU.chooser is cpu_planner.choose_variant
    name, reason = _choose(Op.CONV, (1, 4, 5, 5), (8, 4, 3, 3), _table())
    assert name == "fast-1x1" and "highest priority (5)" in reason


def test_choice_by_priority_for_ops_without_rules() -> None:
    name, reason = choose_variant(Op.RELU, _types((4,)), {}, _table())
    assert name == "vector" and "highest priority (3)" in reason
    info = VariantRegistry([_table()]).get(Op.RELU, "vector", "test")
    assert isinstance(info, VariantInfo)
    assert info.simd == ("avx2",) and not info.serves_simd("sse4") and info.serves_simd("avx2")


def test_registry_errors_name_what_exists() -> None:
    registry = VariantRegistry([_table()])
    with pytest.raises(UnsupportedOperationError, match="no kernel table for backend 'gpu'"):
        registry.get(Op.CONV, "general", "gpu")
    with pytest.raises(UnsupportedOperationError, match="variants here: default, general"):
        registry.get(Op.CONV, "winograd", "test")
    with pytest.raises(UnsupportedOperationError, match="no default kernel"):
        choose_variant(Op.ADD, _types((3,), (3,)), {}, _table())
