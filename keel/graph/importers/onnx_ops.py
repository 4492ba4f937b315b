"""ONNX op converters, one per (op_type, since_version).

Every converter produces keel's form of the op, which is the op's form in the
newest ONNX opset: parameters that newer opsets pass as inputs (Squeeze axes,
Slice starts, Pad pads, Clip bounds, TopK k, Resize scales, ReduceX axes, ...)
become constant inputs when an older model gives them as attributes. Ops
without a keel counterpart of their own are expressed with ops keel has
(Sum of three or more → one variadic ADD_N, Upsample → Resize, Softmax before
opset 13 → Flatten, Softmax, Reshape).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.graph.importers.onnx_context import ConverterTable, ImportContext, OnnxNode
from keel.ops.registry import Op

__all__ = ["DIRECT", "TABLE"]

TABLE = ConverterTable()

# ONNX op_type → (keel op, since_version): ops whose inputs, outputs and
# attributes carry over unchanged, in every version from ``since`` on.
DIRECT: dict[str, tuple[Op, int]] = {
    # elementwise, unary
    "Relu": (Op.RELU, 1), "Neg": (Op.NEG, 1), "Abs": (Op.ABS, 1), "Exp": (Op.EXP, 1),
    "Log": (Op.LOG, 1), "Sqrt": (Op.SQRT, 1), "Tanh": (Op.TANH, 1),
    "Sigmoid": (Op.SIGMOID, 1), "Reciprocal": (Op.RECIPROCAL, 1), "Floor": (Op.FLOOR, 1),
    "Ceil": (Op.CEIL, 1), "Round": (Op.ROUND, 11), "Sign": (Op.SIGN, 9), "Sin": (Op.SIN, 7),
    "Cos": (Op.COS, 7), "Tan": (Op.TAN, 7), "Asin": (Op.ASIN, 7), "Acos": (Op.ACOS, 7),
    "Atan": (Op.ATAN, 7), "Sinh": (Op.SINH, 9), "Cosh": (Op.COSH, 9), "Asinh": (Op.ASINH, 9),
    "Acosh": (Op.ACOSH, 9), "Atanh": (Op.ATANH, 9), "Erf": (Op.ERF, 9), "Not": (Op.NOT, 1),
    "BitwiseNot": (Op.BITWISE_NOT, 18), "IsNaN": (Op.ISNAN, 9), "IsInf": (Op.ISINF, 10),
    "LeakyRelu": (Op.LEAKY_RELU, 6), "HardSigmoid": (Op.HARD_SIGMOID, 6),
    "HardSwish": (Op.HARD_SWISH, 14), "Gelu": (Op.GELU, 20), "Elu": (Op.ELU, 6),
    "Selu": (Op.SELU, 6), "Celu": (Op.CELU, 12), "Softplus": (Op.SOFTPLUS, 1),
    "Softsign": (Op.SOFTSIGN, 1), "ThresholdedRelu": (Op.THRESHOLDED_RELU, 10),
    "Shrink": (Op.SHRINK, 9), "Mish": (Op.MISH, 18), "Swish": (Op.SWISH, 24),
    # elementwise, binary and ternary
    "Add": (Op.ADD, 7), "Sub": (Op.SUB, 7), "Mul": (Op.MUL, 7), "Div": (Op.DIV, 7),
    "Pow": (Op.POW, 7), "Mod": (Op.MOD, 10), "Equal": (Op.EQUAL, 7), "Less": (Op.LESS, 7),
    "LessOrEqual": (Op.LESS_EQUAL, 12), "Greater": (Op.GREATER, 7),
    "GreaterOrEqual": (Op.GREATER_EQUAL, 12), "And": (Op.AND, 7), "Or": (Op.OR, 7),
    "Xor": (Op.XOR, 7), "BitwiseAnd": (Op.BITWISE_AND, 18),
    "BitwiseOr": (Op.BITWISE_OR, 18), "BitwiseXor": (Op.BITWISE_XOR, 18),
    "BitShift": (Op.BIT_SHIFT, 11), "PRelu": (Op.PRELU, 7), "Where": (Op.WHERE, 9),
    # reductions and scans
    "ArgMax": (Op.ARGMAX, 1), "ArgMin": (Op.ARGMIN, 1), "CumSum": (Op.CUMSUM, 11),
    "CumProd": (Op.CUMPROD, 26),
    # matmul-like and convolution
    "MatMul": (Op.MATMUL, 1), "Gemm": (Op.GEMM, 7), "Einsum": (Op.EINSUM, 12),
    "MatMulInteger": (Op.MATMUL_INTEGER, 10), "Conv": (Op.CONV, 1),
    "ConvTranspose": (Op.CONV_TRANSPOSE, 1), "ConvInteger": (Op.CONV_INTEGER, 10),
    # pooling and normalization
    "MaxPool": (Op.MAX_POOL, 1), "AveragePool": (Op.AVG_POOL, 1), "LpPool": (Op.LP_POOL, 2),
    "GlobalAveragePool": (Op.GLOBAL_AVG_POOL, 1), "GlobalMaxPool": (Op.GLOBAL_MAX_POOL, 1),
    "LayerNormalization": (Op.LAYER_NORM, 17), "InstanceNormalization": (Op.INSTANCE_NORM, 6),
    "RMSNormalization": (Op.RMS_NORM, 23), "LRN": (Op.LRN, 1),
    "LpNormalization": (Op.LP_NORMALIZATION, 1),
    "MeanVarianceNormalization": (Op.MEAN_VARIANCE_NORM, 9),
    # shape
    "Reshape": (Op.RESHAPE, 5), "Transpose": (Op.TRANSPOSE, 1), "Flatten": (Op.FLATTEN, 1),
    "Expand": (Op.EXPAND, 8), "Shape": (Op.SHAPE, 1), "Size": (Op.SIZE, 1),
    "Concat": (Op.CONCAT, 4), "Tile": (Op.TILE, 6), "DepthToSpace": (Op.DEPTH_TO_SPACE, 1),
    "SpaceToDepth": (Op.SPACE_TO_DEPTH, 1), "ConstantOfShape": (Op.CONSTANT_OF_SHAPE, 9),
    "Range": (Op.RANGE, 11), "EyeLike": (Op.EYE_LIKE, 9), "Trilu": (Op.TRILU, 14),
    # indexing
    "Gather": (Op.GATHER, 1), "GatherElements": (Op.GATHER_ELEMENTS, 11),
    "GatherND": (Op.GATHER_ND, 11), "ScatterElements": (Op.SCATTER_ELEMENTS, 11),
    "Scatter": (Op.SCATTER_ELEMENTS, 9), "ScatterND": (Op.SCATTER_ND, 11),
    "NonZero": (Op.NONZERO, 9), "OneHot": (Op.ONE_HOT, 9), "Compress": (Op.COMPRESS, 9),
    "ReverseSequence": (Op.REVERSE_SEQUENCE, 10), "Unique": (Op.UNIQUE, 11),
    # memory
    "Identity": (Op.IDENTITY, 1),
    # quantization
    "QuantizeLinear": (Op.QUANTIZE_LINEAR, 10), "DequantizeLinear": (Op.DEQUANTIZE_LINEAR, 10),
    "DynamicQuantizeLinear": (Op.DYNAMIC_QUANTIZE_LINEAR, 11),
    "QLinearMatMul": (Op.QLINEAR_MATMUL, 10), "QLinearConv": (Op.QLINEAR_CONV, 10),
}


def _direct(op: Op) -> Any:
    def convert(ctx: ImportContext, n: OnnxNode) -> None:
        ctx.emit(op, n.inputs, n.outputs, n.attrs)
    return convert


for _op_type, (_op, _since) in DIRECT.items():
    TABLE.register(_op_type, _since, _direct(_op))


def _ints(ctx: ImportContext, values: Sequence[int], hint: str) -> str:
    return ctx.constant(np.asarray(list(values), dtype=np.int64), hint)


def _like(ctx: ImportContext, name: str, value: float | Sequence[float] | np.ndarray,
          hint: str) -> str:
    """A constant with ``name``'s dtype (float32 when that is not known)."""
    dtype = ctx.dtype_of(name) or DType.FLOAT32
    return ctx.constant(np.asarray(value, dtype=dtype.numpy), hint)


