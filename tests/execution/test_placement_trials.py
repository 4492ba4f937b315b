"""Auto placement measured on the machine: a signature's first inputs run on the gpu and
on the cpu, and the faster device takes the whole model (the plan quotes both times).

The gpu here is the fake CuPy (NumPy underneath); one side is slowed down on purpose
so the outcome is known, and the reason must name the measured times.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import keel
from keel.backends.base import KernelTable
from keel.backends.cpu.backend import CpuBackend
from keel.backends.registry import BackendRegistry
from tests.execution.test_capture import (  # noqa: F401 (a fixture)
    _FakeGpu,
    _feeds,
    _mlp,
    _program,
    per_node_rules,
)

_MEASURED = re.compile(r"placement measured here on this signature's first inputs: "
                       r"gpu (\S+ \S+) vs cpu (\S+ \S+) \(median of 3 runs after 2 warm-up "
                       r"runs\): every node on (\w+)")


def _slowed(table: KernelTable, delay: float) -> KernelTable:
    """``table`` with every kernel ``delay`` seconds slower (prepared calls dropped, so
    every step goes through the slowed kernel)."""
    def slow(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            time.sleep(delay)
            return fn(*args)
        return run

    slowed = KernelTable(table.backend, table.chooser)
    for op in table.ops():
        for variant in table.variants(op).values():
            slowed.register(dataclasses.replace(variant, fn=slow(variant.fn), bind=None))
    return slowed


class _SlowCpu(CpuBackend):
    def _kernels(self) -> KernelTable:
        return _slowed(super()._kernels(), 0.01)


class _SlowerCpu(CpuBackend):
    def _kernels(self) -> KernelTable:
        return _slowed(super()._kernels(), 0.03)


class _SlowGpu(_FakeGpu):
    def _kernels(self) -> KernelTable:
        return _slowed(super()._kernels(), 0.01)


def _registry(gpu: type, cpu: type = CpuBackend) -> BackendRegistry:
    registry = BackendRegistry()
    registry.register("gpu", type("Gpu", (gpu,), {"recorders": []}), 10)
    registry.register("cpu", cpu, 0)
    return registry


@pytest.mark.parametrize(("gpu", "cpu", "winner"), [(_SlowGpu, CpuBackend, "cpu"),
                                                   (_FakeGpu, _SlowCpu, "gpu")])
def test_the_faster_device_takes_the_whole_model(gpu: type, cpu: type, winner: str) -> None:
    # fp32 pinned: the device alone is measured (auto precision may take fp16 on a gpu)
    model = keel.load_model(_mlp(), backend="auto", precision="fp32",
                            registry=_registry(gpu, cpu))
    reference = keel.load_model(_mlp(), backend="reference")
    for seed in range(3):
        np.testing.assert_allclose(model.predict(_feeds(seed))["y"],
                                   reference.predict(_feeds(seed))["y"], rtol=1e-5, atol=1e-5)
    found = _MEASURED.search(model.explain())
    assert found is not None, model.explain()
    assert found.group(3) == winner
    assert {b for _, _, b in _program(model).steps if b != "copy"} >= {winner}
    assert all(b == winner for _, op, b in _program(model).steps if op != "copy")


def test_a_gpu_that_cannot_run_the_model_whole_is_left_out_with_the_reason() -> None:
    model = onnx.load_from_string(_mlp())
    graph = model.graph
    graph.output.pop()
    graph.node.append(helper.make_node("Binarizer", ["y"], ["out"], domain="ai.onnx.ml"))
    graph.output.append(helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4]))
    model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 3))
    keel_model = keel.load_model(model.SerializeToString(), backend="auto",
                                 registry=_registry(_FakeGpu))
    keel_model.predict(_feeds(0))
    text = keel_model.explain()
    assert "gpu cannot run it whole (" in text and "every node on cpu" in text, text


@pytest.mark.usefixtures("per_node_rules")
def test_trials_off_leaves_the_per_node_rules() -> None:
    model = keel.load_model(_mlp(), backend="auto", registry=_registry(_FakeGpu))
    model.predict(_feeds(0))
    assert "placement measured here" not in model.explain()
    # The inputs are tiny: seed 004's size rule keeps every node on the cpu.
    assert all(b == "cpu" for _, op, b in _program(model).steps if op != "copy")


def test_a_pinned_backend_is_never_measured_against_another() -> None:
    model = keel.load_model(_mlp(), backend="gpu", registry=_registry(_SlowGpu))
    model.predict(_feeds(0))
    assert "placement measured here" not in model.explain()


class _SlowFp32Gpu(_FakeGpu):
    """A fake gpu whose float32 kernels are slow: fp16 is the faster there."""

    def _kernels(self) -> KernelTable:
        table = super()._kernels()
        slowed = KernelTable(table.backend, table.chooser)

        def slow(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(ctx: Any, ins: Any, attrs: Any, out: Any) -> Any:
                if any(getattr(x, "dtype", None) == np.float32 for x in ins):
                    time.sleep(0.01)
                return fn(ctx, ins, attrs, out)
            return run

        for op in table.ops():
            for variant in table.variants(op).values():
                slowed.register(dataclasses.replace(variant, fn=slow(variant.fn), bind=None))
        return slowed


def test_auto_precision_takes_fp16_on_the_gpu_where_it_validates_and_is_faster() -> None:
    model = keel.load_model(_mlp(), backend="auto", registry=_registry(_SlowFp32Gpu, _SlowerCpu))
    reference = keel.load_model(_mlp(), backend="reference")
    for seed in range(3):
        got = model.predict(_feeds(seed))["y"]
        assert got.dtype == np.float32
        want = reference.predict(_feeds(seed))["y"]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
    text = model.explain()
    assert text.startswith("precision auto: fp16 on gpu: relative error "), text
    assert "(tolerance 5e-03)" in text
    assert model.plan.precision == "fp16"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_auto_precision_takes_bf16_where_fp16_overflows() -> None:
    proto = onnx.load_from_string(_mlp())
    for init in proto.graph.initializer:          # products past fp16's 65504
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 300.0, init.name))
    data = proto.SerializeToString()
    model = keel.load_model(data, backend="auto", registry=_registry(_SlowFp32Gpu, _SlowerCpu))
    got = model.predict(_feeds(0))["y"]
    want = keel.load_model(data, backend="reference").predict(_feeds(0))["y"]
    assert got.dtype == np.float32
    # bfloat16 keeps float32's range: within the tolerance, where fp16 overflowed
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
    text = model.explain()
    assert text.startswith("precision auto: bf16 on gpu: fp16 relative error inf against "
                           "fp32 on these inputs (tolerance 5e-03)"), text
    assert "; bf16 relative error " in text
    assert model.plan.precision == "bf16"


def test_auto_precision_keeps_fp32_where_neither_half_is_accurate() -> None:
    # (x + 3000) - 3000: fp16 keeps x to 2 (its step at 3000), bfloat16 to 16
    shift = numpy_helper.from_array(np.full((1, 8), 3000.0, np.float32), "shift")
    nodes = [helper.make_node("Add", ["x", "shift"], ["s"]),
             helper.make_node("Sub", ["s", "shift"], ["y"])]
    graph = helper.make_graph(nodes, "cancel", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 8])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, 8])], [shift])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = keel.load_model(data.SerializeToString(), backend="auto",
                            registry=_registry(_SlowFp32Gpu, _SlowerCpu))
    got = model.predict(_feeds(0))["y"]
    np.testing.assert_allclose(got, _feeds(0)["x"], rtol=1e-3, atol=1e-3)
    text = model.explain()
    assert "precision auto: fp32 kept: fp16 relative error " in text, text
    assert "; bf16 relative error 1.0e+00 against fp32" in text
    assert model.plan.precision not in ("fp16", "bf16")


def test_a_model_planned_for_a_given_hardware_profile_is_never_measured_here() -> None:
    from keel.hardware import probe

    model = keel.load_model(_mlp(), backend="auto", registry=_registry(_SlowGpu),
                            hardware=probe())
    model.predict(_feeds(0))
    assert "placement measured here" not in model.explain()
