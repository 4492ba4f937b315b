"""The graph rewrites of quantization and the arithmetic behind them.

* Weights: symmetric, per output channel — ``scale[c] = max|w[c]| / qmax``
  with ``qmax`` 127 (int8) or 32767 (int16), zero point 0, so the integer
  range is symmetric (``-qmax..qmax``) and an all-zero channel stays exact.
  The channel axis is Conv's axis 0 (``W[M, C/g, k...]``), Gemm's ``N`` axis
  of ``B`` (0 with ``trans_b``, else 1) and MatMul's last axis of ``B``; any
  other constant operand is quantized per tensor.
* Activations: asymmetric, per tensor, over the calibrated range widened to
  hold 0 (so zero padding and ReLU zeros are exact):
  ``scale = (hi - lo) / (qmax - qmin)``, ``zero_point = round(qmin - lo / scale)``.
* Biases (QDQ only): int32 with ``scale = x_scale * w_scale`` per channel,
  the form onnxruntime folds into QLinearConv/QGemm; a bias whose values
  would overflow int32 stays float.

Each quantized weight is stored as an integer initializer read by a
DEQUANTIZE_LINEAR node placed right before its first consumer (so, when the
nodes run, only the weights of the current layer exist in float). Each
quantized activation gets a QUANTIZE_LINEAR → DEQUANTIZE_LINEAR pair right
after its producer, and every node that read the activation reads the pair's
output instead. Graph outputs keep their float values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from keel.dtypes import DType
from keel.graph.ir import Graph, Node
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.schemas.quantization import QUANT_RANGES
from keel.ops.types import TensorType

__all__ = ["TARGETS", "Rewriter", "Target", "activation_params", "find_targets",
           "quantize_weight"]

TARGETS = frozenset({Op.CONV, Op.GEMM, Op.MATMUL})
_DATA_INPUTS = (0, 1)           # X/W of Conv, A/B of Gemm and MatMul
_BIAS_INPUT = 2                 # Conv B, Gemm C, keel MatMul's fused bias
_INT32_MAX = float(np.iinfo(np.int32).max)
ORIGIN = "keel.quantize"


@dataclass
class Target:
    """A node to quantize: constant operands (input index, channel axis) and activations."""

    node: Node
    weights: list[tuple[int, int | None]] = field(default_factory=list)
    activations: list[int] = field(default_factory=list)


# ---- arithmetic -----------------------------------------------------------------------------
def quantize_weight(w: np.ndarray, axis: int | None,
                    dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric quantization of ``w``: (integers, scale), per ``axis`` or per tensor.

    The scale has ``w``'s float type (it is what DEQUANTIZE_LINEAR multiplies
    by); the integers are rounded against that stored scale.
    """
    qmax = QUANT_RANGES[dtype][1]
    w64 = np.asarray(w, dtype=np.float64)
    if axis is None:
        amax = np.max(np.abs(w64)) if w64.size else np.float64(0.0)
    else:
        amax = np.max(np.abs(w64), axis=tuple(i for i in range(w64.ndim) if i != axis))
    scale = np.asarray(amax / qmax, dtype=w.dtype)
    # An all-zero channel (or one so small its scale underflows) gets scale 1: its
    # integers are 0 and it dequantizes to exact zeros.
    scale = np.where(scale > 0, scale, np.ones_like(scale)).astype(w.dtype)
    s64 = scale.astype(np.float64)
    if axis is not None:
        s64 = s64.reshape([-1 if i == axis else 1 for i in range(w64.ndim)])
    q = np.clip(np.rint(w64 / s64), -qmax, qmax).astype(dtype.numpy)
    return q, scale


