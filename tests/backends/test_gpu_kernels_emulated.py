"""The gpu backend's own variants, end to end on an emulating CuPy (no GPU needed).

``tests.backends.fakes.EmulatedCupy`` runs a NumPy twin of each of keel's CUDA
kernels with the same argument list, so every conformance case the gpu planner
gives an own variant runs through the real planner, kernel table and Python
code, against the reference backend. What this cannot check is the CUDA code
itself: ``test_gpu_variant_matches_reference`` in the conformance suite runs
the same cases on a real GPU.
"""

from __future__ import annotations

import pytest

from keel.backends.gpu.backend import GpuBackend
from keel.backends.plan import request_types
from keel.backends.registry import builtin_registry
from keel.ops.registry import Op
from tests.backends.fakes import EmulatedCupy
from tests.conformance.harness import (
    OpCase,
    assert_outputs_match,
    case_inputs,
    collect_cases,
    run_case,
)

GPU = GpuBackend(cupy_module=EmulatedCupy())
REFERENCE = builtin_registry().instance("reference")


def _own_cases() -> list[pytest.param]:  # type: ignore[valid-type]
    params = []
    for case in collect_cases():
        own = {n for n, kv in GPU.kernels.variants(case.op).items() if kv.meta.get("gpu")}
        if own:
            chosen = GPU.plan_node(case.op, request_types(case_inputs(case)), case.attrs).variant
            if chosen in own:
                params.append(pytest.param(case, chosen, id=f"{case.id}-{chosen}"))
    return params


@pytest.mark.parametrize(("case", "variant"), _own_cases())
def test_own_variant_on_the_emulated_device(case: OpCase, variant: str) -> None:
    expected = run_case(REFERENCE, case)
    for strided in (False, True):
        got = run_case(GPU, case, make_strided=strided, variant=variant)
        assert_outputs_match(got, expected, case, f" ({variant}, strided={strided})")
    if case.op is Op.MAX_POOL:
        arrays = [GPU.to_device(x) for x in case_inputs(case)]
        y = GPU.allocate(expected[0].shape, expected[0].dtype.name)
        GPU.run(case.op, arrays, [y], case.attrs, variant=variant)
        assert_outputs_match([GPU.read(y)], expected[:1], case, " (Y only)")


def test_every_own_kernel_family_is_exercised() -> None:
    ran = {(p.values[0].op, p.values[1]) for p in _own_cases()}
    for op in GPU.kernels.ops():
        for name, kv in GPU.kernels.variants(op).items():
            if kv.meta.get("gpu") and name != "default":
                assert (op, name) in ran, f"{op.value}/{name} has no case it is planned for"
