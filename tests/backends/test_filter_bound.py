"""The cpu planner's choice between Winograd and the native conv from the bytes each
moves (planner.filter_bytes): layers whose transformed filters outgrow the L2 and the
tiles they multiply run native, the rest keep Winograd, and results match the
reference backend either way."""

from __future__ import annotations

import numpy as np
import pytest

from keel import load_model
from keel.backends.cpu import native_gemm
from keel.backends.cpu import planner as cpu_planner
from keel.backends.cpu.conv_rules import ConvCase

MIB = 1 << 20
L2_1MIB = cpu_planner.Caches(MIB, 32 * MIB, "test")


def _case(c: int, m: int, side: int, batch: int) -> ConvCase:
    return ConvCase(2, (3, 3), (1, 1), (1, 1), True, 1, c, m, (side, side), batch, "float32")


@pytest.mark.parametrize(("c", "side", "batch", "bound"), [
    (512, 7, 1, True),      # U 16 MiB for 16 tiles
    (256, 14, 1, True),     # U 4 MiB for 49 tiles
    (128, 28, 1, False),    # U 1 MiB: within the L2
    (64, 56, 1, False),
    (512, 7, 32, False),    # 512 tiles: the tiles' bytes match the filters'
    (256, 14, 8, False),
])
def test_filters_bind_where_they_outgrow_the_l2_and_the_tiles(c: int, side: int,
                                                              batch: int,
                                                              bound: bool) -> None:
    moved = cpu_planner.filter_bytes(_case(c, c, side, batch), L2_1MIB)
    assert moved.bound is bound
    assert moved.u == 16 * c * c * 4 and moved.winograd > moved.u
    assert moved.native < moved.winograd or not bound


def test_the_choice_follows_the_planned_machines_l2() -> None:
    """The same layer keeps Winograd for a machine whose L2 holds its filters."""
    case = _case(256, 256, 14, 1)
    native = cpu_planner.RULES["native"]
    small = cpu_planner.filter_bound_conv(case, "winograd", "rules", native, L2_1MIB)
    large = cpu_planner.filter_bound_conv(case, "winograd", "rules", native,
                                          cpu_planner.Caches(8 * MIB, 64 * MIB, "big"))
    assert small[0] == "native" and "its filters bound it" in small[1]
    assert "4096 KiB" in small[1] and "1024 KiB L2" in small[1]
    assert large == ("winograd", large[1]) and "within the 8192 KiB L2" in large[1]
    # A variant other than Winograd, or a case native cannot run, is left alone.
    assert cpu_planner.filter_bound_conv(case, "im2col", "r", native, L2_1MIB) == ("im2col",
                                                                                   "r")
    f64 = ConvCase(2, (3, 3), (1, 1), (1, 1), True, 1, 256, 256, (14, 14), 1, "float64")
    assert cpu_planner.filter_bound_conv(f64, "winograd", "r", native, L2_1MIB)[0] == \
        "winograd"


def _conv_model(c: int, side: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((c, c, 3, 3)) * 0.05).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["t"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["t"], ["y"])]
    graph = helper.make_graph(
        nodes, "deep_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c, side, side])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


@pytest.mark.skipif(not native_gemm.available(), reason="native tier unavailable")
def test_a_filter_bound_layer_runs_native_and_matches_the_reference() -> None:
    if cpu_planner.caches().l2 >= 4 * MIB:
        pytest.skip("this machine's L2 holds the layer's transformed filters")
    model = _conv_model(256, 14)
    x = np.random.default_rng(6).standard_normal((3, 256, 14, 14)).astype(np.float32)
    want = load_model(model, backend="reference").predict({"x": x})["y"]
    results = {}
    for threads in (1, 2):
        loaded = load_model(model, backend="cpu", threads=threads, plan_cache=False)
        (plan,) = [n.plan for n in loaded.plan.nodes if n.op == "conv"]
        assert plan is not None and plan.variant == "native"
        assert "its filters bound it" in plan.reason("variant")
        results[threads] = loaded.predict({"x": x})["y"]
        assert "its filters bound it" in loaded.explain()
    np.testing.assert_array_equal(results[2], results[1])
    np.testing.assert_allclose(results[1], want, rtol=1e-4, atol=1e-4)