def activation_params(lo: float, hi: float, dtype: DType,
                      scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric per-tensor (scale, zero point), as 0-d arrays, for the range [lo, hi]."""
    qmin, qmax = QUANT_RANGES[dtype]
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = np.asarray((hi - lo) / (qmax - qmin), dtype=scale_dtype)
    if not np.isfinite(scale) or scale <= 0:
        scale = np.asarray(1.0, dtype=scale_dtype)
    zero_point = np.clip(np.rint(qmin - lo / float(scale)), qmin, qmax)
    return scale, np.asarray(zero_point, dtype=dtype.numpy)


def channel_axis(graph: Graph, node: Node, index: int, rank: int) -> int | None:
    """The output-channel axis of constant operand ``index`` of ``node``, or None (per tensor)."""
    if index != 1:
        return None
    if node.op is Op.CONV and rank >= 3:
        return 0
    if node.op is Op.GEMM and rank == 2:
        return 0 if node.attr("trans_b", False) else 1
    if node.op is Op.MATMUL and rank >= 2:
        return rank - 1
    return None


# ---- what to quantize ---------------------------------------------------------------------------
def find_targets(graph: Graph, types: Mapping[str, TensorType | None],
                 with_activations: bool) -> tuple[list[Target], list[tuple[str, str]]]:
    """The nodes to quantize and, for the others of the target ops, why not."""
    targets: list[Target] = []
    skipped: list[tuple[str, str]] = []
    for node in graph.nodes:
        if node.op not in TARGETS:
            continue
        target, reason = _target(graph, node, types, with_activations)
        if target is None:
            skipped.append((node.name, reason))
        else:
            targets.append(target)
    return targets, skipped


def _target(graph: Graph, node: Node, types: Mapping[str, TensorType | None],
            with_activations: bool) -> tuple[Target | None, str]:
    target = Target(node)
    reasons: list[str] = []
    for index in _DATA_INPUTS:
        name = node.input(index)
        t = types.get(name)
        if not name:
            continue
        if t is None or not t.dtype.is_float:
            reasons.append(f"input {name!r} is {'of unknown type' if t is None else t.dtype.value}")
        elif graph.is_constant(name):
            arr = graph.initializers[name]
            if arr.size == 0 or not np.isfinite(arr).all():
                reasons.append(f"weight {name!r} is empty or not finite")
            else:
                target.weights.append((index, channel_axis(graph, node, index, arr.ndim)))
        elif with_activations:
            target.activations.append(index)
    if target.weights or target.activations:
        return target, ""
    return None, "; ".join(reasons) or "no constant float weight"


def activation_tensors(graph: Graph, targets: Sequence[Target],
                       types: Mapping[str, TensorType | None]) -> list[str]:
    """Values that get a Q/DQ pair: activation inputs of targets and their float outputs."""
    consumers = graph.consumers()
    chosen: dict[str, None] = {}
    for target in targets:
        for index in target.activations:
            chosen.setdefault(target.node.inputs[index])
        out = target.node.outputs[0] if target.node.outputs else ""
        t = types.get(out)
        if out and consumers.get(out) and t is not None and t.dtype.is_float:
            chosen.setdefault(out)
    return list(chosen)


# ---- rewriting ----------------------------------------------------------------------------------
class Rewriter:
    """Collects new nodes and initializers on a copy of a graph, then puts them in place."""

    def __init__(self, graph: Graph, weight_dtype: DType) -> None:
        self.g = graph.copy()
        self.weight_dtype = weight_dtype
        self.taken = self.g.names()
        self.consumers = self.g.consumers()
        self.producers = self.g.producers()
        self.before: dict[str, list[Node]] = {}     # node name -> nodes to run first
        self.after: dict[str, list[Node]] = {}      # value -> nodes right after its producer
        self.front: list[Node] = []
        self.weight_cache: dict[tuple[str, int | None], str] = {}
        self.scales: dict[str, np.ndarray] = {}     # dequantized value -> its scale
        self.replaced: set[str] = set()

    def fresh(self, base: str) -> str:
        return self.g.fresh_name(base, self.taken)

    def const(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.g.initializers[name] = value
        return name

    def make(self, op: Op, inputs: list[str], output: str, base: str,
             axis: int | None = None) -> Node:
        attrs = get_schema(op).normalize_attrs({} if axis is None else {"axis": axis})
        return Node(self.fresh(base), op, inputs, [output], attrs, ORIGIN)

    # -- weights --
    def weight(self, node: Node, index: int, axis: int | None) -> None:
        """Make ``node`` read input ``index`` through a DEQUANTIZE_LINEAR of its integers."""
        name = node.inputs[index]
        key = (name, axis)
        if key not in self.weight_cache:
            w = self.g.initializers[name]
            q, scale = quantize_weight(w, axis, self.weight_dtype)
            out = self.dequantize(node, name, q, scale, axis)
            self.g.value_types[out] = TensorType(DType.from_numpy(w.dtype), tuple(w.shape))
            self.weight_cache[key] = out
        node.inputs[index] = self.weight_cache[key]
        self.replaced.add(name)

    def dequantize(self, node: Node, name: str, q: np.ndarray, scale: np.ndarray,
                   axis: int | None) -> str:
        s = self.const(f"{name}_scale", scale)
        # An explicit zero point (all 0): onnxruntime fuses DQ → Gemm → Q into QGemm only then.
        z = self.const(f"{name}_zero_point", np.zeros(scale.shape, dtype=q.dtype))
        qn = self.const(f"{name}_quantized", q)
        out = self.fresh(f"{name}_dequantized")
        dq = self.make(Op.DEQUANTIZE_LINEAR, [qn, s, z], out, f"{name}/dequantize", axis)
        self.before.setdefault(node.name, []).append(dq)
        self.scales[out] = scale
        return out

    def bias(self, node: Node) -> None:
        """An int32 bias with scale x_scale * w_scale, when the node's operands allow it."""
        name, x, w = node.input(_BIAS_INPUT), node.input(0), node.input(1)
        if not name or not self.g.is_constant(name) or x not in self.scales or \
                w not in self.scales:
            return
        b = self.g.initializers[name]
        w_scale = self.scales[w]
        if b.ndim != 1 or b.dtype.kind != "f" or (w_scale.ndim == 1 and
                                                   w_scale.shape[0] != b.shape[0]):
            return
        scale = (self.scales[x].astype(b.dtype) * w_scale.astype(b.dtype)).astype(b.dtype)
        if not np.all(scale > 0):
            return
        q = np.rint(b.astype(np.float64) / scale.astype(np.float64))
        if not np.all(np.abs(q) <= _INT32_MAX):
            return
        out = self.dequantize(node, name, q.astype(np.int32), scale,
                              0 if scale.ndim == 1 else None)
        node.inputs[_BIAS_INPUT] = out
        self.replaced.add(name)

    # -- activations --
    def activation(self, name: str, dtype: DType, lo: float, hi: float) -> None:
        """A Q → DQ pair on ``name``; every node that read it reads the pair's output."""
        t = self.g.type_of(name)
        float_dtype = t.dtype.numpy if t is not None else np.dtype(np.float32)
        scale, zero_point = activation_params(lo, hi, dtype, float_dtype)
        s, z = self.const(f"{name}_scale", scale), self.const(f"{name}_zero_point", zero_point)
        quantized, out = self.fresh(f"{name}_quantized"), self.fresh(f"{name}_dequantized")
        pair = [self.make(Op.QUANTIZE_LINEAR, [name, s, z], quantized, f"{name}/quantize"),
                self.make(Op.DEQUANTIZE_LINEAR, [quantized, s, z], out, f"{name}/dequantize")]
        if name in self.producers:
            self.after.setdefault(name, []).extend(pair)
        else:
            self.front.extend(pair)
        if t is not None:
            self.g.value_types[quantized] = TensorType(dtype, t.shape)
            self.g.value_types[out] = t
        for consumer in self.consumers.get(name, ()):
            consumer.inputs = [out if i == name else i for i in consumer.inputs]
        self.scales[out] = scale

    # -- result --
    def finish(self) -> Graph:
        """The rewritten graph, nodes in order, float weights nothing reads any more dropped."""
        ordered = list(self.front)
        for node in self.g.nodes:
            ordered.extend(self.before.get(node.name, ()))
            ordered.append(node)
            for out in node.outputs:
                ordered.extend(self.after.get(out, ()))
        self.g.nodes = ordered
        still_read = {i for n in ordered for i in n.inputs}
        keep = still_read | set(self.g.input_names) | set(self.g.output_names)
        for name in self.replaced - keep:
            del self.g.initializers[name]
        self.g.verify()
        return self.g
