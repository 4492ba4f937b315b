"""bfloat16 as a compute dtype of the NumPy backends (and of the kernels the gpu shares).

NumPy holds ``ml_dtypes.bfloat16`` arrays but computes little in them well: their
``dtype.kind`` is ``'V'``, ``np.finfo`` refuses them, and ml_dtypes' ufuncs round
after every step of a composite. So a kernel registered in a :class:`WideningTable`
that meets a bfloat16 input runs on its float32 widening (exact: a bfloat16 is the
top half of a float32), and the results the op's schema types as bfloat16 are
rounded back to nearest even. That is what ONNX runtimes do with bfloat16 math:
compute in float32, round on output. The arrays may be NumPy's or CuPy's (both
have ``astype`` and ``[...] =``).

The ops that take bfloat16 as it is (casts, bit casts, quantization, identity,
shape, size) and control flow (whose subgraphs are typed for their inputs) are
left as registered. A variant's ``bind`` serves float inputs only (a bfloat16
step runs through the kernel), and its ``prepack`` sees bfloat16 constants
widened, as the kernel sees them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keel.backends.base import Bind, Kernel, KernelContext, KernelTable, KernelVariant, Prepack
from keel.dtypes import DType
from keel.ops.registry import Op
from keel.ops.schema import get_schema
from keel.ops.types import TensorType

__all__ = ["BF16_NATIVE", "WideningTable", "widened"]

# Ops whose kernels take bfloat16 as it is: a widening would change what they mean
# (a bit cast, a subgraph typed for bfloat16) or only add copies.
BF16_NATIVE = frozenset({Op.CAST, Op.BITCAST, Op.QUANTIZE_LINEAR, Op.DEQUANTIZE_LINEAR,
                         Op.IDENTITY, Op.SHAPE, Op.SIZE, Op.IF, Op.LOOP, Op.SCAN,
                         Op.SEQUENCE_MAP})


def _is_bf16(x: Any) -> bool:
    # ml_dtypes' types have kind 'V': a float or integer array is told apart without
    # importing ml_dtypes (a run that meets no narrow value never does)
    dtype = getattr(x, "dtype", None)
    return dtype is not None and dtype.kind == "V" and dtype.name == "bfloat16"


def _widen(inputs: Sequence[Any]) -> list[Any]:
    return [x.astype(np.float32) if _is_bf16(x) else x for x in inputs]


def widened(op: Op, fn: Kernel) -> Kernel:
    """``fn`` that computes bfloat16 inputs in float32 and rounds its bfloat16 outputs."""

    def kernel(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
               out: Sequence[Any] | None) -> list[Any]:
        for x in inputs:
            if _is_bf16(x):
                break
        else:
            return list(fn(ctx, inputs, attrs, out))
        results = list(fn(ctx, _widen(inputs), attrs, None))
        if out is None:
            targets = _output_dtypes(op, inputs, attrs, len(results))
            return [r.astype(t) if hasattr(r, "astype") and r.dtype != t else r
                    for r, t in zip(results, targets, strict=True)]
        for dst, src in zip(out, results, strict=False):
            if dst is not None:
                dst[...] = src                   # rounds to nearest even into bfloat16
        return [src if dst is None else dst
                for dst, src in zip(out, results, strict=False)] + results[len(out):]

    kernel.__doc__ = fn.__doc__
    return kernel


def _output_dtypes(op: Op, inputs: Sequence[Any], attrs: Mapping[str, Any],
                   count: int) -> list[np.dtype[Any]]:
    """The dtypes the schema gives ``op``'s outputs for these inputs (bfloat16 where it
    cannot say: the result of bfloat16 math)."""
    types = [TensorType(DType.from_numpy(x.dtype), tuple(x.shape))
             if hasattr(x, "dtype") else None for x in inputs]
    values = [x if isinstance(x, np.ndarray) else None for x in inputs]
    inferred = list(get_schema(op).infer_types(types, attrs, values))
    inferred += [None] * (count - len(inferred))
    return [DType.BFLOAT16.numpy if t is None else t.dtype.numpy for t in inferred[:count]]


def _float_bind(bind: Bind) -> Bind:
    def float_only(ctx: KernelContext, inputs: Sequence[Any], attrs: Mapping[str, Any],
                   out: Sequence[Any]) -> Callable[[], object] | None:
        if any(_is_bf16(x) for x in (*inputs, *out)):
            return None
        return bind(ctx, inputs, attrs, out)
    return float_only


def _widened_prepack(prepack: Prepack) -> Prepack:
    def widening(ctx: KernelContext, const_inputs: Sequence[Any],
                 attrs: Mapping[str, Any]) -> Any:
        return prepack(ctx, _widen(const_inputs), attrs)
    return widening


class WideningTable(KernelTable):
    """A kernel table whose kernels (but those of :data:`BF16_NATIVE`) take bfloat16
    through :func:`widened`; a variant that lists float32 among its dtypes lists
    bfloat16 too."""

    def register(self, variant: KernelVariant) -> KernelVariant:
        dtypes = variant.dtypes
        if variant.op in BF16_NATIVE or (dtypes is not None and DType.BFLOAT16 not in dtypes
                                         and DType.FLOAT32 not in dtypes):
            return super().register(variant)
        if dtypes is not None:
            dtypes = dtypes | {DType.BFLOAT16}
        return super().register(dataclasses.replace(
            variant, fn=widened(variant.op, variant.fn), dtypes=dtypes,
            bind=None if variant.bind is None else _float_bind(variant.bind),
            prepack=None if variant.prepack is None else _widened_prepack(variant.prepack)))