def _without(attrs: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if k not in keys}


# ---- constants --------------------------------------------------------------------------
@TABLE.converts("Constant", since=1)
def _constant(ctx: ImportContext, n: OnnxNode) -> None:
    if len(n.attrs) != 1 or len(n.outputs) != 1:
        raise ctx.invalid("a Constant needs exactly one value attribute and one output")
    (key, value), = n.attrs.items()
    kinds = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
             "value_ints": np.int64}
    if key in ("value", "sparse_value"):
        array = np.asarray(value)
    elif key in kinds:
        array = np.asarray(value, dtype=kinds[key])
    elif key in ("value_string", "value_strings"):
        array = np.asarray(value, dtype=object)
    else:
        raise ctx.invalid(f"unknown Constant attribute {key!r}")
    ctx.add_initializer(n.outputs[0], array)


# ---- variadic elementwise ---------------------------------------------------------------
def _chain(ctx: ImportContext, n: OnnxNode, op: Op, final: str) -> None:
    """A variadic op as one keel node when keel's op is variadic, else a chain of binary ones."""
    ins = [i for i in n.inputs if i]
    if not ins:
        raise ctx.invalid("needs at least one input")
    if len(ins) == 1:
        ctx.emit(Op.IDENTITY, ins, [final])
        return
    if _max_inputs(op) is None:
        ctx.emit(op, ins, [final])
        return
    acc = ins[0]
    for k, other in enumerate(ins[1:], start=2):
        out = final if k == len(ins) else ctx.fresh(f"{final}/partial{k}")
        ctx.emit(op, [acc, other], [out])
        acc = out


