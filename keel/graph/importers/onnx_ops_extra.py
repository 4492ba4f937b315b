"""ONNX op converters for the loss, attention, vision, signal, recurrent and numeric ops.

Imported at the end of :mod:`keel.graph.importers.onnx_ops`; registers into its
``TABLE``. Ops whose inputs, outputs and attributes carry over unchanged join
``DIRECT`` (so the exporter spells them back as the same ONNX op); the rest
have a converter of their own below.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.dtypes import DType
from keel.graph.importers.onnx_context import Converter, ImportContext, OnnxNode
from keel.graph.importers.onnx_ops import DIRECT, TABLE
from keel.ops.registry import Op

__all__ = ["EXTRA_DIRECT"]

# ONNX op_type → (keel op, since_version), as in ``onnx_ops.DIRECT``.
EXTRA_DIRECT: dict[str, tuple[Op, int]] = {
    "NegativeLogLikelihoodLoss": (Op.NEGATIVE_LOG_LIKELIHOOD_LOSS, 12),
    "SoftmaxCrossEntropyLoss": (Op.SOFTMAX_CROSS_ENTROPY_LOSS, 12),
    "RotaryEmbedding": (Op.ROTARY_EMBEDDING, 23),
    "SwiGLU": (Op.SWIGLU, 28),
    "TensorScatter": (Op.TENSOR_SCATTER, 24),
    "GridSample": (Op.GRID_SAMPLE, 20),
    "AffineGrid": (Op.AFFINE_GRID, 20),
    "RoiAlign": (Op.ROI_ALIGN, 16),
    "NonMaxSuppression": (Op.NON_MAX_SUPPRESSION, 10),
    "Col2Im": (Op.COL2IM, 18),
    "CenterCropPad": (Op.CENTER_CROP_PAD, 18),
    "MaxUnpool": (Op.MAX_UNPOOL, 9),
    "DeformConv": (Op.DEFORM_CONV, 19),
    "DFT": (Op.DFT, 20),
    "STFT": (Op.STFT, 17),
    "HannWindow": (Op.HANN_WINDOW, 17),
    "HammingWindow": (Op.HAMMING_WINDOW, 17),
    "BlackmanWindow": (Op.BLACKMAN_WINDOW, 17),
    "MelWeightMatrix": (Op.MEL_WEIGHT_MATRIX, 17),
    "RNN": (Op.RNN, 7),
    "GRU": (Op.GRU, 7),
    "LSTM": (Op.LSTM, 7),
    "BitCast": (Op.BITCAST, 26),
    "Det": (Op.DET, 11),
    "LinearAttention": (Op.LINEAR_ATTENTION, 27),
    "CausalConvWithState": (Op.CAUSAL_CONV_WITH_STATE, 27),
    "StringConcat": (Op.STRING_CONCAT, 20),
    "StringSplit": (Op.STRING_SPLIT, 20),
    "StringNormalizer": (Op.STRING_NORMALIZER, 10),
    "RegexFullMatch": (Op.REGEX_FULL_MATCH, 20),
    "TfIdfVectorizer": (Op.TFIDF_VECTORIZER, 9),
}


def _direct(op: Op) -> Any:
    def convert(ctx: ImportContext, n: OnnxNode) -> None:
        ctx.emit(op, n.inputs, n.outputs, n.attrs)
    return convert


for _op_type, (_op, _since) in EXTRA_DIRECT.items():
    TABLE.register(_op_type, _since, _direct(_op))
DIRECT.update(EXTRA_DIRECT)
# onnx_attention *is* ONNX Attention, attribute for attribute: listed here so the exporter
# writes it back as that op. Its converter (below) also chooses the fused form.
DIRECT["Attention"] = (Op.ONNX_ATTENTION, 23)


# ---- vision ---------------------------------------------------------------------------------
_GRID_SAMPLE_16_MODES = {"bilinear": "linear", "bicubic": "cubic", "nearest": "nearest"}


@TABLE.converts("GridSample", since=16)
def _grid_sample_16(ctx: ImportContext, n: OnnxNode) -> None:
    """GridSample-16 spells its modes bilinear and bicubic, and is 2-D only."""
    mode = str(n.attrs.get("mode", "bilinear"))
    if mode not in _GRID_SAMPLE_16_MODES:
        raise ctx.invalid(f"mode {mode!r} is not one of {', '.join(_GRID_SAMPLE_16_MODES)}")
    ctx.emit(Op.GRID_SAMPLE, n.inputs, n.outputs,
             {**n.attrs, "mode": _GRID_SAMPLE_16_MODES[mode]})


@TABLE.converts("RoiAlign", since=10)
def _roi_align_10(ctx: ImportContext, n: OnnxNode) -> None:
    """RoiAlign-10 has no coordinate_transformation_mode: it behaves as output_half_pixel."""
    ctx.emit(Op.ROI_ALIGN, n.inputs, n.outputs,
             {**n.attrs, "coordinate_transformation_mode": "output_half_pixel"})


# ---- signal ---------------------------------------------------------------------------------
@TABLE.converts("DFT", since=17)
def _dft_17(ctx: ImportContext, n: OnnxNode) -> None:
    """DFT-17 gives the axis as an attribute (default 1); DFT-20 (keel's form) as an input."""
    axis = ctx.constant(np.asarray(int(n.attrs.get("axis", 1)), dtype=np.int64), "axis")
    ctx.emit(Op.DFT, [n.input(0), n.input(1), axis], n.outputs,
             {k: v for k, v in n.attrs.items() if k != "axis"})


# ---- attention ----------------------------------------------------------------------------
# The converter onnx_ops registered first maps ONNX Attention to keel's fused ``attention``
# op and refuses what that op cannot express; it stays in charge of the nodes it fits.
_FUSED_ATTENTION: Converter | None = TABLE.lookup("Attention", 23)


def _attention(ctx: ImportContext, n: OnnxNode) -> None:
    """ONNX Attention as keel's fused ``attention`` when it fits, else ``onnx_attention``."""
    if _FUSED_ATTENTION is not None and _fits_fused_attention(ctx, n):
        _FUSED_ATTENTION(ctx, n)
    else:
        ctx.emit(Op.ONNX_ATTENTION, n.inputs, n.outputs, n.attrs)


def _fits_fused_attention(ctx: ImportContext, n: OnnxNode) -> bool:
    """4-D Q/K/V with equal head counts, Y only, no cache, cap, window or grouping, and
    no mask that could leave a query row with no key (ONNX gives zeros there; the fused
    op's softmax would give NaN)."""
    a = n.attrs
    if any(n.inputs[4:]) or any(n.outputs[1:]) or float(a.get("softcap", 0.0)) != 0.0:
        return False
    if a.get("q_num_heads") or a.get("kv_num_heads") or int(a.get("qk_matmul_output_mode", 0)):
        return False
    if int(a.get("left_window_size", -1)) != -1 or int(a.get("right_window_size", -1)) != -1:
        return False
    heads = set()
    for k in range(3):
        t = ctx.type_of(n.input(k))
        if t is None or t.shape is None or len(t.shape) != 4 or not isinstance(t.shape[1], int):
            return False
        heads.add(t.shape[1])
    if len(heads) != 1:
        return False
    return _mask_keeps_every_row(ctx, n.input(3), bool(a.get("is_causal", 0)))


def _mask_keeps_every_row(ctx: ImportContext, mask: str, causal: bool) -> bool:
    if not mask:
        return True
    value = ctx.const(mask)
    if causal or value is None or ctx.dtype_of(mask) is DType.BOOL or value.size == 0:
        return False
    return bool(np.all(np.isfinite(value).any(axis=-1) | (value > -np.inf).any(axis=-1)))


for _since in (23,):
    TABLE.register("Attention", _since, _attention, replace=True)
