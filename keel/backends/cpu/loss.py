"""cpu kernels of the loss family, written once against ``ctx.xp``.

The log-softmax runs in the input's precision (float16 in float32); the
gathered per-element losses are small (one per target) and are weighted and
reduced in float64, so ``sum`` and ``mean`` do not drift with the target count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.cpu.kernels import TABLE
from keel.ops.registry import Op
from keel.ops.schemas.loss import (
    FLOAT_DTYPES,
    check_loss,
    check_reduction,
    check_targets,
)

__all__: list[str] = []



def _deliver(out: Out, i: int, value: Any) -> Any:
    """``value`` as output ``i``: written into the caller's buffer when one is given."""
    if out is not None and len(out) > i and out[i] is not None:
        out[i][...] = value
        return out[i]
    return value


def _nll(xp: Any, op: Op, logp: Any, target: Any, weight: Any, attrs: Attrs) -> Any:
    """The reduced loss in float64 from log-probabilities ``logp`` (N, C, ...)."""
    reduction = check_reduction(op, attrs["reduction"])
    ignore = attrs["ignore_index"]
    check_loss(op, logp.shape, target.shape, None if weight is None else weight.shape)
    check_targets(op, target, logp.shape[1], ignore)
    t = target.astype(xp.int64)
    counted = None if ignore is None else t != ignore
    safe = t if counted is None else xp.where(counted, t, 0)
    loss = -xp.take_along_axis(logp, safe[:, None], axis=1)[:, 0].astype(xp.float64)
    w = None if weight is None else weight.astype(xp.float64)[safe]
    if counted is not None:
        w = counted.astype(xp.float64) if w is None else xp.where(counted, w, 0.0)
    if weight is not None:
        loss = loss * w
    if counted is not None:
        loss = xp.where(counted, loss, 0.0)
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    count = float(loss.size) if w is None else w.sum()
    with np.errstate(invalid="ignore", divide="ignore"):   # nothing counted: NaN, as ONNX
        return total / count


def _weight(inputs: Inputs) -> Any:
    return inputs[2] if len(inputs) > 2 else None


def _compute_dtype(xp: Any, x: Any) -> Any:
    return xp.float64 if x.dtype == xp.float64 else xp.float32


@TABLE.kernel(Op.NEGATIVE_LOG_LIKELIHOOD_LOSS, dtypes=FLOAT_DTYPES, supports_out=True)
def negative_log_likelihood_loss(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                                 out: Out) -> list[Any]:
    """-input[n, target[n, d], d] * weight[target], reduced."""
    xp = ctx.xp
    x, target = inputs[0], inputs[1]
    loss = _nll(xp, Op.NEGATIVE_LOG_LIKELIHOOD_LOSS, x, target, _weight(inputs), attrs)
    return [_deliver(out, 0, xp.asarray(loss).astype(x.dtype))]


@TABLE.kernel(Op.SOFTMAX_CROSS_ENTROPY_LOSS, dtypes=FLOAT_DTYPES, supports_out=True)
def softmax_cross_entropy_loss(ctx: KernelContext, inputs: Inputs, attrs: Attrs,
                               out: Out) -> list[Any]:
    """NLL of log_softmax(scores, axis=1); also returns the log-probabilities."""
    xp = ctx.xp
    x, target = inputs[0], inputs[1]
    check_loss(Op.SOFTMAX_CROSS_ENTROPY_LOSS, x.shape, target.shape,
               None if _weight(inputs) is None else _weight(inputs).shape)
    logp = x.astype(_compute_dtype(xp, x))      # a fresh array: the steps below run in place
    if x.shape[1] and logp.size:
        logp -= logp.max(axis=1, keepdims=True)
        logp -= xp.log(xp.exp(logp).sum(axis=1, keepdims=True))
    loss = _nll(xp, Op.SOFTMAX_CROSS_ENTROPY_LOSS, logp, target, _weight(inputs), attrs)
    results = [_deliver(out, 0, xp.asarray(loss).astype(x.dtype)),
               _deliver(out, 1, logp if logp.dtype == x.dtype else logp.astype(x.dtype))]
    # As many results as output buffers given; both when none are.
    return results if out is None else results[:len(out)]
