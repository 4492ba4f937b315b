"""cpu kernels of the classical machine-learning family (ONNX's ai.onnx.ml domain).

These ops are whole-array NumPy already in the reference backend (linear models and
SVMs are one matrix product, float64 accumulation; the preprocessing ops one
elementwise pass or a table lookup), so the cpu backend registers those same kernels,
host-only: strings and object arrays have no device form. The tree ensembles have a
faster walk of their own in :mod:`keel.backends.cpu.trees`.
"""

from __future__ import annotations

from keel.backends.cpu.kernels import TABLE
from keel.backends.reference import kernels as reference
from keel.ops.registry import Op

__all__: list[str] = []

SHARED = (
    Op.SCALER, Op.NORMALIZER, Op.IMPUTER, Op.BINARIZER, Op.ONE_HOT_ENCODER,
    Op.ARRAY_FEATURE_EXTRACTOR, Op.LABEL_ENCODER, Op.LINEAR_CLASSIFIER, Op.LINEAR_REGRESSOR,
    Op.SVM_CLASSIFIER, Op.SVM_REGRESSOR,
)

for _op in SHARED:
    _variant = reference.load().get(_op)
    TABLE.kernel(_op, dtypes=_variant.dtypes, host_only=True,
                 description=_variant.description)(_variant.fn)
