"""The webgpu backend on whatever adapter wgpu finds here (llvmpipe in CI).

The benchmark models run pinned to webgpu and match the reference backend; auto
placement never chooses a CPU adapter and says why; a pinned webgpu raises a
typed error for an op it has no kernel for. Skips (with the reason) only where
wgpu or an adapter is genuinely absent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import keel
from benchmarks import zoo
from keel.backends.registry import builtin_registry
from keel.errors import InvalidArgumentError, UnsupportedOperationError

REGISTRY = builtin_registry()
WEBGPU = REGISTRY.instance("webgpu")

pytestmark = pytest.mark.skipif(
    not WEBGPU.is_available(),
    reason=f"webgpu is not available here: {WEBGPU.availability().reason}")


@pytest.mark.parametrize("name", ["mlp", "lenet", "resnet20", "mobilenetv2", "bert_mini"])
def test_benchmark_model_matches_onnxruntime(name: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    spec = zoo.MODELS[name]
    model = zoo.build(name)
    x = spec.make_input(1)
    got = keel.load_model(model, backend="webgpu").predict({spec.input_name: x})
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    want = dict(zip(names, session.run(names, {spec.input_name: x}), strict=True))
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-4, err_msg=key)


def test_a_model_run_is_one_submission() -> None:
    spec = zoo.MODELS["lenet"]
    model = keel.load_model(zoo.build("lenet"), backend="webgpu")
    x = spec.make_input(1)
    model.predict({spec.input_name: x})
    from keel.backends.registry import default_registry

    device = default_registry().instance("webgpu")._device
    before = device.submits
    model.predict({spec.input_name: x})
    assert device.submits - before == 1


def test_availability_names_the_adapter() -> None:
    info = WEBGPU.adapter
    assert info is not None
    assert info.label() in WEBGPU.availability().reason
    caps = WEBGPU.capabilities()
    assert any(n.startswith("adapter: ") for n in caps.notes)


def test_auto_placement_leaves_webgpu_out_and_says_why() -> None:
    plan = keel.load_model(zoo.build("mlp"), backend="auto").plan
    assert "webgpu" not in plan.backends
    assert any(r.startswith("webgpu not in the chain: opt-in") for r in plan.reasons)


def test_in_the_chain_a_cpu_adapter_is_still_never_chosen_and_the_plan_says_why() -> None:
    if not WEBGPU.adapter.is_cpu:
        pytest.skip(f"adapter {WEBGPU.adapter.label()} is a GPU")
    registry = builtin_registry()
    registry.set_priority(["webgpu", "cpu", "reference"])
    plan = keel.load_model(zoo.build("mlp"), backend="auto", registry=registry).plan
    assert set(plan.backends) == {"cpu"}
    reasons = " ".join(r for n in plan.nodes for r in n.reasons)
    assert "webgpu rejected" in reasons and "is a CPU adapter" in reasons


def test_pinned_webgpu_raises_for_an_op_without_a_kernel() -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cos", ["x"], ["c"]), helper.make_node("Atan", ["c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOperationError, match="atan"):
        keel.load_model(onnx_model.SerializeToString(), backend="webgpu").predict(
            {"x": np.ones(4, np.float32)})


def _relu_model(elem: int) -> bytes:
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", elem, [2, 3])],
        [helper.make_tensor_value_info("y", elem, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def test_a_float64_model_is_refused_at_placement_with_the_reason() -> None:
    from onnx import TensorProto

    with pytest.raises(UnsupportedOperationError,
                       match=r"relu on float64 \(webgpu holds no float64: WGSL has no 64-bit"):
        keel.load_model(_relu_model(TensorProto.DOUBLE), backend="webgpu")
    with pytest.raises(InvalidArgumentError, match=r"cannot hold float64 \(WGSL has no 64-bit"):
        WEBGPU.to_device(np.zeros(4, np.float64))


def test_auto_placement_says_why_float64_nodes_are_not_on_webgpu() -> None:
    from onnx import TensorProto

    registry = builtin_registry()
    registry.set_priority(["webgpu", "cpu", "reference"])
    model = keel.load_model(_relu_model(TensorProto.DOUBLE), backend="auto", registry=registry)
    reasons = " ".join(r for n in model.plan.nodes for r in n.reasons)
    assert set(model.plan.backends) == {"cpu"}
    assert "holds no float64: WGSL has no 64-bit float" in reasons
    x = np.linspace(-1, 1, 6).reshape(2, 3)
    np.testing.assert_array_equal(model.predict({"x": x})["y"], np.maximum(x, 0))


def test_seed_constraints_enforce_the_gpu_profile() -> None:
    from keel.backends.webgpu.backend import WebGpuBackend

    strict = WebGpuBackend(seed_constraints=True)
    strict.to_device(np.zeros(8, np.float32))
    with pytest.raises(InvalidArgumentError, match="divisible by 4"):
        strict.to_device(np.zeros(3, np.float32))
    with pytest.raises(InvalidArgumentError, match="float32 only"):
        strict.to_device(np.zeros(4, np.int64))


def test_calibrate_times_webgpu_and_keeps_it_in_its_own_file(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from keel import config
    from keel.planning.calibration import calibrate, find_calibration, save

    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KEEL_CALIBRATION")          # the tests' default is "off"
    config.reload_settings()                        # conftest reloads after the undo
    measured = calibrate(REGISTRY, groups=["elementwise"], sizes=[4096], repeats=1,
                         budget_seconds=30, gpu="webgpu")
    assert measured.devices["gpu"].startswith("webgpu: ")
    path = save(measured, gpu="webgpu")
    assert path.name.endswith("-webgpu.json")
    found = find_calibration(gpu="webgpu")
    assert found.calibration is not None and found.path == str(path)
    assert find_calibration().calibration is None          # the default chain's: none


def test_a_gpu_adapter_is_chosen_only_from_its_measured_crossover() -> None:
    from keel.backends.webgpu.device import AdapterInfo
    from keel.backends.webgpu.planner import Measured, auto_blocked

    gpu = AdapterInfo("vendor", "a GPU", "", "Vulkan", "DiscreteGPU", True)
    cpu = AdapterInfo("llvmpipe", "llvmpipe", "", "Vulkan", "CPU", True)
    assert "CPU adapter" in str(auto_blocked(cpu, Measured(1, "m"), 10**9))
    assert "no calibration" in str(auto_blocked(gpu, None, 10**9))
    assert "never found webgpu ahead" in str(auto_blocked(gpu, Measured(None, "m"), 10**9))
    assert "under the calibrated" in str(auto_blocked(gpu, Measured(10**6, "m"), 10**5))
    assert auto_blocked(gpu, Measured(10**6, "m"), 10**6) is None


@pytest.mark.parametrize(("x", "w", "group", "variant"), [
    ((1, 4, 9, 9), (6, 4, 3, 3), 1, "gemm"),
    ((1, 4, 17), (6, 4, 3), 1, "gemm"),
    ((1, 4, 9, 9), (4, 1, 3, 3), 4, "direct"),
    ((1, 4, 5, 6, 7), (6, 4, 3, 3, 3), 1, "direct"),
])
def test_the_planner_picks_the_conv_form_by_rank_and_groups(
        x: tuple[int, ...], w: tuple[int, ...], group: int, variant: str) -> None:
    from keel.dtypes import DType
    from keel.ops.registry import Op
    from keel.ops.types import TensorType

    types = [TensorType(DType.FLOAT32, x), TensorType(DType.FLOAT32, w)]
    plan = WEBGPU.plan_node(Op.CONV, types, {"group": group})
    assert plan.variant == variant
    if len(x) == 5:
        assert "3-D conv" in plan.reason("variant")
