"""Every conformance case on every backend, against the reference backend.

For each ``(backend, case)``: the reference result is computed, the backend
runs the case (contiguous inputs, then non-contiguous ones) and must match it
within the case's tolerance, and running it twice must give bitwise-equal
outputs. A backend that is not available here skips with its reason. A case
listed in ``tests/known_failures/<backend>.txt`` is a strict xfail: when it
starts passing, the run fails until the entry is removed.
"""

from __future__ import annotations

import pytest

from keel.backends.base import Backend
from keel.backends.plan import request_types
from keel.backends.registry import builtin_registry
from keel.errors import UnsupportedOperationError
from keel.ops.registry import Op
from tests.conformance.harness import (
    KnownFailures,
    OpCase,
    assert_outputs_match,
    bitwise_equal,
    case_inputs,
    collect_cases,
    run_case,
)

BACKENDS = ("reference", "cpu", "gpu", "webgpu")
CASES = collect_cases()
REGISTRY = builtin_registry()
KNOWN = {name: KnownFailures.load(name) for name in BACKENDS}

_BACKEND_PARAMS = [pytest.param(name, id=name,
                                marks=[pytest.mark.gpu] if name == "gpu" else [])
                   for name in BACKENDS]
_CASE_PARAMS = [pytest.param(case, id=case.id) for case in CASES]


def _available(name: str) -> Backend:
    backend = REGISTRY.instance(name)
    if not backend.is_available():
        pytest.skip(f"backend {name!r} is not available here: {backend.availability().reason}")
    return backend


def _expected(case: OpCase) -> list:
    reference = REGISTRY.instance("reference")
    try:
        return run_case(reference, case)
    except UnsupportedOperationError:
        known = KNOWN["reference"].match(case.op, case.id)
        if known is None:
            raise
        pytest.xfail(f"no reference result (known_failures/reference.txt:{known.line}: "
                     f"{known.reason})")


@pytest.mark.parametrize("case", _CASE_PARAMS)
@pytest.mark.parametrize("backend_name", _BACKEND_PARAMS)
def test_case_matches_reference(backend_name: str, case: OpCase,
                                request: pytest.FixtureRequest) -> None:
    backend = _available(backend_name)
    known = KNOWN[backend_name].match(case.op, case.id)
    if known is not None and known.glob is None and case.op not in backend.kernels:
        # A whole-op entry for an op without a kernel: nothing to run (an entry for an op
        # that has one is stale: test_known_failures_are_not_stale).
        pytest.xfail(f"known_failures/{backend_name}.txt:{known.line}: {known.reason}")
    if known is not None:
        request.applymarker(pytest.mark.xfail(
            reason=f"known_failures/{backend_name}.txt:{known.line}: {known.reason}",
            strict=True))
    expected = _expected(case)
    first = run_case(backend, case)
    assert_outputs_match(first, expected, case)
    second = run_case(backend, case)
    assert bitwise_equal(first, second), \
        f"{case.id}: two runs on {backend_name} differ (not deterministic)"
    assert_outputs_match(run_case(backend, case, make_strided=True), expected, case,
                         " (non-contiguous inputs)")


def _gpu_variant_params() -> list[pytest.param]:  # type: ignore[valid-type]
    """(case, variant) wherever the gpu planner runs a case on a gpu-only variant."""
    gpu = REGISTRY.instance("gpu")
    params = []
    for case in CASES:
        own = {n for n, kv in gpu.kernels.variants(case.op).items()
               if kv.meta.get("gpu") and n != "default"}
        if not own:
            continue
        chosen = gpu.plan_node(case.op, request_types(case_inputs(case)), case.attrs).variant
        if chosen in own:
            params.append(pytest.param(case, chosen, id=f"{case.id}-{chosen}",
                                       marks=[pytest.mark.gpu]))
    return params


@pytest.mark.parametrize(("case", "variant"), _gpu_variant_params())
def test_gpu_variant_matches_reference(case: OpCase, variant: str) -> None:
    """The gpu backend's own kernels, on every case its planner gives them."""
    backend = _available("gpu")
    expected = _expected(case)
    first = run_case(backend, case, variant=variant)
    assert_outputs_match(first, expected, case, f" (gpu variant {variant})")
    second = run_case(backend, case, variant=variant)
    assert bitwise_equal(first, second), f"{case.id}: two runs of gpu/{variant} differ"
    assert_outputs_match(run_case(backend, case, make_strided=True, variant=variant), expected,
                         case, f" (gpu variant {variant}, non-contiguous inputs)")
    if case.op is Op.MAX_POOL:     # Y alone: the variant's own kernel (Indices: the shared one)
        arrays = [backend.to_device(x) for x in case_inputs(case)]
        y = backend.allocate(expected[0].shape, expected[0].dtype.name)
        backend.run(case.op, arrays, [y], case.attrs, variant=variant)
        assert_outputs_match([backend.read(y)], expected[:1], case, f" (gpu {variant}, Y only)")


# ---- the suite itself ---------------------------------------------------------

def test_cases_were_collected() -> None:
    assert CASES, "no tests/conformance/cases_*.py module defines CASES"


def test_case_ids_are_unique() -> None:
    seen: dict[str, int] = {}
    for case in CASES:
        seen[case.id] = seen.get(case.id, 0) + 1
    assert [i for i, n in seen.items() if n > 1] == []


def test_seed_001_ops_have_cases() -> None:
    from keel.ops.registry import OpGroup

    covered = {case.op for case in CASES}
    missing = sorted(op.value for op in OpGroup.SEED_GPU_PROFILE - covered)
    assert missing == [], f"seed-001 ops without a conformance case: {missing}"


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_every_op_without_a_kernel_is_listed(backend_name: str) -> None:
    """An op the backend lacks must have a whole-op entry in its known-failure file."""
    table = REGISTRY.instance(backend_name).kernels
    listed = KNOWN[backend_name].whole_ops()
    missing = sorted(op.value for op in Op if op not in table and op not in listed)
    assert missing == [], (
        f"{backend_name} has no kernel for {missing}; implement them or list each in "
        f"tests/known_failures/{backend_name}.txt as 'op  reason'")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_known_failures_are_not_stale(backend_name: str) -> None:
    """A whole-op entry for an op the backend has, with no case to prove it fails, is stale."""
    table = REGISTRY.instance(backend_name).kernels
    ops_with_cases = {case.op for case in CASES}
    stale = sorted(f"line {e.line}: {e.op.value}" for e in KNOWN[backend_name].entries
                   if e.op in table and e.op not in ops_with_cases)
    stale += sorted(f"line {e.line}: {e.op.value}:{e.glob}" for e in KNOWN[backend_name].entries
                    if e.glob is not None
                    and not any(KNOWN[backend_name].match(c.op, c.id) is e for c in CASES))
    assert stale == [], f"known_failures/{backend_name}.txt entries matching nothing: {stale}"


def test_every_kernel_has_a_case() -> None:
    """No kernel without a conformance case: a registered op must prove itself."""
    ops_with_cases = {case.op for case in CASES}
    with_kernels = set().union(*(REGISTRY.instance(b).kernels.ops() for b in BACKENDS))
    missing = sorted(op.value for op in with_kernels - ops_with_cases)
    assert missing == [], f"ops with kernels but no conformance case: {missing}"