def _max_inputs(op: Op) -> int | None:
    from keel.ops.schema import get_schema

    return get_schema(op).max_inputs


def _add(ctx: ImportContext, n: OnnxNode, final: str) -> None:
    """Sum's inputs into ``final``: one Add for two, one variadic ``ADD_N`` for more, so
    that a wide fan-in stays one node (no partial sums to hold in the graph)."""
    ins = [i for i in n.inputs if i]
    _chain(ctx, n, Op.ADD if len(ins) <= 2 else Op.ADD_N, final)


@TABLE.converts("Sum", since=6)
def _sum(ctx: ImportContext, n: OnnxNode) -> None:
    _add(ctx, n, n.outputs[0])


@TABLE.converts("Max", since=6)
def _max(ctx: ImportContext, n: OnnxNode) -> None:
    _chain(ctx, n, Op.MAXIMUM, n.outputs[0])


@TABLE.converts("Min", since=6)
def _min(ctx: ImportContext, n: OnnxNode) -> None:
    _chain(ctx, n, Op.MINIMUM, n.outputs[0])


@TABLE.converts("Mean", since=6)
def _mean(ctx: ImportContext, n: OnnxNode) -> None:
    ins = [i for i in n.inputs if i]
    if len(ins) <= 1:
        _chain(ctx, n, Op.ADD, n.outputs[0])
        return
    total = ctx.fresh(f"{n.outputs[0]}/sum")
    _add(ctx, n, total)
    ctx.emit(Op.DIV, [total, _like(ctx, ins[0], float(len(ins)), "count")], n.outputs)


# ---- attribute → input migrations -------------------------------------------------------
@TABLE.converts("Clip", since=6)
def _clip_6(ctx: ImportContext, n: OnnxNode) -> None:
    lo = n.attrs.get("min")
    hi = n.attrs.get("max")
    lo_name = "" if lo is None else _like(ctx, n.inputs[0], lo, "min")
    hi_name = "" if hi is None else _like(ctx, n.inputs[0], hi, "max")
    ctx.emit(Op.CLIP, [n.inputs[0], lo_name, hi_name], n.outputs)


TABLE.register("Clip", 11, _direct(Op.CLIP))


@TABLE.converts("Squeeze", since=1)
def _squeeze_1(ctx: ImportContext, n: OnnxNode) -> None:
    axes = n.attrs.get("axes")
    extra = [] if axes is None else [_ints(ctx, axes, "axes")]
    ctx.emit(Op.SQUEEZE, [n.inputs[0], *extra], n.outputs)


