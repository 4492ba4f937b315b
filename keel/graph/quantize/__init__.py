"""int8/int16 quantization of float models: weight-only and static QDQ.

Two modes, both written in the standard ONNX QDQ form (QUANTIZE_LINEAR /
DEQUANTIZE_LINEAR nodes around float Conv, Gemm and MatMul), so a quantized
graph runs on every keel backend and, exported, in onnxruntime:

* ``weight-only`` — the constant weights of Conv/Gemm/MatMul become int8
  (or int16) integers with one symmetric scale per output channel, each read
  through a DEQUANTIZE_LINEAR node. Activations stay float; no data needed.
  A saved model shrinks about 4x (int8) or 2x (int16) in its weights.
* ``qdq`` (static) — weights as above, biases as int32, and every float
  activation entering or leaving a Conv/Gemm/MatMul passes through a
  QUANTIZE_LINEAR → DEQUANTIZE_LINEAR pair (uint8 by default, or int8;
  uint16/int16 with 16 bits) whose scale and zero point come from running
  calibration samples through the float graph (``minmax`` or ``percentile``
  ranges, see :mod:`keel.graph.quantize.calibrate`), run through keel's
  executor as inference is.

Quantize an optimized graph (``keel convert`` optimizes first), so fused
activations sit inside the quantized ranges. Loading a quantized model with
optimization (the default) folds every DEQUANTIZE_LINEAR of a constant back
into a float weight once, at load time: the *file* stays small and the model
runs at float speed with no per-run dequantization. Loading with
``optimization_level="none"`` keeps the integers in memory and dequantizes
them each run instead. See the rewrite rules in
:mod:`keel.graph.quantize.rewrite`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.errors import InvalidArgumentError
from keel.graph.ir import Graph
from keel.graph.quantize.calibrate import (
    METHODS,
    CalibrationSet,
    Progress,
    check_samples,
    collect_ranges,
    load_calibration,
)
from keel.graph.quantize.rewrite import (
    TARGETS,
    Rewriter,
    activation_params,
    activation_tensors,
    find_targets,
    quantize_weight,
)
from keel.graph.shape_inference import Evaluator, propagate
from keel.ops.registry import OpGroup

__all__ = [
    "BITS",
    "METHODS",
    "MODES",
    "TARGETS",
    "CalibrationSet",
    "QuantizeOptions",
    "QuantizeReport",
    "activation_params",
    "check_samples",
    "load_calibration",
    "quantize_graph",
    "quantize_weight",
    "quantize_with_report",
]

MODES = ("weight-only", "qdq")
BITS = (8, 16)
_WEIGHT = {8: DType.INT8, 16: DType.INT16}
_ACTIVATIONS = {8: (DType.UINT8, DType.INT8), 16: (DType.UINT16, DType.INT16)}

Calibration = CalibrationSet | Mapping[str, Any] | str | os.PathLike[str]


def parse_bits(bits: Any) -> int:
    """8 or 16 from ``8``, ``"8"``, ``"int8"`` (and the same for 16)."""
    text = str(bits).strip().lower() if isinstance(bits, (int, str)) and \
        not isinstance(bits, bool) else ""
    value = {"8": 8, "int8": 8, "16": 16, "int16": 16}.get(text)
    if value is None:
        raise InvalidArgumentError(
            f"unknown quantization bits {bits!r}; allowed: int8, int16 (or 8, 16)")
    return value


def parse_mode(mode: Any) -> str:
    """``weight-only`` or ``qdq`` (``weight_only`` is accepted too)."""
    text = str(mode).strip().lower().replace("_", "-") if isinstance(mode, str) else ""
    if text not in MODES:
        raise InvalidArgumentError(
            f"unknown quantization mode {mode!r}; allowed: {', '.join(MODES)}")
    return text


@dataclass(frozen=True)
class QuantizeOptions:
    """How to quantize; fields are checked and normalized on construction.

    ``bits``: 8/16 or "int8"/"int16"; ``mode``: weight-only or qdq;
    ``method``: minmax or percentile (with ``percentile`` in (50, 100]);
    ``activation_dtype``: uint8/int8 (8 bits) or uint16/int16 (16 bits), default
    unsigned; ``batch_size``: calibration samples run at once.
    """

    bits: int | str = 8
    mode: str = "weight-only"
    method: str = "minmax"
    percentile: float = 99.99
    activation_dtype: DType | str | None = None
    batch_size: int = 32

    def __post_init__(self) -> None:
        bits = parse_bits(self.bits)
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "mode", parse_mode(self.mode))
        if self.method not in METHODS:
            raise InvalidArgumentError(
                f"unknown calibration method {self.method!r}; allowed: {', '.join(METHODS)}")
        if isinstance(self.percentile, bool) or not isinstance(self.percentile, (int, float)) \
                or not 50.0 < float(self.percentile) <= 100.0:
            raise InvalidArgumentError(
                f"percentile must be in (50, 100], got {self.percentile!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or \
                self.batch_size < 1:
            raise InvalidArgumentError(
                f"calibration batch size must be a positive integer, got {self.batch_size!r}")
        object.__setattr__(self, "activation_dtype", self._activation(bits))

    def _activation(self, bits: int) -> DType:
        allowed = _ACTIVATIONS[bits]
        if self.activation_dtype is None:
            return allowed[0]
        text = self.activation_dtype.value if isinstance(self.activation_dtype, DType) \
            else str(self.activation_dtype).strip().lower()
        for dtype in allowed:
            if dtype.value == text:
                return dtype
        raise InvalidArgumentError(
            f"activation dtype {self.activation_dtype!r} does not go with int{bits} "
            f"quantization; allowed: {', '.join(d.value for d in allowed)}")

    @property
    def weight_dtype(self) -> DType:
        return _WEIGHT[int(self.bits)]

    @property
    def activations(self) -> DType:
        """The activation dtype (normalized)."""
        return self._activation(int(self.bits))


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_with_report` did; ``to_dict()`` is plain JSON data."""

    graph: Graph
    options: QuantizeOptions
    quantized_nodes: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]          # (node, why it was left float)
    quantized_weights: int
    quantized_activations: int
    weight_bytes_before: int
    weight_bytes_after: int
    calibration_samples: int = 0
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return {
            "bits": o.bits, "mode": o.mode, "weight_dtype": o.weight_dtype.value,
            "activation_dtype": o.activations.value if o.mode == "qdq" else None,
            "calibration": ({"samples": self.calibration_samples, "method": o.method,
                             **({"percentile": o.percentile} if o.method == "percentile"
                                else {})} if o.mode == "qdq" else None),
            "quantized_nodes": len(self.quantized_nodes),
            "quantized_weights": self.quantized_weights,
            "quantized_activations": self.quantized_activations,
            "weight_bytes_before": self.weight_bytes_before,
            "weight_bytes_after": self.weight_bytes_after,
            "skipped": [{"node": n, "reason": r} for n, r in self.skipped],
        }


