"""One module per op family. :func:`keel.ops.schema.get_schema` imports the family of an
op when the op is first asked for (``FAMILY_OPS``), :func:`load_all` every family.

``FAMILY_OPS`` is written down from what importing each family registers:
:func:`measure` gives it anew in a fresh process, and ``tests/ops/test_schema_families.py``
checks that it is still what the families register.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["FAMILIES", "FAMILY_OPS", "load_all", "measure", "module_of"]

FAMILIES = (
    "attention", "control", "conv", "elementwise", "indexing", "loss", "matmul", "memory",
    "ml", "normalization", "numeric", "pooling", "quantization", "recurrent", "reduction",
    "resize", "shape", "signal", "stateful", "strings", "trees", "vision",
)

# The ops whose schemas each family registers (regenerate with :func:`measure`).
FAMILY_OPS: dict[str, tuple[str, ...]] = {
    "attention": ("onnx_attention", "rotary_embedding", "swiglu", "tensor_scatter"),
    "control": (
        "concat_from_sequence", "if", "loop", "optional", "optional_get_element",
        "optional_has_element", "scan", "sequence_at", "sequence_construct", "sequence_empty",
        "sequence_erase", "sequence_insert", "sequence_length", "sequence_map",
        "split_to_sequence",
    ),
    "conv": ("conv", "conv2d", "conv_integer", "conv_transpose"),
    "elementwise": (
        "abs", "acos", "acosh", "add", "add_n", "and", "asin", "asinh", "atan", "atanh",
        "bit_shift", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "ceil", "celu",
        "clip", "cos", "cosh", "div", "elu", "equal", "erf", "exp", "floor", "gelu", "greater",
        "greater_equal", "hard_sigmoid", "hard_swish", "isinf", "isnan", "leaky_relu", "less",
        "less_equal", "log", "maximum", "minimum", "mish", "mod", "mul", "neg", "not", "or",
        "pow", "prelu", "reciprocal", "relu", "round", "selu", "shrink", "sigmoid", "sign",
        "sin", "sinh", "softplus", "softsign", "sqrt", "sub", "swish", "tan", "tanh",
        "thresholded_relu", "where", "xor",
    ),
    "indexing": (
        "compress", "gather", "gather_elements", "gather_nd", "index", "nonzero", "one_hot",
        "reverse_sequence", "scatter_elements", "scatter_nd", "slice", "topk", "unique",
    ),
    "loss": ("negative_log_likelihood_loss", "softmax_cross_entropy_loss"),
    "matmul": ("attention", "dot", "einsum", "gemm", "matmul", "matmul_integer"),
    "memory": ("cast", "copy", "fill", "identity"),
    "ml": (
        "array_feature_extractor", "binarizer", "imputer", "label_encoder",
        "linear_classifier", "linear_regressor", "normalizer", "one_hot_encoder", "scaler",
        "svm_classifier", "svm_regressor",
    ),
    "normalization": (
        "batch_norm", "group_norm", "hardmax", "instance_norm", "layer_norm", "log_softmax",
        "lp_normalization", "lrn", "mean_variance_norm", "rms_norm", "skip_layer_norm",
        "softmax",
    ),
    "numeric": ("bitcast", "det"),
    "pooling": ("avg_pool", "global_avg_pool", "global_max_pool", "lp_pool", "max_pool"),
    "quantization": (
        "dequantize_linear", "dynamic_quantize_linear", "qgemm", "qlinear_add",
        "qlinear_conv", "qlinear_global_avg_pool", "qlinear_matmul", "quantize_linear",
    ),
    "recurrent": ("gru", "lstm", "rnn"),
    "reduction": (
        "argmax", "argmin", "cumprod", "cumsum", "mean", "mean_all", "reduce_l1", "reduce_l2",
        "reduce_log_sum", "reduce_log_sum_exp", "reduce_max", "reduce_min", "reduce_prod",
        "reduce_sum_square", "sum", "sum_all",
    ),
    "resize": ("resize",),
    "shape": (
        "concat", "constant_of_shape", "depth_to_space", "expand", "expand_dims", "eye_like",
        "flatten", "pad", "range", "reshape", "shape", "size", "space_to_depth", "split",
        "squeeze", "tile", "transpose", "trilu",
    ),
    "signal": (
        "blackman_window", "dft", "hamming_window", "hann_window", "mel_weight_matrix", "stft",
    ),
    "stateful": ("causal_conv_with_state", "linear_attention"),
    "strings": (
        "regex_full_match", "string_concat", "string_normalizer", "string_split",
        "tfidf_vectorizer",
    ),
    "trees": ("tree_ensemble", "tree_ensemble_classifier"),
    "vision": (
        "affine_grid", "center_crop_pad", "col2im", "deform_conv", "grid_sample", "max_unpool",
        "non_max_suppression", "roi_align",
    ),
}


def load_all() -> None:
    """Import every family (each registers its schemas)."""
    for family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}")


def module_of(op_value: str) -> str | None:
    """The module that registers the schema of the op named ``op_value`` (None: unknown)."""
    if not _OWNER:
        _OWNER.update((op, family) for family, ops in FAMILY_OPS.items() for op in ops)
    family = _OWNER.get(op_value)
    return None if family is None else f"{__name__}.{family}"


def measure() -> dict[str, list[str]]:
    """Import every family and note the ops whose schemas each module registers (the
    module that calls ``register_schema``); run in a fresh process, before any family
    is imported."""
    from keel.ops import schema

    if any(f"{__name__}.{family}" in sys.modules for family in FAMILIES):
        raise RuntimeError("schema families are imported already: measure in a fresh process")
    found: dict[str, list[str]] = {family: [] for family in FAMILIES}
    register = schema.register_schema

    def noting(entry: schema.OpSchema) -> schema.OpSchema:
        caller = sys._getframe(1)
        while not caller.f_globals.get("__name__", "").startswith(f"{__name__}."):
            caller = caller.f_back  # type: ignore[assignment]
        found[caller.f_globals["__name__"].rsplit(".", 1)[1]].append(entry.op.value)
        return register(entry)

    schema.register_schema = noting  # type: ignore[assignment]
    try:
        load_all()
    finally:
        schema.register_schema = register
    return {family: sorted(ops) for family, ops in found.items()}


_OWNER: dict[str, str] = {}
