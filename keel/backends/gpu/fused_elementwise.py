"""Elementwise kernels of the gpu backend: the activations of ``keel.ops.epilogue`` as
one CuPy ``ElementwiseKernel`` each, the unary activation ops on them, and the fused
epilogue ``act(alpha * y + beta * c)`` that GEMM, MatMul and attention run after
cuBLAS in one pass.

Each activation is computed in float32 (float16 inputs are widened and the result
rounded once) with the same formulas as the reference: GELU through ``erfc`` (no
cancellation for negative inputs), NaN passed through by every clamp. A kernel is
built once per activation and form; CuPy compiles it once per dtype and launches it
on the current stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keel.backends.base import Attrs, Inputs, KernelContext, Out
from keel.backends.gpu import fused_cuda as cu
from keel.backends.gpu.kernels import TABLE
from keel.ops.epilogue import resolve_activation
from keel.ops.registry import Op

__all__ = ["EXPRESSIONS", "apply_epilogue", "epilogue_of"]

_DTYPES = ("float16", "bfloat16", "float32")

# f(v, p0, p1) in float32 per activation name (keel.ops.epilogue's table).
EXPRESSIONS: dict[str, str] = {
    "": "v",
    "relu": "v < 0.f ? 0.f : v",
    "leaky_relu": "v >= 0.f ? v : p0 * v",
    "sigmoid": "1.f / (1.f + expf(-v))",
    "tanh": "tanhf(v)",
    "clip": "v < p0 ? p0 : (v > p1 ? p1 : v)",
    "hard_sigmoid": "keel_unit(p0 * v + p1)",
    "hard_swish": "v * keel_unit(v / 6.f + 0.5f)",
    "gelu": "0.5f * v * erfcf(-v * 0.7071067811865476f)",
    "gelu_tanh": "0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)))",
    "silu": "v / (1.f + expf(-v))",
}

_PREAMBLE = """
__device__ __forceinline__ float keel_unit(float t) { return t < 0.f ? 0.f : (t > 1.f ? 1.f : t); }
__device__ __forceinline__ float keel_act(float v, float p0, float p1) { return %s; }
"""

# Forms: (input params, output params, operation).
_FORMS: dict[str, tuple[str, str, str]] = {
    # y = act(x)
    "unary": ("T x, float32 p0, float32 p1", "T y", "y = (T)keel_act((float)x, p0, p1)"),
    # y = act(alpha * y)
    "scale": ("float32 alpha, float32 p0, float32 p1", "T y",
              "y = (T)keel_act(alpha * (float)y, p0, p1)"),
    # y = act(alpha * y + beta * c), c broadcast to y
    "addend": ("T c, float32 alpha, float32 beta, float32 p0, float32 p1", "T y",
               "y = (T)keel_act(alpha * (float)y + beta * (float)c, p0, p1)"),
}

def _kernel(cp: Any, activation: str, form: str) -> Any:
    ins, outs, body = _FORMS[form]
    return cu.cached((id(cp), "elementwise", activation, form), lambda: cp.ElementwiseKernel(
        ins, outs, body, f"keel_{form}_{activation or 'identity'}",
        preamble=_PREAMBLE % EXPRESSIONS[activation]))


def _params(p: Sequence[float]) -> tuple[float, float]:
    padded = (*p, 0.0, 0.0)
    return float(padded[0]), float(padded[1])


def epilogue_of(attrs: Attrs) -> tuple[str, tuple[float, ...]]:
    """The fused activation a node's attributes name, resolved (``""``: none)."""
    return resolve_activation(attrs.get("activation") or "",
                              tuple(attrs.get("activation_params") or ()))


def apply_epilogue(xp: Any, y: Any, activation: str, params: Sequence[float],
                   alpha: float = 1.0, addend: Any = None, beta: float = 1.0) -> None:
    """``y = act(alpha * y + beta * addend)`` in place, one pass (nothing when the
    whole epilogue is the identity)."""
    p0, p1 = _params(params)
    if addend is not None:
        _kernel(xp, activation, "addend")(addend, alpha, beta, p0, p1, y)
    elif activation or alpha != 1.0:
        _kernel(xp, activation, "scale")(alpha, p0, p1, y)


def run_activation(xp: Any, x: Any, y: Any, activation: str, params: Sequence[float]) -> None:
    """``y = act(x)`` elementwise (``y`` may be ``x``)."""
    p0, p1 = _params(params)
    _kernel(xp, activation, "unary")(x, p0, p1, y)


# Unary ops that are activations: op -> (activation name, its params) from the attributes.
_OPS: dict[Op, Any] = {
    Op.RELU: lambda a: ("relu", ()),
    Op.LEAKY_RELU: lambda a: ("leaky_relu", (a["alpha"],)),
    Op.SIGMOID: lambda a: ("sigmoid", ()),
    Op.TANH: lambda a: ("tanh", ()),
    Op.HARD_SIGMOID: lambda a: ("hard_sigmoid", (a["alpha"], a["beta"])),
    Op.HARD_SWISH: lambda a: ("hard_swish", ()),
    Op.GELU: lambda a: ("gelu_tanh" if a["approximate"] == "tanh" else "gelu", ()),
}


def _unary_kernel(op: Op) -> Any:
    form = _OPS[op]

    def kernel(ctx: KernelContext, inputs: Inputs, attrs: Attrs, out: Out) -> list[Any]:
        xp, x = ctx.xp, inputs[0]
        y = out[0] if out is not None else xp.empty(x.shape, dtype=x.dtype)
        name, params = form(attrs)
        run_activation(xp, x, y, name, params)
        return [y]
    kernel.__doc__ = f"{op.value} as one elementwise kernel, computed in float32."
    return kernel


for _op in _OPS:
    TABLE.kernel(_op, variant="fused", dtypes=_DTYPES, supports_out=True,
                 shapes="float16/bfloat16/float32, any shape", gpu=True)(_unary_kernel(_op))
