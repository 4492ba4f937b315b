"""The webgpu backend's planner: how a node runs on a WebGPU adapter, and whether auto
placement may choose the adapter at all.

Variants: a convolution with one input channel per group (depthwise) runs
``direct`` (one invocation per output: the implicit GEMM's reduction would be
KH*KW long, its tiles mostly empty), and so does a 3-D one (the implicit-GEMM
shader tiles 1-D and 2-D windows only); every other op runs its default kernel.
Declared, not measured (``keel tune`` overrides through ``PlanRequest.measured``).

Auto placement: :func:`auto_blocked` says why the adapter is not a candidate.
A CPU adapter (llvmpipe, SwiftShader) never is: it runs the same CPU cores as
the cpu backend through a software rasterizer. A GPU adapter is a candidate
only where ``keel calibrate --gpu webgpu`` measured it ahead of the cpu backend
for the op's group, from the measured input size on; without a measurement it
is not. (webgpu is also outside the default priority chain: these rules apply
once it is put in the chain.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.backends.base import KernelTable
from keel.backends.plan import NodePlan, PlanRequest, choose_by_priority, field_reasons
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["Measured", "auto_blocked", "choose_variant", "plan"]

_EVIDENCE = "declared, not measured on a GPU"


def plan(request: PlanRequest, table: KernelTable) -> NodePlan:
    """Every decision about how one webgpu node runs, each with its reason."""
    usable = table.variants(request.op)
    measured = request.measured
    if measured is not None and measured.variant in usable:
        variant, why = measured.variant, measured.reason
    elif request.op is Op.CONV and "direct" in usable and _depthwise(request):
        variant, why = "direct", ("depthwise conv: one invocation per output; an implicit "
                                  f"GEMM's reduction would be one window long ({_EVIDENCE})")
    elif request.op is Op.CONV and "direct" in usable and _spatial_rank(request) > 2:
        variant, why = "direct", ("3-D conv: the implicit-GEMM shader tiles 1-D and 2-D "
                                  "windows only; the direct shader runs up to 3 spatial dims")
    else:
        variant, why = choose_by_priority(request.op, usable, request.dtype, table.backend)
    return NodePlan(
        variant=variant, threads=None, precision=request.precision,
        reasons=field_reasons(
            variant=why,
            threads="not applicable: the adapter schedules its own invocations",
            blas_threads="not applicable: WGSL kernels, no BLAS"))


def choose_variant(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                   table: KernelTable) -> tuple[str, str]:
    found = plan(PlanRequest(op, tuple(input_types), dict(attrs)), table)
    return found.variant, found.reason("variant")


def _spatial_rank(request: PlanRequest) -> int:
    x = request.input_types[0] if request.input_types else None
    return 0 if x is None or x.shape is None else len(x.shape) - 2


def _depthwise(request: PlanRequest) -> bool:
    types = request.input_types
    x = types[0] if types else None
    w = types[1] if len(types) > 1 else None
    if x is None or w is None or x.shape is None or w.shape is None or len(x.shape) < 2:
        return False
    group = int(request.attrs.get("group", 1))
    return group > 1 and x.shape[1] == group and w.shape[1] == 1


@dataclass(frozen=True)
class Measured:
    """A calibrated webgpu crossover: the input size from which it beat the cpu backend
    (None: it never did in the measured range), and where that was measured."""

    crossover: int | None
    source: str


def auto_blocked(adapter: Any, measured: Measured | None, nbytes: int) -> str | None:
    """Why auto placement does not put an op with ``nbytes`` of input on this adapter
    (None: it may), given what ``keel calibrate --gpu webgpu`` measured for its group."""
    if adapter is None:
        return "no WebGPU adapter"
    if adapter.is_cpu:
        return (f"adapter {adapter.label()} is a CPU adapter (a software rasterizer on the "
                "same cores as the cpu backend): never faster, so auto placement does not "
                "choose it; pin backend='webgpu' to run there")
    if measured is None:
        return (f"adapter {adapter.label()}: no calibration measured it for this op group "
                "(run `keel calibrate --gpu webgpu`); auto placement does not choose it")
    if measured.crossover is None:
        return (f"the calibration ({measured.source}) never found webgpu ahead of the cpu "
                "backend for this op group")
    if nbytes < measured.crossover:
        return (f"{nbytes} bytes of input is under the calibrated webgpu crossover of "
                f"{measured.crossover} bytes ({measured.source})")
    return None