def quantize_graph(graph: Graph, bits: int | str = 8, mode: str = "weight-only",
                   calibration: Calibration | None = None, **options: Any) -> Graph:
    """``graph`` with int8/int16 weights (and, in qdq mode, activations); a new graph.

    ``calibration`` (qdq only) is a mapping of input name to samples, a
    :class:`CalibrationSet` or the path of an ``.npz`` holding such arrays.
    Further keywords are :class:`QuantizeOptions` fields, ``progress``
    (called with (samples done, samples in all) after each calibration batch)
    and ``evaluator`` (what runs the samples, see :func:`quantize_with_report`).
    """
    progress = options.pop("progress", None)
    evaluator = options.pop("evaluator", None)
    allowed = [f for f in QuantizeOptions.__dataclass_fields__ if f not in ("bits", "mode")]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InvalidArgumentError(f"unknown quantization option {unknown[0]!r}; allowed: "
                                   f"progress, {', '.join(allowed)}, evaluator")
    opts = QuantizeOptions(bits, mode, **options)
    return quantize_with_report(graph, opts, calibration, progress, evaluator).graph


def quantize_with_report(graph: Graph, options: QuantizeOptions,
                         calibration: Calibration | None = None,
                         progress: Progress | None = None,
                         evaluator: Evaluator | None = None) -> QuantizeReport:
    """Like :func:`quantize_graph`, also saying what was quantized and what was not.

    ``evaluator`` runs the calibration samples (and the constant values shape
    inference needs); by default keel's executor, placed as a loaded model is.
    """
    _check_not_quantized(graph)
    data = _calibration(graph, options, calibration)
    types = propagate(graph, evaluator=evaluator).types
    qdq = options.mode == "qdq"
    targets, skipped = find_targets(graph, types, with_activations=qdq)
    rw = Rewriter(graph, options.weight_dtype)
    ranges: dict[str, tuple[float, float]] = {}
    if qdq and data is not None:
        tensors = activation_tensors(graph, targets, types)
        ranges = collect_ranges(graph, data, tensors, options.method, float(options.percentile),
                                options.batch_size, progress, evaluator)
        for name in tensors:
            rw.activation(name, options.activations, *ranges[name])
    copies = {n.name: n for n in rw.g.nodes}
    for target in targets:
        node = copies[target.node.name]
        for index, axis in target.weights:
            rw.weight(node, index, axis)
        if qdq:
            rw.bias(node)
    result = rw.finish()
    return QuantizeReport(
        result, options, tuple(t.node.name for t in targets), tuple(skipped),
        len(rw.weight_cache), len(ranges), _weight_bytes(graph), _weight_bytes(result),
        data.count if data is not None else 0, ranges)


def _calibration(graph: Graph, options: QuantizeOptions,
                 calibration: Calibration | None) -> CalibrationSet | None:
    if options.mode != "qdq":
        if calibration is not None:
            raise InvalidArgumentError(
                "calibration data is only used by qdq quantization; weight-only "
                "quantization needs none (leave it out, or use mode qdq)")
        return None
    if calibration is None:
        needed = [v.name for v in graph.inputs if v.name not in graph.initializers]
        raise InvalidArgumentError(
            "qdq quantization needs calibration data to measure activation ranges: samples "
            f"for the model inputs ({', '.join(needed) or 'none'}), e.g. an .npz of arrays "
            "keyed by input name (keel convert --calibration FILE.npz); or use mode "
            "weight-only, which needs none")
    if isinstance(calibration, CalibrationSet):
        return calibration
    if isinstance(calibration, (str, os.PathLike)):
        return load_calibration(calibration, graph)
    return check_samples(graph, calibration)


def _check_not_quantized(graph: Graph) -> None:
    found = [n.name for n in graph.nodes if n.op in OpGroup.QUANTIZATION]
    if found:
        raise InvalidArgumentError(
            f"the graph is already quantized ({len(found)} quantization nodes, e.g. "
            f"{found[0]!r}); quantize the float model instead")


def _weight_bytes(graph: Graph) -> int:
    return sum(int(np.asarray(a).nbytes) for a in graph.initializers.values())
