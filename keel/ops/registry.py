"""The op set: an ``Op`` enum and named groups of ops.

Strings live at the edges (ONNX ``op_type``, ``run_op("add")``); they are
turned into ``Op`` once, with :func:`to_op`.
"""

from __future__ import annotations

import enum

from keel.errors import UnsupportedOperationError

__all__ = ["Op", "OpGroup", "op_group", "to_op"]


class Op(str, enum.Enum):
    """Every operation keel knows. The value is the public, snake_case name."""

    # seed 001: reductions
    SUM_ALL = "sum_all"
    MEAN_ALL = "mean_all"
    SUM = "sum"
    MEAN = "mean"
    # elementwise, binary
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    POW = "pow"
    MOD = "mod"
    MAXIMUM = "maximum"
    MINIMUM = "minimum"
    ADD_N = "add_n"
    EQUAL = "equal"
    LESS = "less"
    LESS_EQUAL = "less_equal"
    GREATER = "greater"
    GREATER_EQUAL = "greater_equal"
    AND = "and"
    OR = "or"
    XOR = "xor"
    BITWISE_AND = "bitwise_and"
    BITWISE_OR = "bitwise_or"
    BITWISE_XOR = "bitwise_xor"
    BIT_SHIFT = "bit_shift"
    PRELU = "prelu"
    # elementwise, unary
    RELU = "relu"
    NEG = "neg"
    ABS = "abs"
    EXP = "exp"
    LOG = "log"
    SQRT = "sqrt"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    RECIPROCAL = "reciprocal"
    FLOOR = "floor"
    CEIL = "ceil"
    ROUND = "round"
    SIGN = "sign"
    SIN = "sin"
    COS = "cos"
    TAN = "tan"
    ASIN = "asin"
    ACOS = "acos"
    ATAN = "atan"
    SINH = "sinh"
    COSH = "cosh"
    ASINH = "asinh"
    ACOSH = "acosh"
    ATANH = "atanh"
    ERF = "erf"
    NOT = "not"
    BITWISE_NOT = "bitwise_not"
    ISNAN = "isnan"
    ISINF = "isinf"
    CLIP = "clip"
    LEAKY_RELU = "leaky_relu"
    HARD_SIGMOID = "hard_sigmoid"
    HARD_SWISH = "hard_swish"
    GELU = "gelu"
    ELU = "elu"
    SELU = "selu"
    CELU = "celu"
    SOFTPLUS = "softplus"
    SOFTSIGN = "softsign"
    THRESHOLDED_RELU = "thresholded_relu"
    SHRINK = "shrink"
    MISH = "mish"
    SWISH = "swish"
    # ternary / selection
    WHERE = "where"
    # reductions along axes
    REDUCE_MAX = "reduce_max"
    REDUCE_MIN = "reduce_min"
    REDUCE_PROD = "reduce_prod"
    REDUCE_L1 = "reduce_l1"
    REDUCE_L2 = "reduce_l2"
    REDUCE_LOG_SUM = "reduce_log_sum"
    REDUCE_LOG_SUM_EXP = "reduce_log_sum_exp"
    REDUCE_SUM_SQUARE = "reduce_sum_square"
    ARGMAX = "argmax"
    ARGMIN = "argmin"
    CUMSUM = "cumsum"
    CUMPROD = "cumprod"
    # matmul-like
    MATMUL = "matmul"
    DOT = "dot"
    GEMM = "gemm"
    EINSUM = "einsum"
    MATMUL_INTEGER = "matmul_integer"
    ATTENTION = "attention"
    # convolution
    CONV2D = "conv2d"
    CONV = "conv"
    CONV_TRANSPOSE = "conv_transpose"
    CONV_INTEGER = "conv_integer"
    # pooling
    MAX_POOL = "max_pool"
    AVG_POOL = "avg_pool"
    LP_POOL = "lp_pool"
    GLOBAL_AVG_POOL = "global_avg_pool"
    GLOBAL_MAX_POOL = "global_max_pool"
    # normalization and softmax
    BATCH_NORM = "batch_norm"
    LAYER_NORM = "layer_norm"
    SKIP_LAYER_NORM = "skip_layer_norm"
    INSTANCE_NORM = "instance_norm"
    GROUP_NORM = "group_norm"
    RMS_NORM = "rms_norm"
    LRN = "lrn"
    LP_NORMALIZATION = "lp_normalization"
    MEAN_VARIANCE_NORM = "mean_variance_norm"
    SOFTMAX = "softmax"
    LOG_SOFTMAX = "log_softmax"
    HARDMAX = "hardmax"
    # shape
    RESHAPE = "reshape"
    EXPAND_DIMS = "expand_dims"
    SQUEEZE = "squeeze"
    TRANSPOSE = "transpose"
    FLATTEN = "flatten"
    EXPAND = "expand"
    SHAPE = "shape"
    SIZE = "size"
    CONCAT = "concat"
    SPLIT = "split"
    TILE = "tile"
    PAD = "pad"
    RESIZE = "resize"
    DEPTH_TO_SPACE = "depth_to_space"
    SPACE_TO_DEPTH = "space_to_depth"
    CONSTANT_OF_SHAPE = "constant_of_shape"
    RANGE = "range"
    EYE_LIKE = "eye_like"
    TRILU = "trilu"
    # indexing
    INDEX = "index"
    SLICE = "slice"
    GATHER = "gather"
    GATHER_ELEMENTS = "gather_elements"
    GATHER_ND = "gather_nd"
    SCATTER_ELEMENTS = "scatter_elements"
    SCATTER_ND = "scatter_nd"
    TOPK = "topk"
    NONZERO = "nonzero"
    ONE_HOT = "one_hot"
    COMPRESS = "compress"
    REVERSE_SEQUENCE = "reverse_sequence"
    UNIQUE = "unique"
    # memory and types
    COPY = "copy"
    FILL = "fill"
    CAST = "cast"
    IDENTITY = "identity"
    # quantization
    QUANTIZE_LINEAR = "quantize_linear"
    DEQUANTIZE_LINEAR = "dequantize_linear"
    DYNAMIC_QUANTIZE_LINEAR = "dynamic_quantize_linear"
    QLINEAR_MATMUL = "qlinear_matmul"
    QLINEAR_CONV = "qlinear_conv"
    QGEMM = "qgemm"
    QLINEAR_ADD = "qlinear_add"
    QLINEAR_GLOBAL_AVG_POOL = "qlinear_global_avg_pool"
    # losses
    NEGATIVE_LOG_LIKELIHOOD_LOSS = "negative_log_likelihood_loss"
    SOFTMAX_CROSS_ENTROPY_LOSS = "softmax_cross_entropy_loss"
    # attention and the transformer-block ops around it
    ONNX_ATTENTION = "onnx_attention"
    ROTARY_EMBEDDING = "rotary_embedding"
    SWIGLU = "swiglu"
    TENSOR_SCATTER = "tensor_scatter"
    # recurrent state carried across calls (linear-attention and state-space models)
    LINEAR_ATTENTION = "linear_attention"
    CAUSAL_CONV_WITH_STATE = "causal_conv_with_state"
    # vision
    GRID_SAMPLE = "grid_sample"
    AFFINE_GRID = "affine_grid"
    ROI_ALIGN = "roi_align"
    NON_MAX_SUPPRESSION = "non_max_suppression"
    COL2IM = "col2im"
    CENTER_CROP_PAD = "center_crop_pad"
    MAX_UNPOOL = "max_unpool"
    DEFORM_CONV = "deform_conv"
    # signal processing
    DFT = "dft"
    STFT = "stft"
    HANN_WINDOW = "hann_window"
    HAMMING_WINDOW = "hamming_window"
    BLACKMAN_WINDOW = "blackman_window"
    MEL_WEIGHT_MATRIX = "mel_weight_matrix"
    # recurrent
    RNN = "rnn"
    GRU = "gru"
    LSTM = "lstm"
    # numeric utilities
    BITCAST = "bitcast"
    DET = "det"
    # classical machine learning (ONNX's ai.onnx.ml domain)
    LINEAR_CLASSIFIER = "linear_classifier"
    LINEAR_REGRESSOR = "linear_regressor"
    SCALER = "scaler"
    NORMALIZER = "normalizer"
    IMPUTER = "imputer"
    BINARIZER = "binarizer"
    ONE_HOT_ENCODER = "one_hot_encoder"
    LABEL_ENCODER = "label_encoder"
    ARRAY_FEATURE_EXTRACTOR = "array_feature_extractor"
    TREE_ENSEMBLE = "tree_ensemble"
    TREE_ENSEMBLE_CLASSIFIER = "tree_ensemble_classifier"
    SVM_CLASSIFIER = "svm_classifier"
    SVM_REGRESSOR = "svm_regressor"
    # control flow: ops that run subgraphs
    IF = "if"
    LOOP = "loop"
    SCAN = "scan"
    SEQUENCE_MAP = "sequence_map"
    # sequences and optionals
    SEQUENCE_CONSTRUCT = "sequence_construct"
    SEQUENCE_EMPTY = "sequence_empty"
    SEQUENCE_INSERT = "sequence_insert"
    SEQUENCE_ERASE = "sequence_erase"
    SEQUENCE_AT = "sequence_at"
    SEQUENCE_LENGTH = "sequence_length"
    SPLIT_TO_SEQUENCE = "split_to_sequence"
    CONCAT_FROM_SEQUENCE = "concat_from_sequence"
    OPTIONAL = "optional"
    OPTIONAL_HAS_ELEMENT = "optional_has_element"
    OPTIONAL_GET_ELEMENT = "optional_get_element"
    # strings
    STRING_CONCAT = "string_concat"
    STRING_SPLIT = "string_split"
    STRING_NORMALIZER = "string_normalizer"
    REGEX_FULL_MATCH = "regex_full_match"
    TFIDF_VECTORIZER = "tfidf_vectorizer"


