"""The cpu backend sizes BLAS's threads per program by how much of its work BLAS does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keel import load_model
from keel.backends.base import KernelVariant
from keel.backends.cpu import backend as cpu_backend
from keel.backends.cpu.backend import blas_threads
from keel.backends.cpu.planner import BLAS_SHARE_FOR_THREADS
from keel.dtypes import DType
from keel.ops.registry import Op
from tests.execution.test_dispatch import model_proto


def _kernel(*_: Any) -> list[Any]:
    return []


BLAS = KernelVariant(Op.MATMUL, "default", _kernel)
NATIVE = KernelVariant(Op.MATMUL, "native", _kernel, meta={"requires": "native"})
ELEMENTWISE = KernelVariant(Op.ADD, "default", _kernel)
F32 = DType.FLOAT32


def test_blas_heavy_programs_give_blas_every_thread() -> None:
    threads, why = blas_threads(2, [(BLAS, F32, 90.0), (NATIVE, F32, 10.0)])
    assert threads == 2 and "BLAS kernels do 90% of the work" in why


def test_native_heavy_programs_keep_blas_on_one_thread() -> None:
    threads, why = blas_threads(4, [(BLAS, F32, 8.0), (NATIVE, F32, 92.0), (ELEMENTWISE, F32, 1)])
    assert threads == 1
    assert "BLAS kernels do 8% of the work" in why and "4 keel threads" in why


def test_native_variants_on_other_dtypes_count_as_blas() -> None:
    threads, _ = blas_threads(2, [(NATIVE, DType.FLOAT64, 100.0)])
    assert threads == 2


def test_a_one_thread_cap_is_kept_and_unknown_work_counts_as_blas() -> None:
    assert blas_threads(1, [(NATIVE, F32, 100.0)])[0] == 1
    assert blas_threads(2, [(BLAS, F32, 0.0)])[0] == 2            # shapes unknown: cautious
    assert 0.0 < BLAS_SHARE_FOR_THREADS < 1.0


def _caps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread counts BLAS is capped at from now on, in order (a real ThreadCap runs)."""
    seen: list[int] = []
    real = cpu_backend.ThreadCap.__init__

    def spy(self: cpu_backend.ThreadCap, threads: int) -> None:
        seen.append(threads)
        real(self, threads)

    monkeypatch.setattr(cpu_backend.ThreadCap, "__init__", spy)
    return seen


def test_a_program_runs_under_the_blas_threads_it_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float64 Gemm is all BLAS: the program caps BLAS at the model's threads."""
    seen = _caps(monkeypatch)
    m = load_model(model_proto(np.float64), backend="cpu", threads=2)
    x = np.ones((3, 4), np.float64)
    m.predict({"x": x})
    seen.clear()
    m.predict({"x": x})
    assert seen and seen[0] == 2
    assert "cpu threads: BLAS on 2 threads: BLAS kernels do 100% of the work" in m.explain()


@pytest.mark.parametrize("name", ["depthwise", "winograd"])
def test_conv_variants_with_a_native_form_count_as_native_on_float32(name: str) -> None:
    from keel import native

    if not native.available():
        pytest.skip(f"native tier unavailable: {native.status().reason}")
    conv = KernelVariant(Op.CONV, name, _kernel)
    assert blas_threads(2, [(conv, F32, 90.0), (BLAS, F32, 10.0)])[0] == 1
    assert blas_threads(2, [(conv, DType.FLOAT64, 90.0), (BLAS, F32, 10.0)])[0] == 2


def test_the_program_enters_the_blas_threads_its_plan_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor takes the BLAS decision from the node plans rather than sizing it again:
    a plan edited to one BLAS thread runs on one, with the plan's reason."""
    import dataclasses

    from keel.backends.registry import default_registry
    from keel.execution.program import compile_program
    from keel.graph.importers.onnx import import_onnx
    from keel.graph.shape_inference import infer_graph_types
    from keel.planning.placement import place

    seen = _caps(monkeypatch)
    graph = import_onnx(model_proto(np.float64))
    types = infer_graph_types(graph, {"x": (3, 4)})
    registry = default_registry()
    plan = place(graph, types, registry, backend="cpu")
    decided = {p.plan.blas_threads for p in plan.nodes if p.plan is not None}
    assert decided == {registry.get("cpu").threads}
    edited = dataclasses.replace(plan, nodes=tuple(
        p if p.plan is None else dataclasses.replace(
            p, plan=p.plan.with_field("blas_threads", 1, "edited: one BLAS thread"))
        for p in plan.nodes))
    program = compile_program(graph, edited, types, {"cpu": registry.get("cpu")})
    program.execute([np.ones((3, 4), np.float64)])     # the first run binds the arena
    seen.clear()
    program.execute([np.ones((3, 4), np.float64)])
    assert seen and set(seen) == {1}             # the program and the BLAS call: both 1
    assert program.scope_reasons == {"cpu": "edited: one BLAS thread"}
