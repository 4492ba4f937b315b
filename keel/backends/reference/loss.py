"""Reference kernels of the loss family: readable NumPy in float64.

The per-element loss is ``-logp[n, target[n, d], d] * weight[target[n, d]]``
with weight 0 where the target is ``ignore_index``; ``mean`` divides the sum
by the sum of those weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.reference.kernels import TABLE
from keel.ops.registry import Op
from keel.ops.schemas.loss import (
    FLOAT_DTYPES,
    check_loss,
    check_reduction,
    check_targets,
)

__all__: list[str] = []



def _nll(op: Op, logp: np.ndarray, target: np.ndarray, weight: np.ndarray | None,
         attrs: Attrs) -> np.ndarray:
    """The reduced negative log-likelihood of float64 log-probabilities ``logp``."""
    reduction = check_reduction(op, attrs["reduction"])
    ignore = attrs["ignore_index"]
    check_loss(op, logp.shape, target.shape, None if weight is None else weight.shape)
    check_targets(op, target, logp.shape[1], ignore)
    t = target.astype(np.int64)
    counted = np.ones(t.shape, dtype=bool) if ignore is None else t != ignore
    safe = np.where(counted, t, 0)
    picked = np.take_along_axis(logp, safe[:, None], axis=1)[:, 0]
    w = np.ones(t.shape) if weight is None else weight.astype(np.float64)[safe]
    w = np.where(counted, w, 0.0)
    loss = np.where(counted, -picked * w, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return np.asarray(loss.sum())
    with np.errstate(invalid="ignore", divide="ignore"):   # nothing counted: NaN, as ONNX
        return np.asarray(loss.sum() / w.sum())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=1, keepdims=True, initial=-np.inf)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _weight(inputs: Inputs) -> np.ndarray | None:
    return inputs[2] if len(inputs) > 2 else None


@TABLE.kernel(Op.NEGATIVE_LOG_LIKELIHOOD_LOSS, dtypes=FLOAT_DTYPES)
def negative_log_likelihood_loss(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                                 out: Out) -> list[Any]:
    """-input[n, target[n, d], d] * weight[target], reduced."""
    x, target = inputs[0], inputs[1]
    loss = _nll(Op.NEGATIVE_LOG_LIKELIHOOD_LOSS, x.astype(np.float64), target,
                _weight(inputs), attrs)
    return [loss.astype(x.dtype)]


@TABLE.kernel(Op.SOFTMAX_CROSS_ENTROPY_LOSS, dtypes=FLOAT_DTYPES)
def softmax_cross_entropy_loss(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                               out: Out) -> list[Any]:
    """NLL of log_softmax(scores, axis=1); also returns the log-probabilities."""
    x, target = inputs[0], inputs[1]
    if x.ndim < 2:
        check_loss(Op.SOFTMAX_CROSS_ENTROPY_LOSS, x.shape, target.shape, None)
    logp = _log_softmax(x.astype(np.float64))
    loss = _nll(Op.SOFTMAX_CROSS_ENTROPY_LOSS, logp, target, _weight(inputs), attrs)
    return [loss.astype(x.dtype), logp.astype(x.dtype)]
