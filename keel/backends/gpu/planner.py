"""The gpu backend's planner: how a node runs on the GPU, decided here and only here.

The gpu backend runs the cpu's xp kernels through CuPy, but not the cpu's
choices among them: those rules were measured against OpenBLAS on a CPU and
say nothing about a GPU. Until GPU measurements exist (``keel tune`` on a GPU
machine overrides these through ``PlanRequest.measured``), the rules here are
declared, not measured, and say so:

* variants that need a host tier (``requires="native"``: compiled CPU
  kernels) are never chosen: they would only fall back to the xp path;
* a convolution runs ``cudnn`` (one fused cuDNN graph per shape, through
  nvidia-cudnn-frontend: :mod:`~keel.backends.gpu.cudnn_graph`) where the
  package and the cuDNN library load (checked once, the reason kept) and the
  conv is 1-3-D float16/float32; otherwise ``pointwise`` where it is a 1x1
  stride-1 unpadded dense conv (one GEMM on the input, no copy) and ``im2col``
  (one cuBLAS GEMM per group; it serves every conv), saying why not cudnn;
* any other op runs its highest-priority remaining variant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from keel.backends.base import KernelTable, KernelVariant
from keel.backends.gpu import cudnn_graph, cudnn_lib
from keel.backends.plan import (
    NodePlan,
    PlanRequest,
    choose_by_priority,
    field_reasons,
    skipped_note,
)
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["HOST_TIERS", "choose_variant", "plan"]

# Tiers of compiled CPU kernels: their variants never run on the GPU.
HOST_TIERS = frozenset({"native"})
_CONV = frozenset({Op.CONV})
_EVIDENCE = "declared, not measured on a GPU"
# keel's cudnn conv against its xp variants, same process (H100, CuPy 14.2, cuDNN 9.19,
# float32, batch 32, ResNet-18 and MobileNetV2 conv shapes, with bias and activation):
# 64->64 3x3 0.31 ms vs im2col 3.3 ms, the 7x7 stem 0.49 vs 9.7, a stride-2 depthwise
# 0.26 vs 7.4, a 1x1 expand 0.24 vs pointwise 0.38; at batch 1 1.7-6x faster.
_CUDNN_EVIDENCE = "measured on an H100: 1.6-28x faster than pointwise/im2col"


def plan(request: PlanRequest, table: KernelTable) -> NodePlan:
    """Every decision about how one gpu node runs, each with its reason."""
    found = table.variants(request.op)
    skipped = {n: "needs a host tier (compiled CPU kernels)" for n, kv in found.items()
               if kv.meta.get("requires") in HOST_TIERS}
    usable = {n: kv for n, kv in found.items() if n not in skipped}
    measured = request.measured
    if measured is not None and measured.variant in usable:
        variant, why = measured.variant, measured.reason
    elif request.op in _CONV:
        variant, why = _conv_variant(request, usable)
    else:
        variant, why = choose_by_priority(request.op, usable, request.dtype, table.backend)
    return NodePlan(
        variant=variant, threads=None, precision=request.precision,
        reasons=field_reasons(
            variant=why + skipped_note(skipped),
            threads="not applicable: the device schedules its own threads",
            blas_threads="not applicable: cuBLAS on the device"))


def choose_variant(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                   table: KernelTable) -> tuple[str, str]:
    """The variant this planner runs ``op`` with on ``table``, and why."""
    found = plan(PlanRequest(op, tuple(input_types), dict(attrs)), table)
    return found.variant, found.reason("variant")


def _conv_variant(request: PlanRequest, usable: Mapping[str, KernelVariant]
                  ) -> tuple[str, str]:
    """cuDNN where it loads and takes the conv; else one GEMM (``pointwise``) or im2col."""
    w = request.input_types[1] if len(request.input_types) > 1 else None
    kernel = None if w is None or w.shape is None else tuple(w.shape[2:])
    why_not = _cudnn_unusable(request, kernel, usable)
    if why_not is None:
        return "cudnn", (f"{cudnn_lib.LIBRARY.availability().reason}: one fused graph per "
                         "shape (bias, residual, ReLU/clip in the graph where cuDNN takes "
                         "them), its engine measured once per shape (the fastest of cuDNN's "
                         "candidates on the first run; cuDNN's heuristic choice when that "
                         f"run is captured); float32 without TF32 ({_CUDNN_EVIDENCE})")
    note = f"; not cudnn: {why_not}"
    attrs = request.attrs
    unit = kernel is not None and all(k == 1 for k in kernel)
    plain = (all(s == 1 for s in attrs.get("strides") or (1,))
             and not any(attrs.get("pads") or ()) and int(attrs.get("group", 1)) == 1)
    if unit and plain and "pointwise" in usable:
        return "pointwise", f"1x1 stride-1 unpadded dense conv: one GEMM ({_EVIDENCE}){note}"
    if "im2col" in usable:
        return "im2col", f"one cuBLAS GEMM per group serves every conv ({_EVIDENCE}){note}"
    return "default", f"no im2col variant on this table: the default kernel{note}"


def _cudnn_unusable(request: PlanRequest, kernel: tuple[object, ...] | None,
                    usable: Mapping[str, KernelVariant]) -> str | None:
    """Why the cudnn conv variant cannot run this node; None when it can."""
    if "cudnn" not in usable:
        return "no cudnn variant on this table"
    avail = cudnn_lib.LIBRARY.availability()
    if not avail.available:
        return avail.reason
    return cudnn_graph.cannot_serve(None if kernel is None else len(kernel), request.dtype)