class OpGroup(frozenset[Op], enum.Enum):
    """Named sets of ops (``Op.ADD in OpGroup.ELEMENTWISE``)."""

    ELEMENTWISE_BINARY = frozenset({
        Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.POW, Op.MOD, Op.MAXIMUM, Op.MINIMUM,
        Op.EQUAL, Op.LESS, Op.LESS_EQUAL, Op.GREATER, Op.GREATER_EQUAL,
        Op.AND, Op.OR, Op.XOR, Op.BITWISE_AND, Op.BITWISE_OR, Op.BITWISE_XOR,
        Op.BIT_SHIFT, Op.PRELU,
    })
    ELEMENTWISE_UNARY = frozenset({
        Op.RELU, Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.TANH, Op.SIGMOID,
        Op.RECIPROCAL, Op.FLOOR, Op.CEIL, Op.ROUND, Op.SIGN, Op.SIN, Op.COS, Op.TAN,
        Op.ASIN, Op.ACOS, Op.ATAN, Op.SINH, Op.COSH, Op.ASINH, Op.ACOSH, Op.ATANH,
        Op.ERF, Op.NOT, Op.BITWISE_NOT, Op.ISNAN, Op.ISINF, Op.CLIP, Op.LEAKY_RELU,
        Op.HARD_SIGMOID, Op.HARD_SWISH, Op.GELU, Op.ELU, Op.SELU, Op.CELU,
        Op.SOFTPLUS, Op.SOFTSIGN, Op.THRESHOLDED_RELU, Op.SHRINK, Op.MISH, Op.SWISH,
    })
    ELEMENTWISE = ELEMENTWISE_BINARY | ELEMENTWISE_UNARY | frozenset({
        Op.WHERE, Op.ROTARY_EMBEDDING, Op.SWIGLU, Op.ADD_N,
    })
    REDUCTION = frozenset({
        Op.SUM_ALL, Op.MEAN_ALL, Op.SUM, Op.MEAN, Op.REDUCE_MAX, Op.REDUCE_MIN,
        Op.REDUCE_PROD, Op.REDUCE_L1, Op.REDUCE_L2, Op.REDUCE_LOG_SUM,
        Op.REDUCE_LOG_SUM_EXP, Op.REDUCE_SUM_SQUARE, Op.ARGMAX, Op.ARGMIN,
        Op.CUMSUM, Op.CUMPROD, Op.NEGATIVE_LOG_LIKELIHOOD_LOSS, Op.SOFTMAX_CROSS_ENTROPY_LOSS,
    })
    MATMUL_LIKE = frozenset({
        Op.MATMUL, Op.DOT, Op.GEMM, Op.EINSUM, Op.MATMUL_INTEGER, Op.ATTENTION,
        Op.QLINEAR_MATMUL, Op.ONNX_ATTENTION, Op.DET, Op.RNN, Op.GRU, Op.LSTM, Op.DFT, Op.STFT,
        Op.LINEAR_ATTENTION,
    })
    CONVOLUTION = frozenset({
        Op.CONV2D, Op.CONV, Op.CONV_TRANSPOSE, Op.CONV_INTEGER, Op.QLINEAR_CONV,
        Op.DEFORM_CONV, Op.COL2IM, Op.CAUSAL_CONV_WITH_STATE,
    })
    POOLING = frozenset({
        Op.MAX_POOL, Op.AVG_POOL, Op.LP_POOL, Op.GLOBAL_AVG_POOL, Op.GLOBAL_MAX_POOL,
        Op.ROI_ALIGN, Op.MAX_UNPOOL,
    })
    NORMALIZATION = frozenset({
        Op.BATCH_NORM, Op.LAYER_NORM, Op.SKIP_LAYER_NORM, Op.INSTANCE_NORM, Op.GROUP_NORM,
        Op.RMS_NORM, Op.LRN, Op.LP_NORMALIZATION, Op.MEAN_VARIANCE_NORM, Op.SOFTMAX,
        Op.LOG_SOFTMAX, Op.HARDMAX,
    })
    SHAPE = frozenset({
        Op.RESHAPE, Op.EXPAND_DIMS, Op.SQUEEZE, Op.TRANSPOSE, Op.FLATTEN, Op.EXPAND,
        Op.SHAPE, Op.SIZE, Op.CONCAT, Op.SPLIT, Op.TILE, Op.PAD, Op.RESIZE,
        Op.DEPTH_TO_SPACE, Op.SPACE_TO_DEPTH, Op.CONSTANT_OF_SHAPE, Op.RANGE,
        Op.EYE_LIKE, Op.TRILU, Op.GRID_SAMPLE, Op.AFFINE_GRID, Op.CENTER_CROP_PAD,
        Op.HANN_WINDOW, Op.HAMMING_WINDOW, Op.BLACKMAN_WINDOW, Op.MEL_WEIGHT_MATRIX,
    })
    INDEXING = frozenset({
        Op.INDEX, Op.SLICE, Op.GATHER, Op.GATHER_ELEMENTS, Op.GATHER_ND,
        Op.SCATTER_ELEMENTS, Op.SCATTER_ND, Op.TOPK, Op.NONZERO, Op.ONE_HOT,
        Op.COMPRESS, Op.REVERSE_SEQUENCE, Op.UNIQUE, Op.WHERE, Op.TENSOR_SCATTER,
        Op.NON_MAX_SUPPRESSION,
    })
    MEMORY = frozenset({Op.COPY, Op.FILL, Op.CAST, Op.IDENTITY, Op.BITCAST})
    QUANTIZATION = frozenset({
        Op.QUANTIZE_LINEAR, Op.DEQUANTIZE_LINEAR, Op.DYNAMIC_QUANTIZE_LINEAR,
        Op.QLINEAR_MATMUL, Op.QLINEAR_CONV, Op.MATMUL_INTEGER, Op.CONV_INTEGER, Op.QGEMM,
        Op.QLINEAR_ADD, Op.QLINEAR_GLOBAL_AVG_POOL,
    })
    # Classical machine learning: the ops of ONNX's ai.onnx.ml domain.
    CLASSICAL_ML = frozenset({
        Op.LINEAR_CLASSIFIER, Op.LINEAR_REGRESSOR, Op.SCALER, Op.NORMALIZER, Op.IMPUTER,
        Op.BINARIZER, Op.ONE_HOT_ENCODER, Op.LABEL_ENCODER, Op.ARRAY_FEATURE_EXTRACTOR,
        Op.TREE_ENSEMBLE, Op.TREE_ENSEMBLE_CLASSIFIER, Op.SVM_CLASSIFIER, Op.SVM_REGRESSOR,
    })
    # Ops that run subgraphs (node attributes holding a Graph).
    CONTROL_FLOW = frozenset({Op.IF, Op.LOOP, Op.SCAN, Op.SEQUENCE_MAP})
    # Ops on sequence and optional values.
    SEQUENCE = frozenset({
        Op.SEQUENCE_CONSTRUCT, Op.SEQUENCE_EMPTY, Op.SEQUENCE_INSERT, Op.SEQUENCE_ERASE,
        Op.SEQUENCE_AT, Op.SEQUENCE_LENGTH, Op.SPLIT_TO_SEQUENCE, Op.CONCAT_FROM_SEQUENCE,
        Op.OPTIONAL, Op.OPTIONAL_HAS_ELEMENT, Op.OPTIONAL_GET_ELEMENT,
    })
    # Text processing (ONNX's string ops and TfIdfVectorizer).
    STRING = frozenset({
        Op.STRING_CONCAT, Op.STRING_SPLIT, Op.STRING_NORMALIZER, Op.REGEX_FULL_MATCH,
        Op.TFIDF_VECTORIZER,
    })
    # Ops whose output shape depends on input *values*, not only input shapes.
    DATA_DEPENDENT = frozenset({Op.NONZERO, Op.UNIQUE, Op.COMPRESS, Op.NON_MAX_SUPPRESSION,
                                Op.STRING_SPLIT, Op.STRING_NORMALIZER})
    # The 19 ops of the GPU profile of seed 001.
    SEED_GPU_PROFILE = frozenset({
        Op.SUM_ALL, Op.MEAN_ALL, Op.SUM, Op.MEAN, Op.ADD, Op.MUL, Op.RELU, Op.MATMUL,
        Op.DOT, Op.CONV2D, Op.RESHAPE, Op.EXPAND_DIMS, Op.SQUEEZE, Op.TRANSPOSE,
        Op.INDEX, Op.SLICE, Op.GATHER, Op.COPY, Op.FILL,
    })


# Primary group of each op, for cost models and reports; first match wins.
_PRIMARY = (
    OpGroup.QUANTIZATION, OpGroup.CONVOLUTION, OpGroup.MATMUL_LIKE, OpGroup.POOLING,
    OpGroup.NORMALIZATION, OpGroup.REDUCTION, OpGroup.ELEMENTWISE, OpGroup.SHAPE,
    OpGroup.INDEXING, OpGroup.MEMORY, OpGroup.CLASSICAL_ML, OpGroup.CONTROL_FLOW,
    OpGroup.SEQUENCE, OpGroup.STRING,
)


def op_group(op: Op) -> OpGroup:
    """The primary group of ``op``."""
    for group in _PRIMARY:
        if op in group:
            return group
    raise AssertionError(f"op {op.value} belongs to no group")  # a keel bug, tested


def to_op(name: str | Op) -> Op:
    """Turn a user-facing name into an ``Op``; unknown names raise a typed error."""
    if isinstance(name, Op):
        return name
    try:
        return Op(str(name).strip().lower())
    except ValueError:
        raise UnsupportedOperationError(
            str(name), detail=f"unknown op; known ops: {', '.join(o.value for o in Op)}"
        ) from None
