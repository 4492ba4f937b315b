"""Backend.plan_node: each backend's planner returns a frozen NodePlan, placement stores it,
the program hands it to the kernel, and the plan shows every field with its reason."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest

import keel
from keel.backends.base import DeviceKind, KernelContext
from keel.backends.cpu import native_gemm
from keel.backends.cpu.backend import CpuBackend
from keel.backends.cpu.kernels import load
from keel.backends.gpu import kernels as gpu_kernels
from keel.backends.gpu import planner as gpu_planner
from keel.backends.plan import FIELDS, Measured, NodePlan, PlanRequest
from keel.backends.reference.backend import ReferenceBackend
from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.hardware.fakes import fake_profile
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType
from keel.testing.models import make_inputs, mobilenet_block, resnet_block

F32 = DType.FLOAT32
CONV_3X3 = ((1, 64, 56, 56), (64, 64, 3, 3))


def _types(*shapes: tuple[int, ...]) -> list[TensorType | None]:
    return [TensorType(F32, s) for s in shapes]


def _conv_attrs(**attrs: Any) -> dict[str, Any]:
    return dict(get_schema(Op.CONV).normalize_attrs(attrs))


def test_cpu_plan_has_every_field_and_a_reason_for_each() -> None:
    plan = CpuBackend(threads=2).plan_node(Op.CONV, _types(*CONV_3X3),
                                           _conv_attrs(pads=(1, 1, 1, 1)), precision="fp32")
    assert plan.variant in load().variants(Op.CONV)
    assert plan.threads == 2 and plan.precision == "fp32"
    assert {f for f, _ in plan.reasons} >= set(FIELDS)
    assert all(plan.reason(f) for f in FIELDS)
    data = json.loads(json.dumps(plan.to_dict()))
    assert set(FIELDS) <= set(data) and set(data["reasons"]) >= set(FIELDS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.variant = "im2col"  # type: ignore[misc]


def test_a_measured_choice_overrides_the_rules_and_says_so() -> None:
    measured = Measured("im2col", "measured on this machine: im2col 1.31x faster than winograd")
    plan = CpuBackend().plan_node(Op.CONV, _types(*CONV_3X3), _conv_attrs(pads=(1, 1, 1, 1)),
                                  measured=measured)
    assert plan.variant == "im2col" and plan.reason("variant") == measured.reason
    # A measured variant this backend lacks is ignored: the rules decide.
    odd = Measured("quantum", "measured elsewhere")
    plan = CpuBackend().plan_node(Op.RELU, _types((4,)), {}, measured=odd)
    assert plan.variant != "quantum" and plan.reason("variant") != odd.reason


def test_backend_without_a_planner_takes_the_priority_choice() -> None:
    plan = ReferenceBackend().plan_node(Op.RELU, _types((4,)), {})
    assert plan == NodePlan("default", threads=plan.threads)
    assert plan.reason("variant") == "relu: the only reference kernel"


def test_gpu_planner_has_its_own_rules_not_the_cpus() -> None:
    table = gpu_kernels.load()
    req = PlanRequest(Op.CONV, tuple(_types(*CONV_3X3)), _conv_attrs(pads=(1, 1, 1, 1)))
    plan = gpu_planner.plan(req, table)
    assert plan.variant == "im2col" and "not measured on a GPU" in plan.reason("variant")
    one = PlanRequest(Op.CONV, tuple(_types((1, 8, 5, 5), (4, 8, 1, 1))), _conv_attrs())
    assert gpu_planner.plan(one, table).variant == "pointwise"
    mm = PlanRequest(Op.MATMUL, tuple(_types((3, 4), (4, 5))), {})
    plan = gpu_planner.plan(mm, table)
    assert plan.variant == "cublas" and plan.threads is None
    wide = PlanRequest(Op.MATMUL, (TensorType(DType.FLOAT64, (3, 4)),
                                   TensorType(DType.FLOAT64, (4, 5))), {})
    plan = gpu_planner.plan(wide, table)
    assert plan.variant == "default" and plan.threads is None
    if "native" in table.variants(Op.MATMUL):
        assert "native (needs a host tier" in plan.reason("variant")


def test_op_level_run_asks_the_planner_and_agrees_with_a_named_variant() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 12, 12)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    attrs = _conv_attrs(pads=(1, 1, 1, 1))
    cpu = CpuBackend(threads=1)
    plan = cpu.plan_node(Op.CONV, _types(x.shape, w.shape), attrs)
    by_default = cpu.run(Op.CONV, [x, w], attrs=attrs)[0]
    by_name = cpu.run(Op.CONV, [x, w], attrs=attrs, variant=plan.variant)[0]
    assert by_default.tobytes() == by_name.tobytes()
    # The default kernel runs the plan it is handed, not a choice of its own.
    ctx = KernelContext(np, "cpu", DeviceKind.CPU, 1,
                        plan=NodePlan("im2col", reasons=(("variant", "test"),)))
    forced = load().get(Op.CONV).fn(ctx, [x, w], attrs, None)[0]
    named = cpu.run(Op.CONV, [x, w], attrs=attrs, variant="im2col")[0]
    assert forced.tobytes() == named.tobytes()


@pytest.mark.parametrize("build", [resnet_block, mobilenet_block])
def test_placement_stores_the_plan_and_the_program_binds_it(build: Any) -> None:
    model = keel.load_model(build().SerializeToString(), backend="cpu")
    feeds = make_inputs(build(), 2)
    out = model.predict(feeds)
    reference = keel.load_model(build().SerializeToString(), backend="reference")
    want = reference.predict(feeds)
    for name, value in out.items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-4)
    for node in model.plan.nodes:
        assert node.plan is not None and node.plan.variant == node.variant
    program = next(p.program for p in model._cache.values() if p.program is not None)
    bound = {s.name: s.ctx.plan for s in program._steps if s.ctx is not None}
    assert bound and all(bound[n.name] is n.plan for n in model.plan.nodes if n.name in bound)
    nodes = json.loads(model.plan.to_json())["nodes"]
    assert all(set(FIELDS) <= set(n["plan"]) for n in nodes)
    text = model.explain()
    header = next(line for line in text.splitlines() if line.startswith("node "))
    assert header.split() == ["node", "op", "backend", "variant", "layout", "threads",
                              "precision"]                # each reason wraps under its row
    assert "    why: " in text
    assert "node plans:" in text and "blas_threads:" in text and "workspace_bytes:" in text


def test_conv_layouts_chunks_and_workspace_are_in_the_plan() -> None:
    cpu = CpuBackend(threads=1)
    table = load()
    pads = _conv_attrs(pads=(1, 1, 1, 1))
    im2col = cpu.plan_node(Op.CONV, _types((4, 16, 20, 20), (16, 16, 3, 3)), pads,
                           measured=Measured("im2col", "test"))
    assert im2col.layout in ("wide", "compact", "wide-stacked", "compact-stacked")
    assert im2col.chunk is not None and 1 <= im2col.chunk <= 4
    assert im2col.workspace_bytes is not None and im2col.workspace_bytes > 0
    assert "per chunk" in im2col.reason("chunk")
    winograd = cpu.plan_node(Op.CONV, _types((32, 64, 56, 56), (64, 64, 3, 3)), pads,
                             measured=Measured("winograd", "test"))
    assert winograd.chunk is not None and winograd.chunk < 32   # 4 MiB of tiles per chunk
    if "native" in table.variants(Op.CONV) and native_gemm.available():
        # Stores bypass the cache for an output at least the last-level cache of the
        # machine planned for: the 51 MB output of the big conv fills the Ryzen 5800X's
        # 32 MiB, not the Xeon 8480+'s 105 MiB.
        for machine, streams in (("container-2core-1gib", True), ("x86-avx512-server", None)):
            profile = fake_profile(machine)
            big = cpu.plan_node(Op.CONV, _types((32, 32, 112, 112), (32, 32, 3, 3)), pads,
                                profile=profile, measured=Measured("native", "test"))
            assert big.layout and big.option("stream_stores") is streams, machine
            small = cpu.plan_node(Op.CONV, _types((1, 8, 8, 8), (8, 8, 3, 3)), pads,
                                  profile=profile, measured=Measured("native", "test"))
            assert small.layout and small.option("stream_stores") is None, machine
    # Symbolic shapes: no layout yet, decided from the real shapes at the first call.
    symbolic = cpu.plan_node(Op.CONV, [TensorType(F32, ("n", 16, 20, 20)),
                                       TensorType(F32, (16, 16, 3, 3))], pads,
                             measured=Measured("im2col", "test"))
    assert symbolic.layout == "" and "first call" in symbolic.reason("layout")


def test_a_node_plan_reads_back_from_its_dict() -> None:
    plan = CpuBackend(threads=2).plan_node(
        Op.CONV, _types((8, 96, 56, 56), (96, 1, 3, 3)),
        _conv_attrs(group=96, pads=(1, 1, 1, 1)), precision="fp32")
    data = json.loads(json.dumps(plan.to_dict()))
    again = NodePlan.from_dict(data)
    assert again == plan and again.reasons == plan.reasons
    assert again.option("depthwise_block") == plan.option("depthwise_block")
    with pytest.raises(InvalidArgumentError, match="a node plan needs exactly the fields"):
        NodePlan.from_dict({"variant": "im2col"})


@pytest.mark.parametrize(("make", "threads", "precision"), [
    ("transformer_encoder", 2, "auto"), ("lenet", 2, "auto"), ("mlp", 1, "auto"),
    ("mlp", 2, "fp64")])            # fp64: BLAS does the products, on every thread
def test_every_node_plan_shows_the_program_blas_decision(make: str, threads: int,
                                                         precision: str) -> None:
    from keel.testing import models

    proto = getattr(models, make)()
    model = keel.load_model(proto, backend="cpu", threads=threads, precision=precision)
    model.predict(models.make_inputs(proto, batch=2))       # compiles the program
    plans = [n.plan for n in model.plan.nodes if n.plan is not None]
    decided = {(p.blas_threads, p.reason("blas_threads")) for p in plans}
    assert len(decided) == 1                                # one decision per program
    ((count, why),) = decided
    if count is None:
        assert "no step on this backend may call BLAS" in why
        assert "cpu threads:" not in model.explain()
    else:
        assert count in range(1, threads + 1)
        assert f"BLAS on {count} thread" in why


@pytest.mark.parametrize(("threads", "pieces"), [(2, 2), (16, 16)])
def test_a_float_max_pool_plan_says_how_its_planes_split(threads: int, pieces: int) -> None:
    """ResNet-18's 3x3 stride-2 pool: its 64 planes over the threads, on the row kernel."""
    attrs = {"kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}
    plan = CpuBackend(threads=threads).plan_node(Op.MAX_POOL, _types((1, 64, 112, 112)), attrs)
    why = plan.reason("threads")
    assert f"planes 64 unit(s) in {pieces} piece(s)" in why
    assert "row kernel (max_pool_by_rows)" in why
    one = CpuBackend(threads=1).plan_node(Op.MAX_POOL, _types((1, 64, 112, 112)), attrs)
    assert "piece(s)" not in one.reason("threads")
    wide = dict(attrs, strides=(1, 1))          # stride 1 across: the band copies
    assert "band copies" in CpuBackend(threads=2).plan_node(
        Op.MAX_POOL, _types((1, 64, 112, 112)), wide).reason("threads")
