"""The webgpu backend on whatever adapter wgpu finds here (llvmpipe in CI).

The benchmark models run pinned to webgpu and match the reference backend; auto
placement never chooses a CPU adapter and says why; a pinned webgpu raises a
typed error for an op it has no kernel for. Skips (with the reason) only where
wgpu or an adapter is genuinely absent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
        [helper.make_node("Cos", ["x"], ["c"]), helper.make_node("Hardmax", ["c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOperationError, match="hardmax"):
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


# ---- casts, comparisons, logic and shape copies -----------------------------------

def _shape_and_logic_model() -> bytes:
    """Cast, Equal, Less, Not, Or, Where, Concat, Pad, Tile, Unsqueeze, Expand, integer Mod
    and Div: the ops that move indices and masks between the float layers of a model."""
    from onnx import TensorProto, helper, numpy_helper

    def const(name: str, value: np.ndarray) -> Any:
        return numpy_helper.from_array(value, name)

    nodes = [
        helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT64),
        helper.make_node("Equal", ["xi", "row"], ["eq"]),
        helper.make_node("Less", ["x", "half"], ["lt"]),
        helper.make_node("Not", ["lt"], ["ge"]),
        helper.make_node("Or", ["eq", "ge"], ["keep"]),
        helper.make_node("Where", ["keep", "x", "zero"], ["w"]),
        helper.make_node("Concat", ["w", "x"], ["cat"], axis=1),
        helper.make_node("Pad", ["cat", "pads"], ["pad"], mode="reflect"),
        helper.make_node("Tile", ["pad", "reps"], ["tile"]),
        helper.make_node("Unsqueeze", ["tile", "axes"], ["u"]),
        helper.make_node("Expand", ["u", "shape"], ["e"]),
        helper.make_node("Mul", ["e", "ten"], ["big"]),
        helper.make_node("Cast", ["big"], ["ei"], to=TensorProto.INT32),
        helper.make_node("Mod", ["ei", "three"], ["m"], fmod=0),
        helper.make_node("Cast", ["big"], ["el"], to=TensorProto.INT64),
        helper.make_node("Div", ["el", "seven"], ["d"]),
        helper.make_node("Cast", ["m"], ["y"], to=TensorProto.FLOAT16),
    ]
    inits = [const("row", np.array([0, 1, -1], np.int64)), const("half", np.float32(0.5)),
             const("zero", np.zeros((1, 3), np.float32)),
             const("pads", np.array([1, 0, 0, 2], np.int64)),
             const("reps", np.array([1, 2], np.int64)), const("axes", np.array([0], np.int64)),
             const("shape", np.array([2, 1, 1], np.int64)), const("ten", np.float32(10.0)),
             const("three", np.int32(-3)), const("seven", np.int64(7))]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None),
         helper.make_tensor_value_info("d", TensorProto.INT64, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def test_casts_masks_and_shape_copies_run_on_webgpu_in_one_submission() -> None:
    ort = pytest.importorskip("onnxruntime")
    model_bytes = _shape_and_logic_model()
    model = keel.load_model(model_bytes, backend="webgpu")
    assert set(model.plan.backends) == {"webgpu"}
    x = np.array([[-1.7, 0.2, 2.9], [0.4, -0.3, 1.1]], np.float32)
    model.predict({"x": x})
    from keel.backends.registry import default_registry

    device = default_registry().instance("webgpu")._device
    before = device.submits
    got = model.predict({"x": x})
    assert device.submits - before == 1
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    want = dict(zip(["y", "d"], session.run(["y", "d"], {"x": x}), strict=True))
    for key in ("y", "d"):
        assert got[key].dtype == want[key].dtype
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_cast_to_a_dtype_webgpu_cannot_hold_is_refused_with_the_reason() -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.DOUBLE)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [4])])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOperationError,
                       match=r"makes float64 \(webgpu holds no float64: WGSL has no 64-bit"):
        keel.load_model(onnx_model.SerializeToString(), backend="webgpu")
    x = WEBGPU.to_device(np.ones(4, np.float32))
    for target in ("float64", "uint16", "bfloat16"):
        with pytest.raises(UnsupportedOperationError, match=f"target dtype {target}"):
            WEBGPU.run("cast", [x], None, {"to": target})


def _cast(x: np.ndarray, to: str) -> np.ndarray:
    return WEBGPU.read(WEBGPU.run("cast", [WEBGPU.to_device(x)], None, {"to": to})[0])


def test_int64_casts_are_exact_past_float32_precision() -> None:
    info = np.iinfo(np.int64)
    wide = np.array([info.min, info.max, 2**24 + 1, 2**24 + 3, 2**40 + 2**16 + 1,
                     -(2**53) - 1, 123456789012345, -5, 0, 1], np.int64)
    np.testing.assert_array_equal(_cast(wide, "float32"), wide.astype(np.float32))
    np.testing.assert_array_equal(_cast(wide, "int32"), wide.astype(np.int32))
    np.testing.assert_array_equal(_cast(wide, "uint8"), wide.astype(np.uint8))
    floats = np.array([1e12, -3.5e15, 2.7, -2.7, 9.2e18, -9.2e18, -0.0], np.float32)
    np.testing.assert_array_equal(_cast(floats, "int64"), floats.astype(np.int64))
    ints = np.array([info.min // 3, -1, 7, 2**31 - 1], np.int64)
    np.testing.assert_array_equal(_cast(_cast(ints, "int32"), "int64"),
                                  ints.astype(np.int32).astype(np.int64))


@pytest.mark.parametrize(("op", "attrs"), [("div", {}), ("mod", {"fmod": 0}),
                                          ("mod", {"fmod": 1})])
def test_int64_division_is_exact_over_the_whole_range(op: str, attrs: dict[str, int]) -> None:
    rng = np.random.default_rng(7)
    info = np.iinfo(np.int64)
    a = np.concatenate([[info.min + 1, info.max, -1, 0, 2**40 + 5],
                        rng.integers(info.min // 2, info.max // 2, 27)]).astype(np.int64)
    b = np.concatenate([[3, -7, 5, -1, -(2**33) - 9],
                        rng.integers(1, 2**35, 27) * rng.choice([-1, 1], 27)]).astype(np.int64)
    reference = REGISTRY.instance("reference")
    want = reference.run(op, [a, b], None, attrs)[0]
    got = WEBGPU.read(WEBGPU.run(op, [WEBGPU.to_device(a), WEBGPU.to_device(b)], None, attrs)[0])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["uint8", "bool", "float16", "int64"])
def test_concat_of_more_inputs_than_one_shader_binds(dtype: str) -> None:
    rng = np.random.default_rng(3)
    count = WEBGPU._device.storage_bindings + 5
    parts = [(rng.integers(0, 200, (2, int(rng.integers(0, 4)), 3))).astype(dtype)
             for _ in range(count)]
    got = WEBGPU.run("concat", [WEBGPU.to_device(p) for p in parts], None, {"axis": 1})[0]
    np.testing.assert_array_equal(WEBGPU.read(got), np.concatenate(parts, axis=1))


def test_float16_casts_round_to_nearest_even_bit_for_bit() -> None:
    """float32 -> float16 through pack2x16float: ties to even, subnormals kept, signed zero
    and NaN kept (values in float16's finite range, where WGSL defines the result)."""
    x = np.array([65504.0, 6e-8, 3e-5, 2.9e-8, -0.0, 1.00048828125, 1.000732421875, -2.5e-7,
                  np.nan, 1234.567], np.float32)
    got = _cast(x, "float16")
    np.testing.assert_array_equal(got.view(np.uint16)[:-2], x.astype(np.float16).view(
        np.uint16)[:-2])
    assert np.isnan(got[-2]) and got[-1] == np.float16(1234.567)
    back = _cast(got, "float32")
    np.testing.assert_array_equal(back, got.astype(np.float32))