@TABLE.converts("Unsqueeze", since=1)
def _unsqueeze_1(ctx: ImportContext, n: OnnxNode) -> None:
    axes = n.attrs.get("axes")
    if axes is None:
        raise ctx.invalid("Unsqueeze before opset 13 needs the 'axes' attribute")
    ctx.emit(Op.EXPAND_DIMS, [n.inputs[0], _ints(ctx, axes, "axes")], n.outputs)


TABLE.register("Squeeze", 13, _direct(Op.SQUEEZE))
TABLE.register("Unsqueeze", 13, _direct(Op.EXPAND_DIMS))

# ReduceX: keel op, and the opset from which ONNX passes axes as an input.
REDUCTIONS: dict[str, tuple[Op, int]] = {
    "ReduceSum": (Op.SUM, 13), "ReduceMean": (Op.MEAN, 18), "ReduceMax": (Op.REDUCE_MAX, 18),
    "ReduceMin": (Op.REDUCE_MIN, 18), "ReduceProd": (Op.REDUCE_PROD, 18),
    "ReduceL1": (Op.REDUCE_L1, 18), "ReduceL2": (Op.REDUCE_L2, 18),
    "ReduceLogSum": (Op.REDUCE_LOG_SUM, 18), "ReduceLogSumExp": (Op.REDUCE_LOG_SUM_EXP, 18),
    "ReduceSumSquare": (Op.REDUCE_SUM_SQUARE, 18),
}


def _reduce_attr_axes(op: Op) -> Any:
    def convert(ctx: ImportContext, n: OnnxNode) -> None:
        axes = n.attrs.get("axes")
        extra = [] if axes is None else [_ints(ctx, axes, "axes")]
        ctx.emit(op, [n.inputs[0], *extra], n.outputs, _without(n.attrs, "axes"))
    return convert


for _op_type, (_op, _since) in REDUCTIONS.items():
    TABLE.register(_op_type, 1, _reduce_attr_axes(_op))
    TABLE.register(_op_type, _since, _direct(_op))


@TABLE.converts("Split", since=2)
def _split_2(ctx: ImportContext, n: OnnxNode) -> None:
    split = n.attrs.get("split")
    extra = [] if split is None else [_ints(ctx, split, "split")]
    ctx.emit(Op.SPLIT, [n.inputs[0], *extra], n.outputs, _split_attrs(n, bool(extra)),
             implied=("num_outputs",))


@TABLE.converts("Split", since=13)
def _split_13(ctx: ImportContext, n: OnnxNode) -> None:
    ctx.emit(Op.SPLIT, n.inputs, n.outputs, _split_attrs(n, bool(n.input(1))),
             implied=("num_outputs",))


def _split_attrs(n: OnnxNode, has_sizes: bool) -> dict[str, Any]:
    # Without sizes the outputs split evenly; opset 18 says how many with num_outputs
    # (and forbids it next to sizes), older opsets by the number of outputs.
    attrs = _without(n.attrs, "split")
    if not has_sizes:
        attrs.setdefault("num_outputs", len(n.outputs))
    return attrs


@TABLE.converts("Slice", since=1)
def _slice_1(ctx: ImportContext, n: OnnxNode) -> None:
    starts, ends = n.attrs.get("starts"), n.attrs.get("ends")
    if starts is None or ends is None:
        raise ctx.invalid("Slice before opset 10 needs 'starts' and 'ends'")
    axes = n.attrs.get("axes")
    ins = [n.inputs[0], _ints(ctx, starts, "starts"), _ints(ctx, ends, "ends")]
    if axes is not None:
        ins.append(_ints(ctx, axes, "axes"))
    ctx.emit(Op.SLICE, ins, n.outputs)


TABLE.register("Slice", 10, _direct(Op.SLICE))


@TABLE.converts("Pad", since=2)
def _pad_2(ctx: ImportContext, n: OnnxNode) -> None:
    pads = n.attrs.get("pads")
    if pads is None:
        raise ctx.invalid("Pad before opset 11 needs the 'pads' attribute")
    ins = [n.inputs[0], _ints(ctx, pads, "pads")]
    value = float(n.attrs.get("value", 0.0))
    if value != 0.0:
        ins.append(_like(ctx, n.inputs[0], value, "value"))
    ctx.emit(Op.PAD, ins, n.outputs, _without(n.attrs, "pads", "value"))


