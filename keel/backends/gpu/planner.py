"""The gpu backend's planner: how a node runs on the GPU, decided here and only here.

The gpu backend has kernels of its own (``keel.backends.gpu.kernels.FAMILIES``:
cuBLAS GEMMs with fused epilogues, fused CUDA row kernels for LayerNorm and
softmax, elementwise activations, direct pooling) and runs the cpu's xp kernels
through CuPy for everything else, but never the cpu's choices among them: those
rules were measured against OpenBLAS on a CPU and say nothing about a GPU. Until
GPU measurements exist (``keel tune`` on a GPU machine overrides these through
``PlanRequest.measured``), the rules here are declared, not measured, and say so:

* variants that need a host tier (``requires="native"``: compiled CPU
  kernels) are never chosen: they would only fall back to the xp path;
* a gpu-only variant (``gpu=True`` in its metadata) runs wherever it takes the
  node's dtype (and, for LayerNorm, its float32 statistics): one fused kernel
  instead of the several CuPy passes of the shared xp kernel; ``KEEL_GPU_KERNELS=off``
  turns them all down (the shared xp kernels run, e.g. to compare the two);
* a convolution runs ``cudnn`` (one fused cuDNN graph per shape, through
  nvidia-cudnn-frontend: :mod:`~keel.backends.gpu.cudnn_graph`) where the
  package and the cuDNN library load (checked once, the reason kept) and the
  conv is 1-3-D float16/bfloat16/float32; otherwise ``pointwise`` where it is a 1x1
  stride-1 unpadded dense conv (one GEMM on the input, no copy) and ``im2col``
  (one cuBLAS GEMM per group; it serves every conv), saying why not cudnn;
* any other op runs the shared xp kernel (``default``).

Launch shapes are decided here too: threads per row of a row kernel
(:func:`row_threads`) and per block of an elementwise one
(:func:`elementwise_threads`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from keel.backends.base import KernelTable, KernelVariant
from keel.backends.gpu import cudnn_graph, cudnn_lib
from keel.backends.plan import (
    NodePlan,
    PlanRequest,
    field_reasons,
    skipped_note,
)
from keel.config import settings
from keel.ops.registry import Op
from keel.ops.types import TensorType

__all__ = ["HOST_TIERS", "choose_variant", "elementwise_threads", "plan", "row_threads"]

# Tiers of compiled CPU kernels: their variants never run on the GPU.
HOST_TIERS = frozenset({"native"})
_CONV = frozenset({Op.CONV})
_EVIDENCE = "declared, not measured on a GPU"
# keel's cudnn conv against its xp variants, same process (H100, CuPy 14.2, cuDNN 9.19,
# float32, batch 32, ResNet-18 and MobileNetV2 conv shapes, with bias and activation):
# 64->64 3x3 0.31 ms vs im2col 3.3 ms, the 7x7 stem 0.49 vs 9.7, a stride-2 depthwise
# 0.26 vs 7.4, a 1x1 expand 0.24 vs pointwise 0.38; at batch 1 1.7-6x faster.
_CUDNN_EVIDENCE = "measured on an H100: 1.6-28x faster than pointwise/im2col"
# Row kernels: about this many elements per thread, in whole warps, at most a full block.
ROW_ELEMENTS_PER_THREAD = 4
WARP = 32
MAX_BLOCK = 1024
# Threads per block of a one-thread-per-element kernel (pooling windows).
ELEMENTWISE_BLOCK = 256
# Ops whose gpu-only variant computes statistics in float32: only for stash_type 1.
_STASHED = frozenset({Op.LAYER_NORM, Op.SKIP_LAYER_NORM})


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
        variant, why = _gpu_variant(request, usable)
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


def _gpu_variant(request: PlanRequest, usable: Mapping[str, KernelVariant]
                 ) -> tuple[str, str]:
    """The gpu-only variant where it serves the node, else the shared xp kernel."""
    op, dtype = request.op, request.dtype
    declined = []
    own_kernels = settings().gpu_kernels
    for name, kv in sorted(usable.items()):
        if not kv.meta.get("gpu") or name == "default":
            continue
        if not own_kernels:
            declined.append(f"{name}: KEEL_GPU_KERNELS=off")
        elif dtype is None or (kv.dtypes is not None and dtype not in kv.dtypes):
            declined.append(f"{name} takes {_dtypes(kv)}, the node is "
                            f"{'of unknown dtype' if dtype is None else dtype.value}")
        elif op in _STASHED and int(request.attrs.get("stash_type", 1)) != 1:
            declined.append(f"{name} keeps float32 statistics, the node asks for stash_type "
                            f"{request.attrs.get('stash_type')}")
        else:
            what = " ".join(kv.description.split()).rstrip(".") or name
            return name, (f"{op.value}: {name}, the gpu's own kernel ({what}) over the shared "
                          f"xp kernel ({_EVIDENCE})")
    own = "the gpu's own" if usable.get("default") is not None and usable[
        "default"].meta.get("gpu") else "the shared xp"
    why = f"{op.value}: {own} kernel through CuPy; the cpu's variant rules do not apply here"
    return "default", why + (f" (not taken: {'; '.join(declined)})" if declined else "")


def _dtypes(kv: KernelVariant) -> str:
    return ", ".join(sorted(d.value for d in kv.dtypes or ()))


def row_threads(node_plan: NodePlan | None, k: int) -> int:
    """Threads per row of a row kernel (LayerNorm, softmax, row reductions) of ``k``
    elements: about ROW_ELEMENTS_PER_THREAD each, whole warps, at most one full block
    (the node plan's ``row_threads`` option where it has one)."""
    given = None if node_plan is None else node_plan.option("row_threads")
    if given:
        return int(given)
    warps = -(-max(k, 1) // (WARP * ROW_ELEMENTS_PER_THREAD))
    return min(MAX_BLOCK, WARP * warps)


def elementwise_threads(node_plan: NodePlan | None) -> int:
    """Threads per block of a kernel with one thread per output element."""
    given = None if node_plan is None else node_plan.option("block_threads")
    return int(given) if given else ELEMENTWISE_BLOCK


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
