"""The cpu backend's planner: every decision about how a cpu node runs, in one place.

``plan`` (the cpu backend's ``_plan_node``) turns a node's op, input types,
attributes and the planning context into a :class:`~keel.backends.plan.NodePlan`.
The decisions and their thresholds live here as data with the evidence they
came from (the machine, the measurement): the conv variants' rules
(:class:`~keel.backends.cpu.conv_rules.ConvRule`, with their evidence tables),
the forms of the depthwise and native conv kernels, and the scheme a bound
depthwise call runs. Kernel modules execute what the plan says; where a kernel
runs without a plan (a direct call), it asks the functions here, so a plan and
a plain run make the same choice.

Evidence was measured on a 2-core AMD EPYC (AVX-512) with OpenBLAS
unless a rule says otherwise; ``keel tune`` measures on the running machine
and overrides these rules (``PlanRequest.measured``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, ParamSpec, TypeVar

from keel.backends import planner_constants
from keel.backends.base import KernelTable, KernelVariant
from keel.backends.cpu import (
    conv_epilogue,
    conv_gemm,
    depthwise,
    native_blocked,
    native_gemm,
    native_window,
    thread_costs,
    window,
)
from keel.backends.cpu.conv_rules import ConvCase, ConvRule, conv_case, pick
from keel.backends.plan import (
    LayoutDecision,
    NodePlan,
    PlanRequest,
    choose_by_priority,
    field_reasons,
    skipped_note,
    tier_unavailable,
    usable_variants,
)
from keel.config import settings
from keel.dtypes import DType
from keel.errors import KeelError
from keel.native.pool import parts
from keel.ops.registry import Op
from keel.ops.schemas.conv import ConvGeometry, conv2d_attrs, conv_geometry
from keel.ops.schemas.pooling import pool_window
from keel.ops.types import TensorType

__all__ = ["RULES", "TIER_RULES", "available_rules", "choose_variant", "conv_call_variant",
           "exact_conv_variant", "numa_pinning", "plan", "plan_branches"]

CONV_OPS = frozenset({Op.CONV, Op.CONV2D, Op.CONV_INTEGER})
# What the native depthwise form measured (quoted in the depthwise rule and reasons).
DEPTHWISE_NATIVE_SPEEDUP = ("ran in 0.27x the NumPy forms' time at batch 1 and 8, 1.00x "
                            "onnxruntime's at batch 1 and 0.67x at batch 8")

# ---- the conv variants' rules --------------------------------------------------------
# winograd time / im2col time for C->C 3x3 pad-1 convs with bias and ReLU
# (channels, output side, batch, ratio): 2-core AMD EPYC, OpenBLAS, 1 thread,
# prepacked weights, interleaved runs, median of 5 passes.
_WINOGRAD_EVIDENCE = (
    (16, 32, 1, 1.88), (32, 16, 1, 1.40), (64, 8, 1, 1.12), (64, 14, 1, 1.01),
    (64, 28, 1, 0.81), (64, 56, 1, 0.72), (128, 14, 1, 0.81), (128, 28, 1, 0.66),
    (128, 56, 1, 0.70), (256, 7, 1, 1.31), (256, 14, 1, 0.74), (512, 7, 1, 1.32),
    (16, 32, 4, 1.50), (32, 16, 4, 1.06), (64, 8, 4, 0.83), (64, 14, 4, 0.70),
    (64, 56, 4, 0.76), (128, 14, 4, 0.60), (256, 7, 4, 0.80), (512, 7, 4, 0.85),
    (16, 32, 32, 1.41), (32, 16, 32, 0.86), (64, 8, 32, 0.57), (64, 56, 32, 0.74),
    (128, 28, 32, 0.63), (256, 14, 32, 0.63), (256, 7, 32, 0.82), (512, 7, 32, 0.79),
)

# native (implicit GEMM) time / the best other variant's time (Winograd with compiled
# transforms, or im2col) for C->C 3x3 pad-1 convs with bias and ReLU (channels, output
# side, batch, ratio): 2-core AMD EPYC (Zen 4), 1 thread, prepacked weights,
# interleaved runs, medians.
_NATIVE_EVIDENCE = (
    (16, 32, 1, 0.76), (16, 32, 4, 0.63), (16, 32, 32, 0.61), (32, 16, 1, 0.75),
    (32, 16, 4, 0.72), (32, 16, 32, 0.65), (64, 8, 1, 0.74), (64, 8, 4, 0.72),
    (64, 8, 32, 0.70), (32, 32, 1, 0.97), (32, 32, 4, 1.00), (32, 32, 32, 0.94),
    (64, 16, 1, 0.98), (64, 16, 4, 1.01), (64, 16, 32, 1.03), (64, 28, 1, 1.34),
    (64, 28, 4, 1.20), (64, 28, 32, 1.34), (64, 56, 1, 1.30), (64, 56, 4, 1.32),
    (64, 56, 32, 1.39), (128, 14, 1, 1.13), (128, 14, 4, 1.41), (128, 14, 32, 1.55),
    (128, 28, 1, 1.55), (128, 28, 4, 1.47), (128, 28, 32, 1.59), (256, 7, 1, 1.29),
    (256, 7, 4, 1.40), (256, 7, 32, 1.33), (256, 14, 1, 1.38), (256, 14, 4, 1.58),
    (256, 14, 32, 1.74), (512, 7, 1, 1.46), (512, 7, 4, 1.64), (512, 7, 32, 1.69),
)
# Winograd with compiled transforms (winograd.c) / im2col time, the same convs.
_WINOGRAD_NATIVE_EVIDENCE = (
    (16, 32, 1, 1.13), (16, 32, 4, 0.93), (16, 32, 32, 0.86), (32, 16, 1, 1.08),
    (32, 16, 4, 0.94), (32, 16, 32, 0.77), (64, 8, 1, 1.05), (64, 8, 4, 0.89),
    (64, 8, 32, 0.86), (32, 32, 1, 0.77), (32, 32, 4, 0.65), (32, 32, 32, 0.73),
    (64, 16, 1, 0.79), (64, 16, 4, 0.71), (64, 16, 32, 0.66), (64, 28, 1, 0.60),
    (64, 28, 4, 0.66), (64, 28, 32, 0.61), (64, 56, 1, 0.60), (64, 56, 4, 0.60),
    (64, 56, 32, 0.61), (128, 14, 1, 0.78), (128, 14, 4, 0.62), (128, 14, 32, 0.56),
    (128, 28, 1, 0.58), (128, 28, 4, 0.60), (128, 28, 32, 0.57), (256, 7, 1, 0.75),
    (256, 7, 4, 0.74), (256, 7, 32, 0.80), (256, 14, 1, 0.67), (256, 14, 4, 0.60),
    (256, 14, 32, 0.56), (512, 7, 1, 0.66), (512, 7, 4, 0.68), (512, 7, 32, 0.67),
)
_NATIVE_MEASURED = (
    "2-core AMD EPYC (Zen 4, AVX-512), 1 thread, prepacked weights, interleaved medians "
    "on a shared machine (+-10 %): native/best-other time (Winograd with compiled "
    "transforms, or im2col) 0.61-0.76 for 3x3 convs up to 32 channels on 16x16 and "
    "smaller, 0.94-1.00 on 32x32, 0.70-0.74 at 64 channels on 8x8, 0.98-1.03 on 16x16, "
    "1.2-1.4 from 28x28 and 1.1-1.7 from 128 channels (Winograd wins there); "
    "3x3 stride 2 0.71-0.86; 1x1 stride 2 0.76-0.97")


RULES: dict[str, ConvRule] = {
    "winograd": ConvRule(
        "winograd", 30, "Winograd F(2x2,3x3): 2.25x fewer multiplies than im2col",
        ranks=(2,), kernel=(3, 3), strides=(1, 1), dilations=(1, 1), groups="one",
        dtypes=frozenset({"float32", "float64"}), wins_where=((64, 196), (32, 4096)),
        measured="2-core AMD EPYC (AVX-512), OpenBLAS, 1 thread, prepacked weights: "
                 "winograd/im2col time 0.57-0.86 from 64 channels and 196 output pixels "
                 "over the batch (49 tiles) up, and for 32 channels from 8192 pixels; "
                 "1.01-1.88 below (16 channels; 7x7 outputs at batch 1)",
        baseline="im2col", evidence=_WINOGRAD_EVIDENCE),
}
# The Winograd rule where its transforms are compiled (the native tier): it then beats
# im2col from 128 channels at any size and from 32 channels on 512 output pixels.
WINOGRAD_NATIVE = ConvRule(
    "winograd", 30, "Winograd F(2x2,3x3), transforms compiled: 2.25x fewer multiplies than "
    "im2col", ranks=(2,), kernel=(3, 3), strides=(1, 1), dilations=(1, 1), groups="one",
    dtypes=frozenset({"float32", "float64"}), wins_where=((128, 1), (32, 512)),
    measured="2-core AMD EPYC (Zen 4, AVX-512), 1 thread, prepacked weights: "
             "winograd/im2col time 0.56-0.80 from 128 channels (7x7 at batch 1 too) and "
             "0.60-0.94 from 32 channels and 512 output pixels over the batch; 1.05-1.13 "
             "on 256 or fewer at batch 1",
    baseline="im2col", evidence=_WINOGRAD_NATIVE_EVIDENCE)
RULES.update({
    "pointwise": ConvRule(
        "pointwise", 20, "1x1 conv as one GEMM on the input, no im2col copy",
        unit_kernel=True, unpadded=True),
    "depthwise": ConvRule(
        "depthwise", 20, "compiled window kernel (native tier); else per-channel gemv over "
        "shifted rows, or one channels-last einsum",
        groups="depthwise",
        measured="2-core AMD EPYC (AVX-512), 1 thread, batch 1, MobileNetV2's 3x3 layers: "
                 "NumPy forms / im2col time 0.70-0.99 at 32-144 channels on 56x56-112x112 "
                 "and at 576-960 channels on 7x7, 1.05-1.11 at 144-384 channels on "
                 f"14x14-28x28; the native form {DEPTHWISE_NATIVE_SPEEDUP}"),
    "im2col": ConvRule("im2col", 10, "im2col + one BLAS GEMM per group"),
    "native": ConvRule(
        "native", 40, "implicit GEMM on the native kernel: filters packed once, taps "
        "gathered from the padded image, bias, residual and ReLU fused into the store",
        groups="not_depthwise", dtypes=frozenset({"float32", "float16"}), max_channels=64,
        yields_to_pointwise=True, evidence_decides=True, measured=_NATIVE_MEASURED,
        baseline="the best other variant", evidence=_NATIVE_EVIDENCE),
})
# Variants that need a tier beyond NumPy (see keel.backends.plan.tier_unavailable).
REQUIRES = {"native": "native"}
# Rules in force where a tier is available (the variant runs a faster form there).
TIER_RULES = {"winograd": {"native": WINOGRAD_NATIVE}}

# ---- conv decisions --------------------------------------------------------------------
def rule_in_force(kv: KernelVariant) -> ConvRule:
    """A variant's conv rule, or the one its metadata names for a tier available here."""
    for tier, tier_rule in dict(kv.meta.get("tier_rules", {})).items():
        if tier_unavailable(tier) is None:
            return tier_rule
    return kv.meta["rule"]


def available_rules(tier: bool | None = None) -> list[ConvRule]:
    """The conv rules in force here: native variants need the native tier, which also
    compiles Winograd's transforms (its rule then has its own measurements).
    ``tier``: whether the native GEMM is loaded (default: whether it loads)."""
    if tier is None:
        tier = native_gemm.available()
    return [TIER_RULES[name]["native"] if tier and name in TIER_RULES else r
            for name, r in RULES.items() if name not in REQUIRES or tier]


def batch_invariant() -> bool:
    """Whether choices keep a sample's result independent of its batch: asked for
    (``KEEL_BATCH_INVARIANT``, on by default) and possible, the native GEMM loaded (its
    sums follow only the depth). On OpenBLAS the order of summation follows the
    product's shape whatever is chosen, so the faster per-batch choices stay."""
    return settings().batch_invariant and native_gemm.available()


def deciding_case(case: ConvCase) -> ConvCase:
    """The case the conv rules decide on: with batch invariance one image's. The
    variants round differently (Winograd's transforms, another summation order), so a
    choice that followed the batch size would change a sample's result with the batch;
    the rules' per-batch evidence then goes unused (the cost: docs/performance.md)."""
    return dataclasses.replace(case, batch=1) if batch_invariant() else case


@functools.lru_cache(maxsize=1024)
def _pick_cached(case: ConvCase, tier: bool) -> tuple[str, str]:
    return pick(case, available_rules(tier))


def conv_call_variant(case: ConvCase, threads: int = 1) -> tuple[str, str]:
    """The conv variant for ``case`` on ``threads`` threads when no placement decided one
    (a direct kernel call on shapes known only now): the same rules as :func:`plan`."""
    tier = native_gemm.available()
    variant, why = _pick_cached(deciding_case(case), tier)
    native = next((r for r in available_rules(tier) if r.variant == "native"), None)
    return threaded_conv(case, variant, why, threads, native)


def exact_conv_variant(case: ConvCase) -> str:
    """The variant conv_integer runs in float: Winograd's transforms round, and the
    native kernel has no integer path, so the exact NumPy variants only."""
    exact = [r for k, r in RULES.items() if k not in ("winograd", "native")]
    return pick(case, exact)[0]


def _conv_case(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
               dtype: DType | None) -> ConvCase | None:
    if len(input_types) < 2 or any(t is None or t.shape is None for t in input_types[:2]):
        return None
    x, w = input_types[0], input_types[1]
    assert x is not None and w is not None and x.shape is not None and w.shape is not None
    try:
        case = conv_case(op, x.shape, w.shape, attrs, dtype.value if dtype else "float32")
    except KeelError:
        return None
    return None if case is None else deciding_case(case)


def _choose_conv(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                 variants: Mapping[str, KernelVariant], dtype: DType | None
                 ) -> tuple[str, str]:
    case = _conv_case(op, input_types, attrs, dtype)
    if case is None:
        return "default", "input shapes not known before running: the default kernel picks"
    rules = [rule_in_force(kv) for kv in variants.values()
             if isinstance(kv.meta.get("rule"), ConvRule) and not kv.meta.get("dispatcher")
             and (dtype is None or kv.dtypes is None or dtype in kv.dtypes)]
    if not rules:
        return "default", f"{op.value}: no variant carries conv rules; default dispatches"
    try:
        return pick(case, rules)
    except LookupError as exc:
        return "default", str(exc)


def choose_variant(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                   table: KernelTable) -> tuple[str, str]:
    """The variant of ``op`` to run from the cpu ``table`` for these inputs, and why.

    Depends only on the op, the input types, the attributes, the variants the
    table offers and whether the tiers they require can run here: same inputs,
    same answer. Conv-family ops are decided by the conv rules; the rest by
    priority. Falls back to ``default`` when the shapes are not known.
    """
    variants, skipped = usable_variants(op, table)
    dtype = input_types[0].dtype if input_types and input_types[0] is not None else None
    if op in INT8_OPS and "int8" in variants:
        name, why = "int8", int8_reason(op)
    elif op is Op.QLINEAR_ADD and "int8" in variants:
        name, why = "int8", QADD_REASON
    elif op is Op.QLINEAR_GLOBAL_AVG_POOL and "int8" in variants:
        name, why = "int8", QGAP_REASON
    elif op in CONV_OPS and len(variants) > 1:
        name, why = _choose_conv(op, input_types, attrs, variants, dtype)
    elif op in CONV_OPS and variants["default"].meta.get("dispatcher"):
        conv, _ = usable_variants(Op.CONV, table)
        _, why = _choose_conv(op, input_types, attrs, conv, dtype)
        name, why = "default", f"dispatches through the conv variants: {why}"
    else:
        name, why = choose_by_priority(op, variants, dtype, table.backend)
    return name, why + skipped_note(skipped)


# ---- int8: the integer products ------------------------------------------------------------
# The quantized products with an ``int8`` variant (cpu/qlinear.py): it runs on the native
# int8 kernels (qgemm.c) whenever the tier is built, since they accumulate exactly in int32
# as the NumPy default does in float64, with the same results, and keep the weights 8-bit.
INT8_OPS = frozenset({Op.QLINEAR_CONV, Op.QLINEAR_MATMUL, Op.QGEMM})
_INT8_ISA = {
    "avx512-vnni": "AVX-512 VNNI (vpdpbusd on 512-bit vectors: 64 u8 x s8 products per "
                   "instruction)",
    "avx-vnni": "AVX-VNNI (vpdpbusd on 256-bit vectors: 32 u8 x s8 products per instruction)",
    "portable": "the portable C path (this build's CPU flags have no AVX-512 VNNI or AVX-VNNI)",
}


QADD_REASON = ("qlinear_add: the native 8-bit kernel, onnxruntime's QLinearAdd in one pass "
               "over the bytes (float32 scale ratios and fused multiply-adds, onnxruntime's "
               "bytes; 16 lanes at a time with AVX-512)")
# A QLinearAdd splits over threads only where each gets at least this many elements:
# it runs about 10 elements per nanosecond (ResNet-20's 32x64x8x8 join, 131,072
# elements, in ~13 us on one thread), so this is ~3 us per thread, a few dispatches.
QADD_MIN_ELEMENTS_PER_THREAD = 32_768

QGAP_REASON = ("qlinear_global_avg_pool: the native 8-bit kernel, onnxruntime's "
               "QLinearGlobalAveragePool in one pass (integer sums, its float32 "
               "requantization), reading NCHW or a channels-last chain's bytes")
# A QLinearGlobalAveragePool splits its (image, 256-channel block) tasks over threads only
# where each thread reads at least this many bytes, as QLinearAdd's pass: one pass over
# the bytes, MobileNetV2's channels-last 32x1280x7x7 (2 M bytes) in 60-66 us on one thread
# and 33-36 us on two (the kernel alone, measured under load), so this is ~1 us a thread.
QGAP_MIN_ELEMENTS_PER_THREAD = QADD_MIN_ELEMENTS_PER_THREAD

# An int8 MaxPool (cpu/pooling.py's ``int8`` variant, qgemm.c) splits its planes over
# threads only where each gets at least this many input elements: ResNet-18's 3x3 stride-2
# pool reads ~12 input bytes per nanosecond on one thread (32x64x112x112 in ~2.1 ms), so
# this is ~5 us per thread, a few dispatches.
QMAXPOOL_MIN_ELEMENTS_PER_THREAD = 65_536


# An int8 depthwise convolution whose output planes have at most this many pixels runs with
# the channels in the vector lanes (qgemm.c's qdepth_cl_task): per plane, the plane-wise
# kernel's setup (padding, widening, a store per output row) outweighs the sums of a small
# plane (MobileNetV2's 14x14 and 7x7 layers ran ~5-50x slower than onnxruntime's).
INT8_DEPTHWISE_LANES_MAX_PIXELS = 1024


def int8_depthwise_lanes(out_pixels: int) -> bool:
    """Whether an NCHW int8 depthwise convolution of ``out_pixels`` output pixels per plane
    runs with the channels in the vector lanes (qgemm.c's qdepth_cl_task, where the build
    has AVX-512 VNNI and it has at most INT8_LANES_MAX_TAPS taps) before the plane-wise
    kernel."""
    return out_pixels <= INT8_DEPTHWISE_LANES_MAX_PIXELS

# The int8 direct convolution stacks this many padded positions' worth of images into one
# layout (their padding shared), so a block of 64 positions may span images: on ResNet-20's
# 8x8 maps one image alone is 80 positions, two blocks of 64 for 64 outputs.
INT8_DIRECT_CHUNK_POSITIONS = 2048