TABLE.register("Pad", 11, _direct(Op.PAD))


@TABLE.converts("TopK", since=1)
def _topk_1(ctx: ImportContext, n: OnnxNode) -> None:
    k = n.attrs.get("k")
    if k is None:
        raise ctx.invalid("TopK before opset 10 needs the 'k' attribute")
    ctx.emit(Op.TOPK, [n.inputs[0], _ints(ctx, [k], "k")], n.outputs, _without(n.attrs, "k"))


TABLE.register("TopK", 10, _direct(Op.TOPK))


# ---- Resize and Upsample ----------------------------------------------------------------
def _resize_like_upsample(ctx: ImportContext, n: OnnxNode, scales: str) -> None:
    """Upsample and Resize-10 are Resize with asymmetric coordinates and floor rounding."""
    mode = str(n.attrs.get("mode", "nearest")).lower()
    mode = {"bilinear": "linear", "trilinear": "linear"}.get(mode, mode)
    if mode not in ("nearest", "linear"):
        raise ctx.invalid(f"mode {mode!r} is not one of nearest, linear")
    attrs = {"mode": mode, "coordinate_transformation_mode": "asymmetric",
             "nearest_mode": "floor"}
    ctx.emit(Op.RESIZE, [n.inputs[0], "", scales], n.outputs, attrs)


@TABLE.converts("Upsample", since=7)
def _upsample_7(ctx: ImportContext, n: OnnxNode) -> None:
    scales = n.attrs.get("scales")
    if scales is None:
        raise ctx.invalid("Upsample-7 needs the 'scales' attribute")
    name = ctx.constant(np.asarray(scales, dtype=np.float32), "scales")
    _resize_like_upsample(ctx, n, name)


@TABLE.converts("Upsample", since=9)
def _upsample_9(ctx: ImportContext, n: OnnxNode) -> None:
    _resize_like_upsample(ctx, n, n.input(1))


@TABLE.converts("Resize", since=10)
def _resize_10(ctx: ImportContext, n: OnnxNode) -> None:
    _resize_like_upsample(ctx, n, n.input(1))


@TABLE.converts("Resize", since=11)
def _resize_11(ctx: ImportContext, n: OnnxNode) -> None:
    # Opset 11 requires roi and scales even when unused (as empty tensors); keel's
    # form leaves an unused optional input absent.
    ins = list(n.inputs)
    for k in (1, 2, 3):
        value = ctx.const(n.input(k))
        if value is not None and value.size == 0:
            ins[k] = ""
    ctx.emit(Op.RESIZE, ins, n.outputs, n.attrs)


# ---- softmax family ---------------------------------------------------------------------
SOFTMAXES = {"Softmax": Op.SOFTMAX, "LogSoftmax": Op.LOG_SOFTMAX, "Hardmax": Op.HARDMAX}


def _softmax_old(op: Op) -> Any:
    """Before opset 13 the input is flattened to 2-D at ``axis`` (default 1) first."""
    def convert(ctx: ImportContext, n: OnnxNode) -> None:
        axis = int(n.attrs.get("axis", 1))
        rank = ctx.rank_of(n.inputs[0])
        if rank is not None and axis in (-1, rank - 1):
            ctx.emit(op, n.inputs[:1], n.outputs, {"axis": -1})
            return
        flat = ctx.fresh(f"{n.outputs[0]}/flat")
        soft = ctx.fresh(f"{n.outputs[0]}/2d")
        shape = ctx.fresh(f"{n.outputs[0]}/shape")
        ctx.emit(Op.FLATTEN, n.inputs[:1], [flat], {"axis": axis})
        ctx.emit(op, [flat], [soft], {"axis": 1})
        ctx.emit(Op.SHAPE, n.inputs[:1], [shape])
        ctx.emit(Op.RESHAPE, [soft, shape], n.outputs)
    return convert


for _op_type, _op in SOFTMAXES.items():
    TABLE.register(_op_type, 1, _softmax_old(_op))
    TABLE.register(_op_type, 13, _direct(_op))


# ---- memory and types -------------------------------------------------------------------
@TABLE.converts("Cast", since=6)
def _cast(ctx: ImportContext, n: OnnxNode) -> None:
    if "to" not in n.attrs:
        raise ctx.invalid("Cast needs the 'to' attribute")
    ctx.emit(Op.CAST, n.inputs[:1], n.outputs, n.attrs)


