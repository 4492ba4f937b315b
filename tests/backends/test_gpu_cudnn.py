"""The gpu backend's cuDNN convolutions: descriptor arithmetic, library detection, the
planner's rule and its fallbacks, the kernel on a fake device, and the real thing on a GPU."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from keel.backends.gpu import cudnn_graph, cudnn_lib
from keel.backends.gpu.backend import GpuBackend
from keel.backends.gpu.cudnn_graph import ConvDescriptor, Fusion
from keel.backends.gpu.cudnn_lib import CudnnLibrary
from keel.backends.plan import request_types
from keel.backends.reference.backend import ReferenceBackend
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schemas.conv import conv_geometry
from tests.backends.fakes import FakeCudnn, FakeCupy


def _attrs(**given: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {"auto_pad": "NOTSET", "dilations": (), "kernel_shape": (),
                             "pads": (), "strides": (), "group": 1, "activation": "",
                             "activation_params": ()}
    attrs.update(given)
    return attrs


# ---- the descriptor: pure arithmetic -------------------------------------------------
@pytest.mark.parametrize(("x", "w", "attrs", "expected"), [
    pytest.param((2, 8, 9, 9), (16, 4, 3, 3), _attrs(pads=(0, 1, 1, 0), strides=(2, 2), group=2),
                 ConvDescriptor((2, 8, 9, 9), (16, 4, 3, 3), (2, 16, 4, 4), (0, 1), (1, 0),
                                (2, 2), (1, 1)), id="asymmetric-pads-groups"),
    pytest.param((1, 3, 8, 7), (4, 3, 4, 4), _attrs(auto_pad="SAME_UPPER", strides=(2, 2)),
                 # out ceil(8/2)=4, ceil(7/2)=4; total pads 2 and 3, the odd one at the end
                 ConvDescriptor((1, 3, 8, 7), (4, 3, 4, 4), (1, 4, 4, 4), (1, 1), (1, 2),
                                (2, 2), (1, 1)), id="same-upper"),
    pytest.param((1, 3, 8, 7), (4, 3, 4, 4), _attrs(auto_pad="SAME_LOWER", strides=(2, 2)),
                 ConvDescriptor((1, 3, 8, 7), (4, 3, 4, 4), (1, 4, 4, 4), (1, 2), (1, 1),
                                (2, 2), (1, 1)), id="same-lower"),
    pytest.param((1, 4, 12, 12), (4, 1, 5, 5), _attrs(pads=(4, 4, 4, 4), dilations=(2, 2),
                                                       group=4),
                 # effective kernel 9: 12 + 8 - 9 + 1 = 12
                 ConvDescriptor((1, 4, 12, 12), (4, 1, 5, 5), (1, 4, 12, 12), (4, 4), (4, 4),
                                (1, 1), (2, 2)), id="depthwise-dilated"),
    pytest.param((2, 3, 17), (4, 3, 3), _attrs(pads=(1, 2), strides=(2,)),
                 # 1-D runs as 2-D with a unit height: (17 + 3 - 3) // 2 + 1 = 9
                 ConvDescriptor((2, 3, 1, 17), (4, 3, 1, 3), (2, 4, 1, 9), (0, 1), (0, 2),
                                (1, 2), (1, 1)), id="1d-lifted"),
    pytest.param((1, 2, 5, 6, 7), (3, 2, 3, 3, 3), _attrs(pads=(1, 1, 1, 1, 1, 1),
                                                         strides=(1, 2, 1)),
                 ConvDescriptor((1, 2, 5, 6, 7), (3, 2, 3, 3, 3), (1, 3, 5, 3, 7), (1, 1, 1),
                                (1, 1, 1), (1, 2, 1), (1, 1, 1)), id="3d"),
    pytest.param((2, 8, 7, 6), (16, 8, 1, 1), _attrs(),
                 ConvDescriptor((2, 8, 7, 6), (16, 8, 1, 1), (2, 16, 7, 6), (0, 0), (0, 0),
                                (1, 1), (1, 1)), id="1x1"),
])
def test_the_descriptor_cudnn_is_given(x: tuple[int, ...], w: tuple[int, ...],
                                       attrs: dict[str, Any],
                                       expected: ConvDescriptor) -> None:
    desc = cudnn_graph.describe(conv_geometry(Op.CONV, x, w, attrs))
    assert desc == expected
    assert desc.groups == int(attrs["group"])
    assert desc.bias == (1, expected.y[1], *(1,) * (len(expected.y) - 2))


def test_what_the_variant_serves_and_what_the_graph_fuses() -> None:
    assert cudnn_graph.cannot_serve(2, DType.FLOAT32) is None
    assert cudnn_graph.cannot_serve(None, DType.FLOAT16) is None
    assert cudnn_graph.cannot_serve(1, DType.BFLOAT16) is None
    assert cudnn_graph.cannot_serve(2, DType.FLOAT64) == (
        "cuDNN conv graphs here take float16, bfloat16 or float32, not float64")
    assert cudnn_graph.cannot_serve(4, DType.FLOAT32) == (
        "cuDNN conv graphs here take 1-3 spatial dims, not 4")
    assert cudnn_graph.graph_activation(("clip", (0.0, math.inf))) == (0.0, None)
    assert cudnn_graph.graph_activation(("clip", (0.0, 6.0))) == (0.0, 6.0)
    assert cudnn_graph.graph_activation(("clip", (-math.inf, 6.0))) is None
    assert cudnn_graph.graph_activation(("sigmoid", ())) is None
    assert cudnn_graph.graph_activation(("", ())) is None
    assert cudnn_graph.fusions(True, True, True) == (
        Fusion(True, True, True, True), Fusion(True, True, True),
        Fusion(True, True, False, True), Fusion(True, True, False),
        Fusion(True, False, False), Fusion(False, False, False))
    assert cudnn_graph.fusions(False, True, True) == (
        Fusion(False, True, True), Fusion(False, True, False), Fusion(False, False, False))
    assert cudnn_graph.fusions(False, False, False) == (Fusion(False, False, False),)
    assert Fusion(True, False, True).describe() == "conv + bias + activation"
    assert Fusion(True, True, False, True).describe() == "conv + residual + bias"


# ---- the library: detected once, with its reason --------------------------------------
def _missing() -> Any:
    raise ModuleNotFoundError("No module named 'cudnn'")


@pytest.mark.parametrize(("loader", "reason"), [
    (_missing, "nvidia-cudnn-frontend is not installed (No module named 'cudnn'); install "
               "it with: pip install 'keel-runtime[cuda12]' (nvidia-cudnn-frontend)"),
    (lambda: FakeCudnn(load_error=RuntimeError("Unable to find symbol cudnnGetVersion")),
     "the cuDNN library did not load: RuntimeError: Unable to find symbol cudnnGetVersion"),
    (lambda: FakeCudnn(version=8600), "cuDNN 8.6 is older than the 8.9 its graph API needs"),
    (lambda: FakeCudnn(version=8907), "cuDNN 8.9 (nvidia-cudnn-frontend 0.0-fake)"),
    (lambda: FakeCudnn(version=91900), "cuDNN 9.19 (nvidia-cudnn-frontend 0.0-fake)"),
])
def test_library_availability_is_decided_once_with_its_reason(loader: Any, reason: str) -> None:
    calls = []

    def counted() -> Any:
        calls.append(1)
        return loader()

    lib = CudnnLibrary(counted)
    assert lib.availability().reason == reason
    assert lib.availability().available == reason.startswith("cuDNN 9") or "8.9 (" in reason
    lib.availability()
    assert len(calls) == 1


# ---- the planner and the kernel on a fake device ---------------------------------------
@pytest.fixture
def fake_cudnn(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudnn]:
    fake = FakeCudnn()
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(lambda: fake))
    yield fake


def _gpu() -> GpuBackend:
    return GpuBackend(cupy_module=FakeCupy())


def _inputs(x: tuple[int, ...], w: tuple[int, ...], bias: bool = True,
            z: tuple[int, ...] | None = None, dtype: Any = np.float32) -> list[Any]:
    rng = np.random.default_rng(7)
    arrays: list[Any] = [rng.standard_normal(x).astype(dtype),
                         rng.standard_normal(w).astype(dtype)]
    if bias or z is not None:
        arrays.append(rng.standard_normal(w[0]).astype(dtype) if bias else None)
    if z is not None:
        arrays.append(rng.standard_normal(z).astype(dtype))
    return arrays


def test_planner_runs_convs_on_cudnn_where_it_loads(fake_cudnn: FakeCudnn) -> None:
    gpu = _gpu()
    x, w = (1, 8, 9, 9), (8, 8, 3, 3)
    plan = gpu.plan_node(Op.CONV, request_types(_inputs(x, w)), _attrs(pads=(1, 1, 1, 1)))
    assert plan.variant == "cudnn"
    assert plan.reason("variant").startswith(
        "cuDNN 9.19 (nvidia-cudnn-frontend 0.0-fake): one fused graph per shape")
    assert "its engine measured once per shape (the fastest of cuDNN's candidates on the " \
        "first run" in plan.reason("variant")
    assert "float32 without TF32 (measured on an H100: 1.6-28x faster than " \
        "pointwise/im2col); not considered: native" in plan.reason("variant")
    wide = gpu.plan_node(Op.CONV, request_types(_inputs(x, w, dtype=np.float64)), _attrs())
    assert wide.variant == "im2col"
    assert "not cudnn: cuDNN conv graphs here take float16, bfloat16 or float32, not " \
        "float64" in \
        wide.reason("variant")


def test_planner_says_why_not_cudnn_when_it_does_not_load(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(_missing))
    gpu = _gpu()
    plan = gpu.plan_node(Op.CONV, request_types(_inputs((1, 8, 5, 5), (4, 8, 1, 1))),
                         _attrs())
    assert plan.variant == "pointwise"
    assert "not cudnn: nvidia-cudnn-frontend is not installed" in plan.reason("variant")
    plan = gpu.plan_node(Op.CONV, request_types(_inputs((1, 8, 5, 5), (4, 8, 3, 3))),
                         _attrs())
    assert plan.variant == "im2col" and "not cudnn: nvidia-cudnn-frontend" in \
        plan.reason("variant")


CASES = [
    pytest.param((2, 8, 9, 9), (16, 4, 3, 3), True, None,
                 _attrs(pads=(0, 1, 1, 0), strides=(2, 2), group=2, activation="relu"),
                 "conv + bias + activation", id="groups-asym-pads-relu"),
    pytest.param((2, 4, 6, 6), (5, 4, 3, 3), True, (2, 5, 6, 6),
                 _attrs(pads=(1, 1, 1, 1), activation="clip", activation_params=(0.0, 6.0)),
                 "conv + residual + bias + activation", id="residual-relu6"),
    pytest.param((1, 4, 12, 12), (4, 1, 5, 5), False, None,
                 _attrs(pads=(4, 4, 4, 4), dilations=(2, 2), group=4), "conv",
                 id="depthwise-dilated-no-bias"),
    pytest.param((1, 3, 8, 7), (4, 3, 4, 4), True, None,
                 _attrs(auto_pad="SAME_LOWER", strides=(2, 2), activation="sigmoid"),
                 "conv + bias", id="same-lower-sigmoid-after"),
    pytest.param((2, 3, 17), (4, 3, 3), True, None, _attrs(pads=(1, 2), strides=(2,)),
                 "conv + bias", id="1d"),
    pytest.param((1, 2, 5, 6, 7), (3, 2, 3, 3, 3), True, None,
                 _attrs(pads=(1, 1, 1, 1, 1, 1), strides=(1, 2, 1)), "conv + bias", id="3d"),
]


@pytest.mark.parametrize(("x", "w", "bias", "z", "attrs", "fused"), CASES)
def test_cudnn_kernel_on_a_fake_device_matches_the_reference(
        fake_cudnn: FakeCudnn, x: tuple[int, ...], w: tuple[int, ...], bias: bool,
        z: tuple[int, ...] | None, attrs: dict[str, Any], fused: str) -> None:
    arrays = _inputs(x, w, bias, z)
    expected = ReferenceBackend().run(Op.CONV, arrays, attrs=attrs)[0]
    gpu = _gpu()
    got = gpu.run(Op.CONV, arrays, attrs=attrs, variant="cudnn")[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    graph = fake_cudnn.builds[-1]
    assert graph.ops[0][0] == "conv_fprop"
    row = next(r for r in cudnn_graph.built() if r["x"][0] == x[0] and r["w"][-1] == w[-1]
               and r.get("fused") == fused and r["dtype"] == "float32")
    assert row["engine"].startswith("fake_engine_0, fastest of 1 engines and the fusions "
                                    "cuDNN serves, timed on first run")
    assert row["workspace_bytes"] == 1024 and row["declined"] == ()


def test_a_signature_builds_once_and_each_call_binds_pointers_and_the_stream(
        fake_cudnn: FakeCudnn) -> None:
    cupy = FakeCupy()
    gpu = GpuBackend(cupy_module=cupy)
    attrs = _attrs(pads=(1, 1, 1, 1), activation="relu")
    arrays = _inputs((1, 4, 5, 5), (6, 4, 3, 3))
    first = gpu.run(Op.CONV, arrays, attrs=attrs, variant="cudnn")[0]
    moved = [a + 1 for a in arrays]                   # new buffers, same signature
    second = gpu.run(Op.CONV, moved, attrs=attrs, variant="cudnn")[0]
    # The first call built (and timed) one graph per fusion; the second built nothing.
    assert len(fake_cudnn.builds) == 3 and len(fake_cudnn.executions) == 2
    assert all(stream == cupy.stream.ptr for _, stream in fake_cudnn.executions)
    np.testing.assert_allclose(second, ReferenceBackend().run(Op.CONV, moved, attrs=attrs)[0],
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(first, second)
    graph = fake_cudnn.builds[0]
    assert graph.kwargs["io_data_type"] == "FLOAT"
    assert graph.heuristics == ["A", "FALLBACK"]
    assert {"TENSOR_CORE", "DOWN_CONVERT_INPUTS", "NONDETERMINISTIC"} <= set(
        graph.notes_deselected)


def test_the_fastest_engine_is_measured_once_per_shape(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    cupy = FakeCupy()
    fake = FakeCudnn(plan_costs=(3.0, 1.0, 2.0), tick=cupy.advance)
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(lambda: fake))
    gpu = GpuBackend(cupy_module=cupy)
    attrs = _attrs(pads=(1, 1, 1, 1))
    arrays = _inputs((2, 3, 5, 5), (4, 3, 3, 3))
    for _ in range(3):
        got = gpu.run(Op.CONV, arrays, attrs=attrs, variant="cudnn")[0]
    np.testing.assert_allclose(got, ReferenceBackend().run(Op.CONV, arrays, attrs=attrs)[0],
                               rtol=1e-5, atol=1e-5)
    graph = fake.builds[0]                      # conv + bias (then conv alone) was timed
    assert len(fake.builds) == 2 and graph.policy is None and graph._plan_index == 1
    assert sorted(set(graph.timed)) == [0, 1, 2] and len(graph.timed) == 3 * 4
    row = next(r for r in cudnn_graph.built() if r["x"] == (2, 3, 5, 5))
    assert row["engine"] == ("fake_engine_1, fastest of 3 engines and the fusions cuDNN "
                             "serves, timed on first run: 1.000 ms")
    assert row["fused"] == "conv + bias"
    assert row["workspace_bytes"] == 2048 and len(fake.executions) == 3


def test_a_shorter_graph_wins_where_it_measures_faster(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    cupy = FakeCupy()
    fake = FakeCudnn(plan_costs=lambda kinds: (5.0,) if "relu" in kinds else (2.0, 1.5),
                     tick=cupy.advance)
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(lambda: fake))
    attrs = _attrs(pads=(1, 1, 1, 1), activation="clip", activation_params=(0.0, 6.0))
    arrays = _inputs((1, 2, 6, 6), (3, 2, 3, 3))
    got = GpuBackend(cupy_module=cupy).run(Op.CONV, arrays, attrs=attrs, variant="cudnn")[0]
    np.testing.assert_allclose(got, ReferenceBackend().run(Op.CONV, arrays, attrs=attrs)[0],
                               rtol=1e-5, atol=1e-5)
    row = next(r for r in cudnn_graph.built() if r["x"] == (1, 2, 6, 6))
    assert row["fused"] == "conv + bias"        # the clip runs after it, through xp
    assert row["engine"].startswith("fake_engine_1, fastest of 2 engines")


def test_a_first_run_inside_a_capture_takes_the_heuristic_choice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = FakeCupy()
    cupy.stream.is_capturing = lambda: True
    fake = FakeCudnn(plan_costs=(3.0, 1.0), tick=cupy.advance)
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(lambda: fake))
    arrays = _inputs((1, 3, 6, 5), (4, 3, 3, 3))
    GpuBackend(cupy_module=cupy).run(Op.CONV, arrays, attrs=_attrs(), variant="cudnn")
    (graph,) = fake.builds                      # not timed: the most fused graph served
    assert graph.timed == [] and graph._plan_index == 0
    row = next(r for r in cudnn_graph.built() if r["x"] == (1, 3, 6, 5))
    assert row["engine"] == ("fake_engine_0, cuDNN's heuristic choice (not timed: first run "
                             "captured)")


def test_a_captured_first_run_whose_graph_fails_to_build_takes_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = FakeCupy()
    cupy.stream.is_capturing = lambda: True
    fake = FakeCudnn(decline_build=lambda kinds: "no kernel" if "relu" in kinds else None)
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(lambda: fake))
    attrs = _attrs(activation="relu")
    arrays = _inputs((1, 3, 7, 6), (4, 3, 3, 3))
    got = GpuBackend(cupy_module=cupy).run(Op.CONV, arrays, attrs=attrs, variant="cudnn")[0]
    np.testing.assert_allclose(got, ReferenceBackend().run(Op.CONV, arrays, attrs=attrs)[0],
                               rtol=1e-5, atol=1e-5)
    row = next(r for r in cudnn_graph.built() if r["x"] == (1, 3, 7, 6))
    assert row["fused"] == "conv + bias"        # the ReLU runs after it
    assert row["declined"] == ("conv + bias + activation: RuntimeError: no plan could be "
                               "built: no kernel",)


def test_float16_computes_in_float32_on_tensor_cores(fake_cudnn: FakeCudnn) -> None:
    arrays = _inputs((1, 4, 6, 6), (4, 1, 3, 3), dtype=np.float16)
    attrs = _attrs(pads=(1, 1, 1, 1), group=4, activation="relu")
    got = _gpu().run(Op.CONV, arrays, attrs=attrs, variant="cudnn")[0]
    assert got.dtype == np.float16
    expected = ReferenceBackend().run(Op.CONV, arrays, attrs=attrs)[0]
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32),
                               rtol=2e-3, atol=2e-3)
    graph = fake_cudnn.builds[-1]
    assert graph.kwargs["io_data_type"] == "HALF"
    assert graph.kwargs["compute_data_type"] == graph.kwargs["intermediate_data_type"] == "FLOAT"
    assert "TENSOR_CORE" not in graph.notes_deselected


def test_a_declined_graph_runs_shorter_then_on_im2col(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_upper_clip(kinds: tuple[str, ...], ops: list[Any]) -> str | None:
        clipped = any(op[2].get("upper_clip") is not None for op in ops)
        return "clipped ReLU not supported" if clipped else None

    fake = FakeCudnn(decline=no_upper_clip)
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(lambda: fake))
    attrs = _attrs(pads=(1, 1, 1, 1), activation="clip", activation_params=(0.0, 0.5))
    arrays = _inputs((1, 3, 7, 7), (5, 3, 3, 3), z=(1, 5, 7, 7))
    expected = ReferenceBackend().run(Op.CONV, arrays, attrs=attrs)[0]
    got = _gpu().run(Op.CONV, arrays, attrs=attrs, variant="cudnn")[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert [op[0] for op in fake.builds[0].ops] == ["conv_fprop", "add", "bias"]
    row = next(r for r in cudnn_graph.built() if r["x"] == (1, 3, 7, 7)
               and r["w"] == (5, 3, 3, 3) and r["dtype"] == "float32" and "fused" in r)
    assert row["fused"] == "conv + residual + bias"
    assert len(row["declined"]) == 2 and row["declined"][0].startswith(
        "conv + residual + bias + activation: RuntimeError: cudnnGraphNotSupportedError: "
        "clipped ReLU not supported")

    nothing = FakeCudnn(decline=lambda kinds, ops: "no engine")
    monkeypatch.setattr(cudnn_lib, "LIBRARY", CudnnLibrary(lambda: nothing))
    got = _gpu().run(Op.CONV, arrays, attrs=attrs, variant="cudnn")[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert nothing.builds == [] and nothing.executions == []
    row = next(r for r in cudnn_graph.built() if "fused" not in r and r["x"] == (1, 3, 7, 7))
    assert "conv + bias + residual + activation: RuntimeError: " in row["declined"]
    assert row["declined"].count("no engine") == 6


def test_the_op_level_default_runs_the_planners_variant(fake_cudnn: FakeCudnn) -> None:
    arrays = _inputs((1, 4, 5, 5), (6, 4, 3, 3))
    attrs = _attrs(pads=(1, 1, 1, 1))
    got = _gpu().run(Op.CONV, arrays, attrs=attrs)[0]
    assert len(fake_cudnn.executions) == 1
    np.testing.assert_allclose(got, ReferenceBackend().run(Op.CONV, arrays, attrs=attrs)[0],
                               rtol=1e-5, atol=1e-5)
    wide = [a.astype(np.float64) for a in arrays]     # float64: the shared im2col
    got = _gpu().run(Op.CONV, wide, attrs=attrs)[0]
    assert len(fake_cudnn.executions) == 1
    np.testing.assert_allclose(got, ReferenceBackend().run(Op.CONV, wide, attrs=attrs)[0],
                               rtol=1e-12, atol=1e-12)


# ---- on a real GPU --------------------------------------------------------------------
def _real_gpu() -> GpuBackend:
    gpu = GpuBackend()
    if not gpu.is_available():
        pytest.skip(f"no usable GPU: {gpu.availability().reason}")
    avail = cudnn_lib.LIBRARY.availability()
    if not avail.available:
        pytest.skip(f"cuDNN is not usable here: {avail.reason}")
    return gpu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("x", "w", "bias", "z", "attrs", "fused"), CASES)
def test_cudnn_conv_on_the_gpu_matches_the_reference(
        x: tuple[int, ...], w: tuple[int, ...], bias: bool, z: tuple[int, ...] | None,
        attrs: dict[str, Any], fused: str, dtype: Any) -> None:
    gpu = _real_gpu()
    arrays = _inputs(x, w, bias, z, dtype=dtype)
    wide = [None if a is None else a.astype(np.float64) for a in arrays]
    expected = ReferenceBackend().run(Op.CONV, wide, attrs=attrs)[0]
    plan = gpu.plan_node(Op.CONV, request_types(arrays), attrs)
    assert plan.variant == "cudnn", plan.reason("variant")
    got = gpu.read(gpu.run(Op.CONV, [gpu.to_device(a) for a in arrays], attrs=attrs,
                           variant="cudnn")[0])
    error = np.linalg.norm(got.astype(np.float64) - expected) / np.linalg.norm(expected)
    # float32 without TF32 stays within float32 rounding; float16 within its own.
    assert error < (1e-6 if dtype == np.float32 else 2e-3), error
