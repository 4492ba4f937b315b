"""MatMul, Gemm, Dot, Conv and Attention as tiled WGSL kernels.

The matmul shader works on TILE x TILE tiles of A and B staged in workgroup
memory, reads A, B and the bias through their strides (a transposed weight, a
broadcast batch, a Gemm C of shape (N,) are read in place) and applies
``alpha``, ``beta * C`` and the fused activation before its one store.

Conv runs either as an implicit GEMM (the input patches gathered into the
workgroup tile as they are needed, no im2col buffer) or directly, one
invocation per output (depthwise and tiny convs); the planner picks. Both fuse
the bias, the residual Z and the activation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from keel.backends.base import Attrs, Inputs, KernelContext, KernelTable, Out, optional_input
from keel.backends.webgpu import wgsl
from keel.backends.webgpu.array import WgpuArray
from keel.backends.webgpu.elementwise import broadcast_shape, elementwise
from keel.backends.webgpu.layers import softmax_last
from keel.backends.webgpu.ops import (
    Params,
    broadcast_strides,
    contiguous,
    groups_for,
    launch,
    lifted,
    out_array,
    scalar_type,
)
from keel.errors import InvalidArgumentError
from keel.ops.epilogue import resolve_activation
from keel.ops.registry import Op
from keel.ops.schemas.conv import check_conv_extras, conv2d_attrs, conv_geometry
from keel.ops.schemas.matmul import (
    attention_shape,
    check_bias,
    dot_shape,
    gemm_shape,
    matmul_shape,
)
from keel.ops.schemas.shape import static_dims

__all__ = ["conv_nchw", "matmul_strided", "register"]

_BATCH_DIMS = 4          # batch dims the matmul shader indexes


def _act(attrs: Attrs) -> str:
    name, params = resolve_activation(attrs.get("activation", "") or "",
                                      attrs.get("activation_params", ()) or ())
    return wgsl.activation(name, params)


def _same_dtype(op: Op, *xs: WgpuArray | None) -> None:
    dts = {x.dtype for x in xs if x is not None}
    if len(dts) > 1:
        raise InvalidArgumentError(f"{op.value} needs inputs of one dtype, got "
                                   f"{', '.join(sorted(str(d) for d in dts))}")


def matmul_strided(a: WgpuArray, b: WgpuArray, c: WgpuArray | None = None, *,
                   alpha: float = 1.0, beta: float = 1.0, act: str = "x",
                   out: Out = None) -> WgpuArray:
    """``act(alpha * a @ b + beta * c)`` with NumPy matmul broadcasting over the batch
    dims of ``a`` and ``b`` (both of rank >= 2) and ``c`` broadcast to the result."""
    t = scalar_type(a.dtype)
    batch = broadcast_shape(a.shape[:-2], b.shape[:-2])
    if len(batch) > _BATCH_DIMS:
        raise InvalidArgumentError(f"webgpu matmul takes at most {_BATCH_DIMS} batch dims, "
                                   f"got {len(batch)}")
    m, k = a.shape[-2:]
    n = b.shape[-1]
    shape = (*batch, m, n)
    y = out_array(a.storage.device, out, 0, shape, a.dtype)
    if y.size == 0:
        return y
    sa = broadcast_strides(a, (*batch, m, k))
    sb = broadcast_strides(b, (*batch, k, n))
    sc = broadcast_strides(c, shape) if c is not None else [0] * len(shape)
    pad = _BATCH_DIMS - len(batch)
    nb = math.prod(batch)
    params = (Params().u(m, n, k, y.offset, a.offset, sa[-2], sa[-1], b.offset, sb[-2], sb[-1],
                         0 if c is None else c.offset, sc[-2], sc[-1]).f(alpha, beta)
              .u(nb).u(*([1] * pad + list(batch)))
              .u(*([0] * pad + sa[:-2])).u(*([0] * pad + sb[:-2])).u(*([0] * pad + sc[:-2])))
    if nb > wgsl.MAX_GROUPS:
        raise InvalidArgumentError(f"webgpu matmul: batch {nb} exceeds {wgsl.MAX_GROUPS}")
    arrays = [y, a, b] + ([c] if c is not None else [])
    groups = (-(-n // wgsl.TILE), -(-m // wgsl.TILE), nb)
    launch(wgsl.matmul(t, act, c is not None), arrays, params, groups, [y])
    return y


def _matmul(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    a, b, bias = inputs[0], inputs[1], optional_input(inputs, 2)
    _same_dtype(Op.MATMUL, a, b, bias)
    shape = matmul_shape(a.shape, b.shape)
    if bias is not None:
        check_bias(Op.MATMUL, shape, bias.shape)
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    y = matmul_strided(a2, b2, bias, act=_act(attrs))
    return [_reshaped(y, static_dims(shape), out)]


def _reshaped(y: WgpuArray, shape: tuple[int, ...], out: Out) -> WgpuArray:
    if y.shape == shape:
        return y
    flat = y.reshape(shape)
    dst = out_array(y.storage.device, out, 0, shape, y.dtype)
    dst[...] = flat
    return dst


def _gemm(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    a, b, c = inputs[0], inputs[1], optional_input(inputs, 2)
    _same_dtype(Op.GEMM, a, b, c)
    shape = gemm_shape(a.shape, b.shape, attrs["trans_a"], attrs["trans_b"])
    if c is not None:
        check_bias(Op.GEMM, shape, c.shape, "C")
    wa = a.T if attrs["trans_a"] else a
    wb = b.T if attrs["trans_b"] else b
    return [matmul_strided(wa, wb, c, alpha=float(attrs["alpha"]), beta=float(attrs["beta"]),
                           act=_act(attrs), out=out)]


def _dot(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    a, b = inputs
    _same_dtype(Op.DOT, a, b)
    shape = static_dims(dot_shape(a.shape, b.shape))
    if a.ndim == 0 or b.ndim == 0:
        return [elementwise("a * b", [a, b], (), out)]
    a2 = a.reshape(-1, a.shape[-1]) if a.ndim != 1 else a[None, :]
    if b.ndim == 1:
        b2 = b[:, None]
    else:          # (..., K, N) -> (K, ... * N): numpy.dot contracts b's second-to-last axis
        order = (b.ndim - 2, *range(b.ndim - 2), b.ndim - 1)
        b2 = contiguous(b.transpose(order)).reshape(b.shape[-2], -1)
    y = matmul_strided(a2, b2)
    return [_reshaped(y, shape, out)]


def conv_nchw(x: WgpuArray, w: WgpuArray, b: WgpuArray | None, z: WgpuArray | None,
              geo: Any, act: str, direct: bool, out: Out = None) -> WgpuArray:
    """One 1-D, 2-D or 3-D convolution (``geo`` from ``conv_geometry``) with its fused
    epilogue: ``direct`` runs one invocation per output, else the implicit GEMM (1-D and
    2-D windows only)."""
    t = scalar_type(x.dtype)
    xc, wc = contiguous(x), contiguous(w)
    bc = None if b is None else contiguous(b)
    zc = None if z is None else contiguous(z)
    y = out_array(x.storage.device, out, 0, geo.out_shape, x.dtype)
    if y.size == 0:
        return y
    win = lifted(geo.window, 3 if direct else 2, "direct conv" if direct
                 else "implicit-GEMM conv (the planner runs 3-D convs direct)")
    n, c, m = geo.batch, geo.in_channels, geo.out_channels
    params = Params().u(n, c, *win.in_spatial, m, *win.out_spatial, *win.kernel, *win.strides,
                        *win.pads_begin, *win.dilations, geo.group, xc.offset, wc.offset,
                        0 if bc is None else bc.offset, 0 if zc is None else zc.offset,
                        y.offset)
    arrays = [y, xc, wc] + ([bc] if bc is not None else []) + ([zc] if zc is not None else [])
    if direct:
        source = wgsl.conv_direct(t, act, bc is not None, zc is not None)
        launch(source, arrays, params, groups_for(y.size), [y])
    else:
        source = wgsl.conv_gemm(t, act, bc is not None, zc is not None)
        oh, ow = win.out_spatial
        groups = (-(-(n * oh * ow) // wgsl.TILE), -(-(m // geo.group) // wgsl.TILE), geo.group)
        launch(source, arrays, params, groups, [y])
    return y


def _conv_with(direct: bool | None) -> Any:
    """A conv kernel: the implicit GEMM, the direct form, or (None) the form the plan
    names (the planner decides; an op-level call gets a plan from the real shapes)."""
    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        run_direct = direct if direct is not None else (
            ctx.plan is not None and ctx.plan.variant == "direct")
        x, w = inputs[0], inputs[1]
        b, z = optional_input(inputs, 2), optional_input(inputs, 3)
        _same_dtype(Op.CONV, x, w, b, z)
        geo = conv_geometry(Op.CONV, x.shape, w.shape, attrs)
        check_conv_extras(Op.CONV, geo.out_shape, None if b is None else b.shape,
                          None if z is None else z.shape)
        return [conv_nchw(x, w, b, z, geo, _act(attrs), run_direct, out)]
    return kernel


def _conv2d(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    x, w = inputs
    _same_dtype(Op.CONV2D, x, w)
    if x.ndim != 4:
        raise InvalidArgumentError(f"conv2d: X must be (N, C, H, W), got shape {x.shape}")
    geo = conv_geometry(Op.CONV2D, x.shape, w.shape, conv2d_attrs(attrs))
    return [conv_nchw(x, w, None, None, geo, "x", False, out)]


def _attention(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
    q, k, v, mask = inputs[0], inputs[1], inputs[2], optional_input(inputs, 3)
    _same_dtype(Op.ATTENTION, q, k, v)
    attention_shape(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    boolean = mask if mask is not None and mask.dtype.kind == "b" else None
    additive = mask if boolean is None else None
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    kt = k.transpose((*range(k.ndim - 2), k.ndim - 1, k.ndim - 2))
    scores = matmul_strided(q, kt, additive, alpha=float(scale), beta=1.0)
    if attrs["is_causal"] or boolean is not None:
        _mask_scores(scores, bool(attrs["is_causal"]), boolean)
    weights = softmax_last(scores)
    return [matmul_strided(weights, v, out=out)]


def _mask_scores(scores: WgpuArray, causal: bool, boolean: WgpuArray | None) -> None:
    """Mask contiguous ``scores`` in place: keys after their query (``causal``) and keys
    where ``boolean`` (broadcast to the scores) is false."""
    s, t = scores.shape[-2:]
    params = Params().u(scores.size, s, t, scores.offset)
    arrays = [scores]
    if boolean is not None:
        params.u(boolean.offset).dims(scores.shape, 1).dims(
            broadcast_strides(boolean, scores.shape), 0)
        arrays.append(boolean)
    launch(wgsl.mask_scores(scalar_type(scores.dtype), causal, boolean is not None), arrays,
           params, groups_for(scores.size), [scores])


def register(table: KernelTable, float_dtypes: Sequence[str]) -> None:
    table.kernel(Op.MATMUL, dtypes=float_dtypes, supports_out=True,
                 description="WGSL tiled matmul (workgroup memory), fused bias/activation"
                 )(_matmul)
    table.kernel(Op.GEMM, dtypes=float_dtypes, supports_out=True,
                 description="WGSL tiled gemm, transposes read in place, fused epilogue")(_gemm)
    table.kernel(Op.DOT, dtypes=float_dtypes, supports_out=True,
                 description="numpy.dot through the tiled matmul")(_dot)
    table.kernel(Op.CONV, variant="gemm", dtypes=float_dtypes, supports_out=True, priority=1,
                 description="WGSL implicit-GEMM 1-D/2-D conv with fused bias/residual/"
                             "activation"
                 )(_conv_with(direct=False))
    table.kernel(Op.CONV, variant="direct", dtypes=float_dtypes, supports_out=True,
                 description="WGSL direct 1-D/2-D/3-D conv, one invocation per output "
                             "(depthwise, 3-D)"
                 )(_conv_with(direct=True))
    table.kernel(Op.CONV, dtypes=float_dtypes, supports_out=True, dispatcher=True,
                 description="runs the form webgpu's planner picks (gemm or direct)"
                 )(_conv_with(direct=None))
    table.kernel(Op.CONV2D, dtypes=float_dtypes, supports_out=True,
                 description="seed 001 conv2d as a WGSL implicit GEMM")(_conv2d)
    table.kernel(Op.ATTENTION, dtypes=float_dtypes, supports_out=True,
                 description="softmax(Q K^T * scale + mask) V: two tiled matmuls, "
                             "causal/boolean masking in place and a row softmax")(_attention)