@TABLE.converts("CastLike", since=15)
def _cast_like(ctx: ImportContext, n: OnnxNode) -> None:
    dtype = ctx.dtype_of(n.input(1))
    if dtype is None:
        raise ctx.unsupported("the element type of the target input is not known at import")
    ctx.emit(Op.CAST, n.inputs[:1], n.outputs, {**n.attrs, "to": dtype})


@TABLE.converts("Dropout", since=7)
def _dropout_7(ctx: ImportContext, n: OnnxNode) -> None:
    _dropout(ctx, n, mask_dtype=ctx.dtype_of(n.inputs[0]) if ctx.opset < 10 else DType.BOOL)


@TABLE.converts("Dropout", since=12)
def _dropout_12(ctx: ImportContext, n: OnnxNode) -> None:
    training = n.input(2)
    if training:
        value = ctx.const(training)
        if value is None:
            raise ctx.unsupported("training_mode is not a constant; keel runs inference only")
        if value.size and bool(np.asarray(value).reshape(-1)[0]):
            raise ctx.unsupported("training_mode is true; keel runs inference only")
    _dropout(ctx, n, mask_dtype=DType.BOOL)


def _dropout(ctx: ImportContext, n: OnnxNode, mask_dtype: DType | None) -> None:
    """Inference-time Dropout is the identity; its optional mask is all ones."""
    ctx.emit(Op.IDENTITY, n.inputs[:1], n.outputs[:1])
    mask = n.output(1)
    if mask:
        shape = ctx.fresh(f"{mask}/shape")
        ctx.emit(Op.SHAPE, n.inputs[:1], [shape])
        one = np.ones(1, dtype=(mask_dtype or DType.FLOAT32).numpy)
        ctx.emit(Op.CONSTANT_OF_SHAPE, [shape], [mask], {"value": one})


# ---- normalization ----------------------------------------------------------------------
@TABLE.converts("BatchNormalization", since=7)
def _batch_norm(ctx: ImportContext, n: OnnxNode) -> None:
    if int(n.attrs.get("training_mode", 0)):
        raise ctx.unsupported("training_mode=1; keel runs inference only")
    if any(n.outputs[1:]):
        raise ctx.unsupported("running-statistics outputs exist only in training mode")
    if int(n.attrs.get("spatial", 1)) == 0:
        _batch_norm_per_activation(ctx, n)
        return
    attrs = _without(n.attrs, "spatial", "training_mode", "momentum")
    ctx.emit(Op.BATCH_NORM, n.inputs, n.outputs[:1], attrs)


def _batch_norm_per_activation(ctx: ImportContext, n: OnnxNode) -> None:
    """``spatial=0`` (opset < 9): statistics per activation, an elementwise affine map."""
    params = [ctx.const(n.input(k)) for k in range(1, 5)]
    if any(p is None for p in params):
        raise ctx.unsupported("spatial=0 needs constant scale, bias, mean and variance")
    scale, bias, mean, var = (np.asarray(p, dtype=np.float64) for p in params)
    a = scale / np.sqrt(var + float(n.attrs.get("epsilon", 1e-5)))
    b = bias - mean * a
    scaled = ctx.fresh(f"{n.outputs[0]}/scaled")
    ctx.emit(Op.MUL, [n.inputs[0], _like(ctx, n.inputs[0], a, "a")], [scaled])
    ctx.emit(Op.ADD, [scaled, _like(ctx, n.inputs[0], b, "b")], n.outputs[:1])


@TABLE.converts("GroupNormalization", since=18)
def _group_norm_18(ctx: ImportContext, n: OnnxNode) -> None:
    """Opset 18 gives scale and bias per group; opset 21 (keel's form) per channel."""
    groups = int(n.attrs.get("num_groups", 0))
    t = ctx.type_of(n.inputs[0])
    channels = t.shape[1] if t is not None and t.shape is not None and len(t.shape) > 1 else None
    scale, bias = ctx.const(n.input(1)), ctx.const(n.input(2))
    if scale is None or bias is None or not isinstance(channels, int) or groups <= 0 \
            or channels % groups:
        raise ctx.unsupported("opset-18 GroupNormalization needs constant per-group scale and "
                              "bias and a known channel count divisible by num_groups")
    reps = channels // groups
    ins = [n.inputs[0], ctx.constant(np.repeat(scale, reps), "scale"),
           ctx.constant(np.repeat(bias, reps), "bias")]
    ctx.emit(Op.GROUP_NORM, ins, n.outputs, n.attrs)