def int8_direct_chunk(batch: int, image_positions: int, parts: int) -> int:
    """Images per chunk of the int8 direct convolution (qgemm.c): about
    INT8_DIRECT_CHUNK_POSITIONS positions' worth of ``image_positions`` each, at most one
    of ``parts`` threads' share of ``batch``, and on several threads the divisor of that
    share nearest to it (the larger of two as near) where one lies within a factor of
    two. Each thread's images are then whole chunks: none is built by two threads (the
    threads take near-equal runs of the chunks' blocks, which may end inside a chunk).
    Before (the kernel also split blocks past the last chunk's images), ResNet-18's
    stride-2 layer to 14x14 at batch 32 on two threads stacked 10, 10, 10 and 2 images:
    one thread's run held 20 images' work, the other's 12 (1.6x the one-thread speed);
    8 a chunk gives each 16."""
    share = -(-max(1, batch) // max(1, parts))
    target = min(share, max(1, -(-INT8_DIRECT_CHUNK_POSITIONS // max(1, image_positions))))
    if parts <= 1:
        return target                   # one thread: one share, whatever the chunks
    divisors = [d for d in range(1, share + 1) if share % d == 0]
    best = min(divisors, key=lambda d: (abs(d - target), -d))
    return best if target <= 2 * best <= 4 * target else target

# The int8 direct convolution computes only output pixels ("compact" columns, copied into
# a panel per block of 64; qgemm.c) where its output rows are at most this many pixels
# wide and it has at least this many output channels to share each copy: the padded
# layout's blocks would compute a padding column per row and a padding row per image.
# Compact / padded time, the kernel alone, one thread, same process, alternating, medians
# (measured under load): 3x3 512->512 7x7 (batch 8) 0.91; 256->256 14x14 0.92-0.94;
# stride 2 256->512 14x14 out 0.86, 128->256 0.94; 64->128 8x8 (batch 32) 0.91, 64->64
# 0.98-0.99; but 32->32 16x16 1.09, 16->32 stride 2 8x8 out 1.04 (32 channels share a
# copy too little) and 128->128 28x28 1.03 (6% padding).
INT8_COMPACT_MAX_WIDTH = 16
INT8_COMPACT_MIN_CHANNELS = 64


def int8_compact_columns(out_width: int, out_channels: int) -> bool:
    """Whether the int8 direct convolution computes compact columns (output pixels only)."""
    return out_width <= INT8_COMPACT_MAX_WIDTH and out_channels >= INT8_COMPACT_MIN_CHANNELS


# The int8 direct convolution's columns are "row segments" (qgemm.c: one output row per 16
# columns, or per 8 where rows are at most 8 pixels wide, each read in place from the padded
# layout, no copy) where its output rows are this many pixels wide: they fill their segments,
# where the padded layout computes a padding column per row and a padding row per image, and
# compact columns copy every block. Row segments / padded (and compact / padded) time, the
# kernel alone, batch 32, one thread, same process, alternating, medians (measured under
# load, load average 3-4): 3x3 32->32 16x16 0.87-0.88 (compact 1.07-1.15); 64->64 8x8
# 0.80-0.82 (0.92-0.96); 128->128 8x8 0.82 (0.84); 64->64 16x16 0.92 (1.01); stride 2
# 16->32 out 16x16 0.81-0.89 (0.78-0.93), 32->64 out 8x8 0.97 (1.01); 1x1 stride 2 16->32
# out 16x16 0.86, 32->64 out 8x8 0.90. The whole of ResNet-20 (all its maps 16 or 8 wide
# after the first stage), CPU time per run against the rule before, one process,
# alternating: 0.94. Not on 14 or 12 pixels (1.00-1.02 against padded: 2 or 4 of each 16
# columns dropped, as many as padded drops), nor on 7: 0.88 of padded on 64->64 7x7, but
# ResNet-18 (whose 7x7 layers, 256-512 channels, ran compact) took 1.027 of its time with
# them on row segments.
INT8_ROW_WIDTHS = frozenset({8, 16})


def int8_row_columns(out_width: int, out_channels: int) -> bool:
    """Whether the int8 direct convolution's columns are row segments (one output row per
    16 or 8 columns, read in place)."""
    return out_width in INT8_ROW_WIDTHS


# A shallow int8 direct convolution (each column's depth, KH * KW * C rounded up to 4, at
# most INT8_COMPACT_MAX_DEPTH bytes) with at least INT8_COMPACT_SHALLOW_MIN_CHANNELS output
# channels computes compact columns at any width (rows of 16 or 8 pixels keep their row
# segments): its products are short, and the padded blocks' per-block setup (their output
# runs, compressed stores) and in-place reads of a plane per k quad weigh on them where a
# compact block reads one contiguous panel. Compact / padded time, the kernel alone, batch
# 32, one thread, same process, alternating, medians (measured under load, load average
# 5-6): 1x1 stride 2 64->128 56x56 in 0.71-0.76, 128->256 56 0.88, 64->64 56 0.79, 32->64
# 56 0.76, 64->128 64 0.77; 1x1 stride 1 64->128 28 0.69, 64->256 56 0.70; ResNet-18's 7x7
# stride 2 3->64 224 (depth 196) 0.93. Not deeper: 3x3 32->32 32x32 (depth 288) 1.03,
# 32->64 0.98, 64->64 56x56 1.12, 128->128 28x28 1.05; nor with fewer channels to share
# each copy: 5x5 1->6 28x28 (6 channels) 1.19, and the 16-channel ones varied from run to
# run (3x3 16->16 32x32 0.89 and 1.13; ResNet-20, whose first stage they are, 0.965 and
# 1.04 of its time).
INT8_COMPACT_MAX_DEPTH = 256
INT8_COMPACT_SHALLOW_MIN_CHANNELS = 64


def int8_conv_columns(out_width: int, out_channels: int, depth: int = 0) -> str:
    """Which columns the int8 direct convolution computes: ``rows`` (row segments),
    ``compact`` (output pixels only, copied per block) or ``padded`` (every position of
    the padded layout). ``depth``: a column's bytes, KH * KW * C rounded up to 4 (0:
    unknown, taken as deep)."""
    if int8_row_columns(out_width, out_channels):
        return "rows"
    shallow = (0 < depth <= INT8_COMPACT_MAX_DEPTH
               and out_channels >= INT8_COMPACT_SHALLOW_MIN_CHANNELS)
    if shallow or int8_compact_columns(out_width, out_channels):
        return "compact"
    return "padded"


# ---- int8 layouts over the whole graph -----------------------------------------------------
# MobileNetV2's int8 depthwise layers and 1x1 convolutions ran 2-4x onnxruntime's time in
# NCHW (per-node profiles at batch 32, one thread: a 56x56 stride-2 depthwise layer 26 ms
# against 13, the 14x14 ones 4.7 ms against 1.1, the 1x1 expansions ~2x), which runs the
# whole network channels-last. Channels-last, a 1x1 convolution is one product over every
# pixel and a depthwise one vectorizes over channels with no per-plane setup; the layout
# changes once at a chain's ends. A chain is only worth its layout changes where it holds
# a depthwise convolution: 1x1 convolutions alone run as well in NCHW.
INT8_LAYOUT_REASON = ("int8 channels-last chain of {nodes} nodes ({depthwise} depthwise, "
                      "{dense} dense convolutions): 1x1 convolutions run as one product over "
                      "all pixels, depthwise ones with the channels in the vector lanes, "
                      "dense ones as an indirect product reading each tap's pixel rows in "
                      "place, residual joins elementwise, max pools over whole channel rows; "
                      "the layout changes only at the chain's ends (this node: {this})")
# A dense int8 convolution (one group, not a stride-1 unpadded 1x1) runs channels-last as
# qlayout.c's indirect product: each tile of 12 output pixels lists its taps' input rows,
# then runs the pointwise panels over taps x C. The list is paid per tile and 32 output
# channels, so narrow convolutions lose to the NCHW direct kernel. The kernels alone at
# batch 32, one thread, alternating, median of 20 (NHWC time over NCHW, measured under
# load): ResNet-18's 64->64 3x3 at 56x56 0.95, 64->128 3x3 stride 2 0.76, 1x1 stride 2
# 0.74, 128->128 at 28x28 0.88, 256->256 at 14x14 0.85, 256->512 1x1 stride 2 0.65,
# 512->512 at 7x7 0.89; ResNet-20's 32->32 at 16x16 1.01, 16->32 3x3 stride 2 0.84, 64->64
# at 8x8 0.87, but 16->16 at 32x32 1.75, 32->16 1.40 and 8->32 1.46. So a dense
# convolution joins a chain only with at least these channels in and out; else it stays
# NCHW (and may start or end a chain).
INT8_DENSE_MIN_INPUT_CHANNELS = 16
INT8_DENSE_MIN_OUTPUT_CHANNELS = 32
# A join whose operands are NCHW (outside any chain) writes its value channels-last, so
# starting the chain, where at least this many channels-last kernels read it: ResNet-20's
# first downsampling block, whose 3x3 stride-2 convolution and 1x1 stride-2 shortcut would
# each transpose the same 16x32x32 value. One reader transposes it either way.
INT8_JOIN_START_READERS = 2
# An int8 MaxPool whose input a convolution outside any chain writes (ResNet-18's stem)
# starts the chain itself: the NCHW pool then the transpose of its 4x smaller result.
# ResNet-18's 3x3 stride-2 pool of 32x64x112x112 at one thread (measured under load): NCHW
# pool with its result transposed 3.5-4.3 ms, against the stem's result transposed (4.3-5.0)
# and the channels-last pool (4.1).
# A channels-last 1x1 convolution whose weights (C x M bytes) are at most this size runs on
# qlayout.c's panels (12 pixels by 32 output channels in registers, the requantization
# vectorized in the store); larger ones on qgemm.c's matrix product, since each tile of
# pixels streams all the panels again. Measured at batch 32, one thread (ms, panels /
# matrix product): 16->96 at 112x112 6.6 / 17.3; 24->144 at 56x56 2.9 / 7.8; 144->24 at
# 56x56 2.7 / 3.2; 96->576 at 14x14 1.6 / 2.4; 576->160 at 7x7 (90 KiB) 0.49 / 0.51.
# Since the panels compute the pixel rows past their last whole tile as a tile (a C loop
# took them, a third of a 7x7 layer's time at batch 32), the kernels alone, alternating,
# median ratios of 9 (range), 1 and 2 threads, measured under load: 160->960 at 7x7
# 0.71 (0.70-0.72) and 0.72 (0.69-0.76); 960->160 0.77 (0.75-0.81) and 0.80; 960->320
# (300 KiB) 0.92 (0.91-0.93) and 0.91 (0.89-0.94); 320->1280 (400 KiB, MobileNetV2's last)
# 0.82 (0.81-0.83) and 0.81 (0.73-0.85); 512->1024 (512 KiB) 0.85 (0.80-0.90) and 0.82;
# larger ones (1 and 1.6 MiB) 0.80-0.90 in medians too noisy to rely on (0.3-1.9).
INT8_POINTWISE_PANEL_MAX_WEIGHT_BYTES = 512 * 1024


def int8_pointwise_panels(weight_bytes: int, sizes: Caches | None = None) -> bool:
    """Whether a channels-last int8 1x1 convolution with symmetric weights runs on
    qlayout.c's panels rather than the matrix product: its weights at most
    INT8_POINTWISE_PANEL_MAX_WEIGHT_BYTES, measured against a 1 MiB L2 and scaled to the
    L2 of ``sizes`` (None: this machine's, :func:`caches`)."""
    return weight_bytes <= (sizes or caches()).with_l2(INT8_POINTWISE_PANEL_MAX_WEIGHT_BYTES)

# A channels-last depthwise convolution whose input plane, for one block of 32 channels
# widened to int16 with its padding, is at most this size (a core's L2) splits its work by
# (image, channel block) where that gives every thread a plane: each plane is widened once
# and all its outputs computed with the block's taps in registers. Otherwise it splits by
# output rows, widening the input rows under each (every row widened again for each output
# row it feeds). Measured at batch 32, one thread, under load (ms, rows / planes):
# 32 ch 112x112 (812 KiB) 6.3 / 4.6; 96 ch 112x112 stride 2 9.2 / 7.2; 144 ch 56x56
# 7.3 / 5.7; 192 ch 28x28 1.8 / 1.4; 576 ch 14x14 1.4 / 1.1; 576 ch 14x14 stride 2
# 0.48 / 0.39; 960 ch 7x7 0.67 / 0.50.
INT8_DEPTHWISE_PLANE_MAX_BYTES = 1024 * 1024


def int8_depthwise_planes(pieces: int, threads: int, plane_bytes: int,
                          sizes: Caches | None = None) -> bool:
    """Whether the channels-last int8 depthwise kernel splits its work by (image,
    INT8_DEPTHWISE_LANES-channel block) planes, each widened once and kept in cache, rather
    than by output rows: where every thread gets a plane and a plane fits a core's L2
    (INT8_DEPTHWISE_PLANE_MAX_BYTES, measured against a 1 MiB L2, scaled to the L2 of
    ``sizes``; None: this machine's, :func:`caches`)."""
    return pieces >= threads and plane_bytes <= (sizes or caches()).with_l2(
        INT8_DEPTHWISE_PLANE_MAX_BYTES)


# qlayout.c compiles its AVX-512 paths (the depthwise kernel's plane split among them)
# where the CPU has these features (its LAYOUT_AVX512): a plan for a profile reads them
# from the profile's CPU, as a plan for this machine asks the loaded library.
INT8_LANES_FEATURES = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512vnni"})


def int8_lanes(profile: Any = None) -> bool:
    """Whether the channels-last int8 kernels run their AVX-512 paths on ``profile``'s CPU
    (None: whether the loaded qlayout.c has them)."""
    if profile is None:
        from keel.backends.cpu import qlayout

        return qlayout.lanes_available()
    return INT8_LANES_FEATURES.issubset(profile.cpu.simd)


# ---- int8: the channels-last kernel a chain's convolution runs -------------------------------
# A convolution in a channels-last chain runs one of qlayout.c's kernels, chosen by one rule
# (int8_channels_last_kernel) from its kind and what its constants say:
# - ``panels``: a 1x1 convolution (stride 1, no padding) whose weights are symmetric (zero
#   points 0: the panels fold x's zero point into a bias over each column's sum), that
#   bias within INT8_FOLD_MAX, and its weights within int8_pointwise_panels' size;
# - ``matmul``: any other 1x1 convolution, on qgemm.c's product (zero points as it takes
#   them), channels-last as well;
# - ``indirect``: a dense convolution (C a multiple of 4) on the same terms as the panels,
#   its input image's bytes addressed in int32;
# - ``depthwise``: a depthwise one of at most INT8_DEPTHWISE_MAX_TAPS taps;
# - ``nchw``: else the node's NCHW kernel. The planner, which sees the constant weights,
#   then leaves the node out of the chain's inside (it may start one), rather than run it
#   between two layout changes. Where the weights are not constants the choice is made
#   with the same rule when they are packed (the reason says so).
INT8_CHANNELS_LAST_KERNELS = ("panels", "matmul", "indirect", "depthwise", "nchw")
# The panels' folded bias (x's zero point times a column's weight sum, plus the bias) must
# stay this far inside int32, so the int32 sums over the products cannot overflow.
INT8_FOLD_MAX = 2**31 - 2**30
INT8_INDIRECT_MAX_IMAGE_BYTES = 2**31 - 1      # qlayout.c's int32 tap offsets


@dataclass(frozen=True)
class Int8ConvConstants:
    """What is known of a QLinearConv's constant operands (None: not known, the operand
    is not a constant): whether the weights' zero points are all 0, and whether the
    panels' folded bias stays within INT8_FOLD_MAX (needs x's zero point and the bias)."""

    symmetric: bool | None = None
    fold_fits: bool | None = None


def int8_channels_last_kernel(kind: str, weight_shape: Sequence[int],
                              x_shape: Sequence[int] | None,
                              constants: Int8ConvConstants,
                              sizes: Caches | None = None) -> str | None:
    """Which channels-last kernel a QLinearConv of ``kind`` (qlayout.conv_kind) runs (one
    of INT8_CHANNELS_LAST_KERNELS, by the rule above, for the caches of ``sizes``; None:
    this machine's); None where that depends on weights not known (not constants)."""
    if kind == "depthwise":
        return "depthwise" if math.prod(weight_shape[2:]) <= INT8_DEPTHWISE_MAX_TAPS else "nchw"
    if kind not in ("pointwise", "dense"):
        return "nchw"
    if constants.symmetric is None:
        return None
    fits = constants.symmetric and constants.fold_fits is not False
    if kind == "pointwise":
        weight_bytes = math.prod(int(d) for d in weight_shape)
        return "panels" if fits and int8_pointwise_panels(weight_bytes, sizes) else "matmul"
    image = None if x_shape is None else math.prod(int(d) for d in x_shape[1:])
    small = image is None or image <= INT8_INDIRECT_MAX_IMAGE_BYTES
    return "indirect" if fits and small else "nchw"


_INT8_KERNEL_NAMES = {"panels": "the 1x1 panels (symmetric weights)",
                      "matmul": "the matrix product (a 1x1 convolution the panels do not take)",
                      "indirect": "the indirect product", "depthwise": "the depthwise kernel"}
_INT8_UNKNOWN = {"pointwise": ("the 1x1 panels where its weights are symmetric, else the "
                               "matrix product"),
                 "dense": ("the indirect product where its weights are symmetric, else its "
                           "NCHW kernel between layout changes")}


# ---- int8: the threads each int8 kernel call runs on ------------------------------------------
# An int8 kernel splits a call's tasks over the node's threads only while each thread gets
# at least the least work worth one (MIN_FLOPS_PER_THREAD for the products: a dispatch to a
# spinning worker costs about a microsecond, and 400,000 flops take the VNNI tile about
# 1 us; MIN_CHUNK_TAPS for the depthwise sums; the elements minimums above for the passes
# over bytes), so a small call (LeNet's layers, a 7x7 map at batch 1) runs on fewer threads
# than the plan's. The kernels' prepared calls ask these functions once per call's shapes,
# and the plans' reasons ask the same ones, so what explain() states is what runs.
# The compiled kernels' sizes the splits count tasks in: not choices, the C code's geometry.
# Each library reports its own at load (keel_qgemm_geometry, keel_qlayout_geometry) and
# native_qgemm.check_sizes fails the load where one of these differs, so neither side
# drifts alone; INT8_QGEMM_SIZES and INT8_QLAYOUT_SIZES name them in the order reported.
INT8_DIRECT_PANEL = 64         # qgemm.c's NB: output positions per block of the direct kernel
#                                (and columns per weight panel of its matrix product)
INT8_MATMUL_ROWS = 6           # qgemm.c's MR: rows per tile of its matrix product
INT8_LANES_MAX_TAPS = 64       # qgemm.c's DW_TAPS: the most taps its lanes depthwise takes
INT8_TRANSPOSE_STRIP = 32      # qlayout.c's TB: rows of a transpose strip
INT8_DEPTHWISE_LANES = 32      # qlayout.c's CL: channels per depthwise block
INT8_DEPTHWISE_MAX_TAPS = 64   # qlayout.c's MAX_TAPS: the most taps its depthwise kernel takes
INT8_TILE_PIXELS = 12          # qlayout.c's MR: output pixels per tile of the panels
INT8_PANEL_COLUMNS = 32        # qlayout.c's NT: output channels per panel
INT8_GAP_BLOCK = 256           # qlayout.c's GAP_CB: channels per global-pool task
INT8_QGEMM_SIZES = ("INT8_DIRECT_PANEL", "INT8_MATMUL_ROWS", "INT8_LANES_MAX_TAPS")
INT8_QLAYOUT_SIZES = ("INT8_TRANSPOSE_STRIP", "INT8_DEPTHWISE_LANES", "INT8_DEPTHWISE_MAX_TAPS",
                      "INT8_TILE_PIXELS", "INT8_PANEL_COLUMNS", "INT8_GAP_BLOCK")


@dataclass(frozen=True)
class Int8Split:
    """How one int8 kernel call splits: ``parts`` chunks of its tasks (the threads that run
    it), and for the direct convolution ``chunk`` images per stacked layout, for the
    channels-last depthwise kernel ``planes`` (tasks are (image, channel block) planes,
    not output rows)."""

    parts: int
    tasks: int
    chunk: int = 0
    planes: bool = False


def _int8_parts(tasks: int, threads: int | None, least: int) -> int:
    """Parts of ``tasks`` each at least ``least`` of them: for the passes over bytes, whose
    least work (QADD_MIN_ELEMENTS_PER_THREAD ...) is no measured family's."""
    return parts(tasks, max(1, threads or 1), max(1, least))


def _int8_split(work: LeastWork, tasks: int, threads: int | None, per_task: int) -> int:
    """Parts of ``tasks`` of ``per_task`` work each for the int8 products (FLOPS) and
    depthwise sums (TAPS): the least work of a split that wide (split_parts)."""
    return split_parts(work, max(1, threads or 1), tasks, per_task)


def int8_matmul_split(rows: int, depth: int, columns: int, threads: int) -> Int8Split:
    """qgemm.c's matrix product's split (QGemm, QLinearMatMul and a channels-last 1x1
    convolution the panels do not take): tiles of INT8_MATMUL_ROWS rows by
    INT8_DIRECT_PANEL columns, as many parts as give each thread the least flops worth
    one."""
    tiles = -(-columns // INT8_DIRECT_PANEL) * -(-rows // INT8_MATMUL_ROWS)
    tile_flops = 2 * INT8_MATMUL_ROWS * INT8_DIRECT_PANEL * depth
    return Int8Split(_int8_split(LeastWork.FLOPS, tiles, threads, tile_flops), tiles)


def int8_pass_parts(elements: int, threads: int) -> int:
    """The parts of a one-pass int8 kernel over ``elements`` (QLinearAdd, QuantizeLinear,
    DequantizeLinear: qgemm.c), each thread taking at least QADD_MIN_ELEMENTS_PER_THREAD."""
    return _int8_parts(elements, threads, QADD_MIN_ELEMENTS_PER_THREAD)


def int8_max_pool_plane_parts(planes: int, plane_elements: int, threads: int) -> int:
    """The NCHW int8 MaxPool's parts (qgemm.c: whole (image, channel) planes of
    ``plane_elements`` input bytes each), each thread reading at least
    QMAXPOOL_MIN_ELEMENTS_PER_THREAD bytes."""
    return _int8_parts(planes, threads,
                       -(-QMAXPOOL_MIN_ELEMENTS_PER_THREAD // max(1, plane_elements)))


def int8_direct_split(batch: int, group: int, out_pixels: int, depth: int, out_channels: int,
                      image_positions: int, threads: int) -> Int8Split:
    """The NCHW int8 convolution's split (qgemm.c: direct, im2col and depthwise kernels):
    its blocks of INT8_DIRECT_PANEL output positions per image and group, ``depth`` = C/g x
    KH x KW bytes each, as many parts as give each thread MIN_FLOPS_PER_THREAD; the direct
    kernel's chunk of stacked images (int8_direct_chunk) follows those parts, not the
    plan's threads."""
    units = batch * group * -(-out_pixels // INT8_DIRECT_PANEL)
    unit_flops = 2 * (INT8_DIRECT_PANEL * depth * out_channels // max(1, group))
    count = _int8_split(LeastWork.FLOPS, units, threads, unit_flops)
    return Int8Split(count, units, int8_direct_chunk(batch, image_positions, count))


def int8_panel_split(pixels: int, depth: int, out_channels: int, threads: int) -> Int8Split:
    """The channels-last int8 panels' split (qlayout.c's 1x1 panels, depth = C, and the
    indirect product, depth = KH x KW x C): tiles of INT8_TILE_PIXELS output pixels by
    every output channel, as many parts as give each thread MIN_FLOPS_PER_THREAD."""
    tiles = -(-pixels // INT8_TILE_PIXELS)
    tile_flops = 2 * INT8_TILE_PIXELS * depth * out_channels
    return Int8Split(_int8_split(LeastWork.FLOPS, tiles, threads, tile_flops), tiles)


def int8_depthwise_split(batch: int, channels: int, out_h: int, out_w: int, taps: int,
                         plane_bytes: int, threads: int, lanes: bool,
                         sizes: Caches | None = None) -> Int8Split:
    """The channels-last int8 depthwise kernel's split: by (image, 32-channel block)
    planes where int8_depthwise_planes says so for the caches of ``sizes`` (``lanes``:
    the build has the kernel's AVX-512 path), else by output rows; as many parts as give
    each thread MIN_CHUNK_TAPS output values x taps."""
    blocks = -(-channels // INT8_DEPTHWISE_LANES)
    planes = lanes and int8_depthwise_planes(batch * blocks, max(1, threads), plane_bytes,
                                             sizes)
    tasks, per_task = ((batch * blocks, out_h * out_w * INT8_DEPTHWISE_LANES) if planes
                       else (batch * out_h, out_w * channels))
    count = _int8_split(LeastWork.TAPS, tasks, threads, per_task * taps)
    return Int8Split(count, tasks, planes=planes)


def int8_transpose_parts(batch: int, rows: int, cols: int, threads: int) -> int:
    """The int8 layout change's parts (strips of INT8_TRANSPOSE_STRIP rows per image), each
    thread moving at least QADD_MIN_ELEMENTS_PER_THREAD bytes (one pass over bytes, as a
    QLinearAdd)."""
    return _int8_parts(batch * -(-rows // INT8_TRANSPOSE_STRIP), threads,
                       QADD_MIN_ELEMENTS_PER_THREAD // max(1, INT8_TRANSPOSE_STRIP * cols))


def int8_max_pool_parts(out_rows: int, out_w: int, channels: int, threads: int) -> int:
    """The channels-last int8 MaxPool's parts (output rows), each thread reading at least
    QMAXPOOL_MIN_ELEMENTS_PER_THREAD input bytes (counted as 4 per output value: a 3x3
    stride-2 window's share)."""
    least = -(-QMAXPOOL_MIN_ELEMENTS_PER_THREAD // max(1, 4 * out_w * channels))
    return _int8_parts(out_rows, threads, least)


def int8_global_pool_parts(batch: int, channels: int, pixels: int, threads: int) -> int:
    """The integer global average pool's parts ((image, INT8_GAP_BLOCK-channel block)
    tasks), each thread reading at least QGAP_MIN_ELEMENTS_PER_THREAD bytes."""
    return _int8_parts(batch * -(-channels // INT8_GAP_BLOCK), threads,
                       QGAP_MIN_ELEMENTS_PER_THREAD // max(1, pixels * min(channels,
                                                                           INT8_GAP_BLOCK)))


def int8_layout_split_reason(kernel: str | None, x: Sequence[int], w: Sequence[int],
                             y: Sequence[int], attrs: Mapping[str, Any],
                             threads: int | None, kind: str = "", profile: Any = None) -> str:
    """How a channels-last int8 node's ``kernel`` (int8_channels_last_kernel's, or
    ``maxpool``; None: chosen when the weights of a ``kind`` convolution are packed) splits
    over ``threads`` (its static input, weight and output shapes, graph order; "" where
    not known) on ``profile``'s CPU (None: this machine): the same functions its prepared
    call asks."""
    if not threads or len(x) != 4 or len(y) != 4:
        return ""
    n, c, _, wd = (int(d) for d in x)
    oh, ow = int(y[2]), int(y[3])
    if kernel == "maxpool":
        count = int8_max_pool_parts(n * oh, ow, c, threads)
        return (f"its kernel on {count} of {threads} thread(s): {n * oh} output rows, each "
                f"thread reading at least QMAXPOOL_MIN_ELEMENTS_PER_THREAD = "
                f"{QMAXPOOL_MIN_ELEMENTS_PER_THREAD:,} bytes")
    if kernel is None and kind in _INT8_UNKNOWN:
        return (f"its kernel, {_INT8_UNKNOWN[kind]} (chosen when the weights are packed: they "
                "are not constants)")
    if kernel not in _INT8_KERNEL_NAMES or len(w) != 4:
        return ""
    m, taps = int(w[0]), int(w[2]) * int(w[3])
    if kernel == "depthwise":
        from keel.backends.cpu import qlayout
        from keel.ops.schemas.quantization import conv_geometry as qconv_geometry

        geo = qconv_geometry(x, w, attrs)
        split = int8_depthwise_split(n, c, oh, ow, taps, qlayout.plane_bytes(geo, wd), threads,
                                     int8_lanes(profile), caches(profile))
        unit = (f"(image, {INT8_DEPTHWISE_LANES}-channel block) planes" if split.planes
                else "output rows")
        return (f"its kernel on {split.parts} of {threads} thread(s): {split.tasks} {unit}, "
                f"at least {least_named(LeastWork.TAPS, threads)} output values x taps "
                "a thread")
    if kernel == "matmul":
        split = int8_matmul_split(n * oh * ow, c, m, threads)
        unit = f"{INT8_MATMUL_ROWS} pixels x {INT8_DIRECT_PANEL} output channels"
    else:
        split = int8_panel_split(n * oh * ow, taps * c, m, threads)
        unit = f"{INT8_TILE_PIXELS} pixels"
    return (f"its kernel, {_INT8_KERNEL_NAMES[kernel]}, on {split.parts} of {threads} "
            f"thread(s): {split.tasks} tiles of {unit}, at least "
            f"{least_named(LeastWork.FLOPS, threads)} flops a thread")


_LAYOUT_ROLES = {("nchw", "nhwc"): "starts it, its result written channels-last",
                 ("nhwc", "nhwc"): "inside it",
                 ("nhwc", "nchw"): "ends it, its result written NCHW"}
INT8_LAYOUT_THREADS_REASON = ("{threads} kernel thread(s): the backend's thread count; the "
                              "node runs channels-last ({layout}), {split}")
_JOIN_ROLE = ("starts it, its result written channels-last once for its {readers} readers "
              "(each would otherwise transpose the same NCHW value)")
_POOL_ROLE = ("ends it, the global average pool reading its channels-last bytes in place: "
              "the (N, C, 1, 1) result is the same bytes in either layout")


def _layout_kind(node: Any, types: Mapping[str, TensorType | None], graph: Any,
                 sizes: Caches) -> tuple[str | None, str | None]:
    """What a node placed on the int8 kernels can be in a channels-last chain, and for a
    convolution the channels-last kernel it runs (int8_channels_last_kernel; None where
    its weights are not constants). The kinds: ``pointwise``/``depthwise``/``dense``
    (reads and writes it), ``other`` (a convolution that can only start one: its NCHW
    kernel runs), ``add`` (elementwise, both operands in its layout), ``maxpool`` (reads
    and writes it), ``pool`` (a QLinearGlobalAveragePool: reads either layout, and its
    (N, C, 1, 1) result is the same bytes in both, so it can only end one), or None."""
    shapes = [_static(types.get(i)) if i else None for i in node.inputs]
    if node.op is Op.QLINEAR_GLOBAL_AVG_POOL:
        return ("pool" if shapes[0] is not None and len(shapes[0]) == 4 else None), None
    if node.op is Op.MAX_POOL:
        single = len([o for o in node.outputs if o]) == 1
        return ("maxpool" if single and shapes[0] is not None and len(shapes[0]) == 4
                else None), None
    if node.op is Op.QLINEAR_ADD:
        a, b = shapes[0], shapes[3] if len(shapes) > 3 else None
        return ("add" if a is not None and len(a) == 4 and a == b else None), None
    if node.op is not Op.QLINEAR_CONV or len(shapes) < 4:
        return None, None
    x, w = shapes[0], shapes[3]
    out = _static(types.get(node.outputs[0]))
    if x is None or w is None or out is None or len(x) != 4 or len(w) != 4:
        return None, None
    kind = _int8_conv_kind(w, node.attrs)
    kernel = int8_channels_last_kernel(kind, w, x, _int8_conv_constants(node, graph), sizes)
    return ("other" if kernel == "nchw" else kind), kernel


def _int8_conv_kind(w: Sequence[int], attrs: Mapping[str, Any]) -> str:
    """qlayout.conv_kind, a dense convolution narrower than INT8_DENSE_MIN_INPUT_CHANNELS
    in or INT8_DENSE_MIN_OUTPUT_CHANNELS out counted as ``other``."""
    from keel.backends.cpu import qlayout

    kind = qlayout.conv_kind(w, attrs)
    if kind == "dense" and (w[1] < INT8_DENSE_MIN_INPUT_CHANNELS
                            or w[0] < INT8_DENSE_MIN_OUTPUT_CHANNELS):
        return "other"
    return kind


def _int8_conv_constants(node: Any, graph: Any) -> Int8ConvConstants:
    """What a QLinearConv node's constant operands (the graph's initializers) say."""
    from keel.backends.cpu import qlayout

    def constant(i: int) -> Any:
        name = node.inputs[i] if len(node.inputs) > i else ""
        return graph.constant(name) if name else None

    w, w_zp, x_zp = constant(3), constant(5), constant(2)
    if w is None or w_zp is None:
        return Int8ConvConstants()
    bias_absent = len(node.inputs) <= 8 or not node.inputs[8]
    bias = None if bias_absent else constant(8)
    return qlayout.conv_constants(w, w_zp, x_zp, bias,
                                  bias_known=qlayout.bias_known(bias_absent, bias))


def _static(t: TensorType | None) -> tuple[int, ...] | None:
    if t is None or not t.is_static or t.shape is None:
        return None
    return tuple(int(d) for d in t.shape)  # type: ignore[arg-type]


def int8_layouts(graph: Any, types: Mapping[str, TensorType | None],
                 variants: Sequence[str | None], threads: int | None = None,
                 profile: Any = None) -> dict[int, LayoutDecision]:
    """The channels-last chains of int8 nodes: {node index: LayoutDecision} with layout
    ``"nchw->nhwc"``, ``"nhwc->nhwc"`` or ``"nhwc->nchw"`` (what the node reads and
    writes). ``variants[i]`` is node i's variant on this backend (None: elsewhere). A
    convolution whose weights are constants gets its channels-last kernel as its plan's
    ``int8_kernel`` option (int8_channels_last_kernel, decided here once: the kernel packs
    for it and runs it); with ``threads`` (the backend's), a node whose channels-last
    kernel is known says how it splits over them (int8_layout_split_reason), in its layout
    reason and as its threads reason (which otherwise states its NCHW kernel's split).

    A value is kept channels-last when an int8 convolution, join or max pool writes it,
    every reader is a 1x1, depthwise or dense convolution (one wide enough for the
    indirect product), a max pool (unless a convolution outside any chain writes the
    value), a join or a global average pool (which ends the chain), it is no graph output,
    a join's operands share a layout (its result channels-last where they are, or where
    they are NCHW and several channels-last kernels read it: the join then transposes it
    once), and its chain holds a depthwise or dense convolution. ``profile``: the
    hardware planned for (None: this machine), whose caches and AVX-512 features the
    kernels' choices and splits read."""
    nodes = graph.nodes
    sizes = caches(profile)
    found = [(_layout_kind(n, types, graph, sizes) if variants[i] == "int8" else (None, None))
             for i, n in enumerate(nodes)]
    kinds = [kind for kind, _ in found]
    producer, readers = _links(nodes)
    outputs = set(graph.output_names)

    def reads_nhwc(i: int, name: str) -> bool:
        n = nodes[i]
        if kinds[i] in ("pointwise", "depthwise", "dense"):
            return n.inputs[0] == name and name not in n.inputs[1:]
        if kinds[i] == "maxpool":
            return n.inputs[0] == name and kinds[producer[name]] != "other"
        if kinds[i] == "pool":
            return n.inputs[0] == name
        return kinds[i] == "add" and name in (n.inputs[0], n.inputs[3])

    nhwc = {name for name, i in producer.items()
            if kinds[i] not in (None, "pool") and name == nodes[i].outputs[0]
            and name not in outputs
            and readers.get(name) and all(reads_nhwc(r, name) for r in readers[name])}
    changed = True
    while changed:   # a join reads one layout; it writes NCHW unless it reads channels-last
        changed = False  # or (reading NCHW) its value has several channels-last readers
        for i, n in enumerate(nodes):
            if kinds[i] != "add":
                continue
            operands = {n.inputs[0], n.inputs[3]}
            if operands <= nhwc:
                continue
            if operands & nhwc:      # one layout read: both NCHW, its value decided next
                nhwc -= operands
                changed = True
            elif n.outputs[0] in nhwc and not _join_starts(n, nhwc, readers):
                nhwc.discard(n.outputs[0])
                changed = True
    decided: dict[int, LayoutDecision] = {}
    for i, (layout, why) in _chains(nodes, kinds, nhwc, producer, readers).items():
        kernel = found[i][1] if nodes[i].op is Op.QLINEAR_CONV else None
        split = _int8_node_split(nodes[i], kinds[i], kernel, layout, types, threads, profile)
        decided[i] = LayoutDecision(
            layout, f"{why}; {split}" if split else why,
            INT8_LAYOUT_THREADS_REASON.format(threads=threads, layout=layout, split=split)
            if split and (kernel is not None or kinds[i] == "maxpool") else "",
            () if kernel is None else (("int8_kernel", kernel,
                                        _int8_kernel_reason(kernel, nodes[i], types,
                                                            graph)),))
    return decided


def _join_starts(node: Any, nhwc: set[str], readers: Mapping[str, list[int]]) -> bool:
    """Whether a join reading NCHW operands writes its value channels-last: where at
    least INT8_JOIN_START_READERS nodes read it channels-last, each would transpose it."""
    out = node.outputs[0]
    return out in nhwc and len(set(readers[out])) >= INT8_JOIN_START_READERS


def _int8_node_split(node: Any, kind: str | None, kernel: str | None, layout: str,
                     types: Mapping[str, TensorType | None], threads: int | None,
                     profile: Any) -> str:
    """How a chain node's channels-last kernel splits ("" where its NCHW kernel runs, or
    the shapes are not known)."""
    if kind not in ("pointwise", "dense", "depthwise", "maxpool") or (
            kind == "maxpool" and not layout.startswith("nhwc")):
        return ""
    x, y = _static(types.get(node.inputs[0])), _static(types.get(node.outputs[0]))
    w = _static(types.get(node.inputs[3])) if kind != "maxpool" else (0, 0, 0, 0)
    if x is None or y is None or w is None:
        return ""
    return int8_layout_split_reason("maxpool" if kind == "maxpool" else kernel, x, w, y,
                                    node.attrs, threads, kind, profile)


_INT8_NCHW_WHY = {
    "depthwise": f"more than INT8_DEPTHWISE_MAX_TAPS = {INT8_DEPTHWISE_MAX_TAPS} taps",
    "dense": ("weight zero points not 0, or x's zero point folded over the weights past "
              "INT8_FOLD_MAX"),
    "pointwise": "", "other": ("no channels-last kernel takes its form (groups, C not a "
                               "multiple of 4, or too narrow for the indirect product)")}


def _int8_kernel_reason(kernel: str, node: Any, types: Mapping[str, TensorType | None],
                        graph: Any) -> str:
    """Why a QLinearConv runs ``kernel`` (the int8_kernel option's reason)."""
    if kernel != "nchw":
        why = (f"{_INT8_KERNEL_NAMES[kernel]}: int8_channels_last_kernel, from its constant "
               "weights' zero points and sizes")
        if kernel in ("panels", "indirect") and _int8_conv_constants(
                node, graph).fold_fits is None:
            why += ("; x's zero point or the bias is not a constant, so whether their folded "
                    "bias stays within INT8_FOLD_MAX is decided when it is packed: where it "
                    "does not, its NCHW kernel runs between the layout changes")
        return why
    kind = _int8_conv_kind(_static(types.get(node.inputs[3])) or (), node.attrs)
    return (f"its NCHW kernel ({_INT8_NCHW_WHY.get(kind) or _INT8_NCHW_WHY['other']}), "
            "so it runs where it reads NCHW and at most starts a channels-last chain, its "
            "result transposed")


def _links(nodes: Sequence[Any]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Which node writes each value, and which nodes read it (graph order)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.outputs if o}
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for name in n.present_inputs():
            readers.setdefault(name, []).append(i)
    return producer, readers


def _chain_members(nodes: Sequence[Any], kinds: Sequence[str | None], kept: set[str],
                   producer: Mapping[str, int], readers: Mapping[str, list[int]]
                   ) -> list[list[int]]:
    """The chains of a layout pass: the nodes of a kind (not None) joined by the values
    ``kept`` in its layout, each chain's nodes in graph order (the int8 channels-last
    chains and the float NCHWc regions)."""
    parent = list(range(len(nodes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for name in kept:
        for r in readers[name]:
            parent[root(r)] = root(producer[name])
    members: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        if kinds[i] is not None and (n.outputs[0] in kept or any(
                name in kept for name in n.present_inputs())):
            members.setdefault(root(i), []).append(i)
    return list(members.values())


def _chains(nodes: Sequence[Any], kinds: Sequence[str | None], nhwc: set[str],
            producer: Mapping[str, int], readers: Mapping[str, list[int]]
            ) -> dict[int, tuple[str, str]]:
    """The layouts of the chains (nodes joined by channels-last values) that hold a
    depthwise or dense convolution."""
    decided: dict[int, tuple[str, str]] = {}
    for chain in _chain_members(nodes, kinds, nhwc, producer, readers):
        depthwise = sum(kinds[i] == "depthwise" for i in chain)
        dense = sum(kinds[i] == "dense" for i in chain)
        if not depthwise and not dense:
            continue
        for i in chain:
            src = "nhwc" if nodes[i].inputs[0] in nhwc else "nchw"
            dst = "nhwc" if nodes[i].outputs[0] in nhwc else "nchw"
            role = _POOL_ROLE if kinds[i] == "pool" else _LAYOUT_ROLES[(src, dst)]
            if kinds[i] == "add" and (src, dst) == ("nchw", "nhwc"):
                role = _JOIN_ROLE.format(readers=len(readers[nodes[i].outputs[0]]))
            decided[i] = (f"{src}->{dst}", INT8_LAYOUT_REASON.format(
                nodes=len(chain), depthwise=depthwise, dense=dense, this=role))
    return decided


NCHWC = native_blocked.NCHWC
_FLOAT_LAYOUT_ROLES = {
    ("nchw", NCHWC): "starts it: reads X in NCHW where it lies, its result written blocked",
    (NCHWC, NCHWC): "inside it",
    (NCHWC, "nchw"): "ends it, its result written NCHW ({why})",
    ("nchw", "nchw"): "reads only its residual blocked, its X and result NCHW ({why})"}
FLOAT_LAYOUT_REASON = (
    "float NCHWc region of {nodes} conv(s) (planner.float_layouts): each runs the "
    "channel-blocked direct conv (3x3 or 1x1, stride 1 or 2; 16 output channels a vector, "
    "filters [M/16][C][K*K][16], each input value broadcast once for the taps that read "
    "it), the values between them kept "
    "[N][C/16][H][W][16] so that no conv inside transposes its result into NCHW (a lone "
    "blocked conv's transposes were 10 % of its time: docs/performance.md); a residual is "
    "read in the layout its producer wrote (this node: {this})")
FLOAT_LAYOUT_THREADS_REASON = ("{threads} kernel thread(s): the backend's thread count; the "
                               "node runs channel-blocked ({layout}), {split}")


def float_layouts(graph: Any, types: Mapping[str, TensorType | None],
                  variants: Sequence[str | None], threads: int | None = None,
                  profile: Any = None) -> dict[int, LayoutDecision]:
    """The float NCHWc regions: {node index: LayoutDecision} with layout
    ``"nchw->nchwc16"``, ``"nchwc16->nchwc16"``, ``"nchwc16->nchw"`` (or ``"nchw->nchw"``
    for a conv reading only its residual blocked) and the option ``residual_layout``.
    ``variants[i]`` is node i's variant here (None: elsewhere).

    A conv is blockable where it runs on the native variant and blocked_conv serves its
    static shapes. A value is kept blocked when a blockable conv writes it (its first
    output), it is no graph output, and every reader is a blockable conv reading it as
    X or as its residual; anything else (a pool, a graph output, a conv of another
    kernel or stride, of fewer than 16 or not a multiple of 16 channels) reads NCHW, so
    the conv writing it ends the region. The chains are found as the int8 pass's
    (_chain_members). A blockable conv in no region runs blocked alone, X and Y NCHW,
    where blocked_alone says (``"nchw->nchw"``). ``profile``: the
    hardware planned for (None: this machine), whose tile grid and vendor blocked_conv
    reads."""
    nodes = graph.nodes
    grid, vendor = tile_grid(profile), cpu_vendor(profile)
    geos = [_blockable(n, types, grid, vendor) if variants[i] == "native" else None
            for i, n in enumerate(nodes)]
    kinds = [None if g is None else "conv" for g in geos]
    producer, readers = _links(nodes)
    outputs = set(graph.output_names)

    def reads_blocked(i: int, name: str) -> bool:
        n = nodes[i]
        return kinds[i] is not None and name not in n.inputs[1:3] and (
            name == n.inputs[0] or (len(n.inputs) > 3 and name == n.inputs[3]))

    blocked = {name for name, i in producer.items()
               if kinds[i] is not None and name == nodes[i].outputs[0]
               and name not in outputs and readers.get(name)
               and all(reads_blocked(r, name) for r in readers[name])}
    decided: dict[int, LayoutDecision] = {}
    for chain in _chain_members(nodes, kinds, blocked, producer, readers):
        for i in chain:
            geo = geos[i]
            assert geo is not None                     # chains hold blockable convs only
            leaves = _leaves(nodes, nodes[i].outputs[0], readers, outputs, reads_blocked)
            decided[i] = _float_decision(nodes[i], geo, blocked, leaves, len(chain), threads)
    for i, geo in enumerate(geos):
        if geo is not None and i not in decided and blocked_alone(geo, threads):
            decided[i] = _lone_decision(geo, threads)
    return decided


# ---- a conv pooled while its rows are in cache ----------------------------------------
# pool_in_conv: a float conv whose only reader is the max pool right after it, the conv
# shallow (a network's first layer: at most POOL_IN_CONV_MAX_DEPTH input channels x taps,
# strided, at least BAND_FROM output pixels an image: the shapes of the one measured;
# LeNet's small convs and stride-1 convs were not) and the pool on window.c's row
# kernel (max_pool_by_rows: stride 2 across, at most three taps across, dilation 1; any
# rows, row stride and padding), runs as one native call
# (gemm.c's keel_conv_pool_f32, conv_pool.py): per band of pooled rows the conv's rows,
# their taps gathered as the gathered form gathers them (from a phase image of the X
# rows a step reads: the fill below), go into a buffer of the thread's and are pooled
# from there, so the conv's output (ResNet-18's stem: 3.1 MiB an image) is never
# written out and read back. Bitwise the conv then the pool. Measured on ResNet-18's
# stem (3 -> 64 7x7 stride 2, bias and ReLU, then MaxPool 3x3 stride 2 pad 1) on the
# 2-core Intel Xeon (KVM, AVX-512), alone against keel's two steps (the gathered conv
# and the row pool), alternating in one process, under load (a load average of 5):
# fastest of 100 at batch 1, one thread, 1.92-2.02 ms against 2.04-2.24 ms (0.90-0.95x);
# two threads 0.86-0.91x; batch 32 0.90-0.95x on one and two threads. In the model:
# docs/performance.md, "ResNet-18's stem pooled in cache". (Measured then with the taps
# built band by band as the band conv builds them; gathering them took the call to
# 0.94x of that at batch 1 and 0.90-0.96x at batch 32, alone: gemm.c.) Other vendors
# and AVX2 builds follow from it, not measured: the rule removes a 3.1 MiB write and
# read-back, which no cache hierarchy does for free.
POOL_IN_CONV = True
POOL_IN_CONV_MAX_DEPTH = 147
# Pooled rows a step: the buffer then holds the conv rows they read ((step - 1) * stride
# + kernel rows: 17 of ResNet-18's stem, 476 KiB with 64 channels of 112 columns, beside
# the phase image in the L2). Measured as above (with the band's B): 4, 6, 8 and 12
# within the noise of each other (0.90-0.98x), 16 0.98x.
POOL_IN_CONV_STEP = 8
POOL_IN_CONV_REASON = (
    "pooled in the conv (planner.pool_in_conv): {conv} computes its rows into a buffer "
    "of each thread's, its taps gathered from a phase image of up to {fill} row(s)' inputs, "
    "and this max pool pools them from there {step} pooled row(s) a step, so the conv's "
    "{mib:.1f} MiB output is never written out and read back (the conv's step does "
    "nothing; bitwise the conv then the pool)")
POOLED_BY_REASON = ("pooled while its rows are in cache by {pool}, which runs this conv "
                    "(planner.pool_in_conv)")


def pool_in_conv(graph: Any, types: Mapping[str, TensorType | None],
                 variants: Sequence[str | None], threads: int | None = None,
                 profile: Any = None, taken: Sequence[int] = ()
                 ) -> dict[int, LayoutDecision]:
    """The convs pooled while their rows are in cache: {node index: LayoutDecision}, the
    conv's with the option ``pooled_by`` (the pool's name; its layout its own), the
    pool's with layout ``"pooled"``, both with the option ``pool_in_conv`` (a
    native_gemm.PoolSplit's fields). ``variants[i]``: node i's variant here (None: elsewhere);
    ``taken``: nodes another layout pass decided (left as they are)."""
    if not POOL_IN_CONV:
        return {}
    nodes = graph.nodes
    producer, readers = _links(nodes)
    outputs = set(graph.output_names)
    grid = tile_grid(profile)
    decided: dict[int, LayoutDecision] = {}
    for i, node in enumerate(nodes):
        conv = i - 1
        if (node.op is not Op.MAX_POOL or i == 0 or variants[i] != "native"
                or variants[conv] != "native" or len([o for o in node.outputs if o]) != 1
                or conv in taken or i in taken):
            continue
        x = node.inputs[0]
        if producer.get(x) != conv or readers.get(x) != [i] or x in outputs:
            continue
        geo = _poolable_conv(nodes[conv], types, grid, graph.is_constant)
        pool = _row_pool(node, types)
        if geo is None or pool is None or geo.out_shape[2:] != pool.in_spatial:
            continue
        l2 = caches(profile).l2
        split = pool_in_conv_split(geo.batch, pool.out_spatial[0], threads or 1,
                                   pool.kernel[0], pool.strides[0], conv=geo, l2=l2)
        mib = math.prod(geo.out_shape) * 4 / 2**20
        one_call = (f"{threads or 1} kernel thread(s): the backend's thread count; the conv "
                    f"and the pool run as one call ({node.name}'s), "
                    f"{min(threads or 1, geo.batch * split.bands)} piece(s) of images x bands "
                    f"of pooled rows (pool_in_conv)")
        decided[i] = LayoutDecision(
            "pooled", POOL_IN_CONV_REASON.format(conv=nodes[conv].name, fill=split.fill,
                                                 step=split.step, mib=mib),
            threads_reason=one_call,
            options=(("pool_in_conv", dataclasses.astuple(split),
                      _pooled_split_reason(split, geo.batch, threads or 1,
                                           max(0, pool.kernel[0] - pool.strides[0]))
                      + _pool_fill_reason(split, geo, pool.kernel[0], pool.strides[0],
                                          l2)),))
        decided[conv] = LayoutDecision(None, "", threads_reason=one_call, options=(
            ("pooled_by", node.name, POOLED_BY_REASON.format(pool=node.name)),
            decided[i].options[0]))
    return decided


def _poolable_conv(node: Any, types: Mapping[str, TensorType | None], grid: Grid,
                   constant: Callable[[str], bool]) -> ConvGeometry | None:
    """A float conv's geometry where pool_in_conv serves it: 2-D, one group, no
    residual, no fused activation but ReLU or a clip (the band conv's epilogue), at most
    POOL_IN_CONV_MAX_DEPTH deep, strided and of at least BAND_FROM output pixels an image
    (a network's first layer on a large image, as the stem measured), float32, the
    native tile known, its filter and bias ``constant`` (the graph's own test: the pooled
    call packs them once, so a filter made at run time, as int8 precision's dequantized
    one, or an initializer the caller may override, listed as a graph input too, is not
    served)."""
    if node.op is not Op.CONV or len(node.inputs) < 2 or grid is None or (
            len(node.inputs) > 3 and node.inputs[3]) or any(
            not constant(name) for name in node.inputs[1:3] if name):
        return None
    act = conv_epilogue.activation(node.attrs.get("activation", ""),
                                   node.attrs.get("activation_params", ()))
    if act[0] not in ("", "clip"):
        return None
    x, w = (types.get(name) for name in node.inputs[:2])
    out = types.get(node.outputs[0])
    if x is None or x.dtype is not DType.FLOAT32 or out is None or (
            out.dtype is not DType.FLOAT32):
        return None
    geo = _static_geometry(PlanRequest(node.op, (x, w), dict(node.attrs), None, None))
    if (geo is None or geo.group != 1 or geo.window.rank != 2
            or all(s == 1 for s in geo.window.strides)
            or math.prod(geo.window.out_spatial) < BAND_FROM):
        return None
    return geo if geo.in_channels * math.prod(geo.window.kernel) <= POOL_IN_CONV_MAX_DEPTH \
        else None


def _row_pool(node: Any, types: Mapping[str, TensorType | None]) -> Any:
    """A float32 max pool's window where window.c's row kernel serves it; else None."""
    x, y = types.get(node.inputs[0]), types.get(node.outputs[0])
    if (x is None or y is None or x.dtype is not DType.FLOAT32 or y.dtype is not DType.FLOAT32
            or x.shape is None or len(x.shape) != 4
            or not all(isinstance(d, int) for d in x.shape)):
        return None
    try:
        win = pool_window(Op.MAX_POOL, [int(d) for d in x.shape if isinstance(d, int)],
                          dict(node.attrs))
    except KeelError:
        return None
    ok = win.rank == 2 and max_pool_by_rows(win.kernel, win.strides, win.dilations)
    return win if ok else None


def pool_in_conv_split(batch: int, pooled_rows: int, threads: int, window_rows: int,
                       window_stride: int, conv: ConvGeometry | None = None,
                       l2: int | None = None) -> native_gemm.PoolSplit:
    """How pool_in_conv's call runs: bands of pooled rows an image, so that images x
    bands divide evenly over the threads (threads / gcd(batch, threads), at most a band
    a pooled row); POOL_IN_CONV_STEP pooled rows a step; conv rows a phase image: all
    that a step's pool windows read (derived: one phase image a step, so its extra rows,
    the taps' reach below a step's last conv row, are copied once a step; 4, 8 and all
    17 of ResNet-18's stem measured alike, docs/performance.md "ResNet-18's stem pooled
    in cache"), fewer where ``conv``'s phase image of that many rows would not fit an
    ``l2``-byte L2 beside the conv rows held (:func:`pool_fill`)."""
    bands = max(1, min(pooled_rows, threads // math.gcd(max(batch, 1), threads)))
    rows = (POOL_IN_CONV_STEP - 1) * window_stride + window_rows
    fill = rows if conv is None or l2 is None else pool_fill(conv, rows, l2)
    return native_gemm.PoolSplit(bands, POOL_IN_CONV_STEP, fill)


def pool_fill(conv: ConvGeometry, rows: int, l2: int) -> int:
    """Conv rows a phase image of pool_in_conv's call: ``rows`` (a step's, the rows the
    thread's buffer holds), fewer where the phase image of that many rows and that
    buffer would outgrow the ``l2`` bytes of L2 the plan is sized for (derived: a step's
    tiles read the phase image and write the buffer over and over; an image too wide
    for both in L2 streams them. gemm.c's gather_floats: every phase and input channel,
    the rows and the taps' reach below them, ow plus the taps' reach across). Where not
    even one row's image fits beside the buffer, the buffer alone outgrows the L2 and a
    cap would save nothing but gather the taps' reach again each fill: all ``rows``.
    ResNet-18's stem (476 KiB of rows, 108 KiB of image for 17) keeps all 17 from a
    1 MiB L2 (measured), 3 with 512 KiB (derived, unmeasured) and 17 below 476 KiB."""
    win = conv.window
    (sh, sw), (kh, kw), (dh, dw) = win.strides, win.kernel, win.dilations
    ow = win.out_spatial[1]
    reach = (kh - 1) * dh // sh
    row_bytes = sh * sw * conv.in_channels * (ow + (kw - 1) * dw // sw) * 4
    room = l2 - conv.out_channels * rows * ow * 4
    fits = room // row_bytes - reach
    return rows if fits < 1 else min(rows, fits)


def _pool_fill_reason(split: native_gemm.PoolSplit, conv: ConvGeometry, window_rows: int,
                      window_stride: int, l2: int) -> str:
    """The fill's clause of pool_in_conv's reason where pool_fill capped it."""
    rows = (split.step - 1) * window_stride + window_rows
    if split.fill >= rows:
        return ""
    return (f"; a phase image of {split.fill} of a step's {rows} conv rows: more, beside "
            f"the conv rows held, would outgrow the {l2 >> 10} KiB L2 the plan is sized for "
            "(derived, planner.pool_fill)")


def _pooled_split_reason(split: native_gemm.PoolSplit, batch: int, threads: int,
                         shared: int) -> str:
    """``shared``: the conv rows two neighbouring bands' windows both read (the pool
    window's rows less its row stride, at least 0)."""
    units = max(batch, 0) * split.bands
    extra = "" if split.bands == 1 or shared == 0 else (
        f"; a band's first {shared} conv row(s), shared with the band before it, are "
        f"computed by both ({(split.bands - 1) * shared} extra row(s) an image)")
    return (f"{split.bands} band(s) of pooled rows an image, {units} unit(s) (images x "
            f"bands) over up to {threads} thread(s): threads / gcd(batch, threads) bands, so "
            f"the units divide evenly{extra}")


def _blockable(node: Any, types: Mapping[str, TensorType | None], grid: Grid,
               vendor: str | None) -> ConvGeometry | None:
    """A float conv node's geometry where blocked_conv serves it; None otherwise."""
    if node.op is not Op.CONV or len(node.inputs) < 2:
        return None
    x, w = (types.get(name) for name in node.inputs[:2])
    if x is None or x.dtype is not DType.FLOAT32:
        return None
    request = PlanRequest(node.op, (x, w), dict(node.attrs), None, None)
    geo = _static_geometry(request)
    return geo if geo is not None and blocked_conv(geo, grid, vendor) else None


def _float_decision(n: Any, geo: ConvGeometry, blocked: set[str], leaves: str, size: int,
                    threads: int | None) -> LayoutDecision:
    """One region conv's layout, why (``leaves``: why its result is NCHW, where it is),
    its split and its residual's layout."""
    src = NCHWC if n.inputs[0] in blocked else "nchw"
    dst = NCHWC if n.outputs[0] in blocked else "nchw"
    residual = n.inputs[3] if len(n.inputs) > 3 and n.inputs[3] else ""
    layout = f"{src}->{dst}"
    role = _FLOAT_LAYOUT_ROLES[(src, dst)].format(why=leaves)
    why = FLOAT_LAYOUT_REASON.format(nodes=size, this=role)
    options: tuple[tuple[str, Any, str], ...] = ()
    if residual:
        where = NCHWC if residual in blocked else "nchw"
        options = (("residual_layout", where,
                    "the residual as its producer wrote it: " + (
                        "blocked, inside the region" if where == NCHWC else
                        "NCHW, written outside the region, transposed 16 x 16 as it is "
                        "added")),)
    return _blocked_decision(geo, layout, why, threads, options)


def _lone_decision(geo: ConvGeometry, threads: int | None) -> LayoutDecision:
    """A conv outside any region that runs channel-blocked alone (blocked_alone): X,
    Y and any residual NCHW, the kernel transposing its sums into Y's rows."""
    least = blocked_alone_width(geo.out_channels, batch_on_many_threads(
        geo, threads, BLOCKED_ALONE_MANY_THREADS))
    why = BLOCKED_ALONE_REASON.format(width=geo.window.out_spatial[1], least=least)
    if least == BLOCKED_ALONE_MANY_MIN_WIDTH:
        why += (f"; a batch of {geo.batch} split over {BLOCKED_ALONE_MANY_THREADS} threads or "
                f"more (BLOCKED_ALONE_MANY_THREADS) takes rows of {least} pixels too (measured "
                f"on ResNet-18's 256 -> 512 at batch 32 on a 16-core Intel Xeon: 0.77x the "
                f"masked form)")
    return _blocked_decision(geo, "nchw->nchw", why, threads, ())


def _blocked_decision(geo: ConvGeometry, layout: str, why: str, threads: int | None,
                      options: tuple[tuple[str, Any, str], ...]) -> LayoutDecision:
    """A blocked conv's layout decision: ``why``, its split on more than one thread
    (the conv's and blocked_split's grid), ``options``, and the blocked kernel's variant
    and scratch. Its NCHW form carries no gemm_lanes_tail for the blocked kernel to
    ignore: blocked_conv takes no 1x1 stride-1 conv, the direct form's only."""
    split = (split_reason(conv_splits("native", layout, None, geo, threads), threads)
             + f"; {blocked_split(geo, threads).reason}") if threads and threads > 1 else ""
    return LayoutDecision(
        layout, f"{why}; {split}" if split else why,
        FLOAT_LAYOUT_THREADS_REASON.format(threads=threads, layout=layout, split=split)
        if split else "", options, _blocked_fields(geo, threads or 1))


def _blocked_fields(geo: ConvGeometry, threads: int) -> tuple[tuple[str, Any, str], ...]:
    """A blocked conv's variant and scratch as the blocked kernel runs it, in a region or
    alone (its plan was made for the NCHW form it replaces)."""
    tile, rows = blocked_oc_tile(geo.out_channels), blocked_rows(geo)
    width, parts = geo.window.out_spatial[1], blocked_parts(geo, threads)
    floats = tile * native_blocked.LANES * rows * width
    return (("variant", "native",
             "native: the channel-blocked direct conv (blocked.c), X read where it "
             "lies, inside a float NCHWc region or alone (the layout says why); "
             + _blocked_rows_reason(geo) + "; " + _blocked_tiles_reason(geo)),
            ("workspace_bytes", 4 * floats * parts,
             f"a thread's sums of one register tile's band ({tile} x 16 channels x {rows} "
             f"row(s) x {width} pixels) on each of {parts} thread(s); X is read in place"))


def _leaves(nodes: Sequence[Any], name: str, readers: Mapping[str, list[int]],
            outputs: set[str], reads_blocked: Callable[[int, str], bool]) -> str:
    """Why a value is not kept blocked: a graph output, or the first reader that reads
    NCHW."""
    if name in outputs:
        return f"{name} is a graph output"
    for r in readers.get(name, ()):
        if not reads_blocked(r, name):
            node = nodes[r]
            why = ("not a blockable conv (blocked_conv: 3x3 padded by one or 1x1 unpadded, "
                   "stride 1 or 2, 16 or more input channels and output channels in whole "
                   "blocks of 16, not 1x1 at stride 1, an AVX-512 core of BLOCKED_VENDORS, "
                   "on the native variant)"
                   if node.op is Op.CONV else "not a conv")
            return f"{name} is read by {node.name} ({node.op.value}: {why}), which reads NCHW"
    return f"{name} has no reader"


def int8_reason(op: Op) -> str:
    """Why ``op`` runs on the native int8 kernel, naming the instructions it uses."""
    from keel.backends.cpu import native_qgemm  # int8 models only

    isa = native_qgemm.isa() or "portable"
    return (f"{op.value}: int8 kernel, int32 accumulation with {_INT8_ISA[isa]}, weights "
            "packed once as int8, requantization fused into the store")


def _dispatched(op: Op, request: PlanRequest, table: KernelTable) -> str | None:
    """The conv variant a dispatching conv node (conv2d) runs; None when not known."""
    if op not in CONV_OPS or not table.get(op).meta.get("dispatcher"):
        return None
    conv, _ = usable_variants(Op.CONV, table)
    name, _ = _choose_conv(op, request.input_types, request.attrs, conv, request.dtype)
    return None if name == "default" else name


# ---- threads: the least work worth a worker thread ----------------------------------------
# A dispatch to a spinning keel worker costs about a microsecond (tens to a sleeping one,
# but then the calling thread takes the chunk itself), so a call splits over threads
# only while each gets at least this much work. Each kernel family counts its own unit:
# - the native GEMM, flops (a 1x784x512 product: 18 us on one thread, 10 us on two);
# - the native window kernels (depthwise, pooling), output positions x taps (they run
#   about 5-15 per nanosecond);
# - the fastmath kernels (activations, softmax, norms), elements (GELU: ~0.7 ns each);
# - Winograd's compiled transforms, input or output floats.
# A node's plan gives its thread count (for a MatMul or Gemm from its product's flops);
# a kernel that runs several products or chunks per node splits each call by its own
# work under that count, with these same limits. The values are this machine's
# (2 cores); every split reads them through least_work (below), which derives them from
# the running machine's measured thread costs where those are measured.
MIN_FLOPS_PER_THREAD = 400_000
MIN_CHUNK_TAPS = 50_000
# - a global pool (window.c's row kernel: each input element read once, summed in 16
#   lanes), window taps counted per element it reads: its element costs more than a
#   depthwise tap, which reads one loaded element for nine taps. Measured on the 2-core
#   Intel Xeon, one thread, fastest of 1,000 calls, under load (load 9-10): a 32x512x7x7
#   GlobalAveragePool (ResNet-18 at batch 32) 8.2 elements/ns, 1x1280x7x7 12.7, against
#   the window family's 20.2 taps/ns (thread_costs, the same machine): 1.6-2.5 taps an
#   element, 2 taken. On the 16-core Xeon the pool read its 802,816 elements in 4
#   pieces in 123 us, 1.6 elements/ns a thread, where taps counted 1 an element
#   predicted 17 us a piece: counting 1 left it on fewer threads than its work fills.
GLOBAL_POOL_TAPS_PER_ELEMENT = 2
MIN_CHUNK_ELEMENTS = 8192
# A SkipLayerNorm node (two reads, up to two writes an element) splits only where each
# thread gets this many elements. Its bound native call, rows of 256, alternating
# passes, best of 25 (a loaded 2-core AMD EPYC, Zen 5): 16,384 elements 6.1-6.3 us on
# one thread, 6.3-10.0 on two (the pool's wake-up costs what the second half saves);
# 24,576: 8.8-9.1 against 5.1-5.4; 32,768 (BERT-mini at batch 1): 11.5-11.9 against
# 6.4 (medians too noisy under load to say more).
MIN_SKIP_NORM_ELEMENTS = 12288
MIN_CHUNK_FLOATS = 16384
# - a plain copy (a Transpose's strided copy, window.c), elements: a copy runs at about
#   0.1 ns an element in cache, 4-8 times an activation's rate, so it needs that much
#   more work before a second thread pays. Measured on the 2-core AMD EPYC: BERT-mini's
#   sixteen head transposes of 32,768 elements at batch 1 took 0.142 ms on one thread
#   and 0.222 ms split in two (per-node profile); a 32,768-element copy takes 2.7 us.
MIN_COPY_ELEMENTS = 65536
# - a product of one row panel streaming its weight B (streams_b, below), floats of B: the
#   least time a thread of MIN_CHUNK_FLOATS, at the rate such a product streams a B held
#   in the L2 instead of the transforms' (derived; the rates measured on the 2-core Intel
#   Xeon, native GEMM on one thread, medians of 20,000 calls, under load: 1x400x120
#   19 floats/ns, 1x256x256 21, 1x512x256 24, 1x256x1024 25; the transforms' 11.3):
#   16,384 x 21 / 11.3 = 30,450, rounded up to a power of two.
MIN_STREAM_FLOATS = 32768
# The tree-ensemble walk (cpu/trees.py): (row, tree) pairs walked at once, which bounds
# the walk's scratch to a few tens of MiB; below TREE_PARALLEL_PAIRS pairs per thread one
# thread walks them all (handing a block to another thread costs tens of microseconds, as
# much as walking that many pairs); pairs at a leaf are set aside once they are
# 1/TREE_SET_ASIDE of those still walking.
TREE_PAIRS_PER_BLOCK = 1 << 18
TREE_PARALLEL_PAIRS = 1 << 14
TREE_SET_ASIDE = 4


# ---- the least work, per machine ------------------------------------------------------
# The values above were measured on a 2-core AMD EPYC. Each says: a split pays
# once a thread's share takes longer than the dispatch that hands it out, by a margin. So
# each is derived, by one rule, from this machine's thread costs where they are measured
# (thread_costs: the pool's dispatch round trip at each thread count, and each family's
# one-thread rate):
#     least work(t threads) = factor x rate x dispatch(t)
# with the factor chosen so that the reference machine's measured costs give the
# declared value back: factor = declared / (reference rate x reference dispatch), i.e.
#     least work(t) = declared x (rate / reference rate) x (dispatch(t) / reference dispatch)
# A machine whose cores run a kernel twice as fast, or whose pool takes twice as long to
# get every thread into a job, asks twice the work of each thread; a dispatch that grows
# with the thread count (waking 15 workers across a socket) asks more of wide splits.
# The references: thread_costs.measure() on a 2-core Intel Xeon (KVM, AVX-512, AMX; 2 MiB
# L2 a core). The rates: 12 runs of it in two processes with the current kernels (after
# the Winograd transforms' speed-up), the machine loaded (load average 4.5-7 on its 2
# cores), each point the median of up to 200 repeats; the medians of the runs (their
# range): GEMM 147 flops/ns (140-163), window 20.5 taps/ns (18.3-22.2), GELU 1.91
# elements/ns (1.73-2.04), copy 1.19 (1.03-1.21), Winograd 11.3 floats/ns (10.7-11.6).
# The dispatch: 4 earlier runs, less loaded, 0.72-0.84 us (the 12 runs above, under that
# load, gave 6.8-7.1 us: see below).
# The declared values themselves were measured on the 2-core AMD EPYC above, whose costs
# were not measured: the rule takes them as that 2-core Xeon's, a machine of the same
# kind (two cores of one socket, AVX-512, a pool dispatch under a microsecond). Under
# heavier load (4 runnable processes on the 2 cores) the dispatch took 7.0 us: a worker
# waits for a time slice, and a measurement then asks more work of each thread, as it
# should there.
THREAD_COST_REFERENCE_MACHINE = "a 2-core AMD EPYC; costs measured on a 2-core Intel Xeon"
THREAD_COST_REFERENCE_DISPATCH_US = 0.74
THREAD_COST_REFERENCE_RATES = {
    thread_costs.Family.GEMM: 147.0,         # flops a ns: 32x256 @ 256x256, B packed
    thread_costs.Family.WINDOW: 20.5,        # taps a ns: 3x3 depthwise, 32 28x28 planes
    thread_costs.Family.FASTMATH: 1.91,      # elements a ns: GELU of 16,384 floats
    thread_costs.Family.COPY: 1.19,          # elements a ns: a 128x256 transpose
    thread_costs.Family.WINOGRAD: 11.3,      # floats a ns: input transform, 64 14x14 planes
}
# A measurement off by more than this either way (a machine busy while it was taken, a
# clock gone wrong) is held to it: the declared values are not wrong by more than that.
THREAD_COST_SCALE_LIMIT = 16.0


@dataclass(frozen=True)
class LeastWork:
    """A least work a thread: its declared constant (read when asked: tests lower it)
    and the family whose measured costs scale it. The kinds are its class attributes
    (``LeastWork.FLOPS`` ..., all of them in ``LeastWork.ALL``): a plain class, as the
    splits ask on every call and an enum's ``value`` costs half a microsecond."""

    constant: str
    family: thread_costs.Family
    FLOPS: ClassVar[LeastWork]
    TAPS: ClassVar[LeastWork]
    ELEMENTS: ClassVar[LeastWork]
    SKIP_NORM: ClassVar[LeastWork]
    FLOATS: ClassVar[LeastWork]
    COPY: ClassVar[LeastWork]
    STREAM: ClassVar[LeastWork]
    ALL: ClassVar[tuple[LeastWork, ...]]

    @property
    def declared(self) -> int:
        return int(globals()[self.constant])


LeastWork.FLOPS = LeastWork("MIN_FLOPS_PER_THREAD", thread_costs.Family.GEMM)
LeastWork.TAPS = LeastWork("MIN_CHUNK_TAPS", thread_costs.Family.WINDOW)
LeastWork.ELEMENTS = LeastWork("MIN_CHUNK_ELEMENTS", thread_costs.Family.FASTMATH)
LeastWork.SKIP_NORM = LeastWork("MIN_SKIP_NORM_ELEMENTS", thread_costs.Family.FASTMATH)
LeastWork.FLOATS = LeastWork("MIN_CHUNK_FLOATS", thread_costs.Family.WINOGRAD)
LeastWork.COPY = LeastWork("MIN_COPY_ELEMENTS", thread_costs.Family.COPY)
LeastWork.STREAM = LeastWork("MIN_STREAM_FLOATS", thread_costs.Family.WINOGRAD)
LeastWork.ALL = (LeastWork.FLOPS, LeastWork.TAPS, LeastWork.ELEMENTS, LeastWork.SKIP_NORM,
                 LeastWork.FLOATS, LeastWork.COPY, LeastWork.STREAM)


def least_work(work: LeastWork, threads: int = 2) -> int:
    """The least work worth each thread of a split over ``threads`` threads: the declared
    value, scaled by this machine's measured thread costs where they are measured."""
    costs = thread_costs.current().costs
    if costs is None:
        return work.declared
    return max(1, round(work.declared * cost_scale(costs, work.family, threads)))


def least_named(work: LeastWork, threads: int | None) -> str:
    """A reason's words for the least work of a split over ``threads``: the constant's
    name with its value where it is the declared one, else what it was derived from."""
    value = least_work(work, max(1, threads or 1))
    if value == work.declared:
        return f"{work.constant} = {value:,}"
    return f"least work ({work.constant}, scaled to this machine's costs) = {value:,}"


def cost_scale(costs: thread_costs.ThreadCosts, family: thread_costs.Family,
               threads: int) -> float:
    """How many times the declared least work ``costs`` ask of a thread (the rule above)."""
    scale = (costs.rate(family) / THREAD_COST_REFERENCE_RATES[family]
             * costs.dispatch(threads) / THREAD_COST_REFERENCE_DISPATCH_US)
    return min(THREAD_COST_SCALE_LIMIT, max(1 / THREAD_COST_SCALE_LIMIT, scale))


def split_threads(work: LeastWork, threads: int, units: int) -> int:
    """The most threads (up to ``threads``) whose every one gets the least work of a
    split that wide out of ``units`` (1 or less: not split)."""
    if thread_costs.current().costs is None:           # declared: the same for any width
        return min(threads, units // work.declared)
    most = min(threads, units // least_work(work, 2))   # a wider split asks no less
    for count in range(most, 1, -1):
        if units // least_work(work, count) >= count:
            return count
    return most


def split_parts(work: LeastWork, threads: int, items: int, per_item: int = 1) -> int:
    """How many chunks ``items`` items of ``per_item`` work each split into on up to
    ``threads`` threads (keel.native.pool.parts: whole items a chunk, 0 for no items):
    the most whose every chunk gets the least work of a split that wide, the rule
    split_threads applies to work alone."""
    per = max(1, per_item)
    count = parts(items, max(1, threads), max(1, least_work(work, 2) // per))
    if thread_costs.current().costs is None:           # declared: the same for any width
        return count
    while count > 1 and parts(items, count, max(1, least_work(work, count) // per)) < count:
        count -= 1                                     # a narrower split asks no more
    return count


def gemm_threads(threads: int, flops: int) -> int:
    """The threads a native product of ``flops`` splits over under a cap of ``threads``
    (1 or less: not split)."""
    return split_threads(LeastWork.FLOPS, threads, flops)


def least_work_table(threads: int) -> dict[str, Any]:
    """The least work a thread of each kernel family, on 2 threads and on ``threads``, and
    where it comes from, as plain data (``keel probe --thread-costs --json``)."""
    source = thread_costs.current()
    return {"source": source.reason,
            "costs": None if source.costs is None else source.costs.to_dict(),
            "least_work": {w.constant: {"unit": w.family.unit, "declared": w.declared,
                                        **{f"{t} threads": least_work(w, t)
                                           for t in sorted({2, max(2, threads)})}}
                           for w in LeastWork.ALL}}


def thread_costs_note(threads: int) -> str:
    """Where the least work a thread comes from, for the plan's notes."""
    source = thread_costs.current()
    costs = source.costs
    if costs is None:
        values = ", ".join(f"{w.constant} {w.declared:,} {w.family.unit}" for w in LeastWork.ALL)
        return (f"least work a thread: declared, measured on {THREAD_COST_REFERENCE_MACHINE} "
                f"({values}); {source.reason}")
    spans = ", ".join(f"{s.median:.2f} us on {t} threads ({s.low:.2f}-{s.high:.2f})"
                      for t, s in costs.dispatch_us)
    wide = max(2, threads)
    values = ", ".join(f"{w.constant} {least_work(w, 2):,}" + (
        f" ({least_work(w, wide):,} at {wide})" if least_work(w, wide) != least_work(w, 2)
        else "") + f" {w.family.unit}" for w in LeastWork.ALL)
    return (f"least work a thread: {source.reason}: dispatch {spans}; one thread "
            + ", ".join(f"{f.value} {s.median:,.2f} {f.unit}/ns" for f, s in costs.rates)
            + f" -> least {values} a thread (declared x rate x dispatch, against "
            f"{THREAD_COST_REFERENCE_MACHINE})")


# A product of one row panel (M at most the micro-tile's rows: a model at batch 1) whose
# B is a weight packed once does 2 x M flops for each float of B it reads: its time is
# streaming B through the caches, not its flops, so its split counts B's floats against
# MIN_STREAM_FLOATS (a streaming pass's least time a thread, scaled with the transforms'
# measured costs) instead of its flops against the GEMM's. Measured on the 2-core Intel
# Xeon (native GEMM, one thread, medians of 300 calls, under load): 1x256x256 3.1 us and
# 1x256x1024 10.3 us with B in the L2 (about 21 floats/ns), 8.9-11 and 32-41 us with B
# gone past the L2 (7-8 floats/ns): the least work is set for a B in the L2, the faster.
# The split is by columns, the same share of every such B to the same thread run after
# run (threads.c's owned chunks): where a model's weights overflow one core's L2 but each
# thread's share fits its own, every core keeps its share there. small_block at batch 1
# (3 MiB of weights, 2 MiB L2s) is that case: onnxruntime, which splits these products,
# runs it 2.1-2.4x faster on two threads than on one (docs/performance.md).
def streams_b(batch: int, m: int, rows: int, raw: tuple[bool, bool]) -> bool:
    """Whether a native product streams its B (see above): one product of at most
    ``rows`` rows (the micro-tile's) with B packed once (``raw[1]`` False)."""
    return batch == 1 and m <= rows and not raw[1]


def product_threads(threads: int, batch: int, m: int, n: int, k: int, rows: int,
                    raw: tuple[bool, bool]) -> int:
    """The threads a native product splits over under a cap of ``threads``: by its flops,
    or where it streams B (:func:`streams_b`) by B's floats if they ask more."""
    parts = gemm_threads(threads, 2 * batch * m * n * k)
    if streams_b(batch, m, rows, raw):
        parts = max(parts, split_threads(LeastWork.STREAM, threads, k * n))
    return parts


def product_work(threads: int, m: int, n: int, k: int) -> str:
    """A reason's words for the B a product of ``m`` rows streams (:func:`streams_b`)."""
    return (f"{m} row(s), so the product streams B (a weight; the kernel asks again for "
            f"another B): {k * n:,} floats of B, at least "
            f"{least_named(LeastWork.STREAM, max(2, threads))} per thread")


# ---- threads: how the pool's spinning threads give way ------------------------------------
# keel's idle workers spin for the next job, and a caller spins for its job's last chunks
# (threads.c). Where other work shares the cores, a spinning thread may give its core away
# (sched_yield) every POOL_YIELD_SPINS spins. To any thread (what the pool did before): a
# worker on a core another process runs loses it for a scheduler slice each time and
# misses the run's jobs. Only where another of keel's threads last ran on its CPU
# (POOL_YIELD_SHARED): a worker on the caller's core still hands it back at once (the
# case the yield was made for: the caller otherwise waits out the worker's slice), and a
# worker on a core shared with other work spins on and takes its jobs, as onnxruntime's
# workers do. Measured on the 2-core Intel Xeon under load (load average 1-3.6, other
# processes on the cores), one process, the two ways alternating block by block, medians
# of 400 runs (fastest in brackets), two threads at batch 1, us: ResNet-20 694 (548)
# against 667 (465), 734 (650) against 561 (468); MobileNetV2 7,614 against 6,704, 10,098
# against 7,238; small_block 197 (133) against 196 (57); the MLP and LeNet within 3 %
# (docs/performance.md, "Spinning threads yield to keel's own threads").
# POOL_YIELD_SPINS: 2.7 us of spinning on that Xeon (a pause 10.4 ns, measured), the
# interval the pool had; with the yield kept to a shared CPU, 64 to 4,096 spins measured
# alike there (ResNet-20 at batch 1, under load 5), so it stays a declared value.
POOL_YIELD_SPINS = 256
POOL_YIELD_SHARED = True


@dataclass(frozen=True)
class PoolYield:
    """How keel's spinning threads give their core away (keel.native.pool.set_yield):
    every ``spins`` spins (0: never), with ``shared`` only where another of keel's
    threads last ran on the same CPU; ``reason`` says why."""

    spins: int
    shared: bool
    reason: str


def pool_yield() -> PoolYield:
    """The pool's yield, decided once for the process (the pool is one for every model)."""
    if not POOL_YIELD_SHARED:
        return PoolYield(POOL_YIELD_SPINS, False,
                         f"spinning threads give their core to any thread every "
                         f"{POOL_YIELD_SPINS} spins (POOL_YIELD_SPINS)")
    return PoolYield(POOL_YIELD_SPINS, True,
                     f"spinning threads give their core away every {POOL_YIELD_SPINS} spins "
                     "(POOL_YIELD_SPINS) only where another of keel's threads last ran on "
                     "the same CPU (POOL_YIELD_SHARED): a worker on a core shared with "
                     "other work keeps spinning for its jobs, one on the caller's core "
                     "hands it back")


# ---- the native GEMM's split over threads ----------------------------------------------
# A split runs gemm.c's keel_gemm_tiles_f32: every product of a batch cut into a grid of
# tiles, its row panels in R groups and its column panels in C groups (whole panels, as
# even as they allow); each thread takes consecutive tiles and runs each whole, its A
# rows and B columns packed in its own workspace (no buffer shared between threads).
# The grid is chosen for the machine planned for: its threads (gemm_threads: the
# product's flops under the cap, itself the probe's usable cores unless the caller says
# otherwise) and its L2 (caches()). Among grids of at most twice as many tiles per
# product as threads, in order:
# - the least work on the busiest thread, in micro-tile vectors (a partial panel costs
#   the vectors it has), grids within SPLIT_BALANCE_SLACK of the least counting as equal
#   (a 2% evener split is not worth reading an operand twice);
# - a grid whose tile keeps its A rows and B columns of one depth block (gemm.c's KC)
#   within the L2, so each thread's operands stay in its own cache;
# - the fewest operand reads over all tiles (A read once per column group, B once per
#   row group; a raw operand, packed by every tile that reads it, counts twice: a read
#   and a write);
# - the squarest tile (in panels), then the fewest tiles.
# On two threads this keeps the 1-D choices measured before the grid existed (the larger
# panel dimension splits), within the noise of the products of the benchmark models.
SPLIT_BALANCE_SLACK = 1 / 32


@dataclass(frozen=True)
class GemmSplit:
    """How a native product splits over threads: ``rows`` x ``cols`` tiles of each of
    the batch's products, ``parts`` chunks of consecutive tiles (1: not split)."""

    rows: int
    cols: int
    pieces: int
    parts: int
    reason: str


def gemm_split(batch: int, m: int, n: int, k: int, threads: int, grid: Grid = None,
               sizes: Caches | None = None, raw: tuple[bool, bool] = (True, False),
               lanes: bool = False) -> GemmSplit:
    """The tile grid of ``batch`` products of (m x k) @ (k x n) under a cap of
    ``threads`` (see the rule above). ``grid``: the kernel's micro-tile (None: the one
    loaded here); ``sizes``: the caches planned for (None: this machine's); ``raw``:
    whether A and B are packed per call (a MatMul's activations; its weights are not);
    ``lanes``: the product runs in lanes tiles (lanes_tiles), whose work is the columns
    there are, not whole vectors. Remembered per arguments and least work a thread (the
    thread costs' token and the declared values): a call made again asks again."""
    least = (thread_costs.current().token, MIN_FLOPS_PER_THREAD, MIN_STREAM_FLOATS)
    return _gemm_split(batch, m, n, k, threads, grid, sizes, raw, lanes, least)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _per_least_flops(plan: Callable[_P, _R]) -> Callable[_P, _R]:
    """``plan`` remembered per arguments and least work a thread (the thread costs'
    token and the declared MIN_FLOPS_PER_THREAD), as gemm_split is: for a plan whose
    split comes from gemm_threads."""
    @functools.lru_cache(maxsize=512)
    def remembered(least: tuple[str, int], *args: Any, **kwargs: Any) -> _R:
        return plan(*args, **kwargs)

    @functools.wraps(plan)
    def ask(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        least = (thread_costs.current().token, MIN_FLOPS_PER_THREAD)
        return remembered(least, *args, **kwargs)  # type: ignore[arg-type]  # hashable

    return ask


@functools.lru_cache(maxsize=4096)
def _gemm_split(batch: int, m: int, n: int, k: int, threads: int, grid: Grid,
                sizes: Caches | None, raw: tuple[bool, bool], lanes: bool,
                least: tuple[str, int, int]) -> GemmSplit:
    tile = grid or native_gemm.geometry() or _TILES["scalar"]
    sizes = sizes or caches()
    parts = product_threads(threads, batch, m, n, k, tile[0], raw)
    if parts <= 1 or batch * m * n == 0:
        flops = 2 * batch * m * n * k
        # A split needs twice the least work: each of two threads gets it.
        streamed = (f", and {k * n:,} floats of B, under {least_work(LeastWork.STREAM, 2):,} "
                    "for each of two threads" if streams_b(batch, m, tile[0], raw) else "")
        return GemmSplit(1, 1, batch, 1, "not split: one thread" if threads <= 1 else (
            f"not split: {flops:,} flops, under {least_work(LeastWork.FLOPS, 2):,} for each of two "
            f"threads{streamed}"))
    shape = _Product(batch, m, n, k, tile, native_gemm.depth_block(), raw, lanes)
    return _best_split(shape, parts, sizes.l2, sizes.source)


@dataclass(frozen=True)
class _Product:
    batch: int
    m: int
    n: int
    k: int
    tile: tuple[int, int]
    kc: int                       # gemm.c's depth block
    raw: tuple[bool, bool]
    lanes: bool = False

    @property
    def panels(self) -> tuple[int, int]:
        return -(-self.m // self.tile[0]), -(-self.n // self.tile[1])

    def vectors(self) -> tuple[int, ...]:
        """The column vectors of each column panel (two a panel; a partial one fewer);
        in lanes tiles its columns."""
        nr = self.tile[1]
        if self.lanes:
            return tuple(min(nr, self.n - j) for j in range(0, self.n, nr))
        vw = max(1, nr // 2)
        return tuple(-(-min(nr, self.n - j) // vw) for j in range(0, self.n, nr))

    def tile_shape(self, r: int, c: int) -> tuple[int, int]:
        """Rows and columns of the largest tile of an r x c grid."""
        (mr, nr), (mp, np_) = self.tile, self.panels
        return min(self.m, -(-mp // r) * mr), min(self.n, -(-np_ // c) * nr)

    def block_bytes(self, r: int, c: int) -> int:
        """The largest tile's A rows and B columns over one depth block."""
        rows, cols = self.tile_shape(r, c)
        return 4 * min(self.k, self.kc) * (rows + cols)


def _best_split(p: _Product, parts: int, l2: int, source: str) -> GemmSplit:
    mp, np_ = p.panels
    vectors = p.vectors()
    found = []
    for r in range(1, min(mp, 2 * parts) + 1):
        for c in range(1, min(np_, 2 * parts // r) + 1):
            span = _span(p.batch, mp, vectors, r, c, parts)
            reads = p.batch * (c * p.m * (1 + p.raw[0]) + r * p.n * (1 + p.raw[1]))
            rp, cp = -(-mp // r), -(-np_ // c)
            found.append((span, p.block_bytes(r, c) > l2, reads,
                          max(rp, cp) / min(rp, cp), p.batch * r * c, r, c))
    least = min(f[0] for f in found)
    even = [f for f in found if f[0] <= least * (1 + SPLIT_BALANCE_SLACK)]
    span, _, _, _, pieces, r, c = min(even, key=lambda f: f[1:])
    parts = min(parts, pieces)
    return GemmSplit(r, c, pieces, parts, _split_reason(p, r, c, parts, span, l2, source))


def _groups(panels: int, count: int) -> list[tuple[int, int]]:
    """gemm.c's groups of panels: group q is [q * panels / count, (q + 1) * panels / count)."""
    return [(q * panels // count, (q + 1) * panels // count) for q in range(count)]


def _span(batch: int, mp: int, vectors: tuple[int, ...], r: int, c: int, parts: int) -> int:
    """The busiest thread's work (row panels x column vectors) when ``parts`` threads take
    near-equal runs of consecutive tiles (threads.c's chunks), tiles ordered as gemm.c's."""
    work = [(hi - lo) * sum(vectors[j0:j1]) for j0, j1 in _groups(len(vectors), c)
            for lo, hi in _groups(mp, r)]
    prefix = [0]
    for w in work:
        prefix.append(prefix[-1] + w)
    per, total = len(work), prefix[-1]

    def done(u: int) -> int:
        return (u // per) * total + prefix[u % per]

    base, extra = divmod(batch * per, parts)
    span, lo = 0, 0
    for part in range(parts):
        hi = lo + base + (part < extra)
        span = max(span, done(hi) - done(lo))
        lo = hi
    return span


def _split_reason(p: _Product, r: int, c: int, parts: int, span: int, l2: int,
                  source: str) -> str:
    rows, cols = p.tile_shape(r, c)
    mean = p.batch * p.panels[0] * sum(p.vectors()) / parts
    kind = ("over the batch" if r * c == 1 else "by rows" if c == 1 else
            "by columns" if r == 1 else "2-D")
    block = p.block_bytes(r, c)
    of = f"{p.batch} products x " if p.batch > 1 else ""
    return (f"{kind} split {r}x{c} tiles of {rows}x{cols} ({of}{r} row x {c} column "
            f"groups: {p.batch * r * c} tiles) over {parts} threads, the busiest "
            f"{span / mean:.2f}x the mean work; a tile's A rows and B columns of a depth "
            f"block {block / 2**10:,.0f} KiB, {'within' if block <= l2 else 'over'} the "
            f"{l2 >> 10} KiB L2 ({source})")


def _product(request: PlanRequest) -> tuple[int, int, int] | None:
    """(rows, depth, columns) of the one native product a MatMul (2-D B) or Gemm node
    runs; None for other nodes or shapes not known."""
    shapes = request.static_shapes()
    if shapes is None or len(shapes) < 2 or shapes[0] is None or shapes[1] is None:
        return None
    a, b = shapes[0], shapes[1]
    if request.op is Op.MATMUL and len(b) == 2 and len(a) >= 1:
        return math.prod(a[:-1]), a[-1], b[1]
    if request.op is Op.GEMM and len(a) == 2 and len(b) == 2:
        (m, k) = a[::-1] if request.attrs.get("trans_a") else a
        n = b[0] if request.attrs.get("trans_b") else b[1]
        return m, k, n
    return None


# Row and copy kernels whose node plan takes threads from its elements (the first input's;
# fused attention's: its scores times (d + dv), what its row kernel splits by; a Gather's:
# the elements it copies, its output's):
# a node below its kernel's least work per thread keeps one thread, as the kernel's own
# split would, and the plan says so (a tiny program, e.g. a block at sequence 1, then
# plans no split at all).
_ELEMENT_THREADS_OPS = frozenset({Op.LAYER_NORM, Op.SKIP_LAYER_NORM, Op.SOFTMAX, Op.GELU,
                                  Op.TRANSPOSE, Op.ATTENTION, Op.GATHER})
# The copy kernels among them: their least work is a copy's (MIN_COPY_ELEMENTS).
_COPY_OPS = frozenset({Op.TRANSPOSE, Op.GATHER})


def _element_threads(request: PlanRequest) -> tuple[int, str] | None:
    """A row or copy kernel's node threads from its input's elements, and why; None for
    other nodes or shapes not known."""
    found = _element_work(request)
    if request.threads is None or found is None:
        return None
    elements, work = found
    rows = _gather_rows(request)
    if rows is not None:                       # whole rows, as the kernel splits them
        chosen = gather_parts(request.threads, *rows)
        return chosen, (f"{chosen} kernel thread(s) of {request.threads}: {elements:,} "
                        f"elements copied, {rows[0]:,} row(s) of {rows[1]:,}, whole rows a "
                        f"thread, at least {least_work(work, max(2, chosen)):,} per thread "
                        f"({work.constant})")
    chosen = max(1, split_threads(work, request.threads, elements))
    return chosen, (f"{chosen} kernel thread(s) of {request.threads}: {elements:,} "
                    f"elements{' copied' if request.op in _COPY_OPS else ''}, at least "
                    f"{least_work(work, max(2, chosen)):,} per thread ({work.constant})")


def _product_raw(request: PlanRequest) -> tuple[bool, bool]:
    """A MatMul's or Gemm's (A, B) packed per call: A always (an activation), B where it
    is not a constant of the graph (MatMul(x, Relu(z))) or in low-memory mode (no packed
    copy kept)."""
    return True, bool(request.low_memory) or not request.constant(1)


def _product_threads(request: PlanRequest, variant: str) -> tuple[int, str] | None:
    """A MatMul or Gemm node's kernel threads from its product's flops, and why (with
    the native GEMM's tile grid where ``variant`` runs it); None where the node runs no
    single product of known size."""
    product = _product(request) if request.threads is not None else None
    if product is None or request.threads is None:
        return None
    m, k, n = product
    flops = 2 * m * k * n
    raw, rows = _product_raw(request), (tile_grid(request.profile) or (0, 0))[0]
    streamed = variant == "native" and streams_b(1, m, rows, raw)
    chosen = max(1, product_threads(request.threads, 1, m, n, k, rows if streamed else 0, raw))
    by_flops = max(1, gemm_threads(request.threads, flops))
    why = (f"{chosen} kernel thread(s) of {request.threads}: "
           + (f"{product_work(chosen, m, n, k)}; " if streamed else "")
           + f"{flops:,} flops, at least {least_work(LeastWork.FLOPS, max(2, chosen)):,} per "
           "thread" + (f" (the flops alone: {by_flops} thread(s))" if by_flops < chosen
                       else ""))
    if chosen > 1 and variant == "native":
        split = gemm_split(1, m, n, k, chosen, tile_grid(request.profile),
                           caches(request.profile), raw=raw)
        why += f"; {split.reason}"
    return chosen, why


# ---- inter-op: independent branches at once -----------------------------------------------
# A region's branches (keel.planning.interop) run on threads of their own only where it
# may pay: at least two branches each doing INTEROP_MIN_BRANCH_WORK multiply-adds, and
# kernels that alone would keep at most INTEROP_BUSY_SHARE of the threads busy (work
# weighted by the threads each node's kernel splits over). Measured on the 2-core EPYC:
# handing a lane to a waiting Python thread and joining it costs 17 us (median; 26 us at
# the 90th percentile, keel.execution.branches.run_lanes with empty lanes), and the native
# kernels do about 20M multiply-adds per millisecond on one core (a two-head model of
# 512-wide Gemms at batch 1: 1.8M in 89 us), so 5M multiply-adds (~250 us) is ten times
# the handoff. Below it, on that machine under load (benchmarks/interop.py, same process,
# alternating), branches of 0.26M-3.5M multiply-adds ran 1.07-1.72x slower at once than
# in order. The rule is in threads and work, not in the 2-core machine's core count: on
# more threads the same per-branch minimum holds, and the lanes are as many as the
# threads and the branches allow.
INTEROP_MIN_BRANCH_WORK = 5_000_000
INTEROP_BUSY_SHARE = 0.5


def _kernel_threads(work: float, planned: int, threads: int) -> int:
    """The threads a node's kernel keeps busy: its plan's (a product's already follow its
    flops, or the floats of a B it streams), for the others no more than its work gives
    each at least MIN_CHUNK_ELEMENTS."""
    return max(1, min(planned, split_threads(LeastWork.ELEMENTS, threads, int(work))))


def plan_branches(threads: int, branches: Sequence[Sequence[tuple[float, int]]]
                  ) -> tuple[int, str]:
    """How many lanes a region's ``branches`` run in at once on ``threads`` threads (1: in
    order), and why; each branch is its nodes' (estimated multiply-adds, kernel threads)."""
    work = [sum(w for w, _ in b) for b in branches]
    heavy = sorted((w for w in work if w >= INTEROP_MIN_BRANCH_WORK), reverse=True)
    sizes = ", ".join(f"{w / 1e6:.2g}M" for w in sorted(work, reverse=True)[:6])
    found = f"{len(branches)} independent branches ({sizes} multiply-adds)"
    if threads < 2:
        return 1, f"{found}; in order: 1 thread"
    if len(heavy) < 2:
        return 1, (f"{found}; in order: fewer than two do {INTEROP_MIN_BRANCH_WORK / 1e6:g}M "
                   "multiply-adds, what handing one to another thread (~20 us) needs")
    total = sum(work)
    busy = sum(w * _kernel_threads(w, t, threads) for b in branches for w, t in b) / (
        threads * total)
    if busy > INTEROP_BUSY_SHARE:
        return 1, (f"{found}; in order: their kernels split over {busy:.0%} of the {threads} "
                   f"threads already (> {INTEROP_BUSY_SHARE:.0%})")
    lanes = min(threads, len(heavy))
    return lanes, (f"{found}; at once on {lanes} threads: their kernels alone would keep "
                   f"{busy:.0%} of the {threads} threads busy (<= {INTEROP_BUSY_SHARE:.0%})")


# ---- NUMA: the node keel's threads run on ------------------------------------------------
# On a machine with several NUMA nodes, a thread on one node reads the memory another
# node's threads first touched across the socket link, at a fraction of local bandwidth
# and with more latency; a model's arena, weights and packed copies are touched by whichever
# thread ran first. keel keeps its threads on one node by default (onnxruntime leaves
# this to the user, through numactl or its affinity options): the node with the most
# CPUs this process may use, the lowest-numbered on a tie, and the thread count becomes
# that node's CPU count. KEEL_NUMA_PIN=off runs them on every usable CPU. A declared
# rule, not measured on this 2-core (one-node) development machine.
def numa_pinning(nodes: Sequence[str], usable: frozenset[int] | None = None,
                 enabled: bool = True) -> tuple[frozenset[int] | None, str]:
    """The CPUs keel's threads are kept on (None: not pinned), and why, for the NUMA
    ``nodes`` (each node's sysfs CPU list, node 0 first) and the CPUs the process may
    use (``usable``; None: a profile of another machine, every listed CPU)."""
    from keel.hardware.sources import parse_cpu_list

    cpus = [(i, (parse_cpu_list(text) or frozenset()) & (usable or frozenset(range(1 << 16))))
            for i, text in enumerate(nodes)]
    cpus = [(i, c) for i, c in cpus if c]
    if len(cpus) <= 1:
        return None, ("one NUMA node: threads are not pinned" if nodes else
                      "no NUMA nodes listed (/sys/devices/system/node): threads are not pinned")
    if not enabled:
        return None, (f"{len(cpus)} NUMA nodes; KEEL_NUMA_PIN=off: threads run on every "
                      "usable CPU")
    node, chosen = max(cpus, key=lambda item: (len(item[1]), -item[0]))
    return chosen, (f"{len(cpus)} NUMA nodes: keel's threads pinned to node {node}'s "
                    f"{len(chosen)} CPUs ({nodes[node]}) by default, so that they read "
                    "memory local to them (KEEL_NUMA_PIN=off: every node)")


# ---- the caches plans are sized for -----------------------------------------------------
# The cache-bound sizes below were measured on a 2-core AMD EPYC (Zen 4) whose cores each
# see a 1 MiB L2 and a 32 MiB last-level cache. A plan sizes them for the caches of the
# machine it is made for (this one, or a ``hardware=`` profile's): the blocks and the
# depthwise buffers scale with the L2, the non-temporal store threshold with the
# last-level cache, each within EVIDENCE_RANGE times the measured size. The scaling is
# a declared rule (keep the same share of the cache), not measured on other machines:
# `keel tune` does not time block sizes yet. Where the profile reads no cache size, the
# measured sizes stand and the reason says so.
MEASURED_L2_BYTES = 1 << 20
MEASURED_LLC_BYTES = 32 << 20
EVIDENCE_RANGE = 8


@dataclass(frozen=True)
class Caches:
    """The L2 and last-level cache sizes a plan is made for, and where they came from."""

    l2: int = MEASURED_L2_BYTES
    llc: int = MEASURED_LLC_BYTES
    source: str = "the measured machine's (the profile reads no cache sizes)"

    def with_l2(self, size: int) -> int:
        """``size``, measured against the 1 MiB L2, for this L2."""
        return _scaled(size, self.l2, MEASURED_L2_BYTES)

    def with_llc(self, size: int) -> int:
        """``size``, measured against the 32 MiB last-level cache, for this one."""
        return _scaled(size, self.llc, MEASURED_LLC_BYTES)


def _scaled(size: int, have: int, measured: int) -> int:
    ratio = min(max(have / measured, 1 / EVIDENCE_RANGE), EVIDENCE_RANGE)
    return max(1, int(size * ratio))


def caches(profile: Any = None) -> Caches:
    """The caches of ``profile``'s CPU (None: this machine's)."""
    if profile is None:
        return _here()
    cpu = profile.cpu
    return _caches(cpu.l2_cache_bytes, cpu.l3_cache_bytes, f"the profile's {cpu.brand or 'CPU'}")


def _caches(l2: int | None, l3: int | None, where: str) -> Caches:
    if not l2:
        return Caches()
    llc = l3 or l2
    return Caches(l2, llc, f"{where}: L2 {l2 >> 10} KiB, last level {llc >> 10} KiB")


@functools.cache
def _here() -> Caches:
    from keel.hardware.cpu import cache_sizes

    found = cache_sizes()
    return _caches(found.get("l2_cache_bytes"), found.get("l3_cache_bytes"), "this machine")


# ---- cache blocking of the NumPy kernels ------------------------------------------------
# Elements per block of a kernel that runs its passes block by block, so that every
# pass over a block runs in cache instead of streaming the tensor (about 256 KiB of
# float32, half the L2 cache of the 2-core AMD EPYC the sizes were measured on):
# - epilogue_block: rows of a MatMul / Gemm output per bias + activation block
#   (0.45 ms of 16.8 ms saved on a (4096, 1024) bias + GELU);
# - attention_block: heads per block of scores (heads x S x T), kept in cache between
#   the two products and the softmax passes;
# - row_block: rows per block of the normalizations and softmax (center, square,
#   scale, shift on a block still in cache).
EPILOGUE_BLOCK_ELEMENTS = 65536
ATTENTION_BLOCK_ELEMENTS = 65536
ROW_BLOCK_ELEMENTS = 65536
BLOCKS = {"epilogue_block": EPILOGUE_BLOCK_ELEMENTS,
          "attention_block": ATTENTION_BLOCK_ELEMENTS,
          "row_block": ROW_BLOCK_ELEMENTS}
# Not per node (the code that uses them sees no plan), but the planner's all the same:
# - ERF_BLOCK_ELEMENTS: NumPy's erf runs in blocks that stay in cache (its ~30-45
#   passes over a block cost far less than over one large array);
# - HOLD_BYTES: a fresh MatMul / Gemm output up to this size is computed into a kept
#   buffer and copied (~0.3 us) rather than the prepared call retargeted (~3 us); that
#   was measured for products' outputs only. staging() applies it to every graph output
#   of a bound step (see STAGE_FEED_BYTES), where not holding means the step runs its
#   kernel's full path each run (binding saved 12-25 us a step) against a copy of at
#   most ~2 us (64 KiB, by the copy times there): reasonable, not measured per op. And
#   since it was measured, a prepared call moved to an output at the same address costs
#   nothing, so a product whose fresh output lands where the last one was (the caller
#   dropped it) would lose no more than the copy by not being held; not re-measured;
# - STREAM_BYTES: a raw right operand of the native GEMM larger than this (all
#   products together, about L2's size; a conv's gathered taps by the span of the
#   image they are read from, not their k x n) comes from memory rather than cache, and
#   gemm.c packs it in long sequential runs (KEEL_STREAM; see its row_panels_first).
ERF_BLOCK_ELEMENTS = 1 << 16
HOLD_BYTES = 64 * 1024
STREAM_BYTES = 2 * 2**20


# A product of the native GEMM on a packed B (a MatMul's or Gemm's constant weights)
# runs column panel by column panel, every row panel against the panel while it stays in
# L2 (up to 2 * KC deep: 128 KiB with AVX-512), so a weight is read from beyond the L2
# once a pass however many rows there are. The first row panel of each column panel reads
# it line after line at one 64-byte line every four cycles, and the hardware's
# prefetchers stop at every 4 KiB page: it fetches the rows FETCH_AHEAD_BYTES ahead
# itself (fetch_rows, gemm.c's KEEL_FETCH_SHIFT). Measured on the 2-core Intel Xeon, one
# thread, six products of 32 rows cycled (their weights 4.7 MiB together, so each comes
# from L3 as in a model), alternating, 300-400 rounds, medians under load (us, without ->
# with; five of the six recorded, as docs/performance.md gives them): 32x784x512 208 ->
# 181, 32x256x1024 136 -> 115, 32x1024x256 142 -> 124, 32x512x256 74 -> 66, 32x256x768
# 105 -> 90; 8x784x512 87 -> 67, 24x512x512 118 -> 103, 128x784x512 681 -> 655,
# 256x256x1024 873 -> 857. With each product's weights left in L2 (the call run twice)
# it still gains (32x784x512 174 -> 160, 32x256x1024 106 -> 98, 32x512x256 47 -> 47); 25
# minutes later, the shared L3 faster, the six took 0.94x (from L3) and 0.98x (in L2). So
# on that machine the rule does not depend on the cache sizes, and every packed B fetches
# (one machine's measurement, applied to every machine: not measured elsewhere). 512 B to 2 KiB
# ahead gave the same times, 3 KiB 1.05x and 4 or 8 KiB 1.10x the 2 KiB time; fetching in
# every row panel, not only the first, 1.01x the first alone. What the cache sizes
# would decide instead, the order of the loops, was measured too: depth blocks of 128
# (a 16 KiB block of B in L1 across the row panels) took 1.04x the time of one deep block
# (1.06x with the fetch on both).
# Applied on every vendor: AMD's cores were not measured (their prefetchers stop at the
# page too; a prefetch changes no value).
FETCH_AHEAD_BYTES = 1024


def fetch_rows(row_bytes: int) -> int:
    """Rows ahead of the one it multiplies that the native GEMM's first row panel
    fetches of a packed B whose rows (one column panel's) are ``row_bytes`` long."""
    return max(1, FETCH_AHEAD_BYTES // row_bytes)


def fetch_note() -> str:
    """The plan's note on the native GEMM's fetching of packed weights (fetch_rows)."""
    if not native_gemm.available():
        return "packed weights: none (no native tier here) (fetch_rows)"
    return (f"packed weights: the first row panel of each column panel fetches B's rows "
            f"{FETCH_AHEAD_BYTES} bytes ahead (the hardware's prefetchers stop at every "
            "4 KiB page), for B in L2 and beyond alike: measured on a 2-core Intel Xeon, "
            "it gained in both; not measured on other machines (fetch_rows, "
            "FETCH_AHEAD_BYTES)")


# A conv's product on gathered taps is flagged to stream (KEEL_STREAM) also where it
# is one image whose output is larger than STREAM_BYTES, however small the image its
# taps are read from: gemm.c then runs its taps of many columns row panel by row panel,
# each tile writing 8 of C's rows in runs fetched ahead for writing, where column panel
# by column panel every tile of a panel writes all of C's rows (64 planes at once for
# ResNet-18's stem), each line of which comes from memory inside a model. Measured on
# the 2-core Intel Xeon, one thread, thread CPU time, under load (docs/performance.md,
# "ResNet-18 at batch 1 on an Intel core"): the stem inside ResNet-18 at batch 1
# 1.75-1.88 ms against 2.23-2.41 column by column; alone with the caches flushed between
# calls 1.75-1.77 against 1.85-1.90, alone in cache 1.59-1.63 against 1.53-1.56 (where
# its output stays in cache, column panels win, but a model's conv writes a fresh
# output). One image only, counted in the conv's images (a gathered-stacked product holds
# all of a batch's images in one product of batch 1): at batch 32 the rule would flag six
# gathered products of MobileNetV2 (6-8 MB outputs), where the whole model took
# 0.998-1.012x the time with them (within the noise, not a gain); ResNet-18's stem streams
# there by its image. And only products of at least ROWS_FIRST_TAPS_FROM columns (gemm.c's
# constant of that name, checked against it at load): below it gemm.c runs taps column
# panel by column panel whatever the flag says, which then changes only how B is packed
# (not measured).
ROWS_FIRST_TAPS_FROM = 4096


def output_streams(images: int, columns: int, output_bytes: int) -> bool:
    """Whether a conv's product on gathered taps streams for its output's sake: one
    image (of the conv, not of the GEMM), at least ROWS_FIRST_TAPS_FROM columns, and an
    output (``output_bytes``) larger than STREAM_BYTES."""
    return (images == 1 and columns >= ROWS_FIRST_TAPS_FROM
            and output_bytes > STREAM_BYTES)


# Packed operands of the native GEMM (filters, Winograd's transformed filters, a
# MatMul's constant B) of at least HUGE_PAGE_BYTES lie on fresh memory asked for as huge
# pages (native_gemm._huge). Inside a model they are read from the shared cache or
# memory at every pass, and a 16 MiB operand on small pages takes 4096 TLB entries
# against 8: ResNet-18's three 512-channel Winograd convs at batch 1 took 0.20-0.32 ms
# more each in a model whose packed filters had landed on the heap's small pages than
# in one whose had not (the same plan, two models alternating in one process, 40
# passes, thread CPU time; which one got huge pages depended on where the allocator
# placed them).
HUGE_PAGE_BYTES = 2 * 2**20


def huge_pages(size: int) -> bool:
    """Whether a packed operand of ``size`` bytes goes on fresh huge pages."""
    return size >= HUGE_PAGE_BYTES


def huge_pages_note() -> str:
    """The plan's note on where packed operands lie (huge_pages), as this machine can
    place them: no native tier (nothing packed), no way to ask (MADV_HUGEPAGE), or
    transparent huge pages off ("never") leave them on the heap's small pages."""
    least = f"those of at least {HUGE_PAGE_BYTES >> 20} MiB"
    if not native_gemm.available():
        return "packed operands: none (no native tier here) (huge_pages)"
    here = native_gemm.huge_pages_here()
    if not here.advisable:
        return (f"packed operands: on the heap's small pages; {least} would go on huge "
                "pages, but this system cannot be asked for them (no MADV_HUGEPAGE) "
                "(huge_pages, HUGE_PAGE_BYTES)")
    if here.mode == "never":
        return (f"packed operands: on the heap's small pages; {least} would go on huge "
                "pages, but transparent huge pages are 'never' here "
                "(/sys/kernel/mm/transparent_hugepage/enabled) (huge_pages, HUGE_PAGE_BYTES)")
    unit = f"{here.page >> 20} MiB" if here.page % 2**20 == 0 else f"{here.page >> 10} KiB"
    size = (f"{unit} huge pages (hpage_pmd_size)" if here.page_said
            else f"huge pages (assumed {here.page >> 20} MiB: the system does not say)")
    mode = f"transparent huge pages '{here.mode}'" if here.mode else "its mode not said"
    return (f"packed operands: {least} on fresh memory asked for as {size} ({mode}), "
            "read at every pass from the shared cache or memory (huge_pages, "
            "HUGE_PAGE_BYTES)")


# Feeds and graph outputs of a fixed-shape program copied into (out of) buffers of its
# own, so that the steps reading (writing) them run as bound calls: a step on a new
# array every run takes its kernel's full path, and a native product prepares its call
# again for a new A. Measured on the 2-core Intel Xeon development VM, one thread,
# under load (medians of 1,000 alternating runs): copying 32 KiB costs 1.0 us, 100 KiB
# 2.4 us, 256 KiB 5.9 us, 1 MiB 51 us (out of L2); binding saved 12 us on each of
# small_block's three batch-32 query/key/value products (32 KiB feed), 19 us on its
# residual Add and 25 us on the MLP's first batch-32 Gemm (100 KiB feed). So a feed up
# to STAGE_FEED_BYTES (its copy under half the least saving of one step) is staged. An
# output is held up to HOLD_BYTES, the size measured for a product's fresh output (see
# there) and applied to every step's graph output without its own measurement: past it
# a native product or conv moves its prepared call to the new array (~3 us; nothing at
# the same address) and other steps run their kernels unbound.
STAGE_FEED_BYTES = 256 * 1024


def staging() -> tuple[int, int]:
    """(bytes, feed; bytes, graph output) up to which a fixed-shape host program copies
    a feed into (an output out of) a buffer of its own, so the steps on it bind."""
    return STAGE_FEED_BYTES, HOLD_BYTES


# A staged feed of at least FEED_IN_PLACE_BYTES whose every reader is a bound native
# product taking it as A is read where the caller has it: each run moves those calls' A
# to the caller's array (its address looked up and written into the call's arguments),
# and the product packs A from there as it packed it from the buffer. The copy it saves
# reads the feed from L3 (a model's weights passed through L2 since the last run) and
# writes the buffer. Measured on the 2-core Intel Xeon development VM, one thread, under
# load (load 6-7), alternating blocks of 40 runs in one process: the MLP at batch 32
# (100 KiB feed), its products joined (JOIN_CALLS), in place / copied 0.99, 0.98, 1.00
# (e.g. 274.9 against 278.1 us, medians of 30 blocks' medians). Moving A costs 0.9 us
# (hot, under load), what copying 3-32 KiB costs (0.98 us for 3 KiB here, 1.0 us for
# 32 KiB when STAGE_FEED_BYTES was measured): from 64 KiB the copy costs at least twice
# as much; below it the copy is kept (at batch 1 a moved call was 1.01-1.12x slower).
FEED_IN_PLACE_BYTES = 64 * 1024

# A feed over STAGE_FEED_BYTES, up to FEED_IN_PLACE_MOST_BYTES, is given a buffer of the
# program's too where every step reading it is a bound native call that reads it in place
# (the rule above: a product's A, a band conv's X, the X of a conv pooled in cache,
# conv_pool), and where the run can then be direct (the program's rule: every step bound,
# no region run at once, no scope but NumPy 2's FP context variable): its steps then
# bind, and no run copies it (the direct run, Program.run with outputs given, a run on
# another thread all point the calls at the caller's array); the buffer is read only
# where the caller's array cannot be (not C-contiguous and aligned, another dtype or
# shape). Where a reader cannot read it in place or the run cannot be direct (judged on
# the program's first compile), the feed is not staged (its steps run unbound, as
# before), since a copy of it each run costs more than binding saves (STAGE_FEED_BYTES).
# This is what lets a network whose first conv reads a 3x224x224 image at batch 1 (588 KiB) run
# every step bound and C only (MobileNetV2). Up to 1 MiB: batch 1 of such images;
# derived, not measured beyond it: at batch 32 (18.8 MiB) a first conv takes
# milliseconds, so binding saves under 0.1 % of it, and the buffer held for the
# fallback copy grows with the batch.
FEED_IN_PLACE_MOST_BYTES = 1024 * 1024


def staging_note() -> str:
    """The plan's note on the feeds and outputs staged for bound steps."""
    return (f"feeds up to {STAGE_FEED_BYTES >> 10} KiB and graph outputs up to "
            f"{HOLD_BYTES >> 10} KiB copied into (out of) buffers of the program's own, so "
            "the steps on them run bound: measured, the copy costs less than half what "
            "binding saves one step (staging, STAGE_FEED_BYTES, HOLD_BYTES); a feed of at "
            f"least {FEED_IN_PLACE_BYTES >> 10} KiB that only native products read, as A, "
            "is read where the caller has it instead: measured on a 2-core Intel Xeon, "
            "the copy costs more than moving the products' A (FEED_IN_PLACE_BYTES); a "
            f"feed of up to {FEED_IN_PLACE_MOST_BYTES >> 10} KiB over the staged size is "
            "given a buffer too where every step reading it reads it in place (a "
            "product's A, a band conv's X, a pooled conv's X) and the run can be direct "
            "(every step bound), so those steps bind and a run copies the feed only where "
            "the caller's array is not C-contiguous, aligned and of its dtype "
            "(FEED_IN_PLACE_MOST_BYTES)")


# A steady run's consecutive bound native products (a chain of MatMul / Gemm nodes) go to
# C as one call (native_gemm.joined): after a product that passes a model's weights
# through the L2, every Python operation before the next call pays for the interpreter's
# code and data coming back from L3 (an empty ctypes call right after the MLP's first
# two batch-32 products: 2.7 us median against 0.5). Measured on the 2-core Intel Xeon
# development VM, under load (load 6-7), alternating blocks of runs in one process, the
# feed read in place either way, time against onnxruntime's: the MLP batch 32 one
# thread 0.971 -> 0.944, batch 1 0.826 -> 0.780, batch 32 two threads 0.987 -> 0.969;
# LeNet batch 1 two threads 0.868 -> 0.808 (its three Gemms), batch 32 0.786 -> 0.794
# (noise: its convs take 98 % of the run).
JOIN_CALLS = True


def join_note() -> str:
    """The plan's note on the bound products a steady run calls as one."""
    if not JOIN_CALLS:
        return "bound native products: called one by one (JOIN_CALLS off)"
    if not native_gemm.available():
        return ("bound products: called one by one (no native GEMM library loaded: "
                "JOIN_CALLS has no native calls to join)")
    return ("bound native products: a steady run calls consecutive ones as one native "
            "call, not through the interpreter, whose code a product's weights push out "
            "of the cache: measured on a 2-core Intel Xeon (JOIN_CALLS)")


_BLOCK_OF = {Op.MATMUL: "epilogue_block", Op.GEMM: "epilogue_block",
             Op.ATTENTION: "attention_block",
             **{op: "row_block" for op in (Op.LAYER_NORM, Op.SKIP_LAYER_NORM,
                                           Op.INSTANCE_NORM, Op.GROUP_NORM, Op.SOFTMAX,
                                           Op.LOG_SOFTMAX)}}
_BLOCK_WHY = {
    "epilogue_block": "elements per bias + activation block of the output, in cache",
    "attention_block": "elements of scores per block of heads, in cache between the "
                       "products and the softmax",
    "row_block": "elements per block of rows, every pass over a block in cache",
}


# Fused attention runs on the native GEMM and row softmax (split over batch x heads on
# keel's threads) from this many scores per head (S x T); below it, the native row
# kernel (attention_rows, below), else (no native tier) NumPy's blocks, which a program
# binds once (KernelVariant.bind). Per head, never per call: the choice
# must not follow the batch, or a sample's bits would (batch invariance). Measured on
# the 2-core AMD EPYC (Zen 4): the small block at sequence 1 (one score per head) ran
# 1.16x onnxruntime on the bound NumPy blocks against 1.85x on the native path, whose
# per-call preparation dominates; BERT-mini's 128x128 heads ran faster native at one
# thread (11-15 ms against 16-27 ms at batch 32).
ATTENTION_NATIVE_MIN_SCORES = 256


# A fused attention whose heads have one query row each (a decode step) runs on the
# native row kernel (fastmath.c's keel_attend_rows_f32: scores, softmax and the weighted
# sum of V in one call over all heads, no per-block preparation), as do heads of fewer
# than ATTENTION_NATIVE_MIN_SCORES scores. Per head, never per call (batch invariance).
# Measured on the 2-core AMD EPYC, 1 thread: the GPT-2 decode step's attention (4 heads,
# one query, 65 keys of 64) took 19.6 us a call on the NumPy blocks and ~3 us on the row
# kernel; a single query reads each key once, as a GEMV does, so the GEMM path (its
# packing and per-block preparation) gains nothing at any cache length.
ATTENTION_ROWS_MAX_QUERIES = 1


def attention_rows(queries: int, keys: int) -> bool:
    """Whether a fused attention whose heads have ``queries`` query rows and ``keys``
    keys runs on the native row kernel (when the native tier is loaded)."""
    return queries <= ATTENTION_ROWS_MAX_QUERIES or not attention_native(queries * keys)


def attention_native(scores_per_head: int) -> bool:
    """Whether a fused attention whose heads have ``scores_per_head`` scores (S x T) runs
    on the native kernels (the same answer for the kernel and its bound call, and for
    any batch)."""
    return scores_per_head >= ATTENTION_NATIVE_MIN_SCORES


def attention_split(heads: int, queries: int, threads: int,
                    grid: Any = None) -> tuple[int, int]:
    """(row blocks a head, parts) of the native attention on ``threads`` threads: whole
    heads where there are at least as many as threads; else each head's query rows cut
    into blocks of whole row panels of the GEMM's tile (``grid``), enough for every
    thread (BERT-mini at batch 1 has 4 heads for 16 threads). A block packs its head's
    K and V again, so heads are cut no finer than the threads need. Any split gives the
    same bits (gemm.c's keel_attention_f32)."""
    threads, heads = max(1, threads), max(1, heads)
    if heads >= threads:
        return 1, threads
    panels = -(-queries // (_grid(_HERE if grid is None else grid) or _TILES["scalar"])[0])
    blocks = max(1, min(-(-threads // heads), panels))
    return blocks, min(threads, heads * blocks)


def attention_split_reason(heads: int, queries: int, threads: int, grid: Any = None) -> str:
    """The native attention's split, for its plan's reasons."""
    blocks, parts = attention_split(heads, queries, threads, grid)
    if blocks == 1:
        return f"attention split over batch x heads: {heads} head(s) in {parts} part(s)"
    return (f"attention split over batch x heads x query rows: {heads} head(s) of "
            f"{queries} rows, each in {blocks} row blocks, in {parts} part(s) (fewer heads "
            f"than {threads} threads)")


def attention_heads(block_elements: int, scores_per_head: int, heads: int,
                    threads: int) -> int:
    """Heads per block of the native attention: a block of ``block_elements`` scores
    (the plan's attention_block, sized for one core's L2) for each of ``threads``
    threads, which split the block's heads between them; at least one, at most
    ``heads``."""
    per_thread = max(1, block_elements // max(1, scores_per_head))
    return max(1, min(heads, max(1, threads) * per_thread))


def block(node_plan: NodePlan | None, name: str) -> int:
    """The block size ``name`` (see BLOCKS) a kernel runs with: its node plan's, else
    (a call the planner did not see) the same rule's for this machine's caches."""
    planned = None if node_plan is None else node_plan.option(name)
    return block_size(name, caches()) if planned is None else int(planned)


def block_size(name: str, sizes: Caches) -> int:
    """The block size ``name`` (see BLOCKS) for the caches of ``sizes``: the measured
    size scaled to its L2 (the one rule for a plan's option and a call without one).
    BLOCKS is read at each call (the scaling is kept by value), so a changed entry
    reaches the next plan."""
    return _l2_scaled(BLOCKS[name], sizes)


@functools.cache
def _l2_scaled(measured: int, sizes: Caches) -> int:
    return sizes.with_l2(measured)


def _blocking(op: Op, sizes: Caches) -> tuple[tuple[str, int], str] | None:
    """The cache-blocking option of ``op``'s kernels for ``sizes``, and why; None when it
    has none."""
    name = _BLOCK_OF.get(op)
    if name is None:
        return None
    size = block_size(name, sizes)
    return (name, size), (f"{name} {size}: {_BLOCK_WHY[name]} ({BLOCKS[name]} measured for "
                          f"a 1 MiB L2, scaled by rule to the caches of {sizes.source})")


# ---- the program's BLAS threads ---------------------------------------------------------
# A program gives BLAS more than one thread only when BLAS does at least this share of
# its arithmetic. Between calls, OpenBLAS's workers spin for a while; where the native
# kernels do most of the work on keel's own threads, those spinning workers take the
# cores keel's threads need. Measured on the 2-core AMD EPYC, 2 threads, batch 32:
# BERT-mini (BLAS: the attention products, ~8% of the work) 318 ms with BLAS on 2
# threads against 208 ms with BLAS on 1; ResNet-18 (BLAS: the Winograd and im2col
# convolutions, most of the work) 699 ms against 1027 ms.
BLAS_SHARE_FOR_THREADS = 0.5


def plan_program(threads: int, steps: Sequence[tuple[bool, float]]) -> tuple[int, str]:
    """The BLAS thread count of a whole program under a cap of ``threads``, and why.

    ``steps`` are (whether the step may call BLAS, its estimated work) for each step
    the program runs on the cpu backend; work 0 everywhere (shapes unknown) counts as
    all BLAS, the cautious side.
    """
    if threads <= 1:
        return threads, f"BLAS on {threads} thread: the program's cap"
    total = sum(work for _, work in steps)
    blas = sum(work for uses_blas, work in steps if uses_blas)
    share = blas / total if total > 0 else 1.0
    if share >= BLAS_SHARE_FOR_THREADS:
        return threads, (f"BLAS on {threads} threads: BLAS kernels do {share:.0%} of the "
                         f"work (>= {BLAS_SHARE_FOR_THREADS:.0%})")
    return 1, (f"BLAS on 1 thread: BLAS kernels do {share:.0%} of the work; the native "
               f"kernels split theirs over {threads} keel threads, and idle BLAS workers "
               "would spin on the cores they need")


# ---- convs that would not reach keel's threads --------------------------------------------
# im2col and the pointwise GEMM run their product on OpenBLAS, which a program whose work
# is mostly on the native kernels keeps on one thread (plan_program, above): on more
# threads such a node does not get faster at all. From PARALLEL_CONV_THREADS threads on,
# a conv the rules give one of them runs on the native implicit GEMM instead wherever it
# can compute it, split over keel's threads. Measured on the 16-core Intel Xeon (AVX-512)
# of an H200 machine, ResNet-18 at batch 32: its three 3x3 stride-2 convs (im2col) took
# 40.5 / 35.3 / 31.7 ms on 1 thread and 39.5 / 33.7 / 30.8 on 16, its three 1x1 stride-2
# convs (pointwise) 6.9 / 6.1 / 4.3 and 6.7 / 5.5 / 4.1: 120 of the model's 231 ms.
# Convs of stride STRIDED_NATIVE_STRIDE run natively on one thread too (where the native
# kernel serves them): on one thread it beats im2col and the pointwise GEMM there, now
# that its strided forms read stride phases. Measured on the 2-core AMD EPYC (Zen 5),
# 1 thread, ResNet-18's six stride-2 convs in the model, alternating runs, medians (a
# shared machine): native / im2col time 0.44, 0.49, 0.62 (3x3, 64->128, 128->256,
# 256->512) and native / pointwise 0.48-0.61 (1x1) at batch 1; 0.60-0.71 and 0.77-0.98
# at batch 32. So a strided conv runs the same kernel, with the same bits, on any thread
# count; a stride-1 conv the rules give to BLAS keeps it on one thread.
BLAS_CONV_VARIANTS = frozenset({"im2col", "pointwise"})
PARALLEL_CONV_THREADS = 2
STRIDED_NATIVE_STRIDE = 2
_STRIDED_NATIVE_MEASURED = (
    "measured on one thread (2-core AMD EPYC, ResNet-18's stride-2 convs): 0.44-0.62x "
    "im2col's and 0.48-0.61x the pointwise GEMM's time at batch 1, 0.60-0.98x at batch 32")


def _on_keel_threads(request: PlanRequest, variants: Mapping[str, KernelVariant],
                     variant: str, why: str) -> tuple[str, str]:
    """The conv variant that splits over keel's threads where the rules chose one that
    runs on BLAS (see BLAS_CONV_VARIANTS), and why; else ``variant`` and ``why``."""
    native = variants.get("native")
    if variant not in BLAS_CONV_VARIANTS or native is None or request.op not in CONV_OPS:
        return variant, why
    case = _conv_case(request.op, request.input_types, request.attrs, request.dtype)
    if case is None:
        return variant, why
    return threaded_conv(case, variant, why, request.threads or 1, rule_in_force(native))


def threaded_conv(case: ConvCase, variant: str, why: str, threads: int,
                  native: ConvRule | None) -> tuple[str, str]:
    """``native`` (the native conv's rule in force, None without the tier) instead of
    a BLAS-run ``variant`` where it serves ``case``: for convs of stride
    STRIDED_NATIVE_STRIDE on any thread count, for others from PARALLEL_CONV_THREADS
    threads on; and why. Else ``variant`` and ``why``."""
    if (variant not in BLAS_CONV_VARIANTS or native is None
            or native.cannot_serve(case) is not None):
        return variant, why
    if all(s == STRIDED_NATIVE_STRIDE for s in case.strides):
        return "native", (
            f"{case.describe()}: native on {threads} keel thread(s), not {variant}: strided, "
            f"{_STRIDED_NATIVE_MEASURED}; and BLAS would stay on one thread where the "
            f"program's work is native; the rules without it: {why}")
    if threads < PARALLEL_CONV_THREADS:
        return variant, why
    return "native", (
        f"{case.describe()}: native on {threads} keel threads, not {variant}: its GEMM runs "
        "on BLAS, which a program of native kernels keeps on one thread (on a 16-core "
        "Xeon, ResNet-18's strided im2col and pointwise convs did not get faster from 1 "
        f"to 16 threads); the rules on one thread: {why}")


# ---- the node plan ---------------------------------------------------------------------
# Plans made, by request: the op-level path (Backend.run) asks for every call.
_PLANS: dict[tuple[Any, ...], NodePlan] = {}
_PLANS_LIMIT = 1024


def forget() -> None:
    """Drop the plans kept by request and take the planner's constants again: for code
    that changes the planner's data (tests that lower a threshold), so no plan made
    under other data is reused, the op-level path's included. Inside a load's
    ``planner_constants.once`` scope the constants stay those the load measured."""
    _PLANS.clear()
    _l2_scaled.cache_clear()            # reads EVIDENCE_RANGE and MEASURED_L2_BYTES
    planner_constants.refresh()


def plan(request: PlanRequest, table: KernelTable) -> NodePlan:
    """Every decision about how one cpu node runs, each with its reason (the same
    request, with the same kernel tiers loaded, gets the same plan object)."""
    key = _cache_key(request, table)
    if key is None:
        return _plan(request, table)
    found = _PLANS.get(key)
    if found is None:
        if len(_PLANS) >= _PLANS_LIMIT:
            _PLANS.clear()
        found = _PLANS[key] = _plan(request, table)
    return found


def _cache_key(request: PlanRequest, table: KernelTable) -> tuple[Any, ...] | None:
    """What a plan depends on (of the hardware profile: the machine its reasons name
    and its SIMD level, which sets the native tile); None when an attribute is not
    hashable."""
    profile = request.profile
    machine = None if profile is None else (profile.cpu.brand, profile.cpu.simd_level,
                                            profile.cpu.l2_cache_bytes,
                                            profile.cpu.l3_cache_bytes)
    key = (table, request.op, request.input_types, tuple(request.attrs.items()),
           request.threads, request.precision, request.measured, machine, request.low_memory,
           request.constants,
           state())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def state() -> tuple[Any, ...]:
    """The kernel tiers loaded here, whether choices keep batch invariance, the thread
    costs the least work a thread comes from and the planner's constants
    (:mod:`keel.backends.planner_constants`): every plan depends on them."""
    return (native_gemm.available(), native_window.ready(), tier_unavailable("native"),
            batch_invariant(), thread_costs.current().token, planner_constants.current())


def _plan(request: PlanRequest, table: KernelTable) -> NodePlan:
    variants, _ = usable_variants(request.op, table)
    measured = request.measured
    if measured is not None and measured.variant in variants:
        variant, why = measured.variant, measured.reason
    else:
        variant, why = choose_variant(request.op, request.input_types, request.attrs, table)
        variant, why = _on_keel_threads(request, variants, variant, why)
    options: list[tuple[str, Any]] = []
    dispatched = _dispatched(request.op, request, table) if variant == "default" else None
    if dispatched is not None:
        options.append(("conv_variant", dispatched))
    sizes = caches(request.profile)
    form = _form(request, dispatched or variant, sizes)
    if form.layout and (dispatched or variant) == "depthwise":
        options.append(("depthwise_scheme", form.scheme))
    form_reasons = [("depthwise_scheme", form.scheme_reason)] if form.scheme_reason else []
    if form.stream_stores:
        options.append(("stream_stores", True))
    if form.block is not None:
        options.append(("depthwise_block", form.block))
    if form.lanes is not None:
        options.append(("winograd_lanes", form.lanes))
        form_reasons.append(("winograd_lanes", form.lanes_reason))
    if form.pass_lanes is not None:
        options.append(("winograd_pass_lanes", form.pass_lanes))
        form_reasons.append(("winograd_pass_lanes", form.pass_lanes_reason))
    if form.pipeline is not None:
        options.append(("winograd_pipeline", form.pipeline))
        form_reasons.append(("winograd_pipeline", form.pipeline_reason))
    if form.gemm_lanes is not None:
        options.append(("gemm_lanes", form.gemm_lanes))     # the layout's reason says
    if form.a16_reason:
        options.append(("gemm_a16", form.gemm_a16))
        form_reasons.append(("gemm_a16", form.a16_reason))
    if form.gemm_tail is not None:
        options.append(("gemm_lanes_tail", form.gemm_tail))
        form_reasons.append(("gemm_lanes_tail", form.tail_reason))
    if form.output_streams:
        options.append(("output_streams", True))
    blocking = _blocking(request.op, sizes)
    if blocking is not None:
        options.append(blocking[0])                 # its reason is keyed by its name
    no_pack = _no_packed_copy(request, variants[variant])
    if no_pack:
        options.append(("prepack", False))
    threads, threads_why = request.threads, (
        f"{request.threads} kernel thread(s): the backend's thread count; each call splits "
        "while every thread gets the planner's least work per thread")
    sized = _product_threads(request, variant) or _element_threads(request)
    if sized is not None:
        threads, threads_why = sized
    split = _conv_split_reason(request, dispatched or variant, form) or (
        int8_split_reason(request, form.layout) if variant == "int8" else "") or (
        _attention_split_note(request, threads)) or _pool_split_note(request, threads)
    if split:
        threads_why = f"{threads_why}; {split}"
    return NodePlan(
        variant=variant, layout=form.layout, threads=threads, chunk=form.chunk,
        workspace_bytes=form.workspace_bytes, precision=request.precision,
        options=tuple(options),
        reasons=field_reasons(
            variant=why, layout=form.reason,
            threads=threads_why,
            **({} if form.chunk is None else {"chunk": form.chunk_reason or form.reason}),
            **({} if form.workspace_bytes is None else
               {"workspace_bytes": _SCRATCH.get(dispatched or variant,
                                                 "one chunk's phase-split image, column "
                                                 "matrix and product")}))
        + (() if blocking is None else ((blocking[0][0], blocking[1]),))
        + ((("prepack", no_pack),) if no_pack else ()) + tuple(form_reasons))


# What each conv variant's planned scratch holds (the others: im2col's and pointwise's).
_SCRATCH = {"winograd": "the transformed tiles and products of one chunk",
            "native": "X's zero-bordered copy the kernel reads (its stride-phase image or "
                      "wide buffer; none where it reads X in place)"}


def _conv_split_reason(request: PlanRequest, variant: str, form: ConvForm) -> str:
    """How a conv node's passes split over its threads ("" for other nodes, unknown
    shapes or one thread): see conv_splits."""
    geo = _static_geometry(request)
    if geo is None or not request.threads or request.threads < 2:
        return ""
    grid = tile_grid(request.profile)
    return split_reason(conv_splits(variant, form.layout, form.chunk, geo, request.threads,
                                    grid, caches(request.profile),
                                    cpu_vendor(request.profile)), request.threads)


def int8_split_reason(request: PlanRequest, layout: str | None = None) -> str:
    """How a node's int8 kernel splits over its threads, from the same functions its call
    asks ("" for unknown shapes, one thread, a node its native kernel does not serve, or
    one whose channels-last kernel runs: its layout reason gives that split)."""
    shapes = request.static_shapes()
    if not request.threads or request.threads < 2 or not shapes or shapes[0] is None:
        return ""
    reason = _INT8_SPLIT_REASONS.get(request.op)
    return "" if reason is None else reason(request, shapes, layout)


_Shapes = Sequence[tuple[int, ...] | None]


def _int8_product_split_reason(request: PlanRequest, shapes: _Shapes, layout: str | None
                               ) -> str:
    product = _int8_product(request.op, shapes, request.attrs)
    if product is None:
        return ""
    threads = int(request.threads or 1)
    rows, depth, columns = product
    split = int8_matmul_split(rows, depth, columns, threads)
    return (f"int8 product: {split.parts} of {threads} thread(s) run it ({split.tasks} "
            f"tiles of {INT8_MATMUL_ROWS} rows x {INT8_DIRECT_PANEL} columns, at least "
            f"{least_named(LeastWork.FLOPS, threads)} flops a thread)")


def _int8_pass_split_reason(request: PlanRequest, shapes: _Shapes, layout: str | None
                            ) -> str:
    from keel.backends.cpu import qlinear

    operands = [None if t is None or shape is None else qlinear.Operand(t.dtype.numpy, shape)
                for t, shape in zip(request.input_types, shapes, strict=True)]
    if not qlinear.pass_served(request.op, operands, request.attrs):
        return ""              # the NumPy kernel (broadcasts, scales per axis, other types)
    threads, elements = int(request.threads or 1), math.prod(shapes[0] or ())
    return (f"one pass over {elements:,} elements on {int8_pass_parts(elements, threads)} "
            f"of {threads} thread(s), at least QADD_MIN_ELEMENTS_PER_THREAD = "
            f"{QADD_MIN_ELEMENTS_PER_THREAD:,} a thread")


def _int8_max_pool_split_reason(request: PlanRequest, shapes: _Shapes, layout: str | None
                                ) -> str:
    x, threads = shapes[0] or (), int(request.threads or 1)
    if len(x) != 4 or (layout and "nhwc" in layout):
        return ""
    planes, plane = x[0] * x[1], x[2] * x[3]
    return (f"int8 max pool (NCHW, where the node's layout is NCHW): "
            f"{int8_max_pool_plane_parts(planes, plane, threads)} of {threads} thread(s) "
            f"run its {planes} planes, each thread reading at least "
            f"QMAXPOOL_MIN_ELEMENTS_PER_THREAD = {QMAXPOOL_MIN_ELEMENTS_PER_THREAD:,} bytes")


def _int8_global_pool_split_reason(request: PlanRequest, shapes: _Shapes,
                                   layout: str | None) -> str:
    x, threads = shapes[0] or (), int(request.threads or 1)
    if len(x) < 3:
        return ""
    count = int8_global_pool_parts(x[0], x[1], math.prod(x[2:]), threads)
    return (f"integer global average pool: {count} of {threads} thread(s) run its "
            f"(image, {INT8_GAP_BLOCK}-channel block) tasks, each thread reading at "
            f"least QGAP_MIN_ELEMENTS_PER_THREAD = {QGAP_MIN_ELEMENTS_PER_THREAD:,} bytes")


def _int8_conv_split_reason(request: PlanRequest, shapes: _Shapes, layout: str | None
                            ) -> str:
    return int8_conv_split_reason(request, layout)


# int8_split_reason by op: each states the split its kernel's call asks for.
_INT8_SPLIT_REASONS: dict[Op, Callable[[PlanRequest, _Shapes, str | None], str]] = {
    Op.QLINEAR_CONV: _int8_conv_split_reason,
    Op.QLINEAR_MATMUL: _int8_product_split_reason, Op.QGEMM: _int8_product_split_reason,
    Op.QLINEAR_ADD: _int8_pass_split_reason, Op.QUANTIZE_LINEAR: _int8_pass_split_reason,
    Op.DEQUANTIZE_LINEAR: _int8_pass_split_reason, Op.MAX_POOL: _int8_max_pool_split_reason,
    Op.QLINEAR_GLOBAL_AVG_POOL: _int8_global_pool_split_reason}


def _int8_product(op: Op, shapes: Sequence[tuple[int, ...] | None],
                  attrs: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """(rows, depth, columns) of a QLinearMatMul's (2-D B) or QGemm's int8 product."""
    a, b = shapes[0], shapes[3] if len(shapes) > 3 else None
    if a is None or b is None or len(b) != 2 or len(a) < 2:
        return None
    if op is Op.QLINEAR_MATMUL:
        return math.prod(a[:-1]), a[-1], b[1]
    if len(a) != 2:
        return None
    rows, depth = a[::-1] if attrs.get("trans_a") else a
    columns = b[0] if attrs.get("trans_b") else b[1]
    a_zp, c = shapes[2], shapes[6] if len(shapes) > 6 else None
    if not int8_qgemm_serves(a_zp, c, columns):
        return None
    return rows, depth, columns


def int8_qgemm_serves(a_zero_point: Sequence[int] | None, c: Sequence[int] | None,
                      columns: int) -> bool:
    """Whether a QGemm runs the int8 product (else qlinear.py's float64 form): A's zero
    point one value, C absent or one bias per column (a scalar, (N,) or (1, N)), which
    the product adds in int32."""
    return (a_zero_point is None or math.prod(a_zero_point) == 1) and (c is None or (
        math.prod(c) in (1, columns) and len(c) <= 2 and (len(c) != 2 or c[0] == 1)))


def int8_conv_split_reason(request: PlanRequest, layout: str | None = None) -> str:
    """How an int8 QLinearConv's NCHW kernel splits over its threads ("" for other nodes,
    channels-last ones (``layout``; a chain's layout reason gives their kernel's split),
    unknown shapes or one thread): int8_direct_split, as the kernel's prepared call asks
    it, so the threads and chunk stated are the ones that run."""
    shapes = request.static_shapes()
    if (request.op is not Op.QLINEAR_CONV or not request.threads or request.threads < 2
            or shapes is None or len(shapes) < 4 or shapes[0] is None or shapes[3] is None
            or len(shapes[0]) != 4 or len(shapes[3]) != 4):
        return ""
    from keel.backends.cpu import native_qgemm  # int8 models only
    from keel.ops.schemas.quantization import conv_geometry as qconv_geometry

    try:
        geo = qconv_geometry(shapes[0], shapes[3], request.attrs)
    except KeelError:
        return ""
    if layout and "nhwc" in layout:
        return ""
    n, _, h, w = shapes[0]
    m, depth = int(shapes[3][0]), math.prod(int(d) for d in shapes[3][1:])
    (oh, ow), positions = geo.out_spatial, native_qgemm.image_positions(h, w, geo)
    split = int8_direct_split(n, geo.group, oh * ow, depth, m, positions, request.threads)
    runs = (f"int8 convolution (NCHW, where the node's layout is NCHW): {split.parts} of "
            f"{request.threads} thread(s) run it ({split.tasks} blocks of {INT8_DIRECT_PANEL} "
            f"output positions, at least {least_named(LeastWork.FLOPS, request.threads)} "
            "flops a thread)")
    if geo.group != 1 or geo.dilations != (1, 1):
        lanes = (native_qgemm.isa() == "avx512-vnni" and int8_depthwise_lanes(oh * ow)
                 and math.prod(geo.kernel) <= INT8_LANES_MAX_TAPS)
        if geo.group == m == shapes[0][1] and lanes:
            return (f"{runs}; depthwise with the channels in the vector lanes ({oh * ow} "
                    f"output pixels a plane, at most INT8_DEPTHWISE_LANES_MAX_PIXELS = "
                    f"{INT8_DEPTHWISE_LANES_MAX_PIXELS})")
        return runs
    chunks = -(-n // split.chunk)
    return (f"{runs}; the direct kernel stacks the batch's images in chunks of about "
            f"INT8_DIRECT_CHUNK_POSITIONS = {INT8_DIRECT_CHUNK_POSITIONS} positions (about "
            f"{positions} an image), as many as divide a thread's share where they can, so "
            f"no chunk is built twice (batch {n}: {chunks} chunk(s) of {split.chunk}); the "
            f"chunks' blocks of {INT8_DIRECT_PANEL} columns in {split.parts} near-equal runs")


def _static_geometry(request: PlanRequest) -> ConvGeometry | None:
    """The conv geometry of a node's static shapes; None for other nodes or shapes not
    known."""
    if request.op not in CONV_OPS:
        return None
    shapes = request.static_shapes()
    if shapes is None or len(shapes) < 2 or shapes[0] is None or shapes[1] is None:
        return None
    attrs = conv2d_attrs(request.attrs) if request.op is Op.CONV2D else request.attrs
    try:
        return conv_geometry(request.op, shapes[0], shapes[1], attrs)
    except KeelError:
        return None


def _no_packed_copy(request: PlanRequest, kv: KernelVariant) -> str:
    """Why the variant keeps no packed copy of its constant weights ("" when it does, or
    has none): in low-memory mode the weights stay where they are, memory-mapped from a
    .keel file where they came from one, and each call packs what it needs."""
    if not request.low_memory or kv.prepack is None:
        return ""
    return (f"low-memory mode ({request.low_memory}): no packed copy of the weights is "
            "kept; each call packs what it needs and frees it")


def _form(request: PlanRequest, variant: str, sizes: Caches) -> ConvForm:
    """The layout of a conv node's variant, from its static shapes."""
    if request.op not in CONV_OPS:
        return ConvForm("", "the variant's only form")
    shapes = request.static_shapes()
    if shapes is None or len(shapes) < 2 or shapes[0] is None or shapes[1] is None:
        return ConvForm("", "decided from the real shapes at the first call "
                            "(shapes not static)")
    attrs = conv2d_attrs(request.attrs) if request.op is Op.CONV2D else request.attrs
    try:
        geo = conv_geometry(request.op, shapes[0], shapes[1], attrs)
    except KeelError as exc:
        return ConvForm("", f"no layout: {exc}")
    itemsize = 8 if request.dtype is DType.FLOAT64 else 4    # float16 computes in float32
    grid = tile_grid(request.profile) if variant in ("native", "winograd") else None
    threads = request.threads or 1
    vendor = cpu_vendor(request.profile)
    if grid is None or grid == native_gemm.geometry():
        return conv_form(variant, geo, itemsize, sizes=sizes, threads=threads, vendor=vendor)
    form = conv_form(variant, geo, itemsize, grid, sizes, threads, vendor)
    cpu = request.profile.cpu
    return dataclasses.replace(form, reason=(
        f"{form.reason}; planned for the profile's {cpu.brand or 'CPU'} ({cpu.simd_level}): "
        f"its native GEMM's {grid[0]} x {grid[1]} tiles"))


# ---- the native conv's layout ----------------------------------------------------------
# The native implicit GEMM's forms (conv_gemm.native_layout builds each): measured on
# a 2-core AMD EPYC (Zen 4, AVX-512), 1 thread, prepared calls, interleaved medians.
#
# band: a dense strided 2-D conv of at most BAND_MAX_DEPTH depth (input channels x
# taps per filter) and at least BAND_FROM output pixels per image runs by bands of
# output rows read from X (gemm.c's keel_conv_band_f32). MobileNetV2's 3 -> 32 3x3
# stride-2 conv on 224x224 inside the model: 18.3 -> 12.0 ms at batch 32 (onnxruntime
# 9.9), 0.40 -> 0.39 ms at batch 1 alone. Deeper filters (ResNet-18's 3 -> 64 7x7,
# depth 147) and stride-1 convs were not measured and keep their layouts. Measured
# with the AVX-512 kernel's 32-column panels only.
BAND_MAX_DEPTH = 64
BAND_FROM = 4096
BAND_PANEL = 32
# masked: strided convs take it below this many output pixels per image; above,
# copying the stride phases costs more than the gathered product saves (3 -> 32 3x3
# stride 2 on 224x224 at batch 32: 1.64x the gathered time, 0.99x at batch 1; 3 -> 64
# 7x7 stride 2: 1.04x at batch 1).
MASKED_STRIDED_BELOW = 4096
# ... except one image of at most MASKED_ONE_IMAGE_CHANNELS input channels (a network's
# first layer), whose phase image is small and stays in cache: ResNet-18's 3 -> 64 7x7
# stride-2 stem on 224x224 at batch 1, alone (bias and ReLU, the phase copy included,
# the forms alternating in one process, medians of 41 calls, measured under load, a
# load average of 1.4-3): 1.079-1.250 ms masked against 1.143-1.295 gathered on one
# thread (0.94-0.97x, six runs), 0.94-0.97x on two; inside the model (one thread, keel
# / onnxruntime per pass, 21 passes, processes alternating) 1.020 and 1.033 against
# 1.059 and 1.042. At batch 32 it lost (49.3 against 42.2 ms, 1.17x), so one image only.
# A kernel with Y's channels in the vector lanes (a zero-bordered band of X's rows, 64
# channels by 6 pixels a tile, register transposes to NCHW) ran 0.97-1.01x the gathered
# time on one thread, 1.00-1.03x on two, 0.98x at batch 32, and was not kept
# (docs/performance.md, ResNet-18 at batch 1).
MASKED_ONE_IMAGE_CHANNELS = 3
# ... and strided convs of one image take the masked form only on the vendors in
# MASKED_STRIDED_VENDORS, or where it runs in lanes tiles (masked_lanes), which read the
# taps through the masks once into a copy. The masked tiles load B through lane masks at
# every step; on Intel's cores those loads wait where the gathered form's plain loads of
# a packed panel do not. Measured on the 2-core Intel Xeon (KVM, AVX-512), one thread,
# thread CPU time, each conv + ReLU alone, the two forms alternating in one process,
# medians of 41 calls, under load (docs/performance.md, "ResNet-18 at batch 1 on an
# Intel core"): gathered / masked 0.83x on the 3 -> 64 7x7 stem, 0.89-0.96x on 64 -> 128
# 3x3 stride 2 on 56x56, 0.92x on the 1x1 stride-2 64 -> 128 and 128 -> 256; where the
# masked form runs in lanes tiles it stays (256 -> 512 3x3 stride 2: the gathered form
# took 1.44x). At batch 32 the gathered form took 1.02-1.04x the masked time on the 3x3
# stride-2 convs, so one image only. AMD's Zen: the masked form measured faster (above).
# Other vendors keep Intel's choice, and their reason says it was not measured there.
MASKED_STRIDED_VENDORS = frozenset({"AMD"})
# gathered-images: on the same vendors' cores (outside MASKED_STRIDED_VENDORS) a batch's
# strided conv that the masked rule would take (below MASKED_STRIDED_BELOW output pixels;
# ResNet-18's stem, gathered at batch 32, keeps its form) runs image by image on the
# gathered form, each image's phase copy and then
# its product, which reads the copy from cache (the masked form copies the whole batch's
# phases first, then its masked tiles read them back from memory), where one image's
# product is at least BY_IMAGE_MIN_FLOPS (a few native calls per image) and does not run
# in lanes tiles (masked_lanes). Measured on the 2-core Intel Xeon (KVM, AVX-512), one
# thread, batch 32, each conv + bias + ReLU + GlobalAveragePool alone, thread CPU time,
# medians of 7 calls, the two forms in alternating processes, two rounds, under load
# (docs/performance.md, "Stride-2 convs of a batch image by image"): ResNet-18's 64 -> 128
# 3x3 stride 2 on 56x56 41.8 -> 32.5-33.4 ms, its 1x1 10.4-11.0 -> 7.9-8.4, the 128 -> 256
# 1x1 6.9-7.4 -> 5.4-5.6 (12.8 MFLOP an image each); the 128 -> 256 3x3 (lanes tiles at
# one image) 32.2-34.8 against 32.4-33.5, the 256 -> 512 ones 1.03-1.18x; ResNet-20's
# stride-2 convs (2.4 MFLOP an image at most) 1.06-1.6x. ResNet-18's stem at batch 32 by
# image (each product streaming its output, output_streams) alone 0.972-0.977x, inside the
# model 54.1-55.4 ms against 53.8-59.1 (within the noise): it keeps the gathered form.
BY_IMAGE_MIN_FLOPS = 8_000_000
# ... and, on more threads, whole images per thread (by_image_step). An image's product
# split over the threads in tiles of rows (gemm_split's grid: rows as well as columns
# where its column panels alone would split unevenly, as ResNet-18's 64 -> 128 convs'
# 25 panels of 784 pixels would over 16 threads, an 8 x 2 grid there) has every one of
# a column group's threads gather and pack the same B panels, each thread's share of a
# step is small (7 MFLOP of the 115 an image on 16 threads) against the step's two
# dispatches, and the next image waits on the busiest thread. So where that grid splits
# an image's rows, a step takes min(threads, batch) images instead, their phases copied
# together and their products stacked in one, where that product's grid splits fewer
# rows (B's panels packed by fewer threads): ResNet-18's 64 -> 128 convs on 16 threads
# split 1 x 16 (an image's columns a thread, its panels packed once), its 128 -> 256
# 1x1 4 x 4 against one image's 16 x 1. Derived from gemm_split's grid (its balance and
# operand reads), not measured: no machine of more than two cores was at hand. On two
# threads no conv of ResNet-18 changes (the 64 -> 128 ones split 1 x 2 by columns, the
# 128 -> 256 1x1 2 x 1 for one image and for two stacked). Where a
# thread's image (its phase copy) would not fit BY_IMAGE_L2_SHARE of its L2 (the rest
# for the packed panels and A's rows), threads share an image's panels as before.
BY_IMAGE_L2_SHARE = 0.5
# stacked: the images of a batch go side by side in one product when an image's last
# column panel would be less than STACK_FILL full; for a 1x1 stride-1 conv, which
# otherwise reads X in place row panel by row panel (stacking gathers it), less than
# POINTWISE_STACK_FILL: at batch 32, 7x7 images (77 % full) stacked took 0.56x the
# time of the in-place product, 14x14 (88 %) 1.07x.
STACK_FILL = 0.9
POINTWISE_STACK_FILL = 0.8
# wide: costs the product's extra columns (row gaps, a last partial panel per product)
# and saves the gather of B. Where an output row is whole column panels (32x32 images)
# the gathered B is read in place too and wide loses (16->16 3x3 on 32x32: 1.07x the
# gathered time at batch 32, 1.18x at batch 1; 3->16: 1.5x). Elsewhere it wins while
# its column panels are at most WIDE_MAX_EXTRA times the gathered ones: 0.88x on 32->32
# 3x3 on 16x16 at batch 32 and 0.89x at batch 1 (1.125 times the columns), 0.85x on
# LeNet's 1->6 5x5 on 28x28 at batch 1 (1.17); lost 1.21x on 64->64 3x3 on 8x8 (1.27
# stacked, 1.5 per image).
WIDE_MAX_EXTRA = 1.2
# An output at least this large (the last-level cache there) is stored past the cache:
# the next layer reads it from memory anyway, and the stores skip reading each line
# first (the band conv at batch 32, 51 MB: 16.1 -> 12.2 ms alone).
NT_BYTES = 32 * 2**20


def stream_stores(geo: ConvGeometry, sizes: Caches | None = None) -> bool:
    """Whether the native conv's float32 output bypasses the cache (of ``sizes``; None:
    this machine's)."""
    return math.prod(geo.out_shape) * 4 >= (sizes or caches()).with_llc(NT_BYTES)


# The native GEMM's micro-tile (rows, columns) as gemm.c compiles it for each SIMD
# level (columns: two vectors): how full a product's column panels are, so the native
# conv's forms depend on it. A plan for another machine's profile uses its level's tile.
_TILES = {"avx512": (8, 32), "avx2": (6, 16), "avx": (6, 16), "sse4.2": (6, 8),
          "sse2": (6, 8), "neon": (6, 8), "sve": (6, 8), "sve2": (6, 8), "scalar": (4, 8)}
Grid = tuple[int, int] | None        # the native micro-tile; None: no native GEMM
_HERE: Any = object()                # "the tile of the native GEMM loaded here"


def tile_grid(profile: Any = None) -> Grid:
    """The native GEMM tile plans assume: the loaded kernel's (for no profile, or one of
    this CPU's SIMD level), else the tile gemm.c compiles for the profile's SIMD level
    (None without the native tier)."""
    here = native_gemm.geometry()
    level = None if profile is None else profile.cpu.simd_level
    if here is None or level is None or level == _this_simd_level():
        return here
    return _TILES.get(level, here)


@functools.cache
def _this_simd_level() -> str | None:
    from keel.backends.cpu.backend import CpuBackend

    return CpuBackend().simd_level


def _grid(grid: Any) -> Grid:
    return native_gemm.geometry() if grid is _HERE else grid


# The channel-blocked direct conv (native_blocked, blocked.c: 16 output channels in each
# vector, filters loaded whole and X's values broadcast, where the masked tiles load X's
# taps through lane masks across cache lines; the masked form's bits) runs inside a
# float NCHWc region (float_layouts), where the values between its convs stay blocked,
# or alone where blocked_alone says (below). Measured on the 2-core Intel Xeon
# (AVX-512), one thread, under load (docs/performance.md, "The channel-blocked 3 x 3
# conv"): each 3x3 stride-1 conv alone, hot, 0.69-0.89x the masked time, but a lone
# blocked conv writing NCHW moved ResNet-20 only 0.97-0.99x (the transposes into NCHW
# were 10 % of its samples); the region's gain is in docs/performance.md, "A float NCHWc
# region". ResNet-20's stride-2 3x3 and 1x1 shortcut convs alone (docs/performance.md,
# "Strided and 1 x 1 convs in the region"): 0.38-0.81x the gathered or masked form's
# time at batch 1 and 32 (fastest of 15 rounds), inside the model 0.5-0.85x per node,
# one region against three 0.78-0.94x, so a stage's downsampling block joins the region.
# A 1x1 stride-1 conv stays out (the kernel computes it, but MobileNetV2's 32 -> 16 and
# 16 -> 96 on 112 x 112 ran 1.4-1.7x their direct time blocked, one thread, under load).
# A conv of fewer than BLOCKED_MIN_CHANNELS input channels (the 3 -> 16 stem) and other
# vendors' cores were not measured, and keep their forms.
BLOCKED_MIN_CHANNELS = 16
BLOCKED_VENDORS = frozenset({"Intel"})


def blocked_conv(geo: ConvGeometry, grid: Any = _HERE, vendor: Any = _HERE) -> bool:
    """Whether a float conv may run channel-blocked, inside an NCHWc region or alone
    (blocked_alone adds its own conditions): served by
    the blocked kernel (conv_gemm.blocked_serves: 3x3 padded by one or 1x1 unpadded,
    stride 1 or 2) and not a 1x1 stride-1 conv (measured slower), at least
    BLOCKED_MIN_CHANNELS input
    channels in whole blocks of 16, on an AVX-512 core of BLOCKED_VENDORS (defaults:
    this machine's), where the blocked kernel (blocked.c) is loaded."""
    grid = _grid(grid)
    vendor = _this_vendor() if vendor is _HERE else vendor
    return (grid == _TILES["avx512"] and vendor in BLOCKED_VENDORS
            and native_blocked.available()
            and geo.in_channels >= BLOCKED_MIN_CHANNELS
            and geo.in_channels % native_blocked.LANES == 0 and conv_gemm.blocked_serves(geo)
            and not (geo.is_pointwise and tuple(geo.window.strides) == (1, 1)))


# A 3x3 stride-2 conv outside any region runs channel-blocked alone (X and Y NCHW, the
# sums transposed into Y's rows) where its output rows are at least BLOCKED_ALONE_MIN_WIDTH
# pixels: a whole 8-pixel tile then does most of a row, its tail the rest with both
# blocks of the register tile (28- and 14-wide two-block rows run blocked_wide's 2 x 14
# tiles since; the figures below were measured before those). Measured as
# BLOCKED_VENDORS says, one process, alternating, under load (blocked / the form
# planned before): ResNet-18's 64 -> 128 on 56 x 56 (28
# out) 0.72 at batch 1 and 0.69 at batch 32 on one thread (medians, the conv alone); its
# 128 -> 256 (14 out) inside the model 0.80-0.89 at batch 1 and 0.79-0.84 at batch 32 on
# one thread, 0.94 at batch 1 on two (fastest of 18-60 runs); its 256 -> 512 (7 out, a
# tail tile only) 1.00-1.03 at batch 1 and 32 in the model; the 1x1 stride-2 shortcuts
# 0.88-1.21 in the model (fastest), so they keep their forms. The 14-pixel rows were
# measured with two blocks a tile (out channels a multiple of 32, blocked_oc_tile); a
# one-block conv's tail runs one block, as every row did when 16 pixels was the least
# measured to pay, so it keeps BLOCKED_ALONE_ONE_BLOCK_MIN_WIDTH.
BLOCKED_ALONE_MIN_WIDTH = 14
BLOCKED_ALONE_ONE_BLOCK_MIN_WIDTH = 16
# On many threads a batch's 7-pixel rows run blocked alone too (blocked_alone_width):
# ResNet-18's 256 -> 512 (7 out) at batch 32 on the 16 threads of a 16-core Intel Xeon
# (an H200 machine's host), in the model, every variant in one process, 5 alternating
# passes (benchmarks/results/cpu16-s2-ab-20261128T064434Z.txt): blocked 4435 / 3456 us
# (median / fastest) against the masked form's 5769 / 4687 (0.77 / 0.74), the same
# bits. On one and two threads it was 1.00-1.03 (above); between 2 and 16 threads and at
# batch 1 on many it was not measured, so the 2-thread rule stands there.
BLOCKED_ALONE_MANY_THREADS = 16
BLOCKED_ALONE_MANY_MIN_WIDTH = 7
BLOCKED_ALONE_REASON = (
    "channel-blocked alone (planner.blocked_alone): a 3x3 stride-2 conv outside any float "
    "NCHWc region, {width}-pixel output rows >= {least} (blocked_alone_width); X read "
    "in NCHW where it lies, each input value broadcast once for the taps that read it, "
    "the sums transposed 16 x 16 into Y's NCHW rows "
    "(measured on ResNet-18's 64 -> 128, alone, and 128 -> 256, in the model, at batch 1 "
    "and 32 on one thread and the latter at batch 1 on two, on a 2-core Intel Xeon: "
    "0.69-0.72x (medians) and 0.79-0.94x (fastest) the gathered or masked form planned "
    "before, 7-pixel rows no faster; other shapes follow from it, not measured)")


def blocked_alone(geo: ConvGeometry, threads: int | None = 1) -> bool:
    """Whether a blockable conv (blocked_conv) outside any region runs blocked alone: 3x3
    at stride 2 with output rows of at least blocked_alone_width pixels."""
    win = geo.window
    return (tuple(win.kernel) == (3, 3) and tuple(win.strides) == (2, 2)
            and win.out_spatial[1] >= blocked_alone_width(
                geo.out_channels, batch_on_many_threads(geo, threads, BLOCKED_ALONE_MANY_THREADS)))


def batch_on_many_threads(geo: ConvGeometry, threads: int | None, many: int) -> bool:
    """Whether ``geo`` is a batch whose product splits over ``many`` threads or more on
    ``threads`` (its flops under the least work a thread: gemm_threads), the case the
    many-thread rules were measured in (a conv on a 16-thread cap that gets fewer threads
    for want of work is the few-thread case)."""
    return geo.batch > 1 and gemm_threads(threads or 1, geo.batch * _image_flops(geo)) >= many


def blocked_alone_width(out_channels: int, many_threads: bool = False) -> int:
    """The least output row a lone blocked conv takes: BLOCKED_ALONE_MIN_WIDTH where its
    register tile holds two blocks (the width measured with a two-block tail), else
    BLOCKED_ALONE_ONE_BLOCK_MIN_WIDTH; BLOCKED_ALONE_MANY_MIN_WIDTH for a batch split
    over BLOCKED_ALONE_MANY_THREADS or more (``many_threads``: batch_on_many_threads)."""
    if many_threads:
        return BLOCKED_ALONE_MANY_MIN_WIDTH
    return (BLOCKED_ALONE_MIN_WIDTH if blocked_oc_tile(out_channels) == 2
            else BLOCKED_ALONE_ONE_BLOCK_MIN_WIDTH)


def blocked_oc_tile(out_channels: int) -> int:
    """Blocks of 16 output channels a register tile of the blocked conv: two (2 x 8
    pixels, 16 accumulators, two filter loads for eight broadcasts) where the blocks pair
    up, else one (1 x 16 pixels). Measured as BLOCKED_VENDORS says, at batch 32: 32 -> 32
    on 16 x 16 2 x 8 1,018 us against 1 x 16 1,136 and 2 x 16 1,992 (spilled registers);
    64 -> 64 on 8 x 8 2 x 8 956 against 4 x 4 998 and 2 x 4 1,123; 16 -> 16 (one block)
    1 x 16 1,193 against 1 x 8 1,270."""
    return 2 if out_channels % 32 == 0 else 1


def blocked_rows(geo: ConvGeometry) -> int:
    """Output rows a unit of the blocked conv (a band the kernel sums, then writes sixteen
    pixels a transpose): two where a row is 8 pixels past whole 16-pixel transposes and
    the rows pair up (the band then is whole transposes), else one (a row of whole
    transposes already, or one whose short last run goes through lane masks). Derived
    from the kernel's 16-pixel transposes, not measured."""
    h, w = geo.window.out_spatial
    return 2 if w % 16 == 8 and h % 2 == 0 else 1


def blocked_wide(geo: ConvGeometry) -> bool:
    """Whether the blocked conv runs 2 x 14-pixel register tiles: 3x3 at stride 2 with
    two blocks a tile (blocked_oc_tile) and output rows a multiple of 14 pixels but not
    of 8 (a row of 8-pixel tiles would end in a 4- or 6-pixel tail that costs about as
    much as a whole tile). Same sums in the same order, so the same bits. Measured as
    BLOCKED_VENDORS says, one thread, the conv alone at batch 1, one process, alternating
    (14-pixel / 8-pixel tiles, median and fastest of ~2,400 runs each, under load):
    ResNet-18's 64 -> 128 on 56 x 56 (28 out) 0.89 / 0.89, 128 -> 256 on 28 x 28 (14
    out) 0.89 / 0.88; 12 + 8 + 8 pixels gave the 28 the same 0.90 and nothing for the 14,
    7 + 7 pixels 1.00."""
    w = geo.window.out_spatial[1]
    return (tuple(geo.window.kernel) == (3, 3) and tuple(geo.window.strides) == (2, 2)
            and blocked_oc_tile(geo.out_channels) == 2
            and w % native_blocked.WIDE == 0 and w % 8 != 0)


def _blocked_tiles_reason(geo: ConvGeometry) -> str:
    """Why the blocked conv's register tiles are as wide as they are (blocked_wide)."""
    w = geo.window.out_spatial[1]
    if blocked_wide(geo):
        return (f"2 x {native_blocked.WIDE}-pixel register tiles (blocked_wide: "
                f"{w}-pixel rows at stride 2 would end in a tail tile as costly as a whole "
                "one; measured 0.88-0.89x the 8-pixel tiles on ResNet-18's 28- and "
                "14-wide stride-2 convs, one thread)")
    return "8- or 16-pixel register tiles and a row's last 1-7 pixels in one tail tile"


def _blocked_rows_reason(geo: ConvGeometry) -> str:
    """Why :func:`blocked_rows` gives a blocked conv's rows a unit."""
    h, w = geo.window.out_spatial
    if blocked_rows(geo) == 2:
        return (f"2 output rows a unit (blocked_rows: {w}-pixel rows are 8 past whole "
                "16-pixel transposes and pair up, so a band is whole transposes)")
    if w % 16 == 0:
        return (f"1 output row a unit (blocked_rows: a {w}-pixel row is whole 16-pixel "
                "transposes already)")
    return (f"1 output row a unit (blocked_rows: {w}-pixel rows by {h} do not pair into "
            "whole 16-pixel transposes; a short last run goes through lane masks)")


@dataclass(frozen=True)
class BlockedSplit:
    """How the blocked conv splits over threads: its output channels in ``groups`` equal
    groups of whole register tiles, its units (a band of output rows of one group of one
    image) in ``parts`` chunks of consecutive units, and why."""

    groups: int
    units: int
    parts: int
    reason: str

    @property
    def pair(self) -> tuple[int, int]:
        """(groups, parts): what the kernel call asks (native_blocked.Split)."""
        return self.groups, self.parts


def blocked_split(geo: ConvGeometry, threads: int) -> BlockedSplit:
    """The grid of bands x channel groups of the blocked conv on up to ``threads``
    threads, derived from the products' split (gemm_split): for each number of groups
    that divides the register tiles, the chunks whose every one gets the least flops of
    a split that wide (split_parts); the least work on the busiest thread wins, grids
    within SPLIT_BALANCE_SLACK of it counting as equal, then the fewest groups (an
    image's X is read by the threads of every group, as a product's B by every row
    group). Bands alone where they are as even: on one or two threads the bands-only
    split measured before channel groups existed."""
    return _blocked_split(geo, threads, split_reads())


def split_reads() -> tuple[str, int]:
    """What blocked_split reads beyond a conv and its threads: this process's thread
    costs (they change where they are measured, refreshed or forgotten) and the least
    flops a thread. A blocked call binds its split again when they change, run() and a
    program's bound step alike."""
    return thread_costs.current().token, MIN_FLOPS_PER_THREAD


@functools.lru_cache(maxsize=1024)
def _blocked_split(geo: ConvGeometry, threads: int, least: tuple[str, int]) -> BlockedSplit:
    bands = _blocked_units(geo)
    tiles = geo.out_channels // (native_blocked.LANES * blocked_oc_tile(geo.out_channels))
    if bands == 0:                      # an empty batch: nothing to split
        return BlockedSplit(1, 0, 1, "not split: an empty batch")
    flops = geo.batch * _image_flops(geo)
    found = []
    for groups in (g for g in range(1, tiles + 1) if tiles % g == 0):
        units = bands * groups
        parts = max(1, split_parts(LeastWork.FLOPS, threads, units, flops // units))
        found.append((-(-units // parts) * flops // units, groups, units, parts))
    least_span = min(f[0] for f in found)
    span, groups, units, parts = min(
        (f for f in found if f[0] <= least_span * (1 + SPLIT_BALANCE_SLACK)),
        key=lambda f: f[1:])           # within the slack, the fewest groups
    return BlockedSplit(groups, units, parts, (
        f"the grid: {bands} band(s) of output rows x {groups} group(s) of {tiles // groups} "
        f"register tile(s) of output channels, the busiest thread {span:,} of {flops:,} "
        "flops (blocked_split: the least busiest work, then the fewest groups, as the "
        "products' split; derived, not measured on more than two cores)"))


def blocked_parts(geo: ConvGeometry, threads: int) -> int:
    """Chunks of the blocked conv's units on up to ``threads`` threads (blocked_split)."""
    return blocked_split(geo, threads).parts


def _blocked_units(geo: ConvGeometry) -> int:
    """The blocked conv's bands of output rows, images after one another."""
    return geo.batch * (geo.window.out_spatial[0] // blocked_rows(geo))


def stacks(batch: int, pixels: int, fill: float = STACK_FILL, grid: Any = _HERE) -> bool:
    """Whether a batch's images go side by side in one native product: an image's
    column panels would be less than ``fill`` full."""
    grid = _grid(grid)
    return grid is not None and batch > 1 and pixels % grid[1] != 0 and (
        pixels / (-(-pixels // grid[1]) * grid[1]) < fill)


def _band_wins(geo: ConvGeometry, grid: Grid) -> bool:
    win = geo.window
    return (grid is not None and grid[1] == BAND_PANEL and win.rank == 2 and geo.group == 1
            and any(s != 1 for s in win.strides)
            and geo.in_channels * math.prod(win.kernel) <= BAND_MAX_DEPTH
            and math.prod(win.out_spatial) >= BAND_FROM)


def _masked_wins(geo: ConvGeometry, grid: Grid, vendor: str | None) -> bool:
    win = geo.window
    unit = all(s == 1 for s in win.strides)
    if grid is None or conv_gemm.masked_layout(geo) is None or (
            geo.is_pointwise and not win.padded and unit):
        return False                # a 1x1 stride-1 conv reads X in place as it is
    if unit:
        return True
    if _masked_waits(geo, grid, vendor):
        return False
    return math.prod(win.out_spatial) < MASKED_STRIDED_BELOW or _one_small_image(geo)


def _by_image_wins(geo: ConvGeometry, grid: Grid, vendor: str | None) -> bool:
    """Whether a batch's strided conv runs gathered image by image (BY_IMAGE_MIN_FLOPS)."""
    win = geo.window
    if (grid is None or geo.batch < 2 or geo.group != 1 or win.rank != 2
            or vendor in MASKED_STRIDED_VENDORS or all(s == 1 for s in win.strides)):
        return False
    one = dataclasses.replace(geo, batch=1)
    return (math.prod(win.out_spatial) < MASKED_STRIDED_BELOW and conv_gemm.masked_layout(geo)
            is not None and _image_flops(geo) >= BY_IMAGE_MIN_FLOPS
            and not _masked_lanes_reason(one, grid))


def by_image_step(geo: ConvGeometry, threads: int, grid: Any = _HERE,
                  sizes: Caches | None = None) -> tuple[int, str]:
    """The gathered-images form's images a step on ``threads`` threads (1: threads share
    each image's product; k: k images' products stacked, whole images per thread), and
    why (BY_IMAGE_L2_SHARE)."""
    grid = _grid(grid)
    win = geo.window
    pixels, depth = math.prod(win.out_spatial), geo.in_channels * math.prod(win.kernel)
    one = gemm_split(1, geo.out_channels, pixels, depth, threads, grid, sizes, (False, True))
    if geo.batch < 2:
        return 1, "an image a step: a batch of one image or none"
    if threads < 2 or one.parts < 2:
        return 1, "an image a step: one thread" + ("" if threads < 2 else f" ({one.reason})")
    if one.rows < 2:
        return 1, (f"an image a step: its product splits over {one.parts} threads by "
                   f"columns ({one.rows}x{one.cols} tiles), each thread packing its own "
                   "panels (by_image_step)")
    sizes = sizes or caches()
    image = conv_gemm.native_scratch(           # one image's phase copy, float32
        conv_gemm.native_layout(dataclasses.replace(geo, batch=1), "gathered"), 4)
    if image > BY_IMAGE_L2_SHARE * sizes.l2:
        return 1, (f"an image a step: an image's phase copy ({image >> 10} KiB) over "
                   f"{BY_IMAGE_L2_SHARE} of the {sizes.l2 >> 10} KiB L2 (BY_IMAGE_L2_SHARE)")
    step = min(threads, geo.batch)
    stacked = gemm_split(1, geo.out_channels, step * pixels, depth, threads, grid, sizes,
                         (False, True))
    if stacked.rows >= one.rows:
        return 1, (f"an image a step: its product splits over {one.parts} threads in "
                   f"{one.rows}x{one.cols} tiles, and {step} images' stacked in "
                   f"{stacked.rows}x{stacked.cols}: B's panels packed as often "
                   "(by_image_step)")
    return step, (f"{step} images a step, whole images per thread: one image's product "
                  f"over {one.parts} threads would split its rows too ({one.rows}x{one.cols} "
                  f"tiles, each B panel packed by {one.rows} threads), {step} images' "
                  f"stacked in one split {stacked.rows}x{stacked.cols}; their phase copies "
                  f"({image >> 10} KiB an image) within {BY_IMAGE_L2_SHARE} of the "
                  f"{sizes.l2 >> 10} KiB L2 (by_image_step: derived from gemm_split's grid, "
                  "not measured on more than two cores)")


def _image_flops(geo: ConvGeometry) -> int:
    """The multiply-adds (two flops each) of one image of a dense conv."""
    win = geo.window
    return 2 * geo.out_channels * math.prod(win.out_spatial) * geo.in_channels * math.prod(
        win.kernel) // geo.group


def _masked_waits(geo: ConvGeometry, grid: Grid, vendor: str | None) -> bool:
    """Whether a strided conv's masked tiles would wait on their masked loads: one image
    on a CPU outside MASKED_STRIDED_VENDORS, its product not in lanes tiles."""
    return (geo.batch == 1 and vendor not in MASKED_STRIDED_VENDORS
            and grid is not None and not _masked_lanes_reason(geo, grid))


def _one_small_image(geo: ConvGeometry) -> bool:
    return geo.batch == 1 and geo.group == 1 and geo.in_channels <= MASKED_ONE_IMAGE_CHANNELS


def _masked_waits_reason(vendor: str | None) -> str:
    """Why one image's strided conv is not masked on ``vendor``'s cores."""
    if vendor == "Intel":
        return "whose masked tiles wait on their masked loads on Intel's cores"
    return (f"the masked form {unmeasured_vendor(vendor)}, and its masked loads waited on "
            "Intel's")


def _masked_lanes_reason(geo: ConvGeometry, grid: Grid) -> str:
    """", in lanes tiles: ..." where the masked conv's products run in lanes tiles."""
    pixels = math.prod(geo.window.out_spatial)
    rows, depth = geo.out_channels // geo.group, geo.in_channels // geo.group
    depth *= math.prod(geo.window.kernel)
    if grid is None or not masked_lanes(rows, pixels, depth, grid):
        return ""
    computed = -(-pixels // grid[1]) * grid[1]
    return (f", in lanes tiles: {pixels} pixels an image, which {grid[1]}-column panels "
            f"compute as {computed} (masked_lanes)")


def _direct_lanes_reason(geo: ConvGeometry, grid: Grid, vendor: str | None) -> str:
    """", in lanes tiles: ..." where the direct form's products run in lanes tiles, or
    why a product of the lanes tiles' shapes does not on a vendor outside LANES_VENDORS."""
    pixels = math.prod(geo.window.out_spatial)
    rows, depth = geo.out_channels // geo.group, geo.in_channels // geo.group
    if grid is None or not _lanes_fit(geo.batch, rows, pixels, depth):
        return ""
    computed = -(-pixels // grid[1]) * grid[1]
    shape = f"{pixels} pixels an image, which {grid[1]}-column panels compute as {computed}"
    if not lanes_built(grid):
        return (f", not in lanes tiles: {shape}; gemm.c builds them with its "
                f"{LANES_GRID[0]} x {LANES_GRID[1]} tiles only (LANES_GRID), these are "
                f"{grid[0]} x {grid[1]}")
    if lanes_tiles(geo.batch, rows, pixels, depth, vendor, grid):
        return f", in lanes tiles: {shape} (lanes_tiles)"
    why = (f"depth {depth} below the {rows} rows" if depth < rows
           else f"over LANES_MAX_COLUMNS ({LANES_MAX_COLUMNS}) pixels")
    port = "the lanes tiles' shuffles share a port with the FMA units"
    return (f", not in lanes tiles: {shape}, under LANES_PANEL_WASTE ({LANES_PANEL_WASTE}x), "
            f"{why}: " + (f"{port} on Intel's cores" if vendor == "Intel"
                          else f"as on Intel's cores, where {port}; {unmeasured_vendor(vendor)}"))


def _lanes_tail_reason(geo: ConvGeometry, grid: Grid, vendor: str | None) -> str:
    """"; its last ... columns in lanes tiles" where the direct form's products run in
    column panels and lanes_tail takes their partly filled last panel."""
    pixels = math.prod(geo.window.out_spatial)
    rows, depth = geo.out_channels // geo.group, geo.in_channels // geo.group
    if grid is None or lanes_tiles(geo.batch, rows, pixels, depth, vendor, grid) or (
            not lanes_tail(rows, pixels, depth, grid, vendor)):
        return ""
    tail = pixels % grid[1]
    return (f"; the last {tail} of its {pixels} pixels an image in lanes tiles, the full "
            f"{grid[1]}-column panels in {grid[0]} x {grid[1]} tiles: that panel's "
            f"{grid[1] // 2}-column vector computes {tail} (lanes_tail, "
            f"<= LANES_TAIL_MAX_COLUMNS {LANES_TAIL_MAX_COLUMNS}, on LANES_TAIL_VENDORS' "
            "cores: measured on a 2-core Intel Xeon)")


def _output_streams_reason(geo: ConvGeometry) -> str:
    """"; its output ... streams" where output_streams flags the gathered product (one
    group's output: a grouped conv runs a product per group)."""
    if not _gathered_output_streams(geo):
        return ""
    size = 4 * geo.batch * geo.out_channels // geo.group * math.prod(geo.window.out_spatial)
    return (f"; its output ({size / 2**20:.1f} MiB) > STREAM_BYTES ({STREAM_BYTES >> 20} MiB): "
            "the product streams, and gemm.c writes taps of many columns row panel by row "
            "panel (output_streams)")


def _gathered_output_streams(geo: ConvGeometry) -> bool:
    """output_streams for the product of a gathered conv (one group's output)."""
    pixels = math.prod(geo.window.out_spatial)
    return output_streams(geo.batch, pixels,
                          4 * geo.batch * geo.out_channels // geo.group * pixels)


def native_tiles(geo: ConvGeometry, form: str, grid: Any = _HERE, vendor: Any = _HERE
                 ) -> tuple[bool | None, bool]:
    """How the native conv's products in ``form`` run, as native_form's reason says:
    in lanes tiles or not (the direct form's lanes_tiles for ``vendor``, the masked
    form's masked_lanes; None for the other forms, whose operands the lanes tiles do not
    take) and whether its gathered taps stream for its output's sake
    (output_streams). The kernel runs what the plan says, whatever this machine's vendor."""
    grid = _grid(grid)
    vendor = _this_vendor() if vendor is _HERE else vendor
    lanes = None
    pixels = math.prod(geo.window.out_spatial)
    rows, depth = geo.out_channels // geo.group, geo.in_channels // geo.group
    if form == "direct":
        lanes = grid is not None and lanes_tiles(geo.batch, rows, pixels, depth, vendor, grid)
    elif form == "masked":                  # the taps of one image a product
        lanes = masked_lanes(rows, pixels, depth * math.prod(geo.window.kernel), grid)
    streams = form in ("gathered", "gathered-stacked") and _gathered_output_streams(geo)
    return lanes, streams


def native_a16(lanes: bool | None, grid: Any = _HERE, vendor: Any = _HERE
               ) -> tuple[bool, str]:
    """Whether the native conv's filters are packed in 16-row panels only, and why: its
    products run in lanes tiles as planned (``lanes``: native_tiles') and lanes_a16
    takes the tile ``grid`` and ``vendor`` planned for (defaults: this machine's). The
    plan carries it (gemm_a16): the filters are packed, and the calls read them, as it
    says, whatever this machine's vendor. (False, "") where no product runs in lanes
    tiles: 8-row panels, nothing to choose."""
    if lanes is not True:
        return False, ""
    vendor = _this_vendor() if vendor is _HERE else vendor
    if lanes_a16(grid, vendor):
        return True, ("A in 16-row panels, one load a vector where two 8-row ones take an "
                      "insert on the port of an FMA unit, its filters packed that way only "
                      "(lanes_a16, LANES_A16_VENDORS: measured on a 2-core Intel Xeon)")
    return False, ("A in 8-row panels, two joined each depth step: 16-row panels were "
                   "measured on Intel's cores only (lanes_a16, LANES_A16_VENDORS): "
                   f"{unmeasured_vendor(vendor)}")


def wide_stacks(geo: ConvGeometry, grid: Any = _HERE) -> bool:
    """Stack a batch's images in one wide product when that makes fewer column panels."""
    grid = _grid(grid)
    width = 32 if grid is None else grid[1]
    return geo.batch > 1 and (conv_gemm.wide_panels(geo, True, width)
                              < conv_gemm.wide_panels(geo, False, width))


def _wide_wins(geo: ConvGeometry, grid: Grid) -> bool:
    if grid is None or not conv_gemm.wide_serves(geo) or geo.window.out_spatial[-1] % grid[1] == 0:
        return False
    pixels = math.prod(geo.window.out_spatial)
    together = stacks(geo.batch, pixels, grid=grid)
    gathered = conv_gemm.panels(geo.batch * pixels if together else pixels, grid[1])
    if not together:
        gathered *= geo.batch
    return (conv_gemm.wide_panels(geo, wide_stacks(geo, grid), grid[1])
            <= WIDE_MAX_EXTRA * gathered)


# gathered-strided: an unpadded 1x1 stride-2 conv whose output rows are at least this
# many pixels packs its B straight from X (gemm.c pack_pairs: a row's every other float,
# two loads and one permute per 16 columns), with no phase copy of X first. Measured on
# the 2-core Intel Xeon (KVM, AVX-512), ResNet-18's shortcuts in the model, new against
# the phase copy + gathered / gathered-images forms in one process, alternating passes,
# under load (median / fastest, us): batch 1, one thread, 64 -> 128 on 28x28 260 / 220 ->
# 201 / 166, 128 -> 256 on 14x14 200 / 172 -> 171 / 149; two threads 244 / 148 -> 218 /
# 118 and 180 / 124 -> 158 / 102. The 7-wide 256 -> 512 lost alone (batch 1 150 / 110 ->
# 157 / 120 us, batch 32 9.9 / 7.7 -> 12.5 / 12.2 ms): it keeps the masked form, whose
# lanes tiles compute 49 pixels as 49 where 32-column panels compute 64. One image only:
# at batch 32 (4 passes, heavy load) the form read 44.3 / 16.0 -> 50.2 / 17.2 ms (28x28)
# and 31.8 / 9.8 -> 33.7 / 13.8 ms (14x14) against gathered-images, whose per-image phase
# copy leaves the product's B in cache; a batch keeps that form. AVX-512 tiles only
# (pack_pairs is AVX-512 code: elsewhere a map stepping by two packs column by column,
# measured 1.15-1.23x the phase copy on an AVX2 build of the same Xeon) and on the vendors
# it was measured on (STRIDED_GATHER_VENDORS).
STRIDED_GATHER_MIN_WIDTH = 14
STRIDED_GATHER_VENDORS = frozenset({"Intel"})
# A batch runs gathered-strided too on STRIDED_GATHER_BATCH_THREADS threads or more:
# ResNet-18's shortcuts at batch 32 on the 16 threads of a 16-core Intel Xeon (an H200
# machine's host), in the model, every variant in one process, 5 alternating passes
# (benchmarks/results/cpu16-s2-ab-20261128T064434Z.txt; median / fastest, us): 64 -> 128
# (28 x 28 out) 1039 / 837 against gathered-images' 1277 / 1067 (0.81 / 0.78), 128 -> 256
# (14 x 14) 789 / 603 against 2033 / 1601 (0.39 / 0.38), the same bits: there the phase
# copy is a pass of its own over every image, split thin (an image a step) or its B read
# back from memory (16 images a step). On one or two threads a batch keeps
# gathered-images (above); between 2 and 16 threads it was not measured.
STRIDED_GATHER_BATCH_THREADS = 16


def _strided_gather_wins(geo: ConvGeometry, grid: Grid, vendor: str | None,
                         threads: int) -> bool:
    """Whether a conv runs gathered-strided (STRIDED_GATHER_MIN_WIDTH, on AVX-512 tiles
    of STRIDED_GATHER_VENDORS' cores; one image, or a batch split over
    STRIDED_GATHER_BATCH_THREADS threads or more: batch_on_many_threads)."""
    return (grid == _TILES["avx512"] and vendor in STRIDED_GATHER_VENDORS
            and (geo.batch == 1
                 or batch_on_many_threads(geo, threads, STRIDED_GATHER_BATCH_THREADS))
            and conv_gemm.strided_serves(geo)
            and geo.window.out_spatial[-1] >= STRIDED_GATHER_MIN_WIDTH)


def native_form(geo: ConvGeometry, grid: Any = _HERE, vendor: Any = _HERE,
                threads: int = 1) -> tuple[str, str]:
    """The form the native conv runs ``geo`` in on ``threads`` threads (see
    conv_gemm.native_layout), and why; ``grid`` the native tile and ``vendor`` the CPU's
    vendor planned for (defaults: this machine's)."""
    grid = _grid(grid)
    vendor = _this_vendor() if vendor is _HERE else vendor
    win = geo.window
    pixels = math.prod(win.out_spatial)
    if _strided_gather_wins(geo, grid, vendor, threads):
        many = (f" (a batch of {geo.batch} split over STRIDED_GATHER_BATCH_THREADS "
                f"{STRIDED_GATHER_BATCH_THREADS} threads or more: measured "
                f"0.39-0.81x gathered-images on ResNet-18's shortcuts at batch 32 on a "
                f"16-core Intel Xeon)") if geo.batch > 1 else ""
        return "gathered-strided", (
            f"gathered-strided: an unpadded 1x1 stride-2 conv of output rows of "
            f"{win.out_spatial[-1]} >= STRIDED_GATHER_MIN_WIDTH {STRIDED_GATHER_MIN_WIDTH} "
            f"pixels, its B packed from X itself (a row's every other float, one permute), "
            f"no phase copy{many}")
    if _band_wins(geo, grid):
        return "band", (f"band: depth {geo.in_channels * math.prod(win.kernel)} <= "
                        f"{BAND_MAX_DEPTH}, {pixels} output pixels >= {BAND_FROM}, strided")
    if _by_image_wins(geo, grid, vendor):
        return "gathered-images", (
            f"gathered-images: step by step (the chunk's images a step), each step's phase "
            f"copy then its product, "
            f"which reads it from cache ({_image_flops(geo) / 1e6:.1f} MFLOP an image >= "
            f"BY_IMAGE_MIN_FLOPS {BY_IMAGE_MIN_FLOPS / 1e6:.0f}); not masked: a batch of "
            f"{geo.batch}, {_masked_waits_reason(vendor)} (MASKED_STRIDED_VENDORS)")
    if _masked_wins(geo, grid, vendor):
        strided = any(s != 1 for s in win.strides) and pixels >= MASKED_STRIDED_BELOW
        return "masked", "masked: every tap reads a plane of the output's shape in place" + (
            f", {pixels} output pixels of one image of {geo.in_channels} channel(s) (<= "
            f"{MASKED_ONE_IMAGE_CHANNELS}): its phase image stays in cache" if strided
            else "") + _masked_lanes_reason(geo, grid)
    if _wide_wins(geo, grid):
        form = "wide-stacked" if wide_stacks(geo, grid) else "wide"
        return form, f"{form}: its column panels within {WIDE_MAX_EXTRA}x the gathered ones"
    unit = all(s == 1 for s in win.strides)
    if geo.is_pointwise and unit and not stacks(geo.batch, pixels, POINTWISE_STACK_FILL, grid):
        return "direct", ("direct: a 1x1 stride-1 conv reads X in place"
                          + _direct_lanes_reason(geo, grid, vendor)
                          + _lanes_tail_reason(geo, grid, vendor))
    if stacks(geo.batch, pixels, grid=grid):
        return "gathered-stacked", (f"gathered-stacked: {pixels} pixels fill an image's "
                                    f"column panels less than {STACK_FILL:.0%}"
                                    + _output_streams_reason(geo))
    return "gathered", "gathered: B gathered block by block from the (phase) image" + (
        _output_streams_reason(geo)) + (
        f"; not masked: one image, {_masked_waits_reason(vendor)} (MASKED_STRIDED_VENDORS)"
        if _masked_waits(geo, grid, vendor) and conv_gemm.masked_layout(geo) is not None
        and (pixels < MASKED_STRIDED_BELOW or _one_small_image(geo)) else "")


# ---- the native GEMM's tall tiles -------------------------------------------------------
# gemm.c runs a product in tall tiles (every row of C over one 16-column vector, B read
# in place once; AVX-512 builds only) when the prepared call carries KEEL_TALL and its
# operands fit (a packed A, a raw B of contiguous rows, no tables). Measured inside
# MobileNetV2 at batch 32 on the 2-core AMD EPYC (Zen 4, AVX-512), 1 thread (ms, 8 x 32
# tiles -> tall): projections 32 -> 16 on 112x112 8.43 -> 5.12, 96 -> 24 on 56x56 8.87
# -> 4.58, 144 -> 32 on 28x28 3.87 -> 2.35, 576 -> 96 with the residual 10.11 -> 7.87;
# expansions (depth below the rows) lost: 1.36x on 16 -> 96 on 112x112, 1.17x on 24 ->
# 144 on 56x56. So: 9 to TALL_ROWS rows (one group of tiles), or up to TALL_MAX_ROWS
# rows at a depth of at least twice the rows.
TALL_MIN_ROWS = 9
TALL_ROWS = 24
TALL_MAX_ROWS = 256


def tall_tiles(m: int, k: int) -> bool:
    """Whether a native product of ``m`` rows and depth ``k`` runs in tall tiles (where
    its operands fit them)."""
    return TALL_MIN_ROWS <= m <= TALL_ROWS or (m <= TALL_MAX_ROWS and k >= 2 * m)


# ---- the native GEMM's lanes tiles ------------------------------------------------------
# gemm.c runs a product of few columns with C's rows in the vector lanes (32 rows by up to
# 12 columns a tile, the columns split as evenly as whole columns allow, AVX-512 builds
# with 8-row panels only) when the prepared call carries KEEL_LANES and its operands fit
# as tall tiles' do: a 1x1 conv on a 7x7 map at batch 1 (49 columns) computes 49
# columns instead of the 64 of two 32-column panels or four 16-column vectors. Every
# element is the same chain of operations as in the panels, so the choice may follow the
# shape (and the batch) freely. Measured on the 2-core AMD EPYC (Zen 5), one thread,
# thread CPU time, alternating, under load (us, panels or tall -> lanes, with bias and
# clip): 49 columns 320x960 187 -> 133, 960x160 96 -> 77, 1280x320 238 -> 181, 160x960
# 86 -> 61, 576x160 54 -> 41; 196 columns 576x96 115 -> 106, 96x576 102 -> 89, 384x64
# 53 -> 50, 64x384 47 -> 40, 64x192 26 -> 22; 784 columns 32x192 54 -> 44, 32x144 38 ->
# 34 but 192x32 59 -> 65 (depth below the rows: the transposes outweigh the waste);
# 3136 columns 144x24 152 -> 173, 24x144 116 -> 115. So: up to LANES_MAX_COLUMNS
# columns, or up to LANES_MAX_REDUCING_COLUMNS where the depth is at least the rows;
# and only on a B that stays in L2 (LANES_MAX_B_BYTES over the batch): a block of 32 rows
# reads all of B again. MobileNetV2 at batch 32 (its 14x14 and 28x28 1x1 convs one
# product per image) took 1.04-1.05x the time with lanes up to 2 MiB of B (200.6 -> 210.6
# ms, 1 thread, alternating, under load) and 1.017x (1 thread) / 1.024x (2 threads) with
# its 64 -> 384 on 14x14 (1.6 MiB) alone in them. At batch 1 the model went from 5.93 to
# 5.42 ms (0.91x), bitwise the same outputs.
LANES_MAX_COLUMNS = 256
LANES_MAX_REDUCING_COLUMNS = 1024
LANES_MIN_ROWS = 32
LANES_MAX_B_BYTES = 1 << 20
# The lanes tiles' shuffles (A's two row panels joined each depth step, each 16-row
# block of C transposed) issue on Intel's cores on the port that also holds the second
# 512-bit FMA unit (winograd_lanes), so there the lanes tiles pay less. Measured on the
# 2-core Intel Xeon (AVX-512, AMX; KVM), one thread, under load:
# - each product alone, with a bias per row and a clip or a residual, panels / tall /
#   lanes alternating in one process, fastest of 15 rounds of 100 calls, thread CPU time
#   (us): 49 columns (32-column panels compute 64: 1.31x) 960x160 121 / 119 / 108,
#   160x960 + residual 120 / 117 / 96, 320x960 234 / 229 / 189, 1280x320 314 / 322 /
#   264, 160x576 63 / 63 / 53; 100 columns (1.28x) 256x128 39.4 / 38.3 / 37.9; 64 columns
#   (1.0x) 256x128 22.3 / 24.5 / 28.1; 144 columns (1.11x) 256x128 48.4 / 48.9 / 54.3;
#   196 columns (1.14x) 384x64 58.7 / 58.2 / 66.8, 576x96 125 / 129 / 137, 96x576 +
#   residual 129 / 117 / 124, 64x384 + residual 56.0 / 54.6 / 53.2; 784 columns 32x192 +
#   residual 69.4 / 61.0 / 72.2, 32x144 + residual 50.5 / 46.5 / 48.0.
# - inside MobileNetV2 at batch 1 (two models in one process, this rule and lanes as on
#   AMD, alternating, per-node medians of 80 profiled passes of 3 runs, us): the 14x14
#   expansions 64 -> 384 88 -> 78 and 96 -> 576 168 -> 157 (panels), the 28x28
#   projections 192 -> 32 80 -> 70 and 144 -> 32 66 -> 57 (tall tiles); but the 14x14
#   projections 384 -> 64 (+ residual) and 192 -> 64 ran 1.05-1.10x slower in panels or
#   tall tiles than in lanes (deep products: the transposes weigh little there).
# So on vendors outside LANES_VENDORS (Intel's, and any not measured, as winograd_lanes)
# the lanes tiles take a product of the shapes above (_lanes_fit) at a depth of at least
# its rows up to LANES_MAX_COLUMNS columns, and otherwise only where the column panels
# compute at least LANES_PANEL_WASTE times its columns (up to 102 columns with 32-column
# panels: 102 of 128); the rest run in panels, or in tall tiles where tall_tiles takes
# them. Not measured on more cores. A gap: the depth rule was measured inside the model
# on the 64-row projections only; 96 x 576 with the residual on 196 columns takes lanes
# tiles by it, where alone it ran 124 us against tall tiles' 117 (and panels' 129), and
# inside the model lanes and tall tiles were not compared for it.
LANES_VENDORS = frozenset({"AMD"})
LANES_PANEL_WASTE = 1.25
# gemm.c builds its lanes tiles with its AVX-512 8 x 32 tiles only
# (keel_gemm_lanes_built_f32): a build of another tile (6 x 16 with AVX2, 4 x 8 scalar)
# has none, whatever the vendor. Read from gemm.c, not measured.
LANES_GRID = (8, 32)


def lanes_built(grid: Any = _HERE) -> bool:
    """Whether gemm.c builds lanes tiles with the native tile ``grid`` (default: the
    loaded kernel's; None: no native tier)."""
    grid = _grid(grid)
    return grid is not None and tuple(grid) == LANES_GRID


def lanes_tiles(batch: int, m: int, n: int, k: int, vendor: Any = _HERE,
                grid: Any = _HERE) -> bool:
    """Whether ``batch`` native products of ``m`` rows, ``n`` columns and depth ``k`` run
    in lanes tiles (where their operands fit them) on a CPU of ``vendor`` with the native
    tile ``grid`` (defaults: this machine's): never on a grid without them (LANES_GRID)."""
    if not lanes_built(grid) or not _lanes_fit(batch, m, n, k):
        return False
    vendor = _this_vendor() if vendor is _HERE else vendor
    if vendor in LANES_VENDORS:
        return True
    if k >= m and n <= LANES_MAX_COLUMNS:
        return True
    return -(-n // LANES_GRID[1]) * LANES_GRID[1] >= LANES_PANEL_WASTE * n


# The lanes tiles join each 16-lane vector of A from two 8-row panels, an insert every
# depth step for every 16 rows, which on Intel's cores issues on the port of the second
# FMA unit: 26 operations there for a 32 x 12 tile's 24 multiply-adds. Where the direct
# conv's plan runs its products in lanes tiles, its filters are packed in 16-row panels
# only (one load a vector; held once: conv_gemm.layout_filters; decided once, for the
# plan's vendor and tile, by native_a16, and carried as the conv's gemm_a16 option), on
# LANES_A16_VENDORS' cores with gemm.c's 8 x 32 tiles (LANES_GRID); a call they do not
# serve (one that would not run wholly in lanes tiles) reads 8-row panels made from them
# on first need. The same values in the same lanes: the same bits. Splits starting on
# an odd 8-row panel read the 16-row panels' halves.
# Measured on the 2-core Intel Xeon (AVX-512; KVM) under load: MobileNetV2's lanes-tiled
# 1x1 convs alone (one thread, both layouts alternating in one process, medians of 600
# calls, us) 576 -> 96 + residual on 14x14 127.2 -> 119.9, 384 -> 64 + residual 59.9 ->
# 56.3, 384 -> 96 87.1 -> 81.8, 160 -> 960 on 7x7 99.8 -> 93.7, 960 -> 160 + residual
# 89.4 -> 84.3, 960 -> 320 175.8 -> 166.5, 320 -> 1280 259.2 -> 244.4 (0.939-0.947); in
# the model: docs/performance.md ("MobileNetV2's 1 x 1 convs on 14 x 14 and 7 x 7
# alone"). AMD's Zen runs shuffles on units of their own (LANES_VENDORS): unmeasured
# there, so not taken.
LANES_A16_VENDORS = frozenset({"Intel"})


def lanes_a16(grid: Any = _HERE, vendor: Any = _HERE) -> bool:
    """Whether products in lanes tiles read A packed in 16-row panels (instead of its
    8-row ones), with the native tile ``grid`` on a CPU of ``vendor`` (defaults: this
    machine's). gemm.c builds the lanes tiles, and reads 16-row panels, with its 8 x 32
    tiles (AVX-512) only (lanes_built): another grid (6 x 16 with AVX2, 4 x 8 scalar)
    never does."""
    vendor = _this_vendor() if vendor is _HERE else vendor
    return lanes_built(grid) and vendor in LANES_A16_VENDORS


# A product in 8 x 32 tiles whose columns end in a partly filled panel (a 1x1 conv on
# 14x14: 196 = 6 x 32 + 4) computes that panel in whole 16-column vectors, each depth
# step eight broadcasts of A and one load of B for eight multiply-adds: its 4 columns
# cost about half a full panel. With KEEL_LANES_TAIL gemm.c runs that panel alone in
# lanes tiles (32 rows of C by its columns, A's rows in the lanes), the full panels as
# before; the lanes tiles give the panels' bits. Taken where the tail is at most
# LANES_TAIL_MAX_COLUMNS columns (half a 16-lane vector: the masked vector computes at
# least twice the columns there are, derived) and C has the lanes tiles' rows. Measured
# on the 2-core Intel Xeon (AVX-512; KVM) under load, MobileNetV2 at batch 1, its seven
# 14x14 expansions inside the model (each step timed alone, old / new passes
# alternating, medians / fastest, us, summed): one thread 948.6 / 812.7 -> 887.5 /
# 763.0, two threads 944.2 / 590.8 -> 900.4 / 475.9; outputs bitwise the same
# (docs/performance.md, "MobileNetV2's 14 x 14 expansions"). Other vendors' cores were
# not measured (LANES_TAIL_VENDORS), and keep the vector panel. A conv's plan carries the
# tile's and vendor's part (lanes_tails, through native_lanes_tail as gemm_lanes_tail);
# each prepared call adds its own shape's (lanes_tail_fits).
LANES_TAIL_MAX_COLUMNS = 8
LANES_TAIL_VENDORS = frozenset({"Intel"})


def lanes_tail(m: int, n: int, k: int, grid: Any = _HERE, vendor: Any = _HERE) -> bool:
    """Whether a product of ``m`` rows, ``n`` columns and depth ``k`` in column panels
    (not in lanes tiles) runs its partly filled last column panel in lanes tiles, on a
    core of LANES_TAIL_VENDORS (defaults: this machine's). Lanes tiles read a packed A
    and a raw B: a conv's products (the filter packed on the left), whose plan says so;
    a MatMul's or Gemm's A is its activation, read raw, so theirs never take it."""
    return lanes_tails(grid, vendor) and lanes_tail_fits(m, n, k)


def lanes_tails(grid: Any = _HERE, vendor: Any = _HERE) -> bool:
    """Whether products with the native tile ``grid`` on a CPU of ``vendor`` (defaults:
    this machine's) take lanes tails where their shapes do (lanes_tail_fits): the part of
    lanes_tail a conv's plan carries (gemm_lanes_tail), for the machine planned for."""
    vendor = _this_vendor() if vendor is _HERE else vendor
    return lanes_built(grid) and vendor in LANES_TAIL_VENDORS


def lanes_tail_fits(m: int, n: int, k: int) -> bool:
    """Whether a product of ``m`` rows, ``n`` columns and depth ``k`` ends in a panel of
    LANES_GRID's columns that lanes_tail takes (only that grid builds lanes tiles)."""
    return 0 < n % LANES_GRID[1] <= LANES_TAIL_MAX_COLUMNS and m >= LANES_MIN_ROWS and k > 0


def native_lanes_tail(form: str, grid: Any = _HERE, vendor: Any = _HERE
                      ) -> tuple[bool | None, str]:
    """Whether the native conv's products in ``form`` run a partly filled last column
    panel in lanes tiles where their shapes give one (lanes_tails for the tile ``grid``
    and ``vendor`` planned for; defaults: this machine's), and why; None for the forms
    other than the direct one, whose calls never take it (B read through a row table,
    columns through a column map, taps through masks, or the band kernel: lanes tails
    read a raw B only). The plan carries it (gemm_lanes_tail): the prepared calls run it,
    whatever this machine's vendor."""
    if form != "direct":
        return None, ""
    grid = _grid(grid)
    vendor = _this_vendor() if vendor is _HERE else vendor
    if lanes_tails(grid, vendor):
        return True, (f"a product's last column panel of 1 to LANES_TAIL_MAX_COLUMNS "
                      f"({LANES_TAIL_MAX_COLUMNS}) columns in lanes tiles, where it has "
                      f"at least LANES_MIN_ROWS ({LANES_MIN_ROWS}) rows (lanes_tail, "
                      "LANES_TAIL_VENDORS: measured on a 2-core Intel Xeon)")
    if not lanes_built(grid):
        return False, _no_lanes_reason("a product's last column panel", grid)
    return False, ("a product's last column panel in its vector panel: lanes tails were "
                   "measured on Intel's cores only (lanes_tail, LANES_TAIL_VENDORS): "
                   f"{unmeasured_vendor(vendor)}")


def _lanes_fit(batch: int, m: int, n: int, k: int) -> bool:
    """The shapes the lanes tiles were measured to pay on where their shuffles cost
    little (AMD's Zen): the rows, the columns, and B within L2."""
    if m < LANES_MIN_ROWS or 4 * batch * k * n > LANES_MAX_B_BYTES:
        return False
    return n <= LANES_MAX_COLUMNS or (n <= LANES_MAX_REDUCING_COLUMNS and k >= m)


# ---- the depthwise conv's form ---------------------------------------------------------
# The NumPy forms (depthwise.py's module docstring has the measurements, 1 thread,
# MobileNetV2's 3x3 layers): channels_last serves 2-D depthwise convs with at least
# CHANNELS_LAST_MIN_CHANNELS channels and at most CHANNELS_LAST_MAX_PIXELS output pixels
# per plane (4x as many in a batch); batches of stride-1 convs with at least
# PLANES_MIN_PIXELS output pixels per plane run as planes (long unit-stride passes
# stream better than the per-channel gemvs); the rest as rows.
CHANNELS_LAST_MAX_PIXELS = 196
CHANNELS_LAST_MIN_CHANNELS = 192
PLANES_MIN_PIXELS = 3136
# Bytes of buffers per block of images and channels. ``rows`` keeps its shifted copies
# in the L2 cache (inside a model, where other layers evict them, 1 MiB blocks ran
# MobileNetV2's depthwise layers in 7.8 ms against 9.9 ms with 4 MiB); the other forms
# stream, and only need blocks of images that bound their buffers.
DEPTHWISE_BLOCK_BYTES = 1 << 20
DEPTHWISE_STREAM_BYTES = 16 << 20
# The bound native call's scheme: "auto" asks depthwise_scheme (below) for the call's
# planes and threads when it is bound; a node plan names the scheme itself.
DEPTHWISE_SCHEME = "auto"
# The native depthwise call's scheme (window.c; every scheme gives the same bits, so the
# choice may follow anything). "blocked" computes 16 planes at once, one vector lane a
# plane; it measured faster on MobileNetV2's 3x3 layers inside the model (1 thread, bias
# + ReLU6, time of blocked / planes):
#   batch 1:  7x7 s1 0.78-0.80, 14->7 s2 0.87, 14x14 s1 0.94-0.96, 28x28 s1 0.95,
#             28->14 s2 1.05, 56->28 s2 1.06;
#   batch 32: 7x7 s1 0.82-0.90, 28x28 s1 0.81, 14x14 s1 1.07-1.27, 14->7 s2 1.26,
#             28->14 s2 1.17, 56->28 s2 1.19.
# Alone (the same arrays again and again) the batch-32 layers ran 0.72-0.93 but 576 ch
# 14x14 (1.03) and 56->28 s2 (1.09): in the model, at batch, the 16 planes a block reads
# and writes at once wait on memory where the plane path's compute is already tight (its
# 16-wide rows of 14x14 planes waste little). So: unit strides, outputs up to
# DEPTHWISE_BLOCKED_CACHED_PIXELS where a thread's planes stay in cache
# (DEPTHWISE_BLOCKED_CACHED_BYTES of input and output, for the 1 MiB L2), else outputs
# up to DEPTHWISE_BLOCKED_PIXELS and rows of DEPTHWISE_BLOCKED_ROWS columns up to
# DEPTHWISE_BLOCKED_ROWS_PIXELS (the plane path's worst fit below the rows it computes
# straight into Y, window.c's DIRECT_MIN_WIDTH = 32); strided outputs up to
# DEPTHWISE_BLOCKED_PIXELS only in cache.
DEPTHWISE_BLOCKED_CACHED_BYTES = 4 << 19
DEPTHWISE_BLOCKED_CACHED_PIXELS = 784
DEPTHWISE_BLOCKED_PIXELS = 64
DEPTHWISE_BLOCKED_ROWS = (24, 31)
DEPTHWISE_BLOCKED_ROWS_PIXELS = 1024
# "strided" (3x3 stride-2 convs padded by one, read straight from X) for every call it
# serves. Its output rows run eight vectors at a time (several rows together, each input
# row split once for the two output rows it feeds), and rows of at most 8 outputs two to
# a vector. On a 2-core Intel Xeon (AVX-512, 2 MiB L2), one thread, bias + ReLU6, under
# load, alone from C (fastest of 15 x 100-300 calls, us, planes / blocked / strided
# before -> strided): batch 1 96 ch 112 -> 56 - / - / 219 -> 212 (its 4.8 MB input read
# from L3), 144 ch 56 -> 28 - / - / 66-72 -> 52, 192 ch 28 -> 14 - / - / 22 -> 16-17,
# 576 ch 14 -> 7 38-54 / 26-28 / 31 (rows of 7, one a vector) -> 13-15;
# 18432 planes of 14 -> 7 (batch 32, from memory) 1.4 / 1.04 / 1.18 -> 0.67 ms. Inside
# MobileNetV2 at batch 1 (two models in one process, alternating, per-node medians of 30
# passes) the 14 -> 7 layer took 44.7 us blocked and 32.6 strided. (The plane scheme
# before it at 112 -> 56, 56 -> 28, 28 -> 14: 161 -> 115, 69 -> 54, 24 -> 19 us alone on
# the AMD EPYC machine, 10.5-11.4 -> 7.3, 4.0 -> 3.4, 1.5 -> 0.9 ms at batch 32.)
# "flat" (stride 1, output rows as wide as the input's: 16 consecutive output pixels of a
# plane at a time read straight from X, the taps outside X zeroed; no copy, no
# transposes, no lanes lost at row ends) for every stride-1 3x3 undilated conv padded by
# one (FLAT_KERNEL: window.c's specialized path; other kernels and dilations take its
# generic path, `t % kws` in the inner loop, where flat lost (below), and keep the rules
# that follow) but the smallest planes in cache (up to DEPTHWISE_BLOCKED_PIXELS outputs: 7x7),
# where the blocked scheme keeps the lead. Measured on a 2-core Intel Xeon (AVX-512,
# 2 MiB L2), one thread, bias + ReLU6, under load. Inside MobileNetV2 at batch 1 (two
# models in one process, alternating, per-node medians of 30 passes, us, before -> flat):
# 32 ch 112x112 252 -> 232 (planes before), 144 ch 56x56 293 -> 237 (planes), 192 ch
# 28x28 106 -> 76 and 97 -> 72 (blocked), 384 ch 14x14 55 -> 44 (blocked), 576 ch 14x14
# 79 -> 64 (blocked): 0.72-0.92x (docs/performance.md's second run: 0.71-0.87x); the 7x7
# layers alone 26 us blocked against 32 flat. Alone at batch 32 (ms, planes / blocked /
# flat): 112x112 11.2 / - / 9.0, 56x56 12.8 / 10.1 / 10.2, 28x28 4.7 / 3.2 / 3.4, 14x14
# 2.0 / 1.5 / 1.5 and 3.2 / 2.5 / 2.4, 7x7 1.9 / 1.2 / 1.1: 0.58-0.80x the plane scheme,
# level with the blocked one (0.92-1.06x); the whole model at batch 32 with its stride-1
# layers on flat took 0.965-0.992x the time before (docs/performance.md). On the generic
# path flat lost (batch 1, one thread, bias + ReLU6, the schemes alternating from
# Python, 15 rounds of 20 calls, under load, median us planes / blocked / flat): 5x5
# padded by two 144 ch 56x56 796 / 781 / 1183, 192 ch 28x28 158 / 119 / 265, 576 ch
# 14x14 337 / 92 / 354; 3x3 dilated by two 407 / 440 / 446, 60 / 72 / 92, 72 / 52 / 272.
FLAT_KERNEL = ((3, 3), (1, 1), (1, 1))      # kernel, dilations, leading pads


def _flat_measured(geo: native_window.WindowGeometry) -> bool:
    """Whether ``geo`` is the 3x3 undilated conv padded by one that the flat scheme was
    measured on (FLAT_KERNEL)."""
    kh, kw, _, _, dh, dw, pt, pl = (int(v) for v in geo.array[5:13])
    return ((kh, kw), (dh, dw), (pt, pl)) == FLAT_KERNEL


def depthwise_scheme(geo: native_window.WindowGeometry, planes: int, threads: int,
                     sizes: Caches | None = None) -> tuple[str, str]:
    """The native depthwise call's scheme for ``planes`` (N * C) of ``geo`` split over
    ``threads`` (as the call splits them), and why: "flat", "blocked", "strided" or
    "planes"."""
    _, h, w, oh, ow, _, _, sh, sw = (int(v) for v in geo.array[:9])
    share = -(-planes // max(1, geo.parts(planes, threads)))
    out = oh * ow
    limit = (sizes or caches()).with_l2(DEPTHWISE_BLOCKED_CACHED_BYTES)
    cached = 4 * share * (h * w + out) <= limit
    where = (f"{share} plane(s) a thread, {4 * share * (h * w + out) >> 10} KiB of input "
             f"and output {'within' if cached else 'over'} {limit >> 10} KiB")
    smallest = cached and out <= DEPTHWISE_BLOCKED_PIXELS
    if ((sh, sw) == (1, 1) and not smallest and _flat_measured(geo)
            and native_window.scheme_ok(geo, "flat")):
        return "flat", (f"flat: 16 output pixels at a time straight from X, the taps "
                        f"outside it zeroed ({oh}x{ow} outputs, {where}; MobileNetV2's "
                        "3x3 stride-1 layers from 14x14 up ran 0.71-0.92x the time of the "
                        "blocked and plane schemes inside the model at batch 1, and alone "
                        "at batch 32 0.58-0.80x the plane scheme's, level with the blocked "
                        "one's (0.92-1.06x))")
    if (sh, sw) != (1, 1) and native_window.scheme_ok(geo, "strided"):
        rows = "two output rows a vector" if ow <= 8 else "eight vectors at a time"
        return "strided", (f"strided: the 3x3 stride-2 taps read straight from X, {rows} "
                           f"({oh}x{ow} outputs; MobileNetV2's 56->28, 28->14 and 14->7 "
                           "layers ran 0.5-0.8x the time of the schemes before it alone)")
    if (sh, sw) != (1, 1):
        wins = cached and out <= DEPTHWISE_BLOCKED_PIXELS
    elif cached:
        wins = out <= DEPTHWISE_BLOCKED_CACHED_PIXELS
    else:
        low, high = DEPTHWISE_BLOCKED_ROWS
        wins = out <= DEPTHWISE_BLOCKED_PIXELS or (
            low <= ow <= high and out <= DEPTHWISE_BLOCKED_ROWS_PIXELS)
    if wins and native_window.scheme_ok(geo, "blocked"):
        return "blocked", (f"blocked: 16 planes at once, one a vector lane ({oh}x{ow} "
                           f"outputs, {where}; MobileNetV2's small planes ran 0.78-0.96x "
                           "the plane scheme's time)")
    why = "the blocked scheme serves no such geometry here" if wins else where
    return "planes", f"planes: plane by plane ({oh}x{ow} outputs, {why})"


def depthwise_numpy_form(geo: ConvGeometry) -> str:
    """The measured best NumPy formulation of a depthwise conv."""
    win = geo.window
    if win.rank != 2:
        return "planes"
    pixels = math.prod(win.out_spatial)
    many = geo.in_channels >= CHANNELS_LAST_MIN_CHANNELS and geo.out_channels == geo.in_channels
    if many and (pixels <= CHANNELS_LAST_MAX_PIXELS
                 or (geo.batch > 1 and pixels <= 4 * CHANNELS_LAST_MAX_PIXELS)):
        return "channels_last"
    if geo.batch > 1 and pixels >= PLANES_MIN_PIXELS and all(s == 1 for s in win.strides):
        return "planes"
    return "rows"


def depthwise_budget(form: str, sizes: Caches | None = None) -> int:
    """Bytes of buffers per block of the NumPy depthwise ``form`` for the caches of
    ``sizes`` (None: this machine's): ``rows`` keeps its copies in the L2."""
    if form != "rows":
        return DEPTHWISE_STREAM_BYTES
    return (sizes or caches()).with_l2(DEPTHWISE_BLOCK_BYTES)


def depthwise_block(geo: ConvGeometry, form: str, sizes: Caches | None = None
                    ) -> tuple[int, int]:
    """Images and channels per block of a NumPy depthwise form, so that a block's
    buffers stay in cache."""
    plan = window.wide_plan((1, geo.in_channels), geo.window)
    n, c = geo.batch, geo.in_channels
    kw = geo.window.kernel[-1]
    per_channel = plan.plane * plan.phases * (kw + 1 if form == "rows" else 3) * 4
    budget = depthwise_budget(form, sizes)
    channels = max(1, budget // per_channel)
    if channels < c and form != "channels_last":
        return 1, channels
    return max(1, min(n, budget // (per_channel * c))), c


def depthwise_form(geo: ConvGeometry) -> tuple[str, str]:
    """The depthwise form (``native|<numpy form>`` where the compiled kernel serves
    ``geo``: the NumPy form is its fallback), and why."""
    numpy_form = depthwise_numpy_form(geo)
    if depthwise.native_serves(geo):
        return f"native|{numpy_form}", (
            f"native: compiled window kernel, each output computed once in registers "
            f"(MobileNetV2's depthwise layers {DEPTHWISE_NATIVE_SPEEDUP}); NumPy form "
            f"{numpy_form} where native cannot run")
    return numpy_form, (f"{numpy_form}: measured best NumPy form for this shape; not "
                        f"native: {depthwise.native_refusal(geo)}")


def depthwise_layout(geo: ConvGeometry, form: str | None = None,
                     scheme: str = DEPTHWISE_SCHEME) -> depthwise.DepthwiseLayout:
    """``geo``'s depthwise layout in ``form`` (None: the planned one); ``native`` asked
    for alone falls back to the planned NumPy form."""
    planned, reason = depthwise_form(geo)
    if form is None:
        form = planned
    elif form == "native":
        form, reason = f"native|{depthwise_numpy_form(geo)}", "native: asked for"
    else:
        reason = f"{form}: asked for"
    block = depthwise_block(geo, form.rpartition("|")[2])
    return depthwise.depthwise_layout(geo, form, block, reason, scheme)


def native_layout(geo: ConvGeometry) -> conv_gemm.NativeLayout:
    """``geo``'s native conv layout in the planned form."""
    form = native_form(geo)[0]
    lanes, streams = native_tiles(geo, form)
    a16 = native_a16(lanes if form == "direct" else None)[0]   # the direct form's only
    return conv_gemm.native_layout(geo, form, stream_stores(geo), lanes, streams, a16=a16)


# ---- the NumPy im2col and pointwise layouts --------------------------------------------
# Column-matrix bytes per chunk of images (STACKED_BYTES when the images are stacked):
# chunks stay in cache; a single image larger than this runs alone.
IM2COL_BYTES = 4 * 2**20
STACKED_BYTES = 8 * 2**20
# Stack the images of a batch into one GEMM when an image has fewer columns than this.
# Not with batch invariance: the im2col and pointwise GEMMs run on BLAS, whose order of
# summation follows the product's shape, so a product of one shape per image (whatever
# the batch) keeps an image's result the same at every batch size.
STACK_BELOW = 400
_PER_IMAGE_NOTE = " (batch invariance: BLAS sums in an order that follows the shape)"
# Compact columns (the output pixels, no garbage columns) from this many output
# channels, or for outputs at least this wide: there the extra GEMM work of the garbage
# columns costs more than copying the column matrix in short rows. Never where a row
# of the matrix is a multiple of 4 KiB: BLAS's packed panels then collide in cache.
COMPACT_MIN_CHANNELS = 64
COMPACT_MIN_WIDTH = 56
PAGE_BYTES = 4096


@dataclass(frozen=True)
class ConvForm:
    """A conv variant's layout as planned: the form, why, images per chunk and the
    scratch it needs (None: not estimated), and the depthwise call's scheme."""

    layout: str
    reason: str
    chunk: int | None = None
    workspace_bytes: int | None = None
    scheme: str = DEPTHWISE_SCHEME
    stream_stores: bool = False          # the native conv's output bypasses the cache
    block: tuple[int, int] | None = None  # a depthwise NumPy form's (images, channels)
    chunk_reason: str = ""               # why ``chunk`` ("": the layout's reason says)
    scheme_reason: str = ""              # why ``scheme`` ("": not a native depthwise call)
    # Winograd's compiled products in lanes tiles, else in panels (winograd_lanes; None:
    # no compiled products), as the vendor planned for decides: the kernel runs what the
    # plan says, whatever this machine's vendor.
    lanes: bool | None = None
    lanes_reason: str = ""
    # Run pass by pass, the products of a chunk wider than one vector in lanes tiles or
    # not (winograd_pass_lanes, for the chunk's tiles and the vendor planned for).
    pass_lanes: bool | None = None
    pass_lanes_reason: str = ""
    # Compiled, the per-thread pipeline or pass by pass for the caches, threads and vendor
    # planned for (winograd_pipeline, pipeline_option's plain data): the kernel runs it.
    pipeline: tuple[int, ...] | None = None
    pipeline_reason: str = ""
    # The native conv's products in lanes tiles or not (native_tiles; None: the kernel's
    # rule for the shapes it sees) and its gathered taps streamed for its output's sake.
    gemm_lanes: bool | None = None
    output_streams: bool = False
    # Where those products run in lanes tiles, the filters packed in 16-row panels only,
    # and why (native_a16, for the grid and vendor planned for): packed and read so.
    gemm_a16: bool = False
    a16_reason: str = ""
    # A product's partly filled last column panel in lanes tiles where its shape gives
    # one, and why (native_lanes_tail, for the grid and vendor planned for; None: the
    # kernel's rule for this machine, or a form whose calls never take it).
    gemm_tail: bool | None = None
    tail_reason: str = ""
    # Inside a float NCHWc region, whether the residual is read blocked (residual_layout).
    blocked_residual: bool = False


def im2col_form(geo: ConvGeometry, itemsize: int) -> ConvForm:
    """Compact or wide columns, stacked images and images per chunk of an im2col conv."""
    win = geo.window
    pixels = math.prod(win.out_spatial)
    compact = ((geo.out_channels // geo.group >= COMPACT_MIN_CHANNELS
                or win.out_spatial[-1] >= COMPACT_MIN_WIDTH)
               and (pixels * itemsize) % PAGE_BYTES != 0)
    columns = conv_gemm.im2col_columns(geo, compact)
    stacked = geo.batch > 1 and columns < STACK_BELOW and not batch_invariant()
    budget = STACKED_BYTES if stacked else IM2COL_BYTES
    per_image = geo.group * conv_gemm.im2col_depth(geo) * columns * itemsize
    chunk = max(1, min(geo.batch, budget // max(per_image, 1)))
    layout = ("compact" if compact else "wide") + ("-stacked" if stacked else "")
    why = (f"{layout}: {columns} columns per image ({'output pixels' if compact else 'wide'}"
           f"){', stacked below ' + str(STACK_BELOW) if stacked else ''}; {chunk} image(s) "
           f"per chunk within {budget >> 20} MiB of columns")
    return ConvForm(layout, why, chunk,
                    conv_gemm.im2col_scratch(geo, compact, stacked, chunk, itemsize))


def pointwise_form(geo: ConvGeometry) -> ConvForm:
    """Whether a 1x1 conv stacks its images into one GEMM."""
    pixels = math.prod(geo.window.out_spatial)
    if geo.batch > 1 and pixels < STACK_BELOW and not batch_invariant():
        return ConvForm("stacked", f"stacked: {pixels} output pixels < {STACK_BELOW}")
    return ConvForm("per-image", "per-image: X read as it is, one GEMM per image"
                    + _PER_IMAGE_NOTE * (geo.batch > 1 and batch_invariant()))


# Winograd's transformed tiles per chunk of images (bytes; the transformed input V and,
# compiled, the products P of a chunk): bigger batches run in chunks that stay in cache
# (measured with a 32 MiB last-level cache: batch-8 64-channel 56x56 runs 16 ms in 4 MB
# chunks against 22.6 ms in 24 MB ones). Scaled by rule to the plan's last-level cache:
# every pass over a chunk splits over the threads, and a chunk of one image leaves
# threads idle in the transforms on a many-core machine.
WINOGRAD_CHUNK_BYTES = 4 * 2**20


def winograd_form(geo: ConvGeometry, itemsize: int, sizes: Caches | None = None,
                  threads: int = 1, vendor: Any = _HERE, grid: Any = _HERE) -> ConvForm:
    """Images per chunk of a Winograd conv (its one form), for the caches of ``sizes``
    (None: this machine's); compiled, whether it runs as the per-thread pipeline on
    ``threads`` threads (winograd_pipeline) of a CPU of ``vendor``, which takes the whole
    batch at once; its products' tiles for the native tile ``grid`` (winograd_lanes)."""
    (oh, ow), c, m = geo.window.out_spatial, geo.in_channels, geo.out_channels
    th, tw = -(-oh // 2), -(-ow // 2)
    per_image = 16 * th * tw * max(c, m) * itemsize
    sizes = sizes or caches()
    budget = sizes.with_llc(WINOGRAD_CHUNK_BYTES)
    chunk = _winograd_chunk(geo.batch, per_image, sizes)
    scaled = "" if budget == WINOGRAD_CHUNK_BYTES else (
        f" ({WINOGRAD_CHUNK_BYTES >> 20} MiB measured with a 32 MiB last-level cache, "
        f"scaled by rule to the caches of {sizes.source})")
    why = (f"{chunk} image(s) per chunk: {per_image} bytes of transformed tiles an image, "
           f"within {budget / 2**20:.3g} MiB{scaled}")
    scratch = _winograd_scratch(chunk, c, m, th, tw, itemsize)
    if not (itemsize == 4 and native_gemm.available() and geo.rank == 2):
        return ConvForm("", why, chunk, scratch)
    lanes, lanes_why = winograd_lanes(vendor, grid)
    passes, passes_why = winograd_pass_lanes(c, m, chunk * th * tw, vendor, grid)
    pipe = winograd_pipeline(geo.batch, c, m, (oh, ow), max(1, threads), sizes, grid,
                             vendor=vendor)
    if pipe.tiles:          # each thread's block of V and P, in the pool's scratch
        mr = (_grid(_HERE) or _TILES["scalar"])[0]
        ld = -(-pipe.tiles // PIPELINE_VECTOR) * PIPELINE_VECTOR
        scratch = ((pipe.threads or pipe.parts) * 16 * ld * (c + pipe.panels * mr)
                   * itemsize)
    return ConvForm("", why, chunk, scratch, lanes=lanes, lanes_reason=lanes_why,
                    pass_lanes=passes, pass_lanes_reason=(
                        "where run pass by pass (on these threads the pipeline runs), "
                        if pipe.tiles else "run pass by pass, ") + passes_why,
                    pipeline=pipeline_option(pipe, geo.batch, max(1, threads)),
                    pipeline_reason=f"on {max(1, threads)} thread(s) {pipe.reason}")


def pipeline_option(pipe: WinogradPipeline, images: int, threads: int) -> tuple[int, ...]:
    """``pipe``, planned for ``images`` images on ``threads`` threads, as a plan's
    ``winograd_pipeline`` option: plain integers, so that a saved plan keeps it."""
    return (images, threads, pipe.tiles, pipe.panels, pipe.blocks, pipe.parts,
            int(pipe.last_first), pipe.busiest, pipe.threads)


def planned_pipeline(option: tuple[int, ...] | None, images: int,
                     threads: int) -> WinogradPipeline | None:
    """The pipeline a plan's ``winograd_pipeline`` option states for a call of ``images``
    images on ``threads`` threads; None where the plan has none or stated it for another
    batch or thread count (a call the planner did not see)."""
    if option is None or tuple(option[:2]) != (images, threads):
        return None
    tiles, panels, blocks, parts, last_first, busiest, pool = option[2:]
    return WinogradPipeline(tiles, panels, blocks, parts, "as planned (winograd_pipeline)",
                            bool(last_first), busiest, pool)


def _winograd_chunk(images: int, per_image: int, sizes: Caches) -> int:
    """Images per chunk of the Winograd passes: as many as keep their transformed tiles
    (``per_image`` bytes an image) within WINOGRAD_CHUNK_BYTES, scaled to ``sizes``."""
    return max(1, min(images, sizes.with_llc(WINOGRAD_CHUNK_BYTES) // max(per_image, 1)))


# Winograd's compiled transforms (winograd.c) split a chunk's planes over threads while
# each gets MIN_CHUNK_FLOATS of work, counted in the floats a plane's transform touches
# at the kernel's vector width, not in its pixels: a row of tiles is worked in whole
# vectors, and the input transform first copies the plane into a zero-padded buffer of
# even and odd column halves. Measured on the 2-core AMD EPYC (Zen 5, AVX-512), one
# thread, medians of 200 calls: the input transform of 512 7x7 planes (ResNet-18's
# layer4 at batch 1) 165 us, of 64 56x56 planes 242 us, 5.2 and 5.3 such floats a
# nanosecond (per pixel 6.6 ns against 1.2, so counted in pixels the 7x7 planes stayed
# on one thread at batch 1; split in two they took 85 us); the output transform 44 and
# 70 us, 12.5 and 16 floats a nanosecond.
def winograd_plane_floats(out_hw: tuple[int, int], output: bool,
                          grid: Any = _HERE) -> int:
    """The work of one plane of a Winograd transform (``output``: the output transform's,
    else the input's) in the floats it touches at the native kernels' vector width."""
    th, tw = -(-out_hw[0] // 2), -(-out_hw[1] // 2)
    tiles = _grid(grid)
    lanes = max(1, (tiles[1] if tiles else 8) // 2)     # the micro-tile is two vectors wide
    row = -(-tw // lanes) * lanes
    if output:
        return 16 * th * row + out_hw[0] * out_hw[1]
    return (2 * th + 2) * 2 * (row + lanes) + 16 * th * row


def winograd_transform_parts(planes: int, out_hw: tuple[int, int], output: bool,
                             threads: int) -> int:
    """How many chunks a Winograd transform of ``planes`` planes splits into on up to
    ``threads`` threads (see winograd_plane_floats)."""
    per_plane = winograd_plane_floats(out_hw, output)
    return max(1, min(planes, split_threads(LeastWork.FLOATS, threads, planes * per_plane)))


# Winograd's transforms split by tile rows (every channel of each) where a chunk holds
# fewer images than threads, yet tile rows to split evenly (EVEN_SPLIT, below), and a
# thread's share of the chunk's transformed tiles and products fits its L2 (caches()),
# and the products have a column panel for every thread: split by planes, a thread would
# transform some channels of every tile, while its share of the sixteen products (whole
# columns: tiles, panel-major) reads every channel of a few tiles, written by the other
# threads into their caches. By tile rows a thread transforms the tiles its products
# read and writes the outputs of the tiles it multiplied: its data stays in its own L2
# through the three passes (where its share does not fit there, it streams through the
# shared cache either way). Each value is computed alike either way (the same V and Y),
# so the choice may follow the threads. On the 2-core AMD EPYC (1 MiB L2 a core) only
# ResNet-18's 256-channel layers at batch 1 take it, on two threads: their conv time,
# alternating calls under load, 1.01-1.03x the planes split's (within the noise); the
# rule is for many cores, where a thread's share is small (at 16 threads, ResNet-18's
# 64-channel layers at batch 32: 0.4 MiB a thread).
def winograd_by_rows(images: int, channels: int, out_hw: tuple[int, int], threads: int,
                     sizes: Caches | None = None, grid: Any = _HERE, filters: int = 0) -> bool:
    """Whether a Winograd chunk of ``images`` splits its transforms by tile rows;
    ``channels``: its input and output channels together; ``filters``: M x C (where the
    products split product by product, winograd_by_product, by planes)."""
    th, tw = -(-out_hw[0] // 2), -(-out_hw[1] // 2)
    rows = images * th
    if not images < threads <= rows or -(-rows // threads) * threads > EVEN_SPLIT * rows:
        return False                 # whole images, or rows too few to split evenly
    tile = _grid(grid)
    if tile is None or -(-rows * tw // tile[1]) < threads or _filters_outweigh(
            filters, channels, rows * tw):
        return False                 # the products split by product, not by tiles
    share = 16 * rows * tw * channels * 4 // threads
    return share <= (sizes or caches()).l2


def winograd_parts(images: int, channels: int, out_hw: tuple[int, int], output: bool,
                   threads: int, by_rows: bool) -> int:
    """How many chunks a Winograd transform of ``images`` images of ``channels`` planes
    splits into on up to ``threads`` threads: by planes (winograd_transform_parts), or
    ``by_rows`` by tile rows, each ``channels`` planes' worth of work."""
    if not by_rows:
        return winograd_transform_parts(images * channels, out_hw, output, threads)
    th = -(-out_hw[0] // 2)
    rows = images * th
    per_row = channels * winograd_plane_floats(out_hw, output) // th
    return max(1, min(rows, split_threads(LeastWork.FLOATS, threads, rows * per_row)))


def _winograd_scratch(n: int, c: int, m: int, th: int, tw: int, itemsize: int) -> int:
    """Bytes a Winograd chunk of ``n`` images holds (keel.backends.cpu.winograd): compiled,
    the transformed input V and the products P; in NumPy also the split input D, the
    column pass T1, the first output pass O1 and the NHWC image."""
    tiles = n * th * tw
    if itemsize == 4 and native_gemm.available():
        return 16 * tiles * (c + m) * itemsize
    split = n * 4 * (th + 1) * (tw + 1) * c + 8 * n * (th + 1) * tw * c
    return (split + 16 * tiles * (c + m) + 8 * tiles * m + 4 * tiles * m) * itemsize


# ---- Winograd's per-thread pipeline ----------------------------------------------------
# The compiled Winograd conv runs either pass by pass (the input transform of a chunk of
# images over every thread into a shared V, the sixteen products, the output transform)
# or as one per-thread pipeline (winograd.c's keel_winograd_fused_f32): each thread takes
# blocks of consecutive tile rows and runs a block's input transform, its products (a
# block of output channels at a time) and their output transform in its own scratch,
# one dispatch for the whole batch. Both give bitwise the same result (each tile is
# transformed alike, each product element summed alike), so the choice may follow the
# threads and the caches. It is made on the bytes each form moves past the L2:
# - a block's V (16 C floats a tile) is kept within PIPELINE_L2_SHARE of the L2
#   (caches()) and its P (16 floats a tile and output channel of a product block) within
#   PIPELINE_P_SHARE: the tiles a block holds (PIPELINE_VECTOR, below) and the output
#   channels a product block computes (whole GEMM row panels) are the largest that fit,
#   fewer tiles where the blocks would not split evenly over the threads. Measured on
#   the 2-core AMD EPYC (Zen 5, 1 MiB L2), one thread, 64 -> 64 channels on 56x56
#   against the passes: batch 1, blocks of 4 tile rows 0.93x, of 8 0.90x; batch 8,
#   0.83x and 0.80x;
#   128 -> 128 on 28x28 at batch 8: 0.78-0.85x (at batch 1, 1.04x: its 196 tiles in
#   two blocks, as good as one);
# - the transformed filters U (64 M C bytes) stay in a thread's L2 across its blocks
#   when they fit in PIPELINE_L2_SHARE; else every block reads them from the shared
#   cache again (the pipeline then moves blocks x U);
# - the passes move V and P through the shared cache twice (written, then read by the
#   next pass: 2 x 64 (C + M) bytes a tile) and read U once per chunk of images
#   (winograd_form) on each thread whose share of the products' column panels spans it.
# So the pipeline runs where its bytes are at most the passes' (ResNet-18 at batch 1:
# the 64- and 128-channel layers, where U fits or the tiles are many; the 256- and
# 512-channel layers on 14x14 and 7x7 keep the passes, whose few tiles share each read of
# a U of 4 and 16 MiB), and where its blocks split evenly over the threads.
PIPELINE_L2_SHARE = 0.5
PIPELINE_P_SHARE = 0.25
# Where the products run in 8 x 32 panels (winograd_lanes: Intel's cores), a block holds
# at most PIPELINE_PANELS_MAX_TILES tiles, whatever the L2 would allow: on the 2-core
# Intel Xeon (2 MiB L2, KVM), one thread, thread CPU time, 64 -> 64 on 56x56 + ReLU alone,
# blocks of 128 tiles against the 256 the L2 share gives took 0.91x and 0.93x the time
# at batch 1 (medians of 41, alternating call by call, under load) and 0.93x at batch 32
# (9 calls). The lanes tiles (AMD, 1 MiB L2) were measured with blocks of at most 128
# (the L2 share gives no more there from 64 channels up) and keep the L2's limit.
PIPELINE_PANELS_MAX_TILES = 128


@dataclass(frozen=True)
class WinogradPipeline:
    """How a Winograd conv runs: ``tiles`` a block (0: pass by pass; a block is any run of
    consecutive tiles, across tile rows and images), the GEMM row ``panels`` of output
    channels a product block, the ``blocks``, the ``parts`` they split into, and why;
    ``last_first``: chunk ``[lo, hi)`` of the blocks runs blocks ``[blocks - hi,
    blocks - lo)`` (pipeline_order), else ``[lo, hi)``; ``busiest``: the most tiles a
    chunk runs."""

    tiles: int
    panels: int
    blocks: int
    parts: int
    reason: str
    last_first: bool = False
    busiest: int = 0                 # the tiles of the busiest chunk, in the order planned
    threads: int = 0                 # the threads that take the chunks (0: one a chunk)


# The pipeline's blocks are any run of tiles (winograd.c), sized in tiles: where U stays
# in each thread's L2 (more blocks cost no more bytes), whole vectors of PIPELINE_VECTOR
# tiles wherever the tiles and the threads allow, since winograd.c pads a block's columns
# of V to whole vectors of 16 for the products (a block of 56 tiles costs the products of
# 64); where every block reads U again, the fewest blocks that split evenly. Measured
# under load on the 2-core AMD EPYC, one thread (docs/performance.md): 128 -> 128 on
# 28x28 at batch 1, blocks of 64 tiles against the former 4 tile rows (56 tiles),
# 1.005-1.02x; ResNet-18 b1 1.01x, b32 0.99x: no change at one thread; the gain is that
# fewer tile rows than threads no longer rule the pipeline out.
PIPELINE_VECTOR = 16

# The pipeline's chunks a thread (threads.c's keel_parallel_capped): with more than one,
# its blocks split into that many chunks per thread, which the threads claim one at a
# time past their own first (onnxruntime's pool splits its passes so), so that a thread
# descheduled or slowed by other work holds up only a chunk, not its whole share. Every
# block is computed alike on any thread, so the bits are the same for any count
# (tests/native/test_winograd.py). Measured under load on the 2-core AMD EPYC, two
# threads, 1, 2 and 4 chunks a thread alternating in one process (docs/performance.md,
# "More chunks than threads"): medians within 1 % of one chunk a thread for 64 -> 64 on
# 56x56 and 128 -> 128 on 28x28 at batch 1 and 8; unproven, so one it stays.
PIPELINE_CHUNKS_PER_THREAD = 1


def winograd_pipeline(images: int, c: int, m: int, out_hw: tuple[int, int], threads: int,
                      sizes: Caches | None = None, grid: Any = _HERE,
                      per_thread: int | None = None,
                      vendor: Any = _HERE, lanes: bool | None = None) -> WinogradPipeline:
    """Whether a compiled Winograd conv of ``images`` images (C -> M channels, output
    ``out_hw``) runs as the per-thread pipeline on ``threads`` threads, for the caches of
    ``sizes`` and a CPU of ``vendor`` (defaults: this machine's), and its blocks,
    ``per_thread`` chunks of them a thread (default: PIPELINE_CHUNKS_PER_THREAD, read at
    each call so that setting it takes effect): see PIPELINE_L2_SHARE. ``lanes``: the
    products' tiles as a plan's ``winograd_lanes`` option gives them (None: the rule for
    ``vendor``)."""
    chunks = PIPELINE_CHUNKS_PER_THREAD if per_thread is None else per_thread
    products = winograd_lanes(vendor, grid) if lanes is None else (
        lanes, f"products in {'lanes tiles' if lanes else '8 x 32 panels'}, as planned "
        "(winograd_lanes)")
    return _winograd_pipeline(images, c, m, out_hw, threads, sizes or caches(), grid,
                              chunks, products)


@_per_least_flops
def _winograd_pipeline(images: int, c: int, m: int, out_hw: tuple[int, int], threads: int,
                       sizes: Caches, grid: Any, per_thread: int,
                       products: tuple[bool, str]) -> WinogradPipeline:
    mr, nr = _grid(grid) or _TILES["scalar"]
    th, tw = -(-out_hw[0] // 2), -(-out_hw[1] // 2)
    tiles = images * th * tw
    budget = int(sizes.l2 * PIPELINE_L2_SHARE)
    u_bytes = 64 * m * c
    held = u_bytes <= budget
    flops = 32 * m * c * tiles
    most = min(tiles, budget // (64 * c))
    capped = not products[0] and most > PIPELINE_PANELS_MAX_TILES
    if capped:
        most = PIPELINE_PANELS_MAX_TILES
    block = _even_tiles(tiles, most, threads, held,
                        max(1, gemm_threads(threads, flops)))
    if block < 1:
        return WinogradPipeline(0, 0, 0, 0, "pass by pass: " + (
            "no tiles" if tiles < 1 else
            f"a tile of V does not fit {PIPELINE_L2_SHARE:g} of the L2 "
            f"({sizes.l2 >> 10} KiB)" if most < 1 else
            f"{tiles} tile(s) for {threads} threads" if tiles < threads else
            f"no block of at most {most} of its {tiles} tiles splits evenly over "
            f"{threads} threads (EVEN_SPLIT)"))
    cols = -(-block // PIPELINE_VECTOR) * PIPELINE_VECTOR
    all_panels = -(-m // mr)
    fit = max(1, min(all_panels, int(sizes.l2 * PIPELINE_P_SHARE) // (64 * cols * mr)))
    panels = -(-all_panels // -(-all_panels // fit))     # as even as whole panels allow
    blocks = -(-tiles // block)
    parts = max(1, min(blocks, gemm_threads(threads, flops)))
    moved = (min(parts, blocks) if held else blocks) * u_bytes
    chunk = _winograd_chunk(images, 16 * th * tw * max(c, m) * 4, sizes)
    chunks = -(-images // chunk)
    by_product = winograd_by_product(c, m, chunk * th * tw, threads)
    spans = 1 if by_product else min(threads, max(1, -(-chunk * th * tw // nr)))
    passes = chunks * spans * u_bytes + 2 * 64 * (c + m) * tiles
    what = (f"{blocks} block(s) of {block} tiles ({_vectors(block, tiles)}) in {parts} "
            f"piece(s), products {min(m, panels * mr)} output channel(s) at a time "
            f"({products[1]}"
            + (f"; blocks of at most {PIPELINE_PANELS_MAX_TILES} tiles in panels "
               "(PIPELINE_PANELS_MAX_TILES)" if capped else "") + "), V "
            f"within {PIPELINE_L2_SHARE:g} and P {PIPELINE_P_SHARE:g} of the L2 "
            f"({sizes.l2 >> 10} KiB, {sizes.source})")
    bytes_why = (f"{moved >> 10} KiB past the L2 (U {u_bytes >> 10} KiB "
                 f"{'held in each thread' if held else 'read again by every block'}) "
                 f"against the passes' {passes >> 10} KiB (V and P through the shared cache, "
                 + (f"U read once a chunk of {chunk} image(s), the products split product "
                    "by product)" if by_product else
                    f"U read by {spans} thread(s) a chunk of {chunk} image(s))"))
    if moved > passes:
        return WinogradPipeline(0, 0, 0, 0, f"pass by pass: the per-thread pipeline "
                                f"({what}) would move {bytes_why}")
    chunks = min(blocks, parts * max(1, per_thread))
    last_first, order = pipeline_order(tiles, block, chunks)
    claimed = "" if chunks == parts else (
        f"; the blocks in {chunks} chunks, {-(-chunks // parts)} a thread at most, claimed "
        f"one at a time past each thread's first (PIPELINE_CHUNKS_PER_THREAD {per_thread})")
    busiest = _busiest(tiles, block, chunks, last_first) * -(-chunks // parts)
    return WinogradPipeline(block, panels, blocks, chunks,
                            f"per-thread pipeline: {what}{claimed}; {order}; it moves "
                            f"{bytes_why}", last_first, min(tiles, busiest), parts)


# The pipeline's blocks over its chunks. keel's split (threads.c, keel.native.pool.chunks)
# gives the first chunks one block more, and the last block is the one that may be
# partial: taken in order, the partial block lands in a short chunk and a long chunk of
# whole blocks sets the pace; from the last (chunk [lo, hi) runs blocks [B - hi, B - lo))
# it lands in the first, long chunk. The order that leaves the busiest thread the fewest
# tiles wins, counted here; on a tie the blocks go from the last, as every pipeline's do,
# so that consecutive convs of one shape (ResNet's stages) give each thread the same tiles
# and it finds the previous conv's outputs in its own cache. ResNet-18's 64-channel convs
# at batch 1 on two threads (784 tiles in 7 blocks of 128, the last 16): in order 512 and
# 272 tiles, the conv 512 / 392 = 1.31x an even share (the 1.5x, not 2x, its per-node
# profile showed from the second thread); from the last 400 and 384. Each block is
# computed alike wherever it runs: the same bits either way (tests/native/test_winograd.py).
def pipeline_order(tiles: int, block: int, parts: int) -> tuple[bool, str]:
    """Whether the pipeline's ``parts`` chunks of blocks of ``block`` of ``tiles`` tiles
    take the blocks from the last, and why (the busiest chunk's tiles either way)."""
    in_order, from_last = (_busiest(tiles, block, parts, last) for last in (False, True))
    if in_order < from_last:
        return False, (f"blocks in order (the busiest thread {in_order} tiles, "
                       f"{from_last} from the last)")
    return True, (f"blocks from the last (the busiest thread {from_last} tiles, "
                  f"{in_order} in order)")


def _busiest(tiles: int, block: int, parts: int, last_first: bool,
             padded: int = 0) -> int:
    """The most tiles one of keel's ``parts`` chunks (keel.native.pool.chunks) of the
    blocks of ``block`` of ``tiles`` tiles runs, the blocks in order or from the last;
    with ``padded``, the columns it computes, a whole block counting ``padded`` and the
    last its tiles padded to whole vectors."""
    blocks = -(-tiles // block)
    full = padded or block
    last = tiles - (blocks - 1) * block
    if padded:
        last = -(-last // PIPELINE_VECTOR) * PIPELINE_VECTOR

    def run(a: int, b: int) -> int:                   # the tiles of blocks [a, b)
        return (b - a) * full - (full - last if b == blocks and b > a else 0)

    return max((run(blocks - hi, blocks - lo) if last_first else run(lo, hi))
               for lo, hi in _chunks(blocks, parts))


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """keel's split of ``n`` items into ``parts`` chunks (keel.native.pool.chunks)."""
    from keel.native import pool

    return pool.chunks(n, parts)


# The passes' sixteen products split over the threads either by column panels across the
# sixteen (panel-major: a thread's share is the same tiles of every product, those it
# transformed, so every thread reads the whole of U) or product by product (the GEMM's
# tile grid, gemm_split: a thread's share is whole products, 1/threads of U, while V and
# P cross between the threads' caches). Product by product where U (64 M C bytes)
# outweighs the chunk's V and P (64 (C + M) bytes a tile): ResNet-18's 256-channel convs
# on 14 x 14 at batch 1 (U 4 MiB against 1.6 MB), where on two threads the column panels
# had each thread stream all 4 MiB of U from the shared cache (the conv gained 1.3-1.45x
# from the second thread, onnxruntime's 1.9x). The 256 -> 256 conv + ReLU alone on 14 x 14
# at batch 1, two threads, the forms alternating in one process, measured under load:
# fastest of 120 calls 357 us product by product against 445 by column panels and 454 as
# the per-thread pipeline (its two blocks each read U too); medians 642, 742 and 929 us;
# again, the plan with the rule against the plan without it (the pipeline), 160 calls
# each: fastest 424 against 520 us, medians 677 against 902. ResNet-18's 512-channel convs
# at batch 32 (chunks of 8 images, 128 tiles: U 16 MiB against 8 MiB): fastest of 80
# 31.7 against 32.7 ms, medians 54 against 63; at batch 1 their 16 tiles were one column
# panel, split product by product already. One thread runs every product on itself
# either way (the rule asks for two threads).
# Each element of P is summed alike in any tile: the same bits.
def winograd_by_product(c: int, m: int, tiles: int, threads: int) -> bool:
    """Whether the passes' sixteen products of ``tiles`` tiles (C -> M channels) split
    product by product on ``threads`` threads rather than by column panels across them."""
    return threads > 1 and _filters_outweigh(m * c, c + m, tiles)


def _filters_outweigh(filters: int, channels: int, tiles: int) -> bool:
    """Whether U (``filters`` = M x C) outweighs V and P of ``tiles`` tiles (``channels``
    = C + M): winograd_by_product."""
    return filters > channels * tiles


# Winograd's sixteen products of at most one vector of tiles (a 7 x 7 map at batch 1: 16
# tiles, M and C of 512) run in gemm.c's tall tiles (24 rows of C over the one vector,
# every lane used) instead of 8 x 32 tiles whose second vector is empty; the sums are the
# same. The 512-channel 3x3 conv on 7x7 at batch 1 alone, one thread, measured under
# load: docs/performance.md, "Winograd's products of one vector of tiles". On 49 tiles
# (256 channels on 14x14: three whole vectors and one lane) tall tiles gained nothing.
WINOGRAD_TALL_COLUMNS = 16


# The pipeline's products (and the passes' products of one vector of tiles) run in gemm.c's
# lanes tiles (C's rows in the vector lanes, only the real columns computed) or in its 8 x
# 32 panels (tall tiles for one vector: winograd_tall); the sums are the same either way
# (tests/native/test_winograd.py), so the faster one for the CPU's vendor runs. The lanes
# tiles join A's two row panels and transpose each 16-row block of C in registers: vector
# shuffles, which on Intel's cores issue on the port that also holds the second 512-bit
# FMA unit, and on AMD's Zen on shuffle units of their own. The pipeline prepares one
# call for all its blocks, so this rule, not lanes_tiles on a stand-in shape, decides
# (the passes' wider products follow winograd_pass_lanes, on a chunk's real tiles).
# Measured:
# - AMD (2-core Zen 5, one thread, quiet), ResNet-18, keel / onnxruntime in two
#   alternating runs, lanes against panels and tall tiles: batch 1 1.08-1.10 against
#   1.12-1.14, batch 32 1.08-1.13 against 1.11-1.15.
# - Intel (2-core Xeon with AVX-512 and AMX, KVM), each 3x3 conv + ReLU of ResNet-18
#   alone, both forms alternating in one process, under load: panels took 0.84x the
#   lanes' median time on 64 channels on 56 x 56 at batch 32 (0.71x on two threads),
#   0.87x on 128 on 28 x 28, 0.92x on 256 on 14 x 14, 1.03x (fastest 0.93x) on 512 on
#   7 x 7; at batch 1 0.84-0.88x (0.35x for 512 on 7 x 7, fastest 0.91x).
# Other vendors take the panels, the form that needs no shuffles, and their reason says
# it was not measured there (unmeasured_vendor; Hygon's Zen designs included). Not
# measured on more cores.
WINOGRAD_LANES_VENDORS = frozenset({"AMD"})


def winograd_lanes(vendor: Any = _HERE, grid: Any = _HERE) -> tuple[bool, str]:
    """Whether Winograd's products run in gemm.c's lanes tiles on a CPU of ``vendor``
    with the native tile ``grid`` (defaults: this machine's; cpu_vendor gives a
    profile's), and why: never on a grid without them (lanes_built)."""
    vendor = _this_vendor() if vendor is _HERE else vendor
    if not lanes_built(grid):
        return False, _no_lanes_reason("products", grid)
    if vendor in WINOGRAD_LANES_VENDORS:
        return True, (f"products in lanes tiles: measured faster than 8 x 32 panels on "
                      f"{vendor}'s cores (WINOGRAD_LANES_VENDORS)")
    if vendor == "Intel":
        return False, ("products in 8 x 32 panels: the lanes tiles' shuffles share a port "
                       "with the FMA units on Intel's cores (measured: 0.84-0.92x the lanes "
                       "tiles' time)")
    return False, (f"products in 8 x 32 panels, the form that needs no shuffles: "
                   f"{unmeasured_vendor(vendor)} (on Intel's the panels took 0.84-0.92x "
                   "the lanes tiles' time)")


# The passes' products (a Winograd conv run pass by pass, not as the pipeline) are
# prepared on a chunk's real tiles, so their tiles are decided on those columns: a chunk
# of at most one vector of tiles runs in tall tiles, lanes or not as winograd_lanes says;
# a wider one in lanes tiles or 8 x 32 panels as this rule says, for the vendor planned
# for. Measured on the 2-core Intel Xeon (AVX-512, AMX; KVM), the sixteen products of
# one chunk alone (C = M channels, T tiles), panels and lanes alternating in one process,
# 31-41 rounds, wall-time medians under load, panels' time / lanes':
# where 32-column panels compute 1.31x the tiles or more, lanes won: 256 x 49 1.12 (one
# and two threads), 128 x 49 1.07, 64 x 49 1.10, 512 x 49 1.09, 64 x 36 (1.78x) 1.25;
# at 1.28-1.31x they tied: 256 x 98 1.00 (1.01 on two threads), 128 x 100 1.02, 32 x 100
# 0.97; where the panels waste little, panels won: 128 x 196 (1.14x) 1.00, 128 x 64 0.81,
# 64 x 128 0.79 (two threads 0.79), 32 x 64 0.81, 16 x 256 0.64. Before, the kernel left
# the choice to lanes_tiles for this machine's vendor, which took the lanes tiles for
# 64 x 128 and 32 x 64 (its depth clause, measured on 1x1 convs) and left 512 x 49 in
# panels (its B over LANES_MAX_B_BYTES). So outside WINOGRAD_LANES_VENDORS the passes'
# products take the lanes tiles where the panels compute at least LANES_PANEL_WASTE times
# the chunk's tiles; on AMD's cores, not re-measured for the passes, they keep what ran
# there before: lanes tiles wherever lanes_tiles' shapes fit them (_lanes_fit).
# LANES_PANEL_WASTE (1.25x) is lanes_tiles' value, reused, not measured for the passes:
# here lanes won on 49 tiles (1.31x) and 36 (1.78x), tied on 100 tiles (1.28x) and 98
# (1.31x, as 49), and panels won or tied from 1.14x down. No chunk between
# 1.14x and 1.28x was measured, so any value there decides the measured shapes alike;
# a chunk wasting 1.25-1.28x takes lanes tiles where its measured neighbours tie.
def winograd_pass_lanes(c: int, m: int, tiles: int, vendor: Any = _HERE,
                        grid: Any = _HERE) -> tuple[bool, str]:
    """Whether the sixteen products of a Winograd chunk of ``tiles`` tiles (C -> M
    channels), run pass by pass, take gemm.c's lanes tiles on a CPU of ``vendor`` with the
    native tile ``grid`` (defaults: this machine's), and why."""
    if not lanes_built(grid):
        return False, _no_lanes_reason(f"passes' products of {tiles} tile(s) a chunk", grid)
    if winograd_tall(tiles):
        lanes = winograd_lanes(vendor, grid)[0]
        return lanes, (f"passes' products of {tiles} tile(s) in tall tiles"
                       f"{', lanes' if lanes else ', not lanes'} as winograd_lanes says")
    vendor = _this_vendor() if vendor is _HERE else vendor
    shape = f"passes' products of {tiles} tiles a chunk"
    if vendor in WINOGRAD_LANES_VENDORS:
        fit = _lanes_fit(16, m, tiles, c)
        return fit, (f"{shape} {'in lanes tiles' if fit else 'in 8 x 32 panels'}: on "
                     f"{vendor}'s cores wherever the lanes tiles' shapes fit them "
                     "(_lanes_fit; not re-measured for the passes)")
    width = (_grid(grid) or _TILES["scalar"])[1]
    computed = -(-tiles // width) * width
    lanes = computed >= LANES_PANEL_WASTE * tiles
    return lanes, (f"{shape} {'in lanes tiles' if lanes else 'in 8 x 32 panels'}: "
                   f"{width}-column panels compute {computed / tiles:.2f}x them "
                   f"({'at least' if lanes else 'under'} LANES_PANEL_WASTE, "
                   f"{LANES_PANEL_WASTE}x, lanes_tiles' bound, not re-measured for the "
                   "passes; measured on a 2-core Intel Xeon: the lanes tiles "
                   "1.07-1.25x faster on 36 and 49 tiles, tied on 98-100, panels 1.2-1.5x "
                   "faster without waste)"
                   + ("" if vendor == "Intel" else f"; {unmeasured_vendor(vendor)}"))


def _no_lanes_reason(what: str, grid: Any) -> str:
    """Why ``what`` runs in panels on a native tile ``grid`` without lanes tiles."""
    grid = _grid(grid)
    tile = "no native tier" if grid is None else f"these are {grid[0]} x {grid[1]}"
    return (f"{what} in panels: gemm.c builds lanes tiles with its {LANES_GRID[0]} x "
            f"{LANES_GRID[1]} tiles only (LANES_GRID), {tile}")


def unmeasured_vendor(vendor: str | None) -> str:
    """Says that the vendor rules' forms were not measured on ``vendor``'s cores (they
    were on Intel's and AMD's): Hygon's derive from AMD's first Zen, not the Zen 4 and 5
    cores measured, so they take the same default as any other vendor."""
    zen = (" (derived from AMD's first Zen, not the Zen 4 and 5 measured)"
           if vendor == "Hygon" else "")
    return f"not measured on {vendor or 'an unknown vendor'}'s cores{zen}"


def cpu_vendor(profile: Any = None) -> str | None:
    """The CPU vendor plans assume: ``profile``'s (None: this machine's)."""
    if profile is None:
        return _this_vendor()
    vendor = getattr(profile.cpu, "vendor", None)
    return vendor if isinstance(vendor, str) else None


@functools.cache
def _this_vendor() -> str | None:
    from keel.backends.cpu.backend import CpuBackend

    return CpuBackend().vendor


def winograd_tall(columns: int) -> bool:
    """Whether Winograd's products of ``columns`` columns (tiles) run in tall tiles."""
    return columns <= WINOGRAD_TALL_COLUMNS


def _vectors(block: int, tiles: int) -> str:
    """How a block of ``block`` of ``tiles`` tiles fills the products' vectors."""
    if block % PIPELINE_VECTOR == 0:
        last = tiles % block
        return (f"{block // PIPELINE_VECTOR} whole vector(s) of {PIPELINE_VECTOR}"
                + (f", the last block {last}" if last else ""))
    return f"padded to {-(-block // PIPELINE_VECTOR) * PIPELINE_VECTOR}"


# The pipeline's block on more than one thread: of the block sizes whose blocks split
# evenly over the threads counted in tiles (the busiest chunk's tiles within EVEN_SPLIT of
# an even share, in the better order: pipeline_order), the one whose busiest chunk costs
# least, counted in product columns: each block's tiles padded to whole vectors of
# PIPELINE_VECTOR (winograd.c computes the padded columns), plus, where U does not stay
# in each thread's L2, PIPELINE_U_COLUMNS for each block (each reads U again); on a tie
# the larger block. PIPELINE_U_COLUMNS estimates what reading U (64 M C bytes) costs
# against a column of products (32 M C flops): 2 x the flop rate over the shared cache's
# bandwidth, about 150 GFLOP/s against 40 GB/s a core, so 8 columns whatever the
# channels. 128 -> 128 on 28 x 28 at batch 1 (196 tiles, U 1 MiB not held) on two
# threads: blocks of 64 (the busiest thread 128 tiles, the other 68: 1.31x an even
# share) become blocks of 48 (100 and 96 tiles); blocks of 49 (98 and 98, each padded
# to 64 columns) cost more. Measured under load on the 2-core AMD EPYC (Zen 5), the conv
# alone alternating in one process, fastest of 25 rounds of 200 calls against blocks of
# 64: 48 0.975-0.98x, 49 1.06-1.11x (docs/performance.md, "Uneven pipelines").
PIPELINE_U_COLUMNS = 8


def _even_tiles(tiles: int, most: int, threads: int, vectors: bool, parts: int) -> int:
    """The tiles a block (at most ``most``; ``vectors``: U stays in each thread's L2) on
    ``threads`` threads, the kernel running ``parts`` chunks of blocks (the cap of the
    work on ``threads``): on one thread the whole ``tiles`` where it fits, else whole
    vectors of PIPELINE_VECTOR tiles where U stays (more blocks cost no more bytes),
    else ``most``; on more, where U stays the largest whole vectors that split evenly
    in tiles, else the evenly split block that costs the busiest chunk least
    (PIPELINE_U_COLUMNS); 0 if none splits evenly."""
    if threads <= 1:
        whole = most // PIPELINE_VECTOR * PIPELINE_VECTOR
        return tiles if most >= tiles else whole if vectors and whole else most
    def even(t: int) -> bool:
        return -(-tiles // t) >= threads and min(
            _busiest(tiles, t, parts, last) for last in (False, True)) * parts <= (
                EVEN_SPLIT * tiles)

    if vectors:
        for t in range(most // PIPELINE_VECTOR * PIPELINE_VECTOR, 0, -PIPELINE_VECTOR):
            if even(t):
                return t
    best, cost = 0, 0
    for t in range(min(most, tiles), 0, -1):
        if not even(t):
            continue
        last = min((False, True), key=lambda order: _busiest(tiles, t, parts, order))
        ran = max(hi - lo for lo, hi in _chunks(-(-tiles // t), parts))
        columns = _busiest(tiles, t, parts, last, -(-t // PIPELINE_VECTOR) * PIPELINE_VECTOR)
        here = columns + (0 if vectors else PIPELINE_U_COLUMNS * ran)
        if not best or here < cost:
            best, cost = t, here
    return best


# ---- the masked conv's order over column panels --------------------------------------------
# gemm.c's masked (KEEL_DIRECT) conv runs column panel by column panel, each over every row
# panel of A (the packed filters) for the whole depth: where A is larger than the L2, it is
# read from the shared cache (or memory) once per column panel. Grouped, each row panel
# runs over a group of column panels before the next, A read once per group, while the
# group's B (depth x panel columns) and one row panel of A stay in the L2. A group is taken
# where A exceeds MASKED_GROUP_A_SHARE of the L2 and at least two column panels fit:
# ResNet-18's 256 -> 512 3x3 stride-2 conv (A 4.5 MiB, two panels of B at 288 KiB each)
# and its 128 -> 256 one (A 1.1 MiB, seven panels of 144 KiB: groups of four and three),
# measured under load on the 2-core AMD EPYC (Zen 5): docs/performance.md, "The masked
# conv by groups of column panels". The same sums in the same order either way. The
# kernel takes a group of any size (it keeps no state per group); groups above
# MASKED_GROUP_MAX panels were not measured, so none is planned.
MASKED_GROUP_A_SHARE = 0.5
MASKED_GROUP_MAX = 8


def masked_panel_group(rows: int, depth: int, columns: int, panel: int, tile_rows: int,
                       sizes: Caches | None = None) -> int:
    """Column panels per group of a masked conv's product (``rows`` x ``depth`` filters
    against ``columns`` output pixels an image in panels of ``panel`` columns, row panels
    of ``tile_rows``): 1 runs it column panel by column panel."""
    l2 = (sizes or caches()).l2
    if rows * depth * 4 <= MASKED_GROUP_A_SHARE * l2:
        return 1
    panels = -(-columns // panel)
    fit = (l2 - tile_rows * depth * 4) // max(1, depth * panel * 4)
    most = min(panels, fit, MASKED_GROUP_MAX)
    if most < 2:
        return 1
    return -(-panels // -(-panels // most))      # even groups: 7 panels by 4 + 3, not 6 + 1


# ---- the masked conv in lanes tiles ------------------------------------------------------
# gemm.c runs a masked conv's product with C's rows in the vector lanes (AVX-512 builds with
# 8-row panels) when the prepared call carries KEEL_LANES: an image's B is first read
# through the masks into the workspace (native_gemm.prepare asks only where it fits), then
# the lanes tiles compute only the pixels there are. Bitwise the masked tiles' C, so the
# choice may follow the shape and the batch. Measured on the 2-core AMD EPYC (Zen 5), one
# thread, the conv alone with a clip, thread CPU time, tiles and lanes alternating in one
# process, medians of 31 calls (7 at batch 32), the caches flushed between calls / not,
# under load (us): on 7x7 (49 pixels, 64 computed) 256 -> 512 3x3 stride 2 1000 -> 665 /
# 935 -> 598, at batch 32 0.71x / 0.70x; 256 -> 512 1x1 stride 2 180 -> 121 / 75 -> 60,
# batch 32 0.87x / 0.83x; on 14x14 (196 pixels, 224 computed) 128 -> 256 3x3 stride 2
# 0.90x / 0.91x (batch 32 0.88x / 0.89x), but 128 -> 256 1x1 stride 2 (depth 128 below
# the 256 rows: the copy and the transposes weigh more) 1.30x / 0.98x (batch 32 1.15x /
# 1.14x). Where the panels compute no extra pixel they lose: ResNet-20's 16 -> 32 3x3
# stride 2 on 16x16 1.17x, 32 -> 32 on 16x16 1.18x, 64 -> 64 on 8x8 1.10x (batch 1, hot).
# So: where _lanes_fit takes one image's product (lanes_tiles' shapes, vendor aside: the
# masked form's own waste rule below decides) and the column panels compute at least
# MASKED_LANES_WASTE times the pixels, or more than them at a depth of at least the rows.
MASKED_LANES_WASTE = 1.25


def masked_lanes(m: int, n: int, k: int, grid: Any = _HERE) -> bool:
    """Whether a masked conv's product of ``m`` rows, ``n`` output pixels an image and
    depth ``k`` runs in lanes tiles (``grid`` the native tile: its column panels; never
    on a grid without them, lanes_built); the taps' copy (k x n floats) must fit the
    call's workspace where the tier says its size."""
    grid = _grid(grid)
    work = native_gemm.workspace_floats()
    if not lanes_built(grid) or n <= 0 or (work and k * n > work) or (
            not _lanes_fit(1, m, n, k)):
        return False
    computed = -(-n // grid[1]) * grid[1] / n
    return computed >= MASKED_LANES_WASTE or (computed > 1 and k >= m)


# ---- the float MaxPool's kernel -----------------------------------------------------------
# window.c's row kernel (keel_maxpool_rows_f32) takes a max pool with a stride of 2 across
# and no dilation: each output row's max over its input rows column by column, read in
# place, then over each window's columns from that one row (even lanes by a permute),
# where the band kernel first copies every band of rows into its column phases.
# ResNet-18's 3x3 stride-2 pool (64 x 112 x 112 at batch 1) measured under load on the
# 2-core AMD EPYC (Zen 5): see docs/performance.md, "The float MaxPool by rows".
MAX_POOL_ROWS_STRIDE = 2


def max_pool_by_rows(kernel: tuple[int, ...], strides: tuple[int, ...],
                     dilations: tuple[int, ...]) -> bool:
    """Whether a 2-D float max pool runs on window.c's row kernel (which serves up to
    three taps across)."""
    return (len(kernel) == 2 and kernel[1] <= 3 and strides[1] == MAX_POOL_ROWS_STRIDE
            and dilations == (1, 1))


# ---- a conv's split over threads ---------------------------------------------------------
# What each conv kernel's parallel passes split into on ``threads`` threads, as the kernels
# compute it (the least work per thread above, the planned form and chunk): the pass split
# least is the node's split. explain() gives it with the threads, and the 16-thread audit
# (benchmarks/threads_audit.py) checks that every conv with work for every thread keeps
# them evenly busy: the busiest thread's work within EVEN_SPLIT of an even share (whole
# units: 25 panels over 16 threads are chunks of 1 and 2, 1.28; 15 equal tiles over 16
# threads leave one idle, 1.07).
EVEN_SPLIT = 1.25


@dataclass(frozen=True)
class Split:
    """One parallel pass of a node: ``units`` work items (planes, panels, bands) of
    ``work`` kernel work in all, in ``pieces`` contiguous chunks; ``least`` the kernel
    family's least work per thread; ``product``: the pass is a native GEMM product,
    split as native_gemm.Call splits it."""

    name: str
    units: int
    pieces: int
    work: int
    least: int
    product: bool = False            # a native GEMM's product (its split is the GEMM's)
    largest: int = 0                 # the largest piece's units (0: as keel's chunks split)
    unit: str = "unit(s)"            # what the units are

    @property
    def most(self) -> int:
        """The units of the largest piece: ``largest``, else keel's even chunks'."""
        return self.largest or -(-self.units // self.pieces)

    @property
    def balance(self) -> float:
        """The largest chunk over the mean (1.0: every chunk the same)."""
        return self.most * self.pieces / self.units if self.units else 1.0

    def spread(self, threads: int) -> float:
        """The busiest of ``threads`` threads' work over an even share (1.0: all alike)."""
        return self.most * threads / self.units if self.units else 1.0

    def worth(self, threads: int) -> bool:
        """Whether the pass has the least work per thread for each of ``threads``."""
        return self.work >= threads * self.least

    def describe(self) -> str:
        return (f"{self.name} {self.units} {self.unit} in {self.pieces} piece(s), the largest "
                f"{self.balance:.2f}x the mean")


def chunk_split(name: str, units: int, threads: int, work: int, kind: LeastWork,
                unit: str = "unit(s)") -> Split:
    """A pass of ``units`` items and ``work`` work split as keel.native.pool.parts does,
    each chunk at least the least work of ``kind`` of a split that wide (split_parts)."""
    pieces = max(1, split_parts(kind, threads, units, work // max(1, units)))
    return Split(name, units, pieces, work, least_work(kind, threads), unit=unit)


def phase_copy_split(planes: int, rows: int, cols: int, threads: int) -> tuple[int, int]:
    """(bands, pieces) of a native conv's phase copy of ``planes`` planes of ``rows`` x
    ``cols`` floats on up to ``threads`` threads (window.c's keel_phase_copy_mt_f32):
    whole planes where they alone keep the pieces within EVEN_SPLIT of an even share,
    else each plane cut into the fewest bands of rows that do (a batch-1 stem's 3
    planes on 16 threads: 16 bands a plane, 48 units), so a few planes never leave
    threads idle. The pieces: as many as the copy's floats give the least work each
    (split_parts), whatever the bands."""
    if planes < 1 or rows < 1:
        return 1, 1
    plane = max(1, rows * cols)
    pieces = max(1, split_parts(LeastWork.FLOATS, threads, planes * rows, cols))
    for bands in range(1, rows + 1):
        units = planes * bands
        if units >= pieces and -(-units // pieces) * pieces <= EVEN_SPLIT * units:
            break
    units = planes * bands
    return bands, max(1, split_parts(LeastWork.FLOATS, threads, units, plane // bands))


def gemm_pass(name: str, batch: int, m: int, n: int, k: int, threads: int,
              grid: Any = _HERE, panel_major: bool = False, sizes: Caches | None = None,
              raw: tuple[bool, bool] = (True, False), lanes: bool = False) -> Split:
    """The split of a native product (native_gemm.Call.run): ``gemm_split``'s tile grid
    for the caches of ``sizes`` (None: this machine's), the units its tiles; or, for
    ``panel_major`` products (Winograd's), whole column panels across the batch. At
    least MIN_FLOPS_PER_THREAD flops a thread either way. ``lanes``: the product runs
    in lanes tiles (a packed A, a plain raw B and lanes_tiles)."""
    tiles = _grid(grid) or _TILES["scalar"]
    flops = 2 * batch * m * n * k
    if panel_major:
        wanted = max(1, gemm_threads(threads, flops))
        units = batch * -(-n // tiles[1])
        return Split(f"{name} (column panels)", units, max(1, min(wanted, units)), flops,
                     least_work(LeastWork.FLOPS, wanted), product=True)
    split = gemm_split(batch, m, n, k, threads, tiles, sizes, raw, lanes)
    return Split(f"{name} ({split.rows}x{split.cols} tiles a product)", split.pieces,
                 split.parts, flops, least_work(LeastWork.FLOPS, split.parts), product=True)


def conv_splits(variant: str, layout: str, chunk: int | None, geo: ConvGeometry,
                threads: int, grid: Any = _HERE, sizes: Caches | None = None,
                vendor: Any = _HERE) -> tuple[Split, ...]:
    """The parallel passes of conv ``variant`` (planned ``layout`` and ``chunk``) on
    ``threads`` threads, for the caches of ``sizes`` and a CPU of ``vendor`` (defaults:
    this machine's); () for a variant that runs on BLAS or NumPy (their threads are the
    program's BLAS threads, or one)."""
    if variant == "winograd" and geo.rank == 2:
        return _winograd_splits(geo, chunk or geo.batch, threads, grid, sizes, vendor)
    if variant == "native":
        return _native_splits(geo, layout, threads, grid, sizes, vendor, chunk or 1)
    if variant == "depthwise" and layout.startswith("native"):
        taps = math.prod(geo.window.out_spatial) * math.prod(geo.window.kernel)
        planes = geo.batch * geo.in_channels
        return (chunk_split("planes", planes, threads, planes * taps, LeastWork.TAPS),)
    return ()


def _winograd_splits(geo: ConvGeometry, chunk: int, threads: int, grid: Any,
                     sizes: Caches | None, vendor: Any) -> tuple[Split, ...]:
    out = geo.window.out_spatial
    c, m = geo.in_channels, geo.out_channels
    pipe = winograd_pipeline(geo.batch, c, m, (out[0], out[1]), threads, sizes, grid,
                             vendor=vendor)
    if pipe.tiles:                 # counted in tiles: the last block may be partial
        tiles = geo.batch * -(-out[0] // 2) * -(-out[1] // 2)
        return (Split(f"pipeline ({pipe.blocks} blocks of {pipe.tiles})", tiles,
                      pipe.threads or pipe.parts, 32 * m * c * tiles,
                      least_work(LeastWork.FLOPS, threads),
                      largest=pipe.busiest, unit="tile(s)"),)
    k = min(chunk, geo.batch)
    tiles = k * -(-out[0] // 2) * -(-out[1] // 2)
    hw = (out[0], out[1])
    passes = []
    for name, channels, output in (("input transform", c, False),
                                   ("output transform", m, True)):
        work = k * channels * winograd_plane_floats(hw, output, grid)
        by_rows = winograd_by_rows(k, c + m, hw, threads, sizes, grid, m * c)
        units = k * -(-out[0] // 2) if by_rows else k * channels
        passes.append(Split(f"{name} {'tile rows' if by_rows else 'planes'}", units,
                            winograd_parts(k, channels, hw, output, threads, by_rows), work,
                            least_work(LeastWork.FLOATS, threads)))
    products = gemm_pass("16 products", 16, m, tiles, c, threads, grid,
                         panel_major=not winograd_by_product(c, m, tiles, threads),
                         sizes=sizes, raw=(False, True),
                         lanes=winograd_pass_lanes(c, m, tiles, vendor, grid)[0])
    return passes[0], products, passes[1]


def _native_splits(geo: ConvGeometry, layout: str, threads: int, grid: Any,
                   sizes: Caches | None, vendor: Any = _HERE, step: int = 1
                   ) -> tuple[Split, ...]:
    n, g, win = geo.batch, geo.group, geo.window
    pixels, taps = math.prod(win.out_spatial), math.prod(win.kernel)
    cg, mg = geo.in_channels // g, geo.out_channels // g
    if layout in native_blocked.REGION_LAYOUTS and conv_gemm.blocked_serves(geo):
        split = blocked_split(geo, threads)
        return (Split(f"bands of output rows x {split.groups} channel group(s)", split.units,
                      split.parts, n * _image_flops(geo), least_work(LeastWork.FLOPS, threads)),)
    band, copied, batch, columns, wide = _native_shape(geo, layout, step)
    if band:
        rows = native_gemm.band_rows(geo.in_channels, win.kernel, win.out_spatial) or 1
        units = n * -(-win.out_spatial[0] // rows)
        flops = 2 * n * geo.out_channels * pixels * cg * taps
        return (Split("bands of output rows", units, max(1, min(threads, units)), flops,
                      least_work(LeastWork.FLOPS, threads)),)
    # Only the direct form reads X as B in place, plain rows: lanes tiles take it; the
    # masked form copies each image's taps for them (masked_lanes).
    lanes = (layout == "direct" and lanes_tiles(batch, mg, columns, cg * taps, vendor, grid)) or (
        layout == "masked" and masked_lanes(mg, columns, cg * taps, grid))
    product = gemm_pass("products" if g > 1 else "product", batch, mg, columns, cg * taps,
                        threads, grid, sizes=sizes, raw=(False, True), lanes=lanes)
    if not copied:
        return (product,)
    # By image (gathered-images): each step's planes, then its product, over the batch.
    planes = (min(step, n) if layout == "gathered-images" else n) * geo.in_channels
    work = planes * math.prod(win.in_spatial)
    if wide:                                # X into the wide buffer: one NumPy copy
        return Split("copy into the wide buffer (NumPy)", 1, 1, work,
                     least_work(LeastWork.COPY, threads)), product
    if win.rank != 2:                       # window.c's phase copy takes 2-D planes only
        return chunk_split("phase copy planes", planes, threads, work, LeastWork.FLOATS), product
    bands, pieces = phase_copy_split(planes, win.in_spatial[0], win.in_spatial[1], threads)
    name = "phase copy planes" if bands == 1 else f"phase copy planes x {bands} bands of rows"
    return Split(name, planes * bands, pieces, work, least_work(LeastWork.FLOATS, threads)
                 ), product


@functools.lru_cache(maxsize=512)
def _native_shape(geo: ConvGeometry, form: str, step: int = 1
                  ) -> tuple[bool, bool, int, int, bool]:
    """What the split of ``geo``'s native conv in ``form`` (``step`` images a step by
    image) follows: (by bands, X copied first, the products per group, their columns,
    through the wide buffer)."""
    found = conv_gemm.native_layout(geo, form, step=step)
    pixels = math.prod(geo.window.out_spatial)
    batch, columns = (1, geo.batch * pixels) if found.stacked else (geo.batch, pixels)
    if found.images:
        batch, columns = 1, found.step * pixels     # each step's product on its own
    if found.wide is not None:
        batch, columns = (1 if found.wide.stacked else geo.batch), found.wide.columns
    return found.band, found.copied, batch, columns, found.wide is not None


def node_splits(op: Op, input_types: Sequence[TensorType | None], attrs: Mapping[str, Any],
                node_plan: NodePlan, threads: int, profile: Any = None,
                constants: tuple[bool, ...] | None = None, low_memory: str = ""
                ) -> tuple[Split, ...]:
    """The parallel passes of a node planned as ``node_plan`` on ``threads`` threads (for
    the CPU of ``profile``): a conv's (conv_splits), a MatMul's or Gemm's one product
    (its B packed per call where it is not among the ``constants`` or in ``low_memory``
    mode), a pooling window's planes, a row or copy kernel's elements; () for a node
    whose kernel none of these describes."""
    request = PlanRequest(op, tuple(input_types), dict(attrs), threads, profile,
                          low_memory=low_memory, constants=constants)
    pooled = _pooled_splits(request, node_plan, threads)
    if pooled is not None:
        return pooled
    grid = tile_grid(profile)
    geo = _static_geometry(request)
    if geo is not None:
        variant = node_plan.option("conv_variant") or node_plan.variant
        return conv_splits(variant, node_plan.layout, node_plan.chunk, geo, threads, grid,
                           caches(profile), cpu_vendor(profile))
    product = _product(request)
    if product is not None:
        m, k, n = product
        return (gemm_pass("product", 1, m, n, k, threads, grid, sizes=caches(profile),
                          raw=_product_raw(request)),)
    pool = _pool_split(request, threads) or _attention_pass(request, node_plan.threads or 1)
    if pool is not None:
        return (pool,)
    rows = _gather_rows(request)
    if rows is not None:                       # whole rows: the kernel's own rule
        return (chunk_split("rows", rows[0], node_plan.threads or 1, rows[0] * rows[1],
                            LeastWork.COPY, unit="row(s)"),)
    found = _element_work(request)
    if found is None:
        return ()
    elements, work = found
    pieces = node_plan.threads or 1
    return (Split("elements", elements, max(1, min(pieces, elements)), elements,
                  least_work(work, threads or 2)),)


def _pooled_splits(request: PlanRequest, node_plan: NodePlan, threads: int
                   ) -> tuple[Split, ...] | None:
    """A conv pooled in its pool's step (pool_in_conv) and that pool: the one call over
    images x bands (the pool's step runs it); None for other nodes."""
    split = node_plan.option("pool_in_conv")
    shapes = request.static_shapes()
    if split is None or not shapes or shapes[0] is None:
        return None
    units = shapes[0][0] * split[0]
    return (Split("conv and pool", units, max(1, min(threads, units)), units, 1,
                  unit="image band(s)"),)


def _native_heads(request: PlanRequest) -> tuple[int, int] | None:
    """(heads, query rows a head) of a fused attention the native GEMM path runs (static
    shapes, the same batch dimensions, heads past the row kernel's rule); else None."""
    shapes = request.static_shapes() if request.op is Op.ATTENTION else None
    if not shapes or len(shapes) < 3:
        return None
    q, k = shapes[0], shapes[1]
    if (q is None or k is None or shapes[2] is None or len(q) < 3 or k[:-2] != q[:-2]
            or attention_rows(q[-2], k[-2])):
        return None
    return math.prod(q[:-2]), q[-2]


def _attention_split_note(request: PlanRequest, threads: int | None) -> str:
    found = _native_heads(request)
    return "" if found is None else attention_split_reason(*found, threads or 1)


def _attention_pass(request: PlanRequest, threads: int) -> Split | None:
    """The native attention's one pass (heads x row blocks, attention_split)."""
    found = _native_heads(request)
    if found is None:
        return None
    heads, queries = found
    blocks, parts = attention_split(heads, queries, threads)
    work = _element_work(request)
    elements = work[0] if work is not None else heads * queries
    return Split("heads x row blocks", heads * blocks, max(1, min(parts, heads * blocks)),
                 elements, 1 if work is None else least_work(work[1], request.threads or 2))


def gather_rows(x_shape: Sequence[int], index_elements: int, axis: int) -> tuple[int, int]:
    """(rows, elements a row) of a Gather along ``axis`` as window.c's row copy moves it:
    one index's slice (the elements past ``axis``) a row, for every leading index."""
    return math.prod(x_shape[:axis]) * index_elements, math.prod(x_shape[axis + 1:])


def gather_parts(threads: int, rows: int, per_row: int) -> int:
    """The chunks of whole rows a Gather's row copy of ``rows`` rows of ``per_row``
    elements splits into on up to ``threads`` threads, each the least copy work of a
    split that wide (split_parts): the node plan's threads and the kernel's split (it
    cannot cut a row), so a single row of a million elements stays on one thread."""
    return max(1, split_parts(LeastWork.COPY, threads, rows, per_row))


def gather_copies_unbound(elements: int) -> bool:
    """Whether a Gather called once, not bound into a program (the kernel's plain call:
    a first run, a shape computation), runs window.c's row copy for ``elements`` output
    elements: only with at least one thread's least copy work (MIN_COPY_ELEMENTS).
    Such a call binds the copy each time (checks, addresses, its split: about 7 us on
    the 2-core Xeon under load) where NumPy's take with its index check costs 2.7 us in
    all for a shape tensor's one element, so below one thread's work (a single-thread
    copy, nothing to split) take serves; a bound Gather binds once and keeps the copy."""
    return elements >= least_work(LeastWork.COPY, 2)


def _gather_rows(request: PlanRequest) -> tuple[int, int] | None:
    """A Gather node's (rows, elements a row) where both shapes are known, else None."""
    shapes = request.static_shapes() if request.op is Op.GATHER else None
    if not shapes or len(shapes) < 2 or not shapes[0] or shapes[1] is None:
        return None
    axis = request.attrs.get("axis", 0) % len(shapes[0])
    return gather_rows(shapes[0], math.prod(shapes[1]), axis)


def _element_work(request: PlanRequest) -> tuple[int, LeastWork] | None:
    """A row or copy kernel's work in elements and the kind of its least work per thread;
    None for other nodes or shapes not known."""
    shapes = request.static_shapes() if request.op in _ELEMENT_THREADS_OPS else None
    if not shapes or shapes[0] is None:
        return None
    work = (LeastWork.COPY if request.op in _COPY_OPS else LeastWork.SKIP_NORM
            if request.op is Op.SKIP_LAYER_NORM else LeastWork.ELEMENTS)
    elements = math.prod(shapes[0])
    if request.op is Op.GATHER:                # the rows copied: the output's elements
        rows = _gather_rows(request)
        if rows is None:
            return None
        elements = rows[0] * rows[1]
    if request.op is Op.ATTENTION:             # the row kernel's work: scores x (d + dv)
        if len(shapes) < 3 or shapes[1] is None or shapes[2] is None:
            return None
        q, k, v = shapes[0], shapes[1], shapes[2]
        elements = math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
    return elements, work


_POOL_SPLIT_OPS = frozenset({Op.MAX_POOL, Op.AVG_POOL, Op.GLOBAL_AVG_POOL, Op.GLOBAL_MAX_POOL})


def _pool_split(request: PlanRequest, threads: int) -> Split | None:
    """A MaxPool's or AveragePool's planes on the native window kernels, or a global
    pool's planes on its row kernel (one tap per input element)."""
    shapes = request.static_shapes() if request.op in _POOL_SPLIT_OPS else None
    if not shapes or shapes[0] is None:
        return None
    if request.op in (Op.GLOBAL_AVG_POOL, Op.GLOBAL_MAX_POOL):
        if len(shapes[0]) < 3:
            return None
        planes = shapes[0][0] * shapes[0][1]
        return chunk_split("planes", planes, threads,
                           math.prod(shapes[0]) * GLOBAL_POOL_TAPS_PER_ELEMENT, LeastWork.TAPS)
    if len(shapes[0]) != 4:
        return None
    try:
        win = pool_window(request.op, shapes[0], request.attrs)
    except KeelError:
        return None
    planes = shapes[0][0] * shapes[0][1]
    taps = math.prod(win.out_spatial) * math.prod(win.kernel)
    return chunk_split("planes", planes, threads, planes * taps, LeastWork.TAPS)


def _pool_split_note(request: PlanRequest, threads: int | None) -> str:
    """How a float32 pool's native window kernel splits its planes over ``threads`` (its
    WindowGeometry.parts; for a MaxPool, which of window.c's kernels runs it); "" for
    other nodes and dtypes, unknown shapes or one thread."""
    if threads is None or threads < 2 or request.op not in (Op.MAX_POOL, Op.AVG_POOL) or (
            request.dtype is not DType.FLOAT32):
        return ""
    split, shapes = _pool_split(request, threads), request.static_shapes()
    if split is None or not shapes or shapes[0] is None:
        return ""
    note = split_reason((split,), threads)
    if request.op is Op.MAX_POOL:
        win = pool_window(request.op, shapes[0], request.attrs)
        rows = win.rank == 2 and max_pool_by_rows(win.kernel, win.strides, win.dilations)
        note += ("; window.c's row kernel (max_pool_by_rows)" if rows
                 else "; window.c's band copies")
    return note


def split_reason(splits: Sequence[Split], threads: int) -> str:
    """The split of a node's passes on ``threads`` threads, for its plan's reasons: each
    pass's pieces and evenness, and for a pass on fewer pieces than threads whether it
    has work for all of them."""
    if not splits:
        return ""
    least = min(s.pieces for s in splits)
    notes = []
    for s in splits:
        if s.pieces >= threads:
            continue
        what = s.name.split(" (")[0]
        notes.append(f"{what}: {s.work:,} work, at least {s.least:,} a thread"
                     + ("" if s.worth(threads) else f" (under {threads} x that)"))
    return (f"split into {least} piece(s){' at least' if len(splits) > 1 else ''}: "
            f"{'; '.join(s.describe() for s in splits)}"
            + (f"; on fewer than {threads}: {'; '.join(notes)}" if notes else ""))


def conv_form(variant: str, geo: ConvGeometry, itemsize: int, grid: Any = _HERE,
              sizes: Caches | None = None, threads: int = 1, vendor: Any = _HERE
              ) -> ConvForm:
    """The layout (form) of conv ``variant`` for ``geo`` computed in ``itemsize``-byte
    elements, and why ("" where the variant has one form); cache-bound sizes for the
    caches of ``sizes``, vendor rules for a CPU of ``vendor`` (defaults: this
    machine's)."""
    if variant == "native":
        form, why = native_form(geo, grid, vendor, threads)
        step, step_why = (by_image_step(geo, threads, grid, sizes)
                          if form == "gathered-images" else (None, ""))
        scratch = conv_gemm.native_scratch(conv_gemm.native_layout(geo, form, step=step or 1),
                                           itemsize)
        lanes, streams = native_tiles(geo, form, grid, vendor)
        a16, a16_why = native_a16(lanes if form == "direct" else None, grid, vendor)
        tail, tail_why = native_lanes_tail(form, grid, vendor)
        return ConvForm(form, why, step, workspace_bytes=scratch,
                        stream_stores=stream_stores(geo, sizes), gemm_lanes=lanes,
                        output_streams=streams, chunk_reason=step_why, gemm_a16=a16,
                        a16_reason=a16_why, gemm_tail=tail, tail_reason=tail_why)
    if variant == "depthwise":
        layout, why = depthwise_form(geo)
        numpy_form = layout.rpartition("|")[2]
        block = depthwise_block(geo, numpy_form, sizes)
        budget = depthwise_budget(numpy_form, sizes)
        scheme, scheme_why = _native_depthwise_scheme(geo, layout, threads, sizes)
        return ConvForm(layout, why, block[0], block=block, chunk_reason=(
            f"{block[0]} image(s) and {block[1]} channel(s) per block of the NumPy form "
            f"{numpy_form}: its buffers within {budget >> 10} KiB"), scheme=scheme,
            scheme_reason=scheme_why)
    if variant == "im2col":
        return im2col_form(geo, itemsize)
    if variant == "pointwise":
        return pointwise_form(geo)
    if variant == "winograd":
        return winograd_form(geo, itemsize, sizes, threads, vendor, grid)
    return ConvForm("", "the variant's only form")


def _native_depthwise_scheme(geo: ConvGeometry, layout: str, threads: int,
                             sizes: Caches | None) -> tuple[str, str]:
    """The scheme of a depthwise ``layout``'s native call (depthwise_scheme), and why."""
    compiled = native_window.plan(geo.in_channels, geo.window)
    if not layout.startswith("native") or compiled is None:
        return DEPTHWISE_SCHEME, "no native call"
    return depthwise_scheme(compiled, geo.batch * geo.in_channels, threads, sizes)


def im2col_layout(geo: ConvGeometry, itemsize: int) -> conv_gemm.Im2colLayout:
    """``geo``'s im2col layout as planned."""
    form = im2col_form(geo, itemsize)
    return conv_gemm.im2col_layout(geo, form.layout.startswith("compact"),
                                   form.layout.endswith("-stacked"), form.chunk or 1)
