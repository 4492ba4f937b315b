"""Which convolutions each conv variant serves, and which one to prefer.

A :class:`ConvCase` is the part of a convolution a variant choice depends on
(geometry, channels, dtype), built from shapes and attributes alone. A
:class:`ConvRule` is a variant's typed metadata: the cases it can run
(kernel size, strides, dilations, padding, grouping, dtypes, rank) and, for a
variant that is only *sometimes* faster, the measured region where it wins.
:func:`pick` walks the rules by priority and returns the first that serves
the case with a reason a person can read. The ``default`` conv kernel and the
planner (:func:`keel.planning.variants.choose_variant`) both use it, so a plan
and a plain ``run`` make the same choice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.ops.registry import Op
from keel.ops.schemas.conv import conv2d_attrs, conv_geometry
from keel.ops.types import Dim

__all__ = ["ConvCase", "ConvRule", "conv_case", "pick"]


@dataclass(frozen=True)
class ConvCase:
    """The facts about one convolution that decide its kernel variant."""

    rank: int
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    padded: bool
    group: int
    in_channels: int
    out_channels: int
    out_spatial: tuple[int, ...]
    batch: int
    dtype: str

    @property
    def depthwise(self) -> bool:
        return self.group > 1 and self.group == self.in_channels

    @property
    def out_pixels(self) -> int:
        return math.prod(self.out_spatial)

    @property
    def batch_pixels(self) -> int:
        """Output pixels of the whole batch (what a batched GEMM sees)."""
        return self.batch * self.out_pixels

    def describe(self) -> str:
        k = "x".join(str(d) for d in self.kernel)
        s = "x".join(str(d) for d in self.strides)
        grouping = ("depthwise" if self.depthwise
                    else f"{self.group} groups" if self.group > 1 else "dense")
        size = "x".join(str(d) for d in self.out_spatial)
        return (f"{k} stride {s}, {self.in_channels}->{self.out_channels} channels "
                f"({grouping}), output {size}")


def conv_case(op: Op, x_shape: Sequence[Dim], w_shape: Sequence[Dim],
              attrs: Mapping[str, Any], dtype: str) -> ConvCase | None:
    """The case of a CONV / CONV2D / CONV_INTEGER node; None when shapes are not known.

    A symbolic batch dimension counts as 1 (the batch matters only where a rule's
    ``wins_where`` asks for output pixels over the batch; a plan made for the
    real input shape sees the real batch).
    """
    if len(x_shape) and not isinstance(x_shape[0], int):
        x_shape = (1, *x_shape[1:])
    if not all(isinstance(d, int) for d in (*x_shape, *w_shape)):
        return None
    norm = conv2d_attrs(attrs) if op is Op.CONV2D else attrs
    geo = conv_geometry(op, [int(d) for d in x_shape if isinstance(d, int)],
                        [int(d) for d in w_shape if isinstance(d, int)], norm)
    win = geo.window
    return ConvCase(win.rank, win.kernel, win.strides, win.dilations, win.padded, geo.group,
                    geo.in_channels, geo.out_channels, win.out_spatial, geo.batch, dtype)


# Output pixels over the batch from which a variant that otherwise yields 1x1 stride-1
# convs to the pointwise GEMM keeps them. native: its product reads X in place row panel
# by row panel with bias and ReLU6 fused into the store (or, at batch 32 on 7x7, stacks
# the images). Measured on MobileNetV2's 1x1 layers (2-core AMD EPYC, Zen 4, 1 thread,
# interleaved medians): native / pointwise time at batch 32 0.77 (16->96 on 112x112),
# 0.82 (24->144, 56x56), 0.90 (32->192, 28x28), 0.97-1.03 on 14x14, 0.88-0.98 on 7x7;
# at batch 1 0.81-0.99 down to 14x14, 1.10-1.22 on 7x7 (49 pixels: OpenBLAS keeps those).
# The whole MobileNetV2 set of 1x1 layers: 0.95x onnxruntime's single-conv time at
# batch 32 (pointwise 1.02x), 1.02x at batch 1 (1.03x).
# Batch 1 takes native too, 7x7 layers included: on one thread the model is level
# (MobileNetV2 batch 1: 9.48 ms against 9.54 with the pointwise GEMM below 196 pixels
# and batch 2), and on two the whole model then runs on keel's threads, with BLAS on
# one thread and no OpenBLAS workers spinning against them: 5.15 ms against 6.83 (and
# 10.1 with every batch-1 1x1 layer on OpenBLAS's two threads).
POINTWISE_FROM: dict[str, tuple[int, int]] = {"native": (1, 1)}
# What a reason quotes for those cases (the variant's evidence is about other kernels).
POINTWISE_MEASURED: dict[str, str] = {"native": (
    "1x1 stride 1: measured 0.77-1.01x the pointwise GEMM's time on MobileNetV2's 1x1 "
    "layers at batch 32, the whole model level at batch 1 on one thread and 0.75x on two")}


@dataclass(frozen=True)
class ConvRule:
    """A conv variant's metadata: what it serves and when it is preferred.

    ``None`` means "any". ``priority`` orders the variants that serve a case
    (higher first). ``measured`` records the measurement behind a
    performance-based limit (``min_channels``, ``min_out_pixels``, ...).
    """

    variant: str
    priority: int
    summary: str
    ranks: tuple[int, ...] | None = None
    kernel: tuple[int, ...] | None = None
    unit_kernel: bool = False
    strides: tuple[int, ...] | None = None
    dilations: tuple[int, ...] | None = None
    unpadded: bool = False
    groups: str = "any"                # "one", "depthwise", "not_depthwise" or "any"
    dtypes: frozenset[str] | None = None
    min_channels: int = 0              # min(in, out) channels per group
    max_channels: int | None = None    # ... at most this many
    yields_to_pointwise: bool = False  # leave 1x1 stride-1 unpadded convs to "pointwise"
    # ... except from (this many output pixels over the batch, this batch) up ((0, 0):
    # always yields): there the variant serves them whatever the channel limits (measured
    # apart from them). None: the measured values in POINTWISE_FROM for this variant.
    pointwise_from: tuple[int, int] | None = None
    # Decline a case whose nearest ``evidence`` point measured slower than the baseline.
    evidence_decides: bool = False
    min_out_pixels: int = 0
    max_out_pixels: int | None = None
    measured: str = ""
    # Where the variant is preferred, as (min channels per group, min output pixels of
    # the whole batch) pairs: a case qualifies when it meets any one pair.
    wins_where: tuple[tuple[int, int], ...] = ()
    # Measured points behind the limits: (channels, output side, batch, this variant's
    # time divided by the baseline's), quoted in reasons for the nearest case.
    evidence: tuple[tuple[int, int, int, float], ...] = ()
    baseline: str = ""

    def __post_init__(self) -> None:
        if self.pointwise_from is None:
            object.__setattr__(self, "pointwise_from", POINTWISE_FROM.get(self.variant, (0, 0)))

    def rejects(self, case: ConvCase) -> str | None:
        """Why this variant is not the choice for ``case``: it cannot run it, or it
        measured slower there (None when it is a candidate)."""
        return self.cannot_serve(case) or self._rejects_size(case)

    def cannot_serve(self, case: ConvCase) -> str | None:
        """Why this variant cannot compute ``case`` at all (None when it can)."""
        checks: Iterable[tuple[bool, str]] = (
            (self.ranks is not None and case.rank not in self.ranks,
             f"{case.rank}-D input; serves {self._ranks()}"),
            (self.kernel is not None and case.kernel != self.kernel,
             f"kernel {case.kernel}; serves {self.kernel}"),
            (self.unit_kernel and any(k != 1 for k in case.kernel),
             f"kernel {case.kernel}; serves 1x1 only"),
            (self.strides is not None and case.strides != self.strides,
             f"strides {case.strides}; serves {self.strides}"),
            (self.dilations is not None and case.dilations != self.dilations,
             f"dilations {case.dilations}; serves {self.dilations}"),
            (self.unpadded and case.padded, "padded input; serves unpadded only"),
            (self.groups == "one" and case.group != 1, f"{case.group} groups; serves 1"),
            (self.groups == "depthwise" and not case.depthwise,
             "not depthwise (group != in channels)"),
            (self.groups == "not_depthwise" and case.depthwise,
             "depthwise (one input channel per group)"),
            (self.dtypes is not None and case.dtype not in self.dtypes,
             f"dtype {case.dtype}; serves {', '.join(sorted(self.dtypes or ()))}"),
        )
        for failed, why in checks:
            if failed:
                return why
        return None

    def _rejects_size(self, case: ConvCase) -> str | None:
        if self.yields_to_pointwise and _pointwise(case):
            return self._rejects_pointwise(case)
        per_group = min(case.in_channels, case.out_channels) // max(case.group, 1)
        evidence = self.nearest_evidence(case)
        note = f" ({evidence})" if evidence else ""
        if per_group < self.min_channels:
            return f"{per_group} channels per group < {self.min_channels}{note}"
        if self.max_channels is not None and per_group > self.max_channels:
            return f"{per_group} channels per group > {self.max_channels}{note}"
        if self.evidence_decides and self.evidence and self._nearest(case)[3] >= 1.0:
            return f"the nearest measurement is slower{note}"
        if case.out_pixels < self.min_out_pixels:
            return f"{case.out_pixels} output pixels < {self.min_out_pixels}{note}"
        if self.max_out_pixels is not None and case.out_pixels > self.max_out_pixels:
            return f"{case.out_pixels} output pixels > {self.max_out_pixels}{note}"
        if self.wins_where and not any(per_group >= c and case.batch_pixels >= p
                                       for c, p in self.wins_where):
            need = " or ".join(f">= {c} channels and >= {p} output pixels over the batch"
                               for c, p in self.wins_where)
            return (f"{per_group} channels, {case.batch_pixels} output pixels over the batch; "
                    f"wins with {need}{note}")
        return None

    def _rejects_pointwise(self, case: ConvCase) -> str | None:
        """Why a 1x1 stride-1 unpadded case goes to the pointwise GEMM (None: it stays)."""
        pixels, batch = self.pointwise_from or (0, 0)
        if not pixels:
            return "1x1 stride-1 unpadded: the pointwise GEMM measured faster"
        if case.batch_pixels >= pixels and case.batch >= batch:
            return None
        return (f"1x1 stride-1 unpadded, batch {case.batch}, {case.batch_pixels} output "
                f"pixels over the batch: served from batch {batch} and {pixels} pixels "
                "(the pointwise GEMM below)")

    def scope(self) -> str:
        """The cases this variant serves, in words."""
        parts = []
        if self.ranks is not None:
            parts.append(self._ranks())
        if self.kernel is not None:
            parts.append("kernel " + "x".join(str(k) for k in self.kernel))
        if self.unit_kernel:
            parts.append("1x1 kernel")
        if self.strides is not None:
            parts.append("stride " + "x".join(str(s) for s in self.strides))
        if self.dilations is not None:
            parts.append("dilation " + "x".join(str(d) for d in self.dilations))
        if self.unpadded:
            parts.append("no padding")
        if self.groups != "any":
            parts.append({"one": "1 group", "depthwise": "depthwise",
                          "not_depthwise": "not depthwise"}[self.groups])
        if self.dtypes is not None:
            parts.append("/".join(sorted(self.dtypes)))
        if self.min_channels:
            parts.append(f">= {self.min_channels} channels per group")
        if self.max_channels is not None:
            parts.append(f"<= {self.max_channels} channels per group")
        if self.yields_to_pointwise and self.pointwise_from and self.pointwise_from[0]:
            parts.append(f"1x1 stride-1 unpadded (any channels) only from batch "
                         f"{self.pointwise_from[1]} and {self.pointwise_from[0]} batch "
                         "output pixels")
        elif self.yields_to_pointwise:
            parts.append("not 1x1 stride-1 unpadded")
        if self.min_out_pixels:
            parts.append(f">= {self.min_out_pixels} output pixels")
        if self.wins_where:
            parts.append(" or ".join(f">= {c} channels and >= {p} batch output pixels"
                                     for c, p in self.wins_where))
        return ", ".join(parts) or "any convolution"

    def nearest_evidence(self, case: ConvCase) -> str:
        """The measurement closest to ``case`` (log distance in channels, size and batch)."""
        if self.yields_to_pointwise and _pointwise(case):
            return POINTWISE_MEASURED.get(self.variant, "")
        if not self.evidence:
            return ""
        ch, sd, n, ratio = self._nearest(case)
        verdict = (f"{1 / ratio:.2f}x faster" if ratio < 1 else f"{ratio:.2f}x slower")
        return (f"measured {verdict} than {self.baseline} at {ch} channels, {sd}x{sd} "
                f"output, batch {n}")

    def _nearest(self, case: ConvCase) -> tuple[int, int, int, float]:
        """The evidence point closest to ``case`` (log distance in channels, size, batch)."""
        channels = max(1, min(case.in_channels, case.out_channels))
        side = max(1.0, case.out_pixels ** (1.0 / max(case.rank, 1)))
        batch = max(1, case.batch)

        def dist(point: tuple[int, int, int, float]) -> float:
            return (abs(math.log(point[0] / channels)) + abs(math.log(point[1] / side))
                    + 0.5 * abs(math.log(point[2] / batch)))

        return min(self.evidence, key=dist)

    def _ranks(self) -> str:
        return "/".join(f"{r}-D" for r in self.ranks or ())


def _pointwise(case: ConvCase) -> bool:
    return (all(k == 1 for k in case.kernel) and all(s == 1 for s in case.strides)
            and not case.padded)


def pick(case: ConvCase, rules: Iterable[ConvRule],
         available: Iterable[str] | None = None) -> tuple[str, str]:
    """The highest-priority rule serving ``case`` and the reason, naming rejected ones."""
    names = None if available is None else set(available)
    skipped: list[str] = []
    for rule in sorted(rules, key=lambda r: -r.priority):
        if names is not None and rule.variant not in names:
            continue
        why_not = rule.rejects(case)
        if why_not is None:
            reason = f"{case.describe()}: {rule.variant} ({rule.summary})"
            evidence = rule.nearest_evidence(case)
            if evidence:
                reason += f"; {evidence}"
            if skipped:
                reason += f"; not {', '.join(skipped)}"
            return rule.variant, reason
        skipped.append(f"{rule.variant}: {why_not}")
    raise LookupError(f"no conv variant serves {case.describe()}: {'; '.join(skipped)}")