TABLE.register("GroupNormalization", 21, _direct(Op.GROUP_NORM))


# ---- attention --------------------------------------------------------------------------
@TABLE.converts("Attention", since=23)
def _attention(ctx: ImportContext, n: OnnxNode) -> None:
    """ONNX Attention in the form keel's ATTENTION covers: 4-D Q/K/V, optional mask."""
    if any(n.inputs[4:]) or any(n.outputs[1:]):
        raise ctx.unsupported("past key/value caches and extra outputs are not supported")
    checked = ("qk_matmul_output_mode", "q_num_heads", "kv_num_heads")
    for key in checked:
        if int(n.attrs.get(key, 0)):
            raise ctx.unsupported(f"attribute {key}={n.attrs[key]} is not supported")
    if float(n.attrs.get("softcap", 0.0)) != 0.0:
        raise ctx.unsupported("softcap is not supported")
    ranks = [ctx.rank_of(n.input(k)) for k in range(3)]
    if ranks != [4, 4, 4]:
        raise ctx.unsupported(f"needs 4-D Q, K and V with known ranks, got ranks {ranks}")
    heads = [ctx.type_of(n.input(k)).shape[1] for k in range(3)]  # type: ignore[union-attr,index]
    if heads[0] != heads[1] or heads[1] != heads[2]:
        raise ctx.unsupported(f"grouped-query attention (heads {heads}) is not supported")
    mask = n.input(3)
    if mask and ctx.dtype_of(mask) is DType.BOOL:
        mask = _additive_mask(ctx, mask, n.inputs[0])
    # softmax_precision only asks for at least the input's precision; keel's
    # kernels accumulate in float32 or wider anyway.
    attrs = _without(n.attrs, *checked, "softcap", "softmax_precision")
    ctx.emit(Op.ATTENTION, [*n.inputs[:3], mask], n.outputs[:1], attrs)


def _additive_mask(ctx: ImportContext, mask: str, q: str) -> str:
    """A boolean mask (True: attend) as the additive mask keel's ATTENTION takes."""
    out = ctx.fresh(f"{mask}/additive")
    zero, neg = _like(ctx, q, 0.0, "zero"), _like(ctx, q, -np.inf, "neg_inf")
    ctx.emit(Op.WHERE, [mask, zero, neg], [out])
    return out


# ---- pooling ------------------------------------------------------------------------------
@TABLE.converts("GlobalLpPool", since=2)
def _global_lp_pool(ctx: ImportContext, n: OnnxNode) -> None:
    """``(sum |x|^p)^(1/p)`` over the spatial axes: ReduceL1/ReduceL2, or the general form."""
    rank = ctx.rank_of(n.inputs[0])
    if rank is None or rank < 3:
        raise ctx.unsupported("needs an input of known rank (at least 3)")
    p = int(n.attrs.get("p", 2))
    if p <= 0:
        raise ctx.invalid(f"p must be positive, got {p}")
    axes = _ints(ctx, range(2, rank), "axes")
    if p in (1, 2):
        ctx.emit(Op.REDUCE_L1 if p == 1 else Op.REDUCE_L2, [n.inputs[0], axes], n.outputs)
        return
    absolute, powered, total = (ctx.fresh(f"{n.outputs[0]}/{s}") for s in ("abs", "pow", "sum"))
    ctx.emit(Op.ABS, n.inputs[:1], [absolute])
    ctx.emit(Op.POW, [absolute, _like(ctx, n.inputs[0], float(p), "p")], [powered])
    ctx.emit(Op.SUM, [powered, axes], [total])
    ctx.emit(Op.POW, [total, _like(ctx, n.inputs[0], 1.0 / p, "inv_p")], n.outputs)


from keel.graph.importers import onnx_ops_extra  # noqa: E402,F401
